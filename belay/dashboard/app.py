"""The dashboard's request handling, framework-neutral, and its WSGI app.

:class:`Dashboard` turns a :class:`Request` into a :class:`Response`; an
:class:`Access` says who may mutate through that request. :class:`WSGIApp`
adapts WSGI to it (``belay dashboard`` runs it under waitress);
``belay_django.dashboard`` adapts Django's requests.

Routes, below the mount point: ``/`` (queues and recent jobs), ``/jobs``
(filtered list), ``/jobs/<id>``, ``/workflow?id=…``, ``/doctor`` (the
findings of :mod:`belay.doctor`), ``/schedules``, ``/spend`` (spend analytics,
:mod:`belay.dashboard.spending`), the JSON the pages poll (``/api/overview``,
``/api/jobs``, ``/api/jobs/<id>``, ``/api/workflow?id=…``), ``/api/doctor``,
``/api/schedules``, ``/api/spend`` and the mutations
``POST /api/jobs/<id>/retry|cancel|signal|steer|top-up``.

Every query parameter, path segment and body field read here goes through
:mod:`belay.ops`'s argument checks before any SQL: a bad one is a 400 naming it.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl

import psycopg

from belay import names, ops, origin
from belay.dashboard import pages, spending
from belay.errors import (
    INVALID,
    REFUSED,
    IdempotencyConflict,
    JobNotFound,
    NotRetryable,
    SchemaError,
    ValidationError,
    database_failure,
)
from belay.redact import describe, redact, secrets_of

log = logging.getLogger("belay.dashboard")

#: Every response carries these: no inline script or style, no framing, no sniffing.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy",
     "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
     "frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)

#: The page's actions, by the ops.MUTATIONS tool each one runs.
ACTIONS: Mapping[str, str] = {
    "retry": "retry_job", "cancel": "cancel_job", "signal": "signal", "steer": "steer_job",
    "top-up": "top_up",
}
STATIC: Mapping[str, str] = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
MAX_BODY = 64 * 1024
_ORIGIN_FIX = "send actions from the dashboard's own pages"
_JSON_FIX = ("send the action's arguments as JSON, with Content-Type: application/json "
             "(an empty object {} for retry and cancel)")
PAGE_SIZE = 50
MAX_LIMIT = 500
RECENT = 15

READ_ONLY_HINT = (
    "This dashboard is read-only. To retry, cancel, signal and steer jobs from it, give it "
    "a token (belay dashboard --token-file PATH, or make_app(token=...)) or an authorizer "
    "(--authorizer module:callable)."
)


@dataclass(frozen=True)
class Request:
    """One request: ``path`` is below the mount point and starts with ``/``;
    ``headers`` have lower-case names; ``query`` keeps each name's first value."""

    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def header_list(self) -> list[tuple[str, str]]:
        """Content-Type, the security headers, then this response's own."""
        own = {name.lower() for name, _ in self.headers}
        return [("Content-Type", self.content_type),
                *((k, v) for k, v in SECURITY_HEADERS if k.lower() not in own),
                *self.headers]

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Access:
    """Who may mutate through a request.

    ``mode`` is ``"none"`` (read-only: no buttons, every POST refused),
    ``"token"`` (the request must carry ``Authorization: Bearer <token>``),
    ``"open"`` (no credential: ``guard``'s authorizer decides) or
    ``"session"`` (the host framework authenticated the user and checked
    CSRF; the page sends ``csrf`` back as ``X-CSRFToken``). Whatever the mode,
    ``guard`` has the last word. ``check_origin`` refuses a POST whose Origin
    is not the Host it was sent to.
    """

    mode: str = "none"
    guard: ops.Guard = field(default_factory=ops.Guard)
    token: str | None = None
    csrf: str | None = None
    read_only_hint: str = READ_ONLY_HINT
    check_origin: bool = True

    def __post_init__(self) -> None:
        if self.mode not in pages.AUTH_MODES:
            raise ValueError(f"Access.mode is one of {', '.join(pages.AUTH_MODES)}, "
                             f"got {self.mode!r}")
        if self.mode == "token" and not self.token:
            raise ValueError("Access(mode='token') needs the token")

    @classmethod
    def standalone(cls, guard: ops.Guard | None = None, token: str | None = None) -> Access:
        """The access of ``belay dashboard``: a token (checked, then ``guard``'s
        authorizer if it has one), else the authorizer alone, else read-only."""
        guard = guard or ops.Guard()
        if token is not None:
            if not token.strip():
                raise ValueError("the dashboard token is empty; put a long random string "
                                 "in the token file")
            return cls("token", guard if guard.authorizer else ops.Guard(allow=True), token)
        if not guard.read_only:
            return cls("open", guard)
        return cls("none", guard)


