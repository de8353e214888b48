"""How a run ends (belay/outcome.py, docs/contract.md §7, its outcome table) and how
workers are registered (belay/registry.py). Pure: no database.

The end-to-end versions of these outcomes, through a real worker and the fenced
acks, are in test_worker.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import belay
from belay import registry as registry_module
from belay.codec import decode_value
from belay.outcome import TRACEBACK_LIMIT, Cancel, Outcome, Snooze, decide, default_backoff
from belay.registry import Registry, WorkerDef
from tests.helpers import START

NOW = START + timedelta(minutes=5)


def fixed(seconds: float) -> Any:
    """A deterministic backoff that records what it was asked."""
    asked: list[int] = []

    def backoff(attempt: int) -> float:
        asked.append(attempt)
        return seconds * attempt

    backoff.asked = asked  # type: ignore[attr-defined]
    return backoff


def run(*, returned: Any = None, raised: BaseException | None = None, attempt: int = 1,
        max_attempts: int = 3, backoff: Any = None) -> Outcome:
    return decide(returned=returned, raised=raised, attempt=attempt, max_attempts=max_attempts,
                  now=NOW, backoff=backoff or fixed(10.0))


def raised_from(exc: BaseException) -> BaseException:
    """The exception as a job raises it: with a traceback through a function."""

    def job() -> None:
        raise exc

    try:
        job()
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


# -- return → succeeded ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    {"sent": True, "n": [1, 2.5, None, "é"]},
    [1, 2, 3],
    "text",
    0,
    None,
    2**80,  # JSON has no integer limit; the reference reads it back exactly
])
def test_a_return_succeeds_with_the_value_in_a_json_envelope(value: Any) -> None:
    outcome = run(returned=value, attempt=3, max_attempts=3)
    assert outcome.kind == "succeeded" and outcome.terminal
    assert outcome.error is None and outcome.at is None
    assert isinstance(outcome.result, bytes)
    assert outcome.result[:1] != b"\x83"  # §2: we never write ETF
    assert json.loads(outcome.result) == value
    assert decode_value(outcome.result) == value


# -- a result that can't be stored → the attempt fails, never the worker -------------------


class Thing:
    pass


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


NOT_JSON = {
    "set": {1, 2},
    "datetime": START,
    "nan": float("nan"),
    "infinity": {"x": [float("inf")]},
    "object": Thing(),
    "bytes": b"raw",
    "int key": {1: "one"},
    "lone surrogate": "\ud800",
    "cycle": _cycle(),
    "big int beside a set": {"big": 2**70, "s": {1}},
    "big int beside nan": [2**70, float("nan")],
}


@pytest.mark.parametrize("value", NOT_JSON.values(), ids=NOT_JSON.keys())
def test_a_result_that_is_not_json_retries_the_attempt_with_a_bad_result_error(value: Any) -> None:
    backoff = fixed(7.0)
    outcome = run(returned=value, attempt=2, max_attempts=3, backoff=backoff)
    assert outcome.kind == "retry"
    assert outcome.result is None
    assert outcome.at == NOW + timedelta(seconds=14)
    assert backoff.asked == [2]
    assert set(outcome.error or {}) == {"error", "attempt"}
    assert outcome.error["error"].startswith("bad result: ")  # type: ignore[index]
    assert "JSON" in outcome.error["error"]  # type: ignore[index]
    assert outcome.error["attempt"] == 2  # type: ignore[index]
    json.dumps(outcome.error)  # the entry itself is storable


@pytest.mark.parametrize("value", NOT_JSON.values(), ids=NOT_JSON.keys())
def test_a_bad_result_on_the_last_attempt_fails_the_job(value: Any) -> None:
    outcome = run(returned=value, attempt=3, max_attempts=3)
    assert outcome.kind == "failed" and outcome.terminal
    assert outcome.at is None
    assert outcome.error["error"].startswith("bad result: ")  # type: ignore[index]


def _decide_in_a_subprocess(expression: str, timeout: float = 60.0) -> str:
    """Run decide on a value built by ``expression`` in a child process: a hang or a
    runaway loop there can be killed without taking the test session with it. (The
    child's start, imports included, must fit in the deadline on a loaded machine:
    3 s did not, beside two chaos soaks.)"""
    program = textwrap.dedent(f"""
        from datetime import datetime, timezone
        from belay.outcome import decide, default_backoff
        value = {expression}
        try:
            outcome = decide(returned=value, attempt=1, max_attempts=3,
                             now=datetime.now(timezone.utc), backoff=default_backoff)
            print(outcome.kind, (outcome.error or {{}}).get("error", "")[:60])
        except BaseException as exc:
            print("raised", type(exc).__name__)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "hung"
    return done.stdout.strip() or done.stderr.strip()


