"""Peer libraries drained on the same server as belay: PgQueuer,
Procrastinate, Oban for Python and DBOS (its durable queues) at pinned
versions, each in a virtualenv of its own, so none shares belay's environment
nor pins anything in it. A peer that needs a newer Python than the bench runs
on (Oban: 3.12) gets its virtualenv from such an interpreter found on the
machine (``PATH``, pyenv's versions), or is reported as not measured.

One drain: a fresh empty database, the peer's own schema, N no-op jobs enqueued
in one batch (not timed), then worker processes that connect, say ``ready`` and
start together on SIGUSR1. The clock is the database's, read from the peer's
own log or event table once the queue is drained: from the first job taken to
the last success recorded, as belay's burn-down reads ``belay_jobs``. So
imports and connections stay off the clock, completions count where the peer
commits them (not where a worker believes them done), and the polling that
notices the end adds no error.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import core
from bench.core import Bench, Figure

SECTION = "throughput"
#: Where the peers' virtualenvs are kept between runs.
CACHE_ENV = "BELAY_BENCH_CACHE"
PROCESS_COUNTS = (1, 2)
INSTALL_TIMEOUT = 900.0
PREPARE_TIMEOUT = 300.0
#: How often to look whether the drain is over; the timing does not depend on it.
POLL_INTERVAL = 0.05


class PeerUnavailable(RuntimeError):
    """A peer's virtualenv could not be made (no network, no such release)."""


@dataclass(frozen=True)
class Peer:
    """A peer library: how to install it, run it, and read its progress."""

    system: str
    title: str
    requirement: str
    extras: tuple[str, ...]
    module: str
    #: True once no job is left to run (succeeded or not).
    drained: str
    #: How many jobs succeeded.
    succeeded: str
    #: Seconds from the first job taken to the last success recorded.
    elapsed: str
    #: The oldest Python the pinned release installs on, when newer than 3.11.
    min_python: tuple[int, int] | None = None


@dataclass(frozen=True)
class Setup:
    """One configuration of a peer's worker processes."""

    peer: Peer
    label: str
    args: tuple[str, ...]
    note: str
    extra: dict[str, Any] = field(default_factory=dict)


PGQUEUER = Peer(
    system="pgqueuer",
    title="PgQueuer 1.6.0",
    requirement="pgqueuer[psycopg]==1.6.0",
    extras=("psycopg[binary]",),
    module="bench.peer_pgqueuer",
    # A finished job leaves the queue table for the log table in one statement.
    drained="SELECT NOT EXISTS (SELECT FROM pgqueuer)",
    succeeded="SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'",
    elapsed="SELECT extract(epoch FROM max(created) FILTER (WHERE status = 'successful')"
            " - min(created) FILTER (WHERE status = 'picked')) FROM pgqueuer_log",
)

PROCRASTINATE = Peer(
    system="procrastinate",
    title="Procrastinate 3.10.0",
    requirement="procrastinate==3.10.0",
    extras=("psycopg[binary,pool]",),
    module="bench.peer_procrastinate",
    drained="SELECT NOT EXISTS (SELECT FROM procrastinate_jobs"
            " WHERE status IN ('todo', 'doing'))",
    succeeded="SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
    elapsed="SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
            " - min(at) FILTER (WHERE type = 'started')) FROM procrastinate_events",
)

OBAN = Peer(
    system="oban",
    title="Oban for Python 0.7.0",
    requirement="oban==0.7.0",
    extras=(),
    module="bench.peer_oban",
    # Oban keeps its jobs (pruned after a day): the states left to run.
    drained="SELECT NOT EXISTS (SELECT FROM oban_jobs"
            " WHERE state IN ('available', 'scheduled', 'executing', 'retryable'))",
    succeeded="SELECT count(*) FROM oban_jobs WHERE state = 'completed'",
    # attempted_at is stamped by the fetch, completed_at by the (batched) ack.
    elapsed="SELECT extract(epoch FROM max(completed_at) - min(attempted_at)) FROM oban_jobs",
    min_python=(3, 12),
)

DBOS = Peer(
    system="dbos",
    title="DBOS 3.4.0 queues",
    requirement="dbos==3.4.0",
    extras=(),
    module="bench.peer_dbos",
    drained="SELECT NOT EXISTS (SELECT FROM dbos.workflow_status"
            " WHERE status IN ('ENQUEUED', 'DELAYED', 'PENDING'))",
    succeeded="SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'",
    # Epoch milliseconds of the database's clock: the claim's and the outcome's.
    elapsed="SELECT (max(completed_at) - min(started_at_epoch_ms)) / 1000.0"
            " FROM dbos.workflow_status WHERE status = 'SUCCESS'",
)

