"""A ``django.tasks`` backend on belay.

::

    TASKS = {"default": {"BACKEND": "belay_django.tasks.BelayBackend",
                         "QUEUES": ["default", "mailers"],
                         "OPTIONS": {"max_attempts": 5}}}

``@task`` functions then enqueue into ``belay_jobs`` on the Django connection
of ``settings.BELAY['DATABASE']`` — inside ``transaction.atomic`` they commit
or roll back with it — and ``manage.py belay_worker`` runs them. Django 6's
built-in ``django.tasks`` is used when present, else the ``django-tasks``
backport (``pip install django-tasks``).

Each task becomes one job of the generic kind ``belay_django.run_task``, whose
input names the task by module path (``{"task": "myapp.tasks.send", "args":
[...], "kwargs": {...}}``); the worker imports it and calls it. Capabilities:

- ``supports_defer``: ``run_after`` becomes the job's ``ready_at``;
- ``supports_priority``: Django runs higher priorities first, belay lower
  numbers first, so the job's priority is the task's negated;
- ``supports_get_result``: ``get_result(id)`` reads the job (the id is the
  belay job id, as a string);
- ``supports_async_task``: a coroutine task runs with ``async_to_sync``.

A failed attempt is retried with belay's backoff until ``max_attempts``
(``OPTIONS``, default belay's 20); until then the result stays READY with
the error in ``errors``. A cancelled job reads as FAILED.
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone as django_timezone
from django.utils.module_loading import import_string

from belay.context import Context
from belay.job import Job
from belay.outcome import error_entry
from belay.registry import worker

if TYPE_CHECKING:
    from django.tasks import TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
else:
    try:
        from django.tasks import TaskResultStatus, task_backends
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import Task, TaskContext, TaskError, TaskResult
        from django.tasks.exceptions import TaskResultDoesNotExist
        from django.tasks.signals import task_enqueued, task_finished, task_started
        from django.utils.json import normalize_json
    except ImportError:
        try:
            from django_tasks import TaskResultStatus, task_backends
            from django_tasks.backends.base import BaseTaskBackend
            from django_tasks.base import Task, TaskContext, TaskError, TaskResult
            from django_tasks.exceptions import TaskResultDoesNotExist
            from django_tasks.signals import task_enqueued, task_finished, task_started
            from django_tasks.utils import normalize_json
        except ImportError:
            raise ImproperlyConfigured(
                "belay_django.tasks needs Django >= 6.0 (django.tasks) or, on older Django, "
                "the backport: pip install django-tasks"
            ) from None

#: The belay kind every Django task runs as.
RUN_TASK = "belay_django.run_task"
OPTIONS = ("max_attempts",)
#: Where a job's errors say no Python exception (lease expired, a bad result…).
FAILED_PATH = "belay.errors.JobFailed"
CANCELLED_PATH = "belay.errors.JobCancelled"


class BelayBackend(BaseTaskBackend):
    """``django.tasks`` backend: enqueue into belay, read results from belay."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = dict(self.options)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown key(s) {', '.join(unknown)}; the "
                f"belay backend takes {', '.join(OPTIONS)}"
            )
        max_attempts = options.get("max_attempts")
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
            or max_attempts < 1
        ):
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['max_attempts'] is a whole number >= 1, got "
                f"{max_attempts!r}"
            )
        self.max_attempts: int | None = max_attempts

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        from belay_django.adapter import client

        self.validate_task(task)
        job_input = {
            "task": task.module_path,
            "args": normalize_json(list(args)),
            "kwargs": normalize_json(dict(kwargs)),
            "priority": task.priority,
            "backend": self.alias,
        }
        job = client().enqueue(
            RUN_TASK, job_input, queue=task.queue_name, priority=-task.priority,
            run_at=_utc(task.run_after), max_attempts=self.max_attempts,
        )
        result = task_result(job, task, self.alias)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        from belay_django.adapter import client

        if not isinstance(result_id, str) or not result_id.isdigit():
            raise TaskResultDoesNotExist(result_id)
        job = client().get_job(int(result_id))
        if job is None or job.kind != RUN_TASK:
            raise TaskResultDoesNotExist(result_id)
        return task_result(job, _task_of(job, self.alias), self.alias)

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        yield from super().check(**kwargs)
        if "belay_django" not in settings.INSTALLED_APPS:
            yield checks.Error(
                f"TASKS[{self.alias!r}] uses belay_django.tasks.BelayBackend, but "
                "'belay_django' is not in INSTALLED_APPS",
                hint="add 'belay_django' to INSTALLED_APPS",
                id="belay_django.E020",
            )


