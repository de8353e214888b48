"""Replay debugging (``belay.replay.dry_run``, ``belay replay``): a job's worker code
runs again against the journal a real worker recorded, with no side effects.

Every recording here is made by a real worker (``belay.testing.drain``, or a
started ``belay.Worker`` for a job that is still running) running the functions
of ``tests/replay_jobs.py``; a replay's step functions never run, which
``replay_jobs.CALLS`` counts. That nothing is written is checked against every
belay table's rows with their ``xmin`` (an UPDATE changes it) and every
sequence's last value.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import belay
from belay import replay
from belay.job import Step
from belay.replay import Ask, divergence
from belay.testing import drain
from tests import replay_jobs as jobs
from tests.helpers import START
from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _calls(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs.CALLS.clear()
    monkeypatch.delenv(jobs.VARIANT_ENV, raising=False)


def record(client: belay.Belay, kind: str, input: dict[str, Any] | None = None,
           **options: Any) -> belay.Job:
    """Enqueue a job and let a real worker run it; returns the job as it ended."""
    job = client.enqueue(kind, input or {}, **options)
    drain(jobs.QUEUE, client=client)
    found = client.get_job(job.id)
    assert found is not None
    return found


def world(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Every row of every belay table with its xmin, and every sequence's value."""
    tables = [row[0] for row in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
        "AND tablename LIKE 'belay%' ORDER BY 1")]
    assert {"belay_jobs", "belay_steps", "belay_events", "belay_signals", "belay_rate"} <= set(
        tables)
    seen: dict[str, Any] = {
        table: conn.execute(sql.SQL(
            "SELECT t.xmin::text, t.ctid::text, t::text FROM {} AS t ORDER BY t.ctid"
        ).format(sql.Identifier(table))).fetchall()
        for table in tables
    }
    seen["$sequences"] = conn.execute(
        "SELECT sequencename, last_value FROM pg_sequences ORDER BY 1").fetchall()
    return seen


def ops(report: replay.ReplayReport) -> list[tuple[str, str | None, str, int | None]]:
    return [(a.op, a.name, a.status, a.seq) for a in report.trace if a.op not in ("emit", "debit")]


# -- Same code, same record ---------------------------------------------------------------


