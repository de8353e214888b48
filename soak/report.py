"""The soak report (Markdown)."""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from soak.check import (
    LEASE_EXPIRED,
    Invariant,
    Snapshot,
    attempt_ends,
    duplicate_allowance,
    duplicated_steps,
)
from soak.kinds import BUDGET_USD


def render(snap: Snapshot, results: list[Invariant], *, opts: Any, started: datetime,
           elapsed: float, waves: int, bursts: int, quiesced: bool, quiesce_s: float,
           events: list[str], seed: int | None) -> str:
    failed = [r for r in results if not r.ok]
    verdict = "**PASS**" if not failed else f"**FAIL** ({len(failed)} invariant(s))"
    chaos = snap.chaos
    jobs = {job["id"]: job for job in snap.jobs}
    states = Counter(job["state"] for job in snap.jobs)
    by_kind = Counter(job["kind"] for job in snap.jobs)
    ledger = Counter(row["kind"] for row in snap.ledger)
    effects: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in snap.effects:
        effects[row["job_id"]].append(row)
    dups = duplicated_steps(jobs, effects)
    step_execs = sum(len(rows) for job_id, rows in effects.items()
                     if jobs.get(job_id, {}).get("kind") in ("soak.step", "soak.budget",
                                                              "soak.awaiter"))
    distinct = step_execs - dups
    reruns = sum(len(rows) - 1 for job_id, rows in effects.items()
                 if jobs.get(job_id, {}).get("kind") not in ("soak.step", "soak.budget",
                                                              "soak.awaiter"))
    outcomes = Counter(row["outcome"] for row in snap.acks)
    attempts = sum(job["attempt"] for job in snap.jobs)
    cron = sum(1 for job in snap.jobs if job["cron_name"] is not None)
    restart = (f"every {opts.db_restart_every:g} s" if opts.db_restart_every
               else "at the 1/3 and 2/3 marks")
    pooler = bool(getattr(opts, "pooler", False))
    reclaimed = sum(ends.count(LEASE_EXPIRED) for job in snap.jobs
                    for ends in attempt_ends(job).values())
    lines = [
        f"# Soak report — {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"`python -m soak --duration {opts.duration:g} --workers {opts.workers}"
        + (f" --db-restart-every {opts.db_restart_every:g}" if opts.db_restart_every else "")
        + (f" --pooler --pooler-restart-every {opts.pooler_restart_every:g}" if pooler else "")
        + f" --seed {seed}`: {opts.duration / 60:.1f} min of workload under chaos "
        f"({elapsed / 60:.1f} min in all), {opts.workers} worker processes (one behind the "
        f"cuttable proxy), `kill -9` about every {opts.kill_every:g} s, PostgreSQL "
        f"crash-restarted {restart}, the proxied worker cut off about every "
        f"{opts.cut_every:g} s for longer than its lease."
        + (f" Every worker behind a PgBouncer in transaction-pooling mode "
           f"(`pooler=\"transaction\"`; the proxied one through the proxy in front of it), "
           f"every other one LISTENing on a direct URL, the rest polling; the PgBouncer "
           f"`SIGKILL`ed and restarted about every {opts.pooler_restart_every:g} s."
           if pooler else ""),
        "",
        f"## Verdict: {verdict}",
        "",
        "## Load",
        f"- Workload waves: {waves}; unique bursts: {bursts}",
        f"- Jobs: {len(snap.jobs)} ({cron} from cron) — by kind: "
        + ", ".join(f"{k}={n}" for k, n in sorted(by_kind.items())),
        "- Ledgered by the driver: " + ", ".join(f"{k}={n}" for k, n in sorted(ledger.items())),
        "- Final states: " + ", ".join(f"{k}={n}" for k, n in sorted(states.items())),
        f"- Attempts claimed: {attempts}; quiesced: {'yes' if quiesced else 'NO'} "
        f"({quiesce_s:.0f} s after the chaos stopped)",
        "",
        "## Chaos",
        f"- Worker kills (`kill -9`): {chaos.get('kills', 0)}",
        f"- PostgreSQL crash-restarts (immediate stop): {chaos.get('db_restarts', 0)}",
        f"- Proxy cuts (connections dropped and refused for lease + 1.5 to 3 s): "
        f"{chaos.get('proxy_cuts', 0)}",
        *([f"- PgBouncer restarts (`SIGKILL`, down 0.2 to 1.5 s, every pooled connection "
           f"dropped): {chaos.get('pooler_restarts', 0)}"] if pooler else []),
        f"- Worker processes that died by themselves: {chaos.get('unexpected_exits', 0)}",
        "",
        "## At-least-once accounting",
        f"- Memoized step bodies executed: {step_execs} for {distinct} distinct steps; "
        f"duplicated executions: {dups} (allowance {duplicate_allowance(chaos)}: each kill "
        "or cut can interrupt a worker's slots, each restart every worker's"
        + ("; PgBouncer restarts add nothing" if pooler else "") + ")",
        f"- Attempts reclaimed after their lease lapsed (`lease_expired`): {reclaimed} — "
        "the only re-runs of a job without an ending of its own (see no-double-runs)",
        f"- Job-level side effects re-run by retried attempts (children, workflow members, "
        f"unique, cron): {reruns}",
        "- Outcomes the workers reported: "
        + ", ".join(f"{k}={n}" for k, n in sorted(outcomes.items())),
        f"- Acks the workers discarded as stale (rejected by the fence, or given up while "
        f"the database was unreachable — the lease then lapses and the job is reclaimed): "
        f"{outcomes.get('stale', 0)}; executions that noticed their lease was lost: "
        f"{outcomes.get('lost', 0)}",
        "",
        *_races(snap),
        "## Invariants (contract §11)",
    ]
    for result in results:
        mark = "✓" if result.ok else "✗"
        lines.append(f"- {mark} **{result.name}** ({result.clause}): {result.what}")
        if not result.ok:
            shown = ", ".join(str(o) for o in result.offenders[:20])
            more = f" (+{len(result.offenders) - 20} more)" if len(result.offenders) > 20 else ""
            lines.append(f"  - offending jobs: {shown}{more}")
            lines += [f"  - {note}" for note in result.notes[:8]]
    lines += ["", "## Chaos log (first 40 events)", ""]
    lines += [f"    {event}" for event in events[:40]] or ["    (none)"]
    return "\n".join(lines) + "\n"


