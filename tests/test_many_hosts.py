"""Eight hosts on one database: real ``belay worker`` processes, half through a
transaction-pooling PgBouncer (``--pooler transaction``) and half straight to
the server, some with ``--notify``, each with its own ``--node-id``, all
serving at once:

- ``g``: a global limit (3 across the cluster, 2 local slots on each of 8 nodes);
- ``p``: a partition (per-key cap 2 on ``input.tenant``; one big key, two small);
- ``r``: a rate (10 starts per 2 s sliding window, 4 local slots per node);
- ``cron``: a dynamic cron entry firing every minute, inserted by every node's
  scheduler.

Everything is proved from the database, not the logs (the logs only say when a
process is up, and are shown when an assertion fails):

- concurrency — each run records, from inside the job over a direct connection
  of its own (``tests/hosts_jobs.py``), a row with the server's
  ``clock_timestamp()`` at its start and end, plus, in the same statement as the
  start, how many jobs of its queue and of its key the database holds
  ``running`` under a live lease (what admission counts). The peak overlap of
  the recorded intervals is computed in SQL (at each run's start: the runs of
  the same queue/key that started no later and had not ended). A run's interval
  lies inside its job's ``running`` span, so both measures can only undercount;
  neither may exceed the limit, and the limit must be reached, or the check
  proved nothing;
- the rate — replayed from ``started_at`` (a claim's ``now``, which is what
  admission used) with belay's own window rule, ``belay.queues.rate_allowance``:
  each claim (the jobs sharing one ``started_at``) must fit in what the sliding
  window allowed at that instant, and no fixed window holds more than
  ``allowed`` starts;
- exactly once — every job succeeded at attempt 1 with exactly one recorded run;
- cron — one job per minute slot, each run once, the slots contiguous and
  covering every minute boundary the whole cluster was up through. Slots are
  real UTC minutes (``belay worker`` runs on the wall clock and ticks every 20 s),
  so a run of this test sees one slot, or two when it crosses a minute; the
  first tick of all eight nodes races on the same slot. Exactly-once over many
  slots across processes, on a manual clock, is ``tests/test_cron.py``'s
  ``cron_node`` test.

Bounded polling throughout; no fixed sleeps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay.pgbouncer import PgBouncer
from belay.queues import rate_allowance
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

REPO = Path(__file__).resolve().parent.parent
Conn = psycopg.Connection[Any]

HOLD = "hosts.hold"  # tests/hosts_jobs.py
TICK = "hosts.tick"
GLOBAL = 3
PER_KEY = 2
ALLOWED, PERIOD = 10, 2
QUEUES = {
    "g": {"limit": 2, "global_limit": GLOBAL},
    "p": {"limit": 3, "global_limit": PER_KEY, "partition": {"input": "tenant"}},
    "r": {"limit": 4, "rate": {"allowed": ALLOWED, "period": PERIOD}},
    "cron": 1,
}
G_JOBS, BIG_JOBS, SMALL_JOBS, R_JOBS = 90, 48, 12, 30
NODES = 8
CRON_INTERVAL = 20.0  # belay worker's cron tick (Worker's default; no CLI flag)


class Host:
    """One ``belay worker`` process, its log in a file."""

    def __init__(self, node: str, url: str, extra: list[str], record_url: str,
                 log_path: Path) -> None:
        self.node = node
        self.log_path = log_path
        args = [sys.executable, "-W", "error", "-m", "belay", "worker", "--url", url,
                "--import", "tests.hosts_jobs", "--node-id", node, "--poll-interval", "0.1",
                "--shutdown-grace", "10", *extra]
        for name, options in QUEUES.items():
            args += ["--queue", f"{name}={json.dumps(options)}"]
        env = {k: v for k, v in os.environ.items()
               if k not in ("BELAY_DATABASE_URL", "BELAY_POOLER", "BELAY_DIRECT_URL")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env["HOSTS_RECORD_URL"] = record_url
        env["HOSTS_NODE"] = node
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=log)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def started(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.node} exited ({self.popen.returncode}):\n{self.log()}")
        return re.search(rf"belay worker {re.escape(self.node)} started", self.log()) is not None

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            return self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(5)


@pytest.fixture
def stage(sql_conn: Conn, direct_url: str) -> datetime:
    """The side table and the cron entry, in place before any node starts; returns
    the server's time then."""
    sql_conn.execute("CREATE TABLE runs (id bigserial PRIMARY KEY, job_id bigint, attempt int, "
                     "pid int, node text, queue text, tenant text, started timestamptz, "
                     "ended timestamptz, queue_running int, key_running int)")
    with belay.Belay(direct_url) as producer:
        producer.put_cron("hosts.every", "* * * * *", TICK, queue="cron")
    return db_now(sql_conn)


