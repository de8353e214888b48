"""Cron (contract §8.5): minute slots, cron entries, and a leaderless scheduler.

Every node runs a :class:`CronScheduler`. On each tick it works out which UTC
minute slots are due and inserts one job per (entry, slot) with ``cron_name``
and ``cron_slot`` set; the unique index ``belay_jobs_cron_slot_idx`` turns every
node's insert of the same slot into one row, so each slot fires exactly once
cluster-wide with no leader to elect. Entries come from the Worker's static
config merged with the ``belay_crons`` rows (a row overrides the static entry
of its name; a paused row silences it).

Missed-slot policy
------------------

* A running scheduler fires every matching slot since its previous
  successful tick, so a late tick (a slow database, a GC pause, an interval
  longer than a minute) skips nothing — but it looks back at most
  :data:`LOOKBACK` (10 minutes), so a host waking from suspend does not burst.
* A scheduler's first tick (a node starting after downtime) fires only the
  current minute's slot: slots missed while no node ran are skipped, as
  cron(8) does — unless the entry sets ``catch_up=<seconds>``; then the
  single most recent missed slot that began at most that long ago fires too
  (once cluster-wide, like any slot). ``catch_up`` is capped at one day
  (:data:`MAX_CATCH_UP`): retention prunes a succeeded job after a day, and a
  slot whose job is gone could otherwise fire a second time.

The expression parser is croniter, imported on first use (``pip install
'belay[cron]'``), so ``import belay`` works without it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final

from belay import names, store
from belay.codec import dumps_object
from belay.enqueue import JobSpec, Row, as_utc, build_row, kind_of
from belay.errors import BelayError, ConfigurationError, ValidationError
from belay.job import Job
from belay.parts.service import Service
from belay.registry import Registry, WorkerDef

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.schedules import Declaration

log = logging.getLogger("belay.cron")

MINUTE: Final = timedelta(minutes=1)
#: How far back a running scheduler fires the slots it missed.
LOOKBACK: Final = timedelta(minutes=10)
#: The largest ``catch_up`` (seconds): one day, the default retention of succeeded jobs.
MAX_CATCH_UP: Final = 86_400
EXAMPLE: Final = '"0 8 * * 1-5" (08:00 UTC, Monday to Friday)'

ALIASES: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
FIELDS: Final = ("minute", "hour", "day-of-month", "month", "day-of-week")
# One comma-separated item of a standard field: *, n, or a name; an optional
# range end; an optional step. croniter's extensions (L, W, #, ?, H) are refused.
_ITEM = re.compile(r"(\*|\d+|[a-z]{3})(-(\d+|[a-z]{3}))?(/\d+)?", re.IGNORECASE)
_NAMED_FIELDS: Final = frozenset(("month", "day-of-week"))
_MICROSECOND = timedelta(microseconds=1)
# A fixed instant to validate against: parsing never depends on the clock.
_ANCHOR = datetime(2000, 1, 1, tzinfo=timezone.utc)

#: Enqueue options a cron entry takes (what ``Belay.enqueue`` does, less scheduling).
OPTIONS: Final = ("queue", "priority", "max_attempts", "meta", "budget", "partition_key",
                  "encrypt")
#: The options a ``belay_crons`` row carries: the ones the Elixir reference reads back.
ROW_OPTIONS: Final = ("queue", "priority", "max_attempts", "meta", "partition_key")
_REFUSED: Final = {
    "unique": "a cron job is deduplicated by its slot (cron_name, cron_slot), so unique= "
              "does not apply (a worker's own unique= rule still does)",
    "delay": "a cron job is due at its slot; change the expression instead",
    "run_at": "a cron job is due at its slot; change the expression instead",
}
_STATIC_KEYS: Final = ("name", "expression", "worker", "input", "catch_up", "paused", "overlap",
                       *OPTIONS)


def _croniter() -> Any:
    try:
        import croniter
    except ImportError:
        raise ConfigurationError(
            "cron expressions need the croniter package: pip install 'belay[cron]'"
        ) from None
    return croniter


# -- Slots and expressions (pure) ---------------------------------------------------


def slot(now: datetime) -> datetime:
    """The UTC minute holding ``now``: seconds and microseconds zeroed (§8.5)."""
    return as_utc("now", now).replace(second=0, microsecond=0, fold=0)


@dataclass(frozen=True)
class CronExpr:
    """A parsed five-field cron expression, evaluated in UTC. Make one with :func:`parse`."""

    #: As written (whitespace normalized); what ``belay_crons.expression`` stores.
    source: str
    #: The five fields, aliases expanded.
    spec: str

    def matches(self, when: datetime) -> bool:
        """Does the minute slot holding ``when`` match?"""
        return bool(_croniter().croniter.match(self.spec, slot(when)))

    def __str__(self) -> str:
        return self.source


def parse(expression: str | CronExpr) -> CronExpr:
    """Parse a standard five-field UTC cron expression (``minute hour day-of-month
    month day-of-week``) or an alias (``@hourly``, ``@daily``, ``@weekly``,
    ``@monthly``, ``@yearly``); refuse anything else with a :class:`ValidationError`."""
    if isinstance(expression, CronExpr):
        return expression
    if not isinstance(expression, str):
        raise ValidationError(
            f"a cron expression is a string like {EXAMPLE}, got {type(expression).__name__}"
        )
    source = " ".join(expression.split())
    if not source:
        raise ValidationError(f"the cron expression is empty; write five fields, e.g. {EXAMPLE}")
    if source.startswith("@"):
        spec = ALIASES.get(source.lower())
        if spec is None:
            raise ValidationError(
                f"unknown cron alias {source!r}: belay knows {', '.join(ALIASES)}; "
                f"or write five fields, e.g. {EXAMPLE}"
            )
    else:
        spec = source
    fields = spec.split(" ")
    if len(fields) in (6, 7):
        raise ValidationError(
            f"cron expression {source!r} has {len(fields)} fields: belay fires at most once "
            "a minute and takes the standard five (minute hour day-of-month month "
            f"day-of-week), with no seconds or year field; e.g. {EXAMPLE}"
        )
    if len(fields) != 5:
        raise ValidationError(
            f"cron expression {source!r} has {len(fields)} field(s), expected five "
            f"(minute hour day-of-month month day-of-week); e.g. {EXAMPLE}"
        )
    for name, text in zip(FIELDS, fields, strict=True):
        _check_field(source, name, text)
    croniter = _croniter()
    try:
        # Raises on out-of-range values; get_next proves the expression ever fires.
        croniter.croniter(spec, _ANCHOR).get_next(datetime)
    except croniter.CroniterBadDateError:
        raise ValidationError(
            f"cron expression {source!r} never matches a real date (like 30 February); "
            f"e.g. {EXAMPLE}"
        ) from None
    except (croniter.CroniterError, ValueError, KeyError, IndexError) as exc:
        raise ValidationError(
            f"invalid cron expression {source!r}: {exc}; e.g. {EXAMPLE}"
        ) from None
    return CronExpr(source, spec)


def _check_field(source: str, name: str, text: str) -> None:
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValidationError(
                f"cron expression {source!r}: {name} field {text!r} is not standard cron "
                "(use *, numbers, ranges a-b, steps /n and lists a,b); "
                f"e.g. {EXAMPLE}"
            )
        named = [part for part in (match.group(1), match.group(3)) if part and part.isalpha()]
        if named and name not in _NAMED_FIELDS:
            raise ValidationError(
                f"cron expression {source!r}: names like {named[0]!r} are allowed only in "
                f"the month and day-of-week fields, not {name}; e.g. {EXAMPLE}"
            )


def due_slots(expr: CronExpr, after: datetime, until: datetime,
              limit: int | None = None) -> list[datetime]:
    """The minute slots ``expr`` matches in ``(after, until]``, in order (UTC);
    the first ``limit`` of them when given."""
    after, until = as_utc("after", after), as_utc("until", until)
    found: list[datetime] = []
    if until <= after:
        return found
    schedule = _croniter().croniter(expr.spec, after)
    while limit is None or len(found) < limit:
        candidate = slot(schedule.get_next(datetime))
        if candidate > until:
            return found
        found.append(candidate)
    return found


def latest_slot(expr: CronExpr, until: datetime) -> datetime:
    """The latest minute slot ``expr`` matches at or before ``until``."""
    start = slot(until) + _MICROSECOND
    return slot(_croniter().croniter(expr.spec, start).get_prev(datetime))


def slots_to_fire(
    expr: CronExpr, now: datetime, previous: datetime | None, catch_up: float = 0.0
) -> list[datetime]:
    """The missed-slot policy (module docstring) for one entry, in slot order.

    ``previous`` is the slot of this scheduler's previous successful tick, None
    on its first; ``catch_up`` is the entry's catch-up window in seconds.
    """
    current = slot(now)
    # Slots in (lower, current] are due: just this minute's on a first tick,
    # else all since the previous tick, at most LOOKBACK back.
    lower = current - MINUTE if previous is None else max(slot(previous), current - LOOKBACK)
    fired = due_slots(expr, lower, current)
    if catch_up > 0:
        # Missed: matching slots in (previous, lower] (no previous: all before
        # lower); the most recent one fires if it began within catch_up.
        earliest = now - timedelta(seconds=catch_up)
        if previous is not None:
            earliest = max(earliest, slot(previous) + MINUTE)
        if earliest <= lower:
            missed = latest_slot(expr, lower)
            if missed >= earliest:
                fired.insert(0, missed)
    return fired


# -- Entries -------------------------------------------------------------------------


@dataclass(frozen=True)
class CronEntry:
    """One cron: fire ``worker`` with ``input`` at every slot ``expression`` matches.

    ``worker`` is a kind (str) or a :class:`belay.WorkerDef`; ``options`` are
    enqueue options (queue, priority, max_attempts, meta, budget,
    partition_key, encrypt); ``catch_up`` (seconds, at most a day) lets a
    starting scheduler fire the most recent slot missed within it.
    Validated on construction (:class:`belay.ConfigurationError`).
    """

    name: str
    expression: CronExpr
    worker: str | WorkerDef
    input: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    catch_up: float = 0.0
    paused: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigurationError(f"a cron needs a name (a non-empty string), got {self.name!r}")
        label = f"cron {self.name!r}"
        try:
            object.__setattr__(self, "expression", parse(self.expression))
            kind_of(self.worker)
        except ValidationError as exc:
            raise ConfigurationError(f"{label}: {exc}") from None
        check_option_names(label, self.options, OPTIONS, ConfigurationError)
        catch_up = self.catch_up
        if isinstance(catch_up, timedelta):
            catch_up = catch_up.total_seconds()
        if (isinstance(catch_up, bool) or not isinstance(catch_up, (int, float))
                or not 0 <= catch_up <= MAX_CATCH_UP):
            raise ConfigurationError(
                f"{label}: catch_up is the seconds within which a missed slot still fires, "
                f"from 0 to {MAX_CATCH_UP} (one day: older slots may have been pruned by "
                f"retention and would fire twice); got {self.catch_up!r}"
            )
        object.__setattr__(self, "catch_up", float(catch_up))
        if not isinstance(self.paused, bool):
            raise ConfigurationError(f"{label}: paused must be True or False")
        input_ = self.input if self.input is not None else {}
        object.__setattr__(self, "input", input_)
        object.__setattr__(self, "options", dict(self.options))
        try:
            check_values(self.worker, input_, self.options)
        except ValidationError as exc:
            raise ConfigurationError(f"{label}: {exc}") from None

    @property
    def kind(self) -> str:
        return kind_of(self.worker)[0]


def check_option_names(
    label: str, options: Any, allowed: Sequence[str], error: type[BelayError],
    advice: Mapping[str, str] | None = None,
) -> None:
    if not isinstance(options, Mapping):
        raise error(f"{label}: options must be a dict of enqueue options, got {options!r}")
    for key in options:
        if key in _REFUSED:
            raise error(f"{label}: {key}= is not a cron option: {_REFUSED[key]}")
        if advice is not None and key in advice:
            raise error(f"{label}: {key}= {advice[key]}")
        if key not in allowed:
            raise error(
                f"{label}: unknown option {key!r}; cron options are {', '.join(allowed)}"
            )


def check_values(worker: Any, input: Any, options: Mapping[str, Any]) -> Row:
    """Build the row a slot would insert, to refuse bad values before any tick."""
    return build_row(JobSpec(worker, input, **options), _ANCHOR)


def entries_from_config(entries: Iterable[CronEntry | Mapping[str, Any]]) -> list[CronEntry]:
    """Validate static crons given as dicts (or CronEntry objects).

    ``{"name": "digest", "expression": "0 8 * * 1-5", "worker": send_digest,
    "input": {...}, "queue": ..., "priority": ..., "catch_up": 600}``; every
    problem raises :class:`belay.ConfigurationError` naming the entry. An
    entry with an ``overlap``, or a ``catch_up`` of ``"latest"`` or ``"all"``,
    is a schedule (:func:`split_config`), not a cron.
    """
    crons, _schedules = split_config(entries)
    return crons


def split_config(entries: Iterable[CronEntry | Mapping[str, Any]]
                 ) -> tuple[list[CronEntry], list[Declaration]]:
    """Static crons, and static schedules (:mod:`belay.schedules`), validated."""
    if isinstance(entries, (str, bytes, Mapping)):
        raise ConfigurationError(
            "crons= takes a list of cron dicts like "
            '[{"name": "digest", "expression": "0 8 * * 1-5", "worker": send_digest}]'
        )
    found: list[CronEntry] = []
    declared: list[Declaration] = []
    seen: set[str] = set()
    for position, item in enumerate(entries):
        entry: CronEntry | Declaration
        if isinstance(item, CronEntry):
            entry = item
        elif isinstance(item, Mapping) and _is_schedule(item):
            entry = _schedule_from_dict(position, item)
        elif isinstance(item, Mapping):
            entry = _entry_from_dict(position, item)
        else:
            raise ConfigurationError(
                f"cron #{position} must be a dict with name, expression and worker, "
                f"got {type(item).__name__}"
            )
        if entry.name in seen:
            raise ConfigurationError(
                f"cron name {entry.name!r} is used twice; every cron needs its own name "
                "(it is part of each slot's identity)"
            )
        seen.add(entry.name)
        if isinstance(entry, CronEntry):
            found.append(entry)
        else:
            declared.append(entry)
    return found, declared


def _is_schedule(item: Mapping[str, Any]) -> bool:
    return "overlap" in item or isinstance(item.get("catch_up"), str)


def _schedule_from_dict(position: int, item: Mapping[str, Any]) -> Declaration:
    from belay.schedules import declare

    name = item.get("name")
    label = f"schedule {name!r}" if isinstance(name, str) else f"schedule #{position}"
    missing = [key for key in ("name", "expression", "worker") if key not in item]
    if missing:
        raise ConfigurationError(f"{label} is missing {', '.join(missing)}")
    unknown = sorted(set(item) - set(_STATIC_KEYS) - set(_REFUSED))
    if unknown or "paused" in item:
        raise ConfigurationError(
            f"{label}: unknown key {(unknown or ['paused'])[0]!r}; a schedule takes name, "
            f"expression, worker, input, overlap, catch_up, {', '.join(OPTIONS)} (pause "
            "one with cancel_schedule)")
    try:
        return declare(item["name"], item["expression"], item["worker"], item.get("input"),
                       overlap=item.get("overlap", "skip"),
                       catch_up=item.get("catch_up", "latest"), static=True,
                       options={key: item[key] for key in item if key in OPTIONS
                                or key in _REFUSED})
    except ValidationError as exc:
        raise ConfigurationError(str(exc)) from None


def _entry_from_dict(position: int, item: Mapping[str, Any]) -> CronEntry:
    name = item.get("name")
    label = f"cron {name!r}" if isinstance(name, str) else f"cron #{position}"
    missing = [key for key in ("name", "expression", "worker") if key not in item]
    if missing:
        raise ConfigurationError(
            f"{label} is missing {', '.join(missing)}; e.g. "
            '{"name": "digest", "expression": "0 8 * * 1-5", "worker": send_digest}'
        )
    for key in item:
        if key in _REFUSED:
            raise ConfigurationError(f"{label}: {key}= is not a cron option: {_REFUSED[key]}")
        if key not in _STATIC_KEYS:
            raise ConfigurationError(
                f"{label}: unknown key {key!r}; a cron takes {', '.join(_STATIC_KEYS)}"
            )
    return CronEntry(
        name=item["name"],
        expression=item["expression"],
        worker=item["worker"],
        input=item.get("input") or {},
        options={key: item[key] for key in OPTIONS if key in item},
        catch_up=item.get("catch_up", 0.0),
        paused=item.get("paused", False),
    )


# -- Dynamic crons: belay_crons rows ---------------------------------------------------

_ROW_ADVICE: Final = {
    key: "cannot be stored in a belay_crons row, which the Elixir reference also reads "
         "and could not decode; give it to a static cron on the Worker (crons=[...])"
    for key in ("budget", "encrypt", "catch_up")
}


@dataclass(frozen=True)
class DynamicCron:
    """A ``belay_crons`` row, as stored (by belay or by any other implementation)."""

    name: str
    expression: str
    #: The kind the slot's job gets.
    worker: str
    input: Any
    #: Enqueue options (``opts``), a JSON object.
    options: Any
    paused: bool
    updated_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> DynamicCron:
        return cls(row["name"], row["expression"], row["worker"], row["input"], row["opts"],
                   row["paused"], row["updated_at"])

    def entry(self) -> CronEntry:
        """The schedulable entry; raises a BelayError saying why the row is unusable."""
        label = f"cron {self.name!r}"
        if not isinstance(self.input, Mapping):
            raise ValidationError(f"{label}: input is not a JSON object: {self.input!r}")
        options: Mapping[str, Any] = {} if self.options is None else self.options
        check_option_names(label, options, OPTIONS, ValidationError)
        return CronEntry(self.name, self.expression, self.worker,  # type: ignore[arg-type]
                         self.input, options, paused=self.paused)


def dynamic_values(
    name: Any, expression: Any, worker: Any, input: Any, options: Mapping[str, Any]
) -> dict[str, Any]:
    """Validate a ``put_cron`` request; returns the ``belay_crons`` column values
    (input and opts as JSON text). Raises :class:`belay.ValidationError`."""
    if not isinstance(name, str) or not name.strip():
        raise ValidationError(f"a cron needs a name (a non-empty string), got {name!r}")
    names.check_text(name, "a cron name")
    label = f"cron {name!r}"
    expr = parse(expression)
    kind = kind_of(worker)[0]
    check_option_names(label, options, ROW_OPTIONS, ValidationError, _ROW_ADVICE)
    stored = {key: value for key, value in options.items() if value is not None}
    input_ = input if input is not None else {}
    try:
        check_values(kind, input_, stored)
    except ValidationError as exc:
        raise ValidationError(f"{label}: {exc}") from None
    return {
        "name": name, "expression": expr.source, "worker": kind,
        "input": dumps_object(input_, what="input").decode(),
        "opts": dumps_object(stored, what="opts").decode(),
    }


# -- The scheduler ------------------------------------------------------------------


class CronScheduler:
    """Fires cron slots for one node: static entries merged with ``belay_crons`` rows.

    ``tick()`` does one round; ``start()`` runs ticks every ``interval`` seconds
    on a daemon thread named ``belay-cron``. ``registry`` resolves a kind named
    by string to its worker's defaults; ``notify`` pokes the queues of inserted
    jobs (§9.2).
    """

    def __init__(
        self,
        client: Belay,
        static_entries: Iterable[CronEntry | Mapping[str, Any]] | None = (),
        *,
        registry: Registry | None = None,
        interval: float = 20.0,
        notify: bool = False,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise ConfigurationError(
                f"cron interval must be a number of seconds > 0, got {interval!r}"
            )
        self.client = client
        # Static entries need croniter now; without any, a node lacking it still
        # runs, and dynamic rows are skipped with a warning saying what to install.
        self.entries, self.schedules = split_config(static_entries or ())
        self.registry = registry
        self.interval = float(interval)
        self.notify = notify
        #: Set after every tick of the background thread, failed or not. A test
        #: signal: belay itself never waits on it.
        self.ticked = threading.Event()
        self._previous: datetime | None = None
        #: The static schedules are in belay_schedules (declared on the first tick).
        self._declared = False
        self._warned: dict[str, str] = {}
        self._tick_lock = threading.Lock()
        self._lock = threading.Lock()
        self._service: Service | None = None

    # -- One round ------------------------------------------------------------------

    def tick(self, now: datetime | None = None) -> list[Job]:
        """Insert every due slot (§8.5); returns the jobs this call inserted (a
        slot another node inserted first is not among them)."""
        with self._tick_lock:
            now = as_utc("now", self.client.clock.now() if now is None else now)
            problems: dict[str, str] = {}
            with self.client.transaction() as conn:
                stored = [DynamicCron.from_row(r) for r in store.list_crons(conn)]
                entries = self._merge(stored, problems)
                rows = self._rows(entries, now, problems)
                inserted = store.insert_jobs(conn, rows, now) if rows else []
                if not self._declared:
                    for declaration in self.schedules:
                        store.declare_schedule(conn, declaration.values(now))
                inserted += self._schedule_round(conn, now, problems)
                if self.notify and inserted:
                    channel = self.client.notify_channel(conn)
                    store.notify(conn, channel, [store.poke_payload(q)
                                                 for q in {job.queue for job in inserted}])
            self._previous = slot(now)
            self._declared = True
            for name, problem in problems.items():
                if self._warned.get(name) != problem:
                    log.warning("belay cron %r skipped: %s", name, problem)
            self._warned = problems
            return inserted

    def _merge(self, stored: list[DynamicCron], problems: dict[str, str]) -> list[CronEntry]:
        """Static entries overridden by rows of the same name (§8.5); a paused row
        silences its name, an unusable row is skipped (the static entry stays)."""
        dynamic: dict[str, CronEntry] = {}
        silenced: set[str] = set()
        for row in stored:
            if row.paused:
                silenced.add(row.name)
                continue
            try:
                dynamic[row.name] = row.entry()
            except BelayError as exc:
                problems[row.name] = f"its belay_crons row is unusable: {exc}"
        merged = [entry for entry in self.entries
                  if not entry.paused and entry.name not in dynamic and entry.name not in silenced]
        return merged + list(dynamic.values())

    def _rows(
        self, entries: list[CronEntry], now: datetime, problems: dict[str, str]
    ) -> list[Row]:
        rows: list[Row] = []
        for entry in entries:
            try:
                due = slots_to_fire(entry.expression, now, self._previous, entry.catch_up)
                worker = self._worker(entry)
                rows += [
                    self.client._build(JobSpec(worker, dict(entry.input), **entry.options,
                                               internal={"cron_name": entry.name,
                                                         "cron_slot": at}), now)
                    for at in due
                ]
            except BelayError as exc:
                problems[entry.name] = str(exc)
        # One global insert order: two nodes inserting the same slots then wait
        # on each other's uncommitted rows in the same order, never in a cycle.
        rows.sort(key=lambda r: (r.cron_name or "", r.cron_slot or now))
        return rows

    def _worker(self, entry: CronEntry) -> str | WorkerDef:
        return self._resolve(entry.worker)

    def _resolve(self, worker: str | WorkerDef) -> str | WorkerDef:
        if isinstance(worker, str) and self.registry is not None:
            found = self.registry.get(worker)
            if found is not None:
                return found
        return worker

    def _schedule_round(self, conn: Any, now: datetime, problems: dict[str, str]) -> list[Job]:
        """Every schedule no other node is handling: fire what its policy says
        and move its cursor, in a savepoint each (one broken schedule doesn't
        hold back the others)."""
        from belay import schedules

        inserted: list[Job] = []
        for row in store.due_schedules(conn):
            name = row["name"]
            try:
                with conn.transaction():
                    expr = parse(row["expression"])
                    occurrences = schedules.due(expr, row["cursor_slot"], now, row["catch_up"])
                    decided = schedules.plan(row["overlap"], row["catch_up"], occurrences,
                                             row["busy"])
                    if decided.cursor is None:
                        continue
                    check_option_names(f"schedule {name!r}", row["opts"] or {}, OPTIONS,
                                       ValidationError)
                    worker = self._resolve(row["worker"])
                    rows = [self.client._build(JobSpec(
                        worker, dict(row["input"]), **(row["opts"] or {}),
                        internal={"cron_name": name, "cron_slot": at}), now)
                        for at in decided.fire]
                    jobs = store.insert_jobs(conn, rows, now) if rows else []
                    store.advance_schedule(conn, name, decided.cursor,
                                           jobs[-1].id if jobs else None)
                    if decided.skipped:
                        log.info("belay schedule %r: %d occurrence(s) passed over (%s)", name,
                                 decided.skipped, "busy" if row["busy"] else "coalesced")
                    inserted += jobs
            except (BelayError, TypeError) as exc:
                problems[name] = f"schedule: {exc}"
        return inserted

    # -- The thread -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._service is not None

    def start(self, on_crash: Callable[[Service, BaseException], None] | None = None) -> None:
        """Tick now and then every ``interval`` seconds on the ``belay-cron``
        service (``on_crash``: its crash policy); idempotent."""
        with self._lock:
            if self._service is not None:
                return
            self._service = Service("belay-cron", self._run, on_crash=on_crash).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop ticking and wait (up to ``timeout`` s) for a tick under way; idempotent."""
        with self._lock:
            service, self._service = self._service, None
        if service is not None:
            service.stop()
            service.join(timeout)

    def _run(self, service: Service) -> None:
        while True:
            try:
                self.tick()
            except Exception:
                # Survive anything: the next tick fires what this one missed
                # (up to LOOKBACK), because _previous only moves on success.
                log.exception("belay cron tick failed; retrying in %.1f s", self.interval)
            self.ticked.set()
            if service.wait(self.interval):
                return
