"""Declared workflows (contract §8.3): named jobs joined by dependencies.

A :class:`Workflow` is a builder: members are added by name, each with the
names it depends on, and ``enqueue()`` inserts them all in one transaction —
members with dependencies ``held``, the rest ``ready``. From then on the
database drives it: every terminal write settles the workflow (belay/settle.py),
releasing a held member once its dependencies succeeded and cancelling
("dooming") it when one failed or was cancelled, unless it ``ignore``s that
outcome.

Everything here is pure; the insert is :meth:`belay.Belay.enqueue_workflow`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final

import psycopg

from belay import names
from belay.enqueue import JobSpec, build_row
from belay.errors import ValidationError

if TYPE_CHECKING:
    from belay.client import Belay
    from belay.job import Job

#: The dependency outcomes a member may treat as satisfied (§8.3 ``wf_ignore``).
IGNORABLE: Final = ("failed", "cancelled")


@dataclass(frozen=True)
class WorkflowMember:
    """One declared member: a job to enqueue plus its place in the graph.

    ``ignore`` is None when the member takes the workflow-wide default.
    """

    name: str
    kind: Any
    input: Mapping[str, Any] | None
    deps: tuple[str, ...]
    ignore: tuple[str, ...] | None
    options: Mapping[str, Any]


class Workflow:
    """A set of named jobs with dependencies, inserted together.

    ``name`` labels the workflow; its id is ``f"{name}-{uuid4().hex}"`` unless
    ``workflow_id`` is given. An explicit id makes ``enqueue()`` idempotent:
    when that workflow already has members, they are returned (marked
    ``duplicate=True``) instead of inserting again. ``ignore`` is the default
    ``ignore`` of every member that does not set its own.
    """

    def __init__(
        self,
        name: str,
        *,
        workflow_id: str | None = None,
        ignore: Iterable[str] = (),
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValidationError(
                f"a workflow name is a non-empty string like 'nightly', got {name!r}"
            )
        if workflow_id is None:
            workflow_id = f"{name}-{uuid.uuid4().hex}"
        elif not isinstance(workflow_id, str) or not workflow_id.strip():
            raise ValidationError(
                f"workflow_id must be a non-empty string like 'nightly-2026-11-29', "
                f"got {workflow_id!r}"
            )
        names.check_text(name, "a workflow name")
        names.check_text(workflow_id, "workflow_id", max_bytes=names.MAX_KEY_BYTES)
        self.name = name
        self.workflow_id = workflow_id
        self.ignore: tuple[str, ...] = _ignore(ignore, f"workflow {name!r}")
        self._members: dict[str, WorkflowMember] = {}

    @property
    def members(self) -> list[WorkflowMember]:
        """The declared members, in the order they were added."""
        return list(self._members.values())

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __repr__(self) -> str:
        return (f"<belay workflow {self.workflow_id!r}: "
                f"{', '.join(self._members) or 'no members'}>")

    def add(
        self,
        name: str,
        worker: Any,
        input: Mapping[str, Any] | None = None,
        *,
        deps: Sequence[str] = (),
        ignore: Iterable[str] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        budget: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        partition_key: str | None = None,
        encrypt: bool | None = None,
        unique: object = None,
    ) -> Workflow:
        """Add a member named ``name`` running ``worker`` (a ``@belay.worker`` or a
        kind name) on ``input``; returns the workflow, so calls chain.

        ``deps`` names the members it waits for (added before or after this
        one); ``ignore`` lists the dependency outcomes (``"failed"``,
        ``"cancelled"``) it runs after anyway. The other options are those of
        :meth:`belay.Belay.enqueue`, checked now.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValidationError(
                f"a workflow member name is a non-empty string like 'extract', got {name!r}"
            )
        names.check_text(name, "a workflow member name")
        if name in self._members:
            raise ValidationError(
                f"workflow {self.name!r} already has a member named {name!r}; "
                "give each member its own name"
            )
        what = f"workflow member {name!r}"
        if unique is not None:
            raise ValidationError(
                f"{what}: members can't carry unique options; make the whole workflow "
                "idempotent with an explicit Workflow(..., workflow_id=...) instead"
            )
        dep_names = _deps(deps, what)
        if dep_names and (delay is not None or run_at is not None):
            raise ValidationError(
                f"{what} has deps, so it becomes ready when they finish and a delay or "
                "run_at would be ignored; schedule a member without deps instead"
            )
        options: dict[str, Any] = {
            "queue": queue, "priority": priority, "delay": delay, "run_at": run_at,
            "max_attempts": max_attempts, "budget": budget, "meta": meta,
            "partition_key": partition_key, "encrypt": encrypt,
        }
        member = WorkflowMember(
            name=name, kind=worker, input=input, deps=dep_names,
            ignore=None if ignore is None else _ignore(ignore, what),
            options=options,
        )
        # The job options are checked now, so the error points at this call.
        with member_errors(name):
            build_row(self._spec(member), datetime.now(timezone.utc))
        self._members[name] = member
        return self

    def validate(self) -> None:
        """Raise :class:`belay.ValidationError` unless the workflow can be enqueued:
        it has members, every dep names one of them, and the deps form no cycle."""
        if not self._members:
            raise ValidationError(
                f"workflow {self.name!r} has no members; add some with .add(name, worker, input)"
            )
        known = ", ".join(self._members)
        for member in self._members.values():
            unknown = [dep for dep in member.deps if dep not in self._members]
            if unknown:
                raise ValidationError(
                    f"workflow member {member.name!r} depends on "
                    f"{', '.join(map(repr, unknown))}, not a member of workflow "
                    f"{self.name!r} (members: {known}); add it or fix the name"
                )
            if member.name in member.deps:
                raise ValidationError(
                    f"workflow member {member.name!r} lists itself in its deps; "
                    "a member can't wait for itself"
                )
        cycle = find_cycle({m.name: m.deps for m in self._members.values()})
        if cycle is not None:
            raise ValidationError(
                f"workflow {self.name!r} has a dependency cycle: {' → '.join(cycle)} "
                "(each depends on the next, so none of them could ever run); "
                "remove one of these deps"
            )

    def specs(self) -> list[tuple[str, JobSpec]]:
        """Validate, then each member's name and the job to insert for it."""
        self.validate()
        return [(member.name, self._spec(member)) for member in self._members.values()]

    def _spec(self, member: WorkflowMember) -> JobSpec:
        return JobSpec(
            member.kind,
            member.input,
            **member.options,
            internal={
                "state": "held" if member.deps else "ready",
                "workflow_id": self.workflow_id,
                "wf_name": member.name,
                "wf_deps": member.deps,
                "wf_ignore": self.ignore if member.ignore is None else member.ignore,
                # Never a unique key, not even a worker's default one: a member
                # skipped as a duplicate would leave its dependents held forever.
                "unique_key": None,
                "unique_mode": None,
            },
        )

    def enqueue(
        self,
        *,
        conn: psycopg.Connection[Any] | None = None,
        client: Belay | None = None,
    ) -> dict[str, Job]:
        """Insert every member in one transaction (the caller's, with ``conn=``);
        returns the jobs by member name. See :meth:`belay.Belay.enqueue_workflow`."""
        if client is None:
            from belay.defaults import default

            client = default()
        return client.enqueue_workflow(self, conn=conn)

    def existing(self, jobs: Sequence[Job]) -> dict[str, Job]:
        """The members an earlier enqueue of this workflow id inserted, by name,
        marked ``duplicate=True``; refuses a different set of members."""
        found = {job.wf_name: job for job in jobs if job.wf_name is not None}
        if set(found) != set(self._members) or len(found) != len(jobs):
            raise ValidationError(
                f"workflow id {self.workflow_id!r} is already taken by members "
                f"{', '.join(sorted(map(str, (j.wf_name for j in jobs))))}, not this "
                f"workflow's {', '.join(sorted(self._members))}; give it another workflow_id"
            )
        return {name: found[name].replace(duplicate=True) for name in self._members}


