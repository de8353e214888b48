"""``manage.py belay_worker``: run a belay worker inside the Django project.

Options mirror ``belay worker``; the defaults come from ``settings.BELAY``.
Every installed app's ``jobs.py`` is imported, the schema is checked, and
the worker runs until SIGTERM or SIGINT (then drains for SHUTDOWN_GRACE).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from belay import schema
from belay.cli import parse_queue_option
from belay.errors import ConfigurationError, WorkerCrashed
from belay.registry import DEFAULT_REGISTRY

_SECONDS = (
    ("--lease-ttl", "seconds a claim is held without a heartbeat", 30),
    ("--poll-interval", "idle polling ceiling", 0.5),
    ("--busy-poll", "polling while claims return work", 0.025),
    ("--sweep-interval", "how often expired leases are reclaimed", 5),
    ("--shutdown-grace", "seconds running jobs get to finish on SIGTERM", 15),
)


class Command(BaseCommand):
    help = ("Run a belay worker on the queues of settings.BELAY until SIGTERM/SIGINT; "
            "imports the jobs.py module of every installed app.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue", dest="queues", action="append", default=[], metavar="NAME=N",
            help="a queue and its concurrency limit, or NAME='{json options}' (repeatable; "
                 "replaces settings.BELAY['QUEUES'])")
        parser.add_argument(
            "--notify", action=argparse.BooleanOptionalAction, default=None,
            help="LISTEN for pg_notify pokes and send result notifications "
                 "(default: settings.BELAY['NOTIFY'], True)")
        for flag, what, default in _SECONDS:
            key = flag[2:].replace("-", "_").upper()
            parser.add_argument(flag, type=float, default=None, metavar="SECONDS",
                                help=f"{what} (default: settings.BELAY['{key}'], else {default})")
        parser.add_argument("--node-id", default=None,
                            help="this worker's name in leased_by (default: host/pid/random)")
        parser.add_argument("--log-level", default="INFO",
                            help="DEBUG, INFO (default), WARNING, ERROR")

    def handle(self, *args: Any, **options: Any) -> None:
        from belay_django import checks, conf
        from belay_django.adapter import conninfo_for
        from belay_django.worker import build, discover

        settings = conf.get()
        level = options["log_level"].upper()
        logging.basicConfig(level=level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("belay").setLevel(level)
        discover()
        try:
            queues = dict(parse_queue_option(q) for q in options["queues"]) or None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        conninfo = conninfo_for(settings.database)
        self._check_schema(settings.database, conninfo, checks)
        # Startup touched Django's connection of this thread; the worker never
        # uses it again.
        connections.close_all()

        overrides = {name: options[name] for name in (
            "lease_ttl", "poll_interval", "busy_poll", "sweep_interval", "shutdown_grace")}
        try:
            worker = build(settings, queues=queues, notify=options["notify"],
                           node_id=options["node_id"], **overrides)
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        client = worker.client
        if not len(DEFAULT_REGISTRY):
            client.close()
            raise CommandError(
                "no belay workers registered: define @belay.worker functions in a jobs.py "
                "module of an app in INSTALLED_APPS"
            )
        self.stdout.write(
            f"belay worker {worker.node_id}: queues {', '.join(worker.queues)}; "
            f"{len(DEFAULT_REGISTRY)} kind(s): {', '.join(sorted(DEFAULT_REGISTRY.kinds()))}"
        )
        self.stdout.flush()
        try:
            worker.run()
        except WorkerCrashed as exc:
            raise CommandError(str(exc)) from None  # exit status 1: a supervisor restarts it
        finally:
            client.close()
        self.stdout.write(f"belay worker {worker.node_id} stopped")

    def _check_schema(self, alias: str, conninfo: str, checks: Any) -> None:
        try:
            with psycopg.connect(conninfo, autocommit=True) as probe:
                status = schema.read_status(probe)
        except psycopg.OperationalError as exc:
            raise CommandError(
                f"cannot connect to database {alias!r}: {str(exc).strip()}") from None
        problem = status.problem
        if problem is not None:
            message = checks.schema_message(alias, status, problem,
                                            checks.pending_migrations(alias))
            raise CommandError(f"{message.msg}: {message.hint}")
