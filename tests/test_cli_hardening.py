"""The command line under hostile input: modules that fail to import, number
options that are inf, nan or absurd, TLS files that are no good, database URLs
whose password must never be printed, and request bodies held open half sent.

Most run ``belay.cli.main`` in this process (nothing listens, nothing
connects before the error); the servers run as real subprocesses, and the
stalled body is sent over a real socket.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from belay.cli import main
from belay.redact import redact, secrets_of

#: Nothing listens on port 1: a well-formed URL there fails to connect at once.
NOWHERE = "postgresql://127.0.0.1:1/none"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from ``tmp_path`` (the CLI imports modules from the working
    directory), leaving ``sys.path`` as it was."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("BELAY_DATABASE_URL", raising=False)
    return tmp_path


def module(workdir: Path, source: str) -> str:
    """A module of ``source`` in the working directory, under a fresh name."""
    name = f"hardening_{uuid.uuid4().hex[:10]}"
    (workdir / f"{name}.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()
    return name


# -- Modules that fail to import (--import, --authorizer) ---------------------------------

BROKEN = {
    "raises": ("""\
        def helper():
            raise RuntimeError("kaboom at import")

        helper()
        """, 2, ["RuntimeError: kaboom at import", ".py:2)"]),
    "exits": ("""\
        import sys

        sys.exit(3)
        """, 2, ["called sys.exit(3)", ".py:3)", "__main__"]),
    "unprintable": ("""\
        class Odd(Exception):
            def __str__(self):
                raise ValueError("cannot describe myself")

        raise Odd()
        """, 2, ["raised Odd:", "could not be read", ".py:5)"]),
    "syntax": ("def f(:\n", 2, ["SyntaxError", ".py:1)"]),
    "missing dependency": ("import belay_no_such_dependency\n", 2,
                           ["ModuleNotFoundError", "belay_no_such_dependency", ".py:1)"]),
    "ctrl-c": ("raise KeyboardInterrupt\n", 130, ["interrupted while importing", ".py:1)"]),
}

LOADERS = {
    "worker": lambda name: ["worker", "--url", NOWHERE, "--import", name],
    "replay": lambda name: ["replay", "1", "--url", NOWHERE, "--import", name],
    "mcp": lambda name: ["mcp", "--url", NOWHERE, "--authorizer", f"{name}:authorize"],
    "dashboard": lambda name: ["dashboard", "--url", NOWHERE, "--authorizer",
                               f"{name}:authorize"],
}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case", BROKEN)
def test_a_module_that_fails_to_import_is_a_message_not_a_traceback(
    workdir: Path, capsys: pytest.CaptureFixture[str], loader: str, case: str
) -> None:
    source, code, words = BROKEN[case]
    name = module(workdir, source)
    assert main(LOADERS[loader](name)) == code
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("belay: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert repr(name) in err
    for word in words:
        assert word in err
    if code == 2:
        assert "fix" in err or "__main__" in err


@pytest.mark.parametrize("loader", LOADERS)
def test_a_missing_module_says_where_belay_looks(
    workdir: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    assert main(LOADERS[loader]("belay_no_such_module")) == 2
    err = capsys.readouterr().err
    assert err.startswith("belay: ") and "no module named 'belay_no_such_module'" in err
    assert "PYTHONPATH" in err


# -- Number options ---------------------------------------------------------------------

NUMBERS = [
    (["serve"], "--lease-ttl", "inf"),
    (["serve"], "--lease-ttl", "nan"),
    (["serve"], "--lease-ttl", "0"),
    (["serve"], "--lease-ttl", "-5"),
    (["serve"], "--lease-ttl", "1e300"),
    (["serve"], "--session-ttl", "inf"),
    (["serve"], "--session-ttl", "-1"),
    (["serve"], "--port", "70000"),
    (["serve"], "--port", "-1"),
    (["worker"], "--lease-ttl", "inf"),
    (["worker"], "--poll-interval", "nan"),
    (["worker"], "--busy-poll", "-1"),
    (["worker"], "--sweep-interval", "inf"),
    (["worker"], "--shutdown-grace", "nan"),
    (["worker"], "--metrics-port", "65536"),
    (["dashboard"], "--port", "99999"),
    (["mcp", "--transport", "http"], "--port", "99999"),
    (["events", "1", "--follow"], "--timeout", "inf"),
]


@pytest.mark.parametrize(("command", "option", "value"), NUMBERS)
def test_a_number_option_out_of_range_is_refused_naming_it(
    workdir: Path, capsys: pytest.CaptureFixture[str], command: list[str], option: str,
    value: str
) -> None:
    assert main([*command, "--url", NOWHERE, option, value]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"belay: {option} is "), err


@pytest.mark.parametrize("value", ["0", "10001", "99999999999999999999", "²"])
def test_a_queue_concurrency_out_of_range_is_refused(
    workdir: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main(["worker", "--url", NOWHERE, "--queue", f"q={value}"]) == 2
    assert "a whole number from 1 to 10000" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["job", "99999999999999999999"], ["job", "0"], ["job", "²"], ["retry", "-1"],
    ["cancel", "9223372036854775808"], ["events", "99999999999999999999"],
    ["signal", "1e3", "go"], ["jobs", "--parent", "99999999999999999999"],
    ["jobs", "--before", "0"], ["replay", "99999999999999999999"],
])
def test_a_job_id_out_of_bigint_range_is_a_usage_error(
    workdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--url", NOWHERE])
    assert exit_.value.code == 2
    assert "is not a job id" in capsys.readouterr().err


def test_serve_lease_ttl_inf_is_refused_by_the_library_too() -> None:
    from belay.errors import ConfigurationError
    from belay.http.server import serve

    for option in ("lease_ttl", "session_ttl", "read_timeout"):
        with pytest.raises(ConfigurationError, match="seconds > 0"):
            serve(NOWHERE, port=0, **{option: float("inf")})


# -- TLS files ----------------------------------------------------------------------------


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate it signs and its key, another key, and junk."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
                    signer: ec.EllipticCurvePrivateKey, ca: bool) -> bytes:
        cert = (x509.CertificateBuilder().subject_name(name(subject))
                .issuer_name(name(issuer)).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)

    def pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key, server_key, other_key = (ec.generate_private_key(ec.SECP256R1())
                                     for _ in range(3))
    files = {
        "ca.crt": certificate("test CA", ca_key, "test CA", ca_key, ca=True),
        "server.crt": certificate("localhost", server_key, "test CA", ca_key, ca=False),
        "server.key": pem(server_key),
        "client.key": pem(other_key),
        "junk.pem": b"not a certificate\n",
    }
    for file, data in files.items():
        (tmp_path / file).write_bytes(data)
    return {file: tmp_path / file for file in files}


TLS_CASES = {
    "cert not PEM": (("junk.pem", "server.key", "ca.crt"), "--tls-cert"),
    "key not PEM": (("server.crt", "junk.pem", "ca.crt"), "--tls-key"),
    "CA not PEM": (("server.crt", "server.key", "junk.pem"), "--tls-client-ca"),
    "key of another cert": (("server.crt", "client.key", "ca.crt"), "not the key of"),
    "cert is a key": (("server.key", "server.key", "ca.crt"), "--tls-cert"),
    "missing CA": (("server.crt", "server.key", "absent.crt"), "no such file"),
}


@pytest.mark.parametrize("case", TLS_CASES)
def test_bad_tls_files_fail_before_serving(
    db_url: str, certs: dict[str, Path], capsys: pytest.CaptureFixture[str], case: str
) -> None:
    (cert, key, ca), words = TLS_CASES[case]
    path = {name: str(certs.get(name, certs["ca.crt"].parent / name))
            for name in (cert, key, ca)}
    code = main(["serve", "--url", db_url, "--port", "0", "--tls-cert", path[cert],
                 "--tls-key", path[key], "--tls-client-ca", path[ca]])
    out, err = capsys.readouterr()
    assert code == 2
    assert "serving" not in out
    assert err.startswith("belay: ") and words in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_tls_key_fails_before_serving(
    db_url: str, certs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    certs["server.key"].chmod(0)
    code = main(["serve", "--url", db_url, "--port", "0", "--tls-cert",
                 str(certs["server.crt"]), "--tls-key", str(certs["server.key"]),
                 "--tls-client-ca", str(certs["ca.crt"])])
    out, err = capsys.readouterr()
    assert code == 2 and "serving" not in out
    assert "--tls-key" in err and "cannot read" in err


# -- Passwords never printed --------------------------------------------------------------

SECRET = "SECRETpw42"
URLS = [
    f"postgresql://u:{SECRET}@[::1/x",                               # unclosed IPv6 host
    f"postgresql://u:{SECRET}@127.0.0.1:1/x",                        # nothing listens
    f"postgresql://u:{SECRET}%ZZ@127.0.0.1:1/x",                     # bad percent-encoding
    f"postgresql://u:x@127.0.0.1:1/x?password={SECRET}%ZZ",          # ... in the query
    f"postgresql://u@127.0.0.1:1/x?sslpassword={SECRET}&bogus=1",    # unknown parameter
    f"host=127.0.0.1 port=1 password={SECRET} sslmode=bogus",        # key/value form
    f"host=127.0.0.1 password='{SECRET} and more",                   # unterminated quote
    f"mysql://u:{SECRET}@127.0.0.1/x",                               # another database
]

URL_COMMANDS = [
    ["migrate"], ["check"], ["worker"], ["replay", "1"], ["serve", "--port", "0"],
    ["mcp", "--transport", "http", "--port", "0"], ["dashboard", "--port", "0"], ["stats"],
    ["jobs"], ["job", "1"], ["events", "1"], ["retry", "1"], ["cancel", "1"],
    ["signal", "1", "go"], ["steer", "1", "{}"], ["queues", "list"],
    ["queues", "pause", "q"], ["crons", "list"], ["prune"],
]


def _redacted_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in (1, 2), (code, out, err)
    assert err.startswith("belay: "), err
    return out + err


@pytest.mark.parametrize("url", URLS)
def test_no_command_prints_the_password_of_its_url(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    url: str
) -> None:
    for command in URL_COMMANDS:
        printed = _redacted_run([command[0], "--url", url, *command[1:]], capsys)
        assert SECRET not in printed, (command, printed)
    printed = _redacted_run(["demo", "--url", url], capsys)
    assert SECRET not in printed, ("demo", printed)
    # The same URL from the environment.
    monkeypatch.setenv("BELAY_DATABASE_URL", url)
    for command in URL_COMMANDS:
        printed = _redacted_run(command, capsys)
        assert SECRET not in printed, (command, printed)


def test_the_malformed_url_is_still_shown_without_its_password(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--url", "postgresql://u:SECRET@[::1/x"]) == 2
    err = capsys.readouterr().err
    assert err == ('belay: invalid database URL: end of string reached when looking for '
                   'matching "]" in IPv6 host address in URI: "postgresql://u:***@[::1/x"\n')


def test_a_worker_process_never_prints_or_logs_the_password(workdir: Path) -> None:
    jobs = module(workdir, """\
        import belay

        @belay.worker(name="hardening.noop")
        def noop(ctx):
            return None
        """)
    for url in URLS[1:4]:
        done = subprocess.run(
            [sys.executable, "-m", "belay", "worker", "--url", url, "--import", jobs,
             "--log-level", "DEBUG"], capture_output=True, text=True, timeout=60,
            cwd=workdir, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
        assert done.returncode in (1, 2), done.stderr
        assert "belay: " in done.stderr
        assert SECRET not in done.stdout + done.stderr


@pytest.mark.parametrize(("text", "url", "shown"), [
    ('in URI: "postgresql://u:pw@[::1/x"', "postgresql://u:pw@[::1/x",
     'in URI: "postgresql://u:***@[::1/x"'),
    ("postgresql://u:p@ss@h/db", "", "postgresql://u:***@h/db"),
    ("host=h password=pw sslpassword='s p' port=5", "", "host=h password=*** sslpassword=*** "
     "port=5"),
    ("?sslpassword=abc&x=1", "", "?sslpassword=***&x=1"),
    ('token: "SECRET%ZZ"', "postgresql://u:SECRET%ZZ@h/db", 'token: "***"'),
    ('token: "SE%ZZ"', "postgresql://u:x@h/db?password=SE%ZZ", 'token: "***"'),
    ('port "SE"', "postgresql://u:SE/CRET@h/db", 'port "***"'),
    ("decoded p@ss", "postgresql://u:p%40ss@h/db", "decoded ***"),
    # A password that is a common word masks only where it stands alone.
    ("postgresql://h/db for user postgres", "postgresql://postgres:postgres@h/db",
     "postgresql://h/db for user ***"),
])
def test_redact(text: str, url: str, shown: str) -> None:
    assert redact(text, secrets_of(url)) == shown


# -- Request bodies held open ---------------------------------------------------------------


class Process:
    """A ``belay`` server subprocess; ``port`` from the line it prints."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "belay", *args, "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).parent.parent)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            raise AssertionError(f"did not start: {line}{self.proc.communicate()[1]}")
        self.port = int(line.split("serving ", 1)[1].split("/ ", 1)[0].rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=30)


