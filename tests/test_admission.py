"""Admission (contract §6): global limits, rate windows, partitions and adaptive
limits, checked against what the database shows — across threads and across
worker processes — plus dynamic queues and pauses (§8.6)."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
from belay import store
from belay.queues import parse_spec
from tests.helpers import START, wait_until

REPO = Path(__file__).resolve().parent.parent
Conn = psycopg.Connection[Any]


@pytest.fixture
def registry() -> belay.Registry:
    return belay.Registry()


def drain(client: belay.Belay, registry: belay.Registry, queues: Any) -> dict[str, int]:
    return belay.Worker(queues, client=client, registry=registry).drain()


def rate_rows(conn: Conn) -> dict[tuple[str, int], int]:
    return {(b, w): c for b, w, c in conn.execute(
        "SELECT bucket, window_start, count FROM belay_rate")}


def states(conn: Conn, queue: str) -> dict[str, int]:
    return dict(conn.execute(
        "SELECT state, count(*) FROM belay_jobs WHERE queue = %s GROUP BY state", (queue,)))


# -- Rate windows and token admission, with the clock ----------------------------------


def test_a_rate_admits_allowed_per_window_and_debits_each_claim(
    client, registry, clock, sql_conn
) -> None:
    @belay.worker(name="t.ping", queue="mail", registry=registry)
    def ping(ctx: belay.Context) -> None:
        return None

    client.enqueue_many([belay.JobSpec("t.ping", {}, queue="mail") for _ in range(12)])
    queues = {"mail": {"limit": 5, "rate": {"allowed": 5, "period": 60}}}
    clock.set(START.replace(second=0))
    assert drain(client, registry, queues) == {"succeeded": 5}
    window = int(START.replace(second=0).timestamp())
    assert rate_rows(sql_conn) == {("queue:mail", window): 5}
    # Half way through the next window, half of the last one still counts.
    clock.advance(90)
    assert drain(client, registry, queues) == {"succeeded": 2}
    clock.advance(30)  # the start of the window after: the last one counts fully
    assert drain(client, registry, queues) == {"succeeded": 3}
    clock.advance(60)
    assert drain(client, registry, queues) == {"succeeded": 2}
    assert states(sql_conn, "mail") == {"succeeded": 12}


def test_token_admission_divides_the_remaining_tokens_by_the_estimate(
    client, clock, sql_conn
) -> None:
    for _ in range(10):
        client.enqueue("t.llm", queue="ai")
    spec = parse_spec("ai", {"limit": 10, "rate": {
        "allowed": 10_000, "period": 60, "resource": "anthropic", "estimate": 2_000}})
    now = clock.now()
    with client.transaction() as conn:
        claimed = store.claim_admitted(conn, spec, 10, "n1", now, now + timedelta(seconds=30))
    assert len(claimed) == 5
    window = int(now.timestamp()) // 60 * 60
    assert rate_rows(sql_conn) == {("resource:anthropic", window): 10_000}
    with client.transaction() as conn:
        assert store.claim_admitted(conn, spec, 10, "n1", now, now + timedelta(seconds=30)) == []


def test_debits_true_up_the_estimate_so_admission_converges_on_real_use(
    client, registry, clock, sql_conn
) -> None:
    @belay.worker(name="t.llm", queue="ai", registry=registry)
    def llm(ctx: belay.Context) -> None:
        ctx.debit("anthropic", 300)
        ctx.debit("anthropic", 200)  # the estimate is credited back once per run

    client.enqueue_many([belay.JobSpec("t.llm", {}, queue="ai") for _ in range(40)])
    queues = {"ai": {"limit": 4, "rate": {
        "allowed": 10_000, "period": 60, "resource": "anthropic", "estimate": 2_000}}}
    clock.set(START.replace(second=0))
    # Each run really uses 500: a claim is admitted while 2,000 fit, i.e. until
    # 17 runs have used 8,500 (estimates alone would stop at 5).
    assert drain(client, registry, queues) == {"succeeded": 17}
    window = int(START.replace(second=0).timestamp())
    assert rate_rows(sql_conn) == {("resource:anthropic", window): 17 * 500}


def test_a_debit_on_an_unconfigured_resource_needs_a_period(client, registry, sql_conn) -> None:
    @belay.worker(name="t.other", queue="ai", registry=registry)
    def other(ctx: belay.Context) -> None:
        ctx.debit("openai", 70, period=30)

    client.enqueue("t.other", queue="ai")
    queues = {"ai": {"limit": 1, "rate": {"allowed": 10, "period": 60, "resource": "anthropic"}}}
    assert drain(client, registry, queues) == {"succeeded": 1}
    # Not the queue's resource: recorded as given, nothing credited; the
    # queue's own resource got the claim's estimate (1).
    by_bucket = {bucket: count for (bucket, _), count in rate_rows(sql_conn).items()}
    assert by_bucket == {"resource:anthropic": 1, "resource:openai": 70}


def test_queues_sharing_a_resource_share_its_window_exactly_under_racing_threads(
    db_url, clock, sql_conn
) -> None:
    """Two queues, each claimed by its own worker (own pool) on several threads at
    once, draw on one resource: the window admits exactly ``allowed`` in total."""
    rate = {"allowed": 12, "period": 60, "resource": "shared"}
    with belay.Belay(db_url, clock=clock) as producer:
        for queue in ("a", "b"):
            producer.enqueue_many([belay.JobSpec("t.none", {}, queue=queue) for _ in range(30)])
    specs = [parse_spec(q, {"limit": 30, "rate": rate}) for q in ("a", "b")]
    clients = [belay.Belay(db_url, clock=clock) for _ in range(6)]
    barrier = threading.Barrier(len(clients))
    claimed: list[int] = []
    lock = threading.Lock()

    def claim(index: int) -> None:
        instance, spec = clients[index], specs[index % 2]
        barrier.wait()
        for _ in range(5):
            now = clock.now()
            with instance.transaction() as conn:
                got = store.claim_admitted(conn, spec, 3, f"n{index}", now,
                                           now + timedelta(seconds=30))
            with lock:
                claimed.extend(job.id for job in got)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for instance in clients:
        instance.close()
    assert len(claimed) == len(set(claimed)) == 12
    running = sql_conn.execute("SELECT count(*) FROM belay_jobs WHERE state = 'running'")
    assert running.fetchone() == (12,)


# -- Partitions, exact, with the clock -----------------------------------------------


def test_a_partition_caps_each_key_and_skew_cannot_starve_a_minority_key(
    client, clock, sql_conn
) -> None:
    # 30 jobs of tenant A queued first, then 2 each of B and C.
    client.enqueue_many([belay.JobSpec("t.none", {"tenant": "A"}, queue="t") for _ in range(30)])
    client.enqueue_many([belay.JobSpec("t.none", {"tenant": t}, queue="t")
                         for t in ("B", "C", "B", "C")])
    client.enqueue("t.none", {}, queue="t")  # no key: the empty key is a key of its own
    spec = parse_spec("t", {"limit": 8, "global_limit": 2, "partition": {"input": "tenant"}})
    now = clock.now()
    with client.transaction() as conn:
        first = store.claim_admitted(conn, spec, 8, "n1", now, now + timedelta(seconds=30))
    tenants = sorted(job.input.get("tenant", "") for job in first)
    assert tenants == ["", "A", "A", "B", "B", "C", "C"]
    # Every key is at its cap (or empty): another claim finds nothing.
    with client.transaction() as conn:
        assert store.claim_admitted(conn, spec, 8, "n2", now, now + timedelta(seconds=30)) == []
    # One A finishes: exactly one more A may run.
    a_job = next(job for job in first if job.input.get("tenant") == "A")
    sql_conn.execute("UPDATE belay_jobs SET state = 'succeeded' WHERE id = %s", (a_job.id,))
    with client.transaction() as conn:
        more = store.claim_admitted(conn, spec, 8, "n2", now, now + timedelta(seconds=30))
    assert [job.input["tenant"] for job in more] == ["A"]


#: Contract §6's partitioned selection as it reads, over the whole queue:
#: number the claimable jobs within each key in claim order, keep those within
#: the key's room, order globally, take.
CONTRACT_RANKING = """
WITH keyed AS (
  SELECT id, priority, ready_at,
         COALESCE((CASE WHEN %(source)s = 'meta' THEN meta ELSE input END) ->> %(key)s, '') AS k
  FROM belay_jobs
  WHERE queue = %(queue)s
    AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
    AND ((state = 'ready' AND (ready_at IS NULL OR ready_at <= %(now)s))
      OR (state = 'awaiting' AND ready_at IS NOT NULL AND ready_at <= %(now)s))
), ranked AS (
  SELECT *, row_number() OVER (PARTITION BY k ORDER BY priority, ready_at NULLS FIRST, id) AS rn
  FROM keyed
), running AS (
  SELECT COALESCE(input ->> %(key)s, '') AS k, count(*) AS c FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'running' AND lease_until > %(now)s GROUP BY 1
)
SELECT r.id FROM ranked AS r LEFT JOIN running USING (k)
WHERE r.rn <= GREATEST(%(per_key)s - COALESCE(running.c, 0), 0)
ORDER BY r.priority, r.ready_at NULLS FIRST, r.id
LIMIT %(take)s
"""


@pytest.mark.parametrize("seed", range(6))
def test_the_partitioned_prefix_picks_exactly_what_ranking_the_whole_queue_picks(
    client, clock, sql_conn, seed: int
) -> None:
    """The claim ranks a prefix of the queue in claim order first and the
    whole queue only when the prefix can't settle it. Over random queues —
    skewed tenants, priorities, future and due jobs, awaiting deadlines, jobs
    already running, a kinds filter — and windows from tiny to the whole
    queue, its picks are the contract's full ranking's, in order."""
    rng = random.Random(seed)
    now = clock.now()
    tenants = ["big"] * 12 + [f"t{i}" for i in range(rng.randint(1, 12))] + [None]
    rows = []
    for _ in range(rng.randint(20, 120)):
        tenant = rng.choice(tenants)
        state = rng.choices(["ready", "awaiting", "running"], [6, 3, 2])[0]
        offset = (rng.choice([None, -30, -5, 5]) if state == "ready"
                  else rng.choice([rng.uniform(-60, -1), 20]))
        ready_at = None if offset is None else now + timedelta(seconds=offset)
        lease = now + timedelta(seconds=rng.choice([-5, 30])) if state == "running" else None
        rows.append((rng.choice(["t.a", "t.b"]), state, json.dumps(
            {} if tenant is None else {"tenant": tenant}), rng.choice([0, 0, 1, 2]),
            ready_at, lease))
    sql_conn.cursor().executemany(
        "INSERT INTO belay_jobs (kind, queue, state, input, priority, attempt, max_attempts, "
        "ready_at, lease_until, inserted_at) VALUES (%s, 'p', %s, %s, %s, 0, 5, %s, %s, "
        "now())", rows)
    for per_key, take, kinds in [(1, 5, None), (2, 8, None), (3, 4, ["t.a"]), (5, 50, None)]:
        spec = parse_spec("p", {"limit": take, "global_limit": per_key,
                                "partition": {"input": "tenant"}})
        params = {"queue": "p", "now": now, "kinds": kinds}
        with client.transaction() as conn:
            full = [r[0] for r in conn.execute(CONTRACT_RANKING, {
                **params, "source": "input", "key": "tenant", "per_key": per_key,
                "take": take})]
            assert full
            for window in (1, 2, 3, 7, 25, 1000):
                picks = store.partitioned_picks(conn, spec, params, take, window=window)
                assert picks == full, (per_key, take, kinds, window)


def test_the_partitioned_prefix_orders_due_waits_by_priority_first(client, clock, sql_conn
                                                                     ) -> None:
    """Jobs whose wait is due join the prefix in claim order — priority
    first — not by how long ago they came due: an urgent one that came due
    a second ago goes before older, less urgent ones, and before ready ones."""
    now = clock.now()
    rows = [("ready", 1, None)] * 3 + [("awaiting", 2, -60)] * 3 + [("awaiting", 0, -1)] * 3
    ids = [sql_conn.execute(
        "INSERT INTO belay_jobs (kind, queue, state, input, priority, attempt, max_attempts, "
        "ready_at, inserted_at) VALUES ('t.a', 'p', %s, '{}', %s, 0, 5, %s, now()) "
        "RETURNING id", (state, priority, None if ago is None else now + timedelta(seconds=ago))
    ).fetchone()[0] for state, priority, ago in rows]
    spec = parse_spec("p", {"limit": 3, "global_limit": 10, "partition": {"input": "tenant"}})
    with client.transaction() as conn:
        picks = store.partitioned_picks(conn, spec, {"queue": "p", "now": now, "kinds": None},
                                        3, window=3)
    assert picks == ids[6:]


def test_an_expired_lease_frees_its_slot(client, clock, sql_conn) -> None:
    client.enqueue_many([belay.JobSpec("t.none", {}, queue="g") for _ in range(4)])
    spec = parse_spec("g", {"limit": 4, "global_limit": 2})
    now = clock.now()
    with client.transaction() as conn:
        assert len(store.claim_admitted(conn, spec, 4, "n1", now,
                                        now + timedelta(seconds=30))) == 2
    with client.transaction() as conn:
        assert store.claim_admitted(conn, spec, 4, "n1", now, now + timedelta(seconds=30)) == []
    later = now + timedelta(seconds=31)  # both leases lapsed: their slots count no more
    with client.transaction() as conn:
        assert len(store.claim_admitted(conn, spec, 4, "n2", later,
                                        later + timedelta(seconds=30))) == 2


# -- Across worker processes, observed from the database ----------------------------


class Cluster:
    def __init__(self, db_url: str, tmp_path: Path) -> None:
        self.db_url = db_url
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, count: int, queues: dict[str, Any]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        for n in range(count):
            with open(self.tmp_path / f"node{n}.log", "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-W", "error", "-m", "tests.admission_jobs", self.db_url,
                     f"node{n}", json.dumps(queues)],
                    cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=log,
                ))

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.tmp_path.glob("node*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def cluster(db_url: str, tmp_path: Path, sql_conn: Conn) -> Iterator[Cluster]:
    sql_conn.execute("CREATE TABLE observed (job_id bigint, queue text, tenant text, "
                     "queue_running int, key_running int, pid int)")
    nodes = Cluster(db_url, tmp_path)
    try:
        yield nodes
    finally:
        nodes.stop()


class Sampler:
    """Polls the running counts from the test process while the cluster works."""

    def __init__(self, db_url: str, queue: str) -> None:
        self.queue = queue
        self.peak = 0
        self.peak_by_key: dict[str, int] = {}
        self._stop = threading.Event()
        # Never prepared: the suite may run behind a transaction pooler.
        self._conn = psycopg.connect(db_url, autocommit=True, prepare_threshold=None)
        self._thread = threading.Thread(target=self._run, name="test-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rows = self._conn.execute(
                "SELECT COALESCE(input ->> 'tenant', ''), count(*) FROM belay_jobs "
                "WHERE queue = %s AND state = 'running' AND lease_until > clock_timestamp() "
                "GROUP BY 1", (self.queue,)).fetchall()
            self.peak = max(self.peak, sum(c for _, c in rows))
            for key, count in rows:
                self.peak_by_key[key] = max(self.peak_by_key.get(key, 0), count)
            self._stop.wait(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()


def finished(conn: Conn, queue: str, total: int) -> bool:
    row = conn.execute("SELECT count(*) FROM belay_jobs WHERE queue = %s AND state = 'succeeded'",
                       (queue,)).fetchone()
    return row is not None and row[0] == total


def test_a_global_limit_holds_across_three_worker_processes(
    cluster, db_url, sql_conn
) -> None:
    """Three nodes with 5 local slots each on a queue limited to 4 cluster-wide:
    never more than 4 run at once, and the limit is actually reached."""
    with belay.Belay(db_url) as producer:
        producer.enqueue_many(
            [belay.JobSpec("adm.observe", {"hold": 0.08}, queue="g") for _ in range(60)])
    sampler = Sampler(db_url, "g")
    try:
        cluster.start(3, {"g": {"limit": 5, "global_limit": 4}})
        wait_until(lambda: finished(sql_conn, "g", 60), "all 60 jobs succeeded", timeout=60)
    finally:
        sampler.stop()
    observed = sql_conn.execute(
        "SELECT max(queue_running), count(DISTINCT pid) FROM observed").fetchone()
    assert observed is not None
    peak = max(observed[0], sampler.peak)
    assert peak <= 4, cluster.logs()
    assert peak == 4  # the limit was reached, so the check above means something
    assert observed[1] >= 2  # the work was shared between processes
    once = sql_conn.execute("SELECT count(*) FROM belay_jobs WHERE queue = 'g' AND "
                            "attempt = 1").fetchone()
    assert once == (60,)


def test_partitions_hold_per_key_across_processes_and_a_minority_key_is_not_starved(
    cluster, db_url, sql_conn
) -> None:
    with belay.Belay(db_url) as producer:
        producer.enqueue_many([belay.JobSpec("adm.observe", {"tenant": "big", "hold": 0.05},
                                             queue="t") for _ in range(60)])
        producer.enqueue_many([belay.JobSpec("adm.observe", {"tenant": small, "hold": 0.05},
                                             queue="t") for small in ("s1", "s2") * 3])
    sampler = Sampler(db_url, "t")
    try:
        cluster.start(3, {"t": {"limit": 4, "global_limit": 2,
                                "partition": {"input": "tenant"}}})
        wait_until(lambda: finished(sql_conn, "t", 66), "all 66 jobs succeeded", timeout=60)
    finally:
        sampler.stop()
    peaks = dict(sql_conn.execute("SELECT tenant, max(key_running) FROM observed GROUP BY 1"))
    for key, count in sampler.peak_by_key.items():
        peaks[key] = max(peaks.get(key, 0), count)
    assert max(peaks.values()) <= 2, (peaks, cluster.logs())
    assert peaks["big"] == 2
    # The six minority jobs, queued after all 60 of "big", all started before
    # the first third of "big" had: ranking per key lets them in at once.
    order = [row[0] for row in sql_conn.execute(
        "SELECT input ->> 'tenant' FROM belay_jobs WHERE queue = 't' ORDER BY started_at, id")]
    assert max(i for i, t in enumerate(order) if t != "big") < 20, order


def test_a_rate_window_holds_across_three_worker_processes(cluster, db_url, sql_conn) -> None:
    """5 starts per 1 s window across three nodes: per window, counted from the
    claim times the database holds, never more than 5."""
    with belay.Belay(db_url) as producer:
        producer.enqueue_many(
            [belay.JobSpec("adm.observe", {"hold": 0.01}, queue="r") for _ in range(24)])
    cluster.start(3, {"r": {"limit": 5, "rate": {"allowed": 5, "period": 1}}})
    wait_until(lambda: finished(sql_conn, "r", 24), "all 24 jobs succeeded", timeout=60)
    per_window = [row[0] for row in sql_conn.execute(
        "SELECT count(*) FROM belay_jobs WHERE queue = 'r' "
        "GROUP BY floor(extract(epoch FROM started_at))")]
    assert max(per_window) <= 5, (per_window, cluster.logs())
    assert len(per_window) >= 5  # 24 starts needed at least five windows
    debited = sql_conn.execute("SELECT sum(count) FROM belay_rate WHERE bucket = 'queue:r'")
    assert debited.fetchone() == (24,)


# -- Adaptive limits, in a running worker ------------------------------------------------


def test_an_adaptive_limit_grows_while_claims_come_back_full_and_decays_when_idle(
    client, registry
) -> None:
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()

    @belay.worker(name="t.block", queue="ingest", registry=registry)
    def block(ctx: belay.Context) -> None:
        with lock:
            running.append(ctx.id)
        release.wait(10)

    client.enqueue_many([belay.JobSpec("t.block", {}, queue="ingest") for _ in range(30)])
    worker = belay.Worker({"ingest": {"limit": {"min": 2, "max": 8}}}, client=client,
                          registry=registry, poll_interval=0.05, busy_poll=0.01)
    with worker:
        assert worker.queue_limit("ingest") in (2, 4, 8)
        wait_until(lambda: worker.queue_limit("ingest") == 8, "the limit grew to its max")
        wait_until(lambda: len(running) == 8, "eight jobs run at once")
        assert len(running) == 8  # never more than the max
        release.set()
        wait_until(lambda: client.stats().get("ingest", {}).get("succeeded") == 30,
                   "every job finished")
        wait_until(lambda: worker.queue_limit("ingest") == 2, "the idle limit decayed to min")


# -- Dynamic queues and pauses (§8.6) --------------------------------------------------


def test_a_queue_put_through_the_client_is_served_and_a_deleted_one_is_not(
    client, registry, sql_conn
) -> None:
    ran: list[str] = []

    @belay.worker(name="t.dyn", registry=registry)
    def dyn(ctx: belay.Context) -> None:
        ran.append(ctx.queue)

    worker = belay.Worker({"default": 2}, client=client, registry=registry,
                          poll_interval=0.05, busy_poll=0.01)
    with worker:
        spec = client.put_queue("imports", limit=3, global_limit=2,
                                rate={"allowed": 100, "period": 60})
        assert spec.global_limit == 2
        assert worker.sync_queues()["imports"] == spec
        assert worker.live_queues()["imports"] == spec
        wait_until(lambda: any(t.name == "belay-producer-imports"
                               for t in threading.enumerate()), "a producer started")
        client.enqueue("t.dyn", queue="imports")
        wait_until(lambda: ran == ["imports"], "the dynamic queue's job ran")
        assert client.delete_queue("imports") is True
        assert client.delete_queue("imports") is False
        worker.sync_queues()
        assert "imports" not in worker.live_queues()
        wait_until(lambda: not any(t.name == "belay-producer-imports"
                                   for t in threading.enumerate()), "its producer exited")
        late = client.enqueue("t.dyn", queue="imports")
        client.enqueue("t.dyn", queue="default")
        wait_until(lambda: ran.count("default") == 1, "the static queue still runs")
        assert client.get_job(late.id).state == "ready"


def test_pause_and_resume_through_the_client_reach_every_worker(client, registry) -> None:
    ran: list[int] = []

    @belay.worker(name="t.p", registry=registry)
    def p(ctx: belay.Context) -> None:
        ran.append(ctx.id)

    workers = [belay.Worker({"default": 2}, client=client, registry=registry,
                            poll_interval=0.05, busy_poll=0.01) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        client.pause_queue("default")
        assert client.list_queues() == {"default": {"paused": True}}
        for worker in workers:
            assert worker.sync_queues()["default"].paused
        job = client.enqueue("t.p")
        # Paused on both: the producers ask for nothing, and a drain claims nothing.
        for worker in workers:
            assert worker.producers.demand(worker.producers.live["default"]) == 0
        assert belay.Worker({"default": 1}, client=client, registry=registry).drain() == {}
        assert client.get_job(job.id).state == "ready"
        assert client.resume_queue("default") is True
        assert client.list_queues() == {}  # a pause-only row goes away
        for worker in workers:
            worker.sync_queues()
        wait_until(lambda: ran == [job.id], "the job ran after resume")
    finally:
        for worker in workers:
            worker.stop()
    assert client.resume_queue("nothing") is False


def test_drain_honours_a_pause_and_a_paused_queue_keeps_its_options(
    client, registry, sql_conn
) -> None:
    @belay.worker(name="t.d", queue="q", registry=registry)
    def d(ctx: belay.Context) -> None:
        return None

    client.put_queue("q", limit=4, global_limit=1)
    client.pause_queue("q")
    client.enqueue("t.d", queue="q")
    assert drain(client, registry, {"q": 1}) == {}
    # Replacing the options keeps the pause; resuming keeps the options.
    client.put_queue("q", limit=5)
    assert client.list_queues()["q"] == {"limit": 5, "paused": True}
    assert client.resume_queue("q") is True
    assert client.list_queues()["q"] == {"limit": 5}
    assert drain(client, registry, {"q": 1}) == {"succeeded": 1}


def test_a_worker_can_pause_a_queue_on_its_own_node(client, registry) -> None:
    worker = belay.Worker({"default": 2}, client=client, registry=registry)
    worker.pause_queue("default")
    client.enqueue("t.x")
    assert worker.drain() == {}
    worker.resume_queue("default")
    assert worker.drain() == {"unknown": 1}


def test_a_bad_row_is_skipped_with_one_error_and_the_static_queue_stays(
    client, registry, sql_conn, caplog
) -> None:
    sql_conn.execute("INSERT INTO belay_queues (name, opts) VALUES "
                     "('default', '{\"limit\": \"lots\"}'), "
                     "('ref', '{\"limit\": 3, \"partition\": [\"meta\", \"org\"], "
                     "\"rate\": {\"allowed\": 5, \"period\": 60}}')")
    worker = belay.Worker({"default": 2}, client=client, registry=registry)
    with caplog.at_level(logging.ERROR, logger="belay.worker"):
        specs = worker.sync_queues()
        worker.sync_queues()
    assert specs["default"] == parse_spec("default", 2)
    # A row as the reference writes it.
    assert specs["ref"] == parse_spec("ref", {"limit": 3, "partition": {"meta": "org"},
                                              "rate": {"allowed": 5, "period": 60}})
    errors = [r.getMessage() for r in caplog.records if "belay_queues row" in r.getMessage()]
    assert len(errors) == 1 and "'default'" in errors[0] and "limit" in errors[0]


def test_put_queue_checks_its_options_before_storing(client) -> None:
    with pytest.raises(belay.ConfigurationError, match="min <= max"):
        client.put_queue("x", limit={"min": 3, "max": 1})
    with pytest.raises(belay.ConfigurationError, match="partition is"):
        client.put_queue("x", partition={"body": "k"})
    with pytest.raises(belay.ValidationError, match="queue name"):
        client.pause_queue("")
    assert client.list_queues() == {}


def test_executor_threads_follow_the_live_queues(client, registry) -> None:
    def executors() -> int:
        return sum(1 for t in threading.enumerate()
                   if t.name.startswith("belay-exec-") and t.is_alive())

    worker = belay.Worker({"default": 2}, client=client, registry=registry,
                          poll_interval=0.05, busy_poll=0.01)
    before = executors()
    with worker:
        assert executors() == before + 2
        client.put_queue("extra", limit={"min": 1, "max": 3})  # sized by the max
        worker.sync_queues()
        assert executors() == before + 5
        client.delete_queue("extra")
        worker.sync_queues()
        wait_until(lambda: executors() == before + 2, "the extra executors retired")
    wait_until(lambda: executors() == before, "every executor stopped")


def test_a_claim_limited_to_some_kinds_leaves_the_others_untouched(client, clock, sql_conn) -> None:
    """What an HTTP worker registered for some tasks claims: only those kinds,
    plain and through admission (global limit, partition), others never locked."""
    client.enqueue_many([belay.JobSpec(kind, {"tenant": t}, queue="t")
                         for kind in ("py.only", "http.task") for t in ("A", "B")])
    now = clock.now()
    lease = now + timedelta(seconds=30)
    with client.transaction() as conn:
        plain = store.claim(conn, "t", 10, "n1", now, lease, kinds=["http.task"])
    assert sorted((j.kind, j.input["tenant"]) for j in plain) == [
        ("http.task", "A"), ("http.task", "B")]
    sql_conn.execute("UPDATE belay_jobs SET state = 'ready', attempt = 0, leased_by = NULL, "
                     "lease_until = NULL WHERE kind = 'http.task'")
    for options in ({"limit": 8, "global_limit": 5},
                    {"limit": 8, "partition": {"input": "tenant"}}):
        spec = parse_spec("t", options)
        with client.transaction() as conn:
            admitted = store.claim_admitted(conn, spec, 8, "n1", now, lease, kinds=["http.task"])
        assert {j.kind for j in admitted} == {"http.task"} and len(admitted) == 2, options
        sql_conn.execute("UPDATE belay_jobs SET state = 'ready', attempt = 0, leased_by = NULL, "
                         "lease_until = NULL WHERE kind = 'http.task'")
    assert states(sql_conn, "t") == {"ready": 4}
    untouched = sql_conn.execute("SELECT count(*) FROM belay_jobs WHERE kind = 'py.only' "
                                 "AND attempt = 0 AND started_at IS NULL").fetchone()
    assert untouched == (2,)


def test_a_claimer_reads_the_clock_after_the_queue_lock_so_a_window_cannot_overshoot(
    client, registry, clock, sql_conn
) -> None:
    """Claimer A reads the clock late in one window, then waits on the queue's
    lock while B claims the whole allowance at the start of the next. Had A
    counted against the clock it read before waiting, it would see the old,
    empty window and take the allowance a second time."""
    client.enqueue_many([belay.JobSpec("t.none", {}, queue="r") for _ in range(8)])
    spec = parse_spec("r", {"limit": 5, "rate": {"allowed": 5, "period": 60}})
    boundary = START.replace(second=0) + timedelta(minutes=1)
    clock.set(boundary - timedelta(seconds=1))  # late in window W1, nothing taken in it
    worker = belay.Worker({"default": 1}, client=client, registry=registry,
                          poll_interval=3600, sweep_interval=3600)
    worker.start()
    claimed: list[list[belay.Job]] = []
    try:
        with client.transaction() as holder:  # the queue's lock, as a claimer holds it
            store.lock_for_claim(holder, spec)
            a = threading.Thread(target=lambda: claimed.append(worker._claim_jobs(spec, 5)))
            a.start()
            wait_until(lambda: sql_conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchone() == (1,), "A waits on the queue's lock")
            # B, at the start of W2, took the window's whole allowance.
            clock.set(boundary + timedelta(seconds=1))
            store.rate_add(holder, spec.rate.bucket("r"), int(boundary.timestamp()), 5)
        a.join(10)
    finally:
        worker.stop()
    assert claimed == [[]]
    assert states(sql_conn, "r") == {"ready": 8}
