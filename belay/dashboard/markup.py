"""Escape-by-default HTML building: every value is escaped unless it is :class:`Safe`.

Templates are literal strings of this package; values fill their ``{}`` slots
through :func:`html`, which escapes each one (``html.escape`` with quotes), so
a job's input, kind, step names or events can never become markup.
"""

from __future__ import annotations

import html as _html
import json
from collections.abc import Iterable
from typing import Any


class Safe(str):
    """Markup built here from escaped parts: inserted as is."""

    __slots__ = ()


def escape(value: Any) -> Safe:
    """``value`` as text safe in element content and in quoted attributes."""
    if isinstance(value, Safe):
        return value
    return Safe(_html.escape("" if value is None else str(value), quote=True))


def html(template: str, *values: Any) -> Safe:
    """``template`` (a literal) with each ``{}`` slot filled by an escaped value."""
    return Safe(template.format(*(escape(v) for v in values)))


def join(parts: Iterable[Any], sep: str = "") -> Safe:
    """Parts (escaped unless Safe) joined by the literal ``sep``."""
    return Safe(sep.join(escape(p) for p in parts))


#: JSON shorter than this is shown on one line.
COMPACT = 72


def pretty(value: Any) -> str:
    """A JSON-ready value as JSON text (to be escaped where it is shown): on one
    line when short, indented otherwise; a string as itself."""
    if isinstance(value, str):
        return value
    line = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    if len(line) <= COMPACT:
        return line
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
