"""Result and event notifications (§9.2) for asyncio waiters: one LISTEN
connection per :class:`~belay.aio.AsyncBelay`, read by one task, waking the
``await_result`` and ``subscribe_events`` callers of the job a message is
about. Like the blocking :class:`belay.notify.ResultListener`, it only cuts
waits short: the waiters re-read the job, so a lost message costs latency,
and a forged one (anyone may ``pg_notify``) a read. Closing the client ends
every wait at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import psycopg
from psycopg import sql

from belay.errors import ClientClosed
from belay.notify import about_job, parse
from belay.sql import QUERIES

log = logging.getLogger("belay.aio")


class Results:
    def __init__(self, conninfo: str, channel: str) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._waiters: dict[int, set[asyncio.Event]] = defaultdict(set)
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

    def watch(self, job_id: int, wake: asyncio.Event) -> None:
        """Set ``wake`` on each message about ``job_id``. Register before
        reading the job, so a message in between is not missed."""
        self._waiters[job_id].add(wake)

    def unwatch(self, job_id: int, wake: asyncio.Event) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None:
            waiters.discard(wake)
            if not waiters:
                del self._waiters[job_id]

    def _dispatch(self, payload: str) -> None:
        # Only the job id is used, to find whom to wake: the waiter reads the
        # row (a state or a result in the message is anyone's to forge).
        message = parse(payload)
        job_id = None if message is None else about_job(message)
        if job_id is None:
            return
        for wake in self._waiters.get(job_id, ()):
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


#: ``pause(seconds)``: wait that long, or less when a notification about the
#: job comes; raises :class:`~belay.errors.ClientClosed` once the client is closed.
Pause = Callable[[float], Awaitable[None]]


class Waits:
    """The waits of one client: each cut short by its job's notifications when
    it can LISTEN (``listen``, a conninfo), a plain timed wait otherwise, and
    all ended by :meth:`close`. ``channel`` reads the database's notify
    channel (§9.2) when first needed."""

    def __init__(self, listen: str | None, channel: Callable[[], Awaitable[str]]) -> None:
        self._listen = listen
        self._channel = channel
        self._results: Results | None = None
        self._wakes: set[asyncio.Event] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Set for good by :meth:`close`: the client opens nothing after it."""
        return self._closed

    async def _listener(self) -> Results | None:
        if self._listen is None:
            return None
        if self._results is None:
            channel = await self._channel()
            if self._closed:
                raise ClientClosed()  # closed while the channel was read
            if self._results is None:
                self._results = Results(self._listen, channel)
                self._results.start()
        return self._results

    @asynccontextmanager
    async def watching(self, job_id: int) -> AsyncIterator[Pause]:
        """A :data:`Pause` for ``job_id``, registered before the caller's first read."""
        if self._closed:
            raise ClientClosed()
        results = await self._listener()
        if self._closed:
            raise ClientClosed()
        wake = asyncio.Event()
        self._wakes.add(wake)
        if results is not None:
            results.watch(job_id, wake)

        async def pause(seconds: float) -> None:
            # asyncio.TimeoutError: TimeoutError itself from Python 3.11.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), seconds)
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
            if results is not None:
                results.unwatch(job_id, wake)
            self._wakes.discard(wake)

    async def close(self) -> None:
        """End every wait under way (each raises ClientClosed), refuse new
        ones and stop the LISTEN task; idempotent."""
        self._closed = True
        for wake in self._wakes:
            wake.set()
        results, self._results = self._results, None
        if results is not None:
            await results.stop()
