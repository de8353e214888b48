"""Admitted queues at scale: partitions with many keys, a global limit on
many processes, and a small tenant behind a big one.

Each drain is ``bench.scale``'s: worker processes (``bench.belay_node``)
serving one queue start on a fresh database, the jobs are enqueued in one
transaction (``enqueue_many``) once they idle, and jobs/s is the span from
the first ``started_at`` to the last ``finished_at``, from the rows.

1. A partitioned queue (``limit`` 50, ``global_limit`` 2 per key, keyed by
   ``input.tenant``) draining N no-op jobs spread round-robin over K keys
   (full: 100,000 jobs, 10,000 keys; quick: 10,000 and 1,000), 2 processes,
   against the same jobs in a plain queue (``limit`` 50). Target ≥ 0.5x.
2. The partitioned claim's own latency: 200 claims of 50 (``claim_admitted``
   under the queue's lock, each rolled back) with those N jobs waiting,
   analyzed; target p99 ≤ 10 ms. Beside it, the skewed case the claim's
   prefix can't settle: one key's N jobs at its cap ahead of another key's 10.
3. A queue with a ``global_limit`` of 40 (``limit`` 10 a process) on 8
   processes against the same queue plain (``limit`` 10) on 8 processes,
   N no-op jobs.
4. Fairness: one tenant's N jobs enqueued, then another's 10, in one
   transaction, into a partitioned queue (``limit`` 50, ``global_limit`` 10
   per key), 2 processes. Every claim stamps its jobs with one
   ``started_at``, so the distinct ``started_at`` values up to the small
   tenant's last start count the claims it waited for. Target: ≤ 2.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import psycopg

import belay
from belay import store
from belay.queues import parse_spec
from bench.core import Bench, Figure, percentile, timed_claims
from bench.scale import drain

SECTION = "admitted"
PARTITION = {"limit": 50, "global_limit": 2, "partition": {"input": "tenant"}}
FAIR = {"limit": 50, "global_limit": 10, "partition": {"input": "tenant"}}
CLAIMS, WARM_CLAIMS, TAKE = 200, 10, 50

FILL = """
INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, ready_at, inserted_at)
SELECT 'noop', %(queue)s, 'ready', jsonb_build_object('tenant', %(prefix)s || (g %% %(keys)s)),
       0, 5, NULL, now()
