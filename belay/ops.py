"""What the operator surfaces (CLI, MCP server, dashboard) share.

JSON-ready views of jobs, steps, events, workflows and queues, and the
mutations an operator (or an agent) may ask for, each checked by a
:class:`Guard` before anything is written. Views take rows already read;
the few functions here that read take a :class:`~belay.client.Belay`.

An authorizer is a callable ``authorize(tool, args)`` called before every
mutation. It allows by returning ``None`` or ``True``; it refuses by
returning ``False`` or a message (a ``str``), or by raising — the refusal's
message reaches whoever asked. One that takes an ``authority`` keyword
(``authorize(tool, args, *, authority)``) also gets the capability set of the
job the mutation is for (:class:`belay.authority.Authority`, or None).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from belay import names, store
from belay.authority import authority_of
from belay.budget import check_top_up, check_top_up_key
from belay.codec import Opaque
from belay.errors import BelayError, ConfigurationError, JobNotFound, ValidationError
from belay.job import STATES, Event, Job, Step, WorkflowStatus
from belay.outcome import describe, message_of
from belay.spend import MAX_LIMIT as MAX_SPEND_LIMIT
from belay.spend import parse_span

#: The mutations every surface offers, by the MCP tool name each has.
MUTATIONS: Final = ("retry_job", "cancel_job", "signal", "steer_job", "top_up", "schedule",
                     "cancel_schedule")

#: How far back a queue's "rate" looks: jobs finished per minute.
RATE_WINDOW = timedelta(seconds=60)

#: The arguments each mutation takes.
MUTATION_ARGS: Final[Mapping[str, tuple[str, ...]]] = {
    "retry_job": ("job_id",), "cancel_job": ("job_id",),
    "signal": ("job_id", "name", "payload"), "steer_job": ("job_id", "payload"),
    "top_up": ("job_id", "usd", "tokens", "idempotency_key"),
    "schedule": ("name", "expression", "worker", "input", "overlap", "catch_up", "options"),
    "cancel_schedule": ("name",),
}

#: The largest id (and seq) a bigint column holds.
MAX_ID: Final = 2**63 - 1

#: How deep a signal or steering payload may nest (``{"a": [1]}`` is 2 deep).
#: jsonb takes far deeper values, and the codec's own limit is 255; an
#: operator's payload is a small object, and a parser that recurses must stop
#: somewhere well short of Python's recursion limit.
MAX_JSON_DEPTH: Final = 64

#: ``authorize(tool, args)``, or ``authorize(tool, args, *, authority)``.
Authorizer = Callable[..., object]


class Refused(BelayError, PermissionError):
    """A mutation was refused: mutations are off, or the authorizer said no."""


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: datetimes as ISO 8601, undecodable values
    and anything else JSON has no word for as a descriptive string."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Opaque):
        return f"<opaque: {len(value.data)} bytes, {value.reason}>"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(bytes(value))} bytes>"
    return repr(value)


def job_view(job: Job) -> dict[str, Any]:
    """Every field of a job row, with the result decoded."""
    return {
        "id": job.id, "kind": job.kind, "queue": job.queue, "state": job.state,
        "attempt": job.attempt, "max_attempts": job.max_attempts, "priority": job.priority,
        "input": jsonable(job.input), "meta": jsonable(job.meta),
        "result": jsonable(job.result), "errors": jsonable(job.errors),
        "partition_key": job.partition_key, "unique_key": job.unique_key,
        "workflow_id": job.workflow_id, "wf_name": job.wf_name, "wf_deps": job.wf_deps,
        "parent_id": job.parent_id, "cron_name": job.cron_name,
        "await_scope": job.await_scope, "await_name": job.await_name,
        "leased_by": job.leased_by, "cancel_requested": job.cancel_requested,
        "budget_usd": job.budget_usd, "budget_tokens": job.budget_tokens,
        "spent_usd": job.spent_usd, "spent_tokens": job.spent_tokens,
        "ready_at": jsonable(job.ready_at), "lease_until": jsonable(job.lease_until),
        "inserted_at": jsonable(job.inserted_at), "started_at": jsonable(job.started_at),
        "finished_at": jsonable(job.finished_at),
    }


def job_line(job: Job) -> dict[str, Any]:
    """The short form a list shows."""
    return {
        "id": job.id, "kind": job.kind, "queue": job.queue, "state": job.state,
        "attempt": job.attempt, "max_attempts": job.max_attempts,
        "workflow_id": job.workflow_id, "wf_name": job.wf_name, "parent_id": job.parent_id,
        "spent_usd": job.spent_usd, "spent_tokens": job.spent_tokens,
        "inserted_at": jsonable(job.inserted_at), "finished_at": jsonable(job.finished_at),
    }


def step_view(step: Step) -> dict[str, Any]:
    return {
        "seq": step.seq, "name": step.name, "value": jsonable(step.value),
        "usd": step.usd, "tokens": step.tokens, "inserted_at": jsonable(step.inserted_at),
    }


def event_view(event: Event) -> dict[str, Any]:
    return {"seq": event.seq, "payload": jsonable(event.payload),
            "inserted_at": jsonable(event.inserted_at)}


def workflow_view(status: WorkflowStatus) -> dict[str, Any]:
    """A workflow's members as a graph: nodes by name, edges from each dependency."""
    members: list[dict[str, Any]] = [
        {"name": job.wf_name, "id": job.id, "kind": job.kind, "state": job.state,
         "deps": list(job.wf_deps), "ignore": list(job.wf_ignore)}
        for job in status.jobs
    ]
    return {
        "workflow_id": status.workflow_id, "total": status.total, "done": status.done,
        "counts": status.state_counts, "jobs": members,
        "edges": [[dep, job.wf_name] for job in status.jobs for dep in job.wf_deps],
    }


