"""examples/django_app runs end to end with the one command the README gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_django_example_runs_with_one_command_on_an_embedded_postgresql():
    done = subprocess.run(
        [sys.executable, "examples/django_app/demo.py"], cwd=REPO, capture_output=True,
        text=True, timeout=240, check=False, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "starting an embedded PostgreSQL" in out
    assert "Applying belay_django.0003_contract_major... OK" in out
    assert "order 1: rolled back — and its receipt job with it" in out
    assert "order 2: committed, with receipt job" in out
    assert "| belay worker" in out and "stopped" in out
    assert "succeeded after 1 attempt(s) → {'receipt_for': 'ada@example.com'" in out
    assert "(written by the job through the ORM)" in out
    assert "receipt jobs in belay_jobs: 1 (the rolled-back order left none)" in out
