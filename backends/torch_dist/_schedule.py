"""This rank's part of a plan: its peers, split sizes and the slices of every box (pure, cached)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fshard._boxes import rows_prod, unique_rows
from fshard._cache import cached
from fshard._layout import Layout
from fshard._plan import Plan

# ``execute`` sends box by box (nothing staged on arrival) when every received box lands
# in place, there are at most this many boxes per pair of ranks on average, and they
# average at least ``_DIRECT_MIN_BYTES``: below that, one all_to_all_single has less
# latency than the separate messages save in copying (Gloo on loopback).
_DIRECT_PIECES_PER_PAIR = 4
_DIRECT_MIN_BYTES = 1 << 20


Index = tuple[int, tuple[slice, ...]]  # a box as (shard, slices into that shard's tensor)
Span = tuple[int, int, int]  # boxes back to back in one shard: (shard, first element, end)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's share of a plan, with every index it needs computed once.

    ``send``/``recv``: per peer in group order, the plan rows of the distinct boxes
    exchanged with it, in plan order (so sender and receiver agree); ``fanout`` maps a
    received row to every row writing the same box into a shard on this rank.
    ``at_src``/``at_dst`` give each sent row's box in its source shard and each received
    (or fanned-out) row's box in its destination shard. ``send_split``/``recv_split``
    count elements per rank of the group; ``send_span``/``recv_span`` say where the sent
    boxes (and the first destination of each received box) lie back to back in one
    shard, so that they need no packing when that shard is a contiguous tensor.
    """

    local: np.ndarray
    send: tuple[tuple[int, np.ndarray], ...]
    recv: tuple[tuple[int, np.ndarray], ...]
    fanout: dict[int, np.ndarray]
    sent: int
    at_src: dict[int, Index]
    at_dst: dict[int, Index]
    send_split: tuple[int, ...]
    recv_split: tuple[int, ...]
    send_span: Span | None
    recv_span: Span | None


@cached(512)
def schedule(p: Plan, me: int, order: tuple[int, ...]) -> Schedule:
    sr, dr = p.src_rank, p.dst_rank
    local = np.flatnonzero((sr == me) & (dr == me))
    cross = np.flatnonzero(sr != dr)
    first, inverse = unique_rows(np.c_[p.src_shard[cross], dr[cross], p.lo[cross], p.size[cross]])
    pieces = np.sort(cross[first])  # unique_rows keeps the earliest row of each group
    position = np.zeros(int(max(sr.max(initial=0), dr.max(initial=0), max(order))) + 1, np.int64)
    position[list(order)] = np.arange(len(order))
    send = _by_peer(pieces[sr[pieces] == me], dr, position)
    recv = _by_peer(pieces[dr[pieces] == me], sr, position)
    mine = cross[dr[cross] == me]
    fanout = {int(rows[0]): rows for rows in _split_by(mine, inverse[dr[cross] == me])}
    numel = p.numel
    send_rows = np.concatenate([rows for _, rows in send]) if send else np.zeros(0, np.int64)
    first_dst = np.array([fanout[k][0] for _, rows in recv for k in rows.tolist()], np.int64)
    return Schedule(
        local=local,
        send=send,
        recv=recv,
        fanout=fanout,
        sent=int(sum(numel[rows].sum() for _, rows in send)),
        at_src=_indices(p, send_rows, "src"),
        at_dst=_indices(p, mine, "dst"),
        send_split=_split(send, numel, position, len(order)),
        recv_split=_split(recv, numel, position, len(order)),
        send_span=_span(p, send_rows, "src"),
        recv_span=_span(p, first_dst, "dst"),
    )


def _side(p: Plan, side: str) -> tuple[Layout, np.ndarray]:
    return (p.src, p.src_shard) if side == "src" else (p.dst, p.dst_shard)


