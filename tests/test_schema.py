"""The schema belay creates and the startup check (docs/contract.md §1 and §3,
with where belay differs).

The expected catalog below is written out by hand from docs/contract.md §3 (which
restores the reference's ``@migrations``), in the exact text PostgreSQL prints for it —
the same on PostgreSQL 15 and 18 — so any drift from the shared schema fails here.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import os
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import belay
import belay.sql
from belay import ContractMismatch, SchemaMissing, SchemaOutdated, SchemaStatus
from belay.sql import QUERIES
from tests.helpers import START as NOW
from tests.helpers import url_for

REPO = Path(__file__).resolve().parent.parent

# -- Expected catalog (docs/contract.md §3) ---------------------------------------------------

# (column, format_type, NOT NULL, default as pg_get_expr prints it), in DDL order.
TS = "timestamp with time zone"
EXPECTED_COLUMNS: dict[str, list[tuple[str, str, bool, str | None]]] = {
    "belay_jobs": [
        ("id", "bigint", True, "nextval('belay_jobs_id_seq'::regclass)"),
        ("kind", "text", True, None),
        ("queue", "text", True, None),
        ("state", "text", True, "'ready'::text"),
        ("input", "jsonb", True, "'{}'::jsonb"),
        ("meta", "jsonb", True, "'{}'::jsonb"),
        ("priority", "integer", True, "0"),
        ("attempt", "integer", True, "0"),
        ("max_attempts", "integer", True, "20"),
        ("partition_key", "text", False, None),
        ("ready_at", TS, False, None),
        ("lease_until", TS, False, None),
        ("leased_by", "text", False, None),
        ("await_scope", "text", False, None),
        ("await_name", "text", False, None),
        ("workflow_id", "text", False, None),
        ("wf_name", "text", False, None),
        ("wf_deps", "text[]", True, "'{}'::text[]"),
        ("wf_ignore", "text[]", True, "'{}'::text[]"),
        ("cron_name", "text", False, None),
        ("cron_slot", TS, False, None),
        ("unique_key", "text", False, None),
        ("unique_mode", "text", False, None),
        ("parent_id", "bigint", False, None),
        ("budget_usd_micros", "bigint", False, None),
        ("budget_tokens", "bigint", False, None),
        ("spent_usd_micros", "bigint", True, "0"),
        ("spent_tokens", "bigint", True, "0"),
        ("result", "bytea", False, None),
        ("errors", "jsonb", True, "'[]'::jsonb"),
        ("cancel_requested", "boolean", True, "false"),
        ("inserted_at", TS, True, None),
        ("started_at", TS, False, None),
        ("finished_at", TS, False, None),
    ],
    "belay_steps": [
        ("job_id", "bigint", True, None),
        ("seq", "integer", True, None),
        ("name", "text", True, None),
        ("value", "bytea", False, None),
        ("usd_micros", "bigint", True, "0"),
        ("tokens", "bigint", True, "0"),
        ("inserted_at", TS, False, None),
    ],
    "belay_events": [
        ("job_id", "bigint", True, None),
        ("seq", "integer", True, None),
        ("payload", "jsonb", False, None),
        ("inserted_at", TS, False, None),
    ],
    "belay_signals": [
        ("scope", "text", True, None),
        ("name", "text", True, None),
        ("payload", "jsonb", False, None),
        ("inserted_at", TS, False, None),
    ],
    "belay_rate": [
        ("bucket", "text", True, None),
        ("window_start", "bigint", True, None),
        ("count", "integer", True, "0"),
    ],
    "belay_queues": [
        ("name", "text", True, None),
        ("opts", "jsonb", True, "'{}'::jsonb"),
        ("updated_at", TS, False, None),
    ],
    "belay_crons": [
        ("name", "text", True, None),
        ("expression", "text", True, None),
        ("worker", "text", True, None),
        ("input", "jsonb", True, "'{}'::jsonb"),
        ("opts", "jsonb", True, "'{}'::jsonb"),
        ("paused", "boolean", True, "false"),
        ("updated_at", TS, False, None),
    ],
    # Migration 5: schedules (belay's own; the reference never reads it).
    "belay_schedules": [
        ("name", "text", True, None),
        ("expression", "text", True, None),
        ("worker", "text", True, None),
        ("input", "jsonb", True, "'{}'::jsonb"),
        ("opts", "jsonb", True, "'{}'::jsonb"),
        ("overlap", "text", True, "'skip'::text"),
        ("catch_up", "text", True, "'latest'::text"),
        ("static", "boolean", True, "false"),
        ("cursor_slot", TS, False, None),
        ("last_job_id", "bigint", False, None),
        ("revision", "integer", True, "1"),
        ("cancelled_at", TS, False, None),
        ("created_at", TS, True, None),
        ("updated_at", TS, True, None),
    ],
    # The reference's belay_meta (version int NOT NULL) plus migration 3's column.
    "belay_meta": [
        ("version", "integer", True, None),
        ("contract_major", "integer", True, "1"),
    ],
}

EXPECTED_PRIMARY_KEYS: dict[str, str | None] = {
    "belay_jobs": "PRIMARY KEY (id)",
    "belay_steps": "PRIMARY KEY (job_id, name)",
    "belay_events": "PRIMARY KEY (job_id, seq)",
    "belay_signals": "PRIMARY KEY (scope, name)",
    "belay_rate": "PRIMARY KEY (bucket, window_start)",
    "belay_queues": "PRIMARY KEY (name)",
    "belay_crons": "PRIMARY KEY (name)",
    "belay_schedules": "PRIMARY KEY (name)",
    "belay_meta": None,
}

_STATES = "ARRAY['ready'::text, 'running'::text, 'awaiting'::text, 'held'::text, 'paused'::text]"
_ON = "ON public.belay_jobs USING btree"
# Every index on every belay table, as pg_indexes.indexdef prints it (names normative, §3).
EXPECTED_INDEXES: dict[str, dict[str, str]] = {
    "belay_jobs": {
        "belay_jobs_pkey": f"CREATE UNIQUE INDEX belay_jobs_pkey {_ON} (id)",
        "belay_jobs_claim_idx": (
            f"CREATE INDEX belay_jobs_claim_idx {_ON} (queue, priority, ready_at, id) "
            "WHERE (state = 'ready'::text)"
        ),
        "belay_jobs_await_due_idx": (
            f"CREATE INDEX belay_jobs_await_due_idx {_ON} (queue, ready_at) "
            "WHERE ((state = 'awaiting'::text) AND (ready_at IS NOT NULL))"
        ),
        "belay_jobs_await_wake_idx": (
            f"CREATE INDEX belay_jobs_await_wake_idx {_ON} (await_scope, await_name) "
            "WHERE (state = 'awaiting'::text)"
        ),
        "belay_jobs_lease_idx": (
            f"CREATE INDEX belay_jobs_lease_idx {_ON} (lease_until) "
            "WHERE (state = 'running'::text)"
        ),
        "belay_jobs_workflow_idx": (
            f"CREATE INDEX belay_jobs_workflow_idx {_ON} (workflow_id) "
            "WHERE (workflow_id IS NOT NULL)"
        ),
        "belay_jobs_parent_idx": (
            f"CREATE INDEX belay_jobs_parent_idx {_ON} (parent_id) WHERE (parent_id IS NOT NULL)"
        ),
        "belay_jobs_prune_idx": (
            f"CREATE INDEX belay_jobs_prune_idx {_ON} (state, finished_at) "
            "WHERE (finished_at IS NOT NULL)"
        ),
        "belay_jobs_cron_slot_idx": (
            f"CREATE UNIQUE INDEX belay_jobs_cron_slot_idx {_ON} (cron_name, cron_slot) "
            "WHERE (cron_name IS NOT NULL)"
        ),
        "belay_jobs_unique_incomplete_idx": (
            f"CREATE UNIQUE INDEX belay_jobs_unique_incomplete_idx {_ON} (unique_key) "
            "WHERE ((unique_key IS NOT NULL) AND (unique_mode = 'incomplete'::text) "
            f"AND (state = ANY ({_STATES})))"
        ),
        "belay_jobs_unique_window_idx": (
            f"CREATE UNIQUE INDEX belay_jobs_unique_window_idx {_ON} (unique_key) "
            "WHERE ((unique_key IS NOT NULL) "
            "AND (unique_mode = ANY (ARRAY['window'::text, 'always'::text])))"
        ),
        # Migration 3 (docs/contract.md §3, where belay differs): the claim's own order.
        "belay_jobs_claim_order_idx": (
            f"CREATE INDEX belay_jobs_claim_order_idx {_ON} "
            "(queue, priority, ready_at NULLS FIRST, id) WHERE (state = 'ready'::text)"
        ),
        # Migration 4: counts per queue and state, and the filtered job list.
        "belay_jobs_state_queue_id_idx": (
            f"CREATE INDEX belay_jobs_state_queue_id_idx {_ON} (state, queue, id) "
            "WHERE (id > 0)"
        ),
        # Migration 6: the jobs that spent, for spend analytics.
        "belay_jobs_spend_idx": (
            f"CREATE INDEX belay_jobs_spend_idx {_ON} (inserted_at) "
            "WHERE ((spent_usd_micros <> 0) OR (spent_tokens <> 0))"
        ),
    },
    "belay_steps": {
        "belay_steps_pkey": (
            "CREATE UNIQUE INDEX belay_steps_pkey ON public.belay_steps USING btree (job_id, name)"
        ),
    },
    "belay_events": {
        "belay_events_pkey": (
            "CREATE UNIQUE INDEX belay_events_pkey ON public.belay_events USING btree (job_id, seq)"
        ),
    },
    "belay_signals": {
        "belay_signals_pkey": (
            "CREATE UNIQUE INDEX belay_signals_pkey ON public.belay_signals "
            "USING btree (scope, name)"
        ),
    },
    "belay_rate": {
        "belay_rate_pkey": (
            "CREATE UNIQUE INDEX belay_rate_pkey ON public.belay_rate "
            "USING btree (bucket, window_start)"
        ),
    },
    "belay_queues": {
        "belay_queues_pkey": (
            "CREATE UNIQUE INDEX belay_queues_pkey ON public.belay_queues USING btree (name)"
        ),
    },
    "belay_crons": {
        "belay_crons_pkey": (
            "CREATE UNIQUE INDEX belay_crons_pkey ON public.belay_crons USING btree (name)"
        ),
    },
    "belay_schedules": {
        "belay_schedules_pkey": (
            "CREATE UNIQUE INDEX belay_schedules_pkey ON public.belay_schedules "
            "USING btree (name)"
        ),
    },
    "belay_meta": {},
}

TABLES = sorted(EXPECTED_COLUMNS)


# -- Catalog helpers --------------------------------------------------------------------


def _squash(text: str) -> str:
    return " ".join(text.split())


def _columns(conn: psycopg.Connection[Any], table: str) -> list[tuple[str, str, bool, str | None]]:
    rows = conn.execute(
        """
        SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute a
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY a.attnum
        """,
        (table,),
    ).fetchall()
    return [(name, typ, notnull, default) for name, typ, notnull, default in rows]


def _indexes(conn: psycopg.Connection[Any], table: str) -> dict[str, str]:
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename = %s",
        (table,),
    ).fetchall()
    return {name: _squash(definition) for name, definition in rows}


def _constraints(conn: psycopg.Connection[Any], table: str) -> list[tuple[str, str, str]]:
    """(name, contype, definition) of every constraint on ``table``. PostgreSQL 18 also
    records NOT NULL as constraints (contype 'n'); those are covered by the column check."""
    rows = conn.execute(
        """
        SELECT conname, contype::text, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE conrelid = %s::regclass AND contype <> 'n' ORDER BY conname
        """,
        (table,),
    ).fetchall()
    return [(name, kind, definition) for name, kind, definition in rows]


def _belay_relations(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    rows = conn.execute(
        """
        SELECT c.relname, c.relkind::text FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relname LIKE 'belay%' ORDER BY c.relname
        """
    ).fetchall()
    return [(name, kind) for name, kind in rows]


def _meta_rows(conn: psycopg.Connection[Any]) -> list[tuple[int, ...]]:
    has_major = conn.execute(
        "SELECT count(*) FROM pg_attribute WHERE attrelid = 'belay_meta'::regclass "
        "AND attname = 'contract_major' AND NOT attisdropped"
    ).fetchone()
    query = (
        "SELECT version, contract_major FROM belay_meta ORDER BY version, contract_major"
        if has_major and has_major[0]
        else "SELECT version FROM belay_meta ORDER BY version"
    )
    return [tuple(row) for row in conn.execute(query).fetchall()]


def snapshot(url: str) -> dict[str, Any]:
    """Everything a migration could change: relations, columns, indexes,
    constraints, triggers and the belay_meta rows."""
    with psycopg.connect(url) as conn:
        relations = _belay_relations(conn)
        tables = [name for name, kind in relations if kind == "r"]
        triggers = conn.execute(
            "SELECT tgrelid::regclass::text, tgname FROM pg_trigger "
            "WHERE tgrelid::regclass::text LIKE 'belay%' ORDER BY 1, 2"
        ).fetchall()
        return {
            "relations": relations,
            "columns": {t: _columns(conn, t) for t in tables},
            "indexes": {t: _indexes(conn, t) for t in tables},
            "constraints": {t: _constraints(conn, t) for t in tables},
            "triggers": triggers,
            "meta": _meta_rows(conn) if "belay_meta" in tables else None,
        }


@contextlib.contextmanager
def fresh_empty_database(server_url: str) -> Iterator[str]:
    """A database without schema, dropped afterwards (for tests that need several)."""
    name = f"belay_schema_{os.getpid()}_{next(_names)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield url_for(server_url, name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


_names = itertools.count()


def build_reference_revision_2(url: str) -> None:
    """Build the database exactly as the Elixir reference's ``migrate!`` leaves it at
    its latest revision (2): its own belay_meta, migrations 1 and 2, one row each."""
    first, second = belay.sql.migrations()[:2]
    assert (first.revision, second.revision) == (1, 2)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS belay_meta (version int NOT NULL)")
        for migration in (first, second):
            conn.execute(migration.sql)
            conn.execute("INSERT INTO belay_meta (version) VALUES (%s)", (migration.revision,))


def insert_raw_job(url: str, kind: str = "Elixir.MyApp.Worker") -> int:
    """A job as a foreign producer writes it (§5.1)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO belay_jobs (kind, queue, input, ready_at, inserted_at) "
            "VALUES (%s, 'default', '{\"n\": 7}', %s, %s) RETURNING id",
            (kind, NOW, NOW),
        ).fetchone()
    assert row is not None
    return int(row[0])


