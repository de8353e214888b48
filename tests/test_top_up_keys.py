"""Keyed top-ups (issue 38, finding B): a top-up sent with an idempotency key
raises a job's caps once, however often it is retried — and however many
copies race — on every surface (client, ops, HTTP, MCP, CLI).

The key is a once-only mark in ``belay_signals`` in the job's scope
(``$budget:top_up:<sha-256>``), written in the top-up's transaction under the
job's row lock. The races run real threads against a real PostgreSQL, each
on its own pooled connection, released together by a barrier.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import belay
from belay import ops
from tests.helpers import job_row, signal_rows
from tests.test_budget_pause import PAUSE, spender
from tests.test_http_producer import asgi_call
from tests.test_steps import drain

Conn = psycopg.Connection[Any]
RACERS = 20
#: The wire name of a keyed top-up's mark (belay.budget.TOP_UP_MARKS): a
#: reserved signal in the job's scope, ``$budget:top_up:`` + SHA-256 of the key.
TOP_UP_MARKS = "$budget:top_up:"
#: Generous bounds for a loaded 2-core CI machine: each only caps a wait that
#: an event (the barrier, a thread's end) normally ends at once.
BARRIER_TIMEOUT = 120.0
JOIN_TIMEOUT = 180.0


@pytest.fixture
def wide_client(db_url: str, clock: belay.ManualClock) -> Iterator[belay.Belay]:
    """A client with a connection per racer, all open before a race starts: no
    racer waits on the pool or on a connect while another one runs ahead."""
    with belay.Belay(db_url, clock=clock, max_pool_size=RACERS) as instance:

        def hold() -> None:
            with instance.connection():
                held.wait()  # every racer holds one at once: the pool opens RACERS

        held = threading.Barrier(RACERS, timeout=BARRIER_TIMEOUT)
        assert [r for r in race([hold] * RACERS) if isinstance(r, BaseException)] == []
        yield instance


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run each call on its own thread, all released at once; their results (or
    the exceptions they raised), in order."""
    barrier = threading.Barrier(len(calls), timeout=BARRIER_TIMEOUT)
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = calls[index]()
        except BaseException as exc:  # reported to the test below
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"top-up-racer-{i}")
               for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive(), f"{thread.name} still running after {JOIN_TIMEOUT} s"
    return results


def top_up_mark(key: str) -> str:
    return TOP_UP_MARKS + hashlib.sha256(key.encode()).hexdigest()


def caps(conn: Conn, job_id: int) -> tuple[int, int]:
    row = job_row(conn, job_id)
    return row["budget_usd_micros"], row["budget_tokens"]


def marks(conn: Conn) -> list[dict[str, Any]]:
    return [r for r in signal_rows(conn) if r["name"].startswith(TOP_UP_MARKS)]


# -- the races ------------------------------------------------------------------------------


def test_twenty_concurrent_top_ups_with_one_key_raise_the_cap_once(wide_client, sql_conn):
    job = wide_client.enqueue("k", budget={"usd": 1, "tokens": 1000})
    results = race([lambda: wide_client.top_up(job.id, usd=0.5, tokens=100,
                                                idempotency_key="retry-me")] * RACERS)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert caps(sql_conn, job.id) == (1_500_000, 1100)  # raised once, not 20 times
    assert sorted(r.duplicate for r in results) == [False] + [True] * (RACERS - 1)
    assert {(r.budget_usd_micros, r.budget_tokens) for r in results} == {(1_500_000, 1100)}
    [mark] = marks(sql_conn)
    assert (mark["scope"], mark["name"]) == (f"job:{job.id}", top_up_mark("retry-me"))
    assert mark["payload"] == {"key": "retry-me", "usd_micros": 500_000, "tokens": 100,
                               "resumed": False}


