"""What an idle worker costs: the queries it sends and the CPU it burns with no jobs.

One ``bench.belay_node`` process serves five queues of a fresh database,
with default settings (``poll_interval`` 0.5 s), once polling only and once
with ``--notify``. Its connections go through a small relay here that counts
every statement it sends (a simple Query or an extended-protocol Execute,
attributed to its SQL text), so the count is exact whatever the server's
configuration; ``pg_stat_statements`` needs ``shared_preload_libraries``. The
server's own transaction count for that database (``pg_stat_database``, read
from the admin database so the reading doesn't count) is kept as a cross-check.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import socket
import threading
import time
from collections import Counter
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import belay
from bench.core import Bench, Figure, cpu_seconds, processes

SECTION = "idle"
QUEUES = 5
WARMUP = 3.0
QUERY_TARGET = 2.0
CPU_TARGET = 1.0
#: Many idle queues on several processes (issue 39): statements per second in
#: total, and enqueue → start on any of them.
MANY_QUEUES, MANY_PROCESSES, MANY_WARMUP = 100, 4, 20.0
MANY_TARGET, START_TARGET_MS = 4.0, 50.0

NOTE = (
    "One worker process, {queues} queues (limit 10 each), no jobs, measured over "
    "{seconds:.0f} s after a {warmup:g} s warm-up. Queries: statements the worker sent "
    "(simple Query + Execute messages, counted on the wire by a relay; BEGIN/COMMIT "
    "count), divided by the number of queues. extra.transactions_per_s is the server's "
    "xact_commit + xact_rollback for the worker's own database (pg_stat_database, read "
    "from the admin database); PostgreSQL 15 backends flush those counters at most "
    "once a second, so each edge of the window is uncertain by about a second of "
    "activity, and autovacuum's transactions count too."
)


class _Tap:
    """A TCP relay in front of the server that counts the statements its clients
    send, by SQL text (a prepared statement's text comes from its Parse)."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._sockets: list[socket.socket] = []
        self._numbers = itertools.count()
        threading.Thread(target=self._accept, name="idle-tap", daemon=True).start()

    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _connect_upstream(self) -> socket.socket:
        host, port = self._upstream
        if host.startswith("/"):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock
        return socket.create_connection((host, port))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = self._connect_upstream()
            with self._lock:
                self._sockets += [client, server]
            n = next(self._numbers)
            threading.Thread(target=self._relay, args=(server, client),
                             name=f"idle-tap-down-{n}", daemon=True).start()
            threading.Thread(target=self._frontend, args=(client, server),
                             name=f"idle-tap-up-{n}", daemon=True).start()

    @staticmethod
    def _relay(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _frontend(self, client: socket.socket, server: socket.socket) -> None:
        """Relay what the client sends, counting its statements on the way."""
        stream = _Frontend()
        statements: dict[bytes, bytes] = {}
        bound = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                server.sendall(data)
                for kind, body in stream.feed(data):
                    if kind == b"P":
                        name, query = body.split(b"\0", 2)[:2]
                        statements[name] = query
                    elif kind == b"B":
                        bound = statements.get(body.split(b"\0", 2)[1], b"?")
                    elif kind in (b"E", b"Q"):
                        text = bound if kind == b"E" else body.split(b"\0", 1)[0]
                        with self._lock:
                            self._counts[_label(text)] += 1
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_WR)


class _Frontend:
    """Cuts what a client sends into protocol messages: first the startup message
    (no type byte; the relayed URL disables SSL and GSS, so nothing precedes it),
    then (type, body) pairs."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._started = False

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The messages ``data`` completes (the startup message is not returned)."""
        buffer = self._buffer
        buffer += data
        messages = []
        while True:
            head = 5 if self._started else 4
            if len(buffer) < head:
                break
            end = head - 4 + int.from_bytes(buffer[head - 4:head], "big")
            if len(buffer) < end:
                break
            if self._started:
                messages.append((bytes(buffer[:1]), bytes(buffer[head:end])))
            self._started = True
            del buffer[:end]
        return messages


def _label(sql: bytes) -> str:
    """The statement's first words, past its comment lines."""
    lines = sql.decode(errors="replace").splitlines()
    return " ".join(" ".join(line for line in lines
                             if not line.lstrip().startswith("--")).split())[:60]


def _relayed(url: str, port: int) -> str:
    """``url`` pointed at the relay, in clear (so the relay can read it)."""
    info = conninfo_to_dict(url)
    info.pop("hostaddr", None)
    info.update(host="127.0.0.1", port=str(port), sslmode="disable", gssencmode="disable")
    return make_conninfo(**info)  # type: ignore[arg-type]


def _transactions(admin: psycopg.Connection[Any], dbname: str) -> int:
    row = admin.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
        (dbname,),
    ).fetchone()
    return 0 if row is None else int(row[0])


