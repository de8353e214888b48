"""The Node.js socket executor (examples/node_worker/socket_executor.js).

Real processes: ``belay worker --executor-socket`` (``python -m belay worker``, no
Python task modules) and ``node socket_executor.js`` subprocesses on a real Unix
socket and a real database; jobs enqueued with the Python client. The executor's
frame codec is also checked against belay's own (belay.protocol), and its frames
against a fake server. Skipped when ``node`` is missing, unless ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay import protocol
from belay.errors import JobFailed
from tests.helpers import Proc, job_row, wait_until

EXECUTOR = (Path(__file__).resolve().parent.parent / "examples" / "node_worker"
            / "socket_executor.js")
NODE = shutil.which("node")
TASKS = ["node.add", "node.block", "node.echo", "node.fail", "node.slow"]
#: Retries 50 ms apart instead of belay's default backoff (2 s and more).
FAST_RETRY = {"$backoff": {"type": "exponential", "base_ms": 50, "max_ms": 50}}

if NODE is None:
    if os.environ.get("CI"):
        pytest.fail("node is not installed; CI runs the Node.js socket executor example: "
                    "install Node 18+", pytrace=False)
    pytest.skip("node is not installed (Node 18+ runs examples/node_worker)",
                allow_module_level=True)


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A socket path of this test's own, short enough for AF_UNIX (tmp_path may not be)."""
    directory = tempfile.mkdtemp(prefix="bs-", dir="/tmp")
    try:
        yield Path(directory) / "belay.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def worker(db_url: str, sock_path: Path) -> Iterator[Proc]:
    """``belay worker`` serving executors only, renewing leases every 0.5 s."""
    proc = Proc("worker", [sys.executable, "-m", "belay", "worker", "--url", db_url,
                           "--executor-socket", str(sock_path), "--lease-ttl", "1.5",
                           "--poll-interval", "0.1", "--busy-poll", "0.01",
                           "--shutdown-grace", "2"])
    try:
        proc.wait_for(r"executors served on ")
        yield proc
    finally:
        proc.stop(signal.SIGTERM)


def start_executor(path: Path, name: str, *, max_concurrency: int = 4, wait: bool = True,
                   **env: str) -> Proc:
    """``node socket_executor.js PATH``; by default, once it registered its tasks."""
    assert NODE is not None
    environ = {k: v for k, v in os.environ.items()
               if k not in ("BELAY_SOCKET_PATH", "BELAY_BLOCK_RETURNS", "BELAY_RUNTIME_ID",
                            "BELAY_MAX_CONCURRENCY", "BELAY_SHUTDOWN_GRACE_MS")}
    proc = Proc(name, [NODE, str(EXECUTOR), str(path), "--max-concurrency",
                       str(max_concurrency)], env={**environ, **env})
    if wait:
        proc.wait_for(r"^registered tasks " + re.escape(",".join(TASKS)) + "$")
    return proc


# -- Against belay worker ----------------------------------------------------------------------


def test_jobs_run_in_node_and_their_results_and_failures_are_stored(
        worker: Proc, sock_path: Path, real_client: belay.Belay,
        sql_conn: psycopg.Connection[Any]) -> None:
    executor = start_executor(sock_path, "node")
    try:
        executor.wait_for(r"^connected to .+ as socket:node-\d+/\w+ \(max_concurrency 4\)$")
        echo = real_client.enqueue("node.echo", {"x": [1, "two"], "ü": {"nested": None}})
        add = real_client.enqueue("node.add", {"a": 2, "b": 40})
        fail = real_client.enqueue("node.fail", {"message": "boom from js"}, max_attempts=2,
                                   meta=FAST_RETRY)
        bad = real_client.enqueue("node.add", {"a": "2"}, max_attempts=1)
        assert real_client.await_result(echo.id, timeout=20) == \
            {"x": [1, "two"], "ü": {"nested": None}}
        assert real_client.await_result(add.id, timeout=20) == 42
        with pytest.raises(JobFailed) as failed:
            real_client.await_result(fail.id, timeout=20)  # two attempts
        job = failed.value.job
        assert (job.state, job.attempt) == ("failed", 2)
        assert [(e["error"], e["attempt"]) for e in job.errors] == \
            [("Error: boom from js", 1), ("Error: boom from js", 2)]
        assert "socket_executor.js" in job.errors[-1]["traceback"]  # the JS stack, as sent
        with pytest.raises(JobFailed) as refused:
            real_client.await_result(bad.id, timeout=20)
        assert refused.value.job.errors[0]["error"] == \
            'TypeError: node.add needs numbers a and b, got {"a":"2"}'
        row = job_row(sql_conn, add.id)
        assert (row["state"], row["attempt"], row["leased_by"]) == ("succeeded", 1, None)
        executor.wait_for(rf"^ran job {fail.id} task node.fail attempt 2 -> failed: "
                          r"Error: boom from js$")
        assert executor.stop(signal.SIGTERM) == 0
        assert executor.lines[-2:] == ["SIGTERM: no more jobs; finishing 0 running", "stopped"]
    finally:
        executor.stop()


