"""How a file's bytes reach its writer: its boxes packed, moved in pieces by ``reshard``.

A file is assembled on its writer rank. The distinct boxes of its tensors, each packed
row-major, are laid one after another: the file's **packed** bytes. Each box is held by
its owners (all its replicas; the plan picks one sender per box, balanced). The writer
writes each box's runs straight from the packed bytes to their places in the file
(``spans``: file offset, packed offset, length, merged where they touch).

The files of a round (at most one per writer) move together, a **piece** at a time: piece
``s`` of every file is the packed bytes ``[s * size, (s + 1) * size)``, and one
``reshard`` of a 1-D byte array moves piece ``s`` of every file of the round to its
writer. A writer writes piece ``s`` while piece ``s + 1`` moves, so it holds at most two
pieces, never a whole file, and moving overlaps writing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._ranges import Runs, coalesce, runs
from fshard._layout.index import groups
from fshard._layout.layout import Layout

__all__ = ["FilePlan", "Piece", "piece", "pieces", "plan_file"]


@dataclasses.dataclass(frozen=True)
class FilePlan:
    """One file's packed bytes: who holds each row (a box's copy), its writer, and the runs to write."""

    size: int
    lo: np.ndarray  # per row: its start in the packed bytes
    n: np.ndarray  # its bytes
    rank: np.ndarray  # its holder
    devices: tuple[str, ...]
    sources: tuple[tuple[int, int | None], ...]  # (leaf, shard), shard None for a plain tensor
    writer: int
    device: str  # where the writer receives
    spans: Runs  # file data offset, packed offset, length


def plan_file(leaves: Sequence[Any], file: Sequence[int], writer: int) -> FilePlan:
    """The packed bytes of the tensors ``file`` (leaf indices, in data order) and their runs in the file."""
    lo: list[int] = []
    n: list[int] = []
    rank: list[int] = []
    devices: list[str] = []
    sources: list[tuple[int, int | None]] = []
    parts: list[Runs] = []
    at = data = 0
    for li in file:
        leaf = leaves[li]
        item = leaf.dtype.itemsize
        for offsets, sizes, holders in _boxes(leaf, writer):
            size = math.prod(sizes) * item
            for shard, r, device in holders:
                lo.append(at)
                n.append(size)
                rank.append(r)
                devices.append(device)
                sources.append((li, shard))
            f, b, k = runs(tuple(leaf.shape), offsets, sizes, sizes, (0,) * len(sizes), item)
            parts.append((f + data, b + at, k))
            at += size
        data += math.prod(leaf.shape) * item
    arrays = (np.array(lo, np.int64), np.array(n, np.int64), np.array(rank, np.int64))
    return FilePlan(at, *arrays, tuple(devices), tuple(sources), writer, _device(leaves, file, writer), coalesce(parts))


def _boxes(leaf: Any, writer: int) -> list[tuple[tuple[int, ...], tuple[int, ...], list[tuple[int | None, int, str]]]]:
    """Each distinct non-empty box of ``leaf`` (offsets, sizes) and its holders (shard, rank, device), in box order.

    A plain tensor is one value that every rank holds: its writer's copy is the one written.
    """
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


def _device(leaves: Sequence[Any], file: Sequence[int], writer: int) -> str:
    """Where the writer receives its file: the device of its first shard among the file's arrays, else the CPU."""
    for li in file:
        leaf = leaves[li]
        if isinstance(leaf, ShardedArray):
            cols = leaf.layout.columns
            for i in np.flatnonzero(cols.rank == writer).tolist():
                return cols.devices[i]
    return "cpu"


def pieces(plans: Sequence[FilePlan], size: int) -> int:
    """How many pieces of ``size`` bytes the largest file of a round takes."""
    return max((math.ceil(p.size / size) for p in plans), default=0)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One movement of a round: ``source`` and ``target`` 1-D byte layouts (pieces laid one after another).

    Source shard ``k`` is the bytes ``[skip, skip + n)`` of row ``row`` of file ``file``
    (``rows[k] = (file, row, skip)``); ``files[j]`` is ``None`` when file ``j`` has no
    bytes in this piece, else (its start in the target, its runs, offsets relative to
    the piece).
    """

    source: Layout
    target: Layout
    rows: tuple[tuple[int, int, int], ...]
    files: tuple[tuple[int, Runs] | None, ...]


def piece(plans: Sequence[FilePlan], s: int, size: int) -> Piece | None:
    """Piece ``s`` (of ``size`` bytes) of every file of a round, or ``None`` when none has bytes there."""
    src: list[tuple[int, int, int, str]] = []
    dst: list[tuple[int, int, int, str]] = []
    rows: list[tuple[int, int, int]] = []
    files: list[tuple[int, Runs] | None] = []
    base = 0
    for j, plan in enumerate(plans):
        p, q = s * size, min(plan.size, (s + 1) * size)
        if p >= q:
            files.append(None)
            continue
        for k in np.flatnonzero((plan.lo < q) & (plan.lo + plan.n > p)).tolist():
            x, y = max(int(plan.lo[k]), p), min(int(plan.lo[k] + plan.n[k]), q)
            src.append((base + x - p, y - x, int(plan.rank[k]), plan.devices[k]))
            rows.append((j, k, x - int(plan.lo[k])))
        dst.append((base, q - p, plan.writer, plan.device))
        files.append((base, _trim(plan.spans, p, q)))
        base += q - p
    if base == 0:
        return None
    return Piece(_layout(src, base), _layout(dst, base), tuple(rows), tuple(files))


def _layout(rows: list[tuple[int, int, int, str]], total: int) -> Layout:
    lo, n, rank = (np.array([r[k] for r in rows], np.int64) for k in range(3))
    return Layout.from_arrays((total,), lo[:, None], n[:, None], rank, [r[3] for r in rows])


def _trim(spans: Runs, p: int, q: int) -> Runs:
    """The runs of packed bytes ``[p, q)``, their packed offsets made relative to ``p``."""
    f, b, n = spans
    keep = np.flatnonzero((b < q) & (b + n > p))
    f, b, n = f[keep], b[keep], n[keep]
    start, end = np.maximum(b, p), np.minimum(b + n, q)
    return f + (start - b), start - p, end - start
