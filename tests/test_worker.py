"""The worker (``belay.Worker``): real threads against a real PostgreSQL.

Contract §4 (legal writers), §6 (claim, leases, reclaim), §7 (fenced acks), §9
(wake-ups), §11.1-3 (no job lost, a stale ack never mutates a row, at-least-once).
Issue 3, "Tests must show": N jobs → N terminal rows, none run twice; a zombie ack
changes nothing; two workers never hold the same job; an unknown kind is kept.

Most tests run on the ``clock`` fixture (a ManualClock): a worker then claims only
jobs due at the clock's time and leases never expire unless the test moves the
clock, so any duplicate execution would be a claim bug, not a reclaim. The lease
tests that need wall time use ``live_client`` (SystemClock) and lease_ttl ≤ 0.6 s.
Waits are on events and hooks (``Ends``); ``wait_until`` polls the database only
for what no event announces (a row the heartbeat or the sweeper changed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import belay
import belay.testing
from belay import store
from belay.context import Interrupted
from belay.job import Job
from belay.runner import UNKNOWN_KIND_SNOOZE, JobEnd
from belay.sql import QUERIES
from tests.helpers import (
    START,
    Conn,
    Ends,
    awaiting_own_scope,
    insert_job,
    job_row,
    refuse_updates_of,
    running_job,
    signal_rows,
    wait_until,
)

WORKER_NAMES = ("belay-producer-", "belay-exec-", "belay-heartbeat", "belay-sweeper",
                "belay-listener", "belay-poller", "belay-queues")


# -- helpers -----------------------------------------------------------------------------------


def make_worker(client: belay.Belay, registry: belay.Registry,
                queues: Any = ("default",), **options: Any) -> belay.Worker:
    """A worker tuned for tests: fast polls, no background sweeps unless asked."""
    settings: dict[str, Any] = {"poll_interval": 0.05, "busy_poll": 0.01,
                                "sweep_interval": 3600.0, "shutdown_grace": 5.0}
    settings.update(options)
    return belay.Worker(queues, client=client, registry=registry, **settings)


@contextlib.contextmanager
def running(*workers: belay.Worker) -> Iterator[None]:
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        for worker in workers:
            worker.stop()


@contextlib.contextmanager
def reclaimer(client: belay.Belay, registry: belay.Registry | None = None,
              **options: Any) -> Iterator[belay.Worker]:
    """A started worker on a queue nothing uses: its sweeper, or explicit
    ``reclaim()`` passes beside running threads."""
    worker = make_worker(client, registry or belay.Registry(), ("nothing-here",), **options)
    with running(worker):
        yield worker


def reclaim(
    client: belay.Belay, registry: belay.Registry | None = None, **options: Any
) -> int:
    """One synchronous reclaim pass by a worker that was never started."""
    return make_worker(
        client, registry or belay.Registry(), ("nothing-here",), **options
    ).reclaim()


def alive_worker_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and t.name.startswith(WORKER_NAMES))


def rows_by_state(conn: Conn) -> dict[str, int]:
    return dict(conn.execute("SELECT state, count(*) FROM belay_jobs GROUP BY state").fetchall())


def backend_ran(conn: Conn, application_name: str, query_part: str) -> bool:
    """A backend of this database with that name last ran a statement containing
    ``query_part``, and is idle now (it finished)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = %s AND state = 'idle' AND strpos(query, %s) > 0",
        (application_name, query_part),
    ).fetchone()
    return bool(row and row[0])


def listener_up(conn: Conn) -> bool:
    return backend_ran(conn, "belay-listener", "LISTEN")


def claimed_once(conn: Conn) -> bool:
    return backend_ran(conn, "belay-worker", "WITH ready AS (")


def assert_worker_threads_gone() -> None:
    """No worker thread outlives stop(). Idle executors get a sentinel but stop()
    doesn't join them, so give those a moment (reported as a finding)."""
    for thread in threading.enumerate():
        if thread.name.startswith("belay-exec-"):
            thread.join(2)
    assert alive_worker_threads() == []


def pace() -> None:
    """A short pause inside a job's polling loop (the job, not the test, waits)."""
    threading.Event().wait(0.01)


@pytest.fixture
def live_client(db_url: str) -> Iterator[belay.Belay]:
    """A client on the wall clock, for leases that must expire in real time."""
    with belay.Belay(db_url) as instance:
        yield instance


# -- N jobs, exactly once (§11.1, §11.3) ----------------------------------------------------------


def test_n_jobs_on_two_queues_end_in_n_terminal_rows_each_run_once(client, sql_conn) -> None:
    reg = belay.Registry()
    runs: Counter[int] = Counter()
    lock = threading.Lock()

    @belay.worker(name="count", registry=reg)
    def count(ctx: belay.Context) -> Any:
        with lock:
            runs[ctx.id] += 1
        return {"double": ctx.input["n"] * 2, "queue": ctx.queue}

    def specs(numbers: range) -> list[dict[str, Any]]:
        return [{"kind": count, "input": {"n": n}, "queue": "a" if n % 2 else "b"}
                for n in numbers]

    worker = make_worker(client, reg, {"a": 4, "b": 3})
    ends = Ends(worker)
    before = client.enqueue_many(specs(range(150)))
    with running(worker):
        during = client.enqueue_many(specs(range(150, 300)))
        ends.wait_for(300)
        jobs = before + during
        assert client.await_result(jobs[-1].id, timeout=5) == {"double": 598, "queue": "a"}
    assert len(jobs) == 300
    assert runs == Counter({job.id: 1 for job in jobs})  # none missing, none twice
    assert len(ends.events) == 300
    assert {e.outcome for e in ends.events} == {"succeeded"}
    assert rows_by_state(sql_conn) == {"succeeded": 300}
    for job in jobs:
        stored = client.get_job(job.id)
        assert stored is not None
        assert stored.result == {"double": job.input["n"] * 2, "queue": job.queue}
        assert (stored.attempt, stored.errors, stored.lease_until, stored.leased_by) == (
            1, [], None, None)


