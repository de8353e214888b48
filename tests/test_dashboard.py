"""The web dashboard, driven in-process through its WSGI app on a real PostgreSQL.

Requests are WSGI environ dicts handed to ``make_app``'s application (no
server, no mocks); jobs are made by a real worker, the belay client or raw
SQL, and what the dashboard writes is read back from the database. The
pure DAG layout is checked on its own. ``belay dashboard`` itself runs once
as a subprocess. The browser's view is tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from wsgiref.util import setup_testing_defaults

import psycopg
import pytest

import belay
from belay import ops
from belay.dashboard import dag, make_app, pages
from belay.dashboard.markup import Safe, escape
from belay.testing import drain
from tests.helpers import insert_job, job_row, signal_rows
from tests.test_spend import agents, seeded

HOST = "127.0.0.1:8766"
TOKEN = "s3cret-token-for-tests"
P_SCRIPT = "<script>alert('xss-script')</script>"
P_IMG = "\"'><img src=x onerror=alert('xss-img')>"
P_SVG = "<svg onload=alert('xss-svg')>"
PAYLOADS = (P_SCRIPT, P_IMG, P_SVG)
STATIC = Path(__file__).resolve().parent.parent / "belay" / "dashboard" / "static"


class Reply:
    def __init__(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status = int(status.split()[0])
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode()

    @property
    def json(self) -> Any:
        assert self.headers["content-type"].startswith("application/json"), self.headers
        return json.loads(self.body)


def call(app: Any, method: str, path: str | bytes, *, query: str = "", body: Any = None,
         headers: Mapping[str, str] | None = None, script_name: str = "") -> Reply:
    """One request through the WSGI app; ``body`` (not bytes) is sent as JSON.
    A ``bytes`` path is the raw, percent-decoded path a server puts in PATH_INFO."""
    environ: dict[str, Any] = {}
    setup_testing_defaults(environ)
    raw = body if isinstance(body, bytes) else (b"" if body is None else
                                                json.dumps(body).encode())
    environ.update({
        "REQUEST_METHOD": method,
        "PATH_INFO": (path if isinstance(path, bytes) else path.encode()).decode("latin-1"),
        "SCRIPT_NAME": script_name, "QUERY_STRING": query, "HTTP_HOST": HOST,
        "wsgi.input": io.BytesIO(raw), "CONTENT_LENGTH": str(len(raw)),
    })
    if body is not None and not isinstance(body, bytes):
        environ["CONTENT_TYPE"] = "application/json"
    for name, value in (headers or {}).items():
        key = name.upper().replace("-", "_")
        environ[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value
    seen: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, response_headers

    chunks = app(environ, start_response)
    return Reply(seen["status"], seen["headers"], b"".join(chunks))


def post(app: Any, job_id: int, action: str, body: Any = None, *,
         token: str | None = None, **headers: str) -> Reply:
    sent = dict(headers)
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    return call(app, "POST", f"/api/jobs/{job_id}/{action}", body={} if body is None else body,
                headers=sent)


def ids(page: str, table: str = "") -> list[int]:
    """The job ids of a page's job rows (of one table, when ``table`` names its tbody)."""
    if table:
        match = re.search(rf'<tbody id="{table}">(.*?)</tbody>', page, re.S)
        assert match, f"no table {table}"
        page = match[1]
    return [int(i) for i in re.findall(r'<tr data-id="(\d+)">', page)]


# -- Seeds (the browser tests use them too) ------------------------------------------------


def agent_workflow(client: belay.Belay) -> dict[str, int]:
    """A workflow run by a real worker: gather → (draft, check, images) → publish.
    gather and draft journal steps with costs and emit events, check fails,
    images has no worker (ready), publish stays held. Member → job id."""
    registry = belay.Registry()

    @belay.worker(name="research.gather", queue="agents", registry=registry)
    def gather(ctx: belay.Context) -> dict[str, int]:
        ctx.step("search", lambda: {"hits": 14}, cost=belay.Cost(usd=0.0021, tokens=850))
        ctx.emit({"turn": 1, "summary": "found 14 sources"})
        ctx.step("summarize", lambda: {"notes": "otters hold hands"},
                 cost=belay.Cost(usd=0.0184, tokens=6120))
        ctx.emit({"turn": 2, "summary": "summarized"})
        return {"notes": 14}

    @belay.worker(name="research.draft", queue="agents", registry=registry)
    def draft(ctx: belay.Context) -> dict[str, int]:
        ctx.step("write", lambda: {"words": 812}, cost=belay.Cost(usd=0.0391, tokens=11840))
        return {"words": 812}

    @belay.worker(name="research.check", queue="agents", max_attempts=1, registry=registry)
    def check(ctx: belay.Context) -> None:
        raise ValueError("claim 3 has no source")

    wf = (belay.Workflow("report", workflow_id="report-1")
          .add("gather", gather, {"topic": "sea otters"})
          .add("draft", draft, deps=["gather"])
          .add("check", check, deps=["gather"])
          .add("images", "research.images", deps=["gather"], queue="media")
          .add("publish", "research.publish", deps=["draft", "check", "images"],
               ignore=["failed"]))
    jobs = client.enqueue_workflow(wf)
    belay.Worker({"agents": 2}, client=client, registry=registry).drain()
    return {name: job.id for name, job in jobs.items()}


def hostile_job(client: belay.Belay) -> int:
    """A failed job whose every rendered field is an XSS payload: kind, queue,
    input, meta, step names and values, events, errors, workflow id and name."""
    registry = belay.Registry()

    @belay.worker(name=P_IMG, queue=P_SVG, max_attempts=1, registry=registry)
    def hostile(ctx: belay.Context) -> None:
        ctx.step(P_SCRIPT, lambda: {P_IMG: P_SVG}, cost=belay.Cost(usd=0.5, tokens=7))
        ctx.emit({"html": P_IMG, P_SCRIPT: [P_SVG]})
        raise RuntimeError(P_SCRIPT)

    wf = belay.Workflow("x", workflow_id=P_IMG).add(P_SVG, hostile, {P_SCRIPT: P_IMG},
                                                     meta={"note": P_SVG})
    job_id = client.enqueue_workflow(wf)[P_SVG].id
    belay.Worker({P_SVG: 1}, client=client, registry=registry).drain()
    return job_id


# -- Fixtures --------------------------------------------------------------------------------


@pytest.fixture
def app(client: belay.Belay) -> Any:
    """Read-only: no token, no authorizer."""
    return make_app(client)


@pytest.fixture
def token_app(client: belay.Belay) -> Any:
    return make_app(client, token=TOKEN)


# -- Pages ------------------------------------------------------------------------------------


