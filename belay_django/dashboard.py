"""The belay dashboard mounted in a Django project.

::

    urlpatterns = [..., path("belay/", include("belay_django.urls"))]

It shows the jobs of belay_django's client (``settings.BELAY['DATABASE']``)
to users ``BELAY_DASHBOARD['PERMISSION']`` lets in (default: active staff),
sending anonymous visitors to the login page. It is read-only unless
``BELAY_DASHBOARD['MUTATIONS']`` is True (then those users may retry, cancel,
signal and steer) or an ``AUTHORIZER`` decides each action::

    BELAY_DASHBOARD = {
        "MUTATIONS": True,                         # default False: read-only
        "AUTHORIZER": "myapp.ops.may_act",         # may_act(request, action, args)
        "PERMISSION": "myapp.ops.may_view",        # may_view(request) -> bool
    }

An authorizer allows by returning None or True and refuses by returning
False or a message, or by raising (as belay.ops authorizers do); it gets the
request first, so it can look at ``request.user``. Actions are POSTs under
Django's CSRF protection: the page carries the CSRF token and sends it back
in the ``X-CSRFToken`` header.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import get_token
from django.utils.module_loading import import_string
from django.views.decorators.csrf import csrf_protect

from belay.dashboard.app import Access, Dashboard, Request, Response, parse_query
from belay.ops import Guard

KEYS = ("MUTATIONS", "AUTHORIZER", "PERMISSION")

READ_ONLY_HINT = (
    "This dashboard is read-only. To retry, cancel, signal and steer jobs from it, set "
    "BELAY_DASHBOARD = {'MUTATIONS': True} (or an 'AUTHORIZER') in your Django settings."
)


def is_staff(request: HttpRequest) -> bool:
    """The default PERMISSION: an active staff user."""
    user = request.user
    return bool(user.is_active and user.is_staff)


@dataclass(frozen=True)
class DashboardSettings:
    """``settings.BELAY_DASHBOARD``, checked."""

    mutations: bool = False
    authorizer: Callable[[HttpRequest, str, dict[str, Any]], object] | None = None
    permission: Callable[[HttpRequest], bool] = is_staff


def parse(raw: Any) -> DashboardSettings:
    """Check a ``BELAY_DASHBOARD`` dict; imports the dotted paths it names."""
    if raw is None:
        return DashboardSettings()
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(
            f"settings.BELAY_DASHBOARD is a dict like {{'MUTATIONS': True}}, got "
            f"{type(raw).__name__}")
    unknown = sorted(str(key) for key in raw if key not in KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"settings.BELAY_DASHBOARD has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"the keys are {', '.join(KEYS)}")
    mutations = raw.get("MUTATIONS", False)
    if not isinstance(mutations, bool):
        raise ImproperlyConfigured(
            f"settings.BELAY_DASHBOARD['MUTATIONS'] is True or False, got {mutations!r}")
    authorizer = _callable(raw, "AUTHORIZER", "may_act(request, action, args)")
    permission = _callable(raw, "PERMISSION", "may_view(request) -> bool")
    return DashboardSettings(mutations, authorizer, permission or is_staff)


def _callable(raw: Mapping[str, Any], key: str, shape: str) -> Any:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"settings.BELAY_DASHBOARD[{key!r}]: cannot import {raw[key]!r} ({exc}); "
                f"give the dotted path of a function {shape}") from None
    if not callable(value):
        raise ImproperlyConfigured(
            f"settings.BELAY_DASHBOARD[{key!r}] is a function {shape} or its dotted path, "
            f"got {value!r}")
    return value


def get() -> DashboardSettings:
    """The project's ``settings.BELAY_DASHBOARD``, checked (read afresh each request)."""
    return parse(getattr(settings, "BELAY_DASHBOARD", None))


def access_for(request: HttpRequest, conf: DashboardSettings) -> Access:
    """What this request may do: read only, or act under Django's session and CSRF."""
    if conf.authorizer is not None:
        authorize = conf.authorizer

        def guard(action: str, args: dict[str, Any]) -> object:
            return authorize(request, action, args)

        return Access("session", Guard(authorizer=guard), csrf=get_token(request),
                      check_origin=False)
    if conf.mutations:
        return Access("session", Guard(allow=True), csrf=get_token(request),
                      check_origin=False)
    return Access("none", csrf=get_token(request), read_only_hint=READ_ONLY_HINT)


def _to_django(response: Response) -> HttpResponse:
    out = HttpResponse(response.body, status=response.status,
                       content_type=response.content_type)
    for name, value in response.header_list():
        if name.lower() != "content-type":
            out[name] = value
    return out


@csrf_protect
def view(request: HttpRequest, path: str = "") -> HttpResponse:
    """Every dashboard URL: the page or JSON at ``path`` below the mount point."""
    from belay_django.adapter import client

    conf = get()
    api = path.startswith("api/")
    if not hasattr(request, "user"):
        raise ImproperlyConfigured(
            "the belay dashboard needs Django's auth: add "
            "'django.contrib.auth.middleware.AuthenticationMiddleware' to MIDDLEWARE")
    if not conf.permission(request):
        if not request.user.is_authenticated and not api and request.method == "GET":
            return redirect_to_login(request.get_full_path())
        message = ("the belay dashboard is for staff users (see "
                   "BELAY_DASHBOARD['PERMISSION'])")
        if api:
            return _to_django(Response(403, "application/json; charset=utf-8",
                                       json.dumps({"error": message}).encode()))
        return _to_django(Response(403, "text/plain; charset=utf-8", message.encode()))
    mount = request.path[: len(request.path) - len(path)] if path else request.path
    dashboard = Dashboard(client(), unavailable=(psycopg.OperationalError, OperationalError))
    neutral = Request(
        method=request.method or "GET",
        path="/" + path,
        query=parse_query(request.META.get("QUERY_STRING", "")),
        headers={key.lower(): value for key, value in request.headers.items()},
        body=request.body if request.method == "POST" else b"",
    )
    return _to_django(dashboard.handle(neutral, access_for(request, conf), mount))
