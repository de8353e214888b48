"""Batched acks (docs/contract.md §7, where belay differs): many successes in one
statement, each row fenced on its own claimed attempt, equal to N single acks.

Jobs whose terminal write settles nothing (no workflow, no parent) are
batched in one statement; a batch with workflow members or children is one
transaction that also settles each workflow and tells each parent. A
running worker acks its executors' successes in batches written by the
executor threads themselves (flat combining); ``stop()`` acks whatever is
pending before the pool closes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import belay
from belay import names, store
from belay.context import Execution
from belay.job import Job
from tests.helpers import START, Ends, insert_job, job_row, running_job
from tests.test_worker import make_worker, running

COMPARED = ("state", "result", "finished_at", "lease_until", "leased_by", "attempt", "errors")


def _claimed(conn: Any, job_id: int) -> Job:
    return Job.from_row(job_row(conn, job_id))


def test_a_batch_equals_single_acks_and_skips_every_stale_attempt(sql_conn) -> None:
    live = [running_job(sql_conn) for _ in range(3)]
    twins = [running_job(sql_conn) for _ in range(3)]
    stale_rows = [
        {"state": "running", "attempt": 2, "leased_by": "other"},  # claimed again
        {"state": "ready", "attempt": 1, "lease_until": None, "leased_by": None},  # reclaimed
        {"state": "succeeded", "attempt": 1, "lease_until": None, "leased_by": None},
    ]
    stale = [running_job(sql_conn, **row) for row in stale_rows]
    before = {job_id: job_row(sql_conn, job_id) for job_id in stale}
    # The attempt each stale ack was claimed under: 1, now superseded.
    stale_claims = [_claimed(sql_conn, i).replace(attempt=1, state="running") for i in stale]
    results = [b'{"n":1}', None, b'"x"']
    acks = [(_claimed(sql_conn, i), r) for i, r in zip(live, results, strict=True)]
    acks += [(job, b'{"stale":true}') for job in stale_claims]

    assert store.ack_succeeded_many(sql_conn, acks, START) == set(live)

    for twin, result in zip(twins, results, strict=True):
        with sql_conn.transaction():
            assert store.ack(sql_conn, _claimed(sql_conn, twin), "succeeded", START,
                             result=result) is not None
    for one, twin in zip(live, twins, strict=True):
        batched, single = job_row(sql_conn, one), job_row(sql_conn, twin)
        assert {c: batched[c] for c in COMPARED} == {c: single[c] for c in COMPARED}
        assert batched["state"] == "succeeded"
    for job_id in stale:
        assert job_row(sql_conn, job_id) == before[job_id]


def test_a_batch_announces_each_result_it_wrote_and_no_other(sql_conn, notes) -> None:
    live = [running_job(sql_conn) for _ in range(2)]
    stale = running_job(sql_conn, attempt=2, leased_by="other")
    acks = [(_claimed(sql_conn, i), None) for i in live]
    acks.append((_claimed(sql_conn, stale).replace(attempt=1), None))

    assert store.ack_succeeded_many(sql_conn, acks, START, notes.channel) == set(live)

    assert sorted(notes.received(), key=lambda n: n["id"]) == [
        {"t": "r", "id": job_id} for job_id in sorted(live)]
    # Without a channel, nothing is announced.
    other = running_job(sql_conn)
    assert store.ack_succeeded_many(sql_conn, [(_claimed(sql_conn, other), None)],
                                    START) == {other}
    assert notes.received() == []


class _Batches:
    """Records the batches a worker's acker sends (sizes and job ids)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.sizes: list[int] = []
        self.ids: set[int] = set()
        real = store.ack_succeeded_many

        def recording(conn: Any, acks: Sequence[tuple[Job, bytes | None]], *args: Any,
                      **kwargs: Any) -> set[int]:
            self.sizes.append(len(acks))
            self.ids.update(job.id for job, _ in acks)
            return real(conn, acks, *args, **kwargs)

        monkeypatch.setattr(store, "ack_succeeded_many", recording)


