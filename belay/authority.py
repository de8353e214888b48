"""Attenuated authority, the pure part: what a job may do, and how a child's
authority is derived from its parent's.

A job's authority is a capability set in its ``meta`` under ``"$authority"``
(absent: no restriction). Each key, when present, bounds one thing:

``tools``
    the tool names the job's agent may call (the PydanticAI and LangGraph
    integrations check each call);
``queues``, ``kinds``
    where, and which workers, the job may enqueue or spawn jobs;
``usd``, ``tokens``
    the largest budget the job, and any job it starts, may hold: a top-up
    past it is refused as well.

What a job starts inherits its authority: ``ctx.spawn``/``spawn_many``/
``map_children``, and any enqueue made from inside the job's code. The new
job may be given a narrower set (``authority={...}``): a key it names must be
within the parent's, a key it leaves out is the parent's; a widening is
refused (:class:`~belay.errors.AuthorityExceeded`) before anything is written.
So authority only narrows down a tree of agents, however deep.

The set rides in ``meta`` so the row keeps the contract's columns; belay
writes and checks it, another implementation reading the row ignores it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from belay import names
from belay.ambient import current_job, refuse_contextless
from belay.errors import AuthorityExceeded, ValidationError

#: Where a job's authority lives in its ``meta``.
AUTHORITY_KEY: Final = names.AUTHORITY_KEY
#: The keys an authority takes: three sets of names and two caps.
SETS: Final = ("tools", "queues", "kinds")
CAPS: Final = ("usd", "tokens")
#: The most names one set may hold.
MAX_NAMES: Final = 1_000


@dataclass(frozen=True)
class Authority:
    """A capability set; ``None`` in a field means that thing is not bounded."""

    tools: frozenset[str] | None = None
    queues: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    usd_micros: int | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, value: object, what: str = "authority") -> Authority:
        """From ``{"tools": [...], "queues": [...], "kinds": [...], "usd": 5,
        "tokens": 100000}`` (any subset), checked."""
        if isinstance(value, Authority):
            return value
        if not isinstance(value, Mapping):
            raise ValidationError(
                f"{what} is a dict like {{'tools': ['search'], 'queues': ['agents'], "
                f"'usd': 5}}, got {type(value).__name__}")
        unknown = sorted(str(k) for k in set(value) - set(SETS) - set(CAPS))
        if unknown:
            raise ValidationError(f"unknown {what} key(s) {', '.join(map(repr, unknown))}; "
                                  f"an authority takes {', '.join(SETS + CAPS)}")
        sets = {key: _names(value[key], f"{what} {key}") if value.get(key) is not None
                else None for key in SETS}
        usd = value.get("usd")
        tokens = value.get("tokens")
        return cls(sets["tools"], sets["queues"], sets["kinds"],
                   None if usd is None else _usd_micros(usd, f"{what} usd"),
                   None if tokens is None else _tokens(tokens, f"{what} tokens"))

    def to_meta(self) -> dict[str, Any]:
        """The JSON form stored in ``meta``: only the bounded keys, names sorted."""
        out: dict[str, Any] = {}
        for key in SETS:
            bound = getattr(self, key)
            if bound is not None:
                out[key] = sorted(bound)
        if self.usd_micros is not None:
            out["usd"] = self.usd_micros / 1_000_000
        if self.tokens is not None:
            out["tokens"] = self.tokens
        return out

    @property
    def usd(self) -> float | None:
        return None if self.usd_micros is None else self.usd_micros / 1_000_000

    def narrowed(self, asked: Authority | None, whose: str) -> Authority:
        """The authority of a job started under this one: ``asked`` where it
        says, this one elsewhere; AuthorityExceeded where ``asked`` would widen."""
        if asked is None:
            return self
        fields: dict[str, Any] = {}
        for key in SETS:
            mine, theirs = getattr(self, key), getattr(asked, key)
            if theirs is not None and mine is not None and not theirs <= mine:
                extra = ", ".join(sorted(theirs - mine))
                raise AuthorityExceeded(
                    f"authority may only narrow: {key} {extra} not allowed to {whose} "
                    f"(it may use {_listed(mine)}); ask for a subset, or leave {key} out "
                    "to inherit it")
            fields[key] = mine if theirs is None else theirs
        for key in ("usd_micros", "tokens"):
            mine, theirs = getattr(self, key), getattr(asked, key)
            if theirs is not None and mine is not None and theirs > mine:
                raise AuthorityExceeded(
                    f"authority may only narrow: {_cap(key, theirs)} is more than the "
                    f"{_cap(key, mine)} {whose} may hold")
            fields[key] = mine if theirs is None else theirs
        return Authority(**fields)

    def check_job(self, *, queue: str, kind: str, usd_micros: int | None,
                  tokens: int | None, whose: str) -> None:
        """Refuse a job this authority may not start: another queue or worker,
        or a budget over its caps (or none, where it has a cap)."""
        if self.queues is not None and queue not in self.queues:
            raise AuthorityExceeded(f"queue {queue!r} is not allowed to {whose} "
                                    f"(it may use {_listed(self.queues)})")
        if self.kinds is not None and kind not in self.kinds:
            raise AuthorityExceeded(f"worker {kind!r} is not allowed to {whose} "
                                    f"(it may start {_listed(self.kinds)})")
        self.check_budget(usd_micros, tokens, whose)

    def check_budget(self, usd_micros: int | None, tokens: int | None, whose: str,
                     *, required: bool = True) -> None:
        """Refuse a budget over this authority's caps, or (``required``) none
        where it has one."""
        for key, asked in (("usd_micros", usd_micros), ("tokens", tokens)):
            cap = getattr(self, key)
            if cap is None or (asked is None and not required):
                continue
            if asked is None:
                unit = "usd" if key == "usd_micros" else "tokens"
                raise AuthorityExceeded(
                    f"{whose} may hold at most {_cap(key, cap)}: give the job a budget "
                    f"with {unit} of at most that (budget={{'{unit}': ...}})")
            if asked > cap:
                raise AuthorityExceeded(
                    f"a budget of {_cap(key, asked)} is more than the {_cap(key, cap)} "
                    f"{whose} may hold")

    def check_tool(self, tool: str, whose: str) -> None:
        """Refuse a tool call this authority does not allow."""
        if self.tools is not None and tool not in self.tools:
            raise AuthorityExceeded(f"tool {tool!r} is not allowed to {whose} "
                                    f"(it may call {_listed(self.tools)})")


def authority_of(meta: Mapping[str, Any] | None) -> Authority | None:
    """The authority a job's ``meta`` carries; None when it has none. A stored
    value belay can't read restricts everything (fail closed)."""
    if not meta or AUTHORITY_KEY not in meta:
        return None
    try:
        return Authority.parse(meta[AUTHORITY_KEY])
    except ValidationError:
        return Authority(frozenset(), frozenset(), frozenset(), 0, 0)


