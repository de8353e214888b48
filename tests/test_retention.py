"""Retention (contract §8.7): ``Worker(retention=…, signal_ttl=…)`` and ``Worker.prune()``.

Sweepers delete terminal jobs older than their state's retention together with
their ``belay_steps`` and ``belay_events`` rows (in batches), signals past their
TTL and rate windows no claim reads any more; non-terminal jobs are never
pruned. Ours also keeps a terminal job while its workflow or its parent still
depends on it.

Rows are written with raw SQL (``tests.helpers.insert_job``, finished_at set
explicitly) and read back with raw SQL; "now" is the ``clock`` fixture (a
ManualClock at ``START``), so every cutoff is exact and a test moves time
instead of sleeping. The race tests run real threads, each worker with a
client of its own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

import belay
from belay import retention, store
from belay.retention import DEFAULT_RETENTION, DEFAULT_SIGNAL_TTL, parse_retention
from tests.helpers import START, Conn, insert_job, running_job, wait_until

DAY = 86_400
WEEK = 7 * DAY
NOW_EPOCH = int(START.timestamp())
TERMINAL = ("succeeded", "failed", "cancelled")
NON_TERMINAL = ("ready", "running", "awaiting", "held", "paused")


# -- helpers -------------------------------------------------------------------------------


def ago(seconds: float) -> datetime:
    return START - timedelta(seconds=seconds)


def finished(conn: Conn, state: str, at: datetime, **columns: Any) -> int:
    """A job that ended in ``state`` at ``at``, with a journaled step and an event."""
    job_id = insert_job(conn, state=state, finished_at=at, attempt=1, started_at=at,
                        inserted_at=at - timedelta(minutes=1), **columns)
    add_history(conn, job_id, at)
    return job_id


def add_history(conn: Conn, job_id: int, at: datetime) -> None:
    conn.execute("INSERT INTO belay_steps (job_id, seq, name, value, inserted_at) "
                 "VALUES (%s, 1, 'fetch', %s, %s)", (job_id, b'"doc"', at))
    conn.execute("INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
                 "VALUES (%s, 1, '{\"progress\": 1}', %s)", (job_id, at))


def ids(conn: Conn, query: str) -> set[int]:
    return {int(row[0]) for row in conn.execute(query).fetchall()}


def jobs(conn: Conn) -> set[int]:
    return ids(conn, "SELECT id FROM belay_jobs")


def with_steps(conn: Conn) -> set[int]:
    return ids(conn, "SELECT job_id FROM belay_steps")


def with_events(conn: Conn) -> set[int]:
    return ids(conn, "SELECT job_id FROM belay_events")


def assert_kept_with_history(conn: Conn, kept: set[int]) -> None:
    """Exactly ``kept`` remain, each with its step and event; the rest went whole."""
    assert jobs(conn) == kept
    assert with_steps(conn) == kept
    assert with_events(conn) == kept


def make_worker(client: belay.Belay, queues: Any = ("default",), **options: Any) -> belay.Worker:
    """A worker nothing starts: ``prune()`` runs one pass on a short-lived pool."""
    return belay.Worker(queues, client=client, registry=belay.Registry(), **options)


def no_jobs(**extra: int) -> dict[str, int]:
    """The counts of a pass that deleted ``extra`` only."""
    return {"succeeded": 0, "failed": 0, "cancelled": 0, "signals": 0, "rate_windows": 0,
            **extra}


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    def set_batches(size: int, per_pass: int) -> None:
        monkeypatch.setattr(retention, "PRUNE_BATCH", size)
        monkeypatch.setattr(retention, "PRUNE_BATCHES", per_pass)
    return set_batches


# -- options -------------------------------------------------------------------------------


def test_the_defaults_are_a_day_a_week_a_week_and_signals_a_week(client) -> None:
    worker = make_worker(client)
    assert worker.retention == {"succeeded": DAY, "failed": WEEK, "cancelled": WEEK}
    assert worker.signal_ttl == WEEK
    assert worker.retention == DEFAULT_RETENTION and WEEK == DEFAULT_SIGNAL_TTL


def test_retention_is_merged_over_the_defaults(client) -> None:
    worker = make_worker(client, retention={"succeeded": 60, "cancelled": None},
                         signal_ttl=None)
    assert worker.retention == {"succeeded": 60.0, "failed": WEEK, "cancelled": None}
    assert worker.signal_ttl is None


@pytest.mark.parametrize("retention", [
    {"running": 60}, {"done": 60}, {"succeeded": 0}, {"failed": -1}, {"succeeded": True},
    {"cancelled": "1d"}, {"succeeded": timedelta(days=1)}, {"succeeded": math.inf},
    {"failed": math.nan}, {"succeeded": 1e300},
])
def test_bad_retention_raises_a_configuration_error(client, retention) -> None:
    with pytest.raises(belay.ConfigurationError, match="retention"):
        make_worker(client, retention=retention)


@pytest.mark.parametrize("ttl", [0, -5, True, "7d", math.inf, math.nan, 1e300])
def test_a_bad_signal_ttl_raises_a_configuration_error(client, ttl) -> None:
    with pytest.raises(belay.ConfigurationError, match="signal_ttl"):
        make_worker(client, signal_ttl=ttl)


def test_the_retention_errors_say_what_to_write(client) -> None:
    with pytest.raises(belay.ConfigurationError) as bad_key:
        make_worker(client, retention={"running": 60})
    assert "succeeded, failed, cancelled" in str(bad_key.value)
    with pytest.raises(belay.ConfigurationError) as bad_value:
        make_worker(client, retention={"failed": 0})
    assert "None to keep forever" in str(bad_value.value)


keeps = st.one_of(st.none(), st.integers(min_value=1, max_value=10 * 365 * DAY),
                  st.floats(min_value=0.001, max_value=10 * 365 * DAY))


@given(st.dictionaries(st.sampled_from(TERMINAL), keeps))
def test_parse_retention_merges_any_valid_mapping_over_the_defaults(
    given_retention: dict[str, float | None]
) -> None:
    merged = parse_retention(given_retention)
    assert set(merged) == set(TERMINAL)
    for state in TERMINAL:
        expected = given_retention.get(state, DEFAULT_RETENTION[state])
        assert merged[state] == (None if expected is None else float(expected))


@given(st.dictionaries(st.sampled_from(TERMINAL), keeps, min_size=0),
       st.text(min_size=1).filter(lambda k: k not in TERMINAL), keeps)
def test_parse_retention_refuses_any_other_key(
    given_retention: dict[str, float | None], key: str, keep: float | None
) -> None:
    with pytest.raises(belay.ConfigurationError):
        parse_retention({**given_retention, key: keep})


# -- jobs ----------------------------------------------------------------------------------


def test_terminal_jobs_past_their_states_retention_go_with_their_steps_and_events(
    client, sql_conn, clock
) -> None:
    past = {
        "succeeded": finished(sql_conn, "succeeded", ago(DAY + 1)),
        "failed": finished(sql_conn, "failed", ago(WEEK + 1)),
        "cancelled": finished(sql_conn, "cancelled", ago(WEEK + 1)),
    }
    at_cutoff = {state: finished(sql_conn, state, ago(keep))
                 for state, keep in (("succeeded", DAY), ("failed", WEEK), ("cancelled", WEEK))}
    within = {state: finished(sql_conn, state, ago(keep - 1))
              for state, keep in (("succeeded", DAY), ("failed", WEEK), ("cancelled", WEEK))}
    # Older than a succeeded job may get, within a failed or cancelled one's week.
    two_days = {state: finished(sql_conn, state, ago(2 * DAY)) for state in ("failed",
                                                                             "cancelled")}
    worker = make_worker(client)
    assert worker.prune() == no_jobs(succeeded=1, failed=1, cancelled=1)
    kept = {*at_cutoff.values(), *within.values(), *two_days.values()}
    assert_kept_with_history(sql_conn, kept)
    assert not set(past.values()) & jobs(sql_conn)

    assert worker.prune() == no_jobs()  # nothing more is due
    clock.advance(1)  # the jobs exactly at the cutoff are now past it
    assert worker.prune() == no_jobs(succeeded=1, failed=1, cancelled=1)
    assert_kept_with_history(sql_conn, {*within.values(), *two_days.values()})


def test_each_state_uses_its_own_retention_and_none_keeps_forever(client, sql_conn) -> None:
    gone = {finished(sql_conn, "succeeded", ago(61)), finished(sql_conn, "cancelled", ago(3601))}
    kept = {finished(sql_conn, "succeeded", ago(59)), finished(sql_conn, "cancelled", ago(3599)),
            finished(sql_conn, "failed", ago(3650 * DAY))}
    worker = make_worker(client, retention={"succeeded": 60, "failed": None, "cancelled": 3600})
    counts = worker.prune()
    assert counts == {"succeeded": 1, "cancelled": 1, "signals": 0, "rate_windows": 0}
    assert "failed" not in counts
    assert_kept_with_history(sql_conn, kept)
    assert not gone & jobs(sql_conn)


def test_a_job_pruned_is_gone_from_the_clients_reads(client, sql_conn) -> None:
    job_id = finished(sql_conn, "succeeded", ago(DAY + 1))
    assert client.get_job(job_id) is not None
    make_worker(client).prune()
    assert client.get_job(job_id) is None
    assert client.steps(job_id) == [] and client.events(job_id) == []


@pytest.mark.parametrize("state", NON_TERMINAL)
def test_non_terminal_jobs_are_never_pruned_however_old(client, sql_conn, state) -> None:
    ancient = ago(3650 * DAY)
    columns: dict[str, Any] = {"state": state, "inserted_at": ancient, "started_at": ancient,
                               "finished_at": ancient, "ready_at": ancient}
    if state == "running":
        job_id = running_job(sql_conn, **columns)
    else:
        if state == "awaiting":
            columns.update(await_scope="job:1", await_name="go")
        job_id = insert_job(sql_conn, **columns)
    add_history(sql_conn, job_id, ancient)
    # Also a terminal job, so the pass is known to delete what it may.
    gone = finished(sql_conn, "succeeded", ancient)
    worker = make_worker(client, retention={"succeeded": 1, "failed": 1, "cancelled": 1})
    assert worker.prune() == no_jobs(succeeded=1)
    assert_kept_with_history(sql_conn, {job_id})
    assert gone not in jobs(sql_conn)


def test_a_workflow_goes_whole_once_every_member_is_past_its_retention(client,
                                                                      sql_conn) -> None:
    """Members stay while any member is live or still within its own state's
    retention: a failed member kept a week keeps its succeeded dependencies, so
    an operator's retry two days on still finds them (§8.6 settles on them)."""
    old = ago(WEEK + 1)
    live_a = finished(sql_conn, "succeeded", old, workflow_id="wf-live", wf_name="a")
    live_b = finished(sql_conn, "failed", old, workflow_id="wf-live", wf_name="b")
    live_c = running_job(sql_conn, workflow_id="wf-live", wf_name="c")
    held_a = finished(sql_conn, "cancelled", old, workflow_id="wf-held", wf_name="a")
    held_b = insert_job(sql_conn, state="held", workflow_id="wf-held", wf_name="b",
                        wf_deps=["x"])
    recent_a = finished(sql_conn, "succeeded", ago(2 * DAY), workflow_id="wf-recent",
                        wf_name="a")
    recent_b = finished(sql_conn, "failed", ago(2 * DAY), workflow_id="wf-recent",
                        wf_name="b")
    worker = make_worker(client)
    assert worker.prune() == no_jobs()
    everything = {live_a, live_b, live_c, held_a, held_b, recent_a, recent_b}
    assert jobs(sql_conn) == everything

    # The live members end (long ago, as far as retention is concerned): those
    # workflows are past retention as a whole now and go whole.
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded', finished_at = %s, "
                     "lease_until = NULL, leased_by = NULL WHERE id = %s", (old, live_c))
    sql_conn.execute("UPDATE belay_jobs SET state = 'cancelled', finished_at = %s "
                     "WHERE id = %s", (old, held_b))
    assert worker.prune() == no_jobs(succeeded=2, failed=1, cancelled=2)
    assert jobs(sql_conn) == {recent_a, recent_b}
    assert {live_a, live_b, held_a}.isdisjoint(with_steps(sql_conn) | with_events(sql_conn))

    # A week on, the failed member's retention is over too.
    sql_conn.execute("UPDATE belay_jobs SET finished_at = %s WHERE workflow_id = 'wf-recent'",
                     (old,))
    assert worker.prune() == no_jobs(succeeded=1, failed=1)
    assert jobs(sql_conn) == set()