SETUPS = (
    Setup(PGQUEUER, "", ("--consumers", "5", "--batch", "10"),
          "PgQueuer's benchmark defaults: 5 consumers per process, one psycopg "
          "connection each, batch 10",
          {"consumers": 5, "batch": 10}),
    Setup(PGQUEUER, " (batch 100)", ("--consumers", "5", "--batch", "100"),
          "5 consumers per process, one psycopg connection each, batch 100",
          {"consumers": 5, "batch": 100}),
    Setup(PROCRASTINATE, "", ("--concurrency", "10", "--pool", "4"),
          "one worker per process, concurrency 10, async no-op task, pool of 4 connections",
          {"concurrency": 10, "pool": 4}),
    Setup(OBAN, "", ("--limit", "10"),
          "Oban's documented defaults: embedded as `oban start` runs it (uvloop, orjson), "
          "one queue at limit 10 (the docs' `default = 10`, and a queue's limit when none "
          "is given), debounce 5 ms, connection pool of 1 to 10; async no-op worker",
          {"config": "defaults", "limit": 10, "pool": 10}),
    Setup(OBAN, " (limit 500)", ("--limit", "500"),
          "the best configuration found from Oban's docs (\"Defining Queues\": a queue's "
          "limit is its concurrency, per node, with no upper bound): queue limit 500, "
          "otherwise as the defaults",
          {"config": "best", "limit": 500, "pool": 10}),
    Setup(DBOS, "", ("--worker-concurrency", "0", "--polling", "1.0"),
          "DBOS's defaults: a registered queue with no concurrency limit (one poll claims "
          "every enqueued workflow) and polling_interval_sec 1.0; sync no-op workflow; "
          "each process its own executor_id, one application_version",
          {"config": "defaults", "worker_concurrency": None, "polling": 1.0}),
    Setup(DBOS, " (worker concurrency 100, polling 0.01 s)",
          ("--worker-concurrency", "100", "--polling", "0.01"),
          "the best configuration found from DBOS's queue docs (worker_concurrency, "
          "polling_interval_sec): worker_concurrency 100, polling_interval_sec 0.01, "
          "otherwise as the defaults",
          {"config": "best", "worker_concurrency": 100, "polling": 0.01}),
)


# -- Virtualenvs ------------------------------------------------------------------------

_pythons: dict[str, str] = {}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "belay-bench")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _imports(python: Path, name: str) -> bool:
    if not python.exists():
        return False
    return subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0


