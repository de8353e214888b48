"""Cron on running workers: the Worker runs a scheduler (§8.5) and a slot fires
exactly once however many workers tick it."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import belay
from tests.helpers import START, wait_until


def cron_jobs(sql_conn) -> list[tuple[str, object, str]]:
    return [(r[0], r[1], r[2]) for r in sql_conn.execute(
        "SELECT cron_name, cron_slot, state FROM belay_jobs WHERE cron_name IS NOT NULL "
        "ORDER BY cron_slot")]


def test_three_running_workers_fire_each_slot_once_and_run_it(db_url, clock, sql_conn) -> None:
    registry = belay.Registry()
    ran: list[int] = []
    lock = threading.Lock()

    @belay.worker(name="t.tick", registry=registry)
    def tick(ctx: belay.Context) -> None:
        with lock:
            ran.append(ctx.id)

    clock.set(START.replace(second=5))
    clients = [belay.Belay(db_url, clock=clock) for _ in range(3)]
    workers = [
        belay.Worker({"default": 2}, client=c, registry=registry, poll_interval=0.05,
                     busy_poll=0.01, cron_interval=0.02,
                     crons=[{"name": "every", "expression": "* * * * *", "worker": tick}])
        for c in clients
    ]
    try:
        for worker in workers:
            worker.start()
        wait_until(lambda: len(ran) == 1, "the first slot's job ran")
        for minute in range(1, 4):
            for worker in workers:
                worker.cron.ticked.clear()
            clock.set(START.replace(second=5) + timedelta(minutes=minute))
            # Every scheduler ticks (at least once) at the new minute.
            for worker in workers:
                wait_until(worker.cron.ticked.is_set, "a tick at the new minute")
            wait_until(lambda m=minute: len(ran) == m + 1, "the slot's job ran")
    finally:
        for worker in workers:
            worker.stop()
        for c in clients:
            c.close()
    slots = [slot for _, slot, _ in cron_jobs(sql_conn)]
    assert slots == [START.replace(second=0) + timedelta(minutes=m) for m in range(4)]
    assert {state for _, _, state in cron_jobs(sql_conn)} == {"succeeded"}
    assert len(ran) == len(set(ran)) == 4


def test_a_dynamic_cron_fires_on_a_worker_without_static_crons(client, clock, sql_conn) -> None:
    registry = belay.Registry()

    @belay.worker(name="t.dyn", registry=registry)
    def dyn(ctx: belay.Context) -> str:
        return "fired"

    clock.set(START.replace(second=10))
    client.put_cron("nightly", "* * * * *", "t.dyn")
    worker = belay.Worker({"default": 1}, client=client, registry=registry,
                          poll_interval=0.05, busy_poll=0.01, cron_interval=0.02)
    with worker:
        wait_until(lambda: [s for _, _, s in cron_jobs(sql_conn)] == ["succeeded"],
                   "the dynamic cron's slot ran")
    assert not worker.cron.running
    assert not any(t.name == "belay-cron" for t in threading.enumerate())


def test_catch_up_longer_than_retention_is_refused(client) -> None:
    crons = [{"name": "hourly", "expression": "@hourly", "worker": "t.x", "catch_up": 7_200}]
    with pytest.raises(belay.ConfigurationError, match="shortest retention"):
        belay.Worker({"default": 1}, client=client, crons=crons,
                     retention={"succeeded": 3_600})
    # Within retention, or with every state kept forever, it's fine.
    belay.Worker({"default": 1}, client=client, crons=crons)
    belay.Worker({"default": 1}, client=client, crons=crons,
                 retention={"succeeded": None, "failed": None, "cancelled": None})
