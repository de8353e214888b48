"""HTTP workers (issue 11): sessions, claims, fenced completions, leases — on a real database."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

import belay
from belay import store
from belay.clock import ManualClock
from belay.errors import JobFailed
from belay.http.workers import (
    WORKER_OPENAPI_PATHS,
    InvalidRequest,
    StaleExecution,
    Unauthorized,
    WorkerSessions,
    parse_registration,
    worker_routes,
)
from tests.helpers import START, job_row, refuse_updates_of, running_job
from tests.strategies import deep


class Ticker:
    """A monotonic clock the test moves (session expiry without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ticker() -> Ticker:
    return Ticker()


@pytest.fixture
def sessions(client: belay.Belay, ticker: Ticker) -> Iterator[WorkerSessions]:
    s = WorkerSessions(client, session_ttl=60.0, lease_ttl=30.0, clock=ticker)
    yield s
    s.stop()


@pytest.fixture
def http(sessions: WorkerSessions) -> Iterator[TestClient]:
    with TestClient(Starlette(routes=worker_routes(sessions))) as test_client:
        yield test_client


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- Registration and tokens ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"runtime_id": "", "tasks": ["a"]},
    {"runtime_id": "r", "tasks": []},
    {"runtime_id": "r", "tasks": "a"},
    {"runtime_id": "r", "tasks": ["a"], "capacity": 0},
    {"runtime_id": "r", "tasks": ["a"], "capacity": 257},
    {"runtime_id": "r", "tasks": ["a"], "capacity": True},
    {"runtime_id": "r", "tasks": ["a"], "queue": ""},
    {"runtime_id": "r", "tasks": ["a"], "colour": "red"},
])
def test_register_validates(sessions: WorkerSessions, http: TestClient,
                            bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        parse_registration(bad)
    answer = http.post("/workers", json=bad)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_request"
    assert sessions.sessions() == 0


def post_raw(http: TestClient, path: str, body: Any, token: str | None = None) -> Any:
    """``body`` as JSON text with lone surrogates as ``\\ud800`` escapes and NaN as
    a bare literal, as a careless client writes them (httpx's ``json=`` refuses both)."""
    return http.post(path, content=body if isinstance(body, bytes) else json.dumps(body),
                     headers={"content-type": "application/json",
                              **(auth(token) if token else {})})


@pytest.mark.parametrize(("body", "words"), [
    ({"runtime_id": "\ud800", "tasks": ["a"]}, "runtime_id contains a lone surrogate"),
    ({"runtime_id": "r\x00", "tasks": ["a"]}, "runtime_id contains a NUL"),
    ({"runtime_id": "é" * 128, "tasks": ["a"]}, "runtime_id is 256 bytes long"),
    ({"runtime_id": "r", "tasks": ["a", "b\x00"]}, "tasks[1] contains a NUL"),
    ({"runtime_id": "r", "tasks": ["\udfff"]}, "tasks[0] contains a lone surrogate"),
    ({"runtime_id": "r", "tasks": ["a"], "queue": "q\ud800"}, "queue contains a lone surrogate"),
    ({"runtime_id": "r", "tasks": ["a"], "queue": "\x00"}, "queue contains a NUL"),
    ({"runtime_id": "r", "tasks": ["a"], "capacity": float("nan")}, "NaN is not JSON"),
])
def test_register_refuses_text_postgresql_cannot_hold(
        sessions: WorkerSessions, http: TestClient, body: Any, words: str) -> None:
    """No session is left behind (a surrogate once made the reply fail after the
    session was made), and no NUL kind reaches the claim query."""
    answer = post_raw(http, "/workers", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"
    assert words in answer.json()["error"]["message"]
    assert sessions.sessions() == 0


def test_register_returns_a_secret_token(http: TestClient, sessions: WorkerSessions,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    answer = http.post("/workers", json={"runtime_id": "node-1", "tasks": ["a"], "capacity": 2})
    assert answer.status_code == 201
    body = answer.json()
    token = body["worker_token"]
    assert len(token) >= 40 and body["session_ttl_s"] == 60.0
    assert token not in caplog.text
    assert token not in repr(sessions._table.sessions)  # kept under its hash only
    assert [t.name for t in threading.enumerate()].count("belay-http-heartbeat") == 1


def test_tokens_are_required(http: TestClient, client: belay.Belay) -> None:
    client.enqueue("a", {})
    for path in ("/queues/default/claim", "/workers/started", "/workers/complete"):
        for headers in ({}, auth("not-a-token"), {"Authorization": "Basic abc"}):
            answer = http.post(path, headers=headers, json={"execution_id": "1.1.x",
                                                            "outcome": "success"})
            assert answer.status_code == 401, (path, headers)
            assert answer.json()["error"]["code"] == "unauthorized"
    assert http.delete("/workers", headers=auth("nope")).status_code == 401
    assert client.stats()["default"].get("running", 0) == 0


# -- Claims ---------------------------------------------------------------------------------


def test_with_a_server_token_registering_needs_it(sessions: WorkerSessions) -> None:
    """Else anyone reaching the port could register and take jobs."""
    app = Starlette(routes=worker_routes(sessions, token="server-secret"))
    body = {"runtime_id": "r", "tasks": ["t"]}
    with TestClient(app) as http:
        for headers in ({}, auth("wrong"), {"Authorization": "Basic server-secret"}):
            refused = http.post("/workers", json=body, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "unauthorized"
        assert sessions.sessions() == 0
        registered = http.post("/workers", json=body, headers=auth("server-secret"))
        assert registered.status_code == 201 and registered.json()["worker_token"]
        assert sessions.sessions() == 1


def test_claim_takes_only_the_sessions_tasks(sessions: WorkerSessions, client: belay.Belay,
                                            sql_conn: psycopg.Connection[Any]) -> None:
    foreign = [client.enqueue("python.only", {"n": i}).id for i in range(3)]
    mine = client.enqueue("http.task", {"x": 1}).id
    token = sessions.register("r1", ["http.task"], 5)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    assert (event["type"], event["job_id"], event["task"], event["args"], event["attempt"]) == (
        "execute", mine, "http.task", {"x": 1}, 1)
    row = job_row(sql_conn, mine)
    assert row["state"] == "running" and row["leased_by"].startswith("http:r1/")
    for job_id in foreign:  # never claimed: the claim filters by kind
        other = job_row(sql_conn, job_id)
        assert (other["state"], other["attempt"], other["leased_by"], other["started_at"]) == (
            "ready", 0, None, None)
    assert sessions.claim(token, "default", 0) is None


def test_claim_honours_capacity(sessions: WorkerSessions, client: belay.Belay) -> None:
    for i in range(3):
        client.enqueue("t", {"i": i})
    token = sessions.register("r", ["t"], 2)
    first, second = sessions.claim(token, "default", 0), sessions.claim(token, "default", 0)
    assert first is not None and second is not None
    assert sessions.claim(token, "default", 0) is None  # full: the third waits
    sessions.complete(token, first["execution_id"], "success", result=1)
    third = sessions.claim(token, "default", 0)
    assert third is not None and third["job_id"] not in (first["job_id"], second["job_id"])


def found_nothing(sessions: WorkerSessions, monkeypatch: pytest.MonkeyPatch
                  ) -> threading.Event:
    """An event set once a claim looked for work and found none (it waits now)."""
    polled_empty = threading.Event()
    claim_once = sessions._claim_once

    def spy(session: Any) -> dict[str, Any] | None:
        event = claim_once(session)
        if event is None:
            polled_empty.set()
        return event

    monkeypatch.setattr(sessions, "_claim_once", spy)
    return polled_empty


def test_a_session_waiting_in_a_claim_longer_than_its_ttl_stays_alive(
        sessions: WorkerSessions, client: belay.Belay, ticker: Ticker,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-poll longer than session_ttl must not expire its own session."""
    token = sessions.register("r", ["t"], 1)
    polled_empty = found_nothing(sessions, monkeypatch)
    got: list[dict[str, Any] | None] = []
    waiter = threading.Thread(target=lambda: got.append(sessions.claim(token, "default", 15)),
                              name="test-claim")
    waiter.start()
    assert polled_empty.wait(10)
    ticker.now += 120  # twice the ttl passes while the claim waits
    sessions.tick()
    assert sessions.sessions() == 1
    job = client.enqueue("t", {})
    waiter.join(15)
    assert got and got[0] is not None and got[0]["job_id"] == job.id
    ticker.now += 61  # and once it stops claiming, the ttl applies again
    sessions.tick()
    assert sessions.sessions() == 0


def test_claim_from_another_queue_is_refused(sessions: WorkerSessions) -> None:
    token = sessions.register("r", ["t"], 1, "emails")
    with pytest.raises(InvalidRequest, match="emails"):
        sessions.claim(token, "default", 0)


def test_long_poll_returns_a_job_enqueued_during_the_wait(
        http: TestClient, sessions: WorkerSessions, client: belay.Belay,
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    polled_empty = found_nothing(sessions, monkeypatch)
    enqueued: list[int] = []

    def produce() -> None:
        assert polled_empty.wait(5)  # the claim found nothing and is waiting now
        enqueued.append(client.enqueue("t", {"late": True}).id)

    thread = threading.Thread(target=produce, name="test-producer")
    thread.start()
    started = time.monotonic()
    answer = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 10_000})
    took = time.monotonic() - started
    thread.join()
    assert answer.status_code == 200
    assert answer.json()["job_id"] == enqueued[0]
    assert took < 5  # well inside the 10 s wait


def test_long_poll_times_out_with_204(http: TestClient) -> None:
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    started = time.monotonic()
    answer = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 300})
    assert answer.status_code == 204
    assert time.monotonic() - started >= 0.3
    bad = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 20_001})
    assert bad.status_code == 400 and "wait_ms" in bad.json()["error"]["message"]


# -- Completions ----------------------------------------------------------------------------


def test_success_stores_the_result(http: TestClient, client: belay.Belay) -> None:
    job = client.enqueue("t", {"n": 2})
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    event = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 0}).json()
    started = http.post("/workers/started", headers=auth(token),
                        json={"execution_id": event["execution_id"]})
    assert started.status_code == 200
    done = http.post("/workers/complete", headers=auth(token), json={
        "execution_id": event["execution_id"], "outcome": "success", "result": {"sum": 4}})
    assert done.status_code == 200 and done.json()["state"] == "succeeded"
    assert client.await_result(job.id, timeout=5) == {"sum": 4}
    again = http.post("/workers/complete", headers=auth(token), json={
        "execution_id": event["execution_id"], "outcome": "success", "result": {"sum": 5}})
    assert again.status_code == 409 and again.json()["error"]["code"] == "stale_execution"
    assert client.await_result(job.id, timeout=5) == {"sum": 4}


def test_failure_retries_then_fails(sessions: WorkerSessions, client: belay.Belay,
                                   clock: ManualClock) -> None:
    job = client.enqueue("t", {}, max_attempts=2)
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    done = sessions.complete(token, event["execution_id"], "failure",
                             error={"message": "card declined", "type": "PaymentError"})
    assert done["state"] == "ready"
    clock.advance(600)  # past the backoff
    event = sessions.claim(token, "default", 0)
    assert event is not None and event["attempt"] == 2
    done = sessions.complete(token, event["execution_id"], "failure",
                             error={"message": "still declined", "traceback": "at line 3"})
    assert done["state"] == "failed"
    with pytest.raises(JobFailed):
        client.await_result(job.id, timeout=5)
    errors = client.get_job(job.id).errors  # type: ignore[union-attr]
    assert [e["error"] for e in errors] == ["PaymentError: card declined", "still declined"]
    assert [e["attempt"] for e in errors] == [1, 2] and errors[1]["traceback"] == "at line 3"


def test_a_failure_retries_after_the_jobs_own_backoff(
        sessions: WorkerSessions, client: belay.Belay, clock: ManualClock,
        sql_conn: psycopg.Connection[Any]) -> None:
    """The ``backoff`` option of an HTTP producer ($backoff in meta): base_ms
    doubled per attempt, capped at max_ms; without it, belay's default."""
    spec = {"type": "exponential", "base_ms": 1500, "max_ms": 2000}
    job = client.enqueue("t", {}, max_attempts=5, meta={"$backoff": spec})
    token = sessions.register("r", ["t"], 1)
    for attempt, delay in ((1, 1.5), (2, 2.0)):
        event = sessions.claim(token, "default", 0)
        assert event is not None and event["attempt"] == attempt
        sessions.complete(token, event["execution_id"], "failure", error={"message": "no"})
        assert job_row(sql_conn, job.id)["ready_at"] == clock.now() + timedelta(seconds=delay)
        clock.advance(delay)


def test_bad_completions_are_refused_and_write_nothing(
        http: TestClient, client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    job = client.enqueue("t", {})
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    event = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 0}).json()
    other = http.post("/workers", json={"runtime_id": "r2", "tasks": ["t"]}).json()[
        "worker_token"]
    for body, status in [
        ({"execution_id": event["execution_id"], "outcome": "maybe"}, 400),
        ({"execution_id": event["execution_id"], "outcome": "failure"}, 400),
        ({"execution_id": event["execution_id"], "outcome": "failure",
          "error": {"message": "x" * 20_000}}, 400),
        ({"execution_id": "999.1.zzz", "outcome": "success"}, 409),
    ]:
        answer = http.post("/workers/complete", headers=auth(token), json=body)
        assert answer.status_code == status, body
    wrong_session = http.post("/workers/complete", headers=auth(other), json={
        "execution_id": event["execution_id"], "outcome": "success", "result": 1})
    assert wrong_session.status_code == 409
    assert http.post("/workers/complete", content=b"{not json", headers={
        "content-type": "application/json", **auth(token)}).status_code == 400
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["result"], row["errors"]) == ("running", None, [])


@pytest.mark.parametrize(("body", "words"), [
    ({"outcome": "failure", "error": {"message": "m", "details": {"k": "a\x00"}}},
     "error.details.k contains a NUL"),
    ({"outcome": "failure", "error": {"message": "m", "details": ["\ud800"]}},
     "error.details[0] contains a lone surrogate"),
    ({"outcome": "failure", "error": {"message": "m", "details": {"\x00": 1}}},
     "a key in error.details contains a NUL"),
    ({"outcome": "failure", "error": {"message": "m", "details": {"n": float("nan")}}},
     "NaN is not JSON"),
    ({"outcome": "failure", "error": {"message": "m", "details": deep(300)}},
     "error.details nests deeper than 200 levels"),
    ({"outcome": "success", "result": {"n": float("-inf")}}, "-Infinity is not JSON"),
    ({"outcome": "success", "result": "\udc80"}, "result contains a lone surrogate"),
    ({"outcome": "success", "result": {"k": deep(300)}}, "result nests deeper than 200"),
    (b'{"outcome": "success", "result": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "nests deeper than belay parses"),
])
def test_unstorable_completions_are_refused_and_write_nothing(
        http: TestClient, client: belay.Belay, sql_conn: psycopg.Connection[Any], body: Any,
        words: str) -> None:
    job = client.enqueue("t", {})
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    event = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 0}).json()
    if isinstance(body, bytes):
        body = body.replace(b"{", b'{"execution_id": "%s", ' % event["execution_id"].encode(),
                            1)
    else:
        body = {"execution_id": event["execution_id"], **body}
    answer = post_raw(http, "/workers/complete", body, token)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]["message"]
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["result"], row["errors"]) == ("running", None, [])
    # The execution is still in flight: a good completion goes through.
    done = http.post("/workers/complete", headers=auth(token), json={
        "execution_id": event["execution_id"], "outcome": "success", "result": "\x00 ok"})
    assert done.status_code == 200 and done.json()["state"] == "succeeded"
    assert client.await_result(job.id, timeout=5) == "\x00 ok"  # a result is bytea: NUL fits


