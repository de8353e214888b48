"""The Node.js example worker (examples/node_worker) against a real ``belay serve``.

Real processes: the server (``python -m belay serve``) and ``node worker.js``
subprocesses, a real database; jobs enqueued with the Python client and over
``POST /jobs``. Skipped when ``node`` is missing, unless ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay.errors import JobFailed
from tests.helpers import Proc, job_row

WORKER = Path(__file__).resolve().parent.parent / "examples" / "node_worker" / "worker.js"
NODE = shutil.which("node")

if NODE is None:
    if os.environ.get("CI"):
        pytest.fail("node is not installed; CI runs the Node.js worker example: install Node 18+",
                    pytrace=False)
    pytest.skip("node is not installed (Node 18+ runs examples/node_worker)",
                allow_module_level=True)


@pytest.fixture
def server(db_url: str) -> Iterator[str]:
    """``belay serve`` on a free port with short session and lease TTLs; its base URL."""
    proc = Proc("server", [sys.executable, "-m", "belay", "serve", "--url", db_url,
                           "--port", "0", "--session-ttl", "2", "--lease-ttl", "2"])
    try:
        match = proc.wait_for(r"serving (http://\S+?)/? ")
        yield match.group(1)
    finally:
        proc.stop(signal.SIGTERM)


def start_worker(base: str, name: str) -> Proc:
    assert NODE is not None
    env = {**os.environ, "BELAY_HTTP_URL": base, "BELAY_QUEUE": "default",
           "BELAY_CAPACITY": "4"}
    env.pop("BELAY_TOKEN", None)
    return Proc(name, [NODE, str(WORKER)], env=env)


def post_job(base: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{base}/jobs", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 201
        result: dict[str, Any] = json.loads(response.read())
    return result


def test_node_worker_runs_jobs_from_both_producers(server: str,
                                                  real_client: belay.Belay) -> None:
    echo = real_client.enqueue("node.echo", {"x": [1, "two"]}, max_attempts=2)
    add = real_client.enqueue("node.add", {"a": 2, "b": 40}, max_attempts=2)
    fail = real_client.enqueue("node.fail", {"message": "boom from js"}, max_attempts=2)
    over_http = post_job(server, {"task": "node.echo", "args": {"via": "http"}})
    worker = start_worker(server, "worker")
    try:
        worker.wait_for(r"^registered runtime node-\d+ queue default")
        assert real_client.await_result(echo.id, timeout=20) == {"x": [1, "two"]}
        assert real_client.await_result(add.id, timeout=20) == 42
        assert real_client.await_result(over_http["id"], timeout=20) == {"via": "http"}
        with pytest.raises(JobFailed) as failed:
            real_client.await_result(fail.id, timeout=30)  # two attempts, backoff between
        job = failed.value.job
        assert (job.state, job.attempt) == ("failed", 2)
        assert [e["error"] for e in job.errors] == ["Error: boom from js"] * 2
        assert "worker.js" in job.errors[-1]["traceback"]  # the JS stack, as sent
        worker.wait_for(rf"^ran job {fail.id} task node.fail attempt 2 -> failed: "
                        r"Error: boom from js$")
        assert worker.stop(signal.SIGTERM) == 0
        assert worker.lines[-1] == "stopped"
    finally:
        worker.stop()


def test_killed_node_worker_job_is_reclaimed_and_finished_by_another(
        server: str, real_client: belay.Belay, sql_conn: psycopg.Connection[Any]) -> None:
    slow = real_client.enqueue("node.slow", {"ms": 60000, "fast_after_attempt": 1},
                               max_attempts=2)
    first = start_worker(server, "worker-a")
    second: Proc | None = None
    try:
        first.wait_for(rf"^started job {slow.id} task node.slow attempt 1$")
        assert job_row(sql_conn, slow.id)["state"] == "running"
        first.stop(signal.SIGKILL)  # no completion, no DELETE /workers: the session just ends
        second = start_worker(server, "worker-b")
        # Session expiry (2 s) → lease lapse (2 s) → the server's reclaim sweep → backoff.
        assert real_client.await_result(slow.id, timeout=40) == {"slept_ms": 0}
        row = job_row(sql_conn, slow.id)
        assert (row["state"], row["attempt"]) == ("succeeded", 2)
        second.wait_for(rf"^ran job {slow.id} task node.slow attempt 2 -> ok$")
        assert not any(f"job {slow.id}" in line for line in second.lines
                       if "attempt 1" in line)
    finally:
        first.stop()
        if second is not None:
            second.stop()
