"""Big tables: what 10M terminal rows and 1M ready rows cost the hot path, the
operator reads and retention, each against the same measurement at ~1k rows.

Method. Two databases on the same server, both open for the whole run: the
*small* one (1k terminal + 1k ready rows, plus the ready rows its claims and
drain consume) and the *big* one (10M terminal + 1M ready; quick: 200k +
40k). Both are filled by SQL alone (``generate_series``,
:data:`FILL_TERMINAL` then :data:`FILL_READY`), never by enqueueing: the
terminal rows are a succeeded/failed/cancelled mix (92/6/2) over four
queues, with inputs and results of about 100-300 bytes, failed and cancelled
ones with an error entry, finished evenly over the last 30 days (oldest ids
first); the ready rows follow them (newest ids), all in queue ``default``.
belay's secondary indexes are dropped for the fill and rebuilt after it
(same definitions, read from ``pg_indexes``), then ``VACUUM ANALYZE`` and a
``CHECKPOINT`` before anything is timed. The shared machine is noisy, so
each measurement alternates between the two databases call by call
(:func:`_alternate`) rather than running one database after the other:

1. reads: ``client.stats()``, ``client.list_jobs()`` (first page, and
   filtered by queue, by state, by both), the dashboard's overview
   (``Dashboard.overview``: ``queue_stats``, ``finished_since``,
   ``list_queues`` and the 15 most recent jobs) and ``finished_since`` alone
   — each the median of :data:`READ_RUNS` runs after one untimed. At the big
   size a read slower than 100 ms gets an ``EXPLAIN (ANALYZE, BUFFERS)``;
   in the full run the candidate fixes are timed too (:func:`try_fixes`:
   the indexes :data:`FIX_INDEXES`, created in the bench database only and
   dropped afterwards; ``list_jobs`` as today and in two steps,
   :func:`two_step_list_jobs`; stats capped per pair, :data:`CAPPED_STATS`);
2. enqueue: ``client.enqueue`` one row at a time (p50/p99 of
   :data:`ENQUEUES`) and ``enqueue_many`` of :data:`BATCH` (rows/s), into a
   queue nobody serves;
3. claim: belay's ``claim`` statement through ``belay.store.claim`` (as
   ``bench.scale`` does), :data:`CLAIMS` calls of :data:`TAKE`, each acked
   (untimed) with ``ack_succeeded_many``;
4. drain: one ``belay.Worker`` process (:func:`node`: queue ``default=100``,
   polling, its own retention off so that no prune pass lands in the
   figure) works through 20,000 of the ready jobs (quick: 1,000), one
   database after the other; jobs/s from the first ``started_at`` to the
   last ``finished_at`` of the jobs it finished.

Then, on the big database only, retention (``belay.retention.prune`` with
its default retention: succeeded a day, failed and cancelled a week, so
most of the 30-day spread has expired). While a worker process (as in 4)
drains the ready jobs, a claimer thread (claim of :data:`TAKE` + batched
ack, back to back) runs 60 s (quick: 2 s) without pruning, then as long
again while another thread runs prune passes back to back — a worker runs
one pass per ``PRUNE_INTERVAL``; this is the fastest pace the same code
can go — and a sampler reads ``pg_stat_activity`` and ``pg_locks`` every
100 ms. Every call of ``belay.store.prune_jobs`` (one DELETE statement, its
own transaction on an autocommit connection) is counted and timed through a
wrapper, so the report shows the largest batch any statement deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

import belay
from belay import retention, store
from belay.dashboard.app import Dashboard
from belay.sql import QUERIES
from bench.core import Bench, Figure, Proc, median, percentile, processes
from bench.report import machine_table, publish

SECTION = "bigtable"
NODE = "bench-bigtable"
#: Jobs per claim, timed claims, untimed claims first.
TAKE = 10
CLAIMS = 200
WARM_CLAIMS = 10
#: Timed runs of each read (after one untimed), and the goal for each.
READ_RUNS = 5
READ_GOAL_MS = 100.0
#: Sequential single enqueues timed (after a few untimed); enqueue_many batches.
ENQUEUES = 200
BATCHES = 5
BATCH = 1_000
#: Seconds a drain may go without one more job finishing before it is given up.
STALL = 60.0
DAYS = 30

#: Terminal rows: 92 % succeeded, 6 % failed, 2 % cancelled; queues default
#: (70 %), emails (20 %), reports (9 %), audit (1 %); finished evenly over the
#: last DAYS days, oldest ids first; input and result of about 100-300 bytes (JSON text).
FILL_TERMINAL = """
INSERT INTO belay_jobs (kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at, started_at, finished_at, result, errors)
SELECT CASE WHEN q < 70 THEN 'noop' WHEN q < 90 THEN 'send_email'
            WHEN q < 99 THEN 'build_report' ELSE 'audit_event' END,
       CASE WHEN q < 70 THEN 'default' WHEN q < 90 THEN 'emails'
            WHEN q < 99 THEN 'reports' ELSE 'audit' END,
       st,
       jsonb_build_object('user_id', g, 'email', 'user' || g || '@example.com',
                          'template', 'welcome-v' || (g %% 7), 'locale', 'en-US',
                          'request_id', md5(g::text),
                          'note', repeat('x', (g %% 150)::int)),
       '{}', 0, CASE WHEN st = 'failed' THEN 5 ELSE 1 END, 5,
       fin - interval '3 seconds', fin - interval '3 seconds', fin - interval '1 second', fin,
       CASE WHEN st = 'succeeded' THEN convert_to(jsonb_build_object(
              'ok', true, 'message_id', md5(g::text || 'r'), 'status', 'delivered',
              'bytes', g %% 100000, 'pad', repeat('y', (g %% 120)::int))::text, 'UTF8') END,
       CASE WHEN st = 'failed' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 5, 'kind', 'TimeoutError',
              'message', 'upstream timed out after 30 s (smtp.example.com:587)'))
            WHEN st = 'cancelled' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 1, 'kind', 'cancelled', 'message', 'cancelled by an operator'))
            ELSE '[]'::jsonb END
