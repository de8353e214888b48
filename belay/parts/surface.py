"""The public face of :class:`belay.Worker` beyond its lifecycle: the
methods that register hooks and middleware, and those that read and change
the queues it serves. Mixed into the Worker (the composition root, in
:mod:`belay.runner`), they only delegate to its parts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from belay.budget import BudgetNotice
from belay.job import Job
from belay.parts.executor import ThreadExecutor
from belay.parts.hooks import Hooks, JobEnd
from belay.parts.pool import WorkerPool
from belay.parts.producer import Producers
from belay.parts.queueconfig import QueueConfig
from belay.parts.running import JobRunner, Middleware
from belay.parts.service import Service
from belay.queues import QueueSpec
from belay.registry import Registry

log = logging.getLogger("belay.worker")


class HookMethods:
    """``on_job_start``, ``on_job_end``, ``on_stop``, ``on_crash``, ``middleware``."""

    hooks: Hooks
    runner: JobRunner
    _stop_hooks: list[Callable[[], None]]
    _crash_hooks: list[Callable[[str, BaseException], None]]


    def on_job_start(self, hook: Callable[[Job], None]) -> Callable[[Job], None]:
        """Call ``hook(job)`` as each execution starts, on its thread, before the
        function runs; usable as a decorator. A hook that raises is logged."""
        self.hooks.start.append(hook)
        return hook

    def on_job_end(self, hook: Callable[[JobEnd], None]) -> Callable[[JobEnd], None]:
        """Call ``hook(JobEnd)`` once after every execution that started (for
        metrics); usable as a decorator. A hook that raises is logged."""
        self.hooks.end.append(hook)
        return hook

    def on_budget(self, hook: Callable[[BudgetNotice], None]
                  ) -> Callable[[BudgetNotice], None]:
        """Call ``hook(BudgetNotice)`` when a job reaches a budget warning
        threshold (once per threshold per job), pauses over its budget or fails
        over it; usable as a decorator. On the job's thread, in-process runs
        only. A hook that raises is logged."""
        self.hooks.budget.append(hook)
        return hook

    def on_stop(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call ``hook()`` once ``stop()`` is done (to close what serves this
        worker, like a metrics endpoint); usable as a decorator. After a
        crash, ``worker.crashed`` holds what ended it."""
        self._stop_hooks.append(hook)
        return hook

    def on_crash(self, hook: Callable[[str, BaseException], None]
                 ) -> Callable[[str, BaseException], None]:
        """Call ``hook(service, exception)`` when a background service dies (the
        worker then stops claiming and stops); usable as a decorator."""
        self._crash_hooks.append(hook)
        return hook

    def middleware(self, layer: Middleware) -> Middleware:
        """Wrap every run of a job's function: ``layer(contexts, call)`` runs on
        the executor thread, must call ``call()`` once and return what it
        returns (a chunk's ``contexts`` hold all its jobs). What it raises is the
        job's error. The first layer added is the outermost; usable as a
        decorator. See docs/worker.md."""
        self.runner.middleware.append(layer)
        return layer


class QueueMethods:
    """What a worker serves (§8.6): its live queues, pausing here, syncing the
    ``belay_queues`` rows."""

    producers: Producers
    pools: WorkerPool
    queue_config: QueueConfig
    queue_sync_interval: float
    executor: ThreadExecutor
    registry: Registry
    _lock: threading.RLock
    _started: bool


    def live_queues(self) -> dict[str, QueueSpec]:
        """The queues this node serves now, with their effective options."""
        return self.producers.specs()

    def queue_limit(self, queue: str) -> int | None:
        """The queue's current local limit here (adaptive limits move); None if not served."""
        found = self.producers.get(queue)
        return None if found is None else found.limit

    def pause_queue(self, queue: str) -> None:
        """Stop claiming from ``queue`` on this node only (running jobs finish).
        ``Belay.pause_queue`` pauses it on every node."""
        with self.producers.lock:
            self.producers.paused_here.add(queue)

    def resume_queue(self, queue: str) -> None:
        with self.producers.lock:
            self.producers.paused_here.discard(queue)
        self.producers.wake(queue)

    def sync_queues(self) -> dict[str, QueueSpec]:
        """Merge the ``belay_queues`` rows over the static queues now (the
        ``belay-queues`` thread does this every ``queue_sync_interval``)."""
        with self.pools.connection() as conn:
            specs = self.queue_config.effective(conn)
        if self._started:
            self._apply(specs)
        return specs

    def _sync_loop(self, service: Service) -> None:
        while not service.wait(self.queue_sync_interval):
            try:
                self.sync_queues()
            except Exception:
                log.exception("belay: syncing queues failed; keeping the current ones")

    def _apply(self, specs: Mapping[str, QueueSpec]) -> None:
        """Serve exactly ``specs``: producers, executor threads and pool follow."""
        with self._lock:
            live = self.producers.apply(specs)
            if live is None:  # stopping
                return
            self.executor.resize(sum(q.spec.limit for q in live))
            self.pools.resize(q.spec for q in live)

    def _chunk_kinds(self) -> list[str]:
        return [kind for kind in self.registry.kinds()
                if (found := self.registry.get(kind)) is not None and found.chunk is not None]

    def _spec_for(self, queue: str) -> QueueSpec | None:
        live = self.producers.get(queue)
        return self.queue_config.spec_for(queue, None if live is None else live.spec)
