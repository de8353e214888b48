"""The soak worker kinds, written against belay's public API only.

Every step body (and every job-level side effect) first records a row in
``soak_effects`` through its own autocommit connection, so the at-least-once
window — effect done, step not yet journaled, worker killed — shows up in the
database instead of vanishing. Results carry the attempt that produced them,
so the checker can tell a late (stale) ack from the last claimed attempt's.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from datetime import datetime, timezone
from typing import Any

import psycopg

import belay

REGISTRY = belay.Registry()

#: Set by soak.worker: this process's tag, database URL and pooler mode.
TAG = "?"
URL = ""
POOLER: str | None = None

BUDGET_USD = 0.5
STEP_USD = 0.2
BUDGET_STEPS = 5
#: With five $0.20 steps against $0.50, the third crosses the cap.
BUDGET_ALLOWED = 3

_local = threading.local()


def connect_options(pooler: str | None) -> dict[str, Any]:
    """psycopg options for the soak's own connections: behind a transaction
    pooler, never a server-side prepared statement (psycopg prepares a query
    after five runs, on a server connection the next transaction may not get)."""
    return {"prepare_threshold": None} if pooler else {}


def _conn() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken:
        conn = psycopg.connect(URL, autocommit=True, connect_timeout=5,
                               application_name=f"soak-effects-{TAG}",
                               **connect_options(POOLER))
        _local.conn = conn
    return conn


def effect(ctx: belay.Context, step: str) -> None:
    """Record one execution of ``step`` by this attempt; raises if the database is away
    (then the step fails and the job retries — the effect simply did not happen)."""
    try:
        _conn().execute(
            "INSERT INTO soak_effects (job_id, step, attempt, tag, at) VALUES (%s, %s, %s, %s, %s)",
            (ctx.id, step, ctx.attempt, TAG, datetime.now(timezone.utc)),
        )
    except psycopg.Error:
        conn = getattr(_local, "conn", None)
        _local.conn = None
        if conn is not None:
            conn.close()
        raise


def _nap(low: float, high: float) -> None:
    time.sleep(random.uniform(low, high))


def _backoff(attempt: int) -> float:
    return 0.2


@belay.worker(name="soak.step", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def step_kind(ctx: belay.Context) -> dict[str, Any]:
    """k memoized steps s1..sk returning n+i; raises after them on attempts <= f.
    Expected result: n*k + k*(k+1)/2."""
    n, k, planned = ctx.input["n"], ctx.input["k"], ctx.input.get("f", 0)
    total = 0
    for i in range(1, k + 1):
        def body(i: int = i) -> int:
            effect(ctx, f"s{i}")
            _nap(0.005, 0.04)
            return int(n + i)

        total += ctx.step(f"s{i}", body)
    if ctx.attempt <= planned:
        raise RuntimeError(f"planned failure on attempt {ctx.attempt}")
    # A long run without the database: behind a cut proxy, this attempt becomes a
    # zombie whose lease lapses while it runs, and whose late ack the fence rejects.
    time.sleep(float(ctx.input.get("nap", 0)))
    return {"value": total, "attempt": ctx.attempt}


@belay.worker(name="soak.child", queue="children", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def child_kind(ctx: belay.Context) -> int:
    effect(ctx, "child")
    _nap(0.005, 0.03)
    return int(ctx.input["v"]) * 2


@belay.worker(name="soak.parent", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def parent_kind(ctx: belay.Context) -> dict[str, Any]:
    """Fan out one child per v, fan in: sorted(v*2 for v in vs)."""
    kids = ctx.map_children("fan", child_kind, [{"v": v} for v in ctx.input["vs"]])
    return {"value": sorted(kid.result for kid in kids), "attempt": ctx.attempt}


@belay.worker(name="soak.flow", queue="flow", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def flow_kind(ctx: belay.Context) -> dict[str, Any]:
    """A workflow member: records its member name; ``fail`` makes it fail for good."""
    effect(ctx, ctx.job.wf_name or "?")
    _nap(0.005, 0.03)
    if ctx.input.get("fail"):
        raise belay.Cancel("planned doom") if ctx.input["fail"] == "cancel" else RuntimeError(
            "planned failure")
    return {"attempt": ctx.attempt}


@belay.worker(name="soak.awaiter", queue="default", max_attempts=50, backoff=_backoff,
              registry=REGISTRY)
def awaiter_kind(ctx: belay.Context) -> dict[str, Any]:
    def pre() -> int:
        effect(ctx, "pre")
        return 1

    got = ctx.step("pre", pre)
    payload = ctx.await_signal("go")
    return {"value": {"w": payload["w"], "pre": got}, "attempt": ctx.attempt}


@belay.worker(name="soak.budget", queue="default", max_attempts=10, backoff=_backoff,
              registry=REGISTRY)
def budget_kind(ctx: belay.Context) -> dict[str, Any]:
    """Five $0.20 steps against a $0.50 budget: must fail after exactly three."""
    for i in range(1, BUDGET_STEPS + 1):
        def body(i: int = i) -> int:
            effect(ctx, f"b{i}")
            _nap(0.005, 0.03)
            return i

        ctx.step(f"b{i}", body, cost=belay.Cost(usd=STEP_USD))
    return {"attempt": ctx.attempt}


@belay.worker(name="soak.unique", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def unique_kind(ctx: belay.Context) -> dict[str, Any]:
    effect(ctx, "uni")
    _nap(0.05, 0.3)
    # Hold the key until the whole burst has been inserted (the driver ledgers
    # it once its four inserts returned), at most 10 s: the checker wants one
    # job per burst. With only the nap, a racer that a loaded machine kept
    # back past the holder's end rightly inserted a second job (the key was
    # free again), which read as two holders at once (soak of issue 38).
    key = ctx.job.unique_key
    deadline = time.monotonic() + 10.0
    while key is not None and time.monotonic() < deadline:
        with contextlib.suppress(psycopg.Error):
            if _conn().execute("SELECT 1 FROM soak_bursts WHERE key = %s",
                               (key,)).fetchone():
                break
        time.sleep(0.05)
    return {"attempt": ctx.attempt}


@belay.worker(name="soak.cron", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def cron_kind(ctx: belay.Context) -> dict[str, Any]:
    effect(ctx, "cron")
    return {"attempt": ctx.attempt}


CRONS = [{"name": "soak-cron", "expression": "* * * * *", "worker": cron_kind,
          "catch_up": 600}]


# -- Issue 38's races: parallel steps under max_cost, cancels during retries,
# -- threads that enqueue ---------------------------------------------------------------

#: Four steps at once, each $0.20 with a $0.20 max_cost, against $0.50: the
#: holds let two run; the others wait for them, then find no room (fail).
PARALLEL_STEPS = 4
PARALLEL_ALLOWED = 2
#: A cancellable job fails its attempts below this one (planned), then succeeds.
CANCELLABLE_SUCCEEDS_AT = 4
#: The authority of a spawner: it may start soak.child jobs on the children queue.
SPAWNER_AUTHORITY = {"kinds": ["soak.child"], "queues": ["children"]}


@belay.worker(name="soak.parallel", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def parallel_kind(ctx: belay.Context) -> dict[str, Any]:
    """``PARALLEL_STEPS`` steps in threads at once under one $0.50 budget: at
    most ``PARALLEL_ALLOWED`` are ever journaled, the job fails budget_exceeded
    and never spends past the cap."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        def body() -> int:
            effect(ctx, f"p{i}")
            _nap(0.05, 0.3)
            return i

        try:
            ctx.step(f"p{i}", body, cost=belay.Cost(usd=STEP_USD),
                     max_cost=belay.Cost(usd=STEP_USD))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, PARALLEL_STEPS + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"attempt": ctx.attempt}


