"""Vectorised geometry on axis-aligned integer boxes (numpy), shared by layouts and plans.

A box is a row of ``lo`` and a row of ``hi`` (exclusive); a box with a zero extent is
empty. Everything here is O(n log n) in the number of boxes (plus the output size):
nothing compares all pairs of boxes.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = [
    "corner_sums",
    "count_containing",
    "intersect_pairs",
    "row_keys",
    "rows_all",
    "rows_any",
    "rows_prod",
    "unique_rows",
]

_INT64_LIMIT = 2**63 - 1
# Extent classes allowed per box (on average) before extents are rounded into fewer classes.
_CLASS_BUDGET = 4
_CLASS_SLACK = 4096


def rows_all(mask: np.ndarray) -> np.ndarray:
    """``mask.all(axis=1)`` for a 2-D mask, column by column.

    Numpy's reduction over a short inner axis is over ten times slower.

    >>> rows_all(np.array([[True, True], [True, False]])).tolist()
    [True, False]
    """
    out = np.ones(mask.shape[0], bool)
    for k in range(mask.shape[1]):
        out &= mask[:, k]
    return out


def rows_any(mask: np.ndarray) -> np.ndarray:
    """``mask.any(axis=1)``, computed like ``rows_all``."""
    out = np.zeros(mask.shape[0], bool)
    for k in range(mask.shape[1]):
        out |= mask[:, k]
    return out


def rows_prod(values: np.ndarray) -> np.ndarray:
    """``values.prod(axis=1)`` in int64 (1 for zero columns), computed like ``rows_all``.

    >>> rows_prod(np.array([[2, 3], [4, 0]])).tolist()
    [6, 0]
    """
    out = np.ones(values.shape[0], np.int64)
    for k in range(values.shape[1]):
        out *= values[:, k]
    return out


def row_keys(rows: np.ndarray) -> np.ndarray | None:
    """One int64 per row, ordered like the rows (lexicographically), or ``None`` if they overflow.

    >>> row_keys(np.array([[1, 5], [0, 7], [1, 2]])).tolist()
    [9, 5, 6]
    """
    n, m = rows.shape
    if n == 0 or m == 0:
        return np.zeros(n, np.int64)
    # Column by column: numpy's reductions and matmul over a short inner axis are slow.
    columns = [rows[:, k].astype(np.int64, copy=False) for k in range(m)]
    low = [int(c.min()) for c in columns]
    # In Python ints: ``max - min + 1`` overflows int64 for coordinates near 2**63.
    radix = [int(c.max()) - bottom + 1 for c, bottom in zip(columns, low)]
    if _product(radix) > _INT64_LIMIT:
        return None
    out = columns[0] - low[0]
    for c, bottom, r in zip(columns[1:], low[1:], radix[1:]):
        out = out * r + (c - bottom)
    return out


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first occurrence of each distinct row, inverse map), rows in sorted order.

    >>> first, inverse = unique_rows(np.array([[2, 0], [1, 1], [2, 0]]))
    >>> first.tolist(), inverse.tolist()
    ([1, 0], [1, 0, 1])
    """
    n = rows.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = row_keys(rows)
    if keys is None:
        order = np.lexsort(rows.T[::-1])
        new = np.r_[True, rows_any(rows[order[1:]] != rows[order[:-1]])]
    else:
        # An unstable sort is several times faster; reduceat then finds each group's first index.
        order = np.argsort(keys)
        srt = keys[order]
        new = np.r_[True, srt[1:] != srt[:-1]]
    group = np.cumsum(new) - 1
    inverse = np.empty(n, np.int64)
    inverse[order] = group
    first = np.minimum.reduceat(order, np.flatnonzero(new))
    return first, inverse


def corner_sums(lo: np.ndarray, hi: np.ndarray, bounds: np.ndarray) -> dict[tuple[int, ...], int]:
    """The signed corner measure of boxes inside ``[0, bounds]``: +-1 at each corner, summed per point.

    Two families of boxes have equal indicator sums iff their corner measures are equal
    (the mixed difference operator is injective), so comparing with the corners of the
    full shape checks "no overlap and no gap" exactly, in O(n 2^d log n).

    >>> corner_sums(np.array([[0], [2]]), np.array([[2], [5]]), np.array([5]))
    {(0,): 1, (5,): -1}
    """
    n, d = lo.shape
    corners = list(itertools.product((0, 1), repeat=d))
    points = np.concatenate([np.where(np.array(e, bool), hi, lo) for e in corners])
    sign = np.repeat(np.array([1 - 2 * (sum(e) % 2) for e in corners], np.int64), n)
    radix = [int(b) + 1 for b in bounds]
    if _product(radix) > _INT64_LIMIT or not points.size:  # also d == 0
        return _sparse_sums(points, sign)
    where, values = _sum_by_key(np.asarray(np.ravel_multi_index(tuple(points.T), radix)), sign, _product(radix))
    coords = np.stack(np.unravel_index(where, radix), axis=1)
    return {tuple(p): int(s) for p, s in zip(coords.tolist(), values.tolist())}


