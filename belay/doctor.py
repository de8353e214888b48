"""``belay doctor``: what is wrong with a deployment, one check at a time.

Each check reads the database (the statements are in ``belay/sql/doctor.sql``)
and hands what it read to a pure function that decides the :class:`Finding`:
its severity against the :class:`Thresholds`, a one-line summary and the fix.
Nothing here writes, except one NOTIFY on a channel of the doctor's own. A
check that fails to run becomes an ``error`` finding naming why; the others
still run. docs/doctor.md says what each check reads.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final

import psycopg
from psycopg import pq, sql
from psycopg.rows import dict_row

from belay import connect, store
from belay.redact import describe, redact, secrets_of
from belay.retention import DEFAULT_RETENTION
from belay.schema import CONTRACT_MAJOR, SchemaStatus, latest_revision, read_status
from belay.sql import QUERIES

if TYPE_CHECKING:
    from belay.client import Belay

#: Severities, mildest first. ``info`` never changes the exit code.
SEVERITIES: Final = ("ok", "info", "warning", "error")
LABELS: Final = {"ok": "OK", "info": "INFO", "warning": "WARN", "error": "ERROR"}

#: The checks, in the order they run and print.
CHECKS: Final = ("schema", "pooler", "notify", "horizon", "tables", "leases", "queues",
                 "retention")

# Thresholds (seconds unless said otherwise); docs/doctor.md explains each.
#: A transaction (or prepared transaction) open this long holds vacuum back:
#: every row deleted or updated since stays on disk. Warn, then error.
HORIZON_WARN: Final = 300.0
HORIZON_ERROR: Final = 3600.0
#: A belay table whose rows are this share dead (of live + dead), with at
#: least DEAD_MIN dead rows (small tables churn harmlessly), is bloating.
DEAD_RATIO_WARN: Final = 0.5
DEAD_MIN: Final = 10_000
#: belay_jobs's autovacuum waiting for more dead rows than this: until it
#: runs, every claim steps over the dead index entries of the jobs claimed
#: before it (at 10M rows, claims slowed 3.8x in 5 minutes of draining and
#: recovered when the vacuum came; bench/bigtable_results.md).
VACUUM_AT_INFO: Final = 200_000
#: The storage parameters the fix names for belay_jobs.
JOBS_AUTOVACUUM: Final = ("ALTER TABLE belay_jobs SET (autovacuum_vacuum_scale_factor = 0.01, "
                          "autovacuum_vacuum_threshold = 1000)")
#: A running job past its lease by more than this has no worker reclaiming it
#: (every worker sweeps expired leases every few seconds); past LEASE_ERROR,
#: an error.
LEASE_MARGIN: Final = 60.0
LEASE_ERROR: Final = 900.0
#: A queue with due work shows a live worker when one of its jobs held a lease,
#: was first claimed or was acked (succeeded or failed) this recently.
WORKER_WINDOW: Final = 300.0
#: Due work younger than this is not reported (a worker may be on its way);
#: older than UNSERVED_ERROR with no worker, an error.
UNSERVED_GRACE: Final = 60.0
UNSERVED_ERROR: Final = 3600.0
#: A terminal job older than its retention by this much means no pruning runs
#: (workers prune every minute).
RETENTION_MARGIN: Final = 3600.0
#: How long a NOTIFY may take to arrive.
NOTIFY_TIMEOUT: Final = 2.0
#: Rounds of the pooler probe, and the longest any one doctor statement may run.
PROBE_ROUNDS: Final = 5
STATEMENT_TIMEOUT_MS: Final = 10_000
CONNECT_TIMEOUT: Final = 10
#: The holders of the horizon listed in a finding's details.
HOLDERS_SHOWN: Final = 5
APPLICATION_NAME: Final = "belay-doctor"
#: The tables belay creates (migrations 1 to 3).
TABLES: Final = ("belay_jobs", "belay_steps", "belay_events", "belay_signals", "belay_rate",
                 "belay_queues", "belay_crons", "belay_meta")


@dataclass(frozen=True)
class Thresholds:
    """Where each check turns from ok to warning to error (defaults: the constants)."""

    horizon_warn: float = HORIZON_WARN
    horizon_error: float = HORIZON_ERROR
    dead_ratio: float = DEAD_RATIO_WARN
    dead_min: int = DEAD_MIN
    vacuum_at: int = VACUUM_AT_INFO
    lease_margin: float = LEASE_MARGIN
    lease_error: float = LEASE_ERROR
    worker_window: float = WORKER_WINDOW
    unserved_grace: float = UNSERVED_GRACE
    unserved_error: float = UNSERVED_ERROR
    retention_margin: float = RETENTION_MARGIN
    notify_timeout: float = NOTIFY_TIMEOUT


@dataclass(frozen=True)
class Finding:
    """What one check found: ``severity`` is one of :data:`SEVERITIES`;
    ``fix`` says what to do (empty when nothing is to be done)."""

    check: str
    severity: str
    summary: str
    fix: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity is one of {', '.join(SEVERITIES)}, "
                             f"got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "severity": self.severity, "summary": self.summary,
                "fix": self.fix, "details": _jsonable(self.details)}


def worst(findings: Iterable[Finding]) -> str:
    """The gravest severity among ``findings`` (``ok`` for none)."""
    return max((f.severity for f in findings), key=SEVERITIES.index, default="ok")


def exit_code(findings: Iterable[Finding]) -> int:
    """0 when everything is ok or info, 1 with a warning, 2 with an error."""
    return {"ok": 0, "info": 0, "warning": 1, "error": 2}[worst(findings)]


def report(findings: Sequence[Finding]) -> dict[str, Any]:
    """The ``--json`` document (and the dashboard's ``/api/doctor``)."""
    return {"status": worst(findings), "exit_code": exit_code(findings),
            "findings": [f.to_dict() for f in findings]}


def format_text(findings: Sequence[Finding]) -> str:
    """One line per check (severity, check, what was found), its fix under it."""
    lines = []
    for f in findings:
        lines.append(f"{LABELS[f.severity]:<5}  {f.check:<9}  {f.summary}")
        if f.fix:
            lines.append(f"{'':<18}fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning")}
    tally = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
    lines.append(f"doctor: {tally or 'all ok'} (exit {exit_code(findings)})")
    return "\n".join(lines)


