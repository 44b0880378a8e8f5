r"""Plans between layouts with pending reductions (``Layout.partial``).

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
  copy in the destination, else it goes to one destination copy: |S \ D| per element.
- non-partial -> partial: one copy of each element holds the value (the identity
  elsewhere), taken from a rank that holds it where possible: 0 or 1 per element.

Each phase follows a *rule* that gives the rows of a region (the intersection of a
distinct source box ``u`` and a distinct destination box ``v``, numbered as
``fshard._plan.schedule.index`` numbers them) from facts about ``u`` and ``v`` alone: their
holders (ranks ascending) and their copies (shards). With S the holders of ``u`` and
D (m ranks) those of ``v``:

- ``reduce`` (to one owner per element): every copy of ``u`` to every copy of ``v``;
- ``regroup`` (partial to partial, same op): a copy of ``u`` on a rank of D goes to that
  rank's copy of ``v`` (on the same device if there is one, else its lowest-index
  copy); the holder at position p of S that is not in D sends to the holder at
  position (p + u + v) mod m of D: the receivers take turns;
- ``make`` (a value to a partial layout): the lowest rank in both S and D keeps its
  copy (the one on its destination copy's device, else its lowest); where S and D do
  not meet, the holder at position (u + v) mod |S| of S sends to the holder at
  position (u + v) mod m of D.

So one rank finds its own rows (``PendingPlan.for_rank``) from its own boxes looked up
in the other layout's index, without the global plan, and the global plan (the rows,
computed on first use, for inspection: both backends run the schedules) applies the same rules to
every region: the union over ranks of the schedules is the plan, row for row.
"""

from __future__ import annotations

import functools
import operator
from typing import cast

import numpy as np

from fshard._base.cache import cached
from fshard._layout.index import Index, expand, index, pieces
from fshard._layout.layout import Layout, with_partial
from fshard._plan import schedule as _schedule
from fshard._plan.direct import Plan, numels
from fshard._plan.routing import copy_on, shared_holders, walk_holders
from fshard._plan.schedule import RankSchedule, moves

__all__ = ["PendingPlan", "build", "lower_bound", "rank_schedule"]

Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # source shard, destination shard, lo, size

RULES = ("reduce", "regroup", "make")


class PendingPlan(Plan):
    """A plan between layouts with a pending reduction.

    One phase under ``rule`` (``"reduce"``, ``"regroup"`` or ``"make"``, see
    ``fshard._plan.pending``), or a chain of phases (``rule`` is ``"chain"``). A phase's rows
    are computed on first use; ``for_rank`` computes one rank's share from the layouts alone,
    with the same rule.
    """

    rule: str

    def __init__(self, src: Layout, dst: Layout, rule: str, bound: int, steps: tuple[Plan, ...] = ()) -> None:
        if rule == "chain":
            empty, box = np.zeros(0, np.int64), np.zeros((0, len(src.shape)), np.int64)
            for a in (empty, box):
                a.setflags(write=False)
            super().__init__(src, dst, empty, empty, box, box, min_elements_sent=bound, steps=steps)
        else:
            super().__init__(src, dst, min_elements_sent=bound, op=_op(rule, src, dst))
        object.__setattr__(self, "rule", rule)

    @functools.cached_property
    def _rows(self) -> Rows:
        return global_rows(self.rule, self.src, self.dst)

    def for_rank(self, rank: int) -> RankSchedule:
        """This rank's sends, receives and local copies (every phase), from the layouts alone.

        Pure, cached on ``(src, dst, rank)``: the rows of the global plan that touch this rank,
        in the plan's order.
        """
        rank = _schedule.check_rank(rank)
        if self.steps:
            return _chain_schedule(self, rank)
        return rank_schedule(self.rule, self.src, self.dst, rank)


def _op(rule: str, src: Layout, dst: Layout) -> str | None:
    return src.partial if rule == "reduce" else dst.partial


# -- the plans ------------------------------------------------------------------------------


