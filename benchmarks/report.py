"""What ``python -m fshard bench`` writes: the rich table, the JSON file and the PNG plot."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import Row, Settings

__all__ = ["load_rows", "machine", "markdown", "plot", "render", "save", "stamp", "table_text"]


def machine() -> dict[str, Any]:
    """Where the numbers come from, and how busy the machine was when they started."""
    import numpy
    import torch

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "load_before": load(),
    }


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        text = Path("/proc/meminfo").read_text()
        kib = int(next(line.split()[1] for line in text.splitlines() if line.startswith("MemTotal:")))
        return round(kib / 2**20, 1)
    return None


def load() -> str:
    """The 1, 5 and 15 minute load averages: how much else the machine was running."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def stamp() -> str:
    """A file-name time stamp, ``20250101-120000``."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


# -- the table ------------------------------------------------------------------------------


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _sent(r: Row) -> str:
    """``12.0 / 12.0 ✓``: MiB sent against the minimum (fshard), or just MiB sent (floors)."""
    if r.sent_bytes is None:
        return ""
    if r.impl != "fshard" or r.min_bytes is None:
        return _mib(r.sent_bytes)
    return f"{_mib(r.sent_bytes)} / {_mib(r.min_bytes)} {'✓' if r.sent_bytes == r.min_bytes else '✗'}"


def _check(r: Row) -> str:
    return {None: "", True: "✓", False: "✗ WRONG"}[r.verified]


# Optional columns, shown for a group only where one of its rows has the field.
_EXTRA: tuple[tuple[str, str, Any], ...] = (
    ("MiB sent / min", "sent_bytes", _sent),
    ("peak +MiB", "peak_mib", lambda r: "" if r.peak_mib is None else f"{r.peak_mib:.0f}"),
    ("result", "verified", _check),
)


def _columns(rows: Sequence[Row]) -> list[tuple[str, dict[str, Any], Any]]:
    """(header, rich column options, cell function) of each column the rows need."""
    ratio = lambda r: f"{r.ratio:.2f} {r.ratio_to}" if r.ratio is not None else ""  # noqa: E731
    target = lambda r: f"{r.target} {'✓' if r.ok else '✗'}" if r.ok is not None else r.target  # noqa: E731
    out: list[tuple[str, dict[str, Any], Any]] = [
        ("implementation", {"no_wrap": True}, lambda r: r.impl),
        ("median", {"justify": "right", "no_wrap": True}, lambda r: _time(r.seconds)),
        ("reps", {"justify": "right"}, lambda r: str(r.reps or "")),
        ("ratio", {"justify": "right", "no_wrap": True}, ratio),
        ("target", {"no_wrap": True}, target),
    ]
    for header, field, cell in _EXTRA:
        if any(getattr(r, field) is not None for r in rows):
            out.append((header, {"justify": "right", "no_wrap": True}, cell))
    return out


def _table(group: str, rows: Sequence[Row]) -> Any:
    from rich.table import Table

    table = Table(title=group, title_justify="left")
    columns = _columns(rows)
    table.add_column("case", max_width=38)
    for header, options, _ in columns:
        table.add_column(header, **options)
    table.add_column("note", overflow="fold", min_width=24)
    last: Row | None = None
    for r in rows:
        same = last is not None and r.case == last.case
        if last is not None and not same:
            table.add_section()
        note = "" if same and last is not None and r.note == last.note else r.note
        table.add_row("" if same else r.case, *(cell(r) for _, _, cell in columns), note)
        last = r
    return table


def render(rows: Sequence[Row], info: dict[str, Any], console: Any = None) -> None:
    """Prints one rich table per group, after a line naming the machine."""
    from rich.console import Console

    console = console or Console(width=max(190, Console().width))
    memory = f", {info['memory_gib']} GiB" if info.get("memory_gib") else ""
    console.print(
        f"[bold]fshard bench[/] on {info['cpu']} ({info['cores']} cores{memory}), torch {info['torch']}, "
        f"Python {info['python']}; load average before: {info['load_before']}",
        highlight=False,
    )
    for group in dict.fromkeys(r.group for r in rows):
        console.print(_table(group, [r for r in rows if r.group == group]))


def table_text(rows: Sequence[Row], info: dict[str, Any], width: int = 190) -> str:
    """The tables as plain text (what ``render`` prints), for a file or the docs."""
    from rich.console import Console

    console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    render(rows, info, console)
    console.file.close()
    return console.export_text()


# -- Markdown -------------------------------------------------------------------------------


def markdown(rows: Sequence[Row]) -> str:
    """The results as Markdown tables, one per group, for the docs.

    A group whose rows have sizes (data movement) becomes one line per case and size,
    one column per implementation (median and ratio), then fshard's bytes sent against
    the minimum, its peak extra memory, whether its target was met and whether every
    result was correct. Other groups list their rows as the terminal table does.
    """
    out = []
    for group in dict.fromkeys(r.group for r in rows):
        members = [r for r in rows if r.group == group]
        table = _pivot(members) if all(r.size_mib is not None for r in members) else _plain(members)
        out.append(f"**{group}**\n\n" + "\n".join("| " + " | ".join(cells) + " |" for cells in table))
    return "\n\n".join(out) + "\n"


def _cell(r: Row | None) -> str:
    if r is None:
        return ""
    if r.seconds is None:
        return "N/A" if r.note.startswith("N/A") else "-"
    ratio = f" ({r.ratio:.2f}x)" if r.ratio is not None else ""
    return f"{r.seconds * 1e3:.2f}{ratio}"


def _order(rows: Sequence[Row]) -> list[str]:
    """The implementations of all cases in one order: each new one right after its predecessor in its case."""
    out: list[str] = []
    for case in dict.fromkeys(r.case for r in rows):
        before = -1
        for impl in [r.impl for r in rows if r.case == case]:
            if impl not in out:
                out.insert(before + 1, impl)
            before = out.index(impl)
    return out


def _drop_empty(table: list[list[str]]) -> list[list[str]]:
    keep = [k for k in range(len(table[0])) if any(row[k] for row in table[2:])]
    return [[row[k] for k in keep] for row in table]


REFERENCE = "pack+a2a"  # a hand-packed reference that fshard's own ratio is also given against


def _pivot(rows: Sequence[Row]) -> list[list[str]]:
    impls = _order(rows)
    ref = [f"fshard / {REFERENCE}"] if REFERENCE in impls else []
    head = ["case", "MiB", *(f"{i} ms" for i in impls), *ref, "sent / min MiB", "peak +MiB", "target", "results"]
    table = [head, ["---"] * len(head)]
    for case in dict.fromkeys(r.case for r in rows):
        got = {r.impl: r for r in rows if r.case == case}
        first = next(iter(got.values()))
        main = next((r for r in got.values() if r.target and r.ok is not None and not r.impl.startswith(("Sh", "DT"))
                     and r.impl != REFERENCE), None)  # fmt: skip
        sent = _sent(main) if main is not None and main.sent_bytes is not None else ""
        peak = "" if main is None or main.peak_mib is None else f"{main.peak_mib:.0f}"
        target = "" if main is None else f"{main.target} {'✓' if main.ok else '✗'}"
        checked = [r.verified for r in got.values() if r.verified is not None]
        results = "" if not checked else ("✓" if all(checked) else "✗ WRONG")
        cells = [_cell(got.get(i)) for i in impls]
        if ref:
            cells.append(_versus(got.get("fshard"), got.get(REFERENCE)))
        table.append([first.series, f"{first.size_mib:g}", *cells, sent, peak, target, results])
    return _drop_empty(table)


def _versus(fshard: Row | None, ref: Row | None) -> str:
    """``1.05x ✓``: fshard's time over the reference's, against the reference row's target."""
    if fshard is None or ref is None or not fshard.seconds or not ref.seconds:
        return ""
    return f"{fshard.seconds / ref.seconds:.2f}x {'✓' if ref.ok else '✗'}"


