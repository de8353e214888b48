"""belay behind a real PgBouncer in transaction-pooling mode (docs/scaling.md).

Each test starts a PgBouncer of its own (``pgbouncer`` fixture, the machine's
binary; skipped without one) in front of the test server. With
``pool_size=1`` every client shares one server connection, so anything one
client leaves on a server session — a prepared statement, a session advisory
lock, a LISTEN, a setting — is seen by the next: the state the setting must
never leave behind is read off that one session.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay import connect
from belay.errors import ConfigurationError, PoolerError
from belay.pgbouncer import PREPARED_SINCE, PgBouncer, find_binary
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
Conn = psycopg.Connection[Any]

pytestmark = pytest.mark.skipif(find_binary() is None,
                                reason="needs PgBouncer (Debian/Ubuntu: apt install pgbouncer)")


def _dbname(url: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])


#: The two pooler settings, each tested behind a PgBouncer that fits it.
MODES = ("transaction", "transaction-prepared")


def _tracking_binary() -> None:
    """Skip (fail on CI, which builds one) without a PgBouncer that tracks
    prepared statements."""
    if find_binary(PREPARED_SINCE) is None:
        why = ("needs PgBouncer 1.21 or later (max_prepared_statements); the machine's is "
               "older: name a newer build in BELAY_PGBOUNCER")
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run builds one)")
        pytest.skip(why)


def _bouncer(server_url: str, mode: str, pool_size: int) -> PgBouncer:
    """A PgBouncer for the pooler setting ``mode``: one that tracks prepared
    statements for "transaction-prepared", else one that does not."""
    if mode == "transaction-prepared":
        _tracking_binary()
        return PgBouncer(server_url, pool_size=pool_size, max_prepared_statements=100)
    return PgBouncer(server_url, pool_size=pool_size)


@pytest.fixture
def single(server_url: str, direct_url: str) -> Iterator[str]:
    """The test database through a PgBouncer with ONE server connection."""
    with PgBouncer(server_url, pool_size=1) as bouncer:
        yield bouncer.url_for(_dbname(direct_url))


@pytest.fixture
def tracking(server_url: str, direct_url: str) -> Iterator[str]:
    """The test database through a PgBouncer (1.21+) with ONE server
    connection, tracking each client's prepared statements."""
    with _bouncer(server_url, "transaction-prepared", 1) as bouncer:
        yield bouncer.url_for(_dbname(direct_url))


@pytest.fixture
def pooled(pgbouncer: PgBouncer, direct_url: str) -> str:
    """The test database through a PgBouncer with four server connections."""
    return pgbouncer.url_for(_dbname(direct_url))


