"""A property-based fuzz run of the producer API against its own OpenAPI
document (schemathesis, in process, a real database): no 500s, responses as
documented, and a refused request leaves every table as it was. A second run
against an unreachable database: never a success, only 503s and refusals. A
third layer sends hostile text and JSON (tests.strategies: NUL, lone
surrogates, non-ASCII digits, huge strings, deep nesting) into every text and
JSON field and path parameter: never a 5xx, a 400 for what PostgreSQL can't
store, and nothing written by a refusal.

Cases come from schemathesis's strategies driven by hypothesis directly
(its pytest plugin's fixture loader does not run under pytest 9)."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisDeprecationWarning
from schemathesis import GenerationMode, checks
from starlette.testclient import TestClient

import belay
from belay.http import build_app
from belay.http.options import MAX_JSON_DEPTH
from belay.http.workers import WORKER_OPENAPI_PATHS, WorkerSessions, worker_routes
from belay.names import MAX_NAME_BYTES, text_problem
from tests.helpers import insert_job
from tests.strategies import hostile_json, hostile_text

Conn = psycopg.Connection[Any]
#: The body limit of the fuzzed apps: small, so that oversized requests are
#: fuzzed too. An invalid request refused for its size (413, as documented) is
#: refused all the same: the negative-data check counts 413 as a refusal.
BODY_LIMIT = 10_000
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.response_headers_conformance, checks.negative_data_rejection]
#: Per operation and mode: 12 operations x 2 modes x 50 cases.
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


#: Hypothesis runs many examples against a real database; on a loaded 2-core
#: machine that outlasts the suite's 120 s hang guard, which is for hangs.
pytestmark = pytest.mark.timeout(600)


def loaded(app: Any) -> Any:
    """The app's OpenAPI document, as schemathesis fuzzes it: a 413 (the body
    is over the limit) counts as the refusal of an invalid request."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return schema


def operations(schema: Any, count: int = 12) -> list[Any]:
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) == count, [op.label for op in found]
    return found


def fuzz(schema: Any, each: Callable[[Any], None], count: int = 12) -> None:
    """Run ``each(case)`` on cases of every operation, valid and invalid ones."""
    for operation in operations(schema, count):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @FUZZ
            @given(operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                each(case)

            with warnings.catch_warnings():
                # Some schemathesis releases (4.30) draw from the `random`
                # module inside their strategies, which some hypothesis
                # releases (6.168) flag; that is theirs to fix, not a finding.
                warnings.filterwarnings("ignore", category=HypothesisDeprecationWarning,
                                        message="Do not use the `random` module")
                run()


def snapshot(conn: Conn) -> tuple[Any, ...]:
    """Every row of the tables a producer call can write, digested."""
    row = conn.execute(
        "SELECT (SELECT md5(coalesce(string_agg(j::text, ',' ORDER BY id), '')) "
        "        FROM belay_jobs j),"
        "       (SELECT md5(coalesce(string_agg(s::text, ',' ORDER BY scope, name), '')) "
        "        FROM belay_signals s),"
        "       (SELECT count(*) FROM belay_events)").fetchone()
    assert row is not None
    return tuple(row)


def documented(sql_conn: Conn, statuses: dict[int, int]) -> Callable[[Any], None]:
    """A check per case: answered as the document says, and a refusal wrote
    nothing; counts the statuses seen."""
    def each(case: Any) -> None:
        before = snapshot(sql_conn)
        response = case.call()
        case.validate_response(response, checks=CHECKS)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 400:
            assert snapshot(sql_conn) == before, (
                f"{case.method} {case.formatted_path} -> {response.status_code} wrote rows")
    return each


@pytest.fixture
def seeded(client: belay.Belay, sql_conn: Conn) -> Iterator[Any]:
    # Finished jobs only: a stream of an unfinished job would follow it forever.
    insert_job(sql_conn, state="succeeded", result=b'{"ok": true}')
    insert_job(sql_conn, state="failed", errors=[{"error": "boom"}])
    insert_job(sql_conn, state="cancelled")
    insert_job(sql_conn, state="succeeded")
    yield loaded(build_app(client, body_limit=BODY_LIMIT))


def test_the_api_keeps_its_document(seeded: Any, sql_conn: Conn) -> None:
    statuses: dict[int, int] = {}
    fuzz(seeded, documented(sql_conn, statuses))
    # The run reached both sides: accepted calls and refusals.
    assert statuses.get(201, 0) > 0 and statuses.get(400, 0) > 0, statuses


def test_a_dead_database_is_never_a_success() -> None:
    down = belay.Belay("postgresql://postgres@127.0.0.1:1/none")
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(down))
    answered: set[int] = set()

    def each(case: Any) -> None:
        response = case.call()
        # not_a_server_error left out: a 503 is this run's right answer.
        case.validate_response(response, checks=CHECKS[1:])
        assert response.status_code != 500, response.text
        answered.add(response.status_code)
        assert response.status_code >= 400, (
            f"{case.method} {case.formatted_path} answered {response.status_code} "
            "with no database")

    try:
        fuzz(schema, each)
    finally:
        down.close()
    assert 503 in answered, answered


