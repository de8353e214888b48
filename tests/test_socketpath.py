"""Where the executor socket lives (belay.socketpath): discovery and a safe place."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from belay import socketpath
from belay.socketpath import Resolved, SocketPathError

UID = os.getuid()


def test_discovery_follows_the_order(tmp_path: Path) -> None:
    shared = tmp_path / "run-belay"
    runtime = tmp_path / "xdg"
    tmpdir = tmp_path / "tmpdir"
    runtime.mkdir()
    tmpdir.mkdir()
    env = {socketpath.ENV: "/srv/belay.sock", "XDG_RUNTIME_DIR": str(runtime),
           "TMPDIR": str(tmpdir)}

    def resolve(explicit: str | None = None) -> Resolved:
        return socketpath.resolve(explicit, env=env, shared_dir=shared, uid=UID)

    assert resolve("/opt/x.sock") == Resolved(Path("/opt/x.sock"), "explicit")
    assert resolve() == Resolved(Path("/srv/belay.sock"), "env")
    del env[socketpath.ENV]
    assert resolve().source == "runtime"  # no shared directory yet
    shared.mkdir()  # its existence selects it, before any socket is there
    assert resolve() == Resolved(shared / "belay.sock", "shared")
    shared.rmdir()
    assert resolve() == Resolved(runtime / "belay" / "belay.sock", "runtime")
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "missing")
    assert resolve() == Resolved(tmpdir / f"belay-{UID}" / "belay.sock", "tmpdir")
    env["TMPDIR"] = "relative/dir"
    assert resolve() == Resolved(Path("/tmp") / f"belay-{UID}" / "belay.sock", "tmp")


def test_a_private_directory_is_created_0700_and_refused_when_open(tmp_path: Path) -> None:
    resolved = Resolved(tmp_path / "belay" / "belay.sock", "runtime")
    path = socketpath.prepare(resolved, uid=UID)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.parent.chmod(0o755)
    with pytest.raises(SocketPathError, match=r"open to other users.*chmod 700"):
        socketpath.prepare(resolved, uid=UID)
    path.parent.chmod(0o700)
    with pytest.raises(SocketPathError, match="not a directory of this user"):
        socketpath.prepare(resolved, uid=UID + 1)


def test_a_stale_socket_goes_a_live_one_and_a_file_stay(tmp_path: Path) -> None:
    path = tmp_path / "belay.sock"
    resolved = Resolved(path, "explicit")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nothing listens
    assert path.exists()
    assert socketpath.prepare(resolved, uid=UID) == path
    assert not path.exists()
    live = socketpath.listen(path)
    try:
        with pytest.raises(SocketPathError, match="another process listens on it"):
            socketpath.prepare(resolved, uid=UID)
        assert path.exists()
    finally:
        live.close()
    path.unlink()
    path.write_text("precious")
    with pytest.raises(SocketPathError, match="not a socket; belay won't replace it"):
        socketpath.prepare(resolved, uid=UID)
    assert path.read_text() == "precious"


@pytest.mark.parametrize("mode", [0o600, 0o660])
def test_the_socket_gets_its_mode(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "belay.sock"
    server = socketpath.listen(path, mode)
    try:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == mode
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        client.close()
    finally:
        server.close()


def test_other_modes_and_unsafe_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SocketPathError, match="0600 or 0660"):
        socketpath.listen(tmp_path / "belay.sock", 0o666)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(SocketPathError, match="writable by everyone without the sticky bit"):
        socketpath.prepare(Resolved(open_dir / "belay.sock", "explicit"), uid=UID)
    open_dir.chmod(0o1777)  # like /tmp: the sticky bit keeps others' hands off
    assert socketpath.prepare(Resolved(open_dir / "belay.sock", "explicit"), uid=UID)
    with pytest.raises(SocketPathError, match="create it first"):
        socketpath.prepare(Resolved(tmp_path / "no" / "belay.sock", "env"), uid=UID)
