"""The HTTP/JSON producer API (belay.http): option rules, every endpoint and
error code in-process against a real database, and real uvicorn servers (plain
and mTLS) in subprocesses."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx2
import psycopg
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

import belay
from belay.enqueue import Unique
from belay.errors import ConfigurationError
from belay.http import build_app
from belay.http.errors import STATUS, ApiError
from belay.http.options import MAX_JSON_DEPTH, canonical, parse_enqueue, round_ms
from belay.http.server import check_tls, serve
from belay.http.workers import WORKER_OPENAPI_PATHS, WorkerSessions, worker_routes
from tests.helpers import START, count_jobs, insert_job, job_row, running_job, signal_rows
from tests.strategies import deep

Conn = psycopg.Connection[Any]
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# -- options (pure) ---------------------------------------------------------------------


def parse(options: dict[str, Any], **body: Any) -> Any:
    return parse_enqueue({"task": "billing.capture.v1", "args": {"a": 1},
                          "options": options, **body}, START)


def refused(body: Any) -> str:
    with pytest.raises(ApiError) as info:
        parse_enqueue(body, START)
    assert info.value.code == "invalid_request"
    return info.value.message


def test_a_bare_job_takes_belay_defaults() -> None:
    spec = parse_enqueue({"task": "t"}, START)
    assert (spec.kind, spec.input, spec.meta) == ("t", {}, {})
    assert spec.kwargs() == {"queue": None, "priority": None, "delay": None, "run_at": None,
                             "max_attempts": None, "unique": None, "budget": None,
                             "meta": None, "authority": None}


@pytest.mark.parametrize(("options", "field", "value"), [
    ({"id": "order-42"}, "unique", Unique("order-42", "always")),
    ({"retries": 0}, "max_attempts", 1),
    ({"retries": 65_534}, "max_attempts", 65_535),
    ({"queue": "billing"}, "queue", "billing"),
    ({"priority": -5}, "priority", -5),
    ({"budget": {"usd": 1.5, "tokens": 10}}, "budget", {"usd": 1.5, "tokens": 10}),
    ({"authority": {"tools": ["search"], "usd": 2}}, "authority",
     {"tools": ["search"], "usd": 2}),
    ({"delay": 1.5}, "delay", timedelta(milliseconds=1500)),
    ({"delay": 0.0005}, "delay", timedelta(milliseconds=1)),  # halfway rounds up
    ({"delay": 0.0004}, "delay", timedelta(0)),
    ({"delay_ms": 250}, "delay", timedelta(milliseconds=250)),
    ({"run_at": 1_700_000_000_123}, "run_at",
     EPOCH + timedelta(milliseconds=1_700_000_000_123)),
    ({"run_at": 0}, "run_at", EPOCH),
    ({"durability": "persistent"}, "queue", None),
])
def test_options_map_onto_enqueue(options: dict[str, Any], field: str, value: Any) -> None:
    assert getattr(parse(options), field) == value


def test_submission_id_derives_a_stable_key() -> None:
    first = parse({"submission_id": "s-1"}).unique
    assert first == parse({"submission_id": "s-1"}).unique
    assert first != parse({"submission_id": "s-2"}).unique
    assert first.mode == "always" and first.key.startswith("submission:")
    assert len(parse({"submission_id": "x" * 255}).unique.key) == len("submission:") + 64


@pytest.mark.parametrize(("options", "meta"), [
    ({"timeout": 30}, {"$timeout_ms": 30_000}),
    ({"timeout": 0.0015}, {"$timeout_ms": 2}),
    ({"timeout": 0.0005}, {"$timeout_ms": 1}),
    ({"timeout_ms": 86_400_000}, {"$timeout_ms": 86_400_000}),
    ({"backoff": {"type": "exponential", "base_ms": 100, "max_ms": 100}},
     {"$backoff": {"type": "exponential", "base_ms": 100, "max_ms": 100}}),
])
def test_worker_side_options_travel_in_meta(options: dict[str, Any], meta: Any) -> None:
    assert parse(options).meta == meta


def test_round_ms_rounds_halves_away_from_zero() -> None:
    assert [round_ms("x", v) for v in (0.0005, 0.0015, 0.0025, 1, 2.4999)] == [1, 2, 3, 1000,
                                                                              2500]


@pytest.mark.parametrize(("body", "words"), [
    ([], "body must be a JSON object"),
    ({"task": "t", "extra": 1}, "unknown field(s) 'extra'"),
    ({}, "task must be a non-empty string"),
    ({"task": "  "}, "task must be a non-empty string"),
    ({"task": 5}, "task must be a non-empty string"),
    ({"task": "t", "args": []}, "args must be a JSON object, got an array"),
    ({"task": "t", "options": "x"}, "options must be a JSON object"),
    ({"task": "t", "options": {"colour": 1}}, "unknown option(s) 'colour'"),
    ({"task": "t", "options": {"queue": None, "priority": None}},
     "option(s) 'priority', 'queue' are null"),
    ({"task": "t", "options": {"id": "a", "submission_id": "b"}}, "conflict"),
    ({"task": "t", "options": {"delay": 1, "delay_ms": 1}}, "conflict"),
    ({"task": "t", "options": {"delay": 1, "run_at": 1}}, "conflict"),
    ({"task": "t", "options": {"delay_ms": 1, "run_at": 1}}, "conflict"),
    ({"task": "t", "options": {"timeout": 1, "timeout_ms": 1}}, "conflict"),
    ({"task": "t", "options": {"id": ""}}, "id must be a non-empty string"),
    ({"task": "t", "options": {"id": 7}}, "id must be a non-empty string"),
    ({"task": "t", "options": {"id": "$x"}}, "reserved"),
    ({"task": "t", "options": {"id": "x" * 256}}, "limit is 255"),
    ({"task": "t", "options": {"delay": -1}}, "delay must be between 0"),
    ({"task": "t", "options": {"delay": "5"}}, "delay is a number of seconds"),
    ({"task": "t", "options": {"delay": True}}, "delay is a number of seconds"),
    ({"task": "t", "options": {"delay": 1e300}}, "delay must be between"),
    ({"task": "t", "options": {"delay_ms": 1.5}}, "delay_ms must be an integer"),
    ({"task": "t", "options": {"delay_ms": 315_360_000_001}}, "delay_ms must be between"),
    ({"task": "t", "options": {"run_at": -1}}, "run_at must be between 0"),
    ({"task": "t", "options": {"run_at": 253_402_300_800_000}}, "run_at must be between"),
    ({"task": "t", "options": {"retries": -1}}, "retries must be between 0 and 65534"),
    ({"task": "t", "options": {"retries": 65_535}}, "retries must be between 0 and 65534"),
    ({"task": "t", "options": {"retries": 1.0}}, "retries must be an integer"),
    ({"task": "t", "options": {"timeout": 0}}, "timeout must be between 1 and 86400000"),
    ({"task": "t", "options": {"timeout": 0.0004}}, "rounds to 0 ms"),
    ({"task": "t", "options": {"timeout": 86_400.001}}, "timeout must be between"),
    # Within a rounded millisecond of the document's maximum is still over it.
    ({"task": "t", "options": {"timeout": 86400.00000000001}}, "timeout must be between"),
    ({"task": "t", "options": {"delay": 315_360_000.0000001}}, "delay must be between"),
    ({"task": "t", "options": {"timeout_ms": 0}}, "timeout_ms must be between 1"),
    ({"task": "t", "options": {"timeout_ms": 86_400_001}}, "timeout_ms must be between"),
    ({"task": "t", "options": {"queue": ""}}, "queue must be a non-empty string"),
    ({"task": "t", "options": {"queue": 3}}, "options.queue must be a string, got int"),
    ({"task": "t", "options": {"priority": 2**31}}, "priority must be between"),
    ({"task": "t", "options": {"budget": 5}}, "budget must be a JSON object"),
    ({"task": "t", "options": {"budget": {"eur": 1}}}, "unknown budget key(s) 'eur'"),
    ({"task": "t", "options": {"budget": {"usd": -1}}}, "budget usd must be a finite number"),
    ({"task": "t", "options": {"budget": {"tokens": -1}}}, "budget tokens must be between"),
    ({"task": "t", "options": {"authority": ["search"]}}, "authority must be a JSON object"),
    ({"task": "t", "options": {"authority": {"tools": "search"}}},
     "authority tools is a list of names"),
    ({"task": "t", "options": {"authority": {"kinds": None}}},
     "authority key(s) 'kinds' are null"),
    ({"task": "t", "options": {"budget": {"usd": 1, "warn_at": None}}},
     "budget key(s) 'warn_at' are null"),
    ({"task": "t", "options": {"authority": {"usd": 1}, "budget": {"usd": 2}}},
     "a budget of $2 is more than the $1 this job may hold"),
    ({"task": "t", "options": {"backoff": "exp"}}, "backoff must be a JSON object"),
    ({"task": "t", "options": {"backoff": {"type": "linear", "base_ms": 1, "max_ms": 2}}},
     "backoff type must be 'exponential'"),
    ({"task": "t", "options": {"backoff": {"type": "exponential", "max_ms": 2}}},
     "backoff needs base_ms"),
    ({"task": "t", "options": {"backoff": {"type": "exponential", "base_ms": 5, "max_ms": 2}}},
     "max_ms (2) must be at least base_ms (5)"),
    ({"task": "t", "options": {"backoff": {"type": "exponential", "base_ms": 1, "max_ms": 2,
                                           "jitter": 1}}}, "unknown backoff field(s)"),
    ({"task": "t", "options": {"durability": "volatile"}}, "belay keeps every job in PostgreSQL"),
    ({"task": "t", "options": {"durability": "disk"}}, "durability must be 'persistent'"),
    ({"task": "t", "args": {"x": {1, 2}}}, "not JSON-serializable"),
])
def test_bad_requests_are_refused_naming_the_problem(body: Any, words: str) -> None:
    assert words in refused(body)


def test_a_delay_past_year_9999_is_refused() -> None:
    late = datetime(9999, 12, 1, tzinfo=timezone.utc)
    with pytest.raises(ApiError, match="after year 9999"):
        parse_enqueue({"task": "t", "options": {"delay": 86_400 * 60}}, late)


# -- the app, in process ------------------------------------------------------------------


@pytest.fixture
def api(client: belay.Belay) -> Iterator[TestClient]:
    with TestClient(build_app(client), raise_server_exceptions=False) as http:
        yield http


def post_job(api: TestClient, body: Any, **kw: Any) -> httpx2.Response:
    return api.post("/jobs", json=body, **kw)


def error_of(response: httpx2.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert STATUS[code] == status
    message: str = body["error"]["message"]
    return message


def test_enqueue_returns_201_with_the_job(api: TestClient, sql_conn: Conn) -> None:
    response = post_job(api, {"task": "billing.capture.v1", "args": {"invoice_id": "inv-42"},
                              "options": {"retries": 2, "queue": "billing", "priority": 3,
                                          "timeout": 30, "delay": 5,
                                          "budget": {"usd": 0.5, "tokens": 100},
                                          "authority": {"queues": ["billing"]}}})
    assert response.status_code == 201, response.text
    job = response.json()
    assert response.headers["location"] == f"/jobs/{job['id']}"
    assert job["type"] == "job" and job["duplicate"] is False
    row = job_row(sql_conn, job["id"])
    assert (row["kind"], row["queue"], row["state"], row["max_attempts"], row["priority"]) == (
        "billing.capture.v1", "billing", "ready", 3, 3)
    assert row["input"] == {"invoice_id": "inv-42"}
    assert row["meta"] == {"$timeout_ms": 30_000, "$authority": {"queues": ["billing"]}}
    assert row["ready_at"] == START + timedelta(seconds=5)
    assert (row["budget_usd_micros"], row["budget_tokens"]) == (500_000, 100)
    assert job["input"] == {"invoice_id": "inv-42"} and job["max_attempts"] == 3


def test_run_at_is_absolute_unix_milliseconds(api: TestClient, sql_conn: Conn) -> None:
    at = 1_900_000_000_250
    job = post_job(api, {"task": "t", "options": {"run_at": at}}).json()
    assert job_row(sql_conn, job["id"])["ready_at"] == EPOCH + timedelta(milliseconds=at)


def test_retrying_with_the_same_id_returns_the_same_job(api: TestClient,
                                                        sql_conn: Conn) -> None:
    body = {"task": "t", "args": {"n": 1}, "options": {"id": "order-42"}}
    first = post_job(api, body)
    again = post_job(api, body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"] and again.json()["duplicate"] is True
    # ... even after it finished: the key is held for good (unique mode always).
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE id = %s",
                     (first.json()["id"],))
    assert post_job(api, body).json()["id"] == first.json()["id"]
    assert count_jobs(sql_conn) == 1
    other = post_job(api, {**body, "args": {"n": 2}})
    assert "another task or args" in error_of(other, 409, "id_conflict")
    assert count_jobs(sql_conn) == 1


@pytest.mark.parametrize(("first", "again", "status"), [
    (b'{"confirm": 1}', b'{"confirm": true}', 409),  # Python: True == 1
    (b'{"confirm": 0}', b'{"confirm": false}', 409),
    (b'{"n": 1}', b'{"n": 1.0}', 409),  # Python: 1 == 1.0
    (b'{"n": [1, {"m": 1}]}', b'{"n": [1, {"m": true}]}', 409),
    (b'{"a": 1, "b": [2.5]}', b'{"b": [2.5], "a": 1}', 200),  # key order is not a value
    (b'{"n": 1.0}', b'{"n": 1.0}', 200),
    (b'{"n": 1e16}', b'{"n": 1e16}', 200),  # jsonb reads it back as an integer
    (b'{"n": -0.0}', b'{"n": -0.0}', 200),  # ... and this as 0.0
    (b'{"n": 1e-7}', b'{"n": 1e-7}', 200),
])
def test_an_id_retry_compares_args_as_json(api: TestClient, sql_conn: Conn, first: bytes,
                                           again: bytes, status: int) -> None:
    def send(args: bytes) -> httpx2.Response:
        return api.post("/jobs", content=b'{"task": "t", "options": {"id": "pay-77"}, '
                        b'"args": ' + args + b"}", headers={"content-type": "application/json"})

    held = send(first)
    assert held.status_code == 201, held.text
    retried = send(again)
    if status == 409:
        error_of(retried, 409, "id_conflict")
    else:
        assert retried.status_code == 200 and retried.json()["id"] == held.json()["id"]
    assert count_jobs(sql_conn) == 1


def test_canonical_json_keeps_apart_what_python_conflates() -> None:
    assert len({canonical(v) for v in (True, 1, 1.0, "1", None, False, 0, 0.0)}) == 8
    assert canonical({"b": 1, "a": [True]}) == canonical({"a": [True], "b": 1})
    assert canonical(1e16) == canonical(10**16) and canonical(1e300) == canonical(10**300)
    assert canonical(-0.0) == canonical(0.0) and canonical(1.5e-7) == canonical(0.00000015)
    assert canonical(2**70 + 1) != canonical(float(2**70 + 1))


def test_submission_ids_are_idempotent_too(api: TestClient, sql_conn: Conn) -> None:
    body = {"task": "t", "options": {"submission_id": "client-run-7"}}
    ids = {post_job(api, body).json()["id"] for _ in range(3)}
    assert len(ids) == 1 and count_jobs(sql_conn) == 1
    assert post_job(api, {"task": "t", "options": {"submission_id": "other"}}).status_code == 201


def test_an_http_id_and_a_python_unique_key_are_the_same_key(api: TestClient,
                                                             client: belay.Belay) -> None:
    held = client.enqueue("t", {}, unique=Unique("shared-1", "always"))
    response = post_job(api, {"task": "t", "options": {"id": "shared-1"}})
    assert response.status_code == 200 and response.json()["id"] == held.id


def test_a_refused_option_writes_nothing(api: TestClient, sql_conn: Conn) -> None:
    message = error_of(post_job(api, {"task": "t", "options": {"delay": 1, "run_at": 5}}),
                       400, "invalid_request")
    assert "options 'delay', 'run_at' conflict" in message
    assert "belay keeps every job" in error_of(
        post_job(api, {"task": "t", "options": {"durability": "volatile"}}), 400,
        "invalid_request")
    assert count_jobs(sql_conn) == 0


@pytest.mark.parametrize(("content", "headers", "status", "code", "words"), [
    (b'{"task": ', {"content-type": "application/json"}, 400, "invalid_request",
     "not valid JSON"),
    (b'{"task": "t", "args": {"x": NaN}}', {"content-type": "application/json"}, 400,
     "invalid_request", "not valid JSON"),
    (b'{"task": "t", "args": {"x": 1e400}}', {"content-type": "application/json"}, 400,
     "invalid_request", "too large for a double"),
    (b'\xff\xfe', {"content-type": "application/json"}, 400, "invalid_request",
     "not valid JSON"),
    (b"[1]", {"content-type": "application/json"}, 400, "invalid_request",
     "must be a JSON object"),
    (b"", {"content-type": "application/json"}, 400, "invalid_request", "body is empty"),
    (b'{"task": "t"}', {"content-type": "text/plain"}, 415, "unsupported_media_type",
     "application/json"),
    (b'{"task": "t"}', {}, 415, "unsupported_media_type", "no Content-Type"),
    (b'{"task": "t", "args": {"x": "\\u0000"}}', {"content-type": "application/json"}, 400,
     "invalid_request", "args.x contains a NUL character"),
])
def test_malformed_bodies(api: TestClient, sql_conn: Conn, content: bytes,
                          headers: dict[str, str], status: int, code: str,
                          words: str) -> None:
    response = api.post("/jobs", content=content, headers=headers)
    assert words in error_of(response, status, code)
    assert count_jobs(sql_conn) == 0


def test_huge_integers_stay_exact(api: TestClient, sql_conn: Conn) -> None:
    big = 2**70 + 1
    response = api.post("/jobs", content=b'{"task": "t", "args": {"n": %d}}' % big,
                        headers={"content-type": "application/json"})
    assert response.status_code == 201
    assert job_row(sql_conn, response.json()["id"])["input"] == {"n": big}


def post_raw(api: TestClient, body: Any) -> httpx2.Response:
    """``body`` as JSON text the way a careless client writes it: lone surrogates as
    ``\\ud800`` escapes, NaN as a bare literal (httpx's ``json=`` refuses both)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.post("/jobs", content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("body", "words"), [
    ({"task": "a\x00b"}, "task contains a NUL character"),
    ({"task": "\ud800"}, "task contains a lone surrogate"),
    ({"task": "é" * 128}, "task is 256 bytes long; the limit is 255 bytes"),
    ({"task": "t", "options": {"queue": "q\x00"}}, "options.queue contains a NUL"),
    ({"task": "t", "options": {"queue": "\udfff"}}, "options.queue contains a lone surrogate"),
    ({"task": "t", "options": {"id": "pay\x00"}}, "options.id contains a NUL"),
    ({"task": "t", "options": {"id": "pay-\ud800"}}, "options.id contains a lone surrogate"),
    ({"task": "t", "options": {"id": "é" * 128}}, "options.id is 256 bytes long"),
    ({"task": "t", "options": {"submission_id": "\ud800"}},
     "options.submission_id contains a lone surrogate"),
    ({"task": "t", "options": {"submission_id": "s\x00"}},
     "options.submission_id contains a NUL"),
    ({"task": "t", "args": {"x": [1, "\ud800"]}}, "args.x[1] contains a lone surrogate"),
    ({"task": "t", "args": {"k\x00": 1}}, "a key in args contains a NUL"),
    ({"task": "t", "args": {"x": {"\udc00": 1}}}, "a key in args.x contains a lone surrogate"),
    ({"task": "t", "args": {"x": float("nan")}}, "not valid JSON: NaN is not JSON"),
    ({"task": "t", "args": {"x": float("inf")}}, "not valid JSON: Infinity is not JSON"),
    ({"task": "t", "args": {"x": deep(MAX_JSON_DEPTH)}},
     f"args nests deeper than {MAX_JSON_DEPTH} levels"),
    (b'{"task": "t", "args": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
     "nests deeper than belay parses"),
])
def test_bad_text_is_a_400_naming_the_field(api: TestClient, sql_conn: Conn, body: Any,
                                            words: str) -> None:
    assert words in error_of(post_raw(api, body), 400, "invalid_request")
    assert count_jobs(sql_conn) == 0