def test_the_worker_protocol_keeps_its_document(seeded: Any, client: belay.Belay,
                                                 sql_conn: Conn) -> None:
    """The worker endpoints too, served beside the producer API as ``belay
    serve`` does: no 500s, answers as documented, and a refusal writes nothing."""
    sessions = WorkerSessions(client)
    app = build_app(client, body_limit=BODY_LIMIT, extra_routes=worker_routes(sessions),
                    extra_openapi_paths=WORKER_OPENAPI_PATHS)
    schema = loaded(app)
    statuses: dict[int, int] = {}
    try:
        operations = 12 + sum(len(item) for item in WORKER_OPENAPI_PATHS.values())
        fuzz(schema, documented(sql_conn, statuses), count=operations)
    finally:
        sessions.stop()
    assert statuses.get(201, 0) > 0 and statuses.get(401, 0) > 0, statuses


# -- Hostile text and JSON --------------------------------------------------------------------

#: A few dozen cases per field group: each is one request and two table digests.
HOSTILE = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck))


class _Raw(str):
    """JSON punctuation already written out (see :func:`json_text`)."""


def json_text(value: Any) -> bytes:
    """``value`` as JSON text the way a careless client writes it: lone surrogates
    as ``\\ud800`` escapes, NaN and infinities as bare literals, any depth (the
    stdlib encoder stops near 1,000 levels)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Raw):
            out.append(item)
        elif isinstance(item, (list, dict)):
            pairs = list(item.items()) if isinstance(item, dict) else list(enumerate(item))
            stack.append(_Raw("}" if isinstance(item, dict) else "]"))
            for index, (key, child) in reversed(list(enumerate(pairs))):
                stack.append(child)
                if isinstance(item, dict):
                    stack.append(_Raw(json.dumps(key) + ":"))
                if index:
                    stack.append(_Raw(","))
            stack.append(_Raw("{" if isinstance(item, dict) else "["))
        else:
            out.append(json.dumps(item))
    return "".join(out).encode()


def segment(value: str) -> str:
    """``value`` as one path segment: its UTF-8 bytes percent-encoded, a lone
    surrogate as the three bytes it would take (%ED%A0%80: not UTF-8)."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def unstorable_name(value: str) -> bool:
    """A name belay.names.check_text refuses."""
    return (text_problem(value) is not None or not value.strip()
            or len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES)


