"""SQLAlchemy adapter for belay: enqueue in a Session's transaction.

Importing it lets every belay call take a SQLAlchemy ``Session`` (or a
``scoped_session``, or a ``Connection``) as ``conn=`` — ``session=`` reads
better for ``enqueue`` — on a ``postgresql+psycopg`` engine::

    import belay, belay_sqlalchemy

    belay_sqlalchemy.install(Session)   # a Session class, sessionmaker or scoped_session
    with Session(engine) as session, session.begin():
        session.add(order)
        belay.enqueue(charge_card, {"order_id": order.id}, session=session)

``install`` adds session hooks that hold the worker wake-ups until the commit
and drop them on rollback; ``belay_sqlalchemy.alembic.upgrade(op)`` runs belay's
migrations from an Alembic revision; :func:`check_schema` checks the schema at
startup. See docs/sqlalchemy.md.
"""

from __future__ import annotations

from belay.aio.driver import register_connection_adapter as register_async_adapter
from belay.client import register_connection_adapter
from belay_sqlalchemy.connection import (
    SUPPORTED_DIALECT,
    async_borrow,
    borrow,
    check_schema,
    psycopg_connection,
)
from belay_sqlalchemy.hooks import install, pending_wakeups, uninstall

register_connection_adapter(borrow)
register_async_adapter(async_borrow)

__all__ = [
    "SUPPORTED_DIALECT",
    "borrow",
    "check_schema",
    "install",
    "pending_wakeups",
    "psycopg_connection",
    "uninstall",
]
