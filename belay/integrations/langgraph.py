"""LangGraph graphs and LangChain agents as durable belay jobs (extra ``langgraph``).

Two pieces, usable together or apart:

- :func:`run_graph` runs a compiled graph inside a job on LangGraph's own
  ``PostgresSaver``, kept in belay's database. The thread is the job's, so a
  crash-retry or a wake after a park resumes from the last checkpoint instead of
  starting over; ``interrupt()`` parks the job on a signal; streamed chunks go to
  the job's event stream.
- :class:`BelayMiddleware` makes each model call and tool call of a LangChain
  agent a belay step: journaled once, replayed on later attempts, its token use
  (and optionally dollars) debited into the job's durable budget.

Both are synchronous at heart, like belay's core; the middleware's async hooks
use ``ctx.astep`` so an agent run with ``ainvoke`` keeps its event loop free.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from belay import connect
from belay.authority import check_tool
from belay.client import Belay, normalize_url
from belay.context import Context, Cost, Park, StepValueRefused, current_context
from belay.errors import ConfigurationError, ValidationError
from belay.outcome import describe
from belay.sql import QUERIES

try:
    from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
    from langchain.agents.middleware.types import ToolCallRequest
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        ToolMessage,
        message_to_dict,
        messages_from_dict,
    )
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.config import get_config
    from langgraph.constants import CONFIG_KEY_CHECKPOINTER
    from langgraph.graph import StateGraph
    from langgraph.pregel import Pregel
    from langgraph.types import Command, Interrupt
    from pydantic import BaseModel
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"belay.integrations.langgraph needs LangGraph and LangChain ({exc.name} is missing): "
        "pip install 'belay[langgraph]'"
    ) from exc

__all__ = ["BelayMiddleware", "close_savers", "json_safe", "postgres_saver", "run_graph"]

log = logging.getLogger(__name__)

DURABILITY = ("sync", "async", "exit")
STREAM_MODES = frozenset(
    {"values", "updates", "custom", "messages", "checkpoints", "tasks", "debug"}
)
#: Serializes ``PostgresSaver.setup()`` across processes: its migrations are not
#: safe to run twice at once on a fresh database.
SETUP_LOCK = "belay:langgraph-setup"
SETUP_POLL = 0.05
SETUP_TIMEOUT = 60.0
#: The saver's pool. ``PostgresSaver`` holds one connection per call under a lock
#: of its own, so each run gets its own saver and the pool bounds the total.
POOL_SIZE = 10
#: ``json_safe`` stops descending here (a self-referencing chunk must not recurse forever).
MAX_DEPTH = 64


# -- The saver on belay's database -------------------------------------------------------

_pools: dict[str, ConnectionPool[Any]] = {}
_pools_lock = threading.Lock()
_pools_pid = os.getpid()


def postgres_saver(client: Belay | str) -> PostgresSaver:
    """A LangGraph ``PostgresSaver`` on belay's database (``client`` or a URL).

    The first call per database opens a connection pool with the settings the
    saver needs (autocommit, dict rows, no prepared statements) and runs
    ``saver.setup()`` once, under an advisory lock so two workers starting at
    once don't race its migrations. Later calls share the pool; each returns a
    fresh saver, because one saver serializes its queries on a lock of its own.
    Pools close at exit, or with :func:`close_savers`.
    """
    global _pools_pid
    if isinstance(client, Belay):
        conninfo, pooler = client.conninfo, client.pooler
    elif isinstance(client, str):
        conninfo, pooler = normalize_url(client), connect.pooler_setting()
    else:
        raise ValidationError(
            f"postgres_saver takes a belay.Belay client or a database URL, got "
            f"{type(client).__name__}"
        )
    with _pools_lock:
        if _pools_pid != os.getpid():
            # Forked: the parent's pools belong to the parent; don't touch them.
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(conninfo)
        if pool is None:
            # prepare_threshold=0 (prepare at once) as the saver's docs ask,
            # except behind a transaction pooler that does not track them.
            prepare = {"prepare_threshold": 0 if connect.prepares(pooler) else None}
            pool = connect.pool(
                conninfo, pooler, min_size=1, max_size=POOL_SIZE, open=False,
                name="belay-langgraph",
                kwargs={"row_factory": dict_row, "application_name": "belay-langgraph",
                        **prepare},
            )
            pool.open(wait=False)
            try:
                _setup(conninfo, pooler, pool)
            except BaseException:
                pool.close()
                raise
            _pools[conninfo] = pool
    return PostgresSaver(pool)


def _setup(conninfo: str, pooler: str | None, pool: ConnectionPool[Any]) -> None:
    """``setup()`` while a transaction of its own holds ``SETUP_LOCK``.

    The lock is transaction-scoped (a session lock would stay behind on a
    pooled server connection) and taken by polling, each miss rolled back:
    setup runs CREATE INDEX CONCURRENTLY, which waits for every transaction
    holding a snapshot — a waiter blocked in ``pg_advisory_xact_lock`` would
    hold one and deadlock the holder's setup against its own waiters; the
    holder itself holds none (see :func:`_try_lock`).
    """
    deadline = time.monotonic() + SETUP_TIMEOUT
    with connect.connect(conninfo, pooler) as lock:
        while not _try_lock(lock):
            lock.rollback()
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"LangGraph's checkpoint tables were not set up within {SETUP_TIMEOUT:.0f} s: "
                    f"another process holds the advisory lock {SETUP_LOCK!r}; look for a hung "
                    "process in pg_stat_activity (application_name belay-langgraph)"
                )
            time.sleep(SETUP_POLL)
        PostgresSaver(pool).setup()
        lock.commit()


def _try_lock(conn: psycopg.Connection[Any]) -> bool:
    """Take ``SETUP_LOCK`` for the transaction, if free. On a client-side
    cursor: the extended protocol's unnamed portal would keep a snapshot for
    the rest of the transaction, and CREATE INDEX CONCURRENTLY waits for it."""
    with psycopg.ClientCursor(conn) as cur:
        return bool(_first(cur.execute(QUERIES["advisory_try_xact_lock"],
                                       (SETUP_LOCK,)).fetchone()))


def _first(row: Any) -> Any:
    return None if row is None else row[0]


def close_savers() -> None:
    """Close the pools :func:`postgres_saver` opened (also runs at exit)."""
    with _pools_lock:
        pools = list(_pools.values()) if _pools_pid == os.getpid() else []
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_savers)


# -- JSON for events and results -------------------------------------------------------


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON data, for events and job results; never raises.

    LangChain messages become their dict form (``{"type": "ai", "data": {...}}``),
    pydantic models and dataclasses their fields, interrupts ``{"id", "value"}``;
    anything else without a JSON shape (or nested too deep: a cycle) its ``repr``.
    """
    if _depth > MAX_DEPTH:
        return repr(value)
    deeper = _depth + 1
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, BaseMessage):
        return json_safe(message_to_dict(value), deeper)
    if isinstance(value, Interrupt):
        return {"id": value.id, "value": json_safe(value.value, deeper)}
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, deeper) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, deeper) for v in value]
    try:
        if isinstance(value, BaseModel):
            return json_safe(value.model_dump(mode="json"), deeper)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return json_safe(dataclasses.asdict(value), deeper)
    except Exception:  # a model or dataclass that won't dump: fall back to repr
        pass
    return repr(value)


