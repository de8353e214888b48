"""Awaiting results (contract §10 client checklist; §2 envelope; §9.2 result notifications).

Jobs are finished with plain SQL, as a worker of any SDK would finish them: the result
envelope is bytea — JSON, or Erlang ETF when the Elixir reference wrote it.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import belay
from belay.notify import ResultListener
from tests.helpers import (
    FORGED_RESULT,
    START,
    VECTORS_PATH,
    Conn,
    channel_for,
    forge_result,
    from_expected,
    insert_job,
    notify,
    other_sessions,
    wait_until,
)

THREAD_NAME = "belay-results"


# -- helpers -----------------------------------------------------------------------------


def finished(conn: Conn, result: bytes | None) -> int:
    return insert_job(conn, state="succeeded", attempt=1, result=result, finished_at=START)


def listener_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD_NAME}


@pytest.fixture
def new_listener_threads() -> Any:
    """Listener threads started since the test began (others' leftovers don't count)."""
    before = listener_threads()
    return lambda: listener_threads() - before


class Waiter:
    """``client.await_result`` on a thread of its own; ``outcome()`` joins it."""

    def __init__(self, client: belay.Belay, job_id: int, timeout: float = 10) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        #: Set when await_result has returned or raised.
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(client, job_id, timeout))
        self.thread.start()

    def _run(self, client: belay.Belay, job_id: int, timeout: float) -> None:
        try:
            self.value = client.await_result(job_id, timeout=timeout)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def outcome(self) -> Any:
        self.thread.join(15)
        assert not self.thread.is_alive(), "await_result never returned"
        if self.error is not None:
            raise self.error
        return self.value


class Reads:
    """Counts a client's ``get_job`` calls: a waiter's reads of its job."""

    def __init__(self, client: belay.Belay, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._changed = threading.Condition()
        real = client.get_job

        def get_job(job_id: int, **kwargs: Any) -> Any:
            found = real(job_id, **kwargs)
            with self._changed:
                self.count += 1
                self._changed.notify_all()
            return found

        monkeypatch.setattr(client, "get_job", get_job)

    def wait_for(self, count: int, timeout: float = 15) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.count >= count, timeout), (
                f"{self.count} read(s) of the job, not {count}")


# -- finished jobs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [{"answer": 42, "items": [1, "two", None]}, [1, 2.5, True], "text", 7, 2**64 - 1, False,
     2**70, {"n": -(2**63) - 1}],
    ids=repr,
)
def test_a_succeeded_job_returns_its_decoded_json_result(client, sql_conn, value) -> None:
    job = finished(sql_conn, json.dumps(value).encode())
    result = client.await_result(job, timeout=5)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize("result", [None, b"null"], ids=["sql-null", "json-null"])
def test_a_succeeded_job_without_a_value_returns_none(client, sql_conn, result) -> None:
    assert client.await_result(finished(sql_conn, result), timeout=5) is None


def same(actual: Any, expected: Any) -> bool:
    """Equality that also insists on types (True is not 1, (1,) is not [1], -0.0 is not 0.0)."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, float):
        return struct.pack(">d", actual) == struct.pack(">d", expected)
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(same, actual, expected))
    if isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            same(actual[k], v) for k, v in expected.items()
        )
    return bool(actual == expected)


def test_a_result_written_by_the_elixir_reference_decodes(client, sql_conn) -> None:
    """§2: first byte 131 ⇒ Erlang External Term Format; vectors made by Erlang/OTP itself."""
    if not VECTORS_PATH.exists():
        pytest.skip("no ETF vectors (tests/fixtures/etf/vectors.json)")
    vectors = json.loads(VECTORS_PATH.read_text("ascii"))
    good = [v for v in vectors if v["expected"] != {"error": True}]
    bad = [v for v in vectors if v["expected"] == {"error": True}]
    assert good and bad
    jobs = {v["name"]: finished(sql_conn, bytes.fromhex(v["etf_hex"])) for v in vectors}

    for vector in good:
        actual = client.await_result(jobs[vector["name"]], timeout=5)
        assert same(actual, from_expected(vector["expected"])), vector["name"]
    # A foreign value belay cannot decode comes back opaque, never as an error.
    for vector in bad:
        actual = client.await_result(jobs[vector["name"]], timeout=5)
        assert isinstance(actual, belay.Opaque), vector["name"]
        assert actual.data == bytes.fromhex(vector["etf_hex"])


