"""OpenTelemetry traces from enqueue to ack (the ``otel`` extra).

Needs ``opentelemetry-api`` (``pip install 'belay[otel]'``); without it, or
with no tracer provider configured, every function here is a cheap no-op.

An enqueue opens a PRODUCER span and writes its W3C trace context into the
job's ``meta`` under ``$trace``; each execution of the job opens a CONSUMER
span (``process <queue>``) parented to that context and linked to it, current
while the function runs, ended once the outcome is recorded; each
``ctx.step`` opens an INTERNAL span (``step <name>``) under it. HTTP workers
get their execution's context in the execute event and may send theirs back
with the completion, which links it. docs/observability.md shows the spans.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from belay.parts.execution import Execution

log = logging.getLogger("belay.otel")

T = TypeVar("T")

#: The meta key that carries the enqueuer's W3C trace context.
TRACE_KEY = "$trace"
#: ``messaging.system`` of belay's spans.
SYSTEM = "belay"

#: The outcomes (``belay.parts.hooks.OUTCOMES``) that set a consumer span's
#: status to ERROR, with the description used when no error was recorded.
FAILURES = {
    "retry": "the attempt failed; the job runs again after its backoff",
    "failed": "the job failed",
    "timeout": "the attempt ran past its timeout",
    "lost": "the lease was lost while the job ran; its outcome is discarded",
    "stale": "the ack was discarded: the job was reclaimed meanwhile",
    "crashed": "recording the run failed",
}

#: W3C ``traceparent`` (version, trace id, span id, flags), as an HTTP
#: worker's completion may carry it.
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

_api: Any = None  # the opentelemetry.trace module once imported; False when missing
_override: Any = None  # the provider given to configure(), if any
_tracer: tuple[Any, Any] | None = None  # (provider, its belay tracer)

#: The step whose span is current here: (step name, span). The journal marks
#: it replayed or adds its cost; a journal entry of another name (an
#: integration's, inside the step) leaves it alone.
_STEP: ContextVar[tuple[str, Any] | None] = ContextVar("belay_otel_step", default=None)


def _trace() -> Any:
    global _api
    if _api is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = False
        else:
            _api = trace
    return _api or None


def configure(*, tracer_provider: Any = None) -> None:
    """Trace with ``tracer_provider`` instead of OpenTelemetry's global one
    (``trace.set_tracer_provider``, which can be set only once per process);
    ``None`` goes back to the global provider. For tests, and for an
    application that keeps belay's spans apart."""
    global _override
    _override = tracer_provider


def _provider() -> Any:
    """The tracer provider in use, or None when nothing would record."""
    trace = _trace()
    if trace is None:
        return None
    provider = _override if _override is not None else trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider


def enabled() -> bool:
    """True when opentelemetry-api is installed and a tracer provider is set
    (:func:`configure`, or the global one)."""
    return _provider() is not None


def tracer() -> Any:
    """belay's tracer from the provider in use (a no-op one when none is)."""
    global _tracer
    provider = _provider()
    if provider is None:
        return _trace().get_tracer("belay")
    cached = _tracer
    if cached is None or cached[0] is not provider:
        cached = _tracer = (provider, provider.get_tracer("belay", _version()))
    return cached[1]


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("belay")
    except PackageNotFoundError:
        return None


# -- Enqueue: the PRODUCER span ----------------------------------------------------------


@contextmanager
def producer(operation: str, count: int, queue: str | None = None,
             kind: str | None = None) -> Iterator[dict[str, str] | None]:
    """A PRODUCER span around an enqueue of ``count`` jobs; yields the trace
    context (``traceparent``, ``tracestate``) to store in each job's meta, or
    None when nothing traces."""
    if not enabled():
        yield None
        return
    from opentelemetry import propagate

    trace = _trace()
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": operation,
    }
    if queue is not None:
        attributes["messaging.destination.name"] = queue
    if kind is not None:
        attributes["belay.job.kind"] = kind
    if count != 1:
        attributes["messaging.batch.message_count"] = count
    name = f"send {queue}" if queue is not None else "send"
    with tracer().start_as_current_span(name, kind=trace.SpanKind.PRODUCER,
                                        attributes=attributes):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield carrier or None


@contextmanager
def continued(headers: Mapping[str, str]) -> Iterator[None]:
    """Inside, the W3C context of an incoming request's ``traceparent`` and
    ``tracestate`` headers is current, so the enqueue's span continues the
    caller's trace (the HTTP producer API) — unless a span is current already
    (an ASGI instrumentation extracted it) or nothing traces."""
    if not enabled() or "traceparent" not in headers:
        yield
        return
    trace = _trace()
    if trace.get_current_span().get_span_context().is_valid:
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {key: headers[key] for key in ("traceparent", "tracestate") if key in headers}
    token = context.attach(TraceContextTextMapPropagator().extract(carrier))
    try:
        yield
    finally:
        context.detach(token)


