"""A property-based fuzz run of the producer API against its own OpenAPI
document (schemathesis, in process, a real database): no 500s, responses as
documented, and a refused request leaves every table as it was. A second run
against an unreachable database: never a success, only 503s and refusals.

Cases come from schemathesis's strategies driven by hypothesis directly
(its pytest plugin's fixture loader does not run under pytest 9)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

import belay
from belay.http import build_app
from belay.http.workers import WORKER_OPENAPI_PATHS, WorkerSessions, worker_routes
from tests.helpers import insert_job

Conn = psycopg.Connection[Any]
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.response_headers_conformance, checks.negative_data_rejection]
#: Per operation and mode: 7 operations x 2 modes x 50 cases.
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def operations(schema: Any, count: int = 7) -> list[Any]:
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) == count, [op.label for op in found]
    return found


def fuzz(schema: Any, each: Callable[[Any], None], count: int = 7) -> None:
    """Run ``each(case)`` on cases of every operation, valid and invalid ones."""
    for operation in operations(schema, count):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @FUZZ
            @given(operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                each(case)

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
    yield schemathesis.openapi.from_asgi("/openapi.json", build_app(client, body_limit=10_000))


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
    app = build_app(client, body_limit=10_000, extra_routes=worker_routes(sessions),
                    extra_openapi_paths=WORKER_OPENAPI_PATHS)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    statuses: dict[int, int] = {}
    try:
        operations = 7 + sum(len(item) for item in WORKER_OPENAPI_PATHS.values())
        fuzz(schema, documented(sql_conn, statuses), count=operations)
    finally:
        sessions.stop()
    assert statuses.get(201, 0) > 0 and statuses.get(401, 0) > 0, statuses
