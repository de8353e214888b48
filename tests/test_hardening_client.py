"""Bad input to the Python client is a ``belay.ValidationError`` raised before any
SQL runs: the caller's transaction stays usable and nothing is written.

The regression cases come from an adversarial pass (surrogates, NUL, huge names,
overflowing delays, window-shaped ``always`` keys); the property tests drive the
same fields with hostile text from ``tests/strategies.py``.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus

import belay
from belay import JobSpec, Unique, ValidationError, names
from tests.helpers import START, count_jobs
from tests.strategies import any_text, deep, hostile_json, hostile_text

#: Hypothesis runs many examples against a real database; on a loaded 2-core
#: machine that outlasts the suite's 120 s hang guard, which is for hangs.
pytestmark = pytest.mark.timeout(600)

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def caller(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """The caller's own connection, in an open transaction (as a web view's)."""
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")
        yield conn
        conn.rollback()


def refused_before_sql(conn: psycopg.Connection[Any], call: Callable[[], Any],
                       *words: str) -> ValidationError:
    """``call`` raises ValidationError mentioning ``words``; the caller's transaction
    did not run a failing statement (it would be aborted) and holds no new job."""
    with pytest.raises(ValidationError) as info:
        call()
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    assert conn.execute("SELECT count(*) FROM belay_jobs").fetchone() == (0,)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return info.value


# -- Item 6: the wrong error types, some after SQL ran ------------------------------


@pytest.mark.parametrize("delay", [1e12, 1e20, timedelta.max, float("nan"), -1, 10**30])
def test_an_out_of_range_delay_is_a_validation_error(client, caller, delay):
    refused_before_sql(caller, lambda: client.enqueue("k", delay=delay, conn=caller), "delay")


def test_the_longest_delay_is_accepted_and_documented_as_100_years(client, sql_conn):
    job = client.enqueue("k", delay=belay.MAX_DELAY_SECONDS)
    assert job.ready_at == START + timedelta(seconds=belay.MAX_DELAY_SECONDS)
    with pytest.raises(ValidationError, match="100 years"):
        client.enqueue("k", delay=belay.MAX_DELAY_SECONDS + 1)


@pytest.mark.parametrize("field", ["kind", "queue", "unique", "partition_key"])
@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb", "nul\x00here"])
def test_surrogates_and_nul_in_names_are_validation_errors(client, caller, field, bad):
    options: dict[str, Any] = {"kind": "k", field: bad}
    error = refused_before_sql(caller, lambda: client.enqueue(**options, conn=caller))
    shown = {"unique": "unique key"}.get(field, field)
    assert shown in str(error)


@pytest.mark.parametrize("where", ["input", "meta"])
def test_a_nul_in_a_json_object_is_a_validation_error(client, caller, where):
    value = {"deep": [{"text": "before\x00after"}]}
    refused_before_sql(caller, lambda: client.enqueue("k", conn=caller, **{where: value}),
                       where, "NUL")
    # In a key too.
    refused_before_sql(caller, lambda: client.enqueue("k", conn=caller, **{where: {"\x00": 1}}),
                       "NUL")


def test_a_nul_escape_spelled_out_is_ordinary_text(client):
    # The JSON text of a backslash-u-0000 string holds "\\u0000": not a NUL.
    job = client.enqueue("k", {"text": "\\u0000"})
    assert client.get_job(job.id).input == {"text": "\\u0000"}


def test_a_queue_name_too_long_for_notify_is_a_validation_error(client, caller):
    refused_before_sql(caller, lambda: client.enqueue("k", queue="q" * 8_000, conn=caller),
                       "queue", "255 bytes")


def test_name_limits_count_utf8_bytes(client):
    client.enqueue("k" * 255)
    with pytest.raises(ValidationError, match="256 bytes"):
        client.enqueue("é" * 128)  # 128 characters, 256 bytes
    client.enqueue("k", unique="u" * 1024)
    with pytest.raises(ValidationError, match="unique key is 1025 bytes"):
        client.enqueue("k", unique="u" * 1025)


def test_signals_refuse_bad_names_scopes_and_payloads_before_sql(client, caller):
    job = client.enqueue("k")
    caller.commit()
    caller.execute("SELECT 1")
    for call in (
        lambda: client.signal_job(job.id, "go\ud800", conn=caller),
        lambda: client.signal_job(job.id, "go\x00", conn=caller),
        lambda: client.signal(f"job:{job.id}\x00", "go", conn=caller),
        lambda: client.signal_job(job.id, "go", {"x": "\x00"}, conn=caller),
        lambda: client.steer_job(job.id, {"x": deep(2_000)}, conn=caller),
        lambda: client.clear_signal(f"job:{job.id}", "go\udfff", conn=caller),
    ):
        with pytest.raises(ValidationError):
            call()
        assert caller.info.transaction_status == TransactionStatus.INTRANS
    assert caller.execute("SELECT count(*) FROM belay_signals").fetchone() == (0,)


def test_queue_cron_and_workflow_names_are_checked(client, caller):
    for call in (
        lambda: client.put_queue("q\ud800", conn=caller),
        lambda: client.pause_queue("q\x00", conn=caller),
        lambda: client.resume_queue("q" * 300, conn=caller),
        lambda: client.delete_queue("q\x00", conn=caller),
        lambda: client.pause_cron("c\x00", conn=caller),
        lambda: client.put_cron("c\ud800", "* * * * *", "k", conn=caller),
        lambda: belay.Workflow("w", workflow_id="id\x00"),
        lambda: belay.Workflow("w").add("m\ud800", "k"),
    ):
        with pytest.raises(ValidationError):
            call()
        assert caller.info.transaction_status == TransactionStatus.INTRANS


# -- Item 7: what JSON changes, as documented ------------------------------------------


class Colour(enum.Enum):
    RED = "red"


class Size(int, enum.Enum):
    LARGE = 3


def test_documented_conversions_read_back_as_documented(client):
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    job = client.enqueue("k", {
        "big": 2**64 + 1, "negative": -(2**70), "pair": (1, 2), "id": ident,
        "colour": Colour.RED, "size": Size.LARGE,
    })
    assert client.get_job(job.id).input == {
        "big": 2**64 + 1, "negative": -(2**70), "pair": [1, 2],
        "id": "12345678-1234-5678-1234-567812345678", "colour": "red", "size": 3,
    }


class Nul(enum.Enum):
    HIDDEN = "x\x00"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1, 2}, b"bytes", Nul.HIDDEN,
                                   START, object()])
def test_values_json_cannot_hold_are_refused(client, caller, value):
    refused_before_sql(caller, lambda: client.enqueue("k", {"v": value}, conn=caller), "input")


# -- Item 8: unique modes share one index -------------------------------------------


def test_an_always_key_shaped_like_a_window_key_is_refused(client, clock):
    bucket = int(clock.now().timestamp()) // 3600
    window = client.enqueue("digest", unique=Unique("digest2", mode="window", window=3600))
    assert window.unique_key == f"digest2@{bucket}"
    with pytest.raises(ValidationError, match="window key"):
        client.enqueue("other", unique=Unique(f"digest2@{bucket}", mode="always"))
    with pytest.raises(ValidationError, match="window key"):
        client.enqueue("other", unique={"key": "x@-5", "mode": "always"})
    # Other suffixes are fine, and a window job is never captured by an always key.
    client.enqueue("other", unique=Unique(f"digest2#{bucket}", mode="always"))
    client.enqueue("other", unique=Unique("digest2@hourly", mode="always"))
    again = client.enqueue("digest", unique=Unique("digest2", mode="window", window=3600))
    assert again.duplicate and again.id == window.id and again.kind == "digest"


def test_an_always_key_cannot_capture_a_window_key_enqueued_later(client, clock):
    bucket = int(clock.now().timestamp()) // 60
    with pytest.raises(ValidationError):
        client.enqueue("always-kind", unique=Unique(f"report@{bucket}", mode="always"))
    job = client.enqueue("window-kind", unique=Unique("report", mode="window", window=60))
    assert not job.duplicate and job.kind == "window-kind"


# -- The property layer ----------------------------------------------------------------


@FUZZ
@given(text=any_text(), field=st.sampled_from(["kind", "queue", "unique", "partition_key"]))
def test_any_text_in_a_name_is_stored_exactly_or_refused_before_sql(client, db_url, text,
                                                                       field):
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")
        options: dict[str, Any] = {"kind": "k", field: text}
        try:
            job = client.enqueue(**options, conn=conn)
        except ValidationError:
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            assert count_jobs(conn) == 0
            return
        finally:
            conn.rollback()
    stored = {"kind": job.kind, "queue": job.queue, "unique": job.unique_key,
              "partition_key": job.partition_key}[field]
    assert stored == text


@FUZZ
@given(text=hostile_text(min_size=1))
def test_hostile_text_in_a_name_is_refused_exactly_when_postgres_could_not_hold_it(
        client, text):
    unstorable = (names.text_problem(text) is not None
                  or len(text.encode("utf-8", "surrogatepass")) > names.MAX_NAME_BYTES
                  or not text.strip())
    for options in ({"kind": text}, {"kind": "k", "queue": text}):
        if unstorable:
            with pytest.raises(ValidationError):
                client.enqueue(**options)
        else:
            job = client.enqueue(**options)
            assert text in (job.kind, job.queue)


@FUZZ
@given(value=hostile_json())
def test_any_json_input_round_trips_or_is_refused_before_sql(client, db_url, value):
    with psycopg.connect(db_url) as conn:
        before = count_jobs(conn)
        try:
            job = client.enqueue("k", {"v": value}, conn=conn)
        except ValidationError:
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            assert count_jobs(conn) == before
            conn.rollback()
            return
        conn.commit()
    assert same_json(client.get_job(job.id).input, {"v": value})


def same_json(read: Any, written: Any) -> bool:
    """Equal as JSON values: jsonb keeps numbers as numeric, so a float without a
    fraction can read back as the int of its decimal form (1e16 → 10**16)."""
    if isinstance(written, bool) or isinstance(read, bool):
        return type(read) is type(written) and read == written
    if isinstance(written, float) or isinstance(read, float):
        return isinstance(read, (int, float)) and float(read) == float(written)
    if isinstance(written, dict):
        return (isinstance(read, dict) and read.keys() == written.keys()
                and all(same_json(read[k], written[k]) for k in written))
    if isinstance(written, (list, tuple)):
        return (isinstance(read, list) and len(read) == len(written)
                and all(same_json(r, w) for r, w in zip(read, written, strict=True)))
    return type(read) is type(written) and read == written


def test_a_batch_with_one_bad_row_writes_nothing(client, caller):
    specs = [JobSpec("k"), JobSpec("k", queue="q\x00"), JobSpec("k")]
    refused_before_sql(caller, lambda: client.enqueue_many(specs, conn=caller), "queue")


def test_a_duplicate_is_reported_from_its_own_mode_group(client):
    # 'incomplete' keys have an index of their own; 'window'/'always' share one.
    always = client.enqueue("k", unique=Unique("x", mode="always"))
    live = client.enqueue("k2", unique="x")  # incomplete: no conflict with the always row
    assert not live.duplicate
    again = client.enqueue("k", unique=Unique("x", mode="always"))
    assert again.duplicate and again.id == always.id and again.unique_mode == "always"
    twice = client.enqueue("k2", unique="x")
    assert twice.duplicate and twice.id == live.id and twice.unique_mode == "incomplete"


def test_reads_refuse_what_sql_could_not_take_before_any_sql(client, caller):
    for call in (
        lambda: client.list_jobs(kind="\ud800", conn=caller),
        lambda: client.list_jobs(queue="\x00", conn=caller),
        lambda: client.list_jobs(workflow_id="w\x00", conn=caller),
        lambda: client.workflow_status("\x00", conn=caller),
        lambda: client.events(1, after="x", conn=caller),  # type: ignore[arg-type]
        lambda: client.events(1, limit=2**70, conn=caller),
        lambda: client.events(1, after=2**70, conn=caller),
        lambda: client.get_job(2**70, conn=caller),
        lambda: client.steps(-(2**70), conn=caller),
        lambda: client.cancel_job(2**63, conn=caller),
    ):
        with pytest.raises(ValidationError):
            call()
        assert caller.info.transaction_status == TransactionStatus.INTRANS
    assert client.get_job(0) is None  # ids below 1 are simply not found


# Every client method that takes a name, with the text in that place.
NAMED_CALLS: dict[str, Callable[[belay.Belay, Any, str], Any]] = {
    "signal name": lambda c, conn, t: c.signal_job(1, t, conn=conn),
    "signal scope": lambda c, conn, t: c.signal(t, "go", conn=conn),
    "clear_signal": lambda c, conn, t: c.clear_signal("job:1", t, conn=conn),
    "signal payload": lambda c, conn, t: c.signal_job(1, "go", {t: t}, conn=conn),
    "list_jobs kind": lambda c, conn, t: c.list_jobs(kind=t, conn=conn),
    "list_jobs queue": lambda c, conn, t: c.list_jobs(queue=t, conn=conn),
    "workflow_status": lambda c, conn, t: c.workflow_status(t, conn=conn),
    "put_queue": lambda c, conn, t: c.put_queue(t, conn=conn),
    "pause_queue": lambda c, conn, t: c.pause_queue(t, conn=conn),
    "pause_cron": lambda c, conn, t: c.pause_cron(t, conn=conn),
    "put_cron": lambda c, conn, t: c.put_cron(t, "* * * * *", "k", conn=conn),
    "meta": lambda c, conn, t: c.enqueue("k", meta={"m": t}, conn=conn),
    "workflow": lambda c, conn, t: c.enqueue_workflow(
        belay.Workflow(t).add(t, "k", queue=t), conn=conn),
}


@settings(FUZZ, max_examples=150)
@given(text=any_text(), call=st.sampled_from(sorted(NAMED_CALLS)))
def test_every_named_call_takes_any_text_or_refuses_it_before_sql(client, db_url, text, call):
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")
        try:
            NAMED_CALLS[call](client, conn, text)
        except ValidationError:
            pass  # refused: the transaction must still be usable
        except belay.JobNotFound:
            pass
        assert conn.info.transaction_status == TransactionStatus.INTRANS, call
        conn.rollback()
