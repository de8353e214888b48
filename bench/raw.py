"""The raw-SQL ceiling: belay's claim and a fenced ack, driven by pgbench.

No Python sits between the SQL and the server, so this is what the server can
do with belay's statements on this machine; belay's own throughput is read as
a fraction of it. The claim is belay's ``claim`` statement itself (its binds
replaced by ``now()`` and literals); the per-job ack is ``ack_succeeded``; the
batched ack is one UPDATE of every claimed id, each fenced on its attempt.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import tempfile
import time
import weakref
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from belay.sql import QUERIES
from bench.core import Bench, Figure

SECTION = "throughput"
TAKE = 50
CLIENTS = 4
#: DESIGN's figures for these 2-core machines, for the note only.
REFERENCE = {"batched": 46_000, "per_job": 6_500}

FILL = """
INSERT INTO belay_jobs (kind, queue, state, input, meta, priority, attempt, max_attempts,
                        ready_at, inserted_at)
SELECT 'noop', 'default', 'ready', '{}', '{}', 0, 0, 20, now(), now()
FROM generate_series(1, %s)
"""

#: The batched ack: every claimed row, each fenced on the attempt it was claimed at.
BATCH_ACK = """
UPDATE belay_jobs AS j
SET state = 'succeeded', result = NULL, finished_at = {now},
    lease_until = NULL, leased_by = NULL
FROM unnest({ids}::bigint[], {attempts}::int[]) AS a(id, attempt)
WHERE j.id = a.id AND j.state = 'running' AND j.attempt = a.attempt
"""

_cache: weakref.WeakKeyDictionary[Bench, float] = weakref.WeakKeyDictionary()


def _statement(name: str, binds: dict[str, str]) -> str:
    """A belay statement with its binds replaced by SQL text, comments and ``;`` dropped."""
    lines = [line for line in QUERIES[name].splitlines() if not line.lstrip().startswith("--")]
    text = "\n".join(lines).rstrip().rstrip(";")
    for key, value in binds.items():
        text = text.replace(f"%({key})s", value)
    if "%(" in text:
        raise RuntimeError(f"{name}: a bind is left unreplaced: {text}")
    return text


def _script(take: int) -> str:
    """The pgbench script: claim ``take`` (one statement, autocommit), \\gset the
    claimed ids and attempts, then ack them (another autocommit statement)."""
    claim = _statement("claim", {
        "queue": "'default'", "now": "now()", "take": str(take),
        "lease_until": "now() + interval '30 seconds'", "node": "'raw-' || :client_id",
        "kinds": "NULL",
    })
    if take == 1:
        gather = "SELECT COALESCE(min(id), 0) AS id, COALESCE(min(attempt), 0) AS attempt"
        ack = _statement("ack_succeeded", {
            "result": "NULL", "now": "now()", "id": ":id", "attempt": ":attempt",
        })
    else:
        gather = ("SELECT COALESCE(array_agg(id), '{}') AS ids, "
                  "COALESCE(array_agg(attempt), '{}') AS attempts")
        ack = BATCH_ACK.format(now="now()", ids=":ids", attempts=":attempts").strip()
    return f"WITH claimed AS (\n{claim}\n)\n{gather} FROM claimed\n\\gset\n{ack};\n"


def _pg_env(url: str) -> dict[str, str]:
    info = psycopg.conninfo.conninfo_to_dict(url)
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE",
             "password": "PGPASSWORD", "sslmode": "PGSSLMODE"}
    return {env: str(info[key]) for key, env in names.items() if info.get(key) is not None}


def _run_pgbench(pgbench: str, url: str, take: int, n_jobs: int, clients: int) -> float:
    """Wall seconds of one pgbench run draining the queue."""
    # Enough transactions to drain the queue; a surplus one claims nothing and is cheap.
    per_client = math.ceil(n_jobs / (take * clients)) + 1
    with tempfile.TemporaryDirectory(prefix="belay-raw-") as tmp:
        script = Path(tmp, f"claim{take}.sql")
        script.write_text(_script(take))
        started = time.monotonic()
        done = subprocess.run(
            [pgbench, "-n", "-M", "prepared", "-f", str(script), "-c", str(clients),
             "-j", str(min(clients, os.cpu_count() or 1)), "-t", str(per_client)],
            env={**os.environ, **_pg_env(url)}, capture_output=True, text=True, check=False,
        )
        elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed


def _psycopg_drain(url: str, take: int, start: Any) -> None:
    """The fallback client: once connected and started, claim and ack until a
    claim comes back empty."""
    node = f"raw-{os.getpid()}"
    ack = BATCH_ACK.format(now="%(now)s", ids="%(ids)s", attempts="%(attempts)s")
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        start.wait()
        while True:
            now = datetime.now(timezone.utc)
            rows = conn.execute(QUERIES["claim"], {
                "queue": "default", "take": take, "node": node, "now": now,
                "lease_until": now + timedelta(seconds=30), "kinds": None,
            }).fetchall()
            if not rows:
                return
            now = datetime.now(timezone.utc)
            if take == 1:
                conn.execute(QUERIES["ack_succeeded"], {
                    "id": rows[0]["id"], "attempt": rows[0]["attempt"], "result": None, "now": now})
            else:
                conn.execute(ack, {"ids": [r["id"] for r in rows],
                                   "attempts": [r["attempt"] for r in rows], "now": now})


def _run_psycopg(url: str, take: int, clients: int) -> float:
    """Wall seconds of ``clients`` Python processes draining the queue, counted
    once all have started and connected."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(clients + 1)
    procs = [context.Process(target=_psycopg_drain, args=(url, take, start), name=f"raw-{i}")
             for i in range(clients)]
    for proc in procs:
        proc.start()
    start.wait(timeout=60)
    started = time.monotonic()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError("a raw psycopg client failed")
    return time.monotonic() - started


