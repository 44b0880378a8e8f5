"""Who reads what: each distinct box of every target layout read by one of its holders, then sent to the rest.

All the arrays of one load move as one byte array. Its 1-D byte space holds every
distinct non-empty box of every target layout once, packed row-major, one after
another. The **reader** layout places each box's bytes on one rank that holds the box
(chosen to balance bytes: largest boxes first, each to its least-loaded holder); the
**target** layout places them on every shard that holds the box. One ``reshard``
between the two sends each replica's bytes once, from its reader, in one collective
for the whole load; where no box is replicated the two layouts are equal and nothing
moves. A pure function of the targets, so every rank computes the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fshard._layout.index import groups
from fshard._layout.layout import Layout

__all__ = ["ReadPlan", "plan_reads"]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """The byte layouts of one load and what each byte range holds.

    ``reader`` and ``target`` are ``None`` when there are no bytes to read. Reader shard
    ``k`` holds box ``boxes[k]`` = (array number, offsets, sizes). Target shards are
    grouped by array: array ``a`` owns rows ``start[a] .. start[a + 1]``, which hold its
    non-empty shards ``shard_rows[a]`` (sorted shard indices of its layout).
    """

    reader: Layout | None
    target: Layout | None
    boxes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    start: tuple[int, ...]
    shard_rows: tuple[np.ndarray, ...]

    def row(self, array: int, shard: int) -> int | None:
        """The target row of ``shard`` of array number ``array`` (``None`` for an empty shard)."""
        rows = self.shard_rows[array]
        k = int(np.searchsorted(rows, shard))
        return self.start[array] + k if k < len(rows) and rows[k] == shard else None


@dataclasses.dataclass
class _Columns:
    lo: list[np.ndarray] = dataclasses.field(default_factory=list[np.ndarray])
    n: list[np.ndarray] = dataclasses.field(default_factory=list[np.ndarray])
    rank: list[np.ndarray] = dataclasses.field(default_factory=list[np.ndarray])
    devices: list[str] = dataclasses.field(default_factory=list[str])

    def layout(self, total: int) -> Layout:
        lo, n = np.concatenate(self.lo), np.concatenate(self.n)
        return Layout.from_arrays((total,), lo[:, None], n[:, None], np.concatenate(self.rank), self.devices)


def plan_reads(layouts: list[Layout], itemsizes: list[int]) -> ReadPlan:
    """The reader and target byte layouts of arrays in ``layouts`` (file itemsizes ``itemsizes``)."""
    target, load = _Columns(), dict[int, int]()
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    start: list[int] = []
    shard_rows: list[np.ndarray] = []
    base, rows = 0, 0
    per_box: list[tuple[int, int, int, np.ndarray, Layout]] = []  # (bytes, array, box, holders, layout)
    for a, (layout, item) in enumerate(zip(layouts, itemsizes)):
        first, idx, inverse = groups(layout)
        sizes = layout.columns.sz[first]
        nbytes = np.prod(sizes, axis=1, dtype=np.int64) * item if len(first) else np.zeros(0, np.int64)
        offsets = base + np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64) if len(first) else nbytes
        target.lo.append(offsets[inverse])
        target.n.append(nbytes[inverse])
        target.rank.append(layout.columns.rank[idx])
        shards: list[int] = idx.tolist()
        target.devices.extend(layout.columns.devices[i] for i in shards)
        order = np.argsort(inverse, kind="stable")
        cuts = np.searchsorted(inverse[order], np.arange(len(first) + 1))
        for b in range(len(first)):
            per_box.append((int(nbytes[b]), a, b, idx[order[cuts[b] : cuts[b + 1]]], layout))
        boxes.extend((a, tuple(layout.columns.lo[f].tolist()), tuple(layout.columns.sz[f].tolist())) for f in first)
        start.append(rows)
        shard_rows.append(idx)
        base, rows = base + int(nbytes.sum()), rows + len(idx)
    start.append(rows)
    if base == 0:
        return ReadPlan(None, None, (), tuple(start), tuple(shard_rows))
    reader = _readers(per_box, load, base)
    return ReadPlan(reader, target.layout(base), tuple(boxes), tuple(start), tuple(shard_rows))


def _readers(per_box: list[tuple[int, int, int, np.ndarray, Layout]], load: dict[int, int], total: int) -> Layout:
    """The reader layout: each box on its least-loaded holder, largest boxes first (boxes in byte order)."""
    chosen: list[int] = [0] * len(per_box)
    for k in sorted(range(len(per_box)), key=lambda k: (-per_box[k][0], per_box[k][1], per_box[k][2])):
        nbytes, _, _, holders, layout = per_box[k]
        ranks = layout.columns.rank[holders].tolist()
        pick = min(range(len(ranks)), key=lambda j: (load.get(ranks[j], 0), ranks[j]))
        load[ranks[pick]] = load.get(ranks[pick], 0) + nbytes
        chosen[k] = int(holders[pick])
    reader = _Columns()
    sizes = np.array([p[0] for p in per_box], np.int64)
    reader.lo.append(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
    reader.n.append(sizes)
    reader.rank.append(np.array([int(p[4].columns.rank[c]) for p, c in zip(per_box, chosen)], np.int64))
    reader.devices.extend(p[4].columns.devices[c] for p, c in zip(per_box, chosen))
    assert int(sizes.sum()) == total
    return reader.layout(total)