def test_a_cyclic_result_with_a_big_integer_is_a_bad_result_not_a_hang() -> None:
    outcome = _decide_in_a_subprocess("[2**70]; value.append(value)")
    assert outcome.startswith("retry bad result"), outcome


def test_a_deeply_nested_result_with_a_big_integer_is_a_bad_result() -> None:
    nested = "[2**70, __import__('functools').reduce(lambda a, _: [a], range(100000), [])]"
    outcome = _decide_in_a_subprocess(nested)
    assert outcome.startswith("retry bad result"), outcome


# -- raise → retry with backoff, or failed -------------------------------------------------


def test_a_raise_retries_at_now_plus_the_backoff_of_the_attempt() -> None:
    backoff = fixed(12.5)
    outcome = run(raised=raised_from(ValueError("boom")), attempt=2, max_attempts=5,
                  backoff=backoff)
    assert outcome.kind == "retry" and not outcome.terminal
    assert backoff.asked == [2]
    assert outcome.at == NOW + timedelta(seconds=25)
    assert outcome.result is None
    error = outcome.error
    assert error is not None
    assert set(error) == {"error", "attempt", "traceback"}
    assert error["error"] == "ValueError: boom"
    assert error["attempt"] == 2
    assert "raise exc" in error["traceback"] and "ValueError: boom" in error["traceback"]
    json.dumps(error)


def test_an_exception_without_a_message_is_named_by_its_type() -> None:
    outcome = run(raised=raised_from(KeyError()))
    assert outcome.error["error"] == "KeyError"  # type: ignore[index]


def test_the_traceback_in_an_error_entry_is_bounded_and_keeps_its_end() -> None:
    huge = "x" * (TRACEBACK_LIMIT * 3)
    outcome = run(raised=raised_from(RuntimeError(huge + " THE END")))
    trace = outcome.error["traceback"]  # type: ignore[index]
    assert len(trace) <= TRACEBACK_LIMIT
    assert trace.rstrip().endswith("THE END")


def test_a_negative_backoff_retries_now_rather_than_in_the_past() -> None:
    outcome = run(raised=raised_from(ValueError("x")), backoff=lambda attempt: -30.0)
    assert outcome.kind == "retry"
    assert outcome.at == NOW


@pytest.mark.parametrize("attempt, max_attempts", [(3, 3), (4, 3), (1, 1)])
def test_a_raise_on_or_past_the_last_attempt_fails_the_job(attempt: int, max_attempts: int) -> None:
    backoff = fixed(1.0)
    outcome = run(raised=raised_from(ValueError("last")), attempt=attempt,
                  max_attempts=max_attempts, backoff=backoff)
    assert outcome.kind == "failed" and outcome.terminal
    assert outcome.at is None
    assert outcome.error["error"] == "ValueError: last"  # type: ignore[index]
    assert outcome.error["attempt"] == attempt  # type: ignore[index]


def test_a_base_exception_from_the_job_is_a_failed_try_too() -> None:
    """Whatever the job raised is its failure: decide never lets it escape."""
    outcome = run(raised=raised_from(KeyboardInterrupt()))
    assert outcome.kind == "retry"
    assert outcome.error["error"] == "KeyboardInterrupt"  # type: ignore[index]


@pytest.mark.parametrize("backoff", [
    lambda attempt: 1 / 0,
    lambda attempt: float("inf"),
    lambda attempt: None,
], ids=["raises", "infinite", "none"])
def test_a_broken_backoff_still_gives_a_retry(backoff: Any) -> None:
    outcome = run(raised=raised_from(ValueError("x")), backoff=backoff)
    assert outcome.kind == "retry"
    assert outcome.at is not None and outcome.at >= NOW


# -- Cancel and Snooze -------------------------------------------------------------------------


def test_cancel_ends_the_job_cancelled_with_its_reason() -> None:
    outcome = run(raised=raised_from(Cancel("user gave up")), attempt=1, max_attempts=1)
    assert outcome == Outcome("cancelled", error={"reason": "user gave up"})
    assert outcome.terminal


def test_cancel_without_a_reason() -> None:
    assert run(raised=Cancel()).error == {"reason": "cancelled"}


@pytest.mark.parametrize("seconds", [0, 30, 2.5, 86_400 * 365])
def test_snooze_comes_back_after_its_seconds(seconds: float) -> None:
    backoff = fixed(1.0)
    outcome = run(raised=raised_from(Snooze(seconds)), attempt=3, max_attempts=3,
                  backoff=backoff)
    assert outcome == Outcome("snooze", at=NOW + timedelta(seconds=seconds))
    assert not outcome.terminal
    assert backoff.asked == []  # not a failed try: no backoff, even on the last attempt


