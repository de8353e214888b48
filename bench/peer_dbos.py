"""DBOS's side of the peer benchmark (durable workflows on a DBOS queue), run
with the python of DBOS's own virtualenv (belay is not installed there, so this
imports DBOS, SQLAlchemy, psycopg and the standard library only).

``prepare --url U --count N`` creates DBOS's system tables (``DBOS.migrate``),
registers the queue held shut (``worker_concurrency=0``: no process dequeues
from it) and enqueues N no-op workflows with a ``DBOSClient``, all in one
transaction (``enqueue_in_transaction``; DBOS has no multi-row enqueue). The
client never runs workflows, so nothing starts before the workers do.

``work --url U --worker-concurrency C --polling S`` registers the queue again,
still held, with polling interval S (before launch, so the queue's worker
thread starts at that interval), launches DBOS listening to that queue, and
prints ``ready``. On SIGUSR1 it opens the queue by setting its worker
concurrency to C (0 for none, DBOS's default: no per-process limit); every
worker does the same, and each sees the change at its next poll, so the
processes start within one polling interval of each other. SIGTERM shuts DBOS
down.

Several processes share the queue the way DBOS's docs ask of a self-hosted
fleet: each launches with an ``executor_id`` of its own (``bench-<pid>``;
without one every process is "local", so ``worker_concurrency`` cannot tell
them apart and each launch recovers the others' pending workflows as its own:
docs.dbos.dev/python/reference/queues on ``worker_concurrency``, and
/production/self-hosting/workflow-recovery), and all with the one
``application_version`` the workflows were enqueued with, since a process
dequeues only workflows of its own version.

Why the best configuration is ``worker_concurrency`` 100 with
``polling_interval_sec`` 0.01: the queue tutorial and reference
(docs.dbos.dev/python/tutorials/queue-tutorial, /python/reference/queues) name
the two settings that bear on a drain, worker concurrency (a per-process cap,
none by default) and the polling interval (how often a process looks for work,
1 s by default; shorter means a shorter wait at more database load). At the
defaults one poll claims every enqueued workflow, so the first process to poll
takes the whole queue and starts them all at once while the other idles; a
worker concurrency bounds each claim so both processes share the work, and a
short interval refills the freed slots soon. Tried with 2 processes and 20,000
workflows on the shared 2-core machine: the defaults ran at about 500
workflows/s (502, and 507 with a 0.1 s interval); with a 0.01 s interval,
worker concurrency 50 gave 937 and 922, 100 gave 980 and 1,304, 200 gave 1,267
and 986, 500 gave 966 and 1,084; 100 with a 0.1 s interval gave 1,197 and 929.
100 at 0.01 s had the best median (200 at 0.01 s was within noise of it).
"""

from __future__ import annotations

import os
import signal
import threading

import sqlalchemy as sa
from dbos import DBOS, DBOSClient, EnqueueOptions  # type: ignore[import-not-found]
from psycopg.conninfo import conninfo_to_dict

from bench import peer_cli

APP = "belay-bench"
VERSION = "belay-bench-1"
QUEUE = "bench"
WORKFLOW = "noop"


def database_url(conninfo: str) -> str:
    """The bench hands out libpq conninfo strings; DBOS takes a SQLAlchemy URL."""
    info = {key: str(value) for key, value in conninfo_to_dict(conninfo).items()}
    port = info.pop("port", None)
    url = sa.URL.create(
        "postgresql+psycopg", username=info.pop("user", None),
        password=info.pop("password", None), host=info.pop("host", None),
        port=int(port) if port else None, database=info.pop("dbname", None), query=info,
    )
    return url.render_as_string(hide_password=False)


def prepare(url: str, count: int) -> None:
    url = database_url(url)
    DBOS.migrate(url)
    engine = sa.create_engine(url)
    client = DBOSClient(system_database_engine=engine, application_name=APP)
    try:
        client.register_queue(QUEUE, worker_concurrency=0)
        options: EnqueueOptions = {"workflow_name": WORKFLOW, "queue_name": QUEUE,
                                   "app_version": VERSION}
        with engine.begin() as conn:
            for _ in range(count):
                client.enqueue_in_transaction(conn, options)
    finally:
        client.destroy()
        engine.dispose()


def work(url: str, worker_concurrency: int, polling: float) -> None:
    go, stop = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            stop.set()
        go.set()

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    url = database_url(url)
    # Registered before launch, so the queue's worker thread starts at this
    # polling interval rather than easing down to it from the last one stored.
    client = DBOSClient(system_database_url=url, application_name=APP)
    try:
        client.register_queue(QUEUE, worker_concurrency=0, polling_interval_sec=polling)
    finally:
        client.destroy()
    DBOS(config={
        "name": APP,
        "system_database_url": url,
        "application_version": VERSION,
        "executor_id": f"bench-{os.getpid()}",
        "log_level": "WARNING",
    })

    @DBOS.workflow(name=WORKFLOW)  # type: ignore[untyped-decorator]
    def noop() -> None:
        return None

    DBOS.listen_queues([QUEUE])
    DBOS.launch()
    try:
        print("ready", flush=True)
        go.wait()
        if not stop.is_set():
            queue = DBOS.retrieve_queue(QUEUE)
            assert queue is not None
            queue.set_worker_concurrency(worker_concurrency or None)
        stop.wait()
    finally:
        DBOS.destroy()


def main() -> None:
    parser, serve = peer_cli.parser("python -m bench.peer_dbos",
                                    prepare="migrate, enqueue no-op workflows on a held queue",
                                    work="open the queue on SIGUSR1, run until SIGTERM")
    serve.add_argument("--worker-concurrency", type=int, default=0,
                       help="the queue's worker_concurrency (0: none, DBOS's default)")
    serve.add_argument("--polling", type=float, default=1.0,
                       help="the queue's polling_interval_sec (DBOS's default: 1.0)")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.url, args.count)
    else:
        work(args.url, args.worker_concurrency, args.polling)


if __name__ == "__main__":
    main()
