"""Headroom reserved before it is spent: the storage plans of budget holds.

A check of the budget followed by a spend is two steps, and runs racing each
other — several ``ctx.step``/``astep`` calls of one job in threads or tasks,
two fan-outs sharing a remainder — would each pass the check on the same
headroom. So headroom is *held*: under the job row's lock, a hold is written
only if it fits beside the spend and the other live holds, and the write
that settles it (the step's journal entry, the fan-in's charge-back) drops
it in the same statement. What a hold is, and which are live, is pure
(:mod:`belay.budget`); these plans are the reads and writes, run with
:func:`belay.store.run` inside a transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from belay import budget, names
from belay.codec import dumps
from belay.plans import COUNT, Call, Plan


@dataclass(frozen=True)
class Standing:
    """A job's budget columns (its row locked), and what its live holds keep."""

    spend: dict[str, Any]
    held: budget.Held

    @property
    def promised(self) -> dict[str, Any]:
        """The columns with every live hold counted as spent."""
        return budget.with_held(self.spend, self.held.total)


#: How a reservation went: the hold was written; it does not fit now but
#: would once this run's own steps in flight settle (they may cost less than
#: their ``max_cost``: wait for them, then try again); it does not fit; the
#: run no longer holds the job.
HELD, WAIT, SHORT, LOST = "held", "wait", "short", "lost"


@dataclass(frozen=True)
class Reservation:
    verdict: str
    standing: Standing
    hold: str | None = None


def standing(job_id: int, attempt: int, run: str, *, besides: str | None = None
             ) -> Plan[tuple[Standing, bool] | None]:
    """The job's spend and live holds, its row locked until the transaction
    ends, and whether the run of ``attempt`` still holds it; the dead holds
    of earlier runs are dropped on the way. None when the row is gone."""
    rows: list[dict[str, Any]] = yield Call("lock_budget", {"id": job_id, "attempt": attempt})
    if not rows:
        return None
    spend = rows[0]
    scope = names.job_scope(job_id)
    holds: list[dict[str, Any]] = yield Call("budget_holds", (scope,))
    held = budget.holding(holds, run, besides=besides)
    if held.dead:
        yield Call("drop_budget_holds", (scope, held.dead), COUNT)
    return Standing(spend, held), bool(spend["holds_job"])


def reserve(job_id: int, attempt: int, run: str, step: str, need: tuple[int, int],
            now: datetime) -> Plan[Reservation | None]:
    """Hold ``need`` (micro-dollars, tokens: a step's ``max_cost``) for step
    ``step`` of ``run`` if it fits under the caps beside the spend and every
    live hold. Atomic: run inside a transaction."""
    name = budget.hold_name(run, step)
    found = yield from standing(job_id, attempt, run, besides=name)
    if found is None:
        return None
    now_standing, holds_job = found
    if not holds_job:
        return Reservation(LOST, now_standing)
    if not budget.exceeded(now_standing.promised, need):
        yield from _put(job_id, name, need, now)
        return Reservation(HELD, now_standing, name)
    # Whether it would fit once this run's own steps in flight settle.
    beside_shares = budget.with_held(now_standing.spend, now_standing.held.shares)
    if now_standing.held.steps != (0, 0) and not budget.exceeded(beside_shares, need):
        return Reservation(WAIT, now_standing)
    return Reservation(SHORT, now_standing)


def shares_held(job_id: int) -> Plan[tuple[int, int]]:
    """What a job's fan-outs hold now (its steps' holds die when a run ends:
    what a paused job's wake must leave room for)."""
    holds: list[dict[str, Any]] = yield Call("budget_holds", (names.job_scope(job_id),))
    return budget.holding(holds, None).shares


def share(job_id: int, attempt: int, run: str, fan_out: str, children: int, now: datetime
          ) -> Plan[tuple[int | None, int | None] | None]:
    """An even share per child — (micro-dollars, tokens), None for a unit
    with no cap — of the headroom nothing else holds, and the children's
    total held for fan-out ``fan_out`` until its charge-back (a rerun of the
    same fan-out replaces its hold). Atomic: run inside a transaction."""
    name = budget.share_name(fan_out)
    found = yield from standing(job_id, attempt, run, besides=name)
    if found is None or children <= 0:
        return None
    promised = found[0].promised
    usd = _left(promised, "usd_micros") if promised["budget_usd_micros"] is not None else None
    tokens = _left(promised, "tokens") if promised["budget_tokens"] is not None else None
    each = (None if usd is None else usd // children,
            None if tokens is None else tokens // children)
    total = ((each[0] or 0) * children, (each[1] or 0) * children)
    if total != (0, 0):
        yield from _put(job_id, name, total, now)
    else:
        yield from release(job_id, [name])
    return each


def release(job_id: int, holds: list[str]) -> Plan[None]:
    """Drop holds whose step will not be journaled (it raised)."""
    if holds:
        yield Call("drop_budget_holds", (names.job_scope(job_id), holds), COUNT)


def _put(job_id: int, name: str, amount: tuple[int, int], now: datetime) -> Plan[None]:
    yield Call("put_budget_hold", {"scope": names.job_scope(job_id), "name": name,
                                   "payload": dumps(budget.hold_payload(amount)).decode(),
                                   "now": now}, COUNT)


def _left(promised: dict[str, Any], unit: str) -> int:
    cap: int = promised["budget_usd_micros" if unit == "usd_micros" else "budget_tokens"]
    spent: int = promised["spent_usd_micros" if unit == "usd_micros" else "spent_tokens"]
    return max(cap - spent, 0)