def test_a_claim_path_that_is_not_utf8_is_refused(http: TestClient, client: belay.Belay,
                                                  sql_conn: psycopg.Connection[Any]) -> None:
    """%ED%A0%80 (a surrogate's bytes) reaches the route as U+FFFD x 3: it must not
    match a queue of that name."""
    job = client.enqueue("t", {}, queue="\ufffd\ufffd\ufffd")
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"],
                                        "queue": "\ufffd\ufffd\ufffd"}).json()["worker_token"]
    for path in ("%ED%A0%80", "%FF%FF%FF"):
        answer = http.post(f"/queues/{path}/claim", headers=auth(token), json={"wait_ms": 0})
        assert answer.status_code == 400, answer.text
        assert "not valid UTF-8" in answer.json()["error"]["message"]
    assert job_row(sql_conn, job.id)["state"] == "ready"
    answer = http.post("/queues/a%00b/claim", headers=auth(token), json={"wait_ms": 0})
    assert "queue contains a NUL" in answer.json()["error"]["message"]
    claimed = http.post("/queues/%EF%BF%BD%EF%BF%BD%EF%BF%BD/claim", headers=auth(token),
                        json={"wait_ms": 0})
    assert claimed.status_code == 200 and claimed.json()["job_id"] == job.id


def test_stale_completion_after_reclaim_writes_nothing(
        sessions: WorkerSessions, client: belay.Belay, clock: ManualClock,
        sql_conn: psycopg.Connection[Any]) -> None:
    job = client.enqueue("t", {})
    slow = sessions.register("slow", ["t"], 1)
    event = sessions.claim(slow, "default", 0)
    assert event is not None
    clock.advance(31)  # the lease (30 s) expires without a renewal
    assert sessions.reclaim() == 1
    clock.advance(600)
    fast = sessions.register("fast", ["t"], 1)
    second = sessions.claim(fast, "default", 0)
    assert second is not None and second["attempt"] == 2
    with pytest.raises(StaleExecution):
        sessions.complete(slow, event["execution_id"], "success", result="late")
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["result"]) == ("running", 2, None)
    sessions.complete(fast, second["execution_id"], "success", result="on time")
    assert client.await_result(job.id, timeout=5) == "on time"


