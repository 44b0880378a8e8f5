"""Command line: ``fshard demo``, ``bench``, ``convert`` and ``info`` (also ``python -m fshard ...``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence

from fshard._cli import parser, program
from fshard._convert import main_convert, main_info

# What ``fshard bench`` imports beyond fshard's own dependencies: the ``bench`` extra.
BENCH_NEEDS = ("rich", "matplotlib", "tqdm")

__all__ = ["BENCH_NEEDS", "load_bench", "main"]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Dispatches to the subcommand named by the first argument; returns its exit status (130 on Ctrl-C)."""
    prog = prog or program()
    try:
        return _run(argv, prog)
    except KeyboardInterrupt:  # each command commits its output whole or not at all: the traceback says no more
        _say(f"{prog}: interrupted")
        return 130


def _run(argv: Sequence[str] | None, prog: str) -> int:
    args, rest = parser(prog).parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "demo":
        from fshard._demo import main as demo  # deferred: the demo imports the whole package

        return int(demo(rest, prog=f"{prog} demo") or 0)
    if args.command == "convert":
        return main_convert(rest, f"{prog} convert")
    if args.command == "info":
        return main_info(rest, f"{prog} info")
    bench = load_bench(prog)
    return 2 if bench is None else int(bench(rest) or 0)


def load_bench(prog: str = "fshard") -> Callable[[Sequence[str]], int] | None:
    """``main`` of the benchmarks installed with fshard (``fshard.benchmarks``), or ``None`` after saying why not."""
    missing = [name for name in BENCH_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        _say(f"{prog} bench needs {', '.join(missing)}, from the bench extra: pip install 'fshard[bench]'.")
        return None
    spec = importlib.util.find_spec("fshard.benchmarks")
    if spec is None or not spec.submodule_search_locations:
        _say(f"{prog} bench: this install of fshard has no benchmarks (fshard.benchmarks); reinstall fshard.")
        return None
    from fshard.benchmarks.run import main as bench  # deferred: needs the optional bench extra

    return bench


def _say(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
