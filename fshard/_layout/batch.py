"""Layouts of values under ``torch.func.vmap``: a new leading batch dim that no shard splits.

``torch.func.vmap`` returns a ``ShardedArray`` result by rebuilding it from shard
tensors that gained a batch dim; ``batched_layout`` gives the layout of that
batched value, and autograd moves batched gradients between ``with_batch`` layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fshard._base.cache import cached
from fshard._errors import LayoutError
from fshard._layout.layout import Layout, ShardMeta

__all__ = ["batched_layout", "with_batch"]


def batched_layout(layout: Layout, children: Sequence[torch.Tensor], index: Sequence[int]) -> Layout | None:
    """The layout of an array whose shard tensors ``children`` gained a leading batch dim, or ``None``.

    ``children`` are the addressable shards (positions ``index`` of ``layout``) or,
    on a process without shards, the one 0-element link. ``None`` when they fit
    ``layout`` as they are. The batched layout has shape ``(B, *layout.shape)`` and
    every shard spans the batch dim whole.

    >>> import torch, fshard
    >>> lay = fshard.Chunk(0, [0, 1]).layout((4, 3))
    >>> batched_layout(lay, [torch.zeros(8, 2, 3), torch.zeros(8, 2, 3)], (0, 1)) == fshard.Layout(
    ...     (8, 4, 3), [((0, 0, 0), (8, 2, 3), 0), ((0, 2, 0), (8, 2, 3), 1)]
    ... )
    True

    Raises:
        LayoutError: the tensors fit neither ``layout`` nor one leading batch dim of
            ``layout`` (the message says how to get per-shard results out of ``vmap``).
    """
    if not index:  # a process without shards: its link is (0,), or (B, 0) once batched
        link = children[0] if len(children) == 1 else None
        if link is None or link.ndim != 2 or link.numel():
            return None
        return with_batch(layout, link.shape[0])
    shapes = [tuple(t.shape) for t in children]
    sizes = [layout.shards[i].sizes for i in index]
    if shapes == sizes:
        return None
    batch = {s[0] for s in shapes if len(s) == layout.ndim + 1}
    if len(children) == len(index) and len(batch) == 1 and all(s[1:] == z for s, z in zip(shapes, sizes)):
        return with_batch(layout, batch.pop())
    k = next(k for k, (s, z) in enumerate(zip(shapes, sizes)) if s != z)
    msg = (
        f"Shard {index[k]} tensor has shape {shapes[k]} but the layout gives it sizes {sizes[k]}: a pytree "
        "transform must keep every shard's shape, or (torch.func.vmap) add one leading batch dim to all of them. "
        "With vmap's out_dims other than 0, return the shard tensors (optree.tree_leaves(result)) or "
        "fshard.gather(result) from the vmapped function instead of the array."
    )
    if len(shapes[k]) == layout.ndim - 1:  # a dim fewer: vmap mapped over the shards of an array given to it
        msg += (
            " A dim fewer than the layout's: torch.func.vmap maps an array passed with in_dims=0 over its shards' "
            "first dim. Give arrays in_dims None (vmap(f, in_dims=(0, None))): an array's layout describes one "
            "sample; batch plain tensors and shard them inside the function."
        )
    raise LayoutError(msg)


@cached(256)
def with_batch(layout: Layout, batch: int) -> Layout:
    """``layout`` with a leading dim of size ``batch`` that every shard spans whole."""
    shards = tuple(ShardMeta((0, *s.offsets), (batch, *s.sizes), s.placement) for s in layout.shards)
    return Layout((batch, *layout.shape), shards, layout.partial, layout.terms)
