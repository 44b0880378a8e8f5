"""Command line: ``python -m fshard demo`` and ``python -m fshard bench``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence


def parser() -> argparse.ArgumentParser:
    """``python -m fshard {demo,bench} [options]``; each subcommand parses its own options."""
    out = argparse.ArgumentParser(prog="python -m fshard", description="fshard command line.")
    sub = out.add_subparsers(dest="command", metavar="{demo,bench}", required=True)
    helps = {
        "demo": "shard, reshard, map and gather a real tensor on the local backend and on N Gloo "
        "processes; verify and print layout pictures and a table",
        "bench": "run the benchmarks (from the repository root, where benchmarks/ is)",
    }
    for name, text in helps.items():
        sub.add_parser(name, help=text, add_help=False)  # its options, --help too, go to the subcommand
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to the subcommand named by the first argument; returns its exit status."""
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "demo":
        from fshard._demo import main as demo

        return int(demo(rest) or 0)
    bench = _load_bench()
    return 2 if bench is None else int(bench(rest) or 0)


def _load_bench() -> Callable[[Sequence[str]], int] | None:
    """``benchmarks.run.main`` from the current directory, or ``None`` with a message."""
    if os.path.isdir("benchmarks") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script does not put the cwd on sys.path
    try:
        from benchmarks.run import main as bench
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.run"):
            raise
        where = os.getcwd()
        print(
            f"python -m fshard bench: no benchmarks/ package in {where}; run it from the repository root "
            "(a source checkout of fshard), e.g. `cd fshard && python -m fshard bench`.",
            file=sys.stderr,
        )
        return None
    return bench


if __name__ == "__main__":
    sys.exit(main())
