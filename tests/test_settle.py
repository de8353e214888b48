"""Workflow settlement (contract §8.3): the pure fixpoint in belay/settle.py.

Table tests pin the cases the contract spells out; hypothesis properties check
§11 invariant 5 ("releases occur only with satisfied deps; dooms only with a
doomed dep; settlement is a fixpoint") over random workflows, plus an
independent oracle on acyclic ones. Mirrors the reference's ``settle/1``
(lib/belay/storage.ex, ``Belay.Storage.Logic``). No database.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belay.settle import Member, settle

STATES = ("ready", "running", "awaiting", "held", "paused", "succeeded", "failed", "cancelled")
FAILED_LIKE = ("failed", "cancelled")

# No example database: it would litter the shared work tree with a .hypothesis directory.
PROPERTY = settings(database=None, max_examples=400, deadline=None)


def m(
    id: int,
    name: str | None,
    state: str,
    deps: Sequence[str] = (),
    ignore: Sequence[str] = (),
) -> Member:
    return Member(id=id, wf_name=name, state=state, wf_deps=tuple(deps), wf_ignore=tuple(ignore))


def outcome(members: Sequence[Member]) -> tuple[set[int], set[int]]:
    releases, dooms = settle(members)
    assert len(releases) == len(set(releases)), "a member released twice"
    assert len(dooms) == len(set(dooms)), "a member doomed twice"
    return set(releases), set(dooms)


def applied(
    members: Sequence[Member], releases: Sequence[int], dooms: Sequence[int]
) -> list[Member]:
    """What the database holds after the settle UPDATEs: releases → ready, dooms → cancelled."""
    released, doomed = set(releases), set(dooms)
    out = []
    for member in members:
        state = member.state
        if member.id in released:
            state = "ready"
        elif member.id in doomed:
            state = "cancelled"
        out.append(m(member.id, member.wf_name, state, member.wf_deps, member.wf_ignore))
    return out


# -- Table tests (§8.3) ------------------------------------------------------------


def chain(a_state: str, b_ignore: Sequence[str] = (), c_ignore: Sequence[str] = ()) -> list[Member]:
    """a → b → c: b depends on a, c on b; b and c held."""
    return [
        m(1, "a", a_state),
        m(2, "b", "held", ["a"], b_ignore),
        m(3, "c", "held", ["b"], c_ignore),
    ]


def test_chain_failed_root_dooms_the_whole_chain() -> None:
    """A doomed member counts as cancelled for its own dependents (§8.3)."""
    assert outcome(chain("failed")) == (set(), {2, 3})


def test_chain_cancelled_root_dooms_the_whole_chain() -> None:
    assert outcome(chain("cancelled")) == (set(), {2, 3})


def test_chain_succeeded_root_releases_only_the_next_member() -> None:
    """b is released (→ ready, not succeeded), so c stays held."""
    assert outcome(chain("succeeded")) == ({2}, set())


@pytest.mark.parametrize("a_state", ["ready", "running", "awaiting", "held", "paused"])
def test_chain_with_unfinished_root_changes_nothing(a_state: str) -> None:
    assert outcome(chain(a_state)) == (set(), set())


@pytest.mark.parametrize("flag", FAILED_LIKE)
def test_ignore_flag_matching_the_dep_outcome_releases(flag: str) -> None:
    assert outcome(chain(flag, b_ignore=[flag])) == ({2}, set())


@pytest.mark.parametrize(("dep_state", "flag"), [("failed", "cancelled"), ("cancelled", "failed")])
def test_ignore_flag_for_the_other_outcome_still_dooms(dep_state: str, flag: str) -> None:
    assert outcome(chain(dep_state, b_ignore=[flag])) == (set(), {2, 3})


def test_both_ignore_flags_release_whatever_the_failure() -> None:
    for dep_state in FAILED_LIKE:
        assert outcome(chain(dep_state, b_ignore=["failed", "cancelled"])) == ({2}, set())


def test_dependent_ignoring_cancelled_is_released_by_a_doomed_dep() -> None:
    """b is doomed (a failed); c ignores 'cancelled', and a doom counts as cancelled."""
    assert outcome(chain("failed", c_ignore=["cancelled"])) == ({3}, {2})


def test_dependent_ignoring_failed_is_still_doomed_by_a_doomed_dep() -> None:
    """A doom is a cancellation, not a failure: ignoring 'failed' does not cover it."""
    assert outcome(chain("failed", c_ignore=["failed"])) == (set(), {2, 3})


def diamond(a: str, b: str, c: str, d: str = "held", d_ignore: Sequence[str] = ()) -> list[Member]:
    """a → {b, c} → d."""
    return [
        m(10, "a", a),
        m(11, "b", b, ["a"]),
        m(12, "c", c, ["a"]),
        m(13, "d", d, ["b", "c"], d_ignore),
    ]


def test_diamond_root_succeeded_releases_both_branches_but_not_the_join() -> None:
    assert outcome(diamond("succeeded", "held", "held")) == ({11, 12}, set())


def test_diamond_join_released_when_both_branches_succeeded() -> None:
    assert outcome(diamond("succeeded", "succeeded", "succeeded")) == ({13}, set())


def test_diamond_join_waits_for_the_slower_branch() -> None:
    assert outcome(diamond("succeeded", "succeeded", "running")) == (set(), set())


def test_diamond_join_doomed_by_one_failed_branch_without_waiting_for_the_other() -> None:
    assert outcome(diamond("succeeded", "failed", "running")) == (set(), {13})


def test_diamond_join_ignoring_failed_released_past_a_failed_branch() -> None:
    assert outcome(diamond("succeeded", "succeeded", "failed", d_ignore=["failed"])) == (
        {13},
        set(),
    )


def test_diamond_failed_root_dooms_every_member_below_it() -> None:
    assert outcome(diamond("failed", "held", "held")) == (set(), {11, 12, 13})


def test_diamond_half_ignoring_root_failure() -> None:
    """b ignores the root failure and is released; c is doomed, which dooms d."""
    members = [
        m(10, "a", "failed"),
        m(11, "b", "held", ["a"], ["failed"]),
        m(12, "c", "held", ["a"]),
        m(13, "d", "held", ["b", "c"]),
    ]
    assert outcome(members) == ({11}, {12, 13})


def test_dep_name_that_does_not_exist_neither_releases_nor_dooms() -> None:
    members = [m(1, "a", "succeeded"), m(2, "b", "held", ["a", "nope"])]
    assert outcome(members) == (set(), set())


def test_missing_dep_does_not_shield_from_a_failed_one() -> None:
    members = [m(1, "a", "failed"), m(2, "b", "held", ["nope", "a"])]
    assert outcome(members) == (set(), {2})


def test_held_member_without_deps_is_left_alone() -> None:
    """Held without deps is an operator hold, not settlement's business (§4)."""
    members = [m(1, "a", "failed"), m(2, "b", "held"), m(3, "c", "held", [], ["failed"])]
    assert outcome(members) == (set(), set())


