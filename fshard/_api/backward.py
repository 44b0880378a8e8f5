"""``backward``: the backward pass from a loss array, and the loss, with no wait for the ranks at its start."""

from __future__ import annotations

import numpy as np
import torch

from fshard._api.move import gather
from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec.buckets import Carry, carrying
from fshard._exec.collective import collective
from fshard._layout.layout import Layout

__all__ = ["backward"]


@collective("backward")
def backward(loss: ShardedArray) -> torch.Tensor:
    """``gather(loss).backward()``; returns the gathered value, detached.

    ``loss`` is an array of one element. Where it is a pending sum whose summands are held one
    per rank of its backend's group (what a data-parallel ``shard_map`` returns with
    ``out_specs=fshard.Partial(fshard.Replicated(ranks))``), each rank's backward starts from its
    own summand at once: the gradient of a sum is one for every summand, so no rank waits for
    the others' summands first, as ``gather`` would. The sum itself travels with the gradients:
    the last bucket of replicated arguments' gradients summed over those ranks carries it as one
    more element of its ``all_reduce`` (``fshard.config(bucket_cap_mb=...)``). Where no bucket
    carries it (fully sharded parameters, whose gradients are reduce-scattered; a ``no_sync``
    micro-batch; gradients summed in a lower precision than the loss's, or on another device
    than the loss), it is gathered after the backward. On one process, and for any other
    array, this is ``gather(loss)`` and its backward.

    The value is the same on every rank; it may differ from ``gather(loss)`` in the last bits,
    since the ranks' summands are added in the ``all_reduce``'s order.

    >>> import torch, fshard
    >>> w = torch.arange(4.0, requires_grad=True)
    >>> total = fshard.shard_map(lambda b: (b * b).sum()[None], in_specs=(fshard.Chunk(0, [0, 1]),),
    ...                          out_specs=fshard.Partial(fshard.Replicated([0, 1])))(w)
    >>> fshard.backward(total / 2)
    tensor([7.])
    >>> w.grad
    tensor([0., 1., 2., 3.])

    As torch's ``backward()``, it runs under ``torch.no_grad()`` too (the loss was recorded before).

    Raises:
        TypeError: ``loss`` is not a ``ShardedArray``.
        SpecError: ``loss`` has more or fewer than one element, is complex, or does not require grad.
    """
    if not isinstance(loss, ShardedArray):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"backward() takes a ShardedArray (a loss), got {type(loss).__name__}.")
    if loss.numel() != 1:
        msg = (
            f"backward() takes an array of one element (a loss), got shape {tuple(loss.shape)}: reduce it "
            "first (its sum or mean), as torch's backward() needs a scalar."
        )
        raise SpecError(msg)
    if loss.dtype.is_complex:
        msg = (
            f"backward() takes a real loss, got {loss.dtype}: the backward of a complex value needs a gradient to "
            "start from, as torch's does. Take a real value of it first (loss.abs() or its real part)."
        )
        raise SpecError(msg)
    if not loss.requires_grad:
        # A call's check in flight may say why (another rank's loss records a gradient): it raises first, alike.
        end_checks = getattr(loss.backend, "end_checks", None)
        if end_checks is not None:
            end_checks()
        msg = (
            "backward() takes a loss that requires grad; this one was computed from no tensor that does: "
            "call requires_grad_() on the parameters' shard tensors first."
        )
        raise SpecError(msg)
    if not _summands_one_per_rank(loss.layout, loss.backend):
        with torch.enable_grad():  # the sum's node recorded under no_grad too, as a backward from each summand runs
            value = gather(loss)
        value.backward()  # pyright: ignore[reportUnknownMemberType]  # torch leaves it partly untyped
        return value.detach()
    (block,) = loss.addressable_data
    with carrying(Carry(loss.backend, block.detach())) as carry:
        torch.autograd.backward(block, torch.ones_like(block))  # pyright: ignore[reportUnknownMemberType]  # torch leaves it partly untyped
    if carry.total is not None:
        return carry.total.reshape(loss.shape).to(block.device)
    with torch.no_grad():
        return gather(loss)


def _summands_one_per_rank(layout: Layout, backend: object) -> bool:
    """Whether ``layout`` is a sum over every rank of ``backend``'s group (in processes), each holding one summand.

    Each summand whole (not an empty box): facts of the layout, the same on every rank.
    """
    ranks = getattr(backend, "ranks", ())
    return (
        getattr(backend, "spans_processes", False)
        and layout.partial == "sum"
        and layout.terms is None
        and len(layout.columns.rank) == len(ranks)
        and set(layout.ranks) == set(ranks)
        and bool((layout.columns.sz == np.asarray(layout.shape, np.int64)).all())
    )
