"""``fshard convert``: a checkpoint from one format to another in one process, tensor by tensor.

Sources: an fshard checkpoint, a torch DCP folder, a Hugging Face safetensors file or
folder. Targets: an fshard checkpoint (every tensor whole, in one file; an fshard
source keeps its tree and scalars) or a Hugging Face folder. Memory holds one tensor at
a time, or, for an fshard target with ``max_memory``, one block of at most that many
bytes: the output is written block by block as the input is read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fshard._checkpoint._collective import progress_bar
from fshard._checkpoint._format import CODES, checkpoint_path, human
from fshard._checkpoint._hf_commit import writing
from fshard._checkpoint._hf_write import METADATA_KEY, header_bytes, write_order
from fshard._checkpoint._info import checkpoint_info
from fshard._checkpoint._ranges import byte_view, whole, write_runs
from fshard._checkpoint._sources import Source, open_source
from fshard._checkpoint._stream import save_streamed
from fshard._errors import CheckpointError, SpecError
from fshard.backends.local import LOCAL

__all__ = ["convert", "main_convert", "main_info", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9) or ``"512MiB"`` (2**20).

    >>> parse_size("512MiB"), parse_size("5GB"), parse_size(100)
    (536870912, 5000000000, 100)
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m and _UNITS.get(m[2].upper())
    if m is None or unit is None or float(m[1]) * unit < 1:
        raise SpecError(f"{what} must be a positive number of bytes such as 5GB or 512MiB, got {value!r}.")
    return int(float(m[1]) * unit)


class _Words(NamedTuple):
    """How ``convert``'s errors name it and its arguments: as the Python call, or as the command's options."""

    call: str  # the converter, as the subject of a sentence
    lead: str  # the start of an error about an argument
    to: str  # before a target format
    memory: str  # before a number of bytes held at once
    memory_name: str  # that setting, named alone


_PYTHON = _Words("convert()", "convert() ", "convert() to ", "max_memory=", "max_memory")
_COMMAND = _Words("convert", "", "--to ", "--max-memory ", "--max-memory")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    max_memory: int | str | None = None,
    max_shard_size: int | str = "5GB",
    verify: bool = True,
    progress: bool | None = None,
) -> str:
    """Converts the checkpoint ``src`` into a new one at ``dst``; returns a summary line.

    Args:
        src: an fshard checkpoint, a torch DCP folder, or a Hugging Face file or folder.
        dst: the new checkpoint (an fshard checkpoint there is replaced; a Hugging Face
            target must not exist yet).
        to: ``"fshard"`` or ``"hf"`` (default: ``"hf"`` from an fshard source, else ``"fshard"``).
        max_memory: bytes of tensor data held at once (default: the largest tensor). An fshard
            target is then written in blocks; a Hugging Face target in files of at most this.
        max_shard_size: bytes per Hugging Face file.
        verify: check an fshard source's sha256 hashes.
        progress: show a progress bar (``None``: on a terminal, for large jobs).

    Raises:
        CheckpointError: a damaged source, ``dst`` equal to ``src``, or a target that cannot be written.
        SpecError: a bad ``to``, ``max_memory`` or ``max_shard_size``.
    """
    return _convert(src, dst, to, max_memory, max_shard_size, verify, progress, _PYTHON)


def _convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    to: str | None,
    max_memory: int | str | None,
    max_shard_size: int | str,
    verify: bool,
    progress: bool | None,
    words: _Words,
) -> str:
    """``convert``, its errors worded with ``words`` (the Python call's, or the command's)."""
    source_path, target = checkpoint_path(src, words.call), checkpoint_path(dst, words.call)
    budget = None if max_memory is None else parse_size(max_memory, words.memory_name)
    if source_path.resolve() == target.resolve():
        raise CheckpointError(f"{words.call} writes a new checkpoint: the target {target} is the source itself.")
    with contextlib.ExitStack() as stack:
        source = open_source(source_path, stack, verify=verify)
        to = to or ("hf" if source.kind == "fshard" else "fshard")
        _check_dtypes(source, to, words)
        _check_budget(source, budget, words)
        if to == "fshard":
            tree, item = source.tree()

            def read(leaf: int, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
                source.read(item[leaf], lo, size, out)

            save_streamed(target, tree, read, budget=budget, progress=progress)
        elif to == "hf":
            _to_hf(source, target, parse_size(max_shard_size, "max_shard_size"), budget, progress, words)
        else:
            raise SpecError(f"{words.lead}to= takes 'fshard' or 'hf', got {to!r}.")
        return _summary(source, source_path, to, target)


def _check_dtypes(source: Source, to: str, words: _Words) -> None:
    """Refuses a source holding a dtype that neither target stores (a DCP folder may hold complex32)."""
    odd = [i for i in source.items if i.dtype not in CODES]
    if odd:
        msg = (
            f"{words.to}{to}: {source.kind} {source.root} holds {odd[0].dtype} tensors {[i.name for i in odd[:3]]}, "
            "a dtype that fshard and Hugging Face checkpoints do not store: load them with fshard.load and save "
            "them cast (to complex64, say)."
        )
        raise CheckpointError(msg)


def _check_budget(source: Source, budget: int | None, words: _Words) -> None:
    """Refuses a ``max_memory`` that holds less than one element of some tensor, before anything is written."""
    if budget is None or not source.items:
        return
    widest = max(source.items, key=lambda i: i.dtype.itemsize)
    if widest.dtype.itemsize > budget:
        msg = (
            f"{words.lead}{words.memory}{budget} bytes holds less than one element of {widest.name} ({widest.dtype}, "
            f"{widest.dtype.itemsize} bytes): raise it to at least {widest.dtype.itemsize} bytes (a block of "
            "one element at a time is slow: megabytes, as '256MB', is the usual size)."
        )
        raise SpecError(msg)


def _summary(source: Source, src: Path, to: str, dst: Path) -> str:
    size = human(sum(i.nbytes for i in source.items))
    line = f"{len(source.items)} tensors ({size}) from {source.kind} {src} to {to} {dst}"
    if source.others and not (to == "fshard" and source.kind == "fshard"):  # fshard to fshard keeps its scalars
        more = f" and {len(source.others) - 8} more" if len(source.others) > 8 else ""
        line += f"; not converted (not tensors): {', '.join(source.others[:8])}{more}"
    return line


def _groups(sizes: Sequence[int], limit: float) -> list[list[int]]:
    """Consecutive tensors per file, each file at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[int]] = []
    used = 0
    for k, n in enumerate(sizes):
        if not out or used + n > limit:
            out.append([])
            used = 0
        out[-1].append(k)
        used += n
    return out


