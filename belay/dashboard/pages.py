"""The dashboard's HTML pages, rendered from the JSON-ready views of belay.ops.

Every value goes through :mod:`belay.dashboard.markup`, so it is escaped;
the pages hold no script or style of their own (the Content-Security-Policy
allows neither): ``static/dashboard.js`` reads its settings from the body's
``data-`` attributes and keeps the page live from the JSON endpoints,
building the same rows the functions here build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from belay.cliformat import count
from belay.dashboard import dag
from belay.dashboard.markup import Safe, html, join, pretty
from belay.job import STATES

#: How the page may mutate: not at all, with a bearer token it asks for,
#: with nothing (an authorizer decides), or with the host framework's session
#: and CSRF token (Django).
AUTH_MODES = ("none", "token", "open", "session")

FINISHED = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Page:
    """What every page needs to know about where and how it is served."""

    base: str = ""
    auth: str = "none"
    csrf: str | None = None
    read_only_hint: str = ""

    def url(self, path: str, **query: Any) -> str:
        """``path`` below the mount point, with the non-empty ``query`` values."""
        shown = {k: v for k, v in query.items() if v not in (None, "")}
        return self.base + path + ("?" + urlencode(shown) if shown else "")


# -- Formatting (static/dashboard.js mirrors these) ------------------------------------


def when(iso: Any) -> str:
    """An ISO timestamp as ``YYYY-MM-DD HH:MM:SS`` (UTC as stored); ``—`` for none."""
    if not iso:
        return "—"
    text = str(iso).replace("T", " ")
    return text[:19]


def usd(value: Any) -> str:
    return "—" if value is None else f"${float(value):.4f}"


def limit_text(limit: Any) -> str:
    if isinstance(limit, Mapping):
        return f"{limit.get('min')} to {limit.get('max')}"
    return "—" if limit is None else str(limit)


def rate_text(rate: Any) -> str:
    if not isinstance(rate, Mapping):
        return "—"
    text = f"{rate.get('allowed')} / {rate.get('period')}s"
    if rate.get("resource"):
        text += f" ({rate['resource']})"
    return text


def partition_text(partition: Any) -> str:
    if isinstance(partition, (list, tuple)):
        return ".".join(str(p) for p in partition) or "—"
    return "—" if partition is None else str(partition)


def state_badge(state: Any) -> Safe:
    return html('<span class="badge {}">{}</span>', dag.state_class(state), state)


# -- Layout ----------------------------------------------------------------------------


def layout(page: Page, title: str, name: str, body: Safe, *, api: str = "",
           data: Mapping[str, Any] | None = None) -> str:
    """A whole page: header with navigation and the live indicator, then ``body``."""
    attrs = {"base": page.base, "page": name, "auth": page.auth, "api": api,
             "csrf": page.csrf or "", **(data or {})}
    data_attrs = join(html(' data-{}="{}"', key, value) for key, value in attrs.items())
    token = Safe("")
    if page.auth == "token":
        token = html(
            '<form id="token-form" class="token" hidden autocomplete="off">'
            '<label>Token <input id="token-input" type="password" size="24" '
            'autocomplete="off" spellcheck="false"></label> <button type="submit">Use token'
            '</button> <span id="token-note" class="muted"></span></form>'
            '<button type="button" id="token-forget" class="link" hidden>forget token</button>')
    return html(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer"><link rel="icon" href="data:,">'
        "<title>{} · belay</title>"
        '<link rel="stylesheet" href="{}">'
        '<script src="{}" defer></script></head>'
        "<body{}><header class=\"top\"><a class=\"brand\" href=\"{}\">belay</a>"
        '<nav><a href="{}">Overview</a><a href="{}">Jobs</a><a href="{}">Schedules</a>'
        '<a href="{}">Spend</a><a href="{}">Doctor</a></nav>'
        '<span class="spacer"></span>{}'
        '<span id="live" class="live" title="updates every 2 s">static</span></header>'
        '<main>{}</main></body></html>\n',
        title, page.url("/static/dashboard.css"), page.url("/static/dashboard.js"),
        data_attrs, page.url("/"), page.url("/"), page.url("/jobs"), page.url("/schedules"),
        page.url("/spend"), page.url("/doctor"), token,
        body)


# -- Overview ----------------------------------------------------------------------------


def tile(page: Page, q: Mapping[str, Any]) -> Safe:
    """One queue: counts by state (each a link to those jobs), options, last minute."""
    name = q["queue"]
    counts = join(
        html('<a class="count {}{}" href="{}"><b>{}</b><span>{}</span></a>', dag.state_class(s),
             "" if q["counts"].get(s, 0) else " zero", page.url("/jobs", queue=name, state=s),
             count(q, s), s)
        for s in STATES)
    opts = q.get("options")
    if opts is None:
        options = html('<p class="muted">static options (no belay_queues row)</p>')
    else:
        options = html(
            '<dl class="opts"><dt>limit</dt><dd>{}</dd><dt>global</dt><dd>{}</dd>'
            "<dt>rate</dt><dd>{}</dd><dt>partition</dt><dd>{}</dd></dl>",
            limit_text(opts.get("limit")), opts.get("global_limit") or "—",
            rate_text(opts.get("rate")), partition_text(opts.get("partition")))
    minute = q["last_minute"]
    return html(
        '<section class="tile" data-queue="{}"><header><h3><a href="{}">{}</a></h3>{}'
        '<span class="muted">{} jobs</span></header><div class="counts">{}</div>{}'
        '<p class="minute">last minute: <b>{}</b> succeeded · <b>{}</b> failed · '
        "<b>{}</b> cancelled</p>"
        '<p class="muted">unfinished jobs spent {} · {} tokens</p></section>',
        name, page.url("/jobs", queue=name), name,
        html('<span class="badge paused">paused</span>') if q.get("paused") else "",
        count(q), counts, options, minute.get("succeeded", 0), minute.get("failed", 0),
        minute.get("cancelled", 0), usd(q.get("spent_usd")), q.get("spent_tokens", 0))


def overview(page: Page, queues: Sequence[Mapping[str, Any]],
             recent: Sequence[Mapping[str, Any]]) -> str:
    tiles = join(tile(page, q) for q in queues) or html(
        '<p class="muted">No queues yet: enqueue a job or put_queue() one.</p>')
    body = html(
        '<h1>Queues</h1><div id="tiles" class="tiles">{}</div>'
        '<h2>Recent jobs <a class="more" href="{}">all jobs →</a></h2>{}',
        tiles, page.url("/jobs"), job_table(page, recent, "recent"))
    return layout(page, "Overview", "overview", body, api=page.url("/api/overview"))


# -- Job lists -----------------------------------------------------------------------------


def job_row(page: Page, j: Mapping[str, Any]) -> Safe:
    workflow = Safe("—")
    if j.get("workflow_id"):
        workflow = html('<a href="{}">{}</a>', page.url("/workflow", id=j["workflow_id"]),
                        j.get("wf_name") or j["workflow_id"])
    parent = Safe("—")
    if j.get("parent_id"):
        parent = html('<a href="{}">{}</a>', page.url(f"/jobs/{int(j['parent_id'])}"),
                      j["parent_id"])
    return html(
        '<tr data-id="{}"><td><a href="{}">{}</a></td><td class="kind">{}</td><td>{}</td>'
        "<td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td></tr>",
        j["id"], page.url(f"/jobs/{int(j['id'])}"), j["id"], j["kind"], j["queue"],
        state_badge(j["state"]), j["attempt"], j["max_attempts"], workflow, parent,
        usd(j.get("spent_usd")), when(j.get("inserted_at")), when(j.get("finished_at")))


def job_table(page: Page, jobs: Sequence[Mapping[str, Any]], table_id: str) -> Safe:
    rows = join(job_row(page, j) for j in jobs)
    return html(
        '<table class="jobs"{}><thead><tr><th>id</th><th>kind</th><th>queue</th><th>state</th>'
        "<th>attempt</th><th>workflow</th><th>parent</th><th>spent</th><th>inserted</th>"
        '<th>finished</th></tr></thead><tbody id="{}">{}</tbody></table>'
        '<p class="empty muted" data-empty="{}"{}>No jobs.</p>',
        Safe("" if jobs else " hidden"), table_id, rows, table_id,
        Safe("" if not jobs else " hidden"))


FILTERS = ("queue", "state", "kind", "workflow", "parent")


def jobs_page(page: Page, jobs: Sequence[Mapping[str, Any]], filters: Mapping[str, str],
              before_id: int | None, next_before: int | None, api: str) -> str:
    """The filter form, a page of jobs (newest first), links to older and newest."""
    states = join(
        html('<option value="{}"{}>{}</option>', s,
             Safe(" selected") if filters.get("state") == s else "", s or "any state")
        for s in ("", *STATES))
    text_inputs = join(
        html('<label>{} <input name="{}" value="{}" size="{}"></label>', label, key,
             filters.get(key, ""), size)
        for label, key, size in (("queue", "queue", 10), ("kind", "kind", 14),
                                 ("workflow", "workflow", 18), ("parent", "parent", 6)))
    older = Safe("")
    if next_before is not None:
        older = html('<a class="more" href="{}">older →</a>',
                     page.url("/jobs", **filters, before_id=next_before))
    newest = Safe("")
    if before_id is not None:
        newest = html('<a class="more" href="{}">← newest</a>', page.url("/jobs", **filters))
    body = html(
        '<h1>Jobs</h1><form class="filters" method="get" action="{}">{}'
        '<label>state <select name="state">{}</select></label>'
        ' <button type="submit">Filter</button> <a href="{}">clear</a></form>{}'
        '<nav class="pager">{} {}</nav>',
        page.url("/jobs"), text_inputs, states, page.url("/jobs"),
        job_table(page, jobs, "jobs"), newest, older)
    return layout(page, "Jobs", "jobs", body, api=api)


# -- One job -------------------------------------------------------------------------------


def job_fields(j: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(label, field, text) of the job summary; the page script refreshes each field."""
    budget = "—"
    if j.get("budget_usd") is not None or j.get("budget_tokens") is not None:
        budget = f"{usd(j.get('budget_usd'))} · {j.get('budget_tokens') or '—'} tokens"
    return [
        ("queue", "queue", str(j["queue"])),
        ("attempt", "attempt", f"{j['attempt']}/{j['max_attempts']}"),
        ("priority", "priority", str(j["priority"])),
        ("spent", "spent", f"{usd(j.get('spent_usd'))} · {j.get('spent_tokens', 0)} tokens"),
        ("budget", "budget", budget),
        ("partition", "partition_key", j.get("partition_key") or "—"),
        ("unique key", "unique_key", j.get("unique_key") or "—"),
        ("cron", "cron_name", j.get("cron_name") or "—"),
        ("awaiting", "await", f"{j['await_scope']} / {j['await_name']}"
         if j.get("await_name") else "—"),
        ("leased by", "leased_by", j.get("leased_by") or "—"),
        ("cancel requested", "cancel_requested", "yes" if j.get("cancel_requested") else "no"),
        ("inserted", "inserted_at", when(j.get("inserted_at"))),
        ("ready at", "ready_at", when(j.get("ready_at"))),
        ("started", "started_at", when(j.get("started_at"))),
        ("finished", "finished_at", when(j.get("finished_at"))),
        ("lease until", "lease_until", when(j.get("lease_until"))),
    ]


