"""Durable steps: belay's ``ctx.step`` against DBOS 3.4.0 (``@DBOS.step`` in a
``@DBOS.workflow``) and Absurd 0.5.1 (``ctx.step`` in a task), each peer in a
virtualenv of its own (:func:`bench.peers.peer_python`), all on the same server.

Every system runs the same job: :data:`STEPS` durable steps in a row (a belay
job, a DBOS workflow, an Absurd task), each step journaled by the system before
the next starts. Each system is at its documented defaults, the way its README
starts a worker:

- belay: one ``belay.Worker({"default": 10})`` process (10 slots; lease_ttl
  30 s, sweeper every 5 s, the default backoff 2^attempt + 0-2 s), the
  worker of ``bench/steps_belay.py``.
- DBOS: one process that calls ``DBOS.launch()`` and
  ``DBOS.register_queue("steps")`` (no concurrency limit, so every queued
  workflow starts at once, on a system pool of 20 connections; polled every
  1 s; a launch re-enqueues this executor's pending workflows), logging at
  ERROR (at 2,000 workflows its pool runs dry and it logs a warning with a
  traceback per wait).
- Absurd: one ``Absurd(url).start_worker()`` process (claim_timeout 120 s,
  concurrency 1, poll_interval 0.25 s); its schema is the ``absurd.sql`` that
  ``absurdctl`` 0.5.1 bundles (what ``absurdctl init`` applies), nothing
  fetched at run time.

**steps/s.** A fresh database; N jobs of no-op steps enqueued first (not
timed: ``enqueue_many`` for belay, ``DBOS.enqueue_workflow`` for DBOS,
``spawn`` for Absurd); then one worker process starts and drains them. The
rate is 10·N over the span from the first job started to the last finished,
read from each system's own tables once it is drained (belay_jobs'
``started_at``/``finished_at``; dbos.workflow_status' ``started_at_epoch_ms``
(the dequeue) and ``completed_at``; Absurd's runs table's ``started_at`` (the
claim) and ``completed_at``), so process start-up is not counted. N = 2,000
(quick: 200); median of 3 drains (quick: 1). Each peer's figure is the
baseline of a "belay vs peer" row: the ratio is belay's rate over the peer's.

**kill -9 recovery.** A fresh database; one job of 10 steps, each of which
appends ``"<step> <pid> <time.time()>"`` to a file, then sleeps 50 ms. A
worker process runs it; once the system's own journal holds step
:data:`KILL_AFTER` (belay_steps, dbos.operation_outputs, Absurd's checkpoint
table), the bench takes ``time.time()`` and SIGKILLs the worker, then starts
a fresh worker process at once. Recovery is the time from the kill to the
first line of step m+1 written by the new process, where m is the number of
steps journaled when the old one died (read after it exited; usually 5). The
file also counts how often each step ran: a step journaled before the kill
that runs again in the new process is a duplicate (step m+1, if it had
started before the kill, runs again by design). The job must then finish in the new
process. Rows: each system at its defaults, and "tuned" with the documented
setting for a shorter recovery — belay ``lease_ttl=2`` (heartbeat every
2/3 s), ``sweep_interval=0.5`` and the job's ``backoff`` 0; Absurd
``start_worker(claim_timeout=2)``. DBOS has no timeout to tune: a launch
recovers at once. Median of 3 (quick: 1); a default that waits out a fixed
timeout (belay's lease, Absurd's claim) is measured once.

The default rows of belay (a 30 s lease) and Absurd (a 120 s claim timeout)
wait out those timeouts, so they are measured in the full run only; quick mode
has the tuned rows and DBOS.

A peer that cannot be installed, or whose runs fail, has NaN figures with the
reason in the note; the scenario itself does not fail.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

import belay
from bench import core, peers, steps_belay
from bench.core import Bench, Figure

SECTION = "steps"
STEPS = steps_belay.STEPS
#: The worker is killed once this many steps are journaled.
KILL_AFTER = 5
#: What each step of the recovery job sleeps, in seconds.
SLEEP = 0.05
PREPARE_TIMEOUT = 300.0
POLL = 0.002


@dataclass(frozen=True)
class System:
    """One system's worker, and how to read its progress from its own tables."""

    key: str
    title: str
    module: str
    #: Installs the peer (belay: None, it is this environment).
    install: Callable[[Bench], str] | None
    #: True once no job is left to run.
    drained: str
    #: How many jobs succeeded.
    succeeded: str
    #: Seconds from the first job started to the last finished.
    elapsed: str
    #: Steps journaled (of the one recovery job).
    journaled: str
    #: The settings it ran at, for the notes.
    settings: str
    #: Extra arguments of the worker in the tuned recovery rows (None: no such row).
    tuned: tuple[str, ...] | None
    tuned_settings: str = ""
    #: Whether the default recovery waits out a long timeout (full run only).
    slow_default: bool = False


