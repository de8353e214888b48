"""Chunk workers: ``@belay.worker(chunk={"size": n, "gather_ms": ms})``.

Contract §6 (chunked execution is SDK-side composition: claim up to ``size``
rows, run them in one invocation, ack each row on its own, fenced, §7), §8.1-2
(a job's own await, sleep, budget and cancel inside a chunk), §11.2 (a stale
ack is discarded, here for one job of a chunk while the others ack).

The synchronous tests use ``Worker.drain()`` on the ``clock`` fixture (a
ManualClock): chunks of whatever is claimable now, up to the size. The threaded
tests start a real worker and wait on ``on_job_end`` events; wall time appears
only where the feature is about wall time (the gather window, the heartbeat's
lease and timeout checks), and there only as a lower bound or a generous upper
bound. Every chunk function records the
job ids of each call (under a lock), so "which calls happened" is a record, not
an inference. The database is read with ``client.get_job`` and raw SQL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import belay
from belay.registry import Chunk, parse_chunk
from tests.helpers import START, Conn, Ends, job_row, wait_until

# -- helpers -------------------------------------------------------------------------------


class Calls:
    """Each call of a chunk function, as the list of its job ids (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[list[int]] = []

    def record(self, contexts: list[belay.Context]) -> None:
        with self._lock:
            self._calls.append([ctx.id for ctx in contexts])

    @property
    def calls(self) -> list[list[int]]:
        with self._lock:
            return [list(call) for call in self._calls]

    def sizes(self) -> list[int]:
        return [len(call) for call in self.calls]

    def jobs(self) -> Counter[int]:
        """How many calls each job was in."""
        return Counter(job_id for call in self.calls for job_id in call)


def make_worker(client: belay.Belay, registry: belay.Registry, queues: Any = ("default",),
                **options: Any) -> belay.Worker:
    """Fast polls, no background sweeps unless a test asks."""
    settings: dict[str, Any] = {"poll_interval": 0.05, "busy_poll": 0.01,
                                "sweep_interval": 3600.0, "shutdown_grace": 5.0}
    settings.update(options)
    return belay.Worker(queues, client=client, registry=registry, **settings)


@contextlib.contextmanager
def running(worker: belay.Worker) -> Iterator[belay.Worker]:
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def running_count(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM belay_jobs WHERE state = 'running'").fetchone()
    assert row is not None
    return int(row[0])


def journal(conn: Conn, job_id: int) -> list[tuple[int, str, Any]]:
    """(seq, name, value) of a job's journaled steps, the value parsed from its envelope."""
    rows = conn.execute(
        "SELECT seq, name, value FROM belay_steps WHERE job_id = %s ORDER BY seq", (job_id,)
    ).fetchall()
    return [(seq, name, json.loads(bytes(value))) for seq, name, value in rows]


def enqueue_n(client: belay.Belay, kind: Any, n: int, **options: Any) -> list[int]:
    return [client.enqueue(kind, {"n": i}, **options).id for i in range(n)]


def ten_seconds(attempt: int) -> float:
    return 10.0


# -- options -------------------------------------------------------------------------------


def test_chunk_options_become_the_workers_chunk() -> None:
    reg = belay.Registry()

    @belay.worker(name="t.embed", registry=reg, chunk={"size": 3, "gather_ms": 200})
    def embed(contexts: list[belay.Context]) -> None:
        return None

    @belay.worker(name="t.defaults", registry=reg, chunk={})
    def defaults(contexts: list[belay.Context]) -> None:
        return None

    @belay.worker(name="t.plain", registry=reg)
    def plain(ctx: belay.Context) -> None:
        return None

    assert reg.get("t.embed") is embed and embed.chunk == Chunk(size=3, gather_ms=200)
    assert defaults.chunk == Chunk(size=10, gather_ms=0)
    assert plain.chunk is None


@pytest.mark.parametrize("chunk", [
    5, [("size", 3)], "size=3",
    {"size": 0}, {"size": -1}, {"size": 2.5}, {"size": True}, {"size": "3"}, {"size": None},
    {"gather_ms": -1}, {"gather_ms": 0.5}, {"gather_ms": False}, {"gather_ms": "200"},
    {"batch": 3}, {"size": 3, "gather": 200},
])
def test_invalid_chunk_options_raise_at_decoration(chunk) -> None:
    reg = belay.Registry()
    with pytest.raises(belay.ConfigurationError, match="chunk"):
        belay.worker(name="t.bad", registry=reg, chunk=chunk)
    assert "t.bad" not in reg


@given(size=st.integers(min_value=1, max_value=10**9),
       gather=st.integers(min_value=0, max_value=10**9))
def test_parse_chunk_keeps_any_whole_size_and_gather(size: int, gather: int) -> None:
    assert parse_chunk({"size": size, "gather_ms": gather}) == Chunk(size=size, gather_ms=gather)
    assert parse_chunk({"size": size}) == Chunk(size=size, gather_ms=0)
    assert parse_chunk({"gather_ms": gather}) == Chunk(size=10, gather_ms=gather)


@given(size=st.integers(max_value=0), gather=st.integers(max_value=-1),
       extra=st.text(min_size=1).filter(lambda k: k not in ("size", "gather_ms")))
def test_parse_chunk_refuses_sizes_below_one_negative_gathers_and_unknown_keys(
    size: int, gather: int, extra: str
) -> None:
    for bad in ({"size": size}, {"gather_ms": gather}, {"size": 3, extra: 1}):
        with pytest.raises(belay.ConfigurationError):
            parse_chunk(bad)


# -- drain: sizes and results --------------------------------------------------------------


def test_drain_runs_seven_jobs_as_chunks_of_three_three_one(client) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.embed", registry=reg, chunk={"size": 3, "gather_ms": 200})
    def embed(contexts: list[belay.Context]) -> dict[int, Any]:
        calls.record(contexts)
        return {ctx.id: {"vector": [ctx.input["n"], len(contexts)]} for ctx in contexts}

    ids = enqueue_n(client, embed, 7)
    assert make_worker(client, reg).drain() == {"succeeded": 7}
    assert calls.calls == [ids[0:3], ids[3:6], ids[6:7]]
    for n, job_id in enumerate(ids):
        job = client.get_job(job_id)
        assert job is not None
        assert (job.state, job.attempt, job.errors) == ("succeeded", 1, [])
        assert job.result == {"vector": [n, 3 if n < 6 else 1]}


def test_a_chunk_returning_none_succeeds_every_job_without_a_result(client) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.none", registry=reg, chunk={"size": 10})
    def fire_and_forget(contexts: list[belay.Context]) -> None:
        calls.record(contexts)

    ids = enqueue_n(client, fire_and_forget, 4)
    assert make_worker(client, reg).drain() == {"succeeded": 4}
    assert calls.calls == [ids]
    for job_id in ids:
        job = client.get_job(job_id)
        assert job is not None
        assert (job.state, job.result, job.errors, job.attempt) == ("succeeded", None, [], 1)


def test_drain_max_jobs_caps_the_chunk(client, sql_conn) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.capped", registry=reg, chunk={"size": 3})
    def capped(contexts: list[belay.Context]) -> None:
        calls.record(contexts)

    ids = enqueue_n(client, capped, 7)
    worker = make_worker(client, reg)
    assert worker.drain(max_jobs=5) == {"succeeded": 5}
    assert calls.calls == [ids[0:3], ids[3:5]]
    assert [job_row(sql_conn, i)["state"] for i in ids[5:]] == ["ready", "ready"]
    assert worker.drain(max_jobs=1) == {"succeeded": 1}
    assert calls.calls[-1] == [ids[5]]


def test_a_chunk_holds_one_kind_and_at_most_that_kinds_size(client) -> None:
    """One claim may take jobs of several kinds from the queue: each chunk kind
    still gets chunks of its own jobs, never more than its own size; a plain job
    runs alone and a kind nobody serves goes back."""
    reg = belay.Registry()
    big, small = Calls(), Calls()
    plain_ran: list[int] = []

    @belay.worker(name="t.big", registry=reg, chunk={"size": 10})
    def big_chunks(contexts: list[belay.Context]) -> None:
        big.record(contexts)

    @belay.worker(name="t.small", registry=reg, chunk={"size": 2})
    def small_chunks(contexts: list[belay.Context]) -> None:
        small.record(contexts)

    @belay.worker(name="t.plain", registry=reg)
    def plain(ctx: belay.Context) -> None:
        plain_ran.append(ctx.id)

    b1 = client.enqueue(big_chunks).id
    s1, s2, s3 = (client.enqueue(small_chunks).id for _ in range(3))
    p1 = client.enqueue(plain).id
    b2 = client.enqueue(big_chunks).id
    nobody = client.enqueue("t.nobody").id
    assert make_worker(client, reg).drain() == {"succeeded": 6, "unknown": 1}
    assert big.calls == [[b1, b2]]
    assert small.calls == [[s1, s2], [s3]]
    assert plain_ran == [p1]
    job = client.get_job(nobody)
    assert job is not None and (job.state, job.attempt) == ("ready", 0)


def test_steps_inside_a_chunk_are_journaled_per_job(client, sql_conn) -> None:
    reg = belay.Registry()
    ran: list[tuple[int, str]] = []

    @belay.worker(name="t.stepped", registry=reg, chunk={"size": 5}, backoff=ten_seconds)
    def stepped(contexts: list[belay.Context]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for ctx in contexts:
            n = ctx.input["n"]
            fetched = ctx.step("fetch", lambda n=n, i=ctx.id: ran.append((i, "fetch"))
                               or f"doc-{n}")
            embedded = ctx.step("embed", lambda n=n, i=ctx.id: ran.append((i, "embed"))
                                or [n, n * n])
            out[ctx.id] = {"doc": fetched, "vec": embedded}
        if contexts[0].attempt == 1:
            raise RuntimeError("the index write failed")  # all retry; steps stay journaled
        return out

    ids = enqueue_n(client, stepped, 3)
    worker = make_worker(client, reg)
    assert worker.drain() == {"retry": 3}
    for n, job_id in enumerate(ids):
        assert journal(sql_conn, job_id) == [(1, "fetch", f"doc-{n}"), (2, "embed", [n, n * n])]
        assert [s.name for s in client.steps(job_id)] == ["fetch", "embed"]
    client.clock.advance(10)
    assert worker.drain() == {"succeeded": 3}
    # Each job's steps ran once, on the first attempt; the second replayed them.
    assert sorted(ran) == sorted([(i, s) for i in ids for s in ("fetch", "embed")])
    for n, job_id in enumerate(ids):
        job = client.get_job(job_id)
        assert job is not None and job.attempt == 2
        assert job.result == {"doc": f"doc-{n}", "vec": [n, n * n]}


# -- drain: per-job outcomes ---------------------------------------------------------------


def test_each_job_takes_its_own_outcome_from_the_returned_dict(client, sql_conn, clock,
                                                               caplog) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.mixed", registry=reg, chunk={"size": 10}, backoff=ten_seconds)
    def mixed(contexts: list[belay.Context]) -> dict[Any, Any]:
        calls.record(contexts)
        out: dict[Any, Any] = {999_999_999: "not in this chunk"}
        for ctx in contexts:
            do = ctx.input["do"]
            if do == "ok":
                out[ctx.id] = {"embedded": True}
            elif do in ("fail", "last"):
                out[ctx.id] = ValueError(f"bad input {ctx.id}")
            elif do == "cancel":
                out[ctx.id] = belay.Cancel("duplicate document")
            elif do == "snooze":
                out[ctx.id] = belay.Snooze(30)
            # "missing": no entry at all
        return out

    ids = {do: client.enqueue(mixed, {"do": do}).id
           for do in ("ok", "fail", "cancel", "snooze", "missing")}
    ids["last"] = client.enqueue(mixed, {"do": "last"}, max_attempts=1).id
    with caplog.at_level(logging.WARNING, logger="belay.worker"):
        counts = make_worker(client, reg).drain()
    assert counts == {"succeeded": 1, "retry": 2, "failed": 1, "cancelled": 1, "snooze": 1}
    assert calls.calls == [list(ids.values())]
    assert "999999999" in caplog.text and "not in its chunk" in caplog.text

    def job(do: str) -> belay.Job:
        found = client.get_job(ids[do])
        assert found is not None
        return found

    assert (job("ok").state, job("ok").result, job("ok").errors) == (
        "succeeded", {"embedded": True}, [])

    failed = job("fail")
    assert (failed.state, failed.attempt, failed.result) == ("ready", 1, None)
    assert failed.ready_at == START + timedelta(seconds=10)
    [entry] = failed.errors
    assert (entry["error"], entry["attempt"]) == (f"ValueError: bad input {ids['fail']}", 1)

    last = job("last")
    assert (last.state, last.attempt, last.finished_at) == ("failed", 1, clock.now())
    assert [e["error"] for e in last.errors] == [f"ValueError: bad input {ids['last']}"]

    assert (job("cancel").state, job("cancel").errors) == (
        "cancelled", [{"reason": "duplicate document"}])

    snoozed = job("snooze")
    assert (snoozed.state, snoozed.attempt, snoozed.errors) == ("ready", 0, [])
    assert snoozed.ready_at == START + timedelta(seconds=30)

    missing = job("missing")
    assert (missing.state, missing.attempt) == ("ready", 1)
    [entry] = missing.errors
    assert entry["error"] == (
        f"ValidationError: the chunk worker returned no outcome for job {ids['missing']}")
    assert entry["attempt"] == 1


@pytest.mark.parametrize("returned", [["a", "list"], "text", 3])
def test_a_return_that_is_not_a_dict_errors_every_job(client, returned) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.wrong", registry=reg, chunk={"size": 5}, backoff=ten_seconds)
    def wrong(contexts: list[belay.Context]) -> Any:
        return returned

    ids = enqueue_n(client, wrong, 3)
    assert make_worker(client, reg).drain() == {"retry": 3}
    for job_id in ids:
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.attempt, job.result) == ("ready", 1, None)
        [entry] = job.errors
        assert entry["error"].startswith("ValidationError: a chunk worker returns None or a dict")
        assert type(returned).__name__ in entry["error"]


def test_a_raise_gives_every_job_its_error_and_each_retries_or_fails_by_its_attempts(
    client, clock
) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.down", registry=reg, chunk={"size": 5}, max_attempts=2,
                  backoff=ten_seconds)
    def down(contexts: list[belay.Context]) -> None:
        calls.record(contexts)
        raise RuntimeError("embedding service down")

    once = client.enqueue(down, max_attempts=1).id
    twice = enqueue_n(client, down, 2)
    worker = make_worker(client, reg)
    assert worker.drain() == {"failed": 1, "retry": 2}
    only = client.get_job(once)
    assert only is not None and (only.state, only.attempt) == ("failed", 1)
    assert [e["error"] for e in only.errors] == ["RuntimeError: embedding service down"]
    for job_id in twice:
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.attempt) == ("ready", 1)
        assert [(e["error"], e["attempt"]) for e in job.errors] == [
            ("RuntimeError: embedding service down", 1)]
        assert "in down" in job.errors[0]["traceback"]
    clock.advance(10)
    assert worker.drain() == {"failed": 2}
    assert calls.calls == [[once, *twice], twice]
    for job_id in twice:
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.attempt) == ("failed", 2)
        assert [e["attempt"] for e in job.errors] == [1, 2]


