"""Budget governance, the pure part: what a job's budget policy says, how far
its spend has gone, which warning thresholds it reached.

A budget is two caps on the job row (``budget_usd_micros``,
``budget_tokens``, contract §2) and, when it is not the default, a policy in
the job's ``meta`` under ``"$budget"``: ``on_exceed`` (``"fail"``, the
default, or ``"pause"``) and ``warn_at`` (fractions of a cap at which a
warning is sent once; default 50 % and 80 %). The policy rides in ``meta``
so the row keeps the contract's columns: another implementation reading the
job sees an ordinary budget (and fails it at the crossing, its default).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from belay.errors import IdempotencyConflict, ValidationError
from belay.names import MAX_NAME_BYTES, TOP_UP, check_text

#: Where a job's budget policy lives in its ``meta``.
POLICY_KEY: Final = "$budget"
#: What crossing a cap does.
ON_EXCEED: Final = ("fail", "pause")
#: The fractions of a cap at which a job warns, unless its budget says otherwise.
DEFAULT_WARN_AT: Final = (0.5, 0.8)
#: The most warning thresholds one budget may have.
MAX_THRESHOLDS: Final = 8
#: The prefix of the marks (signals in the job's scope) that record budget warnings.
BUDGET_MARKS: Final = "$budget:"
#: The prefix of a keyed top-up's once-only mark: ``$budget:top_up:`` + the
#: SHA-256 (hex) of its idempotency key, so any key makes a short, fixed-size
#: signal name; the key itself is in the mark's payload.
TOP_UP_MARKS: Final = f"{BUDGET_MARKS}top_up:"
#: The longest idempotency key a top-up takes, in UTF-8 bytes (as POST /jobs' ``id``).
MAX_TOP_UP_KEY_BYTES: Final = MAX_NAME_BYTES
#: The keys ``budget=`` takes.
BUDGET_KEYS: Final = ("usd", "tokens", "on_exceed", "warn_at")


@dataclass(frozen=True)
class Policy:
    """What a job does at its budget: ``on_exceed`` and its ``warn_at`` fractions."""

    on_exceed: str = "fail"
    warn_at: tuple[float, ...] = DEFAULT_WARN_AT

    @property
    def pauses(self) -> bool:
        return self.on_exceed == "pause"

    def to_meta(self) -> dict[str, Any] | None:
        """The ``meta["$budget"]`` entry, or None for the default policy."""
        entry: dict[str, Any] = {}
        if self.on_exceed != "fail":
            entry["on_exceed"] = self.on_exceed
        if self.warn_at != DEFAULT_WARN_AT:
            entry["warn_at"] = list(self.warn_at)
        return entry or None


DEFAULT_POLICY: Final = Policy()


def parse_policy(budget: Mapping[str, Any], has_cap: bool) -> Policy:
    """The policy of an enqueue's ``budget=`` mapping; a ValidationError naming
    the fix for a bad one."""
    on_exceed = budget.get("on_exceed", "fail")
    if on_exceed not in ON_EXCEED:
        raise ValidationError(
            f"budget on_exceed is 'fail' (the job fails at the step that crosses a cap) or "
            f"'pause' (it waits for belay.top_up), got {on_exceed!r}")
    warn_at = _thresholds(budget.get("warn_at", DEFAULT_WARN_AT))
    if not has_cap and ("on_exceed" in budget or "warn_at" in budget):
        raise ValidationError(
            "a budget's on_exceed and warn_at need a cap to apply to: add 'usd' and/or "
            "'tokens', like budget={'usd': 5, 'on_exceed': 'pause'}")
    return Policy(on_exceed, warn_at)


def _thresholds(value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValidationError(
            f"budget warn_at is a list of fractions of the cap, like [0.5, 0.8] ([] for no "
            f"warnings), got {value!r}")
    if len(value) > MAX_THRESHOLDS:
        raise ValidationError(f"budget warn_at has {len(value)} thresholds; at most "
                              f"{MAX_THRESHOLDS}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)) \
                or not math.isfinite(item) or not 0 < item < 1:
            raise ValidationError(
                f"budget warn_at holds fractions between 0 and 1 (0.8 is 80 % of the cap), "
                f"got {item!r}")
    return tuple(sorted({float(item) for item in value}))


def policy_of(meta: Mapping[str, Any] | None) -> Policy:
    """A job's policy from its ``meta``; the default for a missing or unreadable
    entry (a job written by another implementation, or by hand)."""
    entry = None if meta is None else meta.get(POLICY_KEY)
    if not isinstance(entry, Mapping):
        return DEFAULT_POLICY
    on_exceed = entry.get("on_exceed", "fail")
    try:
        warn_at = _thresholds(entry.get("warn_at", DEFAULT_WARN_AT))
    except ValidationError:
        warn_at = DEFAULT_WARN_AT
    return Policy(on_exceed if on_exceed in ON_EXCEED else "fail", warn_at)


@dataclass(frozen=True)
class Headroom:
    """Where a job stands against its budget (``ctx.budget``): per unit, the
    cap (None: no cap), what was spent, and what is left (None: no cap)."""

    usd_limit: float | None
    usd_spent: float
    tokens_limit: int | None
    tokens_spent: int

    @classmethod
    def of(cls, spend: Mapping[str, Any]) -> Headroom:
        """From a row's (or a step write's) four budget columns."""
        usd = spend["budget_usd_micros"]
        return cls(None if usd is None else usd / 1_000_000,
                   spend["spent_usd_micros"] / 1_000_000,
                   spend["budget_tokens"], spend["spent_tokens"])

    @property
    def usd_remaining(self) -> float | None:
        if self.usd_limit is None:
            return None
        return max(round(self.usd_limit - self.usd_spent, 6), 0.0)

    @property
    def tokens_remaining(self) -> int | None:
        if self.tokens_limit is None:
            return None
        return max(self.tokens_limit - self.tokens_spent, 0)

    @property
    def used(self) -> float | None:
        """The larger share of a cap spent (1.0 = at a cap), None with no cap."""
        shares = [_share(spent, limit) for spent, limit in
                  ((self.usd_spent, self.usd_limit), (self.tokens_spent, self.tokens_limit))
                  if limit is not None]
        return max(shares) if shares else None

    @property
    def exceeded(self) -> bool:
        """Spend is over a cap (the job fails or pauses before its next step)."""
        return ((self.usd_limit is not None and self.usd_spent > self.usd_limit)
                or (self.tokens_limit is not None and self.tokens_spent > self.tokens_limit))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``used`` is None past a cap of zero, where it is infinite)."""
        used = self.used
        return {"usd_limit": self.usd_limit, "usd_spent": self.usd_spent,
                "usd_remaining": self.usd_remaining, "tokens_limit": self.tokens_limit,
                "tokens_spent": self.tokens_spent, "tokens_remaining": self.tokens_remaining,
                "used": used if used is None or math.isfinite(used) else None}


