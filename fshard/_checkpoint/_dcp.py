"""``fshard.load`` of a torch DCP folder: into any layout on any number of ranks, each byte read once per job.

Each process reads the pieces (saved chunk ∩ target box) that ``_dcp_plan`` gives it,
straight into its target buffers. Pieces of replicated boxes are then sent to the
other holders by one ``reshard`` of a byte array per batch of tensors: the pieces as
byte ranges, read by one holder each, to the whole boxes' bytes on every holder.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._base.alloc import new
from fshard._checkpoint._collective import agree, agree_on, progress_bar
from fshard._checkpoint._dcp_chunks import Locator
from fshard._checkpoint._dcp_meta import BytesEntry, read_metadata
from fshard._checkpoint._dcp_plan import Pieces, plan_pieces
from fshard._checkpoint._dcp_targets import coordinator, targets
from fshard._checkpoint._format import check_flag, checkpoint_path
from fshard._checkpoint._raw import Files, Stored, flat_bytes, read_box
from fshard._errors import CheckpointError
from fshard._layout.layout import Layout
from fshard.backends import Backend, default_backend

__all__ = ["EXCHANGE_BYTES", "load_dcp"]

# Replicated boxes are sent in batches of tensors whose replicated bytes add up to about this much.
EXCHANGE_BYTES = 256 << 20

_Buffers = dict[tuple[int, int], torch.Tensor]  # (target, distinct box) -> this process's values of the box


def load_dcp(
    path: str | os.PathLike[str], like: Any, specs: Any, *, backend: Backend | None, progress: bool | None
) -> dict[str, Any]:
    """``fshard.load`` of the DCP folder ``path``: names -> arrays, tensors, or raw bytes (see ``load``)."""
    root = checkpoint_path(path, "load()")
    check_flag("load() progress", progress, optional=True)
    coord = coordinator(like, backend, default_backend)
    (md, _), seen = agree_on(coord, "fshard.load", lambda: (read_metadata(root), coord.rank), lambda out: out[1])
    ranks = tuple(int(r) for r in seen) if coord.spans_processes else (0,)
    chosen, raw = agree(coord, "fshard.load", lambda: targets(md, like, specs, coord, ranks))
    pieces = plan_pieces(chosen, coord.spans_processes)
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        files = Files(stack)
        locator = Locator(root, files)
        total = sum(p.nbytes(k) for p in pieces for k in _mine(p, coord))
        bar = stack.enter_context(progress_bar("fshard.load", total, progress, coord))
        buffers: _Buffers = {}
        for batch in _batches(pieces):
            agree(coord, "fshard.load", functools.partial(_read_batch, pieces, batch, locator, coord, buffers, bar))
            _exchange(pieces, batch, coord, buffers)
        values = {p.target.entry.name: _result(t, p, coord, buffers) for t, p in enumerate(pieces)}
        blobs = agree(coord, "fshard.load", lambda: {e.name: _raw_bytes(files, locator, e) for e in raw})
    for e in md.entries:
        if e.name in values or e.name in blobs:
            out[e.name] = values[e.name] if e.name in values else blobs[e.name]
    return out


def _mine(p: Pieces, coord: Backend) -> np.ndarray:
    """The pieces this process reads."""
    if not coord.spans_processes:
        return np.arange(len(p.chunk))
    return np.flatnonzero(p.reader == coord.rank)


def _batches(pieces: Sequence[Pieces]) -> list[list[int]]:
    """Consecutive targets, cut where their replicated boxes' bytes pass ``EXCHANGE_BYTES``."""
    out: list[list[int]] = [[]]
    size = 0
    for t, p in enumerate(pieces):
        shared = int(np.prod(p.index.hi[p.shared] - p.index.lo[p.shared], axis=1).sum())
        shared *= p.target.entry.dtype.itemsize
        if out[-1] and size + shared > EXCHANGE_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += shared
    return out


