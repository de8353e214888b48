"""A job's authority in the threads it starts (issue 38, finding 2).

Authority travels in the job's context (a ContextVar): a ``threading.Thread``
or a plain ``ThreadPoolExecutor`` the job starts begins without it. Such a
thread must never enqueue unrestricted: while a job with an authority runs in
the process, code with no job context is refused (fail closed), and
``belay.propagate`` / ``belay.ThreadPoolExecutor`` carry the job's context —
and so its bounds — into the threads it starts. Each test runs the job through
the worker's own path (``belay.testing.drain``) on a real PostgreSQL, with
real threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest

import belay
from belay import authority
from belay.parts.service import Service
from tests.test_steps import drain, no_backoff

BOUNDED = {"kinds": ["ok.kind"], "usd": 1}


def in_thread(fn: Callable[[], Any], start: Callable[[Callable[[], Any]], Any] | None = None
              ) -> Any:
    """Run ``fn`` in a new thread (started by ``start``, a plain Thread by
    default) and return what it returned, or the exception it raised."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = (start or (lambda t: threading.Thread(target=t)))(target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the thread did not finish"
    return box[0]


def agent(reg: belay.Registry, body: Callable[[belay.Context], Any]) -> None:
    @belay.worker(name="agent", max_attempts=1, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> Any:
        return body(ctx)

    @belay.worker(name="ok.kind", registry=reg)
    def ok(ctx: belay.Context) -> None:
        return None


def jobs_of(sql_conn: Any, kind: str) -> list[tuple[Any, ...]]:
    return sql_conn.execute(
        "SELECT id, budget_usd_micros, meta FROM belay_jobs WHERE kind = %s ORDER BY id",
        (kind,)).fetchall()


def run_agent(client: belay.Belay, body: Callable[[belay.Context], Any]) -> belay.Job:
    reg = belay.Registry()
    agent(reg, body)
    job = client.enqueue("agent", authority=BOUNDED)
    drain(client, reg)
    finished = client.get_job(job.id)
    assert finished is not None
    return finished


def test_a_plain_thread_a_job_starts_can_not_enqueue_unrestricted(client, sql_conn) -> None:
    seen: dict[str, Any] = {}

    def body(ctx: belay.Context) -> str:
        seen["result"] = in_thread(lambda: client.enqueue("evil.kind",
                                                          budget={"usd": 100}))
        return "done"

    run_agent(client, body)
    refused = seen["result"]
    assert isinstance(refused, belay.AuthorityExceeded), refused
    assert "belay.propagate" in str(refused) and "ThreadPoolExecutor" in str(refused)
    assert jobs_of(sql_conn, "evil.kind") == []


def test_a_plain_thread_pool_task_can_not_enqueue_unrestricted(client, sql_conn) -> None:
    seen: dict[str, Any] = {}

    def body(ctx: belay.Context) -> str:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            future = pool.submit(client.enqueue, "evil.kind", budget={"usd": 100})
            seen["error"] = future.exception(30)
        return "done"

    run_agent(client, body)
    assert isinstance(seen["error"], belay.AuthorityExceeded), seen
    assert jobs_of(sql_conn, "evil.kind") == []


@pytest.mark.parametrize("carry", ["propagate", "executor"])
def test_a_thread_given_the_jobs_context_is_bounded_by_its_authority(client, sql_conn,
                                                                    carry: str) -> None:
    seen: dict[str, Any] = {}

    def body(ctx: belay.Context) -> str:
        def evil() -> Any:
            return client.enqueue("evil.kind")

        def ok() -> Any:
            return client.enqueue("ok.kind", budget={"usd": 0.5}).id

        if carry == "propagate":
            seen["evil"] = in_thread(belay.propagate(evil))
            seen["ok"] = in_thread(belay.propagate(ok))
        else:
            with belay.ThreadPoolExecutor(2) as pool:
                seen["evil"] = pool.submit(evil).exception(30)
                seen["ok"] = pool.submit(ok).result(30)
        return "done"

    job = run_agent(client, body)
    assert job.state == "succeeded", job.errors
    assert isinstance(seen["evil"], belay.AuthorityExceeded)
    assert "worker 'evil.kind' is not allowed" in str(seen["evil"])
    assert jobs_of(sql_conn, "evil.kind") == []
    # The job its thread started carries the authority on, narrowed at most.
    ((child_id, budget_micros, meta),) = jobs_of(sql_conn, "ok.kind")
    assert child_id == seen["ok"] and budget_micros == 500_000
    assert meta["$authority"] == {"kinds": ["ok.kind"], "usd": 1.0}


def test_one_propagated_function_may_run_in_several_threads_at_once(client) -> None:
    seen: list[Any] = []
    barrier = threading.Barrier(3, timeout=30)

    def body(ctx: belay.Context) -> str:
        def where() -> Any:
            barrier.wait()  # all three inside the same wrapped function at once
            current = belay.current_context()
            return None if current is None else current.id

        wrapped = belay.propagate(where)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            seen.extend(f.result(30) for f in [pool.submit(wrapped) for _ in range(3)])
        return "done"

    job = run_agent(client, body)
    assert job.state == "succeeded", job.errors
    assert seen == [job.id] * 3


def test_a_tool_check_in_a_thread_that_lost_the_job_is_refused(client) -> None:
    seen: dict[str, Any] = {}

    def body(ctx: belay.Context) -> str:
        seen["lost"] = in_thread(lambda: authority.check_tool("delete_everything"))
        seen["carried"] = in_thread(belay.propagate(
            lambda: authority.check_tool("delete_everything")))
        return "done"

    run_agent(client, body)
    assert isinstance(seen["lost"], belay.AuthorityExceeded)
    assert "tool call 'delete_everything' refused" in str(seen["lost"])
    # BOUNDED names no tools: any tool is allowed to the job itself.
    assert seen["carried"] is None


def test_run_in_executor_loses_the_context_unless_the_loop_uses_belays_executor(
        client, sql_conn) -> None:
    seen: dict[str, Any] = {}

    def body(ctx: belay.Context) -> str:
        def evil() -> Any:
            return client.enqueue("evil.kind")

        async def main() -> None:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, evil)
            except BaseException as exc:
                seen["default"] = exc
            loop.set_default_executor(belay.ThreadPoolExecutor(2))
            try:
                await loop.run_in_executor(None, evil)
            except BaseException as exc:
                seen["belay"] = exc
            try:  # asyncio.to_thread copies the context by itself
                await asyncio.to_thread(evil)
            except BaseException as exc:
                seen["to_thread"] = exc

        asyncio.run(main())
        return "done"

    run_agent(client, body)
    assert "outside any job's context" in str(seen["default"])
    assert "worker 'evil.kind' is not allowed" in str(seen["belay"])
    assert "worker 'evil.kind' is not allowed" in str(seen["to_thread"])
    assert jobs_of(sql_conn, "evil.kind") == []


