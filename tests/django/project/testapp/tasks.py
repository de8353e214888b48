"""The test project's django.tasks (Django 6's, or the django-tasks backport's)."""

from __future__ import annotations

from typing import Any

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

from testapp.models import Note


@task
def add(a: int, b: int) -> int:
    Note.objects.create(text=f"{a}+{b}")
    return a + b


@task(queue_name="mailers", priority=50)
def urgent(user_id: int) -> dict[str, Any]:
    return {"sent_to": user_id}


@task(takes_context=True)
def which_attempt(context: Any) -> int:
    return int(context.attempt)


@task
def explode() -> None:
    raise LookupError("nothing here")


class PaymentDeclined(Exception):
    pass


@task
def declined() -> None:
    raise PaymentDeclined("card declined")


@task
async def async_double(x: int) -> int:
    return x * 2
