"""Budgets that pause for a top-up, headroom and warnings (issue 24, items 1-2).

A job enqueued with ``budget={..., "on_exceed": "pause"}`` parks awaiting
``$top_up`` (no thread, no lease) at the step that crosses a cap;
``belay.top_up`` raises the cap and it resumes from its journal, paying for
no step twice. ``ctx.budget`` reads the headroom; warning thresholds are sent
once each, as job events and ``on_budget`` hooks.

Most tests drain jobs synchronously on the ``clock`` fixture with a private
registry; step functions count their calls, so "not paid twice" is a count.
The crash test kills a real worker process (``tests/budget_worker.py``) with
SIGKILL while it holds the job at the crossing point.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import belay
from belay import ops
from belay.budget import BudgetNotice, Headroom, policy_of
from tests.helpers import START, job_row, wait_until
from tests.test_steps import counted, drain, names, no_backoff, spend
from tests.test_worker_processes import Proc

PAUSE = {"usd": 0.5, "on_exceed": "pause"}


def events(conn: Any, job_id: int) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT payload FROM belay_events WHERE job_id = %s ORDER BY seq",
                        (job_id,)).fetchall()
    return [row[0] for row in rows]


FIFTH = belay.Cost(usd=0.2)


def spender(reg: belay.Registry, calls: list[int], steps: int = 5,
            cost: belay.Cost = FIFTH) -> Any:
    @belay.worker(name="spender", max_attempts=3, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> dict[str, Any]:
        values = [ctx.step(f"call-{n}", counted(calls, n, n), cost=cost)
                  for n in range(1, steps + 1)]
        return {"values": values, "spent": ctx.budget.usd_spent}

    return job


# -- enqueue ------------------------------------------------------------------------------


def test_the_policy_rides_in_meta_and_the_default_adds_nothing(client) -> None:
    plain = client.enqueue("k", budget={"usd": 1})
    assert plain.meta == {} and plain.budget_usd == 1.0
    paused = client.enqueue("k", budget={"usd": 1, "on_exceed": "pause", "warn_at": [0.9, 0.25]},
                            meta={"customer": "acme"})
    assert paused.meta == {"customer": "acme",
                           "$budget": {"on_exceed": "pause", "warn_at": [0.25, 0.9]}}
    assert client.get_job(paused.id).meta == paused.meta  # type: ignore[union-attr]
    assert policy_of(paused.meta).pauses and policy_of(paused.meta).warn_at == (0.25, 0.9)


@pytest.mark.parametrize(("budget", "message"), [
    ({"usd": 1, "on_exceed": "wait"}, "on_exceed is 'fail'"),
    ({"on_exceed": "pause"}, "need a cap"),
    ({"usd": 1, "warn_at": [1.5]}, "fractions between 0 and 1"),
    ({"usd": 1, "warn_at": 0.5}, "a list of fractions"),
    ({"usd": 1, "warn_at": [0.1] * 9}, "at most 8"),
    ({"usd": 1, "pause": True}, "unknown budget key"),
])
def test_a_bad_policy_is_refused_before_anything_is_written(client, sql_conn, budget,
                                                            message) -> None:
    with pytest.raises(belay.ValidationError, match=message):
        client.enqueue("k", budget=budget)
    assert sql_conn.execute("SELECT count(*) FROM belay_jobs").fetchone()[0] == 0


# -- pause and top-up -----------------------------------------------------------------------


def test_a_pausing_job_parks_at_the_crossing_and_a_top_up_resumes_it_paying_once(
        client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    job = client.enqueue(spender(reg, calls), budget=PAUSE)
    assert drain(client, reg) == {"await": 1}
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["await_scope"], row["await_name"]) == (
        "awaiting", f"job:{job.id}", "$top_up")
    assert (row["ready_at"], row["lease_until"], row["leased_by"]) == (None, None, None)
    assert row["attempt"] == 0  # a pause is not a failed try
    assert calls == [1, 2, 3] and spend(sql_conn, job.id) == (600_000, 0)
    paused = [e for e in events(sql_conn, job.id) if e["type"] == "budget_paused"]
    assert [(e["step"], e["usd_spent"], e["usd_limit"]) for e in paused] == [
        ("call-3", 0.6, 0.5)]

    # Draining again runs nothing: the pause holds no claimable row.
    assert drain(client, reg) == {}

    topped = client.top_up(job.id, usd=0.5)
    assert (topped.state, topped.budget_usd, topped.await_name) == ("ready", 1.0, None)
    assert drain(client, reg) == {"succeeded": 1}
    assert calls == [1, 2, 3, 4, 5]  # the three paid steps replayed, not paid again
    assert names(sql_conn, job.id)[:5] == [f"call-{n}" for n in range(1, 6)]
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("succeeded", 1, [])
    assert spend(sql_conn, job.id) == (1_000_000, 0)


def test_a_top_up_that_leaves_the_spend_over_a_cap_keeps_the_job_paused(client,
                                                                        sql_conn) -> None:
    reg, calls = belay.Registry(), []
    job = client.enqueue(spender(reg, calls), budget={**PAUSE, "tokens": 100})
    assert drain(client, reg) == {"await": 1}
    still = client.top_up(job.id, usd=0.05)  # 0.55 < 0.6 spent
    assert (still.state, still.await_name, still.budget_usd) == ("awaiting", "$top_up", 0.55)
    assert drain(client, reg) == {}
    resumed = client.top_up(job.id, usd=0.05)  # exactly at the cap is within it
    assert resumed.state == "ready"
    # The next step crosses again: paused again, at call-4.
    assert drain(client, reg) == {"await": 1}
    assert calls == [1, 2, 3, 4]
    assert client.top_up(job.id, usd=1).state == "ready"
    assert drain(client, reg) == {"succeeded": 1}
    assert calls == [1, 2, 3, 4, 5]


def test_a_top_up_ahead_of_time_raises_the_cap_of_a_waiting_job(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    job = client.enqueue(spender(reg, calls), budget=PAUSE)
    ahead = client.top_up(job.id, usd=0.5, tokens=None)
    assert (ahead.state, ahead.budget_usd) == ("ready", 1.0)
    assert drain(client, reg) == {"succeeded": 1}
    assert not [e for e in events(sql_conn, job.id) if e["type"] == "budget_paused"]


def test_top_up_refusals_name_the_fix(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    failing = client.enqueue(spender(reg, calls), budget={"usd": 0.5})
    assert drain(client, reg) == {"failed": 1}
    with pytest.raises(belay.ValidationError, match=r"on_exceed='fail'.*'on_exceed': 'pause'"):
        client.top_up(failing.id, usd=1)
    no_cap = client.enqueue("k", budget={"usd": 1})
    with pytest.raises(belay.ValidationError, match="no token budget to top up"):
        client.top_up(no_cap.id, tokens=10)
    with pytest.raises(belay.ValidationError, match="give usd=<dollars> and/or tokens"):
        client.top_up(no_cap.id)
    with pytest.raises(belay.ValidationError, match="usd must be a finite number >= 0"):
        client.top_up(no_cap.id, usd=-1)
    with pytest.raises(belay.JobNotFound):
        client.top_up(no_cap.id + 1000, usd=1)
    done = client.enqueue("k")
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE id = %s", (done.id,))
    with pytest.raises(belay.ValidationError, match="is succeeded"):
        client.top_up(done.id, usd=1)
    # Nothing was raised by a refusal.
    assert job_row(sql_conn, no_cap.id)["budget_usd_micros"] == 1_000_000


def test_a_top_up_racing_the_park_is_never_lost(client, sql_conn) -> None:
    """A top-up committed after the crossing step's journal write but before
    the park: the park reads the caps under the row lock and parks ready."""
    reg = belay.Registry()
    topped: list[belay.Job] = []

    @belay.worker(name="racer", registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("big", lambda: "x", cost=belay.Cost(usd=1))  # crosses 0.5
        return "done"

    worker = belay.Worker(["default"], client=client, registry=reg)

    @worker.on_budget
    def top_up_now(notice: BudgetNotice) -> None:
        # On the job's thread, after the crossing, before the park is written.
        if notice.event == "paused":
            topped.append(client.top_up(notice.job_id, usd=1))

    j = client.enqueue(job, budget=PAUSE)
    # Parked ready, not awaiting: the same drain runs it again, to the end.
    assert worker.drain() == {"woken": 1, "succeeded": 1}
    assert topped and topped[0].state == "running"
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"], row["errors"]) == ("succeeded", 1, [])


# -- per-step max_cost -------------------------------------------------------------------------


def headroom_job(reg: belay.Registry, calls: list[str], second: float = 0.4) -> Any:
    @belay.worker(name="headroom", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("a", counted(calls, "a", 1), cost=belay.Cost(usd=0.7))
        ctx.step("b", counted(calls, "b", 2), cost=belay.Cost(usd=second),
                 max_cost=belay.Cost(usd=0.5))
        return "done"

    return job


def test_max_cost_pauses_before_a_step_the_headroom_cannot_cover(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(headroom_job(reg, calls), budget={"usd": 1.0, "on_exceed": "pause"})
    assert drain(client, reg) == {"await": 1}
    assert calls == ["a"]  # b never started: $0.30 left, it may cost $0.50
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["await_name"]) == ("awaiting", "$top_up:500000:0")
    paused = [e for e in events(sql_conn, j.id) if e["type"] == "budget_paused"]
    assert [(e["step"], e["max_usd"], e["usd_remaining"]) for e in paused] == [("b", 0.5, 0.3)]
    assert client.top_up(j.id, usd=0.1).state == "awaiting"  # $0.40 left: still short
    assert drain(client, reg) == {}
    assert client.top_up(j.id, usd=0.1).state == "ready"  # $0.50 left: b fits
    assert drain(client, reg) == {"succeeded": 1}
    assert calls == ["a", "b"]
    assert spend(sql_conn, j.id) == (1_100_000, 0)


def test_max_cost_fails_before_the_step_by_default_and_reports_an_overrun(client,
                                                                         sql_conn) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(headroom_job(reg, calls), budget={"usd": 1.0})
    assert drain(client, reg) == {"failed": 1}
    assert calls == ["a"]
    [entry] = job_row(sql_conn, j.id)["errors"]
    assert (entry["error"], entry["step"], entry["max_cost_usd_micros"]) == (
        "budget_exceeded", "b", 500_000)

    reg2, calls2 = belay.Registry(), []
    over = client.enqueue(headroom_job(reg2, calls2, second=0.6), budget={"usd": 2.0})
    assert drain(client, reg2) == {"succeeded": 1}
    overruns = [e for e in events(sql_conn, over.id) if e["type"] == "budget_step_overrun"]
    assert [(e["step"], e["cost_usd"], e["max_usd"], e["max_tokens"]) for e in overruns] == [
        ("b", 0.6, 0.5, None)]


# -- children sharing a budget -------------------------------------------------------------


def test_a_shared_child_budget_pauses_the_child_then_the_parent_at_fan_in(client,
                                                                          sql_conn) -> None:
    """Defined: children of ``map_children(budget="share")`` follow the parent's
    policy. A top-up of a child raises that child's cap only; its spend is
    still charged to the parent at fan-in, where the parent's own cap binds
    the tree (the parent pauses there, and its top-up resumes it)."""
    reg = belay.Registry()
    kid_calls: list[int] = []

    @belay.worker(name="kid", backoff=no_backoff, registry=reg)
    def kid(ctx: belay.Context) -> int:
        for n in range(1, 4):
            ctx.step(f"k{n}", counted(kid_calls, ctx.id, n), cost=belay.Cost(usd=0.2))
        return ctx.id

    @belay.worker(name="lead", backoff=no_backoff, registry=reg)
    def lead(ctx: belay.Context) -> list[Any]:
        kids = ctx.map_children("fan", kid, [{}, {}], budget="share")
        ctx.step("after", lambda: "ok")
        return [k.result for k in kids]

    parent = client.enqueue(lead, budget={"usd": 1.0, "on_exceed": "pause"})
    drain(client, reg)
    kids = client.list_jobs(parent_id=parent.id)
    assert sorted(k.budget_usd for k in kids) == [0.5, 0.5]  # type: ignore[comparison-overlap]
    assert {k.meta["$budget"]["on_exceed"] for k in kids} == {"pause"}
    # Each child crossed its $0.50 share at k3 ($0.60) and paused.
    assert {(k.state, k.await_name) for k in kids} == {("awaiting", "$top_up")}
    assert job_row(sql_conn, parent.id)["await_name"] == "$children"

    for k in kids:
        client.top_up(k.id, usd=0.1)
    drain(client, reg)
    assert sorted(kid_calls) == sorted([k.id for k in kids] * 3)  # each step paid once
    # Fan-in charged $1.20 to the parent's $1.00: the parent paused there.
    row = job_row(sql_conn, parent.id)
    assert (row["state"], row["await_name"], row["spent_usd_micros"]) == (
        "awaiting", "$top_up", 1_200_000)
    client.top_up(parent.id, usd=0.2)
    assert drain(client, reg) == {"succeeded": 1}
    assert job_row(sql_conn, parent.id)["spent_usd_micros"] == 1_200_000


# -- headroom and warnings ---------------------------------------------------------------------


def test_ctx_budget_reads_the_headroom_in_any_step(client) -> None:
    reg = belay.Registry()
    seen: list[Headroom] = []

    @belay.worker(name="reader", registry=reg)
    def job(ctx: belay.Context) -> str:
        seen.append(ctx.budget)
        ctx.step("a", lambda: 1, cost=belay.Cost(usd=0.3, tokens=250))
        seen.append(ctx.budget)
        left = ctx.budget.usd_remaining
        return "cheap model" if left is not None and left < 0.5 else "big model"

    j = client.enqueue(job, budget={"usd": 0.75, "tokens": 1000})
    assert drain(client, reg) == {"succeeded": 1}
    assert client.get_job(j.id).result == "cheap model"  # type: ignore[union-attr]
    first, second = seen
    assert (first.usd_limit, first.usd_spent, first.usd_remaining, first.used) == (
        0.75, 0.0, 0.75, 0.0)
    assert (second.usd_remaining, second.tokens_remaining, second.tokens_spent) == (
        0.45, 750, 250)
    assert second.used == pytest.approx(0.4) and not second.exceeded
    unbounded = client.enqueue(job)
    assert drain(client, reg) == {"succeeded": 1}
    assert seen[-1].usd_limit is None and seen[-1].usd_remaining is None
    assert seen[-1].used is None
    assert client.get_job(unbounded.id).result == "big model"  # type: ignore[union-attr]


def test_each_threshold_warns_once_as_an_event_and_a_hook(client, sql_conn) -> None:
    reg, calls = belay.Registry(), []
    notices: list[BudgetNotice] = []
    job = spender(reg, calls, steps=5, cost=belay.Cost(usd=0.1, tokens=10))
    worker = belay.Worker(["default"], client=client, registry=reg)
    worker.on_budget(notices.append)
    j = client.enqueue(job, budget={"usd": 1.0, "warn_at": [0.25, 0.5]})
    assert worker.drain() == {"succeeded": 1}
    warnings = [e for e in events(sql_conn, j.id) if e["type"] == "budget_warning"]
    assert [(w["threshold"], w["step"], w["usd_spent"]) for w in warnings] == [
        (0.25, "call-3", 0.3), (0.5, "call-5", 0.5)]
    assert [(n.event, n.threshold, n.step) for n in notices] == [
        ("warning", 0.25, "call-3"), ("warning", 0.5, "call-5")]
    assert notices[0].job_id == j.id and notices[0].kind == "spender"
    # The marks that make them once-only are signals in the job's scope; the
    # journal holds the job's own steps only.
    marks = sql_conn.execute("SELECT name FROM belay_signals WHERE scope = %s ORDER BY name",
                             (f"job:{j.id}",)).fetchall()
    assert [m[0] for m in marks] == ["$budget:warn:0.25", "$budget:warn:0.5"]
    assert names(sql_conn, j.id) == [f"call-{n}" for n in range(1, 6)]

    # Another run that pays for call-5 again (as after a crash before its
    # journal write) passes both thresholds again: the marks keep it quiet.
    sql_conn.execute("DELETE FROM belay_steps WHERE job_id = %s AND name = 'call-5'", (j.id,))
    sql_conn.execute("UPDATE belay_jobs SET state = 'ready', attempt = 0, ready_at = %s, "
                     "spent_usd_micros = 400000, spent_tokens = 40 WHERE id = %s", (START, j.id))
    assert worker.drain() == {"succeeded": 1}
    assert calls == [1, 2, 3, 4, 5, 5]
    assert len([e for e in events(sql_conn, j.id) if e["type"] == "budget_warning"]) == 2
    assert len(notices) == 2


def test_a_warning_lost_to_a_crash_goes_out_before_the_next_step(client, sql_conn) -> None:
    """The default thresholds (50 % and 80 %); a crash between a step's journal
    write and its warning is caught up at the next step's pre-flight."""
    reg, calls = belay.Registry(), []
    job = spender(reg, calls, steps=3, cost=belay.Cost(tokens=30))
    j = client.enqueue(job, budget={"tokens": 100})
    # Attempt 1 "crashed" after journaling two steps (60 tokens): no warning sent.
    sql_conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at) "
        "VALUES (%s, 1, 'call-1', '1', 0, 30, now()), (%s, 2, 'call-2', '2', 0, 30, now())",
        (j.id, j.id))
    sql_conn.execute("UPDATE belay_jobs SET spent_tokens = 60 WHERE id = %s", (j.id,))
    assert drain(client, reg) == {"succeeded": 1}
    assert calls == [3]
    warnings = [(e["threshold"], e["step"], e["tokens_spent"])
                for e in events(sql_conn, j.id) if e["type"] == "budget_warning"]
    assert warnings == [(0.5, "call-3", 60), (0.8, "call-3", 90)]


