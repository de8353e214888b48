"""The MCP server (``belay mcp``), driven by the ``mcp`` package's own client
against a real database: over stdio to a real ``python -m belay mcp``
subprocess, over streamable HTTP to another, and in memory for the argument
checks. Mutations are refused unless the server was started with
``--allow-mutations`` or ``--authorizer``, and the refusal is a tool error.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import anyio
import psycopg
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, TextContent
from psycopg.rows import dict_row

import belay
from belay import Belay, ValidationError, ops
from belay.errors import JobNotFound, NotRetryable
from belay.mcp_server import build_server
from belay.testing import drain
from tests import mcp_authorizer
from tests.helpers import Conn, job_row, running_job, signal_rows

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

READS = {"stats", "list_jobs", "get_job", "job_events", "workflow_status", "schedules",
         "schedule_status", "spend"}
WRITES = set(ops.MUTATIONS)


# -- fixtures: a job with a journal, events and a child; a failed job; a workflow ------


@pytest.fixture
def registry() -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name="mcp.agent", registry=reg)
    def agent(ctx: belay.Context) -> Any:
        plan = ctx.step("plan", lambda: {"outline": 3}, cost=belay.Cost(usd=0.25, tokens=1200))
        ctx.emit({"stage": "planned"})
        draft = ctx.step("draft", lambda: "a draft", cost=belay.Cost(usd=0.5, tokens=800))
        ctx.emit({"stage": "drafted"})
        ctx.spawn("review", "mcp.kid", {"n": 21})
        approval = ctx.await_signal("approve")
        return {"approval": approval, "steering": ctx.steering(), "plan": plan, "draft": draft}

    @belay.worker(name="mcp.kid", queue="kids", registry=reg)
    def kid(ctx: belay.Context) -> Any:
        return ctx.input["n"] * 2

    @belay.worker(name="mcp.flaky", max_attempts=1, registry=reg)
    def flaky(ctx: belay.Context) -> Any:
        raise RuntimeError("model timed out")

    return reg


@dataclass(frozen=True)
class Seed:
    agent: int  # awaiting "approve": two costed steps, two events, one succeeded child
    kid: int
    failed: int
    waiting: int  # ready, in a queue no worker drains
    workflow: str


@pytest.fixture
def seed(client: Belay, registry: belay.Registry) -> Seed:
    agent = client.enqueue("mcp.agent", {"topic": "belay"})
    failed = client.enqueue("mcp.flaky", max_attempts=1)
    assert drain(client=client, registry=registry) == {"await": 1, "failed": 1}
    assert drain("kids", client=client, registry=registry) == {"succeeded": 1}
    wf = (belay.Workflow("nightly", workflow_id="wf-mcp")
          .add("extract", "mcp.kid", {"n": 1}, queue="later")
          .add("load", "mcp.kid", {"n": 2}, queue="later", deps=["extract"]))
    client.enqueue_workflow(wf)
    waiting = client.enqueue("mcp.kid", {"n": 5}, queue="later")
    [kid] = client.list_jobs(parent_id=agent.id)
    return Seed(agent.id, kid.id, failed.id, waiting.id, "wf-mcp")


# -- helpers -------------------------------------------------------------------------


def text(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def ok(result: CallToolResult) -> Any:
    """A successful tool result's JSON, checked against its text form."""
    assert not result.is_error, text(result)
    assert result.structured_content == json.loads(text(result))
    return result.structured_content


def refused(result: CallToolResult) -> str:
    assert result.is_error, result
    return text(result)


def session(target: Any, body: Callable[[Client], Awaitable[T]]) -> T:
    """Connect the package's client to ``target``, run ``body``, disconnect."""
    async def main() -> T:
        async with Client(target) as mcp:
            return await body(mcp)
    return anyio.run(main)


@contextlib.contextmanager
def stdio(db_url: str, tmp_path: Path, *flags: str,
          env: dict[str, str] | None = None) -> Iterator[tuple[Any, Path]]:
    """A transport that spawns ``python -m belay mcp`` (the SDK's stdio client
    closes its stdin on exit and kills it if it lingers); its stderr goes to a file."""
    errlog = tmp_path / f"mcp-stderr-{time.monotonic_ns()}.txt"
    params = StdioServerParameters(
        command=sys.executable,
        args=["-W", "error", "-m", "belay", "mcp", "--url", db_url, *flags],
        cwd=str(REPO), env=env,
    )
    with errlog.open("w", encoding="utf-8") as fh:
        yield stdio_client(params, errlog=fh), errlog


