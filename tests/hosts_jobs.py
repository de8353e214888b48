"""Job functions for the worker processes of ``tests/test_many_hosts.py``.

Imported only by those subprocesses (``belay worker --import tests.hosts_jobs``),
never by the test process, so their kinds stay out of the test run's default
registry. Every run records itself over a connection of its own, straight to
the server (``$HOSTS_RECORD_URL``: the test database, never through the
pooler, so what is recorded does not depend on how the worker connects):

- ``runs``: one row per run as it starts — job, attempt, pid, node, queue,
  partition key — with the server's ``clock_timestamp()`` at the start and, in
  the same statement, how many jobs of the queue (and of the key) the database
  holds ``running`` under a live lease; ``ended`` is set, again from
  ``clock_timestamp()``, when the function's work is over.

The interval [started, ended] of a run lies inside the time its job row is
``running`` (claimed before, acked after), so overlapping intervals can only
undercount how many jobs ran at once, never overcount.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

import belay

HOLD = "hosts.hold"
TICK = "hosts.tick"
RECORD_URL = "HOSTS_RECORD_URL"

_START = """
INSERT INTO runs (job_id, attempt, pid, node, queue, tenant, started,
                  queue_running, key_running)
SELECT %(id)s, %(attempt)s, %(pid)s, %(node)s, %(queue)s, %(tenant)s, clock_timestamp(),
  (SELECT count(*) FROM belay_jobs
   WHERE queue = %(queue)s AND state = 'running' AND lease_until > clock_timestamp()),
  (SELECT count(*) FROM belay_jobs
   WHERE queue = %(queue)s AND state = 'running' AND lease_until > clock_timestamp()
     AND COALESCE(input ->> 'tenant', '') = %(tenant)s)
RETURNING id
"""
_END = "UPDATE runs SET ended = clock_timestamp() WHERE id = %s"


def no_backoff(attempt: int) -> float:
    """A failed run (none should fail) retries at once and shows as attempt 2."""
    return 0.0


def _run(ctx: belay.Context, hold: float) -> dict[str, Any]:
    with psycopg.connect(os.environ[RECORD_URL], autocommit=True) as conn:
        row = conn.execute(_START, {
            "id": ctx.id, "attempt": ctx.attempt, "pid": os.getpid(),
            "node": os.environ.get("HOSTS_NODE", ""), "queue": ctx.queue,
            "tenant": str(ctx.input.get("tenant", "")),
        }).fetchone()
        assert row is not None
        time.sleep(hold)  # the job's work
        conn.execute(_END, (row[0],))
    return {"pid": os.getpid()}


@belay.worker(name=HOLD, backoff=no_backoff)
def hold(ctx: belay.Context) -> dict[str, Any]:
    """Record the run, work for ``input["hold"]`` seconds, record its end."""
    return _run(ctx, float(ctx.input.get("hold", 0.05)))


@belay.worker(name=TICK, backoff=no_backoff)
def tick(ctx: belay.Context) -> dict[str, Any]:
    """A cron slot's job: record the run."""
    return _run(ctx, 0.0)
