"""The HTTP API's error codes, their statuses and the one error body shape.

Every failure is ``{"error": {"code": …, "message": …}}``: the code is for
programs, the message (which names the fix) for people.
"""

from __future__ import annotations

from typing import Any, Final

#: Every code the API answers with, and its HTTP status (``stale_execution``:
#: a worker's report for an attempt that is no longer its own; ``cross_origin``:
#: a browser's mutation from another origin, :mod:`belay.origin`;
#: ``idempotency_conflict``: a top-up key already used with other amounts).
STATUS: Final = {
    "invalid_request": 400,
    "unauthorized": 401,
    "cross_origin": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "id_conflict": 409,
    "idempotency_conflict": 409,
    "stale_execution": 409,
    "result_not_ready": 409,
    "task_failed": 409,
    "task_cancelled": 409,
    "result_missing": 410,
    "request_timeout": 408,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "internal": 500,
    "unavailable": 503,
    "unknown_outcome": 503,
}


class ApiError(Exception):
    """A refusal with its code; the status comes from :data:`STATUS`."""

    def __init__(self, code: str, message: str, *, headers: dict[str, str] | None = None
                 ) -> None:
        if code not in STATUS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return STATUS[self.code]


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def invalid(message: str) -> ApiError:
    return ApiError("invalid_request", message)
