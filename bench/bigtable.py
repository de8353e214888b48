"""Big tables: what 10M terminal rows and 1M ready rows cost the hot path, the
operator reads and retention, each against the same measurement at ~1k rows;
and what schema revision 4's index (``belay_jobs_state_queue_id_idx``, on
``(state, queue, id)``) costs to build and to write.

Method. First, the index's write cost on small fresh databases
(:func:`measure_write_cost`): ``enqueue_many`` of 20,000 jobs (quick: 1,000)
in batches of :data:`BATCH`, then one ``belay.Worker`` process (:func:`node`)
draining them, in a database with the index and in one where it was dropped
(``DROP INDEX belay_jobs_state_queue_id_idx``), alternating
:data:`WRITE_ROUNDS` times (quick: 2), the order flipped every round.

Then two databases on the same server, both open for the rest of the run: the
*small* one (1k terminal + 1k ready rows, plus the ready rows its claims and
drain consume) and the *big* one (10M terminal + 1M ready; quick: 200k +
40k). Both are filled by SQL alone (``generate_series``,
:data:`FILL_TERMINAL` then :data:`FILL_READY`), never by enqueueing: the
terminal rows are a succeeded/failed/cancelled mix (92/6/2) over four
queues, with inputs and results of about 100-300 bytes, failed and cancelled
ones with an error entry, finished evenly over the last 30 days (oldest ids
first); the ready rows follow them (newest ids), all in queue ``default``.
belay's secondary indexes (the migrated template's, revision 4's included)
are dropped for the fill and rebuilt after it (same definitions, read from
``pg_indexes``), then ``VACUUM ANALYZE`` and a ``CHECKPOINT``. On the big
database, revision 4's index is then dropped and built again, timed
(:func:`build_index`): a plain ``CREATE INDEX`` (what the migration runs;
it locks writes for as long as it takes) and ``CREATE INDEX CONCURRENTLY``,
each with the server's default ``maintenance_work_mem``. The shared machine
is noisy, so each measurement alternates between the two databases call by
call (:func:`_alternate`) rather than running one database after the other:

1. reads (:func:`reads`): ``client.stats()`` (counts capped at
   ``STATS_CAP``) and ``client.stats(cap=None)`` (exact: what the cap
   saves), the dashboard's overview (``Dashboard.overview``:
   ``ops.queue_overview`` and the 15 most recent jobs), ``finished_since``
   alone, ``client.list_jobs()`` (first page; by queue, by state, by both,
   a combination with no rows; and page 5 by ``before_id``) — each the
   median of :data:`READ_RUNS` runs after one untimed. At the big size a
   read with a goal that is slower than 100 ms gets an ``EXPLAIN (ANALYZE,
   BUFFERS)`` of the statements belay runs for it;
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

Then, on the big database only, retention as a worker runs it now, with the
default retention (succeeded a day, failed and cancelled a week, so most of
the 30-day spread has expired); the expired rows are counted first. While a
worker process (as in 4) drains the ready jobs, a claimer thread (claim of
:data:`TAKE` + batched ack, back to back) runs through three turns of 60 s
each (quick: 2 s) — no prune; *paced* prune passes, as a worker runs them
(``retention.prune_pass`` with its default budget, ``PRUNE_BUDGET``, resting
``PRUNE_REST`` times each full batch's time on the stop event's wait, the
next pass ``PRUNE_PAUSE`` after the last while it reports ``behind``, as the
worker's sweeper does: the claim p99 goal is judged on this one); *unpaced*
ones (``rest`` a no-op, the batches back to back: the comparison) — taken in
slices of :data:`SLICE` s in rotation, so that what drifts over the phase
(dead entries of the claimed rows piling up in the claim index until
autovacuum comes, autovacuum itself) weighs on every turn alike; the
:data:`SETTLE` s after each prune slice count for no turn. During prune slices
a sampler reads ``pg_stat_activity`` and ``pg_locks`` every 100 ms. The
claims of each turn are compared with those of the turn without
pruning. Every call of ``belay.store.prune_jobs`` (one
DELETE statement, its own transaction on an autocommit connection) is
counted and timed through a wrapper, so the report shows the largest batch
any statement deleted and the slowest; the sampler also records what the
claimer's backend waits on (``wait_event``) while it runs a statement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

import belay
from belay import retention, store
from belay.dashboard.app import RECENT, Dashboard
from belay.sql import QUERIES
from bench.core import Bench, Figure, Proc, arguments, median, percentile, processes
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
#: The deeper page of list_jobs: this many pages of PAGE skipped by before_id.
PAGE = 50
DEEP_PAGES = 4
#: Sequential single enqueues timed (after a few untimed); enqueue_many batches.
ENQUEUES = 200
BATCHES = 5
BATCH = 1_000
#: Rounds of the index's write cost (each: one database with it, one without).
WRITE_ROUNDS = 3
#: Seconds a drain may go without one more job finishing before it is given up.
STALL = 60.0
DAYS = 30
#: Schema revision 4's index: built again, timed, at the big size; dropped in
#: the write-cost comparison.
NEW_INDEX = "belay_jobs_state_queue_id_idx"

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
#: The prune backend: its transaction's age and its locks; the locks the
#: claimer waits for (and whether the prune is what holds them), and what the
#: claimer's backend is waiting on while it runs a statement (IO, WAL, locks).
ACTIVITY = """
SELECT a.state, EXTRACT(EPOCH FROM now() - a.xact_start),
       (SELECT array_agg(DISTINCT l.mode) FROM pg_locks AS l
        WHERE l.pid = a.pid AND l.relation = 'belay_jobs'::regclass),
       (SELECT count(*) FROM pg_locks AS l WHERE l.pid = a.pid),
       (SELECT array_agg(l.locktype || CASE WHEN a.pid = ANY(pg_blocking_pids(l.pid))
                                      THEN ' behind the prune' ELSE '' END)
        FROM pg_locks AS l WHERE NOT l.granted AND l.pid = ANY(%(waiters)s::int[])),
       (SELECT array_agg(w.wait_event_type || ':' || w.wait_event) FROM pg_stat_activity AS w
        WHERE w.pid = ANY(%(waiters)s::int[]) AND w.state = 'active'
          AND w.wait_event IS NOT NULL)
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
#: Expired rows of one terminal state under a cutoff (belay_jobs_prune_idx).
EXPIRED = "SELECT count(*) FROM belay_jobs WHERE state = %s AND finished_at < %s"


