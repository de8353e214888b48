"""What every scenario shares: the server, fresh databases, worker processes,
figures and percentiles.

A scenario is a module with ``run(bench: Bench) -> list[Figure]``. It measures
belay and its baseline side by side, in the same run, on the same server;
the figure carries both and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from belay import schema

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Figure:
    """One measured figure, with the baseline it is read against."""

    section: str
    name: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    #: True when more is better (throughput), False when less is (latency).
    higher_is_better: bool = True
    #: The issue's target for this figure, in words ("≥ 0.5 of the ceiling").
    target: str | None = None
    met: bool | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """value / baseline_value (so > 1 means more than the baseline)."""
        if not self.baseline_value:
            return None
        return self.value / self.baseline_value


def arguments(prog: str, doc: str | None, quick: str, *, out: str) -> argparse.ArgumentParser:
    """A scenario's command line: ``--quick`` (its help says what it sizes
    down), ``--url`` (``BELAY_BENCH_URL``, else a private embedded server) and
    ``--out``; the module's docstring as the description."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--url", default=os.environ.get("BELAY_BENCH_URL"),
                        help="PostgreSQL server (default: a private embedded one)")
    parser.add_argument("--out", help=out)
    return parser


def timed_claims(claim: Callable[[datetime], Sequence[Any]], wanted: int, count: int,
                 warm: int) -> list[float]:
    """Milliseconds of each of ``count`` calls of ``claim(now)`` after ``warm``
    untimed ones; each must return ``wanted`` jobs."""
    timings = []
    for index in range(warm + count):
        started = time.perf_counter()
        jobs = claim(datetime.now(timezone.utc))
        elapsed = time.perf_counter() - started
        if len(jobs) != wanted:
            raise RuntimeError(f"a claim took {len(jobs)} jobs, not {wanted}")
        if index >= warm:
            timings.append(elapsed * 1000)
    return timings


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


class Bench:
    """The run: which server, how big, where databases come from."""

    def __init__(self, url: str, *, quick: bool, bin_dir: Path | None,
                 log: Any = None) -> None:
        self.url = url
        self.quick = quick
        self.bin_dir = bin_dir
        self._log = log
        self._names = itertools.count()
        self._template: str | None = None

    def log(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {message}", file=self._log or sys.stderr, flush=True)

    def size(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def tool(self, name: str) -> str | None:
        """A PostgreSQL client program (pgbench, psql): the server's own first."""
        if self.bin_dir is not None and (self.bin_dir / name).exists():
            return str(self.bin_dir / name)
        return shutil.which(name)

    def url_for(self, dbname: str) -> str:
        info = psycopg.conninfo.conninfo_to_dict(self.url)
        info["dbname"] = dbname
        return psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    def _ensure_template(self) -> str:
        if self._template is None:
            name = f"belay_bench_tpl_{os.getpid()}"
            with self._admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
                conn.execute(f'CREATE DATABASE "{name}"')
            with psycopg.connect(self.url_for(name), autocommit=True) as conn:
                schema.migrate(conn)
            self._template = name
        return self._template

    @contextlib.contextmanager
    def database(self, tag: str, *, belay_schema: bool = True) -> Iterator[str]:
        """A fresh database for one measurement (with belay's schema unless told
        otherwise); yields its URL and drops it afterwards."""
        name = f"belay_bench_{tag}_{os.getpid()}_{next(self._names)}"
        template = f' TEMPLATE "{self._ensure_template()}"' if belay_schema else ""
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"{template}')
        try:
            yield self.url_for(name)
        finally:
            with self._admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        if self._template is not None:
            with self._admin() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self._template}" WITH (FORCE)')
            self._template = None


# -- Processes --------------------------------------------------------------------------


class Proc:
    """A child Python process running one of bench's node modules. It prints
    ``ready`` on a line of its own once it serves; ``stop()`` sends SIGTERM."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None,
                 python: str | None = None) -> None:
        self.popen = subprocess.Popen(
            [python or sys.executable, "-m", module, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.popen.args!r} exited with {self.popen.wait()}")
            if line.strip() == "ready":
                return
        raise RuntimeError(f"{self.popen.args!r} not ready after {timeout}s")

    def stop(self, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


@contextlib.contextmanager
def processes(count: int, module: str, *args: str, **kwargs: Any) -> Iterator[list[Proc]]:
    """``count`` copies of a node module, all ready; stopped afterwards."""
    procs = [Proc(module, *args, **kwargs) for _ in range(count)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process (Linux /proc), else None."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a live process has used (Linux /proc), else None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def wait_for(conn: psycopg.Connection[Any], query: str, params: Any = None, *,
             timeout: float, interval: float = 0.005) -> float:
    """Poll ``query`` until it returns true; returns the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query, params).fetchone()
        if row is not None and row[0]:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{query!r} still false after {timeout}s")
        time.sleep(interval)
