"""Executor Protocol v1 fuzzed on a real socket (belay.parts.sockets), against a
real PostgreSQL, as tests/test_http_fuzz.py fuzzes the HTTP API: random bytes,
broken envelopes (non-JSON, non-objects, invalid UTF-8, lone surrogates, NaN,
huge numbers, deep nesting, wrong versions, types and request ids), oversized,
truncated, coalesced and split frames, bad hellos and bad reports, an executor
that stops reading, and one that never says hello.

For every case: the server stays up (a fresh executor runs a job end to end
afterwards); the misbehaving connection gets an ``error`` or is closed, never
a hang (every read has a deadline); a bystander's execution in flight is
untouched and completes normally; and no job is lost or corrupted: a job held
by a connection that sent garbage is back in ``ready`` with its attempt not
used, and a refused report writes nothing to the job's row.

Cases come from hypothesis (derandomized, modest counts), each on fresh
connections; the expected answer comes from a model (the pure
:class:`~belay.protocol.FrameReader` for framing, the documented rules for
the rest)."""

from __future__ import annotations

import contextlib
import fcntl
import select
import shutil
import socket
import struct
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import belay
from belay import protocol
from belay.clock import ManualClock
from belay.parts.remote import CONCLUDED_KINDS, ERROR_KEYS, MAX_ERROR_BYTES
from belay.parts.sockets import ExecutorServer
from belay.protocol import FrameReader, ProtocolError
from tests.helpers import job_row, wait_until
from tests.strategies import deep
from tests.test_socket_executors import Executor

Conn = psycopg.Connection[Any]

#: A few dozen cases per property: each is a connection or two and a row read.
FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
#: Seconds any read from the server may wait before the test fails: a hang.
WAIT = 5.0
MAX = protocol.MAX_FRAME_BYTES


# -- Peers -------------------------------------------------------------------------------


class Peer(Executor):
    """A test executor that can misbehave: raw bytes, byte-exact splits, and a
    bounded wait for the server to close it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.sock.settimeout(WAIT)

    def join(self, tasks: tuple[str, ...], capacity: int = 1) -> str:
        """hello and register_tasks; the connection's node id."""
        hello = self.reply_to(self.send("hello", mode="worker", runtime_id="fuzz",
                                        max_concurrency=capacity))
        assert hello["type"] == "hello_ok", hello
        registered = self.reply_to(self.send("register_tasks", tasks=list(tasks)))
        assert (registered["type"], registered["tasks"]) == ("ok", sorted(tasks)), registered
        return str(hello["node_id"])

    def spray(self, data: bytes) -> None:
        """Send ``data``; the server may close before it is all taken."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def chunks(self, data: bytes, sizes: list[int]) -> None:
        """Send ``data`` in chunks of ``sizes`` (the rest last), each read by the
        server before the next is sent: it sees exactly these boundaries."""
        start = 0
        for size in [*sizes, len(data)]:
            piece = data[start:start + size]
            start += len(piece)
            if not piece:
                break
            try:
                self.sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                return
            if not self.consumed():
                return

    def consumed(self) -> bool:
        """Wait until the server has read every byte sent (the kernel's count of
        unread bytes, TIOCOUTQ, drops to 0); False if it closed instead."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                unread = struct.unpack("i", fcntl.ioctl(self.sock, termios.TIOCOUTQ,
                                                        b"\0\0\0\0"))[0]
            except OSError:
                return False
            if unread == 0:
                return True
            if self.hung_up():
                return False  # closed: its unread bytes stay counted
            if time.monotonic() > deadline:
                raise AssertionError(f"the server left {unread} byte(s) unread for {WAIT}s")
            time.sleep(0.0002)

    def hung_up(self) -> bool:
        """Whether the server closed its end, even with replies still unread."""
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP)
        return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                   for _, events in poller.poll(0))

    def until_closed(self) -> list[dict[str, Any]]:
        """Every message the server sends until it closes this connection; a
        TimeoutError (a hang) fails the test."""
        received = list(self.inbox)
        self.inbox.clear()
        while True:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                assert self.reader.pending == 0, "the server tore a frame"
                return received
            received.extend(self.reader.feed(data))


@contextlib.contextmanager
def peer(server: ExecutorServer) -> Iterator[Peer]:
    connection = Peer(server.path)
    try:
        yield connection
    finally:
        connection.close()


def ids(event: dict[str, Any]) -> dict[str, Any]:
    return {"execution_id": event["execution_id"], "reservation_id": event["reservation_id"]}


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def request(kind: str, request_id: str = "fz", **fields: Any) -> bytes:
    return protocol.encode(protocol.message(kind, request_id, **fields))


def row_of(sql_conn: Conn, job_id: int) -> dict[str, Any]:
    """The job's row, but for the lease's end (a renewal may rewrite it)."""
    row = job_row(sql_conn, job_id)
    row.pop("lease_until")
    return row


def given_back(sql_conn: Conn, job_id: int, losses: tuple[int, ...] = (1,)) -> None:
    """The job went back to its queue without using an attempt, nothing recorded
    but the losses of its executors (belay.parts.handbacks counts them): as
    many as one of ``losses`` — (0, 1) for a job that may have met the closed
    connection before its send, and gone back uncounted. The count is then
    cleared, as by hand, so the next example hands the same job back afresh
    instead of reaching the bound."""
    seen: list[dict[str, Any]] = []  # one read: a late claim may take it again after
    wait_until(lambda: seen.append(job_row(sql_conn, job_id)) or seen[-1]["state"] == "ready",
               "the job given back")
    row = seen[-1]
    assert (row["attempt"], row["result"], row["leased_by"]) == (0, None, None), row
    entries = [(e["error"], e["attempt"], e["executor"].startswith("socket:"))
               for e in row["errors"]]
    assert set(entries) <= {("executor_lost", 1, True)} and len(entries) in losses, row
    sql_conn.execute("UPDATE belay_jobs SET errors = '[]' WHERE id = %s AND state = 'ready'",
                     (job_id,))


