"""SQLAlchemy fixtures: an engine on the test database, an ORM table, sessions.

Every engine here is ``postgresql+psycopg``, the dialect belay_sqlalchemy
supports; the refusal tests build their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, String, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

import belay_sqlalchemy


class Base(DeclarativeBase):
    pass


class Order(Base):
    """An application table living next to belay's."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))


def sa_url(db_url: str, drivername: str = "postgresql+psycopg") -> URL:
    """The SQLAlchemy URL of a libpq URL or key=value string."""
    params = psycopg.conninfo.conninfo_to_dict(db_url)
    port = params.get("port")
    host = params.get("host")
    # A unix-socket directory (the embedded server's) goes in the query: as the
    # URL's host it would not survive rendering and parsing back.
    socket_dir = host is not None and str(host).startswith("/")
    return URL.create(
        drivername,
        username=params.get("user"),
        password=params.get("password"),
        host=None if socket_dir else host,
        port=int(port) if port else None,
        database=params.get("dbname"),
        query={"host": str(host)} if socket_dir else {},
    )


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(sa_url(db_url))
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def plain(engine: Engine) -> sessionmaker[Any]:
    """Sessions without belay's hooks: wake-ups go as pg_notify in the transaction."""
    return sessionmaker(engine)


@pytest.fixture
def hooked(engine: Engine) -> Iterator[sessionmaker[Any]]:
    """Sessions with belay's hooks: wake-ups wait in session.info for the commit."""
    maker = belay_sqlalchemy.install(sessionmaker(engine))
    yield maker
    belay_sqlalchemy.uninstall(maker)
