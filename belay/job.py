"""What reads return: jobs, steps, events, workflow status.

Rows are read by column name, never by position; a column this version does
not know is ignored (contract §1: changes within a major are additive).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from belay.codec import decode_value

STATES: Final = (
    "ready", "running", "awaiting", "held", "paused", "succeeded", "failed", "cancelled",
)
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
INCOMPLETE: Final = frozenset({"ready", "running", "awaiting", "held", "paused"})
PARKED: Final = frozenset({"ready", "awaiting", "held", "paused"})


@dataclass(frozen=True)
class Job:
    """One ``belay_jobs`` row. ``result`` is the decoded envelope."""

    id: int
    kind: str
    queue: str
    state: str
    input: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    attempt: int = 0
    max_attempts: int = 20
    partition_key: str | None = None
    ready_at: datetime | None = None
    lease_until: datetime | None = None
    leased_by: str | None = None
    await_scope: str | None = None
    await_name: str | None = None
    workflow_id: str | None = None
    wf_name: str | None = None
    wf_deps: list[str] = field(default_factory=list)
    wf_ignore: list[str] = field(default_factory=list)
    cron_name: str | None = None
    cron_slot: datetime | None = None
    unique_key: str | None = None
    unique_mode: str | None = None
    parent_id: int | None = None
    budget_usd_micros: int | None = None
    budget_tokens: int | None = None
    spent_usd_micros: int = 0
    spent_tokens: int = 0
    result_envelope: bytes | None = field(default=None, repr=False)
    errors: list[Any] = field(default_factory=list)
    cancel_requested: bool = False
    inserted_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    #: True when enqueue found an existing holder of the unique key (§5.2), or
    #: a top-up found its idempotency key already used (it changed nothing).
    duplicate: bool = False

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, duplicate: bool = False) -> Job:
        # The hot path of every claim: fill the instance's fields directly
        # (what the generated __init__ of a frozen dataclass does, one
        # object.__setattr__ per field, at a fraction of the cost).
        fields = dict(_DEFAULTS)
        for name, value in row.items():
            if name == "result":
                fields["result_envelope"] = None if value is None else bytes(value)
            elif name in _FIELDS and value is not None:
                fields[name] = value
        for name in ("id", "kind", "queue", "state"):
            if name not in fields:
                raise KeyError(f"a job row needs the column {name!r}")
        for name, fresh in _FRESH.items():
            if name not in fields:
                fields[name] = fresh()
        fields["duplicate"] = duplicate
        job = object.__new__(cls)
        job.__dict__.update(fields)
        return job

    @classmethod
    def from_columns(cls, names: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[Job]:
        """Jobs from tuple rows with these column names (a claim's): what
        :meth:`from_row` makes of each, without a dict per row. Columns this
        version does not know are left out; a NULL keeps the field's default."""
        keep = [(i, "result_envelope" if name == "result" else name)
                for i, name in enumerate(names) if name in _FIELDS or name == "result"]
        if {"id", "kind", "queue", "state"} - {name for _, name in keep}:
            raise KeyError(f"job rows need the columns id, kind, queue and state: {names}")
        plain = len(keep) == len(names)
        fields = [name for _, name in keep]
        # Fields a NULL must not overwrite: those whose default is not None.
        guarded = [name for name in fields if name in _FRESH or _DEFAULTS.get(name) is not None]
        missing = [name for name in _FRESH if name not in fields]
        jobs = []
        for row in rows:
            job = object.__new__(cls)
            state = job.__dict__
            state.update(_DEFAULTS)
            state.update(zip(fields, row if plain else [row[i] for i, _ in keep], strict=True))
            for name in guarded:
                if state[name] is None:
                    state[name] = _FRESH[name]() if name in _FRESH else _DEFAULTS[name]
            for name in missing:
                state[name] = _FRESH[name]()
            envelope = state["result_envelope"]
            if envelope is not None and type(envelope) is not bytes:
                state["result_envelope"] = bytes(envelope)
            jobs.append(job)
        return jobs

    @classmethod
    def trusted(cls, fields: Mapping[str, Any]) -> Job:
        """A job from values belay built itself (names and types already right):
        the defaults, then ``fields`` over them, with no per-column checks."""
        job = object.__new__(cls)
        job.__dict__.update(_DEFAULTS)
        job.__dict__.update(fields)
        return job

    @property
    def result(self) -> Any:
        """The decoded result (JSON or Erlang term); ``None`` when there is none."""
        return decode_value(self.result_envelope)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def capped(self) -> bool:
        """Whether the job has a budget cap (its success is fenced on its spend)."""
        return self.budget_usd_micros is not None or self.budget_tokens is not None

    @property
    def budget_usd(self) -> float | None:
        return None if self.budget_usd_micros is None else self.budget_usd_micros / 1_000_000

    @property
    def spent_usd(self) -> float:
        return self.spent_usd_micros / 1_000_000

    def replace(self, **changes: Any) -> Job:
        return dataclasses.replace(self, **changes)


_FIELDS: Final = frozenset(
    f.name
    for f in dataclasses.fields(Job)
    if f.name not in ("result_envelope", "duplicate")
)
#: Fields a row may leave out (or hold NULL in): their plain defaults...
_DEFAULTS: Final = {
    f.name: f.default for f in dataclasses.fields(Job) if f.default is not dataclasses.MISSING
}
#: ...and the mutable ones, made fresh for each job.
_FRESH: Final = {
    f.name: f.default_factory
    for f in dataclasses.fields(Job)
    if f.default_factory is not dataclasses.MISSING
}


@dataclass(frozen=True)
class Step:
    """One journaled step: its decoded value and recorded cost."""

    seq: int
    name: str
    value: Any
    usd_micros: int
    tokens: int
    inserted_at: datetime | None

    @property
    def usd(self) -> float:
        return self.usd_micros / 1_000_000

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Step:
        return cls(
            seq=row["seq"],
            name=row["name"],
            value=decode_value(row["value"]),
            usd_micros=row["usd_micros"],
            tokens=row["tokens"],
            inserted_at=row["inserted_at"],
        )


@dataclass(frozen=True)
class Event:
    """One entry of a job's append-only event stream."""

    seq: int
    payload: Any
    inserted_at: datetime | None


@dataclass(frozen=True)
class WorkflowStatus:
    """Every member of a workflow and a summary of their states."""

    workflow_id: str
    jobs: list[Job]

    @property
    def total(self) -> int:
        return len(self.jobs)

    @property
    def state_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs:
            counts[job.state] = counts.get(job.state, 0) + 1
        return counts

    @property
    def done(self) -> bool:
        """True once every member is terminal (an unknown id is never done)."""
        return bool(self.jobs) and all(job.terminal for job in self.jobs)

    def by_name(self) -> dict[str, Job]:
        return {job.wf_name: job for job in self.jobs if job.wf_name is not None}
