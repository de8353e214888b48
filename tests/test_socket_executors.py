"""Executors on the socket (belay.parts.sockets): Executor Protocol v1 against a
real PostgreSQL, with real Unix-domain sockets."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import belay
from belay import protocol
from belay.clock import ManualClock
from belay.parts import sockets
from belay.parts.sockets import ExecutorServer
from tests.helpers import job_row, wait_until


class Executor:
    """A test executor: one connection, frames in and out, blocking reads."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(10)
        self.reader = protocol.FrameReader()
        self.inbox: list[dict[str, Any]] = []
        self.ids = 0

    def send(self, kind: str, **fields: Any) -> str:
        self.ids += 1
        request_id = f"{kind}-{self.ids}"
        self.sock.sendall(protocol.encode(protocol.message(kind, request_id, **fields)))
        return request_id

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next(self, kind: str | None = None) -> dict[str, Any]:
        """The next message (of ``kind``, keeping the others for later)."""
        while True:
            for index, message in enumerate(self.inbox):
                if kind is None or message["type"] == kind:
                    return self.inbox.pop(index)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.inbox.extend(self.reader.feed(data))

    def reply_to(self, request_id: str) -> dict[str, Any]:
        while True:
            for index, message in enumerate(self.inbox):
                if message["request_id"] == request_id:
                    return self.inbox.pop(index)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.inbox.extend(self.reader.feed(data))

    def closed(self) -> bool:
        """True once the server closed its end."""
        try:
            return self.sock.recv(65536) == b""
        except OSError:
            return True

    def hello(self, capacity: int = 1, tasks: tuple[str, ...] = ("sock.t",)) -> None:
        reply = self.reply_to(self.send("hello", mode="worker", runtime_id="test-exec",
                                        max_concurrency=capacity))
        assert reply["type"] == "hello_ok"
        assert reply["node_id"].startswith("socket:test-exec/")
        registered = self.reply_to(self.send("register_tasks", tasks=list(tasks)))
        assert registered == {"version": 1, "type": "ok",
                              "request_id": registered["request_id"], "tasks": sorted(tasks)}

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def connected(path: Path) -> Iterator[Executor]:
    executor = Executor(path)
    try:
        yield executor
    finally:
        executor.close()


@pytest.fixture
def server(client: belay.Belay, clock: ManualClock, tmp_path: Path) -> Iterator[ExecutorServer]:
    with ExecutorServer(client, ["default"], path=tmp_path / "belay.sock") as instance:
        yield instance


@pytest.fixture
def executor(server: ExecutorServer) -> Iterator[Executor]:
    instance = Executor(server.path)
    try:
        yield instance
    finally:
        instance.close()


def test_an_executor_runs_a_job_and_its_result_is_stored(
        client: belay.Belay, server: ExecutorServer, executor: Executor) -> None:
    executor.hello()
    job = client.enqueue("sock.t", {"n": 21})
    event = executor.next("execute")
    assert (event["job_id"], event["task"], event["args"], event["attempt"]) == \
        (job.id, "sock.t", {"n": 21}, 1)
    ids = {"execution_id": event["execution_id"], "reservation_id": event["reservation_id"]}
    assert executor.reply_to(executor.send("started", **ids))["type"] == "ok"
    done = executor.reply_to(executor.send("succeeded", result={"n": 42}, **ids))
    assert (done["type"], done["state"], done["job_id"]) == ("ok", "succeeded", job.id)
    assert client.get_job(job.id).result == {"n": 42}
    # Reported twice: the second is stale, and nothing changes.
    again = executor.reply_to(executor.send("succeeded", result={"n": 0}, **ids))
    assert again["error"]["code"] == "stale_execution"
    assert client.get_job(job.id).result == {"n": 42}


