"""OpenTelemetry traces from enqueue to ack (``belay.otel``), on a real database.

Spans go to the SDK's in-memory exporter through a provider handed to
``belay.otel.configure`` (the global provider can be set once per process, and
other tests in this process must not trace). A ``SimpleSpanProcessor`` exports
a span when it ends, and belay ends an execution's span before its
``on_job_end`` hooks run, so a test that saw the hook finds the span.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.applications import Starlette
from starlette.testclient import TestClient

import belay
import belay.testing
from belay import otel
from belay.http.workers import WorkerSessions, worker_routes
from tests.helpers import Ends


@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    tracer_provider = TracerProvider()
    otel.configure(tracer_provider=tracer_provider)
    try:
        yield tracer_provider
    finally:
        otel.configure(tracer_provider=None)
        tracer_provider.shutdown()


@pytest.fixture
def spans(provider: TracerProvider) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def no_backoff(attempt: int) -> float:
    return 0.0


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return (f"00-{format_trace_id(context.trace_id)}-{format_span_id(context.span_id)}-"
            f"{int(context.trace_flags):02x}")


def assert_linked(consumer: ReadableSpan, producer: ReadableSpan) -> None:
    """Parented to the enqueue's span (one trace) and linked to it."""
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None
    assert consumer.parent.span_id == producer.context.span_id
    assert [(link.context.span_id, dict(link.attributes or {})) for link in consumer.links][:1] \
        == [(producer.context.span_id, {"belay.link": "enqueue"})]


# -- A real worker -----------------------------------------------------------------------------


def test_a_worker_runs_each_job_in_a_consumer_span_parented_and_linked_to_its_enqueue(
        client: belay.Belay, provider: TracerProvider, spans: InMemorySpanExporter) -> None:
    reg = belay.Registry()
    inside: dict[str, Any] = {}

    @belay.worker(name="otel.greet", registry=reg)
    def greet(ctx: belay.Context) -> str:
        with provider.get_tracer("app").start_as_current_span("app.work") as mine:
            inside["span"] = mine.get_span_context()
        return f"hello {ctx.input['who']}"

    job = client.enqueue(greet, {"who": "otel"})
    stored = client.get_job(job.id)
    assert stored is not None
    assert set(stored.meta["$trace"]) >= {"traceparent"}
    worker = belay.Worker(["default"], client=client, registry=reg, poll_interval=0.05,
                          busy_poll=0.01, sweep_interval=3600.0, shutdown_grace=5.0)
    ends = Ends(worker)
    worker.start()
    try:
        assert [e.outcome for e in ends.wait_for(1)] == ["succeeded"]
    finally:
        worker.stop()

    producer = one(spans, "send default")
    assert producer.kind == SpanKind.PRODUCER
    assert stored.meta["$trace"]["traceparent"] == traceparent(producer)
    consumer = one(spans, "process default")
    assert consumer.kind == SpanKind.CONSUMER
    assert_linked(consumer, producer)
    assert dict(consumer.attributes or {}) == {
        "messaging.system": "belay", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "default",
        "messaging.message.id": str(job.id), "belay.job.kind": "otel.greet",
        "belay.job.attempt": 1, "belay.outcome": "succeeded"}
    assert consumer.status.status_code == StatusCode.OK
    # The job's own span ran inside the consumer's: current in the worker's thread.
    app = one(spans, "app.work")
    assert app.parent is not None and app.parent.span_id == consumer.context.span_id
    assert inside["span"].trace_id == producer.context.trace_id


def test_the_worker_span_is_current_only_while_the_job_runs(
        client: belay.Belay, spans: InMemorySpanExporter) -> None:
    """After the run the executor thread's context is back to what it was."""
    from opentelemetry import trace

    reg = belay.Registry()

    @belay.worker(name="otel.noop", registry=reg)
    def noop(ctx: belay.Context) -> None:
        return None

    client.enqueue(noop)
    assert belay.testing.drain(client=client, registry=reg) == {"succeeded": 1}
    assert not trace.get_current_span().get_span_context().is_valid
    assert one(spans, "process default").status.status_code == StatusCode.OK


