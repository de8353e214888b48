"""The ``belay`` command line (``python -m belay``), run as a real subprocess against
a real database: ``migrate`` and ``check`` (contract §1) and their exit codes —
0 success, 1 the database is unusable, 2 bad usage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlencode

import psycopg
import pytest

import belay.sql


def run_cli(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m belay …``; BELAY_DATABASE_URL is set only when ``env_url`` is."""
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    if env_url is not None:
        env["BELAY_DATABASE_URL"] = env_url
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "belay", *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )


def as_uri(conninfo: str) -> str:
    """The same database as a ``postgresql://`` URL with host and port as query
    parameters — the shape the embedded server hands out for a unix socket
    (``postgresql://postgres:@/db?host=/tmp/…``) — whatever form ``conninfo`` has."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    user = quote(str(params.pop("user", "")), safe="")
    password = params.pop("password", None)
    dbname = quote(str(params.pop("dbname")), safe="")
    auth = f"{user}:{quote(str(password), safe='')}" if password else f"{user}:"
    query = urlencode({k: str(v) for k, v in params.items()}, safe="/")
    return f"postgresql://{auth}@/{dbname}?{query}"


URL_FORMS = [pytest.param(lambda u: u, id="conninfo"), pytest.param(as_uri, id="uri")]


def meta_versions(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM belay_meta ORDER BY version")]


# -- migrate ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", URL_FORMS)
def test_migrate_on_empty_database_then_again(
    empty_db_url: str, form: Callable[[str], str]
) -> None:
    url = form(empty_db_url)
    first = run_cli("migrate", "--url", url)
    assert first.returncode == 0, first.stderr
    assert "applied migration(s) 1, 2, 3, 4" in first.stdout
    assert "schema revision 6, contract major 1" in first.stdout
    assert first.stderr == ""
    assert meta_versions(empty_db_url) == [1, 2, 3, 4, 5, 6]

    second = run_cli("migrate", "--url", url)
    assert second.returncode == 0, second.stderr
    assert "already up to date" in second.stdout
    assert "applied" not in second.stdout
    assert second.stderr == ""
    assert meta_versions(empty_db_url) == [1, 2, 3, 4, 5, 6]


def test_migrate_upgrades_a_reference_revision_2_database(empty_db_url: str) -> None:
    """Only the missing revision is applied to a database the Elixir reference built."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE belay_meta (version int NOT NULL)")
        for migration in belay.sql.migrations()[:2]:
            conn.execute(migration.sql)
            conn.execute("INSERT INTO belay_meta (version) VALUES (%s)", (migration.revision,))
    before = run_cli("check", "--url", empty_db_url)
    assert before.returncode == 1
    assert "revision 2" in before.stderr
    assert "belay migrate" in before.stderr

    result = run_cli("migrate", "--url", empty_db_url)
    assert result.returncode == 0, result.stderr
    assert "applied migration(s) 3, 4, 5, 6;" in result.stdout
    assert meta_versions(empty_db_url) == [1, 2, 3, 4, 5, 6]


def test_migrate_refuses_a_newer_contract_major(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO belay_meta (version, contract_major) VALUES (4, 2)")
    result = run_cli("migrate", "--url", db_url)
    assert result.returncode == 1
    assert "major 2" in result.stderr
    assert result.stdout == ""


# -- check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("form", URL_FORMS)
def test_check_on_migrated_database_reports_revision_and_major(
    db_url: str, form: Callable[[str], str]
) -> None:
    result = run_cli("check", "--url", form(db_url))
    assert result.returncode == 0, result.stderr
    assert "schema revision 6, contract major 1" in result.stdout
    assert result.stderr == ""


def test_check_on_empty_database_says_to_run_migrate(empty_db_url: str) -> None:
    result = run_cli("check", "--url", empty_db_url)
    assert result.returncode == 1
    assert "belay migrate" in result.stderr
    assert result.stdout == ""
    # check never creates anything.
    with psycopg.connect(empty_db_url) as conn:
        assert conn.execute("SELECT to_regclass('belay_meta')").fetchone() == (None,)


def test_check_refuses_a_newer_contract_major(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE belay_meta SET contract_major = 2")
    result = run_cli("check", "--url", db_url)
    assert result.returncode == 1
    assert "major 2" in result.stderr


def test_check_accepts_a_newer_revision_within_major_1(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO belay_meta (version, contract_major) VALUES (5, 1)")
    result = run_cli("check", "--url", db_url)
    assert result.returncode == 0, result.stderr
    assert "schema revision 6, contract major 1" in result.stdout


# -- URLs and the environment -------------------------------------------------------------------


def test_database_url_comes_from_the_environment_without_url(empty_db_url: str) -> None:
    migrated = run_cli("migrate", env_url=empty_db_url)
    assert migrated.returncode == 0, migrated.stderr
    assert "applied migration(s) 1, 2, 3, 4" in migrated.stdout
    assert meta_versions(empty_db_url) == [1, 2, 3, 4, 5, 6]
    checked = run_cli("check", env_url=as_uri(empty_db_url))
    assert checked.returncode == 0, checked.stderr
    assert "schema revision 6" in checked.stdout


def test_url_option_wins_over_the_environment(db_url: str, empty_db_url: str) -> None:
    result = run_cli("check", "--url", db_url, env_url=empty_db_url)
    assert result.returncode == 0, result.stderr
    assert "schema revision 6" in result.stdout


@pytest.mark.parametrize("env_url", [None, ""], ids=["unset", "empty"])
@pytest.mark.parametrize("command", ["migrate", "check"])
def test_no_url_and_no_environment_is_a_usage_error(command: str, env_url: str | None) -> None:
    result = run_cli(command, env_url=env_url)
    assert result.returncode == 2
    assert "BELAY_DATABASE_URL" in result.stderr


@pytest.mark.parametrize("command", ["migrate", "check"])
@pytest.mark.parametrize("url", ["mysql://root@127.0.0.1/app", "http://127.0.0.1:5432/x"])
def test_bad_url_scheme_is_a_usage_error(command: str, url: str) -> None:
    result = run_cli(command, "--url", url)
    assert result.returncode == 2
    assert "scheme" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["migrate", "check"])
def test_unreachable_server_exits_1_with_cannot_connect(command: str) -> None:
    result = run_cli(command, "--url", "postgresql://postgres@127.0.0.1:1/postgres")
    assert result.returncode == 1
    assert "cannot connect" in result.stderr
    assert result.stdout == ""


def test_installed_console_script_runs_the_same_cli(db_url: str) -> None:
    """The ``belay`` entry point of pyproject.toml, next to this interpreter."""
    script = Path(sys.executable).with_name("belay")
    if not script.exists():
        pytest.skip(f"no console script at {script} (belay not installed in this environment)")
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    result = subprocess.run(
        [str(script), "check", "--url", db_url],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "schema revision 6, contract major 1" in result.stdout


def test_no_command_is_a_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage" in result.stderr.lower()
