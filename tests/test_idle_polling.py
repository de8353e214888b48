"""Idle polling, coalesced (§9.1): once a queue's claims at the idle ceiling
find nothing, its producer stops claiming on its own, and the ``belay-poller``
thread's one read per ``poll_interval`` wakes it when work arrives — so an idle
node with many queues costs one query per interval, not one claim per queue.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import belay
from belay import store
from belay.parts import producer
from tests.helpers import Ends, wait_until
from tests.test_worker import make_worker, running

QUEUES = {f"q{n}": 2 for n in range(5)}


class _Counts:
    def __init__(self, monkeypatch: Any) -> None:
        self.claims = 0
        self.probes = 0
        #: Claims by queue (store.claim's second argument).
        self.by_queue: Counter[str] = Counter()
        self._lock = threading.Lock()
        claim, probe = store.claim, store.queues_with_work

        def counted_claim(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.claims += 1
                self.by_queue[args[1]] += 1
            return claim(*args, **kwargs)

        def counted_probe(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.probes += 1
            return probe(*args, **kwargs)

        monkeypatch.setattr(store, "claim", counted_claim)
        monkeypatch.setattr(store, "queues_with_work", counted_probe)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.claims, self.probes

    def claims_by_queue(self) -> Counter[str]:
        with self._lock:
            return Counter(self.by_queue)


def test_idle_queues_stop_claiming_and_the_poller_wakes_them(client, monkeypatch) -> None:
    monkeypatch.setattr(producer, "IDLE_BACKSTOP", 10_000)  # only the poller wakes them
    counts = _Counts(monkeypatch)
    reg = belay.Registry()
    belay.worker(name="idle.kind", registry=reg)(lambda ctx: ctx.input["n"])
    worker = make_worker(client, reg, QUEUES, poll_interval=0.05, busy_poll=0.01)
    ends = Ends(worker)
    with running(worker):
        wait_until(lambda: len(worker.producers.idle) == len(QUEUES), "every queue idle")
        claims, probes = counts.snapshot()
        time.sleep(0.5)  # ten poll intervals of an idle node
        claims_after, probes_after = counts.snapshot()
        before = counts.claims_by_queue()
        assert claims_after == claims  # no queue claimed on its own
        assert probes_after - probes >= 5  # one shared read per interval did the looking
        job = client.enqueue("idle.kind", {"n": 3}, queue="q3")
        (event,) = ends.wait_for(1)
        assert (event.job.id, event.outcome) == (job.id, "succeeded")
        assert client.await_result(job.id, timeout=5) == 3
        # Only q3 was woken to claim (it claims on while its slot frees and
        # for HOT_WINDOW after, as many times as the machine's pace allows).
        woken = counts.claims_by_queue() - before
        assert set(woken) == {"q3"}


def test_a_job_coming_due_wakes_an_idle_queue(client, clock, monkeypatch) -> None:
    monkeypatch.setattr(producer, "IDLE_BACKSTOP", 10_000)  # only the poller wakes it
    reg = belay.Registry()
    belay.worker(name="due.kind", registry=reg)(lambda ctx: "due")
    worker = make_worker(client, reg, {"later": 1}, poll_interval=0.05, busy_poll=0.01)
    ends = Ends(worker)
    job = client.enqueue("due.kind", queue="later", delay=timedelta(minutes=5))
    with running(worker):
        wait_until(lambda: len(worker.producers.idle) == 1, "the queue idle")
        clock.advance(301)
        (event,) = ends.wait_for(1)
    assert (event.job.id, event.outcome) == (job.id, "succeeded")


def test_an_idle_queue_claims_nothing_of_its_own_while_the_poller_reads(
    client, monkeypatch
) -> None:
    """Each idle queue's backstop (``IDLE_BACKSTOP`` poll intervals: 1 s here)
    runs out three times over, and no queue claims: the poller is reading.
    (Each looked on its own before: 100 idle queues on 4 processes sent 40
    claims a second.)"""
    counts = _Counts(monkeypatch)
    reg = belay.Registry()
    belay.worker(name="idle.kind", registry=reg)(lambda ctx: None)
    worker = make_worker(client, reg, QUEUES, poll_interval=0.05, busy_poll=0.01)
    with running(worker):
        wait_until(lambda: len(worker.producers.idle) == len(QUEUES), "every queue idle")
        claims, probes = counts.snapshot()
        time.sleep(0.05 * producer.IDLE_BACKSTOP * 3.5)
        claims_after, probes_after = counts.snapshot()
    assert claims_after == claims
    assert probes_after - probes >= 10


def test_a_stuck_poller_leaves_idle_queues_to_their_own_backstop(
    client, sql_conn, monkeypatch
) -> None:
    """The poller's read hangs (a connection that never answers): once it
    has not finished a round for ``POLLER_STALE`` (5 s), an idle queue looks
    on its own when its backstop runs out, and finds the job no one announced."""
    stuck, release = threading.Event(), threading.Event()
    probe = store.queues_with_work

    def hanging(*args: Any, **kwargs: Any) -> Any:
        if stuck.is_set():
            release.wait(60)
        return probe(*args, **kwargs)

    monkeypatch.setattr(store, "queues_with_work", hanging)
    reg = belay.Registry()
    belay.worker(name="idle.kind", registry=reg)(lambda ctx: "found")
    worker = make_worker(client, reg, {"lone": 1}, poll_interval=0.05, busy_poll=0.01)
    ends = Ends(worker)
    with running(worker):
        try:
            wait_until(lambda: len(worker.producers.idle) == 1, "the queue idle")
            stuck.set()
            (job_id,) = sql_conn.execute(
                "INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, "
                "inserted_at) VALUES ('idle.kind', 'lone', 'ready', '{}', 0, 5, now()) "
                "RETURNING id").fetchone()
            (event,) = ends.wait_for(1, timeout=60)
            assert (event.job.id, event.outcome) == (job_id, "succeeded")
        finally:
            release.set()


def test_a_listening_worker_claims_once_per_job_that_trickles_in(client, monkeypatch) -> None:
    """Jobs arriving one at a time, each after the last finished: while the
    worker LISTENs, each is claimed once — woken by its enqueue's poke — and
    neither a freed slot nor a hot spell claims again for nothing. (Polling
    hot after each job made 9 claims a job at 5 jobs/s.)"""
    counts = _Counts(monkeypatch)
    reg = belay.Registry()
    belay.worker(name="trickle.kind", registry=reg)(lambda ctx: ctx.input["n"])
    worker = make_worker(client, reg, {"trickle": 5}, poll_interval=0.5, busy_poll=0.01,
                         notify=True)
    ends = Ends(worker)
    with running(worker):
        wait_until(lambda: worker._listener is not None and worker._listener.listening.is_set(),
                   "the worker listening")
        wait_until(lambda: len(worker.producers.idle) == 1, "the queue idle")
        claims, _ = counts.snapshot()
        for n in range(8):
            job = client.enqueue("trickle.kind", {"n": n}, queue="trickle")
            assert ends.wait_for(n + 1)[-1].job.id == job.id
            time.sleep(0.3)  # past the hot window (0.25 s) of the old loop
        claims_after, _ = counts.snapshot()
    assert claims_after - claims <= 8 + 2, counts.claims_by_queue()