FROM (
  SELECT g, (g::bigint * 7919) %% 100 AS q,
         CASE WHEN g %% 50 = 0 THEN 'cancelled' WHEN g %% 25 < 2 THEN 'failed'
              ELSE 'succeeded' END AS st,
         now() - (%(days)s * 86400.0 * (1 - g::float8 / %(rows)s)) * interval '1 second'
           - interval '1 second' AS fin
  FROM generate_series(1, %(rows)s) AS g
) AS t
"""
#: Ready rows, all in queue default, after the terminal rows (newest ids).
FILL_READY = """
INSERT INTO belay_jobs (kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at)
SELECT 'noop', 'default', 'ready',
       jsonb_build_object('user_id', g, 'email', 'user' || g || '@example.com',
                          'template', 'welcome-v' || (g %% 7), 'locale', 'en-US',
                          'request_id', md5(g::text)),
       '{}', 0, 0, 5, now() - interval '1 minute', now() - interval '1 minute'
FROM generate_series(1, %(rows)s) AS g
"""
SECONDARY = """
SELECT indexname, indexdef FROM pg_indexes
WHERE tablename = 'belay_jobs' AND indexname <> 'belay_jobs_pkey'
"""
#: What the drain finished: read off belay_jobs_prune_idx (state, finished_at).
DRAINED = """
SELECT count(*), EXTRACT(EPOCH FROM max(finished_at) - min(started_at))
FROM belay_jobs WHERE state = 'succeeded' AND finished_at >= %s
"""
FINISHED_BETWEEN = """
SELECT count(*) FROM belay_jobs
WHERE state = 'succeeded' AND finished_at >= %s AND finished_at < %s
"""
#: The prune backend: its transaction's age and its locks; and the locks the
#: claimer waits for (and whether the prune is what holds them).
ACTIVITY = """
SELECT a.state, EXTRACT(EPOCH FROM now() - a.xact_start),
       (SELECT array_agg(DISTINCT l.mode) FROM pg_locks AS l
        WHERE l.pid = a.pid AND l.relation = 'belay_jobs'::regclass),
       (SELECT count(*) FROM pg_locks AS l WHERE l.pid = a.pid),
       (SELECT array_agg(l.locktype || CASE WHEN a.pid = ANY(pg_blocking_pids(l.pid))
                                      THEN ' behind the prune' ELSE '' END)
        FROM pg_locks AS l WHERE NOT l.granted AND l.pid = ANY(%(waiters)s::int[]))