#: How much of a job :func:`job_detail` shows: the first steps, the newest
#: events, the first children (each with its total, so a view can say so).
DETAIL_STEPS = 500
DETAIL_EVENTS = 200
DETAIL_CHILDREN = 200


def job_detail(client: Any, job_id: int, *, steps: int = DETAIL_STEPS,
               events: int = DETAIL_EVENTS, children: int = DETAIL_CHILDREN
               ) -> dict[str, Any] | None:
    """A job with its step journal (and the whole journal's cost), events,
    children and workflow; None when there is no such job.

    Bounded, since views poll it: the first ``steps`` journal entries, the
    newest ``events`` events and the first ``children`` children, with
    ``steps_total``, ``events_total`` and ``children_total`` counting all."""
    with client.connection() as conn:
        job = store.get_job(conn, job_id)
        if job is None:
            return None
        journal = store.steps_head(conn, job_id, steps)
        totals = store.step_totals(conn, job_id)
        newest = store.events_tail(conn, job_id, events)
        events_total = store.count_events(conn, job_id)
        kids = store.children_head(conn, job_id, children)
        children_total = store.count_children(conn, job_id)
        members = (store.workflow_jobs(conn, job.workflow_id)
                   if job.workflow_id is not None else None)
    return {
        "job": job_view(job),
        "steps": [step_view(s) for s in journal],
        "steps_total": totals["count"],
        "journal_cost": {"usd": totals["usd_micros"] / 1_000_000, "tokens": totals["tokens"]},
        "events": [event_view(e) for e in newest],
        "events_total": events_total,
        "children": [job_line(kid) for kid in kids],
        "children_total": children_total,
        "workflow": (None if members is None or job.workflow_id is None
                     else workflow_view(WorkflowStatus(job.workflow_id, members))),
    }