# -- Steps -------------------------------------------------------------------------------------


def test_steps_are_child_spans_with_their_cost_and_replays_are_marked(
        client: belay.Belay, spans: InMemorySpanExporter) -> None:
    reg = belay.Registry()
    calls: list[str] = []

    @belay.worker(name="otel.steps", registry=reg, backoff=no_backoff)
    def job(ctx: belay.Context) -> Any:
        def fetch() -> str:
            calls.append("fetch")
            return "page"
        got = ctx.step("fetch", fetch, cost=belay.Cost(usd=0.25, tokens=100))
        if ctx.attempt == 1:
            raise RuntimeError("the model said no")
        return ctx.step("summarize", lambda: got.upper(), cost={"tokens": 7})

    j = client.enqueue(job)
    assert belay.testing.drain(client=client, registry=reg) == {"retry": 1, "succeeded": 1}
    assert calls == ["fetch"]  # the replay did not run it again

    producer = one(spans, "send default")
    first, second = sorted(named(spans, "process default"),
                           key=lambda s: str((s.attributes or {})["belay.job.attempt"]))
    for consumer in (first, second):  # every attempt in the enqueue's trace
        assert_linked(consumer, producer)
    assert first.status.status_code == StatusCode.ERROR
    assert first.status.description == "RuntimeError: the model said no"
    assert first.attributes["belay.outcome"] == "retry"  # type: ignore[index]
    assert [e.name for e in first.events] == ["exception"]
    assert second.status.status_code == StatusCode.OK

    ran, replayed = sorted(named(spans, "step fetch"), key=lambda s: s.start_time or 0)
    assert ran.kind == SpanKind.INTERNAL
    assert ran.parent is not None and ran.parent.span_id == first.context.span_id
    assert dict(ran.attributes or {}) == {
        "belay.step.name": "fetch", "belay.step.replayed": False,
        "belay.cost.usd": 0.25, "belay.cost.tokens": 100}
    assert replayed.parent is not None and replayed.parent.span_id == second.context.span_id
    assert dict(replayed.attributes or {}) == {"belay.step.name": "fetch",
                                               "belay.step.replayed": True}
    summarize = one(spans, "step summarize")
    assert summarize.parent is not None and summarize.parent.span_id == second.context.span_id
    assert (summarize.attributes or {})["belay.cost.tokens"] == 7
    assert (summarize.attributes or {})["belay.cost.usd"] == 0.0
    assert summarize.status.status_code == StatusCode.OK
    assert client.get_job(j.id).result == "PAGE"  # type: ignore[union-attr]


def test_a_raising_step_is_an_error_span_and_astep_is_traced_too(
        client: belay.Belay, spans: InMemorySpanExporter) -> None:
    reg = belay.Registry()

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    @belay.worker(name="otel.async", registry=reg, max_attempts=1)
    def job(ctx: belay.Context) -> Any:
        async def main() -> int:
            return int(await ctx.astep("think", answer, cost={"usd": 0.5}))
        value = asyncio.run(main())
        ctx.step("explode", lambda: 1 / 0)
        return value

    client.enqueue(job)
    assert belay.testing.drain(client=client, registry=reg) == {"failed": 1}
    consumer = one(spans, "process default")
    assert consumer.status.status_code == StatusCode.ERROR
    assert consumer.status.description == "ZeroDivisionError: division by zero"
    think, explode = one(spans, "step think"), one(spans, "step explode")
    for step in (think, explode):
        assert step.parent is not None and step.parent.span_id == consumer.context.span_id
    assert think.status.status_code == StatusCode.OK
    assert (think.attributes or {})["belay.cost.usd"] == 0.5
    assert explode.status.status_code == StatusCode.ERROR
    assert [e.name for e in explode.events] == ["exception"]


