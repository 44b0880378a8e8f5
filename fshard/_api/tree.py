"""Replica-aware helpers over pytrees of arrays, for training loops."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import optree
import torch

from fshard._api.map import map_local
from fshard._api.map_trees import path_text
from fshard._api.move import gather, reshard, split_replicas
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._exec import fused as _fused
from fshard._exec.collective import collective
from fshard._exec.replicas import check_leaves
from fshard._layout.layout import Layout, ShardMeta, replica_ids, with_partial

__all__ = ["check_replicas", "clip_grad_norm", "global_norm"]


@collective("check_replicas")
def check_replicas(tree: Any) -> None:
    """Raises unless the copies of every replicated box of every array in ``tree`` hold equal data.

    A replicated box is held by several shards (``Replicated``, a mesh axis that no
    dim uses, replicas in an ``Explicit`` layout); they must hold the same bits, since
    ``gather``, ``reshard`` and ``save`` read one copy. Copies drift apart when ranks
    update them differently, most often when each rank trains on its own rows as if
    they were the whole batch. The summands of a pending sum (``Partial``) may differ
    and are not compared. A collective: each process digests the copies it holds, and
    one exchange for the whole tree compares them (none on the local backend, none
    for a tree without copies). ``save`` and ``gather`` run this check in check mode.

    Args:
        tree: a pytree whose ``ShardedArray`` leaves are checked; other leaves are ignored.

    Raises:
        ReplicaMismatchError: on every rank, naming the leaf's path in ``tree``, the box,
            the ranks grouped by the digest of their copy, and the fix.

    >>> import torch, fshard
    >>> w = fshard.shard(torch.ones(4), fshard.Replicated([0, 1]))
    >>> fshard.check_replicas({"w": w})
    >>> lay = w.layout
    >>> drifted = fshard.from_local_shards_and_layout(
    ...     [fshard.Shard(m, torch.full((4,), float(m.placement.rank))) for m in lay.shards], lay
    ... )
    >>> fshard.check_replicas({"w": drifted})
    Traceback (most recent call last):
    ...
    fshard.ReplicaMismatchError: check_replicas(): the copies of the ShardedArray at ['w'] hold different data. ...
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, ShardedArray))
    arrays = [(f"the ShardedArray at {_path(p)}", a) for p, a in zip(paths, leaves) if isinstance(a, ShardedArray)]
    check_leaves(arrays, "check_replicas()")


def _path(keys: tuple[Any, ...]) -> str:
    """A leaf's place in a tree, as indexing spells it: ``['params'][0]`` (the root: ``the root``)."""
    return path_text(keys) or "the root"


@collective("global_norm")
def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of every element of a pytree of arrays and tensors, each element counted once.

    Replicas of an array's box count once (not once per copy), a pending sum
    (``Partial``) is reduced first (its summands' norms say nothing about the value's),
    and a plain tensor counts once (it is the same value on every rank). A
    collective: every rank gets the same norm, from two exchanges for the whole tree
    (one movement reduces its pending sums, one sum adds up every process's squares),
    whatever its number of leaves.

    >>> import torch, fshard
    >>> w = fshard.shard(torch.full((4, 2), 2.0), fshard.Replicated([0, 1, 2]))  # 3 copies
    >>> b = fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))
    >>> float(fshard.global_norm({"w": w, "b": b}))  # sqrt(8 * 2**2 + 4 * 1**2)
    6.0
    >>> float(fshard.global_norm([w, torch.tensor([2.0])]))  # a plain tensor counts once
    6.0
    """
    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardedArray))
    arrays = [leaf for leaf in leaves if isinstance(leaf, ShardedArray)]
    tensors = [_stored(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)]
    wide = torch.float64 if any(x.dtype == torch.float64 for x in (*arrays, *tensors)) else torch.float32
    total = None
    for same in _by_backend(_reduced(arrays)):
        # Each box is read once, from its first copy: every copy gets the gradient of that one use.
        square = _gather_squares(_fused.regroup_tree(same, "sum"), wide)
        total = square if total is None else total + square.to(total.device)
    for t in tensors:  # the same value on every rank: once
        square = _squares(t, wide)
        total = square if total is None else total + square.to(total.device)
    if total is None:
        return torch.zeros(())
    return total.sqrt()


@collective("clip_grad_norm")
def clip_grad_norm(tree: Any, max_norm: float, eps: float = 1e-6) -> tuple[Any, torch.Tensor]:
    """The tree scaled so that its ``global_norm`` is at most ``max_norm``, and the norm before.

    Like ``torch.nn.utils.clip_grad_norm_``, but pure (a new tree) and replica-aware:
    the scale ``min(1, max_norm / (norm + eps))`` is computed once over the whole tree
    and is the same on every rank, so replicas stay equal.

    Raises:
        TypeError: ``max_norm`` or ``eps`` is not a real number.
        SpecError: ``max_norm`` or ``eps`` is negative, infinite or NaN; a leaf is a pending max or min.

    >>> import torch, fshard
    >>> g = fshard.shard(torch.full((4,), 3.0), fshard.Chunk(0, [0, 1]))
    >>> clipped, norm = fshard.clip_grad_norm({"g": g}, max_norm=1.0)
    >>> float(norm), round(float(fshard.global_norm(clipped)), 4)
    (6.0, 1.0)
    """
    _check_bound("max_norm", max_norm)
    _check_bound("eps", eps)
    leaves = optree.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, ShardedArray))
    for path, leaf in zip(leaves[0], leaves[1]):
        if isinstance(leaf, ShardedArray) and leaf.layout.partial not in (None, "sum"):
            msg = (
                f"clip_grad_norm() leaf {_path(path)} is a pending {leaf.layout.partial}: the tree's pending "
                "reductions are scaled summand by summand, which pending sums alone allow. Reduce it first "
                "(fshard.reshard(x, fshard.Replicated(ranks)), or its layout without the pending reduction)."
            )
            raise SpecError(msg)
    norm = global_norm(tree)
    scale = torch.clamp(max_norm / (norm + eps), max=1.0).detach()

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * scale.to(t.dtype)

    def clip(leaf: Any) -> Any:
        if isinstance(leaf, ShardedArray):
            if leaf.layout.partial is None:
                return map_local(scaled, leaf)
            return map_local(scaled, split_replicas(leaf), linear=True)  # a pending sum: each summand scaled
        if isinstance(leaf, torch.Tensor):
            return scaled(leaf)
        return leaf

    return optree.tree_map(clip, tree, is_leaf=lambda x: isinstance(x, ShardedArray)), norm


def _stored(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` stores, each element once: all of a dense tensor, the non-zeros of a sparse one."""
    if t.layout == torch.strided:
        return t
    return t.coalesce().values() if t.layout == torch.sparse_coo else t.values()


