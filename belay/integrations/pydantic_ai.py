"""PydanticAI agents as durable belay jobs (extra ``pydantic-ai``).

:class:`BelayDurability` is a durability capability built on PydanticAI's backend API
(``pydantic_ai.durable_exec.BaseDurabilityCapability``, pinned to 2.68). Inside a
belay job, every model request and every tool call of the agent is a belay step:

- a model request is journaled under ``ai:<run>/<agent>__model.request#<n>`` (the
  n-th of its run; a run's requests are sequential), and its usage goes into the job's
  spend in the same transaction: tokens from the response's usage, dollars from
  ``price`` (default: genai-prices' price for the model, when it knows the model), so
  the job's budget holds across retries and crashes;
- a tool call is journaled under its run step and tool-call id, so parallel tool calls
  keep their keys whatever order they finish in; its outcome is journaled whatever it
  is (a ``ModelRetry`` too), except ``ApprovalRequired`` and ``CallDeferred``, which
  ask again on the next attempt; an agent run started inside a tool (a sub-agent)
  numbers its journal keys under the tool call's;
- waits for input (``RequestInput``, ``wait_for_external_event``) are signals: the job
  parks on ``await_signal`` and the signal's payload is the answer;
- the run's events go to ``ctx.emit`` as they happen (tool calls and results, final
  result; text deltas only with ``events="all"``).

belay's core is synchronous, the agent loop is async: :func:`run_agent_job` runs the
agent on an event loop of the job's own thread (``asyncio.run``), and the journal reads
and writes go through ``asyncio.to_thread`` so parallel tool calls overlap their
database round trips (``ctx.astep`` does the same for code of your own).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar, Literal

try:
    from pydantic import JsonValue, TypeAdapter
    from pydantic_ai.agent import EventStreamHandler
    from pydantic_ai.agent.abstract import AbstractAgent
    from pydantic_ai.capabilities import RequestInput, WrapRunHandler
    from pydantic_ai.durable_exec import (
        JSON_CODEC,
        BaseDurabilityCapability,
        DurabilityEngineSpec,
        DurableOperationId,
        EventStreamHandlerId,
        JournalCallableOperationBackend,
        ModelCompactMessagesId,
        ModelRequestId,
        RoleBasedOperationConfig,
        ToolsetCallToolId,
        ToolsetValidateToolArgumentsId,
        conversation_id_from_run_id,
    )
    from pydantic_ai.external_events import (
        ExternalEventError,
        ExternalEventWaiter,
        external_event_scope,
    )
    from pydantic_ai.messages import (
        AgentStreamEvent,
        ModelResponse,
        PartDeltaEvent,
    )
    from pydantic_ai.models import Model
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.run import AgentRunResult
    from pydantic_ai.tools import AgentDepsT, DeferredToolRequests, RunContext
    from pydantic_core import to_jsonable_python
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "belay.integrations.pydantic_ai needs PydanticAI 2.68 (Python >= 3.11): "
        "pip install 'belay[pydantic-ai]'"
    ) from exc

from belay.authority import check_tool
from belay.context import TIMEOUT, Context, Cost, current_context
from belay.errors import ConfigurationError
from belay.outcome import describe

__all__ = ["BelayDurability", "request_input", "run_agent", "run_agent_job"]

ENGINE = "belay"

#: Tool outcomes that are not journaled: the call asks again on the next attempt
#: (an approved or answered call then runs under the same key). Every other
#: outcome — a return, a ModelRetry, a failure — is journaled like a value.
_ASKS_AGAIN = frozenset({"approval_required", "call_deferred"})

#: The journal key of the durable unit running in this task: agent runs started
#: inside it (a sub-agent in a tool) number themselves under it.
_UNIT: ContextVar[str | None] = ContextVar("belay_pydantic_ai_unit", default=None)

_RESPONSE = TypeAdapter(ModelResponse)
_EVENT: TypeAdapter[AgentStreamEvent] = TypeAdapter(AgentStreamEvent)

#: Prices a model response in dollars (None: unknown, counted as 0).
Price = Callable[[ModelResponse], "float | Decimal | None"]
EventFilter = Literal["summary", "all", "none"] | Callable[[AgentStreamEvent], bool]


# -- Per-execution bookkeeping ----------------------------------------------------------


@dataclass
class _Execution:
    """What one execution of a job counts: its agent runs (at the top, and within
    each durable unit) and, per run, each operation's calls. A retry starts from
    zero and counts again in the same order, which is what makes the journal keys
    line up: a unit replayed from the journal starts no runs, and counts under
    other units and at the top don't move."""

    counters: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_run(self, scope: str) -> str:
        """The next run id under ``scope`` (the job, or a durable unit's key)."""
        return f"{scope}.{self.next('run:' + scope)}"

    def next(self, key: str) -> int:
        with self.lock:
            n = self.counters.get(key, 0) + 1
            self.counters[key] = n
            return n


