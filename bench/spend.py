"""Spend analytics on a big table: what ``Belay.spend`` and ``Belay.spend_tree``
cost at 10M jobs of which a tenth spent something, what schema revision 6's
partial index (``belay_jobs_spend_idx``, on ``inserted_at`` where the job spent)
saves them, and what it costs the step journal's writes.

``python -m bench.spend --url URL [--jobs N | --quick] [--out FILE] [--keep]``

Method. First the write side, on small fresh databases (:func:`measure_writes`):
one ``belay.Worker`` (``belay.testing.drain``, in this process) runs
:data:`WRITE_JOBS` jobs of :data:`WRITE_STEPS` journaled steps each, every step
with ``cost=belay.Cost(usd=0.01, tokens=500)``; then :data:`RAW_STEPS` more
steps per job through belay's ``put_step`` statement alone
(``belay.store.put_step``, one autocommit call each, timed one by one). Three
variants, each on a fresh database, :data:`WRITE_ROUNDS` rounds, the order
flipped every round: with the spend index (as migrated), without it (``DROP
INDEX``), and with it but steps without a cost (the update changes no spend
column: it may stay HOT). ``pg_stat_user_tables`` counts the updates of
belay_jobs each part made and how many were HOT.

Then one big database (``belay_bench_spend``), migrated, filled by SQL alone
(:func:`fill`; ``generate_series`` in chunks of :data:`CHUNK`, no row passes
through Python) with N jobs (default 10M), ids in time order, enqueued evenly
over the last :data:`DAYS` days. Every :data:`SPEND_EVERY`-th job spent
something (1-6 steps with a cost, tokens and dollars priced per kind); the rest
spent nothing, and a tenth of them have 1-3 steps without a cost. 20 kinds
(10 agent kinds that spend, 10 plain ones, skewed), 5 queues; states 95 %
succeeded, 4 % failed, 1 % cancelled. Spending jobs carry ``meta.customer``,
one of :data:`CUSTOMERS` (skewed: the first few are the big ones). A third of
the spending jobs are in trees (blocks of 24 spending jobs: a ``lead`` root,
5-20 children and the rest grandchildren, up to 24 nodes); half of those trees
shared their root's budget, so the root carries a ``$spend:fan`` step charging
its children's spend back to it, as ``map_children(budget="share")`` writes.
Two big trees of :data:`BIG_TREE` nodes (a fifth of them children, the rest
grandchildren) hang off roots 3 days and 1 day back, the first one shared. belay's secondary
indexes are dropped for the fill and built again after it (their own
definitions), then ``VACUUM (ANALYZE)`` (the visibility map set, as a real
table's would be) and a ``CHECKPOINT``.

Reads, through the client API, on two clients of one connection each
(:func:`_clients`): ``Belay(url)`` as it comes, whose statements psycopg
prepares on their 5th run (the server may then settle on a generic plan;
warmed first by :data:`WARM_CALLS` calls of each spend statement), and
``Belay(url, pooler="transaction")``, which never prepares (a custom plan
every call, as a one-shot ``belay spend`` gets). Each read once untimed on
each, then :data:`READ_RUNS` timed rounds, the two clients one after the
other in each, the medians reported; then ``EXPLAIN (ANALYZE, BUFFERS)`` of
the same statement with the same parameters (``belay.spend.Query.params``)
on another connection, as a custom plan and as the generic plan (PREPARE,
``plan_cache_mode = force_generic_plan``). Then, on the big database, the
write parts as above (:data:`WRITE_JOBS` jobs of journaled steps with a
cost, then put_step alone) with the index, without it, with, without, with:
dropped the first time, the baseline reads (what they cost without the
index) are measured; built again by ``CREATE INDEX`` (what migration 6 runs)
and the second time by ``CREATE INDEX CONCURRENTLY``, both timed. The big
database is dropped at the end unless ``--keep``.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from psycopg import sql

import belay
import belay.testing
from belay import schema, store
from belay.codec import encode_value
from belay.spend import Query
from belay.sql import QUERIES, migrations
from bench.core import Bench, Figure, arguments, median, percentile
from bench.report import machine_table, publish

SECTION = "spend"
DATABASE = "belay_bench_spend"
INDEX = "belay_jobs_spend_idx"
#: The big table: jobs by default, and at --quick.
FULL_JOBS = 10_000_000
QUICK_JOBS = 200_000
#: Rows per INSERT of the fill.
CHUNK = 1_000_000
DAYS = 90
#: One job in this many spent something.
SPEND_EVERY = 10
CUSTOMERS = 1_000
#: Spending jobs per tree block; every third block holds a tree, every sixth a shared one.
BLOCK = 24
#: Nodes of each big tree (the root, a fifth of them children, the rest
#: grandchildren); fewer in a small table (:func:`big_tree`).
BIG_TREE = 1_000
#: Days back of each big tree's root; the first one shares its budget.
BIG_TREE_DAYS = (3, 1)
READ_RUNS = 5
#: Calls of spend_by that warm the prepared client first (past psycopg's
#: prepare threshold, 5, and the server's 5 custom plans).
WARM_CALLS = 12
#: The write side: jobs, journaled steps per job, raw put_step calls per job, rounds.
WRITE_JOBS = 200
WRITE_STEPS = 10
RAW_STEPS = 5
WRITE_ROUNDS = 3
WRITE_QUEUE = "spendbench"
WRITE_KIND = "spend_step"
COST = belay.Cost(usd=0.01, tokens=500)
#: A step's value: an agent's answer, shortened.
ANSWER = {"text": "The quarterly numbers look fine; the churn line needs a second look. " * 3,
          "model": "model-x", "finish": "stop"}

AGENT_KINDS = ("lead", "research", "summarize", "draft_reply", "classify_ticket",
               "extract_invoice", "translate", "code_review", "web_agent", "plan_trip")
PLAIN_KINDS = ("send_email", "build_report", "sync_crm", "resize_image", "webhook",
               "audit_event", "charge_card", "index_document", "notify_slack", "cleanup")
KINDS = AGENT_KINDS + PLAIN_KINDS
#: Each kind's queue (5 queues).
QUEUE_OF = ("agents", "agents", "agents", "emails", "default", "reports", "default",
            "agents", "agents", "default",
            "emails", "reports", "default", "default", "webhooks", "default", "default",
            "reports", "webhooks", "default")
#: Micro-dollars per token of each kind (a model's price; 0 for the plain kinds).
PRICE = (15, 3, 1, 3, 1, 3, 1, 15, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

#: u(x, seed): a uniform number in [0, 1) from a hash of x (pg_temp, the fill's session).
HELPERS = """
CREATE OR REPLACE FUNCTION pg_temp.u(x bigint, seed bigint) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (hashint8extended(x, seed) & 4294967295)::float8 / 4294967296.0 $$
"""
#: One row per job id g of [lo, hi]: everything the jobs and steps fills derive
#: from it. Spending jobs are g = SPEND_EVERY * (m + 1); m's block b = m / BLOCK
#: holds a tree when b %% 3 = 0 (offset o = 0 the root, 1..children its
#: children, the rest of its size grandchildren, each under child
#: 1 + (o - children - 1) %% children); shared when b %% 6 = 0.
BASE = """
SELECT g, sp, role, b, o, parent_id, kind_idx, k, t0, shared_root,
       CASE WHEN sp THEN 'cust-' || lpad(floor(%(customers)s * pg_temp.u(
              CASE WHEN role = 'solo' THEN g ELSE b END, 9) ^ 2)::int::text, 4, '0') END
         AS customer,
       %(t0)s::timestamptz + (g - 1)::float8 / %(n)s * %(span)s * interval '1 second'
         AS inserted_at,
       CASE WHEN pg_temp.u(g, 11) < 0.95 THEN 'succeeded'
            WHEN pg_temp.u(g, 11) < 0.99 THEN 'failed' ELSE 'cancelled' END AS state,
       CASE WHEN kind_idx < 10 THEN 5 + 115 * pg_temp.u(g, 12)
            ELSE 0.05 + 2 * pg_temp.u(g, 12) END AS seconds
FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g,
LATERAL (SELECT g %% %(every)s = 0 AS sp, g / %(every)s - 1 AS m) AS a,
LATERAL (SELECT m / %(block)s AS b, m %% %(block)s AS o) AS c,
LATERAL (SELECT 6 + floor(pg_temp.u(b, 7) * (%(block)s - 5))::int AS size) AS d,
LATERAL (SELECT 5 + floor(pg_temp.u(b, 8) * (size - 5))::int AS children,
                sp AND b %% 3 = 0 AND o < size AS in_tree) AS e,
LATERAL (SELECT CASE WHEN NOT sp THEN 'plain' WHEN NOT in_tree THEN 'solo'
                     WHEN o = 0 THEN 'root' WHEN o <= children THEN 'child'
                     ELSE 'grandchild' END AS role) AS f,
LATERAL (SELECT
  CASE role WHEN 'child' THEN (%(block)s * b + 1) * %(every)s
            WHEN 'grandchild' THEN (%(block)s * b + 2 + (o - children - 1) %% children)
                                   * %(every)s END AS parent_id,
  role = 'root' AND b %% 6 = 0 AS shared_root,
  CASE role WHEN 'plain' THEN 10 + floor(10 * pg_temp.u(g, 10) ^ 2)::int
            WHEN 'root' THEN 0
            WHEN 'child' THEN 1 + floor(3 * pg_temp.u(g, 10))::int
            WHEN 'grandchild' THEN (ARRAY[2, 8])[1 + floor(2 * pg_temp.u(g, 10))::int]
            ELSE 1 + floor(9 * pg_temp.u(g, 10) ^ 1.5)::int END AS kind_idx,
  CASE WHEN sp THEN 1 + floor(6 * pg_temp.u(g, 3))::int
       WHEN pg_temp.u(g, 5) < 0.1 THEN 1 + floor(3 * pg_temp.u(g, 6))::int
       ELSE 0 END AS k,
  100 + floor(4000 * pg_temp.u(g, 4) ^ 2)::bigint AS t0) AS h
"""
#: The jobs: a spending one's tokens are its steps' (t0 * s for step s of k),
#: its dollars those times its kind's price.
FILL_JOBS = """
INSERT INTO belay_jobs (id, kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at, started_at, finished_at, parent_id,
                        spent_usd_micros, spent_tokens, result, errors)
SELECT g, (%(kinds)s::text[])[kind_idx + 1], (%(queues)s::text[])[kind_idx + 1], state,
       CASE WHEN sp THEN jsonb_build_object(
              'prompt', 'task ' || g || ': ' || repeat('w', (g %% 80)::int),
              'request_id', md5(g::text), 'max_tokens', 4096)
            ELSE jsonb_build_object('user_id', g, 'request_id', md5(g::text),
                                    'note', repeat('x', (g %% 60)::int)) END,
       CASE WHEN sp THEN jsonb_build_object('customer', customer, 'source', 'api')
            ELSE '{}'::jsonb END,
       0, CASE WHEN state = 'failed' THEN 3 ELSE 1 END, 3,
       inserted_at, inserted_at, inserted_at + interval '0.5 seconds',
       inserted_at + interval '0.5 seconds' + seconds * interval '1 second',
       parent_id,
       CASE WHEN sp THEN t0 * k * (k + 1) / 2 * (%(prices)s::int[])[kind_idx + 1] ELSE 0 END,
       CASE WHEN sp THEN t0 * k * (k + 1) / 2 ELSE 0 END,
       CASE WHEN state = 'succeeded' THEN convert_to(jsonb_build_object(
              'ok', true, 'id', md5(g::text || 'r'), 'summary', repeat('y', (g %% 90)::int))::text,
              'UTF8') END,
       CASE WHEN state = 'failed' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 3, 'kind', 'TimeoutError', 'message', 'upstream timed out after 30 s'))
            WHEN state = 'cancelled' THEN jsonb_build_array(jsonb_build_object(
              'attempt', 1, 'kind', 'cancelled', 'message', 'cancelled by an operator'))
            ELSE '[]'::jsonb END
FROM ({base}) AS base
"""
#: The steps: k per job (LLM calls with a cost on spending jobs, plain steps on the others).
FILL_STEPS = """
INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
SELECT g, s, CASE WHEN sp THEN 'llm:call-' || s ELSE 'step-' || s END,
       convert_to(jsonb_build_object('text', repeat('z', 40 + ((g + s) %% 160)::int),
                                     'finish', 'stop')::text, 'UTF8'),
       CASE WHEN sp THEN t0 * s * (%(prices)s::int[])[kind_idx + 1] ELSE 0 END,
       CASE WHEN sp THEN t0 * s ELSE 0 END,
       inserted_at + (1 + s) * interval '1 second'
