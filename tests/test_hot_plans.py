"""Every hot statement has a known plan (issue 39).

The statements a worker and a producer run on every job — the claims (one
queue, several, admitted, kinds-filtered), the acks, the lease renewal, the
reclaim, the enqueue, the journal and the settlement — are planned here over
tables of several shapes, as a custom plan (the parameters' values known, what
a plain execution gets) and as a generic one (what a prepared statement gets
once PostgreSQL stops re-planning it: psycopg prepares a statement on its
fifth execution). Each plan is run (``EXPLAIN ANALYZE``, rolled back) and
must:

- read ``belay_jobs``, ``belay_steps`` and ``belay_events`` through an index,
  never a sequential scan (of a table over :data:`ROWS_READ` rows: a smaller
  one is best read whole); and
- read a bounded number of their rows: the rows it touched, filtered out
  included, stay under :data:`ROWS_READ`, and the pages under
  :data:`BUFFERS`, however many rows the table holds that the statement
  does not return.

A failure names the statement, the shape, the mode and the plan's nodes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.adapt import PyFormat, Transformer

from belay.sql import QUERIES

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
TABLES = frozenset({"belay_jobs", "belay_steps", "belay_events"})
#: Rows of the three tables any hot statement may read, whatever their size:
#: a claim of 50 reads its 50 and a few locked or not-yet-due neighbours.
ROWS_READ = 1_000
#: Buffers (8 kB pages) any hot statement may touch, indexes included: a claim
#: of 50 that writes 50 rows and their index entries touches about 1,100; a
#: scan of the 1M-row table, 26,000. (A second bound beside the rows: the
#: rows a node reports are per loop and rounded, so many loops of less than
#: a row each would add up to nothing.)
BUFFERS = 5_000
LEASED = 10  # running jobs leased by node "n"
TAKE = 50


# -- Shapes ---------------------------------------------------------------------------------

FINISHED = """
INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, ready_at,
                        started_at, finished_at, inserted_at)
SELECT 'k', 'q' || (g %% 4),
       CASE WHEN g %% 50 = 0 THEN 'failed' WHEN g %% 97 = 0 THEN 'cancelled'
            ELSE 'succeeded' END,
       jsonb_build_object('n', g), 1, 5, %(now)s - interval '2 days',
       %(now)s - interval '2 days', %(now)s - (%(rows)s - g) * interval '100 ms',
       %(now)s - interval '2 days'
FROM generate_series(1, %(rows)s) AS g
"""
#: Journal rows and events of the finished jobs: two each, for the first ones.
FINISHED_JOURNAL = """
INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
SELECT id, s, 'step-' || s, '1', 0, 0, %(now)s
FROM belay_jobs, generate_series(1, 2) AS s
WHERE state = 'succeeded' AND id <= %(rows)s;
INSERT INTO belay_events (job_id, seq, payload, inserted_at)
SELECT id, s, '{"n": 1}', %(now)s
FROM belay_jobs, generate_series(1, 2) AS s
WHERE state = 'succeeded' AND id <= %(rows)s
"""
READY = """
INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, ready_at,
                        inserted_at)
SELECT 'k', 'busy', 'ready', jsonb_build_object('n', g), 0, 5,
       %(now)s - interval '1 minute', %(now)s
FROM generate_series(1, %(rows)s) AS g
"""
#: The live rows every shape holds, the statements' subjects: jobs leased by
#: node "n" (with steps and events), expired leases, a partitioned queue, jobs
#: awaiting a signal, a workflow with held members, a parent awaiting its
#: children.
LIVE = """
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, lease_until, leased_by,
                        started_at, ready_at, inserted_at, budget_usd_micros)
SELECT 'k', 'busy', 'running', 1, 5, %(now)s + interval '30 s', 'n', %(now)s, %(now)s,
       %(now)s, 5000000
FROM generate_series(1, 10);
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, lease_until, leased_by,
                        started_at, ready_at, inserted_at)
SELECT 'k', 'busy', 'running', 1, 5, %(now)s - interval '10 s', 'gone', %(now)s, %(now)s,
       %(now)s
FROM generate_series(1, 3);
INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, ready_at,
                        inserted_at)
SELECT 'k', 'part', 'ready', jsonb_build_object('tenant', 't' || (g %% 20)), 0, 5,
       %(now)s - interval '1 minute', %(now)s
FROM generate_series(1, 200) AS g;
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, ready_at, await_scope,
                        await_name, inserted_at)
