"""`belay demo` runs end to end against a real database and leaves real rows."""

from __future__ import annotations

import subprocess
import sys

import psycopg


def test_demo_runs_a_worker_and_reports_every_outcome(db_url):
    done = subprocess.run(
        [sys.executable, "-m", "belay", "demo", "--url", db_url],
        capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "1 duplicate of a unique key" in out
    for outcome in ("succeeded", "retry", "failed", "cancelled", "snooze"):
        assert f"→ {outcome}" in out, outcome
    with psycopg.connect(db_url) as conn:
        states = dict(conn.execute(
            "SELECT kind || ':' || state, count(*) FROM belay_jobs GROUP BY 1"
        ).fetchall())
    assert states == {
        "demo.send_welcome:succeeded": 8,
        "demo.send_welcome:ready": 1,
        "demo.flaky_api:succeeded": 1,
        "demo.broken:failed": 1,
        "demo.moderate:succeeded": 1,
        "demo.moderate:cancelled": 1,
        "demo.wait_a_bit:succeeded": 1,
        "demo.research_agent:succeeded": 1,
        "demo.summarize_chunk:succeeded": 3,
    }
    assert "no terminal: approving automatically" in out
    assert "spent $0.06 and 3600 tokens" in out