def _utc(when: datetime | None) -> datetime | None:
    if when is None:
        return None
    if django_timezone.is_naive(when):  # USE_TZ = False: the project's local time
        when = django_timezone.make_aware(when)
    return when.astimezone(timezone.utc)


# -- Results ----------------------------------------------------------------------------

_STATUS = {
    "ready": "READY", "held": "READY", "paused": "READY", "awaiting": "RUNNING",
    "running": "RUNNING", "succeeded": "SUCCESSFUL", "failed": "FAILED", "cancelled": "FAILED",
}


def task_result(job: Job, task: Task, alias: str) -> TaskResult:
    """The TaskResult a belay job stands for (pure)."""
    result = TaskResult(
        task=task,
        id=str(job.id),
        status=TaskResultStatus[_STATUS[job.state]],
        enqueued_at=job.inserted_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        last_attempted_at=job.started_at,
        args=list(job.input.get("args") or []),
        kwargs=dict(job.input.get("kwargs") or {}),
        backend=alias,
        errors=[task_error(entry) for entry in job.errors if isinstance(entry, Mapping)],
        # belay keeps only the current lease holder's id: one entry per attempt,
        # so TaskResult.attempts counts right.
        worker_ids=[job.leased_by or "" for _ in range(job.attempt)],
    )
    if job.state == "succeeded":
        object.__setattr__(result, "_return_value", job.result)
    return result


def task_error(entry: Mapping[str, Any]) -> TaskError:
    """A belay ``errors`` entry as a Django TaskError (pure)."""
    if "error" not in entry:  # a cancel: {"reason": …}
        return TaskError(exception_class_path=CANCELLED_PATH,
                         traceback=f"cancelled: {entry.get('reason', '')}")
    text = str(entry["error"])
    trace = entry.get("traceback")
    return TaskError(exception_class_path=exception_path(text, trace),
                     traceback=trace if isinstance(trace, str) else text)


_NAME = re.compile(r"[A-Za-z_]\w*")


def exception_path(error: str, traceback: Any) -> str:
    """The import path of the exception an ``errors`` entry records (pure).

    belay writes ``"Type: message"`` (the class name only) and the traceback,
    whose last line spells non-builtin exceptions ``module.Qualname: message``.
    """
    name = error.split(":", 1)[0].strip()
    if not _NAME.fullmatch(name):
        return FAILED_PATH
    if isinstance(traceback, str):
        spelled = re.compile(rf"([A-Za-z_][\w.]*\.{re.escape(name)})(?::|$)")
        for line in reversed(traceback.splitlines()):
            match = spelled.match(line)
            if match:
                return match.group(1)
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return f"builtins.{name}"
    return FAILED_PATH


def _task_of(job: Job, alias: str) -> Task:
    """The task a job runs, as it was enqueued (priority, queue, run_after)."""
    task = load_task(job.input.get("task"))
    changes: dict[str, Any] = {"queue_name": job.queue, "backend": alias}
    priority = job.input.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool):
        changes["priority"] = priority
    try:
        return dataclasses.replace(task, **changes)
    except Exception:
        return task  # e.g. a queue no longer in TASKS: the task as its module defines it


def load_task(path: Any) -> Task:
    if not isinstance(path, str) or not path:
        raise ValueError(f"a belay_django.run_task job names its task by module path, got "
                         f"{path!r}")
    found = import_string(path)
    if not isinstance(found, Task):
        raise TypeError(f"{path} is not a task (decorate the function with @task)")
    return found


# -- The worker kind --------------------------------------------------------------------


@worker(name=RUN_TASK)
def run_task(ctx: Context) -> Any:
    """Run the Django task a job names, sending task_started / task_finished."""
    job = ctx.job
    alias = job.input.get("backend") or "default"
    task = _task_of(job, alias)
    backend = task_backends[task.backend]
    running = task_result(job.replace(state="running"), task, task.backend)
    task_started.send(type(backend), task_result=running)
    args, kwargs = running.args, running.kwargs
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=running), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = normalize_json(value)
    except Exception as exc:
        if ctx.attempt >= job.max_attempts:
            failed = dataclasses.replace(
                running, status=TaskResultStatus.FAILED, finished_at=django_timezone.now(),
                errors=[*running.errors, task_error(error_entry(exc, ctx.attempt))])
            task_finished.send(type(backend), task_result=failed)
        raise
    done = dataclasses.replace(running, status=TaskResultStatus.SUCCESSFUL,
                               finished_at=django_timezone.now())
    object.__setattr__(done, "_return_value", value)
    task_finished.send(type(backend), task_result=done)
    return value
