"""The storage boundary: named operations over a psycopg connection.

Callers (the client, later the worker and the step context) never touch a
cursor; they call these. Each takes the connection to run on — the caller
owns the transaction — and "now" as a value (contract §2). Operations that
need several statements to be atomic say so and must run inside a
transaction; the client guarantees that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from belay import budget, holds, names, plans
from belay.authority import authority_of
from belay.codec import dumps, loads
from belay.connect import pooler_error
from belay.enqueue import Row
from belay.errors import ConfigurationError, JobNotFound, ValidationError
from belay.job import Event, Job, Step
from belay.queues import QueueSpec, rate_admits, rate_allowance
from belay.sql import QUERIES

Conn = psycopg.Connection[Any]
T = TypeVar("T")


def _cursor(conn: Conn) -> psycopg.Cursor[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    # Per cursor, not per connection: a caller's connection keeps its own JSON settings.
    set_json_loads(loads, cur)
    return cur


def _run(cur: psycopg.Cursor[Any], query: str, params: Any) -> None:
    try:
        cur.execute(QUERIES[query], params)
    except psycopg.Error as exc:
        # A transaction pooler belay was not told about: say which setting.
        translated = pooler_error(exc)
        if translated is None:
            raise
        raise translated from exc


def _rows(conn: Conn, query: str, params: Any = None) -> list[dict[str, Any]]:
    with _cursor(conn) as cur:
        _run(cur, query, params)
        return cur.fetchall()


def _jobs(conn: Conn, query: str, params: Any = None) -> list[Job]:
    """The jobs a statement returns (its columns are {job_columns}): the hot
    path of every claim, so rows come as tuples, not dicts, and become jobs
    with one zip each."""
    with conn.cursor() as cur:
        set_json_loads(loads, cur)
        _run(cur, query, params)
        rows = cur.fetchall()
        if not rows:
            return []
        names = _COLUMNS.get(query)
        if names is None:
            # A statement's columns are its text's: read once (building
            # ``cur.description`` costs more than decoding a claim's rows).
            result = cur.pgresult
            assert result is not None
            names = _COLUMNS[query] = [
                (result.fname(i) or b"").decode() for i in range(result.nfields)]
        return Job.from_columns(names, rows)


#: The column names of each statement :func:`_jobs` ran.
_COLUMNS: dict[str, list[str]] = {}


def _value(conn: Conn, query: str, params: Any = None) -> Any:
    with conn.cursor() as cur:
        _run(cur, query, params)
        row = cur.fetchone()
        return None if row is None else row[0]


def _execute(conn: Conn, query: str, params: Any = None) -> int:
    with conn.cursor() as cur:
        _run(cur, query, params)
        return cur.rowcount


def run(conn: Conn, plan: plans.Plan[T]) -> T:
    """Drive a :mod:`belay.plans` operation on ``conn``: each statement it
    yields runs here and its answer goes back in."""
    try:
        call = next(plan)
        while True:
            if call.shape == plans.ROWS:
                answer: Any = _rows(conn, call.query, call.params)
            elif call.shape == plans.VALUE:
                answer = _value(conn, call.query, call.params)
            else:
                answer = _execute(conn, call.query, call.params)
            call = plan.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def current_database(conn: Conn) -> str:
    return run(conn, plans.current_database())


def local_statement_timeout(conn: Conn, milliseconds: int) -> None:
    """Bound the statements of the current transaction (SET LOCAL)."""
    _value(conn, "local_statement_timeout", (f"{int(milliseconds)}ms",))


def lock(conn: Conn, key: str) -> None:
    """Take a transaction-scoped advisory lock (released at commit or rollback)."""
    run(conn, plans.lock(key))


def lock_all(conn: Conn, keys: Iterable[str]) -> None:
    """Take several transaction-scoped advisory locks, in sorted order."""
    run(conn, plans.lock_all(keys))


# -- Enqueue -------------------------------------------------------------------

def insert_jobs(
    conn: Conn, rows: Sequence[Row], now: datetime, *, channel: str | None = None
) -> list[Job]:
    """§5.1 (:func:`belay.plans.insert_jobs`)."""
    return run(conn, plans.insert_jobs(rows, now, channel=channel))


def conflict_free(rows: Sequence[Row]) -> bool:
    """True when no row carries a unique key or cron slot: then none can be
    skipped on conflict, and :func:`copy_jobs` may write the batch."""
    return all(row.unique_key is None and row.cron_name is None for row in rows)


def copy_jobs(conn: Conn, rows: Sequence[Row], now: datetime) -> list[Job]:
    """§5.1 for a batch that cannot conflict (:func:`conflict_free`): ids drawn
    in input order, then one COPY. Two round trips whatever the size, to be run
    in a transaction; the jobs returned are built from the rows, not read back."""
    try:
        with conn.cursor() as cur:
            ids = [row[0] for row in cur.execute(QUERIES["draw_job_ids"], (len(rows),))]
            with cur.copy(QUERIES["copy_jobs"]) as copy:
                write = copy.write_row
                for job_id, row in zip(ids, rows, strict=True):
                    write((job_id, row.kind, row.queue, row.state, row.input, row.meta,
                           row.priority, 0, row.max_attempts, row.partition_key, row.ready_at,
                           row.workflow_id, row.wf_name, _copy_array(row.wf_deps),
                           _copy_array(row.wf_ignore), row.parent_id, row.budget_usd_micros,
                           row.budget_tokens, 0, 0, "[]", False, now))
    except psycopg.Error as exc:
        translated = pooler_error(exc)
        if translated is None:
            raise
        raise translated from exc
    return [plans.new_job(job_id, row, now) for job_id, row in zip(ids, rows, strict=True)]


def _copy_array(encoded: str) -> str | list[str]:
    # COPY's text form of the empty array, without the array dumper.
    return "{}" if encoded == "[]" else list(loads(encoded))


def holders_by_unique_key(conn: Conn, keys: Iterable[str]) -> dict[tuple[str, bool], Job]:
    return run(conn, plans.holders_by_unique_key(keys))


def holders_by_cron_slot(
    conn: Conn, slots: Iterable[tuple[str, datetime]]
) -> dict[tuple[str, datetime], Job]:
    return run(conn, plans.holders_by_cron_slot(slots))


def notify(conn: Conn, channel: str, payloads: Iterable[bytes]) -> None:
    """§9.2: one pg_notify per distinct payload; transactional, so sent on commit only."""
    run(conn, plans.notify(channel, payloads))


def poke_payload(queue: str) -> bytes:
    return dumps({"t": "p", "q": queue})


def result_payload(job_id: int) -> bytes:
    return dumps({"t": "r", "id": job_id})


def event_payload(job_id: int, seq: int) -> bytes:
    """Not in the contract's list (§9.2); listeners ignore types they don't know."""
    return dumps({"t": "e", "id": job_id, "seq": seq})


# -- Reads ---------------------------------------------------------------------


def get_job(conn: Conn, job_id: int, *, for_update: bool = False) -> Job | None:
    return run(conn, plans.get_job(job_id, for_update=for_update))


JobFilter = plans.JobFilter
list_statement = plans.list_statement


def list_jobs(conn: Conn, where: JobFilter) -> list[Job]:
    return run(conn, plans.list_jobs(where))


def workflow_jobs(conn: Conn, workflow_id: str) -> list[Job]:
    return run(conn, plans.workflow_jobs(workflow_id))


#: Counts per queue and state stop here by default (``Belay.stats()``, the
#: dashboard, ``belay stats``): an exact count reads every index entry, seconds
#: at 10M rows.
STATS_CAP = 10_000


def queue_stats(conn: Conn, live_cap: int | None, terminal_cap: int | None
                ) -> list[dict[str, Any]]:
    """Jobs per (queue, state); a count above its cap reads as the cap + 1."""
    return _rows(conn, "queue_stats", {"live_cap": live_cap, "terminal_cap": terminal_cap})


def queue_spend_in_flight(conn: Conn) -> list[dict[str, Any]]:
    return _rows(conn, "queue_spend_in_flight")


def finished_since(conn: Conn, since: datetime) -> list[dict[str, Any]]:
    return _rows(conn, "finished_since", (since,))


def spend_by(conn: Conn, params: Mapping[str, Any], *, jit_off: bool = False
             ) -> list[dict[str, Any]]:
    """Spend of the jobs of a range, grouped (:class:`belay.spend.Query` builds
    ``params``). ``jit_off``: turn JIT off first, for the rest of the
    transaction ``conn`` is in (belay's own, not a caller's)."""
    if jit_off:
        _rows(conn, "spend_jit_off")
    return _rows(conn, "spend_by", params)


def spend_tree(conn: Conn, job_id: int) -> list[dict[str, Any]]:
    """Spend of a job and all its descendants, per kind."""
    return _rows(conn, "spend_tree", {"job_id": job_id})


def list_steps(conn: Conn, job_id: int) -> list[Step]:
    return [Step.from_row(r) for r in _rows(conn, "list_steps", (job_id,))]


def steps_head(conn: Conn, job_id: int, limit: int) -> list[Step]:
    return [Step.from_row(r) for r in _rows(conn, "steps_head", (job_id, limit))]


def step_totals(conn: Conn, job_id: int) -> dict[str, int]:
    return _rows(conn, "step_totals", (job_id,))[0]


def events_tail(conn: Conn, job_id: int, limit: int) -> list[Event]:
    return [Event(r["seq"], r["payload"], r["inserted_at"])
            for r in _rows(conn, "events_tail", (job_id, limit))]


def count_events(conn: Conn, job_id: int) -> int:
    return int(_value(conn, "count_events", (job_id,)))


def children_head(conn: Conn, parent_id: int, limit: int) -> list[Job]:
    return [Job.from_row(r) for r in _rows(conn, "children_head", (parent_id, limit))]


def count_children(conn: Conn, parent_id: int) -> int:
    return int(_value(conn, "count_children", (parent_id,)))


def list_events(conn: Conn, job_id: int, after: int, limit: int | None = None) -> list[Event]:
    return run(conn, plans.list_events(job_id, after, limit))


def get_signal(conn: Conn, scopes: Sequence[str], name: str) -> tuple[bool, Any]:
    found = _rows(conn, "get_signal", (list(scopes), name))
    return (True, found[0]["payload"]) if found else (False, None)


# -- Signals (§8.1) --------------------------------------------------------------


def deliver_signal(
    conn: Conn, scope: str, name: str, payload_json: str, now: datetime
) -> list[tuple[int, str]]:
    """Upsert the signal and wake its awaiters (:func:`belay.plans.deliver_signal`)."""
    return run(conn, plans.deliver_signal(scope, name, payload_json, now))


def deliver_signals(
    conn: Conn, scopes: Iterable[str], name: str, payload_json: str, now: datetime
) -> list[tuple[int, str]]:
    """:func:`deliver_signal` to several scopes (:func:`belay.plans.deliver_signals`)."""
    return run(conn, plans.deliver_signals(scopes, name, payload_json, now))


def clear_signal(conn: Conn, scope: str, name: str) -> bool:
    return _execute(conn, "delete_signal", (scope, name)) > 0


# -- Cancel, retry, settlement (§7, §8.3, §8.6) ---------------------------------


Settled = plans.Settled
CancelOutcome = plans.CancelOutcome
RetryOutcome = plans.RetryOutcome


def settle_workflows(conn: Conn, workflow_ids: Sequence[str], now: datetime) -> tuple[
    list[dict[str, Any]], list[dict[str, Any]]
]:
    """§8.3 for several workflows, whose locks the caller holds."""
    return run(conn, plans.settle_workflows(workflow_ids, now))


def after_terminal(conn: Conn, job: Job, now: datetime) -> Settled:
    """§7 "after any terminal write": settle the workflow, then tell parents."""
    return run(conn, plans.after_terminal(job, now))


def lock_job(conn: Conn, job_id: int) -> Job | None:
    """Lock a job's row for a change that may settle its workflow (:func:`belay.plans.lock_job`)."""
    return run(conn, plans.lock_job(job_id))


