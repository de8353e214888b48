"""Schedules: crons with an overlap policy, a catch-up mode and a durable cursor.

A schedule fires like a cron — one job per due minute slot, ``cron_name`` its
name and ``cron_slot`` the occurrence, so the unique slot index makes every
occurrence one row cluster-wide — and adds what a slow job needs:

``overlap`` — what an occurrence does while the previous one (any job of this
schedule not yet succeeded, failed or cancelled) is still going:

- ``skip`` (the default): it is skipped; the cursor moves past it;
- ``queue``: it waits, and runs once the previous one has finished;
- ``allow``: it runs anyway.

``catch_up`` — what happens when several occurrences are due at once (the
scheduler was down, or they waited under ``queue``):

- ``latest`` (the default): only the most recent runs; the others coalesce
  into it;
- ``all``: each runs, oldest first — one at a time under ``skip`` and
  ``queue`` (each waits for the one before it; under ``skip`` the others are
  then skipped while it runs, so use ``queue`` to deliver a backlog), all at
  once under ``allow`` (at most :data:`MAX_PER_ROUND` a round).

The cursor (the last occurrence handled) lives in ``belay_schedules`` and
moves in the transaction that inserts the occurrence's job: restarts, crashes
and several nodes never lose or repeat an occurrence. This module is pure:
the declarations, the plan of one round, and what a status shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from belay import names
from belay.codec import dumps_object
from belay.cron import (
    MINUTE,
    OPTIONS,
    CronExpr,
    check_option_names,
    check_values,
    latest_slot,
    parse,
    slot,
)
from belay.cron import due_slots as _due_slots
from belay.enqueue import kind_of
from belay.errors import ValidationError

OVERLAPS: Final = ("skip", "queue", "allow")
CATCH_UPS: Final = ("latest", "all")
#: The most occurrences one round inserts for one schedule (``allow`` with
#: ``catch_up="all"`` after a long outage); the rest follow in later rounds.
MAX_PER_ROUND: Final = 100
#: The most names one page of ``schedules`` holds, and the default.
MAX_PAGE: Final = 100
DEFAULT_PAGE: Final = 50


@dataclass(frozen=True)
class Declaration:
    """A validated schedule: what ``belay_schedules`` stores of it."""

    name: str
    expression: CronExpr
    kind: str
    input: Mapping[str, Any]
    options: Mapping[str, Any]
    overlap: str = "skip"
    catch_up: str = "latest"
    static: bool = False

    def values(self, now: datetime) -> dict[str, Any]:
        """The ``declare_schedule`` parameters; a new schedule's cursor is the
        minute before ``now``: this minute's occurrence is its first."""
        return {
            "name": self.name, "expression": self.expression.source, "worker": self.kind,
            "input": dumps_object(dict(self.input), what="input").decode(),
            "opts": dumps_object(dict(self.options), what="options").decode(),
            "overlap": self.overlap, "catch_up": self.catch_up, "static": self.static,
            "cursor": slot(now) - MINUTE, "now": now,
        }


def declare(name: Any, expression: Any, worker: Any, input: Any = None, *,
            overlap: Any = "skip", catch_up: Any = "latest", static: bool = False,
            options: Mapping[str, Any] | None = None) -> Declaration:
    """Validate a schedule; raises :class:`belay.ValidationError` saying what to fix."""
    if not isinstance(name, str) or not name.strip():
        raise ValidationError(f"a schedule needs a name (a non-empty string), got {name!r}")
    names.check_text(name, "a schedule name")
    if len(name.encode("utf-8")) > 255:
        raise ValidationError("a schedule name is at most 255 bytes")
    label = f"schedule {name!r}"
    if overlap not in OVERLAPS:
        raise ValidationError(f"{label}: overlap is one of {', '.join(OVERLAPS)}, got "
                              f"{overlap!r}")
    if catch_up not in CATCH_UPS:
        raise ValidationError(f"{label}: catch_up is \"latest\" or \"all\", got {catch_up!r}")
    try:
        expr = parse(expression)
    except ValidationError as exc:
        raise ValidationError(f"{label}: {exc}") from None
    kind = kind_of(worker)[0]
    stored = {key: value for key, value in (options or {}).items() if value is not None}
    check_option_names(label, stored, OPTIONS, ValidationError)
    input_ = {} if input is None else input
    if not isinstance(input_, Mapping):
        raise ValidationError(f"{label}: input is a JSON object (a dict), got "
                              f"{type(input_).__name__}")
    try:
        check_values(kind, input_, stored)
    except ValidationError as exc:
        raise ValidationError(f"{label}: {exc}") from None
    return Declaration(name, expr, kind, dict(input_), stored, overlap, catch_up, static)