def test_a_running_worker_acks_successes_in_batches(client, sql_conn, monkeypatch) -> None:
    batches = _Batches(monkeypatch)
    reg = belay.Registry()
    gate = threading.Event()

    @belay.worker(name="gated", registry=reg)
    def gated(ctx: belay.Context) -> Any:
        # All 20 slots fill before any function returns, so successes pile up.
        gate.wait(10)
        return {"n": ctx.input["n"]}

    worker = make_worker(client, reg, {"default": 20})
    ends = Ends(worker)
    jobs = client.enqueue_many([{"kind": gated, "input": {"n": n}} for n in range(200)])
    with running(worker):
        threading.Timer(0.3, gate.set).start()
        ends.wait_for(200)
    assert {e.outcome for e in ends.events} == {"succeeded"}
    assert sum(batches.sizes) == 200
    assert batches.ids == {job.id for job in jobs}
    assert max(batches.sizes) > 1  # fewer statements than jobs
    for job in jobs[:5]:
        assert client.get_job(job.id).result == {"n": job.input["n"]}


def test_workflow_members_and_children_are_batched_with_settlement(
    client, monkeypatch
) -> None:
    batches = _Batches(monkeypatch)
    reg = belay.Registry()

    @belay.worker(name="plain", registry=reg)
    def plain(ctx: belay.Context) -> Any:
        return "done"

    @belay.worker(name="parent", registry=reg)
    def parent(ctx: belay.Context) -> Any:
        results = ctx.map_children("kids", "plain", [{"i": 1}, {"i": 2}])
        return len(results)

    flow = belay.Workflow("batch-flow").add("a", "plain").add("b", "plain", deps=["a"])
    members = client.enqueue_workflow(flow)
    boss = client.enqueue("parent")
    worker = make_worker(client, reg)
    with running(worker):
        assert client.await_result(boss.id, timeout=10) == 2
        for member in members.values():
            assert client.await_result(member.id, timeout=10) == "done"
    children = client.list_jobs(parent_id=boss.id)
    assert len(children) == 2
    # Each success went through the acker, and each settled what it had to:
    # b ran after a, the parent woke for its children's results.
    settling = {m.id for m in members.values()} | {c.id for c in children}
    assert settling | {boss.id} <= batches.ids


def _settling_scenario(conn: Any, tag: str) -> dict[str, int]:
    """Two workflows and two parents, each with running jobs whose successes
    settle something: held members wait on them, parents await $children."""
    ids: dict[str, int] = {}
    for w in ("w1", "w2"):
        flow = f"{tag}-{w}"
        for name in ("a", "b"):
            ids[f"{w}.{name}"] = running_job(conn, workflow_id=flow, wf_name=name)
        ids[f"{w}.c"] = insert_job(conn, state="held", workflow_id=flow, wf_name="c",
                                   wf_deps=["a"])
        ids[f"{w}.d"] = insert_job(conn, state="held", workflow_id=flow, wf_name="d",
                                   wf_deps=["a", "b"])
    for p in ("p1", "p2"):
        ids[p] = insert_job(conn, state="awaiting", await_name=names.CHILDREN)
        conn.execute("UPDATE belay_jobs SET await_scope = %s WHERE id = %s",
                     (names.job_scope(ids[p]), ids[p]))
        for k in ("k1", "k2"):
            ids[f"{p}.{k}"] = running_job(conn, parent_id=ids[p])
    return ids


def _picture(conn: Any, ids: dict[str, int]) -> dict[str, Any]:
    rows = {label: job_row(conn, job_id) for label, job_id in ids.items()}
    signals = {scope: name for scope, name in conn.execute(
        "SELECT scope, name FROM belay_signals WHERE scope = ANY(%s)",
        ([names.job_scope(ids[p]) for p in ("p1", "p2")],)).fetchall()}
    return {
        "rows": {label: {c: row[c] for c in (*COMPARED, "ready_at", "await_scope")}
                 for label, row in rows.items()},
        "signalled": sorted(label for label in ("p1", "p2")
                            if signals.get(names.job_scope(ids[label])) == names.CHILDREN),
    }


