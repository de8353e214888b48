"""PgQueuer and Oban for Python under the production profile, measured as
belay is (``bench/profile.py``), in the same run, each from its own
virtualenv (``bench/peers.py``).

Each driver (``bench.peer_profile_pgqueuer``, ``bench.peer_profile_oban``)
says how close each peer comes to belay's configuration: the same five queues
and local slots, the same mix of jobs (``bench/profile_mix.py``), no
partition and no rate (neither peer has them in its open-source release).
Each phase gets a fresh database with the peer's own schema, pre-filled by SQL
with the same number of finished jobs over the last 30 days, in the peer's own
shape: Oban keeps finished jobs in ``oban_jobs`` (97 % completed, 2 %
discarded, 1 % cancelled) and its pruner deletes those past a day, on its own
schedule (a pass a minute on the leader); PgQueuer deletes a finished job from
its queue and keeps its ``queued``, ``picked`` and final rows in
``pgqueuer_log``, which nothing prunes by default.

1. Capacity: the backlog (the same jobs as belay's, by seed) enqueued with the
   peer's batch call before the workers start; the workers start together;
   jobs/s from the first job taken to the last success, from the peer's own
   timestamps (Oban: ``attempted_at``, ``completed_at``; PgQueuer: its log's
   ``picked`` and ``successful`` rows), all from the database's clock.
2. Open loop at :data:`bench.profile.LOAD` of that capacity: the peer's
   workers running, then 2 producer processes of 8 asyncio tasks, each task
   its own connection calling the peer's own single enqueue on a Poisson
   schedule; the window opens :data:`WARM` s after the producers start.
   Insert → start: Oban's ``attempted_at - inserted_at``, PgQueuer's
   ``picked`` minus ``queued`` log times (both set by the database, as the
   INSERT and the fetch run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg

from bench import core, peers
from bench.core import Bench, Figure, Proc, percentile
from bench.profile_meter import XACTS, Meter, PruneWatch, cores, fill, one, wait
from bench.profile_mix import TENANTS

SECTION = "profile"
PRODUCERS, TASKS = 2, 8
#: Seconds of load before the window opens.
WARM = 5.0
SETTLE = 60.0
DAYS = 30

#: The pre-fill's jobs: g in 1..rows, finished evenly over the last DAYS days;
#: the same queues and kinds, and states in the same shares, as belay's.
_JOBS = """
SELECT g, CASE WHEN q < 50 THEN 'q50' WHEN q < 70 THEN 'q20' WHEN q < 80 THEN 'q10'
               WHEN q < 84 THEN 'q4' ELSE 'q2' END AS queue,
       m < 85 AS noop, jsonb_build_object('tenant', 't' || (g %% %(tenants)s)) AS args,
       CASE WHEN g %% 100 = 0 THEN 2 WHEN g %% 50 = 1 THEN 1 ELSE 0 END AS outcome,
       now() - (%(days)s * 86400.0 * (1 - g::float8 / %(rows)s)) * interval '1 second' AS fin
FROM (SELECT g, (g::bigint * 7919) %% 86 AS q, (g::bigint * 104729) %% 100 AS m
      FROM generate_series(1, %(rows)s) AS g) AS t
"""


@dataclass(frozen=True)
class ProfilePeer:
    """How to fill a peer's tables and read its jobs' times."""

    peer: peers.Peer
    module: str
    #: The table pre-filled (its secondary indexes dropped while it fills).
    table: str
    fill: str
    #: The highest pre-filled job id (the phase's own jobs come after).
    top: str
    #: Pre-filled jobs still there (retention deletes them).
    left: str
    #: True once ``count`` of the phase's jobs succeeded (params: top, count).
    done: str
    #: (jobs succeeded, seconds from the first taken to the last success).
    span: str
    #: (queue, insert → start ms) of the jobs inserted in a window, once started.
    latencies: str
    #: Jobs inserted in the window that have not started.
    unstarted: str
    #: Jobs finished in the window.
    finished: str
    #: How the window's edges are passed: Oban's columns are UTC without a zone.
    naive: bool
    note: str
    #: Run after the fill (PgQueuer: its job ids go on after the pre-fill's).
    after: str | None = None
    #: The worker's own options, and what the figures' names add for them.
    args: tuple[str, ...] = ()
    label: str = ""


OBAN = ProfilePeer(
    peer=peers.OBAN, module="bench.peer_profile_oban", table="oban_jobs",
    fill=f"""
