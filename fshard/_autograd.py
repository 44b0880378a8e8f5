"""Differentiable data movement. Every movement is one of three autograd functions, and
the backward of each runs the opposite movement on the gradients:

- ``Move`` (plan ``A -> B``): backward runs plan ``B -> A``;
- ``Scatter`` (a global tensor sliced into shards): backward assembles the gradient;
- ``Assemble`` (shards into a global tensor): backward slices the gradient.

A replicated value is one value: its copies carry equal gradients, and a backward
reads one copy rather than summing them (JAX and DTensor do the same).
"""

from __future__ import annotations

from typing import Any

import torch

from fshard._layout import Layout
from fshard._plan import plan

__all__ = ["assemble", "move", "scatter"]


def _zeros_for(layout: Layout, backend: Any, grads: tuple[Any, ...], like: torch.Tensor) -> list[torch.Tensor]:
    idx = backend.addressable(layout)
    return [
        g if g is not None else torch.zeros(layout.shards[i].sizes, dtype=like.dtype, device=like.device)
        for i, g in zip(idx, grads)
    ]


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: Layout, dst: Layout, backend: Any, like: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.layouts, ctx.backend, ctx.like = (src, dst), backend, like
        return backend.execute(plan(src, dst), tensors, like)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        src, dst = ctx.layouts
        g = _zeros_for(dst, ctx.backend, grads, ctx.like)
        back = ctx.backend.execute(plan(dst, src), g, g[0] if g else ctx.like)
        return (None, None, None, None, *back)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, layout: Layout, backend: Any, src: int | None, full: torch.Tensor) -> Any:
        ctx.layout, ctx.backend, ctx.src, ctx.like = layout, backend, src, full
        return backend.scatter(full, layout, src)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        g = _zeros_for(ctx.layout, ctx.backend, grads, ctx.like)
        full = ctx.backend.assemble(ctx.layout, g, ctx.like, ctx.src)
        return None, None, None, full


class _Assemble(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, layout: Layout, backend: Any, dst: int | None, like: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.layout, ctx.backend, ctx.dst, ctx.like = layout, backend, dst, like
        out = backend.assemble(layout, tensors, like, dst)
        return out if out is not None else like.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        # Off rank dst the gradient is a stand-in that only gives the dtype.
        full = grad if ctx.dst is None or ctx.backend.rank in (None, ctx.dst) else ctx.like.new_empty((0,))
        shards = ctx.backend.scatter(full, ctx.layout, ctx.dst)
        return (None, None, None, None, *shards)


def move(src: Layout, dst: Layout, backend: Any, tensors: tuple[torch.Tensor, ...], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The addressable shards of ``dst`` filled from those of ``src`` (differentiable)."""
    return tuple(_Move.apply(src, dst, backend, like, *tensors))


def scatter(full: torch.Tensor, layout: Layout, backend: Any, src: int | None) -> tuple[torch.Tensor, ...]:
    """The addressable shards of ``layout`` sliced from ``full`` (differentiable)."""
    return tuple(_Scatter.apply(layout, backend, src, full))


def assemble(layout: Layout, backend: Any, tensors: tuple[torch.Tensor, ...], like: torch.Tensor, dst: int | None) -> torch.Tensor | None:
    """The global tensor from the addressable shards of ``layout`` (differentiable)."""
    out = _Assemble.apply(layout, backend, dst, like, *tensors)
    if dst is not None and backend.rank not in (None, dst):
        return None
    return out
