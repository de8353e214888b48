"""Claims for several queues in one statement (docs/performance.md): a node
serving many plain queues claims for every queue that wants work when one of
them does. Each queue still gets at most its own free slots, in its own
claim order, and an admitted queue keeps its claim of its own."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import belay
from belay import store
from tests.helpers import START, insert_job
from tests.test_worker import make_worker, running


def _ready(conn: Any, queue: str, count: int, **columns: Any) -> list[int]:
    return [insert_job(conn, queue=queue, ready_at=START - timedelta(minutes=1), **columns)
            for _ in range(count)]


def test_each_queue_gets_at_most_its_take_in_claim_order(sql_conn) -> None:
    a = _ready(sql_conn, "a", 5)
    urgent = _ready(sql_conn, "a", 1, priority=-1)
    b = _ready(sql_conn, "b", 2)
    _ready(sql_conn, "c", 3)  # not asked for
    due = insert_job(sql_conn, queue="b", state="awaiting", ready_at=START - timedelta(seconds=1),
                     await_scope="s", await_name="n")
    jobs = store.claim_queues(sql_conn, {"a": 3, "b": 5, "empty": 4}, "node-x", START,
                              START + timedelta(seconds=30))
    by_queue = Counter(job.queue for job in jobs)
    assert by_queue == {"a": 3, "b": 3}
    assert [job.id for job in jobs if job.queue == "a"] == [*urgent, *a[:2]]
    assert {job.id for job in jobs if job.queue == "b"} == {*b, due}
    assert all(job.state == "running" and job.leased_by == "node-x" and job.attempt == 1
               for job in jobs)


def test_rows_another_claimer_holds_are_skipped(sql_conn, direct_url) -> None:
    import psycopg

    ids = _ready(sql_conn, "a", 4)
    with psycopg.connect(direct_url) as other:
        held = store.claim(other, "a", 2, "other", START, START + timedelta(seconds=30))
        mine = store.claim_queues(sql_conn, {"a": 10, "b": 1}, "me", START,
                                  START + timedelta(seconds=30))
        other.rollback()
    assert {job.id for job in mine} == set(ids) - {job.id for job in held}


def test_a_node_of_many_queues_keeps_each_limit(client) -> None:
    """Racing executor threads on four queues of limit 2: no queue ever runs
    more than 2 at once, and every job runs once."""
    reg = belay.Registry()
    lock = threading.Lock()
    running_now: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    ran: Counter[int] = Counter()

    @belay.worker(name="count", registry=reg)
    def count(ctx: belay.Context) -> None:
        queue = ctx.job.queue
        with lock:
            running_now[queue] += 1
            peak[queue] = max(peak[queue], running_now[queue])
            ran[ctx.id] += 1
        threading.Event().wait(0.002)
        with lock:
            running_now[queue] -= 1

    queues = {f"q{i}": 2 for i in range(4)}
    jobs = client.enqueue_many([{"kind": "count", "queue": f"q{i % 4}", "input": {"i": i}}
                                for i in range(120)])
    worker = make_worker(client, reg, queues)
    with running(worker):
        for job in jobs:
            client.await_result(job.id, timeout=30)
    assert set(peak) == set(queues)
    assert max(peak.values()) <= 2
    assert sorted(ran) == sorted(job.id for job in jobs) and set(ran.values()) == {1}


def test_one_claim_serves_several_queues(client, monkeypatch) -> None:
    """Jobs waiting on three queues at start: claims that take for several
    queues at once, so fewer claims than queues with work."""
    reg = belay.Registry()

    @belay.worker(name="noop", registry=reg)
    def noop(ctx: belay.Context) -> None:
        return None

    calls: list[dict[str, int]] = []
    real = store.claim_queues

    def recording(conn: Any, takes: dict[str, int], *args: Any, **kwargs: Any) -> Any:
        calls.append(dict(takes))
        return real(conn, takes, *args, **kwargs)

    monkeypatch.setattr(store, "claim_queues", recording)
    jobs = client.enqueue_many([{"kind": "noop", "queue": f"q{i % 3}"} for i in range(30)])
    worker = make_worker(client, reg, {"q0": 10, "q1": 10, "q2": 10})
    with running(worker):
        for job in jobs:
            client.await_result(job.id, timeout=30)
    assert any(len(takes) > 1 for takes in calls)


def test_an_admitted_queue_claims_on_its_own(client, monkeypatch) -> None:
    reg = belay.Registry()

    @belay.worker(name="noop", registry=reg)
    def noop(ctx: belay.Context) -> None:
        return None

    joint: list[set[str]] = []
    real = store.claim_queues

    def recording(conn: Any, takes: dict[str, int], *args: Any, **kwargs: Any) -> Any:
        joint.append(set(takes))
        return real(conn, takes, *args, **kwargs)

    monkeypatch.setattr(store, "claim_queues", recording)
    jobs = client.enqueue_many([{"kind": "noop", "queue": q} for q in ("plain", "limited") * 5])
    worker = make_worker(client, reg, {"plain": 5, "limited": {"limit": 5, "global_limit": 2}})
    with running(worker):
        for job in jobs:
            client.await_result(job.id, timeout=30)
    assert joint and all("limited" not in queues for queues in joint)
