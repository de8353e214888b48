"""The worker's connections.

While a worker runs, one pool serves its producers, heartbeat, acks and
maintenance, sized to the queues it serves. Outside ``start``/``stop``
(``drain``, ``prune``, ``reclaim`` called directly), each call opens a
short-lived pool of its own, checking the schema first; acks made meanwhile
go through it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from belay import connect, schema
from belay.client import Belay
from belay.queues import QueueSpec


def pool_size(specs: Iterable[QueueSpec]) -> int:
    """Producers + heartbeat + sweeper + queue sync + cron + idle poller + acker,
    and single acks (which may wait their turn)."""
    specs = list(specs)
    return len(specs) + 6 + min(sum(s.limit for s in specs), 16)


class WorkerPool:
    """The pool of one worker (``pool`` is None while it is stopped)."""

    def __init__(self, client: Belay) -> None:
        self.client = client
        self.pool: ConnectionPool | None = None
        #: The NOTIFY channel of the database (§9.2), read when a pool opens.
        self.channel = ""

    def probe(self) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A connection of its own, the schema checked: for what ``open`` needs first."""
        return self._checked()

    @contextlib.contextmanager
    def _checked(self) -> Iterator[psycopg.Connection[Any]]:
        with self.client.connect(autocommit=True) as probe:
            schema.check(probe)
            self.channel = self.client.notify_channel(probe)
            yield probe

    def open(self, specs: Iterable[QueueSpec]) -> ConnectionPool:
        self.pool = connect.pool(
            self.client.conninfo, self.client.pooler, min_size=1, max_size=pool_size(specs),
            name="belay-worker", open=True, kwargs={"application_name": "belay-worker"},
        )
        return self.pool

    def resize(self, specs: Iterable[QueueSpec]) -> None:
        pool = self.pool
        if pool is not None:
            wanted = pool_size(specs)
            if wanted != pool.max_size:
                pool.resize(1, wanted)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; while stopped, one from a short-lived pool that
        serves (and outlives) only this call."""
        if self.pool is not None:
            with self.pool.connection() as conn:
                yield conn
            return
        with self._checked():
            pass
        self.pool = connect.pool(self.client.conninfo, self.client.pooler, min_size=1,
                                 max_size=2, name="belay-worker-sync", open=True)
        try:
            with self.pool.connection() as conn:
                yield conn
        finally:
            self.close()