def queue_overview(client: Any, cap: int | None = store.STATS_CAP) -> list[dict[str, Any]]:
    """One entry per queue that has jobs or a ``belay_queues`` row: counts by
    state (each stopping at ``cap``: a state over it is listed in ``capped`` and
    its count reads ``cap + 1``; None counts exactly), the cost and tokens of its unfinished jobs,
    jobs finished in the last minute by outcome, and the row's options (limit,
    global_limit, rate, partition, paused)."""
    now = client.now()
    with client.connection() as conn:
        counts = store.queue_stats(conn, cap, cap)
        spend = store.queue_spend_in_flight(conn)
        finished = store.finished_since(conn, now - RATE_WINDOW)
        rows = store.list_queues(conn)
    queues: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return queues.setdefault(name, {
            "queue": name, "counts": dict.fromkeys(STATES, 0), "total": 0,
            "capped": [], "count_cap": cap,
            "spent_usd": 0.0, "spent_tokens": 0,
            "last_minute": {"succeeded": 0, "failed": 0, "cancelled": 0},
            "options": None, "paused": False,
        })

    for row in counts:
        tile = entry(row["queue"])
        tile["counts"][row["state"]] = row["count"]
        tile["total"] += row["count"]
        if cap is not None and row["count"] > cap:
            tile["capped"].append(row["state"])
    for row in spend:
        tile = entry(row["queue"])
        tile["spent_usd"] = row["spent_usd_micros"] / 1_000_000
        tile["spent_tokens"] = row["spent_tokens"]
    for row in finished:
        entry(row["queue"])["last_minute"][row["state"]] = row["count"]
    for name, opts in rows.items():
        tile = entry(name)
        tile["options"] = jsonable({k: v for k, v in opts.items() if k != "paused"})
        tile["paused"] = bool(opts.get("paused"))
    return [queues[name] for name in sorted(queues)]


# -- Arguments ---------------------------------------------------------------------
#
# Every value an operator surface takes from outside (a dashboard query parameter,
# path segment or JSON body field, an MCP tool argument, a mutation's argument) goes
# through these before any SQL runs, each refusal a ValidationError naming the field.

_ASCII_DIGITS = re.compile(r"[0-9]{1,20}")


def shown(value: object) -> str:
    """``value`` for an error message: short, one line, and safe to build for
    anything (a repr of a list nested 2,000 deep would raise RecursionError)."""
    if isinstance(value, str):
        return repr(value[:40] + "…" if len(value) > 40 else value)
    if value is None or isinstance(value, (bool, float)) or (
            isinstance(value, int) and abs(value) < 10**20):
        return repr(value)
    if isinstance(value, int):
        return f"a {value.bit_length()}-bit integer"
    return f"a {type(value).__name__}"