def test_a_node_executor_killed_mid_job_gives_it_back_without_using_an_attempt(
        worker: Proc, sock_path: Path, real_client: belay.Belay,
        sql_conn: psycopg.Connection[Any]) -> None:
    # One attempt only: had the kill used it, the job would be failed, not run again.
    job = real_client.enqueue("node.block", {"n": 1}, max_attempts=1)
    first = start_executor(sock_path, "node-a")
    second: Proc | None = None
    try:
        first.wait_for(rf"^blocking job {job.id}$")
        row = job_row(sql_conn, job.id)
        assert (row["state"], row["attempt"]) == ("running", 1)
        os.kill(first.popen.pid, signal.SIGKILL)  # no report, no goodbye: the socket closes
        assert first.popen.wait(10) == -signal.SIGKILL
        wait_until(lambda: job_row(sql_conn, job.id)["state"] == "ready",
                   "the worker gave the job back", timeout=10)
        row = job_row(sql_conn, job.id)
        assert (row["attempt"], row["leased_by"]) == (0, None)
        # Recorded, and counted (belay.parts.handbacks): the third loss would use it.
        (lost,) = row["errors"]
        assert (lost["error"], lost["attempt"]) == ("executor_lost", 1), lost
        second = start_executor(sock_path, "node-b", BELAY_BLOCK_RETURNS="1")
        assert real_client.await_result(job.id, timeout=20) == \
            {"blocked": False, "job_id": job.id}
        row = job_row(sql_conn, job.id)
        assert (row["state"], row["attempt"], row["errors"]) == ("succeeded", 1, [lost])
        second.wait_for(rf"^ran job {job.id} task node.block attempt 1 -> ok$")
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_cancelling_a_running_job_aborts_it_in_node(
        worker: Proc, sock_path: Path, real_client: belay.Belay,
        sql_conn: psycopg.Connection[Any]) -> None:
    executor = start_executor(sock_path, "node", max_concurrency=2)
    try:
        doomed = real_client.enqueue("node.block")
        kept = real_client.enqueue("node.block")
        executor.wait_for(rf"^blocking job {doomed.id}$")
        executor.wait_for(rf"^blocking job {kept.id}$")  # both at once
        assert real_client.cancel_job(doomed.id) == "requested"  # it still runs
        # The worker's next lease renewal (every 0.5 s) sees the request, cancels the
        # job, then sends cancel_execution: the handler's AbortSignal fires.
        executor.wait_for(rf"^aborted job {doomed.id} task node.block attempt 1 "
                          r"\(cancel_requested\)$", timeout=10)
        row = job_row(sql_conn, doomed.id)
        assert (row["state"], row["result"]) == ("cancelled", None)
        assert job_row(sql_conn, kept.id)["state"] == "running"
        # The cancelled execution's slot is free again: a job runs beside the kept one.
        echo = real_client.enqueue("node.echo", {"after": "cancel"})
        assert real_client.await_result(echo.id, timeout=10) == {"after": "cancel"}
        assert job_row(sql_conn, kept.id)["state"] == "running"
        assert real_client.cancel_job(kept.id) == "requested"
        executor.wait_for(rf"^aborted job {kept.id} task node.block attempt 1 "
                          r"\(cancel_requested\)$", timeout=10)
        assert job_row(sql_conn, kept.id)["state"] == "cancelled"
        assert executor.stop(signal.SIGTERM) == 0
        # Its failure reports after the aborts were refused as stale, as expected.
        assert not [line for line in executor.lines
                    if "took the failure report" in line or "reporting it failed" in line]
    finally:
        executor.stop()