def test_a_child_stays_until_its_parent_is_past_its_retention(client, sql_conn) -> None:
    old = ago(DAY + 1)
    running_parent = running_job(sql_conn)
    child_of_running = finished(sql_conn, "succeeded", old, parent_id=running_parent)
    awaiting_parent = insert_job(sql_conn, state="awaiting", await_scope="job:0",
                                 await_name="$children")
    child_of_awaiting = finished(sql_conn, "succeeded", old, parent_id=awaiting_parent)
    # A failed parent (kept a week) may still be retried: its children stay.
    failed_parent = finished(sql_conn, "failed", ago(2 * DAY))
    child_of_failed = finished(sql_conn, "succeeded", old, parent_id=failed_parent)
    done_parent = finished(sql_conn, "succeeded", old)
    child_of_done = finished(sql_conn, "succeeded", old, parent_id=done_parent)
    orphan = finished(sql_conn, "succeeded", old, parent_id=999_999)  # parent pruned already
    worker = make_worker(client)
    deleted = worker.prune()
    # The expired parent and its child go (the child in the same pass or the next).
    deleted = no_jobs(succeeded=deleted["succeeded"] + worker.prune()["succeeded"])
    assert deleted == no_jobs(succeeded=3)
    assert jobs(sql_conn) == {running_parent, child_of_running, awaiting_parent,
                              child_of_awaiting, failed_parent, child_of_failed}
    assert {child_of_done, orphan, done_parent}.isdisjoint(with_steps(sql_conn))

    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded', finished_at = %s, "
                     "lease_until = NULL, leased_by = NULL WHERE id = %s",
                     (old, running_parent))
    assert worker.prune()["succeeded"] + worker.prune()["succeeded"] == 2
    assert jobs(sql_conn) == {awaiting_parent, child_of_awaiting, failed_parent,
                              child_of_failed}


