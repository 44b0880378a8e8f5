"""Plans between layouts with pending reductions (``Layout.partial``).

A *reduce phase* is a ``Plan`` with ``op`` set: its rows are contributions, and each
destination region receives the ``op`` of every contribution aimed at it (a region
that none reaches holds the identity: 0 for a sum). Contributions from one rank to
one region on another rank are combined on the sender first and sent once.

- partial -> non-partial: each element's summands (on ranks S) go to one owner
  (a rank of the destination D that holds a summand when there is one), which
  reduces them; when the destination replicates the element, the owner then sends
  the result to the other ranks of D. The reduction is split among the candidate
  owners (reduce-scatter then all-gather), and the plan holds the two phases.
  Elements sent per element: |S| + |D| - 2 when S and D share a rank, else
  |S| + |D| - 1, which is the lower bound (see ``lower_bound``).
- partial -> partial (same op): a summand stays on its rank when that rank holds a
  copy in the destination, else it goes to one destination copy: |S \\ D| per element.
- non-partial -> partial: one copy of each element holds the value (the identity
  elsewhere), taken from a rank that holds it where possible: 0 or 1 per element.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fshard import _boxes
from fshard._cache import cached
from fshard._layout import Layout, ShardMeta, with_partial
from fshard._plan import Plan, _groups, chain, plan
from fshard._specs import chunk_bounds

__all__ = ["build", "lower_bound"]


@dataclasses.dataclass(frozen=True)
class _Boxes:
    """The distinct non-empty boxes of a layout, their copies (shard indices) and ranks."""

    lo: np.ndarray
    hi: np.ndarray
    copies: tuple[tuple[int, ...], ...]
    ranks: tuple[frozenset[int], ...]


@cached(256)
def _boxes_of(layout: Layout) -> _Boxes:
    first, idx, inverse = _groups(layout)
    copies: list[list[int]] = [[] for _ in range(len(first))]
    for i, b in zip(idx.tolist(), inverse.tolist()):
        copies[b].append(i)
    rank = layout._rank.tolist()
    lo = layout._lo[first]
    return _Boxes(
        lo,
        lo + layout._sz[first],
        tuple(tuple(c) for c in copies),
        tuple(frozenset(rank[i] for i in c) for c in copies),
    )


def _regions(src: Layout, dst: Layout) -> tuple[_Boxes, _Boxes, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every non-empty intersection of a distinct source box ``u`` and a distinct destination box ``v``."""
    s, d = _boxes_of(src), _boxes_of(dst)
    u, v = _boxes.intersect_pairs(s.lo, s.hi, d.lo, d.hi)
    lo = np.maximum(s.lo[u], d.lo[v])
    return s, d, u, v, lo, np.minimum(s.hi[u], d.hi[v]) - lo


def lower_bound(src: Layout, dst: Layout) -> int:
    """The fewest elements any schedule must send to turn ``src`` into ``dst``.

    Per element with source ranks S (summands, or replicas of a value) and destination
    ranks D: a partial source needs every summand rank but one to send, and every
    destination rank but one to receive after the reduction is complete, so
    |S| + |D| - 1 - [S and D meet] (the bandwidth-optimal all-reduce sends 2(n - 1)
    per element); a non-partial source needs |D \\ S|; to a partial destination of the
    same op, |S \\ D| for a partial source and [S and D are disjoint] for a value.
    """
    s, d, u, v, _, size = _regions(src, dst)
    numel = _boxes.rows_prod(size).tolist()
    total = 0
    for k, (a, b) in enumerate(zip(u.tolist(), v.tolist())):
        S, D = s.ranks[a], d.ranks[b]
        if src.partial is None:
            need = len(D - S) if dst.partial is None else int(not S & D)
        elif dst.partial == src.partial:
            need = len(S - D)
        elif dst.partial is None:
            need = len(S) + len(D) - 1 - int(bool(S & D))
        else:  # another op: reduce at one destination rank, which keeps the result
            need = len(S) - int(bool(S & D))
        total += need * numel[k]
    return total


def build(src: Layout, dst: Layout) -> Plan:
    """The plan from ``src`` to ``dst`` when either carries a pending reduction."""

    if src.partial is None:
        return _make_partial(src, dst)
    if dst.partial == src.partial:
        return _regroup(src, dst)
    if dst.partial is None:
        return _reduce(src, dst)
    owners = _owners(src, with_partial(dst, None))
    return chain(src, dst, (_reduce_to(src, owners), _make_partial(owners, dst)), lower_bound(src, dst))


def _phase(
    src: Layout, dst: Layout, rows: list[tuple[int, int, list[int], list[int]]], op: str | None, bound: int = 0
) -> Plan:
    """A reduce phase from rows (source shard, destination shard, lo, size), in canonical order.

    Contributions to one destination region come from its own rank first, then by
    rank: both backends reduce in that order.
    """

    d = len(src.shape)
    if rows:
        s_shard = np.array([r[0] for r in rows], np.int64)
        d_shard = np.array([r[1] for r in rows], np.int64)
        lo = np.array([r[2] for r in rows], np.int64).reshape(len(rows), d)
        size = np.array([r[3] for r in rows], np.int64).reshape(len(rows), d)
    else:
        s_shard = d_shard = np.zeros(0, np.int64)
        lo = size = np.zeros((0, d), np.int64)
    s_rank, d_rank = src._rank[s_shard], dst._rank[d_shard]
    # np.lexsort: the last key is the primary one.
    order = np.lexsort((s_shard, s_rank, s_rank != d_rank, *(lo[:, k] for k in range(d - 1, -1, -1)), d_shard))
    arrays = [s_shard[order], d_shard[order], lo[order], size[order]]
    for a in arrays:
        a.setflags(write=False)
    return Plan(src, dst, *arrays, min_elements_sent=bound, op=op)