def test_snoozed_and_parked_runs_are_outcomes_not_errors(
        client: belay.Belay, spans: InMemorySpanExporter) -> None:
    reg = belay.Registry()

    @belay.worker(name="otel.snooze", registry=reg)
    def snoozer(ctx: belay.Context) -> None:
        def later() -> None:
            raise belay.Snooze(60)
        ctx.step("later", later)

    @belay.worker(name="otel.park", registry=reg)
    def parker(ctx: belay.Context) -> Any:
        return ctx.await_signal("approved")

    client.enqueue(snoozer)
    client.enqueue(parker)
    assert belay.testing.drain(client=client, registry=reg) == {"snooze": 1, "await": 1}
    by_outcome = {(s.attributes or {})["belay.outcome"]: s
                  for s in named(spans, "process default")}
    assert set(by_outcome) == {"snooze", "await"}
    for span in by_outcome.values():
        assert span.status.status_code == StatusCode.UNSET
    assert [e.name for e in by_outcome["snooze"].events] == ["belay.snooze"]
    (parked,) = by_outcome["await"].events
    assert parked.name == "belay.await"
    assert (parked.attributes or {})["belay.signal.name"] == "approved"
    later = one(spans, "step later")  # belay's control flow: not an error
    assert later.status.status_code == StatusCode.UNSET
    assert (later.attributes or {})["belay.step.control"] == "Snooze"
    assert later.parent is not None
    assert later.parent.span_id == by_outcome["snooze"].context.span_id


# -- No tracer: nothing at all -----------------------------------------------------------------