def step_row(s: Mapping[str, Any]) -> Safe:
    return html('<tr><td>{}</td><td class="kind">{}</td><td><pre>{}</pre></td>'
                '<td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>',
                s["seq"], s["name"], pretty(s["value"]), usd(s["usd"]), s["tokens"],
                when(s.get("inserted_at")))


def event_row(e: Mapping[str, Any]) -> Safe:
    return html("<tr><td>{}</td><td><pre>{}</pre></td><td>{}</td></tr>",
                e["seq"], pretty(e["payload"]), when(e.get("inserted_at")))


def error_item(entry: Any) -> Safe:
    if isinstance(entry, Mapping) and "error" in entry:
        rest = {k: v for k, v in entry.items() if k not in ("error", "attempt")}
        more = html("<details><summary>details</summary><pre>{}</pre></details>",
                    pretty(rest)) if rest else ""
        return html('<li><span class="muted">attempt {}</span> <code>{}</code>{}</li>',
                    entry.get("attempt", "?"), pretty(entry["error"]), more)
    return html("<li><pre>{}</pre></li>", pretty(entry))


def actions(page: Page) -> Safe:
    if page.auth == "none":
        return html('<p class="muted readonly">{}</p>', page.read_only_hint)
    return html(
        '<section class="actions" id="actions">'
        '<button type="button" data-action="retry">Retry</button>'
        '<button type="button" data-action="cancel" class="danger">Cancel</button>'
        '<form id="signal-form" class="inline" autocomplete="off">'
        '<input id="signal-name" placeholder="signal name" size="12" required>'
        '<input id="signal-payload" placeholder="payload JSON (optional)" size="22">'
        '<button type="submit">Signal</button></form>'
        '<form id="steer-form" class="inline" autocomplete="off">'
        '<input id="steer-text" placeholder="steering instruction" size="28" required>'
        '<button type="submit">Steer</button></form>'
        '<form id="top-up-form" class="inline" autocomplete="off">'
        '<input id="top-up-usd" placeholder="+ USD" size="7" inputmode="decimal">'
        '<input id="top-up-tokens" placeholder="+ tokens" size="9" inputmode="numeric">'
        '<button type="submit">Top up</button></form>'
        '<span id="action-status" class="status" role="status"></span></section>')


