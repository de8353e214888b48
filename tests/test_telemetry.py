"""Worker telemetry: the ``on_job_start`` / ``on_job_end`` hooks with outcomes and
durations, and the Prometheus metrics of :mod:`belay.telemetry` scraped over real
HTTP from a real worker (in this process, and as ``belay worker --metrics-port``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

import belay
from belay import store
from belay.context import Park
from belay.errors import ConfigurationError
from belay.runner import OUTCOMES, JobEnd
from belay.telemetry import PrometheusMetrics, start_metrics
from tests.helpers import Ends
from tests.test_worker import make_worker, running

Conn = psycopg.Connection[Any]
REPO = Path(__file__).resolve().parent.parent

#: (sample name, sorted labels) → value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def named(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def db_depths(conn: Conn) -> dict[tuple[str, str], int]:
    rows = conn.execute("SELECT queue, state, count(*) FROM belay_jobs GROUP BY 1, 2")
    return {(queue, state): count for queue, state, count in rows.fetchall()}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- the hooks ----------------------------------------------------------------------------------


def test_hooks_report_each_execution_with_its_outcome(client: belay.Belay) -> None:
    reg = belay.Registry()

    @belay.worker(name="t.ok", registry=reg)
    def ok(ctx: belay.Context) -> int:
        return int(ctx.input["n"])

    @belay.worker(name="t.boom", registry=reg, backoff=lambda n: 60.0)
    def boom(ctx: belay.Context) -> None:
        raise ValueError(f"boom {ctx.attempt}")

    @belay.worker(name="t.nap", registry=reg)
    def nap(ctx: belay.Context) -> None:
        raise belay.Snooze(60)

    @belay.worker(name="t.quit", registry=reg)
    def quit_(ctx: belay.Context) -> None:
        raise belay.Cancel("not today")

    @belay.worker(name="t.wait", registry=reg)
    def wait(ctx: belay.Context) -> Any:
        return ctx.await_signal("go")

    worker = make_worker(client, reg)
    seen: list[tuple[str, int]] = []
    ends: list[JobEnd] = []
    worker.on_job_start(lambda job: seen.append(("start", job.id)))

    @worker.on_job_end
    def ended(end: JobEnd) -> None:
        seen.append(("end", end.job.id))
        ends.append(end)

    jobs = {
        "succeeded": client.enqueue(ok, {"n": 7}),
        "retry": client.enqueue(boom, max_attempts=2),
        "failed": client.enqueue(boom, max_attempts=1),
        "snooze": client.enqueue(nap),
        "cancelled": client.enqueue(quit_),
        "await": client.enqueue(wait),
    }
    assert worker.drain() == dict.fromkeys(jobs, 1)

    for job in jobs.values():  # one start, then one end, per execution
        assert [step for step, i in seen if i == job.id] == ["start", "end"]
    by_id = {end.job.id: end for end in ends}
    assert len(ends) == len(by_id) == len(jobs)
    for outcome, job in jobs.items():
        end = by_id[job.id]
        assert end.outcome == outcome and end.outcome in OUTCOMES
        assert end.job.kind == job.kind and end.job.attempt == 1
        assert isinstance(end.duration, float) and end.duration >= 0

    success = by_id[jobs["succeeded"].id]
    assert (success.error, success.exception) == (None, None)
    for outcome in ("retry", "failed"):
        end = by_id[jobs[outcome].id]
        assert isinstance(end.exception, ValueError) and str(end.exception) == "boom 1"
        assert end.error["error"] == "ValueError: boom 1" and end.error["attempt"] == 1
    cancelled = by_id[jobs["cancelled"].id]
    assert isinstance(cancelled.exception, belay.Cancel)
    assert cancelled.error == {"reason": "not today"}
    assert isinstance(by_id[jobs["snooze"].id].exception, belay.Snooze)
    assert isinstance(by_id[jobs["await"].id].exception, Park)


def test_on_job_start_runs_on_the_executor_thread_before_the_function(
    client: belay.Belay,
) -> None:
    reg = belay.Registry()
    ran: dict[int, str] = {}

    @belay.worker(name="t.mark", registry=reg)
    def mark(ctx: belay.Context) -> None:
        ran[ctx.id] = threading.current_thread().name

    worker = make_worker(client, reg, {"default": 3})
    starts: dict[int, tuple[str, bool]] = {}

    @worker.on_job_start
    def started(job: belay.Job) -> None:
        starts[job.id] = (threading.current_thread().name, job.id in ran)

    ends = Ends(worker)
    with running(worker):
        jobs = client.enqueue_many([{"kind": "t.mark"} for _ in range(3)])
        ends.wait_for(3)
    assert set(starts) == {job.id for job in jobs}
    for job in jobs:
        thread, function_ran_first = starts[job.id]
        assert thread.startswith("belay-exec-") and not function_ran_first
        assert ran[job.id] == thread


HOLD = 0.3


@pytest.mark.parametrize("outcome", ["succeeded", "retry"])
def test_duration_covers_the_time_the_job_held(client: belay.Belay, outcome: str) -> None:
    reg = belay.Registry()
    entered, release = threading.Event(), threading.Event()

    @belay.worker(name="t.hold", registry=reg, backoff=lambda n: 60.0)
    def hold(ctx: belay.Context) -> None:
        entered.set()
        assert release.wait(30)
        if ctx.input["fail"]:
            raise RuntimeError("after the hold")

    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        client.enqueue(hold, {"fail": outcome == "retry"})
        assert entered.wait(10)
        began = time.monotonic()
        time.sleep(HOLD)  # the job holds for this long: the duration under test
        held = time.monotonic() - began
        release.set()
        [end] = ends.wait_for(1)
    assert end.outcome == outcome
    assert end.duration >= held >= HOLD


def test_raising_hooks_are_logged_and_never_break_the_job(
    client: belay.Belay, sql_conn: Conn, caplog: pytest.LogCaptureFixture,
) -> None:
    reg = belay.Registry()
    belay.worker(name="t.plain", registry=reg)(lambda ctx: ctx.input["n"])
    worker = make_worker(client, reg)

    @worker.on_job_start
    def broken_start(job: belay.Job) -> None:
        raise RuntimeError("start hook down")

    @worker.on_job_end
    def broken_end(end: JobEnd) -> None:
        raise RuntimeError("end hook down")

    later_starts: list[int] = []
    worker.on_job_start(lambda job: later_starts.append(job.id))  # after the broken one
    ends = Ends(worker)
    with caplog.at_level(logging.ERROR, logger="belay.worker"), running(worker):
        jobs = client.enqueue_many([{"kind": "t.plain", "input": {"n": n}} for n in range(4)])
        ends.wait_for(4)
    assert sorted(later_starts) == sorted(job.id for job in jobs)
    assert ends.outcomes() == {job.id: "succeeded" for job in jobs}
    rows = sql_conn.execute("SELECT state, count(*) FROM belay_jobs GROUP BY state").fetchall()
    assert dict(rows) == {"succeeded": 4}
    for which, text in (("on_job_start", "start hook down"), ("on_job_end", "end hook down")):
        records = [r for r in caplog.records if f"{which} hook" in r.getMessage()]
        assert len(records) == 4
        assert all(r.exc_info and str(r.exc_info[1]) == text for r in records)


def test_a_run_whose_ack_crashes_still_ends_once(client: belay.Belay, sql_conn: Conn) -> None:
    """A database error while recording the run (here a trigger refusing every
    ack): the single ack of a failure and the batched ack of a success both end
    their execution as ``crashed``, and nothing stays in flight."""
    sql_conn.execute("CREATE FUNCTION refuse_acks() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN RAISE EXCEPTION 'ack refused by the test'; END $$")
    sql_conn.execute("CREATE TRIGGER refuse_acks BEFORE UPDATE ON belay_jobs FOR EACH ROW "
                     "WHEN (NEW.state <> 'running') EXECUTE FUNCTION refuse_acks()")
    reg = belay.Registry()
    belay.worker(name="t.fine", registry=reg)(lambda ctx: "fine")

    @belay.worker(name="t.bad", registry=reg)
    def bad(ctx: belay.Context) -> None:
        raise ValueError("bad")

    worker = make_worker(client, reg)
    metrics = PrometheusMetrics(worker, queue_depths=False)
    ends = Ends(worker)
    with running(worker):
        fine, failing = client.enqueue("t.fine"), client.enqueue(bad)
        events = ends.wait_for(2)
    assert {e.job.id: e.outcome for e in events} == {fine.id: "crashed", failing.id: "crashed"}
    for event in events:
        assert isinstance(event.exception, psycopg.errors.RaiseException)
        assert "ack refused by the test" in str(event.exception)
    assert len(ends.events) == 2  # once each
    for kind in ("t.fine", "t.bad"):
        assert metrics.registry.get_sample_value(
            "belay_jobs_finished_total",
            {"queue": "default", "kind": kind, "outcome": "crashed"}) == 1
        assert metrics.registry.get_sample_value(
            "belay_jobs_in_flight", {"queue": "default", "kind": kind}) == 0


def test_a_chunk_whose_later_ack_crashes_leaves_a_handed_off_success_to_the_batch(
    client: belay.Belay, sql_conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a chunk, job A's success goes to the batched ack (held up here),
    then job B's ack fails: B ends ``crashed`` and A ends once, ``succeeded``,
    when the batch is written — never ``crashed`` first."""
    gate, handed = threading.Event(), threading.Event()
    real = store.ack_succeeded_many

    def held(conn: Any, acks: Any, *args: Any, **kwargs: Any) -> Any:
        handed.set()
        assert gate.wait(15)
        return real(conn, acks, *args, **kwargs)

    monkeypatch.setattr(store, "ack_succeeded_many", held)
    reg = belay.Registry()

    @belay.worker(name="t.pair", registry=reg, chunk={"size": 2, "gather_ms": 0})
    def pair(ctxs: list[belay.Context]) -> dict[int, Any]:
        first, second = sorted(ctx.id for ctx in ctxs)
        return {first: "fine", second: ValueError("bad")}

    fine, bad = client.enqueue(pair), client.enqueue(pair)
    sql_conn.execute("CREATE FUNCTION refuse_ack() RETURNS trigger LANGUAGE plpgsql AS "
                     "$$ BEGIN RAISE EXCEPTION 'ack refused by the test'; END $$")
    sql_conn.execute(f"CREATE TRIGGER refuse_ack BEFORE UPDATE ON belay_jobs FOR EACH ROW "
                     f"WHEN (NEW.id = {bad.id} AND NEW.state <> 'running') "
                     "EXECUTE FUNCTION refuse_ack()")
    worker = make_worker(client, reg)
    ends = Ends(worker)
    with running(worker):
        assert handed.wait(15)
        ends.wait_for(1)
        gate.set()
        ends.wait_for(2)
    assert [(e.job.id, e.outcome) for e in ends.events] == [(bad.id, "crashed"),
                                                             (fine.id, "succeeded")]


