"""Issue 19 (1): user code that fails while belay describes or records a failure.

A job whose exception can't be turned into text (``__str__`` raises or returns
a non-string, its class name can't be read, its traceback can't be formatted),
a result whose serialization runs code that raises, a chunk return value whose
own methods raise, hooks that raise ``BaseException``: each once crashed the
executor path before the ack, leaving the job ``running`` until its lease
lapsed — attempt after attempt, with nothing recorded but ``lease_expired``.

Every test runs a started worker on the ``clock`` fixture (a ManualClock that
never moves), so no lease can expire: the job ends within its one attempt, with
an error that describes what happened, or the test fails. Waits are on the
worker's ``on_job_end`` events (``Ends``), never on sleeps.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import belay
from belay.runner import JobEnd
from tests.helpers import Ends, job_row
from tests.test_worker import make_worker, running

# -- Exceptions that resist being described ----------------------------------------------


class StrRaises(Exception):
    def __str__(self) -> str:
        raise ValueError("no str for you")


class StrReturnsNumber(Exception):
    def __str__(self) -> str:
        return 42  # type: ignore[return-value]


class Shouty(str):
    """A str subclass whose own methods raise (slicing, replace, encode)."""

    def __getitem__(self, key: Any) -> str:
        raise RuntimeError("no slicing")

    def replace(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        raise RuntimeError("no replace")


class StrReturnsSubclass(Exception):
    def __str__(self) -> str:
        return Shouty("loud message")


class StrRaisesAndItsErrorToo(Exception):
    def __str__(self) -> str:
        raise StrRaises()


class NamelessMeta(type):
    @property
    def __name__(cls) -> str:  # type: ignore[override]
        raise RuntimeError("no name")


class Nameless(Exception, metaclass=NamelessMeta):
    pass


class BaseStrRaises(BaseException):
    """Not an Exception at all, and its __str__ raises one that isn't either."""

    def __str__(self) -> str:
        raise KeyboardInterrupt("from __str__")


class InterruptStrRaises(KeyboardInterrupt):
    def __str__(self) -> str:
        raise ValueError("no str for you")


class ExitStrRaises(SystemExit):
    def __str__(self) -> str:
        raise ValueError("no str for you")


DESCRIBED: list[tuple[Callable[[], BaseException], str]] = [
    (StrRaises, "<exception StrRaises: str() raised ValueError: no str for you>"),
    (StrReturnsNumber,
     "<exception StrReturnsNumber: str() raised TypeError: __str__ returned non-string "
     "(type int)>"),
    (StrReturnsSubclass, "StrReturnsSubclass: loud message"),
    (StrRaisesAndItsErrorToo,
     "<exception StrRaisesAndItsErrorToo: str() raised StrRaises (whose str() raised too)>"),
    (Nameless, "Nameless"),
    (BaseStrRaises, "<exception BaseStrRaises: str() raised KeyboardInterrupt: from __str__>"),
    (InterruptStrRaises, "<exception InterruptStrRaises: str() raised ValueError: no str for "
                         "you>"),
    (ExitStrRaises, "<exception ExitStrRaises: str() raised ValueError: no str for you>"),
]


def run_one(client: belay.Belay, fn: Callable[[belay.Context], Any], *,
            max_attempts: int = 2, hooks: Callable[[belay.Worker], None] | None = None
            ) -> tuple[JobEnd, dict[str, Any]]:
    """Enqueue one job of ``fn``, run it on a started worker, and return its
    ``on_job_end`` event and its row once the worker reported the end."""
    reg = belay.Registry()
    definition = belay.worker(name="hardening.job", max_attempts=max_attempts,
                              backoff=lambda n: 30.0, registry=reg)(fn)
    worker = make_worker(client, reg)
    if hooks is not None:
        hooks(worker)
    ends = Ends(worker)
    job = client.enqueue(definition)
    with running(worker):
        (event,) = ends.wait_for(1)
    with client.connection() as conn:
        return event, job_row(conn, job.id)


@pytest.mark.parametrize(("make", "described"), DESCRIBED,
                         ids=[make.__qualname__ for make, _ in DESCRIBED])