def find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
    """A dependency cycle as a path that starts and ends on the same name
    (``["a", "b", "a"]``: a depends on b, b on a), or None. Names missing from
    ``graph`` are leaves. Deterministic: the first cycle met in ``graph`` order."""
    done: set[str] = set()
    for root in graph:
        if root in done:
            continue
        # Depth-first with an explicit stack, so a long chain can't hit the
        # recursion limit; ``path`` is the chain of dependents being explored.
        path = [root]
        pending = [iter(graph[root])]
        while pending:
            dep = next(pending[-1], None)
            if dep is None:
                pending.pop()
                done.add(path.pop())
            elif dep in path:
                return [*path[path.index(dep):], dep]
            elif dep in graph and dep not in done:
                path.append(dep)
                pending.append(iter(graph[dep]))
    return None


def _deps(deps: Any, what: str) -> tuple[str, ...]:
    if isinstance(deps, str) or not isinstance(deps, Iterable):
        raise ValidationError(
            f"{what}: deps is a list of member names like deps=['extract'], got {deps!r}"
        )
    names = tuple(deps)
    for dep in names:
        if not isinstance(dep, str) or not dep.strip():
            raise ValidationError(
                f"{what}: each dep is a member name (a non-empty string), got {dep!r}"
            )
    repeated = sorted({dep for dep in names if names.count(dep) > 1})
    if repeated:
        raise ValidationError(f"{what} lists {', '.join(map(repr, repeated))} twice in deps")
    return names


def _ignore(ignore: Any, what: str) -> tuple[str, ...]:
    if isinstance(ignore, str) or not isinstance(ignore, Iterable):
        raise ValidationError(
            f"{what}: ignore is a list like ignore=['failed'], got {ignore!r}"
        )
    values = tuple(dict.fromkeys(ignore))
    wrong = [value for value in values if value not in IGNORABLE]
    if wrong:
        raise ValidationError(
            f"{what}: ignore takes 'failed' and/or 'cancelled' (the dependency outcomes "
            f"to run after anyway), got {', '.join(map(repr, wrong))}"
        )
    return values


@contextmanager
def member_errors(name: str) -> Iterator[None]:
    """Say which member a ValidationError raised inside is about."""
    try:
        yield
    except ValidationError as exc:
        raise ValidationError(f"workflow member {name!r}: {exc}") from None
