"""The soak driver: its own PostgreSQL, worker processes, chaos, workload waves,
quiescence, the checker and the report.

With ``--pooler`` every worker process reaches PostgreSQL through a real
PgBouncer in transaction-pooling mode (the proxied one through the proxy, in
front of the PgBouncer), with ``pooler="transaction"``; every other worker has
a ``direct_url`` for LISTEN, the rest poll; the chaos adds PgBouncer restarts.
The driver and the checker stay on direct connections."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb
from psycopg_pool import PoolTimeout

import belay
from belay.connect import DIRECT_URL_ENV, POOLER_ENV, TRANSACTION
from belay.pgbouncer import PgBouncer, find_binary
from soak import check as checker
from soak import kinds
from soak.pg import Server
from soak.proxy import Proxy
from soak.report import render
from soak.worker import LEASE_TTL, QUEUES

log = logging.getLogger("soak")
T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent

SOAK_TABLES = """
CREATE TABLE IF NOT EXISTS soak_effects (
    id bigserial PRIMARY KEY, job_id bigint NOT NULL, step text NOT NULL,
    attempt int NOT NULL, tag text NOT NULL, at timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS soak_acks (
    id bigserial PRIMARY KEY, job_id bigint NOT NULL, attempt int NOT NULL,
    outcome text NOT NULL, tag text NOT NULL, at timestamptz NOT NULL, rid text UNIQUE);
CREATE TABLE IF NOT EXISTS soak_ledger (
    job_id bigint PRIMARY KEY, kind text NOT NULL, expected jsonb NOT NULL);
CREATE TABLE IF NOT EXISTS soak_bursts (
    id bigserial PRIMARY KEY, key text NOT NULL, mode text NOT NULL, ids jsonb NOT NULL,
    fresh int NOT NULL, retried boolean NOT NULL);
CREATE TABLE IF NOT EXISTS soak_chaos (what text PRIMARY KEY, n int NOT NULL);
CREATE TABLE IF NOT EXISTS soak_cancels (
    job_id bigint PRIMARY KEY, status text NOT NULL, attempt int NOT NULL,
    at timestamptz NOT NULL);
"""


@dataclass
class Options:
    duration: float = 180.0
    workers: int = 3
    db_restart_every: float | None = None
    kill_every: float = 4.0
    cut_every: float = 30.0
    wave_every: float = 1.5
    quiesce_timeout: float = 300.0
    report: Path | None = None
    seed: int | None = None
    logs: Path | None = None
    #: Workers behind a transaction-pooling PgBouncer, restarted about this often.
    pooler: bool = False
    pooler_restart_every: float = 45.0
    #: Chaos the run must have delivered (CI's floor), else it fails.
    min_chaos: dict[str, int] = field(default_factory=dict)


@dataclass
class Chaos:
    kills: int = 0
    db_restarts: int = 0
    proxy_cuts: int = 0
    pooler_restarts: int = 0
    unexpected_exits: int = 0
    events: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S")
        self.events.append(f"{stamp} {what}")
        log.info("chaos: %s", what)


class WorkerProc:
    def __init__(self, tag: str, url: str, logs: Path, *, cron: bool = True,
                 pooler: str | None = None, direct_url: str | None = None) -> None:
        self.tag, self.url, self.logs, self.cron = tag, url, logs, cron
        self.pooler, self.direct_url = pooler, direct_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False
        #: Serializes the killer's kill-and-restart with the supervisor's restarts,
        #: so a process is never started twice (leaking the first).
        self.lock = threading.RLock()

    def restart(self) -> None:
        with self.lock:
            self.kill9()
            self.start()

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "soak.worker", self.url, self.tag]
        if not self.cron:
            args.append("--no-cron")
        if self.pooler:
            args += ["--pooler", self.pooler]
            if self.direct_url:
                args += ["--direct-url", self.direct_url]
        return args

    def start(self) -> None:
        args = self.command()
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get(
            "PYTHONPATH", ""))
        # The pooler mode comes from the command line only, never the caller's shell.
        for name in (POOLER_ENV, DIRECT_URL_ENV):
            env.pop(name, None)
        out = open(self.logs / f"{self.tag}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=out)
        out.close()
        self.killed = False

    def kill9(self) -> None:
        with self.lock:
            self._kill9()

    def _kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.killed = True
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def terminate(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.killed = True
                self.proc.terminate()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()


class Driver:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.chaos = Chaos()
        self.server = Server()
        self.proxy: Proxy | None = None
        self.bouncer: PgBouncer | None = None
        self.workers: list[WorkerProc] = []
        self.client: belay.Belay | None = None
        self.conn: psycopg.Connection[Any] | None = None
        self.stop_chaos = threading.Event()
        self.db_lock = threading.Lock()  # held while the database is being crashed
        self.supervise = threading.Event()
        self.ledgered: Counter[str] = Counter()
        self.pending_signals: list[tuple[float, int, int]] = []
        self.signalled: set[int] = set()
        self.awaiters: dict[int, int] = {}
        #: Cancels the driver will ask for, as (when, job id), while the job retries.
        self.pending_cancels: list[tuple[float, int]] = []
        self.bursts = 0
        self.waves = 0
        self.logs = opts.logs or (self.server.root / "logs")

    # -- Plumbing ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.server.url

    def db(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        return self.conn

    def retry(self, fn: Callable[[], T], what: str, tries: int = 120) -> tuple[T, bool]:
        """Run ``fn`` through database outages; returns (value, whether it was retried)."""
        for attempt in range(tries):
            try:
                return fn(), attempt > 0
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
                if attempt == tries - 1:
                    raise
                log.debug("%s failed (%s); retrying", what, exc)
                self.conn = None
                time.sleep(0.5)
        raise AssertionError("unreachable")

    # -- Setup -------------------------------------------------------------------------

    def setup(self) -> None:
        self.server.init()
        self.server.start()
        self.logs.mkdir(parents=True, exist_ok=True)
        belay.migrate(self.url)
        self.db().execute(SOAK_TABLES)
        self.client = belay.Belay(self.url, registry=kinds.REGISTRY, max_pool_size=8,
                                  application_name="soak-driver")
        upstream = self.server.port
        if self.opts.pooler:
            self.bouncer = PgBouncer(self.url, pool_size=40).start()
            upstream = self.bouncer.port
        self.proxy = Proxy(upstream).start()
        for n in range(1, self.opts.workers + 1):
            # The first worker talks to PostgreSQL (or the PgBouncer) through the
            # proxy the driver cuts.
            worker = self.worker(f"w{n}" + ("p" if n == 1 else ""),
                                 proxied=n == 1, listen=n % 2 == 0)
            worker.start()
            self.workers.append(worker)

    def worker(self, tag: str, *, proxied: bool = False, listen: bool = False,
               cron: bool = True) -> WorkerProc:
        """A worker process's route: direct, or through the PgBouncer with
        ``pooler="transaction"`` — LISTENing on a direct URL when ``listen``
        (never for the proxied one: a cut must cut it off entirely), else polling."""
        url = self.url if self.bouncer is None else self.bouncer.url
        if proxied:
            assert self.proxy is not None
            url = make_conninfo(url, host="127.0.0.1", port=str(self.proxy.port))
        if self.bouncer is None:
            return WorkerProc(tag, url, self.logs, cron=cron)
        return WorkerProc(tag, url, self.logs, cron=cron, pooler=TRANSACTION,
                          direct_url=self.url if listen and not proxied else None)

    def teardown(self) -> None:
        self.stop_chaos.set()
        self.supervise.set()
        for worker in self.workers:
            with worker.lock:
                worker.kill9()
                worker.proc = None
        if self.proxy is not None:
            self.proxy.close()
        if self.bouncer is not None:
            with contextlib.suppress(Exception):
                self.bouncer.stop()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.server.cleanup()

    # -- Chaos -------------------------------------------------------------------------

    def _supervisor(self) -> None:
        while not self.supervise.wait(0.3):
            for worker in list(self.workers):
                with worker.lock:
                    if worker.proc is None or worker.proc.poll() is None:
                        continue
                    if not worker.killed:
                        self.chaos.unexpected_exits += 1
                        self.chaos.note(f"worker {worker.tag} exited by itself "
                                        f"(status {worker.proc.returncode}); restarting")
                    worker.start()

    def _killer(self) -> None:
        while not self.stop_chaos.wait(self.rng.uniform(0.5, 1.5) * self.opts.kill_every):
            victim = self.rng.choice(self.workers)
            victim.restart()
            self.chaos.kills += 1

    def _db_restarter(self, start: float) -> None:
        every = self.opts.db_restart_every
        marks = ([start + every * k for k in range(1, int(self.opts.duration / every) + 1)]
                 if every else [start + self.opts.duration / 3, start + 2 * self.opts.duration / 3])
        for mark in marks:
            if mark >= start + self.opts.duration:
                break
            if self.stop_chaos.wait(max(0.0, mark - time.monotonic())):
                return
            with self.db_lock:
                self.server.crash_restart(down=self.rng.uniform(0.5, 2.0))
            self.chaos.db_restarts += 1
            self.chaos.note("PostgreSQL crash-restarted (immediate stop)")

    def _cutter(self) -> None:
        assert self.proxy is not None
        first = self.rng.uniform(5.0, min(20.0, self.opts.cut_every))
        wait = first
        while not self.stop_chaos.wait(wait):
            self.proxy.cut()
            self.chaos.proxy_cuts += 1
            self.chaos.note("proxy cut (worker w1p cut off from PostgreSQL)")
            self.stop_chaos.wait(LEASE_TTL + self.rng.uniform(1.5, 3.0))
            self.proxy.heal()
            wait = self.rng.uniform(0.7, 1.3) * self.opts.cut_every

    def _pooler_restarter(self) -> None:
        """SIGKILL the PgBouncer (every client and server connection drops, as a
        crash or a deploy does), keep it down 0.2 to 1.5 s, start it again on
        the same port."""
        assert self.bouncer is not None
        every = self.opts.pooler_restart_every
        while not self.stop_chaos.wait(self.rng.uniform(0.7, 1.3) * every):
            self.bouncer.kill()
            self.chaos.pooler_restarts += 1
            self.chaos.note("PgBouncer killed (SIGKILL: every pooled connection dropped)")
            time.sleep(self.rng.uniform(0.2, 1.5))
            self.start_bouncer()

    def start_bouncer(self) -> None:
        """Start the PgBouncer again (same port), however long that takes."""
        assert self.bouncer is not None
        for attempt in itertools.count(1):
            try:
                self.bouncer.start()
                return
            except belay.ConfigurationError as exc:
                log.warning("PgBouncer did not start (try %d): %s", attempt, exc)
                time.sleep(1.0)

    # -- Workload ----------------------------------------------------------------------

    def _enqueue(self, kind: str, fn: Callable[[psycopg.Connection[Any]], list[tuple[int, Any]]]
                 ) -> list[int]:
        """Enqueue in one transaction with the ledger rows, so a retry never doubles."""
        def attempt() -> list[int]:
            conn = self.db()
            with conn.transaction():
                rows = fn(conn)
                for job_id, expected in rows:
                    conn.execute("INSERT INTO soak_ledger (job_id, kind, expected) "
                                 "VALUES (%s, %s, %s)", (job_id, kind, Jsonb(expected)))
            return [job_id for job_id, _ in rows]

        ids, _ = self.retry(attempt, f"enqueue {kind}")
        self.ledgered[kind] += len(ids)
        return ids

    def wave(self) -> None:
        assert self.client is not None
        client, wave, rng = self.client, self.waves, self.rng
        self.waves += 1
        for j in range(4):
            k, f = 2 + (wave + j) % 5, rng.choice((0, 0, 1, 2))
            # Now and then a long run: a zombie in the making behind the proxy.
            nap = LEASE_TTL + 3.0 if j == 0 and wave % 2 == 0 else 0.0

            def steps(c: psycopg.Connection[Any], k: int = k, f: int = f, nap: float = nap
                      ) -> list[tuple[int, Any]]:
                job = client.enqueue(kinds.step_kind, {"n": wave, "k": k, "f": f, "nap": nap},
                                     conn=c)
                return [(job.id, {"value": wave * k + k * (k + 1) // 2})]

            self._enqueue("step", steps)
        vs = [wave, wave + 1, wave + 2]
        self._enqueue("parent", lambda c: [
            (client.enqueue(kinds.parent_kind, {"vs": vs}, conn=c).id,
             {"value": sorted(v * 2 for v in vs)})])
        if wave % 2 == 0:
            doomed = wave % 8 == 0
            def flow(c: psycopg.Connection[Any]) -> list[tuple[int, Any]]:
                wf = belay.Workflow("soak")
                wf.add("a", kinds.flow_kind, {"fail": True} if doomed else {},
                       max_attempts=1 if doomed else None)
                wf.add("b", kinds.flow_kind, deps=["a"])
                wf.add("c", kinds.flow_kind, deps=["b"])
                jobs = client.enqueue_workflow(wf, conn=c)
                return [(job.id, {"wf": wf.workflow_id, "pos": name, "doomed": doomed})
                        for name, job in jobs.items()]
            self._enqueue("flow", flow)
        if wave % 3 == 0:
            self._enqueue("budget", lambda c: [
                (client.enqueue(kinds.budget_kind, {}, budget={"usd": kinds.BUDGET_USD},
                                conn=c).id, {})])
        if wave % 3 == 1:
            self.burst(f"uni:{wave}", "incomplete" if wave % 2 else "window")
        if wave % 3 == 2:
            self._enqueue("parallel", lambda c: [
                (client.enqueue(kinds.parallel_kind, {}, budget={"usd": kinds.BUDGET_USD},
                                conn=c).id, {})])
        if wave % 2 == 1:
            self._enqueue("spawner", lambda c: [
                (client.enqueue(kinds.spawner_kind, {}, authority=kinds.SPAWNER_AUTHORITY,
                                conn=c).id, {})])
        cancel = rng.random() < 0.6
        [cancellable] = self._enqueue("cancellable", lambda c: [
            (client.enqueue(kinds.cancellable_kind, {}, conn=c).id, {"cancel": cancel})])
        if cancel:  # while its attempts run and fail, or between them
            self.pending_cancels.append((time.monotonic() + rng.uniform(0.3, 4.0), cancellable))
        self.due_cancels()
        for _ in range(2):
            [job_id] = self._enqueue("awaiter", lambda c: [
                (client.enqueue(kinds.awaiter_kind, {}, conn=c).id, {})])
            self.awaiters[job_id] = wave
            roll = rng.random()
            if roll < 0.25:
                self.signal(job_id)  # before the job even ran: before its await
            else:
                delay = rng.uniform(0.0, 1.0) if roll < 0.5 else rng.uniform(1.0, 8.0)
                self.pending_signals.append((time.monotonic() + delay, job_id, wave))
        self.due_signals()

    def signal(self, job_id: int) -> None:
        assert self.client is not None
        client = self.client
        self.retry(lambda: client.signal_job(job_id, "go", {"w": self.awaiters[job_id]}),
                   "signal")
        self.signalled.add(job_id)

    def due_signals(self, everything: bool = False) -> None:
        now = time.monotonic()
        due = [p for p in self.pending_signals if everything or p[0] <= now]
        self.pending_signals = [p for p in self.pending_signals if p not in due]
        for _, job_id, _ in due:
            self.signal(job_id)

    def due_cancels(self, everything: bool = False) -> None:
        """Ask for the cancels that are due, recording what ``cancel_job``
        answered and the attempt the job was at right after: none after it
        may start (issue 38)."""
        assert self.client is not None
        client = self.client
        now = time.monotonic()
        due = [p for p in self.pending_cancels if everything or p[0] <= now]
        self.pending_cancels = [p for p in self.pending_cancels if p not in due]
        for _, job_id in due:
            def cancel(job_id: int = job_id) -> None:
                status = client.cancel_job(job_id)
                conn = self.db()
                conn.execute(
                    "INSERT INTO soak_cancels (job_id, status, attempt, at) SELECT id, %s, "
                    "attempt, now() FROM belay_jobs WHERE id = %s ON CONFLICT (job_id) DO "
                    "UPDATE SET status = excluded.status, attempt = excluded.attempt, "
                    "at = excluded.at", (str(status), job_id))

            self.retry(cancel, "cancel")

    def burst(self, key: str, mode: str) -> None:
        """Four concurrent inserts of one unique key: one job, three duplicates."""
        assert self.client is not None
        client = self.client
        unique = belay.Unique(key, mode="window", window=3600) if mode == "window" \
            else belay.Unique(key)
        gate = threading.Barrier(4)
        got: list[tuple[int, bool, bool]] = []
        lock = threading.Lock()

        def one() -> None:
            def insert() -> belay.Job:
                with contextlib.suppress(threading.BrokenBarrierError):
                    gate.wait(2.0)
                return client.enqueue(kinds.unique_kind, {}, unique=unique)
            job, retried = self.retry(insert, "unique burst")
            with lock:
                got.append((job.id, job.duplicate, retried))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ids = [job_id for job_id, _, _ in got]
        fresh = sum(1 for _, dup, _ in got if not dup)
        retried = any(r for _, _, r in got)
        self.retry(lambda: self.db().execute(
            "INSERT INTO soak_bursts (key, mode, ids, fresh, retried) VALUES (%s, %s, %s, %s, %s)",
            (key, mode, Jsonb(ids), fresh, retried)), "burst ledger")
        self.bursts += 1
        self.ledgered["unique"] += len(set(ids))

    # -- The run -----------------------------------------------------------------------

    def run(self) -> int:
        opts = self.opts
        started = time.monotonic()
        t0 = datetime.now(timezone.utc)
        self.setup()
        log.info("soak: PostgreSQL on port %d%s, %d workers, %.0fs of chaos", self.server.port,
                 "" if self.bouncer is None else f", PgBouncer on port {self.bouncer.port}",
                 opts.workers, opts.duration)
        threads = [threading.Thread(target=self._supervisor, daemon=True),
                   threading.Thread(target=self._killer, daemon=True),
                   threading.Thread(target=self._db_restarter, args=(time.monotonic(),),
                                    daemon=True),
                   threading.Thread(target=self._cutter, daemon=True)]
        if self.bouncer is not None:
            threads.append(threading.Thread(target=self._pooler_restarter, daemon=True))
        for thread in threads:
            thread.start()
        end = time.monotonic() + opts.duration
        next_report = time.monotonic() + 30
        while time.monotonic() < end:
            tick = time.monotonic()
            self.wave()
            if time.monotonic() >= next_report:
                next_report += 30
                log.info("soak: %d waves, %d kills, %d restarts, %d cuts, %d pooler restarts, "
                         "%.0fs left", self.waves, self.chaos.kills, self.chaos.db_restarts,
                         self.chaos.proxy_cuts, self.chaos.pooler_restarts,
                         end - time.monotonic())
            time.sleep(max(0.0, opts.wave_every - (time.monotonic() - tick)))
        # Quiesce: no more chaos; every awaiter gets its signal; fresh workers
        # without crons finish what is left.
        self.stop_chaos.set()
        for thread in threads[1:]:
            thread.join()
        assert self.proxy is not None
        self.proxy.heal()
        if self.bouncer is not None and not self.bouncer.running:
            self.start_bouncer()
        self.due_signals(everything=True)
        self.due_cancels(everything=True)
        self.supervise.set()
        threads[0].join()
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            worker.wait(10)
        # Behind the PgBouncer too (if any), one LISTENing, one polling.
        finishers = [self.worker(f"f{n}", listen=n == 1, cron=False) for n in (1, 2)]
        for worker in finishers:
            worker.start()
        chaos_end = time.monotonic()
        quiesced = self.wait_quiescent(opts.quiesce_timeout)
        quiesce_s = time.monotonic() - chaos_end
        for worker in finishers:
            worker.terminate()
        for worker in finishers:
            worker.wait(10)
        self.workers += finishers
        counts = {"kills": self.chaos.kills, "db_restarts": self.chaos.db_restarts,
                  "proxy_cuts": self.chaos.proxy_cuts,
                  "pooler_restarts": self.chaos.pooler_restarts, "workers": opts.workers,
                  "slots_per_worker": sum(QUEUES.values()),
                  "unexpected_exits": self.chaos.unexpected_exits}
        conn = self.db()
        with conn.transaction():
            for what, n in counts.items():
                conn.execute("INSERT INTO soak_chaos (what, n) VALUES (%s, %s) ON CONFLICT "
                             "(what) DO UPDATE SET n = excluded.n", (what, n))
        snap = checker.load(conn)
        results = checker.check(snap)
        survival = checker.Invariant("workers-survive", "§10",
                                     "no worker process died of the chaos by itself")
        if self.chaos.unexpected_exits:
            survival.fail("workers", f"{self.chaos.unexpected_exits} unexpected worker exits "
                                     "(see the chaos log)")
        results.append(survival)
        if opts.min_chaos:
            floor = checker.Invariant(
                "chaos-delivered", "—", "at least " + ", ".join(
                    f"{n} {what.replace('_', ' ')}" for what, n in opts.min_chaos.items()))
            for what, n in opts.min_chaos.items():
                if counts[what] < n:
                    floor.fail(what, f"only {counts[what]} {what.replace('_', ' ')}, wanted {n}")
            results.append(floor)
        text = render(
            snap, results, opts=opts, started=t0, elapsed=time.monotonic() - started,
            waves=self.waves, bursts=self.bursts, quiesced=quiesced, quiesce_s=quiesce_s,
            events=self.chaos.events, seed=opts.seed,
        )
        if opts.report is not None:
            opts.report.write_text(text)
            log.info("soak: report written to %s", opts.report)
        print(text)
        return 0 if all(r.ok for r in results) else 1

    def wait_quiescent(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        last = -1
        while time.monotonic() < deadline:
            def count() -> int:
                found = self.db().execute(
                    "SELECT count(*) FROM belay_jobs WHERE state NOT IN "
                    "('succeeded', 'failed', 'cancelled')").fetchone()
                return int(found[0]) if found else 0

            left, _ = self.retry(count, "quiescence")
            if left == 0:
                return True
            if left != last:
                log.info("soak: %d jobs not terminal yet", left)
                last = left
            time.sleep(1.0)
        return False


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m soak",
        description="Chaos soak: worker processes killed with -9, PostgreSQL crash-restarted, "
                    "one worker's connections cut (with --pooler: every worker behind a "
                    "PgBouncer in transaction mode, restarted too); then every contract §11 "
                    "invariant is checked from the database.")
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds of workload under chaos (default 180)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--db-restart-every", type=float, default=None, metavar="SECONDS",
                        help="crash-restart PostgreSQL this often (default: at 1/3 and 2/3)")
    parser.add_argument("--kill-every", type=float, default=4.0, metavar="SECONDS",
                        help="kill -9 a random worker about this often (default 4)")
    parser.add_argument("--cut-every", type=float, default=30.0, metavar="SECONDS",
                        help="cut the proxied worker off about this often (default 30)")
    parser.add_argument("--quiesce-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--report", type=Path, default=None, help="write the report here")
    parser.add_argument("--logs", type=Path, default=None, help="worker logs directory")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-kills", type=int, default=0, metavar="N",
                        help="fail unless at least N kills happened (CI's floor)")
    parser.add_argument("--min-db-restarts", type=int, default=0, metavar="N")
    parser.add_argument("--min-cuts", type=int, default=0, metavar="N")
    parser.add_argument("--pooler", action="store_true",
                        help="workers reach PostgreSQL through a real PgBouncer in "
                             "transaction-pooling mode (pooler=\"transaction\"), which the "
                             "chaos restarts")
    parser.add_argument("--pooler-restart-every", type=float, default=None, metavar="SECONDS",
                        help="with --pooler: SIGKILL and restart the PgBouncer about this "
                             "often (default 45)")
    parser.add_argument("--min-pooler-restarts", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one sits behind the proxy)")
    if not args.pooler and (args.pooler_restart_every is not None or args.min_pooler_restarts):
        parser.error("--pooler-restart-every and --min-pooler-restarts need --pooler")
    if args.pooler and find_binary() is None:
        parser.error("--pooler needs PgBouncer's pgbouncer executable "
                     "(Debian/Ubuntu: apt install pgbouncer)")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    return Options(duration=args.duration, workers=args.workers,
                   db_restart_every=args.db_restart_every, kill_every=args.kill_every,
                   cut_every=args.cut_every, quiesce_timeout=args.quiesce_timeout,
                   report=args.report, seed=seed, logs=args.logs, pooler=args.pooler,
                   pooler_restart_every=(45.0 if args.pooler_restart_every is None
                                         else args.pooler_restart_every),
                   min_chaos={what: n for what, n in (
                       ("kills", args.min_kills), ("db_restarts", args.min_db_restarts),
                       ("proxy_cuts", args.min_cuts),
                       ("pooler_restarts", args.min_pooler_restarts)) if n})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    opts = parse(argv)
    # SIGTERM (and SIGINT, even when a background shell ignores it) tears down:
    # workers killed, the private PostgreSQL stopped and removed.
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    driver = Driver(opts)
    try:
        return driver.run()
    finally:
        driver.teardown()
