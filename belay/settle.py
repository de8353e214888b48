"""Workflow settlement (contract §8.3): a pure fixpoint over a workflow's members.

A held member with dependencies is released when every dependency succeeded
(or ended failed/cancelled with that outcome listed in its ``wf_ignore``), and
doomed when any dependency ended failed/cancelled without it. A doomed member
counts as cancelled for its own dependents, so the pass repeats to a fixpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    id: int
    wf_name: str | None
    state: str
    wf_deps: Sequence[str]
    wf_ignore: Sequence[str]


def settle(members: Iterable[Member]) -> tuple[list[int], list[int]]:
    """Return ``(release_ids, doom_ids)``; applying them and settling again yields nothing."""
    members = list(members)
    states = {m.wf_name: m.state for m in members}
    held = [m for m in members if m.state == "held" and m.wf_deps]
    releases: list[int] = []
    dooms: list[int] = []
    changed = True
    while changed:
        changed = False
        for member in held:
            if states.get(member.wf_name) != "held":
                continue
            if _doomed(member, states):
                dooms.append(member.id)
                states[member.wf_name] = "cancelled"
                changed = True
            elif _satisfied(member, states):
                releases.append(member.id)
                states[member.wf_name] = "ready"
                changed = True
    return releases, dooms


def _satisfied(member: Member, states: dict[str | None, str]) -> bool:
    for dep in member.wf_deps:
        state = states.get(dep)
        if state == "succeeded":
            continue
        if state in ("failed", "cancelled") and state in member.wf_ignore:
            continue
        return False
    return True


def _doomed(member: Member, states: dict[str | None, str]) -> bool:
    return any(
        states.get(dep) in ("failed", "cancelled") and states.get(dep) not in member.wf_ignore
        for dep in member.wf_deps
    )
