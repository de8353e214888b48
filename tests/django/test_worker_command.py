"""``manage.py belay_worker``: a real worker process in the test project, and
the Django hygiene of the worker it runs."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from testapp.models import Note

import belay
from belay_django.worker import discover, django_worker
from tests.django.conftest import PROJECT
from tests.helpers import wait_until


def manage(url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "BELAY_DJANGO_TEST_DATABASE": url, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(PROJECT / "manage.py"), *args], env=env, cwd=PROJECT,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def django_backends(url: str) -> int:
    """Connections Django opened (the test project names them belay-test-django)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'belay-test-django'").fetchone()
    assert row is not None
    return int(row[0])


def test_the_worker_command_runs_a_job_that_writes_through_the_orm(dj):
    with transaction.atomic():
        job = belay.enqueue("testapp.jobs.write_note", {"text": "hello", "then": "chained"})
    worker = manage(dj, "belay_worker", "--queue", "default=2", "--poll-interval", "0.1")
    try:
        assert belay.await_result(job.id, timeout=60) == {
            "note": Note.objects.get(job_id=job.id).pk}
        # The job's own belay.enqueue() committed a second job; it runs too.
        chained = Note.objects.get(text="hello").pk
        wait_until(lambda: Note.objects.filter(text="chained").exists(), "the chained job ran",
                   timeout=30)
        assert Note.objects.get(text="chained").pk > chained
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert "queues default;" in out and "testapp.jobs.write_note" in out
    assert "stopped" in out


def test_the_worker_command_refuses_an_old_schema_with_what_to_run(dj):
    with psycopg.connect(dj, autocommit=True) as conn:
        conn.execute("DELETE FROM belay_meta WHERE version >= 3")
    worker = manage(dj, "belay_worker")
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 1
    assert "CommandError: belay's schema in database 'default' is out of date" in err
    assert "manage.py migrate belay_django" in err


def test_the_worker_command_refuses_bad_options(dj):
    with pytest.raises(CommandError, match="--queue 'default=x'"):
        call_command("belay_worker", "--queue", "default=x", stdout=io.StringIO())
    with pytest.raises(CommandError, match="busy_poll must not exceed poll_interval"):
        call_command("belay_worker", "--busy-poll", "2", stdout=io.StringIO())


def test_job_code_leaves_no_django_connection_open(dj):
    """Jobs use the ORM on the executor threads; with CONN_MAX_AGE = 0 each
    job's connection is closed when it ends, as a request's would be."""
    discover()
    worker = django_worker({"default": 3}, client=belay.Belay(dj), notify=True,
                          poll_interval=0.05, busy_poll=0.01)
    with worker:
        jobs = [belay.enqueue("testapp.jobs.write_note", {"text": str(n)}) for n in range(9)]
        for job in jobs:
            belay.await_result(job.id, timeout=30)
        connections.close_all()  # this thread's own
        wait_until(lambda: django_backends(dj) == 0, "the job threads closed Django's connections")
    worker.client.close()
    assert Note.objects.count() == 9


def test_draining_inside_a_callers_atomic_block_keeps_its_transaction(dj):
    """drain() runs jobs in the calling thread: the hygiene must not close a
    connection that is inside the caller's transaction."""
    discover()
    client = belay.Belay(dj)
    try:
        belay.enqueue("testapp.jobs.write_note", {"text": "queued"})
        with transaction.atomic():
            Note.objects.create(text="mine")
            assert django_worker({"default": 1}, client=client).drain() == {"succeeded": 1}
            assert Note.objects.filter(text="mine").exists()  # still our transaction
    finally:
        client.close()
    assert sorted(Note.objects.values_list("text", flat=True)) == ["mine", "queued"]


def test_the_worker_takes_settings_belay_and_the_command_lines_overrides(dj):
    from belay_django import conf
    from belay_django.worker import build

    settings = conf.parse({
        "QUEUES": {"default": 3, "ai": {"limit": 2, "global_limit": 4}},
        "CRONS": [{"name": "digest", "expression": "0 8 * * *",
                   "worker": "testapp.jobs.send_welcome", "input": {"user_id": 1}}],
        "NOTIFY": False, "LEASE_TTL": 12, "POLL_INTERVAL": 2, "SHUTDOWN_GRACE": 3,
    }, {"default": {}})
    worker = build(settings)
    try:
        assert {name: spec.limit for name, spec in worker.queues.items()} == {
            "default": 3, "ai": 2}
        assert worker.queues["ai"].global_limit == 4
        assert [entry.name for entry in worker.cron.entries] == ["digest"]
        assert (worker.notify, worker.lease_ttl, worker.poll_interval,
                worker.shutdown_grace) == (False, 12, 2, 3)
        assert worker.client.connection_provider is None  # its own pool, never Django's
        assert worker.client.conninfo == belay.default().conninfo
    finally:
        worker.client.close()
    overridden = build(settings, queues={"mailers": 1}, notify=True, node_id="n1",
                       lease_ttl=6, poll_interval=None)
    try:
        assert list(overridden.queues) == ["mailers"]
        assert (overridden.notify, overridden.node_id, overridden.lease_ttl,
                overridden.poll_interval) == (True, "n1", 6, 2)
    finally:
        overridden.client.close()