def test_without_a_tracer_provider_no_span_is_made_and_meta_carries_nothing(
        client: belay.Belay, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not otel.enabled()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was started with no tracer provider")

    monkeypatch.setattr(otel, "tracer", refuse)
    reg = belay.Registry()

    @belay.worker(name="otel.off", registry=reg)
    def job(ctx: belay.Context) -> int:
        return int(ctx.step("one", lambda: 1, cost={"usd": 0.1}))

    j = client.enqueue(job)
    stored = client.get_job(j.id)
    assert stored is not None and "$trace" not in stored.meta
    assert belay.testing.drain(client=client, registry=reg) == {"succeeded": 1}
    assert client.get_job(j.id).result == 1  # type: ignore[union-attr]


# -- HTTP workers ------------------------------------------------------------------------------


@pytest.fixture
def sessions(client: belay.Belay) -> Iterator[WorkerSessions]:
    s = WorkerSessions(client, session_ttl=60.0, lease_ttl=30.0)
    yield s
    s.stop()


def test_an_http_execution_is_a_consumer_span_whose_completion_links_the_workers_span(
        client: belay.Belay, sessions: WorkerSessions, provider: TracerProvider,
        spans: InMemorySpanExporter) -> None:
    job = client.enqueue("remote.task", {"n": 1})
    token = sessions.register("node-1", ["remote.task"])
    event = sessions.claim(token, "default", 0)
    assert event is not None and event["job_id"] == job.id

    # The remote worker's side: its span under the execution's, from the event.
    parent = TraceContextTextMapPropagator().extract({"traceparent": event["traceparent"]})
    with provider.get_tracer("remote").start_as_current_span(
            "remote.run", context=parent) as remote_span:
        remote = remote_span.get_span_context()
    returned = {"traceparent": f"00-{format_trace_id(remote.trace_id)}-"
                               f"{format_span_id(remote.span_id)}-01"}
    with TestClient(Starlette(routes=worker_routes(sessions))) as http:
        answer = http.post("/workers/complete", headers={"Authorization": f"Bearer {token}"},
                           json={"execution_id": event["execution_id"], "outcome": "success",
                                 "result": 2, **returned})
    assert answer.status_code == 200, answer.text

    producer, consumer = one(spans, "send default"), one(spans, "process default")
    assert consumer.kind == SpanKind.CONSUMER
    assert event["traceparent"] == traceparent(consumer)
    assert_linked(consumer, producer)
    assert [(link.context.span_id, dict(link.attributes or {})) for link in consumer.links][1:] \
        == [(remote.span_id, {"belay.link": "http_worker"})]
    assert str((consumer.attributes or {})["messaging.client.id"]).startswith("http:node-1/")
    assert consumer.status.status_code == StatusCode.OK
    assert one(spans, "remote.run").parent.span_id == consumer.context.span_id  # type: ignore[union-attr]


def test_an_http_failure_is_an_error_span_and_a_bad_traceparent_is_refused(
        client: belay.Belay, sessions: WorkerSessions, spans: InMemorySpanExporter) -> None:
    client.enqueue("remote.task", {}, max_attempts=1)
    token = sessions.register("node-1", ["remote.task"])
    event = sessions.claim(token, "default", 0)
    assert event is not None
    auth = {"Authorization": f"Bearer {token}"}
    failure = {"execution_id": event["execution_id"], "outcome": "failure",
               "error": {"type": "CardDeclined", "message": "issuer said no"}}
    with TestClient(Starlette(routes=worker_routes(sessions))) as http:
        for bad in ("00-abc-def-01", "00-" + "A" * 32 + "-" + "b" * 16 + "-01", 7):
            refused = http.post("/workers/complete", headers=auth,
                                json={**failure, "traceparent": bad})
            assert refused.status_code == 400, refused.text
            assert "traceparent" in refused.json()["error"]["message"]
        assert spans.get_finished_spans()[-1].name == "send default"  # still open
        assert http.post("/workers/complete", headers=auth, json=failure).status_code == 200
    consumer = one(spans, "process default")
    assert consumer.status.status_code == StatusCode.ERROR
    assert consumer.status.description == "CardDeclined: issuer said no"
    assert (consumer.attributes or {})["belay.outcome"] == "failed"


def test_an_http_execution_cut_short_by_a_cancel_ends_its_span(
        client: belay.Belay, sessions: WorkerSessions, spans: InMemorySpanExporter) -> None:
    job = client.enqueue("remote.task", {})
    token = sessions.register("node-1", ["remote.task"])
    assert sessions.claim(token, "default", 0) is not None
    client.cancel_job(job.id)
    sessions.tick()  # the renewal sees the cancel request
    consumer = one(spans, "process default")
    assert (consumer.attributes or {})["belay.outcome"] == "cancelled"
    assert [e.name for e in consumer.events] == ["belay.cancelled"]


def test_without_a_tracer_the_execute_event_carries_no_context(
        client: belay.Belay, sessions: WorkerSessions) -> None:
    client.enqueue("remote.task", {})
    token = sessions.register("node-1", ["remote.task"])
    event = sessions.claim(token, "default", 0)
    assert event is not None and "traceparent" not in event
    sessions.complete(token, event["execution_id"], "success", result=None)


def test_an_http_enqueue_continues_the_callers_trace(
        client: belay.Belay, spans: InMemorySpanExporter) -> None:
    from belay.http import build_app

    caller = "00-" + "a1" * 16 + "-" + "b2" * 8 + "-01"
    with TestClient(build_app(client)) as http:
        answer = http.post("/jobs", json={"task": "remote.task", "args": {}},
                           headers={"traceparent": caller})
        plain = http.post("/jobs", json={"task": "remote.task", "args": {"n": 2}})
    assert answer.status_code == 201 and plain.status_code == 201
    continued, fresh = sorted(named(spans, "send default"), key=lambda s: s.start_time or 0)
    assert format_trace_id(continued.context.trace_id) == "a1" * 16
    assert continued.parent is not None and format_span_id(continued.parent.span_id) == "b2" * 8
    assert fresh.parent is None  # no header: a trace of its own
    stored = client.get_job(answer.json()["id"])
    assert stored is not None and stored.meta["$trace"]["traceparent"] == traceparent(continued)


# -- Pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(("traceparent", "tracestate", "expected"), [
    (None, None, None),
    (None, "k=v", None),
    ("00-" + "1" * 32 + "-" + "2" * 16 + "-01", None,
     {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
    ("00-" + "1" * 32 + "-" + "2" * 16 + "-00", "k=v",
     {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-00", "tracestate": "k=v"}),
])
def test_a_returned_context_is_checked(traceparent: Any, tracestate: Any, expected: Any) -> None:
    assert otel.returned_context(traceparent, tracestate) == expected


@pytest.mark.parametrize(("traceparent", "tracestate"), [
    ("", None), ("00-1-2-01", None), (" 00-" + "1" * 32 + "-" + "2" * 16 + "-01", None),
    ("00-" + "1" * 32 + "-" + "2" * 16 + "-01\n", None), (b"00", None),
    ("00-" + "1" * 32 + "-" + "2" * 16 + "-01", 5),
])
def test_a_malformed_returned_context_is_refused(traceparent: Any, tracestate: Any) -> None:
    with pytest.raises(ValueError, match=r"traceparent|tracestate"):
        otel.returned_context(traceparent, tracestate)


def test_an_invalid_but_well_formed_context_is_ignored(spans: InMemorySpanExporter) -> None:
    """An all-zero trace id is W3C syntax but no context: no link (W3C: ignore it)."""
    with otel.producer("enqueue", 1, queue="q") as carrier:
        assert carrier is not None
    span = otel.tracer().start_span("x")
    otel.end(span, "succeeded", returned={"traceparent": "00-" + "0" * 32 + "-" + "1" * 16
                                                          + "-01"})
    assert one(spans, "x").links == ()


def test_configure_falls_back_to_the_global_provider() -> None:
    provider = TracerProvider()
    with contextlib.ExitStack() as stack:
        stack.callback(otel.configure, tracer_provider=None)
        stack.callback(provider.shutdown)
        otel.configure(tracer_provider=provider)
        assert otel.enabled()
        otel.configure(tracer_provider=None)
        assert not otel.enabled()  # no global provider is set in the test run


def test_an_async_enqueue_is_a_producer_span_the_execution_continues(
        db_url: str, spans: InMemorySpanExporter) -> None:
    """belay.aio builds rows with the blocking client's code: the same span,
    the same context in meta, and the worker's span continues it."""
    from belay.aio import AsyncBelay

    reg = belay.Registry()

    @belay.worker(name="t.aio_traced", registry=reg)
    def traced(ctx: belay.Context) -> int:
        return 1

    async def enqueue() -> belay.Job:
        async with AsyncBelay(db_url, registry=reg) as aclient:
            many = await aclient.enqueue_many([{"kind": "t.aio_traced", "queue": "q"},
                                               {"kind": "t.aio_traced", "queue": "q"}])
            assert all("$trace" in job.meta for job in many)
            return await aclient.enqueue("t.aio_traced", queue="q", meta={"k": "v"})

    job = asyncio.run(enqueue())
    batch, single = named(spans, "send q")
    assert batch.kind is SpanKind.PRODUCER
    assert dict(batch.attributes or {})["messaging.batch.message_count"] == 2
    assert job.meta["k"] == "v" and job.meta["$trace"]["traceparent"] == traceparent(single)
    with belay.Belay(db_url, registry=reg) as client:
        assert client.get_job(job.id).meta["$trace"] == job.meta["$trace"]  # type: ignore[union-attr]
        belay.Worker(["q"], client=client, registry=reg).drain()
    consumers = [s for s in named(spans, "process q")
                 if dict(s.attributes or {})["messaging.message.id"] == str(job.id)]
    assert len(consumers) == 1
    assert_linked(consumers[0], single)
