"""``python -m fshard bench``: runs every case, prints a table, writes JSON to ``bench-results/``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Case, Row, Settings

__all__ = ["CASE_MODULES", "collect", "machine", "main", "render"]

# Each module has ``cases(settings) -> list[Case]``; add a module here to add its cases.
CASE_MODULES = ("benchmarks.planner", "benchmarks.local")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``python -m fshard bench``."""
    parser = argparse.ArgumentParser(prog="python -m fshard bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a fast check that everything runs")
    parser.add_argument("--reps", type=int, default=15, help="repetitions per measurement (median reported)")
    parser.add_argument("--no-peers", action="store_true", help="time fshard only, not torch's implementations")
    parser.add_argument("--only", action="append", default=[], help="run cases whose group or name contains this")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the JSON results")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    return args


def collect(settings: Settings, only: Sequence[str] = ()) -> list[Case]:
    """Every case of every module in ``CASE_MODULES``, filtered by ``only`` substrings."""
    out: list[Case] = []
    for name in CASE_MODULES:
        out += importlib.import_module(name).cases(settings)
    if only:
        out = [c for c in out if any(s in c.group or s in c.name for s in only)]
    return out


def machine() -> dict[str, Any]:
    """Where the numbers come from."""
    import numpy
    import torch

    model = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def run_cases(cases: Sequence[Case], settings: Settings) -> list[Row]:
    """Runs the cases with a progress bar; one failing case is reported, not fatal."""
    from tqdm import tqdm

    rows: list[Row] = []
    bar = tqdm(cases, unit="case", file=sys.stderr, dynamic_ncols=True)
    for case in bar:
        bar.set_description(case.name[:60])
        try:
            rows += case.run(settings)
        except Exception as exc:  # a broken case must not hide the others
            rows.append(Row(case.group, case.name, "error", None, note=f"{type(exc).__name__}: {exc}"))
    return rows


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def render(rows: Sequence[Row], info: dict[str, Any]) -> None:
    """Prints one rich table per group."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    console.print(f"[bold]fshard bench[/] on {info['cpu']} ({info['cores']} cores), torch {info['torch']}")
    for group in dict.fromkeys(r.group for r in rows):
        table = Table(title=group, title_justify="left", show_lines=False)
        for col, kw in (("case", {"max_width": 38}), ("implementation", {"no_wrap": True}),
                        ("median", {"justify": "right", "no_wrap": True}), ("reps", {"justify": "right"}),
                        ("ratio", {"justify": "right", "no_wrap": True}), ("target", {"no_wrap": True}),
                        ("note", {"overflow": "fold"})):  # fmt: skip
            table.add_column(col, **kw)
        last: Row | None = None
        for r in (r for r in rows if r.group == group):
            same = last is not None and r.case == last.case
            if last is not None and not same:
                table.add_section()
            ratio = f"{r.ratio:.2f} {r.ratio_to}" if r.ratio is not None else ""
            target = f"{r.target} {'✓' if r.ok else '✗'}" if r.ok is not None else r.target
            note = "" if same and last is not None and r.note == last.note else r.note
            table.add_row("" if same else r.case, r.impl, _time(r.seconds), str(r.reps or ""), ratio, target, note)
            last = r
        console.print(table)


def save(rows: Sequence[Row], info: dict[str, Any], settings: Settings, folder: Path) -> Path:
    """Writes the rows and the machine description as JSON; returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = folder / f"bench-{stamp}.json"
    data = {"machine": info, "settings": dataclasses.asdict(settings), "rows": [r.to_dict() for r in rows]}
    path.write_text(json.dumps(data, indent=1))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks; returns 0, or 1 if a case failed with an error."""
    args = parse(argv)
    missing = [m for m in ("rich", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"The benchmarks need {', '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    settings = Settings(quick=args.quick, reps=args.reps, peers=not args.no_peers)
    cases = collect(settings, args.only)
    if not cases:
        print(f"No benchmark case matches {args.only}.", file=sys.stderr)
        return 2
    info = machine()
    rows = run_cases(cases, settings)
    render(rows, info)
    path = save(rows, info, settings, args.out)
    print(f"results: {path}")
    return 1 if any(r.impl == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
