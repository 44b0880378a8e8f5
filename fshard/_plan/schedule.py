"""Per-rank schedules: one rank's share of a plan, computed from the two layouts and the rank.

A rank needs only the transfers it sends and receives. ``schedule(src, dst, rank)``
finds them without the global plan: each layout gets a cached index of its distinct
boxes (sorted bounds per dim where the boxes form a grid, which every spec but
``Explicit`` makes), the rank's own boxes are looked up in the other layout's index,
and each piece takes its source by a rule that needs only the piece's two boxes and
its receiving rank (``source_shards``). The global plan uses the same rule, so the
union over ranks of the schedules is the plan. Work per rank: O(k log n) for k own
boxes, plus the pieces exchanged and, for a replicated destination box, its ranks.
Between layouts with pending reductions, ``fshard._plan.pending`` finds a rank's rows the same
way (its own boxes looked up in the other layout's index), by the rules of its phases.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.index import expand, index, pieces
from fshard._layout.layout import Layout
from fshard._plan.routing import source_shards

__all__ = ["Moves", "RankSchedule", "moves", "schedule"]


# -- one rank's schedule -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Moves:
    """Columns of transfers: source and destination shard, a box, and the rank on the other side.

    The box is ``[lo, lo + size)`` in global coordinates; the rank on the other side is
    ``peer`` (this rank for local copies).
    """

    src_shard: np.ndarray
    dst_shard: np.ndarray
    lo: np.ndarray
    size: np.ndarray
    peer: np.ndarray

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).setflags(write=False)

    def __len__(self) -> int:
        return int(self.src_shard.shape[0])

    @property
    def numel(self) -> np.ndarray:
        """Elements of each transfer."""
        return _boxes.rows_prod(self.size)

    @property
    def peers(self) -> tuple[int, ...]:
        """The distinct peers, ascending."""
        return tuple(int(p) for p in np.unique(self.peer))

    def __repr__(self) -> str:
        return f"Moves({len(self)} transfers, {int(self.numel.sum())} elements, peers {_short(self.peers)})"


def moves(src_shard: np.ndarray, dst_shard: np.ndarray, lo: np.ndarray, size: np.ndarray,
           peer: np.ndarray, order: np.ndarray) -> Moves:  # fmt: skip
    return Moves(src_shard[order], dst_shard[order], lo[order], size[order], peer[order])


@dataclasses.dataclass(frozen=True, eq=False)
class RankSchedule:
    """One rank's share of ``plan(src, dst)``: what it sends, receives and copies locally.

    ``send``, ``recv`` and ``local`` are ``Moves`` (columns ``src_shard``, ``dst_shard``,
    ``lo``, ``size``, ``peer``), each in the plan's order (source rank, destination rank,
    source shard, destination shard), so a sender and its receiver list their common
    transfers alike. One row per destination shard: a box that a rank holds twice (two
    devices) arrives in two rows from one source shard. Between layouts with pending
    reductions, ``op`` and ``steps`` mirror the plan's (``phases``: one schedule per phase).

    ``fshard.plan(src, dst).for_rank(rank)`` computes it from the layouts alone, without
    the global plan (pure, cached on ``(src, dst, rank)``); the union over ranks of the
    schedules' rows is the plan's rows.

    >>> from fshard import Chunk, plan
    >>> s = plan(Chunk(0, [0, 1]).layout((4, 4)), Chunk(1, [0, 1]).layout((4, 4))).for_rank(0)
    >>> s  # doctest: +NORMALIZE_WHITESPACE
    RankSchedule(rank 0, shape (4, 4): sends 1 transfer (4 elements) to ranks 1,
                 receives 1 (4 elements) from ranks 1, 1 local copy)
    >>> s.send.lo.tolist(), s.send.size.tolist(), s.recv.peer.tolist()
    ([[0, 2]], [[2, 2]], [1])
    """

    src: Layout = dataclasses.field(repr=False)
    dst: Layout = dataclasses.field(repr=False)
    rank: int
    send: Moves
    recv: Moves
    local: Moves
    op: str | None = None
    steps: tuple[RankSchedule, ...] = ()

    @property
    def phases(self) -> tuple[RankSchedule, ...]:
        """The single-phase schedules to run in turn: ``(self,)``, or one per phase of a reduction."""
        return self.steps or (self,)

    @property
    def peers(self) -> tuple[int, ...]:
        """Every rank this rank sends to or receives from (any phase), ascending."""
        out: set[int] = set()
        for s in self.phases:
            out.update(s.send.peers, s.recv.peers)
        return tuple(sorted(out))

    @functools.cached_property
    def elements_sent(self) -> int:
        """Elements this rank sends (every phase).

        A box goes once to a rank that holds it twice, and a reduce phase combines this rank's
        contributions to a box before sending them.
        """
        if self.steps:
            return sum(s.elements_sent for s in self.steps)
        return _distinct_numel(self.send, self.op is None)

    @functools.cached_property
    def elements_received(self) -> int:
        """Elements this rank receives (every phase), counted like ``elements_sent``."""
        if self.steps:
            return sum(s.elements_received for s in self.steps)
        return _distinct_numel(self.recv, self.op is None)

    def __repr__(self) -> str:
        if self.steps:
            parts = "; ".join(repr(s).split(": ", 1)[1].rstrip(")") for s in self.steps)
            return f"RankSchedule(rank {self.rank}, shape {self.src.shape}, {len(self.steps)} phases: {parts})"
        kind = f"reduce {self.op}, " if self.op else ""
        n_local = len(self.local)
        return (
            f"RankSchedule(rank {self.rank}, shape {self.src.shape}: {kind}"
            f"sends {_count(len(self.send), 'transfer')} ({self.elements_sent} elements) to ranks "
            f"{_short(self.send.peers)}, receives {len(self.recv)} ({self.elements_received} elements) "
            f"from ranks {_short(self.recv.peers)}, {_count(n_local, 'local copy', 'local copies')})"
        )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _short(ranks: tuple[int, ...], most: int = 8) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    text = ",".join(map(str, ranks[:most]))
    return text + (f",... ({len(ranks)} ranks)" if len(ranks) > most else "")


def _distinct_numel(m: Moves, per_shard: bool) -> int:
    """Elements of the distinct (source shard, peer, box) of ``m`` (without the shard: per rank)."""
    if not len(m):
        return 0
    key = np.c_[m.src_shard, m.peer, m.lo] if per_shard else np.c_[m.peer, m.lo]
    first, _ = _boxes.unique_rows(key)
    return int(m.numel[first].sum())


@cached(1024)
def schedule(src: Layout, dst: Layout, rank: int) -> RankSchedule:
    """This rank's share of the plan from ``src`` to ``dst`` (neither partial), from the layouts alone."""
    if src.partial is not None or dst.partial is not None:
        raise SpecError(
            "schedule() plans layouts without pending reductions; use fshard.plan(src, dst).for_rank(rank)."
        )
    if src.shape != dst.shape:
        raise SpecError(f"Cannot plan between shapes {src.shape} and {dst.shape}: shapes must match.")
    rank = int(rank)
    local, recv = _receives(src, dst, rank)
    return RankSchedule(src, dst, rank, _sends(src, dst, rank), recv, local)