@pytest.fixture
def hosts(stage: datetime, pgbouncer: PgBouncer, direct_url: str,
          tmp_path: Path) -> Iterator[list[Host]]:
    """Eight nodes: 0-3 through PgBouncer, 4-7 direct; 0, 1, 4, 5 with --notify
    (behind the pooler they LISTEN on --direct-url)."""
    dbname = str(psycopg.conninfo.conninfo_to_dict(direct_url)["dbname"])
    pooled = pgbouncer.url_for(dbname)
    started: list[Host] = []
    try:
        for n in range(NODES):
            extra = ["--notify"] if n % 4 in (0, 1) else []
            if n < 4:
                url = pooled
                extra += ["--pooler", "transaction", "--direct-url", direct_url]
            else:
                url = direct_url
            started.append(Host(f"host-{n}", url, extra, direct_url,
                                tmp_path / f"host-{n}.log"))
        yield started
    finally:
        for host in started:
            host.stop()


def logs(hosts: list[Host]) -> str:
    return "\n".join(f"--- {h.node}\n{h.log()[-3000:]}" for h in hosts)


def db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def peak_overlap(conn: Conn, queue: str, by_key: bool) -> dict[str, int]:
    """The most recorded runs of ``queue`` (per key, when ``by_key``) open at
    once: the maximum over runs r of the runs s with s.started <= r.started <
    s.ended (the peak of a set of intervals is reached at one's start)."""
    rows = conn.execute(
        "SELECT k, max(n) FROM ("
        "  SELECT CASE WHEN %(by_key)s THEN r.tenant ELSE '' END AS k, r.id, count(*) AS n"
        "  FROM runs r JOIN runs s ON s.queue = r.queue AND s.started <= r.started"
        "    AND s.ended > r.started AND (NOT %(by_key)s OR s.tenant = r.tenant)"
        "  WHERE r.queue = %(queue)s GROUP BY 1, r.id) AS peaks GROUP BY k",
        {"queue": queue, "by_key": by_key}).fetchall()
    return {str(k): int(v) for k, v in rows}