def cancel_job(conn: Conn, job_id: int, now: datetime) -> CancelOutcome | None:
    """§8.6 (:func:`belay.plans.cancel_job`). Atomic: run inside a transaction."""
    return run(conn, plans.cancel_job(job_id, now))


def retry_job(conn: Conn, job_id: int, now: datetime) -> RetryOutcome | str | None:
    """§8.6 operator retry (:func:`belay.plans.retry_job`). Atomic: run in a transaction."""
    return run(conn, plans.retry_job(job_id, now))


def park_await(
    conn: Conn,
    job: Job,
    scope: str,
    name: str,
    deadline: datetime | None,
    now: datetime,
) -> str | Acked | None:
    """§7 park-and-wake: park the claimed attempt of ``job`` on (scope, name)
    until ``deadline``.

    Under the scope lock, an already-delivered signal parks the job ready
    instead, so a delivery racing the park can never be lost. Returns the
    state written ("awaiting" or "ready"), or None for a stale attempt — or,
    when an operator asked to cancel the job while it ran (§8.6), the
    cancellation it ends with instead (:class:`Acked`, settled).
    Atomic: run inside a transaction.
    """
    if job.workflow_id is not None:
        # A cancel settles the workflow: its lock before the row's (lock_job).
        lock(conn, names.workflow_lock(job.workflow_id))
    params = {"id": job.id, "attempt": job.attempt, "scope": scope, "name": name,
              "deadline": deadline, "now": now}
    need = budget.pause_need(name) if scope == names.job_scope(job.id) else None
    if need is not None:
        # A budget pause waits on the caps, not on a signal: it parks unless
        # a top-up already covers the spend (read under the row lock) beside
        # what the job's fan-outs hold (its steps' holds end with this run).
        found = _rows(conn, "budget_of_for_update", (job.id,))
        if found and not budget.exceeded(
                budget.with_held(found[0], run(conn, holds.shares_held(job.id))), need):
            parked = "ready" if _execute(conn, "park_ready", params) else None
        else:
            parked = "awaiting" if _execute(conn, "park_await", params) else None
    else:
        lock(conn, names.signal_lock(scope))
        if _value(conn, "signal_exists", (scope, name)) is not None:
            parked = "ready" if _execute(conn, "park_ready", params) else None
        else:
            parked = "awaiting" if _execute(conn, "park_await", params) else None
    return parked if parked is not None else cancel_flagged(conn, job, now)