def test_a_result_that_is_not_json_comes_back_opaque(client, sql_conn) -> None:
    job = finished(sql_conn, b"\xff\xfenot json")
    actual = client.await_result(job, timeout=5)
    assert isinstance(actual, belay.Opaque)
    assert actual.data == b"\xff\xfenot json"


def test_a_failed_job_raises_job_failed_carrying_its_errors(client, sql_conn) -> None:
    errors = [{"error": "boom", "attempt": 1}, {"error": "still boom", "attempt": 2}]
    job = insert_job(sql_conn, kind="reports.Build", state="failed", attempt=2, errors=errors)

    with pytest.raises(belay.JobFailed) as caught:
        client.await_result(job, timeout=5)

    assert caught.value.job.id == job
    assert caught.value.job.errors == errors
    assert f"job {job}" in str(caught.value)
    assert "still boom" in str(caught.value)


def test_a_cancelled_job_raises_job_cancelled(client, sql_conn) -> None:
    job = insert_job(sql_conn, state="cancelled", errors=[{"reason": "cancel"}])
    with pytest.raises(belay.JobCancelled) as caught:
        client.await_result(job, timeout=5)
    assert caught.value.job.id == job
    assert f"job {job}" in str(caught.value)


def test_a_missing_job_raises_job_not_found(client) -> None:
    with pytest.raises(belay.JobNotFound) as caught:
        client.await_result(987654, timeout=5)
    assert caught.value.job_id == 987654


@pytest.mark.parametrize("job_id", ["1", 1.5, None])
def test_a_job_id_must_be_an_integer(client, job_id) -> None:
    with pytest.raises(belay.ValidationError):
        client.await_result(job_id, timeout=1)


@pytest.mark.parametrize("state", ["ready", "running", "awaiting", "held"])
def test_an_unfinished_job_times_out(client, sql_conn, state) -> None:
    """The one inherent real wait: a timeout of 0.2 s."""
    job = insert_job(sql_conn, state=state)
    started = time.monotonic()

    with pytest.raises(TimeoutError, match=f"job {job} is still {state}"):
        client.await_result(job, timeout=0.2)

    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 3


def test_a_zero_timeout_reads_once(client, sql_conn) -> None:
    done = finished(sql_conn, b"1")
    pending = insert_job(sql_conn, state="ready")
    assert client.await_result(done, timeout=0) == 1
    with pytest.raises(TimeoutError):
        client.await_result(pending, timeout=0)


# -- finishing while someone waits ---------------------------------------------------------------


def finish_with_sql(conn: Conn, job_id: int, result: bytes, *, notify_result: bool) -> None:
    """What a worker's ack does: the terminal write and (optionally) the result
    notification in one transaction (§9.2)."""
    with conn.transaction():
        conn.execute(
            "UPDATE belay_jobs SET state = 'succeeded', result = %s, finished_at = %s, "
            "lease_until = NULL, leased_by = NULL WHERE id = %s",
            (result, START, job_id),
        )
        if notify_result:
            notify(conn, json.dumps({"t": "r", "id": job_id}))


@pytest.mark.parametrize("notify_result", [True, False], ids=["notified", "polled"])
def test_a_job_finishing_during_the_wait_returns_its_result(
    client, db_url, sql_conn, monkeypatch, notify_result
) -> None:
    job = insert_job(sql_conn, state="running", attempt=1)
    listener = client._result_listener()
    dispatched: list[dict[str, object]] = []
    on_message = listener._on_message

    def recording(message: dict[str, object]) -> None:
        dispatched.append(message)
        on_message(message)

    monkeypatch.setattr(listener, "_on_message", recording)
    waiter = Waiter(client, job)
    assert listener.listening.wait(5)
    # The waiter registers with the listener before its first read of the job.
    wait_until(lambda: job in listener._waiters, "the waiter watches the job")

    with psycopg.connect(db_url) as conn:
        finish_with_sql(conn, job, b'{"done": true}', notify_result=notify_result)

    assert waiter.outcome() == {"done": True}
    assert job not in listener._waiters  # unwatched on the way out
    # The notification (when sent) reached the listener; polling alone covers the rest.
    if notify_result:
        wait_until(lambda: dispatched, "the listener dispatches the notification")
        assert dispatched == [{"t": "r", "id": job}]
    else:
        assert dispatched == []


