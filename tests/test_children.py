"""Dynamic children (contract §8.4): doubly idempotent spawn, fan-in, races R1 and R2."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

import belay
from belay import store
from belay.testing import drain
from tests.helpers import job_row


@pytest.fixture
def registry() -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name="t.kid", queue="kids", registry=reg)
    def kid(ctx: belay.Context) -> Any:
        if ctx.input.get("fail"):
            raise belay.Cancel("kid gave up")
        return ctx.input["n"] * 10

    @belay.worker(name="t.parent", registry=reg)
    def parent(ctx: belay.Context) -> Any:
        kids = ctx.map_children("fan", "t.kid", ctx.input["inputs"])
        return [(k.state, k.result) for k in kids]

    return reg


def test_map_children_fans_out_and_in_in_input_order(client, registry, sql_conn):
    parent = client.enqueue("t.parent", {"inputs": [{"n": n} for n in range(5)]})
    assert drain(client=client, registry=registry) == {"await": 1}
    kids = client.list_jobs(parent_id=parent.id, limit=100)
    assert sorted(k.unique_key for k in kids) == sorted(
        f"$spawn:{parent.id}:fan:{i}" for i in range(5))
    assert {k.unique_mode for k in kids} == {"always"} and {k.queue for k in kids} == {"kids"}
    assert drain("kids", client=client, registry=registry) == {"succeeded": 5}
    # The last child's terminal write signalled the parent, which is ready again.
    assert job_row(sql_conn, parent.id)["state"] == "ready"
    assert drain(client=client, registry=registry) == {"succeeded": 1}
    assert client.get_job(parent.id).result == [["succeeded", n * 10] for n in range(5)]
    steps = {s.name: s.value for s in client.steps(parent.id)}
    assert steps["$spawn:fan"] == sorted(k.id for k in kids)


def test_failed_or_cancelled_children_still_complete_the_fan_in(client, registry):
    parent = client.enqueue("t.parent", {"inputs": [{"n": 1}, {"n": 2, "fail": True}]})
    drain(client=client, registry=registry)
    drain("kids", client=client, registry=registry)
    drain(client=client, registry=registry)
    assert client.get_job(parent.id).result == [["succeeded", 10], ["cancelled", None]]


def test_a_crash_between_insert_and_journal_yields_exactly_the_declared_children(
    client, registry, sql_conn
):
    """§8.4, §11.8: the spawn ran, the children exist, but the journal entry was lost."""
    parent = client.enqueue("t.parent", {"inputs": [{"n": n} for n in range(3)]})
    drain(client=client, registry=registry)
    sql_conn.execute("DELETE FROM belay_steps WHERE job_id = %s", (parent.id,))
    sql_conn.execute(
        "UPDATE belay_jobs SET state = 'ready', await_scope = NULL, await_name = NULL "
        "WHERE id = %s", (parent.id,))
    drain(client=client, registry=registry)  # spawns again: finds the same three
    kids = client.list_jobs(parent_id=parent.id, limit=100)
    assert len(kids) == 3
    drain("kids", client=client, registry=registry)
    drain(client=client, registry=registry)
    assert client.get_job(parent.id).result == [["succeeded", n * 10] for n in range(3)]


def test_two_last_children_finishing_together_wake_the_parent(db_url, registry, clock):
    """Race R1: never count-gate sibling completion; each terminal write signals."""
    for _ in range(10):
        with belay.Belay(db_url, registry=registry, clock=clock) as client:
            parent = client.enqueue("t.parent", {"inputs": [{"n": 1}, {"n": 2}]})
            drain(client=client, registry=registry)
            kids = client.list_jobs(parent_id=parent.id)
            with psycopg.connect(db_url, autocommit=True) as conn:
                for kid in kids:
                    conn.execute("UPDATE belay_jobs SET state = 'running', attempt = 1 "
                                 "WHERE id = %s", (kid.id,))
            barrier = threading.Barrier(len(kids))

            def finish(kid: belay.Job, barrier: threading.Barrier = barrier) -> None:
                with psycopg.connect(db_url) as conn, conn.transaction():
                    barrier.wait(5)
                    running = kid.replace(attempt=1)
                    assert store.ack(conn, running, "succeeded", clock.now(),
                                     result=b"1") is not None

            threads = [threading.Thread(target=finish, args=(k,)) for k in kids]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert client.get_job(parent.id).state == "ready"


def test_the_reconciler_repairs_a_lost_children_signal(client, registry, sql_conn):
    """Race R2: children all terminal, parent still awaiting (its wake-up was lost)."""
    parent = client.enqueue("t.parent", {"inputs": [{"n": 1}]})
    drain(client=client, registry=registry)
    sql_conn.execute(
        "UPDATE belay_jobs SET state = 'succeeded', result = '10' WHERE parent_id = %s",
        (parent.id,))
    assert job_row(sql_conn, parent.id)["state"] == "awaiting"
    worker = belay.Worker(["default"], client=client, registry=registry)
    assert worker.reconcile() == 1
    assert job_row(sql_conn, parent.id)["state"] == "ready"
    assert worker.reconcile() == 0
    drain(client=client, registry=registry)
    assert client.get_job(parent.id).result == [["succeeded", 10]]


def test_the_reconciler_leaves_parents_with_running_or_no_children(client, registry, sql_conn):
    parent = client.enqueue("t.parent", {"inputs": [{"n": 1}]})
    drain(client=client, registry=registry)
    lonely = client.enqueue("t.parent", {"inputs": []})
    sql_conn.execute(
        "UPDATE belay_jobs SET state = 'awaiting', await_scope = 'job:' || id, "
        "await_name = '$children' WHERE id = %s", (lonely.id,))
    assert belay.Worker(["default"], client=client, registry=registry).reconcile() == 0
    assert job_row(sql_conn, parent.id)["state"] == "awaiting"


def test_spawn_names_and_inputs_are_checked(client, registry):
    @belay.worker(name="t.bad_spawn", registry=registry)
    def bad(ctx: belay.Context) -> None:
        ctx.spawn("", "t.kid")

    job = client.enqueue("t.bad_spawn", max_attempts=1)
    assert drain(client=client, registry=registry) == {"failed": 1}
    assert "spawn name" in client.get_job(job.id).errors[-1]["error"]


# -- One budget across the tree (issue 12) ---------------------------------------------------


@pytest.mark.parametrize(("child_calls", "parent_state"), [(3, "succeeded"), (6, "failed")])
def test_shared_budgets_split_what_is_left_and_charge_the_children_back(
        client, sql_conn, child_calls, parent_state):
    reg = belay.Registry()
    paid: list[str] = []

    @belay.worker(name="b.child", queue="kids", registry=reg)
    def child(ctx: belay.Context) -> None:
        for n in range(ctx.input["calls"]):
            ctx.step(f"call-{n}", lambda n=n: paid.append(f"child-{ctx.id}-{n}"),
                     cost={"tokens": 100})

    @belay.worker(name="b.parent", registry=reg)
    def parent(ctx: belay.Context) -> Any:
        ctx.step("plan", lambda: paid.append("plan"), cost={"tokens": 100})
        kids = ctx.map_children("research", "b.child", [{"calls": child_calls}] * 2,
                                budget="share")
        ctx.step("write", lambda: paid.append("write"), cost={"tokens": 100})
        return [kid.state for kid in kids]

    job = client.enqueue("b.parent", budget={"tokens": 1_000, "usd": 1.0})
    drain(client=client, registry=reg)
    kids = [row for row in sql_conn.execute(
        "SELECT budget_tokens, budget_usd_micros, spent_tokens, state FROM belay_jobs "
        "WHERE parent_id = %s ORDER BY id", (job.id,))]
    # What the parent had left after its first step, split in two.
    assert [(k[0], k[1]) for k in kids] == [(450, 500_000)] * 2
    drain("kids", client=client, registry=reg)
    drain(client=client, registry=reg)
    done = client.get_job(job.id)
    assert done.state == parent_state
    if parent_state == "succeeded":
        # 100 (plan) + 2 x 300 charged back + 100 (write)
        assert done.result == ["succeeded", "succeeded"] and done.spent_tokens == 800
    else:
        # Each child crossed its 450 at its fifth call; 100 + 2 x 500 crossed the 1,000:
        # the parent failed at the charge, before paying for "write".
        assert [k[3] for k in kids] == ["ready", "ready"]
        assert [row[0] for row in sql_conn.execute(
            "SELECT state FROM belay_jobs WHERE parent_id = %s", (job.id,))] == ["failed"] * 2
        assert done.errors[-1]["error"] == "budget_exceeded"
        assert done.errors[-1]["step"] == "$spend:research"
        assert done.spent_tokens == 1_100 and "write" not in paid


def test_a_shared_budget_without_the_charge_back_is_refused(client):
    reg = belay.Registry()

    @belay.worker(name="b.spawner", registry=reg)
    def spawner(ctx: belay.Context) -> Any:
        return ctx.spawn_many("kids", "b.none", [{}], budget="share")

    job = client.enqueue("b.spawner", budget={"usd": 1.0})
    drain(client=client, registry=reg)
    error = client.get_job(job.id).errors[-1]["error"]
    assert "budget='share' is for map_children" in error
    assert client.list_jobs(parent_id=job.id) == []