# -- drain: one job's own control flow raised through the chunk -------------------------

#: Drain counts for a chunk of three where the middle job takes the raise: the
#: other two snooze back at once and, being due, run again in the same drain.
CONTROL_COUNTS = {
    "await": {"await": 1, "snooze": 2, "succeeded": 2},
    "sleep": {"snooze": 3, "succeeded": 2},
    "budget": {"failed": 1, "snooze": 2, "succeeded": 2},
    "cancel": {"cancelled": 1, "snooze": 2, "succeeded": 2},
}


@pytest.mark.parametrize("control", list(CONTROL_COUNTS))
def test_one_jobs_control_flow_is_its_own_and_the_others_go_back_without_an_attempt(
    client, sql_conn, clock, control
) -> None:
    reg = belay.Registry()
    calls = Calls()
    fetched: list[int] = []

    @belay.worker(name="t.control", registry=reg, chunk={"size": 3}, backoff=ten_seconds)
    def chunk(contexts: list[belay.Context]) -> dict[int, Any]:
        calls.record(contexts)
        out: dict[int, Any] = {}
        for ctx in contexts:
            victim = ctx.input["victim"]
            if victim and control == "cancel" and ctx.attempt == 1:
                assert client.cancel_job(ctx.id) == "requested"
            cost = belay.Cost(usd=0.2) if control == "budget" else None
            out[ctx.id] = ctx.step("fetch", lambda i=ctx.id: fetched.append(i) or f"doc-{i}",
                                   cost=cost)
            if victim and control == "await":
                out[ctx.id] = {"doc": out[ctx.id], "go": ctx.await_signal("go")}
            if victim and control == "sleep":
                ctx.sleep("cool-down", 120)
        return out

    first = client.enqueue(chunk, {"victim": False}).id
    victim = client.enqueue(chunk, {"victim": True}, budget={"usd": 0.1}).id
    last = client.enqueue(chunk, {"victim": False}).id
    assert make_worker(client, reg).drain() == CONTROL_COUNTS[control]
    assert calls.calls == [[first, victim, last], [first, last]]

    for job_id in (first, last):
        job = client.get_job(job_id)
        assert job is not None
        # Snoozed back (not an attempt), then run once more: attempt 1 in all.
        assert (job.state, job.attempt, job.errors, job.result) == (
            "succeeded", 1, [], f"doc-{job_id}")
    # The step of every job ran once (the rerun replayed the journal); a job
    # cancelled at its step boundary never ran it.
    assert sorted(fetched) == sorted([first, last] if control == "cancel" else
                                     [first, victim, last])
    for job_id in (first, last):
        assert journal(sql_conn, job_id) == [(1, "fetch", f"doc-{job_id}")]

    row = job_row(sql_conn, victim)
    if control == "await":
        assert (row["state"], row["await_scope"], row["await_name"], row["attempt"]) == (
            "awaiting", f"job:{victim}", "go", 0)
        assert client.signal_job(victim, "go", {"ok": 1}) == [victim]
        assert make_worker(client, reg).drain() == {"succeeded": 1}
        job = client.get_job(victim)
        assert job is not None and job.result == {"doc": f"doc-{victim}", "go": {"ok": 1}}
        assert fetched.count(victim) == 1
    elif control == "sleep":
        assert (row["state"], row["attempt"], row["errors"]) == ("ready", 0, [])
        assert row["ready_at"] == START + timedelta(seconds=120)
        assert [name for _, name, _ in journal(sql_conn, victim)] == [
            "fetch", "$sleep:cool-down"]
        clock.advance(120)
        assert make_worker(client, reg).drain() == {"succeeded": 1}
        job = client.get_job(victim)
        assert job is not None and (job.result, job.attempt) == (f"doc-{victim}", 1)
        assert fetched.count(victim) == 1
    elif control == "budget":
        assert (row["state"], row["attempt"], row["spent_usd_micros"]) == (
            "failed", 1, 200_000)
        [entry] = row["errors"]
        assert (entry["error"], entry["step"]) == ("budget_exceeded", "fetch")
    else:
        assert (row["state"], row["attempt"], row["errors"]) == (
            "cancelled", 1, [{"reason": "cancel_requested", "attempt": 1}])
        assert journal(sql_conn, victim) == []
    assert calls.jobs()[first] == calls.jobs()[last] == 2