def rows(conn: Conn, query: str, *params: Any) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()


def snapshot(conn: Conn, seed: Seed) -> Any:
    """Everything a mutation could touch."""
    jobs = {i: job_row(conn, i) for i in (seed.agent, seed.kid, seed.failed, seed.waiting)}
    return jobs, signal_rows(conn)


# -- 1. stdio: the read tools report what the database holds -----------------------------


def test_stdio_session_reads_what_the_database_holds(
    db_url: str, seed: Seed, sql_conn: Conn, tmp_path: Path
) -> None:
    async def body(mcp: Client) -> dict[str, Any]:
        out: dict[str, Any] = {"tools": (await mcp.list_tools()).tools,
                               "instructions": mcp.instructions}
        out["stats"] = ok(await mcp.call_tool("stats", {}))
        out["awaiting"] = ok(await mcp.call_tool("list_jobs", {"state": "awaiting"}))
        out["later"] = ok(await mcp.call_tool("list_jobs", {"queue": "later", "limit": 2}))
        out["later2"] = ok(await mcp.call_tool(
            "list_jobs", {"queue": "later", "limit": 2,
                          "before_id": out["later"]["next_before_id"]}))
        out["kids"] = ok(await mcp.call_tool("list_jobs", {"parent_id": seed.agent}))
        out["agent"] = ok(await mcp.call_tool("get_job", {"job_id": seed.agent}))
        out["events"] = ok(await mcp.call_tool("job_events", {"job_id": seed.agent, "after": 1}))
        out["first_event"] = ok(await mcp.call_tool("job_events",
                                                    {"job_id": seed.agent, "limit": 1}))
        out["workflow"] = ok(await mcp.call_tool("workflow_status",
                                                 {"workflow_id": seed.workflow}))
        [load] = [j for j in out["workflow"]["jobs"] if j["name"] == "load"]
        out["member"] = ok(await mcp.call_tool("get_job", {"job_id": load["id"]}))
        out["spend"] = ok(await mcp.call_tool("spend", {"by": ["kind"], "since": "52w"}))
        out["tree"] = ok(await mcp.call_tool("spend", {"tree": seed.agent}))
        out["bad_by"] = refused(await mcp.call_tool("spend", {"by": "colour"}))
        out["missing"] = refused(await mcp.call_tool("get_job", {"job_id": 987654}))
        out["no_wf"] = refused(await mcp.call_tool("workflow_status", {"workflow_id": "nope"}))
        return out

    with stdio(db_url, tmp_path) as (transport, errlog):
        out = session(transport, body)

    tools = {t.name: t for t in out["tools"]}
    assert set(tools) == READS | WRITES
    for name in WRITES:
        assert "--allow-mutations" in (tools[name].description or ""), name
        assert tools[name].annotations.read_only_hint is False
    for name in READS:
        assert tools[name].annotations.read_only_hint is True
    assert "durable job engine" in out["instructions"]
    assert "Mutations are disabled" in out["instructions"]

    # stats: every queue's counts and its unfinished jobs' spend, as GROUP BY says.
    expected: dict[str, dict[str, int]] = {}
    for r in rows(sql_conn, "SELECT queue, state, count(*) AS n FROM belay_jobs GROUP BY 1, 2"):
        expected.setdefault(r["queue"], {})[r["state"]] = r["n"]
    tiles = {t["queue"]: t for t in out["stats"]["queues"]}
    assert set(tiles) == set(expected) == {"default", "kids", "later"}
    for queue, counts in expected.items():
        assert {s: n for s, n in tiles[queue]["counts"].items() if n} == counts
        assert tiles[queue]["total"] == sum(counts.values())
    [spend] = rows(sql_conn, "SELECT sum(spent_usd_micros) AS usd, sum(spent_tokens) AS tokens "
                             "FROM belay_jobs WHERE queue = 'default' AND state NOT IN "
                             "('ready', 'succeeded', 'failed', 'cancelled')")
    assert tiles["default"]["spent_usd"] == spend["usd"] / 1_000_000 == 0.75
    assert tiles["default"]["spent_tokens"] == spend["tokens"] == 2000

    # list_jobs: filters and paging, newest first.
    assert [j["id"] for j in out["awaiting"]["jobs"]] == [seed.agent]
    later = [r["id"] for r in rows(sql_conn, "SELECT id FROM belay_jobs WHERE queue = 'later' "
                                             "ORDER BY id DESC")]
    assert len(later) == 3
    assert [j["id"] for j in out["later"]["jobs"]] == later[:2]
    assert out["later"]["next_before_id"] == later[1]
    assert [j["id"] for j in out["later2"]["jobs"]] == later[2:]
    assert out["later2"]["next_before_id"] is None
    assert [j["id"] for j in out["kids"]["jobs"]] == [seed.kid]

    # get_job: the row, the journal with costs, the events, the child.
    agent = out["agent"]
    row = job_row(sql_conn, seed.agent)
    assert agent["job"]["state"] == row["state"] == "awaiting"
    assert agent["job"]["await_name"] == row["await_name"] == "approve"
    assert agent["job"]["input"] == row["input"] == {"topic": "belay"}
    assert agent["job"]["spent_usd"] == row["spent_usd_micros"] / 1_000_000
    steps = rows(sql_conn, "SELECT name, usd_micros, tokens FROM belay_steps WHERE job_id = %s "
                           "ORDER BY seq", seed.agent)
    assert [(s["name"], s["usd"], s["tokens"]) for s in agent["steps"]] == [
        (s["name"], s["usd_micros"] / 1_000_000, s["tokens"]) for s in steps]
    assert [s["name"] for s in steps] == ["plan", "draft", "$spawn:review"]
    assert agent["steps"][0]["value"] == {"outline": 3}
    assert agent["journal_cost"] == {"usd": 0.75, "tokens": 2000}
    events = rows(sql_conn, "SELECT seq, payload FROM belay_events WHERE job_id = %s ORDER BY seq",
                  seed.agent)
    assert [(e["seq"], e["payload"]) for e in agent["events"]] == [
        (e["seq"], e["payload"]) for e in events]
    assert [e["payload"] for e in events] == [{"stage": "planned"}, {"stage": "drafted"}]
    assert [(c["id"], c["state"]) for c in agent["children"]] == [
        (r["id"], r["state"]) for r in rows(
            sql_conn, "SELECT id, state FROM belay_jobs WHERE parent_id = %s", seed.agent)]
    assert agent["workflow"] is None

    # job_events: after a seq.
    assert out["events"]["events"] == agent["events"][1:]
    assert out["events"]["last_seq"] == events[-1]["seq"] and out["events"]["more"] is False
    # ...and a page of one: the first event, and more to come.
    assert out["first_event"]["events"] == agent["events"][:1]
    assert out["first_event"]["more"] is True
    assert out["first_event"]["last_seq"] == agent["events"][0]["seq"]

    # workflow_status, and a member's get_job carries its workflow.
    members = rows(sql_conn, "SELECT id, wf_name, state FROM belay_jobs WHERE workflow_id = %s",
                   seed.workflow)
    wf = out["workflow"]
    assert sorted((j["id"], j["name"], j["state"]) for j in wf["jobs"]) == sorted(
        (m["id"], m["wf_name"], m["state"]) for m in members)
    assert wf["edges"] == [["extract", "load"]]
    assert wf["total"] == 2 and wf["done"] is False
    assert out["member"]["workflow"] == wf

    assert "no job 987654" in out["missing"]

    # spend: each kind's own spend, as the journal's costs sum it (no charge-backs here).
    expected_spend = {
        r["kind"]: [r["usd_micros"], r["tokens"]] for r in rows(
            sql_conn, "SELECT kind, sum(spent_usd_micros)::bigint AS usd_micros, "
            "sum(spent_tokens)::bigint AS tokens FROM belay_jobs "
            "WHERE spent_usd_micros <> 0 OR spent_tokens <> 0 GROUP BY kind")}
    assert expected_spend and {row["key"][0]: [row["usd_micros"], row["tokens"]]
                               for row in out["spend"]["rows"]} == expected_spend
    assert out["tree"]["job_id"] == seed.agent and out["tree"]["total"]["jobs"] >= 2
    assert "unknown dimension 'colour'" in out["bad_by"]
    assert "no workflow 'nope'" in out["no_wf"]
    assert "Traceback" not in errlog.read_text()


