"""A job's children (§8.4): spawning them exactly once, and waiting for them.

What ``ctx.spawn``, ``ctx.spawn_many``, ``ctx.map_children`` and
``ctx.await_children`` do, apart from the context itself (a replay's context
answers these from the record instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from belay import names, store
from belay.budget import policy_of
from belay.context import Park
from belay.enqueue import JobSpec
from belay.errors import ValidationError

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
        budget = budget_share(ctx, len(inputs)) if share else options.get("budget")
        return [job.id for job in ctx.client.enqueue_many(specs(budget))]

    ids = ctx._step(f"$spawn:{name}", insert, None)
    if not isinstance(ids, list):
        raise ValidationError(f"step $spawn:{name} holds {ids!r}, not a list of job ids")
    return ids


def budget_share(ctx: Context, children: int) -> dict[str, Any] | None:
    """An even share, per child, of what is left of this job's budget now."""
    with ctx.client.connection() as conn:
        job = store.get_job(conn, ctx.id)
    if job is None or children == 0:
        return None
    budget: dict[str, Any] = {}
    if job.budget_usd_micros is not None:
        left = max(job.budget_usd_micros - job.spent_usd_micros, 0)
        budget["usd"] = (left // children) / 1_000_000
    if job.budget_tokens is not None:
        budget["tokens"] = max(job.budget_tokens - job.spent_tokens, 0) // children
    if budget:
        # The children follow the parent's policy: a pausing tree pauses
        # wherever it crosses, and warns at the same thresholds.
        policy = policy_of(job.meta)
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
