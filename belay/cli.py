"""The ``belay`` command line: ``migrate``, ``check``, ``worker``, ``demo``.

Exit codes: 0 success; 1 the database is unusable (unreachable, no schema,
outdated schema, unknown contract major); 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from belay.client import Belay
from belay.errors import BelayError, ConfigurationError
from belay.schema import CONTRACT_MAJOR, MIN_REVISION, latest_revision


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
    demo = commands.add_parser(
        "demo", help="a live tour on a real database (an embedded one when no --url)"
    )
    demo.add_argument("--url", default=None, help="PostgreSQL URL (default: embedded server)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _guarded(lambda: _demo(args.url))
    if not args.url:
        print("belay: no database URL: pass --url or set BELAY_DATABASE_URL", file=sys.stderr)
        return 2
    if args.command == "worker":
        return _guarded(lambda: _worker(args))
    return _guarded(lambda: _schema(args.command, args.url))


def _guarded(command: Callable[[], int]) -> int:
    """Run a command, turning the errors a user can cause into a message and an exit code:
    2 for bad usage or configuration, 1 for a database belay can't use."""
    try:
        return command()
    except (ValueError, ImportError, ConfigurationError) as exc:
        print(f"belay: {exc}", file=sys.stderr)
        return 2
    except BelayError as exc:
        print(f"belay: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"belay: cannot connect to the database: {str(exc).strip()}", file=sys.stderr)
        return 1


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


def parse_queue_option(text: str) -> tuple[str, Any]:
    """``name``, ``name=N`` or ``name={json options}`` (see docs/queues.md)."""
    name, sep, value = text.partition("=")
    if not sep:
        return name, 10
    if value.lstrip().startswith("{"):
        try:
            return name, json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--queue {text!r}: the options after '=' are not JSON: {exc}") \
                from None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--queue {text!r}: after '=' comes a whole number >= 1 or JSON "
                         "options like {\"limit\": 10, \"global_limit\": 20}")
    return name, int(value)


def _worker(args: argparse.Namespace) -> int:
    import importlib
    import logging

    from belay.runner import Worker

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    queues = dict(parse_queue_option(q) for q in args.queues) or {"default": 10}
    sys.path.insert(0, os.getcwd())
    for module in args.imports:
        importlib.import_module(module)
    client = Belay(args.url, notify=args.notify)
    worker = Worker(
        queues, client=client, notify=args.notify, lease_ttl=args.lease_ttl,
        poll_interval=args.poll_interval, busy_poll=min(args.busy_poll, args.poll_interval),
        sweep_interval=args.sweep_interval, shutdown_grace=args.shutdown_grace,
        node_id=args.node_id,
    )
    if not len(worker.registry):
        print("belay: no workers registered: pass --import with the module that defines "
              "your @belay.worker functions", file=sys.stderr)
        return 2
    worker.run()
    return 0


def _demo(url: str | None) -> int:
    from belay import demo

    demo.run(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
