"""Plans: which box of which source shard goes to which destination shard (pure, cached)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from fshard import _boxes
from fshard._errors import SpecError
from fshard._layout import Layout

__all__ = ["Box", "Plan", "Transfer", "chain", "plan"]

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
        """Number of elements moved."""
        return int(np.prod(self.box[1], dtype=np.int64))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Every transfer that turns data in layout ``src`` into data in layout ``dst``.

    Arrays hold one row per transfer: source and destination shard indices and the
    box ``[lo, lo + size)``. A destination element is written exactly once per
    destination shard; an element crosses between ranks only when the receiving
    rank holds no copy of it, and then once, so ``elements_sent == min_elements_sent``.

    Between layouts with pending reductions (``Layout.partial``) a plan has ``op``
    set (a reduce phase: transfers into one box are combined) or is a chain of
    ``phases`` (reduce-scatter, then copies to the replicas); ``elements_sent``,
    ``traffic()`` and ``transfers`` cover every phase, and ``min_elements_sent`` is
    the lower bound derived in ``fshard._reduce.lower_bound``.

    >>> from fshard import Chunk
    >>> p = plan(Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,)))
    >>> p.elements_sent, p.min_elements_sent, len(p)
    (4, 4, 2)
    """

    src: Layout
    dst: Layout
    src_shard: np.ndarray = dataclasses.field(repr=False)
    dst_shard: np.ndarray = dataclasses.field(repr=False)
    lo: np.ndarray = dataclasses.field(repr=False)
    size: np.ndarray = dataclasses.field(repr=False)
    min_elements_sent: int = 0
    op: str | None = None
    steps: tuple[Plan, ...] = ()

    @property
    def phases(self) -> tuple[Plan, ...]:
        """The single-phase plans to run in turn: ``(self,)``, or the two phases of a reduction."""
        return self.steps or (self,)

    @property
    def src_rank(self) -> np.ndarray:
        """Rank of each transfer's source shard."""
        return self.src._rank[self.src_shard]

    @property
    def dst_rank(self) -> np.ndarray:
        """Rank of each transfer's destination shard."""
        return self.dst._rank[self.dst_shard]

    @property
    def numel(self) -> np.ndarray:
        """Elements moved by each transfer."""
        return _boxes.rows_prod(self.size)

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
        return int(self.numel[self._crossing].sum())

    def bytes_sent(self, itemsize: int) -> int:
        """Bytes that cross between ranks for elements of ``itemsize`` bytes."""
        return self.elements_sent * int(itemsize)

    def traffic(self) -> np.ndarray:
        """A world x world matrix: elements sent from rank i (row) to rank j (column), every phase."""
        world = int(max(self.src._rank.max(initial=-1), self.dst._rank.max(initial=-1))) + 1
        out = np.zeros((world, world), np.int64)
        for p in self.phases:
            cross = p._crossing
            np.add.at(out, (p.src_rank[cross], p.dst_rank[cross]), p.numel[cross])
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
        return (
            f"Plan({kind}{len(self)} transfers, {self.elements_sent} elements sent "
            f"(minimum {self.min_elements_sent}), shape {self.src.shape})"
        )


def chain(src: Layout, dst: Layout, steps: tuple[Plan, ...], min_elements_sent: int) -> Plan:
    """A plan that runs ``steps`` in turn (each a single-phase plan; the first from ``src``, the last to ``dst``)."""
    empty = np.zeros(0, np.int64)
    box = np.zeros((0, len(src.shape)), np.int64)
    for a in (empty, box):
        a.setflags(write=False)
    return Plan(src, dst, empty, empty, box, box, min_elements_sent=min_elements_sent, steps=steps)


