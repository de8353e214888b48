"""Hostile input for the fuzz/property layer: text and values a careless user or an
attacker sends, shared by the client, HTTP, dashboard and MCP fuzz tests.

Each surface must answer these with its own "bad input" (``belay.ValidationError``,
a 400 naming the field, a tool error) and write nothing — never a 500, a raw
traceback or a half-done write.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# The characters that break PostgreSQL text or a careless parser: NUL, a lone
# surrogate of each half, non-ASCII digits that str.isdigit() accepts and int()
# refuses, a byte-order mark, a right-to-left override.
HOSTILE_CHARS = ("\x00", "\ud800", "\udfff", "²", "\u0663", "\ufeff", "\u202e")

# Limits from belay.names: names are capped at 255 bytes, keys at 1024.
HUGE = 8_192


def hostile_text(*, min_size: int = 0) -> st.SearchStrategy[str]:
    """Strings that always hold at least one hostile character or are huge."""
    seeded = st.builds(
        lambda head, bad, tail: head + bad + tail,
        st.text(max_size=8),
        st.sampled_from(HOSTILE_CHARS),
        st.text(max_size=8),
    )
    huge = st.integers(min_value=256, max_value=HUGE).map(lambda n: "q" * n)
    return st.one_of(seeded, huge).filter(lambda s: len(s) >= min_size)


def any_text() -> st.SearchStrategy[str]:
    """Ordinary and hostile text mixed, surrogates included (hypothesis's default
    ``st.text()`` leaves surrogates out)."""
    return st.one_of(
        st.text(st.characters(codec=None, exclude_categories=()), max_size=40),
        hostile_text(),
    )


def deep(depth: int, leaf: Any = 1) -> Any:
    """A JSON value nested ``depth`` levels: lists within lists."""
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


def hostile_json() -> st.SearchStrategy[Any]:
    """JSON-ish values with hostile strings, NaN/inf and very deep nesting."""
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), any_text()
    )
    tree = st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(any_text(), inner, max_size=3),
        ),
        max_leaves=10,
    )
    return st.one_of(tree, st.sampled_from([2_000, 10_000]).map(deep))
