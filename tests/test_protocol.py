"""Executor Protocol v1's wire format (belay.protocol): frames and envelopes."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from belay import protocol
from belay.protocol import FrameReader, ProtocolError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
REQUEST_IDS = st.text(min_size=1, max_size=32)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def hello(**fields: Any) -> dict[str, Any]:
    return protocol.message("hello", "hello-1", **{
        "mode": "worker", "runtime_id": "worker-1", "max_concurrency": 4, **fields})


@given(args=JSON, request_id=REQUEST_IDS, cut=st.integers(0, 64))
def test_a_message_survives_the_wire_cut_anywhere(args: Any, request_id: str, cut: int) -> None:
    sent = protocol.message("execute", request_id, task="t", args=args, job_id=1)
    wire = protocol.encode(sent) + protocol.encode(hello())
    reader = FrameReader()
    cut = min(cut, len(wire))
    got = list(reader.feed(wire[:cut])) + list(reader.feed(wire[cut:]))
    assert got == [sent, hello()]
    assert reader.pending == 0


def test_the_seeds_examples_decode() -> None:
    for text in (
        b'{"version":1,"type":"hello","request_id":"hello-1","mode":"worker",'
        b'"runtime_id":"worker-1","max_concurrency":4}',
        b'{"version":1,"type":"register_tasks","request_id":"tasks-1",'
        b'"tasks":["billing.capture.v1"]}',
        b'{"version":1,"type":"execute","request_id":"execution-1","reservation_id":'
        b'"reservation-1","execution_id":"execution-1","job_id":"0123456789abcdef",'
        b'"task":"billing.capture.v1","args":{"invoice_id":"inv-42"},"timeout_ms":30000}',
    ):
        (decoded,) = FrameReader().feed(frame(text))
        assert decoded == orjson.loads(text)
    assert protocol.parse_hello(hello()) == protocol.Hello("worker", "worker-1", 4)


def test_an_oversized_length_is_refused_before_its_payload_arrives() -> None:
    reader = FrameReader(max_frame_bytes=100)
    with pytest.raises(ProtocolError, match="at most 100"):
        list(reader.feed(struct.pack(">I", 101)))  # no payload byte sent
    with pytest.raises(ProtocolError, match="already sent a broken frame"):
        list(reader.feed(protocol.encode(hello())))


@pytest.mark.parametrize(("payload", "why"), [
    (b"", "empty frame"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[1, 2]", "JSON object, not list"),
    (b'"hello"', "JSON object, not str"),
    (b'{"version":1,"type":"hello","request_id":"r","x":NaN}', "not UTF-8 JSON"),
    (b'{"version":1,"type":"hello","request_id":"r","x":1e400}', "not UTF-8 JSON"),
    (b'{"version":1,"type":"hello","request_id":"r","x":"\\ud800"}', "not UTF-8 JSON"),
    (b'{"version":2,"type":"hello","request_id":"r"}', "version must be 1"),
    (b'{"version":1.0,"type":"hello","request_id":"r"}', "version must be 1"),
    (b'{"version":true,"type":"hello","request_id":"r"}', "version must be 1"),
    (b'{"type":"hello","request_id":"r"}', "version must be 1"),
    (b'{"version":1,"type":"launch_missiles","request_id":"r"}', "unknown message type"),
    (b'{"version":1,"request_id":"r"}', "unknown message type"),
    (b'{"version":1,"type":"hello","request_id":""}', "request_id"),
    (b'{"version":1,"type":"hello","request_id":7}', "request_id"),
    (b'{"version":1,"type":"hello","request_id":"' + b"x" * 129 + b'"}', "request_id"),
    (b'{"version":1,"type":"hello","request_id":"r","args":' + b"[" * 70 + b"]" * 70 + b"}",
     "nest"),
])
def test_a_broken_frame_is_a_protocol_error(payload: bytes, why: str) -> None:
    reader = FrameReader()
    with pytest.raises(ProtocolError, match=why):
        list(reader.feed(frame(payload) if payload else struct.pack(">I", 0)))


def test_a_request_id_of_128_utf8_bytes_is_the_limit() -> None:
    assert protocol.decode(orjson.dumps(protocol.message("ok", "é" * 64)))  # 128 bytes
    with pytest.raises(ProtocolError, match="request_id"):
        protocol.decode(orjson.dumps(protocol.message("ok", "é" * 64 + "x")))


def test_encode_refuses_what_it_would_not_accept() -> None:
    with pytest.raises(ProtocolError, match="finite"):
        protocol.encode(protocol.message("ok", "r", x=float("nan")))
    with pytest.raises(ProtocolError, match="not a JSON value"):
        protocol.encode(protocol.message("ok", "r", x={1, 2}))
    with pytest.raises(ProtocolError, match="keys must be strings"):
        protocol.encode(protocol.message("ok", "r", x={1: 2}))
    with pytest.raises(ProtocolError, match="at most 64"):
        protocol.encode(protocol.message("ok", "r", x="y" * 100), max_frame_bytes=64)


@pytest.mark.parametrize(("fields", "why"), [
    ({"mode": "boss"}, "mode must be one of"),
    ({"runtime_id": ""}, "runtime_id"),
    ({"max_concurrency": 0}, "1 to 65535"),
    ({"max_concurrency": 65_536}, "1 to 65535"),
    ({"max_concurrency": True}, "1 to 65535"),
    ({"mode": "client", "max_concurrency": 1}, "must be 0 for a client"),
])
def test_a_bad_hello_says_what_is_wrong(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        protocol.parse_hello(hello(**fields))


def test_an_error_reply_carries_its_request_and_code() -> None:
    reply = protocol.error("tasks-1", "invalid_request", "tasks must be a list",
                           reason="shape")
    assert reply == {"version": 1, "type": "error", "request_id": "tasks-1",
                     "error": {"code": "invalid_request", "reason": "shape",
                               "message": "tasks must be a list"}}
    assert protocol.decode(protocol.encode(reply)[4:]) == reply


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_as_anything_but_a_protocol_error(data: bytes) -> None:
    reader = FrameReader(max_frame_bytes=150)
    try:
        for message in reader.feed(data):
            protocol.check(message)
    except ProtocolError:
        pass
