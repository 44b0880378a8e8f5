"""Command line: ``fshard demo`` and ``fshard bench`` (also ``python -m fshard ...``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

# What ``fshard bench`` imports beyond fshard's own dependencies: the ``bench`` extra.
BENCH_NEEDS = ("rich", "matplotlib", "tqdm")


def program() -> str:
    """How this command was started: ``python -m fshard`` or the console script's name (``fshard``)."""
    started = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if started in ("__main__.py", "-m", "-c", ""):
        return "python -m fshard"
    return started if started.startswith("fshard") else "fshard"


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """``fshard {demo,bench} [options]``; each subcommand parses its own options."""
    from fshard import __version__

    prog = prog or program()
    out = argparse.ArgumentParser(prog=prog, description="fshard command line.")
    out.add_argument("--version", action="version", version=f"fshard {__version__}")
    sub = out.add_subparsers(dest="command", metavar="{demo,bench}", required=True)
    helps = {
        "demo": "shard, reshard, map and gather a real tensor on the local backend and on N Gloo "
        "processes; verify and print layout pictures and a table",
        "bench": "run the benchmarks shipped with fshard (needs the bench extra: pip install 'fshard[bench]')",
    }
    for name, text in helps.items():
        sub.add_parser(name, help=text, add_help=False)  # its options, --help too, go to the subcommand
    return out


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Dispatches to the subcommand named by the first argument; returns its exit status."""
    prog = prog or program()
    args, rest = parser(prog).parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "demo":
        from fshard._demo import main as demo

        return int(demo(rest, prog=f"{prog} demo") or 0)
    bench = load_bench(prog)
    return 2 if bench is None else int(bench(rest) or 0)


def load_bench(prog: str = "fshard") -> Callable[[Sequence[str]], int] | None:
    """``main`` of the benchmarks installed with fshard, or ``None`` after saying why not.

    The benchmarks are installed as ``fshard.benchmarks`` and import each other as
    ``benchmarks.*``: the folder that holds them goes first on ``sys.path`` (spawned
    benchmark processes inherit it).
    """
    missing = [name for name in BENCH_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        _say(f"{prog} bench needs {', '.join(missing)}, from the bench extra: pip install 'fshard[bench]'.")
        return None
    spec = importlib.util.find_spec("fshard.benchmarks")
    if spec is None or not spec.submodule_search_locations:
        _say(f"{prog} bench: this install of fshard has no benchmarks (fshard.benchmarks); reinstall fshard.")
        return None
    root = os.path.dirname(os.path.abspath(next(iter(spec.submodule_search_locations))))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.run import main as bench

    where = os.path.dirname(os.path.abspath(sys.modules["benchmarks"].__file__ or ""))
    if os.path.dirname(where) != root:
        _say(f"{prog} bench: another package named 'benchmarks' ({where}) hides fshard's; uninstall it.")
        return None
    return bench


def _say(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
