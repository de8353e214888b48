"""``belay doctor``: the pure decisions (thresholds → severity) on their own, then
every check against a real PostgreSQL (a held transaction, stuck leases, an
unserved queue, retention, a real PgBouncer in front), the command line as a
subprocess (exit codes, ``--json``) and the dashboard's page and endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import belay
from belay import doctor
from belay.connect import DIRECT_URL_ENV, POOLER_ENV
from belay.dashboard import make_app
from belay.doctor import Finding, PoolerProbe, Thresholds
from belay.pgbouncer import PgBouncer
from belay.schema import SchemaStatus
from tests.helpers import START, insert_job, running_job
from tests.test_dashboard import call

T = Thresholds()


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


# -- Pure: severities, exit codes, text ------------------------------------------------------


def f(severity: str) -> Finding:
    return Finding("x", severity, "s")


def test_exit_code_follows_the_gravest_severity():
    assert doctor.exit_code([]) == 0
    assert doctor.exit_code([f("ok"), f("info")]) == 0
    assert doctor.exit_code([f("ok"), f("warning"), f("info")]) == 1
    assert doctor.exit_code([f("warning"), f("error"), f("ok")]) == 2
    assert doctor.worst([f("info"), f("ok")]) == "info"


def test_a_finding_refuses_an_unknown_severity():
    with pytest.raises(ValueError, match="severity is one of ok, info, warning, error"):
        Finding("x", "critical", "s")


def test_span_reads_like_a_person_would_say_it():
    assert [doctor.span(s) for s in (-3, 45, 600, 9000, 86_400, 3 * 86_400, None)] == [
        "0 s", "45 s", "10 min", "2.5 h", "1 d", "3 d", "forever"]


def test_text_has_one_line_per_check_and_its_fix():
    text = doctor.format_text([Finding("leases", "warning", "2 stuck", "start a worker"),
                               Finding("schema", "ok", "fine")])
    lines = text.splitlines()
    assert lines[0].startswith("WARN") and "leases" in lines[0] and "2 stuck" in lines[0]
    assert lines[1].strip() == "fix: start a worker"
    assert lines[2].startswith("OK") and "schema" in lines[2]
    assert lines[-1] == "doctor: 1 warning (exit 1)"


def test_schema_severities():
    assert doctor.schema_finding(SchemaStatus(3, 1), 3).severity == "ok"
    behind = doctor.schema_finding(SchemaStatus(3, 1), 4)
    assert behind.severity == "warning" and "belay migrate" in behind.fix
    # Revision 4 builds an index over every job: the fix says how to avoid the lock.
    assert "CREATE INDEX CONCURRENTLY belay_jobs_state_queue_id_idx" in behind.fix
    assert "WHERE id > 0" in behind.fix
    assert "CONCURRENTLY" not in doctor.schema_finding(SchemaStatus(4, 1), 5).fix
    spend = doctor.schema_finding(SchemaStatus(5, 1), 6).fix
    assert "revision 6" in spend and "CONCURRENTLY belay_jobs_spend_idx" in spend
    assert "state_queue" not in spend
    assert doctor.schema_finding(SchemaStatus(5, 1), 3).severity == "info"
    missing = doctor.schema_finding(SchemaStatus(0, None), 3)
    assert missing.severity == "error" and "no belay schema" in missing.summary
    assert "belay migrate" in missing.fix
    assert doctor.schema_finding(SchemaStatus(3, 2), 3).severity == "error"
    assert doctor.schema_finding(SchemaStatus(2, 1), 3).severity == "error"


def probe(a: tuple[int, ...], b: tuple[int, ...], server: int = 5432,
          url: int = 5432) -> PoolerProbe:
    return PoolerProbe(a, b, server, url)


def test_pooler_severities():
    shared = probe((11, 11), (11, 12), server=5432, url=6432)
    unset = doctor.pooler_finding(shared, None)
    assert unset.severity == "error" and unset.details["detected"]
    for words in ('pooler="transaction"', "--pooler transaction", "BELAY_POOLER"):
        assert words in unset.fix
    assert "proxies port 6432" in unset.summary
    assert doctor.pooler_finding(shared, "transaction").severity == "ok"
    # Whether the pooler kept two clients' prepared statements apart.
    tracking = PoolerProbe((11, 11), (11, 11), 5432, 6432, prepared=True)
    sharing = PoolerProbe((11, 11), (11, 11), 5432, 6432, prepared=False,
                          prepared_error='prepared statement "x" already exists')
    assert doctor.pooler_finding(tracking, "transaction").severity == "info"
    assert doctor.pooler_finding(tracking, "transaction-prepared").severity == "ok"
    assert doctor.pooler_finding(sharing, "transaction").severity == "ok"
    wrong = doctor.pooler_finding(sharing, "transaction-prepared")
    assert wrong.severity == "error" and "already exists" in wrong.summary
    assert 'set pooler="transaction"' in wrong.fix
    assert "transaction-prepared" in doctor.pooler_finding(tracking, None).fix
    # Without a pooler, what the probe saw about prepared statements says nothing.
    assert doctor.pooler_finding(PoolerProbe((1,), (2,), 5432, 5432, prepared=True),
                                 "transaction-prepared").severity == "info"
    # One connection hopping between backends is a pooler too.
    assert probe((1, 2), (3, 3)).evidence is not None
    direct = probe((1, 1), (2, 2))
    assert direct.evidence is None
    assert doctor.pooler_finding(direct, None).severity == "ok"
    assert doctor.pooler_finding(direct, "transaction").severity == "info"
    proxied = doctor.pooler_finding(probe((1, 1), (2, 2), url=5433), None)
    assert proxied.severity == "info" and "proxies" in proxied.summary


def test_notify_severities():
    polling = doctor.notify_finding(None, "transaction", None, 0.0)
    assert polling.severity == "info" and "waits poll" in polling.summary
    assert "direct_url" in polling.fix and "BELAY_DIRECT_URL" in polling.fix
    assert doctor.notify_finding("url", None, True, 0.01).severity == "ok"
    lost = doctor.notify_finding("url", None, False, 2.0)
    assert lost.severity == "warning" and "did not arrive" in lost.summary
    elsewhere = doctor.notify_finding("direct_url", "transaction", False, 2.0, ("a", "b"))
    assert elsewhere.severity == "warning" and "'b'" in elsewhere.summary


def holder(age: float | None, kind: str = "backend", **more: Any) -> dict[str, Any]:
    return {"kind": kind, "pid": 4242, "application_name": "app", "role": "postgres",
            "state": "idle in transaction", "backend_type": "client backend",
            "age_s": age, "xid_age": 3, "name": None, **more}


def test_horizon_severities_by_age():
    assert doctor.horizon_finding([], T).severity == "ok"
    young = doctor.horizon_finding([holder(10.0)], T)
    assert young.severity == "ok" and "pid 4242" in young.summary
    assert young.details["pid"] == 4242
    warn = doctor.horizon_finding([holder(doctor.HORIZON_WARN + 1)], T)
    assert warn.severity == "warning" and "pg_terminate_backend(4242)" in warn.fix
    assert doctor.horizon_finding([holder(doctor.HORIZON_ERROR + 1)], T).severity == "error"
    prepared = doctor.horizon_finding([holder(7200.0, "prepared", pid=None, name="tx1")], T)
    assert prepared.severity == "error" and "ROLLBACK PREPARED 'tx1'" in prepared.fix
    # A forgotten slot is worse than a young transaction listed before it.
    slot = holder(None, "slot", name="standby", state="inactive")
    found = doctor.horizon_finding([holder(5.0), slot], T)
    assert found.severity == "warning" and "pg_drop_replication_slot('standby')" in found.fix
    assert doctor.horizon_finding([holder(None, "slot", name="s", state="active")],
                                  T).severity == "ok"


def table(name: str, live: int, dead: int) -> dict[str, Any]:
    return {"table_name": name, "live": live, "dead": dead, "bytes": 8192 * 100,
            "last_autovacuum": None, "last_vacuum": None}


def test_dead_rows_warn_only_when_many_and_most():
    assert doctor.tables_finding([], T).severity == "info"
    assert doctor.tables_finding([table("belay_jobs", 10, 90)], T).severity == "ok"
    assert doctor.tables_finding([table("belay_jobs", 900_000, 100_000)],
                                 T).severity == "ok"
    bloated = doctor.tables_finding([table("belay_jobs", 10_000, 30_000)], T)
    assert bloated.severity == "warning" and "75% of rows dead" in bloated.summary


def test_a_big_belay_jobs_with_the_default_vacuum_trigger_is_info():
    big = {**table("belay_jobs", 10_000_000, 5_000), "vacuum_at": 2_000_050, "scale": 0.2}
    found = doctor.tables_finding([big], T)
    assert found.severity == "info" and "2,000,050 dead rows" in found.summary
    assert "autovacuum_vacuum_scale_factor = 0.01" in found.fix
    tuned = {**big, "vacuum_at": 101_000, "scale": 0.01}
    assert doctor.tables_finding([tuned], T).severity == "ok"
    # Another table's trigger is not belay_jobs's (and rows without it are old reads).
    assert doctor.tables_finding([{**big, "table_name": "belay_steps"}], T).severity == "ok"
    assert doctor.tables_finding([table("belay_jobs", 10_000_000, 5_000)], T).severity == "ok"


def test_the_vacuum_trigger_is_read_off_the_server(db_url, sql_conn):
    """The table's own storage parameters count before the server's settings."""
    sql_conn.execute("ALTER TABLE belay_jobs SET (autovacuum_vacuum_scale_factor = 0.5, "
                     "autovacuum_vacuum_threshold = 300000)")
    with belay.Belay(db_url) as client:
        tables = by_check(doctor.run(client))["tables"]
    jobs = next(r for r in tables.details["tables"] if r["table_name"] == "belay_jobs")
    assert jobs["scale"] == 0.5 and jobs["vacuum_at"] >= 300_000
    assert tables.severity == "info" and "at 300,000 dead rows" in tables.summary
    sql_conn.execute("ALTER TABLE belay_jobs RESET (autovacuum_vacuum_scale_factor, "
                     "autovacuum_vacuum_threshold)")
    with belay.Belay(db_url) as client:
        jobs = next(r for r in by_check(doctor.run(client))["tables"].details["tables"]
                    if r["table_name"] == "belay_jobs")
    default = float(sql_conn.execute("SHOW autovacuum_vacuum_scale_factor").fetchone()[0])
    assert jobs["scale"] == default


def test_lease_severities():
    now = START
    assert doctor.leases_finding({"stuck": 0}, now, T).severity == "ok"
    row = {"stuck": 2, "id": 7, "queue": "q", "leased_by": "node-a"}
    late = doctor.leases_finding({**row, "lease_until": now - timedelta(minutes=3)}, now, T)
    assert late.severity == "warning" and "job 7" in late.summary
    assert doctor.leases_finding({**row, "lease_until": now - timedelta(hours=1)}, now,
                                 T).severity == "error"
    assert doctor.leases_finding({**row, "lease_until": None}, now, T).severity == "error"


def waiting(queue: str, due_for: float, seen_ago: float | None = None) -> dict[str, Any]:
    seen = None if seen_ago is None else START - timedelta(seconds=seen_ago)
    return {"queue": queue, "due": 3, "oldest_due": START - timedelta(seconds=due_for),
            "last_lease": None, "last_start": seen, "last_finish": None}


def test_queue_severities():
    assert doctor.queues_finding([], [], START, T).severity == "ok"
    assert doctor.queues_finding([waiting("q", 30)], [], START, T).severity == "ok"
    assert doctor.queues_finding([waiting("q", 7200, seen_ago=10)], [],
                                 START, T).severity == "ok"
    unserved = doctor.queues_finding([waiting("q", 600, seen_ago=3600)], [], START, T)
    assert unserved.severity == "warning" and "--queue q" in unserved.fix
    assert doctor.queues_finding([waiting("q", 7200)], [], START, T).severity == "error"
    held = doctor.queues_finding([waiting("q", 7200)], ["q"], START, T)
    assert held.severity == "info" and "paused" in held.summary


def test_retention_severities():
    keep = {"succeeded": 86_400.0, "failed": None}
    rows = [{"state": "succeeded", "oldest": START - timedelta(days=3), "overdue": 5},
            {"state": "failed", "oldest": START - timedelta(days=300), "overdue": 0}]
    late = doctor.retention_finding(rows, keep, START, T)
    assert late.severity == "warning" and "5 succeeded job(s)" in late.summary
    assert doctor.retention_finding(rows, {"succeeded": 7 * 86_400.0}, START,
                                    T).severity == "ok"


# -- Against the database ---------------------------------------------------------------------


def test_a_healthy_database_is_all_ok(client):
    findings = doctor.run(client)
    assert [f.check for f in findings] == list(doctor.CHECKS)
    assert {f.severity for f in findings} <= {"ok", "info"}, doctor.format_text(findings)
    assert doctor.exit_code(findings) == 0


def test_an_open_transaction_shows_with_its_pid(client, direct_url):
    with psycopg.connect(direct_url) as held:
        held.execute("SELECT txid_current()")  # BEGIN, and an xid of its own
        pid = held.info.backend_pid
        horizon = by_check(doctor.run(client))["horizon"]
        assert horizon.severity == "ok" and horizon.details["pid"] == pid
        assert f"pid {pid}" in horizon.summary and "idle in transaction" in horizon.summary
        strict = by_check(doctor.run(client, thresholds=Thresholds(horizon_warn=0.0)))
        assert strict["horizon"].severity == "warning"
        assert f"pg_terminate_backend({pid})" in strict["horizon"].fix
        stricter = Thresholds(horizon_warn=0.0, horizon_error=0.0)
        assert by_check(doctor.run(client, thresholds=stricter))["horizon"].severity == "error"
    assert by_check(doctor.run(client))["horizon"].details.get("pid") != pid


def test_a_stuck_lease_is_a_warning_then_an_error(client, sql_conn, clock):
    job_id = running_job(sql_conn, queue="mail", lease_until=START - timedelta(minutes=3))
    leases = by_check(doctor.run(client))["leases"]
    assert leases.severity == "warning" and f"job {job_id}" in leases.summary
    assert leases.details["stuck"] == 1 and "node-a" in leases.summary
    clock.advance(3600)
    assert by_check(doctor.run(client))["leases"].severity == "error"


def test_due_work_with_no_worker_is_reported_per_queue(client, sql_conn):
    insert_job(sql_conn, queue="mail", inserted_at=START - timedelta(hours=2))
    insert_job(sql_conn, queue="fresh", inserted_at=START - timedelta(seconds=5))
    queues = by_check(doctor.run(client))["queues"]
    assert queues.severity == "error" and "queue 'mail'" in queues.summary
    assert "'fresh'" not in queues.summary and "--queue mail" in queues.fix
    # A job of the queue under a live lease: a worker is there.
    running_job(sql_conn, queue="mail", lease_until=START + timedelta(seconds=30))
    assert by_check(doctor.run(client))["queues"].severity == "ok"


def test_a_paused_queue_with_work_is_info(client, sql_conn):
    insert_job(sql_conn, queue="mail", inserted_at=START - timedelta(hours=2))
    client.pause_queue("mail")
    queues = by_check(doctor.run(client))["queues"]
    assert queues.severity == "info" and "paused" in queues.summary


def test_retention_not_running_is_a_warning(client, sql_conn):
    insert_job(sql_conn, state="succeeded", finished_at=START - timedelta(days=3))
    retention = by_check(doctor.run(client))["retention"]
    assert retention.severity == "warning" and "1 succeeded job(s)" in retention.summary
    kept = doctor.run(client, retention={"succeeded": None})
    assert by_check(kept)["retention"].severity == "ok"


def test_no_schema_is_an_error_and_the_job_checks_are_skipped(empty_db_url):
    with belay.Belay(empty_db_url, verify_schema=False) as bare:
        found = by_check(doctor.run(bare))
    assert found["schema"].severity == "error" and "belay migrate" in found["schema"].fix
    assert found["leases"].summary.startswith("skipped")
    assert found["tables"].severity == "info"


def test_an_unreachable_database_is_one_error_finding():
    with belay.Belay("postgresql://postgres:hunter2@127.0.0.1:1/nowhere") as down:
        findings = doctor.run(down)
    assert [f.severity for f in findings] == ["error"]
    assert "cannot connect" in findings[0].summary and "hunter2" not in findings[0].summary


@pytest.fixture
def unset_pooler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No BELAY_POOLER or BELAY_DIRECT_URL, even in a run behind the suite's pooler."""
    monkeypatch.delenv(POOLER_ENV, raising=False)
    monkeypatch.delenv(DIRECT_URL_ENV, raising=False)
    yield


