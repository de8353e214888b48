"""``POST /jobs`` bodies → belay enqueue arguments, and the checks every HTTP
body shares (strict JSON, storable text and values, canonical JSON): pure, no I/O.

The option names and rules follow the seed's producer API where they map onto
belay (see docs/http.md): ``id``/``submission_id`` become an ``always``
unique key, delays become ``delay`` or ``run_at``, ``retries`` becomes
``max_attempts``, and the two options only HTTP workers honour (``timeout``,
``backoff``) travel in the job's meta under ``$timeout_ms`` / ``$backoff``.
Every refusal is an :class:`~belay.http.errors.ApiError` ``invalid_request``
whose message names the option and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Final
from urllib.parse import unquote_to_bytes

from belay import names
from belay.codec import parse_text
from belay.enqueue import JobSpec, Unique, build_row
from belay.errors import ValidationError
from belay.http.errors import ApiError, invalid
from belay.parts.remote import BACKOFF_META, TIMEOUT_META

BODY_FIELDS: Final = frozenset({"task", "args", "options"})
OPTIONS: Final = frozenset({
    "id", "submission_id", "delay", "delay_ms", "run_at", "retries", "timeout",
    "timeout_ms", "queue", "priority", "budget", "backoff", "durability", "authority",
})
#: What a top-up's body may hold (``POST /jobs/{id}/top_up``).
TOP_UP_FIELDS: Final = frozenset({"usd", "tokens", "idempotency_key"})
#: Meta keys the HTTP worker protocol reads (reserved: ``$`` is belay's prefix).

MAX_TIMEOUT_MS: Final = 86_400_000  # one day, the seed's bound
MAX_DELAY_MS: Final = 10 * 365 * 86_400_000  # ten years
#: 9999-12-31T23:59:59.999Z, the last instant a timestamp can name here.
MAX_RUN_AT_MS: Final = 253_402_300_799_999
MAX_RETRIES: Final = 65_534
#: ``id`` and ``submission_id``, in UTF-8 bytes (belay.names' limit on ids).
MAX_ID_BYTES: Final = names.MAX_NAME_BYTES
#: The deepest a JSON value may nest (args, payloads, results, error details):
#: below orjson's 254, so a value refused by belay.codec is refused here first,
#: with a 400 that names the field.
MAX_JSON_DEPTH: Final = 200
_INT32: Final = (-(2**31), 2**31 - 1)
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Enqueue:
    """One validated enqueue request, as :meth:`belay.Belay.enqueue` takes it."""

    kind: str
    input: dict[str, Any]
    queue: str | None = None
    priority: int | None = None
    delay: timedelta | None = None
    run_at: datetime | None = None
    max_attempts: int | None = None
    unique: Unique | None = None
    budget: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    authority: dict[str, Any] | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Belay.enqueue(kind, input, **kwargs)``."""
        return {"queue": self.queue, "priority": self.priority, "delay": self.delay,
                "run_at": self.run_at, "max_attempts": self.max_attempts,
                "unique": self.unique, "budget": self.budget, "meta": self.meta or None,
                "authority": self.authority}


