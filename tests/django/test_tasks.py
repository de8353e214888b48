"""The django.tasks backend: @task functions enqueue transactionally into
belay, belay_worker's worker runs them, get_result reads the job."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

import belay
from belay.outcome import error_entry
from tests.helpers import count_jobs

tasks = pytest.importorskip("belay_django.tasks",
                            reason="needs Django >= 6 or the django-tasks backport")

from belay_django.tasks import (  # noqa: E402
    RUN_TASK,
    BelayBackend,
    TaskResultDoesNotExist,
    TaskResultStatus,
    exception_path,
    task_finished,
    task_started,
)
from belay_django.worker import django_worker  # noqa: E402

TASKS = {"default": {"BACKEND": "belay_django.tasks.BelayBackend",
                     "QUEUES": ["default", "mailers"], "OPTIONS": {"max_attempts": 1}}}


@pytest.fixture
def sql(dj):
    with psycopg.connect(dj, autocommit=True) as conn:
        yield conn


@pytest.fixture
def run_jobs(dj):
    """Run what is claimable now, as belay_worker's worker would."""
    client = belay.Belay(dj)

    def run() -> dict[str, int]:
        return django_worker({"default": 2, "mailers": 2}, client=client).drain()

    yield run
    client.close()


def test_a_task_enqueues_inside_the_atomic_block(dj, sql):
    from testapp.tasks import add

    with pytest.raises(RuntimeError), transaction.atomic():
        add.enqueue(1, 2)
        raise RuntimeError("rolled back")
    assert count_jobs(sql) == 0
    with transaction.atomic():
        result = add.enqueue(1, 2)
        assert count_jobs(sql) == 0
    assert count_jobs(sql) == 1
    kind, job_input, queue, priority = sql.execute(
        "SELECT kind, input, queue, priority FROM belay_jobs").fetchone()
    assert kind == RUN_TASK == "belay_django.run_task"
    assert job_input == {"task": "testapp.tasks.add", "args": [1, 2], "kwargs": {},
                         "priority": 0, "backend": "default"}
    assert queue == "default" and priority == 0
    assert result.status == TaskResultStatus.READY
    assert result.id == str(sql.execute("SELECT id FROM belay_jobs").fetchone()[0])
    assert result.args == [1, 2] and result.backend == "default"