def ceiling(bench: Bench, url: str, n_jobs: int, clients: int, *, take: int = TAKE
            ) -> dict[str, Any]:
    """Fill ``url``'s (empty) belay_jobs with ``n_jobs`` ready no-op jobs and drain
    them with ``clients`` raw clients claiming ``take`` at a time (take 1: claim
    one, ack it with ``ack_succeeded``; more: one batched ack per claim)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, (n_jobs,))
        conn.execute("VACUUM ANALYZE belay_jobs")
    pgbench = bench.tool("pgbench")
    if pgbench is not None:
        elapsed = _run_pgbench(pgbench, url, take, n_jobs, clients)
    else:
        elapsed = _run_psycopg(url, take, clients)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM belay_jobs WHERE state = 'succeeded'").fetchone()
    succeeded = int(row[0]) if row else 0
    return {"jobs_per_s": succeeded / elapsed, "succeeded": succeeded, "jobs": n_jobs,
            "elapsed_s": elapsed, "clients": clients, "take": take,
            "driver": "pgbench" if pgbench is not None else "psycopg processes"}


def _measure(bench: Bench, clients: int, take: int) -> dict[str, Any]:
    # Batched drains are so fast that 5,000 jobs would mostly time pgbench's start.
    n_jobs = bench.size(5_000 if take == 1 else 20_000, 100_000)
    with bench.database("raw") as url:
        result = ceiling(bench, url, n_jobs, clients, take=take)
    bench.log(f"raw take {take}, {clients} clients: {result['jobs_per_s']:,.0f} jobs/s "
              f"({result['succeeded']} in {result['elapsed_s']:.2f} s, {result['driver']})")
    return result


def raw_ceiling_jobs_per_s(bench: Bench) -> float:
    """The batched ceiling (claim 50 + batched ack, 4 clients), measured once per run."""
    if bench not in _cache:
        _cache[bench] = _measure(bench, CLIENTS, TAKE)["jobs_per_s"]
    return _cache[bench]


def _note(result: dict[str, Any], reference: int) -> str:
    note = (f"{result['succeeded']:,} of {result['jobs']:,} jobs in {result['elapsed_s']:.2f} s "
            f"by {result['driver']}; DESIGN reference ~{reference:,}/s")
    if result["driver"] != "pgbench":
        note += "; pgbench not found, so Python clients: a lower ceiling than pgbench's"
    return note


def run(bench: Bench) -> list[Figure]:
    batched = _measure(bench, CLIENTS, TAKE)
    _cache[bench] = batched["jobs_per_s"]
    single = _measure(bench, 1, TAKE)
    per_job = _measure(bench, CLIENTS, 1)
    top = f"raw SQL ceiling, claim {TAKE} + batched ack, {CLIENTS} clients"
    return [
        Figure(SECTION, top, batched["jobs_per_s"], "jobs/s",
               note=_note(batched, REFERENCE["batched"]), extra=batched),
        Figure(SECTION, f"raw SQL, claim {TAKE} + batched ack, 1 client",
               single["jobs_per_s"], "jobs/s", baseline=top,
               baseline_value=batched["jobs_per_s"], note=_note(single, REFERENCE["batched"]),
               extra=single),
        Figure(SECTION, f"raw SQL, claim 1 + ack per job, {CLIENTS} clients",
               per_job["jobs_per_s"], "jobs/s", baseline=top,
               baseline_value=batched["jobs_per_s"],
               note=_note(per_job, REFERENCE["per_job"]), extra=per_job),
    ]
