"""Cancel and retry (contract §8.6), with the §7 after-terminal effects they trigger:
workflow settlement (§8.3), ``$children`` to the parent (§8.4) and result notifications
(§9.2).

Jobs are put into ``running`` / ``held`` / ``failed`` … with plain SQL, as the Elixir
reference (or a worker not written yet) would leave them.
"""

from __future__ import annotations

import contextlib
import random
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import belay
from belay.settle import Member, settle
from tests.helpers import (
    START,
    Conn,
    advisory_waiters,
    awaiting_own_scope,
    insert_job,
    job_row,
    signal_rows,
    wait_until,
)

NON_TERMINAL_PARKED = ["ready", "awaiting", "held", "paused"]
TERMINAL = ["succeeded", "failed", "cancelled"]


# -- helpers -----------------------------------------------------------------------------


def member(conn: Conn, workflow_id: str, name: str, state: str, deps: list[str] | None = None,
           ignore: list[str] | None = None, **columns: Any) -> int:
    """A workflow member, as enqueue_workflow (or the reference) writes it."""
    return insert_job(conn, workflow_id=workflow_id, wf_name=name, state=state,
                      wf_deps=deps or [], wf_ignore=ignore or [], **columns)


def all_jobs(conn: Conn) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM belay_jobs ORDER BY id").fetchall()


def states(conn: Conn, ids: dict[str, int]) -> dict[str, str]:
    return {name: job_row(conn, job_id)["state"] for name, job_id in ids.items()}


def signal_triples(conn: Conn) -> list[tuple[str, str, Any]]:
    """(scope, name, payload) of every belay_signals row, by scope and name."""
    return [(r["scope"], r["name"], r["payload"]) for r in signal_rows(conn)]


def results(received: list[Any]) -> set[int]:
    return {p["id"] for p in received if p["t"] == "r"}


def pokes(received: list[Any]) -> list[str]:
    return sorted(p["q"] for p in received if p["t"] == "p")


# -- §8.6 cancel ----------------------------------------------------------------------------


@pytest.mark.parametrize("state", NON_TERMINAL_PARKED)
def test_cancel_of_a_parked_or_held_job_finishes_it_at_once(client, sql_conn, clock, state) -> None:
    previous = {"error": "boom", "attempt": 1}
    job = insert_job(sql_conn, state=state, attempt=1, errors=[previous],
                     lease_until=START + timedelta(seconds=30), leased_by="node-a",
                     await_scope="wf:x" if state in ("awaiting", "paused") else None,
                     await_name="go" if state in ("awaiting", "paused") else None)
    now = clock.advance(17)

    assert client.cancel_job(job) == "cancelled"

    row = job_row(sql_conn, job)
    assert row["state"] == "cancelled"
    assert row["finished_at"] == now
    assert row["errors"] == [previous, {"reason": "cancel"}]
    assert (row["lease_until"], row["leased_by"]) == (None, None)
    assert row["attempt"] == 1


def test_cancel_of_a_running_job_only_requests_it(client, sql_conn, clock) -> None:
    lease = START + timedelta(seconds=30)
    job = insert_job(sql_conn, state="running", attempt=2, lease_until=lease, leased_by="node-a")
    before = job_row(sql_conn, job)
    clock.advance(5)

    assert client.cancel_job(job) == "requested"
    assert client.cancel_job(job) == "requested"  # asking twice is harmless

    row = job_row(sql_conn, job)
    assert row["cancel_requested"] is True
    assert {k: v for k, v in row.items() if k != "cancel_requested"} == {
        k: v for k, v in before.items() if k != "cancel_requested"
    }


@pytest.mark.parametrize("state", TERMINAL)
def test_cancel_of_a_finished_job_is_a_noop(client, sql_conn, clock, state) -> None:
    job = insert_job(sql_conn, state=state, attempt=1, finished_at=START,
                     errors=[{"error": "x", "attempt": 1}])
    before = job_row(sql_conn, job)
    clock.advance(60)

    assert client.cancel_job(job) == "noop"

    assert job_row(sql_conn, job) == before


