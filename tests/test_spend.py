"""Spend analytics (issue 24, item 4): what jobs spent, by kind, queue, day,
hour, workflow, parent, tree or meta key, over a range; and per tree.

Jobs spend through real workers (``belay.testing.drain``) on the ``clock``
fixture, so their ``inserted_at`` is set by moving the clock; the expected
sums are the costs the steps declared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest

import belay
from belay import ops
from belay.spend import Dimension, Query, parse_span
from belay.sql import QUERIES
from tests.helpers import START
from tests.test_steps import drain, no_backoff


def agents(reg: belay.Registry) -> tuple[Any, Any, Any]:
    """Two spending kinds and one that fans out to children sharing its budget."""

    @belay.worker(name="research", max_attempts=1, backoff=no_backoff, registry=reg)
    def research(ctx: belay.Context) -> None:
        for n, (usd, tokens) in enumerate(ctx.input["calls"]):
            ctx.step(f"call-{n}", lambda: None, cost=belay.Cost(usd=usd, tokens=tokens))

    @belay.worker(name="write", max_attempts=1, backoff=no_backoff, registry=reg)
    def write(ctx: belay.Context) -> None:
        for n, (usd, tokens) in enumerate(ctx.input["calls"]):
            ctx.step(f"draft-{n}", lambda: None, cost=belay.Cost(usd=usd, tokens=tokens))

    @belay.worker(name="lead", max_attempts=1, backoff=no_backoff, registry=reg)
    def lead(ctx: belay.Context) -> None:
        ctx.step("plan", lambda: None, cost=belay.Cost(usd=0.1, tokens=100))
        options = {"budget": "share"} if ctx.input.get("share") else {}
        ctx.map_children("fan", research, ctx.input["children"], **options)
        if ctx.input.get("grand"):
            ctx.spawn("grand", "lead", {"children": ctx.input["grand"]})

    return research, write, lead


def seeded(client: belay.Belay, clock: belay.ManualClock, *,
           customer: str = "globex") -> dict[str, Any]:
    """Five jobs over two days, two queues, three customers (the third one's
    name is ``customer``); one that spends nothing."""
    reg = belay.Registry()
    research, write, _ = agents(reg)
    ids = {
        "r1": client.enqueue(research, {"calls": [[0.5, 1000], [0.25, 500]]},
                             meta={"customer": "acme"}).id,
        "w1": client.enqueue(write, {"calls": [[1.0, 2000]]}, queue="slow",
                             meta={"customer": "acme"}).id,
    }
    clock.advance(hours=1)
    ids["idle"] = client.enqueue(research, {"calls": []}).id
    clock.advance(days=1)
    ids["r2"] = client.enqueue(research, {"calls": [[0.125, 10]]},
                               meta={"customer": customer}).id
    ids["w2"] = client.enqueue(write, {"calls": [[2.0, 4000]]}, meta={"customer": 7}).id
    assert drain(client, reg, queue=["default", "slow"]) == {"succeeded": 5}
    return ids


def keyed(report: belay.SpendReport) -> dict[tuple[Any, ...], tuple[int, int, int]]:
    return {row.key: (row.jobs, row.usd_micros, row.tokens) for row in report.rows}


WEEK = {"since": START - timedelta(hours=1), "until": START + timedelta(days=7)}


def test_spend_by_kind_queue_and_meta_key_counts_only_jobs_that_spent(client, clock) -> None:
    seeded(client, clock)
    by_kind = client.spend("kind", **WEEK)
    assert keyed(by_kind) == {("write",): (2, 3_000_000, 6000),
                              ("research",): (2, 875_000, 1510)}
    assert [row.key for row in by_kind.rows] == [("write",), ("research",)]  # largest first
    assert (by_kind.total.jobs, by_kind.total.usd, by_kind.total.tokens) == (4, 3.875, 7510)
    assert by_kind.groups == 2 and by_kind.by == ("kind",)

    assert keyed(client.spend("queue", **WEEK)) == {("default",): (3, 2_875_000, 5510),
                                                    ("slow",): (1, 1_000_000, 2000)}
    # A meta value is read as text: the number 7 groups as "7"; no key, None.
    assert keyed(client.spend("meta:customer", **WEEK)) == {
        ("acme",): (2, 1_750_000, 3500), ("globex",): (1, 125_000, 10),
        ("7",): (1, 2_000_000, 4000)}
    assert keyed(client.spend("meta:missing", **WEEK)) == {(None,): (4, 3_875_000, 7510)}


def test_spend_by_day_and_hour_is_in_time_order_and_two_dimensions_cross(client, clock) -> None:
    seeded(client, clock)
    by_day = client.spend("day", **WEEK)
    assert [(row.key, row.usd_micros) for row in by_day.rows] == [
        (("2026-03-01",), 1_750_000), (("2026-03-02",), 2_125_000)]
    by_hour = client.spend(["hour", "kind"], **WEEK)
    assert [(row.key, row.usd_micros) for row in by_hour.rows] == [
        (("2026-03-01T12:00", "write"), 1_000_000),
        (("2026-03-01T12:00", "research"), 750_000),
        (("2026-03-02T13:00", "write"), 2_000_000),
        (("2026-03-02T13:00", "research"), 125_000)]


def test_the_range_filters_and_limit_narrow_the_report(client, clock) -> None:
    seeded(client, clock)
    # [since, until): the first day only; until is exclusive.
    first = client.spend("kind", since=START, until=START + timedelta(days=1))
    assert first.total.usd_micros == 1_750_000
    # A span back from until, and until defaulting to now.
    recent = client.spend("kind", since=timedelta(hours=2))
    assert recent.until == clock.now() and recent.total.usd_micros == 2_125_000
    assert client.spend("kind", kind="write", **WEEK).total.usd_micros == 3_000_000
    assert client.spend("kind", queue="slow", **WEEK).total.usd_micros == 1_000_000
    assert client.spend("kind", meta={"customer": "acme"}, **WEEK).total.usd_micros == 1_750_000
    capped = client.spend("meta:customer", limit=1, **WEEK)
    assert [row.key for row in capped.rows] == [("7",)]
    assert (capped.groups, capped.total.usd_micros) == (3, 3_875_000)  # the whole, not the cap
    empty = client.spend("kind", since=START + timedelta(days=5), until=START + timedelta(days=6))
    assert (empty.rows, empty.total.jobs, empty.groups) == ([], 0, 0)


def test_a_shared_budget_tree_is_counted_once_and_adds_up_under_its_root(client, clock,
                                                                          sql_conn) -> None:
    reg = belay.Registry()
    _, _, lead = agents(reg)
    children = [{"calls": [[0.25, 10]]}, {"calls": [[0.5, 20]]}]
    root = client.enqueue(lead, {"children": children, "share": True,
                                 "grand": [{"calls": [[1.0, 40]]}]}, budget={"usd": 10})
    other = client.enqueue(lead, {"children": [{"calls": [[0.0, 5]]}]})
    assert drain(client, reg)["succeeded"] == 7
    # The lead was charged its children's 0.75 back (step $spend:fan) ...
    row = sql_conn.execute("SELECT spent_usd_micros FROM belay_jobs WHERE id = %s",
                           (root.id,)).fetchone()
    assert row[0] == 850_000
    # ... which spend counts once, at the children.
    by_kind = keyed(client.spend("kind", **WEEK))
    assert by_kind[("lead",)] == (3, 300_000, 300)
    assert by_kind[("research",)] == (4, 1_750_000, 75)  # the zero-usd child spent tokens
    tree = client.spend_tree(root.id)
    assert (tree.total.jobs, tree.total.usd_micros, tree.total.tokens, tree.depth) == (
        5, 1_950_000, 270, 2)
    assert {k: s.usd_micros for k, s in tree.by_kind.items()} == {
        "research": 1_750_000, "lead": 200_000}
    by_tree = keyed(client.spend("tree", **WEEK))
    assert by_tree == {(str(root.id),): (5, 1_950_000, 270), (str(other.id),): (2, 100_000, 105)}
    by_parent = keyed(client.spend("parent", **WEEK))
    assert by_parent[(None,)] == (2, 200_000, 200)
    assert by_parent[(str(root.id),)] == (3, 850_000, 130)


def test_spend_by_workflow(client, clock) -> None:
    reg = belay.Registry()
    research, _, _ = agents(reg)
    flow = belay.Workflow("spend", workflow_id="wf-spend")
    flow.add("a", research, {"calls": [[0.5, 1]]})
    flow.add("b", research, {"calls": [[0.25, 1]]}, deps=["a"])
    client.enqueue_workflow(flow)
    client.enqueue(research, {"calls": [[1.0, 1]]})
    drain(client, reg)
    assert keyed(client.spend("workflow", **WEEK)) == {
        ("wf-spend",): (2, 750_000, 2), (None,): (1, 1_000_000, 1)}


def test_spend_tree_of_a_missing_job_names_it(client) -> None:
    with pytest.raises(belay.JobNotFound, match="job 999 does not exist"):
        client.spend_tree(999)


@pytest.mark.parametrize(("options", "message"), [
    ({"by": "customer"}, "unknown dimension 'customer'.*meta:<key>"),
    ({"by": ["day", "kind", "queue"]}, "one or two dimensions"),
    ({"by": ["kind", "kind"]}, "the two dimensions are the same"),
    ({"by": "meta:"}, "a meta key"),
    ({"by": "meta:a\x00b"}, "a meta key"),
    ({"since": START, "until": START}, "must be before until"),
    ({"since": START.replace(tzinfo=None)}, "timezone-aware"),
    ({"since": timedelta(0)}, "must be positive"),
    ({"limit": 0}, "from 1 to 10000"),
    ({"limit": True}, "from 1 to 10000"),
    ({"meta": ["acme"]}, "a dict of keys and values"),
    ({"meta": {"k": object()}}, "JSON values"),
    ({"kind": ""}, "kind must be a non-empty string"),
])
def test_a_bad_question_is_refused_with_the_fix(client, options, message) -> None:
    by = options.pop("by", "kind")
    with pytest.raises(belay.ValidationError, match=message):
        client.spend(by, **options)


def test_spans_parse_as_the_cli_takes_them() -> None:
    assert parse_span("30m") == timedelta(minutes=30)
    assert parse_span(" 24h") == timedelta(hours=24)
    assert parse_span("7d") == timedelta(days=7)
    assert parse_span("2w") == timedelta(weeks=2)
    for bad in ("7", "d", "7y", "-1d", "1.5d", ""):
        with pytest.raises(belay.ValidationError, match="like 30m, 24h, 7d"):
            parse_span(bad)
    assert str(Dimension.parse("meta:customer")) == "meta:customer"


def test_the_report_reads_through_the_spend_index(client, sql_conn) -> None:
    """The statement repeats the index's predicate: with sequential scans off
    the planner reaches for belay_jobs_spend_idx, which it could not if the two
    predicates differed (then only a full scan answers)."""
    query = Query.of(START, "kind", since=timedelta(days=7))
    params = query.params()
    text = QUERIES["spend_by"]
    with sql_conn.transaction():
        sql_conn.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(r[0] for r in sql_conn.execute(
            "EXPLAIN " + text, params).fetchall())  # type: ignore[operator]
    assert "belay_jobs_spend_idx" in plan


def test_the_mcp_read_and_the_ops_view(client, clock) -> None:
    seeded(client, clock)
    view = ops.spend_view(client, {"by": "kind", "since": "2026-02-28T00:00:00+00:00",
                                   "until": "2026-03-08T00:00:00+00:00"})
    assert view["total"]["usd"] == 3.875 and view["rows"][0]["key"] == ["write"]
    tree = ops.spend_view(client, {"tree": 1})
    assert tree["job_id"] == 1 and tree["total"]["jobs"] == 1
    with pytest.raises(belay.ValidationError, match="since is an ISO 8601 time with a zone"):
        ops.spend_view(client, {"since": "last week"})
    with pytest.raises(belay.ValidationError, match="unknown argument"):
        ops.spend_view(client, {"group": "kind"})


def test_the_cli_prints_a_table_and_json(client, clock, db_url) -> None:
    seeded(client, clock)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "belay", "spend", "--url", db_url, *args],
                              capture_output=True, text=True, timeout=60)

    # The jobs are from March 2026 by the fixture's clock: a range that holds them.
    window = ["--since", "2026-02-28T00:00:00+00:00", "--until", "2026-03-08T00:00:00+00:00"]
    shown = cli("--by", "kind", *window)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["KIND", "JOBS", "USD", "TOKENS"]
    assert lines[1].split() == ["write", "2", "$3.00", "6,000"]
    assert lines[3].split() == ["total", "4", "$3.875", "7,510"]
    assert "jobs enqueued from 2026-02-28T00:00:00+00:00" in lines[4]
    crossed = json.loads(cli("--by", "day", "--by", "meta:customer", "--json", *window).stdout)
    assert crossed["by"] == ["day", "meta:customer"] and crossed["groups"] == 3
    tree = json.loads(cli("--tree", "1", "--json").stdout)
    assert tree["total"]["usd_micros"] == 750_000
    bad = cli("--by", "colour")
    assert bad.returncode == 2 and "unknown dimension 'colour'" in bad.stderr
    assert "Traceback" not in bad.stderr
    span = cli("--since", "a week")
    assert span.returncode == 2 and "a span back from until (30m, 24h, 7d, 2w)" in span.stderr


def test_jit_is_turned_off_only_in_belays_own_transaction(client, db_url) -> None:
    """A report on belay's own connection runs without JIT (its plan over a big
    range compiled for longer than it ran); one on the caller's connection
    leaves the caller's setting alone."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        before = conn.execute("SHOW jit").fetchone()[0]
        client.spend("kind", conn=conn)
        assert conn.execute("SHOW jit").fetchone()[0] == before
    seen: list[str] = []
    real = client.transaction

    def spying(conn: Any = None) -> Any:
        manager = real(conn)

        class Spy:
            def __enter__(self) -> Any:
                self.active = manager.__enter__()
                return self.active

            def __exit__(self, *exc: Any) -> Any:
                seen.append(self.active.execute("SHOW jit").fetchone()[0])
                return manager.__exit__(*exc)

        return Spy()

    client.transaction = spying  # type: ignore[method-assign]
    client.spend("kind")
    assert seen == ["off"]
