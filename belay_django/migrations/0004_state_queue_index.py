"""belay schema revision 4 (belay/sql/migrations/0004_state_queue_index.sql)."""

from __future__ import annotations

from django.db import migrations

from belay_django.operations import ApplyBelayMigration


class Migration(migrations.Migration):
    dependencies = (("belay_django", "0003_contract_major"),)

    operations = (ApplyBelayMigration("0004_state_queue_index.sql"),)
