"""Dispatch latency across processes: from enqueue to the result in the producer's hands.

One job at a time through one worker process, woken by LISTEN/NOTIFY and
polling-only, read against the raw-psycopg floor measured in the same run: the
same round trip with nothing but SQL (a producer here and a tiny worker of this
module's own, ``python -m bench.latency raw-worker --url URL``). Then bursts of
100 jobs at once.
"""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import belay
from bench.core import Bench, Figure, median, percentile, processes

SECTION = "latency"
PERCENTILES = (50, 90, 99)
#: The reference's published figures (ms) and the issue's targets (ms).
REFERENCE = {"notify": {50: 11.0, 99: 24.5}, "polling": {50: 49.4}}
TARGETS = {"notify": {50: 5.0, 99: 15.0}, "polling": {50: 30.0}}
#: belay notify p50 at most this many times the raw floor's p50.
FLOOR_TARGET = 1.5
#: DESIGN's estimate of the raw floor (ms).
DESIGN_FLOOR = {50: 2.0, 99: 5.0}
BURST = 100
BURST_REFERENCE = (336.0, 371.0)
BURST_TARGET = 150.0
#: Before each sample, a random pause up to this long (s), so samples don't
#: fall into step with a poll interval.
GAP = 0.020
WARMUP = 5

SAMPLE_NOTE = (
    "From just before enqueue() to the moment the producer holds the result "
    "(await_result() returned it; raw: the result notification arrived after the "
    "fenced ack committed), one job at a time with a random 0 to 20 ms pause before "
    "each, worker in another process. extra.claim_ms/done_ms are the worker's own "
    "started_at/finished_at stamps minus the enqueue wall time (same host clock): "
    "where the time goes before the result's way back."
)

# -- The raw floor: plain SQL, a LISTEN-woken worker, a notified producer --------------

RAW_SCHEMA = """
CREATE TABLE raw_jobs (
  id bigserial PRIMARY KEY,
  state text NOT NULL DEFAULT 'ready',
  attempt int NOT NULL DEFAULT 0,
  input jsonb NOT NULL,
  result jsonb,
  lease_until timestamptz
);
CREATE INDEX raw_jobs_ready ON raw_jobs (id) WHERE state = 'ready'
"""
RAW_INSERT = """
WITH job AS (INSERT INTO raw_jobs (input) VALUES (%s) RETURNING id)
SELECT id, pg_notify('raw_jobs', '') FROM job
"""
RAW_CLAIM = """
UPDATE raw_jobs SET state = 'running', attempt = attempt + 1,
  lease_until = now() + interval '30 seconds'
WHERE id = (SELECT id FROM raw_jobs WHERE state = 'ready' ORDER BY id LIMIT 1
            FOR UPDATE SKIP LOCKED)
RETURNING id, attempt, input
"""
RAW_ACK = """
WITH done AS (
  UPDATE raw_jobs SET state = 'succeeded', result = %s, lease_until = NULL
  WHERE id = %s AND attempt = %s AND state = 'running' RETURNING id
)
SELECT pg_notify('raw_results', id::text) FROM done
"""