def test_two_workers_racing_on_one_queue_never_hold_the_same_job(client, db_url, clock,
                                                                   sql_conn) -> None:
    """Two nodes, one queue, separate registries so each job function knows which
    node it runs on: the row must be leased to that node for the whole run."""
    runs: list[tuple[int, str]] = []
    holding: set[int] = set()
    overlaps: list[int] = []
    wrong: list[tuple[int, str, Any]] = []
    lock = threading.Lock()

    def job_for(node: str) -> Callable[[belay.Context], Any]:
        def job(ctx: belay.Context) -> Any:
            with lock:
                if ctx.id in holding:
                    overlaps.append(ctx.id)
                holding.add(ctx.id)
            try:
                row = ctx.client.get_job(ctx.id)
                seen = (row.state, row.leased_by, row.attempt) if row else None
                if seen != ("running", node, ctx.attempt) or ctx.job.leased_by != node:
                    wrong.append((ctx.id, node, seen))
                with lock:
                    runs.append((ctx.id, node))
                return node
            finally:
                with lock:
                    holding.discard(ctx.id)
        return job

    registries = {}
    for node in ("node-a", "node-b"):
        registries[node] = belay.Registry()
        belay.worker(name="race", registry=registries[node])(job_for(node))

    with belay.Belay(db_url, clock=clock) as other_client:
        a = make_worker(client, registries["node-a"], {"race": 4}, node_id="node-a")
        b = make_worker(other_client, registries["node-b"], {"race": 4}, node_id="node-b")
        ends = Ends(a, b)
        with running(a, b):
            jobs = client.enqueue_many([{"kind": "race", "input": {"n": n}, "queue": "race"}
                                        for n in range(200)])
            ends.wait_for(200)
    assert overlaps == [] and wrong == []
    assert sorted(job_id for job_id, _ in runs) == sorted(job.id for job in jobs)
    by_node = Counter(node for _, node in runs)
    assert by_node["node-a"] > 0 and by_node["node-b"] > 0, by_node  # they really raced
    ran_on = dict(runs)
    for job in jobs:  # the ack came from the node that ran it
        assert client.get_job(job.id).result == ran_on[job.id]  # type: ignore[union-attr]
    assert rows_by_state(sql_conn) == {"succeeded": 200}


# -- outcomes end to end (§7 ack table) ------------------------------------------------------------


def test_a_return_succeeds_and_stores_the_result(client, sql_conn, clock) -> None:
    reg = belay.Registry()

    @belay.worker(name="ok", registry=reg)
    def ok(ctx: belay.Context) -> Any:
        return {"echo": ctx.input, "attempt": ctx.attempt, "kind": ctx.kind}

    job = client.enqueue(ok, {"x": [1, "two"]})
    clock.advance(5)
    assert make_worker(client, reg).drain() == {"succeeded": 1}
    row = job_row(sql_conn, job.id)
    assert row["state"] == "succeeded"
    assert json.loads(bytes(row["result"])) == {"echo": {"x": [1, "two"]}, "attempt": 1,
                                                "kind": "ok"}
    assert (row["attempt"], row["errors"], row["lease_until"], row["leased_by"]) == (
        1, [], None, None)
    assert row["started_at"] == row["finished_at"] == clock.now()
    assert client.await_result(job.id, timeout=1)["echo"] == {"x": [1, "two"]}


def test_an_error_message_jsonb_cannot_hold_is_still_recorded(client, sql_conn) -> None:
    """NUL and a lone surrogate in an exception's message: the retry is recorded
    with them written out (before, every ack failed and the job was reclaimed
    forever)."""
    reg = belay.Registry()

    @belay.worker(name="nul", max_attempts=2, registry=reg)
    def nul(ctx: belay.Context) -> None:
        raise ValueError("bad\x00byte \ud800!")

    job = client.enqueue(nul)
    assert make_worker(client, reg).drain() == {"retry": 1}
    (error,) = job_row(sql_conn, job.id)["errors"]
    assert error["error"] == "ValueError: bad\\x00byte ?!"


def test_a_raise_retries_with_the_backoff_then_fails_at_max_attempts(client, sql_conn,
                                                                      clock) -> None:
    reg = belay.Registry()

    @belay.worker(name="flaky", max_attempts=2, backoff=lambda n: 30.0 * n, registry=reg)
    def flaky(ctx: belay.Context) -> None:
        raise RuntimeError(f"try {ctx.attempt}")

    job = client.enqueue(flaky)
    worker = make_worker(client, reg)
    assert worker.drain() == {"retry": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["ready_at"]) == (
        "ready", 1, START + timedelta(seconds=30))
    assert (row["lease_until"], row["leased_by"], row["finished_at"]) == (None, None, None)
    [error] = row["errors"]
    assert set(error) == {"error", "attempt", "traceback"}
    assert (error["error"], error["attempt"]) == ("RuntimeError: try 1", 1)
    assert "in flaky" in error["traceback"]

    assert worker.drain() == {}  # not due yet
    clock.advance(30)
    assert worker.drain() == {"failed": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["finished_at"]) == ("failed", 2, clock.now())
    assert row["started_at"] == START  # kept from the first attempt
    assert [(e["error"], e["attempt"]) for e in row["errors"]] == [
        ("RuntimeError: try 1", 1), ("RuntimeError: try 2", 2)]
    with pytest.raises(belay.JobFailed):
        client.await_result(job.id, timeout=1)


def test_cancel_ends_the_job_cancelled(client, sql_conn, clock) -> None:
    reg = belay.Registry()

    @belay.worker(name="quitter", registry=reg)
    def quitter(ctx: belay.Context) -> None:
        raise belay.Cancel("no longer wanted")

    job = client.enqueue(quitter)
    assert make_worker(client, reg).drain() == {"cancelled": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"], row["finished_at"]) == (
        "cancelled", 1, [{"reason": "no longer wanted"}], clock.now())
    with pytest.raises(belay.JobCancelled):
        client.await_result(job.id, timeout=1)


def test_snooze_comes_back_later_without_using_an_attempt(client, sql_conn, clock) -> None:
    reg = belay.Registry()
    attempts: list[int] = []

    @belay.worker(name="sleepy", registry=reg)
    def sleepy(ctx: belay.Context) -> str:
        attempts.append(ctx.attempt)
        if len(attempts) == 1:
            raise belay.Snooze(45)
        return "awake"

    job = client.enqueue(sleepy)
    worker = make_worker(client, reg)
    assert worker.drain() == {"snooze": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["ready_at"], row["errors"]) == (
        "ready", 0, START + timedelta(seconds=45), [])
    assert (row["lease_until"], row["leased_by"], row["finished_at"]) == (None, None, None)
    clock.advance(44)
    assert worker.drain() == {}
    clock.advance(1)
    assert worker.drain() == {"succeeded": 1}
    assert attempts == [1, 1]
    assert job_row(sql_conn, job.id)["attempt"] == 1


def test_a_result_that_is_not_json_retries_with_a_bad_result_error(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="sets", max_attempts=2, backoff=lambda n: 5.0, registry=reg)
    def sets(ctx: belay.Context) -> Any:
        return {"ids": {1, 2, 3}}

    job = client.enqueue(sets)
    worker = make_worker(client, reg)
    assert worker.drain() == {"retry": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["result"], row["ready_at"]) == (
        "ready", None, START + timedelta(seconds=5))
    [error] = row["errors"]
    assert error["error"].startswith("bad result: ") and error["attempt"] == 1


