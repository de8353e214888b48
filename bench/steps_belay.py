"""belay's side of the ``steps`` scenario: ``python -m bench.steps_belay --url U [--tuned]``.

One worker process (``belay.Worker({"default": 10})``, otherwise at its
defaults) serving two kinds of job, each of :data:`STEPS` durable steps
(``ctx.step``):

- ``bench.steps.noop``: every step returns its number at once;
- ``bench.steps.sleep`` (input ``{"file": F, "sleep": S}``): every step first
  appends ``"<step> <pid> <time.time()>"`` to F, then sleeps S seconds, then
  returns its number.

``--tuned`` is the shorter recovery the worker's documented options allow:
``lease_ttl=2`` (heartbeat every 2/3 s), ``sweep_interval=0.5`` and the job's
``backoff`` 0 (the retry after an expired lease is due at once instead of
after 2-4 s). It prints ``ready`` once started and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from typing import Any

import belay
from bench.belay_node import serve

STEPS = 10
NOOP = "bench.steps.noop"
SLEEP = "bench.steps.sleep"
#: The tuned worker's settings (see the module docstring).
TUNED_LEASE_TTL = 2.0
TUNED_SWEEP_INTERVAL = 0.5


def mark(path: str, step: int) -> None:
    """Record that ``step`` starts now, in this process (an O_APPEND write)."""
    with open(path, "a") as out:
        out.write(f"{step} {os.getpid()} {time.time():.6f}\n")


def same(n: int) -> int:
    return n


def marked(path: str, pause: float, n: int) -> int:
    mark(path, n)
    time.sleep(pause)
    return n


def no_backoff(attempt: int) -> float:
    return 0.0


def registry(tuned: bool) -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name=NOOP, registry=reg, queue="default")
    def noop(ctx: belay.Context) -> int:
        for n in range(1, STEPS + 1):
            ctx.step(f"s{n}", partial(same, n))
        return STEPS

    @belay.worker(name=SLEEP, registry=reg, queue="default",
                  backoff=no_backoff if tuned else None)
    def sleep(ctx: belay.Context) -> int:
        path, pause = ctx.input["file"], float(ctx.input["sleep"])
        for n in range(1, STEPS + 1):
            ctx.step(f"s{n}", partial(marked, path, pause, n))
        return STEPS

    return reg


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.steps_belay")
    parser.add_argument("--url", required=True)
    parser.add_argument("--tuned", action="store_true",
                        help=f"lease_ttl={TUNED_LEASE_TTL:g}, "
                             f"sweep_interval={TUNED_SWEEP_INTERVAL:g}, backoff 0")
    args = parser.parse_args()
    options: dict[str, Any] = {}
    if args.tuned:
        options = {"lease_ttl": TUNED_LEASE_TTL, "sweep_interval": TUNED_SWEEP_INTERVAL}
    serve(belay.Worker({"default": 10}, client=belay.Belay(args.url),
                       registry=registry(args.tuned), **options))


if __name__ == "__main__":
    main()