def cancel_flagged(conn: Conn, job: Job, now: datetime) -> Acked | None:
    """§8.6: end the claimed attempt of ``job`` cancelled if an operator asked
    to cancel it, with §7's after-terminal effects; None when no cancel was
    asked (or the attempt is stale). The caller holds the workflow lock of a
    member. Atomic: run inside a transaction."""
    found = _rows(conn, "cancel_flagged", {"id": job.id, "attempt": job.attempt, "now": now})
    if not found:
        return None
    cancelled = Job.from_row(found[0])
    return Acked(cancelled, after_terminal(conn, cancelled, now))


def top_up(conn: Conn, job_id: int, usd_micros: int, tokens: int, now: datetime,
           key: str | None = None) -> tuple[Job, bool]:
    """Raise a job's caps by ``usd_micros`` and ``tokens``; a job paused awaiting
    a top-up whose spend they now cover becomes ready (then the second value
    is True, and the caller pokes its queue). Refused (ValidationError) for a
    finished job and for a cap the job doesn't have. Run in a transaction.

    With ``key`` (checked by :func:`budget.check_top_up_key`) the top-up is
    recorded once, in this transaction (:func:`budget.top_up_mark`): sent
    again it changes nothing and returns the job as it stands with
    ``duplicate`` True and whether the first one resumed it (there is no
    queue to poke then), or raises IdempotencyConflict for other amounts —
    before the finished-job check, so a retry after the job ended still
    answers as the first top-up did."""
    job = get_job(conn, job_id, for_update=True)
    if job is None:
        raise JobNotFound(job_id)
    if key is not None:
        # Read under the row lock, which a concurrent top-up with this key held
        # until it committed: it waits for that one, then finds its mark.
        replay = _top_up_replay(conn, job, key, usd_micros, tokens)
        if replay is not None:
            return replay
    if job.terminal:
        raise ValidationError(budget.top_up_refusal(job))
    usd = budget.raised(job.budget_usd_micros, usd_micros, "USD", job_id)
    more = budget.raised(job.budget_tokens, tokens, "token", job_id)
    granted = authority_of(job.meta)
    if granted is not None:  # a top-up never lifts a cap past the job's authority
        granted.check_budget(usd if usd_micros else None, more if tokens else None,
                             f"job {job_id}", required=False)
    need = budget.pause_need(job.await_name) if job.state == "awaiting" else None
    wake = need is not None and not budget.exceeded(budget.with_held({
        "budget_usd_micros": usd, "spent_usd_micros": job.spent_usd_micros,
        "budget_tokens": more, "spent_tokens": job.spent_tokens},
        run(conn, holds.shares_held(job_id))), need)
    if key is not None:
        record = dumps(budget.top_up_record(key, usd_micros, tokens, wake)).decode()
        if not budget_mark(conn, job_id, budget.top_up_mark(key), record, now):
            # Not while every keyed top-up locks the row first; were the mark
            # written some other way, it still decides: no second raise.
            replay = _top_up_replay(conn, job, key, usd_micros, tokens)
            if replay is not None:
                return replay
    rows = _rows(conn, "top_up", {"id": job_id, "usd_micros": usd, "tokens": more,
                                  "wake": wake, "now": now})
    return Job.from_row(rows[0]), wake


