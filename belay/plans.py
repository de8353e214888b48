"""Storage operations written once, for a blocking and an asyncio connection.

An operation here is a *plan*: a generator that yields each statement it
needs as a :class:`Call` (a named statement from ``belay/sql``, its
parameters and the shape of the answer) and receives the answer back, with
the decisions between statements in plain Python. It never touches a
connection. :func:`belay.store.run` drives a plan on a psycopg
``Connection``, :func:`belay.aio.run` on an ``AsyncConnection``; so the
synchronous client and :mod:`belay.aio` share every statement and every
decision (the lock order, the retries of a unique-key enqueue, workflow
settlement) with no second copy.

Like the rest of the storage boundary, a plan takes "now" as a value and
says when it must run inside a transaction.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, NamedTuple, TypeVar

from belay import names
from belay.codec import dumps, loads
from belay.enqueue import Row
from belay.errors import ValidationError
from belay.job import PARKED, TERMINAL, Event, Job
from belay.settle import Member, settle

T = TypeVar("T")

#: The shapes of an answer: every row as a dict, the first column of the
#: first row (None without one), the number of rows the statement touched.
ROWS: Final = "rows"
VALUE: Final = "value"
COUNT: Final = "count"


class Call(NamedTuple):
    """One statement of a plan: ``query`` names it in ``belay/sql``."""

    query: str
    params: Any = None
    shape: str = ROWS


#: A plan that ends with a value of type T.
Plan = Generator[Call, Any, T]


def _fetch_rows(query: str, params: Any = None) -> Plan[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = yield Call(query, params, ROWS)
    return rows


def _fetch_value(query: str, params: Any = None) -> Plan[Any]:
    return (yield Call(query, params, VALUE))


def _fetch_count(query: str, params: Any = None) -> Plan[int]:
    count: int = yield Call(query, params, COUNT)
    return count


def current_database() -> Plan[str]:
    return str((yield from _fetch_value("current_database")))


def lock(key: str) -> Plan[None]:
    """Take a transaction-scoped advisory lock (released at commit or rollback)."""
    yield from _fetch_count("advisory_xact_lock", (key,))


def lock_all(keys: Iterable[str]) -> Plan[None]:
    """Take several transaction-scoped advisory locks, in sorted order."""
    ordered = sorted(set(keys))
    if ordered:
        yield from _fetch_count("advisory_xact_locks", (ordered,))


def notify(channel: str, payloads: Iterable[bytes]) -> Plan[None]:
    """§9.2: one pg_notify per distinct payload; transactional, so sent on commit only."""
    distinct = sorted({p.decode() for p in payloads})
    if distinct:
        yield from _fetch_count("notify", (channel, distinct))


# -- Schema (§1) ---------------------------------------------------------------------


def schema_status() -> Plan[tuple[int, int | None]]:
    """The schema's revision (0: no belay schema) and contract major (None: unrecorded)."""
    if not (yield from _fetch_value("meta_exists")):
        return 0, None
    revision = yield from _fetch_value("meta_revision")
    major = None
    if (yield from _fetch_value("meta_has_contract_major")):
        found = yield from _fetch_value("meta_contract_major")
        major = None if found is None else int(found)
    return int(revision or 0), major


# -- Enqueue (§5) --------------------------------------------------------------------

_ROW_FIELDS = (
    "kind", "queue", "state", "input", "meta", "priority", "max_attempts", "partition_key",
    "ready_at", "workflow_id", "wf_name", "wf_deps", "wf_ignore", "cron_name", "cron_slot",
    "unique_key", "unique_mode", "parent_id", "budget_usd_micros", "budget_tokens",
)


