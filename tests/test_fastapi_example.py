"""examples/fastapi_app: the app driven through httpx's ASGI transport with its
lifespan, against a real PostgreSQL and a real ``belay.Worker`` running the
example's jobs in threads; and ``demo.py`` end to end over real HTTP.

Each test runs its coroutine with ``asyncio.run`` (no event-loop plugin).
httpx's ASGI transport hands a response over once the app has sent all of it:
an event stream is read whole, after the job it follows has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import psycopg
import pytest
from fastapi import FastAPI

import belay
from tests.conftest import POOLED

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fastapi_app"


def load(name: str) -> ModuleType:
    """An example module, by path: examples/ is not a package."""
    spec = importlib.util.spec_from_file_location(f"fastapi_example_{name}",
                                                  EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations there
    spec.loader.exec_module(module)
    return module


example = load("app")
jobs = load("worker")

REPORT = {"customer": "acme", "period": "2026-11", "sections": ["revenue", "usage", "invoices"]}
FIGURES = {"revenue": 1_254_000, "usage": 84_210, "invoices": 112}


def arun(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())  # type: ignore[arg-type]


@pytest.fixture
def app(db_url: str, direct_url: str, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    """The example's app, configured as its README says: from the environment."""
    monkeypatch.setenv("BELAY_DATABASE_URL", db_url)
    if POOLED:  # LISTEN goes to the server directly (docs/scaling.md)
        monkeypatch.setenv("BELAY_DIRECT_URL", direct_url)
    return example.app  # type: ignore[no-any-return]


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app started (its lifespan run) and an httpx client on it."""
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
        yield http


@contextmanager
def worker(db_url: str, direct_url: str) -> Iterator[belay.Worker]:
    """A real worker on the example's jobs, as ``python worker.py`` runs it."""
    with belay.Belay(db_url, direct_url=direct_url if POOLED else None) as sync, \
            belay.Worker(["default"], client=sync, registry=jobs.registry, poll_interval=0.05,
                         busy_poll=0.005, notify=True) as running:
        yield running


@asynccontextmanager
async def off_the_loop(manager: AbstractContextManager[T]) -> AsyncIterator[T]:
    """Enter and exit a blocking context manager in a thread, the loop running on."""
    value = await asyncio.to_thread(manager.__enter__)
    try:
        yield value
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def sse(body: str) -> list[dict[str, Any]]:
    """The messages of a text/event-stream body, their data decoded as JSON."""
    messages = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        message: dict[str, Any] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                field, _, value = line.partition(":")
                message[field] = value.removeprefix(" ")
        if "data" in message:
            message["data"] = json.loads(message["data"])
            messages.append(message)
    return messages


def sql(url: str, query: str, *params: Any) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


# -- Reports -----------------------------------------------------------------------------


def test_a_report_is_accepted_then_streamed_live_and_its_result_awaited(app, db_url,
                                                                        direct_url):
    async def main() -> None:
        async with serving(app) as http:
            created = await http.post("/reports", json=REPORT)
            assert created.status_code == 202, created.text
            report = created.json()
            assert (report["state"], report["input"], report["max_attempts"]) == (
                "ready", REPORT, example.REPORT_ATTEMPTS)
            assert created.headers["location"] == f"http://app/reports/{report['id']}"
            path = f"/reports/{report['id']}"

            # Subscribed before any worker runs: the stream follows the job live
            # and ends when it does.
            streaming = asyncio.ensure_future(http.get(f"{path}/events"))
            async with off_the_loop(worker(db_url, direct_url)):
                stream = await streaming
                result = await http.get(f"{path}/result", params={"timeout": 20})
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            messages = sse(stream.text)
            assert [m.get("id") for m in messages] == ["1", "2", "3", "4", None]
            assert messages[0]["data"] == {"stage": "started", "attempt": 1, "sections": 3}
            assert [m["data"] for m in messages[1:4]] == [
                {"stage": "fetched", "section": s, "done": n, "of": 3}
                for n, s in enumerate(REPORT["sections"], 1)]
            assert messages[-1] == {"event": "end",
                                    "data": {"id": report["id"], "state": "succeeded"}}

            assert result.status_code == 200
            assert result.json() == {"id": report["id"], "state": "succeeded", "result": {
                "customer": "acme", "period": "2026-11", "figures": FIGURES}}
            read = (await http.get(path)).json()
            assert (read["state"], read["attempt"], read["error"]) == ("succeeded", 1, None)
            assert read["result"]["figures"] == FIGURES

            # An EventSource that reconnects sends the last id it saw: the rest, once.
            resumed = sse((await http.get(f"{path}/events",
                                          headers={"Last-Event-ID": "2"})).text)
            assert [m.get("id") for m in resumed] == ["3", "4", None]
            assert resumed[-1]["event"] == "end"
            at_end = sse((await http.get(f"{path}/events",
                                         headers={"Last-Event-ID": "4"})).text)
            assert at_end == [messages[-1]]

    arun(main)


