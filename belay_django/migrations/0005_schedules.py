"""belay schema revision 5 (belay/sql/migrations/0005_schedules.sql)."""

from __future__ import annotations

from django.db import migrations

from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    dependencies = (("belay_django", "0004_state_queue_index"),)

    operations = (ApplyBelayMigration("0005_schedules.sql"),)
