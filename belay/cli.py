"""The ``belay`` command line.

Schema and processes: ``migrate``, ``check``, ``worker``, ``mcp``,
``dashboard``, ``demo``. Operating: ``stats``, ``jobs``, ``job``, ``events``,
``retry``, ``cancel``, ``signal``, ``steer``, ``top-up``, ``queues``, ``crons``, ``prune``,
``replay``, ``doctor`` — direct client calls (whoever has the database URL may already
write to it), with ``--json`` for scripts.

Exit codes:

===  ==========================================================================
0    success
1    the database is unusable: unreachable, no schema, outdated schema,
     unknown contract major, or it refused a statement
2    bad usage: bad arguments, bad JSON, options belay refuses (a number that
     is inf, nan or out of range, TLS files that are no good), a module given
     to ``--import`` or ``--authorizer`` that is missing or fails to import
3    not found: no such job, queue row or cron row
4    not possible in the job's current state (retrying a job that did not fail)
5    ``replay`` diverged from the record (blocked, raised, unused or reordered
     journal entries, another result)
0-2  ``doctor`` exits by what it found: 0 all ok (or info only), 1 a warning,
     2 an error (docs/doctor.md); its bad usage is 2 as well
130  interrupted (Ctrl-C); the servers (``worker``, ``mcp``, ``dashboard``, ``serve``)
     exit 0 on SIGINT and SIGTERM
===  ==========================================================================

Errors go to stderr as ``belay: <what went wrong and what to do>``, with any
database password shown as ``***`` (:mod:`belay.redact`). Output cut short by
its reader (``belay jobs | head``) ends quietly with 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from belay import connect
from belay.client import Belay
from belay.codec import parse_text
from belay.errors import (
    INVALID,
    UNAVAILABLE,
    BelayError,
    ConfigurationError,
    JobNotFound,
    NotRetryable,
    ValidationError,
    database_failure,
)
from belay.job import STATES
from belay.redact import describe, redact, redact_logging, secrets_of
from belay.retention import DEFAULT_RETENTION, DEFAULT_SIGNAL_TTL
from belay.schema import CONTRACT_MAJOR, MIN_REVISION, latest_revision
from belay.store import STATS_CAP


class NotFound(BelayError, LookupError):
    """No such queue or cron row (exit 3)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="belay", description="belay: a Postgres-backed durable job engine"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_url(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument(
            "--url",
            default=os.environ.get("BELAY_DATABASE_URL"),
            help="PostgreSQL URL (default: $BELAY_DATABASE_URL)",
        )
        _pooler_arguments(sub)
        return sub

    with_url("migrate", "create or upgrade the belay schema (idempotent)")
    with_url("check", "print the schema revision and contract major; exit 1 if unusable")
    run = with_url("worker", "run a worker until SIGTERM/SIGINT")
    run.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                     help="import MODULE to register its @belay.worker functions (repeatable)")
    run.add_argument("--queue", dest="queues", action="append", default=[], metavar="NAME=N",
                     help="a queue and its concurrency limit, or NAME='{json options}' "
                          "(global_limit, rate, partition…; repeatable; default: default=10)")
    run.add_argument("--notify", action="store_true",
                     help="LISTEN for pg_notify pokes and send result notifications")
    run.add_argument("--lease-ttl", type=float, default=30.0, metavar="SECONDS")
    run.add_argument("--poll-interval", type=float, default=0.5, metavar="SECONDS")
    run.add_argument("--busy-poll", type=float, default=0.025, metavar="SECONDS")
    run.add_argument("--sweep-interval", type=float, default=5.0, metavar="SECONDS")
    run.add_argument("--shutdown-grace", type=float, default=15.0, metavar="SECONDS")
    run.add_argument("--node-id", default=None)
    run.add_argument("--log-level", default="INFO")
    run.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                     help="serve Prometheus metrics on 127.0.0.1:PORT/metrics "
                          "(needs the 'metrics' extra)")
    run.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST")
    run.add_argument("--executor-socket", nargs="?", const=True, default=None, metavar="PATH",
                     help="also serve executors in other processes on a Unix-domain socket "
                          "(Executor Protocol v1); without PATH: $BELAY_SOCKET_PATH, then "
                          "the default places (docs/executors.md)")
    run.add_argument("--executor-socket-mode", default="0600", choices=("0600", "0660"),
                     help="the socket's mode: 0600 (this user) or 0660 (and its group)")
    run.add_argument("--processes", type=int, default=None, metavar="N",
                     help="run jobs in N child processes instead of threads: hard timeouts, "
                          "cancels that kill, CPU-bound jobs across cores (docs/executors.md)")
    run.add_argument("--max-tasks-per-child", type=int, default=None, metavar="N",
                     help="with --processes: replace a child after it ran N jobs")
    run.add_argument("--max-memory-per-child", type=int, default=None, metavar="MIB",
                     help="with --processes: replace a child whose resident memory is over "
                          "MIB after a job")

    def with_key(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--encryption-key-file", default=None, metavar="PATH",
                         help="a file holding the key of encrypted input "
                              "(default: $BELAY_ENCRYPTION_KEY)")

    with_key(run)

    replay = with_url("replay", "re-run a job's worker code against its recorded journal, "
                                "with no side effects, and show where the code diverges")
    replay.add_argument("job_id", type=_job_id_arg)
    replay.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="import MODULE to register the job's worker")
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    with_key(replay)

    def with_guard(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--allow-mutations", action="store_true",
                         help="let every client retry, cancel, signal and steer jobs "
                              "(a trusted local client only)")
        sub.add_argument("--authorizer", default=None, metavar="MODULE:CALLABLE",
                         help="authorize(tool, args) decides each mutation")

    http = with_url("serve", "serve the HTTP/JSON API: producers and workers in any language "
                             "(docs/http.md)")
    http.add_argument("--host", default="127.0.0.1",
                      help="a non-loopback host needs --tls-cert, --tls-key and --tls-client-ca")
    http.add_argument("--port", type=int, default=8080)
    http.add_argument("--token-file", default=None, metavar="PATH",
                      help="a file holding the bearer token producer calls must carry")
    http.add_argument("--tls-cert", default=None, metavar="PATH")
    http.add_argument("--tls-key", default=None, metavar="PATH")
    http.add_argument("--tls-client-ca", default=None, metavar="PATH",
                      help="the CA that signs client certificates (mTLS)")
    http.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[],
                      metavar="NAME", help="a Host name to answer to besides the loopback "
                      "names, like the one a reverse proxy forwards (repeatable)")
    http.add_argument("--no-workers", dest="workers", action="store_false",
                      help="serve producers only, not the HTTP worker protocol")
    http.add_argument("--session-ttl", type=float, default=60.0, metavar="SECONDS",
                      help="an HTTP worker session that stops claiming this long expires")
    http.add_argument("--lease-ttl", type=float, default=30.0, metavar="SECONDS",
                      help="the lease of a job an HTTP worker runs (renewed while its "
                           "session lives)")
    http.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="a request body that takes longer to arrive is answered 408 "
                           "and its connection closed (default 30)")

    mcp = with_url("mcp", "serve an MCP server for agents (stdio by default)")
    mcp.add_argument("--transport", choices=("stdio", "http"), default="stdio",
                     help="stdio, or streamable HTTP at http://HOST:PORT/mcp")
    mcp.add_argument("--host", default="127.0.0.1")
    mcp.add_argument("--port", type=int, default=8765)
    with_guard(mcp)

    dash = with_url("dashboard", "serve the web dashboard (read-only unless a token or "
                                 "an authorizer is configured)")
    dash.add_argument("--host", default="127.0.0.1")
    dash.add_argument("--port", type=int, default=8766)
    dash.add_argument("--token-file", default=None, metavar="PATH",
                      help="a file holding the bearer token that allows retry, cancel, "
                           "signal and steer from the page")
    dash.add_argument("--authorizer", default=None, metavar="MODULE:CALLABLE",
                      help="authorize(action, args) decides each mutation")
    dash.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[],
                      metavar="NAME", help="a Host name to answer to besides 127.0.0.1, "
                      "localhost and ::1, like the one a reverse proxy forwards (repeatable)")
    dash.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="close a connection whose request stalls this long, in whole "
                           "seconds (default 30)")
    demo = commands.add_parser(
        "demo", help="a live tour on a real database (an embedded one when no --url)"
    )
    demo.add_argument("--url", default=None, help="PostgreSQL URL (default: embedded server)")
    demo.add_argument("--agent", action="store_true",
                      help="tour a PydanticAI agent as a durable job instead (a scripted "
                      "model, no API key; extra pydantic-ai)")
    _ops_parsers(commands)
    return parser


