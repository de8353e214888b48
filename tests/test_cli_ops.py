"""The operating commands of the ``belay`` command line (``stats``, ``jobs``, ``job``,
``events``, ``retry``, ``cancel``, ``signal``, ``steer``, ``queues``, ``crons``,
``prune``), run as real subprocesses against a real database, and the exit codes
a script relies on: 0 ok, 1 database unusable, 2 bad usage, 3 not found, 4 not
possible in the job's state.

Jobs get their steps, events, children and workflows from a real worker
(:func:`belay.testing.drain` on a registry of this module's own).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import belay
from belay.testing import drain
from tests.helpers import Conn, job_row, running_job, signal_rows
from tests.test_cli import run_cli

REG = belay.Registry()


@belay.worker(name="ops.summarize", registry=REG)
def summarize(ctx: belay.Context) -> Any:
    hits = ctx.step("search", lambda: {"hits": 12}, cost=belay.Cost(usd=0.25, tokens=1000))
    ctx.emit({"stage": "searched", "hits": hits["hits"]})
    text = ctx.step("draft", lambda: "up 4%", cost=belay.Cost(usd=0.5, tokens=2500))
    ctx.emit({"stage": "drafted"})
    approved = ctx.await_signal("approve")
    ctx.emit({"stage": "approved", "by": approved.get("by")})
    return {"summary": text}


@belay.worker(name="ops.fetch", registry=REG, max_attempts=1)
def fetch(ctx: belay.Context) -> Any:
    raise ConnectionError("upstream returned 503")


@belay.worker(name="ops.page", queue="pages", registry=REG)
def page(ctx: belay.Context) -> Any:
    return ctx.step("render", lambda: {"page": ctx.input["n"]},
                    cost=belay.Cost(usd=0.01, tokens=120))


@belay.worker(name="ops.book", registry=REG)
def book(ctx: belay.Context) -> Any:
    kids = ctx.map_children("pages", "ops.page", [{"n": n} for n in range(1, 4)])
    return [kid.result for kid in kids]


@belay.worker(name="ops.etl", queue="etl", registry=REG)
def etl(ctx: belay.Context) -> Any:
    return {"rows": 100}


@pytest.fixture
def live(db_url: str) -> Iterator[belay.Belay]:
    """A client on the system clock, as the CLI's is ("the last minute" is real time)."""
    with belay.Belay(db_url, registry=REG) as instance:
        yield instance


@pytest.fixture
def world(live: belay.Belay) -> dict[str, int]:
    """An awaiting job with a costed journal and events, a failed one, a parent with
    three children, and a workflow with one member done, one ready, one held."""
    summary = live.enqueue("ops.summarize", {"quarter": "Q3"})
    failed = live.enqueue("ops.fetch", {"source": "s3://q3.csv"})
    parent = live.enqueue("ops.book", {"title": "Q3"})
    members = live.enqueue_workflow(
        belay.Workflow("nightly", workflow_id="nightly-1")
        .add("extract", "ops.etl", {}, queue="etl")
        .add("transform", "ops.etl", {}, queue="etl", deps=["extract"])
        .add("load", "ops.etl", {}, queue="etl", deps=["transform"]))
    assert drain("default", client=live, registry=REG) == {"await": 2, "failed": 1}
    assert drain("pages", client=live, registry=REG) == {"succeeded": 3}
    assert drain("default", client=live, registry=REG) == {"succeeded": 1}
    assert drain("etl", client=live, registry=REG, max_jobs=1) == {"succeeded": 1}
    return {"summary": summary.id, "failed": failed.id, "parent": parent.id,
            "extract": members["extract"].id, "transform": members["transform"].id,
            "load": members["load"].id}


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json").stdout)


def fails(code: int, *args: str) -> str:
    """Run a command that must exit ``code``; returns its stderr (nothing on stdout)."""
    result = run_cli(*args)
    assert result.returncode == code, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith("belay: ")
    return result.stderr


# -- stats, jobs, job ---------------------------------------------------------------------