def test_the_overview_shows_a_tile_per_queue_with_counts_options_and_the_last_minute(
        client, sql_conn, app):
    client.put_queue("agents", limit=4, global_limit=8, rate={"allowed": 30, "period": 60},
                     partition={"input": "tenant"})
    client.put_queue("mailers", limit={"min": 1, "max": 3})
    client.pause_queue("mailers")
    members = agent_workflow(client)
    for _ in range(3):
        insert_job(sql_conn, queue="mailers", kind="mail.send")
    page = call(app, "GET", "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")

    def tile(queue: str) -> str:
        match = re.search(rf'<section class="tile" data-queue="{queue}">(.*?)</section>',
                          page.text, re.S)
        assert match, f"no tile for {queue}"
        return match[1]

    def count(queue: str, state: str) -> int:
        found = re.search(rf"<b>(\d+)</b><span>{state}</span>", tile(queue))
        assert found
        return int(found[1])

    # gather and draft succeeded, check failed (all on agents); images ready on media.
    assert [count("agents", s) for s in ("succeeded", "failed", "ready")] == [2, 1, 0]
    assert count("media", "ready") == 1 and count("default", "held") == 1
    assert count("mailers", "ready") == 3
    agents = tile("agents")
    for shown in ("<dt>limit</dt><dd>4</dd>", "<dt>global</dt><dd>8</dd>",
                  "<dd>30 / 60s</dd>", "<dd>input.tenant</dd>"):
        assert shown in agents
    assert "last minute: <b>2</b> succeeded · <b>1</b> failed" in agents
    # Every agents job finished: their spend is in the jobs, the tile shows none.
    assert "unfinished jobs spent $0.0000 · 0 tokens" in agents
    assert "badge paused" in tile("mailers") and "badge paused" not in agents
    assert "<dd>1 to 3</dd>" in tile("mailers")
    assert "static options" in tile("media")  # no belay_queues row
    assert set(ids(page.text, "recent")) >= set(members.values())
    # The counts link to the filtered list.
    assert 'href="/jobs?queue=agents&amp;state=failed"' in agents

    data = call(app, "GET", "/api/overview").json
    assert data["queues"] == ops.jsonable(ops.queue_overview(client))
    assert [j["id"] for j in data["recent"]] == [j.id for j in client.list_jobs(limit=15)]


def test_the_jobs_list_filters_by_queue_state_kind_workflow_and_parent(client, sql_conn, app):
    members = agent_workflow(client)
    a = insert_job(sql_conn, queue="mailers", kind="mail.send")
    b = insert_job(sql_conn, queue="mailers", kind="mail.digest", state="failed")
    kid = insert_job(sql_conn, kind="child.kind", parent_id=a)
    everyone = sorted([*members.values(), a, b, kid], reverse=True)
    cases = {
        "": everyone,
        "queue=mailers": [b, a],
        "state=failed": [b, members["check"]],
        "kind=mail.send": [a],
        "workflow=report-1": sorted(members.values(), reverse=True),
        "parent=" + str(a): [kid],
        "queue=agents&state=succeeded": [members["draft"], members["gather"]],
    }
    for query, expected in cases.items():
        page = call(app, "GET", "/jobs", query=query)
        assert page.status == 200, page.text
        assert ids(page.text, "jobs") == expected, query
        api = call(app, "GET", "/api/jobs", query=query).json
        assert [j["id"] for j in api["jobs"]] == expected, query
    # The form keeps the filters it shows.
    page = call(app, "GET", "/jobs", query="kind=mail.send&state=failed").text
    assert '<input name="kind" value="mail.send"' in page
    assert '<option value="failed" selected>' in page


def test_the_jobs_list_pages_with_before_id(client, sql_conn, app):
    made = [insert_job(sql_conn, kind=f"k.{i}") for i in range(pages_size() + 3)]
    first = call(app, "GET", "/jobs").text
    assert ids(first, "jobs") == sorted(made, reverse=True)[:pages_size()]
    older = re.search(r'<a class="more" href="([^"]+)">older', first)
    assert older, "no link to older jobs"
    before = re.search(r"before_id=(\d+)", html.unescape(older[1]))
    assert before and int(before[1]) == sorted(made, reverse=True)[pages_size() - 1]
    second = call(app, "GET", "/jobs", query=f"before_id={before[1]}").text
    assert ids(second, "jobs") == sorted(made, reverse=True)[pages_size():]
    assert "older →" not in second and "← newest" in second
    api = call(app, "GET", "/api/jobs", query="limit=2").json
    assert [j["id"] for j in api["jobs"]] == sorted(made, reverse=True)[:2]
    nxt = call(app, "GET", "/api/jobs", query=f"limit=2&before_id={api['next_before_id']}")
    assert [j["id"] for j in nxt.json["jobs"]] == sorted(made, reverse=True)[2:4]


def pages_size() -> int:
    from belay.dashboard.app import PAGE_SIZE

    return PAGE_SIZE


@pytest.mark.parametrize(("query", "says"), [
    ("state=bogus", "unknown state 'bogus'"),
    ("parent=abc", "parent is a job id"),
    ("before_id=-3", "before_id is a job id"),
    ("kind=a%00b", "kind contains a NUL character"),
    # str.isdigit() takes these and int() refuses "²" (a 500) or reads "٣" as 3.
    ("before_id=%C2%B2", "before_id is a job id"),
    ("parent=%C2%B2", "parent is a job id"),
    ("before_id=%D9%A3", "before_id is a job id"),
    ("limit=%C2%B2", "limit is an integer from 1 to 500"),
    ("limit=%D9%A3", "limit is an integer from 1 to 500"),
    ("before_id=99999999999999999999999", "before_id is a job id"),
    # The UTF-8 of a surrogate is not UTF-8: refused, not read as U+FFFD.
    ("kind=%ED%A0%80", "kind contains a lone surrogate"),
    ("queue=%FF", "queue contains a lone surrogate"),
    ("workflow=" + "w" * 256, "workflow is 256 bytes long; the limit is 255"),
    ("state=%00", "unknown state"),
])
def test_a_bad_filter_is_a_400_naming_the_problem(app, query, says):
    page = call(app, "GET", "/jobs", query=query)
    if not query.startswith("limit="):  # the page has no limit
        assert page.status == 400 and says in html.unescape(page.text)
    api = call(app, "GET", "/api/jobs", query=query)
    assert api.status == 400 and says in api.json["error"]


def test_a_jobs_page_shows_its_journal_costs_events_errors_children_and_the_dag(
        client, sql_conn, app):
    members = agent_workflow(client)
    gather = members["gather"]
    kid = insert_job(sql_conn, kind="child.kind", parent_id=gather, state="succeeded")
    page = call(app, "GET", f"/jobs/{gather}")
    assert page.status == 200
    text = page.text
    steps = re.search(r'<tbody id="steps">(.*?)</tbody>', text, re.S)
    assert steps
    rows = re.findall(r'<td>(\d+)</td><td class="kind">([^<]+)</td><td><pre>(.*?)</pre></td>'
                      r'<td class="num">([^<]+)</td><td class="num">(\d+)</td>', steps[1])
    assert rows == [
        ("1", "search", html.escape('{"hits": 14}'), "$0.0021", "850"),
        ("2", "summarize", html.escape('{"notes": "otters hold hands"}'), "$0.0184", "6120"),
    ]
    assert '<td class="num" id="journal-usd">$0.0205</td>' in text
    assert '<td class="num" id="journal-tokens">6970</td>' in text
    events = re.search(r'<tbody id="events">(.*?)</tbody>', text, re.S)
    assert events and html.escape('"summary": "found 14 sources"') in events[1]
    assert html.escape('"summary": "summarized"') in events[1]
    assert ids(text, "children") == [kid]
    assert '<span id="job-state"><span class="badge st-succeeded">succeeded</span>' in text
    assert html.escape('{"topic": "sea otters"}') in text  # input
    assert html.escape('{"notes": 14}') in text  # result

    # The workflow as a graph: a node per member coloured by state, an edge per dep.
    svg = re.search(r"<svg class=\"dag\".*?</svg>", text, re.S)
    assert svg
    nodes = {name: cls for cls, name in
             re.findall(r'<g class="node (st-\w+)[^"]*" data-name="(\w+)"', svg[0])}
    assert nodes == {"gather": "st-succeeded", "draft": "st-succeeded", "check": "st-failed",
                     "images": "st-ready", "publish": "st-held"}
    edges = set(re.findall(r'data-from="(\w+)" data-to="(\w+)"', svg[0]))
    assert edges == {("gather", "draft"), ("gather", "check"), ("gather", "images"),
                     ("draft", "publish"), ("check", "publish"), ("images", "publish")}
    assert re.search(r'<g class="node st-succeeded current" data-name="gather"', svg[0])

    # The failed member's error.
    failed = call(app, "GET", f"/jobs/{members['check']}").text
    errors = re.search(r'<ol id="errors" class="errors">(.*?)</ol>', failed, re.S)
    assert errors and "ValueError: claim 3 has no source" in errors[1]
    assert "attempt 1" in errors[1]

    detail = call(app, "GET", f"/api/jobs/{gather}").json
    assert detail == ops.jsonable(ops.job_detail(client, gather))
    assert detail["journal_cost"] == {"usd": 0.0205, "tokens": 6970}


