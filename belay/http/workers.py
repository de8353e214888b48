"""HTTP workers (issue 11): workers in any language claim and complete jobs over HTTP.

A worker registers (``POST /workers``) and gets an opaque token; it claims one
job at a time from its queue (``POST /queues/{queue}/claim``, long-polled), and
reports ``started`` and ``complete``. Underneath, each session is a belay node:
its claims are the Python worker's claims (:func:`belay.store.claim`, or
:func:`belay.store.claim_admitted` for a queue with a global limit, a rate or a
partition), leased to the session's node id; ``belay-http-heartbeat`` renews
the leases of live sessions, and a completion is the runner's fenced ack
(:func:`belay.store.ack` on the claimed attempt, the outcome decided by
:mod:`belay.outcome`). A session that stops claiming for ``session_ttl``
seconds is dropped: its leases are no longer renewed, lapse, and the reclaim
sweep retries or fails its jobs — the at-least-once path every node has.

Pure parts (request validation, error entries) are separate from the I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from belay import names, otel, store
from belay.client import Belay
from belay.crypto import decrypt_input, is_encrypted
from belay.errors import UNAVAILABLE, ConfigurationError, ValidationError, database_failure
from belay.http.app import read_body
from belay.http.errors import ApiError
from belay.http.options import (
    MAX_JSON_DEPTH,
    check_json,
    parse_json,
    path_text,
    text,
)
from belay.job import Job
from belay.origin import refusal
from belay.outcome import (
    RETURN_SNOOZE,
    Outcome,
    cancel_requested,
    retry_or_fail,
    safe_delay,
)
from belay.parts import remote
from belay.parts.completer import ack_on
from belay.parts.execution import ACKED, ENDINGS, Execution
from belay.parts.leases import Leases, timeout_outcome
from belay.parts.maintenance import RECLAIM_LIMIT, reclaim_expired
from belay.parts.producer import claim_jobs
from belay.parts.remote import ReportRefused, job_backoff, timeout_of
from belay.parts.service import Service
from belay.queues import QueueSpec
from belay.queues import merge as merge_queues

log = logging.getLogger("belay.http")


#: The longest session or lease TTL (seconds): a day.
MAX_TTL = 86_400.0


#: The longest a claim long-polls, in seconds (the seed's bound).
MAX_WAIT = 20.0
MAX_CAPACITY = 256
#: Seconds between polls of an idle queue while a claim waits: doubling up to the cap.
POLL_FIRST, POLL_CAP = 0.02, 0.5

_REGISTER_KEYS = {"runtime_id", "tasks", "capacity", "queue"}
_COMPLETE_KEYS = {"execution_id", "outcome", "result", "error", "reservation_id",
                  "traceparent", "tracestate"}


# -- Errors the routes map onto HTTP --------------------------------------------------


class WorkerError(Exception):
    """A request the protocol refuses: ``code`` and ``status`` are the HTTP answer."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(WorkerError):
    code, status = "invalid_request", 400


class Unauthorized(WorkerError):
    code, status = "unauthorized", 401


class StaleExecution(WorkerError):
    code, status = "stale_execution", 409


class Unavailable(WorkerError):
    code, status = "unavailable", 503


# -- Pure validation --------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    runtime_id: str
    tasks: frozenset[str]
    capacity: int
    queue: str


def _name(value: Any, label: str) -> str:
    """A name belay stores (a kind, a queue, a node's runtime id): names.check_text's
    rules, so a NUL or a lone surrogate is refused here, not by PostgreSQL later."""
    try:
        return text(label, value)
    except ApiError as exc:
        raise InvalidRequest(exc.message) from None


def parse_registration(body: Any) -> Registration:
    """``{"runtime_id", "tasks", "capacity"?, "queue"?}`` → a :class:`Registration`."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the body must be a JSON object with runtime_id and tasks")
    unknown = sorted(set(body) - _REGISTER_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown field(s) {', '.join(unknown)}; a registration takes "
                             f"{', '.join(sorted(_REGISTER_KEYS))}")
    runtime_id = _name(body.get("runtime_id"), "runtime_id")
    tasks = body.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise InvalidRequest("tasks must be a non-empty list of task names (job kinds), "
                             f"got {tasks!r}")
    kinds = frozenset(_name(t, f"tasks[{i}]") for i, t in enumerate(tasks))
    capacity = body.get("capacity", 1)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not (
            1 <= capacity <= MAX_CAPACITY):
        raise InvalidRequest(f"capacity must be an integer from 1 to {MAX_CAPACITY}, "
                             f"got {capacity!r}")
    queue = _name(body.get("queue", "default"), "queue")
    return Registration(runtime_id, kinds, capacity, queue)


def parse_wait(body: Any) -> float:
    """The claim's optional ``{"wait_ms": n}`` → seconds (default and cap 20 s)."""
    if body is None:
        return MAX_WAIT
    if not isinstance(body, Mapping):
        raise InvalidRequest("the claim body must be a JSON object like {\"wait_ms\": 5000}")
    unknown = sorted(set(body) - {"wait_ms"})
    if unknown:
        raise InvalidRequest(f"unknown field(s) {', '.join(unknown)}; a claim takes wait_ms")
    wait_ms = body.get("wait_ms", int(MAX_WAIT * 1000))
    if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or not (
            0 <= wait_ms <= MAX_WAIT * 1000):
        raise InvalidRequest(f"wait_ms must be an integer from 0 to {int(MAX_WAIT * 1000)}, "
                             f"got {wait_ms!r}")
    return wait_ms / 1000.0


