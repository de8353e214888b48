"""Imported by ``belay worker --import tests.crash_jobs`` in a test: a worker
whose heartbeat dies on its first beat (what a bug in it would do)."""

from __future__ import annotations

import belay
from belay.parts.leases import Leases


class Killed(BaseException):
    """Nothing in the heartbeat's loop catches it."""


def _die(self: Leases) -> float:
    raise Killed("the heartbeat was killed by the test")


Leases.beat = _die  # type: ignore[method-assign]


@belay.worker(name="crash.noop")
def noop(ctx: belay.Context) -> None:
    return None
