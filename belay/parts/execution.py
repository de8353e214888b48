"""One claimed attempt on this node, from claim to ack (§6, §7).

Every kind of worker holds its claims as :class:`Execution` objects: the
Python worker's producers and executors, and the HTTP worker sessions. The
lease part renews them and enforces their timeouts; whoever ends one first
(its ack, a lost lease, a timeout) wins :meth:`Execution.end`, so exactly one
outcome is written per attempt.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from belay.job import Job
    from belay.registry import WorkerDef

#: The ways an execution ends. ``LOST`` and ``TIMEOUT`` end it against its
#: will: its result or error is discarded, and a context refuses further steps.
ACKED, LOST, TIMEOUT = "acked", "lost", "timeout"

#: What each ending is called in a message to a person.
ENDINGS = {ACKED: "was acked", LOST: "lost its lease", TIMEOUT: "timed out"}


class Flag:
    """A one-way event: ``set`` once (again is harmless), ``wait`` with a
    timeout. One lock, made in a C call, where ``threading.Event`` builds a
    Condition and a lock in Python: every claimed job makes one."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # already set
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when ``timeout`` seconds passed first."""
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            with contextlib.suppress(RuntimeError):  # a second set() released it
                self._lock.release()
            return True
        return False


class Execution:
    """One claimed attempt: its job, its clock, and who may end it.

    ``clock`` gives the monotonic seconds its start and ``timeout`` count in
    (the HTTP sessions take an injectable one). ``node`` is the node id its
    lease was claimed under, when it is not the lease keeper's own (each HTTP
    worker session is a node of its own).
    """

    def __init__(
        self,
        job: Job,
        definition: WorkerDef | None,
        timeout: float | None,
        *,
        node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.definition = definition
        self.node = node
        self._clock = clock
        self.started = clock()
        self.deadline = None if timeout is None else self.started + timeout
        self._lock = threading.Lock()
        self._ended: str | None = None
        #: Set when the thread running it returns (its slot is free again).
        self.done = Flag()
        #: The ident of the thread running it, once one does.
        self.thread: int | None = None
        #: The control-flow exception (park, sleep, budget, cancel…) this job's
        #: own context raised, so a chunk can tell whose it was.
        self.control: BaseException | None = None
        #: The claim-time rate estimate was credited back by ``ctx.debit``.
        self.credited = False
        #: The producer slot this execution holds (the producer's bookkeeping).
        self.owner: Any = None
        #: Its success waits in the batched completer (its slot stays taken).
        self.ack_pending = False
        #: A renewal saw the job's ``cancel_requested`` (an operator's cancel).
        self.cancel_requested = False
        #: The watchdog guarding it (``belay.watchdog``), set by its context.
        self.watchdog: Any = None
        #: With a stall watch: when it trips unless a step is journaled first.
        self.stall_deadline: float | None = None
        #: The last step this run journaled, and whether the stall watch tripped.
        self.last_step: str | None = None
        self.stalled = False
        #: Its OpenTelemetry CONSUMER span while one is open (:mod:`belay.otel`).
        self.span: Any = None

    def take_span(self) -> Any:
        """Its open span, once: whoever ends the execution's span takes it."""
        if self.span is None:
            return None
        with self._lock:
            span, self.span = self.span, None
            return span

    def watch_stall(self, watchdog: Any) -> None:
        """Guard this run with ``watchdog``; its stall counts from now."""
        self.watchdog = watchdog
        if watchdog.stall is not None:
            self.stall_deadline = self._clock() + watchdog.stall

    def progressed(self, step: str) -> None:
        """A step was journaled: the stall counts again from now."""
        self.last_step = step
        if self.watchdog is not None and self.watchdog.stall is not None:
            self.stall_deadline = self._clock() + self.watchdog.stall

    def next_deadline(self) -> float | None:
        """The earlier of its timeout and its stall deadline."""
        due = [d for d in (self.deadline, self.stall_deadline) if d is not None]
        return min(due) if due else None

    def request_cancel(self) -> bool:
        """Mark a cancel request seen; True the first time only."""
        with self._lock:
            first, self.cancel_requested = not self.cancel_requested, True
            return first

    def take_credit(self) -> bool:
        """True the first time only: the claim's rate estimate is credited once per run."""
        with self._lock:
            first, self.credited = not self.credited, True
            return first

    def restart_clock(self, timeout: float | None) -> None:
        """Start the timeout now (a chunk's jobs wait in a buffer before they run)."""
        self.started = self._clock()
        self.deadline = None if timeout is None else self.started + timeout

    def elapsed(self) -> float:
        return self._clock() - self.started

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.attempt)

    @property
    def ended(self) -> str | None:
        """Why this execution may no longer ack: ``"lost"``, ``"timeout"``, or
        ``"acked"`` (its outcome is being, or was, written)."""
        return self._ended

    @property
    def interrupted(self) -> bool:
        """True once it lost its lease or timed out: its work will be discarded."""
        return self._ended in (LOST, TIMEOUT)

    def end(self, why: str) -> bool:
        """Claim the right to end this execution; False when something else did first."""
        with self._lock:
            if self._ended is not None:
                return False
            self._ended = why
            return True

    def reopen(self, why: str) -> None:
        """Undo ``end(why)`` when writing that outcome failed before anything
        was written (an HTTP worker may then report it again)."""
        with self._lock:
            if self._ended == why:
                self._ended = None