# -- Filling -----------------------------------------------------------------------------


def fill(bench: Bench, conn: psycopg.Connection[Any], sizes: Sizes) -> float:
    """Fill belay_jobs with ``sizes`` rows by SQL; returns the seconds it took.
    Every secondary index (revision 4's included) is dropped for the INSERTs
    and built again after them, from its own definition."""
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
    conn.execute("RESET maintenance_work_mem")
    bench.log(f"bigtable: ready rows and {len(indexes)} indexes at "
              f"{time.monotonic() - started:.0f} s; VACUUM ANALYZE")
    conn.execute("VACUUM ANALYZE belay_jobs")
    _checkpoint(conn)
    seconds = time.monotonic() - started
    size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('belay_jobs'))"
                        ).fetchone()
    bench.log(f"bigtable: {sizes.label} filled in {seconds:.0f} s, belay_jobs "
              f"{size[0] if size else '?'} with indexes")
    return seconds


def _checkpoint(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


@dataclass
class IndexBuild:
    """Seconds to build revision 4's index on the full table, both ways."""

    plain_s: float
    concurrent_s: float
    size: str
    settings: str


def build_index(bench: Bench, conn: psycopg.Connection[Any]) -> IndexBuild:
    """Drop :data:`NEW_INDEX` and build it again: ``CREATE INDEX`` as the
    migration does (timed), then, dropped again, ``CREATE INDEX CONCURRENTLY``
    (timed). The server's defaults apply (the fill's maintenance_work_mem is
    reset); a CHECKPOINT before each, so one build's WAL is not the next one's."""
    row = conn.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s",
                       (NEW_INDEX,)).fetchone()
    if row is None:
        raise RuntimeError(f"{NEW_INDEX} is not in the migrated schema")
    definition = str(row[0])
    concurrently = definition.replace("CREATE INDEX ", "CREATE INDEX CONCURRENTLY ", 1)
    settings = ", ".join(
        f"{name} {conn.execute(f'SHOW {name}').fetchone()[0]}"  # type: ignore[index]
        for name in ("maintenance_work_mem", "max_parallel_maintenance_workers"))
    timings = []
    for statement in (definition, concurrently):
        conn.execute(f'DROP INDEX "{NEW_INDEX}"')
        _checkpoint(conn)
        started = time.monotonic()
        conn.execute(statement)
        timings.append(time.monotonic() - started)
        bench.log(f"bigtable: {statement.split(' ON ')[0]}: {timings[-1]:.1f} s")
    _checkpoint(conn)
    size = conn.execute("SELECT pg_size_pretty(pg_relation_size(%s::regclass))",
                        (NEW_INDEX,)).fetchone()
    return IndexBuild(timings[0], timings[1], str(size[0]) if size else "?", settings)


