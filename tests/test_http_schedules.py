"""``/schedules`` over HTTP (belay.http.schedules) against a real PostgreSQL:
declare, page, read, cancel, and the seed's status codes (400, 404, 503)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import psycopg
import pytest
from starlette.testclient import TestClient

import belay
from belay.http.app import build_app
from belay.http.errors import STATUS
from belay.http.schedules import parse_declaration

NIGHTLY = {"id": "nightly", "cron": "0 3 * * *", "task": "app.report",
           "args": {"full": True}, "overlap": "queue", "options": {"queue": "ops"}}


@pytest.fixture
def api(client: belay.Belay) -> Iterator[TestClient]:
    with TestClient(build_app(client), raise_server_exceptions=False) as http:
        yield http


def error_of(response: httpx2.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert STATUS[code] == status
    return str(body["error"]["message"])


def test_declare_read_page_and_cancel(api: TestClient, client: belay.Belay) -> None:
    created = api.post("/schedules", json=NIGHTLY)
    assert created.status_code == 201, created.text
    body = created.json()
    assert (body["type"], body["id"], body["cron"], body["task"], body["args"],
            body["overlap"], body["catch_up"], body["options"], body["revision"]) == \
        ("schedule", "nightly", "0 3 * * *", "app.report", {"full": True}, "queue", "latest",
         {"queue": "ops"}, 1)
    assert body["next_due"].startswith("2026-03-02T03:00")
    again = api.post("/schedules", json=NIGHTLY)  # idempotent
    assert (again.status_code, again.json()["revision"]) == (200, 1)
    assert api.get("/schedules/nightly").json() == again.json()
    for n in range(3):
        assert api.post("/schedules", json={**NIGHTLY, "id": f"z{n}"}).status_code == 201
    page = api.get("/schedules", params={"limit": 2}).json()
    assert [s["id"] for s in page["schedules"]] == ["nightly", "z0"]
    rest = api.get("/schedules", params={"cursor": page["next_cursor"]}).json()
    assert ([s["id"] for s in rest["schedules"]], rest["next_cursor"]) == (["z1", "z2"], None)
    cancelled = api.delete("/schedules/nightly")
    assert cancelled.status_code == 200 and cancelled.json()["cancelled_at"] is not None
    assert client.schedule_status("nightly").cancelled_at is not None  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "fragment"), [
    ([], "a schedule is a JSON object"),
    ({"id": "x", "cron": "@daily"}, "missing task"),
    ({**NIGHTLY, "every": 5}, "unknown field(s) every"),
    ({**NIGHTLY, "id": 5}, "id is a string"),
    ({**NIGHTLY, "overlap": "sometimes"}, "overlap is one of"),
    ({**NIGHTLY, "catch_up": 600}, 'catch_up is "latest" or "all"'),
    ({**NIGHTLY, "args": [1]}, "args is a JSON object"),
    ({**NIGHTLY, "options": {"unique": "k"}}, "unknown option(s) unique"),
    ({**NIGHTLY, "cron": "61 * * * *"}, "invalid cron expression"),
    ({**NIGHTLY, "id": "a\u0000b"}, "NUL"),
    ({**NIGHTLY, "options": {"priority": "high"}}, "priority"),
])
def test_invalid_declarations_are_400_and_write_nothing(
        api: TestClient, client: belay.Belay, body: Any, fragment: str) -> None:
    message = error_of(api.post("/schedules", json=body), 400, "invalid_request")
    assert fragment in message
    assert client.schedules() == []


def test_missing_schedules_are_404(api: TestClient) -> None:
    assert "no schedule 'gone'" in error_of(api.get("/schedules/gone"), 404, "not_found")
    error_of(api.delete("/schedules/gone"), 404, "not_found")
    error_of(api.get("/schedules", params={"limit": "0"}), 400, "invalid_request")
    error_of(api.get("/schedules", params={"limit": "x"}), 400, "invalid_request")


def test_a_connection_lost_mid_declaration_is_503_unknown_outcome(
        api: TestClient, sql_conn: psycopg.Connection[Any]) -> None:
    """The server's connection dies while the declaration is written (a trigger
    terminates its own backend): the outcome is unknown, and said so."""
    sql_conn.execute("""
        CREATE FUNCTION belay_test_die() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$;
        CREATE TRIGGER belay_test_die BEFORE INSERT ON belay_schedules
          FOR EACH ROW EXECUTE FUNCTION belay_test_die();
    """)
    message = error_of(api.post("/schedules", json=NIGHTLY), 503, "unknown_outcome")
    assert "may or may not have been saved" in message
    sql_conn.execute("DROP TRIGGER belay_test_die ON belay_schedules")
    assert api.post("/schedules", json=NIGHTLY).status_code == 201  # sent again: fine


def test_a_database_failure_on_a_read_is_503() -> None:
    down = belay.Belay("postgresql://postgres@127.0.0.1:1/none")
    with TestClient(build_app(down)) as http:
        for response in (http.get("/schedules"), http.get("/schedules/x"),
                         http.post("/schedules", json=NIGHTLY)):
            assert response.status_code == 503
    down.close()


def test_the_declaration_parser_is_pure() -> None:
    assert parse_declaration(NIGHTLY) == {
        "name": "nightly", "expression": "0 3 * * *", "worker": "app.report",
        "input": {"full": True}, "overlap": "queue", "catch_up": "latest", "queue": "ops"}


def test_openapi_lists_the_schedule_endpoints(api: TestClient) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert set(paths["/schedules"]) == {"post", "get"}
    assert {"get", "delete"} <= set(paths["/schedules/{schedule_id}"])
