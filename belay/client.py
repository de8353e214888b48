"""The belay client: enqueue, read, signal, steer, cancel, retry, await results.

A :class:`Belay` owns a lazily opened connection pool (never carried across
``fork()``: a child process opens its own). Every call can instead run on a
caller's psycopg connection (``conn=``), inside the caller's transaction.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed

from belay import connect, names, otel, plans, schema, store
from belay.ambient import current_job, refuse_contextless
from belay.authority import Authority, authority_of
from belay.budget import check_top_up, check_top_up_key
from belay.clock import Clock, SystemClock
from belay.codec import dumps_object
from belay.cron import DynamicCron, dynamic_values
from belay.crypto import encrypt_input, parse_key
from belay.enqueue import JobSpec, Row, Unique, build_row, spec_from, with_trace
from belay.errors import (
    ClientClosed,
    ConfigurationError,
    JobCancelled,
    JobFailed,
    JobNotFound,
    NotRetryable,
    ValidationError,
)
from belay.job import STATES, Event, Job, Step, WorkflowStatus
from belay.notify import ResultListener
from belay.queues import QueueSpec
from belay.queues import parse_spec as parse_queue_spec
from belay.redact import redact, secrets_of
from belay.registry import DEFAULT_REGISTRY, Registry
from belay.schedules import Schedule, SchedulePage
from belay.spend import DEFAULT_LIMIT as SPEND_LIMIT
from belay.spend import Query as SpendQuery
from belay.spend import SpendReport, SpendTree
from belay.waits import Pause, Waits
from belay.workflow import Workflow, member_errors

Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Borrowed:
    """A caller's connection, as a framework adapter hands it to belay.

    ``conn`` is the psycopg connection underneath (its transaction is the
    caller's). ``defer_notify``, when set, takes the wake-ups (channel and
    payloads) to send when the caller commits, instead of ``pg_notify`` in the
    transaction; it must drop them on rollback.
    """

    conn: Conn
    defer_notify: Callable[[str, list[bytes]], None] | None = None


#: ``conn=`` resolvers for framework objects (a Django connection, a SQLAlchemy
#: Session…): each returns a Borrowed for the objects it knows, else None.
_ADAPTERS: list[Callable[[Any], Borrowed | None]] = []


def register_connection_adapter(adapter: Callable[[Any], Borrowed | None]) -> None:
    """Let ``conn=`` take another kind of object (the Django and SQLAlchemy
    adapters register theirs on import); idempotent."""
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)


def borrow(conn: Any) -> Borrowed:
    """What a ``conn=`` argument stands for: a psycopg connection, or an object a
    registered adapter knows."""
    if isinstance(conn, psycopg.Connection):
        return Borrowed(conn)
    for adapter in _ADAPTERS:
        borrowed = adapter(conn)
        if borrowed is not None:
            return borrowed
    raise ValidationError(
        f"conn= takes a psycopg 3 connection, got {type(conn).__name__}: for a Django "
        "connection add 'belay_django' to INSTALLED_APPS, for a SQLAlchemy Session or "
        "Connection import belay_sqlalchemy"
    )
CancelStatus = Literal["cancelled", "requested", "noop"]

_SCHEMES = ("postgresql://", "postgres://")
STATS_CAP = store.STATS_CAP
#: From this many conflict-free jobs on, enqueue_many writes by COPY (two
#: round trips) instead of one INSERT statement (one round trip, but more
#: work per row on both sides).
COPY_AT = 64


def normalize_url(url: str) -> str:
    """Check a database URL and return the conninfo psycopg takes.

    Accepts ``postgresql://`` / ``postgres://`` URLs (``postgresql+psycopg://``
    too, as SQLAlchemy spells it) and libpq key=value strings.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError("a database URL is required, e.g. postgresql://user@host/db")
    url = url.strip()
    if "://" in url:
        scheme, rest = url.split("://", 1)
        base, _, driver = scheme.partition("+")
        if base not in ("postgresql", "postgres") or driver not in ("", "psycopg"):
            raise ConfigurationError(
                f"unsupported database URL scheme {scheme!r}: belay needs "
                "postgresql://user:password@host:port/dbname"
            )
        url = f"postgresql://{rest}"
    try:
        pg_conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # psycopg quotes the URL, or a piece of it: never its password.
        raise ConfigurationError(
            f"invalid database URL: {redact(str(exc).strip(), secrets_of(url))}") from None
    return url


class ClientSettings:
    """What every client checks and keeps (:class:`Belay`,
    :class:`belay.aio.AsyncBelay`): where and how to connect, the clock, the
    registry, the encryption key."""

    def __init__(self, url: str, *, clock: Clock | None, notify: bool, min_pool_size: int,
                 max_pool_size: int, verify_schema: bool, application_name: str,
                 registry: Registry | None, encryption_key: bytes | str | None,
                 pooler: str | None, direct_url: str | None) -> None:
        self.conninfo = normalize_url(url)
        #: "transaction" or "transaction-prepared" behind a transaction-pooling
        #: pooler, else None.
        self.pooler = connect.pooler_setting(pooler)
        direct = connect.direct_url_setting(direct_url)
        #: A URL that reaches the server directly (LISTEN, replay), if given.
        self.direct_url = None if direct is None else normalize_url(direct)
        if min_pool_size < 0 or max_pool_size < max(1, min_pool_size):
            raise ConfigurationError(
                f"pool sizes must satisfy 0 <= min_pool_size <= max_pool_size and "
                f"max_pool_size >= 1; got {min_pool_size} and {max_pool_size}"
            )
        self.clock: Clock = clock or SystemClock()
        #: Where a kind given as a string finds its worker's enqueue defaults.
        self.registry = registry if registry is not None else DEFAULT_REGISTRY
        #: AES-256 key for encrypted input (``encrypt=True``; extra ``crypto``).
        self.encryption_key = parse_key(encryption_key)
        self.notify = notify
        self._pool_sizes = (min_pool_size, max_pool_size)
        self._application_name = application_name
        self._verify = verify_schema
        self._verified = False