def test_a_failure_is_retried_with_the_executors_error(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello()
    job = client.enqueue("sock.t")
    event = executor.next("execute")
    ids = {"execution_id": event["execution_id"], "reservation_id": event["reservation_id"]}
    refused = executor.reply_to(executor.send("failed", error={"oops": 1}, **ids))
    assert refused["error"]["code"] == "invalid_request"
    assert "error object like" in refused["error"]["message"]
    reply = executor.reply_to(executor.send(
        "failed", error={"message": "card declined", "type": "PaymentError"}, **ids))
    assert (reply["type"], reply["state"]) == ("ok", "ready")
    row = job_row(sql_conn, job.id)
    assert row["errors"][0]["error"] == "PaymentError: card declined"


def test_ids_must_match_to_complete(client: belay.Belay, server: ExecutorServer,
                                    executor: Executor) -> None:
    executor.hello()
    job = client.enqueue("sock.t")
    event = executor.next("execute")
    wrong = executor.reply_to(executor.send(
        "succeeded", execution_id=event["execution_id"], reservation_id="not-it", result=1))
    assert wrong["error"]["code"] == "stale_execution"
    assert client.get_job(job.id).state == "running"


def test_capacity_bounds_what_one_connection_holds(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello(capacity=2)
    jobs = [client.enqueue("sock.t", {"i": i}) for i in range(3)]
    first, second = executor.next("execute"), executor.next("execute")
    wait_until(lambda: [job_row(sql_conn, j.id)["state"] for j in jobs].count("running") == 2,
               "two jobs claimed")
    assert job_row(sql_conn, jobs[2].id)["state"] == "ready"
    executor.reply_to(executor.send("succeeded", result=None,
                                    execution_id=first["execution_id"],
                                    reservation_id=first["reservation_id"]))
    third = executor.next("execute")
    assert {first["job_id"], second["job_id"], third["job_id"]} == {j.id for j in jobs}


def test_only_registered_tasks_are_sent(client: belay.Belay, server: ExecutorServer,
                                        executor: Executor, sql_conn: Any) -> None:
    executor.hello(tasks=("sock.a",))
    other = client.enqueue("sock.b")
    mine = client.enqueue("sock.a")
    assert executor.next("execute")["job_id"] == mine.id
    reply = executor.reply_to(executor.send("unregister_tasks", tasks=["sock.a"]))
    assert reply["tasks"] == []
    assert job_row(sql_conn, other.id)["state"] == "ready"


def test_a_disconnect_gives_the_job_back_without_using_an_attempt(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello()
    job = client.enqueue("sock.t")
    executor.next("execute")
    assert job_row(sql_conn, job.id)["attempt"] == 1
    executor.close()
    wait_until(lambda: job_row(sql_conn, job.id)["state"] == "ready", "the job given back")
    assert job_row(sql_conn, job.id)["attempt"] == 0
    # Another executor picks it up as a first attempt.
    again = Executor(server.path)
    try:
        again.hello()
        event = again.next("execute")
        assert (event["job_id"], event["attempt"]) == (job.id, 1)
    finally:
        again.close()


def test_an_executor_killed_mid_job_gives_it_back_to_another(
        client: belay.Belay, server: ExecutorServer, sql_conn: Any) -> None:
    import signal
    import subprocess
    import sys

    job = client.enqueue("sock.t", {"n": 7})
    doomed = subprocess.Popen([sys.executable, "-m", "tests.socket_executor_proc",
                               str(server.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout is not None
        assert int(doomed.stdout.readline()) == job.id  # it holds the job, mid-run
        assert job_row(sql_conn, job.id)["state"] == "running"
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
        doomed.communicate()
    survivor = Executor(server.path)
    try:
        survivor.hello()
        event = survivor.next("execute")
        assert (event["job_id"], event["attempt"]) == (job.id, 1)  # no attempt used
        done = survivor.reply_to(survivor.send(
            "succeeded", result=event["args"]["n"] * 6, execution_id=event["execution_id"],
            reservation_id=event["reservation_id"]))
        assert done["state"] == "succeeded"
    finally:
        survivor.close()
    assert client.get_job(job.id).result == 42


def test_a_broken_frame_closes_only_its_connection(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello()
    bystander = Executor(server.path)
    try:
        bystander.hello()
        held = client.enqueue("sock.t")
        # Whichever of the two holds the job: the broken one gives it back.
        executor.raw(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
        assert executor.closed()
        event = bystander.next("execute")
        assert event["job_id"] == held.id
        done = bystander.reply_to(bystander.send(
            "succeeded", result="ok", execution_id=event["execution_id"],
            reservation_id=event["reservation_id"]))
        assert done["state"] == "succeeded"
    finally:
        bystander.close()


def test_past_its_timeout_the_attempt_fails_and_the_executor_is_told(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello()
    job = client.enqueue("sock.t", meta={"$timeout_ms": 200})
    event = executor.next("execute")
    assert event["timeout_ms"] == 200
    cancel = executor.next("cancel_execution")
    assert (cancel["execution_id"], cancel["job_id"], cancel["reason"]) == \
        (event["execution_id"], job.id, "timeout")
    row = job_row(sql_conn, job.id)
    assert row["state"] == "ready"
    assert row["errors"][0]["error"] == "timeout: ran longer than 0.2s"
    late = executor.reply_to(executor.send(
        "succeeded", result=1, execution_id=event["execution_id"],
        reservation_id=event["reservation_id"]))
    assert late["error"]["code"] == "stale_execution"
    assert "timeout" in late["error"]["message"]


def test_an_operators_cancel_ends_the_job_and_the_executor_is_told(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    executor.hello()
    job = client.enqueue("sock.t")
    event = executor.next("execute")
    server.leases.renew()  # no cancel requested: nothing is sent
    assert job_row(sql_conn, job.id)["state"] == "running"
    assert client.cancel_job(job.id) == "requested"  # the job still runs
    server.leases.renew()
    cancel = executor.next("cancel_execution")
    assert (cancel["execution_id"], cancel["job_id"], cancel["reason"]) == \
        (event["execution_id"], job.id, "cancel_requested")
    row = job_row(sql_conn, job.id)
    assert row["state"] == "cancelled"
    late = executor.reply_to(executor.send(
        "succeeded", result=1, execution_id=event["execution_id"],
        reservation_id=event["reservation_id"]))
    assert late["error"]["code"] == "stale_execution"
    assert job_row(sql_conn, job.id)["result"] is None
    server.leases.renew()  # told once
    executor.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        executor.next("cancel_execution")


def test_an_execution_ended_here_frees_its_slot_without_a_report(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    """An executor that just stops after cancel_execution (as told) gets new
    work: the ended execution no longer holds its slot."""
    executor.hello(capacity=1)
    timed = client.enqueue("sock.t", meta={"$timeout_ms": 200})
    first = executor.next("execute")
    assert executor.next("cancel_execution")["job_id"] == timed.id
    cancelled = client.enqueue("sock.t")
    second = executor.next("execute")
    assert second["job_id"] == cancelled.id
    client.cancel_job(cancelled.id)
    server.leases.renew()
    assert executor.next("cancel_execution")["job_id"] == cancelled.id
    third = client.enqueue("sock.t")
    assert executor.next("execute")["job_id"] == third.id
    # A late report of an ended execution is still answered stale.
    late = executor.reply_to(executor.send(
        "succeeded", result=1, execution_id=first["execution_id"],
        reservation_id=first["reservation_id"]))
    assert late["error"]["code"] == "stale_execution"


def test_a_concluded_report_is_read_strictly(
        client: belay.Belay, server: ExecutorServer, executor: Executor,
        sql_conn: Any) -> None:
    """``concluded`` (belay's own report, from its process pool) carries an
    outcome or a park; anything else is refused and nothing is written."""
    executor.hello()
    job = client.enqueue("sock.t")
    event = executor.next("execute")
    ids = {"execution_id": event["execution_id"], "reservation_id": event["reservation_id"]}
    for bad in ({}, {"outcome": {"kind": "exploded"}},
                {"outcome": {"kind": "succeeded", "result_json": "{nope"}},
                {"outcome": {"kind": "retry", "at": "tomorrow"}},
                {"outcome": {"kind": "retry", "at": "2026-01-01T00:00:00"}},
                {"outcome": {"kind": "failed", "error": ["x"]}},
                {"park": {"scope": "", "name": "go"}}):
        reply = executor.reply_to(executor.send("concluded", **ids, **bad))
        assert reply["error"]["code"] == "invalid_request", bad
        assert job_row(sql_conn, job.id)["state"] == "running"
    reply = executor.reply_to(executor.send(
        "concluded", **ids, outcome={"kind": "succeeded", "result_json": "[1, 2]"}))
    assert (reply["type"], reply["state"]) == ("ok", "succeeded")
    assert client.get_job(job.id).result == [1, 2]


@pytest.mark.parametrize(("first", "code"), [
    ({"type": "register_tasks", "tasks": ["x"]}, "invalid_request"),
    ({"type": "hello", "mode": "worker", "runtime_id": "r", "max_concurrency": 0},
     "invalid_request"),
    ({"type": "hello", "mode": "client", "runtime_id": "r", "max_concurrency": 0},
     "unsupported"),
])
def test_a_connection_must_start_with_an_executors_hello(
        server: ExecutorServer, first: dict[str, Any], code: str) -> None:
    executor = Executor(server.path)
    try:
        kind = first.pop("type")
        request_id = executor.send(kind, **first)
        reply = executor.reply_to(request_id)
        assert reply["error"]["code"] == code
        assert executor.closed()
    finally:
        executor.close()


def test_the_socket_is_private_and_removed_on_stop(
        client: belay.Belay, tmp_path: Path) -> None:
    path = tmp_path / "run" / "belay.sock"
    path.parent.mkdir(mode=0o700)
    server = ExecutorServer(client, ["default"], path=path)
    server.start()
    try:
        assert oct(path.lstat().st_mode & 0o777) == oct(0o600)
    finally:
        server.stop()
    assert not path.exists()


# -- Hostile and stuck peers ------------------------------------------------------------


def test_a_connection_that_never_says_hello_is_closed(
        client: belay.Belay, clock: ManualClock, tmp_path: Path) -> None:
    with ExecutorServer(client, ["default"], path=tmp_path / "belay.sock",
                        hello_timeout=0.3) as server, connected(server.path) as silent:
        assert silent.closed()  # blocks until the server gives up on it
        wait_until(lambda: server.connections() == 0, "the connection forgotten")


def test_an_executor_that_stops_reading_is_dropped_and_its_jobs_go_back(
        client: belay.Belay, clock: ManualClock, tmp_path: Path, sql_conn: Any) -> None:
    with ExecutorServer(client, ["default"], path=tmp_path / "belay.sock",
                        send_timeout=0.3) as server, connected(server.path) as stuck:
        stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.hello(capacity=500)  # then it never reads again
        big = "x" * 60_000
        jobs = client.enqueue_many([{"kind": "sock.t", "input": {"pad": big, "i": i}}
                                    for i in range(200)])
        wait_until(lambda: server.connections() == 0, "the stuck executor dropped", 30)
        # The rest of the dispatcher's batch goes back as it meets the closed connection.
        wait_until(lambda: {(job_row(sql_conn, j.id)["state"], job_row(sql_conn, j.id)[
            "attempt"]) for j in jobs} == {("ready", 0)}, "every job back, no attempt used",
            30)
        with connected(server.path) as healthy:
            healthy.hello(capacity=1)
            event = healthy.next("execute")
            assert event["job_id"] in {j.id for j in jobs}


def test_a_job_too_large_for_a_frame_fails_and_the_executor_stays(
        client: belay.Belay, clock: ManualClock, tmp_path: Path, sql_conn: Any) -> None:
    with ExecutorServer(client, ["default"], path=tmp_path / "belay.sock",
                        max_frame_bytes=4096) as server, connected(server.path) as executor:
        executor.hello()
        huge = client.enqueue("sock.t", {"pad": "x" * 10_000}, max_attempts=1)
        wait_until(lambda: job_row(sql_conn, huge.id)["state"] == "failed", "refused")
        assert "can't be sent to an executor" in job_row(sql_conn, huge.id)["errors"][0][
            "error"]
        small = client.enqueue("sock.t", {"n": 1})
        assert executor.next("execute")["job_id"] == small.id


def test_garbage_closes_only_the_connection_that_sent_it(
        client: belay.Belay, server: ExecutorServer, sql_conn: Any) -> None:
    rng = random.Random(21)
    payloads = [struct.pack(">I", rng.randrange(1, 200)) + rng.randbytes(rng.randrange(200))
                for _ in range(40)]
    payloads += [protocol.encode(protocol.message("hello", "h", mode="worker",
                                                  runtime_id="r", max_concurrency=1))
                 + rng.randbytes(rng.randrange(1, 300)) for _ in range(20)]
    payloads += [struct.pack(">I", 12) + b'{"version":2', b"\x00\x00\x00\x00",
                 struct.pack(">I", 2**32 - 1)]
    good = Executor(server.path)
    try:
        good.hello()
        for payload in payloads:
            bad = Executor(server.path)
            try:
                bad.raw(payload)
                bad.sock.shutdown(socket.SHUT_WR)  # and no more: the server must not hang
                while not bad.closed():
                    pass
            finally:
                bad.close()
        wait_until(lambda: server.connections() == 1, "only the good connection left")
        job = client.enqueue("sock.t")
        event = good.next("execute")
        assert event["job_id"] == job.id
    finally:
        good.close()


# -- In a worker ------------------------------------------------------------------------


def test_a_worker_runs_its_own_kinds_on_threads_and_the_rest_on_executors(
        client: belay.Belay, clock: ManualClock, tmp_path: Path, sql_conn: Any) -> None:
    reg = belay.Registry()
    belay.worker(name="sock.py", registry=reg)(lambda ctx: "thread")
    path = tmp_path / "belay.sock"
    worker = belay.Worker({"default": 2}, client=client, registry=reg, poll_interval=0.05,
                          busy_poll=0.01, sweep_interval=3600.0, executor_socket=path)
    with worker:
        executor = Executor(path)
        try:
            executor.hello(tasks=("sock.t",))
            remote = client.enqueue("sock.t", {"x": 1})
            local = client.enqueue("sock.py")
            event = executor.next("execute")
            assert event["job_id"] == remote.id
            executor.reply_to(executor.send(
                "succeeded", result="executor", execution_id=event["execution_id"],
                reservation_id=event["reservation_id"]))
            assert client.await_result(local.id, timeout=10) == "thread"
            assert client.await_result(remote.id, timeout=10) == "executor"
        finally:
            executor.close()
    for job in (remote, local):
        row = job_row(sql_conn, job.id)
        assert (row["attempt"], row["errors"]) == (1, [])  # never snoozed back as unknown
    assert not path.exists()


def test_belay_worker_serves_executors_with_no_python_workers(
        db_url: str, tmp_path: Path, sql_conn: Any) -> None:
    import signal
    import subprocess
    import sys

    path = tmp_path / "belay.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "belay", "worker", "--url", db_url, "--executor-socket",
         str(path), "--poll-interval", "0.1", "--busy-poll", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: path.exists() or proc.poll() is not None, "the socket", 20)
        assert proc.poll() is None, proc.communicate()[1]
        with belay.Belay(db_url) as producer:
            job = producer.enqueue("sock.t", {"n": 1})
            executor = Executor(path)
            try:
                executor.hello()
                event = executor.next("execute")
                reply = executor.reply_to(executor.send(
                    "succeeded", result=[1, 2], execution_id=event["execution_id"],
                    reservation_id=event["reservation_id"]))
                assert reply["state"] == "succeeded"
            finally:
                executor.close()
            assert producer.get_job(job.id).result == [1, 2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not path.exists()


def test_a_connection_registers_at_most_max_tasks(server: ExecutorServer,
                                                  executor: Executor) -> None:
    executor.hello(tasks=("sock.t",))
    many = [f"t{n}" for n in range(sockets.MAX_TASKS)]
    refused = executor.reply_to(executor.send("register_tasks", tasks=many))
    assert refused["error"]["code"] == "invalid_request"
    assert f"at most {sockets.MAX_TASKS} tasks" in refused["error"]["message"]
    kept = executor.reply_to(executor.send("register_tasks", tasks=many[:10]))
    assert kept["tasks"] == sorted(["sock.t", *many[:10]])  # the connection stays


def test_connections_waiting_for_their_hello_are_capped(
        server: ExecutorServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sockets, "MAX_WAITING", 3)
    silent = [Executor(server.path) for _ in range(3)]
    wait_until(lambda: server.connections() == 3, "three silent connections")
    extra = Executor(server.path)
    extra.sock.settimeout(2)  # shed at once, not after the 10 s hello_timeout
    assert extra.sock.recv(1) == b""
    extra.close()
    for quiet in silent:
        quiet.close()
    wait_until(lambda: server.connections() == 0, "the silent ones gone")
    with connected(server.path) as good:
        good.hello()
