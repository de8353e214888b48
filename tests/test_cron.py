"""Cron (contract §8.5, §11.6): expressions and slot arithmetic (pure, with hypothesis),
the missed-slot policy on a ManualClock, dynamic crons through the client, the merge of
``belay_crons`` rows over static entries, and exactly-once firing across three nodes —
threads with a client each, then three OS processes (``tests/cron_node.py``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

import belay
from belay.cron import (
    LOOKBACK,
    MINUTE,
    CronEntry,
    CronScheduler,
    DynamicCron,
    due_slots,
    entries_from_config,
    latest_slot,
    parse,
    slot,
    slots_to_fire,
)
from tests import cron_node
from tests.helpers import START

Conn = psycopg.Connection[Any]
REPO = Path(__file__).resolve().parent.parent
UTC = timezone.utc
KIND = "test.cron"
EXAMPLE = "0 8 * * 1-5"


def at(hour: int, minute: int, second: int = 0, day: int = 1) -> datetime:
    """A time on the clock fixture's day (2026-03-01, a Sunday) unless told otherwise."""
    return datetime(2026, 3, day, hour, minute, second, tzinfo=UTC)


def fired(conn: Conn) -> list[tuple[str, datetime]]:
    """Every (cron_name, cron_slot) in belay_jobs, in order, duplicates kept."""
    rows = conn.execute(
        "SELECT cron_name, cron_slot FROM belay_jobs WHERE cron_name IS NOT NULL "
        "ORDER BY cron_name, cron_slot, id"
    ).fetchall()
    return [(name, when) for name, when in rows]


def slots_of(jobs: list[belay.Job]) -> list[datetime]:
    return [job.cron_slot for job in jobs if job.cron_slot is not None]


def every5(**extra: Any) -> dict[str, Any]:
    return {"name": "every5", "expression": "*/5 * * * *", "worker": KIND, **extra}


# -- Expressions ------------------------------------------------------------------------


@pytest.mark.parametrize("expression", [
    "* * * * *", "0 8 * * 1-5", "*/15 9-17 * * mon-fri", "0 0 1,15 * *", "5 4 * jan,jul 0",
    "0 0 * * 7", "  30   6 * * *  ", "@hourly", "@daily", "@weekly", "@monthly", "@yearly",
    "@midnight", "@annually", "0 0 29 2 *",
])
def test_parse_accepts_standard_five_field_expressions_and_aliases(expression: str) -> None:
    expr = parse(expression)
    assert expr.source == " ".join(expression.split())
    assert len(expr.spec.split(" ")) == 5
    assert parse(expr) is expr


@pytest.mark.parametrize(("expression", "says"), [
    ("* * * * * *", "has 6 fields"),
    ("0 0 8 * * 1-5 2026", "has 7 fields"),
    ("0 8 * *", "has 4 field(s), expected five"),
    ("", "empty"),
    ("   ", "empty"),
    ("every morning at 8", "has 4 field(s)"),
    ("a b c d e", "not standard cron"),
    ("0 0 L * *", "day-of-month field 'L' is not standard cron"),
    ("0 0 * * 5#3", "day-of-week field '5#3' is not standard cron"),
    ("0 0 ? * *", "not standard cron"),
    ("H * * * *", "not standard cron"),
    ("mon * * * *", "allowed only in the month and day-of-week fields, not minute"),
    ("60 * * * *", "out of range"),
    ("0 24 * * *", "out of range"),
    ("*/0 * * * *", "invalid cron expression"),
    ("* * 30 2 *", "never matches a real date"),
    ("@reboot", "unknown cron alias '@reboot'"),
])
def test_parse_refuses_with_what_is_wrong_and_a_valid_example(expression: str, says: str) -> None:
    with pytest.raises(belay.ValidationError) as caught:
        parse(expression)
    assert says in str(caught.value)
    assert EXAMPLE in str(caught.value)


def test_parse_refuses_a_non_string() -> None:
    with pytest.raises(belay.ValidationError, match="a cron expression is a string like"):
        parse(5)  # type: ignore[arg-type]


