"""Worker functions whose runs ``tests/test_replay.py`` records and then replays
(also imported by ``belay replay --import tests.replay_jobs`` in its CLI tests).

The recorded versions register in the default registry, where the CLI finds
them; "changed code" versions of a kind register in registries of their own
(:func:`changed_pipeline` and friends), so a test replays a recording with
code that has moved on. ``CALLS`` counts every execution of a step's function
in this process, by step name: a replay must leave it untouched.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import belay

QUEUE = "replay"
KIDS = "replay-kids"
PIPELINE = "replay.pipeline"
FAILING = "replay.failing"
PARENT = "replay.parent"
KID = "replay.kid"
APPROVAL = "replay.approval"
NAPPER = "replay.napper"
SLOW = "replay.slow"
SECRET = "replay.secret"
CHUNKY = "replay.chunky"

#: Set to "audit" to make the default pipeline ask for a step its recordings lack.
VARIANT_ENV = "BELAY_REPLAY_TEST_VARIANT"

RECORDED_ORDER = ("fetch", "parse", "summarize")
PIPELINE_INPUT = {"title": "Belay", "text": "a durable job engine on postgres"}

CALLS: Counter[str] = Counter()
#: ``replay.slow`` sets ENTERED inside its step "slow", then waits for GATE.
ENTERED = threading.Event()
GATE = threading.Event()


def no_backoff(attempt: int) -> float:
    return 0.0


def counted(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, counting each run in ``CALLS[name]``."""
    def run() -> Any:
        CALLS[name] += 1
        return fn()
    return run


# -- The pipeline: three costed steps, an event per step, a debit ----------------------


def _fetch(ctx: belay.Context, values: dict[str, Any]) -> Any:
    return {"title": ctx.input["title"], "text": ctx.input["text"]}


def _parse(ctx: belay.Context, values: dict[str, Any]) -> Any:
    return {"words": len(values["fetch"]["text"].split())}


def _summarize(ctx: belay.Context, values: dict[str, Any]) -> Any:
    return f"{values['fetch']['title']}: {values['parse']['words']} words"


def _audit(ctx: belay.Context, values: dict[str, Any]) -> Any:
    return "audited"


STEPS: dict[str, Callable[[belay.Context, dict[str, Any]], Any]] = {
    "fetch": _fetch, "parse": _parse, "summarize": _summarize, "audit": _audit,
}
COSTS: dict[str, belay.Cost | None] = {
    "fetch": belay.Cost(usd=0.001, tokens=10), "parse": belay.Cost(tokens=5),
    "summarize": belay.Cost(usd=0.02, tokens=400), "audit": None,
}