def test_the_workflow_page_shows_members_counts_and_the_graph(client, app):
    members = agent_workflow(client)
    page = call(app, "GET", "/workflow", query="id=report-1")
    assert page.status == 200
    assert '<svg class="dag"' in page.text
    rows = re.findall(r'<tr><td class="kind">(\w+)</td><td><a href="/jobs/(\d+)">',
                      page.text)
    assert {name: int(i) for name, i in rows} == members
    assert "1 failed" in page.text and "2 succeeded" in page.text
    assert "in progress" in page.text
    view = call(app, "GET", "/api/workflow", query="id=report-1").json
    assert view["edges"] and view["total"] == 5 and view["done"] is False


@pytest.mark.parametrize(("path", "query", "status", "says"), [
    ("/jobs/999999", "", 404, "job 999999 does not exist"),
    ("/api/jobs/999999", "", 404, "job 999999 does not exist"),
    ("/workflow", "id=nope", 404, "workflow 'nope' has no jobs"),
    ("/api/workflow", "", 400, "?id=<workflow id>"),
    ("/nowhere", "", 404, "nothing at /nowhere"),
    ("/static/../app.py", "", 404, "nothing at"),
])
def test_unknown_things_are_named(app, path, query, status, says):
    reply = call(app, "GET", path, query=query)
    assert reply.status == status
    text = reply.json["error"] if path.startswith("/api/") else html.unescape(reply.text)
    assert says in text


def test_static_files_are_served_and_the_script_never_writes_markup(app):
    css = call(app, "GET", "/static/dashboard.css")
    assert css.status == 200 and css.headers["content-type"].startswith("text/css")
    js = call(app, "GET", "/static/dashboard.js")
    assert js.status == 200 and js.headers["content-type"].startswith("text/javascript")
    script = js.text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in script, sink
    assert "textContent" in script and "createElement" in script


def test_pages_have_no_inline_script_or_style(client, app):
    members = agent_workflow(client)
    for path, query in (("/", ""), ("/jobs", ""), (f"/jobs/{members['gather']}", ""),
                        ("/workflow", "id=report-1")):
        text = call(app, "GET", path, query=query).text
        assert re.findall(r"<script[^>]*>", text) == ['<script src="/static/dashboard.js" defer>']
        assert "<style" not in text and " style=" not in text
        assert not re.search(r"\son[a-z]+=", text)  # no event-handler attributes


# -- Escaping -------------------------------------------------------------------------------


def test_every_page_escapes_job_data(client, app):
    job_id = hostile_job(client)
    row = client.get_job(job_id)
    assert row is not None and row.kind == P_IMG and row.state == "failed"
    assert client.steps(job_id)[0].name == P_SCRIPT
    replies = {
        "overview": call(app, "GET", "/"),
        "jobs": call(app, "GET", "/jobs", query=f"kind={P_IMG}"),
        "job": call(app, "GET", f"/jobs/{job_id}"),
        "workflow": call(app, "GET", "/workflow", query="id=" + urlquote(P_IMG)),
    }
    for name, reply in replies.items():
        assert reply.status == 200, name
        text = reply.text
        for raw in ("<script>alert", "<img", "<svg onload"):
            assert raw not in text, (name, raw)
        assert html.escape(P_IMG) in text, name  # shown, as text
    job_page = replies["job"].text
    assert html.escape(P_SCRIPT) in job_page  # the step name and the error
    assert html.escape(P_SVG) in job_page  # the queue, the member name, the meta
    # Attributes too: the member name in the DAG's data-name, the filter in the form.
    assert f'data-name="{html.escape(P_SVG)}"' in job_page
    assert f'value="{html.escape(P_IMG)}"' in replies["jobs"].text
    for path, shown in (("/api/overview", P_IMG), (f"/api/jobs/{job_id}", P_SCRIPT)):
        body = call(app, "GET", path).text
        assert "<" not in body  # "<" travels as \u003c
        assert shown in json.dumps(json.loads(body), ensure_ascii=False)  # the same text


def urlquote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def test_markup_escapes_everything_but_safe():
    assert escape(P_IMG) == "&quot;&#x27;&gt;&lt;img src=x onerror=alert(&#x27;xss-img&#x27;)&gt;"
    assert escape(Safe("<b>")) == "<b>"
    assert escape(None) == ""
    assert pages.Page(base="/ops").url("/jobs", queue="a&b", state="") == "/ops/jobs?queue=a%26b"


# -- Mutations ------------------------------------------------------------------------------


def test_read_only_shows_no_actions_and_refuses_every_post(client, sql_conn, app):
    failed = insert_job(sql_conn, state="failed", attempt=1, max_attempts=1)
    ready = insert_job(sql_conn)
    page = call(app, "GET", f"/jobs/{ready}").text
    assert "data-action" not in page and "signal-form" not in page and "token-form" not in page
    assert 'data-auth="none"' in page and "read-only" in page
    before = (job_row(sql_conn, failed), job_row(sql_conn, ready))
    for job_id, action, body in ((failed, "retry", {}), (ready, "cancel", {}),
                                 (ready, "signal", {"name": "go"}),
                                 (ready, "steer", {"payload": {"instruction": "stop"}})):
        reply = post(app, job_id, action, body)
        assert reply.status == 403, action
        assert "read-only" in reply.json["error"] and "--token-file" in reply.json["error"]
        assert "--authorizer" in reply.json["error"]
    assert (job_row(sql_conn, failed), job_row(sql_conn, ready)) == before
    assert signal_rows(sql_conn) == []


def test_a_token_is_required_and_checked(client, sql_conn, token_app):
    ready = insert_job(sql_conn)
    page = call(token_app, "GET", f"/jobs/{ready}").text
    assert 'data-auth="token"' in page and 'id="token-form"' in page
    assert 'data-action="cancel"' in page and 'data-action="retry"' in page
    assert TOKEN not in page  # the page asks for it; it never carries it

    missing = post(token_app, ready, "cancel")
    assert missing.status == 401 and "Authorization: Bearer" in missing.json["error"]
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong = post(token_app, ready, "cancel", token="not-" + TOKEN)
    assert wrong.status == 401 and "wrong token" in wrong.json["error"]
    basic = post(token_app, ready, "cancel", Authorization=f"Basic {TOKEN}")
    assert basic.status == 401
    assert job_row(sql_conn, ready)["state"] == "ready"

    ok = post(token_app, ready, "cancel", token=TOKEN)
    assert ok.status == 200 and ok.json == {"ok": True, "action": "cancel_job",
                                            "job_id": ready, "status": "cancelled"}
    assert job_row(sql_conn, ready)["state"] == "cancelled"

    retried = post(token_app, ready, "retry", token=TOKEN)
    assert retried.status == 200 and retried.json["job"]["state"] == "ready"
    assert job_row(sql_conn, ready)["state"] == "ready"

    signal = post(token_app, ready, "signal", {"name": "approve", "payload": {"by": "ops"}},
                  token=TOKEN)
    assert signal.status == 200 and signal.json["signal"] == "approve"
    steer = post(token_app, ready, "steer", {"payload": {"instruction": "be brief"}},
                 token=TOKEN)
    assert steer.status == 200 and steer.json["steered"] is True
    delivered = {(r["scope"], r["name"]): r["payload"] for r in signal_rows(sql_conn)}
    assert delivered[(f"job:{ready}", "approve")] == {"by": "ops"}
    assert {"instruction": "be brief"} in delivered.values()


