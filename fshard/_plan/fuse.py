"""How a tree of leaves moves as one: the flat array its leaves take ranges of, and the recipe.

A movement of a tree would cost one collective per leaf. Leaves of one dtype whose boxes
are ranges of their row-major order (``flat_range``) are laid end to end in one 1-D flat
array (``flat_layouts``), small leaves of equal layouts stacked along a new dim first; the
tree then moves by one plan of the flat array. Which leaves fuse, and how, depends on
their layouts and dtypes alone (and, for the shards a rank holds, on the backend's rank):
``recipe_of`` is made once per tree of layouts, like any plan. ``fshard._exec.fused`` runs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._base.cache import cached
from fshard._layout.layout import Layout, layout_digest, replica_ids
from fshard._layout.validate import Columns

__all__ = [
    "STACK_MAX_BYTES",
    "Flat",
    "Fused",
    "Part",
    "Recipe",
    "flat_layouts",
    "flat_range",
    "fusable",
    "has_copies",
    "packs_flat",
    "recipe_of",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Flat:
    """The flat array's layouts before and after a tree's movement.

    The shards of leaf ``l`` follow those of the leaves before it, so a rank's addressable
    shards of the flat array are its leaves' addressable shards, leaf by leaf.
    """

    src: Layout
    dst: Layout


def flat_range(layout: Layout) -> np.ndarray | None:
    """Per shard, ``(start, numel)`` of its box in the row-major order of ``layout.shape``.

    ``None`` where some non-empty box is not one range of that order: a box is one where
    every dim before its last partial one is a single row (dims after it are whole).
    """
    c: Columns = layout.columns
    n, d = c.sz.shape
    numel = np.prod(c.sz, axis=1) if d else np.ones(n, np.int64)
    if d == 0:
        return np.stack([np.zeros(n, np.int64), numel], axis=1)
    shape = np.asarray(layout.shape, np.int64)
    partial = c.sz != shape
    last = np.where(partial.any(axis=1), d - 1 - partial[:, ::-1].argmax(axis=1), -1)[:, None]
    dims = np.arange(d, dtype=np.int64).reshape(1, d)
    ok = (numel == 0) | ((dims >= last) | (c.sz == 1)).all(axis=1)
    if not bool(np.all(ok)):
        return None
    strides = np.cumprod(np.concatenate([shape[1:], [1]])[::-1])[::-1]
    start = np.where(numel > 0, c.lo @ strides, 0)
    return np.stack([start, numel], axis=1)


@cached(256)
def flat_layouts(src: tuple[Layout, ...], dst: tuple[Layout, ...]) -> Flat | None:
    """The flat array's source and destination layouts for moving leaves ``src`` to ``dst``.

    ``None`` where some box is not a range (``flat_range``), or the leaves' pending reductions differ.
    """
    if len({x.partial for x in src}) > 1 or len({x.partial for x in dst}) > 1:
        return None
    if any(x.terms is not None for x in (*src, *dst)):  # summands with replicas: each leaf its own plan
        return None
    ranges_src = [flat_range(x) for x in src]
    ranges_dst = [flat_range(x) for x in dst]
    if any(r is None for r in ranges_src) or any(r is None for r in ranges_dst):
        return None
    sizes = np.array([x.numel for x in src], np.int64)
    base = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    return Flat(
        _virtual(src, [r for r in ranges_src if r is not None], base, total),
        _virtual(dst, [r for r in ranges_dst if r is not None], base, total),
    )


def _virtual(layouts: Sequence[Layout], ranges: Sequence[np.ndarray], base: np.ndarray, total: int) -> Layout:
    """One 1-D layout of ``total`` elements: leaf ``l``'s shard ``i`` at ``base[l] + ranges[l][i]``."""
    lo = np.concatenate([b + r[:, 0] for b, r in zip(base.tolist(), ranges)])
    sz = np.concatenate([r[:, 1] for r in ranges])
    lo = np.where(sz > 0, lo, 0)
    rank = np.concatenate([x.columns.rank for x in layouts])
    devices = [d for x in layouts for d in x.columns.devices]
    return Layout.from_arrays((total,), lo[:, None], sz[:, None], rank, devices, layouts[0].partial)


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
    """Leaves that move as one piece: one leaf, or several stacked along a new dim ``dim``.

    Leaves stacked together have equal layouts before and after the movement, so a rank holds
    the same shards of each: its shard ``j`` of the stack is the leaves' shards ``j``, stacked.
    ``sizes``: the piece's destination shards here (of the stacked shape).
    """

    leaves: tuple[int, ...]
    dim: int | None
    sizes: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Fused:
    """One movement of several leaves: the layouts it moves between and its parts, in order.

    ``flat``: the parts take the ranges of a flat array (``flat_layouts``); else there is one
    part, a stack, moved in its stacked layouts. ``leaves``: the parts' leaves, in order.
    """

    src: Layout
    dst: Layout
    parts: tuple[Part, ...]
    flat: bool
    leaves: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaves", tuple(k for part in self.parts for k in part.leaves))


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How ``move_tree`` moves a tree of arrays, from their layouts alone (cached).

    ``alone``: the leaves that move one by one; ``fused``: the movements of several leaves.
    The other leaves are already in their layouts. ``tree``: where that is more than one
    movement, a digest of the tree (every leaf's layouts and dtype) that each of them
    carries in its header (``fshard._base.calls.moving_tree``); else 0.
    """

    alone: tuple[int, ...]
    fused: tuple[Fused, ...]
    tree: int = 0


# A leaf of at most this many bytes is stacked with the leaves of its layouts: a movement's
# cost per leaf (a shard per leaf to pack, unpack and index) is then paid once per stack.
# Larger leaves move as leaves of the flat array, where stacking would only add a copy.
STACK_MAX_BYTES = 1 << 20


def _stacked(layout: Layout, n: int, dim: int) -> Layout:
    """``layout`` of ``n`` arrays stacked along a new dim ``dim`` that no shard splits."""
    c: Columns = layout.columns
    rows = len(c.rank)
    lo = np.insert(c.lo.reshape(rows, layout.ndim), dim, 0, axis=1)
    sz = np.insert(c.sz.reshape(rows, layout.ndim), dim, n, axis=1)
    shape = (*layout.shape[:dim], n, *layout.shape[dim:])
    return Layout.from_arrays(shape, lo, sz, c.rank, list(c.devices), layout.partial)


def _flat_stack(src: Layout, dst: Layout, n: int) -> tuple[int, Layout, Layout] | None:
    """Where ``n`` leaves of layouts ``src -> dst`` stack with every box still a range, and the stacked layouts.

    Along a new dim 0 where that keeps them ranges (no copy to unstack), else along dim 1
    (dim-0 chunks); ``None`` where neither does.
    """
    for dim in range(min(src.ndim, 1) + 1):
        a, b = _stacked(src, n, dim), _stacked(dst, n, dim)
        if fusable(a) and fusable(b):
            return dim, a, b
    return None


@cached(256)
def recipe_of(
    src: tuple[Layout, ...], dst: tuple[Layout, ...], dtypes: tuple[torch.dtype, ...], backend: Any, sums: bool = False
) -> Recipe:
    """``move_tree``'s plan for leaves of layouts ``src`` and dtypes ``dtypes`` moving to ``dst`` on ``backend``.

    Per dtype (and pending reductions), across processes: the leaves whose boxes are ranges
    in one flat movement, small leaves of equal layouts stacked in it. Small leaves of equal
    layouts whose boxes are no ranges stack on their own (one movement per stack), and so do
    those of one process, where a movement is copies alone but a movement per leaf costs
    its call. Every other leaf moves alone. Pending sums pack in one process as across
    processes, so that their elements have the same owners, and their sums the same bits;
    so do leaves whose backward sums their copies' gradients (``sums``, where the targets
    have copies).
    """
    alone: list[int] = []
    fused: list[Fused] = []
    keys: dict[tuple[Any, ...], list[int]] = {}
    for k, (a, b, t) in enumerate(zip(src, dst, dtypes)):
        if a != b:
            keys.setdefault((t, a.partial, b.partial), []).append(k)
    for (dtype, pending, _), found in keys.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        packs = packs_flat(backend, pending, summing=sums and any(has_copies(dst[k]) for k in found))
        ranges: list[int] = []
        for members in _classes(src, dst, found, itemsize):
            first = members[0]
            stack = _stack(src[first], dst[first], members, backend, packs)
            if stack is not None:
                fused.append(stack)
            elif packs and fusable(src[first]) and fusable(dst[first]):
                ranges += members
            else:
                alone += members
        if len(ranges) > 1:
            fused.append(_fuse(src, dst, ranges, itemsize, backend))
        else:
            alone += ranges
    tree = 0
    if len(alone) + len(fused) > 1:
        h = hashlib.blake2b(repr(dtypes).encode(), digest_size=8)
        for a, b in zip(src, dst):
            h.update(layout_digest(a) + layout_digest(b))
        tree = int.from_bytes(h.digest(), "little") or 1
    return Recipe(tuple(sorted(alone)), tuple(fused), tree)


def _classes(src: tuple[Layout, ...], dst: tuple[Layout, ...], found: list[int], itemsize: int) -> list[list[int]]:
    """``found`` in classes of equal layouts before and after; a large leaf is a class of its own."""
    classes: dict[Any, list[int]] = {}
    for k in found:
        classes.setdefault((src[k], dst[k]) if src[k].numel * itemsize <= STACK_MAX_BYTES else k, []).append(k)
    return list(classes.values())


def packs_flat(backend: Any, *partials: str | None, summing: bool = False) -> bool:
    """Whether leaves with these pending reductions move in a flat array on ``backend``.

    Across processes, always; in one process only pending sums, and movements whose
    backward sums copies' gradients (``summing``), so that the summed elements have the
    owners they have across processes, and their sums the same bits.
    """
    return backend.spans_processes or summing or any(p is not None for p in partials)


def _stack(a: Layout, b: Layout, members: list[int], backend: Any, packs: bool) -> Fused | None:
    """A movement of its own for a class of leaves stacked along a new dim 0, where one is due.

    It is for several leaves whose boxes are no ranges where leaves pack in a flat array
    (``packs``: across processes, and pending sums anywhere), or for leaves that do not
    pack; not for copies that are summands with replicas.
    """
    if len(members) < 2 or a.terms is not None or b.terms is not None:
        return None
    if packs and fusable(a) and fusable(b):
        return None  # they join the flat array
    sa, sb = _stacked(a, len(members), 0), _stacked(b, len(members), 0)
    return Fused(sa, sb, (Part(tuple(members), 0, _sizes(sb, backend)),), flat=False)


def _fuse(src: tuple[Layout, ...], dst: tuple[Layout, ...], leaves: list[int], itemsize: int, backend: Any) -> Fused:
    """One flat movement of ``leaves`` (boxes that are ranges): small leaves of equal layouts stacked."""
    parts: list[Part] = []
    a_layouts: list[Layout] = []
    b_layouts: list[Layout] = []
    for members in _classes(src, dst, leaves, itemsize):
        first = members[0]
        stack = _flat_stack(src[first], dst[first], len(members)) if len(members) > 1 else None
        if stack is None:
            for k in members:
                parts.append(Part((k,), None, _sizes(dst[k], backend)))
                a_layouts.append(src[k])
                b_layouts.append(dst[k])
        else:
            dim, sa, sb = stack
            parts.append(Part(tuple(members), dim, _sizes(sb, backend)))
            a_layouts.append(sa)
            b_layouts.append(sb)
    flat = flat_layouts(tuple(a_layouts), tuple(b_layouts))
    assert flat is not None  # every box is a range and the leaves share their pending reductions
    return Fused(flat.src, flat.dst, tuple(parts), flat=True)


def _sizes(layout: Layout, backend: Any) -> tuple[tuple[int, ...], ...]:
    sz: Any = layout.columns.sz
    return tuple(tuple(sz[i].tolist()) for i in backend.addressable(layout))


@cached(1024)
def fusable(layout: Layout) -> bool:
    """Whether ``layout`` can join a flat array.

    Every box a range of its row-major order (``flat_range``), and its copies all replicas
    or all summands (no ``terms``).
    """
    return layout.terms is None and flat_range(layout) is not None


@cached(1024)
def has_copies(layout: Layout) -> bool:
    """Whether some box of ``layout`` is held more than once."""
    ids = replica_ids(layout)
    return len(np.unique(ids)) < len(ids)
