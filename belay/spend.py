"""Spend analytics, the pure part: what a question about spend asks, and its answer.

belay keeps what each job spent (``spent_usd_micros``, ``spent_tokens``,
contract §2). A spend report sums it over the jobs enqueued in a time range,
grouped by up to two dimensions:

``kind``, ``queue``
    the job's worker and queue;
``day``, ``hour``
    when the job was enqueued, in UTC (``2026-12-03``, ``2026-12-03T14:00``);
``workflow``, ``parent``
    the job's workflow id, its parent's id;
``tree``
    the id of the job's root ancestor: a fan-out of agents adds up under the
    job that started it;
``meta:<key>``
    the value of one ``meta`` key, such as a customer id.

A job's spend is its own: what ``map_children(budget="share")`` charged back
to a parent from its children is counted once, at the children. The SQL is in
``sql/spend.sql``; the reads are :meth:`belay.client.Belay.spend` and
:meth:`~belay.client.Belay.spend_tree`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from belay import names
from belay.codec import dumps
from belay.errors import ValidationError

#: The dimensions a report groups by (``meta:<key>`` besides).
DIMENSIONS: Final = ("kind", "queue", "day", "hour", "workflow", "parent", "tree")
#: A report's range when none is given: the last seven days.
DEFAULT_SINCE: Final = timedelta(days=7)
#: How many groups a report lists unless told otherwise, and at most.
DEFAULT_LIMIT: Final = 100
MAX_LIMIT: Final = 10_000
#: ``30m``, ``24h``, ``7d``, ``2w``: a span back from now, as the CLI takes it.
_SPAN = re.compile(r"^\s*(\d{1,6})\s*([mhdw])\s*$")
_UNITS: Final = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_span(text: str) -> timedelta:
    """``"7d"`` → seven days; minutes, hours, days or weeks."""
    found = _SPAN.match(text) if isinstance(text, str) else None
    if found is None:
        raise ValidationError(
            f"a span is a number and a unit, m, h, d or w (like 30m, 24h, 7d), got {text!r}"
        )
    return timedelta(**{_UNITS[found.group(2)]: int(found.group(1))})


@dataclass(frozen=True)
class Dimension:
    """One grouping: a name of :data:`DIMENSIONS`, or ``meta`` and its key."""

    name: str
    key: str | None = None

    def __str__(self) -> str:
        return f"meta:{self.key}" if self.name == "meta" else self.name

    @classmethod
    def parse(cls, text: object) -> Dimension:
        if not isinstance(text, str):
            raise ValidationError(f"a dimension is a string, got {type(text).__name__}")
        if text.startswith("meta:"):
            key = names.check_text(text[5:], "a meta key (after 'meta:')")
            return cls("meta", key)
        if text not in DIMENSIONS:
            raise ValidationError(
                f"unknown dimension {text!r}: group spend by {', '.join(DIMENSIONS)} "
                "or meta:<key> (like meta:customer)"
            )
        return cls(text)


def dimensions(by: str | Sequence[str]) -> tuple[Dimension, ...]:
    """``"kind"`` or ``("day", "kind")``: one or two dimensions, checked."""
    given = [by] if isinstance(by, str) else list(by)
    if not 1 <= len(given) <= 2:
        raise ValidationError(
            f"spend groups by one or two dimensions (like 'kind' or ('day', 'kind')), "
            f"got {len(given)}"
        )
    parsed = tuple(Dimension.parse(d) for d in given)
    if len(parsed) == 2 and parsed[0] == parsed[1]:
        raise ValidationError(f"the two dimensions are the same: {parsed[0]}")
    return parsed


@dataclass(frozen=True)
class Query:
    """A checked spend question: its range, dimensions, filters and cap."""

    by: tuple[Dimension, ...]
    since: datetime
    until: datetime
    kind: str | None = None
    queue: str | None = None
    meta: Mapping[str, Any] | None = None
    limit: int = DEFAULT_LIMIT
    #: No ``until`` was given: the range runs to now, a job enqueued this
    #: very moment included.
    to_now: bool = False

    @classmethod
    def of(cls, now: datetime, by: str | Sequence[str] = "kind", *,
           since: datetime | timedelta | None = None, until: datetime | None = None,
           kind: str | None = None, queue: str | None = None,
           meta: Mapping[str, Any] | None = None, limit: int = DEFAULT_LIMIT) -> Query:
        end = now if until is None else _moment(until, "until")
        begin = since if since is not None else DEFAULT_SINCE
        start = end - _span(begin) if isinstance(begin, timedelta) else _moment(begin, "since")
        if start >= end:
            raise ValidationError(f"since ({start.isoformat()}) must be before until "
                                  f"({end.isoformat()})")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise ValidationError(f"limit is an integer from 1 to {MAX_LIMIT}, got {limit!r}")
        if meta is not None and not isinstance(meta, Mapping):
            raise ValidationError(
                f"meta filters by a dict of keys and values (like {{'customer': 'acme'}}), "
                f"got {type(meta).__name__}"
            )
        if meta:
            for key in meta:
                names.check_text(key, "a meta key")
            try:
                dumps(dict(meta))
            except (TypeError, ValueError) as exc:
                raise ValidationError(f"meta filters by JSON values: {exc}") from None
        return cls(dimensions(by), start, end,
                   None if kind is None else names.check_text(kind, "kind"),
                   None if queue is None else names.check_text(queue, "queue"),
                   dict(meta) if meta else None, limit, until is None)

    def params(self) -> dict[str, Any]:
        """The named parameters of the ``spend_by`` statement."""
        first = self.by[0]
        second = self.by[1] if len(self.by) > 1 else None
        return {
            "since": self.since,
            "until": self.until + timedelta(microseconds=1) if self.to_now else self.until,
            "kind": self.kind, "queue": self.queue,
            "meta": None if self.meta is None else dumps(self.meta).decode(),
            "first": first.name, "first_key": first.key,
            "second": None if second is None else second.name,
            "second_key": None if second is None else second.key, "limit": self.limit,
        }


def _moment(value: object, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValidationError(f"{what} is a timezone-aware datetime or a timedelta back "
                              f"from now, got {value!r}")
    return value


def _span(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValidationError(f"since, as a span back from now, must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Spend:
    """Jobs and what they spent: USD (in micro-dollars, exact) and tokens."""

    jobs: int
    usd_micros: int
    tokens: int

    @property
    def usd(self) -> float:
        return self.usd_micros / 1_000_000

    def to_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "usd": self.usd, "usd_micros": self.usd_micros,
                "tokens": self.tokens}


@dataclass(frozen=True)
class SpendRow(Spend):
    """One group of a report: its key (a value per dimension; None where the
    jobs have none, like ``workflow`` of a plain job) and its spend."""

    key: tuple[str | None, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"key": list(self.key)} | super().to_dict()


@dataclass(frozen=True)
class SpendReport:
    """What the jobs enqueued in ``[since, until)`` spent, grouped ``by``.

    ``rows`` are the largest groups first (in time order for ``day`` and
    ``hour``), at most the query's limit; ``total`` and ``groups`` count every
    group, listed or not."""

    by: tuple[str, ...]
    since: datetime
    until: datetime
    rows: list[SpendRow]
    total: Spend
    groups: int

    @classmethod
    def of(cls, query: Query, rows: Sequence[Mapping[str, Any]]) -> SpendReport:
        width = len(query.by)
        listed = [
            SpendRow(int(r["jobs"]), int(r["usd_micros"]), int(r["tokens"]),
                     (r["first_key"], r["second_key"])[:width])
            for r in rows
        ]
        head = rows[0] if rows else {}
        total = Spend(int(head.get("total_jobs") or 0), int(head.get("total_usd_micros") or 0),
                      int(head.get("total_tokens") or 0))
        return cls(tuple(str(d) for d in query.by), query.since, query.until, listed, total,
                   int(head.get("groups") or 0))

    def to_dict(self) -> dict[str, Any]:
        return {"by": list(self.by), "since": self.since.isoformat(),
                "until": self.until.isoformat(), "groups": self.groups,
                "total": self.total.to_dict(), "rows": [r.to_dict() for r in self.rows]}


@dataclass(frozen=True)
class SpendTree:
    """A job and all its descendants: how many, how deep, what they spent,
    in all and per kind (largest first)."""

    job_id: int
    total: Spend
    depth: int
    by_kind: dict[str, Spend] = field(default_factory=dict)

    @classmethod
    def of(cls, job_id: int, rows: Sequence[Mapping[str, Any]]) -> SpendTree:
        by_kind = {r["kind"]: Spend(int(r["jobs"]), int(r["usd_micros"]), int(r["tokens"]))
                   for r in rows}
        total = Spend(sum(s.jobs for s in by_kind.values()),
                      sum(s.usd_micros for s in by_kind.values()),
                      sum(s.tokens for s in by_kind.values()))
        return cls(job_id, total, max((int(r["depth"]) for r in rows), default=0), by_kind)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "depth": self.depth, "total": self.total.to_dict(),
                "by_kind": {k: s.to_dict() for k, s in self.by_kind.items()}}
