"""``shard``: a global tensor (on every rank, or on one) split into a ``ShardedArray``."""

from __future__ import annotations

from typing import Any

import torch

from fshard._api.move import check_tensor, reshard, resolve_backend, resolved, whole_on
from fshard._array.array import ShardedArray
from fshard._base.compile import opaque
from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec.collective import collective
from fshard._exec.replicas import check_global
from fshard._interop.torch_objects import shard_sharded_tensor
from fshard._layout.layout import Layout, with_partial
from fshard._layout.specs import as_layout
from fshard._layout.torch_meta import is_sharded_tensor
from fshard.backends import Backend

__all__ = ["shard"]


def _meta_problem(tensor: torch.Tensor, layout: Layout, what: str) -> str | None:
    """Why ``tensor`` cannot be sliced into ``layout``.

    On the meta device it has no values to put anywhere but on meta placements.
    """
    if tensor.device.type != "meta":
        return None
    devices = sorted({d for d in layout.columns.devices if torch.device(d).type != "meta"})
    if not devices:
        return None
    return (
        f"{what} is on the meta device, which holds no values, but the spec places shards on {devices}: "
        "place them on the meta device too ('rank:0/meta'), or pass a tensor that holds values."
    )


def _source(tensor: torch.Tensor | None, src: int, spec: Any, backend: Backend) -> tuple[tuple[int, ...], torch.Tensor]:
    """Agrees on ``src`` across ranks; returns the global shape and the tensor (a stand-in off src).

    Rank ``src`` checks its tensor before the exchange and sends what is wrong with it,
    so a bad source tensor raises on every rank instead of leaving the others waiting.
    """
    mine = backend.holds(src)
    problem = _source_problem(tensor, src, spec) if mine else None
    info = (
        (src, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, problem)
        if mine and problem is None and tensor is not None
        else (src, None, None, False, problem)
    )
    seen = backend.exchange(info)
    if len({s[0] for s in seen}) != 1:
        msg = f"src={src} on rank {backend.rank} does not match with src_rank on other ranks: {[s[0] for s in seen]}."
        raise SpecError(msg)
    bad = next((s[4] for s in seen if s[4] is not None), None)
    if bad is not None:
        kind, msg = bad
        raise (TypeError if kind == "TypeError" else SpecError)(msg)
    # Entries follow group order, not global ranks: the owner is the one that sent a shape.
    owner = next(s for s in seen if s[1] is not None)
    if mine:
        return owner[1], resolved(tensor)  # type: ignore[arg-type]
    # The stand-in requires grad like the source, so every rank's shards join autograd alike.
    return owner[1], torch.empty(0, dtype=owner[2], requires_grad=owner[3])


def _source_problem(tensor: Any, src: int, spec: Any) -> tuple[str, str] | None:
    """What is wrong with rank ``src``'s source tensor, as (exception type, message), or ``None``."""
    if tensor is None:
        return "SpecError", f"shard(..., src={src}) needs a tensor on rank {src}, got None."
    if is_sharded_tensor(tensor):
        msg = (
            f"shard(..., src={src}) got a torch ShardedTensor on rank {src}: its data already lives on its "
            "process group's ranks. Convert it instead, on every rank: "
            "fshard.reshard(fshard.from_sharded_tensor(st), spec)."
        )
        return "SpecError", msg
    try:
        check_tensor(tensor, f"shard() input on rank {src}")
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    if tensor.device.type != "meta":
        return None
    try:
        layout = as_layout(spec, tuple(tensor.shape))
    except (TypeError, ValueError):
        return None  # every rank raises it after the exchange, where the shape is known
    problem = _meta_problem(tensor, layout, f"shard() input on rank {src}")
    return None if problem is None else ("SpecError", problem)


@collective("shard", local=("tensor",))
@opaque
def shard(
    tensor: torch.Tensor | None, spec: Any, *, src: int | None = None, backend: Backend | None = None
) -> ShardedArray:
    """Splits a global tensor into a ``ShardedArray`` laid out by ``spec`` (a spec or a ``Layout``).

    Args:
        tensor: the global tensor. With ``src=None`` every rank passes it and slices
            its own boxes (nothing is sent); with ``src=k`` only rank k's is read and
            other ranks may pass ``None``.
        spec: ``Chunk``, ``Named``, ``Replicated``, ``Single``, ``Explicit`` or a ``Layout``.
        src: the rank whose tensor is the source, or ``None``.
        backend: defaults to torch_dist when torch.distributed is initialised, else local.

    Returns:
        A new ``ShardedArray``; non-contiguous inputs are read correctly.

    With a ``Partial`` spec the array's value is still ``tensor``: one copy of each
    element holds it and the others hold the identity (0 for a sum).

    Raises:
        SpecError: the spec does not fit ``tensor.shape``, or ranks disagree on ``src``.
        CollectiveMismatchError: in check mode, with ``src=None``, ranks passed different
            tensors (compared bit for bit by digest); per-rank batches belong in
            ``fshard.from_local_tensor(t, dim=0)``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(10.0), fshard.Chunk(0, [0, 1, 2, 3]))
    >>> [tuple(s.data.tolist()) for s in x.addressable_shards]
    [(0.0, 1.0, 2.0), (3.0, 4.0, 5.0), (6.0, 7.0, 8.0), (9.0,)]
    """
    if is_sharded_tensor(tensor) and src is None:  # already sharded: converted, then resharded
        return shard_sharded_tensor(tensor, spec, src=src, backend=backend)
    backend = resolve_backend(backend)
    if src is not None:
        src = backend.check_rank(src, "src")
    if src is None:
        full = resolved(check_tensor(tensor, "shard() input"))
        shape: tuple[int, ...] = tuple(full.shape)
        check_global(backend, [(f"shard()'s tensor argument ({full.dtype}, shape {tuple(full.shape)})", full)])
    else:
        shape, full = _source(tensor, src, spec, backend)
    target = as_layout(spec, shape)
    backend.check_layout(target)
    problem = _meta_problem(full, target, "shard() input") if src is None else None
    if problem is not None:
        raise SpecError(problem)
    # A pending reduction: slice into copies that all hold the value, then keep one of each.
    layout = target if target.partial is None else with_partial(target, None) if src is None else whole_on(target, src)
    data, link = _autograd.scatter(full, layout, backend, src)
    out = ShardedArray(layout, data, backend, full.dtype, link)
    return out if layout is target else reshard(out, target)