def test_the_deepest_args_allowed_are_stored(api: TestClient, sql_conn: Conn) -> None:
    response = post_raw(api, {"task": "t", "args": {"x": deep(MAX_JSON_DEPTH - 2)}})
    assert response.status_code == 201, response.text
    assert job_row(sql_conn, response.json()["id"])["input"] == {"x": deep(MAX_JSON_DEPTH - 2)}


def test_get_job(api: TestClient, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn, kind="k", input={"a": 1})
    body = api.get(f"/jobs/{job_id}").json()
    assert (body["type"], body["id"], body["kind"], body["state"], body["input"]) == (
        "job", job_id, "k", "ready", {"a": 1})
    assert "does not exist" in error_of(api.get("/jobs/999999"), 404, "not_found")
    for bad in ("abc", "0", "-1", "9223372036854775808", "1.5"):
        assert "a job id is an integer" in error_of(api.get(f"/jobs/{bad}"), 400,
                                                    "invalid_request")


def test_cancel(api: TestClient, sql_conn: Conn) -> None:
    ready = insert_job(sql_conn)
    running = running_job(sql_conn)
    body = api.delete(f"/jobs/{ready}").json()
    assert (body["type"], body["status"], body["job"]["state"]) == ("cancel", "cancelled",
                                                                    "cancelled")
    assert api.delete(f"/jobs/{ready}").json()["status"] == "noop"
    assert api.delete(f"/jobs/{running}").json()["status"] == "requested"
    assert job_row(sql_conn, running)["cancel_requested"] is True
    error_of(api.delete("/jobs/424242"), 404, "not_found")