@pytest.fixture
def started() -> Iterator[list[Process]]:
    running: list[Process] = []
    yield running
    for process in running:
        process.stop()


def stall(port: int, path: str, timeout: float) -> tuple[bytes, float]:
    """Send the headers and half the body of a POST, then nothing; return what
    the server answered before closing, and how long that took."""
    body = b'{"task": "t", "input": {"padding": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}'
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body[: len(body) // 2])
        began = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # blocks until the server answers or closes
            answer += chunk
        return answer, time.monotonic() - began


def test_serve_answers_408_to_a_body_held_open(db_url: str, started: list[Process]) -> None:
    server = Process("serve", "--url", db_url, "--read-timeout", "0.5")
    started.append(server)
    answer, took = stall(server.port, "/jobs", timeout=10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'{"error": {"code": "request_timeout"' in answer
    assert took < 5
    # A body that arrives in time is served as ever.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        body = b'{"task": "t"}'
        sock.sendall(f"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 201 ")


def test_serve_closes_a_connection_whose_headers_trickle(
    db_url: str, started: list[Process]
) -> None:
    server = Process("serve", "--url", db_url, "--read-timeout", "0.5")
    started.append(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        # Closed without an answer; a server that waits forever times this recv out.
        assert sock.recv(65536) == b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        # After a whole request on a kept-alive connection, the next one's headers
        # are bounded the same way (one byte must not cancel every timer).
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"G")
        while chunk := sock.recv(65536):
            assert not chunk.startswith(b"HTTP/"), chunk


def test_the_dashboard_closes_a_connection_whose_body_stalls(
    db_url: str, started: list[Process]
) -> None:
    # waitress counts whole seconds, and looks every second.
    server = Process("dashboard", "--url", db_url, "--read-timeout", "1")
    started.append(server)
    answer, took = stall(server.port, "/api/jobs/1/cancel", timeout=10)
    assert answer == b""
    assert took < 5


def test_only_time_spent_waiting_for_the_body_counts() -> None:
    """The ASGI middleware alone: an app busy longer than the timeout before
    it reads a body that had arrived is not answered 408; a body that never
    comes is, and the app reads a disconnect."""
    import asyncio

    from belay.http.server import ReadTimeout

    async def run(body_arrives: bool) -> tuple[list[dict[str, object]], list[str]]:
        sent: list[dict[str, object]] = []
        read: list[str] = []
        never = asyncio.Event()

        async def receive() -> dict[str, object]:
            if not body_arrives:
                await never.wait()
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        async def app(scope: object, receive: object, send: object) -> None:
            await asyncio.sleep(0.3)  # busy for longer than the timeout
            message = await receive()  # type: ignore[operator]
            read.append(message["type"])
            if message["type"] == "http.request":
                await send({"type": "http.response.start", "status": 204,  # type: ignore[operator]
                            "headers": []})
                await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

        await ReadTimeout(app, 0.1)({"type": "http"}, receive, send)  # type: ignore[arg-type]
        return sent, read

    sent, read = asyncio.run(run(body_arrives=True))
    assert read == ["http.request"] and sent[0]["status"] == 204
    sent, read = asyncio.run(run(body_arrives=False))
    assert read == ["http.disconnect"] and sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]  # type: ignore[operator]


def test_good_tls_files_pass_the_startup_check(certs: dict[str, Path]) -> None:
    from belay.http.server import check_tls

    assert check_tls("127.0.0.1", str(certs["server.crt"]), str(certs["server.key"]),
                     str(certs["ca.crt"])) is True


@pytest.mark.parametrize(("argv", "says"), [
    (["steer", "1", "[" * 3000 + "]" * 3000], "nests deeper than belay parses"),
    (["steer", "1", '{"a": NaN}'], "NaN is not JSON"),
    (["signal", "1", "go", '{"a": 1e999}'], "too large for a double"),
    (["signal", "1", "go", '{"a": "\\u0000"}'], "NUL"),
    (["steer", "1", '{"a": "\\ud800"}'], "lone surrogate"),
    (["signal", "1", "go", "{"], "not valid JSON"),
])
def test_json_arguments_are_parsed_strictly_before_any_sql(
    workdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    # NOWHERE has no server: a message about the JSON proves nothing was sent.
    assert main([*argv, "--url", NOWHERE]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("belay: ") and says in err, err
    assert "Traceback" not in err
