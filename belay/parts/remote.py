"""What workers outside this process report, in belay's terms: HTTP worker
sessions and executors on the socket both end an execution with a success
(a JSON result) or a failure (an error object), decided here the way the
Python worker decides a return or a raise (:mod:`belay.outcome`).

Pure: no I/O. A report that can't be read raises :class:`ReportRefused`,
which each transport answers in its own words (a 400, an ``error`` frame).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import orjson

from belay.job import Job
from belay.outcome import (
    MESSAGE_LIMIT,
    TRACEBACK_LIMIT,
    Outcome,
    decide,
    default_backoff,
    retry_or_fail,
    storable,
)

#: Where a job's per-job options for remote workers live in its meta.
TIMEOUT_META: Final = "$timeout_ms"
BACKOFF_META: Final = "$backoff"
#: The largest ``error`` object a failure may report, JSON-encoded.
MAX_ERROR_BYTES: Final = 16_384
ERROR_KEYS: Final = frozenset({"message", "type", "traceback", "details"})


class ReportRefused(ValueError):
    """A report that can't be recorded: the message says what to send instead."""


def job_backoff(job: Job) -> Callable[[int], float]:
    """The retry delay of ``job``: its own ``$backoff`` (``{"type":
    "exponential", "base_ms", "max_ms"}``, set by an HTTP producer's
    ``backoff`` option) — base_ms doubled per attempt up to max_ms — else
    belay's default backoff."""
    spec = job.meta.get(BACKOFF_META) if isinstance(job.meta, Mapping) else None
    if isinstance(spec, Mapping) and spec.get("type") == "exponential":
        base, top = spec.get("base_ms"), spec.get("max_ms")
        if (isinstance(base, int) and isinstance(top, int) and not isinstance(base, bool)
                and not isinstance(top, bool) and 0 < base <= top):
            return lambda attempt: min(top, base * 2 ** min(max(attempt - 1, 0), 62)) / 1000
    return default_backoff


def timeout_of(job: Job) -> int | None:
    """The job's ``$timeout_ms`` for remote workers, if it has a usable one."""
    value = job.meta.get(TIMEOUT_META) if isinstance(job.meta, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def error_entry(error: Any, attempt: int, *,
                check_details: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """A failure's bounded ``error`` object → a belay ``errors`` entry
    (``{"error": "Type: message", "attempt": n, ...}``, as the Python worker
    writes). ``check_details`` refuses details the transport can't accept."""
    if not isinstance(error, Mapping) or not isinstance(error.get("message"), str):
        raise ReportRefused('a failure needs an error object like {"message": "...", '
                            '"type": "...", "traceback": "...", "details": {...}}')
    unknown = sorted(str(key) for key in set(error) - ERROR_KEYS)
    if unknown:
        raise ReportRefused(f"unknown error field(s) {', '.join(unknown)}; an error takes "
                            f"{', '.join(sorted(ERROR_KEYS))}")
    if check_details is not None:
        check_details(error.get("details"))
    try:
        size = len(orjson.dumps(error))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ReportRefused(f"the error object is not JSON: {exc}") from None
    if size > MAX_ERROR_BYTES:
        raise ReportRefused(f"the error object is larger than {MAX_ERROR_BYTES} bytes as "
                            "JSON; shorten the traceback or details")
    kind, trace = error.get("type"), error.get("traceback")
    if kind is not None and not isinstance(kind, str):
        raise ReportRefused(f"error.type must be a string, got {kind!r}")
    if trace is not None and not isinstance(trace, str):
        raise ReportRefused(f"error.traceback must be a string, got {trace!r}")
    message = error["message"][:MESSAGE_LIMIT]
    entry: dict[str, Any] = {
        "error": storable(f"{kind}: {message}" if kind else message), "attempt": attempt,
    }
    if trace:
        entry["traceback"] = storable(trace[-TRACEBACK_LIMIT:])
    if error.get("details") is not None:
        entry["details"] = error["details"]
    return entry


def reported(job: Job, outcome: str, result: Any, error: Any, now: datetime, *,
             check_details: Callable[[Any], None] | None = None) -> Outcome:
    """What a remote worker's ``success`` (with ``result``) or ``failure``
    (with ``error``) means for the job."""
    if outcome == "success":
        return decide(returned=result, attempt=job.attempt, max_attempts=job.max_attempts,
                      now=now, backoff=job_backoff(job))
    if outcome == "failure":
        entry = error_entry(error, job.attempt, check_details=check_details)
        return retry_or_fail(entry, job.attempt, job.max_attempts, now, job_backoff(job))
    raise ReportRefused(f'outcome must be "success" or "failure", got {outcome!r}')


@dataclass(frozen=True)
class Parked:
    """A ``concluded`` park: the job waits for signal ``name`` in ``scope``."""

    scope: str
    name: str
    deadline: datetime | None


#: The outcomes a ``concluded`` report may carry.
CONCLUDED_KINDS: Final = frozenset({"succeeded", "retry", "failed", "cancelled", "snooze"})


def concluded(message: Mapping[str, Any]) -> Outcome | Parked:
    """Read a ``concluded`` report (belay's extension, sent by its own
    process-pool children): the outcome the child decided, or a park."""
    park = message.get("park")
    if park is not None:
        if not isinstance(park, Mapping) or not all(
                isinstance(park.get(k), str) and park.get(k) for k in ("scope", "name")):
            raise ReportRefused("park is an object with a scope and a name (strings)")
        return Parked(park["scope"], park["name"], _instant(park.get("deadline"), "deadline"))
    outcome = message.get("outcome")
    # isinstance first: a kind that is a list or an object is unhashable.
    if not isinstance(outcome, Mapping) or not isinstance(outcome.get("kind"), str) \
            or outcome["kind"] not in CONCLUDED_KINDS:
        raise ReportRefused("concluded carries an outcome with a kind (one of "
                            f"{', '.join(sorted(CONCLUDED_KINDS))}) or a park")
    kind = outcome["kind"]
    if kind in ("retry", "failed") and not isinstance(outcome.get("error"), Mapping):
        raise ReportRefused(f"a {kind} outcome carries its error (an object)")
    if kind in ("retry", "snooze") and outcome.get("at") is None:
        raise ReportRefused(f"a {kind} outcome carries when the job runs again (at)")
    text = outcome.get("result_json")
    result: bytes | None = None
    if text is not None:
        if not isinstance(text, str):
            raise ReportRefused("outcome.result_json is the result as JSON text, or null")
        result = text.encode("utf-8")
        try:
            orjson.loads(result)
        except orjson.JSONDecodeError:
            raise ReportRefused("outcome.result_json is not JSON") from None
    error = outcome.get("error")
    if error is not None and not isinstance(error, Mapping):
        raise ReportRefused("outcome.error is an object, or null")
    return Outcome(outcome["kind"], result=result,
                   error=None if error is None else dict(error),
                   at=_instant(outcome.get("at"), "at"))


def _instant(value: Any, what: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            found = datetime.fromisoformat(value)
            if found.tzinfo is not None:
                return found
    raise ReportRefused(f"{what} is an ISO 8601 time with its offset, or null")
