"""belay: a Postgres-backed durable job engine for agent workloads.

The module-level functions act on a default instance set up by
:func:`configure` (or, failing that, from ``BELAY_DATABASE_URL``); each one
also exists as a method of :class:`Belay` for explicit instances.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from belay import errors
from belay.client import STATS_CAP, Belay, CancelStatus
from belay.clock import Clock, ManualClock, SystemClock
from belay.codec import Opaque
from belay.context import (
    TIMEOUT,
    BudgetExceeded,
    CancelRequested,
    Context,
    Cost,
    Interrupted,
    StepValueRefused,
    current_context,
)
from belay.cron import CronEntry, CronScheduler, DynamicCron
from belay.enqueue import MAX_DELAY_SECONDS, JobSpec, Unique
from belay.errors import (
    BelayError,
    ConfigurationError,
    ContractMismatch,
    JobCancelled,
    JobFailed,
    JobNotFound,
    NotRetryable,
    PoolerError,
    SchemaError,
    SchemaMissing,
    SchemaOutdated,
    ValidationError,
)
from belay.job import Event, Job, Step, WorkflowStatus
from belay.names import MAX_KEY_BYTES, MAX_NAME_BYTES
from belay.outcome import Cancel, Snooze, default_backoff
from belay.queues import QueueSpec
from belay.registry import Registry, WorkerDef, worker
from belay.runner import JobEnd, Worker
from belay.schema import CONTRACT_MAJOR, MIN_REVISION, SchemaStatus
from belay.workflow import Workflow

__all__ = [
    "CONTRACT_MAJOR",
    "MAX_DELAY_SECONDS",
    "MAX_KEY_BYTES",
    "MAX_NAME_BYTES",
    "MIN_REVISION",
    "STATS_CAP",
    "TIMEOUT",
    "Belay",
    "BelayError",
    "BudgetExceeded",
    "Cancel",
    "CancelRequested",
    "CancelStatus",
    "Clock",
    "ConfigurationError",
    "Context",
    "ContractMismatch",
    "Cost",
    "CronEntry",
    "CronScheduler",
    "DynamicCron",
    "Event",
    "Interrupted",
    "Job",
    "JobCancelled",
    "JobEnd",
    "JobFailed",
    "JobNotFound",
    "JobSpec",
    "ManualClock",
    "NotRetryable",
    "Opaque",
    "PoolerError",
    "QueueSpec",
    "Registry",
    "SchemaError",
    "SchemaMissing",
    "SchemaOutdated",
    "SchemaStatus",
    "Snooze",
    "Step",
    "StepValueRefused",
    "SystemClock",
    "Unique",
    "ValidationError",
    "Worker",
    "WorkerDef",
    "Workflow",
    "WorkflowStatus",
    "await_result",
    "cancel_job",
    "check_schema",
    "clear_signal",
    "configure",
    "current_context",
    "default",
    "default_backoff",
    "delete_cron",
    "delete_queue",
    "enqueue",
    "enqueue_many",
    "enqueue_workflow",
    "errors",
    "events",
    "get_job",
    "list_crons",
    "list_jobs",
    "list_queues",
    "migrate",
    "pause_cron",
    "pause_queue",
    "put_cron",
    "put_queue",
    "resume_cron",
    "resume_queue",
    "retry_job",
    "set_default",
    "signal",
    "signal_job",
    "stats",
    "steer_job",
    "steps",
    "subscribe_events",
    "worker",
    "workflow_status",
]

_default: Belay | None = None
_default_lock = threading.Lock()

Conn = psycopg.Connection[Any]


def configure(url: str | None = None, **options: Any) -> Belay:
    """Set up the default instance (replacing and closing any earlier one).

    ``url`` falls back to ``BELAY_DATABASE_URL``; ``options`` are those of :class:`Belay`.
    """
    global _default
    instance = Belay(_url(url), **options)
    with _default_lock:
        previous, _default = _default, instance
    if previous is not None:
        previous.close()
    return instance


_ANY: Any = object()


def set_default(instance: Belay, *, expected: Belay | None = _ANY) -> bool:
    """Make ``instance`` the default the module-level functions use (for an
    instance built elsewhere, e.g. by a framework adapter).

    With ``expected``, only if the current default is that instance (None: only
    if there is none yet), atomically; returns whether it was set. The instance
    it replaces is not closed: it belongs to whoever made it.
    """
    global _default
    with _default_lock:
        if expected is not _ANY and _default is not expected:
            return False
        _default = instance
        return True


def default() -> Belay:
    """The default instance, created from ``BELAY_DATABASE_URL`` on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Belay(_url(None))
        return _default


def _url(url: str | None) -> str:
    url = url or os.environ.get("BELAY_DATABASE_URL")
    if not url:
        raise ConfigurationError(
            "belay has no database: call belay.configure(url='postgresql://…') "
            "or set BELAY_DATABASE_URL"
        )
    return url


def migrate(url: str | None = None) -> list[int]:
    """Create or upgrade the belay schema (idempotent); returns the revisions applied."""
    if url is None:
        return default().migrate()
    with Belay(url, verify_schema=False) as instance:
        return instance.migrate()


