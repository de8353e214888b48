"""A vacuum held back: belay, PgQueuer and Procrastinate under a steady load
while an idle-in-transaction session pins the xmin horizon for 10 minutes.
``python -m bench.vacuum [--quick] [--url URL] [--out FILE] [--json FILE]``
(issue 20 item 5; not part of ``python -m bench``: the full run takes 40
minutes).

Method. One PostgreSQL server (a private embedded one by default, with
default settings: autovacuum on, as a user runs it), one database per
system, all three systems run at the same time in the same run:

- belay: a fresh migrated database (``Bench.database``); one worker process,
  the command a user writes, ``belay worker --import bench.vacuum --queue
  default=10`` (every other option at its default: polling, no LISTEN);
- PgQueuer 1.6.0 and Procrastinate 3.10.0: a database each with the peer's
  own schema, one worker process each as ``bench.peers`` starts it
  (PgQueuer: 5 consumers, batch 10; Procrastinate: concurrency 10, a pool of
  4), in the peers' own virtualenvs;
- a producer process per system (:mod:`bench.vacuum_producer`, through the
  system's own client) enqueues one no-op job at a time at a fixed rate
  (:data:`RATE` jobs/s each).

Phases, timed from the moment the producers start: ``warmup`` (not
reported), ``before``, ``held`` — in each of the three databases one session
runs ``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1`` and then sits idle in
transaction (since PostgreSQL 14 the horizon that vacuum of an ordinary table
obeys is computed per database, so a session in one database does not hold
back another; the run records each database's oldest ``backend_xmin``) —
then ``after``, once the sessions have rolled back. Full: 1 + 10 + 10 + 15
minutes; ``--quick``: 20 s + 1 + 1 + 1.5 minutes.

Every :data:`SAMPLE` seconds, for each system, from its own database:

- pick-up latency of the jobs picked in the window (the window ends 2 s
  before the sample so picks being committed are not missed), from the
  system's own timestamps: belay ``started_at - inserted_at``; PgQueuer the
  ``picked`` minus the ``queued`` row of ``pgqueuer_log``; Procrastinate the
  ``started`` minus the ``deferred`` event of ``procrastinate_events``. This
  is the comparable "claim" figure: it includes the polling (belay) or
  notification (the peers) delay as well as the claim statement;
- queue depth: ready rows (belay ``state = 'ready'``, PgQueuer ``status =
  'queued'``, Procrastinate ``status = 'todo'``);
- ``n_dead_tup``, ``n_live_tup``, ``autovacuum_count`` summed over the
  system's tables (``pg_stat_user_tables``, names ``belay_%``, ``pgqueuer%``,
  ``procrastinate_%``), and ``pg_total_relation_size`` summed over them
  (heap, indexes, TOAST);
- the age of the oldest ``backend_xmin`` in the database;
- belay only: its ``claim`` statement itself, ``EXPLAIN (ANALYZE, BUFFERS)``
  of a claim of 10 from queue ``default`` in a transaction that is rolled
  back (execution time and shared buffers touched), and the size of the
  index it reads, ``belay_jobs_claim_order_idx``. The peers' claim statements
  are not probed;
- the machine's 1-minute load average, and how many jobs were enqueued in the
  window (from the same timestamps: ``inserted_at``, the ``queued`` log row,
  the ``deferred`` event). The producers are closed-loop — one enqueue at a
  time — so when an enqueue takes longer than 1/rate (a loaded machine) the
  rate falls behind; they say so on stderr every minute.

A sample belongs to the phase in force when it is taken; a phase ends right
after the sample that closes it (whose claim plan the report shows), and
just before the held sessions end, ``belay doctor``'s horizon and tables
checks run on belay's database.

Recovery (:func:`recovery`), per system, from the moment the held sessions
end: the time to the first sample that starts a run of :data:`CONSECUTIVE`
samples each meeting all of (a) pick-up p99 of the window ≤
:data:`P99_FACTOR` x the median of the ``before`` samples' p99, (b) queue
depth ≤ the largest depth of any ``before`` sample, or :data:`DEPTH_FLOOR`
if that is larger (at this rate a snapshot of the depth is a handful of rows
that moves by a few at random), (c) the dead share of the system's tuples,
``n_dead_tup / (n_live_tup + n_dead_tup)``, ≤ the largest share of the
``before`` samples in the second half of that phase (the first minutes, on a
nearly empty table, say little; a share, not a count: belay and Procrastinate keep
finished jobs, so their tables grow all run long and autovacuum, which
triggers at a share of the table, lets the dead count grow with them). A
window with no pick-ups
fails (a). Resolution: one sample interval. ``None`` when the ``after``
phase ends first.

``--variant "LABEL=SQL"`` (repeatable) adds one more belay system to the same
run, in a database of its own, identical but for ``SQL`` run once after the
migration (e.g. ``ALTER TABLE belay_jobs SET (fillfactor = 80)``, or a
``DROP INDEX``): a candidate fix measured beside belay as it is, under the
same load at the same moments. Each gets its own worker and producer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

import belay
from belay.sql import QUERIES
from bench import peers
from bench.core import ROOT, Bench, Proc, arguments, median, percentile
from bench.report import machine_table, publish
from bench.vacuum_producer import BELAY_KIND

SYSTEMS = ("belay", "pgqueuer", "procrastinate")
PEERS = SYSTEMS[1:]
#: Jobs enqueued per second, per system.
RATE = 50.0
#: Seconds between samples.
SAMPLE = 10.0
#: Picks committed this long before a sample are in its window.
MARGIN = 2.0
#: Recovery: this many consecutive samples within the ``before`` limits.
CONSECUTIVE = 3
#: Recovery: pick-up p99 within this factor of the ``before`` median p99.
P99_FACTOR = 1.5
#: Recovery: a depth this small counts as back to normal whatever ``before`` saw.
DEPTH_FLOOR = 10
#: How many samples back the id cursor of the pick-up query starts (5 minutes).
LOOKBACK = 30
PHASES = ("warmup", "before", "held", "after")


@belay.worker(name=BELAY_KIND, queue="default")
def noop(ctx: belay.Context) -> None:
    """The no-op job belay's worker process runs (``--import bench.vacuum``)."""
    return None