def _measure(bench: Bench, seconds: float, *, notify: bool) -> list[Figure]:
    label = "poll_interval 0.5 s" + (", --notify" if notify else "")
    with psycopg.connect(bench.url, autocommit=True) as admin:
        server = (admin.info.host, admin.info.port)
        with bench.database("idle") as url:
            dbname = str(conninfo_to_dict(url)["dbname"])
            tap = _Tap(*server)
            queues = [arg for i in range(1, QUEUES + 1) for arg in ("--queue", f"q{i}=10")]
            try:
                with processes(1, "bench.belay_node", "--url", _relayed(url, tap.port),
                               *queues, *(["--notify"] if notify else [])) as (proc,):
                    time.sleep(WARMUP)
                    counts, xacts = tap.counts(), _transactions(admin, dbname)
                    cpu, start = cpu_seconds(proc.pid), time.monotonic()
                    time.sleep(seconds)
                    counts = tap.counts() - counts
                    xacts = _transactions(admin, dbname) - xacts
                    cpu_end, wall = cpu_seconds(proc.pid), time.monotonic() - start
            finally:
                tap.close()
    if cpu is None or cpu_end is None:
        raise RuntimeError("the worker's CPU time is unreadable (no /proc?)")
    statements = sum(counts.values())
    per_queue = statements / wall / QUEUES
    cpu_percent = (cpu_end - cpu) / wall * 100
    note = NOTE.format(queues=QUEUES, seconds=wall, warmup=WARMUP)
    extra = {
        "window_s": round(wall, 1),
        "statements_per_s": round(statements / wall, 2),
        "transactions_per_s": round(xacts / wall, 2),
        "by_statement_per_s": {sql: round(n / wall, 2) for sql, n in counts.most_common()},
    }
    return [
        Figure(SECTION, f"queries/s per queue ({label})", per_queue, "queries/s",
               higher_is_better=False, target=f"≤ {QUERY_TARGET:g} per queue",
               met=per_queue <= QUERY_TARGET, note=note, extra=extra),
        Figure(SECTION, f"worker CPU ({label})", cpu_percent, "% of a core",
               higher_is_better=False, target=f"< {CPU_TARGET:g} % of a core",
               met=cpu_percent < CPU_TARGET,
               note=note + " CPU: user + system seconds of the worker process over the "
                           "window, per wall second.",
               extra={"window_s": round(wall, 1), "cpu_s": round(cpu_end - cpu, 3)}),
    ]


def _many(bench: Bench, seconds: float) -> list[Figure]:
    """``MANY_PROCESSES`` worker processes each serving the same
    ``MANY_QUEUES`` queues (limit 10 each, ``--notify``), no jobs: statements
    per second from all of them together, counted by the relay after a
    warm-up long enough for every queue to have gone idle (and its backstop
    to have run out at least once); then one job at a time into a random
    queue, each after the last started, for enqueue → start."""
    samples = bench.size(10, 40)
    with psycopg.connect(bench.url, autocommit=True) as admin:
        server = (admin.info.host, admin.info.port)
        with bench.database("idle_many") as url:
            tap = _Tap(*server)
            queues = [arg for i in range(MANY_QUEUES) for arg in ("--queue", f"q{i}=10")]
            try:
                with processes(MANY_PROCESSES, "bench.belay_node", "--url",
                               _relayed(url, tap.port), *queues, "--notify"):
                    time.sleep(MANY_WARMUP)
                    counts, start = tap.counts(), time.monotonic()
                    time.sleep(seconds)
                    counts, wall = tap.counts() - counts, time.monotonic() - start
                    starts = _starts(url, samples)
            finally:
                tap.close()
    total = sum(counts.values()) / wall
    starts.sort()
    p50 = starts[len(starts) // 2]
    note = (f"{MANY_PROCESSES} worker processes (bench.belay_node --notify), each serving "
            f"the same {MANY_QUEUES} queues (limit 10 each), no jobs; statements counted on "
            f"the wire over {wall:.0f} s after a {MANY_WARMUP:g} s warm-up (poll_interval "
            "0.5 s, sweep_interval 5 s, queue sync and cron at their defaults)")
    return [
        Figure(SECTION, f"statements/s, {MANY_QUEUES} idle queues x {MANY_PROCESSES} "
                        "processes, in total", total, "statements/s", higher_is_better=False,
               target=f"≤ {MANY_TARGET:g}", met=total <= MANY_TARGET, note=note,
               extra={"by_statement_per_s": {sql: round(n / wall, 2)
                                             for sql, n in counts.most_common()}}),
        Figure(SECTION, f"enqueue → start p50, {MANY_QUEUES} idle queues x "
                        f"{MANY_PROCESSES} processes", p50, "ms", higher_is_better=False,
               target=f"≤ {START_TARGET_MS:g} ms", met=p50 <= START_TARGET_MS,
               note=f"{len(starts)} jobs, one at a time, each into a random one of the idle "
                    "queues (belay.Belay(notify=True).enqueue); started_at - inserted_at "
                    "from the row (one clock: the same machine)",
               extra={"p95_ms": round(starts[int(len(starts) * 0.95) - 1], 1)}),
    ]


def _starts(url: str, samples: int) -> list[float]:
    """Milliseconds from enqueue to start of ``samples`` jobs, one at a time,
    each into a random idle queue."""
    rng = random.Random(39)
    starts = []
    with belay.Belay(url, notify=True) as client, psycopg.connect(url, autocommit=True) as conn:
        for _ in range(samples):
            job = client.enqueue("noop", {}, queue=f"q{rng.randrange(MANY_QUEUES)}")
            deadline = time.monotonic() + 30
            while True:
                row = conn.execute(
                    "SELECT extract(epoch FROM started_at - inserted_at) * 1000 "
                    "FROM belay_jobs WHERE id = %s AND started_at IS NOT NULL",
                    (job.id,)).fetchone()
                if row is not None:
                    starts.append(float(row[0]))
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job.id} did not start in 30 s")
                time.sleep(0.005)
            time.sleep(rng.uniform(0.2, 0.6))  # let the queue go quiet again
    return starts


def run(bench: Bench) -> list[Figure]:
    seconds = bench.size(10, 60)
    figures = []
    for notify in (False, True):
        bench.log(f"idle: {QUEUES} queues{' with --notify' if notify else ''}, {seconds} s")
        figures += _measure(bench, seconds, notify=notify)
    bench.log(f"idle: {MANY_QUEUES} queues x {MANY_PROCESSES} processes, {seconds} s")
    return figures + _many(bench, seconds)
