"""Helpers for testing code that uses belay.

``drain`` runs every job that is claimable now, synchronously, in the calling
thread, through the same claim/run/ack path a worker uses; ``SimClock`` lets a
test move time (backoff, schedules, leases) instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Iterable

from belay.client import Belay
from belay.clock import ManualClock
from belay.registry import Registry
from belay.runner import Worker

#: A clock that moves only when told to: ``clock.advance(seconds)``.
SimClock = ManualClock


def drain(
    queue: str | Iterable[str] = "default",
    *,
    client: Belay | None = None,
    registry: Registry | None = None,
    max_jobs: int | None = None,
) -> dict[str, int]:
    """Run the claimable jobs of ``queue`` (or several) until none is left.

    Returns counts by outcome, e.g. ``{"succeeded": 3, "retry": 1}``. Jobs
    scheduled in the future (backoff, ``delay``) wait for the client's clock.
    """
    queues = [queue] if isinstance(queue, str) else list(queue)
    worker = Worker(queues, client=client, registry=registry)
    return worker.drain(max_jobs=max_jobs)