@belay.worker(name="soak.cancellable", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def cancellable_kind(ctx: belay.Context) -> dict[str, Any]:
    """Records each attempt's start, runs a while, fails until attempt
    ``CANCELLABLE_SUCCEEDS_AT``: the driver cancels some of them meanwhile."""
    effect(ctx, "run")
    _nap(0.2, 0.8)
    if ctx.attempt < CANCELLABLE_SUCCEEDS_AT:
        raise RuntimeError(f"planned failure on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


@belay.worker(name="soak.spawner", queue="default", max_attempts=25, backoff=_backoff,
              registry=REGISTRY)
def spawner_kind(ctx: belay.Context) -> dict[str, Any]:
    """A job with an authority that enqueues from threads it starts: from a
    plain thread (no job context: refused), and from one given the job's
    context (bounded by the authority: soak.evil refused, soak.child allowed)."""
    seen: dict[str, str] = {}
    failed: list[BaseException] = []
    key = f"thr:{ctx.id}"

    def enqueue(label: str, kind: str) -> None:
        try:
            job = ctx.client.enqueue(kind, {"v": ctx.id}, queue="children",
                                     unique=belay.Unique(key, mode="always"))
            seen[label] = f"enqueued {job.id}"
        except belay.AuthorityExceeded:
            seen[label] = "refused"
        except BaseException as exc:  # the database away (chaos): the attempt fails
            failed.append(exc)

    plan = [("plain", "soak.child", enqueue),
            ("evil", "soak.evil", belay.propagate(enqueue)),
            ("child", "soak.child", belay.propagate(enqueue))]
    for label, kind, target in plan:
        thread = threading.Thread(target=target, args=(label, kind))
        thread.start()
        thread.join()
    if failed:
        raise failed[0]
    return {"plain": seen.get("plain"), "evil": seen.get("evil"),
            "child": (seen.get("child") or "").split(" ")[0], "attempt": ctx.attempt}