@pytest.mark.parametrize("state", [s for s in STATES if s != "held"])
def test_non_held_member_with_deps_is_left_alone(state: str) -> None:
    for dep_state in ("succeeded", "failed"):
        assert outcome([m(1, "a", dep_state), m(2, "b", state, ["a"])]) == (set(), set())


def test_cycle_of_held_members_stays_held() -> None:
    members = [m(1, "a", "held", ["b"]), m(2, "b", "held", ["a"])]
    assert outcome(members) == (set(), set())


def test_self_dependency_stays_held() -> None:
    assert outcome([m(1, "a", "held", ["a"])]) == (set(), set())


def test_cycle_is_doomed_from_outside() -> None:
    members = [m(1, "x", "failed"), m(2, "a", "held", ["b", "x"]), m(3, "b", "held", ["a"])]
    assert outcome(members) == (set(), {2, 3})


def test_empty_workflow_settles_to_nothing() -> None:
    assert settle([]) == ([], [])


def test_settle_accepts_any_iterable_once() -> None:
    """The store passes a list, but a one-shot iterator must work the same."""
    assert outcome(iter(chain("succeeded"))) == ({2}, set())  # type: ignore[arg-type]


def test_long_chain_dooms_transitively_whatever_the_input_order() -> None:
    """Doom propagation must reach the end of a chain even when listed backwards."""
    n = 50
    members = [m(0, "n0", "failed")] + [m(i, f"n{i}", "held", [f"n{i - 1}"]) for i in range(1, n)]
    assert outcome(list(reversed(members))) == (set(), set(range(1, n)))


def test_long_chain_with_ignore_cancelled_releases_only_the_first_ignoring_member() -> None:
    """n1 doomed; n2 ignores cancelled → released (ready, not terminal), so n3 waits."""
    members = [
        m(0, "n0", "failed"),
        m(1, "n1", "held", ["n0"]),
        m(2, "n2", "held", ["n1"], ["cancelled"]),
        m(3, "n3", "held", ["n2"]),
    ]
    assert outcome(list(reversed(members))) == ({2}, {1})


# -- Property tests (§11 invariant 5) ------------------------------------------------


@st.composite
def workflows(draw: st.DrawFn, acyclic: bool = True) -> list[Member]:
    """Random workflows: unique names, random states (held is common), deps on earlier
    members (acyclic) or on anyone (cycles allowed), sometimes on a missing name."""
    n = draw(st.integers(min_value=0, max_value=12))
    names = [f"n{i}" for i in range(n)]
    ids = draw(st.permutations(list(range(100, 100 + n))))
    members = []
    for i in range(n):
        state = draw(st.sampled_from((*STATES, "held", "held", "succeeded", "failed")))
        pool = names[:i] if acyclic else names
        deps = draw(st.lists(st.sampled_from(pool), unique=True, max_size=4)) if pool else []
        if draw(st.integers(0, 9)) == 0:
            deps.append("missing")
        ignore = draw(st.lists(st.sampled_from(FAILED_LIKE), unique=True, max_size=2))
        members.append(m(ids[i], names[i], state, deps, ignore))
    return members


