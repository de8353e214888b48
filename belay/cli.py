"""The ``belay`` command line: ``belay migrate``, ``belay check``, ``belay demo``.

Exit codes: 0 success; 1 the database is unusable (unreachable, no schema,
outdated schema, unknown contract major); 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import psycopg

from belay.client import Belay
from belay.errors import BelayError
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
    demo = commands.add_parser(
        "demo", help="a live tour on a real database (an embedded one when no --url)"
    )
    demo.add_argument("--url", default=None, help="PostgreSQL URL (default: embedded server)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args.url)
    if not args.url:
        print("belay: no database URL: pass --url or set BELAY_DATABASE_URL", file=sys.stderr)
        return 2
    try:
        instance = Belay(args.url, verify_schema=False)
    except BelayError as exc:
        print(f"belay: {exc}", file=sys.stderr)
        return 2
    try:
        with instance:
            if args.command == "migrate":
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
    except BelayError as exc:
        print(f"belay: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"belay: cannot connect to the database: {str(exc).strip()}", file=sys.stderr)
        return 1


def _demo(url: str | None) -> int:
    from belay import demo

    try:
        demo.run(url)
    except BelayError as exc:
        print(f"belay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