_EXECUTIONS: weakref.WeakKeyDictionary[Context, _Execution] = weakref.WeakKeyDictionary()
_EXECUTIONS_LOCK = threading.Lock()


def _execution(ctx: Context) -> _Execution:
    with _EXECUTIONS_LOCK:
        found = _EXECUTIONS.get(ctx)
        if found is None:
            found = _EXECUTIONS[ctx] = _Execution()
        return found


def _job() -> Context:
    ctx = current_context()
    if ctx is None:  # pragma: no cover - the base asks in_durable_context first
        raise ConfigurationError("a belay durable unit ran outside a belay job")
    return ctx


def _run_id(cache_key: Sequence[object]) -> str:
    for part in reversed(cache_key):
        if isinstance(part, RunContext):
            return part.run_id or "run"
    return "run"


def _run_context(cache_key: Sequence[object]) -> RunContext[Any] | None:
    return next((p for p in cache_key if isinstance(p, RunContext)), None)


# -- Cost -------------------------------------------------------------------------------


def default_price(response: ModelResponse) -> Decimal | None:
    """genai-prices' price of ``response``, or None for a model it doesn't know."""
    try:
        return response.cost().total_price
    except Exception:  # unknown model or provider: genai-prices raises LookupError and kin
        return None


def _response_cost(price: Price) -> Callable[[Any], Cost]:
    def cost(payload: Any) -> Cost:
        response = _RESPONSE.validate_python(payload)
        try:
            usd = float(price(response) or 0)
        except Exception as exc:
            raise ConfigurationError(
                f"BelayDurability(price=...) failed on a response of {response.model_name!r}: "
                f"{describe(exc)}; price gets the ModelResponse and returns its "
                "dollars (a float or Decimal) or None"
            ) from exc
        return Cost(usd=usd, tokens=response.usage.total_tokens)

    return cost


# -- The operation backend --------------------------------------------------------------


_NO_CONFIG = RoleBasedOperationConfig[None](model=None, event=None, capability=None, tool=None)


