"""The fuzz/property layer over the operator surfaces: the dashboard's JSON API
(through its WSGI app) and every MCP tool (through the server's own call path,
argument validation included) take hostile text and values from
tests/strategies.py and answer each with a 4xx or a tool error naming the
field, never a 500 or an internal error, and write nothing they refused.

One database per test, not per example: each example compares the rows a
mutation could touch before and after, and removes what an accepted one wrote.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import anyio
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError

import belay
from belay import names, ops
from belay.dashboard import make_app, pages
from belay.mcp_server import build_server
from tests.helpers import insert_job, job_row, signal_rows
from tests.strategies import any_text, deep, hostile_json, hostile_text
from tests.test_dashboard import TOKEN, call

Conn = psycopg.Connection[Any]

FUZZ = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def unstorable(text: str) -> bool:
    """Whether belay must refuse ``text`` as a name (after the strip a query gets)."""
    text = text.strip()
    return (names.text_problem(text) is not None
            or len(text.encode("utf-8", "surrogatepass")) > names.MAX_NAME_BYTES)


#: Text no name may be: a NUL, a lone surrogate, or over 255 bytes.
bad_names = hostile_text().filter(unstorable)

#: Values no id, seq or limit may be, however a surface receives them.
bad_integers = st.one_of(
    hostile_text(min_size=1),
    st.sampled_from(["\u00b2", "\u0663", "1_0", "1e3", "0x10", "+1", "-1", "", " "]),
    st.booleans(), st.floats(allow_nan=True), st.integers(max_value=-1),
    st.integers(min_value=2**63, max_value=2**200), st.none().map(lambda _: [1]),
)


def json_text(value: Any) -> str:
    """``value`` as JSON text, however deep (json.dumps recurses), with NaN and
    infinities as Python writes them and lone surrogates as ``\\udXXX`` escapes."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Raw):
            out.append(item.text)
        elif isinstance(item, dict):
            parts: list[Any] = [_Raw("{")]
            for index, (key, child) in enumerate(item.items()):
                parts += [_Raw(("," if index else "") + json.dumps(key) + ":"), child]
            stack.extend(reversed([*parts, _Raw("}")]))
        elif isinstance(item, list):
            parts = [_Raw("[")]
            for index, child in enumerate(item):
                parts += [_Raw(","), child] if index else [child]
            stack.extend(reversed([*parts, _Raw("]")]))
        else:
            out.append(json.dumps(item))
    return "".join(out)


class _Raw:
    def __init__(self, text: str) -> None:
        self.text = text


def wire(text: str) -> str:
    """``text`` percent-encoded as a browser would, lone surrogates as the bytes
    of their (invalid) UTF-8, the way ``%ED%A0%80`` arrives."""
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


def snapshot(conn: Conn, job: int) -> Any:
    return job_row(conn, job), signal_rows(conn)