def test_cancel_of_an_unknown_job_raises_job_not_found(client, sql_conn) -> None:
    with pytest.raises(belay.JobNotFound) as caught:
        client.cancel_job(424242)
    assert caught.value.job_id == 424242
    assert "424242" in str(caught.value)


def test_a_cancelled_job_emits_its_result_notification(client, sql_conn, notes) -> None:
    job = insert_job(sql_conn, state="ready", queue="mail")
    client.cancel_job(job)
    assert notes.received() == [{"t": "r", "id": job}]


@pytest.mark.parametrize("state", ["running", "succeeded"])
def test_a_cancel_that_finishes_nothing_notifies_nothing(client, sql_conn, notes, state) -> None:
    job = insert_job(sql_conn, state=state, attempt=1)
    client.cancel_job(job)
    assert notes.received() == []


# -- §8.6 + §8.3: cancelling a workflow member settles the workflow -------------------------


def test_cancelling_a_held_member_dooms_and_releases_dependents_transitively(
    client, sql_conn, clock, notes
) -> None:
    wf = "flow-1"
    ids = {
        "x": member(sql_conn, wf, "x", "running", attempt=1),
        "a": member(sql_conn, wf, "a", "held", ["x"]),
        "b": member(sql_conn, wf, "b", "held", ["a"], queue="qb"),            # doomed
        "c": member(sql_conn, wf, "c", "held", ["a"], ["cancelled"], queue="qc"),  # released
        "d": member(sql_conn, wf, "d", "held", ["b"]),                        # doomed via b
        "e": member(sql_conn, wf, "e", "held", ["b"], ["cancelled"], queue="qe"),  # released via b
        "f": member(sql_conn, wf, "f", "held", ["c"]),                        # c not finished
        "g": member(sql_conn, wf, "g", "held", ["a", "x"], ["cancelled"]),    # x still running
        "h": member(sql_conn, wf, "h", "held", ["a"], ["failed"]),            # wrong flag: doomed
    }
    # Same member names in another workflow: settlement is per workflow.
    other = {
        "a": member(sql_conn, "flow-2", "a", "running", attempt=1),
        "b": member(sql_conn, "flow-2", "b", "held", ["a"]),
    }
    now = clock.advance(30)

    assert client.cancel_job(ids["a"]) == "cancelled"

    assert states(sql_conn, ids) == {
        "x": "running", "a": "cancelled", "b": "cancelled", "c": "ready", "d": "cancelled",
        "e": "ready", "f": "held", "g": "held", "h": "cancelled",
    }
    assert states(sql_conn, other) == {"a": "running", "b": "held"}
    for name in ("b", "d", "h"):
        assert job_row(sql_conn, ids[name])["finished_at"] == now
    for name in ("c", "e"):
        assert job_row(sql_conn, ids[name])["ready_at"] == now
    received = notes.received()
    assert pokes(received) == ["qc", "qe"]
    assert results(received) == {ids["a"], ids["b"], ids["d"], ids["h"]}
    # §11.5: settlement reached a fixpoint — settling again changes nothing.
    assert workflow_settles_to_nothing(sql_conn, wf)


def workflow_settles_to_nothing(conn: Conn, workflow_id: str) -> bool:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT id, wf_name, state, wf_deps, wf_ignore FROM belay_jobs WHERE workflow_id = %s",
            (workflow_id,),
        ).fetchall()
    members = [Member(r["id"], r["wf_name"], r["state"], r["wf_deps"], r["wf_ignore"])
               for r in rows]
    return settle(members) == ([], [])


def test_cancelling_a_member_nobody_depends_on_settles_nothing(client, sql_conn) -> None:
    wf = "flow-3"
    ids = {
        "a": member(sql_conn, wf, "a", "ready"),
        "b": member(sql_conn, wf, "b", "held", ["c"]),
        "c": member(sql_conn, wf, "c", "running", attempt=1),
    }
    assert client.cancel_job(ids["a"]) == "cancelled"
    assert states(sql_conn, ids) == {"a": "cancelled", "b": "held", "c": "running"}


