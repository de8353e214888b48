from __future__ import annotations

from django.db import models


class Note(models.Model):
    """What the test jobs write through the ORM."""

    text = models.TextField()
    job_id = models.BigIntegerField(null=True)
