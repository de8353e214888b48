"""``belay demo``: a live tour of the client on a real PostgreSQL.

With no URL it starts an embedded server (extra ``embedded``), migrates it and
walks through enqueueing, uniqueness, signals, cancel, retry and reads — every
step a real round trip, every number read back from the database.
"""

from __future__ import annotations

from collections.abc import Callable

from belay.client import Belay
from belay.embedded import embedded_server
from belay.enqueue import JobSpec, Unique


def run(url: str | None = None, say: Callable[[str], None] = print) -> None:
    if url is None:
        say("starting an embedded PostgreSQL (no --url given)…")
        with embedded_server() as embedded:
            _tour(embedded, say)
    else:
        _tour(url, say)


def _tour(url: str, say: Callable[[str], None]) -> None:
    with Belay(url, verify_schema=False) as client:
        applied = client.migrate()
        say(f"migrated: applied {applied or 'nothing'}; {client.check_schema().describe()}")

        job = client.enqueue(
            "demo.send_welcome", {"user_id": 42}, queue="mailers",
            unique="welcome:42", budget={"usd": 0.5, "tokens": 10_000},
        )
        say(f"enqueued job {job.id} ({job.kind}) on {job.queue!r}: state {job.state}, "
            f"budget ${job.budget_usd} / {job.budget_tokens} tokens")

        again = client.enqueue("demo.send_welcome", {"user_id": 42}, unique="welcome:42")
        say(f"enqueued the same unique key again: duplicate={again.duplicate}, "
            f"returned the holder, job {again.id}")

        batch = client.enqueue_many(
            [JobSpec("demo.summarize", {"chunk": i}, queue="ai") for i in range(5)]
            + [JobSpec("demo.digest", unique=Unique("digest", mode="window", window=3600))]
        )
        say(f"enqueue_many inserted {len(batch)} jobs in one statement: "
            f"ids {[j.id for j in batch]}")

        later = client.enqueue("demo.reminder", delay=3600)
        say(f"scheduled job {later.id} for {later.ready_at:%Y-%m-%d %H:%M:%S %Z}")

        woken = client.signal_job(job.id, "approval", {"approved": True})
        say(f"delivered signal 'approval' to job {job.id} (jobs woken now: {woken}; the "
            "signal persists, so a job that awaits it later finds it at once)")

        status = client.cancel_job(later.id)
        cancelled = client.get_job(later.id)
        errors = cancelled.errors if cancelled is not None else []
        say(f"cancel_job({later.id}) → {status}; its errors: {errors}")
        retried = client.retry_job(later.id)
        say(f"retry_job({later.id}) → state {retried.state}")

        say("stats per queue and state:")
        for queue, counts in sorted(client.stats().items()):
            say(f"  {queue:<10} " + ", ".join(f"{s}={n}" for s, n in sorted(counts.items())))
        newest = client.list_jobs(limit=3)
        say(f"newest three jobs: {[(j.id, j.kind) for j in newest]}")
        say("done — run a worker to execute these (belay worker, coming with the Worker issue)")