def insert_jobs(rows: Sequence[Row], now: datetime, *, channel: str | None = None
                ) -> Plan[list[Job]]:
    """§5.1: insert, skipping conflicts; returns the inserted jobs in input order.
    With a ``channel``, the statement also pokes each inserted job's queue there
    (§9.2), sent when its transaction commits."""
    if len(rows) == 1:
        row = rows[0]
        job_id = yield from _fetch_value("insert_job", (*row, now, channel, channel))
        return [] if job_id is None else [new_job(job_id, row, now)]
    params: dict[str, Any] = {name: [getattr(r, name) for r in rows] for name in _ROW_FIELDS}
    params["now"] = now
    params["channel"] = channel
    inserted = [Job.from_row(r) for r in (yield from _fetch_rows("insert_jobs", params))]
    # ids are drawn in input order (the statement orders by ordinality).
    inserted.sort(key=lambda job: job.id)
    return inserted


def new_job(job_id: int, row: Row, now: datetime) -> Job:
    """The job a newly inserted row became, without reading it back: every
    column is the row's value or its fixed starting value."""
    return Job.trusted({
        "id": job_id, "kind": row.kind, "queue": row.queue, "state": row.state,
        "input": loads(row.input), "meta": {} if row.meta == "{}" else loads(row.meta),
        "priority": row.priority, "max_attempts": row.max_attempts,
        "partition_key": row.partition_key, "ready_at": row.ready_at,
        "workflow_id": row.workflow_id, "wf_name": row.wf_name,
        "wf_deps": _text_array(row.wf_deps), "wf_ignore": _text_array(row.wf_ignore),
        "cron_name": row.cron_name, "cron_slot": row.cron_slot, "unique_key": row.unique_key,
        "unique_mode": row.unique_mode, "parent_id": row.parent_id,
        "budget_usd_micros": row.budget_usd_micros, "budget_tokens": row.budget_tokens,
        "errors": [], "inserted_at": now,
    })


def _text_array(encoded: str) -> list[str]:
    return [] if encoded == "[]" else list(loads(encoded))


def holders_by_unique_key(keys: Iterable[str]) -> Plan[dict[tuple[str, bool], Job]]:
    """§5.2: the newest job holding each key, by (key, mode is ``incomplete``):
    the two unique indexes are separate, so each mode group has its own holder."""
    found = yield from _fetch_rows("jobs_by_unique_keys", {"keys": list(set(keys))})
    return {(row["unique_key"], row["unique_mode"] == "incomplete"):
            Job.from_row(row, duplicate=True) for row in found}


def holders_by_cron_slot(slots: Iterable[tuple[str, datetime]]
                         ) -> Plan[dict[tuple[str, datetime], Job]]:
    slots = list(set(slots))
    found = yield from _fetch_rows(
        "jobs_by_cron_slots", ([s[0] for s in slots], [s[1] for s in slots]))
    return {
        (row["cron_name"], row["cron_slot"]): Job.from_row(row, duplicate=True) for row in found
    }


def enqueue(rows: Sequence[Row], now: datetime, *, channel: str | None = None,
            autocommit: bool = False) -> Plan[list[Job]]:
    """Insert ``rows``; a skipped row's result is the holder of its key (§5.2).
    With a ``channel``, each insert statement pokes its own queues. On an
    ``autocommit`` connection each one commits on its own."""
    pending = list(range(len(rows)))
    results: list[Job | None] = [None] * len(rows)
    # An `incomplete` holder can finish between the skipped insert and the
    # holder lookup; then the key is free again and the row is retried.
    for _ in range(3):
        inserted = yield from insert_jobs([rows[i] for i in pending], now, channel=channel)
        skipped = match_inserted(rows, pending, inserted, results)
        if not skipped:
            break
        holders = yield from holders_by_unique_key(
            [k for i in skipped if (k := rows[i].unique_key) is not None])
        slots = yield from holders_by_cron_slot(
            [(c, s) for i in skipped
             if (c := rows[i].cron_name) is not None and (s := rows[i].cron_slot) is not None])
        pending = []
        for i in skipped:
            row = rows[i]
            holder = (holders.get((row.unique_key, row.unique_mode == "incomplete"))
                      if row.unique_key is not None
                      else slots.get((row.cron_name, row.cron_slot)))  # type: ignore[arg-type]
            if holder is None or (row.unique_mode == "incomplete" and holder.terminal):
                pending.append(i)
            else:
                results[i] = holder
        if not pending:
            break
    missing = [i for i, job in enumerate(results) if job is None]
    if missing:
        written = "" if not autocommit else (
            "; the others are enqueued (ids "
            + ", ".join(str(job.id) for job in results if job is not None) + ")"
        )
        raise ValidationError(
            f"job(s) at position {missing} conflicted with a row that then disappeared; "
            f"enqueue them again{written}"
        )
    return [job for job in results if job is not None]


