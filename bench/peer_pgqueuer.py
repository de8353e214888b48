"""PgQueuer's side of the peer benchmark, run with the python of PgQueuer's own
virtualenv (belay is not installed there, so this imports PgQueuer, psycopg and
the standard library only).

``prepare --url U --count N`` installs PgQueuer's schema and enqueues N no-op
jobs in one batch. ``work --url U --consumers C --batch B`` runs C PgQueuer
instances, one psycopg connection each, the way PgQueuer's own benchmark runs
its dequeue tasks; it prints ``ready`` once connected and starts consuming on
SIGUSR1, so all processes start together. SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import signal

import psycopg
import uvloop
from pgqueuer import Job, PgQueuer, PsycopgDriver, Queries

from bench import peer_cli

ENTRYPOINT = "noop"


async def connect(url: str) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def prepare(url: str, count: int) -> None:
    async with await connect(url) as conn:
        queries = Queries(PsycopgDriver(conn))
        await queries.install()
        await queries.enqueue([ENTRYPOINT] * count, [None] * count, [0] * count)


def consumer(conn: psycopg.AsyncConnection) -> PgQueuer:
    pgq = PgQueuer.from_psycopg_connection(conn)

    @pgq.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        return None

    return pgq


async def work(url: str, consumers: int, batch: int) -> None:
    pgqs = [consumer(await connect(url)) for _ in range(consumers)]
    go = asyncio.Event()

    def stop() -> None:
        for pgq in pgqs:
            pgq.shutdown.set()
        go.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGTERM, stop)
    print("ready", flush=True)
    await go.wait()
    if not pgqs[0].shutdown.is_set():
        await asyncio.gather(*(pgq.run(batch_size=batch) for pgq in pgqs))


def main() -> None:
    parser, serve = peer_cli.parser("python -m bench.peer_pgqueuer",
                                    prepare="install the schema, enqueue no-op jobs",
                                    work="consume until SIGTERM, from SIGUSR1 on")
    serve.add_argument("--consumers", type=int, default=5)
    serve.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()
    if args.command == "prepare":
        uvloop.run(prepare(args.url, args.count))
    else:
        uvloop.run(work(args.url, args.consumers, args.batch))


if __name__ == "__main__":
    main()