@dataclass(frozen=True)
class Phases:
    """Seconds of each phase."""

    warmup: float
    before: float
    held: float
    after: float

    def ends(self) -> dict[str, float]:
        """Each phase's end, in seconds from the start."""
        out, at = {}, 0.0
        for name in PHASES:
            at += float(getattr(self, name))
            out[name] = at
        return out

    def phase_at(self, t: float) -> str:
        for name, end in self.ends().items():
            if t < end:
                return name
        return "after"


FULL = Phases(60, 600, 600, 900)
QUICK = Phases(20, 60, 60, 90)


@dataclass(frozen=True)
class System:
    """How to read one system's database."""

    name: str
    title: str
    like: str
    depth: str
    picks: str
    cursor: str
    #: How many jobs were enqueued in the window (same parameters as ``picks``).
    enqueues: str
    #: belay only: SQL run once after the migration (a variant under test).
    setup: str = ""

    @property
    def is_belay(self) -> bool:
        return self.name.startswith("belay")


BELAY = System(
    "belay", "belay", r"belay\_%",
    "SELECT count(*) FROM belay_jobs WHERE queue = 'default' AND state = 'ready'",
    "SELECT EXTRACT(EPOCH FROM started_at - inserted_at) FROM belay_jobs"
    " WHERE id > %(lo_id)s AND started_at >= %(lo)s AND started_at < %(hi)s",
    "SELECT COALESCE(max(id), 0) FROM belay_jobs",
    "SELECT count(*) FROM belay_jobs"
    " WHERE id > %(lo_id)s AND inserted_at >= %(lo)s AND inserted_at < %(hi)s",
)
PGQUEUER = System(
    "pgqueuer", peers.PGQUEUER.title, "pgqueuer%",
    "SELECT count(*) FROM pgqueuer WHERE status = 'queued'",
    "SELECT EXTRACT(EPOCH FROM p.created - q.created) FROM pgqueuer_log AS p"
    " JOIN pgqueuer_log AS q ON q.job_id = p.job_id AND q.status = 'queued'"
    " WHERE p.status = 'picked' AND p.created >= %(lo)s AND p.created < %(hi)s"
    " AND %(lo_id)s::bigint IS NOT NULL",
    "SELECT 0",
    "SELECT count(*) FROM pgqueuer_log WHERE status = 'queued' AND created >= %(lo)s"
    " AND created < %(hi)s AND %(lo_id)s::bigint IS NOT NULL",
)
PROCRASTINATE = System(
    "procrastinate", peers.PROCRASTINATE.title, r"procrastinate\_%",
    "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'",
    "SELECT EXTRACT(EPOCH FROM s.at - d.at) FROM procrastinate_events AS s"
    " JOIN procrastinate_events AS d ON d.job_id = s.job_id AND d.type = 'deferred'"
    " WHERE s.id > %(lo_id)s AND s.type = 'started' AND s.at >= %(lo)s AND s.at < %(hi)s",
    "SELECT COALESCE(max(id), 0) FROM procrastinate_events",
    "SELECT count(*) FROM procrastinate_events"
    " WHERE id > %(lo_id)s AND type = 'deferred' AND at >= %(lo)s AND at < %(hi)s",
)

TABLES = """
SELECT COALESCE(sum(n_dead_tup), 0)::bigint, COALESCE(sum(n_live_tup), 0)::bigint,
       COALESCE(sum(pg_total_relation_size(relid)), 0)::bigint,
       COALESCE(sum(autovacuum_count), 0)::bigint,
       COALESCE(sum(n_tup_upd), 0)::bigint, COALESCE(sum(n_tup_hot_upd), 0)::bigint
FROM pg_stat_user_tables WHERE relname LIKE %(like)s
"""
HORIZON = """
SELECT max(age(backend_xmin)) FROM pg_stat_activity
WHERE datname = current_database() AND backend_xmin IS NOT NULL
"""
CLAIM_INDEX = "belay_jobs_claim_order_idx"
#: The peers' worker options, as bench.peers runs them (its first setup of each).
PEER_ARGS = {"pgqueuer": ("--consumers", "5", "--batch", "10"),
             "procrastinate": ("--concurrency", "10", "--pool", "4")}
