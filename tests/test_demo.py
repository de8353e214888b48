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


def test_the_agent_demo_runs_a_pydantic_ai_agent_through_an_approval(db_url):
    import importlib.util
    import os

    if importlib.util.find_spec("pydantic_ai") is None:
        if os.environ.get("CI") and sys.version_info >= (3, 11):
            raise AssertionError("pydantic-ai is missing: CI on Python >= 3.11 installs it")
        import pytest

        pytest.skip("the pydantic-ai extra needs Python >= 3.11")
    done = subprocess.run(
        [sys.executable, "-m", "belay", "demo", "--agent", "--url", db_url],
        capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "the agent asks to approve book_table" in out
    assert "paused over its budget after" in out and "parked on '$top_up'" in out
    assert "an operator tops it up by 10000 tokens" in out
    assert "→ succeeded: Sunny in Lisbon" in out
    assert "model calls paid for: 3" in out and "replaying 2 from the journal" in out
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT state, spent_tokens > 0, (SELECT count(*) FROM belay_steps) "
                           "FROM belay_jobs WHERE kind = 'demo.evening_planner'").fetchone()
    assert row == ("succeeded", True, 6)
