"""Executor Protocol v1: the wire format of executors on a Unix-domain socket.

Pure: bytes in, messages out, and the reverse; no sockets here. A frame is a
four-byte unsigned big-endian payload length, then that many bytes of a
nonempty UTF-8 JSON object. The length is checked against ``max_frame_bytes``
before a byte of the payload is read or decoded. Values are bounded JSON
(null, booleans, finite numbers, strings, arrays, string-keyed objects), at
most :data:`MAX_DEPTH` deep: nothing is unpickled, no code is loaded.

Every message carries ``version: 1``, a known ``type`` and a nonempty
``request_id`` of at most 128 UTF-8 bytes. A frame that breaks these rules
raises :class:`ProtocolError`: the server closes that connection, and only
that one. A request that is well formed but can't be served is answered with
an ``error`` message (:func:`error`) and the connection stays open.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

VERSION: Final = 1
#: The largest payload a frame may carry unless the server says otherwise.
MAX_FRAME_BYTES: Final = 1024 * 1024
MAX_REQUEST_ID_BYTES: Final = 128
#: How deep arrays and objects may nest inside a message.
MAX_DEPTH: Final = 64
#: An executor's ``max_concurrency`` range; a client's is 0.
MAX_CONCURRENCY: Final = 65_535

_LENGTH = struct.Struct(">I")

#: Messages an executor or client sends. ``concluded`` is belay's own, sent
#: by its process pool's children: the outcome decided there (a retry, a
#: snooze, a cancel, a park…), which ``succeeded``/``failed`` can't carry.
REQUESTS: Final = frozenset({
    "hello", "register_tasks", "unregister_tasks", "started", "succeeded", "failed",
    "concluded",
})
#: Messages the server sends.
REPLIES: Final = frozenset({
    "hello_ok", "tasks_ok", "execute", "cancel_execution", "ok", "error",
})
TYPES: Final = REQUESTS | REPLIES
MODES: Final = frozenset({"client", "embedded", "worker"})


class ProtocolError(Exception):
    """A frame or message breaks the wire format: its connection is closed."""


@dataclass(frozen=True)
class Hello:
    mode: str
    runtime_id: str
    max_concurrency: int


def encode(message: Mapping[str, Any], max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame holding ``message`` (an object with ``version``, ``type`` and
    ``request_id``); ProtocolError if it breaks the format or is too large."""
    check(message)
    try:
        payload = orjson.dumps(message)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ProtocolError(f"the message is not bounded JSON: {exc}") from None
    if len(payload) > max_frame_bytes:
        raise ProtocolError(f"the message is {len(payload)} bytes; a frame carries at most "
                            f"{max_frame_bytes}")
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into messages: ``feed(data)`` yields every message
    complete so far; the rest waits for more bytes. Raises ProtocolError at
    the first broken frame (the reader is then unusable, as its connection)."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._broken = False

    @property
    def pending(self) -> int:
        """Bytes received that are not a whole frame yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        if self._broken:
            raise ProtocolError("the connection already sent a broken frame")
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size == 0 or size > self.max_frame_bytes:
                self._broken = True
                raise ProtocolError(
                    "an empty frame" if size == 0 else
                    f"a frame of {size} bytes; at most {self.max_frame_bytes} are allowed")
            if len(self._buffer) < _LENGTH.size + size:
                return
            payload = bytes(self._buffer[_LENGTH.size:_LENGTH.size + size])
            del self._buffer[:_LENGTH.size + size]
            try:
                yield decode(payload)
            except ProtocolError:
                self._broken = True
                raise


def decode(payload: bytes) -> dict[str, Any]:
    """The message in one frame's payload, checked."""
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"the frame is not UTF-8 JSON: {exc}") from None
    check(message)
    return message  # type: ignore[no-any-return]


def check(message: Any) -> None:
    """Raise ProtocolError unless ``message`` is a well-formed envelope of
    bounded JSON."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame holds a JSON object, not {type(message).__name__}")
    version = message.get("version")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"version must be {VERSION}, got {version!r}")
    kind = message.get("type")
    if not isinstance(kind, str) or kind not in TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    request_id = message.get("request_id")
    if not isinstance(request_id, str) or not request_id \
            or len(request_id.encode("utf-8", "surrogatepass")) > MAX_REQUEST_ID_BYTES:
        raise ProtocolError(f"request_id must be a nonempty string of at most "
                            f"{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {request_id!r:.80}")
    _bounded(message)


def _bounded(value: Any) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, (bool, int, str)):
            continue
        if isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                raise ProtocolError("numbers must be finite")
            continue
        if not isinstance(item, (list, dict)):
            raise ProtocolError(f"{type(item).__name__} is not a JSON value")
        if depth > MAX_DEPTH:
            raise ProtocolError(f"values nest at most {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise ProtocolError("object keys must be strings")
            stack.extend((v, depth + 1) for v in item.values())
        else:
            stack.extend((v, depth + 1) for v in item)


def parse_hello(message: Mapping[str, Any]) -> Hello:
    """The ``hello`` every connection starts with; ValueError says what is wrong
    (answered with an ``error``, code ``invalid_request``)."""
    if message.get("type") != "hello":
        raise ValueError(f"the first message must be hello, got {message.get('type')!r:.80}")
    mode = message.get("mode")
    # A str first: a list or an object is unhashable, and ``in MODES`` would
    # raise TypeError instead of refusing the hello. (Values are quoted cut to
    # 80 characters: the refusal must fit in a reply frame.)
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r:.80}")
    runtime_id = message.get("runtime_id")
    # No NUL: the runtime id goes into the lease owner (``leased_by``) of every
    # job the connection claims, and PostgreSQL text can't hold one — each
    # claim would fail, and with it the dispatch to every other executor.
    if not isinstance(runtime_id, str) or not runtime_id or len(runtime_id) > 256 \
            or "\x00" in runtime_id:
        raise ValueError("runtime_id must be a nonempty string of at most 256 characters, "
                         "without NUL")
    limit = message.get("max_concurrency")
    low = 0 if mode == "client" else 1
    high = 0 if mode == "client" else MAX_CONCURRENCY
    if isinstance(limit, bool) or not isinstance(limit, int) or not low <= limit <= high:
        raise ValueError(f"max_concurrency must be {low} for a client" if mode == "client"
                         else f"max_concurrency must be {low} to {high}, got {limit!r:.80}")
    return Hello(mode, runtime_id, limit)


def message(kind: str, request_id: str, **fields: Any) -> dict[str, Any]:
    """An envelope of type ``kind`` with ``fields``."""
    return {"version": VERSION, "type": kind, "request_id": request_id, **fields}


def error(request_id: str, code: str, message_text: str | None = None,
          **details: Any) -> dict[str, Any]:
    """The correlated failure of one request: ``{"type": "error", "error": {"code": …}}``."""
    body: dict[str, Any] = {"code": code, **details}
    if message_text is not None:
        body["message"] = message_text
    return message("error", request_id, error=body)
