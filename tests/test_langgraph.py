"""belay.integrations.langgraph: graphs as jobs on LangGraph's PostgresSaver, and
BelayMiddleware for LangChain agents (issue 12, part 2).

Offline: fake chat models (``tests/langgraph_jobs.py``) that answer from the
conversation and count their real calls. In-process runs use ``drain``; the
crash tests ``kill -9`` real worker processes and learn what happened from side
tables, since a killed process's memory is gone.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest


def _require(module: str) -> None:
    """Skip without the integration's packages, except where CI installs them
    (Python >= 3.11 with CI set): there a missing package is a failure."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") and sys.version_info >= (3, 11):
            pytest.fail(f"{module} is missing but CI installs the langgraph extra: {exc}",
                        pytrace=False)
        pytest.skip(f"{module} is not installed (extra 'langgraph', Python >= 3.11)",
                    allow_module_level=True)


for _module in ("langgraph", "langgraph.checkpoint.postgres", "langchain.agents"):
    _require(_module)

from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import StateGraph  # noqa: E402

import belay  # noqa: E402
from belay.errors import ConfigurationError, ValidationError  # noqa: E402
from belay.integrations.langgraph import (  # noqa: E402
    BelayMiddleware,
    close_savers,
    json_safe,
    postgres_saver,
    run_graph,
)
from belay.testing import drain  # noqa: E402
from tests import langgraph_jobs as jobs  # noqa: E402
from tests.helpers import job_row, wait_until  # noqa: E402
from tests.test_worker_processes import Proc  # noqa: E402

Conn = psycopg.Connection[Any]


@pytest.fixture(autouse=True)
def _close_savers() -> Iterator[None]:
    """Each test has a database of its own: close the saver pools before it is dropped."""
    yield
    close_savers()


@pytest.fixture
def registry() -> belay.Registry:
    return belay.Registry()


def run(client: belay.Belay, registry: belay.Registry) -> dict[str, int]:
    return drain(client=client, registry=registry)


def events(client: belay.Belay, job_id: int) -> list[dict[str, Any]]:
    return [e.payload for e in client.events(job_id)]


def step_names(client: belay.Belay, job_id: int) -> list[str]:
    return [s.name for s in client.steps(job_id)]


# -- run_graph: interrupt → signal ----------------------------------------------------------


