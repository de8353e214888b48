"""Where belay's "now" comes from.

Contract §2: every operation takes "now" as a bind parameter. The clock is
injectable so tests travel in time instead of sleeping.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The machine's wall clock (keep it NTP-synced, §2)."""

    def now(self) -> datetime:
        return datetime.now(timezone.utc)


class ManualClock:
    """A clock that moves only when told to: for tests and replays."""

    def __init__(self, start: datetime | None = None) -> None:
        start = start if start is not None else datetime.now(timezone.utc)
        if start.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start time")
        self._now = start.astimezone(timezone.utc)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, **delta: float) -> datetime:
        """Move forward by ``seconds`` (or timedelta keywords); returns the new now."""
        with self._lock:
            self._now += timedelta(seconds=seconds, **delta)
            return self._now

    def set(self, when: datetime) -> None:
        if when.tzinfo is None:
            raise ValueError("ManualClock.set needs a timezone-aware datetime")
        with self._lock:
            self._now = when.astimezone(timezone.utc)
