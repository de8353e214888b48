"""Tests for belay.etf, the Erlang External Term Format decoder.

Real-world correctness comes from fixtures/etf/vectors.json, produced by Erlang/OTP itself (see
fixtures/etf/make_vectors.escript); robustness comes from hypothesis round-trips through a
test-only encoder, fuzzing, mutation and truncation.  Nothing here needs Erlang or a database.
"""

from __future__ import annotations

import contextlib
import math
import random
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from belay.etf import MAX_DEPTH, MAX_UNCOMPRESSED_SIZE, EtfDecodeError, decode_etf
from tests.helpers import etf_vectors, from_expected

VECTORS = etf_vectors()

# No example database: it would litter the shared work tree with a .hypothesis directory.
PROPERTY = settings(database=None, max_examples=300, deadline=None)
FUZZ = settings(
    database=None,
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- expected-value plumbing ----------------------------------------------------------------


def assert_same(actual: object, expected: object, path: str = "$") -> None:
    """Equality that also insists on identical types: True is not 1, (1,) is not [1]."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, float):
        assert isinstance(actual, float)
        # Bitwise, so -0.0 and 0.0 are told apart.
        assert struct.pack(">d", actual) == struct.pack(">d", expected), f"{path}: {actual!r}"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple))
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{index}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert actual.keys() == expected.keys(), f"{path}: keys differ"
        for key, value in expected.items():
            # Dict lookup treats 1 and True as the same key; compare the stored keys strictly too.
            actual_key = next(k for k in actual if k == key)
            assert_same(actual_key, key, f"{path}.<key {key!r}>")
            assert_same(actual[key], value, f"{path}[{key!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def is_error(vector: dict[str, Any]) -> bool:
    return bool(vector["expected"] == {"error": True})


VALUE_VECTORS = [v for v in VECTORS if not is_error(v)]
ERROR_VECTORS = [v for v in VECTORS if is_error(v)]


# --- real vectors from Erlang/OTP -----------------------------------------------------------


@pytest.mark.parametrize("vector", VALUE_VECTORS, ids=lambda v: v["name"])
def test_vector_decodes_to_expected_value(vector: dict[str, Any]) -> None:
    actual = decode_etf(bytes.fromhex(vector["etf_hex"]))
    assert_same(actual, from_expected(vector["expected"]))


@pytest.mark.parametrize("vector", ERROR_VECTORS, ids=lambda v: v["name"])
def test_error_vector_raises(vector: dict[str, Any]) -> None:
    with pytest.raises(EtfDecodeError):
        decode_etf(bytes.fromhex(vector["etf_hex"]))


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_every_strict_prefix_of_a_vector_raises(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["etf_hex"])
    for end in range(len(data)):
        with pytest.raises(EtfDecodeError):
            decode_etf(data[:end])


def test_vectors_cover_every_supported_top_level_tag() -> None:
    # Guards against someone regenerating the fixture with a script that lost cases.
    top_level_tags = {bytes.fromhex(v["etf_hex"])[1] for v in VALUE_VECTORS}
    # 97-100: integers, FLOAT_EXT, ATOM_EXT; 104-111: tuples, lists, binaries, bigs.
    supported = {*range(97, 101), *range(104, 112), 70, 80, 115, 116, 118, 119}
    assert supported <= top_level_tags
    error_tags = {bytes.fromhex(v["etf_hex"])[1] for v in ERROR_VECTORS}
    assert {77, 88, 89, 90, 112, 113} <= error_tags


def test_typical_belay_step_result() -> None:
    (vector,) = [v for v in VECTORS if v["name"] == "belay_step_result"]
    assert decode_etf(bytes.fromhex(vector["etf_hex"])) == {
        "summary": "done",
        "turn": 3,
        "done?": True,
    }


# --- explicit edge cases --------------------------------------------------------------------


def test_error_is_a_value_error_naming_tag_and_offset() -> None:
    (pid,) = [v for v in VECTORS if v["name"] == "error_pid"]
    with pytest.raises(ValueError, match=r"tag 88 .*offset 1") as info:
        decode_etf(bytes.fromhex(pid["etf_hex"]))
    assert isinstance(info.value, EtfDecodeError)
    with pytest.raises(EtfDecodeError, match=r"unknown tag 0 at offset 3"):
        decode_etf(b"\x83h\x01\x00")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"\x82a\x01", b"a\x01", b"\x83"],
    ids=["empty", "zero", "version_130", "no_version", "version_only"],
)
def test_bad_or_missing_version_or_body(data: bytes) -> None:
    with pytest.raises(EtfDecodeError):
        decode_etf(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x83a\x01\x00",
        b"\x83jj",
        b"\x83t\x00\x00\x00\x00garbage",
        b"\x83P\x00\x00\x00\x02" + zlib.compress(b"a\x01") + b"x",
    ],
    ids=["after_int", "after_nil", "after_map", "after_zlib_stream"],
)
def test_trailing_garbage_raises(data: bytes) -> None:
    with pytest.raises(EtfDecodeError, match="trailing"):
        decode_etf(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x83m\xff\xff\xff\xffabcd",  # BINARY_EXT claiming 4 GiB
        b"\x83l\xff\xff\xff\xffa\x01j",  # LIST_EXT claiming 4 billion elements
        b"\x83i\xff\xff\xff\xffa\x01",  # LARGE_TUPLE_EXT
        b"\x83t\x7f\xff\xff\xffa\x01a\x01",  # MAP_EXT
        b"\x83o\xff\xff\xff\xff\x00\x01",  # LARGE_BIG_EXT
        b"\x83k\xff\xffab",  # STRING_EXT
        b"\x83d\xff\xffab",  # ATOM_EXT
        b"\x83v\xff\xffab",  # ATOM_UTF8_EXT
        b"\x83s\xffab",  # SMALL_ATOM_EXT
        b"\x83n\xff\x00\x01",  # SMALL_BIG_EXT
        b"\x83h\xffa\x01",  # SMALL_TUPLE_EXT
    ],
)
def test_huge_length_claims_fail_fast(data: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(EtfDecodeError):
            decode_etf(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def nested_lists(depth: int) -> bytes:
    # [[[...[]...]]]: each level is LIST_EXT with one element, closed by its NIL tail.
    return b"\x83" + b"l\x00\x00\x00\x01" * depth + b"j" + b"j" * depth


def nested_tuples(depth: int) -> bytes:
    return b"\x83" + b"h\x01" * depth + b"a\x07"


def measure_depth(value: object) -> int:
    depth = 0
    while isinstance(value, (list, tuple)) and value:
        assert len(value) == 1
        value = value[0]
        depth += 1
    return depth


@pytest.mark.parametrize("build", [nested_lists, nested_tuples])
def test_deep_nesting_raises_instead_of_overflowing(build: Callable[[int], bytes]) -> None:
    with pytest.raises(EtfDecodeError, match="nesting"):
        decode_etf(build(100_000))
    with pytest.raises(EtfDecodeError, match="nesting"):
        decode_etf(build(MAX_DEPTH + 1))


@pytest.mark.parametrize("build", [nested_lists, nested_tuples])
def test_nesting_up_to_the_limit_decodes(build: Callable[[int], bytes]) -> None:
    assert measure_depth(decode_etf(build(MAX_DEPTH))) == MAX_DEPTH


def test_long_chain_of_list_tails_is_one_flat_list() -> None:
    # [0 | [1 | [2 | ...]]] with every tail its own LIST_EXT: legal, and must not count as nesting.
    count = 3 * MAX_DEPTH
    data = b"\x83" + b"".join(b"l\x00\x00\x00\x01a" + bytes([i % 256]) for i in range(count))
    assert decode_etf(data + b"j") == [i % 256 for i in range(count)]
    assert decode_etf(data + b"k\x00\x02ab") == [i % 256 for i in range(count)] + [97, 98]
    with pytest.raises(EtfDecodeError, match="improper"):
        decode_etf(data + b"a\x01")


def compressed(declared_size: int, payload: bytes) -> bytes:
    return b"\x83P" + struct.pack(">I", declared_size) + payload


def test_zip_bomb_with_lying_size_is_refused_without_inflating_it() -> None:
    # 32 MiB of a valid BINARY_EXT inflates from ~32 KiB; the header claims only 1000 bytes.
    body = b"m" + struct.pack(">I", 32 * 1024 * 1024 - 5) + bytes(32 * 1024 * 1024 - 5)
    bomb = compressed(1000, zlib.compress(body, 9))
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(EtfDecodeError, match="more than the declared"):
            decode_etf(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


def test_compressed_size_over_the_cap_is_refused_before_inflating() -> None:
    with pytest.raises(EtfDecodeError, match="cap"):
        decode_etf(compressed(MAX_UNCOMPRESSED_SIZE + 1, zlib.compress(b"a\x01")))
    with pytest.raises(EtfDecodeError, match="cap"):
        decode_etf(compressed(0xFFFFFFFF, b""))


NESTED_COMPRESSED = b"P\x00\x00\x00\x02" + zlib.compress(b"a\x01")


@pytest.mark.parametrize(
    ("declared", "payload", "match"),
    [
        (3, zlib.compress(b"a\x01"), "inflates to 2 bytes"),
        (1, zlib.compress(b"a\x01"), "more than the declared"),
        (0, zlib.compress(b""), "size 0"),
        (2, b"not zlib at all", "not valid zlib"),
        (2, zlib.compress(b"a\x01")[:-3], "truncated"),
        (2, zlib.compress(b"a\x01") + b"\x00", "trailing"),
        (5, zlib.compress(b"a\x01a\x02"), "inflates to 4 bytes"),
        (4, zlib.compress(b"a\x01a\x02"), "trailing"),
        (1, zlib.compress(b"\x83"), "unknown tag 131"),
        (len(NESTED_COMPRESSED), zlib.compress(NESTED_COMPRESSED), "tag 80"),
    ],
)
def test_malformed_compressed_payloads(declared: int, payload: bytes, match: str) -> None:
    with pytest.raises(EtfDecodeError, match=match):
        decode_etf(compressed(declared, payload))


def test_compressed_round_trip_at_exact_size() -> None:
    body = b"l\x00\x00\x00\x03a\x01a\x02a\x03j"
    assert decode_etf(compressed(len(body), zlib.compress(body))) == [1, 2, 3]


@pytest.mark.parametrize(
    "data",
    [
        b"\x83F\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
        b"\x83F\x7f\xf0\x00\x00\x00\x00\x00\x00",  # +inf
        b"\x83F\xff\xf0\x00\x00\x00\x00\x00\x00",  # -inf
        b"\x83c" + b"1e5".ljust(31, b"\x00"),  # Erlang insists on a decimal point
        b"\x83c" + b"nan".ljust(31, b"\x00"),
        b"\x83c" + b"inf".ljust(31, b"\x00"),
        b"\x83c" + b" 1.5".ljust(31, b"\x00"),
        b"\x83c" + b"1_0.5".ljust(31, b"\x00"),
        b"\x83c" + b"1.0e999".ljust(31, b"\x00"),  # overflows to inf
        b"\x83c" + "\u0661.5".encode().ljust(31, b"\x00"),  # Arabic-Indic digit one
        b"\x83c" + b"".ljust(31, b"\x00"),
    ],
)
def test_bad_floats_raise(data: bytes) -> None:
    with pytest.raises(EtfDecodeError):
        decode_etf(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x83d\x01\x00" + b"a" * 256,  # 256 characters: Erlang's limit is 255
        b"\x83v\x01\x00" + b"a" * 256,
        b"\x83w\x02\xc3\x28",  # invalid UTF-8 in an ATOM_UTF8 atom
        b"\x83v\x00\x01\xff",
    ],
)
def test_bad_atoms_raise(data: bytes) -> None:
    with pytest.raises(EtfDecodeError):
        decode_etf(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x83l\x00\x00\x00\x01a\x01a\x02",  # [1 | 2]
        b"\x83l\x00\x00\x00\x01a\x01h\x00",  # [1 | {}]
        b"\x83l\x00\x00\x00\x01a\x01t\x00\x00\x00\x00",  # [1 | #{}]
        b"\x83t\x00\x00\x00\x02a\x01a\x01a\x01a\x02",  # duplicate key
        b"\x83t\x00\x00\x00\x01ja\x01",  # [] as key
        b"\x83t\x00\x00\x00\x01k\x00\x01aa\x01",  # "a" (a charlist) as key
        b"\x83t\x00\x00\x00\x01t\x00\x00\x00\x00a\x01",  # #{} as key
    ],
)
def test_improper_lists_and_bad_map_keys_raise(data: bytes) -> None:
    with pytest.raises(EtfDecodeError):
        decode_etf(data)


@pytest.mark.parametrize(
    "tag", [67, 77, 80, 82, 88, 89, 90, 101, 102, 103, 112, 113, 114, 117, 120, 0, 255]
)
def test_unsupported_tags_inside_a_tuple_raise(tag: int) -> None:
    with pytest.raises(EtfDecodeError, match=rf"tag {tag} .*offset 3"):
        decode_etf(bytes([131, 104, 1, tag]) + bytes(40))


def test_accepts_bytearray_and_memoryview() -> None:
    data = bytes.fromhex("836d00000002c3a9")
    assert decode_etf(bytearray(data)) == "\u00e9"
    assert decode_etf(memoryview(data)) == "\u00e9"
    assert decode_etf(memoryview(b"xx" + data)[2:]) == "\u00e9"


def test_big_integer_sign_and_padding_follow_erlang() -> None:
    assert decode_etf(b"\x83n\x00\x00") == 0
    assert decode_etf(b"\x83n\x00\x01") == 0
    assert decode_etf(b"\x83n\x02\x00\x05\x00") == 5
    assert decode_etf(b"\x83n\x01\x02\x05") == -5


# --- a test-only encoder for property tests -------------------------------------------------
#
# It deliberately picks at random among all the encodings Erlang would accept for a value
# (SMALL_BIG for a small integer, FLOAT_EXT, any of the four atom tags, STRING_EXT for byte-sized
# integer lists, lists split across LIST_EXT tails, compression) so round-trips cover every tag.

SPECIAL_ATOMS: dict[object, str] = {None: "nil", True: "true", False: "false"}


def encode_atom(name: str, rng: random.Random) -> bytes:
    tag = rng.choice([b"w", b"v", b"s", b"d"])
    raw = b""
    if tag in (b"s", b"d"):  # SMALL_ATOM_EXT, ATOM_EXT: Latin-1 only
        try:
            raw = name.encode("latin-1")
        except UnicodeEncodeError:
            tag = b"w" if tag == b"s" else b"v"
    if tag in (b"w", b"v"):  # SMALL_ATOM_UTF8_EXT, ATOM_UTF8_EXT
        raw = name.encode("utf-8")
    if tag in (b"w", b"s") and len(raw) <= 255:
        return tag + bytes([len(raw)]) + raw
    return (b"v" if tag == b"w" else tag) + struct.pack(">H", len(raw)) + raw


def encode_int(value: int, rng: random.Random) -> bytes:
    options = ["big"]
    if 0 <= value <= 255:
        options.append("small")
    if -(2**31) <= value < 2**31:
        options.append("integer")
    choice = rng.choice(options)
    if choice == "small":
        return b"a" + bytes([value])
    if choice == "integer":
        return b"b" + struct.pack(">i", value)
    magnitude = abs(value)
    digits = magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "little")
    sign = b"\x01" if value < 0 else b"\x00"
    if len(digits) <= 255 and rng.random() < 0.5:
        return b"n" + bytes([len(digits)]) + sign + digits
    return b"o" + struct.pack(">I", len(digits)) + sign + digits


def encode_body(value: object, rng: random.Random) -> bytes:
    if value is None or isinstance(value, bool):
        return encode_atom(SPECIAL_ATOMS[value], rng)
    if isinstance(value, int):
        return encode_int(value, rng)
    if isinstance(value, float):
        if rng.random() < 0.5:
            return b"F" + struct.pack(">d", value)
        return b"c" + (b"%.20e" % value).ljust(31, b"\x00")
    if isinstance(value, str):
        if len(value) <= 255 and value not in ("nil", "true", "false") and rng.random() < 0.3:
            return encode_atom(value, rng)
        value = value.encode("utf-8")
    if isinstance(value, bytes):
        return b"m" + struct.pack(">I", len(value)) + value
    if isinstance(value, tuple):
        items = b"".join(encode_body(item, rng) for item in value)
        if len(value) <= 255 and rng.random() < 0.5:
            return b"h" + bytes([len(value)]) + items
        return b"i" + struct.pack(">I", len(value)) + items
    if isinstance(value, list):
        return encode_list(value, rng)
    if isinstance(value, dict):
        pairs = b"".join(encode_body(k, rng) + encode_body(v, rng) for k, v in value.items())
        return b"t" + struct.pack(">I", len(value)) + pairs
    raise TypeError(f"cannot encode {type(value)}")


def encode_list(value: list[object], rng: random.Random) -> bytes:
    is_charlist = all(type(item) is int and 0 <= item <= 255 for item in value)
    if value and is_charlist and len(value) <= 65535 and rng.random() < 0.5:
        return b"k" + struct.pack(">H", len(value)) + bytes(cast("list[int]", value))
    if not value and rng.random() < 0.7:
        return b"j"
    # Erlang also accepts a proper list as the tail of LIST_EXT, so sometimes split there.
    head = rng.randint(0, len(value)) if rng.random() < 0.3 else len(value)
    items = b"".join(encode_body(item, rng) for item in value[:head])
    tail = encode_list(value[head:], rng) if head < len(value) else b"j"
    return b"l" + struct.pack(">I", head) + items + tail


def encode(value: object, rng: random.Random) -> bytes:
    body = encode_body(value, rng)
    if rng.random() < 0.2:
        return b"\x83P" + struct.pack(">I", len(body)) + zlib.compress(body)
    return b"\x83" + body


def expected_of(value: object) -> object:
    """What decode_etf gives back for `value` after a trip through the encoder."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    if isinstance(value, list):
        return [expected_of(item) for item in value]
    if isinstance(value, tuple):
        return tuple(expected_of(item) for item in value)
    if isinstance(value, dict):
        return {expected_of(k): expected_of(v) for k, v in value.items()}
    return value


finite_floats = st.floats(allow_nan=False, allow_infinity=False)
integers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.integers(min_value=-(2**4000), max_value=2**4000),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    integers,
    finite_floats,
    st.text(),
    st.binary(),
)
keys = st.recursive(
    st.one_of(st.none(), st.booleans(), integers, finite_floats, st.text(), st.binary()),
    lambda children: st.lists(children, max_size=3).map(tuple),
    max_leaves=6,
)
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.lists(children, max_size=6).map(tuple),
        st.dictionaries(keys, children, max_size=6),
    ),
    max_leaves=30,
)


