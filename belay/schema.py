"""Schema migrations and the startup compatibility check (contract §1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from belay import names, plans
from belay.errors import ContractMismatch, SchemaError, SchemaMissing, SchemaOutdated
from belay.sql import QUERIES, migrations

#: The wire-contract major this belay speaks.
CONTRACT_MAJOR = 1
#: The oldest schema revision this belay runs on: 3 brings contract_major and
#: the claim index whose order matches the claim.
MIN_REVISION = 3


def latest_revision() -> int:
    return migrations()[-1].revision


@dataclass(frozen=True)
class SchemaStatus:
    revision: int
    contract_major: int | None

    @property
    def problem(self) -> SchemaError | None:
        """Why belay cannot run on this schema, or None when it can (pure)."""
        if self.revision == 0:
            return SchemaMissing(
                "no belay schema in this database: run `belay migrate --url …` "
                "(or belay.migrate(url))"
            )
        major = self.contract_major if self.contract_major is not None else CONTRACT_MAJOR
        if major > CONTRACT_MAJOR:
            return ContractMismatch(
                f"the database speaks wire-contract major {major}, this belay knows only "
                f"{CONTRACT_MAJOR}: upgrade belay"
            )
        if major < CONTRACT_MAJOR:
            return ContractMismatch(
                f"the database speaks wire-contract major {major}, this belay needs "
                f"{CONTRACT_MAJOR}: migrate the database with a matching belay"
            )
        if self.revision < MIN_REVISION:
            return SchemaOutdated(
                f"schema revision {self.revision} found, belay needs >= {MIN_REVISION}: "
                "run `belay migrate --url …`"
            )
        # Newer revisions within our major are additive (§1) and accepted.
        return None

    def describe(self) -> str:
        major = "unknown" if self.contract_major is None else str(self.contract_major)
        return f"schema revision {self.revision}, contract major {major}"


def read_status(conn: psycopg.Connection[Any]) -> SchemaStatus:
    from belay import store  # store's statements import this module's neighbours

    return SchemaStatus(*store.run(conn, plans.schema_status()))


def check(conn: psycopg.Connection[Any]) -> SchemaStatus:
    """Raise a SchemaError saying what to do when belay can't run on this schema."""
    status = read_status(conn)
    problem = status.problem
    if problem is not None:
        raise problem
    return status


def migrate(conn: psycopg.Connection[Any], target: int | None = None) -> list[int]:
    """Apply pending migrations in one transaction; returns the revisions applied.

    ``target`` stops at that revision (the Django adapter applies one revision
    per Django migration); None applies all. Safe when several processes
    migrate at once: an advisory lock serializes them and the revision is read
    under it, so the second one finds nothing to do. Refuses a database of a
    newer contract major.
    """
    applied: list[int] = []
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(QUERIES["advisory_xact_lock"], (names.MIGRATE_LOCK,))
        cur.execute(QUERIES["meta_create"])
        status = read_status(conn)
        if status.contract_major is not None and status.contract_major > CONTRACT_MAJOR:
            problem = status.problem
            assert problem is not None
            raise problem
        for migration in migrations():
            if migration.revision <= status.revision:
                continue
            if target is not None and migration.revision > target:
                break
            cur.execute(migration.sql)
            cur.execute(QUERIES["meta_record"], (migration.revision,))
            applied.append(migration.revision)
    return applied