# -- Prometheus ---------------------------------------------------------------------------------


def test_metrics_endpoint_counts_what_the_worker_ran(client: belay.Belay, sql_conn: Conn) -> None:
    reg = belay.Registry()
    send = belay.worker(name="t.send", queue="mail", registry=reg)(lambda ctx: ctx.input["n"])

    @belay.worker(name="t.flaky", queue="bulk", registry=reg, backoff=lambda n: 0.0,
                  max_attempts=2)
    def flaky(ctx: belay.Context) -> None:
        raise RuntimeError("always")

    entered, release = threading.Event(), threading.Event()

    @belay.worker(name="t.hold", queue="mail", registry=reg)
    def hold(ctx: belay.Context) -> None:
        entered.set()
        assert release.wait(30)

    worker = make_worker(client, reg, {"mail": 4, "bulk": 2})
    server = start_metrics(worker, port=0)
    # Registered after the metrics' hooks: once Ends saw an end, the metrics did.
    ends = Ends(worker)
    client.enqueue_many([{"kind": "t.send", "queue": "later"} for _ in range(3)])  # never run
    with running(worker):
        client.enqueue_many([{"kind": send, "input": {"n": n}} for n in range(5)]
                            + [{"kind": flaky} for _ in range(2)])
        ends.wait_for(5 + 2 * 2)
        client.enqueue(hold)
        assert entered.wait(10)
        during = scrape(server.url)
        release.set()
        ends.wait_for(5 + 2 * 2 + 1)
        after = scrape(server.url)
        depths = db_depths(sql_conn)
    assert value(during, "belay_jobs_in_flight", queue="mail", kind="t.hold") == 1
    assert value(after, "belay_jobs_in_flight", queue="mail", kind="t.hold") == 0
    assert set(named(after, "belay_jobs_in_flight").values()) == {0}

    assert named(after, "belay_jobs_started_total") == {
        (("kind", "t.send"), ("queue", "mail")): 5,
        (("kind", "t.flaky"), ("queue", "bulk")): 4,
        (("kind", "t.hold"), ("queue", "mail")): 1,
    }
    expected = {("mail", "t.send", "succeeded"): 5, ("bulk", "t.flaky", "retry"): 2,
                ("bulk", "t.flaky", "failed"): 2, ("mail", "t.hold", "succeeded"): 1}
    finished = {(dict(k)["queue"], dict(k)["kind"], dict(k)["outcome"]): v
                for k, v in named(after, "belay_jobs_finished_total").items()}
    assert finished == expected
    for (queue, kind, outcome), count in expected.items():
        labels = {"queue": queue, "kind": kind, "outcome": outcome}
        assert value(after, "belay_job_duration_seconds_count", **labels) == count
        assert value(after, "belay_job_duration_seconds_bucket", le="+Inf", **labels) == count
        total = value(after, "belay_job_duration_seconds_sum", **labels)
        assert total is not None and total >= 0

    # Queue depths: the database's counts, every state of every queue (0 when none).
    reported = {(dict(k)["queue"], dict(k)["state"]): v
                for k, v in named(after, "belay_queue_jobs").items()}
    assert {q for q, _ in reported} == {"mail", "bulk", "later"}
    assert {s for _, s in reported} == set(belay.job.STATES)
    assert reported == {key: depths.get(key, 0) for key in reported}
    assert set(depths) <= set(reported)
    assert reported[("later", "ready")] == 3 and reported[("mail", "succeeded")] == 6
    assert value(after, "belay_queue_stats_up") == 1
    assert value(after, "process_cpu_seconds_total") is not None  # start_metrics' own registry

    # The worker stopped: so did its endpoint and its thread.
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)
    assert not [t for t in threading.enumerate() if t.name.startswith("belay-metrics")]


