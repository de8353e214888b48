"""``belay serve``: the HTTP/JSON API under uvicorn.

Loopback binds may be plain HTTP. Any other address needs TLS with client
certificates (mTLS): ``tls_cert``, ``tls_key`` and ``tls_client_ca`` together,
the last one the CA that signs the clients' certificates.

A request body must arrive within ``read_timeout`` seconds of its headers, or
it is answered 408 and its connection closed: uvicorn bounds the wait between
requests (``timeout_keep_alive``) but not a body held open half sent. And a
request's headers must arrive within ``read_timeout`` of the connection (or of
the previous response), or the connection is closed: uvicorn cancels its
keep-alive timer at the first byte, so a client trickling headers would hold a
connection forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from belay.client import Belay
from belay.errors import ConfigurationError
from belay.http.app import build_app
from belay.loopback import LOOPBACK_NAMES, is_loopback
from belay.redact import redact_logging, secrets_of

#: The most seconds a lease, a session or a read timeout may last.
_LONGEST = {"--session-ttl": 86_400.0, "--lease-ttl": 86_400.0, "--read-timeout": 3600.0}


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
    if missing:
        return False
    for flag, value in given.items():
        assert value is not None
        if not Path(value).is_file():
            raise ConfigurationError(f"{flag} {value}: no such file")
        try:
            Path(value).read_bytes()
        except OSError as exc:
            raise ConfigurationError(f"{flag} {value}: cannot read it: "
                                     f"{exc.strerror or exc}") from None
    assert tls_cert is not None and tls_key is not None and tls_client_ca is not None
    check_tls_files(tls_cert, tls_key, tls_client_ca)
    return True


def check_tls_files(tls_cert: str, tls_key: str, tls_client_ca: str) -> None:
    """Load the files as the server will, now, so a bad one is a
    ConfigurationError naming its flag before anything is served."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for flag, path in (("--tls-cert", tls_cert), ("--tls-client-ca", tls_client_ca)):
        try:
            ssl.create_default_context(cafile=path)
        except ssl.SSLError as exc:
            raise ConfigurationError(f"{flag} {path}: not a PEM certificate ({exc.reason or exc})"
                                     ) from None

    def no_passphrase() -> bytes:
        # Without it OpenSSL would prompt on the terminal for an encrypted key.
        return b""

    try:
        context.load_cert_chain(tls_cert, tls_key, password=no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigurationError(f"--tls-key {tls_key} is not the key of --tls-cert "
                                     f"{tls_cert}: give the key the certificate was made for"
                                     ) from None
        raise ConfigurationError(f"--tls-key {tls_key}: not an unencrypted PEM private key"
                                 + (f" ({exc.reason})" if exc.reason else "")) from None


def check_seconds(flag: str, value: float) -> float:
    """``value`` if it is finite seconds > 0 and at most the longest for ``flag``."""
    longest = _LONGEST[flag]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (math.isfinite(value) and 0 < value <= longest):
        raise ConfigurationError(f"{flag} is seconds > 0 and at most {longest:g}, "
                                 f"got {value!r}")
    return float(value)


class ReadTimeout:
    """ASGI middleware: a request whose body keeps the app waiting more than
    ``timeout`` seconds in all is answered 408 with ``Connection: close``, and
    the app reads a disconnect (it is no longer answering).

    Only time spent waiting for the body counts, not the app's own work
    before it reads it: a body that arrived while the app was busy is never
    late."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        state = {"body_done": False, "started": False, "timed_out": False}
        waited = [0.0]

        async def timed_receive() -> Message:
            if state["timed_out"]:
                return {"type": "http.disconnect"}
            if state["body_done"]:
                return await receive()
            began = loop.time()
            try:
                # > 0: a wait that used the rest of the budget timed out.
                message = await asyncio.wait_for(receive(), self.timeout - waited[0])
            except asyncio.TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    state["started"] = True
                    await send({"type": "http.response.start", "status": 408,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"connection", b"close")]})
                    await send({"type": "http.response.body", "body": json.dumps(
                        {"error": {"code": "request_timeout", "message":
                                   f"the request body did not arrive within "
                                   f"{self.timeout:g} s; send it whole, then retry"}}
                    ).encode()})
                return {"type": "http.disconnect"}
            finally:
                waited[0] += loop.time() - began
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message: Message) -> None:
            if state["timed_out"]:
                return  # answered 408 already
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not state["timed_out"]:
                raise
            # The app failing on the disconnect it was handed: the 408 stands.


def header_deadline_protocol(timeout: float) -> type[Any]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers
    have not all arrived ``timeout`` seconds after the connection was made or
    the previous response was sent (slow-header clients; the body is
    :class:`ReadTimeout`'s)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            # Headers still incomplete (the client's side idle, no request yet).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


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
    read_timeout: float = 30.0,
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
    expired leases, as a Python worker's sweeper does. A request body that takes
    longer than ``read_timeout`` seconds to arrive is answered 408.

    Every option is checked, the TLS files loaded and the port bound before
    the line saying where it serves is printed."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("belay serve runs under uvicorn: pip install 'belay[http]'"
                          ) from None
    session_ttl = check_seconds("--session-ttl", session_ttl)
    lease_ttl = check_seconds("--lease-ttl", lease_ttl)
    read_timeout = check_seconds("--read-timeout", read_timeout)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(f"--port is a port number from 0 (any free port) to 65535, "
                                 f"got {port!r}")
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
        config = uvicorn.Config(ReadTimeout(app, read_timeout), log_level="warning",
                                http=header_deadline_protocol(read_timeout),
                                access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=shutdown_grace, **tls_options)
        # uvicorn set up its loggers just now: what they print is redacted.
        redact_logging(secrets_of(url), ("", "uvicorn", "uvicorn.error", "uvicorn.access"))
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