# -- Fixtures ------------------------------------------------------------------------------


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory: an AF_UNIX path must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_server(client: belay.Belay, clock: ManualClock,
                sock_dir: Path) -> Iterator[Callable[..., ExecutorServer]]:
    started: list[ExecutorServer] = []

    def make(**options: Any) -> ExecutorServer:
        options.setdefault("hello_timeout", 5.0)
        options.setdefault("send_timeout", 1.0)
        instance = ExecutorServer(client, ["default"],
                                  path=sock_dir / f"s{len(started)}.sock", **options)
        instance.start()
        started.append(instance)
        return instance

    try:
        yield make
    finally:
        for instance in started:
            instance.stop()


@pytest.fixture
def server(make_server: Callable[..., ExecutorServer]) -> ExecutorServer:
    return make_server()


@dataclass
class Bystander:
    """A well-behaved executor holding a job for the whole test."""

    peer: Peer
    node_id: str
    job_id: int
    event: dict[str, Any]

    def untouched(self, sql_conn: Conn) -> None:
        row = job_row(sql_conn, self.job_id)
        assert (row["state"], row["attempt"], row["leased_by"], row["errors"]) == \
            ("running", 1, self.node_id, []), row

    def finish(self, client: belay.Belay, sql_conn: Conn) -> None:
        self.untouched(sql_conn)
        done = self.peer.reply_to(self.peer.send("succeeded", result={"by": "stander"},
                                                 **ids(self.event)))
        assert (done["type"], done["state"]) == ("ok", "succeeded"), done
        assert client.get_job(self.job_id).result == {"by": "stander"}


@pytest.fixture
def bystander(client: belay.Belay, server: ExecutorServer) -> Iterator[Bystander]:
    job = client.enqueue("fz.good", {"n": 1})
    with peer(server) as good:
        node_id = good.join(("fz.good",))
        event = good.next("execute")
        assert (event["job_id"], event["attempt"]) == (job.id, 1)
        yield Bystander(good, node_id, job.id, event)


def serves(client: belay.Belay, server: ExecutorServer, sql_conn: Conn) -> None:
    """The server still works: a fresh executor says hello, registers and runs a
    job end to end."""
    job = client.enqueue("fz.fresh", {"x": [1, "two", None]})
    with peer(server) as fresh:
        fresh.join(("fz.fresh",))
        event = fresh.next("execute")
        assert (event["job_id"], event["args"], event["attempt"]) == \
            (job.id, {"x": [1, "two", None]}, 1)
        assert fresh.reply_to(fresh.send("started", **ids(event)))["type"] == "ok"
        done = fresh.reply_to(fresh.send("succeeded", result=event["args"], **ids(event)))
        assert (done["type"], done["state"], done["job_id"]) == ("ok", "succeeded", job.id)
    assert client.get_job(job.id).result == {"x": [1, "two", None]}
    assert job_row(sql_conn, job.id)["attempt"] == 1


def holding(server: ExecutorServer, victim: int) -> tuple[Peer, dict[str, Any]]:
    """A fresh executor that holds the job ``victim`` (kind ``fz.bad``)."""
    bad = Peer(server.path)
    try:
        bad.join(("fz.bad",))
        event = bad.next("execute")
    except BaseException:
        bad.close()
        raise
    assert (event["job_id"], event["attempt"]) == (victim, 1)
    return bad, event


# -- Strategies ----------------------------------------------------------------------------

#: Stands in a message for raw JSON text spliced in (see :func:`splice`).
HOLE = "\x01hole\x01"
#: A field left out of the envelope.
MISSING = object()


def splice(message: dict[str, Any], raw: bytes) -> bytes:
    """``message`` as JSON text, its one HOLE string replaced by ``raw``."""
    text, hole = orjson.dumps(message), orjson.dumps(HOLE)
    assert text.count(hole) == 1
    return text.replace(hole, raw)


def envelope(**fields: Any) -> dict[str, Any]:
    """A ``started`` request (with made-up ids), fields changed or left out."""
    message: dict[str, Any] = {"version": 1, "type": "started", "request_id": "fz",
                               "execution_id": "e", "reservation_id": "r"}
    message.update(fields)
    return {k: v for k, v in message.items() if v is not MISSING}


def broken(data: bytes, max_frame_bytes: int = MAX) -> bool:
    """The model: the reader refuses ``data`` before a whole message comes out."""
    try:
        list(FrameReader(max_frame_bytes).feed(data))
    except ProtocolError:
        return True
    return False


BAD_UTF8 = (b"\xff", b"\xfe", b"\x80", b"\xc3\x28", b"\xc0\xaf", b"\xe2\x82",
            b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80")
BAD_NUMBERS = (b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999", b"nan",
               b"inf", b"0x10", b"01", b"+1", b".5", b"1.")
SURROGATES = (b'"\\ud800"', b'"\\udfff"', b'"a\\udc00b"', b'"\\ud800\\u0041"', b'"\\ud83d"',
              b'"\\ud800\\ud800"')
WRONG_VERSIONS = (0, 2, -1, "1", "v1", 1.5, True, False, None, [1], {"v": 1}, 2**64 - 1,
                  MISSING)
WRONG_REQUEST_IDS = ("", "x" * 129, "\u00e9" * 65, "\U0001f600" * 33, 1, 0, 1.5, None, True,
                     ["r"], {"r": 1}, MISSING)
#: Integers a frame can carry (orjson writes 64 bits, signed or not).
INTEGERS = st.integers(-(2**63), 2**64 - 1)
JSON_LEAVES = (st.none() | st.booleans() | INTEGERS
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))


