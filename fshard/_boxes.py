"""Vectorised geometry on axis-aligned integer boxes (numpy), shared by layouts and plans."""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["corner_sums", "count_containing", "intersect_pairs", "unique_rows"]


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (index of the first occurrence of each distinct row, inverse map) in O(n log n)."""
    n = rows.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(rows.T[::-1]) if rows.shape[1] else np.arange(n)
    srt = rows[order]
    new = np.ones(n, bool)
    if rows.shape[1]:
        new[1:] = (srt[1:] != srt[:-1]).any(axis=1)
    else:
        new[1:] = False
    group = np.cumsum(new) - 1
    inverse = np.empty(n, np.int64)
    inverse[order] = group
    first = np.full(int(group[-1]) + 1, n, np.int64)
    np.minimum.at(first, group, order)
    return first, inverse


def _point_keys(points: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Encodes integer points with 0 <= p <= bounds as sortable keys (rows when too large)."""
    radix = bounds.astype(object) + 1
    if int(np.prod(radix)) < 2**62:
        strides = np.cumprod(np.concatenate([[1], (bounds + 1)[::-1][:-1]]))[::-1]
        return points @ strides.astype(np.int64)
    return points


def corner_sums(lo: np.ndarray, hi: np.ndarray, bounds: np.ndarray) -> dict[tuple[int, ...], int]:
    """The signed corner measure of a union of boxes: sum over boxes of +-1 at each corner.

    Two families of boxes have equal indicator sums iff their corner measures are equal
    (the mixed difference operator is injective), so comparing with the corners of the
    full shape checks "no overlap and no gap" exactly, in O(n 2^d log n).
    """
    n, d = lo.shape
    pts, signs = [], []
    for e in itertools.product((0, 1), repeat=d):
        mask = np.array(e, bool)
        pts.append(np.where(mask, hi, lo))
        signs.append(np.full(n, -1 if sum(e) % 2 else 1, np.int64))
    points = np.concatenate(pts) if pts else np.zeros((0, d), np.int64)
    sign = np.concatenate(signs) if signs else np.zeros(0, np.int64)
    keys = _point_keys(points, bounds)
    if keys.ndim == 1:
        order = np.argsort(keys, kind="stable")
        k = keys[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if k.size else np.zeros(0, int)
    else:
        first, inverse = unique_rows(keys)
        order = np.argsort(inverse, kind="stable")
        k = inverse[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if k.size else np.zeros(0, int)
    if not starts.size:
        return {}
    sums = np.add.reduceat(sign[order], starts)
    nz = np.flatnonzero(sums)
    where = points[order][starts[nz]]
    return {tuple(int(v) for v in p): int(s) for p, s in zip(where, sums[nz])}


def count_containing(lo: np.ndarray, hi: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Indices of the boxes [lo, hi) that contain ``point``."""
    return np.flatnonzero(((lo <= point) & (point < hi)).all(axis=1))


def intersect_pairs(
    lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """All pairs (i, j) whose boxes a[i] and b[j] share at least one element.

    A sort-and-sweep join along the most selective dimension, then a vectorised
    filter on the others; never all pairs of boxes.
    """
    na, nb = lo_a.shape[0], lo_b.shape[0]
    empty = np.zeros(0, np.int64)
    if na == 0 or nb == 0:
        return empty, empty
    d = lo_a.shape[1]
    if d == 0:
        ia, ib = np.meshgrid(np.arange(na), np.arange(nb), indexing="ij")
        return ia.ravel(), ib.ravel()
    best_count, best_ranges = None, None
    for dim in range(d):
        ranges = _sweep_ranges(lo_a[:, dim], hi_a[:, dim], lo_b[:, dim], hi_b[:, dim])
        count = int((ranges[2] - ranges[1]).sum())
        if best_count is None or count < best_count:
            best_count, best_ranges = count, ranges
    assert best_ranges is not None
    order, start, stop = best_ranges
    ib = np.repeat(np.arange(nb), stop - start)
    pos = np.arange(ib.size) - np.repeat(np.cumsum(stop - start) - (stop - start), stop - start)
    ia = order[np.repeat(start, stop - start) + pos]
    keep = ((lo_a[ia] < hi_b[ib]) & (lo_b[ib] < hi_a[ia])).all(axis=1)
    return ia[keep], ib[keep]


def _sweep_ranges(
    lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each b interval, the range in a (sorted by lo) of candidates with lo_a < hi_b.

    Candidates are further restricted to a-intervals whose start is at or after the
    earliest start among a-intervals still open at lo_b (a running max of hi_a).
    """
    order = np.argsort(lo_a, kind="stable")
    slo, shi = lo_a[order], hi_a[order]
    stop = np.searchsorted(slo, hi_b, side="left")
    # First a (in lo order) that can still reach lo_b: hi_a > lo_b. With a running
    # maximum of hi over the sorted a, it is the first position whose max exceeds lo_b.
    running = np.maximum.accumulate(shi)
    start = np.searchsorted(running, lo_b, side="right")
    start = np.minimum(start, stop)
    return order, start, stop
