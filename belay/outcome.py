"""How a run ends, decided without I/O (docs/contract.md §7, its outcome table).

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

from belay.codec import dumps, encode_value
from belay.context import BudgetExceeded, CancelRequested, Sleep, StepValueRefused
from belay.errors import AuthorityExceeded, NoProgress, ValidationError

#: How much of a traceback an error entry keeps (the errors column grows with
#: every attempt; twenty attempts of full tracebacks would bloat every read).
TRACEBACK_LIMIT = 4_000
#: And how much of an exception's message.
MESSAGE_LIMIT = 2_000
#: The longest a retry or snooze may wait: a timestamp must be able to hold it.
MAX_DELAY = 366 * 86_400.0
#: A job a node can't run (a kind it doesn't know, input it can't decrypt)
#: goes back to its queue for this long, the attempt not counted: for a node
#: that can, or for this one once it is fixed. The Python worker and the HTTP
#: worker sessions both.
RETURN_SNOOZE = 60.0

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


def cancel_requested(attempt: int) -> Outcome:
    """§8.6: an operator's cancel reached this attempt (at a step boundary, a
    lease renewal, or before it started: a job whose cancel was requested
    never starts another attempt)."""
    return Outcome("cancelled", error={"reason": "cancel_requested", "attempt": attempt})


def error_entry(exc: BaseException, attempt: int) -> dict[str, Any]:
    """An ``errors`` entry: ``{"error": "Type: message", "attempt": n, "traceback": …}``.

    Never raises: an exception whose ``__str__``, class name or traceback
    can't be rendered is still described (:func:`describe`), so the attempt
    ends with a recorded error instead of a lease left to lapse."""
    entry: dict[str, Any] = {"error": storable(describe(exc)), "attempt": attempt}
    trace = _traceback(exc)
    if trace:
        entry["traceback"] = storable(trace[-TRACEBACK_LIMIT:])
    return entry


def describe(exc: BaseException) -> str:
    """``"Type: message"`` (``"Type"`` when the message is empty), whatever the
    exception does: a ``__str__`` that raises or returns a non-string gives
    ``"<exception Type: str() raised Other: …>"``. User code runs in ``str()``,
    so anything it raises is caught here — the description of a failure must
    not become a failure of its own."""
    name = type_name(exc)
    try:
        text = _exact(str(exc))
    except BaseException as failure:  # user code: see the docstring
        return f"<exception {name}: str() raised {_plain(failure)}>"
    text = text[:MESSAGE_LIMIT]
    return f"{name}: {text}" if text else name


def safe_repr(value: object) -> str:
    """``repr(value)`` for logs and messages, or a placeholder when it raises."""
    try:
        return _exact(repr(value))[:MESSAGE_LIMIT]
    except BaseException as failure:  # user code
        return f"<{type_name(value)} object: repr() raised {_plain(failure)}>"


def type_name(value: object) -> str:
    """The class's own name; a metaclass can't make reading it raise."""
    name = type.__dict__["__name__"].__get__(type(value))
    return name if type(name) is str else "?"


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or :func:`describe`'s fallback when that raises (user code)."""
    try:
        return _exact(str(exc))[:MESSAGE_LIMIT]
    except BaseException:  # user code: see describe
        return describe(exc)


def _plain(failure: BaseException) -> str:
    """A secondary failure, described one level deep only (its own ``__str__``
    may raise too)."""
    name = type_name(failure)
    try:
        text = _exact(str(failure))[:MESSAGE_LIMIT]
    except BaseException:  # user code
        return f"{name} (whose str() raised too)"
    return f"{name}: {text}" if text else name


def _exact(text: str) -> str:
    # A str subclass may override slicing, replace and encode: work on a plain copy.
    return text if type(text) is str else str.__str__(text)


