"""Helpers shared by the test modules (import as ``from tests.helpers import …``).

Raw SQL here plays the part of a foreign SDK, a worker not written yet or the
database operator; nothing here goes through belay's own code.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

Conn = psycopg.Connection[Any]

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)  # the clock fixture's start
VECTORS_PATH = Path(__file__).parent / "fixtures" / "etf" / "vectors.json"


def url_for(server_url: str, dbname: str) -> str:
    """The URL of another database on the same server."""
    return psycopg.conninfo.make_conninfo(server_url, dbname=dbname)


# -- belay_jobs / belay_signals rows -------------------------------------------------------


def insert_job(conn: Conn, **columns: Any) -> int:
    """Insert a belay_jobs row with plain SQL (the part of a foreign SDK / operator).

    Defaults: kind ``test.kind``, queue ``default``, state ``ready``, inserted_at
    START (ready_at stays NULL unless given). ``input``, ``meta`` and ``errors``
    are sent as jsonb unless already wrapped in ``Jsonb``.
    """
    values: dict[str, Any] = {
        "kind": "test.kind", "queue": "default", "state": "ready", "inserted_at": START,
    }
    values.update(columns)
    for name in ("input", "meta", "errors"):
        if name in values and not isinstance(values[name], Jsonb):
            values[name] = Jsonb(values[name])
    query = sql.SQL("INSERT INTO belay_jobs ({}) VALUES ({}) RETURNING id").format(
        sql.SQL(", ").join(map(sql.Identifier, values)),
        sql.SQL(", ").join(sql.Placeholder() * len(values)),
    )
    row = conn.execute(query, list(values.values())).fetchone()
    assert row is not None
    return int(row[0])


def awaiting_own_scope(conn: Conn, name: str, **columns: Any) -> int:
    """A job parked on (job:<its id>, name), as an await in its own code leaves it."""
    job_id = insert_job(conn, state="awaiting", await_name=name, **columns)
    conn.execute("UPDATE belay_jobs SET await_scope = 'job:' || id WHERE id = %s", (job_id,))
    return job_id


def running_job(conn: Conn, **columns: Any) -> int:
    """A job claimed once: running, attempt 1, under a lease."""
    defaults: dict[str, Any] = {
        "state": "running", "attempt": 1, "lease_until": START + timedelta(seconds=30),
        "leased_by": "node-a", "started_at": START,
    }
    defaults.update(columns)
    return insert_job(conn, **defaults)


def job_row(conn: Conn, job_id: int) -> dict[str, Any]:
    """The belay_jobs row, every column, as the database holds it."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT * FROM belay_jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    return row


def count_jobs(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM belay_jobs").fetchone()
    assert row is not None
    return int(row[0])


def signal_rows(conn: Conn) -> list[dict[str, Any]]:
    """Every belay_signals row (scope, name, payload, inserted_at), by scope and name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "SELECT scope, name, payload, inserted_at FROM belay_signals ORDER BY scope, name"
        ).fetchall()


# -- notifications (§9.2) ------------------------------------------------------------------


def channel_for(dbname: str) -> str:
    """§9.2, spelled out independently of belay.names (cut to Postgres's 63-byte identifiers)."""
    return ("belay_" + re.sub(r"[^A-Za-z0-9_]", "_", dbname))[:63]


def notify(conn: Conn, payload: str) -> None:
    """Send ``payload`` on the belay channel of ``conn``'s database."""
    conn.execute("SELECT pg_notify(%s, %s)", (channel_for(conn.info.dbname), payload))


#: The value a forger claims a job returned (issue 38's report).
FORGED_RESULT = {"verified": True, "amount": 1e9}


def forge_result(url: str, job_id: int, value: Any = FORGED_RESULT) -> None:
    """As the role at ``url``, which may not read ``belay_jobs``, send a result
    notification saying job ``job_id`` succeeded with ``value``, shaped as
    belay's batched ack shapes its own (§9.2): ``pg_notify`` needs no privilege."""
    with psycopg.connect(url, autocommit=True) as conn:
        refused = conn.execute("SELECT NOT has_table_privilege('belay_jobs', 'SELECT')")
        assert refused.fetchone() == (True,), "the forger may read belay_jobs"
        envelope = base64.b64encode(json.dumps(value).encode()).decode()
        notify(conn, json.dumps({"t": "r", "id": job_id, "s": "succeeded", "v": envelope}))


class Notifications:
    """A LISTEN connection of its own, as another process would hold it."""

    def __init__(self, db_url: str) -> None:
        self.url = db_url
        self.conn = psycopg.connect(db_url, autocommit=True)
        self.channel = channel_for(self.conn.info.dbname)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))

    def received(self) -> list[Any]:
        """Every notification committed so far, in order.

        Postgres delivers notifications in commit order, so everything committed
        before our sentinel arrives before it: no sleeping to prove an absence.
        """
        token = f"sentinel-{uuid.uuid4()}"
        with psycopg.connect(self.url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, token))
        seen: list[Any] = []
        for note in self.conn.notifies(timeout=10):
            if note.payload == token:
                return seen
            assert note.channel == self.channel
            seen.append(json.loads(note.payload))
        raise AssertionError("the sentinel notification never arrived")

    def close(self) -> None:
        self.conn.close()


