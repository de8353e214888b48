"""Exceptions a belay user can catch, each saying what went wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import psycopg
import psycopg_pool

if TYPE_CHECKING:
    from belay.job import Job

#: What a failed database call means to whoever reports it (:func:`database_failure`).
UNAVAILABLE: Final = "unavailable"
INVALID: Final = "invalid"
REFUSED: Final = "refused"


def database_failure(exc: BaseException) -> str | None:
    """What a failed database call means, one answer for every surface that
    reports one (the CLI, the HTTP API and its worker sessions, the MCP
    server, the dashboard); None when ``exc`` is not a database failure.

    - :data:`INVALID`: PostgreSQL refused a value of the call (a ``DataError``:
      a NUL in text, a number out of range). The caller's input: a 400.
    - :data:`UNAVAILABLE`: there was no database to talk to (the connection
      failed or broke, no pooled connection came in time, the server is
      shutting down or cancelled the statement). Try again later: a 503.
    - :data:`REFUSED`: the database answered no (a missing privilege, a
      missing table, a constraint). The deployment's to fix.
    """
    if isinstance(exc, psycopg.DataError):
        return INVALID
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError,
                        psycopg_pool.PoolTimeout)):
        return UNAVAILABLE
    if isinstance(exc, psycopg.Error):
        return REFUSED
    return None


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


class ClientClosed(BelayError):
    """The client (:class:`belay.Belay`, :class:`belay.aio.AsyncBelay`) was
    closed: a wait under way on it ends with this, and so does every later
    call that would need its own connections (it never opens them again)."""

    def __init__(self, job_id: int | None = None) -> None:
        if job_id is None:
            message = ("this belay client was closed; create a new one (or call "
                       "belay.configure() again) to reach the database")
        else:
            message = (f"the client was closed while waiting for job {job_id}; the job "
                       "itself is unaffected: wait again on an open client")
        super().__init__(message)
        #: The job the closed wait was for; None for a call made after close().
        self.job_id = job_id


class WorkerCrashed(BelayError):
    """A worker's background service died (its heartbeat, a producer, the
    acker…): the worker stopped claiming and stopped, and ``run()`` raises
    this so ``belay worker`` exits non-zero and a supervisor restarts it."""

    def __init__(self, service: str, cause: BaseException) -> None:
        super().__init__(f"the worker's {service} service crashed ({cause!r}); the worker "
                         "stopped claiming and stopped. Restart it (a process supervisor "
                         "does); its jobs' leases lapse and are reclaimed")
        self.service = service
        self.cause = cause


# -- Raised inside a running job (belay's control flow) ------------------------------
#
# BaseExceptions, like KeyboardInterrupt, so a job's own ``except Exception:``
# can't swallow them; ``finally`` blocks still run. ``belay.context`` names
# them too.


class BudgetExceeded(BaseException):
    """The job's recorded spend went over its budget (§8.2): it fails now."""

    def __init__(self, entry: dict[str, Any]) -> None:
        super().__init__(f"budget exceeded: {entry}")
        self.entry = entry


class NoProgress(BaseException):
    """The watchdog saw no progress (steps that repeat, or none for too long):
    the job fails now, without a retry that would loop the same way."""

    def __init__(self, entry: dict[str, Any]) -> None:
        super().__init__(entry.get("message", "no progress"))
        self.entry = entry


class CancelRequested(BaseException):
    """An operator asked to cancel this job (§8.6); honoured at a step boundary."""


class StepValueRefused(ValidationError):
    """A step's value can't be journaled (not JSON, or over 1 MiB). The job fails at
    once: retrying would pay for the same step again and fail the same way."""


class Interrupted(BaseException):
    """This run no longer owns its job: its lease was lost, it timed out, or the
    worker is shutting down hard.

    A ``BaseException``, like ``KeyboardInterrupt``, so a job's own
    ``except Exception:`` can't swallow it; ``finally`` blocks still run.
    """



class AuthorityExceeded(ValidationError):
    """A job asked for more than its authority allows (:mod:`belay.authority`):
    a wider capability set than its parent's, a tool, queue or worker outside
    it, a budget over its caps. Raised in a job, it fails the job at once: a
    retry would ask again."""


class IdempotencyConflict(ValidationError):
    """An idempotency key sent again with a different request: a top-up key
    already used on that job with other amounts (``belay.Belay.top_up``)."""


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