@pytest.mark.parametrize("keyed", [True, False], ids=["distinct-keys", "no-keys"])
def test_twenty_concurrent_top_ups_with_distinct_keys_raise_it_by_their_sum(
        wide_client, sql_conn, keyed):
    job = wide_client.enqueue("k", budget={"usd": 1, "tokens": 1000})

    def top_up(n: int) -> Callable[[], belay.Job]:
        # Without keys, the call a belay before keyed top-ups took as well.
        keys = {"idempotency_key": f"top-up-{n}"} if keyed else {}
        return lambda: wide_client.top_up(job.id, usd=0.01 * (n + 1), tokens=n + 1, **keys)

    results = race([top_up(n) for n in range(RACERS)])
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert not any(r.duplicate for r in results)
    usd_added = sum(10_000 * (n + 1) for n in range(RACERS))
    tokens_added = sum(n + 1 for n in range(RACERS))
    assert caps(sql_conn, job.id) == (1_000_000 + usd_added, 1000 + tokens_added)
    assert len(marks(sql_conn)) == (RACERS if keyed else 0)


def test_twenty_concurrent_keyed_top_ups_resume_a_paused_job_once(wide_client, sql_conn):
    reg, calls = belay.Registry(), []
    job = wide_client.enqueue(spender(reg, calls), budget=PAUSE)
    assert drain(wide_client, reg) == {"await": 1}
    results = race([lambda: ops.mutate(wide_client, ops.Guard(allow=True), "top_up",
                                       {"job_id": job.id, "usd": 0.5,
                                        "idempotency_key": "k1"})] * RACERS)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert caps(sql_conn, job.id)[0] == 1_000_000
    assert sorted(r["duplicate"] for r in results) == [False] + [True] * (RACERS - 1)
    # Every answer is the first one's: it resumed the job.
    assert {r["resumed"] for r in results} == {True}
    assert job_row(sql_conn, job.id)["state"] == "ready"
    assert drain(wide_client, reg) == {"succeeded": 1}
    assert calls == [1, 2, 3, 4, 5]


# -- one job, one key ----------------------------------------------------------------------


def test_a_retry_answers_as_the_first_did_even_after_the_job_ended(client, sql_conn):
    reg, calls = belay.Registry(), []
    job = client.enqueue(spender(reg, calls), budget=PAUSE)
    drain(client, reg)
    guard = ops.Guard(allow=True)
    first = ops.mutate(client, guard, "top_up", {"job_id": job.id, "usd": 0.5,
                                                 "idempotency_key": "k"})
    assert (first["resumed"], first["duplicate"]) == (True, False)
    assert drain(client, reg) == {"succeeded": 1}
    # A finished job refuses a new top-up, but a retry of the first one is
    # answered as the first was, and changes nothing.
    with pytest.raises(belay.ValidationError, match="is succeeded"):
        client.top_up(job.id, usd=0.5, idempotency_key="another")
    again = ops.mutate(client, guard, "top_up", {"job_id": job.id, "usd": 0.5,
                                                 "idempotency_key": "k"})
    assert (again["resumed"], again["duplicate"]) == (True, True)
    assert again["job"]["state"] == "succeeded" and again["job"]["budget_usd"] == 1.0
    assert client.top_up(job.id, usd=0.5, idempotency_key="k").duplicate is True
    assert caps(sql_conn, job.id)[0] == 1_000_000


def test_the_same_key_with_other_amounts_is_a_conflict_and_changes_nothing(client, sql_conn):
    job = client.enqueue("k", budget={"usd": 1, "tokens": 10})
    client.top_up(job.id, usd=1, idempotency_key="k")
    # The same amounts however spelt (1 and 1.0 dollars) are the same top-up.
    assert client.top_up(job.id, usd=1.0, tokens=0, idempotency_key="k").duplicate is True
    for other in ({"usd": 2}, {"tokens": 5}, {"usd": 1, "tokens": 5}):
        with pytest.raises(belay.IdempotencyConflict,
                           match=r"already topped up with idempotency_key 'k' and other "
                                 r"amounts \(usd=1.0, tokens=0"):
            client.top_up(job.id, idempotency_key="k", **other)
    assert issubclass(belay.IdempotencyConflict, belay.ValidationError)
    assert caps(sql_conn, job.id) == (2_000_000, 10)
    # A key is per job: the same key on another job is another top-up.
    other_job = client.enqueue("k", budget={"usd": 1})
    assert client.top_up(other_job.id, usd=2, idempotency_key="k").duplicate is False
    assert caps(sql_conn, other_job.id)[0] == 3_000_000


