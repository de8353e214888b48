"""A FastAPI app that hands its slow work to belay.

Reports are built by a belay worker (``worker.py``), never in a request:
``POST /reports`` enqueues one and answers 202 at once; the client follows the
job over Server-Sent Events (``GET /reports/{id}/events``, resumable with
``Last-Event-ID``) or waits for its result (``GET /reports/{id}/result``).
``POST /orders`` enqueues inside the request's own transaction: the order row
and its receipt job commit together, or neither does.

    belay migrate --url "$BELAY_DATABASE_URL"
    uvicorn app:app --app-dir examples/fastapi_app
    python examples/fastapi_app/worker.py

``python examples/fastapi_app/demo.py`` runs all of it on an embedded
PostgreSQL; README.md beside this file has the routes and the details.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any, Literal, cast

import psycopg
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, ConfigDict, Field, field_validator

import belay
from belay.aio import AsyncBelay

#: The kinds the worker serves. The app names them and never imports the
#: worker's code (the two deploy apart), so the options a job's row carries,
#: like its number of attempts, are chosen here.
REPORT_KIND = "reports.build"
RECEIPT_KIND = "orders.send_receipt"
REPORT_ATTEMPTS = 3

#: The longest ``GET /reports/{id}/result`` holds a request open.
MAX_WAIT = 60.0

# The app's own tables. A real app has migrations; the lock keeps two app
# processes starting at once from racing on CREATE TABLE.
SCHEMA = (
    "SELECT pg_advisory_xact_lock(hashtext('examples/fastapi_app schema'))",
    "CREATE TABLE IF NOT EXISTS shop_stock ("
    " sku text PRIMARY KEY, price_cents integer NOT NULL,"
    " quantity integer NOT NULL CHECK (quantity >= 0))",
    "CREATE TABLE IF NOT EXISTS shop_orders ("
    " id bigserial PRIMARY KEY, email text NOT NULL, lines jsonb NOT NULL,"
    " total_cents integer, receipt_job_id bigint,"
    " created_at timestamptz NOT NULL DEFAULT now())",
    "INSERT INTO shop_stock (sku, price_cents, quantity)"
    " VALUES ('widget', 1999, 100), ('gadget', 4200, 3) ON CONFLICT (sku) DO NOTHING",
)
INSERT_ORDER = "INSERT INTO shop_orders (email, lines) VALUES (%s, %s) RETURNING id"
LOCK_STOCK = "SELECT price_cents, quantity FROM shop_stock WHERE sku = %s FOR UPDATE"
TAKE_STOCK = "UPDATE shop_stock SET quantity = quantity - %s WHERE sku = %s"
FINISH_ORDER = "UPDATE shop_orders SET total_cents = %s, receipt_job_id = %s WHERE id = %s"
READ_ORDER = "SELECT id, email, lines, total_cents, receipt_job_id FROM shop_orders WHERE id = %s"

Pool = AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]]


def connection_options() -> dict[str, Any]:
    """Options for the app's own connections. Behind a transaction-pooling
    PgBouncer (``BELAY_POOLER=transaction``, which belay.aio reads too)
    psycopg must not prepare statements on the server."""
    return {"prepare_threshold": None} if os.environ.get("BELAY_POOLER") == "transaction" else {}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    url = os.environ.get("BELAY_DATABASE_URL")
    if not url:
        raise RuntimeError("set BELAY_DATABASE_URL to the PostgreSQL URL the app and its "
                           "worker share (run `belay migrate` on it once)")
    # One AsyncBelay per process, on this event loop; it reads BELAY_POOLER
    # and BELAY_DIRECT_URL (where to LISTEN from behind a pooler) itself.
    # Both close when the app shuts down.
    async with AsyncConnectionPool(url, min_size=1, max_size=10, open=False,
                                   kwargs=connection_options()) as pool, \
            AsyncBelay(url) as client:
        async with pool.connection() as conn, conn.transaction():
            for statement in SCHEMA:
                await conn.execute(statement)
        app.state.pool, app.state.belay = pool, client
        yield


app = FastAPI(title="belay FastAPI example", lifespan=lifespan)


def get_belay(request: Request) -> AsyncBelay:
    return cast(AsyncBelay, request.app.state.belay)


def get_pool(request: Request) -> Pool:
    return cast(Pool, request.app.state.pool)


Belay = Annotated[AsyncBelay, Depends(get_belay)]
DbPool = Annotated[Pool, Depends(get_pool)]
ReportId = Annotated[int, Path(ge=1, le=2**63 - 1, description="the report's job id")]


@app.exception_handler(belay.JobNotFound)
async def job_not_found(request: Request, exc: belay.JobNotFound) -> JSONResponse:
    # A job pruned by retention between two reads of one request.
    return JSONResponse({"detail": str(exc)}, status_code=404)


@app.exception_handler(belay.ValidationError)
async def refused_by_belay(request: Request, exc: belay.ValidationError) -> JSONResponse:
    # What belay checks before any SQL (a key too long, a NUL in a name…): the
    # caller's input, so a 422 that says what was wrong, never a 500.
    return JSONResponse({"detail": str(exc)}, status_code=422)


# -- Reports ---------------------------------------------------------------------------

Section = Literal["revenue", "usage", "invoices"]


class ReportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    customer: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9-]*$")
    period: str = Field(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$", examples=["2026-11"])
    sections: list[Section] = Field(min_length=1, max_length=3)

    @field_validator("sections")
    @classmethod
    def distinct(cls, sections: list[Section]) -> list[Section]:
        if len(set(sections)) != len(sections):
            raise ValueError("a section appears twice")
        return sections


class Report(BaseModel):
    id: int
    state: str
    input: dict[str, Any]
    attempt: int
    max_attempts: int
    result: Any = None
    error: str | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None

    @classmethod
    def of(cls, job: belay.Job) -> Report:
        return cls(id=job.id, state=job.state, input=job.input, attempt=job.attempt,
                   max_attempts=job.max_attempts,
                   result=job.result if job.state == "succeeded" else None,
                   error=last_error(job), created_at=job.inserted_at,
                   finished_at=job.finished_at)


class ReportResult(BaseModel):
    id: int
    state: str
    result: Any


class Problem(BaseModel):
    """Every error body: ``detail`` says what went wrong."""

    detail: str
    id: int | None = None
    state: str | None = None
    error: str | None = None


class CancelReply(BaseModel):
    id: int
    #: belay's answer: "cancelled" (it was waiting), "requested" (it is running
    #: and stops at its next step), "noop" (it had already finished).
    cancel: Literal["cancelled", "requested", "noop"]
    state: str


def last_error(job: belay.Job) -> str | None:
    """The last attempt's error message (its traceback stays in the database)."""
    last = job.errors[-1] if job.errors else None
    return str(last.get("error")) if isinstance(last, dict) and "error" in last else None


