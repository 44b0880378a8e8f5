"""A functional clone of a module: a shallow copy of its tree that holds given parameters and buffers.

The clone is shallow: each submodule is ``copy.copy``'d with fresh ``_parameters``,
``_buffers`` and ``_modules`` dicts that hold the given tensors (a placement's blocks, in
``apply_module``). Nothing is swapped into the module and back, so code that runs the
module again later (the recomputation of ``torch.utils.checkpoint`` in the backward) sees
the same tensors as the forward did. A submodule reached twice is copied once, and a tied
tensor fills every place it is reached.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import sys
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch.nn.utils import parametrize

from fshard._api.module_rules import Structure, structure
from fshard._api.module_tp import row_parallel_class
from fshard._base.compile import opaque
from fshard._errors import SpecError

__all__ = ["clone_tree", "functional_clone"]

_REENTRANT: Any = cast(
    Any, torch.utils.checkpoint.CheckpointFunction
).forward.__code__  # the forward of use_reentrant=True


class _Parameters(dict[str, Any]):
    """A clone's ``_parameters``: refuses a read from inside the forward of a reentrant checkpoint.

    That forward runs without grad and its backward recomputes in a nested backward pass that
    would reach the arrays' movements once per checkpointed block. ``guard``: the clone runs
    with grad enabled, so a read without grad is worth a look at the call stack.
    """

    __slots__ = ("guard", "names")

    def __init__(self, items: Any, guard: bool, names: Mapping[str, str]) -> None:
        super().__init__(items)
        self.guard = guard
        self.names = names  # each local name's dotted name in the module applied

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if self.guard and not torch.is_grad_enabled() and value is not None and _in_reentrant_checkpoint():
            msg = (
                f"apply_module(): parameter {self.names.get(name, name)!r} was read inside torch.utils.checkpoint "
                "with use_reentrant=True (what torch uses where use_reentrant is not given), whose backward "
                "recomputes in a nested backward pass that the movements of sharded parameters cannot take part "
                "in. Pass use_reentrant=False to checkpoint()."
            )
            raise SpecError(msg)
        return value


def _in_reentrant_checkpoint() -> bool:
    frame = sys._getframe(2)  # pyright: ignore[reportPrivateUsage]  # the one way to read the call stack cheaply
    while frame is not None:
        if frame.f_code is _REENTRANT:
            return True
        frame = frame.f_back
    return False


def functional_clone(
    module: torch.nn.Module, params: Mapping[str, Any], buffers: Mapping[str, Any]
) -> tuple[torch.nn.Module, dict[int, torch.nn.Module]]:
    """A shallow copy of ``module``'s tree whose parameters and buffers are ``params`` and ``buffers`` (by name).

    A submodule reached twice is copied once, and a tied tensor fills every place it is reached.
    Returns the clone and the copies by the ``id`` of their originals.
    """
    memo: dict[int, torch.nn.Module] = {}
    return clone_tree(module, structure(module), params, buffers, memo, torch.is_grad_enabled(), {}), memo


def clone_tree(
    module: torch.nn.Module,
    found: Structure,
    params: Mapping[str, Any],
    buffers: Mapping[str, Any],
    memo: dict[int, torch.nn.Module],
    guard: bool,
    rows: Mapping[int, str],
) -> torch.nn.Module:
    done = memo.get(id(module))
    if done is not None:
        return done
    # torch's is_parametrized, without Module.__getattr__ (an exception per module that has none)
    parametrized = isinstance(vars(module)["_modules"].get("parametrizations"), torch.nn.ModuleDict)
    out = _parametrized_clone(module, found) if parametrized else _shallow(module)
    memo[id(module)] = out
    axis = rows.get(id(module))
    if axis is not None:  # a row-parallel Linear: its clone sums its product over the axis
        out.__class__ = row_parallel_class(type(cast("torch.nn.Linear", module)))
        vars(out)["_tp_axis"] = axis
    own_params, own_buffers = found.slots[id(module)]
    old = vars(module)
    state = vars(out)
    names = dict(own_params)
    filled = {k: None if v is None else params[names[k]] for k, v in old["_parameters"].items()}
    state["_parameters"] = _Parameters(filled, guard, names)
    names = dict(own_buffers)
    state["_buffers"] = {k: None if v is None else buffers[names[k]] for k, v in old["_buffers"].items()}
    children = cast("dict[str, torch.nn.Module | None]", old["_modules"])
    state["_modules"] = {
        k: None if m is None else clone_tree(m, found, params, buffers, memo, guard, rows) for k, m in children.items()
    }
    return out


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.copy(module)``: for a module that copies as ``torch.nn.Module`` does, without its generic path.

    That path (``__reduce_ex__``, then ``__setstate__``) costs several microseconds per
    submodule, and a clone is made at every call; its result is the same object state.
    """
    cls = type(module)
    if torch.compiler.is_compiling() or not _copies_plainly(cls):  # TorchDynamo traces copy.copy, not this
        return copy.copy(module)
    out = object.__new__(cls)
    state = vars(module).copy()
    state.pop("_compiled_call_impl", None)  # as Module.__getstate__
    object.__setattr__(out, "__dict__", state)
    return out


