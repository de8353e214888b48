"""Client reads (contract §10 Client checklist: "read job/steps/events/workflow")
and column tolerance (§1: additive changes only; never depend on column order,
tolerate unknown columns).

Rows the client cannot produce yet (running, finished, steps, events) are
written with plain SQL, as the database operator or a foreign SDK would.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import belay
from belay import Belay, Job, ManualClock, Opaque, Step, ValidationError
from belay.job import STATES
from tests import helpers
from tests.helpers import START as T0
from tests.helpers import Conn, etf_by_name, job_row

VECTORS = etf_by_name()


def insert_job(conn: Conn, **columns: Any) -> int:
    """helpers.insert_job with this module's defaults: kind Reads.Worker, ready_at T0
    (as the reference fills them)."""
    return helpers.insert_job(conn, **{"kind": "Reads.Worker", "ready_at": T0, **columns})


def set_state(conn: Conn, job_id: int, state: str) -> None:
    conn.execute("UPDATE belay_jobs SET state = %s WHERE id = %s", (state, job_id))


def ids(jobs: list[Job]) -> list[int]:
    return [job.id for job in jobs]


# -- get_job -----------------------------------------------------------------------

# Every column, each with a value that differs from its default, so a column that
# is dropped, swapped or mis-mapped shows up as a mismatch.
FULL_ROW: dict[str, Any] = {
    "kind": "MyApp.Workers.Everything",
    "queue": "q-full",
    "state": "running",
    "input": {"prompt": "héllo ✉", "n": [1, 2.5, None, True]},
    "meta": {"tenant": "acme", "tags": ["x"]},
    "priority": -7,
    "attempt": 3,
    "max_attempts": 9,
    "partition_key": "tenant-acme",
    "ready_at": T0 - timedelta(minutes=5),
    "lease_until": T0 + timedelta(seconds=30),
    "leased_by": "node-a@host",
    "await_scope": "job:77",
    "await_name": "approval",
    "workflow_id": "wf-full",
    "wf_name": "summarize",
    "wf_deps": ["fetch", "clean"],
    "wf_ignore": ["failed"],
    "cron_name": "nightly",
    "cron_slot": T0.replace(minute=0),
    "unique_key": "full@123",
    "unique_mode": "window",
    "parent_id": 77,
    "budget_usd_micros": 2_500_000,
    "budget_tokens": 90_000,
    "spent_usd_micros": 1_250_000,
    "spent_tokens": 4_321,
    "result": b'{"ok":true}',
    "errors": [{"error": "boom", "attempt": 1}, {"error": "lease_expired", "at": "x"}],
    "cancel_requested": True,
    "inserted_at": T0 - timedelta(hours=1),
    "started_at": T0 - timedelta(minutes=4),
    "finished_at": T0 + timedelta(minutes=1),
}


def test_get_job_maps_every_column(client: Belay, sql_conn: Conn) -> None:
    """§10 read job: each belay_jobs column lands on its Job attribute."""
    job_id = insert_job(sql_conn, **FULL_ROW)
    job = client.get_job(job_id)
    assert isinstance(job, Job)
    assert job.id == job_id
    for name, value in FULL_ROW.items():
        if name == "result":
            assert job.result_envelope == value
            assert job.result == {"ok": True}
        else:
            assert getattr(job, name) == value, name
    assert job.duplicate is False
    assert job.budget_usd == 2.5
    assert job.spent_usd == 1.25
    assert not job.terminal


def test_get_job_knows_every_column_of_the_schema(client: Belay, sql_conn: Conn) -> None:
    """Every column of the migrated table maps to a Job field."""
    columns = {
        r[0] for r in sql_conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'belay_jobs'"
        )
    }
    fields = {f.name for f in dataclasses.fields(Job)} - {"result_envelope", "duplicate"}
    assert columns - {"result"} == fields


def test_get_job_defaults_of_a_minimal_row(client: Belay, sql_conn: Conn) -> None:
    job = client.get_job(insert_job(sql_conn))
    assert job is not None
    assert (job.input, job.meta, job.errors, job.wf_deps, job.wf_ignore) == ({}, {}, [], [], [])
    assert (job.attempt, job.max_attempts, job.priority) == (0, 20, 0)
    assert job.result_envelope is None and job.result is None
    assert job.cancel_requested is False


def test_get_job_missing_id_is_none(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    assert client.get_job(job_id + 1) is None
    assert client.get_job(-1) is None


@pytest.mark.parametrize("bad", ["1", 1.0, True, None, b"1", [1]])
def test_get_job_non_int_id_is_a_validation_error(client: Belay, bad: Any) -> None:
    with pytest.raises(ValidationError, match="integer"):
        client.get_job(bad)


def test_get_job_reads_a_job_just_enqueued(client: Belay, clock: ManualClock) -> None:
    enqueued = client.enqueue("Reads.Enqueued", {"a": 1}, queue="q1", priority=3, meta={"m": 1})
    job = client.get_job(enqueued.id)
    assert job == enqueued
    assert (job.kind, job.queue, job.state, job.input, job.meta, job.priority) == (
        "Reads.Enqueued", "q1", "ready", {"a": 1}, {"m": 1}, 3,
    )
    assert job.inserted_at == clock.now() and job.ready_at == clock.now()


# -- list_jobs -----------------------------------------------------------------------


@pytest.fixture
def spread(sql_conn: Conn) -> dict[str, int]:
    """Nine jobs across queues, states, kinds, workflows and parents."""
    rows = {
        "a": {"queue": "q1", "state": "ready", "kind": "K.A"},
        "b": {"queue": "q2", "state": "running", "kind": "K.B"},
        "c": {"queue": "q1", "state": "failed", "kind": "K.A", "workflow_id": "wf1"},
        "d": {"queue": "q1", "state": "ready", "kind": "K.B", "workflow_id": "wf1"},
        "e": {"queue": "q2", "state": "succeeded", "kind": "K.A", "parent_id": 1},
        "f": {"queue": "q1", "state": "ready", "kind": "K.A", "parent_id": 1},
        "g": {"queue": "q1", "state": "held", "kind": "K.C", "workflow_id": "wf2"},
        "h": {"queue": "q3", "state": "awaiting", "kind": "K.A", "parent_id": 2},
        "i": {"queue": "q1", "state": "ready", "kind": "K.A", "workflow_id": "wf1"},
    }
    return {name: insert_job(sql_conn, **cols) for name, cols in rows.items()}


def names_of(spread: dict[str, int], jobs: list[Job]) -> str:
    by_id = {v: k for k, v in spread.items()}
    return "".join(by_id[j.id] for j in jobs)


def test_list_jobs_newest_first(client: Belay, spread: dict[str, int]) -> None:
    jobs = client.list_jobs()
    assert names_of(spread, jobs) == "ihgfedcba"
    assert ids(jobs) == sorted(ids(jobs), reverse=True)
    assert all(isinstance(j, Job) for j in jobs)


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"queue": "q1"}, "igfdca"),
        ({"queue": "nope"}, ""),
        ({"state": "ready"}, "ifda"),
        ({"state": "held"}, "g"),
        ({"state": "paused"}, ""),
        ({"kind": "K.A"}, "ihfeca"),
        ({"kind": "K.C"}, "g"),
        ({"workflow_id": "wf1"}, "idc"),
        ({"parent_id": 1}, "fe"),
        ({"parent_id": 2}, "h"),
        ({"limit": 2}, "ih"),
        ({"queue": "q1", "state": "ready"}, "ifda"),
        ({"queue": "q1", "state": "ready", "kind": "K.A"}, "ifa"),
        ({"workflow_id": "wf1", "state": "ready"}, "id"),
        ({"workflow_id": "wf1", "kind": "K.B"}, "d"),
        ({"parent_id": 1, "state": "ready"}, "f"),
        ({"queue": "q2", "kind": "K.A", "parent_id": 1}, "e"),
        ({"queue": "q1", "kind": "K.A", "limit": 2}, "if"),
        ({"queue": "q1", "state": "failed", "workflow_id": "wf1", "kind": "K.A"}, "c"),
        ({"queue": "q3", "state": "ready"}, ""),
    ],
)
def test_list_jobs_filters(
    client: Belay, spread: dict[str, int], filters: dict[str, Any], expected: str
) -> None:
    assert names_of(spread, client.list_jobs(**filters)) == expected


def test_list_jobs_before_id_pages_backwards(client: Belay, spread: dict[str, int]) -> None:
    pages: list[str] = []
    before = None
    for _ in range(5):  # bounded: a broken cursor must fail, not loop
        page = client.list_jobs(limit=4, before_id=before)
        if not page:
            break
        pages.append(names_of(spread, page))
        before = page[-1].id
    assert pages == ["ihgf", "edcb", "a"]


def test_list_jobs_before_id_combines_with_filters(client: Belay, spread: dict[str, int]) -> None:
    assert names_of(spread, client.list_jobs(before_id=spread["f"], queue="q1")) == "dca"
    assert names_of(spread, client.list_jobs(before_id=spread["f"], kind="K.A", limit=1)) == "e"
    assert client.list_jobs(before_id=spread["a"]) == []


def test_list_jobs_kind_accepts_a_worker_object(client: Belay, spread: dict[str, int]) -> None:
    class Worker:
        kind = "K.B"

    assert names_of(spread, client.list_jobs(kind=Worker)) == "db"


def test_list_jobs_unknown_state_names_the_valid_states(client: Belay) -> None:
    with pytest.raises(ValidationError) as info:
        client.list_jobs(state="done")
    message = str(info.value)
    assert "'done'" in message
    for state in STATES:
        assert state in message


@pytest.mark.parametrize("limit", [0, -1, 10_001, True, "5", 2.0, None])
def test_list_jobs_limit_out_of_range_is_refused(client: Belay, limit: Any) -> None:
    with pytest.raises(ValidationError, match="limit"):
        client.list_jobs(limit=limit)


def test_list_jobs_limit_bounds_are_inclusive(client: Belay, sql_conn: Conn) -> None:
    for _ in range(3):
        insert_job(sql_conn)
    assert len(client.list_jobs(limit=1)) == 1
    assert len(client.list_jobs(limit=10_000)) == 3


def test_list_jobs_default_limit_is_50(client: Belay, sql_conn: Conn) -> None:
    sql_conn.execute(
        "INSERT INTO belay_jobs (kind, queue, inserted_at) "
        "SELECT 'K', 'q', %s FROM generate_series(1, 60)", (T0,)
    )
    newest = [r[0] for r in sql_conn.execute("SELECT id FROM belay_jobs ORDER BY id DESC")]
    assert ids(client.list_jobs()) == newest[:50]


@pytest.mark.parametrize(
    "filters", [{"parent_id": "7"}, {"before_id": "x"}, {"parent_id": 1.5}, {"before_id": True}]
)
def test_list_jobs_non_int_ids_are_validation_errors(
    client: Belay, filters: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        client.list_jobs(**filters)


def test_module_level_list_jobs_takes_the_same_filters(
    db_url: str, clock: ManualClock, spread: dict[str, int]
) -> None:
    instance = belay.configure(db_url, clock=clock)
    try:
        assert names_of(spread, belay.list_jobs(queue="q1", state="ready", limit=2)) == "if"
        assert belay.get_job(spread["a"]) == instance.get_job(spread["a"])
    finally:
        instance.close()


# -- steps ---------------------------------------------------------------------------


def insert_step(
    conn: Conn, job_id: int, seq: int, name: str, value: bytes | None,
    usd_micros: int = 0, tokens: int = 0,
) -> None:
    conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (job_id, seq, name, value, usd_micros, tokens, T0 + timedelta(seconds=seq)),
    )


GARBAGE = b"\x80\x81 neither ETF nor JSON \xff\x00"


def test_steps_decode_every_envelope_in_seq_order(client: Belay, sql_conn: Conn) -> None:
    """§2: first byte 131 → ETF, else JSON; NULL → None; anything else → Opaque."""
    job_id = insert_job(sql_conn)
    other = insert_job(sql_conn)
    # Inserted out of order: the journal is ordered by seq, not by insertion.
    insert_step(sql_conn, job_id, 4, "garbage", GARBAGE)
    insert_step(sql_conn, job_id, 2, "etf", VECTORS["belay_step_result"], 1_500_000, 1200)
    insert_step(sql_conn, job_id, 1, "json", '{"summary":"é ✉","n":[1,2.5,null]}'.encode())
    insert_step(sql_conn, job_id, 3, "nothing", None, 0, 7)
    insert_step(sql_conn, job_id, 5, "bad_etf", VECTORS["error_pid"])
    insert_step(sql_conn, other, 1, "json", b"1")

    steps = client.steps(job_id)
    assert all(isinstance(s, Step) for s in steps)
    assert [(s.seq, s.name) for s in steps] == [
        (1, "json"), (2, "etf"), (3, "nothing"), (4, "garbage"), (5, "bad_etf"),
    ]
    json_step, etf_step, null_step, garbage_step, bad_etf_step = steps
    assert json_step.value == {"summary": "é ✉", "n": [1, 2.5, None]}
    assert etf_step.value == {"summary": "done", "turn": 3, "done?": True}
    assert null_step.value is None
    assert isinstance(garbage_step.value, Opaque)
    assert garbage_step.value.data == GARBAGE
    assert isinstance(bad_etf_step.value, Opaque)
    assert bad_etf_step.value.data == VECTORS["error_pid"]

    assert (etf_step.usd_micros, etf_step.usd, etf_step.tokens) == (1_500_000, 1.5, 1200)
    assert (null_step.usd_micros, null_step.usd, null_step.tokens) == (0, 0.0, 7)
    assert etf_step.inserted_at == T0 + timedelta(seconds=2)


@pytest.mark.parametrize(
    "value",
    [b"", b"\x00", b"{", b"\xef\xbb", b"[1,2", b"nul", "\u00e9".encode("latin-1")],
)
def test_steps_undecodable_values_come_back_opaque_with_their_bytes(
    client: Belay, sql_conn: Conn, value: bytes
) -> None:
    job_id = insert_job(sql_conn)
    insert_step(sql_conn, job_id, 1, "s", value)
    (step,) = client.steps(job_id)
    assert isinstance(step.value, Opaque)
    assert step.value.data == value


def test_steps_json_scalars_and_etf_scalars(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    values: list[tuple[bytes, Any]] = [
        (b'"text"', "text"), (b"null", None), (b"false", False), (b"-12", -12), (b"0.5", 0.5),
        (VECTORS["atom_nil"], None), (VECTORS["atom_true"], True), (VECTORS["atom_ok"], "ok"),
        (VECTORS["int_2_pow_64"], 2**64), (VECTORS["tuple_ok_one"], ("ok", 1)),
        (VECTORS["binary_invalid_utf8_ff_00"], b"\xff\x00"),
    ]
    for seq, (raw, _) in enumerate(values, start=1):
        insert_step(sql_conn, job_id, seq, f"s{seq}", raw)
    decoded = [s.value for s in client.steps(job_id)]
    for got, (_, want) in zip(decoded, values, strict=True):
        assert got == want and type(got) is type(want)


def test_steps_json_big_integers_survive(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    raw = b'{"n": 18446744073709551616, "m": -9223372036854775809}'
    insert_step(sql_conn, job_id, 1, "big", raw)
    (step,) = client.steps(job_id)
    assert step.value == {"n": 2**64, "m": -(2**63) - 1}
    assert isinstance(step.value["n"], int)


def test_steps_of_a_job_without_steps_is_empty(client: Belay, sql_conn: Conn) -> None:
    assert client.steps(insert_job(sql_conn)) == []
    assert client.steps(10_000) == []


def test_steps_non_int_job_id_is_a_validation_error(client: Belay) -> None:
    with pytest.raises(ValidationError):
        client.steps("1")  # type: ignore[arg-type]


# -- events --------------------------------------------------------------------------

BIG = 2**70 + 12345
EVENT_PAYLOADS: list[Any] = [
    {"t": "progress", "pct": 10},
    {"nested": {"deep": {"list": [1, {"x": [True, None]}], "f": 0.1}}, "empty": {}},
    {"text": "日本 🎉 é", "emoji": "✉"},
    None,
    ["an", "array", 3],
]


def insert_event(conn: Conn, job_id: int, seq: int, payload: Any) -> None:
    conn.execute(
        "INSERT INTO belay_events (job_id, seq, payload, inserted_at) VALUES (%s, %s, %s, %s)",
        (job_id, seq, None if payload is None else Jsonb(payload), T0 + timedelta(seconds=seq)),
    )


def test_events_in_seq_order_with_decoded_payloads(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    other = insert_job(sql_conn)
    order = [3, 1, 5, 2, 4]
    for seq in order:
        insert_event(sql_conn, job_id, seq, EVENT_PAYLOADS[seq - 1])
    insert_event(sql_conn, other, 1, {"other": True})

    events = client.events(job_id)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [e.payload for e in events] == EVENT_PAYLOADS
    assert events[0].inserted_at == T0 + timedelta(seconds=1)
    assert client.events(other)[0].payload == {"other": True}


def test_events_after_filters_by_seq(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    for seq in range(1, 6):
        insert_event(sql_conn, job_id, seq, {"seq": seq})
    assert [e.seq for e in client.events(job_id, after=0)] == [1, 2, 3, 4, 5]
    assert [e.seq for e in client.events(job_id, 2)] == [3, 4, 5]
    assert [e.payload for e in client.events(job_id, after=4)] == [{"seq": 5}]
    assert client.events(job_id, after=5) == []
    assert client.events(job_id, after=99) == []


def test_events_page_with_a_limit(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    for seq in range(1, 6):
        insert_event(sql_conn, job_id, seq, {"seq": seq})
    assert [e.seq for e in client.events(job_id, limit=2)] == [1, 2]
    assert [e.seq for e in client.events(job_id, after=2, limit=2)] == [3, 4]
    assert [e.seq for e in client.events(job_id, after=4, limit=2)] == [5]
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValidationError, match="limit must be an integer >= 1 or None"):
            client.events(job_id, limit=bad)


def test_events_of_a_job_without_events_is_empty(client: Belay, sql_conn: Conn) -> None:
    assert client.events(insert_job(sql_conn)) == []


def test_events_jsonb_numbers_read_back_as_numbers(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn)
    # Written as jsonb text, the way any SDK's driver sends it.
    sql_conn.execute(
        "INSERT INTO belay_events (job_id, seq, payload) VALUES (%s, 1, %s::jsonb)",
        (job_id, '{"i": 9223372036854775807, "neg": -9223372036854775808, '
                  '"u": 18446744073709551615, "f": 1.5, "e": 1e3}'),
    )
    (event,) = client.events(job_id)
    assert event.payload == {
        "i": 2**63 - 1, "neg": -(2**63), "u": 2**64 - 1, "f": 1.5, "e": 1000,
    }


def test_events_jsonb_big_integers_survive(client: Belay, sql_conn: Conn) -> None:
    """jsonb is numeric: an Elixir/JS producer can store integers of any size."""
    job_id = insert_job(sql_conn)
    insert_event(sql_conn, job_id, 1, {"big": BIG, "neg": -BIG, "list": [2**64, 2**100]})
    (event,) = client.events(job_id)
    assert event.payload == {"big": BIG, "neg": -BIG, "list": [2**64, 2**100]}
    assert all(isinstance(n, int) for n in event.payload["list"])


# -- workflow_status -----------------------------------------------------------------


def test_workflow_status_summarises_members(client: Belay, sql_conn: Conn) -> None:
    wf = "wf-status"
    # Inserted c, a, b so id order differs from name order.
    c = insert_job(sql_conn, workflow_id=wf, wf_name="c", state="held", wf_deps=["b"])
    a = insert_job(sql_conn, workflow_id=wf, wf_name="a", state="succeeded")
    b = insert_job(sql_conn, workflow_id=wf, wf_name="b", state="running", wf_deps=["a"])
    insert_job(sql_conn, workflow_id="other", wf_name="a", state="failed")
    insert_job(sql_conn, state="failed")

    status = client.workflow_status(wf)
    assert isinstance(status, belay.WorkflowStatus)
    assert status.workflow_id == wf
    assert ids(status.jobs) == [c, a, b]
    assert status.total == 3
    assert status.state_counts == {"held": 1, "succeeded": 1, "running": 1}
    assert status.done is False
    assert {name: job.id for name, job in status.by_name().items()} == {"a": a, "b": b, "c": c}
    assert status.by_name()["c"].wf_deps == ["b"]

    set_state(sql_conn, b, "succeeded")
    assert client.workflow_status(wf).done is False  # c is still held
    set_state(sql_conn, c, "cancelled")
    done = client.workflow_status(wf)
    assert done.done is True
    assert done.state_counts == {"succeeded": 2, "cancelled": 1}


@pytest.mark.parametrize("state", ["ready", "running", "awaiting", "held", "paused"])
def test_workflow_status_not_done_while_any_member_is_non_terminal(
    client: Belay, sql_conn: Conn, state: str
) -> None:
    insert_job(sql_conn, workflow_id="wf", wf_name="a", state="succeeded")
    insert_job(sql_conn, workflow_id="wf", wf_name="b", state="failed")
    insert_job(sql_conn, workflow_id="wf", wf_name="c", state=state)
    assert client.workflow_status("wf").done is False


def test_workflow_status_done_with_any_terminal_mix(client: Belay, sql_conn: Conn) -> None:
    for name, state in [("a", "succeeded"), ("b", "failed"), ("c", "cancelled")]:
        insert_job(sql_conn, workflow_id="wf", wf_name=name, state=state)
    assert client.workflow_status("wf").done is True


def test_workflow_status_of_an_unknown_workflow(client: Belay, sql_conn: Conn) -> None:
    insert_job(sql_conn, workflow_id="known", wf_name="a", state="succeeded")
    status = client.workflow_status("unknown")
    assert status.jobs == []
    assert status.total == 0
    assert status.state_counts == {}
    assert status.done is False
    assert status.by_name() == {}


def test_workflow_status_by_name_skips_unnamed_members(client: Belay, sql_conn: Conn) -> None:
    named = insert_job(sql_conn, workflow_id="wf", wf_name="a")
    insert_job(sql_conn, workflow_id="wf")
    status = client.workflow_status("wf")
    assert status.total == 2
    assert {k: v.id for k, v in status.by_name().items()} == {"a": named}


# -- stats ---------------------------------------------------------------------------


def test_stats_on_an_empty_database(client: Belay) -> None:
    assert client.stats() == {}


def test_stats_counts_per_queue_per_state(client: Belay, sql_conn: Conn) -> None:
    layout = {
        "q1": {"ready": 3, "running": 1, "failed": 2},
        "q2": {"succeeded": 4},
        "q3": {"held": 1, "awaiting": 2, "cancelled": 1, "paused": 1},
    }
    for queue, states in layout.items():
        for state, count in states.items():
            for _ in range(count):
                insert_job(sql_conn, queue=queue, state=state)
    assert client.stats() == layout
    enqueued = client.enqueue("K", queue="q2")
    assert client.stats()["q2"] == {"succeeded": 4, "ready": 1}
    set_state(sql_conn, enqueued.id, "succeeded")
    assert client.stats()["q2"] == {"succeeded": 5}


# -- Column tolerance (§1) -----------------------------------------------------------


def test_unknown_columns_are_tolerated(client: Belay, sql_conn: Conn) -> None:
    """§1: a newer migration adds columns; reads, lists and enqueue keep working."""
    before = insert_job(sql_conn, queue="tol")
    sql_conn.execute("ALTER TABLE belay_jobs ADD COLUMN future_col text DEFAULT 'x'")
    sql_conn.execute("ALTER TABLE belay_jobs ADD COLUMN future_num bigint NOT NULL DEFAULT 7")

    job = client.get_job(before)
    assert job is not None
    assert job.queue == "tol" and job.kind == "Reads.Worker"

    enqueued = client.enqueue("Tolerant", {"a": 1}, queue="tol")
    assert enqueued.input == {"a": 1} and not enqueued.duplicate
    row = sql_conn.execute(
        "SELECT future_col, future_num FROM belay_jobs WHERE id = %s", (enqueued.id,)
    ).fetchone()
    assert row == ("x", 7)  # the new columns' defaults apply to belay's inserts

    listed = client.list_jobs(queue="tol")
    assert ids(listed) == [enqueued.id, before]

    dup = client.enqueue("Tolerant", unique="k")
    again = client.enqueue("Tolerant", unique="k")
    assert again.duplicate and again.id == dup.id
    assert client.workflow_status("none").jobs == []


def test_dropped_then_readded_column_positions_do_not_matter(
    client: Belay, sql_conn: Conn
) -> None:
    """Column order changes (drop + re-add moves a column to the end); reads are by name."""
    job_id = insert_job(sql_conn, queue="q-order", priority=5, partition_key="p1")
    sql_conn.execute("ALTER TABLE belay_jobs DROP COLUMN partition_key")
    sql_conn.execute("ALTER TABLE belay_jobs ADD COLUMN partition_key text")
    sql_conn.execute("UPDATE belay_jobs SET partition_key = 'p2' WHERE id = %s", (job_id,))
    job = client.get_job(job_id)
    assert job is not None
    assert (job.queue, job.priority, job.partition_key) == ("q-order", 5, "p2")
    assert client.enqueue("K", partition_key="p3").partition_key == "p3"


def test_from_row_does_not_depend_on_key_order(sql_conn: Conn) -> None:
    row = job_row(sql_conn, insert_job(sql_conn, **FULL_ROW))
    reference = Job.from_row(row)
    rnd = random.Random(1234)
    items = list(row.items())
    for _ in range(25):
        rnd.shuffle(items)
        assert Job.from_row(dict(items)) == reference
    assert Job.from_row(dict(reversed(list(row.items())))) == reference


def test_from_row_ignores_unknown_keys_in_any_order(sql_conn: Conn) -> None:
    row = job_row(sql_conn, insert_job(sql_conn, **FULL_ROW))
    reference = Job.from_row(row)
    # Future columns, including names that collide with Job's own non-column attributes.
    extras = {
        "future_col": "x", "zz_last": 1, "aa_first": None,
        "duplicate": True, "result_envelope": b"\x00",
    }
    rnd = random.Random(99)
    items = list({**row, **extras}.items())
    for _ in range(25):
        rnd.shuffle(items)
        job = Job.from_row(dict(items))
        assert job.duplicate is False
        assert job.result_envelope == FULL_ROW["result"]
        assert job == reference


def test_from_row_with_missing_optional_columns_uses_defaults() -> None:
    """An older row shape without some defaulted columns still reads."""
    job = Job.from_row({"state": "ready", "queue": "q", "kind": "K", "id": 1})
    assert (job.id, job.kind, job.queue, job.state) == (1, "K", "q", "ready")
    assert job.result is None and job.errors == []


@pytest.fixture
def warm_client(db_url: str, clock: ManualClock) -> Iterator[Belay]:
    """A client with one pooled connection, so statements repeat on one session."""
    with Belay(db_url, clock=clock, max_pool_size=1) as instance:
        yield instance


@pytest.mark.parametrize("operation", ["get_job", "list_jobs", "workflow_status", "enqueue"])
def test_long_lived_client_survives_a_column_added_by_another_process(
    warm_client: Belay, sql_conn: Conn, operation: str
) -> None:
    job_id = insert_job(sql_conn, workflow_id="wf", unique_key="u", unique_mode="incomplete")
    calls = {
        "get_job": lambda: warm_client.get_job(job_id),
        "list_jobs": lambda: warm_client.list_jobs(),
        "workflow_status": lambda: warm_client.workflow_status("wf").jobs[0],
        "enqueue": lambda: warm_client.enqueue("K", unique="u"),
    }
    call = calls[operation]
    for _ in range(8):
        call()
    sql_conn.execute("ALTER TABLE belay_jobs ADD COLUMN future_col text DEFAULT 'x'")
    for _ in range(2):
        result = call()
        job = result[0] if isinstance(result, list) else result
        assert isinstance(job, Job)
        assert job.id == job_id


# -- Reads on a caller's connection ------------------------------------------------


def test_reads_on_caller_connection_see_its_uncommitted_rows(
    client: Belay, db_url: str, sql_conn: Conn
) -> None:
    """§10: reads on the caller's connection run inside the caller's transaction."""
    committed = insert_job(sql_conn, queue="txq", state="succeeded")
    with psycopg.connect(db_url) as conn:
        raw = insert_job(conn, queue="txq", state="held", kind="Raw.InTx")  # opens the transaction
        job = client.enqueue("InTx", {"x": 1}, queue="txq", conn=conn)
        conn.execute(
            "INSERT INTO belay_steps (job_id, seq, name, value) VALUES (%s, 1, 's', %s)",
            (job.id, b'{"v": 1}'),
        )
        conn.execute(
            "INSERT INTO belay_events (job_id, seq, payload) VALUES (%s, 1, %s)",
            (job.id, Jsonb({"e": 1})),
        )
        conn.execute(
            "UPDATE belay_jobs SET workflow_id = 'wtx', wf_name = 'n' WHERE id = %s", (job.id,)
        )

        seen = client.get_job(job.id, conn=conn)
        assert seen is not None and seen.input == {"x": 1} and seen.workflow_id == "wtx"
        assert client.get_job(raw, conn=conn) is not None
        assert ids(client.list_jobs(queue="txq", conn=conn)) == [job.id, raw, committed]
        assert [s.value for s in client.steps(job.id, conn=conn)] == [{"v": 1}]
        assert [e.payload for e in client.events(job.id, conn=conn)] == [{"e": 1}]
        assert ids(client.workflow_status("wtx", conn=conn).jobs) == [job.id]
        assert client.stats(conn=conn) == {"txq": {"ready": 1, "held": 1, "succeeded": 1}}
        # Still the caller's transaction: nothing was committed behind its back.
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS

        # Other sessions (the client's own pool) do not see uncommitted work.
        assert client.get_job(job.id) is None
        assert client.get_job(raw) is None
        assert ids(client.list_jobs(queue="txq")) == [committed]
        assert client.steps(job.id) == []
        assert client.events(job.id) == []
        assert client.workflow_status("wtx").jobs == []
        assert client.stats() == {"txq": {"succeeded": 1}}
        conn.rollback()

        assert client.get_job(job.id, conn=conn) is None
    assert client.get_job(job.id) is None
    assert ids(client.list_jobs(queue="txq")) == [committed]


def test_reads_on_caller_connection_after_commit_are_visible_everywhere(
    client: Belay, db_url: str
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")  # the caller's transaction is open
        job = client.enqueue("InTx", conn=conn)
        assert client.get_job(job.id, conn=conn) == job
        assert client.get_job(job.id) is None
        conn.commit()
    assert client.get_job(job.id) == job


def test_reads_on_an_autocommit_caller_connection(client: Belay, sql_conn: Conn) -> None:
    job_id = insert_job(sql_conn, queue="ac")
    assert client.get_job(job_id, conn=sql_conn) == client.get_job(job_id)
    assert ids(client.list_jobs(queue="ac", conn=sql_conn)) == [job_id]
    assert sql_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_enqueue_as_first_statement_on_caller_connection_rolls_back_with_it(
    client: Belay, db_url: str
) -> None:
    with psycopg.connect(db_url) as conn:
        job = client.enqueue("FirstInTx", conn=conn)
        conn.rollback()
    assert client.get_job(job.id) is None
