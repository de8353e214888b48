"""The asyncio side of the storage boundary: :func:`run` drives a
:mod:`belay.plans` operation on a psycopg ``AsyncConnection``, and
:func:`borrow` turns what a caller passes as ``conn=`` into one."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from belay import plans
from belay.codec import loads
from belay.connect import pooler_error
from belay.errors import ValidationError
from belay.sql import QUERIES

T = TypeVar("T")
AConn = psycopg.AsyncConnection[Any]


async def run(conn: AConn, plan: plans.Plan[T]) -> T:
    """Drive ``plan`` on ``conn``: each statement it yields runs here, and its
    answer goes back in (:func:`belay.store.run` is the blocking twin)."""
    try:
        call = next(plan)
        while True:
            call = plan.send(await _answer(conn, call))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _answer(conn: AConn, call: plans.Call) -> Any:
    try:
        if call.shape == plans.ROWS:
            async with conn.cursor(row_factory=dict_row) as cur:
                set_json_loads(loads, cur)
                await cur.execute(QUERIES[call.query], call.params)
                return await cur.fetchall()
        async with conn.cursor() as cur:
            await cur.execute(QUERIES[call.query], call.params)
            if call.shape == plans.VALUE:
                row = await cur.fetchone()
                return None if row is None else row[0]
            return cur.rowcount
    except psycopg.Error as exc:
        # A transaction pooler belay was not told about: say which setting.
        translated = pooler_error(exc)
        if translated is None:
            raise
        raise translated from exc


#: Turn a framework's async session or connection into the psycopg
#: AsyncConnection under it, or None for objects the adapter does not know.
Adapter = Callable[[Any], Awaitable["AConn | None"]]
_adapters: list[Adapter] = []


def register_connection_adapter(adapter: Adapter) -> None:
    """Let ``conn=`` take another kind of object (belay_sqlalchemy registers
    one for ``AsyncSession`` and ``AsyncConnection``)."""
    if adapter not in _adapters:
        _adapters.append(adapter)


DJANGO_ATOMIC = (
    "belay.aio cannot join Django's transaction.atomic(): Django has no async "
    "transactions, and belay.aio runs on a connection of its own, so the job would "
    "be committed even if the atomic block rolled back. Inside the block, enqueue "
    "with the synchronous client (belay.enqueue, which joins Django's transaction "
    "through belay_django; from async code, run the whole block in "
    "asgiref's sync_to_async), or await belay.aio.enqueue(...) after the block commits"
)


async def borrow(conn: Any) -> AConn:
    """The psycopg AsyncConnection a caller's ``conn=`` stands for, checked
    usable; a ValidationError naming the fix for anything else."""
    found: AConn | None = conn if isinstance(conn, psycopg.AsyncConnection) else None
    for adapter in reversed(_adapters):
        if found is not None:
            break
        found = await adapter(conn)
    if found is None:
        raise ValidationError(_refusal(conn))
    if found.info.transaction_status == TransactionStatus.INERROR:
        raise ValidationError(
            "the connection's transaction has failed; roll it back before using belay on it")
    return found


def _refusal(conn: Any) -> str:
    module = type(conn).__module__
    if isinstance(conn, psycopg.Connection):
        return ("belay.aio takes a psycopg.AsyncConnection; this is a blocking "
                "psycopg.Connection: use belay.Belay (the synchronous client) with it")
    if module.startswith("django."):
        return DJANGO_ATOMIC
    if module.startswith("sqlalchemy.") and "belay_sqlalchemy" not in sys.modules:
        return (f"conn= got a SQLAlchemy {type(conn).__name__}: import belay_sqlalchemy "
                "first, which teaches belay.aio to join an AsyncSession's transaction")
    return (f"conn= takes a psycopg.AsyncConnection (or, with belay_sqlalchemy imported, a "
            f"SQLAlchemy AsyncSession or AsyncConnection), got {type(conn).__name__}")


def check_django_atomic() -> None:
    """Refuse an enqueue on belay's own connection from inside a Django
    ``transaction.atomic()`` block (an async function called through
    ``async_to_sync`` from one): it would not be part of that transaction."""
    if "django.db" not in sys.modules:
        return
    from django.db import connections

    try:
        opened = connections.all(initialized_only=True)
    except Exception:  # settings not configured, an older Django: nothing to check
        return
    if any(getattr(c, "in_atomic_block", False) for c in opened):
        raise ValidationError(DJANGO_ATOMIC)