def test_a_finished_job_replays_to_the_same_result_without_running_a_step(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    assert job.state == "succeeded" and jobs.CALLS == {"fetch": 1, "parse": 1, "summarize": 1}
    jobs.CALLS.clear()

    report = replay.dry_run(client, job.id)

    assert report.outcome == "ok" and not report.diverged
    assert report.value == job.result == {"summary": "Belay: 6 words",
                                          "asked": ["fetch", "parse", "summarize"]}
    assert report.matches_recorded_result is True
    assert jobs.CALLS == {}
    assert ops(report) == [("step", "fetch", "served", 1), ("step", "parse", "served", 2),
                           ("step", "summarize", "served", 3)]
    inert = [(a.op, a.status, dict(a.detail)) for a in report.trace if a.op in ("emit", "debit")]
    assert inert == [("emit", "inert", {"payload": {"step": name}}) for name in jobs.RECORDED_ORDER
                     ] + [("debit", "inert", {"units": 415, "period": 60})]
    assert report.unused == [] and report.out_of_order == [] and report.not_reached == []
    assert report.spend["served_usd"] == pytest.approx(0.021)
    assert report.spend["served_tokens"] == 415 == report.spend["recorded_spent_tokens"]
    assert report.spend["debited"] == {"llm-tokens": 415}
    assert len(client.events(job.id)) == 3  # the recorded run's, none added


def test_the_report_is_json_ready_and_readable(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    report = replay.dry_run(client, job.id)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["outcome"] == "ok" and data["diverged"] is False
    assert data["job"] == {"id": job.id, "kind": jobs.PIPELINE, "queue": jobs.QUEUE,
                           "state": "succeeded", "attempt": 1, "max_attempts": 20}
    assert data["trace"][0] == {"position": 1, "op": "step", "name": "fetch",
                                "status": "served", "seq": 1}
    assert data["recorded_result"] == data["value"] and data["journal_entries"] == 3
    text = replay.format_report(report)
    assert text.splitlines()[0] == (
        f"job {job.id} replay.pipeline (succeeded, attempt 1/20): ok: the code ran to its "
        "end on the journal alone")
    assert "matches the recorded result" in text
    assert "step           summarize                served   seq 3" in text


# -- Code that moved on -------------------------------------------------------------------


def test_a_new_step_blocks_the_replay_without_running_it(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    jobs.CALLS.clear()
    changed = jobs.changed_pipeline(("fetch", "parse", "audit", "summarize"))

    report = replay.dry_run(client, job.id, registry=changed)

    assert report.outcome == "blocked" and report.diverged
    assert report.reason == {"missing_step": "audit"}
    assert jobs.CALLS["audit"] == 0 and jobs.CALLS == {}
    assert ops(report) == [("step", "fetch", "served", 1), ("step", "parse", "served", 2),
                           ("step", "audit", "missing", None)]
    # The run stopped there: summarize is not "unused", it was not reached.
    assert [(s.seq, s.name) for s in report.not_reached] == [(3, "summarize")]
    assert report.unused == []
    assert "step 'audit' is not in the journal" in replay.format_report(report)


def test_a_removed_step_is_reported_unused(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    report = replay.dry_run(client, job.id, registry=jobs.changed_pipeline(
        ("fetch", "summarize")))
    assert report.outcome == "ok" and report.diverged
    assert [(s.seq, s.name) for s in report.unused] == [(2, "parse")]
    assert report.matches_recorded_result is False
    assert report.value == {"summary": "Belay: 6 words", "asked": ["fetch", "summarize"]}
    assert "unused journal entries" in replay.format_report(report)


def test_steps_asked_in_another_order_are_reported_out_of_order(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    report = replay.dry_run(client, job.id, registry=jobs.changed_pipeline(
        ("parse", "fetch", "summarize")))
    assert report.outcome == "ok" and report.diverged
    assert report.matches_recorded_result is True  # same values, served in another order
    assert [(position, ask.name, ask.seq) for position, ask in report.out_of_order] == [
        (1, "parse", 2)]
    assert report.to_dict()["out_of_order"] == [{"position": 1, "name": "parse", "seq": 2}]
    assert report.unused == []


def test_divergence_keeps_the_longest_run_in_journal_order():
    journal = [Step(n, name, None, 0, 0, None) for n, name in enumerate("abcd", 1)]
    trace = [Ask("step", "c", "served", 3), Ask("emit", None, "inert"),
             Ask("step", "a", "served", 1), Ask("step", "b", "served", 2),
             Ask("step", "a", "served", 1)]
    unused, moved = divergence(trace, journal)
    assert [s.name for s in unused] == ["d"]
    assert [(position, ask.name) for position, ask in moved] == [(1, "c")]
    assert divergence([], journal) == (journal, [])


def test_code_that_raises_during_replay_reports_the_exception(client):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    report = replay.dry_run(client, job.id, registry=jobs.pipeline_with(
        jobs.expects_a_new_field))
    assert report.outcome == "raised"
    assert report.error is not None
    assert (report.error["type"], report.error["message"]) == ("KeyError", "'body'")
    assert "expects_a_new_field" in report.error["traceback"]
    assert report.error["recorded"] is None and report.error["matches_recorded"] is None
    assert [(s.seq, s.name) for s in report.unused] == [(2, "parse"), (3, "summarize")]
    assert jobs.CALLS == {"fetch": 1, "parse": 1, "summarize": 1}  # the recording's only


def test_a_failed_job_replays_its_exception_and_a_fix_passes(client):
    job = record(client, jobs.FAILING, {"rows": [1, 2, "x", 4]})
    assert job.state == "failed"
    jobs.CALLS.clear()

    report = replay.dry_run(client, job.id)
    assert report.outcome == "raised" and report.error is not None
    assert report.error["type"] == "ValueError"
    assert report.error["message"] == "row 3 is not a number: 'x'"
    assert report.error["recorded"] == "ValueError: row 3 is not a number: 'x'"
    assert report.error["matches_recorded"] is True
    assert ops(report) == [("step", "load", "served", 1)]
    text = replay.format_report(report)
    assert "the same as the last recorded error" in text and "Traceback" in text

    fixed = replay.dry_run(client, job.id, registry=jobs.fixed_failing())
    assert fixed.outcome == "ok" and fixed.value == 7
    assert fixed.matches_recorded_result is None  # the job has no recorded result
    assert jobs.CALLS == {}
    assert client.get_job(job.id) == job


# -- Children, signals, steering, sleep ----------------------------------------------------


def test_children_are_served_from_the_spawn_record_and_their_rows(client):
    parent = client.enqueue(jobs.PARENT, {"inputs": [{"n": 1}, {"n": 2}]})
    assert drain(jobs.QUEUE, client=client) == {"await": 1}
    kids = sorted(k.id for k in client.list_jobs(parent_id=parent.id))

    waiting = replay.dry_run(client, parent.id)
    assert waiting.outcome == "blocked"
    assert waiting.reason == {"awaiting_children": kids}
    assert ops(waiting) == [("spawn", "$spawn:fan", "served", 1),
                            ("await_children", "$children", "missing", None)]
    assert waiting.trace[0].detail == {"inputs": 2}

    drain(jobs.KIDS, client=client)
    drain(jobs.QUEUE, client=client)
    done = replay.dry_run(client, parent.id)
    assert done.outcome == "ok" and done.value == [10, 20]
    assert done.matches_recorded_result is True
    assert done.trace[1].detail == {"children": [{"id": i, "state": "succeeded"} for i in kids]}
    assert len(client.list_jobs(parent_id=parent.id)) == 2


def test_signals_and_steering_are_read_from_the_record(client):
    job = client.enqueue(jobs.APPROVAL)
    assert drain(jobs.QUEUE, client=client) == {"await": 1}

    parked = replay.dry_run(client, job.id)
    assert parked.outcome == "blocked" and parked.reason == {"awaiting_signal": "approve"}
    assert ops(parked) == [("step", "draft", "served", 1),
                           ("await_signal", "approve", "missing", None)]

    client.steer_job(job.id, {"tone": "formal"})
    client.signal_job(job.id, "approve", {"by": "ann"})
    # Delivered, not yet run again: the replay gets past the await, up to the
    # step the recording has not reached.
    signalled = replay.dry_run(client, job.id)
    assert signalled.reason == {"missing_step": "publish"}
    assert ops(signalled) == [("step", "draft", "served", 1),
                              ("await_signal", "approve", "served", None),
                              ("steering", "$steer", "read", None),
                              ("step", "publish", "missing", None)]
    assert jobs.CALLS == {"draft": 1}

    # The replays left the real run alone: it wakes and finishes as ever.
    assert drain(jobs.QUEUE, client=client) == {"succeeded": 1}
    assert jobs.CALLS == {"draft": 1, "publish": 1}
    done = replay.dry_run(client, job.id)
    assert done.outcome == "ok" and done.matches_recorded_result is True
    assert done.value == {"published": "v1 by ann", "tone": {"tone": "formal"}}


def test_a_recorded_signal_timeout_replays_as_timeout(client, clock):
    job = client.enqueue(jobs.APPROVAL)
    drain(jobs.QUEUE, client=client)
    clock.advance(3600)
    assert drain(jobs.QUEUE, client=client) == {"succeeded": 1}
    report = replay.dry_run(client, job.id)
    assert report.outcome == "ok" and report.value == {"expired": True, "draft": "v1"}
    assert report.matches_recorded_result is True
    assert ops(report)[1] == ("await_signal", "approve", "timeout", None)


def test_a_durable_sleep_is_served_from_its_record(client, clock):
    job = client.enqueue(jobs.NAPPER)
    assert drain(jobs.QUEUE, client=client) == {"snooze": 1}
    asleep = replay.dry_run(client, job.id)
    assert asleep.outcome == "blocked"
    assert asleep.reason == {"sleeping": "cool",
                             "until": (START + timedelta(seconds=60)).isoformat()}
    assert ops(asleep) == [("step", "before", "served", 1), ("sleep", "$sleep:cool", "served", 2)]

    clock.advance(60)
    assert drain(jobs.QUEUE, client=client) == {"succeeded": 1}
    done = replay.dry_run(client, job.id)
    assert done.outcome == "ok" and done.value == ["a", "b"]
    assert done.matches_recorded_result is True
    assert jobs.CALLS == {"before": 1, "after": 1}


# -- Any state, no writes -----------------------------------------------------------------


def test_a_running_job_replays_read_only_while_it_runs(client, sql_conn):
    jobs.ENTERED.clear()
    jobs.GATE.clear()
    job = client.enqueue(jobs.SLOW)
    worker = belay.Worker({jobs.QUEUE: 2}, client=client, lease_ttl=300, busy_poll=0.01,
                          poll_interval=0.05)
    try:
        with worker:
            assert jobs.ENTERED.wait(10)
            before = world(sql_conn)
            report = replay.dry_run(client, job.id)
            assert world(sql_conn) == before
            assert report.job.state == "running"
            assert report.outcome == "blocked" and report.reason == {"missing_step": "slow"}
            assert ops(report) == [("step", "first", "served", 1),
                                   ("step", "slow", "missing", None)]
            assert jobs.CALLS == {"first": 1, "slow": 1}  # the live run's, not the replay's
            jobs.GATE.set()
            assert client.await_result(job.id, timeout=10) == 42
    finally:
        jobs.GATE.set()
    finished = replay.dry_run(client, job.id)
    assert finished.outcome == "ok" and finished.matches_recorded_result is True


def test_replays_write_nothing_whatever_the_code_does(client, sql_conn):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    parent = client.enqueue(jobs.PARENT, {"inputs": [{"n": 1}]})
    drain(jobs.QUEUE, client=client)
    before = world(sql_conn)

    outcomes = {
        "same": replay.dry_run(client, job.id),
        "new step": replay.dry_run(client, job.id, registry=jobs.changed_pipeline(
            ("fetch", "audit"))),
        "raises": replay.dry_run(client, job.id, registry=jobs.pipeline_with(
            jobs.expects_a_new_field)),
        "enqueue": replay.dry_run(client, job.id, registry=jobs.pipeline_with(
            jobs.enqueues_directly)),
        "spawn": replay.dry_run(client, job.id, registry=jobs.pipeline_with(
            jobs.spawns_new_children)),
        "sql write": replay.dry_run(client, job.id, registry=jobs.pipeline_with(
            jobs.writes_through_the_client)),
        "children": replay.dry_run(client, parent.id),
    }

    assert world(sql_conn) == before
    assert {name: r.outcome for name, r in outcomes.items()} == {
        "same": "ok", "new step": "blocked", "raises": "raised", "enqueue": "blocked",
        "spawn": "blocked", "sql write": "raised", "children": "blocked"}
    assert outcomes["enqueue"].reason == {"client_call": "enqueue"}
    assert outcomes["spawn"].reason == {"missing_step": "$spawn:audits"}
    error = outcomes["sql write"].error
    assert error is not None and error["type"] == "ReadOnlySqlTransaction"
    assert jobs.CALLS == {"fetch": 1, "parse": 1, "summarize": 1}  # the recording's only


# -- The server refuses the code's writes, whatever SQL it sends (issue 19) ----------------


def role_exists(conn: psycopg.Connection[Any], role: str) -> bool:
    return conn.execute("SELECT count(*) FROM pg_roles WHERE rolname = %s", (role,)
                        ).fetchone() == (1,)


@pytest.mark.parametrize("how", jobs.ESCAPES)
def test_code_that_leaves_the_read_only_transaction_still_cannot_write(client, sql_conn, how):
    """The connecting role (a superuser here) may write: the replay runs as a
    login role made for it, with no write privilege, dropped afterwards. So
    COMMIT, RESET ROLE, SET ROLE, SET SESSION AUTHORIZATION, RESET ALL,
    set_config(), DO, autocommit, the client's pool and a connection of the
    code's own on ctx.client.conninfo all end in a refused write."""
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    victim = client.enqueue(jobs.KID, {"n": 1})
    jobs.ESCAPE.update(victim=victim.id, user=None)
    before = world(sql_conn)

    report = replay.dry_run(client, job.id, registry=jobs.escapes(how))

    assert report.outcome == "raised", report.to_dict()
    assert client.get_job(victim.id) is not None
    assert world(sql_conn) == before
    assert report.error is not None
    # Refused by the role's privileges, not by the (escaped) read-only transaction.
    assert report.error["type"] == "InsufficientPrivilege", report.error
    seen = jobs.ESCAPE["user"]
    if seen is not None:  # the replay's own role, gone once the replay ended
        assert seen.startswith("belay_replay_") and not role_exists(sql_conn, seen)


@pytest.fixture
def login_role(sql_conn, db_url):
    """A login role of this test's own (trust auth on the test server), dropped after."""
    role = f"belay_t_role_{os.getpid()}"
    sql_conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
    sql_conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        sql_conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        sql_conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def reader_url(sql_conn, db_url: str, role: str, grant: str) -> str:
    """The URL of ``role``, which may read every table and holds ``grant`` too."""
    name = sql.Identifier(role)
    sql_conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(name))
    sql_conn.execute(sql.SQL(grant).format(name))
    return psycopg.conninfo.make_conninfo(db_url, user=role)


def test_a_role_that_can_write_and_cannot_make_one_is_refused_clearly(client, sql_conn,
                                                                      db_url, clock,
                                                                      login_role):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    role = sql.Identifier(login_role)
    url = reader_url(sql_conn, db_url, login_role, "GRANT DELETE ON belay_events TO {}")
    with belay.Belay(url, clock=clock) as writer:
        with pytest.raises(belay.ConfigurationError) as refused:
            replay.dry_run(writer, job.id)
        message = str(refused.value)
        assert f"{login_role} may write to belay_events" in message
        assert "pg_read_all_data" in message and "docs/operations.md" in message

        # The same role with reads only: replayed as it is, no role made.
        sql_conn.execute(sql.SQL("REVOKE DELETE ON belay_events FROM {}").format(role))
        jobs.ESCAPE.update(victim=job.id, user=None)
        report = replay.dry_run(writer, job.id, registry=jobs.escapes("commit"))
        assert jobs.ESCAPE["user"] == login_role
        assert report.outcome == "raised" and report.error is not None
        assert report.error["type"] == "InsufficientPrivilege"
        assert replay.dry_run(writer, job.id).outcome == "ok"
    assert client.get_job(job.id) is not None


def test_a_column_level_write_grant_counts_as_writing(client, sql_conn, db_url, clock,
                                                     login_role):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    # Not a table privilege: has_table_privilege says no, yet UPDATE (state) works.
    url = reader_url(sql_conn, db_url, login_role, "GRANT UPDATE (state) ON belay_jobs TO {}")
    with belay.Belay(url, clock=clock) as writer, \
            pytest.raises(belay.ConfigurationError, match="may write to belay_jobs"):
        replay.dry_run(writer, job.id)
    assert client.get_job(job.id).state == "succeeded"


# -- Inputs, kinds, ids -------------------------------------------------------------------


def test_an_encrypted_input_is_decrypted_with_the_clients_key(db_url, clock):
    key = os.urandom(32)
    with belay.Belay(db_url, clock=clock, encryption_key=key) as keyed:
        job = record(keyed, jobs.SECRET, {"secret": "psst"})
        assert job.state == "succeeded" and "$enc" in job.input
        report = replay.dry_run(keyed, job.id)
        assert report.outcome == "ok" and report.value == "PSST!"
        assert report.matches_recorded_result is True
    with belay.Belay(db_url, clock=clock) as keyless, pytest.raises(
            belay.ConfigurationError, match="encryption_key"):
        replay.dry_run(keyless, job.id)


def test_a_chunk_workers_job_replays_as_a_chunk_of_one(client):
    first = client.enqueue(jobs.CHUNKY, {"n": 2})
    second = client.enqueue(jobs.CHUNKY, {"n": 5})
    assert drain(jobs.QUEUE, client=client) == {"succeeded": 2}
    report = replay.dry_run(client, second.id)
    assert report.outcome == "ok" and report.value == 10
    assert report.matches_recorded_result is True
    assert replay.dry_run(client, first.id).value == 4


def test_an_unknown_job_raises_job_not_found(client):
    with pytest.raises(belay.JobNotFound) as raised:
        replay.dry_run(client, 424242)
    assert raised.value.job_id == 424242


def test_an_unregistered_kind_names_the_module_to_import(client):
    job = client.enqueue("replay.nobody", {})
    with pytest.raises(belay.ConfigurationError, match=r"--import MODULE") as raised:
        replay.dry_run(client, job.id)
    assert "'replay.nobody'" in str(raised.value)


# -- The command line -----------------------------------------------------------------------


def test_cli_replays_a_job_and_exits_0(client, db_url, monkeypatch):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    monkeypatch.chdir(ROOT)
    done = run_cli("replay", str(job.id), "--url", db_url, "--import", "tests.replay_jobs")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"job {job.id} replay.pipeline (succeeded, attempt 1/20): ok: the code ran")
    assert "matches the recorded result" in done.stdout


def test_cli_exits_5_with_json_when_the_code_diverged(client, db_url, monkeypatch):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(jobs.VARIANT_ENV, "audit")  # the code now asks for a new step
    done = run_cli("replay", str(job.id), "--url", db_url, "--import", "tests.replay_jobs",
                   "--json")
    assert done.returncode == 5, done.stderr
    report = json.loads(done.stdout)
    assert report["outcome"] == "blocked" and report["diverged"] is True
    assert report["reason"] == {"missing_step": "audit"}
    assert [(a["name"], a["status"]) for a in report["trace"] if a["op"] == "step"] == [
        ("fetch", "served"), ("parse", "served"), ("audit", "missing")]
    assert report["not_reached"] == [{"seq": 3, "name": "summarize"}]


def test_cli_exits_5_when_the_code_ends_but_left_the_record(client, db_url, monkeypatch):
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(jobs.VARIANT_ENV, "skip-parse")  # the code no longer asks for parse
    done = run_cli("replay", str(job.id), "--url", db_url, "--import", "tests.replay_jobs",
                   "--json")
    assert done.returncode == 5, done.stderr
    report = json.loads(done.stdout)
    assert report["outcome"] == "ok" and report["diverged"] is True
    assert report["unused"] == [{"seq": 2, "name": "parse"}]


def test_cli_exits_3_for_an_unknown_job_and_2_for_an_unregistered_kind(client, db_url,
                                                                       monkeypatch):
    monkeypatch.chdir(ROOT)
    missing = run_cli("replay", "424242", "--url", db_url, "--import", "tests.replay_jobs")
    assert missing.returncode == 3 and "job 424242 does not exist" in missing.stderr
    job = record(client, jobs.PIPELINE, jobs.PIPELINE_INPUT)
    unknown = run_cli("replay", str(job.id), "--url", db_url)
    assert unknown.returncode == 2
    assert "--import MODULE" in unknown.stderr and missing.stdout == unknown.stdout == ""
