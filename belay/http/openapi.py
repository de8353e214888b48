"""The OpenAPI 3.1 document served at ``/openapi.json``: a static description
of the producer API, merged with the paths another part plugs in."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

from belay.http.errors import STATUS
from belay.http.options import MAX_JSON_DEPTH
from belay.names import MAX_NAME_BYTES

_ERROR_REF: Final = {"$ref": "#/components/schemas/Error"}
_MAX_ID: Final = 2**63 - 1
#: The rule on every name belay stores (belay.names.check_text): a byte limit,
#: stated as maxLength (a string of at most N UTF-8 bytes has at most N characters).
_TEXT: Final = (f"at most {MAX_NAME_BYTES} bytes of UTF-8; no NUL (\\u0000) or lone "
                "surrogate")
_JSON_RULE: Final = (f"JSON nested at most {MAX_JSON_DEPTH} levels; no string or key "
                     "holding NUL (\\u0000) or a lone surrogate")


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_COMMON: Final = {
    "400": _error("invalid_request: a malformed id, query, body or option"),
    "401": _error("unauthorized: the server has a token and the request did not carry it"),
    "408": _error("request_timeout: the body did not arrive within the server's read "
                  "timeout (30 s by default); the connection is closed"),
    "413": _error("payload_too_large: the body is over the limit (1 MB by default)"),
    "503": _error("unavailable: the database could not be reached; nothing was done"),
}
#: What belay.origin's rule answers, added to every operation it applies to
#: (any path, plugged-in ones too: the rule is the app's, not a route's).
_CROSS_ORIGIN: Final = _error(
    "cross_origin: a browser sent this from a page of another origin (Origin or "
    "Sec-Fetch-Site); call it from this server's origin, or without a browser")
_NOT_JSON: Final = _error(
    "unsupported_media_type: a POST needs Content-Type: application/json, even with an "
    "empty body")
_JOB_ID: Final = {"name": "job_id", "in": "path", "required": True,
                  "schema": {"type": "integer", "minimum": 1, "maximum": _MAX_ID}}
_NOT_FOUND: Final = _error("not_found: no such job (never inserted, or pruned)")

_JOB: Final = {
    "type": "object",
    "required": ["type", "id", "kind", "queue", "state", "attempt", "max_attempts"],
    "properties": {
        "type": {"const": "job"},
        "id": {"type": "integer"},
        "kind": {"type": "string"},
        "queue": {"type": "string"},
        "state": {"enum": ["ready", "running", "awaiting", "held", "paused", "succeeded",
                           "failed", "cancelled"]},
        "attempt": {"type": "integer"},
        "max_attempts": {"type": "integer"},
        "priority": {"type": "integer"},
        "input": {"type": "object"},
        "meta": {"type": "object"},
        "result": {},
        "errors": {"type": "array"},
        "unique_key": {"type": ["string", "null"]},
        "cancel_requested": {"type": "boolean"},
        "ready_at": {"type": ["string", "null"]},
        "inserted_at": {"type": ["string", "null"]},
        "finished_at": {"type": ["string", "null"]},
        "duplicate": {"type": "boolean",
                      "description": "POST /jobs only: true when the id was already held"},
    },
}

_OPTIONS: Final = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_BYTES, "pattern": "^[^$]",
               "description": "idempotency key, used as belay's unique key (mode always); "
                              + _TEXT},
        "submission_id": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_BYTES,
                          "description": "idempotency key; the unique key is derived from "
                                         "it; " + _TEXT},
        "delay": {"type": "number", "minimum": 0, "maximum": 315_360_000,
                  "description": "seconds from now (rounded to ms, halves up)"},
        "delay_ms": {"type": "integer", "minimum": 0, "maximum": 315_360_000_000},
        "run_at": {"type": "integer", "minimum": 0, "maximum": 253_402_300_799_999,
                   "description": "absolute Unix time in milliseconds"},
        "retries": {"type": "integer", "minimum": 0, "maximum": 65_534,
                    "description": "max_attempts = retries + 1"},
        "timeout": {"type": "number", "minimum": 0.0005, "maximum": 86_400,
                    "description": "seconds; stored in meta $timeout_ms for HTTP workers"},
        "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 86_400_000},
        "queue": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_BYTES,
                  "pattern": "\\S", "description": _TEXT},
        "priority": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
        "budget": {
            "type": "object", "additionalProperties": False,
            "properties": {"usd": {"type": "number", "minimum": 0, "maximum": 1e12},
                           "tokens": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
                           "on_exceed": {"enum": ["fail", "pause"]},
                           "warn_at": {"type": "array", "maxItems": 8, "items": {
                               "type": "number", "exclusiveMinimum": 0,
                               "exclusiveMaximum": 1}}},
        },
        "backoff": {
            "type": "object", "additionalProperties": False,
            "required": ["type", "base_ms", "max_ms"],
            "properties": {"type": {"const": "exponential"},
                           "base_ms": {"type": "integer", "minimum": 1, "maximum": 86_400_000},
                           "max_ms": {"type": "integer", "minimum": 1,
                                      "maximum": 86_400_000,
                                      "description": "at least base_ms"}},
        },
        "durability": {"const": "persistent"},
        "authority": {
            "type": "object", "additionalProperties": False,
            "description": "what the job may call, start and spend; jobs it starts inherit "
                           "it and may only narrow it (docs/agents.md)",
            "properties": {
                **{key: {"type": "array", "maxItems": 1000,
                         "items": {"type": "string", "minLength": 1}}
                   for key in ("tools", "queues", "kinds")},
                "usd": {"type": "number", "minimum": 0, "maximum": 9.2e12},
                "tokens": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}},
        },
    },
    "not": {"anyOf": [
        {"required": ["id", "submission_id"]},
        {"required": ["delay", "delay_ms"]},
        {"required": ["delay", "run_at"]},
        {"required": ["delay_ms", "run_at"]},
        {"required": ["timeout", "timeout_ms"]},
    ]},
}

#: A top-up's idempotency key (belay.budget.check_top_up_key).
_KEY: Final = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_BYTES, "pattern": "\\S",
               "description": "a retry with the same key changes nothing; " + _TEXT}

_ENQUEUE: Final = {
    "type": "object",
    "additionalProperties": False,
    "required": ["task"],
    "properties": {
        "task": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_BYTES,
                 "pattern": "\\S",
                 "description": "the worker name (belay's job kind); " + _TEXT},
        "args": {"type": "object", "description": "the job's input; " + _JSON_RULE},
        "options": _OPTIONS,
    },
}

_EVENT: Final = {"type": "object", "required": ["seq", "payload"],
                 "properties": {"seq": {"type": "integer"}, "payload": {},
                                "inserted_at": {"type": ["string", "null"]}}}

#: One Server-Sent Event: ``data`` holds the JSON (an event, or the end).
_SSE_EVENT: Final = {"type": "object", "required": ["event", "data"],
                     "properties": {"event": {"enum": ["event", "end", "error"]},
                                    "id": {"type": "string", "pattern": "^[0-9]+$"},
                                    "data": {"type": "string"}}}


def _paths() -> dict[str, Any]:
    return {
        "/jobs": {"post": {
            "operationId": "enqueue",
            "summary": "Enqueue a job",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ENQUEUE}}},
            "responses": {
                "201": _json(_JOB, "the new job"),
                "200": _json(_JOB, "the job already holding this id/submission_id "
                             "(duplicate: true)"),
                "409": _error("id_conflict: the id is held by a job with another task or "
                              "args"),
                "415": _error("unsupported_media_type: the body is not application/json"),
                **_COMMON,
            },
        }},
        "/jobs/{job_id}": {
            "parameters": [_JOB_ID],
            "get": {"operationId": "getJob", "summary": "A job's state",
                    "responses": {"200": _json(_JOB, "the job"), "404": _NOT_FOUND,
                                  **_COMMON}},
            "delete": {"operationId": "cancelJob", "summary": "Cancel a job",
                       "responses": {"200": _json({
                           "type": "object", "required": ["type", "id", "status"],
                           "properties": {"type": {"const": "cancel"},
                                          "id": {"type": "integer"},
                                          "status": {"enum": ["cancelled", "requested",
                                                              "noop"]},
                                          "job": {"type": ["object", "null"]}}},
                           "cancelled at once, requested (running: stops at its next step), "
                           "or noop (already finished)"), "404": _NOT_FOUND, **_COMMON}},
        },
        "/jobs/{job_id}/result": {
            "parameters": [_JOB_ID],
            "get": {"operationId": "getResult", "summary": "A finished job's result",
                    "responses": {
                        "200": _json({"type": "object", "required": ["type", "id", "result"],
                                      "properties": {"type": {"const": "result"},
                                                     "id": {"type": "integer"},
                                                     "result": {}}},
                                     "the result (JSON null is a valid result)"),
                        "404": _NOT_FOUND,
                        "409": _error("result_not_ready, task_failed or task_cancelled"),
                        "410": _error("result_missing: succeeded with no stored result"),
                        **_COMMON}},
        },
        "/jobs/{job_id}/top_up": {
            "parameters": [_JOB_ID],
            "post": {"operationId": "topUpJob", "summary": "Raise a job's budget caps",
                     "description": "Adds usd dollars and/or tokens to the job's caps. A job "
                                    "paused over its budget (on_exceed 'pause') resumes "
                                    "from its journal once the caps cover its spend. With "
                                    "an idempotency key (the Idempotency-Key header or "
                                    "idempotency_key in the body; both must agree), the "
                                    "same key again on this job changes nothing and "
                                    "answers duplicate: true with resumed as the first "
                                    "top-up said; with other amounts it is 409.",
                     "parameters": [{"name": "Idempotency-Key", "in": "header",
                                     "required": False, "schema": _KEY}],
                     "requestBody": {"required": True, "content": {
                         "application/json": {"schema": {
                             "type": "object", "additionalProperties": False,
                             "properties": {"usd": {"type": "number", "minimum": 0},
                                            "tokens": {"type": "integer", "minimum": 0},
                                            "idempotency_key": _KEY}}}}},
                     "responses": {"200": _json({
                         "type": "object",
                         "required": ["type", "id", "resumed", "duplicate", "job"],
                         "properties": {"type": {"const": "top_up"}, "id": {"type": "integer"},
                                        "resumed": {"type": "boolean"},
                                        "duplicate": {"type": "boolean"}, "job": _JOB}},
                         "the caps were raised (duplicate: false), or the key was used "
                         "already and nothing changed (duplicate: true); resumed says "
                         "whether the (first) top-up woke a paused job"),
                         "400": _error("invalid: no amount, a cap the job doesn't have, a "
                                       "finished job, or a bad key"),
                         "404": _NOT_FOUND,
                         "409": _error("idempotency_conflict: the key was used on this job "
                                       "with other amounts"),
                         "415": _error("unsupported_media_type"), **_COMMON}},
        },
        "/jobs/{job_id}/signals/{name}": {
            "parameters": [_JOB_ID, {"name": "name", "in": "path", "required": True,
                                     "schema": {"type": "string", "minLength": 1,
                                                "maxLength": MAX_NAME_BYTES,
                                                "pattern": "^[^$]", "description": _TEXT}}],
            "post": {"operationId": "signalJob", "summary": "Deliver a durable signal",
                     "requestBody": {"required": False, "content": {
                         "application/json": {"schema": {"type": "object",
                                                         "description": _JSON_RULE}}}},
                     "responses": {"200": _json({
                         "type": "object", "required": ["type", "id", "signal", "woken"],
                         "properties": {"type": {"const": "signal"}, "id": {"type": "integer"},
                                        "signal": {"type": "string"},
                                        "woken": {"type": "array",
                                                  "items": {"type": "integer"}}}},
                         "delivered; woken lists the jobs it woke"),
                         "404": _NOT_FOUND,
                         "415": _error("unsupported_media_type"), **_COMMON}},
        },
        "/jobs/{job_id}/events": {
            "parameters": [_JOB_ID,
                           {"name": "after", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 0, "maximum": _MAX_ID}},
                           {"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}],
            "get": {"operationId": "jobEvents", "summary": "A page of a job's events",
                    "responses": {"200": _json({
                        "type": "object",
                        "required": ["type", "id", "events", "next_after", "state"],
                        "properties": {"type": {"const": "events"}, "id": {"type": "integer"},
                                       "events": {"type": "array", "items": _EVENT},
                                       "next_after": {"type": "integer"},
                                       "state": {"type": "string"}}},
                        "events with seq > after, oldest first"),
                        "404": _NOT_FOUND, **_COMMON}},
        },
        "/jobs/{job_id}/events/stream": {
            "parameters": [_JOB_ID,
                           {"name": "after", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 0, "maximum": _MAX_ID}}],
            "get": {"operationId": "streamJobEvents",
                    "summary": "Follow a job's events (Server-Sent Events) until it ends",
                    "responses": {"200": {"description": "event: event (id: seq) per job "
                                          "event, then event: end",
                                          "content": {"text/event-stream": {
                                              "schema": _SSE_EVENT}}},
                                  "404": _NOT_FOUND, **_COMMON}},
        },
    }


_DOCUMENT: Final = {
    "openapi": "3.1.0",
    "info": {"title": "belay HTTP/JSON API", "version": "1"},
    "components": {
        "schemas": {"Error": {
            "type": "object", "required": ["error"], "additionalProperties": False,
            "properties": {"error": {
                "type": "object", "required": ["code", "message"],
                "properties": {"code": {"enum": sorted(STATUS)},
                               "message": {"type": "string"}}}}}},
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "workerToken": {"type": "http", "scheme": "bearer",
                            "description": "the worker_token POST /workers returned"},
        },
    },
    "security": [{"bearer": []}, {}],
}


def document(extra_paths: Mapping[str, Any]) -> dict[str, Any]:
    """The whole document: the producer paths plus ``extra_paths`` (a path both
    define is refused, so a plug-in can't shadow an endpoint unnoticed), each
    mutation with the 403 and a POST with the 415 of :mod:`belay.origin`."""
    doc = copy.deepcopy(_DOCUMENT)
    paths = _paths()
    clash = sorted(set(paths) & set(extra_paths))
    if clash:
        raise ValueError(f"extra OpenAPI paths clash with the producer API: {clash}")
    paths.update(copy.deepcopy(dict(extra_paths)))
    for item in paths.values():
        for method, operation in item.items():
            if method in ("post", "put", "patch", "delete"):
                responses = operation.setdefault("responses", {})
                responses.setdefault("403", _CROSS_ORIGIN)
                if method == "post":
                    responses.setdefault("415", _NOT_JSON)
    doc["paths"] = paths
    return doc