def _raw_in_field(raw: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return raw.map(lambda token: splice(envelope(x=HOLE), token))


#: Whole frames the reader must refuse (each checked against the model).
BROKEN_FRAMES: st.SearchStrategy[bytes] = st.one_of(
    # Not a frame at all: bytes that break before a message comes out.
    st.binary(min_size=4, max_size=300).filter(broken),
    # A frame that is not JSON, or is JSON but not an object.
    st.binary(min_size=1, max_size=200).map(frame).filter(broken),
    st.one_of(JSON_LEAVES, st.lists(JSON_LEAVES, max_size=4)).map(orjson.dumps).map(frame),
    # Invalid UTF-8 inside a string, with a BOM, or outside any string.
    _raw_in_field(st.builds(lambda head, bad, tail: b'"' + head + bad + tail + b'"',
                            st.text(max_size=5).map(str.encode), st.sampled_from(BAD_UTF8),
                            st.text(max_size=5).map(str.encode))).map(frame),
    st.just(frame(b"\xef\xbb\xbf" + orjson.dumps(envelope()))),
    st.sampled_from(BAD_UTF8).map(lambda bad: frame(orjson.dumps(envelope()) + bad)),
    # Lone surrogates, NaN and infinities, numbers JSON doesn't write.
    _raw_in_field(st.sampled_from(SURROGATES)).map(frame),
    _raw_in_field(st.sampled_from(BAD_NUMBERS)).map(frame),
    # Huge numbers where an integer 1 belongs (they read back as floats).
    st.sampled_from([b"100000000000000000000000000001", b"1.0", b"1e0", b"18446744073709551617"])
    .map(lambda raw: frame(splice(envelope(version=HOLE), raw))),
    # Nesting past MAX_DEPTH (and past orjson's own limit).
    st.sampled_from([protocol.MAX_DEPTH, protocol.MAX_DEPTH + 1, 1025, 5000])
    .map(lambda depth: frame(splice(envelope(x=HOLE), b"[" * depth + b"]" * depth))),
    st.just(frame(orjson.dumps(envelope(x=deep(protocol.MAX_DEPTH, {}))))),
    # The envelope's own fields wrong.
    st.sampled_from(WRONG_VERSIONS).map(lambda v: frame(orjson.dumps(envelope(version=v)))),
    st.one_of(st.text(max_size=20).filter(lambda t: t not in protocol.TYPES),
              st.sampled_from([1, None, ["hello"], {"t": "hello"}, MISSING, "HELLO", "hello "]))
    .map(lambda t: frame(orjson.dumps(envelope(type=t)))),
    st.sampled_from(WRONG_REQUEST_IDS).map(lambda r: frame(orjson.dumps(envelope(request_id=r)))),
    st.just(frame(b'{"version":1,"version":2,"type":"started","request_id":"fz"}')),
    # Trailing bytes after the object, an empty frame, lengths over the limit.
    st.sampled_from([b" x", b"{}", b",", b"\x00"])
    .map(lambda tail: frame(orjson.dumps(envelope()) + tail)),
    st.just(struct.pack(">I", 0)),
    st.integers(MAX + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    st.just(struct.pack(">I", MAX + 1) + b"{" + b" " * (MAX - 1) + b"}"),
)


# -- Garbage -------------------------------------------------------------------------------


def test_bytes_before_hello_get_an_error_or_a_close(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """Random bytes, framed or not, from a connection that never said hello:
    at most one ``error``, then the server closes it (after our EOF when the
    bytes are an unfinished frame)."""
    seen = {"closed": 0, "error": 0, "eof": 0}

    @FUZZ
    @given(data=st.one_of(st.binary(max_size=400),
                          st.binary(max_size=300).map(frame),
                          st.binary(max_size=200).map(lambda b: frame(b)[:-1]),
                          BROKEN_FRAMES))
    def run(data: bytes) -> None:
        reader = FrameReader(server.max_frame_bytes)
        try:
            messages = list(reader.feed(data))
            unfinished = not messages
        except ProtocolError:
            unfinished = False
        with peer(server) as bad:
            bad.spray(data)
            if unfinished:
                bad.sock.shutdown(socket.SHUT_WR)  # the server must not wait for more
                seen["eof"] += 1
            received = bad.until_closed()
        assert all(m["type"] == "error" for m in received), received
        assert len(received) <= 1, received
        seen["error" if received else "closed"] += 1
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        bystander.untouched(sql_conn)

    run()
    assert seen["closed"] and seen["eof"], seen
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


def test_a_broken_frame_closes_only_its_connection_and_gives_its_job_back(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """An executor holding a job sends a broken frame — alone, right after a
    valid request in the same send, or split in two reads: the valid request
    is answered, then the connection is closed with no reply to the garbage,
    and its job is back in ``ready`` with its attempt not used."""
    victim = client.enqueue("fz.bad", {"v": 1}).id

    @FUZZ
    @given(garbage=BROKEN_FRAMES, how=st.sampled_from(["alone", "after", "split"]),
           cut=st.integers(1, 8))
    def run(garbage: bytes, how: str, cut: int) -> None:
        assert broken(garbage, server.max_frame_bytes), garbage[:80]
        bad, event = holding(server, victim)
        with contextlib.closing(bad):
            if how == "after":
                bad.spray(request("started", "ok-first", **ids(event)) + garbage)
            elif how == "split":
                bad.chunks(garbage, [min(cut, len(garbage) - 1)])
            else:
                bad.spray(garbage)
            received = bad.until_closed()
        expected = [("ok", "ok-first")] if how == "after" else []
        assert [(m["type"], m["request_id"]) for m in received] == expected, received
        given_back(sql_conn, victim)
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        bystander.untouched(sql_conn)

    run()
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)
    with peer(server) as last:  # the victim, never run, now runs as its first attempt
        last.join(("fz.bad",))
        event = last.next("execute")
        assert (event["job_id"], event["attempt"]) == (victim, 1)


def test_frames_at_exactly_the_limit_are_served_and_one_byte_over_is_not(
        client: belay.Belay, make_server: Callable[..., ExecutorServer],
        sql_conn: Conn) -> None:
    server = make_server(max_frame_bytes=4096)
    victim = client.enqueue("fz.bad").id
    bad, event = holding(server, victim)
    with contextlib.closing(bad):
        at_limit = protocol.message("started", "at-limit", **ids(event), pad="")
        at_limit["pad"] = "x" * (4096 - len(orjson.dumps(at_limit)))
        bad.raw(protocol.encode(at_limit, 4096))
        assert bad.reply_to("at-limit")["type"] == "ok"
        at_limit["pad"] += "x"
        bad.spray(frame(orjson.dumps(at_limit)))
        assert bad.until_closed() == []
    given_back(sql_conn, victim)
    serves(client, server, sql_conn)


def test_a_truncated_frame_then_a_close_gives_the_job_back(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """The executor sends part of a frame — even a ``succeeded`` for its job —
    and closes: the job is back, not completed, its attempt not used."""
    victim = client.enqueue("fz.bad").id

    @FUZZ
    @given(kind=st.sampled_from(["succeeded", "failed", "started", "register_tasks"]),
           cut=st.floats(0, 1, exclude_max=True), half=st.booleans())
    def run(kind: str, cut: float, half: bool) -> None:
        bad, event = holding(server, victim)
        with contextlib.closing(bad):
            fields: dict[str, Any] = {
                "succeeded": {**ids(event), "result": "done"},
                "failed": {**ids(event), "error": {"message": "nope"}},
                "started": ids(event), "register_tasks": {"tasks": ["fz.x"]}}[kind]
            data = request(kind, **fields)
            bad.chunks(data[:max(1, int(len(data) * cut))], [])
            if half:  # EOF on our side only: the server closes its own
                bad.sock.shutdown(socket.SHUT_WR)
                assert bad.until_closed() == []
        given_back(sql_conn, victim)
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        bystander.untouched(sql_conn)

    run()
    # Before hello, too: the connection is forgotten.
    with peer(server) as early:
        early.chunks(request("hello", mode="worker", runtime_id="r", max_concurrency=1)[:20],
                     [])
    wait_until(lambda: server.connections() == 1, "the half-hello forgotten")
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


# -- Coalesced and split frames --------------------------------------------------------------

TASK_NAMES = st.one_of(
    st.text(min_size=1, max_size=12).map(lambda t: f"fz.t.{t}"),
    st.sampled_from(["", "\x00", "fz.\x00", "x" * 256, "\u00e9" * 128, "\u00e9" * 127]),
    INTEGERS, st.none(), st.lists(st.text(max_size=3), max_size=2),
)
EXTRA = st.one_of(
    st.none(), INTEGERS, st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30), st.just(deep(protocol.MAX_DEPTH - 1)),
)


def valid_tasks(tasks: Any) -> bool:
    return isinstance(tasks, list) and all(
        isinstance(t, str) and "\x00" not in t and 0 < len(t.encode("utf-8")) <= 255
        for t in tasks)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, Any]], bool]:
    """A hello, then requests (some refused), maybe a broken frame: the bytes
    and the replies the model expects (request id, type, code or tasks), and
    whether the server closes the connection at the end."""
    wire = [request("hello", "h", mode="worker", runtime_id="fuzz", max_concurrency=1),
            request("register_tasks", "r", tasks=["fz.bad"])]
    expected: list[tuple[str, str, Any]] = [("h", "hello_ok", None), ("r", "ok", ["fz.bad"])]
    registered = {"fz.bad"}
    for number in range(draw(st.integers(0, 10))):
        request_id = f"q{number}"
        kind = draw(st.sampled_from(["register_tasks", "unregister_tasks", "started",
                                     "succeeded", "failed", "concluded", "hello",
                                     *sorted(protocol.REPLIES)]))
        extra = {"pad": draw(EXTRA)} if draw(st.booleans()) else {}
        if kind in ("register_tasks", "unregister_tasks"):
            tasks = draw(st.lists(TASK_NAMES, max_size=3) | TASK_NAMES)
            wire.append(request(kind, request_id, tasks=tasks, **extra))
            if valid_tasks(tasks):
                if kind == "register_tasks":
                    registered.update(tasks)
                else:
                    registered.difference_update(tasks)
                expected.append((request_id, "ok", sorted(registered)))
            else:
                expected.append((request_id, "error", "invalid_request"))
        elif kind == "hello":
            wire.append(request(kind, request_id, mode="worker", runtime_id="again",
                                max_concurrency=1))
            return b"".join(wire), expected, True
        elif kind in protocol.REPLIES:
            wire.append(request(kind, request_id, **extra))
            expected.append((request_id, "error", "invalid_request"))
        else:  # made-up ids: whatever else it says, it is stale
            wire.append(request(kind, request_id, execution_id=draw(st.text(max_size=20)),
                                reservation_id="r", result=1, **extra))
            expected.append((request_id, "error", "stale_execution"))
    if draw(st.booleans()):
        wire.append(draw(BROKEN_FRAMES))
        return b"".join(wire), expected, True
    return b"".join(wire), expected, False


