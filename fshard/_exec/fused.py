"""Trees of arrays moved as one: every leaf's plan in one movement of a flat array.

(On a backend that spans processes: in one process a movement is copies alone, and the
leaves move one by one, to the same values.)

A movement of a tree of arrays (``reshard`` of a tree, ``shard_map``'s arguments, the
reduction of their gradients) would cost one collective per leaf. Here the leaves of one
dtype are laid end to end in one 1-D **flat array**: leaf ``l`` takes the range
``[base_l, base_l + numel_l)``, and each of its shards is the range its box covers in the
leaf's row-major order. That needs boxes that are ranges (``flat_range``: a box whose
dims after its first partial one are whole and before it are single rows, as dim-0 chunks,
replicas and whole arrays are). The flat array's layouts are ordinary layouts, so the tree
moves by one plan (cached on the tree's layouts), with one collective per phase; its
elements sent are the sum of the leaves' minimums, and each shard tensor travels as its
flattened view, so nothing is copied to pack the tree.

Gradients need no rule of their own: the flat movement is a movement (``autograd.move``),
and flattening and unflattening are views.

For the reduction of copies (``regroup``), only the boxes' sizes matter, not where they
lie: there every distinct box of every leaf gets a range of its own (``box_layout``), so
any layout fuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._exec import autograd as _autograd
from fshard._exec import buckets as _buckets
from fshard._layout.layout import Layout, replica_ids
from fshard._layout.validate import Columns

__all__ = ["Flat", "flat_layouts", "flat_range", "move_tree", "regroup_tree"]


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


def flatten(data: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Each leaf's shard tensors, leaf by leaf, as 1-D views (a copy only for a non-contiguous shard)."""
    return tuple(t.reshape(-1) for leaf in data for t in leaf)


def unflatten(
    flat: Sequence[torch.Tensor], layouts: Sequence[Layout], held: Sequence[Sequence[int]]
) -> list[tuple[torch.Tensor, ...]]:
    """The flat shards back as each leaf's shard tensors (views), ``held[l]`` the leaf's shard indices here."""
    out: list[tuple[torch.Tensor, ...]] = []
    at = 0
    for x, idx in zip(layouts, held):
        sz: Any = x.columns.sz
        out.append(tuple(flat[at + k].view(tuple(sz[i].tolist())) for k, i in enumerate(idx)))
        at += len(idx)
    return out