FROM ({base}) AS base, generate_series(1, k) AS s
WHERE k > 0
"""
#: A big tree: the first BIG_TREE - 1 spending jobs after the root that are in
#: no tree; a fifth of them children of the root, the rest grandchildren.
BIG_TREE_SQL = """
WITH pool AS (
  SELECT id, row_number() OVER (ORDER BY id) AS r FROM (
    SELECT id FROM belay_jobs
    WHERE id > %(root)s AND id %% %(every)s = 0 AND parent_id IS NULL
      AND ((id / %(every)s - 1) / %(block)s) %% 3 <> 0 AND kind <> 'lead'
    ORDER BY id LIMIT %(nodes)s) AS p
), linked AS (
  SELECT a.id, CASE WHEN a.r <= %(children)s THEN %(root)s ELSE b.id END AS parent_id,
         CASE WHEN a.r <= %(children)s THEN 'web_agent' ELSE 'summarize' END AS kind
  FROM pool AS a
  LEFT JOIN pool AS b ON a.r > %(children)s
   AND b.r = 1 + (a.r - %(children)s - 1) %% %(children)s
)
UPDATE belay_jobs AS j
SET parent_id = linked.parent_id, kind = linked.kind, queue = 'agents',
    meta = (SELECT meta FROM belay_jobs WHERE id = %(root)s)
FROM linked WHERE j.id = linked.id
"""
#: A solo spending job (in no tree block) at or after an id: a big tree's root.
BIG_ROOT = """
SELECT min(id) FROM belay_jobs
WHERE id >= %(target)s AND id %% %(every)s = 0 AND parent_id IS NULL
  AND ((id / %(every)s - 1) / %(block)s) %% 3 <> 0 AND kind <> 'lead'
"""
#: What map_children(budget="share") writes at fan-in: a `$spend:fan` step on
#: the root with its children's spend, added to the root's own.
CHARGE_BACK = """
WITH back AS (
  SELECT parent_id AS id, sum(spent_usd_micros)::bigint AS usd, sum(spent_tokens)::bigint AS tokens,
         max(finished_at) AS at
  FROM belay_jobs
  WHERE parent_id = ANY(%(roots)s::bigint[])
     OR (parent_id %% %(every)s = 0 AND (parent_id / %(every)s - 1) %% %(block)s = 0
         AND ((parent_id / %(every)s - 1) / %(block)s) %% 6 = 0)
  GROUP BY parent_id
), journaled AS (
  INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
  SELECT id, 100, '$spend:fan',
         convert_to(json_build_object('usd_micros', usd, 'tokens', tokens)::text, 'UTF8'),
         usd, tokens, at
  FROM back
)
UPDATE belay_jobs AS j
SET spent_usd_micros = j.spent_usd_micros + back.usd,
    spent_tokens = j.spent_tokens + back.tokens,
    finished_at = greatest(j.finished_at, back.at)
FROM back WHERE j.id = back.id
"""
SECONDARY = """
SELECT indexname, indexdef FROM pg_indexes
WHERE tablename = 'belay_jobs' AND indexname <> 'belay_jobs_pkey'
"""
#: The big trees' roots (the only `lead` jobs outside the tree blocks), whether shared.
BIG_ROOTS = """
SELECT p.id, EXISTS (SELECT 1 FROM belay_steps AS s WHERE s.job_id = p.id
                       AND s.name = '$spend:fan')
FROM belay_jobs AS p
WHERE p.kind = 'lead' AND p.id %% %(every)s = 0
  AND ((p.id / %(every)s - 1) / %(block)s) %% 3 <> 0
ORDER BY p.id
"""
#: A shared tree root of the block scheme, the newest below 99 %% of the ids.
SMALL_ROOT = """
SELECT max(id) FROM belay_jobs
WHERE id < %(below)s AND id %% %(every)s = 0 AND (id / %(every)s - 1) %% %(block)s = 0
  AND ((id / %(every)s - 1) / %(block)s) %% 6 = 0
"""
DESCRIBE = """
SELECT count(*),
       count(*) FILTER (WHERE spent_usd_micros <> 0 OR spent_tokens <> 0),
       count(*) FILTER (WHERE parent_id IS NOT NULL),
       count(DISTINCT parent_id),
       count(DISTINCT kind), count(DISTINCT queue),
       count(DISTINCT meta ->> 'customer'),
       min(inserted_at), max(inserted_at)
FROM belay_jobs
"""
DESCRIBE_STEPS = """
SELECT count(*), count(*) FILTER (WHERE name >= '$spend:' AND name < '$spend;'),
       count(*) FILTER (WHERE usd_micros <> 0 OR tokens <> 0)
FROM belay_steps
"""
SIZES = """
SELECT pg_relation_size('belay_jobs'), pg_total_relation_size('belay_jobs'),
       pg_indexes_size('belay_jobs'), pg_relation_size(%(index)s::regclass),
       pg_relation_size('belay_jobs_pkey'), pg_total_relation_size('belay_steps')