def test_a_member_doomed_by_settlement_tells_its_parent(client, sql_conn, clock) -> None:
    """§7 step 2: each settlement-cancelled job with a parent_id sends $children."""
    parent = awaiting_own_scope(sql_conn, "$children", queue="parents")
    a = member(sql_conn, "flow-4", "a", "ready")
    b = member(sql_conn, "flow-4", "b", "held", ["a"], parent_id=parent)
    now = clock.advance(2)

    client.cancel_job(a)

    assert job_row(sql_conn, b)["state"] == "cancelled"
    assert signal_triples(sql_conn) == [(f"job:{parent}", "$children", {})]
    row = job_row(sql_conn, parent)
    assert (row["state"], row["ready_at"], row["await_name"]) == ("ready", now, None)


# -- §7 / §8.4: cancelling a child tells the parent ---------------------------------------------


def test_cancelling_a_child_wakes_a_parent_awaiting_its_children(
    client, sql_conn, clock, notes
) -> None:
    parent = awaiting_own_scope(sql_conn, "$children", queue="parents",
                                ready_at=START + timedelta(hours=1))
    child = insert_job(sql_conn, state="ready", parent_id=parent, queue="children")
    sibling = insert_job(sql_conn, state="running", attempt=1, parent_id=parent)
    now = clock.advance(9)

    assert client.cancel_job(child) == "cancelled"

    assert signal_triples(sql_conn) == [(f"job:{parent}", "$children", {})]
    row = job_row(sql_conn, parent)
    assert (row["state"], row["ready_at"], row["await_scope"]) == ("ready", now, None)
    assert job_row(sql_conn, sibling)["state"] == "running"  # never gated on siblings (R1)
    received = notes.received()
    assert pokes(received) == ["parents"]
    assert results(received) == {child}


def test_cancelling_a_child_signals_a_parent_that_is_not_awaiting_yet(client, sql_conn) -> None:
    """The signal persists, so a parent that parks later still finds it (§8.1)."""
    parent = insert_job(sql_conn, state="running", attempt=1)
    child = insert_job(sql_conn, state="held", parent_id=parent)

    client.cancel_job(child)

    assert signal_triples(sql_conn) == [(f"job:{parent}", "$children", {})]
    assert job_row(sql_conn, parent)["state"] == "running"


def test_a_parent_awaiting_something_else_is_not_woken(client, sql_conn) -> None:
    parent = awaiting_own_scope(sql_conn, "approval")
    child = insert_job(sql_conn, state="ready", parent_id=parent)

    client.cancel_job(child)

    assert job_row(sql_conn, parent)["state"] == "awaiting"


def test_a_requested_or_noop_cancel_does_not_signal_the_parent(client, sql_conn) -> None:
    parent = insert_job(sql_conn, state="running", attempt=1)
    running = insert_job(sql_conn, state="running", attempt=1, parent_id=parent)
    done = insert_job(sql_conn, state="succeeded", parent_id=parent)

    assert client.cancel_job(running) == "requested"
    assert client.cancel_job(done) == "noop"

    assert signal_triples(sql_conn) == []


# -- §8.6 retry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "max_attempts", "expected_max"),
    [
        (3, 3, 4),     # used them all: one more
        (5, 3, 6),     # over the limit (e.g. lowered by an operator): attempt + 1
        (20, 20, 21),
        (1, 20, 20),   # attempts left: unchanged
        (0, 5, 5),     # cancelled before it ever ran
    ],
)
@pytest.mark.parametrize("state", ["failed", "cancelled"])
def test_retry_makes_a_finished_job_ready_again(
    client, sql_conn, clock, state, attempt, max_attempts, expected_max
) -> None:
    errors = [{"error": "boom", "attempt": attempt}]
    job = insert_job(sql_conn, state=state, attempt=attempt, max_attempts=max_attempts,
                     errors=errors, cancel_requested=True, finished_at=START,
                     started_at=START, lease_until=START, leased_by="node-a",
                     ready_at=START - timedelta(days=1))
    now = clock.advance(3600)

    retried = client.retry_job(job)

    row = job_row(sql_conn, job)
    assert row["state"] == "ready"
    assert row["ready_at"] == now
    assert row["cancel_requested"] is False
    assert (row["lease_until"], row["leased_by"], row["finished_at"]) == (None, None, None)
    assert row["max_attempts"] == expected_max
    assert row["attempt"] == attempt
    assert isinstance(retried, belay.Job)
    assert (retried.id, retried.state, retried.max_attempts) == (job, "ready", expected_max)
    assert retried == client.get_job(job)


