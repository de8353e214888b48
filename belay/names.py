"""Reserved names and lock keys of the wire contract, spelled in one place."""

from __future__ import annotations

import re

from belay.errors import ValidationError

_UNSAFE = re.compile(rb"[^A-Za-z0-9_]")
_MAX_IDENTIFIER = 63

STEER = "$steer"
#: What a job paused by its budget (on_exceed="pause") awaits: belay.top_up.
TOP_UP = "$top_up"
CHILDREN = "$children"
RESERVED_PREFIX = "$"
#: Where a job's authority (belay.authority) rides in its ``meta``.
AUTHORITY_KEY = "$authority"


def job_scope(job_id: int) -> str:
    """The signal scope of one job (§8.1)."""
    return f"job:{job_id}"


def workflow_scope(workflow_id: str) -> str:
    return f"wf:{workflow_id}"


def signal_lock(scope: str) -> str:
    """§7: parking and delivery serialize on this advisory lock."""
    return f"belay_sig:{scope}"


def workflow_lock(workflow_id: str) -> str:
    """§7: taken before any signal lock, never after."""
    return f"belay_wf:{workflow_id}"


def queue_lock(queue: str) -> str:
    """§6: serializes claimers of a queue with admission limits."""
    return f"belay:{queue}"


def rate_lock(bucket: str) -> str:
    """Serializes claimers drawing on one shared rate bucket from different queues.

    Not in the contract: the reference counts a shared resource under each
    queue's own lock, so two queues can both admit against the same headroom.
    """
    return f"belay_rate:{bucket}"


MIGRATE_LOCK = "belay:migrate"


def resource_bucket(resource: str) -> str:
    """§3: the rate-counter bucket of a shared resource (e.g. a model provider)."""
    return f"resource:{resource}"


def window_start(epoch_seconds: int, period: int) -> int:
    """§6: the start of the rate window holding ``epoch_seconds``."""
    return epoch_seconds // period * period


def window_key(key: str, epoch_seconds: int, window: int) -> str:
    """§5.2: a window-unique key embeds its bucket."""
    return f"{key}@{epoch_seconds // window}"


_WINDOW_SUFFIX = re.compile(r"@-?[0-9]+\Z")


def looks_windowed(key: str) -> bool:
    """Whether ``key`` has the form of a window key, ``<key>@<bucket>``."""
    return _WINDOW_SUFFIX.search(key) is not None


def spawn_key(parent_id: int, name: str, index: int) -> str:
    """§8.4: the always-unique key of a spawned child."""
    return f"$spawn:{parent_id}:{name}:{index}"


def notify_channel(database: str) -> str:
    """§9.2: ``belay_`` + the database name with each byte outside [A-Za-z0-9_] as ``_``.

    Bytes, not characters, as the reference's (non-unicode) regex does, so both
    sides listen on the same channel. Cut to 63 bytes: pg_notify refuses longer
    channel names, and LISTEN truncates identifiers to that length anyway.
    """
    return ("belay_" + _UNSAFE.sub(b"_", database.encode()).decode())[:_MAX_IDENTIFIER]


# Limits on the names belay stores and indexes. PostgreSQL's text holds neither
# NUL nor lone surrogates (they fail deep inside a statement, after other SQL
# ran), a btree entry over ~2,700 bytes fails its insert, and a NOTIFY payload
# carrying a name must stay under 8,000 bytes: checked here, before any SQL.
MAX_NAME_BYTES = 255
"""Kinds, queues, partition keys, signal and cron names, ids, runtime ids."""
MAX_KEY_BYTES = 1024
"""Unique keys and idempotency keys."""


def text_problem(value: str) -> str | None:
    """Why PostgreSQL text can't hold ``value``, or None when it can."""
    if "\x00" in value:
        return "contains a NUL character (\\x00), which PostgreSQL text cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate, which is not valid UTF-8"
    return None


def check_text(
    value: object, what: str, *, max_bytes: int = MAX_NAME_BYTES, empty: bool = False
) -> str:
    """``value`` if it is a string belay can store as a name; a ValidationError naming
    ``what`` and the fix otherwise (before any SQL runs)."""
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__}")
    if not empty and not value.strip():
        raise ValidationError(f"{what} must be a non-empty string, got {value!r}")
    problem = text_problem(value)
    if problem is not None:
        raise ValidationError(f"{what} {problem}: {value!r}")
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise ValidationError(
            f"{what} is {size} bytes long; the limit is {max_bytes} bytes (UTF-8)"
        )
    return value
