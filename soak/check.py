"""The checker: reads only the database, after quiescence, and verifies the
contract's §11 invariants one by one.

:func:`load` reads the rows; :func:`check` is a pure function of them (so
tests can hand it rows that break each invariant).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from belay.codec import decode_value
from belay.settle import Member, settle
from soak.kinds import (
    BUDGET_ALLOWED,
    BUDGET_USD,
    PARALLEL_ALLOWED,
    SPAWNER_AUTHORITY,
    STEP_USD,
)

Row = dict[str, Any]

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
#: Outcomes that wrote the row and used up the attempt (parks and snoozes give
#: the attempt back: the next claim reuses its number).
APPLIED = frozenset({"succeeded", "failed", "cancelled", "retry"})
#: Memoized step names per kind: their bodies run at most once per clean attempt.
STEP_KINDS = frozenset({"soak.step", "soak.budget", "soak.awaiter", "soak.parallel"})
#: How far two processes' "now" may disagree when ordering a key's holders.
CLOCK_SLACK = timedelta(milliseconds=250)
PLANNED = "planned failure"
#: The errors entry the reclaim writes for an attempt whose lease expired.
LEASE_EXPIRED = "lease_expired"


@dataclass
class Snapshot:
    """Everything the checker reads, as plain rows."""

    jobs: list[Row] = field(default_factory=list)
    steps: list[Row] = field(default_factory=list)
    effects: list[Row] = field(default_factory=list)
    acks: list[Row] = field(default_factory=list)
    ledger: list[Row] = field(default_factory=list)
    bursts: list[Row] = field(default_factory=list)
    signals: list[Row] = field(default_factory=list)
    chaos: dict[str, int] = field(default_factory=dict)
    #: The driver's cancels: job id, what cancel_job answered, the attempt after.
    cancels: list[Row] = field(default_factory=list)


@dataclass
class Invariant:
    name: str
    clause: str
    what: str
    offenders: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.offenders

    def fail(self, offender: Any, note: str) -> None:
        if offender not in self.offenders:
            self.offenders.append(offender)
        if len(self.notes) < 20:
            self.notes.append(note)


# -- Reading the database ------------------------------------------------------------

JOB_COLUMNS = (
    "id, kind, queue, state, input, attempt, max_attempts, result, errors, unique_key, "
    "unique_mode, cron_name, cron_slot, parent_id, workflow_id, wf_name, wf_deps, wf_ignore, "
    "inserted_at, started_at, finished_at, budget_usd_micros, spent_usd_micros, meta"
)


def load(conn: psycopg.Connection[Any]) -> Snapshot:
    """Read every row the checker needs (a quiesced database: nothing moves)."""
    cur = conn.cursor(row_factory=dict_row)
    jobs = cur.execute(f"SELECT {JOB_COLUMNS} FROM belay_jobs ORDER BY id").fetchall()
    for job in jobs:
        job["result"] = None if job["result"] is None else decode_value(job["result"])
    steps = cur.execute("SELECT job_id, name, value FROM belay_steps ORDER BY job_id, seq"
                        ).fetchall()
    for step in steps:
        step["value"] = decode_value(step["value"])
    chaos = {row["what"]: row["n"] for row in
             cur.execute("SELECT what, n FROM soak_chaos").fetchall()}
    return Snapshot(
        jobs=jobs,
        steps=steps,
        effects=cur.execute("SELECT job_id, step, attempt, tag, at FROM soak_effects ORDER BY id"
                            ).fetchall(),
        acks=cur.execute("SELECT job_id, attempt, outcome, tag FROM soak_acks ORDER BY id"
                         ).fetchall(),
        ledger=cur.execute("SELECT job_id, kind, expected FROM soak_ledger ORDER BY job_id"
                           ).fetchall(),
        bursts=cur.execute("SELECT key, mode, ids, fresh, retried FROM soak_bursts ORDER BY id"
                           ).fetchall(),
        signals=cur.execute("SELECT scope, name, payload FROM belay_signals").fetchall(),
        chaos=chaos,
        cancels=cur.execute("SELECT job_id, status, attempt FROM soak_cancels ORDER BY job_id"
                            ).fetchall(),
    )


# -- The invariants -------------------------------------------------------------------


def duplicate_allowance(chaos: Mapping[str, int]) -> int:
    """The most duplicated step executions chaos can explain: each kill or cut
    interrupts at most a worker's slots, each database restart every worker's.
    PgBouncer restarts (``--pooler``) add nothing: their duplicates must fit in
    what the other chaos explains."""
    slots = chaos.get("slots_per_worker", 16)
    workers = chaos.get("workers", 3)
    return 10 + slots * (chaos.get("kills", 0) + chaos.get("proxy_cuts", 0)) + (
        slots * workers * chaos.get("db_restarts", 0))


def check(snap: Snapshot) -> list[Invariant]:
    jobs = {job["id"]: job for job in snap.jobs}
    ledger = {row["job_id"]: row for row in snap.ledger}
    steps: dict[int, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for row in snap.steps:
        steps[row["job_id"]][row["name"]].append(row["value"])
    effects: dict[int, list[Row]] = defaultdict(list)
    for row in snap.effects:
        effects[row["job_id"]].append(row)
    acks: dict[int, list[Row]] = defaultdict(list)
    for row in snap.acks:
        acks[row["job_id"]].append(row)
    children: dict[int, list[Row]] = defaultdict(list)
    for job in snap.jobs:
        if job["parent_id"] is not None:
            children[job["parent_id"]].append(job)
    signals = {(row["scope"], row["name"]): row["payload"] for row in snap.signals}

    results = [
        _quiescence(snap.jobs),
        _lost(jobs, ledger, snap.bursts),
        _stale_acks(snap.jobs, acks),
        _steps(jobs, ledger, steps),
        _budget(jobs, ledger, steps, effects),
        _workflows(jobs, ledger, effects),
        _cron(snap.jobs),
        _unique(snap.jobs, snap.bursts),
        _children(jobs, ledger, steps, children),
        _awaiters(jobs, ledger, signals),
        _attempts(snap.jobs),
        _double_runs(snap.jobs, effects, acks),
        _rerun(jobs, effects),
        _duplicates(jobs, effects, snap.chaos),
        _parallel(jobs, ledger, steps),
        _cancels(jobs, ledger, effects, snap.cancels),
        _threads(snap.jobs, jobs, ledger),
    ]
    return results


def _quiescence(jobs: Iterable[Row]) -> Invariant:
    inv = Invariant("all-terminal", "§11.1", "every job reached a terminal state")
    for job in jobs:
        if job["state"] not in TERMINAL:
            inv.fail(job["id"], f"job {job['id']} ({job['kind']}) is {job['state']}")
    return inv


def _lost(jobs: Mapping[int, Row], ledger: Mapping[int, Row], bursts: Iterable[Row]) -> Invariant:
    inv = Invariant("no-lost-jobs", "§11.1", "every enqueued job is still in belay_jobs")
    for job_id, row in ledger.items():
        if job_id not in jobs:
            inv.fail(job_id, f"ledgered {row['kind']} job {job_id} vanished")
    for burst in bursts:
        for job_id in burst["ids"]:
            if job_id not in jobs:
                inv.fail(job_id, f"unique job {job_id} (key {burst['key']}) vanished")
    return inv


def _stale_acks(jobs: Iterable[Row], acks: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("stale-acks-fenced", "§11.2",
                    "a stale attempt's ack never wrote the row: one applied outcome per "
                    "attempt, one terminal per job, results from the last claimed attempt")
    for job in jobs:
        job_id = job["id"]
        per_attempt: dict[int, int] = defaultdict(int)
        terminal = 0
        for ack in acks.get(job_id, ()):
            if ack["outcome"] in APPLIED:
                per_attempt[ack["attempt"]] += 1
            if ack["outcome"] in TERMINAL:
                terminal += 1
        for attempt, n in per_attempt.items():
            if n > 1:
                inv.fail(job_id, f"job {job_id}: attempt {attempt} wrote the row {n} times")
        if terminal > 1:
            inv.fail(job_id, f"job {job_id}: {terminal} terminal acks applied")
        if job["state"] != "succeeded":
            continue
        result = job["result"]
        if isinstance(result, dict) and "attempt" in result and result["attempt"] != job["attempt"]:
            inv.fail(job_id, f"job {job_id}: result from attempt {result['attempt']}, but "
                             f"attempt {job['attempt']} was the last claimed")
        for error in job["errors"] or ():
            if isinstance(error, dict) and error.get("attempt") == job["attempt"]:
                inv.fail(job_id, f"job {job_id} succeeded on attempt {job['attempt']}, which "
                                 f"also failed: {str(error.get('error'))[:80]}")
    return inv


def _ledgered(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
              kind: str) -> Iterator[tuple[int, Row, Row]]:
    """The driver's ledger entries of one kind whose job is in the database:
    (job id, ledger row, job row)."""
    for job_id, row in ledger.items():
        job = jobs.get(job_id)
        if row["kind"] == kind and job is not None:
            yield job_id, row, job


def _steps(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
           steps: Mapping[int, Mapping[str, list[Any]]]) -> Invariant:
    inv = Invariant("steps-exact", "§11.3",
                    "one journal row per (job, step), journaled values and results exact")
    for job_id, named in steps.items():
        job = jobs.get(job_id)
        for name, values in named.items():
            if len(values) != 1:
                inv.fail(job_id, f"job {job_id} step {name}: {len(values)} journal rows")
            if job is None:
                continue
            value = values[0]
            want: Any = None
            if job["kind"] == "soak.step" and name.startswith("s"):
                want = job["input"]["n"] + int(name[1:])
            elif job["kind"] == "soak.budget" and name.startswith("b"):
                want = int(name[1:])
            elif job["kind"] == "soak.awaiter" and name == "pre":
                want = 1
            elif job["kind"] == "soak.parallel" and name.startswith("p"):
                want = int(name[1:])
            if want is not None and value != want:
                inv.fail(job_id, f"job {job_id} step {name} journaled {value!r}, wanted {want!r}")
    for job_id, row, job in _ledgered(jobs, ledger, "step"):
        want = row["expected"]["value"]
        if job["state"] != "succeeded":
            inv.fail(job_id, f"step job {job_id} ended {job['state']}: "
                             f"{_last_error(job)}")
        elif not isinstance(job["result"], dict) or job["result"].get("value") != want:
            inv.fail(job_id, f"step job {job_id} result {job['result']!r}, wanted {want}")
    return inv


def _last_error(job: Row) -> str:
    errors = job["errors"] or []
    return str(errors[-1])[:160] if errors else "no error"


def _budget(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
            steps: Mapping[int, Mapping[str, list[Any]]],
            effects: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("budget", "§11.4",
                    f"budget jobs fail budget_exceeded with exactly {BUDGET_ALLOWED} steps "
                    "(the first crossing one) and never run a step past it")
    want_spend = round(BUDGET_ALLOWED * STEP_USD * 1_000_000)
    for job_id, _, job in _ledgered(jobs, ledger, "budget"):
        recorded = sorted(steps.get(job_id, {}))
        errors = job["errors"] or []
        last = errors[-1] if errors else {}
        ran = sorted({e["step"] for e in effects.get(job_id, ())})
        if job["state"] != "failed":
            inv.fail(job_id, f"budget job {job_id} ended {job['state']}, wanted failed")
        elif not isinstance(last, dict) or last.get("error") != "budget_exceeded":
            inv.fail(job_id, f"budget job {job_id} failed with {str(last)[:120]}")
        if len(recorded) != BUDGET_ALLOWED:
            inv.fail(job_id, f"budget job {job_id} recorded {len(recorded)} steps {recorded}, "
                             f"wanted {BUDGET_ALLOWED}")
        past = [s for s in ran if int(s[1:]) > BUDGET_ALLOWED]
        if past:
            inv.fail(job_id, f"budget job {job_id} ran step(s) {past} past the crossing step")
        if job["spent_usd_micros"] != want_spend:
            inv.fail(job_id, f"budget job {job_id} spent {job['spent_usd_micros']} µ$, "
                             f"wanted {want_spend}")
    return inv


def _workflows(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
               effects: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("workflows", "§11.5",
                    "members run only after their deps succeeded (order by effects), doomed "
                    "members never run, settlement is a fixpoint")
    flows: dict[str, list[Row]] = defaultdict(list)
    for _, row, job in _ledgered(jobs, ledger, "flow"):
        flows[row["expected"]["wf"]].append(job)
    for wf, members in flows.items():
        by_name = {m["wf_name"]: m for m in members}
        doomed = any(ledger[m["id"]]["expected"].get("doomed") for m in members)
        first = {m["wf_name"]: min((e["at"] for e in effects.get(m["id"], ())), default=None)
                 for m in members}
        for member in members:
            name, job_id = member["wf_name"], member["id"]
            if doomed:
                want = "failed" if not member["wf_deps"] else "cancelled"
                if member["state"] != want:
                    inv.fail(job_id, f"workflow {wf}: doomed-run member {name} ended "
                                     f"{member['state']}, wanted {want}")
                if member["wf_deps"] and (first[name] is not None or member["started_at"]):
                    inv.fail(job_id, f"workflow {wf}: member {name} ran although its dep failed")
                continue
            if member["state"] != "succeeded":
                inv.fail(job_id, f"workflow {wf}: member {name} ended {member['state']}")
            for dep in member["wf_deps"]:
                before = by_name.get(dep)
                if before is None:
                    inv.fail(job_id, f"workflow {wf}: dep {dep} of {name} is missing")
                    continue
                mine, theirs = first[name], first[dep]
                if mine is None or theirs is None:
                    inv.fail(job_id, f"workflow {wf}: no effects for {dep} or {name}")
                elif not theirs < mine:
                    inv.fail(job_id, f"workflow {wf}: {name} ran at {first[name]} before its "
                                     f"dep {dep} at {first[dep]}")
                if before["state"] != "succeeded" and member["started_at"] is not None:
                    inv.fail(job_id, f"workflow {wf}: {name} released with {dep} "
                                     f"{before['state']}")
        released, dooms = settle(Member(m["id"], m["wf_name"], m["state"], m["wf_deps"],
                                        m["wf_ignore"]) for m in members)
        if released or dooms:
            inv.fail(members[0]["id"], f"workflow {wf}: settling again would release "
                                       f"{released} / doom {dooms}")
    return inv


def _cron(jobs: Iterable[Row]) -> Invariant:
    inv = Invariant("cron-once", "§11.6",
                    "each cron slot inserted exactly once, no minute skipped, every run done")
    slots: dict[str, dict[datetime, list[int]]] = defaultdict(lambda: defaultdict(list))
    for job in jobs:
        if job["cron_name"] is not None:
            slots[job["cron_name"]][job["cron_slot"]].append(job["id"])
            if job["state"] != "succeeded":
                inv.fail(job["id"], f"cron job {job['id']} ended {job['state']}")
    for name, by_slot in slots.items():
        for slot, ids in by_slot.items():
            if len(ids) > 1:
                ids = sorted(ids)
                inv.fail(ids[1], f"cron {name} slot {slot} fired {len(ids)} times: {ids}")
        ordered = sorted(by_slot)
        for a, b in itertools.pairwise(ordered):
            if b - a != timedelta(minutes=1):
                inv.fail(by_slot[b][0], f"cron {name}: slots {a} → {b} skip a minute")
    return inv


def _unique(jobs: Iterable[Row], bursts: Iterable[Row]) -> Invariant:
    inv = Invariant("unique-keys", "§11.7",
                    "an incomplete key never had two live holders; a window key one job per "
                    "bucket, ever")
    holders: dict[str, list[Row]] = defaultdict(list)
    for job in jobs:
        if job["unique_key"] is not None and job["kind"] == "soak.unique":
            holders[job["unique_key"]].append(job)
    for key, held in holders.items():
        held = sorted(held, key=lambda j: (j["inserted_at"], j["id"]))
        mode = held[0]["unique_mode"]
        if mode == "incomplete":
            for a, b in itertools.pairwise(held):
                end = a["finished_at"]
                if end is None or b["inserted_at"] + CLOCK_SLACK < end:
                    inv.fail(b["id"], f"key {key}: job {b['id']} inserted at "
                                      f"{b['inserted_at']} while job {a['id']} was live "
                                      f"(until {end})")
        elif len(held) > 1:
            inv.fail(held[1]["id"], f"{mode} key {key} has {len(held)} jobs "
                                    f"{[j['id'] for j in held]}")
        for job in held:
            if job["state"] != "succeeded":
                inv.fail(job["id"], f"unique job {job['id']} ended {job['state']}")
    for burst in bursts:
        ids = burst["ids"]
        if burst["mode"] == "window" and len(set(ids)) != 1:
            inv.fail(ids[-1], f"window burst {burst['key']} got jobs {ids}")
        if not burst["retried"] and burst["fresh"] != 1:
            inv.fail(ids[-1] if ids else burst["key"],
                     f"burst on {burst['key']} inserted {burst['fresh']} jobs, wanted 1")
    return inv


def _children(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
              steps: Mapping[int, Mapping[str, list[Any]]],
              children: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("children-exact", "§11.8",
                    "each parent has exactly its declared children and their exact results")
    for job_id, row, job in _ledgered(jobs, ledger, "parent"):
        vs = job["input"]["vs"]
        kids = sorted(children.get(job_id, ()), key=lambda k: k["id"])
        keys = sorted(k["unique_key"] or "" for k in kids)
        want_keys = sorted(f"$spawn:{job_id}:fan:{i}" for i in range(len(vs)))
        if len(kids) != len(vs) or keys != want_keys:
            inv.fail(job_id, f"parent {job_id} has {len(kids)} children {keys}, declared "
                             f"{len(vs)}")
        journaled = steps.get(job_id, {}).get("$spawn:fan")
        if journaled and sorted(journaled[0]) != [k["id"] for k in kids]:
            inv.fail(job_id, f"parent {job_id} journaled children {journaled[0]}, has "
                             f"{[k['id'] for k in kids]}")
        want = row["expected"]["value"]
        if job["state"] != "succeeded":
            inv.fail(job_id, f"parent {job_id} ended {job['state']}: {_last_error(job)}")
        elif not isinstance(job["result"], dict) or job["result"].get("value") != want:
            inv.fail(job_id, f"parent {job_id} result {job['result']!r}, wanted {want}")
    return inv


def _awaiters(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
              signals: Mapping[tuple[str, str], Any]) -> Invariant:
    inv = Invariant("awaiters-ran", "§11.9",
                    "every awaiter whose signal was delivered ran to the signal's payload")
    for job_id, _, job in _ledgered(jobs, ledger, "awaiter"):
        key = (f"job:{job_id}", "go")
        if key not in signals:
            inv.fail(job_id, f"awaiter {job_id} never got its signal (driver bug)")
            continue
        want = {"w": signals[key]["w"], "pre": 1}
        if job["state"] != "succeeded":
            inv.fail(job_id, f"awaiter {job_id} with a delivered signal ended {job['state']}")
        elif not isinstance(job["result"], dict) or job["result"].get("value") != want:
            inv.fail(job_id, f"awaiter {job_id} result {job['result']!r}, wanted {want}")
    return inv


def _attempts(jobs: Iterable[Row]) -> Invariant:
    inv = Invariant("attempts-bounded", "§4/§6", "attempt ≤ max_attempts on every job")
    for job in jobs:
        if job["attempt"] > job["max_attempts"]:
            inv.fail(job["id"], f"job {job['id']} attempt {job['attempt']} > max "
                                f"{job['max_attempts']}")
    return inv


def attempt_ends(job: Row) -> dict[int, list[str]]:
    """The errors entries of a job by attempt: how each attempt that did not
    succeed ended (its own failure, or the reclaim's ``lease_expired``)."""
    ends: dict[int, list[str]] = defaultdict(list)
    for error in job["errors"] or ():
        # A {"reason": …} entry is a cancel, which ends the attempt's job, not
        # another end of the attempt: a planned failure it cancelled is the end.
        if isinstance(error, dict) and isinstance(error.get("attempt"), int) \
                and "error" in error:
            ends[error["attempt"]].append(str(error["error"]))
    return ends


def _double_runs(jobs: Iterable[Row], effects: Mapping[int, list[Row]],
                 acks: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("no-double-runs", "§11.2",
                    "no job ran twice outside a lease loss: every attempt before the last "
                    "ended once (its own failure, or lease_expired) before the next claim; "
                    "one worker and each step once per attempt; never both reclaimed and "
                    "acked; no attempt after an applied success")
    for job in jobs:
        job_id, last = job["id"], job["attempt"]
        ends = attempt_ends(job)
        for attempt in range(1, last + 1):
            got = ends.get(attempt, [])
            if attempt < last and not got:
                inv.fail(job_id, f"job {job_id}: attempt {attempt + 1} was claimed while "
                                 f"attempt {attempt} neither ended nor lost its lease")
            if len(got) > 1:
                inv.fail(job_id, f"job {job_id}: attempt {attempt} ended {len(got)} times: "
                                 + "; ".join(g[:60] for g in got))
        runs: dict[int, set[str]] = defaultdict(set)
        seen: dict[tuple[int, str], int] = defaultdict(int)
        for row in effects.get(job_id, ()):
            runs[row["attempt"]].add(row["tag"])
            seen[row["attempt"], row["step"]] += 1
        for attempt, tags in runs.items():
            if len(tags) > 1:
                inv.fail(job_id, f"job {job_id}: attempt {attempt} ran on {len(tags)} "
                                 f"workers {sorted(tags)}")
        for (attempt, step), n in seen.items():
            if n > 1:
                inv.fail(job_id, f"job {job_id}: attempt {attempt} ran {step} {n} times")
        for ack in acks.get(job_id, ()):
            attempt, outcome = ack["attempt"], ack["outcome"]
            if outcome in APPLIED and LEASE_EXPIRED in ends.get(attempt, ()):
                inv.fail(job_id, f"job {job_id}: attempt {attempt} was reclaimed (lease "
                                 f"expired) and its executor's {outcome} ack applied too")
            if outcome == "succeeded" and (attempt != last or job["state"] != "succeeded"):
                inv.fail(job_id, f"job {job_id}: attempt {attempt}'s success applied, yet "
                                 f"the job went on to attempt {last} ({job['state']})")
    return inv


def _rerun(jobs: Mapping[int, Row], effects: Mapping[int, list[Row]]) -> Invariant:
    inv = Invariant("memoized-steps-stay-run", "§11.3",
                    "a step body whose attempt ended cleanly (a planned failure after its "
                    "steps) never runs again")
    for job_id, rows in effects.items():
        job = jobs.get(job_id)
        if job is None or job["kind"] not in STEP_KINDS:
            continue
        planned = {e.get("attempt") for e in job["errors"] or ()
                   if isinstance(e, dict) and PLANNED in str(e.get("error", ""))}
        by_step: dict[str, list[int]] = defaultdict(list)
        for row in rows:
            by_step[row["step"]].append(row["attempt"])
        for step, attempts in by_step.items():
            clean = [a for a in attempts if a in planned]
            later = [a for a in attempts if clean and a > min(clean)]
            if later:
                inv.fail(job_id, f"job {job_id} step {step} ran on attempt(s) {later} after "
                                 f"attempt {min(clean)} had journaled it")
    return inv


def _duplicates(jobs: Mapping[int, Row], effects: Mapping[int, list[Row]],
                chaos: Mapping[str, int]) -> Invariant:
    allowance = duplicate_allowance(chaos)
    inv = Invariant("duplicates-bounded", "§11.3",
                    f"duplicated step executions ≤ {allowance}, what the chaos can explain")
    dups = duplicated_steps(jobs, effects)
    if dups > allowance:
        inv.fail("all", f"{dups} duplicated step executions > {allowance} for "
                        f"{chaos.get('kills', 0)} kills, {chaos.get('proxy_cuts', 0)} cuts, "
                        f"{chaos.get('db_restarts', 0)} restarts: systemic re-running")
    return inv


def duplicated_steps(jobs: Mapping[int, Row], effects: Mapping[int, list[Row]]) -> int:
    """Executions of memoized step bodies beyond the first, per (job, step)."""
    total = 0
    for job_id, rows in effects.items():
        job = jobs.get(job_id)
        if job is None or job["kind"] not in STEP_KINDS:
            continue
        seen: dict[str, int] = defaultdict(int)
        for row in rows:
            seen[row["step"]] += 1
        total += sum(n - 1 for n in seen.values())
    return total


def _parallel(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
              steps: Mapping[int, Mapping[str, list[Any]]]) -> Invariant:
    inv = Invariant("parallel-steps-under-cap", "§11.4",
                    f"steps run at once in threads (max_cost $0.20 each, $0.50 budget) never "
                    f"spend past the cap: exactly {PARALLEL_ALLOWED} journaled, then "
                    "budget_exceeded — unless a run lost its lease with steps in flight (a "
                    "zombie journals what it already started, §11.3's at-least-once window)")
    want_spend = round(PARALLEL_ALLOWED * STEP_USD * 1_000_000)
    cap = round(BUDGET_USD * 1_000_000)
    for job_id, _, job in _ledgered(jobs, ledger, "parallel"):
        last = (job["errors"] or [{}])[-1]
        if job["state"] != "failed" or not isinstance(last, dict) \
                or last.get("error") != "budget_exceeded":
            inv.fail(job_id, f"parallel job {job_id} ended {job['state']}: {_last_error(job)}")
        lost = any(LEASE_EXPIRED in ends for ends in attempt_ends(job).values())
        if lost:
            inv.notes.append(f"parallel job {job_id}: a run lost its lease; spent "
                             f"{job['spent_usd_micros']} µ$ (not checked against the cap)")
            continue
        if job["spent_usd_micros"] > cap:
            inv.fail(job_id, f"parallel job {job_id} spent {job['spent_usd_micros']} µ$ "
                             f"past its {cap} µ$ cap")
        elif job["spent_usd_micros"] != want_spend:
            inv.fail(job_id, f"parallel job {job_id} spent {job['spent_usd_micros']} µ$, "
                             f"wanted {want_spend}")
        journaled = len(steps.get(job_id, {}))
        if journaled != PARALLEL_ALLOWED:
            inv.fail(job_id, f"parallel job {job_id} journaled {journaled} steps")
    return inv


def _cancels(jobs: Mapping[int, Row], ledger: Mapping[int, Row],
             effects: Mapping[int, list[Row]], cancels: Iterable[Row]) -> Invariant:
    inv = Invariant("cancel-ends-attempts", "§8.6",
                    "a job whose cancel was requested starts no attempt after it: it ends "
                    "cancelled, or succeeded by the attempt that was running")
    asked = {row["job_id"]: row for row in cancels}
    for job_id, _, job in _ledgered(jobs, ledger, "cancellable"):
        cancel = asked.get(job_id)
        started = max((e["attempt"] for e in effects.get(job_id, ())), default=0)
        if cancel is None or cancel["status"] not in ("requested", "cancelled"):
            # Never cancelled, or asked once it had finished ("noop"): it succeeds.
            if job["state"] != "succeeded":
                said = "no cancel" if cancel is None else cancel["status"]
                inv.fail(job_id, f"cancellable job {job_id} ({said}) ended {job['state']}: "
                                 f"{_last_error(job)}")
            continue
        at = cancel["attempt"]
        if started > at:
            inv.fail(job_id, f"job {job_id}: cancel {cancel['status']} at attempt {at}, yet "
                             f"attempt {started} started")
        if job["state"] == "succeeded" and job["attempt"] != at:
            inv.fail(job_id, f"job {job_id}: cancel {cancel['status']} at attempt {at}, yet it "
                             f"succeeded on attempt {job['attempt']}")
        elif job["state"] not in ("succeeded", "cancelled"):
            inv.fail(job_id, f"job {job_id}: cancel {cancel['status']}, yet it ended "
                             f"{job['state']}")
    return inv


def _threads(all_jobs: Iterable[Row], jobs: Mapping[int, Row],
             ledger: Mapping[int, Row]) -> Invariant:
    inv = Invariant("authority-in-threads", "—",
                    "a job's threads never enqueue past its authority: a plain thread is "
                    "refused, one given the job's context is bounded by it")
    by_key = {job["unique_key"]: job for job in all_jobs if job["unique_key"]}
    for job in all_jobs:
        if job["kind"] == "soak.evil":
            inv.fail(job["id"], f"job {job['id']} of kind soak.evil exists (from "
                                f"{str(job['meta'])[:80]})")
    want_meta = {key: sorted(value) for key, value in SPAWNER_AUTHORITY.items()}
    for job_id, _, job in _ledgered(jobs, ledger, "spawner"):
        result = job["result"]
        want = {"plain": "refused", "evil": "refused", "child": "enqueued"}
        if job["state"] != "succeeded":
            inv.fail(job_id, f"spawner {job_id} ended {job['state']}: {_last_error(job)}")
            continue
        got = {k: result.get(k) for k in want} if isinstance(result, dict) else result
        if got != want:
            inv.fail(job_id, f"spawner {job_id} saw {got!r}, wanted {want!r}")
        child = by_key.get(f"thr:{job_id}")
        if child is None:
            inv.fail(job_id, f"spawner {job_id}: no job from its propagated thread")
        elif (child["meta"] or {}).get("$authority") != want_meta:
            inv.fail(job_id, f"spawner {job_id}: its thread's job carries authority "
                             f"{(child['meta'] or {}).get('$authority')!r}")
    return inv