def _races(snap: Snapshot) -> list[str]:
    """Issue 38's races: what the parallel, cancellable and spawner jobs did."""
    cap = round(BUDGET_USD * 1_000_000)
    parallel = [job for job in snap.jobs if job["kind"] == "soak.parallel"]
    zombies = [job for job in parallel
               if any(LEASE_EXPIRED in ends for ends in attempt_ends(job).values())]
    over = [job["id"] for job in parallel if job["spent_usd_micros"] > cap]
    asked = Counter(row["status"] for row in snap.cancels)
    cancellable = Counter(job["state"] for job in snap.jobs if job["kind"] == "soak.cancellable")
    spawners = Counter(job["state"] for job in snap.jobs if job["kind"] == "soak.spawner")
    return [
        "## Races (issue 38)",
        f"- Parallel steps under max_cost: {len(parallel)} jobs; spent past the $0.50 cap: "
        f"{len(over)} {sorted(over)[:10] if over else ''}; jobs a run of which lost its lease "
        f"with steps in flight (not held to the cap): {len(zombies)}",
        "- Cancels asked while jobs retried: "
        + (", ".join(f"{k}={n}" for k, n in sorted(asked.items())) or "none")
        + "; cancellable jobs ended: "
        + (", ".join(f"{k}={n}" for k, n in sorted(cancellable.items())) or "none"),
        "- Spawners (threads that enqueue under an authority) ended: "
        + (", ".join(f"{k}={n}" for k, n in sorted(spawners.items())) or "none"),
        "",
    ]
