"""A waitress server on a thread of its own, for embedding the dashboard (or
any WSGI app) in a process that does other things, and for tests.

``serve()`` in ``belay.dashboard`` runs in the foreground instead.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any


class Server:
    """Serves ``app`` on ``host:port`` (0: a free port) from a thread named
    ``belay-dashboard`` once started; :meth:`stop` closes every socket and
    joins the thread."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 threads: int = 4) -> None:
        try:
            from waitress import create_server
        except ImportError:
            raise ImportError("the dashboard runs under waitress: pip install "
                              "'belay[dashboard]'") from None
        self._server: Any = create_server(app, host=host, port=port, threads=threads,
                                          ident="belay")
        shown = f"[{host}]" if ":" in host else host
        #: The base URL served, like ``http://127.0.0.1:8766``.
        self.url = f"http://{shown}:{self._server.effective_port}"
        self._thread = threading.Thread(target=self._server.run, name="belay-dashboard",
                                        daemon=True)

    def start(self) -> Server:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listening socket and every connection from the server's own
        loop (closing them from here could race its poll), then join it."""
        from waitress import wasyncore

        server = self._server
        if self._thread.is_alive():
            server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError("the dashboard server did not stop")
        else:
            server.close()
        server.task_dispatcher.shutdown()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