def test_behind_pgbouncer_without_the_setting_is_an_error(pgbouncer: PgBouncer, direct_url,
                                                          unset_pooler):
    dbname = psycopg.conninfo.conninfo_to_dict(direct_url)["dbname"]
    quick = Thresholds(notify_timeout=0.5)
    with belay.Belay(pgbouncer.url_for(dbname)) as pooled:
        found = by_check(doctor.run(pooled, thresholds=quick))
    pooler = found["pooler"]
    assert pooler.severity == "error" and 'pooler="transaction"' in pooler.fix
    assert pooler.details["detected"] and pooler.details["setting"] is None
    if pooler.details["server_port"] is not None:  # over TCP (not a Unix-socket server)
        assert f"proxies port {pgbouncer.port}" in pooler.summary
    assert found["notify"].severity != "ok"
    with belay.Belay(pgbouncer.url_for(dbname), pooler="transaction",
                     direct_url=direct_url) as configured:
        found = by_check(doctor.run(configured))
    assert found["pooler"].severity == "ok" and found["pooler"].details["detected"]
    assert found["notify"].severity == "ok" and found["notify"].details["listen_via"] == \
        "direct_url"
    with belay.Belay(pgbouncer.url_for(dbname), pooler="transaction") as polling:
        notify = by_check(doctor.run(polling))["notify"]
    assert notify.severity == "info" and "direct_url" in notify.fix


