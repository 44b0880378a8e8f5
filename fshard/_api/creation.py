"""Creation functions: each rank allocates only its own boxes."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from fshard._api import random as _random
from fshard._api.move import resolve_backend
from fshard._array.array import ShardedArray
from fshard._base import boxes as _boxes
from fshard._base.alloc import no_summand
from fshard._base.cache import cached
from fshard._errors import LayoutError, SpecError
from fshard._exec.autograd import check_orderable
from fshard._exec.collective import collective
from fshard._interop.torch_objects import from_sharded_tensor
from fshard._layout.layout import Layout, ShardMeta, replica_ids
from fshard._layout.specs import as_layout
from fshard._layout.torch_meta import is_sharded_tensor
from fshard._layout.validate import MAX_EXTENT, check_shape
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
        shape = tuple(cast("Sequence[Any]", shape[0]))
    return check_shape(shape)


def _on_device(layout: Layout, device: Any) -> Layout:
    if device is None:
        return layout
    try:
        dev = str(torch.device(device))
    except (TypeError, RuntimeError) as exc:
        raise SpecError(f"device={device!r} is not a torch device such as 'cpu' or 'cuda:0'.") from exc
    return _placed_on(layout, dev)


@cached(256)
def _placed_on(layout: Layout, dev: str) -> Layout:
    """``layout`` with every shard on device ``dev`` of its rank (its pending reduction and terms kept)."""
    lo, sz, rank, _ = layout.columns
    return Layout.from_arrays(layout.shape, lo, sz, rank, dev, layout.partial, layout.terms)


@cached(256)
def _filled(layout: Layout) -> np.ndarray | None:
    """Per shard, whether it takes the requested values (``None``: every shard does).

    Of a pending sum, each box's first summand (its first copy in layout order and that
    copy's replicas, ``Layout.terms``) takes them and the other summands add nothing (-0.0), so the
    sum is the requested value; every copy of a pending max or min takes them.

    >>> import fshard
    >>> _filled(fshard.Partial(fshard.Replicated([0, 1, 2])).layout((2,))).tolist()
    [True, False, False]
    """
    if layout.partial != "sum":
        return None
    lo, sz, _, _ = layout.columns
    first, box = _boxes.unique_rows(np.c_[lo, sz])
    ids = replica_ids(layout)
    out = ids == ids[first[box]]
    out.setflags(write=False)
    return out


_QUANTIZED = frozenset(
    getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name)
)


def check_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` itself (``None`` or a ``torch.dtype`` that is not quantized), else ``TypeError``."""
    if isinstance(dtype, torch.dtype) and dtype in _QUANTIZED:  # torch fills none of them (zeros, ones, rand)
        msg = (
            f"dtype={dtype} is quantized, which fshard's creation functions do not make: create the array in "
            "torch.float32 and quantize its blocks, fshard.map_local(lambda t: torch.quantize_per_tensor(t, "
            "scale, zero_point, dtype), x)."
        )
        raise TypeError(msg)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r} ({type(dtype).__name__}).")


def _check_grad(requires_grad: Any, dtype: torch.dtype) -> None:
    if type(requires_grad) is not bool:
        kind = type(requires_grad).__name__
        raise TypeError(f"requires_grad must be True or False, got {requires_grad!r} ({kind}).")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"requires_grad=True needs a floating point or complex dtype, got {dtype}.")


def _check_sizes(layout: Layout, dtype: torch.dtype) -> None:
    """Raises ``LayoutError`` for a shard too large for one tensor (more than 2**63 - 1 bytes).

    Every shard of the layout is checked, not only this rank's, so that every rank raises
    the same error. An empty shard counts its other extents: torch multiplies every extent
    before the 0 and refuses ``torch.zeros(2**40, 2**40, 0)`` as it refuses
    ``torch.zeros(2**40, 2**40)``.
    """
    sz = layout.columns.sz
    # float64 bytes are within a factor 1 + 1e-14: those above half the limit are counted exactly.
    approx = np.where(sz > 0, sz, 1).astype(np.float64).prod(axis=1) * dtype.itemsize
    for i in np.flatnonzero(approx > MAX_EXTENT / 2).tolist():
        sizes = tuple(sz[i].tolist())
        if math.prod(s for s in sizes if s) * dtype.itemsize > MAX_EXTENT:
            empty = " (it is empty, but torch counts the extents other than 0 all the same)" if 0 in sizes else ""
            msg = (
                f"shape {layout.shape} gives shard {i} sizes {sizes}: more than 2**63 - 1 bytes of {dtype}, "
                f"the most one tensor holds{empty}. Use a smaller shape or more shards."
            )
            raise LayoutError(msg)


def _create(
    spec: Any, shape: tuple[Any, ...], fill: Fill, dtype: Any, device: Any, requires_grad: Any, backend: Backend | None
) -> ShardedArray:
    dtype = check_dtype(dtype) or torch.get_default_dtype()
    _check_grad(requires_grad, dtype)
    backend = resolve_backend(backend)
    layout = _on_device(as_layout(spec, parse_shape(shape)), device)
    backend.check_layout(layout)
    _check_sizes(layout, dtype)
    check_orderable(layout.partial, dtype)
    filled = _filled(layout)
    data: list[torch.Tensor] = []
    for i in backend.addressable(layout):
        meta = layout._shard(i)  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
        dev = torch.device(meta.placement.device)
        if filled is None or filled[i]:
            t = fill(meta, dtype, dev)
        else:
            t = no_summand(torch.empty(meta.sizes, dtype=dtype, device=dev))
        data.append(t.requires_grad_(requires_grad) if requires_grad else t)
    return ShardedArray(layout, data, backend, dtype, requires_grad=requires_grad)


