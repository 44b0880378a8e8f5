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
from typing import TYPE_CHECKING, Any

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout

if TYPE_CHECKING:
    from fshard._plan.plan import Plan

__all__ = [
    "Index",
    "Moves",
    "RankSchedule",
    "expand",
    "from_plan",
    "groups",
    "index",
    "pieces",
    "schedule",
    "shared_holders",
    "source_shards",
    "walk_holders",
]


# -- a layout's index: distinct boxes, who holds them, and how to find them ---------------------


def groups(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct non-empty boxes: (shard index of each box's first copy, shard indices, box of each).

    Boxes are numbered in lexicographic order of (offsets, sizes).
    """
    idx = np.flatnonzero(_boxes.rows_all(layout._sz > 0))
    first, inverse = _boxes.unique_rows(np.c_[layout._lo[idx], layout._sz[idx]])
    return idx[first], idx, inverse


@dataclasses.dataclass(frozen=True, eq=False)
class _Grid:
    """Distinct boxes that are the cells of one partition per dim: a box is found by bisection."""

    los: tuple[np.ndarray, ...]  # per dim, the sorted disjoint intervals' lower ends
    his: tuple[np.ndarray, ...]  # ... and upper ends
    strides: tuple[int, ...]  # of the dense cell numbering
    cell: np.ndarray  # box at each cell, -1 where none


@dataclasses.dataclass(frozen=True, eq=False)
class Index:
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

    def key(self, box: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The key of each (box, rank), or -1 where the rank holds no shard."""
        code = self.code(rank)
        return np.where(code >= 0, box * len(self.ranks) + code, -1)

    def find(self, box: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Position in ``held`` of each (box, rank), or -1 where that rank holds no copy of the box."""
        key = self.key(box, rank)
        pos = np.minimum(np.searchsorted(self.held, key), max(len(self.held) - 1, 0))
        if not len(self.held):
            return np.full(len(key), -1, np.int64)
        return np.where((key >= 0) & (self.held[pos] == key), pos, -1)

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
    ranks, code = np.unique(layout._rank, return_inverse=True)
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
    box_of = np.full(len(layout._rank), -1, np.int64)
    box_of[idx] = box
    lo = layout._lo[first]
    hi = lo + layout._sz[first]
    by_rank = np.argsort(layout._rank, kind="stable")
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
        rank_sorted=layout._rank[by_rank],
    )


def _grid(lo: np.ndarray, hi: np.ndarray) -> _Grid | None:
    """The grid of the boxes when each dim's distinct intervals are disjoint and the cells are few."""
    n, d = lo.shape
    los, his, cell_of = [], [], []
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
    n, d = lo.shape
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


# -- the source of each piece ------------------------------------------------------------------


def source_shards(src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray, dst_shard: np.ndarray) -> np.ndarray:
    """The source shard of each row: the piece of source box ``u`` in destination box ``v``,
    written into ``dst_shard`` (on rank r).

    - r holds a copy of ``u``: that copy (on the destination shard's device if there is
      one), a local copy;
    - else the k-th holder of ``u`` (ranks ascending, m of them) sends its lowest-index
      copy, with ``k = (p + u + v) mod m`` where ``p`` is r's position among the ranks of
      ``v`` that hold no copy of ``u``: the receivers of a piece take turns over its
      holders, so the senders are balanced, and one rank of ``v`` receives a piece once.
    """
    si, di = index(src), index(dst)
    rank = dst._rank[dst_shard]
    held = si.find(u, rank)
    out = np.empty(len(u), np.int64)
    here = np.flatnonzero(held >= 0)
    out[here] = _local_copy(src, dst, si, u[here], rank[here], dst_shard[here], held[here])
    away = np.flatnonzero(held < 0)
    out[away] = si.first[_sender(si, di, u[away], v[away], rank[away])]
    return out


def _local_copy(
    src: Layout, dst: Layout, si: Index, u: np.ndarray, rank: np.ndarray, dst_shard: np.ndarray, held: np.ndarray
) -> np.ndarray:
    """The copy of ``u`` on the receiving rank: on the destination shard's device, else the lowest index."""
    out = si.first[held]
    start, stop = si.copies_of(u, rank)
    for k in np.flatnonzero(stop - start > 1).tolist():  # a rank holding a box on several devices
        device = dst._devices[int(dst_shard[k])]
        same = [int(i) for i in si.copies[start[k] : stop[k]] if src._devices[int(i)] == device]
        out[k] = min(same) if same else out[k]
    return out


def _sender(si: Index, di: Index, u: np.ndarray, v: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Position in ``si.held`` of the holder of ``u`` that sends to ``rank`` (which holds no copy)."""
    m = si.count[u]
    k = np.zeros(len(u), np.int64)
    multi = np.flatnonzero(m > 1)
    if multi.size:
        uu, vv, rr = u[multi], v[multi], rank[multi]
        p = di.find(vv, rr) - di.start[vv] - _shared_below(si, di, uu, vv, rr)
        k[multi] = (p + uu + vv) % m[multi]
    return si.start[u] + k


def _shared_below(si: Index, di: Index, u: np.ndarray, v: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per row, the ranks below ``rank`` that hold both ``u`` (source) and ``v`` (destination).

    Each distinct (u, v) walks the shorter of its two rank lists once (``shared_holders``).
    """
    first, inverse = _boxes.unique_rows(np.c_[u, v])
    pair, holder = shared_holders(si, di, u[first], v[first])
    width = len(si.ranks) + 1
    keys = pair * width + np.searchsorted(si.ranks, holder)  # sorted: ranks ascend within a pair
    query = inverse * width + np.searchsorted(si.ranks, rank)
    return np.searchsorted(keys, query) - np.searchsorted(keys, inverse * width)


def shared_holders(si: Index, di: Index, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (pair, rank) where ``rank`` holds both ``u[pair]`` (in ``si``) and ``v[pair]`` (in
    ``di``), pairs ascending and ranks ascending within a pair; each pair walks the shorter of
    its two rank lists."""
    pair, at = expand(np.minimum(si.count[u], di.count[v]))
    return walk_holders(si, di, u, v, pair, at)


def walk_holders(
    si: Index, di: Index, u: np.ndarray, v: np.ndarray, pair: np.ndarray, at: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The entries ``at`` of the shorter holder list of each ``pair`` that the other list holds
    too, as (pair, rank)."""
    from_u = (si.count[u] <= di.count[v])[pair]
    rank = np.empty(len(pair), np.int64)
    hit = np.empty(len(pair), bool)
    a, b = np.flatnonzero(from_u), np.flatnonzero(~from_u)
    rank[a] = si.holder[si.start[u[pair[a]]] + at[a]]
    hit[a] = di.find(v[pair[a]], rank[a]) >= 0
    rank[b] = di.holder[di.start[v[pair[b]]] + at[b]]
    hit[b] = si.find(u[pair[b]], rank[b]) >= 0
    return pair[hit], rank[hit]


# -- one rank's schedule -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Moves:
    """Columns of transfers: source and destination shard, the box ``[lo, lo + size)`` in
    global coordinates, and the rank on the other side (``peer``; this rank for local copies)."""

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


def _moves(src_shard: np.ndarray, dst_shard: np.ndarray, lo: np.ndarray, size: np.ndarray,
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
        """Elements this rank sends (every phase); a box goes once to a rank that holds it twice,
        and a reduce phase combines this rank's contributions to a box before sending them."""
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
    peer = src._rank[src_shard]
    here = peer == rank
    local = np.flatnonzero(here)
    away = np.flatnonzero(~here)
    local = local[np.lexsort((dst_shard[local], src_shard[local]))]
    away = away[np.lexsort((dst_shard[away], src_shard[away], peer[away]))]
    return (
        _moves(src_shard, dst_shard, lo, size, peer, local),
        _moves(src_shard, dst_shard, lo, size, peer, away),
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
    return _moves(src_shard, dst_shard, lo[pair], size[pair], to, order)


# -- schedules read from a built plan ----------------------------------------------------------


@cached(1024)
def from_plan(p: Plan, rank: int) -> RankSchedule:
    """``rank``'s share of a built plan, read from its rows (O(rows)). Plans from ``fshard.plan``
    compute theirs from the layouts instead: ``schedule``, and ``fshard._plan.pending.rank_schedule``
    between layouts with pending reductions; this is the reference they agree with."""
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
    return _moves(p.src_shard, p.dst_shard, p.lo, p.size, peer, rows)


def is_direct(src: Layout, dst: Layout) -> bool:
    """Whether ``schedule`` computes the schedules between these layouts (no pending reduction)."""
    return src.partial is None and dst.partial is None


def check_rank(rank: Any) -> int:
    """``rank`` as an int, or raises ``SpecError``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < 2**63:
        raise SpecError(f"for_rank() takes a non-negative int rank (int64, as layouts hold them), got {rank!r}.")
    return int(rank)
