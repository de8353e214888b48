"""Django connections as belay connections.

:func:`adapt` lets every ``conn=`` take a Django connection wrapper
(``django.db.connections["default"]``); :class:`DjangoBelay` is a client whose
calls without ``conn=`` run on the Django connection of the current thread, so
they join ``transaction.atomic`` (a nested atomic is a savepoint, and so is
belay's part of it) and autocommit outside one, as Django does.

Wake-ups stay ``pg_notify`` inside the caller's transaction: PostgreSQL
delivers them at commit and drops them on rollback, including a savepoint's
rollback, which is exactly the transaction.atomic semantics.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionProxy
from psycopg import conninfo as pg_conninfo

import belay
from belay.client import Belay, Borrowed
from belay.errors import ConfigurationError

#: Keys of Django's connection parameters that are Python-side psycopg options,
#: not libpq settings (they can't go into a conninfo string).
_PYTHON_ONLY = frozenset({"cursor_factory", "context", "prepare_threshold", "row_factory",
                          "autocommit"})


def adapt(obj: Any) -> Borrowed | None:
    """``conn=`` resolver for Django connection wrappers (registered in ``ready()``):
    ``connections[alias]``, or ``django.db.connection`` (a proxy to the default's)."""
    if isinstance(obj, ConnectionProxy):
        obj = connections[obj.alias]
    if not isinstance(obj, BaseDatabaseWrapper):
        return None
    if obj.vendor != "postgresql":
        raise ConfigurationError(
            f"belay needs PostgreSQL, but the Django database {obj.alias!r} is {obj.vendor}: "
            "point settings.BELAY['DATABASE'] (or conn=) at a PostgreSQL alias"
        )
    # As the ORM does: no statements in a transaction Django will roll back.
    obj.validate_no_broken_transaction()
    obj.ensure_connection()
    raw = obj.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigurationError(
            f"belay needs Django's psycopg 3 backend, but the Django database {obj.alias!r} "
            f"is connected with {type(raw).__module__}: pip install 'psycopg[binary]' "
            "(Django >= 4.2 uses psycopg 3 when it is installed) and uninstall psycopg2"
        )
    return Borrowed(raw)


def conninfo_for(alias: str) -> str:
    """A libpq conninfo for the Django database ``alias``, from Django's own
    connection parameters (NAME, USER, PASSWORD, HOST, PORT and OPTIONS such
    as ``sslmode``, ``service`` or ``options``)."""
    if alias not in connections.settings:
        raise ImproperlyConfigured(f"settings.DATABASES has no {alias!r} entry for belay")
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"belay needs PostgreSQL, but DATABASES[{alias!r}] uses "
            f"{wrapper.settings_dict['ENGINE']}: point settings.BELAY['DATABASE'] at a "
            "database with ENGINE 'django.db.backends.postgresql'"
        )
    params = {
        key: str(value)
        for key, value in wrapper.get_connection_params().items()
        if key not in _PYTHON_ONLY and isinstance(value, (str, int)) and not isinstance(
            value, bool)
    }
    try:
        return pg_conninfo.make_conninfo(**params)
    except psycopg.ProgrammingError as exc:
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] does not make a libpq connection string for belay: {exc}"
        ) from None


class DjangoBelay(Belay):
    """A :class:`belay.Belay` on the Django database ``alias``.

    Calls without ``conn=`` run on ``django.db.connections[alias]`` of the
    calling thread, inside its transaction if there is one. The connection
    string of belay's own connections (the result listener of
    ``await_result``, ``migrate()``) follows the alias's settings, so a test
    runner that renames the database to ``test_…`` is followed too.
    """

    def __init__(self, alias: str = "default", **options: Any) -> None:
        self.alias = alias
        options.setdefault("application_name", "belay-django")
        super().__init__(conninfo_for(alias), connection_provider=self._django_connection,
                         **options)

    def _django_connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    @property
    def conninfo(self) -> str:
        return conninfo_for(self.alias)

    @conninfo.setter
    def conninfo(self, value: str) -> None:
        """Ignored: the alias's settings are the source of truth."""


_lock = threading.Lock()
_client: DjangoBelay | None = None


def client() -> DjangoBelay:
    """belay_django's client on ``settings.BELAY['DATABASE']``: the one the
    tasks backend, the admin actions and (unless you configured your own)
    ``belay.enqueue()`` use."""
    global _client
    with _lock:
        if _client is None:
            _client = _build()
        return _client


def install() -> DjangoBelay:
    """(Re)build belay_django's client from the settings, and make it belay's
    module-level default unless one is configured already (an explicit
    ``belay.configure()`` that ran first, in settings.py for example, wins).
    Called by ``ready()``; tests that switch databases call it again."""
    global _client
    instance = _build()
    with _lock:
        previous, _client = _client, instance
    # Only over no default or our own earlier one: a configure() that ran first wins.
    if not belay.set_default(instance, expected=None) and previous is not None:
        belay.set_default(instance, expected=previous)
    if previous is not None:
        previous.close()
    return instance


def _build() -> DjangoBelay:
    from belay_django import conf

    settings = conf.get()
    return DjangoBelay(settings.database, **settings.connection_options)
