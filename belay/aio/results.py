"""Result and event notifications (§9.2) for asyncio waiters: one LISTEN
connection per :class:`~belay.aio.AsyncBelay`, read by one task, waking the
``await_result`` and ``subscribe_events`` callers of the job a message is
about. Like the blocking :class:`belay.notify.ResultListener`, it only cuts
waits short: the waiters re-read the job, so a lost message costs latency."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from belay.notify import about_job, carried, parse
from belay.sql import QUERIES

log = logging.getLogger("belay.aio")


class Wake(asyncio.Event):
    """One waiter's wake-up; ``outcome`` the last result notification that set it."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome: dict[str, Any] | None = None

    def carried(self) -> tuple[bool, Any]:
        return carried(self.outcome)


class Results:
    def __init__(self, conninfo: str, channel: str) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._waiters: dict[int, set[Wake]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        #: Set while LISTEN is in place (tests wait on it; waiters never do).
        self.listening = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="belay-aio-results")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def watch(self, job_id: int) -> Wake:
        """Register before reading the job, so a message in between is not missed."""
        wake = Wake()
        self._waiters[job_id].add(wake)
        return wake

    def unwatch(self, job_id: int, wake: Wake) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None:
            waiters.discard(wake)
            if not waiters:
                del self._waiters[job_id]

    def _dispatch(self, payload: str) -> None:
        message = parse(payload)
        job_id = None if message is None else about_job(message)
        if message is None or job_id is None:
            return
        for wake in self._waiters.get(job_id, ()):
            if message.get("t") == "r":
                wake.outcome = message
            wake.set()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, application_name="belay-aio-results",
                    connect_timeout=10,
                ) as conn:
                    listen = sql.SQL(QUERIES["listen"]).format(
                        channel=sql.Identifier(self._channel))
                    await conn.execute(listen)
                    self.listening.set()
                    backoff = 0.1
                    async for note in conn.notifies():
                        self._dispatch(note.payload)
            except asyncio.CancelledError:
                self.listening.clear()
                raise
            except Exception:
                # A server restart, a pooler without LISTEN: waiters poll; retry.
                log.debug("belay-aio-results failed; retrying in %.1fs", backoff,
                          exc_info=True)
                self.listening.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)


#: ``pause(seconds)``: wait that long, or less when a notification comes;
#: ``(True, result)`` when it carried the job's result.
Pause = Callable[[float], Awaitable[tuple[bool, Any]]]


class Waits:
    """The waits of one client: each cut short by its job's notifications when
    it can LISTEN (``listen``, a conninfo), a plain sleep otherwise.
    ``channel`` reads the database's notify channel (§9.2) when first needed."""

    def __init__(self, listen: str | None, channel: Callable[[], Awaitable[str]]) -> None:
        self._listen = listen
        self._channel = channel
        self._results: Results | None = None

    async def _listener(self) -> Results | None:
        if self._listen is None:
            return None
        if self._results is None:
            channel = await self._channel()
            if self._results is None:
                self._results = Results(self._listen, channel)
                self._results.start()
        return self._results

    @asynccontextmanager
    async def watching(self, job_id: int) -> AsyncIterator[Pause]:
        """A :data:`Pause` for ``job_id``, registered before the caller's first read."""
        results = await self._listener()
        if results is None:
            async def sleep(seconds: float) -> tuple[bool, Any]:
                await asyncio.sleep(seconds)
                return False, None

            yield sleep
            return
        wake = results.watch(job_id)

        async def pause(seconds: float) -> tuple[bool, Any]:
            # asyncio.TimeoutError: TimeoutError itself from Python 3.11.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), seconds)
            wake.clear()
            return wake.carried()

        try:
            yield pause
        finally:
            results.unwatch(job_id, wake)

    async def stop(self) -> None:
        results, self._results = self._results, None
        if results is not None:
            await results.stop()