def _top_up_replay(conn: Conn, job: Job, key: str, usd_micros: int, tokens: int
                   ) -> tuple[Job, bool] | None:
    """``job`` marked ``duplicate`` and whether the first top-up resumed it, when
    the top-up keyed ``key`` is already recorded (IdempotencyConflict for other
    amounts); None when it is not."""
    found, record = get_signal(conn, [names.job_scope(job.id)], budget.top_up_mark(key))
    if not found:
        return None
    resumed = budget.replayed_top_up(record, key, usd_micros, tokens, job.id)
    return replace(job, duplicate=True), resumed


def budget_of(conn: Conn, job_id: int) -> dict[str, Any] | None:
    """The four budget columns of a job (None: no such job)."""
    found = _rows(conn, "budget_of", (job_id,))
    return found[0] if found else None


def budget_mark(conn: Conn, job_id: int, name: str, payload_json: str, now: datetime) -> bool:
    """Write a budget warning's once-only mark; True for the one writer that
    inserted it."""
    return bool(_rows(conn, "budget_mark", {"scope": names.job_scope(job_id), "name": name,
                                            "payload": payload_json, "now": now}))


# -- Claim, leases, acks, reclaim (§6, §7) -----------------------------------------


def claim(
    conn: Conn, queue: str, take: int, node: str, now: datetime, lease_until: datetime,
    kinds: Sequence[str] | None = None,
) -> list[Job]:
    """§6 plain claim: up to ``take`` ready or due-awaiting jobs (of ``kinds``
    only, when given), now leased to ``node``."""
    jobs = _jobs(conn, "claim", {
        "queue": queue, "take": take, "node": node, "now": now, "lease_until": lease_until,
        "kinds": None if kinds is None else list(kinds),
    })
    jobs.sort(key=lambda j: (j.priority, j.ready_at is not None, j.ready_at or now, j.id))
    return jobs