FROM pg_stat_activity AS a WHERE a.pid = %(pid)s
"""


@dataclass(frozen=True)
class Sizes:
    terminal: int
    ready: int

    @property
    def label(self) -> str:
        return f"{_count(self.terminal)} terminal + {_count(self.ready)} ready"


def _count(rows: int) -> str:
    if rows >= 1_000_000:
        return f"{rows / 1_000_000:g}M"
    return f"{rows / 1_000:g}k" if rows >= 1_000 else str(rows)


# -- Filling -----------------------------------------------------------------------------


def fill(bench: Bench, conn: psycopg.Connection[Any], sizes: Sizes) -> float:
    """Fill belay_jobs with ``sizes`` rows by SQL; returns the seconds it took."""
    started = time.monotonic()
    conn.execute("SET maintenance_work_mem = '256MB'")
    indexes = conn.execute(SECONDARY).fetchall()
    for name, _ in indexes:
        conn.execute(f'DROP INDEX "{name}"')
    conn.execute(FILL_TERMINAL, {"rows": sizes.terminal, "days": DAYS})
    bench.log(f"bigtable: {sizes.terminal:,} terminal rows in {time.monotonic() - started:.0f} s")
    conn.execute(FILL_READY, {"rows": sizes.ready})
    for _, definition in indexes:
        conn.execute(definition)
    bench.log(f"bigtable: ready rows and {len(indexes)} indexes at "
              f"{time.monotonic() - started:.0f} s; VACUUM ANALYZE")
    conn.execute("VACUUM ANALYZE belay_jobs")
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")
    seconds = time.monotonic() - started
    size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('belay_jobs'))"
                        ).fetchone()
    bench.log(f"bigtable: {sizes.label} filled in {seconds:.0f} s, belay_jobs "
              f"{size[0] if size else '?'} with indexes")
    return seconds


# -- Reads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """One operator read: how belay calls it, and its statement for EXPLAIN."""

    name: str
    call: Callable[[belay.Belay], object]
    query: str
    params: Any = None


def _list(**where: Any) -> tuple[Callable[[belay.Belay], object], dict[str, Any]]:
    params = {"queue": None, "state": None, "kind": None, "workflow_id": None,
              "parent_id": None, "before_id": None, "limit": 50, **where}
    return (lambda client: client.list_jobs(**where)), params


def reads() -> list[Read]:
    out = [Read("belay stats (client.stats)", lambda c: c.stats(), "queue_stats"),
           Read("dashboard overview (tiles + 15 recent)",
                lambda c: Dashboard(c).overview(), "queue_stats")]

    def since(client: belay.Belay) -> object:
        with client.connection() as conn:
            return store.finished_since(conn, client.now() - timedelta(seconds=60))

    out.append(Read("finished_since, last minute (dashboard rates)", since,
                    "finished_since", "now-60s"))
    for title, where in (
        ("list_jobs, first page (50)", {}),
        ("list_jobs queue=emails", {"queue": "emails"}),
        ("list_jobs state=failed", {"state": "failed"}),
        ("list_jobs state=succeeded (behind the ready backlog)", {"state": "succeeded"}),
        ("list_jobs queue=audit state=cancelled", {"queue": "audit", "state": "cancelled"}),
        ("list_jobs state=running (none running)", {"state": "running"}),
    ):
        call, params = _list(**where)
        out.append(Read(title, call, "list_jobs", params))
    return out


def _timed(call: Callable[[], object]) -> Callable[[], float]:
    def timed() -> float:
        started = time.perf_counter()
        call()
        return (time.perf_counter() - started) * 1000
    return timed


def _alternate(calls: list[Callable[[], float]], runs: int, warm: int = 1
               ) -> list[list[float]]:
    """Milliseconds of ``runs`` rounds of every call, one after the other in each
    round (after ``warm`` untimed rounds): the small and the big database are
    measured side by side, so a noisy moment of a shared machine hits both."""
    for _ in range(warm):
        for call in calls:
            call()
    out: list[list[float]] = [[] for _ in calls]
    for _ in range(runs):
        for call, timings in zip(calls, out, strict=True):
            timings.append(call())
    return out


def _explain(conn: psycopg.Connection[Any], read: Read) -> str:
    params = read.params
    if params == "now-60s":
        params = (datetime.now(timezone.utc) - timedelta(seconds=60),)
    rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[read.query], params
                        ).fetchall()
    return "\n".join(str(r[0]) for r in rows)


#: Candidate fixes for the slow reads, created in the bench database only.
FIX_INDEXES = {
    "bench_jobs_state_id_idx": "CREATE INDEX bench_jobs_state_id_idx ON belay_jobs (state, id)",
    "bench_jobs_queue_id_idx": "CREATE INDEX bench_jobs_queue_id_idx ON belay_jobs (queue, id)",
    "bench_jobs_queue_state_id_idx":
        "CREATE INDEX bench_jobs_queue_state_id_idx ON belay_jobs (queue, state, id)",
}
FIX_NAME = "indexes (state, id), (queue, id), (queue, state, id)"


def two_step_list_jobs() -> str:
    """belay's list_jobs in two steps: the page's ids first (an index-only
    scan of whichever index matches the filters stops after LIMIT entries),
    then their rows. Built from belay's own statement, so the filters stay its."""
    columns, rest = QUERIES["list_jobs"].split(" FROM belay_jobs", 1)
    return (f"WITH page AS MATERIALIZED (SELECT id FROM belay_jobs{rest.rstrip(';')}) "
            f"{columns} FROM belay_jobs JOIN page USING (id) ORDER BY id DESC")


