"""The dashboard's Spend page: what jobs spent, as a chart, a table and a tree.

``/spend`` and ``/api/spend`` read :func:`belay.ops.spend_view`, the view every
operator surface shares; this module turns a query string into its arguments
(:func:`spend_args`) and renders what it answers: a bar chart of USD over the
range (an inline SVG built here, no script, no external asset), the groups of
the chosen dimension(s) with their share of the total, and one job's tree per
kind. Every value goes through :mod:`belay.dashboard.markup`, so a meta value
or a kind holding markup shows as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, Final
from urllib.parse import urlencode

from belay import ops
from belay.dashboard.markup import Safe, html, join
from belay.dashboard.pages import Page, layout
from belay.errors import ValidationError
from belay.spend import DEFAULT_LIMIT, DIMENSIONS, MAX_LIMIT

#: The spans offered in the form (any ``<n>m|h|d|w`` or ISO time is taken).
SPANS: Final = ("24h", "48h", "7d", "30d", "90d")
#: A range up to this long is charted per hour, a longer one per day ...
HOURLY_UP_TO: Final = timedelta(hours=48)
#: ... and one of more days than this per month.
DAILY_UP_TO: Final = 731
#: The chart's drawing, in SVG user units (it scales to the page's width).
WIDTH, HEIGHT, LEFT, TOP, BOTTOM = 800, 190, 64, 12, 24


# -- Arguments -------------------------------------------------------------------------


def spend_args(query: Mapping[str, str], by: Sequence[str] = ()) -> dict[str, Any]:
    """The arguments of :func:`belay.ops.spend_view` from a query string.

    ``by`` are the values of every ``by`` parameter (one dimension, or two:
    ``by=day&by=kind``); ``since``, ``until``, ``kind``, ``queue``, ``limit``
    and ``tree`` pass as given. The meta filter is ``meta.<key>=<value>`` per
    key (the value as text: ``meta.customer=acme``) and/or ``meta=`` with
    ``key=value`` or a JSON object (``meta={"customer": 7}`` for a value that
    is not text). Empty values are left out (a submitted form sends every
    field); any other name is passed on, so spend_view refuses it by name."""
    args: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for name, raw in query.items():
        value = raw.strip()
        if name == "by" or not value:
            continue
        if name.startswith("meta."):
            meta[name[5:]] = value
        elif name == "meta":
            meta.update(meta_arg(value))
        else:
            args[name] = value
    given = [d.strip() for d in by if d.strip()]
    if given:
        args["by"] = given[0] if len(given) == 1 else given
    if meta:
        args["meta"] = meta
    return args


def meta_arg(text: str) -> dict[str, Any]:
    """``customer=acme`` → ``{"customer": "acme"}``; ``{"customer": 7}`` as JSON."""
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValidationError(f"meta nests deeper than {ops.MAX_JSON_DEPTH} levels (the "
                                  "limit for operator payloads); send a flatter object") from None
        except ValueError:
            raise ValidationError(f"meta is key=value or a JSON object, and {ops.shown(text)} "
                                  "is not valid JSON") from None
        return ops.object_arg(value, "meta")
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValidationError(f"meta filters as key=value (like customer=acme) or a JSON object "
                              f'(like {{"customer": 7}}), got {ops.shown(text)}')
    return {key.strip(): value.strip()}


# -- The chart's data ------------------------------------------------------------------


def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(timezone.utc)


def unit_of(view: Mapping[str, Any]) -> str:
    """``hour``, ``day`` or ``month``: the bars a report's range is charted in."""
    span = _moment(view["until"]) - _moment(view["since"])
    if span <= HOURLY_UP_TO:
        return "hour"
    return "day" if span.days <= DAILY_UP_TO else "month"


def chart_view(client: Any, args: Mapping[str, Any], view: Mapping[str, Any]) -> dict[str, Any]:
    """The same question as ``args`` (range and filters) per hour or per day,
    every group listed: what the chart draws. Its ``unit`` says which."""
    unit = unit_of(view)
    series = ops.spend_view(client, {**args, "by": "hour" if unit == "hour" else "day",
                                     "limit": MAX_LIMIT})
    return {**series, "unit": unit}


