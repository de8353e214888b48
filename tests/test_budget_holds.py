"""Money under concurrency (issue 38, finding 1): headroom held before it is spent.

A step's ``max_cost`` reserves that much of the budget's headroom, atomically
in the database, before the step starts; its journal entry settles the hold.
So steps in flight at once — ``astep`` calls in ``asyncio.gather``, steps in
threads — never promise the same money twice, and a fan-out's share of the
budget is held until its charge-back. A run whose spend crossed a cap never
ends ``succeeded``, whatever its code did with the error. Each race here is
real: tasks and threads against a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import belay
from belay import budget
from tests.helpers import job_row, signal_rows
from tests.test_steps import drain, journal, lapse_and_reclaim, no_backoff, spend

FORTY = belay.Cost(usd=0.4)


def holds(sql_conn: Any, job_id: int) -> list[str]:
    return [r["name"] for r in signal_rows(sql_conn)
            if r["scope"] == f"job:{job_id}" and r["name"].startswith("$budget:")
            and not r["name"].startswith("$budget:warn")]


def in_threads(body: Any, count: int) -> None:
    """``body(n)`` in ``count`` threads at once; then, as a job's code would,
    raise what the first of them raised."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            body(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]


def gather_steps(reg: belay.Registry, started: list[int], steps: int = 3) -> Any:
    """A job whose ``steps`` asteps (max_cost and cost $0.40 each) are all
    started together by ``asyncio.gather``: each waits (up to 1 s) until every
    one of them is inside its function, so without holds they all run."""

    @belay.worker(name="gather", max_attempts=1, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> list[int]:
        async def main() -> list[int]:
            all_in = asyncio.Event()

            async def call(n: int) -> int:
                started.append(n)
                if len(started) == steps:
                    all_in.set()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(all_in.wait(), 1)
                return n

            return list(await asyncio.gather(*(
                ctx.astep(f"call-{n}", lambda n=n: call(n), cost=FORTY, max_cost=FORTY)
                for n in range(steps))))

        return asyncio.run(main())

    return job


def test_asteps_in_gather_never_spend_past_the_cap(client, sql_conn) -> None:
    reg, started = belay.Registry(), []
    job = client.enqueue(gather_steps(reg, started), budget={"usd": 0.5})
    assert drain(client, reg) == {"failed": 1}
    row = job_row(sql_conn, job.id)
    # $0.40 held: the other two waited for it, then found $0.10 left.
    assert len(started) == 1, started
    assert spend(sql_conn, job.id) == (400_000, 0)
    error = row["errors"][-1]
    assert (error["error"], error["max_cost_usd_micros"], error["spent_usd_micros"]) == (
        "budget_exceeded", 400_000, 400_000)
    assert holds(sql_conn, job.id) == []


def test_a_step_waits_for_the_steps_in_flight_and_runs_when_they_leave_room(
        client, sql_conn) -> None:
    """Each step may cost up to $0.25 and costs $0.05: two fit at once under
    $0.50, the third waits for one of them to be journaled, then runs. Each
    step stays inside until three are (or 2 s passed): without holds all
    three would be inside at once."""
    reg = belay.Registry()
    inside: list[int] = []
    most = [0]
    lock = threading.Lock()
    quarter, nickel = belay.Cost(usd=0.25), belay.Cost(usd=0.05)

    @belay.worker(name="bounded", max_attempts=1, registry=reg)
    def job(ctx: belay.Context) -> list[int]:
        async def call(n: int) -> int:
            with lock:
                inside.append(n)
                most[0] = max(most[0], len(inside))
            deadline = time.monotonic() + 2
            while most[0] < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            with lock:
                inside.remove(n)
            return n

        async def main() -> list[int]:
            return list(await asyncio.gather(*(
                ctx.astep(f"call-{n}", lambda n=n: call(n), cost=nickel, max_cost=quarter)
                for n in range(3))))

        return asyncio.run(main())

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"succeeded": 1}, job_row(sql_conn, j.id)["errors"]
    assert client.get_job(j.id).result == [0, 1, 2]  # type: ignore[union-attr]
    assert most[0] <= 2  # never a third $0.25 promised beside two
    assert spend(sql_conn, j.id) == (150_000, 0) and holds(sql_conn, j.id) == []


