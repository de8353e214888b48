"""``/schedules`` over HTTP: declare, list (in pages), read and cancel schedules
(:mod:`belay.schedules`) — the seed's endpoints and status codes: 400 for an
invalid declaration, 404 for a missing schedule, 503 ``unknown_outcome`` when
the database failed while a mutation was being written.

A declaration is ``{"id": "nightly", "cron": "0 3 * * *", "task": "app.report",
"args": {…}, "overlap": "skip", "catch_up": "latest", "options": {"queue": …}}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import psycopg
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from belay.client import Belay
from belay.codec import dumps
from belay.http.errors import ApiError, invalid
from belay.http.options import check_json, first_line, path_text
from belay.ops import jsonable
from belay.schedules import CATCH_UPS, MAX_PAGE, OVERLAPS, Schedule

#: What a declaration's body may hold.
FIELDS: Final = frozenset({"id", "cron", "task", "args", "overlap", "catch_up", "options"})
#: The enqueue options a declaration's ``options`` may hold.
OPTION_NAMES: Final = frozenset({"queue", "priority", "max_attempts", "meta", "budget",
                                 "partition_key"})

Handler = Callable[[Request], Awaitable[Response]]
ReadBody = Callable[[Request], Awaitable[Any]]


#: The seed's names for a schedule's fields, where belay's differ.
_RENAMED: Final = {"name": "id", "expression": "cron", "worker": "task", "input": "args"}


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """A schedule in the seed's words: ``id``, ``cron``, ``task``, ``args``…"""
    view = {_RENAMED.get(key, key): value for key, value in schedule.to_dict().items()}
    view["args"] = jsonable(view["args"])
    view["options"] = jsonable(view["options"])
    return {"type": "schedule", **view}


def parse_declaration(body: Any) -> dict[str, Any]:
    """The keyword arguments of ``client.schedule`` from a request body (pure; a
    400 naming the fix otherwise)."""
    example = ('{"id": "nightly", "cron": "0 3 * * *", "task": "app.report", '
               '"overlap": "skip"}')
    if not isinstance(body, dict):
        raise invalid(f"a schedule is a JSON object like {example}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise invalid(f"unknown field(s) {', '.join(unknown)}; a schedule takes "
                      f"{', '.join(sorted(FIELDS))}")
    missing = [key for key in ("id", "cron", "task") if key not in body]
    if missing:
        raise invalid(f"missing {', '.join(missing)}; e.g. {example}")
    for key in ("id", "cron", "task"):
        if not isinstance(body[key], str):
            raise invalid(f"{key} is a string; e.g. {example}")
    if body.get("overlap", "skip") not in OVERLAPS:
        raise invalid(f"overlap is one of {', '.join(OVERLAPS)}")
    if body.get("catch_up", "latest") not in CATCH_UPS:
        raise invalid('catch_up is "latest" or "all"')
    args = body.get("args", {})
    if not isinstance(args, dict):
        raise invalid("args is a JSON object")
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise invalid("options is a JSON object of enqueue options")
    bad = sorted(set(options) - OPTION_NAMES)
    if bad:
        raise invalid(f"unknown option(s) {', '.join(bad)}; a schedule's options are "
                      f"{', '.join(sorted(OPTION_NAMES))}")
    check_json(args, "args")
    check_json(options, "options")
    return {"name": body["id"], "expression": body["cron"], "worker": body["task"],
            "input": args, "overlap": body.get("overlap", "skip"),
            "catch_up": body.get("catch_up", "latest"), **options}


def _response(content: Any, status: int = 200) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json")


def _unknown_outcome(exc: BaseException) -> ApiError:
    return ApiError("unknown_outcome", f"the database failed during the change "
                    f"({type(exc).__name__}: {first_line(exc)}); it may or may not have "
                    "been saved: read GET /schedules/{id} to see, or send it again (it is "
                    "idempotent)")


