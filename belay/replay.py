"""Replay debugging: run a job's worker code again against its recorded step
journal, with no side effects, and report where the code departs from the record.

:func:`dry_run` reads the job and its journal (and, when the code asks, its
signals and children) in one read-only snapshot, then calls the job's worker
function with a :class:`ReplayContext`: a journaled step returns its recorded
value without running, ``emit`` and ``debit`` are recorded but inert, and
anything the record does not hold stops the run as "blocked". Nothing is
written, no attempt is used, no lease is touched, so it is safe against a job
in any state, running ones included. Code outside steps runs for real, as it
does on every attempt of the job; every session reachable through ``ctx`` logs
in as a role with no write privilege (:func:`_reader`), so the server refuses
its writes even once the code leaves the read-only transaction.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar, cast

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus

from belay import names, schema, store
from belay.ambient import entered
from belay.codec import decode_value, dumps_object, encode_value
from belay.context import TIMEOUT, Context, Execution, Journal, check_debit
from belay.crypto import DecryptionError, decrypt_input, is_encrypted
from belay.enqueue import JobSpec
from belay.errors import ConfigurationError, JobNotFound, ValidationError
from belay.job import Job, Step
from belay.ops import jsonable
from belay.outcome import describe, error_entry, type_name
from belay.sql import QUERIES

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.registry import Registry, WorkerDef

log = logging.getLogger("belay.replay")

T = TypeVar("T")
_PACKAGE: Final = Path(__file__).resolve().parent
Conn = psycopg.Connection[Any]

#: What ``ctx.client`` still does during a replay: reads, on the replay's snapshot.
CLIENT_READS: Final = frozenset({
    "get_job", "list_jobs", "steps", "events", "workflow_status", "stats", "list_queues",
    "list_crons",
})
_CLIENT_ATTRIBUTES: Final = frozenset({"conninfo", "clock", "registry", "encryption_key", "notify"})


class ReplayBlocked(BaseException):
    """The code asked for something the record does not hold: the replay stops here.

    A ``BaseException``, so a job's own ``except Exception:`` can't swallow it.
    """

    def __init__(self, reason: Mapping[str, Any]) -> None:
        super().__init__(f"replay blocked: {dict(reason)}")
        self.reason = dict(reason)


@dataclass(frozen=True)
class Ask:
    """One thing the code asked its context for, in the order it asked.

    ``status``: ``served`` (from the record), ``missing`` (not in the record:
    the replay stopped), ``timeout`` (a recorded signal deadline), ``read``
    (steering), ``inert`` (emit, debit: not performed), ``refused`` (a client
    call replay does not make).
    """

    op: str
    name: str | None
    status: str
    seq: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self, position: int) -> dict[str, Any]:
        return {"position": position, "op": self.op, "name": self.name, "status": self.status,
                "seq": self.seq, **{k: jsonable(v) for k, v in self.detail.items()}}


@dataclass(frozen=True)
class ReplayReport:
    """What a replay found. ``outcome`` is ``ok``, ``blocked`` or ``raised``."""

    job: Job
    outcome: str
    trace: list[Ask]
    journal: list[Step]
    value: Any = None
    matches_recorded_result: bool | None = None
    reason: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    #: Journal entries the code never asked for (the run reached its end).
    unused: list[Step] = field(default_factory=list)
    #: Journal entries after the point where a blocked run stopped.
    not_reached: list[Step] = field(default_factory=list)
    #: (1-based trace position, ask) of entries asked in another order than journaled.
    out_of_order: list[tuple[int, Ask]] = field(default_factory=list)
    spend: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        """True when the code did not retrace the record exactly."""
        return (self.outcome != "ok" or bool(self.unused) or bool(self.out_of_order)
                or self.matches_recorded_result is False)

    def to_dict(self) -> dict[str, Any]:
        job = self.job
        return {
            "job": {"id": job.id, "kind": job.kind, "queue": job.queue, "state": job.state,
                    "attempt": job.attempt, "max_attempts": job.max_attempts},
            "outcome": self.outcome,
            "diverged": self.diverged,
            "value": jsonable(self.value),
            "matches_recorded_result": self.matches_recorded_result,
            "recorded_result": jsonable(job.result) if job.state == "succeeded" else None,
            "reason": jsonable(self.reason),
            "error": jsonable(self.error),
            "trace": [ask.to_dict(n) for n, ask in enumerate(self.trace, 1)],
            "unused": [_entry(s) for s in self.unused],
            "not_reached": [_entry(s) for s in self.not_reached],
            "out_of_order": [{"position": n, "name": ask.name, "seq": ask.seq}
                             for n, ask in self.out_of_order],
            "journal_entries": len(self.journal),
            "spend": jsonable(self.spend),
        }


def _entry(step: Step) -> dict[str, Any]:
    return {"seq": step.seq, "name": step.name}


# -- The snapshot and the read-only client ------------------------------------------------


class _Snapshot:
    """One read-only REPEATABLE READ transaction, rolled back at the end: every
    read of the replay sees the same moment, and the server refuses any write."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.lock = threading.RLock()

    @contextmanager
    def reading(self) -> Iterator[Conn]:
        with self.lock:
            yield self.conn

    @contextmanager
    def savepoint(self) -> Iterator[Conn]:
        """For the code's own reads: a failed statement undoes only itself."""
        with self.lock, self.conn.transaction():
            yield self.conn


