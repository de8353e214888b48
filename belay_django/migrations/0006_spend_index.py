"""belay schema revision 6 (belay/sql/migrations/0006_spend_index.sql)."""

from __future__ import annotations

from django.db import migrations

from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    dependencies = (("belay_django", "0005_schedules"),)

    operations = (ApplyBelayMigration("0006_spend_index.sql"),)
