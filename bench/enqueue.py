"""Enqueue rates: belay's ``enqueue`` and ``enqueue_many`` against the plain
INSERT (and COPY) an application could write itself, same columns, same run.

belay adds validation and a wake-up ``pg_notify`` (in the same statement
for a single job; a large batch goes by COPY, its ids drawn first); the
ratio is what those cost. Each belay client is built as a user would
(``belay.Belay(url)``, notify on).

The asyncio rows put :mod:`belay.aio` beside raw async psycopg (an
``AsyncConnection`` per task, the same single-row INSERT) and beside the
blocking client, in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import orjson
import psycopg
from psycopg_pool import AsyncConnectionPool

import belay
from belay.aio import AsyncBelay
from bench.core import Bench, Figure

SECTION = "enqueue"
THREADS = 8
BATCH = 1_000
#: Rows each thread enqueues untimed first (pool, prepared statements).
WARM = 5

#: Every column belay's insert_jobs gives a new plain job a non-NULL value.
COLUMNS = ("kind, queue, state, input, meta, priority, attempt, max_attempts, ready_at, "
           "wf_deps, wf_ignore, spent_usd_micros, spent_tokens, errors, cancel_requested, "
           "inserted_at")
INSERT_ONE = f"""
INSERT INTO belay_jobs ({COLUMNS})
VALUES ('noop', 'default', 'ready', %s::jsonb, '{{}}', 0, 0, 20, %s, '{{}}', '{{}}', 0, 0, '[]',
        false, %s)
RETURNING id
"""
INSERT_MANY = f"""
INSERT INTO belay_jobs ({COLUMNS})
SELECT 'noop', 'default', 'ready', i, '{{}}', 0, 0, 20, %(now)s, '{{}}', '{{}}', 0, 0, '[]',
       false, %(now)s
