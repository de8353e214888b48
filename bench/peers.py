"""Peer libraries drained on the same server as belay: PgQueuer and
Procrastinate at pinned versions, each in a virtualenv of its own, so neither
shares belay's environment nor pins anything in it.

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

import math
import os
import re
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


def peer_python(name: str, requirement: str, *extras: str,
                log: Callable[[str], None] = _stderr) -> str:
    """The python of a virtualenv holding ``requirement`` (and ``extras``), made
    once under the cache directory and reused while it still imports ``name``."""
    if requirement in _pythons:
        return _pythons[requirement]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", requirement)
    home = cache_dir() / f"{slug}-py{sys.version_info.major}.{sys.version_info.minor}"
    python = home / "bin" / "python"
    if _imports(python, name):
        log(f"peer {requirement}: reusing {home}")
    else:
        log(f"peer {requirement}: creating {home} and installing it from PyPI")
        started = time.monotonic()
        steps = {
            "venv": [sys.executable, "-m", "venv", "--clear", str(home)],
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
                python = peer_python(peer.system, peer.requirement, *peer.extras, log=bench.log)
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