def _pooler_arguments(sub: Any, quiet: dict[str, Any] | None = None) -> None:
    """--pooler and --direct-url: they set BELAY_POOLER / BELAY_DIRECT_URL for
    the command, so every connection it opens follows them."""
    sub.add_argument("--pooler", metavar="MODE", **(quiet or {}),
                     help="'transaction' when --url goes through a transaction-pooling "
                          "pooler such as PgBouncer (default: $BELAY_POOLER)")
    sub.add_argument("--direct-url", metavar="URL", **(quiet or {}),
                     help="a URL straight to PostgreSQL, for LISTEN and replay behind a "
                          "pooler (default: $BELAY_DIRECT_URL)")


def _apply_pooler(args: argparse.Namespace) -> None:
    pooler = getattr(args, "pooler", None)
    if pooler is not None:
        os.environ[connect.POOLER_ENV] = connect.check_pooler(pooler) or "none"
    direct = getattr(args, "direct_url", None)
    if direct:
        os.environ[connect.DIRECT_URL_ENV] = direct


def _ops_parsers(commands: Any) -> None:
    """The operating commands: reads, job mutations, queue and cron rows, retention."""

    def op(parent: Any, name: str, help: str, *, nested: bool = False) -> Any:
        """A (sub)command with --url and --json. On a nested action the two only
        set what is given, so `queues --json pause x` keeps its --json."""
        sub = parent.add_parser(name, help=help, description=help)
        quiet = {"default": argparse.SUPPRESS} if nested else {}
        sub.add_argument("--url", **({"default": os.environ.get("BELAY_DATABASE_URL")}
                                     | quiet),
                         help="PostgreSQL URL (default: $BELAY_DATABASE_URL)")
        sub.add_argument("--json", action="store_true", **quiet,
                         help="print machine-readable JSON")
        _pooler_arguments(sub, quiet)
        return sub

    stats = op(commands, "stats", "per queue: jobs by state, what unfinished jobs spent, "
                                  "jobs finished in the last minute")
    stats.add_argument("--exact", action="store_true",
                       help="count every job (by default a count stops at "
                            f"{STATS_CAP:,} and shows as {STATS_CAP:,}+: an exact count "
                            "reads every index entry, seconds on a table of 10M jobs)")

    jobs = op(commands, "jobs", "list jobs, newest first")
    jobs.add_argument("--queue")
    jobs.add_argument("--state", choices=STATES)
    jobs.add_argument("--kind")
    jobs.add_argument("--workflow", metavar="WORKFLOW_ID")
    jobs.add_argument("--parent", type=_job_id_arg, metavar="JOB_ID")
    jobs.add_argument("--before", type=_job_id_arg, metavar="JOB_ID",
                      help="only jobs with a smaller id (the next page)")
    jobs.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")

    job = op(commands, "job", "one job: its row, step journal with costs, events, errors, "
                              "children and workflow")
    job.add_argument("job_id", type=_job_id_arg)

    events = op(commands, "events", "a job's events (one JSON line each with --json)")
    events.add_argument("job_id", type=_job_id_arg)
    events.add_argument("--after", type=int, default=0, metavar="SEQ",
                        help="only events after this sequence number")
    events.add_argument("--follow", action="store_true",
                        help="keep printing new events until the job finishes")
    events.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="with --follow: stop after this long")

    op(commands, "retry", "run a failed or cancelled job again").add_argument(
        "job_id", type=_job_id_arg)
    op(commands, "cancel", "cancel a job (a running one stops at its next step)"
       ).add_argument("job_id", type=_job_id_arg)
    signal = op(commands, "signal", "deliver a signal to a job (its await_signal gets it)")
    signal.add_argument("job_id", type=_job_id_arg)
    signal.add_argument("name")
    signal.add_argument("payload", nargs="?", default="{}", metavar="JSON",
                        help="a JSON object (default {})")
    steer = op(commands, "steer", "leave steering guidance a job reads with ctx.steering()")
    steer.add_argument("job_id", type=_job_id_arg)
    steer.add_argument("payload", metavar="JSON", help='a JSON object like '
                                                       '\'{"instruction": "be brief"}\'')
    top_up = op(commands, "top-up", "raise a job's budget caps (a job paused over its "
                "budget resumes)")
    top_up.add_argument("job_id", type=_job_id_arg)
    top_up.add_argument("--usd", type=float, metavar="DOLLARS", help="added to the USD cap")
    top_up.add_argument("--tokens", type=int, metavar="N", help="added to the token cap")
    top_up.add_argument("--idempotency-key", metavar="KEY",
                        help="makes a retry safe: the same key again on this job changes "
                             "nothing; with other amounts it is refused")

    spend = op(commands, "spend", "what jobs spent (USD, tokens) over a range, by kind, queue, "
                                  "day, hour, workflow, parent, tree or a meta key")
    spend.add_argument("--by", action="append", default=None, metavar="DIMENSION",
                       help="kind (default), queue, day, hour, workflow, parent, tree or "
                            "meta:KEY; twice to cross two (--by day --by kind)")
    spend.add_argument("--since", default="7d", metavar="SPAN|TIME",
                       help="a span back from --until (30m, 24h, 7d, 2w) or an ISO 8601 "
                            "time with a zone (default 7d)")
    spend.add_argument("--until", default=None, metavar="TIME",
                       help="an ISO 8601 time with a zone (default now; exclusive)")
    spend.add_argument("--kind")
    spend.add_argument("--queue")
    spend.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                       help="only jobs whose meta has this string value (repeatable)")
    spend.add_argument("--limit", type=int, default=100, help="at most this many groups "
                       "(default 100; the total counts them all)")
    spend.add_argument("--tree", type=_job_id_arg, metavar="JOB_ID",
                       help="instead: a job and all its descendants, in all and per kind")

    queues = op(commands, "queues", "list, put, pause, resume or delete belay_queues rows")
    queue_actions = queues.add_subparsers(dest="action", metavar="ACTION")
    op(queue_actions, "list", "the belay_queues rows (the default action)", nested=True)
    put = op(queue_actions, "put", "create or replace a queue row every worker serves",
             nested=True)
    put.add_argument("name")
    put.add_argument("--limit", default="10", metavar="N|JSON",
                     help='per-node concurrency, or {"min": a, "max": b} (default 10)')
    put.add_argument("--global-limit", type=int, default=None, metavar="N")
    put.add_argument("--rate", default=None, metavar="JSON",
                     help='like {"allowed": 100, "period": 60}')
    put.add_argument("--partition", default=None, metavar="JSON",
                     help='like {"input": "tenant"}')
    for action, text in (("pause", "stop every worker claiming from a queue"),
                         ("resume", "undo pause"),
                         ("delete", "remove a queue row (workers go back to static options)")):
        op(queue_actions, action, text, nested=True).add_argument("name")

    crons = op(commands, "crons", "list, put, pause, resume or delete dynamic crons; "
                                  "schedule, status or cancel schedules")
    cron_actions = crons.add_subparsers(dest="action", metavar="ACTION")
    op(cron_actions, "list", "the belay_crons rows, then the schedules (the default "
                             "action; --json: the rows)", nested=True)
    op(cron_actions, "schedules", "the schedules, cancelled ones included", nested=True)
    cput = op(cron_actions, "put", "create or replace a dynamic cron every node fires",
              nested=True)
    cput.add_argument("name")
    cput.add_argument("expression", metavar="EXPR", help='five UTC fields like "0 8 * * 1-5", '
                                                         "or @hourly, @daily…")
    cput.add_argument("worker", metavar="WORKER", help="the kind its jobs get")
    _cron_job_arguments(cput)
    for action, text in (("pause", "stop a cron firing"), ("resume", "undo pause"),
                         ("delete", "delete a dynamic cron")):
        op(cron_actions, action, text, nested=True).add_argument("name")
    sput = op(cron_actions, "schedule", "create or redeclare a schedule: a cron with an "
                                        "overlap policy and a catch-up mode", nested=True)
    sput.add_argument("name")
    sput.add_argument("expression", metavar="EXPR", help='five UTC fields like "0 3 * * *"')
    sput.add_argument("worker", metavar="WORKER", help="the kind its jobs get")
    sput.add_argument("--overlap", default="skip", choices=("skip", "queue", "allow"),
                      help="while the previous occurrence runs: skip this one (default), "
                           "queue it, or allow it to run too")
    sput.add_argument("--catch-up", default="latest", choices=("latest", "all"),
                      help="several due at once: run the latest (default) or all in turn")
    _cron_job_arguments(sput)
    op(cron_actions, "status", "a schedule's definition and state (cursor, next occurrence, "
                               "active job)", nested=True).add_argument("name")
    op(cron_actions, "cancel", "stop a schedule firing (declaring it again brings it back)",
       nested=True).add_argument("name")

    prune = op(commands, "prune", "delete finished jobs past their retention now, as "
                                  "workers do every minute")
    for state, keep in DEFAULT_RETENTION.items():
        prune.add_argument(f"--{state}", type=_keep, default=keep, metavar="SECONDS",
                           help=f"keep {state} jobs this long, or 'forever' (default {keep:g})")
    prune.add_argument("--signal-ttl", type=_keep, default=DEFAULT_SIGNAL_TTL,
                       metavar="SECONDS", help="keep delivered signals this long, or "
                                               f"'forever' (default {DEFAULT_SIGNAL_TTL:g})")

    doctor = op(commands, "doctor", "check a deployment: schema, pooler, NOTIFY, vacuum, "
                                    "stuck leases, unserved queues, retention (exit 0 ok, "
                                    "1 warnings, 2 errors; docs/doctor.md)")
    for state, keep in DEFAULT_RETENTION.items():
        doctor.add_argument(f"--{state}", type=_keep, default=keep, metavar="SECONDS",
                            help=f"the retention your workers keep {state} jobs, or "
                                 f"'forever' (default {keep:g})")


