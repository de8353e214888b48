"""A worker process for the kill -9 test of ``tests/test_budget_pause.py``:
``python -m tests.budget_worker URL NODE``.

It runs ``budget.loop``, ``input["steps"]`` steps of ``input["usd"]`` each;
every step's work records itself in ``step_effects`` first. Its
``on_budget`` hook holds attempt 1 at the crossing point: after the crossing
step's journal write, before the park. It records the hold in ``held`` and
sleeps, so the test can kill the process exactly there.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psycopg

import belay
from belay.budget import BudgetNotice

registry = belay.Registry()


def no_backoff(attempt: int) -> float:
    return 0.0


@belay.worker(name="budget.loop", queue="q", backoff=no_backoff, registry=registry)
def loop(ctx: belay.Context) -> int:
    usd = float(ctx.input["usd"])
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        for n in range(1, int(ctx.input["steps"]) + 1):
            name = f"s{n}"

            def work(name: str = name) -> str:
                conn.execute("INSERT INTO step_effects VALUES (%s, %s, %s, %s)",
                             (ctx.id, name, ctx.attempt, os.getpid()))
                return name

            ctx.step(name, work, cost=belay.Cost(usd=usd))
    return n


def main(url: str, node: str) -> None:
    worker = belay.Worker({"q": 2}, url=url, registry=registry, lease_ttl=1.0,
                          sweep_interval=0.2, poll_interval=0.1, node_id=node)

    @worker.on_budget
    def hold(notice: BudgetNotice) -> Any:
        if notice.event == "paused" and belay.current_context().attempt == 1:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("INSERT INTO held VALUES (%s, %s)", (notice.job_id, os.getpid()))
            time.sleep(600)

    worker.run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
