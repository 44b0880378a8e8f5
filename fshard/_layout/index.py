"""A layout's index: its distinct boxes, who holds each, and how to find the boxes that meet a query.

Plans, pending plans, lower bounds and the torch_dist transport read layouts through
this index: sorted bounds per dim where the boxes form a grid (every spec but
``Explicit`` makes one), a general box search otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._layout.layout import Layout

__all__ = ["Holders", "Index", "expand", "groups", "index", "pieces"]


# -- a layout's index: distinct boxes, who holds them, and how to find them ---------------------


def groups(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct non-empty boxes: (shard index of each box's first copy, shard indices, box of each).

    Boxes are numbered in lexicographic order of (offsets, sizes).
    """
    idx = np.flatnonzero(_boxes.rows_all(layout.columns.sz > 0))
    first, inverse = _boxes.unique_rows(np.c_[layout.columns.lo[idx], layout.columns.sz[idx]])
    return idx[first], idx, inverse


@dataclasses.dataclass(frozen=True, eq=False)
class _Grid:
    """Distinct boxes that are the cells of one partition per dim: a box is found by bisection."""

    los: tuple[np.ndarray, ...]  # per dim, the sorted disjoint intervals' lower ends
    his: tuple[np.ndarray, ...]  # ... and upper ends
    strides: tuple[int, ...]  # of the dense cell numbering
    cell: np.ndarray  # box at each cell, -1 where none


