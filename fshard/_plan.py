"""Plans: which box of which source shard goes to which destination shard (pure, cached)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from fshard import _boxes
from fshard._errors import SpecError
from fshard._layout import Layout

__all__ = ["Box", "Plan", "Transfer", "plan"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``box`` (global coordinates) from a source shard to a destination shard.

    ``src_box`` and ``dst_box`` name the same global box, seen from either side.
    """

    src_rank: int
    src_shard: int
    dst_rank: int
    dst_shard: int
    box: Box

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
        return np.prod(self.size, axis=1, dtype=np.int64)

    @functools.cached_property
    def _crossing(self) -> np.ndarray:
        """Transfers that cross ranks, each distinct (source, box, receiving rank) once."""
        cross = np.flatnonzero(self.src_rank != self.dst_rank)
        rows = np.c_[self.src_shard[cross], self.dst_rank[cross], self.lo[cross], self.size[cross]]
        first, _ = _boxes.unique_rows(rows)
        return cross[first]

    @property
    def elements_sent(self) -> int:
        """Elements that cross between different ranks."""
        return int(self.numel[self._crossing].sum())

    def bytes_sent(self, itemsize: int) -> int:
        """Bytes that cross between ranks for elements of ``itemsize`` bytes."""
        return self.elements_sent * int(itemsize)

    def traffic(self) -> np.ndarray:
        """A world x world matrix: elements sent from rank i (row) to rank j (column)."""
        world = int(max(self.src._rank.max(initial=-1), self.dst._rank.max(initial=-1))) + 1
        out = np.zeros((world, world), np.int64)
        cross = self._crossing
        np.add.at(out, (self.src_rank[cross], self.dst_rank[cross]), self.numel[cross])
        return out

    @functools.cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """The transfers as ``Transfer`` values."""
        sr, dr = self.src_rank.tolist(), self.dst_rank.tolist()
        return tuple(
            Transfer(sr[k], s, dr[k], d, (tuple(lo), tuple(sz)))
            for k, (s, d, lo, sz) in enumerate(
                zip(self.src_shard.tolist(), self.dst_shard.tolist(), self.lo.tolist(), self.size.tolist())
            )
        )

    def __len__(self) -> int:
        return int(self.src_shard.shape[0])

    def __iter__(self) -> Any:
        return iter(self.transfers)

    def __getitem__(self, k: int) -> Transfer:
        return self.transfers[k]

    def __repr__(self) -> str:
        return (
            f"Plan({len(self)} transfers, {self.elements_sent} elements sent "
            f"(minimum {self.min_elements_sent}), shape {self.src.shape})"
        )


@functools.lru_cache(maxsize=1024)
def plan(src: Layout, dst: Layout) -> Plan:
    """The plan that moves data from layout ``src`` to layout ``dst`` (pure, cached).

    Local copies are used wherever the receiving rank already holds an element;
    otherwise the element is sent once per receiving rank, from a replica chosen
    to balance the senders.

    Raises:
        SpecError: if the layouts have different shapes.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise SpecError(f"plan() takes two Layouts, got {type(src).__name__} and {type(dst).__name__}.")
    if src.shape != dst.shape:
        raise SpecError(f"Cannot plan between shapes {src.shape} and {dst.shape}: shapes must match.")
    return _build(src, dst)


def _nonempty(layout: Layout) -> np.ndarray:
    if not layout.ndim:
        return np.arange(len(layout.shards))
    return np.flatnonzero((layout._sz > 0).all(axis=1))


def _groups(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct non-empty boxes: (shard index of each box's first copy, shard indices, box of each)."""
    idx = _nonempty(layout)
    first, inverse = _boxes.unique_rows(np.c_[layout._lo[idx], layout._sz[idx]])
    return idx[first], idx, inverse


