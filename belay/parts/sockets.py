"""Executors on a Unix-domain socket (Executor Protocol v1, :mod:`belay.protocol`).

The server claims, leases, renews and acks as the Python worker does — the
same :func:`~belay.parts.producer.claim_jobs`, :class:`~belay.parts.leases.Leases`
and :func:`~belay.parts.completer.ack_on` — and hands each claimed job to an
executor connected on the socket that registered its task:

1. an executor connects and sends ``hello`` (``mode: "worker"``, its
   ``runtime_id``, ``max_concurrency``) → ``hello_ok``; then
   ``register_tasks`` (and ``unregister_tasks``) → ``ok``;
2. ``belay-executor-dispatch`` claims jobs of those tasks up to the free
   capacity of each connection (each connection is a node of its own,
   ``socket:<runtime>/<id>``) and sends ``execute`` with the job id, task,
   args, attempt, ``timeout_ms``, and a reservation and an execution id;
3. the executor answers ``started``, then ``succeeded`` with a JSON
   ``result`` or ``failed`` with an ``error`` object, repeating both ids →
   ``ok`` with the job's state, or an ``error`` (``stale_execution``,
   ``invalid_request``, ``unavailable``);
4. past its timeout, the attempt is failed and the executor is sent
   ``cancel_execution`` (best effort); so is it once a lease renewal sees an
   operator's cancel request — the job is then cancelled here at once, and a
   later report of that execution is stale.

A connection that closes (or sends a broken frame, stops reading…) hands its
in-flight jobs back at once, counted (:mod:`~belay.parts.handbacks`): a snooze
until an attempt's third loss, which fails the attempt. Other connections are
untouched. Producer requests (``enqueue``, ``status``…) are not served on the
socket: use the client or the HTTP API.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from belay import names, protocol, socketpath, store
from belay.client import Belay
from belay.errors import BelayError, ValidationError
from belay.job import Job
from belay.outcome import Outcome, cancel_requested
from belay.parts.completer import written
from belay.parts.execution import ACKED, LOST, Execution
from belay.parts.leases import Leases, timeout_outcome
from belay.parts.producer import claim_jobs
from belay.parts.records import Records
from belay.parts.remote import (
    Parked,
    ReportRefused,
    concluded,
    reported,
)
from belay.parts.service import Service
from belay.queues import QueueSpec
from belay.queues import merge as merge_queues
from belay.registry import Registry

log = logging.getLogger("belay.executors")

#: How long the dispatcher sleeps when no queue had work (a completion or a
#: registration wakes it sooner).
IDLE_WAIT = 0.5
#: After a round that found work, the dispatcher skips the "is there work"
#: read and keeps looking every BUSY_WAIT for this long (jobs that arrive
#: soon after others are picked up at once), as the thread producers do.
HOT_WINDOW = 0.25
#: Connections that have not said hello yet, at most: each holds a thread
#: until its hello or ``hello_timeout``; more are closed as they come.
MAX_WAITING = 64
#: Tasks one connection may register (the ``ok`` reply lists them all, and
#: must fit in a frame: 1024 names of 255 bytes do).
MAX_TASKS = 1024
#: How long the ``belay_queues`` rows read by a round are reused.
SPECS_TTL = 1.0
#: How long it sleeps between rounds that found work.
BUSY_WAIT = 0.005
#: Seconds a new connection has to send its hello.
HELLO_TIMEOUT = 10.0
#: Seconds a frame may wait for an executor that stopped reading before its
#: connection is closed (so one stuck executor never stalls the others).
SEND_TIMEOUT = 5.0


@dataclass
class Callbacks:
    """What an :class:`ExecutorServer` tells its owner; each optional."""

    #: ``on_cancel(runtime_id, job_id, reason)``: after ``cancel_execution``
    #: went to an executor (the process pool kills that child).
    on_cancel: Callable[[str, int, str], None] | None = None
    #: ``on_disconnect(runtime_id, executions)`` → the ones still to hand back,
    #: counted (the process pool fails the attempt of a child that died instead).
    on_disconnect: Callable[[str, list[Execution]], list[Execution]] | None = None
    #: ``on_connect(runtime_id)``: after an executor's hello was accepted.
    on_connect: Callable[[str], None] | None = None
    #: ``on_crash(service, exc)``: one of the server's services died (the
    #: worker's crash policy).
    on_crash: Callable[[Service, BaseException], None] | None = None


class _QueueSpecs:
    """The served queues' options (their ``belay_queues`` rows over the
    defaults), read again at most every :data:`SPECS_TTL`."""

    def __init__(self, queues: Sequence[str]) -> None:
        self.queues = list(queues)
        self._at = -SPECS_TTL
        self._specs: dict[str, QueueSpec] = {}

    def get(self, conn: store.Conn) -> dict[str, QueueSpec]:
        if time.monotonic() - self._at >= SPECS_TTL:
            self._specs, _invalid = merge_queues({q: QueueSpec(q) for q in self.queues},
                                                 store.list_queues(conn))
            self._at = time.monotonic()
        return self._specs


@dataclass
class _Running:
    execution: Execution
    reservation_id: str
    started: bool = False


@dataclass
class _Connection:
    sock: socket.socket
    number: int
    runtime_id: str = ""
    node_id: str = ""
    capacity: int = 0
    tasks: set[str] = field(default_factory=set)
    running: dict[str, _Running] = field(default_factory=dict)
    closed: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ready(self) -> bool:
        return not self.closed and self.capacity > 0 and bool(self.tasks)

    def free(self) -> int:
        """Slots for new executions: one that ended here (timed out, cancelled)
        frees its slot at once — its executor was told to stop, and a report
        of it later is only answered stale."""
        return self.capacity - sum(1 for r in self.running.values() if r.execution.ended is None)


class ExecutorServer:
    """Serves executors on ``path`` for the jobs of ``queues``."""

    def __init__(
        self,
        client: Belay,
        queues: Sequence[str],
        *,
        path: str | os.PathLike[str] | None = None,
        mode: int = 0o600,
        lease_ttl: float = 30.0,
        max_frame_bytes: int = protocol.MAX_FRAME_BYTES,
        clock: Callable[[], float] = time.monotonic,
        hello_timeout: float = HELLO_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
        registry: Registry | None = None,
    ) -> None:
        if mode not in socketpath.MODES:
            raise socketpath.SocketPathError(
                f"the socket's mode is 0600 or 0660, got {mode:04o}")
        self.client = client
        self.queues = list(queues)
        self.resolved = socketpath.resolve(path)
        self.mode = mode
        self.max_frame_bytes = max_frame_bytes
        self.hello_timeout = hello_timeout
        self.send_timeout = send_timeout
        self._clock = clock
        #: What the server tells its owner (the worker, the process pool).
        self.callbacks = Callbacks()
        #: The acks, parks and job hooks of what executors report.
        self.records = Records(client, registry)
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        self._numbers = itertools.count(1)
        self.leases = Leases("socket", lease_ttl, client.connection, client.clock.now,
                             on_timeout=self._timed_out, on_cancel=self._cancelled,
                             clock=clock)
        self._listener: socket.socket | None = None
        self._services: list[Service] = []
        self._dispatch: Service | None = None
        self._requests = _Requests(self)
        #: What killed a service of the server, once one died: no more dispatch.
        self.crashed: BaseException | None = None
        self._hot_until = 0.0
        self._specs = _QueueSpecs(self.queues)

    @property
    def path(self) -> Path:
        return self.resolved.path

    # -- Lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Listen on the socket and start serving; raises SocketPathError when the
        path can't be used (the message names it and the fix)."""
        socketpath.prepare(self.resolved)
        self._listener = socketpath.listen(self.path, self.mode)
        self._dispatch = self._service("belay-executor-dispatch", self._dispatch_loop)
        self.leases.service = self._service("belay-executor-heartbeat", self.leases.heartbeat)
        self._service("belay-executor-accept", self._accept_loop)
        log.info("belay: executors served on %s (mode %04o)", self.path, self.mode)

    def stop(self) -> None:
        """Stop serving: every connection closes (its jobs go back to their
        queues), then the socket file is removed."""
        services, self._services = self._services, []
        for service in services:
            service.stop()
        for service in services:  # no connection is accepted, nothing dispatched, after
            service.join(5.0)
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            self._close(connection, "the worker is stopping", lost=False)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _service(self, name: str, body: Callable[[Service], None]) -> Service:
        service = Service(name, body, on_crash=self._service_crashed).start()
        self._services.append(service)
        return service

    def _service_crashed(self, service: Service, exc: BaseException) -> None:
        self.crashed = exc
        lost = self.leases.lose_all()
        log.critical("belay: the executor server's %s crashed; it dispatches no more and "
                     "executions %s are lost", service.name, [e.job.id for e in lost])
        if self.callbacks.on_crash is not None:
            self.callbacks.on_crash(service, exc)

    def in_flight(self) -> list[int]:
        """The ids of the jobs executors are running now (not ended here)."""
        with self._lock:
            return [r.execution.job.id for c in self._connections.values()
                    for r in c.running.values() if r.execution.ended is None]

    def stop_dispatching(self) -> None:
        if self._dispatch is not None:
            self._dispatch.stop()
            self._dispatch.join(5.0)

    def __enter__(self) -> ExecutorServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    # -- Connections ---------------------------------------------------------------------

    def _accept_loop(self, service: Service) -> None:
        listener = self._listener
        assert listener is not None
        while not service.stopping:
            readable, _, _ = select.select([listener], [], [], 0.2)
            if not readable:
                continue
            try:
                sock, _ = listener.accept()
            except OSError:
                if service.stopping:
                    return
                raise
            with self._lock:
                waiting = sum(1 for c in self._connections.values() if not c.runtime_id)
            if _shed(sock, waiting):
                continue
            sock.settimeout(self.hello_timeout)
            connection = _Connection(sock, next(self._numbers))
            with self._lock:
                self._connections[connection.number] = connection
            threading.Thread(target=self._serve, args=(connection,), daemon=True,
                             name=f"belay-executor-conn-{connection.number}").start()

    def _serve(self, connection: _Connection) -> None:
        reader = protocol.FrameReader(self.max_frame_bytes)
        why = "it closed"
        hello_by = time.monotonic() + self.hello_timeout
        try:
            while not connection.closed:
                if not connection.runtime_id:
                    # hello_timeout bounds the whole hello, not each read: a peer
                    # trickling a byte at a time (each within the timeout) would
                    # otherwise hold its connection and thread without a hello.
                    left = hello_by - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    connection.sock.settimeout(left)
                data = connection.sock.recv(65536)
                if not data:
                    break
                for message in reader.feed(data):
                    self._requests.handle(connection, message)
        except protocol.ProtocolError as exc:
            why = f"it sent a broken frame ({exc})"
        except TimeoutError:
            why = f"it sent no hello within {self.hello_timeout:g}s"
        except OSError as exc:
            why = f"its socket failed ({exc.strerror or exc})"
        except _Refused as exc:
            why = str(exc)
        except Exception as exc:  # a bug, or the database refusing: this connection only
            log.exception("belay: serving executor %s failed", connection.node_id or "?")
            why = f"serving it failed ({type(exc).__name__})"
        finally:
            self._close(connection, why)

    def _close(self, connection: _Connection, why: str, *, lost: bool = True) -> None:
        """Close once; hand its in-flight jobs back, counted unless not ``lost``."""
        with self._lock:
            if connection.closed:
                return
            connection.closed = True
            self._connections.pop(connection.number, None)
            running = list(connection.running.values())
            connection.running.clear()
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)
        connection.sock.close()
        ours = []
        for item in running:
            execution = item.execution
            self.leases.release(execution)
            if execution.end(LOST):
                ours.append(execution)
        if ours and self.callbacks.on_disconnect is not None:
            ours = self.callbacks.on_disconnect(connection.runtime_id, ours)
        back = 0
        for execution in ours:
            back += self.records.hand_back(execution, connection.node_id if lost else None, why)
        if connection.runtime_id:
            log.info("belay: executor %s disconnected (%s); %d job(s) back to their queues",
                     connection.node_id, why, back)

    def _send(self, connection: _Connection, message: dict[str, Any]) -> bool:
        frame = protocol.encode(message, self.max_frame_bytes)
        try:
            with connection.send_lock:
                connection.sock.sendall(frame)
        except OSError:
            # Whoever sends (a reply, an execute, a cancel): a send that failed
            # or timed out may have written part of the frame, so nothing more
            # can go on this stream. The connection closes and its jobs go back
            # (a reply that timed out used to leave it open, misframed, its
            # jobs held).
            self._close(connection, "a send to it timed out or failed (it stopped reading)")
            return False
        return True

    # -- Requests --------------------------------------------------------------------------

    def _forget(self, connection: _Connection, execution_id: str) -> None:
        with self._lock:
            item = connection.running.pop(execution_id, None)
        if item is not None:
            self.leases.release(item.execution)
            self._wake()

    def _timed_out(self, execution: Execution) -> None:
        outcome = timeout_outcome(execution, self.client.clock.now(),
                                  self.records.backoff(execution.job))
        self._end_here(execution, outcome, "timeout")

    def _cancelled(self, execution: Execution) -> None:
        """A renewal saw the job's cancel request: it ends cancelled here now
        (an executor can't be relied on to stop), and its executor is told."""
        if not execution.end(ACKED):
            return
        job = execution.job
        log.info("belay: job %d attempt %d: cancel requested; cancelling its execution",
                 job.id, job.attempt)
        error = {"reason": "cancel_requested", "attempt": job.attempt}
        self._end_here(execution, Outcome("cancelled", error=error), "cancel_requested")

    def _end_here(self, execution: Execution, outcome: Outcome, reason: str) -> None:
        """Ack an execution this server ended, report it, tell its executor."""
        acked = self.records.ack(execution.job, outcome)
        ending = "timeout" if reason == "timeout" else "cancelled" if acked else "stale"
        self.records.ended(execution, ending, outcome.error)
        self._tell_cancel(execution, reason)

    def _tell_cancel(self, execution: Execution, reason: str) -> None:
        connection: _Connection | None = execution.owner
        if connection is None:
            return
        with self._lock:
            ids = [i for i, r in connection.running.items() if r.execution is execution]
        for execution_id in ids:
            self._send(connection, protocol.message(
                "cancel_execution", f"cancel-{execution_id}", execution_id=execution_id,
                job_id=execution.job.id, reason=reason))
        if ids and self.callbacks.on_cancel is not None:
            self.callbacks.on_cancel(connection.runtime_id, execution.job.id, reason)
        self._wake()  # its slot is free

    # -- Dispatch ----------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._dispatch is not None:
            self._dispatch.wake()

    def wake(self) -> None:
        """Look for work now (a NOTIFY said a queue has some)."""
        self._wake()

    def _dispatch_loop(self, service: Service) -> None:
        wait = 0.0
        while not service.wait(wait):
            if self.crashed is not None:
                wait = IDLE_WAIT
                continue
            try:
                sent = self.dispatch()
            except (psycopg.Error, BelayError):
                log.warning("belay: dispatching to executors failed; retrying",
                            exc_info=True)
                sent = 0
            if sent:
                self._hot_until = time.monotonic() + HOT_WINDOW
            wait = BUSY_WAIT if time.monotonic() < self._hot_until else IDLE_WAIT

    def dispatch(self) -> int:
        """One round: claim for every connection with free capacity and send
        the executions; returns how many were sent. Outside the hot window
        one read first asks which queues have work at all."""
        with self._lock:
            ready = [c for c in self._connections.values() if c.ready and c.free() > 0]
        if not ready:
            return 0
        sent = 0
        with self.client.connection() as conn:
            specs = self._specs.get(conn)
            if time.monotonic() >= self._hot_until:
                busy = store.queues_with_work(conn, self.queues, self.client.clock.now())
                specs = {name: spec for name, spec in specs.items() if name in busy}
            for connection in ready:
                for spec in specs.values():
                    free = connection.free()
                    if free <= 0 or spec.paused:
                        continue
                    with self._lock:
                        kinds = sorted(connection.tasks)
                    jobs = claim_jobs(conn, spec, free, connection.node_id,
                                      self.client.clock.now, self.leases.lease_ttl,
                                      kinds=kinds)
                    for job in jobs:
                        sent += self._execute(connection, job)
        return sent

    def _execute(self, connection: _Connection, job: Job) -> int:
        if job.cancel_requested:  # §8.6: never another attempt once a cancel was asked
            self.records.ack(job, cancel_requested(job.attempt))
            return 0
        timeout_ms = self.records.timeout_ms(job)
        execution = Execution(job, None, None if timeout_ms is None else timeout_ms / 1000,
                              node=connection.node_id, clock=self._clock)
        execution.owner = connection
        execution_id = f"{job.id}.{job.attempt}.{secrets.token_urlsafe(9)}"
        reservation_id = secrets.token_urlsafe(12)
        with self._lock:
            if connection.closed:
                gone = True
            else:
                gone = False
                connection.running[execution_id] = _Running(execution, reservation_id)
        if gone:
            self.records.give_back(job)
            return 0
        self.leases.hold(execution)
        event = execute_frame(execution_id, reservation_id, job, timeout_ms,
                              self.leases.lease_ttl)
        try:
            ok = self._send(connection, event)
        except protocol.ProtocolError as exc:  # its input doesn't fit in a frame
            self._forget(connection, execution_id)
            if execution.end(ACKED):
                self.records.refuse(job, f"the job can't be sent to an executor: {exc}")
            return 0
        if not ok:
            self._forget(connection, execution_id)
            if execution.end(LOST):
                self.records.hand_back(execution, connection.node_id, "a send to it failed")
            self._close(connection, "a send to it timed out or failed (it stopped reading)")
            return 0
        return 1


