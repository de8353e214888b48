"""Job functions for the worker processes of ``tests/test_worker_processes.py``.

Imported only by those subprocesses (``belay worker --import tests.proc_jobs``),
never by the test process itself, so their kinds stay out of the test run's
default registry. Each run records itself in the test's side tables over a
connection of its own (autocommit), so the database shows which process ran
which attempt, whatever the job row says later:

- ``effects(job_id, attempt, pid)``: a run started;
- ``done(job_id, attempt, pid)``: a run's function got to its end;
- ``released(job_id)``: the test lets a held run finish.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

import belay

QUEUE = "q"
RECORD = "proc.record"
HOLD = "proc.hold"

#: A held run gives up after this long (the test has failed by then; the
#: process is killed by its fixture anyway).
HOLD_BOUND = 30.0


def no_backoff(attempt: int) -> float:
    """Retry at once: a reclaimed job runs again without the default 2 to 4 s wait."""
    return 0.0


def _record(conn: psycopg.Connection[Any], table: str, ctx: belay.Context) -> None:
    query = {
        "effects": "INSERT INTO effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
        "done": "INSERT INTO done (job_id, attempt, pid) VALUES (%s, %s, %s)",
    }[table]
    conn.execute(query, (ctx.id, ctx.attempt, os.getpid()))


@belay.worker(name=RECORD, queue=QUEUE, backoff=no_backoff)
def record(ctx: belay.Context) -> dict[str, Any]:
    """Record the run and succeed."""
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        _record(conn, "effects", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid()}


@belay.worker(name=HOLD, queue=QUEUE, backoff=no_backoff)
def hold(ctx: belay.Context) -> dict[str, Any]:
    """Record the run; on the attempts listed in ``input["hold"]`` (default: the
    first), wait until the test inserts ``released(job_id)``; then succeed.

    It deliberately ignores ``ctx.checkpoint()``: a run that lost its lease
    carries on to its end and tries to ack, as slow user code would.
    """
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        _record(conn, "effects", ctx)
        if ctx.attempt in ctx.input.get("hold", [1]):
            deadline = time.monotonic() + HOLD_BOUND
            while conn.execute("SELECT 1 FROM released WHERE job_id = %s", (ctx.id,)).fetchone() \
                    is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {ctx.id} was never released")
                time.sleep(0.02)
        _record(conn, "done", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid()}