def _share(spent: float, limit: float) -> float:
    if limit > 0:
        return spent / limit
    return math.inf if spent > 0 else 0.0


def exceeded(spend: Mapping[str, Any], need: tuple[int, int] = (0, 0)) -> bool:
    """Spend over a cap, from the four budget columns; with ``need`` (micro-
    dollars, tokens), spend that leaves less headroom than that under a cap."""
    usd_cap, tokens_cap = spend["budget_usd_micros"], spend["budget_tokens"]
    return ((usd_cap is not None and spend["spent_usd_micros"] + need[0] > usd_cap)
            or (tokens_cap is not None and spend["spent_tokens"] + need[1] > tokens_cap))


def capped(spend: Mapping[str, Any]) -> bool:
    """The job has a cap (USD or tokens) to keep within."""
    return spend["budget_usd_micros"] is not None or spend["budget_tokens"] is not None


# -- Holds: headroom reserved before it is spent ---------------------------------------
#
# A step with a ``max_cost`` reserves that much headroom before it starts,
# and a fan-out with ``budget="share"`` the budgets it gives its children,
# so that runs racing each other never promise the same money twice: each
# hold is a signal in the job's scope (no column to add to the contract's
# table), taken under the job row's lock and dropped by the write that
# settles it — the step's journal entry, the fan-in's charge-back.

#: ``$budget:hold:<run>:<step>``: a step of one run (execution) in flight.
HOLDS: Final = f"{BUDGET_MARKS}hold:"
#: ``$budget:share:<fan-out>``: children's budgets, until their spend is charged back.
SHARES: Final = f"{BUDGET_MARKS}share:"


def hold_name(run: str, step: str) -> str:
    return f"{HOLDS}{run}:{step}"


def share_name(fan_out: str) -> str:
    return f"{SHARES}{fan_out}"