def test_a_timed_out_attempt_is_retried_while_its_thread_keeps_the_slot(client, sql_conn,
                                                                        clock) -> None:
    """Threads can't be killed (docs/contract.md §6): the attempt is retried at the timeout,
    the slot stays taken until the function returns, and the late function's
    checkpoint raises Interrupted, which ``except Exception:`` doesn't catch."""
    reg = belay.Registry()
    started, release, b_started = threading.Event(), threading.Event(), threading.Event()
    interrupted: list[str] = []
    swallowed: list[BaseException] = []

    @belay.worker(name="slow", timeout=0.3, backoff=lambda n: 1000.0, queue="one",
                  registry=reg)
    def slow(ctx: belay.Context) -> str:
        started.set()
        release.wait(10)
        assert ctx.interrupted
        try:
            try:
                ctx.checkpoint()
            except Exception as exc:  # what user code often does
                swallowed.append(exc)
        except Interrupted as exc:
            interrupted.append(str(exc))
            raise
        return "too late"

    @belay.worker(name="next", queue="one", registry=reg)
    def next_job(ctx: belay.Context) -> str:
        b_started.set()
        return "b"

    a = client.enqueue(slow)
    b = client.enqueue(next_job)
    worker = make_worker(client, reg, {"one": 1})
    ends = Ends(worker)
    with running(worker):
        assert started.wait(5)
        wait_until(lambda: job_row(sql_conn, a.id)["state"] == "ready", "the timeout acked")
        timed_out = job_row(sql_conn, a.id)
        # Ten idle polls at 50 ms: had the slot been freed, b would have started.
        assert not b_started.wait(0.5), "a second job ran while the timed-out one still ran"
        assert job_row(sql_conn, b.id)["state"] == "ready"
        release.set()
        assert b_started.wait(5)
        ends.wait_for(2)
    assert ends.outcomes() == {a.id: "timeout", b.id: "succeeded"}
    assert interrupted == [f"job {a.id} attempt 1: timed out"]
    assert swallowed == []
    assert (timed_out["attempt"], timed_out["ready_at"], timed_out["leased_by"]) == (
        1, clock.now() + timedelta(seconds=1000), None)
    [error] = timed_out["errors"]
    assert error["error"].startswith("timeout") and error["attempt"] == 1
    assert job_row(sql_conn, a.id) == timed_out  # the late return changed nothing
    assert client.await_result(b.id, timeout=1) == "b"


def test_a_timeout_on_the_last_attempt_fails_the_job(client, sql_conn, clock) -> None:
    reg = belay.Registry()
    release = threading.Event()

    @belay.worker(name="slow.last", timeout=0.2, max_attempts=1, registry=reg)
    def slow(ctx: belay.Context) -> None:
        release.wait(10)

    job = client.enqueue(slow)
    worker = make_worker(client, reg)
    ends = Ends(worker)
    try:
        with running(worker):
            wait_until(lambda: job_row(sql_conn, job.id)["state"] == "failed", "timeout fails")
            release.set()
            ends.wait_for(1)
    finally:
        release.set()
    row = job_row(sql_conn, job.id)
    assert (row["attempt"], row["finished_at"]) == (1, clock.now())
    assert row["errors"][0]["error"].startswith("timeout")


# -- unknown kinds: kept, not run, not an attempt --------------------------------------------------


def test_a_job_of_an_unknown_kind_goes_back_untouched(client, sql_conn, clock) -> None:
    reg = belay.Registry()
    job = client.enqueue("deployed.tomorrow", {"x": 1})
    worker = make_worker(client, reg)
    assert worker.drain() == {"unknown": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])
    assert row["ready_at"] == clock.now() + timedelta(seconds=UNKNOWN_KIND_SNOOZE)
    assert UNKNOWN_KIND_SNOOZE == 60
    assert (row["lease_until"], row["leased_by"], row["finished_at"]) == (None, None, None)
    assert worker.drain() == {}

    clock.advance(60)
    assert worker.drain() == {"unknown": 1}  # still kept, still not an attempt
    assert (job_row(sql_conn, job.id)["attempt"], job_row(sql_conn, job.id)["errors"]) == (0, [])

    @belay.worker(name="deployed.tomorrow", registry=reg)
    def deployed(ctx: belay.Context) -> Any:
        return ctx.input

    clock.advance(60)
    assert worker.drain() == {"succeeded": 1}
    assert client.get_job(job.id).result == {"x": 1}  # type: ignore[union-attr]


def test_a_running_worker_keeps_unknown_kinds_and_runs_the_rest(client, sql_conn, clock) -> None:
    reg = belay.Registry()

    @belay.worker(name="known", registry=reg)
    def known(ctx: belay.Context) -> str:
        return "ran"

    unknown = client.enqueue("nobody.knows")
    ok = client.enqueue(known)
    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        ends.wait_for(1)
        wait_until(lambda: job_row(sql_conn, unknown.id)["ready_at"] > clock.now(),
                   "the unknown job was sent back")
    assert ends.outcomes() == {ok.id: "succeeded"}
    row = job_row(sql_conn, unknown.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])


# -- leases: heartbeat, lost leases, zombie acks (§6, §7, §11.2) -----------------------------------


def test_the_heartbeat_keeps_a_long_job_leased_past_its_ttl(live_client, sql_conn) -> None:
    TTL = 1.5
    reg = belay.Registry()
    started, release = threading.Event(), threading.Event()

    @belay.worker(name="long", registry=reg)
    def long_job(ctx: belay.Context) -> str:
        started.set()
        release.wait(10)
        return "done"

    # A TTL short enough to pass twice in the test, long enough that a loaded
    # machine (CI runs this beside the soak) delays no renewal past it.
    holder = make_worker(live_client, reg, lease_ttl=TTL, node_id="holder")
    # Another node sweeping for expired leases every 50 ms all along.
    sweeper = make_worker(live_client, belay.Registry(), ("elsewhere",), lease_ttl=TTL,
                          sweep_interval=0.05, node_id="sweeper")
    ends = Ends(holder)
    try:
        with running(holder, sweeper):
            job = live_client.enqueue(long_job)
            assert started.wait(5)
            first = job_row(sql_conn, job.id)["lease_until"]
            leases = [first]

            def renewed_past_the_first_lease() -> bool:
                until = job_row(sql_conn, job.id)["lease_until"]
                if until != leases[-1]:
                    leases.append(until)
                return datetime.now(timezone.utc) > first + timedelta(seconds=2 * TTL)

            wait_until(renewed_past_the_first_lease, "two TTLs past the first lease", 15)
            assert sweeper.reclaim() == 0
            row = job_row(sql_conn, job.id)
            assert (row["state"], row["attempt"], row["leased_by"]) == ("running", 1, "holder")
            assert row["lease_until"] > datetime.now(timezone.utc)
            release.set()
            ends.wait_for(1)
    finally:
        release.set()
    assert leases == sorted(leases) and len(leases) >= 4, leases  # renewed every ttl/3
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("succeeded", 1, [])


