"""Prometheus metrics for a worker, fed by its hooks, and an HTTP endpoint to scrape.

Needs the ``metrics`` extra (``pip install 'belay[metrics]'``, which brings
``prometheus_client``). :class:`PrometheusMetrics` counts what the worker's
``on_job_start`` / ``on_job_end`` hooks report and reads the queue depths
from the database at scrape time; :func:`start_metrics` serves them over
HTTP (``belay worker --metrics-port N`` calls it). Labels are the queue,
the kind, the outcome and the state only, never a job id.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from belay import store
from belay.connect import connect
from belay.errors import ConfigurationError
from belay.job import STATES, Job
from belay.runner import JobEnd, Worker

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("belay.telemetry")

#: Histogram buckets in seconds: from quick jobs to hour-long agent runs.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    3600.0,
)

#: Seconds a scrape may spend connecting to and reading the database.
SCRAPE_TIMEOUT = 5.0
#: ``belay_queue_jobs`` counts unfinished jobs up to this many per queue and
#: state, finished ones up to ``store.STATS_CAP``; a count over its cap reads
#: as the cap + 1, so a scrape stays bounded however big the table grows.
METRICS_LIVE_CAP = 1_000_000


def _require() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "belay's metrics need prometheus_client, which is not installed: "
            "pip install 'belay[metrics]'"
        ) from exc


class PrometheusMetrics:
    """Registers belay's metrics in ``registry`` and feeds them from ``worker``'s hooks.

    ``registry`` defaults to a new ``CollectorRegistry`` (pass
    ``prometheus_client.REGISTRY`` to join the process's default one).
    ``queue_depths=False`` leaves out ``belay_queue_jobs``: it reads the
    whole jobs table at every scrape, and every worker reports the same
    cluster-wide numbers.
    """

    def __init__(
        self,
        worker: Worker,
        registry: CollectorRegistry | None = None,
        *,
        queue_depths: bool = True,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        scrape_timeout: float = SCRAPE_TIMEOUT,
    ) -> None:
        _require()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.started = Counter("belay_jobs_started", "Executions started, by queue and kind.",
                               ["queue", "kind"], registry=None)
        self.finished = Counter("belay_jobs_finished",
                                "Executions finished, by queue, kind and outcome.",
                                ["queue", "kind", "outcome"], registry=None)
        self.duration = Histogram("belay_job_duration_seconds",
                                  "Seconds from claim to the end of the run, by outcome.",
                                  ["queue", "kind", "outcome"], buckets=buckets, registry=None)
        self.in_flight = Gauge("belay_jobs_in_flight",
                               "Executions running on this worker now.",
                               ["queue", "kind"], registry=None)
        self.crashes = Counter("belay_worker_crashes",
                               "Background services of this worker that crashed (the worker "
                               "then stops), by service.", ["service"], registry=None)
        collectors: list[Any] = [self.started, self.finished, self.duration, self.in_flight,
                                 self.crashes]
        if queue_depths:
            collectors.append(QueueDepths(worker, timeout=scrape_timeout))
        registered: list[Any] = []
        try:
            for collector in collectors:
                self.registry.register(collector)
                registered.append(collector)
        except ValueError as exc:  # DuplicateTimeseries
            for collector in registered:
                self.registry.unregister(collector)
            raise ConfigurationError(
                f"belay's metrics are already in this registry ({exc}); instrument a worker "
                "once per registry, or give each worker a registry of its own"
            ) from None
        self._lock = threading.Lock()
        #: Executions started and not yet ended: (job id, attempt) → (queue, kind).
        self._open: dict[tuple[int, int], tuple[str, str]] = {}
        worker.on_job_start(self.job_started)
        worker.on_job_end(self.job_ended)
        worker.on_crash(self.crashed)

    def job_started(self, job: Job) -> None:
        """The ``on_job_start`` hook."""
        labels = (job.queue, job.kind)
        with self._lock:
            self._open[(job.id, job.attempt)] = labels
        self.started.labels(*labels).inc()
        self.in_flight.labels(*labels).inc()

    def job_ended(self, end: JobEnd) -> None:
        """The ``on_job_end`` hook."""
        job = end.job
        with self._lock:
            opened = self._open.pop((job.id, job.attempt), None)
        if opened is not None:  # a start seen before these hooks were added is not counted
            self.in_flight.labels(*opened).dec()
        self.finished.labels(job.queue, job.kind, end.outcome).inc()
        self.duration.labels(job.queue, job.kind, end.outcome).observe(end.duration)


    def crashed(self, service: str, exc: BaseException) -> None:
        """The ``on_crash`` hook."""
        self.crashes.labels(service.removeprefix("belay-")).inc()


def instrument(worker: Worker, registry: CollectorRegistry | None = None,
               **options: Any) -> PrometheusMetrics:
    """``PrometheusMetrics(worker, registry, **options)``."""
    return PrometheusMetrics(worker, registry, **options)


class QueueDepths:
    """A collector: jobs per queue and state, read at each scrape (unfinished
    jobs counted up to :data:`METRICS_LIVE_CAP`, finished ones up to
    ``store.STATS_CAP``).

    Soft: when the database can't answer within ``timeout`` seconds the scrape
    still succeeds, without ``belay_queue_jobs`` and with
    ``belay_queue_stats_up`` 0 (logged once per outage).
    """

    def __init__(self, worker: Worker, *, timeout: float = SCRAPE_TIMEOUT) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigurationError(f"scrape_timeout must be seconds > 0, got {timeout!r}")
        self.worker = worker
        self.timeout = float(timeout)
        self._failing = False

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        depths, up = self._families()
        try:
            stats = self._read()
        except Exception as exc:
            if not self._failing:
                log.warning("belay metrics: reading queue depths failed (%s); "
                            "belay_queue_stats_up is 0 until the database answers",
                            str(exc).strip() or type(exc).__name__)
            self._failing = True
            up.add_metric([], 0.0)
            return [up]
        if self._failing:
            log.info("belay metrics: reading queue depths works again")
        self._failing = False
        queues = set(stats) | set(self.worker.queues) | set(self.worker.live_queues())
        for queue in sorted(queues):
            counts = stats.get(queue, {})
            for state in (*STATES, *sorted(set(counts) - set(STATES))):
                depths.add_metric([queue, state], float(counts.get(state, 0)))
        up.add_metric([], 1.0)
        return [depths, up]

    def _families(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("belay_queue_jobs", "Jobs in the database by queue and state.",
                                labels=["queue", "state"])
        yield GaugeMetricFamily("belay_queue_stats_up",
                                "1 when the last scrape could read the queue depths, else 0.")

    def _read(self) -> dict[str, dict[str, int]]:
        """One short-lived connection, bounded in time, so a scrape can't hang."""
        client = self.worker.client
        params = conninfo_to_dict(client.conninfo)
        timeout_ms = max(1, int(self.timeout * 1000))
        conninfo = make_conninfo(
            client.conninfo,
            connect_timeout=params.get("connect_timeout") or max(1, round(self.timeout)),
            application_name="belay-metrics",
        )
        # The time limit is SET LOCAL, in the read's own transaction: a startup
        # option would not pass a transaction pooler.
        with connect(conninfo, client.pooler, autocommit=True) as conn, conn.transaction():
            store.local_statement_timeout(conn, timeout_ms)
            rows = store.queue_stats(conn, METRICS_LIVE_CAP, store.STATS_CAP)
        out: dict[str, dict[str, int]] = {}
        for row in rows:
            out.setdefault(row["queue"], {})[row["state"]] = row["count"]
        return out


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server answering each scrape on a named daemon thread."""

    daemon_threads = True

    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        self.address_family = infos[0][0]
        super().__init__((host, port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address),
                                  name="belay-metrics-scrape", daemon=True)
        thread.start()


class MetricsServer:
    """The HTTP endpoint of :func:`start_metrics`; ``close()`` stops it (idempotent)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        from prometheus_client import make_wsgi_app

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigurationError(f"metrics port must be a whole number from 0 to 65535 "
                                     f"(0 picks a free one), got {port!r}")
        try:
            self._server = _Server(host, port)
        except OSError as exc:
            raise ConfigurationError(
                f"metrics: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                "pick another --metrics-port (0 picks a free one) or --metrics-host"
            ) from None
        self._server.set_app(make_wsgi_app(registry))
        self.host = host
        self.port: int = self._server.server_address[1]
        #: The metrics it serves, when :func:`start_metrics` made them.
        self.metrics: PrometheusMetrics | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.5,),
                                        name="belay-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        log.info("belay metrics: stopped serving %s", self.url)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics(
    worker: Worker,
    *,
    port: int,
    host: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
    queue_depths: bool = True,
) -> MetricsServer:
    """Serve ``worker``'s metrics at ``http://host:port/metrics`` on the
    ``belay-metrics`` thread until the worker stops (or ``close()``).

    ``registry`` defaults to a new one holding belay's metrics and the
    process, platform and GC collectors of ``prometheus_client``.
    ``port=0`` picks a free port (read it back from ``.port``).
    """
    _require()
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
    )

    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    server = MetricsServer(registry, host, port)
    try:
        server.metrics = PrometheusMetrics(worker, registry, queue_depths=queue_depths)
    except BaseException:
        server.close()
        raise
    worker.on_stop(server.close)
    log.info("belay metrics: serving %s", server.url)
    return server
