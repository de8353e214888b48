"""Keep database passwords out of what belay prints and logs.

A conninfo comes as a URL (``postgresql://user:password@host/db``, its query
may carry ``password=`` or ``sslpassword=``) or as libpq key/value pairs
(``host=h password=secret``). psycopg's and libpq's errors may quote it whole
(``end of string reached … in URI: "postgresql://u:secret@[::1/x"``) or a
piece of it (``invalid percent-encoded token: "secret%zz"``), so
:func:`redact` masks both the shapes it recognises and every piece of the
password it was told about, the URL being as malformed as it may.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import unquote

MASK = "***"

# user:password@ after a scheme; the password runs to the last '@' of the
# token, as a password may hold an unencoded '@'.
_URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^\s:/?#@\"']*):[^\s\"']*@", re.IGNORECASE)
# password=… or sslpassword=… as a key/value pair or a URL query parameter;
# a quoted value may hold spaces and backslash escapes.
_KEY_PASSWORD = re.compile(
    r"\b((?:ssl)?password)(\s*=\s*)(?:'(?:[^'\\]|\\.)*(?:'|$)|[^\s&'\"]+)", re.IGNORECASE)
_URL_DELIMITERS = re.compile(r"[/?#@:&]")


def secrets_of(conninfo: str | None) -> tuple[str, ...]:
    """The passwords in ``conninfo``, well formed or not, as given and
    percent-decoded, with the pieces a URL parser could cut them into."""
    if not conninfo:
        return ()
    found: list[str] = []
    _, sep, rest = conninfo.partition("://")
    if sep and "@" in rest:
        # Either '@' may end the user info of a malformed URL: take both.
        for userinfo in (rest.partition("@")[0], rest.rpartition("@")[0]):
            _, colon, password = userinfo.partition(":")
            if colon:
                found.append(password)
    for match in re.finditer(r"\b(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'?|[^\s&]+)",
                             conninfo, re.IGNORECASE):
        value = match.group(1)
        found.append(value)
        if value.startswith("'"):
            found.append(re.sub(r"\\(.)", r"\1", value.strip("'")))
    pieces: set[str] = set()
    for secret in found:
        for form in (secret, unquote(secret)):
            pieces.add(form)
            # A one-character piece gives nothing away; masking it would garble.
            pieces.update(p for p in _URL_DELIMITERS.split(form) if len(p) > 1)
    # Longest first, so a piece never masks part of a longer secret.
    return tuple(sorted((p for p in pieces if p), key=len, reverse=True))


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password shown as ``***``: the ones in a
    ``user:password@`` or ``password=`` shape, and each of ``secrets`` (from
    :func:`secrets_of`) wherever it stands as a word of its own."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{MASK}@", text)
    text = _KEY_PASSWORD.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    for secret in secrets:
        if secret == MASK or not secret:
            continue
        # A secret's edge that is a letter or digit must not continue a word:
        # a password "postgres" leaves "postgresql://" alone.
        before = r"(?<![A-Za-z0-9])" if secret[0].isalnum() else ""
        after = r"(?![A-Za-z0-9])" if secret[-1].isalnum() else ""
        text = re.sub(before + re.escape(secret) + after, MASK, text)
    return text


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in when the exception cannot describe itself."""
    try:
        return str(exc)
    except Exception:  # an exception whose __str__ raises: still say what it was
        return f"<{type(exc).__name__} whose message could not be read>"


class RedactingFormatter(logging.Formatter):
    """Formats with ``inner`` (tracebacks included), then redacts."""

    def __init__(self, inner: logging.Formatter | None, secrets: Iterable[str]) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record), self.secrets)


def redact_logging(secrets: Iterable[str], loggers: Iterable[str] = ("",)) -> None:
    """Make every handler of ``loggers`` (default: the root logger) redact
    what it writes; call it after the handlers are set up."""
    kept = tuple(secrets)
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler.formatter, RedactingFormatter):
                handler.setFormatter(RedactingFormatter(handler.formatter, kept))