def test_a_pass_deletes_batch_after_batch_oldest_first_up_to_its_cap(client, sql_conn,
                                                                     small_batches) -> None:
    small_batches(3, 2)  # 3 jobs a batch, 2 batches per state per pass
    by_state = {state: [finished(sql_conn, state, ago(WEEK + 1000 - minute * 60))
                        for minute in range(10)]  # oldest first
                for state in TERMINAL}
    worker = make_worker(client)
    assert worker.prune() == no_jobs(succeeded=6, failed=6, cancelled=6)
    assert_kept_with_history(sql_conn, {i for made in by_state.values() for i in made[6:]})
    assert worker.prune() == no_jobs(succeeded=4, failed=4, cancelled=4)
    assert_kept_with_history(sql_conn, set())
    assert worker.prune() == no_jobs()


def test_a_pass_with_the_default_batches_empties_more_than_one_batch(client, sql_conn) -> None:
    n = 2 * retention.PRUNE_BATCH + 7
    assert n < retention.PRUNE_BATCH * retention.PRUNE_BATCHES
    sql_conn.execute(
        "INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
        "SELECT 'test.kind', 'default', 'succeeded', %(at)s, %(at)s FROM generate_series(1, %(n)s)",
        {"at": ago(DAY + 1), "n": n})
    sql_conn.execute("INSERT INTO belay_steps (job_id, seq, name, inserted_at) "
                     "SELECT id, 1, 'fetch', finished_at FROM belay_jobs")
    keep = finished(sql_conn, "succeeded", ago(60))
    assert make_worker(client).prune() == no_jobs(succeeded=n)
    assert_kept_with_history(sql_conn, {keep})


