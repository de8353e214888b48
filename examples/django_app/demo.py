#!/usr/bin/env python
"""belay in a Django project, end to end, in one command:

    python examples/django_app/demo.py            # on an embedded PostgreSQL
    python examples/django_app/demo.py --url postgresql://…   # on yours

It runs ``manage.py migrate`` (Django's tables and belay's, from belay's own
SQL files), places two orders — one in a transaction that rolls back, one
that commits, each enqueueing its receipt job inside the same
``transaction.atomic`` — then runs ``manage.py belay_worker`` until the job is
done and prints what happened, read back from the database.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANAGE = str(HERE / "manage.py")


class Abandoned(Exception):
    """The customer closed the tab: the order's transaction rolls back."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a PostgreSQL URL (default: an embedded server)")
    args = parser.parse_args(argv)
    if args.url:
        return run(args.url)
    from belay.embedded import embedded_server

    print("starting an embedded PostgreSQL (no --url given)…", flush=True)
    with embedded_server() as url:
        return run(url)


def run(url: str) -> int:
    env = {**os.environ, "DATABASE_URL": url, "PYTHONUNBUFFERED": "1"}
    print("$ python manage.py migrate", flush=True)
    subprocess.run([sys.executable, MANAGE, "migrate", "--no-input"], env=env, check=True)

    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_site.settings")
    sys.path.insert(0, str(HERE))
    import django

    django.setup()
    from django.db import connections, transaction
    from shop.jobs import send_receipt
    from shop.models import Order

    import belay

    try:
        with transaction.atomic():
            Order.objects.create(email="grace@example.com", total_cents=1999)
            belay.enqueue(send_receipt, {"order_id": 0})
            raise Abandoned
    except Abandoned:
        print("order 1: rolled back — and its receipt job with it", flush=True)

    with transaction.atomic():
        order = Order.objects.create(email="ada@example.com", total_cents=4200)
        job = belay.enqueue(send_receipt, {"order_id": order.pk})
    print(f"order {order.pk}: committed, with receipt job {job.id} (kind {job.kind}, "
          f"queue {job.queue}) in the same transaction", flush=True)

    print("$ python manage.py belay_worker", flush=True)
    worker = subprocess.Popen([sys.executable, MANAGE, "belay_worker", "--log-level", "WARNING"],
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        result = belay.await_result(job.id, timeout=60)
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=30)
    for line in output.splitlines():
        print(f"  | {line}")

    order.refresh_from_db()
    done = belay.get_job(job.id)
    assert done is not None
    total = len(belay.list_jobs(kind=send_receipt.kind))
    print(f"job {done.id}: {done.state} after {done.attempt} attempt(s) → {result}")
    print(f"order {order.pk}: receipt_sent_at = {order.receipt_sent_at:%Y-%m-%d %H:%M:%S %Z} "
          "(written by the job through the ORM)")
    print(f"receipt jobs in belay_jobs: {total} (the rolled-back order left none)")
    connections.close_all()
    belay.default().close()
    return 0 if done.state == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