INSERT INTO oban_jobs (state, queue, worker, args, attempt, max_attempts, inserted_at,
                       scheduled_at, attempted_at, completed_at, discarded_at, cancelled_at,
                       errors, attempted_by)
SELECT (ARRAY['completed', 'discarded', 'cancelled'])[outcome + 1]::oban_job_state, queue,
       CASE WHEN noop THEN 'bench.peer_profile_oban.Noop'
            ELSE 'bench.peer_profile_oban.Sleep' END, args, 1, 20,
       u - interval '2 seconds', u - interval '2 seconds', u - interval '10 milliseconds',
       CASE WHEN outcome = 0 THEN u END, CASE WHEN outcome = 1 THEN u END,
       CASE WHEN outcome = 2 THEN u END,
       CASE WHEN outcome = 1 THEN jsonb_build_array(jsonb_build_object(
              'attempt', 1, 'at', u, 'error', 'TimeoutError: upstream timed out'))
            ELSE '[]'::jsonb END,
       ARRAY['bench-node']
FROM (SELECT *, fin AT TIME ZONE 'UTC' AS u FROM ({_JOBS}) AS j) AS k ORDER BY g
""",
    top="SELECT coalesce(max(id), 0) FROM oban_jobs",
    left="SELECT count(*) FROM oban_jobs WHERE id <= %s",
    done="SELECT count(*) >= %s FROM oban_jobs WHERE id > %s AND state = 'completed'",
    span="SELECT count(*) FILTER (WHERE state = 'completed'), "
         "extract(epoch FROM max(completed_at) - min(attempted_at))::float8 "
         "FROM oban_jobs WHERE id > %s",
    latencies="SELECT queue, extract(epoch FROM attempted_at - inserted_at)::float8 * 1000 "
              "FROM oban_jobs WHERE id > %s AND inserted_at >= %s AND inserted_at < %s "
              "AND attempted_at IS NOT NULL",
    unstarted="SELECT count(*) FROM oban_jobs WHERE id > %s AND inserted_at >= %s "
              "AND inserted_at < %s AND attempted_at IS NULL",
    finished="SELECT count(*) FROM oban_jobs WHERE id > %s AND completed_at >= %s "
             "AND completed_at < %s",
    naive=True,
    note="Oban for Python 0.7.0: five queues of the same local limits (q50=50, q20=20, "
         "q10=10, q4=4, q2=2; no partition, global limit or rate: those are Oban Pro's), "
         "async Noop and Sleep workers, otherwise its defaults as `oban start` runs it "
         "(uvloop, orjson, pool of 10, Postgres notifier, the pruner: a day's retention)",
)

PGQUEUER = ProfilePeer(
    peer=peers.PGQUEUER, module="bench.peer_profile_pgqueuer", table="pgqueuer_log",
    fill=f"""
INSERT INTO pgqueuer_log (created, job_id, status, priority, entrypoint)
SELECT e.at, j.g, e.status::pgqueuer_status, 0, j.queue
FROM ({_JOBS}) AS j CROSS JOIN LATERAL (VALUES
  (j.fin - interval '2 seconds', 'queued'), (j.fin - interval '10 milliseconds', 'picked'),
  (j.fin, (ARRAY['successful', 'exception', 'canceled'])[j.outcome + 1])) AS e(at, status)