def test_the_prepared_setting_against_what_the_pooler_does(server_url, direct_url,
                                                           unset_pooler):
    """Two real PgBouncers: one that shares prepared statements between its
    clients (as before 1.21), one that tracks them (1.21+,
    max_prepared_statements). The doctor tells them apart and judges both
    settings against each."""
    from belay.pgbouncer import PREPARED_SINCE, find_binary

    if find_binary(PREPARED_SINCE) is None:
        why = "needs PgBouncer 1.21 or later: name a build in BELAY_PGBOUNCER"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run builds one)")
        pytest.skip(why)
    dbname = psycopg.conninfo.conninfo_to_dict(direct_url)["dbname"]
    quick = Thresholds(notify_timeout=0.5)
    seen = {}
    for tracks in (False, True):
        with PgBouncer(server_url, pool_size=1,
                       max_prepared_statements=100 if tracks else 0) as bouncer:
            for setting in ("transaction", "transaction-prepared"):
                with belay.Belay(bouncer.url_for(dbname), pooler=setting,
                                 notify=False) as client:
                    seen[tracks, setting] = by_check(doctor.run(client, thresholds=quick))[
                        "pooler"]
    assert {key: (f.severity, f.details["prepared"]) for key, f in seen.items()} == {
        (False, "transaction"): ("ok", False),
        (False, "transaction-prepared"): ("error", False),
        (True, "transaction"): ("info", True),
        (True, "transaction-prepared"): ("ok", True),
    }
    wrong = seen[False, "transaction-prepared"]
    assert 'set pooler="transaction"' in wrong.fix and "belay_doctor_probe" in wrong.summary
    assert 'pooler="transaction-prepared"' in seen[True, "transaction"].fix