def test_frames_in_one_send_or_cut_anywhere_are_answered_in_order(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """A whole conversation in one send, or cut at arbitrary points (each piece
    read by the server before the next is sent): each request answered once,
    in order, as the model says; a broken frame or a second hello at the end
    closes the connection, and its job (if it got one) goes back."""
    victim = client.enqueue("fz.bad").id

    @FUZZ
    @given(conversation=conversations(),
           sizes=st.none() | st.lists(st.integers(1, 40), max_size=12))
    def run(conversation: tuple[bytes, list[tuple[str, str, Any]], bool],
            sizes: list[int] | None) -> None:
        wire, expected, closes = conversation
        with peer(server) as bad:
            if sizes is None:
                bad.spray(wire)
            else:
                bad.chunks(wire, sizes)
            replies: list[dict[str, Any]] = []
            if closes:
                replies = bad.until_closed()
            else:  # in the order they come
                while len(replies) < len(expected):
                    replies.append(bad.next())
                    if replies[-1]["type"] == "execute":
                        replies.pop()
            got = [(m["request_id"], m["type"],
                    m["error"]["code"] if m["type"] == "error" else m.get("tasks"))
                   for m in replies if m["type"] != "execute"]
            assert got == [(r, t, None if t == "hello_ok" else x) for r, t, x in expected]
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        # Held or not (it may have left before the dispatcher claimed it), the
        # job is in its queue, no attempt used.
        given_back(sql_conn, victim, (0, 1))
        bystander.untouched(sql_conn)

    run()
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


def test_a_conversation_sent_one_byte_at_a_time_runs_its_job(
        client: belay.Belay, server: ExecutorServer, sql_conn: Conn) -> None:
    """Every frame split at every byte boundary: each byte is read by the
    server on its own, and the job runs as usual."""
    job = client.enqueue("fz.slow", {"n": 3})
    with peer(server) as slow:
        one_by_one = [1] * 10_000
        slow.chunks(request("hello", "h", mode="worker", runtime_id="fuzz", max_concurrency=1)
                    + request("register_tasks", "r", tasks=["fz.slow"]), one_by_one)
        assert slow.reply_to("h")["type"] == "hello_ok"
        assert slow.reply_to("r")["tasks"] == ["fz.slow"]
        event = slow.next("execute")
        slow.chunks(request("started", "s", **ids(event)), one_by_one)
        assert slow.reply_to("s")["type"] == "ok"
        slow.chunks(request("succeeded", "d", result={"n": 6}, **ids(event)), one_by_one)
        done = slow.reply_to("d")
        assert (done["type"], done["state"]) == ("ok", "succeeded")
    assert client.get_job(job.id).result == {"n": 6}
    assert job_row(sql_conn, job.id)["attempt"] == 1


# -- Hellos --------------------------------------------------------------------------------

HELLO_VALUES = st.one_of(
    JSON_LEAVES, st.sampled_from(["worker", "client", "embedded", "Worker", "", "\x00",
                                  "r\x00", "x" * 256, "x" * 257, 0, 1, 65_535, 65_536, -1]),
    st.lists(JSON_LEAVES, max_size=3), st.dictionaries(st.text(max_size=3), JSON_LEAVES,
                                                       max_size=2),
)


def hello_answer(mode: Any, runtime_id: Any, limit: Any) -> str:
    """The model: ``hello_ok``, or the error code a hello is refused with."""
    if not isinstance(mode, str) or mode not in protocol.MODES:
        return "invalid_request"
    if not isinstance(runtime_id, str) or not runtime_id or len(runtime_id) > 256 \
            or "\x00" in runtime_id:  # PostgreSQL text holds no NUL
        return "invalid_request"
    low, high = (0, 0) if mode == "client" else (1, protocol.MAX_CONCURRENCY)
    if isinstance(limit, bool) or not isinstance(limit, int) or not low <= limit <= high:
        return "invalid_request"
    return "hello_ok" if mode == "worker" else "unsupported"


def test_hellos_are_answered_as_documented(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    seen: dict[str, int] = {}

    @FUZZ
    @example(mode="worker", runtime_id="r", limit=1)
    @example(mode="client", runtime_id="r", limit=0)
    @example(mode=["worker"], runtime_id="r", limit=1)
    @example(mode={"worker": 1}, runtime_id="r", limit=1)
    @example(mode="worker", runtime_id="r\x00", limit=1)
    @given(mode=st.sampled_from(["worker", "client"]) | HELLO_VALUES,
           runtime_id=st.text(min_size=1, max_size=20) | HELLO_VALUES,
           limit=st.integers(-2, 70_000) | HELLO_VALUES)
    def run(mode: Any, runtime_id: Any, limit: Any) -> None:
        expected = hello_answer(mode, runtime_id, limit)
        with peer(server) as new:
            new.raw(request("hello", "h", mode=mode, runtime_id=runtime_id,
                            max_concurrency=limit))
            if expected == "hello_ok":
                assert new.reply_to("h")["type"] == "hello_ok"
            else:
                received = new.until_closed()
                assert [(m["type"], m["error"]["code"]) for m in received] == \
                    [("error", expected)], received
        seen[expected] = seen.get(expected, 0) + 1
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        bystander.untouched(sql_conn)

    run()
    assert len(seen) == 3, seen
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


def test_a_nul_in_a_name_is_refused_and_starves_no_one(
        client: belay.Belay, server: ExecutorServer, sql_conn: Conn) -> None:
    """PostgreSQL text holds no NUL: a runtime id or task name with one is
    refused, so the dispatcher's claims (which store the node id and filter
    on the task names) never fail for every executor connected after it."""
    with peer(server) as bad:
        refused = bad.reply_to(bad.send("hello", mode="worker", runtime_id="r\x00",
                                        max_concurrency=1))
        assert refused["error"]["code"] == "invalid_request"
    with peer(server) as bad:
        bad.join(("fz.bad",))
        refused = bad.reply_to(bad.send("register_tasks", tasks=["fz.\x00"]))
        assert refused["error"]["code"] == "invalid_request"
        assert bad.reply_to(bad.send("register_tasks", tasks=[]))["tasks"] == ["fz.bad"]
        serves(client, server, sql_conn)  # a connection after it is served


# -- Reports -------------------------------------------------------------------------------

OTHER_THAN_STR = st.one_of(st.none(), st.booleans(), INTEGERS,
                           st.floats(allow_nan=False, allow_infinity=False),
                           st.lists(INTEGERS, max_size=2),
                           st.dictionaries(st.text(max_size=3), INTEGERS, max_size=2))
NOT_NULL_OR_STR = OTHER_THAN_STR.filter(lambda v: v is not None)


@st.composite
def with_nul(draw: st.DrawFn) -> Any:
    """A JSON value holding a NUL in one of its strings or keys (jsonb refuses it)."""
    text = draw(st.text(max_size=5)) + "\x00" + draw(st.text(max_size=5))
    return draw(st.sampled_from([
        text, [1, text], {"k": text}, {text: 1}, {"a": [{"b": text}]}, [[[text]]]]))


BAD_ERRORS = st.one_of(
    OTHER_THAN_STR,
    st.dictionaries(st.sampled_from(["type", "traceback", "details"]), st.text(max_size=5),
                    max_size=3),
    OTHER_THAN_STR.map(lambda m: {"message": m}),
    st.text(min_size=1, max_size=10).filter(lambda k: k not in ERROR_KEYS)
    .map(lambda k: {"message": "m", k: 1}),
    NOT_NULL_OR_STR.map(lambda t: {"message": "m", "type": t}),
    NOT_NULL_OR_STR.map(lambda t: {"message": "m", "traceback": t}),
    st.integers(MAX_ERROR_BYTES, MAX_ERROR_BYTES * 3).map(lambda n: {"message": "m" * n}),
    st.integers(MAX_ERROR_BYTES, MAX_ERROR_BYTES * 3)
    .map(lambda n: {"message": "m", "details": {"blob": "d" * n}}),
    with_nul().map(lambda d: {"message": "m", "details": d}),
)
BAD_TIMES = st.one_of(st.sampled_from(["tomorrow", "2026-01-01T00:00:00", "2026-13-01T00:00Z",
                                       "", "now"]),
                      NOT_NULL_OR_STR)
KINDS = st.sampled_from(sorted(CONCLUDED_KINDS))
BAD_CONCLUDED = st.one_of(
    st.just({}),
    NOT_NULL_OR_STR.map(lambda o: {"outcome": o}),
    st.one_of(st.text(max_size=10), OTHER_THAN_STR)
    .filter(lambda k: not isinstance(k, str) or k not in CONCLUDED_KINDS)
    .map(lambda k: {"outcome": {"kind": k}}),
    st.tuples(KINDS, NOT_NULL_OR_STR).map(lambda kr: {"outcome": {"kind": kr[0],
                                                                  "result_json": kr[1]}}),
    st.tuples(KINDS, st.sampled_from(["{nope", "", "[1,", "NaN", "\x00", "'a'"])).map(
        lambda kr: {"outcome": {"kind": kr[0], "result_json": kr[1]}}),
    st.tuples(KINDS, NOT_NULL_OR_STR.filter(lambda e: not isinstance(e, dict))).map(
        lambda ke: {"outcome": {"kind": ke[0], "error": ke[1]}}),
    st.tuples(KINDS, with_nul().map(lambda d: {"error": "x", "details": d})).map(
        lambda ke: {"outcome": {"kind": ke[0], "error": ke[1]}}),
    st.tuples(KINDS, BAD_TIMES).map(lambda kt: {"outcome": {"kind": kt[0], "at": kt[1]}}),
    NOT_NULL_OR_STR.map(lambda p: {"park": p}),
    st.sampled_from([{}, {"scope": "job:1"}, {"name": "go"}, {"scope": "", "name": "go"},
                     {"scope": "job:1", "name": ""}, {"scope": 1, "name": "go"},
                     {"scope": "job:\x00", "name": "go"}, {"scope": "job:1", "name": "g\x00"},
                     # Over a name's 255 bytes, and over PostgreSQL's index row size.
                     {"scope": "s" * 256, "name": "go"}, {"scope": "job:1", "name": "n" * 3000},
                     {"scope": "s" * 100_000, "name": "go"}])
    .map(lambda p: {"park": p}),
    BAD_TIMES.map(lambda t: {"park": {"scope": "job:1", "name": "go", "deadline": t}}),
)
WRONG_IDS = st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=2000),
                      OTHER_THAN_STR, st.just(MISSING))