def _job_id_arg(text: str) -> int:
    """A job id as PostgreSQL's bigint holds it: 1 to 2**63 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (a whole number)") from None
    if not 1 <= value <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (1 to {2**63 - 1})")
    return value


def _keep(text: str) -> float | None:
    if text.strip().lower() == "forever":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not seconds (like 86400) or 'forever'") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Whatever is printed or logged from here on is redacted with the
    # passwords of the URL given, however malformed it is.
    secrets = (secrets_of(getattr(args, "url", None))
               + secrets_of(getattr(args, "direct_url", None) or os.environ.get(
                   connect.DIRECT_URL_ENV)))
    return _guarded(lambda: _dispatch(args, secrets), secrets)


def _dispatch(args: argparse.Namespace, secrets: Sequence[str]) -> int:
    _check_numbers(args)
    _apply_pooler(args)
    if args.command == "worker":
        return _worker(args, secrets)
    _redact_last_resort(secrets)
    if args.command == "demo":
        return _demo(args.url, agent=args.agent)
    if not args.url:
        raise ValidationError("no database URL: pass --url or set BELAY_DATABASE_URL")
    if args.command == "replay":
        return _replay(args)
    if args.command == "mcp":
        return _mcp(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "dashboard":
        return _dashboard(args)
    operate = _OPS.get(args.command)
    if operate is not None:
        return _operate(operate, args)
    return _schema(args.command, args.url)


class _InterruptedImport(Exception):
    """Ctrl-C while a module was importing (exit 130, with where it was)."""


def _guarded(command: Callable[[], int], secrets: Sequence[str] = ()) -> int:
    """Run a command, turning the errors a user can cause into a message and the
    exit code of the module's table; every message redacted of ``secrets``."""

    def say(message: str) -> None:
        print(f"belay: {redact(message, secrets)}", file=sys.stderr)

    try:
        return command()
    except (JobNotFound, NotFound) as exc:
        say(describe(exc))
        return 3
    except NotRetryable as exc:
        say(describe(exc))
        return 4
    # After the two above: ValidationError is a ValueError too, and every
    # BelayError not caught before means a database belay can't use.
    except (ValueError, ImportError, ConfigurationError) as exc:
        say(describe(exc))
        return 2
    except BelayError as exc:
        say(describe(exc))
        return 1
    except psycopg.Error as exc:
        what = {UNAVAILABLE: "cannot connect to the database",
                INVALID: "the database refused a value"}.get(database_failure(exc) or "",
                                                             "the database refused")
        say(f"{what}: {describe(exc).strip()}")
        return 1
    except _InterruptedImport as exc:
        say(describe(exc))
        return 130
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`belay jobs | head`): end quietly, and keep the
        # interpreter's final flush from failing on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        say(describe(exc))
        return 2
    except Exception as exc:
        # A bug: keep the traceback for the report, without the password a
        # wrapped psycopg error may quote.
        text = "".join(traceback.format_exception(exc))
        print(redact(text, secrets), end="", file=sys.stderr)
        say(f"unexpected {type(exc).__name__}: that is a bug in belay, please report it "
            "with the traceback above")
        return 1


