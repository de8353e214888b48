"""The process pool: the worker's jobs run in child processes.

``Worker(processes=N)`` (``belay worker --processes N``) serves executors on
a private Unix-domain socket (:mod:`belay.parts.sockets`) and keeps ``N``
children (:mod:`belay.parts.child`) connected to it, one job at a time each.
The worker process still claims, leases, renews and acks; a child runs the
function and talks to PostgreSQL itself for steps, events, signals, children
and budgets. What a thread can't do, a process can:

- **a hard timeout**: past a job's ``timeout`` the attempt fails (retried
  while attempts remain) and the child is killed and replaced;
- **a cancel that stops the work**: an operator's cancel of a running job
  ends it cancelled and kills its child;
- **a child that dies mid-job** (out of memory, a crash in C code, kill -9)
  fails that attempt with the exit status, so a job that kills its process
  every time ends up failed instead of looping;
- ``max_tasks_per_child`` and ``max_memory_per_child`` (MiB of resident memory,
  checked after each job) retire a child, which is replaced;
- CPU-bound jobs spread over the cores: no GIL is shared.

The ``belay-process-pool`` service reaps and replaces children. Children that
exit before they connect, :data:`START_FAILURES` times in a row, crash it (an
import error in a task module, say): the worker stops, and says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from belay.client import Belay
from belay.errors import ConfigurationError
from belay.outcome import retry_or_fail
from belay.parts.child import ENV, Settings
from belay.parts.execution import Execution
from belay.parts.hooks import Hooks
from belay.parts.service import Service
from belay.parts.sockets import ExecutorServer
from belay.registry import DEFAULT_REGISTRY, Registry

log = logging.getLogger("belay.worker")

#: Children that exit before they connect, this many in a row, crash the pool.
START_FAILURES = 5
#: How often the pool looks for children that exited.
REAP_INTERVAL = 0.2
#: Seconds a child has to exit after SIGTERM at shutdown before SIGKILL.
TERM_GRACE = 2.0


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    runtime_id: str
    started: float = field(default_factory=time.monotonic)
    #: The pool killed it (a timeout or a cancel): its exit is expected.
    killed: str | None = None
    #: It said hello on the socket.
    connected: bool = False


def child_settings(registry: Registry, client: Belay, *, socket_path: str, runtime_id: str,
                   max_tasks: int | None, max_memory_mb: int | None,
                   notify: bool) -> Settings:
    """What a child needs to find the worker's functions and the database.

    Raises :class:`ConfigurationError` (naming the fix) when the functions
    can't be found from another process."""
    modules: set[str] = set()
    main_path: str | None = None
    for kind in registry.kinds():
        definition = registry.get(kind)
        if definition is None or definition.chunk is not None:
            continue
        module = getattr(definition.fn, "__module__", None) or "__main__"
        if module in ("__main__", "__mp_main__"):
            main_path = _main_path(kind)
        else:
            modules.add(module)
    return Settings(
        socket=socket_path, url=client.conninfo, runtime_id=runtime_id,
        modules=sorted(modules), main_path=main_path,
        registry=_registry_name(registry, modules, main_path), sys_path=list(sys.path),
        max_tasks=max_tasks, max_memory_mb=max_memory_mb, notify=notify,
        encryption_key=None if client.encryption_key is None else client.encryption_key.hex(),
        pooler=client.pooler, direct_url=client.direct_url)


def _main_path(kind: str) -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ConfigurationError(
            f"worker {kind!r} is defined in an interactive session; processes import the "
            "functions they run: define it in a module and import that")
    return os.path.abspath(path)


def _registry_name(registry: Registry, modules: set[str], main_path: str | None) -> str | None:
    """``module:name`` of a registry other than the default, found in the
    modules that define its functions."""
    if registry is DEFAULT_REGISTRY:
        return None
    places = [(m, sys.modules.get(m)) for m in sorted(modules)]
    if main_path is not None:
        places.append(("__main__", sys.modules.get("__main__")))
    for name, module in places:
        for attribute, value in vars(module or object()).items():
            if value is registry:
                return f"{name}:{attribute}"
    raise ConfigurationError(
        "processes need to find the worker's registry in a child process: make it a global "
        "of the module that defines its functions, or use the default registry")


