"""``belay demo --agent``: a PydanticAI agent as a durable job, with a fake model.

The agent plans an evening: it looks up the weather, asks to book a table (a tool
that needs approval), and answers. Its model is PydanticAI's ``FunctionModel``
playing a script, so no API key is needed; everything else is real — the journal,
the spend against a budget (a token cap it crosses: the run pauses until an
operator tops it up), the live event stream, the park on a signal.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from belay.client import Belay
from belay.errors import JobCancelled, JobFailed
from belay.registry import Registry, worker
from belay.runner import Worker

Say = Callable[[str], None]

KIND = "demo.evening_planner"
#: The run's token cap: its first model call goes over it, so it pauses.
TOKEN_CAP = 40
#: What the operator adds when it pauses.
TOP_UP_TOKENS = 10_000


def _agent(calls: list[int]) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

    from belay.integrations.pydantic_ai import BelayDurability, request_input

    def turn(messages: list[ModelMessage]) -> int:
        return sum(isinstance(m, ModelResponse) for m in messages)

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        n = turn(messages)
        if n == 0:
            part: Any = ToolCallPart("weather", {"city": "Lisbon"}, tool_call_id="w1")
        elif n == 1:
            part = ToolCallPart("book_table", {"city": "Lisbon", "seats": 2}, tool_call_id="b1")
        else:
            part = TextPart("Sunny in Lisbon: a terrace table for two is booked at 8pm.")
        return ModelResponse(parts=[part])

    async def stream(messages: list[ModelMessage], info: AgentInfo
                     ) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
        calls.append(turn(messages) + 1)  # a real agent pays for this call
        part = script(messages, info).parts[0]
        if isinstance(part, TextPart):
            first, *rest = part.content.split(" ")
            yield first
            for word in rest:
                yield " " + word
        elif isinstance(part, ToolCallPart):
            yield {0: DeltaToolCall(part.tool_name, json.dumps(part.args),
                                    tool_call_id=part.tool_call_id)}

    def price(response: Any) -> float:
        return 0.000003 * int(response.usage.total_tokens)  # $3 per million tokens

    agent = Agent(FunctionModel(script, stream_function=stream), name="planner",
                  capabilities=[BelayDurability(price=price), request_input(name="approve")])

    @agent.tool_plain
    def weather(city: str) -> str:
        return "sunny, 24°C"

    @agent.tool_plain(requires_approval=True)
    def book_table(city: str, seats: int) -> str:
        return f"table for {seats} booked in {city} at 8pm"

    return agent


def _describe(payload: dict[str, Any]) -> str | None:
    kind, data = payload.get("type"), payload.get("data") or {}
    if kind == "pydantic_ai.function_tool_call":
        part = data["part"]
        return f"calls {part['tool_name']}({part['args']})"
    if kind == "pydantic_ai.function_tool_result":
        part = data["part"]
        return f"{part['tool_name']} → {part.get('content')!r}"
    if kind == "pydantic_ai.input_requested":
        wanted = ", ".join(f"{a['tool_name']}({a['args']})" for a in payload["approvals"])
        return f"asks to approve {wanted} (signal {payload['signal']!r})"
    return None


def _parked(client: Belay, job_id: int) -> Any:
    """The job once it is parked (its park is written just after its event)."""
    deadline = time.monotonic() + 30
    while (row := client.get_job(job_id)) is None or row.state != "awaiting":
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent job {job_id} never parked")
        time.sleep(0.05)
    return row


def tour(client: Belay, say: Say, approve: Callable[[], bool]) -> None:
    """Run the agent job on ``client`` with a worker of its own, narrating it."""
    calls: list[int] = []
    agent = _agent(calls)
    registry = Registry()

    from belay.integrations.pydantic_ai import run_agent_job

    @worker(name=KIND, queue="ai", registry=registry)
    def plan_evening(ctx: Any) -> Any:
        return run_agent_job(ctx, agent, ctx.input["ask"])

    say("a PydanticAI agent as a belay job (a scripted model: no API key, real everything else)")
    job = client.enqueue(KIND, {"ask": "Dinner outside in Lisbon tonight?"}, queue="ai",
                         budget={"usd": 0.05, "tokens": TOKEN_CAP, "on_exceed": "pause"})
    say(f"  its budget: $0.05 and {TOKEN_CAP} tokens; over a cap it pauses for a top-up")
    runner = Worker({"ai": 1}, client=client, registry=registry, busy_poll=0.02,
                    poll_interval=0.1, notify=True)
    before = 0
    with runner:
        events = client.subscribe_events(job.id, timeout=60)
        for event in events:
            line = _describe(event.payload)
            if line is not None:
                say(f"  event {event.seq:>2}: the agent {line}")
            kind = event.payload.get("type")
            if kind == "budget_paused":
                row = _parked(client, job.id)
                say(f"  job {job.id} paused over its budget after {row.spent_tokens} tokens "
                    f"(cap {row.budget_tokens}), parked on {row.await_name!r}: no thread, no "
                    "lease")
                topped = client.top_up(job.id, tokens=TOP_UP_TOKENS)
                say(f"  an operator tops it up by {TOP_UP_TOKENS} tokens "
                    f"(`belay top-up {job.id} --tokens {TOP_UP_TOKENS}`): it is {topped.state} "
                    "again and resumes from its journal, paying for no call twice")
            elif kind == "pydantic_ai.input_requested":
                row = _parked(client, job.id)
                signal = row.await_name or ""
                say(f"  job {job.id} is parked on {signal!r}: no thread, no lease, no cost")
                before = len(calls)
                approved = approve()
                client.signal_job(job.id, signal, {"approvals": {"b1": approved}})
                break
        with contextlib.suppress(JobFailed, JobCancelled):
            client.await_result(job.id, timeout=30)
    done = client.get_job(job.id)
    if done is None:
        return
    say(f"  → {done.state}: {done.result}")
    say(f"  model calls paid for: {len(calls)} — after the signal the job ran again from the "
        f"top, replaying {before} from the journal and paying for {len(calls) - before}")
    say(f"  spent ${done.spent_usd:.6f} of $0.05 and {done.spent_tokens} of "
        f"{done.budget_tokens} tokens; journal:")
    for step in client.steps(job.id):
        say(f"    {step.seq}. {step.name}")


def run(url: str | None, say: Say, approve: Callable[[], bool]) -> None:
    # First: without the extra, this import says how to install it (exit 2).
    import belay.integrations.pydantic_ai  # noqa: F401
    from belay.embedded import embedded_server

    if url is None:
        say("starting an embedded PostgreSQL (no --url given)…")
        with embedded_server() as embedded, Belay(embedded, verify_schema=False) as client:
            client.migrate()
            tour(client, say, approve)
        return
    with Belay(url, verify_schema=False) as client:
        client.migrate()
        tour(client, say, approve)
