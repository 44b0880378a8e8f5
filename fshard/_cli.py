"""The command line's parts that the benchmarks share: how it was started, and its parser."""

from __future__ import annotations

import argparse
import os
import sys

from fshard import __version__


def program() -> str:
    """How this command was started: ``python -m fshard`` or the console script's name (``fshard``)."""
    started = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if started in ("__main__.py", "-m", "-c", ""):
        return "python -m fshard"
    return started if started.startswith("fshard") else "fshard"


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """``fshard {demo,bench,convert,info} [options]``; each subcommand parses its own options."""
    prog = prog or program()
    out = argparse.ArgumentParser(prog=prog, description="fshard command line.")
    out.add_argument("--version", action="version", version=f"fshard {__version__}")
    sub = out.add_subparsers(dest="command", metavar="{demo,bench,convert,info}", required=True)
    helps = {
        "demo": "shard, reshard, map and gather a real tensor on the local backend and on N Gloo "
        "processes; verify and print layout pictures and a table",
        "bench": "run the benchmarks shipped with fshard (needs the bench extra: pip install 'fshard[bench]')",
        "convert": "convert a checkpoint (fshard, torch DCP, Hugging Face) to fshard or Hugging Face, tensor by tensor",
        "info": "list a checkpoint's tensors (fshard, torch DCP or Hugging Face): names, shapes, dtypes, files",
    }
    for name, text in helps.items():
        sub.add_parser(name, help=text, add_help=False)  # its options, --help too, go to the subcommand
    return out