def _redact_last_resort(secrets: Sequence[str]) -> None:
    """Warnings logged with no logging configured (psycopg_pool's, say) go to
    stderr as Python's last-resort handler would print them, redacted."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    redact_logging(secrets)


_DAY = 86_400.0
#: argument → (option, lowest, whether lowest itself is allowed, highest).
_NUMBERS: dict[str, tuple[str, float, bool, float]] = {
    "lease_ttl": ("--lease-ttl", 0.0, False, _DAY),
    "session_ttl": ("--session-ttl", 0.0, False, _DAY),
    "poll_interval": ("--poll-interval", 0.0, False, 3600.0),
    "busy_poll": ("--busy-poll", 0.0, False, 3600.0),
    "sweep_interval": ("--sweep-interval", 0.0, False, _DAY),
    "shutdown_grace": ("--shutdown-grace", 0.0, True, _DAY),
    "read_timeout": ("--read-timeout", 0.0, False, 3600.0),
    "timeout": ("--timeout", 0.0, True, 366 * _DAY),
    "port": ("--port", 0, True, 65535),
    "metrics_port": ("--metrics-port", 0, True, 65535),
}


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse a number option that is inf, nan, out of range or absurd, naming
    it, before anything is served (argparse's float takes 'inf' and 'nan')."""
    for attribute, (option, low, low_ok, high) in _NUMBERS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        above = value >= low if low_ok else value > low
        if not (math.isfinite(value) and above and value <= high):
            if option.endswith("port"):
                wanted = "a port number from 0 (any free port) to 65535"
            else:
                wanted = f"seconds {'>=' if low_ok else '>'} {low:g} and at most {high:.0f}"
            raise ValidationError(f"{option} is {wanted}, got {value!r}")


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exc`` outside the import
    machinery, or of the faulty line of a SyntaxError."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen ")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import(module: str, option: str) -> None:
    """Import ``module`` for ``option`` (``--import x``, ``--authorizer x:f``);
    whatever it raises becomes a message naming the module, what it raised,
    where, and the fix (exit 2) instead of a traceback."""
    import importlib

    try:
        importlib.import_module(module)
    except KeyboardInterrupt as exc:
        raise _InterruptedImport(f"interrupted while importing {module!r}{_where(exc)}"
                                 ) from None
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigurationError(
                f"{option}: no module named {exc.name!r}: check the spelling, and run belay "
                "from the directory that holds it (or add that directory to PYTHONPATH)"
            ) from None
        raise ConfigurationError(_import_failed(module, option, exc)) from None
    except SystemExit as exc:
        raise ConfigurationError(
            f"{option}: importing {module!r} called sys.exit({exc.code!r}){_where(exc)}: a "
            "module belay imports must not exit; move that code under "
            "'if __name__ == \"__main__\":'") from None
    except BaseException as exc:
        raise ConfigurationError(_import_failed(module, option, exc)) from None


