"""What the production profile reads around its runs, for belay and the peers
alike: a table pre-filled by SQL, where the CPU goes, and the pruning."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench.core import Proc, cpu_seconds

SECONDARY = """
SELECT indexname, indexdef FROM pg_indexes
WHERE tablename = %s AND indexname <> %s || '_pkey'
"""
DELETED = "SELECT n_tup_del FROM pg_stat_user_tables WHERE relname = %s"
#: The database's transactions: the workers', the producers', the bench's few.
XACTS = """
SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()
"""


def one(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def wait(conn: psycopg.Connection[Any], query: str, params: Any, timeout: float) -> bool:
    """Poll ``query`` until it is true; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not one(conn, query, params):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fill(conn: psycopg.Connection[Any], table: str, insert: str, params: dict[str, Any],
         log: Callable[[str], None]) -> None:
    """Run ``insert`` into ``table`` with its secondary indexes dropped, build
    them again, then ``VACUUM ANALYZE`` and ``CHECKPOINT``: a table that looks
    as if it had grown there, made in seconds."""
    started = time.monotonic()
    indexes = conn.execute(SECONDARY, (table, table)).fetchall()
    conn.execute("SET maintenance_work_mem = '256MB'")
    for name, _ in indexes:
        conn.execute(f'DROP INDEX "{name}"')
    conn.execute(insert, params)
    for _, definition in indexes:
        conn.execute(definition)
    conn.execute("RESET maintenance_work_mem")
    conn.execute(f'VACUUM ANALYZE "{table}"')
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")
    log(f"profile: {table} filled ({params.get('rows', 0):,} jobs) in "
        f"{time.monotonic() - started:.1f} s")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU seconds so far of the workers, the producers, the server (the
    postmaster and its children, when it runs on this machine) and the whole
    machine (/proc/stat, every core)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        backend = _stat(int(one(conn, "SELECT pg_backend_pid()")))
        self.postmaster: int | None = None
        if backend is not None:
            with contextlib.suppress(OSError), open(f"/proc/{backend[0]}/cmdline", "rb") as cmd:
                if b"postgres" in cmd.read():
                    self.postmaster = backend[0]

    def read(self, nodes: list[Proc], producers: list[int]) -> dict[str, float]:
        out = {"workers": sum(cpu_seconds(node.pid) or 0.0 for node in nodes),
               "producers": sum(cpu_seconds(pid) or 0.0 for pid in producers)}
        if self.postmaster is not None:
            found = [(int(e.name), _stat(int(e.name))) for e in os.scandir("/proc")
                     if e.name.isdigit()]
            out["server"] = sum(s[1] for pid, s in found if s is not None
                                and self.postmaster in (pid, s[0]))
        with contextlib.suppress(OSError), open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
            out["machine"] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        return out


def cores(before: dict[str, float], after: dict[str, float], seconds: float
          ) -> dict[str, float]:
    """Cores busy over a window, by whom; ``other``: the rest of the machine."""
    used = {key: round((after[key] - before[key]) / seconds, 2) for key in after}
    if "machine" in used:
        used["other"] = round(used["machine"] - sum(
            v for k, v in used.items() if k != "machine"), 2)
    return used


class PruneWatch:
    """``n_tup_del`` of ``table``, sampled once a second on a connection of
    its own until ``stop()`` (only retention deletes its rows)."""

    def __init__(self, url: str, table: str) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, table),
                                        name="prune-watch")
        self._thread.start()

    def _run(self, url: str, table: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                self.samples.append((time.time(), int(one(conn, DELETED, (table,)))))
                if self._stop.wait(1.0):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def active(self, opened: float, closed: float) -> float:
        """Seconds of [opened, closed) in which rows were deleted (±1 s: the
        server flushes the counter at most once a second)."""
        return sum(max(0.0, min(t1, closed) - max(t0, opened))
                   for (t0, n0), (t1, n1) in itertools.pairwise(self.samples) if n1 > n0)
