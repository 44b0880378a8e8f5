"""Direct plans (no pending reduction): which box of which source shard goes to which destination shard."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout import index as _index
from fshard._layout.layout import Layout
from fshard._plan import routing as _routing
from fshard._plan import schedule as _schedule
from fshard._plan.schedule import Moves, RankSchedule, moves

__all__ = ["Box", "Plan", "Transfer", "min_elements", "numels"]

TRAFFIC_RANKS = 8192  # traffic()'s matrix at most: 8192**2 int64, 512 MiB

_groups = _index.groups  # distinct boxes of a layout, in the numbering plans use

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``box`` (global coordinates) from a source shard to a destination shard.

    ``src_box`` and ``dst_box`` name the same global box, seen from either side.
    ``op`` is set in a reduce phase: the destination box receives the ``op`` of the
    transfers aimed at it rather than a copy. ``phase`` numbers the phase of a plan
    in two phases (reduce, then copy to the replicas); shard indices refer to that
    phase's layouts (``plan.phases[phase].src`` and ``.dst``).
    """

    src_rank: int
    src_shard: int
    dst_rank: int
    dst_shard: int
    box: Box
    op: str | None = None
    phase: int = 0

    @property
    def src_box(self) -> Box:
        """The moved box in global coordinates (read from the source shard)."""
        return self.box

    @property
    def dst_box(self) -> Box:
        """The moved box in global coordinates (written into the destination shard)."""
        return self.box

    @property
    def numel(self) -> int:
        """Number of elements moved (a Python int: exact past 2**63)."""
        return math.prod(self.box[1])