def claim_queues(
    conn: Conn, takes: Mapping[str, int], node: str, now: datetime, lease_until: datetime,
    kinds: Sequence[str] | None = None,
) -> list[Job]:
    """:func:`claim` for several plain queues in one statement: up to
    ``takes[queue]`` jobs of each, in claim order within each queue."""
    if not takes:
        return []
    if len(takes) == 1:
        ((queue, take),) = takes.items()
        return claim(conn, queue, take, node, now, lease_until, kinds)
    jobs = _jobs(conn, "claim_queues", {
        "queues": list(takes), "takes": list(takes.values()), "node": node, "now": now,
        "lease_until": lease_until, "kinds": None if kinds is None else list(kinds),
    })
    jobs.sort(key=lambda j: (j.priority, j.ready_at is not None, j.ready_at or now, j.id))
    return jobs


def lock_for_claim(conn: Conn, spec: QueueSpec) -> None:
    """Take the locks an admitted claim of ``spec`` runs under (transaction-scoped):
    the queue's, then its shared rate resource's (always in that order, as
    several queues draw on one resource). Read "now" after this: a claimer that
    read the clock, then waited here while another claimed in the next rate
    window, would count against the window before and could overshoot."""
    lock(conn, names.queue_lock(spec.name))
    if spec.rate is not None and spec.rate.resource is not None:
        lock(conn, names.rate_lock(spec.rate.bucket(spec.name)))


def claim_admitted(
    conn: Conn, spec: QueueSpec, demand: int, node: str, now: datetime, lease_until: datetime,
    kinds: Sequence[str] | None = None, *, locked: bool = False,
) -> list[Job]:
    """§6 claim through admission: global limit, rate window, partitions.

    Atomic: run inside a transaction. The queue's advisory lock serializes every
    claimer of the queue, so the counts read here can't be raced by another
    claimer (:func:`lock_for_claim`; ``locked`` when the caller took it, to read
    ``now`` after it).
    """
    if not locked:
        lock_for_claim(conn, spec)
    take = demand
    if spec.global_limit is not None and spec.partition is None:
        running = int(_value(conn, "live_running_count", {"queue": spec.name, "now": now}))
        take = min(take, max(spec.global_limit - running, 0))
    epoch = int(now.timestamp())
    rate = spec.rate
    if rate is not None and take > 0:
        bucket = rate.bucket(spec.name)
        window = names.window_start(epoch, rate.period)
        counts = {r["window_start"]: r["count"] for r in _rows(
            conn, "rate_windows", {"bucket": bucket, "windows": [window - rate.period, window]}
        )}
        allowance = rate_allowance(counts.get(window - rate.period, 0), counts.get(window, 0),
                                   rate.allowed, rate.period, epoch)
        take = rate_admits(take, allowance, rate.estimate)
    if take <= 0:
        return []
    params = {"queue": spec.name, "take": take, "node": node, "now": now,
              "lease_until": lease_until, "kinds": None if kinds is None else list(kinds)}
    if spec.partition is None:
        jobs = _jobs(conn, "claim", params)
    else:
        ids = partitioned_picks(conn, spec, params, take)
        jobs = _jobs(conn, "claim_ids", {**params, "ids": ids}) if ids else []
    if rate is not None and jobs:
        rate_add(conn, rate.bucket(spec.name), names.window_start(epoch, rate.period),
                 len(jobs) * rate.estimate)
    jobs.sort(key=lambda j: (j.priority, j.ready_at is not None, j.ready_at or now, j.id))
    return jobs


#: Claimable jobs a partitioned claim ranks first, in claim order, before it
#: ranks the whole queue: at least this many, and four times the take.
PARTITION_WINDOW = 256


def partitioned_picks(
    conn: Conn, spec: QueueSpec, params: dict[str, Any], take: int, *, window: int = 0,
) -> list[int]:
    """§6 partitioned candidates, exact: the ids of the first ``take`` claimable
    jobs in claim order whose key still has room, each key capped at its
    ``per_key_limit`` minus its live-running jobs.

    A prefix of claim order (``window`` jobs) usually settles it, read along
    the claim's indexes; only when keys at their cap fill the whole prefix
    (one tenant's backlog ahead of the others') is the whole queue ranked.
    """
    assert spec.partition is not None
    source, key = spec.partition
    ids: list[int] = _value(conn, "claim_partitioned_ids", {
        **params, "source": source, "key": key, "per_key": spec.per_key_limit, "take": take,
        "window": window or max(PARTITION_WINDOW, 4 * take)})
    return ids


def queues_with_work(conn: Conn, queues: Sequence[str], now: datetime) -> set[str]:
    """§9.1: which of these queues hold a job a claim would take now (unlocked)."""
    if not queues:
        return set()
    return {r["queue"] for r in _rows(conn, "queues_with_work",
                                      {"queues": list(queues), "now": now})}