def job_page(page: Page, detail: Mapping[str, Any]) -> str:
    j = detail["job"]
    job_id = int(j["id"])
    fields = join(html('<dt>{}</dt><dd data-field="{}">{}</dd>', label, key, text)
                  for label, key, text in job_fields(j))
    links = []
    if j.get("workflow_id"):
        links.append(html('workflow <a href="{}">{}</a> as <b>{}</b>',
                          page.url("/workflow", id=j["workflow_id"]), j["workflow_id"],
                          j.get("wf_name") or "—"))
    if j.get("parent_id"):
        links.append(html('child of <a href="{}">job {}</a>',
                          page.url(f"/jobs/{int(j['parent_id'])}"), j["parent_id"]))
    links.append(html('<a href="{}">spend of this job\'s tree</a>',
                      page.url("/spend", tree=job_id)))
    cost = detail["journal_cost"]
    workflow = detail.get("workflow")
    graph = Safe("")
    if workflow:
        graph = html('<h2>Workflow <a class="more" href="{}">{}</a></h2>'
                     '<div id="dag" class="dag-box">{}</div>',
                     page.url("/workflow", id=workflow["workflow_id"]),
                     workflow["workflow_id"],
                     dag.svg(workflow, lambda i: page.url(f"/jobs/{i}"), current=job_id))
    errors = join(error_item(e) for e in j.get("errors") or ())
    body = html(
        '<h1>Job {} <span class="kind">{}</span> <span id="job-state">{}</span></h1>'
        '<p class="links">{}</p>{}'
        '<div class="cols"><dl class="fields">{}</dl><div>'
        "<h3>Input</h3><pre>{}</pre><h3>Meta</h3><pre>{}</pre>"
        '<h3>Result</h3><pre id="result">{}</pre></div></div>{}'
        '<h2>Errors</h2><ol id="errors" class="errors">{}</ol>'
        '<p class="empty muted" data-empty="errors"{}>No errors.</p>'
        '<h2>Step journal</h2><table class="steps"><thead><tr><th>seq</th><th>step</th>'
        '<th>value</th><th>cost</th><th>tokens</th><th>at</th></tr></thead>'
        '<tbody id="steps">{}</tbody><tfoot><tr><td></td><td>total</td><td></td>'
        '<td class="num" id="journal-usd">{}</td><td class="num" id="journal-tokens">{}</td>'
        "<td></td></tr></tfoot></table>{}"
        '<h2>Events</h2><table class="events"><thead><tr><th>seq</th><th>payload</th>'
        '<th>at</th></tr></thead><tbody id="events">{}</tbody></table>{}'
        '<p class="empty muted" data-empty="events"{}>No events.</p>'
        "<h2>Children</h2>{}{}",
        job_id, j["kind"], state_badge(j["state"]), join(links, " · "), actions(page),
        fields, pretty(j["input"]), pretty(j["meta"]),
        pretty(j["result"]) if j["result"] is not None else "—", graph,
        errors, Safe(" hidden" if j.get("errors") else ""),
        join(step_row(s) for s in detail["steps"]), usd(cost["usd"]), cost["tokens"],
        shown_note(detail, "steps", "first"),
        join(event_row(e) for e in detail["events"]), shown_note(detail, "events", "newest"),
        Safe(" hidden" if detail["events"] else ""),
        job_table(page, detail["children"], "children"), shown_note(detail, "children", "first"))
    return layout(page, f"Job {job_id}", "job", body, api=page.url(f"/api/jobs/{job_id}"),
                  data={"job-id": job_id})


