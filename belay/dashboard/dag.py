"""A workflow's dependency graph laid out in layers, drawn as SVG.

:func:`layout` is pure: members and their deps in, a position for every
member out. Each member sits one layer right of its deepest dependency
(longest-path layering), members within a layer are ordered to keep edges
short (barycentre sweeps), and each edge runs from a dependency's right side
to its dependant's left side. :func:`svg` draws a layout with every label
escaped; nodes carry ``data-name`` and a ``st-<state>`` class the page's
script updates as states change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from belay.dashboard.markup import Safe, html, join
from belay.job import STATES

NODE_W = 168
NODE_H = 40
GAP_X = 56
GAP_Y = 14
PAD = 8
SWEEPS = 4
LABEL_CHARS = 22


@dataclass(frozen=True)
class Box:
    """Where one member is drawn: its layer, its place in the layer, its top-left corner."""

    name: str
    layer: int
    index: int
    x: float
    y: float


@dataclass(frozen=True)
class Layout:
    boxes: dict[str, Box]
    edges: list[tuple[str, str]]
    width: float
    height: float


def layers(deps: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Members by layer: layer 0 has no deps; every other member is one layer
    after its deepest dep. Deps naming no member are ignored, and so is the
    edge that would close a cycle; members keep their given order."""
    depth: dict[str, int] = {}
    for root in deps:
        if root in depth:
            continue
        # Iterative depth-first walk: a deep chain must not hit the recursion limit.
        on_path: set[str] = set()
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            name, i = stack.pop()
            if i == 0:
                on_path.add(name)
            known = [d for d in deps[name] if d in deps]
            if i < len(known):
                stack.append((name, i + 1))
                dep = known[i]
                if dep not in depth and dep not in on_path:
                    stack.append((dep, 0))
                continue
            on_path.discard(name)
            depth[name] = 1 + max((depth[d] for d in known if d in depth), default=-1)
    out: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for name in deps:
        out[depth[name]].append(name)
    return out


def _order(rows: list[list[str]], deps: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Reorder each layer by the mean position of its neighbours, sweeping
    down (by deps) and up (by dependants) a few times."""
    dependants: dict[str, list[str]] = {name: [] for name in deps}
    for name, ds in deps.items():
        for dep in ds:
            if dep in dependants:
                dependants[dep].append(name)
    rows = [list(row) for row in rows]

    def position() -> dict[str, float]:
        return {name: i / max(len(row), 1) for row in rows for i, name in enumerate(row)}

    for sweep in range(SWEEPS):
        down = sweep % 2 == 0
        span = range(1, len(rows)) if down else range(len(rows) - 2, -1, -1)
        for layer in span:
            where = position()
            links = deps if down else dependants

            size = max(len(rows[layer]), 1)

            def key(item: tuple[int, str], where: dict[str, float] = where,
                    links: Mapping[str, Sequence[str]] = links, size: int = size
                    ) -> tuple[float, int]:
                i, name = item
                seen = [where[n] for n in links[name] if n in where]
                return (sum(seen) / len(seen) if seen else i / size, i)

            rows[layer] = [name for _, name in sorted(enumerate(rows[layer]), key=key)]
    return rows


def layout(deps: Mapping[str, Sequence[str]]) -> Layout:
    """Positions for members given as name → the names they depend on (in order)."""
    rows = _order(layers(deps), deps)
    tallest = max((len(row) for row in rows), default=0)
    height = 2 * PAD + tallest * NODE_H + max(tallest - 1, 0) * GAP_Y
    width = 2 * PAD + len(rows) * NODE_W + max(len(rows) - 1, 0) * GAP_X
    boxes: dict[str, Box] = {}
    for layer, row in enumerate(rows):
        used = len(row) * NODE_H + max(len(row) - 1, 0) * GAP_Y
        top = PAD + (height - 2 * PAD - used) / 2
        for index, name in enumerate(row):
            boxes[name] = Box(name, layer, index, PAD + layer * (NODE_W + GAP_X),
                              top + index * (NODE_H + GAP_Y))
    edges = [(dep, name) for name, ds in deps.items() for dep in ds
             if dep in boxes and boxes[dep].layer < boxes[name].layer]
    return Layout(boxes, edges, width, height)


def state_class(state: Any) -> str:
    """The CSS class of a state; an unknown one gets ``st-unknown``."""
    return f"st-{state}" if state in STATES else "st-unknown"


def _label(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def svg(workflow: Mapping[str, Any], href: Callable[[int], str],
        current: int | None = None) -> Safe:
    """A workflow (as :func:`belay.ops.workflow_view` gives it) as an inline SVG
    graph: one linked node per member, coloured by state, an arrow per dep."""
    members = [m for m in workflow["jobs"] if m.get("name") is not None]
    by_name = {m["name"]: m for m in members}
    shape = layout({m["name"]: list(m.get("deps") or ()) for m in members})
    paths = []
    for src, dst in shape.edges:
        a, b = shape.boxes[src], shape.boxes[dst]
        x1, y1 = a.x + NODE_W, a.y + NODE_H / 2
        x2, y2 = b.x - 3, b.y + NODE_H / 2
        bend = (x2 - x1) / 2
        paths.append(html(
            '<path class="edge" data-from="{}" data-to="{}" '
            'd="M{} {} C{} {} {} {} {} {}" marker-end="url(#arrow)"/>',
            src, dst, _n(x1), _n(y1), _n(x1 + bend), _n(y1), _n(x2 - bend), _n(y2),
            _n(x2), _n(y2)))
    nodes = []
    for name, box in shape.boxes.items():
        member = by_name[name]
        classes = f"node {state_class(member['state'])}"
        if current is not None and member["id"] == current:
            classes += " current"
        nodes.append(html(
            '<a href="{}"><g class="{}" data-name="{}" data-id="{}">'
            "<title>{} · job {} · {} · {}</title>"
            '<rect x="{}" y="{}" width="{}" height="{}" rx="5"/>'
            '<text class="name" x="{}" y="{}">{}</text>'
            '<text class="state" x="{}" y="{}">{}</text></g></a>',
            href(int(member["id"])), classes, name, member["id"],
            name, member["id"], member["kind"], member["state"],
            _n(box.x), _n(box.y), NODE_W, NODE_H,
            _n(box.x + 9), _n(box.y + 17), _label(name),
            _n(box.x + 9), _n(box.y + 32), member["state"]))
    return html(
        '<svg class="dag" xmlns="http://www.w3.org/2000/svg" role="img" '
        'aria-label="workflow {}" width="{}" height="{}" viewBox="0 0 {} {}">'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0 0 L10 5 L0 10 z"/></marker>'
        "</defs>{}{}</svg>",
        workflow["workflow_id"], _n(shape.width), _n(shape.height), _n(shape.width),
        _n(shape.height), join(paths), join(nodes))


def _n(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")