# -- 2. mutations: refused without flags, done with --allow-mutations, or as authorized ---


async def _all_four(mcp: Client, seed: Seed) -> dict[str, CallToolResult]:
    return {
        "retry_job": await mcp.call_tool("retry_job", {"job_id": seed.failed}),
        "cancel_job": await mcp.call_tool("cancel_job", {"job_id": seed.waiting}),
        "signal": await mcp.call_tool("signal", {"job_id": seed.agent, "name": "approve",
                                                 "payload": {"ok": True}}),
        "steer_job": await mcp.call_tool("steer_job", {"job_id": seed.agent,
                                                       "payload": {"instruction": "shorter"}}),
    }


def test_stdio_without_flags_refuses_every_mutation_and_writes_nothing(
    db_url: str, seed: Seed, sql_conn: Conn, tmp_path: Path
) -> None:
    before = snapshot(sql_conn, seed)

    async def body(mcp: Client) -> tuple[dict[str, CallToolResult], Any]:
        results = await _all_four(mcp, seed)
        # The server is still there after four refusals.
        return results, ok(await mcp.call_tool("get_job", {"job_id": seed.failed}))

    with stdio(db_url, tmp_path) as (transport, errlog):
        results, after_read = session(transport, body)

    for tool, result in results.items():
        message = refused(result)
        assert f"{tool} is refused: mutations are disabled" in message
        assert "--allow-mutations" in message and "--authorizer" in message
    assert snapshot(sql_conn, seed) == before
    assert after_read["job"]["state"] == "failed"
    assert "Traceback" not in errlog.read_text()