def _receives(src: Layout, dst: Layout, rank: int) -> tuple[Moves, Moves]:
    """(local copies, receives) of ``rank``: every piece of a source box in one of its destination shards."""
    si, di = index(src), index(dst)
    boxes = np.unique(di.box_of[di.shards_on(rank)])
    v, u, lo, size = pieces(di, si, boxes)
    start, stop = di.copies_of(v, np.full(len(v), rank))
    row, k = expand(stop - start)
    u, v, lo, size = u[row], v[row], lo[row], size[row]
    dst_shard = di.copies[start[row] + k]
    src_shard = source_shards(src, dst, u, v, dst_shard)
    peer = src.columns.rank[src_shard]
    here = peer == rank
    local = np.flatnonzero(here)
    away = np.flatnonzero(~here)
    local = local[np.lexsort((dst_shard[local], src_shard[local]))]
    away = away[np.lexsort((dst_shard[away], src_shard[away], peer[away]))]
    return (
        moves(src_shard, dst_shard, lo, size, peer, local),
        moves(src_shard, dst_shard, lo, size, peer, away),
    )


def _sends(src: Layout, dst: Layout, rank: int) -> Moves:
    """What ``rank`` sends: the pieces of its boxes whose turn (``source_shards``) falls on it."""
    si, di = index(src), index(dst)
    boxes = np.unique(si.box_of[si.shards_on(rank)])
    mine = si.find(boxes, np.full(len(boxes), rank))  # this rank among each box's holders
    u, v, lo, size = pieces(si, di, boxes)
    at = np.searchsorted(boxes, u)
    pair, k = expand(di.count[v])  # every rank of each destination box
    pu, pv = u[pair], v[pair]
    to = di.holder[di.start[pv] + k]
    need = si.find(pu, to) < 0
    n_need = np.bincount(pair, weights=need, minlength=len(u)).astype(np.int64)
    position = np.cumsum(need) - 1 - np.repeat(np.cumsum(n_need) - n_need, di.count[v])
    turn = (mine - si.start[boxes])[at[pair]]
    ours = need & ((position + pu + pv) % si.count[pu] == turn)
    pair, to = pair[ours], to[ours]
    start, stop = di.copies_of(v[pair], to)
    row, k = expand(stop - start)
    pair, to = pair[row], to[row]
    dst_shard = di.copies[start[row] + k]
    src_shard = si.first[mine[at[pair]]]
    order = np.lexsort((dst_shard, src_shard, to))
    return moves(src_shard, dst_shard, lo[pair], size[pair], to, order)


def is_direct(src: Layout, dst: Layout) -> bool:
    """Whether ``schedule`` computes the schedules between these layouts (no pending reduction)."""
    return src.partial is None and dst.partial is None


def check_rank(rank: Any) -> int:
    """``rank`` as an int, or raises ``SpecError``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < 2**63:
        raise SpecError(f"for_rank() takes a non-negative int rank (int64, as layouts hold them), got {rank!r}.")
    return int(cast("int | np.integer[Any]", rank))