@functools.lru_cache(maxsize=1024)
def plan(src: Layout, dst: Layout) -> Plan:
    """The plan that moves data from layout ``src`` to layout ``dst`` (pure, cached).

    Local copies are used wherever the receiving rank already holds an element;
    otherwise the element is sent once per receiving rank, from a replica chosen
    to balance the senders. Pending reductions (``Layout.partial``) are planned by
    ``fshard._reduce``: reduce-scatter, then copies to the replicas.

    Raises:
        SpecError: if the layouts have different shapes.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise SpecError(f"plan() takes two Layouts, got {type(src).__name__} and {type(dst).__name__}.")
    if src.shape != dst.shape:
        raise SpecError(f"Cannot plan between shapes {src.shape} and {dst.shape}: shapes must match.")
    if src.partial is not None or dst.partial is not None:
        from fshard import _reduce

        return _reduce.build(src, dst)  # type: ignore[return-value]
    return _build(src, dst)


def _groups(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct non-empty boxes: (shard index of each box's first copy, shard indices, box of each)."""
    idx = np.flatnonzero(_boxes.rows_all(layout._sz > 0))
    first, inverse = _boxes.unique_rows(np.c_[layout._lo[idx], layout._sz[idx]])
    return idx[first], idx, inverse


def _build(src: Layout, dst: Layout) -> Plan:
    s_first, s_idx, s_box = _groups(src)
    d_first, d_idx, d_box = _groups(dst)
    slo, shi = src._lo[s_first], src._lo[s_first] + src._sz[s_first]
    dlo, dhi = dst._lo[d_first], dst._lo[d_first] + dst._sz[d_first]
    pu, pv = _boxes.intersect_pairs(slo, shi, dlo, dhi)  # (src box u, dst box v) that share elements
    ilo = np.maximum(slo[pu], dlo[pv])
    isz = np.minimum(shi[pu], dhi[pv]) - ilo
    pair, dst_shard = _to_replicas(pv, d_idx, d_box, len(d_first))
    u, lo, size = pu[pair], ilo[pair], isz[pair]
    src_shard = _choose_sources(src, dst, _Replicas(s_idx, s_box, len(s_first)), u, dst_shard, size)
    numel = _boxes.rows_prod(size)
    minimum = _min_elements(src, dst, u, pair, dst_shard, numel, s_idx, s_box)
    order = _transfer_order(src, dst, src_shard, dst_shard)
    arrays = [src_shard[order], dst_shard[order], lo[order], size[order]]
    for a in arrays:
        a.setflags(write=False)
    return Plan(src, dst, *arrays, min_elements_sent=minimum)


def _to_replicas(pv: np.ndarray, d_idx: np.ndarray, d_box: np.ndarray, n_boxes: int) -> tuple[np.ndarray, np.ndarray]:
    """Expands each pair to every destination shard holding its box: (pair of each row, dst shard)."""
    d_order = np.argsort(d_box, kind="stable")
    count = np.bincount(d_box, minlength=n_boxes)
    start = np.cumsum(count) - count
    rep = count[pv]
    pair = np.repeat(np.arange(len(pv)), rep)
    within = np.arange(pair.size) - np.repeat(np.cumsum(rep) - rep, rep)
    return pair, d_idx[d_order[start[pv][pair] + within]]


def _transfer_order(src: Layout, dst: Layout, src_shard: np.ndarray, dst_shard: np.ndarray) -> np.ndarray:
    """Rows sorted by (source rank, destination rank, source shard, destination shard)."""
    s_rank, d_rank, width = _rank_codes(src, dst)
    ranks = s_rank[src_shard] * width + d_rank[dst_shard]
    shards = src_shard * max(len(dst.shards), 1) + dst_shard
    return np.lexsort((shards, ranks))


def _rank_codes(src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray, int]:
    """Ranks of both layouts as small ints (order kept) and their bound, safe to multiply."""
    width = int(max(src._rank.max(initial=0), dst._rank.max(initial=0))) + 1
    if width <= 1 << 24:
        return src._rank, dst._rank, width
    ranks, inverse = np.unique(np.r_[src._rank, dst._rank], return_inverse=True)
    return inverse[: len(src._rank)], inverse[len(src._rank) :], len(ranks)


