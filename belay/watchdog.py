"""The no-progress watchdog, the pure part: its settings, and how a run of
steps that repeat is told from progress.

An agent loop that makes no progress costs money until a budget stops it. The
watchdog stops it sooner, on either sign, each off unless set:

- ``repeats``: the last N steps the run journaled have the same name pattern
  (digits ignored: ``think-3`` and ``think-4`` are both ``think-#``) and the
  same value (a fingerprint of its journaled bytes) — the agent asks the same
  thing and gets the same answer;
- ``stall``: the run, holding its lease, journaled nothing new for that many
  seconds (a hung call, a loop that never reaches a step).

Tripped, the job fails with ``no_progress`` (``on_trip="fail"``, the default),
or parks awaiting steering (``on_trip="pause"``): ``belay.steer_job`` wakes it
and its code reads the guidance with ``ctx.steering()``. Set per job with
``enqueue(..., watchdog={...})`` (kept in ``meta["$watchdog"]``) or for every
job a worker runs with ``Worker(watchdog={...})``; a job's own wins.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from belay.errors import ValidationError

#: Where a job's watchdog settings live in its ``meta``.
WATCHDOG_KEY: Final = "$watchdog"
#: What a tripped watchdog does.
ON_TRIP: Final = ("fail", "pause")
#: The keys ``watchdog=`` takes.
WATCHDOG_KEYS: Final = ("repeats", "stall", "on_trip")
#: The most repeats a watchdog may wait for (it keeps that many steps in memory).
MAX_REPEATS: Final = 1000
#: The longest stall, in seconds (a week).
MAX_STALL: Final = 7 * 86_400.0

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Watchdog:
    """``repeats`` identical steps in a row, or ``stall`` seconds without a new
    step, trip it; ``on_trip`` says what happens then."""

    repeats: int | None = None
    stall: float | None = None
    on_trip: str = "fail"

    @property
    def pauses(self) -> bool:
        return self.on_trip == "pause"

    def to_meta(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"on_trip": self.on_trip}
        if self.repeats is not None:
            entry["repeats"] = self.repeats
        if self.stall is not None:
            entry["stall"] = self.stall
        return entry


def parse_watchdog(value: Any, what: str = "watchdog") -> Watchdog | None:
    """``watchdog=`` of an enqueue or a Worker; None for None. A ValidationError
    naming the fix for a bad one."""
    if value is None:
        return None
    if isinstance(value, Watchdog):
        return value
    example = "{'repeats': 3, 'stall': 600, 'on_trip': 'pause'}"
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} is a dict like {example}, got {value!r}")
    unknown = sorted(set(value) - set(WATCHDOG_KEYS))
    if unknown:
        raise ValidationError(f"unknown {what} key(s) {', '.join(map(repr, unknown))}; use "
                              f"{', '.join(map(repr, WATCHDOG_KEYS))}")
    repeats, stall = value.get("repeats"), value.get("stall")
    on_trip = value.get("on_trip", "fail")
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int)
                                or not 2 <= repeats <= MAX_REPEATS):
        raise ValidationError(f"{what} repeats is the number of identical steps in a row that "
                              f"trips it, from 2 to {MAX_REPEATS}, got {repeats!r}")
    if stall is not None and (isinstance(stall, bool) or not isinstance(stall, (int, float))
                              or not math.isfinite(stall) or not 0 < stall <= MAX_STALL):
        raise ValidationError(f"{what} stall is seconds without a new step, above 0 and at "
                              f"most {MAX_STALL:g}, got {stall!r}")
    if on_trip not in ON_TRIP:
        raise ValidationError(f"{what} on_trip is 'fail' or 'pause' (park until "
                              f"belay.steer_job), got {on_trip!r}")
    if repeats is None and stall is None:
        raise ValidationError(f"{what} needs repeats and/or stall, like {example}")
    return Watchdog(repeats, None if stall is None else float(stall), on_trip)


def watchdog_of(meta: Mapping[str, Any] | None, default: Watchdog | None) -> Watchdog | None:
    """The watchdog that guards a job: its own (``meta["$watchdog"]``), else
    ``default`` (the worker's). An unreadable entry counts as none of its own."""
    entry = None if meta is None else meta.get(WATCHDOG_KEY)
    if entry is None:
        return default
    try:
        return parse_watchdog(entry)
    except ValidationError:
        return default


def pattern(name: str) -> str:
    """A step name with its digits folded: the steps of one loop share it."""
    return _DIGITS.sub("#", name)


def fingerprint(envelope: bytes) -> str:
    return hashlib.blake2b(envelope, digest_size=8).hexdigest()


class Repeats:
    """The last ``limit`` steps a run journaled; :meth:`add` says when they
    are all the same step with the same value (a loop)."""

    def __init__(self, limit: int) -> None:
        self._recent: deque[tuple[str, str, str]] = deque(maxlen=limit)

    def add(self, name: str, envelope: bytes) -> list[str] | None:
        """Record a journaled step; the names of the repeating run when the
        last ``limit`` steps repeat, else None."""
        self._recent.append((pattern(name), fingerprint(envelope), name))
        recent = self._recent
        if len(recent) < (recent.maxlen or 0):
            return None
        first = recent[0][:2]
        if all(item[:2] == first for item in recent):
            return [item[2] for item in recent]
        return None
