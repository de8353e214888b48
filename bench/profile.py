"""The production profile: one worker configuration as a deployment runs it,
under an open-loop load of mixed jobs; the bench's headline.

The configuration (:func:`queue_options`), served by N = 2 and N = 4 worker
processes (``bench.belay_node --notify``; otherwise the worker's defaults,
default retention and ``sweep_interval`` 5 s included): ``q50`` (limit 50),
``q20`` (limit 20, partitioned by ``input.tenant`` with ``global_limit`` 2 per
tenant, :data:`TENANTS` tenants), ``q10`` (limit 10 and a ``rate`` per 1 s,
below), ``q4`` (4) and ``q2`` (2). Jobs go to the queues by weight
50:20:10:4:2 (their limits); each is a no-op (85 %), a sleep of 1 to 10 ms
(14 %, uniform) or of 100 ms (1 %), with a tenant drawn uniformly.

Each phase gets a fresh database whose ``belay_jobs`` is first filled by SQL
(:data:`FILL`; the secondary indexes dropped for the INSERT and built again,
then ``VACUUM ANALYZE`` and a ``CHECKPOINT``) with 1,000,000 finished jobs
(quick: 100,000) of the same queues and kinds, 97 % succeeded, 2 % failed,
1 % cancelled, finished evenly over the last 30 days: about 96 % are past the
default retention (succeeded 1 day, failed and cancelled 7), so from its first
pass, 5 s after it starts, each worker's sweeper prunes pass after pass
(``retention.PRUNE_PAUSE`` apart) until they are gone, as in a deployment
whose retention is catching up. Each phase starts its measurement with the
first prune batch (the oldest pre-filled row gone), so the pruning overlaps
it from its start; how long it lasts is up to the sweepers' pace (the extra
says how many rows went in the window, and for how many of its seconds
``n_tup_del``, sampled each second, grew; nothing else deletes here).

1. Capacity: the workers start; at the first prune batch, 30,000 mixed jobs
   (quick: 5,000) are enqueued in one transaction (``enqueue_many``); jobs/s
   from the first ``started_at`` to the last ``finished_at`` of those jobs.
   ``q10``'s rate is the backlog's size here: it costs its admission (the
   queue's advisory lock, the ``belay_rate`` window) but can't bind, since a
   closed-loop drain under a binding rate measures the rate. Baseline: the
   raw-SQL ceiling of the same run (:func:`bench.raw.raw_ceiling_jobs_per_s`);
   target ≥ 0.5x with 2 processes.
2. Open loop, on a second fresh database, at :data:`LOAD` (70 %) of that
   capacity: :data:`PRODUCERS` processes of :data:`THREADS` threads, each
   thread its own ``belay.Belay`` (one connection, ``notify=True``) calling
   plain ``client.enqueue`` on a Poisson schedule of its own; a late send goes
   at once (the extra counts what was due and unsent when they stopped, and
   the enqueue's own p50/p99). The 60 s window (quick: 10 s) opens at the
   first prune batch, at least :data:`MIN_WARM` s after the producers start;
   they stop when it closes. ``q10``'s rate is ``allowed`` =
   ``ceil(2 x RATE_HEADROOM x q10's share of the offered rate)`` per 1 s: the
   epoch in the contract's sliding window (§6) is whole seconds, so with a
   1 s period the previous second counts in full, any two consecutive seconds
   share ``allowed``, and a backlog drains at ``allowed / 2`` a second (seen
   here: a q10 backlog took 19, 65, 19, 65… jobs a second under ``allowed``
   84). So the rate sustains 1.2x q10's offered share and binds only on
   bunched arrivals (extra: its peak use of the allowance, the seconds it was
   capped, and each queue's p50/p99).
   Achieved: jobs finished in the window / its length (baseline: the offered
   rate; the extra has the rate really inserted). Insert → start p50 and p99:
   ``started_at - inserted_at`` (the client's clock before the INSERT, the
   worker's at the claim; one host) of every job inserted in the window, once
   each has started. CPU per job: user + system of the worker processes over
   the window (:func:`bench.core.cpu_seconds`) / jobs finished in it, beside
   the same over the capacity drain. The extra splits the machine's busy
   cores between the workers, the producers, the server's processes (every
   one of them, when it runs on this machine) and everything else, and gives
   the database's transactions per finished job (``pg_stat_database``).

The latency baseline is ``bench.latency``'s raw psycopg floor, measured in
this run (insert + ``pg_notify``, a LISTEN-woken claim, a fenced ack with a
result notification; one job at a time, no load): its round trip goes on to
the ack and back, so it is a generous floor for insert → start. Targets at
70 % load: p50 ≤ 1.5x the floor's p50, p99 ≤ 15 ms.

PgQueuer and Oban for Python are measured under the same profile in the same
run, as close as their features allow (``bench/profile_peers.py`` says how).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import psycopg

import belay
from bench import profile_meter as meter
from bench import profile_mix as mix
from bench import profile_peers
from bench.core import Bench, Figure, Proc, percentile, processes
from bench.latency import _raw_samples
from bench.profile_meter import XACTS, Meter, PruneWatch, cores, one, wait
from bench.profile_mix import TENANTS, WEIGHTS, Poisson, job
from bench.raw import raw_ceiling_jobs_per_s

SECTION = "profile"
PROCS = (2, 4)
LOAD = 0.7
#: The capacity drain's backlog: the same jobs for belay and the peers.
SEED = 20260101
#: Set to skip the peers (their figures are then left out, not NaN).
SKIP_PEERS = "BELAY_BENCH_PROFILE_NO_PEERS"
#: What q10's rate sustains, over q10's share of the offered rate.
RATE_HEADROOM = 1.2
#: The warm-up: until the sweepers' first prune batch (a worker's first pass
#: comes 5 s after it starts), at least MIN_WARM s, at most MAX_WARM s.
MIN_WARM = 3.0
MAX_WARM = 30.0
PRODUCERS = 2
THREADS = 8
#: Seconds the jobs inserted in the window may take to have all started.
SETTLE = 60.0
#: The worker's default retention (s): succeeded, and failed or cancelled.
KEEP = (86_400, 7 * 86_400)
DAYS = 30

#: Finished jobs of the profile's queues and kinds, oldest ids first,
#: finished evenly over the last DAYS days.
FILL = """
INSERT INTO belay_jobs (kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at, started_at, finished_at, errors)
SELECT CASE WHEN m < 85 THEN 'noop' ELSE 'sleep' END,
       CASE WHEN q < 50 THEN 'q50' WHEN q < 70 THEN 'q20' WHEN q < 80 THEN 'q10'
            WHEN q < 84 THEN 'q4' ELSE 'q2' END,
       st,
       CASE WHEN m < 85 THEN jsonb_build_object('tenant', 't' || (g %% %(tenants)s))
            ELSE jsonb_build_object('tenant', 't' || (g %% %(tenants)s), 'ms', 1 + m %% 10) END,
       '{}', 0, 1, 20, fin - interval '2 seconds', fin - interval '2 seconds',
       fin - interval '10 milliseconds', fin,
       CASE WHEN st = 'failed' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 1, 'kind', 'TimeoutError', 'message', 'upstream timed out'))
            WHEN st = 'cancelled' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 1, 'kind', 'cancelled', 'message', 'cancelled by an operator'))
            ELSE '[]'::jsonb END