@dataclasses.dataclass(frozen=True)
class _Replicas:
    """The source shards of each distinct source box, lowest shard index first."""

    shard: np.ndarray  # shard indices of non-empty source shards, ascending
    box: np.ndarray  # distinct box of each
    n_boxes: int

    @functools.cached_property
    def by_box(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shards sorted by box, start of each box's run, run length)."""
        order = np.argsort(self.box, kind="stable")
        count = np.bincount(self.box, minlength=self.n_boxes)
        return self.shard[order], np.cumsum(count) - count, count


def _choose_sources(
    src: Layout, dst: Layout, reps: _Replicas, u: np.ndarray, dst_shard: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """Picks the source shard of each row: a copy on the receiving rank (same device first),
    else the replica whose rank has sent the least so far."""
    shards, start, count = reps.by_box
    out = shards[start[u]]
    rows = np.flatnonzero(count[u] > 1)
    if not rows.size:
        return out
    local = _local_replica(src, dst, reps, u[rows], dst_shard[rows])
    out[rows] = local
    remote = rows[local < 0]
    if remote.size:
        out[remote] = _balance(src, dst, reps, u[remote], dst_shard[remote], size[remote])
    return out


def _local_replica(src: Layout, dst: Layout, reps: _Replicas, u: np.ndarray, dst_shard: np.ndarray) -> np.ndarray:
    """Per row, the replica of box ``u`` on the receiving rank (same device first), or -1."""
    s_rank, d_rank, width = _rank_codes(src, dst)
    names = {name: k for k, name in enumerate(sorted(set(src._devices) | set(dst._devices)))}
    s_dev = np.array([names[src._devices[i]] for i in reps.shard.tolist()], np.int64).reshape(-1)
    d_dev = np.array([names[dst._devices[j]] for j in dst_shard.tolist()], np.int64).reshape(-1)
    held = reps.box * width + s_rank[reps.shard]  # (box, rank) of every replica
    want = u * width + d_rank[dst_shard]
    # A placement holds a box at most once, so (box, rank, device) finds at most one shard.
    exact = _lookup(held * len(names) + s_dev, want * len(names) + d_dev, reps.shard)
    anywhere = _lookup(held, want, reps.shard)  # lowest shard index on that rank
    return np.where(exact >= 0, exact, anywhere)


def _lookup(keys: np.ndarray, queries: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` at the first position (in a stable sort) of each query among ``keys``, or -1."""
    order = np.argsort(keys, kind="stable")
    srt = keys[order]
    pos = np.minimum(np.searchsorted(srt, queries), len(srt) - 1)
    return np.where(srt[pos] == queries, values[order[pos]], -1)


def _balance(
    src: Layout, dst: Layout, reps: _Replicas, u: np.ndarray, dst_shard: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """Greedy: each (box, receiving rank, piece size), in row order, from the least-loaded replica."""
    target = dst._rank[dst_shard]
    first, inverse = _boxes.unique_rows(np.c_[u, target, size])
    shards, start, count = reps.by_box
    s_rank = src._rank.tolist()
    numel = _boxes.rows_prod(size)
    load: dict[int, int] = {}
    chosen = np.empty(len(first), np.int64)
    for g in np.argsort(first).tolist():
        row = int(first[g])
        cands = shards[start[u[row]] : start[u[row]] + count[u[row]]].tolist()
        best = min(cands, key=lambda c: (load.get(s_rank[c], 0), s_rank[c], c))
        load[s_rank[best]] = load.get(s_rank[best], 0) + int(numel[row])
        chosen[g] = best
    return chosen[inverse]


def _min_elements(
    src: Layout,
    dst: Layout,
    u: np.ndarray,
    pair: np.ndarray,
    dst_shard: np.ndarray,
    numel: np.ndarray,
    s_idx: np.ndarray,
    s_box: np.ndarray,
) -> int:
    """Pairs (element, receiving rank) where the rank holds no copy of the element in ``src``."""
    if not len(u):
        return 0
    s_rank, d_rank, width = _rank_codes(src, dst)
    rank = d_rank[dst_shard]
    first, _ = _boxes.unique_rows(np.c_[pair, rank])  # a rank needs each piece once
    held = np.sort(s_box * width + s_rank[s_idx])
    want = u[first] * width + rank[first]
    pos = np.minimum(np.searchsorted(held, want), len(held) - 1)
    missing = first[held[pos] != want]
    return int(numel[missing].sum())
