"""Summand terms of a pending reduction: which copies of a box are replicas of one summand.

A partial layout (``Layout.partial``) may carry a ``terms`` column, one int per shard.
Copies of one box with the same term are replicas of one summand and hold equal data;
copies with different terms are different summands. Without the column every copy is a
summand of its own. ``fshard.Partial(Named(...), over=axes)`` makes one: the copies along
``axes`` are summands, those along the other unused mesh axes replicas.

The column is kept canonical, so that layouts that mean the same compare equal: a term is
renumbered as the order in which its box's summands first appear (0, 1, ...), an empty
shard (which holds nothing) is a summand of its own, and a column in which no two copies
are replicas is dropped (``None``). Everything here is numpy, O(n log n) for n shards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fshard._base import boxes as _boxes
from fshard._errors import LayoutError

__all__ = ["canonical_terms"]

# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false


def canonical_terms(
    values: Any, lo: np.ndarray, sz: np.ndarray, rank: np.ndarray, partial: str | None
) -> np.ndarray | None:
    """The canonical, read-only terms column for shards ``(lo, sz, rank)``, or ``None`` (every copy a summand).

    >>> lo, sz = np.zeros((4, 1), np.int64), np.full((4, 1), 3)
    >>> canonical_terms([7, 5, 7, 5], lo, sz, np.arange(4), "sum").tolist()
    [0, 1, 0, 1]
    >>> canonical_terms([0, 1, 2, 3], lo, sz, np.arange(4), "sum") is None
    True

    Raises:
        LayoutError: a column without a pending reduction, of the wrong length or type, or
            one where two summands of a box share a rank but not all their ranks.
    """
    if values is None:
        return None
    if partial is None:
        msg = (
            "Layout terms= marks the summands of a pending reduction, but partial is None: give "
            "partial='sum' (or 'max', 'min'), or drop terms."
        )
        raise LayoutError(msg)
    n = len(rank)
    column = _column(values, n)
    nonempty = _boxes.rows_all(sz > 0)
    _, box = _boxes.unique_rows(np.c_[lo, sz])
    # An empty shard holds nothing: it is a summand of its own, whatever its term.
    alone = np.where(nonempty, -1, np.arange(n))
    first, group = _boxes.unique_rows(np.c_[box, alone, np.where(nonempty, column, 0)])
    if len(first) == n:
        return None
    # Number each box's summands in the order they first appear.
    order = np.lexsort((first, box[first]))
    runs = np.r_[True, box[first][order[1:]] != box[first][order[:-1]]] if len(order) else np.zeros(0, bool)
    start = np.maximum.accumulate(np.where(runs, np.arange(len(order)), 0))
    ordinal = np.empty(len(first), np.int64)
    ordinal[order] = np.arange(len(order)) - start
    out = ordinal[group]
    _check_replicas(box, out, rank, nonempty, lo, sz)
    out.setflags(write=False)
    return out


def _column(values: Any, n: int) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"Layout terms must be one int per shard, got {values!r}: {exc}") from None
    if arr.size == 0 and arr.ndim == 1:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or len(arr) != n or arr.dtype.kind not in "iu":
        what = f"dtype {arr.dtype}" if arr.ndim == 1 and len(arr) == n else f"shape {arr.shape}"
        msg = f"Layout terms must be one int per shard ({n} of them), got {what}: {values!r}."
        raise LayoutError(msg[:400])
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > 2**63 - 1:
        raise LayoutError(f"Layout terms must fit in int64, got {int(arr.max())}.")
    return arr.astype(np.int64)


def _check_replicas(
    box: np.ndarray, term: np.ndarray, rank: np.ndarray, nonempty: np.ndarray, lo: np.ndarray, sz: np.ndarray
) -> None:
    """Raises unless any two summands of a box that share a rank are held by exactly the same ranks.

    Then a rank's copies of a box belong to one group of summands with one set of ranks, and
    a reduction reads each group from one rank: the fewest elements sent is known in closed
    form. Checked in O(n log n): each summand's ranks against those of its *leader* (the
    lowest summand held by its lowest rank), and every rank of a summand against the leader
    of the lowest summand it holds there.
    """
    idx = np.flatnonzero(nonempty)
    if not len(idx):
        return
    first, g = _boxes.unique_rows(np.c_[box[idx], term[idx]])
    pairs, _ = _boxes.unique_rows(np.c_[g, rank[idx]])
    order = np.lexsort((rank[idx][pairs], g[pairs]))
    gp, rp = g[pairs][order], rank[idx][pairs][order]  # (summand, rank), sorted
    count = np.bincount(gp, minlength=len(first))
    start = np.cumsum(count) - count
    lowest_at, at = _boxes.unique_rows(np.c_[box[idx][first][gp], rp])
    lowest = gp[lowest_at][at]  # per (summand, rank): the lowest summand of the box on that rank
    leader = lowest[start]
    same = count == count[leader]
    walk = np.where(same, count, 0)
    row = np.repeat(np.arange(len(first)), walk)
    k = np.arange(row.size) - np.repeat(np.cumsum(walk) - walk, walk)
    differ = np.unique(row[rp[start[row] + k] != rp[start[leader[row]] + k]])
    bad = np.flatnonzero(~same)
    if bad.size or differ.size:
        a = int(bad[0]) if bad.size else int(differ[0])
        _raise(a, int(leader[a]), gp, rp, start, count, idx[first], term, lo, sz)
    mixed = np.flatnonzero(leader[lowest] != leader[gp])
    if mixed.size:
        e = int(mixed[0])
        _raise(int(gp[e]), int(lowest[e]), gp, rp, start, count, idx[first], term, lo, sz)


def _raise(
    a: int,
    b: int,
    gp: np.ndarray,
    rp: np.ndarray,
    start: np.ndarray,
    count: np.ndarray,
    shard: np.ndarray,
    term: np.ndarray,
    lo: np.ndarray,
    sz: np.ndarray,
) -> None:
    def ranks(g: int) -> str:
        held = rp[start[g] : start[g] + count[g]].tolist()
        return str(held[:8])[:-1] + (", ...]" if len(held) > 8 else "]")

    s = int(shard[a])
    msg = (
        f"Layout terms: on box [offsets {tuple(lo[s].tolist())}, sizes {tuple(sz[s].tolist())}], summand "
        f"{int(term[s])} is held by ranks {ranks(a)} and summand {int(term[int(shard[b])])} by ranks {ranks(b)}: "
        "summands of a box that share a rank must be held by the same ranks. Give such copies one term, "
        "or place the summands on different ranks."
    )
    raise LayoutError(msg)
