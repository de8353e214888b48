"""belay.aio: the asyncio producer and reader client, on a real PostgreSQL.

Each test runs its coroutine with ``asyncio.run`` (no event-loop plugin) and
checks what the async client wrote with plain SQL or the blocking client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

import belay
import belay.aio
from belay.aio import AsyncBelay
from tests.conftest import POOLED
from tests.helpers import (
    FORGED_RESULT,
    Notifications,
    count_jobs,
    forge_result,
    notify,
    other_sessions,
    running_job,
    wait_until,
)

T = TypeVar("T")


def arun(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())  # type: ignore[arg-type]


def aclient(db_url: str, direct_url: str, **options: Any) -> AsyncBelay:
    # Pooled, LISTEN goes to the server directly, as docs/scaling.md says.
    return AsyncBelay(db_url, direct_url=direct_url if POOLED else None, **options)


def pokes_of(notes: Notifications) -> list[dict[str, Any]]:
    return [m for m in notes.received() if m.get("t") == "p"]


# -- Enqueue -----------------------------------------------------------------------------


def test_enqueue_on_its_own_pool_writes_the_row_the_sync_client_reads(db_url, direct_url,
                                                                         notes):
    async def main() -> belay.Job:
        async with aclient(db_url, direct_url) as client:
            return await client.enqueue("t.send", {"to": "ada"}, queue="mail", priority=3,
                                        meta={"customer": "c1"})

    job = arun(main)
    with belay.Belay(db_url) as sync:
        stored = sync.get_job(job.id)
    assert stored is not None
    assert (stored.kind, stored.queue, stored.state, stored.input, stored.priority,
            stored.meta) == ("t.send", "mail", "ready", {"to": "ada"}, 3, {"customer": "c1"})
    assert (job.kind, job.queue, job.input, job.meta) == (stored.kind, stored.queue,
                                                          stored.input, stored.meta)
    assert {"t": "p", "q": "mail"} in pokes_of(notes)


def test_enqueue_joins_the_callers_transaction(db_url, direct_url, notes):
    class Boom(Exception):
        pass

    async def main() -> int:
        async with aclient(db_url, direct_url) as client, \
                await psycopg.AsyncConnection.connect(db_url) as conn:
            # Rolled back with the caller's own write: no job, no wake-up.
            with pytest.raises(Boom):
                async with conn.transaction():
                    await client.enqueue("t.rolled_back", conn=conn)
                    raise Boom
            assert count_jobs_sync(direct_url) == 0
            # Committed: the job and its wake-up arrive together, at the commit.
            async with conn.transaction():
                job = await client.enqueue("t.kept", queue="q1", conn=conn)
                assert count_jobs_sync(direct_url) == 0  # not visible before commit
            return job.id

    job_id = arun(main)
    with psycopg.connect(direct_url) as conn:
        assert count_jobs(conn) == 1
        assert conn.execute("SELECT id FROM belay_jobs").fetchone() == (job_id,)
    assert pokes_of(notes) == [{"t": "p", "q": "q1"}]


def count_jobs_sync(url: str) -> int:
    with psycopg.connect(url) as conn:
        return count_jobs(conn)


def test_enqueue_many_returns_holders_of_unique_keys_like_the_sync_client(db_url, direct_url):
    async def main() -> list[belay.Job]:
        async with aclient(db_url, direct_url) as client:
            first = await client.enqueue("t.u", {"n": 1}, unique="order-1")
            batch = await client.enqueue_many([
                {"kind": "t.u", "input": {"n": 2}, "unique": "order-1"},
                {"kind": "t.u", "input": {"n": 3}},
                belay.JobSpec("t.v", {"n": 4}, queue="other"),
            ])
            return [first, *batch]

    first, held, fresh, other = arun(main)
    assert held.duplicate and held.id == first.id and held.input == {"n": 1}
    assert not fresh.duplicate and fresh.input == {"n": 3}
    assert other.queue == "other" and other.id > fresh.id
    with belay.Belay(db_url) as sync:
        again = sync.enqueue("t.u", {"n": 5}, unique="order-1")
    assert again.duplicate and again.id == first.id


def test_enqueue_validates_before_writing_with_the_sync_clients_messages(db_url, direct_url):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client:
            with pytest.raises(belay.ValidationError, match="priority"):
                await client.enqueue_many([{"kind": "t.ok"}, {"kind": "t.bad", "priority": "x"}])
            with pytest.raises(belay.ValidationError, match="conn= or session="):
                await client.enqueue("t.x", conn=object(), session=object())

    arun(main)
    assert count_jobs_sync(direct_url) == 0


def test_a_blocking_connection_is_refused_with_the_fix(db_url, direct_url):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client:
            with psycopg.connect(db_url) as blocking, \
                    pytest.raises(belay.ValidationError, match=r"belay\.Belay"):
                await client.enqueue("t.x", conn=blocking)
            with pytest.raises(belay.ValidationError, match="AsyncConnection"):
                await client.get_job(1, conn="not a connection")

    arun(main)


def test_a_failed_transaction_is_refused(db_url, direct_url):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client, \
                await psycopg.AsyncConnection.connect(db_url) as conn:
            with pytest.raises(psycopg.errors.DivisionByZero):
                await conn.execute("SELECT 1/0")
            with pytest.raises(belay.ValidationError, match="roll it back"):
                await client.enqueue("t.x", conn=conn)

    arun(main)


def test_enqueue_workflow_inserts_once_per_workflow_id(db_url, direct_url):
    def flow() -> belay.Workflow:
        wf = belay.Workflow("pipeline", workflow_id="wf-aio")
        wf.add("fetch", "t.fetch", {"url": "u"})
        wf.add("parse", "t.parse", deps=["fetch"])
        return wf

    async def main() -> tuple[dict[str, belay.Job], dict[str, belay.Job]]:
        async with aclient(db_url, direct_url) as client:
            return await client.enqueue_workflow(flow()), await client.enqueue_workflow(flow())

    first, second = arun(main)
    assert {n: j.state for n, j in first.items()} == {"fetch": "ready", "parse": "held"}
    assert all(j.duplicate for j in second.values())
    assert {n: j.id for n, j in second.items()} == {n: j.id for n, j in first.items()}


# -- Reads -------------------------------------------------------------------------------


def test_get_list_and_events(db_url, direct_url, sql_conn):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client:
            a = await client.enqueue("t.a", queue="q1")
            b = await client.enqueue("t.b", queue="q2")
            assert (await client.get_job(a.id)).kind == "t.a"  # type: ignore[union-attr]
            assert await client.get_job(10**12) is None
            assert [j.id for j in await client.list_jobs()] == [b.id, a.id]
            assert [j.id for j in await client.list_jobs(queue="q1")] == [a.id]
            assert [j.id for j in await client.list_jobs(limit=1)] == [b.id]
            assert [j.id for j in await client.list_jobs(before_id=b.id)] == [a.id]
            with pytest.raises(belay.ValidationError, match="unknown state"):
                await client.list_jobs(state="sleeping")
            for n in (1, 2, 3):
                sql_conn.execute(
                    "INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
                    "VALUES (%s, %s, %s, now())", (a.id, n, psycopg.types.json.Jsonb({"n": n})))
            assert [e.payload for e in await client.events(a.id)] == [{"n": 1}, {"n": 2},
                                                                      {"n": 3}]
            assert [e.seq for e in await client.events(a.id, after=1, limit=1)] == [2]
            with pytest.raises(belay.ValidationError, match="sequence number"):
                await client.events(a.id, after=-1)

    arun(main)


# -- Waiting -----------------------------------------------------------------------------


def test_await_result_of_a_job_a_real_worker_runs(db_url, direct_url):
    reg = belay.Registry()

    @belay.worker(name="t.double", registry=reg)
    def double(ctx: belay.Context) -> int:
        return int(ctx.input["n"]) * 2

    async def main() -> tuple[Any, Any]:
        async with aclient(db_url, direct_url, registry=reg) as client:
            ok = await client.enqueue("t.double", {"n": 21})
            bad = await client.enqueue("t.double", {"n": None}, max_attempts=1)
            return (await client.await_result(ok.id, timeout=20),
                    await _failure(client.await_result(bad.id, timeout=20)))

    with belay.Belay(db_url, direct_url=direct_url if POOLED else None) as sync, \
            belay.Worker(["default"], client=sync, registry=reg, poll_interval=0.05,
                         notify=True):
        value, failure = arun(main)
    assert value == 42
    assert isinstance(failure, belay.JobFailed)


async def _failure(waiting: Awaitable[Any]) -> BaseException | None:
    try:
        await waiting
    except BaseException as exc:
        return exc
    return None


async def until(predicate: Callable[[], Any], what: str, timeout: float = 15) -> None:
    """Let the loop run until ``predicate()`` holds (a task got that far)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def count_reads(client: AsyncBelay, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the client's ``get_job`` calls (a waiter's reads of its job) in
    the one-item list returned."""
    reads = [0]
    real = client.get_job

    async def get_job(job_id: int, **kwargs: Any) -> Any:
        found = await real(job_id, **kwargs)
        reads[0] += 1
        return found

    monkeypatch.setattr(client, "get_job", get_job)
    return reads


def listening(client: AsyncBelay) -> bool:
    results = client._waits._results
    return results is not None and results.listening.is_set()


@pytest.mark.direct_only
def test_a_notification_carrying_a_result_only_wakes_the_waiter(
        db_url, direct_url, sql_conn, monkeypatch):
    """A result notification may carry the result (§9.2); the waiter it wakes
    returns the row's all the same (issue 38: anyone may pg_notify)."""
    job_id = running_job(sql_conn)
    envelope = base64.b64encode(b'{"answer": 42}').decode()
    # No polling between reads: only the notification ends the wait.
    monkeypatch.setattr(belay.aio, "_bounded", lambda interval, deadline: 30.0)

    async def main() -> Any:
        async with aclient(db_url, direct_url) as client:
            reads = count_reads(client, monkeypatch)
            waiting = asyncio.ensure_future(client.await_result(job_id, timeout=30))
            await until(lambda: reads[0] >= 1 and listening(client), "the waiter listens")
            with sql_conn.transaction():
                sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded', result = %s "
                                 "WHERE id = %s", (b'"from the row"', job_id))
                notify(sql_conn, json.dumps({"t": "r", "id": job_id, "s": "succeeded",
                                             "v": envelope}))
            return await asyncio.wait_for(waiting, 30)

    assert arun(main) == "from the row"


