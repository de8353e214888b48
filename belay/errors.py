"""Exceptions a belay user can catch, each saying what went wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from belay.job import Job


class BelayError(Exception):
    """Base class of every error belay raises on purpose."""


class ConfigurationError(BelayError):
    """belay was set up wrongly: a bad URL, no default instance, a bad option."""


class PoolerError(ConfigurationError):
    """A transaction-pooling pooler sits between belay and PostgreSQL, and belay
    was not told (the message says which setting to use)."""


class ValidationError(BelayError, ValueError):
    """Input or options were refused before anything was written."""


class SchemaError(BelayError):
    """The database schema cannot be used by this version of belay."""


class SchemaMissing(SchemaError):
    """The belay tables are not there yet."""


class SchemaOutdated(SchemaError):
    """The schema revision is older than this belay needs."""


class ContractMismatch(SchemaError):
    """The database speaks a wire-contract major this belay does not know."""


class JobNotFound(BelayError, LookupError):
    """No job has that id (it may have been pruned by retention)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} does not exist (never inserted, or pruned by retention)")
        self.job_id = job_id


class NotRetryable(BelayError):
    """Only failed or cancelled jobs can be retried."""

    def __init__(self, job_id: int, state: str) -> None:
        super().__init__(
            f"job {job_id} is {state}; only failed or cancelled jobs can be retried"
        )
        self.job_id = job_id
        self.state = state


class JobFailed(BelayError):
    """The awaited job ended in the failed state; ``.job.errors`` says why."""

    def __init__(self, job: Job) -> None:
        last = job.errors[-1] if job.errors else None
        super().__init__(f"job {job.id} ({job.kind}) failed after {job.attempt} attempt(s): {last}")
        self.job = job


class JobCancelled(BelayError):
    """The awaited job was cancelled."""

    def __init__(self, job: Job) -> None:
        super().__init__(f"job {job.id} ({job.kind}) was cancelled")
        self.job = job