def keys_survive_decoding(value: object) -> bool:
    """False if two distinct dict keys would collide after decoding (b"x" becomes "x")."""
    if isinstance(value, dict):
        decoded_keys = [expected_of(k) for k in value]
        if len(set(decoded_keys)) != len(decoded_keys):
            return False
        return all(keys_survive_decoding(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(keys_survive_decoding(item) for item in value)
    return True


@PROPERTY
@given(value=values, rng=st.randoms(use_true_random=False))
def test_round_trip(value: object, rng: random.Random) -> None:
    if not keys_survive_decoding(value):
        with pytest.raises(EtfDecodeError, match="duplicate key"):
            decode_etf(encode(value, rng))
        return
    assert_same(decode_etf(encode(value, rng)), expected_of(value))


@PROPERTY
@given(value=values, rng=st.randoms(use_true_random=False))
def test_every_strict_prefix_of_an_encoding_raises(value: object, rng: random.Random) -> None:
    data = encode(value, rng)
    for end in range(len(data)):
        with pytest.raises(EtfDecodeError):
            decode_etf(data[:end])


def decode_or_reject(data: bytes) -> None:
    """The robustness contract: a value or EtfDecodeError, never any other exception."""
    with contextlib.suppress(EtfDecodeError):
        decode_etf(data)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_after_version_byte(tail: bytes) -> None:
    decode_or_reject(b"\x83" + tail)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decode_or_reject(data)


@FUZZ
@given(
    value=values,
    rng=st.randoms(use_true_random=False),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0), st.integers(0)),
        min_size=1,
        max_size=4,
    ),
)
def test_fuzz_mutated_valid_encodings(
    value: object, rng: random.Random, edits: list[tuple[str, int, int]]
) -> None:
    # Random bytes rarely get past the first length check; mutating real encodings reaches the
    # deep paths (nested containers, compressed payloads, big integers).
    data = bytearray(encode(value, rng))
    for kind, position, byte in edits:
        index = position % (len(data) + 1)
        if kind == "insert":
            data.insert(index, byte % 256)
        elif index < len(data):
            if kind == "flip":
                data[index] ^= 1 << (byte % 8)
            else:
                del data[index]
    decode_or_reject(bytes(data))


@PROPERTY
@given(st.lists(finite_floats, max_size=20))
def test_float_ext_text_round_trips_exactly(floats: list[float]) -> None:
    # Erlang's old FLOAT_EXT keeps 21 significant digits, enough to be exact for doubles.
    for value in floats:
        data = b"\x83c" + (b"%.20e" % value).ljust(31, b"\x00")
        decoded = decode_etf(data)
        assert isinstance(decoded, float)
        assert math.copysign(1.0, decoded) == math.copysign(1.0, value)
        assert decoded == value