def test_retry_pokes_the_jobs_queue(client, sql_conn, notes) -> None:
    job = insert_job(sql_conn, state="failed", attempt=1, queue="reports")
    client.retry_job(job)
    assert notes.received() == [{"t": "p", "q": "reports"}]


@pytest.mark.parametrize("state", ["ready", "running", "awaiting", "held", "paused", "succeeded"])
def test_retry_of_a_job_that_is_not_failed_or_cancelled_is_refused(
    client, sql_conn, state
) -> None:
    job = insert_job(sql_conn, state=state, attempt=1)
    before = job_row(sql_conn, job)

    with pytest.raises(belay.NotRetryable, match=state) as caught:
        client.retry_job(job)

    assert (caught.value.job_id, caught.value.state) == (job, state)
    assert str(job) in str(caught.value)
    assert job_row(sql_conn, job) == before


def test_retry_of_an_unknown_job_raises_job_not_found(client) -> None:
    with pytest.raises(belay.JobNotFound):
        client.retry_job(31337)


# -- §8.6 retry of workflow members: re-hold, then settle ------------------------------------


def test_retried_member_whose_deps_succeeded_ends_ready(client, sql_conn, clock, notes) -> None:
    ids = {
        "a": member(sql_conn, "wf", "a", "succeeded"),
        "b": member(sql_conn, "wf", "b", "failed", ["a"], attempt=2, queue="qb"),
    }
    now = clock.advance(10)

    retried = client.retry_job(ids["b"])

    assert retried.state == "ready"
    row = job_row(sql_conn, ids["b"])
    assert (row["state"], row["ready_at"], row["finished_at"]) == ("ready", now, None)
    assert notes.received() == [{"t": "p", "q": "qb"}]


def test_retried_member_whose_dep_still_failed_is_doomed_again(
    client, sql_conn, clock, notes
) -> None:
    """§8.6 re-hold (found by model checking): never ready beside a failed dependency."""
    ids = {
        "a": member(sql_conn, "wf", "a", "failed", attempt=20),
        "b": member(sql_conn, "wf", "b", "cancelled", ["a"], cancel_requested=True,
                    finished_at=START),
        "c": member(sql_conn, "wf", "c", "cancelled", ["b"], finished_at=START),
    }
    now = clock.advance(10)

    retried = client.retry_job(ids["b"])

    assert retried.state == "cancelled"
    row = job_row(sql_conn, ids["b"])
    assert row["state"] == "cancelled"
    assert row["finished_at"] == now
    assert row["cancel_requested"] is False
    assert states(sql_conn, ids) == {"a": "failed", "b": "cancelled", "c": "cancelled"}
    assert notes.received() == [{"t": "r", "id": ids["b"]}]  # finished again: no poke


def test_retried_member_whose_failed_dep_is_ignored_ends_ready(client, sql_conn) -> None:
    ids = {
        "a": member(sql_conn, "wf", "a", "failed"),
        "b": member(sql_conn, "wf", "b", "cancelled", ["a"], ["failed"]),
    }
    assert client.retry_job(ids["b"]).state == "ready"


