"""``belay demo``: a live tour on a real PostgreSQL.

With no URL it starts an embedded server (extra ``embedded``), migrates it,
enqueues jobs that succeed, retry, fail, cancel and snooze, runs a worker with
live progress, and prints a summary — every line read back from the database.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from belay.client import Belay
from belay.context import TIMEOUT, Context, Cost
from belay.embedded import embedded_server
from belay.enqueue import JobSpec, Unique
from belay.errors import JobCancelled, JobFailed
from belay.outcome import Cancel, Snooze
from belay.redact import redact, secrets_of
from belay.registry import Registry, worker
from belay.runner import JobEnd, Worker

Say = Callable[[str], None]


def run(url: str | None = None, say: Say = print) -> None:
    if url is None:
        say("starting an embedded PostgreSQL (no --url given)…")
        with embedded_server() as embedded:
            _tour(embedded, say)
            say(f"the data lived in the embedded server at {embedded}; it is removed on exit. "
                "Pass --url to keep it in your own database.")
    else:
        _tour(url, say)
        say(f"the data is in {redact(url, secrets_of(url))}: look at the belay_jobs table.")


def _workers(registry: Registry) -> None:
    def fast(attempt: int) -> float:
        return 0.2  # seconds between retries: a demo shouldn't wait minutes

    @worker(name="demo.send_welcome", queue="mailers", registry=registry, backoff=fast)
    def send_welcome(ctx: Context) -> Any:
        time.sleep(random.uniform(0.05, 0.3))
        return {"sent_to": ctx.input["user_id"]}

    @worker(name="demo.flaky_api", max_attempts=5, registry=registry, backoff=fast)
    def flaky_api(ctx: Context) -> Any:
        if ctx.attempt < 3:
            raise ConnectionError(f"upstream timed out (attempt {ctx.attempt})")
        return {"ok": True, "attempts": ctx.attempt}

    @worker(name="demo.broken", max_attempts=2, registry=registry, backoff=fast)
    def broken(ctx: Context) -> Any:
        raise ValueError("this job always fails")

    @worker(name="demo.moderate", registry=registry)
    def moderate(ctx: Context) -> Any:
        if ctx.input.get("spam"):
            raise Cancel("looks like spam")
        return {"approved": True}

    @worker(name="demo.wait_a_bit", registry=registry)
    def wait_a_bit(ctx: Context) -> Any:
        # The first run finds ready_at still at its enqueue time: come back later.
        if ctx.job.ready_at == ctx.job.inserted_at:
            raise Snooze(0.5)
        return {"done": True, "attempt": ctx.attempt}


def _agent_workers(registry: Registry) -> None:
    @worker(name="demo.summarize_chunk", queue="tools", registry=registry)
    def summarize_chunk(ctx: Context) -> Any:
        time.sleep(random.uniform(0.05, 0.2))
        return f"summary of {ctx.input['chunk']}"

    @worker(name="demo.research_agent", queue="ai", registry=registry)
    def research_agent(ctx: Context) -> Any:
        def llm_turn(n: int) -> Callable[[], str]:
            return lambda: f"finding #{n}"  # a real agent calls its model here

        for n in range(1, 4):
            turn = ctx.step(f"turn-{n}", llm_turn(n), cost=Cost(usd=0.02, tokens=1_200))
            ctx.emit({"turn": n, "summary": turn})
        decision = ctx.await_signal("approval", timeout=3600)
        if decision is TIMEOUT or not decision.get("approved"):
            raise Cancel("not approved")
        parts = ctx.map_children("chunks", "demo.summarize_chunk",
                                 [{"chunk": c} for c in ("intro", "method", "results")])
        return {"report": [p.result for p in parts]}


def _agent(client: Belay, registry: Registry, say: Say, ask: Callable[[], bool]) -> None:
    say("")
    say("an agent run: three paid LLM turns (simulated), a human approval, a fan-out …")
    agent = client.enqueue("demo.research_agent", budget={"usd": 0.10, "tokens": 10_000})
    runner = Worker({"ai": 1, "tools": 3}, client=client, registry=registry,
                    busy_poll=0.02, poll_interval=0.1, notify=True)
    with runner:
        for event in client.subscribe_events(agent.id, timeout=30):
            say(f"  event {event.seq}: {event.payload}")
            if event.payload.get("turn") == 3:
                break
        deadline = time.monotonic() + 30
        while (row := client.get_job(agent.id)) is not None and row.state != "awaiting":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent job {agent.id} never parked")
            time.sleep(0.05)
        say(f"  job {agent.id} is parked awaiting 'approval' (no thread, no lease held)")
        approved = ask()
        client.signal_job(agent.id, "approval", {"approved": approved})
        with contextlib.suppress(JobFailed, JobCancelled):
            client.await_result(agent.id, timeout=30)
    done = client.get_job(agent.id)
    if done is not None:
        kids = client.list_jobs(parent_id=agent.id)
        say(f"  → {done.state}: {done.result or done.errors[-1:]}; spent ${done.spent_usd:.2f} "
            f"and {done.spent_tokens} tokens of a $0.10 budget; {len(kids)} child jobs")


def approve_from_terminal(say: Say) -> Callable[[], bool]:
    def ask() -> bool:
        if not sys.stdin.isatty():
            say("  (no terminal: approving automatically)")
            return True
        answer = input("  approve? [Y/n] ").strip().lower()
        return answer in ("", "y", "yes")

    return ask


def _tour(url: str, say: Say) -> None:
    registry = Registry()
    _workers(registry)
    _agent_workers(registry)
    with Belay(url, verify_schema=False, registry=registry) as client:
        applied = client.migrate()
        say(f"migrated: applied {applied or 'nothing'}; {client.check_schema().describe()}")

        jobs = client.enqueue_many(
            [JobSpec("demo.send_welcome", {"user_id": n}, unique=f"welcome:{n}")
             for n in range(1, 9)]
            + [
                JobSpec("demo.flaky_api", {"call": "charge"}),
                JobSpec("demo.broken"),
                JobSpec("demo.moderate", {"text": "hello"}),
                JobSpec("demo.moderate", {"text": "BUY NOW", "spam": True}),
                JobSpec("demo.wait_a_bit"),
                JobSpec("demo.send_welcome", {"user_id": 1}, unique=Unique("welcome:1")),
            ]
        )
        fresh = [j for j in jobs if not j.duplicate]
        say(f"enqueued {len(fresh)} jobs in one statement "
            f"({len(jobs) - len(fresh)} duplicate of a unique key came back as its holder)")
        later = client.enqueue("demo.send_welcome", {"user_id": 99}, delay=3600)
        say(f"scheduled job {later.id} for {later.ready_at:%H:%M:%S %Z} (it will wait)")

        lock = threading.Lock()

        def progress(end: JobEnd) -> None:
            with lock:
                say(f"  job {end.job.id:>3} {end.job.kind:<18} attempt {end.job.attempt} "
                    f"→ {end.outcome:<9} ({end.duration * 1000:.0f} ms)")

        say("running a worker: mailers=4, default=2 …")
        runner = Worker({"mailers": 4, "default": 2}, client=client, registry=registry,
                        busy_poll=0.02, poll_interval=0.1, notify=True)
        runner.on_job_end(progress)
        with runner:
            for enqueued in fresh:
                with contextlib.suppress(JobFailed, JobCancelled):
                    client.await_result(enqueued.id, timeout=30)

        say("")
        say(f"{'id':>4}  {'kind':<18} {'state':<10} {'attempts':>8}  result / last error")
        for listed in [*fresh, later]:
            row = client.get_job(listed.id)
            if row is None:
                continue
            job = row
            detail = job.result if job.state == "succeeded" else (
                job.errors[-1] if job.errors else "")
            if isinstance(detail, dict):
                detail = {k: v for k, v in detail.items() if k != "traceback"}
            say(f"{job.id:>4}  {job.kind:<18} {job.state:<10} {job.attempt:>8}  {detail}")
        say("")
        _agent(client, registry, say, approve_from_terminal(say))
        say("")
        for queue, counts in sorted(client.stats().items()):
            say(f"queue {queue:<8} " + ", ".join(f"{s}={n}" for s, n in sorted(counts.items())))
