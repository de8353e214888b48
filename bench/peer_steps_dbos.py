# mypy: allow-untyped-decorators
"""DBOS's side of the ``steps`` scenario, run with the python of DBOS's own
virtualenv (belay is not installed there: this imports DBOS, two of its own
dependencies, psycopg and SQLAlchemy, and the standard library).

``prepare --url U --count N [--file F --sleep S]`` launches DBOS on U (which
creates its system tables in the schema ``dbos``) listening to no queue,
registers the queue ``steps`` at its defaults and enqueues N ``steps_job``
workflows on it, then exits. ``work --url U`` is the worker: DBOS launched on
U at its defaults (it recovers this executor's pending workflows on launch and
dequeues ``steps``), printing ``ready`` once launched; SIGTERM ends it.
Logging is at ERROR: at its defaults DBOS starts every queued workflow at once,
and with thousands its pool of 20 connections runs dry, which it logs as a
warning with a traceback per wait.

A workflow runs :data:`STEPS` ``@DBOS.step()`` calls. Without ``--file``
each returns its number at once; with it each first appends
``"<step> <pid> <time.time()>"`` to F, then sleeps S seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psycopg
from dbos import DBOS, DBOSConfig  # type: ignore[import-not-found, unused-ignore]
from sqlalchemy.engine import URL

from bench import peer_cli

APP = "belay-bench-steps"
QUEUE = "steps"
STEPS = 10


@DBOS.step()
def noop_step(n: int) -> int:
    return n


@DBOS.step()
def sleep_step(n: int, path: str, pause: float) -> int:
    with open(path, "a") as out:
        out.write(f"{n} {os.getpid()} {time.time():.6f}\n")
    time.sleep(pause)
    return n


@DBOS.workflow()
def steps_job(path: str | None, pause: float) -> int:
    for n in range(1, STEPS + 1):
        if path is None:
            noop_step(n)
        else:
            sleep_step(n, path, pause)
    return STEPS


def sqlalchemy_url(conninfo: str) -> str:
    """The bench passes libpq conninfo (``host=… dbname=…``); DBOS takes a URL."""
    info = psycopg.conninfo.conninfo_to_dict(conninfo)
    return URL.create("postgresql", username=_text(info.get("user")),
                      password=_text(info.get("password")), host=_text(info.get("host")),
                      port=int(str(info["port"])) if info.get("port") else None,
                      database=_text(info.get("dbname"))).render_as_string(hide_password=False)


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def config(url: str) -> DBOSConfig:
    # Only the logging is quieter than DBOS's default (INFO): nothing else is set.
    return {"name": APP, "system_database_url": sqlalchemy_url(url), "log_level": "ERROR"}


def prepare(url: str, count: int, path: str | None, pause: float) -> None:
    DBOS(config=config(url))
    DBOS.listen_queues([])  # this process only enqueues
    DBOS.launch()
    try:
        DBOS.register_queue(QUEUE)
        for _ in range(count):
            DBOS.enqueue_workflow(QUEUE, steps_job, path, pause)
    finally:
        DBOS.destroy()


def work(url: str) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    DBOS(config=config(url))
    DBOS.launch()
    DBOS.register_queue(QUEUE)
    print("ready", flush=True)
    stop.wait()
    # Whatever is left running is abandoned, as at a crash: the bench only
    # stops a worker once its queue is drained.
    os._exit(0)


def main() -> None:
    parser, _ = peer_cli.steps_parser("python -m bench.peer_steps_dbos",
                                      prepare="create the tables, enqueue workflows")
    args: Any = parser.parse_args()
    if args.command == "prepare":
        prepare(args.url, args.count, args.file, args.sleep)
    else:
        work(args.url)


if __name__ == "__main__":
    main()
