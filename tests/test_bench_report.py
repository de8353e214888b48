"""The benchmark suite's pure parts: percentiles and the targets read across
scenarios (the measurements themselves run in CI as ``python -m bench --quick``)."""

from __future__ import annotations

import math

import pytest

from bench.core import Figure, percentile
from bench.report import derive_targets, markdown


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def _throughput(name: str, value: float, **extra: object) -> Figure:
    return Figure("throughput", name, value, "jobs/s", extra=dict(extra))


def test_targets_compare_belay_with_two_processes_to_each_best_baseline() -> None:
    figures = [
        _throughput("raw SQL ceiling, claim 50", 30_000.0),
        _throughput("raw SQL, claim 1 + ack per job", 3_000.0),
        _throughput("PgQueuer defaults, 2 processes", 5_000.0, system="pgqueuer", procs=2),
        _throughput("PgQueuer batch 100, 2 processes", 10_000.0, system="pgqueuer", procs=2),
        _throughput("PgQueuer batch 100, 1 process", 20_000.0, system="pgqueuer", procs=1),
        _throughput("Procrastinate, 2 processes", math.nan, system="procrastinate", procs=2),
        _throughput("belay, 1 process", 9_000.0, system="belay", procs=1),
        _throughput("belay, 2 processes", 16_000.0, system="belay", procs=2),
        _throughput("belay, sustained", 99_000.0, system="belay", procs=2, sustained=True),
    ]
    targets = {t.baseline: t for t in derive_targets(figures)}
    # Procrastinate was not measured (NaN): no verdict is invented for it.
    assert set(targets) == {"raw SQL ceiling, claim 50", "PgQueuer defaults, 2 processes",
                            "PgQueuer batch 100, 2 processes"}
    ceiling = targets["raw SQL ceiling, claim 50"]
    assert (ceiling.value, ceiling.ratio, ceiling.met) == (16_000.0, 16_000 / 30_000, True)
    assert (targets["PgQueuer defaults, 2 processes"].ratio,
            targets["PgQueuer defaults, 2 processes"].met) == (3.2, True)
    peer = targets["PgQueuer batch 100, 2 processes"]
    assert (peer.ratio, peer.met) == (1.6, True)
    report = markdown(figures + list(targets.values()), {"CPU": "test"}, quick=True,
                      failures=["idle: boom"])
    assert "| belay 2 processes vs raw SQL ceiling, claim 50 | 16,000 jobs/s" in report
    assert "- idle: boom" in report


def test_no_targets_without_belay_figures() -> None:
    assert derive_targets([_throughput("raw SQL ceiling", 1.0)]) == []


def test_a_full_report_carries_the_long_runs_one_heading_level_down(tmp_path) -> None:
    from bench.report import long_runs

    (tmp_path / "hosts_results.md").write_text("## hosts — 1 to 8\n\ntext\n\n### Full size\n")
    (tmp_path / "vacuum_results.md").write_text("# A vacuum held back\n\n## Summary\n| a |\n")
    lines = long_runs(tmp_path)
    assert [line for line in lines if line.startswith("#")] == [
        "## hosts — 1 to 8", "### Full size", "## A vacuum held back", "### Summary"]
    assert "(From [vacuum_results.md](vacuum_results.md), measured on its own; " \
           "not re-run by `python -m bench`.)" in lines
    (tmp_path / "vacuum_results.md").write_text(
        "# Vacuum\n\nlong method\n<!-- results -->\n## Summary\n| a |\n<!-- /results -->\n"
        "## Per minute\n| many |\n<!-- results -->\nrecovered in 8 s\n<!-- /results -->\n")
    marked = long_runs(tmp_path)
    vacuum = marked[marked.index("## Vacuum"):]
    assert vacuum[:5] == ["## Vacuum", "", "### Summary", "| a |", "recovered in 8 s"]
    assert "long method" not in marked and "| many |" not in marked
    (tmp_path / "vacuum_results.md").unlink()
    assert not any("vacuum" in line for line in long_runs(tmp_path))
    quick = markdown([], {"date": "today"}, quick=True, failures=[])
    assert "hosts" not in quick
