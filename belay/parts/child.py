"""One child of the process pool (:mod:`belay.parts.processes`): an executor
on the worker's socket that runs Python jobs in a process of its own.

Run as ``python -c "…from belay.parts.child import main…"`` by the pool, with its settings in the
``BELAY_CHILD`` environment variable (JSON: the socket, the database URL, the
modules to import…; the environment, not the command line, so ``ps`` shows
no secret). It:

1. imports the modules that define the worker's functions (and runs the
   parent's main script as ``__mp_main__`` when one is defined there);
2. connects, says ``hello`` (capacity 1) and registers every non-chunk kind;
3. for each ``execute``: says ``started``, reads the job's row, runs the
   function with a real :class:`~belay.context.Context` — steps, events,
   signals, children and budgets talk to PostgreSQL from here, on this
   child's own connection — and reports how it ended with ``concluded`` (a
   belay extension of the protocol: the decided outcome or a park, which the
   worker acks, fenced as every ack is);
4. exits after ``max_tasks`` jobs, or once its resident memory is over
   ``max_memory_mb`` after a job, or when the worker goes away; the pool
   starts a new one.

A timeout or a cancel is the worker's to enforce: it kills this process.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson

from belay import protocol
from belay.ambient import entered
from belay.client import Belay
from belay.context import Context, Park
from belay.crypto import DecryptionError, decrypt_input, is_encrypted
from belay.errors import ConfigurationError
from belay.outcome import RETURN_SNOOZE, Outcome, decide
from belay.parts.execution import Execution
from belay.registry import DEFAULT_REGISTRY, Registry, WorkerDef

#: The environment variable the pool passes the settings in.
ENV = "BELAY_CHILD"


@dataclass(frozen=True)
class Settings:
    socket: str
    url: str
    runtime_id: str
    modules: list[str]
    main_path: str | None
    registry: str | None
    sys_path: list[str]
    max_tasks: int | None
    max_memory_mb: int | None
    notify: bool
    encryption_key: str | None
    pooler: str | None
    direct_url: str | None

    def to_env(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @classmethod
    def from_env(cls, text: str) -> Settings:
        return cls(**orjson.loads(text))


def load(settings: Settings) -> Registry:
    """Import what defines the worker's functions; the registry they are in."""
    for entry in reversed(settings.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    main: dict[str, Any] = {}
    if settings.main_path is not None:
        main = runpy.run_path(settings.main_path, run_name="__mp_main__")
        # What the main script defines pickles and imports as __main__ here too.
        sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
    for module in settings.modules:
        __import__(module)
    if settings.registry is None:
        return DEFAULT_REGISTRY
    module, _, name = settings.registry.partition(":")
    found = main.get(name) if module == "__main__" else getattr(sys.modules[module], name)
    if not isinstance(found, Registry):
        raise ConfigurationError(f"{settings.registry} is not a belay Registry in this process")
    return found


def resident_mb() -> float:
    """This process's resident memory now, in MiB (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Child:
    """The executor loop of one child process."""

    def __init__(self, settings: Settings, registry: Registry, client: Belay) -> None:
        self.settings = settings
        self.registry = registry
        self.client = client
        self.node_id = ""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.reader = protocol.FrameReader()
        self.ran = 0

    def kinds(self) -> list[str]:
        return [k for k in self.registry.kinds() if self._definition(k) is not None]

    def _definition(self, kind: str) -> WorkerDef | None:
        definition = self.registry.get(kind)
        return None if definition is None or definition.chunk is not None else definition

    def send(self, kind: str, request_id: str, **fields: Any) -> None:
        self.sock.sendall(protocol.encode(protocol.message(kind, request_id, **fields)))

    def frames(self) -> Any:
        while True:
            data = self.sock.recv(65536)
            if not data:
                return
            yield from self.reader.feed(data)

    def serve(self) -> None:
        self.sock.connect(self.settings.socket)
        # The pool knows this child by its prefix and pid.
        self.send("hello", "hello", mode="worker",
                  runtime_id=f"{self.settings.runtime_id}{os.getpid()}", max_concurrency=1)
        self.send("register_tasks", "register", tasks=self.kinds())
        for message in self.frames():
            kind = message["type"]
            if kind == "hello_ok":
                self.node_id = str(message.get("node_id", ""))
            elif kind == "error" and message["request_id"] in ("hello", "register"):
                raise ConfigurationError(f"the worker refused this executor: {message}")
            elif kind == "execute":
                self.execute(message)
                self.ran += 1
                if self.retire():
                    return
            # ok replies, and cancel_execution (the worker kills this process).

    def retire(self) -> bool:
        """True when this child has done its share (the pool starts another)."""
        limit, memory = self.settings.max_tasks, self.settings.max_memory_mb
        return (limit is not None and self.ran >= limit) or (
            memory is not None and resident_mb() > memory)

    def execute(self, message: dict[str, Any]) -> None:
        ids = {"execution_id": message["execution_id"],
               "reservation_id": message["reservation_id"]}
        self.send("started", f"started-{message['execution_id']}", **ids)
        report = self.run(int(message["job_id"]), int(message["attempt"]))
        self.send("concluded", f"concluded-{message['execution_id']}", **ids, **report)

    def run(self, job_id: int, attempt: int) -> dict[str, Any]:
        """Run the job's attempt; the ``concluded`` fields of how it ended."""
        job = self.client.get_job(job_id)
        if job is None or job.state != "running" or job.attempt != attempt:
            # Reclaimed or finished meanwhile: the worker's fenced ack of
            # whatever is reported finds it stale, and forgets the execution.
            return outcome_fields(Outcome("snooze", at=self.client.clock.now()))
        definition = self._definition(job.kind)
        if definition is None:
            when = self.client.clock.now() + timedelta(seconds=RETURN_SNOOZE)
            return outcome_fields(Outcome("snooze", at=when))
        if is_encrypted(job.input):
            try:
                job = job.replace(input=decrypt_input(job.input, self.client.encryption_key))
            except (DecryptionError, ConfigurationError):
                when = self.client.clock.now() + timedelta(seconds=RETURN_SNOOZE)
                return outcome_fields(Outcome("snooze", at=when))
        execution = Execution(job, definition, None, node=self.node_id)
        ctx = Context(execution, self.client, self.registry, notify=self.settings.notify)
        returned: Any = None
        raised: BaseException | None = None
        try:
            with entered(ctx):
                returned = definition(ctx)
        except BaseException as exc:  # the job's failure, whatever it raised
            raised = exc
        if raised is not None and issubclass(type(raised), Park):
            assert isinstance(raised, Park)
            deadline = None if raised.deadline is None else raised.deadline.isoformat()
            return {"park": {"scope": raised.scope, "name": raised.name,
                             "deadline": deadline}}
        return outcome_fields(decide(
            returned=returned, raised=raised, attempt=job.attempt,
            max_attempts=job.max_attempts, now=self.client.clock.now(),
            backoff=definition.backoff))


def outcome_fields(outcome: Outcome) -> dict[str, Any]:
    """An :class:`~belay.outcome.Outcome` as ``concluded`` carries it."""
    return {"outcome": {
        "kind": outcome.kind,
        "result_json": None if outcome.result is None else outcome.result.decode("utf-8"),
        "error": outcome.error,
        "at": None if outcome.at is None else outcome.at.isoformat(),
    }}


def _orphaned(parent: int) -> None:
    """Exit once the worker that started this process is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main() -> int:
    settings = Settings.from_env(os.environ.pop(ENV))
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True,
                     name="belay-child-orphaned").start()
    registry = load(settings)
    client = Belay(settings.url, notify=settings.notify, min_pool_size=0, max_pool_size=2,
                   verify_schema=False, application_name="belay-child",
                   encryption_key=settings.encryption_key, pooler=settings.pooler,
                   direct_url=settings.direct_url, registry=registry)
    child = Child(settings, registry, client)
    try:
        child.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker is stopping
    finally:
        with contextlib.suppress(Exception):
            client.close()
    return 0