def test_a_row_reclaim_cannot_write_does_not_hold_back_the_rest(
        sessions: WorkerSessions, sql_conn: psycopg.Connection[Any]) -> None:
    """The sessions' reclaim is the Python worker's (belay.parts.maintenance):
    a row whose reclaim fails is logged and skipped, and the rows behind it
    are reclaimed (before, the pass stopped at it, on every sweep)."""
    stuck = running_job(sql_conn, lease_until=START - timedelta(seconds=2))
    behind = running_job(sql_conn, lease_until=START - timedelta(seconds=1))
    refuse_updates_of(sql_conn, stuck)
    assert sessions.reclaim() == 1
    assert job_row(sql_conn, behind)["state"] == "ready"
    assert job_row(sql_conn, stuck)["state"] == "running"


def test_lost_lease_is_noticed_by_the_heartbeat(
        sessions: WorkerSessions, client: belay.Belay, sql_conn: psycopg.Connection[Any]
) -> None:
    job = client.enqueue("t", {})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    sql_conn.execute("UPDATE belay_jobs SET leased_by = 'someone-else' WHERE id = %s", (job.id,))
    sessions.tick()
    with pytest.raises(StaleExecution, match="lost its lease"):
        sessions.complete(token, event["execution_id"], "success", result=1)
    assert job_row(sql_conn, job.id)["result"] is None


