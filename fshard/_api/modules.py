"""Module helpers in functional form: shard a state dict, load a tree back into a module."""

# The public functions check their arguments at run time, whatever the annotations promise.
# pyright: reportUnnecessaryIsInstance=false

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from fshard._api.module_rules import structure
from fshard._api.move import gather, refuse_lazy, reshard
from fshard._api.shard import shard
from fshard._array.array import ShardedArray
from fshard._errors import CheckpointError
from fshard._exec.collective import collective
from fshard._interop.torch_objects import from_dtensor, from_sharded_tensor, to_sharded_tensor
from fshard._layout.torch_meta import is_dtensor, is_sharded_tensor
from fshard.backends import Backend

__all__ = ["load_state_dict", "shard_params", "sharded_attributes"]


@collective("shard_params")
def shard_params(
    module_or_state_dict: torch.nn.Module | Mapping[str, Any],
    spec_fn: Callable[[str, Any], Any] | None = None,
    *,
    backend: Backend | None = None,
) -> dict[str, Any]:
    """Each entry of a state dict sharded by ``spec_fn(name, value)``, or kept as it is where it returns ``None``.

    Pure: the module is not changed and the result shares no memory with it
    (tensors kept whole are copied). Every rank passes the full tensors and
    slices its own boxes, so nothing is sent (``fshard.shard`` with ``src=None``).

    Sharded entries are read too: a module's ``ShardedArray`` and torch
    ``ShardedTensor`` attributes (which ``state_dict()`` leaves out) join the
    dict under their dotted names, every ``ShardedTensor`` (attribute or
    state-dict entry) becomes a ``ShardedArray`` (``fshard.from_sharded_tensor``),
    and so does every ``DTensor`` (``fshard.from_dtensor``: the state dict of a
    module under FSDP2's ``fully_shard`` or DTensor's ``parallelize_module``).
    ``spec_fn`` sees that array; a spec reshards it, ``None`` keeps its layout. So
    ``shard_params(torch_state_dict)`` converts a torch state dict in one call.
    Entries that are neither tensors nor arrays are kept as they are.

    Args:
        module_or_state_dict: a module (its ``state_dict()`` is read) or a mapping of names to values.
        spec_fn: called with each name and tensor (or array); returns a spec, a ``Layout``
            or ``None``. Default: ``None`` for every entry.
        backend: for the new arrays (default: torch_dist when initialised, else local).

    Returns:
        A dict in state-dict order (sharded attributes last): ``ShardedArray`` or tensor per name.

    >>> import torch, fshard
    >>> model = torch.nn.Linear(4, 3)
    >>> params = fshard.shard_params(model, lambda name, t: fshard.Chunk(0, [0, 1]) if t.ndim == 2 else None)
    >>> {name: type(v).__name__ for name, v in params.items()}
    {'weight': 'ShardedArray', 'bias': 'Tensor'}
    >>> [tuple(s.data.shape) for s in params["weight"].addressable_shards]
    [(2, 4), (1, 4)]
    """
    if spec_fn is not None and not callable(spec_fn):
        raise TypeError(f"shard_params() spec_fn must be a function of (name, value) or None, got {spec_fn!r}.")
    spec_of = _keep if spec_fn is None else spec_fn
    return {name: _entry(name, value, spec_of, backend) for name, value in _state(module_or_state_dict).items()}


def _keep(name: str, value: Any) -> None:
    return None


def _state(module_or_state_dict: Any) -> Mapping[str, Any]:
    if isinstance(module_or_state_dict, torch.nn.Module):
        return {**module_or_state_dict.state_dict(), **sharded_attributes(module_or_state_dict)}
    if isinstance(module_or_state_dict, Mapping):
        return cast("Mapping[str, Any]", module_or_state_dict)
    kind = type(module_or_state_dict).__name__
    msg = f"shard_params() takes a torch.nn.Module or a mapping of names to tensors, got {kind}."
    raise TypeError(msg)


def _entry(name: str, value: Any, spec_fn: Callable[[str, Any], Any], backend: Backend | None) -> Any:
    if is_sharded_tensor(value):
        value = from_sharded_tensor(value)
    elif is_dtensor(value):
        value = from_dtensor(value)
    if isinstance(value, ShardedArray):
        spec = spec_fn(name, value)
        return value if spec is None else reshard(value, spec)
    if not isinstance(value, torch.Tensor):
        return value
    refuse_lazy(value, f"{name!r}")
    tensor = value.detach()
    spec = spec_fn(name, tensor)
    return tensor.clone() if spec is None else shard(tensor, spec, backend=backend)


