"""LISTEN side of the wake-ups (contract §9.2).

:class:`Listener` is one thread holding an autocommit LISTEN connection that
reconnects on failure and hands each parsed message to a callback. The client
uses it for result notifications (``await_result``), the worker for pokes.
Notifications are an accelerator only: polling is the correctness floor, so a
lost or late message costs latency, never work.

A message is never a value either. ``pg_notify`` needs no privilege: any role
that may connect can send anything on belay's channel (issue 38). So a
message only says where to look — which job's waiters to wake, which queue's
producer — and whoever it wakes reads the database for the answer. A forged
message costs a read, never a wrong answer or a skipped job.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from belay.codec import loads
from belay.parts.service import Service
from belay.sql import QUERIES

log = logging.getLogger("belay.notify")


def parse(payload: str) -> dict[str, Any] | None:
    """A notification's message, or None when it is not a JSON object."""
    try:
        message: Any = loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


class Listener:
    def __init__(
        self,
        conninfo: str,
        channel: str,
        on_message: Callable[[dict[str, Any]], None],
        *,
        name: str,
        on_crash: Callable[[Service, BaseException], None] | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._on_message = on_message
        self._name = name
        self._on_crash = on_crash
        self._lock = threading.Lock()
        self._service: Service | None = None
        #: Set while LISTEN is in place (a test signal; production never waits on it).
        self.listening = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._service is not None:
                return
            self._service = Service(self._name, self._run, on_crash=self._on_crash).start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            service, self._service = self._service, None
        if service is None:
            return
        service.stop()
        service.join(timeout)

    def _dispatch(self, payload: str) -> None:
        message = parse(payload)
        if message is not None:
            try:
                self._on_message(message)
            except Exception:
                log.exception("%s: handling %r failed", self._name, payload)

    def _run(self, service: Service) -> None:
        backoff = 0.1
        while not service.stopping:
            try:
                with psycopg.connect(
                    self._conninfo,
                    autocommit=True,
                    application_name=self._name,
                    connect_timeout=10,
                ) as conn:
                    channel = sql.Identifier(self._channel)
                    conn.execute(sql.SQL(QUERIES["listen"]).format(channel=channel))
                    self.listening.set()
                    backoff = 0.1
                    while not service.stopping:
                        for note in conn.notifies(timeout=0.5):
                            self._dispatch(note.payload)
            except Exception:
                # A server restart, a pooler without LISTEN: keep polling, retry.
                log.debug("%s failed; retrying in %.1fs", self._name, backoff, exc_info=True)
                self.listening.clear()
                service.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        self.listening.clear()


class ResultListener:
    """Wakes ``await_result`` and ``subscribe_events`` callers when a result (or an
    event) notification for their job arrives."""

    def __init__(self, conninfo: str, channel: str) -> None:
        self._waiters: dict[int, set[threading.Event]] = defaultdict(set)
        self._lock = threading.Lock()
        # Through a lambda so the handler stays replaceable (tests record with it).
        self._listener = Listener(
            conninfo, channel, lambda message: self._on_message(message), name="belay-results"
        )
        self.listening = self._listener.listening

    def start(self) -> None:
        self._listener.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._listener.stop(timeout)

    def watch(self, job_id: int, event: threading.Event | None = None) -> threading.Event:
        """Set ``event`` (a new one by default) on each notification about
        ``job_id``. Register before reading the job, so a notification in
        between is not missed."""
        event = threading.Event() if event is None else event
        with self._lock:
            self._waiters[job_id].add(event)
        return event

    def unwatch(self, job_id: int, event: threading.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(job_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[job_id]

    def _on_message(self, message: dict[str, Any]) -> None:
        # Only the job id is used, to find whom to wake: the waiter reads the
        # job's row (whatever else the message says, a state or a result, is
        # anyone's to forge).
        job_id = about_job(message)
        if job_id is None:
            return
        with self._lock:
            for event in self._waiters.get(job_id, ()):
                event.set()


def about_job(message: dict[str, Any]) -> int | None:
    """The job a result or event notification (§9.2) is about; None for
    other messages (pokes, types a newer engine sends)."""
    job_id = message.get("id")
    if message.get("t") not in ("r", "e") or not isinstance(job_id, int):
        return None
    return job_id
