"""belay's migrations as a step of an Alembic history, in a real Alembic
environment (``alembic init``) created for each test.

The belay step must leave the same schema and ``belay_meta`` as ``belay
migrate``, be idempotent either way round, run inside Alembic's transaction,
and refuse the downgrade and offline mode with the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config

import belay
from tests.sqlalchemy.conftest import sa_url

Conn = psycopg.Connection[Any]

REVISION = '''"""{message}"""
from alembic import op
import sqlalchemy as sa

import belay_sqlalchemy.alembic

revision = {revision!r}
down_revision = {down!r}
branch_labels = None
depends_on = None


def upgrade():
{upgrade}


def downgrade():
{downgrade}
'''

ORDERS = '''    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True))'''
BELAY = "    belay_sqlalchemy.alembic.upgrade(op)"


class Env:
    """An ``alembic init`` directory pointed at one database."""

    def __init__(self, root: Path, db_url: str) -> None:
        ini = root / "alembic.ini"
        command.init(Config(str(ini)), str(root / "migrations"))
        self.env_py = root / "migrations" / "env.py"
        # The generated env.py calls logging.config.fileConfig, which disables
        # every logger it does not name: the rest of the suite needs belay's.
        self.edit_env("fileConfig(config.config_file_name)", "pass")
        self.versions = root / "migrations" / "versions"
        self.config = Config(str(ini))
        url = sa_url(db_url).render_as_string(hide_password=False)
        self.config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
        self.head: str | None = None

    def edit_env(self, old: str, new: str) -> None:
        text = self.env_py.read_text()
        assert old in text, f"alembic's env.py template changed: no {old!r}"
        self.env_py.write_text(text.replace(old, new, 1))

    def add(self, message: str, upgrade: str,
            downgrade: str = "    belay_sqlalchemy.alembic.downgrade(op)") -> str:
        revision = f"{len(list(self.versions.glob('*.py'))) + 1:04d}"
        body = REVISION.format(message=message, revision=revision, down=self.head,
                               upgrade=upgrade, downgrade=downgrade)
        (self.versions / f"{revision}_{message.replace(' ', '_')}.py").write_text(body)
        self.head = revision
        return revision

    def upgrade(self, target: str = "head", **options: Any) -> None:
        command.upgrade(self.config, target, **options)


def catalog(url: str) -> dict[str, Any]:
    """The belay tables' columns and indexes, and belay_meta, as PostgreSQL has them."""
    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_name LIKE 'belay%' "
            "ORDER BY table_name, ordinal_position").fetchall()
        indexes = conn.execute(
            "SELECT tablename, indexname, indexdef FROM pg_indexes "
            "WHERE tablename LIKE 'belay%' ORDER BY tablename, indexname").fetchall()
        meta = conn.execute("SELECT * FROM belay_meta ORDER BY version").fetchall()
    return {"columns": columns, "indexes": indexes, "meta": meta}


def alembic_version(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('alembic_version') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return []
        return [v for (v,) in conn.execute("SELECT version_num FROM alembic_version")]


def test_an_alembic_revision_applies_belays_migrations(tmp_path, empty_db_url, db_url) -> None:
    env = Env(tmp_path, empty_db_url)
    env.add("orders", ORDERS, "    op.drop_table('orders')")
    head = env.add("belay", BELAY)
    env.upgrade()
    assert alembic_version(empty_db_url) == [head]
    # The same tables, indexes and belay_meta rows as `belay migrate` made (db_url).
    assert catalog(empty_db_url) == catalog(db_url)
    assert belay.check_schema(empty_db_url).revision >= belay.MIN_REVISION
    with belay.Belay(empty_db_url) as client:
        assert client.enqueue("t.k").id == 1


def test_the_belay_step_is_idempotent_both_ways(tmp_path, empty_db_url, db_url) -> None:
    env = Env(tmp_path, empty_db_url)
    env.add("belay", BELAY)
    env.add("belay again", BELAY)  # what a project adds after upgrading belay
    env.upgrade()
    assert catalog(empty_db_url) == catalog(db_url)
    assert belay.migrate(empty_db_url) == []  # `belay migrate` finds nothing to do
    # And on a database `belay migrate` already did: nothing either.
    before = catalog(db_url)
    other = Env(tmp_path / "other", db_url)
    other.add("belay", BELAY)
    other.upgrade()
    assert catalog(db_url) == before


PER_MIGRATION = ("connection=connection, target_metadata=target_metadata",
                 "connection=connection, target_metadata=target_metadata, "
                 "transaction_per_migration=True")


@pytest.mark.parametrize("per_migration", [False, True])
def test_the_belay_step_runs_inside_alembics_transaction(tmp_path, empty_db_url, db_url,
                                                        per_migration) -> None:
    env = Env(tmp_path, empty_db_url)
    if per_migration:
        env.edit_env(*PER_MIGRATION)
    ok = env.add("orders", ORDERS)
    env.add("belay then fail", BELAY + "\n    raise RuntimeError('a later step failed')")
    with pytest.raises(RuntimeError, match="a later step failed"):
        env.upgrade()
    with pytest.raises(belay.SchemaMissing):  # rolled back with its revision
        belay.check_schema(empty_db_url)
    assert alembic_version(empty_db_url) == ([ok] if per_migration else [])
    (env.versions / "0002_belay_then_fail.py").unlink()
    env.head = ok
    env.add("belay", BELAY)
    env.upgrade()
    assert catalog(empty_db_url) == catalog(db_url)


def test_the_downgrade_is_refused_with_what_to_do(tmp_path, empty_db_url) -> None:
    env = Env(tmp_path, empty_db_url)
    env.add("belay", BELAY)
    env.upgrade()
    with pytest.raises(belay.ConfigurationError, match="no downgrade") as caught:
        command.downgrade(env.config, "base")
    assert "`pass`" in str(caught.value)
    assert belay.check_schema(empty_db_url).revision >= belay.MIN_REVISION  # untouched


def test_offline_mode_is_refused_with_what_to_do(tmp_path, empty_db_url, capsys) -> None:
    env = Env(tmp_path, empty_db_url)
    env.add("belay", BELAY)
    with pytest.raises(belay.ConfigurationError, match="offline") as caught:
        env.upgrade(sql=True)
    assert "belay migrate" in str(caught.value)