@pytest.mark.parametrize("result", [b'{"done": true}', None, b'"' + b"x" * 4000 + b'"'],
                         ids=["small", "none", "large"])
def test_await_result_returns_the_row_not_what_a_batched_ack_notification_carries(
    client, db_url, sql_conn, monkeypatch, result
) -> None:
    """The batched ack's notification (§9.2) may carry the job's result; it
    only wakes the waiter, which returns the row's (issue 38: anyone may
    pg_notify). To tell the two apart, the row's result is overwritten in the
    ack's own transaction, after the notification was queued with the acked one."""
    job = insert_job(sql_conn, state="running", attempt=1, leased_by="node-a")
    listener = client._result_listener()
    assert listener.listening.wait(5)
    reads = Reads(client, monkeypatch)
    # No polling between reads: only the notification ends the wait.
    monkeypatch.setattr(belay.client, "_bounded", lambda interval, deadline: 30.0)
    waiter = Waiter(client, job)
    reads.wait_for(1)  # its first read saw the job running
    claimed = belay.Job.from_row(
        {"id": job, "kind": "k", "queue": "default", "state": "running", "attempt": 1})
    with psycopg.connect(db_url, autocommit=True) as conn, conn.transaction():
        assert belay.store.ack_succeeded_many(conn, [(claimed, result)], START,
                                              channel_for(conn.info.dbname)) == {job}
        conn.execute("UPDATE belay_jobs SET result = %s WHERE id = %s", (b'"the row"', job))
    assert waiter.outcome() == "the row"
    assert reads.count == 2


def test_a_forged_result_notification_only_wakes_the_waiter(
    client, sql_conn, stranger_url, monkeypatch
) -> None:
    """Issue 38: pg_notify needs no privilege, so a role refused SELECT on
    belay_jobs can send a result notification saying a ready job succeeded
    with any value. It only wakes the waiter: the waiter reads the row, sees
    the job still ready and waits on; when the job really finishes, the
    row's result is what comes back."""
    reg = belay.Registry()

    @belay.worker(name="t.audit", registry=reg)
    def audit(ctx: belay.Context) -> dict[str, Any]:
        return {"verified": False, "amount": 3}

    job = client.enqueue("t.audit").id  # no worker runs: it stays ready
    listener = client._result_listener()
    assert listener is not None and listener.listening.wait(5)
    reads = Reads(client, monkeypatch)
    # No polling between reads: only a notification ends a pause, so each
    # read after the first is the answer to one.
    monkeypatch.setattr(belay.client, "_bounded", lambda interval, deadline: 30.0)
    waiter = Waiter(client, job, timeout=60)
    reads.wait_for(1)  # watching, and the job read ready once

    forge_result(stranger_url, job)

    wait_until(lambda: reads.count >= 2 or waiter.done.is_set(),
               "the waiter answers the forged wake-up", timeout=15)
    assert not waiter.done.is_set(), (
        f"await_result ended on a forged notification: {waiter.value!r} {waiter.error!r}")
    assert client.get_job(job).state == "ready"  # type: ignore[union-attr]
    # Now for real: a worker runs it and its ack notifies.
    drained = belay.Worker(["default"], client=client, registry=reg, notify=True).drain()
    assert drained == {"succeeded": 1}
    assert waiter.outcome() == {"verified": False, "amount": 3} != FORGED_RESULT


def test_a_notification_that_says_less_falls_back_to_the_row(client, db_url, sql_conn) -> None:
    """A result notification without the state (another SDK's, or a failed
    job's) only wakes the waiter, which reads the row."""
    job = insert_job(sql_conn, state="running", attempt=1)
    waiter = Waiter(client, job)
    with psycopg.connect(db_url) as conn, conn.transaction():
        conn.execute("UPDATE belay_jobs SET state = 'succeeded', result = %s WHERE id = %s",
                     (b'"from the row"', job))
        notify(conn, json.dumps({"t": "r", "id": job, "s": "succeeded", "v": "!!not base64"}))
    assert waiter.outcome() == "from the row"