def carried(meta: Mapping[str, Any]) -> Mapping[str, str] | None:
    """The trace context an enqueue left in a job's meta, if any."""
    found = meta.get(TRACE_KEY) if isinstance(meta, Mapping) else None
    return found if isinstance(found, Mapping) else None


# -- Execution: the CONSUMER span -----------------------------------------------------------


def begin(execution: Execution) -> Any:
    """Start the CONSUMER span of one execution (``process <queue>``), not yet
    current; None when nothing traces (the one check per execution).

    Its parent is the enqueue's context from ``meta["$trace"]`` — one trace
    from enqueue to ack, every attempt in it — and it links that context too,
    as the messaging conventions ask of a process span. A job enqueued
    without one starts a trace of its own.
    """
    if not enabled():
        return None
    try:
        return _begin(execution)
    except Exception:  # tracing must never cost a job its run
        log.exception("belay: could not start the span of job %d", execution.job.id)
        return None


def _begin(execution: Execution) -> Any:
    trace = _trace()
    job = execution.job
    parent, links = _origin(job.meta)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.id),
        "belay.job.kind": job.kind,
        "belay.job.attempt": job.attempt,
    }
    if job.workflow_id is not None:
        attributes["belay.workflow.id"] = job.workflow_id
    if execution.node is not None:  # an HTTP worker session
        attributes["messaging.client.id"] = execution.node
    return tracer().start_span(f"process {job.queue}", context=parent,
                               kind=trace.SpanKind.CONSUMER, attributes=attributes,
                               links=links)


def _origin(meta: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    """(the parent context, the links) of a consumer span from a job's meta."""
    from opentelemetry import context, propagate

    root = context.Context()  # not whatever span is current where the job runs
    carrier = carried(meta)
    if carrier is None:
        return root, []
    trace = _trace()
    parent = propagate.extract(
        {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)},
        context=root)
    remote = trace.get_current_span(parent).get_span_context()
    if not remote.is_valid:
        return root, []
    return parent, [trace.Link(remote, {"belay.link": "enqueue"})]


def enter(span: Any) -> Any:
    """Make ``span`` current (user code's spans nest under it); returns the
    token for :func:`leave`, None when ``span`` is."""
    if span is None:
        return None
    from opentelemetry import context

    return context.attach(_trace().set_span_in_context(span))


def leave(token: Any) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


def end(span: Any, outcome: str, error: Any = None, exception: BaseException | None = None,
        *, returned: Mapping[str, str] | None = None) -> None:
    """End an execution's span with its outcome (``belay.outcome``): status OK
    for ``succeeded``, ERROR with the recorded error for a failure
    (:data:`FAILURES`), unset with an event of that name otherwise (snoozed,
    parked, woken, cancelled). ``returned``: the trace context an HTTP
    worker's completion carried back, linked."""
    if span is None:
        return
    try:
        _end(span, outcome, error, exception, returned)
    except Exception:
        log.exception("belay: could not end the span of an execution (%s)", outcome)