"""
UPDATES = """
SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'belay_jobs'
"""


def _count(rows: int) -> str:
    if rows >= 1_000_000:
        return f"{rows / 1_000_000:g}M"
    return f"{rows / 1_000:g}k" if rows >= 1_000 else str(rows)


def _mb(size: int) -> str:
    return f"{size / 2**20:,.0f} MB" if size >= 2**20 else f"{size / 1024:,.0f} kB"


# -- Filling -------------------------------------------------------------------------------


@dataclass
class Table:
    """What the big database holds, and what it took to fill."""

    jobs: int
    fill_s: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)
    #: (shared big root, other big root, a shared small tree's root)
    roots: tuple[int, int, int] = (0, 0, 0)
    heap: int = 0
    total: int = 0
    indexes: int = 0
    index: int = 0
    pkey: int = 0
    steps: int = 0


def _params(jobs: int, lo: int, hi: int, t0: Any) -> dict[str, Any]:
    return {"lo": lo, "hi": hi, "n": jobs, "t0": t0, "span": DAYS * 86400.0,
            "every": SPEND_EVERY, "block": BLOCK, "customers": CUSTOMERS,
            "kinds": list(KINDS), "queues": list(QUEUE_OF), "prices": list(PRICE)}


def big_tree(jobs: int) -> int:
    """Nodes of a big tree: BIG_TREE, or in a small table fewer, so that each
    tree's spending jobs span well under a day (they are taken in id order)."""
    return max(min(BIG_TREE, jobs // 2_000), 10)


def fill(bench: Bench, conn: psycopg.Connection[Any], jobs: int) -> float:
    """Fill the migrated (empty) database with ``jobs`` jobs and their steps by
    SQL; returns the seconds it took. belay's secondary indexes are dropped for
    the INSERTs and built again after them, from their own definitions."""
    started = time.monotonic()
    conn.execute(HELPERS)
    conn.execute("SET maintenance_work_mem = '256MB'")
    indexes = conn.execute(SECONDARY).fetchall()
    for name, _ in indexes:
        conn.execute(f'DROP INDEX "{name}"')
    row = conn.execute("SELECT now() - %s * interval '1 day'", (DAYS,)).fetchone()
    assert row is not None
    t0 = row[0]
    jobs_sql = FILL_JOBS.replace("{base}", BASE)
    steps_sql = FILL_STEPS.replace("{base}", BASE)
    for lo in range(1, jobs + 1, CHUNK):
        hi = min(lo + CHUNK - 1, jobs)
        conn.execute(jobs_sql, _params(jobs, lo, hi, t0))
        conn.execute(steps_sql, _params(jobs, lo, hi, t0))
        bench.log(f"spend: jobs {lo:,}-{hi:,} and their steps at "
                  f"{time.monotonic() - started:.0f} s")
    roots = []
    nodes = big_tree(jobs)
    for days in BIG_TREE_DAYS:
        target = max(int(jobs * (1 - days / DAYS)), 1)
        found = conn.execute(BIG_ROOT, {"target": target, "every": SPEND_EVERY,
                                        "block": BLOCK}).fetchone()
        if found is None or found[0] is None:
            raise RuntimeError(f"no root for a big tree {days} days back")
        root = int(found[0])
        conn.execute("UPDATE belay_jobs SET kind = 'lead', queue = 'agents' WHERE id = %s",
                     (root,))
        conn.execute(BIG_TREE_SQL, {"root": root, "nodes": nodes - 1,
                                    "children": nodes // 5, "every": SPEND_EVERY,
                                    "block": BLOCK})
        roots.append(root)
    conn.execute(CHARGE_BACK, {"roots": roots[:1], "every": SPEND_EVERY, "block": BLOCK})
    conn.execute("SELECT setval(pg_get_serial_sequence('belay_jobs', 'id'), %s)", (jobs,))
    bench.log(f"spend: big trees and charge-backs at {time.monotonic() - started:.0f} s; "
              f"building {len(indexes)} indexes")
    for _, definition in indexes:
        conn.execute(definition)
    conn.execute("RESET maintenance_work_mem")
    bench.log(f"spend: indexes at {time.monotonic() - started:.0f} s; VACUUM (ANALYZE)")
    conn.execute("VACUUM (ANALYZE) belay_jobs")
    conn.execute("VACUUM (ANALYZE) belay_steps")
    _checkpoint(conn)
    seconds = time.monotonic() - started
    bench.log(f"spend: {jobs:,} jobs filled in {seconds:.0f} s")
    return seconds


def _checkpoint(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


def describe(conn: psycopg.Connection[Any], table: Table) -> None:
    """Count what the table holds; find the trees' roots; the relations' sizes."""
    row: Any = conn.execute(DESCRIBE).fetchone()
    keys = ("jobs", "spending jobs", "jobs with a parent", "parents", "kinds", "queues",
            "customers", "oldest inserted_at", "newest inserted_at")
    table.facts = dict(zip(keys, row, strict=True))
    row = conn.execute(DESCRIBE_STEPS).fetchone()
    table.facts.update(zip(("steps", "$spend: charge-back steps", "steps with a cost"), row,
                           strict=True))
    big = conn.execute(BIG_ROOTS, {"every": SPEND_EVERY, "block": BLOCK}).fetchall()
    shared = next((int(r[0]) for r in big if r[1]), int(big[0][0]))
    other = next((int(r[0]) for r in big if int(r[0]) != shared), shared)
    small = conn.execute(SMALL_ROOT, {"below": int(table.jobs * 0.99), "every": SPEND_EVERY,
                                      "block": BLOCK}).fetchone()
    table.roots = (shared, other, int(small[0]) if small and small[0] else shared)
    _sizes(conn, table)


def _sizes(conn: psycopg.Connection[Any], table: Table) -> None:
    row: Any = conn.execute(SIZES, {"index": INDEX}).fetchone()
    table.heap, table.total, table.indexes, table.index, table.pkey, table.steps = (
        int(v) for v in row)


# -- Reads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """One read of the client API, and the statement and parameters it runs."""

    name: str
    by: tuple[str, ...] = ("kind",)
    since: timedelta = timedelta(days=7)
    kind: str | None = None
    #: spend_tree of this root (an index into Table.roots) instead of spend_by.
    tree: int | None = None

    def call(self, client: belay.Belay, table: Table) -> Callable[[], object]:
        if self.tree is not None:
            root = table.roots[self.tree]
            return lambda: client.spend_tree(root)
        by = self.by[0] if len(self.by) == 1 else self.by
        return lambda: client.spend(by, since=self.since, kind=self.kind)

    def statement(self, client: belay.Belay, table: Table) -> tuple[str, dict[str, Any]]:
        if self.tree is not None:
            return "spend_tree", {"job_id": table.roots[self.tree]}
        by = self.by[0] if len(self.by) == 1 else self.by
        query = Query.of(client.clock.now(), by, since=self.since, kind=self.kind)
        return "spend_by", query.params()


def reads() -> list[Read]:
    day, week, month = timedelta(days=1), timedelta(days=7), timedelta(days=30)
    return [
        Read("by kind, last 24h", since=day),
        Read("by kind, last 7d", since=week),
        Read("by kind, last 30d", since=month),
        Read(f"by kind, all {DAYS}d (since {DAYS + 1}d)", since=timedelta(days=DAYS + 1)),
        Read("by day, last 30d", by=("day",), since=month),
        Read("by (day, kind), last 30d", by=("day", "kind"), since=month),
        Read("by meta:customer, last 7d", by=("meta:customer",), since=week),
        Read("by tree, last 7d", by=("tree",), since=week),
        Read("kind=research, by kind, last 7d", since=week, kind="research"),
        Read("spend_tree of the big shared root", tree=0),
        Read("spend_tree of a small shared root", tree=2),
    ]


def baseline_reads() -> list[Read]:
    return [Read("by kind, last 7d, without the spend index", since=timedelta(days=7)),
            Read("by kind, last 24h, without the spend index", since=timedelta(days=1))]


@dataclass
class ReadResult:
    """A read's milliseconds on the prepared client (``ms``) and on the
    unprepared one (``custom_ms``), its answer's size, and its plans."""

    name: str
    ms: list[float]
    custom_ms: list[float]
    plan: list[str] = field(default_factory=list)
    #: The custom plan again, with jit off.
    no_jit: list[str] = field(default_factory=list)
    generic: list[str] = field(default_factory=list)
    groups: int = 0
    jobs: int = 0
    usd: float = 0.0

    @property
    def explain_ms(self) -> float | None:
        return _execution_ms(self.plan)

    @property
    def generic_ms(self) -> float | None:
        return _execution_ms(self.generic)

    @property
    def no_jit_ms(self) -> float | None:
        return _execution_ms(self.no_jit)

    @property
    def jit(self) -> str:
        """The custom plan's JIT time, when it used JIT."""
        for line in self.plan:
            found = re.match(r"\s*Timing: .*Total ([\d.]+) ms", line)
            if found:
                return f"JIT {float(found.group(1)):,.0f} ms"
        return ""

    @property
    def scan(self) -> str:
        """The plan's node reading belay_jobs first (the range, or the tree's root)."""
        for line in self.plan:
            if " on belay_jobs" in line:
                node = line.strip().lstrip("-> ").split("  (")[0]
                rows = re.search(r"actual time=[\d.]+\.\.[\d.]+ rows=(\d+) loops=(\d+)", line)
                return node + (f" (rows={rows.group(1)} loops={rows.group(2)})" if rows else "")
        return ""

    @property
    def buffers(self) -> str:
        for line in self.plan:
            if line.strip().startswith("Buffers:"):
                return line.strip()[len("Buffers: "):]
        return ""


def _execution_ms(plan: list[str]) -> float | None:
    for line in plan:
        found = re.match(r"Execution Time: ([\d.]+) ms", line.strip())
        if found:
            return float(found.group(1))
    return None


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def measure_read(clients: tuple[belay.Belay, belay.Belay], conn: psycopg.Connection[Any],
                 table: Table, read: Read) -> ReadResult:
    """Each client untimed once (the cache warm), then READ_RUNS timed rounds,
    the two clients one after the other in each; then EXPLAIN (ANALYZE,
    BUFFERS) of its statement with its parameters, as a custom plan (what the
    unprepared client runs) and as the generic plan."""
    calls = [read.call(client, table) for client in clients]
    answer: Any = calls[0]()
    calls[1]()
    timings: list[list[float]] = [[], []]
    for _ in range(READ_RUNS):
        for call, ms in zip(calls, timings, strict=True):
            ms.append(_timed(call))
    result = ReadResult(read.name, timings[0], timings[1])
    if read.tree is None:
        result.groups, result.jobs = answer.groups, answer.total.jobs
    else:
        result.groups, result.jobs = len(answer.by_kind), answer.total.jobs
    result.usd = answer.total.usd
    name, params = read.statement(clients[0], table)
    rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[name], params).fetchall()
    result.plan = [str(r[0]) for r in rows]
    conn.execute("SET jit = off")
    try:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[name], params).fetchall()
    finally:
        conn.execute("RESET jit")
    result.no_jit = [str(r[0]) for r in rows]
    result.generic = generic_plan(conn, name, params)
    return result


def generic_plan(conn: psycopg.Connection[Any], name: str, params: dict[str, Any]
                 ) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the statement's generic plan (the one a
    prepared statement may settle on, planned without its parameters' values):
    PREPAREd with $n for its named parameters, run with plan_cache_mode
    force_generic_plan."""
    order: list[str] = []

    def number(found: re.Match[str]) -> str:
        if found.group(1) not in order:
            order.append(found.group(1))
        return f"${order.index(found.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, QUERIES[name]).replace("%%", "%")
    conn.execute(f"PREPARE bench_generic AS {text}")
    try:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        rows = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_generic ({})")
                            .format(sql.SQL(", ").join(sql.Literal(params[key])
                                                       for key in order))).fetchall()
    finally:
        conn.execute("RESET plan_cache_mode")
        conn.execute("DEALLOCATE bench_generic")
    return [str(r[0]) for r in rows]


def prepared(client: belay.Belay) -> list[tuple[str, int, int]]:
    """The client connection's prepared statements of spend: (which, generic plans,
    custom plans), as the server counted them."""
    with client.connection() as conn:
        rows = conn.execute("SELECT statement, generic_plans, custom_plans "
                            "FROM pg_prepared_statements").fetchall()
    out = []
    for statement, generic, custom in rows:
        text = str(statement)
        which = ("spend_by" if "WITH spending AS" in text
                 else "spend_tree" if "WITH RECURSIVE tree AS" in text else "")
        if which:
            out.append((which, int(generic), int(custom)))
    return out


# -- The write side ------------------------------------------------------------------------


@dataclass
class WriteRun:
    """One part of the write comparison: journaled steps through a worker, then
    put_step alone; the updates of belay_jobs each made, and how many were HOT."""

    place: str
    index: bool
    costed: bool
    steps: int
    drain_s: float
    raw_ms: list[float]
    drain_updates: tuple[int, int]
    raw_updates: tuple[int, int]

    @property
    def step_ms(self) -> float:
        return self.drain_s * 1000 / self.steps

    @property
    def label(self) -> str:
        if not self.costed:
            return "with the index, steps without a cost"
        return "with the index" if self.index else "without the index"


def _registry(steps: int) -> belay.Registry:
    registry = belay.Registry()

    @belay.worker(name=WRITE_KIND, queue=WRITE_QUEUE, max_attempts=1, registry=registry)
    def spend_step(ctx: belay.Context) -> None:
        cost = COST if ctx.input["costed"] else None
        for n in range(steps):
            ctx.step(f"call-{n}", lambda: ANSWER, cost=cost)

    return registry


def _updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(UPDATES).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def _settled(conn: psycopg.Connection[Any], before: tuple[int, int], expected: int,
             timeout: float = 30.0) -> tuple[int, int]:
    """The updates (all, HOT) since ``before`` once the backends that made them
    flushed their statistics (at least ``expected``, and the same twice)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        now = _updates(conn)
        delta = (now[0] - before[0], now[1] - before[1])
        if (delta[0] >= expected and delta == last) or time.monotonic() > deadline:
            return delta
        last = delta
        time.sleep(0.5)