def test_aliases_and_day_fields_match_as_cron_does() -> None:
    assert parse("@hourly").matches(at(13, 0)) and not parse("@hourly").matches(at(13, 1))
    assert parse("@yearly").matches(datetime(2027, 1, 1, tzinfo=UTC))
    assert not parse("@yearly").matches(datetime(2027, 2, 1, tzinfo=UTC))
    assert parse("@weekly").matches(at(0, 0))  # 2026-03-01 is a Sunday
    # Both day fields restricted: either may match (cron(5)).
    expr = parse("0 0 13 * 5")
    assert expr.matches(datetime(2026, 3, 13, tzinfo=UTC))  # the 13th (a Friday)
    assert expr.matches(datetime(2026, 3, 6, tzinfo=UTC))  # a Friday
    assert expr.matches(datetime(2026, 5, 13, tzinfo=UTC))  # the 13th (a Wednesday)
    assert not expr.matches(datetime(2026, 3, 5, tzinfo=UTC))


def test_matches_reads_the_minute_in_utc() -> None:
    expr = parse("30 8 * * *")
    plus2 = timezone(timedelta(hours=2))
    assert expr.matches(datetime(2026, 3, 1, 10, 30, 59, 999_999, tzinfo=plus2))
    assert not expr.matches(datetime(2026, 3, 1, 8, 30, tzinfo=plus2))


# -- Slots (pure, property-tested) --------------------------------------------------------

instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2090, 12, 31),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)),
                               timezone(timedelta(hours=-8))]),
)
EXPRESSIONS = ["* * * * *", "*/7 * * * *", "0,30 * * * *", "15 */3 * * *", "0 9-17 * * 1-5",
               "59 23 * * *", "*/5 8 1 * *", "0 0 * * 0", "1-59/2 * * * *"]
expressions = st.sampled_from(EXPRESSIONS).map(parse)


@given(instants)
def test_slot_is_the_utc_minute_holding_now(now: datetime) -> None:
    start = slot(now)
    assert start.tzinfo is UTC and start.second == 0 and start.microsecond == 0
    assert start <= now < start + MINUTE
    assert slot(start) == start


def test_slot_refuses_a_naive_datetime() -> None:
    with pytest.raises(belay.ValidationError, match="timezone-aware"):
        slot(datetime(2026, 3, 1, 12, 0))


@settings(max_examples=60, deadline=None)
@given(expressions, instants, st.integers(min_value=0, max_value=6 * 60 * 60 * 1_000_000))
def test_due_slots_are_exactly_the_matching_minutes_in_the_half_open_range(
    expr: Any, after: datetime, span: int
) -> None:
    until = after + timedelta(microseconds=span)
    found = due_slots(expr, after, until)
    brute: list[datetime] = []
    candidate = slot(after)
    while candidate <= until:
        if candidate > after and expr.matches(candidate):
            brute.append(candidate)
        candidate += MINUTE
    assert found == brute
    assert all(s.tzinfo is UTC and s.second == 0 and s.microsecond == 0 for s in found)


@settings(max_examples=60, deadline=None)
@given(expressions, instants)
def test_latest_slot_is_the_last_due_slot_up_to_until(expr: Any, until: datetime) -> None:
    latest = latest_slot(expr, until)
    assert latest <= until and expr.matches(latest)
    assert due_slots(expr, latest, until) == []


@settings(max_examples=80, deadline=None)
@given(expressions, instants,
       st.lists(st.integers(min_value=1, max_value=int(LOOKBACK.total_seconds())),
                min_size=1, max_size=30))
def test_a_running_scheduler_fires_every_slot_once_whatever_its_tick_gaps(
    expr: Any, first: datetime, gaps: list[int]
) -> None:
    """Ticks up to LOOKBACK apart: every matching slot from the first tick's minute to
    the last tick's fires, each exactly once."""
    now, previous = first, None
    seen: list[datetime] = []
    for gap in [0, *gaps]:
        now += timedelta(seconds=gap)
        seen += slots_to_fire(expr, now, previous)
        previous = slot(now)
    assert seen == due_slots(expr, slot(first) - MINUTE, slot(now))


@settings(max_examples=80, deadline=None)
@given(expressions, instants, st.lists(st.integers(min_value=1, max_value=6 * 3600),
                                       min_size=1, max_size=10))