# -- Reads -------------------------------------------------------------------------------


#: Per database: what a read needs that depends on the rows (the deep page's before_id).
Extra = dict[str, Any]


@dataclass(frozen=True)
class Read:
    """One operator read: how belay calls it, and the statements it runs (for
    EXPLAIN: (name in belay/sql/queries.sql, parameters) each)."""

    name: str
    call: Callable[[belay.Belay, Extra], object]
    statements: Callable[[Extra], list[tuple[str, Any]]]
    goal: bool = True
    setup: Callable[[belay.Belay], Extra] = lambda client: {}


def _list_params(where: dict[str, Any]) -> dict[str, Any]:
    return {"queue": None, "state": None, "kind": None, "workflow_id": None,
            "parent_id": None, "before_id": None, "limit": PAGE, **where}


def _list_statement(where: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The statement belay's list_jobs runs for this filter, with its parameters."""
    params = _list_params(where)
    return store.list_statement(store.JobFilter(**params)), params


def _list_read(title: str, where: dict[str, Any], *, pages: int = 0) -> Read:
    def setup(client: belay.Belay) -> Extra:
        if not pages:
            return {}
        skipped = client.list_jobs(**where, limit=PAGE * pages)
        return {"before_id": skipped[-1].id if skipped else 1}

    return Read(title, lambda client, extra: client.list_jobs(**where, **extra),
                lambda extra: [_list_statement({**where, **extra})], setup=setup)


def reads() -> list[Read]:
    capped = {"live_cap": store.STATS_CAP, "terminal_cap": store.STATS_CAP}
    out = [
        Read(f"belay stats (client.stats(), capped at {store.STATS_CAP:,})",
             lambda c, _: c.stats(), lambda _: [("queue_stats", capped)]),
        Read("belay stats exact (client.stats(cap=None))", lambda c, _: c.stats(cap=None),
             lambda _: [("queue_stats", {"live_cap": None, "terminal_cap": None})],
             goal=False),
        Read(f"dashboard overview (ops.queue_overview + {RECENT} recent)",
             lambda c, _: Dashboard(c).overview(),
             lambda _: [("queue_stats", capped), ("queue_spend_in_flight", None),
                        ("finished_since", (_ago(),)), ("list_queues", None),
                        _list_statement({"limit": RECENT})]),
    ]

    def since(client: belay.Belay, _: Extra) -> object:
        with client.connection() as conn:
            return store.finished_since(conn, client.now() - timedelta(seconds=60))

    out.append(Read("finished_since, last minute (dashboard rates)", since,
                    lambda _: [("finished_since", (_ago(),))]))
    for title, where in (
        ("list_jobs, first page (50)", {}),
        ("list_jobs queue=emails", {"queue": "emails"}),
        ("list_jobs state=failed", {"state": "failed"}),
        ("list_jobs state=succeeded (behind the ready backlog)", {"state": "succeeded"}),
        ("list_jobs queue=emails state=failed", {"queue": "emails", "state": "failed"}),
        ("list_jobs queue=audit state=cancelled (no such jobs)",
         {"queue": "audit", "state": "cancelled"}),
        ("list_jobs state=running (none running)", {"state": "running"}),
    ):
        out.append(_list_read(title, where))
    for title, where in (
        ("list_jobs, page 5 (before_id)", {}),
        ("list_jobs state=succeeded, page 5 (before_id)", {"state": "succeeded"}),
        ("list_jobs queue=emails, page 5 (before_id)", {"queue": "emails"}),
    ):
        out.append(_list_read(title, where, pages=DEEP_PAGES))
    return out


def _ago(seconds: float = 60.0) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


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


def _explain(conn: psycopg.Connection[Any], read: Read, extra: Extra) -> str:
    plans = []
    for name, params in read.statements(extra):
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[name], params).fetchall()
        plans.append(f"-- {name}\n" + "\n".join(str(r[0]) for r in rows))
    return "\n\n".join(plans)


