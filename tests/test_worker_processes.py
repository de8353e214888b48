"""Workers as real OS processes (issue 3, "Tests must show"): kill -9 mid-job and
reclaim elsewhere, SIGTERM drains, a zombie's late ack, N jobs over three
processes run exactly once, an unknown kind kept, and the exit codes of
``belay worker``.

The processes import ``tests/proc_jobs.py`` (kinds ``proc.record`` and
``proc.hold`` in the default registry of *their* interpreter; this process never
imports it). Every run writes ``effects(job_id, attempt, pid)`` over its own
connection, so the database says which process ran which attempt. The test
learns what happened only from the database and the processes' logs, with
bounded polling; no fixed sleeps.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from tests.helpers import job_row, wait_until

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

REPO = Path(__file__).resolve().parent.parent
QUEUE = "q"
RECORD = "proc.record"  # tests/proc_jobs.py: records its run, succeeds
HOLD = "proc.hold"  # records its run, waits for released(job_id) on attempt 1, succeeds
LEASE_TTL = 1.0
POLL = 0.1

Conn = psycopg.Connection[Any]

# A worker with options the CLI has no flag for (sweep_interval).
ENTRY = """
import logging, sys
import belay
import tests.proc_jobs
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
url, node, lease_ttl, sweep = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
belay.Worker({"q": 4}, client=belay.Belay(url), lease_ttl=lease_ttl, poll_interval=0.1,
             busy_poll=0.025, sweep_interval=sweep, shutdown_grace=10.0, node_id=node).run()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    return env


class Proc:
    """A worker subprocess whose stderr (its log) goes to a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                args, cwd=REPO, env=_env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log,
            )
        self.pid = self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def send(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def wait_for_log(self, pattern: str, what: str, timeout: float = 60.0) -> re.Match[str]:
        """Poll the log for ``pattern``; fail at once (with the log) if the process died.
        The deadline is generous: a process importing its libraries on a 2-core
        machine busy with other suites can take well over 15 s to start."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.log())
            if found:
                return found
            if self.popen.poll() is not None:
                raise AssertionError(f"process {self.pid} exited ({self.popen.returncode}) "
                                     f"before {what}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting until {what}:\n{self.log()}")
            time.sleep(0.02)

    def started(self) -> Proc:
        self.wait_for_log(r"belay worker \S+ started", "the worker started")
        return self

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # SIGKILL ends a SIGSTOPped process too
        self.popen.wait(10)