# -- Pure decisions --------------------------------------------------------------------------


def span(seconds: float | None) -> str:
    """A duration for people: ``45 s``, ``12 min``, ``3.2 h``, ``4.0 d``."""
    if seconds is None:
        return "forever"
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 86_400:
        return f"{seconds / 3600:.1f} h".replace(".0 ", " ")
    return f"{seconds / 86_400:.1f} d".replace(".0 ", " ")


def size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _graded(age: float, warn: float, error: float) -> str:
    return "error" if age >= error else "warning" if age >= warn else "ok"


def schema_finding(status: SchemaStatus, latest: int) -> Finding:
    """Contract and migration state: what ``belay check`` refuses is an error; a
    database behind the newest migration this belay ships, a warning."""
    details = {"revision": status.revision, "contract_major": status.contract_major,
               "latest_revision": latest, "belay_contract_major": CONTRACT_MAJOR}
    problem = status.problem
    if problem is not None:
        return Finding("schema", "error", str(problem).split(":")[0],
                       str(problem).partition(": ")[2] or "run `belay migrate`", details)
    text = f"{status.describe()} (this belay knows revisions up to {latest}, " \
           f"contract major {CONTRACT_MAJOR})"
    if status.revision < latest:
        fix = (f"run `belay migrate` to apply revisions {status.revision + 1} to {latest} "
               "(additive: running workers keep working)")
        for revision, build in INDEX_REVISIONS.items():
            if status.revision < revision <= latest:
                fix += (f"; revision {revision} builds an index that reads every job and "
                        "blocks writes while it builds: on a big table, first run "
                        f"{build} (docs/schema.md)")
        return Finding("schema", "warning", text, fix, details)
    if status.revision > latest:
        return Finding("schema", "info", text + ": migrated by a newer belay",
                       "nothing needed (newer revisions of the same major are additive); "
                       "upgrade this belay to use them", details)
    return Finding("schema", "ok", text, "", details)