def _groups(arrays: Sequence[ShardedArray], keep: Sequence[bool], to: Sequence[Layout] = ()) -> list[list[int]]:
    """The positions of the kept arrays, in order, grouped by dtype, backend and pending reductions.

    Those of the arrays and of their destinations ``to`` (if given).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, (a, ok) in enumerate(zip(arrays, keep)):
        if ok:
            groups.setdefault((a.dtype, a.backend, a.layout.partial, to[k].partial if to else None), []).append(k)
    return list(groups.values())


def _like(arrays: Sequence[ShardedArray]) -> torch.Tensor:
    """The tensor that stands for the group in its movement.

    The first array's, joined to the links of the arrays that hold no shard here (so the
    backward reaches their history on this rank too).
    """
    links = [a._first() for a in arrays[1:] if not a.addressable_data]  # pyright: ignore[reportPrivateUsage]  # 0-element links
    if not links:
        return arrays[0]._first()  # pyright: ignore[reportPrivateUsage]  # package-internal
    like = arrays[0]._link_view()  # pyright: ignore[reportPrivateUsage]
    for link in links:
        like = like + link
    return like


def move_tree(
    arrays: Sequence[ShardedArray], layouts: Sequence[Layout], *, summing: bool = False
) -> list[ShardedArray]:
    """Every array moved to its layout, the arrays of one dtype in one movement where their boxes allow.

    ``summing``: the backward sums the gradients of the destination's copies (``move_summing``).
    An array already in its layout is returned as it is.
    """
    out = list(arrays)
    move = _autograd.move_summing if summing else _autograd.move
    for found in _groups(arrays, [a.layout != x for a, x in zip(arrays, layouts)], layouts):
        # In one process a movement is copies alone, which fusing would not save: leaf by leaf there.
        ranges = [k for k in found if _fusable(arrays[k].layout) and _fusable(layouts[k])]
        group = ranges if len(ranges) > 1 and arrays[found[0]].backend.spans_processes else []
        for k in found:
            if k not in group:  # boxes that are no ranges, or a leaf alone: a movement of its own
                a = arrays[k]
                data, link = move(a.layout, layouts[k], a.backend, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]
                out[k] = ShardedArray._of(layouts[k], data, a.backend, a.dtype, link)  # pyright: ignore[reportPrivateUsage]
        if not group:
            continue
        leaves = [arrays[k] for k in group]
        src, dst = tuple(a.layout for a in leaves), tuple(layouts[k] for k in group)
        flat = flat_layouts(src, dst)
        assert flat is not None  # every box is a range and the leaves share their pending reductions
        backend = leaves[0].backend
        data = tuple(t.reshape(-1) for a in leaves for t in a.addressable_data)
        moved, link = move(flat.src, flat.dst, backend, data, _like(leaves))
        at = 0
        for k, x in zip(group, dst):
            held = backend.addressable(x)
            sz: Any = x.columns.sz
            shards = tuple(moved[at + n].view(tuple(sz[i].tolist())) for n, i in enumerate(held))
            at += len(held)
            out[k] = ShardedArray._of(x, shards, backend, arrays[k].dtype, link)  # pyright: ignore[reportPrivateUsage]
    return out


def regroup_tree(arrays: Sequence[ShardedArray], mode: str) -> list[ShardedArray]:
    """``autograd.regroup`` of every array that has copies and needs a gradient, one per dtype.

    The backward of ``"sum"`` reduces the copies of every array of a dtype in one movement.
    """
    out = list(arrays)
    needs = [a.requires_grad and a.layout.partial is None and _has_copies(a.layout) for a in arrays]
    for group in _groups(arrays, needs):
        leaves = [arrays[k] for k in group]
        backend = leaves[0].backend
        if not backend.spans_processes:  # copies in one process: nothing to fuse
            for k, a in zip(group, leaves):
                data, link = _autograd.regroup(a.layout, backend, mode, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]
                out[k] = ShardedArray(a.layout, data, backend, a.dtype, link)
            continue
        layouts = tuple(a.layout for a in leaves)
        data = tuple(t for a in leaves for t in a.addressable_data)
        bucketed = None
        if mode == "sum" and not torch._C._are_functorch_transforms_active():  # pyright: ignore[reportPrivateUsage]  # no public check
            bucketed = _buckets.sum_in_buckets(layouts, backend, data, _like(leaves))
        if bucketed is not None:  # the blocks as they come: the function's uses of them are tapped
            flat, link = bucketed
        else:
            flat, link = _autograd.regroup(
                _buckets.box_layout(layouts), backend, mode, tuple(t.reshape(-1) for t in data), _like(leaves)
            )
        at = 0
        for k, a in zip(group, leaves):
            n = len(a.addressable_data)
            shards = (
                flat[at : at + n]
                if bucketed is not None
                else tuple(f.view(t.shape) for f, t in zip(flat[at:], a.addressable_data))
            )
            at += n
            out[k] = ShardedArray(a.layout, tuple(shards), backend, a.dtype, link)
    return out


@cached(1024)
def _fusable(layout: Layout) -> bool:
    """Whether ``layout`` can join a flat array.

    Every box a range of its row-major order (``flat_range``), and its copies all replicas
    or all summands (no ``terms``).
    """
    return layout.terms is None and flat_range(layout) is not None


@cached(1024)
def _has_copies(layout: Layout) -> bool:
    """Whether some box of ``layout`` is held more than once."""
    ids = replica_ids(layout)
    return len(np.unique(ids)) < len(ids)