def build(src: Layout, dst: Layout) -> Plan:
    """The plan from ``src`` to ``dst`` when either carries a pending reduction."""
    if src.partial is None:
        return _phase("make", src, dst)
    if dst.partial == src.partial:
        return _phase("regroup", src, dst)
    if dst.partial is None:
        return _reduce(src, dst)
    owners = _owners(src, with_partial(dst, None))
    steps = (_phase("reduce", src, owners), _phase("make", owners, dst))
    return PendingPlan(src, dst, "chain", lower_bound(src, dst), steps)


def _phase(rule: str, src: Layout, dst: Layout) -> PendingPlan:
    """One phase; its ``min_elements_sent`` is the lower bound, which each rule meets."""
    return PendingPlan(src, dst, rule, lower_bound(src, dst))


def _reduce(src: Layout, dst: Layout) -> Plan:
    """Partial ``src`` to non-partial ``dst``: reduce at one owner per element, then copy to the replicas."""
    if (index(dst).count <= 1).all():  # each element has one owner already
        return _phase("reduce", src, dst)
    owners = _owners(src, dst)
    return PendingPlan(src, dst, "chain", lower_bound(src, dst), (_phase("reduce", src, owners), Plan(owners, dst)))


def lower_bound(src: Layout, dst: Layout) -> int:
    r"""The fewest elements any schedule must send to turn ``src`` into ``dst``.

    Per element with source ranks S (summands, or replicas of a value) and destination
    ranks D: a partial source needs every summand rank but one to send, and every
    destination rank but one to receive after the reduction is complete, so
    |S| + |D| - 1 - [S and D meet] (the bandwidth-optimal all-reduce sends 2(n - 1)
    per element); a non-partial source needs |D \ S|; to a partial destination of the
    same op, |S \ D| for a partial source and [S and D are disjoint] for a value.
    """
    si, di = index(src), index(dst)
    u, v, _, size = _regions(si, di)
    s_count, d_count = si.count[u], di.count[v]
    pair, _ = shared_holders(si, di, u, v)
    both = np.bincount(pair, minlength=len(u)).astype(np.int64)
    meet = (both > 0).astype(np.int64)
    if src.partial is None:
        need = d_count - both if dst.partial is None else 1 - meet
    elif dst.partial == src.partial:
        need = s_count - both
    elif dst.partial is None:
        need = s_count + d_count - 1 - meet
    else:  # another op: reduce at one destination rank, which keeps the result
        need = s_count - meet
    numel = numels(size)  # Python ints where they could wrap around in int64
    if not len(need) or int(need.max()) * int(numel.sum()) < 2**62:  # no int64 overflow
        return int(np.dot(need, numel))
    return sum(map(operator.mul, need.tolist(), numel.tolist()))