@dataclass
class ReadResult:
    name: str
    ms: list[float]
    plan: str = ""
    statements: str = ""
    goal: bool = True


def measure_reads(sides: list[Side]) -> list[list[ReadResult]]:
    """Every read on every side; EXPLAIN on the last (big) side when slow."""
    out: list[list[ReadResult]] = [[] for _ in sides]
    for read in reads():
        extras = [read.setup(side.client) for side in sides]
        timings = _alternate([_timed(functools.partial(read.call, side.client, extra))
                              for side, extra in zip(sides, extras, strict=True)], READ_RUNS)
        names = ", ".join(dict.fromkeys(name for name, _ in read.statements(extras[-1])))
        for found, ms in zip(out, timings, strict=True):
            found.append(ReadResult(read.name, ms, statements=names, goal=read.goal))
        big = out[-1][-1]
        if read.goal and median(big.ms) > READ_GOAL_MS:
            big.plan = _explain(sides[-1].conn, read, extras[-1])
    return out


# -- Enqueue, claim, drain ----------------------------------------------------------------


def measure_enqueue(sides: list[Side]) -> list[tuple[list[float], float]]:
    """Per side: single-enqueue milliseconds, and enqueue_many rows/s."""
    single = _alternate([_timed(functools.partial(
        side.client.enqueue, "noop", {"user_id": 7, "email": "user7@example.com"},
        queue="enqueued")) for side in sides], ENQUEUES, warm=10)
    batch = _batch("enqueued")
    many = _alternate([_timed(functools.partial(side.client.enqueue_many, batch))
                       for side in sides], BATCHES)
    return [(ms, BATCH * BATCHES / (sum(batches) / 1000))
            for ms, batches in zip(single, many, strict=True)]


def _batch(queue: str) -> list[dict[str, Any]]:
    return [{"kind": "noop", "input": {"user_id": i, "email": f"user{i}@example.com"},
             "queue": queue} for i in range(BATCH)]


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


# -- The index's write cost ------------------------------------------------------------------


@dataclass
class WriteCost:
    """Per round, with (True) and without (False) revision 4's index:
    enqueue_many rows/s and worker drain jobs/s, on a fresh database each."""

    jobs: int
    enqueue_many: dict[bool, list[float]] = field(
        default_factory=lambda: {True: [], False: []})
    drain: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})