class _BelayBackend(JournalCallableOperationBackend[None]):
    """Runs each durable unit as a belay step of the current job."""

    def __init__(self, capability: BelayDurability[Any]) -> None:
        super().__init__(agent_name=capability.name, default_model_id=capability.default_model_id,
                         config=_NO_CONFIG)
        self._capability = capability

    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Awaitable[object]],
        cache_key: tuple[object, ...],
        config: None,
    ) -> object:
        # Events are not journaled (ctx.emit never is); validating arguments is pure.
        if isinstance(operation_id, EventStreamHandlerId | ToolsetValidateToolArgumentsId):
            return await body()
        ctx = _job()
        run = _run_id(cache_key)
        if isinstance(operation_id, ToolsetCallToolId):
            run_ctx = _run_context(cache_key)
            assert run_ctx is not None
            # Before anything runs or replays: a tool outside the job's authority.
            check_tool(run_ctx.tool_name or name)
            key = f"ai:{run}/{name}@{run_ctx.run_step}:{run_ctx.tool_call_id}"
        else:
            key = f"ai:{run}/{name}#{_execution(ctx).next(f'{run}/{name}')}"
        hit, value = await asyncio.to_thread(ctx.journal.lookup, key)
        if hit:
            return value
        unit = _UNIT.set(key)
        try:
            payload = await body()
        finally:
            _UNIT.reset(unit)
        if isinstance(operation_id, ToolsetCallToolId) and isinstance(payload, Mapping) \
                and payload.get("kind") in _ASKS_AGAIN:
            return payload
        priced = isinstance(operation_id, ModelRequestId | ModelCompactMessagesId)
        cost = _response_cost(self._capability.price) if priced else None
        try:
            return await asyncio.to_thread(ctx.journal.record, key, payload, cost, None)
        finally:
            # The tokens were used whether or not the call crossed the budget.
            if priced and self._capability.rate_resource is not None:
                tokens = _RESPONSE.validate_python(payload).usage.total_tokens
                await asyncio.to_thread(ctx.debit, self._capability.rate_resource, tokens,
                                        period=self._capability.rate_period)


class _SignalWaiter(ExternalEventWaiter):
    """``wait_for_external_event`` inside a job: the token is a signal name."""

    def __init__(self, ctx: Context, run: str) -> None:
        self._ctx = ctx
        self._run = run

    async def wait(
        self, name: str, *, ask: Callable[[str], Awaitable[JsonValue]], timeout: timedelta | None
    ) -> JsonValue:
        ctx = self._ctx
        base = f"ai:{self._run}/wait:{name}"
        signal = f"{base}#{_execution(ctx).next(base)}"
        # ask runs once: its answer (None: "I handed the token on") is journaled.
        answer = await ctx.astep(f"{signal}:ask", lambda: ask(signal))
        if answer is not None:
            return answer
        seconds = None if timeout is None else timeout.total_seconds()
        payload = await asyncio.to_thread(ctx.await_signal, signal, seconds)  # parks the job
        if payload is TIMEOUT:
            raise ExternalEventError(f"no signal {signal!r} arrived within {timeout}")
        return payload  # type: ignore[no-any-return]


# -- The capability ---------------------------------------------------------------------