def test_a_job_without_a_budget_never_warns_or_pays_a_round_trip_for_it(client,
                                                                         sql_conn) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(spender(reg, calls, steps=3))
    assert drain(client, reg) == {"succeeded": 1}
    assert events(sql_conn, j.id) == []
    assert names(sql_conn, j.id) == ["call-1", "call-2", "call-3"]


# -- the operator surfaces -----------------------------------------------------------------


def test_top_up_through_ops_is_guarded_and_says_whether_the_job_resumed(client) -> None:
    reg, calls = belay.Registry(), []
    j = client.enqueue(spender(reg, calls), budget=PAUSE)
    drain(client, reg)
    with pytest.raises(ops.Refused, match="mutations are disabled"):
        ops.mutate(client, ops.Guard(), "top_up", {"job_id": j.id, "usd": 1})
    asked: list[tuple[str, dict[str, Any]]] = []

    def authorize(tool: str, args: dict[str, Any]) -> object:
        asked.append((tool, args))
        return "over the team's limit" if args["usd"] > 5 else None

    guard = ops.Guard(authorizer=authorize)
    with pytest.raises(ops.Refused, match="over the team's limit"):
        ops.mutate(client, guard, "top_up", {"job_id": j.id, "usd": 50})
    done = ops.mutate(client, guard, "top_up", {"job_id": j.id, "usd": 1})
    assert done["resumed"] is True and done["job"]["budget_usd"] == 1.5
    assert asked[-1] == ("top_up", {"job_id": j.id, "usd": 1, "tokens": None})
    again = ops.mutate(client, guard, "top_up", {"job_id": j.id, "usd": 1})
    assert again["resumed"] is False  # it was ready, not paused
    with pytest.raises(belay.ValidationError, match="top_up takes job_id, usd, tokens"):
        ops.mutate(client, guard, "top_up", {"job_id": j.id, "dollars": 1})