def int_arg(value: object, what: str, *, low: int = 1, high: int = MAX_ID,
            means: str | None = None) -> int:
    """``value`` (an int, or ASCII digits in a str as a query string carries them)
    as an int from ``low`` to ``high``. Refuses booleans, floats and the other
    digits ``str.isdigit()`` accepts (``"²"``, ``"٣"``)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip(" \t\r\n")
        if _ASCII_DIGITS.fullmatch(text):
            number = int(text)
    if number is None or not low <= number <= high:
        raise ValidationError(f"{what} is {means or f'an integer from {low} to {high}'}, "
                              f"got {shown(value)}")
    return number


def id_arg(value: object, what: str = "job_id") -> int:
    """A job id: an integer from 1 to 2**63 - 1 (bigint)."""
    return int_arg(value, what, means=f"a job id (an integer from 1 to {MAX_ID})")


def name_arg(value: object, what: str, *, max_bytes: int = names.MAX_NAME_BYTES) -> str:
    """A name belay stores or filters by: text PostgreSQL can hold (no NUL, no lone
    surrogate), non-empty, at most ``max_bytes`` bytes of UTF-8."""
    return names.check_text(value, what, max_bytes=max_bytes)


def state_arg(value: object, what: str = "state") -> str:
    if not isinstance(value, str) or value not in STATES:
        raise ValidationError(f"unknown {what} {shown(value)}; states are {', '.join(STATES)}")
    return value


def object_arg(value: object, what: str, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A JSON object jsonb can store: str keys, no NUL or lone surrogate in any
    key or string, no NaN or infinity, at most ``max_depth`` levels deep.
    Walked without recursion, so no depth breaks the check itself."""
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} is a JSON object, got {type(value).__name__}")
    stack: list[tuple[object, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, (Mapping, list, tuple)):
            if depth > max_depth:
                raise ValidationError(f"{what} nests deeper than {max_depth} levels (the limit "
                                      "for operator payloads); send a flatter object")
            if isinstance(item, Mapping):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise ValidationError(f"{what}{where} has a key that is not a string: "
                                              f"{shown(key)}")
                    problem = names.text_problem(key)
                    if problem is not None:
                        raise ValidationError(f"{what}{where} has a key that {problem}: "
                                              f"{shown(key)}")
                    stack.append((child, depth + 1, f"{where}[{shown(key)}]"))
            else:
                stack.extend((child, depth + 1, f"{where}[{index}]")
                             for index, child in enumerate(item))
        elif isinstance(item, str):
            problem = names.text_problem(item)
            if problem is not None:
                raise ValidationError(f"{what}{where} {problem}: {shown(item)}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{what}{where} is {item!r}, which JSON cannot represent")
        elif item is not None and not isinstance(item, (bool, int)):
            raise ValidationError(f"{what}{where} is a {type(item).__name__}; JSON has "
                                  "objects, arrays, strings, numbers, booleans and null")
    return dict(value)


def signal_name_arg(value: object, what: str = "name") -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"signal needs {what}, a non-empty string, got {shown(value)}")
    name_arg(value, f"{what} (the signal name)")
    if value.startswith(names.RESERVED_PREFIX):
        raise ValidationError(f"{what}: signal names starting with '$' are reserved for belay "
                              f"({shown(value)}); use steer_job for steering")
    return value


def since_arg(value: object, what: str = "since") -> datetime | timedelta:
    """A moment (ISO 8601 with a zone: ``2026-12-01T00:00:00+00:00``) or, for
    ``since``, a span back from ``until`` as the CLI takes it (``7d``)."""
    if isinstance(value, str):
        text = value.strip()
        if what == "since" and text[-1:] in ("m", "h", "d", "w") and text[:-1].isdigit():
            return parse_span(text)
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            moment = None
        if moment is not None and moment.tzinfo is not None:
            return moment
    spans = " or a span back from until (30m, 24h, 7d, 2w)" if what == "since" else ""
    raise ValidationError(f"{what} is an ISO 8601 time with a zone (like "
                          f"2026-12-01T00:00:00+00:00){spans}, got {shown(value)}")


#: The arguments a spend read takes (``tree`` alone, or the rest).
SPEND_ARGS: Final = ("by", "since", "until", "kind", "queue", "meta", "limit", "tree")