@dataclass(init=False)
class BelayDurability(BaseDurabilityCapability[AgentDepsT]):
    """Makes an agent durable inside belay jobs; outside a job it changes nothing.

    ``price`` turns a model response into dollars for the job's spend (default:
    genai-prices, 0 for models it doesn't know). ``rate_resource`` records each fresh
    model call's tokens in that resource's rate window (``ctx.debit``; the job's queue
    needs a rate on it, or pass ``rate_period``). ``events``
    chooses what reaches the job's event stream: ``"summary"`` (default: everything
    but text and argument deltas), ``"all"``, ``"none"`` or a predicate.
    """

    engine_spec: ClassVar[DurabilityEngineSpec] = DurabilityEngineSpec(
        engine_name=ENGINE,
        durable_unit_noun="step",
        durable_container_noun="job",
        codec=JSON_CODEC,
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={
            "function": "enter-always", "mcp": "enter-in-durable-unit", "dynamic": "enter-never",
        },
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        tool_config_key="belay",
    )

    def __init__(
        self,
        *,
        models: Mapping[str, Model] | None = None,
        name: str | None = None,
        price: Price | None = None,
        rate_resource: str | None = None,
        rate_period: int | None = None,
        events: EventFilter = "summary",
        event_stream_handler: EventStreamHandler[AgentDepsT] | None = None,
    ) -> None:
        if not (events in ("summary", "all", "none") or callable(events)):
            raise ConfigurationError(
                f"events is 'summary', 'all', 'none' or a predicate on an event, got {events!r}"
            )
        if rate_resource is not None and (not isinstance(rate_resource, str) or not rate_resource):
            raise ConfigurationError(f"rate_resource is a resource name, got {rate_resource!r}")
        self.price: Price = price or default_price
        self.rate_resource = rate_resource
        self.rate_period = rate_period
        self._events = events
        self._user_handler = event_stream_handler
        handler = None if events == "none" and event_stream_handler is None else self._handle_events
        super().__init__(models=models, event_stream_handler=handler, name=name)

    @property
    def in_durable_context(self) -> bool:
        return current_context() is not None

    def _check_rate(self, ctx: Context) -> None:
        resource = self.rate_resource
        rate = ctx.rate
        if resource is None or self.rate_period is not None or (
                rate is not None and rate.resource == resource):
            return
        raise ConfigurationError(
            f"BelayDurability(rate_resource={resource!r}): queue {ctx.queue!r} has no rate on "
            f"{resource!r}; give the queue rate={{'resource': {resource!r}, ...}} or pass "
            "rate_period=<seconds> to record usage without admission"
        )

    def _bind_to_agent(self, agent: AbstractAgent[AgentDepsT, Any]) -> None:
        super()._bind_to_agent(agent)
        # Events stream the model's answer, and a FunctionModel streams only with a
        # stream_function: say so now, not from inside the first job.
        model = agent.model
        if (self._event_stream_handler is not None and isinstance(model, FunctionModel)
                and model.stream_function is None):
            raise ConfigurationError(
                f"agent {agent.name!r}: BelayDurability streams model responses to emit "
                "events, and this FunctionModel has no stream_function: pass "
                "FunctionModel(fn, stream_function=...) or BelayDurability(events='none')"
            )

    def get_durable_operation_backend(self) -> _BelayBackend:
        return _BelayBackend(self)

    def get_default_run_id(self) -> str | None:
        ctx = current_context()
        if ctx is None:
            return None
        unit = _UNIT.get()
        return _execution(ctx).next_run(str(ctx.id) if unit is None else unit)

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    async def get_run_start_time(self, run_id: str) -> datetime | None:
        ctx = current_context()
        if ctx is None:
            return None
        # Journaled: a run's timeout= counts from its first start, across retries.
        started = await ctx.astep(f"ai:{run_id}/started", _now_iso(ctx))
        return datetime.fromisoformat(started)

    async def wrap_run(self, ctx: RunContext[AgentDepsT], *, handler: WrapRunHandler
                       ) -> AgentRunResult[Any]:
        job = current_context()
        if job is None:
            return await super().wrap_run(ctx, handler=handler)
        self._check_rate(job)  # before the run pays for anything
        with external_event_scope(_SignalWaiter(job, ctx.run_id or "run")):
            return await super().wrap_run(ctx, handler=handler)

    async def _handle_events(
        self, run_ctx: RunContext[AgentDepsT], stream: AsyncIterable[AgentStreamEvent]
    ) -> None:
        async def emitting() -> AsyncIterator[AgentStreamEvent]:
            async for event in stream:
                await self._emit(event)
                yield event

        if self._user_handler is not None:
            await self._user_handler(run_ctx, emitting())
        else:
            async for _ in emitting():
                pass

    async def _emit(self, event: AgentStreamEvent) -> None:
        ctx = current_context()
        if ctx is not None and self._wanted(event):
            payload = {"type": f"pydantic_ai.{event.event_kind}",
                       "data": _EVENT.dump_python(event, mode="json")}
            await asyncio.to_thread(ctx.emit, payload)

    def _wanted(self, event: AgentStreamEvent) -> bool:
        if callable(self._events):
            return bool(self._events(event))
        if self._events == "none":
            return False
        return self._events == "all" or not isinstance(event, PartDeltaEvent)