def test_a_post_from_another_origin_is_refused_even_with_the_token(sql_conn, token_app):
    ready = insert_job(sql_conn)
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Origin": "http://127.0.0.1:9999"}, {"Sec-Fetch-Site": "cross-site"}):
        reply = post(token_app, ready, "cancel", token=TOKEN, **headers)
        assert reply.status == 403 and "refused" in reply.json["error"], headers
    assert job_row(sql_conn, ready)["state"] == "ready"
    same = post(token_app, ready, "cancel", token=TOKEN, Origin=f"http://{HOST}",
                **{"Sec-Fetch-Site": "same-origin"})
    assert same.status == 200 and job_row(sql_conn, ready)["state"] == "cancelled"


def test_an_action_is_json_or_nothing(sql_conn, token_app):
    ready = insert_job(sql_conn)
    form = call(token_app, "POST", f"/api/jobs/{ready}/cancel", body=b"x=1",
                headers={"Content-Type": "application/x-www-form-urlencoded",
                         "Authorization": f"Bearer {TOKEN}"})
    assert form.status == 415 and "application/json" in form.json["error"]
    broken = call(token_app, "POST", f"/api/jobs/{ready}/cancel", body=b"{nope",
                  headers={"Content-Type": "application/json",
                           "Authorization": f"Bearer {TOKEN}"})
    assert broken.status == 400 and "not valid JSON" in broken.json["error"]
    assert post(token_app, ready, "cancel", [1], token=TOKEN).status == 400
    assert job_row(sql_conn, ready)["state"] == "ready"


@pytest.mark.parametrize(("action", "body", "status", "says"), [
    ("signal", {}, 400, "signal needs name"),
    ("signal", {"name": "go", "payload": [1]}, 400, "a signal payload is a JSON object"),
    ("steer", {"payload": "stop"}, 400, "steering is a JSON object"),
    ("signal", {"name": "go\u0000"}, 400, "name (the signal name) contains a NUL"),
    ("signal", {"name": "g" * 256}, 400, "name (the signal name) is 256 bytes long"),
    ("signal", {"name": "go", "payload": {"a": ["\u0000"]}}, 400,
     "payload['a'][0] contains a NUL character"),
    ("signal", {"name": "go", "payload": {"\u0000": 1}}, 400, "payload has a key that contains"),
    ("signal", {"name": "go", "payload": None, "extra": 1}, 400, "unknown argument(s) 'extra'"),
    ("signal", {"name": "$steer"}, 400, "reserved for belay"),
    ("cancel", {"job_id": 1}, 400, "job_id is not a body field"),
    ("signal", b'{"name": "\\ud800"}', 400, "name (the signal name) contains a lone surrogate"),
    ("signal", b'{"name": "go", "payload": {"a": NaN}}', 400, "payload['a'] is nan"),
    ("steer", b'{"payload": {"a": -Infinity}}', 400, "payload['a'] is -inf"),
    ("steer", b'{"payload": {"a": 1e999}}', 400, "payload['a'] is inf"),
    ("steer", b'{"payload": {"a": "\\udfff"}}', 400, "payload['a'] contains a lone surrogate"),
    ("steer", b'{"payload": {"x": 1}}\xff', 400, "not valid UTF-8"),
    # Nested 2,000 deep: json.loads would recurse past Python's limit (a 500).
    ("steer", b'{"payload": {"a": ' + b"[" * 2000 + b"]" * 2000 + b"}}", 400,
     "payload nests deeper than 64 levels"),
    ("steer", b'{"payload": {"a": ' + b"[" * 64 + b"]" * 64 + b"}}", 400,
     "payload nests deeper than 64 levels"),
    ("signal", b'{"name": "go", "payload": {"\\"[{": ' + b"[" * 100 + b"]" * 100 + b"}}", 400,
     "payload nests deeper than 64 levels"),
    ("signal", b"[" * 3000 + b"]" * 3000, 400, "the request body nests deeper than 64"),
    ("retry", {}, 409, "only failed or cancelled jobs can be retried"),
    ("explode", {}, 404, "no action at POST"),
])
def test_bad_actions_are_refused_with_a_reason(sql_conn, token_app, action, body, status, says):
    ready = insert_job(sql_conn)
    headers = {"Content-Type": "application/json"} if isinstance(body, bytes) else {}
    reply = post(token_app, ready, action, body, token=TOKEN, **headers)
    assert reply.status == status and says in reply.json["error"]
    assert job_row(sql_conn, ready)["state"] == "ready" and signal_rows(sql_conn) == []


def test_a_payload_63_levels_deep_is_taken(sql_conn, token_app):
    ready = insert_job(sql_conn)
    body = b'{"payload": {"a": ' + b"[" * 63 + b"]" * 63 + b"}}"
    reply = post(token_app, ready, "steer", body, token=TOKEN,
                 **{"Content-Type": "application/json"})
    assert reply.status == 200, reply.json
    assert [row["name"] for row in signal_rows(sql_conn)] == ["$steer"]