@contextmanager
def _snapshot(conninfo: str) -> Iterator[_Snapshot]:
    with psycopg.connect(conninfo, autocommit=True, application_name="belay-replay") as conn:
        refuse_writers(conn)
        # Even a transaction the code might start on its own is read-only.
        conn.execute(QUERIES["replay_read_only"])
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        try:
            with conn.transaction(force_rollback=True):
                yield _Snapshot(conn)
        except psycopg.Error:
            # The code ended the snapshot's transaction itself (COMMIT …): the
            # rollback finds none. Its writes were refused all the same.
            if conn.info.transaction_status == TransactionStatus.UNKNOWN:
                raise


# -- A session that can't write -----------------------------------------------------------

#: How long a replay's own role may log in, should the replay die before dropping it.
ROLE_LIFETIME = timedelta(hours=1)


def write_access(conn: Conn) -> list[str]:
    """What the session's login role (or a role it may ``SET ROLE`` to) could
    change; empty when the server refuses every change to existing rows."""
    return [row[0] for row in conn.execute(QUERIES["replay_write_access"]).fetchall()]


def refuse_writers(conn: Conn) -> None:
    """Raise :class:`ConfigurationError` unless ``conn``'s session can't write."""
    access = write_access(conn)
    if access:
        raise ConfigurationError(
            f"belay replay needs a database role that can't write, and "
            f"{conn.info.user!r} can ({'; '.join(access)}). Replayed code runs for real "
            "and could leave a read-only transaction (COMMIT, RESET ROLE …); only the "
            "privileges of the role it logged in as hold. Replay with the URL of a role "
            "that may only read (CREATE ROLE belay_replay LOGIN PASSWORD '…'; GRANT "
            "pg_read_all_data TO belay_replay;), or with a role allowed to create roles "
            "(belay then makes a read-only one for the replay). See docs/operations.md, "
            "Replay debugging."
        )


