"""The worker ``manage.py belay_worker`` runs: a belay.Worker with Django hygiene.

Job code runs on belay's executor threads. When it uses the ORM, Django opens
a connection for that thread, as it would for a request; the
:func:`connection_hygiene` middleware calls ``close_old_connections()``
before and after every job there (Django's
request_started / request_finished do the same for requests), so a job sees
no stale connection and leaves none open past ``CONN_MAX_AGE``. belay's own
work (claims, heartbeats, acks) never touches Django's connections: the
worker gets a client of its own, with its own pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django.db import connections
from django.utils.module_loading import autodiscover_modules

from belay.client import Belay
from belay.context import Context
from belay.errors import ConfigurationError
from belay.runner import Worker
from belay_django.conf import BelaySettings


def close_old_connections() -> None:
    """Django's ``close_old_connections()``, sparing a connection inside an
    atomic block: ``drain()`` may run in a caller's thread (a test's), whose
    open transaction is not ours to close."""
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()


def connection_hygiene(contexts: Sequence[Context], call: Callable[[], Any]) -> Any:
    """Worker middleware: Django's connection hygiene around each run of a job."""
    close_old_connections()
    try:
        return call()
    finally:
        close_old_connections()


def django_worker(queues: Mapping[str, Any] | Iterable[str] = ("default",),
                  **options: Any) -> Worker:
    """A :class:`belay.Worker` (same arguments) that keeps job code's Django
    connections clean (:func:`connection_hygiene`)."""
    worker = Worker(queues, **options)
    worker.middleware(connection_hygiene)
    return worker


def build(
    settings: BelaySettings,
    *,
    queues: Mapping[str, Any] | None = None,
    notify: bool | None = None,
    node_id: str | None = None,
    **overrides: float | None,
) -> Worker:
    """The worker ``belay_worker`` runs: ``settings.BELAY`` with the command
    line's values (those not None) over it.

    It gets a client of its own on the alias's database, with its own pool
    and no connection provider: claims, heartbeats and acks never use Django's
    per-thread connections. Job code's ``belay.enqueue()`` goes through belay's
    default client (Django's connection of the executor thread).
    """
    from belay_django.adapter import conninfo_for

    notify = settings.notify if notify is None else notify
    options: dict[str, Any] = dict(settings.worker)
    options.update({name: value for name, value in overrides.items() if value is not None})
    if "busy_poll" not in options and "poll_interval" in options:
        options["busy_poll"] = min(0.025, options["poll_interval"])
    client = Belay(conninfo_for(settings.database),
                   **{**settings.connection_options, "notify": notify},
                   application_name="belay-worker")
    try:
        return django_worker(queues or settings.queues, client=client, crons=settings.crons,
                             notify=notify, node_id=node_id, **options)
    except ConfigurationError:
        client.close()
        raise


def discover() -> None:
    """Import every installed app's ``jobs`` module (their ``@belay.worker``
    functions register themselves), and the ``django.tasks`` runner when a
    TASKS backend is belay's."""
    autodiscover_modules("jobs")
    if uses_tasks_backend():
        import belay_django.tasks  # noqa: F401  (registers its worker kind)


def uses_tasks_backend() -> bool:
    from django.conf import settings

    backends: Any = getattr(settings, "TASKS", None) or {}
    return any(
        isinstance(options, dict) and options.get("BACKEND") == "belay_django.tasks.BelayBackend"
        for options in backends.values()
    )
