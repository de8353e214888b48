"""Session hooks: belay's wake-ups wait in ``session.info`` for the commit.

Without the hooks every belay call on a Session sends its ``pg_notify`` in the
transaction (PostgreSQL delivers it at commit, drops it on rollback). With
them, the wake-ups of a transaction are collected and sent as one ``pg_notify``
batch per database just before the commit: in ``before_commit``, on the
session's own connection, so PostgreSQL still delivers them only if the COMMIT
succeeds. ``after_commit`` runs no SQL (the transaction is over by then).
Rolling back drops them: the whole lot on a rollback, and only those queued
inside a SAVEPOINT when that SAVEPOINT (``session.begin_nested()``) rolls back.
Releasing a SAVEPOINT (also a ``before_commit``) sends those queued inside it,
where PostgreSQL keeps them exactly as long as it keeps those jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction, scoped_session, sessionmaker

from belay import store
from belay.errors import ValidationError

log = logging.getLogger("belay_sqlalchemy")

#: ``session.info`` keys: the wake-ups waiting for the commit, and the root
#: transaction the hooks saw begin (only those transactions defer).
WAKEUPS = "belay_sqlalchemy.wakeups"
_HOOKED = "belay_sqlalchemy.hooked"

Target = TypeVar("Target")


@dataclass(frozen=True)
class Wakeup:
    """Wake-ups one belay call left for the commit.

    ``scope`` is the chain of transactions it was queued under, innermost
    first: SAVEPOINTs (``nested``) up to the root, so a rolled-back SAVEPOINT
    finds what it must drop.
    """

    scope: tuple[SessionTransaction, ...]
    conn: psycopg.Connection[Any]
    channel: str
    payloads: tuple[bytes, ...]


def install(target: Target) -> Target:
    """Register belay's session hooks on a Session class, a sessionmaker, a
    scoped_session or one Session; returns ``target``. Idempotent."""
    _check_target(target)
    for name, hook in _HOOKS.items():
        if not event.contains(target, name, hook):
            event.listen(target, name, hook)
    if isinstance(target, Session):
        root = target.get_transaction()
        if root is not None:
            target.info[_HOOKED] = root
    return target


def uninstall(target: Any) -> None:
    """Undo :func:`install` on the same target, between transactions: the
    wake-ups a transaction under way has already queued would not be sent
    (workers still find its jobs, at their next poll)."""
    _check_target(target)
    for name, hook in _HOOKS.items():
        if event.contains(target, name, hook):
            event.remove(target, name, hook)


def pending_wakeups(session: Session | scoped_session[Any]) -> list[tuple[str, bytes]]:
    """The wake-ups (channel, payload) waiting for this session's commit."""
    if isinstance(session, scoped_session):
        session = session()
    wakeups: list[Wakeup] = session.info.get(WAKEUPS, [])
    return [(w.channel, p) for w in wakeups for p in w.payloads]


def deferrer(
    session: Session, conn: psycopg.Connection[Any]
) -> Callable[[str, list[bytes]], None] | None:
    """What the connection adapter hands belay as ``defer_notify``: None unless
    the hooks saw this session's transaction begin."""
    root = session.get_transaction()
    if root is None or session.info.get(_HOOKED) is not root:
        return None

    def defer(channel: str, payloads: list[bytes]) -> None:
        wakeup = Wakeup(_scope(session), conn, channel, tuple(payloads))
        session.info[WAKEUPS] = [*session.info.get(WAKEUPS, []), wakeup]

    return defer


# -- Pure bookkeeping ---------------------------------------------------------------


def boundary(transaction: SessionTransaction) -> SessionTransaction:
    """The transaction a rollback of ``transaction`` undoes in the database: it
    or its nearest SAVEPOINT or root ancestor (flush subtransactions have no
    database counterpart)."""
    while not transaction.nested and transaction.parent is not None:
        transaction = transaction.parent
    return transaction


def surviving(wakeups: Sequence[Wakeup], rolled_back: object) -> list[Wakeup]:
    """The wake-ups not queued inside the rolled-back transaction."""
    return [w for w in wakeups if rolled_back not in w.scope]