THEFTS = {
    # Another node took the lease over (what the heartbeat's renew checks).
    "leased_by": "UPDATE belay_jobs SET leased_by = 'thief' WHERE id = %(id)s",
    # A reclaim: back to ready with lease_expired, not due for an hour.
    "reclaimed": """UPDATE belay_jobs SET state = 'ready', lease_until = NULL,
        leased_by = NULL, ready_at = %(later)s,
        errors = errors || '[{"error": "lease_expired"}]'::jsonb WHERE id = %(id)s""",
    # A reclaim, then a claim by another node: running again, attempt + 1.
    "reclaimed_and_claimed": """UPDATE belay_jobs SET attempt = attempt + 1,
        leased_by = 'thief', lease_until = %(later)s,
        errors = errors || '[{"error": "lease_expired"}]'::jsonb WHERE id = %(id)s""",
}


def steal(conn: Conn, job_id: int, theft: str) -> dict[str, Any]:
    conn.execute(THEFTS[theft], {"id": job_id, "later": START + timedelta(hours=1)})
    return job_row(conn, job_id)


@pytest.mark.parametrize("theft", list(THEFTS))
def test_a_lost_lease_interrupts_the_job_and_writes_nothing(client, sql_conn, theft) -> None:
    reg = belay.Registry()
    started = threading.Event()
    interrupted: list[str] = []
    swallowed: list[BaseException] = []

    @belay.worker(name="victim", registry=reg)
    def victim(ctx: belay.Context) -> str:
        started.set()
        try:
            for _ in range(1000):
                try:
                    ctx.checkpoint()
                except Exception as exc:
                    swallowed.append(exc)
                pace()
        except Interrupted as exc:
            interrupted.append(str(exc))
            raise
        return "never interrupted"

    worker = make_worker(client, reg, lease_ttl=0.6)  # renews every 0.2 s
    ends = Ends(worker)
    with running(worker):
        job = client.enqueue(victim)
        assert started.wait(5)
        stolen = steal(sql_conn, job.id, theft)
        [end] = ends.wait_for(1)
    assert end.outcome == "lost"
    assert interrupted == [f"job {job.id} attempt 1: lease lost"]
    assert swallowed == []
    assert job_row(sql_conn, job.id) == stolen  # exactly as the thief left it


LATE = {
    "returns": lambda: {"late": True},
    "raises": lambda: (_ for _ in ()).throw(RuntimeError("late failure")),
    "cancels": lambda: (_ for _ in ()).throw(belay.Cancel("late")),
    "snoozes": lambda: (_ for _ in ()).throw(belay.Snooze(1)),
}


@pytest.mark.parametrize("late", list(LATE))
@pytest.mark.parametrize("theft", ["reclaimed", "reclaimed_and_claimed"])
def test_a_zombie_ack_changes_nothing(client, sql_conn, theft, late) -> None:
    """§11.2: the job was reclaimed behind the worker's back and the heartbeat hasn't
    noticed yet (30 s TTL); the worker's fenced ack finds nothing to update."""
    reg = belay.Registry()
    started, stolen_event = threading.Event(), threading.Event()

    @belay.worker(name="zombie", registry=reg)
    def zombie(ctx: belay.Context) -> Any:
        started.set()
        stolen_event.wait(10)
        return LATE[late]()

    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        job = client.enqueue(zombie)
        assert started.wait(5)
        stolen = steal(sql_conn, job.id, theft)
        stolen_event.set()
        [end] = ends.wait_for(1)
    assert end.outcome == "stale"
    assert job_row(sql_conn, job.id) == stolen


ACK_KINDS = {
    "succeeded": {"result": b'{"r":1}'},
    "retry": {"error": {"error": "x", "attempt": 1}, "at": START},
    "failed": {"error": {"error": "x", "attempt": 1}},
    "cancelled": {"error": {"reason": "x"}},
    "snooze": {"at": START + timedelta(seconds=5)},
}


@pytest.mark.parametrize("kind", list(ACK_KINDS))
@pytest.mark.parametrize("row", [
    {"state": "running", "attempt": 2, "leased_by": "other"},  # reclaimed, claimed again
    {"state": "ready", "attempt": 1, "lease_until": None, "leased_by": None},  # reclaimed
    {"state": "succeeded", "attempt": 1, "lease_until": None, "leased_by": None},
], ids=["claimed-again", "reclaimed", "finished"])
def test_a_fenced_ack_of_a_stale_attempt_returns_none_and_changes_nothing(
    sql_conn, kind, row
) -> None:
    job_id = running_job(sql_conn, **row)
    before = job_row(sql_conn, job_id)
    claimed = Job.from_row(before).replace(attempt=1, state="running")
    with sql_conn.transaction():
        assert store.ack(sql_conn, claimed, kind, START, **ACK_KINDS[kind]) is None
    assert job_row(sql_conn, job_id) == before


@pytest.mark.parametrize("kind", list(ACK_KINDS))
def test_a_fenced_ack_of_the_live_attempt_applies(sql_conn, kind) -> None:
    """The control of the test above: the same ack on the claimed attempt writes."""
    job_id = running_job(sql_conn)
    claimed = Job.from_row(job_row(sql_conn, job_id))
    with sql_conn.transaction():
        acked = store.ack(sql_conn, claimed, kind, START, **ACK_KINDS[kind])
    assert acked is not None
    row = job_row(sql_conn, job_id)
    assert row["state"] == {"retry": "ready", "snooze": "ready"}.get(kind, kind)
    assert (row["lease_until"], row["leased_by"]) == (None, None)


# -- reclaim (§6) ----------------------------------------------------------------------------------


def test_reclaim_retries_an_expired_lease_with_the_kinds_backoff(client, sql_conn,
                                                                clock) -> None:
    reg = belay.Registry()
    belay.worker(name="reclaim.kind", backoff=lambda n: 100.0 * n, registry=reg)(
        lambda ctx: None)
    now = clock.advance(60)
    old = {"error": "earlier", "attempt": 1}
    expired = running_job(sql_conn, kind="reclaim.kind", attempt=2, max_attempts=5,
                          errors=[old], lease_until=now - timedelta(seconds=1),
                          leased_by="dead-node")
    on_the_dot = running_job(sql_conn, kind="reclaim.kind", lease_until=now)
    live = running_job(sql_conn, kind="reclaim.kind", lease_until=now + timedelta(seconds=1))
    live_before = job_row(sql_conn, live)
    with reclaimer(client, reg) as worker:
        assert worker.reclaim() == 2
        assert worker.reclaim() == 0
    row = job_row(sql_conn, expired)
    assert (row["state"], row["attempt"], row["ready_at"]) == (
        "ready", 2, now + timedelta(seconds=200))
    assert (row["lease_until"], row["leased_by"], row["finished_at"]) == (None, None, None)
    assert row["errors"][0] == old
    entry = row["errors"][1]
    assert entry["error"] == "lease_expired"
    assert datetime.fromisoformat(entry["at"]) == now
    assert job_row(sql_conn, on_the_dot)["state"] == "ready"
    assert job_row(sql_conn, live) == live_before


def test_reclaim_of_an_unknown_kind_uses_the_default_backoff(client, sql_conn, clock) -> None:
    job_id = running_job(sql_conn, kind="no.such.kind", attempt=3,
                         lease_until=START - timedelta(seconds=1))
    assert reclaim(client) == 1
    ready_at = job_row(sql_conn, job_id)["ready_at"]
    assert START + timedelta(seconds=8) <= ready_at <= START + timedelta(seconds=10)


