"""belay.enqueue() inside Django: it joins transaction.atomic on Django's connection.

A rollback leaves no job and no wake-up, a commit exactly one of each, a
savepoint's rollback only drops what was enqueued inside it, and outside a
transaction every call autocommits as Django does.
"""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection, connections, transaction
from testapp.models import Note

import belay
from belay_django.adapter import DjangoBelay, adapt
from tests.helpers import Notifications, count_jobs


class Boom(Exception):
    pass


@pytest.fixture
def sql(dj):
    with psycopg.connect(dj, autocommit=True) as conn:
        yield conn


@pytest.fixture
def pokes(dj):
    listener = Notifications(dj)
    try:
        yield listener
    finally:
        listener.close()


def test_the_default_client_is_belay_djangos_on_the_configured_alias(dj):
    instance = belay.default()
    assert isinstance(instance, DjangoBelay)
    assert instance.alias == "default"
    assert instance.connection_provider is not None
    assert instance.connection_provider() is connections["default"]


def test_a_rolled_back_atomic_block_leaves_no_job_and_no_wake_up(dj, sql, pokes):
    with pytest.raises(Boom), transaction.atomic():
        Note.objects.create(text="user row")
        belay.enqueue("t.welcome", {"user": 1})
        raise Boom
    assert count_jobs(sql) == 0
    assert Note.objects.count() == 0
    assert pokes.received() == []


def test_a_committed_atomic_block_leaves_one_job_and_one_wake_up(dj, sql, pokes):
    with transaction.atomic():
        note = Note.objects.create(text="user row")
        job = belay.enqueue("t.welcome", {"note": note.pk}, queue="mailers")
        # Not visible to anyone else before the commit, poke included.
        assert count_jobs(sql) == 0
        assert pokes.received() == []
    assert count_jobs(sql) == 1
    assert belay.get_job(job.id).input == {"note": note.pk}
    assert pokes.received() == [{"t": "p", "q": "mailers"}]


def test_a_savepoint_rollback_drops_only_its_own_job_and_wake_up(dj, sql, pokes):
    with transaction.atomic():
        kept = belay.enqueue("t.kept", queue="a")
        with pytest.raises(Boom), transaction.atomic():  # a savepoint
            belay.enqueue("t.dropped", queue="b")
            raise Boom
        also_kept = belay.enqueue("t.kept_too", queue="c")
    rows = sql.execute("SELECT id, kind FROM belay_jobs ORDER BY id").fetchall()
    assert [kind for _, kind in rows] == ["t.kept", "t.kept_too"]
    assert [job_id for job_id, _ in rows] == [kept.id, also_kept.id]
    assert sorted(p["q"] for p in pokes.received()) == ["a", "c"]


def test_outside_a_transaction_each_call_autocommits(dj, sql, pokes):
    assert connection.get_autocommit()
    belay.enqueue("t.now")
    assert count_jobs(sql) == 1
    assert pokes.received() == [{"t": "p", "q": "default"}]
    assert not connection.in_atomic_block


def test_every_client_call_takes_a_django_connection_as_conn(dj, sql):
    other = belay.Belay(dj)  # a plain client: conn= still joins Django's transaction
    try:
        with transaction.atomic():
            job = other.enqueue("t.k", conn=connection)
            assert other.get_job(job.id, conn=connection) is not None
            assert count_jobs(sql) == 0
            transaction.set_rollback(True)
        assert count_jobs(sql) == 0
        job = other.enqueue("t.k", conn=connections["default"])
        assert other.cancel_job(job.id, conn=connection) == "cancelled"
        assert other.get_job(job.id).state == "cancelled"
    finally:
        other.close()


def test_reads_through_django_keep_belays_types(dj):
    """Django loads jsonb as text and timestamps its own way on its
    connections; belay's reads on them still return dicts and aware datetimes."""
    job = belay.enqueue("t.k", {"a": [1, 2]}, meta={"m": True}, delay=60)
    with transaction.atomic():
        read = belay.get_job(job.id)
        listed = belay.list_jobs(kind="t.k")
    assert read is not None
    assert read.input == {"a": [1, 2]} and read.meta == {"m": True}
    assert read.ready_at == job.ready_at and read.ready_at.tzinfo is not None
    assert listed == [read]


def test_each_thread_uses_its_own_django_connection(dj, sql):
    """Calls run on Django's connection of the calling thread: a thread's
    atomic block is its own."""
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            with transaction.atomic():
                belay.enqueue("t.thread")
                inside.set()
                release.wait(10)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert inside.wait(10)
    belay.enqueue("t.main")  # autocommits on this thread's connection
    assert count_jobs(sql) == 1
    release.set()
    thread.join(10)
    assert not errors
    assert count_jobs(sql) == 2


def test_a_non_postgresql_django_connection_is_refused_with_the_fix(dj):
    from django.db.backends.sqlite3.base import DatabaseWrapper

    sqlite = DatabaseWrapper({
        "ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:", "OPTIONS": {},
        "TIME_ZONE": None, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False, "USER": "", "PASSWORD": "",
        "HOST": "", "PORT": "", "TEST": {},
    }, alias="cache")
    with pytest.raises(belay.ConfigurationError) as caught:
        adapt(sqlite)
    assert "needs PostgreSQL" in str(caught.value) and "'cache'" in str(caught.value)
    assert adapt(object()) is None


def test_belays_own_connections_follow_the_alias_settings(dj, db_url):
    """A test runner renames NAME to the test database after startup; the
    client's connection string (await_result's listener, migrate()) follows."""
    instance = belay.default()
    assert psycopg.conninfo.conninfo_to_dict(instance.conninfo)["dbname"] == \
        psycopg.conninfo.conninfo_to_dict(dj)["dbname"]
    connections.close_all()
    connections["default"].settings_dict["NAME"] = psycopg.conninfo.conninfo_to_dict(
        db_url)["dbname"]
    assert psycopg.conninfo.conninfo_to_dict(instance.conninfo)["dbname"] == \
        psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    assert instance.migrate() == []  # on db_url, already migrated by belay
    job = belay.enqueue("t.k")  # through Django's connection, now to db_url as well
    with psycopg.connect(db_url) as conn:
        assert count_jobs(conn) == 1
    assert belay.get_job(job.id) is not None


def test_a_transaction_django_will_roll_back_is_refused_as_the_orm_refuses_it(dj, sql):
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        with pytest.raises(Boom), transaction.atomic(savepoint=False):
            raise Boom  # no savepoint: the whole block is now marked for rollback
        with pytest.raises(TransactionManagementError):
            belay.enqueue("t.k")
        with pytest.raises(TransactionManagementError):
            Note.objects.count()
    assert count_jobs(sql) == 0


def test_an_explicitly_configured_default_client_is_left_alone(dj, sql):
    from belay_django.adapter import client, install

    forget = belay.default()
    assert isinstance(forget, DjangoBelay)
    mine = belay.configure(dj)  # the project's own choice (closes the one before)
    install()  # what ready() does at startup
    assert belay.default() is mine
    assert isinstance(client(), DjangoBelay) and client() is not mine
    with transaction.atomic():
        belay.enqueue("t.own_pool")  # the project's client: its own pool, committed at once
        client().enqueue("t.django")  # belay_django's: in the atomic block
        assert count_jobs(sql) == 1
        transaction.set_rollback(True)
    assert [k for (k,) in sql.execute("SELECT kind FROM belay_jobs").fetchall()] == [
        "t.own_pool"]
