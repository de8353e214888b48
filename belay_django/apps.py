"""The ``belay_django`` app: checks the settings and wires belay to Django at startup."""

from __future__ import annotations

from django.apps import AppConfig
from django.db import connections

from belay.client import register_connection_adapter


class BelayConfig(AppConfig):
    name = "belay_django"
    label = "belay_django"
    verbose_name = "belay"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from belay_django import checks, conf
        from belay_django.adapter import adapt, install

        checks.register()
        settings = conf.get()  # a mistake in settings.BELAY stops the project here
        register_connection_adapter(adapt)
        # No database access here (Django's rule for ready()): the client only
        # builds a connection string. A non-PostgreSQL alias gets no client;
        # the system check says what to change.
        if connections[settings.database].vendor == "postgresql":
            install()
