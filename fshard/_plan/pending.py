r"""Plans between layouts with pending reductions (``Layout.partial``).

A *reduce phase* is a ``Plan`` with ``op`` set: its rows are contributions, and each
destination region receives the ``op`` of every contribution aimed at it (a region
that none reaches holds the identity: 0 for a sum). Contributions from one rank to
one region on another rank are combined on the sender first and sent once.

A partial layout's summands of a box fall into *groups*, each held by its own ranks
(``fshard._layout.summands``): with ``Layout.terms``, copies of one summand are replicas
and any one of them may be read; without, every copy is a summand and a group is a box's
copies on one rank. A reduction reads each group once, from one of its ranks.

- partial -> non-partial: each element's a groups of summands go to one owner (a rank
  of the destination D that holds a summand when there is one), which reduces them;
  when the destination replicates the element, the owner then sends the result to the
  other ranks of D. The reduction is split among the candidate owners (reduce-scatter
  then all-gather), and the plan holds the two phases. Elements sent per element:
  a + |D| - 2 when the source ranks S and D share a rank, else a + |D| - 1, which is the
  lower bound (see ``lower_bound``).
- partial -> partial (same op, no replicated destination summands): a group stays where
  a rank of D holds it, else it goes to one destination copy: one element per group that
  D does not hold.
- non-partial -> partial: one copy of each element holds the value (the identity
  elsewhere), taken from a rank that holds it where possible: 0 or 1 per element; where
  the destination's summands have replicas, the group of them that lacks the fewest
  copies takes it (``fshard._plan.terms``).
- partial -> partial of another op, or into replicated summands: reduce at one owner,
  then make (two phases); a layout to itself: every copy stays (``keep``).

Each phase follows a *rule* that gives the rows of a region (the intersection of a
distinct source box ``u`` and a distinct destination box ``v``, numbered as
``fshard._plan.schedule.index`` numbers them) from facts about ``u`` and ``v`` alone: their
holders (ranks ascending), their groups of summands and their copies (shards). With S
the holders of ``u`` and D (m ranks) those of ``v``:

- ``reduce`` (to one owner per element): one read of every group of ``u`` to every copy
  of ``v``: from the receiver's own copies where it holds the group, else from the
  group's rank at the receiver's position in its own group (the same row of a mesh), or,
  where the receiver holds no summand, at position (u + v) mod (the group's ranks);
- ``regroup`` (partial to partial, same op): a group that a rank of D holds stays on the
  lowest such rank, going to its copy of ``v`` (on the same device if there is one, else
  its lowest-index copy); the group at position o among those of ``u`` that D does not
  hold goes from its rank at position (u + v) mod (its ranks) to the holder at position
  (o + u + v) mod m of D: the receivers take turns;
- ``make`` (a value to a partial layout): the lowest rank in both S and D keeps its
  copy (the one on its destination copy's device, else its lowest); where S and D do
  not meet, the holder at position (u + v) mod |S| of S sends to the holder at
  position (u + v) mod m of D. Into replicated summands, see ``fshard._plan.terms``.

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
from fshard._layout.index import Holders, Index, expand, index, pieces
from fshard._layout.layout import Layout, with_partial
from fshard._layout.summands import summands
from fshard._plan import schedule as _schedule
from fshard._plan import terms as _terms
from fshard._plan.direct import Plan, numels
from fshard._plan.routing import copy_on, shared_holders, walk_holders
from fshard._plan.schedule import Moves, RankSchedule, moves

__all__ = ["PendingPlan", "build", "lower_bound", "rank_schedule"]

Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # source shard, destination shard, lo, size

RULES = ("reduce", "regroup", "make", "keep")


class PendingPlan(Plan):
    """A plan between layouts with a pending reduction.

    One phase under ``rule`` (``"reduce"``, ``"regroup"``, ``"make"`` or ``"keep"``, see
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
    if dst.partial is None:
        return _reduce(src, dst)
    if src == dst:
        return _phase("keep", src, dst)
    if dst.partial == src.partial and dst.terms is None:
        return _phase("regroup", src, dst)
    # Another op, or summands with replicas: reduce at one owner per element, which keeps the result.
    owners = _owners(src, with_partial(dst, None))
    steps = (_phase("reduce", src, owners), _phase("make", owners, dst))
    return PendingPlan(src, dst, "chain", sum(s.min_elements_sent for s in steps), steps)


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

    Per element with source ranks S and destination ranks D. A partial source's summands
    fall into a groups, each held (as replicas) by its own ranks (``fshard._layout.summands``;
    without ``terms``, a group per rank of S). A partial source needs every group but one
    to send (from any of its ranks), and every destination rank but one to receive after
    the reduction is complete, so a + |D| - 1 - [S and D meet] (the bandwidth-optimal
    all-reduce sends 2(n - 1) per element); a non-partial source needs |D \ S|; to a
    partial destination of the same op without replicated summands, one element for each
    group that no rank of D holds, and from a value [S and D are disjoint]; to a partial
    destination whose summands have replicas (groups E), from a value min over E of |E \ S|.
    Other pairs (another op, or from a partial source to replicated summands) reduce at one
    owner per element, which keeps the result: the bound of those two phases.
    """
    if src.partial is not None and src == dst:
        return 0
    if src.partial is not None and dst.partial is not None and (dst.partial != src.partial or dst.terms is not None):
        owners = _owners(src, with_partial(dst, None))
        return lower_bound(src, owners) + lower_bound(owners, dst)
    si, di = index(src), index(dst)
    u, v, _, size = _regions(si, di)
    d_count = di.count[v]
    pair, rank = shared_holders(si, di, u, v)
    both = np.bincount(pair, minlength=len(u)).astype(np.int64)
    meet = (both > 0).astype(np.int64)
    if src.partial is None and dst.partial is None:
        need = d_count - both
    elif src.partial is None:
        need = 1 - meet if dst.terms is None else _terms.make_choice(src, dst, u, v)[1]
    else:
        ss = summands(src)
        groups = ss.groups[u]
        if dst.partial is None:
            need = groups + d_count - 1 - meet
        else:  # the same op: a group that meets D stays
            found = np.unique(pair * len(ss.count) + ss.group_of[si.find(u[pair], rank)])
            need = groups - np.bincount(found // max(len(ss.count), 1), minlength=len(u))
    numel = numels(size)  # Python ints where they could wrap around in int64
    if not len(need) or int(need.max()) * int(numel.sum()) < 2**62:  # no int64 overflow
        return int(np.dot(need, numel))
    return sum(map(operator.mul, need.tolist(), numel.tolist()))


def _owners(src: Layout, dst: Layout) -> Layout:
    """A non-partial layout with one copy of each element, on the rank that will reduce it.

    Each region's candidates are the destination ranks that hold a summand (else all
    destination ranks); the region (the k-th, in ``_regions`` order) is split along its
    longest dim into as many parts as candidates, as ``Chunk`` splits, part t
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
    # Parts: Chunk's split of extent into count along the longest dim (one part for a 0-d array).
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