def test_an_exception_that_cant_be_described_is_recorded_in_its_attempt(client, make,
                                                                        described) -> None:
    def job(ctx: belay.Context) -> None:
        raise make()

    event, row = run_one(client, job)
    assert event.outcome == "retry"
    assert (row["state"], row["attempt"], row["lease_until"]) == ("ready", 1, None)
    (error,) = row["errors"]
    assert (error["error"], error["attempt"]) == (described, 1)
    assert "in job" in error["traceback"]


def test_the_last_attempt_of_such_an_exception_fails_the_job(client) -> None:
    def job(ctx: belay.Context) -> None:
        raise StrRaises()

    event, row = run_one(client, job, max_attempts=1)
    assert (event.outcome, row["state"]) == ("failed", "failed")
    assert row["errors"][0]["error"].startswith("<exception StrRaises: str() raised")


class SourceRefused:
    """A module loader whose get_source raises: linecache lets that through,
    so formatting a traceback through such a module raises."""

    def get_source(self, name: str) -> str:
        raise RuntimeError("the loader is broken")


@pytest.fixture
def unformattable() -> Iterator[Callable[[belay.Context], None]]:
    filename = "/nonexistent/hardening_loader_module.py"
    scope: dict[str, Any] = {"__name__": "hardening_loader_module",
                             "__loader__": SourceRefused()}
    exec(compile("def boom(ctx):\n    raise ValueError('plain message')\n", filename, "exec"),
         scope)
    yield scope["boom"]
    linecache.cache.pop(filename, None)


def test_a_traceback_that_cant_be_formatted_still_records_the_error(client,
                                                                     unformattable) -> None:
    event, row = run_one(client, unformattable)
    assert (event.outcome, row["state"]) == ("retry", "ready")
    (error,) = row["errors"]
    assert error["error"] == "ValueError: plain message"
    # The bare frames stand in for the formatted traceback.
    assert 'hardening_loader_module.py", line 2, in boom' in error["traceback"]


class ValuesRaise(dict):  # type: ignore[type-arg]
    def values(self) -> Any:
        raise RuntimeError("values() is broken")


def test_a_result_whose_serialization_raises_fails_the_attempt(client) -> None:
    # A None inside sends the encoder through values(), looking for NaN.
    event, row = run_one(client, lambda ctx: ValuesRaise(answer=None))
    assert (event.outcome, row["state"]) == ("retry", "ready")
    (error,) = row["errors"]
    assert error["error"] == "bad result: RuntimeError: values() is broken"


class Unjsonable:
    def __repr__(self) -> str:
        return "<Unjsonable>"


@pytest.mark.parametrize(("reason", "recorded"), [
    (Unjsonable(), "<Unjsonable>"),
    ("nul\x00inside", "nul\\x00inside"),
])
def test_a_cancel_with_a_reason_jsonb_cant_hold_is_still_cancelled(client, reason,
                                                                    recorded) -> None:
    def job(ctx: belay.Context) -> None:
        raise belay.Cancel(reason)

    event, row = run_one(client, job)
    assert (event.outcome, row["state"]) == ("cancelled", "cancelled")
    assert row["errors"] == [{"reason": recorded}]


def test_a_snooze_subclass_with_an_impossible_delay_is_a_recorded_failure(client) -> None:
    class Forever(belay.Snooze):
        seconds = float("inf")  # type: ignore[assignment]

        def __init__(self) -> None:
            Exception.__init__(self, "forever")

    def job(ctx: belay.Context) -> None:
        raise Forever()

    event, row = run_one(client, job)
    assert (event.outcome, row["state"]) == ("retry", "ready")
    assert row["errors"][0]["error"].startswith("belay could not record Forever: forever: ")


# -- Hooks --------------------------------------------------------------------------------


class HookAbort(BaseException):
    pass


def test_an_on_job_start_hook_raising_a_base_exception_does_not_stop_the_job(client) -> None:
    def hooks(worker: belay.Worker) -> None:
        @worker.on_job_start
        def broken(job: belay.Job) -> None:
            raise HookAbort("metrics down")

    event, row = run_one(client, lambda ctx: "ran", hooks=hooks)
    assert (event.outcome, row["state"]) == ("succeeded", "succeeded")