def measure_write_cost(bench: Bench, jobs: int, rounds: int) -> WriteCost:
    """``enqueue_many`` of ``jobs`` (batches of BATCH) into queue default, then
    one worker process draining them; on a fresh database with the index and
    on one without it, alternating, the order flipped every round."""
    cost = WriteCost(jobs)
    for turn in range(rounds):
        for present in (True, False) if turn % 2 == 0 else (False, True):
            with bench.database("bigtable_write") as url, \
                    psycopg.connect(url, autocommit=True) as conn, \
                    belay.Belay(url, max_pool_size=1) as client:
                if not present:
                    conn.execute(f'DROP INDEX "{NEW_INDEX}"')
                batch = _batch("default")
                started = time.perf_counter()
                for _ in range(max(jobs // BATCH, 1)):
                    client.enqueue_many(batch)
                cost.enqueue_many[present].append(
                    max(jobs // BATCH, 1) * BATCH / (time.perf_counter() - started))
                cost.drain[present].append(measure_drain(url, conn, jobs))
                bench.log(f"bigtable write cost, round {turn + 1}, index "
                          f"{'present' if present else 'dropped'}: enqueue_many "
                          f"{cost.enqueue_many[present][-1]:,.0f} rows/s, drain "
                          f"{cost.drain[present][-1]:,.0f} jobs/s")
    return cost


# -- Retention under load ------------------------------------------------------------------


@dataclass
class PruneRun:
    claims_ms: list[float] = field(default_factory=list)
    claimed_jobs: int = 0
    seconds: float = 0.0
    pruned: int = 0
    prune_seconds: float = 0.0
    passes: int = 0
    behind: int = 0
    #: Seconds of each prune_pass call.
    pass_s: list[float] = field(default_factory=list)
    #: (rows deleted, milliseconds, monotonic end) of each prune_jobs call.
    batches: list[tuple[int, float, float]] = field(default_factory=list)
    worker_jobs: int = 0
    longest_xact_s: float = 0.0
    modes: set[str] = field(default_factory=set)
    max_locks: int = 0
    claimer_waits: int = 0
    waited_for: set[str] = field(default_factory=set)
    #: wait_event_type:wait_event of the claimer's backend, how often sampled.
    claimer_events: Counter[str] = field(default_factory=Counter)
    samples: int = 0
    #: Whether prune_pass rested after each full batch (as a worker runs it).
    paced: bool = True
    #: The slices of the phase this turn had: (monotonic start, end).
    slices: list[tuple[float, float]] = field(default_factory=list)


def _claimer(url: str, stop: threading.Event, turn: list[PruneRun | None],
             pids: list[int]) -> None:
    """Claims back to back for the whole phase, each counted for the turn
    whose slice it started and ended in (``turn[0]``; None between slices)."""
    with psycopg.connect(url, autocommit=True) as conn:
        pids.append(conn.info.backend_pid)
        while not stop.is_set():
            run = turn[0]
            try:
                ms = _claim_once(conn)
            except _NoneReady:
                stop.set()  # the backlog ran out (a quick run on a fast machine)
                break
            if run is not None and turn[0] is run:
                run.claims_ms.append(ms)
                run.claimed_jobs += TAKE


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
    """Retention passes as the worker's sweeper runs them: ``prune_pass`` with
    its default budget, the next one PRUNE_PAUSE later while it is behind (a
    pass that caught up ends it: the sweeper would wait PRUNE_INTERVAL). Paced
    (``run.paced``), each pass rests on the stop event's wait after each full
    batch, as a worker's does; unpaced, it does not rest at all (``rest`` a
    no-op: the batches back to back, as before PRUNE_REST)."""
    # Either way the pass ends when the slice does (a rest returning true).
    rest: Callable[[float], object] = stop.wait if run.paced else (lambda _s: stop.is_set())
    with psycopg.connect(url, autocommit=True) as conn, _batches_recorded(run):
        pids.append(conn.info.backend_pid)
        started = time.monotonic()
        while not stop.is_set():
            began = time.monotonic()
            done = retention.prune_pass(conn, datetime.now(timezone.utc),
                                        retention.DEFAULT_RETENTION,
                                        retention.DEFAULT_SIGNAL_TTL, [], rest=rest)
            run.pass_s.append(time.monotonic() - began)
            run.passes += 1
            run.behind += done.behind
            run.pruned += sum(done.counts.get(s, 0) for s in retention.DEFAULT_RETENTION)
            if not done.behind:
                break
            stop.wait(retention.PRUNE_PAUSE)
        run.prune_seconds += time.monotonic() - started


def _sampler(url: str, stop: threading.Event, run: PruneRun, pruner: list[int],
             claimer: list[int]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.wait(0.1):
            if not pruner:
                continue
            row = conn.execute(ACTIVITY, {"pid": pruner[0], "waiters": claimer}).fetchone()
            if row is None:
                continue
            state, xact_age, modes, locks, waits, events = row
            run.samples += 1
            if state == "active" and xact_age is not None:
                run.longest_xact_s = max(run.longest_xact_s, float(xact_age))
            run.modes.update(modes or [])
            run.max_locks = max(run.max_locks, int(locks))
            run.claimer_waits += len(waits or [])
            run.waited_for.update(waits or [])
            run.claimer_events.update(events or [])


def count_expired(conn: psycopg.Connection[Any]) -> int:
    """Terminal rows past the default retention now (what a worker must prune)."""
    now = datetime.now(timezone.utc)
    total = 0
    for state, keep in retention.DEFAULT_RETENTION.items():
        if keep is not None:
            row = conn.execute(EXPIRED, (state, now - timedelta(seconds=keep))).fetchone()
            total += int(row[0]) if row else 0
    return total


#: The prune phase's turns: the claimer alone, with paced prune passes (as a
#: worker runs them), and with unpaced ones (no rest between batches).
PRUNE_TURNS: tuple[tuple[bool, bool], ...] = ((False, True), (True, True), (True, False))
#: The turns take slices of this many seconds in rotation (quick: a second),
#: each prune slice followed by SETTLE seconds that count for no turn.
SLICE = 10.0
SETTLE = 2.0


def _turn(with_prune: bool, paced: bool) -> str:
    return ("paced prune" if paced else "unpaced prune") if with_prune else "no prune"


def measure_prune(bench: Bench, url: str, conn: psycopg.Connection[Any], seconds: float
                  ) -> tuple[PruneRun, PruneRun, PruneRun]:
    """With a worker process draining the ready jobs and a claimer thread
    claiming back to back, ``seconds`` of each turn — no prune, paced, unpaced
    — in slices of SLICE taken in rotation. Whatever drifts over the phase
    (the claim index's dead entries piling up ahead of the backlog, autovacuum
    on the deleted rows) falls on every turn alike, where turns one after the
    other laid it on the later ones. A prune slice ends when its pass's
    current DELETE does; the SETTLE seconds after it count for no turn."""
    runs = [PruneRun(paced=paced) for _, paced in PRUNE_TURNS]
    piece = min(SLICE, max(seconds / 2, 0.5))
    settle = min(SETTLE, piece / 5)
    rounds = max(round(seconds / piece), 1)
    turn: list[PruneRun | None] = [None]
    stop = threading.Event()
    claimer: list[int] = []
    with _worker(url):
        time.sleep(1)
        claiming = threading.Thread(target=_claimer, args=(url, stop, turn, claimer),
                                    name="bench-claimer")
        claiming.start()
        try:
            for _ in range(rounds):
                for (with_prune, _), run in zip(PRUNE_TURNS, runs, strict=True):
                    if stop.is_set():
                        break
                    _slice(url, conn, run, with_prune, piece, turn, claimer)
                    turn[0] = None
                    if with_prune:
                        stop.wait(settle)
        finally:
            stop.set()
            claiming.join(120)
    for (with_prune, paced), run in zip(PRUNE_TURNS, runs, strict=True):
        bench.log(f"bigtable: claims, {_turn(with_prune, paced)} ({len(run.slices)} slices "
                  f"of {piece:g} s): p50 {percentile(run.claims_ms, 50):.2f} ms, "
                  f"p99 {percentile(run.claims_ms, 99):.2f} ms, worker "
                  f"{run.worker_jobs / max(run.seconds, 1e-9):,.0f} jobs/s"
                  + (f"; pruned {run.pruned:,} in {run.prune_seconds:.0f} s, "
                     f"{run.passes} passes" if with_prune else "")
                  + (", claimer waits " + ", ".join(
                      f"{event} {n}x" for event, n in run.claimer_events.most_common(5))
                     if with_prune else ""))
    return runs[0], runs[1], runs[2]


def _slice(url: str, conn: psycopg.Connection[Any], run: PruneRun, with_prune: bool,
           seconds: float, turn: list[PruneRun | None], claimer: list[int]) -> None:
    """One slice of ``run``'s turn: ``seconds`` of claims counted for it, with
    a pruner (and a sampler) beside them when ``with_prune``."""
    stop = threading.Event()
    pruner: list[int] = []
    threads = [threading.Thread(target=_pruner, args=(url, stop, run, pruner),
                                name="bench-pruner"),
               threading.Thread(target=_sampler, args=(url, stop, run, pruner, claimer),
                                name="bench-sampler")] if with_prune else []
    since = datetime.now(timezone.utc)
    started = time.monotonic()
    claimed = run.claimed_jobs
    turn[0] = run
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    turn[0] = None
    ended = time.monotonic()
    stop.set()
    for thread in threads:
        thread.join(120)
    row = conn.execute(FINISHED_BETWEEN, (since, datetime.now(timezone.utc))).fetchone()
    run.worker_jobs += (int(row[0]) if row else 0) - (run.claimed_jobs - claimed)
    run.slices.append((started, ended))
    run.seconds += ended - started


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
    #: (without prune, paced prune, unpaced prune)
    prune: tuple[PruneRun, PruneRun, PruneRun] | None = None
    expired: int = 0
    index: IndexBuild | None = None
    write: WriteCost | None = None


def measure(bench: Bench, small: Sizes, big: Sizes, drain: int) -> tuple[Measured, Measured]:
    write = measure_write_cost(bench, drain, bench.size(2, WRITE_ROUNDS))
    sides: list[Side] = []
    with contextlib.ExitStack() as stack:
        for sizes in (small, big):
            url = stack.enter_context(bench.database("bigtable"))
            conn = stack.enter_context(psycopg.connect(url, autocommit=True))
            client = stack.enter_context(belay.Belay(url, max_pool_size=2))
            side = Side(sizes, url, conn, client, fill(bench, conn, sizes))
            sides.append(side)
        index = build_index(bench, sides[-1].conn)
        for side in sides:
            row = side.conn.execute(
                "SELECT pg_size_pretty(pg_total_relation_size('belay_jobs'))").fetchone()
            side.table_size = str(row[0]) if row else "?"
        found = measure_reads(sides)
        for read_small, read_big in zip(*found, strict=True):
            bench.log(f"bigtable: {read_big.name}: p50 {median(read_small.ms):.1f} ms "
                      f"small, {median(read_big.ms):.1f} ms big")
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
        expired = count_expired(sides[-1].conn)
        bench.log(f"bigtable: {expired:,} expired terminal rows before the prune phase")
        prune = measure_prune(bench, sides[-1].url, sides[-1].conn, bench.size(2, 60))
        results = [
            Measured(side.sizes, side.fill_s, side.table_size, reads, ms, many, claimed, rate)
            for side, reads, (ms, many), claimed, rate
            in zip(sides, found, enqueued, claims, rates, strict=True)]
        results[-1].prune, results[-1].expired = prune, expired
        results[-1].index, results[-1].write = index, write
        return results[0], results[1]


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _prune_figures(b: str, expired: int, quiet: PruneRun, busy: PruneRun) -> list[Figure]:
    """The prune phase's figures for one turn with pruning: paced (as a worker
    runs it: the claim p99 goal) or unpaced (the comparison, no goal)."""
    out = []
    during = "during prune" if busy.paced else "during unpaced prune"
    p99 = percentile(busy.claims_ms, 99) / percentile(quiet.claims_ms, 99)
    rows = max((n for n, _, _ in busy.batches), default=0)
    slowest = max((ms for _, ms, _ in busy.batches), default=0.0)
    how = (f"paced as a worker runs it (rests PRUNE_REST {retention.PRUNE_REST:g} x each "
           "full batch's time, on the stop event's wait)" if busy.paced
           else "unpaced (rest a no-op: the batches back to back, as before PRUNE_REST)")
    note = (f"retention.prune_pass {how}, as the sweeper runs it (PRUNE_BUDGET "
            f"{retention.PRUNE_BUDGET:g} s, PRUNE_PAUSE {retention.PRUNE_PAUSE:g} s while "
            f"behind; PRUNE_BATCH {retention.PRUNE_BATCH}, PRUNE_BATCHES "
            f"{retention.PRUNE_BATCHES}; default retention: succeeded 1 day, failed/"
            f"cancelled 7 days); {busy.passes} passes ({busy.behind} behind), longest "
            f"{max(busy.pass_s, default=0.0):.2f} s; {len(busy.batches):,} DELETE "
            f"statements, largest {rows} rows, slowest {slowest:.0f} ms; "
            f"sampled {busy.samples}x: longest prune transaction seen "
            f"{busy.longest_xact_s * 1000:.0f} ms, locks on belay_jobs "
            f"{', '.join(sorted(busy.modes)) or 'none seen'}, claimer lock waits seen "
            f"{busy.claimer_waits}" + (f" ({', '.join(sorted(busy.waited_for))})"
                                       if busy.waited_for else "")
            + ", claimer's wait events seen " + (", ".join(
                f"{event} {n}x" for event, n in busy.claimer_events.most_common(5))
                or "none"))
    for p, ratio_goal in ((50, None), (99, 2.0 if busy.paced else None)):
        value = percentile(busy.claims_ms, p)
        out.append(Figure(
            SECTION, f"claim p{p} {during}, {b}", value, "ms",
            baseline=f"claim p{p} without prune, same database",
            baseline_value=percentile(quiet.claims_ms, p), higher_is_better=False,
            target="≤ 2x" if ratio_goal else None,
            met=(p99 <= ratio_goal) if ratio_goal else None, note=note))
    out.append(Figure(
        SECTION, f"claim + ack of the claimer thread {during}, {b}",
        busy.claimed_jobs / busy.seconds, "jobs/s", baseline="without prune, same database",
        baseline_value=quiet.claimed_jobs / quiet.seconds,
        note="store.claim of 10 + ack_succeeded_many, one connection, back to back"))
    out.append(Figure(
        SECTION, f"worker process jobs/s {during}, {b}", busy.worker_jobs / busy.seconds,
        "jobs/s", baseline="without prune, same database",
        baseline_value=quiet.worker_jobs / quiet.seconds,
        note="belay.Worker (default=100, polling, its own retention off), draining the "
             "ready rows beside the claimer thread"))
    slices = busy.slices
    half = slices[len(slices) // 2][0] if len(slices) > 1 else float("inf")
    first = sum(n for n, _, at in busy.batches if at < half)
    rate = busy.pruned / max(busy.prune_seconds, 1e-9)
    name = "prune rate" if busy.paced else "prune rate unpaced"
    out.append(Figure(
        SECTION, f"{name}, {b}", rate,
        "rows/s", note=f"{busy.pruned:,} rows in {busy.prune_seconds:.0f} s of "
        f"{len(slices)} slices ({first:,} in the first half of them, "
        f"{busy.pruned - first:,} in the second)",
        extra={"pruned": busy.pruned}))
    if busy.paced and expired and rate:
        out.append(Figure(
            SECTION, f"one worker clearing the expired rows at that rate, {b}",
            expired / rate / 60, "min", higher_is_better=False,
            note=f"{expired:,} rows past the default retention before the prune "
                 f"phase ÷ the paced prune rate: about {_duration(expired / rate)} "
                 "(projected, not measured)"))
    return out


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
             target=f"< {READ_GOAL_MS:.0f} ms" if read.goal else None,
             met=value < READ_GOAL_MS if read.goal else None,
             note=f"median of {READ_RUNS} after one untimed (slowest {max(read.ms):,.1f} ms); "
                  f"{read.statements}")
    if big.index is not None:
        index = big.index
        for what, value, how_it_locks in (
                ("CREATE INDEX", index.plain_s, "what migration 4 runs; blocks writes "
                 "to belay_jobs for as long"),
                ("CREATE INDEX CONCURRENTLY", index.concurrent_s, "writes go on")):
            out.append(Figure(SECTION, f"{what} {NEW_INDEX}, {b}", value, "s",
                              higher_is_better=False,
                              note=f"{how_it_locks}; index {index.size}; {index.settings}"))
    if big.write is not None:
        cost = big.write
        for what, values, unit in (
                (f"enqueue_many of {cost.jobs:,} (batches of {BATCH:,}) with {NEW_INDEX}",
                 cost.enqueue_many, "rows/s"),
                (f"drain of {cost.jobs:,}, 1 worker process, with {NEW_INDEX}",
                 cost.drain, "jobs/s")):
            out.append(Figure(
                SECTION, what + ", fresh database", median(values[True]), unit,
                baseline="without it (DROP INDEX), fresh database",
                baseline_value=median(values[False]),
                note=f"median of {len(values[True])} rounds, alternating; with: "
                     + ", ".join(f"{v:,.0f}" for v in values[True]) + "; without: "
                     + ", ".join(f"{v:,.0f}" for v in values[False])))
    if big.prune is not None:
        quiet, paced, unpaced = big.prune
        for busy in (paced, unpaced):
            out += _prune_figures(b, big.expired, quiet, busy)
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
        lines += ["### Reads over the goal at the big size: EXPLAIN (ANALYZE, BUFFERS)", ""]
        for read in slow:
            lines += [f"**{read.name}** (median {median(read.ms):,.0f} ms)", "", "```",
                      read.plan, "```", ""]
    else:
        lines += [f"Every read with a goal took under {READ_GOAL_MS:.0f} ms at the big size "
                  "(no EXPLAIN needed).", ""]
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
    parser = arguments("python -m bench.bigtable", __doc__,
                       "200k terminal + 40k ready rows (CI)",
                       out="also write the Markdown section here")
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