def _dbos(bench: Bench) -> str:
    return peers.peer_python("dbos", "dbos==3.4.0", log=bench.log)


def _absurd(bench: Bench) -> str:
    # absurdctl carries the schema SQL; the import check covers both packages.
    return peers.peer_python("absurd_sdk, absurdctl", "absurd-sdk==0.5.1", "absurdctl==0.5.1",
                             log=bench.log)


BELAY = System(
    key="belay", title="belay", module="bench.steps_belay", install=None,
    drained="SELECT NOT EXISTS (SELECT FROM belay_jobs"
            " WHERE state NOT IN ('succeeded', 'failed', 'cancelled'))",
    succeeded="SELECT count(*) FROM belay_jobs WHERE state = 'succeeded'",
    elapsed="SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM belay_jobs",
    journaled="SELECT count(*) FROM belay_steps WHERE name LIKE 's%'",
    settings="one worker process, belay.Worker({'default': 10}) at its defaults "
             "(10 slots, lease_ttl 30 s, sweeper every 5 s, default backoff)",
    tuned=("--tuned",),
    tuned_settings=f"lease_ttl={steps_belay.TUNED_LEASE_TTL:g} s, "
                   f"sweep_interval={steps_belay.TUNED_SWEEP_INTERVAL:g} s, job backoff 0",
    slow_default=True,
)

DBOS = System(
    key="dbos", title="DBOS 3.4.0", module="bench.peer_steps_dbos", install=_dbos,
    drained="SELECT NOT EXISTS (SELECT FROM dbos.workflow_status"
            " WHERE status IN ('ENQUEUED', 'PENDING', 'DELAYED'))",
    succeeded="SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'",
    elapsed="SELECT (max(coalesce(completed_at, updated_at)) - min(started_at_epoch_ms))"
            " / 1000.0 FROM dbos.workflow_status",
    journaled="SELECT count(*) FROM dbos.operation_outputs"
              " WHERE completed_at_epoch_ms IS NOT NULL",
    settings="one process: DBOS.launch() + DBOS.register_queue('steps') at its defaults "
             "(no concurrency limit: every queued workflow starts at once, on a system pool "
             "of 20 connections; polled every 1 s); log_level ERROR",
    tuned=None,
)

ABSURD = System(
    key="absurd", title="Absurd 0.5.1", module="bench.peer_steps_absurd", install=_absurd,
    drained="SELECT NOT EXISTS (SELECT FROM absurd.t_default"
            " WHERE state IN ('pending', 'running', 'sleeping'))",
    succeeded="SELECT count(*) FROM absurd.t_default WHERE state = 'completed'",
    elapsed="SELECT extract(epoch FROM max(completed_at) - min(started_at))"
            " FROM absurd.r_default WHERE state = 'completed'",
    journaled="SELECT count(*) FROM absurd.c_default WHERE status = 'committed'",
    settings="one process: Absurd(url).start_worker() at its defaults (claim_timeout 120 s, "
             "concurrency 1, poll_interval 0.25 s); schema from absurdctl 0.5.1's bundled "
             "absurd.sql",
    tuned=("--claim-timeout", "2"),
    tuned_settings="start_worker(claim_timeout=2)",
    slow_default=True,
)

SYSTEMS = (BELAY, DBOS, ABSURD)


class Failed(RuntimeError):
    """A run that did not give a figure."""