def _first_shared(si: Holders, di: Holders, u: np.ndarray, v: np.ndarray) -> np.ndarray:
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
    if rule == "keep":
        return _kept(src, si.copies)
    u, v, lo, size = _regions(si, di)
    if rule == "reduce":
        r, j = _every_copy(di, v)
        r, j, i = _reduce_rows(src, u[r], v[r], dst.columns.rank[j], r, j)
    elif rule == "regroup":
        r, i, j = _regroup_rows(src, dst, u, v)
    elif dst.terms is not None:
        r, i, j = _terms.make_rows(src, dst, u, v)
    else:
        r = np.arange(len(u))
        i, j = _make_ends(src, dst, u, v, _first_shared(si, di, u, v))
    return _sorted(src, dst, i, j, lo[r], size[r])


def _senders(src: Layout, u: np.ndarray, v: np.ndarray, group: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per row, the rank that contributes summand ``group`` of ``u`` to the piece of ``v`` on ``rank``.

    ``rank`` itself where it holds the group; else the group's rank at ``rank``'s own position
    among the ranks of its group of ``u`` (the same row of a mesh), or where ``rank`` holds no
    copy of ``u``, at position (u + v) mod (the group's ranks): the replicas take turns.
    """
    si, ss = index(src), summands(src)
    own = si.find(u, rank)
    q = np.where(own >= 0, ss.position[np.maximum(own, 0)], u + v)
    other = ss.holder[ss.start[group] + q % ss.count[group]]
    return np.where(ss.find(group, rank) >= 0, rank, other)


def _reduce_rows(
    src: Layout, u: np.ndarray, v: np.ndarray, rank: np.ndarray, r: np.ndarray, j: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``reduce`` into destination shards ``j`` (on ``rank``) of pieces ``r``: one read of every summand of ``u``.

    Returns the rows as (piece, destination shard, source shard).
    """
    si, ss = index(src), summands(src)
    row, t = expand(ss.groups[u])
    group = ss.first[u[row]] + t
    h = _senders(src, u[row], v[row], group, rank[row])
    row2, i = ss.read(si.find(u[row], h))
    row = row[row2]
    return r[row], j[row], i


def _regroup_rows(src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``regroup`` of the pieces (u, v): (piece, source shard, destination shard) rows.

    A group of summands that some rank of D holds stays on the lowest such rank (its copy of
    ``v`` on the same device, else its lowest); the group at position o among the groups of
    ``u`` that D does not hold goes from its rank at position (u + v) mod (its ranks) to the
    holder of ``v`` at position (o + u + v) mod m: the receivers take turns.
    """
    si, di, ss = index(src), index(dst), summands(src)
    r, t = expand(ss.groups[u])
    group = ss.first[u[r]] + t
    keeper = _first_shared(ss, di, group, v[r])
    here, away = np.flatnonzero(keeper >= 0), np.flatnonzero(keeper < 0)
    r2, i = ss.read(si.find(u[r[here]], keeper[here]))
    row = here[r2]
    kept = (r[row], i, copy_on(dst, di, v[r[row]], keeper[row], src, i))
    uu, vv, ga = u[r[away]], v[r[away]], group[away]
    sender = ss.holder[ss.start[ga] + (uu + vv) % ss.count[ga]]
    receiver = di.first[di.start[vv] + (t[away] + uu + vv) % di.count[vv]]
    r2, i = ss.read(si.find(uu, sender))
    sent = (r[away][r2], i, receiver[r2])
    return tuple(np.concatenate(c) for c in zip(kept, sent))  # type: ignore[return-value]


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


def _kept(src: Layout, shards: np.ndarray) -> Rows:
    """``keep``: every non-empty shard to itself."""
    return _sorted(src, src, shards, shards, src.columns.lo[shards], src.columns.sz[shards])


def _keep_moves(src: Layout, shards: np.ndarray) -> tuple[Moves, Moves, Moves]:
    """One rank's ``keep``: nothing sent or received, its own shards copied locally."""
    i, j, lo, size = _kept(src, shards)
    none = np.zeros(0, np.int64)
    rank = src.columns.rank[i]
    return (moves(i, j, lo, size, rank, none), moves(i, j, lo, size, rank, none),
            moves(i, j, lo, size, rank, np.arange(len(i))))  # fmt: skip


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
    if rule == "keep":
        i = np.unique(index(src).shards_on(rank))
        return RankSchedule(src, dst, int(rank), *_keep_moves(src, i), _op(rule, src, dst))
    rows = {"reduce": _reduce_rank, "regroup": _regroup_rank, "make": _make_rank}[rule]
    if rule == "make" and dst.terms is not None:
        rows = _terms.make_rank
    i, j, lo, size = rows(src, dst, int(rank))
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
    """``reduce``: this rank's summands of ``u`` to every copy of ``v`` elsewhere that reads them from it.

    And one read of every summand of ``u`` to this rank's copies of ``v``.
    """
    si, di, ss = index(src), index(dst), summands(src)
    u, v, lo, size = pieces(si, di, _own(si, rank))
    me = _mine(len(u), rank)
    group = ss.group_of[si.find(u, me)]
    r, j = _every_copy(di, v)
    theirs = dst.columns.rank[j]
    mine = np.flatnonzero((theirs != rank) & (_senders(src, u[r], v[r], group[r], theirs) == rank))
    r, j = r[mine], j[mine]
    r2, i = ss.read(si.find(u[r], me[r]))
    r, j = r[r2], j[r2]
    sent = (i, j, lo[r], size[r])
    v, u, lo, size = pieces(di, si, _own(di, rank))
    r, j = _copies_on(di, v, _mine(len(v), rank))
    r, j, i = _reduce_rows(src, u[r], v[r], _mine(len(r), rank), r, j)
    return _concat(sent, (i, j, lo[r], size[r]))


def _regroup_rank(src: Layout, dst: Layout, rank: int) -> Rows:
    """``regroup``: this rank's group of ``u`` goes to the receiver whose turn it is, where it sends it.

    It keeps its group where it is the lowest rank of the group that holds ``v``, and receives
    the groups at positions o = q - u - v (mod m) among those of ``u`` (q its position among
    the holders of ``v``) that no holder of ``v`` keeps.
    """
    si, di, ss = index(src), index(dst), summands(src)
    u, v, lo, size = pieces(si, di, _own(si, rank))
    me = _mine(len(u), rank)
    group = ss.group_of[si.find(u, me)]
    sender = ss.holder[ss.start[group] + (u + v) % ss.count[group]]
    go = np.flatnonzero((sender == rank) & (_first_shared(ss, di, group, v) < 0))
    u, v, lo, size, me, group = u[go], v[go], lo[go], size[go], me[go], group[go]
    receiver = di.first[di.start[v] + (group - ss.first[u] + u + v) % di.count[v]]
    r, i = ss.read(si.find(u, me))
    sent = (i, receiver[r], lo[r], size[r])

    v, u, lo, size = pieces(di, si, _own(di, rank))
    me = _mine(len(v), rank)
    own = si.find(u, me)
    held = np.flatnonzero(own >= 0)
    keep = held[_first_shared(ss, di, ss.group_of[own[held]], v[held]) == rank]  # this rank's group stays
    r, i = ss.read(own[keep])
    r = keep[r]
    kept = (i, copy_on(dst, di, v[r], me[r], src, i), lo[r], size[r])
    m, n, q = di.count[v], ss.groups[u], di.find(v, me) - di.start[v]
    c = (q - u - v) % m
    r, t = expand(np.where(c < n, (n - c + m - 1) // m, 0))  # positions c, c + m, ... below n
    group = ss.first[u[r]] + c[r] + t * m[r]
    outside = np.flatnonzero(_first_shared(ss, di, group, v[r]) < 0)  # no holder of v keeps it
    r, group = r[outside], group[outside]
    r2, i = ss.read(si.find(u[r], ss.holder[ss.start[group] + (u[r] + v[r]) % ss.count[group]]))
    r = r[r2]
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
