"""How a run ends, decided without I/O (the ack table of DESIGN.md, contract §7).

A worker function returns a value (succeeded), raises :class:`Cancel` or
:class:`Snooze` (cancelled, snoozed), or raises anything else (retry with
backoff, or failed once the attempts are used up).
"""

from __future__ import annotations

import logging
import math
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from belay.codec import encode_value
from belay.context import BudgetExceeded, CancelRequested, Sleep, StepValueRefused
from belay.errors import ValidationError

#: How much of a traceback an error entry keeps (the errors column grows with
#: every attempt; twenty attempts of full tracebacks would bloat every read).
TRACEBACK_LIMIT = 4_000
#: And how much of an exception's message.
MESSAGE_LIMIT = 2_000
#: The longest a retry or snooze may wait: a timestamp must be able to hold it.
MAX_DELAY = 366 * 86_400.0

log = logging.getLogger("belay.worker")

Backoff = Callable[[int], float]


class Cancel(Exception):
    """Raise in a job to end it cancelled, with ``reason`` recorded."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)
        self.reason = reason


class Snooze(Exception):
    """Raise in a job to run it again after ``seconds``; not counted as an attempt."""

    def __init__(self, seconds: float) -> None:
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not 0 <= seconds <= MAX_DELAY
        ):
            raise ValidationError(
                f"Snooze takes seconds from 0 to {MAX_DELAY:g} (a year), got {seconds!r}"
            )
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
    entry: dict[str, Any] = {"error": storable(_describe(exc)), "attempt": attempt}
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if trace:
        entry["traceback"] = storable(trace[-TRACEBACK_LIMIT:])
    return entry


def _describe(exc: BaseException) -> str:
    text = str(exc)[:MESSAGE_LIMIT]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def storable(text: str) -> str:
    """``text`` as jsonb can hold it: NUL written out as ``\\x00``, lone
    surrogates replaced. An error message with either would otherwise make
    every ack of the job fail, and the job be reclaimed forever."""
    return text.replace("\x00", "\\x00").encode("utf-8", "replace").decode("utf-8")


def retry_or_fail(
    error: dict[str, Any], attempt: int, max_attempts: int, now: datetime, backoff: Backoff
) -> Outcome:
    """A failed try: retry after the backoff, or fail once the attempts are used up."""
    if attempt >= max_attempts:
        return Outcome("failed", error=error)
    return Outcome("retry", error=error, at=now + timedelta(seconds=safe_delay(backoff, attempt)))


def safe_delay(backoff: Backoff, attempt: int) -> float:
    """The backoff's answer, or the default's when it raises or answers nonsense:
    a broken backoff must not leave a job unacked."""
    try:
        delay = float(backoff(attempt))
    except Exception:
        log.exception("belay: backoff %r failed for attempt %d; using the default", backoff,
                      attempt)
        return default_backoff(attempt)
    if not math.isfinite(delay) or delay > MAX_DELAY:
        log.error("belay: backoff %r gave %r for attempt %d; using the default", backoff, delay,
                  attempt)
        return default_backoff(attempt)
    return max(0.0, delay)  # a negative delay means "now", not the past


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
        except (ValidationError, RecursionError, MemoryError) as exc:
            # A result that can't be stored fails the attempt, not the worker.
            return retry_or_fail(
                {"error": f"bad result: {exc}", "attempt": attempt},
                attempt, max_attempts, now, backoff,
            )
    if isinstance(raised, BudgetExceeded):
        return Outcome("failed", error=raised.entry)
    if isinstance(raised, StepValueRefused):
        return Outcome("failed", error={"error": f"bad step value: {raised}", "attempt": attempt})
    if isinstance(raised, CancelRequested):
        return Outcome("cancelled", error={"reason": "cancel_requested", "attempt": attempt})
    if isinstance(raised, Cancel):
        return Outcome("cancelled", error={"reason": raised.reason})
    if isinstance(raised, Snooze):
        return Outcome("snooze", at=now + timedelta(seconds=raised.seconds))
    if isinstance(raised, Sleep):
        return Outcome("snooze", at=raised.until)
    return retry_or_fail(error_entry(raised, attempt), attempt, max_attempts, now, backoff)
