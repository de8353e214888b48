"""Job functions for the process-pool tests (``tests/test_process_pool.py``).

They live in a registry of their own, ``REGISTRY``, a global of this module:
the pool's children import this module and find the registry by that name.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import belay

REGISTRY = belay.Registry()
QUEUE = "pool"

#: Memory a ``pool.hog`` run keeps for the rest of its process's life.
_KEPT: list[bytes] = []


@belay.worker(name="pool.pid", queue=QUEUE, registry=REGISTRY)
def pid(ctx: belay.Context) -> dict[str, Any]:
    return {"pid": os.getpid(), "input": ctx.input}


@belay.worker(name="pool.steps", queue=QUEUE, registry=REGISTRY, max_attempts=3)
def steps(ctx: belay.Context) -> dict[str, Any]:
    """A step journaled in the child, an event, and a failure on the first
    attempt: the retry (in whichever child) gets the journaled step back."""
    first = ctx.step("first", lambda: os.getpid(), cost=belay.Cost(usd=0.5, tokens=10))
    ctx.emit({"ran_in": os.getpid(), "attempt": ctx.attempt})
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails after its step")
    return {"first": first, "second": os.getpid()}


@belay.worker(name="pool.spend", queue=QUEUE, registry=REGISTRY, max_attempts=1)
def spend(ctx: belay.Context) -> str:
    for n in range(5):
        ctx.step(f"call-{n}", lambda n=n: n, cost=belay.Cost(usd=1))
    return "spent"


@belay.worker(name="pool.hang", queue=QUEUE, registry=REGISTRY, timeout=1.0, max_attempts=2)
def hang(ctx: belay.Context) -> int:
    """Stuck where a thread could never be stopped: past its timeout the
    child is killed (a second attempt returns at once)."""
    if ctx.attempt == 1:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        while True:
            time.sleep(0.05)
    return os.getpid()


@belay.worker(name="pool.block", queue=QUEUE, registry=REGISTRY)
def block(ctx: belay.Context) -> int:
    """Runs until it is cancelled (its child killed), reporting its pid."""
    ctx.emit({"pid": os.getpid()})
    while True:
        time.sleep(0.05)


@belay.worker(name="pool.die", queue=QUEUE, registry=REGISTRY, max_attempts=2,
              backoff=lambda attempt: 0.0)
def die(ctx: belay.Context) -> int:
    """Its first attempt kills its own process (an out-of-memory kill, say)."""
    if ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


@belay.worker(name="pool.await", queue=QUEUE, registry=REGISTRY)
def wait(ctx: belay.Context) -> Any:
    return {"got": ctx.await_signal("go"), "pid": os.getpid()}


@belay.worker(name="pool.hog", queue=QUEUE, registry=REGISTRY)
def hog(ctx: belay.Context) -> int:
    _KEPT.append(b"x" * (int(ctx.input["mb"]) * 2**20))
    return os.getpid()


@belay.worker(name="pool.cpu", queue=QUEUE, registry=REGISTRY)
def cpu(ctx: belay.Context) -> int:
    """Pure-Python work that holds the GIL for its whole run."""
    total = 0
    for n in range(int(ctx.input["n"])):
        total += n * n % 7
    return total


@belay.worker(name="pool.threads", queue=QUEUE, registry=REGISTRY)
def threads(ctx: belay.Context) -> dict[str, str]:
    """Enqueues from threads it starts, in a child process: one plain (the
    job's authority doesn't reach it: refused), one given the job's context."""
    seen: dict[str, str] = {}

    def attempt(label: str) -> None:
        try:
            ctx.client.enqueue("evil.kind")
            seen[label] = "enqueued"
        except belay.AuthorityExceeded as exc:
            seen[label] = f"refused: {exc}"

    for thread in (threading.Thread(target=attempt, args=("plain",)),
                   threading.Thread(target=belay.propagate(attempt), args=("propagated",))):
        thread.start()
        thread.join(30)
    return seen
