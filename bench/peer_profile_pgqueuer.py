"""PgQueuer under the production profile (``bench/profile.py``), run with the
python of PgQueuer's own virtualenv (PgQueuer, psycopg and the standard
library only).

How close it comes: PgQueuer has no queues; a job's entrypoint is what picks
its handler and its limit, so each of the profile's queues is an entrypoint
of that name (``q50``, ``q20``, ``q10``, ``q4``, ``q2``) whose handler runs
the job's kind (no-op, or an ``asyncio.sleep`` of ``ms``). PgQueuer's
``concurrency_limit`` is counted in the database across every worker, where
belay's queue limit is per process, so each entrypoint's limit is the queue's
limit times the number of worker processes: the same slots in all. PgQueuer
1.6.0 has neither partitions nor rate limits, so ``q20`` and ``q10`` are plain
limits here. Each process runs 5 PgQueuer instances of one connection each,
``batch_size`` 100 (the best configuration of the peers benchmark).

With those limits PgQueuer drained this profile's backlog at about 130 jobs/s
with the machine nearly idle, whatever the instances, batch size or
``dequeue_timeout`` (tried on 2 processes: 5 instances with batch 100, 1 with
batch 10, a 0.5 s and a 0.1 s timeout: 37 to 131 jobs/s). Its log shows why
in shape, if not in code: the jobs were picked in rounds of 84 to 86, every
limit full, about one round a second. ``work --no-limits`` runs the same
without any ``concurrency_limit`` (an instance takes what its batch allows):
PgQueuer's fast path (2,137 jobs/s in the same trial), reported beside it.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import psycopg
import uvloop
from pgqueuer import Job, PgQueuer, PsycopgDriver, Queries

from bench import peer_produce
from bench.profile_mix import WEIGHTS, backlog

CONSUMERS, BATCH = 5, 100


async def connect(url: str) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


def _payload(spec: dict[str, Any]) -> bytes:
    return json.dumps({"kind": spec["kind"], **spec["input"]}).encode()


async def install(url: str) -> None:
    async with await connect(url) as conn:
        await Queries(PsycopgDriver(conn)).install()


async def enqueue(url: str, count: int, seed: int) -> None:
    specs = backlog(count, seed)
    async with await connect(url) as conn:
        await Queries(PsycopgDriver(conn)).enqueue(
            [s["queue"] for s in specs], [_payload(s) for s in specs], [0] * len(specs))


async def run_job(job: Job) -> None:
    payload = json.loads(job.payload or b"{}")
    if payload.get("kind") == "sleep":
        await asyncio.sleep(float(payload.get("ms", 0)) / 1000)


def consumer(conn: psycopg.AsyncConnection, procs: int, limits: bool) -> PgQueuer:
    pgq = PgQueuer.from_psycopg_connection(conn)
    for name, limit in WEIGHTS.items():
        pgq.entrypoint(name, concurrency_limit=limit * procs if limits else 0)(run_job)
    return pgq


async def work(url: str, procs: int, limits: bool) -> None:
    pgqs = [consumer(await connect(url), procs, limits) for _ in range(CONSUMERS)]
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
        await asyncio.gather(*(pgq.run(batch_size=BATCH) for pgq in pgqs))


async def produce(url: str, rate: float, seconds: float, tasks: int, seed: int) -> None:
    conns = [await connect(url) for _ in range(tasks)]

    def sender(conn: psycopg.AsyncConnection) -> peer_produce.Send:
        queries = Queries(PsycopgDriver(conn))

        async def send(spec: dict[str, Any]) -> None:
            await queries.enqueue(spec["queue"], _payload(spec))

        return send

    try:
        await peer_produce.produce([sender(c) for c in conns], rate, seconds, seed)
    finally:
        for conn in conns:
            await conn.close()


def main() -> None:
    parser, serve = peer_produce.parser("python -m bench.peer_profile_pgqueuer")
    serve.add_argument("--no-limits", action="store_true",
                       help="no concurrency_limit on the entrypoints")
    args = parser.parse_args()
    if args.command == "install":
        uvloop.run(install(args.url))
    elif args.command == "enqueue":
        uvloop.run(enqueue(args.url, args.count, args.seed))
    elif args.command == "work":
        uvloop.run(work(args.url, args.procs, not args.no_limits))
    else:
        uvloop.run(produce(args.url, args.rate, args.seconds, args.tasks, args.seed))


if __name__ == "__main__":
    main()
