"""belay.ops: the views every operator surface shows, and the guard in front of
every mutation. Rows are written with plain SQL (helpers) or the client; the
guard's refusals are checked against the database, not just the exception."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import belay
from belay import ManualClock, ValidationError
from belay.ops import (
    Guard,
    Refused,
    job_detail,
    jsonable,
    load_authorizer,
    mutate,
    queue_overview,
)
from tests import helpers
from tests.helpers import START
from tests.strategies import deep

Conn = psycopg.Connection[Any]


def test_jsonable_turns_every_stored_shape_into_plain_json() -> None:
    opaque = belay.Opaque(b"\x83junk", "undecodable Erlang term")
    value = {"when": START, 1: (1, 2), "raw": b"abc", "opaque": opaque, "set": {3}}
    out = jsonable(value)
    assert out["when"] == START.isoformat()
    assert out["1"] == [1, 2]
    assert out["raw"] == "<3 bytes>"
    assert out["opaque"].startswith("<opaque: 5 bytes")
    assert out["set"] == "{3}"


def test_job_detail_gathers_row_journal_costs_events_children_and_workflow(
    client: belay.Belay, sql_conn: Conn
) -> None:
    wf = belay.Workflow("wf-ops")
    wf.add("fetch", "Ops.Fetch", {"url": "<script>"})
    wf.add("sum", "Ops.Sum", {}, deps=["fetch"])
    jobs = client.enqueue_workflow(wf)
    parent = jobs["fetch"].id
    sql_conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at) "
        "VALUES (%s, 1, 'plan', convert_to('\"a\"', 'UTF8'), 1500, 20, %s), "
        "(%s, 2, 'call', convert_to('{\"n\": 2}', 'UTF8'), 250, 5, %s)",
        (parent, START, parent, START),
    )
    sql_conn.execute(
        "INSERT INTO belay_events (job_id, seq, payload, inserted_at) VALUES (%s, 1, %s, %s)",
        (parent, Jsonb({"progress": 0.5}), START),
    )
    child = helpers.insert_job(sql_conn, kind="Ops.Child", parent_id=parent)

    detail = job_detail(client, parent)
    assert detail is not None
    assert detail["job"]["id"] == parent and detail["job"]["input"] == {"url": "<script>"}
    assert [(s["seq"], s["name"], s["value"]) for s in detail["steps"]] == [
        (1, "plan", "a"), (2, "call", {"n": 2})]
    assert detail["journal_cost"] == {"usd": 0.00175, "tokens": 25}
    assert [e["payload"] for e in detail["events"]] == [{"progress": 0.5}]
    assert [kid["id"] for kid in detail["children"]] == [child]
    graph = detail["workflow"]
    assert graph["workflow_id"] == jobs["fetch"].workflow_id and graph["total"] == 2
    assert graph["edges"] == [["fetch", "sum"]]
    assert job_detail(client, 10**9) is None


def test_queue_overview_counts_states_rates_and_options(
    client: belay.Belay, clock: ManualClock, sql_conn: Conn
) -> None:
    client.enqueue("Ops.A", {}, queue="mail")
    client.enqueue("Ops.A", {}, queue="mail")
    now = client.now()
    helpers.insert_job(sql_conn, queue="mail", state="succeeded", finished_at=now)
    helpers.insert_job(sql_conn, queue="mail", state="failed",
                       finished_at=now - timedelta(seconds=30))
    # Finished two minutes ago: counted in the state, not in the last minute.
    helpers.insert_job(sql_conn, queue="mail", state="succeeded",
                       finished_at=now - timedelta(minutes=2))
    client.put_queue("ai", limit=3, global_limit=5)
    client.pause_queue("ai")

    tiles = {tile["queue"]: tile for tile in queue_overview(client)}
    assert set(tiles) == {"mail", "ai"}
    mail = tiles["mail"]
    assert mail["counts"]["ready"] == 2 and mail["counts"]["succeeded"] == 2
    assert mail["total"] == 5
    assert mail["last_minute"] == {"succeeded": 1, "failed": 1, "cancelled": 0}
    assert mail["options"] is None and mail["paused"] is False
    ai = tiles["ai"]
    assert ai["total"] == 0 and ai["paused"] is True
    assert ai["options"]["limit"] == 3 and ai["options"]["global_limit"] == 5


# -- The guard ----------------------------------------------------------------------


def test_a_default_guard_refuses_every_mutation_and_writes_nothing(
    client: belay.Belay, sql_conn: Conn
) -> None:
    job = client.enqueue("Ops.A", {})
    guard = Guard()
    assert guard.read_only
    for tool, args in [("cancel_job", {"job_id": job.id}), ("retry_job", {"job_id": job.id}),
                       ("signal", {"job_id": job.id, "name": "go", "payload": {}}),
                       ("steer_job", {"job_id": job.id, "payload": {"x": 1}})]:
        with pytest.raises(Refused, match="--allow-mutations"):
            mutate(client, guard, tool, args)
    row = helpers.job_row(sql_conn, job.id)
    assert row["state"] == "ready" and row["cancel_requested"] is False
    assert sql_conn.execute("SELECT count(*) FROM belay_signals").fetchone() == (0,)


def test_allow_lets_mutations_through(client: belay.Belay, sql_conn: Conn) -> None:
    job = client.enqueue("Ops.A", {})
    guard = Guard(allow=True)
    assert mutate(client, guard, "steer_job", {"job_id": job.id, "payload": {"x": 1}})[
        "steered"]
    assert mutate(client, guard, "cancel_job", {"job_id": str(job.id)})["status"] == "cancelled"
    retried = mutate(client, guard, "retry_job", {"job_id": job.id})
    assert retried["job"]["state"] == "ready"
    signals = sql_conn.execute("SELECT scope, name FROM belay_signals").fetchall()
    assert signals == [(f"job:{job.id}", "$steer")]


def test_the_authorizer_sees_each_call_and_its_refusal_is_the_message(
    client: belay.Belay, sql_conn: Conn
) -> None:
    job = client.enqueue("Ops.A", {})
    seen: list[tuple[str, dict[str, Any]]] = []

    def authorize(tool: str, args: dict[str, Any]) -> object:
        seen.append((tool, args))
        if tool == "signal":
            return None
        if tool == "steer_job":
            raise PermissionError("token does not cover steering")
        return False if tool == "retry_job" else "only signals are allowed"

    guard = Guard(authorizer=authorize)
    assert mutate(client, guard, "signal", {"job_id": job.id, "name": "go"})["woken"] == []
    with pytest.raises(Refused, match="only signals are allowed"):
        mutate(client, guard, "cancel_job", {"job_id": job.id})
    with pytest.raises(Refused, match="not authorized"):
        mutate(client, guard, "retry_job", {"job_id": job.id})
    with pytest.raises(Refused, match="token does not cover steering"):
        mutate(client, guard, "steer_job", {"job_id": job.id, "payload": {"a": 1}})
    assert seen == [
        ("signal", {"job_id": job.id, "name": "go", "payload": {}}),
        ("cancel_job", {"job_id": job.id}),
        ("retry_job", {"job_id": job.id}),
        ("steer_job", {"job_id": job.id, "payload": {"a": 1}}),
    ]
    assert helpers.job_row(sql_conn, job.id)["state"] == "ready"
    assert sql_conn.execute("SELECT name FROM belay_signals").fetchall() == [("go",)]


def test_an_authorizer_overrides_allow(client: belay.Belay) -> None:
    job = client.enqueue("Ops.A", {})
    guard = Guard(allow=True, authorizer=lambda tool, args: "no")
    with pytest.raises(Refused, match="no"):
        mutate(client, guard, "cancel_job", {"job_id": job.id})


@pytest.mark.parametrize(("tool", "args", "message"), [
    ("drop_table", {"job_id": 1}, "unknown mutation"),
    ("cancel_job", {}, "job_id is a job id"),
    ("cancel_job", {"job_id": True}, "job_id is a job id"),
    ("cancel_job", {"job_id": -3}, "job_id is a job id"),
    ("signal", {"job_id": 1}, "signal needs name"),
    ("signal", {"job_id": 1, "name": "go", "payload": [1]}, "a signal payload is a JSON object"),
    ("steer_job", {"job_id": 1, "payload": "left"}, "steering is a JSON object"),
    # str.isdigit() takes these: int() refuses "²" (a ValueError), reads "٣" as 3.
    ("cancel_job", {"job_id": "\u00b2"}, "job_id is a job id"),
    ("cancel_job", {"job_id": "\u0663"}, "job_id is a job id"),
    ("retry_job", {"job_id": 2**63}, "job_id is a job id"),
    ("retry_job", {"job_id": 1.0}, "job_id is a job id"),
    ("signal", {"job_id": 1, "name": "go\x00"}, "name (the signal name) contains a NUL"),
    ("signal", {"job_id": 1, "name": "\udfff"}, "name (the signal name) contains a lone"),
    ("signal", {"job_id": 1, "name": "n" * 256}, "name (the signal name) is 256 bytes long"),
    ("signal", {"job_id": 1, "name": "$steer"}, "reserved for belay"),
    ("signal", {"job_id": 1, "name": "go", "payload": []}, "a signal payload is a JSON object"),
    ("signal", {"job_id": 1, "name": "go", "payload": {"a": {"b": math.nan}}},
     "payload['a']['b'] is nan"),
    ("signal", {"job_id": 1, "name": "go", "payload": {1: "x"}}, "payload has a key that is not"),
    ("signal", {"job_id": 1, "name": "go", "payload": {"a": {1, 2}}}, "payload['a'] is a set"),
    ("steer_job", {"job_id": 1, "payload": {"a": deep(2_000)}},
     "payload nests deeper than 64 levels"),
    ("steer_job", {"job_id": 1, "payload": {"a": "\ud800"}}, "payload['a'] contains a lone"),
    ("steer_job", {"job_id": 1, "payload": {}, "name": "x"}, "unknown argument(s) 'name'"),
    ("cancel_job", {"job_id": 1, "force": True}, "unknown argument(s) 'force'"),
])
def test_bad_arguments_are_refused_before_the_authorizer_is_asked(
    client: belay.Belay, sql_conn: Conn, tool: str, args: dict[str, Any], message: str
) -> None:
    job = helpers.insert_job(sql_conn)
    assert job == 1
    asked: list[str] = []
    guard = Guard(authorizer=lambda tool, args: asked.append(tool))
    with pytest.raises(ValidationError, match=re.escape(message)):
        mutate(client, guard, tool, args)
    assert asked == []
    assert helpers.job_row(sql_conn, job)["state"] == "ready"
    assert helpers.signal_rows(sql_conn) == []


def test_arguments_that_fit_pass_as_given(client: belay.Belay, sql_conn: Conn) -> None:
    job = helpers.insert_job(sql_conn)
    payload = {"a": deep(62), "b": ["\u00b2", 10**30, -1.5, None, True], "\u0663": "\u202e"}
    mutate(client, Guard(allow=True), "steer_job", {"job_id": f" {job} ", "payload": payload})
    mutate(client, Guard(allow=True), "signal", {"job_id": job, "name": "\u00e9" * 127})
    rows = helpers.signal_rows(sql_conn)
    assert [row["name"] for row in rows] == ["$steer", "\u00e9" * 127]
    assert rows[0]["payload"] == payload


def test_a_broken_authorizer_module_is_a_configuration_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_guard_mod.py").write_text("def authorize(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(belay.ConfigurationError, match="importing 'broken_guard_mod' failed: "
                                                      "SyntaxError"):
        load_authorizer("broken_guard_mod:authorize")


def test_load_authorizer_imports_module_colon_callable() -> None:
    assert load_authorizer("json:dumps") is __import__("json").dumps
    assert load_authorizer("os.path:join") is __import__("os").path.join
    for spec, message in [("json", "module:callable"), ("no_such_mod_x:f", "cannot import"),
                          ("json:nope", "has no 'nope'"), ("json:__doc__", "not callable")]:
        with pytest.raises(belay.ConfigurationError, match=message):
            load_authorizer(spec)


def test_job_detail_is_bounded_and_counts_what_it_leaves_out(
    client: belay.Belay, sql_conn: Conn
) -> None:
    parent = client.enqueue("Ops.Parent", {}).id
    sql_conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at) "
        "SELECT %s, n, 's' || n, convert_to(n::text, 'UTF8'), 100 * n, n, %s "
        "FROM generate_series(1, 3) AS n", (parent, START))
    sql_conn.execute(
        "INSERT INTO belay_events (job_id, seq, payload, inserted_at) "
        "SELECT %s, n, jsonb_build_object('n', n), %s FROM generate_series(1, 3) AS n",
        (parent, START))
    kids = [helpers.insert_job(sql_conn, kind="Ops.Child", parent_id=parent) for _ in range(2)]

    detail = job_detail(client, parent, steps=2, events=2, children=1)
    assert detail is not None
    assert [s["name"] for s in detail["steps"]] == ["s1", "s2"] and detail["steps_total"] == 3
    # The whole journal's cost, not only the entries shown.
    assert detail["journal_cost"] == {"usd": 0.0006, "tokens": 6}
    assert [e["seq"] for e in detail["events"]] == [2, 3] and detail["events_total"] == 3
    assert [kid["id"] for kid in detail["children"]] == kids[:1]
    assert detail["children_total"] == 2


def test_signal_and_steer_of_a_missing_job_are_not_found_and_store_nothing(
    client: belay.Belay, sql_conn: Conn
) -> None:
    guard = Guard(allow=True)
    for tool, args in [("signal", {"job_id": 424242, "name": "go"}),
                       ("steer_job", {"job_id": 424242, "payload": {"x": 1}})]:
        with pytest.raises(belay.JobNotFound):
            mutate(client, guard, tool, args)
    assert sql_conn.execute("SELECT count(*) FROM belay_signals").fetchone() == (0,)
