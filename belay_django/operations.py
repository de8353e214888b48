"""The Django migration operation that applies one of belay's SQL migrations.

Each ``belay_django/migrations/000N_*.py`` holds one :class:`ApplyBelayMigration`
naming a file of ``belay/sql/migrations`` — the same files ``belay migrate``
runs, read through ``importlib.resources``. The operation goes through
:func:`belay.schema.migrate` with that revision as target, so it takes the
same advisory lock, skips what ``belay_meta`` already records (a database
migrated by ``belay migrate`` first makes it a no-op) and records what it
applies in ``belay_meta``, inside the Django migration's transaction.
"""

from __future__ import annotations

from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation
from psycopg.pq import TransactionStatus

from belay import names, schema, store
from belay.sql import QUERIES, Migration, migrations


def belay_migration(file_name: str) -> Migration:
    """The belay migration of that file name (``0001_initial.sql``…)."""
    for migration in migrations():
        if migration.name == file_name:
            return migration
    known = ", ".join(m.name for m in migrations())
    raise ValueError(f"belay has no migration file {file_name!r}; it has {known}")


class ApplyBelayMigration(Operation):
    """Apply belay schema revision ``file_name`` unless ``belay_meta`` has it.

    Runs on the database of ``settings.BELAY['DATABASE']`` only (and where the
    database routers allow ``belay_django``); ``sqlmigrate`` prints the file.
    """

    reduces_to_sql = True
    reversible = False
    atomic = True

    def __init__(self, file_name: str) -> None:
        self.file_name = file_name
        self.migration = belay_migration(file_name)

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return self.__class__.__name__, [self.file_name], {}

    def describe(self) -> str:
        return f"Apply belay schema revision {self.migration.revision} ({self.file_name})"

    @property
    def migration_name_fragment(self) -> str:
        return f"belay_{self.migration.revision:04d}"

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # the tables are belay's, not Django models (the admin's are unmanaged)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        from belay_django import conf

        connection = schema_editor.connection
        if connection.alias != conf.get().database or not router.allow_migrate(
            connection.alias, app_label
        ):
            return
        if schema_editor.collect_sql:  # sqlmigrate: show, don't run
            schema_editor.execute(self.migration.sql)
            schema_editor.execute(QUERIES["meta_record"], (self.migration.revision,))
            return
        connection.ensure_connection()
        raw = connection.connection
        if not raw.autocommit and raw.info.transaction_status == TransactionStatus.IDLE:
            # Open the Django migration's transaction with belay's migration
            # lock, so the DDL and its belay_meta row commit together with the
            # django_migrations row (schema.migrate then nests as a savepoint).
            store.lock(raw, names.MIGRATE_LOCK)
        schema.migrate(raw, target=self.migration.revision)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        raise NotImplementedError("belay's schema migrations are not reversible")