def test_a_forged_result_notification_only_wakes_the_waiter(
        db_url, direct_url, stranger_url, monkeypatch):
    """Issue 38: a role refused SELECT on belay_jobs sends a result
    notification saying a ready job succeeded with a value of its choosing.
    The waiter reads the row, sees the job still ready and waits on; when the
    job really finishes, the row's result is what comes back."""
    reg = belay.Registry()

    @belay.worker(name="t.audit", registry=reg)
    def audit(ctx: belay.Context) -> dict[str, Any]:
        return {"verified": False, "amount": 3}

    def run_it_for_real() -> dict[str, int]:
        with belay.Belay(db_url) as sync:
            return belay.Worker(["default"], client=sync, registry=reg, notify=True).drain()

    # No polling between reads: only a notification ends a pause, so each
    # read after the first is the answer to one.
    monkeypatch.setattr(belay.aio, "_bounded", lambda interval, deadline: 30.0)

    async def main() -> Any:
        async with aclient(db_url, direct_url, registry=reg) as client:
            job = await client.enqueue("t.audit")  # no worker runs: it stays ready
            reads = count_reads(client, monkeypatch)
            waiting = asyncio.ensure_future(client.await_result(job.id, timeout=60))
            await until(lambda: reads[0] >= 1 and listening(client), "the waiter listens")

            await asyncio.to_thread(forge_result, stranger_url, job.id)

            await until(lambda: reads[0] >= 2 or waiting.done(),
                        "the waiter answers the forged wake-up")
            assert not waiting.done(), (
                f"await_result ended on a forged notification: {await _outcome(waiting)!r}")
            assert (await client.get_job(job.id)).state == "ready"  # type: ignore[union-attr]
            assert await asyncio.to_thread(run_it_for_real) == {"succeeded": 1}
            return await asyncio.wait_for(waiting, 30)

    assert arun(main) == {"verified": False, "amount": 3} != FORGED_RESULT


