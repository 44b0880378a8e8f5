"""Byte ranges of boxes in row-major tensors, and reading and writing them with positioned I/O.

A box of a row-major tensor is a set of runs, each contiguous in the tensor. Where the
box lands in another row-major buffer (a shard, a packed message), a run must be
contiguous on both sides: ``runs`` gives the fewest such runs, and ``coalesce`` merges
consecutive runs that happen to touch on both sides (the boxes of a dim-0 split,
tensors stored one after another). ``read_runs`` and ``write_runs`` then move each
run with one ``preadv``/``pwrite`` call (where the platform has them) between the file
and the buffer, with no intermediate copy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fshard._base.alloc import contiguous_strides
from fshard._checkpoint._safetensors import counters
from fshard._errors import CheckpointError

__all__ = ["Runs", "byte_view", "coalesce", "read_runs", "runs", "whole", "write_runs"]


# (file offsets, buffer offsets, lengths) in bytes, int64 arrays of one length.
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]


_EMPTY: Runs = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def runs(
    shape: Sequence[int],
    at: Sequence[int],
    sizes: Sequence[int],
    buffer: Sequence[int],
    buffer_at: Sequence[int],
    itemsize: int,
) -> Runs:
    """The runs of the box ``at`` + ``sizes`` of a tensor of ``shape``, landing at ``buffer_at`` in ``buffer``.

    Offsets are bytes from the start of the tensor and of the buffer (both row-major).

    >>> f, b, n = runs((4, 6), (1, 0), (2, 6), (2, 6), (0, 0), 4)  # two whole rows: one run
    >>> f.tolist(), b.tolist(), n.tolist()
    ([24], [0], [48])
    >>> f, b, n = runs((4, 6), (0, 2), (2, 3), (2, 3), (0, 0), 1)  # a column block: one run per row
    >>> f.tolist(), b.tolist(), n.tolist()
    ([2, 8], [0, 3], [3, 3])
    """
    nd = len(sizes)
    if any(s == 0 for s in sizes):
        return _EMPTY
    if nd == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, itemsize, np.int64)
    k = nd - 1  # runs span dims k.. ; inner dims must be whole on both sides
    while k > 0 and sizes[k] == shape[k] == buffer[k]:
        k -= 1
    length = math.prod(sizes[k:]) * itemsize
    ts, bs = contiguous_strides(shape), contiguous_strides(buffer)
    grid = np.indices(tuple(sizes[:k]), dtype=np.int64).reshape(k, -1) if k else np.zeros((0, 1), np.int64)
    f = sum(((grid[i] + at[i]) * ts[i] for i in range(k)), np.zeros(grid.shape[1], np.int64)) + at[k] * ts[k]
    b = sum(((grid[i] + buffer_at[i]) * bs[i] for i in range(k)), np.zeros(grid.shape[1], np.int64))
    b = b + buffer_at[k] * bs[k]
    return f * itemsize, b * itemsize, np.full(grid.shape[1], length, np.int64)


def whole(length: int) -> Runs:
    """One run of ``length`` bytes at the start of both the file and the buffer."""
    return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, length, np.int64)


def coalesce(parts: Sequence[Runs]) -> Runs:
    """The runs of ``parts`` in order, consecutive runs that touch in both the file and the buffer merged.

    >>> f, b, n = coalesce([runs((4,), (0,), (2,), (2,), (0,), 1), runs((4,), (2,), (2,), (4,), (2,), 1)])
    >>> f.tolist(), b.tolist(), n.tolist()
    ([0], [0], [4])
    """
    kept = [p for p in parts if len(p[0])]
    if not kept:
        return _EMPTY
    f, b, n = (np.concatenate([p[i] for p in kept]) for i in range(3))
    touch = (f[1:] == f[:-1] + n[:-1]) & (b[1:] == b[:-1] + n[:-1])
    starts = np.flatnonzero(np.r_[True, ~touch])
    return f[starts], b[starts], np.add.reduceat(n, starts)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, writable where ``t`` is."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy()  # numpy arrays are buffers; its stubs do not say so
    return memoryview(array).cast("B")


def read_runs(fd: int, path: Path, what: str, base: int, spans: Runs, out: memoryview) -> None:
    """Reads each run from ``base`` + its file offset into ``out`` at its buffer offset; counts the bytes.

    Raises:
        CheckpointError: the file ends before a run (``what`` names the tensor): it shrank since its header was read.
    """
    f, b, n = spans
    for src, dst, length in zip((f + base).tolist(), b.tolist(), n.tolist()):
        view = out[dst : dst + length]
        while len(view):
            got = _pread_into(fd, view, src)
            counters.reads += 1
            if got <= 0:
                msg = (
                    f"Safetensors file {path}: {what} ends early at byte {src}: the file was truncated after its "
                    "header was read."
                )
                raise CheckpointError(msg)
            counters.bytes_read += got
            view, src = view[got:], src + got


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # pragma: no cover - platforms without preadv (Windows)
    data = os.read(fd, len(view))  # pragma: no cover
    view[: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def write_runs(fd: int, base: int, spans: Runs, data: memoryview) -> None:
    """Writes each run of ``data`` (at its buffer offset) to ``base`` + its file offset."""
    f, b, n = spans
    for dst, src, length in zip((f + base).tolist(), b.tolist(), n.tolist()):
        view = data[src : src + length]
        while len(view):
            wrote = os.pwrite(fd, view, dst) if hasattr(os, "pwrite") else _write_at(fd, view, dst)
            view, dst = view[wrote:], dst + wrote


def _write_at(fd: int, view: memoryview, offset: int) -> int:  # pragma: no cover - platforms without pwrite
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, view)