# -- run_graph ---------------------------------------------------------------------------


def run_graph(
    ctx: Context,
    graph: Any,
    input: Any,
    *,
    config: Mapping[str, Any] | None = None,
    stream_mode: str | Sequence[str] = ("updates", "custom"),
    thread_id: str | None = None,
    signal_prefix: str = "interrupt:",
    result: Callable[[Any], Any] | None = None,
    durability: str = "sync",
    context: Any = None,
    subgraphs: bool = False,
) -> Any:
    """Run the compiled LangGraph ``graph`` as this job; returns its final state.

    The graph checkpoints into thread ``thread_id`` (default
    ``belay-job-<job id>``, shared by every attempt) with a ``PostgresSaver`` on
    belay's database, unless it was compiled with a checkpointer of its own. The
    first attempt journals where the thread stood (step
    ``langgraph:start:<thread>``) and streams ``input``; a later attempt that
    finds the thread moved on since resumes from its last checkpoint; a turn
    that finished returns the result it journaled (``langgraph:result:<thread>``)
    without running. So a thread may carry several jobs, and a job several
    turns (each call of an execution is the next one). ``durability="sync"``
    (LangGraph's default is "async") writes each checkpoint before the next step
    starts: a crash re-runs only the step in progress.

    When the run stops at ``interrupt()``, each pending interrupt waits on the
    signal ``<signal_prefix><interrupt id>``: an event
    ``{"type": "langgraph.interrupt", "signal", "id", "value"}`` names it, and
    the job parks until ``signal_job(job_id, name, payload)``; the payload
    resumes the graph as ``Command(resume=…)``. Each streamed chunk is emitted as
    ``{"type": "langgraph.<mode>", "data": …}``. ``result`` picks the job's
    result from the final state (default: the whole state), made JSON-safe.
    """
    if not isinstance(ctx, Context):
        raise ValidationError(
            f"run_graph takes the job's ctx first, got {type(ctx).__name__}: "
            "call run_graph(ctx, graph, input) inside a belay worker function"
        )
    modes = _stream_modes(stream_mode)
    if not isinstance(signal_prefix, str) or not signal_prefix:
        raise ValidationError(f"signal_prefix is a non-empty string, got {signal_prefix!r}")
    if result is not None and not callable(result):
        raise ValidationError(f"result is a function of the final state, got {result!r}")
    if durability not in DURABILITY:
        raise ValidationError(f"durability is one of {DURABILITY}, got {durability!r}")
    cfg = _thread_config(config, thread_id, ctx.id)
    graph = _checkpointed(graph, ctx.client)

    state = graph.get_state(cfg)
    # Where the thread stood when this job first ran: until the thread moves on
    # from there, no attempt of this job has checkpointed its input (a thread
    # may carry earlier jobs' turns, so "has a checkpoint" is not enough).
    head = _checkpoint_id(state)
    thread = str(cfg["configurable"]["thread_id"])
    # Counted per thread in this execution: a job may run several turns on one thread.
    turn = _next_turn(ctx, thread)
    suffix = "" if turn == 1 else f"#{turn}"
    # A turn that finished in an earlier attempt returns what it returned then
    # (the thread may have moved on with later turns since).
    finished = f"langgraph:result:{thread}{suffix}"
    hit, journaled = ctx.journal.lookup(finished)
    if hit:
        return journaled
    start = ctx.step(f"langgraph:start:{thread}{suffix}", lambda: head)
    if head == start:
        run_input: Any = input
    elif state.interrupts:
        run_input = _resume(ctx, state.interrupts, signal_prefix)
    elif state.next:
        run_input = None  # a crashed or parked run: go on from the last checkpoint
    else:  # finished before its result was journaled
        return ctx.journal.record(finished, _result(state.values, result), None, None)
    while True:
        for part in graph.stream(run_input, cfg, stream_mode=modes, version="v2",
                                 durability=durability, context=context, subgraphs=subgraphs):
            _emit_part(ctx, part)
        state = graph.get_state(cfg)
        if state.interrupts:
            run_input = _resume(ctx, state.interrupts, signal_prefix)
        elif state.next:
            raise ConfigurationError(
                f"graph stopped before {list(state.next)} without an interrupt (a static "
                "breakpoint?): run_graph resumes interrupt() calls only"
            )
        else:
            return ctx.journal.record(finished, _result(state.values, result), None, None)