@contextmanager
def _reader(conninfo: str) -> Iterator[str]:
    """A conninfo whose role can't write: ``conninfo`` itself when its role
    already can't, else a login role made for this replay (when the connecting
    role may create roles) and dropped after it; else :class:`ConfigurationError`."""
    with psycopg.connect(conninfo, autocommit=True, application_name="belay-replay") as admin:
        if not write_access(admin):
            yield conninfo
            return
        row = admin.execute(QUERIES["replay_may_create_role"]).fetchone()
        if not (row and row[0]):
            refuse_writers(admin)
        role = f"belay_replay_{secrets.token_hex(6)}"
        password = secrets.token_urlsafe(24)
        # The server's wall clock judges VALID UNTIL, not the client's (injected) one.
        until = (datetime.now(timezone.utc) + ROLE_LIFETIME).isoformat()
        names_ = {"role": sql.Identifier(role)}
        try:
            with admin.transaction():
                row = admin.execute(QUERIES["replay_role_create"], {
                    "role": role, "password": password, "until": until}).fetchone()
                assert row is not None
                admin.execute(str(row[0]).encode())  # quoted by the server's format()
                try:
                    with admin.transaction():
                        admin.execute(sql.SQL(QUERIES["replay_role_read_all"]).format(**names_))
                except psycopg.Error:  # before 14, or not ours to grant: belay's schema only
                    found = admin.execute(QUERIES["replay_belay_schema"]).fetchone()
                    schema_name = sql.Identifier(found[0] if found else "public")
                    for name in ("replay_role_read_schema", "replay_role_read_tables"):
                        admin.execute(sql.SQL(QUERIES[name]).format(schema=schema_name, **names_))
            reader = make_conninfo(conninfo, user=role, password=password)
            try:
                psycopg.connect(reader, application_name="belay-replay").close()
            except psycopg.OperationalError as exc:
                raise ConfigurationError(
                    f"belay made the read-only role {role} for this replay but could not log "
                    f"in as it ({str(exc).strip()}): pg_hba.conf must let it log in with a "
                    "password, or replay with the URL of a role that may only read (see "
                    "docs/operations.md, Replay debugging)"
                ) from None
            yield reader
        finally:
            _drop_role(admin, role)


def _drop_role(admin: Conn, role: str) -> None:
    names_ = {"role": sql.Identifier(role)}
    try:
        with contextlib.suppress(psycopg.Error):
            admin.execute(QUERIES["replay_role_sessions_end"], {"role": role})
        with admin.transaction():
            admin.execute(sql.SQL(QUERIES["replay_role_revoke"]).format(**names_))
            admin.execute(sql.SQL(QUERIES["replay_role_drop"]).format(**names_))
    except psycopg.Error:
        log.warning("belay: could not drop the replay's role %s (it can't log in after %s); "
                    "drop it with DROP OWNED BY %s; DROP ROLE %s", role,
                    ROLE_LIFETIME, role, role, exc_info=True)


class ReadOnlyClient:
    """``ctx.client`` during a replay: the reads of :class:`~belay.Belay`
    (:data:`CLIENT_READS`) on the replay's snapshot; any other call stops the
    replay as blocked (``{"client_call": name}``), since replay never writes."""

    def __init__(self, client: Belay, snapshot: _Snapshot,
                 refuse: Callable[[str], NoReturn]) -> None:
        self._client = client
        self._snapshot = snapshot
        self._refuse = refuse

    def now(self) -> datetime:
        return self._client.now()

    @contextmanager
    def connection(self, conn: Any = None) -> Iterator[Conn]:
        """The replay's read-only connection (writes fail), inside a savepoint."""
        with self._snapshot.savepoint() as active:
            yield active

    transaction = connection

    def __getattr__(self, name: str) -> Any:
        if name in _CLIENT_ATTRIBUTES:
            return getattr(self._client, name)
        if name in CLIENT_READS:
            method = getattr(self._client, name)

            def read(*args: Any, **kwargs: Any) -> Any:
                with self._snapshot.savepoint() as conn:
                    kwargs.setdefault("conn", conn)
                    return method(*args, **kwargs)

            return read
        if name.startswith("_") or not callable(getattr(self._client, name, None)):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def refused(*args: Any, **kwargs: Any) -> NoReturn:
            self._refuse(name)

        return refused


# -- The context -------------------------------------------------------------------------