def test_timeout_ms_fails_the_attempt(sessions: WorkerSessions, client: belay.Belay,
                                      ticker: Ticker, sql_conn: psycopg.Connection[Any]
                                      ) -> None:
    job = client.enqueue("t", {}, meta={"$timeout_ms": 1500})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None and event["timeout_ms"] == 1500
    ticker.now += 1.0
    sessions.tick()
    assert job_row(sql_conn, job.id)["state"] == "running"
    ticker.now += 1.0
    sessions.tick()
    row = job_row(sql_conn, job.id)
    assert row["state"] == "ready" and "timeout" in row["errors"][0]["error"]
    with pytest.raises(StaleExecution, match="timed out"):
        sessions.complete(token, event["execution_id"], "success", result=1)
    assert job_row(sql_conn, job.id)["result"] is None


def test_an_operators_cancel_reaches_the_worker_as_cancel_execution(
        sessions: WorkerSessions, client: belay.Belay, http: TestClient,
        sql_conn: psycopg.Connection[Any]) -> None:
    job = client.enqueue("t", {})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None and event["type"] == "execute"
    client.cancel_job(job.id)
    assert job_row(sql_conn, job.id)["state"] == "running"  # requested, not yet seen
    sessions.tick()
    row = job_row(sql_conn, job.id)
    assert row["state"] == "cancelled" and row["errors"][-1]["reason"] == "cancel_requested"
    # At capacity or not, the next claim returns the cancel, once.
    response = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 0})
    assert response.status_code == 200
    assert response.json() == {"type": "cancel_execution", "execution_id": event["execution_id"],
                               "job_id": job.id, "attempt": 1, "reason": "cancel_requested"}
    assert http.post("/queues/default/claim", headers=auth(token),
                     json={"wait_ms": 0}).status_code == 204
    with pytest.raises(StaleExecution):
        sessions.complete(token, event["execution_id"], "success", result=1)
    assert job_row(sql_conn, job.id)["result"] is None


