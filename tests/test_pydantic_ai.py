"""PydanticAI agents as belay jobs (issue 12): ``BelayDurability`` and ``run_agent_job``.

Offline only: PydanticAI's ``TestModel`` and ``FunctionModel``, which count their
calls. In-process runs go through ``belay.testing.drain`` (the worker's own
claim/run/ack path); the crash test kills a real worker process.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

if sys.version_info < (3, 11) or not os.environ.get("CI"):
    pytest.importorskip("pydantic_ai", reason="the pydantic-ai extra needs Python >= 3.11")
else:  # CI on a Python that can install it: a missing package is a failure, not a skip
    importlib.import_module("pydantic_ai")

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RequestUsage

import belay
from belay.integrations.pydantic_ai import (
    BelayDurability,
    request_input,
    run_agent,
    run_agent_job,
)
from belay.testing import drain
from tests.helpers import wait_until
from tests.test_worker_processes import Proc

Conn = psycopg.Connection[Any]
REPO = Path(__file__).resolve().parent.parent


class Script:
    """A FunctionModel body that plays a list of responses and counts its calls."""

    def __init__(self, *responses: ModelResponse) -> None:
        self.responses = list(responses)
        self.calls = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(isinstance(m, ModelResponse) for m in messages)
        self.calls += 1
        return self.responses[turn]


def tool_call(name: str, args: dict[str, Any], call_id: str, tokens: int = 0) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=call_id)],
                         usage=RequestUsage(input_tokens=tokens, output_tokens=0))


def text(content: str, tokens: int = 0) -> ModelResponse:
    return ModelResponse(parts=[TextPart(content)],
                         usage=RequestUsage(input_tokens=tokens, output_tokens=0))


@pytest.fixture
def agents() -> belay.Registry:
    return belay.Registry()


@pytest.fixture
def jobs(db_url: str, clock: belay.ManualClock, agents: belay.Registry
         ) -> Iterator[belay.Belay]:
    with belay.Belay(db_url, clock=clock, registry=agents) as instance:
        yield instance


def run(jobs: belay.Belay, agents: belay.Registry, queue: str = "default") -> dict[str, int]:
    return drain(queue, client=jobs, registry=agents)


# -- The result a plain run gives, journaled -----------------------------------------------


def test_a_job_returns_what_a_plain_run_returns_and_journals_each_call(jobs, agents):
    model = TestModel()
    agent = Agent(model, name="plain", capabilities=[BelayDurability()])

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    @belay.worker(name="plain", registry=agents)
    def plain(ctx):
        return run_agent_job(ctx, agent, "add two numbers")

    expected = asyncio.run(agent.run("add two numbers")).output  # outside a job: no belay at all
    job = jobs.enqueue("plain")
    assert run(jobs, agents) == {"succeeded": 1}
    done = jobs.get_job(job.id)
    assert done.result == expected
    names = [step.name for step in jobs.steps(job.id)]
    assert names == [
        f"ai:{job.id}.1/plain__model.request_stream#1",
        f"ai:{job.id}.1/plain__function_toolset__<agent>.call_tool:add@1:pyd_ai_tool_call_id__add",
        f"ai:{job.id}.1/plain__model.request_stream#2",
    ]
    assert done.spent_tokens > 0
    kinds = [event.payload["type"] for event in jobs.events(job.id)]
    assert "pydantic_ai.function_tool_call" in kinds
    assert "pydantic_ai.function_tool_result" in kinds
    assert "pydantic_ai.final_result" in kinds
    assert not any(kind == "pydantic_ai.part_delta" for kind in kinds)  # the summary filter


def test_a_retry_replays_journaled_model_calls_and_tool_calls(jobs, agents):
    script = Script(tool_call("fetch", {"url": "a"}, "c1"),
                    tool_call("parse", {"page": "A"}, "c2"),
                    text("done"))
    agent = Agent(FunctionModel(script), name="retry",
                  capabilities=[BelayDurability(events="none")])
    ran: list[str] = []

    @agent.tool_plain
    def fetch(url: str) -> str:
        ran.append("fetch")
        return url.upper()

    @agent.tool_plain
    def parse(page: str) -> str:
        ran.append("parse")
        ctx = belay.current_context()
        assert ctx is not None
        if ctx.attempt == 1:
            raise ConnectionError("parser down")  # fails the run after two model calls
        return page.lower()

    @belay.worker(name="retry", registry=agents, backoff=lambda attempt: 0)
    def retry(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("retry")
    assert run(jobs, agents) == {"retry": 1, "succeeded": 1}
    done = jobs.get_job(job.id)
    assert (done.state, done.attempt, done.result) == ("succeeded", 2, "done")
    assert script.calls == 3  # two on attempt 1, only the third on attempt 2
    assert ran == ["fetch", "parse", "parse"]  # the journaled fetch did not run again


def tool_steps(ctx: belay.Context) -> list[belay.Step]:
    return [s for s in ctx.client.steps(ctx.id) if "call_tool" in s.name]


def test_parallel_tool_calls_are_keyed_by_call_id(jobs, agents):
    script = Script(
        ModelResponse(parts=[ToolCallPart("slow", {"n": n}, tool_call_id=f"p{n}")
                             for n in range(4)]),
        text("all four"),
    )
    agent = Agent(FunctionModel(script), name="fan", capabilities=[BelayDurability(events="none")])
    started: list[tuple[int, int]] = []
    gate: dict[str, Any] = {}

    @agent.tool_plain
    async def slow(n: int) -> int:
        ctx = belay.current_context()
        assert ctx is not None
        started.append((ctx.attempt, n))
        if ctx.attempt == 1:
            # Every call waits until all four are in flight: they really overlap.
            gate["arrived"] += 1
            if gate["arrived"] == 4:
                gate["all"].set()
            await asyncio.wait_for(gate["all"].wait(), timeout=10)
            if n == 2:  # fails once the other three are journaled
                await asyncio.to_thread(wait_until, lambda: len(tool_steps(ctx)) == 3,
                                        "the other three calls were journaled")
                raise ConnectionError("one of four failed")
        return n * n

    @belay.worker(name="fan", registry=agents, backoff=lambda attempt: 0)
    def fan(ctx):
        async def main() -> Any:
            gate.update(arrived=0, all=asyncio.Event())
            return (await run_agent(ctx, agent, "go")).output
        return asyncio.run(main())

    job = jobs.enqueue("fan")
    assert run(jobs, agents) == {"retry": 1, "succeeded": 1}
    assert jobs.get_job(job.id).result == "all four"
    journaled = {s.name.rsplit(":", 1)[1]: s.value
                 for s in jobs.steps(job.id) if "call_tool" in s.name}
    assert journaled == {f"p{n}": {"kind": "tool_return", "result": n * n} for n in range(4)}
    # Attempt 2 re-ran only what attempt 1 did not journal: the failed call.
    assert sorted(started) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 2)]
    assert script.calls == 2


# -- Authority -----------------------------------------------------------------------------


def test_a_tool_outside_the_jobs_authority_fails_the_job_before_it_runs(jobs, agents):
    ran: list[str] = []
    agent = Agent(FunctionModel(Script(tool_call("lookup", {"topic": "x"}, "c1"),
                                       tool_call("delete", {"path": "/"}, "c2"),
                                       text("done"))),
                  name="guarded", capabilities=[BelayDurability(events="none")])

    @agent.tool_plain
    def lookup(topic: str) -> str:
        ran.append("lookup")
        return topic

    @agent.tool_plain
    def delete(path: str) -> str:
        ran.append("delete")
        return path

    @belay.worker(name="guarded", registry=agents)
    def guarded(ctx):
        return run_agent_job(ctx, agent, "tidy up")

    job = jobs.enqueue("guarded", authority={"tools": ["lookup"]})
    assert run(jobs, agents) == {"failed": 1}
    failed = jobs.get_job(job.id)
    assert failed.attempt == 1 and failed.errors[-1]["authority_exceeded"] is True
    assert failed.errors[-1]["error"] == (
        f"authority exceeded: tool 'delete' is not allowed to job {job.id} "
        "(it may call lookup)")
    assert ran == ["lookup"]  # the refused tool never ran
    open_job = jobs.enqueue("guarded", authority={"tools": ["delete", "lookup"]})
    assert run(jobs, agents) == {"succeeded": 1}
    assert jobs.get_job(open_job.id).result == "done" and ran == ["lookup", "lookup", "delete"]


# -- Budgets -------------------------------------------------------------------------------


def looping_agent(name: str, script: Script, **options: Any) -> Agent[None, str]:
    agent = Agent(FunctionModel(script), name=name,
                  capabilities=[BelayDurability(events="none", **options)])

    @agent.tool_plain
    def think(step: int) -> str:
        return f"thought {step}"

    return agent


def test_a_budget_crossing_stops_the_agent_and_holds_after_a_crash(jobs, agents, sql_conn):
    script = Script(*(tool_call("think", {"step": n}, f"k{n}", tokens=100) for n in range(10)))
    agent = looping_agent("spender", script)

    @belay.worker(name="spender", registry=agents)
    def spender(ctx):
        return run_agent_job(ctx, agent, "think forever")

    job = jobs.enqueue("spender", budget={"tokens": 250})
    run(jobs, agents)
    failed = jobs.get_job(job.id)
    assert failed.state == "failed"
    assert failed.errors[-1]["error"] == "budget_exceeded"
    assert failed.spent_tokens == 300  # the third call crossed 250: no fourth call
    assert script.calls == 3

    # A crash between journaling the crossing call and the failing ack: the job is
    # back in the queue with its journal and spend. The next attempt replays the
    # three calls and fails before paying for anything more.
    sql_conn.execute("UPDATE belay_jobs SET state = 'ready', errors = '[]' WHERE id = %s",
                     (job.id,))
    run(jobs, agents)
    again = jobs.get_job(job.id)
    assert again.state == "failed"
    assert again.errors[-1]["error"] == "budget_exceeded"
    assert script.calls == 3
    assert again.spent_tokens == 300


def test_dollars_come_from_the_price_function_and_tokens_feed_the_rate_window(
        jobs, agents, sql_conn):
    script = Script(tool_call("think", {"step": 1}, "k1", tokens=1_000), text("ok", tokens=500))
    agent = looping_agent("priced", script, price=lambda r: r.usage.total_tokens * 0.00001,
                          rate_resource="llm")
    jobs.put_queue("ai", rate={"allowed": 100_000, "period": 60, "resource": "llm",
                               "estimate": 2_000})

    @belay.worker(name="priced", queue="ai", registry=agents)
    def priced(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("priced")
    assert run(jobs, agents, "ai") == {"succeeded": 1}
    done = jobs.get_job(job.id)
    assert (done.spent_tokens, done.spent_usd) == (1_500, pytest.approx(0.015))
    # The claim debited the 2,000 estimate; the first debit credited it back.
    window = sql_conn.execute(
        "SELECT sum(count) FROM belay_rate WHERE bucket = 'resource:llm'").fetchone()
    assert window == (1_500,)


def test_a_budget_spans_sub_agents_run_as_child_jobs(jobs, agents):
    """A tool delegates to a sub-agent in a child job with a share of the budget;
    at fan-in the child's spend is charged to the parent, whose next call then
    finds the budget gone."""
    child_script = Script(*(tool_call("think", {"step": n}, f"c{n}", tokens=100)
                            for n in range(10)))
    child_agent = looping_agent("child", child_script)
    parent_script = Script(tool_call("delegate", {"topic": "queues"}, "d1", tokens=100),
                           text("summary", tokens=100))
    parent_agent = Agent(FunctionModel(parent_script), name="lead",
                         capabilities=[BelayDurability(events="none")])

    @parent_agent.tool_plain
    def delegate(topic: str) -> Any:
        ctx = belay.current_context()
        assert ctx is not None
        [kid] = ctx.map_children(f"research-{topic}", "pai.child", [{"topic": topic}],
                                 budget="share")
        return kid.result if kid.state == "succeeded" else f"sub-agent {kid.state}"

    @belay.worker(name="pai.child", queue="kids", registry=agents)
    def child(ctx):
        return run_agent_job(ctx, child_agent, ctx.input["topic"])

    @belay.worker(name="pai.lead", registry=agents)
    def lead(ctx):
        return run_agent_job(ctx, parent_agent, "research queues")

    job = jobs.enqueue("pai.lead", budget={"tokens": 500})
    run(jobs, agents)  # the parent's first call (100), then it parks on the child
    [kid] = jobs.list_jobs(parent_id=job.id)
    assert kid.budget_tokens == 400
    run(jobs, agents, "kids")  # the child thinks until its 400 is crossed
    assert jobs.get_job(kid.id).errors[-1]["error"] == "budget_exceeded"
    assert child_script.calls == 5
    run(jobs, agents)  # the parent is charged 500 at fan-in: 600 > 500
    done = jobs.get_job(job.id)
    assert done.state == "failed" and done.errors[-1]["error"] == "budget_exceeded"
    assert done.spent_tokens == 600
    assert parent_script.calls == 1  # no second parent call was paid for


def test_rate_resource_without_a_rate_is_refused_before_paying(jobs, agents):
    script = Script(text("never"))
    agent = looping_agent("norate", script, rate_resource="openai")

    @belay.worker(name="norate", registry=agents)
    def norate(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("norate")
    run(jobs, agents)
    error = jobs.get_job(job.id).errors[-1]["error"]
    assert "rate_period=<seconds>" in error and script.calls == 0


def test_belay_replay_serves_the_agent_from_the_journal(jobs, agents):
    from belay import replay

    script = Script(tool_call("think", {"step": 1}, "k1"), text("done"))
    agent = looping_agent("replayed", script)

    @belay.worker(name="replayed", registry=agents)
    def replayed(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("replayed")
    assert run(jobs, agents) == {"succeeded": 1}
    report = replay.dry_run(jobs, job.id, registry=agents)
    assert (report.outcome, report.diverged, report.value) == ("ok", False, "done")
    assert script.calls == 2  # the replay called no model


# -- Approvals through signals -------------------------------------------------------------


def approval_agent(script: Script, deleted: list[str]) -> Agent[None, str]:
    agent = Agent(FunctionModel(script), name="ops",
                  capabilities=[BelayDurability(events="none"), request_input(name="approve")])

    @agent.tool_plain(requires_approval=True)
    def delete_table(table: str) -> str:
        deleted.append(table)
        return f"dropped {table}"

    return agent


@pytest.mark.parametrize("approved", [True, False])
def test_an_approval_parks_the_job_and_a_signal_resumes_it(jobs, agents, approved):
    script = Script(tool_call("delete_table", {"table": "scratch"}, "d1"), text("finished"))
    deleted: list[str] = []
    agent = approval_agent(script, deleted)

    @belay.worker(name="ops", registry=agents)
    def ops(ctx):
        return run_agent_job(ctx, agent, "clean up")

    job = jobs.enqueue("ops")
    run(jobs, agents)
    waiting = jobs.get_job(job.id)
    assert waiting.state == "awaiting"
    asked = [e.payload for e in jobs.events(job.id)
             if e.payload["type"] == "pydantic_ai.input_requested"]
    assert len(asked) == 1
    assert asked[0]["signal"] == waiting.await_name
    assert asked[0]["approvals"] == [
        {"tool_call_id": "d1", "tool_name": "delete_table", "args": {"table": "scratch"}}]
    assert deleted == [] and script.calls == 1

    jobs.signal_job(job.id, waiting.await_name, {"approvals": {"d1": approved}})
    assert run(jobs, agents) == {"succeeded": 1}
    done = jobs.get_job(job.id)
    assert done.result == "finished"
    assert deleted == (["scratch"] if approved else [])
    assert script.calls == 2  # the first call replayed from the journal
    # The model saw the tool's answer, or the denial.
    final_request = script_messages(jobs, job.id)
    assert ("dropped scratch" in final_request) is approved
    # The ask ran once: resuming did not emit a second request.
    assert sum(e.payload["type"] == "pydantic_ai.input_requested"
               for e in jobs.events(job.id)) == 1


def script_messages(jobs: belay.Belay, job_id: int) -> str:
    return str([s.value for s in jobs.steps(job_id)])


def test_a_tool_can_wait_for_a_signal_itself(jobs, agents):
    script = Script(tool_call("ask_human", {"question": "ship it?"}, "h1"), text("shipped"))
    agent = Agent(FunctionModel(script), name="human",
                  capabilities=[BelayDurability(events="none")])

    @agent.tool_plain
    def ask_human(question: str) -> Any:
        ctx = belay.current_context()
        assert ctx is not None
        return ctx.await_signal("answer")  # parks; the tool runs again on the signal

    @belay.worker(name="human", registry=agents)
    def human(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("human")
    run(jobs, agents)
    assert jobs.get_job(job.id).await_name == "answer"
    jobs.signal_job(job.id, "answer", {"ship": True})
    assert run(jobs, agents) == {"succeeded": 1}
    tool = [s.value for s in jobs.steps(job.id) if "call_tool:ask_human" in s.name]
    assert [(v["kind"], v["result"]) for v in tool] == [("tool_return", {"ship": True})]
    assert script.calls == 2


def test_a_wait_for_input_times_out_into_a_denial(jobs, agents, clock):
    from datetime import timedelta

    script = Script(tool_call("delete_table", {"table": "t"}, "d1"), text("gave up"))
    deleted: list[str] = []
    agent = Agent(FunctionModel(script), name="ops2",
                  capabilities=[BelayDurability(events="none"),
                                request_input(timeout=timedelta(hours=1))])

    @agent.tool_plain(requires_approval=True)
    def delete_table(table: str) -> str:
        deleted.append(table)
        return "dropped"

    @belay.worker(name="ops2", registry=agents)
    def ops2(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("ops2")
    run(jobs, agents)
    assert jobs.get_job(job.id).state == "awaiting"
    clock.advance(3_601)
    assert run(jobs, agents) == {"succeeded": 1}
    assert jobs.get_job(job.id).result == "gave up"
    assert deleted == []


# -- Events, outside a job, misuse ---------------------------------------------------------


def test_events_all_streams_deltas_and_a_user_handler_sees_every_event(jobs, agents):
    seen: list[str] = []

    async def handler(run_ctx: RunContext[None], stream: Any) -> None:
        async for event in stream:
            seen.append(event.event_kind)

    agent = Agent(TestModel(custom_output_text="hello there world"), name="talk",
                  capabilities=[BelayDurability(events="all", event_stream_handler=handler)])

    @belay.worker(name="talk", registry=agents)
    def talk(ctx):
        return run_agent_job(ctx, agent, "hi")

    job = jobs.enqueue("talk")
    assert run(jobs, agents) == {"succeeded": 1}
    kinds = [e.payload["type"].removeprefix("pydantic_ai.") for e in jobs.events(job.id)]
    assert "part_delta" in kinds
    assert kinds == seen


def test_outside_a_job_the_capability_changes_nothing():
    script = Script(tool_call("add", {"a": 1, "b": 2}, "c1"), text("3"))
    agent = Agent(FunctionModel(script), name="free", capabilities=[BelayDurability(events="none")])

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    result = asyncio.run(agent.run("1+2"))
    assert result.output == "3"
    assert isinstance(result.all_messages()[2].parts[0], ToolReturnPart)


def test_misuse_gets_messages_that_name_the_fix(jobs, agents):
    bare = Agent(TestModel(), name="bare")

    @belay.worker(name="bare", registry=agents)
    def bare_job(ctx):
        return run_agent_job(ctx, bare, "hi")

    job = jobs.enqueue("bare")
    run(jobs, agents)
    error = jobs.get_job(job.id).errors[-1]["error"]
    assert "capabilities=[BelayDurability()]" in error

    with pytest.raises(belay.ConfigurationError, match="stream_function"):
        Agent(FunctionModel(lambda m, i: text("x")), name="fm", capabilities=[BelayDurability()])
    with pytest.raises(belay.ConfigurationError, match="events is"):
        BelayDurability(events="loud")  # type: ignore[arg-type]

    durable = Agent(TestModel(), name="loopy", capabilities=[BelayDurability()])

    @belay.worker(name="loopy", registry=agents)
    def loopy(ctx):
        async def inside() -> Any:
            return run_agent_job(ctx, durable, "hi")
        return asyncio.run(inside())

    job = jobs.enqueue("loopy")
    run(jobs, agents)
    assert "await run_agent(ctx, agent" in jobs.get_job(job.id).errors[-1]["error"]


def test_run_agent_from_async_code_of_your_own(jobs, agents):
    agent = Agent(TestModel(), name="asy", capabilities=[BelayDurability(events="none")])

    @belay.worker(name="asy", registry=agents)
    def asy(ctx):
        async def main() -> Any:
            first = await run_agent(ctx, agent, "one")
            second = await run_agent(ctx, agent, "two")
            return [first.output, second.output]
        return asyncio.run(main())

    job = jobs.enqueue("asy")
    assert run(jobs, agents) == {"succeeded": 1}
    runs = {s.name.split("/")[0] for s in jobs.steps(job.id)}
    assert runs == {f"ai:{job.id}.1", f"ai:{job.id}.2"}  # two runs, two key spaces


# -- A worker process killed mid-run -------------------------------------------------------


@pytest.fixture
def side_tables(sql_conn: Conn) -> Conn:
    sql_conn.execute("CREATE TABLE model_calls (job_id bigint, attempt int, n int)")
    sql_conn.execute("CREATE TABLE tool_runs (job_id bigint, attempt int)")
    sql_conn.execute("CREATE TABLE crossed (job_id bigint)")
    return sql_conn


def worker_process(db_url: str, log: Path) -> Proc:
    env_args = [sys.executable, "-m", "belay", "worker", "--url", db_url,
                "--import", "tests.pai_jobs", "--queue", "pai=2", "--lease-ttl", "1",
                "--poll-interval", "0.1"]
    return Proc(env_args, log).started()


def test_a_killed_worker_resumes_without_repeating_model_calls(db_url, side_tables, tmp_path):
    first = worker_process(db_url, tmp_path / "first.log")
    try:
        with belay.Belay(db_url) as producer:
            job = producer.enqueue("pai.research", {"question": "which queue?"}, queue="pai",
                                   budget={"tokens": 10_000})

            def tool_started() -> bool:
                return side_tables.execute("SELECT 1 FROM tool_runs").fetchone() is not None

            wait_until(tool_started, "the tool started on attempt 1", timeout=20)
            first.kill()  # kill -9 while the tool runs: model call 1 is journaled
            second = worker_process(db_url, tmp_path / "second.log")
            try:
                wait_until(lambda: producer.get_job(job.id).state == "succeeded",
                           "the job finished on the second worker", timeout=30)
            finally:
                second.kill()
            done = producer.get_job(job.id)
    finally:
        first.kill()
    assert done.result == "Postgres queues are fine"
    calls = side_tables.execute(
        "SELECT attempt, n FROM model_calls ORDER BY attempt, n").fetchall()
    # Turn 1 ran once, on attempt 1; attempt 2 replayed it and paid only for turn 2.
    assert calls == [(1, 1), (2, 2)]
    assert side_tables.execute("SELECT attempt FROM tool_runs ORDER BY attempt").fetchall() \
        == [(1,), (2,)]
    assert done.spent_tokens == 200


# -- Review findings: sub-agents in tools, journaled retries, debits, prices --------------


def test_sub_agents_in_tools_keep_their_own_journal_keys_across_a_retry(jobs, agents):
    """A tool that runs a sub-agent: on the retry the first tool call replays (its
    sub-agent doesn't run), and the second sub-agent must still get its own keys,
    not the first one's."""
    sub_calls: list[str] = []

    def sub_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        topic = str(messages[0].parts[-1].content)  # type: ignore[union-attr]
        sub_calls.append(topic)
        ctx = belay.current_context()
        assert ctx is not None
        if topic == "B" and ctx.attempt == 1:
            raise ConnectionError("the sub-agent's provider failed once")
        return text(f"answer about {topic}")

    sub = Agent(FunctionModel(sub_model), name="sub", capabilities=[BelayDurability(events="none")])
    lead_script = Script(tool_call("delegate", {"topic": "A"}, "d1"),
                         tool_call("delegate", {"topic": "B"}, "d2"),
                         text("done"))
    lead = Agent(FunctionModel(lead_script), name="lead",
                 capabilities=[BelayDurability(events="none")])
    answers: list[str] = []

    @lead.tool_plain
    async def delegate(topic: str) -> str:
        answer = (await sub.run(topic)).output
        answers.append(answer)
        return answer

    @belay.worker(name="pai.lead2", registry=agents, backoff=lambda attempt: 0)
    def lead_job(ctx):
        return run_agent_job(ctx, lead, "two topics")

    job = jobs.enqueue("pai.lead2")
    assert run(jobs, agents) == {"retry": 1, "succeeded": 1}
    assert answers == ["answer about A", "answer about B"]
    assert sub_calls == ["A", "B", "B"]  # A ran once; B failed, then ran again
    subs = sorted(s.name for s in jobs.steps(job.id) if "sub__model" in s.name)
    assert len(subs) == 2 and len({n.split("/sub__")[0] for n in subs}) == 2


def test_a_model_retry_is_journaled_so_replay_and_retries_do_not_run_the_tool_again(
        jobs, agents):
    from pydantic_ai import ModelRetry

    from belay import replay

    script = Script(tool_call("poll", {"n": 1}, "p0"), tool_call("poll", {"n": 2}, "p1"),
                    text("ready"))
    agent = Agent(FunctionModel(script), name="poller",
                  capabilities=[BelayDurability(events="none")])
    polls: list[int] = []

    @agent.tool_plain
    def poll(n: int) -> str:
        polls.append(n)
        if n == 1:
            raise ModelRetry("not ready yet, poll again")
        ctx = belay.current_context()
        assert ctx is not None
        if ctx.attempt == 1:
            raise ConnectionError("crash after the retry was journaled")
        return "ready"

    @belay.worker(name="poller", registry=agents, backoff=lambda attempt: 0)
    def poller(ctx):
        return run_agent_job(ctx, agent, "wait until ready")

    job = jobs.enqueue("poller")
    assert run(jobs, agents) == {"retry": 1, "succeeded": 1}
    assert polls == [1, 2, 2]  # the ModelRetry'd call did not run again on attempt 2
    report = replay.dry_run(jobs, job.id, registry=agents)
    assert (report.outcome, report.diverged) == ("ok", False)


def test_the_crossing_calls_tokens_reach_the_rate_window(jobs, agents, sql_conn):
    script = Script(*(tool_call("think", {"step": n}, f"k{n}", tokens=100) for n in range(5)))
    agent = looping_agent("crossing", script, rate_resource="llm", rate_period=60)

    @belay.worker(name="crossing", registry=agents)
    def crossing(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("crossing", budget={"tokens": 150})
    run(jobs, agents)
    assert jobs.get_job(job.id).errors[-1]["error"] == "budget_exceeded"
    window = sql_conn.execute(
        "SELECT sum(count) FROM belay_rate WHERE bucket = 'resource:llm'").fetchone()
    assert window == (200,)  # both calls, the crossing one included


def test_a_failing_price_function_names_price(jobs, agents):
    script = Script(text("x"))
    agent = looping_agent("badprice", script, price=lambda response: response.usage.nope)

    @belay.worker(name="badprice", registry=agents)
    def badprice(ctx):
        return run_agent_job(ctx, agent, "go")

    job = jobs.enqueue("badprice")
    run(jobs, agents)
    failed = jobs.get_job(job.id)
    assert failed.state == "failed" and failed.attempt == 1
    assert "BelayDurability(price=...) failed" in failed.errors[-1]["error"]
    assert "returns its dollars" in failed.errors[-1]["error"]


def test_a_budget_crossed_before_a_kill_fails_the_next_attempt_before_any_call(
        db_url, side_tables, tmp_path):
    first = worker_process(db_url, tmp_path / "first.log")
    try:
        with belay.Belay(db_url) as producer:
            job = producer.enqueue("pai.spender", queue="pai", budget={"tokens": 250})
            wait_until(lambda: side_tables.execute("SELECT 1 FROM crossed").fetchone(),
                       "the crossing call was journaled and the worker holds", timeout=20)
            assert producer.get_job(job.id).state == "running"
            first.kill()  # the failing ack never went out
            second = worker_process(db_url, tmp_path / "second.log")
            try:
                wait_until(lambda: producer.get_job(job.id).state == "failed",
                           "the second worker failed the job", timeout=30)
            finally:
                second.kill()
            failed = producer.get_job(job.id)
    finally:
        first.kill()
    assert [(e["error"], e["attempt"]) for e in failed.errors] == [
        ("lease_expired", 1), ("budget_exceeded", 2)]
    # Three calls, all on attempt 1: attempt 2 replayed them and stopped at the
    # pre-flight before the next call.
    assert side_tables.execute("SELECT attempt, n FROM model_calls ORDER BY n").fetchall() \
        == [(1, 1), (1, 2), (1, 3)]
    assert failed.spent_tokens == 300