@pytest.mark.parametrize("seconds", [-1, -0.001, "5", None, True, [1]])
def test_snooze_refuses_anything_but_seconds_at_or_above_zero(seconds: Any) -> None:
    with pytest.raises(belay.ValidationError, match="Snooze"):
        Snooze(seconds)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, 1e300])
def test_snooze_refuses_seconds_a_timestamp_cannot_hold(seconds: float) -> None:
    with pytest.raises(belay.ValidationError):
        Snooze(seconds)


# -- default backoff ------------------------------------------------------------------------


@given(st.one_of(st.integers(0, 12), st.integers(0, 10**9)))
def test_default_backoff_is_two_to_the_capped_attempt_plus_up_to_two_seconds(n: int) -> None:
    base = 2 ** min(n, 8)
    assert base <= default_backoff(n) <= base + 2


def test_default_backoff_jitters() -> None:
    assert len({default_backoff(3) for _ in range(50)}) > 1


def test_default_backoff_caps_at_attempt_8() -> None:
    assert min(default_backoff(9) for _ in range(50)) >= 256
    assert max(default_backoff(100) for _ in range(50)) <= 258


def test_decide_uses_the_default_backoff_when_given_it() -> None:
    outcome = decide(raised=ValueError("x"), attempt=4, max_attempts=9, now=NOW,
                     backoff=default_backoff)
    assert outcome.at is not None
    assert NOW + timedelta(seconds=16) <= outcome.at <= NOW + timedelta(seconds=18)


# -- registry: @belay.worker --------------------------------------------------------------------


def module_level_job(ctx: Any) -> Any:
    """Docs of the job."""
    return ("ran", ctx)


class Holder:
    @staticmethod
    def nested_job(ctx: Any) -> Any:
        return ctx


def test_the_default_kind_is_module_dot_qualname() -> None:
    reg = Registry()
    definition = belay.worker(registry=reg)(module_level_job)
    assert definition.kind == "tests.test_outcome.module_level_job"
    nested = belay.worker(registry=reg)(Holder.nested_job)
    assert nested.kind == "tests.test_outcome.Holder.nested_job"
    assert reg.get("tests.test_outcome.module_level_job") is definition
    assert reg.kinds() == sorted([definition.kind, nested.kind])
    assert definition.kind in reg and "nope" not in reg and len(reg) == 2
    assert reg.get("nope") is None


def test_the_bare_decorator_registers_into_the_default_registry(monkeypatch) -> None:
    fresh = Registry()
    monkeypatch.setattr(registry_module, "DEFAULT_REGISTRY", fresh)
    definition = belay.worker(module_level_job)
    assert isinstance(definition, WorkerDef)
    assert fresh.get(definition.kind) is definition


def test_defaults_of_a_worker() -> None:
    definition = belay.worker(registry=Registry())(module_level_job)
    assert (definition.queue, definition.max_attempts, definition.timeout, definition.priority,
            definition.unique) == ("default", 20, None, 0, None)
    assert definition.backoff is default_backoff
    assert definition.__doc__ == "Docs of the job."
    assert definition.__name__ == "module_level_job"
    assert definition.__wrapped__ is module_level_job


def test_name_overrides_the_kind() -> None:
    reg = Registry()
    definition = belay.worker(name="Elixir.MyApp.Mailer", registry=reg)(module_level_job)
    assert definition.kind == "Elixir.MyApp.Mailer"
    assert reg.get("Elixir.MyApp.Mailer") is definition
    assert reg.get("tests.test_outcome.module_level_job") is None


def test_a_function_defined_inside_a_function_needs_a_name() -> None:
    reg = Registry()
    with pytest.raises(belay.ConfigurationError, match="name="):
        @belay.worker(registry=reg)
        def inner(ctx: Any) -> None: ...
    assert len(reg) == 0

    @belay.worker(name="inner.job", registry=reg)
    def named(ctx: Any) -> None: ...

    assert reg.get("inner.job") is named