# -- waiting on other backends ---------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    """Poll for a condition no event can announce (a backend blocked on a lock)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def other_sessions(conn: Conn) -> list[tuple[int, str]]:
    """The client sessions on ``conn``'s database besides ``conn``'s own
    (autovacuum's come and go): (pid, application_name) each."""
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_type = 'client backend' ORDER BY pid"
    ).fetchall()
    return [(int(pid), str(name)) for pid, name in rows]


def advisory_waiters(conn: Conn) -> int:
    """Backends of this database waiting for an advisory lock."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
        "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0])


# -- ETF vectors (tests/fixtures/etf/vectors.json) -------------------------------------------


def etf_vectors() -> list[dict[str, Any]]:
    """The vectors, as written by Erlang/OTP's ``term_to_binary``."""
    vectors: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text(encoding="ascii"))
    return vectors


def etf_by_name() -> dict[str, bytes]:
    """Each vector's ETF bytes, by vector name."""
    return {v["name"]: bytes.fromhex(v["etf_hex"]) for v in etf_vectors()}


def from_expected(spec: Any) -> Any:
    """Turn the tagged JSON of vectors.json into the Python value decode_etf must return."""
    if spec is None or isinstance(spec, (bool, int, str)):
        return spec
    if isinstance(spec, list):
        return [from_expected(item) for item in spec]
    assert isinstance(spec, dict) and len(spec) == 1, spec
    ((tag, body),) = spec.items()
    if tag == "int":
        return int(body)
    if tag == "float":
        return float(body)
    if tag == "bytes_hex":
        return bytes.fromhex(body)
    if tag == "tuple":
        return tuple(from_expected(item) for item in body)
    if tag == "list_repeat":
        item, count = body
        return [from_expected(item) for _ in range(count)]
    if tag == "map":
        result = {from_expected(k): from_expected(v) for k, v in body}
        assert len(result) == len(body), "fixture map keys collide in Python"
        return result
    raise AssertionError(f"unknown expected tag {tag!r}")


# -- worker runs -------------------------------------------------------------------------


class Ends:
    """Collects ``on_job_end`` events; ``wait_for(n)`` blocks until n arrived."""

    def __init__(self, *workers: Any) -> None:
        self.events: list[Any] = []
        self._cond = threading.Condition()
        for worker in workers:
            worker.on_job_end(self)

    def __call__(self, event: Any) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 15.0) -> list[Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.events) >= n, timeout):
                raise AssertionError(f"{len(self.events)} of {n} jobs ended in {timeout}s")
            return list(self.events)

    def outcomes(self) -> dict[int, str]:
        with self._cond:
            return {e.job.id: e.outcome for e in self.events}


def refuse_updates_of(conn: Conn, job_id: int) -> None:
    """A trigger that makes every UPDATE of one belay_jobs row fail: a row
    nothing can write, as a constraint or a broken extension can make one."""
    conn.execute(
        "CREATE OR REPLACE FUNCTION belay_test_refuse() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN RAISE EXCEPTION 'this row refuses updates'; END $$")
    conn.execute(
        f"CREATE TRIGGER belay_test_refuse_{job_id} BEFORE UPDATE ON belay_jobs FOR EACH ROW "
        f"WHEN (OLD.id = {int(job_id)}) EXECUTE FUNCTION belay_test_refuse()")


# -- subprocesses ------------------------------------------------------------------------


class Proc:
    """A subprocess whose output lines (stdout and stderr) a reader thread collects."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        assert self.popen.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.popen.stdout,),
                                        name=f"test-{name}-output", daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        """The first output line (already printed or coming) matching ``pattern``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = (f"exited ({self.popen.poll()})" if self._eof
                           else f"printed nothing more in {timeout:g}s")
                    raise AssertionError(f"{self.name} {why} without a line matching "
                                         f"{pattern!r}; output:\n" + "\n".join(self.lines))
                self._changed.wait(left)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 20.0) -> int:
        """Send ``sig`` unless it exited; its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._reader.join(5)
        assert self.popen.stdout is not None
        self.popen.stdout.close()
        return code
