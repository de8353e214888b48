"""How a run ends, decided without I/O (the ack table of DESIGN.md, contract §7).

A worker function returns a value (succeeded), raises :class:`Cancel` or
:class:`Snooze` (cancelled, snoozed), or raises anything else (retry with
backoff, or failed once the attempts are used up).
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from belay.codec import encode_value
from belay.errors import ValidationError

#: How much of a traceback an error entry keeps (the errors column grows with
#: every attempt; twenty attempts of full tracebacks would bloat every read).
TRACEBACK_LIMIT = 4_000

Backoff = Callable[[int], float]


class Cancel(Exception):
    """Raise in a job to end it cancelled, with ``reason`` recorded."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)
        self.reason = reason


class Snooze(Exception):
    """Raise in a job to run it again after ``seconds``; not counted as an attempt."""

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValidationError(f"Snooze takes seconds >= 0, got {seconds!r}")
        super().__init__(f"snooze {seconds} s")
        self.seconds = float(seconds)


def default_backoff(attempt: int) -> float:
    """The reference's default: 2^min(attempt, 8) seconds plus up to 2 s of jitter."""
    return float(2 ** min(max(attempt, 0), 8)) + random.uniform(0.0, 2.0)


Kind = Literal["succeeded", "retry", "failed", "cancelled", "snooze"]


@dataclass(frozen=True)
class Outcome:
    """What the fenced ack writes: the target state and its columns."""

    kind: Kind
    result: bytes | None = None
    error: dict[str, Any] | None = None
    at: datetime | None = field(default=None)

    @property
    def terminal(self) -> bool:
        return self.kind in ("succeeded", "failed", "cancelled")


def error_entry(exc: BaseException, attempt: int) -> dict[str, Any]:
    """An ``errors`` entry: ``{"error": "Type: message", "attempt": n, "traceback": …}``."""
    entry: dict[str, Any] = {"error": _describe(exc), "attempt": attempt}
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if trace:
        entry["traceback"] = trace[-TRACEBACK_LIMIT:]
    return entry


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def retry_or_fail(
    error: dict[str, Any], attempt: int, max_attempts: int, now: datetime, backoff: Backoff
) -> Outcome:
    """A failed try: retry after the backoff, or fail once the attempts are used up."""
    if attempt >= max_attempts:
        return Outcome("failed", error=error)
    delay = max(0.0, float(backoff(attempt)))
    return Outcome("retry", error=error, at=now + timedelta(seconds=delay))


def decide(
    *,
    returned: Any = None,
    raised: BaseException | None = None,
    attempt: int,
    max_attempts: int,
    now: datetime,
    backoff: Backoff,
) -> Outcome:
    """The outcome of one run from what the function returned or raised."""
    if raised is None:
        try:
            return Outcome("succeeded", result=encode_value(returned, what="the job's result"))
        except ValidationError as exc:
            # A result that can't be stored fails the attempt, not the worker.
            return retry_or_fail(
                {"error": f"bad result: {exc}", "attempt": attempt},
                attempt, max_attempts, now, backoff,
            )
    if isinstance(raised, Cancel):
        return Outcome("cancelled", error={"reason": raised.reason})
    if isinstance(raised, Snooze):
        return Outcome("snooze", at=now + timedelta(seconds=raised.seconds))
    return retry_or_fail(error_entry(raised, attempt), attempt, max_attempts, now, backoff)
