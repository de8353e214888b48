"""A job's children (§8.4): spawning them exactly once, and waiting for them.

What ``ctx.spawn``, ``ctx.spawn_many``, ``ctx.map_children`` and
``ctx.await_children`` do, apart from the context itself (a replay's context
answers these from the record instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from belay import holds, names, store
from belay.authority import AUTHORITY_KEY, Authority
from belay.budget import capped, policy_of
from belay.context import Park
from belay.enqueue import JobSpec, usd_to_micros
from belay.errors import AuthorityExceeded, ValidationError

if TYPE_CHECKING:
    from belay.context import Context
    from belay.job import Job


def spawn_children(ctx: Context, name: str, kind: Any, inputs: Iterable[Mapping[str, Any]],
                   options: dict[str, Any], *, share: bool) -> list[int]:
    """Insert one child per input once, journaled as step ``$spawn:<name>``;
    ``share``: the children split what is left of the parent's budget."""
    if not isinstance(name, str) or not name:
        raise ValidationError(f"a spawn name is a non-empty string, got {name!r}")
    # Room for the children's keys, $spawn:<parent>:<name>:<index> (§8.4).
    names.check_text(name, "a spawn name", max_bytes=names.MAX_KEY_BYTES - 64, empty=True)
    inputs = list(inputs)
    if isinstance(kind, str):
        kind = ctx.registry.get(kind) or kind

    def specs(budget: Any) -> list[JobSpec]:
        return [
            JobSpec(kind, child_input, **{**options, "budget": budget}, internal={
                "parent_id": ctx.id, "unique_key": names.spawn_key(ctx.id, name, index),
                "unique_mode": "always",
            })
            for index, child_input in enumerate(inputs)
        ]

    # Bad options fail here, before anything is journaled.
    specs(None if share else options.get("budget"))

    def insert() -> list[int]:
        # Ids come back for inserted children and for holders of their keys
        # alike: the list is rebuilt from the keys, never trusted from a
        # partial insert.
        if share:
            budget = budget_share(ctx, name, len(inputs))
        else:
            budget = within_remaining(ctx, options.get("budget"), _asked(options))
        return [job.id for job in ctx.client.enqueue_many(specs(budget))]

    ids = ctx._step(f"$spawn:{name}", insert, None)
    if not isinstance(ids, list):
        raise ValidationError(f"step $spawn:{name} holds {ids!r}, not a list of job ids")
    return ids


def _asked(options: Mapping[str, Any]) -> Authority | None:
    """The authority a spawn asks for its children, if it names one."""
    meta = options.get("meta")
    asked = options.get("authority")
    if asked is None and isinstance(meta, Mapping):
        asked = meta.get(AUTHORITY_KEY)
    return None if asked is None else Authority.parse(asked)


def within_remaining(ctx: Context, budget: Any, asked: Authority | None = None) -> Any:
    """A child's budget bounded by what this job has left: a child never holds
    more than its parent could still spend. Where this job has a cap, a child
    given none gets what is left (no more than the caps of the authority it
    asks for; under this job's policy), and one given more is refused
    (AuthorityExceeded) before anything is written."""
    with ctx.client.transaction() as conn:
        found = store.run(conn, holds.standing(ctx.id, ctx.attempt, ctx.journal.run))
    if found is None or not capped(found[0].spend):
        return budget
    # What is left is what nothing holds: a step in flight's max_cost, a share.
    promised = found[0].promised
    left = {"usd": None if promised["budget_usd_micros"] is None
            else max(promised["budget_usd_micros"] - promised["spent_usd_micros"], 0),
            "tokens": None if promised["budget_tokens"] is None
            else max(promised["budget_tokens"] - promised["spent_tokens"], 0)}
    out = dict(budget) if isinstance(budget, Mapping) else {}
    if budget is None:
        policy = policy_of(ctx.meta)
        out["on_exceed"], out["warn_at"] = policy.on_exceed, list(policy.warn_at)
    for unit, remaining in left.items():
        if remaining is None:
            continue
        given = out.get(unit)
        if given is None:
            cap = None if asked is None else (
                asked.usd_micros if unit == "usd" else asked.tokens)
            if cap is not None:
                remaining = min(remaining, cap)
            out[unit] = remaining / 1_000_000 if unit == "usd" else remaining
            continue
        wanted = usd_to_micros(given, what="budget usd") if unit == "usd" else given
        if isinstance(wanted, int) and wanted > remaining:
            shown = (f"${wanted / 1e6:g}", f"${remaining / 1e6:g}") if unit == "usd" else (
                f"{wanted:,} tokens", f"{remaining:,} tokens")
            raise AuthorityExceeded(
                f"a child budget of {shown[0]} is more than the {shown[1]} job {ctx.id} has "
                f"left; give the child at most that, or leave {unit} out to give it all "
                "that is left")
    return out


def budget_share(ctx: Context, fan_out: str, children: int) -> dict[str, Any] | None:
    """An even share, per child, of what is left of this job's budget now —
    beside what other fan-outs and steps in flight hold — held for them until
    fan-out ``fan_out`` charges their spend back (:mod:`belay.holds`)."""
    with ctx.client.transaction() as conn:
        each = store.run(conn, holds.share(ctx.id, ctx.attempt, ctx.journal.run, fan_out,
                                           children, ctx.client.clock.now()))
    if each is None:
        return None
    budget: dict[str, Any] = {}
    if each[0] is not None:
        budget["usd"] = each[0] / 1_000_000
    if each[1] is not None:
        budget["tokens"] = each[1]
    if budget:
        # The children follow the parent's policy: a pausing tree pauses
        # wherever it crosses, and warns at the same thresholds.
        policy = policy_of(ctx.meta)
        budget["on_exceed"], budget["warn_at"] = policy.on_exceed, list(policy.warn_at)
    return budget or None


def wait_for_children(ctx: Context) -> list[Job]:
    """Every child once all are terminal, else park on ``$children``."""
    ctx.checkpoint()
    scope = names.job_scope(ctx.id)
    for verify in range(2):
        with ctx.client.connection() as conn:
            kids = store.children(conn, ctx.id)
        if all(kid.terminal for kid in kids):
            return kids
        if verify == 0:
            # A $children signal from an earlier child is stale now; clear it,
            # then look again, so a child finishing in between is not missed.
            with ctx.client.transaction() as conn:
                store.clear_signal(conn, scope, names.CHILDREN)
    raise ctx._control(Park(scope, names.CHILDREN, None))