@pytest.mark.parametrize(("method", "path", "says"), [
    ("GET", "/api/jobs/\u0663", "the job id in the path is a job id"),
    ("GET", "/jobs/\u0663", "the job id in the path is a job id"),
    ("GET", "/api/jobs/1\u00b2", "the job id in the path is a job id"),
    ("GET", "/api/jobs/99999999999999999999", "the job id in the path is a job id"),
    ("POST", "/api/jobs/\u0661/cancel", "the job id in the path is a job id"),
    ("GET", b"/api/jobs/\xed\xa0\x80", "the path contains a lone surrogate"),
    ("GET", b"/jobs/\xff", "the path contains a lone surrogate"),
    ("POST", b"/api/jobs/\xed\xa0\x80/cancel", "the path contains a lone surrogate"),
    ("GET", "/api/jobs/1\u0000", "the path contains a NUL character"),
])
def test_a_bad_path_segment_is_a_400_naming_it(sql_conn, token_app, method, path, says):
    """A WSGI server hands PATH_INFO over percent-decoded, as latin-1: ``bytes``
    here are a path's raw bytes (``/api/jobs/%ED%A0%80`` arrives as the first)."""
    ready = insert_job(sql_conn)
    reply = call(token_app, method, path, body={} if method == "POST" else None,
                 headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 400, (reply.status, reply.body)
    api = (path if isinstance(path, str) else path.decode("latin-1")).startswith("/api/")
    assert says in (reply.json["error"] if api else html.unescape(reply.text))
    assert job_row(sql_conn, ready)["state"] == "ready"


def test_an_action_on_a_missing_job_is_a_404(token_app):
    for action, body in (("cancel", {}), ("signal", {"name": "go"})):
        reply = post(token_app, 424242, action, body, token=TOKEN)
        assert reply.status == 404 and "job 424242 does not exist" in reply.json["error"]


def test_an_authorizer_decides_and_its_refusal_reaches_the_page(client, sql_conn):
    asked: list[tuple[str, dict[str, Any]]] = []

    def authorize(tool: str, args: dict[str, Any]) -> object:
        asked.append((tool, args))
        return None if tool == "cancel_job" else "retries wait for the on-call lead"

    app = make_app(client, guard=ops.Guard(authorizer=authorize))
    page = call(app, "GET", f"/jobs/{insert_job(sql_conn)}").text
    assert 'data-auth="open"' in page and 'data-action="retry"' in page
    failed = insert_job(sql_conn, state="failed", attempt=1, max_attempts=1)
    refused = post(app, failed, "retry")
    assert refused.status == 403
    assert refused.json["error"] == ("retry_job refused by the authorizer: "
                                     "retries wait for the on-call lead")
    assert job_row(sql_conn, failed)["state"] == "failed"
    ready = insert_job(sql_conn)
    assert post(app, ready, "cancel").status == 200
    assert job_row(sql_conn, ready)["state"] == "cancelled"
    assert asked == [("retry_job", {"job_id": failed}), ("cancel_job", {"job_id": ready})]

    # With a token too, the token is checked first, then the authorizer.
    both = make_app(client, guard=ops.Guard(authorizer=authorize), token=TOKEN)
    assert post(both, failed, "retry").status == 401
    assert post(both, failed, "retry", token=TOKEN).status == 403
    assert len(asked) == 3


def test_security_headers_are_on_every_response(client, sql_conn, token_app):
    job_id = insert_job(sql_conn)
    replies = [call(token_app, "GET", "/"), call(token_app, "GET", f"/jobs/{job_id}"),
               call(token_app, "GET", "/api/overview"), call(token_app, "GET", "/nowhere"),
               call(token_app, "GET", "/static/dashboard.js"), post(token_app, job_id, "cancel")]
    for reply in replies:
        csp = reply.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert reply.headers["x-content-type-options"] == "nosniff"
        assert reply.headers["x-frame-options"] == "DENY"
        assert reply.headers["referrer-policy"] == "no-referrer"
        assert "set-cookie" not in reply.headers


def test_a_database_that_refuses_is_a_503_naming_the_role(db_url, sql_conn):
    """A role the database refuses (no privilege on belay's tables): a 503 that
    says so, never a 500 (before, only connection failures had an answer)."""
    role = f"belay_dash_none_{os.getpid()}"
    sql_conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'no-secret'")
    try:
        sql_conn.execute(f"GRANT SELECT ON belay_meta TO {role}")
        url = psycopg.conninfo.make_conninfo(db_url, user=role, password="no-secret")
        with belay.Belay(url) as stranger:
            reply = call(make_app(stranger), "GET", "/api/overview")
        assert reply.status == 503
        assert "refused this request" in reply.json["error"]
        assert "permission denied" in reply.json["error"]
        assert "database role" in reply.json["error"]
    finally:
        sql_conn.execute(f"DROP OWNED BY {role}")
        sql_conn.execute(f"DROP ROLE {role}")


def test_a_database_that_is_down_is_a_503(empty_db_url):
    with belay.Belay("postgresql://postgres@127.0.0.1:1/nowhere") as down:
        app = make_app(down, token=TOKEN)
        api = call(app, "GET", "/api/overview")
        assert api.status == 503 and "the database is unavailable" in api.json["error"]
        page = call(app, "GET", "/jobs/1")
        assert page.status == 503 and "check that PostgreSQL is up" in page.text
        assert post(app, 1, "cancel", token=TOKEN).status == 503
    with belay.Belay(empty_db_url) as unmigrated:
        reply = call(make_app(unmigrated), "GET", "/api/overview")
        assert reply.status == 503 and "migrate" in reply.json["error"]


def test_a_prefix_or_script_name_mounts_it_below_a_path(client, sql_conn):
    job_id = insert_job(sql_conn)
    app = make_app(client, prefix="/ops/belay")
    page = call(app, "GET", f"/ops/belay/jobs/{job_id}").text
    assert 'href="/ops/belay/static/dashboard.css"' in page
    assert 'data-base="/ops/belay"' in page and 'data-api="/ops/belay/api/jobs/' in page
    assert call(app, "GET", "/jobs").status == 404
    mounted = call(make_app(client), "GET", "/jobs", script_name="/tools")
    assert f'href="/tools/jobs/{job_id}"' in mounted.text


def test_allowed_hosts_refuse_other_host_names(client):
    app = make_app(client, allowed_hosts={"127.0.0.1", "localhost"})
    assert call(app, "GET", "/").status == 200
    rebound = call(app, "GET", "/api/overview", headers={"Host": "evil.example:8766"})
    assert rebound.status == 421
    assert "answers to the host names 127.0.0.1, localhost only, not 'evil.example:8766'" in (
        rebound.json["error"])


# -- The DAG layout ---------------------------------------------------------------------------


def test_layers_put_each_member_after_its_deepest_dependency():
    deps = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"], "e": ["a", "d"], "f": []}
    assert dag.layers(deps) == [["a", "f"], ["b", "c"], ["d"], ["e"]]


def test_layers_ignore_unknown_deps_and_break_cycles():
    assert dag.layers({"a": ["ghost"], "b": ["a"]}) == [["a"], ["b"]]
    cyclic = dag.layers({"a": ["c"], "b": ["a"], "c": ["b"]})
    assert sorted(n for row in cyclic for n in row) == ["a", "b", "c"]
    assert len(cyclic) == 3
    deep = {f"n{i}": [f"n{i - 1}"] if i else [] for i in range(3000)}  # no recursion limit
    assert len(dag.layers(deep)) == 3000


def test_layout_boxes_never_overlap_and_edges_run_forward():
    deps = {"root": [], **{f"m{i}": ["root"] for i in range(6)},
            "join": [f"m{i}" for i in range(6)], "side": []}
    shape = dag.layout(deps)
    boxes = list(shape.boxes.values())
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = (abs(a.x - b.x) >= dag.NODE_W or abs(a.y - b.y) >= dag.NODE_H)
            assert apart, (a, b)
        assert a.x >= 0 and a.x + dag.NODE_W <= shape.width
        assert a.y >= 0 and a.y + dag.NODE_H <= shape.height
    assert all(shape.boxes[s].layer < shape.boxes[d].layer for s, d in shape.edges)
    assert len(shape.edges) == 12


def test_ordering_uncrosses_edges():
    # Declared so that layer 1 is in the opposite order of its parents.
    deps = {"p1": [], "p2": [], "p3": [], "c3": ["p3"], "c2": ["p2"], "c1": ["p1"]}
    shape = dag.layout(deps)
    order = sorted(("c1", "c2", "c3"), key=lambda n: shape.boxes[n].y)
    assert order == ["c1", "c2", "c3"]


def test_svg_labels_are_escaped_and_states_are_classes():
    wf = {"workflow_id": P_IMG, "jobs": [
        {"name": P_SVG, "id": 1, "kind": P_SCRIPT, "state": "running", "deps": []},
        {"name": "b", "id": 2, "kind": "k", "state": P_IMG, "deps": [P_SVG]},
    ]}
    svg = dag.svg(wf, lambda i: f"/jobs/{i}")
    assert "<svg onload" not in svg and "<script>" not in svg and "<img" not in svg
    assert 'class="node st-running"' in svg and 'class="node st-unknown"' in svg
    assert 'href="/jobs/1"' in svg and 'href="/jobs/2"' in svg


# -- belay dashboard ---------------------------------------------------------------------------


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    """``belay dashboard`` on a free loopback port with a token file; yields its URL."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with run_dashboard(db_url, "--token-file", str(token_file)) as running:
        yield running


@contextmanager
def run_dashboard(db_url: str,
                  *args: str) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    """``belay dashboard --port 0`` as a subprocess; yields its URL, the process and
    the serve line (printed once it listens); terminates it after."""
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    with subprocess.Popen(
        [sys.executable, "-W", "error", "-m", "belay", "dashboard", "--url", db_url,
         "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            match = re.search(r"serving (http://127\.0\.0\.1:\d+)/", line)
            assert match, f"no serve line: {line!r} {proc.stderr.read()}"
            yield match[1], proc, line
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def test_belay_dashboard_serves_until_terminated(served, client, sql_conn):
    url, proc, _ = served
    job_id = insert_job(sql_conn, queue="served")
    with urllib.request.urlopen(url + "/api/overview", timeout=10) as reply:
        data = json.load(reply)
        assert reply.headers["X-Frame-Options"] == "DENY"
    assert [q["queue"] for q in data["queues"]] == ["served"]
    request = urllib.request.Request(
        f"{url}/api/jobs/{job_id}/cancel", data=b"{}", method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert json.load(reply)["status"] == "cancelled"
    assert job_row(sql_conn, job_id)["state"] == "cancelled"
    proc.terminate()
    assert proc.wait(timeout=15) == 0


def test_belay_dashboard_refuses_an_empty_token_file_a_bad_database_and_a_taken_port(
        db_url, tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    done = subprocess.run([sys.executable, "-m", "belay", "dashboard", "--url", db_url,
                           "--port", "0", "--token-file", str(empty)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2 and "the file is empty" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "belay", "dashboard", "--url",
                          "postgresql://postgres@127.0.0.1:1/nowhere", "--port", "0"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert bad.returncode == 1 and "cannot connect to the database" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "belay", "dashboard", "--url", db_url,
                               "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
    assert busy.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in busy.stderr


def test_the_serve_line_says_when_the_dashboard_is_read_only(db_url):
    with run_dashboard(db_url) as (_url, _proc, line):
        assert line.rstrip().endswith("/ (read-only)")



def test_an_allowed_host_lets_a_reverse_proxy_through_and_no_other_name(db_url):
    """Behind a proxy that forwards ``Host: dash.example.com``: named with
    --allowed-host, that name is served (and its same-origin POST reaches the
    access check); any other name is still refused."""
    with run_dashboard(db_url, "--allowed-host", "Dash.Example.com") as (url, _proc, _line):
        def get(host: str) -> int:
            request = urllib.request.Request(url + "/api/overview", headers={"Host": host})
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert get("dash.example.com") == 200
        assert get("evil.example") == 421
        post = urllib.request.Request(
            url + "/api/jobs/1/cancel", data=b"{}", method="POST",
            headers={"Host": "dash.example.com", "Origin": "https://dash.example.com",
                     "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 403
        assert "read-only" in json.load(refused.value)["error"]


def test_a_job_with_more_events_than_a_view_holds_says_so(client, sql_conn, app):
    job_id = insert_job(sql_conn)
    sql_conn.execute(
        "INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
        "SELECT %s, n, jsonb_build_object('n', n), now() FROM generate_series(1, 205) AS n",
        (job_id,))
    data = call(app, "GET", f"/api/jobs/{job_id}").json
    assert data["events_total"] == 205 and len(data["events"]) == 200
    assert data["events"][-1]["seq"] == 205
    page = call(app, "GET", f"/jobs/{job_id}").text
    assert 'id="events-shown" data-which="newest">showing the newest 200 of 205<' in page
    assert 'id="steps-shown" data-which="first" hidden>' in page


def test_an_authorizer_whose_exception_cannot_be_described_is_a_403_not_a_500(client, sql_conn):
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no words")

    def authorize(tool: str, args: dict[str, Any]) -> object:
        raise Unprintable

    app = make_app(client, guard=ops.Guard(authorizer=authorize))
    ready = insert_job(sql_conn)
    refused = post(app, ready, "cancel")
    assert refused.status == 403
    assert "cancel_job refused by the authorizer: <exception" in refused.json["error"]
    assert job_row(sql_conn, ready)["state"] == "ready"


def test_the_schedules_page_shows_schedules_and_crons_escaped(client, sql_conn, app):
    client.schedule("nightly", "0 3 * * *", P_IMG, overlap="queue", catch_up="all")
    client.schedule(P_SCRIPT, "@hourly", "app.hourly")
    client.cancel_schedule(P_SCRIPT)
    client.put_cron("digest", "@daily", "app.digest")
    page = call(app, "GET", "/schedules")
    assert page.status == 200
    rows = re.findall(r"<tr><td>(.*?)</td>", page.text)
    assert html.escape(P_SCRIPT) in rows and "nightly" in rows and "digest" in rows
    for raw in ("<script>alert", "<img"):
        assert raw not in page.text
    assert "<td>queue</td><td>all</td>" in page.text
    assert '<span class="badge">cancelled</span>' in page.text
    data = call(app, "GET", "/api/schedules").json
    assert [s["name"] for s in data["schedules"]] == sorted(["nightly", P_SCRIPT])
    assert [c["name"] for c in data["crons"]] == ["digest"]
    assert re.findall(r"<script[^>]*>", page.text) == [
        '<script src="/static/dashboard.js" defer>']


# -- Spend ----------------------------------------------------------------------------------

WEEK_RANGE = {"since": "2026-02-28T00:00:00Z", "until": "2026-03-08T00:00:00Z"}


def spending_jobs(client: belay.Belay, clock: belay.ManualClock) -> dict[str, int]:
    """tests/test_spend.py's jobs (four that spent over two days, 1 March 12:00
    and 2 March 13:00 UTC, two queues, three customers; one that spent
    nothing), with markup for one customer. The clock ends at the last enqueue."""
    return seeded(client, clock, customer=P_SCRIPT)


def bars(page: str) -> list[dict[str, Any]]:
    """The spend chart's bars: key, USD (micro-dollars), jobs and height."""
    found = re.findall(r'<rect class="bar" data-key="([^"]*)" data-usd-micros="(\d+)" '
                       r'data-jobs="(\d+)" x="[^"]*" y="[^"]*" width="[^"]*" height="([^"]*)">',
                       page)
    return [{"key": k, "usd_micros": int(u), "jobs": int(j), "height": float(h)}
            for k, u, j, h in found]