PEER_NOTES = {s.peer.system: s.note for s in peers.SETUPS if not s.label}
BELAY_NOTE = ("one `belay worker --import bench.vacuum --queue default=10` process, "
              "defaults otherwise (polling: busy_poll 25 ms, poll_interval 0.5 s, no LISTEN)")


@dataclass
class Sample:
    """One system, one window."""

    system: str
    #: Seconds from the start of the run to the end of the window.
    t: float
    phase: str
    #: Pick-up latencies (ms) of the jobs picked in the window.
    latencies: list[float] = field(default_factory=list)
    #: Jobs enqueued in the window (-1: not recorded).
    enqueued: int = -1
    depth: int = 0
    dead: int = 0
    live: int = 0
    size: int = 0
    autovacuums: int = 0
    #: Rows updated, and of those HOT-updated, since the database was made.
    updates: int = 0
    hot_updates: int = 0
    horizon_age: int | None = None
    #: The machine's 1-minute load average at the sample (None: not recorded).
    load: float | None = None
    #: belay only: the claim statement's execution time and buffers, the index
    #: its ready CTE read, that index's size and all of belay_jobs' indexes'.
    probe_ms: float | None = None
    probe_buffers: int | None = None
    probe_index: str | None = None
    claim_index_size: int | None = None
    indexes_size: int | None = None

    @property
    def picks(self) -> int:
        return len(self.latencies)

    @property
    def p50(self) -> float | None:
        return percentile(self.latencies, 50) if self.latencies else None

    @property
    def p99(self) -> float | None:
        return percentile(self.latencies, 99) if self.latencies else None

    @property
    def dead_share(self) -> float:
        """Dead tuples / (live + dead) over the system's tables (0 when empty)."""
        total = self.live + self.dead
        return self.dead / total if total else 0.0


@dataclass(frozen=True)
class Limits:
    """What "back to normal" means for one system, from its ``before`` samples."""

    p99_ms: float
    depth: int
    dead_share: float

    def met(self, sample: Sample) -> bool:
        p99 = sample.p99
        # An infinite p99 limit is no condition at all (see alone()), even with no picks.
        fast = self.p99_ms == float("inf") or (p99 is not None and p99 <= self.p99_ms)
        return fast and sample.depth <= self.depth and sample.dead_share <= self.dead_share


# -- The summaries (pure) ---------------------------------------------------------------