def test_an_interrupt_parks_the_job_until_its_signal_resumes_the_graph(
    client: belay.Belay, registry: belay.Registry
) -> None:
    n1_runs: list[int] = []

    @belay.worker(name="graph.review", registry=registry)
    def review(ctx: belay.Context) -> Any:
        graph = jobs.two_nodes(lambda: n1_runs.append(ctx.id), jobs.approval)
        return run_graph(ctx, graph, {"log": []})

    job = client.enqueue("graph.review")
    assert run(client, registry) == {"await": 1}
    parked = client.get_job(job.id)
    assert parked is not None and parked.state == "awaiting"
    stream = events(client, job.id)
    asked = [e for e in stream if e["type"] == "langgraph.interrupt"]
    assert len(asked) == 1
    name = asked[0]["signal"]
    assert name == f"interrupt:{asked[0]['id']}" and parked.await_name == name
    assert asked[0]["value"] == {"question": "publish?"}
    assert {"type": "langgraph.updates", "data": {"n1": {"log": ["n1"]}}} in stream
    assert {"type": "langgraph.custom", "data": {"progress": "n1 done"}} in stream

    client.signal_job(job.id, name, {"ok": True})
    assert run(client, registry) == {"succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == {"log": ["n1", "n2:{'ok': True}"]}
    assert n1_runs == [job.id]  # the wake resumed from the checkpoint, not from the top
    after = events(client, job.id)[len(stream):]
    assert {"type": "langgraph.updates", "data": {"n2": {"log": ["n2:{'ok': True}"]}}} in after
    assert not any(e["type"] == "langgraph.interrupt" for e in after)


def test_parallel_interrupts_each_wait_for_their_own_signal(
    client: belay.Belay, registry: belay.Registry
) -> None:
    from langgraph.graph import END, START
    from langgraph.types import interrupt

    def asker(question: str) -> Callable[[jobs.Log], dict[str, Any]]:
        def node(state: jobs.Log) -> dict[str, Any]:
            return {"log": [f"{question}={interrupt(question)}"]}
        return node

    builder = StateGraph(jobs.Log)
    builder.add_node("a", asker("a?"))
    builder.add_node("b", asker("b?"))
    builder.add_edge(START, "a")
    builder.add_edge(START, "b")
    builder.add_edge("a", END)
    builder.add_edge("b", END)
    graph = builder.compile()

    @belay.worker(name="graph.two", registry=registry)
    def two(ctx: belay.Context) -> Any:
        return run_graph(ctx, graph, {"log": []}, signal_prefix="ask:",
                         result=lambda state: sorted(state["log"]))

    job = client.enqueue("graph.two")
    run(client, registry)
    asked = {e["value"]: e["signal"] for e in events(client, job.id)
             if e["type"] == "langgraph.interrupt"}
    assert set(asked) == {"a?", "b?"} and all(s.startswith("ask:") for s in asked.values())
    first = client.get_job(job.id)
    assert first is not None and first.await_name in asked.values()
    other = next(s for s in asked.values() if s != first.await_name)

    client.signal_job(job.id, first.await_name, {"n": 1})
    run(client, registry)
    second = client.get_job(job.id)
    assert second is not None and (second.state, second.await_name) == ("awaiting", other)
    client.signal_job(job.id, other, {"n": 2})
    run(client, registry)
    done = client.get_job(job.id)
    assert done is not None and done.state == "succeeded"
    answers = {asked["a?"]: "a?", asked["b?"]: "b?"}
    expected = {answers[first.await_name]: {"n": 1}, answers[other]: {"n": 2}}
    assert done.result == sorted(f"{q}={a}" for q, a in expected.items())


def test_an_attempt_after_the_graph_finished_returns_its_final_state_without_running_it(
    client: belay.Belay, registry: belay.Registry
) -> None:
    runs: list[str] = []

    def second() -> str:
        runs.append("n2")
        return "x"

    @belay.worker(name="graph.finished", registry=registry, backoff=jobs.no_backoff)
    def finished(ctx: belay.Context) -> Any:
        out = run_graph(ctx, jobs.two_nodes(lambda: runs.append("n1"), second), {"log": []})
        if ctx.attempt == 1:
            raise RuntimeError("lost before the ack")
        return out

    job = client.enqueue("graph.finished")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == {"log": ["n1", "n2:x"]}
    assert runs == ["n1", "n2"]


def test_jobs_on_one_thread_each_run_their_own_turn(
    client: belay.Belay, registry: belay.Registry
) -> None:
    """A shared thread (a conversation, say) is not "finished" for the next job:
    each job streams its own input on top of the earlier turns."""
    @belay.worker(name="graph.turn", registry=registry, backoff=jobs.no_backoff)
    def turn(ctx: belay.Context) -> Any:
        graph = jobs.two_nodes(lambda: None, lambda: ctx.input["say"])
        out = run_graph(ctx, graph, {"log": [ctx.input["say"]]}, thread_id="chat-1")
        if ctx.attempt == 1 and ctx.input["say"] == "second":
            raise RuntimeError("lost before the ack")
        return out

    first = client.enqueue("graph.turn", {"say": "first"})
    run(client, registry)
    second = client.enqueue("graph.turn", {"say": "second"})
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    assert client.get_job(first.id).result == {  # type: ignore[union-attr]
        "log": ["first", "n1", "n2:first"]}
    assert client.get_job(second.id).result == {  # type: ignore[union-attr]
        "log": ["first", "n1", "n2:first", "second", "n1", "n2:second"]}


def test_a_failed_attempt_resumes_from_the_last_checkpoint(
    client: belay.Belay, registry: belay.Registry
) -> None:
    runs: list[tuple[str, int]] = []

    def second() -> str:
        ctx = belay.current_context()  # found through LangGraph's executor thread
        assert ctx is not None
        runs.append(("n2", ctx.attempt))
        if ctx.attempt == 1:
            raise RuntimeError("node 2 failed")
        return "ok"

    @belay.worker(name="graph.retry", registry=registry, backoff=jobs.no_backoff)
    def retry(ctx: belay.Context) -> Any:
        graph = jobs.two_nodes(lambda: runs.append(("n1", ctx.attempt)), second)
        return run_graph(ctx, graph, {"log": []})

    job = client.enqueue("graph.retry")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == {"log": ["n1", "n2:ok"]}
    assert runs == [("n1", 1), ("n2", 1), ("n2", 2)]


def test_nodes_on_langgraphs_executor_threads_find_the_job(
    client: belay.Belay, registry: belay.Registry
) -> None:
    """LangGraph runs parallel nodes on its executor's threads with a copy of the
    context, so ``belay.current_context()`` (a ContextVar) finds the job there."""
    from langgraph.graph import END, START

    seen: dict[str, tuple[int, bool]] = {}
    job_thread: list[int] = []
    both = threading.Barrier(2, timeout=10)  # the two nodes run at the same time

    def node(name: str) -> Callable[[jobs.Log], dict[str, Any]]:
        def run_node(state: jobs.Log) -> dict[str, Any]:
            both.wait()
            ctx = belay.current_context()
            seen[name] = (threading.get_ident(), ctx is not None and ctx.kind == "graph.threads")
            return {"log": [name]}
        return run_node

    builder = StateGraph(jobs.Log)
    for name in ("a", "b"):
        builder.add_node(name, node(name))
        builder.add_edge(START, name)
        builder.add_edge(name, END)
    graph = builder.compile()

    @belay.worker(name="graph.threads", registry=registry)
    def threads(ctx: belay.Context) -> Any:
        job_thread.append(threading.get_ident())
        return run_graph(ctx, graph, {"log": []}, result=lambda state: sorted(state["log"]))

    job = client.enqueue("graph.threads")
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == ["a", "b"]  # type: ignore[union-attr]
    assert all(found for _, found in seen.values())
    assert {ident for ident, _ in seen.values()} - set(job_thread)  # not all inline


def test_stream_chunks_that_json_cannot_hold_do_not_fail_the_job(
    client: belay.Belay, registry: belay.Registry
) -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    def first() -> None:
        from langgraph.config import get_stream_writer
        get_stream_writer()({"odd": Opaque(), "nan": float("nan"), "set": {1}})

    @belay.worker(name="graph.odd", registry=registry)
    def odd(ctx: belay.Context) -> Any:
        return run_graph(ctx, jobs.two_nodes(first, lambda: "x"), {"log": []},
                         stream_mode="custom", result=lambda state: state["log"][-1])

    job = client.enqueue("graph.odd")
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == "n2:x"  # type: ignore[union-attr]
    custom = [e["data"] for e in events(client, job.id) if e["type"] == "langgraph.custom"]
    assert {"odd": "<opaque>", "nan": "nan", "set": [1]} in custom


def test_run_graph_refuses_bad_inputs_with_the_fix(
    client: belay.Belay, registry: belay.Registry
) -> None:
    graph = jobs.two_nodes(lambda: None, lambda: "x")
    with pytest.raises(ValidationError, match="job's ctx first"):
        run_graph(None, graph, {})  # type: ignore[arg-type]
    outcomes: dict[str, str] = {}

    def attempt(label: str, call: Callable[[belay.Context], Any]) -> None:
        @belay.worker(name=f"graph.bad.{label}", registry=registry)
        def bad(ctx: belay.Context) -> Any:
            try:
                call(ctx)
            except (ValidationError, ConfigurationError) as exc:
                outcomes[label] = str(exc)
            return None
        client.enqueue(f"graph.bad.{label}")

    builder = StateGraph(jobs.Log)
    builder.add_node("n", lambda s: {"log": []})
    builder.set_entry_point("n")
    attempt("uncompiled", lambda ctx: run_graph(ctx, builder, {}))
    attempt("not-a-graph", lambda ctx: run_graph(ctx, object(), {}))
    attempt("mode", lambda ctx: run_graph(ctx, graph, {}, stream_mode=["updates", "nope"]))
    attempt("breakpoint", lambda ctx: run_graph(
        ctx, builder.compile(interrupt_before=["n"]), {}))
    attempt("no-saver", lambda ctx: run_graph(ctx, builder.compile(checkpointer=False), {}))
    attempt("prefix", lambda ctx: run_graph(ctx, graph, {}, signal_prefix=""))
    run(client, registry)
    assert "builder.compile()" in outcomes["uncompiled"]
    assert "compiled LangGraph graph" in outcomes["not-a-graph"]
    assert "'nope'" in outcomes["mode"]
    assert "interrupt()" in outcomes["breakpoint"]
    assert "compile without one" in outcomes["no-saver"]
    assert "signal_prefix" in outcomes["prefix"]
    with pytest.raises(ValidationError, match=r"belay\.Belay client or a database URL"):
        postgres_saver(42)  # type: ignore[arg-type]


def test_postgres_saver_sets_up_its_tables_once_per_database(client: belay.Belay,
                                                             sql_conn: Conn) -> None:
    first, second = postgres_saver(client), postgres_saver(client.conninfo)
    assert first is not second and first.conn is second.conn  # one pool, a saver per run
    row = sql_conn.execute("SELECT count(*) FROM checkpoint_migrations").fetchone()
    assert row is not None and row[0] == len(first.MIGRATIONS)


def test_json_safe_gives_json_for_messages_models_and_anything_else() -> None:
    from langchain_core.messages import AIMessage
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int

    safe = json_safe({"m": AIMessage("hi", id="m1"), "p": Point(x=1), 3: (1, 2.5)})
    assert safe["m"]["type"] == "ai" and safe["m"]["data"]["content"] == "hi"
    assert safe["p"] == {"x": 1} and safe["3"] == [1, 2.5]


# -- BelayMiddleware in process ---------------------------------------------------------------


def agent_worker(registry: belay.Registry, name: str, calls: list[int], *, rounds: int = 1,
                 middleware: list[Any] | None = None, fail_first: bool = False,
                 via: str = "invoke", **options: Any) -> None:
    @belay.worker(name=name, registry=registry, backoff=jobs.no_backoff, **options)
    def agent_job(ctx: belay.Context) -> Any:
        model = jobs.ScriptedModel(rounds=rounds, on_call=lambda: calls.append(ctx.attempt))
        agent = create_agent(model, tools=[jobs.add_tool()],
                             middleware=middleware or [BelayMiddleware()])
        message = {"messages": [("user", "add")]}
        if via == "run_graph":
            out = run_graph(ctx, agent, message)
        elif via == "ainvoke":
            out = json_safe(asyncio.run(agent.ainvoke(message)))
        else:
            out = json_safe(agent.invoke(message))
        if fail_first and ctx.attempt == 1:
            raise RuntimeError("fail after the agent finished")
        return out["messages"][-1]["data"]["content"]


def test_the_middleware_journals_model_and_tool_calls_and_replays_them(
    client: belay.Belay, registry: belay.Registry
) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.replay", calls, rounds=2, fail_first=True)
    job = client.enqueue("agent.replay")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == "done after 2 tool calls"
    assert calls == [1, 1, 1]  # three model calls, all on attempt 1: attempt 2 replayed
    # No checkpointer: model calls are keyed by their order in the run.
    assert step_names(client, job.id) == [
        "langchain:model:#:1", "langchain:tool:#:call-1:1", "langchain:model:#:2",
        "langchain:tool:#:call-2:1", "langchain:model:#:3"]
    assert (done.spent_tokens, done.spent_usd) == (3 * jobs.TOKENS, 0)


def test_a_replayed_structured_response_is_rebuilt_as_its_schema(
    client: belay.Belay, registry: belay.Registry
) -> None:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str

    class Structured(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Structured:  # type: ignore[override]
            return self

    calls: list[int] = []

    def answers() -> Iterator[AIMessage]:
        while True:
            calls.append(1)
            yield AIMessage("", tool_calls=[{"name": "Answer", "args": {"city": "Lisbon"},
                                             "id": "s1"}])

    @belay.worker(name="agent.structured", registry=registry, backoff=jobs.no_backoff)
    def structured(ctx: belay.Context) -> Any:
        agent = create_agent(Structured(messages=answers()), tools=[], response_format=Answer,
                             middleware=[BelayMiddleware()])
        out = agent.invoke({"messages": [("user", "where?")]})
        if ctx.attempt == 1:
            raise RuntimeError("fail after the agent finished")
        answer = out["structured_response"]
        return {"type": type(answer).__name__, "city": answer.city}

    job = client.enqueue("agent.structured")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    assert client.get_job(job.id).result == {"type": "Answer", "city": "Lisbon"}  # type: ignore[union-attr]
    assert calls == [1]


def test_a_tool_answering_with_a_command_is_journaled_and_rebuilt(
    client: belay.Belay, registry: belay.Registry
) -> None:
    tool_runs: list[int] = []
    add_command = jobs.add_command_tool(tool_runs)

    @belay.worker(name="agent.command", registry=registry, backoff=jobs.no_backoff)
    def command(ctx: belay.Context) -> Any:
        agent = create_agent(jobs.ScriptedModel(rounds=1), tools=[add_command],
                             middleware=[BelayMiddleware()])
        out = agent.invoke({"messages": [("user", "add")]})
        if ctx.attempt == 1:
            raise RuntimeError("fail after the agent finished")
        return [type(m).__name__ + ":" + str(m.content) for m in out["messages"]]

    job = client.enqueue("agent.command")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    assert client.get_job(job.id).result == [  # type: ignore[union-attr]
        "HumanMessage:add", "AIMessage:", "ToolMessage:1", "AIMessage:done after 1 tool calls"]
    assert tool_runs == [1]


def test_a_tool_answer_the_journal_cannot_hold_fails_with_the_fix(
    client: belay.Belay, registry: belay.Registry
) -> None:
    @belay.worker(name="agent.parent", registry=registry)
    def parent(ctx: belay.Context) -> Any:
        agent = create_agent(jobs.ScriptedModel(rounds=1), tools=[jobs.parent_command_tool()],
                             middleware=[BelayMiddleware()])
        return agent.invoke({"messages": [("user", "add")]})

    job = client.enqueue("agent.parent")
    assert run(client, registry) == {"failed": 1}  # at once: a retry would pay again
    failed = client.get_job(job.id)
    assert failed is not None
    assert "a Command with a dict update and node names as goto" in str(failed.errors[-1])


def test_async_agents_journal_through_astep(client: belay.Belay, registry: belay.Registry) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.async", calls, rounds=1, fail_first=True, via="ainvoke",
                 middleware=[BelayMiddleware(price=lambda message: 0.25)])
    job = client.enqueue("agent.async")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == "done after 1 tool calls"
    assert calls == [1, 1]
    assert (done.spent_tokens, done.spent_usd) == (2 * jobs.TOKENS, 0.5)


def test_concurrent_async_agents_in_one_job_get_keys_of_their_own_tasks(
    client: belay.Belay, registry: belay.Registry
) -> None:
    calls: list[str] = []
    saver = InMemorySaver()

    @belay.worker(name="agent.pair", registry=registry)
    def pair(ctx: belay.Context) -> Any:
        async def one(label: str) -> Any:
            model = jobs.ScriptedModel(rounds=2, on_call=lambda: calls.append(label))
            agent = create_agent(model, tools=[jobs.add_tool()],
                                 middleware=[BelayMiddleware()], checkpointer=saver)
            out = await agent.ainvoke({"messages": [("user", label)]},
                                      {"configurable": {"thread_id": f"{ctx.id}-{label}"}})
            return out["messages"][-1].content

        async def both() -> list[Any]:
            return list(await asyncio.gather(one("a"), one("b")))

        return asyncio.run(both())

    job = client.enqueue("agent.pair")
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == ["done after 2 tool calls"] * 2  # type: ignore[union-attr]
    assert sorted(calls) == ["a"] * 3 + ["b"] * 3
    names = step_names(client, job.id)
    models = [n for n in names if n.startswith("langchain:model:")]
    # Keyed by LangGraph task (checkpoint_ns "model:<task id>"), one call per task.
    assert len(models) == len(set(models)) == 6
    assert all(n.startswith("langchain:model:model:") and n.endswith(":1") for n in models)


def test_with_a_checkpointer_a_model_call_journaled_before_a_crash_is_not_repeated(
    client: belay.Belay, registry: belay.Registry
) -> None:
    """The model task's id is the same when the thread resumes from its checkpoint,
    so its journal key is too: a failure after the call was journaled but before
    the node's checkpoint costs no second call."""
    calls: list[int] = []

    class FailAfterFirstCall(AgentMiddleware):  # type: ignore[type-arg]
        def wrap_model_call(self, request: ModelRequest,
                            handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
            response = handler(request)
            ctx = belay.current_context()
            if ctx is not None and ctx.attempt == 1:
                raise RuntimeError("crash after the journal entry, before the checkpoint")
            return response

    agent_worker(registry, "agent.ckpt", calls, via="run_graph",
                 middleware=[FailAfterFirstCall(), BelayMiddleware()])
    job = client.enqueue("agent.ckpt")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    done = client.get_job(job.id)
    assert done is not None and done.result == "done after 1 tool calls"
    assert calls == [1, 2]  # the first call replayed on attempt 2; the second is new
    models = [n for n in step_names(client, job.id) if n.startswith("langchain:model:")]
    assert len(models) == 2 and all(n.startswith("langchain:model:model:") for n in models)


def test_a_budget_crossing_stops_the_agent_at_that_call(
    client: belay.Belay, registry: belay.Registry
) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.budget", calls, rounds=5)
    job = client.enqueue("agent.budget", budget={"tokens": 20})
    assert run(client, registry) == {"failed": 1}
    failed = client.get_job(job.id)
    assert failed is not None and failed.state == "failed"
    assert failed.errors[-1]["error"] == "budget_exceeded"
    assert calls == [1, 1]  # the second call crossed 20 tokens; no third
    assert failed.spent_tokens == 2 * jobs.TOKENS


def test_a_tool_outside_the_jobs_authority_fails_the_job_before_it_runs(
    client: belay.Belay, registry: belay.Registry
) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.authority", calls, rounds=2)
    allowed = client.enqueue("agent.authority", authority={"tools": ["add"]})
    refused = client.enqueue("agent.authority", authority={"tools": ["search"]})
    assert run(client, registry) == {"succeeded": 1, "failed": 1}
    assert client.get_job(allowed.id).state == "succeeded"  # type: ignore[union-attr]
    failed = client.get_job(refused.id)
    assert failed is not None and failed.state == "failed" and failed.attempt == 1
    assert failed.errors[-1]["error"] == (
        f"authority exceeded: tool 'add' is not allowed to job {refused.id} "
        "(it may call search)")
    assert not [n for n in step_names(client, refused.id) if n.startswith("langchain:tool:")]


def test_fresh_model_calls_debit_the_rate_window(
    client: belay.Belay, registry: belay.Registry, sql_conn: Conn
) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.rate", calls, fail_first=True,
                 middleware=[BelayMiddleware(rate_resource="fake", rate_period=60)])
    client.enqueue("agent.rate")
    run(client, registry)
    assert calls == [1, 1]
    row = sql_conn.execute("SELECT sum(count) FROM belay_rate WHERE bucket = 'resource:fake'"
                           ).fetchone()
    assert row is not None and row[0] == 2 * jobs.TOKENS  # replays debit nothing


def test_the_middleware_passes_through_outside_a_job() -> None:
    calls: list[int] = []
    model = jobs.ScriptedModel(rounds=1, on_call=lambda: calls.append(1))
    agent = create_agent(model, tools=[jobs.add_tool()], middleware=[BelayMiddleware()])
    out = agent.invoke({"messages": [("user", "add")]})
    assert out["messages"][-1].content == "done after 1 tool calls" and calls == [1, 1]
    assert asyncio.run(agent.ainvoke({"messages": [("user", "add")]}))["messages"][-1].content \
        == "done after 1 tool calls"


def test_the_middleware_refuses_bad_options() -> None:
    with pytest.raises(ValidationError, match="price is a function"):
        BelayMiddleware(price=0.01)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="rate_resource is a non-empty string"):
        BelayMiddleware(rate_resource="")
    with pytest.raises(ValidationError, match="rate_period needs rate_resource"):
        BelayMiddleware(rate_period=60)