def test_the_mark_is_written_in_the_top_ups_transaction(client, sql_conn):
    job = client.enqueue("k", budget={"usd": 1})
    with client.connection() as conn:
        conn.execute("BEGIN")
        client.top_up(job.id, usd=1, idempotency_key="k", conn=conn)
        conn.execute("ROLLBACK")
    # Rolled back with the caps: the key was never used, so it raises them now.
    assert caps(sql_conn, job.id)[0] == 1_000_000 and marks(sql_conn) == []
    assert client.top_up(job.id, usd=1, idempotency_key="k").duplicate is False
    assert caps(sql_conn, job.id)[0] == 2_000_000


def test_a_refused_top_up_leaves_no_mark(client, sql_conn):
    job = client.enqueue("k", budget={"usd": 1})
    with pytest.raises(belay.ValidationError, match="no token budget"):
        client.top_up(job.id, tokens=5, idempotency_key="k")
    assert marks(sql_conn) == []
    # The key is still free for a top-up that can be done.
    assert client.top_up(job.id, usd=1, idempotency_key="k").duplicate is False


@pytest.mark.parametrize(("key", "words"), [
    ("", "must be a non-empty string"),
    ("   ", "must be a non-empty string"),
    ("a\x00b", "contains a NUL"),
    ("\ud800", "lone surrogate"),
    ("é" * 128, "is 256 bytes long; the limit is 255"),
    (42, "must be a string, got int"),
])
def test_a_bad_key_is_refused_before_anything_is_written(client, sql_conn, key, words):
    job = client.enqueue("k", budget={"usd": 1})
    with pytest.raises(belay.ValidationError, match=words):
        client.top_up(job.id, usd=1, idempotency_key=key)
    with pytest.raises(belay.ValidationError, match=words):
        ops.mutate(client, ops.Guard(allow=True), "top_up",
                   {"job_id": job.id, "usd": 1, "idempotency_key": key})
    assert caps(sql_conn, job.id)[0] == 1_000_000 and marks(sql_conn) == []
    assert client.top_up(job.id, usd=1, idempotency_key="x" * 255).duplicate is False


def test_the_authorizer_sees_the_key_when_one_is_sent(client):
    job = client.enqueue("k", budget={"usd": 1})
    asked: list[dict[str, Any]] = []
    guard = ops.Guard(authorizer=lambda tool, args: asked.append(args))
    ops.mutate(client, guard, "top_up", {"job_id": job.id, "usd": 1})
    ops.mutate(client, guard, "top_up", {"job_id": job.id, "usd": 1, "idempotency_key": "k"})
    assert asked == [{"job_id": job.id, "usd": 1, "tokens": None},
                     {"job_id": job.id, "usd": 1, "tokens": None, "idempotency_key": "k"}]


# -- the other surfaces ---------------------------------------------------------------------