def test_after_a_long_gap_only_the_lookback_window_fires(
    expr: Any, first: datetime, gaps: list[int]
) -> None:
    previous = slot(first)
    now = first
    for gap in gaps:
        now += timedelta(seconds=gap)
        fired_now = slots_to_fire(expr, now, previous)
        window_start = max(previous, slot(now) - LOOKBACK)
        assert fired_now == due_slots(expr, window_start, slot(now))
        previous = slot(now)


def test_first_tick_fires_only_the_current_minute_unless_catch_up() -> None:
    expr = parse("*/5 * * * *")
    assert slots_to_fire(expr, at(12, 17, 30), None) == []
    assert slots_to_fire(expr, at(12, 15, 59), None) == [at(12, 15)]
    # catch_up: the one most recent missed slot within the window, not every one.
    assert slots_to_fire(expr, at(12, 17, 30), None, catch_up=3600) == [at(12, 15)]
    assert slots_to_fire(expr, at(12, 15, 30), None, catch_up=3600) == [at(12, 10), at(12, 15)]
    assert slots_to_fire(expr, at(12, 17, 30), None, catch_up=150) == [at(12, 15)]
    assert slots_to_fire(expr, at(12, 17, 30), None, catch_up=149) == []


def test_catch_up_on_a_running_scheduler_reaches_only_past_its_lookback() -> None:
    expr = parse("0 * * * *")
    # Suspended from 12:00 to 15:30: the lookback (15:20, 15:30] has no slot; the most
    # recent missed one, 15:00, is within catch_up.
    assert slots_to_fire(expr, at(15, 30), at(12, 0)) == []
    assert slots_to_fire(expr, at(15, 30), at(12, 0), catch_up=3600) == [at(15, 0)]
    # Nothing missed beyond the lookback: nothing extra.
    assert slots_to_fire(expr, at(15, 5), at(14, 58), catch_up=3600) == [at(15, 0)]


# -- Entries (static config) --------------------------------------------------------------


def test_entries_from_config_validates_and_keeps_options() -> None:
    reg = belay.Registry()

    @belay.worker(name="cron.digest", queue="mail", registry=reg)
    def digest(ctx: belay.Context) -> None:
        return None

    (entry, other) = entries_from_config([
        {"name": "digest", "expression": EXAMPLE, "worker": digest, "input": {"edition": 1},
         "queue": "q", "priority": 3, "max_attempts": 2, "meta": {"m": 1},
         "budget": {"usd": 1}, "partition_key": "p", "catch_up": 600},
        CronEntry("other", parse("@hourly"), "some.kind"),
    ])
    assert entry.name == "digest" and entry.kind == "cron.digest"
    assert entry.expression == parse(EXAMPLE)
    assert entry.input == {"edition": 1} and entry.catch_up == 600.0
    assert entry.options == {"queue": "q", "priority": 3, "max_attempts": 2, "meta": {"m": 1},
                             "budget": {"usd": 1}, "partition_key": "p"}
    assert other.kind == "some.kind" and other.options == {} and not other.paused


@pytest.mark.parametrize(("item", "says"), [
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "queu": "x"},
     "cron 'd': unknown key 'queu'"),
    ({"name": "d", "expression": "0 8 * * * *", "worker": KIND}, "cron 'd': cron expression"),
    ({"name": "d", "expression": EXAMPLE}, "cron 'd' is missing worker"),
    ({"expression": EXAMPLE, "worker": KIND}, "cron #0 is missing name"),
    ({"name": "", "expression": EXAMPLE, "worker": KIND}, "a cron needs a name"),
    ({"name": "d", "expression": EXAMPLE, "worker": 5}, "cron 'd': kind must be"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "catch_up": 86_401},
     "from 0 to 86400"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "catch_up": -1}, "from 0 to 86400"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "unique": "k"},
     "deduplicated by its slot"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "delay": 5}, "due at its slot"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "priority": "high"},
     "cron 'd': priority must be an integer"),
    ({"name": "d", "expression": EXAMPLE, "worker": KIND, "input": [1]},
     "cron 'd': input must be a dict"),
])
def test_entries_from_config_refuses_with_the_entry_named(item: dict[str, Any], says: str) -> None:
    with pytest.raises(belay.ConfigurationError) as caught:
        entries_from_config([item])
    assert says in str(caught.value)