# -- §3: the tables, columns, indexes and keys --------------------------------------------


def test_migrate_creates_exactly_the_belay_tables(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        relations = _belay_relations(conn)
    assert [name for name, kind in relations if kind == "r"] == TABLES
    # bigserial's sequence, the indexes; nothing else named belay_* (no views, no types).
    expected_indexes = sorted(itertools.chain.from_iterable(EXPECTED_INDEXES.values()))
    assert [name for name, kind in relations if kind == "i"] == expected_indexes
    assert [name for name, kind in relations if kind == "S"] == ["belay_jobs_id_seq"]
    assert {kind for _, kind in relations} == {"r", "i", "S"}


@pytest.mark.parametrize("table", TABLES)
def test_columns_types_not_null_and_defaults_match_the_reference(db_url: str, table: str) -> None:
    with psycopg.connect(db_url) as conn:
        assert _columns(conn, table) == EXPECTED_COLUMNS[table]


@pytest.mark.parametrize("table", TABLES)
def test_indexes_match_the_reference_names_columns_uniqueness_and_predicates(
    db_url: str, table: str
) -> None:
    with psycopg.connect(db_url) as conn:
        assert _indexes(conn, table) == EXPECTED_INDEXES[table]


@pytest.mark.parametrize("table", TABLES)
def test_primary_key_only_no_foreign_keys_or_checks(db_url: str, table: str) -> None:
    """§3: no foreign keys, no CHECKs — the only constraint is the PK."""
    with psycopg.connect(db_url) as conn:
        constraints = _constraints(conn, table)
    pk = EXPECTED_PRIMARY_KEYS[table]
    expected = [] if pk is None else [(f"{table}_pkey", "p", pk)]
    assert constraints == expected


def test_no_triggers_on_belay_tables(db_url: str) -> None:
    assert snapshot(db_url)["triggers"] == []


# -- Migration 3 ------------------------------------------------------------------------


def test_migration_3_adds_contract_major_and_records_each_revision_once(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        assert ("contract_major", "integer", True, "1") in _columns(conn, "belay_meta")
        rows = conn.execute(
            "SELECT version, count(*), min(contract_major), max(contract_major) "
            "FROM belay_meta GROUP BY version ORDER BY version"
        ).fetchall()
    assert rows == [(n, 1, 1, 1) for n in range(1, 7)]


def test_migration_3_claim_order_index_puts_null_ready_at_first(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            """
            SELECT i.indisunique, pg_get_expr(i.indpred, i.indrelid),
                   array(SELECT pg_get_indexdef(i.indexrelid, k, true)
                         FROM generate_series(1, i.indnkeyatts) k),
                   i.indoption::int2[]
            FROM pg_index i WHERE i.indexrelid = 'belay_jobs_claim_order_idx'::regclass
            """
        ).fetchone()
    assert row is not None
    unique, predicate, keys, options = row
    assert not unique
    assert predicate == "(state = 'ready'::text)"
    assert keys == ["queue", "priority", "ready_at", "id"]
    # indoption bit 2 = NULLS FIRST, bit 1 = DESC: only ready_at is NULLS FIRST, all ASC.
    assert list(options) == [0, 0, 2, 0]


# -- docs/contract.md §3, where belay differs: the claim uses the ordered index ----------------

#: The claim's own ready-set select (its first CTE), as the worker runs it.
CLAIM_READY = QUERIES["claim"].split("WITH ready AS (", 1)[1].split("), due AS", 1)[0]
CLAIM_PARAMS = {"queue": "q1", "now": NOW, "take": 10, "kinds": None}


def _fill_ready_set(conn: psycopg.Connection[Any]) -> None:
    """4,000 jobs over 4 queues and 5 priorities: a seventh with NULL ready_at, a tenth
    terminal, the rest due over the past or next hour."""
    conn.execute(
        """
        INSERT INTO belay_jobs (kind, queue, state, priority, ready_at, inserted_at, finished_at)
        SELECT 'k', 'q' || (g %% 4),
               CASE WHEN g %% 10 = 0 THEN 'succeeded' ELSE 'ready' END,
               g %% 5,
               CASE WHEN g %% 7 = 0 THEN NULL
                    ELSE %(now)s + ((g %% 120) - 60) * interval '1 minute' END,
               %(now)s,
               CASE WHEN g %% 10 = 0 THEN %(now)s END
        FROM generate_series(1, 4000) AS g
        """,
        {"now": NOW},
    )
    conn.execute("ANALYZE belay_jobs")


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _explain_claim(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    row = conn.execute(f"EXPLAIN (FORMAT JSON) {CLAIM_READY}", CLAIM_PARAMS).fetchone()
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return list(_plan_nodes(document[0]["Plan"]))


def test_claim_select_uses_claim_order_index_without_sorting(
    sql_conn: psycopg.Connection[Any],
) -> None:
    """§3, where belay differs: no Sort of the ready set on any claim."""
    _fill_ready_set(sql_conn)
    # The planner's own choice, no enable_* overrides: with LIMIT 10 an index whose
    # order is the ORDER BY wins outright.
    nodes = _explain_claim(sql_conn)
    assert "belay_jobs_claim_order_idx" in {n.get("Index Name") for n in nodes}, nodes
    assert not [n["Node Type"] for n in nodes if "Sort" in n["Node Type"]], nodes
    # And the query really returns the claim order: priority 0 first, NULL ready_at
    # before any timestamp, then id.
    ids = [r[0] for r in sql_conn.execute(CLAIM_READY, CLAIM_PARAMS).fetchall()]
    expected = sql_conn.execute(
        """
        SELECT id FROM belay_jobs
        WHERE queue = 'q1' AND state = 'ready' AND (ready_at IS NULL OR ready_at <= %s)
        ORDER BY priority, ready_at IS NOT NULL, ready_at, id LIMIT 10
        """,
        (NOW,),
    ).fetchall()
    assert ids == [r[0] for r in expected]


def test_the_claim_reads_the_index_in_order_before_the_first_analyze(
    sql_conn: psycopg.Connection[Any],
) -> None:
    """A burst of jobs into a table autovacuum has not analyzed yet (its planner
    statistics say "never counted"), most of them already worked off: the claim
    must still walk the index in order. With "ready_at IS NULL OR ready_at <= now"
    this very setup made PostgreSQL bitmap-scan both ranges and sort all 30,000
    jobs left on every claim (26 ms against 1.9 ms)."""
    sql_conn.execute("ALTER TABLE belay_jobs SET (autovacuum_enabled = false)")
    sql_conn.execute(
        """
        INSERT INTO belay_jobs (kind, queue, state, ready_at, inserted_at)
        SELECT 'k', 'q1', 'ready', %(now)s - interval '1 minute', %(now)s
        FROM generate_series(1, 200000)
        """,
        {"now": NOW},
    )
    # Claimed, then acked, as a worker would have: two new row versions each.
    sql_conn.execute("UPDATE belay_jobs SET state = 'running' WHERE id <= 170000")
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE id <= 170000")
    assert sql_conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'belay_jobs'"
                            ).fetchone() == (-1,)
    params = {"queue": "q1", "take": 100, "node": "n", "now": NOW,
              "lease_until": NOW + timedelta(seconds=30), "kinds": None}
    with sql_conn.transaction():
        row = sql_conn.execute(f"EXPLAIN (FORMAT JSON) {QUERIES['claim']}", params).fetchone()
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    nodes = list(_plan_nodes(document[0]["Plan"]))
    scans = {n.get("Index Name"): n["Node Type"] for n in nodes if n.get("Index Name")}
    assert scans.get("belay_jobs_claim_order_idx") == "Index Scan", scans
    assert not [n["Node Type"] for n in nodes if "Bitmap" in n["Node Type"]], scans


def test_reference_claim_index_alone_would_sort(sql_conn: psycopg.Connection[Any]) -> None:
    """The control for the test above: without migration 3's index the same select
    needs a Sort (the cost that made belay add the ordered index), so the plan
    check can tell them apart."""
    _fill_ready_set(sql_conn)
    sql_conn.execute("DROP INDEX belay_jobs_claim_order_idx")
    nodes = _explain_claim(sql_conn)
    assert [n["Node Type"] for n in nodes if "Sort" in n["Node Type"]], nodes


# -- Idempotence and concurrent migrations ----------------------------------------------------


def test_migrate_twice_applies_nothing_the_second_time(empty_db_url: str) -> None:
    assert belay.migrate(empty_db_url) == [1, 2, 3, 4, 5, 6]
    before = snapshot(empty_db_url)
    assert belay.migrate(empty_db_url) == []
    assert snapshot(empty_db_url) == before


def test_migrate_matches_the_template_built_by_the_test_harness(
    empty_db_url: str, db_url: str
) -> None:
    belay.migrate(empty_db_url)
    assert snapshot(empty_db_url) == snapshot(db_url)


def _race_migrations(url: str, threads: int) -> tuple[list[list[int]], list[BaseException]]:
    """``threads`` threads lined up on a barrier, each calling belay.migrate(url)."""
    barrier = threading.Barrier(threads)
    results: list[list[int]] = []
    failures: list[BaseException] = []
    guard = threading.Lock()

    def run() -> None:
        try:
            barrier.wait(timeout=10)
            applied = belay.migrate(url)
            with guard:
                results.append(applied)
        except BaseException as exc:
            with guard:
                failures.append(exc)

    workers = [threading.Thread(target=run, name=f"migrate-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers), "a migration hung"
    return results, failures


def test_concurrent_migrations_apply_each_revision_exactly_once(server_url: str) -> None:
    """Migrations are safe when several processes run them at once (an advisory lock)."""
    threads = 6
    for _round in range(3):
        with fresh_empty_database(server_url) as url:
            results, failures = _race_migrations(url, threads)
            assert not failures, failures
            # One migrator did all the work; the others found nothing left to do.
            assert sorted(results) == [[]] * (threads - 1) + [[1, 2, 3, 4, 5, 6]]
            state = snapshot(url)
            assert state["meta"] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
            assert sorted(state["columns"]) == TABLES
            assert state["indexes"] == EXPECTED_INDEXES


# -- §1: the startup check ------------------------------------------------------------------


def test_no_schema_is_reported_with_the_command_to_run(empty_db_url: str) -> None:
    with pytest.raises(SchemaMissing, match="belay migrate"):
        belay.check_schema(empty_db_url)
    with belay.Belay(empty_db_url) as client, pytest.raises(SchemaMissing, match="belay migrate"):
        client.get_job(1)


def test_empty_belay_meta_counts_as_no_schema(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE belay_meta (version int NOT NULL)")
    with pytest.raises(SchemaMissing, match="belay migrate"):
        belay.check_schema(empty_db_url)


def test_reference_revision_2_is_outdated_until_migrated(empty_db_url: str) -> None:
    """A database the Elixir reference built (revision 2) is refused by the check and
    by the client, then upgraded in place by belay.migrate with its jobs intact."""
    build_reference_revision_2(empty_db_url)
    job_id = insert_raw_job(empty_db_url)

    with pytest.raises(SchemaOutdated, match=r"revision 2\b.*belay migrate"):
        belay.check_schema(empty_db_url)
    with belay.Belay(empty_db_url) as client, pytest.raises(SchemaOutdated, match="revision 2"):
        client.get_job(job_id)

    assert belay.migrate(empty_db_url) == [3, 4, 5, 6]
    status = belay.check_schema(empty_db_url)
    assert (status.revision, status.contract_major) == (6, 1)
    with belay.Belay(empty_db_url) as client:
        job = client.get_job(job_id)
    assert job is not None
    assert (job.kind, job.queue, job.state, job.input) == (
        "Elixir.MyApp.Worker", "default", "ready", {"n": 7}
    )
    with psycopg.connect(empty_db_url) as conn:
        # The reference's rows read as contract major 1 through the column default.
        assert _meta_rows(conn) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]


def test_upgraded_reference_database_equals_a_fresh_belay_database(
    empty_db_url: str, db_url: str
) -> None:
    build_reference_revision_2(empty_db_url)
    belay.migrate(empty_db_url)
    assert snapshot(empty_db_url) == snapshot(db_url)


def test_client_rechecks_after_a_failed_check(empty_db_url: str) -> None:
    """A client that met an outdated schema works once the operator has migrated,
    without being rebuilt."""
    build_reference_revision_2(empty_db_url)
    job_id = insert_raw_job(empty_db_url)
    with belay.Belay(empty_db_url) as client:
        with pytest.raises(SchemaOutdated):
            client.get_job(job_id)
        belay.migrate(empty_db_url)
        job = client.get_job(job_id)
        assert job is not None
        assert job.id == job_id


@pytest.mark.parametrize(
    "setup",
    [
        "UPDATE belay_meta SET contract_major = 2",
        "INSERT INTO belay_meta (version, contract_major) VALUES (4, 2)",
    ],
    ids=["major-updated", "revision-4-major-2"],
)
def test_higher_contract_major_is_refused_by_check_client_and_migrate(
    db_url: str, setup: str
) -> None:
    """§1: refuse a higher contract major than we know — even to migrate."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(setup)
    with pytest.raises(ContractMismatch, match="major 2"):
        belay.check_schema(db_url)
    with belay.Belay(db_url) as client, pytest.raises(ContractMismatch):
        client.get_job(1)
    before = snapshot(db_url)
    with pytest.raises(ContractMismatch):
        belay.migrate(db_url)
    assert snapshot(db_url) == before


def test_migrate_refuses_a_higher_major_before_applying_anything(empty_db_url: str) -> None:
    """Refusal comes before any DDL: a revision-2 database that already declares
    major 2 does not get migration 3 applied."""
    build_reference_revision_2(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE belay_meta ADD COLUMN contract_major int NOT NULL DEFAULT 2")
    before = snapshot(empty_db_url)
    with pytest.raises(ContractMismatch):
        belay.migrate(empty_db_url)
    after = snapshot(empty_db_url)
    assert after == before
    assert "belay_jobs_claim_order_idx" not in after["indexes"]["belay_jobs"]


def test_newer_revision_within_major_1_is_accepted(db_url: str) -> None:
    """§1: tolerate newer migrations within a known contract major."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO belay_meta (version, contract_major) VALUES (6, 1)")
    job_id = insert_raw_job(db_url)
    status = belay.check_schema(db_url)
    assert (status.revision, status.contract_major) == (6, 1)
    with belay.Belay(db_url) as client:
        job = client.get_job(job_id)
    assert job is not None
    assert job.id == job_id
    # Nothing to apply either: migrate never goes backwards.
    assert belay.migrate(db_url) == []


# -- The pure check ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("revision", "major", "problem", "message"),
    [
        (0, None, SchemaMissing, "belay migrate"),
        (1, None, SchemaOutdated, r"revision 1\b.*belay migrate"),
        (2, None, SchemaOutdated, r"revision 2\b.*belay migrate"),
        (2, 1, SchemaOutdated, r"revision 2\b.*belay migrate"),
        (3, 1, None, None),
        (4, 1, None, None),
        (250, 1, None, None),
        (3, 2, ContractMismatch, r"major 2.*upgrade belay"),
        (4, 2, ContractMismatch, r"major 2.*upgrade belay"),
        # A higher major wins over an old revision: migrating would not help.
        (2, 2, ContractMismatch, r"major 2.*upgrade belay"),
        (3, 0, ContractMismatch, r"major 0"),
    ],
)
def test_schema_status_problem(
    revision: int, major: int | None, problem: type[Exception] | None, message: str | None
) -> None:
    found = SchemaStatus(revision, major).problem
    if problem is None:
        assert found is None
    else:
        assert type(found) is problem
        assert message is not None
        assert re.search(message, str(found)), str(found)


def test_schema_status_constants_are_the_contract_ones() -> None:
    assert (belay.CONTRACT_MAJOR, belay.MIN_REVISION) == (1, 3)
    assert [m.revision for m in belay.sql.migrations()] == [1, 2, 3, 4, 5, 6]


# -- One home for SQL (STYLE.md) and the clock rule (§2) ------------------------------------

_PACKAGES = [REPO / p for p in ("belay", "belay_django", "belay_sqlalchemy") if (REPO / p).is_dir()]


def _is_queries(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "QUERIES") or (
        isinstance(node, ast.Attribute) and node.attr == "QUERIES"
    )


def _strings(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def used_query_names() -> tuple[set[str], list[str]]:
    """Query names the code asks for: ``QUERIES["x"]`` directly, or a string passed to a
    helper that indexes QUERIES with one of its parameters (``_rows(conn, "x", …)``;
    found by reading the helpers, not listed by hand)."""
    trees = [
        (path, ast.parse(path.read_text("utf-8")))
        for package in _PACKAGES
        for path in sorted(package.rglob("*.py"))
    ]
    # A plan's statement (belay.plans.Call) names its query first.
    helpers: dict[str, int] = {"Call": 0}
    for _, tree in trees:
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Subscript) and _is_queries(node.value)
                    and isinstance(node.slice, ast.Name) and node.slice.id in params
                ):
                    helpers[fn.name] = params.index(node.slice.id)
                elif (
                    isinstance(node, ast.Call) and _callee(node) == "Call" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in params
                ):
                    helpers[fn.name] = params.index(node.args[0].id)
    used: set[str] = set()
    sites: list[str] = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _is_queries(node.value):
                found = _strings(node.slice)
            elif isinstance(node, ast.Call) and _callee(node) in helpers:
                index = helpers[_callee(node) or ""]
                found = _strings(node.args[index]) if len(node.args) > index else set()
            else:
                continue
            used |= found
            sites += [f"{path.relative_to(REPO)}:{node.lineno}:{name}" for name in found]
    return used, sites


def test_queries_sql_parses_into_named_statements() -> None:
    assert belay.sql.QUERIES, "queries.sql yielded no statements"
    for name, statement in belay.sql.QUERIES.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        code = _without_comments(statement).strip()
        assert code, f"query {name!r} is only comments"


def test_every_query_name_used_in_the_code_exists() -> None:
    used, sites = used_query_names()
    # The helpers are found and used: guards against the scan silently finding nothing.
    assert {"get_job", "insert_jobs", "meta_revision"} <= used, sites
    missing = sorted(used - set(belay.sql.QUERIES))
    assert not missing, [s for s in sites if s.rsplit(":", 1)[1] in missing]


def test_every_query_in_queries_sql_is_used() -> None:
    """No dead SQL: every named block is asked for somewhere in the packages — through a
    helper call, or named as a string constant (e.g. a table of outcome → statement)."""
    used, _ = used_query_names()
    constants = {
        node.value
        for package in _PACKAGES
        for path in sorted(package.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert sorted(set(belay.sql.QUERIES) - used - constants) == []


def _without_comments(text: str) -> str:
    return re.sub(r"--[^\n]*", "", text)


def _to_dollar_params(statement: str) -> str:
    numbers: dict[str, int] = {}
    counter = itertools.count(1)

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        if match.group(1) is None:
            return f"${next(counter)}"
        if match.group(1) not in numbers:
            numbers[match.group(1)] = next(counter)
        return f"${numbers[match.group(1)]}"

    return re.sub(r"%\((\w+)\)s|%s|%%", replace, statement)


def test_every_query_is_valid_sql_against_the_migrated_schema(
    sql_conn: psycopg.Connection[Any],
) -> None:
    """Each statement parses and resolves every table and column it names (prepared,
    never executed); parameter types are left for PostgreSQL to infer."""
    failures: dict[str, str] = {}
    for index, (name, statement) in enumerate(belay.sql.QUERIES.items()):
        text: str = statement
        holes = re.findall(r"\{(\w+)\}", text)
        if holes:
            text = sql.SQL(statement).format(
                **{h: sql.Identifier("belay_probe") for h in holes}
            ).as_string(sql_conn)
        result = sql_conn.pgconn.prepare(
            f"belay_probe_{index}".encode(), _to_dollar_params(text).encode()
        )
        if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
            failures[name] = (result.error_message or b"").decode()
    assert failures == {}


_CLOCK_CALLS = re.compile(
    r"\bnow\s*\(|\b(current_timestamp|clock_timestamp|statement_timestamp"
    r"|transaction_timestamp|localtimestamp|current_date|current_time|localtime)\b",
    re.IGNORECASE,
)


def test_no_sql_reads_the_database_clock() -> None:
    """§2 clock rule: "now" is always a bind parameter; SQL never calls now()."""
    folder = REPO / "belay" / "sql"
    files = sorted(folder.rglob("*.sql"))
    assert any(f.name == "queries.sql" for f in files)
    assert len([f for f in files if f.parent.name == "migrations"]) == 6
    offenders = [
        f"{path.relative_to(REPO)}: {line.strip()}"
        for path in files
        for line in _without_comments(path.read_text("utf-8")).splitlines()
        if _CLOCK_CALLS.search(line)
    ]
    assert offenders == []


def test_clock_rule_scan_catches_a_call() -> None:
    """The scan above is not vacuous: it flags the spellings it is meant to catch and
    ignores them inside comments."""
    assert _CLOCK_CALLS.search("SET finished_at = now()")
    assert _CLOCK_CALLS.search("WHERE ready_at <= CURRENT_TIMESTAMP")
    assert _CLOCK_CALLS.search("clock_timestamp()")
    assert not _CLOCK_CALLS.search(_without_comments("-- SQL never calls now()"))
    assert not _CLOCK_CALLS.search("lease_until = %(now)s")


def test_schema_status_values_are_plain(db_url: str) -> None:
    status = belay.check_schema(db_url)
    assert status == SchemaStatus(6, 1)
    assert status.describe() == "schema revision 6, contract major 1"