def test_http_takes_the_key_as_a_header_or_a_body_field(client, sql_conn):
    from starlette.testclient import TestClient

    from belay.http.app import build_app

    job = client.enqueue("k", budget={"usd": 1})
    url = f"/jobs/{job.id}/top_up"
    with TestClient(build_app(client)) as http:
        first = http.post(url, json={"usd": 1}, headers={"Idempotency-Key": "h-1"})
        assert first.status_code == 200, first.text
        assert (first.json()["duplicate"], first.json()["job"]["budget_usd"]) == (False, 2.0)
        # The body's idempotency_key is the same key as the header.
        again = http.post(url, json={"usd": 1, "idempotency_key": "h-1"})
        assert again.status_code == 200 and again.json()["duplicate"] is True
        both = http.post(url, json={"usd": 1, "idempotency_key": "h-1"},
                         headers={"Idempotency-Key": "h-1"})
        assert both.json()["duplicate"] is True

        conflict = http.post(url, json={"usd": 3}, headers={"Idempotency-Key": "h-1"})
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "idempotency_conflict"
        assert "other amounts" in conflict.json()["error"]["message"]
        refusals: list[tuple[dict[str, Any], dict[str, Any], str]] = [
            ({"usd": 1, "idempotency_key": "a"}, {"Idempotency-Key": "b"}, "differ"),
            ({"usd": 1, "idempotency_key": None}, {}, "idempotency_key is a string"),
            ({"usd": 1}, {"Idempotency-Key": ""}, "must be a non-empty string"),
            ({"usd": 1, "idempotency_key": "x" * 256}, {}, "limit is 255"),
            ({"usd": 1, "key": "x"}, {}, "unknown field(s) 'key'"),
        ]
        for body, headers, words in refusals:
            refused = http.post(url, json=body, headers=headers)
            assert refused.status_code == 400, (body, refused.text)
            assert words in refused.json()["error"]["message"], refused.text
        # Raw bytes that are not UTF-8 (sent straight through ASGI: the test
        # client would re-encode them).
        sent = asgi_call(http.app, "POST", url, [b'{"usd": 1}'],
                         [(b"content-type", b"application/json"),
                          (b"idempotency-key", b"\xff")])
        assert sent[0]["status"] == 400 and b"not UTF-8 text" in sent[1]["body"]
        # A UTF-8 key in the header is the same key as in the body.
        utf8 = http.post(url, json={"usd": 1, "idempotency_key": "clé"},
                         headers={"Idempotency-Key": "clé".encode()})
        assert utf8.status_code == 200 and utf8.json()["duplicate"] is False
    assert caps(sql_conn, job.id)[0] == 3_000_000


def test_the_cli_takes_an_idempotency_key(client, sql_conn, db_url, capsys):
    from belay.cli import main

    job = client.enqueue("k", budget={"usd": 1})
    argv = ["top-up", str(job.id), "--usd", "1", "--idempotency-key", "cli-1", "--url", db_url]
    assert main(argv) == 0
    assert "USD cap 2" in capsys.readouterr().out
    assert main(argv) == 0
    assert "already topped up with this key, nothing changed" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["duplicate"] is True
    assert main(["top-up", str(job.id), "--usd", "5", "--idempotency-key", "cli-1",
                 "--url", db_url]) != 0
    assert "other amounts" in capsys.readouterr().err
    assert caps(sql_conn, job.id)[0] == 2_000_000


def test_the_mcp_tool_takes_an_idempotency_key(client, sql_conn):
    import anyio
    from mcp import Client

    from belay.mcp_server import build_server

    job = client.enqueue("k", budget={"usd": 1})
    server = build_server(client, ops.Guard(allow=True))

    async def calls() -> list[Any]:
        async with Client(server) as mcp:
            args = {"job_id": job.id, "usd": 1, "idempotency_key": "m-1"}
            return [await mcp.call_tool("top_up", args), await mcp.call_tool("top_up", args),
                    await mcp.call_tool("top_up", {**args, "usd": 2})]

    first, again, conflict = anyio.run(calls)
    assert first.structured_content["duplicate"] is False
    assert again.structured_content["duplicate"] is True
    assert conflict.is_error and "other amounts" in conflict.content[0].text
    assert caps(sql_conn, job.id)[0] == 2_000_000


def test_the_dashboard_takes_an_idempotency_key(client, sql_conn):
    from belay.dashboard import make_app
    from tests.test_dashboard import TOKEN, post

    dashboard = make_app(client, token=TOKEN)
    job = client.enqueue("k", budget={"usd": 1})
    body = {"usd": 1, "idempotency_key": "d-1"}
    first = post(dashboard, job.id, "top-up", body, token=TOKEN)
    assert first.status == 200 and first.json["duplicate"] is False, first.json
    again = post(dashboard, job.id, "top-up", body, token=TOKEN)
    assert again.status == 200 and again.json["duplicate"] is True
    conflict = post(dashboard, job.id, "top-up", {**body, "usd": 2}, token=TOKEN)
    assert conflict.status == 409 and "other amounts" in conflict.json["error"]
    assert caps(sql_conn, job.id)[0] == 2_000_000