#: belay stats with counts capped at 10,000 per (queue, state): the pairs by a
#: loose index scan of (queue, state, id), then at most 10,001 entries each.
CAPPED_STATS = """
WITH RECURSIVE pairs AS (
  (SELECT queue, state FROM belay_jobs ORDER BY queue, state LIMIT 1)
  UNION ALL
  SELECT n.queue, n.state FROM pairs AS p, LATERAL (
    SELECT queue, state FROM belay_jobs WHERE (queue, state) > (p.queue, p.state)
    ORDER BY queue, state LIMIT 1) AS n
)
SELECT p.queue, p.state, c.n FROM pairs AS p, LATERAL (
  SELECT count(*) AS n FROM (SELECT 1 FROM belay_jobs AS j
    WHERE j.queue = p.queue AND j.state = p.state LIMIT 10001) AS capped) AS c
"""


def _plan(conn: psycopg.Connection[Any], statement: str, params: Any) -> str:
    rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params).fetchall()
    return "\n".join(str(r[0]) for r in rows)


@dataclass
class ReadResult:
    name: str
    ms: list[float]
    plan: str = ""


def measure_reads(sides: list[Side]) -> list[list[ReadResult]]:
    """Every read on every side; EXPLAIN on the last (big) side when slow."""
    out: list[list[ReadResult]] = [[] for _ in sides]
    for read in reads():
        timings = _alternate([_timed(functools.partial(read.call, side.client))
                              for side in sides], READ_RUNS)
        for found, ms in zip(out, timings, strict=True):
            found.append(ReadResult(read.name, ms))
        big = out[-1][-1]
        if median(big.ms) > READ_GOAL_MS:
            big.plan = _explain(sides[-1].conn, read)
    return out


def try_fixes(bench: Bench, client: belay.Belay,
              conn: psycopg.Connection[Any]) -> list[tuple[str, float, float, str]]:
    """(what, before ms, after ms, plan after) for each candidate fix: the
    filtered list_jobs as belay runs it and in two steps, and the capped
    stats, each with :data:`FIX_INDEXES` (dropped afterwards)."""
    out: list[tuple[str, float, float, str]] = []
    tried = [r for r in reads() if r.query == "list_jobs" and r.params
             and (r.params.get("state") or r.params.get("queue"))]
    before = {r.name: median(_alternate([_timed(functools.partial(r.call, client))],
                                        READ_RUNS)[0]) for r in tried}
    stats_before = median(_alternate([_timed(client.stats)], READ_RUNS)[0])
    started = time.monotonic()
    for statement in FIX_INDEXES.values():
        conn.execute(statement)
    # The visibility map too: the fixes read index-only.
    conn.execute("VACUUM ANALYZE belay_jobs")
    bench.log(f"bigtable: fix indexes built in {time.monotonic() - started:.0f} s")
    two_step = two_step_list_jobs()
    # Fresh connections: the client's prepared statements were planned without them.
    with belay.Belay(client.conninfo, max_pool_size=1) as fresh, \
            psycopg.connect(client.conninfo, autocommit=True) as other:
        for read in tried:
            same = median(_alternate([_timed(functools.partial(read.call, fresh))],
                                     READ_RUNS)[0])
            out.append((f"{read.name}, statement as today, with {FIX_NAME}",
                        before[read.name], same, _explain(conn, read)))
            split = median(_alternate([_timed(functools.partial(
                other.execute, two_step, read.params))], READ_RUNS)[0])
            out.append((f"{read.name}, two-step statement, with {FIX_NAME}",
                        before[read.name], split, _plan(conn, two_step, read.params)))
        capped = median(_alternate([_timed(functools.partial(other.execute, CAPPED_STATS))],
                                   READ_RUNS)[0])
    out.append(("belay stats capped at 10,000 per (queue, state), with (queue, state, id)",
                stats_before, capped, _plan(conn, CAPPED_STATS, None)))
    for name in FIX_INDEXES:
        conn.execute(f'DROP INDEX "{name}"')
    return out


# -- Enqueue, claim, drain ----------------------------------------------------------------


def measure_enqueue(sides: list[Side]) -> list[tuple[list[float], float]]:
    """Per side: single-enqueue milliseconds, and enqueue_many rows/s."""
    single = _alternate([_timed(functools.partial(
        side.client.enqueue, "noop", {"user_id": 7, "email": "user7@example.com"},
        queue="enqueued")) for side in sides], ENQUEUES, warm=10)
    batch = [{"kind": "noop", "input": {"user_id": i, "email": f"user{i}@example.com"},
              "queue": "enqueued"} for i in range(BATCH)]
    many = _alternate([_timed(functools.partial(side.client.enqueue_many, batch))
                       for side in sides], BATCHES)
    return [(ms, BATCH * BATCHES / (sum(batches) / 1000))
            for ms, batches in zip(single, many, strict=True)]


