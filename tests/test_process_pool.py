"""The process pool (belay.parts.processes): jobs run in child processes that
speak the executor protocol on a private socket, against a real PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import belay
from belay.errors import ConfigurationError
from belay.runner import Worker
from tests import pool_jobs
from tests.helpers import Ends, job_row, wait_until

Q = pool_jobs.QUEUE


@pytest.fixture
def real_client(db_url: str, direct_url: str) -> Iterator[belay.Belay]:
    """The children read the wall clock: so does this client."""
    client = belay.Belay(db_url, notify=False, direct_url=direct_url,
                         registry=pool_jobs.REGISTRY)
    yield client
    client.close()


def pool(client: belay.Belay, processes: int = 2, **options: Any) -> Worker:
    return Worker({Q: 4}, client=client, registry=pool_jobs.REGISTRY, processes=processes,
                  lease_ttl=3.0, shutdown_grace=2.0, sweep_interval=0.5, **options)


def finished(sql_conn: psycopg.Connection[Any], job_id: int, timeout: float = 30.0
             ) -> dict[str, Any]:
    wait_until(lambda: job_row(sql_conn, job_id)["state"] in ("succeeded", "failed",
                                                              "cancelled"),
               f"job {job_id} to finish", timeout)
    return job_row(sql_conn, job_id)


def test_jobs_run_in_child_processes(real_client: belay.Belay,
                                     sql_conn: psycopg.Connection[Any]) -> None:
    ids = [real_client.enqueue("pool.pid", {"n": n}).id for n in range(6)]
    with pool(real_client) as worker:
        results = [real_client.await_result(i, timeout=30) for i in ids]
        children = set(worker.processes.pids()) if worker.processes else set()
    pids = {r["pid"] for r in results}
    assert os.getpid() not in pids
    assert pids <= children and len(children) == 2
    assert [r["input"] for r in results] == [{"n": n} for n in range(6)]


def test_steps_events_and_retries_inside_a_child(real_client: belay.Belay,
                                                 sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.steps", {}).id
    with pool(real_client, processes=1):
        row = finished(sql_conn, job_id)
    assert row["state"] == "succeeded", row
    result = belay.codec.loads(row["result"])
    events = real_client.events(job_id)
    assert [e.payload["attempt"] for e in events] == [1, 2]
    assert result["first"] == events[0].payload["ran_in"]  # journaled, not rerun
    assert row["spent_usd_micros"] == 500_000 and row["spent_tokens"] == 10


def test_budget_stops_a_child_job(real_client: belay.Belay,
                                  sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.spend", {}, budget={"usd": 2.5}).id
    with pool(real_client, processes=1):
        row = finished(sql_conn, job_id)
    assert row["state"] == "failed"
    assert "budget_exceeded" in str(row["errors"])
    assert len(real_client.steps(job_id)) == 3


def test_hard_timeout_kills_the_child_and_replaces_it(
        real_client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.hang", {}).id
    with pool(real_client, processes=1) as worker:
        assert worker.processes is not None
        wait_until(lambda: len(worker.processes.pids()) == 1, "a child", 10)
        first = worker.processes.pids()[0]
        result = real_client.await_result(job_id, timeout=30)
    row = job_row(sql_conn, job_id)
    assert row["state"] == "succeeded" and row["attempt"] == 2
    assert "timeout: ran longer than 1s" in str(row["errors"])
    assert result != first  # the second attempt ran in the replacement
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)


def test_a_cancel_kills_the_running_child(real_client: belay.Belay,
                                          sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.block", {}).id
    with pool(real_client, processes=1):
        wait_until(lambda: real_client.events(job_id), "the job to start", 20)
        child = real_client.events(job_id)[0].payload["pid"]
        real_client.cancel_job(job_id)
        row = finished(sql_conn, job_id)
        wait_until(lambda: not _alive(child), "the child to be killed", 10)
    assert row["state"] == "cancelled"


def test_a_child_killed_mid_job_fails_that_attempt(
        real_client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.die", {}).id
    worker = pool(real_client, processes=1)
    ends = Ends()
    worker.on_job_end(ends)
    with worker:
        row = finished(sql_conn, job_id)
        ends.wait_for(2)
    assert row["state"] == "succeeded" and row["attempt"] == 2
    assert "ProcessDied" in str(row["errors"]) and "SIGKILL" in str(row["errors"])
    # The worker's hooks hear of process-run jobs too (metrics count them).
    assert [(e.job.attempt, e.outcome) for e in ends.events] == [(1, "retry"), (2, "succeeded")]


def test_a_job_running_when_the_pool_stops_goes_back_uncounted(
        real_client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    """Past the shutdown grace the pool stops its child: not the job's doing,
    so no attempt used and no executor loss recorded (belay.parts.handbacks
    counts only executors lost while the worker runs)."""
    job_id = real_client.enqueue("pool.block", {}).id
    with pool(real_client, processes=1) as worker:
        wait_until(lambda: real_client.events(job_id), "the job to start", 20)
        worker.stop(grace=0.1)
    row = job_row(sql_conn, job_id)
    assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])


def test_a_parked_job_resumes_in_a_child(real_client: belay.Belay,
                                         sql_conn: psycopg.Connection[Any]) -> None:
    job_id = real_client.enqueue("pool.await", {}).id
    with pool(real_client, processes=1):
        wait_until(lambda: job_row(sql_conn, job_id)["state"] == "awaiting", "the park", 20)
        real_client.signal_job(job_id, "go", {"ok": True})
        row = finished(sql_conn, job_id)
    assert row["state"] == "succeeded"
    assert belay.codec.loads(row["result"])["got"] == {"ok": True}


def test_max_tasks_per_child_recycles(real_client: belay.Belay,
                                      sql_conn: psycopg.Connection[Any]) -> None:
    ids = [real_client.enqueue("pool.pid", {"n": n}).id for n in range(4)]
    with pool(real_client, processes=1, max_tasks_per_child=1):
        pids = [real_client.await_result(i, timeout=30)["pid"] for i in ids]
    assert len(set(pids)) == 4


def test_max_memory_per_child_recycles(real_client: belay.Belay,
                                       sql_conn: psycopg.Connection[Any]) -> None:
    """Under the limit a child stays; the job that takes it over the limit is
    the child's last."""
    first = [real_client.enqueue("pool.pid", {"n": n}).id for n in range(2)]
    hog = real_client.enqueue("pool.hog", {"mb": 300}).id
    after = real_client.enqueue("pool.pid", {"n": 2}).id
    with pool(real_client, processes=1, max_memory_per_child=200):
        pids = [real_client.await_result(i, timeout=30)["pid"] for i in first]
        hog_pid = real_client.await_result(hog, timeout=30)
        last = real_client.await_result(after, timeout=30)["pid"]
    assert pids[0] == pids[1] == hog_pid  # well under 200 MiB: the same child
    assert last != hog_pid  # 300 MiB more: replaced after that job


