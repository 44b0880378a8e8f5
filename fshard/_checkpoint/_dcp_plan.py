"""Who reads what of a DCP folder: each saved chunk cut by the distinct target boxes, one reader per piece.

A pure function of the targets' layouts and the saved chunks, so every rank computes the
same answer without talking. A piece of a box that one process holds is read there. A
piece of a box held by several processes (replicas) is read from storage once, by one of
its holders, and sent to the others; such pieces are first cut into one part per holder,
handed out in turn, so the holders share the reading as they would an all-gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from fshard._base.boxes import intersect_pairs
from fshard._checkpoint._dcp_targets import Target
from fshard._layout.index import Index, expand, index

__all__ = ["Pieces", "plan_pieces"]


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
    """Target ``target``'s pieces: piece k is ``(lo[k], size[k])`` of chunk ``chunk[k]`` and distinct box ``box[k]``.

    ``reader[k]`` reads it; ``shared[b]`` says box b's holders live in several processes.
    """

    target: Target
    index: Index
    chunk: np.ndarray
    box: np.ndarray
    lo: np.ndarray
    size: np.ndarray
    reader: np.ndarray
    shared: np.ndarray

    def nbytes(self, k: int) -> int:
        return math.prod(self.size[k].tolist()) * self.target.entry.dtype.itemsize

    def in_box(self, k: int) -> tuple[slice, ...]:
        """Piece ``k`` as slices of its box."""
        origin = self.index.lo[int(self.box[k])]
        return tuple(slice(int(a - o), int(a - o + n)) for a, n, o in zip(self.lo[k], self.size[k], origin))

    def box_bytes(self, b: int) -> int:
        return math.prod((self.index.hi[b] - self.index.lo[b]).tolist()) * self.target.entry.dtype.itemsize

    def holders(self, b: int) -> list[int]:
        """The ranks that hold box ``b``, ascending."""
        first, count = int(self.index.start[b]), int(self.index.count[b])
        return [int(r) for r in self.index.holder[first : first + count]]

    def device(self, b: int, rank: int) -> str:
        """The device of ``rank``'s copy of box ``b`` (a plain tensor's buffer lives on the CPU)."""
        if self.target.plain:
            return "cpu"
        pos = self.index.find(np.array([b]), np.array([rank]))
        return self.target.layout.columns.devices[int(self.index.first[int(pos[0])])]


def plan_pieces(targets: Sequence[Target], spans_processes: bool) -> list[Pieces]:
    """The pieces of every target, readers chosen in turn across all targets (deterministic)."""
    out: list[Pieces] = []
    turn = 0
    for t in targets:
        p = _pieces(t, spans_processes, turn)
        turn += len(p.chunk)
        out.append(p)
    return out


def _chunk_boxes(t: Target) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index, lo, hi) of the target's non-empty chunks."""
    ndim = len(t.entry.shape)
    keep = [k for k, c in enumerate(t.entry.chunks) if c.numel]
    lo = np.array([t.entry.chunks[k].offsets for k in keep], np.int64).reshape(len(keep), ndim)
    sz = np.array([t.entry.chunks[k].sizes for k in keep], np.int64).reshape(len(keep), ndim)
    return np.array(keep, np.int64), lo, lo + sz


def _pieces(t: Target, spans_processes: bool, turn: int) -> Pieces:
    idx = index(t.layout)
    keep, clo, chi = _chunk_boxes(t)
    ci, b = intersect_pairs(clo, chi, idx.lo, idx.hi)
    lo = np.maximum(clo[ci], idx.lo[b])
    size = np.minimum(chi[ci], idx.hi[b]) - lo
    chunk = keep[ci]
    shared = idx.count > 1 if spans_processes else np.zeros(len(idx.count), bool)
    if shared.any():
        chunk, b, lo, size = _split(chunk, b, lo, size, np.where(shared[b], idx.count[b], 1))
    reader = idx.holder[idx.start[b] + (turn + _position(b)) % idx.count[b]]
    return Pieces(t, idx, chunk, b, lo, size, reader, shared)


def _position(box: np.ndarray) -> np.ndarray:
    """Each piece's position among the pieces of its box (pieces come grouped by box)."""
    if not len(box):
        return box
    starts = np.r_[0, np.flatnonzero(np.diff(box)) + 1]
    counts = np.diff(np.r_[starts, len(box)])
    return np.arange(len(box)) - np.repeat(starts, counts)


def _split(
    chunk: np.ndarray, box: np.ndarray, lo: np.ndarray, size: np.ndarray, parts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each piece cut along its longest dim into up to ``parts`` slabs (torch.chunk sizes, empty ones dropped)."""
    if size.shape[1] == 0:
        return chunk, box, lo, size
    dim = np.argmax(size, axis=1)
    rows = np.arange(len(size))
    extent = size[rows, dim]
    n = np.minimum(parts, extent)
    step = -(-extent // n)
    row, q = expand(n)
    start = q * step[row]
    length = np.minimum(step[row], extent[row] - start)
    keep = length > 0
    row, start, length = row[keep], start[keep], length[keep]
    new_lo, new_size = lo[row].copy(), size[row].copy()
    new_lo[np.arange(len(row)), dim[row]] += start
    new_size[np.arange(len(row)), dim[row]] = length
    return chunk[row], box[row], new_lo, new_size
