"""The worker pool (``belay.Worker``): claims jobs under leases and runs them on threads.

Threads (all named, all stopping within their wait timeouts):

- ``belay-producer-<queue>``: claims up to the queue's free slots (§6), polls
  adaptively (``busy_poll`` while claims return work, doubling to
  ``poll_interval`` when idle), and is woken early by a finished job or a poke;
- ``belay-exec-<n>``: run the jobs, then ack each with one fenced UPDATE (§7);
- ``belay-heartbeat``: renews every local lease in one statement each
  ``lease_ttl / 3`` and enforces timeouts; a lease not renewed is lost, and its
  execution may never ack;
- ``belay-sweeper``: reclaims expired leases of any node (§6);
- ``belay-listener`` (``notify=True``): LISTEN for pokes (§9.2).

Job code never runs on the heartbeat's thread, so a busy job can't starve its
own lease (it still holds the GIL: send CPU-heavy work to several processes).
"""

from __future__ import annotations

import contextlib
import functools
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
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from belay import names, schema, store
from belay.client import Belay
from belay.context import Context, Execution, Park
from belay.crypto import DecryptionError, decrypt_input, is_encrypted
from belay.errors import ConfigurationError
from belay.job import Job
from belay.outcome import Outcome, decide, default_backoff, retry_or_fail, safe_delay
from belay.registry import DEFAULT_REGISTRY, Registry

log = logging.getLogger("belay.worker")

#: A job whose kind no worker here knows goes back this far into the future.
UNKNOWN_KIND_SNOOZE = 60.0


@dataclass(frozen=True)
class JobEnd:
    """What a ``on_job_end`` hook receives once per finished execution."""

    job: Job
    outcome: str  # succeeded | retry | failed | cancelled | snooze | stale | timeout | lost
    duration: float
    error: Any = None


