"""``discard_kept_aside``: a step given up drops what ``no_sync`` keeps aside for its parameters."""

from __future__ import annotations

import hashlib
from typing import Any

import optree
import torch

from fshard._array.array import ShardedArray
from fshard._errors import CollectiveMismatchError
from fshard._exec import accumulate
from fshard._exec.collective import collective
from fshard._layout.layout import layout_digest

__all__ = ["discard_kept_aside"]


@collective("discard_kept_aside")
def discard_kept_aside(params: Any) -> None:
    """Drops the gradients that ``no_sync()`` keeps aside for the arrays of ``params``: a step given up.

    ``opt.zero_grad()`` leaves them, since they are not in ``.grad`` (each rank's own, not yet
    summed), so a step given up after some micro-batches (a loss that is not finite, an error in a
    later micro-batch's forward) would add them to the next step's. Call this instead, on every
    rank, with the tree of arrays the optimizer holds. It also drops what a backward that raised
    put back, so the next call over those arrays runs rather than refusing it.

    Across processes, every rank compares the arrays' layouts (one ``all_reduce`` of three
    numbers): ranks that drop different arrays, or that drop where others do not, would add
    different micro-batches to one sum.

    >>> import torch, fshard
    >>> params = {"w": fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))}
    >>> fshard.discard_kept_aside(params)   # where a step is given up, on every rank

    ``docs/training.md`` shows it in a loop of micro-batches.

    Raises:
        TypeError: a leaf of ``params`` is not a ``ShardedArray``.
        SpecError: called while a backward runs (from a hook).
        CollectiveMismatchError: across processes, the ranks passed arrays of different layouts.
    """
    arrays = optree.tree_leaves(params, is_leaf=lambda a: isinstance(a, ShardedArray), none_is_leaf=True)
    for a in arrays:
        if not isinstance(a, ShardedArray):
            msg = (
                f"discard_kept_aside() takes a tree of ShardedArrays (the parameters the optimizer holds), "
                f"got a leaf of type {type(a).__name__}."
            )
            raise TypeError(msg)
    tensors: list[torch.Tensor] = [t for a in arrays for t in optree.tree_leaves(a)]  # the blocks and the link
    accumulate.discard(tensors)
    backends = {id(a.backend): a.backend for a in arrays if a.backend.spans_processes}
    if not backends:
        return
    h = hashlib.blake2b(b"discard_kept_aside", digest_size=8)
    for a in arrays:
        h.update(layout_digest(a.layout))
    digest = int.from_bytes(h.digest(), "big") >> 2
    for backend in backends.values():
        if not backend.alike(digest):
            msg = (
                "fshard.discard_kept_aside(): the ranks passed arrays of different layouts, so they would drop "
                "the gradients of different arrays: pass the same tree (the optimizer's parameters) on every rank."
            )
            raise CollectiveMismatchError(msg)
