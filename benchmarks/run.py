"""``python -m fshard bench``: runs every case, prints a table, writes JSON, a text table and a plot.

Files go to ``--out`` (default ``bench-results/``): ``bench-<time>.json`` (every row
with its samples, the machine and the settings), ``bench-<time>.txt`` (the tables),
``bench-<time>.md`` (the tables in Markdown, for the docs) and ``bench-<time>.png``
(time against size of each data-movement case). ``--plot PATH``
writes the plot there too, e.g. ``--plot docs/performance.png``. ``--render FILE``
prints and plots a saved JSON file again without running anything.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fshard._cli import program

from . import report
from .common import Case, Row, Settings

__all__ = ["CASE_MODULES", "collect", "main", "parse", "run_cases"]

# Each module has ``cases(settings) -> list[Case]``; add a module here to add its cases.
CASE_MODULES = (
    "fshard.benchmarks.planner",
    "fshard.benchmarks.local",
    "fshard.benchmarks.autograd",
    "fshard.benchmarks.dist",
    "fshard.benchmarks.training",
    "fshard.benchmarks.imports",
    "fshard.benchmarks.dcp",
    "fshard.benchmarks.hf",
)


def parse(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    """The command line of ``fshard bench``.

    ``prog`` is, by default, as started: ``python -m fshard bench`` or ``fshard bench``.
    """
    description = "Runs every benchmark case; prints the tables; writes JSON, the tables as text and a plot."
    parser = argparse.ArgumentParser(prog=prog or f"{program()} bench", description=description)
    add = parser.add_argument
    add("--quick", action="store_true", help="smaller sizes (torch_dist: 1 MiB, 5 rounds): a check that all runs")
    add("--reps", type=int, default=15, help="repetitions per measurement, median reported (15)")
    add("--world", type=int, default=4, help="processes of the torch_dist cases (4)")
    add("--sizes", type=float, nargs="+", default=None, metavar="MIB",
        help="tensor sizes of the local and torch_dist cases (16 256; smaller with --quick)")  # fmt: skip
    add("--no-peers", action="store_true", help="skip torch's implementations (time fshard and floors)")
    add("--only", action="append", default=[], metavar="TEXT",
        help="run the cases whose group, name or key contains TEXT (repeatable)")  # fmt: skip
    add("--out", type=Path, default=Path("bench-results"), help="folder for the results")
    add("--plot", type=Path, action="append", default=[], metavar="PNG",
        help="also write the plot here, e.g. docs/performance.png (repeatable)")  # fmt: skip
    add("--render", type=Path, default=None, metavar="JSON", help="print and plot a saved results file instead")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.world < 2:
        parser.error(f"--world must be at least 2, got {args.world}")
    if args.sizes is not None and min(args.sizes) <= 0:
        parser.error(f"--sizes must be positive MiB, got {args.sizes}")
    if args.out.exists() and not args.out.is_dir():  # known before the run, not after it
        parser.error(f"--out is a folder for the results, and {args.out} is a file: give a folder's path")
    return args


def settings_of(args: argparse.Namespace) -> Settings:
    """The ``Settings`` that the parsed command line asks for."""
    sizes = tuple(float(s) for s in args.sizes) if args.sizes else None
    return Settings(quick=args.quick, reps=args.reps, peers=not args.no_peers, world=args.world, sizes=sizes)


def collect(settings: Settings, only: Sequence[str] = ()) -> list[Case]:
    """Every case of every module in ``CASE_MODULES``, filtered by ``only`` substrings."""
    out: list[Case] = []
    for name in CASE_MODULES:
        out += importlib.import_module(name).cases(settings)
    if only:
        out = [c for c in out if any(s in f"{c.group} {c.name} {getattr(c, 'key', '')}" for s in only)]
    return out


class _Bar:
    """One tqdm bar over all cases; a batch that runs several cases at once moves it per case."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)

    def start(self, label: str) -> None:
        self.bar.set_description(label[:60])

    def done(self) -> None:
        self.bar.update(1)

    def reach(self, n: int) -> None:
        """At least ``n`` cases are done."""
        if self.bar.n < n:
            self.bar.update(n - self.bar.n)


def run_cases(cases: Sequence[Case], settings: Settings) -> list[Row]:
    """Runs the cases under one progress bar; one failing case is reported, not fatal."""
    import dataclasses

    bar = _Bar(len(cases))
    settings = dataclasses.replace(settings, progress=bar)
    rows: list[Row] = []
    try:
        for k, case in enumerate(cases):
            if bar.bar.n <= k:
                bar.start(case.name)
            try:
                rows += case.run(settings)
            except Exception as exc:  # a broken case must not hide the others
                rows.append(Row(case.group, case.name, "error", None, note=f"{type(exc).__name__}: {exc}"))
            bar.reach(k + 1)
    finally:
        bar.bar.close()
    return rows


def _missing() -> list[str]:
    return [m for m in ("rich", "tqdm", "matplotlib") if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks; returns 0, 1 if a case failed or a result was wrong, 2 if nothing ran."""
    args = parse(argv)
    missing = _missing()
    if missing:
        print(f"The benchmarks need {', '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.render is not None:
        return _render_saved(args.render, args.plot)
    settings = settings_of(args)
    cases = collect(settings, args.only)
    if not cases:
        print(f"No benchmark case matches {args.only}.", file=sys.stderr)
        return 2
    info = report.machine()
    start = time.perf_counter()
    rows = run_cases(cases, settings)
    wall = time.perf_counter() - start
    info["load_after"] = report.load()
    report.render(rows, info)
    base = args.out / f"bench-{report.stamp()}"
    path = report.save(rows, info, settings, base.with_suffix(".json"), wall)
    base.with_suffix(".txt").write_text(report.table_text(rows, info))
    base.with_suffix(".md").write_text(report.markdown(rows))
    plots = report.plot(rows, [base.with_suffix(".png"), *args.plot], _title(info))
    print(f"wall time {wall:.0f} s; results: {path} (tables .txt and .md" + (", plot .png)" if plots else ")"))
    return 1 if any(r.impl == "error" or r.verified is False for r in rows) else 0


def _title(info: dict[str, Any]) -> str:
    return f"fshard bench on {info['cpu']} ({info['cores']} cores), torch {info['torch']}"


def _render_saved(path: Path, plots: Sequence[Path]) -> int:
    try:
        info = json.loads(path.read_text())["machine"]
        rows = report.load_rows(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # ValueError: not JSON, or not UTF-8 text
        print(
            f"fshard bench --render: {path} is not a results file that bench saved ({type(exc).__name__}: {exc}); "
            "give the .json that a run wrote (its last line names it).",
            file=sys.stderr,
        )
        return 2
    report.render(rows, info)
    print(report.markdown(rows))
    written = report.plot(rows, plots, _title(info))
    for done in written:
        print(f"plot: {done}")
    if plots and not written:
        print(f"plot: none written, {path} holds no rows of the sized cases (local, torch_dist) to draw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