def raw_worker(url: str) -> None:
    """Claim whatever is ready each time a poke arrives (or every 0.2 s), and ack
    each job fenced on its attempt with its result notification."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with psycopg.connect(url, autocommit=True) as work, \
            psycopg.connect(url, autocommit=True) as listen:
        listen.execute("LISTEN raw_jobs")
        print("ready", flush=True)
        while not stop.is_set():
            while (row := work.execute(RAW_CLAIM).fetchone()) is not None:
                job_id, attempt, payload = row
                work.execute(RAW_ACK, (Jsonb(payload), job_id, attempt))
            for _ in listen.notifies(timeout=0.2, stop_after=1):
                pass


def _raw_samples(bench: Bench, count: int, rng: random.Random) -> list[float]:
    with bench.database("latency_raw", belay_schema=False) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(RAW_SCHEMA)
        with processes(1, "bench.latency", "raw-worker", "--url", url), \
                psycopg.connect(url, autocommit=True) as conn, \
                psycopg.connect(url, autocommit=True) as listen:
            listen.execute("LISTEN raw_results")

            def once(i: int) -> float:
                start = time.perf_counter()
                row = conn.execute(RAW_INSERT, (Jsonb({"i": i}),)).fetchone()
                assert row is not None
                for note in listen.notifies(timeout=10):
                    if note.payload == str(row[0]):
                        return time.perf_counter() - start
                raise TimeoutError(f"raw job {row[0]}: no result notification in 10 s")

            return _sample(once, count, rng)


# -- belay ---------------------------------------------------------------------------


def _belay_samples(bench: Bench, count: int, rng: random.Random, *,
                   notify: bool) -> tuple[list[float], dict[str, Any]]:
    """Latencies (s) and, in ``extra``, where the time went."""
    with bench.database("latency_notify" if notify else "latency_poll") as url:
        args = ["--url", url, "--queue", "default=10", *(["--notify"] if notify else [])]
        with processes(1, "bench.belay_node", *args), belay.Belay(url, notify=notify) as client:
            stamps: list[tuple[int, float, float]] = []

            def once(i: int) -> float:
                payload = {"i": i}
                wall, start = time.time(), time.perf_counter()
                job = client.enqueue("echo", payload)
                enqueued = time.perf_counter()
                result = client.await_result(job.id, timeout=30)
                took = time.perf_counter() - start
                if result != payload:
                    raise RuntimeError(f"job {job.id}: echo returned {result!r}")
                stamps.append((job.id, wall, enqueued - start))
                return took

            latencies = _sample(once, count, rng)
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT id, extract(epoch FROM started_at)::float8,"
                " extract(epoch FROM finished_at)::float8"
                " FROM belay_jobs WHERE id = ANY(%s)",
                ([s[0] for s in stamps[WARMUP:]],),
            ).fetchall()
    walls = {job_id: wall for job_id, wall, _ in stamps}
    extra = {
        "enqueue_ms": _summary([s[2] * 1000 for s in stamps[WARMUP:]]),
        "claim_ms": _summary([(started - walls[i]) * 1000 for i, started, _ in rows]),
        "done_ms": _summary([(finished - walls[i]) * 1000 for i, _, finished in rows]),
    }
    return latencies, extra


def _burst_times(bench: Bench, workers: int, reps: int, rng: random.Random) -> list[float]:
    """Seconds from enqueue_many() of 100 echo jobs until await_result() has
    returned every one of them (awaited in id order)."""
    with bench.database("latency_burst") as url, \
            processes(workers, "bench.belay_node", "--url", url, "--queue", "default=10",
                      "--notify"), \
            belay.Belay(url) as client:
        for i in range(WARMUP):
            client.await_result(client.enqueue("echo", {"i": i}).id, timeout=30)
        times = []
        for _ in range(reps):
            specs = [{"kind": "echo", "input": {"i": i}} for i in range(BURST)]
            start = time.perf_counter()
            jobs = client.enqueue_many(specs)
            for job in jobs:
                client.await_result(job.id, timeout=60)
            times.append(time.perf_counter() - start)
            time.sleep(rng.uniform(0.05, 0.15))
        return times


# -- Sampling and figures -------------------------------------------------------------


def _sample(once: Callable[[int], float], count: int, rng: random.Random) -> list[float]:
    """``count`` timed calls after ``WARMUP`` untimed ones, each after a random gap."""
    timed = []
    for i in range(WARMUP + count):
        time.sleep(rng.uniform(0, GAP))
        timed.append(once(i))
    return timed[WARMUP:]


def _summary(values_ms: list[float]) -> dict[str, float]:
    return {f"p{p}": round(percentile(values_ms, p), 2) for p in PERCENTILES}


def _percentile_figures(variant: str, label: str, latencies: list[float],
                        floor: list[float] | None, extra: dict[str, Any]) -> list[Figure]:
    values = [s * 1000 for s in latencies]
    floor_ms = None if floor is None else [s * 1000 for s in floor]
    figures = []
    for p in PERCENTILES:
        value = percentile(values, p)
        target = TARGETS.get(variant, {}).get(p)
        if variant == "raw":
            baseline, baseline_value = "DESIGN estimate", DESIGN_FLOOR.get(p)
        elif p in REFERENCE.get(variant, {}):
            baseline, baseline_value = "reference (published)", REFERENCE[variant][p]
        else:
            assert floor_ms is not None
            baseline, baseline_value = "raw psycopg floor (this run)", percentile(floor_ms, p)
        figure_extra = {"samples": len(values), **extra}
        if floor_ms is not None:
            figure_extra["floor_ms"] = round(percentile(floor_ms, p), 2)
        figures.append(Figure(
            SECTION, f"{label} p{p}", value, "ms",
            baseline=None if baseline_value is None else baseline,
            baseline_value=baseline_value, higher_is_better=False,
            target=None if target is None else f"≤ {target:g} ms",
            met=None if target is None else value <= target,
            note=SAMPLE_NOTE, extra=figure_extra,
        ))
    return figures


def _floor_figure(latencies: list[float], floor: list[float]) -> Figure:
    """belay notify p50 against the raw floor of the same run (the target is a ratio)."""
    value, base = percentile(latencies, 50) * 1000, percentile(floor, 50) * 1000
    return Figure(
        SECTION, "belay notify p50 against the raw floor", value, "ms",
        baseline="raw psycopg floor p50 (this run)", baseline_value=base,
        higher_is_better=False, target=f"≤ {FLOOR_TARGET:g}x the floor",
        met=value <= FLOOR_TARGET * base, note="as above",
    )


def _burst_figure(workers: int, times: list[float]) -> Figure:
    value = median(times) * 1000
    low, high = BURST_REFERENCE
    return Figure(
        SECTION, f"{BURST}-job burst, {workers} worker process{'es' if workers > 1 else ''}",
        value, "ms", baseline=f"reference (published {low:g} to {high:g} ms)",
        baseline_value=(low + high) / 2, higher_is_better=False,
        target=f"≤ {BURST_TARGET:g} ms", met=value <= BURST_TARGET,
        note=(f"Median over repetitions: enqueue_many() of {BURST} echo jobs until "
              "await_result() has returned each of them (awaited in id order); workers "
              "--notify, queue default=10 each."),
        extra={"repetitions_ms": [round(t * 1000, 1) for t in times]},
    )


def run(bench: Bench) -> list[Figure]:
    count = bench.size(200, 2_000)
    rng = random.Random(20240501)
    bench.log(f"latency: raw psycopg floor, {count} samples")
    floor = _raw_samples(bench, count, rng)
    figures = _percentile_figures("raw", "raw psycopg floor", floor, None, {})
    for notify in (True, False):
        variant = "notify" if notify else "polling"
        bench.log(f"latency: belay {variant}, {count} samples")
        latencies, extra = _belay_samples(bench, count, rng, notify=notify)
        label = "belay notify" if notify else "belay polling (poll_interval 0.5 s)"
        figures += _percentile_figures(variant, label, latencies, floor, extra)
        if notify:
            figures.append(_floor_figure(latencies, floor))
    reps = bench.size(5, 20)
    for workers in (1, 2):
        bench.log(f"latency: {BURST}-job bursts, {workers} worker process(es), {reps} times")
        figures.append(_burst_figure(workers, _burst_times(bench, workers, reps, rng)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.latency")
    parser.add_argument("role", choices=["raw-worker"])
    parser.add_argument("--url", required=True)
    args = parser.parse_args()
    raw_worker(args.url)


if __name__ == "__main__":
    main()