def _import_failed(module: str, option: str, exc: BaseException) -> str:
    return (f"{option}: importing {module!r} raised {type(exc).__name__}: {describe(exc)}"
            f"{_where(exc)}; fix the module so that 'python -c \"import {module}\"' "
            "succeeds, then start belay again")


def _schema(command: str, url: str) -> int:
    with Belay(url, verify_schema=False) as instance:
        if command == "migrate":
            applied = instance.migrate()
            status = instance.check_schema()
            if applied:
                revisions = ", ".join(map(str, applied))
                print(f"applied migration(s) {revisions}; now at {status.describe()}")
            else:
                print(f"already up to date: {status.describe()}")
            return 0
        status = instance.check_schema()
        print(f"ok: {status.describe()} (belay needs revision >= {MIN_REVISION}, "
              f"knows up to {latest_revision()}, contract major {CONTRACT_MAJOR})")
        return 0


#: The most jobs one node may run at once from one queue (one thread each).
MAX_CONCURRENCY = 10_000


def parse_queue_option(text: str) -> tuple[str, Any]:
    """``name``, ``name=N`` or ``name={json options}`` (see docs/queues.md)."""
    name, sep, value = text.partition("=")
    if not sep:
        return name, 10
    if value.lstrip().startswith("{"):
        try:
            return name, parse_text(value, what="the text")
        except ValidationError as exc:
            raise ValueError(f"--queue {text!r}: the options after '=' are not JSON ({exc})") \
                from None
    if not (value.isascii() and value.isdigit() and len(value) <= 6) \
            or not 1 <= int(value) <= MAX_CONCURRENCY:
        raise ValueError(f"--queue {text!r}: after '=' comes a whole number from 1 to "
                         f"{MAX_CONCURRENCY} or JSON options like "
                         "{\"limit\": 10, \"global_limit\": 20}")
    return name, int(value)