class _NoneReady(RuntimeError):
    """The claim found no ready job."""


def _claim_once(conn: psycopg.Connection[Any]) -> float:
    """One claim of TAKE (timed, ms) and its ack (untimed)."""
    started = time.perf_counter()
    now = datetime.now(timezone.utc)
    jobs = store.claim(conn, "default", TAKE, NODE, now, now + timedelta(seconds=60))
    elapsed = (time.perf_counter() - started) * 1000
    if not jobs:
        raise _NoneReady("the claim found no ready job")
    store.ack_succeeded_many(conn, [(job, None) for job in jobs], datetime.now(timezone.utc))
    return elapsed


def measure_claims(sides: list[Side]) -> list[list[float]]:
    return _alternate([functools.partial(_claim_once, side.conn) for side in sides],
                      CLAIMS, warm=WARM_CLAIMS)


def measure_drain(url: str, conn: psycopg.Connection[Any], jobs: int) -> float:
    """Jobs/s of one belay worker process working through ``jobs`` ready jobs."""
    since = datetime.now(timezone.utc)
    with _worker(url):
        done, progress = 0, time.monotonic()
        while done < jobs:
            time.sleep(0.1)
            row = conn.execute(DRAINED, (since,)).fetchone()
            count = int(row[0]) if row else 0
            if count > done:
                done, progress = count, time.monotonic()
            elif time.monotonic() - progress > STALL:
                raise TimeoutError(f"drain stalled at {done} of {jobs} jobs")
        row = conn.execute(DRAINED, (since,)).fetchone()
    assert row is not None
    return int(row[0]) / float(row[1])


def _worker(url: str) -> contextlib.AbstractContextManager[list[Proc]]:
    """One worker process (:func:`node`): belay.Worker, queue default=100,
    no notify (polling), retention off."""
    return processes(1, "bench.bigtable", "--node", url)


# -- Retention under load ------------------------------------------------------------------


@dataclass
class PruneRun:
    claims_ms: list[float] = field(default_factory=list)
    claimed_jobs: int = 0
    seconds: float = 0.0
    pruned: int = 0
    prune_seconds: float = 0.0
    prune_started: float = 0.0
    passes: int = 0
    #: (rows deleted, milliseconds, monotonic end) of each prune_jobs call.
    batches: list[tuple[int, float, float]] = field(default_factory=list)
    worker_jobs: int = 0
    longest_xact_s: float = 0.0
    modes: set[str] = field(default_factory=set)
    max_locks: int = 0
    claimer_waits: int = 0
    waited_for: set[str] = field(default_factory=set)
    samples: int = 0


