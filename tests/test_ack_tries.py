"""An ack tried again after its connection failed (issue 38, hardening).

A try of an ack that failed may have committed: the connection can go with
the reply. A second try is harmless for most outcomes — the row moved on and
the fence refuses it — but a snooze puts the attempt back down: once it is
due, the job can be claimed again at the same attempt, and the second try
would pass the fence and end the new claim's run while it runs. These tests
kill the worker pool's connection in the real database so that the
completer's first try fails, as it would when the database blinks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from belay import store
from belay.job import Job
from belay.outcome import Outcome
from belay.parts.completer import Completer, ack_on
from belay.parts.pool import WorkerPool
from tests.helpers import START, job_row, running_job


@pytest.fixture
def completer(client: Any) -> Iterator[Completer]:
    pools = WorkerPool(client)
    pools.open([]).wait(30)  # its one connection made
    try:
        yield Completer(pools, lambda: START, notify=False, on_batched=lambda *_: None,
                        on_batch_failed=lambda *_: None)
    finally:
        pools.close()


def break_pooled_connection(completer: Completer, sql_conn: psycopg.Connection[Any]) -> None:
    """End, from the server's side, the backend of the pool's one idle
    connection: the next statement sent on it fails (OperationalError)."""
    pool = completer._pools.pool
    assert pool is not None and pool.get_stats()["pool_available"] == 1
    with pool.connection() as conn:
        pid = conn.info.backend_pid
    sql_conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 30
    while sql_conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone() is not None:
        assert time.monotonic() < deadline, "the backend did not end"
        time.sleep(0.05)


def claimed(conn: psycopg.Connection[Any]) -> Job:
    return Job(id=running_job(conn), kind="test.kind", queue="default", state="running",
               attempt=1)


def test_a_due_snooze_is_not_sent_again_over_a_new_claim(client, sql_conn, completer) -> None:
    job = claimed(sql_conn)
    snooze = Outcome("snooze", at=START)
    # The first try of node-a's snooze committed, but its reply was lost ...
    with client.connection() as conn:
        assert ack_on(conn, job, snooze, START, lambda *_: None) is not None
    # ... and the job, due at once and its attempt back down, is claimed again.
    with client.connection() as conn:
        (again,) = store.claim(conn, "default", 1, "node-b", START, START + timedelta(seconds=30))
    assert (again.id, again.attempt) == (job.id, job.attempt)
    # node-a's completer, its connection gone, must not send the snooze again.
    break_pooled_connection(completer, sql_conn)
    assert completer.ack(job, snooze) is None
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["leased_by"]) == ("running", 1, "node-b")


def test_a_snooze_not_yet_due_is_tried_again(client, sql_conn, completer) -> None:
    """Before its due time nobody can claim the job again: the second try is safe."""
    job = claimed(sql_conn)
    break_pooled_connection(completer, sql_conn)
    assert completer.ack(job, Outcome("snooze", at=START + timedelta(minutes=1))) == "snooze"
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["leased_by"]) == ("ready", 0, None)


def test_a_retry_is_tried_again_after_a_blink(client, sql_conn, completer) -> None:
    """A retry keeps the attempt: a second try after a lost reply finds the row
    moved on (stale), and one whose first try did not land writes it."""
    job = claimed(sql_conn)
    break_pooled_connection(completer, sql_conn)
    retry = Outcome("retry", at=START, error={"error": "boom", "attempt": 1})
    assert completer.ack(job, retry) == "retry"
    assert job_row(sql_conn, job.id)["state"] == "ready"