def test_a_settling_batch_equals_single_acks(sql_conn) -> None:
    """Members of two workflows and children of two parents in one batch
    leave every row and signal as single acks (each with its settlement) do."""
    batched, single = _settling_scenario(sql_conn, "batch"), _settling_scenario(sql_conn, "one")
    finishing = [label for label in batched if label.count(".") == 1
                 and label.split(".")[1] in ("a", "b", "k1", "k2")]
    acks = [(_claimed(sql_conn, batched[label]), b'"ok"') for label in finishing]
    with sql_conn.transaction():
        acked, settled = store.ack_succeeded_settling(sql_conn, acks, START)
    assert acked == {batched[label] for label in finishing}
    for label in finishing:
        with sql_conn.transaction():
            assert store.ack(sql_conn, _claimed(sql_conn, single[label]), "succeeded", START,
                             result=b'"ok"') is not None

    assert _picture(sql_conn, batched) == _picture(sql_conn, single)
    after = _picture(sql_conn, batched)
    assert {label for label, row in after["rows"].items() if row["state"] == "ready"} == {
        "w1.c", "w1.d", "w2.c", "w2.d", "p1", "p2"}
    assert after["signalled"] == ["p1", "p2"]
    assert sorted(settled.ready) == sorted(
        (batched[label], "default") for label in ("w1.c", "w1.d", "w2.c", "w2.d", "p1", "p2"))


def test_racing_settling_batches_neither_deadlock_nor_lose_a_release(direct_url) -> None:
    """Two threads ack, in batches, the members of the same workflows in
    opposite orders (the locks are taken sorted): every workflow settles."""
    import psycopg

    flows = 20
    with psycopg.connect(direct_url, autocommit=True) as setup:
        members = {f: [running_job(setup, workflow_id=f"race-{f}", wf_name=n) for n in "ab"]
                   for f in range(flows)}
        held = [insert_job(setup, state="held", workflow_id=f"race-{f}", wf_name="c",
                           wf_deps=["a", "b"]) for f in range(flows)]
        claims = {f: [_claimed(setup, i) for i in ids] for f, ids in members.items()}
    gate = threading.Barrier(2)
    errors: list[BaseException] = []

    def acker(which: int) -> None:
        try:
            with psycopg.connect(direct_url, autocommit=True) as conn:
                order = list(range(flows)) if which == 0 else list(reversed(range(flows)))
                gate.wait()
                for start in range(0, flows, 5):
                    batch = [(claims[f][which], None) for f in order[start:start + 5]]
                    with conn.transaction():
                        store.ack_succeeded_settling(conn, batch, START)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=acker, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with psycopg.connect(direct_url, autocommit=True) as check:
        assert [job_row(check, i)["state"] for i in held] == ["ready"] * flows


def test_a_stale_batched_ack_is_discarded_and_reported(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="robbed", registry=reg)
    def robbed(ctx: belay.Context) -> Any:
        # Meanwhile the job was reclaimed and claimed again elsewhere.
        sql_conn.execute("UPDATE belay_jobs SET attempt = attempt + 1, leased_by = 'thief' "
                         "WHERE id = %s", (ctx.id,))
        return "mine"

    worker = make_worker(client, reg)
    ends = Ends(worker)
    job = client.enqueue(robbed)
    with running(worker):
        (event,) = ends.wait_for(1)
    assert event.outcome == "stale"
    row = job_row(sql_conn, job.id)
    assert (row["state"], row["leased_by"], row["result"]) == ("running", "thief", None)