#: The revisions that build an index over belay_jobs, and how to build it first
#: without the write lock (the migration then finds it and returns at once).
INDEX_REVISIONS: Final = {
    4: "CREATE INDEX CONCURRENTLY belay_jobs_state_queue_id_idx ON belay_jobs "
       "(state, queue, id) WHERE id > 0;",
    6: "CREATE INDEX CONCURRENTLY belay_jobs_spend_idx ON belay_jobs (inserted_at) "
       "WHERE spent_usd_micros <> 0 OR spent_tokens <> 0;",
}


@dataclass(frozen=True)
class PoolerProbe:
    """Backend pids seen by two connections held open at once, taking turns
    one transaction at a time; the server's port and the one the URL reached."""

    pids_a: tuple[int, ...]
    pids_b: tuple[int, ...]
    server_port: int | None
    url_port: int | None
    #: Whether both connections could prepare and run one statement name in
    #: turns (a pooler that tracks prepared statements, or none), else what
    #: the server said when they collided; None: not probed.
    prepared: bool | None = None
    prepared_error: str = ""

    @property
    def evidence(self) -> str | None:
        """Why a transaction pooler must be in between, or None."""
        shared = sorted(set(self.pids_a) & set(self.pids_b))
        if shared:
            return (f"two connections open at once ran on the same server backend, pid "
                    f"{shared[0]}, which direct connections never do")
        for pids in (self.pids_a, self.pids_b):
            if len(set(pids)) > 1:
                return (f"one connection's transactions ran on {len(set(pids))} server "
                        "backends, where a direct connection keeps its own")
        return None


def pooler_finding(probe: PoolerProbe, setting: str | None) -> Finding:
    """A transaction pooler detected against belay's ``pooler`` setting."""
    evidence = probe.evidence
    details = {"detected": evidence is not None, "setting": setting,
               "pids_a": list(probe.pids_a), "pids_b": list(probe.pids_b),
               "server_port": probe.server_port, "url_port": probe.url_port}
    proxied = (probe.server_port is not None and probe.url_port is not None
               and probe.server_port != probe.url_port)
    hint = (f"; something proxies port {probe.url_port} to the server's "
            f"{probe.server_port}") if proxied else ""
    details["prepared"] = probe.prepared
    tracks = probe.prepared is True
    tracking = (f' The pooler keeps prepared statements apart per client (PgBouncer >= '
                f'1.21 with max_prepared_statements > 0), so pooler='
                f'"{connect.TRANSACTION_PREPARED}" may be used.') if tracks else ""
    if evidence is not None and setting is None:
        return Finding(
            "pooler", "error",
            "a transaction pooler is between belay and PostgreSQL, but belay's pooler "
            "setting is unset (prepared statements collide, LISTEN on this URL hears "
            f"nothing): {evidence}{hint}",
            f"set {connect.SETTING_HINT}; `belay doctor --pooler transaction` checks "
            f"with it set.{tracking}", details)
    if evidence is not None and setting == connect.TRANSACTION_PREPARED and not tracks:
        return Finding(
            "pooler", "error",
            f'pooler="{setting}" is set, but this pooler does not keep prepared statements '
            f"apart per client: two connections preparing one name collided "
            f"({probe.prepared_error or 'no answer'}): {evidence}{hint}",
            f'set pooler="{connect.TRANSACTION}", or run PgBouncer 1.21 or later with '
            "max_prepared_statements > 0 (e.g. 200)", details)
    if evidence is not None and setting == connect.TRANSACTION and tracks:
        return Finding(
            "pooler", "info",
            f'transaction pooler detected, and belay\'s pooler="{setting}" matches: '
            f"{evidence}{hint}.{tracking}",
            f'pooler="{connect.TRANSACTION_PREPARED}" lets psycopg prepare belay\'s '
            "repeated statements (less server CPU per job); optional", details)
    if evidence is not None:
        return Finding("pooler", "ok", f'transaction pooler detected, and belay\'s '
                       f'pooler="{setting}" matches: {evidence}{hint}', "", details)
    if setting is not None:
        return Finding(
            "pooler", "info",
            f'pooler="{setting}" is set, but no transaction pooler was seen: each '
            f"connection kept its own server backend{hint}",
            "unset it if the URL reaches PostgreSQL directly or through a session pooler "
            "(the setting only costs server-side prepared statements and LISTEN on the URL)",
            details)
    if proxied:
        return Finding(
            "pooler", "info",
            f"no transaction pooler seen, but the URL's port {probe.url_port} is not the "
            f"server's {probe.server_port}: something proxies it (a session pooler, a port "
            "mapping)",
            "nothing, unless that proxy pools transactions: then set "
            f"{connect.SETTING_HINT}", details)
    return Finding("pooler", "ok", "no pooler: each connection keeps its own server backend",
                   "", details)