FROM (
  SELECT g, (g::bigint * 7919) %% 86 AS q, (g::bigint * 104729) %% 100 AS m,
         CASE WHEN g %% 100 = 0 THEN 'cancelled' WHEN g %% 50 = 1 THEN 'failed'
              ELSE 'succeeded' END AS st,
         now() - (%(days)s * 86400.0 * (1 - g::float8 / %(rows)s)) * interval '1 second'
           AS fin
  FROM generate_series(1, %(rows)s) AS g
) AS t
"""
EXPIRED = """
SELECT count(*) FROM belay_jobs WHERE id <= %s AND finished_at < now()
  - CASE state WHEN 'succeeded' THEN %s ELSE %s END * interval '1 second'
"""
#: The oldest pre-filled row is gone: a sweeper's first prune batch took it.
GONE = "SELECT NOT EXISTS (SELECT FROM belay_jobs WHERE id = %s)"
WINDOW_JOBS = "FROM belay_jobs WHERE id > %s AND inserted_at >= %s AND inserted_at < %s"


def queue_options(rate: int) -> dict[str, Any]:
    """Each worker's queues, ``q10``'s rate ``rate`` per 1 s."""
    return {
        "q50": 50,
        "q20": {"limit": 20, "global_limit": 2, "partition": {"input": "tenant"}},
        "q10": {"limit": 10, "rate": {"allowed": rate, "period": 1}},
        "q4": 4,
        "q2": 2,
    }


def describe(rate: int, prefill: int) -> str:
    return (f"each process: q50=50, q20={{limit 20, global_limit 2, partition input.tenant}} "
            f"({TENANTS} tenants), q10={{limit 10, rate {rate:,}/1 s}}, q4=4, q2=2, notify "
            "on; jobs by queue 50:20:10:4:2, 85 % no-op, 14 % sleep 1-10 ms, 1 % sleep 100 "
            f"ms; {prefill:,} finished rows pre-filled, ~96 % past the default retention")


# -- The database and the workers ---------------------------------------------------------


def fill(bench: Bench, conn: psycopg.Connection[Any], rows: int) -> tuple[int, int]:
    """Pre-fill ``rows`` finished jobs; returns their lowest and highest ids
    (the phase's own jobs come after)."""
    meter.fill(conn, "belay_jobs", FILL, {"rows": rows, "days": DAYS, "tenants": TENANTS},
               bench.log)
    low, high = conn.execute("SELECT min(id), max(id) FROM belay_jobs").fetchone() or (0, 0)
    return int(low), int(high)


def _left(conn: psycopg.Connection[Any], top: int) -> int:
    return int(one(conn, "SELECT count(*) FROM belay_jobs WHERE id <= %s", (top,)))


@contextlib.contextmanager
def workers(url: str, count: int, rate: int) -> Iterator[list[Proc]]:
    args = ["--url", url, "--notify"]
    for name, options in queue_options(rate).items():
        args += ["--queue", f"{name}={json.dumps(options)}"]
    with processes(count, "bench.belay_node", *args) as nodes:
        yield nodes


# -- Capacity: a closed-loop drain ------------------------------------------------------


def capacity(bench: Bench, procs: int, backlog: int, prefill: int) -> dict[str, Any]:
    """Jobs/s of ``procs`` workers draining ``backlog`` mixed jobs, with what it cost."""
    specs = mix.backlog(backlog, SEED + procs)
    with bench.database("profile_cap") as url, psycopg.connect(url, autocommit=True) as conn:
        first, top = fill(bench, conn, prefill)
        gauge = Meter(conn)
        with workers(url, procs, backlog) as nodes, belay.Belay(url, max_pool_size=1) as client:
            # In once a sweeper has begun (its first batch takes the oldest row).
            if not wait(conn, GONE, (first,), MAX_WARM):
                bench.log(f"profile: no prune pass {MAX_WARM:g} s after the workers started")
            left, xacts = _left(conn, top), int(one(conn, XACTS))
            before, started = gauge.read(nodes, []), time.monotonic()
            with conn.transaction():
                for start in range(0, backlog, 5_000):
                    client.enqueue_many(specs[start:start + 5_000], conn=conn)
            if not wait(conn, "SELECT count(*) = %s FROM belay_jobs WHERE id > %s AND "
                               "state = 'succeeded'", (backlog, top), 600):
                raise TimeoutError(f"the capacity drain did not finish in 600 s ({procs} procs)")
            elapsed, after = time.monotonic() - started, gauge.read(nodes, [])
            pruned = left - _left(conn, top)
            time.sleep(1.0)  # the server flushes its counters at most once a second
            xacts = int(one(conn, XACTS)) - xacts
            count, span = conn.execute(
                "SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at))::float8 "
                "FROM belay_jobs WHERE id > %s", (top,)).fetchone() or (0, 0.0)
    result = {"jobs_per_s": count / span, "jobs": count, "span_s": round(span, 3),
              "cpu_us_per_job": (after["workers"] - before["workers"]) / count * 1e6,
              "cores": cores(before, after, elapsed), "xacts_per_job": round(xacts / count, 2),
              "pruned_during_drain": pruned}
    bench.log(f"profile capacity, {procs} processes: {result}")
    return result


# -- The open loop --------------------------------------------------------------------------


def _producer_thread(url: str, rate: float, seed: int, start: Any, stop: Any,
                     out: list[tuple[int, int, int, list[float]]]) -> None:
    """A Poisson stream of ``rate`` enqueues/s from the ``start`` barrier until
    ``stop`` is set: a late send goes at once; what is due and unsent at the
    stop is counted. Keeps each enqueue's own time."""
    rng = random.Random(seed)
    sent = errors = 0
    took: list[float] = []
    with belay.Belay(url, min_pool_size=1, max_pool_size=1) as client:
        with client.connection() as conn:  # connected before the clock starts
            conn.execute("SELECT 1")
        start.wait(timeout=120)
        stream = Poisson(rate, rng, time.monotonic())
        while not stop.wait(max(0.0, stream.due - time.monotonic())):
            spec, called = job(rng), time.monotonic()
            try:
                client.enqueue(spec["kind"], spec["input"], queue=spec["queue"])
                sent += 1
            except psycopg.Error:
                errors += 1
            took.append(time.monotonic() - called)
            stream.advance()
        unsent = stream.unsent(time.monotonic())
    out.append((sent, errors, unsent, took))


def produce(url: str, rate: float, seed: int, start: Any, stop: Any, results: Any) -> None:
    """One producer process: THREADS threads, each its own client (one
    connection) and a Poisson stream of ``rate`` / THREADS jobs/s."""
    out: list[tuple[int, int, int, list[float]]] = []
    pool = [threading.Thread(target=_producer_thread, args=(
        url, rate / THREADS, seed * 100 + i, start, stop, out)) for i in range(THREADS)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    took = [t * 1000 for o in out for t in o[3]] or [math.nan]
    results.put({"sent": sum(o[0] for o in out), "errors": sum(o[1] for o in out),
                 "due_unsent_at_stop": sum(o[2] for o in out),
                 "enqueue_p50_ms": round(percentile(took, 50), 2),
                 "enqueue_p99_ms": round(percentile(took, 99), 2)})


@contextlib.contextmanager
def producers(url: str, offered: float, seed: int) -> Iterator[tuple[list[int], Any, Any]]:
    """PRODUCERS processes offering ``offered`` jobs/s in all; yields, once all
    have connected and started, their pids, the queue their reports come back
    on, and the event that stops them."""
    context = multiprocessing.get_context("spawn")
    start, stop = context.Barrier(PRODUCERS * THREADS + 1), context.Event()
    results = context.Queue()
    procs = [context.Process(target=produce, args=(
        url, offered / PRODUCERS, seed * 10 + i, start, stop, results))
        for i in range(PRODUCERS)]
    try:
        for proc in procs:
            proc.start()
        start.wait(timeout=120)
        yield [proc.pid or 0 for proc in procs], results, stop
        for proc in procs:
            proc.join(timeout=60)
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _percentiles(latencies: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


def _window(conn: psycopg.Connection[Any], top: int, opened: float, closed: float,
            allowed: int) -> dict[str, Any]:
    """What the rows say of the jobs inserted in [opened, closed) (once all
    started, or SETTLE s passed), of those finished in it, and of q10's rate."""
    window = (top, datetime.fromtimestamp(opened, timezone.utc),
              datetime.fromtimestamp(closed, timezone.utc))
    wait(conn, f"SELECT count(*) = 0 {WINDOW_JOBS} AND state = 'ready'", window, SETTLE)
    by_queue: dict[str, list[float]] = {}
    for queue, ms in conn.execute(
            "SELECT queue, extract(epoch FROM started_at - inserted_at)::float8 * 1000 "
            f"{WINDOW_JOBS} AND started_at IS NOT NULL", window):
        by_queue.setdefault(str(queue), []).append(float(ms))
    latencies = [ms for values in by_queue.values() for ms in values]
    # Only q10 has a rate: the allowance each second of the window used (its
    # count plus the previous second's), and the seconds it had less than one
    # claim's worth (q10's limit) left.
    counts = dict(conn.execute("SELECT window_start, count FROM belay_rate WHERE "
                               "window_start >= %s AND window_start < %s",
                               (int(opened) - 1, int(closed))).fetchall())
    use = [counts.get(w, 0) + counts.get(w - 1, 0) for w in range(int(opened), int(closed))]
    return {
        "inserted": len(latencies),
        **_percentiles(latencies or [math.nan]),
        "unstarted": int(one(conn, f"SELECT count(*) {WINDOW_JOBS} AND started_at IS NULL",
                              window)),
        "finished": int(one(conn, "SELECT count(*) FROM belay_jobs WHERE id > %s AND "
                                   "finished_at >= %s AND finished_at < %s", window)),
        "p50_ms_by_queue": {q: round(percentile(v, 50), 2) for q, v in sorted(by_queue.items())},
        "p99_ms_by_queue": {q: round(percentile(v, 99), 2) for q, v in sorted(by_queue.items())},
        "q10_peak_use": round(max(use, default=0) / allowed, 2),
        "q10_capped_s": sum(u > allowed - WEIGHTS["q10"] for u in use),
    }


def open_loop(bench: Bench, procs: int, offered: float, seconds: float,
              prefill: int) -> dict[str, Any]:
    """The open-loop run at ``offered`` jobs/s: a warm-up until the sweepers'
    first prune batch (MIN_WARM to MAX_WARM s), then the ``seconds`` window."""
    allowed = math.ceil(2 * RATE_HEADROOM * offered * WEIGHTS["q10"] / sum(WEIGHTS.values()))
    with bench.database("profile_open") as url, psycopg.connect(url, autocommit=True) as conn:
        first, top = fill(bench, conn, prefill)
        gauge, watch = Meter(conn), PruneWatch(url, "belay_jobs")
        try:
            with workers(url, procs, allowed) as nodes, \
                    producers(url, offered, procs) as (pids, results, stop):
                began = time.time()
                if not wait(conn, GONE, (first,), MAX_WARM):
                    bench.log(f"profile: no prune pass {MAX_WARM:g} s into the open loop")
                opened = max(time.time(), began + MIN_WARM)
                closed = opened + seconds
                time.sleep(max(0.0, opened - time.time()))
                before, left, xacts = gauge.read(nodes, pids), _left(conn, top), \
                    int(one(conn, XACTS))
                time.sleep(max(0.0, closed - time.time()))
                after, elapsed = gauge.read(nodes, pids), time.time() - opened
                stop.set()
                xacts, pruned = int(one(conn, XACTS)) - xacts, left - _left(conn, top)
                reports = [results.get(timeout=120) for _ in range(PRODUCERS)]
                rows = _window(conn, top, opened, closed, allowed)
        finally:
            watch.stop()
        expired = int(one(conn, EXPIRED, (top, *KEEP)))
    if rows["unstarted"]:
        bench.log(f"profile: {rows['unstarted']} jobs of the window had not started {SETTLE:g} "
                  "s after it closed; their latency is missing from the percentiles")
    finished = max(rows["finished"], 1)
    result = {
        **rows, "offered_per_s": round(offered, 1),
        "inserted_per_s": round(rows["inserted"] / seconds, 1),
        "jobs_per_s": rows["finished"] / seconds,
        "cpu_us_per_job": (after["workers"] - before["workers"]) / finished * 1e6,
        "cores": cores(before, after, elapsed), "xacts_per_job": round(xacts / finished, 2),
        "q10_rate": allowed, "pruned_in_window": pruned,
        "prune_active_s": round(watch.active(opened, closed), 1),
        "expired_left_after": expired, "producers": reports,
    }
    bench.log(f"profile open loop, {procs} processes: {result}")
    return result


# -- Figures ------------------------------------------------------------------------------


def _conditions(loaded: dict[str, Any], seconds: float) -> str:
    """What the window was like, in the run's own numbers."""
    used = loaded["cores"]
    split = ", ".join(f"{k} {v:g}" for k, v in used.items() if k != "machine")
    return (f"in this run the producers inserted {loaded['inserted_per_s']:,.0f} jobs/s "
            f"(enqueue p50 up to {max(r['enqueue_p50_ms'] for r in loaded['producers'])} "
            "ms); cores busy "
            f"{used.get('machine', math.nan):g} of {os.cpu_count()} ({split}); pruning ran "
            f"{loaded['prune_active_s']:g} s of the {seconds} s ({loaded['pruned_in_window']:,}"
            f" rows); q10's rate peaked at {loaded['q10_peak_use']:.0%} of its allowance, "
            f"capped {loaded['q10_capped_s']} s")


def run(bench: Bench) -> list[Figure]:
    ceiling = raw_ceiling_jobs_per_s(bench)
    ceiling_name = "raw SQL ceiling, claim 50 + batched ack, 4 clients (this run)"
    floor_count = bench.size(200, 1_000)
    bench.log(f"profile: raw psycopg notify floor, {floor_count} samples")
    floor = [s * 1000 for s in _raw_samples(bench, floor_count, random.Random(20240501))]
    floor50, floor99 = percentile(floor, 50), percentile(floor, 99)
    prefill = bench.size(100_000, 1_000_000)
    backlog = bench.size(5_000, 30_000)
    seconds = bench.size(10, 60)
    figures: list[Figure] = []
    for procs in PROCS:
        drained = capacity(bench, procs, backlog, prefill)
        offered = LOAD * drained["jobs_per_s"]
        loaded = open_loop(bench, procs, offered, seconds, prefill)
        label, at = f"{procs} processes", f"open loop at {LOAD:.0%}"
        extra = {"profile_procs": procs, **loaded}
        figures += [
            Figure(SECTION, f"capacity, {label}", drained["jobs_per_s"], "jobs/s",
                   baseline=ceiling_name, baseline_value=ceiling,
                   target="≥ 0.5x the raw ceiling" if procs == 2 else None,
                   met=drained["jobs_per_s"] >= 0.5 * ceiling if procs == 2 else None,
                   note=f"closed-loop drain of {backlog:,} mixed jobs enqueued in one "
                        "transaction, first started_at to last finished_at; "
                        f"{describe(backlog, prefill)} (q10's rate the backlog's size: "
                        "admission paid, never binding)",
                   extra={"profile_procs": procs, **drained}),
            Figure(SECTION, f"{at}, {label}: achieved", loaded["jobs_per_s"], "jobs/s",
                   baseline=f"offered ({LOAD:.0%} of the capacity)", baseline_value=offered,
                   note=f"jobs finished in the {seconds} s window / its length, opened "
                        "with the first prune batch (after at least "
                        f"{MIN_WARM:g} s of load); {PRODUCERS}x{THREADS} producer threads, each "
                        "its own connection, plain enqueue on Poisson schedules; "
                        f"{describe(loaded['q10_rate'], prefill)}; q10's rate sustains "
                        f"{RATE_HEADROOM:g}x its offered share (a 1 s period sustains half "
                        f"of allowed); {_conditions(loaded, seconds)}",
                   extra=extra),
            Figure(SECTION, f"{at}, {label}: insert → start p50", loaded["p50_ms"], "ms",
                   baseline="raw notify floor p50 (this run)", baseline_value=floor50,
                   higher_is_better=False, target="≤ 1.5x the floor",
                   met=loaded["p50_ms"] <= 1.5 * floor50,
                   note="started_at - inserted_at of every job inserted in the window "
                        "(inserted_at is the producer's clock before its INSERT, so the "
                        "enqueue's own commit counts); the floor is bench.latency's raw insert "
                        "→ result round trip, one job at a time, no load",
                   extra={"floor_samples": floor_count, "by_queue": loaded["p50_ms_by_queue"]}),
            Figure(SECTION, f"{at}, {label}: insert → start p99", loaded["p99_ms"], "ms",
                   baseline="raw notify floor p99 (this run)", baseline_value=floor99,
                   higher_is_better=False, target="≤ 15 ms", met=loaded["p99_ms"] <= 15.0,
                   note="as above", extra={"by_queue": loaded["p99_ms_by_queue"]}),
            Figure(SECTION, f"{at}, {label}: worker CPU per job", loaded["cpu_us_per_job"],
                   "µs", baseline="the capacity drain", higher_is_better=False,
                   baseline_value=drained["cpu_us_per_job"],
                   note="user + system CPU of the worker processes over the window / jobs "
                        f"finished in it (baseline: the same over the drain); transactions "
                        f"per job {loaded['xacts_per_job']:g} (drain: "
                        f"{drained['xacts_per_job']:g})"),
        ]
    if os.environ.get(SKIP_PEERS):
        bench.log(f"profile: peers skipped (${SKIP_PEERS})")
        return figures
    return figures + profile_peers.run(
        bench, PROCS, (ceiling_name, ceiling), (floor50, floor99), backlog, seconds,
        prefill, LOAD, seed=lambda procs: SEED + procs)