# -- signals and rate windows --------------------------------------------------------------


def add_signal(conn: Conn, scope: str, at: datetime) -> None:
    conn.execute("INSERT INTO belay_signals (scope, name, payload, inserted_at) "
                 "VALUES (%s, 'go', '{}', %s)", (scope, at))


def signal_scopes(conn: Conn) -> set[str]:
    return {row[0] for row in conn.execute("SELECT scope FROM belay_signals").fetchall()}


def test_signals_past_their_ttl_are_pruned(client, sql_conn, clock) -> None:
    add_signal(sql_conn, "job:1", ago(WEEK + 1))
    add_signal(sql_conn, "job:2", ago(WEEK))
    add_signal(sql_conn, "wf:recent", ago(3600))
    worker = make_worker(client)
    assert worker.prune() == no_jobs(signals=1)
    assert signal_scopes(sql_conn) == {"job:2", "wf:recent"}
    clock.advance(1)
    assert worker.prune() == no_jobs(signals=1)
    assert signal_scopes(sql_conn) == {"wf:recent"}


def test_a_shorter_signal_ttl_and_none(client, sql_conn) -> None:
    add_signal(sql_conn, "job:1", ago(3601))
    add_signal(sql_conn, "job:2", ago(3599))
    add_signal(sql_conn, "job:3", ago(3650 * DAY))
    kept_forever = make_worker(client, signal_ttl=None).prune()
    assert "signals" not in kept_forever
    assert signal_scopes(sql_conn) == {"job:1", "job:2", "job:3"}
    assert make_worker(client, signal_ttl=3600).prune()["signals"] == 2
    assert signal_scopes(sql_conn) == {"job:2"}


