"""Hosts: throughput and the database's cost per job for 1, 2, 4 and 8 worker
processes, each straight to PostgreSQL, behind a transaction-pooling PgBouncer,
and behind one that tracks prepared statements (1.21 or later: the machine's
or ``BELAY_PGBOUNCER``). ``python -m bench.hosts [--quick] [--url URL] [--out
FILE]``; in the suite, :func:`run`.

Each process is the command a user would write, ``belay worker --queue
default=10`` with every other option at its default (behind the pooler, plus
``--pooler transaction``, or ``--pooler transaction-prepared`` with
``max_prepared_statements = 200``; PgBouncer with its own default
``default_pool_size = 20``), importing this module for the no-op kind below, its log (INFO: one line
per job) going to a file. The processes start first and idle; then N no-op
jobs are inserted in one statement (the rows ``enqueue_many`` writes), so every
process sees the whole backlog at the same moment, within one idle poll (0.5 s).

- jobs/s: the jobs finished between the 10th and the 90th percentile of
  ``finished_at``, over that span, read from the database — the steady rate,
  without the half second it takes the last idle process to notice the backlog
  or the tail where processes run out of work; ``extra.span_rate`` is N over
  first ``started_at`` to last ``finished_at``, as ``throughput`` times it.
- transactions per job: ``xact_commit + xact_rollback`` of the bench database
  (``pg_stat_database``) from just before the insert to after every worker
  (and PgBouncer, whose server connections would otherwise keep their counts
  unflushed) has exited, divided by N. It includes the idle polls, heartbeats,
  queue syncs and cron ticks of the processes meanwhile and autovacuum's
  transactions; the bench's own statements (the insert, its polls, the
  readings) are subtracted.
- statements per job: ``pg_stat_statements`` calls in that database over the
  same window (BEGIN and COMMIT count; needs the module in
  ``shared_preload_libraries`` — ``python -m bench.hosts`` starts its server so
  — else "n/a").
- CPU per job: user + system seconds over the drain (the insert to the last
  ack seen) of the worker processes, of PgBouncer, and of the whole server (the
  postmaster, its live children and the backends it reaped), from ``/proc`` —
  when the server runs on this machine.
- tuples per job: ``n_tup_ins + n_tup_upd + n_tup_del`` of ``belay_jobs``
  (``pg_stat_user_tables``) over the window, the insert's N rows taken out:
  what the workers wrote per job.

On a machine with few cores the processes, PgBouncer and PostgreSQL share
them, so more processes can't scale linearly; the cost per job is what this
table is for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

import belay
from belay.pgbouncer import BINARY_ENV, PREPARED_SINCE, PgBouncer, find_binary
from bench.core import ROOT, Bench, Figure, arguments
from bench.report import machine_table, publish
from bench.scale import FILL

SECTION = "hosts"
PROCS = (1, 2, 4, 8)
#: Straight to PostgreSQL; behind PgBouncer (``--pooler transaction``); and
#: behind a PgBouncer >= 1.21 tracking prepared statements
#: (``max_prepared_statements = 200``, ``--pooler transaction-prepared``).
MODES = ("direct", "pooled", "prepared")
#: Each mode's belay pooler setting.
POOLER = {"direct": None, "pooled": "transaction", "prepared": "transaction-prepared"}
KIND = "bench.hosts.noop"
#: PgBouncer's own default_pool_size: what a pgbouncer.ini that doesn't set it gets.
POOL_SIZE = 20
#: The insert is the rows enqueue_many writes, with this module's kind.
_FILL = FILL.replace("'noop'", f"'{KIND}'")
_LEFT = "SELECT count(*) FROM belay_jobs WHERE state <> 'succeeded'"
_COUNTERS = """
SELECT (SELECT xact_commit + xact_rollback FROM pg_stat_database
        WHERE datname = current_database()),
       (SELECT COALESCE(n_tup_ins + n_tup_upd + n_tup_del, 0) FROM pg_stat_user_tables
        WHERE relname = 'belay_jobs')
"""
_STATEMENTS = """
SELECT COALESCE(sum(calls), 0), (SELECT dealloc FROM pg_stat_statements_info)
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