def _sum_by_key(keys: np.ndarray, sign: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys whose signs do not cancel, and their sums."""
    if n_keys <= max(4 * len(keys), 1 << 16):
        # Few possible corners (a dense grid of shards): count them directly, no sort.
        sums = np.rint(np.bincount(keys, weights=sign, minlength=n_keys)).astype(np.int64)
        where = np.flatnonzero(sums)
        return where, sums[where]
    uniq, inverse = np.unique(keys, return_inverse=True)
    sums = np.rint(np.bincount(inverse.ravel(), weights=sign, minlength=len(uniq))).astype(np.int64)
    nz = np.flatnonzero(sums)
    return uniq[nz], sums[nz]


def _sparse_sums(points: np.ndarray, sign: np.ndarray) -> dict[tuple[int, ...], int]:
    """``corner_sums`` for points too large to encode as one int64 each."""
    if not len(points):
        return {}
    first, inverse = unique_rows(points)
    sums = np.bincount(inverse, weights=sign, minlength=len(first))
    nz = np.flatnonzero(sums)
    return {tuple(p): int(s) for p, s in zip(points[first[nz]].tolist(), np.rint(sums[nz]).astype(np.int64).tolist())}


def count_containing(lo: np.ndarray, hi: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Indices of the boxes [lo, hi) that contain ``point``.

    >>> count_containing(np.array([[0], [2]]), np.array([[2], [4]]), np.array([3])).tolist()
    [1]
    """
    return np.flatnonzero(rows_all((lo <= point) & (point < hi)))


def intersect_pairs(
    lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """All pairs (i, j) whose boxes a[i] and b[j] share at least one element, sorted by (j, i).

    A hash join of box -> grid-cell incidences: boxes are grouped into classes of
    similar extent, and each pair of classes is joined on a grid whose cells are as
    large as the larger class, so a box touches at most 2 cells per dim. A pair is
    reported only in the cell holding its intersection's low corner, so once. The
    work is O((n + pairs) log n) for sets of disjoint boxes such as layouts.

    >>> lo, hi = np.array([[0, 0], [0, 2]]), np.array([[4, 2], [4, 4]])
    >>> [a.tolist() for a in intersect_pairs(lo, hi, np.array([[1, 1]]), np.array([[3, 3]]))]
    [[0, 1], [0, 0]]
    """
    ia, ib = _nonempty(lo_a, hi_a), _nonempty(lo_b, hi_b)
    if not ia.size or not ib.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if lo_a.shape[1] == 0:  # one element: every box holds it
        return np.tile(ia, ib.size), np.repeat(ib, ia.size)
    origin = np.minimum(lo_a[ia].min(axis=0), lo_b[ib].min(axis=0))
    a = (lo_a[ia] - origin, hi_a[ia] - origin)
    b = (lo_b[ib] - origin, hi_b[ib] - origin)
    pa, pb = _grid_join(a, b)
    order = np.lexsort((pa, pb))
    return ia[pa[order]], ib[pb[order]]


def _nonempty(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.flatnonzero(rows_all(hi > lo))


Boxes = tuple[np.ndarray, np.ndarray]


def _grid_join(a: Boxes, b: Boxes) -> tuple[np.ndarray, np.ndarray]:
    """``intersect_pairs`` for non-empty boxes with non-negative coordinates."""
    (cls_a, size_a), (cls_b, size_b) = _classes(a, b)
    # Cell size of class pair (i, j), pair id i * len(size_b) + j: the larger extent per dim.
    cell = np.maximum(size_a[:, None, :], size_b[None, :, :]).reshape(-1, a[0].shape[1])
    rows_a = np.repeat(np.arange(len(cls_a)), len(size_b))
    pair_a = cls_a[rows_a] * len(size_b) + np.tile(np.arange(len(size_b)), len(cls_a))
    rows_b = np.repeat(np.arange(len(cls_b)), len(size_a))
    pair_b = np.tile(np.arange(len(size_a)), len(cls_b)) * len(size_b) + cls_b[rows_b]
    inc_a, cell_a = _incidences(a, rows_a, cell[pair_a])
    inc_b, cell_b = _incidences(b, rows_b, cell[pair_b])
    span = np.maximum(a[1].max(axis=0), b[1].max(axis=0))
    key_a, key_b = _cell_keys(pair_a[inc_a], cell_a, pair_b[inc_b], cell_b, len(cell), span)
    ka, kb = _equal_keys(key_a, key_b)
    box_a, box_b = rows_a[inc_a[ka]], rows_b[inc_b[kb]]
    lo_a, hi_a, lo_b, hi_b = a[0][box_a], a[1][box_a], b[0][box_b], b[1][box_b]
    meets = rows_all((lo_a < hi_b) & (lo_b < hi_a))
    # Both boxes touch every cell that holds a common element; keep only the low corner's.
    home = rows_all(np.maximum(lo_a, lo_b) // cell[pair_b[inc_b[kb]]] == cell_b[kb])
    keep = meets & home
    return box_a[keep], box_b[keep]


def _classes(a: Boxes, b: Boxes) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Groups each side's boxes by extent: (class of each box, largest extent of each class).

    Exact extents first (a regular layout has one or two); if that makes too many
    class pairs, extents are rounded up to powers of 2, 4, 16, ... until it does not.
    """
    ext_a, ext_b = a[1] - a[0], b[1] - b[0]
    budget = _CLASS_BUDGET * (len(ext_a) + len(ext_b)) + _CLASS_SLACK
    bits = 0
    while True:
        ca, cb = _group(ext_a, bits), _group(ext_b, bits)
        if len(ext_a) * len(cb[1]) + len(ext_b) * len(ca[1]) <= budget or bits >= 64:
            return ca, cb
        bits = max(1, 2 * bits)


def _group(ext: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    if bits:
        # Round each extent up to a power of 2**bits (capped so shifts stay in range).
        length = np.frexp((ext - 1).astype(np.float64))[1].astype(np.int64)
        ext = np.left_shift(np.int64(1), np.minimum(-(-length // bits) * bits, 62))
    first, inverse = unique_rows(ext)
    size = np.zeros((len(first), ext.shape[1]), np.int64)
    np.maximum.at(size, inverse, ext)
    return inverse, size


def _incidences(boxes: Boxes, rows: np.ndarray, cell: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (row, grid cell) with the row's box touching the cell: row indices and cell coordinates."""
    first = boxes[0][rows] // cell
    last = (boxes[1][rows] - 1) // cell
    idx = np.arange(len(rows))
    coords = first
    for k in range(first.shape[1]):
        count = last[idx, k] - coords[:, k] + 1
        if (count == 1).all():
            continue
        rep = np.repeat(np.arange(len(idx)), count)
        step = np.arange(rep.size) - np.repeat(np.cumsum(count) - count, count)
        idx, coords = idx[rep], coords[rep]
        coords[:, k] += step
    return idx, coords


def _cell_keys(
    pair_a: np.ndarray, cell_a: np.ndarray, pair_b: np.ndarray, cell_b: np.ndarray, n_pairs: int, span: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Equal int64 keys for equal (class pair, cell) on either side."""
    radix = [n_pairs, *(int(s) + 1 for s in span)]
    if _product(radix) <= _INT64_LIMIT:
        return (np.ravel_multi_index((pair_a, *cell_a.T), radix), np.ravel_multi_index((pair_b, *cell_b.T), radix))
    _, inverse = unique_rows(np.r_[np.c_[pair_a, cell_a], np.c_[pair_b, cell_b]])
    return inverse[: len(pair_a)], inverse[len(pair_a) :]


def _equal_keys(key_a: np.ndarray, key_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (i, j) with key_a[i] == key_b[j] (a sort-merge equi-join)."""
    order = np.argsort(key_a)
    srt = key_a[order]
    start = np.searchsorted(srt, key_b, side="left")
    count = np.searchsorted(srt, key_b, side="right") - start
    jb = np.repeat(np.arange(len(key_b)), count)
    pos = np.repeat(start - (np.cumsum(count) - count), count) + np.arange(jb.size)
    return order[pos], jb
