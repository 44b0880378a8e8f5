"""Gradients of gathered tensors used per shard, on a multi-process backend.

``bf = fshard.gather(b)`` gives every rank the same tensor. Where every rank uses it
alike (a loss computed in full on each rank), its gradient is the same everywhere and
counts once. Where it is used inside ``map_local``/``shard_map``, each rank uses it on
its own shards only, so its gradient there is a part: the gradient of ``b`` is the
sum of the parts over all ranks. The local backend gets that sum by itself (one
process holds every shard and one ``bf``); here, fshard sums it:

- while a per-shard function runs, a torch-function mode replaces each gathered
  tensor it touches with a view whose backward sets its gradient aside (the per-shard
  part) instead of passing it on;
- the backward of the gather that made the tensor adds the parts summed over all
  ranks (one small exchange says whether any rank has a part; then one all-reduce).

This is JAX's rule for ``shard_map`` (an invariant value used where values vary per
device is broadcast, and the transpose of that broadcast is a sum), applied to the
tensors that fshard produced.

The sum is a collective in the gather's backward, so every rank's backward must reach
that gather. A rank that holds no shard runs no per-shard function; its result then
joins (``join``) the gathered tensors that the other ranks' functions used, which it
learns from them (``Usage``: each gathered tensor is named by its age, the number of
gathers registered after it, which is the same on every rank that gathered alike since).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Parts", "Usage", "join", "per_shard", "register"]


class Parts:
    """The per-shard gradient parts of one gathered tensor, summed on this rank."""

    __slots__ = ("__weakref__", "grad")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def add(self, g: torch.Tensor) -> None:
        self.grad = g if self.grad is None else self.grad + g


_LIVE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_PARTS: dict[int, Parts] = {}
_KEYS: dict[int, int] = {}
_BY_KEY: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_COUNT = [0]  # gathers registered so far in this process


def register(t: torch.Tensor, parts: Parts) -> None:
    """Marks ``t`` (a gather's result on every rank) as a tensor whose per-shard uses are parts.

    The n-th registered tensor has key n here; ranks compare ages (``Usage.ages``), not
    keys, since one rank may have registered more in an earlier, failed program.
    """
    key, n = id(t), _COUNT[0]
    _COUNT[0] += 1
    _LIVE[key] = t
    _PARTS[key] = parts
    _KEYS[key] = n
    _BY_KEY[n] = t
    weakref.finalize(t, _forget, key)


def _forget(key: int) -> None:
    _PARTS.pop(key, None)
    _KEYS.pop(key, None)


class Usage:
    """The keys of the gathered tensors that per-shard functions used."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: set[int] = set()

    def ages(self) -> frozenset[int]:
        """The used tensors as ages: how many gathers were registered since each.

        Ranks agree on these as long as they gathered alike since then, even where an earlier
        program (a failed one, say) left their counts apart.
        """
        return frozenset(_COUNT[0] - n for n in self.keys)


def join(link: torch.Tensor, ages: set[int] | frozenset[int]) -> torch.Tensor:
    """``link`` (0 elements) joined to the gathered tensors of ``ages`` (``Usage.ages``) still alive here.

    A backward from it thus reaches their gathers' backward (and its collective) as on the
    other ranks.
    """
    for age in sorted(ages):
        t = _BY_KEY.get(_COUNT[0] - age)
        if t is not None:
            link = link + t.reshape(-1)[:0].to(link.dtype)
    return link


class _SetAside(torch.autograd.Function):
    """Identity forward; backward adds the gradient to ``parts`` and passes nothing on."""

    @staticmethod
    def forward(parts: Parts, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.parts = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        ctx.parts.add(grad_outputs[0])
        return None, None


class _PerShard(TorchFunctionMode):
    """Replaces gathered tensors by set-aside views in every torch call (one view per tensor)."""

    def __init__(self, usage: Usage | None) -> None:
        super().__init__()
        self.views: dict[int, torch.Tensor] = {}
        self.usage = usage

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call: Any = (args, kwargs)  # a pytree (optree's PyTree type does not spell out tuples of them)
        args, kwargs = optree.tree_map(self._swap, call, none_is_leaf=True)
        return func(*args, **kwargs)

    def _swap(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        key = id(x)
        if _LIVE.get(key) is not x:
            return x
        if key not in self.views:  # this mode is off while it handles a call: apply() is not intercepted
            self.views[key] = _SetAside.apply(_PARTS[key], x)  # pyright: ignore[reportUnknownMemberType]  # torch: apply is untyped
            if self.usage is not None:
                self.usage.keys.add(_KEYS[key])
        return self.views[key]


@contextlib.contextmanager
def per_shard(backend: Any, usage: Usage | None = None) -> Generator[None, None, None]:
    """The context of a per-shard function.

    On a multi-process backend with gathered tensors alive, their uses become parts of their
    gradients (and their keys are added to ``usage``).
    """
    if not backend.spans_processes or not _LIVE:
        yield
        return
    with _PerShard(usage):
        yield
