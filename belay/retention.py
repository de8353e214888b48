"""Retention (contract §8.7): what the sweeper deletes, and when.

Terminal jobs go once older than their state's retention, with their steps
and events, in batches; a workflow only as a whole once every member expired,
a child only once its parent expired (the SQL says why). Signals go past their
TTL, rate windows once no claim reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from belay import store
from belay.errors import ConfigurationError

log = logging.getLogger("belay.worker")

#: §8.7 defaults (seconds): succeeded jobs a day, failed and cancelled a week.
DEFAULT_RETENTION: dict[str, float | None] = {
    "succeeded": 86_400.0, "failed": 604_800.0, "cancelled": 604_800.0,
}
DEFAULT_SIGNAL_TTL = 7 * 86_400.0
#: Retention runs at most this often, in batches of this many jobs, this many
#: batches per state per pass (the rest waits for the next pass).
PRUNE_INTERVAL = 60.0
PRUNE_BATCH = 500
PRUNE_BATCHES = 20
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


def prune(
    conn: psycopg.Connection[Any],
    now: datetime,
    retention: Mapping[str, float | None],
    signal_ttl: float | None,
    rate_periods: Iterable[int],
) -> dict[str, int]:
    """One pass; returns how many rows went, by state, ``signals`` and ``rate_windows``.

    Rate windows go after a day — or after two of the longest period this node
    knows, since its rate math still reads the previous window.
    """
    counts: dict[str, int] = {}
    cutoffs = {state: None if keep is None else now - timedelta(seconds=keep)
               for state, keep in retention.items()}
    for state, cutoff in cutoffs.items():
        if cutoff is None:
            continue
        total = 0
        for _ in range(PRUNE_BATCHES):
            deleted = store.prune_jobs(conn, state, cutoffs, PRUNE_BATCH)
            total += deleted
            if deleted < PRUNE_BATCH:
                break
        counts[state] = total
    if signal_ttl is not None:
        counts["signals"] = store.prune_signals(conn, now - timedelta(seconds=signal_ttl))
    horizon = max([RATE_HORIZON, *(2 * period for period in rate_periods)])
    counts["rate_windows"] = store.prune_rate(conn, int(now.timestamp()) - horizon)
    pruned = {k: v for k, v in counts.items() if v}
    if pruned:
        log.info("belay: pruned %s", pruned)
    return counts
