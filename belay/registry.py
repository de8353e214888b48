"""Worker definitions: ``@belay.worker`` and the registry that maps kinds to code.

A kind is a registry name (contract §12: each implementation maps it to code
its own way). Ours defaults to ``module.qualname`` of the function and can be
set with ``name=`` so a Python worker can serve a kind an Elixir producer names.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from belay.enqueue import Unique, check_unique
from belay.errors import ConfigurationError, ValidationError
from belay.outcome import Backoff, default_backoff

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.context import Context
    from belay.job import Job

JobFunction = Callable[["Context"], Any]


@dataclass(frozen=True)
class Chunk:
    """``chunk={"size": 100, "gather_ms": 500}``: run up to ``size`` jobs of this kind
    in one call, waiting up to ``gather_ms`` for a chunk to fill."""

    size: int = 10
    gather_ms: int = 0


def parse_chunk(chunk: Mapping[str, Any] | None) -> Chunk | None:
    if chunk is None:
        return None
    if not isinstance(chunk, Mapping) or set(chunk) - {"size", "gather_ms"}:
        raise ConfigurationError(
            f"chunk is a dict like {{'size': 100, 'gather_ms': 500}}, got {chunk!r}"
        )
    size, gather = chunk.get("size", 10), chunk.get("gather_ms", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigurationError(f"chunk size is a whole number >= 1, got {size!r}")
    if isinstance(gather, bool) or not isinstance(gather, int) or gather < 0:
        raise ConfigurationError(f"chunk gather_ms is a whole number >= 0, got {gather!r}")
    return Chunk(size=size, gather_ms=gather)


class WorkerDef:
    """A registered worker: the function plus its options. Calling it runs the function."""

    def __init__(
        self,
        fn: JobFunction,
        *,
        kind: str,
        queue: str,
        max_attempts: int,
        timeout: float | None,
        priority: int,
        backoff: Backoff,
        unique: str | Unique | Mapping[str, Any] | None,
        encrypted: bool = False,
        chunk: Chunk | None = None,
    ) -> None:
        self.fn = fn
        #: Set for chunk workers: the function takes a list of contexts.
        self.chunk = chunk
        self.kind = kind
        self.queue = queue
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.priority = priority
        self.backoff = backoff
        self.unique = unique
        self.encrypted = encrypted
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", kind)
        self.__wrapped__ = fn

    @property
    def enqueue_defaults(self) -> dict[str, Any]:
        """Options ``enqueue`` takes from the worker when the caller gives none."""
        return {"queue": self.queue, "max_attempts": self.max_attempts,
                "priority": self.priority, "unique": self.unique, "encrypt": self.encrypted}

    def __call__(self, ctx: Context) -> Any:
        return self.fn(ctx)

    def enqueue(
        self, input: Mapping[str, Any] | None = None, *, client: Belay | None = None,
        **options: Any,
    ) -> Job:
        """Enqueue a job for this worker (``belay.enqueue(self, input, **options)``)."""
        if client is None:
            from belay.defaults import default

            client = default()
        return client.enqueue(self, input, **options)

    def __repr__(self) -> str:
        return f"<belay worker {self.kind} queue={self.queue!r}>"


class Registry:
    """Kinds to workers. ``belay.worker`` registers into the default one."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerDef] = {}
        self._lock = threading.Lock()

    def add(self, definition: WorkerDef) -> None:
        with self._lock:
            existing = self._workers.get(definition.kind)
            if existing is not None and existing.fn is not definition.fn:
                same_code = all(
                    getattr(existing.fn, attr, None) == getattr(definition.fn, attr, None)
                    for attr in ("__module__", "__qualname__")
                )
                if not same_code:
                    raise ConfigurationError(
                        f"kind {definition.kind!r} is already registered to {existing.fn!r}; "
                        "give one of them another name= "
                    )
            # Re-registering the same function (a module reloaded) replaces it.
            self._workers[definition.kind] = definition

    def get(self, kind: str) -> WorkerDef | None:
        return self._workers.get(kind)

    def kinds(self) -> list[str]:
        return sorted(self._workers)

    def __contains__(self, kind: object) -> bool:
        return kind in self._workers

    def __len__(self) -> int:
        return len(self._workers)


DEFAULT_REGISTRY = Registry()


@overload
def worker(fn: JobFunction, /) -> WorkerDef: ...


@overload
def worker(
    *,
    name: str | None = None,
    queue: str = "default",
    max_attempts: int = 20,
    timeout: float | None = None,
    priority: int = 0,
    backoff: Backoff | None = None,
    unique: str | Unique | Mapping[str, Any] | None = None,
    encrypted: bool = False,
    chunk: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> Callable[[JobFunction], WorkerDef]: ...


def worker(
    fn: JobFunction | None = None,
    /,
    *,
    name: str | None = None,
    queue: str = "default",
    max_attempts: int = 20,
    timeout: float | None = None,
    priority: int = 0,
    backoff: Backoff | None = None,
    unique: str | Unique | Mapping[str, Any] | None = None,
    encrypted: bool = False,
    chunk: Mapping[str, Any] | None = None,
    registry: Registry | None = None,
) -> WorkerDef | Callable[[JobFunction], WorkerDef]:
    """Register a function as a worker: ``@belay.worker`` or ``@belay.worker(queue=…)``.

    The function takes a :class:`belay.Context` and returns the job's result.
    ``timeout`` (seconds) fails an attempt that runs longer; ``backoff`` maps
    an attempt number to the seconds before the retry; ``encrypted=True``
    stores every enqueued input encrypted (see ``Belay(encryption_key=…)``).

    ``chunk={"size": n, "gather_ms": ms}`` makes a chunk worker: the function
    takes a list of contexts (up to ``n`` jobs claimed together) and returns
    ``None`` (all succeeded) or a dict of job id → result, where an exception
    instance as a value fails (or ``belay.Cancel``/``Snooze``) that job alone.
    """
    chunk_options = parse_chunk(chunk)
    if not isinstance(queue, str) or not queue:
        raise ConfigurationError(f"queue must be a non-empty string, got {queue!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigurationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise ConfigurationError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigurationError(f"priority must be an integer, got {priority!r}")
    if backoff is not None and not callable(backoff):
        raise ConfigurationError("backoff must be a callable taking the attempt number")
    try:
        check_unique(unique)
    except ValidationError as exc:
        raise ConfigurationError(f"@belay.worker unique=: {exc}") from None

    def register(function: JobFunction) -> WorkerDef:
        if not callable(function):
            raise ConfigurationError(f"@belay.worker decorates a function, got {function!r}")
        if inspect.iscoroutinefunction(function):
            raise ConfigurationError(
                f"{function.__qualname__} is async: belay runs jobs on threads, so write it "
                "as a plain def (call asyncio.run(...) inside if you need a loop)"
            )
        kind = name or f"{function.__module__}.{function.__qualname__}"
        if "<locals>" in kind and name is None:
            raise ConfigurationError(
                f"{function.__qualname__} is defined inside a function, so its default kind "
                f"{kind!r} is not a stable name: pass name='…'"
            )
        definition = WorkerDef(
            function, kind=kind, queue=queue, max_attempts=max_attempts,
            timeout=None if timeout is None else float(timeout), priority=priority,
            backoff=backoff or default_backoff, unique=unique, encrypted=bool(encrypted),
            chunk=chunk_options,
        )
        (registry if registry is not None else DEFAULT_REGISTRY).add(definition)
        return definition

    if fn is not None:
        return register(fn)
    return register
