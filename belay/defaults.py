"""The default client: the :class:`~belay.Belay` instance the module-level
functions (``belay.enqueue``, ``belay.get_job``…) and a worker built without
a client use.

Set up by :func:`configure`, installed by a framework adapter with
:func:`set_default`, or created from ``BELAY_DATABASE_URL`` on first use.
Its own module, so the worker, the registry and workflows reach it without
importing the package's top level.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from belay.client import Belay
from belay.errors import ConfigurationError

_instance: Belay | None = None
_lock = threading.Lock()
_ANY: Any = object()


def configure(url: str | None = None, **options: Any) -> Belay:
    """Set up the default instance (replacing and closing any earlier one:
    code still holding that one gets :class:`~belay.errors.ClientClosed`).

    ``url`` falls back to ``BELAY_DATABASE_URL``; ``options`` are those of :class:`Belay`.
    """
    global _instance
    instance = Belay(url_or_env(url), **options)
    with _lock:
        previous, _instance = _instance, instance
    if previous is not None:
        previous.close()
    return instance


def set_default(instance: Belay, *, expected: Belay | None = _ANY) -> bool:
    """Make ``instance`` the default the module-level functions use (for an
    instance built elsewhere, e.g. by a framework adapter).

    With ``expected``, only if the current default is that instance (None: only
    if there is none yet), atomically; returns whether it was set. The instance
    it replaces is not closed: it belongs to whoever made it.
    """
    global _instance
    with _lock:
        if expected is not _ANY and _instance is not expected:
            return False
        _instance = instance
        return True


def default() -> Belay:
    """The default instance, created from ``BELAY_DATABASE_URL`` on first use."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = Belay(url_or_env(None))
        return _instance


def swap(instance: Belay | None) -> Belay | None:
    """Install ``instance`` (None: no default) and return the one it replaced,
    neither closed: for tests that restore the previous default after."""
    global _instance
    with _lock:
        previous, _instance = _instance, instance
    return previous


def url_or_env(url: str | None) -> str:
    url = url or os.environ.get("BELAY_DATABASE_URL")
    if not url:
        raise ConfigurationError(
            "belay has no database: call belay.configure(url='postgresql://…') "
            "or set BELAY_DATABASE_URL"
        )
    return url
