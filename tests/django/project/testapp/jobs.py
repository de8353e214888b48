"""The test project's belay workers (``manage.py belay_worker`` autodiscovers this module)."""

from __future__ import annotations

from typing import Any

import belay
from testapp.models import Note


@belay.worker(queue="default")
def write_note(ctx: belay.Context) -> Any:
    """Writes through the ORM on the executor thread's Django connection."""
    note = Note.objects.create(text=ctx.input["text"], job_id=ctx.id)
    if ctx.input.get("then"):
        # Job code's belay.enqueue() goes through belay's default client: Django's
        # connection of this thread, autocommitting.
        belay.enqueue(write_note, {"text": ctx.input["then"]})
    return {"note": note.pk}


@belay.worker(queue="mailers")
def send_welcome(ctx: belay.Context) -> Any:
    return {"sent_to": ctx.input["user_id"]}