def hold_payload(amount: tuple[int, int]) -> dict[str, int]:
    return {"usd_micros": amount[0], "tokens": amount[1]}


class Held(NamedTuple):
    """What a job's live holds keep, as (micro-dollars, tokens): the steps in
    flight of the run that holds the job, and the fan-outs' shares; and the
    names of the dead holds (steps of an earlier run, which ended without
    settling them: a crash)."""

    steps: tuple[int, int]
    shares: tuple[int, int]
    dead: list[str]

    @property
    def total(self) -> tuple[int, int]:
        return (self.steps[0] + self.shares[0], self.steps[1] + self.shares[1])


def holding(holds: Iterable[Mapping[str, Any]], run: str | None, *,
            besides: str | None = None) -> Held:
    """Sort a job's holds (``budget_holds`` rows): ``run`` is the run that
    holds the job now (None: none does — the job is not running — so every
    step hold is dead); ``besides``, a hold to leave out (the one about to be
    replaced)."""
    steps, shares = [0, 0], [0, 0]
    dead: list[str] = []
    mine = None if run is None else f"{HOLDS}{run}:"
    for hold in holds:
        name = hold["name"]
        if name == besides:
            continue
        if name.startswith(HOLDS):
            if mine is None or not name.startswith(mine):
                dead.append(name)
                continue
            into = steps
        else:
            into = shares
        payload = hold["payload"] if isinstance(hold["payload"], Mapping) else {}
        into[0] += _amount(payload.get("usd_micros"))
        into[1] += _amount(payload.get("tokens"))
    return Held((steps[0], steps[1]), (shares[0], shares[1]), dead)


def _amount(value: Any) -> int:
    """A hold's amount; one belay can't read holds nothing (it only ever writes ints)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def with_held(spend: Mapping[str, Any], held: tuple[int, int]) -> dict[str, Any]:
    """The budget columns with ``held`` counted as spent: the headroom left to
    promise (what a new hold must fit in)."""
    return {**spend, "spent_usd_micros": spend["spent_usd_micros"] + held[0],
            "spent_tokens": spend["spent_tokens"] + held[1]}


def pause_name(need: tuple[int, int] = (0, 0)) -> str:
    """What a paused job awaits: ``$top_up``, or ``$top_up:<micro-dollars>:<tokens>``
    when it paused before a step for lack of that much headroom (``max_cost``):
    the row itself says what a top-up must cover to resume it."""
    return TOP_UP if need == (0, 0) else f"{TOP_UP}:{need[0]}:{need[1]}"


def pause_need(name: str | None) -> tuple[int, int] | None:
    """The headroom a job awaiting ``name`` needs (see :func:`pause_name`), or
    None when ``name`` is not a top-up's."""
    if name == TOP_UP:
        return (0, 0)
    if name is None or not name.startswith(TOP_UP + ":"):
        return None
    usd, _, tokens = name[len(TOP_UP) + 1:].partition(":")
    if not (usd.isdigit() and tokens.isdigit()):
        return None
    return int(usd), int(tokens)


def reached(warn_at: Sequence[float], used: float | None) -> list[float]:
    """The thresholds ``used`` has reached (each is warned about once, ever)."""
    if used is None:
        return []
    return [t for t in warn_at if used >= t]


def mark_name(threshold: float) -> str:
    """The mark that records a threshold's warning (so it is sent once)."""
    return f"{BUDGET_MARKS}warn:{threshold!r}"


@dataclass(frozen=True)
class BudgetNotice:
    """What a worker's ``on_budget`` hooks receive: a job reached a warning
    threshold (``"warning"``, once per threshold), paused over its budget
    (``"paused"``) or failed over it (``"exceeded"``), at ``step``."""

    job_id: int
    kind: str
    queue: str
    event: str
    step: str
    headroom: Headroom
    threshold: float | None = None

    @classmethod
    def of(cls, job: Any, event: str, step: str, headroom: Headroom,
           threshold: float | None = None) -> BudgetNotice:
        return cls(job.id, job.kind, job.queue, event, step, headroom, threshold)


# -- Top-ups ---------------------------------------------------------------------------