def test_a_refused_step_value_fails_its_own_job_and_the_others_go_back(client,
                                                                        sql_conn) -> None:
    """A step value that can't be journaled fails that job at once (§8.2: retrying
    would pay again); the chunk's other jobs are snoozed back, not failed."""
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.refused", registry=reg, chunk={"size": 2})
    def chunk(contexts: list[belay.Context]) -> dict[int, Any]:
        calls.record(contexts)
        return {ctx.id: ctx.step("value", lambda c=ctx: {1, 2} if c.input["bad"] else "ok")
                for ctx in contexts}

    bad = client.enqueue(chunk, {"bad": True}).id
    good = client.enqueue(chunk, {"bad": False}).id
    assert make_worker(client, reg).drain() == {"failed": 1, "snooze": 1, "succeeded": 1}
    assert calls.calls == [[bad, good], [good]]
    row = job_row(sql_conn, bad)
    assert row["state"] == "failed" and "bad step value" in row["errors"][0]["error"]
    job = client.get_job(good)
    assert job is not None and (job.state, job.attempt, job.errors) == ("succeeded", 1, [])


def test_a_control_flow_raise_returned_as_a_value_applies_to_that_job_alone(client,
                                                                            sql_conn) -> None:
    """The function may catch each job's raise and return it as that job's value:
    an await then parks that job and the others keep their results."""
    reg = belay.Registry()

    @belay.worker(name="t.caught", registry=reg, chunk={"size": 3})
    def caught(contexts: list[belay.Context]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for ctx in contexts:
            try:
                out[ctx.id] = ctx.await_signal("go") if ctx.input["wait"] else "done"
            except BaseException as exc:
                out[ctx.id] = exc
        return out

    done = client.enqueue(caught, {"wait": False}).id
    waiting = client.enqueue(caught, {"wait": True}).id
    assert make_worker(client, reg).drain() == {"succeeded": 1, "await": 1}
    assert job_row(sql_conn, waiting)["state"] == "awaiting"
    job = client.get_job(done)
    assert job is not None and (job.state, job.result) == ("succeeded", "done")


def test_a_job_reclaimed_mid_chunk_has_its_ack_discarded_while_the_others_ack(
    client, sql_conn
) -> None:
    """§7/§11.2 per job: each ack is fenced on its own claimed attempt."""
    reg = belay.Registry()
    stolen: dict[str, Any] = {}

    @belay.worker(name="t.fenced", registry=reg, chunk={"size": 3})
    def fenced(contexts: list[belay.Context]) -> dict[int, Any]:
        # Another node reclaimed the middle job and claimed it again meanwhile.
        sql_conn.execute(
            "UPDATE belay_jobs SET attempt = attempt + 1, leased_by = 'node-b' WHERE id = %s",
            (contexts[1].id,))
        stolen.update(job_row(sql_conn, contexts[1].id))
        return {ctx.id: f"result-{ctx.id}" for ctx in contexts}

    a, b, c = enqueue_n(client, fenced, 3)
    assert make_worker(client, reg).drain() == {"succeeded": 2, "stale": 1}
    assert job_row(sql_conn, b) == stolen  # untouched by the stale ack
    assert (stolen["state"], stolen["attempt"], stolen["leased_by"]) == ("running", 2, "node-b")
    for job_id in (a, c):
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.result) == ("succeeded", f"result-{job_id}")