class Plan:
    """Every transfer that turns data in layout ``src`` into data in layout ``dst``.

    Arrays hold one row per transfer: source and destination shard indices and the
    box ``[lo, lo + size)``. A destination element is written exactly once per
    destination shard; an element crosses between ranks only when the receiving
    rank holds no copy of it, and then once, so ``elements_sent == min_elements_sent``.

    A plan from ``fshard.plan`` is lazy: the rows (``src_shard``, ``dst_shard``, ``lo``,
    ``size``, and what reads them: ``len``, iteration, ``transfers``, ``elements_sent``,
    ``traffic()``) are computed on first use. ``min_elements_sent`` has a closed form,
    and ``for_rank(r)`` computes one rank's share from the layouts alone.

    Between layouts with pending reductions (``Layout.partial``) a plan has ``op``
    set (a reduce phase: transfers into one box are combined) or is a chain of
    ``phases`` (reduce-scatter, then copies to the replicas); ``elements_sent``,
    ``traffic()`` and ``transfers`` cover every phase, and ``min_elements_sent`` is
    the lower bound derived in ``fshard._plan.pending.lower_bound``.

    >>> from fshard import Chunk, plan
    >>> p = plan(Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,)))
    >>> p.elements_sent, p.min_elements_sent, len(p)
    (4, 4, 2)
    """

    src: Layout
    dst: Layout
    op: str | None
    steps: tuple[Plan, ...]

    def __init__(
        self,
        src: Layout,
        dst: Layout,
        src_shard: np.ndarray | None = None,
        dst_shard: np.ndarray | None = None,
        lo: np.ndarray | None = None,
        size: np.ndarray | None = None,
        min_elements_sent: int | None = None,
        op: str | None = None,
        steps: tuple[Plan, ...] = (),
    ) -> None:
        for name, value in (("src", src), ("dst", dst), ("op", op), ("steps", steps)):
            object.__setattr__(self, name, value)
        if src_shard is not None:
            self.__dict__["_rows"] = (src_shard, dst_shard, lo, size)
        if min_elements_sent is not None:
            self.__dict__["min_elements_sent"] = int(min_elements_sent)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: a Plan is immutable")

    @functools.cached_property
    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return _build(self.src, self.dst)

    @property
    def src_shard(self) -> np.ndarray:
        """Source shard index of each transfer (into ``src.shards``)."""
        return self._rows[0]

    @property
    def dst_shard(self) -> np.ndarray:
        """Destination shard index of each transfer (into ``dst.shards``)."""
        return self._rows[1]

    @property
    def lo(self) -> np.ndarray:
        """Low corner of each transfer's box, global coordinates (transfers x ndim)."""
        return self._rows[2]

    @property
    def size(self) -> np.ndarray:
        """Extent of each transfer's box (transfers x ndim)."""
        return self._rows[3]

    @functools.cached_property
    def min_elements_sent(self) -> int:
        """The lower bound: pairs (element, receiving rank) where the rank holds no copy of the element."""
        return min_elements(self.src, self.dst)

    @property
    def phases(self) -> tuple[Plan, ...]:
        """The single-phase plans to run in turn: ``(self,)``, or the two phases of a reduction."""
        return self.steps or (self,)

    def for_rank(self, rank: int) -> RankSchedule:
        """This rank's sends, receives and local copies (``RankSchedule``), computed from the layouts alone.

        Pure, cached on ``(src, dst, rank)``; a plan with pending reductions
        (``fshard._plan.pending.PendingPlan``) computes it by its own rules, from the layouts too,
        and a plan built from rows alone reads them.
        """
        rank = _schedule.check_rank(rank)
        if not self.steps and self.op is None and _schedule.is_direct(self.src, self.dst):
            return _schedule.schedule(self.src, self.dst, rank)
        return from_plan(self, rank)

    @property
    def src_rank(self) -> np.ndarray:
        """Rank of each transfer's source shard."""
        return self.src.columns.rank[self.src_shard]

    @property
    def dst_rank(self) -> np.ndarray:
        """Rank of each transfer's destination shard."""
        return self.dst.columns.rank[self.dst_shard]

    @property
    def numel(self) -> np.ndarray:
        """Elements moved by each transfer.

        int64, or Python ints (an object array) where they add up to 2**62 or more (``numels``).
        """
        return numels(self.size)

    @functools.cached_property
    def _crossing(self) -> np.ndarray:
        """Transfers that cross ranks, each distinct (source, box, receiving rank) once.

        The boxes cut from one source shard are identical or disjoint, so the low
        corner names the box: no need to compare sizes.
        """
        cross = np.flatnonzero(self.src_rank != self.dst_rank)
        # A reduce phase combines one rank's contributions to a box before sending them.
        sender = self.src_rank if self.op is not None else self.src_shard
        first, _ = _boxes.unique_rows(np.c_[sender[cross], self.dst_rank[cross], self.lo[cross]])
        return cross[first]

    @functools.cached_property
    def elements_sent(self) -> int:
        """Elements that cross between different ranks (every phase)."""
        if self.steps:
            return sum(p.elements_sent for p in self.steps)
        return int(numels(self.size[self._crossing]).sum())

    def bytes_sent(self, itemsize: int) -> int:
        """Bytes that cross between ranks for elements of ``itemsize`` bytes (a positive int).

        >>> import fshard
        >>> fshard.plan(fshard.Chunk(0, [0, 1]).layout((4,)), fshard.Chunk(0, [1, 0]).layout((4,))).bytes_sent(4)
        16
        """
        if isinstance(itemsize, bool) or not isinstance(itemsize, (int, np.integer)) or itemsize < 1:  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
            msg = f"bytes_sent() takes an element's size in bytes, a positive int (dtype.itemsize), got {itemsize!r}."
            raise SpecError(msg)
        return self.elements_sent * int(itemsize)

    def traffic(self) -> np.ndarray:
        """A world x world matrix: elements sent from rank i (row) to rank j (column), every phase.

        Raises:
            SpecError: the highest rank is ``TRAFFIC_RANKS`` or more: the matrix would take
                world**2 numbers (``for_rank`` gives one rank's part, ``elements_sent`` the total).

        >>> import fshard
        >>> fshard.plan(fshard.Chunk(0, [0, 1]).layout((4,)), fshard.Chunk(0, [1, 0]).layout((4,))).traffic().tolist()
        [[0, 2], [2, 0]]
        """
        world = int(max(self.src.columns.rank.max(initial=-1), self.dst.columns.rank.max(initial=-1))) + 1
        if world > TRAFFIC_RANKS:
            msg = (
                f"traffic() is a world x world matrix, and this plan's ranks go up to {world - 1}: {world}**2 numbers. "
                "Read one rank's part with plan.for_rank(rank), or the total with plan.elements_sent."
            )
            raise SpecError(msg)
        moved = [(p.src_rank[c], p.dst_rank[c], numels(p.size[c])) for p in self.phases for c in (p._crossing,)]
        exact = any(n.dtype == object for _, _, n in moved)  # Python ints where int64 could wrap
        out = np.zeros((world, world), object if exact else np.int64)
        for src, dst, n in moved:
            np.add.at(out, (src, dst), n)
        return out

    @functools.cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """The transfers as ``Transfer`` values (of every phase, in turn)."""
        return tuple(t for k, p in enumerate(self.phases) for t in p._transfers(k))

    def _transfers(self, phase: int) -> tuple[Transfer, ...]:
        sr, dr = self.src_rank.tolist(), self.dst_rank.tolist()
        return tuple(
            Transfer(sr[k], s, dr[k], d, (tuple(lo), tuple(sz)), self.op, phase)
            for k, (s, d, lo, sz) in enumerate(
                zip(self.src_shard.tolist(), self.dst_shard.tolist(), self.lo.tolist(), self.size.tolist())
            )
        )

    def __len__(self) -> int:
        return sum(int(p.src_shard.shape[0]) for p in self.phases)

    def __iter__(self) -> Any:
        return iter(self.transfers)

    def __getitem__(self, k: int) -> Transfer:
        return self.transfers[k]

    def __repr__(self) -> str:
        kind = f"{len(self.steps)} phases, " if self.steps else (f"reduce {self.op}, " if self.op else "")
        shards = len(self.src.columns.rank) * len(self.dst.columns.rank)
        if shards > _REPR_PAIRS and not all("_rows" in vars(p) for p in self.phases):
            # Counting the transfers builds them all (a gather to n ranks has n**2): a large plan says what is cheap.
            return (
                f"Plan({kind}{len(self.src.columns.rank)} -> {len(self.dst.columns.rank)} shards, minimum "
                f"{self.min_elements_sent} elements sent, shape {self.src.shape}; len(plan) and plan.elements_sent "
                "build its transfers, plan.for_rank(rank) one rank's)"
            )
        return (
            f"Plan({kind}{len(self)} transfers, {self.elements_sent} elements sent "
            f"(minimum {self.min_elements_sent}), shape {self.src.shape})"
        )