any_workflow = st.one_of(workflows(acyclic=True), workflows(acyclic=False))


def satisfied_by(member: Member, states: dict[str | None, str]) -> bool:
    return all(
        states.get(dep) == "succeeded"
        or (states.get(dep) in FAILED_LIKE and states.get(dep) in member.wf_ignore)
        for dep in member.wf_deps
    )


def doomed_by(member: Member, states: dict[str | None, str]) -> bool:
    return any(
        states.get(dep) in FAILED_LIKE and states.get(dep) not in member.wf_ignore
        for dep in member.wf_deps
    )


@PROPERTY
@given(any_workflow)
def test_property_releases_only_with_every_dep_satisfied(members: list[Member]) -> None:
    releases, dooms = settle(members)
    after = {x.wf_name: x.state for x in applied(members, releases, dooms)}
    by_id = {x.id: x for x in members}
    for job_id in releases:
        member = by_id[job_id]
        assert satisfied_by(member, after), (member, after)


@PROPERTY
@given(any_workflow)
def test_property_dooms_only_with_an_unignored_failed_or_cancelled_dep(
    members: list[Member],
) -> None:
    releases, dooms = settle(members)
    after = {x.wf_name: x.state for x in applied(members, releases, dooms)}
    before = {x.wf_name: x.state for x in members}
    by_id = {x.id: x for x in members}
    doomed_names = {by_id[i].wf_name for i in dooms}
    for job_id in dooms:
        member = by_id[job_id]
        culprits = [
            dep for dep in member.wf_deps
            if after.get(dep) in FAILED_LIKE and after.get(dep) not in member.wf_ignore
        ]
        assert culprits, (member, after)
        # Each culprit was terminal-failed already, or was itself doomed in this settle.
        for dep in culprits:
            assert before[dep] in FAILED_LIKE or dep in doomed_names


@PROPERTY
@given(any_workflow)
def test_property_settling_the_applied_result_again_is_a_no_op(members: list[Member]) -> None:
    releases, dooms = settle(members)
    assert settle(applied(members, releases, dooms)) == ([], [])


@PROPERTY
@given(any_workflow)
def test_property_releases_and_dooms_are_disjoint_held_members_with_deps(
    members: list[Member],
) -> None:
    releases, dooms = settle(members)
    assert len(releases) == len(set(releases))
    assert len(dooms) == len(set(dooms))
    assert not set(releases) & set(dooms)
    eligible = {x.id for x in members if x.state == "held" and x.wf_deps}
    assert set(releases) <= eligible
    assert set(dooms) <= eligible


@PROPERTY
@given(any_workflow, st.randoms(use_true_random=False))
def test_property_result_does_not_depend_on_input_order(
    members: list[Member], rnd: random.Random
) -> None:
    releases, dooms = settle(members)
    shuffled = list(members)
    rnd.shuffle(shuffled)
    releases2, dooms2 = settle(shuffled)
    assert sorted(releases2) == sorted(releases)
    assert sorted(dooms2) == sorted(dooms)


def oracle(members: Sequence[Member]) -> tuple[set[int], set[int]]:
    """An independent statement of §8.3 for acyclic workflows: resolve each member from
    its deps' *final* states, recursively (a doom is a cancellation for dependents)."""
    by_name = {x.wf_name: x for x in members}
    final: dict[str | None, str] = {}

    def resolve(name: str) -> str | None:
        if name not in by_name:
            return None
        if name in final:
            return final[name]
        member = by_name[name]
        state = member.state
        if state == "held" and member.wf_deps:
            deps = {dep: resolve(dep) for dep in member.wf_deps}
            if any(s in FAILED_LIKE and s not in member.wf_ignore for s in deps.values()):
                state = "cancelled"
            elif all(
                s == "succeeded" or (s in FAILED_LIKE and s in member.wf_ignore)
                for s in deps.values()
            ):
                state = "ready"
        final[name] = state
        return state

    releases, dooms = set(), set()
    for member in members:
        assert member.wf_name is not None
        state = resolve(member.wf_name)
        if member.state == "held" and state == "ready":
            releases.add(member.id)
        elif member.state == "held" and state == "cancelled":
            dooms.add(member.id)
    return releases, dooms


@PROPERTY
@given(workflows(acyclic=True))
def test_property_matches_an_independent_oracle_on_acyclic_workflows(
    members: list[Member],
) -> None:
    assert outcome(members) == oracle(members)