def match_inserted(
    rows: Sequence[Row], pending: list[int], inserted: list[Job], results: list[Job | None]
) -> list[int]:
    """Pair inserted jobs with the requests they came from; returns the skipped ones.

    Inserted rows are an in-order subsequence of the pending requests (ids are
    drawn in input order), and a row can only be skipped for a conflict on its
    unique key or cron slot, so a greedy in-order match on those is exact.
    """
    skipped: list[int] = []
    j = 0
    for i in pending:
        job = inserted[j] if j < len(inserted) else None
        if job is not None and _identity(job) == rows[i].identity():
            results[i] = job
            j += 1
        else:
            skipped.append(i)
    if j != len(inserted):
        raise RuntimeError("belay: inserted rows did not match the request order")
    return skipped


def _identity(job: Job) -> tuple[Any, ...]:
    return (job.kind, job.queue, job.unique_key, job.unique_mode, job.cron_name, job.cron_slot)


def lock_workflow(workflow_id: str) -> Plan[list[Job]]:
    """Take the workflow lock (held until commit) and return the members already there.

    Enqueueing a workflow checks and inserts under this lock, so concurrent
    enqueues of one workflow id insert its members once. §7 lock order: it is
    the first lock the transaction takes. Atomic: run inside a transaction.
    """
    yield from lock(names.workflow_lock(workflow_id))
    return (yield from workflow_jobs(workflow_id))


def enqueue_workflow(workflow_id: str, rows: Sequence[Row], now: datetime
                     ) -> Plan[tuple[bool, list[Job]]]:
    """A workflow's members inserted under its lock: ``(True, inserted)``, or
    ``(False, members already there)`` with nothing written when the id has
    members. Atomic: run inside a transaction."""
    existing = yield from lock_workflow(workflow_id)
    if existing:
        return False, existing
    inserted = yield from insert_jobs(rows, now)
    if len(inserted) != len(rows):
        # Members carry no unique key or cron slot, so nothing can conflict.
        raise RuntimeError("belay: a workflow member was not inserted")
    return True, inserted


# -- Reads ---------------------------------------------------------------------------


def get_job(job_id: int, *, for_update: bool = False) -> Plan[Job | None]:
    found = yield from _fetch_rows("get_job_for_update" if for_update else "get_job", (job_id,))
    return Job.from_row(found[0]) if found else None


@dataclass(frozen=True)
class JobFilter:
    queue: str | None = None
    state: str | None = None
    kind: str | None = None
    workflow_id: str | None = None
    parent_id: int | None = None
    before_id: int | None = None
    limit: int = 50


def list_jobs(where: JobFilter) -> Plan[list[Job]]:
    params = {
        "queue": where.queue, "state": where.state, "kind": where.kind,
        "workflow_id": where.workflow_id, "parent_id": where.parent_id,
        "before_id": where.before_id, "limit": where.limit,
    }
    return [Job.from_row(r) for r in (yield from _fetch_rows(list_statement(where), params))]


def list_statement(where: JobFilter) -> str:
    """Which ``list_jobs*`` statement serves a filter (pure): a workflow or a
    parent has its own index; a state and/or a queue reads
    belay_jobs_state_queue_id_idx in the page-of-ids shape."""
    if where.workflow_id is not None or where.parent_id is not None:
        return "list_jobs"
    if where.state is not None:
        return "list_jobs_in_state_queue" if where.queue is not None else "list_jobs_in_state"
    return "list_jobs_in_queue" if where.queue is not None else "list_jobs"


