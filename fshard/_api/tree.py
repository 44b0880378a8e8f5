"""Replica-aware helpers over pytrees of arrays, for training loops."""

from __future__ import annotations

import math
import numbers
from typing import Any, cast

import optree
import torch

from fshard._api.map import map_local
from fshard._api.move import gather, reshard, split_replicas
from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec.collective import collective
from fshard._exec.replicas import check_leaves
from fshard._layout.layout import with_partial

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
    return "".join(f"[{k!r}]" for k in keys) or "the root"


@collective("global_norm")
def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of every element of a pytree of arrays and tensors, each element counted once.

    Replicas of an array's box count once (not once per copy), a pending sum
    (``Partial``) is reduced first (its summands' norms say nothing about the value's),
    and a plain tensor counts once (it is the same value on every rank). A
    collective: every rank gets the same norm.

    >>> import torch, fshard
    >>> w = fshard.shard(torch.full((4, 2), 2.0), fshard.Replicated([0, 1, 2]))  # 3 copies
    >>> b = fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))
    >>> float(fshard.global_norm({"w": w, "b": b}))  # sqrt(8 * 2**2 + 4 * 1**2)
    6.0
    >>> float(fshard.global_norm([w, torch.tensor([2.0])]))  # a plain tensor counts once
    6.0
    """
    total = None
    for leaf in optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ShardedArray)):
        if isinstance(leaf, ShardedArray):
            value = leaf if leaf.layout.partial is None else _reduced(leaf)
            square = _gather_scalar((cast(Any, value) * value).sum())  # operators are installed on the class
        elif isinstance(leaf, torch.Tensor):
            square = _stored(leaf).pow(2).sum()
        else:
            continue
        total = square if total is None else total + square
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
        SpecError: ``max_norm`` or ``eps`` is negative, infinite or NaN.

    >>> import torch, fshard
    >>> g = fshard.shard(torch.full((4,), 3.0), fshard.Chunk(0, [0, 1]))
    >>> clipped, norm = fshard.clip_grad_norm({"g": g}, max_norm=1.0)
    >>> float(norm), round(float(fshard.global_norm(clipped)), 4)
    (6.0, 1.0)
    """
    _check_bound("max_norm", max_norm)
    _check_bound("eps", eps)
    norm = global_norm(tree)
    scale = torch.clamp(max_norm / (norm + eps), max=1.0).detach()

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * scale.to(t.dtype)

    def clip(leaf: Any) -> Any:
        if isinstance(leaf, ShardedArray):
            if leaf.layout.partial is None:
                return map_local(scaled, leaf)
            return map_local(scaled, split_replicas(leaf), linear=True)
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


def _reduced(x: ShardedArray) -> ShardedArray:
    return reshard(x, with_partial(x.layout, None))


def _gather_scalar(x: ShardedArray) -> torch.Tensor:
    return gather(x).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