SELECT 'k', 'busy', 'awaiting', 0, 5, %(now)s + g * interval '1 hour', 'job:' || g,
       'approve', %(now)s
FROM generate_series(1, 5) AS g;
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, ready_at, workflow_id,
                        wf_name, wf_deps, inserted_at, finished_at)
VALUES ('k', 'busy', 'succeeded', 1, 5, %(now)s, 'wf1', 'a', '{}', %(now)s, %(now)s),
       ('k', 'busy', 'held', 0, 5, NULL, 'wf1', 'b', '{a}', %(now)s, NULL),
       ('k', 'busy', 'held', 0, 5, NULL, 'wf1', 'c', '{b}', %(now)s, NULL);
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, ready_at, await_scope,
                        await_name, inserted_at)
VALUES ('k', 'busy', 'awaiting', 0, 5, NULL, 'parent', '$children', %(now)s);
INSERT INTO belay_jobs (kind, queue, state, attempt, max_attempts, parent_id, inserted_at,
                        finished_at)
SELECT 'k', 'children', 'succeeded', 1, 5, currval(pg_get_serial_sequence('belay_jobs', 'id')),
       %(now)s, %(now)s
FROM generate_series(1, 3);
INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
SELECT id, s, 'step-' || s, '1', 100, 0, %(now)s
FROM belay_jobs, generate_series(1, 5) AS s WHERE leased_by = 'n';
INSERT INTO belay_events (job_id, seq, payload, inserted_at)
SELECT id, s, '{"n": 1}', %(now)s
FROM belay_jobs, generate_series(1, 5) AS s WHERE leased_by = 'n'
"""


@dataclass(frozen=True)
class Shape:
    name: str
    finished: int = 0
    journaled: int = 0  # finished jobs with two steps and two events each
    ready: int = 0
    analyzed: bool = True


SHAPES = [
    Shape("empty", analyzed=False),
    Shape("100k ready, never analyzed", ready=100_000, analyzed=False),
    Shape("100k ready", ready=100_000),
    Shape("1M finished + 1k ready", finished=1_000_000, journaled=200_000, ready=1_000),
    Shape("100k ready + 1M finished", finished=1_000_000, journaled=200_000, ready=100_000),
]


def build(conn: psycopg.Connection[Any], shape: Shape) -> None:
    """Fill a fresh schema to ``shape``; never analyzed means the planner has
    no statistics for the tables at all (autovacuum kept off them)."""
    for table in TABLES:
        conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    if shape.finished:
        conn.execute(FINISHED, {"now": NOW, "rows": shape.finished})
        for statement in FINISHED_JOURNAL.split(";"):
            conn.execute(statement, {"now": NOW, "rows": shape.journaled})
    if shape.ready:
        conn.execute(READY, {"now": NOW, "rows": shape.ready})
    for statement in LIVE.split(";"):
        conn.execute(statement, {"now": NOW})
    if shape.analyzed:
        conn.execute("VACUUM ANALYZE belay_jobs, belay_steps, belay_events, belay_signals")


# -- The statements and their parameters -----------------------------------------------------


@dataclass
class Live:
    """Ids of the live rows, read back after the fill."""

    leased: list[int]
    expired: list[int]
    held: list[int]
    parent: int
    attempt: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def live(conn: psycopg.Connection[Any]) -> Live:
    def ids(where: str) -> list[int]:
        return [r[0] for r in conn.execute(f"SELECT id FROM belay_jobs WHERE {where} ORDER BY id")]

    return Live(
        leased=ids("state = 'running' AND leased_by = 'n'"),
        expired=ids("state = 'running' AND leased_by = 'gone'"),
        held=ids("workflow_id = 'wf1' AND state = 'held'"),
        parent=ids("await_name = '$children'")[0],
    )


def _lease() -> dict[str, Any]:
    return {"node": "n", "now": NOW, "lease_until": NOW + timedelta(seconds=30)}


def _error() -> str:
    return json.dumps({"error": "boom", "attempt": 1})


def _enqueue_row() -> dict[str, Any]:
    return {
        "kind": ["k"], "queue": ["busy"], "state": ["ready"], "input": ["{}"], "meta": ["{}"],
        "priority": [0], "max_attempts": [5], "partition_key": [None], "ready_at": [None],
        "workflow_id": [None], "wf_name": [None], "wf_deps": ["[]"], "wf_ignore": ["[]"],
        "cron_name": [None], "cron_slot": [None], "unique_key": ["u-1"],
        "unique_mode": ["incomplete"], "parent_id": [None], "budget_usd_micros": [None],
        "budget_tokens": [None], "now": NOW, "channel": "belay",
    }


Params = dict[str, Any] | tuple[Any, ...]
#: (label, statement name, parameters from the live rows). The label tells
#: several parameter sets of one statement apart.
STATEMENTS: list[tuple[str, str, Callable[[Live], Params]]] = [
    ("claim", "claim", lambda lv: {"queue": "busy", "take": TAKE, "kinds": None, **_lease()}),
    ("claim, kinds", "claim",
     lambda lv: {"queue": "busy", "take": TAKE, "kinds": ["k"], **_lease()}),
    ("claim, idle queue", "claim",
     lambda lv: {"queue": "small", "take": TAKE, "kinds": None, **_lease()}),
    ("claim_queues", "claim_queues",
     lambda lv: {"queues": ["busy", "small"], "takes": [TAKE, 4], "kinds": None, **_lease()}),
    ("claim_queues, five", "claim_queues",
     lambda lv: {"queues": ["busy", "small", "a", "b", "c"], "takes": [TAKE, 20, 10, 4, 2],
                 "kinds": None, **_lease()}),
    ("claim_queues, kinds", "claim_queues",
     lambda lv: {"queues": ["busy", "small"], "takes": [TAKE, 4], "kinds": ["k"],
                 **_lease()}),
    ("queues_with_work", "queues_with_work",
     lambda lv: {"queues": ["busy", "small", "a", "b", "c"], "now": NOW}),
    ("live_running_count", "live_running_count", lambda lv: {"queue": "busy", "now": NOW}),
    ("claim_partitioned_ids", "claim_partitioned_ids",
     lambda lv: {"queue": "part", "source": "input", "key": "tenant", "per_key": 2,
                 "take": TAKE, "window": 256, "kinds": None, "now": NOW}),
    # A prefix of one job can't settle a claim of 50: the whole queue is
    # ranked, reading its claimable jobs (200 here) whatever the table holds.
    ("claim_partitioned_ids, the whole queue", "claim_partitioned_ids",
     lambda lv: {"queue": "part", "source": "input", "key": "tenant", "per_key": 2,
                 "take": TAKE, "window": 1, "kinds": None, "now": NOW}),
    ("claim_ids", "claim_ids", lambda lv: {"ids": list(range(1, TAKE + 1)), **_lease()}),
    ("renew_leases", "renew_leases",
     lambda lv: {"ids": lv.leased, "node": "n", "until": NOW + timedelta(seconds=60)}),
    ("ack_succeeded", "ack_succeeded",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "result": None, "now": NOW}),
    ("ack_succeeded_many", "ack_succeeded_many",
     lambda lv: {"ids": "{" + ",".join(map(str, lv.leased)) + "}",
                 "attempts": "{" + ",".join("1" for _ in lv.leased) + "}",
                 "results": None, "now": NOW, "channel": "belay"}),
    ("ack_retry", "ack_retry",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "error": _error(), "now": NOW,
                 "at": NOW + timedelta(seconds=5)}),
    ("ack_failed", "ack_failed",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "error": _error(), "now": NOW}),
    ("ack_cancelled", "ack_cancelled",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "error": _error(), "now": NOW}),
    ("ack_snooze", "ack_snooze",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "now": NOW,
                 "at": NOW + timedelta(seconds=5)}),
    ("cancel_flagged", "cancel_flagged",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "now": NOW}),
    ("give_back", "give_back",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "node": "n", "now": NOW,
                 "retry_at": NOW + timedelta(seconds=5), "limit": 3,
                 "entry": json.dumps({"error": "executor_lost", "attempt": 1,
                                      "executor": "n"}),
                 "cancelled": json.dumps({"reason": "cancel_requested", "attempt": 1}),
                 "message": "lost %s times (%s)"}),
    ("park_await", "park_await",
     lambda lv: {"id": lv.leased[0], "attempt": 1, "scope": "job:x", "name": "approve",
                 "deadline": None}),
    ("park_ready", "park_ready", lambda lv: {"id": lv.leased[0], "attempt": 1, "now": NOW}),
    ("expired_leases", "expired_leases", lambda lv: (NOW, 100)),
    ("lock_expired", "lock_expired", lambda lv: (lv.expired[0], NOW)),
    ("step_lookup, hit", "step_lookup", lambda lv: {"job_id": lv.leased[0], "name": "step-1"}),
    ("step_lookup, miss", "step_lookup", lambda lv: {"job_id": lv.leased[0], "name": "new"}),
    ("put_step", "put_step",
     lambda lv: {"job_id": lv.leased[0], "name": "new", "value": "1", "usd_micros": 100,
                 "tokens": 0, "now": NOW, "scope": f"job:{lv.leased[0]}",
                 "holds": ["$budget:hold:r:new"]}),
    ("append_event", "append_event",
     lambda lv: {"job_id": lv.leased[0], "payload": '{"n": 2}', "now": NOW}),
    ("lock_budget", "lock_budget", lambda lv: {"id": lv.leased[0], "attempt": 1}),
    ("get_job", "get_job", lambda lv: (lv.leased[0],)),
    ("insert_jobs", "insert_jobs", lambda lv: _enqueue_row()),
    ("jobs_by_unique_keys", "jobs_by_unique_keys", lambda lv: {"keys": ["u-1", "u-2"]}),
    ("request_cancel", "request_cancel", lambda lv: (lv.leased[0],)),
    ("wake_awaiting", "wake_awaiting",
     lambda lv: {"scope": "job:1", "name": "approve", "now": NOW}),
    ("wake_awaiting_many", "wake_awaiting_many",
     lambda lv: {"scopes": ["job:1", "job:2"], "name": "approve", "now": NOW}),
    ("workflow_members_many", "workflow_members_many", lambda lv: (["wf1"],)),
    ("settle_release", "settle_release", lambda lv: (NOW, lv.held)),
    ("settle_doom", "settle_doom", lambda lv: (NOW, lv.held)),
    ("children", "children", lambda lv: (lv.parent,)),
    ("resettle_parents", "resettle_parents", lambda lv: {"now": NOW}),
    ("prune_jobs", "prune_jobs",
     lambda lv: {"state": "succeeded", "cutoff": NOW - timedelta(days=1), "limit": 100,
                 **{s: NOW - timedelta(days=1) for s in ("succeeded", "failed", "cancelled")}}),
]


# -- Planning ---------------------------------------------------------------------------------

_NAMED = re.compile(r"%\((\w+)\)s|%s|%%")


def prepared(text: str, params: Params) -> tuple[str, list[Any]]:
    """``text`` with $n placeholders, and the values in their order — for
    PREPARE, whose plan PostgreSQL makes without the values when it goes
    generic."""
    order: list[str] = []
    values: list[Any] = []
    position = iter(range(len(params))) if isinstance(params, tuple) else None

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        if match.group(1) is None:
            assert position is not None and isinstance(params, tuple)
            values.append(params[next(position)])
            return f"${len(values)}"
        assert isinstance(params, dict)
        name = match.group(1)
        if name not in order:
            order.append(name)
            values.append(params[name])
        return f"${order.index(name) + 1}"

    return _NAMED.sub(number, text), values


def param_types(conn: psycopg.Connection[Any], values: list[Any]) -> list[str]:
    """The types psycopg gives ``values`` (what it prepares a statement
    with), by name; ``unknown`` (a string, a NULL) is inferred by the server."""
    if not values:
        return []
    dumper = Transformer.from_context(conn)
    dumper.dump_sequence(values, [PyFormat.AUTO] * len(values))
    names = conn.execute("SELECT CASE WHEN t = 0 THEN 'unknown' ELSE t::regtype::text END "
                         "FROM unnest(%s::oid[]) WITH ORDINALITY AS o(t, n) ORDER BY n",
                         [list(dumper.types)]).fetchall()
    return [n for (n,) in names]


def plan(conn: psycopg.Connection[Any], name: str, params: Params, mode: str
         ) -> dict[str, Any]:
    """The statement's plan, run and rolled back."""
    text = QUERIES[name]
    with conn.transaction(force_rollback=True):
        if mode == "custom":
            row = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, params  # type: ignore[arg-type]
            ).fetchone()
        else:
            numbered, values = prepared(text, params)
            conn.execute("DEALLOCATE ALL")  # not transactional: a failed test's may linger
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            types = ", ".join(param_types(conn, values))
            conn.execute(f"PREPARE hot ({types}) AS {numbered}")  # type: ignore[arg-type]
            resolved = conn.execute("SELECT unnest(parameter_types)::text FROM "
                                    "pg_prepared_statements WHERE name = 'hot'").fetchall()
            # EXECUTE's arguments as literals: a utility statement's
            # parameters get no types from the server.
            slots = sql.SQL(", ").join(
                sql.SQL("{}::{}").format(sql.Literal(value), sql.SQL(t))  # type: ignore[arg-type]
                for value, (t,) in zip(values, resolved, strict=True))
            row = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE hot ({})").format(slots)
            ).fetchone()
            conn.execute("DEALLOCATE hot")
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    found: dict[str, Any] = document[0]["Plan"]
    return found


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def seq_scans(plan: dict[str, Any], big: set[str]) -> list[str]:
    """The ``big`` tables the plan reads whole. A node that never ran (a
    branch the statement's own condition skipped) read nothing."""
    return [n["Relation Name"] for n in nodes(plan)
            if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in big
            and n.get("Actual Loops", 1) > 0]