def _names(value: object, what: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValidationError(f"{what} is a list of names, got {value!r}")
    items = list(value)
    if len(items) > MAX_NAMES:
        raise ValidationError(f"{what} holds {len(items)} names; the limit is {MAX_NAMES}")
    return frozenset(names.check_text(item, f"a name in {what}") for item in items)


def _usd_micros(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= 9.2e12):
        raise ValidationError(f"{what} is a number of dollars from 0, got {value!r}")
    return round(value * 1_000_000)


def _tokens(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValidationError(f"{what} is a whole number of tokens from 0, got {value!r}")
    return value


def _listed(bound: frozenset[str]) -> str:
    shown = sorted(bound)
    if not shown:
        return "none"
    return ", ".join(shown[:10]) + (f" and {len(shown) - 10} more" if len(shown) > 10 else "")


def _cap(key: str, amount: int) -> str:
    return f"${amount / 1_000_000:g}" if key == "usd_micros" else f"{amount:,} tokens"


def current() -> Authority | None:
    """The authority of the job whose code is running here; None outside a
    job, or for a job that has none."""
    ctx = current_job()
    return None if ctx is None else authority_of(ctx.meta)


def check_tool(tool: str) -> None:
    """Refuse (AuthorityExceeded) a tool call the running job's authority does
    not allow; outside a job, or without an authority, every tool is allowed —
    except in a thread that lost its job's context while a job with an
    authority runs in this process (:func:`belay.ambient.refuse_contextless`).
    The agent integrations call it before each tool call; call it in a tool
    of your own the same way."""
    ctx = current_job()
    if ctx is None:
        refuse_contextless(f"tool call {tool!r}")
        return
    granted = authority_of(ctx.meta)
    if granted is not None:
        granted.check_tool(tool, f"job {ctx.id}")
