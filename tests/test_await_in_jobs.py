"""Signals inside jobs: await_signal (§7 park-and-wake), steering, events, durable sleep."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

import belay
from belay.testing import drain
from tests.helpers import START, job_row, wait_until


@pytest.fixture
def registry() -> belay.Registry:
    return belay.Registry()


@pytest.fixture
def runs(registry: belay.Registry) -> list[tuple[str, int]]:
    """Every execution of the `approval` worker's draft step body, by (what, job id)."""
    calls: list[tuple[str, int]] = []

    @belay.worker(name="t.approval", registry=registry)
    def approval(ctx: belay.Context) -> Any:
        draft = ctx.step("draft", lambda: calls.append(("draft", ctx.id)) or "v1")
        answer = ctx.await_signal("approval", timeout=3600)
        if answer is belay.TIMEOUT:
            return {"expired": True, "draft": draft}
        return {"answer": answer, "draft": draft}

    return calls


def run(client: belay.Belay, registry: belay.Registry) -> dict[str, int]:
    return drain(client=client, registry=registry)


def test_await_parks_the_job_without_an_attempt(client, registry, runs, sql_conn):
    job = client.enqueue("t.approval")
    assert run(client, registry) == {"await": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["await_scope"], row["await_name"]) == (
        "awaiting", f"job:{job.id}", "approval")
    assert row["ready_at"] == START + timedelta(seconds=3600)
    assert row["attempt"] == 0  # parking is not a try
    assert row["lease_until"] is None and row["leased_by"] is None


def test_a_signal_after_the_park_wakes_the_job_which_replays_its_steps(
    client, registry, runs, sql_conn
):
    job = client.enqueue("t.approval")
    run(client, registry)
    assert client.signal_job(job.id, "approval", {"ok": True}) == [job.id]
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == {"answer": {"ok": True}, "draft": "v1"}
    assert runs == [("draft", job.id)]  # the draft step ran once, across both runs


def test_a_signal_before_the_await_is_found_at_once(client, registry, runs):
    job = client.enqueue("t.approval")
    client.signal_job(job.id, "approval", {"early": True})
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result["answer"] == {"early": True}


def test_the_deadline_returns_timeout(client, registry, runs, clock):
    job = client.enqueue("t.approval")
    run(client, registry)
    clock.advance(3599)
    assert run(client, registry) == {}  # not due yet
    clock.advance(1)
    assert run(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == {"expired": True, "draft": "v1"}
    assert not belay.TIMEOUT


def test_signals_racing_parks_never_leave_a_job_stuck(db_url, registry):
    """§7 with real threads: deliveries race parks; every job still finishes."""
    @belay.worker(name="t.race", registry=registry)
    def race(ctx: belay.Context) -> Any:
        return ctx.await_signal("go")

    with belay.Belay(db_url, registry=registry) as client:
        jobs = [client.enqueue("t.race", {"n": n}) for n in range(30)]
        worker = belay.Worker({"default": 6}, client=client, registry=registry,
                              busy_poll=0.005, poll_interval=0.05, notify=True)
        senders = [threading.Thread(target=client.signal_job, args=(j.id, "go", {"n": n}))
                   for n, j in enumerate(jobs)]
        with worker:
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(10)
            for n, job in enumerate(jobs):
                assert client.await_result(job.id, timeout=20) == {"n": n}


def test_steering_reads_the_latest_payload(client, registry):
    seen: list[Any] = []

    @belay.worker(name="t.steer", registry=registry)
    def steer(ctx: belay.Context) -> None:
        seen.append(ctx.steering())

    client.enqueue("t.steer")
    run(client, registry)
    job = client.enqueue("t.steer")
    client.steer_job(job.id, {"instruction": "first"})
    client.steer_job(job.id, {"instruction": "second"})
    run(client, registry)
    assert seen == [None, {"instruction": "second"}]


def test_emit_appends_numbered_events(client, registry):
    @belay.worker(name="t.emit", registry=registry)
    def emit(ctx: belay.Context) -> list[int]:
        return [ctx.emit({"turn": n}) for n in range(3)]

    job = client.enqueue("t.emit")
    run(client, registry)
    assert client.get_job(job.id).result == [1, 2, 3]
    assert [e.payload for e in client.events(job.id)] == [{"turn": 0}, {"turn": 1}, {"turn": 2}]
    assert [e.seq for e in client.events(job.id, after=2)] == [3]


def test_emit_refuses_non_objects(client, registry):
    @belay.worker(name="t.bad_emit", registry=registry)
    def bad_emit(ctx: belay.Context) -> None:
        ctx.emit(["not", "an", "object"])  # type: ignore[arg-type]

    job = client.enqueue("t.bad_emit", max_attempts=1)
    assert run(client, registry) == {"failed": 1}
    assert "must be a dict" in client.get_job(job.id).errors[-1]["error"]


def test_sleep_snoozes_until_its_journaled_time_then_continues(client, registry, clock, sql_conn):
    after: list[int] = []

    @belay.worker(name="t.sleep", registry=registry)
    def sleepy(ctx: belay.Context) -> str:
        ctx.sleep("nap", 600)
        after.append(ctx.attempt)
        return "rested"

    job = client.enqueue("t.sleep")
    assert run(client, registry) == {"snooze": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"]) == ("ready", 0)
    assert row["ready_at"] == START + timedelta(seconds=600)
    steps = client.steps(job.id)
    assert [s.name for s in steps] == ["$sleep:nap"]
    clock.advance(599)
    assert run(client, registry) == {}
    clock.advance(1)
    assert run(client, registry) == {"succeeded": 1}
    assert after == [1] and client.get_job(job.id).result == "rested"


def test_a_foreign_sleep_value_is_not_interpreted(client, registry, sql_conn):
    @belay.worker(name="t.foreign_sleep", registry=registry)
    def foreign(ctx: belay.Context) -> str:
        ctx.sleep("nap", 600)
        return "continued"

    job = client.enqueue("t.foreign_sleep")
    # An Elixir worker journaled this sleep earlier, as an Erlang term (a small int here).
    sql_conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value) VALUES (%s, 1, '$sleep:nap', %s)",
        (job.id, b"\x83a\x05"),
    )
    assert run(client, registry) == {"succeeded": 1}