def rows_read(plan: dict[str, Any]) -> int:
    """Rows the plan touched in the three tables: what each scan of them
    returned plus what its filters threw away, over all its loops. (A bitmap
    scan counts through its heap node, which names the table.)"""
    total = 0
    for n in nodes(plan):
        if n.get("Relation Name") not in TABLES or "Scan" not in n["Node Type"]:
            continue
        per_loop = (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)
                    + n.get("Rows Removed by Index Recheck", 0))
        total += per_loop * max(n.get("Actual Loops", 1), 1)
    return total


def outline(plan: dict[str, Any], depth: int = 0) -> str:
    line = "  " * depth + plan["Node Type"]
    for key in ("Relation Name", "Index Name"):
        if key in plan:
            line += f" {plan[key]}"
    line += f" rows={plan.get('Actual Rows')} loops={plan.get('Actual Loops')}"
    if plan.get("Rows Removed by Filter"):
        line += f" removed={plan['Rows Removed by Filter']}"
    return "\n".join([line, *(outline(c, depth + 1) for c in plan.get("Plans", []))])


# -- The test ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_every_hot_statement_reads_an_index_and_a_bounded_number_of_rows(
    sql_conn: psycopg.Connection[Any], shape: Shape,
) -> None:
    build(sql_conn, shape)
    rows = live(sql_conn)
    assert len(rows.leased) == LEASED
    # A table of a few hundred rows is best read whole (and the row bound
    # holds there anyway); a sequential scan of a bigger one is a finding.
    big = {t for t in TABLES
           if sql_conn.execute(f"SELECT count(*) > {ROWS_READ} FROM {t}").fetchone() == (True,)}
    problems = []
    for label, name, params in STATEMENTS:
        for mode in ("custom", "generic"):
            try:
                found = plan(sql_conn, name, params(rows), mode)
            except psycopg.Error as error:
                raise AssertionError(f"{label} ({mode}) did not plan: {error}") from error
            scanned, read = seq_scans(found, big), rows_read(found)
            pages = found.get("Shared Hit Blocks", 0) + found.get("Shared Read Blocks", 0)
            if scanned or read > ROWS_READ or pages > BUFFERS:
                problems.append(f"{label} ({mode}): sequential scan of {scanned}, "
                                f"{read} rows read, {pages} buffers\n{outline(found)}")
    assert not problems, f"shape {shape.name}:\n" + "\n\n".join(problems)