def _box_slices(lo: np.ndarray, size: np.ndarray, origin: np.ndarray) -> tuple[slice, ...]:
    return tuple(slice(int(a - o), int(a - o + n)) for a, n, o in zip(lo, size, origin))


def _buffer(t: int, p: Pieces, b: int, coord: Backend, buffers: _Buffers) -> torch.Tensor:
    """This process's buffer for distinct box ``b`` of target ``t``, made on first use."""
    key = (t, b)
    if key not in buffers:
        sizes = tuple(int(n) for n in p.index.hi[b] - p.index.lo[b])
        buffers[key] = new(sizes, p.target.entry.dtype, torch.device(_device(p, b, _holder(p, b, coord))))
    return buffers[key]


def _holder(p: Pieces, b: int, coord: Backend) -> int:
    """A rank of this process that holds box ``b``."""
    first, count = int(p.index.start[b]), int(p.index.count[b])
    ranks = p.index.holder[first : first + count].tolist()
    return next((int(r) for r in ranks if coord.holds(int(r))), int(ranks[0]))


def _device(p: Pieces, b: int, rank: int) -> str:
    """The device of ``rank``'s copy of box ``b`` (a plain tensor's buffer lives on the CPU)."""
    if p.target.plain:
        return "cpu"
    pos = p.index.find(np.array([b]), np.array([rank]))
    return p.target.layout.columns.devices[int(p.index.first[int(pos[0])])]


def _read_batch(
    pieces: Sequence[Pieces], batch: list[int], locator: Locator, coord: Backend, buffers: _Buffers, bar: Any
) -> None:
    """Reads this process's pieces of the batch's targets into their boxes' buffers."""
    for t in batch:
        p = pieces[t]
        for i in p.target.backend.addressable(p.target.layout):  # a buffer per box held, however it is filled
            if int(p.index.box_of[i]) >= 0:
                _buffer(t, p, int(p.index.box_of[i]), coord, buffers)
        stored: dict[int, Stored] = {}
        for k in _mine(p, coord).tolist():
            c, b = int(p.chunk[k]), int(p.box[k])
            chunk = p.target.entry.chunks[c]
            if c not in stored:
                stored[c] = locator.locate(p.target.entry, chunk)
            dest = _buffer(t, p, b, coord, buffers)[_box_slices(p.lo[k], p.size[k], p.index.lo[b])]
            rel = tuple(int(a - o) for a, o in zip(p.lo[k], chunk.offsets))
            read_box(locator.files, stored[c], rel, tuple(int(n) for n in p.size[k]), dest)
            bar.update(p.nbytes(k))


def _piece_bytes(buf: torch.Tensor, p: Pieces, k: int, b: int) -> torch.Tensor:
    """Piece ``k`` of ``buf`` (box ``b``) as contiguous bytes."""
    return flat_bytes(buf[_box_slices(p.lo[k], p.size[k], p.index.lo[b])])


