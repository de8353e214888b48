"""Decoder for the Erlang External Term Format (ETF).

The Elixir implementation of Belay stores job arguments and step results as the output of
``:erlang.term_to_binary/1`` in ``bytea`` columns.  This module turns those bytes into plain Python
values so the Python engine can read rows written by the Elixir one.

Mapping (see ``decode_etf``):

* integers of any size -> ``int``; floats -> ``float``
* atoms ``nil``/``true``/``false`` -> ``None``/``True``/``False``; other atoms -> ``str``
* binaries -> ``str`` if valid UTF-8, else ``bytes``
* tuples -> ``tuple``; proper lists -> ``list``; charlists (STRING_EXT) -> ``list[int]``
* maps -> ``dict``

Only data terms are supported: pids, ports, references, funs, bitstrings and anything else
raise ``EtfDecodeError``.  The input is untrusted, so every length is validated against the
remaining input before anything is sliced or allocated, nesting depth is bounded and the decoder is
iterative, and compressed payloads are inflated with a hard output cap.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from typing import Final

__all__ = ["MAX_DEPTH", "MAX_UNCOMPRESSED_SIZE", "EtfDecodeError", "decode_etf"]

VERSION: Final = 131

# Deep enough for any realistic job payload; unbounded nesting is only ever an
# attack or corruption. Decoding is iterative, but whatever the caller does next with the value
# (==, repr, json.dumps) recurses; 500 levels stays well inside Python's
# default recursion limit, and deeper terms surface as Opaque, not a crash.
MAX_DEPTH: Final = 500

# Erlang itself accepts any size, but a job payload this large is certainly not legitimate and we
# must not let a 5-byte header make us allocate gigabytes.
MAX_UNCOMPRESSED_SIZE: Final = 64 * 1024 * 1024

# Erlang refuses atoms longer than this many characters, so longer ones can only be corruption.
_MAX_ATOM_CHARS: Final = 255

NEW_FLOAT_EXT: Final = 70
BIT_BINARY_EXT: Final = 77
COMPRESSED: Final = 80
SMALL_INTEGER_EXT: Final = 97
INTEGER_EXT: Final = 98
FLOAT_EXT: Final = 99
ATOM_EXT: Final = 100
SMALL_TUPLE_EXT: Final = 104
LARGE_TUPLE_EXT: Final = 105
NIL_EXT: Final = 106
STRING_EXT: Final = 107
LIST_EXT: Final = 108
BINARY_EXT: Final = 109
SMALL_BIG_EXT: Final = 110
LARGE_BIG_EXT: Final = 111
MAP_EXT: Final = 116
SMALL_ATOM_EXT: Final = 115
ATOM_UTF8_EXT: Final = 118
SMALL_ATOM_UTF8_EXT: Final = 119

# Names only for error messages: telling "that's a pid" apart from "that's garbage" saves a lot of
# debugging when someone stores an unsupported term from the Elixir side.
_UNSUPPORTED_NAMES: Final[dict[int, str]] = {
    BIT_BINARY_EXT: "BIT_BINARY_EXT (bitstring)",
    COMPRESSED: "COMPRESSED (only allowed at top level)",
    67: "LOCAL_EXT",
    82: "ATOM_CACHE_REF",
    88: "NEW_PID_EXT",
    89: "NEW_PORT_EXT",
    90: "NEWER_REFERENCE_EXT",
    101: "REFERENCE_EXT",
    102: "PORT_EXT",
    103: "PID_EXT",
    112: "NEW_FUN_EXT",
    113: "EXPORT_EXT",
    114: "NEW_REFERENCE_EXT",
    117: "FUN_EXT",
    120: "V4_PORT_EXT",
}

_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_F64: Final = struct.Struct(">d")

# Erlang's own FLOAT_EXT parser insists on a decimal point and rejects padding, "inf", "nan", etc.;
# Python's float() is far more permissive (underscores, whitespace, "infinity"), so gate it first.
_FLOAT_TEXT: Final = re.compile(rb"[+-]?[0-9]+\.[0-9]+(?:[eE][+-]?[0-9]+)?")

_ATOM_VALUES: Final[dict[str, object]] = {"nil": None, "true": True, "false": False}


class EtfDecodeError(ValueError):
    """The input is not a well-formed, supported External Term Format term."""


class _Frame:
    """A container whose elements are still being decoded.

    Keeping these on an explicit stack instead of recursing is what lets us decode very deep terms
    without touching Python's recursion limit.
    """

    __slots__ = ("items", "kind", "mapping", "offset", "pending_key", "remaining")

    def __init__(self, kind: int, remaining: int, offset: int) -> None:
        self.kind = kind
        self.remaining = remaining
        self.offset = offset
        self.items: list[object] = []
        self.mapping: dict[object, object] = {}
        self.pending_key: object = None


def decode_etf(data: bytes | bytearray | memoryview) -> object:
    """Decode one ``term_to_binary`` blob (version byte 131 included) into a Python value.

    Raises ``EtfDecodeError`` for malformed, truncated, trailing or unsupported input.
    """
    view = memoryview(data).cast("B")
    if len(view) == 0:
        raise EtfDecodeError("empty input: expected version byte 131 at offset 0")
    if view[0] != VERSION:
        raise EtfDecodeError(f"bad version byte {view[0]} at offset 0: expected {VERSION}")
    if len(view) >= 2 and view[1] == COMPRESSED:
        inflated = _inflate(view)
        return _Decoder(memoryview(inflated), " (in the decompressed payload)").run(0)
    return _Decoder(view, "").run(1)


def _inflate(view: memoryview) -> bytes:
    # Layout: version byte, tag 80 at offset 1, 4-byte uncompressed size, zlib stream.
    pos = 2
    if len(view) - pos < 4:
        raise EtfDecodeError(f"truncated COMPRESSED (tag {COMPRESSED}) header at offset 1")
    (size,) = _U32.unpack_from(view, pos)
    if size == 0:
        # zlib treats max_length=0 as "unlimited", and no term encodes to zero bytes anyway.
        raise EtfDecodeError(f"COMPRESSED (tag {COMPRESSED}) at offset 1 declares size 0")
    if size > MAX_UNCOMPRESSED_SIZE:
        raise EtfDecodeError(
            f"COMPRESSED (tag {COMPRESSED}) at offset 1 declares {size} bytes, more than the "
            f"{MAX_UNCOMPRESSED_SIZE}-byte cap"
        )
    inflater = zlib.decompressobj()
    try:
        # max_length is what makes a lying header harmless: we never hold more than `size` bytes.
        out = inflater.decompress(view[pos + 4 :], size)
        # At exactly `size` bytes zlib may not have consumed the end-of-stream marker yet; one more
        # byte of allowance tells "finished" apart from "bigger than declared".
        overflow = (
            inflater.decompress(inflater.unconsumed_tail, 1)
            if len(out) == size and not inflater.eof
            else b""
        )
    except zlib.error as exc:
        raise EtfDecodeError(
            f"COMPRESSED (tag {COMPRESSED}) at offset 1 is not valid zlib: {exc}"
        ) from None
    if overflow:
        raise EtfDecodeError(
            f"COMPRESSED (tag {COMPRESSED}) at offset 1 inflates to more than the declared "
            f"{size} bytes"
        )
    if len(out) != size:
        raise EtfDecodeError(
            f"COMPRESSED (tag {COMPRESSED}) at offset 1 inflates to {len(out)} bytes, "
            f"declared {size}"
        )
    if not inflater.eof:
        raise EtfDecodeError(f"COMPRESSED (tag {COMPRESSED}) at offset 1 has a truncated stream")
    if inflater.unused_data:
        raise EtfDecodeError(
            f"trailing bytes after the COMPRESSED (tag {COMPRESSED}) zlib stream at offset 1"
        )
    return out


class _Decoder:
    """One pass over one buffer; `where` qualifies offsets when the buffer was decompressed."""

    __slots__ = ("end", "view", "where")

    def __init__(self, view: memoryview, where: str) -> None:
        self.view = view
        self.end = len(view)
        self.where = where

    def fail(self, message: str) -> EtfDecodeError:
        return EtfDecodeError(message + self.where)

    def need(self, pos: int, count: int, tag: int, tag_offset: int) -> None:
        if count > self.end - pos:
            raise self.fail(
                f"truncated input: tag {tag} at offset {tag_offset} needs {count} more bytes at "
                f"offset {pos}, only {self.end - pos} remain"
            )

    def run(self, pos: int) -> object:
        view = self.view
        end = self.end
        stack: list[_Frame] = []

        while True:
            if pos >= end:
                raise self.fail(f"truncated input: expected a tag at offset {pos}")
            tag_offset = pos
            tag = view[pos]
            pos += 1
            value: object

            if tag == SMALL_INTEGER_EXT:
                self.need(pos, 1, tag, tag_offset)
                value = view[pos]
                pos += 1
            elif tag == INTEGER_EXT:
                self.need(pos, 4, tag, tag_offset)
                (value,) = _I32.unpack_from(view, pos)
                pos += 4
            elif tag == BINARY_EXT:
                self.need(pos, 4, tag, tag_offset)
                (length,) = _U32.unpack_from(view, pos)
                pos += 4
                self.need(pos, length, tag, tag_offset)
                raw = view[pos : pos + length].tobytes()
                pos += length
                try:
                    value = raw.decode("utf-8")
                except UnicodeDecodeError:
                    value = raw
            elif tag in (ATOM_EXT, ATOM_UTF8_EXT, SMALL_ATOM_EXT, SMALL_ATOM_UTF8_EXT):
                if tag in (ATOM_EXT, ATOM_UTF8_EXT):
                    self.need(pos, 2, tag, tag_offset)
                    (length,) = _U16.unpack_from(view, pos)
                    pos += 2
                else:
                    self.need(pos, 1, tag, tag_offset)
                    length = view[pos]
                    pos += 1
                self.need(pos, length, tag, tag_offset)
                value = self.atom(view[pos : pos + length].tobytes(), tag, tag_offset)
                pos += length
            elif tag == NEW_FLOAT_EXT:
                self.need(pos, 8, tag, tag_offset)
                (number,) = _F64.unpack_from(view, pos)
                pos += 8
                value = self.finite(number, tag, tag_offset)
            elif tag == FLOAT_EXT:
                self.need(pos, 31, tag, tag_offset)
                # The 31-byte field is a C string: Erlang ignores everything after the first NUL.
                text = view[pos : pos + 31].tobytes().split(b"\x00", 1)[0]
                pos += 31
                if not _FLOAT_TEXT.fullmatch(text):
                    raise self.fail(f"malformed FLOAT_EXT (tag {tag}) text at offset {tag_offset}")
                value = self.finite(float(text), tag, tag_offset)
            elif tag == STRING_EXT:
                self.need(pos, 2, tag, tag_offset)
                (length,) = _U16.unpack_from(view, pos)
                pos += 2
                self.need(pos, length, tag, tag_offset)
                value = list(view[pos : pos + length])
                pos += length
            elif tag in (SMALL_BIG_EXT, LARGE_BIG_EXT):
                if tag == SMALL_BIG_EXT:
                    self.need(pos, 2, tag, tag_offset)
                    length = view[pos]
                    pos += 1
                else:
                    self.need(pos, 5, tag, tag_offset)
                    (length,) = _U32.unpack_from(view, pos)
                    pos += 4
                # Erlang reads any non-zero sign byte as negative; follow it rather than reject
                # terms that Erlang itself accepts.
                negative = view[pos] != 0
                pos += 1
                self.need(pos, length, tag, tag_offset)
                magnitude = int.from_bytes(view[pos : pos + length], "little")
                pos += length
                value = -magnitude if negative else magnitude
            elif tag == NIL_EXT:
                value = []
            elif tag in (SMALL_TUPLE_EXT, LARGE_TUPLE_EXT, LIST_EXT, MAP_EXT):
                if tag == SMALL_TUPLE_EXT:
                    self.need(pos, 1, tag, tag_offset)
                    count = view[pos]
                    pos += 1
                else:
                    self.need(pos, 4, tag, tag_offset)
                    (count,) = _U32.unpack_from(view, pos)
                    pos += 4
                if tag == LIST_EXT:
                    count += 1  # the tail is one more term
                elif tag == MAP_EXT:
                    count *= 2
                # Every term takes at least one byte, so this rejects absurd counts before any
                # time or memory is spent on them.
                if count > end - pos:
                    raise self.fail(
                        f"tag {tag} at offset {tag_offset} claims {count} terms but only "
                        f"{end - pos} bytes remain"
                    )
                if count == 0:
                    value = {} if tag == MAP_EXT else ()
                elif (
                    tag == LIST_EXT
                    and stack
                    and stack[-1].kind == LIST_EXT
                    and stack[-1].remaining == 1
                ):
                    # A LIST_EXT whose tail is another LIST_EXT (legal, never emitted by Erlang)
                    # just continues the same list.  Extending the open frame instead of nesting
                    # keeps long tail chains from costing depth or quadratic splicing.
                    stack[-1].remaining = count
                    continue
                else:
                    if len(stack) >= MAX_DEPTH:
                        raise self.fail(
                            f"nesting deeper than {MAX_DEPTH} levels: tag {tag} at offset "
                            f"{tag_offset}"
                        )
                    stack.append(_Frame(tag, count, tag_offset))
                    continue
            elif tag in _UNSUPPORTED_NAMES:
                raise self.fail(
                    f"unsupported tag {tag} {_UNSUPPORTED_NAMES[tag]} at offset {tag_offset}"
                )
            else:
                raise self.fail(f"unknown tag {tag} at offset {tag_offset}")

            # Hand the finished value to its parent; completing a parent may complete its
            # grandparent too, and so on.
            while stack:
                frame = stack[-1]
                frame.remaining -= 1
                if frame.kind == MAP_EXT:
                    if frame.remaining % 2:
                        frame.pending_key = self.map_key(value, frame)
                    else:
                        frame.mapping[frame.pending_key] = value
                elif frame.kind == LIST_EXT and not frame.remaining:
                    # Non-canonical but legal: Erlang accepts a proper list as the tail and
                    # splices it in, so only a non-list tail makes the list improper.
                    if not isinstance(value, list):
                        raise self.fail(
                            f"improper list: LIST_EXT (tag {LIST_EXT}) at offset {frame.offset} "
                            f"has a non-list tail"
                        )
                    frame.items.extend(value)
                else:
                    frame.items.append(value)
                if frame.remaining:
                    break
                stack.pop()
                if frame.kind == MAP_EXT:
                    value = frame.mapping
                elif frame.kind == LIST_EXT:
                    value = frame.items
                else:
                    value = tuple(frame.items)
            else:
                if pos != end:
                    raise self.fail(f"{end - pos} trailing bytes at offset {pos}")
                return value

    def finite(self, number: float, tag: int, tag_offset: int) -> float:
        # Erlang has no NaN or infinity and refuses them on decode, so one here is corruption.
        if math.isfinite(number):
            return number
        raise self.fail(f"non-finite float (tag {tag}) at offset {tag_offset}")

    def atom(self, raw: bytes, tag: int, tag_offset: int) -> object:
        if tag in (ATOM_EXT, SMALL_ATOM_EXT):
            name = raw.decode("latin-1")
        else:
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail(
                    f"atom (tag {tag}) at offset {tag_offset} is not valid UTF-8"
                ) from None
        if len(name) > _MAX_ATOM_CHARS:
            raise self.fail(
                f"atom (tag {tag}) at offset {tag_offset} is longer than {_MAX_ATOM_CHARS} "
                f"characters"
            )
        return _ATOM_VALUES.get(name, name)

    def map_key(self, key: object, frame: _Frame) -> object:
        try:
            duplicate = key in frame.mapping
        except TypeError:
            raise self.fail(
                f"map (tag {MAP_EXT}) at offset {frame.offset} has a key of type "
                f"{type(key).__name__}, which cannot be a Python dict key"
            ) from None
        if duplicate:
            # Either a corrupt map, or distinct Erlang keys (1 vs true vs 1.0, the atom ok vs
            # the binary "ok") that become equal in Python; silently dropping a value is worse.
            raise self.fail(
                f"map (tag {MAP_EXT}) at offset {frame.offset} has a duplicate key {key!r} "
                f"once converted to Python"
            )
        return key
