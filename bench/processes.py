"""The process pool (``Worker(processes=N)``) against threads, in the same run.

Every variant runs a ``belay.Worker`` in this process on a fresh database, with
the job functions of :mod:`bench.pool_jobs` (a module the pool's children can
import); the thread variants run the same functions on the worker's threads.

- **No-op throughput.** N ``bench.pool.noop`` jobs are enqueued first
  (``enqueue_many``), then the worker starts; the rate is N over the time from
  just before ``worker.start()`` to the last job's ``finished_at`` (so a pool's
  start-up, spawning its children, counts), read against threads with the same
  concurrency (``{"pool": 2}``) and with the slots a user would write for
  threads (``{"pool": 10}``). ``extra`` has the rate over the database's span
  (first ``started_at`` to last ``finished_at``), CPU seconds per job of this
  process (the worker's claims, dispatch, acks) and of the children,
  transactions per job (``pg_stat_database``), the median job's claim to ack
  (``started_at`` to ``finished_at``) and the 1-minute load average as the
  run began (the machines are shared).
- **Dispatch latency.** One ``bench.pool.started`` job at a time into a worker
  with nothing else to do: from ``enqueue()`` returning (its commit
  acknowledged) to the ``time.time()`` the function read as it started, which
  it returns. Each job is enqueued after a random pause of up to :data:`GAP`
  (the poll period) once the previous one's result came back, so it lands at a
  random phase of any poll loop (:data:`NOTIFIED_GAP` for threads woken by
  NOTIFY, which have no phase to randomise). Worker and client use
  LISTEN/NOTIFY: the worker's listener wakes the pool's dispatcher as it wakes
  the thread producers (before 89e137f it did not, and an idle dispatcher
  slept ``IDLE_WAIT``, 0.5 s). Threads are also measured polling only (full run
  only; ``poll_interval`` 0.5 s, ``busy_poll`` 25 ms, with the same pauses as
  the pool): their producer polls at ``busy_poll`` for 0.25 s after a claim
  that found work and then doubles its interval up to ``poll_interval``.
- **CPU-bound.** M ``bench.pool.cpu`` jobs, each a pure-Python loop holding the
  GIL for about :data:`CPU_JOB_SECONDS` (its size calibrated in this process
  at the start), run by ``processes=1``, ``processes=2`` and threads with 2
  slots; the rate is M over the database's span (first ``started_at`` to last
  ``finished_at``, so start-up is not counted), the median of the repetitions,
  which alternate between the variants. On 2 cores, processes should scale
  about 2x and threads not at all. The machine's own ceiling is measured
  beside them: the same loops split over 1 and 2 plain Python processes
  without belay (the machines are shared: another tenant's load shows there
  too).

Nothing is asserted: every figure is a ratio against threads in the same run.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

import belay
from bench import pool_jobs
from bench.core import Bench, Figure, median, percentile

SECTION = "processes"
Q = pool_jobs.QUEUE
#: The random pause before each latency sample of a polling variant spans the
#: poll period (s), so the job lands at a random phase of the poll loop; a
#: variant woken by NOTIFY has no phase to randomise and gets a short one.
GAP = 0.5
NOTIFIED_GAP = 0.02
WARMUP = 3
CPU_JOB_SECONDS = 0.075
CPU_TARGET = 1.6
POLL = 0.1


@dataclass(frozen=True)
class Config:
    label: str
    slots: int
    processes: int | None = None
    notify: bool = False

    def worker(self, client: belay.Belay) -> belay.Worker:
        return belay.Worker({Q: self.slots}, client=client, registry=pool_jobs.REGISTRY,
                            processes=self.processes, notify=self.notify, shutdown_grace=5.0)


THREADS_2 = Config('threads {"pool": 2}', 2)
THREADS_10 = Config('threads {"pool": 10}', 10)
PROCESSES_1 = Config("processes=1", 2, processes=1)
PROCESSES_2 = Config("processes=2", 2, processes=2)
BARE_1 = "bare Python, 1 process"
BARE_2 = "bare Python, 2 processes"


def _fill(url: str, specs: list[dict[str, Any]]) -> None:
    with belay.Belay(url, notify=False, registry=pool_jobs.REGISTRY) as client:
        for start in range(0, len(specs), 5_000):
            client.enqueue_many(specs[start:start + 5_000])


def _transactions(bench: Bench, url: str) -> int:
    dbname = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    with psycopg.connect(bench.url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           "WHERE datname = %s", (dbname,)).fetchone()
    return int(row[0]) if row else 0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def drain(bench: Bench, config: Config, specs: list[dict[str, Any]],
          timeout: float = 900.0) -> dict[str, float]:
    """Enqueue ``specs``, start a worker, wait until every job succeeded.

    Returns seconds from just before ``start()`` to the last ``finished_at``
    (``wall``), the database's span (``span``), CPU seconds of this process and
    of the reaped children meanwhile, and the transactions the run took."""
    count = len(specs)
    with bench.database("processes") as url:
        _fill(url, specs)
        time.sleep(0.3)  # the fill's backends exit and flush their counters
        xacts = _transactions(bench, url)
        polls = 0
        with belay.Belay(url, notify=config.notify, registry=pool_jobs.REGISTRY) as client, \
                psycopg.connect(url, autocommit=True) as conn:
            worker = config.worker(client)
            load = os.getloadavg()[0]
            own_cpu, children_cpu = time.process_time(), _children_cpu()
            began = time.time()
            worker.start()
            try:
                deadline = time.monotonic() + timeout
                while True:
                    polls += 1
                    done = conn.execute("SELECT count(*) FROM belay_jobs WHERE state = "
                                        "'succeeded'").fetchone()[0]  # type: ignore[index]
                    if done >= count:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{config.label}: {done}/{count} jobs done after "
                                           f"{timeout:g} s")
                    time.sleep(POLL)
            finally:
                worker.stop()
            own_cpu = time.process_time() - own_cpu
            children_cpu = _children_cpu() - children_cpu
            first, last, in_flight = conn.execute(
                "SELECT extract(epoch FROM min(started_at))::float8,"
                " extract(epoch FROM max(finished_at))::float8,"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY"
                "  extract(epoch FROM finished_at - started_at))::float8 FROM belay_jobs"
            ).fetchone()  # type: ignore[misc]
        time.sleep(0.3)
        xacts = _transactions(bench, url) - xacts - polls - 1
    return {"wall": last - began, "span": last - first, "own_cpu": own_cpu,
            "children_cpu": children_cpu, "xacts": xacts, "in_flight": in_flight,
            "load": load}


def _noop_figures(bench: Bench) -> list[Figure]:
    count = bench.size(1_500, 20_000)
    specs = [{"kind": "bench.pool.noop", "input": {"n": n}} for n in range(count)]
    measured: dict[Config, dict[str, float]] = {}
    for config in (THREADS_2, THREADS_10, PROCESSES_2):
        run = measured[config] = drain(bench, config, specs)
        bench.log(f"processes: {count:,} no-op jobs, {config.label}: "
                  f"{count / run['wall']:,.0f} jobs/s from start ({count / run['span']:,.0f} "
                  f"over the database's span); CPU {run['own_cpu'] / count * 1e3:.2f} ms/job "
                  f"here, {run['children_cpu'] / count * 1e3:.2f} ms/job in children; "
                  f"{run['xacts'] / count:.2f} transactions/job; claim to ack p50 "
                  f"{run['in_flight'] * 1e3:.2f} ms; load {run['load']:.2f}")
    note = (f"{count:,} no-op jobs enqueued first (enqueue_many), then a Worker in the bench "
            "process starts; jobs/s from just before start() to the last finished_at (a "
            "pool's start-up counts). extra: the rate over the database's span, CPU ms per "
            "job in the worker process and in the pool's children, transactions per job "
            "(pg_stat_database, the bench's own polls taken out), the median job's "
            "started_at to finished_at (claim to ack).")
    figures = []
    for config, baseline in ((THREADS_10, THREADS_2), (PROCESSES_2, THREADS_2),
                             (PROCESSES_2, THREADS_10)):
        run, base = measured[config], measured[baseline]
        figures.append(Figure(
            SECTION, f"no-op jobs/s, {config.label} vs {baseline.label}",
            count / run["wall"], "jobs/s", baseline=f"{baseline.label} (this run)",
            baseline_value=count / base["wall"], note=note,
            extra={"count": count, "span_rate": round(count / run["span"], 1),
                   "baseline_span_rate": round(count / base["span"], 1),
                   "worker_cpu_ms_per_job": round(run["own_cpu"] / count * 1e3, 3),
                   "children_cpu_ms_per_job": round(run["children_cpu"] / count * 1e3, 3),
                   "transactions_per_job": round(run["xacts"] / count, 2),
                   "claim_to_ack_ms_p50": round(run["in_flight"] * 1e3, 2),
                   "load_1min": round(run["load"], 2)}))
    return figures


def latencies(bench: Bench, config: Config, count: int,
              rng: random.Random) -> tuple[list[float], list[float]]:
    """(commit → function start, commit → the claim's started_at), in seconds,
    one job at a time into an idle worker."""
    with bench.database("processes_latency") as url, \
            belay.Belay(url, notify=True, registry=pool_jobs.REGISTRY) as client:
        worker = config.worker(client)
        stamps: list[tuple[int, float, float]] = []
        with worker:
            gap = NOTIFIED_GAP if config.notify and config.processes is None else GAP
            for i in range(WARMUP + count):
                time.sleep(rng.uniform(0, gap))
                job = client.enqueue("bench.pool.started", {"i": i})
                committed = time.time()
                began = float(client.await_result(job.id, timeout=60))
                stamps.append((job.id, committed, began))
        stamps = stamps[WARMUP:]
        with psycopg.connect(url) as conn:
            claimed: dict[int, float] = dict(conn.execute(
                "SELECT id, extract(epoch FROM started_at)::float8 FROM belay_jobs"
                " WHERE id = ANY(%s)", ([s[0] for s in stamps],)).fetchall())
    return ([began - committed for _, committed, began in stamps],
            [claimed[job_id] - committed for job_id, committed, _ in stamps])


def _latency_figures(bench: Bench) -> list[Figure]:
    count = bench.size(30, 200)
    rng = random.Random(20240601)
    variants = [Config("processes=2", 2, processes=2, notify=True),
                Config('threads {"pool": 2}, notify', 2, notify=True)]
    if not bench.quick:
        variants.append(Config('threads {"pool": 2}, polling', 2))
    measured = {}
    for config in variants:
        bench.log(f"processes: dispatch latency, {config.label}, {count} samples")
        measured[config] = latencies(bench, config, count, rng)
        starts, claims = measured[config]
        bench.log(f"processes: {config.label}: p50 {percentile(starts, 50) * 1e3:.1f} ms, "
                  f"p95 {percentile(starts, 95) * 1e3:.1f} ms (claim p50 "
                  f"{percentile(claims, 50) * 1e3:.1f} ms)")
    note = (f"One job at a time, each after a random 0 to {GAP * 1000:.0f} ms pause "
            f"({NOTIFIED_GAP * 1000:.0f} ms for threads with notify) once the previous "
            "result came back: from enqueue() returning (commit acknowledged) to the "
            "time.time() the function read as it started. Worker and client with notify; "
            "a NOTIFY wakes the pool's dispatcher as it wakes the thread producers. "
            "Threads polling: no notify, poll_interval 0.5 s, busy_poll 25 ms (adaptive), "
            "same pauses as the pool. extra.claim_ms: commit → the claim's started_at; "
            "function start minus that is the hand-off.")
    figures = []
    pool, threads = variants[0], variants[1:]
    for p in (50, 95):
        for baseline in threads:
            value = percentile(measured[pool][0], p) * 1e3
            extra: dict[str, Any] = {"samples": count}
            for config in (pool, baseline):
                extra[f"claim_ms {config.label}"] = round(
                    percentile(measured[config][1], p) * 1e3, 2)
            figures.append(Figure(
                SECTION, f"dispatch latency p{p}, {pool.label} vs {baseline.label}", value,
                "ms", baseline=f"{baseline.label} (this run)",
                baseline_value=percentile(measured[baseline][0], p) * 1e3,
                higher_is_better=False, note=note, extra=extra))
    return figures


def calibrate(seconds: float = CPU_JOB_SECONDS) -> int:
    """Loop iterations of :func:`bench.pool_jobs.spin` that take about ``seconds`` here."""
    n = 100_000
    while True:
        took = min(_timed_spin(n) for _ in range(3))
        if took > 0.02:
            return max(1, int(n * seconds / took))
        n *= 4


def _timed_spin(n: int) -> float:
    start = time.perf_counter()
    pool_jobs.spin(n)
    return time.perf_counter() - start


#: The machine's own ceiling: the same loop in plain Python processes, no belay.
BARE = """
import sys, time
{source}
n, jobs = int(sys.argv[1]), int(sys.argv[2])
start = time.time()
for _ in range(jobs):
    spin(n)
print(start, time.time())
"""


def bare(procs: int, count: int, n: int) -> dict[str, float]:
    """``count`` loops of ``n`` split over ``procs`` plain Python processes (no
    belay): seconds from the first one's start to the last one's end."""
    code = BARE.format(source=inspect.getsource(pool_jobs.spin))
    load = os.getloadavg()[0]
    children = [subprocess.Popen([sys.executable, "-c", code, str(n), str(count // procs)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    stamps = [[float(x) for x in child.communicate(timeout=600)[0].split()]
              for child in children]
    span = max(end for _, end in stamps) - min(start for start, _ in stamps)
    return {"span": span, "wall": span, "load": load}


def _cpu_figures(bench: Bench) -> list[Figure]:
    count = bench.size(10, 40)
    repeats = bench.size(1, 5)
    n = calibrate()
    bench.log(f"processes: CPU-bound jobs of {n:,} iterations (~{CPU_JOB_SECONDS * 1e3:.0f} ms "
              f"each), {count} jobs, {repeats} repetition(s)")
    specs = [{"kind": "bench.pool.cpu", "input": {"n": n}} for _ in range(count)]
    variants: dict[str, Callable[[], dict[str, float]]] = {
        **{c.label: functools.partial(drain, bench, c, specs)
           for c in (THREADS_2, PROCESSES_1, PROCESSES_2)},
        BARE_1: functools.partial(bare, 1, count, n),
        BARE_2: functools.partial(bare, 2, count, n),
    }
    rates: dict[str, list[float]] = {label: [] for label in variants}
    walls: dict[str, list[float]] = {label: [] for label in variants}
    loads: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(repeats):
        for label, measure in variants.items():
            run = measure()
            rates[label].append(count / run["span"])
            walls[label].append(run["wall"])
            loads[label].append(run["load"])
            bench.log(f"processes: CPU-bound, {label}: {run['span']:.2f} s span "
                      f"({rates[label][-1]:.1f} jobs/s), {run['wall']:.2f} s from start; "
                      f"load {run['load']:.2f}")
    note = (f"{count} jobs, each a pure-Python loop holding the GIL ({n:,} iterations, "
            f"~{CPU_JOB_SECONDS * 1e3:.0f} ms here); jobs/s over the database's span (first "
            "started_at to last finished_at), median of the repetitions (alternating); the "
            "ratio is the speedup. Bare Python: the same loops split over plain processes "
            "without belay, from the first one's start to the last one's end (the machine's "
            "ceiling). extra.wall_s: from start() to the last finished_at; extra.load_1min: "
            "the load average as each repetition began.")

    def figure(label: str, baseline: str, target: str | None = None,
               goal: float | None = None) -> Figure:
        value, base = median(rates[label]), median(rates[baseline])
        return Figure(
            SECTION, f"CPU-bound jobs/s, {label} vs {baseline}", value, "jobs/s",
            baseline=f"{baseline} (this run)", baseline_value=base, note=note,
            target=target, met=None if goal is None else value / base >= goal,
            extra={"runs": [round(r, 2) for r in rates[label]],
                   "baseline_runs": [round(r, 2) for r in rates[baseline]],
                   "wall_s": [round(w, 2) for w in walls[label]], "iterations": n,
                   "load_1min": [round(x, 2) for x in loads[label]]})

    p1, p2, t2 = PROCESSES_1.label, PROCESSES_2.label, THREADS_2.label
    return [figure(p2, t2, f"≥ {CPU_TARGET:g}x threads (2 slots)", CPU_TARGET),
            figure(p2, p1),
            figure(p1, t2),
            figure(BARE_2, BARE_1),
            figure(p2, BARE_2)]


def run(bench: Bench) -> list[Figure]:
    return [*_noop_figures(bench), *_latency_figures(bench), *_cpu_figures(bench)]
