"""The enqueue paths on belay's own connection (docs/performance.md): one
statement that inserts and pokes for a single job or a small batch, and a
COPY for a large batch no row of which can conflict. Both return jobs built
on the client, not read back, so each is checked against the stored row."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import belay
from belay import JobSpec
from belay.client import COPY_AT
from tests.helpers import START, count_jobs

OPTIONS: list[dict[str, Any]] = [
    {},
    {"queue": "mailers", "priority": 3, "max_attempts": 5},
    {"delay": 30},
    {"run_at": START + timedelta(days=2)},
    {"budget": {"usd": 1.25, "tokens": 20_000}},
    {"meta": {"trace": "abc", "nested": {"k": [1, 2]}}, "partition_key": "tenant-7"},
    {"input": {"z": 1, "a": [1.5, None, "é"], "big": 2**70}},
]


def specs(count: int) -> list[JobSpec]:
    made = []
    for i in range(count):
        options = dict(OPTIONS[i % len(OPTIONS)])
        made.append(JobSpec(f"kind{i % 3}", options.pop("input", {"i": i}), **options))
    return made


def assert_stored(client: belay.Belay, jobs: list[belay.Job]) -> None:
    """Every returned job equals its row read back, field by field."""
    for job in jobs:
        stored = client.get_job(job.id)
        assert stored is not None
        assert job == stored, (job, stored)


@pytest.mark.parametrize("count", [1, 5, COPY_AT - 1, COPY_AT, 3 * COPY_AT])
def test_returned_jobs_are_the_stored_rows_in_input_order(client, sql_conn, count):
    jobs = client.enqueue_many(specs(count))
    assert len(jobs) == count == count_jobs(sql_conn)
    assert [job.id for job in jobs] == sorted(job.id for job in jobs)
    assert [job.kind for job in jobs] == [f"kind{i % 3}" for i in range(count)]
    assert_stored(client, jobs)


def test_a_single_enqueue_is_the_stored_row(client):
    for options in OPTIONS:
        options = dict(options)
        job = client.enqueue("one", options.pop("input", {"n": 1}), **options)
        assert_stored(client, [job])
        assert job.duplicate is False and job.attempt == 0 and job.errors == []


def test_a_large_batch_with_a_held_key_skips_only_that_row(client, sql_conn):
    holder = client.enqueue("k", unique="taken")
    batch = specs(2 * COPY_AT)
    batch[7] = JobSpec("other", {"x": 1}, unique="taken")
    jobs = client.enqueue_many(batch)
    assert jobs[7].duplicate is True and jobs[7].id == holder.id
    assert [job.duplicate for i, job in enumerate(jobs) if i != 7] == [False] * (2 * COPY_AT - 1)
    assert count_jobs(sql_conn) == 2 * COPY_AT
    assert_stored(client, [job for job in jobs if not job.duplicate])


@pytest.mark.parametrize("count", [1, COPY_AT - 1, COPY_AT])
def test_a_failing_batch_writes_nothing_and_pokes_nobody(client, sql_conn, notes, count):
    """Each path is one transaction: a row the database refuses takes the
    whole batch (and its wake-up) with it."""
    sql_conn.execute("ALTER TABLE belay_jobs ADD CONSTRAINT no_sevens CHECK (priority <> 7)")
    batch = [JobSpec("k", {"i": i}, priority=7 if i == count - 1 else 0) for i in range(count)]
    with pytest.raises(psycopg.errors.CheckViolation):
        client.enqueue_many(batch)
    assert count_jobs(sql_conn) == 0
    assert notes.received() == []


@pytest.mark.parametrize("count", [1, COPY_AT - 1, 2 * COPY_AT])
def test_each_path_pokes_each_queue_once(client, notes, count):
    client.enqueue_many([JobSpec("k", {"i": i}, queue=("a", "b")[i % 2]) for i in range(count)])
    pokes = sorted(note["q"] for note in notes.received() if note["t"] == "p")
    assert pokes == (["a"] if count == 1 else ["a", "b"])


def test_no_poke_without_notify(db_url, notes):
    with belay.Belay(db_url, notify=False) as quiet:
        quiet.enqueue("k")
        quiet.enqueue_many(specs(COPY_AT))
    assert notes.received() == []


def test_racing_batches_each_keep_their_order(db_url, sql_conn):
    """Threads enqueueing large and small batches at once: each batch's ids
    ascend in its input order and every returned job is its stored row."""
    results: list[list[belay.Job]] = []
    errors: list[BaseException] = []
    with belay.Belay(db_url, max_pool_size=6) as shared:
        gate = threading.Barrier(6)

        def body(index: int) -> None:
            try:
                gate.wait()
                for round_ in range(4):
                    size = COPY_AT * 2 if (index + round_) % 2 else 3
                    results.append(shared.enqueue_many(specs(size)))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        for batch in results:
            assert [job.id for job in batch] == sorted(job.id for job in batch)
            assert_stored(shared, batch)
    total = sum(len(batch) for batch in results)
    assert count_jobs(sql_conn) == total
    assert len({job.id for batch in results for job in batch}) == total


def test_a_callers_transaction_still_owns_the_batch(client, direct_url, sql_conn):
    """On a caller's connection nothing commits until the caller does, COPY-sized or not."""
    with psycopg.connect(direct_url) as conn:
        client.enqueue_many(specs(2 * COPY_AT), conn=conn)
        client.enqueue("single", conn=conn)
        assert count_jobs(sql_conn) == 0
        conn.rollback()
    assert count_jobs(sql_conn) == 0
