"""One cron "node" as an OS process, for ``tests/test_cron.py``.

    python -m tests.cron_node URL START_ISO STEP_SECONDS TICKS NODE NODES [LISTEN_URL]

Builds its own client on a ManualClock at START_ISO and a CronScheduler over
:data:`ENTRIES`, then ticks TICKS times, moving its clock STEP_SECONDS between
ticks. Before every tick the NODES processes meet at a barrier in the test's
database (table ``cron_gate``, woken by LISTEN/NOTIFY — no sleeps), so all of
them insert each round's slots at the same moment (LISTEN_URL, default URL:
where the barrier LISTENs — straight to the server when URL is a pooler's).
Prints one JSON line: the
``[cron_name, cron_slot]`` pairs its own ticks inserted.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import psycopg

import belay
from belay.cron import CronScheduler

ENTRIES: list[dict[str, Any]] = [
    {"name": "proc.every", "expression": "* * * * *", "worker": "cron.proc"},
    {"name": "proc.even", "expression": "*/2 * * * *", "worker": "cron.proc"},
    {"name": "proc.odd", "expression": "1-59/2 * * * *", "worker": "cron.proc", "queue": "odd"},
]
CHANNEL = "cron_gate"
GATE_TABLE = "CREATE TABLE cron_gate (round int NOT NULL, node int NOT NULL)"
BOUND = 60.0  # seconds a node waits for the others before giving up


def meet(conn: psycopg.Connection[Any], listener: psycopg.Connection[Any], round_: int,
         node: int, nodes: int) -> None:
    """Wait until every node has arrived at ``round_``. ``listener`` LISTENs on
    CHANNEL and does nothing else, so no notification is consumed elsewhere."""
    conn.execute("INSERT INTO cron_gate (round, node) VALUES (%s, %s)", (round_, node))
    conn.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
    while True:
        row = conn.execute("SELECT count(*) FROM cron_gate WHERE round = %s", (round_,)).fetchone()
        if row is not None and row[0] >= nodes:
            return
        if not any(True for _ in listener.notifies(timeout=BOUND, stop_after=1)):
            raise TimeoutError(f"node {node}: the others never reached round {round_}")


def main(argv: list[str]) -> None:
    url, start, step = argv[0], datetime.fromisoformat(argv[1]), float(argv[2])
    ticks, node, nodes = int(argv[3]), int(argv[4]), int(argv[5])
    listen_url = argv[6] if len(argv) > 6 else url
    clock = belay.ManualClock(start)
    inserted: list[tuple[str, str]] = []
    with (
        belay.Belay(url, clock=clock, notify=False) as client,
        psycopg.connect(listen_url, autocommit=True) as conn,
        psycopg.connect(listen_url, autocommit=True) as listener,
    ):
        listener.execute(f"LISTEN {CHANNEL}")
        scheduler = CronScheduler(client, ENTRIES)
        client.list_crons()  # open the pool before the first round
        for n in range(ticks):
            if n:
                clock.advance(step)
            meet(conn, listener, n, node, nodes)
            inserted += [(job.cron_name or "", job.cron_slot.isoformat() if job.cron_slot else "")
                         for job in scheduler.tick()]
    print(json.dumps(inserted), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