# -- a running worker ----------------------------------------------------------------------


def test_a_running_worker_runs_seven_jobs_as_chunks_of_three_three_one(client) -> None:
    reg = belay.Registry()
    calls = Calls()
    threads: set[str] = set()

    @belay.worker(name="t.embed", registry=reg, chunk={"size": 3})
    def embed(contexts: list[belay.Context]) -> dict[int, Any]:
        calls.record(contexts)
        threads.add(threading.current_thread().name)
        return {ctx.id: ctx.input["n"] for ctx in contexts}

    ids = enqueue_n(client, embed, 7)
    worker = make_worker(client, reg, {"default": 10})
    ends = Ends(worker)
    with running(worker):
        events = ends.wait_for(7)
    assert sorted(calls.sizes()) == [1, 3, 3]
    assert calls.jobs() == Counter({job_id: 1 for job_id in ids})
    assert all(call == sorted(call) for call in calls.calls)
    assert Counter(e.outcome for e in events) == {"succeeded": 7}
    assert all(name.startswith("belay-exec-") for name in threads)
    for n, job_id in enumerate(ids):
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.result) == ("succeeded", n)


def test_a_running_worker_chunks_each_kind_apart(client) -> None:
    reg = belay.Registry()
    calls: dict[str, Calls] = {"a": Calls(), "b": Calls()}

    for kind in calls:
        belay.worker(name=f"t.{kind}", registry=reg, chunk={"size": 3})(calls[kind].record)

    a_ids, b_ids = [], []
    for _ in range(3):
        a_ids.append(client.enqueue("t.a").id)
        b_ids.append(client.enqueue("t.b").id)
    worker = make_worker(client, reg, {"default": 10})
    ends = Ends(worker)
    with running(worker):
        ends.wait_for(6)
    assert calls["a"].calls == [a_ids]
    assert calls["b"].calls == [b_ids]


