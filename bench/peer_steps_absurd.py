# mypy: allow-untyped-decorators
"""Absurd's side of the ``steps`` scenario, run with the python of Absurd's own
virtualenv (``absurd-sdk`` and ``absurdctl``; belay is not installed there).

``prepare --url U --count N [--file F --sleep S]`` installs Absurd's schema
on U — the ``absurd.sql`` that ``absurdctl`` bundles for its release, which is
what ``absurdctl init`` applies (run here through psycopg, so no ``psql`` is
needed) — creates the queue ``default`` and spawns N ``steps`` tasks.
``work --url U [--claim-timeout S] [--concurrency C]`` runs the SDK's
synchronous worker, ``Absurd(U).start_worker()``, at its defaults unless told
(claim_timeout 120 s, concurrency 1, poll_interval 0.25 s), printing ``ready``
first; SIGTERM stops it.

A task runs :data:`STEPS` ``ctx.step`` calls. Without ``--file`` each
returns its number at once; with it each first appends
``"<step> <pid> <time.time()>"`` to F, then sleeps S seconds.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import absurdctl  # type: ignore[import-not-found, unused-ignore]
import psycopg
from absurd_sdk import Absurd  # type: ignore[import-not-found, unused-ignore]

from bench import peer_cli

TASK = "steps"
STEPS = 10


def register(app: Absurd) -> None:
    @app.register_task(name=TASK)
    def steps(params: Any, ctx: Any) -> int:
        path, pause = params.get("file"), float(params.get("sleep", 0))

        def one(n: int) -> int:
            if path is not None:
                with open(path, "a") as out:
                    out.write(f"{n} {os.getpid()} {time.time():.6f}\n")
                time.sleep(pause)
            return n

        for n in range(1, STEPS + 1):
            ctx.step(f"s{n}", lambda n=n: one(n))
        return STEPS


def prepare(url: str, count: int, path: str | None, pause: float) -> None:
    if absurdctl.ABSURD_SCHEMA_TARGET_VERSION != "0.5.1":
        raise SystemExit(f"absurdctl bundles schema {absurdctl.ABSURD_SCHEMA_TARGET_VERSION}")
    with psycopg.connect(url, autocommit=True) as conn:
        # No parameters: psycopg sends the whole script in one simple query.
        conn.execute(absurdctl.BUNDLED_SCHEMA_SQL)
    app = Absurd(url)
    try:
        register(app)
        app.create_queue("default")
        params = {"file": path, "sleep": pause} if path else {}
        for _ in range(count):
            app.spawn(TASK, params)
    finally:
        app.close()


def work(url: str, claim_timeout: int | None, concurrency: int | None) -> None:
    app = Absurd(url)
    register(app)
    signal.signal(signal.SIGTERM, lambda *_: app.stop_worker())
    options: dict[str, Any] = {}
    if claim_timeout is not None:
        options["claim_timeout"] = claim_timeout
    if concurrency is not None:
        options["concurrency"] = concurrency
    print("ready", flush=True)
    app.start_worker(**options)


def main() -> None:
    parser, serve = peer_cli.steps_parser("python -m bench.peer_steps_absurd",
                                         prepare="install the schema, spawn tasks")
    serve.add_argument("--claim-timeout", type=int)
    serve.add_argument("--concurrency", type=int)
    args: Any = parser.parse_args()
    if args.command == "prepare":
        prepare(args.url, args.count, args.file, args.sleep)
    else:
        work(args.url, args.claim_timeout, args.concurrency)


if __name__ == "__main__":
    main()