def shown_note(detail: Mapping[str, Any], part: str, which: str) -> Safe:
    """"Showing the newest 200 of 5,000": shown when a job's detail holds only
    part of its steps, events or children (the script keeps it current)."""
    count, total = len(detail[part]), detail.get(f"{part}_total", len(detail[part]))
    return html('<p class="muted" id="{}-shown" data-which="{}"{}>showing the {} {} of {}</p>',
                part, which, Safe("" if total > count else " hidden"), which, count,
                f"{total:,}")


# -- Workflow ------------------------------------------------------------------------------


def workflow_page(page: Page, wf: Mapping[str, Any]) -> str:
    counts = join(html('<span class="badge {}">{} {}</span>', dag.state_class(s), n, s)
                  for s, n in sorted(wf["counts"].items()))
    rows = join(
        html('<tr><td class="kind">{}</td><td><a href="{}">{}</a></td><td class="kind">{}</td>'
             "<td>{}</td><td>{}</td></tr>",
             m["name"], page.url(f"/jobs/{int(m['id'])}"), m["id"], m["kind"],
             state_badge(m["state"]), ", ".join(m["deps"]) or "—")
        for m in wf["jobs"])
    body = html(
        '<h1>Workflow <span class="kind">{}</span></h1>'
        '<p id="wf-summary"><span data-field="done">{}</span> · {} members · '
        '<span id="wf-counts">{}</span></p>'
        '<div id="dag" class="dag-box">{}</div>'
        '<table class="members"><thead><tr><th>member</th><th>job</th><th>kind</th>'
        '<th>state</th><th>deps</th></tr></thead><tbody id="members">{}</tbody></table>',
        wf["workflow_id"], "done" if wf["done"] else "in progress", wf["total"], counts,
        dag.svg(wf, lambda i: page.url(f"/jobs/{i}")), rows)
    return layout(page, f"Workflow {wf['workflow_id']}", "workflow", body,
                  api=page.url("/api/workflow", id=wf["workflow_id"]))