def check_top_up(usd: Any, tokens: Any) -> tuple[int, int]:
    """A top-up's amounts in micro-dollars and tokens; a ValidationError unless
    they are non-negative numbers, at least one of them above zero."""
    from belay.enqueue import usd_to_micros  # enqueue imports this module

    usd_micros = 0 if usd is None else usd_to_micros(usd, what="top-up usd")
    if tokens is None:
        more_tokens = 0
    elif isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < 2**63:
        raise ValidationError(f"top-up tokens is a whole number from 0 to 2**63-1, "
                              f"got {tokens!r}")
    else:
        more_tokens = tokens
    if usd_micros == 0 and more_tokens == 0:
        raise ValidationError("a top-up raises a cap: give usd=<dollars> and/or "
                              "tokens=<count>, above zero")
    return usd_micros, more_tokens


def raised(cap: int | None, more: int, unit: str, job_id: int) -> int | None:
    """A cap after a top-up of ``more``; a ValidationError when there is no
    cap to raise, or the sum would not fit the column."""
    if more == 0:
        return cap
    if cap is None:
        key = "usd" if unit == "USD" else "tokens"
        raise ValidationError(
            f"job {job_id} has no {unit} budget to top up: a top-up raises a cap the job "
            f"was enqueued with (budget={{'{key}': …}})")
    if cap + more > 2**63 - 1:
        raise ValidationError(f"job {job_id}'s {unit} budget would overflow: top up less")
    return cap + more


def top_up_refusal(job: Any) -> str:
    """Why a finished job can't be topped up, and what to do instead."""
    last = job.errors[-1] if job.errors else None
    if job.state == "failed" and isinstance(last, Mapping) \
            and last.get("error") == "budget_exceeded":
        return (f"job {job.id} failed when it went over its budget (on_exceed='fail'), so "
                "there is no paused run to resume: enqueue the work again with a larger "
                "budget, or with budget={..., 'on_exceed': 'pause'} to be able to top it up")
    return f"job {job.id} is {job.state}: only a job that has not finished can be topped up"


# -- Keyed top-ups (idempotency) --------------------------------------------------------------
#
# A top-up sent with an idempotency key leaves a once-only mark in the job's
# signal scope, written in the top-up's own transaction under the job's row
# lock (store.top_up): a retry of it with the same key finds the mark and
# changes nothing. A mark in belay_signals, not a new column or table: the
# tables are the wire contract another implementation shares, and a reserved
# ``$`` name in a job's scope is what the budget warnings' marks already are.
# It lives as long as signals do (the workers' signal_ttl, 7 days by default).


def check_top_up_key(key: Any) -> str | None:
    """``key`` if it can be a top-up's idempotency key (a non-blank string of at
    most :data:`MAX_TOP_UP_KEY_BYTES` UTF-8 bytes, no NUL, no lone surrogate),
    None for None; a ValidationError naming the fix otherwise."""
    if key is None:
        return None
    return check_text(key, "the top-up's idempotency_key", max_bytes=MAX_TOP_UP_KEY_BYTES)


def top_up_mark(key: str) -> str:
    """The signal name (in the job's scope) that records the top-up keyed ``key``."""
    return TOP_UP_MARKS + hashlib.sha256(key.encode("utf-8")).hexdigest()


def top_up_record(key: str, usd_micros: int, tokens: int, resumed: bool) -> dict[str, Any]:
    """The mark's payload: the key, what the top-up added and whether it resumed the job."""
    return {"key": key, "usd_micros": usd_micros, "tokens": tokens, "resumed": resumed}


def replayed_top_up(record: Any, key: str, usd_micros: int, tokens: int, job_id: int) -> bool:
    """A top-up sent again with the key of ``record`` (the mark's payload):
    whether the first one resumed the job; an :class:`IdempotencyConflict` when
    the amounts differ (compared in micro-dollars and tokens, as stored)."""
    first = record if isinstance(record, Mapping) else {}
    if (first.get("usd_micros"), first.get("tokens")) != (usd_micros, tokens):
        raise IdempotencyConflict(
            f"job {job_id} was already topped up with idempotency_key {key!r} and other "
            f"amounts ({_amounts(first.get('usd_micros'), first.get('tokens'))}, not "
            f"{_amounts(usd_micros, tokens)}): send a retry with the same amounts, or a new "
            "top-up with a new key")
    return first.get("resumed") is True


def _amounts(usd_micros: Any, tokens: Any) -> str:
    usd = usd_micros / 1_000_000 if isinstance(usd_micros, int) else usd_micros
    return f"usd={usd!r}, tokens={tokens!r}"
