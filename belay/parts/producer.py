"""Producers: claiming work for the queues this node serves (§6, §9.1).

One :class:`Producer` per queue, each a ``belay-producer-<queue>`` service:
it claims up to the queue's free slots (plain queues together: one
statement claims for every plain queue of the node that wants work), polls adaptively (``busy_poll``
while claims return work, doubling to ``poll_interval``) and is woken early
by a freed slot or a poke; once a claim at ``poll_interval`` finds nothing,
the queue is idle and waits for ``belay-poller``, which asks in one read per
interval which idle queues have work (coalesced: an idle node costs one
query per interval, not one claim per queue).

Queues with a global limit, a rate or a partition claim through admission
(:func:`belay.store.claim_admitted`); chunk workers' jobs gather in a
per-queue buffer until their chunk fills or its gather time is up.

:class:`Producers` holds the set, with one lock for every queue's slots.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from belay import store
from belay.job import Job
from belay.parts.execution import Execution
from belay.parts.executor import Work
from belay.parts.service import Service
from belay.queues import QueueSpec, adapt_limit
from belay.registry import Chunk, Registry

log = logging.getLogger("belay.worker")

#: Seconds a queue keeps polling at ``busy_poll`` after a claim found work.
HOT_WINDOW = 0.25

#: An idle producer's own look, in poll intervals, should the poller not wake
#: it: it claims then only if the poller has not read for half that long and
#: for :data:`POLLER_STALE` (a stuck or dead poller). While the poller reads,
#: an idle queue costs nothing of its own: 100 idle queues on 4 processes sent
#: 40 backstop claims a second when each looked on its own (issue 39).
IDLE_BACKSTOP = 20

#: The least time without a finished round after which the poller counts as
#: stuck (a loaded machine can hold a short poll interval's round up).
POLLER_STALE = 5.0

Connect = Callable[[], contextlib.AbstractContextManager[store.Conn]]


def claim_jobs(conn: store.Conn, spec: QueueSpec, demand: int, node_id: str,
               now: Callable[[], datetime], lease_ttl: float,
               kinds: list[str] | None = None) -> list[Job]:
    """Claim up to ``demand`` jobs of ``spec``'s queue (of ``kinds`` only, if
    given) under leases for ``node_id``: the one claim both kinds of worker make."""
    if not spec.admitted:
        at = now()
        return store.claim(conn, spec.name, demand, node_id, at,
                           at + timedelta(seconds=lease_ttl), kinds=kinds)
    with conn.transaction():
        store.lock_for_claim(conn, spec)
        at = now()  # after the lock (store.lock_for_claim says why)
        return store.claim_admitted(conn, spec, demand, node_id, at,
                                    at + timedelta(seconds=lease_ttl), kinds=kinds,
                                    locked=True)


class Producer:
    """One queue's producer on this node: its options, slots and service."""

    def __init__(self, spec: QueueSpec, producers: Producers) -> None:
        self.spec = spec
        self._set = producers
        #: The local limit now: fixed, or adaptive between the spec's min and max.
        self.limit = spec.limit_min if spec.limit_min is not None else spec.limit
        #: Slots taken: running jobs plus chunk jobs waiting in a buffer.
        self.inflight = 0
        #: Set when the queue left the configuration: the producer exits.
        self.retired = False
        #: When a claim last brought this queue jobs (its own, or another's).
        self.last_hit = 0.0
        #: Set by :meth:`wake`: something (the poller, a notification, a
        #: freed slot) asked for a claim, as opposed to a wait running out.
        self.poked = False
        #: The last claim of this plain queue took fewer jobs than it asked
        #: for: nothing more was waiting, so a freed slot need not claim
        #: (new jobs wake the queue, and its own polling goes on). A claim
        #: that takes all it asks for clears it; slots only fill that way.
        self.drained = False
        #: Chunk workers' claimed jobs by kind, and when each buffer must go.
        self.buffers: dict[str, list[Execution]] = {}
        self.gather_until: dict[str, float] = {}
        self.service = Service(f"belay-producer-{spec.name}", self.run,
                               on_crash=producers.on_crash)

    @property
    def name(self) -> str:
        return self.spec.name

    def wake(self) -> None:
        self.poked = True
        self.service.wake()

    def reconfigure(self, spec: QueueSpec) -> None:
        self.spec = spec
        low = spec.limit_min if spec.limit_min is not None else spec.limit
        self.limit = max(low, min(spec.limit, self.limit))

    def hit(self) -> None:
        """Another queue's claim brought this one jobs: it is hot (§9.1)."""
        self.last_hit = time.monotonic()

    def run(self, service: Service) -> None:
        """The producer's loop."""
        p = self._set
        interval = p.busy_poll
        while not service.stopping and not self.retired:
            claimed = demand = 0
            self.poked = False
            try:
                demand = p.demand(self)
                if demand > 0:
                    claimed = self.claim(demand)
                    self.adapt(claimed, demand)
                self.flush()
            except Exception:
                log.exception("belay: claiming from %r failed; retrying", self.name)
                interval = p.poll_interval
            # Hot while claims find work and for HOT_WINDOW after (jobs that
            # trickle in keep being picked up at busy_poll), then decaying to
            # the idle ceiling (§9.1); a claim at the ceiling that finds nothing
            # leaves the queue to the poller (with a long backstop, should the
            # poller be stuck). While this node LISTENs, a claim that leaves
            # nothing waiting does so at once (one that finds nothing, or a
            # plain queue's that took less than it asked): an enqueue's poke
            # wakes the queue, and jobs that come due with time are the
            # poller's either way. (Hot polling after each job cost 9 claims
            # a job at 5 jobs/s.)
            idle = demand > 0 and (
                (not claimed and interval >= p.poll_interval)
                or ((not claimed or self.drained) and p.listening()))
            if claimed:
                self.last_hit = time.monotonic()
            hot = time.monotonic() - self.last_hit < HOT_WINDOW
            interval = p.busy_poll if hot else min(interval * 2, p.poll_interval)
            wait = interval * IDLE_BACKSTOP if idle else interval
            with p.lock:
                if self.gather_until:
                    wait = min(wait, max(0.0, min(self.gather_until.values()) - time.monotonic()))
                if idle:
                    p.idle.add(self)
            service.wait(wait)
            # An idle queue's backstop ran out: look only if the poller
            # has not been reading (it would have woken this queue). A chunk
            # gathering here is due to run: the loop times it.
            while (idle and not self.poked and not self.gather_until
                   and not service.stopping and p.poller_reads()):
                service.wait(wait)
            if idle:
                with p.lock:
                    p.idle.discard(self)
        # Leaving (stop, or the queue left the configuration): chunks still
        # gathering hold claimed jobs under renewed leases; they run now.
        self.flush(everything=True)

    @property
    def joins(self) -> bool:
        """Whether this queue's claims may be made together with other
        queues' (:meth:`Producers.claim_together`): plain queues with a fixed
        limit. Admission takes a lock per queue; an adaptive limit adapts
        to its own claims."""
        return not self.spec.admitted and self.spec.limit_min is None

    def claim(self, demand: int) -> int:
        p = self._set
        kinds = None if p.kinds is None else p.kinds()
        if kinds == []:
            return 0
        if self.joins:
            return p.claim_together(self, demand, kinds)
        with p.connection() as conn:
            jobs = claim_jobs(conn, self.spec, demand, p.node_id, p.now, p.lease_ttl,
                              kinds=kinds)
        # An admitted queue's short claim may be its cap, not its backlog:
        # a freed slot is room for the jobs left waiting.
        self.drained = len(jobs) < demand and not self.spec.admitted
        with p.lock:
            self.inflight += len(jobs)
        self.take(jobs)
        return len(jobs)

    def take(self, jobs: list[Job]) -> None:
        """Start (or gather, for a chunk worker) jobs claimed for this queue,
        whose slots are already counted in ``inflight``."""
        p = self._set
        for job in jobs:
            definition = p.registry.get(job.kind)
            if definition is None:
                with p.lock:
                    self.inflight -= 1
                p.return_unknown(job)
                continue
            # A chunk job's timeout starts when its chunk does, not while it gathers.
            timeout = None if definition.chunk is not None else definition.timeout
            execution = Execution(job, definition, timeout)
            execution.owner = self
            p.hold(execution)
            if definition.chunk is not None:
                with p.lock:
                    self._buffer(execution, definition.chunk)
                continue
            p.submit(execution)

    def adapt(self, claimed: int, demand: int) -> None:
        spec = self.spec
        if spec.limit_min is None:
            return
        with self._set.lock:
            before = self.limit
            self.limit = adapt_limit(before, spec.limit_min, spec.limit, claimed=claimed,
                                     demand=demand, busy=self.inflight)
        if self.limit != before:
            log.debug("belay: queue %r limit %d → %d", self.name, before, self.limit)

    def _buffer(self, execution: Execution, chunk: Chunk) -> None:
        """Hold a chunk worker's job until its chunk fills or its gather time is up
        (lock held). Never longer than half the lease: the lease is renewed
        meanwhile, but a gather must not be what makes it lapse."""
        kind = execution.job.kind
        buffered = self.buffers.setdefault(kind, [])
        buffered.append(execution)
        gather = min(chunk.gather_ms / 1000.0, self._set.lease_ttl / 2)
        if kind not in self.gather_until:
            self.gather_until[kind] = time.monotonic() + gather
        if len(buffered) >= chunk.size:
            while len(buffered) >= chunk.size:
                self._set.submit(buffered[:chunk.size])
                del buffered[:chunk.size]
            # What is left starts a gather of its own.
            self.gather_until[kind] = time.monotonic() + gather
        if not buffered:
            del self.buffers[kind]
            del self.gather_until[kind]

    def flush(self, *, everything: bool = False) -> None:
        """Hand over the buffers whose gather time is up (all of them on stop)."""
        now = time.monotonic()
        with self._set.lock:
            for kind in [k for k, until in self.gather_until.items()
                         if everything or until <= now]:
                self._set.submit(self.buffers.pop(kind))
                del self.gather_until[kind]


