"""Turning an enqueue request into a ``belay_jobs`` row: pure, no I/O.

Every check runs here, before any SQL, so bad input is refused with a clear
message and nothing is written (a batch is all-or-nothing at this stage).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any, Final, Literal, NamedTuple

from belay import names
from belay.authority import AUTHORITY_KEY, Authority
from belay.budget import BUDGET_KEYS, POLICY_KEY, parse_policy
from belay.codec import dumps, dumps_object, loads
from belay.errors import ValidationError
from belay.otel import TRACE_KEY
from belay.watchdog import WATCHDOG_KEY, parse_watchdog

UniqueMode = Literal["incomplete", "window", "always"]
UNIQUE_MODES: Final = ("incomplete", "window", "always")
DEFAULT_QUEUE: Final = "default"
DEFAULT_MAX_ATTEMPTS: Final = 20
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Unique:
    """A uniqueness rule (§5.2).

    ``incomplete``: one live job per key; ``window``: one job per key per
    ``window``-second bucket, whatever its outcome; ``always``: one job per key, ever.
    """

    key: str
    mode: UniqueMode = "incomplete"
    window: int | None = None


@dataclass(frozen=True)
class JobSpec:
    """One job to enqueue; ``belay.enqueue_many`` takes a list of these (or dicts)."""

    kind: Any
    input: Mapping[str, Any] | None = None
    queue: str | None = None
    priority: int | None = None
    delay: float | timedelta | None = None
    run_at: datetime | None = None
    max_attempts: int | None = None
    unique: str | Unique | Mapping[str, Any] | None = None
    budget: Mapping[str, Any] | None = None
    meta: Mapping[str, Any] | None = None
    partition_key: str | None = None
    encrypt: bool | None = None
    watchdog: Mapping[str, Any] | None = None
    authority: Mapping[str, Any] | None = None
    # Set by belay itself (workflows, children, cron), not by enqueue callers.
    internal: Mapping[str, Any] = field(default_factory=dict, repr=False)


SPEC_FIELDS: Final = frozenset(
    ("kind", "input", "queue", "priority", "delay", "run_at", "max_attempts", "unique",
     "budget", "meta", "partition_key", "encrypt", "watchdog", "authority")
)
_SPEC_DEFAULTS: Final = {name: None for name in SPEC_FIELDS}
_INTERNAL_FIELDS: Final = frozenset(
    ("state", "workflow_id", "wf_name", "wf_deps", "wf_ignore", "cron_name", "cron_slot",
     "parent_id", "unique_key", "unique_mode")
)


class Row(NamedTuple):
    """The values one new ``belay_jobs`` row gets; JSON fields already serialized.
    (A named tuple: a batch of 1,000 builds 1,000 of them.) The field order
    is the parameter order of the ``insert_job`` statement."""

    kind: str
    queue: str
    state: str
    input: str
    meta: str
    priority: int
    max_attempts: int
    partition_key: str | None
    ready_at: datetime
    workflow_id: str | None
    wf_name: str | None
    wf_deps: str
    wf_ignore: str
    cron_name: str | None
    cron_slot: datetime | None
    unique_key: str | None
    unique_mode: str | None
    parent_id: int | None
    budget_usd_micros: int | None
    budget_tokens: int | None

    def identity(self) -> tuple[Any, ...]:
        """What tells this row apart from others that might be skipped on conflict."""
        return (self.kind, self.queue, self.unique_key, self.unique_mode, self.cron_name,
                self.cron_slot)


def spec_from(item: JobSpec | Mapping[str, Any]) -> JobSpec:
    """Accept a JobSpec or a dict with the same keys (unknown keys are refused)."""
    if isinstance(item, JobSpec):
        return item
    if not isinstance(item, Mapping):
        raise ValidationError(
            f"enqueue_many takes belay.JobSpec objects or dicts, got {type(item).__name__}"
        )
    unknown = sorted(set(item) - SPEC_FIELDS)
    if unknown:
        raise ValidationError(
            f"unknown enqueue option(s) {', '.join(map(repr, unknown))}; "
            f"known options: {', '.join(sorted(SPEC_FIELDS))}"
        )
    if "kind" not in item:
        raise ValidationError("each job needs a 'kind' (the worker name)")
    # What JobSpec(**item) makes, without the frozen dataclass's slow __init__
    # (a batch of 1,000 dicts makes 1,000 of these).
    spec = object.__new__(JobSpec)
    spec.__dict__.update(_SPEC_DEFAULTS, internal={})
    spec.__dict__.update(item)
    return spec


#: Kind and queue names already checked (bounded: a name is checked again
#: once the set is full). Validation is the bulk of an enqueue's Python.
_CHECKED: set[str] = set()
_CHECKED_MAX: Final = 4096


def kind_of(kind: Any) -> tuple[str, Mapping[str, Any]]:
    """A kind is a registry name, or a worker object carrying ``kind`` and its defaults."""
    defaults: Mapping[str, Any] = {}
    name: Any = kind
    if not isinstance(kind, str):
        name = getattr(kind, "kind", None)
        defaults = getattr(kind, "enqueue_defaults", None) or {}
        if not isinstance(name, str):
            raise ValidationError(
                f"kind must be a worker name (str) or a belay worker, got {type(kind).__name__}"
            )
    if name in _CHECKED:
        return name, defaults
    if not name.strip():
        raise ValidationError("kind must be a non-empty worker name")
    names.check_text(name, "kind")
    if len(_CHECKED) < _CHECKED_MAX:
        _CHECKED.add(name)
    return name, defaults


def _checked(name: Any, what: str) -> None:
    if type(name) is str and name in _CHECKED:
        return
    if not isinstance(name, str) or not name.strip():
        raise ValidationError(f"{what} must be a non-empty string, got {name!r}")
    names.check_text(name, what)
    if len(_CHECKED) < _CHECKED_MAX:
        _CHECKED.add(name)


def build_row(spec: JobSpec, now: datetime, definition: Any = None,
              parent: tuple[Authority, str] | None = None) -> Row:
    """Validate one request and produce its row (§5.1 defaults; ``now`` from the
    clock). ``definition`` is the registered worker a string kind names, if any:
    its enqueue defaults apply. ``parent``: the authority of the job this
    request comes from, and its name for messages (:mod:`belay.authority`)."""
    kind, defaults = kind_of(spec.kind if definition is None else definition)
    if defaults:
        def opt(name: str, fallback: Any) -> Any:
            value = getattr(spec, name)
            return defaults.get(name, fallback) if value is None else value
    else:
        def opt(name: str, fallback: Any) -> Any:
            value = getattr(spec, name)
            return fallback if value is None else value

    internal = spec.internal
    if internal:
        stray = sorted(set(internal) - _INTERNAL_FIELDS)
        if stray:
            raise ValidationError(f"unknown internal enqueue field(s): {', '.join(stray)}")

    queue = opt("queue", DEFAULT_QUEUE)
    _checked(queue, "queue")

    priority = _int("priority", opt("priority", 0), *_INT32)
    max_attempts = _int("max_attempts", opt("max_attempts", DEFAULT_MAX_ATTEMPTS), 1, _INT32[1])
    ready_at = now if spec.delay is None and spec.run_at is None else _ready_at(
        spec.delay, spec.run_at, now)
    if "unique_key" in internal:
        # belay's own keys (§8.4 spawn keys) are reserved names: set, not validated.
        unique_key, unique_mode = internal["unique_key"], internal["unique_mode"]
    else:
        unique_key, unique_mode = _unique(opt("unique", None), now)
    budget_usd_micros, budget_tokens, policy = _budget(opt("budget", None))

    partition_key = spec.partition_key
    if partition_key is not None:
        names.check_text(partition_key, "partition_key", max_bytes=names.MAX_KEY_BYTES,
                         empty=True)

    state = internal.get("state", "ready")
    if state not in ("ready", "held"):
        raise ValidationError(f"new jobs start ready or held, not {state!r}")

    input_ = spec.input if spec.input is not None else {}
    meta = spec.meta if spec.meta is not None else defaults.get("meta", {})
    watch = parse_watchdog(opt("watchdog", None))
    granted = _authority(opt("authority", None), meta, parent)
    if granted is not None:
        budget_usd_micros, budget_tokens = _capped(granted, parent, kind, queue,
                                                   budget_usd_micros, budget_tokens)
    if policy is not None or watch is not None or granted is not None:
        if not isinstance(meta, Mapping):
            raise ValidationError(f"meta must be a dict, got {type(meta).__name__}")
        meta = dict(meta)
        if policy is not None:
            meta[POLICY_KEY] = policy
        if watch is not None:
            meta[WATCHDOG_KEY] = watch.to_meta()
        if granted is not None:
            meta[AUTHORITY_KEY] = granted.to_meta()
    deps, ignore = internal.get("wf_deps"), internal.get("wf_ignore")

    return Row(
        kind,
        queue,
        state,
        dumps_object(input_, what="input").decode(),
        "{}" if type(meta) is dict and not meta else dumps_object(meta, what="meta").decode(),
        priority,
        max_attempts,
        partition_key,
        ready_at,
        internal.get("workflow_id"),
        internal.get("wf_name"),
        "[]" if not deps else dumps(list(deps)).decode(),
        "[]" if not ignore else dumps(list(ignore)).decode(),
        internal.get("cron_name"),
        internal.get("cron_slot"),
        unique_key,
        unique_mode,
        internal.get("parent_id"),
        budget_usd_micros,
        budget_tokens,
    )


def with_trace(row: Row, trace: Mapping[str, str]) -> Row:
    """``row`` with the enqueue's W3C trace context in its meta (:mod:`belay.otel`);
    a context the meta already carries (a job enqueued again from another's) is kept."""
    meta = {} if row.meta == "{}" else loads(row.meta)
    if TRACE_KEY in meta:
        return row
    meta[TRACE_KEY] = dict(trace)
    return row._replace(meta=dumps(meta).decode())


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValidationError(f"{name} must be between {low} and {high}, got {value}")
    return value


def as_utc(name: str, value: Any) -> datetime:
    """``value``, a timezone-aware datetime, in UTC; a ValidationError naming ``name`` else."""
    if not isinstance(value, datetime):
        raise ValidationError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError(
            f"{name} must be timezone-aware (e.g. datetime.now(timezone.utc)); "
            f"a naive datetime is ambiguous: {value!r}"
        )
    return value.astimezone(timezone.utc)


def _ready_at(delay: Any, run_at: Any, now: datetime) -> datetime:
    if delay is not None and run_at is not None:
        raise ValidationError("give delay or run_at, not both")
    if run_at is not None:
        return as_utc("run_at", run_at)
    if delay is None:
        return now
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()  # exact to the microsecond, finite for any timedelta
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise ValidationError(f"delay must be seconds or a timedelta, got {delay!r}")
    return now + timedelta(seconds=check_seconds("delay", seconds, original=delay))


MAX_DELAY_SECONDS: Final = 100 * 365 * 86_400
"""The longest delay (and durable sleep or snooze) belay takes: 100 years."""


def check_seconds(
    name: str, seconds: float, *, original: Any = None, maximum: float = MAX_DELAY_SECONDS
) -> float:
    """``seconds`` if it is a finite number of seconds in ``0..maximum``; a
    ValidationError naming ``name`` otherwise (a datetime overflow is no error
    a caller can act on)."""
    shown = seconds if original is None else original
    if not seconds >= 0 or seconds == float("inf"):
        raise ValidationError(f"{name} must be a finite number of seconds >= 0, got {shown!r}")
    if seconds > maximum:
        raise ValidationError(
            f"{name} must be at most {maximum:,.0f} seconds (100 years), got {shown!r}; "
            "for a fixed moment give run_at"
        )
    return seconds


def check_unique(unique: Any) -> None:
    """Raise ValidationError unless ``unique`` is a usable uniqueness rule."""
    _unique(unique, datetime.now(timezone.utc))


def _unique(unique: Any, now: datetime) -> tuple[str | None, str | None]:
    if unique is None:
        return None, None
    if isinstance(unique, str):
        unique = Unique(unique)
    elif isinstance(unique, Mapping):
        unknown = sorted(set(unique) - {"key", "mode", "window"})
        if unknown:
            raise ValidationError(
                f"unknown unique option(s) {', '.join(map(repr, unknown))}; use key, mode, window"
            )
        if "key" not in unique:
            raise ValidationError("unique needs a 'key'")
        unique = Unique(**unique)
    elif not isinstance(unique, Unique):
        raise ValidationError(
            f"unique must be a key (str), a belay.Unique or a dict, got {type(unique).__name__}"
        )
    key, mode, window = unique.key, unique.mode, unique.window
    if not isinstance(key, str) or not key:
        raise ValidationError(f"unique key must be a non-empty string, got {key!r}")
    names.check_text(key, "unique key", max_bytes=names.MAX_KEY_BYTES, empty=True)
    if key.startswith(names.RESERVED_PREFIX):
        raise ValidationError(f"unique keys starting with '$' are reserved for belay: {key!r}")
    if mode not in UNIQUE_MODES:
        raise ValidationError(
            f"unique mode must be one of {', '.join(UNIQUE_MODES)}, got {mode!r}"
        )
    if mode == "always" and names.looks_windowed(key):
        # 'window' and 'always' keys share one unique index (§5.2), and a window
        # key is stored as <key>@<bucket>: an 'always' key of that shape would
        # capture a window key of another job.
        raise ValidationError(
            f"unique key {key!r} ends in '@<digits>', the form of a window key's bucket; "
            "with mode 'always' it would collide with mode 'window' keys: change the "
            "suffix (e.g. '#' instead of '@')"
        )
    if mode == "window":
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValidationError(
                f"unique mode 'window' needs window=<seconds>, a positive integer; got {window!r}"
            )
        return names.window_key(key, int(now.timestamp()), window), mode
    if window is not None:
        raise ValidationError(f"window only applies to unique mode 'window', not {mode!r}")
    return key, mode


def _authority(asked: Any, meta: Any, parent: tuple[Authority, str] | None
               ) -> Authority | None:
    """The authority a new job gets: what it asks for (``authority=``, or a
    ``$authority`` already in its meta), narrowed from its parent's."""
    if isinstance(meta, Mapping) and AUTHORITY_KEY in meta:
        if asked is not None:
            raise ValidationError(f"give the authority once: authority= or meta "
                                  f"{AUTHORITY_KEY!r}, not both")
        asked = meta[AUTHORITY_KEY]
    wanted = None if asked is None else Authority.parse(asked)
    if parent is None:
        return wanted
    return parent[0].narrowed(wanted, parent[1])


def _capped(granted: Authority, parent: tuple[Authority, str] | None, kind: str, queue: str,
            usd_micros: int | None, tokens: int | None) -> tuple[int | None, int | None]:
    """The budget of a job with an authority: its caps where it gave none,
    checked against them (and the parent's queue and worker bounds)."""
    if usd_micros is None:
        usd_micros = granted.usd_micros
    if tokens is None:
        tokens = granted.tokens
    granted.check_budget(usd_micros, tokens, "this job")
    if parent is not None:
        parent[0].check_job(queue=queue, kind=kind, usd_micros=usd_micros, tokens=tokens,
                            whose=parent[1])
    return usd_micros, tokens


def _budget(budget: Any) -> tuple[int | None, int | None, dict[str, Any] | None]:
    """The caps of an enqueue's ``budget=`` and its policy's ``meta`` entry
    (None for the default policy: fail at the crossing, warn at 50 % and 80 %)."""
    if budget is None:
        return None, None, None
    if not isinstance(budget, Mapping):
        raise ValidationError(
            f"budget must be a dict like {{'usd': 1.5, 'tokens': 20000}}, got {budget!r}"
        )
    unknown = sorted(set(budget) - set(BUDGET_KEYS))
    if unknown:
        raise ValidationError(
            f"unknown budget key(s) {', '.join(map(repr, unknown))}; use "
            f"{', '.join(map(repr, BUDGET_KEYS))}"
        )
    usd, tokens = budget.get("usd"), budget.get("tokens")
    policy = parse_policy(budget, has_cap=usd is not None or tokens is not None)
    return (None if usd is None else usd_to_micros(usd, what="budget usd"),
            None if tokens is None else _int("budget tokens", tokens, 0, _INT64[1]),
            policy.to_meta())


def usd_to_micros(usd: Any, *, what: str) -> int:
    """Dollars to integer micro-dollars (§2), exactly: 0.1 is 100_000, not 99_999."""
    if isinstance(usd, bool) or not isinstance(usd, (int, float, Decimal)):
        raise ValidationError(f"{what} must be a number of dollars, got {usd!r}")
    try:
        micros = (Decimal(str(usd)) * 1_000_000).to_integral_value(ROUND_HALF_EVEN)
    except InvalidOperation:
        raise ValidationError(f"{what} must be a finite number, got {usd!r}") from None
    if not micros.is_finite() or micros < 0:
        raise ValidationError(f"{what} must be a finite number >= 0, got {usd!r}")
    if micros > _INT64[1]:
        raise ValidationError(f"{what} is too large: {usd!r}")
    return int(micros)