def test_entries_from_config_refuses_duplicate_names_and_non_lists() -> None:
    item = {"name": "d", "expression": EXAMPLE, "worker": KIND}
    with pytest.raises(belay.ConfigurationError, match="cron name 'd' is used twice"):
        entries_from_config([item, dict(item)])
    with pytest.raises(belay.ConfigurationError, match="takes a list of cron dicts"):
        entries_from_config(item)  # type: ignore[arg-type]


def test_catch_up_takes_a_timedelta_up_to_a_day() -> None:
    entry = CronEntry("d", parse(EXAMPLE), KIND, catch_up=timedelta(hours=24))  # type: ignore[arg-type]
    assert entry.catch_up == 86_400.0


def test_without_croniter_import_works_and_cron_says_how_to_install_it() -> None:
    code = (
        "import sys\n"
        "import belay, belay.cron\n"
        "assert 'croniter' not in sys.modules, 'croniter imported eagerly'\n"
        "sys.modules['croniter'] = None\n"
        "try:\n"
        "    belay.cron.parse('* * * * *')\n"
        "except belay.ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60)
    assert "pip install 'belay[cron]'" in out.stdout


def test_a_node_without_croniter_still_ticks_and_says_what_to_install(
    client: belay.Belay, clock: belay.ManualClock, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client.put_cron("r", "* * * * *", KIND)
    monkeypatch.setitem(sys.modules, "croniter", None)  # the import now fails
    with pytest.raises(belay.ConfigurationError, match=r"pip install 'belay\[cron\]'"):
        CronScheduler(client, [every5()])
    scheduler = CronScheduler(client)  # no static crons: a Worker without the extra runs
    with caplog.at_level(logging.WARNING, logger="belay.cron"):
        assert scheduler.tick() == []
    assert any("'r'" in r.getMessage() and "pip install 'belay[cron]'" in r.getMessage()
               for r in caplog.records)


# -- The missed-slot policy, end to end on a ManualClock ------------------------------------


def test_a_late_tick_fires_the_slot_it_skipped(client: belay.Belay, clock: belay.ManualClock,
                                               sql_conn: Conn) -> None:
    scheduler = CronScheduler(client, [every5()])
    clock.set(at(12, 0, 10))
    assert slots_of(scheduler.tick()) == [at(12, 0)]
    clock.set(at(12, 4, 50))
    assert scheduler.tick() == []
    clock.set(at(12, 11, 5))  # the tick that should have seen 12:05 came late
    jobs = scheduler.tick()
    assert slots_of(jobs) == [at(12, 5), at(12, 10)]
    assert {(j.kind, j.cron_name, j.state, j.ready_at) for j in jobs} == {
        (KIND, "every5", "ready", at(12, 11, 5))}
    assert fired(sql_conn) == [("every5", at(12, 0)), ("every5", at(12, 5)),
                               ("every5", at(12, 10))]


def test_a_first_tick_after_downtime_skips_missed_slots(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    clock.set(at(12, 0, 10))
    CronScheduler(client, [every5()]).tick()
    # The node dies; another starts at 12:17:30.
    restarted = CronScheduler(client, [every5()])
    clock.set(at(12, 17, 30))
    assert restarted.tick() == []
    clock.set(at(12, 20, 1))
    assert slots_of(restarted.tick()) == [at(12, 20)]
    assert fired(sql_conn) == [("every5", at(12, 0)), ("every5", at(12, 20))]


def test_catch_up_fires_the_latest_missed_slot_once_cluster_wide(
    client: belay.Belay, db_url: str, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    entry = every5(catch_up=600)
    clock.set(at(12, 0, 10))
    assert slots_of(CronScheduler(client, [entry]).tick()) == [at(11, 55), at(12, 0)]
    clock.set(at(12, 17, 30))  # a restart: 12:05 and 12:10 stay missed
    assert slots_of(CronScheduler(client, [entry]).tick()) == [at(12, 15)]
    # A second node starting a little later finds the slot taken.
    with belay.Belay(db_url, clock=clock) as node_b:
        clock.set(at(12, 19, 0))
        assert CronScheduler(node_b, [entry]).tick() == []
    # At 12:35:30 the current minute's slot fires, and the most recent missed one,
    # 12:30 (12:20 and 12:25 are missed too, but only one catches up).
    clock.set(at(12, 35, 30))
    assert slots_of(CronScheduler(client, [entry]).tick()) == [at(12, 30), at(12, 35)]
    assert fired(sql_conn) == [("every5", at(11, 55)), ("every5", at(12, 0)),
                               ("every5", at(12, 15)), ("every5", at(12, 30)),
                               ("every5", at(12, 35))]


def test_catch_up_leaves_slots_older_than_its_window(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    entry = {"name": "morning", "expression": "0 8 * * *", "worker": KIND, "catch_up": 3600}
    clock.set(at(9, 30))
    assert CronScheduler(client, [entry]).tick() == []
    clock.set(at(8, 40, day=2))
    assert slots_of(CronScheduler(client, [entry]).tick()) == [at(8, 0, day=2)]
    assert fired(sql_conn) == [("morning", at(8, 0, day=2))]


def test_a_running_scheduler_looks_back_at_most_ten_minutes(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    scheduler = CronScheduler(client, [{"name": "m", "expression": "* * * * *", "worker": KIND}])
    clock.set(at(12, 0, 10))
    scheduler.tick()
    clock.set(at(13, 0, 30))  # woke from an hour's suspend
    assert slots_of(scheduler.tick()) == [at(12, 51) + MINUTE * i for i in range(10)]
    assert len(fired(sql_conn)) == 11


def test_a_failed_tick_is_made_up_by_the_next(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    scheduler = CronScheduler(client, [every5()])
    clock.set(at(12, 0, 10))
    scheduler.tick()
    sql_conn.execute("ALTER TABLE belay_crons RENAME TO belay_crons_away")
    clock.set(at(12, 5, 10))
    with pytest.raises(psycopg.errors.UndefinedTable):
        scheduler.tick()
    sql_conn.execute("ALTER TABLE belay_crons_away RENAME TO belay_crons")
    clock.set(at(12, 6, 0))
    assert slots_of(scheduler.tick()) == [at(12, 5)]


# -- Dynamic crons through the client ------------------------------------------------------


def test_put_list_pause_resume_delete_round_trip(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    stored = client.put_cron("digest", " 0 8  * * 1-5", "app.digest", {"edition": "am"},
                             queue="mail", priority=2, meta={"team": "growth"})
    assert stored == DynamicCron("digest", "0 8 * * 1-5", "app.digest", {"edition": "am"},
                                 {"queue": "mail", "priority": 2, "meta": {"team": "growth"}},
                                 False, START)
    assert client.list_crons() == [stored]
    row = sql_conn.execute(
        "SELECT worker, input, opts, paused FROM belay_crons WHERE name = 'digest'"
    ).fetchone()
    assert row == ("app.digest", {"edition": "am"},
                   {"queue": "mail", "priority": 2, "meta": {"team": "growth"}}, False)

    assert client.pause_cron("digest") is True
    clock.advance(60)
    again = client.put_cron("digest", "@daily", "app.digest")  # replaced, still paused
    assert (again.expression, again.options, again.input, again.paused, again.updated_at) == (
        "@daily", {}, {}, True, START + timedelta(seconds=60))
    assert client.resume_cron("digest") is True
    assert [c.paused for c in client.list_crons()] == [False]
    assert client.delete_cron("digest") is True
    assert client.list_crons() == []
    for call in (client.delete_cron, client.pause_cron, client.resume_cron):
        assert call("digest") is False


def test_put_cron_stores_a_worker_definition_as_its_kind(client: belay.Belay) -> None:
    reg = belay.Registry()

    @belay.worker(name="cron.report", queue="reports", registry=reg)
    def report(ctx: belay.Context) -> None:
        return None

    assert client.put_cron("r", "@hourly", report).worker == "cron.report"


@pytest.mark.parametrize(("args", "options", "says"), [
    (("d", "0 8 * * * *", KIND), {}, "has 6 fields"),
    (("d", EXAMPLE, KIND), {"budget": {"usd": 1}},
     "budget= cannot be stored in a belay_crons row"),
    (("d", EXAMPLE, KIND), {"catch_up": 60}, "give it to a static cron on the Worker"),
    (("d", EXAMPLE, KIND), {"encrypt": True}, "cannot be stored"),
    (("d", EXAMPLE, KIND), {"unique": "k"}, "deduplicated by its slot"),
    (("d", EXAMPLE, KIND), {"run_at": START}, "due at its slot"),
    (("d", EXAMPLE, KIND), {"queu": "x"}, "unknown option 'queu'"),
    (("d", EXAMPLE, KIND), {"priority": 1.5}, "priority must be an integer"),
    (("d", EXAMPLE, KIND), {"meta": {"at": START}}, "meta"),
    (("", EXAMPLE, KIND), {}, "a cron needs a name"),
    (("d", EXAMPLE, 42), {}, "kind must be"),
])
def test_put_cron_validates_before_writing(
    client: belay.Belay, sql_conn: Conn, args: tuple[Any, ...], options: dict[str, Any],
    says: str
) -> None:
    with pytest.raises(belay.ValidationError) as caught:
        client.put_cron(*args, **options)
    assert says in str(caught.value)
    assert sql_conn.execute("SELECT count(*) FROM belay_crons").fetchone() == (0,)


def test_module_level_cron_functions_use_the_default_instance(
    db_url: str, restore_default: None
) -> None:
    belay.configure(db_url)
    belay.put_cron("nightly", "0 3 * * *", KIND, queue="night")
    assert belay.pause_cron("nightly") and belay.resume_cron("nightly")
    assert [(c.name, c.options) for c in belay.list_crons()] == [("nightly", {"queue": "night"})]
    assert belay.delete_cron("nightly") and belay.list_crons() == []


# -- Merging rows over static entries -------------------------------------------------------


def test_a_row_overrides_the_static_entry_of_its_name_and_a_paused_row_silences_it(
    client: belay.Belay, clock: belay.ManualClock
) -> None:
    scheduler = CronScheduler(client, [every5(queue="static")])
    clock.set(at(12, 0, 5))
    assert [(j.queue, j.cron_slot) for j in scheduler.tick()] == [("static", at(12, 0))]

    client.put_cron("every5", "* * * * *", "row.kind", {"from": "row"}, queue="dynamic")
    clock.set(at(12, 1, 5))
    [job] = scheduler.tick()
    assert (job.kind, job.queue, job.input, job.cron_slot) == (
        "row.kind", "dynamic", {"from": "row"}, at(12, 1))

    client.pause_cron("every5")
    clock.set(at(12, 5, 5))  # the static entry would fire here
    assert scheduler.tick() == []
    client.resume_cron("every5")
    clock.set(at(12, 6, 5))
    assert [j.queue for j in scheduler.tick()] == ["dynamic"]

    client.delete_cron("every5")
    clock.set(at(12, 10, 5))
    assert [(j.queue, j.cron_slot) for j in scheduler.tick()] == [("static", at(12, 10))]


def test_a_paused_static_entry_does_not_fire(client: belay.Belay, clock: belay.ManualClock) -> None:
    scheduler = CronScheduler(client, [every5(paused=True)])
    clock.set(at(12, 0, 5))
    assert scheduler.tick() == []


def test_an_unusable_row_is_skipped_with_one_warning_and_the_tick_goes_on(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = CronScheduler(client, [every5(queue="static")])
    for name, expression, opts in [("every5", "every five minutes", {}),
                                   ("later", "* * * * *", {"schedule_in": 30})]:
        sql_conn.execute(
            "INSERT INTO belay_crons (name, expression, worker, input, opts) "
            "VALUES (%s, %s, %s, '{}', %s)", (name, expression, KIND, Jsonb(opts)))
    client.put_cron("good", "* * * * *", KIND)
    caplog.set_level(logging.WARNING, logger="belay.cron")
    clock.set(at(12, 0, 5))
    # The bad every5 row does not silence the static entry; the good row fires.
    assert sorted((j.cron_name, j.queue) for j in scheduler.tick()) == [
        ("every5", "static"), ("good", "default")]
    clock.set(at(12, 1, 5))
    assert [j.cron_name for j in scheduler.tick()] == ["good"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one per row, not one per tick
    assert any("'every5'" in w and "every five minutes" in w for w in warnings)
    assert any("'later'" in w and "unknown option 'schedule_in'" in w for w in warnings)


def test_an_entry_that_cannot_build_its_job_is_skipped_with_a_warning(
    client: belay.Belay, clock: belay.ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    # encrypt=True without an encryption key: refused at insert time, not at config time.
    scheduler = CronScheduler(client, [every5(encrypt=True), {
        "name": "fine", "expression": "* * * * *", "worker": KIND}])
    clock.set(at(12, 0, 5))
    with caplog.at_level(logging.WARNING, logger="belay.cron"):
        assert [j.cron_name for j in scheduler.tick()] == ["fine"]
    assert any("'every5'" in r.getMessage() for r in caplog.records)


def test_a_row_the_reference_wrote_is_honoured(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    # As Belay.Crons.put writes it: worker = the kind, opts = enqueue options.
    sql_conn.execute(
        "INSERT INTO belay_crons (name, expression, worker, input, opts, paused, updated_at) "
        "VALUES ('ref.digest', '*/5 * * * *', 'MyApp.Digest', %s, %s, false, %s)",
        (Jsonb({"edition": "morning"}), Jsonb({"queue": "x", "max_attempts": 3}), START))
    [listed] = client.list_crons()
    assert (listed.worker, listed.options) == ("MyApp.Digest", {"queue": "x", "max_attempts": 3})
    clock.set(at(12, 0, 30))
    [job] = CronScheduler(client).tick()
    assert (job.kind, job.queue, job.input, job.max_attempts, job.cron_name, job.cron_slot) == (
        "MyApp.Digest", "x", {"edition": "morning"}, 3, "ref.digest", at(12, 0))


def test_a_kind_named_by_string_takes_its_registered_workers_defaults(
    client: belay.Belay, clock: belay.ManualClock
) -> None:
    reg = belay.Registry()

    @belay.worker(name="cron.mailer", queue="mailers", max_attempts=4, registry=reg)
    def mailer(ctx: belay.Context) -> None:
        return None

    scheduler = CronScheduler(client, [
        {"name": "by-name", "expression": "* * * * *", "worker": "cron.mailer"},
        {"name": "by-def", "expression": "* * * * *", "worker": mailer, "queue": "other"},
    ], registry=reg)
    clock.set(at(12, 0, 5))
    jobs = {j.cron_name: j for j in scheduler.tick()}
    assert (jobs["by-name"].queue, jobs["by-name"].max_attempts) == ("mailers", 4)
    assert (jobs["by-def"].queue, jobs["by-def"].max_attempts) == ("other", 4)


def test_a_workers_own_unique_rule_still_applies_to_its_cron_jobs(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    reg = belay.Registry()

    @belay.worker(name="cron.single", unique="single-run", registry=reg)
    def single(ctx: belay.Context) -> None:
        return None

    scheduler = CronScheduler(client, [every5(worker=single)])
    clock.set(at(12, 0, 5))
    assert slots_of(scheduler.tick()) == [at(12, 0)]
    clock.set(at(12, 5, 5))  # the 12:00 job is still ready: this slot is skipped
    assert scheduler.tick() == []
    assert fired(sql_conn) == [("every5", at(12, 0))]


def test_notify_pokes_the_queues_of_inserted_jobs(
    db_url: str, clock: belay.ManualClock, notes: Any
) -> None:
    with belay.Belay(db_url, clock=clock, notify=False) as quiet_client:
        entries = [every5(queue="a"), {"name": "b", "expression": "* * * * *",
                                       "worker": KIND, "queue": "b"}]
        clock.set(at(12, 0, 5))
        CronScheduler(quiet_client, entries, notify=False).tick()
        assert notes.received() == []
        clock.set(at(12, 5, 5))
        CronScheduler(quiet_client, entries, notify=True).tick()
        assert sorted(n["q"] for n in notes.received()) == ["a", "b"]


# -- The thread ---------------------------------------------------------------------------


def cron_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "belay-cron"]


def test_start_and_stop_are_idempotent_and_the_thread_survives_a_failing_tick(
    client: belay.Belay, clock: belay.ManualClock, sql_conn: Conn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = CronScheduler(client, [every5()], interval=0.01)
    clock.set(at(12, 0, 5))
    sql_conn.execute("ALTER TABLE belay_crons RENAME TO belay_crons_away")
    with caplog.at_level(logging.ERROR, logger="belay.cron"):
        scheduler.start()
        scheduler.start()
        assert len(cron_threads()) == 1 and scheduler.running
        assert scheduler.ticked.wait(10)
        sql_conn.execute("ALTER TABLE belay_crons_away RENAME TO belay_crons")
        for _ in range(500):  # bounded: each wait returns after one more tick
            if fired(sql_conn):
                break
            scheduler.ticked.clear()
            assert scheduler.ticked.wait(10)
        scheduler.stop()
        scheduler.stop()
    assert cron_threads() == [] and not scheduler.running
    assert fired(sql_conn) == [("every5", at(12, 0))]
    assert any("cron tick failed" in r.getMessage() for r in caplog.records)
    # Restartable after a stop.
    scheduler.start()
    scheduler.stop()
    assert cron_threads() == []


def test_bad_scheduler_settings_are_refused(client: belay.Belay) -> None:
    for interval in (0, -1, True, "20"):
        with pytest.raises(belay.ConfigurationError, match="cron interval"):
            CronScheduler(client, [], interval=interval)  # type: ignore[arg-type]


# -- Exactly once across nodes (§11.6) ------------------------------------------------------

RACE_ENTRIES = [
    {"name": "race.every", "expression": "* * * * *", "worker": KIND},
    {"name": "race.even", "expression": "*/2 * * * *", "worker": KIND},
    {"name": "race.seven", "expression": "*/7 * * * *", "worker": KIND, "queue": "q7"},
    {"name": "race.odd", "expression": "1-59/2 * * * *", "worker": KIND},
]


def expected_slots(entries: list[dict[str, Any]], first: datetime, last: datetime
                   ) -> list[tuple[str, datetime]]:
    return sorted((e["name"], s) for e in entries
                  for s in due_slots(parse(e["expression"]), slot(first) - MINUTE, slot(last)))


def test_three_nodes_on_threads_insert_every_slot_exactly_once(
    db_url: str, clock: belay.ManualClock, sql_conn: Conn
) -> None:
    rounds = 60
    rng = random.Random(20260301)
    steps = iter([rng.choice([10, 30, 59, 60, 61, 125, 290]) for _ in range(rounds)])
    times: list[datetime] = []

    def advance() -> None:  # runs while all three nodes wait at the barrier
        times.append(clock.advance(next(steps)))

    barrier = threading.Barrier(3, action=advance, timeout=30)
    clients = [belay.Belay(db_url, clock=clock, notify=False) for _ in range(3)]
    schedulers = [CronScheduler(c, RACE_ENTRIES) for c in clients]
    inserted: list[list[belay.Job]] = [[] for _ in schedulers]
    errors: list[BaseException] = []

    def node(index: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait()
                inserted[index] += schedulers[index].tick()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for c in clients:
            c.close()
    assert errors == []
    rows = fired(sql_conn)
    assert rows == expected_slots(RACE_ENTRIES, times[0], times[-1])
    mine = [(j.cron_name, j.cron_slot) for jobs in inserted for j in jobs]
    assert Counter(mine) == Counter(rows)  # every insert reported by exactly one node


def test_three_node_processes_insert_every_slot_exactly_once(
    db_url: str, direct_url: str, sql_conn: Conn
) -> None:
    """Three OS processes, each with its own client, tick in lock-step rounds (a
    LISTEN/NOTIFY barrier in tests/cron_node.py) at the same clock instants."""
    ticks, step, nodes = 40, 50.0, 3
    sql_conn.execute(cron_node.GATE_TABLE)
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.cron_node", db_url, START.isoformat(), str(step),
             str(ticks), str(node), str(nodes), direct_url],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(nodes)
    ]
    try:
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes] == [0] * nodes, [err for _, err in outputs]
    last = START + timedelta(seconds=step * (ticks - 1))
    rows = fired(sql_conn)
    assert rows == expected_slots(cron_node.ENTRIES, START, last)
    reported = [(name, datetime.fromisoformat(when))
                for out, _ in outputs for name, when in json.loads(out)]
    assert Counter(reported) == Counter(rows)
