"""What a running job sees (``ctx``), and the bookkeeping of one execution."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.job import Job
    from belay.registry import WorkerDef


class Interrupted(BaseException):
    """This run no longer owns its job: its lease was lost, it timed out, or the
    worker is shutting down hard.

    A ``BaseException``, like ``KeyboardInterrupt``, so a job's own
    ``except Exception:`` can't swallow it; ``finally`` blocks still run.
    """


class Execution:
    """One claimed attempt on this node, from claim to ack."""

    def __init__(self, job: Job, definition: WorkerDef | None, timeout: float | None) -> None:
        self.job = job
        self.definition = definition
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self._lock = threading.Lock()
        self._ended: str | None = None
        #: Set when the thread running it returns (its slot is free again).
        self.done = threading.Event()
        #: The ident of the thread running it, once one does.
        self.thread: int | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.attempt)

    @property
    def ended(self) -> str | None:
        """Why this execution may no longer ack: "lost", "timeout", or "acked"."""
        return self._ended

    def end(self, why: str) -> bool:
        """Claim the right to end this execution; False when something else did first."""
        with self._lock:
            if self._ended is not None:
                return False
            self._ended = why
            return True


class Context:
    """Passed to a worker function: the job, and the run's link to belay."""

    def __init__(self, execution: Execution, client: Belay) -> None:
        self._execution = execution
        self.client = client

    @property
    def job(self) -> Job:
        return self._execution.job

    @property
    def id(self) -> int:
        return self._execution.job.id

    @property
    def input(self) -> dict[str, Any]:
        return self._execution.job.input

    @property
    def meta(self) -> dict[str, Any]:
        return self._execution.job.meta

    @property
    def attempt(self) -> int:
        return self._execution.job.attempt

    @property
    def kind(self) -> str:
        return self._execution.job.kind

    @property
    def queue(self) -> str:
        return self._execution.job.queue

    @property
    def interrupted(self) -> bool:
        """True once this run lost its lease or timed out: its work will be discarded."""
        return self._execution.ended in ("lost", "timeout")

    def checkpoint(self) -> None:
        """Raise :class:`Interrupted` if this run no longer owns its job.

        Steps call it at every boundary; long loops of your own can too.
        """
        why = self._execution.ended
        if why in ("lost", "timeout"):
            raise Interrupted(
                f"job {self.id} attempt {self.attempt}: "
                + ("lease lost" if why == "lost" else "timed out")
            )
