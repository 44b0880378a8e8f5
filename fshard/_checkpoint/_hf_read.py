"""Reading a load's boxes: each rank reads the boxes the plan gives it, only their byte ranges.

A box of an array meets one or more pieces of checkpoint tensors (``_fuse.View``); in
each it is a set of runs (``_ranges.runs``), merged where consecutive pieces of one file
touch, and read with one ``preadv`` per run into the box's buffer. A file is opened once
and checked to be the one whose header was read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._base.alloc import new
from fshard._checkpoint._fuse import View
from fshard._checkpoint._hf_files import Source
from fshard._checkpoint._hf_plan import ReadPlan
from fshard._checkpoint._hf_targets import Want
from fshard._checkpoint._ranges import Runs, byte_view, coalesce, read_runs, runs
from fshard._checkpoint._safetensors import Header
from fshard._errors import CheckpointError
from fshard.backends import Backend

__all__ = ["read_boxes"]


_CPU = torch.device("cpu")


class _Files:
    """Data files opened on first use and checked to be the files whose headers were read."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack, self.fds = stack, dict[Path, int]()

    def fd(self, header: Header) -> int:
        fd = self.fds.get(header.path)
        if fd is None:
            try:
                fd = os.open(header.path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise CheckpointError(
                    f"Safetensors file {header.path} cannot be opened: {exc.strerror or exc}."
                ) from None
            self.stack.callback(os.close, fd)
            info = os.fstat(fd)
            if (info.st_size, (info.st_dev, info.st_ino, info.st_mtime_ns)) != (header.size, header.identity):
                msg = (
                    f"Safetensors file {header.path} changed since its header was read: load again once it is written."
                )
                raise CheckpointError(msg)
            self.fds[header.path] = fd
        return fd


def _box_runs(
    view: View, offsets: tuple[int, ...], sizes: tuple[int, ...], sources: dict[str, Source]
) -> list[tuple[Source, Runs]]:
    """Per piece of ``view`` that the box meets: its source and runs (absolute file offsets, box buffer offsets)."""
    out: list[tuple[Source, Runs]] = []
    d = view.dim
    for p, at in zip(view.pieces, view.starts()):
        lo, hi = (max(offsets[d], at), min(offsets[d] + sizes[d], at + p.sizes[d])) if sizes else (0, 1)
        if lo >= hi:
            continue
        sub_at = (*offsets[:d], lo, *offsets[d + 1 :]) if sizes else ()
        sub_sz = (*sizes[:d], hi - lo, *sizes[d + 1 :]) if sizes else ()
        t_at = tuple(o + s - (at if k == d else 0) for k, (o, s) in enumerate(zip(p.offsets, sub_at)))
        b_at = tuple(s - o for s, o in zip(sub_at, offsets))
        src = sources[p.source]
        f, b, n = runs(src.entry.shape, t_at, sub_sz, sizes, b_at, view.dtype.itemsize)
        out.append((src, (f + src.entry.begin, b, n)))
    return out


def read_boxes(
    plan: ReadPlan, wants: Sequence[Want], sources: dict[str, Source], coord: Backend, bar: Any
) -> list[torch.Tensor]:
    """This process's reader shards: each box's bytes, read from its files only where it lies."""
    reader = plan.reader
    if reader is None:
        return []
    out: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        files = _Files(stack)
        for i in coord.addressable(reader):
            a, offsets, sizes = plan.boxes[i]
            w = wants[a]
            buf = new(sizes, w.view.dtype, _CPU)
            into = byte_view(buf)
            for src, spans in _grouped(_box_runs(w.view, offsets, sizes, sources)):
                read_runs(files.fd(src.header), src.header.path, f"tensor {src.entry.name!r}", 0, spans, into)
            data = buf.reshape(-1).view(torch.uint8)
            device = torch.device(reader.shards[i].placement.device)
            out.append(data if device.type == "cpu" else data.to(device))
            bar.update(buf.nbytes)
    return out


def _grouped(parts: list[tuple[Source, Runs]]) -> list[tuple[Source, Runs]]:
    """Consecutive pieces in one file as one set of runs, merged where they touch."""
    out: list[tuple[Source, list[Runs]]] = []
    for src, spans in parts:
        if out and out[-1][0].header.path == src.header.path:
            out[-1][1].append(spans)
        else:
            out.append((src, [spans]))
    return [(src, coalesce(spans)) for src, spans in out]
