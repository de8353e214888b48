"""Browser-reachable mutations (issue 38, finding A): every HTTP surface belay
serves refuses a state-changing request that a browser sent from a page of
another origin, and takes a POST only as ``application/json`` — the rule of
:mod:`belay.origin`, one implementation for all of them.

The attack: ``belay serve`` without a token, and any web page the operator
visits posting a plain cross-site form to ``/jobs/{id}/signals/approve`` (a
"simple" request: no CORS preflight). The class: every mutation route of
``belay serve`` (producer API, schedules, HTTP worker protocol), enumerated
from the app itself; the dashboard; the MCP server's streamable HTTP.
Requests with no ``Origin`` (curl, SDKs, HTTP workers) keep working.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.routing import Route
from starlette.testclient import TestClient

import belay
from belay import ops
from belay.dashboard import make_app
from belay.http import build_app
from belay.http.errors import STATUS
from belay.http.workers import WORKER_OPENAPI_PATHS, WorkerSessions, worker_routes
from tests.helpers import insert_job, job_row, signal_rows
from tests.strategies import any_text
from tests.test_dashboard import HOST, TOKEN, call

Conn = psycopg.Connection[Any]
EVIL = "https://evil.example"
FORM = "application/x-www-form-urlencoded"
#: A browser's cross-site form post, as a page elsewhere makes it.
FORGED = {"Origin": EVIL, "Sec-Fetch-Site": "cross-site", "Content-Type": FORM}
SERVER_TOKEN = "s3cret"
#: The methods that change nothing (belay.origin.SAFE_METHODS, spelt out here so
#: that this file runs against a belay without that module, and fails there).
SAFE = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


# -- the rule (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "refused"), [
    ({}, False),  # curl, an SDK, an HTTP worker
    ({"origin": "http://h:8080", "host": "h:8080"}, False),
    ({"origin": "HTTP://H:8080", "host": "h:8080"}, False),
    ({"origin": "http://h", "host": "h:80"}, False),  # the scheme's default port
    ({"origin": "https://h:443", "host": "h"}, False),
    ({"origin": "http://[::1]:8080", "host": "[::1]:8080"}, False),
    ({"sec-fetch-site": "same-origin", "origin": "http://h", "host": "h"}, False),
    ({"sec-fetch-site": "none"}, False),  # typed by the user, not sent by a page
    ({"origin": "http://h:8081", "host": "h:8080"}, True),
    ({"origin": "https://h:8080", "host": "h:8080"}, False),  # host and port decide
    ({"origin": "http://evil.example", "host": "h"}, True),
    ({"origin": "http://h.evil.example", "host": "h"}, True),
    ({"origin": "null", "host": "h"}, True),  # a sandboxed frame, a file: page
    ({"origin": "file://", "host": "h"}, True),
    ({"origin": "chrome-extension://abc", "host": "abc"}, True),
    ({"origin": "http://h/path", "host": "h"}, True),
    ({"origin": "http://h:99999", "host": "h:99999"}, True),  # no such port
    ({"origin": "http://[::1", "host": "[::1"}, True),
    ({"origin": "http://h"}, True),  # no Host to be
    ({"sec-fetch-site": "cross-site"}, True),
    ({"sec-fetch-site": "same-site", "origin": "http://h", "host": "h"}, True),
])
def test_a_foreign_origin_is_told_apart_from_this_one(headers: dict[str, str],
                                                      refused: bool) -> None:
    from belay import origin

    message = origin.cross_origin(headers)
    assert (message is not None) == refused, message
    if message is not None:
        assert message.startswith("cross-origin request refused")
        assert message.endswith(origin.ORIGIN_FIX)


@pytest.mark.parametrize(("method", "headers", "status"), [
    ("GET", {"origin": EVIL, "host": "h"}, None),  # reads change nothing
    ("HEAD", {"sec-fetch-site": "cross-site"}, None),
    ("OPTIONS", {"origin": EVIL, "host": "h"}, None),
    ("POST", {"content-type": "application/json"}, None),
    ("POST", {"content-type": "Application/JSON; charset=utf-8"}, None),
    ("POST", {}, 415),  # even with an empty body
    ("POST", {"content-type": "text/plain"}, 415),
    ("POST", {"content-type": FORM}, 415),
    ("POST", {"content-type": "multipart/form-data; boundary=x"}, 415),
    ("POST", {"content-type": "application/json", "origin": EVIL, "host": "h"}, 403),
    ("DELETE", {}, None),  # no body: a cross-site DELETE needs a preflight anyway
    ("DELETE", {"origin": EVIL, "host": "h"}, 403),
    ("PUT", {"sec-fetch-site": "cross-site"}, 403),
    ("PATCH", {"origin": "null", "host": "h"}, 403),
])
def test_the_rule_per_method(method: str, headers: dict[str, str], status: int | None
                             ) -> None:
    from belay import origin

    refused = origin.refusal(method, headers)
    assert (None if refused is None else refused.status) == status
    if refused is not None:
        assert STATUS[refused.code] == refused.status
    if status == 415:
        assert refused is not None and "send Content-Type: application/json" in refused.message


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(method=st.sampled_from(["POST", "DELETE", "PUT", "GET"]),
       values=st.lists(any_text(), min_size=4, max_size=4))
def test_no_header_value_makes_the_rule_raise(method: str, values: list[str]) -> None:
    """Never a 500: whatever Origin, Host, Sec-Fetch-Site and Content-Type say."""
    from belay import origin

    keys = ("origin", "host", "sec-fetch-site", "content-type")
    found = origin.refusal(method, dict(zip(keys, values, strict=True)))
    assert found is None or found.status in (403, 415)


# -- belay serve: the attack, and every mutation route -------------------------------------


@pytest.fixture
def api(client: belay.Belay) -> Iterator[TestClient]:
    """``belay serve``'s default: no token."""
    with TestClient(build_app(client), raise_server_exceptions=False) as http:
        yield http