def _shed(sock: socket.socket, waiting: int) -> bool:
    """Close a new connection when :data:`MAX_WAITING` others are still to say
    hello; True when it was."""
    if waiting < MAX_WAITING:
        return False
    log.warning("belay: %d executor connections have not said hello; closing a new one",
                waiting)
    sock.close()
    return True


def execute_frame(execution_id: str, reservation_id: str, job: Job, timeout_ms: int | None,
                  lease_ttl: float) -> dict[str, Any]:
    """The ``execute`` message for a claimed job."""
    return protocol.message(
        "execute", execution_id, reservation_id=reservation_id, execution_id=execution_id,
        job_id=job.id, task=job.kind, args=job.input, attempt=job.attempt,
        max_attempts=job.max_attempts, timeout_ms=timeout_ms, queue=job.queue,
        lease_ttl_ms=int(lease_ttl * 1000))


class _Requests:
    """What an executor sends on an established connection, answered."""

    def __init__(self, server: ExecutorServer) -> None:
        self.server = server

    def handle(self, connection: _Connection, message: dict[str, Any]) -> None:
        kind, request_id = message["type"], message["request_id"]
        if not connection.runtime_id:
            self._hello(connection, message)
            return
        if kind == "hello":
            raise _Refused("it sent hello twice")
        try:
            reply = self._answer(connection, kind, message)
        except ReportRefused as exc:
            reply = protocol.error(request_id, "invalid_request", _said(exc))
        except _Stale as exc:
            reply = protocol.error(request_id, "stale_execution", _said(exc))
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            reply = protocol.error(request_id, "unavailable",
                                   f"the database is unavailable ({type(exc).__name__}); "
                                   "report it again")
        self.server._send(connection, reply)

    def _hello(self, connection: _Connection, message: dict[str, Any]) -> None:
        request_id = message["request_id"]
        try:
            hello = protocol.parse_hello(message)
        except ValueError as exc:
            self.server._send(connection, protocol.error(request_id, "invalid_request",
                                                         _said(exc)))
            raise _Refused(f"its hello was refused ({exc})") from None
        if hello.mode != "worker":
            text = ("this socket serves executors (mode \"worker\"); enqueue and read jobs "
                    "with the client or the HTTP API")
            self.server._send(connection, protocol.error(request_id, "unsupported", text))
            raise _Refused("it is not an executor")
        # From now on it may stay quiet for as long as it likes; a send to it
        # that can't go through for send_timeout closes it instead.
        connection.sock.settimeout(None)
        seconds = int(self.server.send_timeout)
        connection.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO,
            struct.pack("ll", seconds, int((self.server.send_timeout - seconds) * 1_000_000)))
        with self.server._lock:
            connection.runtime_id = hello.runtime_id
            connection.node_id = f"socket:{hello.runtime_id[:64]}/{uuid.uuid4().hex[:12]}"
            connection.capacity = hello.max_concurrency
        self.server._send(connection, protocol.message(
            "hello_ok", request_id, node_id=connection.node_id))
        log.info("belay: executor %s connected (capacity %d)", connection.node_id,
                 hello.max_concurrency)
        if self.server.callbacks.on_connect is not None:
            self.server.callbacks.on_connect(hello.runtime_id)

    def _answer(self, connection: _Connection, kind: str,
                message: dict[str, Any]) -> dict[str, Any]:
        request_id = message["request_id"]
        if kind in ("register_tasks", "unregister_tasks"):
            tasks = message.get("tasks")
            # No NUL: the names filter every claim for this connection, and
            # PostgreSQL text can't hold one — the claim would fail, and with it
            # the dispatch round of every executor after this one.
            if not isinstance(tasks, list) or not all(
                    isinstance(t, str) and 0 < len(t.encode("utf-8", "surrogatepass")) <= 255
                    and "\x00" not in t for t in tasks):
                raise ReportRefused("tasks must be a list of task names (1 to 255 bytes each, "
                                    "without NUL)")
            with self.server._lock:
                if kind == "register_tasks":
                    if len(connection.tasks | set(tasks)) > MAX_TASKS:
                        raise ReportRefused(f"a connection registers at most {MAX_TASKS} "
                                            "tasks; open another connection for more")
                    connection.tasks.update(tasks)
                else:
                    connection.tasks.difference_update(tasks)
                registered = sorted(connection.tasks)
            self.server._wake()
            return protocol.message("ok", request_id, tasks=registered)
        if kind == "started":
            item = self._running(connection, message)
            hooks = self.server.records.hooks
            if not item.started and hooks is not None:
                hooks.started(item.execution)
            item.started = True
            return protocol.message("ok", request_id)
        if kind in ("succeeded", "failed", "concluded"):
            return self._complete(connection, kind, message)
        raise ReportRefused(f"an executor does not send {kind!r}")

    def _running(self, connection: _Connection, message: dict[str, Any]) -> _Running:
        execution_id, reservation_id = message.get("execution_id"), message.get("reservation_id")
        with self.server._lock:
            found = connection.running.get(execution_id) if isinstance(execution_id, str) \
                else None
        if found is None or found.reservation_id != reservation_id:
            # Ids quoted cut to 80 characters: the reply must fit in a frame.
            raise _Stale(f"execution {execution_id!r:.80} with reservation "
                         f"{reservation_id!r:.80} is not in flight on this connection "
                         "(completed, reclaimed, or never sent here)")
        if found.execution.ended is not None:
            self.server._forget(connection, str(execution_id))
            raise _Stale(f"execution {execution_id!r:.80} ended here ({found.execution.ended}); "
                         "its outcome is discarded")
        return found

    def _complete(self, connection: _Connection, kind: str,
                  message: dict[str, Any]) -> dict[str, Any]:
        item = self._running(connection, message)
        execution, job = item.execution, item.execution.job
        server = self.server
        now = server.client.clock.now()
        decided: Outcome | Parked
        if kind == "concluded":
            decided = _concluded(message)
        else:
            decided = reported(job, "success" if kind == "succeeded" else "failure",
                               message.get("result"), message.get("error"), now,
                               check_details=lambda d: _storable(d, "error.details"))
        if not execution.end(ACKED):
            raise _Stale(f"execution {message['execution_id']!r:.80} ended here "
                         f"({execution.ended}); its outcome is discarded")
        try:
            if isinstance(decided, Parked):
                parked = server.records.park(job, decided.scope, decided.name, decided.deadline)
                state = None if parked is None else \
                    parked if parked in ("ready", "cancelled") else "awaiting"
                outcome = {"ready": "woken", "cancelled": "cancelled"}.get(parked or "", "await")
            else:
                acked = server.records.ack(job, decided)
                state = None if acked is None else acked.job.state
                outcome = decided.kind if acked is None else written(decided, acked.job)
        except BaseException:
            execution.reopen(ACKED)  # nothing written: the executor may report it again
            raise
        server._forget(connection, message["execution_id"])
        server.records.ended(execution, "stale" if state is None else outcome,
                     None if isinstance(decided, Parked) else decided.error)
        if state is None:
            raise _Stale(f"job {job.id} attempt {job.attempt} was reclaimed or finished "
                         "meanwhile; this outcome was discarded")
        return protocol.message("ok", message["request_id"], job_id=job.id,
                                state=state, attempt=job.attempt)