def test_reclaim_fails_a_job_out_of_attempts(client, sql_conn, clock, notes) -> None:
    job_id = running_job(sql_conn, attempt=3, max_attempts=3,
                         lease_until=START - timedelta(seconds=1))
    assert reclaim(client, notify=True) == 1
    row = job_row(sql_conn, job_id)
    assert (row["state"], row["attempt"], row["finished_at"]) == ("failed", 3, START)
    assert row["errors"][-1]["error"] == "lease_expired"
    assert {"t": "r", "id": job_id} in notes.received()
    with pytest.raises(belay.JobFailed):
        client.await_result(job_id, timeout=1)


@pytest.mark.parametrize("attempt, a_state, b_state", [
    (3, "failed", "cancelled"),  # out of attempts: the dependent is doomed
    (1, "ready", "held"),  # retried: the dependent keeps waiting
])
def test_reclaim_of_a_workflow_member_settles_its_dependents(client, sql_conn, attempt,
                                                            a_state, b_state) -> None:
    a = running_job(sql_conn, workflow_id="wf", wf_name="a", attempt=attempt, max_attempts=3,
                    lease_until=START - timedelta(seconds=1))
    b = insert_job(sql_conn, workflow_id="wf", wf_name="b", state="held", wf_deps=["a"])
    assert reclaim(client) == 1
    assert (job_row(sql_conn, a)["state"], job_row(sql_conn, b)["state"]) == (a_state, b_state)
    if b_state == "cancelled":
        assert job_row(sql_conn, b)["finished_at"] == START


def test_reclaim_failing_a_child_tells_its_parent(client, sql_conn) -> None:
    parent = awaiting_own_scope(sql_conn, "$children", kind="parent")
    child = running_job(sql_conn, parent_id=parent, attempt=1, max_attempts=1,
                        lease_until=START - timedelta(seconds=1))
    assert reclaim(client) == 1
    assert job_row(sql_conn, child)["state"] == "failed"
    assert [(s["scope"], s["name"]) for s in signal_rows(sql_conn)] == [
        (f"job:{parent}", "$children")]
    row = job_row(sql_conn, parent)
    assert (row["state"], row["ready_at"], row["await_scope"]) == ("ready", START, None)


def test_reclaim_sends_the_wake_ups_an_ack_would(client, sql_conn, notes) -> None:
    parent = awaiting_own_scope(sql_conn, "$children", kind="parent", queue="parents")
    running_job(sql_conn, parent_id=parent, max_attempts=1,
                lease_until=START - timedelta(seconds=1))
    a = running_job(sql_conn, workflow_id="wf", wf_name="a", max_attempts=1,
                    lease_until=START - timedelta(seconds=1))
    b = insert_job(sql_conn, workflow_id="wf", wf_name="b", state="held", wf_deps=["a"])
    assert reclaim(client, notify=True) == 2
    received = notes.received()
    assert {"t": "r", "id": a} in received
    assert {"t": "p", "q": "parents"} in received
    assert {"t": "r", "id": b} in received


def test_the_sweeper_reclaims_on_its_own(client, sql_conn) -> None:
    job_id = running_job(sql_conn, lease_until=START - timedelta(seconds=1))
    with reclaimer(client, sweep_interval=0.05):
        wait_until(lambda: job_row(sql_conn, job_id)["state"] != "running", "the sweeper ran")
    assert job_row(sql_conn, job_id)["errors"][-1]["error"] == "lease_expired"


def test_reclaim_works_on_a_worker_not_started(client, sql_conn) -> None:
    job_id = running_job(sql_conn, lease_until=START - timedelta(seconds=1))
    assert make_worker(client, belay.Registry()).reclaim() == 1
    assert job_row(sql_conn, job_id)["state"] == "ready"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("belay-worker")]


def test_a_broken_backoff_does_not_jam_reclaim(client, sql_conn) -> None:
    reg = belay.Registry()

    def broken(attempt: int) -> float:
        raise ZeroDivisionError("bad backoff")

    belay.worker(name="broken.backoff", backoff=broken, registry=reg)(lambda ctx: None)
    jammed = running_job(sql_conn, kind="broken.backoff",
                         lease_until=START - timedelta(seconds=2))
    behind = running_job(sql_conn, lease_until=START - timedelta(seconds=1))
    with contextlib.suppress(ZeroDivisionError):
        reclaim(client, reg)
    assert job_row(sql_conn, behind)["state"] == "ready"
    assert job_row(sql_conn, jammed)["state"] == "ready"


def test_a_row_reclaim_cannot_write_does_not_hold_back_the_rest(client, sql_conn) -> None:
    stuck = running_job(sql_conn, lease_until=START - timedelta(seconds=2))
    behind = running_job(sql_conn, lease_until=START - timedelta(seconds=1))
    refuse_updates_of(sql_conn, stuck)
    assert reclaim(client, belay.Registry()) == 1
    assert job_row(sql_conn, behind)["state"] == "ready"
    assert job_row(sql_conn, stuck)["state"] == "running"


# -- claim (§4, §6) --------------------------------------------------------------------------------


def claim_fixture(conn: Conn) -> dict[str, int]:
    """Claimable and unclaimable rows of queue 'order', inserted out of claim order."""
    q = {"kind": "order.kind", "queue": "order"}
    ids: dict[str, int] = {}
    ids["e"] = insert_job(conn, priority=5, ready_at=None, **q)
    ids["not-yet"] = insert_job(conn, ready_at=START + timedelta(seconds=1), **q)
    ids["j"] = insert_job(conn, ready_at=START, **q)
    ids["await-no-deadline"] = insert_job(conn, state="awaiting", await_scope="s",
                                          await_name="n", **q)
    ids["b"] = insert_job(conn, ready_at=START - timedelta(minutes=10), **q)
    ids["f"] = insert_job(conn, state="awaiting", await_scope="s", await_name="n",
                          ready_at=START - timedelta(minutes=20), **q)
    ids["c"] = insert_job(conn, ready_at=START - timedelta(minutes=10), **q)
    ids["await-later"] = insert_job(conn, state="awaiting", await_scope="s", await_name="n",
                                    ready_at=START + timedelta(minutes=1), **q)
    ids["a"] = insert_job(conn, ready_at=None, **q)
    ids["held"] = insert_job(conn, state="held", ready_at=START - timedelta(hours=1), **q)
    ids["paused"] = insert_job(conn, state="paused", ready_at=START - timedelta(hours=1), **q)
    ids["running"] = running_job(conn, ready_at=START - timedelta(hours=1), **q)
    ids["d"] = insert_job(conn, priority=-1, ready_at=START - timedelta(seconds=1), **q)
    ids["other-queue"] = insert_job(conn, kind="order.kind", queue="elsewhere",
                                    priority=-9, ready_at=None)
    ids["done"] = insert_job(conn, state="succeeded", ready_at=None, priority=-9, **q)
    return ids