def parked(conn: Conn, name: str = "approve") -> int:
    job = insert_job(conn, state="awaiting", await_name=name)
    conn.execute("UPDATE belay_jobs SET await_scope = 'job:' || id WHERE id = %s", (job,))
    return job


def test_a_cross_site_form_post_cannot_approve_a_parked_job(api, sql_conn) -> None:
    job = parked(sql_conn)
    url = f"/jobs/{job}/signals/approve"
    for headers, status in [
        (FORGED, 403),  # what a browser sends for <form method=post action=...>
        ({"Origin": EVIL, "Content-Type": "text/plain"}, 403),
        ({"Origin": EVIL}, 403),
        ({"Sec-Fetch-Site": "cross-site"}, 403),  # an Origin stripped on the way
        ({"Content-Type": FORM}, 415),  # a browser that sent no Origin at all
        ({"Content-Type": "text/plain"}, 415),
        ({}, 415),
    ]:
        refused = api.post(url, headers=headers, content=b"")
        assert refused.status_code == status, (headers, refused.text)
        code = refused.json()["error"]["code"]
        assert code == ("cross_origin" if status == 403 else "unsupported_media_type")
        assert refused.headers["content-type"] == "application/json"
    assert job_row(sql_conn, job)["state"] == "awaiting" and signal_rows(sql_conn) == []

    message = api.post(url, headers=FORGED).json()["error"]["message"]
    assert "call it from a page of this server's own origin, or without a browser" in message
    message = api.post(url, headers={"Content-Type": FORM}).json()["error"]["message"]
    assert "send Content-Type: application/json, with {} as the body" in message

    # The operator's own page (same origin), and curl or an SDK (no Origin), go through.
    same = api.post(url, headers={"Origin": "http://testserver",
                                  "Sec-Fetch-Site": "same-origin",
                                  "Content-Type": "application/json"})
    assert same.status_code == 200 and same.json()["woken"] == [job]
    again = parked(sql_conn, "nudge")
    curl = api.post(f"/jobs/{again}/signals/nudge", content=b"",
                    headers={"Content-Type": "application/json"})
    assert curl.status_code == 200 and curl.json()["woken"] == [again]


class Serve:
    """``belay serve``'s app as :func:`belay.http.server.serve` composes it (a
    producer token, the worker protocol beside the API), with a job of every
    kind a mutation needs and a worker session holding a claimed execution."""

    def __init__(self, client: belay.Belay, conn: Conn) -> None:
        self.sessions = WorkerSessions(client)
        self.app = build_app(client, token=SERVER_TOKEN,
                             extra_routes=worker_routes(self.sessions, token=SERVER_TOKEN),
                             extra_openapi_paths=WORKER_OPENAPI_PATHS)
        self.parked = parked(conn)
        self.budgeted = client.enqueue("t", budget={"usd": 1}).id
        client.schedule("nightly", "0 3 * * *", "t")
        self.worker_token = self.sessions.register("r", ["remote"])
        self.running = client.enqueue("remote").id
        event = self.sessions.claim(self.worker_token, "default", 0)
        assert event is not None and event["job_id"] == self.running
        self.execution = event["execution_id"]

    def request(self, method: str, path: str) -> tuple[str, dict[str, str], Any]:
        """A request every check but the browser rule lets through: the URL, the
        right token and a valid body for ``method path``."""
        url = (path.replace("{job_id}", str(self.budgeted if "top_up" in path
                                            else self.parked))
               .replace("{name}", "approve").replace("{schedule_id}", "nightly")
               .replace("{queue}", "default"))
        worker = path.startswith("/queues/") or (path.startswith("/workers")
                                                 and (path, method) != ("/workers", "POST"))
        token = self.worker_token if worker else SERVER_TOKEN
        body: Any = {
            "/jobs": {"task": "t"},
            "/jobs/{job_id}/signals/{name}": {},
            "/jobs/{job_id}/top_up": {"usd": 1},
            "/schedules": {"id": "other", "cron": "0 4 * * *", "task": "t"},
            "/workers": {"runtime_id": "r2", "tasks": ["t"]},
            "/queues/{queue}/claim": {"wait_ms": 0},
            "/workers/started": {"execution_id": self.execution},
            # A forged completion: another's execution, a result of the page's choosing.
            "/workers/complete": {"execution_id": self.execution, "outcome": "success",
                                  "result": "forged"},
        }.get(path) if method == "POST" else None
        return url, {"Authorization": f"Bearer {token}"}, body

    def mutations(self) -> list[tuple[str, str]]:
        """Every (method, path) of the app that may change state, from its routes."""
        found = []
        for route in self.app.routes:
            assert isinstance(route, Route)
            for method in sorted(route.methods or ()):
                if method not in SAFE:
                    found.append((method, route.path))
        return found