class _RecordedJournal(Journal):
    """A replay's journal: every step is answered from the record (a bad cost
    already failed in the caller, as it would in a real run); a step the
    record lacks stops the replay."""

    def __init__(self, ctx: ReplayContext) -> None:
        super().__init__(ctx)
        self._replay = ctx

    def lookup(self, name: str, need: tuple[int, int] = (0, 0)) -> tuple[bool, Any]:
        return True, self._replay._serve("step", name)

    def probe(self, name: str, need: tuple[int, int] = (0, 0)) -> tuple[bool, Any]:
        return self.lookup(name, need)  # nothing is held: nothing is spent


class ReplayContext(Context):
    """What the worker function receives during a replay: the API of
    :class:`~belay.Context`, answered from the record alone.

    ``step``, ``sleep`` and ``spawn``/``spawn_many`` return their journaled
    values without running anything; ``await_signal``, ``await_children`` and
    ``steering`` read the database, read-only; ``emit`` and ``debit`` are
    recorded in the trace and do nothing else (``emit`` returns a count, not a
    stored seq); ``checkpoint`` never interrupts; budgets are not enforced.
    """

    def __init__(self, job: Job, definition: WorkerDef, client: Belay, registry: Registry,
                 journal: Sequence[Step], snapshot: _Snapshot) -> None:
        self._snapshot = snapshot
        self._journal = {step.name: step for step in journal}
        self._trace: list[Ask] = []
        self._trace_lock = threading.Lock()
        self._emits = 0
        #: Why the replay stopped (the first block wins), once it did.
        self.blocked: dict[str, Any] | None = None
        facade = ReadOnlyClient(client, snapshot, self._refuse)
        super().__init__(Execution(job, definition, None), cast("Belay", facade), registry)
        self._real_client = client
        self.journal = _RecordedJournal(self)

    @property
    def trace(self) -> list[Ask]:
        with self._trace_lock:
            return list(self._trace)

    def _record(self, ask: Ask) -> None:
        with self._trace_lock:
            self._trace.append(ask)

    def _block(self, reason: dict[str, Any]) -> NoReturn:
        with self._trace_lock:
            if self.blocked is None:
                self.blocked = reason
        raise ReplayBlocked(reason)

    def _stopped(self) -> None:
        """The replay already stopped (the code swallowed it): stop again."""
        if self.blocked is not None:
            raise ReplayBlocked(self.blocked)

    def _refuse(self, call: str) -> NoReturn:
        self._stopped()
        self._record(Ask("client", call, "refused"))
        self._block({"client_call": call})

    def _now(self) -> datetime:
        return self._real_client.clock.now()

    def checkpoint(self) -> None:
        self._stopped()

    def _serve(self, op: str, entry: str, detail: Mapping[str, Any] | None = None) -> Any:
        self._stopped()
        found = self._journal.get(entry)
        if found is None:
            self._record(Ask(op, entry, "missing", None, dict(detail or {})))
            self._block({"missing_step": entry})
        self._record(Ask(op, entry, "served", found.seq, dict(detail or {})))
        return found.value


    def sleep(self, name: str, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValidationError(f"sleep takes seconds >= 0, got {seconds!r}")
        target = self._serve("sleep", f"$sleep:{name}")
        if not isinstance(target, str):
            return  # another SDK's $sleep value: never interpreted (§2)
        until = datetime.fromisoformat(target)
        if self._now() < until:
            self._block({"sleeping": name, "until": until.isoformat()})

    def emit(self, payload: Mapping[str, Any]) -> int:
        dumps_object(payload, what="an event payload")
        self._stopped()
        self._record(Ask("emit", None, "inert", detail={"payload": dict(payload)}))
        with self._trace_lock:
            self._emits += 1
            return self._emits

    def steering(self) -> Any:
        self._stopped()
        with self._snapshot.reading() as conn:
            found, payload = store.get_signal(conn, self._scopes(), names.STEER)
        self._record(Ask("steering", names.STEER, "read", detail={"found": found}))
        return payload if found else None

    def await_signal(self, name: str, timeout: float | None = None) -> Any:
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a signal name is a non-empty string, got {name!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
        ):
            raise ValidationError(f"timeout must be seconds >= 0 or None, got {timeout!r}")
        self._stopped()
        scopes = self._scopes()
        with self._snapshot.reading() as conn:
            found, payload = store.get_signal(conn, scopes, name)
        if found:
            self._record(Ask("await_signal", name, "served"))
            return payload
        job = self.job
        # The recorded run was claimed back at its deadline: it got TIMEOUT.
        if job.await_name == name and job.ready_at is not None and job.ready_at <= self._now():
            self._record(Ask("await_signal", name, "timeout"))
            return TIMEOUT
        self._record(Ask("await_signal", name, "missing", detail={"scopes": scopes}))
        self._block({"awaiting_signal": name})

    def debit(self, resource: str, units: int, *, period: int | None = None) -> None:
        check_debit(resource, units, period)
        self._stopped()
        self._record(Ask("debit", resource, "inert", detail={"units": units, "period": period}))

    def _spawn_many(self, name: str, kind: Any, inputs: Iterable[Mapping[str, Any]],
                    options: dict[str, Any], *, share: bool) -> list[int]:
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a spawn name is a non-empty string, got {name!r}")
        inputs = list(inputs)
        if isinstance(kind, str):
            kind = self.registry.get(kind) or kind
        budget = None if share else options.get("budget")
        for child_input in inputs:  # bad options fail as in a real run
            JobSpec(kind, child_input, **{**options, "budget": budget})
        ids = self._serve("spawn", f"$spawn:{name}", {"inputs": len(inputs)})
        if not isinstance(ids, list):
            raise ValidationError(f"step $spawn:{name} holds {ids!r}, not a list of job ids")
        return ids

    def await_children(self) -> list[Job]:
        self._stopped()
        with self._snapshot.reading() as conn:
            kids = store.children(conn, self.id)
        states = [{"id": kid.id, "state": kid.state} for kid in kids]
        if all(kid.terminal for kid in kids):
            self._record(Ask("await_children", names.CHILDREN, "served",
                             detail={"children": states}))
            return kids
        self._record(Ask("await_children", names.CHILDREN, "missing",
                         detail={"children": states}))
        self._block({"awaiting_children": [kid.id for kid in kids if not kid.terminal]})


# -- Running -----------------------------------------------------------------------------


def dry_run(client: Belay, job_id: int, *, registry: Registry | None = None) -> ReplayReport:
    """Replay job ``job_id``'s worker code against its recorded journal.

    ``registry`` (default: ``client.registry``, the one ``@belay.worker``
    fills and the worker uses) maps the job's kind to its code. Raises
    :class:`~belay.errors.JobNotFound` for an unknown id and
    :class:`~belay.errors.ConfigurationError` when no worker is registered
    for the kind or an encrypted input can't be decrypted. Writes nothing.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
        raise ValidationError(f"a job id is an integer >= 1, got {job_id!r}")
    registry = registry if registry is not None else client.registry
    with (_reader(_direct(client)) as conninfo, _reading_client(client, conninfo) as reader,
          _snapshot(conninfo) as snap):
        with snap.reading() as conn:
            schema.check(conn)
            job = store.get_job(conn, job_id)
            if job is None:
                raise JobNotFound(job_id)
            journal = store.list_steps(conn, job_id)
        definition = registry.get(job.kind)
        if definition is None:
            known = ", ".join(registry.kinds()) or "none"
            raise ConfigurationError(
                f"job {job_id} is of kind {job.kind!r}, and no worker for it is registered "
                f"here (registered: {known}): import the module that defines it first "
                "(belay replay --import MODULE; in Python, import it or pass registry=)"
            )
        job = _decrypted(job, client)
        # The code sees only the reading client: its conninfo, its pool and
        # the snapshot all log in as the role that can't write.
        ctx = ReplayContext(job, definition, reader, registry, journal, snap)
        returned, raised = _call(definition, ctx)
    return _report(job, journal, ctx, returned, raised)


def _direct(client: Belay) -> str:
    """A replay's session logs in as its own role and sets session settings:
    neither passes a transaction pooler, so it needs the server itself."""
    if client.direct_url is not None:
        return client.direct_url
    if client.pooler:
        raise ConfigurationError(
            "belay replay needs a direct connection to PostgreSQL (it logs in as a "
            "read-only role of its own and sets session settings, which a transaction "
            "pooler can't carry): give the server's own URL as direct_url "
            "(BELAY_DIRECT_URL, or --direct-url), or run it with a direct --url"
        )
    return client.conninfo


@contextmanager
def _reading_client(client: Belay, conninfo: str) -> Iterator[Belay]:
    """``client``'s clock, registry and key on ``conninfo`` (the role that can't write)."""
    from belay.client import Belay

    reader = Belay(conninfo, clock=client.clock, notify=False, min_pool_size=0,
                   max_pool_size=2, application_name="belay-replay",
                   registry=client.registry, encryption_key=client.encryption_key)
    try:
        yield reader
    finally:
        reader.close()


def _decrypted(job: Job, client: Belay) -> Job:
    if not is_encrypted(job.input):
        return job
    try:
        return job.replace(input=decrypt_input(job.input, client.encryption_key))
    except DecryptionError as exc:
        raise ConfigurationError(
            f"job {job.id}'s input is encrypted: {exc}; replay with the key the workers use, "
            "belay.Belay(url, encryption_key=…)"
        ) from None


def _call(definition: WorkerDef, ctx: ReplayContext) -> tuple[Any, BaseException | None]:
    """The function's return value, or what it raised (a chunk worker gets a
    chunk of one and its entry for this job is unwrapped)."""
    # current_context() is the replay's ctx, as it is the real one in a worker:
    # integrations that find the job through it replay from the journal too.
    try:
        with entered(ctx if definition.chunk is None else None, [ctx]):
            if definition.chunk is None:
                return definition(ctx), None
            returned = definition.fn([ctx])  # type: ignore[arg-type]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the job's failure, whatever it raised
        return None, exc
    if returned is None:
        return None, None
    if not isinstance(returned, Mapping):
        return None, ValidationError("a chunk worker returns None or a dict of job id → "
                                     f"result, got {type(returned).__name__}")
    if ctx.id not in returned:
        return None, ValidationError(f"the chunk worker returned no outcome for job {ctx.id}")
    mine = returned[ctx.id]
    return (None, mine) if isinstance(mine, BaseException) else (mine, None)


def _report(job: Job, journal: list[Step], ctx: ReplayContext, returned: Any,
            raised: BaseException | None) -> ReplayReport:
    trace = ctx.trace
    outcome, value, matches, error = "ok", None, None, None
    if ctx.blocked is not None:
        outcome = "blocked"
    elif raised is not None:
        outcome, error = "raised", _error(raised, job)
    else:
        value = returned
        try:
            stored = decode_value(encode_value(returned, what="the job's result"))
        except (ValidationError, RecursionError) as exc:
            outcome = "raised"
            error = {"type": type(exc).__name__, "message": f"bad result: {exc}",
                     "traceback": "", "recorded": None, "matches_recorded": None}
        else:
            if job.state == "succeeded":
                matches = stored == job.result
    unused, out_of_order = divergence(trace, journal)
    not_reached: list[Step] = []
    if outcome == "blocked":
        unused, not_reached = [], unused
    return ReplayReport(
        job=job, outcome=outcome, trace=trace, journal=journal, value=value,
        matches_recorded_result=matches, reason=ctx.blocked, error=error, unused=unused,
        not_reached=not_reached, out_of_order=out_of_order, spend=_spend(job, journal, trace),
    )


def _error(exc: BaseException, job: Job) -> dict[str, Any]:
    described = error_entry(exc, job.attempt)["error"]
    last = job.errors[-1] if job.errors else None
    recorded = last.get("error") if isinstance(last, Mapping) else None
    name = type_name(exc)
    # describe(): the code's exception may not survive str() (as in a worker).
    text = describe(exc)
    try:
        trace = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc)))
    except BaseException:  # user code (a loader's get_source …): the worker's fallback
        trace = error_entry(exc, job.attempt).get("traceback", "")
    return {
        "type": name,
        "message": "" if text == name else text.removeprefix(f"{name}: "),
        "traceback": trace,
        "recorded": recorded,
        "matches_recorded": None if not isinstance(recorded, str) else recorded == described,
    }


def _user_frames(exc: BaseException) -> TracebackType | None:
    """The traceback from the first frame outside belay (the replay's own call
    and the registry's wrapper say nothing about the code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and Path(
            tb.tb_frame.f_code.co_filename).resolve().parent == _PACKAGE:
        tb = tb.tb_next
    return tb


