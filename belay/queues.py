"""Queue configuration and admission math, without I/O (contract §6, §8.6).

A queue's options, static (``Worker(queues=...)``) or dynamic (a ``belay_queues``
row), parse into a :class:`QueueSpec`:

- ``limit``: this node's concurrency — an integer, or ``{"min": a, "max": b}``
  for an adaptive limit that doubles toward ``max`` while claims come back
  full and halves toward ``min`` while the queue idles;
- ``global_limit``: jobs running at once across every node (with a
  ``partition``: per partition key);
- ``rate``: ``{"allowed", "period", "resource", "estimate"}``, a sliding
  window over bucket ``queue:<q>``, or ``resource:<r>`` shared by every queue
  that names the resource; each claimed job debits ``estimate`` units;
- ``partition``: ``{"input": "tenant_id"}`` (or ``"meta"``), a fair share per key;
- ``paused``: claim nothing (jobs already running finish).

Dynamic rows are stored in the reference's JSON shape (``partition`` as
``[source, key]``), so an Elixir node reads the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from belay import names
from belay.errors import ConfigurationError, ValidationError

#: The local limit of a queue given by name only.
DEFAULT_LIMIT = 10

_KEYS = ("limit", "global_limit", "rate", "partition", "paused")
_RATE_KEYS = ("allowed", "period", "resource", "estimate")
_PARTITION_SOURCES = ("input", "meta")


@dataclass(frozen=True)
class Rate:
    """§6 sliding-window admission: at most ``allowed`` units per ``period`` seconds."""

    allowed: int
    period: int
    resource: str | None = None
    estimate: int = 1

    def bucket(self, queue: str) -> str:
        """§3: ``resource:<name>`` when shared, else ``queue:<queue>``."""
        return f"resource:{self.resource}" if self.resource else f"queue:{queue}"


@dataclass(frozen=True)
class QueueSpec:
    """One queue's effective options on this node."""

    name: str
    limit: int = DEFAULT_LIMIT
    limit_min: int | None = None
    global_limit: int | None = None
    rate: Rate | None = None
    partition: tuple[str, str] | None = None
    paused: bool = False

    @property
    def admitted(self) -> bool:
        """Claims go through admission, serialized on the queue's advisory lock (§6)."""
        return self.global_limit is not None or self.rate is not None or self.partition is not None

    @property
    def adaptive(self) -> bool:
        return self.limit_min is not None

    @property
    def per_key_limit(self) -> int:
        """§6: the partition's per-key cap — the global limit, else the local one."""
        return self.global_limit if self.global_limit is not None else self.limit

    def to_opts(self) -> dict[str, Any]:
        """The JSON options of a ``belay_queues`` row (the reference's shape)."""
        opts: dict[str, Any] = {
            "limit": self.limit if self.limit_min is None
            else {"min": self.limit_min, "max": self.limit},
        }
        if self.global_limit is not None:
            opts["global_limit"] = self.global_limit
        if self.rate is not None:
            rate: dict[str, Any] = {"allowed": self.rate.allowed, "period": self.rate.period,
                                    "estimate": self.rate.estimate}
            if self.rate.resource is not None:
                rate["resource"] = self.rate.resource
            opts["rate"] = rate
        if self.partition is not None:
            opts["partition"] = list(self.partition)
        if self.paused:
            opts["paused"] = True
        return opts


_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _whole(queue: str, label: str, value: Any, *, minimum: int,
           maximum: int = _INT32_MAX) -> int:
    """A whole number in ``minimum..maximum``: the columns and casts that read
    these options are 32-bit (rates 64-bit), and a stored option a worker can't
    cast would break every claim on the queue."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not minimum <= value <= maximum):
        raise ConfigurationError(
            f"queue {queue!r}: {label} is a whole number from {minimum} to {maximum}, "
            f"got {value!r}"
        )
    return value


def parse_spec(name: Any, value: Any) -> QueueSpec:
    """``10`` or ``{"limit": …, "global_limit": …, "rate": …, "partition": …}`` → spec."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a queue name is a non-empty string, got {name!r}")
    try:
        names.check_text(name, "a queue name")
    except ValidationError as exc:
        raise ConfigurationError(str(exc)) from None
    if not isinstance(value, Mapping):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(
                f"queue {name!r}: give a limit (an integer >= 1) or a dict of options "
                f"({', '.join(_KEYS)}), got {value!r}"
            )
        value = {"limit": value}
    unknown = sorted(set(map(str, value)) - set(_KEYS))
    if unknown:
        raise ConfigurationError(
            f"queue {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"use {', '.join(_KEYS)}"
        )
    limit_min, limit = _parse_limit(name, value.get("limit", DEFAULT_LIMIT))
    global_limit = value.get("global_limit")
    if global_limit is not None:
        global_limit = _whole(name, "global_limit", global_limit, minimum=1)
    paused = value.get("paused", False)
    if not isinstance(paused, bool):
        raise ConfigurationError(f"queue {name!r}: paused is true or false, got {paused!r}")
    return QueueSpec(
        name=name, limit=limit, limit_min=limit_min, global_limit=global_limit,
        rate=_parse_rate(name, value.get("rate")),
        partition=_parse_partition(name, value.get("partition")), paused=paused,
    )


def _parse_limit(queue: str, limit: Any) -> tuple[int | None, int]:
    if isinstance(limit, Mapping):
        if set(limit) != {"min", "max"}:
            raise ConfigurationError(
                f"queue {queue!r}: an adaptive limit is {{'min': a, 'max': b}}, got {limit!r}"
            )
        low = _whole(queue, "limit min", limit["min"], minimum=1)
        high = _whole(queue, "limit max", limit["max"], minimum=1)
        if low > high:
            raise ConfigurationError(
                f"queue {queue!r}: the adaptive limit needs min <= max, got {limit!r}"
            )
        return low, high
    return None, _whole(queue, "the limit", limit, minimum=1)