def test_result_mapping(api: TestClient, sql_conn: Conn) -> None:
    null = insert_job(sql_conn, state="succeeded", result=b"null")
    value = insert_job(sql_conn, state="succeeded", result=b'{"ok": [1, 2]}')
    missing = insert_job(sql_conn, state="succeeded")
    failed = insert_job(sql_conn, state="failed", attempt=3, errors=[{"error": "boom"}])
    cancelled = insert_job(sql_conn, state="cancelled")
    pending = insert_job(sql_conn, state="ready")

    assert api.get(f"/jobs/{null}/result").json() == {"type": "result", "id": null,
                                                      "result": None}
    assert api.get(f"/jobs/{value}/result").json()["result"] == {"ok": [1, 2]}
    assert "no stored result" in error_of(api.get(f"/jobs/{missing}/result"), 410,
                                          "result_missing")
    assert "boom" in error_of(api.get(f"/jobs/{failed}/result"), 409, "task_failed")
    error_of(api.get(f"/jobs/{cancelled}/result"), 409, "task_cancelled")
    assert "is ready" in error_of(api.get(f"/jobs/{pending}/result"), 409, "result_not_ready")
    error_of(api.get("/jobs/77777/result"), 404, "not_found")


def test_signals(api: TestClient, sql_conn: Conn) -> None:
    waiting = insert_job(sql_conn, state="awaiting", await_name="approve")
    sql_conn.execute("UPDATE belay_jobs SET await_scope = 'job:' || id WHERE id = %s",
                     (waiting,))
    response = api.post(f"/jobs/{waiting}/signals/approve", json={"by": "ann"})
    assert response.json() == {"type": "signal", "id": waiting, "signal": "approve",
                               "woken": [waiting]}
    assert job_row(sql_conn, waiting)["state"] == "ready"
    # An empty body is the payload {}, sent as JSON like any other (belay.origin).
    assert api.post(f"/jobs/{waiting}/signals/nudge",
                    headers={"content-type": "application/json"}).json()["woken"] == []
    assert [(r["name"], r["payload"]) for r in signal_rows(sql_conn)] == [
        ("approve", {"by": "ann"}), ("nudge", {})]

    assert "reserved" in error_of(api.post(f"/jobs/{waiting}/signals/$steer", json={}), 400,
                                  "invalid_request")
    error_of(api.post(f"/jobs/{waiting}/signals/x", json=[1]), 400, "invalid_request")
    error_of(api.post(f"/jobs/{waiting}/signals/x", content=b"{}",
                      headers={"content-type": "text/plain"}), 415, "unsupported_media_type")
    error_of(api.post("/jobs/5555/signals/approve", json={}), 404, "not_found")
    assert len(signal_rows(sql_conn)) == 2