class _Failure(Exception):
    """Ends a request with ``status`` and a message for whoever sent it."""

    def __init__(self, status: int, message: str,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


@functools.lru_cache(maxsize=1)
def _static_files() -> dict[str, bytes]:
    folder = resources.files("belay.dashboard").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in STATIC}


class Dashboard:
    """The dashboard over one belay client. A failed database call is answered
    as :func:`belay.errors.database_failure` classes it (a refused value 400,
    else 503); ``unavailable`` adds exceptions of a framework's own that mean
    "the database can't be reached" (503)."""

    def __init__(self, client: Any, *,
                 unavailable: tuple[type[BaseException], ...] = ()
                 ) -> None:
        self.client = client
        self.unavailable = unavailable
        self._database_errors: tuple[type[BaseException], ...] = (psycopg.Error, *unavailable)
        self.static = _static_files()

    # -- Dispatch --------------------------------------------------------------------

    def handle(self, request: Request, access: Access, base: str = "") -> Response:
        """Answer one request; ``base`` is the URL path of the mount point (links)."""
        page = pages.Page(base=base.rstrip("/"), auth=access.mode, csrf=access.csrf,
                          read_only_hint=access.read_only_hint)
        path = request.path or "/"
        api = path.startswith("/api/")
        try:
            problem = names.text_problem(path)
            if problem is not None:  # e.g. /api/jobs/%ED%A0%80, a surrogate's UTF-8
                raise _Failure(400, f"the path {problem}: {ops.shown(path)}")
            if request.method == "POST":
                match = re.fullmatch(r"/api/jobs/([^/]+)/([^/]+)", path)
                if match is None or match[2] not in ACTIONS:
                    raise _Failure(404 if _known_get(path) is None else 405,
                                   f"no action at POST {path}; actions are POST "
                                   "/api/jobs/<id>/retry, cancel, signal, steer or top-up")
                return self._mutate(request, access, match[1], ACTIONS[match[2]])
            if request.method not in ("GET", "HEAD"):
                raise _Failure(405, f"{request.method} is not served here")
            route = _known_get(path)
            if route is None:
                raise _Failure(404, f"nothing at {path}")
            name, arg = route
            return self._get(name, arg, request, page)
        except _Failure as failure:
            return self._failure(failure, api, page)
        except ops.Refused as exc:
            return self._failure(_Failure(403, str(exc)), api, page)
        except JobNotFound as exc:
            return self._failure(_Failure(404, str(exc)), api, page)
        except (NotRetryable, IdempotencyConflict) as exc:
            return self._failure(_Failure(409, str(exc)), api, page)
        except ValidationError as exc:
            return self._failure(_Failure(400, str(exc)), api, page)
        except SchemaError as exc:
            return self._failure(_Failure(503, str(exc)), api, page)
        except self._database_errors as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            kind = database_failure(exc)
            if kind == INVALID:  # a value PostgreSQL can't take, like a NUL
                return self._failure(_Failure(
                    400, f"the database refused a value of this request: {detail}"), api, page)
            if kind == REFUSED:
                return self._failure(_Failure(
                    503, f"the database refused this request ({detail}); check the "
                         "dashboard's database role (its privileges) and that `belay migrate` "
                         "ran"), api, page)
            return self._failure(_Failure(
                503, f"the database is unavailable ({detail}); check that PostgreSQL is up "
                     "and that the dashboard's database URL is right"), api, page)

    def _get(self, name: str, arg: str | None, request: Request, page: pages.Page) -> Response:
        if name == "static":
            assert arg is not None
            return Response(200, STATIC[arg], self.static[arg],
                            (("Cache-Control", "no-cache"),))
        if name in ("overview", "api_overview"):
            data = self.overview()
            if name == "api_overview":
                return _json(200, data)
            return _page(200, pages.overview(page, data["queues"], data["recent"]))
        if name in ("doctor", "api_doctor"):
            report = self.doctor()
            if name == "api_doctor":
                return _json(200, report)
            return _page(200, pages.doctor_page(page, report))
        if name in ("schedules", "api_schedules"):
            data = self.schedules()
            if name == "api_schedules":
                return _json(200, data)
            return _page(200, pages.schedules_page(page, data["schedules"], data["crons"]))
        if name in ("spend", "api_spend"):
            return self._spend(name == "api_spend", request, page)
        if name in ("jobs", "api_jobs"):
            filters, parent, before_id, limit = _list_args(request.query,
                                                           api=name == "api_jobs")
            data = self.jobs(filters, before_id, limit, parent)
            if name == "api_jobs":
                return _json(200, data)
            api = page.url("/api/jobs", **filters,
                           before_id=before_id if before_id is not None else "")
            return _page(200, pages.jobs_page(page, data["jobs"], filters, before_id,
                                              data["next_before_id"], api))
        if name in ("job", "api_job"):
            assert arg is not None
            job_id = ops.id_arg(arg, "the job id in the path")
            detail = ops.job_detail(self.client, job_id)
            if detail is None:
                raise JobNotFound(job_id)
            if name == "api_job":
                return _json(200, detail)
            return _page(200, pages.job_page(page, detail))
        workflow_id = request.query.get("id", "")
        if not workflow_id:
            raise _Failure(400, "name the workflow: ?id=<workflow id>")
        ops.name_arg(workflow_id, "id (the workflow id)")
        status = self.client.workflow_status(workflow_id)
        if not status.jobs:
            raise _Failure(404, f"workflow {workflow_id!r} has no jobs (never enqueued, or "
                                "pruned by retention)")
        view = ops.workflow_view(status)
        if name == "api_workflow":
            return _json(200, view)
        return _page(200, pages.workflow_page(page, view))

    def _spend(self, api: bool, request: Request, page: pages.Page) -> Response:
        """``/api/spend``: :func:`belay.ops.spend_view` of the query string.

        ``by`` names a dimension (kind, queue, day, hour, workflow, parent,
        tree or ``meta:<key>``; repeat it for two: ``by=day&by=kind``);
        ``since`` is an ISO time with a zone or a span back from until
        (``30m``, ``24h``, ``7d``, ``2w``; default 7d); ``until`` an ISO time
        (default now); ``kind``, ``queue`` and ``limit`` (1 to 10000) as the
        CLI takes them; the meta filter is ``meta.<key>=<text>`` per key and/or
        ``meta=key=value`` or ``meta=<JSON object>`` (for a value that is not
        text). ``tree=<job id>`` answers that job's tree instead, per kind.
        ``/spend`` shows the same with a chart of USD per hour (ranges up to
        48 h), day or month."""
        by = all_values(request.query, "by")
        args = spending.spend_args(request.query, by)
        view = ops.spend_view(self.client, args)
        if api:
            return _json(200, view)
        if "job_id" in view:
            return _page(200, spending.tree_page(page, view))
        series = spending.chart_view(self.client, args, view)
        return _page(200, spending.spend_page(page, view, series, request.query, by))

    # -- Reads -----------------------------------------------------------------------

    def overview(self) -> dict[str, Any]:
        """Queue tiles and the most recent jobs."""
        return {"queues": ops.queue_overview(self.client),
                "recent": [ops.job_line(j) for j in self.client.list_jobs(limit=RECENT)]}

    def schedules(self) -> dict[str, Any]:
        """Every schedule (with its state) and every dynamic cron row."""
        return {"schedules": [s.to_dict() for s in self.client.schedules()],
                "crons": [ops.cron_view(c) for c in self.client.list_crons()]}

    def doctor(self) -> dict[str, Any]:
        """``belay doctor``'s report on the dashboard's database. Whatever goes
        wrong is a finding, never a 500 (the checks catch their own failures;
        this catches the rest)."""
        from belay import doctor

        try:
            findings = doctor.run(self.client)
        except Exception as exc:
            log.exception("belay dashboard: the doctor's checks failed")
            hidden = secrets_of(getattr(self.client, "conninfo", None))
            said = redact(" ".join(describe(exc).split()), hidden)
            findings = [doctor.Finding("doctor", "error", f"the checks could not run: "
                                       f"{type(exc).__name__}: {said}",
                                       "see the dashboard's log")]
        return doctor.report(findings)

    def jobs(self, filters: Mapping[str, str], before_id: int | None,
             limit: int, parent_id: int | None = None) -> dict[str, Any]:
        """A page of jobs, newest first, and the ``before_id`` of the next page;
        ``filters`` as :func:`_list_args` checked them."""
        if parent_id is None and filters.get("parent"):
            parent_id = ops.id_arg(filters["parent"], "parent")
        jobs = self.client.list_jobs(
            queue=filters.get("queue"), state=filters.get("state"), kind=filters.get("kind"),
            workflow_id=filters.get("workflow"), parent_id=parent_id,
            before_id=before_id, limit=limit)
        return {"jobs": [ops.job_line(j) for j in jobs],
                "next_before_id": jobs[-1].id if len(jobs) == limit else None}

    # -- Mutations -------------------------------------------------------------------

    def _mutate(self, request: Request, access: Access, job_segment: str,
                tool: str) -> Response:
        if access.mode == "none":
            raise _Failure(403, access.read_only_hint)
        # belay.origin's rule, the one every HTTP surface applies to a mutation.
        refused = origin.cross_origin(request.headers, fix=_ORIGIN_FIX) \
            if access.check_origin else None
        if refused is not None:
            raise _Failure(403, refused)
        refused = origin.not_json(request.headers, fix=_JSON_FIX)
        if refused is not None:
            raise _Failure(415, refused)
        if access.mode == "token":
            _check_token(request.headers.get("authorization", ""), access.token or "")
        if len(request.body) > MAX_BODY:
            raise _Failure(413, f"the request body is over {MAX_BODY} bytes")
        job_id = ops.id_arg(job_segment, "the job id in the path")
        args = _body_object(request.body)
        if "job_id" in args:
            raise ValidationError("job_id is not a body field: the job is the one in the "
                                  "path, /api/jobs/<id>/<action>")
        result = ops.mutate(self.client, access.guard, tool, {**args, "job_id": job_id})
        return _json(200, {"ok": True, "action": tool, **result})

    def _failure(self, failure: _Failure, api: bool, page: pages.Page) -> Response:
        if api:
            return _json(failure.status, {"error": failure.message}, failure.headers)
        title = {400: "Bad request", 403: "Forbidden", 404: "Not found", 405: "Not allowed",
                 409: "Conflict", 503: "Unavailable"}.get(failure.status, "Error")
        body = pages.error_page(page, failure.status, title, failure.message)
        return Response(failure.status, "text/html; charset=utf-8", body.encode(),
                        failure.headers)


