"""The belay_django migrations run belay's own SQL files, once each, and agree
with ``belay migrate`` whichever ran first."""

from __future__ import annotations

import importlib
import io

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections
from django.db.migrations.exceptions import IrreversibleError

import belay
from belay import schema
from belay.sql import migrations as belay_migrations
from belay_django.checks import migration_names
from belay_django.operations import ApplyBelayMigration


def meta(url: str) -> list[tuple[int, int]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT version, contract_major FROM belay_meta ORDER BY version").fetchall()


def indexes(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename LIKE 'belay%'").fetchall()
    return {name for (name,) in rows}


def recorded(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT name FROM django_migrations WHERE app = 'belay_django' "
                            "ORDER BY name").fetchall()
    return [name for (name,) in rows]


def migrate(*args: str) -> str:
    out = io.StringIO()
    call_command("migrate", *args, stdout=out, verbosity=1)
    connections.close_all()
    return out.getvalue()


def operations_by_migration() -> dict[str, list[ApplyBelayMigration]]:
    found = {}
    for name in migration_names():
        module = importlib.import_module(f"belay_django.migrations.{name}")
        found[name] = [op for op in module.Migration.operations
                       if isinstance(op, ApplyBelayMigration)]
    return found


def test_every_belay_sql_migration_is_referenced_by_exactly_one_django_migration():
    files = [m.name for m in belay_migrations()]
    by_migration = operations_by_migration()
    referenced = [op.file_name for ops in by_migration.values() for op in ops]
    assert sorted(referenced) == sorted(files)  # each file once, none missing
    # One per Django migration, in the same order, the Django name after the file's.
    assert [len(ops) for ops in by_migration.values()] == [1] * len(files)
    assert list(by_migration) == [f.removesuffix(".sql") for f in files]
    # The operation runs the file's own text: one source of truth.
    for ops, migration in zip(by_migration.values(), belay_migrations(), strict=True):
        assert ops[0].migration.sql == migration.sql
        assert ops[0].migration.revision == migration.revision


def test_an_unknown_file_name_is_refused_at_import(dj):
    with pytest.raises(ValueError, match=r"no migration file '0009_nope\.sql'"):
        ApplyBelayMigration("0009_nope.sql")


def test_migrate_builds_belays_schema_on_an_empty_database(empty_db_url, on_database):
    on_database(empty_db_url)
    out = migrate()
    assert "Applying belay_django.0003_contract_major... OK" in out
    assert "Applying belay_django.0004_state_queue_index... OK" in out
    assert "Applying belay_django.0005_schedules... OK" in out
    assert "Applying belay_django.0006_spend_index... OK" in out
    assert meta(empty_db_url) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert recorded(empty_db_url) == migration_names()
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert schema.check(conn).revision == 6
    # belay migrate afterwards finds nothing to do.
    assert belay.migrate(empty_db_url) == []


def test_migrate_after_belay_migrate_is_a_no_op(db_url, on_database):
    """db_url was migrated by `belay migrate`. Drop an index that revision 1
    creates: had Django re-run that file, the index would be back."""
    assert belay.migrate(db_url) == []
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("DROP INDEX belay_jobs_lease_idx")
    before = indexes(db_url)
    on_database(db_url)
    migrate()
    assert indexes(db_url) == before
    assert meta(db_url) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
    # (nothing recorded twice)
    assert recorded(db_url) == migration_names()


def test_migrate_applies_only_the_revisions_belay_meta_lacks(empty_db_url, on_database):
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert schema.migrate(conn, target=2) == [1, 2]
        conn.execute("DROP INDEX belay_jobs_lease_idx")  # revision 1's: must stay dropped
    on_database(empty_db_url)
    migrate()
    assert meta(empty_db_url) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert "belay_jobs_lease_idx" not in indexes(empty_db_url)
    assert "belay_jobs_claim_order_idx" in indexes(empty_db_url)  # revision 3's
    assert "belay_jobs_state_queue_id_idx" in indexes(empty_db_url)  # revision 4's


def test_migrating_to_a_django_migration_stops_at_its_revision(empty_db_url, on_database):
    on_database(empty_db_url)
    migrate("belay_django", "0002")
    with psycopg.connect(empty_db_url) as conn:
        versions = conn.execute("SELECT version FROM belay_meta ORDER BY version").fetchall()
    assert versions == [(1,), (2,)]  # and no contract_major column yet: that is revision 3
    assert recorded(empty_db_url) == ["0001_initial", "0002_dynamic"]


def test_sqlmigrate_prints_the_sql_file(dj):
    out = io.StringIO()
    call_command("sqlmigrate", "belay_django", "0003", stdout=out)
    text = out.getvalue()
    assert "CREATE INDEX IF NOT EXISTS belay_jobs_claim_order_idx" in text
    assert "INSERT INTO belay_meta (version) VALUES (3)" in text
    assert meta(dj) == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]  # printed, not run


def test_the_models_match_the_migrations(dj):
    out = io.StringIO()
    call_command("makemigrations", "belay_django", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def test_belay_migrations_are_not_reversible(dj):
    with pytest.raises(IrreversibleError):
        migrate("belay_django", "0002")
