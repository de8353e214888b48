"""belay for asyncio producers: FastAPI and Starlette apps, async Django
views, SQLAlchemy's ``AsyncSession``, agent code on asyncio.

:class:`AsyncBelay` is the producer and reader side of :class:`belay.Belay`
on psycopg's ``AsyncConnection`` and ``AsyncConnectionPool``: enqueue (joining
a caller's ``AsyncConnection`` or, with ``belay_sqlalchemy`` imported, its
``AsyncSession``), reads, signals, steering, cancel and retry, and waits
(``await_result``, ``subscribe_events``) woken by the result notification.
It runs the same statements and the same decisions as the blocking client
(:mod:`belay.plans`) and builds rows the same way; workers stay threaded.

The module-level functions act on a default instance set up by
:func:`configure` (or, failing that, from ``BELAY_DATABASE_URL``)::

    import belay.aio

    belay.aio.configure("postgresql://localhost/app")
    job = await belay.aio.enqueue("send_email", {"to": "ada@example.com"})
    result = await belay.aio.await_result(job.id, timeout=30)

See docs/async.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolClosed

from belay import connect, names, plans
from belay.aio.driver import AConn, borrow, check_django_atomic, register_connection_adapter, run
from belay.aio.results import Waits
from belay.client import (
    CancelStatus,
    ClientSettings,
    _bounded,
    _check_signal_name,
    _conn_or_session,
    _job_id,
    build,
    check_events_page,
    finished,
    job_filter,
    sending,
    signal_body,
    steering,
)
from belay.clock import Clock
from belay.defaults import url_or_env
from belay.enqueue import JobSpec, Row, Unique, spec_from
from belay.errors import ClientClosed, ConfigurationError, JobNotFound, NotRetryable
from belay.job import Event, Job
from belay.registry import Registry
from belay.schema import SchemaStatus
from belay.store import poke_payload, result_payload
from belay.workflow import Workflow, member_errors

__all__ = [
    "AsyncBelay",
    "await_result",
    "cancel_job",
    "configure",
    "default",
    "enqueue",
    "enqueue_many",
    "enqueue_workflow",
    "events",
    "get_job",
    "list_jobs",
    "register_connection_adapter",
    "retry_job",
    "run",
    "signal_job",
    "steer_job",
    "subscribe_events",
]


class AsyncBelay(ClientSettings):
    """The asyncio client of one database. Options are :class:`belay.Belay`'s.

    An instance belongs to the event loop it first runs on (its pool and its
    LISTEN task live there): create it in your app's startup (FastAPI's
    lifespan) and ``await client.close()`` at shutdown, or use ``async with``.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        notify: bool = True,
        min_pool_size: int = 1,
        max_pool_size: int = 10,
        verify_schema: bool = True,
        application_name: str = "belay",
        registry: Registry | None = None,
        encryption_key: bytes | str | None = None,
        pooler: str | None = None,
        direct_url: str | None = None,
    ) -> None:
        super().__init__(url, clock=clock, notify=notify, min_pool_size=min_pool_size,
                         max_pool_size=max_pool_size, verify_schema=verify_schema,
                         application_name=application_name, registry=registry,
                         encryption_key=encryption_key, pooler=pooler, direct_url=direct_url)
        self._pool: AsyncConnectionPool[AConn] | None = None
        listen = self.direct_url or (None if self.pooler else self.conninfo)
        self._waits = Waits(listen if notify else None, self._channel_of_pool)
        self._channel: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None

    # -- Connections -------------------------------------------------------------

    def _own_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._opening = loop, asyncio.Lock()
        elif self._loop is not loop:
            raise ConfigurationError(
                "this AsyncBelay belongs to another event loop (the one it first ran "
                "on): create one per event loop, e.g. in your app's lifespan")

    async def _own_pool(self) -> AsyncConnectionPool[AConn]:
        self._own_loop()
        if self._waits.closed:
            raise ClientClosed()
        if self._pool is not None:
            return self._pool
        assert self._opening is not None
        async with self._opening:
            if self._waits.closed:
                raise ClientClosed()
            if self._pool is None:
                # One direct connection first: a wrong URL or a down server
                # raises its real error now, and the schema check rides on it.
                async with await psycopg.AsyncConnection.connect(
                    self.conninfo, autocommit=True, **connect.options(self.pooler)
                ) as probe:
                    await self._verify_once(probe)
                low, high = self._pool_sizes
                pool: AsyncConnectionPool[AConn] = AsyncConnectionPool(
                    self.conninfo, min_size=low, max_size=high, name="belay-aio", open=False,
                    kwargs={"autocommit": True, "application_name": self._application_name,
                            **connect.options(self.pooler)})
                await pool.open(wait=False)
                if self._waits.closed:
                    # close() ran while this one was being opened: nothing keeps it.
                    await pool.close()
                    raise ClientClosed()
                self._pool = pool
        return self._pool

    @asynccontextmanager
    async def _acquire(self, conn: Any) -> AsyncIterator[AConn]:
        if conn is None:
            pool = await self._own_pool()
            try:
                async with pool.connection() as own:
                    yield own
            except PoolClosed:
                # close() in another task, after _own_pool() handed the pool out.
                if self._waits.closed:
                    raise ClientClosed() from None
                raise
            return
        self._own_loop()
        active = await borrow(conn)
        await self._verify_once(active)
        if connect.prepares(self.pooler) or active.prepare_threshold is None:
            yield active
            return
        # Behind a transaction pooler, never prepared on a caller's connection.
        saved, active.prepare_threshold = active.prepare_threshold, None
        try:
            yield active
        finally:
            active.prepare_threshold = saved

    @asynccontextmanager
    async def transaction(self, conn: Any = None) -> AsyncIterator[AConn]:
        """A connection inside a transaction: a caller's joins its current one
        (or starts one psycopg leaves open for the caller to commit); only an
        autocommit connection gets a transaction of belay's own."""
        async with self._acquire(conn) as active:
            if (not active.autocommit
                    or active.info.transaction_status == TransactionStatus.INTRANS):
                yield active
            else:
                async with active.transaction():
                    yield active

    async def _verify_once(self, conn: AConn) -> None:
        if self._verified or not self._verify:
            return
        problem = SchemaStatus(*await run(conn, plans.schema_status())).problem
        if problem is not None:
            raise problem
        self._verified = True

    async def _notify_channel(self, conn: AConn) -> str:
        if self._channel is None:
            self._channel = names.notify_channel(await run(conn, plans.current_database()))
        return self._channel

    async def _poke(self, conn: AConn, queues: Iterable[str], results: Iterable[int] = ()
                    ) -> None:
        """Wake the workers of ``queues`` and the waiters on ``results`` when
        ``conn``'s transaction commits (§9.2)."""
        if not self.notify:
            return
        payloads = [poke_payload(q) for q in queues] + [result_payload(i) for i in results]
        if payloads:
            await run(conn, plans.notify(await self._notify_channel(conn), payloads))

    async def close(self) -> None:
        """Close the pool and stop the LISTEN task; idempotent.

        For good: waits under way in other tasks (``await_result``,
        ``subscribe_events``) end at once with :class:`~belay.errors.ClientClosed`,
        and so does every later call that would need the pool (a call on a
        connection of yours, ``conn=``, still runs on it)."""
        await self._waits.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def open(self) -> None:
        """Connect and check the schema now, so an app's startup fails fast
        (``async with`` does it); otherwise the first call does."""
        await self._own_pool()

    async def __aenter__(self) -> AsyncBelay:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- Enqueue (§5) --------------------------------------------------------------

    async def enqueue(
        self, kind: Any, input: Mapping[str, Any] | None = None, *,
        queue: str | None = None, priority: int | None = None,
        delay: float | timedelta | None = None, run_at: datetime | None = None,
        max_attempts: int | None = None, unique: str | Unique | Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
        partition_key: str | None = None, encrypt: bool | None = None, conn: Any = None,
        session: Any = None, watchdog: Mapping[str, Any] | None = None,
        authority: Mapping[str, Any] | None = None,
    ) -> Job:
        """:meth:`belay.Belay.enqueue`, awaited: ``conn=`` (or ``session=``) is an
        ``AsyncConnection`` or an ``AsyncSession`` whose transaction to join."""
        spec = JobSpec(kind, input, queue, priority, delay, run_at, max_attempts, unique,
                       budget, meta, partition_key, encrypt, watchdog, authority)
        return (await self.enqueue_many([spec], conn=_conn_or_session(conn, session)))[0]

    async def enqueue_many(
        self, jobs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Any = None,
        session: Any = None,
    ) -> list[Job]:
        """:meth:`belay.Belay.enqueue_many`, awaited: one statement for the batch."""
        conn = _conn_or_session(conn, session)
        now = self.clock.now()
        built = [self._build(spec_from(item), now) for item in jobs]
        if not built:
            return []
        with sending("enqueue", built) as rows:
            if conn is None:
                check_django_atomic()
                pool = await self._own_pool()
                async with pool.connection() as own:
                    channel = await self._notify_channel(own) if self.notify else None
                    # Autocommit: the statement inserts and pokes, and commits.
                    return await run(own, plans.enqueue(rows, now, channel=channel,
                                                        autocommit=True))
            async with self.transaction(conn) as active:
                results = await run(active, plans.enqueue(rows, now))
                await self._poke(active, {job.queue for job in results if not job.duplicate})
            return results

    async def enqueue_workflow(self, workflow: Workflow, *, conn: Any = None,
                               session: Any = None) -> dict[str, Job]:
        """:meth:`belay.Belay.enqueue_workflow`, awaited: the members in one
        transaction under the workflow lock; a second enqueue of the same
        workflow id returns the first's members with ``duplicate=True``."""
        conn = _conn_or_session(conn, session)
        if conn is None:
            check_django_atomic()
        now = self.clock.now()
        rows: dict[str, Row] = {}
        for name, spec in workflow.specs():
            with member_errors(name):
                rows[name] = self._build(spec, now)
        with sending("enqueue_workflow", list(rows.values())) as traced:
            async with self.transaction(conn) as active:
                fresh, inserted = await run(active, plans.enqueue_workflow(
                    workflow.workflow_id, traced, now))
                if not fresh:
                    return workflow.existing(inserted)
                await self._poke(active, {job.queue for job in inserted if job.state == "ready"})
        return dict(zip(rows, inserted, strict=True))

    def _build(self, spec: JobSpec, now: datetime) -> Row:
        return build(spec, now, self.registry, self.encryption_key)

    # -- Reads ---------------------------------------------------------------------

    async def get_job(self, job_id: int, *, conn: Any = None) -> Job | None:
        """The job with this id, or None."""
        job_id = _job_id(job_id)
        async with self._acquire(conn) as active:
            return await run(active, plans.get_job(job_id))

    async def list_jobs(
        self, *, queue: str | None = None, state: str | None = None, kind: Any = None,
        workflow_id: str | None = None, parent_id: int | None = None,
        before_id: int | None = None, limit: int = 50, conn: Any = None,
    ) -> list[Job]:
        """Jobs newest first, filtered; page with ``before_id=<last id seen>``."""
        where = job_filter(queue, state, kind, workflow_id, parent_id, before_id, limit)
        async with self._acquire(conn) as active:
            return await run(active, plans.list_jobs(where))

    async def events(self, job_id: int, after: int = 0, *, limit: int | None = None,
                     conn: Any = None) -> list[Event]:
        """A job's events after sequence number ``after``, at most ``limit``."""
        job_id = _job_id(job_id)
        check_events_page(after, limit)
        async with self._acquire(conn) as active:
            return await run(active, plans.list_events(job_id, after, limit))

    async def subscribe_events(
        self, job_id: int, after: int = 0, *, timeout: float | None = None,
        poll_interval: float = 0.2,
    ) -> AsyncIterator[Event]:
        """Yield a job's events live, from after seq ``after``, until the job is
        terminal and every event is out (or ``timeout`` seconds pass). A
        reconnecting consumer that passes the last seq it saw loses and
        repeats nothing; a notification ends each wait at once (the events
        are then read), and closing the client ends it with ClientClosed."""
        job_id = _job_id(job_id)
        check_events_page(after, None)
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.01
        async with self._waits.watching(job_id) as pause:
            while True:
                job = await self.get_job(job_id)
                if job is None:
                    raise JobNotFound(job_id)
                fresh = await self.events(job_id, after)
                for event in fresh:
                    yield event
                if fresh:
                    after, interval = fresh[-1].seq, 0.01
                    continue
                if job.terminal:
                    return
                wait = _bounded(interval, deadline)
                if wait is None:
                    return
                await pause(wait)
                interval = min(interval * 2, poll_interval)

    async def await_result(self, job_id: int, timeout: float | None = None) -> Any:
        """Wait for a job to finish and return its decoded result: JobFailed or
        JobCancelled when it ends that way, TimeoutError after ``timeout``
        seconds, ClientClosed when the client is closed meanwhile. Woken by
        the job's result notification, re-reads on a 5 → 50 ms backoff; the
        result is always the row's, never what a notification says."""
        job_id = _job_id(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.005
        async with self._waits.watching(job_id) as pause:
            while True:
                job = await self.get_job(job_id)
                if job is None:
                    raise JobNotFound(job_id)
                if finished(job):
                    return job.result
                wait = _bounded(interval, deadline)
                if wait is None:
                    raise TimeoutError(f"job {job_id} is still {job.state} after {timeout} s")
                # A notification only cuts the pause short: the row, read
                # next, is the answer (anyone may send one, issue 38).
                await pause(wait)
                interval = min(interval * 1.5, 0.05)

    async def _channel_of_pool(self) -> str:
        pool = await self._own_pool()
        async with pool.connection() as conn:
            return await self._notify_channel(conn)

    # -- Signals, steering, cancel and retry (§8.1, §8.6) ---------------------------

    async def signal_job(self, job_id: int, name: str, payload: Mapping[str, Any] | None = None,
                         *, conn: Any = None) -> list[int]:
        """Deliver a signal to one job; returns the ids of the jobs it woke."""
        _check_signal_name(name)
        return await self._deliver(names.job_scope(_job_id(job_id)), name, payload, conn)

    async def steer_job(self, job_id: int, payload: Mapping[str, Any], *,
                        conn: Any = None) -> list[int]:
        """Leave steering guidance for a job; its next ``ctx.steering()`` reads it."""
        return await self._deliver(names.job_scope(_job_id(job_id)), names.STEER,
                                   steering(payload), conn)

    async def _deliver(self, scope: str, name: str, payload: Mapping[str, Any] | None,
                       conn: Any) -> list[int]:
        body = signal_body(scope, payload)
        async with self.transaction(conn) as active:
            woken = await run(active, plans.deliver_signal(scope, name, body, self.clock.now()))
            await self._poke(active, {queue for _, queue in woken})
        return [job_id for job_id, _ in woken]

    async def cancel_job(self, job_id: int, *, conn: Any = None) -> CancelStatus:
        """``"cancelled"`` at once when parked or held, ``"requested"`` when
        running (it stops at its next step boundary), ``"noop"`` when finished."""
        job_id = _job_id(job_id)
        async with self.transaction(conn) as active:
            outcome = await run(active, plans.cancel_job(job_id, self.clock.now()))
            if outcome is None:
                raise JobNotFound(job_id)
            done = [outcome.job.id] if outcome.status == "cancelled" else []
            await self._poke(active, {queue for _, queue in outcome.settled.ready},
                             done + outcome.settled.cancelled)
        return outcome.status  # type: ignore[return-value]

    async def retry_job(self, job_id: int, *, conn: Any = None) -> Job:
        """Run a failed or cancelled job again (one more attempt if it used them all)."""
        job_id = _job_id(job_id)
        async with self.transaction(conn) as active:
            outcome = await run(active, plans.retry_job(job_id, self.clock.now()))
            if outcome is None:
                raise JobNotFound(job_id)
            if isinstance(outcome, str):
                raise NotRetryable(job_id, outcome)
            await self._poke(active, {queue for _, queue in outcome.settled.ready},
                             outcome.settled.cancelled)
        return outcome.job


# -- The default instance ----------------------------------------------------------

_instance: AsyncBelay | None = None


def configure(url: str | None = None, **options: Any) -> AsyncBelay:
    """Set up the default instance the module-level functions use. ``url``
    falls back to ``BELAY_DATABASE_URL``; ``options`` are :class:`AsyncBelay`'s.
    The one it replaces is not closed (it may belong to another event loop):
    ``await`` its ``close()`` where it ran."""
    global _instance
    _instance = AsyncBelay(url_or_env(url), **options)
    return _instance


def default() -> AsyncBelay:
    """The default instance, created from ``BELAY_DATABASE_URL`` on first use."""
    global _instance
    if _instance is None:
        _instance = AsyncBelay(url_or_env(None))
    return _instance


async def enqueue(kind: Any, input: Mapping[str, Any] | None = None, **options: Any) -> Job:
    """:meth:`AsyncBelay.enqueue` on the default instance."""
    return await default().enqueue(kind, input, **options)


async def enqueue_many(jobs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Any = None,
                       session: Any = None) -> list[Job]:
    return await default().enqueue_many(jobs, conn=conn, session=session)


async def enqueue_workflow(workflow: Workflow, *, conn: Any = None,
                           session: Any = None) -> dict[str, Job]:
    return await default().enqueue_workflow(workflow, conn=conn, session=session)


async def get_job(job_id: int, *, conn: Any = None) -> Job | None:
    return await default().get_job(job_id, conn=conn)


async def list_jobs(**filters: Any) -> list[Job]:
    return await default().list_jobs(**filters)


async def events(job_id: int, after: int = 0, *, limit: int | None = None,
                 conn: Any = None) -> list[Event]:
    return await default().events(job_id, after, limit=limit, conn=conn)


def subscribe_events(job_id: int, after: int = 0, *, timeout: float | None = None,
                     poll_interval: float = 0.2) -> AsyncIterator[Event]:
    return default().subscribe_events(job_id, after, timeout=timeout,
                                      poll_interval=poll_interval)


async def await_result(job_id: int, timeout: float | None = None) -> Any:
    return await default().await_result(job_id, timeout)


async def signal_job(job_id: int, name: str, payload: Mapping[str, Any] | None = None, *,
                     conn: Any = None) -> list[int]:
    return await default().signal_job(job_id, name, payload, conn=conn)


async def steer_job(job_id: int, payload: Mapping[str, Any], *, conn: Any = None) -> list[int]:
    return await default().steer_job(job_id, payload, conn=conn)


async def cancel_job(job_id: int, *, conn: Any = None) -> CancelStatus:
    return await default().cancel_job(job_id, conn=conn)


async def retry_job(job_id: int, *, conn: Any = None) -> Job:
    return await default().retry_job(job_id, conn=conn)