def snapshot(conn: Conn, sessions: WorkerSessions) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT (SELECT md5(coalesce(string_agg(j::text, ',' ORDER BY id), '')) "
        "        FROM belay_jobs j),"
        "       (SELECT md5(coalesce(string_agg(s::text, ',' ORDER BY scope, name), '')) "
        "        FROM belay_signals s),"
        "       (SELECT md5(coalesce(string_agg(c::text, ',' ORDER BY name), '')) "
        "        FROM belay_schedules c),"
        "       (SELECT count(*) FROM belay_events)").fetchone()
    assert row is not None
    return (*row, sessions.sessions())


@pytest.fixture
def serve(client: belay.Belay, sql_conn: Conn) -> Iterator[Serve]:
    served = Serve(client, sql_conn)
    try:
        yield served
    finally:
        served.sessions.stop()


def test_every_mutation_of_belay_serve_refuses_a_foreign_origin_even_with_its_token(
        serve: Serve, sql_conn: Conn) -> None:
    mutations = serve.mutations()
    assert set(mutations) >= {
        ("POST", "/jobs"), ("DELETE", "/jobs/{job_id}"),
        ("POST", "/jobs/{job_id}/signals/{name}"), ("POST", "/jobs/{job_id}/top_up"),
        ("POST", "/schedules"), ("DELETE", "/schedules/{schedule_id}"),
        ("POST", "/workers"), ("DELETE", "/workers"), ("POST", "/queues/{queue}/claim"),
        ("POST", "/workers/started"), ("POST", "/workers/complete")}
    before = snapshot(sql_conn, serve.sessions)
    with TestClient(serve.app, raise_server_exceptions=False) as http:
        for method, path in mutations:
            url, headers, body = serve.request(method, path)
            for browser in ({"Origin": EVIL}, {"Origin": "null"},
                            {"Sec-Fetch-Site": "cross-site"},
                            {"Origin": "http://testserver:8080"}):
                refused = http.request(method, url, json=body, headers={**headers, **browser})
                assert refused.status_code == 403, (method, path, browser, refused.text)
                assert refused.json()["error"]["code"] == "cross_origin"
    assert snapshot(sql_conn, serve.sessions) == before
    assert job_row(sql_conn, serve.running)["state"] == "running"


def test_every_post_of_belay_serve_needs_json_even_when_empty(serve: Serve,
                                                              sql_conn: Conn) -> None:
    before = snapshot(sql_conn, serve.sessions)
    posts = [path for method, path in serve.mutations() if method == "POST"]
    answers = {}
    with TestClient(serve.app, raise_server_exceptions=False) as http:
        for path in posts:
            url, headers, _ = serve.request("POST", path)
            for content, media in ((b"", None), (b"", FORM), (b"{}", "text/plain"),
                                   (b"x=1", FORM)):
                sent = dict(headers)
                if media is not None:
                    sent["Content-Type"] = media
                answers[(path, content, media)] = http.post(url, content=content,
                                                            headers=sent)
    assert {key: (answer.status_code, answer.text[:80]) for key, answer in answers.items()
            if answer.status_code != 415} == {}
    for answer in answers.values():
        error = answer.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert "send Content-Type: application/json" in error["message"]
    assert snapshot(sql_conn, serve.sessions) == before


