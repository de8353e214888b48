"""belay schema revision 2 (belay/sql/migrations/0002_dynamic.sql)."""

from __future__ import annotations

from django.db import migrations

from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    dependencies = (("belay_django", "0001_initial"),)

    operations = (ApplyBelayMigration("0002_dynamic.sql"),)