def test_a_lone_job_still_runs_once_its_gather_time_is_up(client) -> None:
    reg = belay.Registry()
    called_at: list[float] = []

    @belay.worker(name="t.lone", registry=reg, chunk={"size": 10, "gather_ms": 300})
    def lone(contexts: list[belay.Context]) -> None:
        called_at.append(time.monotonic())
        assert len(contexts) == 1

    job = client.enqueue(lone)
    worker = make_worker(client, reg)
    ends = Ends(worker)
    started = time.monotonic()
    with running(worker):
        [end] = ends.wait_for(1)
    assert (end.job.id, end.outcome) == (job.id, "succeeded")
    # Claimed after start(), then held for the gather time before its call.
    assert called_at[0] - started >= 0.3


def test_jobs_arriving_while_a_chunk_gathers_join_it_and_a_full_chunk_goes_at_once(
    client, sql_conn
) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.gather", registry=reg, chunk={"size": 3, "gather_ms": 10_000})
    def gather(contexts: list[belay.Context]) -> None:
        calls.record(contexts)

    first = client.enqueue(gather).id
    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        wait_until(lambda: running_count(sql_conn) == 1, "the first job is claimed")
        assert calls.calls == []
        more = enqueue_n(client, gather, 2)
        ends.wait_for(3, timeout=8.0)  # well before the 10 s gather
    assert calls.calls == [[first, *more]]


