"""``discard_kept_aside``: a step given up drops what ``no_sync`` keeps aside for its parameters."""

from __future__ import annotations

import hashlib
from typing import Any

import optree
import torch

from fshard._array.array import ShardedArray
from fshard._errors import CollectiveMismatchError, SpecError
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

    Across processes, the ranks compare the arrays' layouts first (one ``all_reduce`` of three
    numbers per process group of the arrays that this rank belongs to), and drop nothing unless
    every rank passed the same: ranks that dropped different arrays would add different
    micro-batches to one sum. Arrays moved in one call with others (a tree moved as one) share
    what is kept aside: they are dropped together, so the tree must hold all of them.

    >>> import torch, fshard
    >>> params = {"w": fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))}
    >>> fshard.discard_kept_aside(params)   # where a step is given up, on every rank

    ``docs/training.md`` shows it in a loop of micro-batches.

    Raises:
        TypeError: a leaf of ``params`` is not a ``ShardedArray``.
        SpecError: called while a backward runs (from a hook), or gradients kept aside for some of the
            arrays were moved in one call with arrays that ``params`` lacks; nothing is dropped.
        CollectiveMismatchError: across processes, the ranks passed arrays of different layouts, or
            another rank raised ``SpecError``; nothing is dropped.
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
    refused: SpecError | None = None
    try:
        found = accumulate.kept_for(tensors)
    except SpecError as exc:  # raised after the comparison, which tells the other ranks
        refused, found = exc, []
    h = hashlib.blake2b(b"discard_kept_aside", digest_size=8)
    for a in arrays:
        h.update(layout_digest(a.layout))
    digest = None if refused is not None else int.from_bytes(h.digest(), "big") >> 2
    groups = {id(a.backend): a.backend for a in arrays if a.backend.spans_processes and a.backend.member}
    alike = all([backend.alike(digest) for backend in groups.values()])  # each group's comparison, on its ranks
    if refused is not None:
        raise refused
    if not alike:
        msg = (
            "fshard.discard_kept_aside(): the ranks passed arrays of different layouts, or some rank refused its "
            "arrays (SpecError there), so nothing was dropped: pass the same tree (the optimizer's parameters) on "
            "every rank."
        )
        raise CollectiveMismatchError(msg)
    accumulate.discard(found)