# -- Doctor --------------------------------------------------------------------------------

#: A finding's severity as its badge says it (``belay doctor`` prints the same).
SEVERITY_LABELS = {"ok": "OK", "info": "INFO", "warning": "WARN", "error": "ERROR"}


def finding_row(f: Mapping[str, Any]) -> Safe:
    severity = f.get("severity")
    label = SEVERITY_LABELS.get(str(severity), str(severity))
    return html('<tr class="finding" data-check="{}" data-severity="{}"><td class="kind">{}</td>'
                '<td><span class="badge sev-{}">{}</span></td><td>{}</td><td>{}</td></tr>',
                f.get("check"), severity, f.get("check"), severity, label, f.get("summary"),
                f.get("fix") or "—")


def doctor_page(page: Page, report: Mapping[str, Any]) -> str:
    """``belay doctor``'s findings, one row per check, run as the page loaded."""
    status = str(report.get("status"))
    rows = join(finding_row(f) for f in report.get("findings", ()))
    body = html(
        '<h1>Doctor <span id="doctor-status" class="badge sev-{}">{}</span></h1>'
        '<p class="muted">The checks of <code>belay doctor</code>, run when this page '
        'loaded: <a href="{}">run them again</a> · <a href="{}">JSON</a>. The command '
        "exits {} for this.</p>"
        '<table class="doctor"><thead><tr><th>check</th><th>status</th><th>found</th>'
        '<th>fix</th></tr></thead><tbody id="findings">{}</tbody></table>',
        status, SEVERITY_LABELS.get(status, status), page.url("/doctor"),
        page.url("/api/doctor"), report.get("exit_code"), rows)
    # No polling (no api): the checks open connections and wait on a NOTIFY.
    return layout(page, "Doctor", "doctor", body)


