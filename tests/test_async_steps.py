"""Steps from async code (``ctx.astep``), costs known from a step's value, and
``belay.current_context()`` — what the agent-framework integrations stand on (issue 12).

Jobs run through ``belay.testing.drain``; the step functions count their calls, so
"replayed without running" is a count. The event-loop test holds a real row lock
from another connection so a journal write really waits on the database.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

import belay
import belay.testing
from belay.context import Context, Execution
from tests.helpers import Conn, job_row, running_job, wait_until


def drain(client: belay.Belay, registry: belay.Registry) -> dict[str, int]:
    return belay.testing.drain(client=client, registry=registry)


@pytest.fixture
def registry() -> belay.Registry:
    return belay.Registry()


@pytest.fixture
def ctx(client: belay.Belay, sql_conn: Conn) -> Context:
    job = client.get_job(running_job(sql_conn))
    assert job is not None
    return Context(Execution(job, None, None), client)


def journal(conn: Conn, job_id: int) -> list[tuple[str, int]]:
    return [(name, tokens) for name, tokens in conn.execute(
        "SELECT name, tokens FROM belay_steps WHERE job_id = %s ORDER BY seq", (job_id,))]


# -- astep ---------------------------------------------------------------------------------


def test_astep_journals_once_and_replays_without_awaiting_fn(client, registry, sql_conn):
    calls: list[str] = []

    async def call_model(prompt: str) -> dict[str, Any]:
        calls.append(prompt)
        await asyncio.sleep(0)  # a real suspension point
        return {"answer": prompt.upper(), "tokens": 42}

    @belay.worker(name="a.chat", registry=registry, backoff=lambda attempt: 0)
    def chat(ctx: belay.Context) -> Any:
        async def main() -> Any:
            first = await ctx.astep("turn-1", lambda: call_model("hi"),
                                    cost=lambda v: belay.Cost(tokens=v["tokens"]))
            if ctx.attempt == 1:
                raise ConnectionError("crash after turn 1")
            second = await ctx.astep("turn-2", lambda: call_model("bye"), cost={"usd": 0.5})
            return [first["answer"], second["answer"]]
        return asyncio.run(main())

    job = client.enqueue("a.chat")
    assert drain(client, registry) == {"retry": 1, "succeeded": 1}
    assert client.get_job(job.id).result == ["HI", "BYE"]
    assert calls == ["hi", "bye"]  # turn 1 was not awaited again on attempt 2
    assert journal(sql_conn, job.id) == [("turn-1", 42), ("turn-2", 0)]
    row = job_row(sql_conn, job.id)
    assert (row["spent_tokens"], row["spent_usd_micros"]) == (42, 500_000)


def test_concurrent_asteps_overlap_and_the_loop_runs_while_a_write_waits(
        client, registry, db_url, sql_conn):
    """Twenty asteps are in flight at once, and while one's journal write waits on a
    row lock held elsewhere, another task of the same loop still runs: the database
    round trips are off the event loop."""
    release = threading.Event()
    locked = threading.Event()
    seen: dict[str, Any] = {}

    def hold_job_row(job_id: int) -> None:
        with psycopg.connect(db_url) as conn:  # a transaction: the lock lives until commit
            conn.execute("SELECT 1 FROM belay_jobs WHERE id = %s FOR UPDATE", (job_id,))
            locked.set()
            assert release.wait(15), "the event loop never got to release the lock"

    def a_write_waits_on_the_lock() -> bool:
        row = sql_conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE '%belay_steps%'").fetchone()
        return bool(row and row[0] >= 1)

    @belay.worker(name="a.fan", registry=registry)
    def fan(ctx: belay.Context) -> Any:
        holder = threading.Thread(target=hold_job_row, args=(ctx.id,), name="row-lock-holder")

        async def main() -> Any:
            in_flight = 0
            everyone = asyncio.Event()

            async def part(n: int) -> int:
                nonlocal in_flight
                in_flight += 1
                if in_flight == 20:
                    everyone.set()
                await asyncio.wait_for(everyone.wait(), timeout=10)
                return n * n

            holder.start()
            await asyncio.to_thread(locked.wait, 10)
            # The journal writes of these twenty wait on the row lock held elsewhere.
            parts = [asyncio.ensure_future(ctx.astep(f"part-{n}", lambda n=n: part(n)))
                     for n in range(20)]
            await asyncio.wait_for(everyone.wait(), timeout=10)
            # On a thread of its own: the journal writes blocked on the lock may
            # hold every thread of the loop's default executor (asyncio.to_thread's).
            with ThreadPoolExecutor(1, thread_name_prefix="lock-watch") as watch:
                await asyncio.get_running_loop().run_in_executor(
                    watch, wait_until, a_write_waits_on_the_lock,
                    "a journal write waits on the row lock")
            seen["loop_ran_while_blocked"] = True  # this task ran: the loop is free
            release.set()
            values = await asyncio.gather(*parts)
            await asyncio.to_thread(holder.join, 10)
            return values

        return asyncio.run(main())

    job = client.enqueue("a.fan")
    assert drain(client, registry) == {"succeeded": 1}
    assert client.get_job(job.id).result == [n * n for n in range(20)]
    assert seen == {"loop_ran_while_blocked": True}
    assert sorted(name for name, _ in journal(sql_conn, job.id)) == \
        sorted(f"part-{n}" for n in range(20))


def test_jobs_on_worker_threads_each_run_their_own_event_loop(client, registry, sql_conn):
    @belay.worker(name="a.loop", registry=registry)
    def loop_job(ctx: belay.Context) -> Any:
        async def main() -> Any:
            got = await asyncio.gather(*(ctx.astep(f"s{n}", lambda n=n: asyncio.sleep(0, n))
                                         for n in range(5)))
            return {"values": got, "thread": threading.get_ident()}
        return asyncio.run(main())

    ids = [client.enqueue("a.loop", queue="loops").id for _ in range(8)]
    worker = belay.Worker({"loops": 4}, client=client, registry=registry, poll_interval=0.05)
    with worker:
        wait_until(lambda: all(client.get_job(i).state == "succeeded" for i in ids),
                   "eight async jobs finished on four threads", timeout=20)
    results = [client.get_job(i).result for i in ids]
    assert all(r["values"] == [0, 1, 2, 3, 4] for r in results)
    assert len({r["thread"] for r in results}) > 1  # they really ran on several threads


def test_asteps_do_not_nest_but_siblings_may_run_together(ctx, sql_conn):
    async def nested() -> Any:
        async def outer() -> str:
            await ctx.astep("inner", lambda: asyncio.sleep(0, "x"))
            return "outer"
        return await ctx.astep("outer", outer)

    with pytest.raises(belay.ValidationError, match="inside another step"):
        asyncio.run(nested())

    async def sync_inside() -> Any:
        async def outer() -> str:
            ctx.step("inner", lambda: "x")
            return "outer"
        return await ctx.astep("outer", outer)

    with pytest.raises(belay.ValidationError, match="inside another step"):
        asyncio.run(sync_inside())
    assert journal(sql_conn, ctx.id) == []

    async def siblings() -> Any:
        return await asyncio.gather(ctx.astep("a", lambda: asyncio.sleep(0, 1)),
                                    ctx.astep("b", lambda: asyncio.sleep(0, 2)))

    assert asyncio.run(siblings()) == [1, 2]
    with pytest.raises(belay.ValidationError, match="reserved"):
        asyncio.run(ctx.astep("$mine", lambda: asyncio.sleep(0, 1)))


# -- costs from the value --------------------------------------------------------------------


def test_a_cost_function_prices_the_value_and_a_crossing_fails_the_job(client, registry):
    @belay.worker(name="a.priced", registry=registry)
    def priced(ctx: belay.Context) -> None:
        for n in range(5):
            ctx.step(f"call-{n}", lambda: {"usage": 40},
                     cost=lambda reply: {"tokens": reply["usage"], "usd": 0.01})

    job = client.enqueue("a.priced", budget={"tokens": 100})
    drain(client, registry)
    failed = client.get_job(job.id)
    assert failed.state == "failed" and failed.errors[-1]["error"] == "budget_exceeded"
    assert (failed.spent_tokens, len(client.steps(job.id))) == (120, 3)


@pytest.mark.parametrize(("cost", "message"), [
    (lambda value: value["missing"], "KeyError"),
    (lambda value: "cheap", "belay.Cost or a dict"),
    (lambda value: {"tokens": -1}, "integer from 0"),
])
def test_a_failing_cost_function_fails_the_job_at_once_and_journals_nothing(
        client, registry, sql_conn, cost, message):
    calls: list[int] = []

    @belay.worker(name="a.badcost", registry=registry, max_attempts=5)
    def badcost(ctx: belay.Context) -> None:
        ctx.step("paid", lambda: calls.append(1) or {"ok": True}, cost=cost)

    job = client.enqueue("a.badcost")
    assert drain(client, registry) == {"failed": 1}
    row = client.get_job(job.id)
    assert row.attempt == 1 and calls == [1]
    assert "cost function of step 'paid' failed" in row.errors[-1]["error"]
    assert message in row.errors[-1]["error"]
    assert journal(sql_conn, job.id) == []


# -- current_context -----------------------------------------------------------------------


def test_current_context_is_the_running_job_in_tasks_and_copied_threads(client, registry):
    seen: dict[str, Any] = {}

    @belay.worker(name="a.where", registry=registry)
    def where(ctx: belay.Context) -> None:
        seen["direct"] = belay.current_context() is ctx

        async def task() -> bool:
            return belay.current_context() is ctx

        seen["task"] = asyncio.run(task())
        copied = contextvars.copy_context()
        out: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: out.update(copied=copied.run(belay.current_context) is ctx,
                                      plain=belay.current_context()), name="probe")
        thread.start()
        thread.join(10)
        seen.update(out)

    assert belay.current_context() is None
    client.enqueue("a.where")
    assert drain(client, registry) == {"succeeded": 1}
    assert seen == {"direct": True, "task": True, "copied": True, "plain": None}
    assert belay.current_context() is None  # reset after the job


def test_replay_serves_asteps_from_the_journal(client, registry):
    from belay import replay

    calls: list[int] = []

    async def paid() -> int:
        calls.append(1)
        return 7

    @belay.worker(name="a.replayed", registry=registry)
    def replayed(ctx: belay.Context) -> Any:
        assert belay.current_context() is ctx
        return asyncio.run(ctx.astep("paid", paid)) * 6

    job = client.enqueue("a.replayed")
    assert drain(client, registry) == {"succeeded": 1}
    report = replay.dry_run(client, job.id, registry=registry)
    assert (report.outcome, report.diverged, report.value, calls) == ("ok", False, 42, [1])