ORDER BY e.at
""",
    after="SELECT setval('pgqueuer_id_seq', %(rows)s)",
    top="SELECT last_value FROM pgqueuer_id_seq",
    left="SELECT count(*) FROM pgqueuer_log WHERE job_id <= %s",
    done="SELECT count(*) >= %s FROM pgqueuer_log WHERE job_id > %s AND status = 'successful'",
    span="SELECT count(*) FILTER (WHERE status = 'successful'), extract(epoch FROM "
         "max(created) FILTER (WHERE status = 'successful') - min(created) FILTER "
         "(WHERE status = 'picked'))::float8 FROM pgqueuer_log WHERE job_id > %s",
    latencies="SELECT q.entrypoint, extract(epoch FROM p.created - q.created)::float8 * 1000 "
              "FROM pgqueuer_log q JOIN pgqueuer_log p ON p.job_id = q.job_id "
              "AND p.status = 'picked' WHERE q.status = 'queued' AND q.job_id > %s "
              "AND q.created >= %s AND q.created < %s",
    unstarted="SELECT count(*) FROM pgqueuer_log q WHERE q.status = 'queued' "
              "AND q.job_id > %s AND q.created >= %s AND q.created < %s AND NOT EXISTS "
              "(SELECT FROM pgqueuer_log p WHERE p.job_id = q.job_id AND p.status = 'picked')",
    finished="SELECT count(*) FROM pgqueuer_log WHERE job_id > %s AND status = 'successful' "
             "AND created >= %s AND created < %s",
    naive=False,
    note="PgQueuer 1.6.0: an entrypoint per queue, each with concurrency_limit = the "
         "queue's limit x the worker processes (PgQueuer counts it across workers; the same "
         "slots in all; no partition or rate: PgQueuer has neither), async handlers, "
         "5 instances of one connection per process, batch_size 100 (the peers "
         "benchmark's best); its log is not pruned",
)

PGQUEUER_FREE = dataclasses.replace(
    PGQUEUER, args=("--no-limits",), label=" (no limits)",
    note="PgQueuer 1.6.0 as above but with no concurrency_limit: its fast path (with the "
         "limits its claims came in rounds about a second apart: "
         "bench/peer_profile_pgqueuer.py)")

PEERS = (PGQUEUER, PGQUEUER_FREE, OBAN)


def _edge(peer: ProfilePeer, at: float) -> datetime:
    moment = datetime.fromtimestamp(at, timezone.utc)
    return moment.replace(tzinfo=None) if peer.naive else moment


def _run(peer: ProfilePeer, python: str, url: str, command: str, *args: str) -> None:
    proc = Proc(peer.module, command, "--url", url, *args, python=python)
    try:
        code = proc.popen.wait(peers.PREPARE_TIMEOUT)
    finally:
        proc.stop()
    if code != 0:
        raise RuntimeError(f"{peer.module} {command} exited with {code}")


@contextlib.contextmanager
def _phase(bench: Bench, peer: ProfilePeer, python: str, tag: str, prefill: int
           ) -> Iterator[tuple[str, psycopg.Connection[Any], int]]:
    """A fresh database with the peer's schema and its pre-fill: its URL, a
    connection and the highest pre-filled id."""
    with bench.database(f"{peer.peer.system}_{tag}", belay_schema=False) as url, \
            psycopg.connect(url, autocommit=True) as conn:
        _run(peer, python, url, "install")
        params = {"rows": prefill, "days": DAYS, "tenants": TENANTS}
        fill(conn, peer.table, peer.fill, params, bench.log)
        if peer.after is not None:
            conn.execute(peer.after, params)
        yield url, conn, int(one(conn, peer.top))


@contextlib.contextmanager
def _workers(peer: ProfilePeer, python: str, url: str, procs: int) -> Iterator[list[Proc]]:
    with core.processes(procs, peer.module, "work", "--url", url, "--procs", str(procs),
                        *peer.args, python=python) as nodes:
        for node in nodes:
            node.popen.send_signal(signal.SIGUSR1)
        yield nodes


def capacity(bench: Bench, peer: ProfilePeer, python: str, procs: int, backlog: int,
             seed: int, prefill: int) -> dict[str, Any]:
    with _phase(bench, peer, python, "cap", prefill) as (url, conn, top):
        _run(peer, python, url, "enqueue", "--count", str(backlog), "--seed", str(seed))
        gauge, xacts = Meter(conn), int(one(conn, XACTS))
        with _workers(peer, python, url, procs) as nodes:
            before, started = gauge.read(nodes, []), time.monotonic()
            if not wait(conn, peer.done, (backlog, top), 600):
                raise TimeoutError(f"{peer.peer.title}: the capacity drain did not finish "
                                   f"in 600 s ({procs} procs)")
            elapsed, after = time.monotonic() - started, gauge.read(nodes, [])
        time.sleep(1.0)  # the server flushes its counters at most once a second
        xacts = int(one(conn, XACTS)) - xacts
        count, span = conn.execute(peer.span, (top,)).fetchone() or (0, 0.0)
    result = {"jobs_per_s": count / span, "jobs": count, "span_s": round(span, 3),
              "cpu_us_per_job": (after["workers"] - before["workers"]) / count * 1e6,
              "cores": cores(before, after, elapsed), "xacts_per_job": round(xacts / count, 2)}
    bench.log(f"profile {peer.peer.title}{peer.label} capacity, {procs} processes: {result}")
    return result


@contextlib.contextmanager
def _producers(peer: ProfilePeer, python: str, url: str, offered: float, seconds: float,
               seed: int) -> Iterator[list[Proc]]:
    """PRODUCERS processes sending ``offered`` jobs/s in all for ``seconds``,
    started together; yields them (each prints its report when done)."""
    with core.processes(PRODUCERS, peer.module, "produce", "--url", url, "--rate",
                        str(offered / PRODUCERS), "--seconds", str(seconds), "--tasks",
                        str(TASKS), "--seed", str(seed), python=python) as procs:
        for proc in procs:
            proc.popen.send_signal(signal.SIGUSR1)
        yield procs


def _report(proc: Proc, timeout: float) -> dict[str, Any]:
    assert proc.popen.stdout is not None
    proc.popen.wait(timeout)
    lines = [line for line in proc.popen.stdout.read().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{proc.popen.args!r} printed no report")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def open_loop(bench: Bench, peer: ProfilePeer, python: str, procs: int, offered: float,
              seconds: float, prefill: int) -> dict[str, Any]:
    with _phase(bench, peer, python, "open", prefill) as (url, conn, top):
        gauge, watch = Meter(conn), PruneWatch(url, peer.table)
        try:
            with _workers(peer, python, url, procs) as nodes, \
                    _producers(peer, python, url, offered, WARM + seconds, procs) as prods:
                pids = [p.pid for p in prods]
                opened = time.time() + WARM
                closed = opened + seconds
                time.sleep(max(0.0, opened - time.time()))
                before, left, xacts = gauge.read(nodes, pids), int(one(conn, peer.left, (top,))), \
                    int(one(conn, XACTS))
                time.sleep(max(0.0, closed - time.time()))
                after, elapsed = gauge.read(nodes, pids), time.time() - opened
                xacts = int(one(conn, XACTS)) - xacts
                pruned = left - int(one(conn, peer.left, (top,)))
                reports = [_report(p, 120) for p in prods]
                window = (top, _edge(peer, opened), _edge(peer, closed))
                wait(conn, f"SELECT ({peer.unstarted}) = 0", window, SETTLE)
        finally:
            watch.stop()
        by_queue: dict[str, list[float]] = {}
        for queue, ms in conn.execute(peer.latencies, window):
            by_queue.setdefault(str(queue), []).append(float(ms))
        latencies = [ms for values in by_queue.values() for ms in values] or [math.nan]
        unstarted = int(one(conn, peer.unstarted, window))
        finished = int(one(conn, peer.finished, window))
    inserted = sum(len(v) for v in by_queue.values()) + unstarted
    result = {
        "inserted": inserted, "inserted_per_s": round(inserted / seconds, 1),
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "unstarted": unstarted, "finished": finished, "offered_per_s": round(offered, 1),
        "jobs_per_s": finished / seconds,
        "cpu_us_per_job": (after["workers"] - before["workers"]) / max(finished, 1) * 1e6,
        "cores": cores(before, after, elapsed), "xacts_per_job": round(xacts / max(finished, 1), 2),
        "pruned_in_window": pruned, "prune_active_s": round(watch.active(opened, closed), 1),
        "p50_ms_by_queue": {q: round(percentile(v, 50), 2) for q, v in sorted(by_queue.items())},
        "p99_ms_by_queue": {q: round(percentile(v, 99), 2) for q, v in sorted(by_queue.items())},
        "producers": reports,
    }
    bench.log(f"profile {peer.peer.title}{peer.label} open loop, {procs} processes: {result}")
    return result


def figures(peer: ProfilePeer, procs: int, ceiling: tuple[str, float],
            floor: tuple[float, float], drained: dict[str, Any] | None,
            loaded: dict[str, Any] | None, offered: float, why: str = "") -> list[Figure]:
    """The peer's figures, named as belay's with the peer's title in front
    (NaN, with ``why``, for what was not measured)."""
    title, label, nan = peer.peer.title + peer.label, f"{procs} processes", math.nan
    extra = {"system": peer.peer.system, "config": peer.label.strip(" ()") or "closest",
             "profile_procs": procs}

    def value(result: dict[str, Any] | None, key: str) -> float:
        return float(result[key]) if result is not None else nan

    note = why or peer.note
    return [
        Figure(SECTION, f"{title}: capacity, {label}", value(drained, "jobs_per_s"), "jobs/s",
               baseline=ceiling[0], baseline_value=ceiling[1], note=note,
               extra={**extra, **(drained or {})}),
        Figure(SECTION, f"{title}: open loop, {label}: achieved", value(loaded, "jobs_per_s"),
               "jobs/s", baseline="offered (70% of its capacity)", baseline_value=offered,
               note=why or f"{PRODUCERS}x{TASKS} producer tasks, each its own connection, "
                           f"the peer's own enqueue; window opened {WARM:g} s into the load",
               extra={**extra, **(loaded or {})}),
        Figure(SECTION, f"{title}: open loop, {label}: insert → start p50",
               value(loaded, "p50_ms"), "ms", baseline="raw notify floor p50 (this run)",
               baseline_value=floor[0], higher_is_better=False, note=why or "as belay's",
               extra={**extra, "by_queue": (loaded or {}).get("p50_ms_by_queue")}),
        Figure(SECTION, f"{title}: open loop, {label}: insert → start p99",
               value(loaded, "p99_ms"), "ms", baseline="raw notify floor p99 (this run)",
               baseline_value=floor[1], higher_is_better=False, note=why or "as belay's",
               extra={**extra, "by_queue": (loaded or {}).get("p99_ms_by_queue")}),
        Figure(SECTION, f"{title}: open loop, {label}: worker CPU per job",
               value(loaded, "cpu_us_per_job"), "µs", baseline="its capacity drain",
               baseline_value=value(drained, "cpu_us_per_job"), higher_is_better=False,
               note=why or "user + system CPU of the worker processes over the window / "
                           "jobs finished in it"),
    ]


def run(bench: Bench, procs_list: tuple[int, ...], ceiling: tuple[str, float],
        floor: tuple[float, float], backlog: int, seconds: float, prefill: int,
        load: float, seed: Callable[[int], int]) -> list[Figure]:
    out: list[Figure] = []
    for peer in PEERS:
        try:
            python = peers.peer_python(peer.peer.system, peer.peer.requirement,
                                       *peer.peer.extras, log=bench.log,
                                       min_python=peer.peer.min_python)
        except peers.PeerUnavailable as exc:
            bench.log(f"!!! {peer.peer.title} could not be installed: {exc}")
            for procs in procs_list:
                out += figures(peer, procs, ceiling, floor, None, None, math.nan,
                               f"not measured: {exc}")
            continue
        for procs in procs_list:
            drained = loaded = None
            offered = math.nan
            try:
                drained = capacity(bench, peer, python, procs, backlog, seed(procs), prefill)
                offered = load * drained["jobs_per_s"]
                loaded = open_loop(bench, peer, python, procs, offered, seconds, prefill)
                why = ""
            except (RuntimeError, TimeoutError, OSError, psycopg.Error) as exc:
                bench.log(f"!!! {peer.peer.title} under the profile failed: {exc}")
                why = f"not measured: {exc}"
            out += figures(peer, procs, ceiling, floor, drained, loaded, offered, why)
    return out