@pytest.mark.parametrize(("path", "payload", "words"), [
    # Invalid UTF-8 once percent-decoded: the server would hand the route U+FFFD.
    ("signals/%ED%A0%80", b"{}", "the request path is not valid UTF-8"),
    ("signals/ok%FF", b"{}", "the request path is not valid UTF-8"),
    ("signals/a%00b", b"{}", "the signal name contains a NUL character"),
    ("signals/" + "%C3%A9" * 128, b"{}", "the signal name is 256 bytes long"),
    ("signals/ok", b'{"by": "\\u0000"}', "payload.by contains a NUL character"),
    ("signals/ok", b'{"\\ud800": 1}', "a key in payload contains a lone surrogate"),
    ("signals/ok", b'{"n": NaN}', "NaN is not JSON"),
])
def test_a_bad_signal_is_a_400_and_writes_nothing(api: TestClient, sql_conn: Conn, path: str,
                                                  payload: bytes, words: str) -> None:
    waiting = insert_job(sql_conn, state="awaiting", await_name="ok")
    sql_conn.execute("UPDATE belay_jobs SET await_scope = 'job:' || id WHERE id = %s",
                     (waiting,))
    response = api.post(f"/jobs/{waiting}/{path}", content=payload,
                        headers={"content-type": "application/json"})
    assert words in error_of(response, 400, "invalid_request")
    assert signal_rows(sql_conn) == [] and job_row(sql_conn, waiting)["state"] == "awaiting"
    for bad_id in ("%ED%A0%80", "%C2%B2", "1%00"):  # a job id is ASCII digits only
        assert "a job id is an integer" in error_of(
            api.post(f"/jobs/{bad_id}/signals/ok", json={}), 400, "invalid_request")


