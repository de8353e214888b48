"""What a worker tells the outside about its jobs: the ``on_job_start`` and
``on_job_end`` hooks, each execution's end reported exactly once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from belay import otel
from belay.budget import BudgetNotice
from belay.job import Job
from belay.outcome import safe_repr
from belay.parts.execution import Execution

log = logging.getLogger("belay.worker")

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


class Hooks:
    """The start and end hooks, and which started executions still owe an end.

    Each execution's OpenTelemetry span (:mod:`belay.otel`) opens with its
    start and ends with its end, reported here exactly once.
    """

    def __init__(self) -> None:
        self.start: list[Callable[[Job], None]] = []
        self.end: list[Callable[[JobEnd], None]] = []
        self.budget: list[Callable[[BudgetNotice], None]] = []
        self._lock = threading.Lock()
        #: Executions whose start was reported and whose end not yet.
        self._open: dict[tuple[int, int], Execution] = {}

    def budget_notice(self, notice: BudgetNotice) -> None:
        """Tell the ``on_budget`` hooks, on the job's thread; a hook that
        raises is logged, never the job's failure."""
        for hook in self.budget:
            try:
                hook(notice)
            except BaseException:
                log.exception("belay: on_budget hook %s failed", safe_repr(hook))

    def started(self, execution: Execution) -> None:
        """Report an execution's start, on its thread, before the function runs."""
        execution.span = otel.begin(execution)
        with self._lock:
            self._open[execution.key] = execution
        for hook in self.start:
            try:
                hook(execution.job)
            except BaseException:  # a hook's failure, whatever its class, is not the job's
                log.exception("belay: on_job_start hook %s failed", safe_repr(hook))

    def finished(self, job: Job, outcome: str, duration: float, error: Any,
                 exception: BaseException | None = None) -> None:
        with self._lock:
            execution = self._open.pop((job.id, job.attempt), None)
        if execution is not None:
            otel.end(execution.take_span(), outcome, error, exception)
        self._report(job, outcome, duration, error, exception)

    def crashed(self, executions: Iterable[Execution], exc: BaseException) -> None:
        """End, as ``crashed``, the started executions whose end was not reported."""
        for execution in executions:
            with self._lock:  # check and claim the report in one step
                unreported = self._open.pop(execution.key, None) is not None
            if unreported:
                otel.end(execution.take_span(), "crashed", None, exc)
                self._report(execution.job, "crashed", execution.elapsed(), None, exc)

    def _report(self, job: Job, outcome: str, duration: float, error: Any,
                exception: BaseException | None) -> None:
        log.info("job %d %s queue=%s %s attempt=%d in %.3fs", job.id, job.kind, job.queue,
                 outcome, job.attempt, duration)
        if not self.end:
            return
        event = JobEnd(job, outcome, duration, error, exception)
        for hook in self.end:
            try:
                hook(event)
            except BaseException:  # after the ack: it must not stop a chunk's other acks
                log.exception("belay: on_job_end hook %s failed", safe_repr(hook))
