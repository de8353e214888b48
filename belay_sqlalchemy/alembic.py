"""Alembic helpers: belay's schema migrations as a step of your Alembic history.

An Alembic revision file::

    from alembic import op
    import belay_sqlalchemy.alembic

    def upgrade():
        belay_sqlalchemy.alembic.upgrade(op)

    def downgrade():
        belay_sqlalchemy.alembic.downgrade(op)

``upgrade`` applies the same migration files as ``belay migrate`` (recording
them in ``belay_meta`` the same way), inside Alembic's transaction, and only
those not applied yet: after upgrading belay, a new revision calling it again
brings the schema up to date.
"""

from __future__ import annotations

from typing import Any, NoReturn

from alembic.operations import Operations

from belay import schema
from belay.errors import ConfigurationError
from belay_sqlalchemy.connection import psycopg_connection


def upgrade(op: Operations) -> list[int]:
    """Apply the pending belay migrations on the migration's connection;
    returns the revisions applied (none when the schema is current)."""
    if op.get_context().as_sql:
        raise ConfigurationError(
            "belay's migrations read the schema revision before applying anything, so "
            "they cannot run in Alembic's offline (--sql) mode: run the upgrade online, "
            "or apply them with `belay migrate --url …`"
        )
    conn = psycopg_connection(op.get_bind())
    # psycopg opens the transaction Alembic began at its first statement. Reading
    # first makes sure it is open, so migrate()'s transaction block becomes a
    # SAVEPOINT inside Alembic's transaction, not a transaction committing alone.
    schema.read_status(conn)
    return schema.migrate(conn)


def downgrade(op: Any = None) -> NoReturn:
    """Refuse: belay's migrations only go forward."""
    raise ConfigurationError(
        "belay's schema migrations have no downgrade. To step below this Alembic "
        "revision, make its downgrade() a no-op (`pass`) and leave the belay tables in "
        "place, or drop them by hand if belay is gone for good"
    )


__all__ = ["downgrade", "upgrade"]
