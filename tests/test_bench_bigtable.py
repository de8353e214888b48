"""bench.bigtable's fill, reads, index build and report, at a few thousand rows
(the measurements themselves run as ``python -m bench.bigtable --quick``;
nothing here judges a number)."""

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
        indexes = dict(conn.execute(bigtable.SECONDARY).fetchall())
        assert bigtable.NEW_INDEX in indexes  # revision 4's, from the migrated schema
        bigtable.fill(Bench(server_url, quick=True, bin_dir=None), conn,
                      bigtable.Sizes(terminal=5_000, ready=200))
        assert dict(conn.execute(bigtable.SECONDARY).fetchall()) == indexes
        states = dict(conn.execute(
            "SELECT state, count(*) FROM belay_jobs GROUP BY state").fetchall())
        assert states == {"succeeded": 4_600, "failed": 300, "cancelled": 100, "ready": 200}
        queues = dict(conn.execute("SELECT queue, count(*) FROM belay_jobs "
                                   "WHERE state <> 'ready' GROUP BY queue").fetchall())
        assert set(queues) == {"default", "emails", "reports", "audit"}
        # The combination the reads look for with no rows really has none.
        row: Any = conn.execute("SELECT count(*) FROM belay_jobs "
                                "WHERE queue = 'audit' AND state = 'cancelled'").fetchone()
        assert row[0] == 0
        row = conn.execute("""
            SELECT min(octet_length(input::text)), max(octet_length(input::text)),
                   min(octet_length(result)), max(octet_length(result)),
                   max(finished_at) - min(finished_at)
            FROM belay_jobs WHERE state = 'succeeded'""").fetchone()
        assert row[0] >= 100 and row[1] <= 320 and row[2] >= 100 and row[3] <= 320
        assert row[4] > timedelta(days=bigtable.DAYS - 1)
        # Most of the 30 days are past the default retention.
        assert 4_000 < bigtable.count_expired(conn) < 5_000

        built = bigtable.build_index(Bench(server_url, quick=True, bin_dir=None), conn)
        assert built.plain_s > 0 and built.concurrent_s > 0
        assert dict(conn.execute(bigtable.SECONDARY).fetchall()) == indexes
        row = conn.execute("SELECT indisvalid FROM pg_index "
                           "WHERE indexrelid = %s::regclass", (bigtable.NEW_INDEX,)).fetchone()
        assert row[0] is True

    with belay.Belay(direct_url, max_pool_size=1) as client, \
            psycopg.connect(direct_url, autocommit=True) as conn:
        newest = client.list_jobs(state="succeeded", limit=1)[0]
        assert newest.result["ok"] is True
        assert client.stats(cap=None)["default"]["ready"] == 200
        # Each list read's EXPLAIN runs the statement belay runs for it: the
        # same rows, in the same order; the deep page starts DEEP_PAGES pages in.
        for read in bigtable.reads():
            extra = read.setup(client)
            statements = read.statements(extra)
            if not read.name.startswith("list_jobs"):
                assert all(name in bigtable.QUERIES for name, _ in statements)
                continue
            [(name, params)] = statements
            assert name.startswith("list_jobs")
            jobs: Any = read.call(client, extra)
            ids = [r[0] for r in conn.execute(bigtable.QUERIES[name], params).fetchall()]
            assert ids == [job.id for job in jobs]
            if extra:
                where = {k: v for k, v in params.items()
                         if k in ("queue", "state") and v is not None}
                pages = bigtable.PAGE * bigtable.DEEP_PAGES
                everything = client.list_jobs(**where, limit=pages + bigtable.PAGE)
                assert ids == [job.id for job in everything[pages:]]
                assert len(ids) == bigtable.PAGE


def _measured(scale: float, **extra: Any) -> bigtable.Measured:
    reads = [bigtable.ReadResult(read.name, [1.0 * scale] * 3, goal=read.goal)
             for read in bigtable.reads()]
    return bigtable.Measured(bigtable.Sizes(1_000, 1_000), 1.0, "1 MB", reads,
                             [2.0 * scale] * 10, 5_000 / scale, [1.0 * scale] * 10,
                             3_000 / scale, **extra)


def test_figures_read_each_big_measurement_against_the_small_one() -> None:
    quiet, busy = bigtable.PruneRun([1.0] * 10, 100, 10.0), bigtable.PruneRun(
        [1.5] * 10, 80, 10.0, pruned=5_000, prune_seconds=10.0, passes=5, behind=5,
        pass_s=[2.0] * 5, batches=[(500, 20.0, 1.0)] * 10, worker_jobs=900)
    unpaced = bigtable.PruneRun(
        [3.0] * 10, 50, 10.0, pruned=10_000, prune_seconds=10.0, passes=5, behind=5,
        pass_s=[2.0] * 5, batches=[(500, 40.0, 1.0)] * 20, worker_jobs=800, paced=False)
    write = bigtable.WriteCost(1_000, {True: [900.0, 1_000.0], False: [1_000.0, 1_000.0]},
                               {True: [1_500.0, 1_500.0], False: [1_600.0, 1_400.0]})
    small = _measured(1.0)
    big = _measured(1.2, prune=(quiet, busy, unpaced), expired=60_000, write=write,
                    index=bigtable.IndexBuild(30.0, 45.0, "300 MB", "maintenance_work_mem 64MB"))
    found = {f.name.split(", ")[0]: f for f in bigtable.figures(small, big, 1_000)}
    assert found["claim p50"].met and round(found["claim p50"].ratio or 0, 2) == 1.2
    assert found["belay stats (client.stats()"].met  # 1.2 ms < 100 ms
    assert found["belay stats exact (client.stats(cap=None))"].met is None  # no goal
    assert found["claim p99 during prune"].met
    assert "largest 500 rows" in found["claim p99 during prune"].note
    assert "claimer's wait events seen none" in found["claim p99 during prune"].note
    assert found["prune rate"].value == 500.0
    # Unpaced: the comparison, no goal (3x here would miss it).
    unpaced_p99 = found["claim p99 during unpaced prune"]
    assert unpaced_p99.met is None and unpaced_p99.ratio == 3.0
    assert "unpaced" in unpaced_p99.note and "paced as a worker" in \
        found["claim p99 during prune"].note
    assert found["prune rate unpaced"].value == 1_000.0
    assert "claim + ack of the claimer thread during unpaced prune" in found
    assert found["one worker clearing the expired rows at that rate"].value == 2.0  # minutes
    assert found[f"CREATE INDEX {bigtable.NEW_INDEX}"].value == 30.0
    assert found[f"CREATE INDEX CONCURRENTLY {bigtable.NEW_INDEX}"].value == 45.0
    enqueue = found[f"enqueue_many of 1,000 (batches of 1,000) with {bigtable.NEW_INDEX}"]
    assert enqueue.ratio == 0.95
    report = bigtable.section(list(found.values()), small, big, {"CPU": "test"}, quick=True)
    assert report.startswith("## bigtable") and "| CPU | test |" in report
    assert "no EXPLAIN needed" in report