def renew_leases(
    conn: Conn, keys: Sequence[tuple[int, int]], node: str, until: datetime
) -> dict[tuple[int, int], bool]:
    """§6: renew every local lease in one statement; returns the (id, attempt)
    pairs still held, each with its ``cancel_requested`` — any other is lost."""
    if not keys:
        return {}
    held = _rows(conn, "renew_leases", {"ids": [k[0] for k in keys], "node": node, "until": until})
    return {(r["id"], r["attempt"]): bool(r["cancel_requested"]) for r in held}


@dataclass(frozen=True)
class Acked:
    """A fenced ack that took effect: the new row and what it set in motion."""

    job: Job
    settled: Settled


_ACKS = {
    "succeeded": "ack_succeeded",
    "retry": "ack_retry",
    "failed": "ack_failed",
    "cancelled": "ack_cancelled",
    "snooze": "ack_snooze",
}


def ack(
    conn: Conn,
    job: Job,
    kind: str,
    now: datetime,
    *,
    result: bytes | None = None,
    error: Any = None,
    at: datetime | None = None,
) -> Acked | None:
    """§7: apply an outcome to the claimed attempt ``job.attempt``; None when stale.

    Atomic: run inside a transaction. A workflow member takes the workflow lock
    before its row (the lock order of :func:`lock_job`).
    """
    if job.workflow_id is not None:
        lock(conn, names.workflow_lock(job.workflow_id))
    found = _rows(conn, _ACKS[kind], {
        "id": job.id, "attempt": job.attempt, "now": now, "result": result, "at": at,
        "error": None if error is None else dumps(error).decode(),
    })
    if not found:
        if kind == "succeeded" and budget.capped(_caps(job)):
            return _over_budget(conn, job, now)
        return None
    updated = Job.from_row(found[0])
    if updated.terminal:
        return Acked(updated, after_terminal(conn, updated, now))
    return Acked(updated, Settled([], []))


def _caps(job: Job) -> dict[str, Any]:
    return {"budget_usd_micros": job.budget_usd_micros, "budget_tokens": job.budget_tokens}


def _over_budget(conn: Conn, job: Job, now: datetime) -> Acked | None:
    """A success the fence refused although the attempt is current: the job's
    spend is over a cap (ack_succeeded). It ends as the step that crossed it
    would have ended it — failed with ``budget_exceeded``, or parked for a
    top-up under ``on_exceed="pause"``; None when the ack was stale after all."""
    found = _rows(conn, "lock_budget", {"id": job.id, "attempt": job.attempt})
    if not found or not found[0]["holds_job"] or not budget.exceeded(found[0]):
        return None
    spend = found[0]
    if budget.policy_of(job.meta).pauses:
        parked = park_await(conn, job, names.job_scope(job.id), names.TOP_UP, None, now)
        if parked is None or isinstance(parked, Acked):
            return parked
        current = get_job(conn, job.id)
        return None if current is None else Acked(current, Settled([], []))
    error = {"error": "budget_exceeded", "step": None, "attempt": job.attempt, "at_ack": True,
             **{key: spend[key] for key in ("spent_usd_micros", "budget_usd_micros",
                                            "spent_tokens", "budget_tokens")}}
    return ack(conn, job, "failed", now, error=error)


def batchable(job: Job) -> bool:
    """A job whose success may be acked in a batch: its terminal write settles
    nothing (no workflow, no parent), so the batch equals single acks."""
    return job.workflow_id is None and job.parent_id is None


def ack_succeeded_many(
    conn: Conn, acks: Sequence[tuple[Job, bytes | None]], now: datetime,
    channel: str | None = None,
) -> set[int]:
    """§7 "succeeded" for many :func:`batchable` jobs in one statement (atomic on
    its own), each fenced on its claimed attempt; returns the ids that took
    effect — any other was stale. With ``channel``, the same statement
    announces each result there (§9.2)."""
    if not acks:
        return set()
    results = [result for _, result in acks]
    found = _rows(conn, "ack_succeeded_many", {
        "ids": _int_array(job.id for job, _ in acks),
        "attempts": _int_array(job.attempt for job, _ in acks),
        "results": results if any(r is not None for r in results) else None,
        "now": now,
        "channel": channel,
    })
    return {r["id"] for r in found}


def ack_succeeded_settling(
    conn: Conn, acks: Sequence[tuple[Job, bytes | None]], now: datetime,
    channel: str | None = None,
) -> tuple[set[int], Settled]:
    """:func:`ack_succeeded_many` for any successes, workflow members and
    children included, with §7's after-terminal effects for the batch: each
    workflow settled once, each parent sent ``$children`` once (as many single
    acks would leave them). Atomic: run inside a transaction. Lock order as
    everywhere: workflow locks (sorted), job rows (id order), signal scopes
    (sorted)."""
    lock_all(conn, [names.workflow_lock(job.workflow_id) for job, _ in acks
                    if job.workflow_id is not None])
    acked = ack_succeeded_many(conn, acks, now, channel)
    done = [job for job, _ in acks if job.id in acked]
    released, doomed = settle_workflows(
        conn, sorted({job.workflow_id for job in done if job.workflow_id is not None}), now)
    parents = {job.parent_id for job in done} | {r["parent_id"] for r in doomed}
    ready = [(r["id"], r["queue"]) for r in released]
    ready += deliver_signals(conn, [names.job_scope(p) for p in parents if p is not None],
                             names.CHILDREN, "{}", now)
    return acked, Settled(ready=ready, cancelled=[r["id"] for r in doomed])


