"""Plain-text rendering for the ``belay`` command line.

Pure functions from the JSON-ready views of :mod:`belay.ops` (and small
dicts the CLI builds) to aligned tables and sections; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from belay.job import STATES

#: Values wider than this are cut with an ellipsis in tables.
CELL_WIDTH = 60


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, indent: str = "") -> str:
    """Columns padded to their widest cell; numbers aligned right."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(_is_number(row[i]) or row[i] == "-" for row in cells)
        and any(_is_number(row[i]) for row in cells)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w)
                 for v, w, num in zip(row, widths, numeric, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    return "\n".join([line(list(headers)), *(line(row) for row in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else str(value)


def _is_number(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).lstrip("-").rstrip("+").isdigit()


def count(tile: Mapping[str, Any], state: str | None = None) -> str:
    """A queue's count for one state, or its total, as ``12`` or ``10,000+``
    when counting stopped at the cap (:func:`belay.ops.queue_overview`)."""
    capped = tile.get("capped") or ()
    if state is None:
        return f"{tile['total']:,}" + ("+" if capped else "")
    if state in capped:
        return f"{tile['count_cap']:,}+"
    return f"{tile['counts'][state]:,}"


def usd(amount: float) -> str:
    """Dollars with at least two decimals and at most six (belay counts micro-dollars)."""
    text = f"{amount:,.6f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"


def spent(amount: float, tokens: int) -> str:
    """``$0.75 / 3,500 tok``; ``-`` when nothing was spent."""
    if not amount and not tokens:
        return "-"
    return f"{usd(amount)} / {tokens:,} tok"


def spend_table(view: Mapping[str, Any]) -> str:
    """A spend report: a row per group, then the total of every group."""
    heads = [str(d).upper() for d in view["by"]]
    rows = [[*(_key(k) for k in row["key"]), f"{row['jobs']:,}",
             usd(row["usd"]), f"{row['tokens']:,}"] for row in view["rows"]]
    total = view["total"]
    rows.append(["total", *([""] * (len(heads) - 1)), f"{total['jobs']:,}", usd(total["usd"]),
                 f"{total['tokens']:,}"])
    text = table([*heads, "JOBS", "USD", "TOKENS"], rows)
    listed = len(view["rows"])
    if listed < view["groups"]:
        text += f"\n({listed} of {view['groups']:,} groups: raise --limit for the rest)"
    return text + f"\n(jobs enqueued from {view['since']} until {view['until']})"


def _key(value: str | None) -> str | None:
    """A group's key as it reads: plain text, or JSON-escaped when it holds a
    character a terminal would act on; cut to the cell width."""
    if value is None or not value.isprintable():
        return None if value is None else compact(value)
    return value if len(value) <= CELL_WIDTH else value[: CELL_WIDTH - 1] + "…"


def spend_tree_text(view: Mapping[str, Any]) -> str:
    """A job's tree: its total, then per kind."""
    total = view["total"]
    head = (f"job {view['job_id']} and its descendants: {total['jobs']:,} job(s), "
            f"{view['depth']} level(s) deep, {spent(total['usd'], total['tokens'])}")
    rows = [[kind, f"{s['jobs']:,}", usd(s["usd"]), f"{s['tokens']:,}"]
            for kind, s in view["by_kind"].items()]
    return head + "\n" + table(["KIND", "JOBS", "USD", "TOKENS"], rows)


def when(value: str | None) -> str:
    """An ISO 8601 timestamp as ``YYYY-MM-DD HH:MM:SSZ`` (UTC); ``-`` for none."""
    if not value:
        return "-"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def compact(value: Any, width: int = CELL_WIDTH) -> str:
    """``value`` as one line of JSON, cut to ``width`` characters."""
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= width else text[: width - 1] + "…"


def attempts(view: Mapping[str, Any]) -> str:
    return f"{view['attempt']}/{view['max_attempts']}"


# -- Commands -------------------------------------------------------------------------


def stats_table(overview: Sequence[Mapping[str, Any]]) -> str:
    """``belay stats``: one row per queue from :func:`belay.ops.queue_overview`."""
    if not overview:
        return "no queues yet: no jobs and no belay_queues rows"
    headers = ["QUEUE", *(s.upper() for s in STATES), "TOTAL", "UNFINISHED SPENT",
               "LAST MINUTE"]
    rows = []
    for tile in overview:
        name = tile["queue"] + (" (paused)" if tile["paused"] else "")
        last = ", ".join(f"{n:,} {state}" for state, n in tile["last_minute"].items() if n) or "-"
        rows.append([name, *(count(tile, s) for s in STATES), count(tile),
                     spent(tile["spent_usd"], tile["spent_tokens"]), last])
    return table(headers, rows)


JOB_HEADERS = ("ID", "KIND", "QUEUE", "STATE", "ATTEMPT", "SPENT", "INSERTED")


def job_rows(lines: Iterable[Mapping[str, Any]]) -> list[list[Any]]:
    return [[j["id"], j["kind"], j["queue"], j["state"], attempts(j),
             spent(j["spent_usd"], j["spent_tokens"]), when(j["inserted_at"])] for j in lines]


def jobs_table(lines: Sequence[Mapping[str, Any]], *, indent: str = "") -> str:
    """``belay jobs``: :func:`belay.ops.job_line` entries, as given (newest first)."""
    if not lines:
        return indent + "no jobs match"
    return table(JOB_HEADERS, job_rows(lines), indent=indent)


def job_text(detail: Mapping[str, Any]) -> str:
    """``belay job ID``: the sections of :func:`belay.ops.job_detail`."""
    job = detail["job"]
    out = [f"job {job['id']}  {job['kind']}  {job['state']}"]
    fields: list[tuple[str, Any]] = [
        ("queue", job["queue"]), ("priority", job["priority"]), ("attempt", attempts(job)),
        ("inserted", when(job["inserted_at"])), ("started", when(job["started_at"])),
        ("finished", when(job["finished_at"])),
        ("spent", spent(job["spent_usd"], job["spent_tokens"])),
    ]
    optional: list[tuple[str, Any]] = [
        ("ready at", when(job["ready_at"]) if job["ready_at"] and job["state"] in
         ("ready", "awaiting") else None),
        ("budget", _budget(job)),
        ("leased by", job["leased_by"] and f"{job['leased_by']} until "
                                           f"{when(job['lease_until'])}"),
        ("awaiting", job["await_name"] and f"{job['await_name']!r} on {job['await_scope']}"),
        ("cancel", "requested" if job["cancel_requested"] else None),
        ("parent", job["parent_id"]),
        ("workflow", job["workflow_id"] and f"{job['workflow_id']} (member "
                                             f"{job['wf_name']!r})"),
        ("cron", job["cron_name"]), ("unique key", job["unique_key"]),
        ("partition", job["partition_key"]),
        ("meta", compact(job["meta"], 200) if job["meta"] else None),
    ]
    fields += [(k, v) for k, v in optional if v is not None]
    fields += [("input", compact(job["input"], 200))]
    if job["result"] is not None:
        fields.append(("result", compact(job["result"], 200)))
    out += [f"  {name:<10} {value}" for name, value in fields]

    steps = detail["steps"]
    cost = detail["journal_cost"]
    out += ["", f"steps ({_shown(len(steps), detail, 'steps', 'first')})  "
                f"total {spent(cost['usd'], cost['tokens'])}"]
    if steps:
        out.append(table(["SEQ", "NAME", "COST", "AT", "VALUE"], [
            [s["seq"], s["name"], spent(s["usd"], s["tokens"]), when(s["inserted_at"]),
             compact(s["value"])] for s in steps], indent="  "))
    events = detail["events"]
    out += ["", f"events ({_shown(len(events), detail, 'events', 'newest')})"]
    if events:
        out.append(table(["SEQ", "AT", "PAYLOAD"], [
            [e["seq"], when(e["inserted_at"]), compact(e["payload"])] for e in events],
            indent="  "))
    errors = job["errors"] or []
    out += ["", f"errors ({len(errors)})"]
    out += [f"  {_error_line(e)}" for e in errors]
    children = detail["children"]
    out += ["", f"children ({_shown(len(children), detail, 'children', 'first')})"]
    if children:
        out.append(jobs_table(children, indent="  "))
    workflow = detail["workflow"]
    if workflow is not None:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(workflow["counts"].items()))
        status = "done" if workflow["done"] else "in progress"
        out += ["", f"workflow {workflow['workflow_id']}  {status}: {counts}"]
        out.append(table(["NAME", "ID", "KIND", "STATE", "DEPS"], [
            [m["name"], m["id"], m["kind"], m["state"], ", ".join(m["deps"]) or "-"]
            for m in workflow["jobs"]], indent="  "))
    return "\n".join(out)


def _budget(job: Mapping[str, Any]) -> str | None:
    parts = []
    if job["budget_usd"] is not None:
        parts.append(usd(job["budget_usd"]))
    if job["budget_tokens"] is not None:
        parts.append(f"{job['budget_tokens']:,} tok")
    return " / ".join(parts) or None


def _error_line(entry: Any) -> str:
    if isinstance(entry, Mapping) and "error" in entry:
        attempt = entry.get("attempt")
        prefix = f"attempt {attempt}: " if attempt is not None else ""
        return prefix + str(entry["error"])
    return compact(entry, 200)


def event_line(event: Mapping[str, Any]) -> str:
    """One event of ``belay events``: seq, time, payload (whole, on one line)."""
    return f"{event['seq']:>4}  {when(event['inserted_at'])}  " \
           f"{compact(event['payload'], 10_000)}"


def retried_text(view: Mapping[str, Any]) -> str:
    return (f"job {view['id']} is {view['state']} again: attempt {view['attempt'] + 1} "
            f"of {view['max_attempts']} comes next")


CANCEL_TEXT = {
    "cancelled": "cancelled: job {id} will not run again",
    "requested": "requested: job {id} is running; it stops at its next step boundary",
    "noop": "noop: job {id} had already finished",
}


def woken_text(what: str, job_id: int, woken: Sequence[int]) -> str:
    if not woken:
        return f"{what} delivered to job {job_id}; no job was waiting on it (it stays " \
               "delivered until read)"
    return f"{what} delivered to job {job_id}; woke job(s) {', '.join(map(str, woken))}"


def queues_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``belay queues``: the belay_queues rows as ``{queue, options, paused}``."""
    if not rows:
        return "no belay_queues rows (workers serve their static queues; " \
               "'belay queues put NAME' adds one)"
    body = []
    for row in rows:
        opts = row["options"] or {}
        body.append([row["queue"], "yes" if row["paused"] else "no",
                     compact(opts["limit"]) if "limit" in opts else None,
                     opts.get("global_limit"),
                     compact(opts["rate"]) if opts.get("rate") else None,
                     compact(opts["partition"]) if opts.get("partition") else None])
    return table(["QUEUE", "PAUSED", "LIMIT", "GLOBAL", "RATE", "PARTITION"], body)


def crons_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``belay crons``: the belay_crons rows (:func:`belay.ops.cron_view`)."""
    if not rows:
        return "no dynamic crons ('belay crons put NAME EXPR WORKER' adds one)"
    return table(["NAME", "EXPRESSION", "WORKER", "PAUSED", "INPUT", "OPTIONS", "UPDATED"], [
        [c["name"], c["expression"], c["worker"], "yes" if c["paused"] else "no",
         compact(c["input"], 40), compact(c["options"], 40) if c["options"] else None,
         when(c["updated_at"])] for c in rows])


def schedules_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``belay crons list``: the schedules (``Schedule.to_dict()``)."""
    return table(["SCHEDULE", "EXPRESSION", "WORKER", "OVERLAP", "CATCH-UP", "NEXT", "ACTIVE",
                  "STATE"], [
        [s["name"], s["expression"], s["worker"], s["overlap"], s["catch_up"],
         when(s["next_due"]), s["active_job_id"],
         "cancelled" if s["cancelled_at"] else "static" if s["static"] else "live"]
        for s in rows])


def schedule_text(view: Mapping[str, Any]) -> str:
    """``belay crons schedule|status|cancel``: one schedule."""
    state = f"cancelled {when(view['cancelled_at'])}" if view["cancelled_at"] else "live"
    lines = [f"schedule {view['name']!r} ({state}, revision {view['revision']}"
             + (", declared in code" if view["static"] else "") + ")",
             f"  {view['expression']} -> {view['worker']}  overlap={view['overlap']} "
             f"catch_up={view['catch_up']}",
             f"  last due {when(view['last_due'])}, next due {when(view['next_due'])}",
             f"  active job {view['active_job_id'] or '-'}, last job "
             f"{view['last_job_id'] or '-'}"]
    if view["input"]:
        lines.append(f"  input {compact(view['input'], 80)}")
    if view["options"]:
        lines.append(f"  options {compact(view['options'], 80)}")
    return "\n".join(lines)


PRUNED = ("succeeded", "failed", "cancelled", "signals", "rate_windows")


def pruned_text(counts: Mapping[str, int]) -> str:
    """``belay prune``: rows deleted by kind (a kind kept forever was not looked at)."""
    jobs = sum(counts.get(s, 0) for s in ("succeeded", "failed", "cancelled"))
    lines = [f"pruned {jobs} job(s) with their steps and events"]
    lines += [f"  {kind:<12} {counts.get(kind, 'kept forever')}"
              for kind in PRUNED]
    return "\n".join(lines)


def _shown(count: int, detail: Mapping[str, Any], part: str, which: str) -> str:
    """``3``, or ``the newest 200 of 5,000`` when the detail holds only some."""
    total = detail.get(f"{part}_total", count)
    return str(count) if total <= count else f"the {which} {count} of {total:,}"