def _value(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _worker(system: System, python: str, url: str, *args: str) -> core.Proc:
    if system is BELAY:
        return core.Proc(system.module, "--url", url, *args)
    return core.Proc(system.module, "work", "--url", url, *args, python=python)


def _prepare(system: System, python: str, url: str, count: int, path: str | None) -> None:
    """Enqueue ``count`` jobs (sleeping steps that record into ``path``, if given)."""
    if system is BELAY:
        kind = steps_belay.NOOP if path is None else steps_belay.SLEEP
        payload = {} if path is None else {"file": path, "sleep": SLEEP}
        with belay.Belay(url, notify=False) as client:
            for start in range(0, count, 5_000):
                client.enqueue_many([{"kind": kind, "input": payload}
                                     for _ in range(start, min(count, start + 5_000))])
        return
    args = ["prepare", "--url", url, "--count", str(count)]
    if path is not None:
        args += ["--file", path, "--sleep", str(SLEEP)]
    done = subprocess.run([python, "-m", system.module, *args], cwd=core.ROOT,
                          env={**os.environ, "PYTHONPATH": str(core.ROOT)},
                          capture_output=True, text=True, timeout=PREPARE_TIMEOUT)
    if done.returncode != 0:
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise Failed(f"{system.module} prepare exited with {done.returncode}: "
                     + " | ".join(said[-3:]))


# -- steps/s -----------------------------------------------------------------------------


def drain(bench: Bench, system: System, python: str, count: int) -> float:
    """steps/s of one drain of ``count`` no-op jobs by one worker process."""
    with bench.database(f"steps_{system.key}", belay_schema=system is BELAY) as url:
        _prepare(system, python, url, count, None)
        worker = _worker(system, python, url)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                core.wait_for(conn, system.drained, timeout=120 + count / 5, interval=0.05)
                succeeded = _value(conn, system.succeeded)
                elapsed = _value(conn, system.elapsed)
        finally:
            worker.stop()
    if succeeded != count:
        raise Failed(f"{succeeded} of {count} jobs succeeded")
    return STEPS * count / float(elapsed)


# -- kill -9 recovery ------------------------------------------------------------------


@dataclass
class Recovery:
    seconds: float
    journaled: int
    #: Runs of steps journaled before the kill beyond their first.
    duplicates: int
    runs: dict[int, int]


def recover(bench: Bench, system: System, python: str, args: tuple[str, ...],
            timeout: float) -> Recovery:
    """One kill -9 of a worker in the middle of the sleeping job (see the docstring)."""
    with bench.database(f"recover_{system.key}", belay_schema=system is BELAY) as url, \
            tempfile.TemporaryDirectory(prefix="belay-bench-steps-") as folder:
        path = str(Path(folder) / "steps.log")
        Path(path).touch()
        _prepare(system, python, url, 1, path)
        old = _worker(system, python, url, *args)
        new: core.Proc | None = None
        new_pid = -1
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                core.wait_for(conn, f"SELECT ({system.journaled}) >= {KILL_AFTER}",
                              timeout=60, interval=POLL)
                killed_at = time.time()
                old.popen.kill()
                new = _worker(system, python, url, *args)
                new_pid = new.pid
                old.popen.wait()
                journaled = int(_value(conn, system.journaled))
                core.wait_for(conn, system.drained, timeout=timeout, interval=0.05)
                succeeded = _value(conn, system.succeeded)
            if succeeded != 1:
                raise Failed("the job did not succeed after the kill")
            lines = [line.split() for line in Path(path).read_text().splitlines()]
        finally:
            old.stop()
            if new is not None:
                new.stop()
    runs = Counter(int(step) for step, _, _ in lines)
    resumed = [float(at) for step, pid, at in lines
               if int(step) == journaled + 1 and int(pid) == new_pid]
    if not resumed:
        raise Failed(f"step {journaled + 1} never ran in the new worker")
    if set(runs) != set(range(1, STEPS + 1)):
        raise Failed(f"steps run: {sorted(runs)}")
    duplicates = sum(runs[n] - 1 for n in range(1, journaled + 1))
    return Recovery(min(resumed) - killed_at, journaled, duplicates, dict(sorted(runs.items())))


# -- Figures ---------------------------------------------------------------------------


def _runs(values: list[float]) -> str:
    return ", ".join(f"{value:,.1f}" for value in values)


def measure_rate(bench: Bench, system: System, python: str, count: int,
                 repeats: int) -> float:
    rates = [drain(bench, system, python, count) for _ in range(repeats)]
    value = core.median(rates)
    bench.log(f"{system.title}: {value:,.0f} steps/s (runs: {_runs(rates)})")
    return value


def measure_recovery(bench: Bench, system: System, python: str, tuned: bool,
                     repeats: int) -> list[Recovery]:
    args = (system.tuned or ()) if tuned else ()
    timeout = 60.0 if tuned or not system.slow_default else 240.0
    results = [recover(bench, system, python, args, timeout) for _ in range(repeats)]
    label = "tuned" if tuned else "defaults"
    bench.log(f"{system.title} kill -9 recovery ({label}): "
              f"{_runs([r.seconds for r in results])} s; steps journaled at the kill: "
              f"{[r.journaled for r in results]}; runs per step: {[r.runs for r in results]}")
    return results


def run(bench: Bench) -> list[Figure]:
    count, repeats = bench.size(200, 2_000), bench.size(1, 3)
    pythons: dict[str, str] = {BELAY.key: ""}
    #: Why a figure is missing: "<system>" (not installed), "<system>/rate",
    #: "<system>/recovery".
    missing: dict[str, str] = {}
    for system in SYSTEMS:
        if system.install is not None:
            try:
                pythons[system.key] = system.install(bench)
            except peers.PeerUnavailable as exc:
                missing[system.key] = f"not measured: {exc}"
                bench.log(f"!!! {system.title} could not be installed; its figures are NaN: "
                          f"{exc}")

    rates: dict[str, float] = {}
    for system in SYSTEMS:
        if system.key not in pythons:
            continue
        try:
            rates[system.key] = measure_rate(bench, system, pythons[system.key],
                                             count, repeats)
        except (Failed, TimeoutError, RuntimeError, subprocess.SubprocessError,
                psycopg.Error) as exc:
            bench.log(f"!!! {system.title} steps/s failed, reported as NaN: {exc}")
            missing[f"{system.key}/rate"] = f"not measured: {exc}"

    recovered: dict[tuple[str, bool], list[Recovery]] = {}
    for system in SYSTEMS:
        if system.key not in pythons:
            continue
        for tuned in (False, True):
            if (tuned and system.tuned is None) or (
                    not tuned and system.slow_default and bench.quick):
                continue
            try:
                # A default whose recovery is a fixed timeout (belay's 30 s
                # lease, Absurd's 120 s claim) is measured once.
                once = not tuned and system.slow_default
                recovered[system.key, tuned] = measure_recovery(
                    bench, system, pythons[system.key], tuned, 1 if once else repeats)
            except (Failed, TimeoutError, RuntimeError, subprocess.SubprocessError,
                    psycopg.Error) as exc:
                bench.log(f"!!! {system.title} recovery failed, reported as NaN: {exc}")
                missing.setdefault(f"{system.key}/recovery", f"not measured: {exc}")
    return [*rate_figures(rates, missing, count, repeats),
            *recovery_figures(bench, recovered, missing, repeats)]


def _why(missing: dict[str, str], *keys: str) -> str:
    """The first reason given for any of ``keys``' figures being missing."""
    return next((missing[key] for key in keys if key in missing), "not measured")


def rate_figures(rates: dict[str, float], missing: dict[str, str], count: int,
                 repeats: int) -> list[Figure]:
    method = (f"{count:,} jobs of {STEPS} no-op steps enqueued first, drained by one worker "
              f"process; 10·N over first job started → last finished, from the system's own "
              f"tables; median of {repeats}")
    ours = rates.get(BELAY.key, math.nan)
    figures = [Figure(
        SECTION, f"belay: {STEPS}-step jobs, 1 worker process", ours, "steps/s",
        note=("" if BELAY.key in rates else f"{_why(missing, 'belay/rate')}; ")
        + f"{BELAY.settings}; {method}",
        extra={"system": BELAY.key, "jobs": count})]
    for peer in (DBOS, ABSURD):
        name = f"belay vs {peer.title}: {STEPS}-step jobs, 1 worker process"
        if peer.key in rates and BELAY.key in rates:
            figures.append(Figure(SECTION, name, ours, "steps/s", baseline=peer.title,
                                  baseline_value=rates[peer.key],
                                  note=f"{peer.title}: {peer.settings}",
                                  extra={"system": peer.key, "jobs": count}))
        else:
            figures.append(Figure(
                SECTION, name, math.nan, "steps/s",
                note=_why(missing, peer.key, f"{peer.key}/rate", "belay/rate"),
                extra={"system": peer.key}))
    return figures


def _seconds(results: list[Recovery] | None) -> float:
    return core.median([r.seconds for r in results]) if results else math.nan


def _mode(system: System, tuned: bool) -> str:
    return f"tuned: {system.tuned_settings}" if tuned else "defaults"


def recovery_figures(bench: Bench, recovered: dict[tuple[str, bool], list[Recovery]],
                     missing: dict[str, str], repeats: int) -> list[Figure]:
    method = (f"kill -9 once step {KILL_AFTER} of {STEPS} (50 ms each) is journaled, a fresh "
              f"worker process started at once; from the kill to the step after the last "
              f"journaled one starting in the new process; median of {repeats} (a default "
              "whose recovery waits out a fixed timeout: once)")
    figures: list[Figure] = []
    for tuned in (False, True):
        if bench.quick and not tuned:
            continue
        ours = recovered.get(("belay", tuned))
        figures.append(Figure(
            SECTION, f"kill -9 recovery, belay ({'tuned' if tuned else 'defaults'})",
            _seconds(ours), "s", higher_is_better=False,
            note=("" if ours is not None else f"{_why(missing, 'belay/recovery')}; ")
            + f"{_mode(BELAY, tuned)}; {method}",
            extra={"system": "belay", "runs": [r.seconds for r in ours or []]}))
    # belay against each peer, mode for mode. DBOS has only its defaults (a
    # launch recovers at once), so it stands against belay both ways.
    pairs = ((False, DBOS, False), (True, DBOS, False), (False, ABSURD, False),
             (True, ABSURD, True))
    for belay_tuned, peer, peer_tuned in pairs:
        if bench.quick and not belay_tuned:
            continue
        ours = recovered.get(("belay", belay_tuned))
        theirs = recovered.get((peer.key, peer_tuned))
        name = (f"kill -9 recovery, belay ({'tuned' if belay_tuned else 'defaults'}) vs "
                f"{peer.title} ({'tuned' if peer_tuned else 'defaults'})")
        extra = {"system": peer.key, "peer_runs": [r.seconds for r in theirs or []]}
        if ours is None or theirs is None:
            why = _why(missing, peer.key, f"{peer.key}/recovery", "belay/recovery")
            figures.append(Figure(SECTION, name, math.nan, "s", higher_is_better=False,
                                  note=why, extra=extra))
            continue
        how = ("a launch re-enqueues this executor's pending workflows"
               if peer is DBOS else _mode(peer, peer_tuned))
        figures.append(Figure(
            SECTION, name, _seconds(ours), "s", baseline=peer.title,
            baseline_value=_seconds(theirs), higher_is_better=False,
            note=f"{peer.title}: {how}; belay {_mode(BELAY, belay_tuned)}", extra=extra))
    for system in SYSTEMS:
        results = [r for (key, _), rs in recovered.items() if key == system.key for r in rs]
        reason = missing.get(system.key) or missing.get(f"{system.key}/recovery")
        duplicates = float(sum(r.duplicates for r in results)) if results else math.nan
        figures.append(Figure(
            SECTION, f"{system.title}: journaled steps run again after kill -9",
            duplicates, "steps", higher_is_better=False, target="0",
            met=None if not results else duplicates == 0,
            note=(reason or "not measured") if not results else (
                f"every recovery run above ({len(results)}); steps journaled at the kill: "
                f"{[r.journaled for r in results]}; runs of steps 1-{STEPS}: "
                f"{[list(r.runs.values()) for r in results]} (a step the kill cut short "
                "runs again, by design)"),
            extra={"system": system.key}))
    return figures
