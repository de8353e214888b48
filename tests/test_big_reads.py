"""Operator reads that stay fast on big tables (revision 4's
``belay_jobs_state_queue_id_idx``): counts per queue and state that stop at a
cap, and the job list filtered by state and/or queue read as a page of ids.

Each shape is checked against a plain reading of the same rows (every filter,
every page), and its plan is pinned: the index, never a pass over the table,
with custom and with generic plans (what a prepared statement gets after five
executions).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest

import belay
from belay import ValidationError, cliformat, ops, store
from belay.dashboard import pages
from belay.job import STATES
from belay.sql import QUERIES
from tests.helpers import Conn

QUEUES = ("alpha", "beta", "gamma")
KINDS = ("k.one", "k.two")


def fill(conn: Conn, rows: int) -> None:
    """``rows`` jobs spread over the queues, every state and both kinds, in an
    order that interleaves them (so no filter's rows are contiguous by id)."""
    conn.execute(
        "INSERT INTO belay_jobs (kind, queue, state, inserted_at) "
        "SELECT (%(kinds)s::text[])[1 + (i * 7) %% 2], (%(queues)s::text[])[1 + (i * 5) %% 3], "
        "       (%(states)s::text[])[1 + (i * 3 + i / 11) %% 8], now() "
        "FROM generate_series(1, %(n)s) AS i",
        {"kinds": list(KINDS), "queues": list(QUEUES), "states": list(STATES), "n": rows})


def every_row(conn: Conn) -> list[tuple[int, str, str, str]]:
    return conn.execute("SELECT id, queue, state, kind FROM belay_jobs ORDER BY id DESC").fetchall()


# -- the job list ------------------------------------------------------------------------


def test_each_filter_reads_its_own_statement() -> None:
    F = store.JobFilter
    assert store.list_statement(F()) == "list_jobs"
    assert store.list_statement(F(kind="k")) == "list_jobs"
    assert store.list_statement(F(state="failed")) == "list_jobs_in_state"
    assert store.list_statement(F(queue="q")) == "list_jobs_in_queue"
    assert store.list_statement(F(state="failed", queue="q", kind="k")) == \
        "list_jobs_in_state_queue"
    # A workflow or a parent has its own, more selective index.
    assert store.list_statement(F(state="failed", workflow_id="w")) == "list_jobs"
    assert store.list_statement(F(queue="q", parent_id=1)) == "list_jobs"


@pytest.mark.parametrize("limit", [1, 7, 50])
def test_every_filter_and_page_matches_a_plain_reading(client: belay.Belay, sql_conn: Conn,
                                                       limit: int) -> None:
    fill(sql_conn, 400)
    rows = every_row(sql_conn)
    assert {r[2] for r in rows} == set(STATES) and {r[1] for r in rows} == set(QUEUES)
    for queue, state, kind in itertools.product(
            (None, *QUEUES, "nowhere"), (None, *STATES), (None, *KINDS)):
        expected = [r[0] for r in rows if queue in (None, r[1]) and state in (None, r[2])
                    and kind in (None, r[3])]
        seen: list[int] = []
        before: int | None = None
        while True:
            page = client.list_jobs(queue=queue, state=state, kind=kind, before_id=before,
                                    limit=limit)
            assert len(page) <= limit
            seen += [job.id for job in page]
            if len(page) < limit:
                break
            before = page[-1].id
        assert seen == expected, (queue, state, kind, limit)


def plan(conn: Conn, name: str, params: dict[str, Any], *, generic: bool) -> str:
    conn.execute("SET plan_cache_mode = " + ("force_generic_plan" if generic else "auto"))
    cur = psycopg.ClientCursor(conn)
    text = cur.mogrify(QUERIES[name], params) if not generic else QUERIES[name]
    if generic:
        # A prepared statement's generic plan: the parameters stay unknown.
        conn.prepare_threshold = 0
        found = conn.execute("EXPLAIN (FORMAT JSON) " + text, params,  # type: ignore[arg-type]
                             prepare=True).fetchone()
    else:
        found = conn.execute("EXPLAIN (FORMAT JSON) " + text).fetchone()  # type: ignore[arg-type]
    assert found is not None
    return json.dumps(found[0])


@pytest.mark.direct_only
@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize(("name", "filters"), [
    ("list_jobs_in_state", {"state": "failed"}),
    ("list_jobs_in_queue", {"queue": "beta"}),
    ("list_jobs_in_state_queue", {"state": "failed", "queue": "beta"}),
    ("list_jobs_in_state_queue", {"state": "cancelled", "queue": "nowhere"}),
])
def test_a_filtered_list_reads_the_index_never_the_whole_table(
        direct_url: str, name: str, filters: dict[str, Any], generic: bool) -> None:
    """The shape bench/bigtable.py measured: a big finished history, the newest ids
    a ready backlog. In one statement the planner walked the primary key back
    through the backlog; the page of ids must come off the state/queue index."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
            "SELECT 'k.one', (ARRAY['alpha','beta','gamma'])[1 + i % 3], "
            "       (ARRAY['succeeded','succeeded','failed','cancelled'])[1 + i % 4], now(), now() "
            "FROM generate_series(1, 60000) AS i")
        conn.execute("INSERT INTO belay_jobs (kind, queue, inserted_at) "
                     "SELECT 'k.one', 'alpha', now() FROM generate_series(1, 20000)")
        conn.execute("VACUUM ANALYZE belay_jobs")
        params = {"queue": None, "state": None, "kind": None, "before_id": None, "limit": 50,
                  **filters}
        shown = plan(conn, name, params, generic=generic)
    assert "belay_jobs_state_queue_id_idx" in shown
    assert "Seq Scan" not in shown
    assert '"Scan Direction": "Backward", "Index Name": "belay_jobs_pkey"' not in shown


@pytest.mark.direct_only
def test_the_tiles_spend_reads_the_index_not_the_table(direct_url: str) -> None:
    with psycopg.connect(direct_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
            "SELECT 'k.one', 'alpha', 'succeeded', now(), now() FROM generate_series(1, 60000)")
        conn.execute("INSERT INTO belay_jobs (kind, queue, state, inserted_at) "
                     "SELECT 'k.one', 'alpha', 'running', now() FROM generate_series(1, 5)")
        conn.execute("VACUUM ANALYZE belay_jobs")
        shown = plan(conn, "queue_spend_in_flight", {}, generic=False)
    assert "belay_jobs_state_queue_id_idx" in shown and "Seq Scan" not in shown


@pytest.mark.direct_only
@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_a_claim_never_reads_the_state_queue_index(direct_url: str, generic: bool) -> None:
    """The claim walks belay_jobs_claim_order_idx in claim order. Had the operator
    index no predicate the claim can't state (``id > 0``), the planner could read
    it and sort the ready set instead; it did, while a long transaction held
    vacuum back (bench/vacuum_results.md). Few ready rows among many finished
    ones, dead entries in the claim index: the shape that tempted it."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
            "SELECT 'k.one', 'alpha', 'succeeded', now(), now() FROM generate_series(1, 20000)")
        conn.execute("INSERT INTO belay_jobs (kind, queue, inserted_at) "
                     "SELECT 'k.one', 'alpha', now() FROM generate_series(1, 3000)")
        conn.execute("VACUUM ANALYZE belay_jobs")
        conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE state = 'ready' "
                     "AND id % 100 <> 0")  # dead entries the claim index keeps
        shown = plan(conn, "claim", {"queue": "alpha", "now": datetime.now(timezone.utc),
                                     "take": 10, "kinds": None, "node": "n",
                                     "lease_until": datetime.now(timezone.utc)},
                     generic=generic)
    assert "belay_jobs_claim_order_idx" in shown
    assert "belay_jobs_state_queue_id_idx" not in shown