def divergence(trace: Sequence[Ask], journal: Sequence[Step]
               ) -> tuple[list[Step], list[tuple[int, Ask]]]:
    """Journal entries the trace never served, and the served asks (1-based
    position, ask) out of journal order: those outside the longest run of
    first asks whose seqs increase (the fewest moves that explain the order)."""
    served = {ask.seq for ask in trace if ask.seq is not None}
    unused = [step for step in journal if step.seq not in served]
    firsts: list[tuple[int, Ask]] = []
    seqs: list[int] = []
    seen: set[int] = set()
    for position, ask in enumerate(trace, 1):
        if ask.seq is not None and ask.seq not in seen:
            seen.add(ask.seq)
            seqs.append(ask.seq)
            firsts.append((position, ask))
    keep = _longest_increasing(seqs)
    return unused, [first for i, first in enumerate(firsts) if i not in keep]


def _longest_increasing(values: Sequence[int]) -> set[int]:
    """Indexes of one longest strictly increasing subsequence of ``values``."""
    tails: list[int] = []  # index of the smallest tail of each length
    previous: list[int | None] = [None] * len(values)
    for i, value in enumerate(values):
        low, high = 0, len(tails)
        while low < high:
            mid = (low + high) // 2
            if values[tails[mid]] < value:
                low = mid + 1
            else:
                high = mid
        previous[i] = tails[low - 1] if low else None
        if low == len(tails):
            tails.append(i)
        else:
            tails[low] = i
    kept: set[int] = set()
    index = tails[-1] if tails else None
    while index is not None:
        kept.add(index)
        index = previous[index]
    return kept