def groups(page: str) -> list[list[str]]:
    """The cells of the spend table's group rows, as text."""
    match = re.search(r'<table class="spend" id="spend-groups">.*?<tbody>(.*?)</tbody>', page,
                      re.S)
    assert match, "no spend table"
    return [[html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
             for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r'<tr class="group">(.*?)</tr>', match[1], re.S)]


def total_row(page: str) -> list[str]:
    match = re.search(r'<tr id="spend-total">(.*?)</tr>', page, re.S)
    assert match, "no total"
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", match[1], re.S)]


def test_the_spend_page_charts_usd_per_day_and_lists_the_groups(client, clock, app):
    spending_jobs(client, clock)
    page = call(app, "GET", "/spend", query=urlencode({"by": "kind", **WEEK_RANGE}))
    assert page.status == 200, page.text
    text = page.text
    assert '<a href="/spend">Spend</a>' in text  # in the nav, on every page
    assert '<a href="/spend">Spend</a>' in call(app, "GET", "/").text
    # A bar a day over the eight days of the range, empty ones included.
    chart = bars(text)
    assert [b["key"] for b in chart] == [f"2026-02-{d}" for d in (28,)] + [
        f"2026-03-0{d}" for d in range(1, 8)]
    spent = {b["key"]: (b["usd_micros"], b["jobs"]) for b in chart if b["usd_micros"]}
    assert spent == {"2026-03-01": (1_750_000, 2), "2026-03-02": (2_125_000, 2)}
    heights = {b["key"]: b["height"] for b in chart}
    assert heights["2026-03-02"] == max(heights.values()) > 0  # the largest is the scale
    assert heights["2026-03-01"] == pytest.approx(heights["2026-03-02"] * 1_750_000 / 2_125_000,
                                                  abs=0.01)
    assert heights["2026-02-28"] == 0
    assert 'data-unit="day"' in text and "USD per day" in text
    # The groups, largest first, with jobs, USD, tokens and share of the total.
    assert groups(text) == [["write", "2", "$3.00", "6,000", "77.4%"],
                            ["research", "2", "$0.875", "1,510", "22.6%"]]
    assert total_row(text) == ["total", "4", "$3.875", "7,510", "100.0%"]
    assert "spend-capped" not in text
    assert "jobs enqueued from 2026-02-28 00:00:00 until 2026-03-08 00:00:00" in text
    # The form shows the question back.
    assert 'name="since" value="2026-02-28T00:00:00Z"' in text
    assert 'name="by" value="kind"' in text
    assert re.findall(r"<script[^>]*>", text) == ['<script src="/static/dashboard.js" defer>']
    assert "<style" not in text and " style=" not in text
    assert not re.search(r"\son[a-z]+=", text)