# -- counts ------------------------------------------------------------------------------


def exact(conn: Conn) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for queue, state, n in conn.execute(
            "SELECT queue, state, count(*) FROM belay_jobs GROUP BY 1, 2").fetchall():
        out.setdefault(queue, {})[state] = n
    return out


def test_counts_are_exact_up_to_the_cap_and_cap_plus_one_beyond(client: belay.Belay,
                                                                 sql_conn: Conn) -> None:
    fill(sql_conn, 400)
    truth = exact(sql_conn)
    assert client.stats(cap=None) == truth
    assert client.stats() == truth  # all under the default cap
    sizes = Counter(n for counts in truth.values() for n in counts.values())
    cap = sorted(sizes)[len(sizes) // 2]  # some counts above it, some not
    capped = client.stats(cap=cap)
    assert capped == {q: {s: min(n, cap + 1) for s, n in counts.items()}
                      for q, counts in truth.items()}
    assert any(n == cap + 1 for c in capped.values() for n in c.values())
    assert any(n <= cap for c in capped.values() for n in c.values())
    assert belay.STATS_CAP == 10_000


def test_a_state_outside_the_contract_is_counted_too(client: belay.Belay,
                                                     sql_conn: Conn) -> None:
    fill(sql_conn, 30)
    sql_conn.execute("UPDATE belay_jobs SET state = 'archived' WHERE id % 10 = 0")
    assert client.stats() == exact(sql_conn)
    assert "archived" in client.stats()["alpha"] or "archived" in client.stats()["beta"]


@pytest.mark.parametrize("cap", [0, -1, True, 1.5, "10"])
def test_a_bad_cap_is_refused_naming_it(client: belay.Belay, cap: Any) -> None:
    with pytest.raises(ValidationError, match="cap is a whole number >= 1"):
        client.stats(cap=cap)


def test_the_overview_shows_a_capped_count_with_a_plus(client: belay.Belay,
                                                       sql_conn: Conn) -> None:
    sql_conn.execute("INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
                     "SELECT 'k.one', 'alpha', 'succeeded', now(), now() "
                     "FROM generate_series(1, 12)")
    sql_conn.execute("INSERT INTO belay_jobs (kind, queue, inserted_at) "
                     "SELECT 'k.one', 'alpha', now() FROM generate_series(1, 3)")
    [tile] = ops.queue_overview(client, cap=5)
    assert (tile["counts"]["succeeded"], tile["counts"]["ready"]) == (6, 3)
    assert (tile["capped"], tile["count_cap"], tile["total"]) == (["succeeded"], 5, 9)
    assert (cliformat.count(tile, "succeeded"), cliformat.count(tile, "ready")) == ("5+", "3")
    assert cliformat.count(tile) == "9+"
    page = str(pages.tile(pages.Page(), tile))
    assert "<b>5+</b><span>succeeded</span>" in page and "9+ jobs" in page
    [exact_tile] = ops.queue_overview(client)
    assert (exact_tile["counts"]["succeeded"], exact_tile["capped"]) == (12, [])
    assert cliformat.count(exact_tile) == "15"


def test_the_tiles_spend_is_what_unfinished_jobs_spent(client: belay.Belay,
                                                       sql_conn: Conn) -> None:
    for state, usd, tokens in (("running", 2_000_000, 10), ("awaiting", 500_000, 5),
                               ("succeeded", 9_000_000, 90), ("failed", 1, 1)):
        sql_conn.execute(
            "INSERT INTO belay_jobs (kind, queue, state, spent_usd_micros, spent_tokens, "
            "inserted_at) VALUES ('k.one', 'alpha', %s, %s, %s, now())", (state, usd, tokens))
    [tile] = ops.queue_overview(client)
    assert (tile["spent_usd"], tile["spent_tokens"]) == (2.5, 15)


def test_belay_stats_shows_the_cap_and_exact_counts_on_request(db_url: str,
                                                               sql_conn: Conn) -> None:
    n = belay.STATS_CAP + 5
    sql_conn.execute("INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
                     "SELECT 'k.one', 'bulk', 'succeeded', now(), now() "
                     "FROM generate_series(1, %s)", (n,))
    sql_conn.execute("INSERT INTO belay_jobs (kind, queue, inserted_at) "
                     "VALUES ('k.one', 'bulk', now())")

    def stats(*extra: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
        done = subprocess.run([sys.executable, "-m", "belay", "stats", "--url", db_url, *extra],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        return done

    [tile] = json.loads(stats("--json").stdout)
    assert (tile["counts"]["succeeded"], tile["counts"]["ready"]) == (belay.STATS_CAP + 1, 1)
    assert (tile["capped"], tile["count_cap"]) == (["succeeded"], belay.STATS_CAP)
    row = stats().stdout.splitlines()[1].split()
    assert row[:1] + row[6:10] == ["bulk", "10,000+", "0", "0", "10,002+"], row
    [exact_tile] = json.loads(stats("--json", "--exact").stdout)
    assert (exact_tile["counts"]["succeeded"], exact_tile["total"]) == (n, n + 1)
    assert (exact_tile["capped"], exact_tile["count_cap"]) == ([], None)
    assert f"{n:,}" in stats("--exact").stdout