_turns: weakref.WeakKeyDictionary[Context, dict[str, int]] = weakref.WeakKeyDictionary()
_turns_lock = threading.Lock()


def _next_turn(ctx: Context, thread: str) -> int:
    with _turns_lock:
        counts = _turns.setdefault(ctx, {})
        counts[thread] = counts.get(thread, 0) + 1
        return counts[thread]


def _checkpoint_id(state: Any) -> str | None:
    if state.created_at is None:
        return None  # an empty thread
    return str(state.config["configurable"]["checkpoint_id"])


def _checkpointed(graph: Any, client: Belay) -> Any:
    """The graph with a usable checkpointer: its own, or a saver on belay's database."""
    if isinstance(graph, StateGraph):
        raise ValidationError(
            "run_graph needs a compiled graph: pass builder.compile(), not the StateGraph"
        )
    if not isinstance(graph, Pregel):
        raise ValidationError(
            f"run_graph runs a compiled LangGraph graph (a Pregel), got {type(graph).__name__}"
        )
    if graph.interrupt_before_nodes or graph.interrupt_after_nodes:
        raise ConfigurationError(
            "run_graph does not support static breakpoints (interrupt_before/interrupt_after): "
            "call langgraph.types.interrupt() inside the node instead"
        )
    saver = graph.checkpointer
    if saver is None:
        return graph.copy({"checkpointer": postgres_saver(client)})
    if not isinstance(saver, BaseCheckpointSaver):
        raise ConfigurationError(
            f"run_graph needs a checkpointer, but the graph was compiled with "
            f"checkpointer={saver!r}: compile without one (belay supplies a PostgresSaver) "
            "or with a BaseCheckpointSaver"
        )
    return graph