def test_a_last_event_id_in_other_digits_is_ignored(client: belay.Belay,
                                                    sql_conn: Conn) -> None:
    """b"\\xb2" is "²" as Starlette decodes a header (Latin-1): str.isdigit() takes
    it, int() does not. Sent at the ASGI level: an HTTP client would re-encode it."""
    job_id = insert_job(sql_conn, state="succeeded", result=b"1")
    add_events(sql_conn, job_id, 1)
    sent = asgi_call(build_app(client), "GET", f"/jobs/{job_id}/events/stream", [],
                     [(b"last-event-id", b"\xb2")])
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert [kind for kind, _, _ in sse(body)] == ["event", "end"]


def add_events(conn: Conn, job_id: int, count: int, first: int = 1) -> None:
    for seq in range(first, first + count):
        conn.execute("INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
                     "VALUES (%s, %s, %s, %s)",
                     (job_id, seq, psycopg.types.json.Jsonb({"n": seq}), START))


def test_event_pages(api: TestClient, sql_conn: Conn) -> None:
    job_id = running_job(sql_conn)
    add_events(sql_conn, job_id, 5)
    page = api.get(f"/jobs/{job_id}/events?after=1&limit=2").json()
    assert [e["seq"] for e in page["events"]] == [2, 3] and page["next_after"] == 3
    assert page["events"][0]["payload"] == {"n": 2} and page["state"] == "running"
    rest = api.get(f"/jobs/{job_id}/events", params={"after": page["next_after"]}).json()
    assert [e["seq"] for e in rest["events"]] == [4, 5]
    assert api.get(f"/jobs/{job_id}/events?after=5").json()["next_after"] == 5
    for query in ("limit=0", "limit=1001", "after=-1", "after=x"):
        error_of(api.get(f"/jobs/{job_id}/events?{query}"), 400, "invalid_request")
    error_of(api.get("/jobs/8888/events"), 404, "not_found")


