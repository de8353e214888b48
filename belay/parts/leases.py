"""Leases: the executions this process holds, renewed and timed (§6).

One lease keeper per process kind — the Python worker's, and the HTTP worker
sessions' — with its own lock. Every third of ``lease_ttl`` it renews every
live lease in one statement per node; a lease the database no longer holds
for that node is lost (the job was reclaimed): its execution ends ``"lost"``
and may never ack. An execution past its ``timeout`` ends ``"timeout"`` and
its owner fails the attempt at once (``on_timeout``); the thread running it
can't be killed, so its slot stays taken until the function returns.
A renewal also reads each job's ``cancel_requested``: the first time it is
seen, the execution is marked and ``on_cancel`` (when given) is told — the
executors in other processes end the attempt and are sent
``cancel_execution``; a thread's job stops at its next step or checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from belay import otel, store
from belay.outcome import Outcome, retry_or_fail
from belay.parts.execution import LOST, TIMEOUT, Execution
from belay.parts.service import Service

log = logging.getLogger("belay.worker")

Connect = Callable[[], contextlib.AbstractContextManager[store.Conn]]


def timeout_outcome(execution: Execution, now: datetime, backoff: Any) -> Outcome:
    """The attempt's end when it ran past its timeout: retried after
    ``backoff`` while attempts remain, else failed."""
    job = execution.job
    if execution.stalled:
        return Outcome("failed", error=stall_entry(execution))
    assert execution.deadline is not None
    limit = execution.deadline - execution.started
    error = {"error": f"timeout: ran longer than {limit:g}s", "attempt": job.attempt}
    return retry_or_fail(error, job.attempt, job.max_attempts, now, backoff)


def stall_entry(execution: Execution) -> dict[str, Any]:
    """The error of a run the watchdog stopped for journaling nothing new."""
    stall = execution.watchdog.stall
    last = execution.last_step
    return {"error": "no_progress", "reason": "stalled", "stall": stall, "last_step": last,
            "attempt": execution.job.attempt,
            "message": f"no step journaled for {stall:g}s "
                       + (f"after step {last!r}" if last else "since the run started")}


class Leases:
    """The live executions of one node (or, for HTTP sessions, of several),
    keyed by ``(job id, attempt)``.

    ``connection()`` lends a connection; ``now()`` is the database clock
    (the client's); ``clock`` the monotonic one timeouts count in (renewals keep real time).
    ``on_timeout(execution)`` records a timed-out attempt.
    """

    def __init__(
        self,
        node_id: str,
        lease_ttl: float,
        connection: Connect,
        now: Callable[[], datetime],
        *,
        on_timeout: Callable[[Execution], None],
        on_cancel: Callable[[Execution], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.lease_ttl = lease_ttl
        self._connection = connection
        self._now = now
        self._on_timeout = on_timeout
        self._on_cancel = on_cancel
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], Execution] = {}
        self._next_renew = time.monotonic() + self.period
        #: The heartbeat's service, once started: a new deadline wakes it.
        self.service: Service | None = None

    @property
    def period(self) -> float:
        return self.lease_ttl / 3

    def lease_until(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.lease_ttl)

    # -- The set --------------------------------------------------------------------

    def hold(self, execution: Execution) -> None:
        with self._lock:
            self._held[execution.key] = execution
        if execution.deadline is not None:
            self.wake()

    def release(self, execution: Execution) -> None:
        with self._lock:
            if self._held.get(execution.key) is execution:
                del self._held[execution.key]
        if execution.span is not None:  # no end was recorded: it ends as what ended it
            otel.end(execution.take_span(), execution.ended or LOST)

    def running(self) -> list[Execution]:
        """Every execution held: running, or waiting for its ack or its chunk."""
        with self._lock:
            return list(self._held.values())

    def live(self) -> list[Execution]:
        """The executions that may still ack."""
        return [e for e in self.running() if e.ended is None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def wake(self) -> None:
        """A new deadline: the heartbeat looks again now."""
        if self.service is not None:
            self.service.wake()

    # -- Renewal and timeouts -----------------------------------------------------------

    def renew(self) -> list[Execution]:
        """Extend every live lease by ``lease_ttl``, one statement per node;
        returns the executions whose lease was lost (now ended ``"lost"``)."""
        live = self.live()
        self._next_renew = time.monotonic() + self.period
        if not live:
            return []
        by_node: dict[str, list[Execution]] = {}
        for execution in live:
            by_node.setdefault(execution.node or self.node_id, []).append(execution)
        lost: list[Execution] = []
        cancelled: list[Execution] = []
        until = self.lease_until(self._now())
        with self._connection() as conn:
            for node, executions in by_node.items():
                held = store.renew_leases(conn, [e.key for e in executions], node, until)
                lost += [e for e in executions if e.key not in held and e.end(LOST)]
                cancelled += [e for e in executions if held.get(e.key) and e.request_cancel()]
        for execution in lost:
            log.warning("belay: lost the lease of job %d attempt %d; its result will be "
                        "discarded", execution.job.id, execution.job.attempt)
        for execution in cancelled:
            if self._on_cancel is not None and execution.ended is None:
                try:
                    self._on_cancel(execution)
                except Exception:
                    log.exception("belay: cancelling job %d attempt %d failed; its lease "
                                  "is renewed and the next renewal tries again",
                                  execution.job.id, execution.job.attempt)
                    execution.cancel_requested = False
        return lost

    def enforce_timeouts(self) -> list[Execution]:
        """End ``"timeout"`` every execution past its deadline, recording each
        through ``on_timeout``; returns them."""
        now = self._clock()
        due = []
        for e in self.running():
            stalled = e.stall_deadline is not None and now >= e.stall_deadline
            if ((stalled or (e.deadline is not None and now >= e.deadline))
                    and e.end(TIMEOUT)):
                e.stalled = stalled and not (e.deadline is not None and now >= e.deadline)
                due.append(e)
        for execution in due:
            try:
                self._on_timeout(execution)
            except Exception:
                # Its lease is no longer renewed: it lapses and reclaim fails the attempt.
                log.exception("belay: failing timed-out job %d attempt %d failed",
                              execution.job.id, execution.job.attempt)
        return due

    def beat(self) -> float:
        """One heartbeat: renew when due, enforce timeouts; returns the seconds
        until the next thing due (a renewal or a deadline)."""
        if time.monotonic() >= self._next_renew:
            self.renew()
        self.enforce_timeouts()
        deadlines = [d for e in self.running()
                     if (d := e.next_deadline()) is not None and e.ended is None]
        wait = self._next_renew - time.monotonic()
        if deadlines:
            wait = min(wait, min(deadlines) - self._clock())
        return max(0.01, min(wait, self.period))

    def heartbeat(self, service: Service) -> None:
        """The heartbeat service's loop (``belay-heartbeat``)."""
        self._next_renew = time.monotonic() + self.period
        wait = 0.0  # a first look now: executions may be held already
        while not service.wait(wait):
            try:
                wait = self.beat()
            except Exception:
                log.exception("belay: heartbeat failed; retrying")
                wait = min(self.period, 1.0)

    def lose_all(self) -> list[Execution]:
        """End ``"lost"`` every live execution: their leases will not be
        renewed (the heartbeat is gone), so their results must not count."""
        return [e for e in self.live() if e.end(LOST)]
