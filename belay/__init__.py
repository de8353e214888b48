"""belay: a Postgres-backed durable job engine for agent workloads.

The module-level functions act on a default instance set up by
:func:`configure` (or, failing that, from ``BELAY_DATABASE_URL``); each one
also exists as a method of :class:`Belay` for explicit instances.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg

from belay import errors
from belay.ambient import ThreadPoolExecutor, propagate
from belay.authority import Authority as Authority
from belay.budget import BudgetNotice as BudgetNotice
from belay.budget import Headroom as Headroom
from belay.client import STATS_CAP as STATS_CAP
from belay.client import Belay
from belay.client import CancelStatus as CancelStatus
from belay.clock import Clock as Clock
from belay.clock import ManualClock
from belay.clock import SystemClock as SystemClock
from belay.codec import Opaque as Opaque
from belay.context import (
    TIMEOUT,
    BudgetExceeded,
    CancelRequested,
    Context,
    Cost,
    Interrupted,
    current_context,
)
from belay.context import (
    StepValueRefused as StepValueRefused,
)
from belay.cron import CronEntry as CronEntry
from belay.cron import CronScheduler as CronScheduler
from belay.cron import DynamicCron as DynamicCron
from belay.defaults import configure, default, set_default
from belay.enqueue import MAX_DELAY_SECONDS as MAX_DELAY_SECONDS
from belay.enqueue import JobSpec as JobSpec
from belay.enqueue import Unique
from belay.errors import (
    AuthorityExceeded,
    BelayError,
    ClientClosed,
    ConfigurationError,
    ContractMismatch,
    IdempotencyConflict,
    JobCancelled,
    JobFailed,
    JobNotFound,
    NotRetryable,
    SchemaError,
    SchemaMissing,
    SchemaOutdated,
    ValidationError,
    WorkerCrashed,
)
from belay.errors import (
    PoolerError as PoolerError,
)
from belay.job import Event, Job, Step
from belay.job import WorkflowStatus as WorkflowStatus
from belay.names import MAX_KEY_BYTES as MAX_KEY_BYTES
from belay.names import MAX_NAME_BYTES as MAX_NAME_BYTES
from belay.outcome import Cancel, Snooze
from belay.outcome import default_backoff as default_backoff
from belay.queues import QueueSpec as QueueSpec
from belay.registry import Registry, worker
from belay.registry import WorkerDef as WorkerDef
from belay.runner import JobEnd, Worker
from belay.schema import CONTRACT_MAJOR as CONTRACT_MAJOR
from belay.schema import MIN_REVISION as MIN_REVISION
from belay.schema import SchemaStatus as SchemaStatus
from belay.spend import SpendReport as SpendReport
from belay.spend import SpendTree as SpendTree
from belay.workflow import Workflow

# What people use daily. The rest stays importable from here, and is
# documented where it lives: belay.client (STATS_CAP, CancelStatus),
# belay.clock, belay.cron (CronEntry, CronScheduler, DynamicCron),
# belay.enqueue (JobSpec, MAX_DELAY_SECONDS), belay.codec (Opaque),
# belay.errors (every exception), belay.job (WorkflowStatus), belay.names,
# belay.outcome (default_backoff), belay.queues (QueueSpec),
# belay.registry (WorkerDef), belay.schema (CONTRACT_MAJOR, MIN_REVISION,
# SchemaStatus), belay.context (StepValueRefused).
__all__ = [
    "TIMEOUT",
    "AuthorityExceeded",
    "Belay",
    "BelayError",
    "BudgetExceeded",
    "Cancel",
    "CancelRequested",
    "ClientClosed",
    "ConfigurationError",
    "Context",
    "ContractMismatch",
    "Cost",
    "Event",
    "IdempotencyConflict",
    "Interrupted",
    "Job",
    "JobCancelled",
    "JobEnd",
    "JobFailed",
    "JobNotFound",
    "ManualClock",
    "NotRetryable",
    "Registry",
    "SchemaError",
    "SchemaMissing",
    "SchemaOutdated",
    "Snooze",
    "Step",
    "ThreadPoolExecutor",
    "Unique",
    "ValidationError",
    "Worker",
    "WorkerCrashed",
    "Workflow",
    "await_result",
    "cancel_job",
    "check_schema",
    "clear_signal",
    "configure",
    "current_context",
    "default",
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
    "propagate",
    "put_cron",
    "put_queue",
    "resume_cron",
    "resume_queue",
    "retry_job",
    "set_default",
    "signal",
    "signal_job",
    "spend",
    "spend_tree",
    "stats",
    "steer_job",
    "steps",
    "subscribe_events",
    "top_up",
    "worker",
    "workflow_status",
]

Conn = psycopg.Connection[Any]


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
    watchdog: Mapping[str, Any] | None = None,
    authority: Mapping[str, Any] | None = None,
) -> Job:
    return default().enqueue(
        kind, input, queue=queue, priority=priority, delay=delay, run_at=run_at,
        max_attempts=max_attempts, unique=unique, budget=budget, meta=meta,
        partition_key=partition_key, encrypt=encrypt, conn=conn, session=session,
        watchdog=watchdog, authority=authority,
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


def top_up(job_id: int, *, usd: float | None = None, tokens: int | None = None,
           idempotency_key: str | None = None, conn: Conn | None = None) -> Job:
    return default().top_up(job_id, usd=usd, tokens=tokens, idempotency_key=idempotency_key,
                            conn=conn)


def spend(by: str | Sequence[str] = "kind", **options: Any) -> SpendReport:
    return default().spend(by, **options)


def spend_tree(job_id: int, *, conn: Conn | None = None) -> SpendTree:
    return default().spend_tree(job_id, conn=conn)


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