def test_stats_counts_unfinished_spend_and_last_minute(db_url: str,
                                                       world: dict[str, int]) -> None:
    tiles = {t["queue"]: t for t in ok_json("stats", "--url", db_url)}
    assert sorted(tiles) == ["default", "etl", "pages"]
    default, pages, etl_tile = tiles["default"], tiles["pages"], tiles["etl"]
    assert {k: v for k, v in default["counts"].items() if v} == {
        "awaiting": 1, "failed": 1, "succeeded": 1}
    assert default["total"] == 3
    assert (default["capped"], default["count_cap"]) == ([], belay.STATS_CAP)
    # The awaiting summary's journal: spend of unfinished jobs only.
    assert (default["spent_usd"], default["spent_tokens"]) == (0.75, 3500)
    assert default["last_minute"] == {"succeeded": 1, "failed": 1, "cancelled": 0}
    assert pages["last_minute"]["succeeded"] == 3
    # Every pages job finished: what they spent is in their rows, not the tile.
    assert (pages["spent_usd"], pages["spent_tokens"]) == (0, 0)
    assert {k: v for k, v in etl_tile["counts"].items() if v} == {
        "succeeded": 1, "ready": 1, "held": 1}

    lines = ok("stats", "--url", db_url).stdout.splitlines()
    assert lines[0].split()[:4] == ["QUEUE", "READY", "RUNNING", "AWAITING"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "$0.75 / 3,500 tok" in rows["default"]
    assert "1 succeeded, 1 failed" in rows["default"]
    assert "$0.03" not in rows["pages"]


def test_jobs_lists_newest_first_with_filters(
    db_url: str, live: belay.Belay, world: dict[str, int]
) -> None:
    everything = ok_json("jobs", "--url", db_url)
    ids = [j["id"] for j in everything]
    assert ids == sorted(ids, reverse=True) and len(ids) == 9
    assert set(everything[0]) >= {"id", "kind", "queue", "state", "attempt", "max_attempts",
                                  "spent_usd", "spent_tokens", "inserted_at"}

    kids = ok_json("jobs", "--url", db_url, "--parent", str(world["parent"]),
                   "--state", "succeeded", "--queue", "pages", "--kind", "ops.page")
    assert [j["id"] for j in kids] == [
        j.id for j in live.list_jobs(parent_id=world["parent"])]
    assert len(kids) == 3
    flow = ok_json("jobs", "--url", db_url, "--workflow", "nightly-1")
    assert [j["wf_name"] for j in flow] == ["load", "transform", "extract"]

    page_two = ok("jobs", "--url", db_url, "--before", str(world["load"]), "--limit", "2")
    lines = page_two.stdout.splitlines()
    assert lines[0].split() == ["ID", "KIND", "QUEUE", "STATE", "ATTEMPT", "SPENT", "INSERTED"]
    assert [int(line.split()[0]) for line in lines[1:3]] == [world["transform"],
                                                             world["extract"]]
    assert lines[3] == f"(more may follow: add --before {world['extract']})"


def test_job_shows_journal_events_errors_children_and_workflow(
    db_url: str, world: dict[str, int]
) -> None:
    detail = ok_json("job", str(world["summary"]), "--url", db_url)
    assert detail["job"]["state"] == "awaiting"
    assert [(s["name"], s["usd"], s["tokens"]) for s in detail["steps"]] == [
        ("search", 0.25, 1000), ("draft", 0.5, 2500)]
    assert detail["journal_cost"] == {"usd": 0.75, "tokens": 3500}
    assert [e["payload"] for e in detail["events"]] == [
        {"stage": "searched", "hits": 12}, {"stage": "drafted"}]
    assert detail["children"] == [] and detail["workflow"] is None

    text = ok("job", str(world["summary"]), "--url", db_url).stdout
    assert text.startswith(f"job {world['summary']}  ops.summarize  awaiting\n")
    assert "steps (2)  total $0.75 / 3,500 tok" in text
    assert "awaiting   'approve' on job:" in text
    assert '{"hits": 12, "stage": "searched"}' in text

    failed = ok("job", str(world["failed"]), "--url", db_url).stdout
    assert "errors (1)\n  attempt 1: ConnectionError: upstream returned 503" in failed

    parent = ok("job", str(world["parent"]), "--url", db_url).stdout
    assert "children (3)" in parent
    assert parent.count("ops.page  pages  succeeded") == 3

    member = ok_json("job", str(world["transform"]), "--url", db_url)["workflow"]
    assert member["workflow_id"] == "nightly-1"
    assert [(m["name"], m["state"]) for m in member["jobs"]] == [
        ("extract", "succeeded"), ("transform", "ready"), ("load", "held")]


# -- retry, cancel, signal, steer ----------------------------------------------------------


def test_retry_a_failed_job_then_a_ready_one_is_not_possible(
    db_url: str, world: dict[str, int]
) -> None:
    retried = ok_json("retry", str(world["failed"]), "--url", db_url)
    assert retried["job_id"] == world["failed"]
    assert retried["job"]["state"] == "ready"
    assert retried["job"]["max_attempts"] == 2  # it had used its one attempt

    message = fails(4, "retry", str(world["failed"]), "--url", db_url)
    assert f"job {world['failed']} is ready; only failed or cancelled jobs" in message


def test_cancel_prints_cancelled_requested_or_noop(
    db_url: str, live: belay.Belay, sql_conn: Conn
) -> None:
    waiting = live.enqueue("ops.etl", {}, queue="idle")
    running = running_job(sql_conn, kind="ops.etl")
    done = live.enqueue("ops.etl", {}, queue="etl")
    drain("etl", client=live, registry=REG)

    assert ok("cancel", str(waiting.id), "--url", db_url).stdout.startswith("cancelled:")
    assert ok_json("cancel", str(running), "--url", db_url) == {
        "job_id": running, "status": "requested"}
    assert ok("cancel", str(done.id), "--url", db_url).stdout.startswith("noop:")
    assert job_row(sql_conn, waiting.id)["state"] == "cancelled"
    assert job_row(sql_conn, running)["cancel_requested"] is True


def test_signal_wakes_the_awaiting_job_and_steer_leaves_guidance(
    db_url: str, live: belay.Belay, sql_conn: Conn, world: dict[str, int]
) -> None:
    job_id = world["summary"]
    sent = ok_json("signal", str(job_id), "approve", '{"by": "ana"}', "--url", db_url)
    assert sent == {"job_id": job_id, "signal": "approve", "woken": [job_id]}
    assert drain("default", client=live, registry=REG) == {"succeeded": 1}
    assert live.events(job_id)[-1].payload == {"stage": "approved", "by": "ana"}

    steered = ok("steer", str(world["transform"]), '{"instruction": "be brief"}',
                 "--url", db_url)
    assert "no job was waiting on it" in steered.stdout
    no_payload = ok("signal", str(world["load"]), "go", "--url", db_url)
    assert f"signal 'go' delivered to job {world['load']}" in no_payload.stdout
    rows = {(r["scope"], r["name"]): r["payload"] for r in signal_rows(sql_conn)}
    assert rows[(f"job:{world['transform']}", "$steer")] == {"instruction": "be brief"}
    assert rows[(f"job:{world['load']}", "go")] == {}


def test_bad_json_and_bad_arguments_exit_2_naming_the_fix(
    db_url: str, live: belay.Belay
) -> None:
    job_id = str(live.enqueue("ops.etl", {}).id)
    assert "not valid JSON" in fails(2, "signal", job_id, "go", "{'by': 1}", "--url", db_url)
    assert "is a JSON object like" in fails(2, "signal", job_id, "go", "[1]", "--url", db_url)
    assert "in single quotes" in fails(2, "steer", job_id, "be brief", "--url", db_url)
    assert "reserved" in fails(2, "signal", job_id, "$steer", "--url", db_url)
    assert "--rate is not valid JSON" in fails(
        2, "queues", "put", "q", "--rate", "{allowed: 1}", "--url", db_url)
    assert "limit must be an integer" in fails(2, "jobs", "--limit", "0", "--url", db_url)
    assert "--failed is seconds > 0" in fails(2, "prune", "--failed", "0", "--url", db_url)
    unknown = run_cli("jobs", "--state", "bogus", "--url", db_url)
    assert unknown.returncode == 2 and "invalid choice: 'bogus'" in unknown.stderr


def test_not_found_exits_3(db_url: str) -> None:
    for args in (["job", "999"], ["retry", "999"], ["cancel", "999"], ["events", "999"],
                 ["signal", "999", "go"], ["steer", "999", "{}"]):
        assert "job 999 does not exist" in fails(3, *args, "--url", db_url)
    for args in (["queues", "resume", "nosuch"], ["queues", "delete", "nosuch"],
                 ["crons", "delete", "nosuch"], ["crons", "pause", "nosuch"]):
        assert "'nosuch'" in fails(3, *args, "--url", db_url)


def test_replay_of_a_missing_job_exits_3(db_url: str) -> None:
    assert "job 999 does not exist" in fails(3, "replay", "999", "--url", db_url)


def test_an_unusable_database_exits_1(empty_db_url: str) -> None:
    assert "cannot connect" in fails(
        1, "stats", "--url", "postgresql://postgres@127.0.0.1:1/postgres")
    assert "belay migrate" in fails(1, "jobs", "--url", empty_db_url)


# -- events --------------------------------------------------------------------------------


def test_events_print_text_or_json_lines_after_a_seq(db_url: str, world: dict[str, int]) -> None:
    job_id = str(world["summary"])
    text = ok("events", job_id, "--url", db_url).stdout.splitlines()
    assert [line.split()[0] for line in text] == ["1", "2"]
    assert text[1].endswith('{"stage": "drafted"}')
    lines = ok("events", job_id, "--after", "1", "--json", "--url", db_url).stdout.splitlines()
    assert [json.loads(line)["payload"] for line in lines] == [{"stage": "drafted"}]
    assert "--timeout only applies with --follow" in fails(
        2, "events", job_id, "--timeout", "1", "--url", db_url)


def test_events_follow_prints_events_as_they_come_and_exits_when_the_job_ends(
    db_url: str, live: belay.Belay, world: dict[str, int]
) -> None:
    job_id = world["summary"]
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", "-m", "belay", "events", str(job_id), "--follow",
         "--json", "--timeout", "60", "--url", db_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, name="follow-reader", daemon=True)
    reader.start()
    try:
        seen = [json.loads(lines.get(timeout=20))["seq"] for _ in range(2)]
        assert seen == [1, 2]
        assert proc.poll() is None  # still following: the job is awaiting

        live.signal_job(job_id, "approve", {"by": "ana"})
        assert drain("default", client=live, registry=REG) == {"succeeded": 1}
        # The run after the wake emits again (events are not journaled), then approves.
        after = [json.loads(lines.get(timeout=20)) for _ in range(3)]
        assert [e["seq"] for e in after] == [3, 4, 5]
        assert after[-1]["payload"] == {"stage": "approved", "by": "ana"}
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()
    assert stderr == ""
    assert lines.empty()


