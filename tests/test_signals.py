"""Signals, steering and park-and-wake (contract §7 "Await park-and-wake", §8.1, §9.2).

Jobs are put into ``running`` / ``awaiting`` / ``paused`` with plain SQL, the way the
Elixir reference (or a worker not written yet) would leave them.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import belay
from belay import store
from belay.job import Job
from tests.helpers import (
    START,
    Conn,
    Notifications,
    advisory_waiters,
    awaiting_own_scope,
    insert_job,
    job_row,
    running_job,
    signal_rows,
    wait_until,
)

# -- §8.1 delivery ------------------------------------------------------------------------


def test_delivery_upserts_latest_payload_with_clock_time(client, sql_conn, clock) -> None:
    client.signal("wf:flow", "go", {"n": 1})
    later = clock.advance(90)
    client.signal("wf:flow", "go", {"n": 2, "note": "second"})

    assert signal_rows(sql_conn) == [
        {"scope": "wf:flow", "name": "go", "payload": {"n": 2, "note": "second"},
         "inserted_at": later},
    ]


def test_signals_are_keyed_by_scope_and_name(client, sql_conn) -> None:
    client.signal("wf:flow", "go", {"a": 1})
    client.signal("wf:flow", "stop", {"b": 2})
    client.signal("wf:other", "go", {"c": 3})

    assert [(r["scope"], r["name"], r["payload"]) for r in signal_rows(sql_conn)] == [
        ("wf:flow", "go", {"a": 1}),
        ("wf:flow", "stop", {"b": 2}),
        ("wf:other", "go", {"c": 3}),
    ]


def test_delivery_wakes_exactly_the_jobs_awaiting_that_scope_and_name(
    client, sql_conn, clock
) -> None:
    deadline = START + timedelta(hours=1)
    first = insert_job(sql_conn, state="awaiting", await_scope="wf:flow", await_name="go",
                       ready_at=deadline)
    second = insert_job(sql_conn, state="awaiting", await_scope="wf:flow", await_name="go",
                        queue="other")
    bystanders = [
        insert_job(sql_conn, state="awaiting", await_scope="wf:flow", await_name="stop"),
        insert_job(sql_conn, state="awaiting", await_scope="wf:elsewhere", await_name="go"),
        # An operator-frozen parked job keeps its await fields but is not awaiting.
        insert_job(sql_conn, state="paused", await_scope="wf:flow", await_name="go"),
        insert_job(sql_conn, state="held", await_scope="wf:flow", await_name="go"),
        insert_job(sql_conn, state="ready", ready_at=START),
        running_job(sql_conn, await_scope="wf:flow", await_name="go"),
    ]
    before = {job_id: job_row(sql_conn, job_id) for job_id in bystanders}
    now = clock.advance(42)

    woken = client.signal("wf:flow", "go", {"ok": True})

    assert sorted(woken) == [first, second]
    for job_id in (first, second):
        row = job_row(sql_conn, job_id)
        assert row["state"] == "ready"
        assert row["ready_at"] == now
        assert row["await_scope"] is None
        assert row["await_name"] is None
        assert row["attempt"] == 0
    for job_id, row in before.items():
        assert job_row(sql_conn, job_id) == row


def test_delivery_returns_nothing_when_no_job_awaits(client, sql_conn) -> None:
    assert client.signal("wf:flow", "go") == []
    assert len(signal_rows(sql_conn)) == 1


def test_wake_pokes_each_woken_queue_once_on_the_database_channel(
    client, sql_conn, notes
) -> None:
    for queue in ("alpha", "beta", "alpha"):
        insert_job(sql_conn, queue=queue, state="awaiting", await_scope="wf:x", await_name="go")
    insert_job(sql_conn, queue="gamma", state="awaiting", await_scope="wf:x", await_name="other")

    client.signal("wf:x", "go")

    received = notes.received()
    assert sorted(received, key=lambda p: p["q"]) == [
        {"t": "p", "q": "alpha"}, {"t": "p", "q": "beta"},
    ]


def test_delivery_that_wakes_nothing_sends_no_notification(client, sql_conn, notes) -> None:
    insert_job(sql_conn, state="awaiting", await_scope="wf:x", await_name="other")
    client.signal("wf:x", "go", {"v": 1})
    client.signal("wf:x", "go", {"v": 2})

    assert notes.received() == []


def test_client_with_notify_off_wakes_without_poking(db_url, clock, sql_conn, notes) -> None:
    job = insert_job(sql_conn, state="awaiting", await_scope="wf:x", await_name="go")
    with belay.Belay(db_url, clock=clock, notify=False) as quiet:
        assert quiet.signal("wf:x", "go") == [job]
    assert job_row(sql_conn, job)["state"] == "ready"
    assert notes.received() == []


@pytest.fixture
def long_db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh migrated database whose name has Postgres's maximum length (63 bytes)."""
    name = f"belay_t_long_{uuid.uuid4().hex}"
    name += "x" * (63 - len(name))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    try:
        yield psycopg.conninfo.make_conninfo(server_url, dbname=name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def test_wakes_poke_in_a_database_with_a_long_name(long_db_url, clock) -> None:
    with psycopg.connect(long_db_url, autocommit=True) as conn:
        assert len(conn.info.dbname) == 63
        job = insert_job(conn, state="awaiting", await_scope="wf:x", await_name="go", queue="q")
    notes = Notifications(long_db_url)
    try:
        with belay.Belay(long_db_url, clock=clock) as instance:
            assert instance.signal("wf:x", "go") == [job]
        assert notes.received() == [{"t": "p", "q": "q"}]
    finally:
        notes.close()


# -- signal_job, steer_job, validation -------------------------------------------------------


def test_signal_job_uses_the_job_scope_and_wakes_it(client, sql_conn, clock) -> None:
    job = awaiting_own_scope(sql_conn, "approve")
    now = clock.advance(5)

    assert client.signal_job(job, "approve", {"by": "ops"}) == [job]

    assert [(r["scope"], r["name"], r["payload"]) for r in signal_rows(sql_conn)] == [
        (f"job:{job}", "approve", {"by": "ops"}),
    ]
    row = job_row(sql_conn, job)
    assert (row["state"], row["ready_at"], row["await_scope"]) == ("ready", now, None)


def test_steer_job_writes_the_reserved_steer_name(client, sql_conn) -> None:
    job = insert_job(sql_conn, state="ready")
    assert client.steer_job(job, {"hint": "be brief"}) == []
    client.steer_job(job, {"hint": "be briefer"})

    assert [(r["scope"], r["name"], r["payload"]) for r in signal_rows(sql_conn)] == [
        (f"job:{job}", "$steer", {"hint": "be briefer"}),
    ]
    assert job_row(sql_conn, job)["state"] == "ready"


def test_steer_job_wakes_a_job_awaiting_steering(client, sql_conn) -> None:
    job = awaiting_own_scope(sql_conn, "$steer")
    assert client.steer_job(job, {"hint": "go on"}) == [job]
    assert job_row(sql_conn, job)["state"] == "ready"


@pytest.mark.parametrize("name", ["$steer", "$children", "$anything"])
def test_reserved_signal_names_are_refused_and_nothing_is_written(client, sql_conn, name) -> None:
    job = awaiting_own_scope(sql_conn, name)

    with pytest.raises(belay.ValidationError, match="reserved"):
        client.signal_job(job, name, {"x": 1})
    with pytest.raises(belay.ValidationError, match="reserved"):
        client.signal(f"job:{job}", name, {"x": 1})

    assert signal_rows(sql_conn) == []
    assert job_row(sql_conn, job)["state"] == "awaiting"


@pytest.mark.parametrize("name", ["", None, 7])
def test_signal_names_must_be_non_empty_strings(client, sql_conn, name) -> None:
    with pytest.raises(belay.ValidationError):
        client.signal("wf:x", name)
    assert signal_rows(sql_conn) == []


@pytest.mark.parametrize("scope", ["", None])
def test_an_empty_scope_is_refused(client, sql_conn, scope) -> None:
    with pytest.raises(belay.ValidationError, match="scope"):
        client.signal(scope, "go", {})
    with pytest.raises(belay.ValidationError, match="scope"):
        client.clear_signal(scope, "go")
    assert signal_rows(sql_conn) == []


@pytest.mark.parametrize("payload", [[1, 2], "text", 5, True, {"when": datetime(2026, 1, 1)}])
def test_a_payload_that_is_not_a_json_object_is_refused(client, sql_conn, payload) -> None:
    job = insert_job(sql_conn, state="awaiting", await_scope="wf:x", await_name="go")

    with pytest.raises(belay.ValidationError):
        client.signal("wf:x", "go", payload)
    with pytest.raises(belay.ValidationError):
        client.steer_job(job, payload)

    assert signal_rows(sql_conn) == []
    assert job_row(sql_conn, job)["state"] == "awaiting"


def test_a_missing_payload_is_stored_as_an_empty_object(client, sql_conn) -> None:
    client.signal("wf:x", "go")
    client.signal_job(1, "approve", None)

    assert {(r["scope"], r["name"]): r["payload"] for r in signal_rows(sql_conn)} == {
        ("wf:x", "go"): {}, ("job:1", "approve"): {},
    }


def test_steering_needs_a_dict(client, sql_conn) -> None:
    with pytest.raises(belay.ValidationError, match="steering is a dict"):
        client.steer_job(2, None)  # type: ignore[arg-type]
    assert signal_rows(sql_conn) == []


@pytest.mark.parametrize("job_id", ["1", 1.0, True, None])
def test_signal_job_needs_an_integer_id(client, sql_conn, job_id) -> None:
    with pytest.raises(belay.ValidationError, match="job id"):
        client.signal_job(job_id, "go")
    assert signal_rows(sql_conn) == []


def test_get_signal_reads_the_first_matching_scope(client, sql_conn) -> None:
    client.signal("wf:flow", "go", {"from": "workflow"})
    scopes = ["job:5", "wf:flow"]
    assert store.get_signal(sql_conn, scopes, "go") == (True, {"from": "workflow"})
    assert store.get_signal(sql_conn, scopes, "stop") == (False, None)
    assert store.get_signal(sql_conn, ["job:5"], "go") == (False, None)


# -- clear_signal ---------------------------------------------------------------------------


def test_clear_signal_deletes_it_and_says_whether_there_was_one(client, sql_conn) -> None:
    client.signal("wf:x", "go")
    client.signal("wf:x", "stop")

    assert client.clear_signal("wf:x", "go") is True
    assert client.clear_signal("wf:x", "go") is False
    assert client.clear_signal("wf:nowhere", "stop") is False
    assert [(r["scope"], r["name"]) for r in signal_rows(sql_conn)] == [("wf:x", "stop")]


def test_a_cleared_signal_no_longer_short_circuits_a_park(client, db_url, sql_conn, clock) -> None:
    job = running_job(sql_conn)
    client.signal_job(job, "go")
    assert client.clear_signal(f"job:{job}", "go") is True

    with psycopg.connect(db_url) as conn, conn.transaction():
        state = store.park_await(conn, claimed(job, 1), f"job:{job}", "go", None, clock.now())
    assert state == "awaiting"


# -- §7 park-and-wake -------------------------------------------------------------------------


def claimed(job_id: int, attempt: int) -> Job:
    """The claimed attempt a park is fenced on (a running job's row, as claimed)."""
    return Job(id=job_id, kind="test.kind", queue="default", state="running", attempt=attempt)


def park(db_url: str, job_id: int, attempt: int, scope: str, name: str,
         deadline: datetime | None, now: datetime) -> Any:
    with psycopg.connect(db_url) as conn, conn.transaction():
        return store.park_await(conn, claimed(job_id, attempt), scope, name, deadline, now)


def test_park_without_a_signal_awaits_until_the_deadline(db_url, sql_conn, clock) -> None:
    job = running_job(sql_conn)
    deadline = START + timedelta(minutes=10)

    assert park(db_url, job, 1, f"job:{job}", "go", deadline, clock.now()) == "awaiting"

    row = job_row(sql_conn, job)
    assert row["state"] == "awaiting"
    assert (row["await_scope"], row["await_name"]) == (f"job:{job}", "go")
    assert row["ready_at"] == deadline
    assert row["attempt"] == 0  # parking is not a failed try
    assert (row["lease_until"], row["leased_by"]) == (None, None)


def test_park_with_no_deadline_leaves_ready_at_null(db_url, sql_conn, clock) -> None:
    job = running_job(sql_conn, ready_at=START)
    assert park(db_url, job, 1, "wf:w", "go", None, clock.now()) == "awaiting"
    assert job_row(sql_conn, job)["ready_at"] is None


def test_signal_delivered_before_the_park_makes_it_ready_at_once(
    client, db_url, sql_conn, clock
) -> None:
    job = running_job(sql_conn)
    assert client.signal_job(job, "go", {"answer": 42}) == []  # nothing awaits yet
    now = clock.advance(3)

    assert park(db_url, job, 1, f"job:{job}", "go", now + timedelta(hours=1), now) == "ready"

    row = job_row(sql_conn, job)
    assert row["state"] == "ready"
    assert row["ready_at"] == now
    assert (row["await_scope"], row["await_name"]) == (None, None)
    assert row["attempt"] == 0
    assert (row["lease_until"], row["leased_by"]) == (None, None)
    # Signals persist until cleared: the resumed job still reads the payload.
    assert store.get_signal(sql_conn, [f"job:{job}"], "go") == (True, {"answer": 42})


def test_a_signal_of_another_name_or_scope_does_not_short_circuit(
    client, db_url, sql_conn, clock
) -> None:
    job = running_job(sql_conn)
    client.signal_job(job, "other")
    client.signal("wf:elsewhere", "go")
    assert park(db_url, job, 1, f"job:{job}", "go", None, clock.now()) == "awaiting"


def test_signal_delivered_after_the_park_wakes_the_job(client, db_url, sql_conn, clock) -> None:
    job = running_job(sql_conn)
    assert park(db_url, job, 1, f"job:{job}", "go", None, clock.now()) == "awaiting"
    now = clock.advance(60)

    assert client.signal_job(job, "go") == [job]

    row = job_row(sql_conn, job)
    assert (row["state"], row["ready_at"], row["await_name"]) == ("ready", now, None)


@pytest.mark.parametrize("signal_first", [False, True])
def test_a_stale_park_returns_none_and_changes_nothing(
    client, db_url, sql_conn, clock, signal_first
) -> None:
    job = running_job(sql_conn, attempt=2)
    if signal_first:
        client.signal_job(job, "go")
    before = job_row(sql_conn, job)

    assert park(db_url, job, 1, f"job:{job}", "go", None, clock.now()) is None

    assert job_row(sql_conn, job) == before


@pytest.mark.parametrize("state", ["ready", "awaiting", "succeeded", "cancelled"])
def test_park_of_a_job_that_is_not_running_returns_none(db_url, sql_conn, clock, state) -> None:
    job = insert_job(sql_conn, state=state, attempt=1)
    before = job_row(sql_conn, job)
    assert park(db_url, job, 1, f"job:{job}", "go", None, clock.now()) is None
    assert job_row(sql_conn, job) == before


# -- §7 the race: delivery concurrent with the park -------------------------------------------


def test_delivery_racing_the_park_never_loses_the_wake_up(client, db_url, sql_conn, clock) -> None:
    """§7: scope lock + persistent signal row ⇒ no lost wake-ups, whoever wins."""
    rounds = 50
    client.signal("wf:warm-up", "go")  # open the pool and verify the schema outside the race
    outcomes: dict[str | None, int] = {}

    def parker(conn: Conn, job: int, barrier: threading.Barrier, out: dict[str, Any]) -> None:
        barrier.wait()
        with conn.transaction():
            out["park"] = store.park_await(conn, claimed(job, 1), f"job:{job}", "go", None,
                                           clock.now())

    def signaller(job: int, barrier: threading.Barrier, out: dict[str, Any]) -> None:
        barrier.wait()
        out["woken"] = client.signal_job(job, "go", {"job": job})

    with psycopg.connect(db_url, prepare_threshold=None) as park_conn:  # maybe pooled
        for _ in range(rounds):
            job = running_job(sql_conn)
            barrier = threading.Barrier(2, timeout=10)
            out: dict[str, Any] = {}
            run_threads(
                (parker, (park_conn, job, barrier, out)), (signaller, (job, barrier, out))
            )

            row = job_row(sql_conn, job)
            assert row["state"] == "ready", f"job {job} stuck {row['state']} ({out})"
            # Either the park saw the signal, or the delivery woke the parked job.
            if out["park"] == "ready":
                assert out["woken"] == []
            else:
                assert (out["park"], out["woken"]) == ("awaiting", [job])
            outcomes[out["park"]] = outcomes.get(out["park"], 0) + 1
    assert sum(outcomes.values()) == rounds


def run_threads(*targets: tuple[Any, tuple[Any, ...]]) -> None:
    """Run each (function, args) on a thread of its own; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(function: Any, args: tuple[Any, ...]) -> None:
        try:
            function(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


def naive_park(conn: Conn, job_id: int, scope: str, name: str) -> None:
    """A park that skips §7's lock and signal check: what the race test guards against."""
    conn.execute(
        "UPDATE belay_jobs SET state = 'awaiting', await_scope = %s, await_name = %s, "
        "attempt = attempt - 1, lease_until = NULL, leased_by = NULL "
        "WHERE id = %s AND state = 'running'",
        (scope, name, job_id),
    )


def test_a_park_without_lock_and_check_can_lose_the_wake_up(
    client, db_url, sql_conn, clock
) -> None:
    """The ordering the race test can hit: delivery commits, then the job parks."""
    naive = running_job(sql_conn)
    proper = running_job(sql_conn)
    assert client.signal_job(naive, "go") == []
    assert client.signal_job(proper, "go") == []

    naive_park(sql_conn, naive, f"job:{naive}", "go")
    assert park(db_url, proper, 1, f"job:{proper}", "go", None, clock.now()) == "ready"

    # The naive job is stuck: awaiting, with its signal sitting right there.
    assert job_row(sql_conn, naive)["state"] == "awaiting"
    assert store.get_signal(sql_conn, [f"job:{naive}"], "go")[0] is True
    assert job_row(sql_conn, proper)["state"] == "ready"


def test_delivery_waits_for_an_open_park_then_wakes_it(client, db_url, sql_conn, clock) -> None:
    """Deterministic interleaving: the park holds the scope lock, delivery queues behind it."""
    job = running_job(sql_conn)
    client.signal("wf:warm-up", "go")
    woken: list[int] = []
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            parked = store.park_await(conn, claimed(job, 1), f"job:{job}", "go", None,
                                      clock.now())
            assert parked == "awaiting"
            thread = threading.Thread(target=lambda: woken.extend(client.signal_job(job, "go")))
            thread.start()
            wait_until(lambda: advisory_waiters(sql_conn) == 1, "delivery waits for the lock")
            # It has not written anything yet.
            assert store.get_signal(sql_conn, [f"job:{job}"], "go") == (False, None)
        thread.join(10)
    assert woken == [job]
    assert job_row(sql_conn, job)["state"] == "ready"


def test_park_waits_for_an_open_delivery_then_sees_its_signal(
    client, db_url, sql_conn, clock
) -> None:
    """The other interleaving: delivery holds the lock, the park queues behind it."""
    job = running_job(sql_conn)
    parked: list[str | None] = []
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            assert client.signal_job(job, "go", conn=conn) == []
            thread = threading.Thread(
                target=lambda: parked.append(park(db_url, job, 1, f"job:{job}", "go", None,
                                                  clock.now()))
            )
            thread.start()
            wait_until(lambda: advisory_waiters(sql_conn) == 1, "the park waits for the lock")
            assert job_row(sql_conn, job)["state"] == "running"
        thread.join(10)
    assert parked == ["ready"]
    assert job_row(sql_conn, job)["state"] == "ready"


# -- signals on the caller's connection ----------------------------------------------------------


def test_signal_in_a_rolled_back_transaction_leaves_no_trace(
    client, db_url, sql_conn, notes
) -> None:
    job = awaiting_own_scope(sql_conn, "go")

    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        assert client.signal_job(job, "go", {"x": 1}, conn=conn) == [job]
        # Inside the caller's transaction, the wake is visible to the caller only.
        assert job_row(conn, job)["state"] == "ready"
        assert job_row(sql_conn, job)["state"] == "awaiting"

    assert signal_rows(sql_conn) == []
    assert job_row(sql_conn, job)["state"] == "awaiting"
    assert notes.received() == []


def test_signal_in_a_committed_transaction_lands_on_commit(
    client, db_url, sql_conn, notes, clock
) -> None:
    job = awaiting_own_scope(sql_conn, "go", queue="inbox")
    now = clock.advance(1)

    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            assert client.signal_job(job, "go", {"x": 1}, conn=conn) == [job]
            assert notes.received() == []  # pg_notify is delivered on commit only
            assert signal_rows(sql_conn) == []
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    assert [(r["scope"], r["payload"]) for r in signal_rows(sql_conn)] == [(f"job:{job}", {"x": 1})]
    row = job_row(sql_conn, job)
    assert (row["state"], row["ready_at"]) == ("ready", now)
    assert notes.received() == [{"t": "p", "q": "inbox"}]


def test_signal_on_an_idle_caller_connection_commits_by_itself(client, db_url, sql_conn) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        client.signal("wf:x", "go", {"y": 2}, conn=conn)
    assert len(signal_rows(sql_conn)) == 1


def test_signal_on_a_failed_caller_transaction_is_refused(client, db_url, sql_conn) -> None:
    with psycopg.connect(db_url) as conn, conn.transaction(force_rollback=True):
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(belay.ValidationError, match="roll it back"):
            client.signal("wf:x", "go", conn=conn)
    assert signal_rows(sql_conn) == []
