"""The worker's parts (belay.parts): supervised services, the crash policy,
middleware, and the HTTP sessions on the same leases."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import belay
from belay.clock import ManualClock
from belay.errors import WorkerCrashed
from belay.http.workers import StaleExecution, Unavailable, WorkerSessions
from belay.parts.execution import LOST, Execution
from belay.parts.service import Service, ServiceCrashed
from tests.helpers import Ends, job_row, wait_until
from tests.test_worker import make_worker


class Killed(BaseException):
    """What the tests kill a service with: nothing in a loop catches it."""


# -- Service ------------------------------------------------------------------------------


def test_a_service_that_raises_is_a_crash_reported_once() -> None:
    crashes: list[tuple[str, BaseException]] = []
    reported = threading.Event()

    def body(service: Service) -> None:
        raise Killed("boom")

    def on_crash(service: Service, exc: BaseException) -> None:
        crashes.append((service.name, exc))
        reported.set()

    service = Service("belay-test", body, on_crash=on_crash).start()
    assert reported.wait(5)
    assert service.join(5)
    assert [(name, type(exc)) for name, exc in crashes] == [("belay-test", Killed)]
    assert isinstance(service.crashed, Killed)
    assert "crashed" in repr(service)


def test_a_service_that_returns_unasked_crashed_and_one_stopped_did_not() -> None:
    crashes: list[BaseException] = []
    early = Service("belay-early", lambda service: None,
                    on_crash=lambda service, exc: crashes.append(exc)).start()
    assert early.join(5)
    assert len(crashes) == 1 and isinstance(crashes[0], ServiceCrashed)

    def loop(service: Service) -> None:
        while not service.wait(60):
            pass

    steady = Service("belay-steady", loop,
                     on_crash=lambda service, exc: crashes.append(exc)).start()
    assert steady.alive
    steady.stop()
    assert steady.join(5)
    assert len(crashes) == 1 and steady.crashed is None


def test_wake_cuts_a_wait_short_without_stopping() -> None:
    woke = threading.Event()
    passes: list[bool] = []

    def loop(service: Service) -> None:
        while not service.wait(60):
            passes.append(True)
            woke.set()

    service = Service("belay-wakeable", loop).start()
    service.wake()
    assert woke.wait(5)
    service.stop()
    assert service.join(5)
    assert passes == [True]


# -- A worker whose heartbeat dies --------------------------------------------------------


def test_a_dead_heartbeat_stops_the_worker_and_no_job_runs_twice(
        client: belay.Belay, clock: ManualClock, sql_conn: Any) -> None:
    """The heartbeat renews every lease this node holds. Once it is gone, a
    job the node still claimed would lapse and run again elsewhere while it
    still runs here: the worker must stop claiming, interrupt what runs (its
    results can't count), and stop."""
    reg = belay.Registry()
    lock = threading.Lock()
    runs: list[tuple[int, int]] = []
    effects: list[tuple[int, str]] = []
    entered = threading.Event()
    gate = threading.Event()

    def effect(job_id: int, what: str) -> None:
        with lock:
            effects.append((job_id, what))

    @belay.worker(name="parts.twice", registry=reg, max_attempts=5)
    def twice(ctx: belay.Context) -> str:
        with lock:
            runs.append((ctx.id, ctx.attempt))
        ctx.step("first", lambda: effect(ctx.id, "first"))
        entered.set()
        gate.wait(15)
        ctx.step("second", lambda: effect(ctx.id, "second"))
        effect(ctx.id, "tail")  # no journal: done twice if two runs overlap
        return "done"

    a = make_worker(client, reg, {"default": 4}, lease_ttl=30.0)
    ends = Ends(a)
    crashed: list[str] = []
    crash_seen, stopped = threading.Event(), threading.Event()
    a.on_crash(lambda service, exc: (crashed.append(service), crash_seen.set()))
    a.on_stop(stopped.set)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            a.run()
        except BaseException as exc:
            raised.append(exc)

    first = client.enqueue("parts.twice")
    runner = threading.Thread(target=run, name="test-worker-run")
    runner.start()
    try:
        assert entered.wait(10)

        def die() -> float:
            raise Killed("the test killed the heartbeat")

        a.leases.beat = die  # type: ignore[method-assign]
        a.leases.wake()
        assert crash_seen.wait(10)
        second = client.enqueue("parts.twice")
        clock.advance(31)  # the first job's lease lapses: nothing renews it now
        gate.set()
        assert stopped.wait(15)
    finally:
        gate.set()
        runner.join(15)
    assert crashed == ["belay-heartbeat"]
    assert isinstance(a.crashed, Killed)
    assert len(raised) == 1 and isinstance(raised[0], WorkerCrashed)
    assert "belay-heartbeat" in str(raised[0])
    assert ends.outcomes() == {first.id: "lost"}
    assert job_row(sql_conn, second.id)["state"] == "ready"  # never claimed by the dead node

    b = make_worker(client, reg, {"default": 4})
    assert b.reclaim() == 1
    clock.advance(3600)  # past the retry's backoff
    assert b.drain() == {"succeeded": 2}
    assert sorted(runs) == sorted([(first.id, 1), (first.id, 2), (second.id, 1)])
    for job in (first, second):
        assert sorted(what for job_id, what in effects if job_id == job.id) == \
            ["first", "second", "tail"]
        assert client.get_job(job.id).state == "succeeded"


def test_a_crash_is_counted_in_the_metrics_and_the_stop_hooks_run(
        client: belay.Belay) -> None:
    pytest.importorskip("prometheus_client")
    from belay.telemetry import PrometheusMetrics

    worker = make_worker(client, belay.Registry())
    metrics = PrometheusMetrics(worker, queue_depths=False)
    stopped = threading.Event()
    worker.on_stop(stopped.set)
    worker.start()
    try:
        def die(service: Service) -> None:
            raise Killed("the test killed the sweeper")

        worker.supervisor.start("belay-sweeper-2", die)
        assert stopped.wait(15)
    finally:
        worker.stop()
    assert metrics.registry.get_sample_value(
        "belay_worker_crashes_total", {"service": "sweeper-2"}) == 1.0
    assert isinstance(worker.crashed, Killed)


def test_belay_worker_exits_non_zero_when_its_heartbeat_dies(db_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "belay", "worker", "--url", db_url, "--import",
         "tests.crash_jobs", "--lease-ttl", "0.3", "--shutdown-grace", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "belay-heartbeat service crashed" in done.stderr
    assert "Restart it" in done.stderr


# -- Middleware ----------------------------------------------------------------------------


def test_middleware_wraps_every_run_outside_in(client: belay.Belay) -> None:
    reg = belay.Registry()
    calls: list[str] = []

    @belay.worker(name="parts.mw", registry=reg)
    def one(ctx: belay.Context) -> int:
        calls.append(f"run {ctx.input['n']}")
        assert belay.current_context() is ctx
        return int(ctx.input["n"]) * 2

    @belay.worker(name="parts.mw.chunk", registry=reg, chunk={"size": 3, "gather_ms": 0})
    def chunked(contexts: list[belay.Context]) -> None:
        calls.append(f"chunk of {len(contexts)}")

    worker = make_worker(client, reg)

    @worker.middleware
    def outer(contexts: Any, call: Any) -> Any:
        calls.append(f"outer in {[c.id for c in contexts]}")
        try:
            return call()
        finally:
            calls.append("outer out")

    @worker.middleware
    def inner(contexts: Any, call: Any) -> Any:
        calls.append("inner in")
        return call()

    job = client.enqueue("parts.mw", {"n": 21})
    assert worker.drain() == {"succeeded": 1}
    assert client.get_job(job.id).result == 42
    assert calls == [f"outer in {[job.id]}", "inner in", "run 21", "outer out"]
    calls.clear()
    chunk = [client.enqueue("parts.mw.chunk") for _ in range(3)]
    assert worker.drain() == {"succeeded": 3}
    assert calls == [f"outer in {[j.id for j in chunk]}", "inner in", "chunk of 3", "outer out"]


def test_a_middleware_that_raises_is_the_jobs_error(client: belay.Belay) -> None:
    reg = belay.Registry()
    belay.worker(name="parts.mw.fail", registry=reg)(lambda ctx: "never")
    worker = make_worker(client, reg)

    @worker.middleware
    def refuse(contexts: Any, call: Any) -> Any:
        raise RuntimeError("the middleware refused")

    job = client.enqueue("parts.mw.fail")
    assert worker.drain() == {"retry": 1}
    errors = client.get_job(job.id).errors
    assert "RuntimeError: the middleware refused" in errors[-1]["error"]


# -- HTTP sessions on the same leases ---------------------------------------------------


@pytest.fixture
def sessions(client: belay.Belay, clock: ManualClock) -> Iterator[WorkerSessions]:
    instance = WorkerSessions(client, lease_ttl=30.0)
    try:
        yield instance
    finally:
        instance.stop()


def claimed(sessions: WorkerSessions, client: belay.Belay,
            capacity: int = 1) -> tuple[str, belay.Job, dict[str, Any]]:
    """A session's token, the job it claimed, and the execute event."""
    token = sessions.register("rt", ["parts.http"], capacity, "default")
    job = client.enqueue("parts.http")
    event = sessions.claim(token, "default", wait=0)
    assert event is not None
    return token, job, event


def test_http_sessions_hold_their_executions_in_the_leases_part(
        sessions: WorkerSessions, client: belay.Belay) -> None:
    token, job, event = claimed(sessions, client)
    (held,) = sessions.leases.running()
    assert isinstance(held, Execution) and held.key == (job.id, 1)
    assert held.node is not None and held.node.startswith("http:rt/")
    sessions.complete(token, event["execution_id"], "success", {"ok": True})
    assert sessions.leases.running() == []


def test_http_sessions_refuse_claims_once_their_heartbeat_died(
        sessions: WorkerSessions, client: belay.Belay) -> None:
    token, _, _ = claimed(sessions, client, capacity=2)
    (held,) = sessions.leases.running()

    def die() -> float:
        raise Killed("the test killed the heartbeat")

    sessions.leases.beat = die  # type: ignore[method-assign]
    sessions.leases.wake()
    wait_until(lambda: sessions.crashed is not None, "the heartbeat crashed")
    assert held.ended == LOST
    client.enqueue("parts.http")
    with pytest.raises(Unavailable, match="heartbeat crashed"):
        sessions.claim(token, "default", wait=0)
    with pytest.raises(Unavailable, match="heartbeat crashed"):
        sessions.register("rt2", ["parts.http"])


def test_a_lost_lease_reads_the_same_on_both_kinds_of_worker(
        sessions: WorkerSessions, client: belay.Belay, sql_conn: Any) -> None:
    """One vocabulary: the HTTP session's execution ends "lost", as a thread's
    does, and the worker is told it "lost its lease"."""
    token, job, event = claimed(sessions, client)
    sql_conn.execute("UPDATE belay_jobs SET leased_by = 'someone-else' WHERE id = %s",
                     (job.id,))
    (lost,) = sessions.leases.renew()
    assert lost.ended == LOST
    with pytest.raises(StaleExecution, match="lost its lease"):
        sessions.complete(token, event["execution_id"], "success")
    assert sessions.leases.running() == []


# -- The journal, public ---------------------------------------------------------------


def test_the_journal_looks_up_and_records_steps_nested_where_step_may_not(
        client: belay.Belay) -> None:
    """What the agent integrations build on: a lookup and a record under a key
    of their own, inside a running step (``ctx.step`` refuses nesting)."""
    reg = belay.Registry()
    calls: list[str] = []

    @belay.worker(name="parts.journal", registry=reg)
    def journaled(ctx: belay.Context) -> Any:
        def outer() -> Any:
            hit, value = ctx.journal.lookup("inner")
            if not hit:
                calls.append("inner ran")
                value = ctx.journal.record("inner", {"n": 1}, belay.Cost(usd=0.25, tokens=7))
            return value
        first = ctx.step("outer", outer)
        return {"first": first, "again": ctx.journal.lookup("inner"),
                "rate": ctx.rate, "control": repr(ctx.control)}

    worker = make_worker(client, reg)
    job = client.enqueue("parts.journal")
    assert worker.drain() == {"succeeded": 1}
    result = client.get_job(job.id).result
    assert result == {"first": {"n": 1}, "again": [True, {"n": 1}], "rate": None,
                      "control": "None"}
    steps = {step.name: step for step in client.steps(job.id)}
    assert set(steps) == {"inner", "outer"}
    assert (steps["inner"].usd, steps["inner"].tokens) == (0.25, 7)
    assert calls == ["inner ran"]