def _spend(job: Job, journal: Sequence[Step], trace: Sequence[Ask]) -> dict[str, Any]:
    """Costs served from the journal, the job's recorded spend and budget, and
    what the code debited (none of it enforced or written during a replay)."""
    by_seq = {step.seq: step for step in journal}
    served = [by_seq[seq] for seq in {ask.seq for ask in trace if ask.seq is not None}]
    debited: dict[str, int] = {}
    for ask in trace:
        if ask.op == "debit" and ask.name is not None:
            debited[ask.name] = debited.get(ask.name, 0) + int(ask.detail["units"])
    over = ((job.budget_usd_micros is not None and job.spent_usd_micros > job.budget_usd_micros)
            or (job.budget_tokens is not None and job.spent_tokens > job.budget_tokens))
    return {
        "served_usd": sum(s.usd_micros for s in served) / 1_000_000,
        "served_tokens": sum(s.tokens for s in served),
        "journal_usd": sum(s.usd_micros for s in journal) / 1_000_000,
        "journal_tokens": sum(s.tokens for s in journal),
        "recorded_spent_usd": job.spent_usd, "recorded_spent_tokens": job.spent_tokens,
        "budget_usd": job.budget_usd, "budget_tokens": job.budget_tokens,
        "over_budget": over, "debited": debited,
    }