async def report_job(report_id: ReportId, client: Belay) -> belay.Job:
    job = await client.get_job(report_id)
    if job is None or job.kind != REPORT_KIND:
        raise HTTPException(404, f"report {report_id} does not exist")
    return job


ReportJob = Annotated[belay.Job, Depends(report_job)]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem}}


@app.post("/reports", status_code=202, response_model=Report,
          responses={409: {"model": Problem}})
async def create_report(
    body: ReportRequest, request: Request, response: Response, client: Belay,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> Report | JSONResponse:
    """Enqueue a report; 202 with its id and a Location to follow. A retried
    request with the same ``Idempotency-Key`` gets the first one's job."""
    unique = None if idempotency_key is None else {"key": f"reports:{idempotency_key}",
                                                   "mode": "always"}
    job = await client.enqueue(REPORT_KIND, body.model_dump(), max_attempts=REPORT_ATTEMPTS,
                               unique=unique)
    if job.duplicate and job.input != body.model_dump():
        return JSONResponse({"detail": "this Idempotency-Key was used for another report",
                             "id": job.id, "state": job.state}, status_code=409)
    response.headers["Location"] = str(request.url_for("read_report", report_id=job.id))
    if job.duplicate:
        response.headers["Idempotent-Replayed"] = "true"
    return Report.of(job)


@app.get("/reports/{report_id}", response_model=Report, responses=NOT_FOUND)
async def read_report(job: ReportJob) -> Report:
    return Report.of(job)


@app.get("/reports/{report_id}/events", response_class=EventSourceResponse,
         responses=NOT_FOUND)
async def report_events(
    job: ReportJob, client: Belay,
    last_event_id: Annotated[int, Header(ge=0, description="the last seq seen")] = 0,
) -> AsyncIterator[ServerSentEvent]:
    """The job's events as they happen, each with ``id:`` its seq: a browser's
    EventSource that reconnects sends ``Last-Event-ID`` and gets the rest, none
    twice. An ``end`` event with the final state closes the stream (a client
    should close its EventSource then, or it reconnects and gets ``end`` again)."""
    async for event in client.subscribe_events(job.id, after=last_event_id):
        yield ServerSentEvent(data=event.payload, id=str(event.seq))
    finished = await client.get_job(job.id)
    yield ServerSentEvent(event="end", data={"id": job.id, "state": (
        finished.state if finished is not None else "pruned")})


@app.get("/reports/{report_id}/result", response_model=ReportResult,
         responses={404: {"model": Problem}, 409: {"model": Problem},
                    504: {"model": Problem}})
async def report_result(
    job: ReportJob, client: Belay,
    timeout: Annotated[float, Query(gt=0, le=MAX_WAIT, description="seconds to wait")] = 30.0,
) -> ReportResult | JSONResponse:
    """Wait up to ``timeout`` seconds for the report: 200 with its result; 409
    when it failed or was cancelled; 504 when it is not done yet (ask again)."""
    try:
        result = await client.await_result(job.id, timeout=timeout)
    except TimeoutError:
        now = await client.get_job(job.id)
        return JSONResponse({
            "detail": f"report {job.id} is not finished after {timeout:g} s; ask again",
            "id": job.id, "state": job.state if now is None else now.state,
        }, status_code=504)
    except belay.JobFailed as exc:
        return JSONResponse({
            "detail": f"report {job.id} failed after {exc.job.attempt} attempt(s)",
            "id": job.id, "state": "failed", "error": last_error(exc.job),
        }, status_code=409)
    except belay.JobCancelled:
        return JSONResponse({"detail": f"report {job.id} was cancelled", "id": job.id,
                             "state": "cancelled"}, status_code=409)
    return ReportResult(id=job.id, state="succeeded", result=result)


@app.post("/reports/{report_id}/cancel", response_model=CancelReply, responses=NOT_FOUND)
async def cancel_report(job: ReportJob, client: Belay, response: Response) -> CancelReply:
    """200 when cancelled (or already finished: ``noop``); 202 when running,
    as it stops at its next step boundary."""
    outcome = await client.cancel_job(job.id)
    if outcome == "requested":
        response.status_code = 202
    return CancelReply(id=job.id, cancel=outcome,
                       state="cancelled" if outcome == "cancelled" else job.state)


# -- Orders: enqueue in the request's own transaction ----------------------------------


class OrderLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sku: str = Field(min_length=1, max_length=40)
    quantity: int = Field(ge=1, le=100)


class OrderRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: str = Field(max_length=254, pattern=r"^[^@\s]+@[^@\s]+$")
    lines: list[OrderLine] = Field(min_length=1, max_length=20)


class Order(BaseModel):
    id: int
    email: str
    lines: list[OrderLine]
    total_cents: int
    receipt_job_id: int
    receipt_state: str | None = None


@app.post("/orders", status_code=201, response_model=Order,
          responses={409: {"model": Problem}})
async def place_order(body: OrderRequest, request: Request, response: Response,
                      client: Belay, pool: DbPool) -> Order:
    """Insert the order, enqueue its receipt job on the same connection, then
    take the stock: when a line can't be served the transaction rolls back,
    and the receipt job goes with the order — no receipt for an order that
    never was, and no order without its receipt."""
    lines = [line.model_dump() for line in body.lines]
    async with pool.connection() as conn, conn.transaction():
        inserted = await (await conn.execute(INSERT_ORDER, (body.email, Jsonb(lines)))).fetchone()
        assert inserted is not None
        order_id: int = inserted[0]
        # conn=: the job row is written in this transaction; workers see it
        # (and are woken) only when it commits.
        receipt = await client.enqueue(RECEIPT_KIND, {"order_id": order_id}, conn=conn)
        total = 0
        # Stock rows are locked in sku order, so two checkouts never deadlock.
        for line in sorted(body.lines, key=lambda line: line.sku):
            stock = await (await conn.execute(LOCK_STOCK, (line.sku,))).fetchone()
            if stock is None:
                raise HTTPException(422, f"there is no product {line.sku!r}")
            price_cents, available = stock
            if available < line.quantity:
                raise HTTPException(409, f"only {available} of {line.sku!r} in stock, "
                                         f"{line.quantity} ordered")
            await conn.execute(TAKE_STOCK, (line.quantity, line.sku))
            total += price_cents * line.quantity
        await conn.execute(FINISH_ORDER, (total, receipt.id, order_id))
    response.headers["Location"] = str(request.url_for("read_order", order_id=order_id))
    return Order(id=order_id, email=body.email, lines=body.lines, total_cents=total,
                 receipt_job_id=receipt.id, receipt_state=receipt.state)


@app.get("/orders/{order_id}", response_model=Order, responses=NOT_FOUND)
async def read_order(order_id: Annotated[int, Path(ge=1, le=2**63 - 1)], client: Belay,
                     pool: DbPool) -> Order:
    async with pool.connection() as conn:
        row = await (await conn.execute(READ_ORDER, (order_id,))).fetchone()
    if row is None:
        raise HTTPException(404, f"order {order_id} does not exist")
    order_id, email, lines, total_cents, receipt_job_id = row
    receipt = await client.get_job(receipt_job_id)
    return Order(id=order_id, email=email, lines=lines, total_cents=total_cents,
                 receipt_job_id=receipt_job_id,
                 receipt_state=None if receipt is None else receipt.state)