def _version(python: str) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [python, "-c", "import sys, venv; print(*sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2:
        return None
    return int(words[0]), int(words[1])


def base_python(minimum: tuple[int, int] | None) -> tuple[str, tuple[int, int]]:
    """An interpreter of at least ``minimum`` to make a virtualenv with: the
    bench's own when new enough, else the oldest such one on ``PATH``
    (``python3.N``) or among pyenv's versions."""
    own = (sys.version_info.major, sys.version_info.minor)
    if minimum is None or own >= minimum:
        return sys.executable, own
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    for minor in range(minimum[1], 20):
        name = f"python{minimum[0]}.{minor}"
        found = [shutil.which(name), *sorted(glob.glob(str(pyenv / f"*/bin/{name}")))]
        for candidate in filter(None, found):
            version = _version(candidate)
            if version is not None and version >= minimum:
                return candidate, version
    raise PeerUnavailable(f"no Python {minimum[0]}.{minimum[1]} or newer on this machine "
                          "(PATH, pyenv)")


def peer_python(name: str, requirement: str, *extras: str,
                log: Callable[[str], None] = _stderr,
                min_python: tuple[int, int] | None = None) -> str:
    """The python of a virtualenv holding ``requirement`` (and ``extras``), made
    once under the cache directory (from an interpreter of at least
    ``min_python``) and reused while it still imports ``name``."""
    if requirement in _pythons:
        return _pythons[requirement]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", requirement)
    own = (sys.version_info.major, sys.version_info.minor)

    def home_of(version: tuple[int, int]) -> Path:
        return cache_dir() / f"{slug}-py{version[0]}.{version[1]}"

    if min_python is None or own >= min_python:
        homes = [home_of(own)]
    else:  # any virtualenv of this release made before from a new enough Python
        homes = [home_of((own[0], minor)) for minor in range(min_python[1], 20)]
    home = next((home for home in homes if _imports(home / "bin" / "python", name)), None)
    if home is not None:
        python = home / "bin" / "python"
        log(f"peer {requirement}: reusing {home}")
    else:
        base, version = base_python(min_python)
        home = home_of(version)
        python = home / "bin" / "python"
        log(f"peer {requirement}: creating {home} from {base} and installing it from PyPI")
        started = time.monotonic()
        steps = {
            "venv": [base, "-m", "venv", "--clear", str(home)],
            "pip install": [str(python), "-m", "pip", "install", "--quiet",
                            "--disable-pip-version-check", requirement, *extras],
        }
        for step, command in steps.items():
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=INSTALL_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PeerUnavailable(f"{step} {requirement}: {exc}") from exc
            if done.returncode != 0:
                said = [line for line in (done.stderr + done.stdout).splitlines()
                        if line.strip() and not line.startswith("WARNING")]
                raise PeerUnavailable(f"{step} {requirement} exited with {done.returncode}: "
                                      + " | ".join(said[-2:]))
        if not _imports(python, name):
            raise PeerUnavailable(f"{requirement} installed but `import {name}` fails")
        log(f"peer {requirement}: installed in {time.monotonic() - started:.1f}s")
    _pythons[requirement] = str(python)
    return str(python)


# -- Drains -----------------------------------------------------------------------------


def _prepare(peer: Peer, python: str, url: str, count: int) -> None:
    proc = core.Proc(peer.module, "prepare", "--url", url, "--count", str(count),
                     python=python)
    try:
        code = proc.popen.wait(PREPARE_TIMEOUT)
    finally:
        proc.stop()
    if code != 0:
        raise RuntimeError(f"{peer.module} prepare exited with {code}")


def _value(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _drain(bench: Bench, setup: Setup, python: str, procs: int, count: int) -> float:
    """Jobs/s of one drain of ``count`` jobs by ``procs`` worker processes."""
    peer = setup.peer
    with bench.database(peer.system, belay_schema=False) as url:
        _prepare(peer, python, url, count)
        with psycopg.connect(url, autocommit=True) as conn, core.processes(
            procs, peer.module, "work", "--url", url, *setup.args, python=python,
        ) as workers:
            for worker in workers:
                worker.popen.send_signal(signal.SIGUSR1)
            core.wait_for(conn, peer.drained, timeout=60 + count / 50, interval=POLL_INTERVAL)
            # Stop them together rather than one after another.
            for worker in workers:
                worker.popen.send_signal(signal.SIGTERM)
            succeeded = _value(conn, peer.succeeded)
            elapsed = _value(conn, peer.elapsed)
    if succeeded != count:
        raise RuntimeError(f"{succeeded} of {count} jobs succeeded")
    return count / float(elapsed)


def _name(setup: Setup, procs: int) -> str:
    return f"{setup.peer.title}{setup.label}, {procs} process{'es' if procs > 1 else ''}"


def _figure(setup: Setup, procs: int, value: float, note: str, **extra: Any) -> Figure:
    return Figure(SECTION, _name(setup, procs), value, "jobs/s", note=note,
                  extra={"system": setup.peer.system, "procs": procs, **setup.extra, **extra})


def _measure(bench: Bench, setup: Setup, python: str, procs: int) -> Figure:
    count, repeats = bench.size(2_000, 20_000), bench.size(1, 3)
    rates = []
    try:
        for _ in range(repeats):
            rates.append(_drain(bench, setup, python, procs, count))
    except (RuntimeError, TimeoutError, subprocess.SubprocessError, psycopg.Error) as exc:
        bench.log(f"!!! {_name(setup, procs)} failed, reported as NaN: {exc}")
        return _figure(setup, procs, math.nan, f"not measured: {exc}")
    value = core.median(rates)
    bench.log(f"{_name(setup, procs)}: {value:,.0f} jobs/s "
              f"(runs: {', '.join(f'{rate:,.0f}' for rate in rates)})")
    return _figure(
        setup, procs, value,
        f"{setup.note}; median of {repeats} drain(s) of {count:,} no-op jobs, timed by "
        "the database from the first job taken to the last success",
        jobs=count, runs=[round(rate, 1) for rate in rates],
    )


def run(bench: Bench) -> list[Figure]:
    figures: list[Figure] = []
    unavailable: dict[str, str] = {}
    for setup in SETUPS:
        peer = setup.peer
        python = None
        if peer.system not in unavailable:
            try:
                python = peer_python(peer.system, peer.requirement, *peer.extras, log=bench.log,
                                     min_python=peer.min_python)
            except PeerUnavailable as exc:
                unavailable[peer.system] = str(exc)
                bench.log(f"!!! {peer.title} could not be installed; its figures are NaN: {exc}")
        for procs in PROCESS_COUNTS:
            if python is None:
                figures.append(_figure(setup, procs, math.nan,
                                       f"not measured: {unavailable[peer.system]}"))
            else:
                figures.append(_measure(bench, setup, python, procs))
    return figures
