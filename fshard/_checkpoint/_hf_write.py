"""Writing Hugging Face safetensors files: which tensors go in which file, and each file's bytes.

Files are cut as ``huggingface_hub`` cuts them (tensors in order; a new file when the next
tensor would pass ``max_shard_size``; a tensor larger than that alone in its file), and
each file's tensors are laid out as the safetensors library lays them out (by dtype,
widest first, then by name), so a file fshard writes is byte for byte the one
``safetensors.torch.save_file`` writes for the same tensors.

A file is assembled on its writer rank: the distinct boxes of its tensors, packed
row-major one after another, form one byte range of a 1-D byte array held by the
boxes' owners, and one ``reshard`` moves the ranges of every file of a round to their
writers (each box from one of its replicas). The writer then writes each box's runs
straight from the packed bytes to their places in the file (``_ranges.write_runs``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._format import CODES
from fshard._checkpoint._ranges import Runs, coalesce, runs
from fshard._errors import SpecError
from fshard._layout.index import groups
from fshard._layout.layout import Layout

__all__ = ["FileRound", "file_names", "header_bytes", "parse_size", "plan_round", "shard_files", "write_order"]


# The safetensors library orders a file's tensors by dtype, in this order, then by name.
_DTYPE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")  # fmt: skip


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any) -> int:
    """``max_shard_size`` in bytes: a positive int, or a str such as ``"5GB"`` (10**9) or ``"512MiB"`` (2**20).

    >>> parse_size("5GB"), parse_size("100KB"), parse_size("1.5MiB"), parse_size(1000)
    (5000000000, 100000, 1572864, 1000)
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get((m[2] or "B").upper()) if m else None
    if m is None or unit is None or int(float(m[1]) * unit) <= 0:
        msg = f"max_shard_size={value!r}: give a positive int of bytes or a str such as '5GB', '100MB' or '512MiB'."
        raise SpecError(msg)
    return int(float(m[1]) * unit)


def shard_files(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """The tensors (indices into ``sizes``, in bytes) of each file, as ``huggingface_hub`` splits a state dict."""
    files: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if n > limit:
            files.append([i])
            continue
        if used + n > limit and current:
            files.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current or not files:
        files.append(current)
    return files


def file_names(n: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000n.safetensors``."""
    return ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def write_order(names: Sequence[str], dtypes: Sequence[torch.dtype]) -> list[int]:
    """The order of a file's tensors in its data section: by dtype as safetensors orders them, then by name."""
    return sorted(range(len(names)), key=lambda i: (_DTYPE_ORDER.index(CODES[dtypes[i]]), names[i]))


def header_bytes(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length prefix and JSON header of a file holding ``entries`` (name, dtype, shape) in data order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return len(text).to_bytes(8, "little") + text


@dataclasses.dataclass(frozen=True)
class FileRound:
    """One round of files moved to their writers at once.

    ``source`` holds every distinct box of the round's tensors (each copy on its holder),
    ``target`` each file's range on its writer (both ``None`` when the round has no bytes).
    ``sources`` names, per source shard, the (leaf, shard) it comes from (``shard`` is
    ``None`` for a plain tensor); ``spans`` gives, per file, the runs from its packed bytes
    to its data section; ``ranges`` each file's byte range in the round.
    """

    source: Layout | None
    target: Layout | None
    sources: tuple[tuple[int, int | None], ...]
    spans: tuple[Runs, ...]
    ranges: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class _Rows:
    lo: list[int] = dataclasses.field(default_factory=list[int])
    n: list[int] = dataclasses.field(default_factory=list[int])
    rank: list[int] = dataclasses.field(default_factory=list[int])
    devices: list[str] = dataclasses.field(default_factory=list[str])

    def add(self, lo: int, n: int, rank: int, device: str) -> None:
        self.lo.append(lo)
        self.n.append(n)
        self.rank.append(rank)
        self.devices.append(device)

    def layout(self, total: int) -> Layout:
        cols = np.array(self.lo, np.int64)[:, None], np.array(self.n, np.int64)[:, None]
        return Layout.from_arrays((total,), *cols, np.array(self.rank, np.int64), self.devices)


def plan_round(leaves: Sequence[Any], files: Sequence[Sequence[int]], writers: Sequence[int]) -> FileRound:
    """The movement of the files ``files`` (leaf indices in data order) to ranks ``writers``."""
    src, dst, sources, spans = _Rows(), _Rows(), list[tuple[int, int | None]](), list[Runs]()
    ranges: list[tuple[int, int]] = []
    at = 0
    for file, writer in zip(files, writers):
        start, data, parts = at, 0, list[Runs]()
        for li in file:
            leaf = leaves[li]
            for lo, sizes, holders in _boxes(leaf, writer):
                n = math.prod(sizes) * leaf.dtype.itemsize
                for shard, rank, device in holders:
                    src.add(at, n, rank, device)
                    sources.append((li, shard))
                f, b, k = runs(tuple(leaf.shape), lo, sizes, sizes, (0,) * len(sizes), leaf.dtype.itemsize)
                parts.append((f + data, b + at - start, k))
                at += n
            data += math.prod(leaf.shape) * leaf.dtype.itemsize
        if at > start:
            dst.add(start, at - start, writer, _writer_device(leaves, file, writer))
        spans.append(coalesce(parts))
        ranges.append((start, at))
    if at == 0:
        return FileRound(None, None, (), tuple(spans), tuple(ranges))
    return FileRound(src.layout(at), dst.layout(at), tuple(sources), tuple(spans), tuple(ranges))


def _boxes(leaf: Any, writer: int) -> list[tuple[tuple[int, ...], tuple[int, ...], list[tuple[int | None, int, str]]]]:
    """Each distinct non-empty box of ``leaf`` (offsets, sizes) and its holders (shard, rank, device), in box order."""
    if not isinstance(leaf, ShardedArray):
        t: torch.Tensor = leaf
        return [((0,) * t.ndim, tuple(t.shape), [(None, writer, str(t.device))])] if t.numel() else []
    cols = leaf.layout.columns
    first, idx, inverse = groups(leaf.layout)
    order = np.argsort(inverse, kind="stable")
    cuts = np.searchsorted(inverse[order], np.arange(len(first) + 1))
    out: list[tuple[tuple[int, ...], tuple[int, ...], list[tuple[int | None, int, str]]]] = []
    for b, f in enumerate(first.tolist()):
        shards: list[int] = idx[order[cuts[b] : cuts[b + 1]]].tolist()
        holders: list[tuple[int | None, int, str]] = [(i, int(cols.rank[i]), cols.devices[i]) for i in shards]
        out.append((tuple(cols.lo[f].tolist()), tuple(cols.sz[f].tolist()), holders))
    return out


def _writer_device(leaves: Sequence[Any], file: Sequence[int], writer: int) -> str:
    """Where the writer receives its file: the device of its first shard among the file's arrays, else the CPU."""
    for li in file:
        leaf = leaves[li]
        if isinstance(leaf, ShardedArray):
            cols = leaf.layout.columns
            for i in np.flatnonzero(cols.rank == writer).tolist():
                return cols.devices[i]
    return "cpu"
