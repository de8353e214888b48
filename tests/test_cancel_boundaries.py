"""A cancel is honoured at every attempt boundary (issue 38, finding 3).

``cancel_job`` on a running job answers "requested" and sets the row's flag.
Whatever that attempt then ends with — a raise (retry), a snooze, a park on a
signal, a lapsed lease — the job ends ``cancelled`` there and never starts
another attempt; and a claimed row that carries the flag (left by another
implementation, say) is cancelled before its function runs, by every kind of
worker. The races are real threads against a real PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

import belay
from belay import store
from belay.http.workers import WorkerSessions, worker_routes
from belay.job import Job
from tests.helpers import insert_job, job_row, running_job, wait_until
from tests.test_steps import drain, no_backoff

TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.mark.parametrize("ends", ["raises", "snoozes", "parks"])
def test_a_cancel_requested_while_an_attempt_runs_starts_no_other_attempt(
        client, sql_conn, ends: str) -> None:
    reg = belay.Registry()
    runs: list[int] = []
    inside, go = threading.Event(), threading.Event()

    @belay.worker(name="side.effect", max_attempts=5, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            inside.set()
            assert go.wait(30)
            if ends == "raises":
                raise RuntimeError("a flaky dependency")
            if ends == "snoozes":
                raise belay.Snooze(0)
            ctx.await_signal("approval")
        return "the side effect, a second time"

    j = client.enqueue(job)
    with belay.Worker({"default": 2}, client=client, registry=reg, poll_interval=0.05,
                      busy_poll=0.01):
        assert inside.wait(30)
        assert client.cancel_job(j.id) == "requested"
        go.set()
        wait_until(lambda: job_row(sql_conn, j.id)["state"] in TERMINAL,
                   "the attempt to end", 30)
        # A claim that would take it again has had every chance to.
        assert drain(client, reg) == {}
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"], row["result"]) == ("cancelled", 1, None)
    assert row["errors"][-1] == {"reason": "cancel_requested", "attempt": 1}
    assert runs == [1]


def test_a_claimed_row_that_carries_a_cancel_request_is_cancelled_unrun(client,
                                                                       sql_conn) -> None:
    reg = belay.Registry()
    runs: list[int] = []

    @belay.worker(name="side.effect", registry=reg)
    def job(ctx: belay.Context) -> str:
        runs.append(ctx.id)
        return "ran"

    flagged = insert_job(sql_conn, kind="side.effect", cancel_requested=True, attempt=1)
    plain = insert_job(sql_conn, kind="side.effect")
    assert drain(client, reg) == {"cancelled": 1, "succeeded": 1}
    assert runs == [plain]
    row = job_row(sql_conn, flagged)
    assert (row["state"], row["attempt"]) == ("cancelled", 2)
    assert row["errors"][-1] == {"reason": "cancel_requested", "attempt": 2}


@pytest.fixture
def http_worker(client: belay.Belay) -> Iterator[TestClient]:
    sessions = WorkerSessions(client, session_ttl=60.0, lease_ttl=30.0)
    try:
        with TestClient(Starlette(routes=worker_routes(sessions))) as test_client:
            yield test_client
    finally:
        sessions.stop()


def test_an_http_worker_is_never_handed_a_row_that_carries_a_cancel_request(
        client, sql_conn, http_worker: TestClient) -> None:
    flagged = insert_job(sql_conn, kind="t", cancel_requested=True, attempt=1)
    token = http_worker.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    answer = http_worker.post("/queues/default/claim", json={"wait_ms": 0},
                              headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 204, answer.text
    row = job_row(sql_conn, flagged)
    assert (row["state"], row["errors"][-1]) == (
        "cancelled", {"reason": "cancel_requested", "attempt": 2})


def claimed(conn: Any) -> Job:
    job_id = running_job(conn)
    return Job(id=job_id, kind="test.kind", queue="default", state="running", attempt=1)


@pytest.mark.parametrize("boundary", ["retry", "snooze", "park"])
def test_a_cancel_racing_an_attempt_boundary_is_never_lost(client, db_url, sql_conn, clock,
                                                           boundary: str) -> None:
    """The operator's cancel and the attempt's end race from two threads; in
    every round the job ends cancelled, whichever commits first: a cancel
    that lands first is seen by the boundary, one that lands after finds the
    job parked (or ready) and cancels it itself."""
    client.get_job(1)  # open the client's pool outside the race
    outcomes: dict[str, int] = {}
    with psycopg.connect(db_url, prepare_threshold=None) as conn:
        for _ in range(30):
            job = claimed(sql_conn)
            barrier = threading.Barrier(2)
            said: dict[str, Any] = {}

            def end(job: Job, barrier: threading.Barrier, said: dict[str, Any]) -> None:
                barrier.wait(10)
                with conn.transaction():
                    if boundary == "park":
                        said["end"] = store.park_await(conn, job, f"job:{job.id}", "go", None,
                                                       clock.now())
                    else:
                        said["end"] = store.ack(conn, job, boundary, clock.now(), at=clock.now(),
                                                error={"error": "x", "attempt": 1})

            thread = threading.Thread(target=end, args=(job, barrier, said))
            thread.start()
            barrier.wait(10)
            said["cancel"] = client.cancel_job(job.id)
            thread.join(30)
            outcomes[said["cancel"]] = outcomes.get(said["cancel"], 0) + 1
            row = job_row(sql_conn, job.id)
            assert row["state"] == "cancelled", (said, row)
    assert set(outcomes) <= {"requested", "cancelled"}, outcomes
