"""The production profile's jobs: which queue, which kind, which tenant
(standard library only: the peers' drivers import it inside their own
virtualenvs, where belay is not installed)."""

from __future__ import annotations

import random
from typing import Any

TENANTS = 500
#: Queue → local limit, and each queue's share of the jobs.
WEIGHTS = {"q50": 50, "q20": 20, "q10": 10, "q4": 4, "q2": 2}
#: (kind, share, sleep range in ms)
MIX = (("noop", 0.85, (0, 0)), ("sleep", 0.14, (1, 10)), ("sleep", 0.01, (100, 100)))


def job(rng: random.Random) -> dict[str, Any]:
    """One job of the mix: kind, input (tenant, sleep) and queue."""
    queue = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    pick, cumulative = rng.random(), 0.0
    kind, (low, high) = MIX[-1][0], MIX[-1][2]
    for name, share, span in MIX:
        cumulative += share
        if pick < cumulative:
            kind, (low, high) = name, span
            break
    payload: dict[str, Any] = {"tenant": f"t{rng.randrange(TENANTS)}"}
    if kind == "sleep":
        payload["ms"] = rng.randint(low, high)
    return {"kind": kind, "input": payload, "queue": queue}


def backlog(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` jobs of the mix, the same for the same seed."""
    rng = random.Random(seed)
    return [job(rng) for _ in range(count)]


class Poisson:
    """Send times of a Poisson stream of ``rate`` per second from ``start``
    (a monotonic time): a late send goes at once, so :meth:`unsent` counts
    what was due and not sent by a given time."""

    def __init__(self, rate: float, rng: random.Random, start: float) -> None:
        self.rate, self.rng = rate, rng
        self.due = start + rng.expovariate(rate)

    def advance(self) -> None:
        self.due += self.rng.expovariate(self.rate)

    def unsent(self, stopped: float) -> int:
        count = 0
        while self.due < stopped:
            count += 1
            self.advance()
        return count