FROM unnest(%(inputs)s::text[]::jsonb[]) AS i
RETURNING id
"""
COPY = f"COPY belay_jobs ({COLUMNS}) FROM STDIN"

#: body(thread index, rows it inserts, ready) sets up, calls ready(), then inserts.
Body = Callable[[int, range, Callable[[], object]], None]
#: A body for (database URL, thread count), its resources closed by the exit stack.
Maker = Callable[[str, int, contextlib.ExitStack], Body]


def _input(n: int) -> str:
    return orjson.dumps({"i": n}).decode()


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _timed(threads: int, rows: int, body: Body) -> float:
    """Seconds for ``threads`` threads to insert ``rows`` between them, counted
    from the moment all of them are set up."""
    gate = threading.Barrier(threads + 1)
    share = rows // threads

    def target(index: int) -> None:
        try:
            body(index, range(index * share, (index + 1) * share), gate.wait)
        except BaseException:
            gate.abort()
            raise

    with ThreadPoolExecutor(threads, thread_name_prefix="bench-enqueue") as pool:
        futures = [pool.submit(target, i) for i in range(threads)]
        try:
            gate.wait()
        except threading.BrokenBarrierError:
            for future in futures:
                future.result()
            raise
        started = time.monotonic()
        for future in futures:
            future.result()
    return time.monotonic() - started


def _rate(bench: Bench, tag: str, threads: int, rows: int, make: Maker) -> float:
    """rows/s on a fresh database, after an untimed warm-up round."""
    with bench.database(f"enq_{tag}") as url, contextlib.ExitStack() as stack:
        run = make(url, threads, stack)
        _timed(threads, WARM * threads, run)
        elapsed = _timed(threads, rows, run)
    rate = rows // threads * threads / elapsed
    bench.log(f"enqueue {tag}: {rate:,.0f} rows/s")
    return rate


# -- belay --------------------------------------------------------------------------


def _belay_single(url: str, threads: int, stack: contextlib.ExitStack) -> Body:
    client = stack.enter_context(belay.Belay(url, min_pool_size=threads, max_pool_size=threads))

    def body(index: int, rows: range, ready: Callable[[], object]) -> None:
        ready()
        for n in rows:
            client.enqueue("noop", {"i": n})

    return body


def _belay_many(url: str, threads: int, stack: contextlib.ExitStack) -> Body:
    client = stack.enter_context(belay.Belay(url, max_pool_size=threads))

    def body(index: int, rows: range, ready: Callable[[], object]) -> None:
        ready()
        for start in range(rows.start, rows.stop, BATCH):
            client.enqueue_many([{"kind": "noop", "input": {"i": n}}
                                 for n in range(start, min(start + BATCH, rows.stop))])

    return body


# -- raw psycopg ------------------------------------------------------------------------


def _raw_single(url: str, threads: int, stack: contextlib.ExitStack) -> Body:
    def body(index: int, rows: range, ready: Callable[[], object]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            ready()
            for n in rows:
                now = _now()
                conn.execute(INSERT_ONE, (_input(n), now, now)).fetchone()

    return body


def _raw_many(url: str, threads: int, stack: contextlib.ExitStack) -> Body:
    def body(index: int, rows: range, ready: Callable[[], object]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            ready()
            for start in range(rows.start, rows.stop, BATCH):
                inputs = [_input(n) for n in range(start, min(start + BATCH, rows.stop))]
                conn.execute(INSERT_MANY, {"inputs": inputs, "now": _now()}).fetchall()

    return body


def _raw_copy(url: str, threads: int, stack: contextlib.ExitStack) -> Body:
    def body(index: int, rows: range, ready: Callable[[], object]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            ready()
            for start in range(rows.start, rows.stop, BATCH):
                now = _now()
                with conn.cursor() as cur, cur.copy(COPY) as copy:
                    for n in range(start, min(start + BATCH, rows.stop)):
                        copy.write_row(("noop", "default", "ready", _input(n), "{}", 0, 0, 20,
                                        now, "{}", "{}", 0, 0, "[]", False, now))

    return body


# -- asyncio: belay.aio against raw async psycopg ----------------------------------------

#: async body(rows it inserts): one task's inserts, on what ``make`` set up.
AsyncBody = Callable[[range], Awaitable[None]]
AsyncMaker = Callable[[str, int, contextlib.AsyncExitStack], Awaitable[AsyncBody]]


def _async_rate(bench: Bench, tag: str, tasks: int, rows: int, make: AsyncMaker) -> float:
    """rows/s of ``tasks`` concurrent tasks on one event loop, on a fresh
    database, after an untimed warm-up round."""
    share = rows // tasks

    async def main(url: str) -> float:
        async with contextlib.AsyncExitStack() as stack:
            body = await make(url, tasks, stack)
            await asyncio.gather(*(body(range(i * WARM, (i + 1) * WARM)) for i in range(tasks)))
            started = time.monotonic()
            await asyncio.gather(*(body(range(i * share, (i + 1) * share))
                                   for i in range(tasks)))
            return time.monotonic() - started

    with bench.database(f"enq_{tag}") as url:
        elapsed = asyncio.run(main(url))
    rate = share * tasks / elapsed
    bench.log(f"enqueue {tag}: {rate:,.0f} rows/s")
    return rate


async def _aio_single(url: str, tasks: int, stack: contextlib.AsyncExitStack) -> AsyncBody:
    client = await stack.enter_async_context(
        AsyncBelay(url, min_pool_size=tasks, max_pool_size=tasks))

    async def body(rows: range) -> None:
        for n in rows:
            await client.enqueue("noop", {"i": n})

    return body


async def _raw_async_single(url: str, tasks: int, stack: contextlib.AsyncExitStack
                            ) -> AsyncBody:
    idle = [await stack.enter_async_context(
        await psycopg.AsyncConnection.connect(url, autocommit=True)) for _ in range(tasks)]

    async def body(rows: range) -> None:
        conn = idle.pop()
        try:
            for n in rows:
                now = _now()
                await (await conn.execute(INSERT_ONE, (_input(n), now, now))).fetchone()
        finally:
            idle.append(conn)

    return body


async def _raw_async_pooled(url: str, tasks: int, stack: contextlib.AsyncExitStack
                            ) -> AsyncBody:
    """The same INSERT, each one on a connection borrowed from a psycopg_pool
    AsyncConnectionPool, as an app's request handlers would."""
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        url, min_size=tasks, max_size=tasks, open=False, kwargs={"autocommit": True})
    await stack.enter_async_context(pool)
    await pool.wait()

    async def body(rows: range) -> None:
        for n in rows:
            now = _now()
            async with pool.connection() as conn:
                await (await conn.execute(INSERT_ONE, (_input(n), now, now))).fetchone()

    return body