def test_a_failed_report_is_a_409_with_its_error(app, db_url, direct_url):
    async def main() -> None:
        async with serving(app) as http, off_the_loop(worker(db_url, direct_url)):
            created = await http.post("/reports", json={**REPORT, "customer": "initech"})
            path = f"/reports/{created.json()['id']}"
            result = await http.get(f"{path}/result", params={"timeout": 30})
            assert result.status_code == 409
            error = "LookupError: the warehouse has no figures for customer 'initech'"
            assert result.json() == {
                "detail": f"report {created.json()['id']} failed after 3 attempt(s)",
                "id": created.json()["id"], "state": "failed", "error": error}
            read = (await http.get(path)).json()
            assert (read["state"], read["attempt"], read["error"]) == ("failed", 3, error)
            messages = sse((await http.get(f"{path}/events")).text)
            assert [m["data"].get("attempt") for m in messages[:-1]] == [1, 2, 3]
            assert messages[-1]["data"]["state"] == "failed"

    arun(main)


def test_a_result_not_ready_in_time_is_a_504_naming_the_state(app):
    async def main() -> None:
        async with serving(app) as http:  # no worker: the job stays ready
            job_id = (await http.post("/reports", json=REPORT)).json()["id"]
            waited = await http.get(f"/reports/{job_id}/result", params={"timeout": 0.1})
            assert waited.status_code == 504
            assert waited.json() == {
                "detail": f"report {job_id} is not finished after 0.1 s; ask again",
                "id": job_id, "state": "ready"}

    arun(main)


def test_a_cancelled_report(app):
    async def main() -> None:
        async with serving(app) as http:
            job_id = (await http.post("/reports", json=REPORT)).json()["id"]
            cancelled = await http.post(f"/reports/{job_id}/cancel")
            assert (cancelled.status_code, cancelled.json()) == (
                200, {"id": job_id, "cancel": "cancelled", "state": "cancelled"})
            again = await http.post(f"/reports/{job_id}/cancel")
            assert (again.status_code, again.json()) == (
                200, {"id": job_id, "cancel": "noop", "state": "cancelled"})
            result = await http.get(f"/reports/{job_id}/result", params={"timeout": 5})
            assert (result.status_code, result.json()) == (409, {
                "detail": f"report {job_id} was cancelled", "id": job_id, "state": "cancelled"})
            events = sse((await http.get(f"/reports/{job_id}/events")).text)
            assert events == [{"event": "end", "data": {"id": job_id, "state": "cancelled"}}]

    arun(main)


