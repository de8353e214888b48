"""Queue options and the admission math, without a database (belay/queues.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import belay
from belay.queues import (
    QueueSpec,
    Rate,
    adapt_limit,
    merge,
    parse_queues,
    parse_spec,
    rate_admits,
    rate_allowance,
)


def test_a_bare_limit_and_a_name_list_give_plain_queues() -> None:
    assert parse_queues({"default": 4}) == {"default": QueueSpec("default", limit=4)}
    assert parse_queues(["a"]) == {"a": QueueSpec("a", limit=10)}
    assert not parse_spec("a", 3).admitted


def test_full_options_parse_into_a_spec() -> None:
    spec = parse_spec("ai", {
        "limit": {"min": 2, "max": 50}, "global_limit": 20,
        "rate": {"allowed": 100_000, "period": 60, "resource": "anthropic", "estimate": 2_000},
        "partition": {"input": "tenant_id"},
    })
    assert spec == QueueSpec(
        "ai", limit=50, limit_min=2, global_limit=20,
        rate=Rate(100_000, 60, "anthropic", 2_000), partition=("input", "tenant_id"),
    )
    assert spec.admitted and spec.adaptive
    assert spec.per_key_limit == 20
    assert spec.rate is not None and spec.rate.bucket("ai") == "resource:anthropic"
    assert Rate(5, 1).bucket("mail") == "queue:mail"
    assert parse_spec("t", {"limit": 6, "partition": {"meta": "k"}}).per_key_limit == 6


def test_options_round_trip_through_the_row_shape() -> None:
    spec = parse_spec("q", {"limit": {"min": 1, "max": 4}, "rate": {"allowed": 9, "period": 2},
                            "partition": {"meta": "org"}, "global_limit": 3, "paused": True})
    opts = spec.to_opts()
    # The reference's shape: partition as [source, key], the limit bounds as a map.
    assert opts["partition"] == ["meta", "org"]
    assert opts["limit"] == {"min": 1, "max": 4}
    assert parse_spec("q", opts) == spec


@pytest.mark.parametrize(("value", "message"), [
    (0, "the limit is a whole number from 1 to"),
    (True, "give a limit"),
    ("5", "give a limit"),
    ({"limit": 0}, "the limit is a whole number from 1 to"),
    ({"limt": 3}, "unknown option(s) 'limt'"),
    ({"limit": {"min": 5, "max": 2}}, "min <= max"),
    ({"limit": {"min": 1}}, "an adaptive limit is"),
    ({"global_limit": 0}, "global_limit is a whole number from 1 to"),
    ({"global_limit": 10**20}, "global_limit is a whole number from 1 to 2147483647"),
    (2**31, "the limit is a whole number from 1 to 2147483647"),
    ({"rate": {"allowed": 2**63, "period": 5}}, "rate allowed is a whole number"),
    ({"rate": {"allowed": 10, "period": 5, "resource": "r\x00"}}, "without NUL"),
    ({"rate": 5}, "rate is a dict"),
    ({"rate": {"allowed": 10}}, "rate takes allowed and period"),
    ({"rate": {"allowed": 10, "period": 0}}, "rate period"),
    ({"rate": {"allowed": 10, "period": 5, "burst": 1}}, "rate takes allowed"),
    ({"rate": {"allowed": 10, "period": 5, "estimate": 20}}, "no job could ever be admitted"),
    ({"rate": {"allowed": 10, "period": 5, "resource": ""}}, "resource is a non-empty string"),
    ({"partition": "tenant"}, "partition is"),
    ({"partition": {"body": "tenant"}}, "partition is"),
    ({"partition": {"input": "a", "meta": "b"}}, "partition is"),
    ({"paused": "yes"}, "paused is true or false"),
])
def test_bad_options_name_the_queue_and_the_fix(value: object, message: str) -> None:
    with pytest.raises(belay.ConfigurationError) as caught:
        parse_spec("jobs", value)
    assert message in str(caught.value)
    assert "'jobs'" in str(caught.value)


def test_bad_queue_sets_are_refused() -> None:
    for queues in ({}, "default", {"": 1}):
        with pytest.raises(belay.ConfigurationError):
            parse_queues(queues)  # type: ignore[arg-type]


def test_a_row_replaces_a_static_queue_and_a_pause_only_row_just_pauses() -> None:
    static = parse_queues({"a": {"limit": 3, "global_limit": 2}, "b": 4})
    effective, invalid = merge(static, {
        "a": {"limit": 7},                     # replaces: no global limit any more
        "b": {"paused": True},                 # pauses the static queue
        "c": {"paused": True},                 # no such queue here: nothing
        "d": {"limit": 2, "partition": ["input", "t"]},   # a new queue, reference shape
        "e": {"limit": "many"},                # bad: skipped with its reason
        "f": ["not", "an", "object"],
    })
    assert effective["a"] == QueueSpec("a", limit=7)
    assert effective["b"] == QueueSpec("b", limit=4, paused=True)
    assert "c" not in effective
    assert effective["d"] == QueueSpec("d", limit=2, partition=("input", "t"))
    assert set(invalid) == {"e", "f"} and "limit" in invalid["e"]
    assert "e" not in effective
    # A row whose pause was lifted leaves the static spec as it was.
    assert merge(static, {"b": {"paused": False}})[0]["b"] == static["b"]
    # Null options mean "not set" (another SDK may write them).
    assert merge({}, {"g": {"limit": 2, "rate": None}})[0]["g"] == QueueSpec("g", limit=2)


# -- The sliding window (§6) -----------------------------------------------------------


def test_the_window_weighs_the_previous_window_by_what_it_still_covers() -> None:
    # 15 s into a 60 s window: three quarters of the previous window still count.
    assert rate_allowance(previous=40, current=10, allowed=100, period=60, epoch=615) == 60
    # At the window's start the previous one counts fully; at its end not at all.
    assert rate_allowance(previous=40, current=0, allowed=100, period=60, epoch=600) == 60
    assert rate_allowance(previous=40, current=0, allowed=100, period=60, epoch=659) == 99
    # Half up, as the reference rounds (Python's round would give 2 here: half to even).
    assert rate_allowance(previous=5, current=0, allowed=10, period=2, epoch=1) == 7
    # Overdrawn windows admit nothing; credits never admit beyond ``allowed``.
    assert rate_allowance(previous=0, current=150, allowed=100, period=60, epoch=600) == 0
    assert rate_allowance(previous=0, current=-500, allowed=100, period=60, epoch=600) == 100


def test_admission_divides_the_remaining_units_by_the_estimate() -> None:
    assert rate_admits(demand=10, allowance=10_000, estimate=2_000) == 5
    assert rate_admits(demand=3, allowance=10_000, estimate=2_000) == 3
    assert rate_admits(demand=10, allowance=1_999, estimate=2_000) == 0
    assert rate_admits(demand=0, allowance=50, estimate=1) == 0


@given(previous=st.integers(-10**6, 10**6), current=st.integers(-10**6, 10**6),
       allowed=st.integers(1, 10**6), period=st.integers(1, 86_400),
       epoch=st.integers(0, 2**33))
def test_the_allowance_stays_within_zero_and_allowed(
    previous: int, current: int, allowed: int, period: int, epoch: int
) -> None:
    allowance = rate_allowance(previous, current, allowed, period, epoch)
    assert 0 <= allowance <= allowed
    # Never more than the current window alone leaves (when nothing was credited back).
    if previous >= 0 and current >= 0:
        assert allowance <= max(allowed - current, 0)


@given(demand=st.integers(0, 1000), allowance=st.integers(0, 10**6),
       estimate=st.integers(1, 10**4))
def test_admitted_jobs_never_exceed_demand_nor_overdraw(
    demand: int, allowance: int, estimate: int
) -> None:
    admitted = rate_admits(demand, allowance, estimate)
    assert 0 <= admitted <= demand
    assert admitted * estimate <= allowance
    # And it admits as many as fit.
    assert admitted == demand or (admitted + 1) * estimate > allowance


# -- Adaptive limits ---------------------------------------------------------------------


def test_saturated_rounds_double_toward_max_and_idle_rounds_halve_toward_min() -> None:
    limit, seen = 2, []
    for _ in range(5):
        limit = adapt_limit(limit, 2, 50, claimed=limit, demand=limit, busy=limit)
        seen.append(limit)
    assert seen == [4, 8, 16, 32, 50]
    for _ in range(6):
        limit = adapt_limit(limit, 2, 50, claimed=0, demand=limit, busy=0)
    assert limit == 2
    # Partly full, or idle while jobs still run: unchanged.
    assert adapt_limit(8, 2, 50, claimed=3, demand=8, busy=3) == 8
    assert adapt_limit(8, 2, 50, claimed=0, demand=2, busy=6) == 8


@given(current=st.integers(1, 200), low=st.integers(1, 50), span=st.integers(0, 150),
       claimed=st.integers(0, 200), demand=st.integers(1, 200), busy=st.integers(0, 200))
def test_the_adaptive_limit_stays_within_its_bounds(
    current: int, low: int, span: int, claimed: int, demand: int, busy: int
) -> None:
    high = low + span
    current = max(low, min(high, current))
    assert low <= adapt_limit(current, low, high, claimed=claimed, demand=demand,
                              busy=busy) <= high