async def _outcome(task: Awaitable[Any]) -> Any:
    try:
        return await task
    except BaseException as exc:
        return exc


def test_await_result_times_out_and_names_the_state(db_url, direct_url):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client:
            job = await client.enqueue("t.nobody_runs_this")
            with pytest.raises(TimeoutError, match="still ready"):
                await client.await_result(job.id, timeout=0.1)
            with pytest.raises(belay.JobNotFound):
                await client.await_result(10**12, timeout=1)

    arun(main)


def test_subscribe_events_follows_a_running_job_to_its_end(db_url, direct_url):
    reg = belay.Registry()
    gate = threading.Event()

    @belay.worker(name="t.stream", registry=reg)
    def stream(ctx: belay.Context) -> int:
        for n in range(5):
            ctx.emit({"n": n})
            if n == 2:
                gate.wait(10)  # the subscriber is mid-stream now
        return 5

    async def main() -> list[Any]:
        seen: list[Any] = []
        async with aclient(db_url, direct_url, registry=reg) as client:
            job = await client.enqueue("t.stream")
            async for event in client.subscribe_events(job.id, timeout=20):
                seen.append(event.payload)
                if event.seq == 3:
                    gate.set()
            resumed = [e.seq async for e in client.subscribe_events(job.id, after=3)]
        return [seen, resumed]

    with belay.Belay(db_url, direct_url=direct_url if POOLED else None) as sync, \
            belay.Worker(["default"], client=sync, registry=reg, poll_interval=0.05,
                         busy_poll=0.005, notify=True):
        seen, resumed = arun(main)
    assert seen == [{"n": n} for n in range(5)]
    assert resumed == [4, 5]