def test_stop_acks_every_success_still_pending(client, sql_conn) -> None:
    reg = belay.Registry()
    returned: list[int] = []
    lock = threading.Lock()
    enough = threading.Event()

    @belay.worker(name="quick", registry=reg)
    def quick(ctx: belay.Context) -> Any:
        with lock:
            returned.append(ctx.id)
            if len(returned) >= 150:
                enough.set()
        return None

    worker = make_worker(client, reg, {"default": 30})
    client.enqueue_many([{"kind": quick} for _ in range(600)])
    worker.start()
    assert enough.wait(15)
    worker.stop()
    with lock:
        ran = set(returned)
    states = dict(sql_conn.execute(
        "SELECT id, state FROM belay_jobs WHERE state <> 'ready'").fetchall())
    # Every function that returned was acked before the pool closed; none is
    # left running for a lease to lapse.
    assert {i for i, s in states.items() if s == "succeeded"} == ran
    assert "running" not in states.values()


def test_drain_acks_before_it_returns(client, sql_conn) -> None:
    """Off the executor threads (drain, direct calls) a success is acked at once."""
    reg = belay.Registry()
    belay.worker(name="drained", registry=reg)(lambda ctx: 7)
    jobs = client.enqueue_many([{"kind": "drained"} for _ in range(5)])
    worker = make_worker(client, reg)
    assert worker.drain() == {"succeeded": 5}
    for job in jobs:
        assert job_row(sql_conn, job.id)["state"] == "succeeded"


def test_a_slot_stays_taken_until_its_ack_lands(client, sql_conn, monkeypatch) -> None:
    """Backpressure: while the acker is held up, a queue claims no more than its
    limit — done-but-unacked jobs keep their slots, so claims can't run ahead
    of acks (and pile up claimed rows in memory)."""
    real = store.ack_succeeded_many
    held = threading.Event()
    gate = threading.Event()

    def slow_ack(conn: Any, acks: Any, *args: Any, **kwargs: Any) -> set[int]:
        held.set()
        assert gate.wait(15)
        return real(conn, acks, *args, **kwargs)

    monkeypatch.setattr(store, "ack_succeeded_many", slow_ack)
    reg = belay.Registry()
    lock = threading.Lock()
    started: list[int] = []
    sixth = threading.Event()

    @belay.worker(name="pressed", registry=reg)
    def pressed(ctx: belay.Context) -> Any:
        with lock:
            started.append(ctx.id)
            if len(started) > 5:
                sixth.set()
        return None

    worker = make_worker(client, reg, {"default": 5})
    ends = Ends(worker)
    client.enqueue_many([{"kind": pressed} for _ in range(20)])
    with running(worker):
        assert held.wait(10)
        # The first five ran; their acks wait; no sixth job may start meanwhile
        # (a window of many busy polls: the producer is not starved of chances).
        assert not sixth.wait(0.5), started
        assert sql_conn.execute("SELECT count(*) FROM belay_jobs WHERE state = 'running'"
                                ).fetchone() == (5,)
        gate.set()
        ends.wait_for(20)
    assert {e.outcome for e in ends.events} == {"succeeded"}
    assert len(started) == 20


def test_a_direct_execute_on_a_started_worker_acks_before_it_returns(
    client, sql_conn, monkeypatch
) -> None:
    """Only executor threads hand successes to the acker: a caller running an
    execution itself (tests, scripts) finds it acked when ``execute`` returns,
    even while the acker is held up."""
    gate = threading.Event()
    real = store.ack_succeeded_many

    def held(conn: Any, acks: Any, *args: Any, **kwargs: Any) -> set[int]:
        assert gate.wait(15)
        return real(conn, acks, *args, **kwargs)

    monkeypatch.setattr(store, "ack_succeeded_many", held)
    reg = belay.Registry()
    definition = belay.worker(name="direct", registry=reg)(lambda ctx: "mine")
    worker = make_worker(client, reg, {"elsewhere": 1})  # its producer never sees the job
    job = client.enqueue("direct")
    with running(worker):
        (claimed,) = store.claim(sql_conn, "default", 1, "test-node", START,
                                 START + timedelta(seconds=30))
        try:
            assert worker.execute(Execution(claimed, definition, None)) == "succeeded"
            row = job_row(sql_conn, job.id)
        finally:
            gate.set()
    assert row["state"] == "succeeded"