def numbers_as_floats(value: Any) -> Any:
    """``value`` with every number a float: jsonb keeps a number as its shortest
    decimal, so -1.7976931348623157e308 comes back as an int of 309 digits."""
    if isinstance(value, dict):
        return {k: numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [numbers_as_floats(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def stored(conn: Conn, before: list[dict[str, Any]]) -> Any:
    """The payload of the one signal row written since ``before``; clears them."""
    [row] = [r for r in signal_rows(conn) if r not in before]
    conn.execute("DELETE FROM belay_signals")
    return numbers_as_floats(row["payload"])


# -- The dashboard's JSON API --------------------------------------------------------------


@pytest.fixture
def dash(client: belay.Belay, sql_conn: Conn) -> Iterator[tuple[Any, int]]:
    yield make_app(client, token=TOKEN), insert_job(sql_conn)


def api_error(reply: Any) -> str:
    assert reply.status != 500, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    return str(reply.json.get("error", ""))


@FUZZ
@given(param=st.sampled_from(["queue", "kind", "workflow", "state", "parent", "before_id",
                              "limit"]),
       value=hostile_text())
def test_a_hostile_list_parameter_is_a_400_naming_it(dash, sql_conn, param, value):
    app, job = dash
    before = snapshot(sql_conn, job)
    reply = call(app, "GET", "/api/jobs", query=f"{param}={wire(value)}")
    error = api_error(reply)
    text_filter = param in ("queue", "kind", "workflow")
    if text_filter and not unstorable(value):
        assert reply.status == 200, error  # "²" or U+202E is a name like any other
    elif value.strip() or param in ("before_id", "limit"):
        assert reply.status == 400 and param in error, (reply.status, error)
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(query=st.dictionaries(st.one_of(st.sampled_from([*pages.FILTERS, "before_id", "limit",
                                                        "id"]), any_text()),
                             any_text(), max_size=4))
def test_any_query_string_is_answered_without_a_500(dash, sql_conn, query):
    app, job = dash
    before = snapshot(sql_conn, job)
    encoded = "&".join(f"{wire(k)}={wire(v)}" for k, v in query.items())
    for path in ("/api/jobs", "/api/workflow", "/api/overview"):
        reply = call(app, "GET", path, query=encoded)
        error = api_error(reply)
        assert reply.status in (200, 400, 404), (path, reply.status, error)
        if reply.status == 400:
            assert any(name in error for name in (*pages.FILTERS, "before_id", "limit", "id"))
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(segment=hostile_text(min_size=1), action=st.sampled_from(["", "/cancel", "/signal"]))
def test_a_hostile_path_segment_is_a_400_naming_it(dash, sql_conn, segment, action):
    app, job = dash
    before = snapshot(sql_conn, job)
    path = b"/api/jobs/" + segment.encode("utf-8", "surrogatepass") + action.encode()
    reply = call(app, "POST" if action else "GET", path, body={} if action else None,
                 headers={"Authorization": f"Bearer {TOKEN}"})
    error = api_error(reply)
    if "/" in segment:
        assert reply.status in (400, 404, 405), error
    else:
        assert reply.status == 400 and ("the path" in error or "job id" in error), error
    assert snapshot(sql_conn, job) == before


def post_json(app: Any, job: int, action: str, text: str) -> Any:
    return call(app, "POST", f"/api/jobs/{job}/{action}",
                body=text.encode("utf-8", "surrogatepass"),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})


@FUZZ
@given(name=bad_names)
def test_a_hostile_signal_name_is_a_400_naming_it(dash, sql_conn, name):
    app, job = dash
    before = snapshot(sql_conn, job)
    error = api_error(reply := post_json(app, job, "signal", json_text({"name": name})))
    assert reply.status == 400 and "name" in error, error
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(action=st.sampled_from(["signal", "steer"]), value=hostile_json(),
       wrap=st.booleans())
def test_a_hostile_payload_is_refused_by_name_or_stored_exactly(
        dash, sql_conn, action, value, wrap):
    app, job = dash
    before = snapshot(sql_conn, job)
    payload = {"v": value} if wrap else value
    body = {"name": "go", "payload": payload} if action == "signal" else {"payload": payload}
    reply = post_json(app, job, action, json_text(body))
    error = api_error(reply)
    if reply.status == 200:
        assert stored(sql_conn, before[1]) == numbers_as_floats(payload or {})
    else:
        assert reply.status == 400 and ("payload" in error or "steering" in error), error
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(action=st.sampled_from(["cancel", "retry", "signal", "steer"]),
       body=st.dictionaries(any_text(), hostile_json(), min_size=1, max_size=3))
def test_unknown_or_hostile_body_fields_are_refused(dash, sql_conn, action, body):
    app, job = dash
    before = snapshot(sql_conn, job)
    takes = {"signal": {"name", "payload"}, "steer": {"payload"}}.get(action, set())
    body = {key: value for key, value in body.items() if key not in takes} or {"\x00": 1}
    reply = post_json(app, job, action, json_text(body))
    error = api_error(reply)
    assert reply.status == 400, error
    assert "unknown argument" in error or "job_id" in error or "nests deeper" in error, error
    assert snapshot(sql_conn, job) == before


# -- Every MCP tool ------------------------------------------------------------------------


@pytest.fixture
def mcp(client: belay.Belay, sql_conn: Conn) -> Iterator[tuple[Any, int]]:
    yield build_server(client, ops.Guard(allow=True)), insert_job(sql_conn)


def tool_error(server: Any, tool: str, args: dict[str, Any]) -> str | None:
    """The tool error's text, or None when the call succeeded; never a crash."""
    async def run() -> Any:
        return await server.call_tool(tool, args)
    try:
        anyio.run(run)
    except UnexpectedToolError as exc:  # the SDK's "internal error"
        raise AssertionError(f"{tool}{args!r:.200} crashed: {exc.__cause__!r}") from exc
    except ToolError as exc:
        return str(exc)
    return None


@FUZZ
@given(tool=st.sampled_from(["get_job", "retry_job", "cancel_job", "job_events", "signal",
                             "steer_job"]),
       job_id=bad_integers)
def test_every_tool_refuses_a_hostile_job_id_by_name(mcp, sql_conn, tool, job_id):
    server, job = mcp
    before = snapshot(sql_conn, job)
    args = {"job_id": job_id, "name": "go", "payload": {}}
    args = {k: v for k, v in args.items() if k == "job_id" or tool in ("signal", "steer_job")}
    if tool == "steer_job":
        del args["name"]
    error = tool_error(server, tool, args)
    assert error is not None and "job_id" in error, error
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(arg=st.sampled_from(["queue", "kind", "workflow_id", "state", "parent_id", "before_id",
                            "limit"]),
       text=bad_names, number=bad_integers)
def test_list_jobs_refuses_each_hostile_filter_by_name(mcp, sql_conn, arg, text, number):
    server, _ = mcp
    value = text if arg in ("queue", "kind", "workflow_id", "state") else number
    if value is None:
        return
    error = tool_error(server, "list_jobs", {arg: value})
    assert error is not None and arg in error, error


@FUZZ
@given(arg=st.sampled_from(["after", "limit"]), number=bad_integers,
       workflow_id=bad_names)
def test_job_events_and_workflow_status_refuse_hostile_arguments(
        mcp, sql_conn, arg, number, workflow_id):
    server, job = mcp
    if number is not None:
        error = tool_error(server, "job_events", {"job_id": job, arg: number})
        assert error is not None and arg in error, error
    error = tool_error(server, "workflow_status", {"workflow_id": workflow_id})
    assert error is not None and "workflow_id" in error, error


@FUZZ
@given(name=bad_names)
def test_signal_refuses_a_hostile_name(mcp, sql_conn, name):
    server, job = mcp
    before = snapshot(sql_conn, job)
    error = tool_error(server, "signal", {"job_id": job, "name": name})
    assert error is not None and "name" in error, error
    assert snapshot(sql_conn, job) == before


@FUZZ
@given(tool=st.sampled_from(["signal", "steer_job"]), value=hostile_json(),
       wrap=st.booleans())
def test_signal_and_steer_refuse_a_hostile_payload_by_name_or_store_it_exactly(
        mcp, sql_conn, tool, value, wrap):
    server, job = mcp
    before = snapshot(sql_conn, job)
    payload = {"v": value} if wrap else value
    args = {"job_id": job, "payload": payload, **({"name": "go"} if tool == "signal" else {})}
    error = tool_error(server, tool, args)
    if error is None:
        assert stored(sql_conn, before[1]) == numbers_as_floats(payload or {})
    else:
        assert "payload" in error, error
    assert snapshot(sql_conn, job) == before


def test_a_payload_nested_2000_deep_is_refused_by_every_surface(dash, mcp, sql_conn):
    app, job = dash
    server, _ = mcp
    before = snapshot(sql_conn, job)
    for depth in (65, 2_000, 10_000):
        steer = {"payload": {"a": deep(depth)}}
        reply = post_json(app, job, "steer", json_text(steer))
        assert reply.status == 400 and "payload nests deeper than 64" in api_error(reply)
        error = tool_error(server, "steer_job", {"job_id": job, **steer})
        assert error is not None and "payload nests deeper than 64" in error
        error = tool_error(server, "signal", {"job_id": job, "name": "go", **steer})
        assert error is not None and "payload nests deeper than 64" in error
    assert snapshot(sql_conn, job) == before