def parse_enqueue(body: Any, now: datetime) -> Enqueue:
    """Validate a ``POST /jobs`` body; ``now`` is the server clock (relative
    schedules are checked against it)."""
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object like {{\"task\": \"billing.capture.v1\", "
                      f"\"args\": {{}}}}, got {_json_type(body)}")
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise invalid(f"unknown field(s) {_names(unknown)}; a job is task, args and options")
    task = body.get("task")
    if not isinstance(task, str) or not task.strip():
        raise invalid(f"task must be a non-empty string naming the worker (belay's job kind), "
                      f"got {_show(task)}")
    text("task", task)
    args = body.get("args", {})
    if not isinstance(args, dict):
        raise invalid(f"args must be a JSON object, got {_json_type(args)}")
    check_json(args, "args")
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise invalid(f"options must be a JSON object, got {_json_type(options)}")
    request = _options(task, args, options, now)
    try:  # belay's own rules (JSON-serializable input, bounds) on top of ours
        build_row(JobSpec(request.kind, request.input, **request.kwargs()), now)
    except ValidationError as exc:
        raise invalid(str(exc)) from None
    return request


def _options(task: str, args: dict[str, Any], options: dict[str, Any], now: datetime
             ) -> Enqueue:
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise invalid(f"unknown option(s) {_names(unknown)}; options are "
                      f"{', '.join(sorted(OPTIONS))}")
    nulls = sorted(name for name, value in options.items() if value is None)
    if nulls:  # as the OpenAPI document says: an option is a value or absent
        raise invalid(f"option(s) {_names(nulls)} are null; leave an option out for its "
                      "default")
    _exclusive(options, ("id", "submission_id"), "one idempotency key")
    _exclusive(options, ("delay", "delay_ms", "run_at"), "one schedule")
    _exclusive(options, ("timeout", "timeout_ms"), "one timeout unit")

    meta: dict[str, Any] = {}
    durability = options.get("durability", "persistent")
    if durability == "volatile":
        raise invalid("durability 'volatile' is not offered: belay keeps every job in "
                      "PostgreSQL; leave durability out or send 'persistent'")
    if durability != "persistent":
        raise invalid(f"durability must be 'persistent', got {_show(durability)}")

    delay, run_at = _schedule(options, now)
    timeout_ms = _timeout(options)
    if timeout_ms is not None:
        meta[TIMEOUT_META] = timeout_ms
    if "backoff" in options:
        meta[BACKOFF_META] = parse_backoff(options["backoff"])

    max_attempts = None
    if "retries" in options:
        max_attempts = _int("retries", options["retries"], 0, MAX_RETRIES) + 1
    priority = None
    if "priority" in options:
        priority = _int("priority", options["priority"], *_INT32)
    queue = options.get("queue")
    if queue is not None:
        text("options.queue", queue)
    budget = options.get("budget")
    if budget is not None and not isinstance(budget, dict):
        raise invalid(f"budget must be a JSON object like {{\"usd\": 1.5, \"tokens\": 20000}}, "
                      f"got {_json_type(budget)}")
    authority = options.get("authority")
    if authority is not None and not isinstance(authority, dict):
        raise invalid(f"authority must be a JSON object like {{\"tools\": [\"search\"], "
                      f"\"usd\": 5}}, got {_json_type(authority)}")
    for name, value in (("budget", budget), ("authority", authority)):
        nulls = sorted(key for key, item in (value or {}).items() if item is None)
        if nulls:  # as the OpenAPI document says: a key is a value or absent
            raise invalid(f"{name} key(s) {_names(nulls)} are null; leave a key out for "
                          "no bound")
    return Enqueue(kind=task, input=args, queue=queue, priority=priority, delay=delay,
                   run_at=run_at, max_attempts=max_attempts, unique=idempotency(options),
                   budget=budget, meta=meta, authority=authority)


def idempotency(options: Mapping[str, Any]) -> Unique | None:
    """``id`` is the unique key itself (so it matches a Python producer's
    ``unique=Unique(key, "always")``); ``submission_id`` derives one
    (``submission:`` + SHA-256 hex), so any string of any length works."""
    if "id" in options:
        key = _identifier("id", options["id"])
        if key.startswith(names.RESERVED_PREFIX):
            raise invalid(f"options.id must not start with '$' (reserved for belay), "
                          f"got {key!r}")
        return Unique(key, "always")
    if "submission_id" in options:
        raw = _identifier("submission_id", options["submission_id"])
        return Unique("submission:" + hashlib.sha256(raw.encode()).hexdigest(), "always")
    return None


def parse_top_up(body: Any, header_key: str | None) -> dict[str, Any]:
    """A ``POST /jobs/{id}/top_up`` body and its ``Idempotency-Key`` header (as
    the server decoded it, latin-1) → ``ops.mutate``'s top_up arguments. The
    key may come in either, or in both when they agree; the amounts and the
    key are checked by ``ops.mutate`` (a ValidationError, answered 400)."""
    if not isinstance(body, dict):
        raise invalid('a top-up is a JSON object like {"usd": 2.5} or {"tokens": 10000}')
    unknown = sorted(set(body) - TOP_UP_FIELDS)
    if unknown:
        raise invalid(f"a top-up takes {', '.join(sorted(TOP_UP_FIELDS))}; unknown field(s) "
                      f"{_names(unknown)}")
    if "idempotency_key" in body and not isinstance(body["idempotency_key"], str):
        raise invalid(f"idempotency_key is a string of 1 to {MAX_ID_BYTES} bytes (UTF-8), "
                      f"got {_show(body['idempotency_key'])}; leave it out for no key")
    args = dict(body)
    if header_key is not None:
        try:  # a header's bytes, as UTF-8 text (the body's key is JSON text)
            key = header_key.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            raise invalid("the Idempotency-Key header is not UTF-8 text; send the key as "
                          "ASCII (or in the body as idempotency_key)") from None
        if args.setdefault("idempotency_key", key) != key:
            raise invalid("the Idempotency-Key header and the body's idempotency_key differ; "
                          "send the key once, or the same key in both")
    return args


def parse_backoff(value: Any) -> dict[str, Any]:
    """``{"type": "exponential", "base_ms": …, "max_ms": …}`` (integers, 1 ms to a
    day, base <= max); returned as stored in meta."""
    if not isinstance(value, dict):
        raise invalid(f"backoff must be a JSON object like {{\"type\": \"exponential\", "
                      f"\"base_ms\": 1000, \"max_ms\": 60000}}, got {_json_type(value)}")
    unknown = sorted(set(value) - {"type", "base_ms", "max_ms"})
    if unknown:
        raise invalid(f"unknown backoff field(s) {_names(unknown)}; use type, base_ms, max_ms")
    if value.get("type") != "exponential":
        raise invalid(f"backoff type must be 'exponential', got {_show(value.get('type'))}")
    for name in ("base_ms", "max_ms"):
        if name not in value:
            raise invalid(f"backoff needs {name} (integer milliseconds)")
    base = _int("backoff base_ms", value["base_ms"], 1, MAX_TIMEOUT_MS)
    top = _int("backoff max_ms", value["max_ms"], 1, MAX_TIMEOUT_MS)
    if top < base:
        raise invalid(f"backoff max_ms ({top}) must be at least base_ms ({base})")
    return {"type": "exponential", "base_ms": base, "max_ms": top}


def round_ms(name: str, seconds: Any) -> int:
    """Seconds (a JSON number) to integer milliseconds; a positive halfway
    millisecond rounds away from zero (0.0005 s is 1 ms)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise invalid(f"{name} is a number of seconds, got {_show(seconds)}")
    if isinstance(seconds, float) and not math.isfinite(seconds):
        raise invalid(f"{name} must be finite, got {seconds!r}")
    try:
        ms = (Decimal(str(seconds)) * 1000).to_integral_value(ROUND_HALF_UP)
    except InvalidOperation:  # pragma: no cover - finite floats always convert
        raise invalid(f"{name} is not a usable number: {seconds!r}") from None
    if ms > 2**63 - 1:
        return 2**63 - 1  # beyond every bound; the caller's range check names it
    return int(ms)


def _schedule(options: Mapping[str, Any], now: datetime
              ) -> tuple[timedelta | None, datetime | None]:
    if "run_at" in options:
        at = _int("run_at", options["run_at"], 0, MAX_RUN_AT_MS,
                  unit="a Unix timestamp in milliseconds")
        return None, _EPOCH + timedelta(milliseconds=at)
    if "delay" in options:
        ms = round_ms("delay", options["delay"])
        # The document's bound is on the seconds sent, not on them rounded.
        if options["delay"] > MAX_DELAY_MS / 1000:
            raise invalid(f"delay must be between 0 and {MAX_DELAY_MS // 1000} seconds, "
                          f"got {options['delay']!r}")
        name = "delay"
    elif "delay_ms" in options:
        ms = options["delay_ms"]
        name = "delay_ms"
    else:
        return None, None
    ms = _int(name, ms, 0, MAX_DELAY_MS, unit="milliseconds" if name == "delay_ms" else
              "milliseconds once rounded")
    last = _EPOCH + timedelta(milliseconds=MAX_RUN_AT_MS)
    if timedelta(milliseconds=ms) > last - now:
        raise invalid(f"{name} puts the job after year 9999; use a shorter delay")
    return timedelta(milliseconds=ms), None


def _timeout(options: Mapping[str, Any]) -> int | None:
    if "timeout" in options:
        ms = round_ms("timeout", options["timeout"])
        if options["timeout"] > MAX_TIMEOUT_MS / 1000:
            raise invalid(f"timeout must be between 0.001 and {MAX_TIMEOUT_MS // 1000} "
                          f"seconds, got {options['timeout']!r}")
        if ms < 1 and options["timeout"] > 0:
            raise invalid(f"timeout {options['timeout']!r} s rounds to 0 ms; the shortest "
                          "timeout is 0.001 s (1 ms)")
        return _int("timeout", ms, 1, MAX_TIMEOUT_MS, unit="milliseconds once rounded")
    if "timeout_ms" in options:
        return _int("timeout_ms", options["timeout_ms"], 1, MAX_TIMEOUT_MS,
                    unit="milliseconds")
    return None


def _exclusive(options: Mapping[str, Any], group: tuple[str, ...], what: str) -> None:
    given = [name for name in group if name in options]
    if len(given) > 1:
        raise invalid(f"options {_names(given)} conflict: give {what} "
                      f"({' or '.join(group)}), not several")


def _identifier(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"options.{name} must be a non-empty string, got {_show(value)}")
    return text(f"options.{name}", value, max_bytes=MAX_ID_BYTES, empty=True)


def text(what: str, value: Any, *, max_bytes: int = names.MAX_NAME_BYTES,
         empty: bool = False) -> str:
    """``value`` if PostgreSQL text can hold it as a name (no NUL, no lone
    surrogate, at most ``max_bytes`` of UTF-8); else a 400 naming ``what``."""
    try:
        return names.check_text(value, what, max_bytes=max_bytes, empty=empty)
    except ValidationError as exc:
        raise invalid(str(exc)) from None


def path_text(raw_path: bytes | None, value: str, what: str) -> str:
    """A path parameter as :func:`text` takes it. ``raw_path`` is the request's
    path as sent: the server percent-decodes invalid UTF-8 (``%ED%A0%80``) to
    U+FFFD, so the parameter alone can't tell it was never text."""
    if raw_path is not None:
        try:
            unquote_to_bytes(raw_path).decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"{what}: the request path is not valid UTF-8 once "
                          "percent-decoded; percent-encode the UTF-8 bytes of the text"
                          ) from None
    return text(what, value)


