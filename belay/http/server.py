"""``belay serve``: the HTTP/JSON API under uvicorn.

Loopback binds may be plain HTTP. Any other address needs TLS with client
certificates (mTLS): ``tls_cert``, ``tls_key`` and ``tls_client_ca`` together,
the last one the CA that signs the clients' certificates.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from starlette.routing import BaseRoute

from belay.client import Belay
from belay.errors import ConfigurationError
from belay.http.app import build_app
from belay.loopback import LOOPBACK_NAMES, is_loopback


def check_tls(host: str, tls_cert: str | None, tls_key: str | None,
              tls_client_ca: str | None) -> bool:
    """Whether to serve TLS; a ConfigurationError naming the flags when the
    options are partial, or missing on a non-loopback ``host``."""
    given = {"--tls-cert": tls_cert, "--tls-key": tls_key, "--tls-client-ca": tls_client_ca}
    missing = [flag for flag, value in given.items() if not value]
    if missing and len(missing) < len(given):
        raise ConfigurationError(
            f"TLS needs all of --tls-cert, --tls-key and --tls-client-ca; missing "
            f"{', '.join(missing)}")
    if missing and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to serve {host} without TLS: a non-loopback address needs "
            "--tls-cert, --tls-key and --tls-client-ca (clients must present a certificate "
            "signed by that CA); or bind 127.0.0.1")
    for flag, value in given.items():
        if value and not Path(value).is_file():
            raise ConfigurationError(f"{flag} {value}: no such file")
    return not missing


def serve(
    url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    extra_openapi_paths: Mapping[str, Any] | None = None,
    body_limit: int = 1_000_000,
    allowed_hosts: Collection[str] = (),
    shutdown_grace: int = 10,
    workers: bool = True,
    session_ttl: float = 60.0,
    lease_ttl: float = 30.0,
    reclaim_interval: float = 5.0,
) -> None:
    """Serve the API of the database at ``url`` until SIGTERM or Ctrl-C (then
    return normally, after at most ``shutdown_grace`` seconds for open requests
    such as event streams). Port 0 picks a free port; the first line printed
    says where it serves. On a loopback address it answers only requests whose
    Host is a loopback name or one of ``allowed_hosts`` (DNS-rebinding guard).

    With ``workers`` (the default) it also serves the HTTP worker protocol
    (:mod:`belay.http.workers`): sessions expire after ``session_ttl`` seconds
    without a claim, their jobs' leases last ``lease_ttl`` and are renewed while
    the session lives, and every ``reclaim_interval`` seconds the server reclaims
    expired leases, as a Python worker's sweeper does."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("belay serve runs under uvicorn: pip install 'belay[http]'"
                          ) from None
    tls = check_tls(host, tls_cert, tls_key, tls_client_ca)
    if token is not None and not token.strip():
        raise ConfigurationError("the token is empty; put a secret in the --token-file")
    loopback = is_loopback(host)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a kept-alive connection's
        # every reply waits ~40 ms for the client's delayed ACK (Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)  # before the line is printed: a client may connect at once
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                 "choose another --port (or --host)") from None
    with sock, Belay(url) as client, contextlib.ExitStack() as stack:
        client.check_schema()
        routes, paths = list(extra_routes), dict(extra_openapi_paths or {})
        if workers:
            from belay.http.workers import WORKER_OPENAPI_PATHS, WorkerSessions, worker_routes

            sessions = WorkerSessions(client, session_ttl=session_ttl, lease_ttl=lease_ttl,
                                      reclaim_interval=reclaim_interval)
            sessions.start()  # reclaims expired leases from the start
            stack.callback(sessions.stop)
            routes += worker_routes(sessions, token=token)
            paths.update(WORKER_OPENAPI_PATHS)
        app = build_app(client, token=token, body_limit=body_limit,
                        extra_routes=routes, extra_openapi_paths=paths,
                        allowed_hosts=(LOOPBACK_NAMES | {host.lower()}
                                       | {h.lower() for h in allowed_hosts})
                        if loopback else None)
        tls_options: dict[str, Any] = {}
        if tls:
            tls_options = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key,
                           "ssl_ca_certs": tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                server_header=False,
                                timeout_graceful_shutdown=shutdown_grace, **tls_options)
        server = uvicorn.Server(config)
        shown = f"[{host.strip('[]')}]" if family == socket.AF_INET6 else host
        scheme = "https" if tls else "http"
        bound = sock.getsockname()[1]
        access = "bearer token required" if token else "no token"
        print(f"belay serve: serving {scheme}://{shown}:{bound}/ "
              f"({'mTLS, ' if tls else ''}{access})", flush=True)
        with _quiet_sigterm():
            server.run(sockets=[sock])


@contextlib.contextmanager
def _quiet_sigterm() -> Iterator[None]:
    """uvicorn shuts down on SIGTERM, then raises the signal again for the
    handler it found; a no-op one here makes that a clean return (exit 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _ignore)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore(signum: int, frame: Any) -> None:
    print("belay serve: stopped", file=sys.stderr, flush=True)