def spend_view(client: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    """A spend report (or, given ``tree``, a job's tree) as JSON-ready data,
    from the arguments an MCP tool or a query string carries."""
    unknown = sorted(set(args) - set(SPEND_ARGS))
    if unknown:
        raise ValidationError(f"unknown argument(s) {', '.join(map(shown, unknown))}; "
                              f"spend takes {', '.join(SPEND_ARGS)}")
    given = {key: value for key, value in args.items() if value is not None}
    if "tree" in given:
        return dict(client.spend_tree(id_arg(given["tree"], "tree")).to_dict())
    by = given.get("by", "kind")
    if not isinstance(by, (str, list, tuple)):
        raise ValidationError(f"by is a dimension or a list of two, got {shown(by)}")
    options: dict[str, Any] = {
        "since": since_arg(given["since"]) if "since" in given else None,
        "until": since_arg(given["until"], "until") if "until" in given else None,
        "meta": object_arg(given["meta"], "meta") if "meta" in given else None,
    }
    for key in ("kind", "queue"):
        if key in given:
            options[key] = name_arg(given[key], key)
    if "limit" in given:
        options["limit"] = int_arg(given["limit"], "limit", high=MAX_SPEND_LIMIT)
    return dict(client.spend(by, **options).to_dict())


# -- Mutations ---------------------------------------------------------------------


def load_authorizer(spec: str) -> Authorizer:
    """``module:callable`` → the callable, imported now; a clear error otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(
            f"an authorizer is given as module:callable (like myapp.guards:authorize), "
            f"got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"authorizer {spec!r}: cannot import {module_name!r}: "
                                 f"{message_of(exc)}") from None
    except Exception as exc:  # the module itself is broken: say so, not a traceback
        raise ConfigurationError(f"authorizer {spec!r}: importing {module_name!r} failed: "
                                 f"{describe(exc)}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigurationError(f"authorizer {spec!r}: {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ConfigurationError(f"authorizer {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Guard:
    """Who may mutate: nobody (the default), everybody (``allow``), or whoever
    ``authorizer`` lets through."""

    allow: bool = False
    authorizer: Authorizer | None = None

    @property
    def read_only(self) -> bool:
        return not self.allow and self.authorizer is None

    def check(self, tool: str, args: dict[str, Any], job: Job | None = None) -> None:
        """Return if ``tool`` may run with ``args``; raise :class:`Refused` if not.
        An authorizer that takes an ``authority`` keyword also gets the
        authority of the job the mutation is for (None: it has none)."""
        if self.authorizer is not None:
            try:
                if _takes_authority(self.authorizer):
                    verdict = self.authorizer(
                        tool, dict(args), authority=None if job is None else authority_of(job.meta))
                else:
                    verdict = self.authorizer(tool, dict(args))
            except Exception as exc:
                raise Refused(f"{tool} refused by the authorizer: {message_of(exc)}") from None
            if verdict is None or verdict is True:
                return
            reason = verdict if isinstance(verdict, str) and verdict else "not authorized"
            raise Refused(f"{tool} refused by the authorizer: {reason}")
        if self.allow:
            return
        raise Refused(
            f"{tool} is refused: mutations are disabled. Start with --allow-mutations "
            "(a trusted local client) or --authorizer module:callable"
        )


def _takes_authority(authorizer: Authorizer) -> bool:
    """Whether ``authorizer`` has an ``authority`` keyword (or ``**kwargs``)."""
    try:
        params = inspect.signature(authorizer).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any((p.name == "authority" and p.kind is not p.POSITIONAL_ONLY)
               or p.kind is p.VAR_KEYWORD for p in params)


def mutate(client: Any, guard: Guard, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Run one of :data:`MUTATIONS` after ``guard`` allows it; returns what
    happened as JSON-ready data. Bad arguments (an unknown one, a bad id, a
    signal name or payload PostgreSQL can't store) raise ValidationError
    before any SQL runs and before the guard is asked."""
    if not isinstance(tool, str) or tool not in MUTATIONS:
        raise ValidationError(f"unknown mutation {shown(tool)}; mutations are "
                              f"{', '.join(MUTATIONS)}")
    if not isinstance(args, Mapping):
        raise ValidationError(f"{tool}'s arguments are a JSON object, got {type(args).__name__}")
    takes = MUTATION_ARGS[tool]
    unknown = sorted(shown(key) for key in args if key not in takes)
    if unknown:
        raise ValidationError(f"{tool} takes {', '.join(takes)}; unknown argument(s) "
                              f"{', '.join(unknown)}")
    if tool in ("schedule", "cancel_schedule"):
        return _schedule_mutation(client, guard, tool, args)
    job_id = id_arg(args.get("job_id"), "job_id")
    if tool == "signal":
        name = signal_name_arg(args.get("name"))
        raw = args.get("payload")
        if raw is not None and not isinstance(raw, Mapping):
            raise ValidationError(f"a signal payload is a JSON object, got {shown(raw)}")
        payload = object_arg({} if raw is None else raw, "payload")
        guard.check(tool, {"job_id": job_id, "name": name, "payload": payload},
                    _exists(client, job_id))
        woken = client.signal_job(job_id, name, payload)
        return {"job_id": job_id, "signal": name, "woken": woken}
    if tool == "steer_job":
        raw = args.get("payload")
        if not isinstance(raw, Mapping):
            raise ValidationError(f"steering is a JSON object like {{\"instruction\": \"…\"}} "
                                  f"in payload, got {shown(raw)}")
        payload = object_arg(raw, "payload")
        guard.check(tool, {"job_id": job_id, "payload": payload}, _exists(client, job_id))
        woken = client.steer_job(job_id, payload)
        return {"job_id": job_id, "steered": True, "woken": woken}
    if tool == "top_up":
        usd, tokens = args.get("usd"), args.get("tokens")
        check_top_up(usd, tokens)
        key = check_top_up_key(args.get("idempotency_key"))
        asked = {"job_id": job_id, "usd": usd, "tokens": tokens}
        if key is not None:  # the authorizer sees the key only when one is sent
            asked["idempotency_key"] = key
        guard.check(tool, asked, _exists(client, job_id))
        job, resumed = client._top_up(job_id, usd, tokens, idempotency_key=key)
        # duplicate: the key was used already, nothing changed; resumed is the first answer's.
        return {"job_id": job_id, "resumed": resumed, "duplicate": job.duplicate,
                "job": job_view(job)}
    guard.check(tool, {"job_id": job_id},
                _exists(client, job_id) if _takes(guard) else None)
    if tool == "cancel_job":
        return {"job_id": job_id, "status": client.cancel_job(job_id)}
    return {"job_id": job_id, "job": job_view(client.retry_job(job_id))}


def _schedule_mutation(client: Any, guard: Guard, tool: str, args: Mapping[str, Any]
                       ) -> dict[str, Any]:
    """``schedule`` (declare) or ``cancel_schedule``, checked before the guard is asked."""
    from belay.schedules import declare

    name = name_arg(args.get("name"), "name")
    if tool == "cancel_schedule":
        guard.check(tool, {"name": name})
        if not client.cancel_schedule(name):
            raise ValidationError(f"no live schedule {name!r} to cancel")
        return {"schedule": client.schedule_status(name).to_dict()}
    options = args.get("options") or {}
    if not isinstance(options, Mapping):
        raise ValidationError(f"options is a JSON object of enqueue options, got "
                              f"{shown(options)}")
    raw_input = args.get("input")
    if raw_input is not None and not isinstance(raw_input, Mapping):
        raise ValidationError(f"input is a JSON object, got {shown(raw_input)}")
    enqueue_options: dict[str, Any] = object_arg(options, "options")
    checked = {
        "name": name, "expression": args.get("expression"), "worker": args.get("worker"),
        "input": object_arg(raw_input or {}, "input"),
        "overlap": args.get("overlap") or "skip", "catch_up": args.get("catch_up") or "latest",
        "options": enqueue_options,
    }
    declare(name, checked["expression"], checked["worker"], checked["input"],
            overlap=checked["overlap"], catch_up=checked["catch_up"], options=enqueue_options)
    guard.check(tool, checked)
    declared = client.schedule(name, checked["expression"], checked["worker"],
                               checked["input"], overlap=checked["overlap"],
                               catch_up=checked["catch_up"], **enqueue_options)
    return {"schedule": declared.to_dict()}


def _exists(client: Any, job_id: int) -> Job:
    """The job a mutation is for. The client stores a signal for any scope;
    for a job that isn't there, every surface answers not found instead."""
    job = client.get_job(job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job  # type: ignore[no-any-return]


def _takes(guard: Guard) -> bool:
    return guard.authorizer is not None and _takes_authority(guard.authorizer)


def cron_view(cron: Any) -> dict[str, Any]:
    """A :class:`belay.cron.DynamicCron` as JSON-ready data."""
    return {"name": cron.name, "expression": cron.expression, "worker": cron.worker,
            "input": jsonable(cron.input), "options": jsonable(cron.options),
            "paused": cron.paused, "updated_at": jsonable(cron.updated_at)}
