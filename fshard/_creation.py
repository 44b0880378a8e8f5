"""Creation functions: each rank allocates only its own boxes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fshard import _random
from fshard._array import ShardedArray, empty_link
from fshard._layout import Layout, ShardMeta, check_shape
from fshard._ops import resolve_backend
from fshard._placement import Placement
from fshard._specs import as_layout
from fshard._torch_meta import is_sharded_tensor
from fshard.backends import Backend

__all__ = [
    "empty",
    "empty_like",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "zeros",
    "zeros_like",
]

Fill = Callable[[ShardMeta, torch.dtype, torch.device], torch.Tensor]


def parse_shape(shape: tuple[Any, ...]) -> tuple[int, ...]:
    """``(10, 20)``, ``([10, 20],)`` or ``((10, 20),)`` to ``(10, 20)``; ``TypeError`` for non-ints."""
    if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
        shape = tuple(shape[0])
    return check_shape(shape)


def _on_device(layout: Layout, device: Any) -> Layout:
    if device is None:
        return layout
    dev = str(torch.device(device))
    shards = tuple(dataclasses.replace(s, placement=Placement(s.placement.rank, dev)) for s in layout.shards)
    return Layout(layout.shape, shards)


def _create(
    spec: Any, shape: tuple[Any, ...], fill: Fill, dtype: Any, device: Any, requires_grad: bool, backend: Backend | None
) -> ShardedArray:
    backend = resolve_backend(backend)
    layout = _on_device(as_layout(spec, parse_shape(shape)), device)
    backend.check_layout(layout)
    dtype = dtype or torch.get_default_dtype()
    data = []
    for i in backend.addressable(layout):
        meta = layout.shards[i]
        t = fill(meta, dtype, torch.device(meta.placement.device))
        data.append(t.requires_grad_(requires_grad) if requires_grad else t)
    return ShardedArray(layout, data, backend, dtype, None if data else empty_link(dtype, requires_grad))


def _const(make: Callable[..., torch.Tensor], *args: Any) -> Fill:
    return lambda m, dtype, device: make(m.sizes, *args, dtype=dtype, device=device)


def zeros(
    spec: Any,
    *shape: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """A sharded array of zeros.

    ``shape`` is ints, a list or a tuple; ``device`` (optional) moves every
    placement to that device.

    >>> import fshard
    >>> fshard.zeros(fshard.Chunk(0, [0, 1, 2, 3]), 10, 20).addressable_shards[3].data.shape
    torch.Size([1, 20])
    """
    return _create(spec, shape, _const(torch.zeros), dtype, device, requires_grad, backend)


def ones(
    spec: Any,
    *shape: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """A sharded array of ones.

    >>> import fshard
    >>> float(fshard.gather(fshard.ones(fshard.Chunk(0, [0, 1]), [3])).sum())
    3.0
    """
    return _create(spec, shape, _const(torch.ones), dtype, device, requires_grad, backend)


def empty(
    spec: Any,
    *shape: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """A sharded array with uninitialised values.

    >>> import fshard
    >>> fshard.empty(fshard.Chunk(1, [0, 1, 2, 3]), (10, 32)).addressable_shards[0].data.shape
    torch.Size([10, 8])
    """
    return _create(spec, shape, _const(torch.empty), dtype, device, requires_grad, backend)


def full(
    spec: Any,
    *shape: Any,
    fill_value: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """A sharded array filled with ``fill_value``.

    >>> import torch, fshard
    >>> x = fshard.full(fshard.Chunk(0, [0, 1]), (2, 2), fill_value=7, dtype=torch.int32)
    >>> fshard.gather(x).tolist()
    [[7, 7], [7, 7]]
    """
    return _create(spec, shape, _const(torch.full, fill_value), dtype, device, requires_grad, backend)


def rand(
    spec: Any,
    *shape: Any,
    seed: int | None = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """Uniform [0, 1) values that depend on ``seed`` and the global index only.

    ``gather(rand(spec, shape, seed=s))`` is bit-identical for every spec and
    world size. ``seed=None`` draws one from torch's default generator (so
    ``torch.manual_seed`` applies; under torch_dist every rank must draw alike).

    >>> import torch, fshard
    >>> a = fshard.rand(fshard.Chunk(0, [0, 1, 2]), 5, 3, seed=7)
    >>> b = fshard.rand(fshard.Chunk(1, [0, 1]), 5, 3, seed=7)
    >>> torch.equal(fshard.gather(a), fshard.gather(b))
    True
    """
    s = _random.draw_seed() if seed is None else int(seed)
    gshape = parse_shape(shape)
    fill: Fill = lambda m, dt, dev: _random.box_uniform(s, gshape, m.offsets, m.sizes, dt, dev)  # noqa: E731
    return _create(spec, shape, fill, dtype, device, requires_grad, backend)


def randn(
    spec: Any,
    *shape: Any,
    seed: int | None = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    backend: Backend | None = None,
) -> ShardedArray:
    """Standard normal values that depend on ``seed`` and the global index only (see ``rand``).

    >>> import torch, fshard
    >>> a = fshard.randn(fshard.Replicated([0, 1]), 4, seed=1)
    >>> torch.equal(a.addressable_shards[0].data, a.addressable_shards[1].data)
    True
    """
    s = _random.draw_seed() if seed is None else int(seed)
    gshape = parse_shape(shape)
    fill: Fill = lambda m, dt, dev: _random.box_normal(s, gshape, m.offsets, m.sizes, dt, dev)  # noqa: E731
    return _create(spec, shape, fill, dtype, device, requires_grad, backend)


def _like(
    maker: Callable[..., ShardedArray], array: ShardedArray, dtype: Any, requires_grad: bool, **kw: Any
) -> ShardedArray:
    if is_sharded_tensor(array):  # torch's ShardedTensor: its layout and process group
        from fshard._interop import from_sharded_tensor

        array = from_sharded_tensor(array)
    return maker(
        array.layout,
        array.layout.shape,
        dtype=dtype or array.dtype,
        requires_grad=requires_grad,
        backend=array.backend,
        **kw,
    )


def zeros_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Zeros in ``array``'s layout (and dtype unless given).

    >>> import fshard
    >>> x = fshard.ones(fshard.Chunk(0, [0, 1]), 4)
    >>> fshard.gather(fshard.zeros_like(x)).tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    return _like(zeros, array, dtype, requires_grad)


def ones_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Ones in ``array``'s layout.

    >>> import fshard
    >>> fshard.ones_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2)).layout.ranks
    (0, 1)
    """
    return _like(ones, array, dtype, requires_grad)