@pytest.mark.parametrize(("args", "message"), [
    (("",), "signal name"), (("x", -1), "timeout"), (("x", "soon"), "timeout"),
])
def test_await_signal_refuses_bad_arguments(client, registry, args, message):
    @belay.worker(name="t.bad_await", registry=registry)
    def bad(ctx: belay.Context) -> None:
        ctx.await_signal(*args)

    job = client.enqueue("t.bad_await", max_attempts=1)
    assert run(client, registry) == {"failed": 1}
    assert message in client.get_job(job.id).errors[-1]["error"]


def test_a_stale_park_is_discarded(client, registry, sql_conn):
    """A park from an attempt that lost its job changes nothing (§7 fence)."""
    started = threading.Event()
    release = threading.Event()

    @belay.worker(name="t.slow_await", registry=registry)
    def slow(ctx: belay.Context) -> Any:
        started.set()
        release.wait(10)
        return ctx.await_signal("never")

    job = client.enqueue("t.slow_await")
    worker = belay.Worker({"default": 1}, client=client, registry=registry,
                          busy_poll=0.005, poll_interval=0.05)
    ends: list[str] = []
    worker.on_job_end(lambda end: ends.append(end.outcome))
    with worker:
        assert started.wait(10)
        # Another node reclaimed it and ran it to completion meanwhile.
        sql_conn.execute(
            "UPDATE belay_jobs SET state = 'succeeded', attempt = attempt + 1 WHERE id = %s",
            (job.id,))
        release.set()
        wait_until(lambda: ends, "the late park is handled")
    assert ends == ["stale"]
    assert job_row(sql_conn, job.id)["state"] == "succeeded"


def test_debit_adds_to_the_resource_rate_window(client, registry, clock, sql_conn):
    @belay.worker(name="t.debit", registry=registry)
    def debit(ctx: belay.Context) -> None:
        ctx.debit("anthropic", 1_500, period=60)
        ctx.debit("anthropic", 500, period=60)

    client.enqueue("t.debit")
    run(client, registry)
    window = int(START.timestamp()) // 60 * 60
    rows = sql_conn.execute("SELECT bucket, window_start, count FROM belay_rate").fetchall()
    assert rows == [("resource:anthropic", window, 2_000)]


@pytest.mark.parametrize(("args", "message"), [
    (("", 1), "resource"), (("r", -1), "units"), (("r", 1.5), "units"), (("r", 1, 0), "period"),
    (("r", 1), "has no rate on resource 'r'"),
])
def test_debit_refuses_bad_arguments(client, registry, args, message):
    @belay.worker(name="t.bad_debit", registry=registry)
    def bad(ctx: belay.Context) -> None:
        resource, units, *rest = args
        ctx.debit(resource, units, **({"period": rest[0]} if rest else {}))

    job = client.enqueue("t.bad_debit", max_attempts=1)
    assert run(client, registry) == {"failed": 1}
    assert message in client.get_job(job.id).errors[-1]["error"]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda ctx: ctx.sleep("nap", 1e20), "sleep must be at most"),
        (lambda ctx: ctx.sleep("nap", timedelta.max.total_seconds()), "100 years"),
        (lambda ctx: ctx.sleep("nap\x00", 5), "NUL"),
        (lambda ctx: ctx.await_signal("go", timeout=1e20), "await_signal timeout"),
        (lambda ctx: ctx.await_signal("go\ud800"), "lone surrogate"),
        (lambda ctx: ctx.step("s\udfff", lambda: 1), "lone surrogate"),
    ],
)
def test_out_of_range_waits_and_bad_names_in_a_job_fail_it_with_a_validation_error(
        client, registry, sql_conn, call, words):
    @belay.worker(name="t.bad_wait", registry=registry)
    def bad_wait(ctx: belay.Context) -> None:
        call(ctx)

    job = client.enqueue("t.bad_wait", max_attempts=1)
    assert run(client, registry) == {"failed": 1}
    error = client.get_job(job.id).errors[-1]
    assert "ValidationError" in error["error"] and words in error["error"], error
    assert sql_conn.execute("SELECT count(*) FROM belay_steps").fetchone() == (0,)


@pytest.mark.parametrize("spawn", ["spawn", "spawn_many", "map_children"])
@pytest.mark.parametrize("name", ["fan\x00out", "fan\ud800", "f" * 1000])
def test_a_bad_spawn_name_fails_the_job_before_any_child_or_step(client, registry, sql_conn,
                                                                  spawn, name):
    @belay.worker(name="t.bad_spawn", registry=registry)
    def parent(ctx: belay.Context) -> None:
        if spawn == "spawn":
            ctx.spawn(name, "t.child", {})
        else:
            getattr(ctx, spawn)(name, "t.child", [{}])

    job = client.enqueue("t.bad_spawn", max_attempts=1)
    assert run(client, registry) == {"failed": 1}
    error = client.get_job(job.id).errors[-1]["error"]
    assert "ValidationError" in error and "a spawn name" in error, error
    assert sql_conn.execute("SELECT count(*) FROM belay_jobs").fetchone() == (1,)
    assert sql_conn.execute("SELECT count(*) FROM belay_steps").fetchone() == (0,)
