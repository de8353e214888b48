"""The belay web dashboard: queues, jobs, journals and workflow graphs, live.

``belay dashboard --url URL`` serves it (:func:`serve`, under waitress);
:func:`make_app` gives the WSGI application for any WSGI server, and
``belay_django.urls`` mounts it in a Django project. It is read-only unless
a token or an authorizer is configured; see docs/operations.md.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections.abc import Collection
from typing import Any

from belay.client import Belay
from belay.dashboard.app import Access, Dashboard, Request, Response, WSGIApp
from belay.errors import ConfigurationError
from belay.loopback import LOOPBACK_NAMES, is_loopback
from belay.ops import Guard

__all__ = ["Access", "Dashboard", "Request", "Response", "WSGIApp", "make_app", "serve"]

def make_app(client: Belay, *, guard: Guard | None = None, token: str | None = None,
             prefix: str = "", allowed_hosts: Collection[str] | None = None) -> WSGIApp:
    """The dashboard as a WSGI application on ``client``.

    Read-only unless ``token`` (then every action needs ``Authorization: Bearer
    <token>``; the page asks for it once) or ``guard`` with an authorizer is
    given; with both, the token is checked first, then the authorizer.
    ``prefix`` is the path it is mounted at (``"/belay"``); ``allowed_hosts``
    limits the Host names it answers to.
    """
    return WSGIApp(Dashboard(client), Access.standalone(guard, token), prefix=prefix,
                   allowed_hosts=allowed_hosts)


def serve(url: str, *, host: str = "127.0.0.1", port: int = 8766, guard: Guard | None = None,
          token: str | None = None, threads: int = 8,
          allowed_hosts: Collection[str] = (), read_timeout: float = 30.0) -> None:
    """Serve the dashboard of the database at ``url`` under waitress until
    interrupted (Ctrl-C or SIGTERM). Port 0 picks a free port; the line printed
    first says which URL it serves. On a loopback address it answers to the
    loopback names and ``allowed_hosts`` (the name a reverse proxy forwards).
    A connection whose request stalls ``read_timeout`` seconds (whole seconds:
    waitress's ``channel_timeout``) is closed."""
    try:
        from waitress import create_server
    except ImportError:
        raise ImportError("the dashboard runs under waitress: pip install 'belay[dashboard]'"
                          ) from None
    loopback = is_loopback(host)
    with Belay(url) as client:
        client.check_schema()
        app = make_app(client, guard=guard, token=token,
                       allowed_hosts=(LOOPBACK_NAMES | {host} | {h.lower() for h in allowed_hosts}
                                      if loopback else None))
        try:
            # channel_timeout closes a connection idle that long with no whole
            # request read (a body held open half sent); cleanup_interval is how
            # often waitress looks.
            server: Any = create_server(app, host=host, port=port, threads=threads,
                                        ident="belay", clear_untrusted_proxy_headers=True,
                                        channel_timeout=max(1, math.ceil(read_timeout)),
                                        cleanup_interval=1)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another "
                "--port (or --host)") from None
        shown = f"[{host}]" if ":" in host else host
        mode = {"none": "read-only",
                "token": "actions need the token",
                "open": "actions go to the authorizer"}[app.access.mode]
        print(f"belay dashboard: serving http://{shown}:{server.effective_port}/ ({mode})",
              flush=True)
        if not loopback:
            print(f"belay dashboard: warning: {host} is reachable from other machines, and "
                  "anyone who reaches it reads every job's input and results; actions need "
                  "a token or an authorizer. Put it behind TLS and your own access control.",
                  file=sys.stderr, flush=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.run()
        finally:
            server.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
