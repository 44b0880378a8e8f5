"""Sending the pieces of replicated boxes from the rank that read them to the boxes' other holders.

In a byte space, box b of target t is the range ``[base, base + its bytes)``, its pieces
one after the other: the readers' layout holds each piece once (on its reader), the
target layout holds each box's range on each of its holders. One ``reshard`` of a uint8
array moves a whole batch of tensors, whatever their dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fshard._api.move import reshard
from fshard._array.array import ShardedArray
from fshard._checkpoint._dcp_plan import Pieces
from fshard._checkpoint._raw import flat_bytes
from fshard._layout.layout import Layout
from fshard.backends import Backend

__all__ = ["Buffers", "exchange"]

Buffers = dict[tuple[int, int], torch.Tensor]  # (target, distinct box) -> this process's values of the box

# One shard of a byte layout: (offset, bytes, rank, (target, box)).
_Row = tuple[int, int, int, tuple[int, int]]


def exchange(pieces: Sequence[Pieces], batch: list[int], coord: Backend, buffers: Buffers) -> None:
    """Fills, in ``buffers``, the pieces of the batch's replicated boxes that other ranks read (collective)."""
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
    read = [(start[(t, k, b)], pieces[t].nbytes(k), int(pieces[t].reader[k]), (t, b)) for t, k, b in rows]
    held = [(o, pieces[t].box_bytes(b), h, (t, b)) for (t, b), o in base.items() for h in pieces[t].holders(b)]
    mine = [(t, k, b) for t, k, b in rows if int(pieces[t].reader[k]) == coord.rank]
    data = [flat_bytes(buffers[(t, b)][pieces[t].in_box(k)]) for t, k, b in mine]
    sent = reshard(
        ShardedArray(_byte_layout(end, read, pieces), data, coord, torch.uint8), _byte_layout(end, held, pieces)
    )
    got = {int(s.meta.offsets[0]): s.data for s in sent.addressable_shards}
    for t, k, b in rows:
        if (t, b) in buffers and int(pieces[t].reader[k]) != coord.rank:
            p = pieces[t]
            at = start[(t, k, b)] - base[(t, b)]
            piece = got[base[(t, b)]][at : at + p.nbytes(k)].view(p.target.entry.dtype)
            buffers[(t, b)][p.in_box(k)].copy_(piece.view(tuple(p.size[k].tolist())))


def _byte_layout(total: int, rows: list[_Row], pieces: Sequence[Pieces]) -> Layout:
    """A 1-D layout of ``total`` bytes, one shard per row, on the device of the rank's copy of the box."""
    devices = [pieces[t].device(b, rank) for _, _, rank, (t, b) in rows]
    lo = np.array([[o] for o, _, _, _ in rows], np.int64)
    sz = np.array([[n] for _, n, _, _ in rows], np.int64)
    return Layout.from_arrays((total,), lo, sz, np.array([r for _, _, r, _ in rows], np.int64), devices)