def unstorable_json(value: Any, *, nul: bool = True) -> bool:
    """A JSON value no belay column can hold (``nul``: a NUL counts, as in jsonb)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if text_problem(item if nul else item.replace("\x00", "")) is not None:
                return True
        elif isinstance(item, float) and not math.isfinite(item):
            return True
        elif isinstance(item, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                return True
            if isinstance(item, dict):
                if any(text_problem(key) is not None for key in item):
                    return True
                stack.extend((child, depth + 1) for child in item.values())
            else:
                stack.extend((child, depth + 1) for child in item)
    return False


def hostile_run(sql_conn: Conn, send: Callable[[str, Any], Any],
                refused: Callable[[str, Any], bool], fields: list[str],
                values: st.SearchStrategy[Any], prepare: Callable[[], object] = lambda: None
                ) -> dict[int, int]:
    """Send ``values`` into each of ``fields``: never a 5xx; a 400 (or, for an
    empty path segment, a 404) whenever ``refused(field, value)``; and a refusal
    writes nothing. ``prepare`` runs before each case's digest. Returns how often
    each status was seen."""
    statuses: dict[int, int] = {}

    @HOSTILE
    @given(field=st.sampled_from(fields), value=values)
    def run(field: str, value: Any) -> None:
        prepare()
        before = snapshot(sql_conn)
        response = send(field, value)
        status = response.status_code
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (field, value, response.text)
        if refused(field, value):
            assert status in (400, 404), (field, value, status, response.text)
        if status >= 400:
            assert snapshot(sql_conn) == before, (field, status, "wrote rows")

    run()
    return statuses


def test_hostile_text_and_json_reach_no_producer_write(client: belay.Belay,
                                                       sql_conn: Conn) -> None:
    waiting = insert_job(sql_conn, state="awaiting", await_name="go")
    sql_conn.execute("UPDATE belay_jobs SET await_scope = 'job:' || id WHERE id = %s",
                     (waiting,))
    json_headers = {"content-type": "application/json"}

    def send(field: str, value: Any) -> Any:
        if field == "signal name":
            return http.post(f"/jobs/{waiting}/signals/{segment(value)}", content=b"{}",
                             headers=json_headers)
        if field == "payload":
            return http.post(f"/jobs/{waiting}/signals/go", headers=json_headers,
                             content=json_text({"v": value}))
        body: dict[str, Any] = {"task": "t", "args": {}, "options": {}}
        if field == "args":
            body["args"] = {"v": value}
        elif field == "args key":
            body["args"] = {value: 1}
        elif field.startswith("options."):
            body["options"][field.removeprefix("options.")] = value
        else:
            body[field] = value
        return http.post("/jobs", content=json_text(body), headers=json_headers)

    def refused(field: str, value: Any) -> bool:
        if field in ("args", "payload"):
            return unstorable_json(value)
        if field == "args key":
            return text_problem(value) is not None
        return unstorable_name(value)

    names = ["task", "options.queue", "options.id", "options.submission_id", "signal name",
             "args key"]
    with TestClient(build_app(client), raise_server_exceptions=False) as http:
        seen = hostile_run(sql_conn, send, refused, names, hostile_text())
        seen_json = hostile_run(sql_conn, send, refused, ["args", "payload"], hostile_json())
    assert seen.get(400, 0) > 0 and seen.get(201, 0) > 0, seen
    assert seen_json.get(400, 0) > 0, seen_json


def test_hostile_text_and_json_reach_no_worker_write(client: belay.Belay,
                                                     sql_conn: Conn) -> None:
    sessions = WorkerSessions(client)
    token = sessions.register("fuzz", ["t"])
    json_headers = {"content-type": "application/json"}
    auth = {"Authorization": f"Bearer {token}", **json_headers}
    flight: dict[str, str] = {}

    def execution() -> str:
        """The session's execution in flight (a fresh one once the last completed)."""
        if "id" not in flight:
            client.enqueue("t", {})
            event = sessions.claim(token, "default", 0)
            assert event is not None
            flight["id"] = event["execution_id"]
        return flight["id"]

    def send(field: str, value: Any) -> Any:
        if field == "claim queue":
            return http.post(f"/queues/{segment(value)}/claim", headers=auth,
                             content=b'{"wait_ms": 0}')
        if field in ("result", "error.details", "error.message", "execution_id"):
            body: dict[str, Any] = {"execution_id": execution(), "outcome": "failure",
                                    "error": {"message": "boom"}}
            if field == "result":
                body = {"execution_id": body["execution_id"], "outcome": "success",
                        "result": value}
            elif field == "execution_id":
                body["execution_id"] = value
            else:
                body["error"][field.removeprefix("error.")] = value
            response = http.post("/workers/complete", headers=auth, content=json_text(body))
            if response.status_code == 200:
                flight.clear()
            return response
        registration: dict[str, Any] = {"runtime_id": "r", "tasks": ["t"], "queue": "q"}
        registration[field] = [value] if field == "tasks" else value
        return http.post("/workers", content=json_text(registration), headers=json_headers)

    def refused(field: str, value: Any) -> bool:
        if field == "result":
            return unstorable_json(value, nul=False)  # bytea JSON holds a NUL
        if field == "error.details":
            return unstorable_json(value)
        if field in ("error.message", "execution_id"):
            return False  # made storable / only looked up
        return unstorable_name(value)

    app = build_app(client, extra_routes=worker_routes(sessions),
                    extra_openapi_paths=WORKER_OPENAPI_PATHS)
    try:
        with TestClient(app, raise_server_exceptions=False) as http:
            seen = hostile_run(sql_conn, send, refused,
                               ["runtime_id", "tasks", "queue", "claim queue", "error.message",
                                "execution_id"], hostile_text(), execution)
            seen_json = hostile_run(sql_conn, send, refused, ["result", "error.details"],
                                    hostile_json(), execution)
    finally:
        sessions.stop()
    assert seen.get(400, 0) > 0 and seen.get(201, 0) > 0, seen
    assert seen_json.get(400, 0) > 0 and seen_json.get(200, 0) > 0, seen_json
