"""Draining: every job claimable now, run in the calling thread (tests, scripts).

No thread starts. Admission applies as on a running worker (limits, rate
windows, partitions, pauses); a chunk worker's jobs run in chunks of what is
claimable now, up to its size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from belay.job import Job
from belay.parts.execution import Execution
from belay.queues import QueueSpec
from belay.registry import Registry

Claim = Callable[[QueueSpec, int], list[Job]]


def drain(
    specs: Sequence[QueueSpec],
    claim: Claim,
    registry: Registry,
    *,
    execute: Callable[[Execution], str],
    execute_chunk: Callable[[list[Execution]], dict[int, str]],
    return_unknown: Callable[[Job], None],
    max_jobs: int | None = None,
) -> dict[str, int]:
    """Claim and run until nothing is claimable (or ``max_jobs`` ran);
    returns counts by outcome (``"unknown"``: a kind no worker here knows,
    snoozed back)."""
    counts: dict[str, int] = {}
    ran = 0
    while max_jobs is None or ran < max_jobs:
        batch = _claim_some(specs, claim, registry, None if max_jobs is None else max_jobs - ran)
        if not batch:
            break
        for outcome in _run(batch, registry, execute, execute_chunk, return_unknown):
            counts[outcome] = counts.get(outcome, 0) + 1
        ran += len(batch)
    return counts


def _claim_some(specs: Sequence[QueueSpec], claim: Claim, registry: Registry,
                room: int | None) -> list[Job]:
    """One job, or for a chunk worker as much of a chunk as is claimable now."""
    for spec in specs:
        jobs = claim(spec, 1)
        if not jobs:
            continue
        definition = registry.get(jobs[0].kind)
        if definition is not None and definition.chunk is not None:
            size = definition.chunk.size if room is None else min(definition.chunk.size, room)
            if size > 1:
                jobs += claim(spec, size - 1)
        return jobs
    return []


def _run(jobs: list[Job], registry: Registry, execute: Callable[[Execution], str],
         execute_chunk: Callable[[list[Execution]], dict[int, str]],
         return_unknown: Callable[[Job], None]) -> list[str]:
    outcomes: list[str] = []
    chunks: dict[str, list[Execution]] = {}
    sizes: dict[str, int] = {}
    for job in jobs:
        definition = registry.get(job.kind)
        if definition is None:
            return_unknown(job)
            outcomes.append("unknown")
        elif definition.chunk is not None:
            chunks.setdefault(job.kind, []).append(Execution(job, definition, None))
            sizes[job.kind] = definition.chunk.size
        else:
            outcomes.append(execute(Execution(job, definition, None)))
    # The claim may hold several chunk kinds: each runs in chunks of its own size.
    for kind, executions in chunks.items():
        for start in range(0, len(executions), sizes[kind]):
            outcomes += execute_chunk(executions[start:start + sizes[kind]]).values()
    return outcomes
