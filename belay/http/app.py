"""The producer API as an ASGI app (Starlette): enqueue, read, cancel, results,
signals and events over HTTP/JSON, and schedules (:mod:`belay.http.schedules`).

Every database call runs on a worker thread (the client is blocking). A
database failure is answered ``503 unavailable``, never an invented success.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Final

import anyio
import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from belay import ops, otel
from belay.client import Belay
from belay.codec import dumps
from belay.errors import (
    INVALID,
    IdempotencyConflict,
    JobNotFound,
    SchemaError,
    ValidationError,
    database_failure,
)
from belay.http.errors import STATUS, ApiError, error_body, invalid
from belay.http.openapi import document
from belay.http.options import (
    canonical,
    check_json,
    first_line,
    parse_enqueue,
    parse_json,
    parse_top_up,
    path_text,
)
from belay.http.schedules import PATHS as SCHEDULE_PATHS
from belay.http.schedules import ScheduleApi
from belay.job import Job
from belay.ops import event_view, job_view, jsonable
from belay.origin import BrowserGuard, not_json

DEFAULT_BODY_LIMIT: Final = 1_000_000
MAX_EVENTS_PAGE: Final = 1000
DEFAULT_EVENTS_PAGE: Final = 100
#: The longest pause between two looks at a streamed job.
STREAM_POLL: Final = 0.5
_MAX_ID: Final = 2**63 - 1
#: The scope key under which the app publishes its body limit to every route,
#: the worker routes included: each reads its body itself, after its token check.
BODY_LIMIT_KEY: Final = "belay.body_limit"

Handler = Callable[[Request], Awaitable[Response]]


def build_app(
    client: Belay,
    *,
    token: str | None = None,
    body_limit: int = DEFAULT_BODY_LIMIT,
    extra_routes: Sequence[BaseRoute] = (),
    extra_openapi_paths: Mapping[str, Any] | None = None,
    allowed_hosts: Collection[str] | None = None,
) -> Starlette:
    """The producer API over ``client``. ``token``: every producer call needs
    ``Authorization: Bearer <token>``. ``body_limit``: the largest request body
    in bytes (counted as it streams in, whatever Content-Length says; read only
    once the token checked out).
    ``extra_routes`` / ``extra_openapi_paths`` plug more endpoints in (the HTTP
    worker protocol). ``allowed_hosts``: when given, a request whose Host header
    names another host is refused (a loopback server's DNS-rebinding guard).

    Every route, ``extra_routes`` included, is behind :class:`belay.origin.BrowserGuard`:
    a mutation from a browser page of another origin is 403 ``cross_origin``,
    a POST without ``Content-Type: application/json`` (even an empty one) 415."""
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    if isinstance(body_limit, bool) or not isinstance(body_limit, int) or body_limit < 1:
        raise ValueError(f"body_limit must be a positive integer, got {body_limit!r}")
    api = _Api(client, token, body_limit)
    schedules = ScheduleApi(client, lambda request: api._json_body(request, required=True))
    spec = document({**SCHEDULE_PATHS, **(extra_openapi_paths or {})})

    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    routes: list[BaseRoute] = [
        Route("/jobs", api.guarded(api.enqueue), methods=["POST"]),
        Route("/jobs/{job_id}", api.guarded(api.get), methods=["GET"]),
        Route("/jobs/{job_id}", api.guarded(api.cancel), methods=["DELETE"]),
        Route("/jobs/{job_id}/result", api.guarded(api.result), methods=["GET"]),
        Route("/jobs/{job_id}/signals/{name}", api.guarded(api.signal), methods=["POST"]),
        Route("/jobs/{job_id}/top_up", api.guarded(api.top_up), methods=["POST"]),
        Route("/jobs/{job_id}/events", api.guarded(api.events), methods=["GET"]),
        Route("/jobs/{job_id}/events/stream", api.guarded(api.stream), methods=["GET"]),
        Route("/schedules", api.guarded(schedules.declare), methods=["POST"]),
        Route("/schedules", api.guarded(schedules.list), methods=["GET"]),
        Route("/schedules/{schedule_id}", api.guarded(schedules.get), methods=["GET"]),
        Route("/schedules/{schedule_id}", api.guarded(schedules.cancel), methods=["DELETE"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *extra_routes,
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, ApiError: _api_error,
                            ClientDisconnect: _disconnected, Exception: _crash},
    )
    # Outermost last: the Host check, then the browser rule (belay.origin), then routing.
    app.add_middleware(BrowserGuard)
    app.add_middleware(_Guard, limit=body_limit,
                       hosts=None if allowed_hosts is None else frozenset(
                           h.lower() for h in allowed_hosts))
    return app


def json_response(content: Any, status: int = 200, headers: Mapping[str, str] | None = None
                  ) -> Response:
    return Response(dumps(content), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(code: str, message: str, headers: Mapping[str, str] | None = None
                   ) -> Response:
    return json_response(error_body(code, message), STATUS[code], headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.code, exc.message, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error_response("method_not_allowed",
                              f"{request.method} is not allowed on {request.url.path}",
                              exc.headers)
    if exc.status_code == 404:
        return error_response("not_found", f"no endpoint {request.url.path}; "
                              "GET /openapi.json lists them")
    code = {400: "invalid_request", 401: "unauthorized", 413: "payload_too_large",
            415: "unsupported_media_type", 503: "unavailable"}.get(exc.status_code, "internal")
    return error_response(code, str(exc.detail))


async def _disconnected(request: Request, exc: Exception) -> Response:
    # The client left before its body ended (or belay serve's read timeout
    # answered 408 already): nobody reads this, and it is no crash to log.
    return error_response("invalid_request", "the client disconnected before the body "
                          "ended", {"Connection": "close"})


async def _crash(request: Request, exc: Exception) -> Response:
    return error_response("internal", f"internal error ({type(exc).__name__}); see the "
                          "server's log")


def job_json(job: Job, **extra: Any) -> dict[str, Any]:
    return {"type": "job", **job_view(job), **extra}


class _Api:
    """The producer endpoints over one client."""

    def __init__(self, client: Belay, token: str | None, body_limit: int) -> None:
        self.client = client
        self._token = None if token is None else token.encode()
        self._body_limit = body_limit

    def guarded(self, handler: Handler) -> Handler:
        """``handler`` behind the bearer token, with database failures as 503."""

        async def endpoint(request: Request) -> Response:
            self._authorize(request)
            try:
                return await handler(request)
            except ValidationError as exc:
                raise invalid(str(exc)) from None
            except JobNotFound as exc:
                raise ApiError("not_found", str(exc)) from None
            except (psycopg.Error, SchemaError, OSError) as exc:
                if database_failure(exc) == INVALID:  # a value PostgreSQL can't take
                    raise invalid(f"PostgreSQL refused a value: {first_line(exc)}") from None
                # Unavailable, a schema belay can't use, or refused (a privilege, a
                # missing table): nothing was done either way, and the message says which.
                raise ApiError("unavailable", f"the database is unavailable "
                               f"({type(exc).__name__}: {first_line(exc)}); nothing was "
                               "done, try again") from None

        endpoint.__name__ = handler.__name__
        return endpoint

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), self._token
        ):
            return
        # Closed: a body sent along is never read, so the connection can't carry more.
        raise ApiError("unauthorized", "this server needs 'Authorization: Bearer <token>' "
                       "with the token it was started with",
                       headers={"WWW-Authenticate": "Bearer", "Connection": "close"})

    async def enqueue(self, request: Request) -> Response:
        body = await self._json_body(request, required=True)
        now = self.client.now()
        spec = parse_enqueue(body, now)

        def insert() -> Job:
            with otel.continued(request.headers):  # a caller's traceparent (docs/observability.md)
                return self.client.enqueue(spec.kind, spec.input, **spec.kwargs())

        job = await run_in_threadpool(insert)
        if job.duplicate:
            # Compared as JSON, not with Python's ==, where True == 1 == 1.0.
            if job.kind != spec.kind or canonical(job.input) != canonical(spec.input):
                raise ApiError("id_conflict", f"job {job.id} already holds this id with "
                               f"another task or args ({job.kind}); retry only with the same "
                               "id and definition, or use a new id")
            return json_response(job_json(job, duplicate=True), 200,
                                 {"Location": f"/jobs/{job.id}"})
        return json_response(job_json(job, duplicate=False), 201,
                             {"Location": f"/jobs/{job.id}"})

    async def get(self, request: Request) -> Response:
        return json_response(job_json(await self._job(request)))

    async def cancel(self, request: Request) -> Response:
        job_id = _job_id(request)
        status = await run_in_threadpool(self.client.cancel_job, job_id)
        job = await run_in_threadpool(self.client.get_job, job_id)
        return json_response({"type": "cancel", "id": job_id, "status": status,
                              "job": None if job is None else job_view(job)})

    async def result(self, request: Request) -> Response:
        job = await self._job(request)
        if job.state == "succeeded":
            if job.result_envelope is None:
                raise ApiError("result_missing", f"job {job.id} succeeded but has no stored "
                               "result (it was written without one, or cleared)")
            return json_response({"type": "result", "id": job.id,
                                  "result": jsonable(job.result)})
        if job.state == "failed":
            last = job.errors[-1] if job.errors else None
            raise ApiError("task_failed", f"job {job.id} failed after {job.attempt} "
                           f"attempt(s): {json.dumps(jsonable(last))[:2000]}")
        if job.state == "cancelled":
            raise ApiError("task_cancelled", f"job {job.id} was cancelled")
        raise ApiError("result_not_ready", f"job {job.id} is {job.state}; ask again later "
                       f"(or follow GET /jobs/{job.id}/events/stream)")

    async def signal(self, request: Request) -> Response:
        job_id = _job_id(request)
        name = path_text(request.scope.get("raw_path"), request.path_params["name"],
                         "the signal name")
        payload = await self._json_body(request, required=False)
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise invalid("a signal payload is a JSON object (or an empty body)")
        check_json(payload, "payload")

        def deliver() -> list[int]:
            if self.client.get_job(job_id) is None:
                raise JobNotFound(job_id)
            return self.client.signal_job(job_id, name, payload)

        woken = await run_in_threadpool(deliver)
        return json_response({"type": "signal", "id": job_id, "signal": name,
                              "woken": woken})

    async def top_up(self, request: Request) -> Response:
        job_id = _job_id(request)
        body = await self._json_body(request, required=True)
        args = parse_top_up(body, request.headers.get("idempotency-key"))

        def raise_caps() -> dict[str, Any]:
            return ops.mutate(self.client, ops.Guard(allow=True), "top_up",
                              {"job_id": job_id, **args})

        try:
            done = await run_in_threadpool(raise_caps)
        except IdempotencyConflict as exc:
            raise ApiError("idempotency_conflict", str(exc)) from None
        return json_response({"type": "top_up", "id": job_id, "resumed": done["resumed"],
                              "duplicate": done["duplicate"], "job": done["job"]})

    async def events(self, request: Request) -> Response:
        job_id = _job_id(request)
        after = _query_int(request, "after", 0, 0, _MAX_ID)
        limit = _query_int(request, "limit", DEFAULT_EVENTS_PAGE, 1, MAX_EVENTS_PAGE)

        def read() -> tuple[Job | None, list[Any]]:
            job = self.client.get_job(job_id)
            if job is None:
                return None, []
            return job, self.client.events(job_id, after, limit=limit)

        job, page = await run_in_threadpool(read)
        if job is None:
            raise JobNotFound(job_id)
        return json_response({
            "type": "events", "id": job_id, "events": [event_view(e) for e in page],
            "next_after": page[-1].seq if page else after, "state": job.state,
        })

    async def stream(self, request: Request) -> Response:
        job_id = _job_id(request)
        after = _query_int(request, "after", 0, 0, _MAX_ID)
        last_seen = request.headers.get("last-event-id")
        if (last_seen is not None and last_seen.isascii() and last_seen.isdigit()
                and len(last_seen) <= 18):
            after = max(after, int(last_seen))
        await self._job(request)  # a 404 before the stream starts
        return StreamingResponse(self._follow(job_id, after), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def _follow(self, job_id: int, after: int) -> AsyncIterator[bytes]:
        """Server-Sent Events: one ``event`` per job event (``id:`` its seq), then
        one ``end`` with the job's terminal state. The job is read before its
        events, as ``Belay.subscribe_events`` does, so no event is missed."""
        interval = 0.01

        def read(after: int) -> tuple[Job | None, list[Any]]:
            job = self.client.get_job(job_id)
            return job, ([] if job is None else
                         self.client.events(job_id, after, limit=DEFAULT_EVENTS_PAGE))

        while True:
            try:
                job, fresh = await run_in_threadpool(read, after)
            except (psycopg.Error, OSError) as exc:
                yield _sse("error", error_body("unavailable", f"the database is unavailable "
                                               f"({type(exc).__name__}); reconnect with "
                                               f"Last-Event-ID {after}"))
                return
            if job is None:
                yield _sse("end", {"id": job_id, "state": None})
                return
            for event in fresh:
                yield _sse("event", event_view(event), event.seq)
            if fresh:
                after, interval = fresh[-1].seq, 0.01
                continue
            if job.terminal:
                yield _sse("end", {"id": job_id, "state": job.state})
                return
            await anyio.sleep(interval)
            interval = min(interval * 2, STREAM_POLL)

    async def _job(self, request: Request) -> Job:
        job_id = _job_id(request)
        job = await run_in_threadpool(self.client.get_job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    async def _json_body(self, request: Request, *, required: bool) -> Any:
        """The body as JSON; None for an empty body when it is optional."""
        raw = await read_body(request, self._body_limit)
        if not raw.strip() and not required:
            return None
        # BrowserGuard answers first; the same rule here (belay.origin) keeps a
        # route that reads a body from ever taking one that is not JSON.
        refused = not_json(request.headers)
        if refused is not None:
            raise ApiError("unsupported_media_type", refused)
        if not raw.strip():
            raise invalid("the body is empty; send a JSON object")
        return parse_json(raw)


def _sse(kind: str, data: Any, seq: int | None = None) -> bytes:
    head = f"event: {kind}\n" + (f"id: {seq}\n" if seq is not None else "")
    return head.encode() + b"data: " + dumps(data) + b"\n\n"


def _job_id(request: Request) -> int:
    raw = request.path_params["job_id"]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or not 1 <= int(raw) <= _MAX_ID:
        raise invalid(f"a job id is an integer from 1 to {_MAX_ID}, got {raw[:40]!r}")
    return int(raw)


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or not low <= int(raw) <= high:
        raise invalid(f"{name} must be an integer from {low} to {high}, got {raw[:40]!r}")
    return int(raw)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (or the app's
    own, when lower): at once when Content-Length says so, else by counting
    what streams in. Read only here, so every route checks its token first and
    an unauthenticated client can't make the server take in a body."""
    limit = min(limit, request.scope.get(BODY_LIMIT_KEY, limit))
    declared = request.headers.get("content-length")
    if (declared is not None and declared.isascii() and declared.isdigit()
            and int(declared) > limit):
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    # The rest of the body is never read: the connection can't carry another request.
    return ApiError("payload_too_large", f"the request body is over the {limit}-byte "
                    "limit; send less", headers={"Connection": "close"})


class _Guard:
    """Publishes the body limit to the routes (which read their bodies after
    their token checks). With ``hosts``, refuses a Host header naming another
    host (400) before anything else."""

    def __init__(self, app: ASGIApp, limit: int, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.limit = limit
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.hosts is not None:
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            host = headers.get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.hosts and host not in self.hosts:
                response = error_response(
                    "invalid_request", f"Host {host!r} is not served here (this server "
                    "answers its loopback names only)", {"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app({**scope, BODY_LIMIT_KEY: self.limit}, receive, send)