# -- kill -9 a worker process ---------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
posix = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
ENTRY = """
import logging, sys
import belay
from tests.langgraph_jobs import REGISTRY
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
url, node = sys.argv[1], sys.argv[2]
belay.Worker({"q": 2}, client=belay.Belay(url), registry=REGISTRY, lease_ttl=1.0,
             poll_interval=0.1, busy_poll=0.025, sweep_interval=0.2, node_id=node).run()
"""


@pytest.fixture
def workers(db_url: str, tmp_path: Path) -> Iterator[Callable[[str], Proc]]:
    procs: list[Proc] = []

    def start(node: str) -> Proc:
        proc = Proc([sys.executable, "-W", "error", "-c", ENTRY, db_url, node],
                    tmp_path / f"{node}.log")
        procs.append(proc)
        return proc.started()

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture
def side_tables(sql_conn: Conn) -> Conn:
    for table in ("node_runs (job_id bigint, node text, pid int)",
                  "model_calls (job_id bigint, pid int)", "tool_runs (job_id bigint, pid int)",
                  "crossed (job_id bigint, pid int)", "released (job_id bigint)"):
        sql_conn.execute(f"CREATE TABLE {table}")
    return sql_conn


@pytest.fixture
def producer(db_url: str) -> Iterator[belay.Belay]:
    with belay.Belay(db_url) as instance:
        yield instance


