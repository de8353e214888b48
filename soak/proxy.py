"""A small TCP proxy between one worker and PostgreSQL that the driver can cut.

``cut()`` closes every proxied connection and refuses new ones (they are
accepted and closed at once) until ``heal()``: the worker behind it can't reach
the database, its leases lapse and other workers reclaim its jobs while its
threads keep running — a zombie whose late acks the fence must reject.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.cuts = 0
        self._thread = threading.Thread(target=self._accept, name="soak-proxy", daemon=True)

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._cut or self._closed
            if refuse:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`heal`."""
        with self._lock:
            self._cut = True
            victims = list(self._open)
        for sock in victims:
            self._drop(sock)
        self.cuts += 1

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()