def _parse_rate(queue: str, rate: Any) -> Rate | None:
    if rate is None:
        return None
    if not isinstance(rate, Mapping):
        raise ConfigurationError(
            f"queue {queue!r}: rate is a dict like {{'allowed': 100, 'period': 60}}, got {rate!r}"
        )
    unknown = sorted(set(map(str, rate)) - set(_RATE_KEYS))
    if unknown or "allowed" not in rate or "period" not in rate:
        raise ConfigurationError(
            f"queue {queue!r}: rate takes allowed and period (required), resource and "
            f"estimate; got {dict(rate)!r}"
        )
    allowed = _whole(queue, "rate allowed", rate["allowed"], minimum=1, maximum=_INT64_MAX)
    period = _whole(queue, "rate period (seconds)", rate["period"], minimum=1)
    estimate = _whole(queue, "rate estimate", rate.get("estimate", 1), minimum=1,
                      maximum=_INT64_MAX)
    resource = rate.get("resource")
    if resource is not None and (not isinstance(resource, str) or not resource
                                 or names.text_problem(resource) is not None
                                 or len(resource.encode()) > names.MAX_NAME_BYTES):
        raise ConfigurationError(
            f"queue {queue!r}: rate resource is a non-empty string of at most "
            f"{names.MAX_NAME_BYTES} bytes without NUL or lone surrogates, got {resource!r}"
        )
    if estimate > allowed:
        raise ConfigurationError(
            f"queue {queue!r}: rate estimate {estimate} is more than allowed {allowed}, so no "
            "job could ever be admitted; lower the estimate or raise allowed"
        )
    return Rate(allowed=allowed, period=period, resource=resource, estimate=estimate)


def _parse_partition(queue: str, partition: Any) -> tuple[str, str] | None:
    if partition is None:
        return None
    if isinstance(partition, Mapping) and len(partition) == 1:
        ((source, key),) = partition.items()
    elif isinstance(partition, (list, tuple)) and len(partition) == 2:
        source, key = partition
    else:
        raise ConfigurationError(
            f"queue {queue!r}: partition is {{'input': '<key>'}} or {{'meta': '<key>'}}, "
            f"got {partition!r}"
        )
    if source not in _PARTITION_SOURCES or not isinstance(key, str) or not key:
        raise ConfigurationError(
            f"queue {queue!r}: partition is {{'input': '<key>'}} or {{'meta': '<key>'}}, "
            f"got {partition!r}"
        )
    return str(source), key


def parse_queues(queues: Mapping[str, Any] | Iterable[str]) -> dict[str, QueueSpec]:
    """``{"default": 10, "ai": {...}}`` or ``["default"]`` → ``{name: spec}``."""
    if isinstance(queues, str):
        raise ConfigurationError(f"queues is a dict of name → limit, got the string {queues!r}")
    if isinstance(queues, Mapping):
        parsed = {name: parse_spec(name, value) for name, value in queues.items()}
    else:
        parsed = {name: parse_spec(name, DEFAULT_LIMIT) for name in queues}
    if not parsed:
        raise ConfigurationError("a worker needs at least one queue")
    return parsed


def merge(
    static: Mapping[str, QueueSpec], rows: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, QueueSpec], dict[str, str]]:
    """Static specs with the ``belay_queues`` rows over them (§8.6).

    A row with options replaces the static queue of its name, as on the
    reference. A row holding nothing but ``paused`` (what ``pause_queue``
    writes for a static queue) only pauses: it makes no queue on a node that
    doesn't serve one. Returns the effective specs and, for rows that don't
    parse, the reason — those are skipped (a static spec stays), never fatal.
    """
    effective = dict(static)
    invalid: dict[str, str] = {}
    for name, opts in rows.items():
        if not isinstance(opts, Mapping):
            invalid[name] = f"options are not a JSON object: {opts!r}"
            continue
        base = static.get(name)
        if set(opts) <= {"paused"}:
            if base is not None:
                effective[name] = replace(base, paused=opts.get("paused") is True)
            continue
        try:
            effective[name] = parse_spec(name, {k: v for k, v in opts.items() if v is not None})
        except ConfigurationError as exc:
            invalid[name] = str(exc)
    return effective, invalid


# -- Admission math (§6) -------------------------------------------------------------


def rate_allowance(
    previous: int, current: int, allowed: int, period: int, epoch: int
) -> int:
    """Units still admissible now: ``allowed`` minus the sliding-window use, where the
    previous window counts in proportion to how much of it the window still covers."""
    start = epoch // period * period
    elapsed = (epoch - start) / period
    used = current + _round_half_up(previous * (1.0 - elapsed))
    return max(min(allowed - used, allowed), 0)


def _round_half_up(value: float) -> int:
    # The reference rounds half away from zero; Python's round() would round half to even.
    return math.floor(value + 0.5) if value >= 0 else -math.floor(-value + 0.5)


def rate_admits(demand: int, allowance: int, estimate: int) -> int:
    """How many jobs of ``estimate`` units each fit in ``allowance``."""
    return max(0, min(demand, allowance // max(estimate, 1)))


def adapt_limit(current: int, low: int, high: int, *, claimed: int, demand: int,
                busy: int) -> int:
    """The next adaptive limit: a saturated round (every slot asked for was filled)
    doubles toward ``high``; a round that found nothing while nothing runs halves
    toward ``low``; anything else keeps it."""
    if claimed > 0 and claimed >= demand:
        return min(high, current * 2)
    if claimed == 0 and busy == 0:
        return max(low, current // 2)
    return max(low, min(high, current))