@opaque  # TorchDynamo traces _injected wrongly: run it, and the copy, eagerly
def _parametrized_clone(module: torch.nn.Module, found: Structure) -> torch.nn.Module:
    """``_shallow(module)`` for a module with ``torch.nn.utils.parametrize`` parametrizations (``weight_norm``).

    torch gives such a module a class of its own, which refuses ``__getstate__`` (and so
    ``copy.copy``) to keep it from being pickled. It adds to the module's class only that
    refusal, a ``__deepcopy__`` and a property per parametrized tensor, which computes it from
    ``self.parametrizations`` (the clone's, holding the placement's blocks): where the module's
    class copies plainly, the clone is the same new object holding a copy of its ``__dict__``.

    Raises:
        SpecError: the class copies otherwise (``__copy__``, ``__getstate__``, slots), or a
            ``torch.nn.utils.parametrize.cached()`` is on: its cache is keyed by the module, so
            every placement's clone would read the value of the first one computed.
    """
    cls = type(module)
    if not (_injected(cls) and _copies_plainly(cls.__bases__[0])):
        msg = (
            f"apply_module() cannot clone the parametrized {_parametrized_names(module, found)}: its class "
            f"{cls.__bases__[0].__qualname__} copies otherwise than torch.nn.Module does, and torch refuses "
            "copy.copy of a parametrized module. Remove the parametrizations before sharding "
            "(torch.nn.utils.parametrize.remove_parametrizations(module, name)), or give the class "
            "torch.nn.Module's copy."
        )
        raise SpecError(msg)
    if getattr(parametrize, "_cache_enabled"):  # noqa: B009  # cached()'s switch: no public getter, untyped
        msg = (
            f"apply_module() runs the parametrized {_parametrized_names(module, found)} inside "
            "torch.nn.utils.parametrize.cached(), whose cache is keyed by the module: every placement would "
            "read the value computed first (from one placement's blocks, or the module's own parameters). "
            "Call apply_module outside cached()."
        )
        raise SpecError(msg)
    out = object.__new__(cls)
    state = vars(module).copy()
    state.pop("_compiled_call_impl", None)  # as Module.__getstate__
    object.__setattr__(out, "__dict__", state)
    return out


def _injected(cls: type) -> bool:
    """Whether ``cls`` is a class that ``torch.nn.utils.parametrize`` made: its base, and nothing but the above.

    Not cached: torch makes one such class per module, and its properties hold the module.
    """
    getstate = vars(cls).get("__getstate__")
    return (
        getattr(getstate, "__qualname__", None) == "_inject_new_class.<locals>.getstate"
        and getattr(getstate, "__module__", None) == parametrize.__name__
        and len(cls.__bases__) == 1
        and all(k in _INJECTED or isinstance(v, property) for k, v in vars(cls).items())
    )


_INJECTED = frozenset({"__getstate__", "__deepcopy__", "__module__", "__doc__"})  # parametrize's, besides properties


def _parametrized_names(module: torch.nn.Module, found: Structure) -> list[str]:
    """The dotted names of a parametrized module's parametrized tensors (``"0.weight"``), from its originals'."""
    out: list[str] = []
    for tensor, chain in cast("Mapping[str, torch.nn.Module]", vars(module)["_modules"]["parametrizations"]).items():
        own_params, own_buffers = found.slots[id(chain)]  # a buffer's parametrization keeps buffers
        local, full = (*own_params, *own_buffers)[0]  # ("original0", "0.parametrizations.weight.original0")
        out.append(full[: -len(f"parametrizations.{tensor}.{local}")] + tensor)
    return out


@functools.cache
def _copies_plainly(cls: type) -> bool:
    """Whether ``copy.copy`` of a ``cls`` is ``torch.nn.Module``'s: a new object holding a copy of its ``__dict__``."""
    module: Any = torch.nn.Module
    return (
        getattr(cls, "__copy__", None) is None
        and cls not in copyreg.dispatch_table
        and cls.__reduce_ex__ is object.__reduce_ex__  # pyright: ignore[reportUnknownMemberType]
        and cls.__reduce__ is object.__reduce__  # pyright: ignore[reportUnknownMemberType]
        and cls.__getstate__ is module.__getstate__  # pyright: ignore[reportUnknownMemberType]
        and cls.__setstate__ is module.__setstate__  # pyright: ignore[reportUnknownMemberType]
        and cls.__new__ is object.__new__
        and all("__slots__" not in vars(c) for c in cls.__mro__)
    )
