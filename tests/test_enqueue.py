"""Enqueueing (contract §5): row defaults, options, uniqueness, batches, transactions."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, ClassVar

import psycopg
import pytest

import belay
from belay import JobSpec, Unique, ValidationError
from tests.helpers import START, count_jobs, job_row

# -- §5.1 row defaults -----------------------------------------------------------


def test_new_row_gets_the_contract_defaults(client, sql_conn):
    job = client.enqueue("myapp.send_email", {"user_id": 42})
    row = job_row(sql_conn, job.id)
    assert row["kind"] == "myapp.send_email"
    assert row["queue"] == "default"
    assert row["state"] == "ready"
    assert row["input"] == {"user_id": 42}
    assert row["meta"] == {}
    assert row["priority"] == 0
    assert row["attempt"] == 0
    assert row["max_attempts"] == 20
    assert row["errors"] == []
    assert row["spent_usd_micros"] == 0 and row["spent_tokens"] == 0
    assert row["cancel_requested"] is False
    assert row["ready_at"] == START and row["inserted_at"] == START
    assert row["budget_usd_micros"] is None and row["budget_tokens"] is None
    assert row["unique_key"] is None and row["unique_mode"] is None
    for column in ("lease_until", "leased_by", "started_at", "finished_at", "result"):
        assert row[column] is None
    assert job.duplicate is False


def test_now_comes_from_the_injected_clock(client, clock, sql_conn):
    clock.advance(3600)
    job = client.enqueue("k")
    assert job_row(sql_conn, job.id)["inserted_at"] == START + timedelta(hours=1)


def test_options_land_in_their_columns(client, sql_conn):
    job = client.enqueue(
        "myapp.send_email",
        {"user_id": 42},
        queue="mailers",
        priority=3,
        delay=30,
        max_attempts=5,
        budget={"usd": 1.0, "tokens": 20_000},
        meta={"trace": "abc", "nested": {"k": [1, 2]}},
        partition_key="tenant-7",
    )
    row = job_row(sql_conn, job.id)
    assert row["queue"] == "mailers"
    assert row["priority"] == 3
    assert row["ready_at"] == START + timedelta(seconds=30)
    assert row["inserted_at"] == START
    assert row["max_attempts"] == 5
    assert row["budget_usd_micros"] == 1_000_000
    assert row["budget_tokens"] == 20_000
    assert row["meta"] == {"trace": "abc", "nested": {"k": [1, 2]}}
    assert row["partition_key"] == "tenant-7"
    assert job.budget_usd == 1.0


def test_run_at_schedules_at_an_aware_time(client, sql_conn):
    at = datetime(2026, 3, 2, 9, 30, tzinfo=timezone(timedelta(hours=2)))
    job = client.enqueue("k", run_at=at)
    assert job_row(sql_conn, job.id)["ready_at"] == at
    assert job.ready_at == at


def test_delay_accepts_a_timedelta_and_fractions(client):
    assert client.enqueue("k", delay=timedelta(minutes=2)).ready_at == START + timedelta(minutes=2)
    assert client.enqueue("k", delay=0.25).ready_at == START + timedelta(seconds=0.25)


@pytest.mark.parametrize(
    ("usd", "micros"),
    [(0.1, 100_000), (0.000001, 1), (1, 1_000_000), (Decimal("2.5"), 2_500_000), (0, 0),
     (12.345678, 12_345_678)],
)
def test_budget_usd_becomes_exact_micros(client, usd, micros):
    assert client.enqueue("k", budget={"usd": usd}).budget_usd_micros == micros


def test_worker_object_supplies_kind_and_defaults(client):
    class Worker:
        kind = "myapp.Worker"
        enqueue_defaults: ClassVar[dict[str, Any]] = {
            "queue": "ai", "max_attempts": 3, "priority": 2,
        }

    job = client.enqueue(Worker(), {"x": 1})
    assert (job.kind, job.queue, job.max_attempts, job.priority) == ("myapp.Worker", "ai", 3, 2)
    # An explicit option beats the worker's default.
    assert client.enqueue(Worker(), queue="other").queue == "other"


# -- §5.2 uniqueness ---------------------------------------------------------------


def test_incomplete_unique_returns_the_live_holder_as_duplicate(client, sql_conn):
    first = client.enqueue("k", {"n": 1}, unique="welcome:42")
    second = client.enqueue("k", {"n": 2}, unique="welcome:42")
    assert second.duplicate is True
    assert second.id == first.id
    assert second.input == {"n": 1}
    assert count_jobs(sql_conn) == 1


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_incomplete_unique_frees_the_key_once_the_holder_is_terminal(client, sql_conn, state):
    first = client.enqueue("k", unique="key")
    sql_conn.execute("UPDATE belay_jobs SET state = %s WHERE id = %s", (state, first.id))
    second = client.enqueue("k", unique="key")
    assert second.duplicate is False
    assert second.id != first.id


@pytest.mark.parametrize("state", ["running", "awaiting", "held", "paused"])
def test_incomplete_unique_holds_in_every_non_terminal_state(client, sql_conn, state):
    first = client.enqueue("k", unique="key")
    sql_conn.execute("UPDATE belay_jobs SET state = %s WHERE id = %s", (state, first.id))
    again = client.enqueue("k", unique="key")
    assert again.duplicate and again.id == first.id and again.state == state


def test_window_unique_embeds_the_bucket_and_dedupes_regardless_of_outcome(
    client, clock, sql_conn
):
    window = 60
    first = client.enqueue("k", unique=Unique("digest", mode="window", window=window))
    bucket = int(START.timestamp()) // window
    assert first.unique_key == f"digest@{bucket}"
    assert first.unique_mode == "window"
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE id = %s", (first.id,))
    same_bucket = client.enqueue("k", unique={"key": "digest", "mode": "window", "window": 60})
    assert same_bucket.duplicate and same_bucket.id == first.id
    clock.advance(window)
    next_bucket = client.enqueue("k", unique=Unique("digest", mode="window", window=window))
    assert not next_bucket.duplicate
    assert next_bucket.unique_key == f"digest@{bucket + 1}"


def test_always_unique_dedupes_forever(client, sql_conn, clock):
    first = client.enqueue("k", unique=Unique("once", mode="always"))
    sql_conn.execute("UPDATE belay_jobs SET state = 'failed' WHERE id = %s", (first.id,))
    clock.advance(days=365)
    again = client.enqueue("k", unique=Unique("once", mode="always"))
    assert again.duplicate and again.id == first.id and again.state == "failed"


def test_modes_do_not_collide_with_each_other(client):
    a = client.enqueue("k", unique=Unique("same", mode="incomplete"))
    b = client.enqueue("k", unique=Unique("same", mode="always"))
    assert not a.duplicate and not b.duplicate and a.id != b.id


def race_enqueue(client: belay.Belay, key: str, threads: int) -> list[belay.Job]:
    barrier = threading.Barrier(threads)
    results: list[belay.Job] = []
    failures: list[BaseException] = []

    def enqueue() -> None:
        try:
            barrier.wait(5)
            results.append(client.enqueue("k", unique=key))
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=enqueue) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert failures == []
    return results


def test_racing_threads_on_one_incomplete_key_insert_exactly_one_row(db_url, clock, sql_conn):
    """Two (here eight) threads enqueue the same key at once: one row, the rest duplicates."""
    threads = 8
    with belay.Belay(db_url, clock=clock, max_pool_size=threads) as client:
        for round_ in range(10):
            key = f"race-{round_}"
            results = race_enqueue(client, key, threads)
            assert len(results) == threads
            assert len({job.id for job in results}) == 1
            assert sum(not job.duplicate for job in results) == 1
            row = sql_conn.execute(
                "SELECT count(*) FROM belay_jobs WHERE unique_key = %s", (key,)
            ).fetchone()
            assert row is not None and row[0] == 1


# -- Batches ----------------------------------------------------------------------


def test_enqueue_many_returns_one_job_per_request_in_order(client, sql_conn):
    holder = client.enqueue("k", unique="taken")
    jobs = client.enqueue_many(
        [
            JobSpec("a", {"i": 0}),
            {"kind": "b", "input": {"i": 1}, "unique": "taken"},
            JobSpec("c", {"i": 2}, queue="q2", unique="fresh"),
            JobSpec("d", {"i": 3}, unique="fresh"),  # same key as the row before it
            JobSpec("e", {"i": 4}),
        ]
    )
    assert [j.kind for j in jobs] == ["a", "k", "c", "c", "e"]
    assert [j.duplicate for j in jobs] == [False, True, False, True, False]
    assert jobs[1].id == holder.id
    assert jobs[3].id == jobs[2].id
    assert jobs[0].input == {"i": 0} and jobs[4].input == {"i": 4}
    assert count_jobs(sql_conn) == 4


def test_enqueue_many_of_nothing_writes_nothing(client, sql_conn):
    assert client.enqueue_many([]) == []
    assert count_jobs(sql_conn) == 0


def test_enqueue_many_large_batch(client, sql_conn):
    jobs = client.enqueue_many([JobSpec("k", {"i": i}) for i in range(2_000)])
    assert [j.input["i"] for j in jobs] == list(range(2_000))
    assert count_jobs(sql_conn) == 2_000


def test_one_bad_request_rejects_the_whole_batch_before_sql(client, sql_conn):
    with pytest.raises(ValidationError, match="priority"):
        client.enqueue_many([JobSpec("a"), JobSpec("b", priority="high")])  # type: ignore[arg-type]
    assert count_jobs(sql_conn) == 0


def test_enqueue_many_refuses_unknown_keys_in_dicts(client, sql_conn):
    with pytest.raises(ValidationError, match="'qeue'"):
        client.enqueue_many([{"kind": "a", "qeue": "x"}])
    with pytest.raises(ValidationError, match="kind"):
        client.enqueue_many([{"input": {}}])
    with pytest.raises(ValidationError, match="JobSpec"):
        client.enqueue_many(["a"])  # type: ignore[list-item]
    assert count_jobs(sql_conn) == 0


# -- Validation: clear errors, nothing written ---------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": {"when": datetime(2026, 1, 1)}}, "not JSON-serializable"),
        ({"input": {"x": object()}}, "not JSON-serializable"),
        ({"input": {1: "int key"}}, "not JSON-serializable"),
        ({"input": {"x": float("nan")}}, "JSON cannot represent"),
        ({"input": {"x": [1, {"y": float("inf")}]}}, "JSON cannot represent"),
        ({"input": {"x": [{2**70: 1}]}}, "not JSON-serializable"),
        ({"input": {"x": 2**70, "y": {1, 2}}}, "not JSON-serializable"),
        ({"input": {"x": 2**70, "y": float("nan")}}, "JSON cannot represent"),
        ({"input": [1, 2]}, "input must be a dict"),
        ({"meta": "x"}, "meta must be a dict"),
        ({"budget": {"usd": -1}}, ">= 0"),
        ({"budget": {"tokens": -5}}, "between"),
        ({"budget": {"usd": float("nan")}}, "finite"),
        ({"budget": {"dollars": 1}}, "unknown budget key"),
        ({"budget": 5}, "budget must be a dict"),
        ({"run_at": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"delay": 5, "run_at": START}, "not both"),
        ({"delay": -1}, ">= 0"),
        ({"delay": "soon"}, "delay must be"),
        ({"unique": Unique("k", mode="forever")}, "unique mode must be one of"),  # type: ignore[arg-type]
        ({"unique": {"key": "k", "mode": "window"}}, "window=<seconds>"),
        ({"unique": {"key": "k", "mode": "window", "window": 0}}, "window=<seconds>"),
        ({"unique": {"key": "k", "window": 60}}, "only applies"),
        ({"unique": {"key": "k", "scope": "x"}}, "unknown unique option"),
        ({"unique": ""}, "non-empty"),
        ({"unique": "$spawn:1:x:0"}, "reserved"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"priority": True}, "priority must be an integer"),
        ({"priority": 2**40}, "between"),
        ({"max_attempts": 0}, "between"),
        ({"queue": ""}, "queue must be"),
        ({"partition_key": 5}, "partition_key"),
    ],
)
def test_bad_input_is_refused_before_any_sql(client, sql_conn, kwargs, message):
    with pytest.raises(ValidationError, match=message):
        client.enqueue("k", **kwargs)
    assert count_jobs(sql_conn) == 0


def test_integers_beyond_64_bits_are_stored_exactly(client, sql_conn):
    job = client.enqueue("k", {"big": 2**70, "neg": -(2**64), "nested": [{"n": 10**30}]})
    assert job.input == {"big": 2**70, "neg": -(2**64), "nested": [{"n": 10**30}]}
    row = sql_conn.execute(
        "SELECT input->>'big' FROM belay_jobs WHERE id = %s", (job.id,)
    ).fetchone()
    assert row is not None and row[0] == str(2**70)


def test_bad_kind_is_refused(client):
    with pytest.raises(ValidationError, match="kind"):
        client.enqueue("")
    with pytest.raises(ValidationError, match="kind"):
        client.enqueue(42)


def test_unknown_option_is_a_type_error(client):
    with pytest.raises(TypeError, match="qeue"):
        client.enqueue("k", qeue="x")  # type: ignore[call-arg]


# -- Transactional enqueue on the caller's connection (§5.1, §9.2) -------------------


def listen(db_url: str, channel: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(db_url, autocommit=True)
    conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    return conn


def channel_of(db_url: str) -> str:
    with psycopg.connect(db_url) as conn:
        return belay.names.notify_channel(conn.info.dbname)


def drain(conn: psycopg.Connection[Any], timeout: float = 0.5) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout)]


def test_enqueue_joins_the_callers_transaction_and_rolls_back_with_it(client, db_url, sql_conn):
    listener = listen(db_url, channel_of(db_url))
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")  # a transaction is now open
        job = client.enqueue("k", {"n": 1}, queue="mailers", conn=conn)
        assert job.id > 0
        # Not visible outside the transaction yet.
        assert count_jobs(sql_conn) == 0
        conn.rollback()
    assert count_jobs(sql_conn) == 0
    # A rolled-back transaction delivers no wake-up either.
    assert drain(listener) == []
    listener.close()


def test_enqueue_commits_with_the_callers_transaction_and_pokes_once_per_queue(
    client, db_url, sql_conn
):
    listener = listen(db_url, channel_of(db_url))
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            client.enqueue_many(
                [JobSpec("a", queue="q1"), JobSpec("b", queue="q1"), JobSpec("c", queue="q2")],
                conn=conn,
            )
            assert drain(listener, 0.2) == []  # nothing before commit
        assert count_jobs(sql_conn) == 3
    payloads = sorted(drain(listener))
    assert payloads == ['{"t":"p","q":"q1"}', '{"t":"p","q":"q2"}']
    listener.close()


def test_enqueue_as_the_first_statement_belongs_to_the_callers_transaction(
    client, db_url, sql_conn
):
    """psycopg opens a transaction at the first statement; it is the caller's to end."""
    with psycopg.connect(db_url) as conn:
        client.enqueue("k", conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()
    assert count_jobs(sql_conn) == 0
    with psycopg.connect(db_url) as conn:
        client.enqueue("k", conn=conn)
    # Leaving `with psycopg.connect()` commits, as psycopg always does.
    assert count_jobs(sql_conn) == 1


def test_enqueue_on_an_autocommit_caller_connection_commits_at_once(client, db_url, sql_conn):
    with psycopg.connect(db_url, autocommit=True) as conn:
        client.enqueue_many([JobSpec("a"), JobSpec("b")], conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert count_jobs(sql_conn) == 2


def test_enqueue_refuses_a_failed_transaction(client, db_url):
    with psycopg.connect(db_url) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(ValidationError, match="roll it back"):
            client.enqueue("k", conn=conn)


def test_duplicates_do_not_poke(client, db_url):
    client.enqueue("k", unique="x", queue="q")
    listener = listen(db_url, channel_of(db_url))
    assert client.enqueue("k", unique="x", queue="q").duplicate
    assert drain(listener) == []
    listener.close()


def test_notify_can_be_turned_off(db_url, clock):
    listener = listen(db_url, channel_of(db_url))
    with belay.Belay(db_url, clock=clock, notify=False) as quiet:
        quiet.enqueue("k")
    assert drain(listener) == []
    listener.close()
