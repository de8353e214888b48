"""The waits of one :class:`belay.Belay` (``await_result``,
``subscribe_events``): each a pause that a notification about its job cuts
short, and that closing the client ends at once.

A notification is only a hint to read the job again (:mod:`belay.notify`):
a pause returns nothing, and its caller reads the row for the answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from belay.errors import ClientClosed
from belay.notify import ResultListener

#: ``pause(seconds)``: wait that long, or less when a notification about the
#: job comes; raises :class:`ClientClosed` once the client is closed.
Pause = Callable[[float], None]


class Waits:
    """Every pause under way on one client, so that ``close()`` can end them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: set[threading.Event] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Set for good by :meth:`close`: the client opens nothing after it."""
        return self._closed

    def close(self) -> None:
        """End every pause under way (each raises :class:`ClientClosed`) and
        refuse new ones; idempotent."""
        with self._lock:
            self._closed = True
            wakes = list(self._wakes)
        for wake in wakes:
            wake.set()

    @contextmanager
    def watching(self, job_id: int, listener: ResultListener | None) -> Iterator[Pause]:
        """A :data:`Pause` for ``job_id``, woken by ``listener`` (None: none,
        the pause runs its full length). Enter it before the first read of
        the job, so a notification in between is not missed."""
        wake = threading.Event()
        with self._lock:
            if self._closed:
                raise ClientClosed()
            self._wakes.add(wake)
        if listener is not None:
            listener.watch(job_id, wake)

        def pause(seconds: float) -> None:
            wake.wait(seconds)
            wake.clear()
            if self._closed:
                raise ClientClosed(job_id)

        try:
            yield pause
        except ClientClosed as exc:
            if exc.job_id is None:
                # A read that found the client closed: say which wait it ended.
                raise ClientClosed(job_id) from None
            raise
        finally:
            if listener is not None:
                listener.unwatch(job_id, wake)
            with self._lock:
                self._wakes.discard(wake)