def _check_fill(fill_value: Any, dtype: Any) -> None:
    """Raises unless ``fill_value`` is a number that ``dtype`` (default: torch's) can hold."""
    dtype = check_dtype(dtype) or torch.get_default_dtype()
    try:
        torch.full((), fill_value, dtype=dtype)
    except TypeError as exc:
        kind = type(fill_value).__name__
        raise TypeError(f"fill_value must be a number, got {fill_value!r} ({kind}).") from exc
    except (RuntimeError, OverflowError) as exc:
        raise SpecError(f"fill_value={fill_value!r} does not fit dtype {dtype}: give a value in its range.") from exc


def _seed(seed: Any) -> int:
    """``seed`` as an int (``None``: one drawn from torch's default generator).

    Raises:
        TypeError: ``seed`` is neither an int nor ``None``.
        ValueError: it does not fit 64 bits (``torch.manual_seed``'s range), where two seeds would give one stream.
    """
    if seed is None:
        return _random.draw_seed()
    if not isinstance(seed, bool):
        try:
            value = operator.index(seed)
        except TypeError:
            pass
        else:
            if not -(1 << 63) <= value < 1 << 64:
                msg = f"seed {value} does not fit 64 bits: give one in [-2**63, 2**64), as torch.manual_seed takes."
                raise ValueError(msg)
            return value
    raise TypeError(f"seed must be an int or None, got {seed!r} ({type(seed).__name__}).")


def _const(make: Callable[..., torch.Tensor], *args: Any) -> Fill:
    return lambda m, dtype, device: make(m.sizes, *args, dtype=dtype, device=device)


@collective("zeros")
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


@collective("ones")
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


@collective("empty")
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


@collective("full")
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
    _check_fill(fill_value, dtype)
    return _create(spec, shape, _const(torch.full, fill_value), dtype, device, requires_grad, backend)


@collective("rand")
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
    dtype = _random.real_dtype(check_dtype(dtype) or torch.get_default_dtype(), "rand()")
    s = _seed(seed)
    gshape = parse_shape(shape)
    fill: Fill = lambda m, dt, dev: _random.box_uniform(s, gshape, m.offsets, m.sizes, dt, dev)  # noqa: E731
    return _create(spec, shape, fill, dtype, device, requires_grad, backend)


@collective("randn")
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
    dtype = _random.real_dtype(check_dtype(dtype) or torch.get_default_dtype(), "randn()")
    s = _seed(seed)
    gshape = parse_shape(shape)
    fill: Fill = lambda m, dt, dev: _random.box_normal(s, gshape, m.offsets, m.sizes, dt, dev)  # noqa: E731
    return _create(spec, shape, fill, dtype, device, requires_grad, backend)


def _like(
    maker: Callable[..., ShardedArray], array: object, dtype: Any, requires_grad: bool, random: bool = False, **kw: Any
) -> ShardedArray:
    if is_sharded_tensor(array):  # torch's ShardedTensor: its layout and process group
        array = from_sharded_tensor(array)
    if not isinstance(array, ShardedArray):
        raise TypeError(f"{maker.__name__}_like() takes a ShardedArray, got {type(array).__name__}.")
    dtype = check_dtype(dtype)
    if random:
        _random.real_dtype(dtype or array.dtype, f"{maker.__name__}_like()", inherited=dtype is None)
    return maker(
        array.layout,
        array.layout.shape,
        dtype=dtype or array.dtype,
        requires_grad=requires_grad,
        backend=array.backend,
        **kw,
    )


@collective("zeros_like")
def zeros_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Zeros in ``array``'s layout (and dtype unless given).

    >>> import fshard
    >>> x = fshard.ones(fshard.Chunk(0, [0, 1]), 4)
    >>> fshard.gather(fshard.zeros_like(x)).tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    return _like(zeros, array, dtype, requires_grad)


@collective("ones_like")
def ones_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Ones in ``array``'s layout.

    >>> import fshard
    >>> fshard.ones_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2)).layout.ranks
    (0, 1)
    """
    return _like(ones, array, dtype, requires_grad)


@collective("empty_like")
def empty_like(array: ShardedArray, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> ShardedArray:
    """Uninitialised values in ``array``'s layout.

    >>> import torch, fshard
    >>> fshard.empty_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2), dtype=torch.int8).dtype
    torch.int8
    """
    return _like(empty, array, dtype, requires_grad)


@collective("full_like")
def full_like(
    array: ShardedArray, fill_value: Any, *, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """``fill_value`` in ``array``'s layout.

    >>> import fshard
    >>> fshard.gather(fshard.full_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 2), 8.5)).tolist()
    [8.5, 8.5]
    """
    return _like(full, array, dtype, requires_grad, fill_value=fill_value)


@collective("rand_like")
def rand_like(
    array: ShardedArray, *, seed: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """Layout-invariant uniform values in ``array``'s layout (see ``rand``).

    >>> import fshard
    >>> x = fshard.zeros(fshard.Chunk(0, [0, 1]), 3)
    >>> fshard.equal(fshard.rand_like(x, seed=3), fshard.rand(fshard.Replicated([0]), 3, seed=3))
    True
    """
    return _like(rand, array, dtype, requires_grad, random=True, seed=seed)


@collective("randn_like")
def randn_like(
    array: ShardedArray, *, seed: int | None = None, dtype: torch.dtype | None = None, requires_grad: bool = False
) -> ShardedArray:
    """Layout-invariant normal values in ``array``'s layout (see ``randn``).

    >>> import fshard
    >>> fshard.randn_like(fshard.zeros(fshard.Chunk(0, [0, 1]), 3), seed=3).shape
    torch.Size([3])
    """
    return _like(randn, array, dtype, requires_grad, random=True, seed=seed)
