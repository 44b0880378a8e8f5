"""Writing a save's files in place: each file made by its writer, each box written by one holder.

Each file is created at its full size by its writer (``create_files``: the header, then
a hole for the data). Then every process writes the bytes of the boxes it holds straight
into the files, at their offsets in the row-major bytes of their tensors
(``write_boxes``): one holder per replicated box, the lowest in layout order, and the
file's writer for a plain tensor. Nothing crosses ranks, no process holds more than its
own shards, and every byte of every file is written once; each process flushes what it
wrote. As for ``fshard.save``, every rank must see the folder (one machine, or a shared
file system).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._checkpoint._format import resolved
from fshard._checkpoint._hf_commit import writing
from fshard._checkpoint._hf_write import header_bytes
from fshard._checkpoint._ranges import byte_view, runs, whole, write_runs
from fshard._layout.layout import Layout, replica_ids
from fshard.backends import Backend

__all__ = ["create_files", "write_boxes"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE = os.O_WRONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def _layout_of_file(leaves: list[tuple[str, Any]], file: list[int]) -> tuple[bytes, dict[int, int], int]:
    """A file's header, where each of its tensors starts in it (bytes from the file's start), and its size."""
    values = [leaves[i][1] for i in file]
    head = header_bytes([(leaves[i][0], v.dtype, tuple(v.shape)) for i, v in zip(file, values)])
    starts: dict[int, int] = {}
    at = len(head)
    for i, v in zip(file, values):
        starts[i] = at
        at += math.prod(v.shape) * v.dtype.itemsize
    return head, starts, at


def create_files(
    files: list[list[int]],
    names: list[str],
    writers: list[int],
    leaves: list[tuple[str, Any]],
    backend: Backend,
    stage: Path,
) -> None:
    """Creates the files this process writes: each its header, then its data's size (to be filled)."""
    for k, file in enumerate(files):
        if not backend.holds(writers[k]):
            continue
        path = stage / names[k]
        head, _, end = _layout_of_file(leaves, file)
        with writing(path):
            fd = os.open(path, _CREATE, 0o644)
            try:
                write_runs(fd, 0, whole(len(head)), memoryview(head))
                os.ftruncate(fd, end)
            finally:
                os.close(fd)


def write_boxes(
    files: list[list[int]],
    names: list[str],
    writers: list[int],
    leaves: list[tuple[str, Any]],
    backend: Backend,
    stage: Path,
) -> None:
    """Writes every box this process is the chosen holder of into its file, and fsyncs the files it wrote."""
    for k, file in enumerate(files):
        todo = [(i, box, t) for i in file for box, t in _mine(leaves[i][1], backend, backend.holds(writers[k]))]
        if not todo:
            continue
        path = stage / names[k]
        _, starts, _ = _layout_of_file(leaves, file)
        with writing(path):
            fd = os.open(path, _WRITE)
            try:
                for i, (lo, sz), t in todo:
                    value = leaves[i][1]
                    spans = runs(tuple(value.shape), lo, sz, sz, (0,) * len(sz), value.dtype.itemsize)
                    write_runs(fd, starts[i], spans, byte_view(_bytes(t)))
                os.fsync(fd)
            finally:
                os.close(fd)


def _mine(
    value: Any, backend: Backend, writer: bool
) -> list[tuple[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]]:
    """The boxes (offsets, sizes) of ``value`` that this process writes, with their tensors."""
    if not isinstance(value, ShardedArray):
        return [(((0,) * value.dim(), tuple(value.shape)), value)] if writer and value.numel() else []
    chosen = _chosen(value.layout)
    c = value.layout.columns
    return [
        ((tuple(c.lo[j].tolist()), tuple(c.sz[j].tolist())), t)
        for j, t in zip(backend.addressable(value.layout), value.addressable_data)
        if chosen[j]
    ]


@cached(256)
def _chosen(layout: Layout) -> np.ndarray:
    """Per shard, whether it is the one that writes its box: the first non-empty copy in layout order."""
    ids = replica_ids(layout)
    _, first = np.unique(ids, return_index=True)
    out = np.zeros(len(ids), bool)
    out[first] = True
    out &= np.all(layout.columns.sz > 0, axis=1)
    out.flags.writeable = False
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (its bytes in row-major order)."""
    t = resolved(t.detach()).contiguous()
    return t if t.device.type == "cpu" else t.cpu()
