"""Oban for Python's side of the peer benchmark, run with the python of Oban's
own virtualenv (Python 3.12 or newer, as Oban requires; belay is not installed
there, so this imports Oban, what Oban itself installs (psycopg, uvloop,
orjson) and the standard library only).

``prepare --url U --count N`` installs Oban's schema (``oban.schema.install``,
what ``oban install`` runs: the ``oban_jobs`` table Oban for Elixir shares) and
enqueues N no-op jobs with one ``enqueue_many`` call, in one transaction.
``work --url U --limit L [--pool P] [--debounce S]`` runs Oban embedded, set up
as ``oban start`` sets itself up (uvloop, orjson for JSON), with the one queue
at limit L over a connection pool of at most P (Oban's default 10); it starts
Oban with the queue paused, prints ``ready``, and resumes the queue on SIGUSR1,
so all processes start together. SIGTERM stops Oban gracefully. Each process
has a node name of its own (hostname and pid, Oban's default), which Oban asks
of every running instance.

Why the best configuration is limit 500: in Oban's docs (oban.pro/docs/py),
"Defining Queues" makes a queue's limit its concurrency, counted per node and
with no upper bound, and its examples run ``default = 10`` (the limit a queue
also gets when none is given); "Ready for Production", section "Sizing the
Connection Pool", says a high limit does not hold that many connections (jobs
borrow one only to fetch or acknowledge) and keeps the default pool of 10 for
most deployments; the one other queue option, ``debounce_interval`` ("Advanced
Queue Options", default 5 ms), is a cooldown between fetches. In the code, a
producer fetches up to its free slots in one statement and acknowledges the
jobs finished since its last fetch in one transaction, so a higher limit means
fewer, larger fetches and ack transactions. Tried with 2 processes and 20,000
jobs on the shared 2-core machine (runs varied 2 to 4 times with the load of
other work): limits 10, 50, 100, 200, 500 and 1000, and limits 100 and 200
each with a pool of 20 and with a 1 ms debounce. Limit 500 won each of three
alternating rounds against 100 and 200 (3,519 vs 2,629 and 2,350 jobs/s; 5,580
vs 2,017 and 2,190; 6,293 vs 5,366 and 5,825) and had the best median over all
rounds; 1000 did no better (4,925 against 500's 5,322 in the same quiet round).
A pool of 20 or a 1 ms debounce gave no steady gain: at limit 200 in that quiet
round both were slower than the defaults (5,919 and 5,224 against 6,944), at
limit 100 they went either way from round to round.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import orjson
import uvloop
from oban import Oban, worker  # type: ignore[import-not-found]
from oban.schema import install  # type: ignore[import-not-found]
from psycopg.types.json import set_json_dumps, set_json_loads

from bench import peer_cli

QUEUE = "bench"


@worker(queue=QUEUE)
class Noop:
    async def process(self, job: object) -> None:
        return None


async def prepare(url: str, count: int) -> None:
    pool = await Oban.create_pool(url, min_size=1, max_size=1)
    try:
        await install(pool)
        client = Oban(pool=pool)  # no queues: a client that only enqueues
        await client.enqueue_many(Noop.new() for _ in range(count))  # type: ignore[attr-defined]
    finally:
        await pool.close()


async def work(url: str, limit: int, pool_size: int, debounce: float) -> None:
    set_json_dumps(orjson.dumps)
    set_json_loads(orjson.loads)
    go, stop = asyncio.Event(), asyncio.Event()

    def terminate() -> None:
        stop.set()
        go.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGTERM, terminate)
    node = f"{socket.gethostname()}.{os.getpid()}"
    pool = await Oban.create_pool(url, max_size=pool_size)
    queue = {"limit": limit, "paused": True, "debounce_interval": debounce}
    oban = Oban(pool=pool, node=node, queues={QUEUE: queue})
    try:
        async with oban:
            print("ready", flush=True)
            await go.wait()
            if not stop.is_set():
                await oban.resume_queue(QUEUE, node=node)
            await stop.wait()
    finally:
        await pool.close()


def main() -> None:
    parser, serve = peer_cli.parser("python -m bench.peer_oban",
                                    prepare="install the schema, enqueue no-op jobs",
                                    work="run the queue until SIGTERM, from SIGUSR1 on")
    serve.add_argument("--limit", type=int, default=10, help="the queue's limit (Oban's: 10)")
    serve.add_argument("--pool", type=int, default=10,
                       help="the connection pool's max_size (Oban's default: 10)")
    serve.add_argument("--debounce", type=float, default=0.005,
                       help="the queue's debounce_interval, s (Oban's default: 0.005)")
    args = parser.parse_args()
    if args.command == "prepare":
        uvloop.run(prepare(args.url, args.count))
    else:
        uvloop.run(work(args.url, args.limit, args.pool, args.debounce))


if __name__ == "__main__":
    # Oban names a worker by its module: run the importable twin of this
    # module, so the jobs say bench.peer_oban.Noop rather than __main__.Noop.
    from bench import peer_oban

    peer_oban.main()