def _check_bound(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"clip_grad_norm() {name} must be a real number, got {value!r} ({type(value).__name__}).")
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise SpecError(f"clip_grad_norm() {name}={value!r}: give a finite number of at least 0.")


def _reduced(arrays: list[ShardedArray]) -> list[ShardedArray]:
    """``arrays`` with their pending sums reduced, all in one call (one movement per dtype and phase)."""
    pending = [k for k, a in enumerate(arrays) if a.layout.partial is not None]
    if not pending:
        return arrays
    moved = reshard([arrays[k] for k in pending], [with_partial(arrays[k].layout, None) for k in pending])
    out = list(arrays)
    for k, a in zip(pending, moved):
        out[k] = a
    return out


def _by_backend(arrays: list[ShardedArray]) -> list[list[ShardedArray]]:
    """``arrays`` grouped by backend, in order of first appearance (most trees: one group)."""
    groups: dict[int, list[ShardedArray]] = {}
    for a in arrays:
        groups.setdefault(id(a.backend), []).append(a)
    return list(groups.values())


def _squares(t: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """The sum of the squares of ``t``'s elements (their magnitudes, for a complex one), in ``wide``."""
    t = t.abs() if t.is_complex() else t
    return t.to(wide).square().sum()


def _gather_squares(arrays: list[ShardedArray], wide: torch.dtype) -> torch.Tensor:
    """The sum of the squares of every element of ``arrays`` (one backend's), each box once: one collective.

    Each process adds up the squares of the boxes whose first copy it holds, one summand per
    placement (``_summands``), and one ``gather`` sums them.
    """
    backend = arrays[0].backend
    out, owners = _summands(tuple(a.layout for a in arrays))
    if out is None:  # every array empty
        return torch.zeros((), dtype=wide)
    totals: dict[int, torch.Tensor] = {}
    for a, own in zip(arrays, owners):
        for i, t in zip(backend.addressable(a.layout), a.addressable_data):
            j = own.get(i)
            if j is not None:
                square = _squares(t, wide)
                totals[j] = square if j not in totals else totals[j] + square
    mine = backend.addressable(out)
    data = tuple(totals[j] if j in totals else torch.zeros((), dtype=wide, device=_device(out, j)) for j in mine)
    # The history of every array that needs a gradient joins each rank's result, whichever boxes it squared: a
    # backward then runs, on every rank alike, the nodes of each (a replicated one's sum of its copies' gradients
    # is a collective). Arrays without one (gradients being clipped, say) add nothing to the call.
    anchor: torch.Tensor | None = None
    for a in arrays:
        if a.requires_grad:
            zero = a._link_view().to(wide).sum()  # pyright: ignore[reportPrivateUsage]  # package-internal
            anchor = zero if anchor is None else anchor + zero.to(anchor.device)
    if not data:
        link = arrays[0]._link_view().to(wide)  # pyright: ignore[reportPrivateUsage]  # a rank holding no summand
        link = link if anchor is None else link + anchor.to(link.device)
        return gather(ShardedArray(out, (), backend, wide, link))
    if anchor is not None:  # every summand: in one process, those of every rank
        data = tuple(d + anchor.to(d.device) for d in data)
    return gather(ShardedArray(out, data, backend, wide))


@cached(256)
def _summands(layouts: tuple[Layout, ...]) -> tuple[Layout | None, tuple[dict[int, int], ...]]:
    """A pending sum of one scalar per placement that holds the first copy of some box of ``layouts``.

    And per layout, the shards whose squares count (each box's first copy, not empty), each
    mapped to its placement's summand.
    """
    placements: dict[Any, int] = {}
    owners: list[dict[int, int]] = []
    for layout in layouts:
        ids = replica_ids(layout)
        _, first = np.unique(ids, return_index=True)
        full: list[bool] = np.all(layout.columns.sz > 0, axis=1).tolist()  # a shard of no element counts nothing
        own: dict[int, int] = {}
        for i in sorted(int(i) for i in first if full[i]):
            own[i] = placements.setdefault(layout.shards[i].placement, len(placements))
        owners.append(own)
    if not placements:
        return None, tuple(owners)
    metas = [ShardMeta((), (), placement) for placement in placements]
    return Layout((), metas, "sum"), tuple(owners)


def _device(layout: Layout, j: int) -> torch.device:
    return torch.device(layout.shards[j].placement.device)