def test_eight_hosts_pooled_and_direct_keep_every_limit_and_run_each_job_once(
    stage: datetime, hosts: list[Host], sql_conn: Conn, direct_url: str
) -> None:
    conn = sql_conn
    before_start = stage
    with belay.Belay(direct_url) as producer:
        for host in hosts:
            wait_until(host.started, f"{host.node} started", timeout=60)
        all_up = db_now(conn)
        # One transaction: every node sees the whole backlog at once.
        jobs = producer.enqueue_many(
            [belay.JobSpec(HOLD, {"hold": 0.06}, queue="g") for _ in range(G_JOBS)]
            + [belay.JobSpec(HOLD, {"tenant": "big", "hold": 0.06}, queue="p")
               for _ in range(BIG_JOBS)]
            + [belay.JobSpec(HOLD, {"tenant": t, "hold": 0.06}, queue="p")
               for t in ("s1", "s2") * (SMALL_JOBS // 2)]
            + [belay.JobSpec(HOLD, {"hold": 0.01}, queue="r") for _ in range(R_JOBS)])
    total = len(jobs)

    def settled() -> bool:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE finished_at IS NOT NULL AND cron_name IS NULL), "
            "count(*) FILTER (WHERE cron_name IS NOT NULL AND state = 'succeeded') "
            "FROM belay_jobs").fetchone()
        assert row is not None
        for host in hosts:
            assert host.popen.poll() is None, f"{host.node} died:\n{host.log()}"
        return bool(row[0] == total and row[1] >= 1)

    try:
        wait_until(settled, "every job finished and a cron slot ran", timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(hosts)}") from None
    last_up = db_now(conn)
    for host in hosts:
        assert host.stop() == 0, host.log()
    after_stop = db_now(conn)

    # -- Exactly once: every job succeeded at attempt 1 with one recorded run. ------------
    rows = conn.execute(
        "SELECT j.id, j.state, j.attempt, jsonb_array_length(j.errors), count(r.id), "
        "min(r.attempt) FROM belay_jobs j LEFT JOIN runs r ON r.job_id = j.id "
        "GROUP BY j.id ORDER BY j.id").fetchall()
    wrong = [r for r in rows if (r[1], r[2], r[3], r[4], r[5]) != ("succeeded", 1, 0, 1, 1)]
    assert not wrong, (wrong, logs(hosts))
    assert {r[0] for r in rows} >= {job.id for job in jobs}
    assert conn.execute("SELECT count(*) FROM runs WHERE ended IS NULL").fetchone() == (0,)
    by_node = dict(conn.execute("SELECT node, count(*) FROM runs GROUP BY node").fetchall())
    assert set(by_node) <= {h.node for h in hosts}
    # Both kinds of host ran the admitted queues (their claims raced each other).
    served = conn.execute(
        "SELECT split_part(node, '-', 2)::int < 4, array_agg(DISTINCT queue ORDER BY queue) "
        "FROM runs GROUP BY 1").fetchall()
    assert {(pooled, q) for pooled, queues in served for q in queues} >= {
        (True, "g"), (True, "p"), (False, "g"), (False, "p")}, (served, by_node)

    # -- The global limit: never more than GLOBAL at once, and GLOBAL was reached. --------
    overlap = peak_overlap(conn, "g", by_key=False)[""]
    at_start = conn.execute("SELECT max(queue_running) FROM runs WHERE queue = 'g'").fetchone()
    assert at_start is not None
    assert overlap <= GLOBAL and at_start[0] <= GLOBAL, (overlap, at_start, logs(hosts))
    assert max(overlap, at_start[0]) == GLOBAL  # the limit was reached: the check bites

    # -- The partition: never more than PER_KEY of a key at once; reached on "big". -------
    per_key = peak_overlap(conn, "p", by_key=True)
    key_at_start = dict(conn.execute(
        "SELECT tenant, max(key_running) FROM runs WHERE queue = 'p' GROUP BY 1").fetchall())
    assert set(per_key) == set(key_at_start) == {"big", "s1", "s2"}
    assert max(per_key.values()) <= PER_KEY and max(key_at_start.values()) <= PER_KEY, (
        per_key, key_at_start, logs(hosts))
    assert max(per_key["big"], key_at_start["big"]) == PER_KEY
    # Keys don't cap one another: more than one key's worth ran at once overall.
    assert peak_overlap(conn, "p", by_key=False)[""] > PER_KEY

    # -- The rate: each claim within the sliding window's allowance at its instant. -------
    claims = [(at, int(n)) for at, n in conn.execute(
        "SELECT started_at, count(*) FROM belay_jobs WHERE queue = 'r' "
        "GROUP BY started_at ORDER BY started_at")]
    starts: dict[int, int] = {}  # window start -> jobs started in it so far
    for at, taken in claims:
        epoch = int(at.timestamp())
        window = epoch // PERIOD * PERIOD
        previous = sum(n for t, n in claims if int(t.timestamp()) // PERIOD * PERIOD
                       == window - PERIOD)
        allowance = rate_allowance(previous, starts.get(window, 0), ALLOWED, PERIOD, epoch)
        assert taken <= allowance, (at, taken, allowance, claims)
        starts[window] = starts.get(window, 0) + taken
    assert max(starts.values()) <= ALLOWED
    assert sum(starts.values()) == R_JOBS
    debited = conn.execute("SELECT sum(count) FROM belay_rate WHERE bucket = 'queue:r'")
    assert debited.fetchone() == (R_JOBS,)
    assert len(starts) >= R_JOBS // ALLOWED  # it took several windows: the rate bit

    # -- Cron: one job per minute slot, run once, every slot the cluster lived through. ---
    slots = [r[0] for r in conn.execute(
        "SELECT cron_slot FROM belay_jobs WHERE cron_name = 'hosts.every' ORDER BY cron_slot")]
    assert slots and len(slots) == len(set(slots)), slots
    assert slots == [slots[0] + timedelta(minutes=m) for m in range(len(slots))]  # no gap
    assert minute(before_start) <= slots[0] and slots[-1] <= minute(after_stop), (
        slots, before_start, after_stop)
    # All eight nodes were up from all_up to last_up, each ticking every CRON_INTERVAL:
    # a minute that began in between, early enough for a tick to follow, fired.
    boundary = minute(all_up) + timedelta(minutes=1)
    while boundary <= last_up - timedelta(seconds=CRON_INTERVAL + 5):
        assert boundary in slots, (boundary, slots)
        boundary += timedelta(minutes=1)
