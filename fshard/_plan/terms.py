r"""The ``make`` rule into a partial layout whose summands have replicas (``Layout.terms``).

A value becomes a pending reduction by putting it into one summand and the identity into
the others. When a summand has replicas, the value must reach every rank that holds one,
so the rule picks, per piece (a source box ``u`` meets a destination box ``v``), the group
of summands of ``v`` (``fshard._layout.summands``) whose ranks E hold the fewest copies that
the source ranks S lack: the cost |E \ S| is the lower bound. Among groups of least cost,
the first that S meets (groups ordered by lowest rank); where S meets none, the one at
position (u + v) mod (their number). Each rank of E takes the value into the copies of the
group's first summand: from its own copy of ``u`` where it holds one, else from the holder
of ``u`` at position (p + u + v) mod |S|, p its position in E.

The rows of a piece depend on the piece alone, so a rank finds its own from its own boxes.
"""

from __future__ import annotations

import numpy as np

from fshard._base.boxes import unique_rows
from fshard._layout.index import expand, index, pieces
from fshard._layout.layout import Layout
from fshard._layout.summands import summands
from fshard._plan.routing import copy_on, shared_holders

__all__ = ["make_choice", "make_rank", "make_rows"]


def make_choice(src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Per piece (u, v): the group of summands of ``v`` that takes the value, and its cost |E \ S|."""
    si, di, ds = index(src), index(dst), summands(dst)
    n, width = len(u), max(len(ds.count), 1)
    pair, rank = shared_holders(si, di, u, v)
    keys, counts = np.unique(pair * width + ds.group_of[di.find(v[pair], rank)], return_counts=True)
    row, t = expand(ds.groups[v])
    group = ds.first[v[row]] + t
    want = row * width + group
    shared = np.zeros(len(row), np.int64)
    if len(keys):
        at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
        shared = np.where(keys[at] == want, counts[at], 0)
    cost = ds.count[group] - shared
    best = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(best, row, cost)
    least = np.flatnonzero(cost == best[row])
    first_met = np.full(n, -1, np.int64)
    met = least[shared[least] > 0][::-1]
    first_met[row[met]] = met  # written last: the first such group of each piece
    count = np.bincount(row[least], minlength=n)
    start = np.cumsum(count) - count
    turn = least[start + (u + v) % np.maximum(count, 1)] if len(least) else np.zeros(n, np.int64)
    return group[np.where(first_met >= 0, first_met, turn)], best


def make_rows(src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of the pieces (u, v): (piece, source shard, destination shard)."""
    si, di, ds = index(src), index(dst), summands(dst)
    group, _ = make_choice(src, dst, u, v)
    r, p = expand(ds.count[group])
    rank = ds.holder[ds.start[group[r]] + p]
    r2, j = ds.take(di.find(v[r], rank))
    r, p, rank = r[r2], p[r2], rank[r2]
    uu = u[r]
    here = np.flatnonzero(si.find(uu, rank) >= 0)
    away = np.flatnonzero(si.find(uu, rank) < 0)
    i = np.empty(len(r), np.int64)
    i[here] = copy_on(src, si, uu[here], rank[here], dst, j[here])
    turn = p[away] + uu[away] + v[r[away]]
    i[away] = si.first[si.start[uu[away]] + turn % si.count[uu[away]]]
    return r, i, j


def make_rank(src: Layout, dst: Layout, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """This rank's rows (source shard, destination shard, lo, size): those of the pieces of its own boxes."""
    si, di = index(src), index(dst)
    a = pieces(si, di, np.unique(si.box_of[si.shards_on(rank)]))
    b = pieces(di, si, np.unique(di.box_of[di.shards_on(rank)]))
    u, v = np.r_[a[0], b[1]], np.r_[a[1], b[0]]
    lo, size = np.concatenate([a[2], b[2]]), np.concatenate([a[3], b[3]])
    first, _ = unique_rows(np.c_[u, v])  # a piece of two own boxes once
    u, v, lo, size = u[first], v[first], lo[first], size[first]
    r, i, j = make_rows(src, dst, u, v)
    mine = np.flatnonzero((src.columns.rank[i] == rank) | (dst.columns.rank[j] == rank))
    r, i, j = r[mine], i[mine], j[mine]
    return i, j, lo[r], size[r]
