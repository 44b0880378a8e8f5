"""The transport choices that every rank makes alike, from the two layouts (pure, cached).

A transport choice must be the same on every rank (``all_to_all_single`` needs the
whole group), so ``all_contiguous`` and ``direct`` are computed from per-layout facts
(each layout's distinct boxes, O(shards log shards) in numpy), never from the global
plan, which is O(world^2) rows for an all-to-all reshard. They are sufficient
conditions: where the layouts' facts cannot show that a received box lands in place,
the box counts as staged. See each function for how that compares with reading the rows.

``step`` puts a rank's choices for one copy phase together, once per (phase, rank, group),
so that a repeated call only allocates its outputs and runs the transport.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch

from fshard._base.alloc import new
from fshard._base.boxes import unique_rows
from fshard._base.cache import cached
from fshard._layout.index import index
from fshard._layout.layout import Layout
from fshard._plan import plan
from fshard._plan.direct import Plan

from .._execution import shard_device
from ._lowering import Schedule, schedule
from ._transport import alltoall, messages, p2p

__all__ = ["Step", "all_contiguous", "by_messages", "direct", "has_alltoall", "rows_in_order", "smallest_piece", "step"]

# ``execute`` sends box by box (nothing staged) when every box goes out and lands in
# place, there are at most this many boxes per pair of ranks on average, and they
# hold at least ``_DIRECT_MIN_BYTES`` each: below that, one all_to_all_single has less
# latency than the separate messages save in copying (Gloo on loopback).
_DIRECT_PIECES_PER_PAIR = 4
_DIRECT_MIN_BYTES = 1 << 20
# A launched movement whose boxes land in place, and a reduce phase, go by messages (``p2p``,
# ``_reduce_messages.run_by_messages``) where a rank sends this many bytes on average: then they hold
# no buffer for the large boxes. Smaller, one all_to_all_single has less latency (each
# point-to-point message on Gloo is a round of its own), and its buffers are small.
_MESSAGES_MIN_BYTES = 1 << 20


@cached(512)
def all_contiguous(src: Layout, dst: Layout) -> bool:
    """Whether every piece (source box meets destination box) is a contiguous range of its destination shard.

    As far as the layouts show it (a sufficient condition).

    A piece is such a range when it is whole in every dim after its first of extent over
    1. Dims in which every source box, or every destination box, has extent 1 give every
    piece extent 1; after the first other dim ``g``, a piece is whole in dim ``d`` when no
    source box starts or ends strictly inside a destination box's extent in ``d`` (then
    each source box that meets a destination box covers it in ``d``). Equal to reading
    the rows for chunks along one dim, grids and replicas; it says no (staged) only where
    a piece happens to have extent 1 in a dim where pieces may be longer.
    """
    si, di = index(src), index(dst)
    if not len(si.lo) or not len(di.lo) or not src.ndim:
        return True
    single = ((si.hi - si.lo) <= 1).all(axis=0) | ((di.hi - di.lo) <= 1).all(axis=0)
    g = int(np.argmin(single)) if not single.all() else src.ndim
    for d in range(g + 1, src.ndim):
        bounds = np.unique(np.r_[si.lo[:, d], si.hi[:, d]])
        inside = np.searchsorted(bounds, di.hi[:, d], "left") - np.searchsorted(bounds, di.lo[:, d], "right")
        if (inside > 0).any():
            return False
    return True


@cached(512)
def direct(src: Layout, dst: Layout, itemsize: int) -> bool:
    """Whether ``execute`` sends box by box.

    It does when every box lands in place on arrival and goes
    out without packing (``all_contiguous`` both ways: each piece is a range of its
    destination shard and of its source shard), and the boxes are large (each at least
    ``_DIRECT_MIN_BYTES``) and few (at most ``_DIRECT_PIECES_PER_PAIR`` per pair of
    ranks). Boxes that must be packed (column blocks of a row chunk: dim 0 -> dim 1) go
    by one ``all_to_all_single`` of a buffer packed with one strided copy, which on Gloo
    beats one message per box (1.1x against 1.4x the hand-packed reference at 16 MiB,
    ``docs/performance.md``). Every rank computes the same answer from the layouts:
    ``min_elements_sent`` (closed form) for the elements sent and ``smallest_piece`` for
    a lower bound on every box, so ``elements / smallest`` bounds the number of boxes.
    The rows would give the mean box size and the exact count: with boxes of unequal
    sizes this says no (all_to_all) more often.
    """
    sent = plan(src, dst).min_elements_sent
    if not sent:
        return False
    small = smallest_piece(src, dst)
    if small * itemsize < _DIRECT_MIN_BYTES:
        return False
    ranks = int(np.union1d(index(src).ranks, index(dst).ranks).size)
    few = sent <= _DIRECT_PIECES_PER_PAIR * ranks * ranks * small
    return few and all_contiguous(src, dst) and all_contiguous(dst, src)


def by_messages(p: Plan, itemsize: int, world: int) -> bool:
    """Whether a launched movement or a reduce phase ``p`` is large enough to go by messages.

    From the plan's closed-form ``min_elements_sent``, alike on every rank.
    """
    return p.min_elements_sent * itemsize >= world * _MESSAGES_MIN_BYTES


def smallest_piece(src: Layout, dst: Layout) -> int:
    """A lower bound on the elements of every piece (a source box meets a destination box).

    It is the product over dims of the shortest overlap of a source extent with a destination
    extent. 0 where a layout's distinct extents in a dim overlap each other (``Explicit``
    boxes of unequal sizes): then the pairs are not O(boxes) to walk.
    """
    si, di = index(src), index(dst)
    out = 1
    for d in range(src.ndim):
        a, b = _intervals(si.lo[:, d], si.hi[:, d]), _intervals(di.lo[:, d], di.hi[:, d])
        if a is None or b is None:
            return 0
        (alo, ahi), (blo, bhi) = a, b
        first = np.searchsorted(bhi, alo, "right")  # b intervals that end after a starts ...
        count = np.maximum(np.searchsorted(blo, ahi, "left") - first, 0)  # ... and start before it ends
        row = np.repeat(np.arange(len(alo)), count)
        k = first[row] + np.arange(row.size) - np.repeat(np.cumsum(count) - count, count)
        overlap = np.minimum(ahi[row], bhi[k]) - np.maximum(alo[row], blo[k])
        if not overlap.size:
            return 0
        out *= int(overlap.min())
    return out


def _intervals(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct intervals ``[lo, hi)`` sorted, or ``None`` where two of them overlap."""
    first, _ = unique_rows(np.c_[lo, hi])
    o = np.lexsort((hi[first], lo[first]))
    a, b = lo[first][o], hi[first][o]
    return None if (b[:-1] > a[1:]).any() else (a, b)