def test_the_setting_without_a_pooler_is_info(direct_url, unset_pooler):
    with belay.Belay(direct_url, pooler="transaction") as client:
        found = by_check(doctor.run(client))
    assert found["pooler"].severity == "info" and not found["pooler"].details["detected"]
    assert doctor.exit_code(list(found.values())) == 0


# -- The command line --------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    return subprocess.run([sys.executable, "-W", "error", "-m", "belay", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=60, check=False)


def test_cli_json_shape_and_exit_0(db_url):
    done = run_cli("--url", db_url, "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    data = json.loads(done.stdout)
    assert data["status"] in ("ok", "info") and data["exit_code"] == 0
    assert [f["check"] for f in data["findings"]] == list(doctor.CHECKS)
    for found in data["findings"]:
        assert set(found) == {"check", "severity", "summary", "fix", "details"}
        assert found["severity"] in doctor.SEVERITIES and isinstance(found["details"], dict)


def test_cli_exits_1_on_a_warning_and_2_on_an_error(db_url, sql_conn):
    now = datetime.now(timezone.utc)
    job_id = running_job(sql_conn, lease_until=now - timedelta(minutes=5))
    warned = run_cli("--url", db_url)
    assert warned.returncode == 1, warned.stdout + warned.stderr
    assert any(line.startswith("WARN") and "leases" in line and f"job {job_id}" in line
               for line in warned.stdout.splitlines())
    assert warned.stdout.rstrip().endswith("doctor: 1 warning (exit 1)")
    sql_conn.execute("UPDATE belay_jobs SET lease_until = %s WHERE id = %s",
                     (now - timedelta(hours=2), job_id))
    failed = run_cli("--url", db_url)
    assert failed.returncode == 2 and "ERROR  leases" in failed.stdout
    assert "Traceback" not in failed.stderr


def test_cli_usage_errors_and_a_dead_server_say_so_without_a_traceback():
    bad = run_cli("--url", "postgresql://postgres@127.0.0.1:1/x", "--succeeded", "nan")
    assert bad.returncode == 2 and "belay: --succeeded is seconds > 0" in bad.stderr
    down = run_cli("--url", "postgresql://postgres:hunter2@127.0.0.1:1/x")
    assert down.returncode == 2 and "cannot connect to the database" in down.stdout
    assert "Traceback" not in down.stderr and "hunter2" not in down.stdout + down.stderr


# -- The dashboard ----------------------------------------------------------------------------


def test_the_dashboard_lists_the_findings(client, sql_conn):
    job_id = running_job(sql_conn, lease_until=START - timedelta(minutes=3))
    app = make_app(client)
    api = call(app, "GET", "/api/doctor")
    assert api.status == 200 and api.json["status"] == "warning"
    assert api.json["exit_code"] == 1
    leases = next(x for x in api.json["findings"] if x["check"] == "leases")
    assert leases["severity"] == "warning" and f"job {job_id}" in leases["summary"]
    page = call(app, "GET", "/doctor")
    assert page.status == 200 and 'data-check="leases" data-severity="warning"' in page.text
    assert f"job {job_id}" in page.text and 'href="/doctor"' in call(app, "GET", "/").text


def test_the_dashboard_doctor_never_500s(empty_db_url):
    with belay.Belay("postgresql://postgres@127.0.0.1:1/nowhere") as down:
        reply = call(make_app(down), "GET", "/api/doctor")
        assert reply.status == 200 and reply.json["status"] == "error"
        assert "cannot connect" in reply.json["findings"][0]["summary"]
        assert call(make_app(down), "GET", "/doctor").status == 200
    with belay.Belay(empty_db_url) as unmigrated:
        reply = call(make_app(unmigrated), "GET", "/api/doctor")
        assert reply.status == 200 and reply.json["findings"][0]["severity"] == "error"
