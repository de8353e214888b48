"""Unmanaged models over belay's tables, for the admin and for ORM reads.

belay owns these tables (its SQL migrations create them; Django never alters
them) and changes jobs only through its own operations: write through the
belay client (``retry_job``, ``cancel_job``, ``signal_job``…), never with
``save()``, which would race the workers' fenced updates.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from belay.codec import decode_value
from belay.job import STATES, TERMINAL


class TextArrayField(models.Field):
    """A ``text[]`` column, read as a list of str (psycopg converts it).

    Not ``django.contrib.postgres``' ArrayField, which needs that app
    installed; belay writes these columns, Django only reads them."""

    description = "Array of text"

    def db_type(self, connection: Any) -> str:
        return "text[]"


class Job(models.Model):
    """A ``belay_jobs`` row."""

    id = models.BigAutoField(primary_key=True)
    kind = models.TextField()
    queue = models.TextField()
    state = models.TextField(choices=[(state, state) for state in STATES])
    input = models.JSONField(default=dict)
    meta = models.JSONField(default=dict)
    priority = models.IntegerField(default=0)
    attempt = models.IntegerField(default=0)
    max_attempts = models.IntegerField(default=20)
    partition_key = models.TextField(null=True)
    ready_at = models.DateTimeField(null=True)
    lease_until = models.DateTimeField(null=True)
    leased_by = models.TextField(null=True)
    await_scope = models.TextField(null=True)
    await_name = models.TextField(null=True)
    workflow_id = models.TextField(null=True)
    wf_name = models.TextField(null=True)
    wf_deps = TextArrayField(default=list)
    wf_ignore = TextArrayField(default=list)
    cron_name = models.TextField(null=True)
    cron_slot = models.DateTimeField(null=True)
    unique_key = models.TextField(null=True)
    unique_mode = models.TextField(null=True)
    parent_id = models.BigIntegerField(null=True)
    budget_usd_micros = models.BigIntegerField(null=True)
    budget_tokens = models.BigIntegerField(null=True)
    spent_usd_micros = models.BigIntegerField(default=0)
    spent_tokens = models.BigIntegerField(default=0)
    result = models.BinaryField(null=True)
    errors = models.JSONField(default=list)
    cancel_requested = models.BooleanField(default=False)
    inserted_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "belay_jobs"
        ordering = ("-id",)
        verbose_name = "job"

    def __str__(self) -> str:
        return f"job {self.id} ({self.kind}, {self.state})"

    @property
    def decoded_result(self) -> Any:
        """The result envelope decoded (JSON or an Erlang term), or None."""
        return decode_value(None if self.result is None else bytes(self.result))

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class Step(models.Model):
    """A ``belay_steps`` row: one journaled step of a job, with its cost."""

    # The table's key is (job_id, name). Django before 5.2 has no composite
    # keys, so seq stands in: it is unique within a job, and steps are only
    # ever read through their job.
    seq = models.IntegerField(primary_key=True)
    job = models.ForeignKey(Job, models.DO_NOTHING, db_constraint=False, related_name="steps")
    name = models.TextField()
    value = models.BinaryField(null=True)
    usd_micros = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)
    inserted_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "belay_steps"
        ordering = ("job", "seq")

    def __str__(self) -> str:
        return f"step {self.seq} {self.name!r} of job {self.job_id}"

    @property
    def decoded_value(self) -> Any:
        return decode_value(None if self.value is None else bytes(self.value))


class Event(models.Model):
    """A ``belay_events`` row: one entry of a job's event stream."""

    # The table's key is (job_id, seq): as for Step, seq stands in.
    seq = models.IntegerField(primary_key=True)
    job = models.ForeignKey(Job, models.DO_NOTHING, db_constraint=False, related_name="events")
    payload = models.JSONField(null=True)
    inserted_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "belay_events"
        ordering = ("job", "seq")

    def __str__(self) -> str:
        return f"event {self.seq} of job {self.job_id}"