def _int_array(values: Iterable[int]) -> str:
    """An integer array's literal (``{1,2,3}``): one join, where a list
    parameter is dumped element by element in Python."""
    return "{" + ",".join(map(str, values)) + "}"


def expired_leases(conn: Conn, now: datetime, limit: int) -> list[int]:
    """§6 reclaim candidates (unlocked; each is re-checked by :func:`reclaim_one`)."""
    return [r["id"] for r in _rows(conn, "expired_leases", (now, limit))]


def reclaim_one(
    conn: Conn, job_id: int, now: datetime, backoff: Callable[[Job], float]
) -> Acked | None:
    """Retry or fail one job whose lease expired, with §7 after-terminal effects.

    Atomic: run inside a transaction. None when it was not (or no longer) expired.
    """
    job = get_job(conn, job_id)
    if job is None:
        return None
    if job.workflow_id is not None:
        lock(conn, names.workflow_lock(job.workflow_id))
    found = _rows(conn, "lock_expired", (job_id, now))
    if not found:
        return None
    job = Job.from_row(found[0])
    error = {"error": "lease_expired", "at": now.isoformat(), "attempt": job.attempt}
    if job.attempt >= job.max_attempts:
        return ack(conn, job, "failed", now, error=error)
    return ack(conn, job, "retry", now, error=error,
               at=now + timedelta(seconds=max(0.0, backoff(job))))


# -- Steps (§8.2) ------------------------------------------------------------------


def get_step(conn: Conn, job_id: int, name: str) -> tuple[bool, bytes | None]:
    """A journaled step's envelope: ``(True, value)`` on a hit, ``(False, None)`` on a miss."""
    found = _rows(conn, "get_step", (job_id, name))
    if not found:
        return False, None
    value = found[0]["value"]
    return True, None if value is None else bytes(value)


def step_lookup(conn: Conn, job_id: int, name: str) -> dict[str, Any] | None:
    """A step's journal entry (``hit``, ``value``) with the job's spend, caps and
    ``cancel_requested``; None when the job row is gone."""
    found = _rows(conn, "step_lookup", {"job_id": job_id, "name": name})
    return found[0] if found else None


def put_step(
    conn: Conn, job_id: int, name: str, value: bytes, usd_micros: int, tokens: int,
    now: datetime, holds: Sequence[str] = (),
) -> dict[str, Any] | None:
    """Journal a step and add its cost, atomically, dropping the ``holds`` it
    settles (:mod:`belay.holds`); returns the job's spend and caps and whether
    this call journaled it (False: another run got there first)."""
    found = _rows(conn, "put_step", {
        "job_id": job_id, "name": name, "value": value, "usd_micros": usd_micros,
        "tokens": tokens, "now": now, "scope": names.job_scope(job_id),
        "holds": list(holds) if holds else None,
    })
    return found[0] if found else None


def children(conn: Conn, parent_id: int) -> list[Job]:
    return [Job.from_row(r) for r in _rows(conn, "children", (parent_id,))]


def resettle_parents(conn: Conn, now: datetime) -> list[tuple[int, str]]:
    """§8.4 backstop (R2): wake parents whose children are all terminal."""
    return [(r["id"], r["queue"]) for r in _rows(conn, "resettle_parents", {"now": now})]


def rate_add(conn: Conn, bucket: str, window_start: int, amount: int) -> None:
    _execute(conn, "rate_add", (bucket, window_start, amount))


# -- Dynamic queues (§8.6) ------------------------------------------------------------


def list_queues(conn: Conn) -> dict[str, Any]:
    """Every ``belay_queues`` row: name → its JSON options."""
    return {r["name"]: r["opts"] for r in _rows(conn, "list_queues")}


def put_queue(conn: Conn, name: str, opts: dict[str, Any], now: datetime) -> None:
    _execute(conn, "put_queue", {"name": name, "opts": dumps(opts).decode(), "now": now})


def queue_paused(conn: Conn, name: str) -> bool:
    return bool(_value(conn, "queue_paused", (name,)))


def delete_queue(conn: Conn, name: str) -> bool:
    return _execute(conn, "delete_queue", (name,)) > 0


def pause_queue(conn: Conn, name: str, now: datetime) -> None:
    _execute(conn, "pause_queue", {"name": name, "now": now})


