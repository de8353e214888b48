"""One classification of database failures for every surface that reports
them (belay.errors.database_failure): each class raised for real, by psycopg
against the test server, not built by hand."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg_pool
import pytest

from belay.errors import INVALID, REFUSED, UNAVAILABLE, database_failure


def _raised(call: Any) -> BaseException:
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def test_each_database_failure_is_classed(db_url: str, sql_conn: psycopg.Connection[Any]
                                          ) -> None:
    nul = _raised(lambda: sql_conn.execute("SELECT %s::text", ("a\x00b",)))
    out_of_range = _raised(lambda: sql_conn.execute("SELECT 2147483648::int4"))
    missing = _raised(lambda: sql_conn.execute("SELECT * FROM belay_no_such_table"))
    sql_conn.execute("CREATE TEMP TABLE once (id int PRIMARY KEY)")
    duplicate = _raised(lambda: sql_conn.execute("INSERT INTO once VALUES (1), (1)"))
    refused_port = _raised(lambda: psycopg.connect("postgresql://postgres@127.0.0.1:1/x",
                                                   connect_timeout=2))
    cancelled = _raised(lambda: sql_conn.execute(
        "SET statement_timeout = 50; SELECT pg_sleep(5)"))
    sql_conn.execute("RESET statement_timeout")
    with psycopg_pool.ConnectionPool(db_url, min_size=1, max_size=1, open=True) as pool, \
            pool.connection():
        exhausted = _raised(lambda: pool.getconn(timeout=0.1))
    with psycopg.connect(db_url) as conn:
        cursor = conn.cursor()
        cursor.close()
        closed = _raised(lambda: cursor.execute("SELECT 1"))
    assert {
        "nul": database_failure(nul), "out_of_range": database_failure(out_of_range),
        "missing": database_failure(missing), "duplicate": database_failure(duplicate),
        "refused_port": database_failure(refused_port),
        "cancelled": database_failure(cancelled), "exhausted": database_failure(exhausted),
        "closed": database_failure(closed), "not_a_database_error":
            database_failure(ValueError("x")),
    } == {
        "nul": INVALID, "out_of_range": INVALID, "missing": REFUSED, "duplicate": REFUSED,
        "refused_port": UNAVAILABLE, "cancelled": UNAVAILABLE, "exhausted": UNAVAILABLE,
        "closed": UNAVAILABLE, "not_a_database_error": None,
    }
    assert isinstance(closed, psycopg.InterfaceError)
    assert isinstance(exhausted, psycopg_pool.PoolTimeout)
