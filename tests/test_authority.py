"""Attenuated authority (issue 24, item 5): a capability set in a job's meta
that what the job starts inherits and may only narrow.

Jobs run through the worker's own claim/run/ack path (``belay.testing.drain``)
on a real PostgreSQL; a refusal inside a job fails it at once (attempt 1, no
retry), and nothing it tried to start is written.
"""

from __future__ import annotations

from typing import Any

import pytest

import belay
from belay import ops
from belay.authority import AUTHORITY_KEY, Authority, authority_of, check_tool
from tests.test_steps import drain, no_backoff

ROOT = {"tools": ["search", "fetch"], "queues": ["default", "agents"], "kinds": ["child"],
        "usd": 2, "tokens": 10_000}


def spawner(reg: belay.Registry, how: Any) -> None:
    """A ``parent`` whose body is ``how(ctx)``, and a ``child`` that returns its meta."""

    @belay.worker(name="parent", max_attempts=3, backoff=no_backoff, registry=reg)
    def parent(ctx: belay.Context) -> Any:
        return how(ctx)

    @belay.worker(name="child", registry=reg)
    def child(ctx: belay.Context) -> Any:
        return ctx.meta.get(AUTHORITY_KEY)

    @belay.worker(name="other", registry=reg)
    def other(ctx: belay.Context) -> None:
        return None


def kids(sql_conn: Any, parent: int) -> list[dict[str, Any]]:
    cur = sql_conn.execute(
        "SELECT id, kind, queue, meta, budget_usd_micros, budget_tokens FROM belay_jobs "
        "WHERE parent_id = %s ORDER BY id", (parent,))
    cols = [c.name for c in cur.description]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def refusal(client: belay.Belay, job_id: int) -> str:
    job = client.get_job(job_id)
    assert job is not None and job.state == "failed" and job.attempt == 1, job
    assert job.errors[-1]["authority_exceeded"] is True
    return str(job.errors[-1]["error"])


# -- enqueue ---------------------------------------------------------------------------------


def test_an_authority_is_stored_sorted_and_its_caps_become_the_budget(client) -> None:
    job = client.enqueue("k", authority={"tools": ["search", "fetch"], "usd": 2},
                         meta={"customer": "acme"})
    assert job.meta == {"customer": "acme", AUTHORITY_KEY: {"tools": ["fetch", "search"],
                                                            "usd": 2.0}}
    assert (job.budget_usd, job.budget_tokens) == (2.0, None)
    assert authority_of(job.meta) == Authority(tools=frozenset({"fetch", "search"}),
                                               usd_micros=2_000_000)
    smaller = client.enqueue("k", authority={"usd": 2}, budget={"usd": 0.5})
    assert smaller.budget_usd == 0.5
    # A $authority already in meta is the same request.
    assert client.enqueue("k", meta={AUTHORITY_KEY: {"queues": ["a"]}}).meta == {
        AUTHORITY_KEY: {"queues": ["a"]}}
    assert client.enqueue("k").meta == {}  # nothing when none is asked


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"authority": {"tools": "search"}}, belay.ValidationError, "a list of names"),
    ({"authority": {"tools": [""]}}, belay.ValidationError, "non-empty string"),
    ({"authority": {"powers": ["x"]}}, belay.ValidationError, "unknown authority key"),
    ({"authority": {"usd": -1}}, belay.ValidationError, "a number of dollars from 0"),
    ({"authority": {"tokens": 1.5}}, belay.ValidationError, "a whole number of tokens"),
    ({"authority": ["search"]}, belay.ValidationError, "authority is a dict"),
    ({"authority": {"usd": 1}, "meta": {AUTHORITY_KEY: {}}}, belay.ValidationError,
     "give the authority once"),
    ({"authority": {"usd": 1}, "budget": {"usd": 1.5}}, belay.AuthorityExceeded,
     r"a budget of \$1.5 is more than the \$1 this job may hold"),
])
def test_a_bad_authority_is_refused_before_anything_is_written(client, sql_conn, options,
                                                               error, message) -> None:
    with pytest.raises(error, match=message):
        client.enqueue("k", **options)
    assert sql_conn.execute("SELECT count(*) FROM belay_jobs").fetchone()[0] == 0


# -- inheritance and narrowing ------------------------------------------------------------------


def test_children_inherit_the_authority_and_may_narrow_it(client, sql_conn) -> None:
    reg = belay.Registry()
    spawner(reg, lambda ctx: [
        ctx.spawn("same", "child"),
        ctx.spawn("narrow", "child", authority={"tools": ["search"], "usd": 0.5}),
    ])
    parent = client.enqueue("parent", authority=ROOT)
    assert drain(client, reg, queue=["default"]) == {"succeeded": 3}
    same, narrow = kids(sql_conn, parent.id)
    inherited = {"tools": ["fetch", "search"], "queues": ["agents", "default"],
                 "kinds": ["child"], "usd": 2.0, "tokens": 10_000}
    assert same["meta"] == {AUTHORITY_KEY: inherited}
    assert narrow["meta"] == {AUTHORITY_KEY: {**inherited, "tools": ["search"], "usd": 0.5}}
    # Each child's budget: its caps, within what the parent had left (all of it here).
    assert (same["budget_usd_micros"], same["budget_tokens"]) == (2_000_000, 10_000)
    assert (narrow["budget_usd_micros"], narrow["budget_tokens"]) == (500_000, 10_000)
    assert client.get_job(narrow["id"]).result == narrow["meta"][AUTHORITY_KEY]


