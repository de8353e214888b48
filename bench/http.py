"""Enqueue over HTTP: ``POST /jobs`` to ``belay serve`` against the same
enqueue made in process with belay's client, same run, same thread counts.

The server is a real ``belay serve`` process (uvicorn) on loopback; each
client thread keeps one HTTP/1.1 connection alive. The ratio is what the
HTTP hop costs: parsing, validation, JSON both ways, a thread hand-off.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx2

from bench import enqueue
from bench.core import ROOT, Bench, Figure

SECTION = "http"
SERVING = re.compile(r"serving (http://[^/\s]+)/")


@contextlib.contextmanager
def _serve(url: str) -> Iterator[str]:
    """``belay serve`` on a free loopback port; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "belay", "serve", "--url", url, "--port", "0", "--no-workers"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = SERVING.search(line)
        if found is None:
            raise RuntimeError(f"belay serve did not start: {line!r} (exit {proc.poll()})")
        yield found[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _http_single(base: str) -> enqueue.Maker:
    def make(url: str, threads: int, stack: contextlib.ExitStack) -> enqueue.Body:
        def body(index: int, rows: range, ready: Callable[[], object]) -> None:
            with httpx2.Client(base_url=base, timeout=30) as http:
                ready()
                for n in rows:
                    reply = http.post("/jobs", json={"task": "noop", "args": {"i": n}})
                    if reply.status_code != 201:
                        raise RuntimeError(f"POST /jobs: {reply.status_code} {reply.text}")

        return body

    return make


def _rate(bench: Bench, tag: str, threads: int, rows: int) -> float:
    """rows/s through a server on a fresh database, after an untimed warm-up."""
    with bench.database(f"http_{tag}") as url, _serve(url) as base, \
            contextlib.ExitStack() as stack:
        run = _http_single(base)(url, threads, stack)
        enqueue._timed(threads, enqueue.WARM * threads, run)
        elapsed = enqueue._timed(threads, rows, run)
    rate = rows // threads * threads / elapsed
    bench.log(f"http {tag}: {rate:,.0f} jobs/s")
    return rate


def run(bench: Bench) -> list[Figure]:
    rows = bench.size(500, 5_000)
    threads = enqueue.THREADS
    rates = {
        "http_seq": _rate(bench, "seq", 1, rows),
        "client_seq": enqueue._rate(bench, "belay_seq", 1, rows, enqueue._belay_single),
        "http_threads": _rate(bench, "threads", threads, rows),
        "client_threads": enqueue._rate(bench, "belay_threads", threads, rows,
                                        enqueue._belay_single),
    }
    note = "one keep-alive connection per client thread, 201 checked on every reply"
    return [
        Figure(SECTION, "POST /jobs to belay serve, sequential", rates["http_seq"], "jobs/s",
               baseline="belay enqueue in process, sequential",
               baseline_value=rates["client_seq"], note=note, extra={"rows": rows}),
        Figure(SECTION, f"POST /jobs to belay serve, {threads} client threads",
               rates["http_threads"], "jobs/s",
               baseline=f"belay enqueue in process, {threads} threads",
               baseline_value=rates["client_threads"], note=note, extra={"rows": rows}),
    ]