class ProcessPool:
    """``processes`` children serving ``server`` (already started)."""

    def __init__(self, server: ExecutorServer, registry: Registry, client: Belay, *,
                 processes: int, max_tasks_per_child: int | None = None,
                 max_memory_per_child: int | None = None, notify: bool = False) -> None:
        _positive("processes", processes)
        if max_tasks_per_child is not None:
            _positive("max_tasks_per_child", max_tasks_per_child)
        if max_memory_per_child is not None:
            _positive("max_memory_per_child", max_memory_per_child)
        self.server = server
        self.registry = registry
        self.client = client
        self.processes = processes
        self.max_tasks_per_child = max_tasks_per_child
        self.max_memory_per_child = max_memory_per_child
        self.notify = notify
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}
        self._prefix = f"belay-process-{os.getpid()}-"
        self._failures = 0
        self._stopping = False
        self.service: Service | None = None
        server.callbacks.on_cancel = self.cancelled
        server.callbacks.on_disconnect = self.disconnected
        server.callbacks.on_connect = self.connected
        # Raises now, in the caller, when the functions can't be found.
        self._settings("check")

    def _settings(self, runtime_id: str) -> Settings:
        return child_settings(
            self.registry, self.client, socket_path=str(self.server.path),
            runtime_id=runtime_id, max_tasks=self.max_tasks_per_child,
            max_memory_mb=self.max_memory_per_child, notify=self.notify)

    def pids(self) -> list[int]:
        with self._lock:
            return [c.process.pid for c in self._children.values()]

    # -- Lifecycle --------------------------------------------------------------------

    def start(self, on_crash: Callable[[Service, BaseException], None]) -> None:
        self._stopping = False
        self._failures = 0
        for _ in range(self.processes):
            self._spawn()
        self.service = Service("belay-process-pool", self._loop, on_crash=on_crash).start()

    def stop(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after :data:`TERM_GRACE`)."""
        self._stopping = True
        if self.service is not None:
            self.service.stop()
            self.service.join(5.0)
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.process.terminate()
        deadline = time.monotonic() + TERM_GRACE
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def drain(self, grace: float) -> list[int]:
        """Stop dispatching and wait up to ``grace`` seconds for the jobs the
        children run to be reported; returns the ids still running then."""
        self.server.stop_dispatching()
        deadline = time.monotonic() + grace
        while True:
            running = self.server.in_flight()
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(0.05)

    def _spawn(self) -> None:
        env = dict(os.environ)
        # The child's id is known only once it runs: it appends its pid.
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from belay.parts.child import main; "
                                   "sys.exit(main())"],
            env={**env, ENV: self._settings(self._prefix).to_env()},
            stdin=subprocess.DEVNULL)
        runtime_id = f"{self._prefix}{process.pid}"
        with self._lock:
            self._children[runtime_id] = _Child(process, runtime_id)

    def _loop(self, service: Service) -> None:
        while not service.wait(REAP_INTERVAL):
            self.reap()

    def reap(self) -> None:
        """Replace every child that exited; crash after too many failed starts."""
        with self._lock:
            exited = [c for c in self._children.values() if c.process.poll() is not None]
            for child in exited:
                del self._children[child.runtime_id]
        for child in exited:
            code = child.process.returncode
            if child.killed is None and code != 0 and not child.connected:
                self._failures += 1
                if self._failures >= START_FAILURES:
                    raise ConfigurationError(
                        f"{self._failures} child processes in a row exited before they "
                        f"connected (last exit: {describe_exit(code)}); their output above "
                        "says why (an import error in a task module, a bad database URL…)")
            else:
                self._failures = 0
            if child.killed is None and code != 0:
                log.warning("belay: child process %d exited (%s); starting another",
                            child.process.pid, describe_exit(code))
            if not self._stopping:
                self._spawn()

    # -- The server's calls ------------------------------------------------------------

    def connected(self, runtime_id: str) -> None:
        with self._lock:
            child = self._children.get(runtime_id)
            if child is not None:
                child.connected = True

    def cancelled(self, runtime_id: str, job_id: int, reason: str) -> None:
        """A timeout or a cancel: kill the child running the job (the pool
        starts another)."""
        with self._lock:
            child = self._children.get(runtime_id)
            if child is None:
                return
            child.killed = reason
        log.info("belay: killing child process %d (job %d: %s)", child.process.pid, job_id,
                 reason.replace("_", " "))
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()

    def disconnected(self, runtime_id: str, executions: list[Execution]) -> list[Execution]:
        """A child's connection closed with ``executions`` in flight: when the
        child died (not stopped by the pool), each attempt fails with its exit
        status; when the pool stopped or killed it, each goes back uncounted.
        Returns the executions for the server to hand back, counted (a child
        alive whose connection went: :mod:`belay.parts.handbacks`)."""
        with self._lock:
            child = self._children.get(runtime_id)
        if child is None or self._stopping or child.killed is not None:
            # Stopping (the pool forgets its children first) or killed for
            # another job's timeout or cancel: not this job's doing.
            for execution in executions:
                self.server.records.hand_back(execution, None, "the pool stopped its child")
            return []
        try:
            code = child.process.wait(2.0)
        except subprocess.TimeoutExpired:
            return executions  # alive, only its connection went: counted
        for execution in executions:
            job = execution.job
            definition = self.registry.get(job.kind)
            error = {"error": f"ProcessDied: the process running the job exited "
                              f"({describe_exit(code)}): out of memory, a crash in native "
                              "code, or killed", "attempt": job.attempt}
            backoff = definition.backoff if definition is not None else (lambda _: 0.0)
            outcome = retry_or_fail(error, job.attempt, job.max_attempts,
                                    self.client.clock.now(), backoff)
            log.error("belay: job %d attempt %d: %s", job.id, job.attempt, error["error"])
            acked = self.server.records.ack(job, outcome)
            self.server.records.ended(execution, outcome.kind if acked else "stale", error)
        return []


def out_of_process(
    client: Belay, queues: list[str], registry: Registry, hooks: Hooks,
    on_crash: Callable[[Service, BaseException], None], *,
    executor_socket: str | os.PathLike[str] | bool | None, mode: int, lease_ttl: float,
    processes: int | None, max_tasks_per_child: int | None,
    max_memory_per_child: int | None, notify: bool,
) -> tuple[ExecutorServer | None, ProcessPool | None]:
    """A worker's executors on a socket (``executor_socket``: a path, or True
    for the default place) and its process pool (``processes``), as asked for;
    a pool without a socket of the user's gets a private one."""
    if processes is None and (max_tasks_per_child is not None
                              or max_memory_per_child is not None):
        raise ConfigurationError("max_tasks_per_child and max_memory_per_child are "
                                 "settings of a process pool: pass processes=N too")
    private: Path | None = None
    if processes is not None and executor_socket in (None, False):
        executor_socket, private = private_socket()
    if executor_socket is None or executor_socket is False:
        return None, None
    server = ExecutorServer(client, queues, path=None if executor_socket is True
                            else executor_socket, mode=mode, lease_ttl=lease_ttl,
                            registry=registry if processes is not None else None)
    server.callbacks.on_crash = on_crash
    server.records.hooks = hooks
    if private is not None:
        weakref.finalize(server, remove_private, private)
    if processes is None:
        return server, None
    return server, ProcessPool(server, registry, client, processes=processes,
                               max_tasks_per_child=max_tasks_per_child,
                               max_memory_per_child=max_memory_per_child, notify=notify)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def private_socket() -> tuple[Path, Path]:
    """A socket path in a new directory only this user can enter; (path, directory)."""
    directory = Path(tempfile.mkdtemp(prefix="belay-pool-"))
    return directory / "executor.sock", directory


def remove_private(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a whole number >= 1, got {value!r}")