FROM generate_series(1, %(rows)s) AS g
"""


def _option(name: str, options: dict[str, Any]) -> str:
    return f"{name}={json.dumps(options)}"


def _tenants(n_jobs: int, keys: int, queue: str) -> Any:
    def fill(client: belay.Belay, conn: psycopg.Connection[Any]) -> None:
        client.enqueue_many([{"kind": "noop", "input": {"tenant": f"t{i % keys}"},
                              "queue": queue} for i in range(n_jobs)], conn=conn)
    return fill


def _partition_figures(bench: Bench) -> list[Figure]:
    n_jobs, keys = bench.size(10_000, 100_000), bench.size(1_000, 10_000)
    plain = drain(bench, "adm_plain", 2, ["q=50"], n_jobs, _tenants(n_jobs, keys, "q"))
    keyed = drain(bench, "adm_partition", 2, [_option("q", PARTITION)], n_jobs,
                   _tenants(n_jobs, keys, "q"))
    spread, skew = _claim_latencies(bench, n_jobs, keys)
    note = (f"{n_jobs:,} no-op jobs round-robin over {keys:,} keys, 2 worker processes, "
            f"queue options {PARTITION}")
    return [
        Figure(SECTION, f"throughput, a partitioned queue ({keys:,} keys), 2 worker processes",
               keyed, "jobs/s", baseline="throughput, the same jobs in a plain queue (50), "
               "2 worker processes", baseline_value=plain, target="≥ 0.5x",
               met=keyed >= 0.5 * plain, note=note, extra={"jobs": n_jobs, "keys": keys}),
        Figure(SECTION, f"partitioned claim of {TAKE}, p99 ({keys:,} keys waiting)",
               percentile(spread, 99), "ms", higher_is_better=False, target="≤ 10 ms",
               met=percentile(spread, 99) <= 10,
               note=f"{CLAIMS} claims under the queue's lock, each rolled back, "
                    f"{n_jobs:,} jobs over {keys:,} keys waiting, analyzed",
               extra={"p50_ms": round(percentile(spread, 50), 2)}),
        Figure(SECTION, f"partitioned claim, p99, one key's {n_jobs:,} jobs at its cap ahead "
                        "of another's 10", percentile(skew, 99), "ms", higher_is_better=False,
               note="the prefix of claim order holds only the capped key's jobs, so the "
                    "whole queue is read (the capped key's jobs dropped before the ranking)",
               extra={"p50_ms": round(percentile(skew, 50), 2)}),
    ]


def _claim_latencies(bench: Bench, n_jobs: int, keys: int) -> tuple[list[float], list[float]]:
    """Milliseconds per partitioned claim: ``n_jobs`` over ``keys`` keys; and
    one key's ``n_jobs`` at its cap ahead of another's 10."""
    spec = parse_spec("q", PARTITION)
    with bench.database("adm_claims") as url, psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, {"queue": "q", "prefix": "t", "keys": keys, "rows": n_jobs})
        conn.execute(FILL, {"queue": "skew", "prefix": "big", "keys": 1, "rows": n_jobs})
        conn.execute(FILL, {"queue": "skew", "prefix": "small", "keys": 1, "rows": 10})
        conn.execute(
            "INSERT INTO belay_jobs (kind, queue, state, input, attempt, max_attempts, "
            "lease_until, leased_by, started_at, inserted_at) SELECT 'noop', 'skew', 'running', "
            "'{\"tenant\": \"big0\"}', 1, 5, now() + interval '1 hour', 'x', now(), now() "
            "FROM generate_series(1, %s)", (PARTITION["global_limit"],))
        conn.execute("VACUUM ANALYZE belay_jobs")
        timings: dict[str, list[float]] = {"q": [], "skew": []}
        for queue in timings:
            queue_spec = spec if queue == "q" else parse_spec(queue, PARTITION)

            def claim(now: datetime, queue_spec: Any = queue_spec) -> list[Any]:
                with conn.transaction(force_rollback=True):
                    return store.claim_admitted(conn, queue_spec, TAKE, "bench", now,
                                                now + timedelta(seconds=30))

            timings[queue] = timed_claims(claim, TAKE if queue == "q" else 2, CLAIMS,
                                          WARM_CLAIMS)
    bench.log(f"partitioned claim: p99 {percentile(timings['q'], 99):.2f} ms; skewed "
              f"p99 {percentile(timings['skew'], 99):.2f} ms")
    return timings["q"], timings["skew"]


def _global_limit_figure(bench: Bench) -> Figure:
    n_jobs, processes = bench.size(10_000, 100_000), 8
    fill = _tenants(n_jobs, 1, "g")
    plain = drain(bench, "adm_g_plain", processes, ["g=10"], n_jobs, fill)
    limited = drain(bench, "adm_g_limit", processes,
                     [_option("g", {"limit": 10, "global_limit": 40})], n_jobs, fill)
    return Figure(SECTION, f"throughput, global_limit 40 (limit 10), {processes} worker processes",
                  limited, "jobs/s", baseline=f"throughput, the same queue plain (limit 10), "
                  f"{processes} worker processes", baseline_value=plain,
                  note=f"{n_jobs:,} no-op jobs; every claim takes the queue's advisory lock "
                       "and counts its live leases", extra={"jobs": n_jobs})


def _fairness_figure(bench: Bench) -> Figure:
    n_jobs = bench.size(10_000, 100_000)

    def fill(client: belay.Belay, conn: psycopg.Connection[Any]) -> None:
        client.enqueue_many([{"kind": "noop", "input": {"tenant": "big"}, "queue": "f"}]
                            * n_jobs, conn=conn)
        client.enqueue_many([{"kind": "noop", "input": {"tenant": "small"}, "queue": "f"}]
                            * 10, conn=conn)

    claims: list[int] = []

    def count(conn: psycopg.Connection[Any]) -> None:
        row = conn.execute(
            "SELECT count(DISTINCT started_at) FROM belay_jobs WHERE started_at <= "
            "(SELECT max(started_at) FROM belay_jobs WHERE input ->> 'tenant' = 'small')"
        ).fetchone()
        claims.append(int(row[0]) if row else 0)

    drain(bench, "adm_fair", 2, [_option("f", FAIR)], n_jobs + 10, fill, after=count)
    return Figure(SECTION, f"claims until a small tenant's 10 jobs all started, behind "
                           f"another's {n_jobs:,}", claims[0], "claims",
                  higher_is_better=False, target="≤ 2", met=claims[0] <= 2,
                  note=f"queue options {FAIR}, 2 worker processes; distinct started_at "
                       "values up to the small tenant's last start (each claim stamps one)")


def run(bench: Bench) -> list[Figure]:
    return [*_partition_figures(bench), _global_limit_figure(bench), _fairness_figure(bench)]
