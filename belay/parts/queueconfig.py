"""Which queues a worker serves, with which options (§8.6): the static
configuration with the ``belay_queues`` rows merged over it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg

from belay import store
from belay.queues import QueueSpec
from belay.queues import merge as merge_queues

log = logging.getLogger("belay.worker")


class QueueConfig:
    """The static queues, and the effective specs read from the database."""

    def __init__(self, static: Mapping[str, QueueSpec]) -> None:
        self.static = dict(static)
        self._invalid: dict[str, str] = {}
        #: The effective specs of the last ``drain`` (a drained job's
        #: ``ctx.debit`` trues up against the rate it was admitted by).
        self.drained: dict[str, QueueSpec] = {}

    def effective(self, conn: psycopg.Connection[Any]) -> dict[str, QueueSpec]:
        """The static queues with the ``belay_queues`` rows over them; a row
        that can't be used is logged once (until its reason changes)."""
        specs, invalid = merge_queues(self.static, store.list_queues(conn))
        for name, reason in invalid.items():
            if self._invalid.get(name) != reason:
                log.error("belay: belay_queues row %r is ignored: %s", name, reason)
        self._invalid = invalid
        return specs

    def spec_for(self, queue: str, live: QueueSpec | None) -> QueueSpec | None:
        """A queue's spec for a job's context: served now, else drained, else static."""
        if live is not None:
            return live
        drained = self.drained.get(queue)
        return drained if drained is not None else self.static.get(queue)
