"""The fixed-rate producer of ``bench.vacuum``: ``python -m bench.vacuum_producer
SYSTEM --url U --rate R``, run with the python of the system's own
environment (belay's, or a peer's virtualenv: this module imports only the
standard library and, for the system it drives, that system's client).

It enqueues one no-op job at a time through the system's own client —
``belay.Belay.enqueue``, PgQueuer's ``Queries.enqueue``, Procrastinate's
``Task.defer_async`` — the i-th at ``start + i / rate`` (late ones go at once,
so the mean rate holds), prints ``ready`` once connected, and on SIGTERM
prints ``enqueued N in S s, at most L s behind schedule`` and exits. Every
minute it says on stderr how many it sent, the p50/p99/max time of an
``enqueue`` call over that minute, and how far behind schedule it is.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable

Enqueue = Callable[[], Awaitable[None]]
#: The kind belay's worker processes register (``belay worker --import bench.vacuum``).
BELAY_KIND = "bench.vacuum.noop"


async def _belay(url: str) -> Enqueue:
    import belay

    client = belay.Belay(url)

    async def enqueue() -> None:
        client.enqueue(BELAY_KIND, {})

    return enqueue


async def _pgqueuer(url: str) -> Enqueue:
    from pgqueuer import PsycopgDriver, Queries

    from bench.peer_pgqueuer import ENTRYPOINT, connect

    queries = Queries(PsycopgDriver(await connect(url)))

    async def enqueue() -> None:
        await queries.enqueue([ENTRYPOINT], [None], [0])

    return enqueue


async def _procrastinate(url: str) -> Enqueue:
    from bench.peer_procrastinate import TASK, make_app

    app = make_app(url, 1)
    await app.open_async()
    task = app.tasks[TASK]

    async def enqueue() -> None:
        await task.defer_async()

    return enqueue


CLIENTS: dict[str, Callable[[str], Awaitable[Enqueue]]] = {
    "belay": _belay, "pgqueuer": _pgqueuer, "procrastinate": _procrastinate,
}


async def produce(system: str, url: str, rate: float) -> None:
    enqueue = await CLIENTS[system](url)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    start = time.monotonic()
    sent, behind = 0, 0.0
    calls: list[float] = []
    report = start + 60.0
    while not stop.is_set():
        due = start + sent / rate
        wait = due - time.monotonic()
        if wait > 0:
            try:
                await asyncio.wait_for(stop.wait(), wait)
                break
            except asyncio.TimeoutError:
                pass
        else:
            behind = max(behind, -wait)
        began = time.monotonic()
        await enqueue()
        calls.append(time.monotonic() - began)
        sent += 1
        # belay's client is synchronous: yield, so that SIGTERM is seen even
        # when the producer is behind schedule and never waits.
        await asyncio.sleep(0)
        if began >= report:
            calls.sort()
            print(f"producer {system}: {sent} sent at {began - start:.0f} s; enqueue over "
                  f"the last minute p50 {calls[len(calls) // 2] * 1000:.1f} ms, p99 "
                  f"{calls[int(len(calls) * 0.99)] * 1000:.1f} ms, max {calls[-1] * 1000:.1f} "
                  f"ms; {max(0.0, began - due):.1f} s behind", file=sys.stderr, flush=True)
            calls, report = [], report + 60.0
    print(f"enqueued {sent} in {time.monotonic() - start:.1f} s, "
          f"at most {behind:.2f} s behind schedule", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vacuum_producer")
    parser.add_argument("system", choices=sorted(CLIENTS))
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="jobs per second")
    args = parser.parse_args()
    asyncio.run(produce(args.system, args.url, args.rate))


if __name__ == "__main__":
    main()