DIRECT_URL_HINT: Final = (
    "give belay a URL straight to PostgreSQL for LISTEN: direct_url (belay.Belay(url, "
    'pooler="transaction", direct_url=...), --direct-url URL, or BELAY_DIRECT_URL)'
)


def notify_finding(via: str | None, pooler: str | None, delivered: bool | None,
                   waited: float, databases: tuple[str, str] | None = None) -> Finding:
    """NOTIFY reachability: ``via`` names where LISTEN ran (``"direct_url"``,
    ``"url"``, or None when it can't run anywhere); ``databases`` the
    databases the URL and the LISTEN URL reached, when they differ."""
    details = {"listen_via": via, "delivered": delivered, "waited_s": round(waited, 3)}
    if via is None:
        return Finding(
            "notify", "info",
            f'pooler="{pooler}" and no direct_url: LISTEN cannot go through a transaction '
            "pooler, so waits poll (await_result, worker wake-ups: up to a poll interval "
            "late)", DIRECT_URL_HINT, details)
    if delivered:
        return Finding("notify", "ok",
                       f"a NOTIFY sent through the URL arrived on LISTEN via {via} in "
                       f"{waited * 1000:.0f} ms", "", details)
    if databases is not None:
        return Finding(
            "notify", "warning",
            f"direct_url reaches database {databases[1]!r}, the URL {databases[0]!r}: "
            "notifications of the one never reach the other, so waits poll",
            "point direct_url at the same database as the URL", details)
    fix = (DIRECT_URL_HINT + ", and set the pooler setting (see the pooler check)"
           if via == "url" else
           "check that direct_url reaches the same server as the URL directly, not "
           "through a transaction pooler")
    return Finding("notify", "warning",
                   f"a NOTIFY sent through the URL did not arrive on LISTEN via {via} within "
                   f"{waited:.1f} s: waits poll (up to a poll interval late)", fix, details)


def _holder_text(h: Mapping[str, Any]) -> str:
    kind = h["kind"]
    if kind == "prepared":
        return f"prepared transaction {h['name']!r} (owner {h['role']}) for {span(h['age_s'])}"
    if kind == "slot":
        return (f"replication slot {h['name']!r} ({h['state']}) holding xmin "
                f"{h['xid_age']:,} transactions back")
    app = f", application {h['application_name']!r}" if h.get("application_name") else ""
    return (f"pid {h['pid']} ({h['state'] or h['backend_type']}{app}, role {h['role']}) "
            f"with a transaction open {span(h['age_s'])}")


def _holder_severity(h: Mapping[str, Any], t: Thresholds) -> str:
    if h["kind"] == "slot":
        return "ok" if h["state"] == "active" else "warning"
    return _graded(float(h["age_s"] or 0.0), t.horizon_warn, t.horizon_error)


def _holder_fix(h: Mapping[str, Any]) -> str:
    if h["kind"] == "prepared":
        return (f"finish it: COMMIT PREPARED '{h['name']}' or ROLLBACK PREPARED "
                f"'{h['name']}'")
    if h["kind"] == "slot":
        return (f"drop the slot if no standby or consumer uses it any more: SELECT "
                f"pg_drop_replication_slot('{h['name']}')")
    return (f"end it (SELECT pg_terminate_backend({h['pid']})) and find the code that "
            "keeps transactions open; idle_in_transaction_session_timeout ends idle ones")