def schedule_row(page: Page, s: Mapping[str, Any]) -> Safe:
    state = "cancelled" if s["cancelled_at"] else "static" if s["static"] else "live"
    active = s["active_job_id"]
    return html(
        "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        s["name"], s["expression"], s["worker"], s["overlap"], s["catch_up"],
        when(s["last_due"]), when(s["next_due"]),
        html('<a href="{}">{}</a>', page.url(f"/jobs/{active}"), active) if active else "—",
        html('<span class="badge">{}</span>', state))


def schedules_page(page: Page, schedules: Sequence[Mapping[str, Any]],
                   crons: Sequence[Mapping[str, Any]]) -> str:
    """The schedules (overlap policy, catch-up, cursor, active job) and the
    dynamic cron rows."""
    schedule_rows = join(schedule_row(page, s) for s in schedules) or html(
        '<tr><td colspan="9" class="muted">no schedules: <code>belay crons schedule NAME '
        "EXPR WORKER</code>, <code>client.schedule(…)</code> or POST /schedules adds one"
        "</td></tr>")
    cron_rows = join(html("<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td>"
                          "<td>{}</td></tr>", c["name"], c["expression"], c["worker"],
                          "paused" if c["paused"] else "live", when(c["updated_at"]))
                     for c in crons) or html(
        '<tr><td colspan="5" class="muted">no dynamic crons</td></tr>')
    body = html(
        "<h1>Schedules</h1>"
        '<p class="muted">Schedules fire like crons, with an overlap policy (skip, queue, '
        'allow) and a catch-up mode (latest, all). <a href="{}">JSON</a></p>'
        '<table id="schedules"><thead><tr><th>name</th><th>expression</th><th>worker</th>'
        "<th>overlap</th><th>catch-up</th><th>last due</th><th>next due</th>"
        "<th>active job</th><th>state</th></tr></thead><tbody>{}</tbody></table>"
        "<h2>Dynamic crons</h2>"
        '<table id="crons"><thead><tr><th>name</th><th>expression</th><th>worker</th>'
        "<th>state</th><th>updated</th></tr></thead><tbody>{}</tbody></table>",
        page.url("/api/schedules"), schedule_rows, cron_rows)
    return layout(page, "Schedules", "schedules", body)


def error_page(page: Page, status: int, title: str, message: str) -> str:
    body = html('<h1>{} <span class="muted">{}</span></h1><p class="problem">{}</p>',
                title, status, message)
    return layout(page, title, "error", body)