@pytest.mark.parametrize("mode", ["custom", "generic"])
def test_the_partitioned_claim_reads_a_bounded_number_of_rows(
    sql_conn: psycopg.Connection[Any], mode: str,
) -> None:
    """A partitioned queue with 10,000 tenants waiting, two jobs each: a claim
    of 50 reads a prefix of the queue in claim order, not all 20,000 jobs (it
    read 20,200 when it ranked the whole queue): the prefix settles it."""
    build(sql_conn, Shape("live rows only"))
    sql_conn.execute(
        """
        INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, ready_at,
                                inserted_at)
        SELECT 'k', 'part', 'ready', jsonb_build_object('tenant', 't' || (g %% 10000)), 0, 5,
               %(now)s - interval '1 minute', %(now)s
        FROM generate_series(1, 20000) AS g
        """, {"now": NOW})
    sql_conn.execute("VACUUM ANALYZE belay_jobs")
    params = next(p for label, _, p in STATEMENTS if label == "claim_partitioned_ids")
    found = plan(sql_conn, "claim_partitioned_ids", params(live(sql_conn)), mode)
    assert rows_read(found) <= ROWS_READ, outline(found)
    assert not seq_scans(found, set(TABLES)), outline(found)
    row = sql_conn.execute(QUERIES["claim_partitioned_ids"], params(live(sql_conn))).fetchone()
    assert row is not None and len(row[0]) == TAKE
