"""A throwaway PgBouncer in transaction-pooling mode, in front of a given server.

Used by the test harness (``BELAY_TEST_POOLER=pgbouncer``), the soak
(``--pooler``) and the benchmarks to put the real pooler production puts
between belay and PostgreSQL. It runs the machine's ``pgbouncer`` binary
(Debian: ``apt install pgbouncer``; no Python package ships one) on a free
port, with a configuration of its own in a temporary directory.

``BELAY_PGBOUNCER`` names another binary to try (``find_binary``) when the
machine's is too old for what is asked of it: prepared statements in
transaction mode need PgBouncer 1.21 or later (``max_prepared_statements``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from belay.errors import ConfigurationError

#: Where Debian and most distributions put the binary when it is not on PATH.
_PLACES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")


#: Another binary to try after the machine's own (a newer build).
BINARY_ENV = "BELAY_PGBOUNCER"
#: The first release that tracks prepared statements in transaction mode.
PREPARED_SINCE: tuple[int, int] = (1, 21)


def version(binary: str) -> tuple[int, ...] | None:
    """What ``pgbouncer --version`` says, as numbers: ``(1, 18, 0)``."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.split()
    if len(words) < 2 or words[0] != "PgBouncer":
        return None
    try:
        return tuple(int(part) for part in words[1].split("."))
    except ValueError:
        return None


def find_binary(min_version: tuple[int, ...] | None = None) -> str | None:
    """The pgbouncer executable (at least ``min_version``): the machine's
    own, else ``$BELAY_PGBOUNCER``; None when there is none."""
    candidates = [shutil.which("pgbouncer"), *_PLACES, os.environ.get(BINARY_ENV)]
    for path in dict.fromkeys(c for c in candidates if c):
        if not os.access(path, os.X_OK):
            continue
        if min_version is None:
            return path
        found = version(path)
        if found is not None and found >= min_version:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _quote(value: str) -> str:
    """A value inside a [databases] connection string (libpq's quoting)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """``with PgBouncer(server_url) as bouncer: bouncer.url_for("mydb")``.

    Every database of the server is reachable through it (a ``*`` entry), as
    the server URL's user; ``pool_mode = transaction``. ``restart()`` kills it
    (dropping every client and server connection, as a crash or a deploy
    does) and starts it again on the same port.
    """

    def __init__(self, server_url: str, *, pool_size: int = 40,
                 max_client_conn: int = 1000, max_prepared_statements: int = 0) -> None:
        need = PREPARED_SINCE if max_prepared_statements else None
        binary = find_binary(need)
        if binary is None:
            raise ConfigurationError(
                "no pgbouncer executable found; install PgBouncer "
                "(Debian/Ubuntu: apt install pgbouncer)" if need is None else
                f"max_prepared_statements needs PgBouncer {'.'.join(map(str, need))} or "
                f"later, and none was found; name one in {BINARY_ENV}"
            )
        self.binary = binary
        self.version = version(binary)
        #: Prepared statements tracked per client (0: off, as before 1.21).
        self.max_prepared_statements = max_prepared_statements
        self.server = conninfo_to_dict(server_url)
        self.port = _free_port()
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- URLs ------------------------------------------------------------------------

    def url_for(self, dbname: str | None = None) -> str:
        """The pooler's URL for a database of the server (the server URL's by default)."""
        params = {k: v for k, v in self.server.items() if k not in ("host", "port", "hostaddr")}
        if dbname is not None:
            params["dbname"] = dbname
        return make_conninfo("", host="127.0.0.1", port=str(self.port), **params)

    @property
    def url(self) -> str:
        return self.url_for()

    # -- Lifecycle --------------------------------------------------------------------

    def _write_config(self, root: Path) -> Path:
        host = str(self.server.get("host") or "127.0.0.1")
        target = f"host={_quote(host)} port={self.server.get('port') or 5432}"
        user = str(self.server.get("user") or "postgres")
        target += f" user={_quote(user)}"
        if self.server.get("password"):
            target += f" password={_quote(str(self.server['password']))}"
        (root / "userlist.txt").write_text(f'"{user}" ""\n')
        ini = root / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = {target}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"admin_users = {user}\n"
            f"auth_file = {root / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            f"max_client_conn = {self.max_client_conn}\n"
            "server_reset_query =\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {root / 'pgbouncer.log'}\n"
            f"pidfile = {root / 'pgbouncer.pid'}\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
            # Off unless asked for (1.22+ default it to 200): the same pooler
            # whichever release runs.
            + (f"max_prepared_statements = {self.max_prepared_statements}\n"
               if self.version is not None and self.version >= PREPARED_SINCE else "")
        )
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root; the user it drops to must read these.
            root.chmod(0o777)
            for path in root.iterdir():
                path.chmod(0o666)
        return ini

    def start(self) -> PgBouncer:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="belay-pgbouncer-")
        root = Path(self._dir.name)
        ini = self._write_config(root)
        command = [self.binary, "--quiet"]  # its log goes to pgbouncer.log only
        if os.geteuid() == 0:
            command += ["-u", self._run_as()]
        command.append(str(ini))
        # Its stderr into a file: an unread pipe fills up, and PgBouncer then
        # blocks on its next log line, every connection with it.
        with open(root / "stderr.log", "ab") as stderr:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr, start_new_session=True,
            )
        self._wait_listening()
        return self

    def _run_as(self) -> str:
        """PgBouncer refuses to run as root. It runs as nobody, or, when the
        server listens on a Unix socket in a directory only its owner may enter
        (an embedded server's data directory), as that owner."""
        host = str(self.server.get("host") or "")
        if host.startswith("/"):
            with contextlib.suppress(OSError, KeyError):
                owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
                if owner != "root":
                    return owner
        return "nobody"

    def _wait_listening(self, timeout: float = 10.0) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ConfigurationError(f"pgbouncer exited at start:{self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise ConfigurationError(f"pgbouncer did not listen on port {self.port}{self._log_tail()}")

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        lines: list[str] = []
        for name in ("stderr.log", "pgbouncer.log"):
            with contextlib.suppress(OSError):
                lines += (Path(self._dir.name) / name).read_text().splitlines()[-10:]
        return "".join("\n" + line for line in lines)

    def kill(self) -> None:
        """SIGKILL: every client and server connection drops at once."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart(self) -> None:
        """Kill and start again on the same port (a crash, a deploy)."""
        self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        self.kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