def empty_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Uninitialised values in ``array``'s layout.

    >>> import torch, fshard
    >>> fshard.empty_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2), dtype=torch.int8).dtype
    torch.int8
    """
    return _like(empty, array, dtype, requires_grad)


def full_like(
    array: ShardedArray, fill_value: Any, *, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """``fill_value`` in ``array``'s layout.

    >>> import fshard
    >>> fshard.gather(fshard.full_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2), 8.5)).tolist()
    [8.5, 8.5]
    """
    return _like(full, array, dtype, requires_grad, fill_value=fill_value)


def rand_like(
    array: ShardedArray, *, seed: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """Layout-invariant uniform values in ``array``'s layout (see ``rand``).

    >>> import fshard
    >>> x = fshard.zeros(fshard.Chunk(0, [0, 1]), 3)
    >>> fshard.equal(fshard.rand_like(x, seed=3), fshard.rand(fshard.Replicated([0]), 3, seed=3))
    True
    """
    return _like(rand, array, dtype, requires_grad, seed=seed)


def randn_like(
    array: ShardedArray, *, seed: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """Layout-invariant normal values in ``array``'s layout (see ``randn``).

    >>> import fshard
    >>> fshard.randn_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 3), seed=3).shape
    torch.Size([3])
    """
    return _like(randn, array, dtype, requires_grad, seed=seed)