def _build(src: Layout, dst: Layout) -> Plan:
    d = src.ndim
    s_first, s_idx, s_box = _groups(src)
    d_first, d_idx, d_box = _groups(dst)
    slo, shi = src._lo[s_first], src._lo[s_first] + src._sz[s_first]
    dlo, dhi = dst._lo[d_first], dst._lo[d_first] + dst._sz[d_first]
    pu, pv = _boxes.intersect_pairs(slo, shi, dlo, dhi)  # (src box u, dst box v) that touch
    ilo, ihi = np.maximum(slo[pu], dlo[pv]), np.minimum(shi[pu], dhi[pv])
    # Expand each pair to every destination shard that holds box v.
    d_order = np.argsort(d_box, kind="stable")
    d_start = np.searchsorted(d_box[d_order], np.arange(len(d_first)))
    d_count = np.bincount(d_box, minlength=len(d_first))
    rep = d_count[pv]
    row_pair = np.repeat(np.arange(len(pu)), rep)
    within = np.arange(row_pair.size) - np.repeat(np.cumsum(rep) - rep, rep)
    dst_shard = d_idx[d_order[d_start[pv][row_pair] + within]]
    u = pu[row_pair]
    src_shard = _choose_sources(src, dst, s_idx, s_box, len(s_first), u, dst_shard, ihi[row_pair] - ilo[row_pair])
    lo, size = ilo[row_pair], (ihi - ilo)[row_pair]
    order = np.lexsort((dst_shard, src_shard, dst._rank[dst_shard], src._rank[src_shard]))
    numel = np.prod(size, axis=1, dtype=np.int64) if d else np.ones(len(u), np.int64)
    minimum = _min_elements(src, dst, u, dst_shard, lo, size, numel, s_idx, s_box)
    arrays = [src_shard[order], dst_shard[order], lo[order].reshape(-1, d), size[order].reshape(-1, d)]
    for a in arrays:
        a.setflags(write=False)
    return Plan(src, dst, *arrays, min_elements_sent=minimum)


def _choose_sources(
    src: Layout, dst: Layout, s_idx: np.ndarray, s_box: np.ndarray, n_boxes: int,
    u: np.ndarray, dst_shard: np.ndarray, size: np.ndarray,
) -> np.ndarray:
    """Picks the source shard of each row: a copy on the receiving rank (same device first),
    else the replica whose rank has sent the least so far."""
    replicas: list[list[int]] = [[] for _ in range(n_boxes)]
    for shard, box in zip(s_idx.tolist(), s_box.tolist()):
        replicas[box].append(shard)
    only = np.array([r[0] for r in replicas], np.int64) if n_boxes else np.zeros(0, np.int64)
    out = only[u] if len(u) else np.zeros(0, np.int64)
    multi = np.array([len(r) > 1 for r in replicas], bool)
    rows = np.flatnonzero(multi[u]) if n_boxes else np.zeros(0, np.int64)
    if not rows.size:
        return out
    s_rank, s_dev = src._rank, [s.placement.device for s in src.shards]
    d_rank = dst._rank
    load: dict[int, int] = {}
    numel = np.prod(size[rows], axis=1, dtype=np.int64).tolist() if size.shape[1] else [1] * len(rows)
    chosen: dict[tuple[int, int, tuple[int, ...]], int] = {}
    for k, row in enumerate(rows.tolist()):
        cands = replicas[int(u[row])]
        target = int(d_rank[dst_shard[row]])
        local = [c for c in cands if s_rank[c] == target]
        if local:
            device = dst.shards[int(dst_shard[row])].placement.device
            out[row] = next((c for c in local if s_dev[c] == device), local[0])
            continue
        key = (int(u[row]), target, tuple(size[row].tolist()))
        if key not in chosen:
            chosen[key] = min(cands, key=lambda c: (load.get(int(s_rank[c]), 0), int(s_rank[c]), c))
            load[int(s_rank[chosen[key]])] = load.get(int(s_rank[chosen[key]]), 0) + numel[k]
        out[row] = chosen[key]
    return out


def _min_elements(
    src: Layout, dst: Layout, u: np.ndarray, dst_shard: np.ndarray, lo: np.ndarray,
    size: np.ndarray, numel: np.ndarray, s_idx: np.ndarray, s_box: np.ndarray,
) -> int:
    """Pairs (element, receiving rank) where the rank holds no copy of the element in ``src``."""
    if not len(u):
        return 0
    width = int(max(src._rank.max(initial=0), dst._rank.max(initial=0))) + 1
    held = s_box * width + src._rank[s_idx]
    rank = dst._rank[dst_shard]
    first, _ = _boxes.unique_rows(np.c_[u, rank, lo, size])  # a rank needs each piece once
    missing = first[~np.isin(u[first] * width + rank[first], held)]
    return int(numel[missing].sum())
