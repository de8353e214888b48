"""``settings.BELAY``: read and checked in one place.

::

    BELAY = {
        "DATABASE": "default",                # the DATABASES alias belay lives in
        "QUEUES": {"default": 10, "mailers": 5},   # what `manage.py belay_worker` serves
        "CRONS": [{"name": "digest", "expression": "0 8 * * *", "worker": "myapp.jobs.digest"}],
        "NOTIFY": True,                       # pg_notify wake-ups (enqueue pokes, LISTEN)
        "POOLER": "transaction",              # the alias goes through PgBouncer (transaction mode)
        "DIRECT_URL": "postgresql://…",       # straight to the server, for LISTEN behind it
        "LEASE_TTL": 30, "POLL_INTERVAL": 0.5, "SHUTDOWN_GRACE": 15, ...
    }

Every problem raises ImproperlyConfigured naming the key and the fix; the
app checks the settings in ``ready()``, so a typo stops the project at startup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from belay.connect import check_pooler
from belay.cron import entries_from_config
from belay.errors import ConfigurationError
from belay.queues import parse_queues
from belay.retention import keep_ok, parse_retention

#: ``BELAY`` keys that are Worker options: the key → the ``belay.Worker`` argument.
WORKER_OPTIONS: dict[str, str] = {
    "LEASE_TTL": "lease_ttl",
    "POLL_INTERVAL": "poll_interval",
    "BUSY_POLL": "busy_poll",
    "SHUTDOWN_GRACE": "shutdown_grace",
    "SWEEP_INTERVAL": "sweep_interval",
    "QUEUE_SYNC_INTERVAL": "queue_sync_interval",
    "CRON_INTERVAL": "cron_interval",
    "RETENTION": "retention",
    "SIGNAL_TTL": "signal_ttl",
}
_SECONDS = ("LEASE_TTL", "POLL_INTERVAL", "BUSY_POLL", "SWEEP_INTERVAL", "QUEUE_SYNC_INTERVAL",
            "CRON_INTERVAL")
KEYS = ("DATABASE", "QUEUES", "CRONS", "NOTIFY", "ENCRYPTION_KEY", "POOLER", "DIRECT_URL",
        *WORKER_OPTIONS)


@dataclass(frozen=True)
class BelaySettings:
    """``settings.BELAY``, checked. ``queues`` and ``crons`` keep the shapes
    ``belay.Worker`` takes; ``worker`` holds the other Worker options given."""

    database: str = "default"
    queues: Mapping[str, Any] = field(default_factory=lambda: {"default": 10})
    crons: tuple[Mapping[str, Any], ...] = ()
    notify: bool = True
    encryption_key: bytes | str | None = None
    worker: Mapping[str, Any] = field(default_factory=dict)
    pooler: str | None = None
    direct_url: str | None = None

    @property
    def connection_options(self) -> dict[str, Any]:
        """What every belay client built from these settings takes."""
        return {"notify": self.notify, "encryption_key": self.encryption_key,
                "pooler": self.pooler, "direct_url": self.direct_url}


def parse(raw: Any, databases: Mapping[str, Any]) -> BelaySettings:
    """Check a ``BELAY`` dict against ``DATABASES``; pure (no I/O)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(
            f"settings.BELAY is a dict like {{'QUEUES': {{'default': 10}}}}, got "
            f"{type(raw).__name__}"
        )
    unknown = sorted(str(key) for key in raw if key not in KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"settings.BELAY has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"the keys are {', '.join(KEYS)}"
        )
    database = raw.get("DATABASE", "default")
    if not isinstance(database, str) or database not in databases:
        known = ", ".join(map(repr, databases)) or "none"
        raise ImproperlyConfigured(
            f"settings.BELAY['DATABASE'] is the alias of a DATABASES entry ({known}), "
            f"got {database!r}"
        )
    queues = raw.get("QUEUES", {"default": 10})
    try:
        parse_queues(queues)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"settings.BELAY['QUEUES']: {exc}") from None
    if not isinstance(queues, Mapping):
        queues = {name: 10 for name in queues}
    crons = raw.get("CRONS", [])
    if crons:
        try:
            entries_from_config(crons)
        except ConfigurationError as exc:
            raise ImproperlyConfigured(f"settings.BELAY['CRONS']: {exc}") from None
    notify = raw.get("NOTIFY", True)
    if not isinstance(notify, bool):
        raise ImproperlyConfigured(f"settings.BELAY['NOTIFY'] is True or False, got {notify!r}")
    key = raw.get("ENCRYPTION_KEY")
    if key is not None and not isinstance(key, (str, bytes)):
        raise ImproperlyConfigured(
            "settings.BELAY['ENCRYPTION_KEY'] is the AES-256 key of encrypted input: 32 "
            "bytes, or their base64 text"
        )
    try:
        pooler = check_pooler(raw.get("POOLER"))
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"settings.BELAY['POOLER']: {exc}") from None
    direct = raw.get("DIRECT_URL")
    if direct is not None and (not isinstance(direct, str) or not direct.strip()):
        raise ImproperlyConfigured(
            "settings.BELAY['DIRECT_URL'] is a PostgreSQL URL that reaches the server "
            f"without the pooler (postgresql://user@host:5432/db), got {direct!r}"
        )
    return BelaySettings(
        pooler=pooler,
        direct_url=direct,
        database=database,
        queues=dict(queues),
        crons=tuple(crons),
        notify=notify,
        encryption_key=key,
        worker=_worker_options(raw),
    )


def _worker_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, argument in WORKER_OPTIONS.items():
        if key not in raw:
            continue
        value = raw[key]
        if key in _SECONDS and not _positive(value):
            raise ImproperlyConfigured(
                f"settings.BELAY[{key!r}] is a number of seconds > 0, got {value!r}"
            )
        if key == "SHUTDOWN_GRACE" and not (_positive(value) or value == 0):
            raise ImproperlyConfigured(
                f"settings.BELAY['SHUTDOWN_GRACE'] is a number of seconds >= 0, got {value!r}"
            )
        if key == "RETENTION":
            if not isinstance(value, Mapping):
                raise ImproperlyConfigured(
                    "settings.BELAY['RETENTION'] is a dict of terminal state → seconds (or "
                    f"None to keep), like {{'succeeded': 86400}}; got {value!r}"
                )
            try:
                parse_retention(value)
            except ConfigurationError as exc:
                raise ImproperlyConfigured(f"settings.BELAY['RETENTION']: {exc}") from None
        if key == "SIGNAL_TTL" and value is not None and not keep_ok(value):
            raise ImproperlyConfigured(
                "settings.BELAY['SIGNAL_TTL'] is seconds > 0 (at most a century), or None "
                f"to keep signals; got {value!r}"
            )
        options[argument] = value
    busy, poll = options.get("busy_poll"), options.get("poll_interval", 0.5)
    if busy is not None and busy > poll:
        raise ImproperlyConfigured(
            "settings.BELAY['BUSY_POLL'] must not exceed POLL_INTERVAL (default 0.5 s)"
        )
    return options


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def get() -> BelaySettings:
    """The project's ``settings.BELAY``, checked (read afresh: tests override settings)."""
    return parse(getattr(settings, "BELAY", None), settings.DATABASES)