def add_window(conn: Conn, bucket: str, window_start: int) -> None:
    conn.execute("INSERT INTO belay_rate (bucket, window_start, count) VALUES (%s, %s, 1)",
                 (bucket, window_start))


def windows(conn: Conn) -> set[tuple[str, int]]:
    return {(b, int(w)) for b, w in conn.execute(
        "SELECT bucket, window_start FROM belay_rate").fetchall()}


def test_rate_windows_older_than_a_day_are_pruned(client, sql_conn) -> None:
    add_window(sql_conn, "queue:default", NOW_EPOCH - DAY - 1)
    add_window(sql_conn, "queue:default", NOW_EPOCH - DAY)
    add_window(sql_conn, "resource:tokens", NOW_EPOCH - 60)
    # A short period does not shorten the day.
    queues = {"default": 1, "fast": {"limit": 1, "rate": {"allowed": 5, "period": 60}}}
    assert make_worker(client, queues).prune() == no_jobs(rate_windows=1)
    assert windows(sql_conn) == {("queue:default", NOW_EPOCH - DAY),
                                 ("resource:tokens", NOW_EPOCH - 60)}


def test_a_long_rate_period_keeps_two_periods_of_windows(client, sql_conn) -> None:
    period = 2 * DAY
    queues = {"default": 1, "slow": {"limit": 1, "rate": {"allowed": 10, "period": period}}}
    add_window(sql_conn, "queue:slow", NOW_EPOCH - 2 * period - 1)
    add_window(sql_conn, "queue:slow", NOW_EPOCH - 2 * period)
    add_window(sql_conn, "queue:slow", NOW_EPOCH - DAY - 1)  # a day would have dropped it
    assert make_worker(client, queues).prune() == no_jobs(rate_windows=1)
    assert windows(sql_conn) == {("queue:slow", NOW_EPOCH - 2 * period),
                                 ("queue:slow", NOW_EPOCH - DAY - 1)}


