"""The soak's checker can fail: hand-built rows breaking each §11 invariant, a
real engine with its ack fence broken on purpose, and a short soak whose workers
skip the budget check and step memoization (``SOAK_BREAK``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import belay
from belay import store
from belay.pgbouncer import PgBouncer, find_binary
from soak import check as checker
from soak.driver import SOAK_TABLES, Driver, parse
from soak.pg import Server
from soak.proxy import Proxy
from soak.worker import AckRecorder, apply_break

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
REPO = Path(__file__).resolve().parent.parent


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job(id: int, kind: str, state: str = "succeeded", **columns: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": id, "kind": kind, "queue": "default", "state": state, "input": {},
        "attempt": 1, "max_attempts": 25, "result": {"attempt": 1}, "errors": [],
        "unique_key": None, "unique_mode": None, "cron_name": None, "cron_slot": None,
        "parent_id": None, "workflow_id": None, "wf_name": None, "wf_deps": [],
        "wf_ignore": [], "inserted_at": at(0), "started_at": at(0.1),
        "finished_at": at(0.5), "budget_usd_micros": None, "spent_usd_micros": 0,
        "meta": {},
    }
    row.update(columns)
    return row


def effect(job_id: int, step: str, attempt: int = 1, when: float = 0.2,
           tag: str = "w1") -> dict[str, Any]:
    return {"job_id": job_id, "step": step, "attempt": attempt, "tag": tag, "at": at(when)}


def good() -> checker.Snapshot:
    """One job of every soak kind, every invariant holding."""
    planned = {"error": "RuntimeError: planned failure on attempt 1", "attempt": 1}
    jobs = [
        job(1, "soak.step", input={"n": 10, "k": 2, "f": 1}, attempt=2,
            result={"value": 23, "attempt": 2}, errors=[planned]),
        job(2, "soak.parent", input={"vs": [1, 2]}, result={"value": [2, 4], "attempt": 1}),
        job(3, "soak.child", parent_id=2, unique_key="$spawn:2:fan:0", unique_mode="always",
            result=2),
        job(4, "soak.child", parent_id=2, unique_key="$spawn:2:fan:1", unique_mode="always",
            result=4),
        job(5, "soak.flow", workflow_id="w", wf_name="a"),
        job(6, "soak.flow", workflow_id="w", wf_name="b", wf_deps=["a"]),
        job(7, "soak.flow", workflow_id="w", wf_name="c", wf_deps=["b"]),
        job(8, "soak.flow", "failed", workflow_id="d", wf_name="a", max_attempts=1,
            errors=[{"error": "RuntimeError: planned failure", "attempt": 1}]),
        job(9, "soak.flow", "cancelled", workflow_id="d", wf_name="b", wf_deps=["a"],
            attempt=0, started_at=None, result=None),
        job(10, "soak.flow", "cancelled", workflow_id="d", wf_name="c", wf_deps=["b"],
            attempt=0, started_at=None, result=None),
        job(11, "soak.awaiter", result={"value": {"w": 3, "pre": 1}, "attempt": 1}),
        job(12, "soak.budget", "failed", result=None, budget_usd_micros=500_000,
            spent_usd_micros=600_000, errors=[{"error": "budget_exceeded", "attempt": 1}]),
        job(13, "soak.unique", unique_key="uni:1", unique_mode="incomplete",
            inserted_at=at(0), finished_at=at(1)),
        job(14, "soak.unique", unique_key="uni:1", unique_mode="incomplete",
            inserted_at=at(2), finished_at=at(3)),
        job(15, "soak.unique", unique_key="uni:2@0", unique_mode="window"),
        job(16, "soak.cron", cron_name="soak-cron", cron_slot=T0),
        job(17, "soak.cron", cron_name="soak-cron", cron_slot=T0 + timedelta(minutes=1)),
        job(40, "soak.parallel", "failed", result=None, budget_usd_micros=500_000,
            spent_usd_micros=400_000, errors=[{"error": "budget_exceeded", "attempt": 1}]),
        # Cancelled while attempt 2 ran: it ends there (its planned failure, then the cancel).
        job(41, "soak.cancellable", "cancelled", attempt=2, result=None, errors=[
            {"error": "RuntimeError: planned failure on attempt 1", "attempt": 1},
            {"error": "RuntimeError: planned failure on attempt 2", "attempt": 2},
            {"reason": "cancel_requested", "attempt": 2}]),
        job(42, "soak.cancellable", attempt=4, result={"attempt": 4}, errors=[
            {"error": f"RuntimeError: planned failure on attempt {n}", "attempt": n}
            for n in (1, 2, 3)]),
        job(43, "soak.spawner", result={"plain": "refused", "evil": "refused",
                                        "child": "enqueued", "attempt": 1},
            meta={"$authority": {"kinds": ["soak.child"], "queues": ["children"]}}),
        job(44, "soak.child", queue="children", unique_key="thr:43", unique_mode="always",
            result=46, meta={"$authority": {"kinds": ["soak.child"], "queues": ["children"]}}),
    ]
    steps = [
        {"job_id": 1, "name": "s1", "value": 11}, {"job_id": 1, "name": "s2", "value": 12},
        {"job_id": 2, "name": "$spawn:fan", "value": [3, 4]},
        {"job_id": 11, "name": "pre", "value": 1},
        *({"job_id": 12, "name": f"b{i}", "value": i} for i in (1, 2, 3)),
        {"job_id": 40, "name": "p2", "value": 2}, {"job_id": 40, "name": "p4", "value": 4},
    ]
    effects = [
        effect(1, "s1"), effect(1, "s2"), effect(3, "child"), effect(4, "child"),
        effect(5, "a", when=1), effect(6, "b", when=2), effect(7, "c", when=3),
        effect(8, "a"), effect(11, "pre"), *(effect(12, f"b{i}") for i in (1, 2, 3)),
        effect(13, "uni"), effect(14, "uni"), effect(15, "uni"),
        effect(16, "cron"), effect(17, "cron"), effect(40, "p2"), effect(40, "p4"),
        effect(41, "run", 1), effect(41, "run", 2),
        *(effect(42, "run", n) for n in (1, 2, 3, 4)), effect(44, "child"),
    ]
    acks = [{"job_id": 1, "attempt": 1, "outcome": "retry", "tag": "w1"},
            {"job_id": 1, "attempt": 2, "outcome": "succeeded", "tag": "w2"},
            {"job_id": 11, "attempt": 1, "outcome": "await", "tag": "w1"},
            {"job_id": 11, "attempt": 1, "outcome": "succeeded", "tag": "w1"}]
    ledger = [
        {"job_id": 1, "kind": "step", "expected": {"value": 23}},
        {"job_id": 2, "kind": "parent", "expected": {"value": [2, 4]}},
        *({"job_id": i, "kind": "flow", "expected": {"wf": wf, "pos": p, "doomed": wf == "d"}}
          for i, wf, p in ((5, "w", "a"), (6, "w", "b"), (7, "w", "c"), (8, "d", "a"),
                           (9, "d", "b"), (10, "d", "c"))),
        {"job_id": 11, "kind": "awaiter", "expected": {}},
        {"job_id": 12, "kind": "budget", "expected": {}},
        {"job_id": 40, "kind": "parallel", "expected": {}},
        {"job_id": 41, "kind": "cancellable", "expected": {"cancel": True}},
        {"job_id": 42, "kind": "cancellable", "expected": {"cancel": False}},
        {"job_id": 43, "kind": "spawner", "expected": {}},
    ]
    bursts = [{"key": "uni:1", "mode": "incomplete", "ids": [13] * 4, "fresh": 1,
               "retried": False},
              {"key": "uni:2", "mode": "window", "ids": [15] * 4, "fresh": 1, "retried": False}]
    signals = [{"scope": "job:11", "name": "go", "payload": {"w": 3}}]
    cancels = [{"job_id": 41, "status": "requested", "attempt": 2}]
    return checker.Snapshot(jobs, steps, effects, acks, ledger, bursts, signals,
                            {"kills": 0, "db_restarts": 0, "proxy_cuts": 0}, cancels)


def find(snap: checker.Snapshot, job_id: int) -> dict[str, Any]:
    return next(j for j in snap.jobs if j["id"] == job_id)


def failing(snap: checker.Snapshot) -> dict[str, list[Any]]:
    return {r.name: r.offenders for r in checker.check(snap) if not r.ok}


def test_the_good_snapshot_passes_every_invariant() -> None:
    results = checker.check(good())
    assert [r.name for r in results if not r.ok] == []
    assert len(results) == 17


def _running(s: checker.Snapshot) -> None:
    find(s, 6)["state"] = "running"


def _lost(s: checker.Snapshot) -> None:
    s.jobs = [j for j in s.jobs if j["id"] != 1]


def _stale_overwrite(s: checker.Snapshot) -> None:
    find(s, 1)["result"] = {"value": 23, "attempt": 1}  # attempt 1's late ack won


def _two_terminal_acks(s: checker.Snapshot) -> None:
    s.acks.append({"job_id": 1, "attempt": 1, "outcome": "succeeded", "tag": "w1"})


def _step_value(s: checker.Snapshot) -> None:
    s.steps[0]["value"] = 99


def _step_twice(s: checker.Snapshot) -> None:
    s.steps.append({"job_id": 1, "name": "s2", "value": 12})


def _budget_fourth_step(s: checker.Snapshot) -> None:
    s.steps.append({"job_id": 12, "name": "b4", "value": 4})
    s.effects.append(effect(12, "b4", attempt=2))
    find(s, 12)["spent_usd_micros"] = 800_000


def _flow_order(s: checker.Snapshot) -> None:
    s.effects[5]["at"] = at(0.5)  # b ran before a


def _doomed_ran(s: checker.Snapshot) -> None:
    s.effects.append(effect(9, "b", when=2))


def _cron_twice(s: checker.Snapshot) -> None:
    s.jobs.append(job(18, "soak.cron", cron_name="soak-cron", cron_slot=T0))


def _cron_gap(s: checker.Snapshot) -> None:
    find(s, 17)["cron_slot"] = T0 + timedelta(minutes=2)


def _two_live_holders(s: checker.Snapshot) -> None:
    find(s, 14)["inserted_at"] = at(0.5)  # while job 13 held the key (until 1 s)


def _window_twice(s: checker.Snapshot) -> None:
    s.jobs.append(job(19, "soak.unique", unique_key="uni:2@0", unique_mode="window"))


def _extra_child(s: checker.Snapshot) -> None:
    s.jobs.append(job(20, "soak.child", parent_id=2, unique_key=None, result=6))


def _awaiter_never_ran(s: checker.Snapshot) -> None:
    find(s, 11).update(state="cancelled", result=None)


def _too_many_attempts(s: checker.Snapshot) -> None:
    find(s, 3).update(attempt=26)


def _rerun_journaled(s: checker.Snapshot) -> None:
    s.effects.append(effect(1, "s1", attempt=2))


def _claimed_while_live(s: checker.Snapshot) -> None:
    # Attempt 2 ran although attempt 1 neither ended nor lost its lease.
    find(s, 3)["attempt"] = 2
    s.effects.append(effect(3, "child", attempt=2, tag="w2"))


def _ended_twice(s: checker.Snapshot) -> None:
    find(s, 1)["errors"].append({"error": "lease_expired", "attempt": 1})


def _step_twice_in_one_attempt(s: checker.Snapshot) -> None:
    s.effects.append(effect(13, "uni", when=0.3))


def _two_executors(s: checker.Snapshot) -> None:
    s.effects[1]["tag"] = "w2"  # job 1's attempt 1 ran s1 on w1 and s2 on w2


def _reclaimed_and_acked(s: checker.Snapshot) -> None:
    find(s, 1)["errors"] = [{"error": "lease_expired", "attempt": 1}]


def _success_ran_again(s: checker.Snapshot) -> None:
    s.acks.insert(0, {"job_id": 1, "attempt": 1, "outcome": "succeeded", "tag": "w1"})


def _systemic_duplicates(s: checker.Snapshot) -> None:
    s.effects += [effect(11, "pre") for _ in range(11)]


def _parallel_overspent(s: checker.Snapshot) -> None:
    find(s, 40)["spent_usd_micros"] = 800_000
    s.steps += [{"job_id": 40, "name": "p1", "value": 1}, {"job_id": 40, "name": "p3",
                                                           "value": 3}]


def _parallel_succeeded(s: checker.Snapshot) -> None:
    find(s, 40).update(state="succeeded", result={"attempt": 1}, errors=[])


def _attempt_after_cancel(s: checker.Snapshot) -> None:
    s.effects.append(effect(41, "run", 3))
    find(s, 41).update(attempt=3, state="succeeded", result={"attempt": 3})


def _cancel_lost(s: checker.Snapshot) -> None:
    find(s, 41).update(state="failed")


def _thread_unbounded(s: checker.Snapshot) -> None:
    s.jobs.append(job(45, "soak.evil", meta={}))


def _thread_lost_authority(s: checker.Snapshot) -> None:
    find(s, 44)["meta"] = {}


BREAKS: list[tuple[str, Callable[[checker.Snapshot], None], Any]] = [
    ("all-terminal", _running, 6),
    ("no-lost-jobs", _lost, 1),
    ("stale-acks-fenced", _stale_overwrite, 1),
    ("stale-acks-fenced", _two_terminal_acks, 1),
    ("steps-exact", _step_value, 1),
    ("steps-exact", _step_twice, 1),
    ("budget", _budget_fourth_step, 12),
    ("workflows", _flow_order, 6),
    ("workflows", _doomed_ran, 9),
    ("cron-once", _cron_twice, 18),
    ("cron-once", _cron_gap, 17),
    ("unique-keys", _two_live_holders, 14),
    ("unique-keys", _window_twice, 19),
    ("children-exact", _extra_child, 2),
    ("awaiters-ran", _awaiter_never_ran, 11),
    ("attempts-bounded", _too_many_attempts, 3),
    ("memoized-steps-stay-run", _rerun_journaled, 1),
    ("no-double-runs", _claimed_while_live, 3),
    ("no-double-runs", _ended_twice, 1),
    ("no-double-runs", _step_twice_in_one_attempt, 13),
    ("no-double-runs", _two_executors, 1),
    ("no-double-runs", _reclaimed_and_acked, 1),
    ("no-double-runs", _success_ran_again, 1),
    ("duplicates-bounded", _systemic_duplicates, "all"),
    ("parallel-steps-under-cap", _parallel_overspent, 40),
    ("parallel-steps-under-cap", _parallel_succeeded, 40),
    ("cancel-ends-attempts", _attempt_after_cancel, 41),
    ("cancel-ends-attempts", _cancel_lost, 41),
    ("authority-in-threads", _thread_unbounded, 45),
    ("authority-in-threads", _thread_lost_authority, 43),
]


@pytest.mark.parametrize(("invariant", "breaker", "offender"), BREAKS,
                         ids=[b.__name__.strip("_") for _, b, _ in BREAKS])
def test_each_broken_invariant_is_caught(
    invariant: str, breaker: Callable[[checker.Snapshot], None], offender: Any
) -> None:
    snap = copy.deepcopy(good())
    breaker(snap)
    failed = failing(snap)
    assert invariant in failed, failed
    assert offender in failed[invariant]


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([None, *range(len(BREAKS))]))
def test_the_verdict_does_not_depend_on_row_order(rng: Any, which: int | None) -> None:
    snap = copy.deepcopy(good())
    if which is not None:
        BREAKS[which][1](snap)
    before = {r.name: sorted(map(str, r.offenders)) for r in checker.check(snap)}
    for rows in (snap.jobs, snap.steps, snap.effects, snap.acks, snap.ledger, snap.bursts,
                 snap.signals, snap.cancels):
        rng.shuffle(rows)
    after = {r.name: sorted(map(str, r.offenders)) for r in checker.check(snap)}
    assert after == before


def test_duplicate_allowance_grows_with_the_chaos() -> None:
    quiet = checker.duplicate_allowance({})
    assert checker.duplicate_allowance({"kills": 10}) > quiet
    assert checker.duplicate_allowance({"db_restarts": 1, "workers": 3,
                                        "slots_per_worker": 16}) == quiet + 48


@pytest.mark.timeout(180)
def test_the_private_server_crashes_and_the_proxy_cuts() -> None:
    server = Server()
    server.init()
    server.start()
    proxy = Proxy(server.port).start()
    via = psycopg.conninfo.make_conninfo(server.url, port=proxy.port, connect_timeout=3)
    try:
        with psycopg.connect(via, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            proxy.cut()
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(via).close()  # refused while cut
        proxy.heal()
        with psycopg.connect(via, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n int)")
            conn.execute("INSERT INTO kept VALUES (7)")
            server.crash_restart(down=0.1)
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        with psycopg.connect(server.url, autocommit=True) as conn:
            # Crash recovery kept the committed row.
            assert conn.execute("SELECT n FROM kept").fetchone() == (7,)
        assert (proxy.cuts, server.restarts) == (1, 1)
    finally:
        proxy.close()
        server.cleanup()


def test_the_pooler_options() -> None:
    if find_binary() is None:
        with pytest.raises(SystemExit):
            parse(["--pooler"])
        pytest.skip("needs PgBouncer (Debian/Ubuntu: apt install pgbouncer)")
    opts = parse(["--pooler", "--min-pooler-restarts", "2", "--min-kills", "3"])
    assert (opts.pooler, opts.pooler_restart_every) == (True, 45.0)
    assert opts.min_chaos == {"kills": 3, "pooler_restarts": 2}
    assert parse(["--pooler", "--pooler-restart-every", "9"]).pooler_restart_every == 9.0
    assert not parse([]).pooler
    for alone in (["--min-pooler-restarts", "1"], ["--pooler-restart-every", "9"]):
        with pytest.raises(SystemExit):
            parse(alone)


@pytest.mark.timeout(180)
def test_the_pooler_route_survives_its_restarts_and_a_database_crash(tmp_path: Path) -> None:
    """The soak's routes with --pooler: every worker through the PgBouncer (the
    first through the cuttable proxy in front of it), some with a direct URL
    for LISTEN; the PgBouncer killed and started again, PostgreSQL crashed
    under it — and it reconnects by itself."""
    if find_binary() is None:
        pytest.skip("needs PgBouncer (Debian/Ubuntu: apt install pgbouncer)")
    driver = Driver(parse(["--pooler", "--logs", str(tmp_path)]))
    server = driver.server
    try:
        server.init()
        server.start()
        bouncer = driver.bouncer = PgBouncer(server.url, pool_size=4).start()
        proxy = driver.proxy = Proxy(bouncer.port).start()
        proxied, listening, polling = (driver.worker("w1p", proxied=True),
                                       driver.worker("w2", listen=True), driver.worker("w3"))
        assert proxied.command()[-2:] == ["--pooler", "transaction"]
        assert listening.command()[-4:] == ["--pooler", "transaction", "--direct-url",
                                            server.url]
        assert polling.command()[-2:] == ["--pooler", "transaction"]
        finishers = [driver.worker("f1", listen=True, cron=False).command(),
                     driver.worker("f2", cron=False).command()]
        assert [f[5:] for f in finishers] == [
            ["--no-cron", "--pooler", "transaction", "--direct-url", server.url],
            ["--no-cron", "--pooler", "transaction"]]

        def port_behind(url: str) -> int:
            with psycopg.connect(url, autocommit=True, prepare_threshold=None,
                                 connect_timeout=3) as conn:
                found = conn.execute("SELECT current_setting('port')::int").fetchone()
                assert found is not None
                return int(found[0])

        assert {port_behind(w.url) for w in (proxied, listening, polling)} == {server.port}
        assert psycopg.conninfo.conninfo_to_dict(proxied.url)["port"] == str(proxy.port)
        assert psycopg.conninfo.conninfo_to_dict(polling.url)["port"] == str(bouncer.port)
        with psycopg.connect(polling.url, autocommit=True, prepare_threshold=None) as conn:
            bouncer.kill()
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        driver.start_bouncer()
        assert port_behind(proxied.url) == server.port
        server.crash_restart(down=0.2)
        deadline = time.monotonic() + 40  # PgBouncer's server_login_retry is 15 s
        while True:
            try:
                assert port_behind(polling.url) == server.port
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert bouncer.running
    finally:
        driver.teardown()


# -- The real engine, its fence broken on purpose -------------------------------------


def _zombie_run(db_url: str) -> checker.Snapshot:
    """Attempt 1 of a job loses its lease while it runs; attempt 2 is claimed and
    runs; then attempt 1 — a zombie — finishes first and acks."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(SOAK_TABLES)
    registry = belay.Registry()
    gates = {1: threading.Event(), 2: threading.Event()}
    started = {1: threading.Event(), 2: threading.Event()}

    @belay.worker(name="soak.zombie", registry=registry)
    def zombie(ctx: belay.Context) -> dict[str, int]:
        started[ctx.attempt].set()
        gates[ctx.attempt].wait(30)
        return {"attempt": ctx.attempt}

    client = belay.Belay(db_url, registry=registry)
    ended: list[belay.JobEnd] = []
    done = threading.Condition()
    # A long lease: the heartbeat stays away, so only the database fence can stop
    # the zombie's ack.
    worker = belay.Worker(["default"], client=client, registry=registry, lease_ttl=60,
                          sweep_interval=0.1, poll_interval=0.05)
    recorder = AckRecorder(db_url, "w1")

    @worker.on_job_end
    def record(end: belay.JobEnd) -> None:
        recorder(end)
        with done:
            ended.append(end)
            done.notify_all()

    job_id = client.enqueue(zombie).id
    with worker:
        assert started[1].wait(10)
        with psycopg.connect(db_url, autocommit=True) as conn:
            # The lease lapses (as behind a cut proxy): the sweeper reclaims it.
            conn.execute("UPDATE belay_jobs SET lease_until = %s WHERE id = %s",
                         (datetime.now(timezone.utc) - timedelta(seconds=1), job_id))
        assert started[2].wait(10)
        gates[1].set()
        with done:
            assert done.wait_for(lambda: len(ended) == 1, 10)
        gates[2].set()
        with done:
            assert done.wait_for(lambda: len(ended) == 2, 10)
    client.close()
    recorder.close()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO soak_ledger (job_id, kind, expected) VALUES (%s, 'zombie', "
                     "'{}')", (job_id,))
        return checker.load(conn)