def execution_id_of(body: Any) -> str:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the body must be a JSON object with execution_id")
    value = body.get("execution_id")
    if not isinstance(value, str) or not value:
        raise InvalidRequest("execution_id is required: repeat the one the execute event gave")
    return value


def error_entry(error: Any, attempt: int) -> dict[str, Any]:
    """A failure's ``error`` object → a belay ``errors`` entry
    (:func:`belay.parts.remote.error_entry`), refused with a 400."""
    try:
        return remote.error_entry(
            error, attempt, check_details=lambda details: _json_value(details, "error.details"))
    except ReportRefused as exc:
        raise InvalidRequest(str(exc)) from None


def reported(job: Job, outcome: str, result: Any, error: Any, now: datetime) -> Outcome:
    """What an HTTP worker's completion means for the job."""
    if outcome == "failure":
        return retry_or_fail(error_entry(error, job.attempt), job.attempt, job.max_attempts,
                             now, job_backoff(job))
    try:
        return remote.reported(job, outcome, result, error, now)
    except ReportRefused as exc:
        raise InvalidRequest(str(exc)) from None


def parse_completion(body: Any) -> tuple[str, str, Any, Any]:
    """``(execution_id, outcome, result, error)`` of a ``complete`` request."""
    execution_id = execution_id_of(body)
    unknown = sorted(set(body) - _COMPLETE_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown field(s) {', '.join(unknown)}; a completion takes "
                             f"{', '.join(sorted(_COMPLETE_KEYS))}")
    outcome = body.get("outcome")
    if outcome not in ("success", "failure"):
        raise InvalidRequest(f'outcome must be "success" or "failure", got {outcome!r}')
    if outcome == "success" and "error" in body:
        raise InvalidRequest("a success carries result, not error")
    if outcome == "failure" and "result" in body:
        raise InvalidRequest("a failure carries error, not result")
    # A result is stored as bytea JSON, which holds a NUL; error details go to jsonb.
    _json_value(body.get("result"), "result", nul=True)
    if outcome == "failure":
        error_entry(body.get("error"), 1)  # a 400 before the execution is looked up
    completion_trace(body)
    return execution_id, outcome, body.get("result"), body.get("error")


def completion_trace(body: Mapping[str, Any]) -> dict[str, str] | None:
    """The W3C trace context a completion carries back (``traceparent``,
    ``tracestate``: the worker's own span of the execution), or None."""
    try:
        return otel.returned_context(body.get("traceparent"), body.get("tracestate"))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _json_value(value: Any, what: str, *, nul: bool = False) -> None:
    try:
        check_json(value, what, nul=nul)
    except ApiError as exc:
        raise InvalidRequest(exc.message) from None


