#!/usr/bin/env python
"""The FastAPI example end to end, in one command:

    python examples/fastapi_app/demo.py                        # on an embedded PostgreSQL
    python examples/fastapi_app/demo.py --url postgresql://…   # on yours

It runs ``belay migrate``, serves ``app.py`` with uvicorn and starts
``worker.py`` in a process of its own, then plays the client over real HTTP: a
report is enqueued, its events followed over Server-Sent Events — the
connection dropped midway and resumed with ``Last-Event-ID``, as a browser's
EventSource does — and its result awaited; then two orders are placed, one
refused (out of stock) and rolled back with its receipt job, one committed
with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import psycopg
import uvicorn

import belay

HERE = Path(__file__).resolve().parent
REPORT = {"customer": "acme", "period": "2026-11", "sections": ["revenue", "usage", "invoices"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", help="a PostgreSQL URL (default: an embedded server)")
    args = parser.parse_args(argv)
    if args.url:
        return run(args.url)
    from belay.embedded import embedded_server

    print("starting an embedded PostgreSQL (no --url given)…", flush=True)
    with embedded_server() as url:
        return run(url)


def run(url: str) -> int:
    print("$ belay migrate", flush=True)
    belay.migrate(url)
    os.environ["BELAY_DATABASE_URL"] = url
    sys.path.insert(0, str(HERE))
    from app import app

    # A socket bound before uvicorn starts: its port is known at once, and a
    # request that comes before the app's startup waits in the backlog.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                               name="uvicorn")
    print(f"$ uvicorn app:app   # served in this process, on {base}", flush=True)
    serving.start()
    print("$ python worker.py", flush=True)
    worker = subprocess.Popen([sys.executable, str(HERE / "worker.py")],
                              env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            ok = report(http) and orders(http, url)
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=30)
        server.should_exit = True
        serving.join(timeout=30)
        listener.close()
    for line in output.splitlines():
        print(f"  | {line}")
    return 0 if ok else 1


def report(http: httpx.Client) -> bool:
    created = http.post("/reports", json=REPORT)
    created.raise_for_status()
    location = created.headers["location"]
    print(f"POST /reports → {created.status_code}, Location: {location}", flush=True)
    path = httpx.URL(location).path

    print(f"GET {path}/events", flush=True)
    last_seq = "0"
    with http.stream("GET", f"{path}/events") as stream:
        for message in sse(stream.iter_lines()):
            print(f"  event {message['id']}: {message['data']}", flush=True)
            last_seq = message["id"]
            if last_seq == "2":
                break
    print(f"  (connection dropped; reconnecting with Last-Event-ID: {last_seq})", flush=True)
    with http.stream("GET", f"{path}/events", headers={"Last-Event-ID": last_seq}) as stream:
        for message in sse(stream.iter_lines()):
            if message.get("event") == "end":
                print(f"  end: {message['data']}", flush=True)
                break
            print(f"  event {message['id']}: {message['data']}", flush=True)

    result = http.get(f"{path}/result", params={"timeout": 30})
    body = result.json()
    print(f"GET {path}/result → {result.status_code}: {body.get('result', body)}", flush=True)
    return result.status_code == 200


def orders(http: httpx.Client, url: str) -> bool:
    refused = http.post("/orders", json={"email": "grace@example.com", "lines": [
        {"sku": "widget", "quantity": 1}, {"sku": "gadget", "quantity": 5}]})
    print(f"POST /orders (5 gadgets) → {refused.status_code}: {refused.json()['detail']}",
          flush=True)
    placed = http.post("/orders", json={"email": "ada@example.com", "lines": [
        {"sku": "widget", "quantity": 2}, {"sku": "gadget", "quantity": 1}]})
    placed.raise_for_status()
    order = placed.json()
    print(f"POST /orders (2 widgets, 1 gadget) → {placed.status_code}: order {order['id']}, "
          f"{order['total_cents']} cents, receipt job {order['receipt_job_id']}", flush=True)

    with belay.Belay(url) as client:
        receipt = client.await_result(order["receipt_job_id"], timeout=60)
    print(f"receipt job {order['receipt_job_id']} → {receipt}", flush=True)
    again = http.get(f"/orders/{order['id']}").json()
    print(f"GET /orders/{order['id']} → receipt_state {again['receipt_state']}", flush=True)

    with psycopg.connect(url, autocommit=True) as conn:
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM shop_orders),"
            " (SELECT count(*) FROM belay_jobs WHERE kind = 'orders.send_receipt')").fetchone()
    assert counts is not None
    print(f"orders in shop_orders: {counts[0]}, receipt jobs: {counts[1]} "
          "(the refused order left neither)", flush=True)
    return refused.status_code == 409 and again["receipt_state"] == "succeeded"


def sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Server-Sent Event messages from a stream's lines (data as JSON)."""
    message: dict[str, Any] = {}
    for line in lines:
        if not line:
            if "data" in message:
                message["data"] = json.loads(message["data"])
                yield message
            message = {}
        elif not line.startswith(":"):  # ":" opens a comment (the keep-alive ping)
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            message[field] = f"{message[field]}\n{value}" if field in message else value


if __name__ == "__main__":
    sys.exit(main())
