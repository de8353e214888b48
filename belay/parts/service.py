"""A background loop on a named thread, supervised.

Every loop a worker runs in the background (producers, the poller, the lease
keeper, the completer, maintenance, queue sync, the HTTP sessions' heartbeat)
is a :class:`Service`: one named daemon thread, ``start``/``stop``/``join``,
a ``wait`` that a stop or a ``wake`` cuts short, and a crash policy. A loop
handles the failures it expects (a database that blinks) itself and goes on;
anything that escapes it — a bug, a ``BaseException`` — or a loop that
returns before it was asked to stop is a crash: logged as critical and handed
to ``on_crash``, which for a worker means it stops claiming and stops (a
worker whose leases no longer renew must not take more jobs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from belay.ambient import mark_system_thread

log = logging.getLogger("belay.worker")


class ServiceCrashed(RuntimeError):
    """A service's loop returned although nobody asked it to stop."""


class Service:
    """``body(service)`` run on a daemon thread named ``name``.

    The body loops until :attr:`stopping`; it sleeps with :meth:`wait`, which
    returns early (True) once the service is asked to stop, or (False) on
    :meth:`wake`.
    """

    def __init__(
        self,
        name: str,
        body: Callable[[Service], None],
        *,
        on_crash: Callable[[Service, BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self._body = body
        self._on_crash = on_crash
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: What ended the loop against its will, once it crashed.
        self.crashed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        state = ("crashed" if self.crashed is not None else "alive" if self.alive
                 else "stopped")
        return f"<Service {self.name} {state}>"

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Service:
        # A daemon: a job stuck past the shutdown grace must not hold the
        # process open (its lease lapses and another node reclaims it).
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the loop to end (it does at its next ``wait`` or check)."""
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True once it has ended. A service never joins itself."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    def wake(self) -> None:
        """Cut the current or next ``wait`` short."""
        self._wake.set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when the service is stopping."""
        if not self._stop.is_set():
            self._wake.wait(max(0.0, seconds))
            self._wake.clear()
        return self._stop.is_set()

    def _main(self) -> None:
        # Not a job's thread: what the loop enqueues (a cron's job) is belay's.
        mark_system_thread()
        try:
            self._body(self)
            if self._stop.is_set():
                return
            raise ServiceCrashed(f"{self.name} returned while the worker still needed it")
        except BaseException as exc:
            self.crashed = exc
            log.critical("belay: %s crashed: %r", self.name, exc, exc_info=exc)
            if self._on_crash is not None:
                try:
                    self._on_crash(self, exc)
                except BaseException:
                    log.exception("belay: handling the crash of %s failed", self.name)


class Supervisor:
    """The services of one worker: started together, stopped together, and
    the first crash of any of them handed to ``on_crash(service, exc)``."""

    def __init__(self, on_crash: Callable[[Service, BaseException], None]) -> None:
        self._on_crash = on_crash
        self._lock = threading.Lock()
        self._services: list[Service] = []
        #: The first service that crashed, and what ended it.
        self.crashed: tuple[Service, BaseException] | None = None

    def service(self, name: str, body: Callable[[Service], None]) -> Service:
        """A new service, supervised (not started)."""
        return Service(name, body, on_crash=self.report)

    def start(self, name: str, body: Callable[[Service], None]) -> Service:
        service = self.service(name, body).start()
        with self._lock:
            self._services.append(service)
        return service

    def reset(self) -> None:
        with self._lock:
            self._services, self.crashed = [], None

    def take(self) -> list[Service]:
        """The started services, forgotten (a stop stops and joins them)."""
        with self._lock:
            services, self._services = self._services, []
        return services

    def report(self, service: Service, exc: BaseException) -> None:
        with self._lock:
            if self.crashed is None:
                self.crashed = (service, exc)
        self._on_crash(service, exc)