def bad_report(real: dict[str, Any], others: dict[str, Any]
               ) -> st.SearchStrategy[tuple[str, dict[str, Any], str]]:
    """A report about the held execution (``real`` ids; ``others``: those of
    another connection's) that must be refused: (type, fields, the error code
    it gets)."""
    def stale(kind: str, which: str, wrong: Any, result: Any) -> tuple[str, dict[str, Any], str]:
        fields = {**real, which: wrong, "result": result, "error": {"message": "m"},
                  "outcome": {"kind": "succeeded"}}
        return kind, {k: v for k, v in fields.items() if v is not MISSING}, "stale_execution"

    return st.one_of(
        st.builds(stale, st.sampled_from(["started", "succeeded", "failed", "concluded"]),
                  st.sampled_from(["execution_id", "reservation_id"]), WRONG_IDS, EXTRA),
        BAD_ERRORS.map(lambda error: ("failed", {**real, "error": error}, "invalid_request")),
        BAD_CONCLUDED.map(lambda fields: ("concluded", {**real, **fields}, "invalid_request")),
        st.sampled_from(["started", "succeeded", "failed"]).map(
            lambda kind: (kind, {**others, "result": 1, "error": {"message": "m"}},
                          "stale_execution")),
    )


def test_bad_reports_are_refused_and_write_nothing(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """Reports with wrong ids, a wrong reservation, or an error, outcome or park
    belay can't read or store: an ``error`` frame, and the job's row as it was.
    Each case on a fresh connection that holds the job (given back between)."""
    job = client.enqueue("fz.job", {"n": 1}).id
    codes: dict[str, int] = {}

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        # An example whose draw was rejected handed the job back too: its
        # count goes, as given_back's does.
        given_back(sql_conn, job, (0, 1, 2))
        with peer(server) as executor:
            executor.join(("fz.job",))
            event = executor.next("execute")
            assert (event["job_id"], event["attempt"]) == (job, 1)
            kind, fields, code = data.draw(bad_report(ids(event), ids(bystander.event)))
            before = row_of(sql_conn, job)
            reply = executor.reply_to(executor.send(kind, **fields))
            assert (reply["type"], reply.get("error", {}).get("code")) == ("error", code), \
                (kind, fields, reply)
            assert row_of(sql_conn, job) == before, (kind, fields)
            # The connection still serves: the same execution is still its own.
            assert executor.reply_to(executor.send("started", **ids(event)))["type"] == "ok"
        codes[code] = codes.get(code, 0) + 1
        given_back(sql_conn, job)
        wait_until(lambda: server.connections() == 1, "the connection forgotten")
        bystander.untouched(sql_conn)

    run()
    assert len(codes) == 2, codes
    with peer(server) as executor:
        executor.join(("fz.job",))
        event = executor.next("execute")
        done = executor.reply_to(executor.send("succeeded", result=[1, "x"], **ids(event)))
        assert (done["type"], done["state"]) == ("ok", "succeeded")
    assert client.get_job(job).result == [1, "x"]
    assert job_row(sql_conn, job)["attempt"] == 1
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


@pytest.mark.parametrize(("kind", "fields"), [
    ("failed", {"error": {"message": "m", "details": {"k": "a\x00b"}}}),
    ("failed", {"error": {"message": "m", "details": {"\x00": 1}}}),
    ("concluded", {"outcome": {"kind": "failed", "error": {"error": "\x00"}}}),
    ("concluded", {"outcome": {"kind": ["failed"]}}),
    ("concluded", {"outcome": {"kind": {"failed": 1}}}),
    ("concluded", {"park": {"scope": "job:\x00", "name": "go"}}),
    ("concluded", {"park": {"scope": "s" * 100_000, "name": "go"}}),
    ("concluded", {"park": {"scope": "job:1", "name": "n" * 3000}}),
])
def test_a_report_belay_cannot_store_is_refused_not_dropped(
        client: belay.Belay, server: ExecutorServer, sql_conn: Conn, kind: str,
        fields: dict[str, Any]) -> None:
    """What PostgreSQL can't store (a NUL in jsonb, a name past the index row
    size) or remote.concluded can't read (an unhashable kind) is refused with
    ``invalid_request`` before any write. It used to fail in the write or the
    parse: the connection closed and its jobs went back (or, for a long park
    name, ``unavailable``: "report it again", forever)."""
    job = client.enqueue("fz.job").id
    with peer(server) as executor:
        executor.join(("fz.job",))
        event = executor.next("execute")
        before = row_of(sql_conn, job)
        reply = executor.reply_to(executor.send(kind, **ids(event), **fields))
        assert reply["error"]["code"] == "invalid_request", reply
        assert row_of(sql_conn, job) == before
        done = executor.reply_to(executor.send("succeeded", result="\x00", **ids(event)))
        assert done["state"] == "succeeded"
    assert client.get_job(job).result == "\x00"  # a result is bytea: a NUL is fine


@pytest.mark.parametrize("poison", [
    b"NaN", b"Infinity", b"-1e400", b'"\\ud800"', b'{"k": "\xed\xa0\x80"}', b'"\xff"',
    b"[" * protocol.MAX_DEPTH + b"]" * protocol.MAX_DEPTH,
])
def test_a_result_that_is_not_json_closes_the_connection_and_writes_nothing(
        client: belay.Belay, server: ExecutorServer, sql_conn: Conn, poison: bytes) -> None:
    """A ``succeeded`` whose result is not bounded JSON is a broken frame: the
    connection closes, the job is not completed, and it goes back unspent."""
    victim = client.enqueue("fz.bad").id
    bad, event = holding(server, victim)
    with contextlib.closing(bad):
        bad.spray(frame(splice(protocol.message("succeeded", "s", **ids(event), result=HOLE),
                               poison)))
        assert bad.until_closed() == []
    given_back(sql_conn, victim)
    serves(client, server, sql_conn)


def test_a_stale_report_with_huge_ids_gets_an_error_not_a_close(
        client: belay.Belay, server: ExecutorServer, sql_conn: Conn) -> None:
    """The refusal quotes the ids it could not find; quoted in full, a long id
    of characters Python's repr spells out (``\\x7f`` → 4 characters) made
    the reply larger than a frame, and the connection was dropped as if it
    had sent a broken frame."""
    victim = client.enqueue("fz.bad").id
    bad, event = holding(server, victim)
    with contextlib.closing(bad):
        for huge in ("\x7f" * 300_000, "\x01" * 150_000, "\u200b" * 200_000):
            reply = bad.reply_to(bad.send("started", execution_id=huge,
                                          reservation_id=event["reservation_id"]))
            assert reply["error"]["code"] == "stale_execution"
            reply = bad.reply_to(bad.send("failed", **ids(event),
                                          error={"message": "m", huge[:1000]: 1}))
            assert reply["error"]["code"] == "invalid_request"
        done = bad.reply_to(bad.send("succeeded", result=None, **ids(event)))
        assert done["state"] == "succeeded"
    serves(client, server, sql_conn)


JSON_VALUES = st.recursive(
    JSON_LEAVES | st.text(max_size=10).map(lambda t: t + "\x00"),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=20,
) | st.just(deep(protocol.MAX_DEPTH - 2, {"a": "\x00"}))


def test_any_json_result_is_stored_exactly(
        client: belay.Belay, server: ExecutorServer, bystander: Bystander,
        sql_conn: Conn) -> None:
    """A good connection's results — NULs, 64-bit and float edges, nesting up to
    the limit — are stored as sent, on the attempt they were sent for."""

    @FUZZ
    @given(result=JSON_VALUES)
    def run(result: Any) -> None:
        job = client.enqueue("fz.res", {"n": 1}).id
        with peer(server) as executor:
            executor.join(("fz.res",))
            event = executor.next("execute")
            assert event["job_id"] == job
            done = executor.reply_to(executor.send("succeeded", result=result, **ids(event)))
            assert (done["type"], done["state"]) == ("ok", "succeeded"), done
        assert client.get_job(job).result == result
        assert job_row(sql_conn, job)["attempt"] == 1
        bystander.untouched(sql_conn)

    run()
    bystander.finish(client, sql_conn)
    serves(client, server, sql_conn)


# -- Stuck and silent peers -------------------------------------------------------------------


def test_an_executor_that_never_reads_is_dropped_and_another_keeps_working(
        client: belay.Belay, make_server: Callable[..., ExecutorServer],
        sql_conn: Conn) -> None:
    server = make_server(send_timeout=0.3)
    good_job = client.enqueue("fz.good").id
    with peer(server) as good:
        good.join(("fz.good",))
        held = good.next("execute")
        assert held["job_id"] == good_job
        big = client.enqueue_many([{"kind": "fz.big", "input": {"pad": "x" * 250_000, "i": i}}
                                   for i in range(8)])
        with peer(server) as stuck:
            stuck.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.join(("fz.big",), capacity=8)  # and it never reads again
            # The good executor is answered meanwhile, on its own connection.
            done = good.reply_to(good.send("succeeded", result="fine", **ids(held)))
            assert done["state"] == "succeeded"
            wait_until(lambda: server.connections() == 1, "the stuck executor dropped", 15)
        for job in big:  # the rest of the dispatcher's batch met the closed connection
            given_back(sql_conn, job.id, (0, 1))
        good.reply_to(good.send("register_tasks", tasks=["fz.big"]))
        for _ in big:
            event = good.next("execute")
            assert event["attempt"] == 1 and event["args"]["pad"] == "x" * 250_000
            reply = good.reply_to(good.send("succeeded", result=event["args"]["i"],
                                            **ids(event)))
            assert reply["state"] == "succeeded"
    assert sorted(client.get_job(j.id).result for j in big) == list(range(8))
    serves(client, server, sql_conn)


def test_an_executor_that_never_reads_its_replies_is_dropped(
        client: belay.Belay, make_server: Callable[..., ExecutorServer],
        sql_conn: Conn) -> None:
    """Replies are frames too: one that can't be sent within send_timeout
    closes the connection (it may be half-written: the stream can't go on)
    and gives its job back."""
    server = make_server(send_timeout=0.3)
    victim = client.enqueue("fz.bad").id
    bad, _ = holding(server, victim)
    with contextlib.closing(bad):
        bad.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        many = [f"fz.{i:04d}." + "t" * 200 for i in range(1000)]
        # Each reply lists every task registered: ~200 kB, and it never reads one.
        bad.raw(request("register_tasks", "big", tasks=many)
                + b"".join(request("register_tasks", f"again-{i}", tasks=[]) for i in range(40)))
        wait_until(lambda: server.connections() == 0, "the deaf executor dropped", 15)
        given_back(sql_conn, victim)
    serves(client, server, sql_conn)


def test_a_connection_that_never_completes_its_hello_is_closed(
        client: belay.Belay, make_server: Callable[..., ExecutorServer],
        sql_conn: Conn) -> None:
    """hello_timeout bounds the whole hello: a silent connection, one that sent
    half a frame, and one trickling a byte at a time all go."""
    server = make_server(hello_timeout=0.3)
    hello = request("hello", "h", mode="worker", runtime_id="trickle", max_concurrency=1)
    with peer(server) as silent, peer(server) as half:
        half.chunks(hello[:10], [])
        assert silent.until_closed() == [] and half.until_closed() == []
    with peer(server) as trickle:
        begun = time.monotonic()
        for index in range(len(hello) - 1):  # ~2 s at one byte per 25 ms: never whole
            trickle.spray(hello[index:index + 1])
            readable, _, _ = select.select([trickle.sock], [], [], 0.025)
            if readable:
                break
        assert trickle.until_closed() == []
        assert time.monotonic() - begun < 1.5, "the trickle kept its connection"
    wait_until(lambda: server.connections() == 0, "every connection forgotten")
    serves(client, server, sql_conn)
