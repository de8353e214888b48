"""belay calls in a SQLAlchemy Session's transaction (issue 7).

Rows and wake-ups follow the session: nothing on rollback, the jobs and one
wake-up per queue on commit, and a rolled-back SAVEPOINT takes exactly its own
jobs and wake-ups with it. Most tests run both with belay's session hooks
(``hooked``: wake-ups wait in ``session.info`` for the commit) and without
(``plain``: ``pg_notify`` in the transaction); the outcome must be the same.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, UOWTransaction, scoped_session, sessionmaker

import belay
import belay_sqlalchemy
from belay.job import Job
from tests.helpers import Notifications, count_jobs
from tests.sqlalchemy.conftest import Order

Conn = psycopg.Connection[Any]


def poke(queue: str = "default") -> dict[str, str]:
    return {"t": "p", "q": queue}


def pokes(notes: Notifications) -> list[dict[str, Any]]:
    return sorted(notes.received(), key=lambda n: sorted(n.items()))


def queues(conn: Conn) -> list[str]:
    return [q for (q,) in conn.execute("SELECT queue FROM belay_jobs ORDER BY queue")]


def orders(conn: Conn) -> list[str]:
    return [item for (item,) in conn.execute("SELECT item FROM orders ORDER BY id")]


@pytest.fixture(params=["hooked", "plain"])
def maker(request: pytest.FixtureRequest) -> sessionmaker[Any]:
    made: sessionmaker[Any] = request.getfixturevalue(request.param)
    return made


# -- commit and rollback ---------------------------------------------------------------------


def test_commit_makes_the_job_and_one_wake_up(client, maker, sql_conn, notes) -> None:
    with maker() as session, session.begin():
        session.add(Order(id=1, item="book"))
        session.flush()
        job = client.enqueue("t.charge", {"order_id": 1}, session=session)
        client.enqueue("t.charge", {"order_id": 1, "again": True}, session=session)
        assert count_jobs(sql_conn) == 0  # not committed yet
        assert client.get_job(job.id, conn=session) is not None  # but there inside
    assert count_jobs(sql_conn) == 2
    assert orders(sql_conn) == ["book"]  # the app's row, same transaction
    assert notes.received() == [poke()]  # one queue: one wake-up


@pytest.mark.parametrize("ending", ["exception", "rollback", "close"])
def test_rollback_leaves_no_job_and_no_wake_up(client, maker, sql_conn, notes, ending) -> None:
    session = maker()
    if ending == "exception":
        with pytest.raises(RuntimeError), session.begin():
            session.add(Order(id=1, item="book"))
            client.enqueue("t.charge", {"order_id": 1}, session=session)
            raise RuntimeError("card declined")
    else:
        session.add(Order(id=1, item="book"))
        client.enqueue("t.charge", {"order_id": 1}, session=session)
        if ending == "rollback":
            session.rollback()
        session.close()  # rolls back what is still open
    assert count_jobs(sql_conn) == 0
    assert orders(sql_conn) == []
    assert notes.received() == []
    # The session goes on; its next transaction starts clean.
    with session.begin():
        client.enqueue("t.k", {}, queue="next", session=session)
    assert queues(sql_conn) == ["next"]
    assert notes.received() == [poke("next")]


def test_the_hooks_hold_the_wake_ups_in_session_info_until_commit(client, hooked,
                                                                  notes) -> None:
    with hooked() as session:
        client.enqueue("t.k", session=session)
        client.enqueue("t.k", {}, queue="mail", session=session)
        assert belay_sqlalchemy.pending_wakeups(session) == [
            (notes.channel, b'{"t":"p","q":"default"}'),
            (notes.channel, b'{"t":"p","q":"mail"}'),
        ]
        session.commit()
        assert belay_sqlalchemy.pending_wakeups(session) == []
        # after_commit ran no SQL: that would have begun a new transaction.
        assert not session.in_transaction()
    assert pokes(notes) == [poke(), poke("mail")]


def test_without_the_hooks_wake_ups_are_pg_notify_in_the_transaction(client, plain,
                                                                     notes) -> None:
    with plain() as session:
        client.enqueue("t.k", session=session)
        assert belay_sqlalchemy.pending_wakeups(session) == []
        assert notes.received() == []  # sent, but PostgreSQL delivers on commit only
        session.commit()
    assert notes.received() == [poke()]


def test_the_module_level_enqueue_of_the_issue(db_url, clock, engine, sql_conn, notes,
                                               restore_default) -> None:
    belay.configure(db_url, clock=clock)
    belay_sqlalchemy.install(Session)
    try:
        with Session(engine) as session, session.begin():
            order = Order(id=3, item="lamp")
            session.add(order)
            session.flush()
            belay.enqueue("t.charge", {"order_id": order.id}, session=session)
            assert belay_sqlalchemy.pending_wakeups(session) != []  # every Session hooked
    finally:
        belay_sqlalchemy.uninstall(Session)
    assert [j.input for j in belay.list_jobs()] == [{"order_id": 3}]
    assert notes.received() == [poke()]
    with Session(engine) as session:
        belay.enqueue("t.k", session=session)
        assert belay_sqlalchemy.pending_wakeups(session) == []  # uninstalled
        session.commit()


def test_every_client_call_takes_the_session_as_conn(client, maker, sql_conn, notes) -> None:
    with maker() as session:
        kept = client.enqueue("t.k", session=session)
        dropped = client.enqueue_many([{"kind": "t.k", "queue": "q2"}], session=session)[0]
        members = client.enqueue_workflow(belay.Workflow("wf").add("a", "t.k"), session=session)
        assert client.get_job(kept.id, conn=session).state == "ready"  # type: ignore[union-attr]
        listed = client.list_jobs(conn=session)
        assert {j.id for j in listed} == {kept.id, dropped.id, members["a"].id}
        assert client.cancel_job(dropped.id, conn=session) == "cancelled"
        client.signal("order:1", "paid", {"ok": True}, conn=session)
        assert client.stats(conn=session)["q2"] == {"cancelled": 1}
        session.commit()
    assert (count_jobs(sql_conn), client.get_job(dropped.id).state) == (3, "cancelled")  # type: ignore[union-attr]
    assert pokes(notes) == [{"t": "r", "id": dropped.id}, poke(), poke("q2")]


def test_conn_and_session_together_are_refused(client, plain) -> None:
    with plain() as session, pytest.raises(belay.ValidationError, match="not both"):
        client.enqueue("t.k", conn=session, session=session)


# -- SAVEPOINTs --------------------------------------------------------------------------------


def test_a_rolled_back_savepoint_drops_only_its_own_jobs_and_wake_ups(client, maker, sql_conn,
                                                                     notes) -> None:
    with maker() as session, session.begin():
        client.enqueue("t.k", {}, queue="outer", session=session)
        with pytest.raises(RuntimeError), session.begin_nested():
            client.enqueue("t.k", {}, queue="inner", session=session)
            raise RuntimeError("undo the inner part")
        with session.begin_nested():
            client.enqueue("t.k", {}, queue="kept", session=session)
    assert queues(sql_conn) == ["kept", "outer"]
    assert pokes(notes) == [poke("kept"), poke("outer")]


def test_the_hooks_forget_what_a_rolled_back_savepoint_queued(client, hooked, notes) -> None:
    with hooked() as session:
        client.enqueue("t.k", {}, queue="outer", session=session)
        savepoint = session.begin_nested()
        client.enqueue("t.k", {}, queue="inner", session=session)
        deeper = session.begin_nested()
        client.enqueue("t.k", {}, queue="deeper", session=session)
        deeper.commit()  # sends inner's and deeper's wake-ups, inside the savepoint
        assert belay_sqlalchemy.pending_wakeups(session) == [
            (notes.channel, b'{"t":"p","q":"outer"}')]
        client.enqueue("t.k", {}, queue="late", session=session)
        savepoint.rollback()  # drops late's; outer's waits for the commit
        assert belay_sqlalchemy.pending_wakeups(session) == [
            (notes.channel, b'{"t":"p","q":"outer"}')]
        client.enqueue("t.k", {}, queue="after", session=session)
        session.commit()
    assert pokes(notes) == [poke("after"), poke("outer")]


def test_committing_with_a_savepoint_still_open_wakes_both_levels(client, maker, sql_conn,
                                                                  notes) -> None:
    with maker() as session:
        with session.begin():
            client.enqueue("t.k", {}, queue="outer", session=session)
            session.begin_nested()  # never closed: the commit releases it
            client.enqueue("t.k", {}, queue="inner", session=session)
        assert belay_sqlalchemy.pending_wakeups(session) == []
    assert queues(sql_conn) == ["inner", "outer"]
    assert pokes(notes) == [poke("inner"), poke("outer")]


def test_a_released_savepoint_is_undone_by_the_outer_rollback(client, maker, sql_conn,
                                                              notes) -> None:
    with maker() as session:
        with session.begin_nested():
            client.enqueue("t.k", session=session)
        session.rollback()
    assert count_jobs(sql_conn) == 0
    assert notes.received() == []


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(program=["enqueue", "savepoint", "enqueue", "savepoint", "release", "rollback"],
         commit=True, hooks=True)
@given(
    program=st.lists(st.sampled_from(["enqueue", "savepoint", "release", "rollback"]),
                     max_size=12),
    commit=st.booleans(),
    hooks=st.booleans(),
)
def test_the_wake_ups_are_those_of_the_jobs_that_committed(
    client, hooked, plain, sql_conn, notes, program, commit, hooks
) -> None:
    """Any nesting of SAVEPOINTs released and rolled back, then a commit or a
    rollback: the queues poked are exactly the queues of the committed jobs."""
    sql_conn.execute("DELETE FROM belay_jobs")
    notes.received()
    levels: list[list[str]] = [[]]  # the model: queues enqueued per open level
    savepoints = []
    with (hooked if hooks else plain)() as session:
        for n, op in enumerate(program):
            if op == "enqueue":
                client.enqueue("t.k", {}, queue=f"q{n}", session=session)
                levels[-1].append(f"q{n}")
            elif op == "savepoint":
                savepoints.append(session.begin_nested())
                levels.append([])
            elif op == "release" and savepoints:
                savepoints.pop().commit()
                released = levels.pop()
                levels[-1].extend(released)
            elif op == "rollback" and savepoints:
                savepoints.pop().rollback()
                levels.pop()
        if commit:
            session.commit()
        else:
            session.rollback()
    expected = sorted(q for level in levels for q in level) if commit else []
    assert queues(sql_conn) == expected
    assert sorted(n["q"] for n in notes.received()) == expected


# -- the commit's own flush ------------------------------------------------------------------


def test_a_job_enqueued_by_a_flush_listener_during_commit_is_woken(client, hooked, sql_conn,
                                                                  notes) -> None:
    def charge_new_orders(session: Session, context: UOWTransaction) -> None:
        for obj in session.new:
            if isinstance(obj, Order):
                client.enqueue("t.charge", {"order_id": obj.id}, queue="billing",
                               session=session)

    with hooked() as session:
        event.listen(session, "after_flush", charge_new_orders)
        session.add(Order(id=7, item="desk"))
        session.commit()  # its flush enqueues
    assert queues(sql_conn) == ["billing"]
    assert notes.received() == [poke("billing")]


def test_a_wake_up_queued_after_the_hooks_ran_is_reported(client, hooked, sql_conn, notes,
                                                          caplog) -> None:
    with hooked() as session:
        event.listen(session, "before_commit",
                     lambda s: client.enqueue("t.k", session=s))
        with caplog.at_level(logging.WARNING, logger="belay_sqlalchemy"):
            session.commit()
    assert count_jobs(sql_conn) == 1  # the job is committed; workers find it by polling
    assert notes.received() == []
    assert "were not sent" in caplog.text


# -- what install() takes --------------------------------------------------------------------


def test_a_scoped_session_stands_for_the_session_of_its_thread(client, engine, sql_conn,
                                                              notes) -> None:
    scoped = belay_sqlalchemy.install(scoped_session(sessionmaker(engine)))
    try:
        client.enqueue("t.k", session=scoped)
        assert len(belay_sqlalchemy.pending_wakeups(scoped)) == 1

        def elsewhere() -> None:  # another thread, another session: rolled back
            client.enqueue("t.k", {}, queue="other", session=scoped)
            scoped.rollback()
            scoped.remove()

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        scoped.commit()
    finally:
        scoped.remove()
        belay_sqlalchemy.uninstall(scoped)
    assert queues(sql_conn) == ["default"]
    assert notes.received() == [poke()]


def test_install_on_a_session_class_hooks_its_sessions_only(client, engine, notes) -> None:
    class AppSession(Session):
        pass

    assert belay_sqlalchemy.install(AppSession) is AppSession
    belay_sqlalchemy.install(AppSession)  # idempotent
    try:
        with AppSession(engine) as session:
            client.enqueue("t.k", session=session)
            assert len(belay_sqlalchemy.pending_wakeups(session)) == 1
            session.commit()
        with Session(engine) as other:
            client.enqueue("t.k", session=other)
            assert belay_sqlalchemy.pending_wakeups(other) == []
            other.commit()
    finally:
        belay_sqlalchemy.uninstall(AppSession)
    assert notes.received() == [poke(), poke()]  # one per transaction


def test_install_on_one_session_already_in_a_transaction(client, engine, notes) -> None:
    with Session(engine) as session:
        session.connection()
        belay_sqlalchemy.install(session)
        client.enqueue("t.k", session=session)
        assert len(belay_sqlalchemy.pending_wakeups(session)) == 1
        session.commit()
    assert notes.received() == [poke()]


def test_install_refuses_what_is_not_a_session(engine) -> None:
    for target in (engine, object(), Engine):
        with pytest.raises(belay.ValidationError, match="sessionmaker"):
            belay_sqlalchemy.install(target)


# -- concurrency ----------------------------------------------------------------------------


def test_two_sessions_racing_for_one_unique_key_make_one_holder_and_one_duplicate(
    client, hooked, sql_conn, notes
) -> None:
    barrier = threading.Barrier(2)
    results: list[Job] = []
    errors: list[BaseException] = []

    def enqueue(n: int) -> None:
        try:
            with hooked() as session, session.begin():
                session.add(Order(id=n, item=f"order {n}"))
                session.flush()
                barrier.wait(timeout=10)
                results.append(client.enqueue("t.charge", {"n": n}, unique="customer-9",
                                              session=session))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=enqueue, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert sorted(job.duplicate for job in results) == [False, True]
    assert results[0].id == results[1].id
    assert count_jobs(sql_conn) == 1
    assert orders(sql_conn) == ["order 1", "order 2"]
    assert notes.received() == [poke()]  # the duplicate pokes nobody
