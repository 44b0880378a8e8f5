"""Where the gradients of a tree's replicated leaves are summed: its buckets, pure facts of its layouts.

The backward sums the gradients of a replicated tree's copies in **buckets** of about
``bucket_cap_mb`` (``fshard._exec.buckets`` runs them). Which leaves go in which bucket,
where each of a rank's shards sits in its bucket's buffer, and which blocks share a tap
depend on the leaves' layouts, the dtype's size, the cap and the rank alone: each is made
once and cached, like any plan.

Each bucket lays its boxes end to end, and boxes held by the same ranks make one range
(``run_layout``): where every rank holds every leaf, a bucket is one ``all_reduce`` of
one buffer. The last bucket also carries a few elements of its own (``FLAG`` and one per
leaf): the count of late gradients, a carried value, and each leaf's count of uses.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, cast

import numpy as np

from fshard._base.cache import cached
from fshard._layout.layout import Layout, layout_digest, replica_ids

__all__ = [
    "FIRST_CAP",
    "FLAG",
    "Bucket",
    "Slots",
    "box_layout",
    "buckets",
    "flag_width",
    "held_by_all",
    "run_layout",
    "run_parts",
    "bucket_slots",
    "series_name",
    "tap_groups",
]

FIRST_CAP = 1 << 20  # bytes: the first bucket, as DDP's


@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """One bucket of a tree's gradients, as one rank sees it.

    Attributes:
        runs: its 1-D layout (``run_layout`` of its leaves).
        positions: this rank's shards of its leaves, as positions among the rank's shards of the tree.
        parts: per range of ``runs`` held here, positions (into ``positions``) of its boxes, in order.
        flag: where the last bucket keeps its count (a position into ``positions``), else ``None``.
    """

    runs: Layout
    positions: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]
    flag: int | None


@cached(256)
def box_layout(layouts: tuple[Layout, ...]) -> Layout:
    """A 1-D layout in which every distinct box of every leaf has a range of its own, held where the leaf holds it.

    Copies of a box share its range. Leaves with pending reductions must not be given here.
    """
    los: list[np.ndarray] = []
    base = 0
    for x in layouts:
        ids = replica_ids(x)
        numel = np.prod(x.columns.sz, axis=1) if x.ndim else np.ones(len(ids), np.int64)
        _, first = np.unique(ids, return_index=True)
        per_box = numel[first]
        starts = base + np.cumsum(per_box) - per_box
        los.append(np.where(numel > 0, starts[np.searchsorted(ids[first], ids)], 0))
        base += int(per_box.sum())
    sz = np.concatenate(
        [np.prod(x.columns.sz, axis=1) if x.ndim else np.ones(len(x.columns.rank), np.int64) for x in layouts]
    )
    rank = np.concatenate([x.columns.rank for x in layouts])
    devices = [d for x in layouts for d in x.columns.devices]
    return Layout.from_arrays((base,), np.concatenate(los)[:, None], sz[:, None], rank, devices)


@cached(256)
def run_layout(layouts: tuple[Layout, ...]) -> Layout | None:
    """``box_layout`` with every run of consecutive boxes held by the same ranks made one range.

    Where every rank holds every leaf (data parallel), that is one range, held whole by
    every rank: the sum of its copies is one ``all_reduce``. ``None`` where a rank holds
    some box twice. Leaves with pending reductions must not be given here.
    """
    c = box_layout(layouts).columns
    lo, sz, rank = c.lo[:, 0], c.sz[:, 0], c.rank
    holders: dict[int, list[tuple[int, str]]] = {}
    ends: dict[int, int] = {}
    for i in np.lexsort((rank, lo)).tolist():
        if sz[i] > 0:
            holders.setdefault(int(lo[i]), []).append((int(rank[i]), str(cast(Any, c.devices)[i])))
            ends[int(lo[i])] = int(lo[i] + sz[i])
    spans: list[tuple[int, int, tuple[tuple[int, str], ...]]] = []
    for start in sorted(holders):
        who = tuple(holders[start])
        if len({r for r, _ in who}) < len(who):
            return None
        if spans and spans[-1][1] == start and spans[-1][2] == who:
            spans[-1] = (spans[-1][0], ends[start], who)
        else:
            spans.append((start, ends[start], who))
    rows = [(a, b - a, r, d) for a, b, who in spans for r, d in who]
    total = int(box_layout(layouts).shape[0])
    at, size, ranks, devices = zip(*rows) if rows else ((), (), (), ())
    column = functools.partial(np.array, dtype=np.int64)
    return Layout.from_arrays(
        (total,), column(at).reshape(-1, 1), column(size).reshape(-1, 1), column(ranks), list(devices)
    )


@cached(256)
def run_parts(layouts: tuple[Layout, ...], rank: int) -> tuple[tuple[int, ...], ...]:
    """Per range of ``run_layout`` held by ``rank``, the positions of its boxes among the rank's shards.

    The rank's shards are its shards of every leaf, leaf by leaf (``box_layout``'s order);
    each range lists its boxes in their order in the range. Empty shards are in no range.
    """
    boxes = box_layout(layouts)
    runs = run_layout(layouts)
    assert runs is not None  # only called where the ranges exist
    mine = boxes.indices_on(rank)
    lo, sz = boxes.columns.lo[list(mine), 0], boxes.columns.sz[list(mine), 0]
    out: list[tuple[int, ...]] = []
    for j in runs.indices_on(rank):
        start, size = int(runs.columns.lo[j, 0]), int(runs.columns.sz[j, 0])
        inside = np.flatnonzero((sz > 0) & (lo >= start) & (lo < start + size))
        out.append(tuple(inside[np.argsort(lo[inside], kind="stable")].tolist()))
    return tuple(out)


# The last bucket's own elements: the count of late gradients, a carried value (``carrying``), then one per
# leaf, the number of ranks whose blocks of it had a gradient (a leaf no rank used gets none, as in torch).
FLAG = 2


def flag_width(layouts: tuple[Layout, ...]) -> int:
    return FLAG + len(layouts)


@cached(256)
def _flag_layout(layouts: tuple[Layout, ...]) -> Layout:
    """The flag's elements (``flag_width``) held by every rank that holds a shard of leaf 0 (every leaf's ranks)."""
    devices: dict[int, str] = {}
    for r, d in zip(layouts[0].columns.rank.tolist(), layouts[0].columns.devices):  # every rank holds leaf 0
        devices.setdefault(int(r), d)
    ranks = sorted(devices)
    n, width = len(ranks), flag_width(layouts)
    lo, sz = np.zeros((n, 1), np.int64), np.full((n, 1), width, np.int64)
    return Layout.from_arrays((width,), lo, sz, np.array(ranks, np.int64), [devices[r] for r in ranks])


@cached(256)
def buckets(layouts: tuple[Layout, ...], itemsize: int, cap: int, rank: int) -> tuple[Bucket, ...] | None:
    """The buckets of a tree of leaves with ``layouts``, in launch order, as rank ``rank`` sees them.

    ``None`` where some bucket's boxes make no ranges (``run_layout``).
    """
    held = [len(x.indices_on(rank)) for x in layouts]
    base = np.cumsum([0, *held]).tolist()
    groups: list[list[int]] = [[]]
    size, limit = 0, min(cap, FIRST_CAP)
    for leaf in reversed(range(len(layouts))):
        if groups[-1] and size + layouts[leaf].numel * itemsize > limit:
            groups.append([])
            size, limit = 0, cap
        groups[-1].append(leaf)
        size += layouts[leaf].numel * itemsize
    out: list[Bucket] = []
    for k, leaves in enumerate(groups):
        last = k == len(groups) - 1
        members = tuple(layouts[leaf] for leaf in leaves) + ((_flag_layout(layouts),) if last else ())
        runs = run_layout(members)
        if runs is None:
            return None
        positions = tuple(p for leaf in leaves for p in range(base[leaf], base[leaf + 1]))
        out.append(Bucket(runs, positions, run_parts(members, rank), len(positions) if last else None))
    return tuple(out)


@cached(256)
def series_name(plan: tuple[Bucket, ...]) -> str:
    """A name of the buckets' layouts, the same on every rank: ranks whose buckets differ anywhere differ here."""
    h = hashlib.blake2b(digest_size=8)
    for bucket in plan:
        h.update(layout_digest(bucket.runs))
    return f"buckets {len(plan)} {h.hexdigest()}"