def horizon_finding(holders: Sequence[Mapping[str, Any]], t: Thresholds) -> Finding:
    """The oldest transaction holding vacuum back: rows as ``doctor_horizon``
    reads them, oldest first."""
    shown = [dict(h) for h in holders[:HOLDERS_SHOWN]]
    details: dict[str, Any] = {"holders": shown}
    if not holders:
        return Finding("horizon", "ok", "no open transaction, prepared transaction or "
                       "replication slot holds vacuum back", "", details)
    graded = [(SEVERITIES.index(_holder_severity(h, t)), i) for i, h in enumerate(holders)]
    rank, index = max(graded, key=lambda g: (g[0], -g[1]))
    worst_holder = holders[index]
    severity = SEVERITIES[rank]
    details["pid"] = worst_holder.get("pid")
    details["age_s"] = worst_holder.get("age_s")
    oldest = "oldest" if index == 0 else "worst"
    more = f" ({len(holders) - 1} more)" if len(holders) > 1 else ""
    text = f"{oldest}: {_holder_text(worst_holder)}{more}"
    if severity == "ok":
        limit = f"under the {span(t.horizon_warn)} warning"
        return Finding("horizon", "ok", f"{text}, {limit}", "", details)
    why = ": vacuum keeps every row deleted or updated since (belay_jobs bloats)"
    return Finding("horizon", severity, text + why, _holder_fix(worst_holder), details)


def tables_finding(tables: Sequence[Mapping[str, Any]], t: Thresholds,
                   now: datetime | None = None) -> Finding:
    """Dead rows and size of belay's tables (``doctor_tables`` rows)."""
    details = {"tables": [dict(r) for r in tables]}
    if not tables:
        return Finding("tables", "info", "no statistics for belay's tables yet", "", details)
    total = sum(int(r["bytes"] or 0) for r in tables)
    bloated = []
    for r in tables:
        live, dead = int(r["live"] or 0), int(r["dead"] or 0)
        ratio = dead / (live + dead) if live + dead else 0.0
        if dead >= t.dead_min and ratio >= t.dead_ratio:
            last = r.get("last_autovacuum") or r.get("last_vacuum")
            ago = "never" if last is None or now is None else span(
                (now - last).total_seconds()) + " ago"
            bloated.append(f"{r['table_name']}: {ratio:.0%} of rows dead ({dead:,} dead, "
                           f"{live:,} live), {size(int(r['bytes'] or 0))}, last vacuumed "
                           f"{ago}")
    if bloated:
        return Finding(
            "tables", "warning", "; ".join(bloated),
            "see the horizon check first (an old transaction keeps dead rows); else "
            f"VACUUM the table and let autovacuum run sooner on it, e.g. {JOBS_AUTOVACUUM}",
            details)
    jobs = next((r for r in tables if r["table_name"] == "belay_jobs"), None)
    head = ""
    if jobs is not None:
        live, dead = int(jobs["live"] or 0), int(jobs["dead"] or 0)
        head = f"belay_jobs {size(int(jobs['bytes'] or 0))}, {dead:,} dead of " \
               f"{live + dead:,} rows; "
        vacuum_at = jobs.get("vacuum_at")
        if vacuum_at is not None and int(vacuum_at) > t.vacuum_at:
            return Finding(
                "tables", "info",
                f"{head}autovacuum takes belay_jobs on only at {int(vacuum_at):,} dead rows "
                f"(scale factor {float(jobs.get('scale') or 0):g} of its rows): until then "
                "each claim steps over the index entries of the jobs claimed before it, "
                "and claims slow down as a backlog drains (docs/scaling.md, big tables)",
                f"let autovacuum come sooner on belay_jobs: {JOBS_AUTOVACUUM}", details)
    return Finding("tables", "ok", f"{head}{len(tables)} tables {size(total)} in all",
                   "", details)