def parse_queues(queues: Mapping[str, int] | Iterable[str]) -> dict[str, int]:
    """``{"default": 10}`` or ``["default"]`` (limit 10 each) → ``{name: limit}``."""
    if isinstance(queues, str):
        raise ConfigurationError(f"queues is a dict of name → limit, got the string {queues!r}")
    items = queues.items() if isinstance(queues, Mapping) else ((q, 10) for q in queues)
    parsed: dict[str, int] = {}
    for name, limit in items:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a queue name is a non-empty string, got {name!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(
                f"queue {name!r}: the limit is an integer >= 1 (concurrent jobs), got {limit!r}"
            )
        parsed[name] = limit
    if not parsed:
        raise ConfigurationError("a worker needs at least one queue")
    return parsed


class Worker:
    """Runs the registered workers' jobs from the given queues.

    ``queues`` maps each queue to its local concurrency limit. ``.run()`` blocks
    until SIGTERM/SIGINT; ``.start()`` and ``.stop()`` are for embedding.
    Durations are in seconds.
    """

    def __init__(
        self,
        queues: Mapping[str, int] | Iterable[str] = ("default",),
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
        node_id: str | None = None,
    ) -> None:
        self.queues = parse_queues(queues)
        for label, value in (("lease_ttl", lease_ttl), ("poll_interval", poll_interval),
                             ("busy_poll", busy_poll), ("sweep_interval", sweep_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"{label} must be a number of seconds > 0, got {value!r}")
        if busy_poll > poll_interval:
            raise ConfigurationError("busy_poll must not exceed poll_interval")
        if shutdown_grace < 0:
            raise ConfigurationError("shutdown_grace must be >= 0 seconds")
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
        self.node_id = node_id or f"{os.uname().nodename}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._hooks: list[Callable[[JobEnd], None]] = []
        self._lock = threading.Lock()
        self._executions: dict[tuple[int, int], Execution] = {}
        self._inflight = dict.fromkeys(self.queues, 0)
        self._wake = {q: threading.Event() for q in self.queues}
        self._work: queue_module.SimpleQueue[Execution | None] = queue_module.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._executors: list[threading.Thread] = []
        #: Set on stop: producers stop claiming.
        self._stopping = threading.Event()
        #: Set once running jobs had their grace: the heartbeat (which keeps
        #: their leases alive meanwhile) and the sweeper stop.
        self._halted = threading.Event()
        self._stopped = threading.Event()
        self._heartbeat_wake = threading.Event()
        self._pool: ConnectionPool | None = None
        self._listener: Any = None
        self._channel = ""
        self._started = False

    # -- Lifecycle -------------------------------------------------------------------

    def on_job_end(self, hook: Callable[[JobEnd], None]) -> Callable[[JobEnd], None]:
        """Call ``hook(JobEnd)`` after every execution (for metrics); usable as a decorator."""
        self._hooks.append(hook)
        return hook

    def start(self) -> None:
        """Check the schema, open the pool and start the threads; idempotent."""
        with self._lock:
            if self._started:
                return
            with psycopg.connect(self.client.conninfo, autocommit=True) as probe:
                schema.check(probe)
                self._channel = names.notify_channel(probe.info.dbname)
            slots = sum(self.queues.values())
            self._pool = ConnectionPool(
                self.client.conninfo,
                min_size=1,
                # producers + heartbeat + sweeper, and acks (which may wait their turn)
                max_size=len(self.queues) + 2 + min(slots, 16),
                kwargs={"autocommit": True, "application_name": "belay-worker"},
                name="belay-worker",
                open=True,
            )
            self._stopping.clear()
            self._halted.clear()
            self._stopped.clear()
            for n in range(slots):
                self._spawn(self._exec_loop, f"belay-exec-{n}", executor=True)
            for q in self.queues:
                self._spawn(functools.partial(self._produce, q), f"belay-producer-{q}")
            self._spawn(self._heartbeat, "belay-heartbeat")
            self._spawn(self._sweep, "belay-sweeper")
            if self.notify:
                from belay.notify import Listener

                self._listener = Listener(
                    self.client.conninfo, self._channel, self._on_notify, name="belay-listener"
                )
                self._listener.start()
            self._started = True
        log.info("belay worker %s started: queues %s", self.node_id, self.queues)

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
        for event in self._wake.values():
            event.set()
        # A claim already under way finishes and hands its jobs over before
        # the running set is read, so they get their grace too.
        producers = [t for t in self._threads if t.name.startswith("belay-producer-")]
        for thread in producers:
            thread.join(max(grace, 5.0))
        deadline = time.monotonic() + grace
        for execution in self._running():
            execution.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = [e.job.id for e in self._running()]
        if abandoned:
            log.warning("belay worker %s: jobs %s still running after %.1fs grace; their "
                        "leases will lapse and another worker will reclaim them",
                        self.node_id, abandoned, grace)
        for _ in self._executors:
            self._work.put(None)
        busy = {e.thread for e in self._running()}
        for thread in self._executors:
            if thread.ident not in busy:
                thread.join(1.0)
        self._halted.set()
        self._heartbeat_wake.set()
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        for thread in self._threads:
            thread.join(max(1.0, self.poll_interval * 2))
        self._threads.clear()
        self._executors.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._stopped.set()
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

    # -- Claiming ----------------------------------------------------------------------

    def _now(self) -> datetime:
        return self.client.clock.now()

    def _free(self, queue: str) -> int:
        with self._lock:
            return self.queues[queue] - self._inflight[queue]

    def _produce(self, queue: str) -> None:
        interval = self.busy_poll
        wake = self._wake[queue]
        while not self._stopping.is_set():
            claimed = 0
            try:
                free = self._free(queue)
                if free > 0:
                    claimed = self._claim(queue, free)
            except Exception:
                log.exception("belay: claiming from %r failed; retrying", queue)
                interval = self.poll_interval
            # Hot while claims find work, decaying to the idle ceiling (§9.1).
            interval = self.busy_poll if claimed else min(interval * 2, self.poll_interval)
            wake.wait(interval)
            wake.clear()

    def _claim(self, queue: str, free: int) -> int:
        assert self._pool is not None
        now = self._now()
        with self._pool.connection() as conn:
            jobs = store.claim(conn, queue, free, self.node_id, now,
                               now + timedelta(seconds=self.lease_ttl))
        for job in jobs:
            definition = self.registry.get(job.kind)
            if definition is None:
                self._return_unknown(job)
                continue
            timeout = definition.timeout
            execution = Execution(job, definition, timeout)
            with self._lock:
                self._executions[execution.key] = execution
                self._inflight[queue] += 1
            if execution.deadline is not None:
                self._heartbeat_wake.set()
            self._work.put(execution)
        return len(jobs)

    def _return_unknown(self, job: Job) -> None:
        """Not run, not lost, not an attempt: snoozed back for a worker that knows it."""
        log.error("belay: no worker for kind %r (job %d, queue %r) on this node; it goes back "
                  "to the queue for %.0fs. Registered kinds: %s", job.kind, job.id, job.queue,
                  UNKNOWN_KIND_SNOOZE, ", ".join(self.registry.kinds()) or "none")
        outcome = Outcome("snooze", at=self._now() + timedelta(seconds=UNKNOWN_KIND_SNOOZE))
        self._ack(job, outcome)

    def _on_notify(self, message: dict[str, Any]) -> None:
        if message.get("t") == "p":
            event = self._wake.get(message.get("q"))  # type: ignore[arg-type]
            if event is not None:
                event.set()

    # -- Running -----------------------------------------------------------------------

    def _exec_loop(self) -> None:
        while True:
            execution = self._work.get()
            if execution is None:
                return
            try:
                self.execute(execution)
            except BaseException:
                log.exception("belay: executing job %d crashed the executor", execution.job.id)
            finally:
                self._release(execution)

    def _release(self, execution: Execution) -> None:
        with self._lock:
            self._executions.pop(execution.key, None)
            self._inflight[execution.job.queue] -= 1
        execution.done.set()
        self._wake[execution.job.queue].set()

    def execute(self, execution: Execution) -> str:
        """Run one claimed execution and ack it; returns the outcome recorded."""
        execution.thread = threading.get_ident()
        if is_encrypted(execution.job.input):
            try:
                plain = decrypt_input(execution.job.input, self.client.encryption_key)
            except (DecryptionError, ConfigurationError) as exc:
                # Not the job's fault and not an attempt: back to the queue,
                # never lost, for a worker that has the right key.
                log.error("belay: job %d: %s; it goes back to the queue for %.0fs",
                          execution.job.id, exc, UNKNOWN_KIND_SNOOZE)
                execution.end("acked")
                when = self._now() + timedelta(seconds=UNKNOWN_KIND_SNOOZE)
                self._ack(execution.job, Outcome("snooze", at=when))
                self._finished(execution.job, "snooze", 0.0, str(exc))
                return "snooze"
            execution.job = execution.job.replace(input=plain)
        job, definition = execution.job, execution.definition
        assert definition is not None
        ctx = Context(execution, self.client, self.registry, notify=self.notify)
        raised: BaseException | None = None
        returned: Any = None
        try:
            returned = definition(ctx)
        except BaseException as exc:  # the job's failure, whatever it raised
            raised = exc
        duration = time.monotonic() - execution.started
        if not execution.end("acked"):
            why = execution.ended or "ended"
            log.warning("belay: job %d attempt %d %s; its %s is discarded", job.id, job.attempt,
                        "lost its lease" if why == "lost" else "timed out",
                        "error" if raised else "result")
            self._finished(job, why, duration, raised)
            return why
        if isinstance(raised, Park):
            kind = self._park(job, raised)
            self._finished(job, kind, duration, None)
            return kind
        outcome = decide(returned=returned, raised=raised, attempt=job.attempt,
                         max_attempts=job.max_attempts, now=self._now(),
                         backoff=definition.backoff)
        acked = self._ack(job, outcome)
        kind = outcome.kind if acked else "stale"
        self._finished(job, kind, duration, outcome.error)
        return kind

    def _ack(self, job: Job, outcome: Outcome) -> bool:
        """One fenced ack in its own transaction; False when stale (discarded)."""
        if self._pool is None:
            log.warning("belay: job %d attempt %d finished after its worker stopped; its "
                        "lease will lapse and it will be reclaimed", job.id, job.attempt)
            return False
        for attempt in range(3):
            try:
                with self._pool.connection() as conn, conn.transaction():
                    acked = store.ack(conn, job, outcome.kind, self._now(),
                                      result=outcome.result, error=outcome.error, at=outcome.at)
                    if acked is not None:
                        self._notify_acked(conn, acked)
                if acked is None:
                    log.warning("belay: stale ack for job %d attempt %d discarded (the job was "
                                "reclaimed)", job.id, job.attempt)
                return acked is not None
            except psycopg.OperationalError:
                # The database blinked: try again; if it stays down the lease
                # lapses and the job is reclaimed (at-least-once).
                log.warning("belay: ack of job %d failed (try %d)", job.id, attempt + 1,
                            exc_info=True)
                self._halted.wait(0.2 * (attempt + 1))
        return False

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

    def _finished(self, job: Job, outcome: str, duration: float, error: Any) -> None:
        log.info("job %d %s queue=%s %s attempt=%d in %.3fs", job.id, job.kind, job.queue,
                 outcome, job.attempt, duration)
        event = JobEnd(job, outcome, duration, error)
        for hook in self._hooks:
            try:
                hook(event)
            except Exception:
                log.exception("belay: on_job_end hook %r failed", hook)

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
        while not self._halted.wait(self.sweep_interval):
            try:
                self.reclaim()
                self.reconcile()
            except Exception:
                log.exception("belay: reclaiming expired leases failed; retrying")

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; outside start()/stop(), a short-lived pool of its own."""
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        with psycopg.connect(self.client.conninfo, autocommit=True) as probe:
            schema.check(probe)
            self._channel = names.notify_channel(probe.info.dbname)
        self._pool = ConnectionPool(self.client.conninfo, min_size=1, max_size=2,
                                    kwargs={"autocommit": True}, name="belay-worker-sync",
                                    open=True)
        try:
            with self._pool.connection() as conn:
                yield conn
        finally:
            self._pool.close()
            self._pool = None

    def reclaim(self, limit: int = 100) -> int:
        """Retry or fail jobs whose leases expired (any node's); returns how many."""
        now = self._now()
        count = 0
        with self._connection() as conn:
            for job_id in store.expired_leases(conn, now, limit):
                try:
                    with conn.transaction():
                        acked = store.reclaim_one(conn, job_id, now, self._backoff_for)
                        if acked is not None:
                            self._notify_acked(conn, acked)
                except Exception:
                    # One bad row must not stop the pass for the rows behind it.
                    log.exception("belay: reclaiming job %d failed", job_id)
                    continue
                if acked is not None:
                    count += 1
                    log.warning("belay: reclaimed job %d (lease expired) → %s", job_id,
                                acked.job.state)
        return count

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
        """Run every job claimable now, one at a time in this thread, until none
        is left (or ``max_jobs``); returns counts by outcome. No threads start."""
        counts: dict[str, int] = {}
        with self._connection():
            ran = 0
            while max_jobs is None or ran < max_jobs:
                job = self._claim_one()
                if job is None:
                    break
                definition = self.registry.get(job.kind)
                if definition is None:
                    self._return_unknown(job)
                    outcome = "unknown"
                else:
                    execution = Execution(job, definition, None)
                    outcome = self.execute(execution)
                counts[outcome] = counts.get(outcome, 0) + 1
                ran += 1
        return counts

    def _claim_one(self) -> Job | None:
        assert self._pool is not None
        now = self._now()
        for queue in self.queues:
            with self._pool.connection() as conn:
                jobs = store.claim(conn, queue, 1, self.node_id, now,
                                   now + timedelta(seconds=self.lease_ttl))
            if jobs:
                return jobs[0]
        return None