def test_a_timeout_reaches_the_worker_as_cancel_execution(
        sessions: WorkerSessions, client: belay.Belay, ticker: Ticker) -> None:
    client.enqueue("t", {}, meta={"$timeout_ms": 1000})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    ticker.now += 2.0
    sessions.tick()
    cancel = sessions.claim(token, "default", 0)
    assert cancel is not None and (cancel["type"], cancel["execution_id"], cancel["reason"]) \
        == ("cancel_execution", event["execution_id"], "timeout")


# -- Leases and sessions --------------------------------------------------------------------


def test_heartbeat_renews_leases_of_live_sessions(
        sessions: WorkerSessions, client: belay.Belay, clock: ManualClock,
        sql_conn: psycopg.Connection[Any]) -> None:
    job = client.enqueue("t", {})
    token = sessions.register("r", ["t"], 1)
    assert sessions.claim(token, "default", 0) is not None
    before = job_row(sql_conn, job.id)["lease_until"]
    clock.advance(20)
    sessions.tick()
    assert job_row(sql_conn, job.id)["lease_until"] > before
    clock.advance(20)  # 40 s after the claim: alive thanks to the renewal
    assert sessions.reclaim() == 0


def test_expired_session_lets_its_lease_lapse(
        sessions: WorkerSessions, client: belay.Belay, clock: ManualClock, ticker: Ticker,
        sql_conn: psycopg.Connection[Any]) -> None:
    job = client.enqueue("t", {})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    ticker.now += 61  # no claim for longer than session_ttl
    sessions.tick()
    assert sessions.sessions() == 0
    with pytest.raises(Unauthorized):
        sessions.claim(token, "default", 0)
    lease = job_row(sql_conn, job.id)["lease_until"]
    clock.advance(31)
    sessions.tick()  # nothing renews it any more
    assert job_row(sql_conn, job.id)["lease_until"] == lease
    # Normal reclaim: a Python worker's sweep (or the sessions' own) retries it.
    assert belay.Worker(["default"], client=client).reclaim() == 1
    row = job_row(sql_conn, job.id)
    assert row["state"] == "ready" and row["errors"][0]["error"] == "lease_expired"