def run_pipeline(ctx: belay.Context, order: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in order:
        work = counted(name, functools.partial(STEPS[name], ctx, values))
        values[name] = ctx.step(name, work, cost=COSTS[name])
        ctx.emit({"step": name})
    ctx.debit("llm-tokens", 415, period=60)
    return {"summary": values.get("summarize"), "asked": sorted(values)}


@belay.worker(name=PIPELINE, queue=QUEUE, backoff=no_backoff)
def pipeline(ctx: belay.Context) -> dict[str, Any]:
    order: Sequence[str] = RECORDED_ORDER
    variant = os.environ.get(VARIANT_ENV)
    if variant == "audit":
        order = ("fetch", "parse", "audit", "summarize")
    elif variant == "skip-parse":
        order = ("fetch", "summarize")
    return run_pipeline(ctx, order)


def changed_pipeline(order: Sequence[str]) -> belay.Registry:
    """A registry whose ``replay.pipeline`` asks for ``order``'s steps."""
    registry = belay.Registry()

    @belay.worker(name=PIPELINE, queue=QUEUE, registry=registry)
    def changed(ctx: belay.Context) -> dict[str, Any]:
        return run_pipeline(ctx, order)

    return registry


def pipeline_with(body: Callable[[belay.Context], Any]) -> belay.Registry:
    """A registry whose ``replay.pipeline`` runs ``body``."""
    registry = belay.Registry()
    belay.worker(name=PIPELINE, queue=QUEUE, registry=registry)(body)
    return registry


def expects_a_new_field(ctx: belay.Context) -> Any:
    """Code that moved on: it reads a field the recorded ``fetch`` value lacks."""
    fetched = ctx.step("fetch", counted("fetch", lambda: {"body": "new shape"}))
    return fetched["body"]


def enqueues_directly(ctx: belay.Context) -> Any:
    ctx.step("fetch", counted("fetch", lambda: None))
    return ctx.client.enqueue(KID, {"n": 1}).id


def spawns_new_children(ctx: belay.Context) -> Any:
    ctx.step("fetch", counted("fetch", lambda: None))
    return ctx.spawn_many("audits", KID, [{"n": 1}, {"n": 2}])


def writes_through_the_client(ctx: belay.Context) -> Any:
    ctx.step("fetch", counted("fetch", lambda: None))
    with ctx.client.connection() as conn:
        conn.execute("INSERT INTO belay_events (job_id, seq, payload) VALUES (%s, 99, '{}')",
                     (ctx.id,))
    return "wrote"


# -- A job that fails ---------------------------------------------------------------------


def _load(ctx: belay.Context) -> Any:
    return {"rows": ctx.input["rows"]}


def _total(rows: list[Any], *, skip_bad: bool) -> int:
    total = 0
    for number, row in enumerate(rows, 1):
        if not isinstance(row, int):
            if skip_bad:
                continue
            raise ValueError(f"row {number} is not a number: {row!r}")
        total += row
    return total


@belay.worker(name=FAILING, queue=QUEUE, max_attempts=1)
def failing(ctx: belay.Context) -> int:
    loaded = ctx.step("load", counted("load", functools.partial(_load, ctx)))
    return _total(loaded["rows"], skip_bad=False)


def fixed_failing() -> belay.Registry:
    """The failing job's code after the fix: bad rows are skipped."""
    registry = belay.Registry()

    @belay.worker(name=FAILING, queue=QUEUE, max_attempts=1, registry=registry)
    def fixed(ctx: belay.Context) -> int:
        loaded = ctx.step("load", counted("load", functools.partial(_load, ctx)))
        return _total(loaded["rows"], skip_bad=True)

    return registry


# -- Children, signals, steering, sleep ----------------------------------------------------


@belay.worker(name=KID, queue=KIDS)
def kid(ctx: belay.Context) -> int:
    return int(ctx.input["n"]) * 10


@belay.worker(name=PARENT, queue=QUEUE)
def parent(ctx: belay.Context) -> list[Any]:
    kids = ctx.map_children("fan", KID, ctx.input["inputs"])
    return [k.result for k in kids]


@belay.worker(name=APPROVAL, queue=QUEUE)
def approval(ctx: belay.Context) -> dict[str, Any]:
    draft = ctx.step("draft", counted("draft", lambda: "v1"))
    answer = ctx.await_signal("approve", timeout=3600)
    if answer is belay.TIMEOUT:
        return {"expired": True, "draft": draft}
    tone = ctx.steering()
    published = ctx.step("publish", counted("publish", lambda: f"{draft} by {answer['by']}"))
    return {"published": published, "tone": tone}


@belay.worker(name=NAPPER, queue=QUEUE)
def napper(ctx: belay.Context) -> list[Any]:
    before = ctx.step("before", counted("before", lambda: "a"))
    ctx.sleep("cool", 60)
    after = ctx.step("after", counted("after", lambda: "b"))
    return [before, after]


# -- Live, encrypted, chunked -----------------------------------------------------------


def _wait_for_gate() -> int:
    ENTERED.set()
    GATE.wait(30)
    return 41


@belay.worker(name=SLOW, queue=QUEUE)
def slow(ctx: belay.Context) -> int:
    first = ctx.step("first", counted("first", lambda: 1))
    second = ctx.step("slow", counted("slow", _wait_for_gate))
    return int(first) + int(second)


@belay.worker(name=SECRET, queue=QUEUE, encrypted=True)
def secret(ctx: belay.Context) -> str:
    shout = ctx.step("shout", counted("shout", lambda: str(ctx.input["secret"]).upper()))
    return f"{shout}!"


@belay.worker(name=CHUNKY, queue=QUEUE, chunk={"size": 5})
def chunky(contexts: list[belay.Context]) -> dict[int, Any]:
    return {c.id: c.step("double", counted("double", lambda c=c: c.input["n"] * 2))
            for c in contexts}


# -- Code that tries to write past the replay's read-only session (issue 19) -----------

#: The row the escapes try to delete (set by the test), and what the code saw.
ESCAPE: dict[str, Any] = {"victim": 0, "user": None}


def _owner(conn: Any) -> str:
    row = conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'belay_jobs'"
                       ).fetchone()
    return str(row[0])