def _exchange(pieces: Sequence[Pieces], batch: list[int], coord: Backend, buffers: _Buffers) -> None:
    """Sends the pieces of replicated boxes from their readers to the boxes' other holders.

    In a byte space, box b of target t is the range ``[base, base + its bytes)``, its pieces
    one after the other: the readers' layout holds each piece once (on its reader), the
    target layout holds each box's range on each of its holders; one ``reshard`` moves them.
    """
    rows = [(t, k, b) for t in batch for k, b in enumerate(pieces[t].box.tolist()) if pieces[t].shared[b]]
    if not coord.spans_processes or not rows:
        return
    base: dict[tuple[int, int], int] = {}
    start: dict[tuple[int, int, int], int] = {}  # (t, k, b) -> byte offset of piece k in the byte space
    end = 0
    for t, k, b in sorted(rows, key=lambda r: (r[0], r[2], r[1])):  # pieces grouped by box
        base.setdefault((t, b), end)
        start[(t, k, b)] = end
        end += pieces[t].nbytes(k)
    src = _byte_layout(
        end, [(start[r], pieces[r[0]].nbytes(r[1]), int(pieces[r[0]].reader[r[1]]), r) for r in rows], pieces
    )
    dst = _byte_layout(
        end,
        [(o, _box_bytes(pieces[t], b), h, (t, -1, b)) for (t, b), o in base.items() for h in _holders(pieces[t], b)],
        pieces,
    )
    mine = [r for r in rows if int(pieces[r[0]].reader[r[1]]) == coord.rank]
    data = [_piece_bytes(buffers[(t, b)], pieces[t], k, b) for t, k, b in mine]
    sent = reshard(ShardedArray(src, data, coord, torch.uint8), dst)
    got = {int(s.meta.offsets[0]): s.data for s in sent.addressable_shards}
    for t, k, b in rows:
        if (t, b) in buffers and int(pieces[t].reader[k]) != coord.rank:
            p = pieces[t]
            at = start[(t, k, b)] - base[(t, b)]
            piece = got[base[(t, b)]][at : at + p.nbytes(k)].view(p.target.entry.dtype)
            buffers[(t, b)][_box_slices(p.lo[k], p.size[k], p.index.lo[b])].copy_(piece.view(tuple(p.size[k].tolist())))


def _box_bytes(p: Pieces, b: int) -> int:
    return math.prod((p.index.hi[b] - p.index.lo[b]).tolist()) * p.target.entry.dtype.itemsize


def _holders(p: Pieces, b: int) -> list[int]:
    first, count = int(p.index.start[b]), int(p.index.count[b])
    return [int(r) for r in p.index.holder[first : first + count]]


def _byte_layout(
    total: int, rows: list[tuple[int, int, int, tuple[int, int, int]]], pieces: Sequence[Pieces]
) -> Layout:
    """A 1-D layout of ``total`` bytes: each row (offset, size, rank, (target, piece, box)) one shard."""
    devices = [_device(pieces[t], b, rank) for _, _, rank, (t, _, b) in rows]
    lo = np.array([[o] for o, _, _, _ in rows], np.int64)
    sz = np.array([[n] for _, n, _, _ in rows], np.int64)
    return Layout.from_arrays((total,), lo, sz, np.array([r for _, _, r, _ in rows], np.int64), devices)


def _result(t: int, p: Pieces, coord: Backend, buffers: _Buffers) -> Any:
    """Target ``t`` as the caller asked: an array of this process's shards, or a plain tensor."""
    target = p.target
    index = target.backend.addressable(target.layout)
    if target.plain:
        whole = buffers[(t, 0)] if (t, 0) in buffers else torch.empty(target.entry.shape, dtype=target.entry.dtype)
        whole = whole.to(target.device)
        return whole.requires_grad_() if target.requires_grad else whole
    data: list[torch.Tensor] = []
    used: set[int] = set()
    for i in index:
        b = int(p.index.box_of[i])
        shard = target.layout.shards[i]
        if b < 0:
            data.append(new(shard.sizes, target.entry.dtype, torch.device(shard.placement.device)))
        else:  # in one process, the other copies of a box are copies of the one read (on their own devices)
            data.append(buffers[(t, b)].to(shard.placement.device, copy=b in used))
            used.add(b)
    data = [d.requires_grad_() if target.requires_grad else d for d in data]
    return ShardedArray(target.layout, data, target.backend, target.entry.dtype, requires_grad=target.requires_grad)


def _raw_bytes(files: Files, locator: Locator, e: BytesEntry) -> bytes:
    """A non-tensor entry's stored bytes (DCP wrote them with ``torch.save``); never unpickled."""
    path = locator.path(e.file)
    if files.size(path) < e.offset + e.length:
        raise CheckpointError(f"DCP file {path} is too short for entry {e.name!r} (bytes {e.offset}+{e.length}).")
    return files.read(path, e.offset, e.length)