def test_close_ends_the_session(http: TestClient, sessions: WorkerSessions) -> None:
    token = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]}).json()[
        "worker_token"]
    assert http.delete("/workers", headers=auth(token)).status_code == 204
    assert sessions.sessions() == 0
    answer = http.post("/queues/default/claim", headers=auth(token), json={"wait_ms": 0})
    assert answer.status_code == 401


def test_a_session_closed_with_a_job_in_flight_uses_its_attempt(
        sessions: WorkerSessions, client: belay.Belay, clock: ManualClock,
        sql_conn: psycopg.Connection[Any]) -> None:
    """Issue 38's class, on HTTP: a session that goes (DELETE, or expiry, above)
    hands nothing back for free — its lease lapses and reclaim uses the
    attempt, so a job that kills every HTTP worker it runs on is bounded by
    its max_attempts like any job (a guard: this held on 845be33 too)."""
    job = client.enqueue("t", {}, max_attempts=1)
    token = sessions.register("r", ["t"], 1)
    assert sessions.claim(token, "default", 0) is not None
    sessions.close(token)
    clock.advance(31)
    sessions.tick()  # nothing renews it any more
    assert sessions.reclaim() == 1
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"]) == ("failed", 1)
    assert [e["error"] for e in row["errors"]] == ["lease_expired"]