def test_the_cli_tops_up(client, db_url, capsys) -> None:
    from belay.cli import main

    reg, calls = belay.Registry(), []
    j = client.enqueue(spender(reg, calls), budget=PAUSE)
    drain(client, reg)
    assert main(["top-up", str(j.id), "--usd", "0.05", "--url", db_url]) == 0
    assert "still paused: a cap is still short" in capsys.readouterr().out
    assert main(["top-up", str(j.id), "--usd", "1", "--url", db_url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resumed"] is True and out["job"]["state"] == "ready"
    assert main(["top-up", str(j.id), "--url", db_url]) != 0
    assert "give usd=<dollars> and/or tokens" in capsys.readouterr().err


def test_the_http_api_tops_up(client) -> None:
    from starlette.testclient import TestClient

    from belay.http.app import build_app

    reg, calls = belay.Registry(), []
    j = client.enqueue(spender(reg, calls), budget=PAUSE)
    drain(client, reg)
    with TestClient(build_app(client)) as http:
        bad = http.post(f"/jobs/{j.id}/top_up", json={"usd": "lots"})
        assert bad.status_code == 400 and "number of dollars" in bad.json()["error"]["message"]
        unknown = http.post(f"/jobs/{j.id}/top_up", json={"usd": 1, "why": "x"})
        assert unknown.status_code == 400
        assert http.post(f"/jobs/{j.id + 99}/top_up", json={"usd": 1}).status_code == 404
        ok = http.post(f"/jobs/{j.id}/top_up", json={"usd": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["resumed"] is True and ok.json()["job"]["budget_usd"] == 1.5
        assert "/jobs/{job_id}/top_up" in http.get("/openapi.json").json()["paths"]


# -- kill -9 at the crossing point ---------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_kill_9_at_the_crossing_point_keeps_the_pause_and_pays_nothing_twice(
        db_url, sql_conn, tmp_path: Path, procs) -> None:
    """Worker A journals the crossing step and is killed before its park is
    written (its on_budget hook holds it there). Worker B reclaims the job,
    replays the paid steps and pauses at the next step's pre-flight; a top-up
    resumes it and it finishes. Every step's work ran exactly once."""
    conn = sql_conn
    conn.execute("CREATE TABLE step_effects (job_id bigint, name text, attempt int, pid int)")
    conn.execute("CREATE TABLE held (job_id bigint, pid int)")

    def start(node: str) -> Proc:
        proc = Proc([sys.executable, "-W", "error", "-m", "tests.budget_worker", db_url, node],
                    tmp_path / f"{node}.log")
        procs.append(proc)
        return proc

    with belay.Belay(db_url) as producer:
        job = producer.enqueue("budget.loop", {"steps": 5, "usd": 0.2}, queue="q",
                               budget=PAUSE)
        a = start("node-a")
        wait_until(lambda: conn.execute("SELECT count(*) FROM held").fetchone()[0] == 1,
                   "A holds the job at the crossing", timeout=20)
        a.send(signal.SIGKILL)
        assert a.wait(10) == -signal.SIGKILL
        row = job_row(conn, job.id)
        assert (row["state"], row["spent_usd_micros"]) == ("running", 600_000)
        b = start("node-b")
        wait_until(lambda: job_row(conn, job.id)["state"] == "awaiting",
                   "B reclaims the job and pauses it", timeout=20)
        row = job_row(conn, job.id)
        assert (row["await_name"], row["spent_usd_micros"]) == ("$top_up", 600_000)
        producer.top_up(job.id, usd=0.5)
        wait_until(lambda: job_row(conn, job.id)["state"] == "succeeded",
                   "B finishes the topped-up job", timeout=20)
        b.send(signal.SIGTERM)
    effects = conn.execute("SELECT name, count(*) FROM step_effects WHERE job_id = %s "
                           "GROUP BY name ORDER BY name", (job.id,)).fetchall()
    assert effects == [(f"s{n}", 1) for n in range(1, 6)]
    assert spend(conn, job.id) == (1_000_000, 0)
    row = job_row(conn, job.id)
    assert [e["error"] for e in row["errors"]] == ["lease_expired"]