def test_stdio_allow_mutations_does_each_one(
    db_url: str, seed: Seed, sql_conn: Conn, tmp_path: Path, client: Belay,
    registry: belay.Registry,
) -> None:
    with stdio(db_url, tmp_path, "--allow-mutations") as (transport, _):
        results = session(transport, lambda mcp: _all_four(mcp, seed))
    out = {tool: ok(result) for tool, result in results.items()}

    assert out["cancel_job"] == {"job_id": seed.waiting, "status": "cancelled"}
    assert job_row(sql_conn, seed.waiting)["state"] == "cancelled"

    assert out["retry_job"]["job"]["state"] == "ready"
    assert job_row(sql_conn, seed.failed)["state"] == "ready"

    # The signal woke the awaiting job; the steering is stored next to it.
    assert out["signal"] == {"job_id": seed.agent, "signal": "approve", "woken": [seed.agent]}
    assert out["steer_job"] == {"job_id": seed.agent, "steered": True, "woken": []}
    stored = {(s["scope"], s["name"]): s["payload"] for s in signal_rows(sql_conn)}
    assert stored[(f"job:{seed.agent}", "approve")] == {"ok": True}
    assert stored[(f"job:{seed.agent}", "$steer")] == {"instruction": "shorter"}
    assert job_row(sql_conn, seed.agent)["state"] == "ready"
    # … and the job's code gets both when it runs again (on the server's clock,
    # which stamped the wake-up).
    with Belay(db_url) as wall:
        assert drain(client=wall, registry=registry) == {"succeeded": 1, "failed": 1}
    assert client.get_job(seed.agent).result == {
        "approval": {"ok": True}, "steering": {"instruction": "shorter"},
        "plan": {"outline": 3}, "draft": "a draft"}


