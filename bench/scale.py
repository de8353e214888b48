"""Scale: does the claim stay flat as the ready set grows, do many queues cost
throughput, and what do workflow members and children add to each ack?"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

import belay
from belay import names, store
from belay.sql import QUERIES
from bench.core import Bench, Figure, percentile, processes, timed_claims

SECTION = "scale"
CLAIMS = 200
TAKE = 10
#: Claims before the timed ones: connection, prepared statement, caches.
WARM_CLAIMS = 10
NODE = "bench-scale"
FILL = """
INSERT INTO belay_jobs (kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at)
SELECT 'noop', 'default', 'ready', jsonb_build_object('i', g), '{}', 0, 0, 20,
       now() - interval '1 minute', now() - interval '1 minute'
FROM generate_series(1, %s) AS g
"""
SUCCEEDED = "SELECT count(*) FROM belay_jobs WHERE state = 'succeeded'"
#: Seconds without one more job succeeding before a drain is given up.
STALL = 20.0
#: Jobs/s from the workers' own clocks: first claim to last ack, startup excluded.
SPAN = """
SELECT count(*), EXTRACT(EPOCH FROM max(finished_at) - min(started_at))
FROM belay_jobs WHERE state = 'succeeded'
"""
#: Enqueues a drain's jobs, on the given connection (inside its transaction).
Fill = Callable[[belay.Belay, psycopg.Connection[Any]], None]


def _label(rows: int) -> str:
    return f"{rows // 1_000_000}M" if rows >= 1_000_000 else f"{rows // 1_000}k"


# -- Claim latency against the size of the ready set -------------------------------------


def _claim_latencies(bench: Bench, ready: int) -> tuple[list[float], str]:
    """Milliseconds of each of CLAIMS calls to belay's claim with ``ready`` ready
    rows (plus the rows the claims take); and what EXPLAIN says of the plan."""
    with bench.database("scale_claim") as url, psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, (ready + (CLAIMS + WARM_CLAIMS) * TAKE,))
        conn.execute("VACUUM ANALYZE belay_jobs")
        _checkpoint(conn)
        plan = _plan(conn)
        timings = timed_claims(
            lambda now: store.claim(conn, "default", TAKE, NODE, now,
                                    now + timedelta(seconds=30)),
            TAKE, CLAIMS, WARM_CLAIMS)
    bench.log(f"claim at {_label(ready)} ready: p50 {percentile(timings, 50):.2f} ms, "
              f"p99 {percentile(timings, 99):.2f} ms")
    return timings, plan


def _checkpoint(conn: psycopg.Connection[Any]) -> None:
    """Write the fill out now, so the checkpoint it causes doesn't land on the
    timed claims (with 1M rows it would); needs superuser or pg_checkpoint."""
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


def _plan(conn: psycopg.Connection[Any]) -> str:
    """Whether the claim's plan sorts table rows (a Sort over a scan of
    belay_jobs, not over the merged CTE candidates) and which indexes it reads."""
    now = datetime.now(timezone.utc)
    row = conn.execute("EXPLAIN (FORMAT JSON) " + QUERIES["claim"], {
        "queue": "default", "take": TAKE, "node": NODE, "now": now, "lease_until": now,
        "kinds": None,
    }).fetchone()
    assert row is not None
    nodes = list(_walk(row[0][0]["Plan"]))
    sorts = [n for n in nodes if n["Node Type"] == "Sort"]
    of_table = [n for n in sorts if any("Relation Name" in d for d in _walk(n))]
    indexes = sorted({n["Index Name"] for n in nodes if "Index Name" in n})
    verdict = ("a Sort over belay_jobs rows: the ready set is sorted" if of_table else
               f"no sort of the ready set ({len(sorts)} Sort, over the merged candidates only)")
    return f"EXPLAIN: {verdict}; indexes {', '.join(indexes)}"


def _walk(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _walk(child)


def _claim_figures(bench: Bench) -> list[Figure]:
    small, big = 1_000, bench.size(100_000, 1_000_000)
    small_ms, _ = _claim_latencies(bench, small)
    big_ms, plan = _claim_latencies(bench, big)
    base = f"claim latency p50, {_label(small)} ready rows"
    base_p99 = f"claim latency p99, {_label(small)} ready rows"
    ratio = percentile(big_ms, 50) / percentile(small_ms, 50)
    how = (f"belay.store.claim of {TAKE}, {CLAIMS} autocommit calls after {WARM_CLAIMS} "
           f"untimed, each its own commit; the table also holds the rows the claims take")
    return [
        Figure(SECTION, base, percentile(small_ms, 50), "ms", higher_is_better=False, note=how,
               extra={"p99_ms": percentile(small_ms, 99)}),
        Figure(SECTION, f"claim latency p50, {_label(big)} ready rows", percentile(big_ms, 50),
               "ms", baseline=base, baseline_value=percentile(small_ms, 50),
               higher_is_better=False, target=f"≤ 2x the {_label(small)} figure",
               met=ratio <= 2, note=f"{how}. At {_label(big)}, {plan}",
               extra={"p99_ms": percentile(big_ms, 99)}),
        Figure(SECTION, f"claim latency p99, {_label(big)} ready rows", percentile(big_ms, 99),
               "ms", baseline=base_p99, baseline_value=percentile(small_ms, 99),
               higher_is_better=False),
    ]


# -- Draining with belay worker processes -------------------------------------------------


def drain(bench: Bench, tag: str, workers: int, queues: list[str], expected: int,
          fill: Fill, *, analyze: bool = False,
          after: Callable[[psycopg.Connection[Any]], None] | None = None) -> float:
    """Jobs/s of ``workers`` belay worker processes serving ``queues`` draining
    what ``fill`` enqueues (in one transaction, once the workers idle); with
    ``analyze``, the table's statistics are taken in that transaction, as
    autovacuum takes them within a minute of a big insert. ``after`` reads the
    drained database before it goes."""
    queue_args = [arg for queue in queues for arg in ("--queue", queue)]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(bench.database(f"scale_{tag}"))
        stack.enter_context(processes(workers, "bench.belay_node", "--url", url, *queue_args))
        client = stack.enter_context(belay.Belay(url, max_pool_size=1))
        conn = stack.enter_context(psycopg.connect(url, autocommit=True))
        with conn.transaction():
            fill(client, conn)
            if analyze:
                conn.execute("ANALYZE belay_jobs")
        _wait_drained(conn, expected)
        row = conn.execute(SPAN).fetchone()
        if after is not None:
            after(conn)
    assert row is not None
    count, seconds = int(row[0]), float(row[1])
    bench.log(f"drain {tag}: {count} jobs in {seconds:.2f} s, {count / seconds:,.0f} jobs/s")
    return count / seconds


def _wait_drained(conn: psycopg.Connection[Any], expected: int) -> None:
    """Wait until ``expected`` jobs succeeded; give up when progress stalls."""
    done, progress = 0, time.monotonic()
    while done < expected:
        time.sleep(0.05)
        row = conn.execute(SUCCEEDED).fetchone()
        count = int(row[0]) if row else 0
        if count > done:
            done, progress = count, time.monotonic()
        elif time.monotonic() - progress > STALL:
            raise TimeoutError(f"drain stalled at {done} of {expected} jobs succeeded")


def _plain(n_jobs: int, queues: int = 1, queue: str = "default") -> Fill:
    def fill(client: belay.Belay, conn: psycopg.Connection[Any]) -> None:
        client.enqueue_many([{"kind": "noop", "input": {"i": i},
                              "queue": queue if queues == 1 else f"q{i % queues}"}
                             for i in range(n_jobs)], conn=conn)
    return fill


def _workflows(n_jobs: int, size: int) -> Fill:
    def fill(client: belay.Belay, conn: psycopg.Connection[Any]) -> None:
        for w in range(n_jobs // size):
            workflow = belay.Workflow(f"bench{w}")
            for k in range(size):
                workflow.add(f"step{k}", "noop", {"k": k})
            client.enqueue_workflow(workflow, conn=conn)
    return fill


def _children(n_jobs: int, size: int) -> Fill:
    """Children as ``ctx.spawn_many`` inserts them, under parents left ready on a
    queue nobody serves (each child's ack still signals its parent)."""
    def fill(client: belay.Belay, conn: psycopg.Connection[Any]) -> None:
        parents = client.enqueue_many(
            [{"kind": "noop", "queue": "parents"}] * (n_jobs // size), conn=conn)
        client.enqueue_many([
            belay.JobSpec("noop", {"k": k}, internal={
                "parent_id": parent.id, "unique_key": names.spawn_key(parent.id, "bench", k),
                "unique_mode": "always"})
            for parent in parents for k in range(size)
        ], conn=conn)
    return fill


def _queue_figure(bench: Bench) -> Figure:
    n_jobs = bench.size(10_000, 100_000)
    many = [f"q{i}=10" for i in range(10)]
    spread = drain(bench, "queues10", 2, many, n_jobs, _plain(n_jobs, 10))
    single = drain(bench, "queues1", 2, ["default=100"], n_jobs, _plain(n_jobs))
    return Figure(SECTION, "throughput, 10 queues (10 each), 2 worker processes", spread,
                  "jobs/s", baseline="throughput, 1 queue (100), 2 worker processes",
                  baseline_value=single, target="≥ 0.85x", met=spread >= 0.85 * single,
                  note=f"{n_jobs:,} no-op jobs; first claim to last ack, by the workers' clocks",
                  extra={"jobs": n_jobs})


def _idle_queue_figures(bench: Bench) -> list[Figure]:
    """A busy queue served beside idle ones (the worker configuration the docs
    show: a busy queue and a small one) against the busy queue alone, each on
    a fresh table, once as it is right after the insert (never analyzed) and
    once analyzed (what autovacuum does within a minute, and the planner's
    view for the rest of a long drain): with several queues a node claims
    with claim_queues, whose plan once hashed the whole table per claim on an
    analyzed table (issue 39)."""
    n_jobs = bench.size(10_000, 100_000)
    fill = _plain(n_jobs, queue="busy")
    figures = []
    for analyze in (False, True):
        table = "analyzed" if analyze else "never analyzed"
        tag = "a" if analyze else "n"
        alone = drain(bench, f"busy_alone_{tag}", 2, ["busy=50"], n_jobs, fill,
                       analyze=analyze)
        for idle in (["small=4"], ["small=4", "a=4", "b=4", "c=4"]):
            rate = drain(bench, f"busy_idle{len(idle)}_{tag}", 2, ["busy=50", *idle],
                          n_jobs, fill, analyze=analyze)
            figures.append(Figure(
                SECTION, f"throughput, busy queue (50) + {len(idle)} idle "
                         f"queue{'s' if len(idle) > 1 else ''} (4), 2 worker processes, "
                         f"{table}",
                rate, "jobs/s",
                baseline=f"throughput, busy queue (50) alone, 2 worker processes, {table}",
                baseline_value=alone, target="≥ 0.85x", met=rate >= 0.85 * alone,
                note=f"{n_jobs:,} no-op jobs in the busy queue, a fresh table ({table}); "
                     "first claim to last ack, by the workers' clocks",
                extra={"jobs": n_jobs, "analyzed": analyze}))
    return figures


def _ack_figures(bench: Bench) -> list[Figure]:
    n_jobs, size = bench.size(2_000, 20_000), 10
    queue = ["default=10"]
    plain = drain(bench, "ack_plain", 1, queue, n_jobs, _plain(n_jobs))
    members = drain(bench, "ack_workflow", 1, queue, n_jobs, _workflows(n_jobs, size))
    children = drain(bench, "ack_children", 1, queue, n_jobs, _children(n_jobs, size))
    base = "plain jobs, 1 worker process"
    return [
        Figure(SECTION, f"workflow members ({size} per workflow, no deps), 1 worker process",
               members, "jobs/s", baseline=base, baseline_value=plain,
               target="≥ 0.5x", met=members >= 0.5 * plain,
               note="batched acks: each batch takes its workflows' locks and settles each "
                    "workflow once", extra={"jobs": n_jobs}),
        Figure(SECTION, f"children ({size} per parent), 1 worker process", children,
               "jobs/s", baseline=base, baseline_value=plain,
               target="≥ 0.5x", met=children >= 0.5 * plain,
               note="batched acks: each batch signals $children to each of its parents once",
               extra={"jobs": n_jobs}),
    ]


def run(bench: Bench) -> list[Figure]:
    return [*_claim_figures(bench), _queue_figure(bench), *_idle_queue_figures(bench),
            *_ack_figures(bench)]
