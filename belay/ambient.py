"""The job a piece of code runs for, found without ``ctx`` being passed down —
and what a thread with no job does while jobs with an authority run here.

``belay.current_context()`` reads a :class:`~contextvars.ContextVar`, set around a
worker function's call. A ContextVar follows the code into asyncio tasks and
into ``asyncio.to_thread``, but not into a ``threading.Thread`` or a plain
``concurrent.futures.ThreadPoolExecutor`` the job starts: those begin with an
empty context. Since a job's authority (:mod:`belay.authority`) travels in
that context, a thread that lost it must not be taken for code outside any
job, which enqueues unrestricted. So belay fails closed: while a job with an
authority runs in this process, a thread with no job context may not enqueue,
start jobs or call tools (:func:`refuse_contextless`) — unless it is one of
belay's own threads (:func:`mark_system_thread`). :func:`propagate` and
:class:`ThreadPoolExecutor` carry the job's context into the threads it starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar

from belay.errors import AuthorityExceeded
from belay.names import AUTHORITY_KEY

P = ParamSpec("P")
R = TypeVar("R")


class Job(Protocol):
    """What this module and the checks below it read of a running job's
    context (:class:`belay.Context` is one): this layer knows no more of it."""

    @property
    def id(self) -> int: ...

    @property
    def meta(self) -> dict[str, Any]: ...


#: The context of the job running in this thread (or task), for code far from it.
CURRENT: contextvars.ContextVar[Job | None] = contextvars.ContextVar(
    "belay_current_context", default=None)


def current_job() -> Job | None:
    """The context of the job this code runs in (:func:`belay.current_context`
    has its full type), or None outside a job."""
    return CURRENT.get()


class _InFlight:
    """The jobs with an authority whose functions run in this process now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[int, int] = {}  # job id → contexts entered for it

    def add(self, job_ids: Sequence[int]) -> None:
        with self._lock:
            for job_id in job_ids:
                self._jobs[job_id] = self._jobs.get(job_id, 0) + 1

    def remove(self, job_ids: Sequence[int]) -> None:
        with self._lock:
            for job_id in job_ids:
                left = self._jobs.get(job_id, 0) - 1
                if left > 0:
                    self._jobs[job_id] = left
                else:
                    self._jobs.pop(job_id, None)

    def some(self) -> list[int]:
        """A few of them (empty when there are none), for a message."""
        if not self._jobs:  # the common case, read without the lock
            return []
        with self._lock:
            return sorted(self._jobs)[:3]


_IN_FLIGHT = _InFlight()

#: Marks belay's own background threads (cron, schedules, the worker's
#: loops): they run no job, and what they enqueue is belay's, not a job's.
_SYSTEM = threading.local()


def mark_system_thread() -> None:
    """Declare the calling thread one of belay's own (see the module docstring)."""
    _SYSTEM.marked = True


def enter(current: Job | None, contexts: Sequence[Job] = ()
          ) -> tuple[contextvars.Token[Job | None] | None, list[int]]:
    """Before a worker function's call: ``current`` is what
    :func:`current_context` returns inside it (None for a chunk, whose jobs
    share the call), and every job of ``contexts`` (``current`` included)
    that has an authority counts as running in this process until
    :func:`leave`. Two plain functions, not a context manager: it is on
    every job's path."""
    every = contexts if contexts else (() if current is None else (current,))
    # A stored authority belay can't read still restricts (authority_of):
    # the key's presence is what counts.
    bounded = [ctx.id for ctx in every if AUTHORITY_KEY in ctx.meta]
    if bounded:
        _IN_FLIGHT.add(bounded)
    return (CURRENT.set(current) if current is not None else None), bounded


def leave(entered: tuple[contextvars.Token[Job | None] | None, list[int]]) -> None:
    """After the call :func:`enter` was for."""
    token, bounded = entered
    if token is not None:
        CURRENT.reset(token)
    if bounded:
        _IN_FLIGHT.remove(bounded)


@contextlib.contextmanager
def entered(current: Job | None, contexts: Sequence[Job] = ()) -> Iterator[None]:
    """:func:`enter` and :func:`leave` around a block."""
    state = enter(current, contexts)
    try:
        yield
    finally:
        leave(state)


def refuse_contextless(what: str) -> None:
    """Raise AuthorityExceeded when code with no job context tries ``what`` (an
    enqueue, a tool call) while a job with an authority runs in this process:
    it may be a thread that job started, which lost the job's context and
    with it the job's bounds (fail closed). belay's own threads may."""
    running = _IN_FLIGHT.some()
    if not running or getattr(_SYSTEM, "marked", False):
        return
    jobs = ", ".join(str(job_id) for job_id in running)
    raise AuthorityExceeded(
        f"{what} refused: this code runs outside any job's context while job(s) {jobs}, "
        "which have an authority, run in this process — a thread a job starts does not "
        "carry the job's context (nor its authority) by itself. Start the thread with "
        "belay.propagate(fn) (or contextvars.copy_context().run), or submit to a "
        "belay.ThreadPoolExecutor, so the job's authority bounds it; code that is not "
        "part of a job should run in a process that runs no jobs with an authority "
        "(a chunk worker's jobs share one call: start jobs with one job's ctx.spawn)")


def propagate(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, run in a copy of the context it was wrapped in: the job's
    ``ctx``, its authority and its trace follow it into a thread —
    ``threading.Thread(target=belay.propagate(work))``. Each call runs in a
    fresh copy, so one wrapped function may run in several threads at once."""
    captured = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return captured.copy().run(fn, *args, **kwargs)

    return run


class ThreadPoolExecutor(concurrent.futures.ThreadPoolExecutor):
    """A :class:`concurrent.futures.ThreadPoolExecutor` whose tasks run in the
    context of the code that submitted them (as ``asyncio.to_thread`` does):
    a task a job submits runs as part of that job, with its authority. Also
    for ``loop.set_default_executor(...)``, so ``run_in_executor`` does too."""

    def submit(self, fn: Callable[..., R], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[R]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)