def _claimer(url: str, stop: threading.Event, run: PruneRun, pids: list[int]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        pids.append(conn.info.backend_pid)
        started = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    run.claims_ms.append(_claim_once(conn))
                except _NoneReady:
                    break  # the backlog ran out (a quick run on a fast machine)
                run.claimed_jobs += TAKE
        finally:
            run.seconds = max(time.monotonic() - started, 1e-9)


@contextlib.contextmanager
def _batches_recorded(run: PruneRun) -> Iterator[None]:
    """Count and time every call of belay.store.prune_jobs (one DELETE statement)."""
    original = store.prune_jobs

    def recorded(conn: store.Conn, state: str, cutoffs: dict[str, datetime | None],
                 limit: int) -> int:
        started = time.perf_counter()
        deleted = original(conn, state, cutoffs, limit)
        run.batches.append((deleted, (time.perf_counter() - started) * 1000,
                            time.monotonic()))
        return deleted

    store.prune_jobs = recorded
    try:
        yield
    finally:
        store.prune_jobs = original


def _pruner(url: str, stop: threading.Event, run: PruneRun, pids: list[int]) -> None:
    with psycopg.connect(url, autocommit=True) as conn, _batches_recorded(run):
        pids.append(conn.info.backend_pid)
        started = run.prune_started = time.monotonic()
        while not stop.is_set():
            counts = retention.prune(conn, datetime.now(timezone.utc),
                                     retention.DEFAULT_RETENTION,
                                     retention.DEFAULT_SIGNAL_TTL, [])
            run.passes += 1
            gone = sum(counts.get(s, 0) for s in retention.DEFAULT_RETENTION)
            run.pruned += gone
            if not gone:
                break
        run.prune_seconds = time.monotonic() - started


def _sampler(url: str, stop: threading.Event, run: PruneRun, pruner: list[int],
             claimer: list[int]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.wait(0.1):
            if not pruner:
                continue
            row = conn.execute(ACTIVITY, {"pid": pruner[0], "waiters": claimer}).fetchone()
            if row is None:
                continue
            state, xact_age, modes, locks, waits = row
            run.samples += 1
            if state == "active" and xact_age is not None:
                run.longest_xact_s = max(run.longest_xact_s, float(xact_age))
            run.modes.update(modes or [])
            run.max_locks = max(run.max_locks, int(locks))
            run.claimer_waits += len(waits or [])
            run.waited_for.update(waits or [])


def measure_prune(bench: Bench, url: str, conn: psycopg.Connection[Any], seconds: float
                  ) -> tuple[PruneRun, PruneRun]:
    """With a worker process draining the ready jobs: the claimer alone for
    ``seconds``, then as long again with prune passes beside it."""
    runs = []
    with _worker(url):
        time.sleep(1)
        for with_prune in (False, True):
            run, stop = PruneRun(), threading.Event()
            claimer: list[int] = []
            pruner: list[int] = []
            threads = [threading.Thread(target=_claimer, args=(url, stop, run, claimer),
                                        name="bench-claimer")]
            if with_prune:
                threads += [
                    threading.Thread(target=_pruner, args=(url, stop, run, pruner),
                                     name="bench-pruner"),
                    threading.Thread(target=_sampler, args=(url, stop, run, pruner, claimer),
                                     name="bench-sampler")]
            since = datetime.now(timezone.utc)
            for thread in threads:
                thread.start()
            stop.wait(seconds)
            stop.set()
            for thread in threads:
                thread.join(120)
            row = conn.execute(FINISHED_BETWEEN, (since, datetime.now(timezone.utc))).fetchone()
            run.worker_jobs = (int(row[0]) if row else 0) - run.claimed_jobs
            bench.log(f"bigtable: claims {'during' if with_prune else 'without'} prune: "
                      f"p50 {percentile(run.claims_ms, 50):.2f} ms, "
                      f"p99 {percentile(run.claims_ms, 99):.2f} ms, worker "
                      f"{run.worker_jobs / seconds:,.0f} jobs/s"
                      + (f"; pruned {run.pruned:,} in {run.prune_seconds:.0f} s"
                         if with_prune else ""))
            runs.append(run)
    return runs[0], runs[1]


# -- The scenario ----------------------------------------------------------------------------


@dataclass
class Side:
    """One database of the comparison, open."""

    sizes: Sizes
    url: str
    conn: psycopg.Connection[Any]
    client: belay.Belay
    fill_s: float = 0.0
    table_size: str = "?"


@dataclass
class Measured:
    sizes: Sizes
    fill_s: float
    table_size: str
    reads: list[ReadResult]
    enqueue_ms: list[float]
    enqueue_many: float
    claims_ms: list[float]
    drain: float
    fixes: list[tuple[str, float, float, str]] = field(default_factory=list)
    prune: tuple[PruneRun, PruneRun] | None = None


def measure(bench: Bench, small: Sizes, big: Sizes, drain: int) -> tuple[Measured, Measured]:
    sides: list[Side] = []
    with contextlib.ExitStack() as stack:
        for sizes in (small, big):
            url = stack.enter_context(bench.database("bigtable"))
            conn = stack.enter_context(psycopg.connect(url, autocommit=True))
            client = stack.enter_context(belay.Belay(url, max_pool_size=2))
            side = Side(sizes, url, conn, client, fill(bench, conn, sizes))
            row = conn.execute(
                "SELECT pg_size_pretty(pg_total_relation_size('belay_jobs'))").fetchone()
            side.table_size = str(row[0]) if row else "?"
            sides.append(side)
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            sides[-1].conn.execute("CHECKPOINT")
        found = measure_reads(sides)
        for read_small, read_big in zip(*found, strict=True):
            bench.log(f"bigtable: {read_big.name}: p50 {median(read_small.ms):.1f} ms "
                      f"small, {median(read_big.ms):.1f} ms big")
        fixes = [] if bench.quick else try_fixes(bench, sides[-1].client, sides[-1].conn)
        enqueued = measure_enqueue(sides)
        claims = measure_claims(sides)
        for side, (ms, many), claimed in zip(sides, enqueued, claims, strict=True):
            bench.log(f"bigtable {_count(side.sizes.terminal)}: enqueue p50 "
                      f"{percentile(ms, 50):.2f} ms, enqueue_many {many:,.0f} rows/s; claim p50 "
                      f"{percentile(claimed, 50):.2f} ms p99 {percentile(claimed, 99):.2f} ms")
        rates = []
        for side in sides:
            rates.append(measure_drain(side.url, side.conn, drain))
            bench.log(f"bigtable {_count(side.sizes.terminal)}: drain {rates[-1]:,.0f} jobs/s")
        prune = measure_prune(bench, sides[-1].url, sides[-1].conn, bench.size(2, 60))
        results = [
            Measured(side.sizes, side.fill_s, side.table_size, reads, ms, many, claimed, rate)
            for side, reads, (ms, many), claimed, rate
            in zip(sides, found, enqueued, claims, rates, strict=True)]
        results[-1].fixes, results[-1].prune = fixes, prune
        return results[0], results[1]


def figures(small: Measured, big: Measured, drain: int) -> list[Figure]:
    s, b = _count(small.sizes.terminal), big.sizes.label
    base = f"at {small.sizes.label}"
    out = []

    def pair(name: str, value: float, baseline: float, unit: str, *, higher: bool,
             target: str | None = None, met: bool | None = None, note: str = "") -> None:
        out.append(Figure(SECTION, f"{name}, {b}", value, unit, baseline=f"{name}, {base}",
                          baseline_value=baseline, higher_is_better=higher, target=target,
                          met=met, note=note))

    claim50, claim99 = (percentile(big.claims_ms, p) / percentile(small.claims_ms, p)
                        for p in (50, 99))
    how = (f"belay.store.claim of {TAKE}, {CLAIMS} autocommit calls after {WARM_CLAIMS} "
           "untimed, each acked (untimed)")
    pair("claim p50", percentile(big.claims_ms, 50), percentile(small.claims_ms, 50), "ms",
         higher=False, target="≤ 1.5x", met=claim50 <= 1.5, note=how)
    pair("claim p99", percentile(big.claims_ms, 99), percentile(small.claims_ms, 99), "ms",
         higher=False, target="≤ 1.5x", met=claim99 <= 1.5, note=how)
    pair(f"drain of {drain:,}, 1 worker process", big.drain, small.drain, "jobs/s",
         higher=True, target="≥ 1/1.5 of the small figure", met=big.drain / small.drain >= 2 / 3,
         note="belay.Worker (bigtable.node: default=100, polling, retention off); "
              "first started_at to last finished_at")
    pair("enqueue p50", percentile(big.enqueue_ms, 50), percentile(small.enqueue_ms, 50),
         "ms", higher=False, note=f"client.enqueue, {ENQUEUES} sequential")
    pair("enqueue p99", percentile(big.enqueue_ms, 99), percentile(small.enqueue_ms, 99),
         "ms", higher=False)
    pair(f"enqueue_many of {BATCH:,}", big.enqueue_many, small.enqueue_many, "rows/s",
         higher=True, note=f"{BATCHES} batches after one untimed")
    small_reads = {r.name: r for r in small.reads}
    for read in big.reads:
        value = median(read.ms)
        pair(read.name, value, median(small_reads[read.name].ms), "ms", higher=False,
             target=f"< {READ_GOAL_MS:.0f} ms", met=value < READ_GOAL_MS,
             note=f"median of {READ_RUNS} after one untimed")
    for what, before, after, _ in big.fixes:
        out.append(Figure(SECTION, f"{what} (bench database only)", after, "ms",
                          baseline="as belay runs it today", baseline_value=before,
                          higher_is_better=False))
    if big.prune is not None:
        quiet, busy = big.prune
        p99 = percentile(busy.claims_ms, 99) / percentile(quiet.claims_ms, 99)
        rows = max((n for n, _, _ in busy.batches), default=0)
        slowest = max((ms for _, ms, _ in busy.batches), default=0.0)
        note = (f"retention.prune passes back to back (defaults: succeeded 1 day, failed/"
                f"cancelled 7 days), PRUNE_BATCH {retention.PRUNE_BATCH}, PRUNE_BATCHES "
                f"{retention.PRUNE_BATCHES}; {len(busy.batches):,} DELETE statements in "
                f"{busy.passes} passes, largest {rows} rows, slowest {slowest:.0f} ms; "
                f"sampled {busy.samples}x: longest prune transaction seen "
                f"{busy.longest_xact_s * 1000:.0f} ms, locks on belay_jobs "
                f"{', '.join(sorted(busy.modes)) or 'none seen'}, claimer lock waits seen "
                f"{busy.claimer_waits}" + (f" ({', '.join(sorted(busy.waited_for))})"
                                           if busy.waited_for else ""))
        for p, ratio_goal in ((50, None), (99, 2.0)):
            value = percentile(busy.claims_ms, p)
            out.append(Figure(
                SECTION, f"claim p{p} during prune, {b}", value, "ms",
                baseline=f"claim p{p} without prune, same database",
                baseline_value=percentile(quiet.claims_ms, p), higher_is_better=False,
                target="≤ 2x" if ratio_goal else None,
                met=(p99 <= ratio_goal) if ratio_goal else None, note=note))
        out.append(Figure(
            SECTION, f"claim + ack of the claimer thread during prune, {b}",
            busy.claimed_jobs / busy.seconds, "jobs/s", baseline="without prune, same database",
            baseline_value=quiet.claimed_jobs / quiet.seconds,
            note="store.claim of 10 + ack_succeeded_many, one connection, back to back"))
        out.append(Figure(
            SECTION, f"worker process jobs/s during prune, {b}", busy.worker_jobs / busy.seconds,
            "jobs/s", baseline="without prune, same database",
            baseline_value=quiet.worker_jobs / quiet.seconds,
            note="belay.Worker (default=100, polling, its own retention off), draining the "
                 "ready rows beside the claimer thread"))
        half = busy.prune_started + busy.prune_seconds / 2
        first = sum(n for n, _, at in busy.batches if at <= half)
        out.append(Figure(
            SECTION, f"prune rate, {b}", busy.pruned / max(busy.prune_seconds, 1e-9),
            "rows/s", note=f"{busy.pruned:,} rows in {busy.prune_seconds:.0f} s "
            f"({first:,} in the first half, {busy.pruned - first:,} in the second)",
            extra={"pruned": busy.pruned}))
    for f in out:
        f.extra.setdefault("small", s)
    return out


def sizes(bench: Bench) -> tuple[Sizes, Sizes, int]:
    """(small, big, drain) for this run."""
    drain = bench.size(1_000, 20_000)
    # The small side also holds the ready rows its claims and drain take.
    return (Sizes(1_000, 1_000 + (WARM_CLAIMS + CLAIMS) * TAKE + drain),
            Sizes(bench.size(200_000, 10_000_000), bench.size(40_000, 1_000_000)), drain)


def run(bench: Bench) -> list[Figure]:
    return run_measured(bench)[0]


def run_measured(bench: Bench) -> tuple[list[Figure], Measured, Measured]:
    small_sizes, big_sizes, drain = sizes(bench)
    small, big = measure(bench, small_sizes, big_sizes, drain)
    return figures(small, big, drain), small, big


# -- Report ----------------------------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 \
        else f"{value:.2f}"


def section(found: list[Figure], small: Measured, big: Measured,
            described: dict[str, str], quick: bool) -> str:
    lines = [f"## {SECTION}", "",
             ("Quick size" if quick else "Full size") + f": {big.sizes.label} rows "
             f"(belay_jobs {big.table_size} with indexes, filled in {big.fill_s:.0f} s) "
             f"against {small.sizes.label} ({small.table_size}), same server, same run. "
             "Method: the docstring of bench/bigtable.py.", "",
             "| figure | value | baseline | ratio | target | met | note |",
             "|---|---:|---|---:|---|:-:|---|"]
    previous = ""
    for f in found:
        baseline = "" if f.baseline is None else f"{f.baseline}: {_num(f.baseline_value or 0)}"
        ratio = "" if f.ratio is None else f"{f.ratio:.2f}"
        met = "" if f.met is None else ("yes" if f.met else "**no**")
        note, previous = ("as above" if f.note and f.note == previous else f.note), f.note
        lines.append(f"| {f.name} | {_num(f.value)} {f.unit} | {baseline} | {ratio} | "
                     f"{f.target or ''} | {met} | {note.replace('|', '/')} |")
    lines.append("")
    slow = [r for r in big.reads if r.plan]
    if slow:
        lines += ["### Slow reads at the big size: EXPLAIN (ANALYZE, BUFFERS)", ""]
        for read in slow:
            lines += [f"**{read.name}** (median {median(read.ms):,.0f} ms)", "", "```",
                      read.plan, "```", ""]
    if big.fixes:
        lines += ["### Candidate fixes, tried in the bench database", ""]
        for what, before, after, plan in big.fixes:
            lines += [f"**{what}**: {_num(before)} ms → {_num(after)} ms", "", "```", plan,
                      "```", ""]
    lines += machine_table(described)
    return "\n".join(lines)


def node(url: str) -> None:
    """A belay worker serving ``default=100`` with retention off (the bench
    prunes on its own schedule), until SIGTERM; says ``ready``."""
    from bench.belay_node import registry, serve

    keep: dict[str, float | None] = dict.fromkeys(retention.DEFAULT_RETENTION)
    serve(belay.Worker({"default": 100}, client=belay.Belay(url), registry=registry(),
                       notify=False, retention=keep, shutdown_grace=5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bigtable", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="200k terminal + 20k ready rows (CI)")
    parser.add_argument("--url", default=os.environ.get("BELAY_BENCH_URL"),
                        help="PostgreSQL server (default: a private embedded one)")
    parser.add_argument("--out", help="also write the Markdown section here")
    parser.add_argument("--node", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        node(args.node)
        return 0
    from bench.__main__ import machine, server

    with server(args.url) as (url, bin_dir):
        bench = Bench(url, quick=args.quick, bin_dir=bin_dir)
        described = machine(url)
        try:
            found, small, big = run_measured(bench)
        finally:
            bench.close()
    publish(section(found, small, big, described, args.quick), args.out)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