def _reduce(src: Layout, dst: Layout) -> Plan:
    """Partial ``src`` to non-partial ``dst``: reduce at one owner per element, then copy to the replicas."""

    if all(len(r) == 1 for r in _boxes_of(dst).ranks):  # each element has one owner already
        return _reduce_to(src, dst, lower_bound(src, dst))
    owners = _owners(src, dst)
    return chain(src, dst, (_reduce_to(src, owners), plan(owners, dst)), lower_bound(src, dst))


def _reduce_to(src: Layout, dst: Layout, bound: int = 0) -> Plan:
    """One reduce phase: every summand of a region to every copy of it in ``dst`` (one rank per box)."""
    s, d, u, v, lo, size = _regions(src, dst)
    rows = [
        (i, j, lo[k].tolist(), size[k].tolist())
        for k, (a, b) in enumerate(zip(u.tolist(), v.tolist()))
        for i in s.copies[a]
        for j in d.copies[b]
    ]
    return _phase(src, dst, rows, src.partial, bound)


def _owners(src: Layout, dst: Layout) -> Layout:
    """A non-partial layout with one copy of each element, on the rank that will reduce it.

    Each region's candidates are the destination ranks that hold a summand (else all
    destination ranks); the region is split along its longest dim among them, starting
    at a rotating candidate, so the reduction work spreads as in a reduce-scatter.
    """
    s, d, u, v, lo, size = _regions(src, dst)
    placement_on = {}
    for b, copies in enumerate(d.copies):
        for j in copies:
            placement_on.setdefault((b, int(dst._rank[j])), dst.shards[j].placement)
    shards = []
    for k, (a, b) in enumerate(zip(u.tolist(), v.tolist())):
        cand = sorted(s.ranks[a] & d.ranks[b]) or sorted(d.ranks[b])
        rlo, rsz = lo[k].tolist(), size[k].tolist()
        dim = int(np.argmax(rsz)) if rsz else 0
        parts = chunk_bounds(rsz[dim], len(cand)) if rsz else [(0, 1)]
        for t, (off, n) in enumerate(parts):
            if n == 0:
                continue
            owner = cand[(t + k) % len(cand)]
            plo, psz = list(rlo), list(rsz)
            if rsz:
                plo[dim], psz[dim] = rlo[dim] + off, n
            shards.append(ShardMeta(tuple(plo), tuple(psz), placement_on[(b, owner)]))
    return Layout(dst.shape, tuple(shards))


def _regroup(src: Layout, dst: Layout) -> Plan:
    """Partial to partial, same op: a summand stays where its rank holds a destination copy."""
    s, d, u, v, lo, size = _regions(src, dst)
    rows = []
    for k, (a, b) in enumerate(zip(u.tolist(), v.tolist())):
        by_rank = _copies_by_rank(dst, d.copies[b])
        ranks = sorted(by_rank)
        for i in s.copies[a]:
            r = int(src._rank[i])
            j = _same_device(src, dst, i, by_rank[r]) if r in by_rank else by_rank[ranks[(k + r) % len(ranks)]][0]
            rows.append((i, j, lo[k].tolist(), size[k].tolist()))
    return _phase(src, dst, rows, dst.partial, lower_bound(src, dst))


def _make_partial(src: Layout, dst: Layout) -> Plan:
    """A value to a partial layout: one destination copy per element holds it, from a local replica if any."""

    full = plan(src, with_partial(dst, None))
    s_rank, d_rank = full.src_rank, full.dst_rank
    box = _box_index(dst)[full.dst_shard]
    # One row per (destination box, piece): a row whose source is on its rank if there is one.
    order = np.lexsort((full.dst_shard, s_rank != d_rank, *(full.lo[:, k] for k in range(dst.ndim - 1, -1, -1)), box))
    keys = np.c_[box, full.lo][order]
    keep = order[np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]] if len(order) else order
    rows = [
        (i, j, lo, sz)
        for i, j, lo, sz in zip(
            full.src_shard[keep].tolist(),
            full.dst_shard[keep].tolist(),
            full.lo[keep].tolist(),
            full.size[keep].tolist(),
        )
    ]
    return _phase(src, dst, rows, dst.partial, lower_bound(src, dst))


@cached(256)
def _box_index(layout: Layout) -> np.ndarray:
    """The distinct-box number of each shard (-1 for empty shards)."""
    out = np.full(len(layout.shards), -1, np.int64)
    for b, copies in enumerate(_boxes_of(layout).copies):
        out[list(copies)] = b
    return out


def _copies_by_rank(layout: Layout, copies: tuple[int, ...]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j in copies:
        out.setdefault(int(layout._rank[j]), []).append(j)
    return out


def _same_device(src: Layout, dst: Layout, i: int, candidates: list[int]) -> int:
    device = src.shards[i].placement.device
    return next((j for j in candidates if dst.shards[j].placement.device == device), candidates[0])
