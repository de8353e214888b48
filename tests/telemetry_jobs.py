"""Job functions for the ``belay worker --metrics-port`` process of
``tests/test_telemetry.py``; imported only by that subprocess
(``--import tests.telemetry_jobs``), so its kinds stay out of the test
process's default registry.
"""

from __future__ import annotations

from typing import Any

import belay

QUEUE = "tele"
ECHO = "telemetry.echo"
FLAKY = "telemetry.flaky"


def no_backoff(attempt: int) -> float:
    """Retry at once."""
    return 0.0


@belay.worker(name=ECHO, queue=QUEUE)
def echo(ctx: belay.Context) -> Any:
    """Succeeds with its input."""
    return ctx.input


@belay.worker(name=FLAKY, queue=QUEUE, backoff=no_backoff, max_attempts=3)
def flaky(ctx: belay.Context) -> str:
    """Fails its first attempt, then succeeds."""
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return "second time lucky"