def test_a_job_failing_during_the_wait_raises_job_failed(client, db_url, sql_conn) -> None:
    job = insert_job(sql_conn, state="running", attempt=1)
    waiter = Waiter(client, job)
    with psycopg.connect(db_url) as conn, conn.transaction():
        conn.execute(
            "UPDATE belay_jobs SET state = 'failed', errors = %s WHERE id = %s",
            (Jsonb([{"error": "late", "attempt": 1}]), job),
        )
        notify(conn, json.dumps({"t": "r", "id": job}))
    with pytest.raises(belay.JobFailed, match="late"):
        waiter.outcome()


def test_many_waiters_on_one_job_all_return(client, db_url, sql_conn) -> None:
    job = insert_job(sql_conn, state="running", attempt=1)
    waiters = [Waiter(client, job) for _ in range(5)]
    with psycopg.connect(db_url) as conn:
        finish_with_sql(conn, job, b"[1]", notify_result=True)
    assert [w.outcome() for w in waiters] == [[1]] * 5


def test_a_client_with_notify_off_finds_the_result_by_polling(
    db_url, clock, sql_conn, new_listener_threads
) -> None:
    job = insert_job(sql_conn, state="running", attempt=1)
    with belay.Belay(db_url, clock=clock, notify=False) as quiet:
        assert quiet._result_listener() is None
        waiter = Waiter(quiet, job)
        with psycopg.connect(db_url) as conn:
            finish_with_sql(conn, job, b'"ok"', notify_result=False)
        assert waiter.outcome() == "ok"
    assert new_listener_threads() == set()


# -- the ResultListener itself -------------------------------------------------------------------


@pytest.fixture
def listener(direct_url: str) -> Iterator[ResultListener]:
    """A result listener straight to the server (LISTEN never goes through a pooler)."""
    with psycopg.connect(direct_url) as conn:
        channel = channel_for(conn.info.dbname)
    instance = ResultListener(direct_url, channel)
    instance.start()
    assert instance.listening.wait(5)
    try:
        yield instance
    finally:
        instance.stop()


def settled(listener: ResultListener, conn: Conn) -> None:
    """Return once every notification sent so far has been dispatched.

    One thread dispatches notifications in commit order, so when our sentinel's
    event is set, everything before it has been handled.
    """
    sentinel_id = -int(time.monotonic_ns() % 1_000_000_000) - 1
    event = listener.watch(sentinel_id)
    try:
        notify(conn, json.dumps({"t": "r", "id": sentinel_id}))
        assert event.wait(5), "the sentinel notification was never dispatched"
    finally:
        listener.unwatch(sentinel_id, event)


def test_a_result_notification_sets_the_watchers_event(listener, sql_conn) -> None:
    first, second = listener.watch(7), listener.watch(7)
    other = listener.watch(8)

    notify(sql_conn, '{"t":"r","id":7}')

    assert first.wait(5) and second.wait(5)
    settled(listener, sql_conn)
    assert not other.is_set()


@pytest.mark.parametrize(
    "payload",
    [
        '{"t":"r","id":8}',        # another job
        '{"t":"p","q":"7"}',       # a poke
        '{"t":"p","id":7}',        # a poke, whatever else it carries
        '{"t":"r","id":"7"}',      # an id that is not an integer
        '{"t":"r"}',
        "[7]",
        "not json at all",
        "",
    ],
)
def test_other_notifications_do_not_set_the_event(listener, sql_conn, payload) -> None:
    event = listener.watch(7)
    notify(sql_conn, payload)
    settled(listener, sql_conn)
    assert not event.is_set()
    # …and the listener survived it.
    notify(sql_conn, '{"t":"r","id":7}')
    assert event.wait(5)


def test_unwatch_stops_delivery_to_that_event_only(listener, sql_conn) -> None:
    gone, kept = listener.watch(7), listener.watch(7)
    listener.unwatch(7, gone)
    listener.unwatch(7, gone)  # twice is harmless
    listener.unwatch(99, gone)  # never watched: harmless

    notify(sql_conn, '{"t":"r","id":7}')

    assert kept.wait(5)
    settled(listener, sql_conn)
    assert not gone.is_set()


def test_stop_is_idempotent_and_joins_the_thread(direct_url, sql_conn,
                                                 new_listener_threads) -> None:
    instance = ResultListener(direct_url, channel_for(sql_conn.info.dbname))
    instance.start()
    instance.start()  # a second start is a no-op
    assert instance.listening.wait(5)
    assert len(new_listener_threads()) == 1

    instance.stop()
    assert new_listener_threads() == set()
    assert not instance.listening.is_set()
    instance.stop()
    assert new_listener_threads() == set()