def test_stop_joins_the_heartbeat(client: belay.Belay) -> None:
    s = WorkerSessions(client)
    s.register("r", ["t"], 1)
    assert any(t.name == "belay-http-heartbeat" for t in threading.enumerate())
    s.stop()
    assert not any(t.name == "belay-http-heartbeat" for t in threading.enumerate())


# -- Admission and the database ------------------------------------------------------------


def test_global_limit_holds_for_http_executions(sessions: WorkerSessions,
                                               client: belay.Belay) -> None:
    client.put_queue("paid", global_limit=1)
    for i in range(3):
        client.enqueue("t", {"i": i}, queue="paid")
    a = sessions.register("a", ["t"], 4, "paid")
    b = sessions.register("b", ["t"], 4, "paid")
    first = sessions.claim(a, "paid", 0)
    assert first is not None
    assert sessions.claim(a, "paid", 0) is None
    assert sessions.claim(b, "paid", 0) is None
    sessions.complete(a, first["execution_id"], "success", result=None)
    assert sessions.claim(b, "paid", 0) is not None
    assert client.stats()["paid"]["running"] == 1


def test_database_failure_is_unavailable(clock: ManualClock) -> None:
    with belay.Belay("postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=1",
                     clock=clock) as down:
        s = WorkerSessions(down)
        try:
            token = s.register("r", ["t"], 1)
            app = TestClient(Starlette(routes=worker_routes(s)))
            answer = app.post("/queues/default/claim", headers=auth(token),
                              json={"wait_ms": 0})
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "unavailable"
        finally:
            s.stop()


def test_openapi_paths_cover_the_routes() -> None:
    assert set(WORKER_OPENAPI_PATHS) == {"/workers", "/queues/{queue}/claim",
                                         "/workers/started", "/workers/complete"}
    assert set(WORKER_OPENAPI_PATHS["/workers"]) == {"post", "delete"}


def test_store_claim_is_what_http_workers_use(sessions: WorkerSessions, client: belay.Belay,
                                             sql_conn: psycopg.Connection[Any]) -> None:
    """A Python worker's node and an HTTP session see one another's leases."""
    job = client.enqueue("t", {})
    token = sessions.register("r", ["t"], 1)
    event = sessions.claim(token, "default", 0)
    assert event is not None
    with client.connection() as conn:
        assert store.claim(conn, "default", 5, "py-node", client.now(),
                           client.now()) == []
    assert job_row(sql_conn, job.id)["attempt"] == 1


@pytest.mark.parametrize("options", [
    {"lease_ttl": float("inf")}, {"lease_ttl": 1e300}, {"lease_ttl": float("nan")},
    {"session_ttl": float("inf")}, {"lease_ttl": 0}, {"session_ttl": True},
])
def test_ttls_a_lease_cannot_hold_are_refused_when_the_sessions_are_made(client, options):
    with pytest.raises(belay.ConfigurationError, match="at most 86400"):
        WorkerSessions(client, **options)
