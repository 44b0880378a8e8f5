"""The fshard layout of a DTensor whose placements include ``_StridedShard`` (FSDP2 over tensor parallelism).

DTensor applies placements left to right over the mesh dims. Along one tensor dim, a
rank's local tensor holds a list of global indices, in order: ``Shard`` keeps the
``torch.chunk`` part of the list at the rank's mesh coordinate; ``_StridedShard(dim,
split_factor=s)`` first cuts the list into ``s`` ``torch.chunk`` parts, cuts each of
them into ``n`` (the mesh dim's size) and keeps, from every part, the piece at the
rank's coordinate, concatenated. The indices stay ascending, so each rank's list is a
few runs of consecutive indices, and its local tensor is the product over dims of those
runs: one box each (one box in all when every dim has one run, which is the even FSDP2 +
TP case). Runs are kept as (start, length) pairs, never index arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

import numpy as np

from fshard._layout.layout import Layout
from fshard._layout.specs import Mesh

__all__ = ["Split", "local_runs", "strided_layout"]

# One placement as data: ("shard", dim, 1), ("strided", dim, split_factor) or ("replicate", -1, 1).
Split = tuple[str, int, int]
Runs = list[tuple[int, int]]


def _chunk(length: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s part ``i`` of ``parts`` over ``length`` items: (start, stop), possibly empty."""
    step = -(-length // parts) if length else 0
    return min(i * step, length), min((i + 1) * step, length)


def _take(runs: Runs, a: int, b: int) -> Runs:
    """The items at positions ``[a, b)`` of the list that ``runs`` describe."""
    out: Runs = []
    pos = 0
    for start, n in runs:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += n
    return out


def _split(runs: Runs, split: Split, size: int, coord: int) -> Runs:
    length = sum(n for _, n in runs)
    kind, _, factor = split
    if kind == "shard":
        return _take(runs, *_chunk(length, size, coord))
    out: Runs = []
    for j in range(factor):
        a, b = _chunk(length, factor, j)
        lo, hi = _chunk(b - a, size, coord)
        out += _take(runs, a + lo, a + hi)
    return out


def _merged(runs: Runs) -> Runs:
    out: Runs = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out


def local_runs(
    shape: Sequence[int], mesh_shape: Sequence[int], splits: Sequence[Split], coord: Sequence[int]
) -> list[Runs]:
    """Per tensor dim, the runs (global start, length) of the indices that mesh position ``coord`` holds, in order.

    >>> local_runs((9,), (4,), [("strided", 0, 2)], (0,))  # indices [0, 1, 5]
    [[(0, 2), (5, 1)]]
    """
    runs: list[Runs] = [[(0, n)] for n in shape]
    for m, split in enumerate(splits):
        if split[0] != "replicate":
            runs[split[1]] = _split(runs[split[1]], split, mesh_shape[m], coord[m])
    return [_merged(r) for r in runs]


Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _boxes(runs: list[Runs]) -> list[Box]:
    """(global offsets, local offsets, sizes) of each box of the local tensor; one empty box if it holds nothing."""
    if any(not r for r in runs):
        return [((0,) * len(runs), (0,) * len(runs), tuple(sum(n for _, n in r) for r in runs))]
    local = [[sum(n for _, n in r[:k]) for k in range(len(r))] for r in runs]
    out: list[Box] = []
    for pick in product(*(range(len(r)) for r in runs)):
        out.append(
            (
                tuple(runs[d][k][0] for d, k in enumerate(pick)),
                tuple(local[d][k] for d, k in enumerate(pick)),
                tuple(runs[d][k][1] for d, k in enumerate(pick)),
            )
        )
    return out


def strided_layout(shape: tuple[int, ...], mesh: Mesh, splits: Sequence[Split]) -> tuple[Layout, np.ndarray]:
    """The layout of every rank's local tensor, and each shard's offsets inside its rank's local tensor.

    >>> layout, local = strided_layout((9,), Mesh((4,)), [("strided", 0, 2)])
    >>> [(s.offsets, s.sizes, s.placement.rank) for s in layout.shards][:3], local[:3].tolist()
    ([((0,), (2,), 0), ((5,), (1,), 0), ((2,), (2,), 1)], [[0], [2], [0]])
    """
    assert mesh.ranks is not None
    rows: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, str]] = []
    for flat, place in enumerate(mesh.ranks):
        coord = tuple(int(c) for c in np.unravel_index(flat, mesh.shape))
        for lo, at, size in _boxes(local_runs(shape, mesh.shape, splits, coord)):
            rows.append((lo, at, size, place.rank, place.device))
    ndim = len(shape)
    cols = (np.array([r[k] for r in rows], np.int64).reshape(len(rows), ndim) for k in range(3))
    lo, at, size = cols
    ranks = np.array([r[3] for r in rows], np.int64)
    return Layout.from_arrays(shape, lo, size, ranks, [r[4] for r in rows]), at