# -- Signals, steering, cancel and retry ---------------------------------------------------


def test_signal_and_steer_wake_a_waiting_job(db_url, direct_url):
    reg = belay.Registry()

    @belay.worker(name="t.approve", registry=reg)
    def approve(ctx: belay.Context) -> Any:
        decision = ctx.await_signal("approval")
        return {"decision": decision, "steering": ctx.steering()}

    async def main() -> Any:
        async with aclient(db_url, direct_url, registry=reg) as client:
            job = await client.enqueue("t.approve")
            with belay.Belay(db_url) as sync:
                belay.Worker(["default"], client=sync, registry=reg).drain()
            assert (await client.get_job(job.id)).state == "awaiting"  # type: ignore[union-attr]
            await client.steer_job(job.id, {"instruction": "be brief"})
            assert await client.signal_job(job.id, "approval", {"ok": True}) == [job.id]
            with pytest.raises(belay.ValidationError, match="reserved"):
                await client.signal_job(job.id, "$steer", {})
            with pytest.raises(belay.ValidationError, match="steering is a dict"):
                await client.steer_job(job.id, "faster")  # type: ignore[arg-type]
            with belay.Belay(db_url) as sync:
                belay.Worker(["default"], client=sync, registry=reg).drain()
            return await client.await_result(job.id, timeout=5)

    result = arun(main)
    assert result["decision"] == {"ok": True}
    assert result["steering"] == {"instruction": "be brief"}


def test_cancel_and_retry(db_url, direct_url, notes):
    async def main() -> None:
        async with aclient(db_url, direct_url) as client:
            job = await client.enqueue("t.c")
            assert await client.cancel_job(job.id) == "cancelled"
            assert await client.cancel_job(job.id) == "noop"
            retried = await client.retry_job(job.id)
            assert retried.state == "ready"
            with pytest.raises(belay.NotRetryable):
                await client.retry_job(job.id)
            with pytest.raises(belay.JobNotFound):
                await client.cancel_job(10**12)
            with pytest.raises(belay.ValidationError, match="integer job id"):
                await client.cancel_job("7")  # type: ignore[arg-type]

    arun(main)
    # The cancel told result waiters; the retry woke the queue.
    received = notes.received()
    assert any(m.get("t") == "r" for m in received)
    assert {"t": "p", "q": "default"} in received


