"""Module helpers in functional form: shard a state dict, load a tree back into a module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fshard._array import ShardedArray
from fshard._ops import gather, shard
from fshard.backends import Backend

__all__ = ["load_state_dict", "shard_params"]


def shard_params(
    module_or_state_dict: torch.nn.Module | Mapping[str, Any],
    spec_fn: Callable[[str, torch.Tensor], Any],
    *,
    backend: Backend | None = None,
) -> dict[str, Any]:
    """Each entry of a state dict sharded by ``spec_fn(name, tensor)``, or kept whole where it returns ``None``.

    Pure: the module is not changed and the result shares no memory with it
    (tensors kept whole are copied). Every rank passes the full tensors and
    slices its own boxes, so nothing is sent (``fshard.shard`` with ``src=None``).
    Entries that are not tensors are kept as they are.

    Args:
        module_or_state_dict: a module (its ``state_dict()`` is read) or a mapping of names to tensors.
        spec_fn: called with each name and tensor; returns a spec, a ``Layout`` or ``None``.
        backend: for the new arrays (default: torch_dist when initialised, else local).

    Returns:
        A dict in state-dict order: ``ShardedArray`` or tensor per name.

    >>> import torch, fshard
    >>> model = torch.nn.Linear(4, 3)
    >>> params = fshard.shard_params(model, lambda name, t: fshard.Chunk(0, [0, 1]) if t.ndim == 2 else None)
    >>> {name: type(v).__name__ for name, v in params.items()}
    {'weight': 'ShardedArray', 'bias': 'Tensor'}
    >>> [tuple(s.data.shape) for s in params["weight"].addressable_shards]
    [(2, 4), (1, 4)]
    """
    if isinstance(module_or_state_dict, torch.nn.Module):
        state: Mapping[str, Any] = module_or_state_dict.state_dict()
    elif isinstance(module_or_state_dict, Mapping):
        state = module_or_state_dict
    else:
        kind = type(module_or_state_dict).__name__
        msg = f"shard_params() takes a torch.nn.Module or a mapping of names to tensors, got {kind}."
        raise TypeError(msg)
    out: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        tensor = value.detach()
        spec = spec_fn(name, tensor)
        out[name] = tensor.clone() if spec is None else shard(tensor, spec, backend=backend)
    return out


def load_state_dict(module: torch.nn.Module, tree: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Loads a flat tree of names to ``ShardedArray``s and tensors into ``module`` (collective).

    Each array is gathered to a full tensor on every rank, then the whole dict
    goes to ``module.load_state_dict`` (so a process briefly holds a second full
    copy of the parameters). This is how a checkpoint saved on any world size
    goes back into a module: ``load`` it (or ``shard_params`` a fresh module as
    ``like=``), then call this.

    Args:
        module: changed in place, as ``torch.nn.Module.load_state_dict`` does.
        tree: names as in ``module.state_dict()``.
        strict: as in ``torch.nn.Module.load_state_dict``.

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` result.

    Raises:
        RuntimeError: from torch, for missing or unexpected keys (``strict``) or shape mismatches.

    >>> import tempfile, torch, fshard
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Linear(4, 3)
    >>> spec = lambda name, t: fshard.Chunk(0, [0, 1, 2])
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, fshard.shard_params(model, spec))
    ...     fresh = torch.nn.Linear(4, 3)
    ...     tree = fshard.load(d, like=fshard.shard_params(fresh, lambda name, t: fshard.Chunk(0, [0, 1])))
    ...     fshard.load_state_dict(fresh, tree)
    <All keys matched successfully>
    >>> torch.equal(fresh.weight, model.weight)
    True
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"load_state_dict() takes a mapping of names to arrays or tensors, got {type(tree).__name__}.")
    full = {name: gather(v) if isinstance(v, ShardedArray) else v for name, v in tree.items()}
    return module.load_state_dict(full, strict=strict)
