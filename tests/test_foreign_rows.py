"""A foreign SDK's rows read back correctly (the issue's "Done when").

The ``Reference`` helper below writes rows with the statements of the Elixir
reference (github.com/b-erdem/belay @ 0be1229, lib/belay/storage/postgres.ex:
``build_insert``, the claim UPDATE, ``apply_and_settle``, ``put_step``,
``append_event``, ``do_put_signal``) and fills them the way ``Belay.Job.new``
and ``Belay.Runner`` do: kind is the Elixir module name, errors are appended
maps, budgets are micro-dollars, window keys embed their bucket, spawned
children carry ``$spawn:<parent>:<name>:<i>`` keys in mode ``always``. Results
and step values are real ``:erlang.term_to_binary`` output taken from
tests/fixtures/etf/vectors.json. Then belay's client must read it all back
with the right Python values, dedupe against it, and wake it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from belay import Belay, JobCancelled, JobFailed, ManualClock, Opaque, Unique
from belay.codec import ETF_VERSION, encode_value
from belay.names import notify_channel
from tests.helpers import Conn, count_jobs, etf_by_name, job_row

ETF = etf_by_name()

# The Python values the Elixir terms behind those vectors must decode to
# (the terms are in tests/fixtures/etf/make_vectors.escript).
STEP_RESULT = {"summary": "done", "turn": 3, "done?": True}  # binary keys
OK_TUPLE = ("ok", {"summary": "x", "turn": 12})  # {:ok, %{summary: "x", turn: 12}}
ERROR_TUPLE = ("error", ("timeout", 30000))  # {:error, {:timeout, 30000}}
JOB_ARGS = {
    "prompt": "Summarise the thread ✉", "attempt": 1, "deadline": None,
    "meta": {"tags": ["a", "b"]}, "weights": [0.25, 0.75],
}
DATETIME_STRUCT = {  # ~U[2024-05-17 13:45:07.123456Z]
    "__struct__": "Elixir.DateTime", "calendar": "Elixir.Calendar.ISO", "year": 2024,
    "month": 5, "day": 17, "hour": 13, "minute": 45, "second": 7,
    "microsecond": (123456, 6), "time_zone": "Etc/UTC", "zone_abbr": "UTC",
    "utc_offset": 0, "std_offset": 0,
}

WF_ID = "9f1c2e4a7b3d5c6e8f0a1b2c3d4e5f60"  # Belay.Workflow's random_id: 16 bytes, hex
NODE = "belay@elixir-node-1"

# @insert_fields of the reference, in its order.
INSERT_FIELDS = (
    "kind", "queue", "state", "input", "meta", "priority", "attempt", "max_attempts",
    "partition_key", "ready_at", "workflow_id", "wf_name", "wf_deps", "wf_ignore", "cron_name",
    "cron_slot", "unique_key", "unique_mode", "parent_id", "budget_usd_micros", "budget_tokens",
    "spent_usd_micros", "spent_tokens", "errors", "cancel_requested", "inserted_at",
)
TERMINAL = ("succeeded", "failed", "cancelled")


class Reference:
    """The Elixir reference's storage statements, run over plain SQL."""

    def __init__(self, conn: Conn, clock: ManualClock) -> None:
        self.conn = conn
        self.clock = clock

    def now(self) -> datetime:
        return self.clock.now()

    # Belay.Job.new/4
    def new(
        self,
        worker: str,
        input: dict[str, Any],
        *,
        queue: str = "default",
        state: str = "ready",
        unique: str | dict[str, Any] | None = None,
        parent_id: int | None = None,
        meta: dict[str, Any] | None = None,
        priority: int = 0,
        max_attempts: int = 20,
        partition_key: str | None = None,
        schedule_in: int | None = None,
        workflow_id: str | None = None,
        wf_name: str | None = None,
        wf_deps: Sequence[str] = (),
        wf_ignore: Sequence[str] = (),
        cron_name: str | None = None,
        cron_slot: datetime | None = None,
        budget: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        now = self.now()
        unique_key = unique_mode = None
        if isinstance(unique, str):
            unique_key, unique_mode = unique, "incomplete"
        elif unique is not None:
            if unique.get("scope") == "always":
                unique_key, unique_mode = unique["key"], "always"
            else:
                bucket = int(now.timestamp()) // unique["within"]
                unique_key, unique_mode = f"{unique['key']}@{bucket}", "window"
        budget = budget or {}
        usd = budget.get("usd")
        return {
            "kind": worker.removeprefix("Elixir."),
            "queue": queue,
            "state": state,
            "input": Jsonb(input),
            "meta": Jsonb(meta or {}),
            "priority": priority,
            "attempt": 0,
            "max_attempts": max_attempts,
            "partition_key": partition_key,
            "ready_at": now if schedule_in is None else now + timedelta(seconds=schedule_in),
            "workflow_id": workflow_id,
            "wf_name": wf_name,
            "wf_deps": list(wf_deps),
            "wf_ignore": list(wf_ignore),
            "cron_name": cron_name,
            "cron_slot": cron_slot,
            "unique_key": unique_key,
            "unique_mode": unique_mode,
            "parent_id": parent_id,
            "budget_usd_micros": None if usd is None else round(usd * 1_000_000),
            "budget_tokens": budget.get("tokens"),
            "spent_usd_micros": 0,
            "spent_tokens": 0,
            "errors": Jsonb([]),
            "cancel_requested": False,
            "inserted_at": now,
        }

    # build_insert/1 + insert_jobs/3
    def insert(self, *rows: dict[str, Any]) -> list[dict[str, Any]]:
        one = "(" + ", ".join(["%s"] * len(INSERT_FIELDS)) + ")"
        query = (
            f"INSERT INTO belay_jobs ({', '.join(INSERT_FIELDS)}) "
            f"VALUES {', '.join([one] * len(rows))} ON CONFLICT DO NOTHING RETURNING *"
        )
        params = [row[f] for row in rows for f in INSERT_FIELDS]
        with self.conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query, params).fetchall()  # type: ignore[arg-type]

    def insert_one(self, worker: str, input: dict[str, Any], **opts: Any) -> int:
        (row,) = self.insert(self.new(worker, input, **opts))
        return int(row["id"])

    def row(self, job_id: int) -> dict[str, Any]:
        return job_row(self.conn, job_id)

    # claim/6 (the UPDATE after candidate selection)
    def claim(self, *ids: int, ttl_ms: int = 30_000) -> None:
        now = self.now()
        self.conn.execute(
            """
            UPDATE belay_jobs
            SET state = 'running', attempt = attempt + 1, lease_until = %s,
                leased_by = %s, started_at = COALESCE(started_at, %s)
            WHERE id = ANY(%s) AND state IN ('ready', 'awaiting')
            RETURNING *
            """,
            (now + timedelta(milliseconds=ttl_ms), NODE, now, list(ids)),
        )

    # ack/4: Logic.apply_outcome + the fenced UPDATE of apply_and_settle (and,
    # for an await park, the scope lock + signal check; for terminal outcomes
    # the parent notification). Workflow settlement is left to the caller.
    def ack(self, job_id: int, outcome: tuple[Any, ...]) -> str:
        now = self.now()
        with self.conn.transaction():
            job = self.row(job_id)
            new = {k: job[k] for k in (
                "state", "ready_at", "attempt", "await_scope", "await_name", "result",
                "errors", "finished_at",
            )}
            kind = outcome[0]
            if kind == "succeeded":
                new.update(state="succeeded", result=outcome[1], finished_at=now)
            elif kind == "retry":
                new.update(state="ready", ready_at=outcome[2], errors=[*job["errors"], outcome[1]])
            elif kind == "failed":
                new.update(state="failed", errors=[*job["errors"], outcome[1]], finished_at=now)
            elif kind == "cancelled":
                new.update(state="cancelled", errors=[*job["errors"], outcome[1]],
                           finished_at=now)
            elif kind == "await":
                _, scope, name, deadline = outcome
                new.update(state="awaiting", await_scope=scope, await_name=name,
                           ready_at=deadline, attempt=job["attempt"] - 1)
                self.conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(%s))", ("belay_sig:" + scope,)
                )
                found = self.conn.execute(
                    "SELECT 1 FROM belay_signals WHERE scope = %s AND name = %s", (scope, name)
                ).fetchall()
                if found:
                    new.update(state="ready", ready_at=now, await_scope=None, await_name=None)
            else:
                raise AssertionError(kind)
            updated = self.conn.execute(
                """
                UPDATE belay_jobs
                SET state = %s, ready_at = %s, attempt = %s, lease_until = %s, leased_by = %s,
                    await_scope = %s, await_name = %s, result = %s, errors = %s,
                    finished_at = %s
                WHERE id = %s AND state = 'running' AND attempt = %s
                """,
                (new["state"], new["ready_at"], new["attempt"], None, None, new["await_scope"],
                 new["await_name"], new["result"], Jsonb(new["errors"]), new["finished_at"],
                 job_id, job["attempt"]),
            ).rowcount
            assert updated == 1, "stale foreign ack"
            if new["state"] in TERMINAL and job["parent_id"] is not None:
                self._put_signal(f"job:{job['parent_id']}", "$children", {})
        return str(new["state"])

    # settle_workflow/3's two UPDATEs (the release and doom ids come from Logic.settle)
    def settle_release(self, *ids: int) -> None:
        self.conn.execute(
            "UPDATE belay_jobs SET state = 'ready', ready_at = %s "
            "WHERE id = ANY(%s) AND state = 'held' RETURNING *",
            (self.now(), list(ids)),
        )

    def settle_doom(self, *ids: int) -> None:
        self.conn.execute(
            "UPDATE belay_jobs SET state = 'cancelled', finished_at = %s "
            "WHERE id = ANY(%s) AND state = 'held' RETURNING *",
            (self.now(), list(ids)),
        )

    # put_step/6
    def put_step(
        self, job_id: int, name: str, value: bytes | None, usd_micros: int = 0, tokens: int = 0
    ) -> tuple[int, int]:
        with self.conn.transaction():
            self.conn.execute(
                """
                INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
                VALUES (%s, (SELECT COALESCE(MAX(seq), 0) + 1 FROM belay_steps WHERE job_id = %s),
                        %s, %s, %s, %s, %s)
                ON CONFLICT (job_id, name) DO NOTHING
                """,
                (job_id, job_id, name, value, usd_micros, tokens, self.now()),
            )
            spent = self.conn.execute(
                """
                UPDATE belay_jobs
                SET spent_usd_micros = spent_usd_micros + %s, spent_tokens = spent_tokens + %s
                WHERE id = %s
                RETURNING spent_usd_micros, spent_tokens
                """,
                (usd_micros, tokens, job_id),
            ).fetchone()
        assert spent is not None
        return int(spent[0]), int(spent[1])

    # append_event/4
    def append_event(self, job_id: int, payload: Any) -> int:
        row = self.conn.execute(
            """
            INSERT INTO belay_events (job_id, seq, payload, inserted_at)
            VALUES (%s, (SELECT COALESCE(MAX(seq), 0) + 1 FROM belay_events WHERE job_id = %s),
                    %s, %s)
            RETURNING seq
            """,
            (job_id, job_id, Jsonb(payload), self.now()),
        ).fetchone()
        assert row is not None
        return int(row[0])

    # put_signal/5
    def put_signal(self, scope: str, name: str, payload: dict[str, Any]) -> list[int]:
        with self.conn.transaction():
            return self._put_signal(scope, name, payload)

    def _put_signal(self, scope: str, name: str, payload: dict[str, Any]) -> list[int]:
        now = self.now()
        self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("belay_sig:" + scope,))
        self.conn.execute(
            """
            INSERT INTO belay_signals (scope, name, payload, inserted_at)
            VALUES (%s, %s, %s, %s)
            ON CONFLICT (scope, name) DO UPDATE SET payload = EXCLUDED.payload,
                                                    inserted_at = EXCLUDED.inserted_at
            """,
            (scope, name, Jsonb(payload), now),
        )
        woken = self.conn.execute(
            """
            UPDATE belay_jobs
            SET state = 'ready', ready_at = %s, await_scope = NULL, await_name = NULL
            WHERE state = 'awaiting' AND await_scope = %s AND await_name = %s
            RETURNING id
            """,
            (now, scope, name),
        ).fetchall()
        return [r[0] for r in woken]

    # get_signal/3 — what a foreign reader sees of a signal
    def get_signal(self, scopes: list[str], name: str) -> Any:
        row = self.conn.execute(
            "SELECT payload FROM belay_signals WHERE scope = ANY(%s) AND name = %s LIMIT 1",
            (scopes, name),
        ).fetchone()
        return None if row is None else row[0]

    def run_to_success(self, job_id: int, result: bytes | None) -> None:
        self.claim(job_id)
        self.clock.advance(1)
        assert self.ack(job_id, ("succeeded", result)) == "succeeded"


