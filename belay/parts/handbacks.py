"""Hand-backs: a claimed attempt given back because the executor running it
was lost (issue 38).

An executor on the socket that closes, dies, sends a broken frame or stops
reading while it runs a job gives the job back. Usually that is the
infrastructure (a deploy, a restart, a crash elsewhere), and the job should
not pay for it. But a job can be what kills its executor (a crash in native
code, ``os._exit``, running out of memory), every time: given back for free,
it would run forever. So each hand-back is counted on the row, as an
``errors`` entry::

    {"error": "executor_lost", "attempt": 2, "executor": "socket:node-7/1df6ae9a0ad4",
     "reason": "it closed", "at": "2026-03-01T12:00:00+00:00"}

Below :data:`EXECUTOR_LOSSES` losses of one attempt the hand-back is a
snooze due now (not an attempt used, as before); the loss that reaches it
fails the attempt — retried after the job's backoff, or ``failed`` once the
attempts are used up — and its entry also carries ``lost`` (the count),
``executors`` (the node ids) and a ``message``. A poison-pill job is so
bounded at about ``EXECUTOR_LOSSES * max_attempts`` runs. A job whose cancel
was requested ends ``cancelled`` instead.

The count and the decision are one fenced statement (``give_back`` in
``belay/sql/queries.sql``), so two servers handing back one row neither
lose nor double a count. Terminal outcomes settle the workflow and tell the
parent (:func:`belay.plans.after_terminal`), as every ack does.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg

from belay import names, plans, store
from belay.codec import dumps
from belay.job import Job
from belay.outcome import MESSAGE_LIMIT, Backoff, safe_delay, storable
from belay.parts.completer import Announce

log = logging.getLogger("belay.executors")

#: The ``error`` of a hand-back's entry.
EXECUTOR_LOST: Final = "executor_lost"
#: Losses of its executor one attempt takes: the one that reaches this
#: fails the attempt. Three: a restart during a deploy (or two) costs
#: nothing, and a job that kills every executor it runs on stops after
#: three of them per attempt.
EXECUTOR_LOSSES: Final = 3


def lost_entry(job: Job, executor: str, why: str, now: datetime) -> dict[str, Any]:
    """The ``errors`` entry of one hand-back of ``job``'s claimed attempt."""
    return {"error": EXECUTOR_LOST, "attempt": job.attempt, "executor": storable(executor),
            "reason": storable(why[:MESSAGE_LIMIT]), "at": now.isoformat()}


def failure_message(job: Job) -> str:
    """The ``message`` of the loss that fails the attempt: a ``format()``
    template the statement fills with the count and the executors."""
    return (f"attempt {job.attempt} lost its executor %s times (%s): the job may be what "
            "kills it (a crash in native code, os._exit, running out of memory), so the "
            "attempt failed; those executors' logs say how they ended")


def give_back_plan(job: Job, executor: str, why: str, now: datetime, retry_at: datetime,
                   limit: int = EXECUTOR_LOSSES) -> plans.Plan[tuple[str, store.Acked] | None]:
    """The fenced hand-back (see the module); (what it became — ``snooze``,
    ``retry``, ``failed`` or ``cancelled`` — and the ack), or None when stale.
    Atomic: run inside a transaction. Lock order as every ack: the workflow
    lock, then the row, then (settling) the signal scopes."""
    if job.workflow_id is not None:
        yield from plans.lock(names.workflow_lock(job.workflow_id))
    rows: list[dict[str, Any]] = yield plans.Call("give_back", {
        "id": job.id, "attempt": job.attempt, "node": executor, "now": now,
        "retry_at": retry_at, "limit": limit,
        "entry": dumps(lost_entry(job, executor, why, now)).decode(),
        "cancelled": dumps({"reason": "cancel_requested", "attempt": job.attempt}).decode(),
        "message": failure_message(job),
    })
    if not rows:
        return None
    kind = str(rows[0]["handed_back"])
    updated = Job.from_row(rows[0])
    settled = (yield from plans.after_terminal(updated, now)) if updated.terminal \
        else plans.Settled([], [])
    return kind, store.Acked(updated, settled)


def give_back(conn: psycopg.Connection[Any], job: Job, executor: str, why: str,
              now: datetime, backoff: Backoff, announce: Announce
              ) -> tuple[str, store.Acked] | None:
    """Hand ``job``'s claimed attempt back, lost by ``executor`` (the node it
    was leased to) because ``why``, in a transaction of its own with
    ``announce`` inside it; what it became and the ack, or None when stale."""
    retry_at = now + timedelta(seconds=safe_delay(backoff, job.attempt))
    with conn.transaction():
        handed = store.run(conn, give_back_plan(job, executor, why, now, retry_at))
        if handed is None:
            return None
        kind, acked = handed
        announce(conn, acked)
    if kind == "cancelled":
        log.info("belay: job %d attempt %d: its executor was lost with a cancel requested; "
                 "cancelled", job.id, job.attempt)
    elif kind != "snooze":
        log.error("belay: job %d attempt %d: %s", job.id, job.attempt,
                  _message(acked.job.errors))
    return kind, acked


def _message(errors: Any) -> str:
    last = errors[-1] if isinstance(errors, list) and errors else None
    return str(last.get("message")) if isinstance(last, dict) else EXECUTOR_LOST
