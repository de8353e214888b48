"""belay schema revision 3 (belay/sql/migrations/0003_contract_major.sql)."""

from __future__ import annotations

from django.db import migrations

from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    dependencies = (("belay_django", "0002_dynamic"),)

    operations = (ApplyBelayMigration("0003_contract_major.sql"),)