def test_the_gather_time_is_clamped_to_half_the_lease(client) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.patient", registry=reg, chunk={"size": 10, "gather_ms": 600_000})
    def patient(contexts: list[belay.Context]) -> None:
        return None

    client.enqueue(patient)
    worker = make_worker(client, reg, lease_ttl=0.6)
    ends = Ends(worker)
    with running(worker):
        [end] = ends.wait_for(1, timeout=10.0)  # 0.3 s, not ten minutes
    assert end.outcome == "succeeded"


def test_gathering_jobs_hold_the_queues_slots(client, sql_conn) -> None:
    """A limit-2 queue never has more than two jobs claimed, buffered ones
    included: chunks of a size-3 worker there hold at most two jobs."""
    reg = belay.Registry()
    calls = Calls()
    claimed: list[int] = []

    @belay.worker(name="t.slots", registry=reg, chunk={"size": 3, "gather_ms": 60_000})
    def slots(contexts: list[belay.Context]) -> None:
        calls.record(contexts)
        claimed.append(running_count(sql_conn))

    ids = enqueue_n(client, slots, 5)
    worker = make_worker(client, reg, {"default": 2}, lease_ttl=0.6)  # gathers 0.3 s
    ends = Ends(worker)
    with running(worker):
        ends.wait_for(5)
    assert max(calls.sizes()) <= 2
    assert max(claimed) <= 2
    assert calls.jobs() == Counter({job_id: 1 for job_id in ids})