def test_sigterm_lets_running_jobs_finish_and_gives_the_rest_back(
        worker: Proc, sock_path: Path, real_client: belay.Belay,
        sql_conn: psycopg.Connection[Any]) -> None:
    executor = start_executor(sock_path, "node", BELAY_SHUTDOWN_GRACE_MS="3000")
    try:
        slow = real_client.enqueue("node.slow", {"ms": 300})
        block = real_client.enqueue("node.block", max_attempts=1)
        executor.wait_for(rf"^started job {slow.id} task node.slow attempt 1$")
        executor.wait_for(rf"^blocking job {block.id}$")
        assert executor.stop(signal.SIGTERM) == 0
        assert executor.lines[-1] == "stopped"
        assert f"ran job {slow.id} task node.slow attempt 1 -> ok" in executor.lines
        assert f"abandoned job {block.id} task node.block attempt 1 (shutting down)" \
            in executor.lines
        assert real_client.await_result(slow.id, timeout=10) == {"slept_ms": 300}
        # Not reported: the closed connection gives it back without using its one attempt.
        wait_until(lambda: job_row(sql_conn, block.id)["state"] == "ready",
                   "the worker gave the job back", timeout=10)
        assert job_row(sql_conn, block.id)["attempt"] == 0
    finally:
        executor.stop()


# -- The frames -------------------------------------------------------------------------------

CODEC = r"""
const ex = require(process.argv[1]);
const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const stream = Buffer.from(input.stream, 'hex');
const read = (chunks) => {
  const reader = new ex.FrameReader();
  const messages = [];
  for (const chunk of chunks) messages.push(...reader.push(chunk));
  return { messages, pending: reader.size };
};
const out = { whole: read([stream]), bytes: read([...stream].map((b) => Buffer.from([b]))) };
out.splits = [];
for (let i = 1; i < stream.length; i++) {
  out.splits.push(read([stream.subarray(0, i), stream.subarray(i)]));
}
out.broken = input.broken.map((hex) => {
  try {
    return read([Buffer.from(hex, 'hex')]);
  } catch (err) {
    return `${err.name}: ${err.message}`;
  }
});
out.encoded = ex.encode(input.message).toString('hex');
console.log(JSON.stringify(out));
"""


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def test_the_node_frame_reader_cuts_belays_frames_at_any_chunk_boundary() -> None:
    assert NODE is not None
    messages = [
        protocol.message("ok", "r-1", tasks=["a"]),
        protocol.message("execute", "e-2", args={"s": "ü€😀", "n": [1.5, None, True]}),
        protocol.message("cancel_execution", "c-3", execution_id="e-2", reason="timeout"),
    ]
    stream = b"".join(protocol.encode(m) for m in messages)
    broken = [
        struct.pack(">I", protocol.MAX_FRAME_BYTES + 1),  # refused from its length alone
        struct.pack(">I", 0),
        frame(b"\xff{}"),  # not UTF-8
        frame(b'{"version":2,"type":"ok","request_id":"r-1"}'),
        struct.pack(">I", protocol.MAX_FRAME_BYTES),  # the largest frame: its payload waits
    ]
    node_message = {"version": 1, "type": "succeeded", "request_id": "s-1",
                    "result": {"ü": [1, 2.5, None]}}
    done = subprocess.run(
        [NODE, "-e", CODEC, str(EXECUTOR)], capture_output=True, text=True, timeout=60,
        input=json.dumps({"stream": stream.hex(), "broken": [b.hex() for b in broken],
                          "message": node_message}))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    whole = {"messages": messages, "pending": 0}
    assert out["whole"] == whole
    assert out["bytes"] == whole
    assert len(out["splits"]) == len(stream) - 1
    assert all(split == whole for split in out["splits"])
    assert out["broken"][0] == f"ProtocolError: a frame of {protocol.MAX_FRAME_BYTES + 1} " \
                               f"bytes; at most {protocol.MAX_FRAME_BYTES} are allowed"
    assert out["broken"][1] == "ProtocolError: an empty frame"
    assert out["broken"][2].startswith("ProtocolError: the frame is not UTF-8 JSON")
    assert out["broken"][3] == "ProtocolError: version must be 1, got 2"
    assert out["broken"][4] == {"messages": [], "pending": 4}
    # And what node encodes, belay reads.
    assert list(protocol.FrameReader().feed(bytes.fromhex(out["encoded"]))) == [node_message]


