"""The production profile's open-loop producers and command line, for the
peers' drivers (standard library only: they run inside the peers' own
virtualenvs, where belay is not installed).

A producer process runs ``tasks`` asyncio tasks, each with a connection of
its own (made before the clock starts), each sending the profile's jobs on a
Poisson schedule of ``rate / tasks`` per second; it prints ``ready``, starts
on SIGUSR1, sends for ``seconds`` and prints one JSON line: jobs sent,
errors, jobs due and unsent at the stop, and the enqueue's own p50/p99 (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.profile_mix import Poisson, job

#: One task's sender: enqueue one job of the mix ({kind, input, queue}).
Send = Callable[[dict[str, Any]], Awaitable[None]]


def parser(prog: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``install``, ``enqueue --count N --seed S``, ``work --procs P`` and
    ``produce --rate R --seconds S --tasks T --seed S``, each with ``--url``;
    returns the parser and ``work``'s subparser for the peer's own options."""
    top = argparse.ArgumentParser(prog=prog)
    commands = top.add_subparsers(dest="command", required=True)
    for name, said in (("install", "install the schema"),
                       ("enqueue", "enqueue a backlog of the profile's jobs"),
                       ("work", "serve the profile's queues from SIGUSR1 until SIGTERM"),
                       ("produce", "send the profile's jobs on Poisson schedules")):
        sub = commands.add_parser(name, help=said)
        sub.add_argument("--url", required=True)
        if name == "enqueue":
            sub.add_argument("--count", type=int, required=True)
            sub.add_argument("--seed", type=int, default=1)
        elif name == "work":
            sub.add_argument("--procs", type=int, required=True,
                             help="how many worker processes serve the queues in all")
            serve = sub
        elif name == "produce":
            sub.add_argument("--rate", type=float, required=True)
            sub.add_argument("--seconds", type=float, required=True)
            sub.add_argument("--tasks", type=int, default=8)
            sub.add_argument("--seed", type=int, default=1)
    return top, serve


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


async def produce(senders: list[Send], rate: float, seconds: float, seed: int) -> None:
    """Run one task per sender from SIGUSR1 on for ``seconds``; print the report."""
    go = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
    print("ready", flush=True)
    await go.wait()
    start = time.monotonic()
    stop = start + seconds
    counts = {"sent": 0, "errors": 0, "due_unsent_at_stop": 0}
    took: list[float] = []

    async def one(send: Send, rng: random.Random) -> None:
        stream = Poisson(rate / len(senders), rng, start)
        while True:
            await asyncio.sleep(max(0.0, min(stream.due, stop) - time.monotonic()))
            called = time.monotonic()
            if called >= stop:
                break
            try:
                await send(job(rng))
                counts["sent"] += 1
            except Exception:  # a peer's own error type: counted, as belay's are
                counts["errors"] += 1
            took.append((time.monotonic() - called) * 1000)
            stream.advance()
        counts["due_unsent_at_stop"] += stream.unsent(stop)

    await asyncio.gather(*(one(send, random.Random(seed * 100 + i))
                           for i, send in enumerate(senders)))
    print(json.dumps({**counts, "enqueue_p50_ms": round(_percentile(took, 50), 2),
                      "enqueue_p99_ms": round(_percentile(took, 99), 2)}), flush=True)
