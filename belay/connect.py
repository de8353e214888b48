"""How belay opens its own connections: straight to PostgreSQL, or through a
transaction-pooling pooler (PgBouncer ``pool_mode = transaction``, managed
poolers in that mode).

A transaction pooler hands each transaction to whichever server connection is
free, so nothing may outlive a transaction: no server-side prepared statements
(psycopg prepares a query after five runs, under a name the next client of
that server connection collides with), no session settings, no session
advisory locks, no LISTEN. With ``pooler="transaction"`` belay keeps to that,
and LISTENs on ``direct_url`` when one is given (else it polls).

A pooler that tracks prepared statements itself (PgBouncer 1.21 and later with
``max_prepared_statements`` above 0) gives them back: with
``pooler="transaction-prepared"`` belay keeps to everything above but lets
psycopg prepare its repeated statements, which the pooler re-prepares on
whichever server connection a transaction lands on.
"""

from __future__ import annotations

import os
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool

from belay.errors import ConfigurationError, PoolerError

#: The pooler modes belay adapts to (session poolers need nothing): a
#: transaction pooler, and one that tracks prepared statements across its
#: server connections (PgBouncer >= 1.21, max_prepared_statements > 0).
TRANSACTION: Final = "transaction"
TRANSACTION_PREPARED: Final = "transaction-prepared"
POOLERS: Final = (TRANSACTION, TRANSACTION_PREPARED)

#: Environment variables read when the setting is not given.
POOLER_ENV: Final = "BELAY_POOLER"
DIRECT_URL_ENV: Final = "BELAY_DIRECT_URL"

#: How to set it, quoted in every message that asks for it.
SETTING_HINT: Final = (
    'pooler="transaction" (belay.configure(url, pooler="transaction"), '
    "belay.Belay(url, pooler=...), `belay worker --pooler transaction`, "
    'BELAY_POOLER=transaction, or Django\'s BELAY = {"POOLER": "transaction"})'
)


def check_pooler(value: Any) -> str | None:
    """The pooler setting, checked: None (direct or a session pooler),
    "transaction" or "transaction-prepared"."""
    if value is None or value in ("", "none", "session"):
        return None
    if value in POOLERS:
        return str(value)
    raise ConfigurationError(
        f"pooler must be None (a direct connection or a session pooler), "
        f"'transaction' (PgBouncer pool_mode=transaction and other transaction poolers) "
        f"or 'transaction-prepared' (the same, with PgBouncer >= 1.21 tracking prepared "
        f"statements: max_prepared_statements > 0); got {value!r}"
    )


def prepares(pooler: str | None) -> bool:
    """Whether psycopg may prepare statements server-side in this pooler mode."""
    return pooler != TRANSACTION


def pooler_setting(value: Any = None) -> str | None:
    """``value``, else ``BELAY_POOLER``, checked."""
    if value is None:
        value = os.environ.get(POOLER_ENV) or None
    return check_pooler(value)


def direct_url_setting(value: str | None = None) -> str | None:
    """``value``, else ``BELAY_DIRECT_URL``."""
    return value or os.environ.get(DIRECT_URL_ENV) or None


def options(pooler: str | None) -> dict[str, Any]:
    """psycopg connection options for the pooler mode."""
    # prepare_threshold=None: never prepare server-side (the statements stay
    # parameterized; only the plan cache on the server connection goes).
    return {} if prepares(pooler) else {"prepare_threshold": None}


def connect(conninfo: str, pooler: str | None, **kwargs: Any) -> psycopg.Connection[Any]:
    """One connection of belay's own."""
    return psycopg.connect(conninfo, **options(pooler), **kwargs)


def pool(conninfo: str, pooler: str | None, *, min_size: int, max_size: int, name: str,
         open: bool, kwargs: dict[str, Any] | None = None) -> ConnectionPool[Any]:
    """A connection pool of belay's own (autocommit connections)."""
    return ConnectionPool(
        conninfo, min_size=min_size, max_size=max_size, name=name, open=open,
        kwargs={"autocommit": True, **options(pooler), **(kwargs or {})},
    )


#: What PostgreSQL says when two clients share one server connection's
#: prepared statements: the sign of a transaction pooler belay was not told about.
_PREPARED_CLASH = (pg_errors.DuplicatePreparedStatement, pg_errors.InvalidSqlStatementName)


def pooler_error(exc: BaseException) -> PoolerError | None:
    """The error to raise instead of ``exc`` when ``exc`` is a transaction
    pooler's mark on a connection set up for a direct one; None otherwise."""
    if not isinstance(exc, _PREPARED_CLASH):
        return None
    return PoolerError(
        f"{str(exc).strip()}: this connection goes through a transaction-pooling "
        f"pooler (e.g. PgBouncer with pool_mode=transaction), which shares server "
        f"connections and their prepared statements between clients; set "
        f"{SETTING_HINT}. (pooler=\"transaction-prepared\" is only for a pooler that "
        f"tracks prepared statements, PgBouncer >= 1.21 with max_prepared_statements > 0; "
        f"with it set, this error means the pooler does not: use \"transaction\")"
    )