def resume_queue(conn: Conn, name: str, now: datetime) -> bool:
    """Clear the pause; False when there was no row. Atomic: run in a transaction."""
    left = _rows(conn, "resume_queue", {"name": name, "now": now})
    if not left:
        return False
    if not left[0]["opts"]:
        _execute(conn, "delete_empty_queue", (name,))
    return True


# -- Retention (§8.7) ------------------------------------------------------------------


def prune_jobs(
    conn: Conn, state: str, cutoffs: dict[str, datetime | None], limit: int
) -> int:
    """Delete one batch of ``state`` jobs finished before ``cutoffs[state]``, with
    their steps and events; returns how many jobs went. ``cutoffs`` holds every
    terminal state's (None: kept forever), for the workflow and parent checks."""
    return int(_value(conn, "prune_jobs", {
        "state": state, "cutoff": cutoffs[state], "limit": limit,
        "succeeded": cutoffs.get("succeeded"), "failed": cutoffs.get("failed"),
        "cancelled": cutoffs.get("cancelled"),
    }))


def prune_signals(conn: Conn, cutoff: datetime) -> int:
    return _execute(conn, "prune_signals", (cutoff,))


def prune_rate(conn: Conn, before_window: int) -> int:
    return _execute(conn, "prune_rate", (before_window,))


def append_event(conn: Conn, job_id: int, payload_json: str, now: datetime) -> int:
    """Append to a job's event stream; returns the new entry's seq. Appends
    racing for one job each get a seq of their own (the statement says how)."""
    params = {"job_id": job_id, "payload": payload_json, "now": now}
    for _ in range(APPEND_TRIES):
        seq = _value(conn, "append_event", params)
        if seq is not None:
            return int(seq)
    # Only a snapshot that never moves (a caller's REPEATABLE READ transaction)
    # keeps picking a number already taken.
    raise ConfigurationError(
        f"appending an event to job {job_id} found its next number taken {APPEND_TRIES} times: "
        "append events on a connection in READ COMMITTED (PostgreSQL's default)")


#: How many times an event append picks the job's next number before giving up.
APPEND_TRIES = 100


# -- Workflows (§8.3) ----------------------------------------------------------------


def lock_workflow(conn: Conn, workflow_id: str) -> list[Job]:
    """Take the workflow lock and return the members already there (:mod:`belay.plans`)."""
    return run(conn, plans.lock_workflow(workflow_id))


# -- Cron (§8.5) -------------------------------------------------------------------


def put_cron(conn: Conn, values: dict[str, Any], now: datetime) -> dict[str, Any]:
    """Create or replace a ``belay_crons`` row (``paused`` kept); returns the stored row.

    ``values``: name, expression, worker, and input and opts as JSON text."""
    return _rows(conn, "put_cron", {**values, "now": now})[0]


def delete_cron(conn: Conn, name: str) -> bool:
    return _execute(conn, "delete_cron", (name,)) > 0


def set_cron_paused(conn: Conn, name: str, paused: bool, now: datetime) -> bool:
    return _execute(conn, "set_cron_paused", {"name": name, "paused": paused, "now": now}) > 0


def list_crons(conn: Conn) -> list[dict[str, Any]]:
    """Every ``belay_crons`` row by name: name, expression, worker, input, opts, paused,
    updated_at."""
    return _rows(conn, "list_crons")


# -- Schedules (belay_schedules, revision 5) ------------------------------------------


def declare_schedule(conn: Conn, values: dict[str, Any]) -> bool:
    """Create or redeclare a schedule; True when anything changed."""
    return bool(_rows(conn, "declare_schedule", values))


def cancel_schedule(conn: Conn, name: str, now: datetime) -> bool:
    """Cancel a live schedule; False when there is none (or it was cancelled)."""
    return bool(_rows(conn, "cancel_schedule", {"name": name, "now": now}))


def schedule_cancelled(conn: Conn, name: str) -> bool | None:
    """Whether the schedule ``name`` is cancelled; None when there is none."""
    found = _rows(conn, "schedule_exists", (name,))
    return None if not found else bool(found[0]["cancelled"])


def cron_named(conn: Conn, name: str) -> bool:
    return bool(_rows(conn, "cron_named", (name,)))


def get_schedule(conn: Conn, name: str) -> dict[str, Any] | None:
    found = _rows(conn, "get_schedule", (name,))
    return found[0] if found else None


def schedule_page(conn: Conn, after: str | None, limit: int) -> list[dict[str, Any]]:
    """Schedules by name after ``after`` (exclusive), up to ``limit``."""
    return _rows(conn, "schedule_page", {"after": after, "limit": limit})


def due_schedules(conn: Conn) -> list[dict[str, Any]]:
    """Every live schedule no other node's round holds, locked (run in a transaction)."""
    return _rows(conn, "due_schedules")


def advance_schedule(conn: Conn, name: str, cursor: datetime, job_id: int | None) -> None:
    _execute(conn, "advance_schedule", {"name": name, "cursor": cursor, "job_id": job_id})