def workflow_jobs(workflow_id: str) -> Plan[list[Job]]:
    return [Job.from_row(r) for r in (yield from _fetch_rows("workflow_jobs", (workflow_id,)))]


def list_events(job_id: int, after: int, limit: int | None = None) -> Plan[list[Event]]:
    return [Event(r["seq"], r["payload"], r["inserted_at"])
            for r in (yield from _fetch_rows("list_events", (job_id, after, limit)))]


# -- Signals (§8.1) --------------------------------------------------------------------


def deliver_signal(scope: str, name: str, payload_json: str, now: datetime
                   ) -> Plan[list[tuple[int, str]]]:
    """Upsert the signal and wake its awaiters; returns the woken (id, queue) pairs.

    Atomic: run inside a transaction. §7: the scope lock serializes this
    against a job parking on the same scope, so no wake-up is ever lost.
    """
    yield from lock(names.signal_lock(scope))
    yield from _fetch_count("upsert_signal", (scope, name, payload_json, now))
    woken = yield from _fetch_rows("wake_awaiting", {"scope": scope, "name": name, "now": now})
    return [(r["id"], r["queue"]) for r in woken]


def deliver_signals(scopes: Iterable[str], name: str, payload_json: str, now: datetime
                    ) -> Plan[list[tuple[int, str]]]:
    """:func:`deliver_signal` to several scopes in three statements, the scope
    locks taken in sorted order. Atomic: run inside a transaction."""
    distinct = sorted(set(scopes))
    if not distinct:
        return []
    yield from lock_all([names.signal_lock(scope) for scope in distinct])
    params = {"scopes": distinct, "name": name, "payload": payload_json, "now": now}
    yield from _fetch_count("upsert_signals", params)
    return [(r["id"], r["queue"]) for r in (yield from _fetch_rows("wake_awaiting_many", params))]


# -- Cancel, retry, settlement (§7, §8.3, §8.6) -------------------------------------


@dataclass(frozen=True)
class Settled:
    """What a terminal write set in motion: jobs made ready (to poke) and dooms."""

    ready: list[tuple[int, str]]
    cancelled: list[int]


def settle_workflow(workflow_id: str, now: datetime) -> Plan[
    tuple[list[dict[str, Any]], list[dict[str, Any]]]
]:
    """§8.3 under the workflow lock (taking it again when held is harmless);
    returns the released and doomed rows."""
    yield from lock(names.workflow_lock(workflow_id))
    return (yield from settle_workflows([workflow_id], now))


def settle_workflows(workflow_ids: Sequence[str], now: datetime) -> Plan[
    tuple[list[dict[str, Any]], list[dict[str, Any]]]
]:
    """§8.3 for several workflows, whose locks the caller holds: one read of
    their members, each settled on its own, one write of each kind."""
    if not workflow_ids:
        return [], []
    by_workflow: dict[str, list[Member]] = {}
    for r in (yield from _fetch_rows("workflow_members_many", (list(workflow_ids),))):
        by_workflow.setdefault(r["workflow_id"], []).append(
            Member(r["id"], r["wf_name"], r["state"], r["wf_deps"] or (), r["wf_ignore"] or ()))
    release_ids: list[int] = []
    doom_ids: list[int] = []
    for members in by_workflow.values():
        releases, dooms = settle(members)
        release_ids += releases
        doom_ids += dooms
    released = (yield from _fetch_rows("settle_release", (now, release_ids))) if release_ids else []
    doomed = (yield from _fetch_rows("settle_doom", (now, doom_ids))) if doom_ids else []
    return released, doomed


def after_terminal(job: Job, now: datetime) -> Plan[Settled]:
    """§7 "after any terminal write": settle the workflow, then tell parents."""
    return (yield from settle_and_notify(job.workflow_id, [job.parent_id], now))