def test_a_chunk_jobs_timeout_starts_when_its_chunk_runs_not_while_it_gathers(client) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.timed", registry=reg, timeout=0.2,
                  chunk={"size": 10, "gather_ms": 600})
    def timed(contexts: list[belay.Context]) -> dict[int, str]:
        return {ctx.id: "in time" for ctx in contexts}

    job = client.enqueue(timed)
    # The heartbeat (which enforces timeouts) looks every 0.4 s: during the 0.6 s
    # gather, past the 0.2 s timeout, had its clock started at the claim.
    worker = make_worker(client, reg, lease_ttl=1.2)
    ends = Ends(worker)
    with running(worker):
        [end] = ends.wait_for(1)
    assert end.outcome == "succeeded"
    found = client.get_job(job.id)
    assert found is not None and (found.state, found.result) == ("succeeded", "in time")


def test_a_chunk_running_past_its_timeout_times_out_every_job_in_it(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.slow", registry=reg, timeout=0.2, backoff=ten_seconds,
                  chunk={"size": 2})
    def slow(contexts: list[belay.Context]) -> dict[int, str]:
        wait_until(lambda: all(ctx.interrupted for ctx in contexts), "the chunk times out")
        return {ctx.id: "too late" for ctx in contexts}

    ids = enqueue_n(client, slow, 2)
    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        events = ends.wait_for(2)
    assert sorted((e.job.id, e.outcome) for e in events) == [(i, "timeout") for i in ids]
    for job_id in ids:
        row = job_row(sql_conn, job_id)
        assert (row["state"], row["attempt"], row["result"]) == ("ready", 1, None)
        assert row["errors"] == [{"error": "timeout: ran longer than 0.2s", "attempt": 1}]


