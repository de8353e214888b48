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
from belay.client import Belay, CancelStatus
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
)
from belay.enqueue import JobSpec, Unique
from belay.errors import (
    BelayError,
    ConfigurationError,
    ContractMismatch,
    JobCancelled,
    JobFailed,
    JobNotFound,
    NotRetryable,
    SchemaError,
    SchemaMissing,
    SchemaOutdated,
    ValidationError,
)
from belay.job import Event, Job, Step, WorkflowStatus
from belay.outcome import Cancel, Snooze, default_backoff
from belay.registry import Registry, WorkerDef, worker
from belay.runner import JobEnd, Worker
from belay.schema import CONTRACT_MAJOR, MIN_REVISION, SchemaStatus

__all__ = [
    "CONTRACT_MAJOR",
    "MIN_REVISION",
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
    "WorkflowStatus",
    "await_result",
    "cancel_job",
    "check_schema",
    "clear_signal",
    "configure",
    "default",
    "default_backoff",
    "enqueue",
    "enqueue_many",
    "errors",
    "events",
    "get_job",
    "list_jobs",
    "migrate",
    "retry_job",
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
) -> Job:
    return default().enqueue(
        kind, input, queue=queue, priority=priority, delay=delay, run_at=run_at,
        max_attempts=max_attempts, unique=unique, budget=budget, meta=meta,
        partition_key=partition_key, encrypt=encrypt, conn=conn,
    )


def enqueue_many(
    jobs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Conn | None = None
) -> list[Job]:
    return default().enqueue_many(jobs, conn=conn)


def get_job(job_id: int, *, conn: Conn | None = None) -> Job | None:
    return default().get_job(job_id, conn=conn)


def list_jobs(**filters: Any) -> list[Job]:
    return default().list_jobs(**filters)


def steps(job_id: int, *, conn: Conn | None = None) -> list[Step]:
    return default().steps(job_id, conn=conn)


def events(job_id: int, after: int = 0, *, conn: Conn | None = None) -> list[Event]:
    return default().events(job_id, after, conn=conn)


def subscribe_events(
    job_id: int, after: int = 0, *, timeout: float | None = None
) -> Iterator[Event]:
    return default().subscribe_events(job_id, after, timeout=timeout)


def workflow_status(workflow_id: str, *, conn: Conn | None = None) -> WorkflowStatus:
    return default().workflow_status(workflow_id, conn=conn)


def stats(*, conn: Conn | None = None) -> dict[str, dict[str, int]]:
    return default().stats(conn=conn)


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