def _owners(src: Layout, dst: Layout) -> Layout:
    """A non-partial layout with one copy of each element, on the rank that will reduce it.

    Each region's candidates are the destination ranks that hold a summand (else all
    destination ranks); the region (the k-th, in ``_regions`` order) is split along its
    longest dim into as many parts as candidates, as ``chunk_bounds`` splits, part t
    going to candidate (t + k) mod (candidates), so the reduction work spreads as in a
    reduce-scatter. Each part sits on its owner's lowest-index destination copy's device.
    """
    si, di = index(src), index(dst)
    u, v, lo, size = _regions(si, di)
    n, d = len(u), dst.ndim
    # The candidates of each region, ranks ascending: the shared ranks, else every rank of v.
    pair, rank = shared_holders(si, di, u, v)
    alone = np.flatnonzero(np.bincount(pair, minlength=n) == 0)
    row, k = expand(di.count[v[alone]])
    cand_pair = np.r_[pair, alone[row]]
    cand_rank = np.r_[rank, di.holder[di.start[v[alone]][row] + k]]
    order = np.argsort(cand_pair, kind="stable")
    cand_rank = cand_rank[order]
    count = np.bincount(cand_pair, minlength=n)
    cand_start = np.cumsum(count) - count
    # Parts: chunk_bounds(extent, count) along the longest dim (one part for a 0-d array).
    axis = np.argmax(size, axis=1) if d else np.zeros(n, np.int64)
    extent = size[np.arange(n), axis] if d else np.ones(n, np.int64)
    step = -(-extent // np.maximum(count, 1))
    row, t = expand(count if d else np.ones(n, np.int64))
    off = t * step[row]
    length = np.minimum(extent[row], off + step[row]) - off
    keep = length > 0
    row, t, off, length = row[keep], t[keep], off[keep], length[keep]
    owner = cand_rank[cand_start[row] + (t + row) % count[row]]
    part_lo, part_size = lo[row], size[row]
    if d:
        at = np.arange(len(row))
        part_lo[at, axis[row]] += off
        part_size[at, axis[row]] = length
    first = di.first[di.find(v[row], owner)]
    devices = dst.columns.devices
    placed = devices[0] if len(set(devices)) == 1 else [devices[j] for j in cast("list[int]", first.tolist())]
    return Layout.from_arrays(dst.shape, part_lo, part_size, owner, placed or "cpu")


# -- facts about regions ----------------------------------------------------------------------


def _regions(si: Index, di: Index) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every non-empty intersection (u, v, lo, size) of distinct source box ``u`` and distinct destination box ``v``.

    Sorted by (v, u).
    """
    u, v = di.query(si.lo, si.hi)
    order = np.lexsort((u, v))
    u, v = u[order], v[order]
    lo = np.maximum(si.lo[u], di.lo[v])
    return u, v, lo, np.minimum(si.hi[u], di.hi[v]) - lo


def _first_shared(si: Index, di: Index, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The lowest rank that holds both ``u`` and ``v``, or -1 where none, per pair.

    Walks the shorter holder list from its lowest rank in windows of doubling width, so a
    pair whose boxes share an early rank costs O(log) and a pair that shares none the
    shorter list's length.
    """
    out = np.full(len(u), -1, np.int64)
    length = np.minimum(si.count[u], di.count[v])
    todo = np.flatnonzero(length > 0)
    done, width = 0, 1
    while todo.size:
        row, k = expand(np.minimum(length[todo] - done, width))
        pair, rank = walk_holders(si, di, u, v, todo[row], done + k)
        found, first = np.unique(pair, return_index=True)  # the lowest rank of each pair found
        out[found] = rank[first]
        todo = todo[(out[todo] < 0) & (length[todo] > done + width)]
        done, width = done + width, 2 * width
    return out


def _every_copy(ix: Index, box: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, shard) for every copy of ``box[row]``."""
    row, k = expand(ix.copy_count[box])
    return row, ix.copies[ix.copy_start[box][row] + k]


def _copies_on(ix: Index, box: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, shard) for every copy of ``box[row]`` on ``rank[row]``, shards ascending."""
    start, stop = ix.copies_of(box, rank)
    row, k = expand(stop - start)
    return row, ix.copies[start[row] + k]


def _own(ix: Index, rank: int) -> np.ndarray:
    """The distinct boxes that ``rank`` holds, ascending."""
    return np.unique(ix.box_of[ix.shards_on(rank)])


def _mine(n: int, rank: int) -> np.ndarray:
    return np.full(n, rank, np.int64)


# -- the rules, for every region (the global plan) ---------------------------------------------


def global_rows(rule: str, src: Layout, dst: Layout) -> Rows:
    """The rows of the phase ``rule`` from ``src`` to ``dst``, in canonical order (``_canonical``)."""
    si, di = index(src), index(dst)
    u, v, lo, size = _regions(si, di)
    if rule == "reduce":
        r, i = _every_copy(si, u)
        r2, j = _every_copy(di, v[r])
        r, i = r[r2], i[r2]
    elif rule == "regroup":
        r, i = _every_copy(si, u)
        j = _regroup_target(src, dst, u[r], v[r], src.columns.rank[i], i)
    else:
        r = np.arange(len(u))
        i, j = _make_ends(src, dst, u, v, _first_shared(si, di, u, v))
    return _sorted(src, dst, i, j, lo[r], size[r])


def _regroup_target(
    src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray, rank: np.ndarray, shard: np.ndarray
) -> np.ndarray:
    """The destination shard of source copy ``shard`` (of ``u``, on ``rank``) under ``regroup``."""
    si, di = index(src), index(dst)
    held = di.find(v, rank)
    out = np.empty(len(u), np.int64)
    here, away = np.flatnonzero(held >= 0), np.flatnonzero(held < 0)
    out[here] = copy_on(dst, di, v[here], rank[here], src, shard[here])
    out[away] = di.first[_turn(si, di, u[away], v[away], rank[away])]
    return out


def _turn(si: Index, di: Index, u: np.ndarray, v: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Position in ``di.held`` of the holder of ``v`` that receives from holder ``rank`` of ``u``.

    Position (p + u + v) mod m among the m holders of ``v``, p the position of ``rank`` among
    the holders of ``u``.
    """
    p = si.find(u, rank) - si.start[u]
    return di.start[v] + (p + u + v) % di.count[v]


def _make_ends(
    src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray, shared: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(source shard, destination shard) of the one row of each region under ``make``.

    Given the lowest rank holding both boxes (``shared``, -1 where none).
    """
    si, di = index(src), index(dst)
    i, j = np.empty(len(u), np.int64), np.empty(len(u), np.int64)
    here, away = np.flatnonzero(shared >= 0), np.flatnonzero(shared < 0)
    j[here] = di.first[di.find(v[here], shared[here])]
    i[here] = copy_on(src, si, u[here], shared[here], dst, j[here])
    turn = u[away] + v[away]
    i[away] = si.first[si.start[u[away]] + turn % si.count[u[away]]]
    j[away] = di.first[di.start[v[away]] + turn % di.count[v[away]]]
    return i, j


def _sorted(src: Layout, dst: Layout, i: np.ndarray, j: np.ndarray, lo: np.ndarray, size: np.ndarray) -> Rows:
    order = _canonical(src.columns.rank[i], dst.columns.rank[j], i, j, lo)
    arrays = (i[order], j[order], lo[order], size[order])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def _canonical(s_rank: np.ndarray, d_rank: np.ndarray, i: np.ndarray, j: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The order of a reduce phase's rows: both backends combine a region's contributions in that order.

    Rows are (source rank and shard ``i``, destination rank and shard ``j``, region ``lo``),
    ordered by destination shard and region, then the contributions to one region from its own
    rank first, then by rank and source shard.
    """
    # np.lexsort: the last key is the primary one.
    return np.lexsort((i, s_rank, s_rank != d_rank, *(lo[:, k] for k in range(lo.shape[1] - 1, -1, -1)), j))


# -- the rules, for one rank's regions -------------------------------------------------------


@cached(1024)
def rank_schedule(rule: str, src: Layout, dst: Layout, rank: int) -> RankSchedule:
    """``rank``'s share of the phase ``rule`` from ``src`` to ``dst``.

    Its rows of the global plan, in that plan's order, from its own boxes alone.

    Work: O(k log n) for its k boxes, plus its rows; ``make`` adds, for a region where this
    rank holds both boxes or takes a turn, the walk that finds the lowest shared rank.
    """
    i, j, lo, size = {"reduce": _reduce_rank, "regroup": _regroup_rank, "make": _make_rank}[rule](src, dst, int(rank))
    s_rank, d_rank = src.columns.rank[i], dst.columns.rank[j]
    order = _canonical(s_rank, d_rank, i, j, lo)
    side = ((s_rank == rank) + 2 * (d_rank == rank))[order]  # 1: sent, 2: received, 3: local
    send, recv, local = (order[side == k] for k in (1, 2, 3))
    return RankSchedule(
        src,
        dst,
        int(rank),
        moves(i, j, lo, size, d_rank, send),
        moves(i, j, lo, size, s_rank, recv),
        moves(i, j, lo, size, s_rank, local),
        _op(rule, src, dst),
    )


@cached(1024)
def _chain_schedule(p: PendingPlan, rank: int) -> RankSchedule:
    steps = tuple(s.for_rank(rank) for s in p.steps)
    empty = np.zeros(0, np.int64)
    none = moves(empty, empty, np.zeros((0, p.src.ndim), np.int64), np.zeros((0, p.src.ndim), np.int64),
                            empty, empty)  # fmt: skip
    return RankSchedule(p.src, p.dst, rank, none, none, none, p.op, steps)


def _concat(*parts: Rows) -> Rows:
    return tuple(np.concatenate(cols) for cols in zip(*parts))  # type: ignore[return-value]


def _reduce_rank(src: Layout, dst: Layout, rank: int) -> Rows:
    """``reduce``: this rank's copies of ``u`` to every copy of ``v`` elsewhere.

    And every copy of ``u`` to this rank's copies of ``v``.
    """
    si, di = index(src), index(dst)
    u, v, lo, size = pieces(si, di, _own(si, rank))
    r, i = _copies_on(si, u, _mine(len(u), rank))
    r2, j = _every_copy(di, v[r])
    r, i = r[r2], i[r2]
    away = dst.columns.rank[j] != rank
    sent = (i[away], j[away], lo[r[away]], size[r[away]])
    v, u, lo, size = pieces(di, si, _own(di, rank))
    r, j = _copies_on(di, v, _mine(len(v), rank))
    r2, i = _every_copy(si, u[r])
    r, j = r[r2], j[r2]
    return _concat(sent, (i, j, lo[r], size[r]))


def _regroup_rank(src: Layout, dst: Layout, rank: int) -> Rows:
    """``regroup``: this rank's copies of ``u`` where it holds no ``v`` go to the holder whose turn it is.

    It keeps its own where it holds ``v``, and receives from the holders of ``u`` outside the
    holders of ``v`` at positions p = q - u - v (mod m), q its position among them.
    """
    si, di = index(src), index(dst)
    u, v, lo, size = pieces(si, di, _own(si, rank))
    me = _mine(len(u), rank)
    away = np.flatnonzero(di.find(v, me) < 0)
    u, v, lo, size, me = u[away], v[away], lo[away], size[away], me[away]
    r, i = _copies_on(si, u, me)
    sent = (i, di.first[_turn(si, di, u, v, me)][r], lo[r], size[r])

    v, u, lo, size = pieces(di, si, _own(di, rank))
    me = _mine(len(v), rank)
    r, i = _copies_on(si, u, me)  # this rank's own summands stay
    kept = (i, copy_on(dst, di, v[r], me[r], src, i), lo[r], size[r])
    m, n, q = di.count[v], si.count[u], di.find(v, me) - di.start[v]
    c = (q - u - v) % m
    r, t = expand(np.where(c < n, (n - c + m - 1) // m, 0))  # positions c, c + m, ... below n
    holder = si.holder[si.start[u[r]] + c[r] + t * m[r]]
    outside = di.find(v[r], holder) < 0  # a holder of v keeps its summand
    r2, i = _copies_on(si, u[r[outside]], holder[outside])
    r = r[outside][r2]
    got = (i, di.first[di.find(v[r], me[r])], lo[r], size[r])
    return _concat(sent, kept, got)


def _make_rank(src: Layout, dst: Layout, rank: int) -> Rows:
    """``make``: the regions where this rank holds ``u`` and takes the sender's turn.

    Or where it holds ``v`` and either holds ``u`` too or takes the receiver's turn; the lowest
    shared rank decides which of them have a row.
    """
    si, di = index(src), index(dst)
    u, v, lo, size = pieces(si, di, _own(si, rank))
    turn = si.holder[si.start[u] + (u + v) % si.count[u]] == rank
    u, v, lo, size = u[turn], v[turn], lo[turn], size[turn]
    shared = _first_shared(si, di, u, v)
    keep = shared < 0  # (where they meet, the row is local, found below)
    i, j = _make_ends(src, dst, u[keep], v[keep], shared[keep])
    sent = (i, j, lo[keep], size[keep])

    v, u, lo, size = pieces(di, si, _own(di, rank))
    holds = si.find(u, _mine(len(u), rank)) >= 0
    turn = di.holder[di.start[v] + (u + v) % di.count[v]] == rank
    ask = np.flatnonzero(holds | turn)
    u, v, lo, size, holds = u[ask], v[ask], lo[ask], size[ask], holds[ask]
    shared = _first_shared(si, di, u, v)
    keep = np.flatnonzero(np.where(holds, shared == rank, shared < 0))
    i, j = _make_ends(src, dst, u[keep], v[keep], shared[keep])
    return _concat(sent, (i, j, lo[keep], size[keep]))