@pytest.mark.parametrize(("asked", "message"), [
    ({"tools": ["search", "shell"]},
     "authority may only narrow: tools shell not allowed to job {id} "
     "(it may use fetch, search)"),
    ({"usd": 3}, "authority may only narrow: $3 is more than the $2 job {id} may hold"),
    ({"tokens": 10_001}, "10,001 tokens is more than the 10,000 tokens job {id} may hold"),
])
def test_a_widening_at_spawn_fails_the_parent_and_starts_nothing(client, sql_conn, asked,
                                                                 message) -> None:
    reg = belay.Registry()
    spawner(reg, lambda ctx: ctx.spawn("wide", "child", authority=asked))
    parent = client.enqueue("parent", authority=ROOT)
    assert drain(client, reg) == {"failed": 1}
    assert message.format(id=parent.id) in refusal(client, parent.id)
    assert kids(sql_conn, parent.id) == []


@pytest.mark.parametrize(("how", "message"), [
    (lambda ctx: ctx.spawn("q", "child", queue="batch"),
     "queue 'batch' is not allowed to job {id} (it may use agents, default)"),
    (lambda ctx: ctx.spawn("k", "other"),
     "worker 'other' is not allowed to job {id} (it may start child)"),
    (lambda ctx: ctx.spawn("b", "child", budget={"usd": 2.5}),
     "a child budget of $2.5 is more than the $2 job {id} has left"),
])
def test_a_spawn_outside_the_queues_workers_or_budget_is_refused(client, sql_conn, how,
                                                                  message) -> None:
    reg = belay.Registry()
    spawner(reg, how)
    parent = client.enqueue("parent", authority=ROOT)
    assert drain(client, reg) == {"failed": 1}
    assert message.format(id=parent.id) in refusal(client, parent.id)
    assert kids(sql_conn, parent.id) == []


def test_an_enqueue_from_inside_a_job_inherits_and_cannot_widen(client, sql_conn) -> None:
    reg = belay.Registry()
    seen: dict[str, Any] = {}

    def how(ctx: belay.Context) -> None:
        plain = ctx.client.enqueue("child", queue="agents")
        seen["plain"] = plain.meta
        try:  # a raw meta entry is no way around it
            ctx.client.enqueue("child", meta={AUTHORITY_KEY: {"tools": ["shell"]}})
        except belay.AuthorityExceeded as exc:
            seen["raw"] = str(exc)
        try:
            ctx.client.enqueue_many([{"kind": "child", "queue": "agents"},
                                     {"kind": "child", "queue": "elsewhere"}])
        except belay.AuthorityExceeded as exc:
            seen["batch"] = str(exc)

    spawner(reg, how)
    parent = client.enqueue("parent", authority=ROOT)
    assert drain(client, reg) == {"succeeded": 1}
    assert seen["plain"] == {AUTHORITY_KEY: {"tools": ["fetch", "search"],
                                             "queues": ["agents", "default"],
                                             "kinds": ["child"], "usd": 2.0, "tokens": 10_000}}
    assert "tools shell not allowed" in seen["raw"]
    assert f"queue 'elsewhere' is not allowed to job {parent.id}" in seen["batch"]
    # Only the one allowed enqueue was written; the batch was all-or-nothing.
    count = sql_conn.execute("SELECT count(*) FROM belay_jobs WHERE kind = 'child'").fetchone()
    assert count[0] == 1
    # A job without an authority starts jobs without one, as before.
    free = client.enqueue("parent")
    seen.clear()
    assert drain(client, reg) == {"succeeded": 2}  # it, and the child it put on default
    assert seen["plain"] == {} and "raw" not in seen and "batch" not in seen
    assert free.meta == {}


def test_authority_narrows_down_three_generations(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="lead", registry=reg, max_attempts=1)
    def lead(ctx: belay.Context) -> Any:
        depth = ctx.input["depth"]
        if depth == 3:
            return ctx.meta[AUTHORITY_KEY]
        asked = ctx.input.get("asked")
        options = {} if asked is None else {"authority": asked}
        child_input = {"depth": depth + 1, "asked": ctx.input.get("next")}
        [kid] = ctx.map_children("down", "lead", [child_input], **options)
        return kid.result if kid.state == "succeeded" else {"failed": kid.errors[-1]["error"]}

    root = client.enqueue("lead", {"depth": 1, "asked": {"tools": ["search"]},
                                   "next": {"tools": ["search", "fetch"]}},
                          authority={"tools": ["search", "fetch"], "kinds": ["lead"]})
    drain(client, reg)
    done = client.get_job(root.id)
    assert done is not None and done.state == "succeeded"
    # The grandchild asked for fetch back: its parent (narrowed to search) refused it.
    assert "tools fetch not allowed" in done.result["failed"]