def test_a_failing_queue_depth_read_answers_with_up_zero(
    client: belay.Belay, sql_conn: Conn, caplog: pytest.LogCaptureFixture,
) -> None:
    reg = belay.Registry()
    worker = make_worker(client, reg, {"mail": 1})
    client.enqueue("t.any", queue="mail")
    with caplog.at_level(logging.INFO, logger="belay.telemetry"), \
            start_metrics(worker, port=0) as server:
        assert value(scrape(server.url), "belay_queue_jobs", queue="mail", state="ready") == 1
        sql_conn.execute("ALTER TABLE belay_jobs RENAME TO belay_jobs_away")
        try:
            for _ in range(2):
                down = scrape(server.url)  # still a 200
                assert value(down, "belay_queue_stats_up") == 0
                assert named(down, "belay_queue_jobs") == {}
                assert named(down, "belay_jobs_started_total") == {}  # the rest is there
                assert value(down, "process_cpu_seconds_total") is not None
        finally:
            sql_conn.execute("ALTER TABLE belay_jobs_away RENAME TO belay_jobs")
        back = scrape(server.url)
    assert value(back, "belay_queue_stats_up") == 1
    assert value(back, "belay_queue_jobs", queue="mail", state="ready") == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "belay.telemetry"]
    assert len([m for m in messages if "reading queue depths failed" in m]) == 1  # per outage
    assert any("belay_jobs" in m for m in messages if "failed" in m)
    assert len([m for m in messages if "works again" in m]) == 1


