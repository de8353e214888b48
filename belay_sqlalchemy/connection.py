"""What a SQLAlchemy Session or Connection stands for as a belay ``conn=``.

belay speaks psycopg 3, so it runs on the psycopg connection under SQLAlchemy's
``postgresql+psycopg`` dialect, inside the transaction SQLAlchemy has open on
it. Other drivers and the asyncio extension are refused with the fix.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.orm import Session, scoped_session

from belay import schema
from belay.client import Borrowed
from belay.errors import ValidationError
from belay_sqlalchemy import hooks

#: The one SQLAlchemy dialect belay runs on: PostgreSQL through psycopg 3.
SUPPORTED_DIALECT = "postgresql+psycopg"

_URL_FORM = "postgresql+psycopg://user:password@host:port/dbname"


def borrow(obj: Any) -> Borrowed | None:
    """The connection adapter belay_sqlalchemy registers: a Borrowed for a
    Session (or the Session a scoped_session holds for this thread) or a
    Connection, None for objects it does not know."""
    if _is_asyncio(obj):
        raise ValidationError(
            f"belay.Belay is the synchronous client and cannot run on a "
            f"{type(obj).__name__}: await belay.aio (belay.aio.AsyncBelay) with it, "
            f"which joins an AsyncSession's transaction on a {SUPPORTED_DIALECT} engine"
        )
    if isinstance(obj, scoped_session):
        obj = obj()
    if isinstance(obj, Session):
        return _from_session(obj)
    if isinstance(obj, Connection):
        return Borrowed(_joined(obj))
    if isinstance(obj, Engine):
        raise ValidationError(
            "conn= takes a Session or a Connection, not an Engine: belay joins a "
            "transaction, so pass the session, or the connection of `with engine.begin() "
            "as connection:`"
        )
    return None


def _from_session(session: Session) -> Borrowed:
    try:
        bind = session.get_bind()
    except UnboundExecutionError:
        raise ValidationError(
            "the Session has no single bind: create it with Session(engine) (or "
            "sessionmaker(engine)); with several binds, pass "
            "conn=session.connection(bind_arguments={'mapper': SomeModel})"
        ) from None
    check_dialect(bind.dialect)
    # Like any statement the session runs: begins its transaction (or, with
    # join_transaction_mode="create_savepoint", its SAVEPOINT) when none is open.
    raw = psycopg_connection(session.connection())
    return Borrowed(raw, hooks.deferrer(session, raw))


def _joined(connection: Connection) -> psycopg.Connection[Any]:
    raw = psycopg_connection(connection)
    if not connection.in_transaction():
        # What SQLAlchemy's autobegin does at a Connection's first statement, so
        # that connection.commit() commits belay's statements too.
        connection.begin()
    return raw


def check_dialect(dialect: Dialect) -> None:
    """Refuse an engine belay cannot run on, saying which one it needs."""
    if dialect.is_async:
        raise ValidationError(
            f"belay.Belay works with synchronous SQLAlchemy only; this engine uses "
            f"the asyncio dialect {dialect.name}+{dialect.driver}. Pass its AsyncSession "
            f"to belay.aio (on a {SUPPORTED_DIALECT} engine), or enqueue from a sync "
            f"Session on a {SUPPORTED_DIALECT} engine ({_URL_FORM})"
        )
    if (dialect.name, dialect.driver) != ("postgresql", "psycopg"):
        raise ValidationError(
            f"belay_sqlalchemy needs the {SUPPORTED_DIALECT} dialect (psycopg 3), this "
            f"engine uses {dialect.name}+{dialect.driver}: create the engine with a URL "
            f"like {_URL_FORM}"
        )


def psycopg_connection(connection: Connection) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under a SQLAlchemy Connection."""
    check_dialect(connection.dialect)
    raw = connection.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise ValidationError(
            f"expected a psycopg 3 connection under the {SUPPORTED_DIALECT} dialect, "
            f"found {type(raw).__name__}"
        )
    return raw


def check_schema(bind: Engine | Connection) -> schema.SchemaStatus:
    """Raise a SchemaError saying what to do unless belay can run on the database
    of this Engine or Connection (call it at application startup)."""
    if isinstance(bind, Engine):
        with bind.connect() as connection:
            return check_schema(connection)
    if not isinstance(bind, Connection):
        raise ValidationError(
            f"check_schema() takes an Engine or a Connection, got {type(bind).__name__}"
        )
    raw = psycopg_connection(bind)
    idle = not raw.autocommit and raw.info.transaction_status == TransactionStatus.IDLE
    try:
        return schema.check(raw)
    finally:
        if idle:
            # Our reads began a transaction SQLAlchemy knows nothing about.
            raw.rollback()


def _is_asyncio(obj: Any) -> bool:
    # By module, not isinstance: sqlalchemy.ext.asyncio needs greenlet to import,
    # and an object of it exists only where it imported.
    return any(cls.__module__.startswith("sqlalchemy.ext.asyncio")
               for cls in type(obj).__mro__)


async def async_borrow(obj: Any) -> psycopg.AsyncConnection[Any] | None:
    """The adapter belay_sqlalchemy registers with :mod:`belay.aio`: the psycopg
    AsyncConnection under an ``AsyncSession`` or ``AsyncConnection``, inside
    the transaction it has open (begun as SQLAlchemy's autobegin would), None
    for objects it does not know."""
    if not _is_asyncio(obj):
        if isinstance(obj, Session | Connection):
            raise ValidationError(
                f"belay.aio runs on asyncio SQLAlchemy (AsyncSession, AsyncConnection); "
                f"this is a synchronous {type(obj).__name__}: use belay.Belay with it")
        return None
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

    if isinstance(obj, async_scoped_session):
        obj = obj()
    if isinstance(obj, AsyncSession):
        # Begins the session's transaction (or its SAVEPOINT) when none is open.
        connection = await obj.connection()
    elif isinstance(obj, AsyncConnection):
        connection = obj
        if not connection.in_transaction():
            await connection.begin()
    else:
        raise ValidationError(
            f"conn= takes an AsyncSession or an AsyncConnection, not a {type(obj).__name__}: "
            "belay joins a transaction, so pass the session, or the connection of "
            "`async with engine.begin() as connection:`")
    dialect = connection.dialect
    if (dialect.name, dialect.driver) != ("postgresql", "psycopg"):
        raise ValidationError(
            f"belay.aio needs the {SUPPORTED_DIALECT} dialect (psycopg 3) on "
            f"create_async_engine, this engine uses {dialect.name}+{dialect.driver}: "
            f"create it with a URL like {_URL_FORM}")
    raw = (await connection.get_raw_connection()).driver_connection
    if not isinstance(raw, psycopg.AsyncConnection):
        raise ValidationError(
            f"expected a psycopg AsyncConnection under the {SUPPORTED_DIALECT} dialect, "
            f"found {type(raw).__name__}")
    return raw
