"""Executors: where claimed work runs.

An executor takes work — one :class:`~belay.parts.execution.Execution`, or a
chunk of them — and runs it with ``run(work)``, which calls the job's
function and records its outcome, then ``release(executions)``, which frees
the slots. :class:`ThreadExecutor` runs work on ``belay-exec-<n>`` threads of
this process; another kind (a process over a socket) fills the same seam.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue as queue_module
import threading
from collections.abc import Callable, Collection
from typing import Protocol

from belay.parts.execution import Execution

log = logging.getLogger("belay.worker")

#: One execution, or a chunk worker's executions that run together.
Work = Execution | list[Execution]


class Executor(Protocol):
    """What a worker needs of the place its jobs run."""

    def submit(self, work: Work) -> None:
        """Run ``work`` when a slot is free (the producer took the slot already)."""

    def resize(self, slots: int) -> None:
        """Be able to run ``slots`` pieces of work at once."""

    def stop(self, busy: Collection[int]) -> None:
        """Stop taking work; ``busy``: thread idents still running a job, not waited for."""

    def on_executor(self) -> bool:
        """True on a thread that runs work (its successes may be acked in batches)."""


class ThreadExecutor:
    """Work runs on daemon threads, one piece at a time each, taken in order
    from one queue; ``run(work)`` then ``release(executions)`` on that thread."""

    def __init__(self, run: Callable[[Work], object],
                 release: Callable[[Execution], None]) -> None:
        self._run = run
        self._release = release
        self._lock = threading.Lock()
        self._work: queue_module.SimpleQueue[Work | None] = queue_module.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._numbers = itertools.count()
        #: Threads wanted: the sum of the live queues' maximum limits.
        self._target = 0
        self._local = threading.local()

    def submit(self, work: Work) -> None:
        self._work.put(work)

    def resize(self, slots: int) -> None:
        """Grow to ``slots`` threads, or retire the extra ones as they finish."""
        with self._lock:
            while self._target < slots:
                self._target += 1
                thread = threading.Thread(target=self._loop, daemon=True,
                                          name=f"belay-exec-{next(self._numbers)}")
                self._threads.append(thread)
                thread.start()
            while self._target > slots:
                self._target -= 1
                self._work.put(None)

    def stop(self, busy: Collection[int]) -> None:
        """Retire every thread; wait a second for each idle one (a job stuck
        past the grace keeps its thread: a daemon, it can't hold the process)."""
        with self._lock:
            threads = list(self._threads)
            self._target = 0
            self._threads.clear()
        for _ in threads:
            self._work.put(None)
        for thread in threads:
            if thread.ident not in busy:
                thread.join(1.0)
        self._work = queue_module.SimpleQueue()

    def on_executor(self) -> bool:
        return bool(getattr(self._local, "executor", False))

    def _loop(self) -> None:
        self._local.executor = True
        work_queue = self._work
        while True:
            work = work_queue.get()
            if work is None:
                with self._lock, contextlib.suppress(ValueError):
                    self._threads.remove(threading.current_thread())
                return
            executions = work if isinstance(work, list) else [work]
            try:
                self._run(work)
            except BaseException:
                log.exception("belay: executing job(s) %s crashed the executor",
                              [e.job.id for e in executions])
            finally:
                for execution in executions:
                    self._release(execution)