@dataclasses.dataclass(frozen=True, eq=False)
class Slots:
    """Where each of a rank's shards sits in its bucket: ``where[position] = (bucket, range, offset)``.

    ``where[-1]`` is the slot of the flag (``flag`` elements: the count, the carried value, the leaves'
    uses); ``leaves[position]`` a shard's leaf; ``widths[bucket][range]`` the elements of each of
    the range's entries, in order (a split of the range's tensor cuts it into them); ``boxes[bucket]``
    the shards that have a slot in it (an empty shard has none).
    """

    where: dict[int, tuple[int, int, int]]
    leaves: tuple[int, ...]
    flag: int
    widths: tuple[tuple[tuple[int, ...], ...], ...]
    boxes: tuple[int, ...]


@cached(256)
def bucket_slots(layouts: tuple[Layout, ...], itemsize: int, cap: int, rank: int) -> Slots:
    plan = buckets(layouts, itemsize, cap, rank)
    assert plan is not None  # only asked where the buckets exist
    numels = tuple(int(np.prod(x.columns.sz[i], dtype=np.int64).item()) for x in layouts for i in x.indices_on(rank))
    leaves = tuple(k for k, x in enumerate(layouts) for _ in x.indices_on(rank))
    width = flag_width(layouts)
    where: dict[int, tuple[int, int, int]] = {}
    widths: list[tuple[tuple[int, ...], ...]] = []
    for b, bucket in enumerate(plan):
        ranges: list[tuple[int, ...]] = []
        for j, part in enumerate(bucket.parts):
            at = 0
            sizes: list[int] = []
            for q in part:
                flag = q == bucket.flag
                where[-1 if flag else bucket.positions[q]] = (b, j, at)
                sizes.append(width if flag else numels[bucket.positions[q]])
                at += sizes[-1]
            ranges.append(tuple(sizes))
        widths.append(tuple(ranges))
    boxes = tuple(sum(p in where for p in bucket.positions) for bucket in plan)
    return Slots(where, leaves, width, tuple(widths), boxes)