def test_stdio_authorizer_decides_each_mutation(
    db_url: str, seed: Seed, sql_conn: Conn, tmp_path: Path
) -> None:
    log = tmp_path / "authz.jsonl"
    before_jobs, before_signals = snapshot(sql_conn, seed)
    flags = ("--authorizer", "tests.mcp_authorizer:authorize")
    with stdio(db_url, tmp_path, *flags, env={"BELAY_TEST_AUTHZ_LOG": str(log)}) as (
            transport, errlog):
        async def body(mcp: Client) -> tuple[Any, dict[str, CallToolResult]]:
            return mcp.instructions, await _all_four(mcp, seed)
        instructions, results = session(transport, body)

    assert "authorizer" in instructions
    # Allowed: the signal was delivered and woke the job.
    assert ok(results["signal"])["woken"] == [seed.agent]
    assert job_row(sql_conn, seed.agent)["state"] == "ready"
    # Refused, each with the authorizer's reason, and nothing written.
    assert refused(results["retry_job"]) == (
        f"Error executing tool retry_job: retry_job refused by the authorizer: "
        f"{mcp_authorizer.RETRY_REFUSAL}")
    assert f"cancel_job refused by the authorizer: {mcp_authorizer.CANCEL_REFUSAL}" in refused(
        results["cancel_job"])
    assert "steer_job refused by the authorizer: not authorized" in refused(results["steer_job"])
    assert job_row(sql_conn, seed.failed) == before_jobs[seed.failed]
    assert job_row(sql_conn, seed.waiting) == before_jobs[seed.waiting]
    assert {(s["scope"], s["name"]) for s in signal_rows(sql_conn)} == {
        (s["scope"], s["name"]) for s in before_signals} | {(f"job:{seed.agent}", "approve")}
    # The authorizer was asked first, with the tool and its arguments.
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [
        ["retry_job", {"job_id": seed.failed}],
        ["cancel_job", {"job_id": seed.waiting}],
        ["signal", {"job_id": seed.agent, "name": "approve", "payload": {"ok": True}}],
        ["steer_job", {"job_id": seed.agent, "payload": {"instruction": "shorter"}}],
    ]
    assert "Traceback" not in errlog.read_text()