def _now_iso(ctx: Context) -> Callable[[], Awaitable[str]]:
    async def now() -> str:
        return ctx.client.clock.now().isoformat()

    return now


# -- Approvals --------------------------------------------------------------------------


def request_input(*, name: str = "input", timeout: timedelta | None = None
                  ) -> RequestInput[Any]:
    """A ``RequestInput`` capability that asks through the job's event stream.

    When tools need approval (``requires_approval=True``) or an outside result
    (``CallDeferred``), the job emits ``{"type": "pydantic_ai.input_requested",
    "signal": …, "approvals": […], "calls": […]}`` and parks on that signal. Send the
    answer as the JSON form of ``DeferredToolResults``::

        client.signal_job(job_id, job.await_name, {"approvals": {tool_call_id: True}})

    Outside a job it waits in process, as ``RequestInput`` does.
    """

    async def ask(run_ctx: RunContext[Any], requests: DeferredToolRequests, token: str) -> None:
        ctx = current_context()
        if ctx is None:
            return None
        payload = {
            "type": "pydantic_ai.input_requested",
            "signal": token,
            "approvals": [_call(part) for part in requests.approvals],
            "calls": [_call(part) for part in requests.calls],
        }
        await asyncio.to_thread(ctx.emit, payload)
        return None

    return RequestInput(ask=ask, name=name, timeout=timeout)


def _call(part: Any) -> dict[str, Any]:
    return {"tool_call_id": part.tool_call_id, "tool_name": part.tool_name,
            "args": to_jsonable_python(part.args_as_dict())}


# -- Running an agent as a job ----------------------------------------------------------


def _durability(agent: AbstractAgent[Any, Any]) -> None:
    if BelayDurability.from_agent(agent) is None:
        raise ConfigurationError(
            f"agent {agent.name!r} has no BelayDurability: build it with "
            "Agent(..., capabilities=[BelayDurability()]) so its model and tool calls "
            "are journaled"
        )


async def run_agent(ctx: Context, agent: AbstractAgent[Any, Any], user_prompt: Any = None,
                    **run_kwargs: Any) -> AgentRunResult[Any]:
    """``await agent.run(...)`` as part of job ``ctx`` (for async code of your own).

    The agent must carry :class:`BelayDurability`. belay's control flow (a park on a
    signal, a budget crossing, a cancel) leaves the run as itself, never wrapped in
    an exception group, so the worker handles it.
    """
    _durability(agent)
    try:
        return await agent.run(user_prompt, **run_kwargs)
    except BaseException as exc:
        control = ctx.control
        if control is not None and control is not exc and _contains(exc, control):
            raise control from None
        raise


def run_agent_job(ctx: Context, agent: AbstractAgent[Any, Any], user_prompt: Any = None,
                  *, output: Callable[[AgentRunResult[Any]], Any] | None = None,
                  **run_kwargs: Any) -> Any:
    """Run ``agent`` as the body of a (synchronous) belay worker and return its output.

    ``output`` turns the run's result into the job's result (default: the output in
    its JSON form). ``run_kwargs`` go to ``agent.run`` (``deps``, ``message_history``,
    ``usage_limits``, …). Call it from the job's own thread, not from a running event
    loop: there, ``await run_agent(ctx, agent, …)``.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigurationError(
            "run_agent_job runs its own event loop; from async code use "
            "`await run_agent(ctx, agent, ...)`"
        )
    result = asyncio.run(run_agent(ctx, agent, user_prompt, **run_kwargs))
    if output is not None:
        return output(result)
    return to_jsonable_python(result.output)


def _contains(exc: BaseException, target: BaseException) -> bool:
    if exc is target:
        return True
    inner = getattr(exc, "exceptions", None)  # an exception group (anyio's task groups)
    if isinstance(inner, tuple) and any(_contains(e, target) for e in inner):
        return True
    return _contains(exc.__cause__, target) if exc.__cause__ is not None else False

