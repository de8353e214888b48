"""The one rule every HTTP surface of belay applies to a request that changes
state: a browser may send it only from the server's own origin, and a body is
``application/json`` (issue 38).

Why both: a web page the operator visits can make the browser send a "simple"
cross-site request — a GET, or a POST whose Content-Type is a form's
(``application/x-www-form-urlencoded``, ``multipart/form-data``,
``text/plain``) — with no CORS preflight and whatever cookies or ambient
access the browser has (a loopback server with no token, say). The page never
reads the answer, but the mutation is done. Requiring ``application/json``
makes every such POST a non-simple one, which needs a preflight belay never
answers; refusing a foreign ``Origin`` (or ``Sec-Fetch-Site: cross-site`` /
``same-site``) stops it outright, whatever the method, and covers the
methods a preflight already guards (DELETE, PUT) the same way.

A request with no ``Origin`` and no ``Sec-Fetch-Site`` is not from a browser
page (curl, an SDK, an HTTP worker): the token or the authorizer decides.

The checks are pure and framework-free: the dashboard (WSGI) calls
:func:`cross_origin` and :func:`not_json`; the ASGI servers (``belay serve``,
``belay mcp --transport http``) wrap their app in :class:`BrowserGuard`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

#: Methods that change nothing: no rule applies to them.
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: What a browser's ``Sec-Fetch-Site`` says of a request from another origin.
FOREIGN_SITES: Final = frozenset({"cross-site", "same-site"})
#: The fix the API servers name in a 403.
ORIGIN_FIX: Final = ("call it from a page of this server's own origin, or without a browser "
                     "(curl, an SDK and the HTTP workers send no Origin)")
#: The fix the API servers name in a 415.
JSON_FIX: Final = ("send Content-Type: application/json, with {} as the body when the call "
                   "has nothing to send")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: its HTTP ``status``, the API error ``code``
    (:data:`belay.http.errors.STATUS`) and a ``message`` that names the fix."""

    status: int
    code: str
    message: str


def cross_origin(headers: Mapping[str, str], *, fix: str = ORIGIN_FIX) -> str | None:
    """Why a browser sent this request from another origin (the message ends
    with ``fix``), or None. ``headers`` have lower-case names; ``host`` is the
    Host the request reached."""
    site = headers.get("sec-fetch-site", "").strip().lower()
    if site in FOREIGN_SITES:
        return f"cross-origin request refused (Sec-Fetch-Site: {site}): {fix}"
    origin = headers.get("origin")
    if origin is None:
        return None  # not a browser page: the token or the authorizer decides
    host = headers.get("host", "")
    if _same(origin.strip(), host.strip()):
        return None
    return (f"cross-origin request refused: Origin {origin[:200]!r} is not this server "
            f"({host[:200] or 'no Host header'}): {fix}")


def not_json(headers: Mapping[str, str], *, fix: str = JSON_FIX) -> str | None:
    """Why this body is not declared JSON (the message starts with ``fix``), or None."""
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "application/json":
        return None
    return f"{fix} (got {media[:100] or 'no Content-Type'!r})"


def refusal(method: str, headers: Mapping[str, str]) -> Refusal | None:
    """The API servers' rule for one request: a mutation (any method but
    :data:`SAFE_METHODS`) from a foreign origin is 403 ``cross_origin``; a POST
    whose Content-Type is not ``application/json`` — even with an empty body —
    is 415 ``unsupported_media_type``. DELETE and PUT need no Content-Type: a
    browser can't send them cross-site without a preflight."""
    method = method.upper()
    if method in SAFE_METHODS:
        return None
    message = cross_origin(headers)
    if message is not None:
        return Refusal(403, "cross_origin", message)
    if method == "POST":
        message = not_json(headers)
        if message is not None:
            return Refusal(415, "unsupported_media_type", message)
    return None


def _same(origin: str, host: str) -> bool:
    """Whether ``origin`` (scheme://host[:port]) names ``host`` (a Host header),
    a missing port being the scheme's default on both sides."""
    try:
        parts = urlsplit(origin)
        default = _DEFAULT_PORTS.get(parts.scheme.lower())
        if default is None or parts.hostname is None or parts.path or parts.query:
            return False  # "null", a file: or extension page, or not an origin at all
        served = urlsplit("//" + host)
        if served.hostname is None or served.path:
            return False
        return (parts.hostname, parts.port or default) == (served.hostname,
                                                           served.port or default)
    except ValueError:  # a port out of range, a malformed IPv6 literal
        return False


class BrowserGuard:
    """ASGI middleware: a request :func:`refusal` refuses is answered with its
    status and ``{"error": {"code", "message"}}`` (the API's error body), its
    body never read, and the connection closed."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for name, value in scope.get("headers", []):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        refused = refusal(scope.get("method", "GET"), headers)
        if refused is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"code": refused.code, "message": refused.message}},
                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": refused.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