def test_events_follow_stops_at_the_timeout_and_says_so(
    db_url: str, world: dict[str, int]
) -> None:
    result = run_cli("events", str(world["summary"]), "--follow", "--after", "2",
                     "--timeout", "0.3", "--url", db_url)
    assert result.returncode == 0
    assert result.stdout == ""
    assert "stopped following after 0.3 s" in result.stderr
    assert "still awaiting" in result.stderr


# -- queues, crons, prune ------------------------------------------------------------------


def test_queues_put_list_pause_resume_delete(db_url: str, live: belay.Belay) -> None:
    put = ok_json("queues", "put", "ai", "--limit", "4", "--global-limit", "8",
                  "--rate", '{"allowed": 100, "period": 60}', "--partition",
                  '{"input": "tenant"}', "--url", db_url)
    assert put == {"queue": "ai", "options": {
        "limit": 4, "global_limit": 8, "rate": {"allowed": 100, "period": 60, "estimate": 1},
        "partition": ["input", "tenant"]}}
    ok("queues", "put", "bulk", "--limit", '{"min": 2, "max": 20}', "--url", db_url)
    ok("queues", "--url", db_url, "pause", "ai")
    assert live.list_queues()["ai"]["paused"] is True

    rows = ok_json("queues", "list", "--url", db_url)
    assert rows == [
        {"queue": "ai", "options": put["options"], "paused": True},
        {"queue": "bulk", "options": {"limit": {"min": 2, "max": 20}}, "paused": False},
    ]
    table = ok("queues", "--url", db_url).stdout.splitlines()
    assert table[0].split() == ["QUEUE", "PAUSED", "LIMIT", "GLOBAL", "RATE", "PARTITION"]
    assert table[1].split()[:4] == ["ai", "yes", "4", "8"]

    assert ok_json("queues", "resume", "ai", "--url", db_url) == {"queue": "ai",
                                                                 "paused": False}
    ok("queues", "delete", "bulk", "--url", db_url)
    assert list(live.list_queues()) == ["ai"]
    assert "paused" not in live.list_queues()["ai"]


