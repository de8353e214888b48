"""The value envelope (contract §2) and belay's JSON rules; no database needed."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from belay import Opaque, ValidationError
from belay.codec import decode_value, dumps, encode_value, loads

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


@given(json_values)
def test_json_values_round_trip_through_the_envelope(value):
    data = encode_value(value)
    assert data[:1] != b"\x83"  # never mistaken for an Erlang term
    assert decode_value(data) == value
    # And a foreign JSON reader gets the same value.
    assert json.loads(data) == value


def test_sql_null_is_no_value():
    assert decode_value(None) is None


def test_json_null_is_none():
    assert decode_value(b"null") is None


def test_first_byte_131_means_erlang_term_format():
    # term_to_binary(1) and term_to_binary(<<"hi">>)
    assert decode_value(b"\x83a\x01") == 1
    assert decode_value(b"\x83m\x00\x00\x00\x02hi") == "hi"


def test_undecodable_values_come_back_opaque_with_their_bytes():
    garbage = b"\x83\xff\x00garbage"
    value = decode_value(garbage)
    assert isinstance(value, Opaque) and value.data == garbage
    assert "Erlang" in value.reason
    not_json = b"\x00\x01 not json"
    value = decode_value(not_json)
    assert isinstance(value, Opaque) and value.data == not_json
    invalid_utf8 = b'"\xff\xfe"'
    assert isinstance(decode_value(invalid_utf8), Opaque)
    assert isinstance(decode_value(b""), Opaque)


@given(st.binary())
def test_any_bytes_decode_without_raising(data):
    decode_value(data)
    decode_value(b"\x83" + data)


def test_memoryview_input_is_accepted():
    assert decode_value(memoryview(b'{"a": 1}')) == {"a": 1}


def test_huge_integers_from_foreign_json_still_decode():
    big = 2**100
    assert decode_value(str(big).encode()) == big
    assert loads(f'{{"n": {big}}}') == {"n": big}


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        {"a": [1.0, float("inf")]},
        {"a": {"b": -math.inf}},
    ],
)
def test_non_finite_floats_are_refused_not_written_as_null(value):
    with pytest.raises(ValidationError, match="JSON cannot represent"):
        dumps(value)


def test_none_alone_is_fine():
    assert dumps({"a": None, "b": "null"}) == b'{"a":null,"b":"null"}'


@dataclasses.dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    "value",
    [datetime(2026, 1, 1, tzinfo=timezone.utc), Point(1), {1: "int key"}, {"s": {1, 2}}, b"raw"],
)
def test_values_json_would_change_are_refused(value):
    with pytest.raises(ValidationError, match="not JSON-serializable"):
        dumps(value)