def _traceback(exc: BaseException) -> str:
    """The formatted traceback; else the bare frames (file, line, function)
    when formatting runs into user code that raises (a chained exception, a
    module loader's ``get_source``); else nothing."""
    try:
        return _exact("".join(traceback.format_exception(exc)))
    except BaseException:  # user code
        pass
    try:
        tb = BaseException.__dict__["__traceback__"].__get__(exc)
        lines = ["Traceback (most recent call last):\n"]
        while tb is not None:
            code = tb.tb_frame.f_code
            lines.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}\n')
            tb = tb.tb_next
        return "".join(lines) + describe(exc) + "\n"
    except BaseException:
        return ""


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
    except BaseException:  # user code: whatever it raises, the ack still happens
        log.exception("belay: backoff %s failed for attempt %d; using the default",
                      safe_repr(backoff), attempt)
        return default_backoff(attempt)
    if not math.isfinite(delay) or delay > MAX_DELAY:
        log.error("belay: backoff %s gave %r for attempt %d; using the default",
                  safe_repr(backoff), delay, attempt)
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
    """The outcome of one run from what the function returned or raised.

    Total: user code runs while the outcome is worked out (the result's
    serialization, the exception's ``__str__``, attributes of a ``Cancel`` or
    ``Snooze`` subclass), and whatever it raises makes the attempt a failure
    with a recorded error — never an exception here, which would skip the ack
    and leave the job ``running`` until its lease lapsed."""
    try:
        outcome = _decide(returned, raised, attempt, max_attempts, now, backoff)
        if outcome.error is not None:
            _check_storable(outcome.error)
        return outcome
    except BaseException as failure:  # user code: see the docstring
        what = "the result" if raised is None else describe(raised)
        error = {"error": storable(f"belay could not record {what}: {describe(failure)}"),
                 "attempt": attempt}
        return retry_or_fail(error, attempt, max_attempts, now, backoff)


def _decide(returned: Any, raised: BaseException | None, attempt: int, max_attempts: int,
            now: datetime, backoff: Backoff) -> Outcome:
    if raised is None:
        try:
            return Outcome("succeeded", result=encode_value(returned, what="the job's result"))
        except BaseException as exc:  # a dict subclass's items(), a float's __repr__ …
            # A result that can't be stored fails the attempt, not the worker.
            message = str(exc) if isinstance(exc, ValidationError) else describe(exc)
            return retry_or_fail(
                {"error": storable(f"bad result: {message}"), "attempt": attempt},
                attempt, max_attempts, now, backoff,
            )
    if isinstance(raised, (BudgetExceeded, NoProgress)):
        return Outcome("failed", error=raised.entry)
    if isinstance(raised, AuthorityExceeded):
        return Outcome("failed", error={"error": storable(f"authority exceeded: {raised}"),
                                        "authority_exceeded": True, "attempt": attempt})
    if isinstance(raised, StepValueRefused):
        return Outcome("failed", error={"error": storable(f"bad step value: {raised}"),
                                        "attempt": attempt})
    if isinstance(raised, CancelRequested):
        return cancel_requested(attempt)
    if isinstance(raised, Cancel):
        reason = raised.reason
        text = _exact(reason) if isinstance(reason, str) else safe_repr(reason)
        return Outcome("cancelled", error={"reason": storable(text[:MESSAGE_LIMIT])})
    if isinstance(raised, Snooze):
        return Outcome("snooze", at=now + timedelta(seconds=raised.seconds))
    if isinstance(raised, Sleep):
        if not isinstance(raised.until, datetime):
            raise ValidationError(f"Sleep.until is not a datetime: {safe_repr(raised.until)}")
        return Outcome("snooze", at=raised.until)
    return retry_or_fail(error_entry(raised, attempt), attempt, max_attempts, now, backoff)


def _check_storable(error: dict[str, Any]) -> None:
    """Refuse an errors entry jsonb can't hold (it would fail the ack itself):
    one not JSON, or with a NUL character."""
    if b"\\u0000" in dumps(error, what="the errors entry"):
        raise ValidationError("the errors entry contains a NUL character, which jsonb refuses")
