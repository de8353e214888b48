"""Durable steps (``ctx.step``): journal, spend, budgets, cooperative cancel.

Contract §8.2 (steps: journal hit → replay; miss → durable budget pre-flight,
run, journal ``ON CONFLICT DO NOTHING`` and add spend in one transaction; fail
``budget_exceeded`` when spend goes strictly over a cap), §8.6 (cancel of a
running job → ``cancel_requested``, honoured at a step boundary; the flag
survives retries), §11.3 (a journaled step never runs again; a racing
duplicate neither overwrites nor pays twice), §11.4 (budget: five $0.20 steps
against $0.50 fail after exactly three). Issue 4, items 1 and 5.

Most tests run jobs synchronously (``belay.testing.drain``) on the ``clock``
fixture, with a private registry; the step functions count their calls, so
"replayed without running" is a count, not an inference. The cancel and
timeout tests use real worker threads; the crash test kills a real worker
process (``tests/step_jobs.py``) with SIGKILL and lets another finish the job.
The database is read with raw SQL, independently of belay's own readers.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import belay
import belay.testing
from belay import store
from belay.context import MAX_STEP_VALUE, BudgetExceeded, CancelRequested, Context, Execution
from belay.runner import JobEnd
from tests.helpers import START, Conn, job_row, running_job, wait_until
from tests.test_worker_processes import Proc

REPO = Path(__file__).resolve().parent.parent


# -- helpers -------------------------------------------------------------------------------


def journal(conn: Conn, job_id: int) -> list[tuple[int, str, Any, int, int]]:
    """(seq, name, value, usd_micros, tokens) of each journaled step, by seq; the
    value parsed as the JSON envelope belay writes (a NULL would show as the
    marker "<SQL NULL>")."""
    rows = conn.execute(
        "SELECT seq, name, value, usd_micros, tokens FROM belay_steps WHERE job_id = %s "
        "ORDER BY seq", (job_id,)
    ).fetchall()
    return [(seq, name, "<SQL NULL>" if value is None else json.loads(bytes(value)), usd, tokens)
            for seq, name, value, usd, tokens in rows]


def names(conn: Conn, job_id: int) -> list[str]:
    return [row[1] for row in journal(conn, job_id)]


def spend(conn: Conn, job_id: int) -> tuple[int, int]:
    row = job_row(conn, job_id)
    return row["spent_usd_micros"], row["spent_tokens"]


def drain(client: belay.Belay, registry: belay.Registry, **kw: Any) -> dict[str, int]:
    return belay.testing.drain(client=client, registry=registry, **kw)


def no_backoff(attempt: int) -> float:
    return 0.0


def counted(calls: list[Any], tag: Any, value: Any) -> Callable[[], Any]:
    """A step function that records ``tag`` in ``calls`` each time it runs."""
    def fn() -> Any:
        calls.append(tag)
        return value
    return fn


def lapse_and_reclaim(client: belay.Belay, clock: belay.ManualClock,
                      registry: belay.Registry) -> None:
    """From inside a running job: its worker stalls past its lease and another
    node's sweeper reclaims the job (the real reclaim path), so this run's
    ack will be stale — as if the process had died before acking."""
    clock.advance(31)  # drain's lease is the default 30 s
    sweeper = belay.Worker(["elsewhere"], client=client, registry=registry)
    assert sweeper.reclaim() == 1


@pytest.fixture
def ctx(client: belay.Belay, sql_conn: Conn) -> Context:
    """A context on a claimed job (attempt 1, leased), outside any worker: the
    unit-level view of ``ctx.step``."""
    job = client.get_job(running_job(sql_conn))
    assert job is not None
    return Context(Execution(job, None, None), client)


# -- the journal (§8.2) --------------------------------------------------------------------


def test_each_step_is_journaled_in_call_order_with_its_value_and_cost(client, sql_conn) -> None:
    reg = belay.Registry()

    @belay.worker(name="journal", registry=reg)
    def job(ctx: belay.Context) -> list[Any]:
        return [
            ctx.step("zeta", lambda: {"doc": "z", "n": [1, 2]},
                     cost=belay.Cost(usd=0.25, tokens=100)),
            ctx.step("alpha", lambda: "plain text", cost={"usd": 0.1, "tokens": 7}),
            ctx.step("mid", lambda: 42, cost={"tokens": 5}),
            ctx.step("free", lambda: [True, None, 1.5]),
        ]

    j = client.enqueue(job)
    assert drain(client, reg) == {"succeeded": 1}
    # seq is the order of journaling, not of names; each value is its JSON envelope.
    assert journal(sql_conn, j.id) == [
        (1, "zeta", {"doc": "z", "n": [1, 2]}, 250_000, 100),
        (2, "alpha", "plain text", 100_000, 7),
        (3, "mid", 42, 0, 5),
        (4, "free", [True, None, 1.5], 0, 0),
    ]
    raw = sql_conn.execute("SELECT value FROM belay_steps WHERE job_id = %s AND name = 'zeta'",
                           (j.id,)).fetchone()
    assert raw is not None and bytes(raw[0])[0] != 131  # JSON, never ETF (DESIGN.md)
    assert spend(sql_conn, j.id) == (350_000, 112)
    assert client.get_job(j.id).result == [  # type: ignore[union-attr]
        {"doc": "z", "n": [1, 2]}, "plain text", 42, [True, None, 1.5]]
    # belay's own reader agrees with the table.
    assert [(s.seq, s.name, s.value, s.usd_micros, s.tokens) for s in client.steps(j.id)] == \
        journal(sql_conn, j.id)


def test_a_later_attempt_gets_journaled_values_without_running_them(client, sql_conn) -> None:
    """§11.3: a journaled step's function never runs again; its cost is paid once."""
    reg = belay.Registry()
    calls: list[str] = []
    seen: dict[int, list[Any]] = {}

    @belay.worker(name="replay", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> list[Any]:
        cost = belay.Cost(usd=0.1, tokens=10)
        got = [ctx.step(n, counted(calls, n, {"step": n, "attempt": ctx.attempt}), cost=cost)
               for n in ("a", "b")]
        seen[ctx.attempt] = list(got)
        if ctx.attempt == 1:
            raise RuntimeError("crashed after two steps")
        got.append(ctx.step("c", counted(calls, "c", {"step": "c", "attempt": ctx.attempt}),
                            cost=cost))
        return got

    j = client.enqueue(job)
    assert drain(client, reg) == {"retry": 1, "succeeded": 1}
    assert calls == ["a", "b", "c"]
    # Attempt 2 saw attempt 1's values, not values of its own.
    assert seen[2] == seen[1] == [{"step": "a", "attempt": 1}, {"step": "b", "attempt": 1}]
    assert client.get_job(j.id).result == [  # type: ignore[union-attr]
        {"step": "a", "attempt": 1}, {"step": "b", "attempt": 1}, {"step": "c", "attempt": 2}]
    assert [(seq, name) for seq, name, *_ in journal(sql_conn, j.id)] == [
        (1, "a"), (2, "b"), (3, "c")]
    assert spend(sql_conn, j.id) == (300_000, 30)  # five step calls, three paid


@pytest.mark.parametrize(
    "value", [{"error": "rate limited", "status": 429}, None, False, 0, "", [], {}],
    ids=["error-dict", "None", "False", "0", "empty-str", "empty-list", "empty-dict"],
)
def test_error_shaped_and_falsy_values_are_memoized_like_any_other(client, sql_conn,
                                                                   value) -> None:
    reg = belay.Registry()
    calls: list[int] = []

    @belay.worker(name="falsy", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> dict[str, Any]:
        got = ctx.step("probe", counted(calls, ctx.attempt, value))
        if ctx.attempt == 1:
            raise RuntimeError("retry")
        return {"got": got}

    j = client.enqueue(job)
    assert drain(client, reg) == {"retry": 1, "succeeded": 1}
    assert calls == [1]  # attempt 2 replayed it, falsy or not
    assert client.get_job(j.id).result == {"got": value}  # type: ignore[union-attr]
    assert journal(sql_conn, j.id) == [(1, "probe", value, 0, 0)]  # JSON, even for None


def test_a_raising_step_journals_nothing_and_its_attempt_retries(client, sql_conn,
                                                                 clock) -> None:
    reg = belay.Registry()
    calls: list[int] = []
    propagated: list[BaseException] = []

    def flaky() -> dict[str, bool]:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("provider timed out")
        return {"ok": True}

    @belay.worker(name="flaky", backoff=lambda n: 60.0, registry=reg)
    def job(ctx: belay.Context) -> Any:
        try:
            return ctx.step("call", flaky, cost=belay.Cost(usd=0.5, tokens=100))
        except TimeoutError as exc:
            propagated.append(exc)
            raise

    j = client.enqueue(job)
    assert drain(client, reg) == {"retry": 1}
    assert [str(e) for e in propagated] == ["provider timed out"]  # the fn's own exception
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"]) == ("ready", 1)
    assert row["errors"][0]["error"] == "TimeoutError: provider timed out"
    assert journal(sql_conn, j.id) == [] and spend(sql_conn, j.id) == (0, 0)

    clock.advance(60)
    assert drain(client, reg) == {"succeeded": 1}
    assert len(calls) == 2  # unrecorded, so it ran again
    assert journal(sql_conn, j.id) == [(1, "call", {"ok": True}, 500_000, 100)]
    assert spend(sql_conn, j.id) == (500_000, 100)


# -- spend (§8.2, §2 micro-dollars) ------------------------------------------------------------


def test_spend_adds_each_journaled_cost_exactly_in_micro_dollars(client, sql_conn) -> None:
    reg = belay.Registry()
    costs: list[Any] = [belay.Cost(usd=0.1, tokens=1)] * 10 + [
        {"usd": 0.7, "tokens": 3}, belay.Cost(usd=0.07), {"usd": 0.000001}, {"usd": 2}]

    @belay.worker(name="pennies", registry=reg)
    def job(ctx: belay.Context) -> None:
        for n, cost in enumerate(costs):
            ctx.step(f"s{n}", lambda: None, cost=cost)

    j = client.enqueue(job)
    assert drain(client, reg) == {"succeeded": 1}
    # Ten float 0.1s sum to 0.9999999999999999 dollars; in micros they are exact.
    assert [usd for *_, usd, _ in journal(sql_conn, j.id)] == \
        [100_000] * 10 + [700_000, 70_000, 1, 2_000_000]
    assert spend(sql_conn, j.id) == (3_770_001, 13)
    assert client.get_job(j.id).spent_usd_micros == 3_770_001  # type: ignore[union-attr]


# -- budgets (§8.2, §11.4) -----------------------------------------------------------------------


BUDGETS = {
    # budget, cost per step, the spend after three steps
    "usd": ({"usd": 0.5}, belay.Cost(usd=0.2), (600_000, 0)),
    "tokens": ({"tokens": 1000}, belay.Cost(tokens=400), (0, 1200)),
}


@pytest.mark.parametrize("which", list(BUDGETS))
def test_five_steps_against_a_budget_for_two_and_a_half_fail_after_exactly_three(
    client, sql_conn, which
) -> None:
    """The soak's budget invariant: five $0.20 steps against $0.50 journal three
    (the third crosses and is kept: it was paid for) and the job fails — it
    does not retry, however many attempts are left."""
    budget, cost, spent = BUDGETS[which]
    reg = belay.Registry()
    calls: list[int] = []

    @belay.worker(name="budgeted", max_attempts=20, backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        for n in range(1, 6):
            ctx.step(f"call-{n}", counted(calls, n, {"n": n}), cost=cost)
        return "finished"

    j = client.enqueue(job, budget=budget)
    assert drain(client, reg) == {"failed": 1}
    assert calls == [1, 2, 3]
    assert names(sql_conn, j.id) == ["call-1", "call-2", "call-3"]
    assert spend(sql_conn, j.id) == spent
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"], row["result"]) == ("failed", 1, None)
    assert row["finished_at"] is not None
    [entry] = row["errors"]
    assert (entry["error"], entry["step"], entry["attempt"]) == ("budget_exceeded", "call-3", 1)
    assert (entry["spent_usd_micros"], entry["spent_tokens"]) == spent


def test_spend_exactly_at_the_budget_does_not_fail(client, sql_conn) -> None:
    """Strictly greater fails; equal is within budget — also at the pre-flight
    of the free step that follows."""
    reg = belay.Registry()

    @belay.worker(name="exact", registry=reg)
    def job(ctx: belay.Context) -> str:
        for n in range(1, 4):
            ctx.step(f"call-{n}", lambda: "ok", cost=belay.Cost(usd=0.2, tokens=400))
        ctx.step("free", lambda: "ok")
        return "finished"

    j = client.enqueue(job, budget={"usd": 0.6, "tokens": 1200})
    assert drain(client, reg) == {"succeeded": 1}
    assert spend(sql_conn, j.id) == (600_000, 1200)
    row = job_row(sql_conn, j.id)
    assert (row["budget_usd_micros"], row["budget_tokens"]) == (600_000, 1200)
    assert len(journal(sql_conn, j.id)) == 4 and row["errors"] == []


@pytest.mark.parametrize("which", ["usd", "tokens"])
def test_preflight_fails_an_overspent_job_at_its_next_miss_without_running_it(
    client, sql_conn, which
) -> None:
    """§8.2 pre-flight: the state left by a crash between journaling the crossing
    step and the failing ack (written here with SQL). The journal hit still
    replays; the next miss fails the job before its function runs."""
    reg = belay.Registry()
    calls: list[str] = []
    replayed: list[Any] = []

    @belay.worker(name="overspent", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        replayed.append(ctx.step("call-1", counted(calls, "call-1", "fresh")))
        ctx.step("call-2", counted(calls, "call-2", "never"))
        return "finished"

    budget = {"usd": 0.5} if which == "usd" else {"tokens": 1000}
    usd, tokens = (600_000, 0) if which == "usd" else (0, 1001)
    j = client.enqueue(job, budget=budget)
    sql_conn.execute(
        "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at) "
        "VALUES (%s, 1, 'call-1', %s, %s, %s, %s)", (j.id, b'"journaled"', usd, tokens, START))
    sql_conn.execute("UPDATE belay_jobs SET spent_usd_micros = %s, spent_tokens = %s "
                     "WHERE id = %s", (usd, tokens, j.id))

    assert drain(client, reg) == {"failed": 1}
    assert calls == []
    assert replayed == ["journaled"]
    [entry] = job_row(sql_conn, j.id)["errors"]
    assert (entry["error"], entry["step"]) == ("budget_exceeded", "call-2")
    assert names(sql_conn, j.id) == ["call-1"] and spend(sql_conn, j.id) == (usd, tokens)


def test_a_crossing_whose_failing_ack_was_lost_fails_on_the_next_attempt(client, sql_conn,
                                                                         clock) -> None:
    """The same, arrived at for real: attempt 1 stalls while running the
    crossing step, its lease is reclaimed, and it still journals the step (the
    journal belongs to the job, not the attempt) before its failing ack goes
    stale. Attempt 2 replays three steps and must not buy a fourth."""
    reg = belay.Registry()
    calls: list[tuple[int, int]] = []

    @belay.worker(name="crossing", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        for n in range(1, 6):
            def work(n: int = n) -> dict[str, int]:
                calls.append((ctx.attempt, n))
                if (ctx.attempt, n) == (1, 3):
                    lapse_and_reclaim(client, clock, reg)
                return {"n": n}
            ctx.step(f"call-{n}", work, cost=belay.Cost(usd=0.2))
        return "finished"

    j = client.enqueue(job, budget={"usd": 0.5})
    assert drain(client, reg) == {"stale": 1, "failed": 1}
    assert calls == [(1, 1), (1, 2), (1, 3)]
    assert names(sql_conn, j.id) == ["call-1", "call-2", "call-3"]
    assert spend(sql_conn, j.id) == (600_000, 0)
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"]) == ("failed", 2)
    assert [(e["error"], e["attempt"]) for e in row["errors"]] == [
        ("lease_expired", 1), ("budget_exceeded", 2)]
    assert row["errors"][1]["step"] == "call-4"


# -- racing duplicates (§11.3) -------------------------------------------------------------------


@pytest.mark.parametrize("race", ["concurrent", "sequential"])
def test_put_step_from_two_connections_keeps_the_first_value_and_pays_once(
    db_url, sql_conn, race
) -> None:
    """A zombie attempt and the live one journal the same step. Concurrent: the
    second INSERT waits on the first's uncommitted row, then does nothing."""
    job_id = running_job(sql_conn)
    results: dict[str, Any] = {}

    def put(label: str, conn: Conn) -> dict[str, Any] | None:
        return store.put_step(conn, job_id, "llm", json.dumps({"by": label}).encode(),
                              250_000, 40, START)

    with psycopg.connect(db_url) as first, psycopg.connect(db_url) as second:
        results["first"] = put("first", first)  # its transaction stays open
        if race == "sequential":
            first.commit()
            results["second"] = put("second", second)
            second.commit()
        else:
            def run_second() -> None:
                results["second"] = put("second", second)
                second.commit()

            thread = threading.Thread(target=run_second)
            thread.start()
            wait_until(lambda: lock_waiters(sql_conn) == 1, "the second put_step waits")
            first.commit()
            thread.join(10)
            assert not thread.is_alive()

    assert results["first"]["journaled"] is True
    assert results["second"]["journaled"] is False
    # Both report the job's spend: one step's worth.
    for label in ("first", "second"):
        assert (results[label]["spent_usd_micros"], results[label]["spent_tokens"]) == \
            (250_000, 40)
    assert journal(sql_conn, job_id) == [(1, "llm", {"by": "first"}, 250_000, 40)]
    assert spend(sql_conn, job_id) == (250_000, 40)


def quick_worker(client: belay.Belay, reg: belay.Registry) -> belay.Worker:
    """A threaded worker on "default" that polls fast and never sweeps on its own."""
    return belay.Worker(["default"], client=client, registry=reg, poll_interval=0.05,
                        busy_poll=0.01, sweep_interval=3600.0, shutdown_grace=5.0)


def lock_waiters(conn: Conn) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_step_journaled_by_another_run_meanwhile_returns_that_runs_value(
    client, sql_conn, db_url
) -> None:
    """While this run's fn works, another run of the job (a zombie) journals the
    same step and pays for it. ctx.step returns the journaled value — every
    run must see one value per step — and adds no spend of its own."""
    reg = belay.Registry()

    def work_while_another_run_journals(job_id: int) -> dict[str, str]:
        with psycopg.connect(db_url) as other, other.transaction():
            other.execute(
                "INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, "
                "inserted_at) VALUES (%s, 1, 'turn', %s, 300000, 30, %s)",
                (job_id, b'{"by": "the other run"}', START))
            other.execute("UPDATE belay_jobs SET spent_usd_micros = spent_usd_micros + 300000, "
                          "spent_tokens = spent_tokens + 30 WHERE id = %s", (job_id,))
        return {"by": "this run"}

    @belay.worker(name="raced", registry=reg)
    def job(ctx: belay.Context) -> Any:
        got = ctx.step("turn", lambda: work_while_another_run_journals(ctx.id),
                       cost=belay.Cost(usd=0.5, tokens=50))
        again = ctx.step("turn", lambda: {"by": "a third run"})
        return [got, again]

    j = client.enqueue(job)
    assert drain(client, reg) == {"succeeded": 1}
    assert client.get_job(j.id).result == [  # type: ignore[union-attr]
        {"by": "the other run"}, {"by": "the other run"}]
    assert journal(sql_conn, j.id) == [(1, "turn", {"by": "the other run"}, 300_000, 30)]
    assert spend(sql_conn, j.id) == (300_000, 30)


# -- cooperative cancel (§8.6) -------------------------------------------------------------------


def test_a_cancel_request_stops_a_running_job_at_its_next_step_miss(client, sql_conn) -> None:
    reg = belay.Registry()
    between, go = threading.Event(), threading.Event()
    calls: list[str] = []
    swallowed: list[BaseException] = []
    stopped: list[int] = []

    @belay.worker(name="cancellable", registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("first", counted(calls, "first", 1))
        between.set()
        if not go.wait(10):
            raise AssertionError("the test never let the job go on")
        # A journal hit is a replay, not a boundary where work would be paid for.
        assert ctx.step("first", counted(calls, "first again", 2)) == 1
        try:
            try:
                ctx.step("second", counted(calls, "second", 2))
            except Exception as exc:  # what user code often does
                swallowed.append(exc)
        except CancelRequested:
            stopped.append(ctx.attempt)
            raise
        return "not cancelled"

    ended: queue.SimpleQueue[JobEnd] = queue.SimpleQueue()
    worker = quick_worker(client, reg)
    worker.on_job_end(ended.put)
    j = client.enqueue(job)
    with worker:
        assert between.wait(10)
        assert client.cancel_job(j.id) == "requested"
        flagged = job_row(sql_conn, j.id)
        assert (flagged["state"], flagged["cancel_requested"]) == ("running", True)
        go.set()
        end = ended.get(timeout=10)
    assert end.outcome == "cancelled"
    assert calls == ["first"]
    assert swallowed == [] and stopped == [1]
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"], row["result"]) == ("cancelled", 1, None)
    assert row["finished_at"] is not None
    assert [e["reason"] for e in row["errors"]] == ["cancel_requested"]
    assert names(sql_conn, j.id) == ["first"]
    assert issubclass(CancelRequested, BaseException)
    assert not issubclass(CancelRequested, Exception)


@pytest.mark.parametrize("how", ["raises", "lease_lapses"])
def test_a_cancel_request_survives_the_attempt_that_did_not_honour_it(client, sql_conn, clock,
                                                                      how) -> None:
    """§8.6: the attempt that got the request fails (or is reclaimed) without
    reaching a step: instead of a retry, the job ends cancelled there — no
    further attempt starts, so nothing of the job runs again. An operator's
    retry afterwards clears the flag and the job completes."""
    reg = belay.Registry()
    calls: list[tuple[int, str]] = []

    @belay.worker(name="doomed", backoff=no_backoff, registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("first", lambda: calls.append((ctx.attempt, "first")) or 1)
        if ctx.attempt == 1:
            assert client.cancel_job(ctx.id) == "requested"  # the operator, meanwhile
            if how == "raises":
                raise RuntimeError("an unrelated failure")
            lapse_and_reclaim(client, clock, reg)
            return "a zombie's result"
        ctx.step("second", lambda: calls.append((ctx.attempt, "second")) or 2)
        return "completed"

    j = client.enqueue(job)
    assert drain(client, reg, max_jobs=1) == (
        {"cancelled": 1} if how == "raises" else {"stale": 1})
    assert drain(client, reg) == {}  # no attempt 2: nothing is claimable
    assert calls == [(1, "first")]
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"], row["cancel_requested"]) == ("cancelled", 1, True)
    # The attempt's own error (or the lapsed lease), then the cancel that ended it.
    assert row["errors"][-2]["error"].startswith(
        "RuntimeError" if how == "raises" else "lease_expired")
    assert row["errors"][-1] == {"reason": "cancel_requested", "attempt": 1}

    client.retry_job(j.id)
    assert job_row(sql_conn, j.id)["cancel_requested"] is False
    assert drain(client, reg) == {"succeeded": 1}
    assert [name for _, name in calls] == ["first", "second"]
    assert client.get_job(j.id).result == "completed"  # type: ignore[union-attr]


# -- validation and interruption -------------------------------------------------------------


def nothing_journaled(conn: Conn, job_id: int) -> bool:
    return journal(conn, job_id) == [] and spend(conn, job_id) == (0, 0)


@pytest.mark.parametrize(("name", "message"), [
    ("", "non-empty string"),
    (None, "non-empty string"),
    (7, "non-empty string"),
    (b"bytes", "non-empty string"),
    ("$sleep:nap", "reserved"),
    ("$anything", "reserved"),
])
def test_a_bad_step_name_is_refused_before_anything_runs(ctx, sql_conn, name, message) -> None:
    calls: list[int] = []
    with pytest.raises(belay.ValidationError, match=message):
        ctx.step(name, counted(calls, 1, "v"))
    assert calls == [] and nothing_journaled(sql_conn, ctx.id)


def test_a_step_name_with_a_nul_is_a_validation_error(ctx, sql_conn) -> None:
    calls: list[int] = []
    with pytest.raises(belay.ValidationError, match="step name"):
        ctx.step("turn\x001", counted(calls, 1, "v"))
    assert calls == [] and nothing_journaled(sql_conn, ctx.id)


def test_a_step_inside_a_step_is_refused(ctx, sql_conn) -> None:
    calls: list[str] = []

    def outer() -> str:
        calls.append("outer")
        ctx.step("inner", counted(calls, "inner", "v"))
        return "outer value"

    with pytest.raises(belay.ValidationError, match="inside another step"):
        ctx.step("outer", outer)
    assert calls == ["outer"] and nothing_journaled(sql_conn, ctx.id)
    # The refusal leaves the context usable.
    assert ctx.step("after", lambda: "fine") == "fine"
    assert names(sql_conn, ctx.id) == ["after"]


@pytest.mark.parametrize(("cost", "message"), [
    ({"dollars": 1}, "unknown cost key"),
    ({"usd": 0.1, "tokens": 1, "eur": 2}, "unknown cost key"),
    ({"usd": -0.01}, ">= 0"),
    (belay.Cost(usd=-1.0), ">= 0"),
    (belay.Cost(usd=float("nan")), "finite"),
    ({"usd": "0.10"}, "number of dollars"),
    (belay.Cost(tokens=-1), "integer from 0"),
    (belay.Cost(tokens=1.5), "integer from 0"),  # type: ignore[arg-type]
    (belay.Cost(tokens=True), "integer from 0"),
    ({"tokens": "5"}, "integer from 0"),
    ("cheap", "belay.Cost or a dict"),
])
def test_a_bad_cost_is_refused_before_the_step_runs(ctx, sql_conn, cost, message) -> None:
    calls: list[int] = []
    with pytest.raises(belay.ValidationError, match=message):
        ctx.step("priced", counted(calls, 1, "v"), cost=cost)
    assert calls == [] and nothing_journaled(sql_conn, ctx.id)


def test_a_token_count_beyond_bigint_is_refused_before_the_step_runs(ctx, sql_conn) -> None:
    calls: list[int] = []
    with pytest.raises(belay.ValidationError, match="tokens"):
        ctx.step("huge", counted(calls, 1, "v"), cost=belay.Cost(tokens=2**63))
    assert calls == [] and nothing_journaled(sql_conn, ctx.id)


def test_a_value_over_1_mib_is_refused_and_nothing_is_journaled(ctx, sql_conn) -> None:
    calls: list[int] = []
    # The JSON envelope of a str is its text plus two quotes.
    at_limit = "x" * (MAX_STEP_VALUE - 2)
    over = "x" * (MAX_STEP_VALUE - 1)
    assert MAX_STEP_VALUE == 1024 * 1024
    with pytest.raises(belay.ValidationError, match="1 MiB"):
        ctx.step("big", counted(calls, 1, over), cost=belay.Cost(usd=0.1))
    assert calls == [1]  # it ran: the size is known only afterwards
    assert nothing_journaled(sql_conn, ctx.id)
    assert ctx.step("big", lambda: at_limit, cost=belay.Cost(usd=0.1)) == at_limit
    row = sql_conn.execute("SELECT length(value) FROM belay_steps WHERE job_id = %s",
                           (ctx.id,)).fetchone()
    assert row == (MAX_STEP_VALUE,)
    assert spend(sql_conn, ctx.id) == (100_000, 0)


class Unserializable:
    pass


def cyclic() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


@pytest.mark.parametrize("make", [Unserializable, lambda: {"x": float("nan")},
                                  lambda: {1, 2}, cyclic],
                         ids=["object", "nan", "set", "cyclic"])
def test_a_value_that_is_not_json_is_a_validation_error(ctx, sql_conn, make) -> None:
    with pytest.raises(belay.ValidationError, match="'shaped'"):
        ctx.step("shaped", make, cost=belay.Cost(usd=0.1))
    assert nothing_journaled(sql_conn, ctx.id)


@pytest.mark.parametrize(("why", "message"), [("lost", "lease lost"), ("timeout", "timed out")])
def test_a_run_that_lost_its_lease_or_timed_out_is_interrupted_before_fn(
    client, sql_conn, why, message
) -> None:
    job = client.get_job(running_job(sql_conn))
    execution = Execution(job, None, None)
    ctx = Context(execution, client)
    assert ctx.step("before", lambda: "ok") == "ok"
    assert execution.end(why)
    calls: list[int] = []
    with pytest.raises(belay.Interrupted, match=message):
        ctx.step("after", counted(calls, 1, "v"), cost=belay.Cost(usd=1))
    assert calls == []
    assert names(sql_conn, job.id) == ["before"] and spend(sql_conn, job.id) == (0, 0)


def test_a_timed_out_job_stops_at_its_next_step_in_a_real_worker(client, sql_conn) -> None:
    reg = belay.Registry()
    calls: list[str] = []
    swallowed: list[BaseException] = []

    @belay.worker(name="slowpoke", timeout=0.3, backoff=lambda n: 1000.0, registry=reg)
    def job(ctx: belay.Context) -> str:
        ctx.step("first", counted(calls, "first", 1))
        stop = threading.Event()
        for _ in range(500):  # the job's own slow work, unaware of the clock
            if ctx.interrupted:
                break
            stop.wait(0.01)
        try:
            ctx.step("second", counted(calls, "second", 2))
        except Exception as exc:
            swallowed.append(exc)
        return "too late"

    ended: queue.SimpleQueue[JobEnd] = queue.SimpleQueue()
    worker = quick_worker(client, reg)
    worker.on_job_end(ended.put)
    j = client.enqueue(job)
    with worker:
        end = ended.get(timeout=10)
    assert end.outcome == "timeout"
    assert isinstance(end.exception, belay.Interrupted)
    assert calls == ["first"] and swallowed == []
    assert names(sql_conn, j.id) == ["first"]
    row = job_row(sql_conn, j.id)
    assert (row["state"], row["attempt"]) == ("ready", 1)
    assert row["errors"][0]["error"].startswith("timeout")


def test_budget_and_cancel_signals_are_base_exceptions() -> None:
    """A user's ``except Exception:`` around a step must not swallow either."""
    for exc_type in (BudgetExceeded, CancelRequested, belay.Interrupted):
        assert issubclass(exc_type, BaseException) and not issubclass(exc_type, Exception)


# -- kill -9 mid-loop (issue 4, "Tests must show") ---------------------------------------------


LOOP = "steps.loop"  # tests/step_jobs.py


def start_worker(procs: list[Proc], db_url: str, tmp_path: Path, node: str) -> Proc:
    proc = Proc([
        sys.executable, "-W", "error", "-m", "belay", "worker", "--url", db_url,
        "--import", "tests.step_jobs", "--queue", "q=2", "--lease-ttl", "1",
        "--sweep-interval", "0.2", "--poll-interval", "0.1", "--node-id", node,
    ], tmp_path / f"{node}.log")
    procs.append(proc)
    return proc


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_kill_9_mid_loop_replays_committed_steps_and_pays_once(db_url, sql_conn, tmp_path,
                                                               procs) -> None:
    conn = sql_conn
    conn.execute("CREATE TABLE step_effects (job_id bigint, name text, attempt int, pid int)")

    def effects(job_id: int) -> list[tuple[str, int, int]]:
        return [(r[0], r[1], r[2]) for r in conn.execute(
            "SELECT name, attempt, pid FROM step_effects WHERE job_id = %s "
            "ORDER BY attempt, name", (job_id,))]

    with belay.Belay(db_url) as producer:
        job = producer.enqueue(LOOP, {"steps": 6, "pause": 0.25, "usd": 0.1, "tokens": 7},
                               queue="q")
        a = start_worker(procs, db_url, tmp_path, "node-a")
        wait_until(lambda: effects(job.id), "A starts the job", timeout=15)
        b = start_worker(procs, db_url, tmp_path, "node-b")  # boots while A works
        wait_until(lambda: len(names(conn, job.id)) >= 2, "A journals two steps", timeout=10)
        a.send(signal.SIGKILL)
        assert a.wait(10) == -signal.SIGKILL
        before = names(conn, job.id)  # A is dead: this is what it committed
        assert 2 <= len(before) < 6, f"the kill did not land mid-loop: {before}"

        wait_until(lambda: job_row(conn, job.id)["state"] == "succeeded",
                   "B reclaims and finishes the job", timeout=15)
        result = producer.get_job(job.id).result  # type: ignore[union-attr]

    row = job_row(conn, job.id)
    assert row["attempt"] == 2
    assert [(e["error"], e["attempt"]) for e in row["errors"]] == [("lease_expired", 1)]
    steps = journal(conn, job.id)
    all_names = [f"s{n}" for n in range(1, 7)]
    assert [(seq, name) for seq, name, *_ in steps] == list(enumerate(all_names, 1))
    assert {(usd, tokens) for *_, usd, tokens in steps} == {(100_000, 7)}
    assert spend(conn, job.id) == (600_000, 42)  # six steps paid once each, none twice

    runs = Counter(name for name, _, _ in effects(job.id))
    # Steps journaled before the kill never ran again.
    for name in before:
        assert [e for e in effects(job.id) if e[0] == name] == [(name, 1, a.pid)]
    # The one step in flight at the kill may have run on A without its journal
    # write committing; B then legitimately runs it again (at-least-once for the
    # un-journaled step, §11.3). That is allowed for that single step only.
    in_flight = f"s{len(before) + 1}"
    for name in all_names[len(before):]:
        expected = [(name, 2, b.pid)]
        if name == in_flight and runs[name] == 2:
            expected = [(name, 1, a.pid), (name, 2, b.pid)]
        assert [e for e in effects(job.id) if e[0] == name] == expected
    assert sum(runs.values()) <= 7

    # The result is built from the journal: A's values for its steps, B's for the rest.
    assert result["total"] == sum(n * n for n in range(1, 7))
    assert result["values"] == [value for _, _, value, _, _ in steps]
    assert [(v["attempt"], v["pid"]) for v in result["values"]] == \
        [(1, a.pid)] * len(before) + [(2, b.pid)] * (6 - len(before))


def test_a_step_value_that_cannot_be_journaled_fails_the_job_at_once(client) -> None:
    """Retrying would pay for the same step again and fail the same way."""
    reg = belay.Registry()
    calls: list[int] = []

    @belay.worker(name="t.unjournalable", registry=reg, max_attempts=5)
    def unjournalable(ctx: belay.Context) -> None:
        ctx.step("paid", lambda: calls.append(1) or {1, 2})  # a set: not JSON

    job = client.enqueue("t.unjournalable")
    assert drain(client=client, registry=reg) == {"failed": 1}
    row = client.get_job(job.id)
    assert row is not None and row.attempt == 1 and calls == [1]
    assert row.errors[-1]["error"].startswith("bad step value:")


def test_steps_may_run_from_several_threads_of_one_job(client) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.parallel_steps", registry=reg)
    def parallel(ctx: belay.Context) -> list[int]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda n: ctx.step(f"part-{n}", lambda: n * n), range(4)))

    job = client.enqueue("t.parallel_steps")
    assert drain(client=client, registry=reg) == {"succeeded": 1}
    assert client.get_job(job.id).result == [0, 1, 4, 9]
    assert sorted(s.name for s in client.steps(job.id)) == [f"part-{n}" for n in range(4)]