def token_key(token: str) -> str:
    """Sessions are kept under a hash of their token: the token itself is never stored."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def cancel_event(execution_id: str, job: Job, reason: str) -> dict[str, Any]:
    """The seed's ``cancel_execution`` event: stop running this execution (its
    attempt is already ended here; a report of it is stale)."""
    return {"type": "cancel_execution", "execution_id": execution_id, "job_id": job.id,
            "attempt": job.attempt, "reason": reason}


def execute_event(execution_id: str, job: Job, timeout_ms: int | None,
                  lease_ttl: float, span: Any = None) -> dict[str, Any]:
    """The seed's ``execute`` event for a claimed job; with the execution's
    ``span``, its W3C ``traceparent`` and ``tracestate`` (:mod:`belay.otel`)."""
    return {"type": "execute", "execution_id": execution_id, "job_id": job.id,
            "task": job.kind, "args": job.input, "attempt": job.attempt,
            "max_attempts": job.max_attempts, "timeout_ms": timeout_ms,
            "queue": job.queue, "lease_ttl_ms": int(lease_ttl * 1000), **otel.wire(span)}


# -- Sessions ---------------------------------------------------------------------------


def _check_ttls(*, reclaim_interval: float | None, **ttls: float) -> None:
    for label, value in ttls.items():
        # A day at most: an infinite or huge TTL can't become a lease_until.
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value <= MAX_TTL:
            raise ConfigurationError(
                f"{label} must be seconds > 0 and at most {MAX_TTL:g}, got {value!r}")
    if reclaim_interval is not None and not reclaim_interval > 0:
        raise ConfigurationError(
            f"reclaim_interval must be positive seconds or None, got {reclaim_interval!r}")


@dataclass
class _Session:
    key: str
    registration: Registration
    node_id: str
    last_seen: float
    #: Its claimed executions by execution id (an ended one until it is told so once).
    executions: dict[str, Execution] = field(default_factory=dict)
    #: Execution ids the worker reported ``started``.
    started: set[str] = field(default_factory=set)
    closed: bool = False
    #: Claims waiting now: a session in a long-poll is alive, however long it waits.
    claiming: int = 0
    #: ``cancel_execution`` events its next claims return, oldest first.
    cancels: list[dict[str, Any]] = field(default_factory=list)

    def live(self) -> list[Execution]:
        return [e for e in self.executions.values() if e.ended is None]


class _SessionTable:
    """The live sessions, by token hash, and their expiry (``lock`` is the
    sessions' lock, shared). ``release(session)`` lets go of a gone
    session's leases (called without the lock)."""

    def __init__(self, lock: threading.Lock, clock: Callable[[], float], session_ttl: float,
                 release: Callable[[_Session], None]) -> None:
        self._lock = lock
        self._clock = clock
        self.session_ttl = session_ttl
        self._release = release
        self.sessions: dict[str, _Session] = {}

    def add(self, session: _Session) -> None:
        with self._lock:
            self.sessions[session.key] = session

    def get(self, token: Any, *, touch: bool = False) -> _Session:
        """The live session of ``token``, else :class:`Unauthorized`."""
        if not isinstance(token, str) or not token:
            raise Unauthorized("a worker token is required: Authorization: Bearer <worker_token>"
                               " from POST /workers")
        key = token_key(token)  # a dict lookup by hash: no timing signal about the token
        with self._lock:
            session = self.sessions.get(key)
            expired = session is not None and self.expired(session)
            if session is not None and expired:
                self._drop(session, "expired")
            if touch and session is not None and not expired:
                session.last_seen = self._clock()
        if session is None or expired:
            if session is not None:
                self._release(session)
            raise Unauthorized("unknown or expired worker token; register again with "
                               "POST /workers")
        return session

    def pop(self, token: str) -> _Session:
        """End ``token``'s session (closed); else :class:`Unauthorized`."""
        with self._lock:
            session = self.sessions.pop(token_key(token), None)
            if session is None:
                raise Unauthorized("unknown or expired worker token; register again")
            session.closed = True
        self._release(session)
        return session

    def expired(self, session: _Session) -> bool:
        return (not session.claiming
                and self._clock() - session.last_seen > self.session_ttl)

    def expire(self) -> None:
        """Drop every session that sent no claim for ``session_ttl``."""
        with self._lock:
            gone = [s for s in self.sessions.values() if self.expired(s)]
            for session in gone:
                self._drop(session, f"sent no claim for {self.session_ttl:g}s and expired")
        for session in gone:
            self._release(session)

    def clear(self) -> None:
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            self._release(session)

    def __len__(self) -> int:
        with self._lock:
            return len(self.sessions)

    def _drop(self, session: _Session, why: str) -> None:
        """Forget a session (lock held): its leases are no longer renewed once released."""
        self.sessions.pop(session.key, None)
        session.closed = True
        log.warning("belay: HTTP worker %s %s; %d in-flight execution(s) left to lease expiry "
                    "and reclaim", session.node_id, why, len(session.live()))


class WorkerSessions:
    """HTTP worker sessions over one :class:`belay.Belay` (thread-safe).

    ``session_ttl``: seconds without a claim after which a session is dropped.
    ``lease_ttl``: the lease of each claimed job, renewed every third of it while
    its session lives. ``clock``: monotonic seconds, for session expiry and
    timeouts (database "now" is the client's clock). ``reclaim_interval``: when
    set, the heartbeat thread also runs the reclaim sweep (expired leases of any
    node → retry or fail) every so many seconds — for a server with no Python
    worker alongside it; None leaves reclaim to the workers' sweepers.

    The leases are the Python worker's part (:class:`belay.parts.leases.Leases`),
    each session a node of its own; acks are its fenced ack
    (:func:`belay.parts.completer.ack_on`) and reclaim its maintenance.
    """

    def __init__(
        self,
        client: Belay,
        *,
        session_ttl: float = 60.0,
        lease_ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        reclaim_interval: float | None = None,
    ) -> None:
        _check_ttls(session_ttl=session_ttl, lease_ttl=lease_ttl,
                    reclaim_interval=reclaim_interval)
        self.client = client
        self.session_ttl = float(session_ttl)
        self.lease_ttl = float(lease_ttl)
        self.reclaim_interval = reclaim_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._table = _SessionTable(self._lock, clock, self.session_ttl, self._release)
        self._stopped = threading.Event()
        self.leases = Leases("http", self.lease_ttl, self._db, client.clock.now,
                             on_timeout=self._timed_out, on_cancel=self._cancelled,
                             clock=clock)
        self._service: Service | None = None
        #: What killed the heartbeat, once it died: no more claims here.
        self.crashed: BaseException | None = None

    # -- Lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the ``belay-http-heartbeat`` service (register does it too); idempotent."""
        with self._lock:
            if self._service is not None or self._stopped.is_set():
                return
            self._service = Service("belay-http-heartbeat", self._heartbeat,
                                    on_crash=self._crashed)
            self.leases.service = self._service
            self._service.start()

    def stop(self) -> None:
        """Stop the heartbeat and forget every session (their leases lapse); idempotent."""
        self._stopped.set()
        with self._lock:
            service, self._service = self._service, None
        self._table.clear()
        if service is not None:
            service.stop()
            service.join()

    def _crashed(self, service: Service, exc: BaseException) -> None:
        """The heartbeat died: leases here are no longer renewed, so no more
        claims, and what runs now is lost (its outcome will be discarded)."""
        self.crashed = exc
        lost = self.leases.lose_all()
        log.critical("belay: the HTTP workers' heartbeat crashed; claims are refused from now "
                     "on and executions %s are lost; restart the server",
                     [e.job.id for e in lost])

    # -- Protocol ----------------------------------------------------------------------

    def register(self, runtime_id: Any, tasks: Any, capacity: Any = 1,
                 queue: Any = "default") -> str:
        """A new session; returns its token (a secret: never log it)."""
        reg = parse_registration({"runtime_id": runtime_id, "tasks": tasks,
                                  "capacity": capacity, "queue": queue})
        return self.register_parsed(reg)

    def register_parsed(self, reg: Registration) -> str:
        self._refuse_if_down()
        token = secrets.token_urlsafe(32)
        node_id = f"http:{reg.runtime_id[:64]}/{uuid.uuid4().hex[:12]}"
        session = _Session(token_key(token), reg, node_id, self._clock())
        self._table.add(session)
        self.start()
        log.info("belay: HTTP worker %s registered (runtime %r, queue %r, tasks %s, "
                 "capacity %d)", node_id, reg.runtime_id, reg.queue, sorted(reg.tasks),
                 reg.capacity)
        return token

    def _refuse_if_down(self) -> None:
        if self._stopped.is_set():
            raise Unavailable("the server is shutting down; register with another one")
        if self.crashed is not None:
            raise Unavailable("this server's lease heartbeat crashed and it takes no more "
                              "work; use another server (an operator must restart this one)")

    def authenticate(self, token: str) -> None:
        """Raise :class:`Unauthorized` unless ``token`` is a live session's (no I/O)."""
        self._table.get(token)

    def session_info(self, token: str) -> dict[str, Any]:
        session = self._table.get(token)
        return {"runtime_id": session.registration.runtime_id,
                "queue": session.registration.queue,
                "tasks": sorted(session.registration.tasks),
                "capacity": session.registration.capacity, "node_id": session.node_id}

    def claim(self, token: str, queue: str, wait: float = MAX_WAIT) -> dict[str, Any] | None:
        """One event for this session — a ``cancel_execution`` for one of its
        running executions first, else an ``execute`` — or None after ``wait``
        seconds without one."""
        session = self._table.get(token, touch=True)
        if queue != session.registration.queue:
            raise InvalidRequest(f"this worker registered for queue "
                                 f"{session.registration.queue!r}, not {queue!r}; claim "
                                 "from its own queue or register again")
        if not 0 <= wait <= MAX_WAIT:
            raise InvalidRequest(f"wait must be 0 to {MAX_WAIT:g} seconds, got {wait!r}")
        self._refuse_if_down()
        with self._lock:
            session.claiming += 1
        try:
            return self._wait_for_work(session, wait)
        finally:
            with self._lock:
                session.claiming -= 1
                session.last_seen = max(session.last_seen, self._clock())

    def _wait_for_work(self, session: _Session, wait: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + wait
        interval = POLL_FIRST
        while True:
            event = self._cancel_event(session) or self._claim_once(session)
            if event is not None:
                return event
            left = deadline - time.monotonic()
            if left <= 0 or session.closed or self._stopped.is_set():
                return None
            self._stopped.wait(min(interval, left))
            interval = min(interval * 2, POLL_CAP)

    def started(self, token: str, execution_id: str) -> None:
        session = self._table.get(token)
        with self._lock:
            self._execution(session, execution_id)
            session.started.add(execution_id)

    def complete(self, token: str, execution_id: str, outcome: str, result: Any = None,
                 error: Any = None, trace: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Record an execution's end through the fenced ack; returns ``{"state": ...}``.

        Raises :class:`StaleExecution` (nothing written) when the execution is not
        this session's, already completed, or its attempt is no longer the job's."""
        session = self._table.get(token)
        with self._lock:
            execution = self._execution(session, execution_id)
        job = execution.job
        decided = reported(job, outcome, result, error, self.client.clock.now())
        with self._lock:  # claim the right to ack: one completion per execution
            execution = self._execution(session, execution_id)
            if not execution.end(ACKED):
                raise self._stale(session, execution_id, execution)
        try:
            acked = self._ack(job, decided)
        except BaseException:
            execution.reopen(ACKED)  # nothing written: the worker may report it again
            raise
        otel.end(execution.take_span(), decided.kind if acked else "stale", decided.error,
                 returned=trace)
        with self._lock:
            session.executions.pop(execution_id, None)
            session.started.discard(execution_id)
        self.leases.release(execution)
        if acked is None:
            raise StaleExecution(f"execution {execution_id} is stale: job {job.id} attempt "
                                 f"{job.attempt} was reclaimed or finished meanwhile; its "
                                 "outcome was discarded")
        return {"job_id": job.id, "state": acked.job.state, "attempt": job.attempt}

    def close(self, token: str) -> None:
        """End a session; its in-flight jobs' leases lapse and reclaim retries them."""
        session = self._table.pop(token)
        log.info("belay: HTTP worker %s closed (%d execution(s) left to lease expiry)",
                 session.node_id, len(session.live()))

    def reclaim(self, limit: int = RECLAIM_LIMIT) -> int:
        """Retry or fail jobs whose leases expired (any node's), as a worker's sweeper
        does (the same code), with each job's backoff; returns how many."""
        with self._db() as conn:
            return reclaim_expired(
                conn, self.client.clock.now(),
                lambda job: safe_delay(job_backoff(job), job.attempt), self._poke, limit)

    def sessions(self) -> int:
        return len(self._table)

    # -- Internals ---------------------------------------------------------------------

    def _release(self, session: _Session) -> None:
        """Stop renewing a gone session's leases (lock not held)."""
        with self._lock:
            executions = list(session.executions.values())
        for execution in executions:
            self.leases.release(execution)

    def _execution(self, session: _Session, execution_id: str) -> Execution:
        """This session's live execution (lock held), else :class:`StaleExecution`."""
        execution = session.executions.get(execution_id)
        if execution is None:
            raise StaleExecution(f"execution {execution_id!r} is not in flight for this worker "
                                 "(already completed, never claimed by it, or reclaimed)")
        if execution.ended is not None:
            raise self._stale(session, execution_id, execution)
        return execution

    def _stale(self, session: _Session, execution_id: str, execution: Execution
               ) -> StaleExecution:
        """The error for an execution that ended here (lock held)."""
        if execution.ended == ACKED:
            return StaleExecution(f"execution {execution_id!r} is stale: another completion "
                                  "of it is being recorded")
        del session.executions[execution_id]  # told once; then it is simply unknown
        session.started.discard(execution_id)
        self.leases.release(execution)
        why = ENDINGS.get(execution.ended or "", execution.ended)
        return StaleExecution(f"execution {execution_id!r} is stale: it ended here "
                              f"({why}); its outcome is discarded")

    def _db(self) -> contextlib.AbstractContextManager[store.Conn]:
        return _guarded(self.client)

    def _claim_once(self, session: _Session) -> dict[str, Any] | None:
        reg = session.registration
        with self._lock:
            if session.closed or len(session.live()) >= reg.capacity:
                return None
        if self.crashed is not None:
            return None
        now = self.client.clock.now()
        with self._db() as conn:
            if not store.queues_with_work(conn, [reg.queue], now):
                return None
            spec = _spec(conn, reg.queue)
            if spec.paused:
                return None
            job = self._claim_one(conn, session, spec)
        if job is None:
            return None
        timeout_ms = timeout_of(job)
        execution = Execution(job, None, None if timeout_ms is None else timeout_ms / 1000,
                              node=session.node_id, clock=self._clock)
        execution_id = f"{job.id}.{job.attempt}.{secrets.token_urlsafe(9)}"
        execution.owner = (session, execution_id)
        span = execution.span = otel.begin(execution)
        with self._lock:
            closed = session.closed
            if not closed:
                session.executions[execution_id] = execution
        if closed:  # dropped while claiming: the lease lapses, reclaim applies
            otel.end(execution.take_span(), "lost")
            return None
        self.leases.hold(execution)
        return execute_event(execution_id, job, timeout_ms, self.lease_ttl, span)

    def _claim_one(self, conn: store.Conn, session: _Session, spec: QueueSpec) -> Job | None:
        """Claim one job of this session's kinds with the Python worker's claim
        (admission included), or None; an input it can't decrypt goes back."""
        with conn.transaction():
            jobs = claim_jobs(conn, spec, 1, session.node_id, self.client.clock.now,
                              self.lease_ttl, kinds=sorted(session.registration.tasks))
            if not jobs:
                return None
            (job,) = jobs
            if job.cancel_requested:  # §8.6: never another attempt once a cancel was asked
                acked = store.ack(conn, job, "cancelled", self.client.clock.now(),
                                  error=cancel_requested(job.attempt).error)
                if acked is not None:
                    self._poke(conn, acked)
                return None
            if is_encrypted(job.input):
                try:
                    return job.replace(input=decrypt_input(job.input, self.client.encryption_key))
                except Exception as exc:
                    log.error("belay: job %d: %s; it goes back to the queue for %.0fs",
                              job.id, exc, RETURN_SNOOZE)
                    now = self.client.clock.now()
                    store.ack(conn, job, "snooze", now, at=now + timedelta(seconds=RETURN_SNOOZE))
                    return None
        return job

    def _ack(self, job: Job, outcome: Outcome) -> store.Acked | None:
        with self._db() as conn:
            return ack_on(conn, job, outcome, self.client.clock.now(), self._poke)

    def _poke(self, conn: store.Conn, acked: store.Acked) -> None:
        results = [acked.job.id] if acked.job.terminal else []
        self.client.poke(conn, {q for _, q in acked.settled.ready},
                          results + acked.settled.cancelled)

    def _timed_out(self, execution: Execution) -> None:
        job = execution.job
        self._ack(job, timeout_outcome(execution, self.client.clock.now(), job_backoff(job)))
        self._tell_cancel(execution, "timeout")

    def _cancelled(self, execution: Execution) -> None:
        """A renewal saw the job's cancel request: it ends cancelled now (a
        remote worker can't be relied on to stop), and the worker's next claim
        returns ``cancel_execution``."""
        with self._lock:
            if not execution.end(ACKED):
                return
        job = execution.job
        self._ack(job, Outcome("cancelled", error={"reason": "cancel_requested",
                                                   "attempt": job.attempt}))
        self._tell_cancel(execution, "cancel_requested")

    def _tell_cancel(self, execution: Execution, reason: str) -> None:
        otel.end(execution.take_span(), "timeout" if reason == "timeout" else "cancelled")
        if execution.owner is None:
            return
        session, execution_id = execution.owner
        with self._lock:
            if not session.closed:
                session.cancels.append(cancel_event(execution_id, execution.job, reason))

    def _cancel_event(self, session: _Session) -> dict[str, Any] | None:
        with self._lock:
            return session.cancels.pop(0) if session.cancels else None

    # -- The heartbeat service -----------------------------------------------------------

    def _heartbeat(self, service: Service) -> None:
        next_reclaim = time.monotonic() + (self.reclaim_interval or 0.0)
        wait = 0.0
        while not service.wait(wait):
            wait = min(self.leases.period, 0.5, self.session_ttl / 4)
            try:
                self._table.expire()
                wait = min(wait, self.leases.beat())
                if self.reclaim_interval is not None and time.monotonic() >= next_reclaim:
                    self.reclaim()
                    next_reclaim = time.monotonic() + self.reclaim_interval
            except Exception:
                log.exception("belay: HTTP worker heartbeat failed; retrying")

    def tick(self) -> None:
        """One heartbeat pass now (expiry, timeouts, renewal): for tests and shutdown."""
        self._table.expire()
        self.leases.enforce_timeouts()
        self.leases.renew()

def _spec(conn: store.Conn, queue: str) -> QueueSpec:
    """The queue's effective options: its ``belay_queues`` row, else the defaults."""
    specs, _invalid = merge_queues({queue: QueueSpec(queue)}, store.list_queues(conn))
    return specs[queue]


@contextlib.contextmanager
def _guarded(client: Belay) -> Iterator[store.Conn]:
    """A connection from the client's pool; a database failure becomes :class:`Unavailable`
    (never an invented success)."""
    try:
        with client.connection() as conn:
            yield conn
    except psycopg.Error as exc:
        if database_failure(exc) != UNAVAILABLE:
            raise
        raise Unavailable(f"the database is unavailable ({type(exc).__name__}); retry "
                          "later") from exc


# -- Starlette routes -------------------------------------------------------------------

#: The largest worker request body read, in bytes (checked before parsing).
MAX_BODY = 1_048_576


def _error(code: str, message: str, status: int,
           headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status,
                        headers=headers)


def _bearer(request: Request, sessions: WorkerSessions) -> str:
    """The request's worker token, checked before anything else is read."""
    token = _token(request)
    sessions.authenticate(token)
    return token


def _path_name(request: Request, key: str) -> str:
    try:
        return path_text(request.scope.get("raw_path"), request.path_params[key], key)
    except ApiError as exc:
        raise InvalidRequest(exc.message) from None


def _token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("a worker token is required: Authorization: Bearer <worker_token> "
                           "from POST /workers")
    return token.strip()


async def _body(request: Request, *, required: bool) -> Any:
    """The body as strict JSON (no NaN, no number beyond a double); read only
    after the route checked the token."""
    raw = await read_body(request, MAX_BODY)
    if not raw.strip():
        if required:
            raise InvalidRequest("the body must be a JSON object")
        return None
    return parse_json(raw)


Handler = Callable[[Request], Awaitable[Response]]


def _handled(handler: Handler) -> Handler:
    async def run(request: Request) -> Response:
        # belay.origin's rule, here too: these routes may be mounted without
        # build_app, whose BrowserGuard otherwise answers before they run.
        refused = refusal(request.method, request.headers)
        if refused is not None:
            return _error(refused.code, refused.message, refused.status, {"Connection": "close"})
        try:
            return await handler(request)
        except WorkerError as exc:
            # A 401's body is never read: the connection can't carry another request.
            return _error(exc.code, exc.message, exc.status,
                          {"Connection": "close"} if exc.status == 401 else None)
        except ApiError as exc:  # the shared body checks: strict JSON, the size limit
            return _error(exc.code, exc.message, exc.status, exc.headers)
        except ValidationError as exc:  # belay's own checks, before anything is written
            return _error("invalid_request", str(exc), 400)
    return run


def worker_routes(sessions: WorkerSessions, *, token: str | None = None) -> list[BaseRoute]:
    """The worker protocol's routes over ``sessions``. With ``token`` (the
    server's producer token), registering needs it too: otherwise anyone who
    reaches the port could register a worker and take jobs."""
    server_token = None if token is None else token.encode()

    async def register(request: Request) -> Response:
        if server_token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode("utf-8", "surrogateescape"), server_token):
                raise Unauthorized("registering a worker needs 'Authorization: Bearer <token>' "
                                   "with the token the server was started with")
        reg = parse_registration(await _body(request, required=True))
        token = await run_in_threadpool(sessions.register_parsed, reg)
        return JSONResponse({
            "worker_token": token, "session_ttl_s": sessions.session_ttl,
            "lease_ttl_s": sessions.lease_ttl, "queue": reg.queue,
            "tasks": sorted(reg.tasks), "capacity": reg.capacity,
            "max_wait_ms": int(MAX_WAIT * 1000),
        }, status_code=201)

    async def claim(request: Request) -> Response:
        token = _bearer(request, sessions)
        queue = _path_name(request, "queue")
        wait = parse_wait(await _body(request, required=False))
        event = await run_in_threadpool(sessions.claim, token, queue, wait)
        return Response(status_code=204) if event is None else JSONResponse(event)

    async def started(request: Request) -> Response:
        token = _bearer(request, sessions)
        execution_id = execution_id_of(await _body(request, required=True))
        await run_in_threadpool(sessions.started, token, execution_id)
        return JSONResponse({"execution_id": execution_id, "started": True})

    async def complete(request: Request) -> Response:
        token = _bearer(request, sessions)
        body = await _body(request, required=True)
        execution_id, outcome, result, error = parse_completion(body)
        done = await run_in_threadpool(sessions.complete, token, execution_id, outcome,
                                       result, error, completion_trace(body))
        return JSONResponse({"execution_id": execution_id, **done})

    async def close(request: Request) -> Response:
        token = _bearer(request, sessions)
        await run_in_threadpool(sessions.close, token)
        return Response(status_code=204)

    return [
        Route("/workers", _handled(register), methods=["POST"]),
        Route("/workers", _handled(close), methods=["DELETE"]),
        Route("/queues/{queue}/claim", _handled(claim), methods=["POST"]),
        Route("/workers/started", _handled(started), methods=["POST"]),
        Route("/workers/complete", _handled(complete), methods=["POST"]),
    ]


# -- OpenAPI ------------------------------------------------------------------------------

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
        "code": {"type": "string"}, "message": {"type": "string"}}}},
}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "invalid_request", 401: "unauthorized: unknown or expired worker token",
            409: "stale_execution", 413: "payload_too_large",
            503: "unavailable: the database failed"}
    return {str(c): {"description": what[c], "content": {
        "application/json": {"schema": _ERROR_SCHEMA}}} for c in codes}


