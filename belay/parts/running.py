"""Running claimed work in the calling thread, and recording how it ended.

:class:`JobRunner` is what an executor thread calls: decrypt the input, report
the start, build the context, call the function through the middleware, then
conclude — ``outcome.decide`` on what it returned or raised, and the ack
through the completer (a park, a batched success, or one fenced ack).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from belay import ambient, otel
from belay.client import Belay
from belay.context import CancelRequested, Context, Park, pause_for_steering
from belay.crypto import DecryptionError, decrypt_input, is_encrypted
from belay.errors import ConfigurationError, ValidationError
from belay.job import Job
from belay.outcome import RETURN_SNOOZE, Outcome, decide, describe, safe_repr
from belay.parts.completer import Completer, PendingAck
from belay.parts.execution import ACKED, ENDINGS, Execution
from belay.parts.hooks import Hooks
from belay.parts.leases import stall_entry, timeout_outcome
from belay.queues import QueueSpec
from belay.registry import Registry
from belay.watchdog import Watchdog

log = logging.getLogger("belay.worker")


#: ``middleware(contexts, call)``: runs ``call()`` (the job's function, or a
#: chunk worker's over all its contexts) and returns what it returns.
Middleware = Callable[[Sequence[Context], Callable[[], Any]], Any]


class JobRunner:
    """Runs executions and chunks for one worker and records their ends."""

    def __init__(
        self,
        client: Belay,
        registry: Registry,
        completer: Completer,
        hooks: Hooks,
        *,
        notify: bool,
        spec_for: Callable[[str], QueueSpec | None],
        may_batch: Callable[[], bool],
        new_deadline: Callable[[], None],
        free: Callable[[Execution], None],
        watchdog: Watchdog | None = None,
    ) -> None:
        self.client = client
        self.registry = registry
        self.completer = completer
        self.hooks = hooks
        self.notify = notify
        self._spec_for = spec_for
        self._may_batch = may_batch
        self._new_deadline = new_deadline
        self._free = free
        self.middleware: list[Middleware] = []
        #: The no-progress watchdog for jobs without their own.
        self.watchdog = watchdog

    def _now(self) -> datetime:
        return self.client.clock.now()

    def run(self, work: Execution | list[Execution]) -> object:
        """What an executor calls with a piece of work; then it acks the
        successes it handed over (with any others waiting), unless a batch
        is in flight that takes them along."""
        try:
            return self.execute_chunk(work) if isinstance(work, list) else self.execute(work)
        finally:
            self.completer.combine()

    def release(self, execution: Execution) -> None:
        """The executor is done with it: forget it and free its slot — unless
        its ack is pending: then the acker does, once the ack lands. The slot
        stays taken until then, so a queue never holds more claimed-but-unacked
        jobs than its limit: the claims wait for the acks (backpressure),
        instead of running ahead of them."""
        if not execution.ack_pending:
            self._free(execution)

    def batched(self, pending: PendingAck, outcome: str) -> None:
        """The acker acked (or found stale) a success handed to it."""
        self.hooks.finished(pending.execution.job, outcome, pending.duration, None)
        self._free(pending.execution)

    def batch_failed(self, batch: list[PendingAck], exc: BaseException) -> None:
        self.hooks.crashed([p.execution for p in batch], exc)
        for pending in batch:
            self._free(pending.execution)

    def timed_out(self, execution: Execution) -> None:
        """The attempt is failed at its deadline. The thread can't be killed: the
        slot stays taken until the function returns, and the context refuses
        further steps."""
        definition = execution.definition
        assert definition is not None
        if execution.stalled and execution.watchdog.pauses:
            log.warning("belay: job %d attempt %d: %s; parked until steered", execution.job.id,
                        execution.job.attempt, stall_entry(execution)["message"])
            park = pause_for_steering(self.client, execution.job.id)
            self.completer.park(execution.job, park.scope, park.name, None)
            return
        self.completer.ack(execution.job,
                           timeout_outcome(execution, self._now(), definition.backoff))

    def return_unknown(self, job: Job) -> None:
        """Not run, not lost, not an attempt: snoozed back for a worker that knows it."""
        log.error("belay: no worker for kind %r (job %d, queue %r) on this node; it goes back "
                  "to the queue for %.0fs. Registered kinds: %s", job.kind, job.id, job.queue,
                  RETURN_SNOOZE, ", ".join(self.registry.kinds()) or "none")
        outcome = Outcome("snooze", at=self._now() + timedelta(seconds=RETURN_SNOOZE))
        self.completer.ack(job, outcome)

    # -- One execution -----------------------------------------------------------------

    def execute(self, execution: Execution) -> str:
        """Run one claimed execution and ack it; returns the outcome recorded."""
        try:
            return self._execute(execution)
        except BaseException as exc:
            self.hooks.crashed([execution], exc)
            raise

    def _execute(self, execution: Execution) -> str:
        execution.thread = threading.get_ident()
        if execution.job.cancel_requested:
            self.hooks.started(execution)
            return self.conclude(execution, None, cancelled_before_start(execution.job))
        if not self._decrypt(execution):
            return "snooze"
        definition = execution.definition
        assert definition is not None
        self.hooks.started(execution)
        ctx = self.context(execution)
        returned, raised = self._call([ctx], lambda: definition(ctx), current=ctx,
                                      span=execution.span)
        return self.conclude(execution, returned, raised)

    def _call(self, contexts: list[Context], call: Callable[[], Any], *,
              current: Context | None = None, span: Any = None
              ) -> tuple[Any, BaseException | None]:
        """``call()`` inside the middleware, ``current`` the context
        ``belay.current_context()`` returns and ``span`` the current
        OpenTelemetry span (a chunk's jobs share a call: none is current);
        (what it returned, what it raised)."""
        for layer in reversed(self.middleware):
            call = _wrapped(layer, contexts, call)
        traced = otel.enter(span)
        state = ambient.enter(current, contexts)
        try:
            return call(), None
        except BaseException as exc:  # the job's failure, whatever it raised
            return None, exc
        finally:
            ambient.leave(state)
            otel.leave(traced)

    # -- A chunk -----------------------------------------------------------------------

    def execute_chunk(self, executions: list[Execution]) -> dict[int, str]:
        """Run a chunk worker once over several claimed jobs, then ack each one
        on its own (fenced, §7); returns the outcome recorded per job id.

        The function returns None (every job succeeded) or a dict of job id →
        result, where an exception instance fails (or cancels, or snoozes) that
        job alone. If it raises, every job gets that error — unless the raise is
        one job's own control flow (await, sleep, budget, cancel, a lost lease):
        that job takes it, and the others go back to the queue without using
        an attempt (their journaled steps make the rerun cheap).
        """
        try:
            return self._execute_chunk(executions)
        except BaseException as exc:
            # A success already handed to the acker is the acker's to report.
            self.hooks.crashed([e for e in executions if not e.ack_pending], exc)
            raise

    def _execute_chunk(self, executions: list[Execution]) -> dict[int, str]:
        outcomes: dict[int, str] = {}
        runnable: list[Execution] = []
        for execution in executions:
            execution.thread = threading.get_ident()
            if execution.job.cancel_requested:
                self.hooks.started(execution)
                outcomes[execution.job.id] = self._conclude_one(
                    execution, None, cancelled_before_start(execution.job))
            elif self._decrypt(execution):
                runnable.append(execution)
            else:
                outcomes[execution.job.id] = "snooze"
        if not runnable:
            return outcomes
        definition = runnable[0].definition
        assert definition is not None
        for execution in runnable:
            execution.restart_clock(definition.timeout)
            self.hooks.started(execution)
        if definition.timeout is not None:
            self._new_deadline()
        contexts = [self.context(execution) for execution in runnable]
        returned, raised = self._call(contexts, lambda: definition.fn(contexts))  # type: ignore[arg-type]
        if raised is not None:
            owner = next((e for e in runnable if e.control is raised), None)
            for execution in runnable:
                if owner is None or execution is owner:
                    outcomes[execution.job.id] = self._conclude_one(execution, None, raised)
                else:
                    outcomes[execution.job.id] = self._conclude_one(
                        execution, None, None, outcome=Outcome("snooze", at=self._now()))
            return outcomes
        try:
            ends = chunk_ends(definition.kind, runnable, returned)
        except BaseException as exc:  # user code: a Mapping's __iter__, a key's __eq__ …
            bad = ValidationError(f"the chunk worker's return value could not be read: "
                                  f"{describe(exc)}")
            ends = {e.job.id: (None, bad) for e in runnable}
        for execution in runnable:
            result, error = ends[execution.job.id]
            outcomes[execution.job.id] = self._conclude_one(execution, result, error)
        return outcomes

    def _conclude_one(self, execution: Execution, returned: Any, raised: BaseException | None,
                      *, outcome: Outcome | None = None) -> str:
        """Conclude one job of a chunk: one that can't be acked (the database
        refused) must not keep the others from theirs."""
        try:
            return self.conclude(execution, returned, raised, outcome=outcome)
        except Exception as exc:
            log.exception("belay: recording job %d attempt %d failed; its lease will lapse and "
                          "it will be reclaimed", execution.job.id, execution.job.attempt)
            self.hooks.crashed([execution], exc)
            return "crashed"

    # -- Around the run ----------------------------------------------------------------

    def _decrypt(self, execution: Execution) -> bool:
        """Decrypt an encrypted input in place; False when it can't be (the job was
        snoozed back: not its fault and not an attempt, for a worker with the key)."""
        if not is_encrypted(execution.job.input):
            return True
        try:
            plain = decrypt_input(execution.job.input, self.client.encryption_key)
        except (DecryptionError, ConfigurationError) as exc:
            log.error("belay: job %d: %s; it goes back to the queue for %.0fs",
                      execution.job.id, exc, RETURN_SNOOZE)
            execution.end(ACKED)
            self.hooks.started(execution)
            when = self._now() + timedelta(seconds=RETURN_SNOOZE)
            self.completer.ack(execution.job, Outcome("snooze", at=when))
            self.hooks.finished(execution.job, "snooze", 0.0, str(exc))
            return False
        execution.job = execution.job.replace(input=plain)
        return True

    def context(self, execution: Execution) -> Context:
        owner = execution.owner
        spec = owner.spec if owner is not None else self._spec_for(execution.job.queue)
        return Context(execution, self.client, self.registry, notify=self.notify,
                       rate=None if spec is None else spec.rate,
                       on_budget=self.hooks.budget_notice if self.hooks.budget else None,
                       watchdog=self.watchdog)

    def conclude(self, execution: Execution, returned: Any, raised: BaseException | None,
                 *, outcome: Outcome | None = None) -> str:
        """Ack what a run returned or raised (or ``outcome``); returns the outcome's name."""
        job, definition = execution.job, execution.definition
        assert definition is not None
        duration = execution.elapsed()
        if not execution.end(ACKED):
            why = execution.ended or "ended"
            log.warning("belay: job %d attempt %d %s; its %s is discarded", job.id, job.attempt,
                        ENDINGS.get(why, why), "error" if raised is not None else "result")
            self.hooks.finished(job, why, duration, None, raised)
            return why
        # issubclass of the type: isinstance would read a user object's __class__.
        if raised is not None and issubclass(type(raised), Park):
            assert isinstance(raised, Park)
            kind = self.completer.park(job, raised.scope, raised.name, raised.deadline)
            self.hooks.finished(job, kind, duration, None, raised)
            return kind
        if outcome is None:
            outcome = decide(returned=returned, raised=raised, attempt=job.attempt,
                             max_attempts=job.max_attempts, now=self._now(),
                             backoff=definition.backoff)
        # A job with a budget cap acks alone: its success is fenced on its
        # spend (store.ack), which a batch does not check.
        if (outcome.kind == "succeeded" and self._may_batch() and not job.capped
                and self.completer.defer(PendingAck(execution, outcome.result, duration))):
            return "succeeded"
        kind = self.completer.ack(job, outcome) or "stale"
        self.hooks.finished(job, kind, duration, outcome.error, raised)
        return kind