@belay.worker(name=KIND, queue="default")
def noop(ctx: belay.Context) -> None:
    """The no-op job the worker processes run (``--import bench.hosts``)."""
    return None


@dataclass
class Drain:
    """One drain of ``jobs`` by ``procs`` processes: rates and the database's counts."""

    procs: int
    mode: str
    jobs: int
    rate: float
    span_rate: float
    xacts: int
    statements: int | None
    tuples: int
    #: CPU seconds over the drain (insert to last ack): the worker processes,
    #: PgBouncer (pooled only), PostgreSQL; None where they can't be read.
    cpu_workers: float | None = None
    cpu_pooler: float | None = None
    cpu_server: float | None = None


# -- Statistics the server keeps --------------------------------------------------------


def statements_available(conn: psycopg.Connection[Any]) -> str | None:
    """None when pg_stat_statements counts this server's statements; else why not.
    Creates the extension in the connection's database if need be."""
    if conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'pg_stat_statements'"
                    ).fetchone() is None:
        return "pg_stat_statements is not installed on the server"
    preload = str(conn.execute("SHOW shared_preload_libraries").fetchone()[0])  # type: ignore[index]
    if "pg_stat_statements" not in preload:
        return ("pg_stat_statements is not in the server's shared_preload_libraries "
                "(python -m bench.hosts, without --url, starts a server that loads it)")
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    except psycopg.Error as exc:
        return f"CREATE EXTENSION pg_stat_statements failed: {exc}".strip()
    return None


def _read(conn: psycopg.Connection[Any], statements: bool) -> tuple[int, int | None, int | None,
                                                                     int]:
    """(transactions, statements, statements' dealloc, tuples) as the server counts them."""
    row = conn.execute(_COUNTERS).fetchone()
    assert row is not None
    calls = dealloc = None
    if statements:
        counted = conn.execute(_STATEMENTS).fetchone()
        assert counted is not None
        calls, dealloc = int(counted[0]), int(counted[1])
    return int(row[0]), calls, dealloc, int(row[1] or 0)


def _settled(bench: Bench, dbname: str, timeout: float = 30.0) -> None:
    """Wait until no backend is connected to ``dbname``: every process that ran
    there has exited, and a backend flushes its counts as it exits."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(bench.url, autocommit=True) as admin:
        while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                            (dbname,)).fetchone()[0]:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise TimeoutError(f"backends of {dbname} still there after {timeout}s")
            time.sleep(0.05)


# -- CPU, from /proc (Linux, a server on this machine) ---------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu(pid: int, *, reaped: bool = False) -> float | None:
    """User + system CPU seconds of a process (and of its children it has waited
    for, when ``reaped``), or None."""
    fields = _stat(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == parent:
                found.append(int(entry))
    return found


def postmaster(conn: psycopg.Connection[Any]) -> int | None:
    """The server's postmaster pid, when the server runs on this machine."""
    backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
    fields = _stat(backend)
    if fields is None or _stat(int(fields[1])) is None:
        return None
    return int(fields[1])


def server_cpu(master: int | None) -> float | None:
    """CPU seconds of the whole server so far: the postmaster, the backends it
    has reaped (an exited backend's time lands in its parent's) and the live
    ones (backends, checkpointer, WAL writer, autovacuum)."""
    if master is None:
        return None
    total = _cpu(master, reaped=True)
    if total is None:
        return None
    return total + sum(_cpu(pid, reaped=True) or 0.0 for pid in _children(master))


def pgbouncer_pid() -> int | None:
    """Our PgBouncer (a child of this process)."""
    for pid in _children(os.getpid()):
        fields = _stat(pid)
        with contextlib.suppress(OSError):
            if fields is not None and Path(f"/proc/{pid}/comm").read_text().strip() == "pgbouncer":
                return pid
    return None


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# -- Worker processes -----------------------------------------------------------------------