def test_steps_in_threads_never_spend_past_the_cap(client, sql_conn) -> None:
    reg, started = belay.Registry(), []
    barrier = threading.Barrier(2)

    @belay.worker(name="threads", max_attempts=1, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        def call(n: int) -> int:
            started.append(n)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(3)  # both inside their step function at once, without holds
            return n

        in_threads(lambda n: ctx.step(f"call-{n}", lambda: call(n), cost=FORTY,
                                      max_cost=FORTY), 2)
        return "done"

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"failed": 1}
    assert len(started) == 1, started
    assert spend(sql_conn, j.id) == (400_000, 0)
    assert job_row(sql_conn, j.id)["errors"][-1]["error"] == "budget_exceeded"


def test_a_step_refused_for_held_headroom_pauses_and_a_top_up_resumes_paying_once(
        client, sql_conn) -> None:
    reg, started = belay.Registry(), []
    job = client.enqueue(gather_steps(reg, started, steps=2),
                         budget={"usd": 0.5, "on_exceed": "pause"})
    assert drain(client, reg) == {"await": 1}, job_row(sql_conn, job.id)["errors"]
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["await_name"]) == ("awaiting", "$top_up:400000:0")
    assert len(started) == 1
    client.top_up(job.id, usd=0.5)
    assert drain(client, reg) == {"succeeded": 1}
    assert len(started) == 2  # call-0 replayed from the journal, call-1 ran once
    assert sorted(name for _, name, *_ in journal(sql_conn, job.id)) == ["call-0", "call-1"]
    assert spend(sql_conn, job.id) == (800_000, 0)
    assert holds(sql_conn, job.id) == []


def test_a_budget_error_swallowed_in_a_thread_never_ends_succeeded(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="swallow", max_attempts=3, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        def costly() -> None:
            with contextlib.suppress(BaseException):  # the job's code loses the error
                ctx.step("llm", lambda: "answer", cost=belay.Cost(usd=0.8))

        thread = threading.Thread(target=costly)
        thread.start()
        thread.join(30)
        return "done"

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"failed": 1}
    row = job_row(sql_conn, j.id)
    assert row["state"] == "failed" and row["result"] is None
    assert row["errors"][-1]["error"] == "budget_exceeded"
    assert (row["errors"][-1]["spent_usd_micros"], row["attempt"]) == (800_000, 1)


def test_a_run_over_its_cap_at_the_end_pauses_under_on_exceed_pause(client, sql_conn) -> None:
    reg = belay.Registry()
    runs: list[int] = []

    @belay.worker(name="swallow", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        runs.append(ctx.attempt)
        with contextlib.suppress(BaseException):
            ctx.step("llm", lambda: "answer", cost=belay.Cost(usd=0.8))
        return "done"

    j = client.enqueue(job, budget={"usd": 0.5, "on_exceed": "pause"})
    assert drain(client, reg) == {"await": 1}
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["await_name"], row["attempt"]) == ("awaiting", "$top_up", 0)
    client.top_up(j.id, usd=0.5)
    assert drain(client, reg) == {"succeeded": 1}
    assert spend(sql_conn, j.id) == (800_000, 0)  # the step replayed, paid once


def test_spend_that_crossed_the_cap_outside_this_run_fails_the_success(client,
                                                                      sql_conn) -> None:
    """The fence is the row's: whatever put the spend over the cap (another
    run of the job, another implementation), a success is not written."""
    reg = belay.Registry()

    @belay.worker(name="late", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        sql_conn.execute("UPDATE belay_jobs SET spent_usd_micros = 600000 WHERE id = %s",
                         (ctx.id,))
        return "done"

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"failed": 1}
    entry = job_row(sql_conn, j.id)["errors"][-1]
    assert (entry["error"], entry["at_ack"], entry["spent_usd_micros"]) == (
        "budget_exceeded", True, 600_000)


def test_a_success_within_the_cap_is_acked_as_before(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="fits", registry=reg)
    def job(ctx: belay.Context) -> float:
        ctx.step("a", lambda: 1, cost=FORTY, max_cost=FORTY)
        ctx.step("b", lambda: 2, cost=belay.Cost(usd=0.1), max_cost=belay.Cost(usd=0.1))
        return ctx.budget.usd_spent

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"succeeded": 1}
    assert client.get_job(j.id).result == 0.5  # type: ignore[union-attr]
    assert holds(sql_conn, j.id) == []


def test_a_step_that_raises_gives_its_headroom_back(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="retry-inside", registry=reg)
    def job(ctx: belay.Context) -> int:
        def broken() -> int:
            raise ValueError("the model timed out")

        with contextlib.suppress(ValueError):
            ctx.step("first", broken, cost=FORTY, max_cost=FORTY)
        return ctx.step("second", lambda: 2, cost=FORTY, max_cost=FORTY)  # fits again

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"succeeded": 1}
    assert spend(sql_conn, j.id) == (400_000, 0) and holds(sql_conn, j.id) == []


