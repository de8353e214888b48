"""The completer: every outcome written as one fenced ack (§7).

:func:`ack_on` is the one ack both kinds of worker write: ``store.ack`` on the
claimed attempt, and in the same transaction the NOTIFYs it calls for. A
stale attempt (reclaimed meanwhile) writes nothing.

:class:`Completer` is the Python worker's: inline acks retried when the
database blinks, parks (§7 park-and-wake), and batched acks (deliberate
difference 2) — successes wait in a queue, and the executor thread that
handed one over acks every one waiting in one statement, unless another
thread's batch is in flight (flat combining: that thread takes them along
next), each row fenced on its own attempt (with workflow members or children
among them, in one transaction that also settles each workflow once and
tells each parent once). No timer and no hand-off: a lone success is acked
at once, by the thread that ran it.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg

from belay import store
from belay.job import Job
from belay.outcome import Outcome
from belay.parts.execution import Execution
from belay.parts.pool import WorkerPool

log = logging.getLogger("belay.worker")

T = TypeVar("T")

#: The most successes one batched ack statement carries.
ACK_BATCH = 1000

#: Tries of one ack while the database blinks, before the lease is left to lapse.
ACK_TRIES = 3


#: How far ahead of a snooze's due time a second try of its ack may still be
#: sent: before then no worker, even one whose clock runs this much ahead,
#: can have claimed the job again.
SNOOZE_MARGIN = timedelta(seconds=5)


def may_try_again(outcome: Outcome, now: datetime) -> bool:
    """Whether an ack whose try failed may be sent again. A try that failed
    may have committed (the connection went with the reply). A snooze puts
    the attempt back down, so once it is due the job can be claimed again at
    the same attempt, and a second try would pass the fence and end the new
    claim's run while it runs (two runs at once). So a snooze is tried again
    only while it is not yet due; otherwise the lease is left to lapse and
    the reclaim retries the job (at-least-once, one attempt used)."""
    if outcome.kind != "snooze":
        return True
    return outcome.at is not None and now + SNOOZE_MARGIN < outcome.at


Announce = Callable[[psycopg.Connection[Any], store.Acked], None]


def ack_on(conn: psycopg.Connection[Any], job: Job, outcome: Outcome, now: datetime,
           announce: Announce) -> store.Acked | None:
    """Write ``outcome`` for ``job``'s claimed attempt in a transaction of its
    own, ``announce`` inside it; None when stale (nothing written)."""
    with conn.transaction():
        acked = store.ack(conn, job, outcome.kind, now, result=outcome.result,
                          error=outcome.error, at=outcome.at)
        if acked is not None:
            announce(conn, acked)
    return acked


def written(outcome: Outcome, row: Job) -> str:
    """What an ack wrote, by the row it left: ``outcome.kind``, unless the
    database decided otherwise — a retry or snooze of a job whose cancel was
    requested ends "cancelled" (§8.6); a success over a budget cap "failed",
    or "await" for a top-up."""
    if row.state in ("succeeded", "failed", "cancelled"):
        return row.state
    return "await" if row.state == "awaiting" else outcome.kind


@dataclass(frozen=True)
class PendingAck:
    """A success handed to the batched ack: acked, then reported, then forgotten."""

    execution: Execution
    result: bytes | None
    duration: float


class Completer:
    """The Python worker's acks, on its pool.

    ``notify``: announce acks with NOTIFY on ``channel`` (§9.2).
    ``on_batched(pending, outcome)``: a batched success was acked (or found
    stale); ``on_batch_failed(batch, exc)``: writing a batch failed.
    """

    def __init__(
        self,
        pools: WorkerPool,
        now: Callable[[], datetime],
        *,
        notify: bool,
        on_batched: Callable[[PendingAck, str], None],
        on_batch_failed: Callable[[list[PendingAck], BaseException], None],
    ) -> None:
        self._now = now
        self.notify = notify
        self._pools = pools
        self._on_batched = on_batched
        self._on_batch_failed = on_batch_failed
        self._lock = threading.Lock()
        self._acks: queue_module.SimpleQueue[PendingAck] = queue_module.SimpleQueue()
        #: True between start() and stop(): successes may be handed over.
        self._open = False
        #: Held by the thread writing a batched ack (:meth:`combine`).
        self._acking = threading.Lock()
        #: Paces retries of an ack; set once the worker halts.
        self._halted = threading.Event()

    # -- Inline acks -------------------------------------------------------------------

    def announce(self, conn: psycopg.Connection[Any], acked: store.Acked) -> None:
        """Inside the ack's transaction: poke the queues it made work for, and
        announce the results it finished (§9.2). Only with ``notify``: a
        NOTIFY serializes commits, so it is opt-in, like the LISTEN side."""
        if not self.notify:
            return
        results = [acked.job.id] if acked.job.terminal else []
        results += acked.settled.cancelled
        store.notify(conn, self._pools.channel,
                     [store.poke_payload(q) for q in {q for _, q in acked.settled.ready}]
                     + [store.result_payload(i) for i in results])

    def poke(self, conn: psycopg.Connection[Any], queues: Iterable[str]) -> None:
        """Inside ``conn``'s transaction: wake the workers of ``queues`` (with ``notify``)."""
        if self.notify:
            store.notify(conn, self._pools.channel, [store.poke_payload(q) for q in queues])

    def ack(self, job: Job, outcome: Outcome) -> str | None:
        """One fenced ack in its own transaction: what it wrote
        (:func:`written`), or None when stale (discarded) or when the database
        stayed away."""
        if self._pools.pool is None:
            log.warning("belay: job %d attempt %d finished after its worker stopped; its "
                        "lease will lapse and it will be reclaimed", job.id, job.attempt)
            return None
        done, acked = self.write(
            f"ack of job {job.id}",
            lambda conn: ack_on(conn, job, outcome, self._now(), self.announce),
            again=lambda: may_try_again(outcome, self._now()))
        if done and acked is None:
            log.warning("belay: stale ack for job %d attempt %d discarded (the job was "
                        "reclaimed)", job.id, job.attempt)
        return None if acked is None else written(outcome, acked.job)

    def write(self, what: str, write: Callable[[psycopg.Connection[Any]], T],
              again: Callable[[], bool] = lambda: True) -> tuple[bool, T | None]:
        """Run an ack on a pooled connection, ``ACK_TRIES`` tries when the
        database blinks (each try after the first only while ``again()``);
        (False, None) once it stays away — the leases then lapse and the jobs
        are reclaimed (at-least-once)."""
        pool = self._pools.pool
        assert pool is not None
        for attempt in range(ACK_TRIES):
            if attempt and not again():
                log.warning("belay: %s is not tried again (it may have landed, and the job "
                            "been claimed since); the lease lapses and reclaim retries it",
                            what)
                break
            try:
                with pool.connection() as conn:
                    return True, write(conn)
            except psycopg.OperationalError:
                log.warning("belay: %s failed (try %d)", what, attempt + 1, exc_info=True)
                self._halted.wait(0.2 * (attempt + 1))
        return False, None

    def park(self, job: Job, scope: str, name: str, deadline: datetime | None) -> str:
        """§7 park-and-wake: "await", "woken" when the signal was already there,
        "cancelled" when an operator asked to cancel the job meanwhile (§8.6),
        or "stale"."""
        pool = self._pools.pool
        if pool is None:
            return "stale"
        with pool.connection() as conn, conn.transaction():
            parked = store.park_await(conn, job, scope, name, deadline, self._now())
            if isinstance(parked, store.Acked):
                self.announce(conn, parked)
                return "cancelled"
            if parked == "ready" and self.notify:
                store.notify(conn, self._pools.channel, [store.poke_payload(job.queue)])
        if parked is None:
            log.warning("belay: stale park of job %d attempt %d discarded", job.id, job.attempt)
            return "stale"
        return "await" if parked == "awaiting" else "woken"

    # -- Batched acks (deliberate difference 2) -----------------------------------------

    def start(self) -> None:
        self._halted.clear()
        with self._lock:
            self._acks = queue_module.SimpleQueue()
            self._open = True

    def defer(self, pending: PendingAck) -> bool:
        """Hand a success to the next batch; False (ack it yourself) once the
        completer is stopping. The caller then calls :meth:`combine`."""
        with self._lock:
            if not self._open:
                return False
            pending.execution.ack_pending = True
            self._acks.put(pending)
        return True

    def combine(self) -> None:
        """Flat combining: the thread that handed successes over writes the
        batch itself when no batched ack is in flight — every success
        waiting, in one statement — and otherwise leaves them to the thread
        whose ack is in flight, which takes them along next. Whoever lets go
        of the batch looks again, so nothing waits unwritten: a lone success
        is acked at once, on its own thread, with no hand-off."""
        while self._acking.acquire(blocking=False):
            try:
                batch = self._waiting()
                if batch:
                    self._write_batch(batch)
            finally:
                self._acking.release()
            if self._acks.empty():
                return

    def stop(self) -> None:
        """Ack what is pending (before the pool closes); no success is taken after."""
        with self._lock:
            self._open = False
        with self._acking:
            while batch := self._waiting():
                self._write_batch(batch)

    def halt(self) -> None:
        """The worker is going: a retry of an ack waits no more."""
        self._halted.set()

    def _settling(self, conn: psycopg.Connection[Any], rows: list[tuple[Job, bytes | None]],
                  channel: str | None) -> set[int]:
        """A batch with workflow members or children: acked, settled and its
        parents told in one transaction, with what that woke announced."""
        with conn.transaction():
            acked, settled = store.ack_succeeded_settling(conn, rows, self._now(), channel)
            self.announce_settled(conn, settled)
        return acked

    def announce_settled(self, conn: psycopg.Connection[Any], settled: store.Settled) -> None:
        """Inside the transaction that settled: poke the queues of the jobs it
        readied and announce the results of the members it doomed (§9.2)."""
        if self.notify:
            store.notify(conn, self._pools.channel,
                         [store.poke_payload(q) for q in {q for _, q in settled.ready}]
                         + [store.result_payload(i) for i in settled.cancelled])

    def _waiting(self) -> list[PendingAck]:
        """Up to ``ACK_BATCH`` successes waiting, in the order handed over."""
        batch: list[PendingAck] = []
        while len(batch) < ACK_BATCH:
            try:
                batch.append(self._acks.get_nowait())
            except queue_module.Empty:
                break
        return batch

    def _write_batch(self, batch: list[PendingAck]) -> None:
        try:
            self._ack_batch(batch)
        except BaseException as exc:
            log.exception("belay: batched ack of jobs %s failed; their leases will lapse and "
                          "they will be reclaimed", [p.execution.job.id for p in batch])
            self._on_batch_failed(batch, exc)

    def _ack_batch(self, batch: list[PendingAck]) -> None:
        rows = [(p.execution.job, p.result) for p in batch]
        channel = self._pools.channel if self.notify else None
        if all(store.batchable(job) for job, _ in rows):
            done, acked = self.write(
                f"batched ack of {len(batch)} jobs",
                lambda conn: store.ack_succeeded_many(conn, rows, self._now(), channel))
        else:
            done, acked = self.write(f"batched ack of {len(batch)} jobs",
                                     lambda conn: self._settling(conn, rows, channel))
        for pending in batch:
            job = pending.execution.job
            kind = "succeeded" if acked is not None and job.id in acked else "stale"
            if done and kind == "stale":
                log.warning("belay: stale ack for job %d attempt %d discarded (the job was "
                            "reclaimed)", job.id, job.attempt)
            self._on_batched(pending, kind)
