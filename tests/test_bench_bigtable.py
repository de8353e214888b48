"""bench.bigtable's fill and report, at a few thousand rows (the measurements
themselves run as ``python -m bench.bigtable --quick``; nothing here judges a number)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

import belay
from bench import bigtable
from bench.core import Bench


def test_the_fill_makes_realistic_rows_and_keeps_belays_indexes(
        server_url: str, direct_url: str) -> None:
    with psycopg.connect(direct_url, autocommit=True) as conn:
        indexes = {name for name, _ in conn.execute(bigtable.SECONDARY).fetchall()}
        bigtable.fill(Bench(server_url, quick=True, bin_dir=None), conn,
                      bigtable.Sizes(terminal=5_000, ready=200))
        assert {name for name, _ in conn.execute(bigtable.SECONDARY).fetchall()} == indexes
        states = dict(conn.execute(
            "SELECT state, count(*) FROM belay_jobs GROUP BY state").fetchall())
        assert states == {"succeeded": 4_600, "failed": 300, "cancelled": 100, "ready": 200}
        queues = dict(conn.execute("SELECT queue, count(*) FROM belay_jobs "
                                   "WHERE state <> 'ready' GROUP BY queue").fetchall())
        assert set(queues) == {"default", "emails", "reports", "audit"}
        row: Any = conn.execute("""
            SELECT min(octet_length(input::text)), max(octet_length(input::text)),
                   min(octet_length(result)), max(octet_length(result)),
                   max(finished_at) - min(finished_at)
            FROM belay_jobs WHERE state = 'succeeded'""").fetchone()
        assert row[0] >= 100 and row[1] <= 320 and row[2] >= 100 and row[3] <= 320
        assert row[4] > timedelta(days=bigtable.DAYS - 1)
    with belay.Belay(direct_url, max_pool_size=1) as client, \
            psycopg.connect(direct_url, autocommit=True) as conn:
        newest = client.list_jobs(state="succeeded", limit=1)[0]
        assert newest.result["ok"] is True
        assert client.stats()["default"]["ready"] == 200
        # The candidate fixes answer what belay's own statements answer.
        two_step = bigtable.two_step_list_jobs()
        for read in bigtable.reads():
            if read.query == "list_jobs":
                ids = [r[0] for r in conn.execute(two_step, read.params).fetchall()]
                assert ids == [job.id for job in read.call(client)]  # type: ignore[attr-defined]
        capped = {(q, s): n for q, s, n in conn.execute(bigtable.CAPPED_STATS).fetchall()}
        exact = client.stats()
        assert capped == {(q, s): min(n, 10_001) for q, by in exact.items()
                          for s, n in by.items()}
        fixes = bigtable.try_fixes(Bench(server_url, quick=True, bin_dir=None), client, conn)
        assert len(fixes) == 2 * 5 + 1  # five filtered list_jobs, two shapes each; stats
        assert "Index Only Scan" in fixes[-1][3]
        indexes_now = {name for name, _ in conn.execute(bigtable.SECONDARY).fetchall()}
        assert indexes_now == indexes


def _measured(scale: float, **extra: Any) -> bigtable.Measured:
    reads = [bigtable.ReadResult(read.name, [1.0 * scale] * 3) for read in bigtable.reads()]
    return bigtable.Measured(bigtable.Sizes(1_000, 1_000), 1.0, "1 MB", reads,
                             [2.0 * scale] * 10, 5_000 / scale, [1.0 * scale] * 10,
                             3_000 / scale, **extra)


def test_figures_read_each_big_measurement_against_the_small_one() -> None:
    quiet, busy = bigtable.PruneRun([1.0] * 10, 100, 10.0), bigtable.PruneRun(
        [1.5] * 10, 80, 10.0, pruned=5_000, prune_seconds=10.0,
        batches=[(500, 20.0, 1.0)] * 10, worker_jobs=900)
    small, big = _measured(1.0), _measured(1.2, prune=(quiet, busy))
    found = {f.name.split(", ")[0]: f for f in bigtable.figures(small, big, 1_000)}
    assert found["claim p50"].met and round(found["claim p50"].ratio or 0, 2) == 1.2
    assert found["belay stats (client.stats)"].met  # 1.2 ms < 100 ms
    assert found["claim p99 during prune"].met
    assert "largest 500 rows" in found["claim p99 during prune"].note
    assert found["prune rate"].value == 500.0
    report = bigtable.section(list(found.values()), small, big, {"CPU": "test"}, quick=True)
    assert report.startswith("## bigtable") and "| CPU | test |" in report