def test_cancelling_a_held_member_settles_its_workflow(db_url, direct_url):
    async def main() -> dict[str, str]:
        async with aclient(db_url, direct_url) as client:
            wf = belay.Workflow("pipeline", workflow_id="wf-cancel")
            wf.add("a", "t.a")
            wf.add("b", "t.b", deps=["a"])
            jobs = await client.enqueue_workflow(wf)
            assert await client.cancel_job(jobs["a"].id) == "cancelled"
            return {n: (await client.get_job(j.id)).state  # type: ignore[union-attr]
                    for n, j in jobs.items()}

    # "b" depended on "a": settlement dooms it in the same transaction.
    assert arun(main) == {"a": "cancelled", "b": "cancelled"}


# -- Lifecycle -----------------------------------------------------------------------------


def test_an_instance_belongs_to_its_event_loop(db_url, direct_url):
    client = aclient(db_url, direct_url)
    arun(lambda: client.enqueue("t.first"))
    with pytest.raises(belay.ConfigurationError, match="one per event loop"):
        arun(lambda: client.enqueue("t.second"))


def test_a_missing_schema_fails_at_open_saying_to_migrate(empty_db_url):
    async def startup() -> None:
        async with AsyncBelay(empty_db_url):
            raise AssertionError("entered a client on a database without belay's schema")

    with pytest.raises(belay.SchemaMissing, match="belay migrate"):
        arun(startup)

    async def lazily() -> None:
        client = AsyncBelay(empty_db_url)
        try:
            await client.get_job(1)
        finally:
            await client.close()

    with pytest.raises(belay.SchemaMissing, match="belay migrate"):
        arun(lazily)


def test_the_module_functions_use_the_configured_default(db_url, direct_url):
    async def main() -> Any:
        client = belay.aio.configure(db_url, direct_url=direct_url if POOLED else None)
        try:
            job = await belay.aio.enqueue("t.default", {"x": 1})
            assert (await belay.aio.get_job(job.id)).input == {"x": 1}  # type: ignore[union-attr]
            return [j.id for j in await belay.aio.list_jobs(kind="t.default")] == [job.id]
        finally:
            await client.close()

    assert arun(main) is True


def test_many_concurrent_enqueues_share_the_pool(db_url, direct_url):
    async def main() -> list[belay.Job]:
        async with aclient(db_url, direct_url, max_pool_size=4) as client:
            return await asyncio.gather(*(client.enqueue("t.n", {"n": n}) for n in range(200)))

    jobs = arun(main)
    assert len({j.id for j in jobs}) == 200
    assert sorted(j.input["n"] for j in jobs) == list(range(200))
    assert count_jobs_sync(direct_url) == 200


@pytest.mark.direct_only
@pytest.mark.parametrize("notify_on", [True, False], ids=["listening", "polling"])
def test_close_ends_the_waits_under_way_and_leaves_no_connection(
        db_url, sql_conn, monkeypatch, notify_on):
    """close() while one task waits in await_result and one follows
    subscribe_events: both end at once with ClientClosed, later calls raise it
    instead of opening the pool again, and no session of the client's
    outlives asyncio.run."""

    async def main() -> None:
        client = AsyncBelay(db_url, notify=notify_on)
        job = await client.enqueue("t.nobody_runs_this")
        reads = count_reads(client, monkeypatch)

        async def follow() -> list[Any]:
            return [e async for e in client.subscribe_events(job.id, timeout=60)]

        waits = {asyncio.ensure_future(client.await_result(job.id, timeout=60)),
                 asyncio.ensure_future(follow())}
        await until(lambda: reads[0] >= 2, "both waits watch the job")

        await client.close()

        done, pending = await asyncio.wait(waits, timeout=10)
        assert not pending, "a wait outlived close()"
        for task in done:
            error = task.exception()
            assert isinstance(error, belay.ClientClosed), error
            assert f"closed while waiting for job {job.id}" in str(error)
        with pytest.raises(belay.ClientClosed, match="was closed"):
            await client.get_job(job.id)
        with pytest.raises(belay.ClientClosed, match="was closed"):
            await client.await_result(job.id, timeout=1)
        # A connection of the caller's is not the client's to refuse.
        async with await psycopg.AsyncConnection.connect(db_url) as conn:
            assert (await client.get_job(job.id, conn=conn)).state == "ready"  # type: ignore[union-attr]
        await client.close()  # still idempotent

    arun(main)
    wait_until(lambda: other_sessions(sql_conn) == [], "the client's sessions end", timeout=10)
