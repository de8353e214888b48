"""How the executor server records what happens to the jobs it hands out: the
fenced acks and parks, the job hooks, and where a kind's timeout and backoff
come from. Shared by the server's requests, its timeouts and cancels, and
the process pool (a child that died), and the hand-backs of executors lost."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from belay import store
from belay.client import Belay
from belay.errors import BelayError
from belay.job import Job
from belay.outcome import Outcome, retry_or_fail
from belay.parts import handbacks
from belay.parts.completer import ack_on
from belay.parts.execution import Execution
from belay.parts.hooks import Hooks
from belay.parts.remote import job_backoff, timeout_of
from belay.registry import Registry, WorkerDef

log = logging.getLogger("belay.executors")


class Records:
    """The writes of one executor server, through ``client``."""

    def __init__(self, client: Belay, registry: Registry | None) -> None:
        self.client = client
        #: Where a kind's timeout and backoff come from, for the kinds it knows
        #: (the process pool's); other kinds take them from the job's meta.
        self.registry = registry
        #: The worker's ``on_job_start``/``on_job_end`` hooks, when it has them:
        #: called as executors report starts and ends (metrics count their jobs).
        self.hooks: Hooks | None = None

    def _definition(self, job: Job) -> WorkerDef | None:
        return None if self.registry is None else self.registry.get(job.kind)

    def backoff(self, job: Job) -> Callable[[int], float]:
        definition = self._definition(job)
        return job_backoff(job) if definition is None else definition.backoff

    def timeout_ms(self, job: Job) -> int | None:
        definition = self._definition(job)
        if definition is None:
            return timeout_of(job)
        return None if definition.timeout is None else int(definition.timeout * 1000)

    def park(self, job: Job, scope: str, name: str, deadline: datetime | None) -> str | None:
        """§7 park-and-wake of the claimed attempt: "awaiting", "ready" (the
        signal was there: it runs again now), "cancelled" (an operator asked
        to cancel it meanwhile, §8.6), or None when stale."""
        now = self.client.clock.now()
        with self.client.connection() as conn, conn.transaction():
            parked = store.park_await(conn, job, scope, name, deadline, now)
            if isinstance(parked, store.Acked):
                self.announce(conn, parked)
                return "cancelled"
            if parked == "ready":
                self.client.poke(conn, [job.queue])
        return parked

    def ack(self, job: Job, outcome: Outcome) -> store.Acked | None:
        """One fenced ack of ``job``'s claimed attempt (None when stale)."""
        with self.client.connection() as conn:
            return ack_on(conn, job, outcome, self.client.clock.now(), self.announce)

    def announce(self, conn: store.Conn, acked: store.Acked) -> None:
        results = [acked.job.id] if acked.job.terminal else []
        self.client.poke(conn, {q for _, q in acked.settled.ready},
                         results + acked.settled.cancelled)

    def ended(self, execution: Execution, outcome: str, error: Any = None) -> None:
        """Tell the ``on_job_end`` hooks (when there are any)."""
        if self.hooks is not None:
            self.hooks.finished(execution.job, outcome, execution.elapsed(), error)

    def refuse(self, job: Job, why: str) -> None:
        """An attempt no executor can be given: failed (retried while attempts remain)."""
        log.error("belay: job %d attempt %d: %s", job.id, job.attempt, why)
        now = self.client.clock.now()
        outcome = retry_or_fail({"error": f"ValidationError: {why}", "attempt": job.attempt},
                                job.attempt, job.max_attempts, now, self.backoff(job))
        with self.client.connection() as conn:
            ack_on(conn, job, outcome, now, self.announce)

    def give_back(self, job: Job) -> int:
        """Snooze the claimed attempt back, due now, uncounted: for a job no
        executor ran (its connection closed before the send) and for the
        worker's own stop — neither can be the job's doing."""
        now = self.client.clock.now()
        try:
            with self.client.connection() as conn:
                acked = ack_on(conn, job, Outcome("snooze", at=now), now, self.announce)
        except (psycopg.Error, BelayError):
            log.warning("belay: giving job %d back failed; its lease lapses and reclaim "
                        "retries it", job.id, exc_info=True)
            return 0
        return 0 if acked is None else 1

    def hand_back(self, execution: Execution, executor: str | None, why: str) -> int:
        """``executor``, the node running ``execution``, was lost (``why``): a
        counted hand-back (:mod:`belay.parts.handbacks`) — a snooze, or at the
        bound a failed attempt; None (the worker stops): :meth:`give_back`.
        The ``on_job_end`` hooks are told. 1 when written."""
        job = execution.job
        if executor is None:
            back = self.give_back(job)
            self.ended(execution, "lost")
            return back
        now = self.client.clock.now()
        try:
            with self.client.connection() as conn:
                handed = handbacks.give_back(conn, job, executor, why, now, self.backoff(job),
                                             self.announce)
        except (psycopg.Error, BelayError):
            log.warning("belay: giving job %d back failed; its lease lapses and reclaim "
                        "retries it", job.id, exc_info=True)
            handed = None
        if handed is None or handed[0] == "snooze":
            self.ended(execution, "lost")
        else:
            self.ended(execution, handed[0], handed[1].job.errors[-1])
        return 0 if handed is None else 1