def _write_file(path: Path, source: Source, group: list[int], bar: Any) -> None:
    """One Hugging Face file of the tensors ``group``, read and written one tensor at a time.

    The header first (tensors in the order the safetensors library lays them out), then each
    tensor at its offset: at most one tensor in memory.
    """
    items = source.items
    order = [group[j] for j in write_order([items[k].name for k in group], [items[k].dtype for k in group])]
    head = header_bytes([(items[k].name, items[k].dtype, tuple(items[k].shape)) for k in order])
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
        try:
            write_runs(fd, 0, whole(len(head)), memoryview(head))
            at = len(head)
            for k in order:
                t = _whole(source, k)
                if t.numel():
                    write_runs(fd, at, whole(t.nbytes), byte_view(t))
                at += t.nbytes
                bar.update(t.nbytes)
                del t
            os.fsync(fd)
        finally:
            os.close(fd)


def _to_hf(
    source: Source, target: Path, shard_size: int, budget: int | None, progress: bool | None, words: _Words
) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{words.call} writes a new Hugging Face folder: {target} exists and is not empty.")
    if target.suffix == ".safetensors":
        msg = (
            f"{words.call} writes a Hugging Face folder, and {target} names a file: give the folder's path "
            "(its weights go in model.safetensors, or in numbered files and an index)."
        )
        raise CheckpointError(msg)
    seen: set[str] = set()
    for name in (i.name for i in source.items):
        if name == METADATA_KEY:
            msg = (
                f"{words.to}hf cannot name a tensor {name!r}, the key a safetensors header keeps for its "
                "metadata: convert to fshard instead."
            )
            raise CheckpointError(msg)
        if name in seen:  # a file would hold two tensors under one name, one of them unreadable
            msg = (
                f"{words.to}hf names each tensor by its keys joined with '.', and {name!r} names two tensors of "
                "the source (a key that holds a '.' beside nested keys): rename one of them, or convert to fshard."
            )
            raise CheckpointError(msg)
        seen.add(name)
    too_big = [i.name for i in source.items if budget is not None and i.nbytes > budget]
    if too_big:
        msg = (
            f"A Hugging Face file holds each tensor whole, and {too_big[:3]} hold more than {words.memory}{budget} "
            f"bytes: raise {words.memory_name}, or convert to fshard (written block by block)."
        )
        raise CheckpointError(msg)
    # No tensors: one file of none, as save_safetensors writes, so that the folder loads.
    groups = _groups([i.nbytes for i in source.items], min(shard_size, budget or shard_size)) or [[]]
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    stage = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        stage.mkdir(parents=True)
    except OSError as exc:
        raise CheckpointError(f"{words.call} cannot create the folder {target}: {exc.strerror or exc}.") from exc
    try:
        total = sum(i.nbytes for i in source.items)
        with progress_bar("fshard convert", total, progress, LOCAL) as bar:
            for name, group in zip(names, groups):
                _write_file(stage / name, source, group, bar)
        if len(groups) > 1:
            weights = {source.items[k].name: names[g] for g, group in enumerate(groups) for k in group}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weights.items()))}
            (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if target.exists():
            target.rmdir()
        os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _whole(source: Source, k: int) -> torch.Tensor:
    item = source.items[k]
    out = torch.empty(item.shape, dtype=item.dtype)
    source.read(k, (0,) * len(item.shape), item.shape, out)
    return out


def main_convert(argv: Sequence[str], prog: str) -> int:
    """``fshard convert SRC DST``: prints a summary; exit status 1 on a checkpoint error, 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path, help="fshard checkpoint, torch DCP folder, or Hugging Face file or folder")
    parser.add_argument("dst", type=Path, help="the new checkpoint")
    parser.add_argument("--to", choices=["fshard", "hf"], help="target format (default: hf from fshard, else fshard)")
    parser.add_argument("--max-memory", metavar="SIZE", help="bytes of tensor data held at once, e.g. 512MiB")
    parser.add_argument("--max-shard-size", metavar="SIZE", default="5GB", help="bytes per Hugging Face file (5GB)")
    parser.add_argument("--no-verify", action="store_true", help="skip an fshard source's sha256 checks")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar")
    args = parser.parse_args(argv)
    for option in ("max_memory", "max_shard_size"):
        try:
            value = getattr(args, option)
            if value is not None:
                parse_size(value, "--" + option.replace("_", "-"))
        except SpecError as exc:
            parser.error(str(exc))
    try:
        # Its errors name the command's options (--max-memory), not the Python call's keywords.
        line = _convert(
            args.src,
            args.dst,
            args.to,
            args.max_memory,
            args.max_shard_size,
            not args.no_verify,
            args.progress,
            _COMMAND,
        )
    except (CheckpointError, SpecError, OSError) as exc:  # OSError: a destination that cannot be made or written
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"converted {line}")
    return 0


def main_info(argv: Sequence[str], prog: str) -> int:
    """``fshard info PATH``: prints what a checkpoint of any of the three formats holds."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Lists a checkpoint's tensors: fshard, torch DCP or Hugging Face."
    )
    parser.add_argument("path", type=Path, help="fshard checkpoint, torch DCP folder, or Hugging Face file or folder")
    args = parser.parse_args(argv)
    try:
        text = checkpoint_info(args.path)
    except CheckpointError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    try:
        print(text, flush=True)
    except BrokenPipeError:  # a reader that stopped early (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush is quiet too
    return 0
