"""A plain SQLAlchemy Connection, the create_savepoint test-fixture pattern, and
the engines belay_sqlalchemy refuses (with the fix in the message)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

import belay
import belay_sqlalchemy
from tests.helpers import count_jobs
from tests.sqlalchemy.conftest import Order, sa_url

Conn = psycopg.Connection[Any]
POKE = {"t": "p", "q": "default"}


# -- a Connection -----------------------------------------------------------------------------


def test_a_connection_of_engine_begin_commits_with_it(client, engine, sql_conn, notes) -> None:
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO orders (id, item) VALUES (1, 'pen')"))
        job = client.enqueue("t.k", conn=connection)
        assert count_jobs(sql_conn) == 0
    assert client.get_job(job.id) is not None
    assert notes.received() == [POKE]
    with pytest.raises(RuntimeError), engine.begin() as connection:
        client.enqueue("t.k", conn=connection)
        raise RuntimeError("rolled back")
    assert count_jobs(sql_conn) == 1
    assert notes.received() == []


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_connection_outside_a_transaction_autobegins(client, engine, sql_conn, notes,
                                                      end) -> None:
    with engine.connect() as connection:
        assert not connection.in_transaction()
        client.enqueue("t.k", conn=connection)
        assert connection.in_transaction()  # as a statement of its own would
        getattr(connection, end)()
    assert count_jobs(sql_conn) == (1 if end == "commit" else 0)
    assert notes.received() == ([POKE] if end == "commit" else [])


def test_an_autocommit_connection_gets_a_transaction_of_belays_own(client, engine, sql_conn,
                                                                  notes) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        client.enqueue("t.k", conn=connection)
        assert count_jobs(sql_conn) == 1  # committed at once
    assert notes.received() == [POKE]


def test_the_engines_json_settings_do_not_reach_belays_values(client, db_url, notes) -> None:
    """SQLAlchemy installs an engine's json_serializer/json_deserializer on its
    psycopg connections; belay reads and writes its own JSON regardless."""
    engine = create_engine(sa_url(db_url), json_serializer=lambda v: '"app"',
                           json_deserializer=lambda s: "app's decoding")
    try:
        with Session(engine) as session:
            job = client.enqueue("t.k", {"n": [1, 2]}, meta={"m": True}, session=session)
            read = client.get_job(job.id, conn=session)
            assert read is not None and (read.input, read.meta) == ({"n": [1, 2]}, {"m": True})
            session.commit()
    finally:
        engine.dispose()
    assert client.get_job(job.id).input == {"n": [1, 2]}  # type: ignore[union-attr]


# -- join_transaction_mode="create_savepoint" (the test-fixture pattern) ---------------------


@pytest.mark.parametrize("hooks", [True, False])
@pytest.mark.parametrize("outer_end", ["rollback", "commit"])
def test_a_session_joining_an_outer_transaction_with_savepoints(
    client, engine, sql_conn, notes, hooks, outer_end
) -> None:
    with engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        if hooks:
            belay_sqlalchemy.install(session)
        session.add(Order(id=1, item="kept"))
        kept = client.enqueue("t.k", session=session)
        session.commit()  # releases the session's SAVEPOINT only
        session.add(Order(id=2, item="dropped"))
        client.enqueue("t.k", {}, queue="dropped", session=session)
        session.rollback()  # back to the SAVEPOINT: the outer transaction goes on
        assert [j.id for j in client.list_jobs(conn=connection)] == [kept.id]
        assert count_jobs(sql_conn) == 0
        assert notes.received() == []
        session.close()
        getattr(outer, outer_end)()
    if outer_end == "commit":
        assert [j.id for j in client.list_jobs()] == [kept.id]
        assert notes.received() == [POKE]
    else:  # the fixture's teardown: nothing happened
        assert count_jobs(sql_conn) == 0
        assert notes.received() == []


# -- refusals -------------------------------------------------------------------------------


def refused(obj: Any) -> str:
    with pytest.raises(belay.ValidationError) as caught:
        belay.Belay("postgresql://nobody@localhost/never-connected").enqueue("t.k", conn=obj)
    return str(caught.value)


def test_sqlite_is_refused_naming_the_supported_dialect() -> None:
    engine = create_engine("sqlite://")
    try:
        with engine.connect() as connection:
            for obj in (Session(engine), sessionmaker(engine)(), connection):
                message = refused(obj)
                assert "postgresql+psycopg" in message and "sqlite+pysqlite" in message
                assert "postgresql+psycopg://user:password@host:port/dbname" in message
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver, module", [
    ("psycopg2", "psycopg2"), ("pg8000", "pg8000"),
])
def test_other_postgresql_drivers_are_refused(db_url, driver, module) -> None:
    pytest.importorskip(module)
    engine = create_engine(sa_url(db_url, f"postgresql+{driver}"))
    try:
        message = refused(Session(engine))
        assert f"postgresql+{driver}" in message and "postgresql+psycopg://" in message
    finally:
        engine.dispose()


def test_asyncio_sessions_are_refused(db_url) -> None:
    asyncio_ext = pytest.importorskip("sqlalchemy.ext.asyncio", exc_type=ImportError)
    engine = asyncio_ext.create_async_engine(sa_url(db_url))
    session = asyncio_ext.AsyncSession(engine)
    for obj in (session, session.sync_session, engine,
                asyncio_ext.async_scoped_session(asyncio_ext.async_sessionmaker(engine),
                                                 scopefunc=lambda: 1)):
        message = refused(obj)
        assert "synchronous" in message and "postgresql+psycopg" in message
    with pytest.raises(belay.ValidationError, match="asyncio sessions are not supported"):
        belay_sqlalchemy.install(asyncio_ext.async_sessionmaker(engine))


def test_an_asyncpg_engine_is_refused(db_url) -> None:
    pytest.importorskip("asyncpg")
    asyncio_ext = pytest.importorskip("sqlalchemy.ext.asyncio", exc_type=ImportError)
    engine = asyncio_ext.create_async_engine(sa_url(db_url, "postgresql+asyncpg"))
    message = refused(asyncio_ext.AsyncSession(engine).sync_session)
    assert "postgresql+asyncpg" in message and "synchronous" in message


def test_an_engine_is_refused_with_what_to_pass_instead(engine: Engine) -> None:
    assert "engine.begin()" in refused(engine)


def test_a_session_without_a_bind_is_refused() -> None:
    assert "Session(engine)" in refused(Session())


def test_other_objects_still_get_the_core_message() -> None:
    message = refused(object())
    assert "psycopg 3 connection" in message and "belay_sqlalchemy" in message


# -- check_schema ----------------------------------------------------------------------------


def test_check_schema_at_startup(db_url, empty_db_url, engine) -> None:
    status = belay_sqlalchemy.check_schema(engine)
    assert status.revision >= belay.MIN_REVISION
    with engine.connect() as connection:
        assert belay_sqlalchemy.check_schema(connection) == status
        assert not connection.in_transaction()
        raw = belay_sqlalchemy.psycopg_connection(connection)
        assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # as found
    empty = create_engine(sa_url(empty_db_url))
    try:
        with pytest.raises(belay.SchemaMissing, match="belay migrate"):
            belay_sqlalchemy.check_schema(empty)
    finally:
        empty.dispose()
    with pytest.raises(belay.ValidationError, match="Engine or a Connection"):
        belay_sqlalchemy.check_schema(Session(engine))  # type: ignore[arg-type]