def _plain(rows: Sequence[Row]) -> list[list[str]]:
    head = ["case", "implementation", "median", "ratio", "target", "note"]
    table = [head, ["---"] * len(head)]
    for r in rows:
        ratio = f"{r.ratio:.2f} {r.ratio_to}" if r.ratio is not None else ""
        target = f"{r.target} {'✓' if r.ok else '✗'}" if r.ok is not None else r.target
        table.append([r.case, r.impl, _time(r.seconds), ratio, target, r.note.replace("|", "/")])
    return table


# -- JSON -----------------------------------------------------------------------------------


def save(rows: Sequence[Row], info: dict[str, Any], settings: Settings, path: Path, wall_s: float) -> Path:
    """Writes the rows, the machine, the settings and the wall time as JSON to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": info,
        "settings": settings.to_dict(),
        "wall_s": wall_s,
        "rows": [r.to_dict() for r in rows],
    }
    path.write_text(json.dumps(data, indent=1))
    return path


def load_rows(path: Path) -> list[Row]:
    """The rows of a JSON file written by ``save``."""
    data = json.loads(path.read_text())
    return [Row(**{**r, "samples": tuple(r["samples"])}) for r in data["rows"]]


# -- the plot -------------------------------------------------------------------------------


def plot_series(rows: Sequence[Row]) -> dict[tuple[str, str], dict[str, list[tuple[float, float]]]]:
    """(group, series) -> implementation -> sorted (x, seconds) points.

    What ``plot`` draws (x is ``size_mib``, or ``x`` for the rows that give it).
    """
    out: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        x = r.x if r.x is not None else r.size_mib
        if x is None or r.seconds is None or not r.series:
            continue
        out.setdefault((r.group, r.series), {}).setdefault(r.impl, []).append((x, r.seconds))
    return {k: {impl: sorted(points) for impl, points in v.items()} for k, v in out.items()}


def plot(rows: Sequence[Row], paths: Sequence[Path], title: str = "") -> list[Path]:
    """Draws time against size (log-log), one panel per case and one line per implementation.

    Writes the PNG to each of ``paths`` and returns them (none when no row has a size).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    series = plot_series(rows)
    labels = {(r.group, r.series): r.x_label or "MiB" for r in rows if r.series}
    if not series or not paths:
        return []
    cols = min(3, len(series))
    nrows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, ((group, name), lines) in zip(axes.flat, series.items()):
        sizes = sorted({x for points in lines.values() for x, _ in points})
        for impl, points in lines.items():
            xs, ys = zip(*points)
            ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=impl, **_style(impl))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{name} ({group.split(':')[0]})", fontsize=9)
        ax.set_xlabel(labels.get((group, name), "MiB"))
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(series) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98 if title else 1))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
    plt.close(fig)
    return list(paths)


_STYLES: dict[str, dict[str, Any]] = {
    "fshard": {"color": "C0", "linewidth": 2.4},
    "floor": {"color": "0.25", "linestyle": "--"},
    "floor p2p": {"color": "0.6", "linestyle": "--"},
    "copy_ floor": {"color": "0.25", "linestyle": "--"},
    "copies": {"color": "C2", "linestyle": ":"},
    "ShardedTensor": {"color": "C1"},
    "DTensor": {"color": "C3"},
    "this rank's schedule (first)": {"color": "C0", "linewidth": 2.4},
    "cached re-plan": {"color": "C2"},
    "global plan (every rank)": {"color": "0.25", "linestyle": "--"},
}


def _style(impl: str) -> dict[str, Any]:
    """Fixed colours, so that an implementation looks the same in every panel."""
    if impl in _STYLES:
        return _STYLES[impl]
    return {"color": "C0", "linestyle": "-."} if impl.startswith("fshard") else {"color": "C4"}
