"""Setting belay up: URLs, the default instance, pools across fork()."""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

import psycopg
import pytest

import belay
from belay import ConfigurationError
from belay.client import normalize_url


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user:pw@localhost:5432/app",
        "postgres://localhost/app",
        "postgresql+psycopg://localhost/app",
        "host=localhost dbname=app",
        "postgresql:///app?host=/var/run/postgresql",
    ],
)
def test_postgres_urls_are_accepted(url):
    assert normalize_url(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "required"),
        ("mysql://localhost/app", "unsupported database URL scheme 'mysql'"),
        ("postgresql+asyncpg://localhost/app", "unsupported"),
        ("host=localhost bogus", "invalid database URL"),
        ("postgresql://localhost/app?nosuchoption=1", "invalid database URL"),
    ],
)
def test_bad_urls_are_refused_with_a_clear_message(url, message):
    with pytest.raises(ConfigurationError, match=message):
        belay.Belay(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:SECRET@[::1/x", 'in URI: "postgresql://u:***@[::1/x"'),
        ("postgresql://u:SECRET%ZZ@localhost/app", 'invalid percent-encoded token: "***"'),
        ("postgresql://u@localhost/app?password=SECRET%ZZ", 'token: "***"'),
    ],
)
def test_a_bad_url_is_refused_without_its_password(url, shown):
    with pytest.raises(ConfigurationError) as info:
        belay.Belay(url)
    assert "SECRET" not in str(info.value)
    assert str(info.value).endswith(shown)


def test_bad_pool_sizes_are_refused():
    with pytest.raises(ConfigurationError, match="pool sizes"):
        belay.Belay("postgresql://localhost/app", min_pool_size=5, max_pool_size=2)


def test_constructing_a_client_does_not_connect():
    # Port 1 refuses connections; construction must not notice.
    client = belay.Belay("postgresql://127.0.0.1:1/nothing")
    client.close()


def test_module_functions_need_configuration(monkeypatch, restore_default):
    monkeypatch.delenv("BELAY_DATABASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match=r"belay\.configure"):
        belay.enqueue("k")


def test_module_functions_use_the_configured_default(db_url, restore_default):
    belay.configure(db_url)
    job = belay.enqueue("myapp.k", {"a": 1}, queue="q")
    assert belay.get_job(job.id) == job
    assert belay.list_jobs(queue="q") == [job]
    assert belay.stats() == {"q": {"ready": 1}}
    assert belay.enqueue_many([{"kind": "b"}])[0].kind == "b"
    assert belay.cancel_job(job.id) == "cancelled"
    assert belay.retry_job(job.id).state == "ready"
    assert belay.signal_job(job.id, "go", {"x": 1}) == []
    assert belay.steer_job(job.id, {"hint": "shorter"}) == []
    assert belay.clear_signal(f"job:{job.id}", "go") is True
    assert belay.signal("wf:x", "go") == []
    assert belay.steps(job.id) == [] and belay.events(job.id) == []
    assert belay.workflow_status("none").jobs == []
    assert belay.check_schema().revision >= 3
    assert belay.migrate() == []


def test_default_instance_from_the_environment(db_url, monkeypatch, restore_default):
    monkeypatch.setenv("BELAY_DATABASE_URL", db_url)
    assert belay.enqueue("k").kind == "k"


def test_configure_replaces_and_closes_the_previous_default(db_url, restore_default):
    first = belay.configure(db_url)
    first.enqueue("k")
    assert first._pool is not None
    second = belay.configure(db_url)
    assert first._pool is None and second is belay.default()


def test_client_refuses_a_database_without_schema(empty_db_url):
    with belay.Belay(empty_db_url) as client, pytest.raises(
        belay.SchemaMissing, match="belay migrate"
    ):
        client.enqueue("k")


def _enqueue_in_child(client: belay.Belay, queue: Any) -> None:
    try:
        queue.put(client.enqueue("from-child").id)
    except BaseException as exc:  # report, don't hang the parent
        queue.put(repr(exc))
    finally:
        client.close()


@pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX")
def test_a_forked_child_opens_its_own_pool(client, sql_conn):
    """A pool must never cross fork(): the child must not use the parent's sockets."""
    parent_job = client.enqueue("from-parent")  # the parent's pool is open now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_enqueue_in_child, args=(client, queue))
    with pytest.warns(DeprecationWarning) if sys.version_info >= (3, 12) else _nothing():
        child.start()
    child_result = queue.get(timeout=30)
    child.join(30)
    assert isinstance(child_result, int), child_result
    assert child.exitcode == 0
    # The parent's pool still works after the child exited.
    assert client.get_job(parent_job.id) is not None
    assert client.get_job(child_result) is not None
    rows = sql_conn.execute("SELECT kind FROM belay_jobs ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["from-parent", "from-child"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_reads_and_writes_on_an_autocommit_caller_connection(client, db_url):
    with psycopg.connect(db_url, autocommit=True) as conn:
        job = client.enqueue("k", conn=conn)
        assert client.get_job(job.id, conn=conn) == job


def test_an_unreachable_server_fails_fast_with_the_real_error():
    with belay.Belay("postgresql://127.0.0.1:1/nothing") as client, pytest.raises(
        psycopg.OperationalError, match="refused"
    ):
        client.get_job(1)


def test_set_default_installs_an_instance_and_can_be_conditional(db_url, restore_default):
    mine, theirs, other = (belay.Belay(db_url) for _ in range(3))
    try:
        assert belay.set_default(mine, expected=None) is True      # none yet: set
        assert belay.default() is mine
        assert belay.set_default(theirs, expected=None) is False   # one is set: kept
        assert belay.set_default(theirs, expected=other) is False  # not that one: kept
        assert belay.default() is mine
        assert belay.set_default(theirs, expected=mine) is True    # swap ours for ours
        assert belay.set_default(other) is True                    # unconditional
        assert belay.default() is other
    finally:
        mine.close()
        theirs.close()