class ScheduleApi:
    """The ``/schedules`` endpoints over one client."""

    def __init__(self, client: Belay, read_body: ReadBody) -> None:
        self.client = client
        self._read_body = read_body

    def _id(self, request: Request) -> str:
        return path_text(request.scope.get("raw_path"), request.path_params["schedule_id"],
                         "the schedule id")

    async def declare(self, request: Request) -> Response:
        kwargs = parse_declaration(await self._read_body(request))

        def write() -> tuple[Schedule, bool]:
            existed = self.client.schedule_status(kwargs["name"]) is not None
            try:
                return self.client.schedule(**kwargs), existed
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError) as exc:
                raise _unknown_outcome(exc) from None

        schedule, existed = await run_in_threadpool(write)
        return _response(schedule_json(schedule), 200 if existed else 201)

    async def list(self, request: Request) -> Response:
        limit_text = request.query_params.get("limit")
        limit: int | None = None
        if limit_text is not None:
            if not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 3):
                raise invalid(f"limit is a whole number from 1 to {MAX_PAGE}")
            limit = int(limit_text)
        cursor = request.query_params.get("cursor")
        page = await run_in_threadpool(self.client.schedule_page, limit, cursor)
        return _response({"type": "schedules",
                          "schedules": [schedule_json(s) for s in page.schedules],
                          "next_cursor": page.next_cursor})

    async def get(self, request: Request) -> Response:
        name = self._id(request)
        found = await run_in_threadpool(self.client.schedule_status, name)
        if found is None:
            raise ApiError("not_found", f"no schedule {name!r}")
        return _response(schedule_json(found))

    async def cancel(self, request: Request) -> Response:
        name = self._id(request)

        def write() -> Schedule | None:
            try:
                self.client.cancel_schedule(name)
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError) as exc:
                raise _unknown_outcome(exc) from None
            return self.client.schedule_status(name)

        found = await run_in_threadpool(write)
        if found is None:
            raise ApiError("not_found", f"no schedule {name!r}")
        return _response(schedule_json(found))


# -- OpenAPI ---------------------------------------------------------------------------

_ERROR = {"$ref": "#/components/schemas/Error"}
_SCHEDULE: Final = {
    "type": "object",
    "required": ["type", "id", "cron", "task", "overlap", "catch_up", "revision"],
    "properties": {
        "type": {"const": "schedule"}, "id": {"type": "string"}, "cron": {"type": "string"},
        "task": {"type": "string"}, "args": {}, "options": {"type": "object"},
        "overlap": {"enum": list(OVERLAPS)}, "catch_up": {"enum": list(CATCH_UPS)},
        "static": {"type": "boolean"}, "revision": {"type": "integer"},
        "last_due": {"type": ["string", "null"], "format": "date-time"},
        "next_due": {"type": ["string", "null"], "format": "date-time"},
        "active_job_id": {"type": ["integer", "null"]},
        "last_job_id": {"type": ["integer", "null"]},
        "cancelled_at": {"type": ["string", "null"], "format": "date-time"},
        "created_at": {"type": "string", "format": "date-time"},
        "updated_at": {"type": "string", "format": "date-time"},
    },
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR}}}


def _json(description: str, schema: Any = _SCHEDULE) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_TEXT: Final = {"type": "string", "minLength": 1, "maxLength": 255}
_ID: Final = {"name": "schedule_id", "in": "path", "required": True, "schema": _TEXT}
_COMMON: Final = {"400": _error("invalid_request: an invalid declaration, id or query"),
                  "401": _error("unauthorized"),
                  "503": _error("unavailable (a read), or unknown_outcome: the database "
                                "failed during a change, which may or may not be saved")}
PATHS: Final = {
    "/schedules": {
        "post": {
            "operationId": "declareSchedule",
            "summary": "Create or redeclare a schedule (idempotent)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["id", "cron", "task"],
                "additionalProperties": False,
                "properties": {"id": _TEXT, "cron": {"type": "string", "minLength": 1},
                               "task": _TEXT, "args": {"type": "object"},
                               "overlap": {"enum": list(OVERLAPS)},
                               "catch_up": {"enum": list(CATCH_UPS)},
                               "options": {"type": "object"}}}}}},
            "responses": {"201": _json("created"), "200": _json("redeclared"), **_COMMON},
        },
        "get": {
            "operationId": "listSchedules",
            "summary": "A page of schedules by id",
            "parameters": [
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
                {"name": "cursor", "in": "query", "required": False, "schema": _TEXT}],
            "responses": {"200": _json("schedules after cursor, and the next cursor", {
                "type": "object", "required": ["type", "schedules", "next_cursor"],
                "properties": {"type": {"const": "schedules"},
                               "schedules": {"type": "array", "items": _SCHEDULE},
                               "next_cursor": {"type": ["string", "null"]}}}), **_COMMON},
        },
    },
    "/schedules/{schedule_id}": {
        "parameters": [_ID],
        "get": {"operationId": "getSchedule", "summary": "A schedule's definition and state",
                "responses": {"200": _json("the schedule"),
                              "404": _error("not_found: no such schedule"), **_COMMON}},
        "delete": {"operationId": "cancelSchedule", "summary": "Cancel a schedule",
                   "responses": {"200": _json("the schedule, cancelled"),
                                 "404": _error("not_found: no such schedule"), **_COMMON}},
    },
}

