"""Where the executor socket lives, and making its place safe to listen on.

The worker and the executors resolve the same path, in this order (the
seed's discovery order, under belay's names):

1. the path given explicitly (``--executor-socket``, an argument);
2. ``BELAY_SOCKET_PATH``;
3. ``/run/belay/belay.sock`` when the directory ``/run/belay`` exists (a
   shared directory: its ownership and mode are the operator's, and a
   container shares it through a volume);
4. ``$XDG_RUNTIME_DIR/belay/belay.sock`` when ``XDG_RUNTIME_DIR`` is usable;
5. ``$TMPDIR/belay-<uid>/belay.sock`` when ``TMPDIR`` is usable;
6. ``/tmp/belay-<uid>/belay.sock``.

A directory belay creates itself is private (``0700``); the socket is
``0600``, or ``0660`` when asked for (a group of executors). :func:`prepare`
removes only a socket nothing listens on, and refuses to replace anything
else (a regular file, a live socket).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ENV: Final = "BELAY_SOCKET_PATH"
SHARED_DIR: Final = Path("/run/belay")
NAME: Final = "belay.sock"
#: The modes a socket may be given.
MODES: Final = (0o600, 0o660)


class SocketPathError(Exception):
    """The socket's place can't be used; the message names the path and the fix."""


@dataclass(frozen=True)
class Resolved:
    path: Path
    #: Where it came from: "explicit", "env", "shared", "runtime", "tmpdir" or "tmp".
    source: str

    @property
    def private_dir(self) -> bool:
        """True when belay creates (and owns) the directory: it is made ``0700``."""
        return self.source in ("runtime", "tmpdir", "tmp")


def resolve(explicit: str | os.PathLike[str] | None = None, *,
            env: dict[str, str] | None = None, shared_dir: Path = SHARED_DIR,
            uid: int | None = None) -> Resolved:
    """The socket path by the discovery order above (no file is touched)."""
    environ = dict(os.environ) if env is None else env
    uid = os.getuid() if uid is None else uid
    if explicit is not None and str(explicit):
        return Resolved(Path(explicit), "explicit")
    if environ.get(ENV):
        return Resolved(Path(environ[ENV]), "env")
    if shared_dir.is_dir():
        return Resolved(shared_dir / NAME, "shared")
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and _usable(Path(runtime), uid):
        return Resolved(Path(runtime) / "belay" / NAME, "runtime")
    tmpdir = environ.get("TMPDIR")
    if tmpdir and _usable(Path(tmpdir), uid):
        return Resolved(Path(tmpdir) / f"belay-{uid}" / NAME, "tmpdir")
    return Resolved(Path("/tmp") / f"belay-{uid}" / NAME, "tmp")


def _usable(directory: Path, uid: int) -> bool:
    """An absolute directory this user can create entries in."""
    try:
        info = directory.stat()
    except OSError:
        return False
    return (directory.is_absolute() and stat.S_ISDIR(info.st_mode)
            and os.access(directory, os.W_OK | os.X_OK))


def prepare(resolved: Resolved, *, uid: int | None = None) -> Path:
    """Make ``resolved``'s directory ready and its path free to bind: create a
    private directory (``0700``) when belay owns it, check an existing one is
    this user's and not open to others, and remove a stale socket. Raises
    SocketPathError naming the path and the OS error, never falling back to
    another place."""
    uid = os.getuid() if uid is None else uid
    path = resolved.path
    directory = path.parent
    if resolved.private_dir:
        try:
            directory.mkdir(mode=0o700, parents=False, exist_ok=True)
            info = directory.lstat()
        except OSError as exc:
            raise SocketPathError(f"{directory}: can't create the socket's directory "
                                  f"({exc.strerror}); set {ENV} to a path you own") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            raise SocketPathError(f"{directory} is not a directory of this user (uid {uid}); "
                                  f"remove it or set {ENV}")
        if info.st_mode & 0o077:
            raise SocketPathError(f"{directory} is open to other users (mode "
                                  f"{stat.S_IMODE(info.st_mode):04o}); chmod 700 it")
    elif resolved.source in ("explicit", "env"):
        try:
            info = directory.stat()
        except OSError as exc:
            raise SocketPathError(f"{directory}: the socket's directory can't be used "
                                  f"({exc.strerror}); create it first") from None
        if info.st_uid not in (uid, 0):
            raise SocketPathError(f"{directory} belongs to uid {info.st_uid}, not to this "
                                  f"user ({uid}) or root; choose a directory you own")
        if info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX:
            raise SocketPathError(f"{directory} is writable by everyone without the sticky "
                                  "bit: another user could replace the socket; choose a "
                                  "private directory")
    _clear(path)
    return path


def _clear(path: Path) -> None:
    """Remove a socket nothing listens on; refuse anything else at ``path``."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SocketPathError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; belay won't replace it "
                              "(remove it, or choose another path)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise SocketPathError(f"{path}: can't tell whether the socket is in use "
                                  f"({exc.strerror})") from None
    else:
        raise SocketPathError(f"{path}: another process listens on it; stop it or choose "
                              "another path")
    finally:
        probe.close()
    path.unlink(missing_ok=True)


def listen(path: Path, mode: int = 0o600, backlog: int = 128) -> socket.socket:
    """A listening socket at ``path`` (prepared) with ``mode`` (0600 or 0660)."""
    if mode not in MODES:
        raise SocketPathError(f"the socket's mode is 0600 or 0660, got {mode:04o}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~mode)
        try:
            server.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, mode)
        server.listen(backlog)
    except OSError as exc:
        server.close()
        raise SocketPathError(f"{path}: can't listen ({exc.strerror})") from None
    return server
