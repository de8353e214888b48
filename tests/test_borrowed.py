"""Borrowed connections: the hooks the Django and SQLAlchemy adapters build on.

``conn=`` takes a psycopg connection or any object a registered adapter knows;
an adapter may defer the wake-ups to the caller's commit; a client's
``connection_provider`` supplies the connection of calls without ``conn=``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

import belay
from belay import client as client_module
from belay.client import Borrowed


@dataclass
class FrameworkConnection:
    """Stands in for a framework's wrapper around a psycopg connection."""

    raw: psycopg.Connection[Any]
    pending: list[tuple[str, list[bytes]]] = field(default_factory=list)
    deferring: bool = False


def adapter(obj: Any) -> Borrowed | None:
    if not isinstance(obj, FrameworkConnection):
        return None
    if not obj.deferring:
        return Borrowed(obj.raw)
    return Borrowed(obj.raw, lambda channel, payloads: obj.pending.append((channel, payloads)))


@pytest.fixture
def adapted(db_url: str) -> Iterator[FrameworkConnection]:
    client_module.register_connection_adapter(adapter)
    client_module.register_connection_adapter(adapter)  # idempotent
    assert client_module._ADAPTERS.count(adapter) == 1
    raw = psycopg.connect(db_url)  # not autocommit: a framework's open transaction
    try:
        yield FrameworkConnection(raw)
    finally:
        raw.close()
        client_module._ADAPTERS.remove(adapter)


def count(sql_conn: psycopg.Connection[Any]) -> int:
    row = sql_conn.execute("SELECT count(*) FROM belay_jobs").fetchone()
    assert row is not None
    return int(row[0])


def test_an_adapted_connection_joins_the_callers_transaction(
    client, adapted, sql_conn, notes
) -> None:
    job = client.enqueue("t.k", conn=adapted)
    assert count(sql_conn) == 0  # not committed yet
    assert client.get_job(job.id, conn=adapted) is not None
    adapted.raw.rollback()
    assert count(sql_conn) == 0
    assert notes.received() == []
    client.enqueue("t.k", conn=adapted)
    adapted.raw.commit()
    assert count(sql_conn) == 1
    assert notes.received() == [{"t": "p", "q": "default"}]  # in the transaction, on commit


def test_an_adapter_may_take_the_wake_ups_to_send_on_its_commit(
    client, adapted, sql_conn, notes
) -> None:
    adapted.deferring = True
    client.enqueue_many([belay.JobSpec("t.k", {}), belay.JobSpec("t.k", {}, queue="b")],
                        conn=adapted)
    adapted.raw.commit()
    assert count(sql_conn) == 2
    assert notes.received() == []  # nothing sent in the transaction
    [(channel, payloads)] = adapted.pending
    assert channel == notes.channel
    assert sorted(payloads) == sorted([b'{"t":"p","q":"default"}', b'{"t":"p","q":"b"}'])
    # Calls on belay's own connections are not deferred.
    client.enqueue("t.k")
    assert notes.received() == [{"t": "p", "q": "default"}]
    assert len(adapted.pending) == 1


def test_a_connection_provider_supplies_calls_without_conn(db_url, clock, adapted,
                                                          sql_conn) -> None:
    current: list[Any] = [adapted]
    with belay.Belay(db_url, clock=clock, connection_provider=lambda: current[0]) as provided:
        provided.enqueue("t.k")
        assert count(sql_conn) == 0  # it went into the provided connection's transaction
        adapted.raw.commit()
        assert count(sql_conn) == 1
        current[0] = None  # no framework connection here: belay's own pool
        provided.enqueue("t.k")
        assert count(sql_conn) == 2
        # An explicit conn= still wins.
        with psycopg.connect(db_url) as other:
            provided.enqueue("t.k", conn=other)
            other.rollback()
        assert count(sql_conn) == 2


def test_an_unknown_connection_object_is_refused_with_the_fix(client) -> None:
    with pytest.raises(belay.ValidationError) as caught:
        client.enqueue("t.k", conn=object())
    assert "psycopg 3 connection" in str(caught.value)
    assert "belay_django" in str(caught.value) and "belay_sqlalchemy" in str(caught.value)


def test_a_call_on_the_pool_inside_a_borrowed_one_sends_its_own_pokes(
    client, adapted, sql_conn, notes
) -> None:
    adapted.deferring = True
    with client.connection(adapted):
        client.enqueue("t.k")  # belay's own pool: committed and poked at once
    assert notes.received() == [{"t": "p", "q": "default"}]
    assert adapted.pending == []