def _indices(p: Plan, rows: np.ndarray, side: str) -> dict[int, Index]:
    """Each row's box as (shard, slices into that shard's tensor)."""
    layout, shard = _side(p, side)
    start = p.lo[rows] - layout._lo[shard[rows]]
    stop = start + p.size[rows]
    return {
        k: (j, tuple(slice(a, b) for a, b in zip(lo, hi)))
        for k, j, lo, hi in zip(rows.tolist(), shard[rows].tolist(), start.tolist(), stop.tolist())
    }


def _split(by_peer: tuple[tuple[int, np.ndarray], ...], numel: np.ndarray, position: np.ndarray,
           n: int) -> tuple[int, ...]:  # fmt: skip
    """Elements exchanged with each rank, in group order."""
    out = [0] * n
    for peer, rows in by_peer:
        out[int(position[peer])] = int(numel[rows].sum())
    return tuple(out)


def _span(p: Plan, rows: np.ndarray, side: str) -> Span | None:
    """(shard, first element, end) when the boxes of ``rows``, in order, are non-empty ranges
    that follow each other in one shard stored contiguously (C order), else ``None``."""
    layout, shard = _side(p, side)
    if not rows.size or np.unique(shard[rows]).size != 1:
        return None
    j = int(shard[rows[0]])
    sizes, size, lo = layout._sz[j], p.size[rows], p.lo[rows] - layout._lo[j]
    if not (size > 0).all():
        return None
    if not sizes.size:  # a 0-d array: one box, its single element
        return (j, 0, 1) if rows.size == 1 else None
    # A range in C order: every extent before some dim is 1, every extent after it is whole.
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = np.arange(size.shape[1])[None, :] > lead[:, None]
    if not (((size == sizes[None, :]) | ~after).all(axis=1) | ~big.any(axis=1)).all():
        return None
    strides = np.ones(len(sizes), np.int64)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    starts, counts = lo @ strides, rows_prod(size)
    if (starts[1:] != starts[:-1] + counts[:-1]).any():
        return None
    return j, int(starts[0]), int(starts[-1] + counts[-1])


def _split_by(rows: np.ndarray, key: np.ndarray) -> list[np.ndarray]:
    """``rows`` grouped by ``key`` (groups in key order, rows kept in order within a group)."""
    o = np.argsort(key, kind="stable")
    k = key[o]
    return np.split(rows[o], np.flatnonzero(k[1:] != k[:-1]) + 1) if rows.size else []


def _by_peer(rows: np.ndarray, peer: np.ndarray, position: np.ndarray) -> tuple[tuple[int, np.ndarray], ...]:
    """``rows`` grouped by their peer rank, peers in group-rank order."""
    return tuple((int(peer[g[0]]), g) for g in _split_by(rows, position[peer[rows]]))


@cached(512)
def all_contiguous(p: Plan) -> bool:
    """Whether every box that crosses ranks is a contiguous range of its destination shard."""
    rows = np.flatnonzero(p.src_rank != p.dst_rank)
    if not rows.size or not p.dst.ndim:
        return True
    shape = p.dst._sz[p.dst_shard[rows]]
    size = p.size[rows]
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = np.arange(p.dst.ndim)[None, :] > lead[:, None]
    return bool((((size == shape) | ~after).all(axis=1) | ~big.any(axis=1)).all())


@cached(512)
def direct(p: Plan, itemsize: int) -> bool:
    """Whether ``execute`` sends box by box: every received box lands in place, and the
    boxes are few and large. Every rank computes the same answer from the same plan."""
    pieces = p._crossing.size
    if not pieces or p.elements_sent * itemsize < _DIRECT_MIN_BYTES * pieces:
        return False
    ranks = int(np.unique(np.r_[p.src._rank, p.dst._rank]).size)
    return pieces <= _DIRECT_PIECES_PER_PAIR * ranks * ranks and all_contiguous(p)


def has_alltoall(backend_name: str) -> bool:
    return any(b in backend_name for b in ("gloo", "nccl", "mpi", "ucc"))
