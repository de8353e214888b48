"""belay schema revision 1 (belay/sql/migrations/0001_initial.sql), and the
unmanaged models over its tables (state only: no DDL of Django's)."""

from __future__ import annotations

from django.db import migrations, models

from belay_django.models import TextArrayField
from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    initial = True

    dependencies = ()

    operations = (
        ApplyBelayMigration("0001_initial.sql"),
        migrations.CreateModel(
            name="Event",
            fields=[
                ("seq", models.IntegerField(primary_key=True, serialize=False)),
                ("payload", models.JSONField(null=True)),
                ("inserted_at", models.DateTimeField(null=True)),
            ],
            options={
                "db_table": "belay_events",
                "ordering": ("job", "seq"),
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="Job",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("kind", models.TextField()),
                ("queue", models.TextField()),
                ("state", models.TextField(choices=[
                    ("ready", "ready"), ("running", "running"), ("awaiting", "awaiting"),
                    ("held", "held"), ("paused", "paused"), ("succeeded", "succeeded"),
                    ("failed", "failed"), ("cancelled", "cancelled"),
                ])),
                ("input", models.JSONField(default=dict)),
                ("meta", models.JSONField(default=dict)),
                ("priority", models.IntegerField(default=0)),
                ("attempt", models.IntegerField(default=0)),
                ("max_attempts", models.IntegerField(default=20)),
                ("partition_key", models.TextField(null=True)),
                ("ready_at", models.DateTimeField(null=True)),
                ("lease_until", models.DateTimeField(null=True)),
                ("leased_by", models.TextField(null=True)),
                ("await_scope", models.TextField(null=True)),
                ("await_name", models.TextField(null=True)),
                ("workflow_id", models.TextField(null=True)),
                ("wf_name", models.TextField(null=True)),
                ("wf_deps", TextArrayField(default=list)),
                ("wf_ignore", TextArrayField(default=list)),
                ("cron_name", models.TextField(null=True)),
                ("cron_slot", models.DateTimeField(null=True)),
                ("unique_key", models.TextField(null=True)),
                ("unique_mode", models.TextField(null=True)),
                ("parent_id", models.BigIntegerField(null=True)),
                ("budget_usd_micros", models.BigIntegerField(null=True)),
                ("budget_tokens", models.BigIntegerField(null=True)),
                ("spent_usd_micros", models.BigIntegerField(default=0)),
                ("spent_tokens", models.BigIntegerField(default=0)),
                ("result", models.BinaryField(null=True)),
                ("errors", models.JSONField(default=list)),
                ("cancel_requested", models.BooleanField(default=False)),
                ("inserted_at", models.DateTimeField()),
                ("started_at", models.DateTimeField(null=True)),
                ("finished_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "job",
                "db_table": "belay_jobs",
                "ordering": ("-id",),
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="Step",
            fields=[
                ("seq", models.IntegerField(primary_key=True, serialize=False)),
                ("name", models.TextField()),
                ("value", models.BinaryField(null=True)),
                ("usd_micros", models.BigIntegerField(default=0)),
                ("tokens", models.BigIntegerField(default=0)),
                ("inserted_at", models.DateTimeField(null=True)),
            ],
            options={
                "db_table": "belay_steps",
                "ordering": ("job", "seq"),
                "managed": False,
            },
        ),
        )