class FakeServer:
    """One accepted connection, as belay's server end: frames in and out."""

    def __init__(self, listener: socket.socket) -> None:
        self.sock, _ = listener.accept()
        self.sock.settimeout(20)
        self.reader = protocol.FrameReader()
        self.inbox: list[dict[str, Any]] = []

    def next(self, kind: str) -> dict[str, Any]:
        while True:
            for index, message in enumerate(self.inbox):
                if message["type"] == kind:
                    return self.inbox.pop(index)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the executor closed the connection")
            self.inbox.extend(self.reader.feed(data))

    def send(self, *messages: dict[str, Any]) -> None:
        self.sock.sendall(b"".join(protocol.encode(m) for m in messages))

    def eof(self) -> bool:
        """True once the executor closed its end (whatever it sent before is dropped)."""
        while True:
            data = self.sock.recv(65536)
            if not data:
                return True

    def close(self) -> None:
        self.sock.close()


def test_node_speaks_the_protocol_frame_by_frame_and_refuses_a_frame_too_large(
        sock_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen()
    listener.settimeout(20)
    executor = start_executor(sock_path, "node", max_concurrency=3, wait=False,
                              BELAY_RUNTIME_ID="fake-test")
    try:
        server = FakeServer(listener)
        hello = server.next("hello")
        assert hello == {"version": 1, "type": "hello", "request_id": hello["request_id"],
                         "mode": "worker", "runtime_id": "fake-test", "max_concurrency": 3}
        server.send(protocol.message("hello_ok", hello["request_id"], node_id="socket:x/1"))
        register = server.next("register_tasks")
        assert sorted(register["tasks"]) == TASKS
        ids = [{"execution_id": f"{n}.1.x", "reservation_id": f"res-{n}"} for n in (7, 8)]
        # The ok and two executes in one chunk.
        server.send(
            protocol.message("ok", register["request_id"], tasks=TASKS),
            protocol.message("execute", "7.1.x", **ids[0], job_id=7, task="node.echo",
                             args={"v": "ü"}, attempt=1, max_attempts=3, timeout_ms=None,
                             queue="default", lease_ttl_ms=1500),
            protocol.message("execute", "8.1.x", **ids[1], job_id=8, task="node.fail",
                             args={"message": "no"}, attempt=2, max_attempts=3,
                             timeout_ms=5000, queue="default", lease_ttl_ms=1500))
        started = [server.next("started"), server.next("started")]
        assert sorted((m["execution_id"], m["reservation_id"]) for m in started) == \
            [(i["execution_id"], i["reservation_id"]) for i in ids]
        server.send(*(protocol.message("ok", m["request_id"]) for m in started))
        succeeded = server.next("succeeded")
        assert succeeded == {"version": 1, "type": "succeeded",
                             "request_id": succeeded["request_id"], **ids[0],
                             "result": {"v": "ü"}}
        failed = server.next("failed")
        assert {k: failed[k] for k in ("execution_id", "reservation_id")} == ids[1]
        assert {k: failed["error"][k] for k in ("message", "type")} == \
            {"message": "no", "type": "Error"}
        assert "socket_executor.js" in failed["error"]["traceback"]
        server.send(protocol.message("ok", succeeded["request_id"], state="succeeded"),
                    protocol.message("ok", failed["request_id"], state="ready"))
        executor.wait_for(r"^ran job 8 task node.fail attempt 2 -> failed: Error: no$")
        # A frame over 1 MiB: refused from its length, the connection closed...
        server.sock.sendall(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
        assert server.eof()
        server.close()
        executor.wait_for(r"^the worker sent a broken frame \(a frame of 1048577 bytes; at "
                          r"most 1048576 are allowed\); closing the connection$")
        # ...and it connects again.
        again = FakeServer(listener)
        assert again.next("hello")["runtime_id"] == "fake-test"
        again.close()
    finally:
        executor.stop()
        listener.close()
