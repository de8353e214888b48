"""Schedules (belay.schedules): crons with overlap policies, catch-up modes and
a durable cursor, against a real PostgreSQL — the pure plan, then rounds of
real schedulers (restarts, several nodes racing on threads)."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import belay
from belay.clock import ManualClock
from belay.cron import CronScheduler, parse
from belay.errors import ConfigurationError, ValidationError
from belay.schedules import MAX_PER_ROUND, Plan, due, plan
from tests.helpers import START

T = [START + timedelta(minutes=n) for n in range(10)]


# -- The plan (pure) ---------------------------------------------------------------


@pytest.mark.parametrize(("overlap", "catch_up", "busy", "expected"), [
    ("allow", "latest", False, Plan(T[3:4], T[3], 2)),
    ("allow", "latest", True, Plan(T[3:4], T[3], 2)),
    ("allow", "all", True, Plan(T[1:4], T[3])),
    ("skip", "latest", False, Plan(T[3:4], T[3], 2)),
    ("skip", "latest", True, Plan([], T[3], 3)),
    ("skip", "all", False, Plan(T[1:2], T[1])),
    ("skip", "all", True, Plan([], T[3], 3)),
    ("queue", "latest", False, Plan(T[3:4], T[3], 2)),
    ("queue", "latest", True, Plan()),
    ("queue", "all", False, Plan(T[1:2], T[1])),
    ("queue", "all", True, Plan()),
])
def test_the_plan_of_three_due_occurrences(overlap: str, catch_up: str, busy: bool,
                                           expected: Plan) -> None:
    assert plan(overlap, catch_up, T[1:4], busy) == expected
    assert plan(overlap, catch_up, [], busy) == Plan()


def test_due_is_bounded_and_knows_the_latest() -> None:
    every = parse("* * * * *")
    year_ago = START - timedelta(days=365)
    assert due(every, year_ago, START, "all") == [
        year_ago + timedelta(minutes=n) for n in range(1, MAX_PER_ROUND + 1)]
    assert due(every, year_ago, START, "latest") == [year_ago + timedelta(minutes=1), START]
    assert due(every, START, START + timedelta(seconds=59), "latest") == []
    assert due(every, None, START, "latest") == [START]  # the first round: this minute's


# -- Rounds against the database -----------------------------------------------------


def jobs_of(sql_conn: psycopg.Connection[Any], name: str) -> list[tuple[datetime, str]]:
    rows = sql_conn.execute("SELECT cron_slot, state FROM belay_jobs WHERE cron_name = %s "
                            "ORDER BY cron_slot", (name,)).fetchall()
    return [(r[0], r[1]) for r in rows]


def finish_all(sql_conn: psycopg.Connection[Any], name: str) -> None:
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded', finished_at = now() "
                     "WHERE cron_name = %s AND state NOT IN ('succeeded', 'failed', "
                     "'cancelled')", (name,))


def at(clock: ManualClock, minutes: float) -> datetime:
    clock.set(START + timedelta(minutes=minutes))
    return clock.now()


def test_skip_passes_over_occurrences_while_the_last_one_runs(
        client: belay.Belay, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    client.schedule("report", "* * * * *", "app.report")  # skip is the default
    scheduler = CronScheduler(client)
    scheduler.tick(at(clock, 0.5))
    assert jobs_of(sql_conn, "report") == [(T[0], "ready")]
    scheduler.tick(at(clock, 1.5))
    scheduler.tick(at(clock, 2.5))
    assert jobs_of(sql_conn, "report") == [(T[0], "ready")]  # T1, T2 skipped
    status = client.schedule_status("report")
    assert status is not None
    assert (status.last_due, status.next_due, status.active_job_id is not None) == \
        (T[2], T[3], True)
    finish_all(sql_conn, "report")
    scheduler.tick(at(clock, 3.5))
    assert jobs_of(sql_conn, "report") == [(T[0], "succeeded"), (T[3], "ready")]


def test_queue_holds_the_next_occurrence_until_the_last_one_ends(
        client: belay.Belay, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    client.schedule("sync", "* * * * *", "app.sync", overlap="queue", catch_up="all")
    scheduler = CronScheduler(client)
    scheduler.tick(at(clock, 0.5))
    for minute in (1.5, 2.5, 3.5):
        scheduler.tick(at(clock, minute))
    assert jobs_of(sql_conn, "sync") == [(T[0], "ready")]
    assert client.schedule_status("sync").next_due == T[1]  # waiting  # type: ignore[union-attr]
    # Each waiting occurrence runs in turn, oldest first, one at a time.
    for delivered in (1, 2, 3):
        finish_all(sql_conn, "sync")
        scheduler.tick(at(clock, 3.6))
        assert jobs_of(sql_conn, "sync")[-1] == (T[delivered], "ready")
    finish_all(sql_conn, "sync")
    scheduler.tick(at(clock, 3.7))
    assert [slot for slot, _ in jobs_of(sql_conn, "sync")] == T[0:4]


def test_queue_with_latest_coalesces_the_waiting_occurrences(
        client: belay.Belay, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    client.schedule("sync", "* * * * *", "app.sync", overlap="queue")
    scheduler = CronScheduler(client)
    scheduler.tick(at(clock, 0.5))
    scheduler.tick(at(clock, 3.5))
    finish_all(sql_conn, "sync")
    scheduler.tick(at(clock, 3.6))
    assert [slot for slot, _ in jobs_of(sql_conn, "sync")] == [T[0], T[3]]


def test_allow_all_fires_every_missed_occurrence_after_a_restart(
        client: belay.Belay, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    client.schedule("tick", "* * * * *", "app.tick", overlap="allow", catch_up="all")
    CronScheduler(client).tick(at(clock, 0.5))
    # Every node down for four minutes; a new scheduler (a restart) reads the cursor.
    CronScheduler(client).tick(at(clock, 4.5))
    assert [slot for slot, _ in jobs_of(sql_conn, "tick")] == T[0:5]


def test_each_occurrence_fires_once_across_racing_nodes(
        db_url: str, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    """Four nodes (a client each) tick at once, minute after minute: every
    occurrence of every policy is one job, and skip/queue never overlap."""
    clients = [belay.Belay(db_url, clock=clock, notify=False) for _ in range(4)]
    try:
        for overlap in ("allow", "skip", "queue"):
            clients[0].schedule(f"race-{overlap}", "* * * * *", "app.race", overlap=overlap,
                                catch_up="all")
        schedulers = [CronScheduler(c) for c in clients]
        for minute in range(6):
            now = START + timedelta(minutes=minute, seconds=30)
            barrier = threading.Barrier(len(schedulers))
            errors: list[BaseException] = []

            def node(scheduler: CronScheduler, now: datetime = now,
                     barrier: threading.Barrier = barrier,
                     errors: list[BaseException] = errors) -> None:
                try:
                    barrier.wait()
                    scheduler.tick(now)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=node, args=(s,)) for s in schedulers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert errors == []
            if minute == 2:
                finish_all(sql_conn, "race-skip")
                finish_all(sql_conn, "race-queue")
        assert [s for s, _ in jobs_of(sql_conn, "race-allow")] == T[0:6]
        # skip: T0 ran until after minute 2, T1 and T2 skipped; T3 fired, the rest skipped.
        assert [s for s, _ in jobs_of(sql_conn, "race-skip")] == [T[0], T[3]]
        # queue: T0 until minute 2, then T1 — the next waits for it.
        assert [s for s, _ in jobs_of(sql_conn, "race-queue")] == [T[0], T[1]]
    finally:
        for c in clients:
            c.close()


def test_redeclaring_cancelling_and_reading(client: belay.Belay, clock: ManualClock,
                                            sql_conn: psycopg.Connection[Any]) -> None:
    first = client.schedule("nightly", "0 3 * * *", "app.nightly", {"full": True}, queue="ops")
    assert (first.revision, first.overlap, first.catch_up, first.static) == \
        (1, "skip", "latest", False)
    assert first.next_due == datetime(2026, 3, 2, 3, 0, tzinfo=timezone.utc)
    assert client.schedule("nightly", "0 3 * * *", "app.nightly", {"full": True},
                           queue="ops").revision == 1  # the same: nothing changes
    changed = client.schedule("nightly", "0 4 * * *", "app.nightly", overlap="queue")
    assert (changed.revision, changed.expression, changed.overlap) == (2, "0 4 * * *", "queue")
    assert client.cancel_schedule("nightly") is True
    assert client.cancel_schedule("nightly") is False
    cancelled = client.schedule_status("nightly")
    assert cancelled is not None and cancelled.cancelled_at is not None
    assert cancelled.next_due is None
    CronScheduler(client).tick(at(clock, 60 * 16 + 0.5))  # 04:00 passes: nothing fires
    assert jobs_of(sql_conn, "nightly") == []
    revived = client.schedule("nightly", "0 4 * * *", "app.nightly", overlap="queue")
    assert (revived.cancelled_at, revived.revision) == (None, 3)
    assert client.schedule_status("missing") is None
    assert revived.to_dict()["next_due"].startswith("2026-03-02T04:00")


def test_pages_of_schedules(client: belay.Belay) -> None:
    for n in range(5):
        client.schedule(f"s{n}", "@hourly", "app.s")
    page = client.schedule_page(2)
    assert [s.name for s in page.schedules] == ["s0", "s1"] and page.next_cursor == "s1"
    last = client.schedule_page(2, "s3")
    assert [s.name for s in last.schedules] == ["s4"] and last.next_cursor is None
    assert [s.name for s in client.schedules()] == [f"s{n}" for n in range(5)]
    with pytest.raises(ValidationError, match="limit is a whole number from 1 to 100"):
        client.schedule_page(0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"overlap": "sometimes"}, "overlap is one of skip, queue, allow"),
    ({"catch_up": 600}, 'catch_up is "latest" or "all"'),
    ({"expression": "0 0 8 * * 1-5"}, "has 6 fields"),
    ({"unique": "x"}, "unique= is not a cron option"),
    ({"delay": 5}, "due at its slot"),
    ({"input": [1]}, "input is a JSON object"),
    ({"name": ""}, "needs a name"),
])
def test_declarations_are_checked(client: belay.Belay, kwargs: dict[str, Any],
                                  message: str) -> None:
    args = {"name": "bad", "expression": "@daily", "worker": "app.x", **kwargs}
    with pytest.raises(ValidationError, match=message):
        client.schedule(args.pop("name"), args.pop("expression"), args.pop("worker"),
                        args.pop("input", None), **args)
    assert client.schedules() == []


def test_a_name_is_a_cron_or_a_schedule(client: belay.Belay) -> None:
    client.put_cron("digest", "@daily", "app.digest")
    with pytest.raises(ValidationError, match="is the name of a cron"):
        client.schedule("digest", "@daily", "app.digest")
    client.schedule("report", "@daily", "app.report")
    with pytest.raises(ValidationError, match="is the name of a schedule"):
        client.put_cron("report", "@daily", "app.report")


def test_static_schedules_on_the_worker(client: belay.Belay, clock: ManualClock,
                                        sql_conn: psycopg.Connection[Any]) -> None:
    crons = [{"name": "heavy", "expression": "* * * * *", "worker": "app.heavy",
              "overlap": "queue", "queue": "batch"},
             {"name": "plain", "expression": "* * * * *", "worker": "app.plain"}]
    scheduler = CronScheduler(client, crons)
    assert [e.name for e in scheduler.entries] == ["plain"]
    assert [s.name for s in scheduler.schedules] == ["heavy"]
    scheduler.tick(at(clock, 0.5))
    status = client.schedule_status("heavy")
    assert status is not None and status.static and status.overlap == "queue"
    assert jobs_of(sql_conn, "heavy") == [(T[0], "ready")]
    queue = sql_conn.execute("SELECT queue FROM belay_jobs WHERE cron_name = 'heavy'"
                             ).fetchone()
    assert queue == ("batch",)
    # An operator's cancel outlives a restart that declares it again from code.
    client.cancel_schedule("heavy")
    CronScheduler(client, crons).tick(at(clock, 1.5))
    assert client.schedule_status("heavy").cancelled_at is not None  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="overlap is one of"):
        CronScheduler(client, [{"name": "x", "expression": "@daily", "worker": "a.b",
                                "overlap": "never"}])
    with pytest.raises(ConfigurationError, match="unknown key 'paused'"):
        CronScheduler(client, [{"name": "x", "expression": "@daily", "worker": "a.b",
                                "overlap": "skip", "paused": True}])


def test_a_broken_schedule_does_not_hold_back_the_others(
        client: belay.Belay, clock: ManualClock, sql_conn: psycopg.Connection[Any]) -> None:
    client.schedule("good", "* * * * *", "app.good")
    client.schedule("broken", "* * * * *", "app.broken")
    sql_conn.execute("UPDATE belay_schedules SET opts = '{\"priority\": \"high\"}' "
                     "WHERE name = 'broken'")
    scheduler = CronScheduler(client)
    scheduler.tick(at(clock, 0.5))
    assert jobs_of(sql_conn, "good") == [(T[0], "ready")]
    assert jobs_of(sql_conn, "broken") == []
    broken = client.schedule_status("broken")
    assert broken is not None and (broken.last_due, broken.next_due) == (None, T[0])  # unmoved