def test_the_stream_of_a_finished_job_replays_and_ends(api: TestClient,
                                                       sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn, state="succeeded", result=b"1")
    add_events(sql_conn, job_id, 3)
    response = api.get(f"/jobs/{job_id}/events/stream", headers={"Last-Event-ID": "1"})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse(response.text) == [("event", "2", {"seq": 2, "payload": {"n": 2},
                                                  "inserted_at": START.isoformat()}),
                                  ("event", "3", {"seq": 3, "payload": {"n": 3},
                                                  "inserted_at": START.isoformat()}),
                                  ("end", None, {"id": job_id, "state": "succeeded"})]
    error_of(api.get("/jobs/8888/events/stream"), 404, "not_found")


def sse(text: str) -> list[tuple[str, str | None, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], fields.get("id"), json.loads(fields["data"])))
    return out


def test_routing_errors_are_json(api: TestClient) -> None:
    response = api.put("/jobs")
    assert "PUT is not allowed" in error_of(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"
    assert "GET /openapi.json" in error_of(api.get("/nope"), 404, "not_found")


@pytest.mark.parametrize("with_length", [True, False])
def test_bodies_over_the_limit_are_refused_unread(client: belay.Belay, sql_conn: Conn,
                                                  with_length: bool) -> None:
    app = build_app(client, body_limit=100)
    body = json.dumps({"task": "t", "args": {"pad": "x" * 200}}).encode()
    with TestClient(app) as http:
        if with_length:
            response = http.post("/jobs", content=body,
                                 headers={"content-type": "application/json"})
        else:  # a streamed body: no Content-Length, the bytes are counted
            response = http.post("/jobs", content=iter([body[:60], body[60:]]),
                                 headers={"content-type": "application/json"})
            assert "content-length" not in response.request.headers
        assert "100-byte limit" in error_of(response, 413, "payload_too_large")
        small = http.post("/jobs", json={"task": "t"})
        assert small.status_code == 201
    assert count_jobs(sql_conn) == 1


def asgi_call(app: Any, method: str, path: str, chunks: list[bytes],
              headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One request straight through ASGI (headers and body exactly as given); the
    messages the app sent."""
    import anyio

    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks or [b""])]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await anyio.sleep_forever()  # the client keeps the connection open
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("testserver", 80), "client": ("1.2.3.4", 5), "headers": headers}
    anyio.run(app, scope, receive, send)
    return sent


def test_a_lying_content_length_is_counted_anyway(client: belay.Belay) -> None:
    """An ASGI-level check: Content-Length says 10, 200 bytes arrive."""
    sent = asgi_call(build_app(client, body_limit=100), "POST", "/jobs",
                     [b"x" * 100, b"x" * 100],
                     [(b"content-length", b"10"), (b"content-type", b"application/json")])
    assert sent[0]["status"] == 413


def test_the_token_guards_every_producer_call(client: belay.Belay, sql_conn: Conn) -> None:
    with TestClient(build_app(client, token="s3cret")) as http:
        message = error_of(http.post("/jobs", json={"task": "t"}), 401, "unauthorized")
        assert "s3cret" not in message
        for header in ("Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2"):
            response = http.get("/jobs/1", headers={"Authorization": header})
            error_of(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
        ok = http.post("/jobs", json={"task": "t"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 201
        assert http.get("/openapi.json").status_code == 200  # the document is public
    assert count_jobs(sql_conn) == 1


@pytest.mark.parametrize("with_length", [True, False])
def test_the_token_is_checked_before_the_body_is_read(client: belay.Belay, sql_conn: Conn,
                                                      with_length: bool) -> None:
    """A client without the token can't make the server take in a body: 401, not 413."""
    sessions = WorkerSessions(client)
    app = build_app(client, token="s3cret", body_limit=100,
                    extra_routes=worker_routes(sessions, token="s3cret"),
                    extra_openapi_paths=WORKER_OPENAPI_PATHS)
    big = json.dumps({"task": "t", "args": {"pad": "x" * 5000}}).encode()
    try:
        with TestClient(app) as http:
            def post(path: str, **headers: str) -> httpx2.Response:
                content: Any = big if with_length else iter([big[:60], big[60:]])
                return http.post(path, content=content,
                                 headers={"content-type": "application/json", **headers})

            for path in ("/jobs", "/jobs/1/signals/go", "/workers", "/queues/default/claim",
                         "/workers/started", "/workers/complete"):
                error_of(post(path), 401, "unauthorized")
                error_of(post(path, authorization="Bearer wrong"), 401, "unauthorized")
            for path in ("/jobs", "/workers"):
                refused = post(path, authorization="Bearer s3cret")
                assert "100-byte limit" in error_of(refused, 413, "payload_too_large")
                assert refused.headers["connection"] == "close"
    finally:
        sessions.stop()
    assert count_jobs(sql_conn) == 0 and sessions.sessions() == 0


def test_a_database_failure_is_503_never_a_success() -> None:
    down = belay.Belay("postgresql://postgres@127.0.0.1:1/none")
    with TestClient(build_app(down)) as http:
        for response in (http.post("/jobs", json={"task": "t"}), http.get("/jobs/1"),
                         http.get("/jobs/1/result"), http.delete("/jobs/1")):
            assert "database is unavailable" in error_of(response, 503, "unavailable")
    down.close()


def test_loopback_host_guard(client: belay.Belay) -> None:
    app = build_app(client, allowed_hosts={"127.0.0.1", "localhost"})
    with TestClient(app, base_url="http://evil.example") as http:
        assert "not served here" in error_of(http.get("/jobs/1"), 400, "invalid_request")
    with TestClient(app, base_url="http://127.0.0.1:8080") as http:
        error_of(http.get("/jobs/1"), 404, "not_found")


def test_openapi_document(client: belay.Belay) -> None:
    async def ping(request: Any) -> Any:
        from starlette.responses import PlainTextResponse
        return PlainTextResponse("pong")

    app = build_app(client, extra_routes=[Route("/workers/ping", ping)],
                    extra_openapi_paths={"/workers/ping": {"get": {"responses": {
                        "200": {"description": "pong"}}}}})
    with TestClient(app) as http:
        doc = http.get("/openapi.json").json()
        assert http.get("/workers/ping").text == "pong"
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/result",
                                 "/jobs/{job_id}/signals/{name}", "/jobs/{job_id}/top_up",
                                 "/jobs/{job_id}/events",
                                 "/jobs/{job_id}/events/stream", "/schedules",
                                 "/schedules/{schedule_id}", "/workers/ping"}
    assert set(doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]
               ["code"]["enum"]) == set(STATUS)
    with pytest.raises(ValueError, match="clash"):
        build_app(client, extra_openapi_paths={"/jobs": {}})


