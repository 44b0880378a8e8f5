"""Programs that reduce inside shard_map bodies (psum), with their dense float64 references.

Shared by tests/test_psum.py (local backend) and tests/test_dist_psum.py (Gloo): each
program returns the result and the input's gradient as nested lists, so the two backends
and the dense reference compare exactly.

The program: ``x`` laid out by ``Named(mesh, partition)``; per placement
``y = b * tanh(psum((sin(b) * b).sum(dims split by axes, keepdim=True), axes))``. Summed
over ``axes``, the block sums become sums over the whole dims that those axes split, and
an axis that splits no dim sums that many equal copies: the dense value is
``x * tanh(copies * (sin(x) * x).sum(dims, keepdim=True))``.
"""

from __future__ import annotations

import math

import torch

import fshard

SHAPE = (5, 7)  # uneven on 2 x 2: rows 3 + 2, columns 4 + 3; on 3 ranks: rows 2 + 2 + 1

# name: (mesh shape, axis names, partition, psum axes)
CASES = {
    "1d-x": ((3,), ("x",), ("x", None), ("x",)),
    "2d-over-tp": ((2, 2), ("dp", "tp"), ("dp", "tp"), ("tp",)),
    "2d-over-dp": ((2, 2), ("dp", "tp"), ("dp", "tp"), ("dp",)),
    "2d-over-both": ((2, 2), ("dp", "tp"), ("dp", "tp"), ("dp", "tp")),
    "2d-replicated-tp": ((2, 2), ("dp", "tp"), ("dp", None), ("tp",)),
}


def _split_dims(partition, axes) -> tuple[int, ...]:
    return tuple(d for d, entry in enumerate(partition) if entry in axes)


def _copies(mesh_shape, names, partition, axes) -> int:
    return math.prod(n for n, a in zip(mesh_shape, names) if a in axes and a not in partition)


def inputs(dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(SHAPE, generator=g, dtype=dtype), torch.randn(SHAPE, generator=g, dtype=dtype)


def dense(name: str) -> tuple[list, list]:
    """The reference: value and gradient of ``(y * r).sum()`` with respect to ``x``, unsharded."""
    mesh_shape, names, partition, axes = CASES[name]
    x, r = inputs()
    x.requires_grad_()
    dims = _split_dims(partition, axes)
    s = (torch.sin(x) * x).sum(dims, keepdim=True) if dims else torch.sin(x) * x
    y = x * torch.tanh(_copies(mesh_shape, names, partition, axes) * s)
    (y * r).sum().backward()
    return y.detach().tolist(), x.grad.tolist()


def sharded(name: str, dtype=torch.float64) -> tuple[list, list]:
    """The program with psum in its body, on the default backend."""
    mesh_shape, names, partition, axes = CASES[name]
    mesh = fshard.Mesh(mesh_shape, axis_names=names)
    spec = fshard.Named(mesh, partition)
    dims = _split_dims(partition, axes)
    psum_axes = axes[0] if len(axes) == 1 else axes

    def body(b: torch.Tensor) -> torch.Tensor:
        s = (torch.sin(b) * b).sum(dims, keepdim=True) if dims else torch.sin(b) * b
        return b * torch.tanh(fshard.psum(s, psum_axes))

    x, r = inputs(dtype)
    x.requires_grad_()
    y = fshard.shard_map(body, in_specs=spec, out_specs=spec)(x)
    full = fshard.gather(y)
    (full * r).sum().backward()
    return full.detach().tolist(), x.grad.tolist()
