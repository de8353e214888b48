"""The worker pool (``belay.Worker``): claims jobs under leases and runs them on threads.

Threads (all named, all stopping within their wait timeouts):

- ``belay-producer-<queue>``: claims up to the queue's free slots (§6), polls
  adaptively (``busy_poll`` while claims return work, doubling to
  ``poll_interval``), and is woken early by a finished job or a poke; once a
  claim at ``poll_interval`` finds nothing, the queue is idle and stops polling
  on its own:
- ``belay-poller``: every ``poll_interval``, one read asks which idle queues
  have work now and wakes their producers (§9.1, coalesced: an idle node costs
  one query per interval, not one claim per queue);
- ``belay-exec-<n>``: run the jobs, then ack each with one fenced UPDATE (§7) —
  except a success that settles nothing (no workflow, no parent), which goes to
- ``belay-acker``: acks every such success waiting in one statement, each row
  fenced on its own attempt (deliberate difference 2); the executor thread is
  free as soon as the function returns, the job's slot (and lease) until the
  ack lands;
- ``belay-heartbeat``: renews every local lease in one statement each
  ``lease_ttl / 3`` and enforces timeouts; a lease not renewed is lost, and its
  execution may never ack;
- ``belay-sweeper``: reclaims expired leases of any node (§6), wakes parents
  whose children are done (§8.4) and prunes old rows (§8.7);
- ``belay-queues``: merges the ``belay_queues`` rows over the static queues (§8.6);
- ``belay-cron``: inserts due cron slots, exactly once cluster-wide (§8.5);
- ``belay-listener`` (``notify=True``): LISTEN for pokes (§9.2).

Queues with a global limit, a rate or a partition claim through admission
(§6, :func:`belay.store.claim_admitted`); chunk workers' jobs gather in a
per-queue buffer until their chunk fills or its gather time is up.

Job code never runs on the heartbeat's thread, so a busy job can't starve its
own lease (it still holds the GIL: send CPU-heavy work to several processes).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue as queue_module
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from belay import connect, schema, store
from belay.client import Belay
from belay.context import _CURRENT, Context, Execution, Park
from belay.cron import CronScheduler
from belay.crypto import DecryptionError, decrypt_input, is_encrypted
from belay.errors import ConfigurationError, ValidationError
from belay.job import Job
from belay.outcome import (
    RETURN_SNOOZE,
    Outcome,
    decide,
    default_backoff,
    describe,
    retry_or_fail,
    safe_delay,
    safe_repr,
)
from belay.parts.maintenance import RECLAIM_LIMIT, reclaim_expired
from belay.queues import QueueSpec, adapt_limit, parse_queues
from belay.queues import merge as merge_queues
from belay.registry import DEFAULT_REGISTRY, Chunk, Registry
from belay.retention import (
    DEFAULT_SIGNAL_TTL,
    PRUNE_INTERVAL,
    PRUNE_PAUSE,
    Pass,
    keep_ok,
    parse_retention,
    prune_pass,
)

log = logging.getLogger("belay.worker")

T = TypeVar("T")

#: A job whose kind no worker here knows goes back this far into the future.
UNKNOWN_KIND_SNOOZE = RETURN_SNOOZE

#: Seconds a queue keeps polling at ``busy_poll`` after a claim found work.
HOT_WINDOW = 0.25

#: An idle producer's own look, in poll intervals, should the poller not wake it.
IDLE_BACKSTOP = 20

#: The most successes one batched ack statement carries.
ACK_BATCH = 1000


@dataclass(frozen=True)
class _PendingAck:
    """A success handed to the acker: acked, then reported, then forgotten."""

    execution: Execution
    result: bytes | None
    duration: float


#: Every ``JobEnd.outcome``, as documented on :class:`JobEnd`.
OUTCOMES = ("succeeded", "retry", "failed", "cancelled", "snooze", "await", "woken", "stale",
            "timeout", "lost", "crashed")


@dataclass(frozen=True)
class JobEnd:
    """What an ``on_job_end`` hook receives once per finished execution.

    ``outcome`` is one of :data:`OUTCOMES`:

    - ``succeeded``: the function returned and the result was stored;
    - ``retry``: it raised (or its result could not be stored) and the job runs
      again after its backoff; ``failed``: the same with no attempt left, or a
      budget exceeded, or a step value refused;
    - ``cancelled``: it raised ``Cancel``, or an operator's cancel reached it;
    - ``snooze``: it raised ``Snooze`` or slept durably (no attempt used), or
      its input could not be decrypted here, or another job of its chunk took
      the chunk down with its own control flow;
    - ``await``: it parked waiting for a signal; ``woken``: it parked but the
      signal was already there, so it is ready again at once;
    - ``stale``: the ack was discarded — the job was reclaimed meanwhile, or
      the database stayed away (the lease lapses and it is reclaimed);
    - ``timeout``: it ran past its ``timeout`` (the attempt was failed at the
      deadline); ``lost``: the lease was lost while it ran. In both its
      result or error was discarded;
    - ``crashed``: recording the run failed unexpectedly (logged); the lease
      lapses and the job is reclaimed.

    ``duration`` is in seconds of ``time.monotonic()``, from the claim (for
    a chunk, from the chunk's start) to the end of the run. ``error`` is what
    was recorded: the errors entry (``{"error": "Type: message", "attempt": n,
    "traceback": …}``) for ``retry`` and ``failed``, ``{"reason": …}`` for
    ``cancelled``, a message when the input could not be decrypted, else None.
    ``exception`` is what the function raised (belay's own control flow
    included: ``Snooze``, ``Cancel``, a park or a durable sleep), None when it
    returned.
    """

    job: Job
    outcome: str
    duration: float
    error: Any = None
    exception: BaseException | None = None


def _pool_size(specs: Iterable[QueueSpec]) -> int:
    """Producers + heartbeat + sweeper + queue sync + cron + idle poller + acker,
    and single acks (which may wait their turn)."""
    specs = list(specs)
    return len(specs) + 6 + min(sum(s.limit for s in specs), 16)


class _Queue:
    """One queue's producer on this node: its options, slots and wake-up."""

    def __init__(self, spec: QueueSpec) -> None:
        self.spec = spec
        #: The local limit now: fixed, or adaptive between the spec's min and max.
        self.limit = spec.limit_min if spec.limit_min is not None else spec.limit
        #: Slots taken: running jobs plus chunk jobs waiting in a buffer.
        self.inflight = 0
        self.wake = threading.Event()
        #: Set when the queue left the configuration: the producer exits.
        self.retired = False
        #: Chunk workers' claimed jobs by kind, and when each buffer must go.
        self.buffers: dict[str, list[Execution]] = {}
        self.gather_until: dict[str, float] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    def reconfigure(self, spec: QueueSpec) -> None:
        self.spec = spec
        low = spec.limit_min if spec.limit_min is not None else spec.limit
        self.limit = max(low, min(spec.limit, self.limit))


class Worker:
    """Runs the registered workers' jobs from the given queues.

    ``queues`` maps each queue to its local concurrency limit or to a dict of
    options (see :mod:`belay.queues` and docs/queues.md); ``belay_queues``
    rows written through the client are merged over them every
    ``queue_sync_interval`` seconds. ``crons`` are static cron entries (see
    docs/cron.md). ``.run()`` blocks until SIGTERM/SIGINT; ``.start()`` and
    ``.stop()`` are for embedding. Durations are in seconds.
    """

    def __init__(
        self,
        queues: Mapping[str, Any] | Iterable[str] = ("default",),
        *,
        client: Belay | None = None,
        url: str | None = None,
        registry: Registry | None = None,
        lease_ttl: float = 30.0,
        poll_interval: float = 0.5,
        busy_poll: float = 0.025,
        notify: bool = False,
        shutdown_grace: float = 15.0,
        sweep_interval: float = 5.0,
        queue_sync_interval: float = 5.0,
        crons: Iterable[Mapping[str, Any]] = (),
        cron_interval: float = 20.0,
        retention: Mapping[str, float | None] | None = None,
        signal_ttl: float | None = DEFAULT_SIGNAL_TTL,
        node_id: str | None = None,
    ) -> None:
        self.queues = parse_queues(queues)
        for label, value in (("lease_ttl", lease_ttl), ("poll_interval", poll_interval),
                             ("busy_poll", busy_poll), ("sweep_interval", sweep_interval),
                             ("queue_sync_interval", queue_sync_interval),
                             ("cron_interval", cron_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"{label} must be a number of seconds > 0, got {value!r}")
        if busy_poll > poll_interval:
            raise ConfigurationError("busy_poll must not exceed poll_interval")
        if shutdown_grace < 0:
            raise ConfigurationError("shutdown_grace must be >= 0 seconds")
        self.retention = parse_retention(retention)
        if signal_ttl is not None and not keep_ok(signal_ttl):
            raise ConfigurationError(
                "signal_ttl must be seconds > 0 (at most a century), or None to keep signals; "
                f"got {signal_ttl!r}"
            )
        if client is None:
            from belay import default

            client = Belay(url) if url is not None else default()
        self.client = client
        self.registry = registry if registry is not None else DEFAULT_REGISTRY
        self.lease_ttl = float(lease_ttl)
        self.poll_interval = float(poll_interval)
        self.busy_poll = float(busy_poll)
        self.notify = notify
        self.shutdown_grace = float(shutdown_grace)
        self.sweep_interval = float(sweep_interval)
        self.queue_sync_interval = float(queue_sync_interval)
        self.signal_ttl = None if signal_ttl is None else float(signal_ttl)
        self.node_id = node_id or f"{os.uname().nodename}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        # Every node runs a scheduler, crons or not: rows in belay_crons fire
        # leaderlessly from whichever nodes are up (§8.5).
        self.cron = CronScheduler(self.client, list(crons), registry=self.registry,
                                  interval=cron_interval, notify=notify)
        kept = [keep for keep in self.retention.values() if keep is not None]
        for entry in self.cron.entries:
            if kept and entry.catch_up > min(kept):
                # A slot whose job retention already pruned would fire again.
                raise ConfigurationError(
                    f"cron {entry.name!r}: catch_up ({entry.catch_up:g} s) is longer than the "
                    f"shortest retention ({min(kept):g} s); shorten catch_up or keep jobs longer"
                )
        self._hooks: list[Callable[[JobEnd], None]] = []
        self._start_hooks: list[Callable[[Job], None]] = []
        self._stop_hooks: list[Callable[[], None]] = []
        #: Executions whose start was reported and whose end not yet.
        self._open: set[tuple[int, int]] = set()
        # Reentrant: start() applies the first queue set while holding it.
        self._lock = threading.RLock()
        self._executions: dict[tuple[int, int], Execution] = {}
        #: The queues this node serves now: static merged with belay_queues rows.
        self._live: dict[str, _Queue] = {}
        #: The effective specs of the last ``drain`` (static config + belay_queues rows).
        self._drain_specs: dict[str, QueueSpec] = {}
        self._invalid_rows: dict[str, str] = {}
        #: Queues paused on this node only (``pause_queue``).
        self._paused_here: set[str] = set()
        self._work: queue_module.SimpleQueue[Execution | list[Execution] | None] = (
            queue_module.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._executors: list[threading.Thread] = []
        self._executor_numbers = itertools.count()
        #: Executor threads wanted: the sum of the live queues' maximum limits.
        self._executor_target = 0
        #: Set on stop: producers stop claiming.
        self._stopping = threading.Event()
        #: Set once running jobs had their grace: the heartbeat (which keeps
        #: their leases alive meanwhile) and the sweeper stop.
        self._halted = threading.Event()
        self._stopped = threading.Event()
        self._heartbeat_wake = threading.Event()
        #: Idle queues, whose producers wait for the poller (or a poke) to wake them.
        self._idle: set[_Queue] = set()
        #: Successes waiting for the acker; None stops it.
        self._acks: queue_module.SimpleQueue[_PendingAck | None] = queue_module.SimpleQueue()
        self._acker: threading.Thread | None = None
        #: Marks executor threads: only their successes are acked in batches
        #: (``drain()`` and direct calls ack before they return).
        self._local = threading.local()
        self._pool: ConnectionPool | None = None
        self._listener: Any = None
        self._channel = ""
        self._started = False

    # -- Lifecycle -------------------------------------------------------------------

    def on_job_start(self, hook: Callable[[Job], None]) -> Callable[[Job], None]:
        """Call ``hook(job)`` as each execution starts, on its thread, before the
        function runs; usable as a decorator. A hook that raises is logged."""
        self._start_hooks.append(hook)
        return hook

    def on_job_end(self, hook: Callable[[JobEnd], None]) -> Callable[[JobEnd], None]:
        """Call ``hook(JobEnd)`` once after every execution that started (for
        metrics); usable as a decorator. A hook that raises is logged."""
        self._hooks.append(hook)
        return hook

    def on_stop(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call ``hook()`` once ``stop()`` is done (to close what serves this
        worker, like a metrics endpoint); usable as a decorator."""
        self._stop_hooks.append(hook)
        return hook

    def start(self) -> None:
        """Check the schema, open the pool and start the threads; idempotent."""
        with self._lock:
            if self._started:
                return
            with self.client.connect(autocommit=True) as probe:
                schema.check(probe)
                self._channel = self.client.notify_channel(probe)
                specs = self._effective_specs(probe)
            self._pool = connect.pool(
                self.client.conninfo, self.client.pooler,
                min_size=1, max_size=_pool_size(specs.values()), name="belay-worker", open=True,
                kwargs={"application_name": "belay-worker"},
            )
            self._stopping.clear()
            self._halted.clear()
            self._stopped.clear()
            self._work = queue_module.SimpleQueue()
            self._executor_target = 0
            self._acks = queue_module.SimpleQueue()
            self._acker = threading.Thread(target=self._ack_loop, name="belay-acker",
                                           daemon=True)
            self._acker.start()
            self._apply(specs)
            self._spawn(self._heartbeat, "belay-heartbeat")
            self._spawn(self._sweep, "belay-sweeper")
            self._spawn(self._sync_loop, "belay-queues")
            self._spawn(self._poll_idle, "belay-poller")
            listen = self.client.listen_conninfo
            if self.notify and listen is not None:
                from belay.notify import Listener

                self._listener = Listener(
                    listen, self._channel, self._on_notify, name="belay-listener"
                )
                self._listener.start()
            self.cron.start()
            self._started = True
        log.info("belay worker %s started: queues %s", self.node_id,
                 {name: q.spec.to_opts() for name, q in self._live.items()})

    def _spawn(self, target: Callable[[], None], name: str, *, executor: bool = False) -> None:
        # Daemon threads: a job stuck past the shutdown grace must not hold the
        # process open (its lease lapses and another node reclaims it).
        thread = threading.Thread(target=target, name=name, daemon=True)
        (self._executors if executor else self._threads).append(thread)
        thread.start()

    def stop(self, grace: float | None = None) -> list[int]:
        """Stop claiming, give running jobs ``grace`` seconds (default
        ``shutdown_grace``), then stop. Returns the ids of jobs still running,
        left to lease expiry and reclaim. Idempotent."""
        with self._lock:
            if not self._started:
                return []
            self._started = False
        grace = self.shutdown_grace if grace is None else grace
        self._stopping.set()
        self.cron.stop()
        with self._lock:
            queues = list(self._live.values())
        for q in queues:
            q.wake.set()
        # A claim already under way finishes and hands its jobs over before
        # the running set is read, so they get their grace too.
        producers = [t for t in self._threads if t.name.startswith("belay-producer-")]
        for thread in producers:
            thread.join(max(grace, 5.0))
        # Claimed chunk jobs still gathering hold leases: they run now.
        for q in queues:
            self._flush_chunks(q, everything=True)
        deadline = time.monotonic() + grace
        for execution in self._running():
            execution.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = [e.job.id for e in self._running()]
        if abandoned:
            log.warning("belay worker %s: jobs %s still running after %.1fs grace; their "
                        "leases will lapse and another worker will reclaim them",
                        self.node_id, abandoned, grace)
        with self._lock:
            executors = list(self._executors)
            self._executor_target = 0
        for _ in executors:
            self._work.put(None)
        busy = {e.thread for e in self._running()}
        for thread in executors:
            if thread.ident not in busy:
                thread.join(1.0)
        self._stop_acker()
        self._halted.set()
        self._heartbeat_wake.set()
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        for thread in self._threads:
            thread.join(max(1.0, self.poll_interval * 2))
        self._threads.clear()
        self._executors.clear()
        with self._lock:
            self._live.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._stopped.set()
        for hook in list(self._stop_hooks):
            try:
                hook()
            except Exception:
                log.exception("belay: on_stop hook %r failed", hook)
        log.info("belay worker %s stopped", self.node_id)
        return abandoned

    def run(self) -> None:
        """Run until SIGTERM or SIGINT (then drain for ``shutdown_grace``); a second
        signal exits at once. Signal handlers install only in the main thread."""
        requested = threading.Event()
        previous: dict[int, Any] = {}

        def handle(signum: int, frame: FrameType | None) -> None:
            if requested.is_set():
                log.warning("second signal: exiting at once")
                os._exit(1)
            log.info("signal %d: stopping (grace %.1fs)", signum, self.shutdown_grace)
            requested.set()

        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, handle)
        try:
            self.start()
            while not requested.wait(0.5) and not self._stopped.is_set():
                pass
            self.stop()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Queues: static, dynamic, paused (§8.6) ----------------------------------------

    def live_queues(self) -> dict[str, QueueSpec]:
        """The queues this node serves now, with their effective options."""
        with self._lock:
            return {name: q.spec for name, q in self._live.items()}

    def queue_limit(self, queue: str) -> int | None:
        """The queue's current local limit here (adaptive limits move); None if not served."""
        with self._lock:
            found = self._live.get(queue)
            return None if found is None else found.limit

    def pause_queue(self, queue: str) -> None:
        """Stop claiming from ``queue`` on this node only (running jobs finish).
        ``Belay.pause_queue`` pauses it on every node."""
        with self._lock:
            self._paused_here.add(queue)

    def resume_queue(self, queue: str) -> None:
        with self._lock:
            self._paused_here.discard(queue)
            found = self._live.get(queue)
        if found is not None:
            found.wake.set()

    def sync_queues(self) -> dict[str, QueueSpec]:
        """Merge the ``belay_queues`` rows over the static queues now (the
        ``belay-queues`` thread does this every ``queue_sync_interval``)."""
        if not self._started:
            with self._connection() as conn:
                return self._effective_specs(conn)
        with self._connection() as conn:
            specs = self._effective_specs(conn)
        self._apply(specs)
        return specs

    def _effective_specs(self, conn: psycopg.Connection[Any]) -> dict[str, QueueSpec]:
        specs, invalid = merge_queues(self.queues, store.list_queues(conn))
        for name, reason in invalid.items():
            if self._invalid_rows.get(name) != reason:
                log.error("belay: belay_queues row %r is ignored: %s", name, reason)
        self._invalid_rows = invalid
        return specs

    def _sync_loop(self) -> None:
        while not self._stopping.wait(self.queue_sync_interval):
            try:
                self.sync_queues()
            except Exception:
                log.exception("belay: syncing queues failed; keeping the current ones")

    def _apply(self, specs: Mapping[str, QueueSpec]) -> None:
        """Start producers for new queues, retire removed ones, reconfigure the rest."""
        with self._lock:
            if self._stopping.is_set():
                return
            started: list[_Queue] = []
            for name, spec in specs.items():
                current = self._live.get(name)
                if current is None:
                    current = self._live[name] = _Queue(spec)
                    started.append(current)
                elif current.spec != spec:
                    log.info("belay: queue %r now %s", name, spec.to_opts())
                    current.reconfigure(spec)
                    current.wake.set()
            for name in [n for n in self._live if n not in specs]:
                gone = self._live.pop(name)
                gone.retired = True
                gone.wake.set()
                log.info("belay: queue %r removed; its running jobs finish", name)
            self._resize_executors(sum(q.spec.limit for q in self._live.values()))
            if self._pool is not None:
                wanted = _pool_size(q.spec for q in self._live.values())
                if wanted != self._pool.max_size:
                    self._pool.resize(1, wanted)
        for q in started:
            self._spawn(functools.partial(self._produce, q), f"belay-producer-{q.name}")

    def _resize_executors(self, target: int) -> None:
        """Grow the executor threads to ``target`` or retire the extra ones (lock held)."""
        while self._executor_target < target:
            self._executor_target += 1
            self._spawn(self._exec_loop, f"belay-exec-{next(self._executor_numbers)}",
                        executor=True)
        while self._executor_target > target:
            self._executor_target -= 1
            self._work.put(None)

    # -- Claiming ----------------------------------------------------------------------

    def _now(self) -> datetime:
        return self.client.clock.now()

    def _demand(self, q: _Queue) -> int:
        with self._lock:
            if q.spec.paused or q.name in self._paused_here:
                return 0
            return q.limit - q.inflight

    def _produce(self, q: _Queue) -> None:
        interval = self.busy_poll
        last_hit = 0.0
        while not self._stopping.is_set() and not q.retired:
            claimed = demand = 0
            try:
                demand = self._demand(q)
                if demand > 0:
                    claimed = self._claim(q, demand)
                    self._adapt(q, claimed, demand)
                self._flush_chunks(q)
            except Exception:
                log.exception("belay: claiming from %r failed; retrying", q.name)
                interval = self.poll_interval
            # Hot while claims find work and for HOT_WINDOW after (jobs that
            # trickle in keep being picked up at busy_poll), then decaying to
            # the idle ceiling (§9.1); a claim at the ceiling that finds nothing
            # leaves the queue to the poller (with a long backstop, should the
            # poller be stuck).
            idle = demand > 0 and not claimed and interval >= self.poll_interval
            if claimed:
                last_hit = time.monotonic()
            hot = time.monotonic() - last_hit < HOT_WINDOW
            interval = self.busy_poll if hot else min(interval * 2, self.poll_interval)
            wait = interval * IDLE_BACKSTOP if idle else interval
            with self._lock:
                if q.gather_until:
                    wait = min(wait, max(0.0, min(q.gather_until.values()) - time.monotonic()))
                if idle:
                    self._idle.add(q)
            q.wake.wait(wait)
            q.wake.clear()
            if idle:
                with self._lock:
                    self._idle.discard(q)
        # Leaving (stop, or the queue left the configuration): chunks still
        # gathering hold claimed jobs under renewed leases; they run now.
        self._flush_chunks(q, everything=True)

    def _poll_idle(self) -> None:
        """One read per ``poll_interval`` for every idle queue; wakes the
        producers of those with work. A failed read wakes them all, so they
        claim (and log) on their own until the database answers again."""
        while not self._stopping.wait(self.poll_interval):
            with self._lock:
                idle = {q.name: q for q in self._idle if not q.retired}
            if not idle:
                continue
            try:
                assert self._pool is not None
                with self._pool.connection() as conn:
                    busy = store.queues_with_work(conn, sorted(idle), self._now())
            except Exception:
                log.warning("belay: polling idle queues failed", exc_info=True)
                busy = set(idle)
            for name in busy:
                idle[name].wake.set()

    def _adapt(self, q: _Queue, claimed: int, demand: int) -> None:
        spec = q.spec
        if spec.limit_min is None:
            return
        with self._lock:
            before = q.limit
            q.limit = adapt_limit(before, spec.limit_min, spec.limit, claimed=claimed,
                                  demand=demand, busy=q.inflight)
        if q.limit != before:
            log.debug("belay: queue %r limit %d → %d", q.name, before, q.limit)

    def _claim(self, q: _Queue, demand: int) -> int:
        assert self._pool is not None
        jobs = self._claim_jobs(q.spec, demand)
        for job in jobs:
            definition = self.registry.get(job.kind)
            if definition is None:
                self._return_unknown(job)
                continue
            # A chunk job's timeout starts when its chunk does, not while it gathers.
            timeout = None if definition.chunk is not None else definition.timeout
            execution = Execution(job, definition, timeout)
            execution.owner = q
            with self._lock:
                self._executions[execution.key] = execution
                q.inflight += 1
                if definition.chunk is not None:
                    self._buffer(q, execution, definition.chunk)
                    continue
            if execution.deadline is not None:
                self._heartbeat_wake.set()
            self._work.put(execution)
        return len(jobs)

    def _claim_jobs(self, spec: QueueSpec, demand: int) -> list[Job]:
        assert self._pool is not None
        with self._pool.connection() as conn:
            if not spec.admitted:
                now = self._now()
                lease_until = now + timedelta(seconds=self.lease_ttl)
                return store.claim(conn, spec.name, demand, self.node_id, now, lease_until)
            with conn.transaction():
                store.lock_for_claim(conn, spec)
                now = self._now()  # after the lock (store.lock_for_claim says why)
                lease_until = now + timedelta(seconds=self.lease_ttl)
                return store.claim_admitted(conn, spec, demand, self.node_id, now, lease_until,
                                            locked=True)

    def _buffer(self, q: _Queue, execution: Execution, chunk: Chunk) -> None:
        """Hold a chunk worker's job until its chunk fills or its gather time is up
        (lock held). Never longer than half the lease: the lease is renewed
        meanwhile, but a gather must not be what makes it lapse."""
        kind = execution.job.kind
        buffered = q.buffers.setdefault(kind, [])
        buffered.append(execution)
        gather = min(chunk.gather_ms / 1000.0, self.lease_ttl / 2)
        if kind not in q.gather_until:
            q.gather_until[kind] = time.monotonic() + gather
        if len(buffered) >= chunk.size:
            while len(buffered) >= chunk.size:
                self._work.put(buffered[:chunk.size])
                del buffered[:chunk.size]
            # What is left starts a gather of its own.
            q.gather_until[kind] = time.monotonic() + gather
        if not buffered:
            del q.buffers[kind]
            del q.gather_until[kind]

    def _flush_chunks(self, q: _Queue, *, everything: bool = False) -> None:
        """Hand over the buffers whose gather time is up (all of them on stop)."""
        now = time.monotonic()
        with self._lock:
            for kind in [k for k, until in q.gather_until.items() if everything or until <= now]:
                self._work.put(q.buffers.pop(kind))
                del q.gather_until[kind]

    def _return_unknown(self, job: Job) -> None:
        """Not run, not lost, not an attempt: snoozed back for a worker that knows it."""
        log.error("belay: no worker for kind %r (job %d, queue %r) on this node; it goes back "
                  "to the queue for %.0fs. Registered kinds: %s", job.kind, job.id, job.queue,
                  UNKNOWN_KIND_SNOOZE, ", ".join(self.registry.kinds()) or "none")
        outcome = Outcome("snooze", at=self._now() + timedelta(seconds=UNKNOWN_KIND_SNOOZE))
        self._ack(job, outcome)

    def _on_notify(self, message: dict[str, Any]) -> None:
        if message.get("t") == "p":
            with self._lock:
                found = self._live.get(message.get("q"))  # type: ignore[arg-type]
            if found is not None:
                found.wake.set()

    # -- Running -----------------------------------------------------------------------

    def _exec_loop(self) -> None:
        self._local.executor = True
        while True:
            item = self._work.get()
            if item is None:
                with self._lock, contextlib.suppress(ValueError):
                    self._executors.remove(threading.current_thread())
                return
            executions = item if isinstance(item, list) else [item]
            try:
                if isinstance(item, list):
                    self.execute_chunk(item)
                else:
                    self.execute(item)
            except BaseException:
                log.exception("belay: executing job(s) %s crashed the executor",
                              [e.job.id for e in executions])
            finally:
                for execution in executions:
                    self._release(execution)

    def _release(self, execution: Execution) -> None:
        """Forget the execution and free its slot — unless its ack is pending:
        then the acker does, once the ack lands. The slot stays taken until
        then, so a queue never holds more claimed-but-unacked jobs than its
        limit: the claims wait for the acks (backpressure), instead of
        running ahead of them."""
        if not execution.ack_pending:
            self._forget(execution)

    def _forget(self, execution: Execution) -> None:
        owner: _Queue | None = execution.owner
        with self._lock:
            self._executions.pop(execution.key, None)
            if owner is not None:
                owner.inflight -= 1
        execution.done.set()
        if owner is not None:
            owner.wake.set()

    def execute(self, execution: Execution) -> str:
        """Run one claimed execution and ack it; returns the outcome recorded."""
        try:
            return self._execute(execution)
        except BaseException as exc:
            self._crashed([execution], exc)
            raise

    def _execute(self, execution: Execution) -> str:
        execution.thread = threading.get_ident()
        if not self._decrypt(execution):
            return "snooze"
        definition = execution.definition
        assert definition is not None
        self._job_started(execution)
        ctx = self._context(execution)
        raised: BaseException | None = None
        returned: Any = None
        token = _CURRENT.set(ctx)
        try:
            returned = definition(ctx)
        except BaseException as exc:  # the job's failure, whatever it raised
            raised = exc
        finally:
            _CURRENT.reset(token)
        return self._conclude(execution, returned, raised)

    def execute_chunk(self, executions: list[Execution]) -> dict[int, str]:
        """Run a chunk worker once over several claimed jobs, then ack each one
        on its own (fenced, §7); returns the outcome recorded per job id.

        The function returns None (every job succeeded) or a dict of job id →
        result, where an exception instance fails (or cancels, or snoozes) that
        job alone. If it raises, every job gets that error — unless the raise is
        one job's own control flow (await, sleep, budget, cancel, a lost lease):
        that job takes it, and the others go back to the queue without using
        an attempt (their journaled steps make the rerun cheap).
        """
        try:
            return self._execute_chunk(executions)
        except BaseException as exc:
            # A success already handed to the acker is the acker's to report.
            self._crashed([e for e in executions if not e.ack_pending], exc)
            raise

    def _execute_chunk(self, executions: list[Execution]) -> dict[int, str]:
        outcomes: dict[int, str] = {}
        runnable: list[Execution] = []
        for execution in executions:
            execution.thread = threading.get_ident()
            if self._decrypt(execution):
                runnable.append(execution)
            else:
                outcomes[execution.job.id] = "snooze"
        if not runnable:
            return outcomes
        definition = runnable[0].definition
        assert definition is not None
        for execution in runnable:
            execution.restart_clock(definition.timeout)
            self._job_started(execution)
        if definition.timeout is not None:
            self._heartbeat_wake.set()
        contexts = [self._context(execution) for execution in runnable]
        raised: BaseException | None = None
        returned: Any = None
        try:
            returned = definition.fn(contexts)  # type: ignore[arg-type]
        except BaseException as exc:
            raised = exc
        if raised is not None:
            owner = next((e for e in runnable if e.control is raised), None)
            for execution in runnable:
                if owner is None or execution is owner:
                    outcomes[execution.job.id] = self._conclude_one(execution, None, raised)
                else:
                    outcomes[execution.job.id] = self._conclude_one(
                        execution, None, None, outcome=Outcome("snooze", at=self._now()))
            return outcomes
        try:
            ends = self._chunk_ends(definition.kind, runnable, returned)
        except BaseException as exc:  # user code: a Mapping's __iter__, a key's __eq__ …
            bad = ValidationError(f"the chunk worker's return value could not be read: "
                                  f"{describe(exc)}")
            ends = {e.job.id: (None, bad) for e in runnable}
        for execution in runnable:
            result, error = ends[execution.job.id]
            outcomes[execution.job.id] = self._conclude_one(execution, result, error)
        return outcomes

    def _chunk_ends(self, kind: str, runnable: list[Execution], returned: Any
                    ) -> dict[int, tuple[Any, BaseException | None]]:
        """(result, raised) per job id from a chunk worker's return value."""
        if returned is None:
            return {e.job.id: (None, None) for e in runnable}
        if not isinstance(returned, Mapping):
            bad = ValidationError("a chunk worker returns None or a dict of job id → result, "
                                  f"got {type(returned).__name__}")
            return {e.job.id: (None, bad) for e in runnable}
        by_id: Mapping[Any, Any] = returned
        strays = set(by_id) - {e.job.id for e in runnable}
        if strays:
            log.warning("belay: chunk worker %s returned outcomes for jobs not in its chunk: %s",
                        kind, sorted(map(safe_repr, strays)))
        ends: dict[int, tuple[Any, BaseException | None]] = {}
        for execution in runnable:
            job_id = execution.job.id
            if job_id not in by_id:
                ends[job_id] = (None, ValidationError(
                    f"the chunk worker returned no outcome for job {job_id}"))
                continue
            mine = by_id[job_id]
            # issubclass of the type: isinstance would read a user object's __class__.
            ends[job_id] = (None, mine) if issubclass(type(mine), BaseException) else (mine, None)
        return ends

    def _conclude_one(self, execution: Execution, returned: Any, raised: BaseException | None,
                      *, outcome: Outcome | None = None) -> str:
        """Conclude one job of a chunk: one that can't be acked (the database
        refused) must not keep the others from theirs."""
        try:
            return self._conclude(execution, returned, raised, outcome=outcome)
        except Exception as exc:
            log.exception("belay: recording job %d attempt %d failed; its lease will lapse and "
                          "it will be reclaimed", execution.job.id, execution.job.attempt)
            self._crashed([execution], exc)
            return "crashed"

    def _decrypt(self, execution: Execution) -> bool:
        """Decrypt an encrypted input in place; False when it can't be (the job was
        snoozed back: not its fault and not an attempt, for a worker with the key)."""
        if not is_encrypted(execution.job.input):
            return True
        try:
            plain = decrypt_input(execution.job.input, self.client.encryption_key)
        except (DecryptionError, ConfigurationError) as exc:
            log.error("belay: job %d: %s; it goes back to the queue for %.0fs",
                      execution.job.id, exc, UNKNOWN_KIND_SNOOZE)
            execution.end("acked")
            self._job_started(execution)
            when = self._now() + timedelta(seconds=UNKNOWN_KIND_SNOOZE)
            self._ack(execution.job, Outcome("snooze", at=when))
            self._finished(execution.job, "snooze", 0.0, str(exc))
            return False
        execution.job = execution.job.replace(input=plain)
        return True

    def _context(self, execution: Execution) -> Context:
        owner: _Queue | None = execution.owner
        spec = owner.spec if owner is not None else self._spec_for(execution.job.queue)
        return Context(execution, self.client, self.registry, notify=self.notify,
                       rate=None if spec is None else spec.rate)

    def _spec_for(self, queue: str) -> QueueSpec | None:
        with self._lock:
            live = self._live.get(queue)
        if live is not None:
            return live.spec
        drained = self._drain_specs.get(queue)
        return drained if drained is not None else self.queues.get(queue)

    def _conclude(self, execution: Execution, returned: Any, raised: BaseException | None,
                  *, outcome: Outcome | None = None) -> str:
        """Ack what a run returned or raised (or ``outcome``); returns the outcome's name."""
        job, definition = execution.job, execution.definition
        assert definition is not None
        duration = time.monotonic() - execution.started
        if not execution.end("acked"):
            why = execution.ended or "ended"
            log.warning("belay: job %d attempt %d %s; its %s is discarded", job.id, job.attempt,
                        "lost its lease" if why == "lost" else "timed out",
                        "error" if raised is not None else "result")
            self._finished(job, why, duration, None, raised)
            return why
        # issubclass of the type: isinstance would read a user object's __class__.
        if raised is not None and issubclass(type(raised), Park):
            assert isinstance(raised, Park)
            kind = self._park(job, raised)
            self._finished(job, kind, duration, None, raised)
            return kind
        if outcome is None:
            outcome = decide(returned=returned, raised=raised, attempt=job.attempt,
                             max_attempts=job.max_attempts, now=self._now(),
                             backoff=definition.backoff)
        if outcome.kind == "succeeded" and store.batchable(job) and self._defer_ack(
                _PendingAck(execution, outcome.result, duration)):
            return "succeeded"
        acked = self._ack(job, outcome)
        kind = outcome.kind if acked else "stale"
        self._finished(job, kind, duration, outcome.error, raised)
        return kind

    def _ack(self, job: Job, outcome: Outcome) -> bool:
        """One fenced ack in its own transaction; False when stale (discarded)."""
        if self._pool is None:
            log.warning("belay: job %d attempt %d finished after its worker stopped; its "
                        "lease will lapse and it will be reclaimed", job.id, job.attempt)
            return False
        def write(conn: psycopg.Connection[Any]) -> store.Acked | None:
            with conn.transaction():
                acked = store.ack(conn, job, outcome.kind, self._now(), result=outcome.result,
                                  error=outcome.error, at=outcome.at)
                if acked is not None:
                    self._notify_acked(conn, acked)
            return acked

        done, acked = self._write_ack(f"ack of job {job.id}", write)
        if done and acked is None:
            log.warning("belay: stale ack for job %d attempt %d discarded (the job was "
                        "reclaimed)", job.id, job.attempt)
        return acked is not None

    def _write_ack(self, what: str, write: Callable[[psycopg.Connection[Any]], T]
                   ) -> tuple[bool, T | None]:
        """Run an ack on a pooled connection, three tries when the database
        blinks; (False, None) once it stays away — the leases then lapse and
        the jobs are reclaimed (at-least-once)."""
        assert self._pool is not None
        for attempt in range(3):
            try:
                with self._pool.connection() as conn:
                    return True, write(conn)
            except psycopg.OperationalError:
                log.warning("belay: %s failed (try %d)", what, attempt + 1, exc_info=True)
                self._halted.wait(0.2 * (attempt + 1))
        return False, None

    # -- Batched acks (deliberate difference 2) -------------------------------------------

    def _defer_ack(self, pending: _PendingAck) -> bool:
        """Hand a success to the acker; False (ack it yourself) off an executor
        thread or once the acker is stopping."""
        if not getattr(self._local, "executor", False):
            return False
        with self._lock:
            if self._acker is None:
                return False
            pending.execution.ack_pending = True
            self._acks.put(pending)
        return True

    def _stop_acker(self) -> None:
        """Ack what is pending, then stop the acker (before the pool closes)."""
        with self._lock:
            acker, self._acker = self._acker, None
        if acker is not None:
            self._acks.put(None)
            acker.join()

    def _ack_loop(self) -> None:
        """Take every success waiting — one, or as many as piled up while the
        last batch was in flight — and ack them in one statement. No timer:
        a lone success is acked at once, so batching costs no latency."""
        while True:
            item = self._acks.get()
            batch: list[_PendingAck] = []
            stopping = item is None
            if item is not None:
                batch.append(item)
            while not stopping and len(batch) < ACK_BATCH:
                try:
                    item = self._acks.get_nowait()
                except queue_module.Empty:
                    break
                if item is None:
                    stopping = True
                else:
                    batch.append(item)
            if batch:
                try:
                    self._ack_batch(batch)
                except BaseException as exc:
                    log.exception("belay: batched ack of jobs %s failed; their leases will "
                                  "lapse and they will be reclaimed",
                                  [p.execution.job.id for p in batch])
                    self._crashed([p.execution for p in batch], exc)
                    for pending in batch:
                        self._forget(pending.execution)
            if stopping:
                return

    def _ack_batch(self, batch: list[_PendingAck]) -> None:
        rows = [(p.execution.job, p.result) for p in batch]
        channel = self._channel if self.notify else None
        done, acked = self._write_ack(
            f"batched ack of {len(batch)} jobs",
            lambda conn: store.ack_succeeded_many(conn, rows, self._now(), channel))
        for pending in batch:
            job = pending.execution.job
            kind = "succeeded" if acked is not None and job.id in acked else "stale"
            if done and kind == "stale":
                log.warning("belay: stale ack for job %d attempt %d discarded (the job was "
                            "reclaimed)", job.id, job.attempt)
            self._finished(job, kind, pending.duration, None)
            self._forget(pending.execution)

    def _park(self, job: Job, park: Park) -> str:
        """§7 park-and-wake: "await", or "ready" when the signal was already there."""
        if self._pool is None:
            return "stale"
        with self._pool.connection() as conn, conn.transaction():
            parked = store.park_await(conn, job.id, job.attempt, park.scope, park.name,
                                      park.deadline, self._now())
            if parked == "ready" and self.notify:
                store.notify(conn, self._channel, [store.poke_payload(job.queue)])
        if parked is None:
            log.warning("belay: stale park of job %d attempt %d discarded", job.id, job.attempt)
            return "stale"
        return "await" if parked == "awaiting" else "woken"

    def _notify_acked(self, conn: psycopg.Connection[Any], acked: store.Acked) -> None:
        """Inside the ack's transaction: poke the queues it made work for, and
        announce the results it finished (§9.2). Only with ``notify=True``: a
        NOTIFY serializes commits, so it is opt-in, like the LISTEN side."""
        if not self.notify:
            return
        results = [acked.job.id] if acked.job.terminal else []
        results += acked.settled.cancelled
        store.notify(conn, self._channel,
                     [store.poke_payload(q) for q in {q for _, q in acked.settled.ready}]
                     + [store.result_payload(i) for i in results])

    def _job_started(self, execution: Execution) -> None:
        """Report an execution's start to the ``on_job_start`` hooks."""
        with self._lock:
            self._open.add(execution.key)
        for hook in self._start_hooks:
            try:
                hook(execution.job)
            except BaseException:  # a hook's failure, whatever its class, is not the job's
                log.exception("belay: on_job_start hook %s failed", safe_repr(hook))

    def _crashed(self, executions: Iterable[Execution], exc: BaseException) -> None:
        """End, as ``crashed``, the started executions whose end was not reported."""
        for execution in executions:
            with self._lock:  # check and claim the report in one step
                unreported = execution.key in self._open
                self._open.discard(execution.key)
            if unreported:
                self._report(execution.job, "crashed", time.monotonic() - execution.started,
                             None, exc)

    def _finished(self, job: Job, outcome: str, duration: float, error: Any,
                  exception: BaseException | None = None) -> None:
        with self._lock:
            self._open.discard((job.id, job.attempt))
        self._report(job, outcome, duration, error, exception)

    def _report(self, job: Job, outcome: str, duration: float, error: Any,
                exception: BaseException | None) -> None:
        log.info("job %d %s queue=%s %s attempt=%d in %.3fs", job.id, job.kind, job.queue,
                 outcome, job.attempt, duration)
        event = JobEnd(job, outcome, duration, error, exception)
        for hook in self._hooks:
            try:
                hook(event)
            except BaseException:  # after the ack: it must not stop a chunk's other acks
                log.exception("belay: on_job_end hook %s failed", safe_repr(hook))

    def _running(self) -> list[Execution]:
        with self._lock:
            return list(self._executions.values())

    # -- Leases and timeouts (§6) ------------------------------------------------------

    def _heartbeat(self) -> None:
        period = self.lease_ttl / 3
        next_renew = time.monotonic() + period
        while not self._halted.is_set():
            try:
                now = time.monotonic()
                if now >= next_renew:
                    self._renew()
                    next_renew = now + period
                self._enforce_timeouts()
            except Exception:
                log.exception("belay: heartbeat failed; retrying")
            deadlines = [e.deadline for e in self._running()
                         if e.deadline is not None and e.ended is None]
            wake_at = min([next_renew, *deadlines])
            self._heartbeat_wake.wait(max(0.01, min(wake_at - time.monotonic(), period)))
            self._heartbeat_wake.clear()

    def _renew(self) -> None:
        assert self._pool is not None
        live = [e for e in self._running() if e.ended is None]
        if not live:
            return
        until = self._now() + timedelta(seconds=self.lease_ttl)
        with self._pool.connection() as conn:
            held = store.renew_leases(conn, [e.key for e in live], self.node_id, until)
        for execution in live:
            if execution.key not in held and execution.end("lost"):
                log.warning("belay: lost the lease of job %d attempt %d; its result will be "
                            "discarded", execution.job.id, execution.job.attempt)

    def _enforce_timeouts(self) -> None:
        now = time.monotonic()
        for execution in self._running():
            if execution.deadline is None or now < execution.deadline:
                continue
            if not execution.end("timeout"):
                continue
            job, definition = execution.job, execution.definition
            assert definition is not None
            # The thread can't be killed: this attempt is failed now, the slot
            # stays taken until the function returns, and the context refuses
            # further steps.
            error = {"error": f"timeout: ran longer than {definition.timeout:g}s",
                     "attempt": job.attempt}
            outcome = retry_or_fail(error, job.attempt, job.max_attempts, self._now(),
                                    definition.backoff)
            self._ack(job, outcome)

    # -- Reclaim (§6) ------------------------------------------------------------------

    def _sweep(self) -> None:
        swept_at = prune_due = 0.0
        wait = self.sweep_interval
        while not self._halted.wait(wait):
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
                    behind = self._prune_pass().behind
                except Exception:
                    log.exception("belay: pruning old jobs failed; retrying")
                # Behind (expired jobs left when the pass's budget ran out): the
                # next pass follows shortly, so retention keeps up with a busy
                # deployment; reclaim still runs every sweep_interval between.
                prune_due = time.monotonic() + (PRUNE_PAUSE if behind else PRUNE_INTERVAL)
            wait = max(0.0, min(self.sweep_interval - (time.monotonic() - swept_at),
                                prune_due - time.monotonic()))

    def prune(self) -> dict[str, int]:
        """§8.7 retention, one pass: delete terminal jobs older than their state's
        retention (with their steps and events, in batches), signals past
        ``signal_ttl`` and rate windows no claim reads any more. Never a
        non-terminal job; a workflow's members only once all of them are past
        their retention, children only once their parent is.
        Returns how many rows went, by kind."""
        return self._prune_pass().counts

    def _prune_pass(self) -> Pass:
        with self._connection() as conn:
            # Not started: the static queues with the belay_queues rows over them,
            # as drain() serves them.
            specs = self.live_queues() or self._effective_specs(conn)
            return prune_pass(
                conn, self._now(), self.retention, self.signal_ttl,
                [s.rate.period for s in specs.values() if s.rate is not None],
                rest=self._halted.wait,
            )

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; outside start()/stop(), a short-lived pool of its own."""
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        with self.client.connect(autocommit=True) as probe:
            schema.check(probe)
            self._channel = self.client.notify_channel(probe)
        self._pool = connect.pool(self.client.conninfo, self.client.pooler, min_size=1,
                                  max_size=2, name="belay-worker-sync", open=True)
        try:
            with self._pool.connection() as conn:
                yield conn
        finally:
            self._pool.close()
            self._pool = None

    def reclaim(self, limit: int = RECLAIM_LIMIT) -> int:
        """Retry or fail jobs whose leases expired (any node's); returns how many."""
        with self._connection() as conn:
            return reclaim_expired(conn, self._now(), self._backoff_for, self._notify_acked,
                                   limit)

    def reconcile(self) -> int:
        """§8.4 backstop (race R2): wake parents whose children are all terminal
        but which still await ``$children``; returns how many."""
        with self._connection() as conn, conn.transaction():
            woken = store.resettle_parents(conn, self._now())
            if woken and self.notify:
                store.notify(conn, self._channel, [store.poke_payload(q) for _, q in woken])
        for job_id, _ in woken:
            log.warning("belay: reconciler woke parent job %d (its children are done)", job_id)
        return len(woken)

    def _backoff_for(self, job: Job) -> float:
        definition = self.registry.get(job.kind)
        backoff = definition.backoff if definition is not None else default_backoff
        return safe_delay(backoff, job.attempt)

    # -- Synchronous running (tests, scripts) ----------------------------------------------

    def drain(self, max_jobs: int | None = None) -> dict[str, int]:
        """Run every job claimable now, in this thread, until none is left (or
        ``max_jobs``); returns counts by outcome. No threads start.

        Admission applies (limits, rate windows, partitions, pauses from the
        ``belay_queues`` rows), as on a running worker; a chunk worker's jobs
        run in chunks of whatever is claimable now, up to its size.
        """
        counts: dict[str, int] = {}
        with self._connection() as conn:
            effective = self._effective_specs(conn)
            # A drained job's ctx.debit trues up against the rate it was admitted by.
            self._drain_specs = effective
            specs = [effective[name] for name in self.queues if name in effective
                     and not effective[name].paused and name not in self._paused_here]
            ran = 0
            while max_jobs is None or ran < max_jobs:
                batch = self._claim_for_drain(specs, None if max_jobs is None else max_jobs - ran)
                if not batch:
                    break
                for outcome in self._run_drained(batch):
                    counts[outcome] = counts.get(outcome, 0) + 1
                ran += len(batch)
        return counts

    def _claim_for_drain(self, specs: list[QueueSpec], room: int | None) -> list[Job]:
        """One job, or for a chunk worker as much of a chunk as is claimable now."""
        for spec in specs:
            jobs = self._claim_jobs(spec, 1)
            if not jobs:
                continue
            definition = self.registry.get(jobs[0].kind)
            if definition is not None and definition.chunk is not None:
                more = definition.chunk.size - 1 if room is None else min(
                    definition.chunk.size, room) - 1
                if more > 0:
                    jobs += self._claim_jobs(spec, more)
            return jobs
        return []

    def _run_drained(self, jobs: list[Job]) -> list[str]:
        outcomes: list[str] = []
        chunks: dict[str, list[Execution]] = {}
        sizes: dict[str, int] = {}
        for job in jobs:
            definition = self.registry.get(job.kind)
            if definition is None:
                self._return_unknown(job)
                outcomes.append("unknown")
            elif definition.chunk is not None:
                chunks.setdefault(job.kind, []).append(Execution(job, definition, None))
                sizes[job.kind] = definition.chunk.size
            else:
                outcomes.append(self.execute(Execution(job, definition, None)))
        # The claim may hold several chunk kinds: each runs in chunks of its own size.
        for kind, executions in chunks.items():
            for start in range(0, len(executions), sizes[kind]):
                outcomes += self.execute_chunk(executions[start:start + sizes[kind]]).values()
        return outcomes