def test_a_range_of_48_hours_or_less_is_charted_per_hour(client, clock, app):
    spending_jobs(client, clock)  # the clock is at 2 March 13:00, when the last two were
    page = call(app, "GET", "/spend", query="since=24h")
    assert page.status == 200, page.text
    chart = bars(page.text)
    assert 'data-unit="hour"' in page.text
    # 1 March 13:00 up to now, the jobs enqueued this very hour included.
    assert chart[0]["key"] == "2026-03-01T13:00" and chart[-1]["key"] == "2026-03-02T13:00"
    assert len(chart) == 25
    assert [(b["key"], b["usd_micros"]) for b in chart if b["usd_micros"]] == [
        ("2026-03-02T13:00", 2_125_000)]
    assert total_row(page.text)[:3] == ["total", "2", "$2.125"]
    # Filters narrow the chart as much as the table.
    slow = call(app, "GET", "/spend", query=urlencode({"queue": "slow", **WEEK_RANGE}))
    assert [(b["key"], b["usd_micros"]) for b in bars(slow.text) if b["usd_micros"]] == [
        ("2026-03-01", 1_000_000)]
    assert groups(slow.text) == [["write", "1", "$1.00", "2,000", "100.0%"]]


def test_the_spend_api_answers_the_shared_view_with_two_dimensions_and_meta(client, clock, app):
    spending_jobs(client, clock)
    week = urlencode(WEEK_RANGE)
    view = call(app, "GET", "/api/spend", query=f"by=kind&{week}").json
    assert view == ops.spend_view(client, {"by": "kind", **WEEK_RANGE})
    assert view["total"] == {"jobs": 4, "usd": 3.875, "usd_micros": 3_875_000, "tokens": 7510}
    crossed = call(app, "GET", "/api/spend", query=f"by=day&by=kind&{week}").json
    assert crossed["by"] == ["day", "kind"] and crossed["groups"] == 4
    assert [(r["key"], r["usd_micros"]) for r in crossed["rows"]] == [
        (["2026-03-01", "write"], 1_000_000), (["2026-03-01", "research"], 750_000),
        (["2026-03-02", "write"], 2_000_000), (["2026-03-02", "research"], 125_000)]
    # meta.<key>=<text>, meta=key=value, meta=<JSON object> (a value that is not text).
    for meta in ("meta.customer=acme", "meta=customer%3Dacme",
                 "meta=" + urlquote('{"customer": "acme"}')):
        acme = call(app, "GET", "/api/spend", query=f"{meta}&{week}").json
        assert acme["total"]["usd_micros"] == 1_750_000, meta
    seven = call(app, "GET", "/api/spend", query="meta=" + urlquote('{"customer": 7}') + "&"
                 + week).json
    assert seven["total"]["usd_micros"] == 2_000_000
    capped = call(app, "GET", "/api/spend", query=f"by=meta:customer&limit=1&{week}").json
    assert (len(capped["rows"]), capped["groups"]) == (1, 3)
    # The page shows two dimensions as two key columns.
    page = call(app, "GET", "/spend", query=f"by=day&by=kind&{week}")
    assert groups(page.text)[0] == ["2026-03-01", "write", "1", "$1.00", "2,000", "25.8%"]
    assert 'name="by" value="kind"' in page.text  # the second "by" of the form
    # An empty second "by" (the form sends one) is one dimension.
    single = call(app, "GET", "/api/spend", query=f"by=queue&by=&{week}").json
    assert single["by"] == ["queue"]


def test_a_capped_report_says_so_and_links_to_the_rest(client, clock, app):
    spending_jobs(client, clock)
    page = call(app, "GET", "/spend", query=urlencode({"by": "meta:customer", "limit": "2",
                                                       **WEEK_RANGE}))
    assert page.status == 200
    assert len(groups(page.text)) == 2
    assert total_row(page.text)[:3] == ["total", "4", "$3.875"]  # the whole, not the cap
    note = re.search(r'<p class="muted" id="spend-capped">(.*?)</p>', page.text)
    assert note and "showing 2 of 3 groups (the largest)" in html.unescape(note[1])
    assert "limit=3" in note[1]


def test_the_tree_view_totals_a_job_and_its_descendants_per_kind(client, clock, app):
    registry = belay.Registry()
    _, _, lead = agents(registry)
    root = client.enqueue(lead, {"children": [{"calls": [[0.25, 10]]}, {"calls": [[0.5, 20]]}],
                                 "grand": [{"calls": [[1.0, 40]]}]})
    done = drain(client=client, registry=registry)
    assert done["succeeded"] == 5, done
    page = call(app, "GET", "/spend", query=f"tree={root.id}")
    assert page.status == 200, page.text
    assert groups(page.text) == [["research", "3", "$1.75", "70", "89.7%"],
                                 ["lead", "2", "$0.20", "200", "10.3%"]]
    assert total_row(page.text) == ["total", "5", "$1.95", "270", "100.0%"]
    assert f'<a href="/jobs/{root.id}">job {root.id}</a>' in page.text
    assert "2 level(s) deep" in page.text
    view = call(app, "GET", "/api/spend", query=f"tree={root.id}").json
    assert view == ops.spend_view(client, {"tree": root.id})
    assert view["total"]["usd_micros"] == 1_950_000
    # By tree, each root links to its job and its tree; by parent, to the parent.
    by_tree = call(app, "GET", "/spend", query=urlencode({"by": "tree", **WEEK_RANGE})).text
    assert (f'<a href="/jobs/{root.id}">{root.id}</a> '
            f'<a class="more" href="/spend?tree={root.id}">tree</a>') in by_tree
    by_parent = call(app, "GET", "/spend", query=urlencode({"by": "parent", **WEEK_RANGE})).text
    assert f'<td class="key"><a href="/jobs/{root.id}">{root.id}</a></td>' in by_parent
    assert '<span class="muted">(none)</span>' in by_parent  # the root has no parent
    # The job page links to its tree's spend.
    job = call(app, "GET", f"/jobs/{root.id}").text
    assert f'<a href="/spend?tree={root.id}">spend of this job\'s tree</a>' in job


