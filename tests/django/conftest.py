"""belay_django's tests: the tiny project in tests/django/project, on a real PostgreSQL.

Django is configured once per run from the project's settings module; each
test that asks for ``dj`` gets a fresh database cloned from a template that
``manage.py migrate`` built (Django's tables and belay's, through the
belay_django migrations), and Django's default alias pointed at it. No
pytest-django: its per-test rollback can't show what a commit delivers
(wake-ups, a worker in another process), and belay's tables are not Django's
to flush.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")

from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

import belay
from tests.conftest import _create_database, _drop_database, _fresh

PROJECT = Path(__file__).resolve().parent / "project"


def _configure() -> None:
    if settings.configured:
        return
    sys.path.insert(0, str(PROJECT))
    import django
    import testproject.settings as project

    settings.configure(**{name: getattr(project, name) for name in dir(project)
                          if name.isupper()})
    django.setup()
    # ready() made belay_django's client belay's default; the rest of the
    # suite expects none until it configures one.
    forget_default()


def forget_default() -> None:
    from belay_django import adapter as client_module

    previous = belay.defaults.swap(None)
    with client_module._lock:
        ours, client_module._client = client_module._client, None
    for instance in {id(x): x for x in (previous, ours) if x is not None}.values():
        instance.close()


def use_database(url: str) -> None:
    """Point Django's default alias (and belay_django's client) at ``url``."""
    from django.db import connections

    from belay_django.adapter import install

    params = conninfo_to_dict(url)
    connections.close_all()
    connections["default"].settings_dict.update(
        NAME=params.get("dbname", ""), USER=params.get("user", ""),
        PASSWORD=params.get("password", ""), HOST=params.get("host", ""),
        PORT=str(params.get("port", "")),
    )
    install()


_configure()


@pytest.fixture(scope="session")
def django_template(server_url: str) -> Iterator[str]:
    """A database built by ``manage.py migrate`` alone, as a new project's is."""
    from django.core.management import call_command
    from django.db import connections

    name = f"belay_djtpl_{os.getpid()}"
    _drop_database(server_url, name)
    url = _create_database(server_url, name)
    use_database(url)
    call_command("migrate", verbosity=0)
    connections.close_all()
    forget_default()
    yield name
    _drop_database(server_url, name)


@pytest.fixture
def dj_url(server_url: str, django_template: str) -> Iterator[str]:
    """A fresh database of this test's own, migrated by Django."""
    yield from _fresh(server_url, django_template)


@pytest.fixture
def dj(dj_url: str) -> Iterator[str]:
    """Django (and belay's default client) on this test's database; yields its URL."""
    from django.db import connections

    use_database(dj_url)
    try:
        yield dj_url
    finally:
        connections.close_all()
        forget_default()


@pytest.fixture
def on_database() -> Iterator[Any]:
    """``on_database(url)``: Django on another database of the test's (an empty
    one, one ``belay migrate`` built…)."""
    from django.db import connections

    yield use_database
    connections.close_all()
    forget_default()