# -- Text --------------------------------------------------------------------------------


_VERDICT: Final = {
    "ok": "ok: the code ran to its end on the journal alone",
    "blocked": "blocked: the code asked for something the recording never saw",
    "raised": "raised: the code raised during the replay",
}


def format_report(report: ReplayReport) -> str:
    """The report as text for a terminal."""
    job = report.job
    lines = [f"job {job.id} {job.kind} ({job.state}, attempt {job.attempt}/"
             f"{job.max_attempts}): {_VERDICT[report.outcome]}"]
    if report.outcome == "ok":
        lines.append(f"  returned: {_short(report.value)}")
        if report.matches_recorded_result is True:
            lines.append("  matches the recorded result")
        elif report.matches_recorded_result is False:
            lines.append(f"  DIFFERS from the recorded result: {_short(job.result)}")
    if report.reason is not None:
        lines.append(f"  {_describe_block(report.reason)}")
    if report.error is not None:
        error = report.error
        lines.append(f"  {error['type']}: {error['message']}")
        if error.get("recorded") is not None:
            same = "the same as" if error.get("matches_recorded") else "unlike"
            lines.append(f"  {same} the last recorded error: {error['recorded']}")
        if error.get("traceback"):
            lines += ["  " + line for line in error["traceback"].rstrip().splitlines()]
    lines.append(f"trace ({_count(len(report.trace), 'ask')}, "
                 f"{_count(len(report.journal), 'journal entry', 'journal entries')}):")
    if not report.trace:
        lines.append("  (nothing asked)")
    for position, ask in enumerate(report.trace, 1):
        lines.append(f"  {position:>3}. {_describe_ask(ask)}")
    if report.unused:
        lines.append("unused journal entries (the code never asked for them):")
        lines += [f"  seq {s.seq}  {s.name}" for s in report.unused]
    if report.not_reached:
        lines.append("journal entries after the point where the replay stopped:")
        lines += [f"  seq {s.seq}  {s.name}" for s in report.not_reached]
    if report.out_of_order:
        lines.append("asked out of journal order:")
        lines += [f"  {ask.name} (seq {ask.seq}) asked at position {position}"
                  for position, ask in report.out_of_order]
    spend = report.spend
    budget = ", ".join(part for part in (
        None if spend["budget_usd"] is None else f"${spend['budget_usd']:g}",
        None if spend["budget_tokens"] is None else f"{spend['budget_tokens']} tokens",
    ) if part) or "none"
    lines.append(f"spend: served ${spend['served_usd']:g} / {spend['served_tokens']} tokens "
                 f"from the journal; recorded ${spend['recorded_spent_usd']:g} / "
                 f"{spend['recorded_spent_tokens']} tokens; budget {budget}"
                 + (" (over budget)" if spend["over_budget"] else ""))
    if spend["debited"]:
        lines.append("debited (not written): " + ", ".join(
            f"{resource} {units}" for resource, units in sorted(spend["debited"].items())))
    return "\n".join(lines)


