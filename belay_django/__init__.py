"""Django adapter for belay.

Add ``"belay_django"`` to INSTALLED_APPS: ``belay.enqueue()`` then runs on
Django's connection, inside ``transaction.atomic``; ``manage.py migrate``
creates belay's tables from the same SQL files as ``belay migrate``;
``manage.py belay_worker`` runs the workers of every app's ``jobs.py``; the
admin shows jobs; ``belay_django.tasks.BelayBackend`` serves ``django.tasks``.
See docs/django.md.
"""

from __future__ import annotations

from belay_django.adapter import DjangoBelay, client

__all__ = ["DjangoBelay", "client"]