def _not_listening() -> bool:
    return False


class Producers:
    """The queues this node serves now, their producers and the idle poller."""

    def __init__(
        self,
        registry: Registry,
        *,
        node_id: str,
        lease_ttl: float,
        poll_interval: float,
        busy_poll: float,
        connection: Connect,
        now: Callable[[], datetime],
        hold: Callable[[Execution], None],
        submit: Callable[[Work], None],
        return_unknown: Callable[[Job], None],
        on_crash: Callable[[Service, BaseException], None],
        kinds: Callable[[], list[str]] | None = None,
    ) -> None:
        self.registry = registry
        #: When set, the kinds claims are limited to (executors of other
        #: kinds share the queues on the socket).
        self.kinds = kinds
        self.node_id = node_id
        self.lease_ttl = lease_ttl
        self.poll_interval = poll_interval
        self.busy_poll = busy_poll
        self.connection = connection
        self.now = now
        self.hold = hold
        self.submit = submit
        self.return_unknown = return_unknown
        self.on_crash = on_crash
        self.lock = threading.Lock()
        self.live: dict[str, Producer] = {}
        #: Idle queues, whose producers wait for the poller (or a poke) to wake them.
        self.idle: set[Producer] = set()
        #: Queues paused on this node only (``Worker.pause_queue``).
        self.paused_here: set[str] = set()
        self._closed = False
        self.poller = Service("belay-poller", self.poll_idle, on_crash=on_crash)
        #: When the poller last finished a round (monotonic).
        self.polled_at = time.monotonic()
        #: Whether this node's LISTEN connection is up (set by the worker
        #: while it listens): enqueue pokes then wake idle queues.
        self.listening: Callable[[], bool] = _not_listening

    def claim_together(self, first: Producer, demand: int, kinds: list[str] | None) -> int:
        """One claim statement for ``first`` (up to ``demand``) and every other
        joining queue that wants work now: free slots, not paused, not idle
        (an idle queue waits for the poller's word). Their slots are taken
        before the claim, so two producers never claim the same slot, and
        handed back when the claim brings fewer jobs. Returns ``first``'s
        count (each other producer is woken when its queue got jobs)."""
        with self.lock:
            # ``first``'s free slots again: another claim may have taken some.
            takes = {first: min(demand, first.limit - first.inflight)}
            for q in self.live.values():
                if (q is first or not q.joins or q.retired or q in self.idle
                        or q.spec.paused or q.name in self.paused_here):
                    continue
                takes[q] = q.limit - q.inflight
            takes = {q: take for q, take in takes.items() if take > 0}
            if not takes:
                return 0
            for q, take in takes.items():
                q.inflight += take
        jobs: list[Job] | None = None
        try:
            with self.connection() as conn:
                at = self.now()
                jobs = store.claim_queues(
                    conn, {q.name: take for q, take in takes.items()}, self.node_id, at,
                    at + timedelta(seconds=self.lease_ttl), kinds=kinds)
        finally:
            by_queue: dict[str, list[Job]] = {}
            for job in jobs or ():
                by_queue.setdefault(job.queue, []).append(job)
            with self.lock:
                for q, take in takes.items():
                    got = len(by_queue.get(q.name, ()))
                    q.inflight -= take - got
                    if jobs is not None:  # a failed claim tells nothing of the backlog
                        q.drained = got < take
        for q in takes:
            mine = by_queue.get(q.name)
            if mine:
                q.take(mine)
                if q is not first:
                    q.hit()
                    if q.buffers:
                        q.wake()  # its loop times the chunk's gather
        return len(by_queue.get(first.name, ()))

    def demand(self, q: Producer) -> int:
        with self.lock:
            if q.spec.paused or q.name in self.paused_here:
                return 0
            return q.limit - q.inflight

    def apply(self, specs: Mapping[str, QueueSpec]) -> list[Producer] | None:
        """Start producers for new queues, retire removed ones, reconfigure the
        rest; returns every producer now live (None once stopping)."""
        started: list[Producer] = []
        with self.lock:
            if self._closed:
                return None
            for name, spec in specs.items():
                current = self.live.get(name)
                if current is None:
                    current = self.live[name] = Producer(spec, self)
                    started.append(current)
                elif current.spec != spec:
                    log.info("belay: queue %r now %s", name, spec.to_opts())
                    current.reconfigure(spec)
                    current.wake()
            for name in [n for n in self.live if n not in specs]:
                gone = self.live.pop(name)
                gone.retired = True
                gone.service.stop()
                log.info("belay: queue %r removed; its running jobs finish", name)
            live = list(self.live.values())
        for q in started:
            q.service.start()
        return live

    def get(self, queue: str) -> Producer | None:
        with self.lock:
            return self.live.get(queue)

    def specs(self) -> dict[str, QueueSpec]:
        with self.lock:
            return {name: q.spec for name, q in self.live.items()}

    def wake(self, queue: str) -> None:
        found = self.get(queue)
        if found is not None:
            found.wake()

    def free(self, execution: Execution) -> None:
        """The execution's slot is free again: its producer may claim."""
        owner: Producer | None = execution.owner
        if owner is None:
            return
        with self.lock:
            owner.inflight -= 1
        if not owner.drained:
            owner.wake()

    def poll_idle(self, service: Service) -> None:
        """One read per ``poll_interval`` for every idle queue; wakes the
        producers of those with work. A failed read wakes them all, so they
        claim (and log) on their own until the database answers again."""
        while not service.wait(self.poll_interval):
            with self.lock:
                idle = {q.name: q for q in self.idle if not q.retired}
            if not idle:
                self.polled_at = time.monotonic()
                continue
            try:
                with self.connection() as conn:
                    busy = store.queues_with_work(conn, sorted(idle), self.now())
            except Exception:
                log.warning("belay: polling idle queues failed", exc_info=True)
                busy = set(idle)
            else:
                self.polled_at = time.monotonic()
            for name in busy:
                idle[name].wake()

    def poller_reads(self) -> bool:
        """Whether the idle poller finished a round within half an idle
        queue's backstop (and within :data:`POLLER_STALE`): it is alive and
        its reads get answers."""
        stale = max(self.poll_interval * IDLE_BACKSTOP / 2, POLLER_STALE)
        return self.poller.alive and time.monotonic() - self.polled_at < stale

    def on_notify(self, message: dict[str, Any]) -> None:
        if message.get("t") == "p" and isinstance(message.get("q"), str):
            self.wake(message["q"])

    def halt(self) -> None:
        """Stop claiming now, without waiting for a claim under way."""
        with self.lock:
            self._closed = True
            queues = list(self.live.values())
        for q in queues:
            q.service.stop()

    def open(self) -> None:
        with self.lock:
            self._closed = False
        self.polled_at = time.monotonic()
        self.poller = Service("belay-poller", self.poll_idle, on_crash=self.on_crash).start()

    def stop_claiming(self, grace: float) -> list[Producer]:
        """Stop every producer: a claim under way finishes and hands its jobs
        over, and chunks still gathering run now. Returns the producers."""
        with self.lock:
            self._closed = True
            queues = list(self.live.values())
        for q in queues:
            q.service.stop()
        self.poller.stop()
        for q in queues:
            q.service.join(max(grace, 5.0))
        # Claimed chunk jobs still gathering hold leases: they run now.
        for q in queues:
            q.flush(everything=True)
        return queues

    def close(self, timeout: float) -> None:
        self.poller.join(timeout)
        with self.lock:
            self.live.clear()
            self.idle.clear()
