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