def _stream_modes(stream_mode: str | Sequence[str]) -> list[str]:
    modes = [stream_mode] if isinstance(stream_mode, str) else list(stream_mode)
    unknown = [m for m in modes if m not in STREAM_MODES]
    if unknown or not modes:
        raise ValidationError(
            f"unknown stream mode(s) {unknown or modes!r}: use some of {sorted(STREAM_MODES)}"
        )
    return modes


def _thread_config(config: Mapping[str, Any] | None, thread_id: str | None,
                   job_id: int) -> dict[str, Any]:
    if config is not None and not isinstance(config, Mapping):
        raise ValidationError(f"config is a LangGraph config dict, got {type(config).__name__}")
    cfg = dict(config or {})
    configurable = dict(cfg.get("configurable") or {})
    if thread_id is not None:
        if not isinstance(thread_id, str) or not thread_id:
            raise ValidationError(f"thread_id is a non-empty string, got {thread_id!r}")
        configurable["thread_id"] = thread_id
    configurable.setdefault("thread_id", f"belay-job-{job_id}")
    cfg["configurable"] = configurable
    return cfg


def _emit_part(ctx: Context, part: Mapping[str, Any]) -> None:
    event: dict[str, Any] = {"type": f"langgraph.{part['type']}", "data": json_safe(part["data"])}
    if part.get("ns"):
        event["ns"] = list(part["ns"])
    try:
        ctx.emit(event)
    except ValidationError as exc:  # e.g. too large: the stream is advisory, the run goes on
        log.warning("job %s: dropped a %s event: %s", ctx.id, event["type"], exc)


def _resume(ctx: Context, interrupts: Sequence[Interrupt], prefix: str) -> Command[Any]:
    """The ``Command`` answering every pending interrupt; parks the job until the
    signal of each has been sent (announcing the missing ones as events first)."""
    answers: dict[str, Any] = {}
    waiting: list[tuple[Interrupt, str, Park]] = []
    for pending in interrupts:
        signal = f"{prefix}{pending.id}"
        try:
            answers[pending.id] = ctx.await_signal(signal)
        except Park as park:
            waiting.append((pending, signal, park))
    if waiting:
        for pending, signal, _ in waiting:
            ctx.emit({"type": "langgraph.interrupt", "signal": signal, "id": pending.id,
                      "value": json_safe(pending.value)})
        raise waiting[0][2]  # the job awaits the first; a wake re-checks the rest
    return Command(resume=answers)


def _result(values: Any, pick: Callable[[Any], Any] | None) -> Any:
    return json_safe(values if pick is None else pick(values))


# -- BelayMiddleware ---------------------------------------------------------------------

#: The journal's form of a model answer / tool answer, tagged by kind.
Journaled = dict[str, Any]