_REPR_PAIRS = 1 << 16  # source shards times destination shards past which a plan's repr builds no transfers


def _build(src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows of ``plan(src, dst)`` (neither partial).

    Every piece of a source box in a destination shard, from the source that
    ``_routing.source_shards`` picks.
    """
    si, di = _index.index(src), _index.index(dst)
    pu, pv = _boxes.intersect_pairs(si.lo, si.hi, di.lo, di.hi)  # (src box u, dst box v) that share elements
    ilo = np.maximum(si.lo[pu], di.lo[pv])
    isz = np.minimum(si.hi[pu], di.hi[pv]) - ilo
    pair, k = _index.expand(di.copy_count[pv])  # every copy of each destination box
    dst_shard = di.copies[di.copy_start[pv][pair] + k]
    u, v, lo, size = pu[pair], pv[pair], ilo[pair], isz[pair]
    src_shard = _routing.source_shards(src, dst, u, v, dst_shard)
    order = _transfer_order(src, dst, src_shard, dst_shard)
    arrays = (src_shard[order], dst_shard[order], lo[order], size[order])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def _transfer_order(src: Layout, dst: Layout, src_shard: np.ndarray, dst_shard: np.ndarray) -> np.ndarray:
    """Rows sorted by (source rank, destination rank, source shard, destination shard)."""
    s_rank, d_rank, width = _rank_codes(src, dst)
    ranks = s_rank[src_shard] * width + d_rank[dst_shard]
    shards = src_shard * max(len(dst.columns.rank), 1) + dst_shard
    return np.lexsort((shards, ranks))


def _rank_codes(src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray, int]:
    """Ranks of both layouts as small ints (order kept) and their bound, safe to multiply."""
    width = int(max(src.columns.rank.max(initial=0), dst.columns.rank.max(initial=0))) + 1
    if width <= 1 << 24:
        return src.columns.rank, dst.columns.rank, width
    ranks, inverse = np.unique(np.r_[src.columns.rank, dst.columns.rank], return_inverse=True)
    return inverse[: len(src.columns.rank)], inverse[len(src.columns.rank) :], len(ranks)


def min_elements(src: Layout, dst: Layout) -> int:
    """Pairs (element, receiving rank) where the rank holds no copy of the element in ``src``.

    In closed form, without the plan's rows: every (destination box, rank) needs its
    elements, less those that the rank already holds, which are the overlaps of its
    own source and destination boxes (found with the rank as one more coordinate).
    """
    si, di = _index.index(src), _index.index(dst)
    need = int(numels((di.hi - di.lo)[di.held // max(len(di.ranks), 1)]).sum())
    ranks = np.union1d(si.ranks, di.ranks)
    a = _with_rank(si, np.searchsorted(ranks, si.holder))
    b = _with_rank(di, np.searchsorted(ranks, di.holder))
    pa, pb = _boxes.intersect_pairs(*a, *b)
    overlap = np.minimum(a[1][pa], b[1][pb]) - np.maximum(a[0][pa], b[0][pb])
    return need - int(numels(overlap[:, :-1]).sum())


def numels(sizes: np.ndarray) -> np.ndarray:
    """The elements of each box (rows of extents).

    int64 where they add up to less than 2**62, else Python ints in an object array, whose sums
    are exact (a layout may hold 2**63 elements or more: only each extent must fit in int64).

    >>> numels(np.array([[2, 3], [4, 0]])).tolist(), numels(np.array([[2**40, 2**40]])).tolist()
    ([6, 0], [1208925819614629174706176])
    """
    if not sizes.size or np.prod(sizes.astype(np.float64), axis=1).sum() < 2.0**62:
        return _boxes.rows_prod(sizes)
    return np.array([math.prod(row) for row in sizes.tolist()], dtype=object)


def _with_rank(ix: _index.Index, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each held (box, rank) as a box with the rank as its last coordinate."""
    box = ix.held // max(len(ix.ranks), 1)
    return np.c_[ix.lo[box], rank], np.c_[ix.hi[box], rank + 1]


# -- schedules read from a built plan ----------------------------------------------------------


@cached(1024)
def from_plan(p: Plan, rank: int) -> RankSchedule:
    """``rank``'s share of a built plan, read from its rows (O(rows)).

    Plans from ``fshard.plan`` compute theirs from the layouts instead: ``schedule``, and
    ``fshard._plan.pending.rank_schedule`` between layouts with pending reductions; this is the
    reference they agree with.
    """
    rank = int(rank)
    if p.steps:
        steps = tuple(from_plan(s, rank) for s in p.steps)
        empty = _rows_of(p, np.zeros(0, np.int64), p.src_rank)
        return RankSchedule(p.src, p.dst, rank, empty, empty, empty, p.op, steps)
    sr, dr = p.src_rank, p.dst_rank
    send = np.flatnonzero((sr == rank) & (dr != rank))
    recv = np.flatnonzero((dr == rank) & (sr != rank))
    local = np.flatnonzero((sr == rank) & (dr == rank))
    return RankSchedule(p.src, p.dst, rank, _rows_of(p, send, dr), _rows_of(p, recv, sr), _rows_of(p, local, sr), p.op)


def _rows_of(p: Plan, rows: np.ndarray, peer: np.ndarray) -> Moves:
    return moves(p.src_shard, p.dst_shard, p.lo, p.size, peer, rows)
