"""Agent jobs for the worker processes of ``tests/test_pydantic_ai.py``.

Imported only by those subprocesses (``belay worker --import tests.pai_jobs``).
The fake model records every call it gets in ``model_calls(job_id, attempt, n)``
over a connection of its own, so the test can count calls across processes,
including one that was killed.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import belay
from belay.integrations.pydantic_ai import BelayDurability, run_agent_job

QUEUE = "pai"
KIND = "pai.research"
#: A held tool gives up after this long (the test has failed by then).
HOLD_BOUND = 30.0


def _conn() -> psycopg.Connection[Any]:
    ctx = belay.current_context()
    assert ctx is not None
    return psycopg.connect(ctx.client.conninfo, autocommit=True)


def _record_call(messages: list[ModelMessage]) -> int:
    """Record this model call in ``model_calls``; returns its turn (1-based)."""
    ctx = belay.current_context()
    assert ctx is not None
    turn = sum(isinstance(m, ModelResponse) for m in messages) + 1
    with _conn() as conn:
        conn.execute("INSERT INTO model_calls (job_id, attempt, n) VALUES (%s, %s, %s)",
                     (ctx.id, ctx.attempt, turn))
    return turn


def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Turn 1 asks for the ``lookup`` tool, turn 2 answers; 100 tokens a call."""
    turn = _record_call(messages)
    usage = RequestUsage(input_tokens=60, output_tokens=40)
    if turn == 1:
        return ModelResponse(parts=[ToolCallPart("lookup", {"topic": "queues"}, tool_call_id="t1")],
                             usage=usage)
    return ModelResponse(parts=[TextPart("Postgres queues are fine")], usage=usage)


agent = Agent(FunctionModel(model), name="researcher",
              capabilities=[BelayDurability(events="none")])


@agent.tool_plain
def lookup(topic: str) -> str:
    """On the first attempt, record that the tool started and hang until killed."""
    ctx = belay.current_context()
    assert ctx is not None
    with _conn() as conn:
        conn.execute("INSERT INTO tool_runs (job_id, attempt) VALUES (%s, %s)",
                     (ctx.id, ctx.attempt))
    if ctx.attempt == 1:
        deadline = time.monotonic() + HOLD_BOUND
        while time.monotonic() < deadline:
            time.sleep(0.02)
        raise TimeoutError("the test never killed this worker")
    return f"notes on {topic}"


def no_backoff(attempt: int) -> float:
    return 0.0


@belay.worker(name=KIND, queue=QUEUE, backoff=no_backoff)
def research(ctx: belay.Context) -> Any:
    return run_agent_job(ctx, agent, ctx.input["question"])


SPENDER = "pai.spender"


def thinking_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for ``think`` forever, 100 tokens a call (a budget must stop it)."""
    turn = _record_call(messages)
    return ModelResponse(parts=[ToolCallPart("think", {"step": turn}, tool_call_id=f"k{turn}")],
                         usage=RequestUsage(input_tokens=100, output_tokens=0))


spender_agent = Agent(FunctionModel(thinking_model), name="spender",
                      capabilities=[BelayDurability(events="none")])


@spender_agent.tool_plain
def think(step: int) -> str:
    return f"thought {step}"


@belay.worker(name=SPENDER, queue=QUEUE, backoff=no_backoff)
def spender(ctx: belay.Context) -> Any:
    """On attempt 1, hold after the crossing call is journaled, before the failing
    ack goes out — the test kills the process there."""
    try:
        return run_agent_job(ctx, spender_agent, "think")
    except belay.BudgetExceeded:
        if ctx.attempt == 1:
            with _conn() as conn:
                conn.execute("INSERT INTO crossed (job_id) VALUES (%s)", (ctx.id,))
            deadline = time.monotonic() + HOLD_BOUND
            while time.monotonic() < deadline:
                time.sleep(0.02)
        raise
