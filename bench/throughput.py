"""Throughput: belay's burn-down and sustained rates, worker memory.

Burn-down: N no-op jobs enqueued first, then 1 or 2 worker processes start;
the rate is N over the span from the first job's ``started_at`` to the last
one's ``finished_at``, read from the database, so process start-up is not
counted (nor is it for the raw ceiling, which pgbench times the same way).

Sustained: the queue is filled for longer than the window, two workers run,
and the rate counts the jobs finished inside a window that opens once they
are warm. Worker RSS is sampled every half second meanwhile.
"""

from __future__ import annotations

import time

import psycopg

import belay
from bench.core import Bench, Figure, cpu_seconds, median, processes, rss_bytes
from bench.scale import FILL

#: Local slots per worker process: a claim takes up to this many jobs.
LIMIT = 100


def fill(url: str, count: int, kind: str = "noop") -> None:
    client = belay.Belay(url, notify=False)
    for start in range(0, count, 5_000):
        client.enqueue_many([{"kind": kind, "input": {"n": n}}
                             for n in range(start, min(count, start + 5_000))])


DONE = "SELECT count(*) FROM belay_jobs WHERE state = 'succeeded'"


def burn_down(bench: Bench, count: int, procs: int, limit: int = LIMIT) -> tuple[float, float]:
    """(jobs/s, worker CPU µs per job) for ``count`` no-op jobs drained by
    ``procs`` worker processes. The CPU is the workers' user + system time
    from the moment each said ``ready`` (imports and start-up excluded) to
    the end of the drain, over the jobs finished in that time."""
    with bench.database("burn") as url:
        fill(url, count)
        with psycopg.connect(url, autocommit=True) as conn, processes(
                procs, "bench.belay_node", "--url", url, "--queue", f"default={limit}"
        ) as nodes:
            cpu_start = sum(cpu_seconds(n.pid) or 0.0 for n in nodes)
            done_start = conn.execute(DONE).fetchone()[0]  # type: ignore[index]
            deadline = time.monotonic() + 600
            while conn.execute("SELECT count(*) FROM belay_jobs WHERE state <> 'succeeded'"
                               ).fetchone()[0]:  # type: ignore[index]
                if time.monotonic() > deadline:
                    raise TimeoutError("burn-down did not finish in 10 minutes")
                time.sleep(0.05)
            cpu = sum(cpu_seconds(n.pid) or 0.0 for n in nodes) - cpu_start
            span = conn.execute(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM belay_jobs"
            ).fetchone()[0]  # type: ignore[index]
    return count / float(span), cpu / max(1, count - done_start) * 1e6


def sustained(bench: Bench, seconds: float, procs: int = 2) -> tuple[float, int]:
    """(jobs/s inside the window, peak worker RSS in bytes)."""
    warm = 2.0
    with bench.database("sustained") as url:
        # More than the window can take, so it never runs dry; filled in one
        # statement (the same rows enqueue_many writes), as the fill isn't timed.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(FILL, (bench.size(200_000, 1_000_000),))
        peak = 0
        with psycopg.connect(url, autocommit=True) as conn, processes(
                procs, "bench.belay_node", "--url", url, "--queue", f"default={LIMIT}") as nodes:
            start = time.monotonic()
            opened = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
            while time.monotonic() - start < warm + seconds:
                peak = max([peak, *(rss_bytes(n.pid) or 0 for n in nodes)])
                time.sleep(0.5)
            left = conn.execute("SELECT count(*) FROM belay_jobs WHERE state = 'ready'"
                                ).fetchone()[0]  # type: ignore[index]
            done = conn.execute(
                "SELECT count(*) FROM belay_jobs WHERE finished_at >= %s + "
                "make_interval(secs => %s) AND finished_at < %s + make_interval(secs => %s)",
                (opened, warm, opened, warm + seconds)).fetchone()[0]  # type: ignore[index]
        if not left:
            bench.log("sustained: the queue ran dry; the rate is a lower bound")
    return done / seconds, peak


def run(bench: Bench) -> list[Figure]:
    # As many as each peer drains (bench/peers.py), so rates compare like with like.
    count = bench.size(5_000, 20_000)
    repeats = bench.size(1, 3)
    figures: list[Figure] = []
    for procs in (1, 2):
        rates, cpus = [], []
        for _ in range(repeats):
            rate, cpu = burn_down(bench, count, procs)
            rates.append(rate)
            cpus.append(cpu)
            bench.log(f"belay burn-down, {procs} process(es): {rate:,.0f} jobs/s, "
                      f"worker CPU {cpu:.1f} µs/job")
        figures.append(Figure(
            "throughput", f"belay, burn-down of {count:,}, {procs} process(es)", median(rates),
            "jobs/s", note=f"queue limit {LIMIT} per process; median of {repeats}",
            extra={"system": "belay", "procs": procs, "runs": rates}))
        if procs == 1:
            figures.append(Figure(
                "throughput", "belay worker CPU per no-op job, 1 process", median(cpus), "µs",
                higher_is_better=False, target="≤ 25 µs", met=median(cpus) <= 25,
                note="user + system CPU of the worker process (every thread: claim, run, "
                     "ack; psycopg and libpq included) from `ready` to the end of the "
                     f"burn-down, per job finished meanwhile; median of {repeats}",
                extra={"runs": [round(c, 1) for c in cpus]}))
    seconds = bench.size(5, 30)
    rate, peak = sustained(bench, seconds)
    bench.log(f"belay sustained {seconds}s, 2 processes: {rate:,.0f} jobs/s, peak RSS "
              f"{peak / 2**20:.0f} MiB")
    figures.append(Figure("throughput", f"belay, sustained {seconds} s, 2 processes", rate,
                          "jobs/s", extra={"system": "belay", "procs": 2, "sustained": True}))
    figures.append(Figure("memory", "worker RSS, peak during the sustained run", peak / 2**20,
                          "MiB", higher_is_better=False,
                          note=f"each of 2 worker processes, {LIMIT} executor threads"))
    return figures