def _server_session(url: str) -> dict[str, Any]:
    """What the single server session carries, read through the pooler (a
    fresh client, no prepared statements of its own)."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM pg_prepared_statements) AS prepared, "
            "(SELECT count(*) FROM pg_listening_channels()) AS listening, "
            "current_setting('statement_timeout') AS statement_timeout, "
            "current_setting('default_transaction_read_only') AS read_only"
        ).fetchone()
    assert row is not None
    return dict(zip(("prepared", "listening", "statement_timeout", "read_only"), row,
                    strict=True))


def _advisory_locks(conn: Conn) -> int:
    return int(conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()[0])


@contextlib.contextmanager
def _two_clients(url: str, pooler: str) -> Iterator[tuple[belay.Belay, belay.Belay, int]]:
    """Two clients of one connection each, through ``url``, and a job to read."""
    a = belay.Belay(url, pooler=pooler, notify=False, min_pool_size=1, max_pool_size=1)
    b = belay.Belay(url, pooler=pooler, notify=False, min_pool_size=1, max_pool_size=1)
    with a, b:
        yield a, b, a.enqueue("pooler.noop").id


# -- The setting, or the error that names it ---------------------------------------------


def test_without_the_setting_the_pooler_error_names_it(single: str) -> None:
    """Two clients on one server connection: psycopg prepares a repeated query
    after five runs under the name ``_pg3_0``, which the other client's
    preparation then collides with. The error says which setting fixes it."""
    with _two_clients(single, "none") as (a, b, job), \
            pytest.raises(PoolerError, match=r'pooler="transaction"') as raised:
        for _ in range(20):
            a.get_job(job)
            b.get_job(job)
    assert isinstance(raised.value.__cause__, (psycopg.errors.DuplicatePreparedStatement,
                                               psycopg.errors.InvalidSqlStatementName))
    assert "BELAY_POOLER=transaction" in str(raised.value)


def test_with_the_setting_clients_share_a_server_connection(single: str) -> None:
    with _two_clients(single, "transaction") as (a, b, job):
        for _ in range(50):
            assert a.get_job(job) == b.get_job(job)
    assert _server_session(single)["prepared"] == 0


def test_behind_a_tracking_pooler_belay_prepares(tracking: str) -> None:
    """pooler="transaction-prepared" behind a PgBouncer that tracks prepared
    statements: two clients on one server connection, each with its own
    prepared statements (psycopg's names collide; PgBouncer renames them), and
    the server runs them prepared."""
    with _two_clients(tracking, "transaction-prepared") as (a, b, job):
        for _ in range(50):
            assert a.get_job(job) == b.get_job(job)
    with psycopg.connect(tracking, autocommit=True, prepare_threshold=None) as conn:
        names = [row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")]
    assert names and all(name.startswith("PGBOUNCER_") for name in names)


def test_the_prepared_setting_behind_a_pooler_that_does_not_track(
        server_url: str, direct_url: str) -> None:
    """pooler="transaction-prepared" where the pooler shares prepared
    statements (PgBouncer before 1.21, or max_prepared_statements = 0): the
    error says to use "transaction"."""
    with PgBouncer(server_url, pool_size=1) as bouncer, \
            _two_clients(bouncer.url_for(_dbname(direct_url)), "transaction-prepared") \
            as (a, b, job), pytest.raises(PoolerError, match='use "transaction"'):
        for _ in range(20):
            a.get_job(job)
            b.get_job(job)


def test_the_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                 db_url: str) -> None:
    monkeypatch.setenv("BELAY_POOLER", "transaction")
    monkeypatch.setenv("BELAY_DIRECT_URL", db_url)
    with belay.Belay(db_url) as client:
        assert client.pooler == "transaction"
        assert client.listen_conninfo == client.direct_url
    monkeypatch.setenv("BELAY_POOLER", "transaction-prepared")
    with belay.Belay(db_url) as client:
        assert client.pooler == "transaction-prepared"
    monkeypatch.setenv("BELAY_POOLER", "statement")
    with pytest.raises(ConfigurationError,
                       match=r"pooler must be None .* 'transaction' .* 'transaction-prepared'"):
        belay.Belay(db_url)


def test_a_callers_connection_keeps_its_own_prepare_setting(single: str) -> None:
    """belay's statements on a caller's connection are never prepared behind
    the pooler; the caller's setting is back afterwards."""
    with belay.Belay(single, pooler="transaction", notify=False) as client, \
            psycopg.connect(single, prepare_threshold=0) as conn:
        for _ in range(10):
            client.enqueue("pooler.noop", conn=conn)
            conn.commit()
            assert conn.prepare_threshold == 0
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements",
                            prepare=False).fetchone() == (0,)
        conn.rollback()


# -- A worker behind the pooler leaves nothing on a server session --------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_leaves_nothing_on_the_server_session(
        mode: str, server_url: str, direct_url: str, sql_conn: Conn) -> None:
    """Steps, signals, limits, partitions, a workflow and a metrics-style read,
    all through one shared server connection: no LISTEN, session lock or
    setting is left on it, and no prepared statement unless the pooler tracks
    them (then only PgBouncer's own)."""
    with _bouncer(server_url, mode, 1) as bouncer:
        _worker_through(bouncer.url_for(_dbname(direct_url)), mode, sql_conn)