_GET_ROUTES: tuple[tuple[str, str], ...] = (
    ("overview", r"/"),
    ("jobs", r"/jobs/?"),
    ("job", r"/jobs/([^/]+)"),
    ("workflow", r"/workflow"),
    ("doctor", r"/doctor/?"),
    ("schedules", r"/schedules/?"),
    ("spend", r"/spend/?"),
    ("static", r"/static/(dashboard\.css|dashboard\.js)"),
    ("api_overview", r"/api/overview"),
    ("api_jobs", r"/api/jobs"),
    ("api_job", r"/api/jobs/([^/]+)"),
    ("api_workflow", r"/api/workflow"),
    ("api_doctor", r"/api/doctor"),
    ("api_schedules", r"/api/schedules"),
    ("api_spend", r"/api/spend"),
)


def _known_get(path: str) -> tuple[str, str | None] | None:
    for name, pattern in _GET_ROUTES:
        match = re.fullmatch(pattern, path)
        if match:
            return name, (match[1] if match.groups() else None)
    return None


def _json(status: int, data: Any, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    text = json.dumps(ops.jsonable(data), ensure_ascii=False)
    # "<" as \u003c: the JSON can never close a tag, wherever it ends up. A lone
    # surrogate that slipped into a message becomes its JSON escape, not a 500.
    return Response(status, "application/json; charset=utf-8",
                    text.replace("<", "\\u003c").encode("utf-8", "backslashreplace"), headers)


def _page(status: int, text: str) -> Response:
    return Response(status, "text/html; charset=utf-8",
                    text.encode("utf-8", "backslashreplace"))


def _list_args(query: Mapping[str, str], *, api: bool
               ) -> tuple[dict[str, str], int | None, int | None, int]:
    """The list's filters (each checked, the text ones as names), parent,
    before_id and limit."""
    filters = {k: query[k].strip() for k in pages.FILTERS if query.get(k, "").strip()}
    for key, value in filters.items():
        if key == "state":
            ops.state_arg(value)
        elif key != "parent":
            ops.name_arg(value, key)
    parent = ops.id_arg(filters["parent"], "parent") if "parent" in filters else None
    before = query.get("before_id", "").strip()
    before_id = ops.id_arg(before, "before_id") if before else None
    limit = PAGE_SIZE
    if api and query.get("limit"):
        limit = ops.int_arg(query["limit"], "limit", high=MAX_LIMIT)
    return filters, parent, before_id, limit


_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def _too_deep(text: str, limit: int) -> str | None:
    """The field of the body object ``text`` under which JSON nests more than
    ``limit`` levels (``"the request body"`` if not under one), else None.

    Scanned before parsing: json.loads recurses, and a body of 64 KiB holds a
    value nested 32,000 deep. Linear: each bracket, quote and backslash once."""
    depth, key_start, key, in_string, skip_to = 0, -1, "", False, -1
    fields = text.lstrip()[:1] == "{"
    for match in _JSON_STRUCTURE.finditer(text):
        at, char = match.start(), match[0]
        if at < skip_to:
            continue  # the character a backslash escaped
        if in_string:
            if char == "\\":
                skip_to = at + 2
            elif char == '"':
                in_string = False
                if depth == 1 and key_start >= 0:
                    key, key_start = text[key_start:at + 1], -1
        elif char == '"':
            in_string = True
            key_start = at if depth == 1 and fields else -1
        elif char in "[{":
            depth += 1
            if depth > limit + 1:  # the body object is one level
                try:
                    name = json.loads(key) if key else ""
                except ValueError:
                    name = ""
                if not isinstance(name, str) or not name:
                    return "the request body"
                return name if name.isidentifier() else ops.shown(name)
        elif char in "]}":
            depth -= 1
    return None


def _body_object(body: bytes) -> dict[str, Any]:
    """A mutation's JSON body as an object; a 400 saying why it isn't one."""
    try:
        text = body.decode("utf-8") if body else "{}"
    except UnicodeDecodeError:
        raise ValidationError("the request body is not valid UTF-8") from None
    deepest = _too_deep(text, ops.MAX_JSON_DEPTH)
    if deepest is not None:
        raise ValidationError(f"{deepest} nests deeper than {ops.MAX_JSON_DEPTH} levels (the "
                              "limit for operator payloads); send a flatter object")
    try:
        args = json.loads(text)
    except ValueError:
        raise ValidationError("the request body is not valid JSON") from None
    if not isinstance(args, dict):
        raise ValidationError('the request body is a JSON object, like {} or '
                              '{"name": "approve", "payload": {}}')
    return args


def _check_token(authorization: str, token: str) -> None:
    scheme, _, given = authorization.partition(" ")
    challenge = (("WWW-Authenticate", 'Bearer realm="belay dashboard"'),)
    if scheme.lower() != "bearer" or not given.strip():
        raise _Failure(401, "this action needs the dashboard's token in an "
                            "'Authorization: Bearer' header (the page asks for it once)",
                       challenge)
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise _Failure(401, "wrong token: use the one in the dashboard's --token-file",
                       challenge)


# -- WSGI ------------------------------------------------------------------------------------

StartResponse = Callable[..., Any]


def _host_name(host: str) -> str:
    """The name in a Host header: ``127.0.0.1:8766`` → ``127.0.0.1``, ``[::1]:80`` → ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class WSGIApp:
    """The dashboard as a WSGI application mounted at ``prefix`` (below
    SCRIPT_NAME). ``allowed_hosts``, when given, are the only Host names
    answered (a loopback-only server refuses DNS-rebinding requests)."""

    def __init__(self, dashboard: Dashboard, access: Access, *, prefix: str = "",
                 allowed_hosts: Collection[str] | None = None) -> None:
        self.dashboard = dashboard
        self.access = access
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self.allowed_hosts = (None if allowed_hosts is None
                              else frozenset(h.lower() for h in allowed_hosts))

    def __call__(self, environ: Mapping[str, Any],
                 start_response: StartResponse) -> Iterable[bytes]:
        try:
            response = self._respond(environ)
        except Exception:
            log.exception("belay dashboard: unexpected error")
            response = _json(500, {"error": "internal error: see the dashboard's log"})
        status = f"{response.status} {_REASONS.get(response.status, 'Status')}"
        start_response(status, response.header_list())
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [response.body]

    def _respond(self, environ: Mapping[str, Any]) -> Response:
        path = _wsgi_text(str(environ.get("PATH_INFO", "") or ""))
        headers = {key[5:].replace("_", "-").lower(): str(value)
                   for key, value in environ.items() if key.startswith("HTTP_")}
        for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(key):
                headers[key.replace("_", "-").lower()] = str(environ[key])
        if self.allowed_hosts is not None:
            host = headers.get("host") or str(environ.get("SERVER_NAME", ""))
            if _host_name(host) not in self.allowed_hosts:
                names = ", ".join(sorted(self.allowed_hosts))
                return _json(421, {"error": f"this dashboard answers to the host names "
                                            f"{names} only, not {host!r} (a guard against "
                                            "DNS rebinding)"})
        base = str(environ.get("SCRIPT_NAME", "")).rstrip("/") + self.prefix
        if self.prefix:
            if path != self.prefix and not path.startswith(self.prefix + "/"):
                return _json(404, {"error": f"the dashboard is at {base}/"})
            path = path[len(self.prefix):] or "/"
        body = b""
        if environ.get("REQUEST_METHOD") == "POST":
            try:
                length = int(headers.get("content-length") or 0)
            except ValueError:
                length = 0
            if length > MAX_BODY:
                return _json(413, {"error": f"the request body is over {MAX_BODY} bytes"})
            body = environ["wsgi.input"].read(length) if length > 0 else b""
        request = Request(str(environ.get("REQUEST_METHOD", "GET")).upper(), path,
                          parse_query(str(environ.get("QUERY_STRING", ""))), headers, body)
        return self.dashboard.handle(request, self.access, base)


class QueryArgs(dict[str, str]):
    """:attr:`Request.query` as :func:`parse_query` builds it: each name's
    first value, and in ``every`` all of them (``by=day&by=kind``)."""

    def __init__(self) -> None:
        super().__init__()
        self.every: dict[str, list[str]] = {}


def all_values(query: Mapping[str, str], name: str) -> list[str]:
    """Every value of ``name`` in the query string (only the first one when
    ``query`` is a plain mapping that kept no others)."""
    if isinstance(query, QueryArgs):
        return list(query.every.get(name, ()))
    return [query[name]] if name in query else []


def parse_query(query_string: str) -> QueryArgs:
    """A WSGI ``QUERY_STRING`` as :attr:`Request.query` (each name's first value;
    all of them in :attr:`QueryArgs.every`). Values whose bytes are not UTF-8
    keep them as lone surrogates, which the checks refuse by name
    (``kind=%ED%A0%80`` is a 400, not a search for U+FFFD)."""
    query = QueryArgs()
    for raw_key, raw_value in parse_qsl(query_string, encoding="latin-1"):
        key, value = _wsgi_text(raw_key), _wsgi_text(raw_value)
        query.setdefault(key, value)
        query.every.setdefault(key, []).append(value)
    return query


def _wsgi_text(raw: str) -> str:
    """A WSGI string (the request's bytes as latin-1, PEP 3333) as text. Bytes
    that are not UTF-8 (``%ED%A0%80``, a surrogate's encoding) stay lone
    surrogates, so the checks refuse them by name instead of guessing."""
    try:
        data = raw.encode("latin-1")
    except UnicodeEncodeError:
        return raw  # a server that already decoded it
    return data.decode("utf-8", "surrogateescape")


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            413: "Payload Too Large", 415: "Unsupported Media Type",
            421: "Misdirected Request", 500: "Internal Server Error",
            503: "Service Unavailable"}