# -- real servers ---------------------------------------------------------------------------


class Served:
    """``serve()`` in a subprocess; ``url`` from the line it prints."""

    def __init__(self, db_url: str, **options: Any) -> None:
        code = ("import sys, json; from belay.http.server import serve; "
                "serve(sys.argv[1], **json.loads(sys.argv[2]))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, db_url, json.dumps({"port": 0, **options})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).parent.parent)
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()
        if not self.line:
            self.proc.wait(10)
            raise AssertionError(f"serve did not start: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.url = self.line.split("serving ", 1)[1].split("/ ", 1)[0]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        _, self.err = self.proc.communicate(timeout=30)
        return self.proc.wait()


def test_a_real_server_serves_streams_and_stops_on_sigterm(db_url: str, sql_conn: Conn
                                                           ) -> None:
    served = Served(db_url, token="tok-1", shutdown_grace=1)
    try:
        assert served.line.startswith("belay serve: serving http://127.0.0.1:")
        assert "(bearer token required)" in served.line
        auth = {"Authorization": "Bearer tok-1"}
        with httpx2.Client(base_url=served.url, headers=auth, timeout=10) as http:
            created = http.post("/jobs", json={"task": "t", "options": {"id": "x"}})
            assert created.status_code == 201
            job_id = created.json()["id"]
            sql_conn.execute("UPDATE belay_jobs SET state = 'running', attempt = 1 "
                             "WHERE id = %s", (job_id,))
            seen: list[str] = []
            opened = threading.Event()

            def follow() -> None:
                with http.stream("GET", f"/jobs/{job_id}/events/stream") as stream:
                    opened.set()
                    seen.extend(line for line in stream.iter_lines() if line)

            reader = threading.Thread(target=follow, name="sse-reader")
            reader.start()
            assert opened.wait(10)
            add_events(sql_conn, job_id, 2)
            sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded', result = 'null' "
                             "WHERE id = %s", (job_id,))
            reader.join(15)
            assert not reader.is_alive()
            assert [line for line in seen if line.startswith(("event:", "id:"))] == [
                "event: event", "id: 1", "event: event", "id: 2", "event: end"]
            assert http.get(f"/jobs/{job_id}/result").json()["result"] is None
            # The producer token and the Host guard hold on the real server too.
            assert http.get("/jobs/1", headers={"Authorization": "Bearer no"}
                            ).status_code == 401
            assert http.get("/jobs/1", headers={"Host": "attacker.example"}
                            ).status_code == 400
    finally:
        assert served.stop() == 0
    assert "tok-1" not in served.err


def test_sigterm_with_an_open_stream_still_exits_0(db_url: str, sql_conn: Conn) -> None:
    job_id = running_job(sql_conn)
    served = Served(db_url, shutdown_grace=1)
    opened = threading.Event()
    ended: list[BaseException | None] = []

    def follow() -> None:
        try:
            with httpx2.Client(base_url=served.url, timeout=30) as http, \
                    http.stream("GET", f"/jobs/{job_id}/events/stream") as stream:
                opened.set()
                for _ in stream.iter_lines():
                    pass
            ended.append(None)
        except httpx2.HTTPError as exc:  # cut off by the shutdown
            ended.append(exc)

    reader = threading.Thread(target=follow, name="sse-reader")
    reader.start()
    try:
        assert opened.wait(10)
    finally:
        assert served.stop() == 0
        reader.join(15)
    assert not reader.is_alive() and len(ended) == 1
    assert "belay serve: stopped" in served.err


def _certs(tmp: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (tmp / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("belay test CA")).issuer_name(
        name("belay test CA")).public_key(ca_key.public_key()).serial_number(1)
        .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                     False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256()))
    write("ca", ca, ca_key)
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    import ipaddress
    for stem, usage, san in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("producer")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - timedelta(minutes=5))
                .not_valid_after(now + timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                               critical=True)
                .add_extension(aki, critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(stem, cert, key)
    return {p.stem + p.suffix: p for p in tmp.iterdir()}


def test_mtls_refuses_a_client_without_a_certificate(db_url: str, tmp_path: Path) -> None:
    files = _certs(tmp_path)
    served = Served(db_url, tls_cert=str(files["server.crt"]),
                    tls_key=str(files["server.key"]), tls_client_ca=str(files["ca.crt"]))
    try:
        assert served.url.startswith("https://127.0.0.1:")
        assert "(mTLS, no token)" in served.line
        import ssl
        ca = ssl.create_default_context(cafile=str(files["ca.crt"]))
        with httpx2.Client(base_url=served.url, verify=ca, timeout=10) as anonymous, \
                pytest.raises((httpx2.ReadError, httpx2.RemoteProtocolError)):
            anonymous.post("/jobs", json={"task": "t"})
        trusted = ssl.create_default_context(cafile=str(files["ca.crt"]))
        trusted.load_cert_chain(str(files["client.crt"]), str(files["client.key"]))
        with httpx2.Client(base_url=served.url, verify=trusted, timeout=10) as http:
            response = http.post("/jobs", json={"task": "t"})
            assert response.status_code == 201, response.text
    finally:
        assert served.stop() == 0


@pytest.mark.parametrize(("host", "tls", "words"), [
    ("0.0.0.0", {}, "refusing to serve 0.0.0.0 without TLS"),
    ("192.0.2.1", {}, "--tls-cert, --tls-key and --tls-client-ca"),
    ("127.0.0.1", {"tls_cert": "a.crt"}, "missing --tls-key, --tls-client-ca"),
    ("::", {"tls_cert": "a", "tls_key": "b"}, "missing --tls-client-ca"),
    ("127.0.0.1", {"tls_cert": "/no/a", "tls_key": "/no/b", "tls_client_ca": "/no/c"},
     "--tls-cert /no/a: no such file"),
])
def test_unsafe_tls_configurations_refuse_to_start(host: str, tls: dict[str, str],
                                                    words: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        serve("postgresql://postgres@127.0.0.1:1/none", host=host, port=0, **tls)
    assert words in str(info.value)


def test_loopback_without_tls_is_plain_http() -> None:
    assert check_tls("127.0.0.1", None, None, None) is False
    assert check_tls("localhost", None, None, None) is False
    assert check_tls("::1", None, None, None) is False

