"""``fshard.load`` of a torch DCP folder: into any layout on any number of ranks, each byte read once per job.

Each process reads the pieces (saved chunk ∩ target box) that ``_dcp_plan`` gives it,
straight into its target buffers. Pieces of replicated boxes are then sent to the
other holders by one ``reshard`` of a byte array per batch of tensors: the pieces as
byte ranges, read by one holder each, to the whole boxes' bytes on every holder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._base.alloc import new
from fshard._checkpoint._collective import agree, agree_on, progress_bar
from fshard._checkpoint._dcp_chunks import Locator
from fshard._checkpoint._dcp_exchange import Buffers, exchange
from fshard._checkpoint._dcp_meta import METADATA, BytesEntry, DcpMetadata, read_metadata
from fshard._checkpoint._dcp_plan import Pieces, plan_pieces
from fshard._checkpoint._dcp_targets import Target, coordinator, targets
from fshard._checkpoint._format import check_flag, checkpoint_path
from fshard._checkpoint._raw import Files, Stored, read_box
from fshard._errors import CheckpointError
from fshard._layout.layout import layout_digest
from fshard.backends import Backend, default_backend

__all__ = ["EXCHANGE_BYTES", "load_dcp"]

# Replicated boxes are sent in batches of tensors whose replicated bytes add up to about this much.
EXCHANGE_BYTES = 256 << 20


def load_dcp(
    path: str | os.PathLike[str], like: Any, specs: Any, *, backend: Backend | None, progress: bool | None
) -> dict[str, Any]:
    """``fshard.load`` of the DCP folder ``path``: names -> arrays, tensors, or raw bytes (see ``load``)."""
    root = checkpoint_path(path, "load()")
    check_flag("load() progress", progress, optional=True)
    coord = coordinator(like, backend, default_backend)
    (md, _), seen = agree_on(coord, "fshard.load", lambda: _metadata(root, coord), lambda out: out[1])
    if len({d for _, d in seen}) > 1:  # each rank would read its own folder's bytes into the others' boxes
        msg = (
            f"fshard.load of {root}: the ranks read different DCP folders (their {METADATA} files differ): give "
            "every rank the same checkpoint."
        )
        raise CheckpointError(msg)
    ranks = tuple(r for r, _ in seen) if coord.spans_processes else (0,)
    (chosen, raw), seen = agree_on(coord, "fshard.load", lambda: targets(md, like, specs, coord, ranks), _digest)
    if len(set(seen)) > 1:
        msg = (
            f"fshard.load of {root}: the ranks asked for different tensors or layouts (like= or specs= differ "
            "between ranks). Every rank must pass the same like= or specs= (load is collective)."
        )
        raise CheckpointError(msg)
    pieces = plan_pieces(chosen, coord.spans_processes)
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        files = Files(stack)
        locator = Locator(root, files)
        total = sum(p.nbytes(k) for p in pieces for k in _mine(p, coord))
        bar = stack.enter_context(progress_bar("fshard.load", total, progress, coord))
        buffers: Buffers = {}
        for batch in _batches(pieces):
            agree(coord, "fshard.load", functools.partial(_read_batch, pieces, batch, locator, coord, buffers, bar))
            exchange(pieces, batch, coord, buffers)
        values = {p.target.entry.name: _result(t, p, coord, buffers) for t, p in enumerate(pieces)}
        blobs = agree(coord, "fshard.load", lambda: {e.name: _raw_bytes(files, locator, e) for e in raw})
    for e in md.entries:
        if e.name in values or e.name in blobs:
            out[e.name] = values[e.name] if e.name in values else blobs[e.name]
    return out


def _metadata(root: Path, coord: Backend) -> tuple[DcpMetadata, tuple[int, str]]:
    """The folder's metadata, and this rank with a digest of the metadata's bytes.

    DCP names each save in its metadata (a save id), so two folders' digests differ even
    where they hold tensors of the same names and shapes; copies of one folder agree.
    """
    md = read_metadata(root)
    try:
        digest = hashlib.sha256((root / METADATA).read_bytes()).hexdigest()
    except OSError as exc:
        raise CheckpointError(f"DCP metadata {root / METADATA} cannot be read: {exc.strerror or exc}.") from None
    return md, (int(coord.rank or 0), digest)


def _digest(chosen: tuple[Sequence[Target], Sequence[BytesEntry]]) -> str:
    """A digest of the tensors a rank builds (names and layouts, devices aside) and of the entries read as bytes."""
    h = hashlib.sha256()
    for t in chosen[0]:
        h.update(repr((t.entry.name, t.plain)).encode())
        h.update(layout_digest(t.layout))
    h.update(repr([e.name for e in chosen[1]]).encode())
    return h.hexdigest()


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


def _buffer(t: int, p: Pieces, b: int, coord: Backend, buffers: Buffers) -> torch.Tensor:
    """This process's buffer for distinct box ``b`` of target ``t``, made on first use."""
    key = (t, b)
    if key not in buffers:
        sizes = tuple(int(n) for n in p.index.hi[b] - p.index.lo[b])
        buffers[key] = new(sizes, p.target.entry.dtype, torch.device(p.device(b, _holder(p, b, coord))))
    return buffers[key]


def _holder(p: Pieces, b: int, coord: Backend) -> int:
    """A rank of this process that holds box ``b``."""
    ranks = p.holders(b)
    return next((r for r in ranks if coord.holds(r)), ranks[0])


def _read_batch(
    pieces: Sequence[Pieces], batch: list[int], locator: Locator, coord: Backend, buffers: Buffers, bar: Any
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
            dest = _buffer(t, p, b, coord, buffers)[p.in_box(k)]
            rel = tuple(int(a - o) for a, o in zip(p.lo[k], chunk.offsets))
            read_box(locator.files, stored[c], rel, tuple(int(n) for n in p.size[k]), dest)
            bar.update(p.nbytes(k))


def _result(t: int, p: Pieces, coord: Backend, buffers: Buffers) -> Any:
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
