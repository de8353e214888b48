"""The worker pool (``belay.Worker``): the composition root of the worker's parts.

A :class:`Worker` wires the parts in :mod:`belay.parts` together (that
package's docstring draws the threads and one job's path from claim to ack)
and owns their lifecycle: ``start``/``stop``/``run``, the hooks, the queue
set, ``drain`` for tests and scripts, and what happens when a background
service dies — the worker stops claiming and stops, and ``run()`` raises
:class:`~belay.errors.WorkerCrashed` so a supervisor restarts the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from types import FrameType
from typing import Any

import psycopg

from belay.client import Belay
from belay.cron import CronScheduler
from belay.defaults import default
from belay.errors import ConfigurationError, WorkerCrashed
from belay.job import Job
from belay.outcome import RETURN_SNOOZE
from belay.parts.completer import ACK_BATCH, Completer
from belay.parts.drain import drain
from belay.parts.execution import Execution
from belay.parts.executor import ThreadExecutor
from belay.parts.hooks import OUTCOMES, Hooks, JobEnd
from belay.parts.leases import Leases
from belay.parts.maintenance import RECLAIM_LIMIT, Maintenance, registry_backoff
from belay.parts.pool import WorkerPool
from belay.parts.processes import out_of_process
from belay.parts.producer import HOT_WINDOW, IDLE_BACKSTOP, Producers, claim_jobs
from belay.parts.queueconfig import QueueConfig
from belay.parts.running import JobRunner, Middleware
from belay.parts.service import Service, Supervisor
from belay.parts.surface import HookMethods, QueueMethods
from belay.queues import QueueSpec, parse_queues
from belay.registry import DEFAULT_REGISTRY, Registry
from belay.retention import DEFAULT_SIGNAL_TTL, keep_ok, parse_retention
from belay.watchdog import parse_watchdog

log = logging.getLogger("belay.worker")

__all__ = ["ACK_BATCH", "HOT_WINDOW", "IDLE_BACKSTOP", "OUTCOMES", "UNKNOWN_KIND_SNOOZE",
           "JobEnd", "Middleware", "Worker"]

#: A job whose kind no worker here knows goes back this far into the future.
UNKNOWN_KIND_SNOOZE = RETURN_SNOOZE


def _check(*, shutdown_grace: float, signal_ttl: float | None, **durations: float) -> None:
    for label, value in durations.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigurationError(f"{label} must be a number of seconds > 0, got {value!r}")
    if durations["busy_poll"] > durations["poll_interval"]:
        raise ConfigurationError("busy_poll must not exceed poll_interval")
    if shutdown_grace < 0:
        raise ConfigurationError("shutdown_grace must be >= 0 seconds")
    if signal_ttl is not None and not keep_ok(signal_ttl):
        raise ConfigurationError(
            "signal_ttl must be seconds > 0 (at most a century), or None to keep signals; "
            f"got {signal_ttl!r}"
        )


@contextlib.contextmanager
def _signals(grace: float) -> Iterator[threading.Event]:
    """An event SIGTERM or SIGINT sets (handlers install only in the main
    thread, and are put back after); a second signal exits at once."""
    requested = threading.Event()
    previous: dict[int, Any] = {}

    def handle(signum: int, frame: FrameType | None) -> None:
        if requested.is_set():
            log.warning("second signal: exiting at once")
            os._exit(1)
        # Set before the log line: a second signal can run this handler again
        # while the first is still writing it, and must find it set.
        requested.set()
        log.info("signal %d: stopping (grace %.1fs)", signum, grace)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handle)
    try:
        yield requested
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class Worker(HookMethods, QueueMethods):
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
        executor_socket: str | os.PathLike[str] | bool | None = None,
        executor_socket_mode: int = 0o600,
        processes: int | None = None,
        max_tasks_per_child: int | None = None,
        max_memory_per_child: int | None = None,
        watchdog: Mapping[str, Any] | None = None,
    ) -> None:
        self.queues = parse_queues(queues)
        _check(lease_ttl=lease_ttl, poll_interval=poll_interval, busy_poll=busy_poll,
               sweep_interval=sweep_interval, queue_sync_interval=queue_sync_interval,
               cron_interval=cron_interval, shutdown_grace=shutdown_grace,
               signal_ttl=signal_ttl)
        self.retention = parse_retention(retention)
        if client is None:
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
        # Reentrant: start() applies the first queue set while holding it.
        self._lock = threading.RLock()
        self._stop_hooks: list[Callable[[], None]] = []
        self._crash_hooks: list[Callable[[str, BaseException], None]] = []
        self.queue_config = QueueConfig(self.queues)
        self.pools = WorkerPool(self.client)
        self._listener: Any = None
        self._started = False
        self._stopped = threading.Event()
        #: Every background service, and the crash policy (:meth:`_service_crashed`).
        self.supervisor = Supervisor(self._service_crashed)
        # The parts (belay.parts), each with one job; the lambdas bind the
        # parts that are built after the one calling them.
        self.hooks = Hooks()
        self.completer = Completer(
            self.pools, self._now, notify=notify,
            on_batched=lambda pending, outcome: self.runner.batched(pending, outcome),
            on_batch_failed=lambda batch, exc: self.runner.batch_failed(batch, exc),
        )
        self.leases = Leases(self.node_id, self.lease_ttl, self.pools.connection, self._now,
                             on_timeout=lambda execution: self.runner.timed_out(execution))
        self.runner = JobRunner(self.client, self.registry, self.completer, self.hooks,
                                notify=notify, spec_for=self._spec_for,
                                may_batch=lambda: self.executor.on_executor(),
                                new_deadline=self.leases.wake, free=self._free,
                                watchdog=parse_watchdog(watchdog, "Worker watchdog"))
        self.executor = ThreadExecutor(self.runner.run, self.runner.release)
        self.producers = Producers(
            self.registry, node_id=self.node_id, lease_ttl=self.lease_ttl,
            poll_interval=self.poll_interval, busy_poll=self.busy_poll,
            connection=self.pools.connection, now=self._now, hold=self.leases.hold,
            submit=self.executor.submit, return_unknown=self.runner.return_unknown,
            on_crash=self.supervisor.report,
            # Beside executors on the socket, this process claims only its own
            # kinds; beside a process pool, only the chunk workers' (they run here).
            kinds=(None if executor_socket is None and processes is None
                   else self._chunk_kinds if processes is not None else self.registry.kinds),
        )
        #: Executors on a Unix-domain socket (docs/executors.md), when asked
        #: for, and the process pool (docs/processes.md), with ``processes=N``.
        self.executors, self.processes = out_of_process(
            self.client, list(self.queues), self.registry, self.hooks, self.supervisor.report,
            executor_socket=executor_socket, mode=executor_socket_mode,
            lease_ttl=self.lease_ttl, processes=processes,
            max_tasks_per_child=max_tasks_per_child,
            max_memory_per_child=max_memory_per_child, notify=notify)
        self.maintenance = Maintenance(
            self.pools.connection, self._now, backoff=registry_backoff(self.registry),
            announce=self.completer.announce, poke=self.completer.poke, keep=self.retention,
            signal_ttl=self.signal_ttl, rate_periods=self._rate_periods,
            sweep_interval=self.sweep_interval,
        )

    # -- Lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Check the schema, open the pool and start the services; idempotent."""
        with self._lock:
            if self._started:
                return
            with self.pools.probe() as probe:
                specs = self.queue_config.effective(probe)
            self.pools.open(specs.values())
            self._stopped.clear()
            self.supervisor.reset()
            self.maintenance.halted.clear()
            self.completer.start()
            self.producers.open()
            self._started = True
            # The heartbeat first: the producers' first claims may carry deadlines.
            self.leases.service = self.supervisor.start("belay-heartbeat",
                                                        self.leases.heartbeat)
            self._apply(specs)
            self.supervisor.start("belay-sweeper", self.maintenance.sweep)
            self.supervisor.start("belay-queues", self._sync_loop)
            if self.executors is not None:
                self.executors.start()
            if self.processes is not None:
                self.processes.start(on_crash=self.supervisor.report)
            listen = self.client.listen_conninfo
            if self.notify and listen is not None:
                from belay.notify import Listener

                self._listener = Listener(
                    listen, self.pools.channel, self._on_notify, name="belay-listener",
                    on_crash=self.supervisor.report,
                )
                self._listener.start()
                self.producers.listening = self._listener.listening.is_set
            self.cron.start(on_crash=self.supervisor.report)
        log.info("belay worker %s started: queues %s", self.node_id,
                 {name: spec.to_opts() for name, spec in self.live_queues().items()})

    def stop(self, grace: float | None = None) -> list[int]:
        """Stop claiming, give running jobs ``grace`` seconds (default
        ``shutdown_grace``), then stop. Returns the ids of jobs still running,
        left to lease expiry and reclaim. Idempotent."""
        with self._lock:
            if not self._started:
                return []
            self._started = False
            services = self.supervisor.take()
        grace = self.shutdown_grace if grace is None else grace
        self.cron.stop()
        if self.executors is not None:
            if self.processes is not None:
                # Running jobs get the grace; what is still running after it
                # goes back to its queue when its child stops.
                self.processes.drain(self.shutdown_grace if grace is None else grace)
                self.processes.stop()
            self.executors.stop()
        for service in services:
            if service.name == "belay-queues":
                service.stop()
        # A claim already under way finishes and hands its jobs over before
        # the running set is read, so they get their grace too.
        self.producers.stop_claiming(grace)
        if self.leases.service is not None and self.leases.service.crashed is not None:
            self.leases.lose_all()
        deadline = time.monotonic() + grace
        for execution in self.leases.running():
            execution.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = [e.job.id for e in self.leases.running()]
        if abandoned:
            log.warning("belay worker %s: jobs %s still running after %.1fs grace; their "
                        "leases will lapse and another worker will reclaim them",
                        self.node_id, abandoned, grace)
        self.executor.stop(busy={e.thread for e in self.leases.running()
                                 if e.thread is not None})
        self.completer.stop()
        # The heartbeat kept the running jobs' leases alive through the grace.
        self.maintenance.halted.set()
        for service in services:
            service.stop()
        if self._listener is not None:
            self.producers.listening = lambda: False
            self._listener.stop()
            self._listener = None
        for service in services:
            service.join(max(1.0, self.poll_interval * 2))
        self.producers.close(max(1.0, self.poll_interval * 2))
        self.completer.halt()
        self.pools.close()
        self._stopped.set()
        for hook in list(self._stop_hooks):
            try:
                hook()
            except Exception:
                log.exception("belay: on_stop hook %r failed", hook)
        log.info("belay worker %s stopped", self.node_id)
        return abandoned

    @property
    def crashed(self) -> BaseException | None:
        """What ended the first background service that crashed, if one did."""
        crash = self.supervisor.crashed
        return None if crash is None else crash[1]

    def _on_notify(self, message: dict[str, Any]) -> None:
        """A NOTIFY: wake the producer of its queue, and the executor dispatcher."""
        self.producers.on_notify(message)
        if self.executors is not None and message.get("t") == "p":
            self.executors.wake()

    def _service_crashed(self, service: Service, exc: BaseException) -> None:
        """A background service died: stop claiming now, and stop. If it was
        the heartbeat, no lease here is renewed any more: every running
        execution is lost (``ctx.checkpoint()`` stops it; its result would be
        discarded anyway once its lease lapses and another node reclaims it)."""
        if service is self.leases.service:
            lost = self.leases.lose_all()
            if lost:
                log.critical("belay worker %s: the heartbeat is gone; jobs %s are interrupted "
                             "and will be reclaimed", self.node_id, [e.job.id for e in lost])
        self.producers.halt()
        crash = self.supervisor.crashed
        if crash is None or crash[0] is not service:
            return  # not the first crash: the first one's stop is under way
        log.critical("belay worker %s: %s crashed; the worker stops claiming and stops",
                     self.node_id, service.name)
        for hook in list(self._crash_hooks):
            try:
                hook(service.name, exc)
            except Exception:
                log.exception("belay: on_crash hook %r failed", hook)
        threading.Thread(target=self.stop, name="belay-stopper", daemon=True).start()

    def run(self) -> None:
        """Run until SIGTERM or SIGINT (then drain for ``shutdown_grace``); a second
        signal exits at once. Signal handlers install only in the main thread.
        Raises :class:`~belay.errors.WorkerCrashed` once a background service
        died and the worker stopped."""
        with _signals(self.shutdown_grace) as requested:
            self.start()
            while not requested.wait(0.5) and not self._stopped.is_set():
                pass
            self.stop()
        crash = self.supervisor.crashed
        if crash is not None:
            self._stopped.wait()
            raise WorkerCrashed(crash[0].name, crash[1])

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Running (the executor's calls) ---------------------------------------------------

    def _now(self) -> datetime:
        return self.client.clock.now()

    def execute(self, execution: Execution) -> str:
        """Run one claimed execution and ack it; returns the outcome recorded."""
        return self.runner.execute(execution)

    def execute_chunk(self, executions: list[Execution]) -> dict[int, str]:
        """Run a chunk worker once over several claimed jobs and ack each one
        (see :meth:`belay.parts.running.JobRunner.execute_chunk`)."""
        return self.runner.execute_chunk(executions)

    def _free(self, execution: Execution) -> None:
        """Its run and its ack are done: the lease and the slot go."""
        self.leases.release(execution)
        self.producers.free(execution)
        execution.done.set()

    # -- Maintenance (§6, §8.4, §8.7) --------------------------------------------------------

    def prune(self) -> dict[str, int]:
        """§8.7 retention, one pass: delete terminal jobs older than their state's
        retention (with their steps and events, in batches), signals past
        ``signal_ttl`` and rate windows no claim reads any more. Never a
        non-terminal job; a workflow's members only once all of them are past
        their retention, children only once their parent is.
        Returns how many rows went, by kind."""
        return self.maintenance.prune_pass().counts

    def reclaim(self, limit: int = RECLAIM_LIMIT) -> int:
        """Retry or fail jobs whose leases expired (any node's); returns how many."""
        return self.maintenance.reclaim(limit)

    def reconcile(self) -> int:
        """§8.4 backstop (race R2): wake parents whose children are all terminal
        but which still await ``$children``; returns how many."""
        return self.maintenance.reconcile()

    def _rate_periods(self, conn: psycopg.Connection[Any]) -> list[int]:
        # Not started: the static queues with the belay_queues rows over them,
        # as drain() serves them.
        specs = self.live_queues() or self.queue_config.effective(conn)
        return [s.rate.period for s in specs.values() if s.rate is not None]

    # -- Synchronous running (tests, scripts) ----------------------------------------------

    def drain(self, max_jobs: int | None = None) -> dict[str, int]:
        """Run every job claimable now, in this thread, until none is left (or
        ``max_jobs``); returns counts by outcome. No threads start.

        Admission applies (limits, rate windows, partitions, pauses from the
        ``belay_queues`` rows), as on a running worker; a chunk worker's jobs
        run in chunks of whatever is claimable now, up to its size.
        """
        with self.pools.connection() as conn:
            effective = self.queue_config.drained = self.queue_config.effective(conn)
            with self.producers.lock:
                here = set(self.producers.paused_here)
            specs = [effective[name] for name in self.queues if name in effective
                     and not effective[name].paused and name not in here]
            return drain(specs, self._claim_jobs, self.registry, execute=self.execute,
                         execute_chunk=self.execute_chunk,
                         return_unknown=self.runner.return_unknown, max_jobs=max_jobs)

    def _claim_jobs(self, spec: QueueSpec, demand: int) -> list[Job]:
        kinds = None if self.producers.kinds is None else self.producers.kinds()
        if kinds == []:
            return []
        with self.pools.connection() as conn:
            return claim_jobs(conn, spec, demand, self.node_id, self._now, self.lease_ttl,
                              kinds=kinds)