def test_cancelling_a_running_report_stops_it_at_its_next_step(app, db_url, direct_url,
                                                              monkeypatch):
    # The first warehouse call waits for the test: the job is running, mid-step.
    gate = threading.Event()
    fetch = jobs.fetch

    def held(*args: Any) -> int:
        gate.wait(20)
        return fetch(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(jobs, "fetch", held)

    async def main() -> None:
        async with serving(app) as http, off_the_loop(worker(db_url, direct_url)):
            job_id = (await http.post("/reports", json=REPORT)).json()["id"]
            events = app.state.belay.subscribe_events(job_id, timeout=20)
            async with contextlib.aclosing(events):
                assert (await anext(events)).payload["stage"] == "started"
            cancel = await http.post(f"/reports/{job_id}/cancel")
            assert (cancel.status_code, cancel.json()) == (
                202, {"id": job_id, "cancel": "requested", "state": "running"})
            gate.set()
            result = await http.get(f"/reports/{job_id}/result", params={"timeout": 20})
            assert (result.status_code, result.json()["state"]) == (409, "cancelled")
            messages = sse((await http.get(f"/reports/{job_id}/events")).text)
            # Stopped before the next section (after the first one's event, unless
            # a lease renewal brought the request to that event's checkpoint first).
            assert messages[0]["data"]["stage"] == "started"
            assert [m["data"]["section"] for m in messages[1:-1]] in (["revenue"], [])
            assert messages[-1] == {"event": "end", "data": {"id": job_id, "state": "cancelled"}}

    try:
        arun(main)
    finally:
        gate.set()


def test_a_retried_post_with_an_idempotency_key_gets_the_first_report(app):
    async def main() -> None:
        async with serving(app) as http:
            key = {"Idempotency-Key": "9b1c0e4e"}
            first = await http.post("/reports", json=REPORT, headers=key)
            second = await http.post("/reports", json=REPORT, headers=key)
            assert (first.status_code, second.status_code) == (202, 202)
            assert second.json()["id"] == first.json()["id"]
            assert second.headers["idempotent-replayed"] == "true"
            assert "idempotent-replayed" not in first.headers
            other = await http.post("/reports", json={**REPORT, "customer": "globex"},
                                    headers=key)
            assert other.status_code == 409
            assert other.json()["detail"] == "this Idempotency-Key was used for another report"
            fresh = await http.post("/reports", json=REPORT)
            assert fresh.json()["id"] != first.json()["id"]

    arun(main)


def test_a_missing_report_or_another_kind_of_job_is_a_404(app, db_url):
    with belay.Belay(db_url) as sync:
        foreign = sync.enqueue("orders.send_receipt", {"order_id": 1}).id

    async def main() -> None:
        async with serving(app) as http:
            for job_id in (10**12, foreign):
                for method, path in (("GET", ""), ("GET", "/events"), ("GET", "/result"),
                                     ("POST", "/cancel")):
                    answer = await http.request(method, f"/reports/{job_id}{path}")
                    assert answer.status_code == 404, (method, path)
                    assert answer.json() == {"detail": f"report {job_id} does not exist"}

    arun(main)
    with belay.Belay(db_url) as sync:
        assert sync.get_job(foreign).state == "ready"  # type: ignore[union-attr]


def test_bad_input_is_a_422_that_names_the_field(app, direct_url):
    def field(answer: httpx.Response) -> list[Any]:
        assert answer.status_code == 422, answer.text
        return [error["loc"] for error in answer.json()["detail"]]

    async def main() -> None:
        async with serving(app) as http:
            assert field(await http.get("/reports/abc")) == [["path", "report_id"]]
            assert field(await http.get("/reports/0")) == [["path", "report_id"]]
            assert field(await http.get(f"/reports/{2**63}/events")) == [["path", "report_id"]]
            assert field(await http.post("/reports", json={**REPORT, "period": "2026-13"})) \
                == [["body", "period"]]
            assert field(await http.post("/reports", json={**REPORT, "sections": []})) \
                == [["body", "sections"]]
            assert field(await http.post("/reports", json={**REPORT, "sections": ["x"]})) \
                == [["body", "sections", 0]]
            twice = await http.post("/reports", json={**REPORT, "sections": ["usage", "usage"]})
            assert field(twice) == [["body", "sections"]]
            assert "a section appears twice" in twice.json()["detail"][0]["msg"]
            assert field(await http.post("/reports", json={**REPORT, "priority": 9})) \
                == [["body", "priority"]]
            assert field(await http.post("/reports", json={"customer": "acme"})) \
                == [["body", "period"], ["body", "sections"]]
            assert field(await http.post("/reports", content=b"{not json",
                                         headers={"content-type": "application/json"})) \
                == [["body", 1]]

            job_id = (await http.post("/reports", json=REPORT)).json()["id"]
            for timeout in ("soon", "0", "-1", "61", "nan", "inf"):
                answer = await http.get(f"/reports/{job_id}/result", params={"timeout": timeout})
                assert field(answer) == [["query", "timeout"]], timeout
            resume = await http.get(f"/reports/{job_id}/events",
                                    headers={"Last-Event-ID": "three"})
            assert field(resume) == [["header", "last-event-id"]]
            assert field(await http.post("/orders", json={"email": "nobody", "lines": [
                {"sku": "widget", "quantity": 1}]})) == [["body", "email"]]
            assert field(await http.post("/orders", json={"email": "a@b.c", "lines": [
                {"sku": "widget", "quantity": 0}]})) == [["body", "lines", 0, "quantity"]]

    arun(main)
    assert sql(direct_url, "SELECT count(*) FROM belay_jobs") == 1


# -- Orders: the transactional enqueue ---------------------------------------------------


ORDER = {"email": "ada@example.com", "lines": [{"sku": "widget", "quantity": 2},
                                               {"sku": "gadget", "quantity": 1}]}


def test_an_order_and_its_receipt_job_commit_together(app, db_url, direct_url, notes):
    async def main() -> tuple[dict[str, Any], Any, dict[str, Any]]:
        async with serving(app) as http, off_the_loop(worker(db_url, direct_url)):
            placed = await http.post("/orders", json=ORDER)
            assert placed.status_code == 201, placed.text
            order = placed.json()
            assert placed.headers["location"] == f"http://app/orders/{order['id']}"
            receipt = await app.state.belay.await_result(order["receipt_job_id"], timeout=20)
            return order, receipt, (await http.get(f"/orders/{order['id']}")).json()

    order, receipt, read = arun(main)
    assert order["total_cents"] == 2 * 1999 + 4200
    assert receipt == {"order_id": order["id"], "sent_to": "ada@example.com",
                       "total_cents": 2 * 1999 + 4200}
    assert read == {**order, "receipt_state": "succeeded"}
    assert sql(direct_url, "SELECT quantity FROM shop_stock WHERE sku = 'gadget'") == 2
    assert {"t": "p", "q": "default"} in notes.received()


@pytest.mark.parametrize(("line", "status", "detail"), [
    ({"sku": "gadget", "quantity": 4}, 409, "only 3 of 'gadget' in stock, 4 ordered"),
    ({"sku": "gizmo", "quantity": 1}, 422, "there is no product 'gizmo'"),
])
def test_a_refused_order_leaves_neither_the_row_nor_the_job(app, direct_url, notes, line,
                                                            status, detail):
    async def main() -> httpx.Response:
        async with serving(app) as http:
            return await http.post("/orders", json={
                "email": "grace@example.com", "lines": [{"sku": "widget", "quantity": 1}, line]})

    refused = arun(main)
    assert (refused.status_code, refused.json()) == (status, {"detail": detail})
    # The order was inserted and its receipt job enqueued before the refusal:
    # the rollback took both, the widget taken back, and no worker was woken.
    assert sql(direct_url, "SELECT count(*) FROM shop_orders") == 0
    assert sql(direct_url, "SELECT count(*) FROM belay_jobs") == 0
    assert sql(direct_url, "SELECT quantity FROM shop_stock WHERE sku = 'widget'") == 100
    assert notes.received() == []


def test_a_missing_order_is_a_404(app):
    async def main() -> httpx.Response:
        async with serving(app) as http:
            return await http.get("/orders/7")

    missing = arun(main)
    assert (missing.status_code, missing.json()) == (404, {"detail": "order 7 does not exist"})


# -- Lifecycle and the demo ----------------------------------------------------------------


def test_the_app_refuses_to_start_without_a_database_url(monkeypatch):
    monkeypatch.delenv("BELAY_DATABASE_URL", raising=False)

    async def main() -> None:
        async with example.app.router.lifespan_context(example.app):
            pass

    with pytest.raises(RuntimeError, match="set BELAY_DATABASE_URL"):
        arun(main)


@pytest.mark.timeout(180)
def test_the_demo_runs_end_to_end_over_http(db_url, direct_url):
    env = {"BELAY_DIRECT_URL": direct_url} if POOLED else {}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "demo.py"), "--url", db_url], cwd=REPO,
        capture_output=True, text=True, timeout=150, check=False, stdin=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "POST /reports → 202, Location: http://127.0.0.1:" in out
    assert "  event 2: {" in out
    assert "(connection dropped; reconnecting with Last-Event-ID: 2)" in out
    assert "  event 3: {" in out and "  event 4: {" in out
    assert out.count("  event 1: ") == 1 and out.count("  event 3: ") == 1
    assert "  end: {'id': 1, 'state': 'succeeded'}" in out
    assert "/result → 200: {'customer': 'acme'" in out
    assert "POST /orders (5 gadgets) → 409: only 3 of 'gadget' in stock, 5 ordered" in out
    assert "receipt_state succeeded" in out
    assert "orders in shop_orders: 1, receipt jobs: 1 (the refused order left neither)" in out
    assert "| " in out and "stopped" in out
