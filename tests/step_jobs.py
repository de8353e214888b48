"""Job functions for the worker processes of ``tests/test_steps.py``.

Imported only by those subprocesses (``belay worker --import tests.step_jobs``),
never by the test process itself, so their kinds stay out of the test run's
default registry. Every execution of a step's function records itself in the
test's side table ``step_effects(job_id, name, attempt, pid)`` over a
connection of its own (autocommit), *before* doing its work: the database
shows how many times each step's work ran, whatever the journal says.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

import belay

QUEUE = "q"
LOOP = "steps.loop"


def no_backoff(attempt: int) -> float:
    """Retry at once: a reclaimed job runs again without the default 2 to 4 s wait."""
    return 0.0


@belay.worker(name=LOOP, queue=QUEUE, backoff=no_backoff)
def loop(ctx: belay.Context) -> dict[str, Any]:
    """``input["steps"]`` costed steps ``s1``…``sN``, each taking ``input["pause"]``
    seconds of "work" (a stand-in for an LLM call) and costing
    ``Cost(usd=input["usd"], tokens=input["tokens"])``."""
    count, pause = int(ctx.input["steps"]), float(ctx.input["pause"])
    cost = belay.Cost(usd=ctx.input["usd"], tokens=ctx.input["tokens"])
    values = []
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        for n in range(1, count + 1):
            name = f"s{n}"

            def work(n: int = n, name: str = name) -> dict[str, Any]:
                conn.execute(
                    "INSERT INTO step_effects (job_id, name, attempt, pid) VALUES (%s, %s, %s, %s)",
                    (ctx.id, name, ctx.attempt, os.getpid()),
                )
                time.sleep(pause)
                return {"n": n, "square": n * n, "attempt": ctx.attempt, "pid": os.getpid()}

            values.append(ctx.step(name, work, cost=cost))
    return {"total": sum(v["square"] for v in values), "values": values}