def _json_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


_BEARER: list[dict[str, list[str]]] = [{"workerToken": []}]
_EXECUTION_ID = {"type": "string", "minLength": 1}
#: A name belay stores: at most 255 bytes of UTF-8 (so at most 255 characters),
#: not blank, no NUL or lone surrogate (belay.names.check_text).
_NAME = {"type": "string", "minLength": 1, "maxLength": names.MAX_NAME_BYTES,
         "pattern": "\\S",
         "description": f"at most {names.MAX_NAME_BYTES} bytes of UTF-8, not blank, no NUL"}
_OK = {"type": "object"}
#: W3C trace context fields (docs/observability.md): the execute event's are its
#: execution's span, a completion's the worker's own span of it (linked).
_TRACEPARENT = {"type": "string", "pattern": f"^{otel.TRACEPARENT.pattern}$",
                "description": "W3C traceparent (docs/observability.md)"}
_TRACESTATE = {"type": "string", "description": "W3C tracestate"}

#: OpenAPI 3.1 path items of the worker protocol (security scheme ``workerToken``:
#: ``{"type": "http", "scheme": "bearer"}``), for the server's ``/openapi.json``.
WORKER_OPENAPI_PATHS: dict[str, Any] = {
    "/workers": {
        "post": {
            "summary": "Register an HTTP worker session",
            "operationId": "registerWorker",
            "requestBody": _json_body({
                "type": "object", "required": ["runtime_id", "tasks"],
                "additionalProperties": False,
                "properties": {
                    "runtime_id": _NAME,
                    "tasks": {"type": "array", "minItems": 1, "items": _NAME},
                    "capacity": {"type": "integer", "minimum": 1, "maximum": MAX_CAPACITY},
                    "queue": _NAME,
                },
            }),
            "responses": {"201": {"description": "the session", "content": {
                "application/json": {"schema": {
                    "type": "object", "required": ["worker_token", "session_ttl_s"],
                    "properties": {"worker_token": {"type": "string"},
                                   "session_ttl_s": {"type": "number"},
                                   "lease_ttl_s": {"type": "number"}}}}}},
                          **_errors(400, 413, 503)},
        },
        "delete": {
            "summary": "Close the worker session",
            "operationId": "closeWorker",
            "security": _BEARER,
            "responses": {"204": {"description": "closed"}, **_errors(401)},
        },
    },
    "/queues/{queue}/claim": {
        "post": {
            "summary": "Long-poll for one execute or cancel_execution event",
            "operationId": "claimJob",
            "security": _BEARER,
            "parameters": [{"name": "queue", "in": "path", "required": True,
                            "schema": _NAME}],
            "requestBody": _json_body({
                "type": "object", "additionalProperties": False,
                "properties": {"wait_ms": {"type": "integer", "minimum": 0,
                                           "maximum": int(MAX_WAIT * 1000)}}}, required=False),
            "responses": {
                "200": {"description": "an execute event, or a cancel_execution event for "
                                       "a running execution (its attempt already ended: "
                                       "stop it; a report of it is stale)",
                        "content": {"application/json": {"schema": {"oneOf": [
                            {"type": "object", "required": [
                                "type", "execution_id", "job_id", "task", "args", "attempt"],
                             "properties": {
                                "type": {"const": "execute"}, "execution_id": _EXECUTION_ID,
                                "job_id": {"type": "integer"}, "task": {"type": "string"},
                                "args": {}, "attempt": {"type": "integer"},
                                "max_attempts": {"type": "integer"},
                                "timeout_ms": {"type": ["integer", "null"]},
                                "queue": {"type": "string"},
                                "lease_ttl_ms": {"type": "integer"},
                                "traceparent": _TRACEPARENT, "tracestate": _TRACESTATE}},
                            {"type": "object", "required": [
                                "type", "execution_id", "job_id", "attempt", "reason"],
                             "properties": {
                                "type": {"const": "cancel_execution"},
                                "execution_id": _EXECUTION_ID,
                                "job_id": {"type": "integer"}, "attempt": {"type": "integer"},
                                "reason": {"enum": ["timeout", "cancel_requested"]}}},
                        ]}}}},
                "204": {"description": "nothing to run within wait_ms"},
                **_errors(400, 401, 413, 503)},
        },
    },
    "/workers/started": {
        "post": {
            "summary": "Acknowledge that an execution started",
            "operationId": "workerStarted",
            "security": _BEARER,
            "requestBody": _json_body({
                "type": "object", "required": ["execution_id"],
                "properties": {"execution_id": _EXECUTION_ID,
                               "reservation_id": {"type": "string"}}}),
            "responses": {"200": {"description": "noted", "content": {
                "application/json": {"schema": _OK}}}, **_errors(400, 401, 409, 413)},
        },
    },
    "/workers/complete": {
        "post": {
            "summary": "Report an execution's outcome (fenced on its attempt)",
            "operationId": "workerComplete",
            "security": _BEARER,
            "requestBody": _json_body({
                "type": "object", "required": ["execution_id", "outcome"],
                "additionalProperties": False,
                "properties": {
                    "execution_id": _EXECUTION_ID,
                    "reservation_id": {"type": "string"},
                    "outcome": {"enum": ["success", "failure"]},
                    "traceparent": _TRACEPARENT, "tracestate": _TRACESTATE,
                    "result": {"description": f"any JSON nested at most {MAX_JSON_DEPTH} "
                                              "levels; no lone surrogate"},
                    "error": {"type": "object", "required": ["message"],
                              "additionalProperties": False, "properties": {
                                  "message": {"type": "string"}, "type": {"type": "string"},
                                  "traceback": {"type": "string"},
                                  "details": {"description": f"any JSON nested at most "
                                                             f"{MAX_JSON_DEPTH} levels; no "
                                                             "NUL or lone surrogate"}}},
                }}),
            "responses": {"200": {"description": "recorded: the job's new state", "content": {
                "application/json": {"schema": {"type": "object", "properties": {
                    "job_id": {"type": "integer"}, "state": {"type": "string"},
                    "attempt": {"type": "integer"}}}}}},
                          **_errors(400, 401, 409, 413, 503)},
        },
    },
}
