"""What a running job sees (``ctx``), and the bookkeeping of one execution."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, TypeVar, Union, cast

from belay import budget, holds, names, otel, store
from belay.ambient import CURRENT
from belay.budget import BudgetNotice, Headroom
from belay.codec import decode_value, dumps_object, encode_value
from belay.enqueue import check_seconds, usd_to_micros
from belay.errors import BudgetExceeded as BudgetExceeded
from belay.errors import CancelRequested as CancelRequested
from belay.errors import ConfigurationError, ValidationError
from belay.errors import Interrupted as Interrupted
from belay.errors import NoProgress as NoProgress
from belay.errors import StepValueRefused as StepValueRefused
from belay.parts.execution import Execution as Execution
from belay.watchdog import Repeats, Watchdog, watchdog_of

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.job import Job
    from belay.queues import Rate
    from belay.registry import Registry

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: §2: the reference refuses step values over 1 MiB; so do we, before writing.
MAX_STEP_VALUE = 1024 * 1024

#: The step of a fan-in that charges its children's spend back (``map_children``).
SPEND_PREFIX = "$spend:"

log = logging.getLogger("belay.worker")


@dataclass(frozen=True)
class Cost:
    """What a step spent: dollars (stored as micro-dollars) and tokens."""

    usd: float = 0.0
    tokens: int = 0


#: What ``step``/``astep`` take as ``cost``: a cost, or a function of the step's value.
CostSpec: TypeAlias = Union[
    "Cost", Mapping[str, Any], Callable[[T], "Cost | Mapping[str, Any] | None"], None
]

def current_context() -> Context | None:
    """The ``ctx`` of the job this code runs in, or None outside a job.

    Set around a worker function's call (not a chunk worker's, whose jobs share a
    call); it follows into asyncio tasks, ``asyncio.to_thread``, and threads
    started with the job's context (:func:`belay.propagate`,
    :class:`belay.ThreadPoolExecutor`, ``contextvars.copy_context().run``).
    Integrations use it to find the job without ``ctx`` being passed down.
    """
    return cast("Context | None", CURRENT.get())


#: The Context whose ``astep`` body is running in this task (steps don't nest).
_ASYNC_STEP: ContextVar[Context | None] = ContextVar("belay_async_step", default=None)


def describe(exc: BaseException) -> str:
    """:func:`belay.outcome.describe` (imported late: ``belay.outcome`` imports this module)."""
    from belay.outcome import describe as describe_exception

    return describe_exception(exc)


def _check_step_name(name: object) -> None:
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValidationError(f"a step name is a non-empty string without NUL, got {name!r}")
    names.check_text(name, "a step name", max_bytes=names.MAX_KEY_BYTES, empty=True)
    if name.startswith(names.RESERVED_PREFIX):
        raise ValidationError(f"step names starting with '$' are reserved for belay: {name!r}")


class Park(BaseException):
    """The job waits for a signal (§7): the worker parks it and its thread is free."""

    def __init__(self, scope: str, name: str, deadline: datetime | None) -> None:
        super().__init__(f"awaiting {name!r} in {scope}")
        self.scope = scope
        self.name = name
        self.deadline = deadline


class BudgetPause(Park):
    """The job went over its budget with ``on_exceed="pause"``: it parks
    awaiting a top-up (``belay.top_up``), no thread and no lease held, and
    runs again from its journal once the caps cover its spend."""

    def __init__(self, job_id: int, step: str, need: tuple[int, int] = (0, 0)) -> None:
        super().__init__(names.job_scope(job_id), budget.pause_name(need), None)
        self.step = step
        #: The headroom (micro-dollars, tokens) the step's ``max_cost`` asks for.
        self.need = need

    def __str__(self) -> str:
        return (f"job paused over its budget at step {self.step!r}: belay.top_up(job_id, "
                "usd=…, tokens=…) resumes it")


class Sleep(BaseException):
    """A durable sleep that is not over: the job snoozes until ``until``."""

    def __init__(self, until: datetime) -> None:
        super().__init__(f"sleeping until {until.isoformat()}")
        self.until = until


class _Timeout:
    """``ctx.await_signal`` returns this when the deadline passed without a signal."""

    _instance: _Timeout | None = None

    def __new__(cls) -> _Timeout:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "belay.TIMEOUT"

    def __bool__(self) -> bool:
        return False


TIMEOUT = _Timeout()


#: Guards the lazy creation of a context's per-thread state.
_LOCAL_LOCK = threading.Lock()


class Context:
    """Passed to a worker function: the job, and the run's link to belay."""

    def __init__(
        self, execution: Execution, client: Belay, registry: Registry | None = None,
        *, notify: bool = False, rate: Rate | None = None,
        on_budget: Callable[[BudgetNotice], None] | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self._execution = execution
        #: The no-progress watchdog guarding this run: the job's own, else the worker's.
        self._watchdog = watchdog_of(execution.job.meta, watchdog)
        if self._watchdog is not None:
            execution.watch_stall(self._watchdog)
        #: Where budget warnings and pauses are reported (the worker's hooks).
        self._on_budget = on_budget
        self.client = client
        self._notify = notify
        #: The rate admission of the job's queue, if any (for ``debit``'s true-up).
        self._rate = rate
        #: Where child kinds named by string find their worker's defaults.
        self.registry = registry if registry is not None else client.registry
        # Per thread: a job may run steps from several threads at once, but a
        # step's function may not start another step.
        self._local: threading.local | None = None  # made by the first step
        #: The run's journal of steps (what ``step`` and the integrations use).
        self.journal = Journal(self)

    @property
    def rate(self) -> Rate | None:
        """The rate admission of the job's queue (docs/queues.md), if it has one."""
        return self._rate

    @property
    def budget(self) -> Headroom:
        """Where this job stands against its budget, read now (:class:`Headroom`:
        caps, spend, ``usd_remaining``, ``tokens_remaining``, ``used``), to pick
        a cheaper model or wrap up."""
        return _headroom(self)

    @property
    def control(self) -> BaseException | None:
        """belay's control flow this run raised (a park on a signal, a durable
        sleep, a budget crossed, a cancel, a lost lease), once it did: code
        that catches exceptions around job code lets this one through."""
        return self._execution.control

    @property
    def _in_step(self) -> bool:
        return self._local is not None and bool(getattr(self._local, "in_step", False))

    @_in_step.setter
    def _in_step(self, value: bool) -> None:
        local = self._local
        if local is None:
            with _LOCAL_LOCK:
                local = self._local
                if local is None:
                    local = self._local = threading.local()
        local.in_step = value

    @property
    def job(self) -> Job:
        return self._execution.job

    @property
    def id(self) -> int:
        return self._execution.job.id

    @property
    def input(self) -> dict[str, Any]:
        return self._execution.job.input

    @property
    def meta(self) -> dict[str, Any]:
        return self._execution.job.meta

    @property
    def attempt(self) -> int:
        return self._execution.job.attempt

    @property
    def kind(self) -> str:
        return self._execution.job.kind

    @property
    def queue(self) -> str:
        return self._execution.job.queue

    @property
    def interrupted(self) -> bool:
        """True once this run lost its lease or timed out: its work will be discarded."""
        return self._execution.interrupted

    def _control(self, exc: E) -> E:
        """Mark ``exc`` as this job's control flow (a chunk tells its jobs apart by it)."""
        self._execution.control = exc
        return exc

    def checkpoint(self) -> None:
        """Raise :class:`Interrupted` if this run no longer owns its job, and
        :class:`CancelRequested` once a lease renewal saw an operator's cancel
        request (within a third of ``lease_ttl``; a step sees it at once).

        Steps call it at every boundary; long loops of your own can too.
        """
        why = self._execution.ended
        if why in ("lost", "timeout"):
            raise self._control(Interrupted(
                f"job {self.id} attempt {self.attempt}: "
                + ("lease lost" if why == "lost" else "timed out")
            ))
        if self._execution.cancel_requested:
            raise self._control(CancelRequested(f"job {self.id}: cancel requested"))

    # -- Durable steps (§8.2) ---------------------------------------------------------

    def step(
        self,
        name: str,
        fn: Callable[[], T],
        *,
        cost: CostSpec[T] = None,
        max_cost: Cost | Mapping[str, Any] | None = None,
    ) -> T | Any:
        """Run ``fn`` once per job, ever: its value is journaled under ``name`` and
        every later attempt gets the journaled value back without running it.

        ``cost`` (``belay.Cost(usd=…, tokens=…)``, or a function of the value that
        returns one, for spend known only from the answer) is added to the job's
        spend in the same transaction as the journal entry; a job whose spend goes
        over its budget fails with ``budget_exceeded``, or pauses for a top-up
        with ``budget={..., "on_exceed": "pause"}``. ``max_cost`` is what the
        step may cost at most (a unit left at 0 is not limited): it does not
        start unless the budget has that much headroom left — the job fails or
        pauses before it instead — and a step that cost more is reported (event
        ``budget_step_overrun``). A pending cancel request, a lost lease or a
        timeout stop the job here, before ``fn`` runs.
        """
        _check_step_name(name)
        return otel.step(self._execution, name, lambda: self._step(name, fn, cost, max_cost))

    async def astep(
        self,
        name: str,
        fn: Callable[[], Awaitable[T]],
        *,
        cost: CostSpec[T] = None,
        max_cost: Cost | Mapping[str, Any] | None = None,
    ) -> T | Any:
        """:meth:`step` for async code: ``await ctx.astep(name, coroutine_function)``.

        ``fn`` is awaited on the caller's event loop; the journal read and write run
        in a thread (``asyncio.to_thread``), so other tasks on the loop keep going
        while they wait on the database. Concurrent ``astep`` calls of one job are
        fine as long as their names differ.
        """
        _check_step_name(name)
        return await otel.astep(self._execution, name,
                                lambda: _astep(self, name, fn, cost, max_cost))

    def _nested(self, name: str) -> ValidationError:
        return ValidationError(
            f"step {name!r} was called inside another step; steps don't nest — call it "
            "after the outer step returns"
        )

    def _step(self, name: str, fn: Callable[[], T], cost: CostSpec[T],
              max_cost: Cost | Mapping[str, Any] | None = None) -> T | Any:
        if self._in_step or _ASYNC_STEP.get() is self:
            raise self._nested(name)
        units = None if callable(cost) else cost_units(cost)
        need = cost_units(max_cost)
        hit, value = self.journal.lookup(name, need)
        if hit:
            return value
        self._in_step = True
        try:
            value = fn()
        except BaseException:
            self.journal.release(name)  # its headroom is free again
            raise
        finally:
            self._in_step = False
        return self.journal.record(name, value, cost, units, need)

    # -- Events, signals, steering, sleep (§7, §8.1) ------------------------------------

    def emit(self, payload: Mapping[str, Any]) -> int:
        """Append ``payload`` (a dict) to this job's event stream; returns its seq.

        Not journaled: a job that runs again emits again (readers dedupe by content
        if they need to)."""
        body = dumps_object(payload, what="an event payload").decode()
        self.checkpoint()
        if not self._notify:
            with self.client.connection() as conn:
                return store.append_event(conn, self.id, body, self.client.clock.now())
        with self.client.transaction() as conn:
            seq = store.append_event(conn, self.id, body, self.client.clock.now())
            # Wakes subscribe_events at once (delivered on commit).
            store.notify(conn, self.client.notify_channel(conn),
                         [store.event_payload(self.id, seq)])
            return seq

    def _scopes(self) -> list[str]:
        scopes = [names.job_scope(self.id)]
        if self.job.workflow_id is not None:
            scopes.append(names.workflow_scope(self.job.workflow_id))
        return scopes

    def steering(self) -> Any:
        """The latest steering payload sent with ``belay.steer_job``, or None."""
        with self.client.connection() as conn:
            found, payload = store.get_signal(conn, self._scopes(), names.STEER)
        return payload if found else None

    def await_signal(self, name: str, timeout: float | None = None) -> Any:
        """Wait for the signal ``name`` (sent to ``job:<id>``, or ``wf:<workflow>``).

        Delivered already: returns its payload at once. Otherwise the job is
        parked — no thread, no lease — and runs again from the top when the
        signal arrives (steps replay), this time getting the payload. After
        ``timeout`` seconds without it, returns ``belay.TIMEOUT`` (falsy).
        """
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a signal name is a non-empty string, got {name!r}")
        names.check_text(name, "a signal name", empty=True)
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise ValidationError(f"timeout must be seconds >= 0 or None, got {timeout!r}")
            check_seconds("await_signal timeout", timeout)
        if self._in_step:
            raise ValidationError("await_signal can't run inside a step")
        self.checkpoint()
        scopes = self._scopes()
        with self.client.connection() as conn:
            found, payload = store.get_signal(conn, scopes, name)
        if found:
            return payload
        now = self.client.clock.now()
        job = self.job
        # Claimed back from awaiting because its deadline came (§4): a timeout.
        if job.await_name == name and job.ready_at is not None and job.ready_at <= now:
            return TIMEOUT
        deadline = None if timeout is None else now + timedelta(seconds=timeout)
        raise self._control(Park(scopes[0], name, deadline))

    def sleep(self, name: str, seconds: float) -> None:
        """Sleep durably: the wake time is journaled (step ``$sleep:<name>``), the job
        snoozes until then without holding a thread, and continues after it."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValidationError(f"sleep takes seconds >= 0, got {seconds!r}")
        check_seconds("sleep", seconds)
        names.check_text(name, "a sleep name", max_bytes=names.MAX_KEY_BYTES)
        now = self.client.clock.now()
        target = self._step(
            f"$sleep:{name}", lambda: (now + timedelta(seconds=seconds)).isoformat(), None
        )
        if not isinstance(target, str):
            return  # another SDK's $sleep value: never interpreted (§2)
        until = datetime.fromisoformat(target)
        if self.client.clock.now() < until:
            raise self._control(Sleep(until))


    def debit(self, resource: str, units: int, *, period: int | None = None) -> None:
        """Record ``units`` (e.g. tokens actually used) against ``resource``'s rate
        window, the counters rate admission reads (contract §6, bucket
        ``resource:<name>``).

        When this job's queue has a rate on ``resource``, its claim already
        debited the queue's ``estimate``: the first ``debit`` of the run credits
        that back, so the window converges on what was really used. With no such
        rate, pass ``period`` (seconds) to record usage all the same.
        """
        record_debit(self, resource, units, period)

    # -- Children (§8.4) ---------------------------------------------------------------

    def spawn_many(self, name: str, kind: Any, inputs: Iterable[Mapping[str, Any]],
                   **options: Any) -> list[int]:
        """Enqueue one child job per input, exactly once however often this runs.

        Doubly idempotent (§8.4): the id list is journaled as step
        ``$spawn:<name>``, and each child carries the always-unique key
        ``$spawn:<parent>:<name>:<index>``, so a crash between inserting the
        children and journaling the list can't duplicate them. ``options`` are
        enqueue options for every child (queue, priority, budget, …).
        """
        if options.get("budget") == SHARE:
            raise ValidationError(
                "budget='share' is for map_children, which charges the children's spend "
                "back to this job at fan-in; with spawn/spawn_many, give the children a "
                "budget of their own"
            )
        return self._spawn_many(name, kind, inputs, options, share=False)

    def _spawn_many(self, name: str, kind: Any, inputs: Iterable[Mapping[str, Any]],
                    options: dict[str, Any], *, share: bool) -> list[int]:
        from belay.children import spawn_children

        return spawn_children(self, name, kind, inputs, options, share=share)

    def spawn(self, name: str, kind: Any, input: Mapping[str, Any] | None = None,
              **options: Any) -> int:
        """Enqueue one child job exactly once; returns its id."""
        return self.spawn_many(name, kind, [input or {}], **options)[0]

    def await_children(self) -> list[Job]:
        """Wait until every child of this job is terminal; returns them, oldest first.

        Parks on ``$children`` (no thread held) until a child's terminal write
        signals it; re-verifies on every wake (§8.4, races R1/R2).
        """
        from belay.children import wait_for_children

        return wait_for_children(self)

    def map_children(self, name: str, kind: Any, inputs: Iterable[Mapping[str, Any]],
                     **options: Any) -> list[Job]:
        """Fan out one child per input and fan in: their jobs (``.result``,
        ``.state``) in input order, once all are terminal.

        With ``budget="share"`` the children split what is left of this job's
        budget, and at fan-in their spend is charged to this job (step
        ``$spend:<name>``), so one budget holds across the whole tree: the
        parent fails with ``budget_exceeded`` if the children took it over.
        What they are given stays held from this job's headroom until that
        charge-back: two fan-outs in flight at once split what is left between
        them, never the same remainder twice, and a step's ``max_cost`` must
        fit beside it.
        """
        share = options.get("budget") == SHARE
        ids = self._spawn_many(name, kind, inputs, options, share=share)
        by_id = {kid.id: kid for kid in self.await_children()}
        kids = [by_id[i] for i in ids]
        if share:
            spent = {"usd_micros": sum(k.spent_usd_micros for k in kids),
                     "tokens": sum(k.spent_tokens for k in kids)}
            self._step(f"{SPEND_PREFIX}{name}", lambda: spent, _charge_back)
        return kids


async def _astep(ctx: Context, name: str, fn: Callable[[], Awaitable[T]], cost: CostSpec[T],
                 max_cost: Cost | Mapping[str, Any] | None) -> T | Any:
    """``ctx.astep`` once its name is checked (the journal's I/O in a thread)."""
    if ctx._in_step or _ASYNC_STEP.get() is ctx:
        raise ctx._nested(name)
    units = None if callable(cost) else cost_units(cost)
    need = cost_units(max_cost)
    while True:
        found = await asyncio.to_thread(ctx.journal.probe, name, need)
        if not isinstance(found, Wait):
            break
        await ctx.journal.asettled(found)
    hit, value = found
    if hit:
        return value
    token = _ASYNC_STEP.set(ctx)
    try:
        value = await fn()
    except BaseException:
        # Cancelled too: a short write on the loop's thread, not awaited (the
        # task may be cancelled again while it would wait).
        ctx.journal.release(name)
        raise
    finally:
        _ASYNC_STEP.reset(token)
    return await asyncio.to_thread(ctx.journal.record, name, value, cost, units, need)


#: How often a step waiting for headroom held by its run's steps in flight
#: checks again without being told (and the cancel and lease with it).
SETTLE_POLL = 1.0


class Wait(NamedTuple):
    """:meth:`Journal.probe`: the step must wait until this run has settled
    more than ``after`` holds (:meth:`Journal.lookup` waits by itself)."""

    after: int


class Journal:
    """The journal of one run (§8.2): look up and record its steps.

    ``ctx.step`` is built on it; so are the agent integrations, which journal
    model and tool calls under keys of their own, nested inside one another
    (``ctx.step`` refuses nesting; the journal does not). A replay's context
    answers from the record instead (:mod:`belay.replay`).
    """

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        #: Warning thresholds this run knows were marked (no need to try again).
        self._warned: set[float] = set()
        watchdog = ctx._watchdog
        #: The steps this run journaled, when a watchdog looks for repeats.
        self._repeats = (None if watchdog is None or watchdog.repeats is None
                         else Repeats(watchdog.repeats))
        #: The holds on the headroom of this run's steps in flight, by step name,
        #: and the steps whose reservation is being written.
        self._held: dict[str, str] = {}
        self._reserving: set[str] = set()
        #: This run's name in its holds, fixed before any thread of the job can
        #: read it: two names for one run would each find the other's holds
        #: dead and drop them (a name made on first use was, now and then,
        #: made twice by threads reserving at once — and steps overspent).
        self._run_id = secrets.token_hex(8)
        #: How many holds this run settled: a step waiting for headroom its
        #: own steps in flight hold tries again when it moves.
        self._settled = 0
        self._settling = threading.Condition()

    @property
    def run(self) -> str:
        """This run's name in its holds (:mod:`belay.holds`): a hold of any
        other run is dead, since one run at a time holds the job."""
        return self._run_id

    def lookup(self, name: str, need: tuple[int, int] = (0, 0)) -> tuple[bool, Any]:
        """The journaled value of step ``name`` as ``(True, value)``; else
        ``(False, None)`` once the pre-flight checks allow running it (the
        run still owns its job, the budget is not spent, and it has ``need``
        (micro-dollars, tokens: the step's ``max_cost``) of headroom, which
        is then held for it). Raises :class:`Interrupted`,
        :class:`CancelRequested` or :class:`BudgetExceeded` as ``ctx.step``
        would. A ``max_cost`` that fits only once this run's other steps in
        flight are journaled (they may cost less than theirs) waits for them."""
        while True:
            found = self.probe(name, need)
            if not isinstance(found, Wait):
                return found
            self._wait_settled(found.after)

    def probe(self, name: str, need: tuple[int, int] = (0, 0)) -> tuple[bool, Any] | Wait:
        """One try of :meth:`lookup`: what it returns, or :class:`Wait` when
        the step must wait for this run's steps in flight to settle first."""
        ctx = self._ctx
        ctx.checkpoint()
        with ctx.client.connection() as conn:
            found = store.step_lookup(conn, ctx.id, name)
        if found is not None and found["hit"]:
            otel.step_replayed(name)
            return True, decode_value(found["value"])
        if found is not None:
            self._preflight(found, name, need)
            if need != (0, 0) and budget.capped(found):
                settled = self._settled  # read before trying: a settle after it wakes the wait
                if not self._reserve(name, need):
                    return Wait(settled)
        return False, None

    def _wait_settled(self, after: int) -> None:
        with self._settling:
            self._settling.wait_for(lambda: self._settled != after, SETTLE_POLL)

    async def asettled(self, wait: Wait) -> None:
        """:meth:`lookup`'s wait, for an ``astep``: on the loop, not in a
        thread (a wait per step would take every thread of the executor that
        the steps in flight need to journal)."""
        deadline = time.monotonic() + SETTLE_POLL
        while self._settled == wait.after and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _reserve(self, name: str, need: tuple[int, int]) -> bool:
        """Hold ``need`` of the headroom for step ``name`` until it is
        journaled (True), so steps in flight at once never promise the same
        money twice; False when it would fit once this run's own steps in
        flight settle. A step it doesn't fit at all fails or pauses the job as
        one over its budget does."""
        ctx = self._ctx
        self._reserving.add(name)
        try:
            with ctx.client.transaction() as conn:
                reserved = store.run(conn, holds.reserve(
                    ctx.id, ctx.attempt, self.run, name, need, ctx.client.clock.now()))
            if reserved is not None and reserved.hold is not None:
                self._held[name] = reserved.hold
        finally:
            self._reserving.discard(name)
        if reserved is None:
            return True  # the row is gone: nothing to keep within
        if reserved.verdict == holds.LOST:
            raise ctx._control(Interrupted(f"job {ctx.id} attempt {ctx.attempt}: lease lost"))
        # Wait only while this run has steps in flight to settle (a hold it
        # could not drop — a failed write — would otherwise be waited on forever).
        if reserved.verdict == holds.WAIT and (set(self._held) | self._reserving) - {name}:
            return False
        if reserved.verdict in (holds.SHORT, holds.WAIT):
            standing = reserved.standing
            self._check_budget(standing.spend, name, need, standing.held.total)
            raise AssertionError("unreachable: the reservation did not fit")  # pragma: no cover
        return True

    def _settle(self) -> None:
        """A hold of this run was settled or dropped: waiting steps try again."""
        with self._settling:
            self._settled += 1
            self._settling.notify_all()

    def release(self, name: str) -> None:
        """Drop the hold of step ``name`` when it won't be journaled (it raised).
        Best effort: a hold left behind dies with this run."""
        hold = self._held.get(name)
        if hold is None:
            return
        ctx = self._ctx
        try:
            with ctx.client.connection() as conn:
                store.run(conn, holds.release(ctx.id, [hold]))
        except Exception:
            log.warning("belay: job %d: dropping the hold of step %r failed; it is dropped "
                        "when the job next runs", ctx.id, name, exc_info=True)
        # Forgotten once dropped in the database (see record).
        self._held.pop(name, None)
        self._settle()

    def _settles(self, name: str) -> list[str]:
        """The holds journaling step ``name`` settles: its own, and a fan-in's
        charge-back (``$spend:<fan-out>``) the share its children were given."""
        settled = [hold] if (hold := self._held.get(name)) is not None else []
        if name.startswith(SPEND_PREFIX):
            settled.append(budget.share_name(name[len(SPEND_PREFIX):]))
        return settled

    def record(self, name: str, value: T, cost: CostSpec[T] = None,
               units: tuple[int, int] | None = None,
               limit: tuple[int, int] = (0, 0)) -> T | Any:
        """Journal ``value`` under ``name`` with its cost (a :class:`Cost`, a
        mapping, or a function of the value, as ``ctx.step`` takes), charged
        to the budget; returns the value that stands — another run's, if it
        journaled the step first (§11.3)."""
        ctx = self._ctx
        try:
            if units is None:
                units = self._priced(name, value, cost) if callable(cost) else cost_units(cost)
            envelope = self._envelope(name, value)
        except BaseException:
            self.release(name)
            raise
        usd_micros, tokens = units
        otel.step_cost(name, usd_micros, tokens)
        job_id = ctx.id
        settles = self._settles(name)
        # One statement (journal + spend + holds settled): no transaction block around it.
        try:
            with ctx.client.connection() as conn:
                spend = store.put_step(conn, job_id, name, envelope, usd_micros, tokens,
                                       ctx.client.clock.now(), settles)
                if spend is not None and not spend["journaled"]:
                    # Another run of this job journaled it first: its value stands (§11.3).
                    _, journaled = store.get_step(conn, job_id, name)
                    value = decode_value(journaled)
        except BaseException:
            self.release(name)  # not journaled: give the headroom back
            raise
        if settles:
            # Forgotten only once settled in the database: a step that waits
            # for this run's holds must not find none here while one is there.
            self._held.pop(name, None)
            self._settle()
        if spend is not None:
            if spend["journaled"] and _overran(units, limit):
                self._announce({"type": "budget_step_overrun", "step": name,
                                "cost_usd": usd_micros / 1_000_000, "cost_tokens": tokens,
                                "max_usd": limit[0] / 1_000_000 if limit[0] else None,
                                "max_tokens": limit[1] or None})
            self._warn(spend, name)
            self._check_budget(spend, name)
            if spend["journaled"]:
                ctx._execution.progressed(name)
                looped = None if self._repeats is None else self._repeats.add(name, envelope)
                if looped is not None:
                    self._trip(looped)
        return value

    def _envelope(self, name: str, value: Any) -> bytes:
        """A step's value as the journal stores it; StepValueRefused when it can't be."""
        ctx = self._ctx
        try:
            envelope = encode_value(value, what=f"the value of step {name!r}")
        except ValidationError as exc:
            raise ctx._control(StepValueRefused(str(exc))) from None
        except Exception as exc:  # the value's own code raised (a dict subclass's items() …)
            raise ctx._control(StepValueRefused(
                f"the value of step {name!r} could not be serialized: {describe(exc)}"
            )) from None
        if len(envelope) > MAX_STEP_VALUE:
            raise ctx._control(StepValueRefused(
                f"the value of step {name!r} is {len(envelope)} bytes; steps hold at most "
                f"{MAX_STEP_VALUE} (1 MiB): store large data elsewhere and journal a reference"
            ))
        return envelope

    def _trip(self, steps: list[str]) -> None:
        """The watchdog saw ``steps`` repeat: fail the job, or park it for steering."""
        ctx = self._ctx
        shown = steps if len(steps) <= 10 else [*steps[:5], "…", *steps[-4:]]
        message = (f"no progress: {len(steps)} steps in a row were the same step with the "
                   f"same value ({', '.join(shown)})")
        watchdog = ctx._watchdog
        if watchdog is not None and watchdog.pauses:
            self._announce({"type": "watchdog_paused", "reason": "repeats", "steps": shown,
                            "message": message})
            raise ctx._control(pause_for_steering(ctx.client, ctx.id))
        raise ctx._control(NoProgress({"error": "no_progress", "reason": "repeats",
                                       "steps": shown, "attempt": ctx.attempt,
                                       "message": message}))

    def _priced(self, name: str, value: T, cost: CostSpec[T]) -> tuple[int, int]:
        """Run a step's cost function. It failing is a bug that a retry would pay
        for again, so the job fails at once (like a value that can't be journaled)."""
        assert callable(cost)
        try:
            return cost_units(cost(value))
        except Exception as exc:
            # describe(): the exception's own __str__ may raise, and must not
            # turn this refusal into an ordinary retry that pays for the step again.
            raise self._ctx._control(StepValueRefused(
                f"the cost function of step {name!r} failed: {describe(exc)}; "
                "it gets the step's value and returns a belay.Cost, a dict or None"
            )) from exc

    def _preflight(self, spend: Mapping[str, Any], name: str,
                   need: tuple[int, int] = (0, 0)) -> None:
        """§8.2: before paying for a step, check the durable spend — a crash
        between journaling an over-budget step and the failing ack must not buy
        one more step on the next attempt. Also honours a cancel request (§8.6)."""
        if spend["cancel_requested"]:
            raise self._ctx._control(CancelRequested(f"job {self._ctx.id}: cancel requested"))
        # A warning a crash kept from being sent goes out before the next step.
        self._warn(spend, name)
        self._check_budget(spend, name, need)

    def _warn(self, spend: Mapping[str, Any], name: str) -> None:
        """Send each warning threshold the spend has reached, once per job: its
        mark (signal ``$budget:warn:<fraction>`` in the job's scope) decides who
        sends it, so a retry or a racing run doesn't send it again."""
        ctx = self._ctx
        headroom = Headroom.of(spend)
        due = [t for t in budget.reached(budget.policy_of(ctx.meta).warn_at, headroom.used)
               if t not in self._warned]
        for threshold in due:
            payload = {"type": "budget_warning", "threshold": threshold, "step": name,
                       **headroom.to_dict()}
            if self._announce(payload, mark=budget.mark_name(threshold)):
                self._report(BudgetNotice.of(ctx.job, "warning", name, headroom, threshold))
            self._warned.add(threshold)

    def _announce(self, payload: dict[str, Any], mark: str | None = None) -> bool:
        """Append ``payload`` to the job's events (and wake its subscribers);
        with a ``mark``, only if this call journaled it. True when appended."""
        ctx = self._ctx
        body = dumps_object(payload, what="a budget event").decode()
        now = ctx.client.clock.now()
        with ctx.client.transaction() as conn:
            if mark is not None and not store.budget_mark(conn, ctx.id, mark, body, now):
                return False
            seq = store.append_event(conn, ctx.id, body, now)
            if ctx._notify:
                store.notify(conn, ctx.client.notify_channel(conn),
                             [store.event_payload(ctx.id, seq)])
        return True

    def _report(self, notice: BudgetNotice) -> None:
        hook = self._ctx._on_budget
        if hook is not None:
            hook(notice)

    def _check_budget(self, spend: Mapping[str, Any], name: str,
                      need: tuple[int, int] = (0, 0), held: tuple[int, int] = (0, 0)) -> None:
        """Spend over a cap, or a step's ``max_cost`` (``need``) more than the
        headroom left beside what steps in flight hold (``held``): the job
        pauses for a top-up (``on_exceed="pause"``) or fails with
        ``budget_exceeded`` (the default)."""
        over = budget.exceeded(spend)
        if not over and not budget.exceeded(budget.with_held(spend, held), need):
            return
        ctx = self._ctx
        headroom = Headroom.of(spend)
        short = {} if over else {"max_usd": need[0] / 1_000_000, "max_tokens": need[1]}
        if not over and held != (0, 0):
            short.update(held_usd=held[0] / 1_000_000, held_tokens=held[1])
        if budget.policy_of(ctx.meta).pauses:
            self._announce({"type": "budget_paused", "step": name, **headroom.to_dict(),
                            **short})
            self._report(BudgetNotice.of(ctx.job, "paused", name, headroom))
            raise ctx._control(BudgetPause(ctx.id, name, (0, 0) if over else need))
        self._report(BudgetNotice.of(ctx.job, "exceeded", name, headroom))
        raise ctx._control(BudgetExceeded({
            "error": "budget_exceeded", "step": name, "attempt": ctx.attempt,
            "spent_usd_micros": spend["spent_usd_micros"],
            "budget_usd_micros": spend["budget_usd_micros"],
            "spent_tokens": spend["spent_tokens"], "budget_tokens": spend["budget_tokens"],
            **({} if over else {"max_cost_usd_micros": need[0], "max_cost_tokens": need[1]}),
            **({"held_usd_micros": held[0], "held_tokens": held[1]}
               if not over and held != (0, 0) else {}),
        }))


def _headroom(ctx: Context) -> Headroom:
    with ctx.client.connection() as conn:
        spend = store.budget_of(conn, ctx.id)
    if spend is None:  # the row is gone: what the run was claimed with
        job = ctx.job
        spend = {"budget_usd_micros": job.budget_usd_micros,
                 "spent_usd_micros": job.spent_usd_micros,
                 "budget_tokens": job.budget_tokens, "spent_tokens": job.spent_tokens}
    return Headroom.of(spend)


def pause_for_steering(client: Belay, job_id: int) -> Park:
    """A park until ``belay.steer_job`` (the watchdog's pause): steering sent
    before it is cleared first, or the park would find it and run again at once."""
    scope = names.job_scope(job_id)
    with client.connection() as conn:
        store.clear_signal(conn, scope, names.STEER)
    return Park(scope, names.STEER, None)


def _overran(units: tuple[int, int], limit: tuple[int, int]) -> bool:
    """A step cost more than its ``max_cost`` in a unit that has one."""
    return any(bound and spent > bound for spent, bound in zip(units, limit, strict=True))


#: ``budget=SHARE`` for children: an even share of what the parent has left.
SHARE = "share"


def _charge_back(spent: Mapping[str, Any]) -> Cost:
    return Cost(usd=spent["usd_micros"] / 1_000_000, tokens=spent["tokens"])


def check_debit(resource: object, units: object, period: object) -> None:
    """Refuse the arguments of a ``ctx.debit`` that could not be recorded."""
    if not isinstance(resource, str) or not resource:
        raise ValidationError(f"a resource is a non-empty string, got {resource!r}")
    names.check_text(resource, "a resource")
    if isinstance(units, bool) or not isinstance(units, int) or not 0 <= units <= 2**63 - 1:
        raise ValidationError(f"units must be an integer from 0 to 2**63 - 1, got {units!r}")
    if period is not None and (
        isinstance(period, bool) or not isinstance(period, int) or not 1 <= period <= 2**31 - 1
    ):
        raise ValidationError(f"period must be whole seconds from 1 to 2**31 - 1, got {period!r}")


def cost_units(cost: Cost | Mapping[str, Any] | None) -> tuple[int, int]:
    if cost is None:
        return 0, 0
    if isinstance(cost, Mapping):
        unknown = sorted(set(cost) - {"usd", "tokens"})
        if unknown:
            raise ValidationError(f"unknown cost key(s) {unknown}; use 'usd' and 'tokens'")
        cost = Cost(usd=cost.get("usd", 0.0), tokens=cost.get("tokens", 0))
    if not isinstance(cost, Cost):
        raise ValidationError(f"cost is a belay.Cost or a dict, got {type(cost).__name__}")
    tokens = cost.tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < 2**63:
        raise ValidationError(f"cost tokens must be an integer from 0 to 2**63-1, got {tokens!r}")
    return usd_to_micros(cost.usd, what="cost usd"), tokens


def record_debit(ctx: Context, resource: str, units: int, period: int | None) -> None:
    """``ctx.debit``: add ``units`` to ``resource``'s rate window, crediting back
    the claim's estimate the first time in a run."""
    check_debit(resource, units, period)
    rate = ctx._rate
    credit = 0
    if rate is not None and rate.resource == resource:
        period = rate.period
        if ctx._execution.take_credit():
            credit = rate.estimate
    elif period is None:
        raise ConfigurationError(
            f"queue {ctx.queue!r} has no rate on resource {resource!r}: add "
            f"rate={{'resource': {resource!r}, ...}} to the queue's options, or pass "
            "period=<seconds> to record the usage without admission"
        )
    epoch = int(ctx.client.clock.now().timestamp())
    with ctx.client.connection() as conn:
        store.rate_add(conn, names.resource_bucket(resource),
                       names.window_start(epoch, period), units - credit)