def limits(before: Sequence[Sample]) -> Limits:
    """(a) P99_FACTOR x the median window p99, (b) the largest depth (at least
    DEPTH_FLOOR), over the ``before`` samples; (c) the largest dead share over
    the second half of them."""
    p99s = [s.p99 for s in before if s.p99 is not None]
    if not p99s:
        raise ValueError("no before sample picked a job")
    return Limits(P99_FACTOR * median(p99s), max(DEPTH_FLOOR, *(s.depth for s in before)),
                  max(s.dead_share for s in before[len(before) // 2:]))


def alone(bounds: Limits) -> tuple[Limits, Limits, Limits]:
    """``bounds`` with one condition kept at a time: p99, depth, dead tuples."""
    inf = float("inf")
    return (Limits(bounds.p99_ms, sys.maxsize, inf), Limits(inf, bounds.depth, inf),
            Limits(inf, sys.maxsize, bounds.dead_share))


def recovery(samples: Sequence[Sample], release: float, bounds: Limits,
             consecutive: int = CONSECUTIVE) -> float | None:
    """Seconds from ``release`` to the first sample (ending after it) that
    starts a run of ``consecutive`` samples all within ``bounds``; None when
    there is no such run."""
    later = sorted((s for s in samples if s.t > release), key=lambda s: s.t)
    run = 0
    for index, sample in enumerate(later):
        run = run + 1 if bounds.met(sample) else 0
        if run == consecutive:
            return later[index - consecutive + 1].t - release
    return None


def pooled(samples: Sequence[Sample]) -> list[float]:
    return [ms for s in samples for ms in s.latencies]


@dataclass(frozen=True)
class Summary:
    """One system over one phase (or one minute)."""

    seconds: float
    picks: int
    #: Jobs enqueued over the span (None: not recorded).
    enqueued: int | None
    p50: float | None
    p99: float | None
    worst_p99: float | None
    depth_median: float
    depth_max: int
    dead_max: int
    dead_end: int
    live_end: int
    size_end: int
    autovacuums: int
    #: HOT updates / updates over the span (None: no updates).
    hot_share: float | None
    horizon_max: int | None
    #: Median 1-minute load average of the machine (None: not recorded).
    load_median: float | None
    probe_ms_median: float | None
    probe_ms_max: float | None
    probe_buffers_median: float | None
    probe_buffers_max: int | None
    #: The indexes the probed claims read, with how many probes read each.
    probe_indexes: dict[str, int]
    claim_index_end: int | None
    indexes_end: int | None


def summarize(samples: Sequence[Sample], seconds: float, prior: Sample | None = None) -> Summary:
    """``samples`` (in time order) over ``seconds``; the counters (autovacuums,
    updates) count from ``prior``, the sample before the first, else the first."""
    latencies = pooled(samples)
    p99s = [s.p99 for s in samples if s.p99 is not None]
    probes = [s.probe_ms for s in samples if s.probe_ms is not None]
    buffers = [s.probe_buffers for s in samples if s.probe_buffers is not None]
    horizons = [s.horizon_age for s in samples if s.horizon_age is not None]
    last = samples[-1]
    first = prior or samples[0]
    updates = last.updates - first.updates
    indexes: dict[str, int] = {}
    for s in samples:
        if s.probe_index is not None:
            indexes[s.probe_index] = indexes.get(s.probe_index, 0) + 1
    return Summary(
        seconds=seconds, picks=len(latencies),
        enqueued=(None if any(s.enqueued < 0 for s in samples)
                  else sum(s.enqueued for s in samples)),
        p50=percentile(latencies, 50) if latencies else None,
        p99=percentile(latencies, 99) if latencies else None,
        worst_p99=max(p99s) if p99s else None,
        depth_median=median([s.depth for s in samples]),
        depth_max=max(s.depth for s in samples),
        dead_max=max(s.dead for s in samples), dead_end=last.dead, live_end=last.live,
        size_end=last.size, autovacuums=last.autovacuums - first.autovacuums,
        hot_share=(last.hot_updates - first.hot_updates) / updates if updates > 0 else None,
        horizon_max=max(horizons) if horizons else None,
        load_median=median(loads) if (loads := [s.load for s in samples
                                                  if s.load is not None]) else None,
        probe_ms_median=median(probes) if probes else None,
        probe_ms_max=max(probes) if probes else None,
        probe_buffers_median=median([float(b) for b in buffers]) if buffers else None,
        probe_buffers_max=max(buffers) if buffers else None,
        probe_indexes=indexes,
        claim_index_end=last.claim_index_size, indexes_end=last.indexes_size,
    )


def by_phase(samples: Sequence[Sample], phases: Phases) -> dict[str, Summary]:
    """The reported phases of one system's samples (time order)."""
    out = {}
    for name in PHASES[1:]:
        chosen = [i for i, s in enumerate(samples) if s.phase == name]
        if not chosen:
            continue
        prior = samples[chosen[0] - 1] if chosen[0] > 0 else None
        out[name] = summarize([samples[i] for i in chosen], float(getattr(phases, name)), prior)
    return out


def by_minute(samples: Sequence[Sample]) -> list[tuple[int, str, Summary]]:
    """(minute, phase at its end, summary) for each whole or partial minute."""
    out = []
    minutes: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        minutes.setdefault(int((sample.t - 1e-9) // 60), []).append(index)
    for minute, chosen in sorted(minutes.items()):
        prior = samples[chosen[0] - 1] if chosen[0] > 0 else None
        part = [samples[i] for i in chosen]
        out.append((minute, part[-1].phase, summarize(part, 60.0, prior)))
    return out


# -- Measuring --------------------------------------------------------------------------


@dataclass
class Target:
    """One system under test in this run."""

    system: System
    url: str
    conn: psycopg.Connection[Any]
    cursors: list[int] = field(default_factory=list)
    lo: datetime | None = None
    samples: list[Sample] = field(default_factory=list)
    held: psycopg.Connection[Any] | None = None
    enqueued: str = ""


_EXECUTION = re.compile(r"Execution Time: ([0-9.]+) ms")
_BUFFERS = re.compile(r"Buffers: shared((?: \w+=\d+)+)")
#: The first scan of belay_jobs in the plan: the ready CTE's.
_SCAN = re.compile(r"Scan(?: Backward)? (?:using (\w+) )?on belay_jobs\b")


def probe_claim(url: str) -> tuple[float, int, str, str]:
    """belay's claim of 10 from ``default`` under EXPLAIN (ANALYZE, BUFFERS),
    rolled back: (execution ms, shared buffers of the top node, the index the
    ready CTE read — "seq scan" when none — and the plan)."""
    now = datetime.now(timezone.utc)
    params = {"queue": "default", "take": 10, "node": "bench-vacuum-probe", "now": now,
              "lease_until": now + timedelta(seconds=30), "kinds": None}
    with psycopg.connect(url) as conn:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + QUERIES["claim"], params).fetchall()
        conn.rollback()
    plan = "\n".join(str(r[0]) for r in rows)
    found = _EXECUTION.search(plan)
    buffers = _BUFFERS.search(plan)
    blocks = sum(int(part.split("=")[1]) for part in buffers.group(1).split()) if buffers else 0
    scan = _SCAN.search(plan)
    index = "?" if scan is None else scan.group(1) or "seq scan"
    return (float(found.group(1)) if found else float("nan")), blocks, index, plan


def sample(target: Target, t: float, phase: str, probe: bool) -> tuple[Sample, str | None]:
    conn = target.conn
    row = conn.execute("SELECT clock_timestamp() - make_interval(secs => %s)",
                       (MARGIN,)).fetchone()
    assert row is not None
    hi: datetime = row[0]
    lo = target.lo or hi
    lo_id = target.cursors[-LOOKBACK] if len(target.cursors) >= LOOKBACK else 0
    window = {"lo": lo, "hi": hi, "lo_id": lo_id}
    latencies = [float(r[0]) * 1000 for r in conn.execute(target.system.picks, window)]
    enqueued = conn.execute(target.system.enqueues, window).fetchone()
    assert enqueued is not None
    target.lo = hi
    cursor = conn.execute(target.system.cursor).fetchone()
    target.cursors.append(int(cursor[0]) if cursor else 0)
    depth = conn.execute(target.system.depth).fetchone()
    tables = conn.execute(TABLES, {"like": target.system.like}).fetchone()
    horizon = conn.execute(HORIZON).fetchone()
    assert depth is not None and tables is not None and horizon is not None
    taken = Sample(target.system.name, t - MARGIN, phase, latencies,
                   enqueued=int(enqueued[0]), depth=int(depth[0]),
                   dead=int(tables[0]), live=int(tables[1]), size=int(tables[2]),
                   autovacuums=int(tables[3]), updates=int(tables[4]),
                   hot_updates=int(tables[5]),
                   horizon_age=None if horizon[0] is None else int(horizon[0]),
                   load=os.getloadavg()[0])
    plan = None
    if target.system.is_belay:
        size = conn.execute("SELECT pg_relation_size(%s::regclass),"
                            " pg_indexes_size('belay_jobs'::regclass)", (CLAIM_INDEX,)).fetchone()
        assert size is not None
        taken.claim_index_size, taken.indexes_size = int(size[0]), int(size[1])
        if probe:
            taken.probe_ms, taken.probe_buffers, taken.probe_index, plan = probe_claim(
                target.url)
    target.samples.append(taken)
    return taken, plan


def ask_doctor(url: str) -> dict[str, str]:
    """``belay doctor``'s horizon and tables findings on ``url``."""
    from belay import doctor

    found = doctor.run(belay.Belay(url))
    return {f.check: f"{f.severity}: {f.summary}" for f in found
            if f.check in ("horizon", "tables")}


def hold(url: str) -> psycopg.Connection[Any]:
    """A session idle in a REPEATABLE READ transaction that has taken its snapshot."""
    conn = psycopg.connect(url)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("SELECT 1")
    return conn


@dataclass
class Run:
    phases: Phases
    rate: float
    #: Each system's title, in report order, and each belay variant's SQL.
    titles: dict[str, str]
    variants: dict[str, str]
    targets: dict[str, list[Sample]]
    #: Seconds from the start to when the sessions were opened and closed.
    held_at: float
    released_at: float
    #: The held sessions' own xmin ages just before they ended, per system.
    held_ages: dict[str, int | None]
    enqueued: dict[str, str]
    #: belay's claim plan at the end of each phase, per belay system.
    plans: dict[str, dict[str, str]]
    wall_seconds: float
    #: belay_jobs' indexes in each belay system's database, as the run began.
    indexes: dict[str, list[str]] = field(default_factory=dict)
    #: ``belay doctor``'s horizon and tables findings on belay's database in the
    #: last sample interval of the held phase ("severity: summary").
    doctor: dict[str, str] = field(default_factory=dict)


def _stop_popen(popen: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def _stopped_output(proc: Proc) -> str:
    proc.stop()
    assert proc.popen.stdout is not None
    return proc.popen.stdout.read().strip()


def systems(variants: Sequence[str], with_peers: bool = True) -> list[System]:
    """belay, a belay system per ``LABEL=SQL`` variant, then the peers."""
    out = [BELAY]
    for number, variant in enumerate(variants, 1):
        label, sep, setup = variant.partition("=")
        if not sep or not label.strip() or not setup.strip():
            raise ValueError(f"a variant is LABEL=SQL, got {variant!r}")
        out.append(replace(BELAY, name=f"belay-{number}", title=f"belay, {label.strip()}",
                           setup=setup.strip()))
    return [*out, PGQUEUER, PROCRASTINATE] if with_peers else out


def measure(bench: Bench, phases: Phases, rate: float, variants: Sequence[str] = (),
            with_peers: bool = True) -> Run:
    chosen = systems(variants, with_peers)
    pythons: dict[str, str | None] = {
        peer.system: peers.peer_python(peer.system, peer.requirement, *peer.extras,
                                       log=bench.log)
        for peer in (peers.PGQUEUER, peers.PROCRASTINATE) if with_peers
    }
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vacuum-")))
        workers: dict[str, subprocess.Popen[Any]] = {}
        # Workers first, producers after: every system starts from an empty queue.
        for system in chosen:
            if system.is_belay:
                urls[system.name] = stack.enter_context(bench.database("vacuum"))
                if system.setup:
                    with psycopg.connect(urls[system.name], autocommit=True) as conn:
                        conn.execute(system.setup)
                log = stack.enter_context(open(logs / f"{system.name}-worker.log", "w"))
                worker = subprocess.Popen(
                    [sys.executable, "-m", "belay", "worker", "--url", urls[system.name],
                     "--import", "bench.vacuum", "--queue", "default=10"],
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                    env={**os.environ, "PYTHONPATH": str(ROOT)})
                stack.callback(_stop_popen, worker)
                workers[system.name] = worker
                continue
            peer = peers.PGQUEUER if system is PGQUEUER else peers.PROCRASTINATE
            python = pythons[system.name]
            assert python is not None
            urls[system.name] = stack.enter_context(
                bench.database(f"vacuum_{system.name}", belay_schema=False))
            peers._prepare(peer, python, urls[system.name], 1)
            proc = Proc(peer.module, "work", "--url", urls[system.name],
                        *PEER_ARGS[system.name], python=python)
            stack.callback(proc.stop)
            proc.wait_ready()
            proc.popen.send_signal(signal.SIGUSR1)
        targets = {system.name: Target(system, urls[system.name], stack.enter_context(
                       psycopg.connect(urls[system.name], autocommit=True)))
                   for system in chosen}
        producers = {}
        for system in chosen:
            producers[system.name] = Proc(
                "bench.vacuum_producer", "belay" if system.is_belay else system.name,
                "--url", urls[system.name], "--rate", f"{rate:g}",
                python=pythons.get(system.name))
            stack.callback(producers[system.name].stop)
        for proc in producers.values():
            proc.wait_ready()
        bench.log(f"vacuum: {len(chosen)} systems at {rate:g} jobs/s each; phases "
                  f"{phases.ends()}")
        indexes = {name: [str(r[0]) for r in target.conn.execute(
                       "SELECT indexname FROM pg_indexes WHERE tablename = 'belay_jobs'"
                       " ORDER BY indexname").fetchall()]
                   for name, target in targets.items() if target.system.is_belay}
        run = _sample_loop(bench, phases, rate, targets, producers, workers)
        run.indexes = indexes
        return run
    raise AssertionError("unreachable")


def _close_held(targets: dict[str, Target]) -> None:
    for target in targets.values():
        if target.held is not None:
            with contextlib.suppress(psycopg.Error):
                target.held.close()
            target.held = None


def _sample_loop(bench: Bench, phases: Phases, rate: float, targets: dict[str, Target],
                 producers: dict[str, Proc], workers: dict[str, subprocess.Popen[Any]]) -> Run:
    ends = phases.ends()
    start = time.monotonic()
    held_at = released_at = -1.0
    held_ages: dict[str, int | None] = {}
    plans: dict[str, dict[str, str]] = {}
    doctored: dict[str, str] = {}
    tick = 0
    try:
        while True:
            tick += 1
            time.sleep(max(0.0, start + tick * SAMPLE - time.monotonic()))
            t = time.monotonic() - start
            # The phase is what has happened so far; a phase's end is acted on
            # right after the sample that closes it.
            if released_at >= 0:
                phase = "after"
            elif held_at >= 0:
                phase = "held"
            else:
                phase = "warmup" if phases.phase_at(t - MARGIN) == "warmup" else "before"
            hold_now = held_at < 0 and t >= ends["before"]
            release_now = held_at >= 0 and released_at < 0 and t >= ends["held"]
            last = hold_now or release_now or t >= ends["after"]
            for name, target in targets.items():
                _, plan = sample(target, t, phase, probe=target.system.is_belay)
                if plan is not None and phase != "warmup" and last:
                    plans.setdefault(name, {})[phase] = plan
            if release_now:
                doctored = ask_doctor(targets["belay"].url)
                bench.log(f"vacuum: belay doctor said {doctored}")
                for name, target in targets.items():
                    age = target.conn.execute(
                        "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s",
                        (target.held.info.backend_pid if target.held else 0,),
                    ).fetchone()
                    held_ages[name] = None if age is None else age[0]
                _close_held(targets)
                released_at = time.monotonic() - start
                bench.log(f"vacuum: sessions ended at {released_at:.0f} s")
            if hold_now:
                for target in targets.values():
                    target.held = hold(target.url)
                held_at = time.monotonic() - start
                bench.log(f"vacuum: sessions idle in transaction from {held_at:.0f} s")
            if tick % max(1, int(60 / SAMPLE)) == 0:
                bench.log(f"vacuum: {t:5.0f} s {phase:6} " + "; ".join(
                    f"{n} p99 {_ms(tg.samples[-1].p99)} depth {tg.samples[-1].depth} "
                    f"dead {tg.samples[-1].dead:,}"
                    + (f" claim {_ms(tg.samples[-1].probe_ms)} ms "
                       f"{tg.samples[-1].probe_buffers} buf {tg.samples[-1].probe_index}"
                       if tg.system.is_belay else "")
                    for n, tg in targets.items()))
            for name, worker in workers.items():
                if worker.poll() is not None:
                    raise RuntimeError(f"{name}'s worker exited with {worker.returncode}")
            if t >= ends["after"]:
                break
    finally:
        _close_held(targets)
    enqueued = {name: _stopped_output(proc) for name, proc in producers.items()}
    return Run(phases, rate, {n: tg.system.title for n, tg in targets.items()},
               {n: tg.system.setup for n, tg in targets.items() if tg.system.setup},
               {n: tg.samples for n, tg in targets.items()},
               held_at, released_at, held_ages, enqueued, plans,
               time.monotonic() - start, doctor=doctored)


# -- Report -----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _mb(size: int | None) -> str:
    return "—" if size is None else f"{size / 2**20:,.1f}"


def _num(value: float | int | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _rate(count: int | None, seconds: float) -> str:
    return "—" if count is None else f"{count / seconds:.1f}"


def _load(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _indexes(counts: dict[str, int]) -> str:
    return ", ".join(f"`{name}` {n}" for name, n in sorted(counts.items(), key=lambda i: -i[1]))


def report(run: Run, described: dict[str, str], quick: bool) -> str:
    p = run.phases
    names = list(run.titles)
    belays = [n for n in names if n.startswith("belay")]
    minutes = f"{p.before / 60:g} / {p.held / 60:g} / {p.after / 60:g}"
    with_peers = [n for n in PEERS if n in run.titles]
    standard = QUICK if quick else FULL
    lengths = "" if (p.before, p.held, p.after) == (standard.before, standard.held,
                                                    standard.after) else (
        f" --minutes {p.before / 60:g},{p.held / 60:g},{p.after / 60:g}")
    command = "python -m bench.vacuum" + (" --quick" if quick else "") + (
        "" if with_peers else " --no-peers") + lengths + "".join(
        f' --variant "{run.titles[n].removeprefix("belay, ")}={sql}"'
        for n, sql in run.variants.items())
    lines = [
"# A vacuum held back: " + ("belay, PgQueuer and Procrastinate" if with_peers
                                    else "belay and variants of its schema"),
        "",
        f"`{command}` (method: the module's docstring). The {len(names)} systems ran at "
        "the same time on one server, each in its own database, each fed "
        f"{run.rate:g} no-op jobs/s by a producer of its own; phases before / held / after "
        f"of {minutes} minutes (after {p.warmup:g} s of warm-up, not reported); during "
        "`held` one session per database sat idle in a REPEATABLE READ transaction holding "
        f"its snapshot. Samples every {SAMPLE:g} s. The run took "
        f"{run.wall_seconds / 60:.1f} minutes.",
        "",
        "Workers: belay — " + BELAY_NOTE + "".join(
            f"; {run.titles[n]} — one process, {PEER_NOTES[n]}" for n in with_peers) + ".",
        "",
        *(f"Variant **{run.titles[n]}**: belay as above, its database altered once after the "
          f"migration by `{sql}`." for n, sql in run.variants.items()),
        "",
        *(f"`belay_jobs` indexes in {run.titles[n]}'s database: "
          + ", ".join(f"`{i}`" for i in found) + "." for n, found in run.indexes.items()),
        "",
        "Producers said: " + "; ".join(f"{run.titles[n]}: {run.enqueued.get(n) or 'nothing'}"
                                       for n in names) + ".",
        "",
        "The held sessions' xmin age just before they ended: " + ", ".join(
            f"{run.titles[n]} {_num(run.held_ages.get(n))}" for n in names) + " transactions.",
        "",
        *(f"`belay doctor` on belay's database in the last {SAMPLE:g} s of the held phase, "
          f"{check} check — {said}" for check, said in run.doctor.items()),
        "",
        "## Per phase",
        "",
        "Pick-up = enqueue → start from each system's own timestamps, pooled over the "
        "phase; worst p99 = the worst 10-s window. Dead/live tuples, HOT share (HOT "
        "updates / updates) and size are over all of the system's tables (size: heap + "
        "indexes + TOAST). Oldest xmin age: of any session in the system's database.",
        "",
        "| system | phase | enqueued/s | picks/s | pick-up p50 ms | p99 ms | worst 10-s p99 ms | "
        "depth median / max | dead tuples max / at end | live at end | size at end MB | "
        "HOT share | autovacuums | oldest xmin age | load avg median |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summaries = {name: by_phase(samples, p) for name, samples in run.targets.items()}
    for name in names:
        for phase, s in summaries[name].items():
            lines.append(
                f"| {run.titles[name]} | {phase} | {_rate(s.enqueued, s.seconds)} | "
                f"{s.picks / s.seconds:.1f} | {_ms(s.p50)} | "
                f"{_ms(s.p99)} | {_ms(s.worst_p99)} | {s.depth_median:,.0f} / {s.depth_max:,} | "
                f"{s.dead_max:,} / {s.dead_end:,} | {s.live_end:,} | {_mb(s.size_end)} | "
                f"{_share(s.hot_share)} | {s.autovacuums} | {_num(s.horizon_max)} | "
                f"{_load(s.load_median)} |")
    lines += [
        "",
        "belay's own claim statement, `EXPLAIN (ANALYZE, BUFFERS)` of a claim of 10 "
        "(rolled back), once per sample; the index its ready CTE read (probes per index); "
        f"the size of `{CLAIM_INDEX}` and of all of `belay_jobs`' indexes at the phase's end:",
        "",
        "| system | phase | claim ms median / max | shared buffers median / max | "
        "ready CTE read | claim index MB | all indexes MB |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for name in belays:
        for phase, s in summaries[name].items():
            lines.append(f"| {run.titles[name]} | {phase} | {_ms(s.probe_ms_median)} / "
                         f"{_ms(s.probe_ms_max)} | {_num(s.probe_buffers_median)} / "
                         f"{_num(s.probe_buffers_max)} | {_indexes(s.probe_indexes)} | "
                         f"{_mb(s.claim_index_end)} | {_mb(s.indexes_end)} |")
    lines += [
        "",
        "## Recovery",
        "",
        f"From the end of the held sessions (at {run.released_at:.0f} s) to the first of "
        f"{CONSECUTIVE} consecutive samples with pick-up p99 ≤ {P99_FACTOR:g}x the `before` "
        f"median of 10-s p99s, depth ≤ the largest `before` depth (at least {DEPTH_FLOOR}) "
        "and dead tuples / (live + dead) ≤ the largest share in the second half of `before` "
        "(resolution: one sample).",
        "",
        "The last three columns take one condition at a time (the other two ignored), to "
        "show which one held recovery back.",
        "",
        "| system | p99 limit ms | depth limit | dead share limit | **recovered after** | "
        "p99 alone | depth alone | dead tuples alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        samples = run.targets[name]
        try:
            bounds = limits([s for s in samples if s.phase == "before"])
        except ValueError:
            lines.append(f"| {run.titles[name]} | — | — | — | no `before` picks | | | |")
            continue
        took = [recovery(samples, run.released_at, b) for b in (bounds, *alone(bounds))]
        lines.append(f"| {run.titles[name]} | {_ms(bounds.p99_ms)} | {bounds.depth:,} | "
                     f"{bounds.dead_share:.0%} | " + " | ".join(
                         ("not within the after phase" if x is None else f"{x:.0f} s")
                         for x in took) + " |")
    lines += ["", "## One row per minute", ""]
    for name in names:
        belay_like = name in belays
        lines += [f"### {run.titles[name]}", "",
                  "| minute | phase | enqueued/s | picks/s | p50 ms | p99 ms | depth max | "
                  "dead at end | "
                  "live at end | size MB | oldest xmin age | load avg |"
                  + (" claim ms median | claim buffers median |" if belay_like else ""),
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                  + ("---:|---:|" if belay_like else "")]
        for minute, phase, s in by_minute(run.targets[name]):
            lines.append(
                f"| {minute} | {phase} | {_rate(s.enqueued, s.seconds)} | "
                f"{s.picks / s.seconds:.1f} | {_ms(s.p50)} | "
                f"{_ms(s.p99)} | {s.depth_max:,} | {s.dead_end:,} | {s.live_end:,} | "
                f"{_mb(s.size_end)} | {_num(s.horizon_max)} | {_load(s.load_median)} |"
                + (f" {_ms(s.probe_ms_median)} | {_num(s.probe_buffers_median)} |"
                   if belay_like else ""))
        lines.append("")
    if run.plans:
        lines += ["## belay's claim plan at the end of each phase", ""]
        for name, plans in run.plans.items():
            for phase, plan in plans.items():
                lines += [f"**{run.titles[name]}, end of {phase}**", "", "```", plan, "```", ""]
    lines += machine_table(described)
    return "\n".join(lines)


def dump(run: Run, path: str, described: dict[str, str]) -> None:
    """Every sample, as JSON (latencies included), and the machine it ran on."""
    data = {**asdict(run), "machine": described}
    Path(path).write_text(json.dumps(data, default=str))


def load(path: str) -> tuple[Run, dict[str, str] | None]:
    """A run :func:`dump` wrote, and its machine (None if not recorded)."""
    data = json.loads(Path(path).read_text())
    described = data.pop("machine", None)
    data["phases"] = Phases(**data["phases"])
    data["targets"] = {name: [Sample(**s) for s in samples]
                       for name, samples in data["targets"].items()}
    return Run(**data), described


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m bench.vacuum", __doc__,
                       "20 s warm-up, 1 min before, 1 min held, 1.5 min after",
                       out="also write the Markdown report here")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--report-from", metavar="JSON",
                        help="no run: the report of a run --json wrote (with the machine "
                             "it recorded, else this one, now)")
    parser.add_argument("--rate", type=float, default=RATE, help="jobs/s per system")
    parser.add_argument("--minutes", metavar="BEFORE,HELD,AFTER",
                        help="phase lengths in minutes (default 10,10,15; quick 1,1,1.5)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=SQL",
                        help="one more belay system, its database altered by SQL (repeatable)")
    parser.add_argument("--no-peers", action="store_true",
                        help="belay and its variants only (no PgQueuer, no Procrastinate)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so workers, producers and the server stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    phases = QUICK if args.quick else FULL
    if args.minutes:
        before, held, after = (float(m) * 60 for m in args.minutes.split(","))
        phases = Phases(phases.warmup, before, held, after)
    from bench.__main__ import machine, server

    if args.report_from:
        loaded, recorded = load(args.report_from)
        if recorded is None:
            with server(args.url) as (url, _):
                recorded = machine(url)
        publish(report(loaded, recorded, args.quick), args.out)
        return 0
    with server(args.url) as (url, bin_dir):
        bench = Bench(url, quick=args.quick, bin_dir=bin_dir)
        described = machine(url)
        try:
            run = measure(bench, phases, args.rate, args.variant, not args.no_peers)
        finally:
            bench.close()
    if args.json:
        dump(run, args.json, described)
    publish(report(run, described, args.quick), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
