"""Command line: ``python -m fshard demo`` and ``python -m fshard bench``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m fshard {demo,bench} [options]

  demo   shard, reshard, map and gather a real tensor on the local backend and on
         N Gloo processes; verify and print layout pictures and a table
  bench  run the benchmarks (from the repository root)

Run 'python -m fshard demo --help' or 'python -m fshard bench --help' for options."""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to the subcommand named by the first argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from fshard._demo import main as demo

        return demo(rest)
    if command == "bench":
        try:
            from benchmarks.run import main as bench
        except ModuleNotFoundError as exc:
            if exc.name not in ("benchmarks", "benchmarks.run"):
                raise
            print("python -m fshard bench: run it from the repository root (benchmarks/ not found).", file=sys.stderr)
            return 2
        return int(bench(rest) or 0)
    print(f"python -m fshard: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
