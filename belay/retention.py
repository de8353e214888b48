"""Retention (contract §8.7): what the sweeper deletes, and when.

Terminal jobs go once older than their state's retention, with their steps
and events, in batches; a workflow only as a whole once every member expired,
a child only once its parent expired (the SQL says why). Signals go past their
TTL, rate windows once no claim reads them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import psycopg

from belay import store
from belay.errors import ConfigurationError

log = logging.getLogger("belay.worker")

#: §8.7 defaults (seconds): succeeded jobs a day, failed and cancelled a week.
DEFAULT_RETENTION: dict[str, float | None] = {
    "succeeded": 86_400.0, "failed": 604_800.0, "cancelled": 604_800.0,
}
DEFAULT_SIGNAL_TTL = 7 * 86_400.0
#: A worker runs a retention pass this often while it keeps up. A pass deletes
#: batches of PRUNE_BATCH jobs (each its own short transaction), taking the
#: terminal states in turn, until nothing expired is left, or it has run
#: PRUNE_BATCHES batches of one state, or PRUNE_BUDGET seconds have gone. A
#: pass that stopped with work left is behind: the worker runs the next one
#: after PRUNE_PAUSE instead of PRUNE_INTERVAL, so retention keeps pace with a
#: busy deployment (one pass a minute of 10,000 rows per state could not: that
#: is ~167 jobs/s, and a table grew to millions of expired rows).
#: After each full batch a pass rests PRUNE_REST times as long as the batch
#: took (vacuum's cost delay in spirit): deletes write WAL that claims and acks
#: then wait behind at commit, and at 10M rows back-to-back batches raised the
#: claim p99 several-fold (bench/bigtable_results.md).
PRUNE_INTERVAL = 60.0
PRUNE_BATCH = 500
PRUNE_BATCHES = 200
PRUNE_BUDGET = 2.0
PRUNE_PAUSE = 0.25
PRUNE_REST = 1.0
#: The longest retention or signal TTL taken (a century: "now" minus it must
#: still be a date); None keeps forever.
MAX_KEEP = 100 * 365 * 86_400.0
#: §8.7: rate windows older than a day are dead weight.
RATE_HORIZON = 86_400


def keep_ok(keep: object) -> bool:
    """Seconds > 0 and at most MAX_KEEP (NaN and infinity are neither)."""
    return (not isinstance(keep, bool) and isinstance(keep, (int, float))
            and 0 < keep <= MAX_KEEP)


def parse_retention(retention: Mapping[str, float | None] | None) -> dict[str, float | None]:
    """Per terminal state: seconds to keep finished jobs, or None to keep them forever."""
    merged = dict(DEFAULT_RETENTION)
    for state, keep in (retention or {}).items():
        if state not in DEFAULT_RETENTION:
            raise ConfigurationError(
                f"retention is per terminal state (succeeded, failed, cancelled), got {state!r}"
            )
        if keep is not None and not keep_ok(keep):
            raise ConfigurationError(
                f"retention[{state!r}] is seconds > 0 (at most a century), or None to keep "
                f"forever; got {keep!r}"
            )
        merged[state] = None if keep is None else float(keep)
    return merged


class Pass(NamedTuple):
    """One retention pass: rows deleted by kind, and whether it stopped with
    expired jobs left (at its time budget or batch cap)."""

    counts: dict[str, int]
    behind: bool


def prune(
    conn: psycopg.Connection[Any],
    now: datetime,
    retention: Mapping[str, float | None],
    signal_ttl: float | None,
    rate_periods: Iterable[int],
) -> dict[str, int]:
    """One pass (:func:`prune_pass` with the default budget); returns how many
    rows went, by state, ``signals`` and ``rate_windows``."""
    return prune_pass(conn, now, retention, signal_ttl, rate_periods).counts


def prune_pass(
    conn: psycopg.Connection[Any],
    now: datetime,
    retention: Mapping[str, float | None],
    signal_ttl: float | None,
    rate_periods: Iterable[int],
    *,
    budget: float | None = PRUNE_BUDGET,
    monotonic: Callable[[], float] = time.monotonic,
    rest: Callable[[float], object] = time.sleep,
) -> Pass:
    """Delete what retention no longer keeps, batch by batch, the terminal
    states in turn, for at most ``budget`` seconds (None: until done), resting
    ``rest(PRUNE_REST * the batch's time)`` after each full batch. A rest that
    returns true ends the pass there, behind (a worker passes its stop
    event's wait: a stop cuts the rest short and the pass with it).

    Rate windows go after a day — or after two of the longest period this node
    knows, since its rate math still reads the previous window.
    """
    cutoffs = {state: None if keep is None else now - timedelta(seconds=keep)
               for state, keep in retention.items()}
    pending = [state for state, cutoff in cutoffs.items() if cutoff is not None]
    counts: dict[str, int] = dict.fromkeys(pending, 0)
    batches: dict[str, int] = dict.fromkeys(pending, 0)
    deadline = None if budget is None else monotonic() + budget
    behind = stopped = False
    while pending and not stopped:
        for state in list(pending):
            started = monotonic()
            deleted = store.prune_jobs(conn, state, cutoffs, PRUNE_BATCH)
            counts[state] += deleted
            batches[state] += 1
            if deleted < PRUNE_BATCH:
                pending.remove(state)
                continue
            if batches[state] >= PRUNE_BATCHES:
                pending.remove(state)
                behind = True
            if rest(PRUNE_REST * (monotonic() - started)):
                behind = stopped = True
                break
        if pending and deadline is not None and monotonic() >= deadline:
            behind = True
            break
    if signal_ttl is not None:
        counts["signals"] = store.prune_signals(conn, now - timedelta(seconds=signal_ttl))
    horizon = max([RATE_HORIZON, *(2 * period for period in rate_periods)])
    counts["rate_windows"] = store.prune_rate(conn, int(now.timestamp()) - horizon)
    pruned = {k: v for k, v in counts.items() if v}
    if pruned:
        log.info("belay: pruned %s%s", pruned, " (more left: next pass soon)" if behind else "")
    return Pass(counts, behind)