#: priority, then ready_at with NULL first, then id; awaiting-due f merges in by its deadline.
CLAIM_ORDER = ["d", "a", "f", "b", "c", "j", "e"]


def test_claim_takes_ready_and_due_awaiting_jobs_in_claim_order(client, sql_conn) -> None:
    ids = claim_fixture(sql_conn)
    untouched = {name: job_row(sql_conn, i) for name, i in ids.items()
                 if name not in CLAIM_ORDER}
    reg = belay.Registry()
    ran: list[int] = []
    belay.worker(name="order.kind", registry=reg)(lambda ctx: ran.append(ctx.id))
    # drain claims one job per transaction, so the run order is the SQL's order.
    assert make_worker(client, reg, ("order",)).drain() == {"succeeded": len(CLAIM_ORDER)}
    assert ran == [ids[name] for name in CLAIM_ORDER]
    for name, before in untouched.items():
        assert job_row(sql_conn, ids[name]) == before, name


def test_a_batch_claim_takes_the_first_rows_of_the_merged_order(sql_conn) -> None:
    ids = claim_fixture(sql_conn)
    until = START + timedelta(seconds=30)
    first = store.claim(sql_conn, "order", 3, "node-x", START, until)
    assert [j.id for j in first] == [ids[n] for n in CLAIM_ORDER[:3]]  # includes awaiting f
    rest = store.claim(sql_conn, "order", 100, "node-x", START, until)
    assert [j.id for j in rest] == [ids[n] for n in CLAIM_ORDER[3:]]
    assert store.claim(sql_conn, "order", 100, "node-x", START, until) == []