def test_children_that_cannot_start_crash_the_worker(
        real_client: belay.Belay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "")
    worker = pool(real_client, processes=1)
    assert worker.processes is not None
    # The child imports a module that doesn't exist there.
    monkeypatch.setattr(worker.processes, "_settings", _broken(worker.processes._settings))
    crashed: list[str] = []
    worker.on_crash(lambda service, exc: crashed.append(str(exc)))
    worker.start()
    try:
        wait_until(lambda: crashed, "the pool to give up", 60)
    finally:
        worker.stop()
    assert "exited before they connected" in crashed[0]


def _broken(settings: Any) -> Any:
    def broken(runtime_id: str) -> Any:
        good = settings(runtime_id)
        return type(good)(**{**good.__dict__, "modules": ["tests.no_such_module"]})
    return broken


def test_functions_defined_interactively_are_refused(real_client: belay.Belay,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    registry = belay.Registry()

    def job(ctx: belay.Context) -> None:
        return None

    job.__module__ = "__main__"
    belay.worker(name="repl.job", registry=registry)(job)
    monkeypatch.delattr(__import__("__main__"), "__file__", raising=False)
    with pytest.raises(ConfigurationError, match="define it in a module"):
        Worker({Q: 1}, client=real_client, registry=registry, processes=1)


def test_settings_are_checked(real_client: belay.Belay) -> None:
    with pytest.raises(ConfigurationError, match="processes must be a whole number"):
        Worker({Q: 1}, client=real_client, registry=pool_jobs.REGISTRY, processes=0)
    with pytest.raises(ConfigurationError, match="pass processes=N too"):
        Worker({Q: 1}, client=real_client, registry=pool_jobs.REGISTRY, max_tasks_per_child=5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True



SCRIPT = '''
import os, sys
import belay

@belay.worker(name="script.pid")
def pid(ctx):
    return os.getpid()

if __name__ == "__main__":
    client = belay.Belay(sys.argv[1])
    job = client.enqueue(pid)
    with belay.Worker({"default": 1}, client=client, processes=1, shutdown_grace=1):
        ran_in = client.await_result(job.id, timeout=30)
    print(ran_in != os.getpid())
'''


def test_functions_of_the_main_script_run_in_children(db_url: str, tmp_path: Any) -> None:
    """A worker function defined in the script being run: each child runs the
    script again as ``__mp_main__`` (its ``__main__`` block doesn't run)."""
    script = tmp_path / "jobs_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), db_url], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
