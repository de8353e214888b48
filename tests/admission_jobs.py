"""Jobs and a worker entry point for the admission tests run across processes.

``python -m tests.admission_jobs <url> <node> <queues-json>`` runs a worker
with those queue options until SIGTERM. Each run records, from the database,
how many jobs of its queue — and of its partition key — are running under a
live lease as it starts, in the test's ``observed`` table.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import psycopg

import belay

OBSERVE = "adm.observe"

_RECORD = """
INSERT INTO observed (job_id, queue, tenant, queue_running, key_running, pid)
SELECT %(id)s, %(queue)s, %(tenant)s,
  (SELECT count(*) FROM belay_jobs
   WHERE queue = %(queue)s AND state = 'running' AND lease_until > clock_timestamp()),
  (SELECT count(*) FROM belay_jobs
   WHERE queue = %(queue)s AND state = 'running' AND lease_until > clock_timestamp()
     AND input ->> 'tenant' = %(tenant)s),
  %(pid)s
"""


@belay.worker(name=OBSERVE)
def observe(ctx: belay.Context) -> None:
    """Record the running counts, then work for ``input["hold"]`` seconds."""
    with psycopg.connect(ctx.client.conninfo, autocommit=True) as conn:
        conn.execute(_RECORD, {"id": ctx.id, "queue": ctx.queue,
                               "tenant": ctx.input.get("tenant", ""), "pid": os.getpid()})
    time.sleep(float(ctx.input.get("hold", 0.05)))  # the job's work


def main(argv: list[str]) -> None:
    url, node, queues = argv[1], argv[2], json.loads(argv[3])
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    belay.Worker(queues, client=belay.Belay(url), poll_interval=0.05, busy_poll=0.01,
                 shutdown_grace=5.0, node_id=node).run()


if __name__ == "__main__":
    main(sys.argv)