def _end(span: Any, outcome: str, error: Any, exception: BaseException | None,
         returned: Mapping[str, str] | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("belay.outcome", outcome)
    if returned is not None:
        remote = _wire_context(returned)
        if remote is not None:
            span.add_link(remote, {"belay.link": "http_worker"})
    if outcome == "succeeded":
        span.set_status(Status(StatusCode.OK))
    elif outcome in FAILURES:
        if exception is not None:
            span.record_exception(exception)
        span.set_status(Status(StatusCode.ERROR, describe(outcome, error, exception)))
    else:
        span.add_event(f"belay.{outcome}", _parked(exception))
    span.end()


def describe(outcome: str, error: Any, exception: BaseException | None) -> str:
    """The status description of a failed execution: the recorded error's
    message, else the exception, else what the outcome means."""
    if isinstance(error, Mapping):
        for key in ("message", "error", "reason"):
            text = error.get(key)
            if isinstance(text, str) and text:
                return text
    if exception is not None:
        from belay.outcome import describe as describe_exception

        return describe_exception(exception)
    return FAILURES.get(outcome, outcome)


def _parked(exception: BaseException | None) -> dict[str, Any]:
    """The event attributes of a park: the signal waited for."""
    scope, name = getattr(exception, "scope", None), getattr(exception, "name", None)
    if isinstance(scope, str) and isinstance(name, str):
        return {"belay.signal.scope": scope, "belay.signal.name": name}
    return {}


# -- Steps: INTERNAL spans under the consumer's --------------------------------------------


def step(execution: Execution, name: str, run: Callable[[], T]) -> T:
    """``run()`` (a ``ctx.step``: its journal lookup, function and record)
    inside the step's span, when the execution has a span."""
    consumer = execution.span
    if consumer is None:
        return run()
    opened = _open_step(consumer, name)
    try:
        value = run()
    except BaseException as exc:
        _close_step(opened, exc)
        raise
    _close_step(opened, None)
    return value


async def astep(execution: Execution, name: str, run: Callable[[], Awaitable[T]]) -> T:
    """:func:`step` for ``ctx.astep``."""
    consumer = execution.span
    if consumer is None:
        return await run()
    opened = _open_step(consumer, name)
    try:
        value = await run()
    except BaseException as exc:
        _close_step(opened, exc)
        raise
    _close_step(opened, None)
    return value


def _open_step(consumer: Any, name: str) -> tuple[Any, Any, Any]:
    from opentelemetry import context

    trace = _trace()
    # Under the current span when it is the job's own (a span of the job's
    # code, or the consumer's), else (a chunk, a thread without the context)
    # straight under the consumer's.
    current = trace.get_current_span().get_span_context()
    parent = (None if current.trace_id == consumer.get_span_context().trace_id
              else trace.set_span_in_context(consumer))
    span = tracer().start_span(f"step {name}", context=parent, kind=trace.SpanKind.INTERNAL,
                               attributes={"belay.step.name": name,
                                           "belay.step.replayed": False})
    return span, context.attach(trace.set_span_in_context(span)), _STEP.set((name, span))


def _close_step(opened: tuple[Any, Any, Any], exc: BaseException | None) -> None:
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    span, token, mark = opened
    _STEP.reset(mark)
    context.detach(token)
    if exc is None:
        span.set_status(Status(StatusCode.OK))
    elif _is_failure(exc):
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, describe("failed", None, exc)))
    else:  # belay's control flow (a park, a sleep, a snooze, a cancel): not an error
        span.set_attribute("belay.step.control", type(exc).__name__)
    span.end()


def _is_failure(exc: BaseException) -> bool:
    """An exception that fails the attempt, not belay's control flow."""
    from belay.outcome import Cancel, Snooze

    return isinstance(exc, Exception) and not isinstance(exc, (Cancel, Snooze))


def step_replayed(name: str) -> None:
    """The journal answered step ``name``: its function does not run again."""
    entry = _STEP.get()
    if entry is not None and entry[0] == name:
        entry[1].set_attribute("belay.step.replayed", True)


def step_cost(name: str, usd_micros: int, tokens: int) -> None:
    """Step ``name`` was journaled with this cost."""
    entry = _STEP.get()
    if entry is not None and entry[0] == name:
        entry[1].set_attributes({"belay.cost.usd": usd_micros / 1_000_000,
                                 "belay.cost.tokens": tokens})


# -- HTTP workers: the context on the wire --------------------------------------------------


def wire(span: Any) -> dict[str, str]:
    """The W3C ``traceparent`` (and ``tracestate``) of an execution's span,
    for the HTTP worker's execute event; empty when there is no span."""
    if span is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, _trace().set_span_in_context(span))
    return carrier


def returned_context(traceparent: Any, tracestate: Any) -> dict[str, str] | None:
    """The trace context an HTTP worker's completion carries back, checked
    (pure: no OpenTelemetry needed); raises ValueError with what is wrong."""
    if tracestate is not None and not isinstance(tracestate, str):
        raise ValueError(f"tracestate must be a string, got {tracestate!r:.80}")
    if traceparent is None:
        return None  # a tracestate alone means nothing: ignored
    if not isinstance(traceparent, str) or not TRACEPARENT.fullmatch(traceparent):
        raise ValueError("traceparent must be a W3C traceparent like "
                         f"'00-<32 hex>-<16 hex>-<2 hex>' (lowercase), got {traceparent!r:.80}")
    found = {"traceparent": traceparent}
    if tracestate:
        found["tracestate"] = tracestate
    return found


def _wire_context(carrier: Mapping[str, str]) -> Any:
    """The span context of a W3C carrier, or None when it is not a valid one
    (an all-zero id: ignored, as W3C asks)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    found = _trace().get_current_span(
        TraceContextTextMapPropagator().extract(dict(carrier))).get_span_context()
    return found if found.is_valid else None