def journal(url: str, place: str, index: bool, costed: bool, jobs: int, steps: int,
            raw_steps: int) -> WriteRun:
    """``jobs`` jobs of ``steps`` journaled steps through belay.testing.drain (a
    belay.Worker in this process); then ``raw_steps`` put_step calls per job."""
    registry = _registry(steps)
    value = encode_value(ANSWER)
    usd, tokens = (10_000, COST.tokens) if costed else (0, 0)
    with psycopg.connect(url, autocommit=True) as conn:
        before = _updates(conn)
        with belay.Belay(url, max_pool_size=2) as client:
            ids = [job.id for job in client.enqueue_many(
                [{"kind": WRITE_KIND, "input": {"costed": costed, "n": n},
                  "queue": WRITE_QUEUE} for n in range(jobs)])]
            started = time.perf_counter()
            done = belay.testing.drain(WRITE_QUEUE, client=client, registry=registry)
            drain_s = time.perf_counter() - started
        if done != {"succeeded": jobs}:
            raise RuntimeError(f"the journaled steps' jobs ended {done}")
        drained = _settled(conn, before, jobs * steps)
        before = _updates(conn)
        raw_ms = []
        with psycopg.connect(url, autocommit=True) as raw:
            for job_id in ids:
                for n in range(raw_steps):
                    started = time.perf_counter()
                    store.put_step(raw, job_id, f"raw-{n}", value, usd, tokens,
                                   datetime.now(timezone.utc))
                    raw_ms.append((time.perf_counter() - started) * 1000)
        rawed = _settled(conn, before, jobs * raw_steps)
    return WriteRun(place, index, costed, jobs * steps, drain_s, raw_ms, drained, rawed)