def leases_finding(row: Mapping[str, Any], now: datetime, t: Thresholds) -> Finding:
    """Stuck leases (the ``doctor_stuck_leases`` row)."""
    stuck = int(row.get("stuck") or 0)
    details = {"stuck": stuck, "oldest_job_id": row.get("id"), "queue": row.get("queue"),
               "leased_by": row.get("leased_by"), "lease_until": row.get("lease_until")}
    if not stuck:
        return Finding("leases", "ok", f"no running job is past its lease by more than "
                       f"{span(t.lease_margin)}", "", details)
    until = row.get("lease_until")
    overdue = None if until is None else (now - until).total_seconds()
    details["overdue_s"] = overdue
    severity = "error" if overdue is None else _graded(overdue, t.lease_margin,
                                                        t.lease_error)
    when = "has no lease_until at all" if overdue is None else \
        f"lease ran out {span(overdue)} ago"
    return Finding(
        "leases", severity,
        f"{stuck:,} running job(s) past their lease by more than {span(t.lease_margin)}; "
        f"oldest: job {row.get('id')} (queue {row.get('queue')!r}, leased by "
        f"{row.get('leased_by')!r}), {when}: no live worker reclaims them",
        "start a worker (any worker's sweeper reclaims every queue's expired leases "
        "each --sweep-interval); if workers run, check their logs and that their clocks "
        "agree with the database's", details)


def queues_finding(rows: Sequence[Mapping[str, Any]], paused: Iterable[str],
                   now: datetime, t: Thresholds) -> Finding:
    """Queues with due work and no sign of a live worker (``doctor_waiting_work``
    rows); paused queues are reported as info."""
    paused = set(paused)
    window = now - timedelta(seconds=t.worker_window)
    queues, problems, held = [], [], []
    severity = "ok"
    for r in rows:
        signs = [s for s in (r.get("last_lease"), r.get("last_start"), r.get("last_finish"))
                 if s is not None]
        last_seen = max(signs) if signs else None
        waiting = (now - r["oldest_due"]).total_seconds() if r.get("oldest_due") else 0.0
        live = last_seen is not None and last_seen >= window
        entry = {"queue": r["queue"], "due": int(r["due"]), "waiting_s": waiting,
                 "last_worker_sign": last_seen, "live_worker": live,
                 "paused": r["queue"] in paused}
        queues.append(entry)
        if r["queue"] in paused:
            held.append(f"{r['queue']!r} is paused with {int(r['due']):,} job(s) due")
            continue
        if live or waiting < t.unserved_grace:
            continue
        grade = "error" if waiting >= t.unserved_error else "warning"
        severity = max(severity, grade, key=SEVERITIES.index)
        seen = "never" if last_seen is None else f"{span((now - last_seen).total_seconds())} ago"
        problems.append(f"queue {r['queue']!r}: {int(r['due']):,} job(s) due, the oldest "
                        f"for {span(waiting)}; last sign of a worker: {seen}")
    details = {"queues": queues, "worker_window_s": t.worker_window}
    if problems:
        names = " ".join(f"--queue {e['queue']}" for e in queues
                         if not e["live_worker"] and not e["paused"]
                         and e["waiting_s"] >= t.unserved_grace)
        return Finding("queues", severity, "; ".join(problems + held),
                       f"start a worker serving them (belay worker {names} …), or add them "
                       "to your workers' queues", details)
    if held:
        return Finding("queues", "info", "; ".join(held),
                       "`belay queues resume NAME` when it should run again", details)
    busy = sum(1 for e in queues)
    text = (f"{busy} queue(s) with due work, each with a live worker" if busy
            else "no queue has work waiting")
    return Finding("queues", "ok", text, "", details)


def retention_finding(rows: Sequence[Mapping[str, Any]],
                      retention: Mapping[str, float | None], now: datetime,
                      t: Thresholds) -> Finding:
    """Retention not running: ``doctor_oldest_terminal`` rows (state, oldest,
    overdue) against the retention each terminal state is kept."""
    late = []
    details: dict[str, Any] = {"states": [dict(r) for r in rows],
                               "retention_s": dict(retention)}
    for r in rows:
        keep = retention.get(r["state"])
        if keep is None or r.get("oldest") is None:
            continue
        age = (now - r["oldest"]).total_seconds()
        if age > keep + t.retention_margin:
            late.append(f"{int(r['overdue'] or 0):,} {r['state']} job(s) past their "
                        f"{span(keep)} retention, the oldest finished {span(age)} ago")
    if late:
        return Finding(
            "retention", "warning", "; ".join(late) + ": retention is not running",
            "workers prune every minute: run one (any queue), or `belay prune` from cron; "
            "if your workers keep jobs longer on purpose, tell the doctor "
            "(--succeeded/--failed/--cancelled SECONDS or 'forever')", details)
    kept = ", ".join(f"{s} {span(k)}" for s, k in retention.items())
    return Finding("retention", "ok", f"no finished job outlived its retention ({kept})",
                   "", details)


