"""belay.aio inside SQLAlchemy's asyncio extension: an enqueue joins an
AsyncSession's (or an AsyncConnection's) transaction on a postgresql+psycopg
engine, so it commits and rolls back with the application's own rows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

import belay
import belay_sqlalchemy  # noqa: F401 - registers the adapters
from belay.aio import AsyncBelay
from tests.conftest import POOLED
from tests.helpers import count_jobs
from tests.sqlalchemy.conftest import Base, Order, sa_url

asyncio_ext = pytest.importorskip("sqlalchemy.ext.asyncio", exc_type=ImportError)

T = TypeVar("T")


class Boom(Exception):
    pass


def arun(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())  # type: ignore[arg-type]


def counts(url: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        orders = conn.execute("SELECT count(*) FROM orders").fetchone()
        return count_jobs(conn), int(orders[0]) if orders else 0


async def engine_for(db_url: str) -> Any:
    engine = asyncio_ext.create_async_engine(sa_url(db_url))
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    return engine


def test_an_async_session_commits_and_rolls_back_the_job_with_its_rows(db_url, direct_url,
                                                                          notes) -> None:
    async def main() -> int:
        engine = await engine_for(db_url)
        maker = asyncio_ext.async_sessionmaker(engine)
        try:
            async with AsyncBelay(db_url, direct_url=direct_url if POOLED else None) as client:
                with pytest.raises(Boom):
                    async with maker() as session, session.begin():
                        session.add(Order(item="lost"))
                        await client.enqueue("t.charge", {"item": "lost"}, session=session)
                        raise Boom
                assert counts(direct_url) == (0, 0)
                async with maker() as session, session.begin():
                    session.add(Order(item="book"))
                    await session.flush()
                    job = await client.enqueue("t.charge", {"item": "book"}, session=session,
                                               queue="billing")
                    assert counts(direct_url) == (0, 0)  # nothing visible before the commit
                return job.id
        finally:
            await engine.dispose()

    job_id = arun(main)
    assert counts(direct_url) == (1, 1)
    with belay.Belay(db_url) as sync:
        assert sync.get_job(job_id).input == {"item": "book"}  # type: ignore[union-attr]
    assert {"t": "p", "q": "billing"} in notes.received()


def test_an_async_connection_outside_a_transaction_autobegins(db_url, direct_url) -> None:
    async def main() -> None:
        engine = await engine_for(db_url)
        try:
            async with AsyncBelay(db_url) as client, engine.connect() as connection:
                await client.enqueue("t.kept", conn=connection)
                assert connection.in_transaction()
                assert counts(direct_url)[0] == 0
                await connection.commit()
        finally:
            await engine.dispose()

    arun(main)
    assert counts(direct_url)[0] == 1


def test_sync_sessions_and_other_drivers_are_refused_with_the_fix(db_url, engine) -> None:
    from sqlalchemy.orm import Session

    async def main() -> list[str]:
        messages = []
        async with AsyncBelay(db_url) as client:
            with Session(engine) as session:
                with pytest.raises(belay.ValidationError) as sync_session:
                    await client.enqueue("t.x", session=session)
                messages.append(str(sync_session.value))
            async_engine = asyncio_ext.create_async_engine(sa_url(db_url))
            with pytest.raises(belay.ValidationError) as bare_engine:
                await client.enqueue("t.x", conn=async_engine)
            messages.append(str(bare_engine.value))
            await async_engine.dispose()
        return messages

    sync_message, engine_message = arun(main)
    assert "belay.Belay" in sync_message
    assert "AsyncSession" in engine_message and "engine.begin()" in engine_message