def _worker(args: argparse.Namespace, secrets: Sequence[str]) -> int:
    from belay.runner import Worker

    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        raise ValidationError(f"--log-level is DEBUG, INFO, WARNING, ERROR or CRITICAL, "
                              f"got {args.log_level!r}")
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_logging(secrets)
    if not args.url:
        raise ValidationError("no database URL: pass --url or set BELAY_DATABASE_URL")
    queues = dict(parse_queue_option(q) for q in args.queues) or {"default": 10}
    sys.path.insert(0, os.getcwd())
    for module in args.imports:
        _import(module, f"--import {module}")
    client = Belay(args.url, notify=args.notify, encryption_key=_encryption_key(args))
    worker = Worker(
        queues, client=client, notify=args.notify, lease_ttl=args.lease_ttl,
        poll_interval=args.poll_interval, busy_poll=min(args.busy_poll, args.poll_interval),
        sweep_interval=args.sweep_interval, shutdown_grace=args.shutdown_grace,
        node_id=args.node_id, executor_socket=args.executor_socket,
        executor_socket_mode=int(args.executor_socket_mode, 8), processes=args.processes,
        max_tasks_per_child=args.max_tasks_per_child,
        max_memory_per_child=args.max_memory_per_child,
    )
    if not len(worker.registry) and worker.executors is None:
        print("belay: no workers registered: pass --import with the module that defines "
              "your @belay.worker functions, or --executor-socket to serve executors in "
              "other processes", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        from belay.telemetry import start_metrics

        start_metrics(worker, port=args.metrics_port, host=args.metrics_host)
    worker.run()
    return 0


def _guard(args: argparse.Namespace) -> Any:
    from belay.ops import Guard, load_authorizer

    sys.path.insert(0, os.getcwd())
    authorizer = None
    if args.authorizer:
        module, sep, attr = args.authorizer.partition(":")
        if sep and module and attr:
            _import(module, f"--authorizer {args.authorizer}")
        authorizer = load_authorizer(args.authorizer)
    return Guard(allow=getattr(args, "allow_mutations", False), authorizer=authorizer)


def _encryption_key(args: argparse.Namespace) -> str | None:
    if args.encryption_key_file is None:
        return os.environ.get("BELAY_ENCRYPTION_KEY") or None
    key = _read_file("--encryption-key-file", args.encryption_key_file)
    if not key:
        raise ConfigurationError(f"--encryption-key-file {args.encryption_key_file}: the file "
                                 "is empty")
    return key


def _replay(args: argparse.Namespace) -> int:
    """Exit 0 when the code retraced the record exactly, 5 when it diverged
    (blocked, raised, left journal entries unused, asked them in another order
    or returned another result), 3 when there is no such job."""
    from belay import replay

    sys.path.insert(0, os.getcwd())
    for module in args.imports:
        _import(module, f"--import {module}")
    with Belay(args.url, encryption_key=_encryption_key(args)) as client:
        report = replay.dry_run(client, args.job_id)
    print(json.dumps(report.to_dict(), indent=2) if args.json else replay.format_report(report))
    return 5 if report.diverged else 0


def _mcp(args: argparse.Namespace) -> int:
    from belay import mcp_server

    mcp_server.serve(args.url, guard=_guard(args), transport=args.transport,
                     host=args.host, port=args.port)
    return 0


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    token = _read_file("--token-file", path)
    if not token:
        raise ConfigurationError(f"--token-file {path}: the file is empty")
    return token


def _read_file(option: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigurationError(f"{option} {path}: cannot read it: {reason}") from None


def _serve(args: argparse.Namespace) -> int:
    from belay.http import server

    server.serve(args.url, host=args.host, port=args.port, token=_read_token(args.token_file),
                 tls_cert=args.tls_cert, tls_key=args.tls_key,
                 tls_client_ca=args.tls_client_ca, allowed_hosts=args.allowed_hosts,
                 workers=args.workers, session_ttl=args.session_ttl,
                 lease_ttl=args.lease_ttl, read_timeout=args.read_timeout)
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from belay import dashboard

    dashboard.serve(args.url, host=args.host, port=args.port, guard=_guard(args),
                    token=_read_token(args.token_file), allowed_hosts=args.allowed_hosts,
                    read_timeout=args.read_timeout)
    return 0


def _demo(url: str | None, *, agent: bool = False) -> int:
    from belay import demo

    if agent:
        from belay import demo_agent

        demo_agent.run(url, print, demo.approve_from_terminal(print))
        return 0
    demo.run(url)
    return 0


# -- Operating commands ---------------------------------------------------------------
# Each takes the parsed arguments and an open client, prints, and returns the exit code.

Operate = Callable[[argparse.Namespace, Belay], int]


def _operate(operate: Operate, args: argparse.Namespace) -> int:
    with Belay(args.url, max_pool_size=2, application_name="belay-cli") as client:
        return operate(args, client)


def _emit(args: argparse.Namespace, data: Any, text: str) -> int:
    """Print ``data`` as JSON with --json, else ``text``; exit 0."""
    print(json.dumps(data, indent=2, ensure_ascii=False) if args.json else text)
    return 0


def _json_object(text: str, what: str, example: str) -> dict[str, Any]:
    """A command-line argument that must be a JSON object."""
    from belay import ops

    value = _json_value(text, what, example)
    if not isinstance(value, dict):
        raise ValidationError(f"{what} is a JSON object like {example}, got {text!r}")
    # The checks every operator surface makes (jsonb's text, depth), before any SQL.
    return ops.object_arg(value, what)


def _json_value(text: str, what: str, example: str) -> Any:
    try:
        return parse_text(text, what=what)
    except ValidationError as exc:
        raise ValidationError(f"{exc}; write it like {example}, in single quotes for the "
                              "shell") from None


def _stats(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    overview = ops.queue_overview(client, None if args.exact else STATS_CAP)
    return _emit(args, overview, cliformat.stats_table(overview))


def _jobs(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    found = client.list_jobs(queue=args.queue, state=args.state, kind=args.kind,
                             workflow_id=args.workflow, parent_id=args.parent,
                             before_id=args.before, limit=args.limit)
    lines = [ops.job_line(job) for job in found]
    text = cliformat.jobs_table(lines)
    if len(found) == args.limit:
        text += f"\n(more may follow: add --before {found[-1].id})"
    return _emit(args, lines, text)


def _job(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    detail = ops.job_detail(client, args.job_id)
    if detail is None:
        raise JobNotFound(args.job_id)
    return _emit(args, detail, cliformat.job_text(detail))


def _events(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    if args.timeout is not None and not args.follow:
        raise ValidationError("--timeout only applies with --follow")
    if client.get_job(args.job_id) is None:
        raise JobNotFound(args.job_id)
    events = (client.subscribe_events(args.job_id, args.after, timeout=args.timeout)
              if args.follow else client.events(args.job_id, args.after))
    printed = 0
    for event in events:
        view = ops.event_view(event)
        print(json.dumps(view, ensure_ascii=False) if args.json else cliformat.event_line(view),
              flush=True)
        printed += 1
    if args.follow:
        job = client.get_job(args.job_id)
        if job is not None and not job.terminal:
            said = (f"job {args.job_id} finished, then was retried: it is {job.state} now"
                    if args.timeout is None else
                    f"stopped following after {args.timeout:g} s; job {args.job_id} is "
                    f"still {job.state}")
            print(f"belay: {said}", file=sys.stderr)
    elif not printed and not args.json:
        print(f"no events after seq {args.after}")
    return 0


def _retry(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    view = ops.job_view(client.retry_job(args.job_id))
    return _emit(args, {"job_id": args.job_id, "job": view}, cliformat.retried_text(view))


def _cancel(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat

    status = client.cancel_job(args.job_id)
    return _emit(args, {"job_id": args.job_id, "status": status},
                 cliformat.CANCEL_TEXT[status].format(id=args.job_id))


def _signal(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat

    payload = _json_object(args.payload, "the signal payload", '\'{"approved": true}\'')
    if client.get_job(args.job_id) is None:
        raise JobNotFound(args.job_id)
    woken = client.signal_job(args.job_id, args.name, payload)
    return _emit(args, {"job_id": args.job_id, "signal": args.name, "woken": woken},
                 cliformat.woken_text(f"signal {args.name!r}", args.job_id, woken))


def _steer(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat

    payload = _json_object(args.payload, "the steering payload",
                          '\'{"instruction": "be brief"}\'')
    if client.get_job(args.job_id) is None:
        raise JobNotFound(args.job_id)
    woken = client.steer_job(args.job_id, payload)
    return _emit(args, {"job_id": args.job_id, "steered": True, "woken": woken},
                 cliformat.woken_text("steering", args.job_id, woken))


def _top_up(args: argparse.Namespace, client: Belay) -> int:
    from belay import ops
    from belay.budget import pause_need

    done = ops.mutate(client, ops.Guard(allow=True), "top_up",
                      {"job_id": args.job_id, "usd": args.usd, "tokens": args.tokens,
                       "idempotency_key": args.idempotency_key})
    job = done["job"]
    caps = ", ".join(f"{unit} cap {job[key]:g}" for unit, key in
                     (("USD", "budget_usd"), ("token", "budget_tokens"))
                     if job[key] is not None)
    text = (f"job {args.job_id}: {caps}; "
            + ("resumed" if done["resumed"] else
               "still paused: a cap is still short" if pause_need(job["await_name"]) is not None
               else job["state"]))
    if done["duplicate"]:
        text = (f"job {args.job_id}: already topped up with this key, nothing changed "
                f"({caps}; {'the first top-up resumed it' if done['resumed'] else job['state']})")
    return _emit(args, done, text)


def _spend(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    if args.tree is not None:
        view = ops.spend_view(client, {"tree": args.tree})
        return _emit(args, view, cliformat.spend_tree_text(view))
    meta: dict[str, str] = {}
    for pair in args.meta:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValidationError(f"--meta is KEY=VALUE (like customer=acme), got {pair!r}")
        meta[key] = value
    view = ops.spend_view(client, {
        "by": args.by or ["kind"], "since": args.since, "until": args.until,
        "kind": args.kind, "queue": args.queue, "meta": meta or None, "limit": args.limit})
    return _emit(args, view, cliformat.spend_table(view))


def _queues(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    action, name = args.action or "list", str(getattr(args, "name", ""))
    if action == "list":
        rows = [{"queue": queue, "options": ops.jsonable(
                    {k: v for k, v in opts.items() if k != "paused"}),
                 "paused": bool(opts.get("paused"))}
                for queue, opts in sorted(client.list_queues().items())]
        return _emit(args, rows, cliformat.queues_table(rows))
    if action == "put":
        limit = (int(args.limit) if args.limit.strip().isdigit()
                 else _json_value(args.limit, "--limit", '10 or \'{"min": 2, "max": 20}\''))
        rate = None if args.rate is None else _json_object(
            args.rate, "--rate", '\'{"allowed": 100, "period": 60}\'')
        partition = None if args.partition is None else _json_value(
            args.partition, "--partition", '\'{"input": "tenant"}\'')
        spec = client.put_queue(name, limit=limit, global_limit=args.global_limit, rate=rate,
                                partition=partition)
        options = spec.to_opts()
        return _emit(args, {"queue": name, "options": options},
                     f"put queue {name!r}: {json.dumps(options)}")
    if action == "pause":
        client.pause_queue(name)
        return _emit(args, {"queue": name, "paused": True},
                     f"paused queue {name!r}: no worker claims from it (running jobs finish)")
    if action == "resume":
        if not client.resume_queue(name):
            raise NotFound(f"no queue row named {name!r}: nothing to resume "
                           "('belay queues list' shows the rows)")
        return _emit(args, {"queue": name, "paused": False}, f"resumed queue {name!r}")
    if not client.delete_queue(name):
        raise NotFound(f"no queue row named {name!r} ('belay queues list' shows the rows)")
    return _emit(args, {"queue": name, "deleted": True}, f"deleted queue row {name!r}")


def _crons(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, ops

    action, name = args.action or "list", str(getattr(args, "name", ""))
    if action == "list":
        rows = [ops.cron_view(c) for c in client.list_crons()]
        scheduled = [] if args.json else [s.to_dict() for s in client.schedules()]
        text = cliformat.crons_table(rows)
        if scheduled:
            text += "\n\n" + cliformat.schedules_table(scheduled)
        return _emit(args, rows, text)
    if action == "schedules":
        views = [s.to_dict() for s in client.schedules()]
        return _emit(args, views, cliformat.schedules_table(views) if views else
                     "no schedules ('belay crons schedule NAME EXPR WORKER' adds one)")
    if action in ("schedule", "status", "cancel"):
        return _schedules(args, client, action, name)
    if action == "put":
        cron_input, options = _cron_job(args)
        view = ops.cron_view(client.put_cron(name, args.expression, args.worker, cron_input,
                                             **options))
        return _emit(args, view, f"put cron {name!r}: {view['expression']} -> "
                                 f"{view['worker']}" + (" (paused)" if view["paused"] else ""))
    done = {"pause": client.pause_cron, "resume": client.resume_cron,
            "delete": client.delete_cron}[action](name)
    if not done:
        raise NotFound(f"no cron row named {name!r} ('belay crons list' shows the rows; "
                       "a static cron defined in code has none)")
    past = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[action]
    return _emit(args, {"cron": name, past: True}, f"{past} cron {name!r}")


def _cron_job_arguments(sub: argparse.ArgumentParser) -> None:
    """The input and enqueue options of a cron's or a schedule's jobs."""
    sub.add_argument("--input", default=None, metavar="JSON", help="a JSON object")
    sub.add_argument("--queue", default=None)
    sub.add_argument("--priority", type=int, default=None)
    sub.add_argument("--max-attempts", type=int, default=None)
    sub.add_argument("--meta", default=None, metavar="JSON", help="a JSON object")
    sub.add_argument("--partition-key", default=None)


def _cron_job(args: argparse.Namespace) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(input, enqueue options given) from :func:`_cron_job_arguments`."""
    example = '\'{"report": "daily"}\''
    options = {
        "queue": args.queue, "priority": args.priority, "max_attempts": args.max_attempts,
        "partition_key": args.partition_key,
        "meta": None if args.meta is None else _json_object(args.meta, "--meta", example),
    }
    job_input = None if args.input is None else _json_object(args.input, "--input", example)
    return job_input, {k: v for k, v in options.items() if v is not None}


def _schedules(args: argparse.Namespace, client: Belay, action: str, name: str) -> int:
    from belay import cliformat

    if action == "schedule":
        job_input, options = _cron_job(args)
        declared = client.schedule(name, args.expression, args.worker, job_input,
                                   overlap=args.overlap, catch_up=args.catch_up, **options)
        view = declared.to_dict()
        return _emit(args, view, cliformat.schedule_text(view))
    if action == "cancel" and not client.cancel_schedule(name):
        raise NotFound(f"no live schedule named {name!r} ('belay crons list' shows them)")
    found = client.schedule_status(name)
    if found is None:
        raise NotFound(f"no schedule named {name!r} ('belay crons list' shows them)")
    view = found.to_dict()
    return _emit(args, view, cliformat.schedule_text(view))


def _doctor(args: argparse.Namespace, client: Belay) -> int:
    """Exit 0 when every check is ok (or info), 1 with a warning, 2 with an error."""
    from belay import doctor, retention

    for state in DEFAULT_RETENTION:
        keep = getattr(args, state)
        if keep is not None and not retention.keep_ok(keep):
            raise ValidationError(f"--{state} is seconds > 0 (at most a century) or "
                                  f"'forever', got {keep:g}")
    findings = doctor.run(client, retention={s: getattr(args, s) for s in DEFAULT_RETENTION})
    _emit(args, doctor.report(findings), doctor.format_text(findings))
    return doctor.exit_code(findings)


def _prune(args: argparse.Namespace, client: Belay) -> int:
    from belay import cliformat, queues, retention

    asked = {"succeeded": args.succeeded, "failed": args.failed,
             "cancelled": args.cancelled, "signal-ttl": args.signal_ttl}
    for option, keep in asked.items():
        if keep is not None and not retention.keep_ok(keep):
            raise ValidationError(f"--{option} is seconds > 0 (at most a century) or "
                                  f"'forever', got {keep:g}")
    kept = retention.parse_retention(
        {"succeeded": args.succeeded, "failed": args.failed, "cancelled": args.cancelled})
    # Rate windows a row's rate math still reads are kept, as a worker keeps them.
    specs, _ = queues.merge({}, client.list_queues())
    periods = [spec.rate.period for spec in specs.values() if spec.rate is not None]
    counts: dict[str, int] = {}
    with client.connection() as conn:
        # Until nothing expired is left: pass after pass, each batch of
        # PRUNE_BATCH jobs its own transaction (never one huge DELETE).
        while True:
            done = retention.prune_pass(conn, client.now(), kept, args.signal_ttl, periods,
                                        budget=None)
            for kind, n in done.counts.items():
                counts[kind] = counts.get(kind, 0) + n
            if not done.behind:
                break
    return _emit(args, {"deleted": counts, "retention": kept, "signal_ttl": args.signal_ttl},
                 cliformat.pruned_text(counts))


_OPS: dict[str, Operate] = {
    "stats": _stats, "jobs": _jobs, "job": _job, "events": _events, "retry": _retry,
    "cancel": _cancel, "signal": _signal, "steer": _steer, "top-up": _top_up,
    "spend": _spend, "queues": _queues,
    "crons": _crons, "prune": _prune, "doctor": _doctor,
}


if __name__ == "__main__":
    sys.exit(main())