# -- One round (pure) --------------------------------------------------------------------


def due(expr: CronExpr, cursor: datetime | None, now: datetime, catch_up: str,
        limit: int = MAX_PER_ROUND) -> list[datetime]:
    """The occurrences due after ``cursor`` up to ``now``, oldest first: all of
    them (at most ``limit``) for ``catch_up="all"``, else just enough to know
    the oldest and the latest."""
    current = slot(now)
    after = current - MINUTE if cursor is None else cursor
    if after >= current:
        return []
    if catch_up == "all":
        return _due_slots(expr, after, current, limit)
    latest = latest_slot(expr, current)
    if latest <= after:
        return []
    oldest = _due_slots(expr, after, current, 1)
    return oldest if oldest == [latest] else [*oldest, latest]


@dataclass(frozen=True)
class Plan:
    """What one round does for one schedule: insert jobs for ``fire`` (oldest
    first) and move the cursor to ``cursor`` (None: leave it)."""

    fire: list[datetime] = field(default_factory=list)
    cursor: datetime | None = None
    #: The occurrences passed over: skipped while busy, or coalesced.
    skipped: int = 0


def plan(overlap: str, catch_up: str, due: list[datetime], busy: bool) -> Plan:
    """The overlap policy and catch-up mode (module docstring) applied to the
    occurrences ``due`` now, the previous occurrence ``busy`` or not."""
    if not due:
        return Plan()
    if overlap == "allow":
        fire = due if catch_up == "all" else due[-1:]
        return Plan(fire, fire[-1], len(due) - len(fire) if catch_up == "latest" else 0)
    if busy:
        if overlap == "skip":
            return Plan([], due[-1], len(due))
        return Plan()  # queue: the due occurrence waits, the cursor stays before it
    if catch_up == "all":
        return Plan(due[:1], due[0])
    return Plan(due[-1:], due[-1], len(due) - 1)


# -- Reads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """A schedule's definition and state, as ``schedule_status`` shows it."""

    name: str
    expression: str
    worker: str
    input: Any
    options: Any
    overlap: str
    catch_up: str
    static: bool
    revision: int
    #: The last occurrence handled (fired, or skipped); None before the first.
    last_due: datetime | None
    #: The next occurrence to handle (it may be in the past: waiting under
    #: ``queue``, or not yet reached by a round); None once cancelled.
    next_due: datetime | None
    #: The job of the oldest occurrence not finished yet, if any.
    active_job_id: int | None
    last_job_id: int | None
    cancelled_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Schedule:
        return cls(
            name=row["name"], expression=row["expression"], worker=row["worker"],
            input=row["input"], options=row["opts"], overlap=row["overlap"],
            catch_up=row["catch_up"], static=row["static"], revision=row["revision"],
            # A new schedule's cursor is the minute before it was made: not a due.
            last_due=row["cursor_slot"] if row["cursor_slot"] is not None
            and row["cursor_slot"] >= slot(row["created_at"]) else None,
            next_due=None if row["cancelled_at"] is not None else next_occurrence(
                row["expression"], row["cursor_slot"], row["created_at"]),
            active_job_id=row.get("active_job_id"), last_job_id=row["last_job_id"],
            cancelled_at=row["cancelled_at"], created_at=row["created_at"],
            updated_at=row["updated_at"])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601 strings)."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            out[key] = value.isoformat() if isinstance(value, datetime) else value
        return out


def next_occurrence(expression: str, cursor: datetime | None, created: datetime
                    ) -> datetime | None:
    try:
        expr = parse(expression)
    except ValidationError:
        return None
    after = cursor if cursor is not None else slot(created) - MINUTE
    found = _due_slots(expr, after, after + 366 * 1440 * MINUTE, 1)
    return found[0] if found else None


@dataclass(frozen=True)
class SchedulePage:
    """One page of ``schedules``: up to ``limit`` by name, and the cursor of the next."""

    schedules: list[Schedule]
    next_cursor: str | None


def page_limit(limit: Any) -> int:
    if limit is None:
        return DEFAULT_PAGE
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValidationError(f"limit is a whole number from 1 to {MAX_PAGE}, got {limit!r}")
    return limit