def sharded_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """The module's ``ShardedArray`` and ``ShardedTensor`` attributes by dotted name.

    Torch's ``state_dict_hook`` adds the latter to a state dict the same way.
    """
    out: dict[str, Any] = {}
    for prefix, sub in module.named_modules():  # pyright: ignore[reportUnknownVariableType]  # torch leaves its type out
        for attr, value in vars(sub).items():
            if isinstance(value, ShardedArray) or is_sharded_tensor(value):
                out[f"{prefix}.{attr}" if prefix else attr] = value
    return out


@collective("load_state_dict")
def load_state_dict(module: torch.nn.Module, tree: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Loads a flat tree of names to ``ShardedArray``s and tensors into ``module`` (collective).

    Parameters and buffers: each array is gathered to a full tensor on every rank,
    then the dict goes to ``module.load_state_dict`` (so a process briefly holds a
    second full copy of them). Sharded attributes (names that ``shard_params``
    read from a module's ``ShardedArray`` or ``ShardedTensor`` attributes, or
    attributes that are ``None`` in a fresh module) are set to the loaded arrays,
    still sharded; one that held a ``ShardedTensor`` gets one back
    (``fshard.to_sharded_tensor``). This is how a checkpoint saved on any world
    size goes back into a module: ``load`` it (or ``shard_params`` a fresh module
    as ``like=``), then call this.

    Args:
        module: changed in place, as ``torch.nn.Module.load_state_dict`` does.
        tree: names as in ``module.state_dict()``, plus its sharded attributes and its
            buffers outside the state dict (``persistent=False``: ``fshard.shard_module``
            returns them with the others; each is copied into the module's own); a tied
            tensor may appear under its first name only (as ``fshard.shard_module`` gives it).
        strict: as in ``torch.nn.Module.load_state_dict``.

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` result.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``, ``tree`` not a mapping, or
            ``strict`` not a bool.
        CheckpointError: the tree does not fit the module: missing or unexpected keys
            (``strict``) or shape mismatches, with torch's message (a ``RuntimeError``, as
            torch raises); a buffer outside the state dict given another shape.

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
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_state_dict() takes a torch.nn.Module, got {type(module).__name__}.")
    if not isinstance(tree, Mapping):
        raise TypeError(f"load_state_dict() takes a mapping of names to arrays or tensors, got {type(tree).__name__}.")
    if type(strict) is not bool:
        raise TypeError(f"load_state_dict() strict must be True or False, got {strict!r}.")
    bad = [k for k in tree if not isinstance(k, str)]
    if bad:
        raise TypeError(f"load_state_dict() tree keys must be str names, got {bad[0]!r} ({type(bad[0]).__name__}).")
    known = module.state_dict().keys()
    rest: dict[str, Any] = {}
    for name, value in tree.items():
        if name in known or not _set_sharded_attribute(module, name, value):
            rest[name] = value
    full = {name: gather(v) if isinstance(v, ShardedArray) else v for name, v in rest.items()}
    for alias, name in structure(module).ties:  # shard_module keeps a tied tensor under its first name only
        if alias not in full and name in full:
            full[alias] = full[name]
    # Buffers outside the state dict (persistent=False), which shard_module returns as it returns the others.
    transient = {n: (t, full.pop(n)) for n, t in module.named_buffers() if n not in known and n in full}
    for name, (target, value) in transient.items():
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            msg = (
                f"load_state_dict() tree gives buffer {name!r} (persistent=False) a {got}, where the "
                f"{type(module).__name__}'s is of shape {tuple(target.shape)}."
            )
            raise CheckpointError(msg)
    try:
        result = module.load_state_dict(full, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(f"load_state_dict() tree does not fit the {type(module).__name__}: {exc}") from exc
    with torch.no_grad():
        for target, value in transient.values():
            target.copy_(value)
    return result


def _set_sharded_attribute(module: torch.nn.Module, name: str, value: Any) -> bool:
    """Sets ``module.<name>`` to ``value`` if it names a sharded attribute (or one that is ``None``)."""
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return False
    if attr not in vars(owner) or not isinstance(value, ShardedArray):
        return False
    old = vars(owner)[attr]
    if is_sharded_tensor(old):
        value = to_sharded_tensor(value)
    elif old is not None and not isinstance(old, ShardedArray):
        return False
    setattr(owner, attr, value)
    return True