@cached(512)
def rows_in_order(layout: Layout, order: tuple[int, ...], wire: str) -> bool:
    """Whether the group's ranks ``order`` hold ``layout`` as ``all_gather_into_tensor`` gathers it.

    That is: one shard each, on the ``wire`` device type, equal dim-0 chunks whole in every other dim,
    in group order (so the whole array, not empty, is their shards back to back).

    >>> import fshard
    >>> rows_in_order(fshard.Chunk(0, [0, 1]).layout((4, 3)), (0, 1), "cpu")
    True
    >>> rows_in_order(fshard.Chunk(0, [1, 0]).layout((4, 3)), (0, 1), "cpu")  # not in group order
    False
    """
    n, shape = len(order), layout.shape
    if layout.partial is not None or not layout.ndim or len(layout.columns.rank) != n or shape[0] % n or not all(shape):
        return False
    if any(torch.device(d).type != wire for d in set(layout.columns.devices)):
        return False
    ranks = np.asarray(order, np.int64)
    sort = np.argsort(ranks)
    at = np.minimum(np.searchsorted(ranks[sort], layout.columns.rank), n - 1)
    k = sort[at]  # each shard's position in the group
    if not (ranks[k] == layout.columns.rank).all() or len(np.unique(k)) != n:
        return False
    rows = shape[0] // n
    whole = np.asarray(shape[1:], np.int64)
    lo, sz = layout.columns.lo, layout.columns.sz
    return bool((lo[:, 0] == k * rows).all() and (sz[:, 0] == rows).all() and not lo[:, 1:].any()
                and (sz[:, 1:] == whole).all())  # fmt: skip


def has_alltoall(backend_name: str) -> bool:
    return any(b in backend_name for b in ("gloo", "nccl", "mpi", "ucc"))


@dataclasses.dataclass(frozen=True)
class Step:
    """A rank's part of one copy phase.

    The shards it reads (``src``) and writes (``dst``, of ``sizes`` on ``devices``), its
    ``schedule``, whether anything crosses ranks (alike on every rank: the plan's closed-form
    minimum is not 0) and the ``transport`` that carries it (``p2p`` or ``alltoall``: it starts
    the messages and returns the function that waits for them).
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    devices: tuple[torch.device, ...]
    schedule: Schedule
    crosses: bool
    transport: Callable[..., Callable[[], None]]

    def outputs(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """New uninitialised destination shards of ``dtype``, by shard index."""
        return {j: new(s, dtype, d) for j, s, d in zip(self.dst, self.sizes, self.devices)}


@cached(512)
def step(p: Plan, rank: int, ranks: tuple[int, ...], one_per_box: bool, alltoall_ok: bool, itemsize: int) -> Step:
    """Rank ``rank``'s ``Step`` of the copy phase ``p`` in the group of ``ranks``, for elements of ``itemsize`` bytes.

    Messages per box (``p2p``: large boxes alone, small ones packed per peer) where
    ``one_per_box`` or the group has no all-to-all (``alltoall_ok`` false), else one
    ``all_to_all_single``.
    """
    dst = p.dst.indices_on(rank)
    sched = schedule(p, rank, ranks)
    transport = functools.partial(p2p, plan=messages(sched, itemsize)) if one_per_box or not alltoall_ok else alltoall
    return Step(
        p.src.indices_on(rank),
        dst,
        tuple(tuple(p.dst.columns.sz[j].tolist()) for j in dst),
        tuple(shard_device(p.dst, j) for j in dst),
        sched,
        p.min_elements_sent > 0,
        transport,
    )
