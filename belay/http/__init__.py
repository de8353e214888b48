"""belay's language-neutral HTTP/JSON API (``belay serve``): producers in any
language enqueue, read, cancel and signal jobs, and read results and events.

Needs the ``http`` extra (Starlette and uvicorn)."""

from __future__ import annotations

from belay.http.app import build_app
from belay.http.errors import ApiError

__all__ = ["ApiError", "build_app"]
