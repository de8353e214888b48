"""Procrastinate's side of the peer benchmark, run with the python of
Procrastinate's own virtualenv (belay is not installed there, so this imports
Procrastinate, psycopg and the standard library only).

``prepare --url U --count N`` applies Procrastinate's schema and defers N no-op
jobs in one batch. ``work --url U --concurrency C --pool P`` runs one
Procrastinate worker with C concurrent async jobs over a pool of P connections;
it prints ``ready`` once its pool is open and starts the worker on SIGUSR1, so
all processes start together. SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import procrastinate

from bench import peer_cli

TASK = "noop"


def make_app(url: str, pool: int) -> procrastinate.App:
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=pool, max_size=pool)
    )

    @app.task(name=TASK)
    async def noop() -> None:
        return None

    return app


async def prepare(url: str, count: int) -> None:
    app = make_app(url, 1)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        await app.tasks[TASK].batch_defer_async(*({} for _ in range(count)))


async def work(url: str, concurrency: int, pool: int) -> None:
    app = make_app(url, pool)
    go, stop = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with app.open_async():
        print("ready", flush=True)
        started = asyncio.create_task(go.wait(), name="go")
        stopped = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait((started, stopped), return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if stop.is_set():
            return
        worker = asyncio.create_task(
            app.run_worker_async(concurrency=concurrency, install_signal_handlers=False),
            name="worker",
        )
        await asyncio.wait((worker, stopped), return_when=asyncio.FIRST_COMPLETED)
        # Cancelling run_worker_async is Procrastinate's way to stop it gracefully.
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker


def main() -> None:
    parser, serve = peer_cli.parser("python -m bench.peer_procrastinate",
                                    prepare="apply the schema, defer no-op jobs",
                                    work="run a worker until SIGTERM, from SIGUSR1 on")
    serve.add_argument("--concurrency", type=int, default=10)
    serve.add_argument("--pool", type=int, default=4)
    args = parser.parse_args()
    if args.command == "prepare":
        asyncio.run(prepare(args.url, args.count))
    else:
        asyncio.run(work(args.url, args.concurrency, args.pool))


if __name__ == "__main__":
    # Procrastinate warns about an App made in __main__; run this module's
    # importable twin instead, so the App lives where Procrastinate expects.
    from bench import peer_procrastinate

    peer_procrastinate.main()
