"""The report: the issue's ratio targets from the figures, a Markdown table,
and a PNG chart (matplotlib, when installed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from bench.core import Figure

SECTIONS = ("profile", "throughput", "targets", "latency", "enqueue", "scale", "idle", "memory")
#: Runs too long for ``python -m bench``, each measured by its own command into
#: a results file of its own; a full report carries them after its sections.
LONG_RUNS = ("hosts_results.md", "vacuum_results.md")


def _find(figures: list[Figure], test: Callable[[Figure], bool]) -> Figure | None:
    found = [f for f in figures if test(f) and f.value is not None and not math.isnan(f.value)]
    return max(found, key=lambda f: f.value) if found else None


def _system(figure: Figure) -> str:
    return str(figure.extra.get("system", ""))


def derive_targets(figures: list[Figure]) -> list[Figure]:
    """The throughput targets, read across scenarios: belay with 2 worker
    processes against the raw ceiling and the peers' 2-process figures."""
    # (system, factor, label, which of the system's configurations). PgQueuer
    # and Procrastinate are held to every configuration they were run in, so
    # no verdict hides behind the choice of one; Oban and DBOS to the best
    # configuration found in their docs (``config: best`` in the extra).
    peers: tuple[tuple[str, float, str, Callable[[Figure], bool]], ...] = (
        ("pgqueuer", 1.5, "pgqueuer", lambda f: f.extra.get("batch") != 100),
        ("pgqueuer", 1.3, "pgqueuer batch 100", lambda f: f.extra.get("batch") == 100),
        ("procrastinate", 2.0, "procrastinate", lambda f: True),
        ("oban", 1.0, "oban best configuration", lambda f: f.extra.get("config") == "best"),
        ("dbos", 1.0, "dbos best configuration", lambda f: f.extra.get("config") == "best"),
    )
    belay = _find(figures, lambda f: _system(f) == "belay" and f.extra.get("procs") == 2
                  and not f.extra.get("sustained"))
    if belay is None:
        return []
    derived = []
    ceiling = _find(figures, lambda f: f.section == "throughput"
                    and f.name.startswith("raw SQL ceiling"))
    goals: list[tuple[Figure | None, float, str]] = [(ceiling, 0.5, "raw SQL ceiling")]
    for system, factor, label, which in peers:
        goals += [(f, factor, label) for f in figures
                  if _system(f) == system and f.extra.get("procs") == 2 and which(f)
                  and not math.isnan(f.value)]
    for baseline, factor, label in goals:
        if baseline is None:
            continue
        ratio = belay.value / baseline.value
        derived.append(Figure(
            "targets", f"belay 2 processes vs {baseline.name}", belay.value, "jobs/s",
            baseline=baseline.name, baseline_value=baseline.value,
            target=f"≥ {factor:g}x {label}", met=ratio >= factor))
    return derived


def _number(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def machine_table(machine: dict[str, str]) -> list[str]:
    """The machine a report was measured on, as Markdown table lines."""
    return ["| machine | |", "|---|---|",
            *(f"| {key} | {value} |" for key, value in machine.items()), ""]


def publish(report: str, out: str | None) -> None:
    """Print a scenario's report, and write it to ``out`` when given."""
    print(report)
    if out:
        Path(out).write_text(report)


def markdown(figures: list[Figure], machine: dict[str, str], *, quick: bool,
             failures: list[str]) -> str:
    lines = [
        "# belay benchmark results",
        "",
        ("Quick mode (CI sizes): numbers only, too small to judge by."
         if quick else "Full run. Every ratio is against a baseline measured in the same run."),
        "",
        *machine_table(machine),
    ]
    for section in [*SECTIONS, *sorted({f.section for f in figures} - set(SECTIONS))]:
        rows = [f for f in figures if f.section == section]
        if not rows:
            continue
        lines += [f"## {section}", "",
                  "| figure | value | baseline | ratio | target | met | note |",
                  "|---|---:|---|---:|---|:-:|---|"]
        previous = ""
        for f in rows:
            baseline = "" if f.baseline is None else (
                f"{f.baseline}: {_number(f.baseline_value)} {f.unit}")
            met = "" if f.met is None else ("yes" if f.met else "**no**")
            ratio = "" if f.ratio is None else f"{f.ratio:.2f}"
            note = f.note.replace("|", "\\|").replace("\n", " ")
            # A method shared by several rows is said once.
            note, previous = ("as above" if note and note == previous else note), note
            lines.append(f"| {f.name} | {_number(f.value)} {f.unit} | {baseline} | {ratio} | "
                         f"{f.target or ''} | {met} | {note} |")
        lines.append("")
    if failures:
        lines += ["## failed scenarios", "", *(f"- {failure}" for failure in failures), ""]
    if not quick:
        lines += long_runs(Path(__file__).parent)
    return "\n".join(lines)


def _marked(lines: list[str]) -> list[str]:
    """A results file's title and the blocks between ``<!-- results -->`` and
    ``<!-- /results -->``; the whole file when it marks none."""
    if "<!-- results -->" not in lines:
        return lines
    kept, inside = [*lines[:1], ""], False
    for line in lines[1:]:
        if line.strip() in ("<!-- results -->", "<!-- /results -->"):
            inside = line.strip() == "<!-- results -->"
            continue
        if inside:
            kept.append(line)
    return kept


def long_runs(folder: Path) -> list[str]:
    """The :data:`LONG_RUNS` files found in ``folder``, each as one ``##``
    section (a file's own headings one level down; only its marked blocks, when
    it marks some), with where it came from."""
    lines: list[str] = []
    for name in LONG_RUNS:
        path = folder / name
        if not path.exists():
            continue
        text = _marked(path.read_text().strip().splitlines())
        top = min((len(line) - len(line.lstrip("#")) for line in text if line.startswith("#")),
                  default=2)
        shift = 2 - top
        for line in text:
            if line.startswith("#"):
                line = "#" * shift + line if shift > 0 else line[-shift:]
            lines.append(line)
        lines += ["", f"(From [{name}]({name}), measured on its own; not re-run by "
                      "`python -m bench`.)", ""]
    return lines


def chart(figures: list[Figure], path: str) -> None:
    """Throughput per system and latency percentiles, side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'belay[bench]'): no chart")
        return
    throughput = [f for f in figures if f.section == "throughput" and f.unit == "jobs/s"
                  and not math.isnan(f.value)]
    latency = [f for f in figures if f.section == "latency" and f.unit == "ms"
               and not math.isnan(f.value)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 7))
    names = [f.name for f in throughput]
    left.barh(names, [f.value for f in throughput],
              color=["tab:blue" if _system(f) == "belay" else "tab:gray" for f in throughput])
    left.set_xlabel("jobs/s")
    left.set_title("Throughput (no-op jobs)")
    left.invert_yaxis()
    right.barh([f.name for f in latency], [f.value for f in latency],
               color=["tab:gray" if f.name.startswith("raw") else "tab:orange" for f in latency])
    right.set_xlabel("ms")
    right.set_title("Dispatch latency")
    right.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