def test_a_child_budget_never_exceeds_what_the_parent_has_left(client, sql_conn) -> None:
    reg = belay.Registry()

    def how(ctx: belay.Context) -> None:
        ctx.step("pay", lambda: None, cost=belay.Cost(usd=0.4, tokens=300))
        ctx.spawn("rest", "other")
        ctx.spawn("some", "other", budget={"usd": 0.25})
        ctx.spawn("too_much", "other", budget={"usd": 0.7})

    spawner(reg, how)
    parent = client.enqueue("parent", budget={"usd": 1, "tokens": 1000, "on_exceed": "pause"})
    assert drain(client, reg) == {"failed": 1, "succeeded": 2}
    rest, some = kids(sql_conn, parent.id)
    # Given none, a child gets what is left, under the parent's policy.
    assert (rest["budget_usd_micros"], rest["budget_tokens"]) == (600_000, 700)
    assert rest["meta"]["$budget"]["on_exceed"] == "pause"
    assert (some["budget_usd_micros"], some["budget_tokens"]) == (250_000, 700)
    assert ("a child budget of $0.7 is more than the $0.6 job "
            f"{parent.id} has left") in refusal(client, parent.id)


def test_a_job_without_a_budget_spawns_children_as_before(client, sql_conn) -> None:
    reg = belay.Registry()
    spawner(reg, lambda ctx: ctx.spawn("free", "other", budget={"usd": 100}))
    parent = client.enqueue("parent")
    assert drain(client, reg) == {"succeeded": 2}
    [kid] = kids(sql_conn, parent.id)
    assert kid["budget_usd_micros"] == 100_000_000 and kid["meta"] == {}


# -- top-ups, authorizers, tools ---------------------------------------------------------------


def test_a_top_up_past_the_authority_cap_is_refused(client) -> None:
    job = client.enqueue("k", authority={"usd": 2}, budget={"usd": 1})
    assert client.top_up(job.id, usd=1).budget_usd == 2.0
    with pytest.raises(belay.AuthorityExceeded, match=r"a budget of \$2.5 is more than the "
                                                      rf"\$2 job {job.id} may hold"):
        client.top_up(job.id, usd=0.5)
    assert client.get_job(job.id).budget_usd == 2.0  # type: ignore[union-attr]
    # The token cap is not bounded by this authority: topping it up is fine.
    tokens = client.enqueue("k", authority={"usd": 2}, budget={"tokens": 5})
    assert client.top_up(tokens.id, tokens=10).budget_tokens == 15


def test_an_authorizer_that_asks_for_it_gets_the_jobs_authority(client) -> None:
    seen: list[tuple[str, Any]] = []

    def authorize(tool: str, args: dict[str, Any], *, authority: Authority | None) -> Any:
        seen.append((tool, authority))
        if authority is not None and authority.usd_micros is not None:
            return "jobs with a spending authority are topped up by their owner"
        return None

    guard = ops.Guard(authorizer=authorize)
    capped = client.enqueue("k", authority={"usd": 2}, budget={"usd": 1})
    free = client.enqueue("k", budget={"usd": 1})
    with pytest.raises(ops.Refused, match="topped up by their owner"):
        ops.mutate(client, guard, "top_up", {"job_id": capped.id, "usd": 0.5})
    assert ops.mutate(client, guard, "top_up", {"job_id": free.id, "usd": 0.5})["job"][
        "budget_usd"] == 1.5
    assert ops.mutate(client, guard, "cancel_job", {"job_id": free.id})["job_id"] == free.id
    assert [(tool, a and a.to_meta()) for tool, a in seen] == [
        ("top_up", {"usd": 2.0}), ("top_up", None), ("cancel_job", None)]
    # A two-argument authorizer is called as before.
    plain: list[str] = []
    ops.mutate(client, ops.Guard(authorizer=lambda tool, args: plain.append(tool)),
               "retry_job", {"job_id": free.id})
    assert plain == ["retry_job"]


def test_check_tool_reads_the_running_jobs_authority(client) -> None:
    reg = belay.Registry()
    outcomes: list[str] = []

    def how(ctx: belay.Context) -> None:
        check_tool("search")
        outcomes.append("search")
        check_tool("shell")
        outcomes.append("shell")

    spawner(reg, how)
    check_tool("shell")  # outside a job, every tool is allowed
    limited = client.enqueue("parent", authority={"tools": ["search"]})
    client.enqueue("parent")
    assert drain(client, reg) == {"failed": 1, "succeeded": 1}
    assert outcomes == ["search", "search", "shell"]
    assert f"tool 'shell' is not allowed to job {limited.id}" in refusal(client, limited.id)


def test_an_unreadable_stored_authority_allows_nothing() -> None:
    closed = authority_of({AUTHORITY_KEY: {"tools": "not-a-list"}})
    assert closed is not None
    with pytest.raises(belay.AuthorityExceeded, match="may call none"):
        closed.check_tool("search", "job 1")
    with pytest.raises(belay.AuthorityExceeded):
        closed.check_job(queue="default", kind="k", usd_micros=None, tokens=None, whose="job 1")