#: The fresh-database variants: (index present, steps with a cost).
VARIANTS = ((True, True), (False, True), (True, False))


def measure_writes(bench: Bench, jobs: int, rounds: int) -> list[WriteRun]:
    runs = []
    for turn in range(rounds):
        order = VARIANTS if turn % 2 == 0 else VARIANTS[::-1]
        for index, costed in order:
            with bench.database("spend_write") as url:
                if not index:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute(f'DROP INDEX "{INDEX}"')
                run = journal(url, "fresh", index, costed, jobs, WRITE_STEPS, RAW_STEPS)
            runs.append(run)
            bench.log(f"spend write, round {turn + 1}, {run.label}: {run.step_ms:.2f} ms/step "
                      f"through the worker, put_step p50 {median(run.raw_ms):.2f} ms; HOT "
                      f"{_hot(run.drain_updates)} / {_hot(run.raw_updates)}")
    return runs


def _hot(updates: tuple[int, int]) -> str:
    total, hot = updates
    return f"{hot:,} of {total:,}" + (f" ({100 * hot / total:.0f} %)" if total else "")


@dataclass
class Build:
    plain_s: float
    concurrent_s: float
    settings: str


def build_index(bench: Bench, conn: psycopg.Connection[Any], statement: str) -> float:
    """Seconds of ``statement`` (CREATE INDEX [CONCURRENTLY]), after a CHECKPOINT."""
    _checkpoint(conn)
    started = time.monotonic()
    conn.execute(statement)
    seconds = time.monotonic() - started
    bench.log(f"spend: {statement.split(' ON ')[0]}: {seconds:.1f} s")
    return seconds


def settings(conn: psycopg.Connection[Any], names: tuple[str, ...]) -> str:
    return ", ".join(f"{name} {conn.execute(f'SHOW {name}').fetchone()[0]}"  # type: ignore
                     for name in names)


# -- The scenario --------------------------------------------------------------------------


@dataclass
class Measured:
    table: Table
    reads: list[ReadResult]
    baseline: list[ReadResult]
    prepared: list[tuple[str, int, int]]
    fresh: list[WriteRun]
    big: list[WriteRun]
    build: Build | None
    write_jobs: int
    seconds: float = 0.0