def _escape_sql(how: str, conn: Any) -> str:
    delete = f"DELETE FROM belay_jobs WHERE id = {int(ESCAPE['victim'])}"
    owner = _owner(conn) if how in ("set role", "session authorization", "set_config") else ""
    return {
        # The exact escape of the review.
        "commit": "COMMIT; SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE; "
                  f"SET default_transaction_read_only=off; BEGIN READ WRITE; {delete}; COMMIT",
        "reset role": "COMMIT; RESET ROLE; SET default_transaction_read_only=off; "
                      f"BEGIN READ WRITE; {delete}; COMMIT",
        "set role": f'COMMIT; SET ROLE "{owner}"; SET default_transaction_read_only=off; '
                    f"BEGIN READ WRITE; {delete}; COMMIT",
        "session authorization": f'COMMIT; SET SESSION AUTHORIZATION "{owner}"; '
                                 f"SET default_transaction_read_only=off; BEGIN READ WRITE; "
                                 f"{delete}; COMMIT",
        "reset all": f"COMMIT; RESET ALL; BEGIN READ WRITE; {delete}; COMMIT",
        "set_config": f"COMMIT; SELECT set_config('role', '{owner}', false), "
                      f"set_config('default_transaction_read_only', 'off', false); {delete}",
        "do block": "COMMIT; SET default_transaction_read_only=off; BEGIN READ WRITE; "
                    f"DO $$ BEGIN {delete}; END $$; COMMIT",
    }[how]


def escapes(how: str) -> belay.Registry:
    """A registry whose ``replay.pipeline`` tries to delete ``ESCAPE["victim"]``."""

    def body(ctx: belay.Context) -> Any:
        ctx.step("fetch", counted("fetch", lambda: None))
        if how == "pool":  # a connection of its own from the client's pool
            with ctx.client._client.connection() as conn:  # type: ignore[attr-defined]
                conn.execute(f"DELETE FROM belay_jobs WHERE id = {int(ESCAPE['victim'])}")
            return "escaped"
        if how == "own connection":
            import psycopg

            with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
                conn.execute("SET default_transaction_read_only = off")
                conn.execute(f"DELETE FROM belay_jobs WHERE id = {int(ESCAPE['victim'])}")
            return "escaped"
        with ctx.client.connection() as conn:
            ESCAPE["user"] = conn.execute("SELECT session_user").fetchone()[0]
            if how == "autocommit":
                conn.execute("COMMIT")
                conn.autocommit = True
                conn.execute("SET default_transaction_read_only = off")
                conn.execute(f"DELETE FROM belay_jobs WHERE id = {int(ESCAPE['victim'])}")
            else:
                conn.execute(_escape_sql(how, conn))
        return "escaped"

    return pipeline_with(body)


ESCAPES = ("commit", "reset role", "set role", "session authorization", "reset all",
           "set_config", "do block", "autocommit", "pool", "own connection")