@pytest.mark.parametrize(("query", "status", "says"), [
    ("by=colour", 400, "unknown dimension 'colour'"),
    ("by=day&by=kind&by=queue", 400, "one or two dimensions"),
    ("by=kind&by=kind", 400, "the two dimensions are the same"),
    ("since=last+week", 400, "a span back from until (30m, 24h, 7d, 2w)"),
    ("since=2026-03-01T00:00:00", 400, "since is an ISO 8601 time with a zone"),
    ("until=tomorrow", 400, "until is an ISO 8601 time with a zone"),
    ("since=2026-03-02T00:00:00Z&until=2026-03-01T00:00:00Z", 400, "must be before until"),
    ("limit=0", 400, "limit is an integer from 1 to 10000"),
    ("limit=10001", 400, "limit is an integer from 1 to 10000"),
    ("limit=ten", 400, "limit is an integer from 1 to 10000"),
    ("tree=abc", 400, "tree is a job id"),
    ("tree=0", 400, "tree is a job id"),
    ("tree=999", 404, "job 999 does not exist"),
    ("meta=acme", 400, "meta filters as key=value"),
    ("meta=%7B%22a%22", 400, "is not valid JSON"),
    ("meta=" + "%5B" * 3000, 400, "meta filters as key=value"),
    ("meta=%7B%22a%22%3A" + "%5B" * 3000 + "%5D" * 3000 + "%7D", 400, "nests deeper"),
    ("meta.=acme", 400, "meta"),
    ("kind=%00", 400, "kind contains a NUL"),
    ("by=%ED%A0%80", 400, "unknown dimension"),
    ("group=kind", 400, "unknown argument(s) 'group'"),
])
def test_a_bad_spend_question_is_a_4xx_naming_the_problem(client, app, query, status, says):
    for path in ("/spend", "/api/spend"):
        reply = call(app, "GET", path, query=query)
        assert reply.status == status, (path, reply.status, reply.body[:300])
        text = reply.json["error"] if path.startswith("/api/") else html.unescape(reply.text)
        assert says in text, (path, text[:500])


def test_the_spend_page_escapes_keys_filters_and_meta_values(client, clock, app):
    spending_jobs(client, clock)
    registry = belay.Registry()

    @belay.worker(name=P_IMG, queue="default", registry=registry)
    def hostile(ctx: belay.Context) -> None:
        ctx.step("x", lambda: None, cost=belay.Cost(usd=0.5, tokens=5))

    client.enqueue(hostile, {}, meta={"customer": P_SVG, P_SCRIPT: P_IMG})
    drain(client=client, registry=registry)
    replies = [
        call(app, "GET", "/spend", query=urlencode({"by": "meta:customer", **WEEK_RANGE})),
        call(app, "GET", "/spend", query=urlencode([("by", "kind"), ("by", ""),
                                                    *WEEK_RANGE.items()])),
        call(app, "GET", "/spend", query=urlencode({"by": f"meta:{P_SCRIPT}", "kind": P_IMG,
                                                    "meta": f"customer={P_SVG}",
                                                    f"meta.{P_SCRIPT}": P_IMG, **WEEK_RANGE})),
    ]
    for reply in replies:
        assert reply.status == 200, reply.text
        for raw in ("<script>alert", "<img", "<svg onload"):
            assert raw not in reply.text
    by_customer = [row[0] for row in groups(replies[0].text)]
    assert P_SCRIPT in by_customer and P_SVG in by_customer  # shown as text
    kinds = [row[0] for row in groups(replies[1].text)]
    assert kinds[0] == "write" and P_IMG in kinds
    filtered = replies[2].text
    assert groups(filtered) == [[P_IMG, "1", "$0.50", "5", "100.0%"]]
    assert f'name="kind" value="{html.escape(P_IMG)}"' in filtered
    assert f'name="meta" value="customer={html.escape(P_SVG)}"' in filtered
    assert (f'<input type="hidden" name="meta.{html.escape(P_SCRIPT)}" '
            f'value="{html.escape(P_IMG)}">') in filtered
    api = call(app, "GET", "/api/spend", query=urlencode({"by": "meta:customer",
                                                         **WEEK_RANGE}))
    assert "<" not in api.text
    assert P_SVG in [row["key"][0] for row in api.json["rows"]]
    # A bad value echoed in an error is escaped too.
    bad = call(app, "GET", "/spend", query=urlencode({"by": P_SCRIPT}))
    assert bad.status == 400 and "<script>alert" not in bad.text


def test_the_query_keeps_every_value_of_a_repeated_name():
    from belay.dashboard.app import all_values, parse_query

    query = parse_query("by=day&kind=a&by=kind&by=&kind=b")
    assert query == {"by": "day", "kind": "a"}  # each name's first value, as before
    assert all_values(query, "by") == ["day", "kind"]  # a blank value is none
    assert all_values({"by": "day"}, "by") == ["day"] and all_values({}, "by") == []


def test_the_chart_fills_empty_buckets_and_turns_to_months_past_two_years():
    from belay.dashboard import spending

    def series(since: str, until: str, unit: str, rows: list[tuple[str, int]]) -> dict[str, Any]:
        return {"since": since, "until": until, "unit": unit, "groups": len(rows),
                "rows": [{"key": [k], "jobs": 1, "usd_micros": u, "tokens": 1} for k, u in rows]}

    week = {"since": "2026-03-01T00:00:00+00:00", "until": "2026-03-08T00:00:00+00:00"}
    assert spending.unit_of(week) == "day"
    assert spending.unit_of({**week, "until": "2026-03-03T00:00:00+00:00"}) == "hour"
    assert spending.unit_of({**week, "until": "2029-03-01T00:00:00+00:00"}) == "month"
    # A zone other than UTC is read as the UTC the keys are in.
    hours = spending.buckets(series("2026-03-01T02:30:00+02:00", "2026-03-01T03:00:00+00:00",
                                    "hour", []))
    assert [b["key"] for b in hours] == ["2026-03-01T00:00", "2026-03-01T01:00",
                                         "2026-03-01T02:00"]
    months = spending.buckets(series("2025-11-20T00:00:00+00:00", "2026-02-02T00:00:00+00:00",
                                     "month", [("2025-12-01", 5), ("2025-12-31", 7),
                                               ("2026-02-01", 1)]))
    assert [(b["key"], b["usd_micros"], b["jobs"]) for b in months] == [
        ("2025-11", 0, 0), ("2025-12", 12, 2), ("2026-01", 0, 0), ("2026-02", 1, 1)]
    empty = spending.chart(series(week["since"], week["until"], "day", []))
    assert len(bars(empty)) == 7 and {b["height"] for b in bars(empty)} == {0.0}
    assert spending.dollars(3_875_000) == "$3.875" and spending.dollars(1_234_500_000) == \
        "$1,234.50" and spending.dollars(-10) == "-$0.00001"