class Belay(ClientSettings):
    """One belay instance: a database, a clock and a connection pool.

    ``url`` is a PostgreSQL URL. ``clock`` supplies "now" (contract §2).
    ``notify`` sends ``pg_notify`` wake-ups with enqueues and wakes (§9.2).
    ``registry`` (default: the one ``@belay.worker`` fills) gives a kind named
    by string its worker's defaults (queue, max_attempts, priority, unique).
    ``connection_provider`` (for framework adapters) returns the connection
    calls without ``conn=`` should use, or None for belay's own pool.
    ``pooler="transaction"`` (default: ``BELAY_POOLER``) when ``url`` goes
    through a transaction-pooling pooler such as PgBouncer: no server-side
    prepared statements, nothing kept across transactions, and LISTEN only on
    ``direct_url`` (default: ``BELAY_DIRECT_URL``), a URL that reaches the
    server directly; without one, waits poll (docs/scaling.md).
    ``pooler="transaction-prepared"``: the same behind a pooler that tracks
    prepared statements (PgBouncer 1.21+ with ``max_prepared_statements``),
    where belay's statements are prepared again.
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
        connection_provider: Callable[[], Any] | None = None,
        pooler: str | None = None,
        direct_url: str | None = None,
    ) -> None:
        super().__init__(url, clock=clock, notify=notify, min_pool_size=min_pool_size,
                         max_pool_size=max_pool_size, verify_schema=verify_schema,
                         application_name=application_name, registry=registry,
                         encryption_key=encryption_key, pooler=pooler, direct_url=direct_url)
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._listener: ResultListener | None = None
        #: The waits under way; closed (for good) by close().
        self._waits = Waits()
        self._channel: str | None = None
        self._pid = os.getpid()
        #: Calls without ``conn=`` run on what this returns (a framework's
        #: connection of the current thread, so they join its transaction), or on
        #: the pool when it returns None.
        self.connection_provider = connection_provider
        #: Per thread: the wake-up deferrers of the borrowed connections in use.
        self._deferrers = threading.local()

    # -- Connections -------------------------------------------------------------

    def _own_pool(self) -> ConnectionPool:
        with self._lock:
            if self._waits.closed:
                raise ClientClosed()
            if self._pid != os.getpid():
                # Forked: the parent's pool and listener belong to the parent.
                # Drop them unclosed (closing would talk on the parent's sockets).
                self._pool, self._listener, self._pid = None, None, os.getpid()
            if self._pool is None:
                # One direct connection first: a wrong URL or a down server
                # raises its real error now, instead of a pool timeout later,
                # and the schema check (§1) rides on it.
                with self.connect(autocommit=True) as probe:
                    self._verify_once(probe)
                low, high = self._pool_sizes
                pool = connect.pool(
                    self.conninfo, self.pooler, min_size=low, max_size=high, name="belay",
                    open=False, kwargs={"application_name": self._application_name},
                )
                pool.open(wait=False)
                self._pool = pool
            return self._pool

    @contextmanager
    def _acquire(self, conn: Any) -> Iterator[Conn]:
        if conn is None and self.connection_provider is not None:
            conn = self.connection_provider()
        if conn is None:
            borrowed = None
        else:
            borrowed = borrow(conn)
            if borrowed.conn.info.transaction_status == TransactionStatus.INERROR:
                raise ValidationError(
                    "the connection's transaction has failed; roll it back before using belay "
                    "on it"
                )
        # The innermost acquire decides where pokes go: a call on belay's own
        # pool inside a borrowed one must not hand its pokes to the caller's commit.
        stack = self._deferrer_stack()
        stack.append(None if borrowed is None else borrowed.defer_notify)
        try:
            if borrowed is not None:
                with self._unprepared(borrowed.conn):
                    yield borrowed.conn
            else:
                try:
                    with self._own_pool().connection() as own:
                        yield own
                except PoolClosed:
                    # close() on another thread, after _own_pool() handed the pool out.
                    if self._waits.closed:
                        raise ClientClosed() from None
                    raise
        finally:
            stack.pop()

    @contextmanager
    def _unprepared(self, conn: Conn) -> Iterator[None]:
        """Behind a transaction pooler, belay's statements on a caller's
        connection are never prepared server-side (the caller's own setting
        comes back afterwards)."""
        if connect.prepares(self.pooler) or conn.prepare_threshold is None:
            yield
            return
        saved, conn.prepare_threshold = conn.prepare_threshold, None
        try:
            yield
        finally:
            conn.prepare_threshold = saved

    def connect(self, **kwargs: Any) -> Conn:
        """A new connection of belay's own to ``url``, set up for the pooler mode."""
        return connect.connect(self.conninfo, self.pooler, **kwargs)

    @property
    def listen_conninfo(self) -> str | None:
        """Where LISTEN can run: ``direct_url``, else ``url`` unless that goes
        through a transaction pooler (then None: waits poll)."""
        if self.direct_url is not None:
            return self.direct_url
        return None if self.pooler else self.conninfo

    def _deferrer_stack(self) -> list[Callable[[str, list[bytes]], None] | None]:
        stack: list[Callable[[str, list[bytes]], None] | None] | None = getattr(
            self._deferrers, "stack", None)
        if stack is None:
            stack = self._deferrers.stack = []
        return stack

    @contextmanager
    def connection(self, conn: Conn | None = None) -> Iterator[Conn]:
        """A connection for a read: the caller's, or one from the pool."""
        with self._acquire(conn) as active:
            self._verify_once(active)
            yield active

    @contextmanager
    def transaction(self, conn: Conn | None = None) -> Iterator[Conn]:
        """A connection inside a transaction.

        A caller's connection that is not in autocommit mode is used as is: the
        statements join its current transaction, or start one psycopg leaves
        open for the caller to commit or roll back, so advisory locks and
        pokes last until *the caller* commits. Only an autocommit connection
        (the pool's, or a caller's) gets a transaction of belay's own.
        """
        with self._acquire(conn) as active:
            if (
                not active.autocommit
                or active.info.transaction_status == TransactionStatus.INTRANS
            ):
                self._verify_once(active)
                yield active
            else:
                with active.transaction():
                    self._verify_once(active)
                    yield active

    def _verify_once(self, conn: Conn) -> None:
        if self._verified or not self._verify:
            return
        schema.check(conn)
        self._verified = True

    def notify_channel(self, conn: Conn) -> str:
        """The database's NOTIFY channel (§9.2), from the server's name for it
        (behind a pooler, the URL's dbname may be an alias); read once."""
        channel = self._channel
        if channel is None:
            channel = self._channel = names.notify_channel(store.current_database(conn))
        return channel

    def poke(self, conn: Conn, queues: Iterable[str], results: Iterable[int] = ()) -> None:
        """Inside ``conn``'s transaction (with ``notify=True``): wake the
        workers of ``queues`` and the waiters on the results of the job ids
        ``results`` (§9.2), at commit; deferred to the outer transaction when
        a framework adapter holds one open."""
        if not self.notify:
            return
        payloads = [store.poke_payload(q) for q in queues]
        payloads += [store.result_payload(i) for i in results]
        if not payloads:
            return
        stack = self._deferrer_stack()
        defer = stack[-1] if stack else None
        if defer is not None:
            defer(self.notify_channel(conn), payloads)
        else:
            store.notify(conn, self.notify_channel(conn), payloads)

    def close(self) -> None:
        """Close the pool and stop the result listener; idempotent.

        For good: waits under way on other threads (``await_result``,
        ``subscribe_events``) end at once with :class:`ClientClosed`, and so
        does every later call that would need the pool or the listener (a
        call on a connection of yours, ``conn=``, still runs on it)."""
        # First, so the waits end even while an open holds the lock; a pool
        # opened meanwhile is the one taken and closed below.
        self._waits.close()
        with self._lock:
            pool, self._pool = self._pool, None
            listener, self._listener = self._listener, None
            mine = self._pid == os.getpid()
        if listener is not None and mine:
            listener.stop()
        if pool is not None and mine:
            pool.close()

    def __enter__(self) -> Belay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def now(self) -> datetime:
        return self.clock.now()

    # -- Schema ------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Apply pending migrations; returns the revisions applied."""
        with self.connect(autocommit=True) as conn:
            applied = schema.migrate(conn)
        self._verified = False
        return applied

    def check_schema(self) -> schema.SchemaStatus:
        """Raise a SchemaError (saying what to do) unless belay can run here."""
        with self.connect(autocommit=True) as conn:
            return schema.check(conn)

    # -- Enqueue (§5) --------------------------------------------------------------

    def enqueue(
        self,
        kind: Any,
        input: Mapping[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique: str | Unique | Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        partition_key: str | None = None,
        encrypt: bool | None = None,
        conn: Conn | None = None,
        session: Any = None,
        watchdog: Mapping[str, Any] | None = None,
        authority: Mapping[str, Any] | None = None,
    ) -> Job:
        """Insert one job; with a ``unique`` key already held, return the holder
        flagged ``duplicate=True`` instead (§5.2). ``encrypt=True`` stores the
        input AES-256-GCM-encrypted with the client's ``encryption_key``.
        ``session=`` is another name for ``conn=`` (a framework's session).
        ``watchdog={"repeats": 3, "stall": 600, "on_trip": "pause"}`` stops a
        run that makes no progress (:mod:`belay.watchdog`).
        ``authority={"tools": [...], "queues": [...], "kinds": [...], "usd": 5}``
        bounds what the job may call, start and spend; what it starts inherits
        it, narrowed at most (:mod:`belay.authority`)."""
        spec = JobSpec(kind, input, queue, priority, delay, run_at, max_attempts, unique,
                       budget, meta, partition_key, encrypt, watchdog, authority)
        return self.enqueue_many([spec], conn=_conn_or_session(conn, session))[0]

    def enqueue_many(
        self, jobs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Conn | None = None,
        session: Any = None,
    ) -> list[Job]:
        """Insert many jobs in one statement. Returns one Job per request, in
        order: the inserted row, or the holder of its unique key with
        ``duplicate=True``. Every request is validated before anything is written.
        """
        conn = _conn_or_session(conn, session)
        now = self.clock.now()
        built = [self._build(spec_from(item), now) for item in jobs]
        if not built:
            return []
        with sending("enqueue", built) as rows:
            if conn is None and self.connection_provider is None:
                return self._insert_own(rows, now)
            with self.transaction(conn) as active:
                results = self._insert(active, rows, now)
                self.poke(active, {job.queue for job in results if not job.duplicate})
            return results

    def _insert_own(self, rows: Sequence[Row], now: datetime) -> list[Job]:
        """An enqueue on belay's own (autocommit) connection, in the fewest
        round trips: one statement that inserts and pokes for a small batch or
        one with keys; a COPY in a short transaction for a large conflict-free
        batch."""
        with self._acquire(None) as active:
            self._verify_once(active)
            channel = self.notify_channel(active) if self.notify else None
            if len(rows) >= COPY_AT and store.conflict_free(rows):
                with active.transaction():
                    jobs = store.copy_jobs(active, rows, now)
                    if channel is not None:
                        store.notify(active, channel,
                                     [store.poke_payload(q) for q in {r.queue for r in rows}])
                return jobs
            return self._insert(active, rows, now, channel=channel)

    def enqueue_workflow(
        self, workflow: Workflow, *, conn: Conn | None = None, session: Any = None
    ) -> dict[str, Job]:
        """Insert a :class:`belay.Workflow`'s members in one transaction (§8.3):
        members with deps ``held``, the others ``ready``. Returns the jobs by
        member name.

        Runs under the workflow lock: when the workflow id already has members
        (an enqueue retried after a network error, or of an explicit
        ``workflow_id`` used before), they are returned with ``duplicate=True``
        and nothing is inserted.
        """
        conn = _conn_or_session(conn, session)
        now = self.clock.now()
        rows: dict[str, Row] = {}
        for name, spec in workflow.specs():
            with member_errors(name):
                rows[name] = self._build(spec, now)
        with sending("enqueue_workflow", list(rows.values())) as traced, \
                self.transaction(conn) as active:
            fresh, inserted = store.run(active, plans.enqueue_workflow(
                workflow.workflow_id, traced, now))
            if not fresh:
                return workflow.existing(inserted)
            self.poke(active, {job.queue for job in inserted if job.state == "ready"})
        return dict(zip(rows, inserted, strict=True))

    def _build(self, spec: JobSpec, now: datetime) -> Row:
        return build(spec, now, self.registry, self.encryption_key)

    def _insert(
        self, conn: Conn, rows: Sequence[Row], now: datetime, *, channel: str | None = None
    ) -> list[Job]:
        """Insert ``rows``; a skipped row's result is the holder of its key.
        With a ``channel`` (an autocommit connection), each insert statement
        pokes its own queues and commits on its own."""
        autocommit = conn.info.transaction_status == TransactionStatus.IDLE
        return store.run(conn, plans.enqueue(rows, now, channel=channel, autocommit=autocommit))

    # -- Reads -------------------------------------------------------------------

    def get_job(self, job_id: int, *, conn: Conn | None = None) -> Job | None:
        """The job with this id, or None."""
        with self.connection(conn) as active:
            return store.get_job(active, _job_id(job_id))

    def list_jobs(
        self,
        *,
        queue: str | None = None,
        state: str | None = None,
        kind: Any = None,
        workflow_id: str | None = None,
        parent_id: int | None = None,
        before_id: int | None = None,
        limit: int = 50,
        conn: Conn | None = None,
    ) -> list[Job]:
        """Jobs newest first, filtered; page with ``before_id=<last id seen>``."""
        where = job_filter(queue, state, kind, workflow_id, parent_id, before_id, limit)
        with self.connection(conn) as active:
            return store.list_jobs(active, where)

    def steps(self, job_id: int, *, conn: Conn | None = None) -> list[Step]:
        """A job's step journal in order, with decoded values and costs."""
        with self.connection(conn) as active:
            return store.list_steps(active, _job_id(job_id))

    def events(self, job_id: int, after: int = 0, *, limit: int | None = None,
               conn: Conn | None = None) -> list[Event]:
        """A job's event stream after sequence number ``after`` (0: from the start),
        at most ``limit`` of them (None: all)."""
        check_events_page(after, limit)
        with self.connection(conn) as active:
            return store.list_events(active, _job_id(job_id), after, limit)

    def subscribe_events(
        self, job_id: int, after: int = 0, *, timeout: float | None = None,
        poll_interval: float = 0.2,
    ) -> Iterator[Event]:
        """Yield a job's events live, from after seq ``after``, until the job is
        terminal and every event is out (or ``timeout`` seconds pass).

        Reads by sequence number, so a reconnecting consumer that passes the last
        seq it saw loses and repeats nothing. Polls on a 10 ms → ``poll_interval``
        backoff; a result or event notification ends the wait at once (the
        events are then read). Raises :class:`ClientClosed` when another
        thread closes the client meanwhile.
        """
        job_id = _job_id(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.01
        with self._watching(job_id) as pause:
            while True:
                job = self.get_job(job_id)
                if job is None:
                    raise JobNotFound(job_id)
                fresh = self.events(job_id, after)
                yield from fresh
                if fresh:
                    after = fresh[-1].seq
                    interval = 0.01
                    continue
                if job.terminal:
                    return
                wait = _bounded(interval, deadline)
                if wait is None:
                    return
                pause(wait)
                interval = min(interval * 2, poll_interval)

    def workflow_status(self, workflow_id: str, *, conn: Conn | None = None) -> WorkflowStatus:
        names.check_text(workflow_id, "workflow_id", max_bytes=names.MAX_KEY_BYTES)
        with self.connection(conn) as active:
            return WorkflowStatus(workflow_id, store.workflow_jobs(active, workflow_id))

    def stats(self, *, cap: int | None = STATS_CAP,
              conn: Conn | None = None) -> dict[str, dict[str, int]]:
        """Job counts per queue, per state. Counting stops at ``cap``: a count
        above it reads as ``cap + 1`` ("10,000+"), so the read stays a few
        milliseconds at any table size; ``cap=None`` counts exactly (every
        index entry: seconds at 10M rows)."""
        _check_cap(cap)
        with self.connection(conn) as active:
            rows = store.queue_stats(active, cap, cap)
        out: dict[str, dict[str, int]] = {}
        for row in rows:
            out.setdefault(row["queue"], {})[row["state"]] = row["count"]
        return out

    def spend(self, by: str | Sequence[str] = "kind", *,
              since: datetime | timedelta | None = None, until: datetime | None = None,
              kind: str | None = None, queue: str | None = None,
              meta: Mapping[str, Any] | None = None, limit: int = SPEND_LIMIT,
              conn: Conn | None = None) -> SpendReport:
        """What the jobs enqueued in ``[since, until)`` spent (USD, tokens),
        grouped by one or two of ``kind``, ``queue``, ``day``, ``hour``,
        ``workflow``, ``parent``, ``tree`` and ``meta:<key>``.

        ``since`` is a moment or a span back from ``until`` (default: the last
        7 days); ``until`` defaults to now. ``kind``, ``queue`` and ``meta``
        (a dict the job's meta must contain) filter. Only jobs that spent
        something count; a job's spend is its own (charge-backs of shared
        child budgets are counted once, at the children). The largest
        ``limit`` groups come back, in time order for ``day``/``hour``; the
        report's ``total`` covers all of them."""
        query = SpendQuery.of(self.clock.now(), by, since=since, until=until, kind=kind,
                               queue=queue, meta=meta, limit=limit)
        # On belay's own connection, in a transaction of its own: without JIT.
        with self.transaction(conn) as active:
            return SpendReport.of(query, store.spend_by(active, query.params(),
                                                        jit_off=conn is None))

    def spend_tree(self, job_id: int, *, conn: Conn | None = None) -> SpendTree:
        """What job ``job_id`` and all its descendants (children, theirs, …)
        spent, in all and per kind, however long ago; JobNotFound if there is
        no such job."""
        job_id = _job_id(job_id)
        with self.connection(conn) as active:
            rows = store.spend_tree(active, job_id)
        if not rows:
            raise JobNotFound(job_id)
        return SpendTree.of(job_id, rows)

    # -- Signals and steering (§8.1) ------------------------------------------------

    def signal(
        self,
        scope: str,
        name: str,
        payload: Mapping[str, Any] | None = None,
        *,
        conn: Conn | None = None,
    ) -> list[int]:
        """Deliver a durable signal to a scope; returns the ids of the jobs it woke."""
        _check_signal_name(name)
        return self._deliver(scope, name, payload, conn)

    def signal_job(
        self,
        job_id: int,
        name: str,
        payload: Mapping[str, Any] | None = None,
        *,
        conn: Conn | None = None,
    ) -> list[int]:
        """Deliver a signal to one job (scope ``job:<id>``)."""
        _check_signal_name(name)
        return self._deliver(names.job_scope(_job_id(job_id)), name, payload, conn)

    def top_up(self, job_id: int, *, usd: float | None = None, tokens: int | None = None,
               idempotency_key: str | None = None, conn: Conn | None = None) -> Job:
        """Raise job ``job_id``'s budget caps by ``usd`` dollars and/or ``tokens``.

        A job paused over its budget (``budget={..., "on_exceed": "pause"}``)
        resumes from its journal once the caps cover its spend: the steps it
        paid for replay, nothing is paid twice. A top-up that leaves it over
        a cap keeps it paused. Any unfinished job can be topped up ahead of
        time. Refused (ValidationError) for a finished job — one failed by
        ``on_exceed="fail"`` included — and for a cap the job doesn't have.
        Returns the job as it now stands.

        ``idempotency_key`` (a string of 1 to 255 UTF-8 bytes, per job) makes
        a retry safe: the same key again changes nothing and returns the job
        as it stands with ``duplicate`` True; with other amounts it raises
        IdempotencyConflict (a ValidationError). The key is kept as long as
        signals are (the workers' ``signal_ttl``, 7 days by default)."""
        return self._top_up(job_id, usd, tokens, conn, idempotency_key)[0]

    def _top_up(self, job_id: int, usd: float | None, tokens: int | None,
                conn: Conn | None = None, idempotency_key: str | None = None
                ) -> tuple[Job, bool]:
        """:meth:`top_up`, and whether it resumed a paused job (for a duplicate,
        whether the first top-up with its key did)."""
        job_id = _job_id(job_id)
        usd_micros, more_tokens = check_top_up(usd, tokens)
        key = check_top_up_key(idempotency_key)
        with self.transaction(conn) as active:
            job, woken = store.top_up(active, job_id, usd_micros, more_tokens, self.clock.now(),
                                      key)
            if woken and not job.duplicate:
                self.poke(active, [job.queue])
        return job, woken

    def steer_job(
        self, job_id: int, payload: Mapping[str, Any], *, conn: Conn | None = None
    ) -> list[int]:
        """Leave steering guidance for a job; its next ``ctx.steering()`` reads it."""
        return self._deliver(names.job_scope(_job_id(job_id)), names.STEER, steering(payload),
                             conn)

    def clear_signal(self, scope: str, name: str, *, conn: Conn | None = None) -> bool:
        """Delete a delivered signal; True when there was one."""
        _check_scope(scope)
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a signal name is a non-empty string, got {name!r}")
        names.check_text(name, "a signal name", empty=True)
        with self.transaction(conn) as active:
            return store.clear_signal(active, scope, name)

    def _deliver(
        self, scope: str, name: str, payload: Mapping[str, Any] | None, conn: Conn | None
    ) -> list[int]:
        body = signal_body(scope, payload)
        with self.transaction(conn) as active:
            woken = store.deliver_signal(active, scope, name, body, self.clock.now())
            self.poke(active, {queue for _, queue in woken})
        return [job_id for job_id, _ in woken]

    # -- Cancel and retry (§8.6) -------------------------------------------------

    def cancel_job(self, job_id: int, *, conn: Conn | None = None) -> CancelStatus:
        """Cancel a job: ``"cancelled"`` at once when parked or held,
        ``"requested"`` when running (it stops at its next step boundary),
        ``"noop"`` when it had already finished."""
        with self.transaction(conn) as active:
            outcome = store.cancel_job(active, _job_id(job_id), self.clock.now())
            if outcome is None:
                raise JobNotFound(job_id)
            finished = [outcome.job.id] if outcome.status == "cancelled" else []
            self.poke(
                active,
                {queue for _, queue in outcome.settled.ready},
                finished + outcome.settled.cancelled,
            )
        return outcome.status  # type: ignore[return-value]

    def retry_job(self, job_id: int, *, conn: Conn | None = None) -> Job:
        """Run a failed or cancelled job again (one more attempt if it had used them all)."""
        with self.transaction(conn) as active:
            outcome = store.retry_job(active, _job_id(job_id), self.clock.now())
            if outcome is None:
                raise JobNotFound(job_id)
            if isinstance(outcome, str):
                raise NotRetryable(job_id, outcome)
            self.poke(
                active, {queue for _, queue in outcome.settled.ready}, outcome.settled.cancelled
            )
        return outcome.job

    # -- Cron (§8.5) ----------------------------------------------------------------

    def put_cron(
        self,
        name: str,
        expression: str,
        worker: Any,
        input: Mapping[str, Any] | None = None,
        *,
        conn: Conn | None = None,
        **options: Any,
    ) -> DynamicCron:
        """Create or replace the dynamic cron ``name``: a ``belay_crons`` row every
        node's scheduler fires (overriding a static cron of that name). Options:
        queue, priority, max_attempts, meta, partition_key; all checked before
        anything is written. A paused cron stays paused."""
        values = dynamic_values(name, expression, worker, input, options)
        with self.transaction(conn) as active:
            if store.schedule_cancelled(active, values["name"]) is not None:
                raise ValidationError(
                    f"{values['name']!r} is the name of a schedule; a name is a cron or a "
                    "schedule: pick another name")
            return DynamicCron.from_row(store.put_cron(active, values, self.clock.now()))

    def delete_cron(self, name: str, *, conn: Conn | None = None) -> bool:
        """Delete a dynamic cron; False when there was none. A static cron of that
        name fires again."""
        names.check_text(name, "a cron name")
        with self.transaction(conn) as active:
            return store.delete_cron(active, name)

    def pause_cron(self, name: str, *, conn: Conn | None = None) -> bool:
        """Stop a dynamic cron firing (a static cron of that name too); False when
        there is no such row."""
        names.check_text(name, "a cron name")
        with self.transaction(conn) as active:
            return store.set_cron_paused(active, name, True, self.clock.now())

    def resume_cron(self, name: str, *, conn: Conn | None = None) -> bool:
        """Let a paused dynamic cron fire again; False when there is no such row."""
        names.check_text(name, "a cron name")
        with self.transaction(conn) as active:
            return store.set_cron_paused(active, name, False, self.clock.now())

    def list_crons(self, *, conn: Conn | None = None) -> list[DynamicCron]:
        """Every dynamic cron (``belay_crons`` row), by name, as stored."""
        with self.connection(conn) as active:
            return [DynamicCron.from_row(row) for row in store.list_crons(active)]

    # -- Schedules (docs/cron.md) ----------------------------------------------------

    def schedule(
        self,
        name: str,
        expression: str,
        worker: Any,
        input: Mapping[str, Any] | None = None,
        *,
        overlap: str = "skip",
        catch_up: str = "latest",
        conn: Conn | None = None,
        **options: Any,
    ) -> Schedule:
        """Create or redeclare the schedule ``name``: a cron with an overlap
        policy (``skip``, ``queue`` or ``allow``) and a catch-up mode
        (``latest`` or ``all``), see :mod:`belay.schedules`. Redeclaring the
        same definition changes nothing; a different one bumps the revision
        and keeps the cursor; a cancelled schedule comes back. Options are
        enqueue options (queue, priority, max_attempts, meta, budget,
        partition_key, encrypt), checked before anything is written."""
        from belay.schedules import declare

        declaration = declare(name, expression, worker, input, overlap=overlap,
                              catch_up=catch_up, options=options)
        with self.transaction(conn) as active:
            if store.cron_named(active, declaration.name):
                raise ValidationError(
                    f"{declaration.name!r} is the name of a cron (a belay_crons row); a name "
                    "is a cron or a schedule: pick another name, or delete the cron first")
            store.declare_schedule(active, declaration.values(self.clock.now()))
            found = store.get_schedule(active, declaration.name)
        assert found is not None
        return Schedule.from_row(found)

    def cancel_schedule(self, name: str, *, conn: Conn | None = None) -> bool:
        """Stop a schedule firing (its status stays readable; declaring it again
        brings it back); False when there is no live schedule of that name. A
        job already fired runs on: cancel it with ``cancel_job``."""
        names.check_text(name, "a schedule name")
        with self.transaction(conn) as active:
            return store.cancel_schedule(active, name, self.clock.now())

    def schedule_status(self, name: str, *, conn: Conn | None = None) -> Schedule | None:
        """A schedule's definition and state (cursor, next occurrence, active
        job), or None when there is none."""
        names.check_text(name, "a schedule name")
        with self.connection(conn) as active:
            found = store.get_schedule(active, name)
        return None if found is None else Schedule.from_row(found)

    def schedule_page(self, limit: int | None = None, cursor: str | None = None, *,
                      conn: Conn | None = None) -> SchedulePage:
        """One page of schedules by name (``limit`` 1 to 100, default 50) after
        ``cursor`` (a name, exclusive); ``next_cursor`` is None on the last page."""
        from belay.schedules import page_limit

        size = page_limit(limit)
        if cursor is not None:
            names.check_text(cursor, "a schedule cursor")
        with self.connection(conn) as active:
            rows = store.schedule_page(active, cursor, size + 1)
        found = [Schedule.from_row(row) for row in rows[:size]]
        return SchedulePage(found, found[-1].name if len(rows) > size else None)

    def schedules(self, *, conn: Conn | None = None) -> list[Schedule]:
        """Every schedule by name, cancelled ones included (pages fetched in turn)."""
        found: list[Schedule] = []
        cursor: str | None = None
        while True:
            page = self.schedule_page(None, cursor, conn=conn)
            found += page.schedules
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor

    # -- Dynamic queues (§8.6) -------------------------------------------------------

    def put_queue(
        self, name: str, *, limit: int | Mapping[str, int] = 10,
        global_limit: int | None = None, rate: Mapping[str, Any] | None = None,
        partition: Mapping[str, str] | None = None, conn: Conn | None = None,
    ) -> QueueSpec:
        """Create or replace the ``belay_queues`` row of ``name``: every worker
        serves the queue with these options within its ``queue_sync_interval``,
        in place of a static queue's options of that name. The options are
        checked here, so a bad row never reaches a worker. A pause stays as it was."""
        names.check_text(name, "a queue name")
        opts: dict[str, Any] = {"limit": limit, "global_limit": global_limit, "rate": rate,
                                "partition": partition}
        spec = parse_queue_spec(name, {k: v for k, v in opts.items() if v is not None})
        stored = spec.to_opts()
        with self.transaction(conn) as active:
            if store.queue_paused(active, name):
                stored["paused"] = True
            store.put_queue(active, name, stored, self.clock.now())
        return spec

    def delete_queue(self, name: str, *, conn: Conn | None = None) -> bool:
        """Remove the row: workers stop serving a queue only the row defined (its
        running jobs finish) and go back to their static options for the rest."""
        names.check_text(name, "a queue name")
        with self.connection(conn) as active:
            return store.delete_queue(active, name)

    def pause_queue(self, name: str, *, conn: Conn | None = None) -> None:
        """Stop every worker claiming from ``name`` (running jobs finish); works for
        static queues too. ``Worker.pause_queue`` pauses one node only."""
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a queue name is a non-empty string, got {name!r}")
        names.check_text(name, "a queue name")
        with self.connection(conn) as active:
            store.pause_queue(active, name, self.clock.now())

    def resume_queue(self, name: str, *, conn: Conn | None = None) -> bool:
        """Undo :meth:`pause_queue`; False when the queue had no row."""
        names.check_text(name, "a queue name")
        with self.transaction(conn) as active:
            return store.resume_queue(active, name, self.clock.now())

    def list_queues(self, *, conn: Conn | None = None) -> dict[str, dict[str, Any]]:
        """The ``belay_queues`` rows: name → options (static queues are not listed)."""
        with self.connection(conn) as active:
            return store.list_queues(active)

    # -- Results -------------------------------------------------------------------

    def await_result(self, job_id: int, timeout: float | None = None) -> Any:
        """Wait for a job to finish and return its decoded result.

        Raises :class:`JobFailed` or :class:`JobCancelled` when it ends that
        way, :class:`TimeoutError` after ``timeout`` seconds (None: no limit),
        :class:`ClientClosed` when another thread closes the client meanwhile.
        Re-reads the job on a 5 ms → 50 ms backoff (x1.5 per look); a result
        notification (§9.2) cuts the wait short. The result is always the
        row's, never what a notification says.
        """
        job_id = _job_id(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.005
        with self._watching(job_id) as pause:
            while True:
                job = self.get_job(job_id)
                if job is None:
                    raise JobNotFound(job_id)
                if finished(job):
                    return job.result
                wait = _bounded(interval, deadline)
                if wait is None:
                    raise TimeoutError(f"job {job_id} is still {job.state} after {timeout} s")
                # A notification only cuts the pause short: the row, read
                # next, is the answer (anyone may send one, issue 38).
                pause(wait)
                # A short ceiling: without notifications (or when one is
                # missed) the result shows within 50 ms, at 20 reads/s at most.
                interval = min(interval * 1.5, 0.05)

    def _watching(self, job_id: int) -> AbstractContextManager[Pause]:
        """A ``pause(seconds)`` that a notification about ``job_id`` cuts
        short and :meth:`close` ends (with :class:`ClientClosed`). Entered
        before the caller's first read, so a notification that lands in
        between is not missed."""
        return self._waits.watching(job_id, self._result_listener())

    def _result_listener(self) -> ResultListener | None:
        listen = self.listen_conninfo
        if not self.notify or listen is None:
            return None
        pool = self._own_pool()  # also resets state after a fork
        with self._lock:
            if self._waits.closed:
                raise ClientClosed()
            if self._listener is None:
                with pool.connection() as conn:
                    channel = self.notify_channel(conn)
                self._listener = ResultListener(listen, channel)
                self._listener.start()
            return self._listener


def _bounded(interval: float, deadline: float | None) -> float | None:
    """How long to pause before the next look: ``interval``, cut to what is left
    before the monotonic ``deadline``; None once it has passed."""
    if deadline is None:
        return interval
    remaining = deadline - time.monotonic()
    return None if remaining <= 0 else min(interval, remaining)


def build(spec: JobSpec, now: datetime, registry: Registry, key: bytes | None) -> Row:
    """One request's row, as every client builds it: a kind named by string
    takes its registered worker's defaults, the enqueueing job's authority
    bounds it, and its input is sealed with ``key`` when it asks for encryption."""
    kind = spec.kind
    definition = registry.get(kind) if isinstance(kind, str) else None
    row = build_row(spec, now, definition, _parent_authority())
    encrypt = spec.encrypt
    if encrypt is None:
        worker = kind if definition is None else definition
        encrypt = bool(getattr(worker, "enqueue_defaults", {}).get("encrypt"))
    if encrypt:
        sealed = encrypt_input(spec.input or {}, key)
        row = row._replace(input=dumps_object(sealed, what="input").decode())
    return row


def sending(operation: str, rows: list[Row]) -> AbstractContextManager[list[Row]]:
    """The rows of an enqueue, inside its OpenTelemetry PRODUCER span when a
    tracer is configured, each then carrying the span's context in its meta
    (:mod:`belay.otel`); the rows as they are otherwise, at no cost."""
    if not otel.enabled():
        return nullcontext(rows)
    return _traced(operation, rows)


@contextmanager
def _traced(operation: str, rows: list[Row]) -> Iterator[list[Row]]:
    queues = {row.queue for row in rows}
    kinds = {row.kind for row in rows}
    with otel.producer(operation, len(rows), queue=queues.pop() if len(queues) == 1 else None,
                       kind=kinds.pop() if len(kinds) == 1 else None) as trace:
        yield rows if trace is None else [with_trace(row, trace) for row in rows]


def job_filter(queue: str | None, state: str | None, kind: Any, workflow_id: str | None,
               parent_id: int | None, before_id: int | None, limit: int) -> store.JobFilter:
    """The checked filter of a ``list_jobs`` call."""
    if state is not None and state not in STATES:
        raise ValidationError(f"unknown state {state!r}; states are {', '.join(STATES)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise ValidationError(f"limit must be an integer from 1 to 10000, got {limit!r}")
    if kind is not None and not isinstance(kind, str):
        kind = getattr(kind, "kind", kind)
    for value, what in ((queue, "queue"), (kind, "kind")):
        if value is not None:
            names.check_text(value, f"the {what} filter", empty=True)
    if workflow_id is not None:
        names.check_text(workflow_id, "the workflow_id filter", max_bytes=names.MAX_KEY_BYTES,
                         empty=True)
    parent_id = None if parent_id is None else _job_id(parent_id, what="parent_id")
    before_id = None if before_id is None else _job_id(before_id, what="before_id")
    return store.JobFilter(queue, state, kind, workflow_id, parent_id, before_id, limit)


def check_events_page(after: Any, limit: Any) -> None:
    """Refuse an ``events`` page that is not a sequence number and a size."""
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_ID
    ):
        raise ValidationError(f"limit must be an integer >= 1 or None, got {limit!r}")
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= _MAX_ID:
        raise ValidationError(f"after is a sequence number (an integer >= 0), got {after!r}")


def signal_body(scope: str, payload: Mapping[str, Any] | None) -> str:
    """A signal's scope checked and its payload encoded."""
    _check_scope(scope)
    return dumps_object(payload if payload is not None else {}, what="signal payload").decode()


def steering(payload: Any) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping):
        raise ValidationError(
            f"steering is a dict like {{'instruction': '…'}}, got {type(payload).__name__}"
        )
    return payload


def finished(job: Job) -> bool:
    """Whether ``await_result`` is done with ``job``: True when it succeeded;
    raises JobFailed or JobCancelled when it ended so; False while unfinished."""
    if job.state == "succeeded":
        return True
    if job.state == "failed":
        raise JobFailed(job)
    if job.state == "cancelled":
        raise JobCancelled(job)
    return False


def _parent_authority() -> tuple[Authority, str] | None:
    """The authority of the job whose code is enqueueing, if it has one: what
    it starts inherits it, narrowed at most (:mod:`belay.authority`)."""
    ctx = current_job()
    if ctx is None:
        refuse_contextless("an enqueue")
        return None
    granted = authority_of(ctx.meta)
    return None if granted is None else (granted, f"job {ctx.id}")


def _conn_or_session(conn: Any, session: Any) -> Any:
    """``session=`` names the caller's transaction as ``conn=`` does (a SQLAlchemy
    Session reads better that way); one of the two, not both."""
    if session is None:
        return conn
    if conn is not None:
        raise ValidationError(
            "pass conn= or session=, not both: they name the same thing, the "
            "transaction to join"
        )
    return session


_MAX_ID = 2**63 - 1


def _check_cap(cap: object) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                            or not 1 <= cap < _MAX_ID):
        raise ValidationError(f"cap is a whole number >= 1, or None to count exactly; "
                              f"got {cap!r}")


def _job_id(job_id: Any, *, what: str = "a job id") -> int:
    # Ids below 1 are never given, so they are simply not found; beyond bigint,
    # PostgreSQL would refuse the statement (after the caller's other SQL).
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not -_MAX_ID <= job_id <= _MAX_ID:
        raise ValidationError(f"{what} is an integer job id (1 to 2**63 - 1), got {job_id!r}")
    return job_id


def _check_scope(scope: Any) -> None:
    if not isinstance(scope, str) or not scope:
        raise ValidationError(f"a signal scope is a non-empty string like 'job:42', got {scope!r}")
    names.check_text(scope, "a signal scope", empty=True)


def _check_signal_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValidationError(f"a signal name is a non-empty string, got {name!r}")
    names.check_text(name, "a signal name", empty=True)
    if name.startswith(names.RESERVED_PREFIX):
        raise ValidationError(
            f"signal names starting with '$' are reserved for belay ({name!r}); "
            "use steer_job() for steering"
        )