def _fence(snap: checker.Snapshot) -> checker.Invariant:
    return next(r for r in checker.check(snap) if r.name == "stale-acks-fenced")


def test_the_fence_rejects_a_zombies_ack(db_url: str) -> None:
    snap = _zombie_run(db_url)
    assert [(a["attempt"], a["outcome"]) for a in snap.acks] == [(1, "stale"), (2, "succeeded")]
    assert _fence(snap).ok


def test_an_unfenced_ack_is_caught(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "ack", store.ack)  # restored after the test
    monkeypatch.setattr(store, "ack_succeeded_many", store.ack_succeeded_many)
    apply_break("fence")
    snap = _zombie_run(db_url)
    assert [(a["attempt"], a["outcome"]) for a in snap.acks] == [
        (1, "succeeded"), (2, "stale")]
    fence = _fence(snap)
    assert not fence.ok
    assert "result from attempt 1" in " ".join(fence.notes)
    # Attempt 1 was reclaimed (lease_expired) and its own ack landed too: it ran twice.
    [double] = [r for r in checker.check(snap) if r.name == "no-double-runs"]
    assert "reclaimed (lease expired) and its executor's succeeded ack applied" in " ".join(
        double.notes)


# -- A short soak with two rules broken in its workers ----------------------------------


@pytest.fixture
def soak_logs(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@pytest.mark.timeout(400)
def test_a_soak_with_broken_workers_fails(soak_logs: Path) -> None:
    report = soak_logs / "REPORT.md"
    env = dict(os.environ, SOAK_BREAK="budget,steps")
    env.pop("BELAY_TEST_DATABASE_URL", None)
    run = subprocess.run(
        [sys.executable, "-m", "soak", "--duration", "25", "--workers", "2", "--seed", "7",
         "--cut-every", "12", "--report", str(report), "--logs", str(soak_logs / "logs")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=380,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    text = report.read_text()
    assert "## Verdict: **FAIL**" in text
    assert "- ✗ **budget**" in text
    assert "recorded 5 steps" in text
    assert "- ✗ **memoized-steps-stay-run**" in text
    assert "- ✓ **all-terminal**" in text


def test_a_parallel_job_whose_run_lost_its_lease_is_not_held_to_the_cap() -> None:
    """A zombie journals the steps it had started (the at-least-once window):
    the job can then be over the cap, and the checker says so without failing."""
    snap = copy.deepcopy(good())
    find(snap, 40).update(attempt=2, spent_usd_micros=600_000, errors=[
        {"error": "lease_expired", "at": "2026-03-01T12:00:05+00:00", "attempt": 1},
        {"error": "budget_exceeded", "attempt": 2}])
    snap.steps.append({"job_id": 40, "name": "p1", "value": 1})
    results = {r.name: r for r in checker.check(snap)}
    assert results["parallel-steps-under-cap"].ok
    assert "a run lost its lease" in results["parallel-steps-under-cap"].notes[0]