# -- JSON the HTTP layer takes -------------------------------------------------------------


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, strictly (:func:`belay.codec.parse_text`); a 400
    otherwise. Strings may still hold NUL or lone surrogates: :func:`check_json`
    them."""
    try:
        return parse_text(raw, what="the body")
    except ValidationError as exc:
        raise invalid(str(exc)) from None


def first_line(exc: BaseException) -> str:
    message = str(exc).strip()
    return message.splitlines()[0] if message else type(exc).__name__


def check_json(value: Any, what: str, *, nul: bool = False) -> None:
    """Refuse, with a 400 naming ``what`` and the place inside it, a JSON value
    belay can't store: a string or key holding a NUL (jsonb refuses ``\\u0000``;
    ``nul=True`` for a value stored as bytea, like a result) or a lone surrogate
    (not UTF-8), a NaN or infinity, nesting over :data:`MAX_JSON_DEPTH`. Other
    types pass: belay.codec names those."""
    # Entries are (value, depth, place); a place is (parent place, key), spelled out
    # only for the message, so a large value costs no strings.
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        item, depth, place = stack.pop()
        if isinstance(item, str):
            problem = names.text_problem(item.replace("\x00", "") if nul else item)
            if problem is not None:
                raise invalid(f"{_place(what, place)} {problem}: {_show(item)}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise invalid(f"{_place(what, place)} is {item!r}, which JSON cannot "
                              "represent")
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"{what} nests deeper than {MAX_JSON_DEPTH} levels; flatten it")
            if isinstance(item, list):
                stack.extend((v, depth + 1, (place, i)) for i, v in enumerate(item))
                continue
            for key, v in item.items():
                if isinstance(key, str):
                    problem = names.text_problem(key)
                    if problem is not None:
                        raise invalid(f"a key in {_place(what, place)} {problem}: "
                                      f"{_show(key)}")
                stack.append((v, depth + 1, (place, key)))


def _place(what: str, place: Any) -> str:
    steps: list[str] = []
    while place is not None:
        place, key = place
        if isinstance(key, int):
            steps.append(f"[{key}]")
        elif isinstance(key, str) and key.isidentifier() and len(key) <= 40:
            steps.append(f".{key}")
        else:
            steps.append(f"[{_show(key)}]")
    return what + "".join(reversed(steps))


def canonical(value: Any) -> str:
    """``value`` as text that is equal exactly when the values are the same
    JSON as jsonb keeps it: keys sorted, ``true`` apart from ``1``, ``1`` apart
    from ``1.0``, and a number as PostgreSQL's numeric prints it (so ``1e16``,
    which jsonb reads back as the integer 10000000000000000, equals that
    integer). An idempotent retry is compared this way: Python's ``==`` holds
    ``True == 1 == 1.0``."""
    if value is None or isinstance(value, (bool, str)):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        number = Decimal(repr(value))
        return format(number.copy_abs() if number.is_zero() else number, "f")
    if isinstance(value, list):
        return "[" + ",".join(canonical(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(key))}:{canonical(item)}"
                              for key, item in sorted(value.items())) + "}"
    return repr(value)  # not JSON (an undecodable stored value): equal to nothing sent


def _int(name: str, value: Any, low: int, high: int, *, unit: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        what = f"an integer ({unit})" if unit else "an integer"
        raise invalid(f"{name} must be {what}, got {_show(value)}")
    if not low <= value <= high:
        suffix = f" ({unit})" if unit else ""
        raise invalid(f"{name} must be between {low} and {high}{suffix}, got {value}")
    return value


def _names(items: list[str]) -> str:
    return ", ".join(repr(item) for item in items)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["ApiError", "Enqueue", "parse_enqueue"]
