"""The one home of belay's SQL: named statements and the migration files.

Runtime code asks for statements by name (``QUERIES["get_job"]``); nothing
else in the package assembles SQL text. Statements are grouped by subject in
the ``*.sql`` files here (``queries.sql`` for the core, one file per feature
beside it); names are unique across all of them.
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


def _parse(files: dict[str, str]) -> dict[str, LiteralString]:
    queries: dict[str, LiteralString] = {}
    for file_name, text in sorted(files.items()):
        parts = _NAME.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"duplicate query name {name!r} (again in {file_name})")
            queries[name] = _literal(body.strip())
    # A macro, not a statement: the column list of every job read.
    columns = " ".join(
        line for line in queries.pop("job_columns").splitlines() if not line.startswith("--")
    )
    return {
        name: _literal(statement.replace("{job_columns}", columns))
        for name, statement in queries.items()
    }


def _statement_files() -> dict[str, str]:
    """Every ``*.sql`` file beside this module (the migrations live in a folder of their own)."""
    return {
        entry.name: entry.read_text("utf-8")
        for entry in resources.files(__package__).iterdir()
        if entry.name.endswith(".sql") and entry.is_file()
    }


QUERIES: dict[str, LiteralString] = _parse(_statement_files())


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