def rows(conn: Conn, query: str, job_id: int) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(query, (job_id,))]


def state(conn: Conn, job_id: int) -> str:
    return str(job_row(conn, job_id)["state"])


def kill(proc: Proc) -> None:
    proc.send(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


@posix
def test_a_killed_graph_run_resumes_from_its_last_checkpoint(
    workers: Callable[[str], Proc], side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = workers("node-a")
    job = producer.enqueue(jobs.GRAPH, queue=jobs.QUEUE)
    nodes = "SELECT node, pid FROM node_runs WHERE job_id = %s ORDER BY node, pid"
    wait_until(lambda: rows(conn, nodes, job.id) == [("n1", a.pid), ("n2", a.pid)],
               "A ran n1 and holds in n2", timeout=20)
    kill(a)
    conn.execute("INSERT INTO released (job_id) VALUES (%s)", (job.id,))
    b = workers("node-b")
    wait_until(lambda: state(conn, job.id) == "succeeded", "B completes the job", timeout=20)
    assert producer.get_job(job.id).result == {"log": ["n1", "n2:done"]}  # type: ignore[union-attr]
    # n1 ran once, in A: B resumed at n2 from the checkpoint A wrote.
    assert rows(conn, nodes, job.id) == [("n1", a.pid), ("n2", a.pid), ("n2", b.pid)]
    assert job_row(conn, job.id)["attempt"] == 2


@posix
def test_a_killed_agent_does_not_repeat_its_journaled_model_calls(
    workers: Callable[[str], Proc], side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = workers("node-a")
    job = producer.enqueue(jobs.AGENT, queue=jobs.QUEUE)
    tools = "SELECT pid FROM tool_runs WHERE job_id = %s ORDER BY pid"
    models = "SELECT pid FROM model_calls WHERE job_id = %s ORDER BY pid"
    wait_until(lambda: rows(conn, tools, job.id) == [(a.pid,)], "A's tool holds", timeout=20)
    assert rows(conn, models, job.id) == [(a.pid,)]
    kill(a)
    b = workers("node-b")
    wait_until(lambda: state(conn, job.id) == "succeeded", "B completes the job", timeout=20)
    assert producer.get_job(job.id).result == "done after 1 tool calls"  # type: ignore[union-attr]
    # The first model call was journaled in A and replayed in B; only the second is B's.
    assert sorted(rows(conn, models, job.id)) == sorted([(a.pid,), (b.pid,)])
    assert sorted(rows(conn, tools, job.id)) == sorted([(a.pid,), (b.pid,)])


@posix
def test_a_budget_crossed_before_a_kill_fails_the_next_attempt_before_any_call(
    workers: Callable[[str], Proc], side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = workers("node-a")
    job = producer.enqueue(jobs.BUDGET, queue=jobs.QUEUE, budget={"tokens": 20})
    crossed = "SELECT pid FROM crossed WHERE job_id = %s"
    wait_until(lambda: rows(conn, crossed, job.id) == [(a.pid,)],
               "A journaled the crossing call and holds before its failing ack", timeout=20)
    assert state(conn, job.id) == "running"
    kill(a)
    workers("node-b")
    wait_until(lambda: state(conn, job.id) == "failed", "B fails the job", timeout=20)
    row = job_row(conn, job.id)
    assert [(e["error"], e["attempt"]) for e in row["errors"]] == [
        ("lease_expired", 1), ("budget_exceeded", 2)]
    # Both model calls were A's; B replayed them and stopped before the next tool
    # call (the pre-flight of the durable spend), so no tool ran twice either.
    models = "SELECT pid FROM model_calls WHERE job_id = %s"
    assert rows(conn, models, job.id) == [(a.pid,), (a.pid,)]
    assert rows(conn, "SELECT pid FROM tool_runs WHERE job_id = %s", job.id) == [(a.pid,)]
    assert row["spent_tokens"] == 2 * jobs.TOKENS


SETUP_RACE = """
import pathlib, sys, time
from belay.integrations.langgraph import close_savers, postgres_saver
url, here, me = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
(here / f"ready-{me}").touch()
while not (here / "go").exists():
    time.sleep(0.005)
postgres_saver(url)
close_savers()
"""


def test_workers_setting_up_the_saver_at_once_on_a_fresh_database_all_succeed(
    db_url: str, tmp_path: Path, sql_conn: Conn
) -> None:
    """setup()'s migrations can't run twice at once, and one of them is a CREATE
    INDEX CONCURRENTLY, which waits for every older snapshot: a setup lock whose
    waiters sat in a blocking lock call would deadlock it."""
    procs = [subprocess.Popen([sys.executable, "-W", "error", "-c", SETUP_RACE, db_url,
                               str(tmp_path), str(n)], cwd=REPO, stderr=subprocess.PIPE)
             for n in range(4)]
    try:
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 4, "all imported", timeout=60)
        (tmp_path / "go").touch()
        for proc in procs:
            assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stderr:
                proc.stderr.close()
    row = sql_conn.execute("SELECT count(*), count(DISTINCT v) FROM checkpoint_migrations"
                           ).fetchone()
    assert row is not None and row[0] == row[1] > 0


# -- Review findings: several turns in one job, agents as tools, price errors --------------


def test_two_run_graph_calls_on_one_thread_in_one_job_each_run_their_input(
    client: belay.Belay, registry: belay.Registry
) -> None:
    @belay.worker(name="graph.two_turns", registry=registry, backoff=jobs.no_backoff)
    def two_turns(ctx: belay.Context) -> Any:
        graph = jobs.two_nodes(lambda: None, lambda: "x")
        first = run_graph(ctx, graph, {"log": ["turn 1"]}, thread_id="chat-2")
        second = run_graph(ctx, graph, {"log": ["turn 2"]}, thread_id="chat-2")
        if ctx.attempt == 1:
            raise RuntimeError("lost before the ack: the retry must not run them again")
        return [first["log"], second["log"]]

    job = client.enqueue("graph.two_turns")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    turn1 = ["turn 1", "n1", "n2:x"]
    assert client.get_job(job.id).result == [turn1, [*turn1, "turn 2", "n1", "n2:x"]]  # type: ignore[union-attr]


def test_an_agent_used_as_a_tool_journals_its_calls_under_the_tool_call(
    client: belay.Belay, registry: belay.Registry
) -> None:
    from langchain_core.tools import tool

    sub_calls: list[tuple[int, int]] = []

    @belay.worker(name="agent.lead", registry=registry, backoff=jobs.no_backoff)
    def lead(ctx: belay.Context) -> Any:
        def sub_answer(a: int) -> None:
            sub_calls.append((ctx.attempt, a))
            if a == 1 and ctx.attempt == 1:
                raise ConnectionError("the sub-agent's provider failed once")

        @tool
        def add(a: int, b: int) -> int:
            """Add two integers, after asking a sub-agent."""
            sub = create_agent(jobs.ScriptedModel(rounds=0, on_call=lambda: sub_answer(a)),
                               tools=[], middleware=[BelayMiddleware()])
            sub.invoke({"messages": [("user", f"check {a}")]})
            return a + b

        agent = create_agent(jobs.ScriptedModel(rounds=2), tools=[add],
                             middleware=[BelayMiddleware()])
        out = json_safe(agent.invoke({"messages": [("user", "add twice")]}))
        return out["messages"][-1]["data"]["content"]

    job = client.enqueue("agent.lead")
    assert run(client, registry) == {"retry": 1, "succeeded": 1}
    assert client.get_job(job.id).result == "done after 2 tool calls"  # type: ignore[union-attr]
    # The first tool call's sub-agent ran once; on attempt 2 that tool call replayed.
    assert sub_calls == [(1, 0), (1, 1), (2, 1)]
    inner = [n for n in step_names(client, job.id)
             if n.startswith("langchain:model:langchain:tool:")]
    assert inner == [  # each sub-agent's model call, keyed under its tool call
        "langchain:model:langchain:tool:#:call-1:1/#:1",
        "langchain:model:langchain:tool:#:call-2:1/#:1"]


def test_a_failing_price_function_names_price(
    client: belay.Belay, registry: belay.Registry
) -> None:
    calls: list[int] = []
    agent_worker(registry, "agent.badprice", calls,
                 middleware=[BelayMiddleware(price=lambda m: m.usage_metadata["nope"])])
    job = client.enqueue("agent.badprice")
    run(client, registry)
    failed = client.get_job(job.id)
    assert failed is not None and failed.state == "failed" and failed.attempt == 1
    assert "BelayMiddleware(price=...) failed" in failed.errors[-1]["error"]