@contextlib.contextmanager
def big_database(bench: Bench, name: str, jobs: int, *, keep: bool, reuse: bool
                 ) -> Iterator[tuple[str, float]]:
    """The big database, migrated and filled (or, with ``reuse``, as a kept run
    left it, when it holds ``jobs`` jobs); dropped afterwards unless ``keep``."""
    url = bench.url_for(name)
    filled = 0.0
    with psycopg.connect(bench.url, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                               (name,)).fetchone()
    if reuse and exists:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM belay_jobs WHERE queue <> %s",
                               (WRITE_QUEUE,)).fetchone()
            if not row or row[0] != jobs:
                raise RuntimeError(f"{name} holds {row[0] if row else 0:,} jobs, not {jobs:,}")
            # What an earlier run's write parts left: their jobs, and the index
            # if it stopped while the index was dropped (migration 6, again).
            conn.execute(f"DELETE FROM belay_steps WHERE job_id IN (SELECT id FROM belay_jobs "
                         f"WHERE queue = '{WRITE_QUEUE}')")
            conn.execute(f"DELETE FROM belay_jobs WHERE queue = '{WRITE_QUEUE}'")
            conn.execute(next(m.sql for m in migrations() if m.revision == 6))
            conn.execute("VACUUM (ANALYZE) belay_jobs")
            conn.execute("VACUUM (ANALYZE) belay_steps")
        bench.log(f"spend: reusing {name} ({jobs:,} jobs)")
    else:
        with psycopg.connect(bench.url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{name}"')
        with psycopg.connect(url, autocommit=True) as conn:
            schema.migrate(conn)
            filled = fill(bench, conn, jobs)
    try:
        yield url, filled
    finally:
        if not keep:
            with psycopg.connect(bench.url, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            bench.log(f"spend: dropped {name}")


def measure(bench: Bench, jobs: int, *, name: str = DATABASE, keep: bool = False,
            reuse: bool = False) -> Measured:
    started = time.monotonic()
    write_jobs = bench.size(50, WRITE_JOBS)
    fresh = measure_writes(bench, write_jobs, bench.size(1, WRITE_ROUNDS))
    with big_database(bench, name, jobs, keep=keep, reuse=reuse) as (url, filled), \
            psycopg.connect(url, autocommit=True) as conn:
        table = Table(jobs, filled)
        describe(conn, table)
        bench.log(f"spend: {table.facts}; belay_jobs heap {_mb(table.heap)}, "
                  f"{INDEX} {_mb(table.index)}; roots {table.roots}")
        with _clients(url, table) as clients:
            found = [measure_read(clients, conn, table, read) for read in reads()]
            for read in found:
                _log_read(bench, read)
            plans = prepared(clients[0])
        row = conn.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s",
                           (INDEX,)).fetchone()
        if row is None:
            raise RuntimeError(f"{INDEX} is not in the migrated schema")
        definition = str(row[0])
        concurrently = definition.replace("CREATE INDEX ", "CREATE INDEX CONCURRENTLY ", 1)
        server = settings(conn, ("maintenance_work_mem", "max_parallel_maintenance_workers"))

        def write(index: bool) -> None:
            big.append(journal(url, "big", index, True, write_jobs, WRITE_STEPS, RAW_STEPS))
            _log_write(bench, big[-1])

        # With, without, with, without, with: the index dropped twice and
        # built twice (as migration 6 does, then CONCURRENTLY), both timed.
        big: list[WriteRun] = []
        write(True)
        conn.execute(f'DROP INDEX "{INDEX}"')
        with _clients(url, table) as clients:
            baseline = [measure_read(clients, conn, table, read) for read in baseline_reads()]
        for read in baseline:
            _log_read(bench, read)
        write(False)
        plain_s = build_index(bench, conn, definition)
        write(True)
        conn.execute(f'DROP INDEX "{INDEX}"')
        write(False)
        concurrent_s = build_index(bench, conn, concurrently)
        write(True)
        _sizes(conn, table)
    return Measured(table, found, baseline, plans, fresh, big,
                    Build(plain_s, concurrent_s, server), write_jobs,
                    time.monotonic() - started)


@contextlib.contextmanager
def _clients(url: str, table: Table) -> Iterator[tuple[belay.Belay, belay.Belay]]:
    """Two clients of one connection each: belay's default (psycopg prepares a
    statement on its 5th run, and the server may then settle on a generic
    plan), warmed by WARM_CALLS calls of each spend statement so that it has;
    and one with pooler="transaction", which never prepares (a custom plan
    every call, as a one-shot ``belay spend`` or a PgBouncer deployment gets)."""
    with belay.Belay(url, max_pool_size=1) as prepared_client, \
            belay.Belay(url, max_pool_size=1, pooler="transaction") as unprepared:
        for _ in range(WARM_CALLS):
            prepared_client.spend("kind", since=timedelta(days=7))
            prepared_client.spend_tree(table.roots[2])
        yield prepared_client, unprepared


def _log_read(bench: Bench, read: ReadResult) -> None:
    bench.log(f"spend: {read.name}: median {median(read.ms):,.1f} ms prepared, "
              f"{median(read.custom_ms):,.1f} ms unprepared (EXPLAIN custom "
              f"{read.explain_ms or 0:,.1f} ms {read.jit}, jit off {read.no_jit_ms or 0:,.1f} ms, "
              f"generic {read.generic_ms or 0:,.1f} "
              f"ms), {read.jobs:,} jobs, {read.groups:,} groups; {read.scan}")


def _log_write(bench: Bench, run: WriteRun) -> None:
    bench.log(f"spend write, big table, {run.label}: {run.step_ms:.2f} ms/step through the "
              f"worker, put_step p50 {median(run.raw_ms):.2f} ms; HOT "
              f"{_hot(run.drain_updates)} / {_hot(run.raw_updates)}")


# -- Figures and report --------------------------------------------------------------------


def _write_medians(runs: list[WriteRun], index: bool, costed: bool
                   ) -> tuple[float, float, list[WriteRun]]:
    """Median ms per journaled step and median put_step p50 over the runs of one variant."""
    chosen = [r for r in runs if r.index == index and r.costed == costed]
    return (statistics.median(r.step_ms for r in chosen),
            statistics.median(median(r.raw_ms) for r in chosen), chosen)


def figures(m: Measured) -> list[Figure]:
    size = _count(m.table.jobs)
    out = []
    for read in m.reads + m.baseline:
        out.append(Figure(SECTION, f"{read.name}, {size} jobs", median(read.ms), "ms",
                          higher_is_better=False,
                          note=f"median of {READ_RUNS}; {read.jobs:,} jobs; {read.scan}"))
    with_7d = next(r for r in m.reads if r.name == "by kind, last 7d")
    without_7d = m.baseline[0]
    out.append(Figure(SECTION, f"by kind, last 7d, with the spend index, {size} jobs",
                      median(with_7d.ms), "ms", baseline="without it (DROP INDEX), same run",
                      baseline_value=median(without_7d.ms), higher_is_better=False))
    for place, runs in (("fresh database", m.fresh), (f"{size} jobs", m.big)):
        with_step, with_raw, _ = _write_medians(runs, True, True)
        without_step, without_raw, _ = _write_medians(runs, False, True)
        out.append(Figure(SECTION, f"journaled step with a cost, with the spend index, {place}",
                          with_step, "ms/step", baseline="without it", higher_is_better=False,
                          baseline_value=without_step,
                          note="belay.testing.drain of jobs of steps with cost"))
        out.append(Figure(SECTION, f"put_step with a cost, with the spend index, {place}",
                          with_raw, "ms", baseline="without it", baseline_value=without_raw,
                          higher_is_better=False, note="p50 of single autocommit calls"))
    return out


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "—"


def section(m: Measured, described: dict[str, str], command: str) -> str:
    t = m.table
    facts = t.facts
    with_7d = next(r for r in m.reads if r.name == "by kind, last 7d")
    lines = [
        f"# Spend analytics at {_count(t.jobs)} jobs (schema revision 6, `{INDEX}`)", "",
        f"`{command}`; the whole run took {m.seconds / 60:.0f} min"
        + (f" (the fill {t.fill_s:.0f} s)." if t.fill_s else " (a kept table, reused)."),
        "Method: the docstring of bench/spend.py. Every figure below was measured in this run.",
        "",
        "## The table", "",
        "| | |", "|---|---|",
        f"| jobs | {facts['jobs']:,} over {DAYS} days ({facts['oldest inserted_at']:%Y-%m-%d} "
        f"to {facts['newest inserted_at']:%Y-%m-%d}) |",
        f"| jobs that spent something | {facts['spending jobs']:,} "
        f"({_pct(facts['spending jobs'], facts['jobs'])}) |",
        f"| jobs with a parent / distinct parents | {facts['jobs with a parent']:,} / "
        f"{facts['parents']:,} |",
        f"| kinds, queues, customers | {facts['kinds']}, {facts['queues']}, "
        f"{facts['customers']:,} |",
        f"| belay_steps rows / with a cost / `$spend:` charge-backs | {facts['steps']:,} / "
        f"{facts['steps with a cost']:,} / {facts['$spend: charge-back steps']:,} |",
        f"| belay_jobs heap | {_mb(t.heap)} |",
        f"| belay_jobs with its indexes and TOAST | {_mb(t.total)} (indexes {_mb(t.indexes)}) |",
        f"| `{INDEX}` | {_mb(t.index)}: {_pct(t.index, t.heap)} of the heap, "
        f"{_pct(t.index, t.indexes)} of all belay_jobs indexes (`belay_jobs_pkey`: "
        f"{_mb(t.pkey)}) |",
        f"| belay_steps with its indexes | {_mb(t.steps)} |",
    ]
    if m.build is not None:
        lines.append(f"| `CREATE INDEX {INDEX}` (migration 6) / `CONCURRENTLY` | "
                     f"{m.build.plain_s:.1f} s / {m.build.concurrent_s:.1f} s "
                     f"({m.build.settings}) |")
    lines += [
        "", "## Reads", "",
        "Client API, warm (each read once untimed), the median of "
        f"{READ_RUNS} calls on each of two clients of one connection: *prepared* is "
        "`Belay(url)` as it comes (psycopg prepares a statement on its 5th run; the "
        f"server may then settle on a generic plan; warmed by {WARM_CALLS} calls of each "
        "spend statement first, as a long-running process is), *unprepared* is "
        "`Belay(url, pooler=\"transaction\")` (never prepares: a custom plan every call, "
        "as a one-shot `belay spend` gets). *EXPLAIN custom* is the Execution Time of "
        "`EXPLAIN (ANALYZE, BUFFERS)` of the same statement with the same parameters, "
        "right after (its JIT time when it used JIT), and again with `jit = off`; "
        "*EXPLAIN generic* that of its generic "
        "plan (PREPARE, `plan_cache_mode = force_generic_plan`, EXPLAIN EXECUTE). *scan* "
        "is the custom plan's first node on belay_jobs, *buffers* its top node's.", "",
        "| read | prepared ms (min-max) | unprepared ms | EXPLAIN custom ms | "
        "EXPLAIN custom, jit off, ms | EXPLAIN generic ms | jobs counted | groups | "
        "scan (custom plan) | buffers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for read in m.reads + m.baseline:
        jit = f" ({read.jit})" if read.jit else ""
        lines.append(
            f"| {read.name} | {_ms(median(read.ms))} ({_ms(min(read.ms))}-{_ms(max(read.ms))}) "
            f"| {_ms(median(read.custom_ms))} | {_ms(read.explain_ms)}{jit} | "
            f"{_ms(read.no_jit_ms)} | {_ms(read.generic_ms)} | {read.jobs:,} | "
            f"{read.groups:,} | {read.scan} | "
            f"{read.buffers} |")
    lines.append("")
    without_7d = m.baseline[0]
    lines.append(
        f"By kind over the last 7 days: {_ms(median(with_7d.ms))} ms with `{INDEX}`, "
        f"{_ms(median(without_7d.ms))} ms without it "
        f"({median(without_7d.ms) / median(with_7d.ms):.1f}x) on the prepared client; "
        f"{_ms(median(with_7d.custom_ms))} vs {_ms(median(without_7d.custom_ms))} ms "
        f"({median(without_7d.custom_ms) / median(with_7d.custom_ms):.1f}x) unprepared. "
        "The reads without the index "
        f"ran after the first write part below, so they also count its {m.write_jobs} jobs.")
    if m.prepared:
        lines += ["", "Server-side prepared statements on the prepared client's connection "
                  "after the reads (the server picks a generic or a custom plan on each "
                  "run): " + "; ".join(
                      f"{which}: {generic} generic plans, {custom} custom"
                      for which, generic, custom in m.prepared) + "."]
    lines += ["", "## Writes: a step with a cost is no longer HOT", "",
              f"{m.write_jobs} jobs of {WRITE_STEPS} journaled steps each "
              f"(`cost=belay.Cost(usd=0.01, tokens=500)`), run by `belay.testing.drain`: "
              "*ms/step* is the drain's wall time (claims and acks included) per step; then "
              f"{RAW_STEPS} `put_step` calls per job alone (one autocommit statement each), "
              "*put_step p50/p99*. *HOT* counts the updates of belay_jobs that were HOT "
              "(`pg_stat_user_tables`), through the worker / by put_step alone.", "",
              "| where | variant | ms/step (worker) | put_step p50 ms | put_step p99 ms | "
              "HOT (worker) | HOT (put_step) |",
              "|---|---|---:|---:|---:|---|---|"]
    for run in m.fresh + m.big:
        where = "fresh database" if run.place == "fresh" else f"{_count(t.jobs)} jobs"
        lines.append(f"| {where} | {run.label} | {run.step_ms:.2f} | {median(run.raw_ms):.2f} "
                     f"| {percentile(run.raw_ms, 99):.2f} | {_hot(run.drain_updates)} | "
                     f"{_hot(run.raw_updates)} |")
    lines.append("")
    for place, runs in (("fresh databases", m.fresh), (f"the {_count(t.jobs)} table", m.big)):
        with_step, with_raw, chosen = _write_medians(runs, True, True)
        without_step, without_raw, _ = _write_medians(runs, False, True)
        others = sum(1 for r in runs if not r.index)
        lines.append(f"- {place} (medians of {len(chosen)} runs with the index, {others} "
                     f"without): {with_step:.2f} vs {without_step:.2f} ms per journaled step "
                     "through the worker "
                     f"({with_step / without_step:.2f}x with the index); put_step p50 "
                     f"{with_raw:.2f} vs {without_raw:.2f} ms ({with_raw / without_raw:.2f}x).")
    lines += ["", "## Plans", "",
              "The top lines of each read's `EXPLAIN (ANALYZE, BUFFERS)` (the whole plan "
              "below them).", ""]
    for read in m.reads + m.baseline:
        lines += [f"**{read.name}** (median {_ms(median(read.ms))} ms prepared, "
                  f"{_ms(median(read.custom_ms))} ms unprepared)", "", "```",
                  *_key_lines(read.plan), "```", "",
                  "<details><summary>whole plan (custom)</summary>", "", "```", *read.plan,
                  "```", "", "</details>", "",
                  "<details><summary>generic plan</summary>", "", "```", *read.generic,
                  "```", "", "</details>", ""]
    lines += ["## Machine", "", *machine_table(described)]
    return "\n".join(lines)


def _key_lines(plan: list[str]) -> list[str]:
    """The plan's first lines, its lines on belay_jobs and belay_steps and the
    ones under them (conditions, buffers), and its timings."""
    keep = set(range(min(4, len(plan))))
    for n, line in enumerate(plan):
        if re.search(r" on belay_(jobs|steps)| using belay_| Seq Scan", line):
            keep.add(n)
            for after in range(n + 1, min(n + 5, len(plan))):
                if "->" in plan[after] or "SubPlan" in plan[after]:
                    break
                keep.add(after)
        if re.match(r"\s*(Planning Time|Execution Time|JIT:|Functions:|Options:|Timing:)", line):
            keep.add(n)
    return [plan[n] for n in sorted(keep)]


def run(bench: Bench) -> list[Figure]:
    return figures(measure(bench, bench.size(QUICK_JOBS, FULL_JOBS)))


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m bench.spend", __doc__,
                       f"{_count(QUICK_JOBS)} jobs, one write round (a smoke run)",
                       out="also write the Markdown report here (bench/spend_results.md)")
    parser.add_argument("--jobs", type=int, help=f"jobs in the big table (default "
                        f"{FULL_JOBS:,}; --quick {QUICK_JOBS:,})")
    parser.add_argument("--db", default=DATABASE, help="the big database's name")
    parser.add_argument("--keep", action="store_true", help="leave the big database")
    parser.add_argument("--reuse", action="store_true",
                        help="use the big database a --keep run left, if it holds --jobs jobs")
    args = parser.parse_args(argv)
    jobs = args.jobs or (QUICK_JOBS if args.quick else FULL_JOBS)
    from bench.__main__ import machine, server

    command = " ".join(["python -m bench.spend", *(sys.argv[1:] if argv is None else argv)])
    with server(args.url) as (url, bin_dir):
        bench = Bench(url, quick=args.quick, bin_dir=bin_dir)
        described = machine(url)
        try:
            measured = measure(bench, jobs, name=args.db, keep=args.keep, reuse=args.reuse)
        finally:
            bench.close()
    publish(section(measured, described, command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
