"""Hand-backs counted on the row (belay.parts.handbacks, issue 38): a job whose
executor is lost while it runs goes back without using an attempt — until its
attempt has lost EXECUTOR_LOSSES executors, which fails that attempt. Real
PostgreSQL, real Unix-domain sockets, real executor processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay.clock import ManualClock
from belay.parts.execution import Execution
from belay.parts.handbacks import EXECUTOR_LOSSES
from belay.parts.records import Records
from belay.parts.sockets import ExecutorServer
from tests.helpers import Notifications, awaiting_own_scope, insert_job, job_row, wait_until
from tests.test_socket_executors import connected

#: A retry 50 ms after a failed attempt (the job's own backoff, as an HTTP
#: producer sets it), so a test on the wall clock needn't wait seconds for it.
QUICK_RETRY = {"$backoff": {"type": "exponential", "base_ms": 50, "max_ms": 50}}
#: Generous: a loaded 2-core CI machine starts processes slowly.
WAIT = 30.0


@pytest.fixture
def server(client: belay.Belay, clock: ManualClock, tmp_path: Path) -> Iterator[ExecutorServer]:
    # A lease renewal (every lease_ttl / 3) never comes within a test: a
    # renewal that saw a cancel request would cancel the job itself.
    with ExecutorServer(client, ["default"], path=tmp_path / "belay.sock",
                        lease_ttl=600.0) as instance:
        yield instance


def handed_back(sql_conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any]:
    """The job's row once its executor's loss is written (it leaves ``running``)."""
    seen: list[dict[str, Any]] = []
    wait_until(lambda: seen.append(job_row(sql_conn, job_id)) or
               seen[-1]["state"] != "running", f"job {job_id} handed back", WAIT)
    return seen[-1]


def lose_executor(server: ExecutorServer, *job_ids: int) -> str:
    """An executor takes ``job_ids`` (all at once) and disconnects; its node id."""
    with connected(server.path) as executor:
        executor.sock.settimeout(WAIT)
        hello = executor.reply_to(executor.send(
            "hello", mode="worker", runtime_id="lost", max_concurrency=len(job_ids)))
        executor.reply_to(executor.send("register_tasks", tasks=["sock.t"]))
        got = sorted(executor.next("execute")["job_id"] for _ in job_ids)
        assert got == sorted(job_ids)
        return str(hello["node_id"])


# -- A job that kills every executor it runs on -------------------------------------------


def test_a_job_that_kills_its_executor_every_time_fails_within_the_bound(
        real_client: belay.Belay, tmp_path: Path, sql_conn: psycopg.Connection[Any]) -> None:
    """Issue 38: an executor that dies (SIGKILL) every time it runs the job,
    restarted by a supervisor each time. On 845be33 the job went back for free
    forever (attempt 1, no error). Now each loss is an errors entry, the third
    of an attempt fails it, and with max_attempts=2 the job ends failed after
    EXECUTOR_LOSSES * 2 executors, never past its last attempt."""
    job = real_client.enqueue("sock.poison", max_attempts=2, meta=QUICK_RETRY)
    runs: list[tuple[int, str]] = []
    cap = 2 * EXECUTOR_LOSSES * 2  # where a supervisor of the old code gives up
    deadline = time.monotonic() + 180
    with ExecutorServer(real_client, ["default"], path=tmp_path / "belay.sock") as server:
        while job_row(sql_conn, job.id)["state"] != "failed" and len(runs) < cap:
            assert time.monotonic() < deadline, runs
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.poison_executor_proc", str(server.path),
                 "sock.poison"], stdout=subprocess.PIPE, text=True)
            # A bounded wait for its line: killed past it, its stdout closes.
            timer = threading.Timer(WAIT, proc.kill)
            timer.start()
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert proc.wait(WAIT) == -signal.SIGKILL
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
            assert line, f"executor {len(runs) + 1} got no job within {WAIT:g}s"
            job_id, attempt, node = line.split()
            assert int(job_id) == job.id
            runs.append((int(attempt), node))
            handed_back(sql_conn, job.id)
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"]) == ("failed", 2), (row, runs)
    assert [a for a, _ in runs] == [1] * EXECUTOR_LOSSES + [2] * EXECUTOR_LOSSES
    nodes = [n for _, n in runs]
    assert len(set(nodes)) == len(nodes)
    errors = row["errors"]
    assert [(e["error"], e["attempt"], e["executor"]) for e in errors] == \
        [("executor_lost", a, n) for a, n in runs]
    # Why, as the server saw it: it closed, its socket was reset, or the reply
    # to its "started" could not be sent: whichever came first.
    assert all(isinstance(e["reason"], str) and e["reason"] and "at" in e
               for e in errors), errors
    # The loss that failed each attempt names them all, and how many.
    first, last = errors[EXECUTOR_LOSSES - 1], errors[-1]
    assert (first["lost"], first["executors"]) == (EXECUTOR_LOSSES, nodes[:EXECUTOR_LOSSES])
    assert (last["lost"], last["executors"]) == (EXECUTOR_LOSSES, nodes[EXECUTOR_LOSSES:])
    assert f"attempt 2 lost its executor {EXECUTOR_LOSSES} times" in last["message"]
    assert ", ".join(nodes[EXECUTOR_LOSSES:]) in last["message"]
    assert not any("lost" in e for e in errors[:EXECUTOR_LOSSES - 1])
    with pytest.raises(belay.JobFailed):
        real_client.await_result(job.id, timeout=1)


# -- Below the bound, nothing changes ---------------------------------------------------------


def test_one_lost_executor_costs_no_attempt_and_is_recorded(
        client: belay.Belay, server: ExecutorServer, sql_conn: psycopg.Connection[Any]) -> None:
    """An executor restarted once (a deploy): the job runs again as attempt 1 on
    a healthy one and succeeds; the loss is on the row, naming the executor."""
    job = client.enqueue("sock.t", {"n": 21}, max_attempts=1)
    node = lose_executor(server, job.id)
    row = handed_back(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["leased_by"]) == ("ready", 0, None)
    with connected(server.path) as healthy:
        healthy.hello()
        event = healthy.next("execute")
        assert (event["job_id"], event["attempt"]) == (job.id, 1)
        done = healthy.reply_to(healthy.send(
            "succeeded", result=event["args"]["n"] * 2, execution_id=event["execution_id"],
            reservation_id=event["reservation_id"]))
        assert done["state"] == "succeeded"
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"]) == ("succeeded", 1)
    assert [{k: v for k, v in e.items() if k != "at"} for e in row["errors"]] == \
        [{"error": "executor_lost", "attempt": 1, "executor": node, "reason": "it closed"}]
    assert all(e["at"].startswith("2026-03-01T12:00:00") for e in row["errors"])
    assert client.get_job(job.id).result == 42


def test_the_count_is_per_attempt(
        client: belay.Belay, clock: ManualClock, server: ExecutorServer,
        sql_conn: psycopg.Connection[Any]) -> None:
    """Losses of an attempt that then failed on its own don't count against the
    next one: each attempt may lose EXECUTOR_LOSSES - 1 executors for free."""
    job = client.enqueue("sock.t", max_attempts=2, meta=QUICK_RETRY)
    for _ in range(EXECUTOR_LOSSES - 1):
        lose_executor(server, job.id)
        assert handed_back(sql_conn, job.id)["attempt"] == 0
    with connected(server.path) as executor:
        executor.hello()
        event = executor.next("execute")
        failed = executor.reply_to(executor.send(
            "failed", error={"message": "flaky"}, execution_id=event["execution_id"],
            reservation_id=event["reservation_id"]))
        assert (failed["state"], failed["attempt"]) == ("ready", 1)
    clock.advance(1)  # past its 50 ms backoff
    for _ in range(EXECUTOR_LOSSES - 1):
        lose_executor(server, job.id)
        row = handed_back(sql_conn, job.id)
        assert (row["state"], row["attempt"]) == ("ready", 1)
    assert [e["attempt"] for e in row["errors"] if e["error"] == "executor_lost"] == \
        [1] * (EXECUTOR_LOSSES - 1) + [2] * (EXECUTOR_LOSSES - 1)


def test_the_worker_stopping_gives_its_jobs_back_uncounted(
        client: belay.Belay, clock: ManualClock, tmp_path: Path,
        sql_conn: psycopg.Connection[Any]) -> None:
    """The server's own stop is not the job's doing: its jobs go back with
    nothing recorded (a guard: this held on 845be33 too)."""
    job = client.enqueue("sock.t")
    server = ExecutorServer(client, ["default"], path=tmp_path / "belay.sock")
    server.start()
    try:
        with connected(server.path) as executor:
            executor.hello()
            assert executor.next("execute")["job_id"] == job.id
            server.stop()
    finally:
        server.stop()
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])


# -- At the bound: a terminal outcome, settled like any ack -----------------------------------


def test_the_loss_at_the_bound_fails_the_job_and_settles_its_workflow_and_parent(
        client: belay.Belay, server: ExecutorServer, sql_conn: psycopg.Connection[Any],
        notes: Notifications) -> None:
    """With max_attempts=1, the third loss fails the job: its workflow's
    dependent is doomed, its parent is told ``$children`` (woken), and the
    results are announced — what every terminal ack does."""
    flow = client.enqueue_workflow(belay.Workflow("hb")
                                   .add("first", "sock.t", max_attempts=1)
                                   .add("then", "sock.t", deps=["first"]))
    member = flow["first"]
    parent = awaiting_own_scope(sql_conn, "$children", kind="hb.parent")
    child = insert_job(sql_conn, kind="sock.t", parent_id=parent, max_attempts=1)
    for n in range(1, EXECUTOR_LOSSES + 1):
        lose_executor(server, member.id, child)
        for job_id in (member.id, child):
            row = handed_back(sql_conn, job_id)
            expected = ("ready", 0) if n < EXECUTOR_LOSSES else ("failed", 1)
            assert (row["state"], row["attempt"]) == expected, row
    assert job_row(sql_conn, flow["then"].id)["state"] == "cancelled"
    assert job_row(sql_conn, parent)["state"] == "ready"
    received = notes.received()
    for job_id in (member.id, child, flow["then"].id):
        assert {"t": "r", "id": job_id} in received, received
    with pytest.raises(belay.JobFailed):
        client.await_result(member.id, timeout=1)


def test_a_cancel_requested_while_it_ran_ends_it_cancelled(
        client: belay.Belay, server: ExecutorServer, sql_conn: psycopg.Connection[Any]) -> None:
    """An operator asked to cancel while the executor ran it, and the executor
    was lost before a renewal saw the request: cancelled, not put back."""
    job = client.enqueue("sock.t")
    with connected(server.path) as executor:
        executor.hello()
        assert executor.next("execute")["job_id"] == job.id
        assert client.cancel_job(job.id) == "requested"
    row = handed_back(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["finished_at"] is not None) == \
        ("cancelled", 1, True)
    lost, cancelled = row["errors"]
    assert (lost["error"], lost["attempt"]) == ("executor_lost", 1)
    assert cancelled == {"reason": "cancel_requested", "attempt": 1}


# -- Two servers, one row -------------------------------------------------------------------


def test_two_servers_handing_back_one_row_count_it_once(
        client: belay.Belay, clock: ManualClock, db_url: str, direct_url: str,
        sql_conn: psycopg.Connection[Any]) -> None:
    """Both servers' hand-backs of one attempt are in flight at once (held on
    the row lock until both wait): one writes, the other is fenced out, and
    the count goes up by exactly one each round — the snoozes, the failed
    first attempt, then the failed job."""
    job_id = insert_job(sql_conn, kind="sock.t", max_attempts=2, meta=QUICK_RETRY)
    expected = [("ready", 0), ("ready", 0), ("ready", 1),
                ("ready", 1), ("ready", 1), ("failed", 2)]
    assert len(expected) == 2 * EXECUTOR_LOSSES
    with belay.Belay(db_url, clock=clock, notify=False) as other:
        servers = [Records(client, None), Records(other, None)]
        for state, attempt in expected:
            sql_conn.execute("UPDATE belay_jobs SET state = 'running', attempt = attempt + 1, "
                             "leased_by = 'node-a' WHERE id = %s", (job_id,))
            job = client.get_job(job_id)
            written = [0, 0]
            with psycopg.connect(direct_url) as locker:
                locker.execute("SELECT 1 FROM belay_jobs WHERE id = %s FOR UPDATE", (job_id,))
                threads = [threading.Thread(target=hand_back, args=(servers[n], job, written, n))
                           for n in (0, 1)]
                for thread in threads:
                    thread.start()
                wait_until(lambda: row_lock_waiters(sql_conn) == 2, "both hand-backs waiting",
                           WAIT)
                locker.commit()
                for thread in threads:
                    thread.join(WAIT)
            assert sorted(written) == [0, 1]
            row = job_row(sql_conn, job_id)
            assert (row["state"], row["attempt"]) == (state, attempt), row
    assert [e["attempt"] for e in row["errors"]] == [1] * 3 + [2] * 3
    assert [e.get("lost") for e in row["errors"]] == [None, None, 3, None, None, 3]


@pytest.mark.parametrize("foreign", [
    [{"error": "executor_lost", "attempt": "1"}, "x", 7, {"attempt": 1}, None],
    {"not": "a list"},
])
def test_entries_of_another_shape_are_not_counted_and_break_nothing(
        client: belay.Belay, sql_conn: psycopg.Connection[Any], foreign: Any) -> None:
    """The errors column is shared with other implementations: entries belay
    didn't write (an attempt as a string, no executor, not an object — or no
    array at all) are skipped by the count instead of failing the hand-back,
    which would leave the job to lease expiry."""
    job_id = insert_job(sql_conn, kind="sock.t", state="running", attempt=1,
                        leased_by="node-a", errors=foreign)
    records = Records(client, None)
    for losses in range(1, EXECUTOR_LOSSES + 1):
        job = client.get_job(job_id)
        assert records.hand_back(Execution(job, None, None), "node-a", "gone") == 1
        row = job_row(sql_conn, job_id)
        if losses < EXECUTOR_LOSSES:
            assert (row["state"], row["attempt"]) == ("ready", 0), row
            sql_conn.execute("UPDATE belay_jobs SET state = 'running', attempt = 1, "
                             "leased_by = 'node-a' WHERE id = %s", (job_id,))
    assert (row["state"], row["attempt"]) == ("ready", 1), row
    assert row["errors"][-1]["lost"] == EXECUTOR_LOSSES
    assert row["errors"][-1]["executors"] == ["node-a"] * EXECUTOR_LOSSES


def hand_back(records: Records, job: belay.Job, written: list[int], n: int) -> None:
    """Server ``n``'s hand-back of ``job``, leased to node-a; 1 in ``written[n]`` if it wrote."""
    written[n] = records.hand_back(Execution(job, None, None, node="node-a"), "node-a",
                                   f"server {n}")


def row_lock_waiters(conn: psycopg.Connection[Any]) -> int:
    """Backends of this database waiting for a lock (here: the row's)."""
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND wait_event_type = 'Lock'").fetchone()
    assert row is not None
    return int(row[0])
