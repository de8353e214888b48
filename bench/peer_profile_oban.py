"""Oban for Python under the production profile (``bench/profile.py``), run
with the python of Oban's own virtualenv (Oban, what it installs, and the
standard library only).

How close it comes: the profile's five queues are Oban queues of the same
local limits (``q50`` 50, ``q20`` 20, ``q10`` 10, ``q4`` 4, ``q2`` 2: Oban's
limit is per node, as belay's is per process). Oban's global limits,
partitions and rate limits are Oban Pro's, not the open-source package's, so
``q20`` and ``q10`` are plain limits here. Two workers, ``Noop`` and ``Sleep``
(an ``asyncio.sleep`` of ``ms``), put in each job's queue with ``new(...,
queue=...)``. Everything else is Oban's default, as ``oban start`` runs it
(uvloop, orjson): a pool of at most 10 connections, the Postgres notifier
(an insert notifies the queue), the pruner (completed, cancelled and
discarded jobs older than a day, on the leader). Enqueueing is
``Oban.enqueue`` (one call per job in the open loop; each producer task holds
an Oban client on a one-connection pool) and ``enqueue_many`` for the backlog.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import orjson
import uvloop
from oban import Oban, worker  # type: ignore[import-not-found]
from oban.schema import install as install_schema  # type: ignore[import-not-found]
from psycopg.types.json import set_json_dumps, set_json_loads

from bench import peer_produce
from bench.profile_mix import WEIGHTS, backlog


@worker(queue="q50")
class Noop:
    async def process(self, job: Any) -> None:
        return None


@worker(queue="q50")
class Sleep:
    async def process(self, job: Any) -> None:
        await asyncio.sleep(float(job.args.get("ms", 0)) / 1000)


def _job(spec: dict[str, Any]) -> Any:
    kind: Any = Sleep if spec["kind"] == "sleep" else Noop
    return kind.new(spec["input"], queue=spec["queue"])


def _json() -> None:
    set_json_dumps(orjson.dumps)
    set_json_loads(orjson.loads)


async def install(url: str) -> None:
    pool = await Oban.create_pool(url, min_size=1, max_size=1)
    try:
        await install_schema(pool)
    finally:
        await pool.close()


async def enqueue(url: str, count: int, seed: int) -> None:
    _json()
    pool = await Oban.create_pool(url, min_size=1, max_size=1)
    try:
        client = Oban(pool=pool)  # no queues: a client that only enqueues
        await client.enqueue_many(_job(spec) for spec in backlog(count, seed))
    finally:
        await pool.close()


async def work(url: str) -> None:
    _json()
    go, stop = asyncio.Event(), asyncio.Event()

    def terminate() -> None:
        stop.set()
        go.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGTERM, terminate)
    node = f"{socket.gethostname()}.{os.getpid()}"
    pool = await Oban.create_pool(url)
    queues = {name: {"limit": limit, "paused": True} for name, limit in WEIGHTS.items()}
    oban = Oban(pool=pool, node=node, queues=queues)
    try:
        async with oban:
            print("ready", flush=True)
            await go.wait()
            if not stop.is_set():
                for name in WEIGHTS:
                    await oban.resume_queue(name, node=node)
            await stop.wait()
    finally:
        await pool.close()


async def produce(url: str, rate: float, seconds: float, tasks: int, seed: int) -> None:
    _json()
    pools = [await Oban.create_pool(url, min_size=1, max_size=1) for _ in range(tasks)]

    def sender(pool: Any) -> peer_produce.Send:
        client = Oban(pool=pool)

        async def send(spec: dict[str, Any]) -> None:
            await client.enqueue(_job(spec))

        return send

    try:
        await peer_produce.produce([sender(p) for p in pools], rate, seconds, seed)
    finally:
        for pool in pools:
            await pool.close()


def main() -> None:
    parser, _ = peer_produce.parser("python -m bench.peer_profile_oban")
    args = parser.parse_args()
    if args.command == "install":
        uvloop.run(install(args.url))
    elif args.command == "enqueue":
        uvloop.run(enqueue(args.url, args.count, args.seed))
    elif args.command == "work":
        uvloop.run(work(args.url))
    else:
        uvloop.run(produce(args.url, args.rate, args.seconds, args.tasks, args.seed))


if __name__ == "__main__":
    # Oban names a worker by its module: run the importable twin of this
    # module, so the jobs say bench.peer_profile_oban.Noop, not __main__.Noop.
    from bench import peer_profile_oban

    peer_profile_oban.main()