def test_a_rate_period_from_a_queue_row_counts_too(client, sql_conn) -> None:
    """A queue the ``belay_queues`` rows define is one of the worker's queues,
    started or not (drain admits by it too)."""
    period = 2 * DAY
    sql_conn.execute(
        "INSERT INTO belay_queues (name, opts, updated_at) VALUES ('slow', %s, %s)",
        (f'{{"limit": 1, "rate": {{"allowed": 10, "period": {period}}}}}', START))
    add_window(sql_conn, "queue:slow", NOW_EPOCH - DAY - 1)
    add_window(sql_conn, "queue:slow", NOW_EPOCH - 2 * period - 1)
    worker = make_worker(client, sweep_interval=3600.0, poll_interval=0.05, busy_poll=0.01)
    assert worker.prune()["rate_windows"] == 1  # not started
    add_window(sql_conn, "queue:slow", NOW_EPOCH - 2 * period - 1)
    worker.start()
    try:
        assert "slow" in worker.live_queues()
        assert worker.prune()["rate_windows"] == 1  # started
    finally:
        worker.stop()
    assert windows(sql_conn) == {("queue:slow", NOW_EPOCH - DAY - 1)}


# -- the sweeper ---------------------------------------------------------------------------


def test_the_sweeper_prunes_on_its_own_at_most_once_a_minute(client, sql_conn,
                                                             monkeypatch) -> None:
    worker = make_worker(client, sweep_interval=0.02, poll_interval=0.05, busy_poll=0.01)
    lock = threading.Lock()
    sweeps: list[str] = []

    def counting(name: str, method: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            with lock:
                sweeps.append(name)
            return method()
        return counted

    parts = worker.maintenance
    monkeypatch.setattr(parts, "prune_pass", counting("prune", parts.prune_pass))
    monkeypatch.setattr(parts, "reclaim", counting("reclaim", parts.reclaim))
    old = finished(sql_conn, "succeeded", ago(DAY + 1))
    kept = finished(sql_conn, "succeeded", ago(60))
    worker.start()
    try:
        wait_until(lambda: old not in jobs(sql_conn), "the sweeper prunes the old job")
        wait_until(lambda: sweeps.count("reclaim") >= 10, "ten sweeps went by")
    finally:
        worker.stop()
    with lock:
        assert sweeps.count("prune") == 1
    assert_kept_with_history(sql_conn, {kept})


def test_a_sweeper_behind_runs_the_next_pass_at_once_until_it_caught_up(
        client, sql_conn, monkeypatch, small_batches) -> None:
    """A pass that stops with expired jobs left does not wait a minute for the
    next: one pass a minute could not keep up with a busy deployment."""
    small_batches(3, 2)  # 6 jobs per state per pass
    monkeypatch.setattr(retention, "PRUNE_PAUSE", 0.01)
    worker = make_worker(client, sweep_interval=0.02, poll_interval=0.05, busy_poll=0.01)
    passes: list[bool] = []
    real = worker.maintenance.prune_pass

    def counted() -> retention.Pass:
        done = real()
        passes.append(done.behind)
        return done

    monkeypatch.setattr(worker.maintenance, "prune_pass", counted)
    reclaims: list[int] = []
    reclaim = worker.maintenance.reclaim
    monkeypatch.setattr(worker.maintenance, "reclaim", lambda: reclaims.append(1) or reclaim())
    old = {finished(sql_conn, "failed", ago(WEEK + 1 + i)) for i in range(20)}
    kept = finished(sql_conn, "failed", ago(60))
    worker.start()
    try:
        wait_until(lambda: not old & jobs(sql_conn), "the sweeper prunes every old job")
        seen = len(reclaims)
        wait_until(lambda: len(reclaims) >= seen + 10, "ten more sweeps went by")
    finally:
        worker.stop()
    # 20 jobs, 6 a pass: three passes stopped behind, the fourth finished; then
    # nothing until the next minute.
    assert passes == [True, True, True, False]
    assert_kept_with_history(sql_conn, {kept})


def test_a_pass_stops_at_its_time_budget_taking_the_states_in_turn(client, sql_conn,
                                                                   small_batches) -> None:
    small_batches(2, 1000)
    for state in TERMINAL:
        for i in range(10):
            finished(sql_conn, state, ago(WEEK + 1 + i))
    ticks = iter(range(100))  # each reading 1 s after the last
    rests: list[float] = []

    with client.connection() as conn:
        done = retention.prune_pass(conn, client.now(), DEFAULT_RETENTION, None, [],
                                    budget=10.0, monotonic=lambda: float(next(ticks)),
                                    rest=rests.append)
    # Deadline at 10; a batch reads the clock before and after it (1 s apart), a
    # round then once more: 7 after the first round, 14 after the second. After
    # each full batch, a rest as long as the batch.
    assert done == retention.Pass({"succeeded": 4, "failed": 4, "cancelled": 4,
                                   "rate_windows": 0}, True)
    assert rests == [1.0 * retention.PRUNE_REST] * 6
    with client.connection() as conn:
        rest = retention.prune_pass(conn, client.now(), DEFAULT_RETENTION, None, [],
                                    budget=None, rest=rests.append)
    assert rest == retention.Pass({"succeeded": 6, "failed": 6, "cancelled": 6,
                                   "rate_windows": 0}, False)
    # 3 full batches per state, then the short one: no rest after a short batch.
    assert len(rests) == 6 + 9


def test_a_rest_that_says_stop_ends_the_pass(client, sql_conn, small_batches) -> None:
    """A worker's rest is its stop event's wait, true once it is stopping: the
    pass ends after that batch, behind, instead of deleting on without rests
    until its budget runs out."""
    small_batches(2, 1000)
    for state in TERMINAL:
        for i in range(10):
            finished(sql_conn, state, ago(WEEK + 1 + i))
    stop = threading.Event()
    rests: list[float] = []

    def rest(seconds: float) -> bool:
        rests.append(seconds)
        if len(rests) == 4:
            stop.set()
        return stop.wait(0)

    with client.connection() as conn:
        done = retention.prune_pass(conn, client.now(), DEFAULT_RETENTION, None, [],
                                    budget=None, rest=rest)
    # Round one: a batch of each state; round two: succeeded, then the stop.
    assert done.counts["succeeded"] == 4 and done.counts["failed"] == 2
    assert done.counts["cancelled"] == 2 and done.behind
    assert len(rests) == 4


def test_prune_runs_on_a_started_worker(client, sql_conn) -> None:
    old = finished(sql_conn, "failed", ago(WEEK + 1))
    worker = make_worker(client, sweep_interval=3600.0, poll_interval=0.05, busy_poll=0.01)
    worker.start()
    try:
        assert worker.prune()["failed"] == 1
    finally:
        worker.stop()
    assert old not in jobs(sql_conn)


# -- races ---------------------------------------------------------------------------------


def test_two_pruners_in_open_transactions_skip_each_others_rows(client, sql_conn,
                                                                db_url) -> None:
    """SKIP LOCKED: a second pruner neither waits for the first nor deletes its rows."""
    made = [finished(sql_conn, "succeeded", ago(DAY + 100 - n)) for n in range(8)]
    cutoff = {"succeeded": ago(DAY), "failed": None, "cancelled": None}
    with psycopg.connect(db_url) as first, psycopg.connect(db_url) as second:
        first.execute("SET lock_timeout = '2s'")
        second.execute("SET lock_timeout = '2s'")
        assert store.prune_jobs(first, "succeeded", cutoff, 3) == 3  # uncommitted, locked
        assert store.prune_jobs(second, "succeeded", cutoff, 3) == 3
        second.commit()
        assert jobs(sql_conn) == set(made) - set(made[3:6])  # the first's not committed
        first.commit()
        assert store.prune_jobs(second, "succeeded", cutoff, 10) == 2
        second.commit()
    assert_kept_with_history(sql_conn, set())


@pytest.fixture
def other_clients(db_url: str, clock: belay.ManualClock) -> Iterator[list[belay.Belay]]:
    with belay.Belay(db_url, clock=clock) as a, belay.Belay(db_url, clock=clock) as b:
        yield [a, b]


def test_two_workers_pruning_at_once_delete_each_job_exactly_once(sql_conn, other_clients,
                                                                  small_batches) -> None:
    small_batches(20, 10_000)
    n = 3000
    sql_conn.execute(
        "INSERT INTO belay_jobs (kind, queue, state, inserted_at, finished_at) "
        "SELECT 'test.kind', 'default', (ARRAY['succeeded', 'failed', 'cancelled'])[1 + i %% 3], "
        "%(at)s, %(at)s - i * interval '1 second' FROM generate_series(1, %(n)s) AS i",
        {"at": ago(WEEK + 1), "n": n})
    sql_conn.execute("INSERT INTO belay_steps (job_id, seq, name, inserted_at) "
                     "SELECT id, 1, 'fetch', finished_at FROM belay_jobs")
    sql_conn.execute("INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
                     "SELECT id, s, '{}', finished_at FROM belay_jobs, generate_series(1, 2) s")
    workers = [make_worker(c) for c in other_clients]
    start = threading.Barrier(len(workers))
    deleted: list[dict[str, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def prune(worker: belay.Worker) -> None:
        try:
            start.wait(10)
            while True:
                counts = worker.prune()
                with lock:
                    deleted.append(counts)
                if not any(counts[state] for state in TERMINAL):
                    return
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=prune, args=(w,), name=f"pruner-{i}")
               for i, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    # Every job counted once across both workers: none deleted twice, none missed.
    assert sum(counts[state] for counts in deleted for state in TERMINAL) == n
    assert {state: sum(c[state] for c in deleted) for state in TERMINAL} == {
        state: n // 3 for state in TERMINAL}
    assert_kept_with_history(sql_conn, set())


def test_a_member_kept_forever_or_live_with_a_stale_finished_at_keeps_its_workflow(
    client, sql_conn
) -> None:
    """The "still needed" check is null-safe: a sibling whose state is kept
    forever (retention None) or isn't terminal at all (even with a finished_at
    left over) keeps the whole workflow, and a parent kept forever its children."""
    old = ago(WEEK + 1)
    forever_a = finished(sql_conn, "succeeded", old, workflow_id="wf-forever", wf_name="a")
    forever_b = finished(sql_conn, "failed", old, workflow_id="wf-forever", wf_name="b")
    live_a = finished(sql_conn, "succeeded", old, workflow_id="wf-live", wf_name="a")
    live_b = insert_job(sql_conn, state="ready", finished_at=old, workflow_id="wf-live",
                        wf_name="b")
    parent = finished(sql_conn, "failed", old)
    child = finished(sql_conn, "succeeded", old, parent_id=parent)
    worker = make_worker(client, retention={"failed": None})
    nothing = {k: v for k, v in no_jobs().items() if k != "failed"}  # failed: not pruned at all
    assert worker.prune() == nothing
    assert jobs(sql_conn) == {forever_a, forever_b, live_a, live_b, parent, child}