def skipped(check: str, why: str) -> Finding:
    return Finding(check, "info", f"skipped: {why}")


# -- Reading the database -------------------------------------------------------------------


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    # Never prepared server-side, whatever is in between: the doctor must work
    # where belay's setting is wrong.
    return connect.connect(conninfo, connect.TRANSACTION, autocommit=True,
                           connect_timeout=CONNECT_TIMEOUT,
                           application_name=APPLICATION_NAME)


def _rows(conn: psycopg.Connection[Any], name: str, params: Any = None
          ) -> list[dict[str, Any]]:
    """One doctor statement in a transaction of its own, bounded in time."""
    with conn.transaction():
        store.local_statement_timeout(conn, STATEMENT_TIMEOUT_MS)
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(QUERIES[name], params)
            return cur.fetchall()


def probe_pooler(conninfo: str, rounds: int = PROBE_ROUNDS) -> PoolerProbe:
    """Two connections open at once, each running ``pg_backend_pid()`` in a
    transaction of its own, in turns."""
    pids_a: list[int] = []
    pids_b: list[int] = []
    server_port = None
    with _connect(conninfo) as a, _connect(conninfo) as b:
        for _ in range(rounds):
            for conn, pids in ((a, pids_a), (b, pids_b)):
                row = _rows(conn, "doctor_backend")[0]
                pids.append(int(row["pid"]))
                server_port = row["server_port"]
        url_port = a.info.port
        said = _prepare_in_turns(a, b, rounds)
    return PoolerProbe(tuple(pids_a), tuple(pids_b),
                       None if server_port is None else int(server_port), url_port,
                       prepared=said is None, prepared_error=said or "")


#: The statement name both probe connections prepare: the doctor's own, so
#: that what a pooler that does not track prepared statements leaves on a
#: server connection can collide with nobody else's.
PROBE_STATEMENT: Final = b"belay_doctor_probe"


def _said_by(message: bytes) -> str:
    """libpq's error text without its severity prefix."""
    text = message.decode(errors="replace").strip()
    return text.split(":", 1)[1].strip() if text.startswith("ERROR:") else text


def _prepare_in_turns(a: psycopg.Connection[Any], b: psycopg.Connection[Any],
                      rounds: int) -> str | None:
    """Each connection prepares PROBE_STATEMENT once, then both run it in
    turns (each its own transaction): None when every call succeeded (a direct
    connection, or a pooler that keeps each client's prepared statements),
    else the server's message (a pooler that hands one server connection's
    prepared statements to every client: the names collide or go missing)."""
    prepared: set[int] = set()
    try:
        for _ in range(rounds):
            for conn in (a, b):
                if id(conn) not in prepared:
                    res = conn.pgconn.prepare(PROBE_STATEMENT, b"SELECT 1")
                    if res.status != pq.ExecStatus.COMMAND_OK:
                        return _said_by(res.error_message)
                    prepared.add(id(conn))
                res = conn.pgconn.exec_prepared(PROBE_STATEMENT, None)
                if res.status != pq.ExecStatus.TUPLES_OK:
                    return _said_by(res.error_message)
        return None
    finally:
        # Best effort: behind a pooler that does not track them, the statement
        # lives on whichever server connection ran the PREPARE.
        for conn in (a, b):
            if id(conn) in prepared:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("DEALLOCATE belay_doctor_probe")