def test_stop_runs_the_chunks_still_gathering(client, sql_conn) -> None:
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.flush", registry=reg, chunk={"size": 5, "gather_ms": 60_000})
    def flush(contexts: list[belay.Context]) -> dict[int, str]:
        calls.record(contexts)
        return {ctx.id: "flushed" for ctx in contexts}

    ids = enqueue_n(client, flush, 2)
    worker = make_worker(client, reg)  # gathers 15 s (half the 30 s lease)
    ends = Ends(worker)
    worker.start()
    try:
        wait_until(lambda: running_count(sql_conn) == 2, "both jobs are claimed")
        assert calls.calls == []
    finally:
        before = time.monotonic()
        assert worker.stop() == []
    assert time.monotonic() - before < 10.0
    assert calls.calls == [ids]
    assert Counter(e.outcome for e in ends.events) == {"succeeded": 2}
    for job_id in ids:
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.result) == ("succeeded", "flushed")


def test_a_queue_removed_while_its_chunk_gathers_still_runs_the_chunk(client, sql_conn) -> None:
    """A dynamic queue's row is deleted while a chunk of it gathers: its claimed
    jobs run (a removed queue's running jobs finish), they don't sit leased
    until the worker stops."""
    reg = belay.Registry()
    calls = Calls()

    @belay.worker(name="t.extra", registry=reg, queue="extra",
                  chunk={"size": 5, "gather_ms": 60_000})
    def extra(contexts: list[belay.Context]) -> None:
        calls.record(contexts)

    # The operator's row, as any client writes it (§8.6).
    sql_conn.execute("INSERT INTO belay_queues (name, opts, updated_at) "
                     "VALUES ('extra', '{\"limit\": 5}', %s)", (START,))
    job = client.enqueue(extra)
    worker = make_worker(client, reg, queue_sync_interval=0.05)
    ends = Ends(worker)
    with running(worker):
        wait_until(lambda: running_count(sql_conn) == 1, "the job is claimed")
        sql_conn.execute("DELETE FROM belay_queues WHERE name = 'extra'")
        [end] = ends.wait_for(1, timeout=8.0)  # the gather alone is 15 s
    assert (end.job.id, end.outcome) == (job.id, "succeeded")
    assert calls.calls == [[job.id]]


def test_a_lost_lease_inside_a_chunk_is_that_jobs_alone(client, sql_conn) -> None:
    """The heartbeat finds one job's lease gone mid-chunk; its checkpoint raises
    through the chunk: that job writes nothing, the others snooze back and run
    again."""
    reg = belay.Registry()
    calls = Calls()
    stolen = threading.Event()

    @belay.worker(name="t.lost", registry=reg, chunk={"size": 3})
    def lost(contexts: list[belay.Context]) -> None:
        calls.record(contexts)
        if stolen.is_set():
            return
        stolen.set()
        victim = contexts[1]
        sql_conn.execute("UPDATE belay_jobs SET leased_by = 'thief' WHERE id = %s",
                         (victim.id,))
        wait_until(lambda: victim.interrupted, "the heartbeat notices the lost lease")
        for ctx in contexts:
            ctx.checkpoint()

    a, b, c = enqueue_n(client, lost, 3)
    worker = make_worker(client, reg, lease_ttl=0.3)  # renews every 0.1 s
    ends = Ends(worker)
    with running(worker):
        events = ends.wait_for(5)
    # The two snoozed back are claimed again at once: together or one by one.
    assert calls.calls[0] == [a, b, c]
    assert calls.jobs() == {a: 2, b: 1, c: 2}
    assert Counter((e.job.id, e.outcome) for e in events) == {
        (a, "snooze"): 1, (b, "lost"): 1, (c, "snooze"): 1, (a, "succeeded"): 1,
        (c, "succeeded"): 1}
    row = job_row(sql_conn, b)
    assert (row["state"], row["attempt"], row["leased_by"], row["errors"]) == (
        "running", 1, "thief", [])
    for job_id in (a, c):
        job = client.get_job(job_id)
        assert job is not None and (job.state, job.attempt) == ("succeeded", 1)