class Node:
    """One ``belay worker`` process, its log in a file."""

    def __init__(self, index: int, url: str, pooler: str | None, logs: Path) -> None:
        self.node = f"bench-host-{index}"
        self.log_path = logs / f"{self.node}.log"
        args = [sys.executable, "-m", "belay", "worker", "--url", url, "--import", "bench.hosts",
                "--queue", "default=10", "--node-id", self.node]
        if pooler:
            args += ["--pooler", pooler]
        env = {k: v for k, v in os.environ.items()
               if k not in ("BELAY_DATABASE_URL", "BELAY_POOLER", "BELAY_DIRECT_URL")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=log)

    def started(self) -> bool:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.node} exited with {self.popen.returncode}:\n"
                               + self.log_path.read_text(errors="replace")[-2000:])
        return f"belay worker {self.node} started" in self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@contextlib.contextmanager
def nodes(count: int, url: str, pooler: str | None) -> Iterator[list[Node]]:
    """``count`` worker processes, all started (idle until there is work)."""
    with tempfile.TemporaryDirectory(prefix="belay-bench-hosts-") as logs:
        procs: list[Node] = []
        try:
            for index in range(count):
                procs.append(Node(index, url, pooler, Path(logs)))
            deadline = time.monotonic() + 120
            while not all(proc.started() for proc in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError("worker processes not started after 120 s")
                time.sleep(0.05)
            yield procs
        finally:
            for proc in procs:
                proc.stop()


# -- One drain ---------------------------------------------------------------------------


def drain(bench: Bench, procs: int, mode: str, count: int, statements: bool) -> Drain:
    """``count`` no-op jobs drained by ``procs`` processes in ``mode``."""
    with bench.database("hosts") as url:
        dbname = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
        if statements:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        with contextlib.ExitStack() as stack:
            bouncer = None
            worker_url = url
            if mode != "direct":
                bouncer = stack.enter_context(PgBouncer(
                    bench.url, pool_size=POOL_SIZE,
                    max_prepared_statements=200 if mode == "prepared" else 0))
                worker_url = bouncer.url_for(dbname)
            workers = stack.enter_context(nodes(procs, worker_url, POOLER[mode]))
            # Our own statements are taken out of the counts: the readings (the
            # first is in the statements' "before" already, and neither reading
            # sees its own transaction), the insert, the polls, the final reading.
            with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
                master = postmaster(conn)
                bouncer_pid = pgbouncer_pid() if bouncer is not None else None
                xacts0, calls0, dealloc0, tuples0 = _read(conn, statements)
                cpu0 = (sum(_cpu(w.popen.pid) or 0.0 for w in workers),
                        None if bouncer_pid is None else _cpu(bouncer_pid), server_cpu(master))
                conn.execute(_FILL, (count,))
                polls = 1
                deadline = time.monotonic() + 600
                while conn.execute(_LEFT).fetchone()[0]:  # type: ignore[index]
                    polls += 1
                    if time.monotonic() > deadline:
                        raise TimeoutError("the drain did not finish in 10 minutes")
                    if any(w.popen.poll() is not None for w in workers):
                        raise RuntimeError("a worker process exited during the drain")
                    time.sleep(0.05)
                cpu1 = (sum(_cpu(w.popen.pid) or 0.0 for w in workers),
                        None if bouncer_pid is None else _cpu(bouncer_pid), server_cpu(master))
            stack.close()  # workers, then PgBouncer: every backend goes, and flushes
        _settled(bench, dbname)
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
            xacts1, calls1, dealloc1, tuples1 = _read(conn, statements)
            timing = conn.execute(
                "SELECT percentile_disc(0.1) WITHIN GROUP (ORDER BY finished_at), "
                "percentile_disc(0.9) WITHIN GROUP (ORDER BY finished_at), "
                "extract(epoch FROM max(finished_at) - min(started_at)) FROM belay_jobs"
            ).fetchone()
            assert timing is not None
            low, high, span = timing
            between = conn.execute(
                "SELECT count(*) FROM belay_jobs WHERE finished_at > %s AND finished_at <= %s",
                (low, high)).fetchone()[0]  # type: ignore[index]
    calls = None
    if calls0 is not None and calls1 is not None and dealloc0 == dealloc1:
        calls = calls1 - calls0 - (1 + 1 + polls + 1)
    elif statements:
        bench.log("hosts: pg_stat_statements evicted entries during the drain; no statements")
    return Drain(procs, mode, count, rate=between / (high - low).total_seconds(),
                 span_rate=count / float(span),
                 xacts=xacts1 - xacts0 - ((2 if statements else 1) + 1 + polls),
                 statements=calls, tuples=tuples1 - tuples0 - count,
                 cpu_workers=cpu1[0] - cpu0[0], cpu_pooler=_delta(cpu1[1], cpu0[1]),
                 cpu_server=_delta(cpu1[2], cpu0[2]))


# -- The scenario -------------------------------------------------------------------------


def run(bench: Bench, repeats: int = 1) -> list[Figure]:
    """The figures of every (processes, mode) configuration, each the median
    of ``repeats`` drains; the pooled ones only when a pgbouncer executable is
    installed, the prepared ones when one is 1.21 or later. One drain of each
    at full size takes 20 to 45 minutes in all on 2 shared cores (a single
    process drains ~600 jobs/s)."""
    count = bench.size(20_000, 100_000)
    with psycopg.connect(bench.url, autocommit=True) as admin:
        why_not = statements_available(admin)
    if why_not is not None:
        bench.log(f"hosts: statements per job n/a: {why_not}")
    modes = [mode for mode in MODES if mode == "direct" or find_binary(
        PREPARED_SINCE if mode == "prepared" else None) is not None]
    if len(modes) < len(MODES):
        bench.log(f"hosts: no pgbouncer executable for {sorted(set(MODES) - set(modes))} "
                  f"(prepared needs 1.21 or later: {BINARY_ENV})")
    runs: dict[tuple[int, str], list[Drain]] = {}
    for procs in PROCS:
        for mode in modes:
            for _ in range(repeats):
                done = drain(bench, procs, mode, count, why_not is None)
                runs.setdefault((procs, mode), []).append(done)
                per = "n/a" if done.statements is None else f"{done.statements / count:.2f}"
                bench.log(f"hosts {procs} process(es) {mode}: {done.rate:,.0f} jobs/s "
                          f"(span {done.span_rate:,.0f}), {done.xacts / count:.2f} xacts/job, "
                          f"{per} statements/job, {done.tuples / count:.2f} tuples/job")
    return figures(runs, count, repeats, why_not)


def figures(runs: dict[tuple[int, str], list[Drain]], count: int, repeats: int,
            why_not: str | None) -> list[Figure]:
    out: list[Figure] = []
    for mode in MODES:
        single = runs.get((1, mode))
        if not single:
            continue
        base = statistics.median(d.rate for d in single)
        for procs in PROCS:
            drains = runs.get((procs, mode), [])
            if not drains:
                continue
            rate = statistics.median(d.rate for d in drains)
            known = [d.statements for d in drains if d.statements is not None]
            statements = statistics.median(known) / count if known else float("nan")
            how = {"direct": "straight to PostgreSQL",
                   "pooled": "PgBouncer, pool_mode=transaction, --pooler transaction",
                   "prepared": "PgBouncer >= 1.21, pool_mode=transaction, "
                               "max_prepared_statements=200, --pooler transaction-prepared",
                   }[mode]
            out.append(Figure(
                SECTION, f"{procs} process(es), {mode}", rate, "jobs/s",
                baseline=None if procs == 1 else f"1 process, {mode}",
                baseline_value=None if procs == 1 else base,
                note=(f"belay worker --queue default=10, {how}; {count:,} no-op jobs, "
                      f"p10 to p90 of finished_at; median of {repeats}"),
                extra={"procs": procs, "mode": mode, "jobs": count,
                       "runs": [d.rate for d in drains],
                       "span_rate": statistics.median(d.span_rate for d in drains),
                       "xacts_per_job": statistics.median(d.xacts for d in drains) / count,
                       "statements_per_job": statements,
                       "statements_note": why_not or "",
                       "tuples_per_job": statistics.median(d.tuples for d in drains) / count,
                       **{f"cpu_ms_per_job_{part}": _cpu_per_job(drains, part, count)
                          for part in ("workers", "pooler", "server")}}))
    return out


def _cpu_per_job(drains: list[Drain], part: str, count: int) -> float:
    known = [v for v in (getattr(d, f"cpu_{part}") for d in drains) if v is not None]
    return statistics.median(known) * 1000 / count if known else float("nan")


def _per_job(value: Any) -> str:
    return "n/a" if value is None or value != value else f"{float(value):.2f}"


def _pair(cells: list[Figure | None], render: Callable[[Figure], str]) -> str:
    return " / ".join("—" if f is None else render(f) for f in cells)


def table(figures: list[Figure]) -> str:
    """The hosts figures as one Markdown table: processes by mode."""
    by = {(f.extra["procs"], f.extra["mode"]): f for f in figures if f.section == SECTION}
    modes = [m for m in MODES if any(key[1] == m for key in by)]
    each = " / ".join(modes)
    lines = ["| processes | " + " | ".join(f"{m} jobs/s" for m in modes)
             + f" | ratio to 1 process ({each}) | xacts/job ({each}) | statements/job "
             f"({each}) | tuples/job ({each}) |",
             "|---:|" + "---:|" * (len(modes) + 4)]
    for procs in PROCS:
        cells = [by.get((procs, mode)) for mode in modes]
        if not any(cells):
            continue

        rates = [f"{f.value:,.0f}" if f else "—" for f in cells]
        lines.append(
            f"| {procs} | " + " | ".join(rates) + " | "
            f"{_pair(cells, lambda f: '1.00' if f.ratio is None else f'{f.ratio:.2f}')} | "
            f"{_pair(cells, lambda f: _per_job(f.extra['xacts_per_job']))} | "
            f"{_pair(cells, lambda f: _per_job(f.extra['statements_per_job']))} | "
            f"{_pair(cells, lambda f: _per_job(f.extra['tuples_per_job']))} |")
    lines += ["", "CPU per job, over the drain (ms; the 2 cores are shared by all three):", "",
              "| processes | mode | worker processes | PgBouncer | PostgreSQL | total |",
              "|---:|---|---:|---:|---:|---:|"]
    for procs in PROCS:
        for mode in MODES:
            f = by.get((procs, mode))
            if f is None:
                continue
            parts = [f.extra[f"cpu_ms_per_job_{p}"] for p in ("workers", "pooler", "server")]
            known = [v for v in parts if v == v]
            lines.append(f"| {procs} | {mode} | " + " | ".join(
                "—" if v != v else f"{v:.2f}" for v in parts) + f" | {sum(known):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m bench.hosts", __doc__, "20k jobs per drain, no repeats",
                       out="also write the Markdown section here")
    parser.add_argument("--repeats", type=int, default=1,
                        help="drains per configuration (the median is reported)")
    args = parser.parse_args(argv)
    from bench.__main__ import machine, server

    # pg_stat_statements loaded: the statements per job.
    with server(args.url, "-c shared_preload_libraries=pg_stat_statements") as (url, bin_dir):
        bench = Bench(url, quick=args.quick, bin_dir=bin_dir)
        described = machine(url)
        try:
            measured = run(bench, args.repeats)
        finally:
            bench.close()
    first = measured[0].extra if measured else {}
    repeats = len(first.get("runs", []))
    lines = [f"## {SECTION}", "",
             ("Quick size" if args.quick else "Full size") + f": {first.get('jobs', 0):,} "
             "no-op jobs per drain, inserted in one statement once every process idles; "
             "each process `belay worker --queue default=10` (defaults otherwise); pooled: "
             f"behind PgBouncer (transaction pooling, pool size {POOL_SIZE}) with `--pooler "
             "transaction`; prepared: behind PgBouncer 1.21+ with max_prepared_statements = "
             "200 and `--pooler transaction-prepared`; jobs/s over the 10th to 90th "
             "percentile of finished_at; "
             f"{repeats} drain(s) per configuration (median). Method: bench/hosts.py.", "",
             table(measured), ""]
    if first.get("statements_note"):
        lines += [f"statements/job: n/a — {first['statements_note']}.", ""]
    publish("\n".join([*lines, *machine_table(described)]), args.out)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