def test_crons_put_list_pause_resume_delete(db_url: str, live: belay.Belay) -> None:
    put = ok_json("crons", "put", "nightly", "0 2 * * *", "ops.summarize", "--input",
                  '{"quarter": "Q4"}', "--queue", "etl", "--priority", "1", "--meta",
                  '{"team": "finance"}', "--url", db_url)
    assert {k: v for k, v in put.items() if k != "updated_at"} == {
        "name": "nightly", "expression": "0 2 * * *", "worker": "ops.summarize",
        "input": {"quarter": "Q4"}, "options": {"queue": "etl", "priority": 1,
                                                "meta": {"team": "finance"}},
        "paused": False}
    assert "put cron 'hourly': @hourly -> ops.etl" in ok(
        "crons", "put", "hourly", "@hourly", "ops.etl", "--url", db_url).stdout
    assert "invalid cron expression" in fails(2, "crons", "put", "x", "61 * * * *", "ops.etl",
                                              "--url", db_url)
    ok("crons", "pause", "hourly", "--url", db_url)
    listed = ok_json("crons", "--url", db_url)
    assert [(c["name"], c["paused"]) for c in listed] == [("hourly", True), ("nightly", False)]
    table = ok("crons", "list", "--url", db_url).stdout.splitlines()
    assert table[1].split()[:4] == ["hourly", "@hourly", "ops.etl", "yes"]

    ok("crons", "resume", "hourly", "--url", db_url)
    ok("crons", "delete", "nightly", "--url", db_url)
    assert [(c.name, c.paused) for c in live.list_crons()] == [("hourly", False)]


