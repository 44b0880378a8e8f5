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


def inputs(dtype=torch.float64, shape: tuple[int, ...] = SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)


def random_case(seed: int) -> tuple[tuple, tuple[int, ...]]:
    """A random program: 1 to 3 mesh axes, 1 to 3 array dims split by some of them, psum over some axes."""
    g = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (), generator=g))

    mesh_shape = tuple((1, 2, 2, 3)[pick(4)] for _ in range(1 + pick(3)))
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    ndim = 1 + pick(3)
    free = list(names)
    partition = []
    for _ in range(ndim):
        partition.append(free.pop(pick(len(free))) if free and pick(2) else None)
    axes = tuple(n for n in names if pick(2)) or (names[pick(len(names))],)
    shape = tuple(1 + pick(6) for _ in range(ndim))
    return (mesh_shape, names, tuple(partition), axes), shape


def dense(name: str, case: tuple | None = None, shape: tuple[int, ...] = SHAPE) -> tuple[list, list]:
    """The reference: value and gradient of ``(y * r).sum()`` with respect to ``x``, unsharded."""
    mesh_shape, names, partition, axes = case or CASES[name]
    x, r = inputs(shape=shape)
    x.requires_grad_()
    dims = _split_dims(partition, axes)
    s = (torch.sin(x) * x).sum(dims, keepdim=True) if dims else torch.sin(x) * x
    y = x * torch.tanh(_copies(mesh_shape, names, partition, axes) * s)
    (y * r).sum().backward()
    return y.detach().tolist(), x.grad.tolist()


def sharded(
    name: str, dtype=torch.float64, case: tuple | None = None, shape: tuple[int, ...] = SHAPE
) -> tuple[list, list]:
    """The program with psum in its body, on the default backend."""
    mesh_shape, names, partition, axes = case or CASES[name]
    mesh = fshard.Mesh(mesh_shape, axis_names=names)
    spec = fshard.Named(mesh, partition)
    dims = _split_dims(partition, axes)
    psum_axes = axes[0] if len(axes) == 1 else axes

    def body(b: torch.Tensor) -> torch.Tensor:
        s = (torch.sin(b) * b).sum(dims, keepdim=True) if dims else torch.sin(b) * b
        return b * torch.tanh(fshard.psum(s, psum_axes))

    x, r = inputs(dtype, shape)
    x.requires_grad_()
    y = fshard.shard_map(body, in_specs=spec, out_specs=spec)(x)
    full = fshard.gather(y)
    (full * r).sum().backward()
    return full.detach().tolist(), x.grad.tolist()


def closed_over(sharded_run: bool = True) -> list[float]:
    """The gradient of a weight the body closes over (not an argument), with a psum between its uses."""
    w = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
    x, r = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) / 3, torch.linspace(-1, 1, 8).reshape(4, 2).double()

    def body(b: torch.Tensor) -> torch.Tensor:
        return torch.sin(fshard.psum((b * w).sum(0), "x") * b * w)

    if sharded_run:
        spec = fshard.Named(fshard.Mesh((4,)), ("x", None))
        y = fshard.gather(fshard.shard_map(body, in_specs=spec, out_specs=spec)(x))
    else:
        y = torch.sin((x * w).sum(0) * x * w)
    (y * r).sum().backward()
    return w.grad.tolist()