def test_a_stopped_listener_starts_again(direct_url, sql_conn, new_listener_threads) -> None:
    instance = ResultListener(direct_url, channel_for(sql_conn.info.dbname))
    instance.start()
    assert instance.listening.wait(5)
    instance.stop()
    instance.start()
    try:
        assert instance.listening.wait(5)
        event = instance.watch(3)
        notify(sql_conn, '{"t":"r","id":3}')
        assert event.wait(5)
    finally:
        instance.stop()
    assert new_listener_threads() == set()


def test_the_listener_reconnects_after_losing_its_connection(listener, sql_conn) -> None:
    """Any failure (here: the server ends the backend) costs latency, not the listener."""

    def listener_backends() -> list[int]:
        rows = sql_conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE '%LISTEN %' AND pid <> pg_backend_pid()"
        ).fetchall()
        return [r[0] for r in rows]

    def reconnected() -> bool:
        pids = listener_backends()
        return len(pids) == 1 and pids[0] != old

    (old,) = listener_backends()
    sql_conn.execute("SELECT pg_terminate_backend(%s)", (old,))
    wait_until(reconnected, "the listener reconnects", timeout=10)
    assert listener.listening.wait(5)

    event = listener.watch(11)
    notify(sql_conn, '{"t":"r","id":11}')
    assert event.wait(5)


# -- the client owns its listener ----------------------------------------------------------------


def test_close_stops_the_listener_thread(client, new_listener_threads) -> None:
    instance = client
    listener = instance._result_listener()
    assert listener is not None
    assert instance._result_listener() is listener  # one per client
    assert listener.listening.wait(5)
    assert len(new_listener_threads()) == 1

    instance.close()
    assert new_listener_threads() == set()
    instance.close()  # idempotent


def test_await_result_starts_one_listener_lazily(client, sql_conn, new_listener_threads) -> None:
    job = finished(sql_conn, b"1")
    client.await_result(job, timeout=5)
    client.await_result(job, timeout=5)
    assert len(new_listener_threads()) == 1


# -- closing the client (issue 38) ------------------------------------------------------------


@pytest.mark.direct_only
@pytest.mark.parametrize("notify_on", [True, False], ids=["listening", "polling"])
def test_close_ends_the_waits_under_way_and_leaves_no_connection(
    db_url, sql_conn, monkeypatch, notify_on
) -> None:
    """Another thread closes the client while one waits in await_result and
    one follows subscribe_events: both end at once with ClientClosed, later
    calls raise it instead of opening the pool again, and no session of the
    client's outlives it."""
    job = insert_job(sql_conn, state="ready")
    instance = belay.Belay(db_url, notify=notify_on)
    reads = Reads(instance, monkeypatch)
    waiter = Waiter(instance, job, timeout=60)
    followed: list[Any] = []

    def follow() -> None:
        try:
            followed.extend(instance.subscribe_events(job, timeout=60))
        except BaseException as exc:
            followed.append(exc)

    follower = threading.Thread(target=follow)
    follower.start()
    reads.wait_for(2)  # both watch the job and have read it once
    assert other_sessions(sql_conn) != []

    instance.close()

    waiter.thread.join(10)
    follower.join(10)
    assert not waiter.thread.is_alive() and not follower.is_alive(), (
        "a wait outlived close()")
    assert isinstance(waiter.error, belay.ClientClosed), waiter.error
    assert f"closed while waiting for job {job}" in str(waiter.error)
    assert len(followed) == 1 and isinstance(followed[0], belay.ClientClosed), followed
    assert f"closed while waiting for job {job}" in str(followed[0])
    with pytest.raises(belay.ClientClosed, match="was closed"):
        instance.get_job(job)
    with pytest.raises(belay.ClientClosed, match="was closed"):
        instance.await_result(job, timeout=1)
    # A connection of the caller's is not the client's to refuse.
    with psycopg.connect(db_url) as conn:
        assert instance.get_job(job, conn=conn).state == "ready"  # type: ignore[union-attr]
    instance.close()  # still idempotent
    wait_until(lambda: other_sessions(sql_conn) == [], "the client's sessions end",
               timeout=10)
