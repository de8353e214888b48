"""Result notifications for ``await_result`` (contract §9.2).

One thread per client (``belay-results``) holds a LISTEN connection and sets
an event for each job a caller waits on when its result notification arrives.
Notifications are an accelerator only: a waiter re-reads the job on a
backoff whatever happens here, so a lost or late notification costs latency,
never a result.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import psycopg
from psycopg import sql

from belay.codec import loads
from belay.sql import QUERIES

log = logging.getLogger("belay.notify")


class ResultListener:
    def __init__(self, conninfo: str, channel: str) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._waiters: dict[int, set[threading.Event]] = defaultdict(set)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set once LISTEN is in place (a test signal; production never waits on it).
        self.listening = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="belay-results", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)

    def watch(self, job_id: int) -> threading.Event:
        """Register before reading the job, so a notification in between is not missed."""
        event = threading.Event()
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

    def _dispatch(self, payload: str) -> None:
        try:
            message: Any = loads(payload)
        except ValueError:
            return
        if not isinstance(message, dict) or message.get("t") != "r":
            return
        job_id = message.get("id")
        with self._lock:
            for event in self._waiters.get(job_id, ()) if isinstance(job_id, int) else ():
                event.set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self._conninfo,
                    autocommit=True,
                    application_name="belay-results",
                    connect_timeout=10,
                ) as conn:
                    channel = sql.Identifier(self._channel)
                    conn.execute(sql.SQL(QUERIES["listen"]).format(channel=channel))
                    self.listening.set()
                    backoff = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._dispatch(note.payload)
            except Exception:
                # Any failure (server restart, pooler without LISTEN): waiters
                # keep polling; try again with a capped backoff.
                log.debug("result listener failed; retrying in %.1fs", backoff, exc_info=True)
                self.listening.clear()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        self.listening.clear()
