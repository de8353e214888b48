"""Maintenance both kinds of worker run: reclaim of expired leases (§6).

Any node reclaims any node's expired leases: each candidate is re-checked and
retried or failed in a transaction of its own (``store.reclaim_one``), with
the after-terminal effects an ack would have. One row that can't be reclaimed
is logged and skipped, so it can't hold back the rows behind it (a pass that
stopped at it would stop there on every sweep, and those jobs would stay
``running`` for good).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from belay import store
from belay.job import Job

log = logging.getLogger("belay.worker")

#: Expired leases looked at per pass.
RECLAIM_LIMIT = 100


def reclaim_expired(
    conn: psycopg.Connection[Any],
    now: datetime,
    backoff: Callable[[Job], float],
    announce: Callable[[psycopg.Connection[Any], store.Acked], None],
    limit: int = RECLAIM_LIMIT,
) -> int:
    """Retry or fail up to ``limit`` jobs whose leases expired before ``now``
    (``backoff(job)``: the retry's delay), ``announce`` called inside each
    one's transaction (its NOTIFYs); returns how many were reclaimed."""
    count = 0
    for job_id in store.expired_leases(conn, now, limit):
        try:
            with conn.transaction():
                acked = store.reclaim_one(conn, job_id, now, backoff)
                if acked is not None:
                    announce(conn, acked)
        except Exception:
            # One bad row must not stop the pass for the rows behind it.
            log.exception("belay: reclaiming job %d failed", job_id)
            continue
        if acked is not None:
            count += 1
            log.warning("belay: reclaimed job %d (lease expired) → %s", job_id,
                        acked.job.state)
    return count