def test_get_result_reads_the_job_as_it_runs(dj, run_jobs):
    from testapp.models import Note
    from testapp.tasks import add

    enqueued = add.enqueue(2, 3)
    fresh = add.get_result(enqueued.id)
    assert fresh.status == TaskResultStatus.READY and not fresh.is_finished
    assert run_jobs() == {"succeeded": 1}
    done = add.get_result(enqueued.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == 5
    assert done.attempts == 1 and done.finished_at is not None
    assert Note.objects.get().text == "2+3"  # the task used the ORM
    enqueued.refresh()
    assert enqueued.return_value == 5


@override_settings(TASKS=TASKS)
def test_a_failed_task_reads_as_failed_with_its_exception(dj, run_jobs):
    from testapp.tasks import declined, explode

    builtin, custom = explode.enqueue(), declined.enqueue()
    assert run_jobs() == {"failed": 2}
    failed = explode.get_result(builtin.id)
    assert failed.status == TaskResultStatus.FAILED
    [error] = failed.errors
    assert error.exception_class is LookupError
    assert "nothing here" in error.traceback
    [error] = declined.get_result(custom.id).errors
    assert error.exception_class_path == "testapp.tasks.PaymentDeclined"
    with pytest.raises(ValueError, match="Task failed"):
        _ = failed.return_value


def test_a_failed_attempt_is_retried_and_reads_ready_meanwhile(dj, run_jobs):
    from testapp.tasks import explode

    result = explode.enqueue()
    assert run_jobs() == {"retry": 1}
    again = explode.get_result(result.id)
    assert again.status == TaskResultStatus.READY
    assert [e.exception_class_path for e in again.errors] == ["builtins.LookupError"]


def test_priority_maps_to_belays_order(dj, sql, run_jobs):
    """Django runs higher priorities first, belay lower numbers first."""
    from testapp.tasks import urgent

    low = urgent.using(priority=-20).enqueue(1)
    high = urgent.enqueue(2)  # priority 50
    assert sql.execute("SELECT priority FROM belay_jobs ORDER BY id").fetchall() == [(20,), (-50,)]
    client = belay.Belay(dj)
    try:
        django_worker({"mailers": 1}, client=client).drain(max_jobs=1)
    finally:
        client.close()
    assert urgent.get_result(high.id).status == TaskResultStatus.SUCCESSFUL
    assert urgent.get_result(low.id).status == TaskResultStatus.READY
    assert urgent.get_result(high.id).task.priority == 50


def test_run_after_defers_the_job(dj, sql):
    from testapp.tasks import add

    when = timezone.now() + timedelta(hours=1)
    add.using(run_after=when).enqueue(1, 1)
    assert sql.execute("SELECT ready_at FROM belay_jobs").fetchone()[0] == when


def test_context_and_async_tasks_run(dj, run_jobs):
    from testapp.tasks import async_double, which_attempt

    attempt, doubled = which_attempt.enqueue(), async_double.enqueue(21)
    assert run_jobs() == {"succeeded": 2}
    assert which_attempt.get_result(attempt.id).return_value == 1
    assert async_double.get_result(doubled.id).return_value == 42


def test_the_worker_sends_djangos_task_signals(dj, run_jobs):
    from testapp.tasks import add

    seen: list[tuple[str, str]] = []

    def started(sender, task_result, **kwargs):
        seen.append(("started", task_result.status))

    def finished(sender, task_result, **kwargs):
        seen.append(("finished", task_result.status))

    task_started.connect(started)
    task_finished.connect(finished)
    try:
        add.enqueue(1, 1)
        run_jobs()
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(finished)
    assert seen == [("started", TaskResultStatus.RUNNING),
                    ("finished", TaskResultStatus.SUCCESSFUL)]


def test_get_result_of_something_else_does_not_exist(dj, sql):
    from testapp.tasks import add

    other = belay.enqueue("t.not_a_task")
    for result_id in (str(other.id), "999999", "abc"):
        with pytest.raises(TaskResultDoesNotExist):
            add.get_result(result_id)


def test_backend_options_are_checked():
    with pytest.raises(ImproperlyConfigured, match=r"unknown key.*max_atempts"):
        BelayBackend("x", {"OPTIONS": {"max_atempts": 3}})
    with pytest.raises(ImproperlyConfigured, match=r"whole number >= 1"):
        BelayBackend("x", {"OPTIONS": {"max_attempts": 0}})
    backend = BelayBackend("x", {})
    assert (backend.supports_defer, backend.supports_async_task, backend.supports_get_result,
            backend.supports_priority) == (True, True, True, True)


@override_settings(TASKS=TASKS)
def test_max_attempts_comes_from_the_backend_options(dj, sql):
    from testapp.tasks import add

    add.enqueue(1, 1)
    assert sql.execute("SELECT max_attempts FROM belay_jobs").fetchone() == (1,)


# -- exception paths (pure) --------------------------------------------------------------

def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


@given(module=st.from_regex(r"[a-z_][a-z0-9_]{0,8}(\.[a-z_][a-z0-9_]{0,8}){0,3}",
                            fullmatch=True),
       name=st.from_regex(r"[A-Z][A-Za-z0-9_]{0,15}", fullmatch=True),
       message=st.text(max_size=40))
def test_the_exception_path_is_read_back_from_belays_error_entry(module, name, message):
    if module in ("builtins", "__main__"):
        return
    cls = type(name, (Exception,), {"__module__": module, "__qualname__": name})
    entry = error_entry(_raised(cls(message)), 1)
    assert exception_path(entry["error"], entry["traceback"]) == f"{module}.{name}"


def test_builtin_and_unknown_exception_paths():
    entry = error_entry(_raised(KeyError("k")), 1)
    assert exception_path(entry["error"], entry["traceback"]) == "builtins.KeyError"
    assert exception_path("lease_expired", None) == "belay.errors.JobFailed"
    assert exception_path("bad result: nan", None) == "belay.errors.JobFailed"
    assert exception_path("Mystery: x", None) == "belay.errors.JobFailed"


def test_a_cancelled_job_reads_as_failed(dj, sql):
    from testapp.tasks import add

    result = add.enqueue(1, 1)
    belay.cancel_job(int(result.id))
    cancelled = add.get_result(result.id)
    assert cancelled.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in cancelled.errors] == ["belay.errors.JobCancelled"]
    assert dataclasses.is_dataclass(cancelled)