def _describe_block(reason: Mapping[str, Any]) -> str:
    if "missing_step" in reason:
        return (f"step {reason['missing_step']!r} is not in the journal: the recorded run "
                "never got here (its function was not called)")
    if "awaiting_signal" in reason:
        return (f"awaits signal {reason['awaiting_signal']!r}, which was never delivered "
                "(or was pruned)")
    if "awaiting_children" in reason:
        return f"awaits children that are not finished: {reason['awaiting_children']}"
    if "sleeping" in reason:
        return f"sleep {reason['sleeping']!r} lasts until {reason['until']}"
    if "client_call" in reason:
        return (f"the code called ctx.client.{reason['client_call']}, which a replay does "
                "not make (it writes or waits)")
    return f"stopped: {dict(reason)}"


def _describe_ask(ask: Ask) -> str:
    where = f"seq {ask.seq}" if ask.seq is not None else ""
    status = "MISSING" if ask.status == "missing" else ask.status
    text = f"{ask.op:<14} {ask.name or '':<24} {status:<8} {where}".rstrip()
    extra = {k: v for k, v in ask.detail.items() if k != "scopes"}
    if extra:
        text += "  " + _short(extra)
    return text


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _short(value: Any, limit: int = 200) -> str:
    text = repr(jsonable(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"