def _worker_through(single: str, mode: str, sql_conn: Conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="pooler.steps", queue="limited", registry=reg)
    def steps(ctx: belay.Context) -> int:
        total = 0
        for i in range(6):
            total += ctx.step(f"s{i}", lambda i=i: i)
        return total

    @belay.worker(name="pooler.waits", queue="default", registry=reg)
    def waits(ctx: belay.Context) -> Any:
        return ctx.await_signal("go", timeout=30)

    client = belay.Belay(single, pooler=mode, registry=reg)
    queues = {"default": 2,
              "limited": {"limit": 2, "global_limit": 1, "partition": {"input": "tenant"},
                          "rate": {"allowed": 1000, "period": 1}}}
    worker = belay.Worker(queues, client=client, registry=reg, poll_interval=0.05,
                          busy_poll=0.01, notify=True)
    with client:
        worker.start()
        try:
            jobs = [client.enqueue("pooler.steps", {"tenant": i % 3}) for i in range(12)]
            flow = belay.Workflow("pooled")
            flow.add("a", "pooler.steps", {"tenant": 9})
            flow.add("b", "pooler.steps", {"tenant": 9}, deps=["a"])
            members = client.enqueue_workflow(flow)
            waiter = client.enqueue("pooler.waits")
            for job in jobs:
                assert client.await_result(job.id, timeout=60) == 15
            for member in members.values():
                assert client.await_result(member.id, timeout=60) == 15
            wait_until(lambda: client.get_job(waiter.id).state == "awaiting",
                       "the waiter parks", timeout=30)
            client.signal_job(waiter.id, "go", {"ok": True})
            assert client.await_result(waiter.id, timeout=60) == {"ok": True}
            stats = client.stats()
            assert stats["limited"]["succeeded"] == 14
        finally:
            worker.stop()
    assert _advisory_locks(sql_conn) == 0
    session = _server_session(single)
    if mode == "transaction":
        assert session["prepared"] == 0
    else:
        assert session["prepared"] > 0  # PgBouncer's PGBOUNCER_n, for every client
    assert session["listening"] == 0  # no direct_url: the worker polled instead
    assert session["read_only"] == "off"
    attempts = sql_conn.execute("SELECT DISTINCT attempt FROM belay_jobs").fetchall()
    assert attempts == [(1,)]


def test_listen_goes_to_the_direct_url(pooled: str, direct_url: str, sql_conn: Conn) -> None:
    """With ``direct_url`` the listener connects straight to the server (and
    a poke wakes a worker polling every 5 s); without one there is no listener."""
    reg = belay.Registry()
    belay.worker(name="pooler.poked", registry=reg)(lambda ctx: "hi")

    def listeners() -> list[tuple[Any, ...]]:
        return sql_conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'belay-listener'").fetchall()

    with belay.Belay(pooled, pooler="transaction", direct_url=direct_url) as client:
        worker = belay.Worker(["default"], client=client, registry=reg, poll_interval=5.0,
                              busy_poll=5.0, notify=True)
        worker.start()
        try:
            wait_until(lambda: len(listeners()) == 1, "the listener connects directly")
            time.sleep(0.3)  # past the first claim round, so only the poke explains a pickup
            started = time.monotonic()
            job = client.enqueue("pooler.poked")
            assert client.await_result(job.id, timeout=10) == "hi"
            assert time.monotonic() - started < 2.5
        finally:
            worker.stop()
    with belay.Belay(pooled, pooler="transaction") as client:
        assert client.listen_conninfo is None
        worker = belay.Worker(["default"], client=client, registry=reg, poll_interval=0.05,
                              notify=True)
        worker.start()
        try:
            job = client.enqueue("pooler.poked")
            assert client.await_result(job.id, timeout=10) == "hi"
            assert listeners() == []
        finally:
            worker.stop()


def test_the_metrics_read_limits_only_its_own_transaction(single: str) -> None:
    pytest.importorskip("prometheus_client")
    from belay.telemetry import QueueDepths

    with belay.Belay(single, pooler="transaction", notify=False) as client:
        client.enqueue("pooler.noop")
        worker = belay.Worker(["default"], client=client, registry=belay.Registry())
        depths = QueueDepths(worker, timeout=0.5)
        assert depths._read()["default"]["ready"] == 1
    assert _server_session(single)["statement_timeout"] == "0"