def test_stdio_server_exits_at_once_on_sigterm_with_stdin_still_open(db_url: str) -> None:
    """The SDK reads stdin in a thread no cancellation reaches; SIGTERM must not
    wait for the client to close the pipe."""
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", "-m", "belay", "mcp", "--url", db_url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}}}
        proc.stdin.write(json.dumps(hello).encode() + b"\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no answer to initialize within 30 s"
        answer = json.loads(proc.stdout.readline())
        assert answer["id"] == 1 and answer["result"]["serverInfo"]["name"] == "belay"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


# -- 3. streamable HTTP ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for_port(port: int, proc: subprocess.Popen[str], stderr: TextIO,
                   timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr.seek(0)
            raise AssertionError(f"belay mcp exited {proc.returncode}: {stderr.read()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"belay mcp did not listen on {port} within {timeout} s")


def test_streamable_http_serves_tools_and_stops_cleanly_on_sigterm(
    db_url: str, seed: Seed, tmp_path: Path
) -> None:
    port = _free_port()
    with (tmp_path / "http-stderr.txt").open("w+", encoding="utf-8") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "belay", "mcp", "--url", db_url,
             "--transport", "http", "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
            cwd=REPO, env={k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"},
        )
        try:
            _wait_for_port(port, proc, stderr)

            async def body(mcp: Client) -> tuple[Any, CallToolResult]:
                got = ok(await mcp.call_tool("list_jobs", {"state": "failed"}))
                return got, await mcp.call_tool("cancel_job", {"job_id": seed.waiting})
            listed, cancel = session(f"http://127.0.0.1:{port}/mcp", body)
            assert [j["id"] for j in listed["jobs"]] == [seed.failed]
            assert "mutations are disabled" in refused(cancel)

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        stderr.seek(0)
        logged = stderr.read()
    assert f"serving streamable HTTP at http://127.0.0.1:{port}/mcp" in logged
    assert "Traceback" not in logged


def test_http_on_a_port_in_use_exits_2_naming_the_fix(db_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-W", "error", "-m", "belay", "mcp", "--url", db_url,
             "--transport", "http", "--port", str(port)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd=REPO,
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "choose another --port" in done.stderr
    assert "serving" not in done.stderr


# -- 4. bad arguments and failed calls are tool errors, the server goes on ---------------


def test_bad_arguments_are_tool_errors_with_the_clients_message(
    client: Belay, seed: Seed, sql_conn: Conn
) -> None:
    def message(call: Callable[[], Any]) -> str:
        with pytest.raises((ValidationError, JobNotFound, NotRetryable)) as caught:
            call()
        return str(caught.value)

    server = build_server(client, ops.Guard(allow=True))

    async def body(mcp: Client) -> dict[str, str]:
        calls: dict[str, tuple[str, dict[str, Any]]] = {
            "job_id_text": ("get_job", {"job_id": "seven"}),
            "job_id_missing": ("get_job", {}),
            "limit_type": ("list_jobs", {"limit": "many"}),
            "limit_zero": ("list_jobs", {"limit": 0}),
            "state": ("list_jobs", {"state": "sleeping"}),
            "after": ("job_events", {"job_id": seed.agent, "after": -1}),
            "events_missing": ("job_events", {"job_id": 987654}),
            "events_limit": ("job_events", {"job_id": seed.agent, "limit": 0}),
            "payload_type": ("signal", {"job_id": seed.agent, "name": "x", "payload": [1, 2]}),
            "signal_name": ("signal", {"job_id": seed.agent, "name": ""}),
            "steer_missing": ("steer_job", {"job_id": seed.agent}),
            "mutate_id": ("cancel_job", {"job_id": 0}),
            "cancel_missing": ("cancel_job", {"job_id": 987654}),
            "retry_succeeded": ("retry_job", {"job_id": seed.kid}),
            "no_such_tool": ("drop_everything", {}),
            "nul_kind": ("list_jobs", {"kind": "a\x00b"}),
            # pydantic's lax ints take these as 1, 3 and 10; psycopg can't send the rest.
            "id_bool": ("get_job", {"job_id": True}),
            "id_arabic": ("cancel_job", {"job_id": "\u0663"}),
            "id_underscore": ("retry_job", {"job_id": "1_0"}),
            "id_superscript": ("get_job", {"job_id": "\u00b2"}),
            "id_huge": ("list_jobs", {"before_id": 2**70}),
            "after_huge": ("job_events", {"job_id": seed.agent, "after": 2**64}),
            "surrogate_kind": ("list_jobs", {"kind": "\ud800"}),
            "long_queue": ("list_jobs", {"queue": "q" * 256}),
            "surrogate_workflow": ("workflow_status", {"workflow_id": "wf\udfff"}),
            "nul_signal": ("signal", {"job_id": seed.agent, "name": "go\x00"}),
            "payload_nul": ("steer_job", {"job_id": seed.agent, "payload": {"a": ["\x00"]}}),
        }
        out = {key: refused(await mcp.call_tool(tool, args))
               for key, (tool, args) in calls.items()}
        # Still serving, and the calls changed nothing.
        out["still_serving"] = json.dumps(ok(await mcp.call_tool("get_job", {"job_id": seed.kid})))
        return out

    before = snapshot(sql_conn, seed)
    out = session(server, body)
    assert snapshot(sql_conn, seed) == before
    assert "job_id" in out["job_id_text"] and "integer" in out["job_id_text"]
    assert "job_id" in out["job_id_missing"] and "required" in out["job_id_missing"].lower()
    assert "limit" in out["limit_type"]
    assert "limit is an integer from 1 to 10000, got 0" in out["limit_zero"]
    assert message(lambda: client.list_jobs(state="sleeping")) in out["state"]
    assert "after is an integer from 0 to" in out["after"]
    assert "no job 987654" in out["events_missing"]
    assert "limit is an integer from 1 to 1000, got 0" in out["events_limit"]
    assert "payload" in out["payload_type"]
    assert "signal needs name, a non-empty string" in out["signal_name"]
    assert "payload" in out["steer_missing"] and "required" in out["steer_missing"].lower()
    assert "job_id is a job id (an integer from 1 to 9223372036854775807), got 0" \
        in out["mutate_id"]
    assert message(lambda: client.cancel_job(987654)) in out["cancel_missing"]
    assert message(lambda: client.retry_job(seed.kid)) in out["retry_succeeded"]
    assert "drop_everything" in out["no_such_tool"]
    assert "kind contains a NUL character" in out["nul_kind"]
    for key in ("id_bool", "id_arabic", "id_underscore", "id_superscript"):
        assert "job_id is a job id" in out[key], out[key]
    assert "before_id is an integer from 1 to 9223372036854775807" in out["id_huge"]
    assert "after is an integer from 0 to 9223372036854775807" in out["after_huge"]
    assert "kind contains a lone surrogate" in out["surrogate_kind"]
    assert "queue is 256 bytes long; the limit is 255" in out["long_queue"]
    assert "workflow_id contains a lone surrogate" in out["surrogate_workflow"]
    assert "name (the signal name) contains a NUL" in out["nul_signal"]
    assert "payload['a'][0] contains a NUL" in out["payload_nul"]
    assert "Error executing tool" in out["surrogate_kind"]  # a tool error, not a crash
    assert json.loads(out["still_serving"])["job"]["state"] == "succeeded"


def test_cancel_of_a_running_job_is_requested_in_memory(
    client: Belay, sql_conn: Conn
) -> None:
    """The in-memory server with mutations allowed: the result is the client's."""
    job_id = running_job(sql_conn, kind="mcp.kid")
    server = build_server(client, ops.Guard(allow=True))

    async def body(mcp: Client) -> Any:
        return ok(await mcp.call_tool("cancel_job", {"job_id": job_id}))

    assert session(server, body) == {"job_id": job_id, "status": "requested"}
    assert job_row(sql_conn, job_id)["cancel_requested"] is True


def test_any_refusal_of_the_database_is_a_tool_error_with_its_reason(
    client: Belay, seed: Seed, sql_conn: Conn
) -> None:
    """Not only a missing privilege: whatever the database refuses (here a
    table gone) comes back as the tool's error with the database's words."""
    sql_conn.execute("ALTER TABLE belay_signals RENAME TO belay_signals_gone")
    try:
        server = build_server(client, ops.Guard(allow=True))

        async def body(mcp: Client) -> str:
            return refused(await mcp.call_tool(
                "signal", {"job_id": seed.agent, "name": "approve"}))
        message = session(server, body)
    finally:
        sql_conn.execute("ALTER TABLE belay_signals_gone RENAME TO belay_signals")
    assert 'the database refused: relation "belay_signals" does not exist' in message


def test_a_read_only_database_role_serves_reads_and_says_why_a_write_failed(
    db_url: str, seed: Seed, sql_conn: Conn
) -> None:
    """A server on a role with SELECT only: reads work; an allowed mutation fails
    with the database's reason, not a bare 'Error executing tool'."""
    role = f"belay_mcp_ro_{os.getpid()}"
    sql_conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'ro-secret'")
    try:
        sql_conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        url = psycopg.conninfo.make_conninfo(db_url, user=role, password="ro-secret")
        with Belay(url) as reader:
            server = build_server(reader, ops.Guard(allow=True))

            async def body(mcp: Client) -> tuple[Any, str]:
                got = ok(await mcp.call_tool("get_job", {"job_id": seed.agent}))
                return got, refused(await mcp.call_tool(
                    "signal", {"job_id": seed.agent, "name": "approve"}))
            got, message = session(server, body)
        assert got["job"]["state"] == "awaiting"
        assert "permission denied for table belay_signals" in message
        assert "grant the server's database role the privilege" in message
        assert job_row(sql_conn, seed.agent)["state"] == "awaiting"
    finally:
        sql_conn.execute(f"DROP OWNED BY {role}")
        sql_conn.execute(f"DROP ROLE {role}")


def test_stdio_schedules_are_read_and_guarded(
    db_url: str, tmp_path: Path, client: Belay
) -> None:
    declare = {"name": "nightly", "expression": "0 3 * * *", "worker": "mcp.agent",
               "overlap": "queue", "options": {"queue": "later"}}

    async def refused_body(mcp: Client) -> CallToolResult:
        return await mcp.call_tool("schedule", declare)

    with stdio(db_url, tmp_path) as (transport, _):
        denied = session(transport, refused_body)
    assert "schedule is refused: mutations are disabled" in refused(denied)
    assert client.schedules() == []

    async def body(mcp: Client) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["declared"] = ok(await mcp.call_tool("schedule", declare))
        out["bad"] = refused(await mcp.call_tool("schedule", {**declare,
                                                              "overlap": "sometimes"}))
        out["listed"] = ok(await mcp.call_tool("schedules", {}))
        out["status"] = ok(await mcp.call_tool("schedule_status", {"name": "nightly"}))
        out["cancelled"] = ok(await mcp.call_tool("cancel_schedule", {"name": "nightly"}))
        out["missing"] = refused(await mcp.call_tool("schedule_status", {"name": "nope"}))
        return out

    with stdio(db_url, tmp_path, "--allow-mutations") as (transport, _):
        out = session(transport, body)
    assert (out["declared"]["schedule"]["overlap"], out["declared"]["schedule"]["options"]) \
        == ("queue", {"queue": "later"})
    assert "overlap is one of skip, queue, allow" in out["bad"]
    assert [s["name"] for s in out["listed"]["schedules"]] == ["nightly"]
    assert out["status"]["next_due"] is not None
    assert out["cancelled"]["schedule"]["cancelled_at"] is not None
    assert "no schedule 'nope'" in out["missing"]
    assert client.schedule_status("nightly").cancelled_at is not None  # type: ignore[union-attr]
