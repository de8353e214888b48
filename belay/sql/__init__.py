"""The one home of belay's SQL: named statements and the migration files.

Runtime code asks for statements by name (``QUERIES["get_job"]``); nothing
else in the package assembles SQL text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from typing_extensions import LiteralString

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _literal(text: str) -> LiteralString:
    # The text comes from files shipped inside the package, never from input.
    return cast("LiteralString", text)  # type: ignore[redundant-cast,unused-ignore]


def _parse(text: str) -> dict[str, LiteralString]:
    parts = _NAME.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        statement = body.strip()
        if name in queries:
            raise RuntimeError(f"duplicate query name {name!r} in queries.sql")
        queries[name] = _literal(statement)
    # A macro, not a statement: the column list of every job read.
    columns = " ".join(
        line for line in queries.pop("job_columns").splitlines() if not line.startswith("--")
    )
    return {
        name: _literal(statement.replace("{job_columns}", columns))
        for name, statement in queries.items()
    }


QUERIES: dict[str, LiteralString] = _parse(
    resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
)


@dataclass(frozen=True)
class Migration:
    """One schema revision: its number, file name and DDL."""

    revision: int
    name: str
    sql: LiteralString


def migrations() -> list[Migration]:
    """Every migration file in revision order (``NNNN_name.sql``)."""
    folder = resources.files(__package__).joinpath("migrations")
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append(
                Migration(
                    revision=int(match.group(1)),
                    name=entry.name,
                    sql=_literal(entry.read_text("utf-8")),
                )
            )
    found.sort(key=lambda m: m.revision)
    expected = list(range(1, len(found) + 1))
    if [m.revision for m in found] != expected:
        raise RuntimeError("migration files must be numbered 0001, 0002, … without gaps")
    return found
