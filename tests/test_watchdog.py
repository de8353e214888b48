"""The no-progress watchdog (issue 24, item 3): a looping agent is failed or
paused after N identical steps; a run that journals nothing new for T seconds
while holding its lease is failed or paused; off by default; set per enqueue
and per worker, the job's own winning.

The looping agents are real job functions run by real workers; the repeat
tests drain synchronously, the stall tests use worker threads and a job that
blocks on an event the test holds.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import belay
from belay.watchdog import Repeats, Watchdog, parse_watchdog, pattern, watchdog_of
from tests.helpers import job_row, wait_until
from tests.test_steps import counted, drain, names, no_backoff

LOOP = {"repeats": 3}


def looping_agent(reg: belay.Registry, calls: list[int], *, answer: Any = "search again",
                  turns: int = 10) -> Any:
    """An agent that asks the model the same thing and gets the same answer."""
    @belay.worker(name="looper", max_attempts=5, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        for turn in range(1, turns + 1):
            steer = ctx.steering()
            value = answer if steer is None else f"{steer['instruction']} {turn}"
            if ctx.step(f"think-{turn}", counted(calls, turn, value)) == "done":
                return "done"
        return "gave up"

    return job


# -- pure ----------------------------------------------------------------------------


def test_a_loop_is_the_same_step_pattern_with_the_same_value() -> None:
    assert pattern("think-12/tool:3") == "think-#/tool:#"
    seen = Repeats(3)
    assert seen.add("think-1", b"a") is None
    assert seen.add("think-2", b"a") is None
    assert seen.add("think-3", b"a") == ["think-1", "think-2", "think-3"]
    other = Repeats(3)
    for n, value in enumerate([b"a", b"a", b"b", b"b"], 1):
        assert other.add(f"think-{n}", value) is None  # the answer changed: progress
    mixed = Repeats(2)
    assert mixed.add("plan", b"x") is None
    assert mixed.add("act", b"x") is None  # another step with the same value


@pytest.mark.parametrize(("value", "message"), [
    ({}, "needs repeats and/or stall"),
    ({"repeats": 1}, "from 2 to 1000"),
    ({"stall": 0}, "above 0"),
    ({"stall": float("inf")}, "above 0"),
    ({"repeats": 3, "on_trip": "stop"}, "on_trip is 'fail' or 'pause'"),
    ({"repeat": 3}, "unknown watchdog key"),
    ("3", "a dict like"),
])
def test_bad_settings_name_the_fix(value: Any, message: str) -> None:
    with pytest.raises(belay.ValidationError, match=message):
        parse_watchdog(value)


def test_a_jobs_own_watchdog_wins_over_the_workers() -> None:
    worker = Watchdog(repeats=5)
    assert watchdog_of({}, worker) == worker
    assert watchdog_of({"$watchdog": {"stall": 9, "on_trip": "fail"}}, worker) == Watchdog(
        None, 9.0, "fail")
    assert watchdog_of({"$watchdog": "garbage"}, None) is None


# -- repeats ---------------------------------------------------------------------------


def test_off_by_default_a_loop_runs_to_its_end(client) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(looping_agent(reg, calls))
    assert drain(client, reg) == {"succeeded": 1}
    assert client.get_job(j.id).result == "gave up"  # type: ignore[union-attr]
    assert len(calls) == 10


def test_a_looping_agent_fails_after_n_identical_steps(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(looping_agent(reg, calls), watchdog=LOOP)
    assert j.meta == {"$watchdog": {"on_trip": "fail", "repeats": 3}}
    assert drain(client, reg) == {"failed": 1}
    assert calls == [1, 2, 3]  # no fourth paid call; no retry either
    row = job_row(sql_conn, j.id)
    [entry] = row["errors"]
    assert (entry["error"], entry["reason"], entry["steps"]) == (
        "no_progress", "repeats", ["think-1", "think-2", "think-3"])
    assert "3 steps in a row" in entry["message"]


def test_progress_resets_the_count(client) -> None:
    reg, calls = belay.Registry(), []

    @belay.worker(name="varied", registry=reg)
    def varied(ctx: belay.Context) -> str:
        for turn in range(1, 9):
            ctx.step(f"think-{turn}", counted(calls, turn, turn // 2))  # pairs repeat
        return "ok"

    client.enqueue(varied, watchdog=LOOP)
    assert drain(client, reg) == {"succeeded": 1}


def test_a_paused_loop_waits_for_steering_and_resumes_steered(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(looping_agent(reg, calls), watchdog={**LOOP, "on_trip": "pause"})
    assert drain(client, reg) == {"await": 1}
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["await_name"], row["attempt"]) == ("awaiting", "$steer", 0)
    paused = [e for (e,) in sql_conn.execute(
        "SELECT payload FROM belay_events WHERE job_id = %s ORDER BY seq", (j.id,))]
    assert [(e["type"], e["steps"]) for e in paused] == [
        ("watchdog_paused", ["think-1", "think-2", "think-3"])]
    assert drain(client, reg) == {}  # stays parked

    assert client.steer_job(j.id, {"instruction": "try"}) == [j.id]
    assert drain(client, reg) == {"succeeded": 1}
    # The three paid steps replayed; the steered run went on from think-4.
    assert calls == list(range(1, 11))
    assert names(sql_conn, j.id) == [f"think-{n}" for n in range(1, 11)]


def test_the_workers_watchdog_guards_jobs_without_their_own(client) -> None:
    reg, calls = belay.Registry(), []
    job = looping_agent(reg, calls)
    worker = belay.Worker(["default"], client=client, registry=reg, watchdog=LOOP)
    client.enqueue(job)
    assert worker.drain() == {"failed": 1}
    assert calls == [1, 2, 3]
    calls.clear()
    client.enqueue(job, watchdog={"repeats": 5})  # its own wins
    assert worker.drain() == {"failed": 1}
    assert calls == [1, 2, 3, 4, 5]
    with pytest.raises(belay.ValidationError, match="Worker watchdog"):
        belay.Worker(["default"], client=client, registry=reg, watchdog={"repeats": 0})


# -- stall -----------------------------------------------------------------------------


def hung_agent(reg: belay.Registry, release: threading.Event, entered: threading.Event) -> Any:
    @belay.worker(name="hung", backoff=no_backoff, max_attempts=3, registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("plan", lambda: "ok")
        entered.set()
        release.wait(30)  # a call that never answers
        return "late"

    return job


@pytest.mark.parametrize("on_trip", ["fail", "pause"])
def test_a_run_that_journals_nothing_for_the_stall_is_stopped(real_client, sql_conn,
                                                              on_trip) -> None:
    reg = belay.Registry()
    release, entered = threading.Event(), threading.Event()
    j = real_client.enqueue(hung_agent(reg, release, entered),
                            watchdog={"stall": 0.5, "on_trip": on_trip})
    # The stall is checked at each heartbeat (every lease_ttl / 3): a short
    # TTL checks it every 0.5 s, not at the default 10 s that the wait below
    # would barely outlast.
    worker = belay.Worker(["default"], client=real_client, registry=reg, poll_interval=0.05,
                          lease_ttl=1.5)
    try:
        worker.start()
        assert entered.wait(10)
        want = "failed" if on_trip == "fail" else "awaiting"
        wait_until(lambda: job_row(sql_conn, j.id)["state"] == want, f"the job {want}",
                   timeout=10)
    finally:
        release.set()
        worker.stop()
    row = job_row(sql_conn, j.id)
    if on_trip == "fail":
        [entry] = row["errors"]
        assert (entry["error"], entry["reason"], entry["last_step"]) == (
            "no_progress", "stalled", "plan")
        assert entry["stall"] == 0.5
    else:
        assert (row["await_name"], row["attempt"], row["errors"]) == ("$steer", 0, [])
    assert row["result"] is None  # the late return was discarded
