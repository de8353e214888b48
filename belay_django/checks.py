"""System checks: the settings (always) and belay's schema (database checks).

The schema check reads ``belay_meta`` (revision and contract major) through
:mod:`belay.schema`. Django runs database checks in ``manage.py check
--database``, in ``migrate`` (before it migrates) and in the test runner
(after). A schema that ``migrate`` is about to build or upgrade (the last
belay_django migration is still unapplied) is therefore no problem, as
Django's own unapplied migrations are none; anything ``migrate`` cannot fix
(the migrations are recorded as applied, or the database speaks another
contract major) is an error saying what to run.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Sequence
from typing import Any

import psycopg
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.migrations.recorder import MigrationRecorder

from belay import schema
from belay.errors import ContractMismatch, SchemaError, SchemaMissing

APP = "belay_django"


def register() -> None:
    checks.register(check_settings)
    checks.register(check_schema, checks.Tags.database)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from belay_django import conf

    try:
        settings = conf.get()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="belay_django.E001")]
    wrapper = connections[settings.database]
    if wrapper.vendor != "postgresql":
        return [checks.Error(
            f"belay needs PostgreSQL, but DATABASES[{settings.database!r}] uses "
            f"{wrapper.settings_dict['ENGINE']}",
            hint="point settings.BELAY['DATABASE'] at a database with ENGINE "
                 "'django.db.backends.postgresql'",
            id="belay_django.E002",
        )]
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        return [checks.Error(
            "belay needs Django's psycopg 3 backend, but Django is using psycopg2",
            hint="pip install 'psycopg[binary]' (Django >= 4.2 uses psycopg 3 when it is "
                 "installed) and uninstall psycopg2",
            id="belay_django.E003",
        )]
    return []


def check_schema(
    app_configs: Any = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    from belay_django import conf

    try:
        alias = conf.get().database
    except ImproperlyConfigured:
        return []  # check_settings reports it
    if not databases or alias not in databases or connections[alias].vendor != "postgresql":
        return []
    wrapper = connections[alias]
    try:
        wrapper.ensure_connection()
        status = schema.read_status(wrapper.connection)
    except psycopg.Error as exc:
        return [checks.Error(
            f"cannot read belay's schema in database {alias!r}: {str(exc).strip()}",
            id="belay_django.E011",
        )]
    problem = status.problem
    if problem is None:
        return []
    pending = pending_migrations(alias)
    if pending and pending[-1] == migration_names()[-1] and not isinstance(
            problem, ContractMismatch):
        return []  # `migrate` brings it up to date (and runs this check first)
    return [schema_message(alias, status, problem, pending)]


def schema_message(
    alias: str, status: schema.SchemaStatus, problem: SchemaError, pending: list[str]
) -> checks.CheckMessage:
    """What is wrong with belay's schema and what to run, for a Django project."""
    where = f"belay's schema in database {alias!r}"
    if isinstance(problem, ContractMismatch):
        return checks.Error(f"{where} is unusable: {problem}", id="belay_django.E012",
                            hint="run a belay that speaks the database's contract major")
    if isinstance(problem, SchemaMissing):
        state, detail = "missing", "no belay_meta table"
    else:
        state = "out of date"
        detail = f"{status.describe()}; belay needs revision >= {schema.MIN_REVISION}"
    if pending:
        return checks.Error(
            f"{where} is {state} ({detail}); the belay_django migration(s) "
            f"{', '.join(pending)} are not applied yet",
            hint="run `python manage.py migrate`",
            id="belay_django.E013",
        )
    return checks.Error(
        f"{where} is {state} ({detail}), although every belay_django migration is recorded "
        "as applied (a database restored from an older dump, or migrations run with --fake?)",
        hint="run `python manage.py migrate belay_django zero --fake` and then `python "
             "manage.py migrate belay_django`: each belay migration applies what belay_meta "
             "lacks (or run `belay migrate --url …` on that database)",
        id="belay_django.E010",
    )


def migration_names() -> list[str]:
    """belay_django's Django migrations, by name, in order."""
    from belay_django import migrations

    return sorted(m.name for m in pkgutil.iter_modules(migrations.__path__) if m.name[:4].isdigit())


def pending_migrations(alias: str) -> list[str]:
    """The belay_django migrations ``django_migrations`` of ``alias`` lacks."""
    recorder = MigrationRecorder(connections[alias])
    if not recorder.has_table():
        return migration_names()
    applied = {name for app, name in recorder.applied_migrations() if app == APP}
    return [name for name in migration_names() if name not in applied]