def cancelled_before_start(job: Job) -> CancelRequested:
    """§8.6: a claimed job whose cancel was requested (by an operator, while an
    earlier attempt ran) never runs again: it is acked cancelled unrun."""
    return CancelRequested(f"job {job.id}: cancel requested before attempt {job.attempt} "
                           "started")


def _wrapped(layer: Middleware, contexts: Sequence[Context], call: Callable[[], Any]
             ) -> Callable[[], Any]:
    return lambda: layer(contexts, call)


def chunk_ends(kind: str, runnable: list[Execution], returned: Any
               ) -> dict[int, tuple[Any, BaseException | None]]:
    """(result, raised) per job id from a chunk worker's return value."""
    if returned is None:
        return {e.job.id: (None, None) for e in runnable}
    if not isinstance(returned, Mapping):
        bad = ValidationError("a chunk worker returns None or a dict of job id → result, "
                              f"got {type(returned).__name__}")
        return {e.job.id: (None, bad) for e in runnable}
    by_id: Mapping[Any, Any] = returned
    strays = set(by_id) - {e.job.id for e in runnable}
    if strays:
        log.warning("belay: chunk worker %s returned outcomes for jobs not in its chunk: %s",
                    kind, sorted(map(safe_repr, strays)))
    ends: dict[int, tuple[Any, BaseException | None]] = {}
    for execution in runnable:
        job_id = execution.job.id
        if job_id not in by_id:
            ends[job_id] = (None, ValidationError(
                f"the chunk worker returned no outcome for job {job_id}"))
            continue
        mine = by_id[job_id]
        # issubclass of the type: isinstance would read a user object's __class__.
        ends[job_id] = (None, mine) if issubclass(type(mine), BaseException) else (mine, None)
    return ends