def test_an_unreachable_database_answers_at_once_with_up_zero() -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    worker = belay.Worker(["mail"], client=belay.Belay(
        f"postgresql://postgres@127.0.0.1:{port}/nothing"), registry=belay.Registry())
    with start_metrics(worker, port=0) as server:
        samples = scrape(server.url)  # a 200 (within urlopen's timeout)
    assert value(samples, "belay_queue_stats_up") == 0
    assert named(samples, "belay_queue_jobs") == {}


def test_user_errors_say_what_to_do(client: belay.Belay, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker(client, belay.Registry())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigurationError,
                           match=r"cannot listen on 127\.0\.0\.1:.*--metrics-port"):
            start_metrics(worker, port=taken.getsockname()[1])
    with pytest.raises(ConfigurationError, match="0 to 65535"):
        start_metrics(worker, port=70000)

    metrics = PrometheusMetrics(worker)
    with pytest.raises(ConfigurationError, match="already in this registry"):
        PrometheusMetrics(worker, metrics.registry)

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'belay\[metrics\]'"):
        start_metrics(worker, port=0)
    with pytest.raises(ConfigurationError, match=r"pip install 'belay\[metrics\]'"):
        PrometheusMetrics(worker)


# -- belay worker --metrics-port ---------------------------------------------------------------


def test_belay_worker_serves_metrics_until_sigterm(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "BELAY_DATABASE_URL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    log_path = tmp_path / "worker.log"
    with belay.Belay(db_url) as real_clock_client:
        real_clock_client.enqueue_many(
            [{"kind": "telemetry.echo", "queue": "tele", "input": {"n": n}} for n in range(4)]
            + [{"kind": "telemetry.flaky", "queue": "tele"}])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "belay", "worker", "--url", db_url,
             "--import", "tests.telemetry_jobs", "--queue", "tele=4",
             "--poll-interval", "0.1", "--metrics-port", str(port)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(OSError):
                samples = scrape(url)
                succeeded = value(samples, "belay_jobs_finished_total", queue="tele",
                                  kind="telemetry.echo", outcome="succeeded")
                if succeeded == 4 and value(
                        samples, "belay_jobs_finished_total", queue="tele",
                        kind="telemetry.flaky", outcome="succeeded") == 1:
                    break
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert value(samples, "belay_jobs_finished_total", queue="tele",
                     kind="telemetry.flaky", outcome="retry") == 1
        assert value(samples, "belay_jobs_started_total", queue="tele",
                     kind="telemetry.flaky") == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    assert f"serving http://127.0.0.1:{port}/metrics" in log_text
    assert "stopped serving" in log_text
    with pytest.raises(urllib.error.URLError):
        scrape(f"http://127.0.0.1:{port}/metrics")