class BelayMiddleware(AgentMiddleware):
    """Memoizes a LangChain agent's model and tool calls as steps of the current job.

    Inside a belay job (``belay.current_context()``), each model call becomes a
    step ``langchain:model:<key>`` and each tool call ``langchain:tool:<key>``:
    its answer is journaled, and a later attempt of the job gets the journaled
    answer back instead of calling again. Outside a job, calls pass through.

    Keys: when the agent runs with a checkpointer, a call is keyed by its
    LangGraph task (``checkpoint_ns``, the same when a thread resumes from a
    checkpoint) and its count within that task (a tool call also by its
    ``tool_call_id``); without one, task ids are random per run, so model calls
    are keyed by their order in this execution of the job and tool calls by
    ``tool_call_id``. Without a checkpointer, run one job's agents one at a time:
    concurrent agents would race for the order.

    Spend: ``usage_metadata["total_tokens"]`` of each answer, and ``price(message)``
    dollars if given, go into the job's budget with the journal entry: a call
    that crosses the budget fails the job, and a later attempt fails before the
    next call. ``rate_resource`` also debits fresh calls' tokens into that rate
    window (``ctx.debit``; ``rate_period`` when the queue has no rate on it).
    """

    def __init__(
        self,
        *,
        price: Callable[[AIMessage], float] | None = None,
        rate_resource: str | None = None,
        rate_period: int | None = None,
    ) -> None:
        super().__init__()
        if price is not None and not callable(price):
            raise ValidationError(f"price is a function AIMessage -> USD, got {price!r}")
        if rate_resource is not None and (not isinstance(rate_resource, str) or not rate_resource):
            raise ValidationError(f"rate_resource is a non-empty string, got {rate_resource!r}")
        if rate_period is not None and rate_resource is None:
            raise ValidationError("rate_period needs rate_resource (the resource it counts for)")
        self.price = price
        self.rate_resource = rate_resource
        self.rate_period = rate_period
        # Per execution of a job (a Context): calls counted per key prefix.
        self._counts: weakref.WeakKeyDictionary[Context, dict[str, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    # -- keys

    def _model_key(self, ctx: Context) -> str:
        scope = _task_scope()
        return f"langchain:model:{scope}:{self._next(ctx, scope)}"

    def _tool_key(self, ctx: Context, request: ToolCallRequest) -> str:
        # The id alone is not enough: some providers repeat short ids across turns.
        scope, call_id = _task_scope(), str(request.tool_call.get("id") or "")
        return f"langchain:tool:{scope}:{call_id}:{self._next(ctx, f'{scope}|{call_id}')}"

    def _next(self, ctx: Context, scope: str) -> int:
        with self._lock:
            counts = self._counts.setdefault(ctx, {})
            counts[scope] = counts.get(scope, 0) + 1
            return counts[scope]

    # -- spend

    def _cost(self, journaled: Journaled) -> Cost | None:
        usd, tokens = 0.0, 0
        for message in _messages(journaled):
            if isinstance(message, AIMessage):
                tokens += _tokens(message)
                if self.price is not None:
                    usd += self._priced(message)
        return Cost(usd=usd, tokens=tokens) if usd or tokens else None

    def _priced(self, message: AIMessage) -> float:
        assert self.price is not None
        try:
            return float(self.price(message))
        except Exception as exc:
            raise ConfigurationError(
                f"BelayMiddleware(price=...) failed on a model answer: {describe(exc)}; "
                "price gets the AIMessage (usage in message.usage_metadata, which a "
                "provider may leave None) and returns its dollars as a float"
            ) from exc

    def _debit(self, ctx: Context, journaled: Journaled) -> None:
        if self.rate_resource is None:
            return
        tokens = sum(_tokens(m) for m in _messages(journaled) if isinstance(m, AIMessage))
        ctx.debit(self.rate_resource, tokens, period=self.rate_period)

    # -- hooks

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> ModelResponse:
        ctx = current_context()
        if ctx is None:
            return handler(request)
        fresh: list[Journaled] = []

        def call() -> Journaled:
            fresh.append(_dump_model(handler(request)))
            return fresh[0]

        try:
            journaled = ctx.step(self._model_key(ctx), call, cost=self._cost)
        finally:
            if fresh:  # the tokens were used, whether or not the call crossed the budget
                self._debit(ctx, fresh[0])
        return _load_model(journaled, request)

    async def awrap_model_call(
        self, request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        ctx = current_context()
        if ctx is None:
            return await handler(request)
        fresh: list[Journaled] = []

        async def call() -> Journaled:
            fresh.append(_dump_model(await handler(request)))
            return fresh[0]

        try:
            journaled = await ctx.astep(self._model_key(ctx), call, cost=self._cost)
        finally:
            if fresh:  # the tokens were used, whether or not the call crossed the budget
                await asyncio.to_thread(self._debit, ctx, fresh[0])
        return _load_model(journaled, request)

    # A tool may run an agent of its own (an agent as a tool): its calls are
    # journaled too, keyed under the tool call's key, so a replayed tool call
    # that skips them doesn't shift anyone else's keys. That is why tool calls
    # bypass ctx.step's no-nesting rule (ctx.journal.lookup/record).

    def wrap_tool_call(
        self, request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        ctx = current_context()
        if ctx is None:
            return handler(request)
        check_tool(str(request.tool_call.get("name") or ""))
        key = self._tool_key(ctx, request)
        hit, journaled = ctx.journal.lookup(key)
        if not hit:
            scope = _TOOL.set(key)
            try:
                answer = handler(request)
            finally:
                _TOOL.reset(scope)
            journaled = ctx.journal.record(key, _dump_tool(answer), None, None)
        return _load_tool(journaled)

    async def awrap_tool_call(
        self, request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        ctx = current_context()
        if ctx is None:
            return await handler(request)
        check_tool(str(request.tool_call.get("name") or ""))
        key = self._tool_key(ctx, request)
        hit, journaled = await asyncio.to_thread(ctx.journal.lookup, key)
        if not hit:
            scope = _TOOL.set(key)
            try:
                answer = await handler(request)
            finally:
                _TOOL.reset(scope)
            journaled = await asyncio.to_thread(ctx.journal.record, key, _dump_tool(answer),
                                                None, None)
        return _load_tool(journaled)


#: The journal key of the tool call running in this task, if any.
_TOOL: ContextVar[str | None] = ContextVar("belay_langchain_tool", default=None)


def _task_scope() -> str:
    """The running LangGraph task's ``checkpoint_ns`` when the graph has a
    checkpointer (task ids then repeat when a thread resumes from a checkpoint),
    else ``#``: without one, task ids are random per run, so calls count in order.
    Inside a tool call (an agent used as a tool), under that call's key."""
    tool = _TOOL.get()
    prefix = "" if tool is None else f"{tool}/"
    try:
        configurable = get_config().get("configurable", {})
    except RuntimeError:  # not inside a LangGraph run
        return prefix + "#"
    if configurable.get(CONFIG_KEY_CHECKPOINTER) is None:
        return prefix + "#"
    return prefix + str(configurable.get("checkpoint_ns") or "#")


def _tokens(message: AIMessage) -> int:
    usage = message.usage_metadata
    return 0 if usage is None else int(usage.get("total_tokens") or 0)


# -- the journal's form of answers ------------------------------------------------------


def _tag(value: Any) -> Any:
    """JSON for the journal, with LangChain messages tagged so they come back as such."""
    if isinstance(value, BaseMessage):
        return {"$message": message_to_dict(value)}
    if isinstance(value, Mapping):
        return {str(k): _tag(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tag(v) for v in value]
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$message"}:
            return messages_from_dict([value["$message"]])[0]
        return {k: _untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return value


def _messages(journaled: Journaled) -> list[BaseMessage]:
    return list(_untag(journaled["messages"]))


# A value the journal can't hold fails the job at once (StepValueRefused), as
# ctx.step does: a retry would pay for the same call and fail the same way.


def _dump_model(response: Any) -> Journaled:
    if isinstance(response, AIMessage):
        response = ModelResponse(result=[response])
    if not isinstance(response, ModelResponse):
        raise StepValueRefused(
            f"BelayMiddleware can journal a ModelResponse or an AIMessage, and the model "
            f"handler returned {type(response).__name__}: put BelayMiddleware after "
            "middleware that returns other types (last in the list is innermost)"
        )
    structured = response.structured_response
    if isinstance(structured, BaseModel):
        structured = structured.model_dump(mode="json")
    return {"messages": _tag(response.result), "structured": structured}


def _load_model(journaled: Journaled, request: ModelRequest) -> ModelResponse:
    structured = journaled.get("structured")
    schema = getattr(request.response_format, "schema", None)
    if structured is not None and isinstance(schema, type) and issubclass(schema, BaseModel):
        structured = schema.model_validate(structured)
    return ModelResponse(result=_messages(journaled), structured_response=structured)


def _dump_tool(answer: ToolMessage | Command[Any]) -> Journaled:
    if isinstance(answer, ToolMessage):
        return {"message": _tag(answer)}
    if isinstance(answer, Command) and _plain(answer):
        return {"command": {"update": _tag(answer.update), "goto": _tag(answer.goto)}}
    raise StepValueRefused(
        "BelayMiddleware journals a tool's ToolMessage, or a Command with a dict update "
        f"and node names as goto; the tool returned {answer!r:.200}"
    )


def _plain(command: Command[Any]) -> bool:
    """A Command the journal can hold: a dict update and node names to go to."""
    goto = [command.goto] if isinstance(command.goto, str) else command.goto
    return (command.graph is None and command.resume is None
            and isinstance(command.update, (Mapping, type(None)))
            and isinstance(goto, (list, tuple)) and all(isinstance(g, str) for g in goto))


def _load_tool(journaled: Journaled) -> ToolMessage | Command[Any]:
    if "message" in journaled:
        message = _untag(journaled["message"])
        assert isinstance(message, ToolMessage)
        return message
    command = journaled["command"]
    return Command(update=_untag(command["update"]), goto=command["goto"])