# -- Processes ----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("BELAY_DATABASE_URL", "BELAY_POOLER", "BELAY_DIRECT_URL")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.parametrize("mode", MODES)
def test_two_worker_processes_behind_pgbouncer_run_each_job_once(
        mode: str, server_url: str, direct_url: str, sql_conn: Conn, tmp_path: Path) -> None:
    """The issue's reproduction, with the setting: two `belay worker` processes
    through the pooler (four server connections for both) drain 500 jobs; each
    ran once, at attempt 1."""
    with _bouncer(server_url, mode, 4) as bouncer:
        _two_workers(bouncer.url_for(_dbname(direct_url)), mode, sql_conn, tmp_path)


def _two_workers(pooled: str, mode: str, sql_conn: Conn, tmp_path: Path) -> None:
    sql_conn.execute("CREATE TABLE effects (job_id bigint, attempt int, pid int)")
    with belay.Belay(pooled, pooler=mode, notify=False) as client:
        ids = [job.id for job in client.enqueue_many(
            [belay.JobSpec("proc.record", {}, queue="q") for _ in range(500)])]
    procs = []
    for node in ("pooled-a", "pooled-b"):
        log = open(tmp_path / f"{node}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "belay", "worker", "--url", pooled,
             "--pooler", mode, "--import", "tests.proc_jobs", "--queue", "q=8",
             "--lease-ttl", "5", "--poll-interval", "0.05", "--node-id", node],
            cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log), log))
    try:
        wait_until(lambda: sql_conn.execute(
            "SELECT count(*) FROM belay_jobs WHERE state = 'succeeded'").fetchone() == (500,),
            "both workers drain the queue", timeout=120)
    finally:
        for proc, log in procs:
            proc.terminate()
            proc.wait(30)
            log.close()
    logs = "".join((tmp_path / f"{node}.log").read_text() for node in ("pooled-a", "pooled-b"))
    assert "prepared statement" not in logs
    effects = sql_conn.execute(
        "SELECT job_id, attempt FROM effects ORDER BY job_id").fetchall()
    assert [e[0] for e in effects] == ids
    assert {e[1] for e in effects} == {1}
    nodes = sql_conn.execute("SELECT count(DISTINCT pid) FROM effects").fetchone()
    assert nodes == (2,)


def test_the_cli_takes_the_setting(pooled: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "belay", "stats", "--json", "--url", pooled,
         "--pooler", "transaction"], cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []
    bad = subprocess.run(
        [sys.executable, "-m", "belay", "stats", "--url", pooled, "--pooler", "statement"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "pooler must be None" in bad.stderr and "Traceback" not in bad.stderr


# -- What needs a direct connection ---------------------------------------------------------


def test_replay_behind_the_pooler_needs_a_direct_url(pooled: str) -> None:
    from belay.replay import dry_run

    with belay.Belay(pooled, pooler="transaction", notify=False) as client:
        job = client.enqueue("pooler.noop")
        with pytest.raises(ConfigurationError, match="direct_url"):
            dry_run(client, job.id)


@pytest.mark.parametrize("mode", MODES)
def test_langgraph_setup_behind_the_pooler(mode: str, server_url: str, direct_url: str,
                                           sql_conn: Conn) -> None:
    """Two savers set up at once through the pooler: the setup runs under a
    transaction-scoped lock (a session lock would stay behind on the pooled
    server connection, held for whichever client gets it next)."""
    pytest.importorskip("langgraph.checkpoint.postgres")
    with _bouncer(server_url, mode, 4) as bouncer:
        _langgraph_through(bouncer.url_for(_dbname(direct_url)), mode, sql_conn)


def _langgraph_through(pooled: str, mode: str, sql_conn: Conn) -> None:
    from belay.integrations.langgraph import close_savers, postgres_saver

    try:
        with belay.Belay(pooled, pooler=mode, notify=False) as client:
            savers = []
            threads = [threading.Thread(target=lambda: savers.append(postgres_saver(client)))
                       for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert len(savers) == 2
            config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
            assert savers[0].get_tuple(config) is None
    finally:
        close_savers()
    assert _advisory_locks(sql_conn) == 0
    tables = sql_conn.execute("SELECT to_regclass('checkpoints') IS NOT NULL").fetchone()
    assert tables == (True,)


def test_connect_options() -> None:
    assert connect.options("transaction") == {"prepare_threshold": None}
    assert connect.options("transaction-prepared") == {}
    assert connect.options(None) == {}
    assert connect.pooler_error(ValueError("x")) is None