def test_a_hold_left_by_a_crashed_run_is_dead(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="after-crash", registry=reg)
    def job(ctx: belay.Context) -> int:
        return ctx.step("call", lambda: 1, cost=FORTY, max_cost=FORTY)

    j = client.enqueue(job, budget={"usd": 0.5})
    dead = budget.hold_name("0123456789abcdef", "call")  # a run that died holding $0.40
    sql_conn.execute("INSERT INTO belay_signals (scope, name, payload, inserted_at) "
                     "VALUES (%s, %s, %s, now())",
                     (f"job:{j.id}", dead, '{"usd_micros": 400000, "tokens": 0}'))
    assert drain(client, reg) == {"succeeded": 1}
    assert spend(sql_conn, j.id) == (400_000, 0) and holds(sql_conn, j.id) == []


def test_a_run_that_lost_its_job_reserves_nothing(client, sql_conn, clock) -> None:
    reg, calls = belay.Registry(), []

    @belay.worker(name="zombie", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        if ctx.attempt == 1:
            lapse_and_reclaim(client, clock, reg)
            ctx.step("late", lambda: calls.append(1), cost=FORTY, max_cost=FORTY)
        return "done"

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg, max_jobs=1) == {"stale": 1}
    assert calls == [] and journal(sql_conn, j.id) == [] and holds(sql_conn, j.id) == []


def test_concurrent_share_fan_outs_split_the_remainder_between_them(client, sql_conn) -> None:
    reg = belay.Registry()
    barrier = threading.Barrier(2)

    @belay.worker(name="kid", registry=reg)
    def kid(ctx: belay.Context) -> None:
        return None

    @belay.worker(name="tree", backoff=no_backoff, registry=reg)
    def tree(ctx: belay.Context) -> int:
        def fan(n: int) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(3)
            ctx.map_children(f"fan-{n}", "kid", [{}, {}], budget="share")

        in_threads(fan, 2)
        return len(ctx.await_children())

    j = client.enqueue(tree, budget={"usd": 1})
    for _ in range(5):
        if not drain(client, reg):
            break
    row = job_row(sql_conn, j.id)
    assert row["state"] == "succeeded", row["errors"]
    given = [r[0] for r in sql_conn.execute(
        "SELECT budget_usd_micros FROM belay_jobs WHERE parent_id = %s", (j.id,)).fetchall()]
    assert len(given) == 4
    assert sum(given) <= 1_000_000, given  # never the same remainder twice
    assert holds(sql_conn, j.id) == []  # both charge-backs settled their shares


def test_events_a_jobs_threads_append_at_once_each_get_a_number(client, sql_conn) -> None:
    """Steps in threads announce at once (budget warnings, ``emit``): each
    event gets a seq of its own, where two used to pick the same one and one
    append failed with a unique violation."""
    reg = belay.Registry()
    barrier = threading.Barrier(8)

    @belay.worker(name="chatty", max_attempts=1, registry=reg)
    def job(ctx: belay.Context) -> int:
        def emit(n: int) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(5)
            for k in range(5):
                ctx.emit({"thread": n, "k": k})

        in_threads(emit, 8)
        return 40

    j = client.enqueue(job)
    assert drain(client, reg) == {"succeeded": 1}, job_row(sql_conn, j.id)["errors"]
    seqs = [r[0] for r in sql_conn.execute(
        "SELECT seq FROM belay_events WHERE job_id = %s ORDER BY seq", (j.id,)).fetchall()]
    assert seqs == list(range(1, 41))


def test_every_thread_of_a_run_reserves_under_one_name(client) -> None:
    """A run names its holds once, before a thread of the job can reserve: a
    second name for the same run would take the first name's holds for a dead
    run's and drop them, and the steps behind them would overspend (the soak
    caught four $0.20 steps journaled on a $0.50 budget). Eight threads read
    the name at the same instant, in each of many runs."""
    reg, seen = belay.Registry(), []
    threads = 8

    @belay.worker(name="names", max_attempts=1, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> None:
        barrier, names = threading.Barrier(threads), set()

        def read(_: int) -> None:
            barrier.wait(10)
            names.add(ctx.journal.run)

        in_threads(read, threads)
        seen.append(len(names))

    runs = 200
    client.enqueue_many([belay.JobSpec(job) for _ in range(runs)])
    assert drain(client, reg) == {"succeeded": runs}
    assert seen == [1] * runs, f"{sum(n > 1 for n in seen)} of {runs} runs had several names"
