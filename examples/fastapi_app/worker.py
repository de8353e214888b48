"""The jobs of the FastAPI example, and the worker process that runs them.

    BELAY_DATABASE_URL=postgresql://… python examples/fastapi_app/worker.py

It runs until SIGTERM or Ctrl-C (then finishes what it started). The app
(``app.py``) enqueues these kinds by name; it never imports this module.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any

import belay

log = logging.getLogger("fastapi_app.worker")

#: The example's own registry: ``python worker.py`` runs exactly these jobs,
#: and a test can load them without touching belay's default registry.
registry = belay.Registry()

#: A stand-in for the data warehouse reports are built from.
WAREHOUSE: dict[str, dict[str, int]] = {
    "acme": {"revenue": 1_254_000, "usage": 84_210, "invoices": 112},
    "globex": {"revenue": 980_500, "usage": 151_007, "invoices": 87},
}
#: How long the warehouse takes to answer, so a report has progress to follow.
LATENCY = 0.2

READ_ORDER = "SELECT email, total_cents FROM shop_orders WHERE id = %s"


def fetch(customer: str, period: str, section: str) -> int:
    time.sleep(LATENCY)
    figures = WAREHOUSE.get(customer)
    if figures is None:
        raise LookupError(f"the warehouse has no figures for customer {customer!r}")
    return figures[section]


def soon(attempt: int) -> float:
    """Retry after 0.5 s, then 1 s: a flaky warehouse usually answers the next call."""
    return 0.5 * attempt


@belay.worker(name="reports.build", registry=registry, timeout=120, backoff=soon)
def build_report(ctx: belay.Context) -> dict[str, Any]:
    customer, period = ctx.input["customer"], ctx.input["period"]
    sections: list[str] = ctx.input["sections"]
    # Events are not journaled: every attempt emits its own "started".
    ctx.emit({"stage": "started", "attempt": ctx.attempt, "sections": len(sections)})
    figures: dict[str, int] = {}
    for done, section in enumerate(sections, 1):
        # A step runs once per job: a retry after a crash reuses the figures
        # already fetched instead of asking the warehouse again.
        figures[section] = ctx.step(f"fetch:{section}",
                                    functools.partial(fetch, customer, period, section))
        ctx.emit({"stage": "fetched", "section": section, "done": done, "of": len(sections)})
    return {"customer": customer, "period": period, "figures": figures}


@belay.worker(name="orders.send_receipt", registry=registry)
def send_receipt(ctx: belay.Context) -> dict[str, Any]:
    order_id = ctx.input["order_id"]
    # The job was enqueued in the order's transaction: the order is committed.
    with ctx.client.connection() as conn:
        row = conn.execute(READ_ORDER, (order_id,)).fetchone()
    if row is None:
        raise LookupError(f"order {order_id} does not exist")
    email, total_cents = row
    log.info("receipt for order %s (%d cents) sent to %s", order_id, total_cents, email)
    return {"order_id": order_id, "sent_to": email, "total_cents": total_cents}


def main() -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The URL from BELAY_DATABASE_URL; notify=True: woken by each enqueue at
    # once, and the app's result waits woken by each finish.
    worker = belay.Worker(["default"], registry=registry, notify=True)
    log.info("running %s", ", ".join(registry.kinds()))
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
