"""One soak worker process:
``python -m soak.worker URL TAG [--no-cron] [--pooler transaction [--direct-url URL]]``.

Runs the soak kinds (soak.kinds) on a ``belay.Worker`` with a short lease and
frequent sweeps, and records every execution's outcome as belay reports it
(``on_job_end``) in ``soak_acks`` — how the checker sees which acks applied.

With ``--pooler transaction`` URL goes through a transaction-pooling PgBouncer:
belay gets ``pooler="transaction"`` (and ``direct_url`` for LISTEN when
``--direct-url`` is given, else it polls), and the soak's own bookkeeping
connections (effects, acks) never prepare statements server-side either.

``SOAK_BREAK`` (tests only) breaks one engine rule on purpose, from this
process, by monkeypatching belay — never in belay's own code:

- ``budget``: skip the budget checks (the pre-flight and the post-step check);
- ``fence``: acks ignore the fence (state='running' AND attempt=claimed): a
  stale attempt's ack overwrites the row;
- ``steps``: a step never finds its journal entry, so every attempt re-runs
  and re-journals every step (memoization off).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

import psycopg

import belay
from soak import kinds

LEASE_TTL = 2.0
SWEEP_INTERVAL = 1.0
QUEUES = {"default": 8, "children": 4, "flow": 4}

log = logging.getLogger("soak.worker")


def apply_break(rules: str) -> None:
    """Break each comma-separated rule in this process (see the module docstring)."""
    for rule in filter(None, (r.strip() for r in rules.split(","))):
        _break(rule)


def _break(rule: str) -> None:
    if rule == "budget":
        from belay.context import Journal

        def no_budget(self: Journal, spend: Any, name: str, need: Any = (0, 0)) -> None:
            return None

        Journal._check_budget = no_budget  # type: ignore[method-assign]
    elif rule == "fence":
        from belay import store

        real_ack = store.ack

        def unfenced_ack(conn: Any, job: Any, kind: str, now: Any, **kw: Any) -> Any:
            # WHERE id = $id only: whatever attempt the row is on, and whether it
            # runs or waits for its retry, this ack lands.
            found = conn.execute("SELECT attempt FROM belay_jobs WHERE id = %s AND state NOT IN "
                                 "('succeeded', 'failed', 'cancelled')", (job.id,)).fetchone()
            if found is None:
                return real_ack(conn, job, kind, now, **kw)
            conn.execute("UPDATE belay_jobs SET state = 'running' WHERE id = %s", (job.id,))
            return real_ack(conn, job.replace(attempt=found[0]), kind, now, **kw)

        real_many = store.ack_succeeded_many

        def unfenced_many(conn: Any, acks: Any, now: Any, channel: Any = None) -> Any:
            # The batched ack, broken the same way: each row on whatever attempt it is.
            unfenced = []
            for job, result in acks:
                found = conn.execute("SELECT attempt FROM belay_jobs WHERE id = %s AND state "
                                     "NOT IN ('succeeded', 'failed', 'cancelled')",
                                     (job.id,)).fetchone()
                if found is not None:
                    conn.execute("UPDATE belay_jobs SET state = 'running' WHERE id = %s",
                                 (job.id,))
                    job = job.replace(attempt=found[0])
                unfenced.append((job, result))
            return real_many(conn, unfenced, now, channel)

        store.ack = unfenced_ack
        store.ack_succeeded_many = unfenced_many
    elif rule == "steps":
        from belay import store

        real_lookup = store.step_lookup

        def forgetful(conn: Any, job_id: int, name: str) -> Any:
            found = real_lookup(conn, job_id, name)
            if found is not None and found["hit"]:
                found = dict(found, hit=False)
            return found

        store.step_lookup = forgetful
    else:
        raise SystemExit(f"SOAK_BREAK={rule!r}: expected budget, fence or steps")


class AckRecorder:
    """Writes each JobEnd to soak_acks, in order, from a thread of its own: an
    outcome reported while the database (or the pooler in front of it) is away
    waits for it instead of being dropped; ``close()`` flushes what is left
    (a ``kill -9`` loses what was not written yet, like the attempt itself)."""

    def __init__(self, url: str, tag: str, *, pooler: str | None = None) -> None:
        self.url, self.tag = url, tag
        self.options = kinds.connect_options(pooler)
        self._cond = threading.Condition()
        self._pending: list[tuple[Any, ...]] = []
        self._seq = itertools.count(1)
        self._closing = False
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(target=self._write, name="soak-acks", daemon=True)
        self._thread.start()

    def __call__(self, end: belay.JobEnd) -> None:
        with self._cond:
            # rid: written once, however often a lost COMMIT reply makes us retry.
            rid = f"{self.tag}:{os.getpid()}:{next(self._seq)}"
            row = (end.job.id, end.job.attempt, end.outcome, self.tag,
                   datetime.now(timezone.utc), rid)
            self._pending.append(row)
            self._cond.notify_all()

    def _write(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                rows = list(self._pending)
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                                                 **self.options)
                with self._conn.transaction(), self._conn.cursor() as cur:
                    cur.executemany("INSERT INTO soak_acks (job_id, attempt, outcome, tag, at, "
                                    "rid) VALUES (%s, %s, %s, %s, %s, %s) "
                                    "ON CONFLICT (rid) DO NOTHING", rows)
            except psycopg.Error as exc:
                failures += 1
                if failures % 20 == 1:
                    log.warning("recording %d outcome(s) failed (%s); retrying", len(rows), exc)
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                time.sleep(0.3)
                continue
            failures = 0
            with self._cond:
                del self._pending[:len(rows)]

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if self._pending:
                log.warning("could not record %d outcome(s) before exiting", len(self._pending))
        if self._conn is not None and not self._thread.is_alive():
            self._conn.close()
            self._conn = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m soak.worker")
    parser.add_argument("url")
    parser.add_argument("tag")
    parser.add_argument("--no-cron", action="store_true", help="run no cron entries")
    parser.add_argument("--pooler", choices=["transaction"], default=None,
                        help="URL goes through a transaction-pooling pooler")
    parser.add_argument("--direct-url", default=None,
                        help="with --pooler: a URL straight to PostgreSQL, for LISTEN")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {args.tag} %(name)s %(levelname)s %(message)s")
    apply_break(os.environ.get("SOAK_BREAK", ""))
    kinds.TAG, kinds.URL, kinds.POOLER = args.tag, args.url, args.pooler
    # "none": the pooler mode is this command line's, never the environment's.
    client = belay.Belay(args.url, max_pool_size=24, application_name=f"soak-{args.tag}",
                         pooler=args.pooler or "none", direct_url=args.direct_url)
    worker = belay.Worker(
        QUEUES, client=client, registry=kinds.REGISTRY, lease_ttl=LEASE_TTL,
        sweep_interval=SWEEP_INTERVAL, poll_interval=0.3, notify=True, shutdown_grace=3.0,
        queue_sync_interval=5.0, crons=[] if args.no_cron else kinds.CRONS, cron_interval=5.0,
        retention={"succeeded": None, "failed": None, "cancelled": None}, signal_ttl=None,
        node_id=f"soak-{args.tag}-{os.getpid()}",
    )
    recorder = AckRecorder(args.url, args.tag, pooler=args.pooler)
    worker.on_job_end(recorder)
    # The database (or the proxy in front of it) may be down right now: keep trying.
    try:
        while True:
            try:
                worker.run()
                return
            except (psycopg.OperationalError, belay.BelayError) as exc:
                log.warning("worker start failed (%s); retrying", exc)
                time.sleep(0.5)
    finally:
        recorder.close()


if __name__ == "__main__":
    main()