def buckets(series: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One bar per hour, day or month of the range, in time order, empty ones
    included: ``{"key", "jobs", "usd_micros", "tokens"}``."""
    unit = series["unit"]
    since, until = _moment(series["since"]), _moment(series["until"])
    keys: list[str] = []
    if unit == "month":
        year, month = since.year, since.month
        while (year, month) <= (until.year, until.month):
            keys.append(f"{year:04d}-{month:02d}")
            year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    else:
        step = timedelta(hours=1) if unit == "hour" else timedelta(days=1)
        at = since.replace(minute=0, second=0, microsecond=0)
        if unit == "day":
            at = at.replace(hour=0)
        while at < until:
            keys.append(at.strftime("%Y-%m-%dT%H:00" if unit == "hour" else "%Y-%m-%d"))
            at += step
    sums = {key: [0, 0, 0] for key in keys}
    for row in series["rows"]:
        raw = row["key"][0]
        if raw is None:
            continue
        key = str(raw)[:7] if unit == "month" else str(raw)
        totals = sums.setdefault(key, [0, 0, 0])
        for n, name in enumerate(("jobs", "usd_micros", "tokens")):
            totals[n] += int(row[name])
    return [{"key": key, "jobs": sums[key][0], "usd_micros": sums[key][1],
             "tokens": sums[key][2]} for key in sorted(sums)]


# -- Formatting ------------------------------------------------------------------------


def dollars(micros: int) -> str:
    """Exact dollars from micro-dollars: two decimals at least, six at most."""
    whole, fraction = divmod(abs(int(micros)), 1_000_000)
    cents = f"{fraction:06d}".rstrip("0").ljust(2, "0")
    return f"{'-' if micros < 0 else ''}${whole:,}.{cents}"


def share(part: int, whole: int) -> Safe:
    """A group's share of the total USD, as a meter and a percentage."""
    if whole <= 0:
        return Safe("—")
    fraction = max(0.0, min(1.0, part / whole))
    return html('<meter min="0" max="1" value="{}"></meter> {}', f"{fraction:.4f}",
                f"{part / whole:.1%}")


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def chart(series: Mapping[str, Any]) -> Safe:
    """USD per bar as an inline SVG: a bar per hour/day/month (each with its
    numbers in a ``<title>`` and ``data-`` attributes), the largest as the scale."""
    bars = buckets(series)
    top = max((b["usd_micros"] for b in bars), default=0)
    plot_w, plot_h = WIDTH - LEFT - 8, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(bars), 1)
    rects = []
    for n, bar in enumerate(bars):
        tall = plot_h * bar["usd_micros"] / top if top > 0 else 0.0
        rects.append(html(
            '<rect class="bar" data-key="{}" data-usd-micros="{}" data-jobs="{}" '
            'x="{}" y="{}" width="{}" height="{}"><title>{}: {} · {} job(s) · {} tokens'
            "</title></rect>",
            bar["key"], bar["usd_micros"], bar["jobs"], _number(LEFT + n * slot + slot * 0.1),
            _number(TOP + plot_h - max(tall, 0.0)), _number(max(slot * 0.8, 0.5)),
            _number(max(tall, 0.0)), bar["key"], dollars(bar["usd_micros"]), bar["jobs"],
            f"{bar['tokens']:,}"))
    labels = []
    if bars:
        marks = sorted({0, len(bars) // 2, len(bars) - 1})
        for n in marks:
            anchor = "start" if n == 0 and len(marks) > 1 else "end" if n == len(bars) - 1 \
                else "middle"
            labels.append(html('<text class="x" x="{}" y="{}" text-anchor="{}">{}</text>',
                               _number(LEFT + n * slot + slot / 2), HEIGHT - 6, anchor,
                               bars[n]["key"].replace("T", " ")))
    return html(
        '<svg class="spend-chart" id="spend-chart" xmlns="http://www.w3.org/2000/svg" '
        'role="img" aria-label="USD per {}" data-unit="{}" viewBox="0 0 {} {}">'
        '<line class="axis" x1="{}" y1="{}" x2="{}" y2="{}"/>'
        '<line class="grid" x1="{}" y1="{}" x2="{}" y2="{}"/>'
        '<text class="y" x="{}" y="{}" text-anchor="end">{}</text>'
        '<text class="y" x="{}" y="{}" text-anchor="end">$0</text>{}{}</svg>',
        series["unit"], series["unit"], WIDTH, HEIGHT,
        LEFT, TOP + plot_h, WIDTH - 8, TOP + plot_h, LEFT, TOP, WIDTH - 8, TOP,
        LEFT - 6, TOP + 4, dollars(top), LEFT - 6, TOP + plot_h,
        join(rects), join(labels))


# -- Pages -----------------------------------------------------------------------------


def _link(page: Page, path: str, pairs: Sequence[tuple[str, Any]]) -> str:
    """``path`` with these query pairs (a name may repeat, like ``by``)."""
    shown = [(k, str(v)) for k, v in pairs if v not in (None, "")]
    return page.base + path + ("?" + urlencode(shown) if shown else "")


def key_cell(page: Page, dimension: str, value: str | None) -> Safe:
    """A group's key: a job id links to its job (and, for ``tree``, its tree's
    spend), a workflow id to its workflow; none reads as such."""
    if value is None:
        return html('<span class="muted">(none)</span>')
    if dimension in ("tree", "parent") and value.isascii() and value.isdigit():
        cell = html('<a href="{}">{}</a>', page.url(f"/jobs/{int(value)}"), value)
        if dimension == "tree":
            cell = html('{} <a class="more" href="{}">tree</a>', cell,
                        page.url("/spend", tree=int(value)))
        return cell
    if dimension == "workflow":
        return html('<a href="{}">{}</a>', page.url("/workflow", id=value), value)
    return html("{}", value)


NUMBER_HEADS: Final = Safe('<th class="num">jobs</th><th class="num">USD</th>'
                           '<th class="num">tokens</th><th>share</th>')


def _spend_cells(s: Mapping[str, Any], whole: int) -> Safe:
    return html('<td class="num">{}</td><td class="num">{}</td><td class="num">{}</td>'
                '<td class="share">{}</td>', f"{int(s['jobs']):,}", dollars(s["usd_micros"]),
                f"{int(s['tokens']):,}", share(int(s["usd_micros"]), whole))


def report_table(page: Page, view: Mapping[str, Any]) -> Safe:
    """The groups, largest first (in time order for day/hour), then the total."""
    dims = list(view["by"])
    whole = int(view["total"]["usd_micros"])
    rows = join(
        html('<tr class="group">{}{}</tr>',
             join(html('<td class="key">{}</td>', key_cell(page, d, k))
                  for d, k in zip(dims, row["key"], strict=False)),
             _spend_cells(row, whole))
        for row in view["rows"]) or html(
        '<tr><td colspan="{}" class="muted">no job enqueued in this range spent anything'
        "</td></tr>", len(dims) + 4)
    heads = join(html("<th>{}</th>", d) for d in dims)
    return html(
        '<table class="spend" id="spend-groups"><thead><tr>{}{}</tr></thead><tbody>{}</tbody>'
        '<tfoot><tr id="spend-total"><td colspan="{}">total</td>{}</tr></tfoot></table>',
        heads, NUMBER_HEADS, rows, len(dims), _spend_cells(view["total"], whole))


def _form(page: Page, query: Mapping[str, str], by: Sequence[str]) -> Safe:
    """The question: dimensions (a list to pick from, or meta:<key>), range, filters."""
    options = join(html('<option value="{}"></option>', d)
                   for d in (*DIMENSIONS, "meta:customer"))
    spans = join(html('<option value="{}"></option>', s) for s in SPANS)
    given = [*by, "", ""][:2]
    kept = join(html('<input type="hidden" name="{}" value="{}">', name, value)
                for name, value in query.items() if name.startswith("meta."))
    return html(
        '<form class="filters" id="spend-form" method="get" action="{}">'
        '<datalist id="spend-dims">{}</datalist><datalist id="spend-spans">{}</datalist>'
        '<label>by <input name="by" value="{}" size="14" list="spend-dims" '
        'placeholder="kind"></label>'
        '<label>then by <input name="by" value="{}" size="14" list="spend-dims" '
        'placeholder="(none)"></label>'
        '<label>since <input name="since" value="{}" size="12" list="spend-spans" '
        'placeholder="7d"></label>'
        '<label>until <input name="until" value="{}" size="12" placeholder="now"></label>'
        '<label>kind <input name="kind" value="{}" size="14"></label>'
        '<label>queue <input name="queue" value="{}" size="10"></label>'
        '<label>meta <input name="meta" value="{}" size="16" placeholder="customer=acme">'
        '</label><label>limit <input name="limit" value="{}" size="5" inputmode="numeric" '
        'placeholder="{}"></label>{}'
        ' <button type="submit">Show</button> <a href="{}">clear</a></form>',
        page.url("/spend"), options, spans, given[0], given[1], query.get("since", ""),
        query.get("until", ""), query.get("kind", ""), query.get("queue", ""),
        query.get("meta", ""), query.get("limit", ""), DEFAULT_LIMIT, kept, page.url("/spend"))


def spend_page(page: Page, view: Mapping[str, Any], series: Mapping[str, Any],
               query: Mapping[str, str], by: Sequence[str]) -> str:
    """The form, USD over the range as bars, the groups and their total."""
    listed, groups = len(view["rows"]), int(view["groups"])
    capped = Safe("")
    if listed < groups:
        pairs = [*(("by", d) for d in view["by"]),
                 *((k, v) for k, v in query.items() if k not in ("by", "limit")),
                 ("limit", min(groups, MAX_LIMIT))]
        capped = html(
            '<p class="muted" id="spend-capped">showing {} of {} groups (the {}); the total '
            'covers all of them. <a href="{}">show all {}</a></p>', listed, f"{groups:,}",
            "first in time" if view["by"][0] in ("day", "hour") else "largest",
            _link(page, "/spend", pairs), f"{min(groups, MAX_LIMIT):,}")
    series_note = Safe("")
    if len(series["rows"]) < int(series["groups"]):
        series_note = html('<p class="muted">the chart holds the first {} {}s of {}</p>',
                           len(series["rows"]), "hour" if series["unit"] == "hour" else "day",
                           series["groups"])
    api = _link(page, "/api/spend", [*(("by", d) for d in view["by"]),
                       *((k, v) for k, v in query.items() if k != "by")])
    body = html(
        '<h1>Spend <span class="kind">by {}</span></h1>{}'
        '<p class="muted" id="spend-range">jobs enqueued from {} until {} (UTC), counting '
        'what each job spent itself · <a href="{}">JSON</a></p>'
        '<h2>USD per {}</h2><div class="chart-box">{}</div>{}'
        "<h2>Groups</h2>{}{}"
        '<form class="filters tree-form" method="get" action="{}"><label>one job\'s tree: job id '
        '<input name="tree" size="8" inputmode="numeric" required></label> '
        '<button type="submit">Show tree</button></form>',
        " and ".join(view["by"]), _form(page, query, by), _when(view["since"]),
        _when(view["until"]), api,
        series["unit"], chart(series), series_note, report_table(page, view), capped,
        page.url("/spend"))
    return layout(page, "Spend", "spend", body)


def _when(iso: str) -> str:
    return _moment(iso).strftime("%Y-%m-%d %H:%M:%S")


def tree_page(page: Page, view: Mapping[str, Any]) -> str:
    """One job and its descendants: the total and a row per kind."""
    job_id = int(view["job_id"])
    total = view["total"]
    whole = int(total["usd_micros"])
    rows = join(html('<tr class="group"><td class="kind">{}</td>{}</tr>', kind,
                     _spend_cells(s, whole))
                for kind, s in view["by_kind"].items())
    body = html(
        '<h1>Spend <span class="kind">of job {}\'s tree</span></h1>'
        '<p class="links"><a href="{}">job {}</a> and its descendants: {} job(s), {} level(s) '
        "deep, however long ago · <a href=\"{}\">JSON</a> · <a href=\"{}\">all spend</a></p>"
        '<table class="spend" id="spend-groups"><thead><tr><th>kind</th>{}</tr></thead>'
        "<tbody>{}</tbody>"
        '<tfoot><tr id="spend-total"><td>total</td>{}</tr></tfoot></table>',
        job_id, page.url(f"/jobs/{job_id}"), job_id, f"{int(total['jobs']):,}", view["depth"],
        page.url("/api/spend", tree=job_id), page.url("/spend"), NUMBER_HEADS, rows,
        _spend_cells(total, whole))
    return layout(page, f"Spend of job {job_id}'s tree", "spend", body)
