"""The value envelope (contract §2) and belay's JSON rules.

``belay_steps.value`` and ``belay_jobs.result`` are bytea: a first byte of 131
means Erlang External Term Format (what the Elixir reference writes), anything
else is UTF-8 JSON, SQL NULL means no value. belay writes JSON only and reads
both; a value it cannot decode comes back as :class:`Opaque`, never an error,
so a foreign value can't crash a reader or a worker.
"""

from __future__ import annotations

import enum
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from belay.errors import ValidationError
from belay.etf import EtfDecodeError, decode_etf

ETF_VERSION = 131

# orjson would quietly turn dataclasses and datetimes into objects and strings
# that read back as something else; passing them through to a missing
# ``default`` makes it refuse them, so a value's JSON form is never a surprise
# to the reader on the other side.
_STRICT = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


@dataclass(frozen=True)
class Opaque:
    """A stored value belay could not decode; ``data`` holds its exact bytes."""

    data: bytes
    reason: str

    def __repr__(self) -> str:
        return f"Opaque({len(self.data)} bytes: {self.reason})"


def dumps(value: Any, *, what: str = "value") -> bytes:
    """Serialize to JSON, refusing what would read back as something else.

    NaN and infinities are refused (orjson would write them as ``null``), and so
    are datetimes, dataclasses, sets and bytes. A few types convert as every
    JSON encoder does, the same on both paths (documented in docs/client.md):
    tuples become lists, UUIDs their canonical string, Enums their value, and
    subclasses of str/int/float their base value. Integers of any size are
    written exactly.
    """
    try:
        data = orjson.dumps(value, option=_STRICT)
    except TypeError as exc:
        if "ecursion" in str(exc):
            raise ValidationError(
                f"{what} is nested too deeply or contains itself; JSON needs a finite tree"
            ) from None
        if "64-bit" in str(exc):
            # JSON (and jsonb, and the reference's decoder) has no integer
            # limit; only orjson does. The stdlib writes them exactly.
            return _dumps_exact(value, what)
        raise ValidationError(
            f"{what} is not JSON-serializable ({exc}); use dicts with str keys, lists, str, "
            "int, float, bool and None"
        ) from None
    if b"null" in data:
        _check_finite(value, what)
    return data


def _dumps_exact(value: Any, what: str) -> bytes:
    """The slow path for integers beyond 64 bits, held to orjson's strictness."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if id(item) in seen:
                raise ValidationError(f"{what} contains itself; JSON needs a finite tree")
            seen.add(id(item))
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise ValidationError(f"{what} is not JSON-serializable (a dict key is not a str)")
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, enum.Enum):
            stack.append(item.value)
        elif item is not None and not isinstance(item, (str, int, float, uuid.UUID)):
            raise ValidationError(
                f"{what} is not JSON-serializable ({type(item).__name__}); use dicts with str "
                "keys, lists, str, int, float, bool and None"
            )
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_as_orjson_would)
    except ValueError:
        raise ValidationError(f"{what} contains a float JSON cannot represent") from None
    except RecursionError:
        raise ValidationError(f"{what} is nested too deeply for JSON") from None
    return text.encode()


def _as_orjson_would(item: Any) -> Any:
    """The stdlib path's conversions, the same as orjson's (docs/client.md)."""
    if isinstance(item, enum.Enum):
        return item.value
    if isinstance(item, uuid.UUID):
        return str(item)
    raise TypeError(type(item).__name__)


def _check_finite(value: Any, what: str) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValidationError(f"{what} contains {item!r}, which JSON cannot represent")
        if isinstance(item, enum.Enum):
            stack.append(item.value)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


# orjson reads integers beyond 64 bits as floats, silently losing digits; a
# run of 19+ digits (2**63 has 19) sends the text to the exact stdlib parser.
_LONG_NUMBER = re.compile(rb"\d{19}")
_EMPTY = (b"{}", b"[]")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON exactly: integers of any size stay integers."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) == 2 and raw in _EMPTY:
        # Most meta and errors columns: a claim decodes three documents a job.
        return {} if raw == b"{}" else []
    if _LONG_NUMBER.search(raw):
        return json.loads(raw)
    return orjson.loads(raw)


def parse_text(text: str | bytes, *, what: str) -> Any:
    """JSON text from a person or a peer (an HTTP body, a CLI argument), strictly:
    UTF-8, no NaN or Infinity, no number beyond a double, and a
    ValidationError naming ``what`` for anything else, nesting too deep for
    Python's parser included (it recurses). Strings may still hold NUL or lone
    surrogates (``"\\ud800"`` is valid JSON text): the writer checks those."""
    try:
        decoded = text.decode("utf-8") if isinstance(text, bytes) else text
        return json.loads(decoded, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValidationError(
            f"{what} is not valid JSON: it nests deeper than belay parses; send a flatter value"
        ) from None
    except UnicodeDecodeError:
        raise ValidationError(f"{what} is not valid JSON: its bytes are not UTF-8") from None
    except ValueError as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValidationError(f"{what} is not valid JSON: {message[:200]}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"the number {raw[:40]} is too large for a double")
    return value


def dumps_object(value: Any, *, what: str) -> bytes:
    """Serialize a JSON object (input, meta, signal payloads must be objects)."""
    if not isinstance(value, Mapping):
        raise ValidationError(
            f"{what} must be a dict (a JSON object), got {type(value).__name__}"
        )
    data = dumps(value if isinstance(value, dict) else dict(value), what=what)
    if b"\\u0000" in data:
        _check_no_nul(value, what)
    return data


def _check_no_nul(value: Any, what: str) -> None:
    """jsonb (where objects are stored) refuses ``\\u0000`` in any string; a
    bytea value (step values, results) holds it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ValidationError(
                    f"{what} contains a NUL character (\\x00) in {item[:40]!r}, which "
                    "PostgreSQL's jsonb cannot store; remove it or encode the text (e.g. base64)"
                )
        elif isinstance(item, enum.Enum):
            stack.append(item.value)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def encode_value(value: Any, *, what: str = "value") -> bytes:
    """Envelope-encode a step value or job result (always JSON)."""
    return dumps(value, what=what)


def decode_value(data: bytes | memoryview | None) -> Any:
    """Decode an envelope: ETF or JSON by the first byte; ``None`` for SQL NULL."""
    if data is None:
        return None
    raw = bytes(data)
    if not raw:
        return Opaque(raw, "empty value")
    if raw[0] == ETF_VERSION:
        try:
            return decode_etf(raw)
        except EtfDecodeError as exc:
            return Opaque(raw, f"undecodable Erlang term: {exc}")
    try:
        return loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return Opaque(raw, f"not JSON: {exc}")