def test_without_an_origin_every_mutation_still_works(serve: Serve, sql_conn: Conn) -> None:
    """curl, the SDKs and the HTTP workers send no Origin: their calls go through."""
    done = {}
    with TestClient(serve.app, raise_server_exceptions=False) as http:
        for method, path in serve.mutations():
            if (method, path) == ("DELETE", "/workers"):
                continue  # closes the session the other calls use: last, below
            url, headers, body = serve.request(method, path)
            done[(method, path)] = http.request(method, url, json=body, headers=headers)
        url, headers, _ = serve.request("DELETE", "/workers")
        done[("DELETE", "/workers")] = http.delete(url, headers=headers)
    assert {key: answer.status_code for key, answer in done.items()
            if answer.status_code >= 400} == {}
    assert job_row(sql_conn, serve.running)["state"] == "succeeded"


def test_the_worker_routes_carry_the_rule_wherever_they_are_mounted(client, sql_conn
                                                                    ) -> None:
    """worker_routes() mounted without build_app (and its BrowserGuard)."""
    from starlette.applications import Starlette

    sessions = WorkerSessions(client)
    try:
        with TestClient(Starlette(routes=worker_routes(sessions))) as http:
            forged = http.post("/workers", json={"runtime_id": "r", "tasks": ["t"]},
                               headers={"Origin": EVIL})
            assert forged.status_code == 403
            assert forged.json()["error"]["code"] == "cross_origin"
            form = http.post("/workers", content=b'{"runtime_id": "r", "tasks": ["t"]}',
                             headers={"Content-Type": "text/plain"})
            assert form.status_code == 415
            assert sessions.sessions() == 0
    finally:
        sessions.stop()


def test_the_openapi_document_lists_the_refusals(serve: Serve) -> None:
    with TestClient(serve.app) as http:
        doc = http.get("/openapi.json").json()
    for method, path in serve.mutations():
        responses = doc["paths"][path][method.lower()]["responses"]
        assert "403" in responses, (method, path)
        assert ("415" in responses) == (method == "POST"), (method, path)


# -- the dashboard: the same rule ------------------------------------------------------------


@pytest.mark.parametrize("browser", [
    {"Origin": EVIL}, {"Origin": "null"}, {"Origin": f"http://{HOST}"},
    {"Origin": f"http://{HOST.split(':')[0]}:1"}, {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"}, {"Sec-Fetch-Site": "same-origin"}, {},
])
def test_the_dashboard_and_the_api_draw_the_line_in_the_same_place(
        client, sql_conn, browser: dict[str, str]) -> None:
    """One rule: a request the API refuses as cross-origin, the dashboard refuses
    too, and the other way round (the Host being the same)."""
    dashboard = make_app(client, token=TOKEN)
    job = insert_job(sql_conn)
    reply = call(dashboard, "POST", f"/api/jobs/{job}/cancel", body={},
                 headers={"Authorization": f"Bearer {TOKEN}", **browser})
    with TestClient(build_app(client), base_url=f"http://{HOST}") as http:
        answer = http.delete(f"/jobs/{insert_job(sql_conn)}", headers=browser)
    assert (reply.status == 403) == (answer.status_code == 403), (reply.json, answer.text)
    if reply.status == 403:
        assert re.search(r"cross-origin request refused.*dashboard's own pages",
                         reply.json["error"])


# -- the MCP server's streamable HTTP --------------------------------------------------------


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "test", "version": "1"}}}
MCP_ACCEPT = {"Accept": "application/json, text/event-stream"}


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_the_mcp_http_transport_refuses_a_foreign_origin(client, host: str) -> None:
    """The SDK's own guard checks no Origin off loopback, and lets any loopback
    origin (another local site's page) through on loopback."""
    from belay.mcp_server import build_server, http_app

    app = http_app(build_server(client, ops.Guard(allow=True)), host)
    base = "http://testserver" if host == "0.0.0.0" else "http://127.0.0.1:8765"
    with TestClient(app, base_url=base) as http:
        for browser in ({"Origin": EVIL}, {"Origin": "http://localhost:3000"},
                        {"Origin": "http://127.0.0.1:3000"},
                        {"Sec-Fetch-Site": "cross-site"}):
            forged = http.post("/mcp", json=INITIALIZE, headers={**MCP_ACCEPT, **browser})
            assert forged.status_code == 403, (browser, forged.text)
            assert forged.json()["error"]["code"] == "cross_origin"
            closed = http.delete("/mcp", headers={"mcp-session-id": "x", **browser})
            assert closed.status_code == 403
        form = http.post("/mcp", content=b"{}", headers={**MCP_ACCEPT, "Content-Type": FORM})
        assert form.status_code == 415
        assert form.json()["error"]["code"] == "unsupported_media_type"
        # An MCP client (no Origin), and a page of the server's own origin, go through.
        for own in ({}, {"Origin": base}):
            started = http.post("/mcp", json=INITIALIZE, headers={**MCP_ACCEPT, **own})
            assert started.status_code == 200, (own, started.text)
            assert '"serverInfo"' in started.text