@pytest.fixture
def ref(sql_conn: Conn, clock: ManualClock) -> Reference:
    return Reference(sql_conn, clock)


# -- Jobs and results ----------------------------------------------------------------


def test_foreign_succeeded_job_reads_back_every_column(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    enqueued_at = clock.now()
    job_id = ref.insert_one(
        "Elixir.MyApp.Workers.Summarize",
        {"url": "https://example.com/t/1", "max_tokens": 800},
        queue="ai", meta={"trace_id": "abc123"}, priority=2, max_attempts=5,
        partition_key="tenant-7",
    )
    clock.advance(2)
    started_at = clock.now()
    ref.claim(job_id)
    clock.advance(3)
    ref.ack(job_id, ("succeeded", ETF["belay_step_result"]))

    job = client.get_job(job_id)
    assert job is not None
    assert job.kind == "MyApp.Workers.Summarize"
    assert (job.queue, job.state, job.priority, job.max_attempts, job.attempt) == (
        "ai", "succeeded", 2, 5, 1,
    )
    assert job.input == {"url": "https://example.com/t/1", "max_tokens": 800}
    assert job.meta == {"trace_id": "abc123"}
    assert job.partition_key == "tenant-7"
    assert job.result_envelope == ETF["belay_step_result"]
    assert job.result == STEP_RESULT
    assert job.errors == []
    assert (job.lease_until, job.leased_by) == (None, None)
    assert job.inserted_at == enqueued_at and job.ready_at == enqueued_at
    assert job.started_at == started_at and job.finished_at == clock.now()
    assert (job.spent_usd_micros, job.spent_tokens, job.cancel_requested) == (0, 0, False)
    assert job.terminal
    assert client.await_result(job_id, timeout=5) == STEP_RESULT


@pytest.mark.parametrize(
    ("vector", "expected"),
    [
        ("belay_step_result", STEP_RESULT),
        ("belay_step_result_v2_atoms", STEP_RESULT),
        ("belay_ok_tuple_result", OK_TUPLE),
        ("belay_error_tuple_result", ERROR_TUPLE),
        ("belay_job_args", JOB_ARGS),
        ("map_elixir_datetime_struct", DATETIME_STRUCT),
        ("map_atom_key", {"summary": "x"}),
        ("atom_nil", None),
        ("atom_true", True),
        ("atom_false", False),
        ("atom_ok", "ok"),
        ("atom_elixir_module", "Elixir.Belay.Job"),
        ("int_2_pow_64", 2**64),
        ("int_minus_big_decimal", -123456789012345678901234567890),
        ("float_pi", 3.141592653589793),
        ("binary_utf8_multibyte", "héllo 日本 🎉"),
        ("binary_invalid_utf8_ff_00", b"\xff\x00"),
        ("charlist_abc", [97, 98, 99]),
        ("tuple_empty", ()),
        ("map_empty", {}),
        ("list_empty", []),
        ("compressed_list_of_maps", [{"summary": "done", "turn": 3}] * 2000),
    ],
)
def test_foreign_etf_results_decode_to_python_values(
    client: Belay, ref: Reference, vector: str, expected: Any
) -> None:
    """{:ok, term} results are term_to_binary bytes (§2: first byte 131)."""
    job_id = ref.insert_one("MyApp.Workers.Any", {})
    ref.run_to_success(job_id, ETF[vector])
    job = client.get_job(job_id)
    assert job is not None
    assert job.result_envelope is not None and job.result_envelope[0] == ETF_VERSION
    assert job.result == expected
    assert type(job.result) is type(expected)
    assert client.await_result(job_id, timeout=5) == expected


def test_foreign_ok_without_value_has_no_result(client: Belay, ref: Reference) -> None:
    """A worker returning plain :ok acks {:succeeded, nil}: result is SQL NULL."""
    job_id = ref.insert_one("MyApp.Workers.Fire", {})
    ref.run_to_success(job_id, None)
    job = client.get_job(job_id)
    assert job is not None and job.state == "succeeded"
    assert job.result_envelope is None and job.result is None
    assert client.await_result(job_id, timeout=5) is None


def test_foreign_result_with_an_unsupported_term_is_opaque(
    client: Belay, ref: Reference
) -> None:
    """A pid in a result (not data by contract) never crashes the reader (§2)."""
    job_id = ref.insert_one("MyApp.Workers.Odd", {})
    ref.run_to_success(job_id, ETF["error_pid_in_tuple"])
    value = client.await_result(job_id, timeout=5)
    assert isinstance(value, Opaque)
    assert value.data == ETF["error_pid_in_tuple"]


def test_await_result_returns_once_a_foreign_worker_acks(
    client: Belay, ref: Reference, db_url: str
) -> None:
    job_id = ref.insert_one("MyApp.Workers.Slow", {"n": 1})
    ref.claim(job_id)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["value"] = client.await_result(job_id, timeout=10)
        except BaseException as exc:  # pragma: no cover - reported below
            outcome["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    ref.ack(job_id, ("succeeded", ETF["belay_ok_tuple_result"]))
    # Belay.Notifier.Postgres sends the result notification after the ack commits.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_notify(%s, %s)",
            (notify_channel(conn.info.dbname), json.dumps({"t": "r", "id": job_id})),
        )
    waiter.join(10)
    assert not waiter.is_alive()
    assert outcome == {"value": OK_TUPLE}


def test_foreign_retries_then_failure_read_back_with_their_errors(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    job_id = ref.insert_one("MyApp.Workers.Flaky", {"x": 1}, max_attempts=2)
    ref.claim(job_id)
    backoff_until = clock.now() + timedelta(seconds=3)
    ref.ack(job_id, ("retry", {"error": "{:timeout, 30000}", "attempt": 1}, backoff_until))

    job = client.get_job(job_id)
    assert job is not None
    assert (job.state, job.attempt, job.ready_at) == ("ready", 1, backoff_until)
    assert job.errors == [{"error": "{:timeout, 30000}", "attempt": 1}]

    clock.advance(3)
    ref.claim(job_id)
    banner = "** (RuntimeError) boom ✗"
    ref.ack(job_id, ("failed", {"error": banner, "attempt": 2}))

    job = client.get_job(job_id)
    assert job is not None
    assert (job.state, job.attempt, job.finished_at) == ("failed", 2, clock.now())
    assert job.errors == [
        {"error": "{:timeout, 30000}", "attempt": 1},
        {"error": banner, "attempt": 2},
    ]
    with pytest.raises(JobFailed) as info:
        client.await_result(job_id, timeout=5)
    assert info.value.job.id == job_id
    assert info.value.job.errors[-1] == {"error": banner, "attempt": 2}
    assert "boom" in str(info.value)


def test_foreign_lease_expiry_error_reads_back(client: Belay, ref: Reference) -> None:
    job_id = ref.insert_one("MyApp.Workers.Lost", {}, max_attempts=1)
    ref.claim(job_id)
    at = ref.now().isoformat().replace("+00:00", "Z")
    ref.ack(job_id, ("failed", {"error": "lease_expired", "at": at}))
    job = client.get_job(job_id)
    assert job is not None and job.errors == [{"error": "lease_expired", "at": at}]


def test_foreign_cancelled_job_reads_back(client: Belay, ref: Reference) -> None:
    job_id = ref.insert_one("MyApp.Workers.Cancellable", {})
    ref.claim(job_id)
    ref.ack(job_id, ("cancelled", {"reason": ":user_abort"}))
    job = client.get_job(job_id)
    assert job is not None
    assert job.state == "cancelled" and job.errors == [{"reason": ":user_abort"}]
    with pytest.raises(JobCancelled) as info:
        client.await_result(job_id, timeout=5)
    assert info.value.job.errors == [{"reason": ":user_abort"}]


def test_foreign_encrypted_input_reads_back_untouched(client: Belay, ref: Reference) -> None:
    """A client reads ``{"$enc": …}`` inputs as stored; only a worker with the key decrypts."""
    sealed = {"$enc": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="}
    job_id = ref.insert_one("MyApp.Workers.Secret", sealed)
    job = client.get_job(job_id)
    assert job is not None and job.input == sealed


def test_foreign_input_with_big_integers_survives(client: Belay, ref: Reference) -> None:
    """Jason writes integers of any size into jsonb (numeric)."""
    job_id = ref.insert_one("MyApp.Workers.Big", {"id": 2**80 + 1, "ids": [-(2**70)]})
    job = client.get_job(job_id)
    assert job is not None and job.input == {"id": 2**80 + 1, "ids": [-(2**70)]}


# -- Budgets and steps ------------------------------------------------------------------


def test_foreign_budget_job_with_paid_steps_reads_back(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    """Five $0.20 steps against $0.50: the reference fails the job after the third."""
    job_id = ref.insert_one(
        "MyApp.Workers.Budgeted", {"prompt": "p"}, budget={"usd": 0.5, "tokens": 10_000}
    )
    ref.claim(job_id)
    values = [ETF["belay_step_result"], ETF["belay_job_args"], ETF["belay_ok_tuple_result"]]
    spent: tuple[int, int] = (0, 0)
    for i, value in enumerate(values, start=1):
        clock.advance(1)
        spent = ref.put_step(job_id, f"call_llm_{i}", value, usd_micros=200_000, tokens=1_500)
    assert spent == (600_000, 4_500)
    detail = "%{budget_usd_micros: 500000, spent_usd_micros: 600000}"
    ref.ack(job_id, ("failed", {"error": "budget_exceeded", "detail": detail}))

    job = client.get_job(job_id)
    assert job is not None
    assert (job.budget_usd_micros, job.budget_tokens) == (500_000, 10_000)
    assert (job.budget_usd, job.spent_usd) == (0.5, 0.6)
    assert (job.spent_usd_micros, job.spent_tokens) == (600_000, 4_500)
    assert job.state == "failed"
    assert job.errors == [{"error": "budget_exceeded", "detail": detail}]

    steps = client.steps(job_id)
    assert [(s.seq, s.name) for s in steps] == [
        (1, "call_llm_1"), (2, "call_llm_2"), (3, "call_llm_3"),
    ]
    assert [s.value for s in steps] == [STEP_RESULT, JOB_ARGS, OK_TUPLE]
    assert all((s.usd_micros, s.usd, s.tokens) == (200_000, 0.2, 1_500) for s in steps)
    assert steps[0].inserted_at < steps[2].inserted_at  # type: ignore[operator]


def test_foreign_step_journal_is_write_once(client: Belay, ref: Reference) -> None:
    """The reference's ON CONFLICT DO NOTHING keeps the first value (§11.3)."""
    job_id = ref.insert_one("MyApp.Workers.Once", {})
    ref.claim(job_id)
    ref.put_step(job_id, "fetch", ETF["binary_ascii"])
    ref.put_step(job_id, "fetch", ETF["binary_empty"])
    (step,) = client.steps(job_id)
    assert (step.seq, step.name, step.value) == (1, "fetch", "hello")


def test_foreign_sleep_step_value_is_a_datetime_struct(client: Belay, ref: Reference) -> None:
    """Belay.sleep memoizes its wake target (a DateTime) under ``$sleep:<name>``."""
    job_id = ref.insert_one("MyApp.Workers.Sleeper", {})
    ref.claim(job_id)
    ref.put_step(job_id, "$sleep:cooldown", ETF["map_elixir_datetime_struct"])
    (step,) = client.steps(job_id)
    assert step.name == "$sleep:cooldown"
    assert step.value == DATETIME_STRUCT
    assert step.value["__struct__"] == "Elixir.DateTime"


# -- Dynamic children (§8.4) -----------------------------------------------------------


def spawn_children(ref: Reference, parent_id: int, name: str, count: int) -> list[int]:
    """Runner.spawn_many: insert children keyed ``$spawn:<parent>:<name>:<i>`` (always),
    rebuild the id list from those keys, memoize it as the ``$spawn:<name>`` step."""
    rows = [
        ref.new(
            "MyApp.Workers.Child", {"i": i}, parent_id=parent_id,
            unique={"key": f"$spawn:{parent_id}:{name}:{i}", "scope": "always"},
        )
        for i in range(count)
    ]
    ref.insert(*rows)
    ids = []
    for i in range(count):
        row = ref.conn.execute(
            "SELECT id FROM belay_jobs WHERE unique_key = %s ORDER BY id DESC LIMIT 1",
            (f"$spawn:{parent_id}:{name}:{i}",),
        ).fetchone()
        assert row is not None
        ids.append(int(row[0]))
    return ids


def test_foreign_parent_with_spawned_children_reads_back(
    client: Belay, ref: Reference, sql_conn: Conn
) -> None:
    parent = ref.insert_one("MyApp.Workers.Parent", {"fan_out": 3})
    ref.claim(parent)
    # Children get ids 97, 98, 99 so the memoized id list is the real ETF of [97, 98, 99]
    # (Erlang encodes a list of bytes as STRING_EXT).
    sql_conn.execute(
        "SELECT setval(pg_get_serial_sequence('belay_jobs', 'id'), 96)"
    )
    children = spawn_children(ref, parent, "fanout", 3)
    assert children == [97, 98, 99]
    ref.put_step(parent, "$spawn:fanout", ETF["charlist_abc"])
    assert ref.ack(parent, ("await", f"job:{parent}", "$children", None)) == "awaiting"

    # A retried spawn inserts nothing new: the always-unique keys absorb it.
    spawn_children(ref, parent, "fanout", 3)
    listed = client.list_jobs(parent_id=parent)
    assert [j.id for j in listed] == [99, 98, 97]
    for index, job in enumerate(reversed(listed)):
        assert job.kind == "MyApp.Workers.Child"
        assert (job.unique_key, job.unique_mode) == (f"$spawn:{parent}:fanout:{index}", "always")
        assert job.input == {"i": index} and job.parent_id == parent

    (spawn_step,) = client.steps(parent)
    assert (spawn_step.name, spawn_step.value) == ("$spawn:fanout", children)

    job = client.get_job(parent)
    assert job is not None
    assert (job.state, job.await_scope, job.await_name, job.ready_at, job.attempt) == (
        "awaiting", f"job:{parent}", "$children", None, 0,
    )

    # Children finish on the foreign side; each ack signals the parent, which wakes.
    for child in children:
        ref.run_to_success(child, ETF["atom_ok"])
    job = client.get_job(parent)
    assert job is not None and (job.state, job.await_name) == ("ready", None)
    assert [client.get_job(c).result for c in children] == ["ok", "ok", "ok"]  # type: ignore[union-attr]


def test_python_cancel_of_a_foreign_child_wakes_the_foreign_parent(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    """§7: after a terminal write, the parent gets ``$children`` — whichever SDK wrote it."""
    parent = ref.insert_one("MyApp.Workers.Parent", {})
    ref.claim(parent)
    (child,) = spawn_children(ref, parent, "one", 1)
    ref.put_step(parent, "$spawn:one", ETF["list_empty"])
    ref.ack(parent, ("await", f"job:{parent}", "$children", None))

    assert client.cancel_job(child) == "cancelled"
    job = client.get_job(parent)
    assert job is not None
    assert (job.state, job.ready_at, job.await_scope) == ("ready", clock.now(), None)
    assert ref.get_signal([f"job:{parent}"], "$children") == {}


# -- Events --------------------------------------------------------------------------


def test_foreign_events_read_back_in_order(client: Belay, ref: Reference) -> None:
    """Belay.emit/2 appends Elixir maps (atom keys → JSON strings) to belay_events."""
    job_id = ref.insert_one("MyApp.Workers.Agent", {})
    payloads = [
        {"type": "turn", "turn": 1, "text": "Bonjour ✉"},
        {"type": "tool_call", "tool": "search", "args": {"q": "belay", "k": [1, 2]}},
        {"type": "usage", "usd_micros": 1250, "tokens": {"in": 900, "out": 350}},
        {"type": "done", "ok": True, "note": None},
    ]
    seqs = [ref.append_event(job_id, p) for p in payloads]
    assert seqs == [1, 2, 3, 4]
    events = client.events(job_id)
    assert [(e.seq, e.payload) for e in events] == list(zip(seqs, payloads, strict=True))
    assert [e.payload for e in client.events(job_id, after=2)] == payloads[2:]


# -- Workflows (§8.3) ------------------------------------------------------------------


def test_foreign_workflow_reads_back_as_it_settles(client: Belay, ref: Reference) -> None:
    """Belay.Workflow.insert: members with deps start held; the reference settles on ack."""
    rows = ref.insert(
        ref.new("MyApp.Flow.Fetch", {"u": 1}, workflow_id=WF_ID, wf_name="fetch"),
        ref.new("MyApp.Flow.Summarize", {}, workflow_id=WF_ID, wf_name="summarize",
                state="held", wf_deps=["fetch"]),
        ref.new("MyApp.Flow.Notify", {}, workflow_id=WF_ID, wf_name="notify", state="held",
                wf_deps=["summarize"], wf_ignore=["failed"]),
        ref.new("MyApp.Flow.Audit", {}, workflow_id=WF_ID, wf_name="audit", state="held",
                wf_deps=["fetch", "summarize"]),
    )
    ids = {r["wf_name"]: r["id"] for r in rows}
    ref.insert_one("MyApp.Flow.Other", {}, workflow_id="another", wf_name="fetch")

    status = client.workflow_status(WF_ID)
    assert [j.id for j in status.jobs] == sorted(ids.values())
    assert status.total == 4
    assert status.state_counts == {"ready": 1, "held": 3}
    assert not status.done
    by_name = status.by_name()
    assert {n: j.id for n, j in by_name.items()} == ids
    assert by_name["notify"].wf_deps == ["summarize"]
    assert by_name["notify"].wf_ignore == ["failed"]
    assert by_name["audit"].wf_deps == ["fetch", "summarize"]
    assert by_name["summarize"].kind == "MyApp.Flow.Summarize"

    # fetch succeeds → summarize released.
    ref.run_to_success(ids["fetch"], ETF["belay_step_result"])
    ref.settle_release(ids["summarize"])
    # summarize fails → notify (ignores failed) released, audit doomed.
    ref.claim(ids["summarize"])
    ref.ack(ids["summarize"], ("failed", {"error": "boom", "attempt": 1}))
    ref.settle_release(ids["notify"])
    ref.settle_doom(ids["audit"])
    status = client.workflow_status(WF_ID)
    assert status.state_counts == {"succeeded": 1, "failed": 1, "ready": 1, "cancelled": 1}
    assert not status.done
    assert status.by_name()["fetch"].result == STEP_RESULT

    ref.run_to_success(ids["notify"], None)
    status = client.workflow_status(WF_ID)
    assert status.done
    assert status.state_counts == {"succeeded": 2, "failed": 1, "cancelled": 1}


# -- Cron, stats --------------------------------------------------------------------


def test_foreign_cron_row_reads_back_and_dedupes_by_slot(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    clock.advance(37)  # slots are minute-truncated UTC
    slot = clock.now().replace(second=0, microsecond=0)
    first = ref.insert(
        ref.new("MyApp.Cron.Digest", {}, cron_name="nightly_digest", cron_slot=slot)
    )
    again = ref.insert(
        ref.new("MyApp.Cron.Digest", {}, cron_name="nightly_digest", cron_slot=slot)
    )
    assert len(first) == 1 and again == []
    (job,) = client.list_jobs(kind="MyApp.Cron.Digest")
    assert (job.cron_name, job.cron_slot) == ("nightly_digest", slot)
    assert job.cron_slot is not None and job.cron_slot.utcoffset() == timedelta(0)


def test_stats_count_foreign_rows(client: Belay, ref: Reference) -> None:
    a = ref.insert_one("MyApp.A", {}, queue="ai")
    ref.insert_one("MyApp.A", {}, queue="ai")
    ref.insert_one("MyApp.Mail", {}, queue="mailers")
    ref.insert_one("MyApp.Later", {}, queue="mailers", schedule_in=3600)
    ref.run_to_success(a, ETF["atom_ok"])
    client.enqueue("py.worker", queue="ai")
    assert client.stats() == {"ai": {"ready": 2, "succeeded": 1}, "mailers": {"ready": 2}}


# -- Uniqueness against foreign holders (§5.2) ------------------------------------------


def test_enqueue_reports_a_foreign_incomplete_holder_as_duplicate(
    client: Belay, ref: Reference, sql_conn: Conn
) -> None:
    holder = ref.insert_one("MyApp.Workers.Digest", {"user": 7}, unique="digest:user-7")
    before = count_jobs(sql_conn)
    dup = client.enqueue("py.digest", {"user": 7}, unique="digest:user-7")
    assert dup.duplicate is True
    assert dup.id == holder
    assert (dup.kind, dup.input, dup.unique_mode) == (
        "MyApp.Workers.Digest", {"user": 7}, "incomplete",
    )
    assert count_jobs(sql_conn) == before

    # Once the foreign holder is terminal the key is free again (incomplete mode).
    ref.run_to_success(holder, ETF["atom_ok"])
    fresh = client.enqueue("py.digest", {"user": 7}, unique="digest:user-7")
    assert fresh.duplicate is False and fresh.id != holder
    assert count_jobs(sql_conn) == before + 1
    # The key now has two rows; the holder is the newest (ORDER BY id DESC LIMIT 1).
    again = client.enqueue("py.digest", {"user": 7}, unique="digest:user-7")
    assert (again.duplicate, again.id) == (True, fresh.id)


def test_enqueue_reports_the_newest_foreign_row_of_a_key(
    client: Belay, ref: Reference
) -> None:
    old = ref.insert_one("MyApp.Workers.Digest", {"v": 1}, unique="digest:user-8")
    ref.claim(old)
    ref.ack(old, ("failed", {"error": "x", "attempt": 1}))
    new = ref.insert_one("MyApp.Workers.Digest", {"v": 2}, unique="digest:user-8")
    dup = client.enqueue("py.digest", unique="digest:user-8")
    assert (dup.duplicate, dup.id, dup.input, dup.state) == (True, new, {"v": 2}, "ready")


def test_enqueue_reports_a_foreign_window_holder_as_duplicate(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    """Both sides bucket the key as ``<key>@<floor(epoch / window)>``."""
    holder = ref.insert_one("MyApp.Workers.Report", {}, unique={"key": "report", "within": 3600})
    key = f"report@{int(clock.now().timestamp()) // 3600}"
    assert ref.row(holder)["unique_key"] == key
    ref.run_to_success(holder, None)  # window mode dedupes regardless of outcome

    clock.advance(60)
    dup = client.enqueue("py.report", unique=Unique("report", "window", 3600))
    assert (dup.duplicate, dup.id, dup.unique_key) == (True, holder, key)
    assert dup.kind == "MyApp.Workers.Report" and dup.state == "succeeded"

    clock.advance(3600)
    fresh = client.enqueue("py.report", unique={"key": "report", "mode": "window", "window": 3600})
    assert fresh.duplicate is False
    assert fresh.unique_key == f"report@{int(clock.now().timestamp()) // 3600}"


def test_enqueue_reports_a_foreign_always_holder_as_duplicate(
    client: Belay, ref: Reference
) -> None:
    holder = ref.insert_one(
        "MyApp.Workers.Welcome", {}, unique={"key": "welcome:user-7", "scope": "always"}
    )
    ref.claim(holder)
    ref.ack(holder, ("failed", {"error": "smtp down", "attempt": 1}))
    dup = client.enqueue("py.welcome", unique=Unique("welcome:user-7", "always"))
    assert (dup.duplicate, dup.id, dup.state, dup.unique_mode) == (
        True, holder, "failed", "always",
    )


def test_enqueue_many_mixes_foreign_duplicates_and_new_rows(
    client: Belay, ref: Reference
) -> None:
    holder = ref.insert_one("MyApp.Workers.Digest", {}, unique="k1")
    jobs = client.enqueue_many([
        {"kind": "py.a", "unique": "k0"},
        {"kind": "py.a", "unique": "k1"},
        {"kind": "py.a"},
    ])
    assert [j.duplicate for j in jobs] == [False, True, False]
    assert jobs[1].id == holder and jobs[1].kind == "MyApp.Workers.Digest"


def test_foreign_insert_is_skipped_by_a_python_holder(client: Belay, ref: Reference) -> None:
    """The other direction: the reference's ON CONFLICT DO NOTHING skips a key Python holds."""
    holder = client.enqueue("py.digest", unique="shared")
    assert ref.insert(ref.new("MyApp.Workers.Digest", {}, unique="shared")) == []
    row = ref.conn.execute(
        "SELECT id FROM belay_jobs WHERE unique_key = %s ORDER BY id DESC LIMIT 1", ("shared",)
    ).fetchone()
    assert row is not None and row[0] == holder.id


# -- Signals (§8.1) ------------------------------------------------------------------


def test_signal_job_wakes_a_foreign_awaiting_row(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    job_id = ref.insert_one("MyApp.Workers.Approval", {"doc": 1})
    other = ref.insert_one("MyApp.Workers.Approval", {"doc": 2})
    ref.claim(job_id, other)
    deadline = clock.now() + timedelta(hours=1)
    ref.ack(job_id, ("await", f"job:{job_id}", "approval", deadline))
    ref.ack(other, ("await", f"job:{other}", "approval", None))
    parked = client.get_job(job_id)
    assert parked is not None
    assert (parked.state, parked.await_scope, parked.await_name, parked.ready_at) == (
        "awaiting", f"job:{job_id}", "approval", deadline,
    )
    assert parked.attempt == 0  # parking gives the attempt back

    clock.advance(5)
    assert client.signal_job(job_id, "other_name", {}) == []
    assert client.signal_job(job_id, "approval", {"approved": True, "by": "ops ✓"}) == [job_id]

    woken = ref.row(job_id)
    assert (woken["state"], woken["ready_at"], woken["await_scope"], woken["await_name"]) == (
        "ready", clock.now(), None, None,
    )
    assert woken["attempt"] == 0
    assert ref.row(other)["state"] == "awaiting"
    # When the job runs again, the reference's await finds the payload (get_signal).
    assert ref.get_signal([f"job:{job_id}"], "approval") == {"approved": True, "by": "ops ✓"}


def test_signal_on_a_workflow_scope_wakes_a_foreign_awaiter(
    client: Belay, ref: Reference
) -> None:
    job_id = ref.insert_one("MyApp.Flow.Gate", {}, workflow_id=WF_ID, wf_name="gate")
    ref.claim(job_id)
    ref.ack(job_id, ("await", f"wf:{WF_ID}", "go", None))
    assert client.signal(f"wf:{WF_ID}", "go", {"n": 1}) == [job_id]
    assert ref.row(job_id)["state"] == "ready"
    assert ref.get_signal([f"job:{job_id}", f"wf:{WF_ID}"], "go") == {"n": 1}


def test_python_signal_before_a_foreign_park_makes_it_park_ready(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    """§7 park-and-wake: the reference's park sees the persistent row Python wrote."""
    job_id = ref.insert_one("MyApp.Workers.Approval", {})
    ref.claim(job_id)
    assert client.signal_job(job_id, "approval", {"ok": 1}) == []
    assert ref.ack(job_id, ("await", f"job:{job_id}", "approval", None)) == "ready"
    row = ref.row(job_id)
    assert (row["state"], row["ready_at"], row["await_name"]) == ("ready", clock.now(), None)


def test_steer_job_is_what_the_reference_reads_as_steering(
    client: Belay, ref: Reference
) -> None:
    job_id = ref.insert_one("MyApp.Workers.Agent", {})
    ref.claim(job_id)
    assert client.steer_job(job_id, {"hint": "be brief", "max_turns": 3}) == []
    assert ref.get_signal([f"job:{job_id}"], "$steer") == {"hint": "be brief", "max_turns": 3}
    assert ref.row(job_id)["state"] == "running"


def test_python_clears_a_foreign_signal(client: Belay, ref: Reference) -> None:
    ref.put_signal("job:5", "approval", {"from": "elixir"})
    assert client.clear_signal("job:5", "approval") is True
    assert ref.get_signal(["job:5"], "approval") is None
    assert client.clear_signal("job:5", "approval") is False


# -- The other direction: what a foreign reader sees of Python's writes ---------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(database=None, max_examples=300, deadline=None)
@given(json_values)
def test_python_values_are_json_a_foreign_reader_parses(value: Any) -> None:
    """§2: belay writes JSON, which never starts with byte 131, so Belay.Codec.decode
    takes the Jason path; the bytes are UTF-8 JSON of the same value."""
    data = encode_value(value)
    assert data[0] != ETF_VERSION
    assert json.loads(data.decode("utf-8")) == value


@pytest.mark.parametrize(
    "value",
    [
        {"summary": "done ✓", "turn": 3, "tags": ["a", "b"], "score": 0.25, "none": None},
        [1, "two", [3.5, {"x": False}]],
        "plain text",
        2**63 - 1,
        None,
        {},
    ],
)
def test_python_written_result_reads_as_plain_json_bytes(
    client: Belay, ref: Reference, value: Any
) -> None:
    """A Python worker's ack stores encode_value(result); a foreign reader gets JSON bytes."""
    job_id = client.enqueue("py.worker", {"n": 1}).id
    ref.claim(job_id)
    # The Python worker's succeeded ack (the same fenced UPDATE as the reference's).
    ref.ack(job_id, ("succeeded", encode_value(value)))
    raw = ref.row(job_id)["result"]
    assert isinstance(raw, bytes)
    assert raw[0] != 131
    assert json.loads(raw) == value
    assert client.await_result(job_id, timeout=5) == value


def test_python_written_result_with_big_integers_is_readable(client: Belay) -> None:
    data = encode_value({"n": 2**64, "m": -(2**63) - 1})
    assert json.loads(data) == {"n": 2**64, "m": -(2**63) - 1}


def test_python_enqueued_row_is_what_the_reference_expects(
    client: Belay, ref: Reference, clock: ManualClock
) -> None:
    """§5.1 new-row columns, jsonb input a foreign reader can query, and the reference's
    claim candidate query picks the row."""
    job = client.enqueue(
        "MyApp.Workers.Email", {"to": "a@example.com", "n": [1, 2]}, queue="mailers",
        budget={"usd": 0.5}, meta={"src": "py"},
    )
    row = ref.row(job.id)
    assert (row["kind"], row["queue"], row["state"], row["attempt"]) == (
        "MyApp.Workers.Email", "mailers", "ready", 0,
    )
    assert (row["errors"], row["spent_usd_micros"], row["spent_tokens"]) == ([], 0, 0)
    assert row["cancel_requested"] is False
    assert (row["inserted_at"], row["ready_at"]) == (clock.now(), clock.now())
    assert (row["wf_deps"], row["wf_ignore"]) == ([], [])
    assert row["budget_usd_micros"] == 500_000
    assert row["input"] == {"to": "a@example.com", "n": [1, 2]}
    assert row["meta"] == {"src": "py"}
    found = ref.conn.execute(
        "SELECT input->>'to', jsonb_typeof(input->'n') FROM belay_jobs WHERE id = %s", (job.id,)
    ).fetchone()
    assert found == ("a@example.com", "array")

    candidates = ref.conn.execute(
        """
        SELECT id FROM belay_jobs
        WHERE queue = %s
          AND ((state = 'ready' AND (ready_at IS NULL OR ready_at <= %s))
            OR (state = 'awaiting' AND ready_at IS NOT NULL AND ready_at <= %s))
        ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
        LIMIT %s
        FOR UPDATE SKIP LOCKED
        """,
        ("mailers", clock.now(), clock.now(), 10),
    ).fetchall()
    assert [c[0] for c in candidates] == [job.id]