def test_outside_jobs_with_an_authority_a_thread_enqueues_as_before(client, sql_conn) -> None:
    # No job running at all.
    assert isinstance(in_thread(lambda: client.enqueue("free.kind")), belay.Job)

    # A job without an authority running: nothing is bounded, nothing refused.
    reg = belay.Registry()
    agent(reg, lambda ctx: in_thread(lambda: client.enqueue("free.kind").id))
    job = client.enqueue("agent")
    drain(client, reg)
    done = client.get_job(job.id)
    assert done is not None and done.state == "succeeded", done
    assert len(jobs_of(sql_conn, "free.kind")) == 2


def test_a_job_ending_lifts_the_refusal(client, sql_conn) -> None:
    run_agent(client, lambda ctx: "done")
    assert isinstance(in_thread(lambda: client.enqueue("free.kind")), belay.Job)


def test_another_thread_is_refused_only_while_the_bounded_job_runs(client, sql_conn) -> None:
    """A second, unrelated thread enqueueing while a job with an authority runs
    can't be told apart from one the job started: refused, with the fix named."""
    inside, leave = threading.Event(), threading.Event()

    def body(ctx: belay.Context) -> str:
        inside.set()
        assert leave.wait(30)
        return "done"

    runner = threading.Thread(target=run_agent, args=(client, body))
    runner.start()
    try:
        assert inside.wait(30)
        refused = in_thread(lambda: client.enqueue("free.kind"))
        assert isinstance(refused, belay.AuthorityExceeded)
        assert "job(s)" in str(refused)
    finally:
        leave.set()
        runner.join(30)
    assert isinstance(in_thread(lambda: client.enqueue("free.kind")), belay.Job)


def test_belays_own_threads_enqueue_while_a_bounded_job_runs(client, sql_conn) -> None:
    """A cron tick, say, runs on a service thread of belay's own: not a job's."""
    inside, leave = threading.Event(), threading.Event()
    ticked: list[Any] = []

    def body(ctx: belay.Context) -> str:
        inside.set()
        assert leave.wait(30)
        return "done"

    def tick(service: Service) -> None:
        try:
            ticked.append(client.enqueue("cron.kind"))
        except BaseException as exc:
            ticked.append(exc)
        service.wait(60)

    runner = threading.Thread(target=run_agent, args=(client, body))
    runner.start()
    service = Service("belay-test-tick", tick)
    try:
        assert inside.wait(30)
        service.start()
        deadline = threading.Event()
        for _ in range(300):
            if ticked:
                break
            deadline.wait(0.1)
    finally:
        service.stop()
        service.join(30)
        leave.set()
        runner.join(30)
    assert len(ticked) == 1 and isinstance(ticked[0], belay.Job), ticked


def test_in_a_child_process_a_thread_that_lost_the_job_is_refused_too(
        db_url: str, direct_url: str, sql_conn: Any) -> None:
    """The process pool runs the job in a child process: the same rule holds
    there (the child counts the jobs with an authority it runs)."""
    from tests import pool_jobs

    with belay.Belay(db_url, notify=False, direct_url=direct_url,
                     registry=pool_jobs.REGISTRY) as client:
        job = client.enqueue("pool.threads", authority=BOUNDED)
        with belay.Worker({pool_jobs.QUEUE: 1}, client=client, registry=pool_jobs.REGISTRY,
                          processes=1, lease_ttl=3.0, shutdown_grace=2.0):
            seen = client.await_result(job.id, timeout=60)
    assert seen["plain"].startswith("refused: an enqueue refused"), seen
    assert "worker 'evil.kind' is not allowed" in seen["propagated"], seen
    assert jobs_of(sql_conn, "evil.kind") == []
