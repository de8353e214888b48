"""Declared workflows: the ``belay.Workflow`` builder and ``enqueue_workflow`` (contract
§8.3 held members and settlement, §8.6 retry re-hold, §7 settlement after every terminal
write and the workflow-lock-first order).

Builder checks are pure. Everything else runs on a real PostgreSQL: members are enqueued
through the builder and run by a real ``belay.Worker`` (threads) or ``drain``; each run
records the states its dependencies had when it started, read from the database.
"""

from __future__ import annotations

import graphlib
import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import belay
from belay import store
from belay.settle import Member, settle
from belay.testing import drain
from belay.workflow import find_cycle
from tests.helpers import START, advisory_waiters, count_jobs, job_row, wait_until

PROPERTY = settings(database=None, max_examples=300, deadline=None)
TERMINAL = ("succeeded", "failed", "cancelled")


# -- helpers -------------------------------------------------------------------------------


class Runs:
    """What each execution saw: its member name, thread, and its deps' states at start."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []

    def record(self, ctx: belay.Context) -> None:
        job = ctx.job
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            deps = dict(conn.execute(
                "SELECT wf_name, state FROM belay_jobs WHERE workflow_id = %s "
                "AND wf_name = ANY(%s)", (job.workflow_id, job.wf_deps)).fetchall())
        with self.lock:
            self.log.append({"wf": job.workflow_id, "name": job.wf_name, "deps": deps,
                             "thread": threading.get_ident(), "attempt": ctx.attempt})

    def names(self, workflow_id: str | None = None) -> list[str]:
        with self.lock:
            return [r["name"] for r in self.log if workflow_id in (None, r["wf"])]


@pytest.fixture
def runs(db_url: str) -> Runs:
    return Runs(db_url)


@pytest.fixture
def barriers() -> dict[str, threading.Barrier]:
    """Named meeting points for members that must be running at the same time."""
    return {}


@pytest.fixture
def reg(runs: Runs, barriers: dict[str, threading.Barrier]) -> belay.Registry:
    registry = belay.Registry()

    @belay.worker(name="wf.step", registry=registry)
    def step(ctx: belay.Context) -> Any:
        """input: do=fail (raise while attempt < until), do=cancel, meet=<barrier name>."""
        runs.record(ctx)
        do = ctx.input.get("do")
        if do == "fail" and ctx.attempt < ctx.input.get("until", 1_000):
            raise RuntimeError(f"{ctx.job.wf_name} fails on purpose")
        if do == "cancel":
            raise belay.Cancel(f"{ctx.job.wf_name} gives up")
        if "meet" in ctx.input:
            barriers[ctx.input["meet"]].wait(10)
        return ctx.job.wf_name

    @belay.worker(name="wf.unique", registry=registry, unique="always-the-same")
    def unique(ctx: belay.Context) -> Any:
        return "unique"

    return registry


@pytest.fixture
def wclient(db_url: str, clock: belay.ManualClock, reg: belay.Registry) -> Iterator[belay.Belay]:
    """A client whose registry knows the test workers (string kinds get their defaults)."""
    with belay.Belay(db_url, clock=clock, registry=reg) as instance:
        yield instance


def run_all(client: belay.Belay, reg: belay.Registry) -> dict[str, int]:
    return drain(client=client, registry=reg)


def states(client: belay.Belay, workflow_id: str) -> dict[str, str]:
    return {name: job.state for name, job in client.workflow_status(workflow_id).by_name().items()}


def threaded_worker(client: belay.Belay, reg: belay.Registry, slots: int) -> belay.Worker:
    return belay.Worker({"default": slots}, client=client, registry=reg, poll_interval=0.05,
                        busy_poll=0.01, sweep_interval=3600.0, shutdown_grace=5.0)


def wait_done(client: belay.Belay, *workflow_ids: str) -> None:
    # A workflow's end is many rows' states: no single event announces it.
    wait_until(lambda: all(client.workflow_status(w).done for w in workflow_ids),
               "every workflow member is terminal", timeout=20)


# -- The builder (pure) -----------------------------------------------------------------------


def test_workflow_id_is_the_name_plus_a_random_hex_unless_given() -> None:
    first, second = belay.Workflow("nightly"), belay.Workflow("nightly")
    prefix, _, tail = first.workflow_id.rpartition("-")
    assert prefix == "nightly" and len(tail) == 32 and int(tail, 16) >= 0
    assert first.workflow_id != second.workflow_id
    assert belay.Workflow("nightly", workflow_id="nightly-2026-11-29").workflow_id == (
        "nightly-2026-11-29")


def test_add_chains_and_keeps_the_declaration_order() -> None:
    wf = belay.Workflow("w")
    assert wf.add("b", "k", deps=["a"]) is wf  # a dep added later is fine
    wf.add("a", "k")
    assert [m.name for m in wf.members] == ["b", "a"] and len(wf) == 2 and "a" in wf
    wf.validate()


def test_specs_hold_dep_bearing_members_and_resolve_ignore() -> None:
    wf = (belay.Workflow("w", workflow_id="w-1", ignore=["failed"])
          .add("a", "k", {"x": 1}, queue="q", priority=3)
          .add("b", "k", deps=["a"])
          .add("c", "k", deps=["a", "b"], ignore=["cancelled"])
          .add("d", "k", deps=["a"], ignore=[]))
    internal = {name: dict(spec.internal) for name, spec in wf.specs()}
    assert {n: (i["state"], tuple(i["wf_deps"]), tuple(i["wf_ignore"]))
            for n, i in internal.items()} == {
        "a": ("ready", (), ("failed",)),
        "b": ("held", ("a",), ("failed",)),
        "c": ("held", ("a", "b"), ("cancelled",)),
        "d": ("held", ("a",), ()),
    }
    assert {i["workflow_id"] for i in internal.values()} == {"w-1"}


def refused(make: Any) -> str:
    with pytest.raises(belay.ValidationError) as info:
        make()
    return str(info.value)


def test_duplicate_member_names_are_refused_at_add() -> None:
    wf = belay.Workflow("nightly").add("extract", "k")
    assert refused(lambda: wf.add("extract", "k")) == (
        "workflow 'nightly' already has a member named 'extract'; give each member its own name")


@pytest.mark.parametrize("name", ["", "   ", 7, None, b"a"])
def test_member_names_must_be_non_empty_strings(name: Any) -> None:
    assert refused(lambda: belay.Workflow("w").add(name, "k")) == (
        f"a workflow member name is a non-empty string like 'extract', got {name!r}")


@pytest.mark.parametrize("name", ["", " ", None, 3])
def test_workflow_names_and_ids_must_be_non_empty_strings(name: Any) -> None:
    assert refused(lambda: belay.Workflow(name)) == (
        f"a workflow name is a non-empty string like 'nightly', got {name!r}")
    if name is not None:  # workflow_id=None means: generate one
        assert refused(lambda: belay.Workflow("w", workflow_id=name)) == (
            f"workflow_id must be a non-empty string like 'nightly-2026-11-29', got {name!r}")


def test_unknown_dep_names_are_refused_naming_the_members() -> None:
    wf = belay.Workflow("nightly").add("extract", "k").add("report", "k", deps=["transfrom"])
    assert refused(wf.validate) == (
        "workflow member 'report' depends on 'transfrom', not a member of workflow 'nightly' "
        "(members: extract, report); add it or fix the name")


def test_a_member_depending_on_itself_is_refused() -> None:
    wf = belay.Workflow("w").add("a", "k", deps=["a"])
    assert refused(wf.validate) == (
        "workflow member 'a' lists itself in its deps; a member can't wait for itself")


def test_a_cycle_is_refused_naming_its_path() -> None:
    wf = belay.Workflow("w").add("a", "k", deps=["b"]).add("b", "k", deps=["a"])
    assert refused(wf.validate) == (
        "workflow 'w' has a dependency cycle: a → b → a (each depends on the next, so none of "
        "them could ever run); remove one of these deps")
    longer = (belay.Workflow("w").add("root", "k").add("x", "k", deps=["root", "z"])
              .add("y", "k", deps=["x"]).add("z", "k", deps=["y"]))
    assert "cycle: x → z → y → x " in refused(longer.validate)


def test_an_empty_workflow_is_refused() -> None:
    assert refused(belay.Workflow("w").validate) == (
        "workflow 'w' has no members; add some with .add(name, worker, input)")


@pytest.mark.parametrize("ignore", [["failed", "succeeded"], ["FAILED"], [None]])
def test_ignore_takes_only_failed_and_cancelled(ignore: list[Any]) -> None:
    wrong = ", ".join(repr(v) for v in ignore if v not in ("failed", "cancelled"))
    tail = ("ignore takes 'failed' and/or 'cancelled' (the dependency outcomes to run after "
            f"anyway), got {wrong}")
    assert refused(lambda: belay.Workflow("w").add("a", "k", ignore=ignore)) == (
        f"workflow member 'a': {tail}")
    assert refused(lambda: belay.Workflow("w", ignore=ignore)) == f"workflow 'w': {tail}"


def test_ignore_and_deps_must_be_lists_not_one_string() -> None:
    assert refused(lambda: belay.Workflow("w", ignore="failed")) == (
        "workflow 'w': ignore is a list like ignore=['failed'], got 'failed'")
    assert refused(lambda: belay.Workflow("w").add("b", "k", deps="a")) == (
        "workflow member 'b': deps is a list of member names like deps=['extract'], got 'a'")
    assert refused(lambda: belay.Workflow("w").add("b", "k", deps=["a", ""])) == (
        "workflow member 'b': each dep is a member name (a non-empty string), got ''")
    assert refused(lambda: belay.Workflow("w").add("b", "k", deps=["a", "a"])) == (
        "workflow member 'b' lists 'a' twice in deps")


def test_members_cannot_carry_unique_options() -> None:
    assert refused(lambda: belay.Workflow("w").add("a", "k", unique="key")) == (
        "workflow member 'a': members can't carry unique options; make the whole workflow "
        "idempotent with an explicit Workflow(..., workflow_id=...) instead")


def test_a_dep_bearing_member_cannot_be_scheduled() -> None:
    """Settlement sets ready_at when it releases a member (§8.3): a delay would be lost."""
    for option in ({"delay": 5}, {"run_at": START}):
        assert refused(lambda o=option: belay.Workflow("w").add("b", "k", deps=["a"], **o)) == (
            "workflow member 'b' has deps, so it becomes ready when they finish and a delay "
            "or run_at would be ignored; schedule a member without deps instead")
    belay.Workflow("w").add("a", "k", delay=5)  # without deps it is a plain schedule


def test_job_options_are_checked_at_add_naming_the_member() -> None:
    assert refused(lambda: belay.Workflow("w").add("a", "k", priority="high")) == (
        "workflow member 'a': priority must be an integer, got 'high'")
    assert refused(lambda: belay.Workflow("w").add("a", "")) == (
        "workflow member 'a': kind must be a non-empty worker name")
    assert refused(lambda: belay.Workflow("w").add("a", "k", budget={"dollars": 1})) == (
        "workflow member 'a': unknown budget key(s) 'dollars'; use 'usd', 'tokens', 'on_exceed', "
        "'warn_at'")
    assert len(belay.Workflow("w")) == 0


# -- Properties of the builder with settlement (pure) ---------------------------------------


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, list[str]]:
    """Random dependency graphs over n0…nk, cycles and self-edges allowed."""
    n = draw(st.integers(min_value=1, max_value=9))
    names = [f"n{i}" for i in range(n)]
    return {name: draw(st.lists(st.sampled_from(names), unique=True, max_size=3))
            for name in names}


def has_cycle(graph: dict[str, list[str]]) -> bool:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return True
    return False


@PROPERTY
@given(graphs())
def test_property_find_cycle_agrees_with_graphlib_and_returns_a_real_cycle(
    graph: dict[str, list[str]],
) -> None:
    cycle = find_cycle(graph)
    assert (cycle is not None) == has_cycle(graph)
    if cycle is not None:
        assert cycle[0] == cycle[-1] and len(set(cycle[:-1])) == len(cycle) - 1
        for member, dep in itertools.pairwise(cycle):
            assert dep in graph[member]


@PROPERTY
@given(graphs())
def test_property_validate_accepts_exactly_the_acyclic_workflows(
    graph: dict[str, list[str]],
) -> None:
    wf = belay.Workflow("w")
    for name, deps in graph.items():
        wf.add(name, "k", deps=deps)
    if has_cycle(graph):
        with pytest.raises(belay.ValidationError, match=r"itself|cycle"):
            wf.validate()
    else:
        wf.validate()


@st.composite
def dags(draw: st.DrawFn) -> belay.Workflow:
    """Random valid workflows: deps on earlier members, random ignore lists."""
    n = draw(st.integers(min_value=1, max_value=10))
    wf = belay.Workflow("w", ignore=draw(st.lists(st.sampled_from(["failed", "cancelled"]),
                                                  unique=True)))
    for i in range(n):
        deps = draw(st.lists(st.sampled_from([f"n{j}" for j in range(i)]), unique=True,
                             max_size=3)) if i else []
        ignore = draw(st.none() | st.lists(st.sampled_from(["failed", "cancelled"]),
                                           unique=True))
        wf.add(f"n{i}", "k", deps=deps, ignore=ignore)
    return wf


@PROPERTY
@given(dags(), st.data())
def test_property_an_enqueued_workflow_always_finishes_and_runs_members_only_when_due(
    wf: belay.Workflow, data: st.DataObject
) -> None:
    """Simulate workers on the builder's rows: run any ready member to any outcome (or
    cancel a held one), settling after each terminal write (§7). Every member ends
    terminal — none is held forever — and none ever runs beside an unsatisfied dep."""
    rows = {name: dict(spec.internal) for name, spec in wf.specs()}
    ids = {name: i for i, name in enumerate(rows)}
    state = {name: row["state"] for name, row in rows.items()}

    def settle_now() -> None:
        members = [Member(ids[n], n, state[n], rows[n]["wf_deps"], rows[n]["wf_ignore"])
                   for n in rows]
        releases, dooms = settle(members)
        by_id = {i: n for n, i in ids.items()}
        for i in releases:
            state[by_id[i]] = "ready"
        for i in dooms:
            state[by_id[i]] = "cancelled"

    while True:
        ready = sorted(n for n, s in state.items() if s == "ready")
        held = sorted(n for n, s in state.items() if s == "held")
        if not ready:
            break
        if held and data.draw(st.integers(0, 9)) == 0:
            state[data.draw(st.sampled_from(held))] = "cancelled"  # an operator cancel
        else:
            name = data.draw(st.sampled_from(ready))
            for dep in rows[name]["wf_deps"]:
                assert state[dep] == "succeeded" or (
                    state[dep] in ("failed", "cancelled") and state[dep] in rows[name]["wf_ignore"]
                )
            state[name] = data.draw(st.sampled_from(TERMINAL))
        settle_now()
    assert set(state.values()) <= set(TERMINAL), state


# -- enqueue ---------------------------------------------------------------------------------


def test_enqueue_inserts_every_member_in_one_go(wclient, reg, sql_conn, notes) -> None:
    step = reg.get("wf.step")
    wf = (belay.Workflow("nightly", ignore=["failed"])
          .add("extract", step, {"day": "2026-11-29"}, meta={"run": 1})
          .add("side", "wf.step", queue="side")
          .add("transform", step, deps=["extract"], queue="transform", max_attempts=3)
          .add("report", step, deps=["transform", "side"], ignore=["cancelled"],
               queue="reports", priority=1, budget={"usd": 0.5}))
    jobs = wf.enqueue(client=wclient)

    assert list(jobs) == ["extract", "side", "transform", "report"]
    assert [job.id for job in jobs.values()] == sorted(job.id for job in jobs.values())
    assert not any(job.duplicate for job in jobs.values())
    rows = {name: job_row(sql_conn, job.id) for name, job in jobs.items()}
    assert {name: (r["state"], r["wf_name"], r["wf_deps"], r["wf_ignore"], r["queue"])
            for name, r in rows.items()} == {
        "extract": ("ready", "extract", [], ["failed"], "default"),
        "side": ("ready", "side", [], ["failed"], "side"),
        "transform": ("held", "transform", ["extract"], ["failed"], "transform"),
        "report": ("held", "report", ["transform", "side"], ["cancelled"], "reports"),
    }
    assert {r["workflow_id"] for r in rows.values()} == {wf.workflow_id}
    assert {r["kind"] for r in rows.values()} == {"wf.step"}
    assert rows["extract"]["input"] == {"day": "2026-11-29"}
    assert rows["extract"]["meta"] == {"run": 1}
    assert (rows["report"]["priority"], rows["report"]["budget_usd_micros"]) == (1, 500_000)
    assert rows["transform"]["max_attempts"] == 3
    assert {r["inserted_at"] for r in rows.values()} == {START}
    # One poke per queue that got claimable work; held members' queues have none yet.
    assert sorted(p["q"] for p in notes.received()) == ["default", "side"]


def test_a_workers_unique_default_does_not_apply_to_members(wclient, reg, sql_conn) -> None:
    """A member skipped as a duplicate would leave its dependents held forever."""
    for _ in range(2):
        jobs = (belay.Workflow("u").add("a", "wf.unique").add("b", reg.get("wf.unique"),
                                                               deps=["a"])
                .enqueue(client=wclient))
        assert {job_row(sql_conn, j.id)["unique_key"] for j in jobs.values()} == {None}
    assert count_jobs(sql_conn) == 4


def test_an_invalid_workflow_inserts_nothing(wclient, sql_conn) -> None:
    wf = belay.Workflow("w").add("a", "k").add("b", "k", deps=["a", "ghost"])
    with pytest.raises(belay.ValidationError, match="'ghost', not a member"):
        wf.enqueue(client=wclient)
    assert count_jobs(sql_conn) == 0


# -- Running (§8.3) ------------------------------------------------------------------------------


def test_a_chain_runs_in_order_on_a_threaded_worker(wclient, reg, runs) -> None:
    """a → b → c with four executor threads free: b and c could run at once if released
    early; each must start only after its dependency succeeded."""
    wf = (belay.Workflow("chain").add("a", "wf.step").add("b", "wf.step", deps=["a"])
          .add("c", "wf.step", deps=["b"]))
    jobs = wf.enqueue(client=wclient)
    worker = threaded_worker(wclient, reg, slots=4)
    worker.start()
    try:
        wait_done(wclient, wf.workflow_id)
    finally:
        worker.stop()

    assert runs.names() == ["a", "b", "c"]
    assert [r["deps"] for r in runs.log] == [{}, {"a": "succeeded"}, {"b": "succeeded"}]
    status = wclient.workflow_status(wf.workflow_id)
    assert status.done and status.state_counts == {"succeeded": 3}
    assert {n: j.result for n, j in status.by_name().items()} == {"a": "a", "b": "b", "c": "c"}
    assert [j.id for j in status.jobs] == [j.id for j in jobs.values()]


def diamond(label: str) -> belay.Workflow:
    """a → {b, c} → d, with b and c meeting at barrier ``label`` so both run at once."""
    return (belay.Workflow(label).add("a", "wf.step")
            .add("b", "wf.step", {"meet": label}, deps=["a"])
            .add("c", "wf.step", {"meet": label}, deps=["a"])
            .add("d", "wf.step", deps=["b", "c"]))


def test_diamond_join_runs_once_when_both_branches_finish_together(
    wclient, reg, runs, barriers
) -> None:
    """b and c run side by side on two executor threads (a barrier holds each until the
    other is running) and ack at the same moment; d must be released, and only once."""
    flows = [diamond(f"d{i}") for i in range(4)]
    for wf in flows:
        barriers[wf.name] = threading.Barrier(2)
        wf.enqueue(client=wclient)
    worker = threaded_worker(wclient, reg, slots=8)  # room for every b and c at once
    worker.start()
    try:
        wait_done(wclient, *(wf.workflow_id for wf in flows))
    finally:
        worker.stop()

    for wf in flows:
        log = [r for r in runs.log if r["wf"] == wf.workflow_id]
        assert Counter(r["name"] for r in log) == {"a": 1, "b": 1, "c": 1, "d": 1}
        threads = {r["name"]: r["thread"] for r in log}
        assert threads["b"] != threads["c"]
        (d_run,) = [r for r in log if r["name"] == "d"]
        assert d_run["deps"] == {"b": "succeeded", "c": "succeeded"}
        status = wclient.workflow_status(wf.workflow_id)
        assert status.state_counts == {"succeeded": 4}
        assert status.by_name()["d"].attempt == 1


def test_concurrent_acks_of_both_branches_release_the_join_exactly_once(
    wclient, reg, db_url, clock
) -> None:
    """The same race at the storage boundary, where the release itself is visible: of
    two acks committing together, exactly one settlement releases d (§7: each settles
    under the workflow lock, so the second sees the first's success)."""
    for i in range(15):
        wf = diamond(f"race{i}")
        jobs = wf.enqueue(client=wclient)
        assert drain(client=wclient, registry=reg, max_jobs=1) == {"succeeded": 1}  # a
        now = clock.now()
        with psycopg.connect(db_url, autocommit=True) as conn:
            claimed = store.claim(conn, "default", 2, "node-t", now, now + timedelta(seconds=30))
        assert sorted(j.wf_name for j in claimed) == ["b", "c"]
        barrier = threading.Barrier(2)

        def ack(job: belay.Job, barrier: threading.Barrier = barrier) -> list[int]:
            with psycopg.connect(db_url) as conn, conn.transaction():
                barrier.wait(5)
                acked = store.ack(conn, job, "succeeded", clock.now(), result=b'"ok"')
                assert acked is not None
                return [job_id for job_id, _ in acked.settled.ready]

        with ThreadPoolExecutor(2) as pool:
            released = [f.result() for f in [pool.submit(ack, j) for j in claimed]]
        assert sorted(released, key=len) == [[], [jobs["d"].id]], f"round {i}"
        assert wclient.get_job(jobs["d"].id).state == "ready"
        assert drain(client=wclient, registry=reg) == {"succeeded": 1}  # d: a clean slate


def test_a_failed_dependency_dooms_its_dependents_transitively(wclient, reg, runs) -> None:
    wf = (belay.Workflow("fail")
          .add("a", "wf.step", {"do": "fail"}, max_attempts=1)
          .add("b", "wf.step", deps=["a"])
          .add("c", "wf.step", deps=["b"])
          .add("d", "wf.step", deps=["a"], ignore=["failed"])
          .add("e", "wf.step", deps=["c"], ignore=["cancelled"])   # c's doom is a cancel
          .add("f", "wf.step", deps=["c"], ignore=["failed"]))      # …which this doesn't skip
    jobs = wf.enqueue(client=wclient)
    clock_now = wclient.clock.now()

    assert run_all(wclient, reg) == {"failed": 1, "succeeded": 2}

    assert states(wclient, wf.workflow_id) == {
        "a": "failed", "b": "cancelled", "c": "cancelled", "d": "succeeded",
        "e": "succeeded", "f": "cancelled"}
    assert sorted(runs.names()) == ["a", "d", "e"]
    assert [r["deps"] for r in runs.log if r["name"] == "d"] == [{"a": "failed"}]
    doomed = wclient.get_job(jobs["c"].id)
    assert (doomed.finished_at, doomed.attempt) == (clock_now, 0)
    with pytest.raises(belay.JobCancelled):
        wclient.await_result(jobs["c"].id, timeout=5)


def test_a_workflow_wide_ignore_applies_to_members_without_their_own(wclient, reg, runs) -> None:
    wf = (belay.Workflow("lenient", ignore=["failed"])
          .add("a", "wf.step", {"do": "fail"}, max_attempts=1)
          .add("b", "wf.step", deps=["a"])
          .add("c", "wf.step", deps=["a"], ignore=[]))
    wf.enqueue(client=wclient)
    run_all(wclient, reg)
    assert states(wclient, wf.workflow_id) == {"a": "failed", "b": "succeeded", "c": "cancelled"}
    assert sorted(runs.names()) == ["a", "b"]


@pytest.mark.parametrize("how", ["operator", "itself"])
def test_a_cancelled_member_dooms_dependents_unless_they_ignore_cancelled(
    wclient, reg, runs, how
) -> None:
    wf = (belay.Workflow("cancel")
          .add("a", "wf.step", {"do": "cancel"})
          .add("b", "wf.step", deps=["a"])
          .add("c", "wf.step", deps=["b"])
          .add("d", "wf.step", deps=["a"], ignore=["cancelled"])
          .add("e", "wf.step", deps=["a"], ignore=["failed"]))
    jobs = wf.enqueue(client=wclient)
    if how == "operator":
        assert wclient.cancel_job(jobs["a"].id) == "cancelled"
        assert states(wclient, wf.workflow_id) == {
            "a": "cancelled", "b": "cancelled", "c": "cancelled", "d": "ready",
            "e": "cancelled"}
    run_all(wclient, reg)
    assert states(wclient, wf.workflow_id) == {
        "a": "cancelled", "b": "cancelled", "c": "cancelled", "d": "succeeded",
        "e": "cancelled"}
    assert sorted(runs.names()) == (["d"] if how == "operator" else ["a", "d"])


def test_retry_re_holds_a_member_and_settles_it_again(wclient, reg, runs) -> None:
    """§8.6: retrying a doomed member while its dep is still failed dooms it again at once;
    once the failed dep is retried and succeeds, retrying the member runs it."""
    wf = (belay.Workflow("retry")
          .add("a", "wf.step", {"do": "fail", "until": 2}, max_attempts=1)
          .add("b", "wf.step", deps=["a"])
          .add("c", "wf.step", deps=["b"]))
    jobs = wf.enqueue(client=wclient)
    run_all(wclient, reg)
    assert states(wclient, wf.workflow_id) == {"a": "failed", "b": "cancelled", "c": "cancelled"}

    assert wclient.retry_job(jobs["b"].id).state == "cancelled"  # a is still failed
    assert run_all(wclient, reg) == {}
    assert states(wclient, wf.workflow_id) == {"a": "failed", "b": "cancelled", "c": "cancelled"}

    assert wclient.retry_job(jobs["a"].id).state == "ready"
    assert run_all(wclient, reg) == {"succeeded": 1}
    # Settlement moves held members only: b, doomed earlier, stays cancelled.
    assert states(wclient, wf.workflow_id) == {
        "a": "succeeded", "b": "cancelled", "c": "cancelled"}

    assert wclient.retry_job(jobs["b"].id).state == "ready"
    assert wclient.retry_job(jobs["c"].id).state == "held"  # b is not done yet
    assert run_all(wclient, reg) == {"succeeded": 2}
    assert states(wclient, wf.workflow_id) == {
        "a": "succeeded", "b": "succeeded", "c": "succeeded"}
    assert runs.names() == ["a", "a", "b", "c"]
    assert [r["deps"] for r in runs.log[2:]] == [{"a": "succeeded"}, {"b": "succeeded"}]


# -- Idempotent ids, transactions ----------------------------------------------------------------


def nightly(workflow_id: str = "nightly-2026-11-29") -> belay.Workflow:
    return (belay.Workflow("nightly", workflow_id=workflow_id)
            .add("extract", "wf.step").add("report", "wf.step", deps=["extract"]))


def test_an_explicit_workflow_id_is_enqueued_once(wclient, sql_conn, notes) -> None:
    first = nightly().enqueue(client=wclient)
    notes.received()
    again = nightly().enqueue(client=wclient)

    assert count_jobs(sql_conn) == 2
    assert {n: j.id for n, j in again.items()} == {n: j.id for n, j in first.items()}
    assert all(j.duplicate for j in again.values())
    assert not any(j.duplicate for j in first.values())
    assert {n: j.state for n, j in again.items()} == {"extract": "ready", "report": "held"}
    assert notes.received() == []  # nothing new to claim


def test_enqueueing_the_same_workflow_object_twice_is_safe(wclient, sql_conn) -> None:
    """A retry after a network error, with the generated id."""
    wf = belay.Workflow("gen").add("a", "wf.step")
    first, again = wf.enqueue(client=wclient), wf.enqueue(client=wclient)
    assert again["a"].id == first["a"].id and again["a"].duplicate
    assert count_jobs(sql_conn) == 1


def test_an_explicit_id_taken_by_other_members_is_refused(wclient, sql_conn) -> None:
    nightly().enqueue(client=wclient)
    other = belay.Workflow("nightly", workflow_id="nightly-2026-11-29").add("extract", "wf.step")
    with pytest.raises(belay.ValidationError) as info:
        other.enqueue(client=wclient)
    assert str(info.value) == (
        "workflow id 'nightly-2026-11-29' is already taken by members extract, report, not "
        "this workflow's extract; give it another workflow_id")
    assert count_jobs(sql_conn) == 2


def test_concurrent_enqueues_of_one_workflow_id_insert_its_members_once(
    wclient, db_url, sql_conn
) -> None:
    """The second enqueue waits on the workflow lock until the first commits, then finds
    its members (without the lock it would see no members yet and insert a second set)."""
    with psycopg.connect(db_url) as first, ThreadPoolExecutor(1) as pool:
        inserted = nightly().enqueue(conn=first, client=wclient)  # uncommitted, lock held
        second = pool.submit(nightly().enqueue, client=wclient)
        wait_until(lambda: advisory_waiters(sql_conn) == 1,
                   "the second enqueue waits for the workflow lock")
        first.commit()
        found = second.result(timeout=10)
    assert {n: j.id for n, j in found.items()} == {n: j.id for n, j in inserted.items()}
    assert all(j.duplicate for j in found.values())
    assert count_jobs(sql_conn) == 2


def test_conn_joins_the_callers_transaction(wclient, db_url, sql_conn, notes) -> None:
    with psycopg.connect(db_url) as conn:
        jobs = nightly().enqueue(conn=conn, client=wclient)
        assert count_jobs(conn) == 2 and count_jobs(sql_conn) == 0  # not committed yet
        conn.rollback()
    assert count_jobs(sql_conn) == 0
    assert wclient.get_job(jobs["extract"].id) is None
    assert notes.received() == []  # the poke went with the rollback

    with psycopg.connect(db_url) as conn:
        nightly().enqueue(conn=conn, client=wclient)
        conn.commit()
    assert count_jobs(sql_conn) == 2
    assert notes.received() == [{"t": "p", "q": "default"}]


def test_module_level_enqueue_workflow_uses_the_default_instance(
    db_url, reg, restore_default, sql_conn
) -> None:
    belay.configure(db_url, registry=reg)
    jobs = belay.enqueue_workflow(nightly("via-module"))
    assert jobs["report"].workflow_id == "via-module"
    again = nightly("via-module").enqueue()
    assert again["report"].duplicate and count_jobs(sql_conn) == 2


def test_workflow_status_after_a_run(wclient, reg) -> None:
    wf = (belay.Workflow("status").add("a", "wf.step")
          .add("b", "wf.step", {"do": "fail"}, deps=["a"], max_attempts=1)
          .add("c", "wf.step", deps=["b"]))
    wf.enqueue(client=wclient)
    before = wclient.workflow_status(wf.workflow_id)
    assert (before.total, before.done, before.state_counts) == (3, False,
                                                               {"ready": 1, "held": 2})
    run_all(wclient, reg)
    after = wclient.workflow_status(wf.workflow_id)
    assert after.done
    assert after.state_counts == {"succeeded": 1, "failed": 1, "cancelled": 1}
    assert [j.wf_name for j in after.jobs] == ["a", "b", "c"]