def test_an_on_job_end_hook_raising_a_base_exception_keeps_a_chunks_other_acks(client) -> None:
    reg = belay.Registry()

    @belay.worker(name="hardening.chunk", registry=reg, max_attempts=2, backoff=lambda n: 30.0,
                  chunk={"size": 3, "gather_ms": 10_000})
    def chunk(contexts: list[belay.Context]) -> dict[int, Any]:
        return {c.id: ValueError(f"job {c.input['n']}") for c in contexts}

    worker = make_worker(client, reg, {"default": 3})

    @worker.on_job_end
    def broken(end: JobEnd) -> None:
        raise SystemExit("hook exits")

    ends = Ends(worker)
    jobs = client.enqueue_many([{"kind": "hardening.chunk", "input": {"n": n}}
                                for n in range(3)])
    with running(worker):
        ends.wait_for(3)
    assert sorted(ends.outcomes().values()) == ["retry"] * 3
    for job in jobs:
        found = client.get_job(job.id)
        assert found is not None and found.state == "ready"
        assert found.errors[0]["error"] == f"ValueError: job {job.input['n']}"


# -- Chunk workers -------------------------------------------------------------------------


class LookupRaises(dict):  # type: ignore[type-arg]
    def __contains__(self, key: object) -> bool:
        raise RuntimeError("no lookups")


@pytest.mark.parametrize("returns", ["undescribable errors", "a broken mapping"])
def test_a_chunks_return_value_that_raises_is_recorded_for_every_job(client, returns) -> None:
    reg = belay.Registry()

    @belay.worker(name="hardening.chunk", registry=reg, max_attempts=2, backoff=lambda n: 30.0,
                  chunk={"size": 3, "gather_ms": 10_000})
    def chunk(contexts: list[belay.Context]) -> Any:
        if returns == "a broken mapping":
            return LookupRaises({c.id: "ok" for c in contexts})
        return {c.id: StrRaises() for c in contexts}

    worker = make_worker(client, reg, {"default": 3})
    ends = Ends(worker)
    jobs = client.enqueue_many([{"kind": "hardening.chunk", "input": {"n": n}}
                                for n in range(3)])
    with running(worker):
        ends.wait_for(3)
    expected = ("<exception StrRaises: str() raised ValueError: no str for you>"
                if returns == "undescribable errors" else
                "ValidationError: the chunk worker's return value could not be read: "
                "RuntimeError: no lookups")
    assert sorted(ends.outcomes().values()) == ["retry"] * 3
    for job in jobs:
        found = client.get_job(job.id)
        assert found is not None and found.state == "ready"
        assert found.errors[0]["error"] == expected


# -- The step journal ------------------------------------------------------------------------


def test_a_cost_function_whose_error_cant_be_described_still_fails_at_once(client) -> None:
    """A failing cost function fails the job at once (a retry would pay for the
    step again); before, the error's own __str__ turned that into a retry."""

    def price(value: Any) -> belay.Cost:
        raise StrRaises()

    def job(ctx: belay.Context) -> Any:
        return ctx.step("priced", lambda: 1, cost=price)

    event, row = run_one(client, job, max_attempts=3)
    assert (event.outcome, row["state"]) == ("failed", "failed")
    assert row["errors"][0]["error"].startswith(
        "bad step value: the cost function of step 'priced' failed: <exception StrRaises: "
        "str() raised ValueError: no str for you>")


def test_a_step_value_whose_serialization_raises_fails_at_once(client) -> None:
    def job(ctx: belay.Context) -> Any:
        return ctx.step("weird", lambda: ValuesRaise(a=None))

    event, row = run_one(client, job, max_attempts=3)
    assert (event.outcome, row["state"]) == ("failed", "failed")
    assert row["errors"][0]["error"] == (
        "bad step value: the value of step 'weird' could not be serialized: RuntimeError: "
        "values() is broken")
