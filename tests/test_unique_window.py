"""Window uniqueness end to end (contract §5.2, §11.7) on a ManualClock.

``unique_mode = 'window'``: the key embeds its bucket, ``<key>@<floor(epoch /
window)>``, and one job per key per bucket is admitted whatever became of it —
succeeded, failed or cancelled; the next bucket admits a new one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

import belay
from belay.testing import drain
from tests.helpers import START, insert_job

Conn = psycopg.Connection[Any]
KIND = "test.window"
HOUR = 3600


def bucket(when: Any, window: int) -> int:
    """§5.2 spelled out independently of belay: floor(epoch_seconds / window)."""
    return int(when.timestamp() // window)


def hourly(key: str = "report") -> belay.Unique:
    return belay.Unique(key, mode="window", window=HOUR)


@pytest.fixture
def registry() -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name=KIND, registry=reg)
    def report(ctx: belay.Context) -> Any:
        if ctx.input.get("fail"):
            raise RuntimeError("boom")
        return {"n": ctx.input["n"]}

    return reg


def test_the_key_embeds_the_floored_bucket(client: belay.Belay, clock: belay.ManualClock,
                                           sql_conn: Conn) -> None:
    clock.set(START + timedelta(seconds=100))
    job = client.enqueue(KIND, {}, unique=belay.Unique("sync", mode="window", window=90))
    expected = f"sync@{int(START.timestamp() + 100) // 90}"
    assert (job.unique_key, job.unique_mode, job.duplicate) == (expected, "window", False)
    assert sql_conn.execute("SELECT unique_key, unique_mode FROM belay_jobs").fetchall() == [
        (expected, "window")]


def test_a_second_job_in_the_same_bucket_is_a_duplicate_of_the_first(
    client: belay.Belay, clock: belay.ManualClock
) -> None:
    first = client.enqueue(KIND, {"n": 1}, unique=hourly())
    assert first.unique_key == f"report@{bucket(START, HOUR)}"
    clock.advance(HOUR - 1)  # the bucket's last second
    again = client.enqueue(KIND, {"n": 2}, unique=hourly())
    assert again.duplicate and again.id == first.id and again.input == {"n": 1}
    # Other keys and other windows are other buckets.
    assert not client.enqueue(KIND, {"n": 3}, unique=hourly("other")).duplicate


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "cancelled"])
def test_the_window_dedupes_whatever_the_first_jobs_outcome(
    client: belay.Belay, clock: belay.ManualClock, registry: belay.Registry, outcome: str
) -> None:
    first = client.enqueue(KIND, {"n": 1, "fail": outcome == "failed"}, unique=hourly(),
                           max_attempts=1)
    if outcome == "cancelled":
        assert client.cancel_job(first.id) == "cancelled"
    else:
        assert drain(client=client, registry=registry) == {outcome: 1}
    clock.advance(1800)
    again = client.enqueue(KIND, {"n": 2}, unique=hourly())
    assert (again.duplicate, again.id, again.state) == (True, first.id, outcome)


def test_incomplete_mode_by_contrast_admits_a_new_job_once_the_first_finished(
    client: belay.Belay, registry: belay.Registry
) -> None:
    first = client.enqueue(KIND, {"n": 1}, unique="report")
    assert client.enqueue(KIND, {"n": 2}, unique="report").duplicate
    drain(client=client, registry=registry)
    second = client.enqueue(KIND, {"n": 3}, unique="report")
    assert not second.duplicate and second.id != first.id


def test_the_next_bucket_admits_a_new_job(
    client: belay.Belay, clock: belay.ManualClock, registry: belay.Registry
) -> None:
    first = client.enqueue(KIND, {"n": 1}, unique=hourly())
    drain(client=client, registry=registry)
    clock.set(START + timedelta(hours=1))  # exactly the next bucket's first instant
    second = client.enqueue(KIND, {"n": 2}, unique=hourly())
    assert not second.duplicate and second.id != first.id
    assert second.unique_key == f"report@{bucket(START, HOUR) + 1}"
    clock.advance(59 * 60)
    third = client.enqueue(KIND, {"n": 3}, unique=hourly())
    assert (third.duplicate, third.id) == (True, second.id)


def test_one_batch_dedupes_within_itself(client: belay.Belay) -> None:
    jobs = client.enqueue_many([
        {"kind": KIND, "input": {"n": 1}, "unique": hourly()},
        {"kind": KIND, "input": {"n": 2}, "unique": hourly()},
        {"kind": KIND, "input": {"n": 3}, "unique": {"key": "report", "mode": "window",
                                                     "window": HOUR}},
    ])
    assert [j.duplicate for j in jobs] == [False, True, True]
    assert {j.id for j in jobs} == {jobs[0].id}


def test_a_window_key_another_implementation_wrote_is_honoured(
    client: belay.Belay, sql_conn: Conn
) -> None:
    foreign = insert_job(sql_conn, kind=KIND, state="succeeded", unique_mode="window",
                         unique_key=f"report@{bucket(START, HOUR)}", finished_at=START)
    again = client.enqueue(KIND, {"n": 1}, unique=hourly())
    assert (again.duplicate, again.id) == (True, foreign)


def test_window_needs_a_positive_integer_window(client: belay.Belay) -> None:
    for window in (None, 0, -5, 1.5, True):
        with pytest.raises(belay.ValidationError, match="window=<seconds>"):
            client.enqueue(KIND, unique=belay.Unique("k", mode="window", window=window))  # type: ignore[arg-type]