BAD_OPTIONS = {
    "empty queue": {"queue": ""},
    "queue not a str": {"queue": 5},
    "max_attempts 0": {"max_attempts": 0},
    "max_attempts negative": {"max_attempts": -1},
    "max_attempts bool": {"max_attempts": True},
    "max_attempts float": {"max_attempts": 2.0},
    "timeout negative": {"timeout": -1},
    "timeout zero": {"timeout": 0},
    "timeout bool": {"timeout": True},
    "timeout str": {"timeout": "30"},
    "priority bool": {"priority": True},
    "priority str": {"priority": "1"},
    "backoff not callable": {"backoff": 5},
    "unique bad mode": {"unique": belay.Unique("k", mode="sometimes")},  # type: ignore[arg-type]
}


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_are_refused_at_decoration(options: dict[str, Any]) -> None:
    reg = Registry()
    with pytest.raises(belay.ConfigurationError):
        belay.worker(name="k", registry=reg, **options)(module_level_job)
    assert len(reg) == 0


@pytest.mark.parametrize("unique", [5, {"mode": "incomplete"}, "$spawn:1:x:0"])
def test_a_bad_unique_default_is_refused_at_decoration(unique: Any) -> None:
    with pytest.raises(belay.ConfigurationError):
        belay.worker(name="k", registry=Registry(), unique=unique)(module_level_job)


def test_decorating_something_not_callable_is_refused() -> None:
    with pytest.raises(belay.ConfigurationError, match="decorates a function"):
        belay.worker(name="k", registry=Registry())("not a function")  # type: ignore[arg-type]


def test_options_are_kept_on_the_definition() -> None:
    def backoff(attempt: int) -> float:
        return 1.0

    definition = belay.worker(name="k", queue="mailers", max_attempts=5, timeout=30,
                              priority=-2, backoff=backoff, unique="one-at-a-time",
                              registry=Registry())(module_level_job)
    assert (definition.queue, definition.max_attempts, definition.priority) == ("mailers", 5, -2)
    assert definition.timeout == 30.0 and isinstance(definition.timeout, float)
    assert definition.backoff is backoff
    assert definition.enqueue_defaults == {
        "queue": "mailers", "max_attempts": 5, "priority": -2, "unique": "one-at-a-time",
        "encrypt": False,
    }
    assert repr(definition) == "<belay worker k queue='mailers'>"


def test_another_function_under_a_taken_kind_is_refused() -> None:
    reg = Registry()
    first = belay.worker(name="shared.kind", registry=reg)(module_level_job)
    taken = re.escape("'shared.kind' is already registered")
    with pytest.raises(belay.ConfigurationError, match=taken):
        belay.worker(name="shared.kind", registry=reg)(Holder.nested_job)
    assert reg.get("shared.kind") is first


def test_registering_the_same_function_again_replaces_it() -> None:
    reg = Registry()
    first = belay.worker(name="again", registry=reg)(module_level_job)
    second = belay.worker(name="again", queue="other", registry=reg)(module_level_job)
    assert reg.get("again") is second and second is not first
    assert len(reg) == 1


def test_a_reloaded_module_replaces_its_workers() -> None:
    """A module imported again (importlib.reload, a dev server) defines new function
    objects with the same module and qualname: they replace the old ones."""
    reg = Registry()
    source = textwrap.dedent("""
        import belay

        @belay.worker(registry=REGISTRY)
        def send(ctx):
            return VERSION
    """)
    loaded = []
    for version in (1, 2):
        namespace: dict[str, Any] = {"__name__": "myapp.jobs", "REGISTRY": reg,
                                     "VERSION": version}
        exec(compile(source, "myapp/jobs.py", "exec"), namespace)
        loaded.append(namespace["send"])
    assert loaded[0].fn is not loaded[1].fn
    assert reg.kinds() == ["myapp.jobs.send"]
    assert reg.get("myapp.jobs.send") is loaded[1]
    assert reg.get("myapp.jobs.send")(None) == 2  # type: ignore[misc]


def test_a_worker_definition_is_callable_with_a_context() -> None:
    definition = belay.worker(name="callable", registry=Registry())(module_level_job)
    ctx = object()
    assert definition(ctx) == ("ran", ctx)  # type: ignore[arg-type]


def test_a_registry_is_safe_to_fill_from_threads() -> None:
    import threading

    reg = Registry()
    barrier = threading.Barrier(8)

    def register(n: int) -> None:
        barrier.wait()
        for i in range(50):
            belay.worker(name=f"k{n}.{i}", registry=reg)(module_level_job)

    threads = [threading.Thread(target=register, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reg) == 400


def test_now_is_a_parameter_of_decide_not_the_wall_clock() -> None:
    """§2: the outcome's times come from the "now" it is given."""
    past = datetime(2001, 1, 1, tzinfo=START.tzinfo)
    outcome = decide(raised=Snooze(60), attempt=1, max_attempts=3, now=past,
                     backoff=default_backoff)
    assert outcome.at == past + timedelta(seconds=60)
