"""Maintenance: reclaim of expired leases (§6), the parents' backstop (§8.4)
and retention (§8.7).

:class:`Maintenance` is the Python worker's ``belay-sweeper`` service: every
``sweep_interval`` it reclaims and reconciles; about once a minute (sooner
while a pass falls behind) it prunes. HTTP worker sessions run
:func:`reclaim_expired` on their own heartbeat when asked to.

Any node reclaims any node's expired leases: each candidate is re-checked and
retried or failed in a transaction of its own (``store.reclaim_one``), with
the after-terminal effects an ack would have. One row that can't be reclaimed
is logged and skipped, so it can't hold back the rows behind it (a pass that
stopped at it would stop there on every sweep, and those jobs would stay
``running`` for good).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import psycopg

from belay import retention, store
from belay.job import Job
from belay.outcome import default_backoff, safe_delay
from belay.parts.service import Service
from belay.registry import Registry

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


def registry_backoff(registry: Registry) -> Callable[[Job], float]:
    """A reclaimed job's retry delay: its worker's backoff, else the default."""
    def backoff(job: Job) -> float:
        definition = registry.get(job.kind)
        return safe_delay(definition.backoff if definition is not None else default_backoff,
                          job.attempt)
    return backoff


class Maintenance:
    """Reclaim, reconcile and prune for one worker.

    ``connection()`` lends a connection; ``backoff(job)`` is a reclaimed
    job's retry delay; ``announce`` the completer's NOTIFYs of an ack;
    ``poke(conn, queues)`` wakes the workers of ``queues``; ``rate_periods(conn)``
    the rate windows the served queues claim by (kept by the prune).
    """

    def __init__(
        self,
        connection: Callable[[], contextlib.AbstractContextManager[store.Conn]],
        now: Callable[[], datetime],
        *,
        backoff: Callable[[Job], float],
        announce: Callable[[psycopg.Connection[Any], store.Acked], None],
        poke: Callable[[psycopg.Connection[Any], Iterable[str]], None],
        keep: Mapping[str, float | None],
        signal_ttl: float | None,
        rate_periods: Callable[[psycopg.Connection[Any]], list[int]],
        sweep_interval: float,
    ) -> None:
        self._connection = connection
        self._now = now
        self._backoff = backoff
        self._announce = announce
        self._poke = poke
        self.keep = keep
        self.signal_ttl = signal_ttl
        self._rate_periods = rate_periods
        self.sweep_interval = sweep_interval
        #: Set once the worker halts: a prune's rests end at once.
        self.halted = threading.Event()

    def reclaim(self, limit: int = RECLAIM_LIMIT) -> int:
        """Retry or fail jobs whose leases expired (any node's); returns how many."""
        with self._connection() as conn:
            return reclaim_expired(conn, self._now(), self._backoff, self._announce, limit)

    def reconcile(self) -> int:
        """§8.4 backstop (race R2): wake parents whose children are all terminal
        but which still await ``$children``; returns how many."""
        # One statement, on its own (the pool's connections autocommit): an
        # idle node runs this every sweep_interval, and a BEGIN and COMMIT
        # around it were two of its three statements. The poke follows the
        # wake's commit.
        with self._connection() as conn:
            woken = store.resettle_parents(conn, self._now())
            if woken:
                self._poke(conn, [q for _, q in woken])
        for job_id, _ in woken:
            log.warning("belay: reconciler woke parent job %d (its children are done)", job_id)
        return len(woken)

    def prune_pass(self) -> retention.Pass:
        """§8.7 retention, one pass (see :func:`belay.retention.prune_pass`)."""
        with self._connection() as conn:
            return retention.prune_pass(conn, self._now(), self.keep, self.signal_ttl,
                                        self._rate_periods(conn), rest=self.halted.wait)

    def sweep(self, service: Service) -> None:
        """The ``belay-sweeper`` loop."""
        swept_at = prune_due = 0.0
        wait = self.sweep_interval
        while not service.wait(wait):
            if time.monotonic() - swept_at >= self.sweep_interval:
                swept_at = time.monotonic()
                try:
                    self.reclaim()
                    self.reconcile()
                except Exception:
                    log.exception("belay: reclaiming expired leases failed; retrying")
            if time.monotonic() >= prune_due:
                behind = False
                try:
                    behind = self.prune_pass().behind
                except Exception:
                    log.exception("belay: pruning old jobs failed; retrying")
                # Behind (expired jobs left when the pass's budget ran out): the
                # next pass follows shortly, so retention keeps up with a busy
                # deployment; reclaim still runs every sweep_interval between.
                prune_due = time.monotonic() + (
                    retention.PRUNE_PAUSE if behind else retention.PRUNE_INTERVAL)
            wait = max(0.0, min(self.sweep_interval - (time.monotonic() - swept_at),
                                prune_due - time.monotonic()))