class Holders:
    """Groups held by ranks, and lookups of (group, rank) pairs.

    ``held`` lists each (group, rank) as the sorted key ``group * len(ranks) + code``
    (``code``: the rank's position in the sorted ``ranks``); a group's holders are the run
    ``held[start[g] : start[g] + count[g]]``, ranks ascending (``holder``). An ``Index``
    groups a layout's copies by distinct box, a ``Summands`` (``fshard._layout.summands``)
    a partial layout's summands by the ranks that hold replicas of them.
    """

    ranks: np.ndarray
    held: np.ndarray
    holder: np.ndarray
    start: np.ndarray
    count: np.ndarray

    @functools.cached_property
    def _dense(self) -> bool:
        """Whether ``ranks`` is ``0 .. len(ranks) - 1``, so that a rank is its own code."""
        return not len(self.ranks) or int(self.ranks[-1]) == len(self.ranks) - 1

    def code(self, rank: np.ndarray) -> np.ndarray:
        """Position of each rank in ``ranks``, or -1 for ranks that hold no shard."""
        if self._dense:
            return np.where(rank < len(self.ranks), rank, -1)
        pos = np.searchsorted(self.ranks, rank)
        clipped = np.minimum(pos, max(len(self.ranks) - 1, 0))
        ok = (pos < len(self.ranks)) & (self.ranks[clipped] == rank) if len(self.ranks) else pos < 0
        return np.where(ok, pos, -1)

    def key(self, group: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The key of each (group, rank), or -1 where the rank holds no shard."""
        code = self.code(rank)
        return np.where(code >= 0, group * len(self.ranks) + code, -1)

    def find(self, group: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Position in ``held`` of each (group, rank), or -1 where that rank holds none of the group."""
        key = self.key(group, rank)
        pos = np.minimum(np.searchsorted(self.held, key), max(len(self.held) - 1, 0))
        if not len(self.held):
            return np.full(len(key), -1, np.int64)
        return np.where((key >= 0) & (self.held[pos] == key), pos, -1)


@dataclasses.dataclass(frozen=True, eq=False)
class Index(Holders):
    """A layout's distinct non-empty boxes, the ranks holding each, and a lookup by region.

    ``held`` lists each (box, rank) holding a copy as the key ``box * len(ranks) + code``
    (``code``: the rank's position in ``ranks``), sorted; a box's holders are the run
    ``held[start[b] : start[b] + count[b]]``, ranks ascending. ``copies`` lists the
    non-empty shards by (box, rank, shard), ``copy_key`` the key of each; a box's copies
    are the run ``copies[copy_start[b] : copy_start[b] + copy_count[b]]``.
    """

    lo: np.ndarray
    hi: np.ndarray
    box_of: np.ndarray  # box of each shard, -1 for an empty one
    ranks: np.ndarray
    held: np.ndarray
    holder: np.ndarray  # rank of each held key
    first: np.ndarray  # lowest shard index of each held key
    start: np.ndarray
    count: np.ndarray
    copies: np.ndarray
    copy_key: np.ndarray
    copy_start: np.ndarray  # first entry of each box in ``copies``
    copy_count: np.ndarray  # copies of each box
    by_rank: np.ndarray  # every shard, sorted by rank (stable)
    rank_sorted: np.ndarray

    @functools.cached_property
    def grid(self) -> _Grid | None:
        """The boxes as the cells of one partition per dim, when they are (every spec but ``Explicit``)."""
        return _grid(self.lo, self.hi)

    def copies_of(self, box: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) in ``copies`` of the shards of each box on each rank (empty where none)."""
        key = self.key(box, rank)
        start = np.searchsorted(self.copy_key, key, side="left")
        stop = np.where(key >= 0, np.searchsorted(self.copy_key, key, side="right"), start)
        return start, stop

    def shards_on(self, rank: int) -> np.ndarray:
        """Indices of the non-empty shards on ``rank``, ascending."""
        a, b = np.searchsorted(self.rank_sorted, [rank, rank + 1])
        own = self.by_rank[a:b]
        return own[self.box_of[own] >= 0]

    def query(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every (query q, box b) where box b meets the non-empty region ``[lo[q], hi[q])``."""
        if self.grid is None:
            return _boxes.intersect_pairs(lo, hi, self.lo, self.hi)
        return _grid_query(self.grid, lo, hi)


@cached(256)
def index(layout: Layout) -> Index:
    """The cached ``Index`` of ``layout`` (O(n log n) once per layout)."""
    first, idx, box = groups(layout)
    ranks, code = np.unique(layout.columns.rank, return_inverse=True)
    code = code.reshape(-1)
    n_ranks = max(len(ranks), 1)
    order = np.lexsort((idx, code[idx], box))
    copies = idx[order]
    copy_key = box[order] * n_ranks + code[copies]
    new = np.r_[True, copy_key[1:] != copy_key[:-1]] if len(copy_key) else np.zeros(0, bool)
    held, lowest = copy_key[new], copies[new]
    held_box = held // n_ranks
    n_boxes = len(first)
    count = np.bincount(held_box, minlength=n_boxes)
    copy_count = np.bincount(box, minlength=n_boxes)
    box_of = np.full(len(layout.columns.rank), -1, np.int64)
    box_of[idx] = box
    lo = layout.columns.lo[first]
    hi = lo + layout.columns.sz[first]
    by_rank = np.argsort(layout.columns.rank, kind="stable")
    return Index(
        lo=lo,
        hi=hi,
        box_of=box_of,
        ranks=ranks,
        held=held,
        holder=ranks[held % n_ranks] if len(ranks) else held,
        first=lowest,
        start=np.cumsum(count) - count,
        count=count,
        copies=copies,
        copy_key=copy_key,
        copy_start=np.cumsum(copy_count) - copy_count,
        copy_count=copy_count,
        by_rank=by_rank,
        rank_sorted=layout.columns.rank[by_rank],
    )


def _grid(lo: np.ndarray, hi: np.ndarray) -> _Grid | None:
    """The grid of the boxes when each dim's distinct intervals are disjoint and the cells are few."""
    n, d = lo.shape
    los: list[np.ndarray] = []
    his: list[np.ndarray] = []
    cell_of: list[np.ndarray] = []
    for k in range(d):
        first, inverse = _boxes.unique_rows(np.c_[lo[:, k], hi[:, k]])
        a, b = lo[first, k], hi[first, k]
        if (b[:-1] > a[1:]).any():  # intervals overlap: not one partition
            return None
        los.append(a)
        his.append(b)
        cell_of.append(inverse)
    sides = [len(a) for a in los]
    cells = 1
    for s in sides:
        cells *= s
    if cells > 2 * n + 1:
        return None
    strides = [1] * d
    for k in range(d - 2, -1, -1):
        strides[k] = strides[k + 1] * sides[k + 1]
    flat = np.zeros(n, np.int64)
    for k in range(d):
        flat += cell_of[k] * strides[k]
    cell = np.full(cells, -1, np.int64)
    cell[flat] = np.arange(n)
    return _Grid(tuple(los), tuple(his), tuple(strides), cell)


def _grid_query(g: _Grid, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Index.query`` on a grid: per dim, the run of intervals that a region meets, then their product."""
    n, d = cast("tuple[int, int]", lo.shape)
    first = [np.searchsorted(g.his[k], lo[:, k], side="right") for k in range(d)]
    runs = [np.maximum(np.searchsorted(g.los[k], hi[:, k], side="left") - first[k], 0) for k in range(d)]
    total = np.ones(n, np.int64)
    for r in runs:
        total *= r
    q = np.repeat(np.arange(n), total)
    rest = np.arange(q.size) - np.repeat(np.cumsum(total) - total, total)
    cell = np.zeros(q.size, np.int64)
    for k in range(d - 1, -1, -1):
        side = runs[k][q]
        cell += (first[k][q] + rest % side) * g.strides[k]
        rest //= side
    box = g.cell[cell]
    keep = box >= 0
    return q[keep], box[keep]


def pieces(mine: Index, other: Index, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(own box, other box, lo, size) of every non-empty intersection of ``boxes`` of ``mine`` with ``other``."""
    q, b = other.query(mine.lo[boxes], mine.hi[boxes])
    a = boxes[q]
    lo = np.maximum(mine.lo[a], other.lo[b])
    return a, b, lo, np.minimum(mine.hi[a], other.hi[b]) - lo


def expand(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, k) for k in range(count[row]) of every row."""
    row = np.repeat(np.arange(len(count)), count)
    return row, np.arange(row.size) - np.repeat(np.cumsum(count) - count, count)