#: The longest ``message`` of an ``error`` reply. A refusal may quote what the
#: executor sent; however long that was, the reply must fit in a frame (one
#: that didn't was raised as the executor's broken frame, and closed it).
MAX_ERROR_TEXT = 1024


def _said(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT - 1] + "\u2026"


def _storable(value: Any, what: str) -> None:
    """ReportRefused unless PostgreSQL's jsonb can hold ``value``: no NUL in
    any string or key (the HTTP transport refuses them too). Such a report
    used to fail its write (a DataError), which closed the connection and gave
    its jobs back instead of answering ``invalid_request``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ReportRefused(f"{what} holds a NUL character (\\x00), which PostgreSQL "
                                    "can't store; remove it or encode the text")
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _concluded(message: dict[str, Any]) -> Outcome | Parked:
    """:func:`~belay.parts.remote.concluded`, refusing what it would let
    through to fail later: a NUL in the outcome's error, and a park's scope or
    name the Python worker would refuse (a NUL failed the write; one over
    PostgreSQL's index row size was answered ``unavailable``, "report it
    again", forever)."""
    decided = concluded(message)
    if isinstance(decided, Parked):
        try:
            names.check_text(decided.scope, "park.scope", empty=True)
            names.check_text(decided.name, "park.name", empty=True)
        except ValidationError as exc:
            raise ReportRefused(str(exc)) from None
    else:
        _storable(decided.error, "outcome.error")
    return decided


class _Refused(Exception):
    """The connection is closed after this (a refused hello, a second hello)."""


class _Stale(Exception):
    """A report about an execution this connection no longer holds."""