def check_schema(url: str | None = None) -> SchemaStatus:
    """Raise a SchemaError saying what to do unless belay can run on this database."""
    if url is None:
        return default().check_schema()
    with Belay(url, verify_schema=False) as instance:
        return instance.check_schema()


def enqueue(
    kind: Any,
    input: Mapping[str, Any] | None = None,
    *,
    queue: str | None = None,
    priority: int | None = None,
    delay: float | timedelta | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
    unique: str | Unique | Mapping[str, Any] | None = None,
    budget: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    partition_key: str | None = None,
    encrypt: bool | None = None,
    conn: Conn | None = None,
    session: Any = None,
) -> Job:
    return default().enqueue(
        kind, input, queue=queue, priority=priority, delay=delay, run_at=run_at,
        max_attempts=max_attempts, unique=unique, budget=budget, meta=meta,
        partition_key=partition_key, encrypt=encrypt, conn=conn, session=session,
    )


def enqueue_many(
    jobs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Conn | None = None,
    session: Any = None,
) -> list[Job]:
    return default().enqueue_many(jobs, conn=conn, session=session)


def enqueue_workflow(
    workflow: Workflow, *, conn: Conn | None = None, session: Any = None
) -> dict[str, Job]:
    return default().enqueue_workflow(workflow, conn=conn, session=session)


def get_job(job_id: int, *, conn: Conn | None = None) -> Job | None:
    return default().get_job(job_id, conn=conn)


def list_jobs(**filters: Any) -> list[Job]:
    return default().list_jobs(**filters)


def steps(job_id: int, *, conn: Conn | None = None) -> list[Step]:
    return default().steps(job_id, conn=conn)


def events(job_id: int, after: int = 0, *, limit: int | None = None,
           conn: Conn | None = None) -> list[Event]:
    return default().events(job_id, after, limit=limit, conn=conn)


def subscribe_events(
    job_id: int, after: int = 0, *, timeout: float | None = None
) -> Iterator[Event]:
    return default().subscribe_events(job_id, after, timeout=timeout)


def workflow_status(workflow_id: str, *, conn: Conn | None = None) -> WorkflowStatus:
    return default().workflow_status(workflow_id, conn=conn)


def stats(*, cap: int | None = STATS_CAP,
          conn: Conn | None = None) -> dict[str, dict[str, int]]:
    return default().stats(cap=cap, conn=conn)


def signal(
    scope: str, name: str, payload: Mapping[str, Any] | None = None, *, conn: Conn | None = None
) -> list[int]:
    return default().signal(scope, name, payload, conn=conn)


def signal_job(
    job_id: int, name: str, payload: Mapping[str, Any] | None = None, *, conn: Conn | None = None
) -> list[int]:
    return default().signal_job(job_id, name, payload, conn=conn)


def steer_job(job_id: int, payload: Mapping[str, Any], *, conn: Conn | None = None) -> list[int]:
    return default().steer_job(job_id, payload, conn=conn)


def clear_signal(scope: str, name: str, *, conn: Conn | None = None) -> bool:
    return default().clear_signal(scope, name, conn=conn)


def cancel_job(job_id: int, *, conn: Conn | None = None) -> CancelStatus:
    return default().cancel_job(job_id, conn=conn)


def retry_job(job_id: int, *, conn: Conn | None = None) -> Job:
    return default().retry_job(job_id, conn=conn)


def await_result(job_id: int, timeout: float | None = None) -> Any:
    return default().await_result(job_id, timeout)


# -- Cron (§8.5) -------------------------------------------------------------------


def put_cron(
    name: str,
    expression: str,
    worker: Any,
    input: Mapping[str, Any] | None = None,
    *,
    conn: Conn | None = None,
    **options: Any,
) -> DynamicCron:
    return default().put_cron(name, expression, worker, input, conn=conn, **options)


def delete_cron(name: str, *, conn: Conn | None = None) -> bool:
    return default().delete_cron(name, conn=conn)


def pause_cron(name: str, *, conn: Conn | None = None) -> bool:
    return default().pause_cron(name, conn=conn)


def resume_cron(name: str, *, conn: Conn | None = None) -> bool:
    return default().resume_cron(name, conn=conn)


def list_crons(*, conn: Conn | None = None) -> list[DynamicCron]:
    return default().list_crons(conn=conn)


def put_queue(name: str, **options: Any) -> QueueSpec:
    return default().put_queue(name, **options)


def delete_queue(name: str, *, conn: Conn | None = None) -> bool:
    return default().delete_queue(name, conn=conn)


def pause_queue(name: str, *, conn: Conn | None = None) -> None:
    default().pause_queue(name, conn=conn)


def resume_queue(name: str, *, conn: Conn | None = None) -> bool:
    return default().resume_queue(name, conn=conn)


def list_queues(*, conn: Conn | None = None) -> dict[str, dict[str, Any]]:
    return default().list_queues(conn=conn)
