"""Live event streams: subscribe_events loses and repeats nothing, and ends with the job."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg

import belay
import belay.testing
from tests.helpers import forge_result, notify, wait_until


def test_subscribe_follows_a_running_job_to_its_end(db_url):
    registry = belay.Registry()
    gate = threading.Event()

    @belay.worker(name="t.stream", registry=registry)
    def stream(ctx: belay.Context) -> int:
        for n in range(5):
            ctx.emit({"n": n})
            if n == 2:
                gate.wait(10)  # the subscriber is mid-stream now
        return 5

    with belay.Belay(db_url, registry=registry) as client:
        job = client.enqueue("t.stream")
        seen: list[Any] = []
        worker = belay.Worker(["default"], client=client, registry=registry,
                              busy_poll=0.005, poll_interval=0.05, notify=True)
        with worker:
            for event in client.subscribe_events(job.id, timeout=20):
                seen.append(event.payload)
                if event.seq == 3:
                    gate.set()
        assert seen == [{"n": n} for n in range(5)]
        assert client.get_job(job.id).state == "succeeded"


def test_resuming_after_a_seq_repeats_nothing(client):
    reg = belay.Registry()

    @belay.worker(name="t.burst", registry=reg)
    def burst(ctx: belay.Context) -> None:
        for n in range(4):
            ctx.emit({"n": n})

    job = client.enqueue("t.burst")
    belay.testing.drain(client=client, registry=reg)
    first = [e.seq for e in client.subscribe_events(job.id, after=0)]
    resumed = [e.seq for e in client.subscribe_events(job.id, after=2)]
    assert first == [1, 2, 3, 4] and resumed == [3, 4]


def test_subscribe_stops_at_its_timeout_while_the_job_waits(client):
    job = client.enqueue("t.nobody_runs_this")
    assert list(client.subscribe_events(job.id, timeout=0.2)) == []


def test_a_notifying_worker_announces_each_event(client, notes):
    reg = belay.Registry()

    @belay.worker(name="t.announce", registry=reg)
    def announce(ctx: belay.Context) -> None:
        ctx.emit({"n": 1})
        ctx.emit({"n": 2})

    job = client.enqueue("t.announce")
    belay.Worker(["default"], client=client, registry=reg, notify=True).drain()
    received = [m for m in notes.received() if m.get("t") == "e"]
    assert received == [{"t": "e", "id": job.id, "seq": 1}, {"t": "e", "id": job.id, "seq": 2}]


def test_a_quiet_worker_announces_nothing(client, notes):
    reg = belay.Registry()

    @belay.worker(name="t.quiet", registry=reg)
    def quiet(ctx: belay.Context) -> None:
        ctx.emit({"n": 1})

    client.enqueue("t.quiet")
    belay.Worker(["default"], client=client, registry=reg).drain()
    assert [m for m in notes.received() if m.get("t") == "e"] == []


def test_forged_notifications_add_no_event_and_end_nothing(client, stranger_url):
    """Issue 38: a role that may not read belay's tables sends an event and a
    result notification about a ready job. They only wake the follower, which
    reads the events table: nothing is yielded, and it follows on to its
    timeout (the job is not terminal)."""
    job = client.enqueue("t.nobody_runs_this")
    followed: list[Any] = []
    follower = threading.Thread(
        target=lambda: followed.extend(client.subscribe_events(job.id, timeout=3)))
    follower.start()
    try:
        wait_until(lambda: client._listener is not None
                   and job.id in client._listener._waiters, "the follower watches the job")
        with psycopg.connect(stranger_url, autocommit=True) as stranger:
            notify(stranger, json.dumps({"t": "e", "id": job.id, "seq": 1,
                                         "payload": {"forged": True}}))
        forge_result(stranger_url, job.id)
    finally:
        follower.join(15)
    assert not follower.is_alive()
    assert followed == []
    assert client.get_job(job.id).state == "ready"