class Spawner:
    """Starts worker processes for one test; the fixture kills whatever is left."""

    def __init__(self, db_url: str, tmp_path: Path) -> None:
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []

    def _start(self, node: str, args: list[str]) -> Proc:
        proc = Proc(args, self.tmp_path / f"{node}-{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def cli(self, node: str, *extra: str, slots: int = 4) -> Proc:
        """``belay worker`` on queue q (4 slots) with a 1 s lease (sweeper at its 5 s
        default)."""
        return self._start(node, [
            sys.executable, "-W", "error", "-m", "belay", "worker", "--url", self.db_url,
            "--import", "tests.proc_jobs", "--queue", f"{QUEUE}={slots}",
            "--lease-ttl", str(LEASE_TTL), "--poll-interval", str(POLL), "--node-id", node,
            *extra,
        ])

    def entry(self, node: str, sweep_interval: float) -> Proc:
        """``belay.Worker(...).run()`` with a short sweep interval."""
        return self._start(node, [
            sys.executable, "-W", "error", "-c", ENTRY, self.db_url, node, str(LEASE_TTL),
            str(sweep_interval),
        ])

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.kill()


@pytest.fixture
def spawn(db_url: str, tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(db_url, tmp_path)
    try:
        yield spawner
    finally:
        spawner.kill_all()


@pytest.fixture
def side_tables(sql_conn: Conn) -> Conn:
    sql_conn.execute("CREATE TABLE effects (job_id bigint, attempt int, pid int)")
    sql_conn.execute("CREATE TABLE done (job_id bigint, attempt int, pid int)")
    sql_conn.execute("CREATE TABLE released (job_id bigint)")
    return sql_conn


@pytest.fixture
def producer(db_url: str) -> Iterator[belay.Belay]:
    """A client on the wall clock, as the worker processes are."""
    with belay.Belay(db_url) as instance:
        yield instance


def runs(conn: Conn, job_id: int, table: str = "effects") -> list[tuple[int, int]]:
    """(attempt, pid) of each recorded run of the job, in attempt order."""
    query = {
        "effects": "SELECT attempt, pid FROM effects WHERE job_id = %s ORDER BY attempt, pid",
        "done": "SELECT attempt, pid FROM done WHERE job_id = %s ORDER BY attempt, pid",
    }[table]
    return [(r[0], r[1]) for r in conn.execute(query, (job_id,))]


def state(conn: Conn, job_id: int) -> str:
    return str(job_row(conn, job_id)["state"])


def release(conn: Conn, job_id: int) -> None:
    conn.execute("INSERT INTO released (job_id) VALUES (%s)", (job_id,))


def lease_expired(conn: Conn, job_id: int) -> bool:
    row = conn.execute(
        "SELECT lease_until <= now() FROM belay_jobs WHERE id = %s", (job_id,)
    ).fetchone()
    return bool(row and row[0])


def stays(predicate: Callable[[], bool], what: str, seconds: float) -> None:
    """Assert that a condition holds throughout a bounded window (polled, failing
    at the first violation) — how an absence across processes can be shown."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.02)


# -- kill -9 mid-job ---------------------------------------------------------------------


def test_kill_9_mid_job_is_reclaimed_after_the_lease_and_completed_elsewhere(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = spawn.cli("node-a").started()
    job = producer.enqueue(HOLD, {}, queue=QUEUE)
    wait_until(lambda: runs(conn, job.id) == [(1, a.pid)], "A runs attempt 1", timeout=10)
    running = job_row(conn, job.id)
    assert (running["state"], running["attempt"], running["leased_by"]) == ("running", 1, "node-a")

    a.send(signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    b = spawn.entry("node-b", sweep_interval=0.2)

    wait_until(lambda: state(conn, job.id) == "succeeded", "B completes the job", timeout=15)
    row = job_row(conn, job.id)
    assert row["attempt"] == 2
    assert row["lease_until"] is None and row["leased_by"] is None
    assert [(e["error"], e["attempt"]) for e in row["errors"]] == [("lease_expired", 1)]
    assert producer.get_job(job.id).result == {"attempt": 2, "pid": b.pid}  # type: ignore[union-attr]
    assert runs(conn, job.id) == [(1, a.pid), (2, b.pid)]
    assert runs(conn, job.id, "done") == [(2, b.pid)]  # A never got past its hold
    assert re.search(rf"reclaimed job {job.id} \(lease expired\)", b.log())


# -- SIGTERM -----------------------------------------------------------------------------


def test_sigterm_finishes_the_running_job_claims_nothing_new_and_exits_0(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = spawn.cli("node-a", "--shutdown-grace", "10").started()
    first = producer.enqueue(HOLD, {}, queue=QUEUE)
    wait_until(lambda: runs(conn, first.id) == [(1, a.pid)], "A runs the job", timeout=10)

    a.send(signal.SIGTERM)
    a.wait_for_log(rf"signal {int(signal.SIGTERM)}: stopping", "A took the signal")
    later = producer.enqueue(RECORD, {}, queue=QUEUE)
    # A live producer claims within one poll (0.1 s); ten polls' worth of
    # 'ready' shows A stopped claiming, while its first job holds it in the grace.
    stays(lambda: state(conn, later.id) == "ready", "A claimed a job after SIGTERM",
          10 * POLL)
    assert a.popen.poll() is None, "A exited before its running job finished"

    release(conn, first.id)
    assert a.wait(10) == 0, a.log()

    done = job_row(conn, first.id)
    assert (done["state"], done["attempt"], done["errors"]) == ("succeeded", 1, [])
    assert producer.get_job(first.id).result == {"attempt": 1, "pid": a.pid}  # type: ignore[union-attr]
    untouched = job_row(conn, later.id)
    assert (untouched["state"], untouched["attempt"], untouched["leased_by"]) == ("ready", 0, None)
    assert runs(conn, later.id) == []
    assert "still running after" not in a.log()


def test_leases_keep_being_renewed_while_draining(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = spawn.cli("node-a", "--shutdown-grace", "10").started()
    job = producer.enqueue(HOLD, {}, queue=QUEUE)
    wait_until(lambda: runs(conn, job.id) == [(1, a.pid)], "A runs the job", timeout=10)

    a.send(signal.SIGTERM)
    a.wait_for_log(rf"signal {int(signal.SIGTERM)}: stopping", "A took the signal")
    at_signal = job_row(conn, job.id)["lease_until"]
    # The heartbeat renews every lease_ttl / 3; within three TTLs it must have
    # pushed the lease past where it stood when the grace began.
    wait_until(lambda: job_row(conn, job.id)["lease_until"] > at_signal,
               "A's heartbeat renews the lease during the grace", timeout=3 * LEASE_TTL)
    assert not lease_expired(conn, job.id)
    release(conn, job.id)
    assert a.wait(10) == 0
    assert (state(conn, job.id), job_row(conn, job.id)["attempt"]) == ("succeeded", 1)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_during_the_grace_exits_at_once_leaving_the_job_to_reclaim(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay, db_url: str, second: int
) -> None:
    conn = side_tables
    a = spawn.cli("node-a", "--shutdown-grace", "10").started()
    job = producer.enqueue(HOLD, {}, queue=QUEUE)
    wait_until(lambda: runs(conn, job.id) == [(1, a.pid)], "A runs the job", timeout=10)

    a.send(signal.SIGTERM)
    a.wait_for_log(rf"signal {int(signal.SIGTERM)}: stopping", "A took the first signal")
    a.send(second)
    # Far inside the 10 s grace: the second signal did not wait for the job.
    exit_code = a.wait(3)
    assert exit_code != 0 and exit_code != -second, a.log()  # its own exit, not the signal's
    assert "second signal" in a.log()

    left = job_row(conn, job.id)
    assert (left["state"], left["attempt"], left["leased_by"]) == ("running", 1, "node-a")
    assert runs(conn, job.id, "done") == []

    # Left to lease expiry, then reclaimed like any crashed run.
    wait_until(lambda: lease_expired(conn, job.id), "the lease lapses", timeout=3 * LEASE_TTL)
    sweeper = belay.Worker(["elsewhere"], client=producer, registry=belay.Registry(),
                           lease_ttl=LEASE_TTL, poll_interval=POLL)
    with sweeper:
        assert sweeper.reclaim() == 1
    back = job_row(conn, job.id)
    assert (back["state"], back["attempt"]) == ("ready", 1)
    assert [e["error"] for e in back["errors"]] == ["lease_expired"]


# -- a zombie across processes ------------------------------------------------------------


@pytest.mark.parametrize("how", ["frozen", "partitioned"])
def test_a_zombie_whose_lease_was_reclaimed_cannot_change_the_row(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay, how: str
) -> None:
    """Two ways for A to lose its lease while its run goes on:

    - frozen: SIGSTOP A past its 1 s lease (a GC pause, a stalled VM); once
      thawed, its heartbeat finds the lease gone and the run is discarded
      before it can ack ("lost");
    - partitioned: A holds a 30 s lease (next renewal in 10 s) that lapses
      anyway — the database saw no renewal, as when A's heartbeat can't reach
      it — so A's run finishes unaware and sends its ack, which the fence
      (state = 'running' AND attempt = 1) turns into a no-op ("stale").
    """
    conn = side_tables
    ttl = ["--lease-ttl", "30"] if how == "partitioned" else []
    # One slot, held by the zombie run: attempt 2 can only go to B.
    a = spawn.cli("node-a", *ttl, slots=1).started()
    job = producer.enqueue(HOLD, {}, queue=QUEUE)
    wait_until(lambda: runs(conn, job.id) == [(1, a.pid)], "A runs attempt 1", timeout=10)

    if how == "frozen":
        a.send(signal.SIGSTOP)  # A's heartbeat freezes with it: its lease lapses
    else:
        conn.execute("UPDATE belay_jobs SET lease_until = now() - interval '1 second' "
                     "WHERE id = %s AND leased_by = 'node-a'", (job.id,))
    b = spawn.entry("node-b", sweep_interval=0.2)
    wait_until(lambda: state(conn, job.id) == "succeeded", "B reclaims and completes the job",
               timeout=15)
    settled = job_row(conn, job.id)
    assert settled["attempt"] == 2
    assert [(e["error"], e["attempt"]) for e in settled["errors"]] == [("lease_expired", 1)]

    release(conn, job.id)  # A's run finishes and, unless it knows better, acks
    if how == "frozen":
        a.send(signal.SIGCONT)
    wait_until(lambda: (1, a.pid) in runs(conn, job.id, "done"),
               "A's run reaches its end", timeout=10)
    expected = "stale" if how == "partitioned" else "(?:stale|lost)"
    found = a.wait_for_log(rf"job {job.id} {re.escape(HOLD)} queue={QUEUE} ({expected}) "
                           "attempt=1 ", "A reports its run discarded")
    # Each is logged by another thread than the run's own report (the
    # heartbeat's renewal, after it gave its connection back): waited for,
    # not read at once.
    if found[1] == "stale":
        a.wait_for_log(rf"stale ack for job {job.id} attempt 1 discarded", "A logs the stale ack")
    else:
        a.wait_for_log(rf"lost the lease of job {job.id} attempt 1", "A logs the lost lease")

    assert job_row(conn, job.id) == settled
    assert producer.get_job(job.id).result == {"attempt": 2, "pid": b.pid}  # type: ignore[union-attr]
    assert runs(conn, job.id) == [(1, a.pid), (2, b.pid)]
    # The zombie's worker itself is healthy: it stops cleanly with nothing in flight.
    a.send(signal.SIGTERM)
    assert a.wait(10) == 0, a.log()


# -- many jobs, three processes --------------------------------------------------------------


def test_three_processes_run_each_of_200_jobs_exactly_once(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    workers = [spawn.cli(f"node-{n}") for n in "abc"]
    for proc in workers:
        proc.started()
    jobs = producer.enqueue_many([{"kind": RECORD, "input": {"n": n}, "queue": QUEUE}
                                  for n in range(200)])
    ids = sorted(job.id for job in jobs)

    def terminal() -> int:
        row = conn.execute("SELECT count(*) FROM belay_jobs WHERE finished_at IS NOT NULL")
        return int(row.fetchone()[0])  # type: ignore[index]

    wait_until(lambda: terminal() == 200, "all 200 jobs finish", timeout=30)

    rows = conn.execute(
        "SELECT id, state, attempt, errors, result IS NOT NULL FROM belay_jobs ORDER BY id"
    ).fetchall()
    assert [r[0] for r in rows] == ids
    assert {(r[1], r[2], len(r[3]), r[4]) for r in rows} == {("succeeded", 1, 0, True)}
    effects = conn.execute("SELECT job_id, attempt, pid FROM effects ORDER BY job_id").fetchall()
    assert [e[0] for e in effects] == ids  # one run per job: none lost, none twice
    assert {e[1] for e in effects} == {1}
    pids = {e[2] for e in effects}
    assert pids <= {p.pid for p in workers}
    assert len(pids) >= 2, "one process ran everything: the test raced nothing"
    # Each result names the process that recorded the run.
    by_job = {e[0]: e[2] for e in effects}
    listed = producer.list_jobs(queue=QUEUE, limit=500)
    assert len(listed) == 200
    for job in listed:
        assert job.result == {"attempt": 1, "pid": by_job[job.id]}

    for proc in workers:
        proc.send(signal.SIGTERM)
    assert [proc.wait(10) for proc in workers] == [0, 0, 0]


# -- an unknown kind ----------------------------------------------------------------------------


def test_an_unknown_kind_is_kept_ready_not_run_and_not_counted(
    spawn: Spawner, side_tables: Conn, producer: belay.Belay
) -> None:
    conn = side_tables
    a = spawn.cli("node-a").started()
    stranger = producer.enqueue("proc.nobody_knows", {"x": 1}, queue=QUEUE)
    a.wait_for_log(rf"no worker for kind 'proc\.nobody_knows' \(job {stranger.id}",
                   "A turns the unknown kind away")
    # The worker survived it and keeps working.
    known = producer.enqueue(RECORD, {}, queue=QUEUE)
    wait_until(lambda: state(conn, known.id) == "succeeded", "A runs a known job", timeout=10)

    kept = job_row(conn, stranger.id)
    assert (kept["state"], kept["attempt"], kept["errors"]) == ("ready", 0, [])
    assert kept["kind"] == "proc.nobody_knows" and kept["input"] == {"x": 1}
    assert kept["lease_until"] is None and kept["leased_by"] is None
    # Snoozed into the future, so it doesn't spin between claims.
    ahead = conn.execute("SELECT %s::timestamptz - now() > interval '30 seconds'",
                         (kept["ready_at"],)).fetchone()
    assert ahead is not None and ahead[0]
    assert runs(conn, stranger.id) == []
    a.send(signal.SIGTERM)
    assert a.wait(10) == 0
    assert (state(conn, stranger.id), job_row(conn, stranger.id)["attempt"]) == ("ready", 0)


# -- exit codes of belay worker ------------------------------------------------------------------


def run_worker_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "belay", "worker", *args],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=30, check=False,
    )


def test_worker_without_import_exits_2_and_says_what_to_pass(db_url: str) -> None:
    done = run_worker_cli("--url", db_url, "--queue", "q=1")
    assert done.returncode == 2, done.stderr
    assert "--import" in done.stderr


@pytest.mark.parametrize("spec", ["q=0", "q=x", "q=-1", "q=1.5"])
def test_worker_with_a_bad_queue_limit_exits_2(db_url: str, spec: str) -> None:
    done = run_worker_cli("--url", db_url, "--import", "tests.proc_jobs", "--queue", spec)
    assert done.returncode == 2, done.stderr
    assert f"--queue {spec!r}" in done.stderr


@pytest.mark.parametrize("args", [["--queue", "=4"], ["--lease-ttl", "0"]],
                         ids=["empty-queue-name", "zero-lease-ttl"])
def test_worker_with_bad_options_exits_2(db_url: str, args: list[str]) -> None:
    done = run_worker_cli("--url", db_url, "--import", "tests.proc_jobs", *args)
    assert done.returncode == 2, done.stderr


def test_worker_with_an_unknown_import_exits_2(db_url: str) -> None:
    done = run_worker_cli("--url", db_url, "--import", "tests.no_such_module")
    assert done.returncode == 2, done.stderr
    assert "tests.no_such_module" in done.stderr


def test_worker_on_an_unreachable_database_exits_1(unused_port: int) -> None:
    url = f"postgresql://postgres@127.0.0.1:{unused_port}/nowhere?connect_timeout=3"
    done = run_worker_cli("--url", url, "--import", "tests.proc_jobs", "--queue", "q=1")
    assert done.returncode == 1, done.stderr
    assert "cannot connect to the database" in done.stderr


@pytest.fixture
def unused_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize(("spec", "message"), [
    ('q={"limit": 2,', "the options after '=' are not JSON"),
    ('q={"limit": 0}', "queue 'q': the limit is a whole number from 1 to"),
    ('q={"global_limt": 3}', "unknown option(s) 'global_limt'"),
])
def test_worker_with_bad_json_queue_options_exits_2(db_url: str, spec: str,
                                                     message: str) -> None:
    done = run_worker_cli("--url", db_url, "--import", "tests.proc_jobs", "--queue", spec)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_worker_takes_json_queue_options(spawn: Spawner, db_url: str) -> None:
    proc = spawn._start("json", [
        sys.executable, "-W", "error", "-m", "belay", "worker", "--url", db_url,
        "--import", "tests.proc_jobs", "--queue",
        f'{QUEUE}={{"limit": 3, "global_limit": 2, "partition": {{"input": "tenant"}}}}',
        "--node-id", "json",
    ]).started()
    found = proc.wait_for_log(r"started: queues (.*)", "the queues are logged")
    assert "'global_limit': 2" in found.group(1)
    assert "'partition': ['input', 'tenant']" in found.group(1)
    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0