def test_retried_member_whose_dep_is_unfinished_waits_held(client, sql_conn) -> None:
    ids = {
        "a": member(sql_conn, "wf", "a", "running", attempt=1),
        "b": member(sql_conn, "wf", "b", "cancelled", ["a"]),
    }
    retried = client.retry_job(ids["b"])
    assert retried.state == "held"
    assert job_row(sql_conn, ids["b"])["state"] == "held"


def test_retried_member_without_deps_ends_ready(client, sql_conn) -> None:
    ids = {
        "a": member(sql_conn, "wf", "a", "failed"),
        "b": member(sql_conn, "wf", "b", "cancelled", ["a"]),
    }
    assert client.retry_job(ids["a"]).state == "ready"
    # The dependent cancelled earlier stays cancelled: settlement only moves held jobs.
    assert states(sql_conn, ids) == {"a": "ready", "b": "cancelled"}


def test_retry_then_cancel_then_retry_round_trips(client, sql_conn, clock) -> None:
    ids = {
        "a": member(sql_conn, "wf", "a", "succeeded"),
        "b": member(sql_conn, "wf", "b", "failed", ["a"]),
        "c": member(sql_conn, "wf", "c", "held", ["b"]),
    }
    assert client.retry_job(ids["b"]).state == "ready"
    assert client.cancel_job(ids["b"]) == "cancelled"
    assert states(sql_conn, ids) == {"a": "succeeded", "b": "cancelled", "c": "cancelled"}
    assert client.retry_job(ids["b"]).state == "ready"
    # c was doomed with b: a retry of b does not resurrect it.
    assert states(sql_conn, ids) == {"a": "succeeded", "b": "ready", "c": "cancelled"}
    assert client.retry_job(ids["c"]).state == "held"


# -- §7 lock order under concurrency -------------------------------------------------------------


def test_cancels_queued_on_the_workflow_lock_do_not_deadlock(client, db_url, sql_conn) -> None:
    """A deterministic interleaving of the race below.

    An unrelated cancel holds the workflow lock; then "cancel a" and "cancel b"
    queue behind it (in that order — Postgres grants lock waiters first come,
    first served). Cancelling a dooms b, whose row the second cancel must not be
    holding while it waits for the workflow lock.
    """
    a = member(sql_conn, "wf", "a", "ready")
    b = member(sql_conn, "wf", "b", "held", ["a"])
    c = member(sql_conn, "wf", "c", "ready")
    errors: list[BaseException] = []

    def cancel(job_id: int) -> None:
        try:
            client.cancel_job(job_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=cancel, args=(job_id,)) for job_id in (a, b)]
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            assert client.cancel_job(c, conn=conn) == "cancelled"  # holds the workflow lock
            threads[0].start()
            wait_until(lambda: advisory_waiters(sql_conn) == 1, "cancel(a) queues", timeout=10.0)
            threads[1].start()
            wait_until(lambda: advisory_waiters(sql_conn) == 2, "cancel(b) queues", timeout=10.0)
        for thread in threads:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]
    assert states(sql_conn, {"a": a, "b": b, "c": c}) == {
        "a": "cancelled", "b": "cancelled", "c": "cancelled",
    }