def test_prune_deletes_what_is_past_retention(
    db_url: str, live: belay.Belay, sql_conn: Conn
) -> None:
    old, recent, failed = (live.enqueue("ops.etl", {}, queue="etl") for _ in range(3))
    drain("etl", client=live, registry=REG)
    sql_conn.execute("UPDATE belay_jobs SET state = 'failed' WHERE id = %s", (failed.id,))
    sql_conn.execute("UPDATE belay_jobs SET finished_at = now() - interval '2 days' "
                     "WHERE id IN (%s, %s)", (old.id, failed.id))
    live.signal("job:12345", "stale", {})
    sql_conn.execute("UPDATE belay_signals SET inserted_at = now() - interval '3 days'")

    kept = ok_json("prune", "--succeeded", "forever", "--url", db_url)
    assert kept["deleted"] == {"failed": 0, "cancelled": 0, "signals": 0, "rate_windows": 0}
    assert kept["retention"]["succeeded"] is None

    pruned = ok("prune", "--failed", "86400", "--signal-ttl", "172800", "--url", db_url)
    assert pruned.stdout.splitlines() == [
        "pruned 2 job(s) with their steps and events",
        "  succeeded    1", "  failed       1", "  cancelled    0",
        "  signals      1", "  rate_windows 0",
    ]
    assert [j.id for j in live.list_jobs()] == [recent.id]
    assert signal_rows(sql_conn) == []


def test_crons_schedule_status_list_and_cancel(db_url: str, live: belay.Belay) -> None:
    declared = ok_json("crons", "schedule", "nightly", "0 3 * * *", "ops.summarize",
                       "--overlap", "queue", "--catch-up", "all", "--input",
                       '{"quarter": "Q4"}', "--queue", "etl", "--url", db_url)
    assert {k: declared[k] for k in ("name", "overlap", "catch_up", "revision", "input",
                                     "options", "last_due", "active_job_id")} == {
        "name": "nightly", "overlap": "queue", "catch_up": "all", "revision": 1,
        "input": {"quarter": "Q4"}, "options": {"queue": "etl"}, "last_due": None,
        "active_job_id": None}
    text = ok("crons", "status", "nightly", "--url", db_url).stdout
    assert "schedule 'nightly' (live, revision 1)" in text and "overlap=queue" in text
    assert [s["name"] for s in ok_json("crons", "schedules", "--url", db_url)] == ["nightly"]
    listed = ok("crons", "--url", db_url).stdout
    assert "SCHEDULE" in listed and "nightly" in listed
    assert ok_json("crons", "--url", db_url) == []  # --json list: the belay_crons rows
    assert "invalid choice: 'sometimes'" in run_cli(
        "crons", "schedule", "x", "@daily", "ops.etl", "--overlap", "sometimes",
        "--url", db_url).stderr
    ok("crons", "put", "digest", "@daily", "ops.etl", "--url", db_url)
    assert "is the name of a cron" in fails(2, "crons", "schedule", "digest", "@daily",
                                            "ops.etl", "--url", db_url)
    cancelled = ok_json("crons", "cancel", "nightly", "--url", db_url)
    assert cancelled["cancelled_at"] is not None and cancelled["next_due"] is None
    assert "no live schedule named 'nightly'" in fails(3, "crons", "cancel", "nightly",
                                                       "--url", db_url)
    assert "no schedule named 'nope'" in fails(3, "crons", "status", "nope", "--url", db_url)
    assert live.schedule_status("nightly").cancelled_at is not None  # type: ignore[union-attr]
