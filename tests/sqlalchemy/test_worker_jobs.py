"""Job code using a SQLAlchemy Session, run by a worker with its own client.

The worker's internals run on its own ``belay.Belay`` (its pool); the job's
``belay.enqueue(..., session=...)`` uses the module-level default client and
joins the job's Session transaction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

import belay
import belay_sqlalchemy
from tests.helpers import wait_until
from tests.sqlalchemy.conftest import Order
from tests.test_worker import Ends, claimed_once, listener_up, make_worker, running


def registry_for(sessions: sessionmaker[Any]) -> belay.Registry:
    reg = belay.Registry()

    @belay.worker(name="t.ship", registry=reg)
    def ship(ctx: belay.Context) -> Any:
        with sessions() as session, session.begin():
            order = session.get(Order, ctx.input["order_id"])
            assert order is not None
            order.item += " (shipped)"
            belay.enqueue("t.mail", {"order_id": order.id}, queue="mail", session=session)
            if ctx.input.get("crash"):
                raise RuntimeError("the carrier's API is down")
            return {"shipped": order.id}

    @belay.worker(name="t.mail", queue="mail", registry=reg)
    def mail(ctx: belay.Context) -> Any:
        return f"mailed about {ctx.input['order_id']}"

    return reg


@pytest.fixture
def sessions(db_url, clock, engine: Engine, restore_default) -> Iterator[sessionmaker[Any]]:
    belay.configure(db_url, clock=clock)  # what job code's belay.enqueue() uses
    maker = belay_sqlalchemy.install(sessionmaker(engine))
    yield maker
    belay_sqlalchemy.uninstall(maker)


def place_order(sessions: sessionmaker[Any], **extra: Any) -> belay.Job:
    with sessions() as session, session.begin():
        session.add(Order(id=5, item="desk"))
        session.flush()
        return belay.enqueue("t.ship", {"order_id": 5, **extra}, max_attempts=1,
                             session=session)


def test_the_worker_runs_a_job_that_uses_a_session(client, sessions, sql_conn) -> None:
    reg = registry_for(sessions)
    ship = place_order(sessions)
    assert belay.Worker(["default"], client=client, registry=reg).drain() == {"succeeded": 1}
    assert client.get_job(ship.id).result == {"shipped": 5}  # type: ignore[union-attr]
    assert sql_conn.execute("SELECT item FROM orders").fetchall() == [("desk (shipped)",)]
    assert belay.Worker(["mail"], client=client, registry=reg).drain() == {"succeeded": 1}
    [mailed] = client.list_jobs(queue="mail")
    assert mailed.result == "mailed about 5"


def test_a_job_whose_session_rolls_back_leaves_no_follow_up(client, sessions, sql_conn,
                                                            notes) -> None:
    reg = registry_for(sessions)
    place_order(sessions, crash=True)
    notes.received()
    assert belay.Worker(["default"], client=client, registry=reg).drain() == {"failed": 1}
    assert sql_conn.execute("SELECT item FROM orders").fetchall() == [("desk",)]
    assert client.list_jobs(queue="mail") == []
    assert {"t": "p", "q": "mail"} not in notes.received()


@pytest.mark.direct_only
def test_a_commit_in_a_session_wakes_an_idle_worker(db_url, engine, sql_conn,
                                                   restore_default) -> None:
    """Polls every 5 s and no other wake source: only the wake-up the session
    hooks sent at commit explains a pickup within 2 s."""
    sessions = belay_sqlalchemy.install(sessionmaker(engine))
    try:
        with belay.Belay(db_url) as own:  # the worker's own client, real time
            reg = registry_for(sessions)
            belay.configure(db_url)
            worker = make_worker(own, reg, ("mail",), notify=True, poll_interval=5.0,
                                 busy_poll=5.0)
            ends = Ends(worker)
            with running(worker):
                wait_until(lambda: listener_up(sql_conn) and claimed_once(sql_conn),
                           "the worker listens and sits idle")
                begun = time.monotonic()
                with sessions() as session, session.begin():
                    job = belay.enqueue("t.mail", {"order_id": 1}, queue="mail",
                                        session=session)
                ends.wait_for(1, timeout=4.5)
                elapsed = time.monotonic() - begun
            assert own.await_result(job.id, timeout=1) == "mailed about 1"
            assert elapsed < 2.0, elapsed
    finally:
        belay_sqlalchemy.uninstall(sessions)