def run(bench: Bench) -> list[Figure]:
    single = bench.size(500, 5_000)
    batched = bench.size(10_000, 200_000)
    rates: dict[str, float] = {
        "belay_seq": _rate(bench, "belay_seq", 1, single, _belay_single),
        "raw_seq": _rate(bench, "raw_seq", 1, single, _raw_single),
        "belay_threads": _rate(bench, "belay_threads", THREADS, single, _belay_single),
        "raw_threads": _rate(bench, "raw_threads", THREADS, single, _raw_single),
        "belay_many": _rate(bench, "belay_many", 1, batched, _belay_many),
        "raw_many": _rate(bench, "raw_many", 1, batched, _raw_many),
        "raw_copy": _rate(bench, "raw_copy", 1, batched, _raw_copy),
        "aio_seq": _async_rate(bench, "aio_seq", 1, single, _aio_single),
        "raw_async_seq": _async_rate(bench, "raw_async_seq", 1, single, _raw_async_single),
        "aio_tasks": _async_rate(bench, "aio_tasks", THREADS, single, _aio_single),
        "raw_async_tasks": _async_rate(bench, "raw_async_tasks", THREADS, single,
                                       _raw_async_single),
        "raw_async_pooled": _async_rate(bench, "raw_async_pooled", THREADS, single,
                                        _raw_async_pooled),
    }

    def figure(name: str, key: str, baseline: str, base_key: str, rows: int,
               goal: float | None = None) -> Figure:
        ratio = rates[key] / rates[base_key]
        return Figure(SECTION, name, rates[key], "rows/s", baseline=baseline,
                      baseline_value=rates[base_key], extra={"rows": rows},
                      target=None if goal is None else f"≥ {goal:g}x",
                      met=None if goal is None else ratio >= goal)

    batches = f"{BATCH:,}-row batches"
    return [
        figure("belay enqueue, single rows, sequential", "belay_seq",
               "raw single-row INSERT, sequential", "raw_seq", single, 0.7),
        figure(f"belay enqueue, single rows, {THREADS} threads", "belay_threads",
               f"raw single-row INSERT, {THREADS} threads", "raw_threads", single, 0.7),
        figure(f"belay enqueue_many, {batches}", "belay_many",
               f"raw multi-row INSERT (unnest), {batches}", "raw_many", batched),
        figure(f"belay enqueue_many against COPY, {batches}", "belay_many",
               f"raw COPY, {batches}", "raw_copy", batched, 0.6),
        figure("belay.aio enqueue, single rows, sequential", "aio_seq",
               "raw async psycopg single-row INSERT, sequential", "raw_async_seq", single, 0.7),
        figure(f"belay.aio enqueue, single rows, {THREADS} tasks", "aio_tasks",
               f"raw async psycopg single-row INSERT, {THREADS} tasks on {THREADS} connections",
               "raw_async_tasks", single, 0.7),
        figure(f"belay.aio enqueue, single rows, {THREADS} tasks, against a pooled INSERT",
               "aio_tasks", f"raw async psycopg single-row INSERT, {THREADS} tasks on an "
               f"AsyncConnectionPool of {THREADS}", "raw_async_pooled", single),
        figure("belay.aio enqueue against the blocking client, sequential", "aio_seq",
               "belay enqueue, single rows, sequential", "belay_seq", single),
    ]
