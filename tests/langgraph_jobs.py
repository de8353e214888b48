"""Graphs, agents and job functions for ``tests/test_langgraph.py``.

The worker processes of its kill tests import this module and run the kinds of
:data:`REGISTRY` (a registry of its own, so importing it from the test process
adds nothing to the default one). Each run records what it did in the test's
side tables over a connection of its own (autocommit), so the database shows
which process did what even after a ``kill -9``:

- ``node_runs(job_id, node, pid)``: a graph node started;
- ``model_calls(job_id, pid)``: the fake chat model was really called;
- ``tool_runs(job_id, pid)``: a tool really ran;
- ``crossed(job_id, pid)``: a model call crossed the job's budget;
- ``released(job_id)``: the test lets a held run go on.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

import psycopg
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, InjectedToolCallId, tool
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

import belay
from belay.integrations.langgraph import BelayMiddleware, run_graph

QUEUE = "q"
GRAPH = "lg.graph"  # node n1, then n2 holds until released
AGENT = "lg.agent"  # an agent without checkpointer; its tool holds on attempt 1
BUDGET = "lg.budget"  # an agent whose second model call crosses a 20-token budget
TOKENS = 15  # every fake model answer uses this many tokens
HOLD_BOUND = 30.0  # a held run gives up after this long (the test failed by then)

REGISTRY = belay.Registry()


def no_backoff(attempt: int) -> float:
    """Retry at once: a reclaimed job runs again without the default 2 to 4 s wait."""
    return 0.0


# -- side tables ------------------------------------------------------------------------


def record(ctx: belay.Context, query: str, *args: Any) -> None:
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        conn.execute(query, (ctx.id, *args, os.getpid()))


def hold(ctx: belay.Context) -> None:
    """Block until the test inserts ``released(job_id)`` (it kills us first)."""
    deadline = time.monotonic() + HOLD_BOUND
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        while conn.execute("SELECT 1 FROM released WHERE job_id = %s", (ctx.id,)).fetchone() \
                is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {ctx.id} was never released")
            time.sleep(0.02)


# -- a fake chat model that answers from the conversation -------------------------------


class ScriptedModel(BaseChatModel):
    """Asks for ``add`` until ``rounds`` tool answers are in, then answers.

    Its answer depends only on the conversation, never on how often it was
    called, so a replayed call and a real one can't be told apart by the agent;
    ``on_call`` counts the real ones.
    """

    rounds: int = 1
    on_call: Callable[[], None] | None = None

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:
        if self.on_call is not None:
            self.on_call()
        done = sum(isinstance(m, ToolMessage) for m in messages)
        usage = {"input_tokens": TOKENS - 5, "output_tokens": 5, "total_tokens": TOKENS}
        if done < self.rounds:
            message = AIMessage("", usage_metadata=usage, tool_calls=[
                {"name": "add", "args": {"a": done, "b": 1}, "id": f"call-{done + 1}"}])
        else:
            message = AIMessage(f"done after {done} tool calls", usage_metadata=usage)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self


def add_tool(before: Callable[[], None] | None = None) -> BaseTool:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        if before is not None:
            before()
        return a + b

    return add


def add_command_tool(runs: list[int]) -> BaseTool:
    """``add`` answering with a ``Command`` that appends its ToolMessage."""

    @tool("add")
    def add(a: int, b: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
        """Add two integers."""
        runs.append(a + b)
        return Command(update={"messages": [ToolMessage(str(a + b), tool_call_id=tool_call_id)]})

    return add


def parent_command_tool() -> BaseTool:
    """``add`` answering with a Command for the parent graph (not journalable)."""

    @tool("add")
    def add(a: int, b: int) -> Command[Any]:
        """Add two integers."""
        return Command(graph=Command.PARENT, goto="elsewhere")

    return add


# -- a two-node graph ---------------------------------------------------------------------


class Log(TypedDict):
    log: Annotated[list[str], operator.add]


def two_nodes(first: Callable[[], None], second: Callable[[], Any]) -> Any:
    """START → n1 → n2 → END; n1 also writes a custom stream chunk; n2 appends
    whatever ``second()`` returns (an ``interrupt(...)`` answer, say)."""

    def n1(state: Log) -> dict[str, Any]:
        first()
        get_stream_writer()({"progress": "n1 done"})
        return {"log": ["n1"]}

    def n2(state: Log) -> dict[str, Any]:
        return {"log": [f"n2:{second()}"]}

    builder = StateGraph(Log)
    builder.add_node("n1", n1)
    builder.add_node("n2", n2)
    builder.add_edge(START, "n1")
    builder.add_edge("n1", "n2")
    builder.add_edge("n2", END)
    return builder.compile()


def approval() -> Any:
    return interrupt({"question": "publish?"})


# -- kinds for the worker processes ----------------------------------------------------


@belay.worker(name=GRAPH, queue=QUEUE, backoff=no_backoff, registry=REGISTRY)
def graph_job(ctx: belay.Context) -> Any:
    def n1() -> None:
        record(ctx, "INSERT INTO node_runs (job_id, node, pid) VALUES (%s, 'n1', %s)")

    def n2() -> str:
        record(ctx, "INSERT INTO node_runs (job_id, node, pid) VALUES (%s, 'n2', %s)")
        hold(ctx)
        return "done"

    return run_graph(ctx, two_nodes(n1, n2), {"log": []})


def counted_model(ctx: belay.Context, rounds: int) -> ScriptedModel:
    return ScriptedModel(rounds=rounds, on_call=lambda: record(
        ctx, "INSERT INTO model_calls (job_id, pid) VALUES (%s, %s)"))


@belay.worker(name=AGENT, queue=QUEUE, backoff=no_backoff, registry=REGISTRY)
def agent_job(ctx: belay.Context) -> Any:
    def before() -> None:
        record(ctx, "INSERT INTO tool_runs (job_id, pid) VALUES (%s, %s)")
        if ctx.attempt == 1:
            hold(ctx)

    agent = create_agent(counted_model(ctx, rounds=1), tools=[add_tool(before)],
                         middleware=[BelayMiddleware()])
    out = agent.invoke({"messages": [("user", "add 0 and 1")]})
    return out["messages"][-1].content


class StallOnBudget(AgentMiddleware):  # type: ignore[type-arg]
    """Outside BelayMiddleware: when a model call crosses the budget on attempt 1,
    record it and hold, so the test can kill the process after the crossing step
    is journaled and before the worker acks the failure."""

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> ModelResponse:
        ctx = belay.current_context()
        assert ctx is not None
        try:
            return handler(request)
        except belay.BudgetExceeded:
            if ctx.attempt == 1:
                record(ctx, "INSERT INTO crossed (job_id, pid) VALUES (%s, %s)")
                hold(ctx)
            raise


@belay.worker(name=BUDGET, queue=QUEUE, backoff=no_backoff, registry=REGISTRY)
def budget_job(ctx: belay.Context) -> Any:
    def before() -> None:
        record(ctx, "INSERT INTO tool_runs (job_id, pid) VALUES (%s, %s)")

    agent = create_agent(counted_model(ctx, rounds=2), tools=[add_tool(before)],
                         middleware=[StallOnBudget(), BelayMiddleware()])
    out = agent.invoke({"messages": [("user", "add twice")]})
    return out["messages"][-1].content
