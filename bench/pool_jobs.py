"""The job functions of the ``processes`` scenario (bench/processes.py).

A module of their own, with the registry a global of it (``REGISTRY``): the
process pool's children import this module (by the functions' ``__module__``)
and find the registry by that name. The thread-run variants use the same
functions, so both sides run the same code.
"""

from __future__ import annotations

import time

import belay

REGISTRY = belay.Registry()
QUEUE = "pool"


def spin(n: int) -> int:
    """Pure-Python work that holds the GIL for its whole run."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


@belay.worker(name="bench.pool.noop", queue=QUEUE, registry=REGISTRY)
def noop(ctx: belay.Context) -> None:
    return None


@belay.worker(name="bench.pool.started", queue=QUEUE, registry=REGISTRY)
def started(ctx: belay.Context) -> float:
    """The wall-clock time (s) the function started: read against the
    producer's own clock (same host)."""
    return time.time()


@belay.worker(name="bench.pool.cpu", queue=QUEUE, registry=REGISTRY)
def cpu(ctx: belay.Context) -> int:
    return spin(int(ctx.input["n"]))