def test_concurrent_cancel_and_retry_of_workflow_members_never_deadlock(
    client, db_url, sql_conn
) -> None:
    """§7: workflow lock before signal-scope lock, row locks taken consistently.

    Eight threads cancel and retry members of one workflow whose dependencies
    cross, and whose members have a parent, so every settlement touches rows
    other threads are locking.
    """
    wf = "crossed"
    parent = insert_job(sql_conn, state="running", attempt=1)
    names = [f"m{i}" for i in range(8)]
    ids = [
        member(sql_conn, wf, name, "ready" if i < 2 else "held",
               names[max(0, i - 2):i],  # each depends on the two before it
               ["cancelled"] if i % 3 == 0 else [],
               parent_id=parent)
        for i, name in enumerate(names)
    ]
    rounds = 15
    barrier = threading.Barrier(len(ids), timeout=20)
    errors: list[BaseException] = []
    done = [0] * len(ids)

    def churn(index: int) -> None:
        rng = random.Random(index)
        job_id = ids[index]
        try:
            barrier.wait()
            for _ in range(rounds):
                client.cancel_job(ids[rng.randrange(len(ids))])
                with contextlib.suppress(belay.NotRetryable):
                    client.retry_job(job_id)
                done[index] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(len(ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    deadlocks = [e for e in errors if isinstance(e, psycopg.errors.DeadlockDetected)]
    assert not deadlocks, f"{len(deadlocks)} deadlock(s), first: {deadlocks[0]}"
    assert not errors, errors
    assert done == [rounds] * len(ids)
    assert workflow_settles_to_nothing(sql_conn, wf)


# -- on the caller's connection ------------------------------------------------------------------


def test_cancel_in_a_rolled_back_transaction_changes_nothing(
    client, db_url, sql_conn, notes
) -> None:
    parent = awaiting_own_scope(sql_conn, "$children")
    a = member(sql_conn, "wf", "a", "ready", parent_id=parent)
    b = member(sql_conn, "wf", "b", "held", ["a"])
    before = all_jobs(sql_conn)

    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        assert client.cancel_job(a, conn=conn) == "cancelled"
        assert job_row(conn, b)["state"] == "cancelled"  # seen inside the transaction only

    assert all_jobs(sql_conn) == before
    assert signal_triples(sql_conn) == []
    assert notes.received() == []


def test_cancel_in_a_committed_transaction_lands_on_commit(
    client, db_url, sql_conn, notes
) -> None:
    a = member(sql_conn, "wf", "a", "ready")
    b = member(sql_conn, "wf", "b", "held", ["a"])

    with psycopg.connect(db_url) as conn, conn.transaction():
        assert client.cancel_job(a, conn=conn) == "cancelled"
        assert notes.received() == []

    assert job_row(sql_conn, a)["state"] == "cancelled"
    assert job_row(sql_conn, b)["state"] == "cancelled"
    assert results(notes.received()) == {a, b}


def test_retry_in_a_rolled_back_transaction_changes_nothing(
    client, db_url, sql_conn, notes
) -> None:
    job = insert_job(sql_conn, state="failed", attempt=3, max_attempts=3, finished_at=START)
    before = job_row(sql_conn, job)

    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        assert client.retry_job(job, conn=conn).state == "ready"

    assert job_row(sql_conn, job) == before
    assert notes.received() == []


def test_retry_in_a_committed_transaction_lands_on_commit(client, db_url, sql_conn) -> None:
    job = insert_job(sql_conn, state="failed", attempt=3, max_attempts=3, finished_at=START)

    with psycopg.connect(db_url) as conn, conn.transaction():
        client.retry_job(job, conn=conn)
        assert job_row(sql_conn, job)["state"] == "failed"

    row = job_row(sql_conn, job)
    assert (row["state"], row["max_attempts"]) == ("ready", 4)


def test_a_running_threads_checkpoint_sees_a_cancel_request(
        client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    """A lease renewal reads ``cancel_requested``: a job that calls
    ``ctx.checkpoint()`` in its own loop (no steps) stops there, cancelled."""
    registry = belay.Registry()
    started, loops = threading.Event(), []

    @belay.worker(name="loop.checkpoint", registry=registry)
    def looping(ctx: belay.Context) -> str:
        started.set()
        while len(loops) < 10_000:
            loops.append(1)
            ctx.checkpoint()
            threading.Event().wait(0.01)
        return "ran to the end"

    job = client.enqueue("loop.checkpoint", {})
    with belay.Worker({"default": 1}, client=client, registry=registry, lease_ttl=0.6,
                      poll_interval=0.05, busy_poll=0.01):
        assert started.wait(10)
        assert client.cancel_job(job.id) == "requested"
        wait_until(lambda: job_row(sql_conn, job.id)["state"] == "cancelled",
                   "the checkpoint to stop the job", 10)
    assert job_row(sql_conn, job.id)["errors"][-1]["reason"] == "cancel_requested"
    assert len(loops) < 10_000