def test_claim_leases_the_row_and_keeps_the_first_started_at(sql_conn) -> None:
    fresh = insert_job(sql_conn, ready_at=START)
    earlier = START - timedelta(hours=1)
    again = insert_job(sql_conn, attempt=2, ready_at=START, started_at=earlier,
                       errors=[{"error": "x", "attempt": 1}, {"error": "y", "attempt": 2}])
    now = START + timedelta(seconds=5)
    until = now + timedelta(seconds=30)
    claimed = {j.id: j for j in store.claim(sql_conn, "default", 10, "node-x", now, until)}
    assert set(claimed) == {fresh, again}
    for job_id, attempt, started_at in ((fresh, 1, now), (again, 3, earlier)):
        row = job_row(sql_conn, job_id)
        assert (row["state"], row["attempt"], row["lease_until"], row["leased_by"],
                row["started_at"]) == ("running", attempt, until, "node-x", started_at)
        assert claimed[job_id].attempt == attempt and claimed[job_id].leased_by == "node-x"


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _sorts_of_the_table(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Sort nodes that sort belay_jobs rows straight from a scan (no Limit between):
    the whole-ready-set sort migration 3 exists to avoid."""
    found = []
    for sort in (n for n in _plan_nodes(node) if "Sort" in n["Node Type"]):
        stack = list(sort.get("Plans", []))
        while stack:
            below = stack.pop()
            if below["Node Type"] == "Limit":
                continue
            if below.get("Relation Name") == "belay_jobs":
                found.append(sort)
                break
            stack.extend(below.get("Plans", []))
    return found


def _explain_claim(conn: Conn) -> dict[str, Any]:
    params = {"queue": "q1", "take": 10, "node": "n", "now": START,
              "lease_until": START + timedelta(seconds=30), "kinds": None}
    row = conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES["claim"], params).fetchone()
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


def _fill(conn: Conn) -> None:
    """4,000 jobs over 4 queues and 5 priorities: a tenth awaiting (some due), a
    seventh with NULL ready_at, the rest due over the past or next hour."""
    conn.execute(
        """
        INSERT INTO belay_jobs (kind, queue, state, priority, ready_at, inserted_at)
        SELECT 'k', 'q' || (g %% 4), CASE WHEN g %% 10 = 0 THEN 'awaiting' ELSE 'ready' END,
               g %% 5,
               CASE WHEN g %% 7 = 0 THEN NULL
                    ELSE %(now)s + ((g %% 120) - 60) * interval '1 minute' END,
               %(now)s
        FROM generate_series(1, 4000) AS g
        """,
        {"now": START},
    )
    conn.execute("ANALYZE belay_jobs")


def test_the_claim_statement_reads_the_ordered_index_and_sorts_only_candidates(
    sql_conn,
) -> None:
    """queries.sql: ready jobs come in claim order off belay_jobs_claim_order_idx; only
    the merge of at most 2 * take capped candidates is sorted."""
    _fill(sql_conn)
    plan = _explain_claim(sql_conn)
    nodes = list(_plan_nodes(plan))
    assert "belay_jobs_claim_order_idx" in {n.get("Index Name") for n in nodes}, nodes
    assert _sorts_of_the_table(plan) == [], plan
    expected = sql_conn.execute(
        """SELECT id FROM belay_jobs WHERE queue = 'q1' AND (
             (state = 'ready' AND (ready_at IS NULL OR ready_at <= %(now)s))
             OR (state = 'awaiting' AND ready_at <= %(now)s))
           ORDER BY priority, ready_at IS NOT NULL, ready_at, id LIMIT 10""",
        {"now": START},
    ).fetchall()
    claimed = store.claim(sql_conn, "q1", 10, "n", START, START + timedelta(seconds=30))
    assert [j.id for j in claimed] == [r[0] for r in expected]


def test_without_the_ordered_index_the_plan_check_sees_a_table_sort(sql_conn) -> None:
    """The control: the check above can tell a whole-set sort when there is one."""
    _fill(sql_conn)
    sql_conn.execute("DROP INDEX belay_jobs_claim_order_idx")
    assert _sorts_of_the_table(_explain_claim(sql_conn)) != []


# -- wake-ups (§9) ---------------------------------------------------------------------------------


@pytest.mark.direct_only
def test_a_poke_wakes_an_idle_worker_long_before_its_poll(client, sql_conn, notes) -> None:
    """Latency claim, bound kept generous (< 2 s against a 5 s poll): with polls
    every 5 s and no other wake source, only the poke explains a quick pickup."""
    reg = belay.Registry()
    belay.worker(name="poked", registry=reg)(lambda ctx: "hi")
    worker = make_worker(client, reg, notify=True, poll_interval=5.0, busy_poll=5.0)
    ends = Ends(worker)
    with running(worker):
        wait_until(lambda: listener_up(sql_conn) and claimed_once(sql_conn),
                   "the worker listens and sits idle")
        begun = time.monotonic()
        job = client.enqueue("poked")
        ends.wait_for(1, timeout=4.5)
        elapsed = time.monotonic() - begun
        assert client.await_result(job.id, timeout=1) == "hi"
    assert elapsed < 2.0, elapsed
    received = notes.received()
    assert {"t": "p", "q": "default"} in received  # the client's poke
    # The worker's result notification: a hint only (§9.2), the waiter reads the row.
    assert {"t": "r", "id": job.id} in received


def test_polling_alone_still_finds_the_work(db_url, clock, sql_conn) -> None:
    reg = belay.Registry()
    belay.worker(name="polled", registry=reg)(lambda ctx: "found")
    with belay.Belay(db_url, clock=clock, notify=False) as quiet:
        worker = make_worker(quiet, reg, notify=False, poll_interval=0.2, busy_poll=0.02)
        ends = Ends(worker)
        with running(worker):
            assert not any(name == "belay-listener" for name in alive_worker_threads())
            wait_until(lambda: claimed_once(sql_conn), "the first (empty) claim")
            job = quiet.enqueue("polled")
            ends.wait_for(1, timeout=5)
        assert quiet.await_result(job.id, timeout=1) == "found"


def test_a_retry_sends_no_result_notification(client, notes) -> None:
    reg = belay.Registry()
    belay.worker(name="fails", backoff=lambda n: 60.0, registry=reg)(lambda ctx: 1 / 0)
    job = client.enqueue("fails")
    assert make_worker(client, reg).drain() == {"retry": 1}
    assert {"t": "r", "id": job.id} not in notes.received()


# -- hooks and logs --------------------------------------------------------------------------------


def test_on_job_end_receives_each_execution(client, clock) -> None:
    reg = belay.Registry()

    @belay.worker(name="hooked", backoff=lambda n: 10.0, registry=reg)
    def hooked(ctx: belay.Context) -> str:
        if ctx.input["fail"]:
            raise ValueError("nope")
        return "yes"

    worker = make_worker(client, reg)
    events: list[JobEnd] = []
    assert worker.on_job_end(events.append) == events.append  # usable as a decorator
    good = client.enqueue(hooked, {"fail": False})
    bad = client.enqueue(hooked, {"fail": True})
    assert worker.drain() == {"succeeded": 1, "retry": 1}
    by_id = {e.job.id: e for e in events}
    assert set(by_id) == {good.id, bad.id} and len(events) == 2
    assert (by_id[good.id].outcome, by_id[good.id].error) == ("succeeded", None)
    assert by_id[bad.id].outcome == "retry"
    assert by_id[bad.id].error["error"] == "ValueError: nope"
    for event in events:
        assert isinstance(event.job, belay.Job)
        assert (event.job.kind, event.job.attempt, event.job.state) == ("hooked", 1, "running")
        assert 0 <= event.duration < 5


def test_a_hook_that_raises_does_not_break_the_worker(client, sql_conn, caplog) -> None:
    reg = belay.Registry()
    belay.worker(name="plain", registry=reg)(lambda ctx: ctx.input["n"])
    worker = make_worker(client, reg)

    @worker.on_job_end
    def broken(event: JobEnd) -> None:
        raise RuntimeError("metrics backend down")

    ends = Ends(worker)  # registered after the broken hook: still called
    with running(worker):
        jobs = client.enqueue_many([{"kind": "plain", "input": {"n": n}} for n in range(5)])
        ends.wait_for(5)
    assert rows_by_state(sql_conn) == {"succeeded": 5}
    assert [client.get_job(j.id).result for j in jobs] == list(range(5))  # type: ignore[union-attr]
    failures = [r.exc_info[1] for r in caplog.records if r.exc_info and r.exc_info[1]]
    assert any(str(exc) == "metrics backend down" for exc in failures)


def test_one_log_line_per_finished_job(client, caplog) -> None:
    reg = belay.Registry()
    belay.worker(name="logged.kind", queue="logq", backoff=lambda n: 1.0, registry=reg)(
        lambda ctx: 1 / 0)
    job = client.enqueue("logged.kind", queue="logq")
    caplog.set_level(logging.INFO, logger="belay.worker")
    assert make_worker(client, reg, ("logq",)).drain() == {"retry": 1}
    lines = [r.getMessage() for r in caplog.records
             if r.name == "belay.worker" and f"job {job.id} " in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    for part in (f"job {job.id} ", "logged.kind", "queue=logq", "retry", "attempt=1"):
        assert part in line, (part, line)


# -- lifecycle -------------------------------------------------------------------------------------


def test_start_and_stop_are_idempotent_and_name_their_threads(client, sql_conn) -> None:
    reg = belay.Registry()
    belay.worker(name="life", registry=reg)(lambda ctx: "ok")
    worker = make_worker(client, reg, {"a": 2, "b": 1}, notify=True)
    assert worker.stop() == []  # never started
    worker.start()
    worker.start()
    try:
        names = alive_worker_threads()
        assert sorted(n for n in names if n.startswith("belay-exec-")) == [
            "belay-exec-0", "belay-exec-1", "belay-exec-2"]
        assert {n for n in names if not n.startswith("belay-exec-")} == {
            "belay-producer-a", "belay-producer-b", "belay-heartbeat", "belay-sweeper",
            "belay-listener", "belay-poller", "belay-queues"}
        assert len(names) == 10  # the second start() started nothing
        ends = Ends(worker)
        client.enqueue("life", queue="b")
        ends.wait_for(1)
    finally:
        assert worker.stop() == []
    assert worker.stop() == []
    assert [n for n in alive_worker_threads() if not n.startswith("belay-exec-")] == []
    assert_worker_threads_gone()


def test_a_stopped_worker_can_start_again(client) -> None:
    reg = belay.Registry()
    belay.worker(name="again", registry=reg)(lambda ctx: "ok")
    worker = make_worker(client, reg)
    ends = Ends(worker)
    for round_ in range(2):
        with running(worker):
            client.enqueue("again")
            ends.wait_for(round_ + 1)
    assert [e.outcome for e in ends.events] == ["succeeded", "succeeded"]
    assert_worker_threads_gone()


def test_stop_after_the_grace_leaves_a_running_job_to_reclaim(client, sql_conn) -> None:
    reg = belay.Registry()
    started, release, returned = threading.Event(), threading.Event(), threading.Event()

    @belay.worker(name="stuck", registry=reg)
    def stuck(ctx: belay.Context) -> str:
        started.set()
        try:
            release.wait(10)
            return "finally"
        finally:
            returned.set()

    worker = make_worker(client, reg, {"default": 1}, node_id="leaving")
    worker.start()
    try:
        job = client.enqueue(stuck)
        assert started.wait(5)
        begun = time.monotonic()
        assert worker.stop(grace=0.2) == [job.id]
        assert time.monotonic() - begun < 3
        # Only the executor still running user code outlives stop().
        assert alive_worker_threads() == ["belay-exec-0"]
        row = job_row(sql_conn, job.id)
        assert (row["state"], row["attempt"], row["leased_by"]) == ("running", 1, "leaving")
    finally:
        release.set()
    assert returned.wait(5)
    for thread in threading.enumerate():
        if thread.name == "belay-exec-0":
            thread.join(5)
    assert_worker_threads_gone()
    assert job_row(sql_conn, job.id)["state"] == "running"  # left for reclaim, not acked


def test_stop_waits_for_running_jobs_within_the_grace(client, sql_conn) -> None:
    reg = belay.Registry()
    started, release = threading.Event(), threading.Event()

    @belay.worker(name="finishing", registry=reg)
    def finishing(ctx: belay.Context) -> str:
        started.set()
        release.wait(10)
        return "finished"

    worker = make_worker(client, reg)
    worker.start()
    job = client.enqueue(finishing)
    assert started.wait(5)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    try:
        assert worker.stop(grace=5) == []
    finally:
        timer.cancel()
        release.set()
    assert job_row(sql_conn, job.id)["state"] == "succeeded"


# -- belay.testing ---------------------------------------------------------------------------------


def test_testing_drain_runs_jobs_here_and_counts_outcomes(client, sql_conn) -> None:
    reg = belay.Registry()
    threads: list[threading.Thread] = []

    @belay.worker(name="mixed", max_attempts=1, registry=reg)
    def mixed(ctx: belay.Context) -> Any:
        threads.append(threading.current_thread())
        action = ctx.input["do"]
        if action == "fail":
            raise ValueError("x")
        if action == "cancel":
            raise belay.Cancel("y")
        if action == "snooze":
            raise belay.Snooze(30)
        return action

    for action in ("ok", "ok", "ok", "fail", "cancel", "snooze"):
        client.enqueue(mixed, {"do": action}, queue="a" if action == "ok" else "b")
    client.enqueue("unknown.kind", queue="b")
    client.enqueue(mixed, {"do": "ok"}, queue="not-drained")
    counts = belay.testing.drain(["a", "b"], client=client, registry=reg)
    assert counts == {"succeeded": 3, "failed": 1, "cancelled": 1, "snooze": 1, "unknown": 1}
    assert set(threads) == {threading.current_thread()}
    assert_worker_threads_gone()
    assert rows_by_state(sql_conn) == {"succeeded": 3, "failed": 1, "cancelled": 1, "ready": 3}
    assert belay.testing.drain("a", client=client, registry=reg) == {}


def test_a_sim_clock_runs_a_retry_only_once_time_passes_its_backoff(db_url) -> None:
    assert belay.testing.SimClock is belay.ManualClock
    clock = belay.testing.SimClock(START)
    reg = belay.Registry()
    attempts: list[int] = []

    @belay.worker(name="second.time", backoff=lambda n: 10.0, registry=reg)
    def second_time(ctx: belay.Context) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")
        return "ok"

    with belay.Belay(db_url, clock=clock) as sim:
        job = sim.enqueue(second_time)
        assert belay.testing.drain(client=sim, registry=reg) == {"retry": 1}
        assert belay.testing.drain(client=sim, registry=reg) == {}
        clock.advance(9.99)
        assert belay.testing.drain(client=sim, registry=reg) == {}
        clock.advance(0.01)
        assert belay.testing.drain(client=sim, registry=reg) == {"succeeded": 1}
        assert sim.await_result(job.id, timeout=1) == "ok"
    assert attempts == [1, 2]


def test_drain_stops_at_max_jobs(client) -> None:
    reg = belay.Registry()
    belay.worker(name="many", registry=reg)(lambda ctx: None)
    client.enqueue_many([{"kind": "many"} for _ in range(5)])
    assert belay.testing.drain(client=client, registry=reg, max_jobs=2) == {"succeeded": 2}
    assert belay.testing.drain(client=client, registry=reg) == {"succeeded": 3}


# -- enqueue with a worker's defaults --------------------------------------------------------------


def test_a_workers_defaults_apply_to_its_enqueues_unless_given(client, sql_conn, db_url,
                                                                  clock, restore_default) -> None:
    reg = belay.Registry()

    @belay.worker(name="mail", queue="mailers", max_attempts=5, priority=3, unique="welcome",
                  registry=reg)
    def mail(ctx: belay.Context) -> Any:
        return ctx.input

    first = mail.enqueue({"user": 1}, client=client)
    row = job_row(sql_conn, first.id)
    assert (row["kind"], row["queue"], row["max_attempts"], row["priority"], row["unique_key"],
            row["unique_mode"]) == ("mail", "mailers", 5, 3, "welcome", "incomplete")
    assert row["input"] == {"user": 1}
    duplicate = mail.enqueue({"user": 2}, client=client)  # the unique default applies
    assert duplicate.duplicate and duplicate.id == first.id

    explicit = mail.enqueue({}, client=client, queue="other", max_attempts=2, priority=-1,
                            unique="another")
    row = job_row(sql_conn, explicit.id)
    assert (row["queue"], row["max_attempts"], row["priority"], row["unique_key"]) == (
        "other", 2, -1, "another")

    belay.configure(db_url, clock=clock)
    via_module = belay.enqueue(mail, {"user": 3}, unique="third")
    via_default = mail.enqueue({"user": 4}, unique="fourth")  # no client: the default one
    for job in (via_module, via_default):
        row = job_row(sql_conn, job.id)
        assert (row["queue"], row["max_attempts"], row["priority"]) == ("mailers", 5, 3)
    assert belay.enqueue(mail, {"user": 5}).id == first.id  # still the holder of "welcome"

    assert belay.testing.drain("mailers", client=client, registry=reg) == {"succeeded": 3}
    assert client.get_job(via_default.id).result == {"user": 4}  # type: ignore[union-attr]


def test_a_worker_rejects_bad_options(client) -> None:
    reg = belay.Registry()
    for queues, options in [
        ({}, {}),
        ({"q": 0}, {}),
        ({"q": True}, {}),
        ({"": 1}, {}),
        ("default", {}),
        (("default",), {"lease_ttl": 0}),
        (("default",), {"poll_interval": -1}),
        (("default",), {"busy_poll": 1.0, "poll_interval": 0.5}),
        (("default",), {"shutdown_grace": -1}),
        (("default",), {"sweep_interval": True}),
    ]:
        with pytest.raises(belay.ConfigurationError):
            belay.Worker(queues, client=client, registry=reg, **options)
    named = belay.Worker(["x", "y"], client=client, registry=reg).queues
    assert {name: spec.limit for name, spec in named.items()} == {"x": 10, "y": 10}


def test_a_worker_refuses_to_start_on_an_unmigrated_database(empty_db_url) -> None:
    with belay.Belay(empty_db_url) as bare:
        worker = belay.Worker(client=bare, registry=belay.Registry())
        with pytest.raises(belay.SchemaError):
            worker.start()
        assert_worker_threads_gone()
        with pytest.raises(belay.SchemaError):
            worker.drain()


def test_without_notify_the_worker_sends_no_notifications(client, sql_conn, notes) -> None:
    """pg_notify serializes commits, so the worker's sends are opt-in (notify=True)."""
    job_id = running_job(sql_conn, max_attempts=1, lease_until=START - timedelta(seconds=1))
    assert reclaim(client) == 1
    assert job_row(sql_conn, job_id)["state"] == "failed"
    assert notes.received() == []
