"""The system checks: settings.BELAY, and belay's schema (database checks).

An unusable schema that ``migrate`` can't fix is an error saying what to run;
one the pending belay_django migrations will fix is a warning, so ``migrate``
itself (which runs the database checks first) still runs.
"""

from __future__ import annotations

import io

import psycopg
import pytest
from django.core.checks import Error, run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.test import override_settings

from belay_django import conf


def belay_messages(databases=("default",)):
    return [m for m in run_checks(databases=list(databases)) if m.id.startswith("belay_django")]


def sql(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)


def test_a_healthy_project_has_no_belay_messages(dj):
    assert belay_messages() == []


def test_an_old_schema_fails_the_check_with_what_to_run(dj):
    sql(dj, "DELETE FROM belay_meta WHERE version >= 3")  # e.g. restored from an older dump
    [message] = belay_messages()
    assert isinstance(message, Error) and message.id == "belay_django.E010"
    assert "belay's schema in database 'default' is out of date" in message.msg
    assert "schema revision 2" in message.msg and "belay needs revision >= 3" in message.msg
    assert "manage.py migrate belay_django zero --fake" in message.hint
    with pytest.raises(SystemCheckError) as caught:
        call_command("check", databases=["default"], stdout=io.StringIO())
    assert "belay_django.E010" in str(caught.value)


def test_the_hint_of_an_old_schema_fixes_it(dj):
    sql(dj, "DELETE FROM belay_meta WHERE version >= 3")
    out = io.StringIO()
    call_command("migrate", "belay_django", "zero", "--fake", stdout=out, skip_checks=True)
    call_command("migrate", "belay_django", stdout=out)
    connections.close_all()
    assert belay_messages() == []


def test_a_missing_schema_with_migrations_recorded_is_an_error(dj):
    sql(dj, "DROP TABLE belay_meta")
    [message] = belay_messages()
    assert message.id == "belay_django.E010"
    assert "is missing (no belay_meta table)" in message.msg


def test_a_schema_migrate_is_about_to_build_is_no_problem(empty_db_url, on_database):
    """migrate runs the database checks before it migrates: a fresh database, or
    one with belay_django migrations left to apply, must not stop it."""
    on_database(empty_db_url)
    assert belay_messages() == []  # nothing migrated yet
    call_command("migrate", "belay_django", "0002", stdout=io.StringIO())
    assert belay_messages() == []  # revision 2; 0003 pending
    call_command("migrate", stdout=io.StringIO())
    connections.close_all()
    assert belay_messages() == []


def test_the_worker_names_the_pending_migrations(empty_db_url, on_database):
    from belay import schema
    from belay_django.checks import pending_migrations, schema_message

    on_database(empty_db_url)
    call_command("migrate", "belay_django", "0002", stdout=io.StringIO())
    with psycopg.connect(empty_db_url) as conn:
        status = schema.read_status(conn)
    assert status.problem is not None
    message = schema_message("default", status, status.problem, pending_migrations("default"))
    assert message.id == "belay_django.E013"
    assert "schema revision 2" in message.msg and "0003_contract_major" in message.msg
    assert message.hint == "run `python manage.py migrate`"


def test_another_contract_major_is_an_error_migrate_cannot_fix(dj):
    sql(dj, "UPDATE belay_meta SET contract_major = 2")
    [message] = belay_messages()
    assert message.id == "belay_django.E012"
    assert "speaks wire-contract major 2" in message.msg


def test_database_checks_only_run_when_asked_for_that_database(dj):
    sql(dj, "DROP TABLE belay_meta")
    assert belay_messages(databases=()) == []
    assert [m.id for m in belay_messages(databases=("default",))] == ["belay_django.E010"]


def test_a_non_postgresql_belay_database_is_an_error(dj):
    with override_settings(BELAY={"DATABASE": "other"}):
        [message] = belay_messages(databases=())
    assert message.id == "belay_django.E002"
    assert "belay needs PostgreSQL" in message.msg and "sqlite3" in message.msg


def test_bad_settings_are_an_error_naming_the_key(dj):
    with override_settings(BELAY={"QUEUE": {"default": 1}}):
        [message] = belay_messages(databases=())
    assert message.id == "belay_django.E001"
    assert "unknown key(s) 'QUEUE'" in message.msg and "QUEUES" in message.msg


# -- settings.BELAY, parsed (pure) --------------------------------------------------------

DATABASES = {"default": {}, "replica": {}}


def test_defaults():
    parsed = conf.parse(None, DATABASES)
    assert parsed == conf.BelaySettings()
    assert parsed.queues == {"default": 10} and parsed.notify is True


def test_every_key_is_read():
    parsed = conf.parse({
        "DATABASE": "replica", "QUEUES": ["a", "b"], "NOTIFY": False,
        "CRONS": [{"name": "n", "expression": "* * * * *", "worker": "k"}],
        "LEASE_TTL": 10, "POLL_INTERVAL": 1, "BUSY_POLL": 0.01, "SHUTDOWN_GRACE": 0,
        "RETENTION": {"succeeded": 60}, "SIGNAL_TTL": None, "ENCRYPTION_KEY": "k" * 44,
    }, DATABASES)
    assert parsed.database == "replica"
    assert parsed.queues == {"a": 10, "b": 10}
    assert parsed.notify is False and len(parsed.crons) == 1
    assert parsed.worker == {"lease_ttl": 10, "poll_interval": 1, "busy_poll": 0.01,
                             "shutdown_grace": 0, "retention": {"succeeded": 60},
                             "signal_ttl": None}


@pytest.mark.parametrize(("raw", "says"), [
    ([], "settings.BELAY is a dict"),
    ({"DATABASE": "nope"}, "alias of a DATABASES entry ('default', 'replica'), got 'nope'"),
    ({"QUEUES": {"q": 0}}, "settings.BELAY['QUEUES']"),
    ({"QUEUES": "default"}, "settings.BELAY['QUEUES']"),
    ({"NOTIFY": "yes"}, "settings.BELAY['NOTIFY'] is True or False"),
    ({"CRONS": [{"name": "x"}]}, "settings.BELAY['CRONS']: cron 'x' is missing expression"),
    ({"LEASE_TTL": 0}, "settings.BELAY['LEASE_TTL'] is a number of seconds > 0"),
    ({"SHUTDOWN_GRACE": -1}, "SHUTDOWN_GRACE'] is a number of seconds >= 0"),
    ({"BUSY_POLL": 2}, "BUSY_POLL'] must not exceed POLL_INTERVAL"),
    ({"RETENTION": {"ready": 1}}, "settings.BELAY['RETENTION']: retention is per terminal"),
    ({"SIGNAL_TTL": -5}, "settings.BELAY['SIGNAL_TTL'] is seconds > 0"),
    ({"ENCRYPTION_KEY": 5}, "settings.BELAY['ENCRYPTION_KEY'] is the AES-256 key"),
])
def test_mistakes_name_the_key_and_the_fix(raw, says):
    with pytest.raises(ImproperlyConfigured) as caught:
        conf.parse(raw, DATABASES)
    assert says in str(caught.value)
