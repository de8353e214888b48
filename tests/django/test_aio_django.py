"""belay.aio in a Django project: an async view's enqueue runs on belay.aio's
own connection, so from inside ``transaction.atomic()`` (Django's transactions
are synchronous; an async function reaches one through ``async_to_sync``) it
is refused, never committed beside the block."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connection, connections, transaction

import belay
from belay.aio import AsyncBelay
from tests.helpers import count_jobs


@pytest.fixture
def sql(dj):
    with psycopg.connect(dj, autocommit=True) as conn:
        yield conn


def test_an_enqueue_inside_an_atomic_block_of_async_code_never_commits_alone(
        dj, sql, monkeypatch) -> None:
    async def view() -> belay.Job:
        async with AsyncBelay(dj) as client:
            try:
                with transaction.atomic():
                    return await client.enqueue("t.inside")
            finally:
                # The connection Django opened for this (unsafe) async context.
                for opened in connections.all(initialized_only=True):
                    opened.close()

    # Django itself refuses transaction.atomic() in async code...
    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(view())
    # ...and where that guard is lifted, belay.aio refuses to enqueue beside the block.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with pytest.raises(belay.ValidationError, match=r"transaction\.atomic"):
        asyncio.run(view())
    assert count_jobs(sql) == 0
    monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE")

    # Outside any atomic block it runs in a transaction of its own.
    async def plain() -> belay.Job:
        async with AsyncBelay(dj) as client:
            return await client.enqueue("t.outside")

    assert asyncio.run(plain()).kind == "t.outside"
    assert count_jobs(sql) == 1


def test_djangos_connection_is_refused_as_a_conn(dj) -> None:
    async def enqueue() -> None:
        async with AsyncBelay(dj) as client:
            await client.enqueue("t.x", conn=connection)

    with pytest.raises(belay.ValidationError, match="sync_to_async"):
        async_to_sync(enqueue)()