def settle_and_notify(workflow_id: str | None, parent_ids: list[int | None], now: datetime
                      ) -> Plan[Settled]:
    """Settle (when a workflow member) and send ``$children`` to each parent of
    the job and of every member settlement doomed.

    Lock order is workflow lock, then signal-scope locks — never the reverse.
    Parents are told unconditionally, never gated on a sibling count (§11 R1).
    """
    ready: list[tuple[int, str]] = []
    doomed: list[dict[str, Any]] = []
    if workflow_id is not None:
        released, doomed = yield from settle_workflow(workflow_id, now)
        ready.extend((r["id"], r["queue"]) for r in released)
    for parent_id in [*parent_ids, *(r["parent_id"] for r in doomed)]:
        if parent_id is not None:
            ready.extend((yield from deliver_signal(
                names.job_scope(parent_id), names.CHILDREN, "{}", now)))
    return Settled(ready=ready, cancelled=[r["id"] for r in doomed])


def lock_job(job_id: int) -> Plan[Job | None]:
    """Lock a job's row for a change that may settle its workflow.

    Lock order, everywhere: workflow lock, then job rows, then signal-scope
    locks. Settlement writes other members' rows, so a writer holding one
    member's row while queueing for the workflow lock would deadlock with a
    settler. ``workflow_id`` never changes, so reading it unlocked is safe.
    """
    job = yield from get_job(job_id)
    if job is None:
        return None
    if job.workflow_id is not None:
        yield from lock(names.workflow_lock(job.workflow_id))
    return (yield from get_job(job_id, for_update=True))


@dataclass(frozen=True)
class CancelOutcome:
    status: str  # "cancelled" | "requested" | "noop"
    job: Job
    settled: Settled


def cancel_job(job_id: int, now: datetime) -> Plan[CancelOutcome | None]:
    """§8.6: parked/held → cancelled (+ settlement, parent notify); running →
    cancel_requested. Atomic: run inside a transaction. None when no such job."""
    job = yield from lock_job(job_id)
    if job is None:
        return None
    nothing = Settled([], [])
    if job.state in TERMINAL:
        return CancelOutcome("noop", job, nothing)
    if job.state == "running":
        yield from _fetch_count("request_cancel", (job_id,))
        return CancelOutcome("requested", job.replace(cancel_requested=True), nothing)
    if job.state not in PARKED:
        return CancelOutcome("noop", job, nothing)
    rows = yield from _fetch_rows("cancel_parked", {
        "id": job_id, "state": job.state, "now": now,
        "error": dumps({"reason": "cancel"}).decode(),
    })
    cancelled = Job.from_row(rows[0])
    return CancelOutcome("cancelled", cancelled, (yield from after_terminal(cancelled, now)))


@dataclass(frozen=True)
class RetryOutcome:
    job: Job
    settled: Settled


def retry_job(job_id: int, now: datetime) -> Plan[RetryOutcome | str | None]:
    """§8.6 operator retry. Returns the outcome, the blocking state (not
    failed/cancelled), or None when no such job. Atomic: run in a transaction."""
    job = yield from lock_job(job_id)
    if job is None:
        return None
    if job.state not in ("failed", "cancelled"):
        return job.state
    # §8.6: a dep-bearing member goes back to held and lets settlement decide;
    # going straight to ready would let it run beside a failed dependency.
    target = "held" if job.wf_deps else "ready"
    rows = yield from _fetch_rows("retry_job", {"id": job_id, "target": target, "now": now})
    retried = Job.from_row(rows[0])
    settled = yield from settle_and_notify(retried.workflow_id, [], now)
    if settled.ready or settled.cancelled:
        retried = (yield from get_job(job_id)) or retried
    if retried.state == "ready" and (retried.id, retried.queue) not in settled.ready:
        settled = Settled([*settled.ready, (retried.id, retried.queue)], settled.cancelled)
    return RetryOutcome(retried, settled)