def _notify(client: Belay, conn: psycopg.Connection[Any], timeout: float) -> Finding:
    listen = client.listen_conninfo
    if listen is None:
        return notify_finding(None, client.pooler, None, 0.0)
    via = "direct_url" if client.direct_url is not None else "url"
    channel = f"belay_doctor_{secrets.token_hex(8)}"
    payload = secrets.token_hex(8)
    with connect.connect(listen, None, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                         application_name=APPLICATION_NAME) as listener:
        listener.execute(sql.SQL(QUERIES["listen"]).format(channel=sql.Identifier(channel)))
        started = time.monotonic()
        store.notify(conn, channel, [payload.encode()])
        delivered = False
        for note in listener.notifies(timeout=timeout):
            if note.channel == channel and note.payload == payload:
                delivered = True
                break
        waited = time.monotonic() - started
        databases = None
        if not delivered:
            pair = (store.current_database(conn), store.current_database(listener))
            databases = pair if pair[0] != pair[1] else None
    return notify_finding(via, client.pooler, delivered, waited, databases)


def run(client: Belay, *, thresholds: Thresholds | None = None,
        retention: Mapping[str, float | None] | None = None) -> list[Finding]:
    """Every check against ``client``'s database, in :data:`CHECKS` order.

    Job rows are measured against ``client.now()`` (belay's clock, §2); the
    ages of backends and prepared transactions against the wall clock.
    ``retention`` is what the workers keep per terminal state (default: §8.7's).
    Never raises for the database's sake: a check that can't run is an
    ``error`` finding saying why.
    """
    t = thresholds or Thresholds()
    kept = dict(DEFAULT_RETENTION) | dict(retention or {})
    hidden = secrets_of(client.conninfo) + secrets_of(client.direct_url)
    try:
        conn = _connect(client.conninfo)
    except Exception as exc:
        return [Finding("schema", "error",
                        f"cannot connect to the database: {_said(exc, hidden)}",
                        "check the URL, that PostgreSQL is up and that this host may "
                        "connect to it")]
    findings: list[Finding] = []
    with conn:
        def check(name: str, body: Callable[[], Finding]) -> Finding:
            try:
                found = body()
            except Exception as exc:
                found = Finding(name, "error",
                                f"the check could not run: {_said(exc, hidden)}",
                                "see the message; the other checks ran")
            findings.append(found)
            return found

        status_box: list[SchemaStatus] = []

        def schema_check() -> Finding:
            with conn.transaction():
                status_box.append(read_status(conn))
            return schema_finding(status_box[0], latest_revision())

        check("schema", schema_check)
        check("pooler", lambda: pooler_finding(probe_pooler(client.conninfo),
                                               client.pooler))
        check("notify", lambda: _notify(client, conn, t.notify_timeout))
        # The server's timestamps are real time: measured on the wall clock, not
        # belay's (a test's manual clock).
        check("horizon", lambda: horizon_finding(_rows(conn, "doctor_horizon", {
            "wall": datetime.now(timezone.utc), "limit": HOLDERS_SHOWN * 4}), t))
        now = client.now()
        check("tables", lambda: tables_finding(
            _rows(conn, "doctor_tables", (list(TABLES),)), t, now))
        usable = bool(status_box) and status_box[0].problem is None
        if not usable:
            for name in ("leases", "queues", "retention"):
                findings.append(skipped(name, "no belay schema belay can run on (see schema)"))
            return findings
        check("leases", lambda: leases_finding(
            _rows(conn, "doctor_stuck_leases",
                  {"cutoff": now - timedelta(seconds=t.lease_margin)})[0], now, t))

        def queues_check() -> Finding:
            with conn.transaction():
                rows = store.list_queues(conn)
            paused = [name for name, opts in rows.items() if opts.get("paused")]
            return queues_finding(_rows(conn, "doctor_waiting_work", {"now": now}),
                                  paused, now, t)

        check("queues", queues_check)
        states = [s for s, keep in kept.items() if keep is not None]
        cutoffs = [now - timedelta(seconds=float(kept[s] or 0)) for s in states]
        check("retention", lambda: retention_finding(
            _rows(conn, "doctor_oldest_terminal", (states, cutoffs)), kept, now, t))
    return findings


def _said(exc: BaseException, hidden: Sequence[str]) -> str:
    return redact(" ".join(describe(exc).split()) or type(exc).__name__, hidden)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)
