"""A belay worker process for the benchmarks: ``python -m bench.belay_node``.

Registers ``noop`` (returns None), ``echo`` (returns its input) and ``sleep``
(sleeps ``input["ms"]`` milliseconds, then returns None), serves the given
queues (``--queue NAME=N`` or ``NAME={json options}``, docs/queues.md) until
SIGTERM, and prints ``ready`` once it claims.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

import belay
from belay.cli import parse_queue_option


def registry() -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name="noop", registry=reg, queue="default")
    def noop(ctx: belay.Context) -> None:
        return None

    @belay.worker(name="echo", registry=reg, queue="default")
    def echo(ctx: belay.Context) -> Any:
        return ctx.input

    @belay.worker(name="sleep", registry=reg, queue="default")
    def sleep(ctx: belay.Context) -> None:
        time.sleep(float(ctx.input.get("ms", 0)) / 1000)

    return reg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", action="append", default=[],
                        help="NAME=N or NAME={json options} (repeatable); default default=10")
    parser.add_argument("--notify", action="store_true")
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--busy-poll", type=float, default=0.025)
    args = parser.parse_args()
    queues: dict[str, Any] = {}
    for option in args.queue or ["default=10"]:
        name, value = parse_queue_option(option)
        queues[name] = value
    serve(belay.Worker(queues, client=belay.Belay(args.url), registry=registry(),
                       notify=args.notify, poll_interval=args.poll_interval,
                       busy_poll=min(args.busy_poll, args.poll_interval), shutdown_grace=5))


def serve(worker: belay.Worker) -> None:
    """Run ``worker`` until SIGTERM, saying ``ready`` once started."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker.start()
    print("ready", flush=True)
    stop.wait()
    worker.stop()


if __name__ == "__main__":
    main()