def ready_at(wakeups: Sequence[Wakeup], level: object) -> tuple[list[Wakeup], list[Wakeup]]:
    """Split the wake-ups into those queued at or inside ``level`` (sendable
    once the transactions inside it are released) and the rest."""
    send = [w for w in wakeups if level in w.scope]
    return send, [w for w in wakeups if level not in w.scope]


def batches(
    wakeups: Sequence[Wakeup],
) -> list[tuple[psycopg.Connection[Any], str, list[bytes]]]:
    """One (connection, channel, payloads) per database connection and channel,
    in first-queued order, each payload once."""
    grouped: dict[tuple[int, str], tuple[psycopg.Connection[Any], str, list[bytes]]] = {}
    for w in wakeups:
        _, _, payloads = grouped.setdefault((id(w.conn), w.channel), (w.conn, w.channel, []))
        payloads.extend(p for p in w.payloads if p not in payloads)
    return list(grouped.values())


def _scope(session: Session) -> tuple[SessionTransaction, ...]:
    chain: list[SessionTransaction] = []
    current = session.get_nested_transaction() or session.get_transaction()
    while current is not None:
        if current.nested or current.parent is None:
            chain.append(current)
        current = current.parent
    return tuple(chain)


# -- The hooks ------------------------------------------------------------------------


def _after_transaction_create(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        session.info[_HOOKED] = transaction


def _before_commit(session: Session) -> None:
    # Flush first: what the commit's own flush does next could call belay (an
    # after_flush listener enqueueing, say), and its wake-ups must go out too.
    session.flush()
    wakeups: list[Wakeup] = session.info.get(WAKEUPS, [])
    innermost = session.get_nested_transaction() or session.get_transaction()
    if not wakeups or innermost is None:
        return
    # Whatever is committing, the innermost open transaction is released or
    # committed with it, which leaves the sent notifications at its parent's
    # level (a COMMIT: delivered). So send what was queued at or inside that
    # level; PostgreSQL drops it if an enclosing SAVEPOINT rolls back later, as
    # it drops those jobs. Wake-ups of outer levels wait for an outer commit.
    level = boundary(innermost.parent) if innermost.parent is not None else innermost
    send, keep = ready_at(wakeups, level)
    session.info[WAKEUPS] = keep
    for conn, channel, payloads in batches(send):
        store.notify(conn, channel, payloads)


def _after_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a SAVEPOINT released: later wake-ups go out with an outer commit
    late: list[Wakeup] = session.info.pop(WAKEUPS, [])
    if late:
        # No SQL here: the session's transaction is over. The jobs are committed;
        # workers find them at their next poll instead of at once.
        log.warning(
            "belay: %d wake-up(s) were queued after belay_sqlalchemy's before_commit "
            "hook ran (a before_commit listener registered after install() called "
            "belay?) and were not sent; workers pick the jobs up at their next poll",
            sum(len(w.payloads) for w in late),
        )


def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    wakeups: list[Wakeup] = session.info.get(WAKEUPS, [])
    if wakeups:
        session.info[WAKEUPS] = surviving(wakeups, boundary(previous_transaction))


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        # Committed, rolled back or closed: nothing carries over to the next one.
        session.info.pop(WAKEUPS, None)
        if session.info.get(_HOOKED) is transaction:
            del session.info[_HOOKED]


_HOOKS: dict[str, Callable[..., None]] = {
    "after_transaction_create": _after_transaction_create,
    "before_commit": _before_commit,
    "after_commit": _after_commit,
    "after_soft_rollback": _after_soft_rollback,
    "after_transaction_end": _after_transaction_end,
}


def _check_target(target: Any) -> None:
    if isinstance(target, (Session, sessionmaker, scoped_session)) or (
        isinstance(target, type) and issubclass(target, Session)
    ):
        return
    raise ValidationError(
        "belay_sqlalchemy.install() takes a Session class, a sessionmaker, a "
        f"scoped_session or a Session, got {target!r} (asyncio sessions are not supported: "
        "belay.aio sends an AsyncSession's wake-ups inside its transaction, no hooks needed)"
    )