@cached(256)
def held_by_all(layouts: tuple[Layout, ...], ranks: tuple[int, ...]) -> bool:
    """Whether every rank of ``ranks`` holds a shard of every leaf of ``layouts``, and no other rank does."""
    group = set(ranks)
    return all(set(x.ranks) == group for x in layouts)


@cached(256)
def tap_groups(layouts: tuple[Layout, ...], itemsize: int, cap: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The positions that share a tap: those of runs of one bucket's leaves of at most ``FIRST_CAP`` bytes.

    A tap's node holds its blocks' gradients until the last of them is in, so a run is kept
    small (a larger leaf is a run alone): a bucket of 25 MiB tapped whole held up to 25 MiB of
    gradients more than copying each into the bucket as it comes. Runs are cut by the leaves'
    whole sizes, last leaf first (the backward's order), so every rank makes the same tap nodes
    at the same uses (the engine orders the backward's nodes by when they were made), its empty
    blocks included.
    """
    plan = buckets(layouts, itemsize, cap, rank)
    assert plan is not None  # only asked where the buckets exist
    held = [len(x.indices_on(rank)) for x in layouts]
    base = np.cumsum([0, *held]).tolist()
    leaf_of = np.repeat(np.arange(len(layouts)), held)
    bucket_of = {int(leaf_of[p]): b for b, bucket in enumerate(plan) for p in bucket.positions}
    groups: list[list[int]] = []
    bucket, size = None, 0
    for leaf in reversed(range(len(layouts))):
        nbytes = layouts[leaf].numel * itemsize
        if not groups or bucket_of[leaf] != bucket or size + nbytes > FIRST_CAP:
            groups.append([])
            bucket, size = bucket_of[leaf], 0
        groups[-1].extend(range(base[leaf], base[leaf + 1]))
        size += nbytes
    return tuple(tuple(g) for g in groups if g)
