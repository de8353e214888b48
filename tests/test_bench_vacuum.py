"""bench.vacuum's summaries, on synthetic series: the limits read off the
``before`` samples, the recovery time after the held sessions end, and the
per-phase and per-minute roll-ups. No server, nothing timed."""

from __future__ import annotations

import pytest

from bench.vacuum import (
    DEPTH_FLOOR,
    Limits,
    Phases,
    Sample,
    alone,
    by_minute,
    by_phase,
    limits,
    recovery,
)


def point(t: float, p99: float | None, depth: int = 0, dead: int = 0,
          phase: str = "after", autovacuums: int = 0, live: int = 900) -> Sample:
    # A window whose latencies are all one value has that value as its p99.
    return Sample("belay", t, phase, [] if p99 is None else [p99] * 10, depth=depth,
                  dead=dead, live=live, autovacuums=autovacuums)


def test_limits_are_read_off_the_before_samples() -> None:
    before = [point(10, 10.0, depth=2, dead=100), point(20, 20.0, depth=25, dead=900),
              point(30, 30.0, depth=1, dead=300), point(40, None, depth=0, dead=50)]
    # 1.5x the median of the windows' p99 (a window with no picks has none);
    # the largest depth; the largest dead share in the second half (300 dead of
    # 900 live + 300 dead), the first half's 50 % left out.
    assert limits(before) == Limits(p99_ms=30.0, depth=25, dead_share=0.25)
    # A depth of a few rows is within the floor whatever before saw.
    assert limits([point(10, 10.0, depth=2)]).depth == DEPTH_FLOOR
    with pytest.raises(ValueError):
        limits([point(10, None)])


def test_recovery_is_the_start_of_the_first_run_of_samples_within_the_limits() -> None:
    bounds = Limits(p99_ms=30.0, depth=5, dead_share=0.25)
    release = 100.0
    series = [
        point(95, 500.0, depth=50, dead=9_000),  # before the release: ignored
        point(105, 400.0, depth=40, dead=9_000),
        point(115, 20.0, depth=1, dead=100),  # one good sample, then a relapse
        point(125, 20.0, depth=1, dead=9_000),  # dead tuples not yet vacuumed
        point(135, 20.0, depth=1, dead=100),
        point(145, None, depth=0, dead=100),  # no pick-ups: not recovered
        point(155, 25.0, depth=5, dead=300),  # at the limits: within them
        # A table that grew: more dead tuples, the same share.
        point(165, 29.0, depth=2, dead=3_000, live=9_000),
        point(175, 29.0, depth=2, dead=10),
    ]
    assert recovery(series, release, bounds, consecutive=3) == pytest.approx(55.0)
    assert recovery(series, release, bounds, consecutive=1) == pytest.approx(15.0)
    assert recovery(series, release, bounds, consecutive=4) is None
    # One condition at a time: p99 is back first, dead tuples last.
    p99, depth, dead = alone(bounds)
    assert recovery(series, release, p99, consecutive=3) == pytest.approx(15.0)
    assert recovery(series, release, depth, consecutive=3) == pytest.approx(15.0)
    assert recovery(series, release, dead, consecutive=3) == pytest.approx(35.0)
    # Samples may come in any order.
    assert recovery(list(reversed(series)), release, bounds, consecutive=3) == pytest.approx(55.0)


def test_phase_and_minute_summaries() -> None:
    phases = Phases(warmup=10, before=20, held=20, after=20)
    assert phases.ends() == {"warmup": 10, "before": 30, "held": 50, "after": 70}
    assert [phases.phase_at(t) for t in (5, 10, 29, 30, 69, 90)] == [
        "warmup", "before", "before", "held", "after", "after"]
    series = [point(10, 1.0, phase="warmup", autovacuums=1),
              point(20, 2.0, depth=3, dead=10, phase="before", autovacuums=1),
              point(30, 4.0, depth=1, dead=30, phase="before", autovacuums=2),
              point(40, 8.0, depth=9, dead=50, phase="held", autovacuums=3),
              point(50, 8.0, depth=7, dead=70, phase="held", autovacuums=3),
              point(60, 2.0, depth=1, dead=5, phase="after", autovacuums=5),
              point(70, 2.0, depth=1, dead=6, phase="after", autovacuums=5)]
    summary = by_phase(series, phases)
    assert list(summary) == ["before", "held", "after"]
    before, held, after = summary["before"], summary["held"], summary["after"]
    assert (before.picks, before.p99, before.worst_p99) == (20, pytest.approx(4.0), 4.0)
    assert (before.depth_max, before.dead_max, before.dead_end) == (3, 30, 30)
    # Autovacuum runs counted from the sample before the phase.
    assert (before.autovacuums, held.autovacuums, after.autovacuums) == (1, 1, 2)
    assert (held.depth_median, held.dead_end, after.dead_max) == (8.0, 70, 6)
    minutes = by_minute(series)
    assert [(m, phase) for m, phase, _ in minutes] == [(0, "after"), (1, "after")]
    assert minutes[0][2].picks == 60 and minutes[1][2].picks == 10
