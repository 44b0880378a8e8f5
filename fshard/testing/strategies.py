"""Hypothesis strategies for placements, specs, layouts, dtypes and sharded arrays.

They need hypothesis, which the ``test`` extra installs (``pip install 'fshard[test]'``).
Use them to property-test your own sharded code the way fshard tests itself:

>>> from hypothesis import given
>>> import fshard
>>> from fshard.testing import strategies as fst
>>> @given(fst.arrays_and_layouts(fst.shapes(max_dims=2)))
... def test_reshard_keeps_values(pair):
...     x, layout = pair
...     assert fshard.equal(fshard.reshard(x, layout), x)
>>> test_reshard_keeps_values()

Every strategy takes ``world`` (ranks are drawn from ``range(world)``) and produces
valid values only; shrinking goes towards fewer dims, fewer shards and rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union, cast

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fshard._api.shard import shard
from fshard._array.array import ShardedArray
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement
from fshard._layout.specs import Chunk, Explicit, Mesh, Named, Partial, Replicated, Single

__all__ = [
    "arrays",
    "arrays_and_layouts",
    "chunk_specs",
    "dtypes",
    "guillotine_layouts",
    "layout_pairs",
    "layouts",
    "named_specs",
    "partial_specs",
    "placements",
    "shapes",
    "specs",
    "values",
]


def _at_least(what: str, name: str, value: Any, low: int, meaning: str = "") -> None:
    """Raises ``ValueError`` unless ``value`` (a strategy's parameter ``name``) is an int of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        said = f" ({meaning})" if meaning else ""
        raise ValueError(f"{what} needs {name} >= {low}{said}, got {value!r}.")


def _check_world(world: Any, what: str) -> None:
    _at_least(what, "world", world, 1, "ranks 0 .. world-1")


def placements(world: int = 4, devices: Sequence[str] = ("cpu",)) -> st.SearchStrategy[Placement]:
    """Placements on ranks ``0 .. world-1`` and the given devices."""
    _check_world(world, "placements()")
    return st.builds(Placement, st.integers(0, world - 1), st.sampled_from(tuple(devices)))


def shapes(
    min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 6
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global array shapes; sides of 0 are allowed unless ``min_side`` > 0."""
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def _rank_lists(world: int, min_size: int = 1, max_size: int | None = None) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, world - 1), min_size=min_size, max_size=max_size or world, unique=True)


@st.composite
def chunk_specs(draw: st.DrawFn, ndim: int, world: int = 4) -> Chunk:
    """``Chunk`` specs over 1 to ``world + 2`` placements (a rank may hold several chunks)."""
    if ndim == 0:
        raise ValueError("chunk_specs needs ndim >= 1: a 0-D array has no dim to split.")
    _check_world(world, "chunk_specs()")
    dim = draw(st.integers(-ndim, ndim - 1))
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world + 2))
    return Chunk(dim, ranks)


@st.composite
def named_specs(draw: st.DrawFn, ndim: int, world: int = 4) -> Named:
    """``Named`` specs on a random mesh of up to ``world`` distinct ranks (1-3 axes)."""
    _check_world(world, "named_specs()")
    sides = draw(st.lists(st.integers(1, world), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= world))
    n = math.prod(sides)  # that many distinct ranks, in any order (a permutation of them all would be world long)
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n, unique=True))
    mesh = Mesh(tuple(sides), ranks)
    axes = list(mesh.axis_names or ())
    partition: list[object] = []
    for _ in range(ndim):
        free = [a for a in axes if all(a != p and not (isinstance(p, tuple) and a in p) for p in partition)]
        choice = draw(st.sampled_from(["none", "one", "many"]) if free else st.just("none"))
        if choice == "none":
            partition.append(None)
        elif choice == "one":
            partition.append(draw(st.sampled_from(free)))
        else:
            partition.append(tuple(draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))))
    return Named(mesh, tuple(partition))


def _split(draw: st.DrawFn, lo: list[int], hi: list[int], depth: int) -> list[tuple[list[int], list[int]]]:
    """A guillotine partition of ``[lo, hi)``: cut along a random dim, recurse on both halves."""
    cuttable = [k for k in range(len(lo)) if hi[k] - lo[k] > 1]
    if not cuttable or depth == 0 or not draw(st.booleans()):
        return [(lo, hi)]
    k = draw(st.sampled_from(cuttable))
    at = draw(st.integers(lo[k] + 1, hi[k] - 1))
    left_hi, right_lo = list(hi), list(lo)
    left_hi[k], right_lo[k] = at, at
    return _split(draw, lo, left_hi, depth - 1) + _split(draw, right_lo, hi, depth - 1)


@st.composite
def guillotine_layouts(
    draw: st.DrawFn,
    shape: tuple[int, ...],
    world: int = 4,
    *,
    max_replicas: int = 3,
    empty: bool = True,
    depth: int = 4,
) -> Layout:
    """Random guillotine partitions of ``shape``: each box on 1 to ``max_replicas`` ranks, plus empty shards.

    Empty shards (a zero side, in any dim) may sit at any non-negative offset, as the layout rules allow.

    Raises:
        ValueError: ``world`` or ``max_replicas`` below 1, or ``depth`` below 0.
    """
    _check_world(world, "guillotine_layouts()")
    _at_least("guillotine_layouts()", "max_replicas", max_replicas, 1)
    _at_least("guillotine_layouts()", "depth", depth, 0, "cuts of cuts")
    shards: list[ShardMeta] = []
    for lo, hi in _split(draw, [0] * len(shape), list(shape), depth):
        size = tuple(b - a for a, b in zip(lo, hi))
        shards += [ShardMeta(tuple(lo), size, r) for r in draw(_rank_lists(world, 1, min(max_replicas, world)))]
    for _ in range(draw(st.integers(0, 2)) if empty and shape else 0):
        offsets = tuple(draw(st.integers(0, 2 * s + 1)) for s in shape)
        zero = draw(st.integers(0, len(shape) - 1))  # the dim whose side is 0
        sizes = tuple(0 if d == zero else draw(st.sampled_from([0, 1])) for d in range(len(shape)))
        shard = ShardMeta(offsets, sizes, draw(st.integers(0, world - 1)))
        if shard not in shards:
            shards.append(shard)
    order = draw(st.permutations(range(len(shards))))
    return Layout(shape, tuple(shards[i] for i in order))


@st.composite
def specs(draw: st.DrawFn, shape: tuple[int, ...], world: int = 4) -> Chunk | Named | Replicated | Single | Explicit:
    """Any spec valid for ``shape``: chunk, named mesh, replicated, single, or explicit guillotine boxes."""
    kinds = ["named", "replicated", "single", "explicit"] + (["chunk"] if shape else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "chunk":
        return draw(chunk_specs(len(shape), world))
    if kind == "named":
        return draw(named_specs(len(shape), world))
    if kind == "replicated":
        return Replicated(draw(_rank_lists(world)))
    if kind == "single":
        return Single(draw(st.integers(0, world - 1)))
    return Explicit(draw(guillotine_layouts(shape, world)).shards)


@st.composite
def partial_specs(draw: st.DrawFn, shape: tuple[int, ...], world: int = 4) -> Partial:
    """``Partial`` specs for ``shape``: a pending sum, max or min over the copies of any spec.

    Half of them are over a ``Named`` spec, and where its mesh has unused axes, ``over=`` may
    name some of them: the copies along those are summands, those along the others replicas
    of each summand (DTensor's ``[Replicate(), Partial()]``).

    >>> from hypothesis import find
    >>> spec = find(partial_specs((4, 2)), lambda p: p.layout((4, 2)).terms is not None)
    >>> spec.layout((4, 2)).partial in ("sum", "max", "min")
    True
    """
    spec = draw(named_specs(len(shape), world) if draw(st.booleans()) else specs(shape, world))
    op = draw(st.sampled_from(["sum", "max", "min"]))
    if not isinstance(spec, Named):
        return Partial(spec, op)
    used = {a for p in spec.partition if p is not None for a in ((p,) if isinstance(p, str) else p)}
    unused = [a for a in spec.mesh.axis_names if a not in used]
    if not unused or draw(st.booleans()):
        return Partial(spec, op)
    return Partial(spec, op, over=tuple(draw(st.lists(st.sampled_from(unused), min_size=1, unique=True))))


def layouts(shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]], world: int = 4) -> st.SearchStrategy[Layout]:
    """Layouts of ``shape`` (a shape or a strategy of shapes) drawn from every kind of ``specs``.

    None is a pending reduction: ``partial_specs`` draws those.
    """
    _check_world(world, "layouts()")
    shape_st = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))
    return shape_st.flatmap(lambda s: specs(s, world).map(lambda spec: spec.layout(s)))


def layout_pairs(
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]], world: int = 4
) -> st.SearchStrategy[tuple[Layout, Layout]]:
    """Two layouts of one shape: the source and target of a reshard."""
    shape_st = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))
    return shape_st.flatmap(lambda s: st.tuples(layouts(s, world), layouts(s, world)))


_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.bool)
# The numpy dtype that draws each torch dtype's values (bfloat16 through float32, then rounded).
_NUMPY: dict[torch.dtype, type[np.generic]] = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bfloat16: np.float32,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}

DtypeLike = Union[torch.dtype, st.SearchStrategy[torch.dtype], None]


def dtypes(include: Sequence[torch.dtype] = _DTYPES) -> st.SearchStrategy[torch.dtype]:
    """Torch dtypes from ``include`` (default: float32, float64, int64, int32, bfloat16, bool).

    Raises:
        ValueError: ``include`` is empty or holds a dtype the array strategies cannot fill.
    """
    if isinstance(include, torch.dtype):
        include = (include,)  # one dtype, as dtypes(torch.float32) reads
    include = tuple(include)
    unknown = [d for d in include if d not in _NUMPY]
    if not include or unknown:
        msg = f"dtypes() takes a non-empty list of {sorted(map(str, _NUMPY))}, got {list(include)}."
        raise ValueError(msg)
    return st.sampled_from(include)


def values(dtype: torch.dtype) -> st.SearchStrategy[Any]:
    """Python scalars for ``dtype``: finite floats or complex numbers, integers, or booleans.

    Floats (and complex numbers) take any finite magnitude the dtype holds, -0.0 and
    subnormals included; integers cover its whole range.

    Raises:
        ValueError: a dtype that ``dtypes()`` does not take.
    """
    kind = _NUMPY.get(dtype) if isinstance(dtype, torch.dtype) else None  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
    if kind is None:
        raise ValueError(f"values() cannot draw dtype {dtype!r}; use one of {sorted(map(str, _NUMPY))}.")
    if dtype == torch.bool:
        return st.booleans()
    if dtype == torch.bfloat16:  # drawn as float32, then rounded to what bfloat16 holds
        top = float(torch.finfo(dtype).max)
        return st.floats(-top, top, allow_nan=False, width=32).map(_to_bfloat16)
    bits = np.dtype(kind).itemsize * 8
    if dtype.is_complex:
        top = float(torch.finfo(dtype).max)
        return st.complex_numbers(max_magnitude=top, allow_nan=False, allow_infinity=False, width=bits)  # type: ignore[arg-type]
    if dtype.is_floating_point:
        top = float(torch.finfo(dtype).max)
        return st.floats(-top, top, allow_nan=False, width=bits)  # type: ignore[arg-type]
    info = np.iinfo(cast("type[np.integer[Any]]", kind))  # neither bool, float nor complex: an integer type
    return st.integers(int(info.min), int(info.max))


def _to_bfloat16(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.bfloat16))


def _tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype, elements: Any) -> torch.Tensor:
    kind = _NUMPY[dtype]
    try:
        data = draw(hnp.arrays(kind, shape, elements=elements if elements is not None else values(dtype)))
    except OverflowError as exc:  # numpy's, for a value of elements= that dtype cannot hold (-5 as uint8)
        raise ValueError(f"arrays() elements= drew a value that {dtype} cannot hold ({exc}).") from exc
    # np.array copies into a fresh, writable, C-ordered array; a 0-D draw comes back a numpy scalar.
    # torch's stub leaves from_numpy's argument untyped.
    return torch.from_numpy(np.array(data, dtype=kind).reshape(shape)).to(dtype)  # pyright: ignore[reportUnknownMemberType]


def _dtype(draw: st.DrawFn, dtype: DtypeLike) -> torch.dtype:
    got: Any = draw(dtypes()) if dtype is None else draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
    if not isinstance(got, torch.dtype) or got not in _NUMPY:
        raise ValueError(f"arrays() cannot fill dtype {got!r}; use one of {sorted(map(str, _NUMPY))}.")
    return got


def _shape(draw: st.DrawFn, shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None) -> tuple[int, ...]:
    return draw(shapes() if shape is None else shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape)))


@st.composite
def arrays(
    draw: st.DrawFn,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: DtypeLike = None,
    world: int = 4,
    *,
    elements: st.SearchStrategy[Any] | None = None,
) -> ShardedArray:
    """``ShardedArray`` values on the local backend with random layouts, dtypes and contents.

    Args:
        draw: passed by ``st.composite``; callers leave it out.
        shape: a shape, a strategy of shapes, or ``None`` for ``shapes()``.
        dtype: a torch dtype, a strategy of them (``dtypes()``), or ``None`` for ``dtypes()``.
        world: ranks are drawn from ``range(world)``.
        elements: a strategy of the values (default ``values(dtype)``: finite floats of every
            magnitude the dtype holds, integers over its range, booleans).
    """
    s = _shape(draw, shape)
    layout = draw(layouts(s, world))
    return shard(_tensor(draw, s, _dtype(draw, dtype), elements), layout)


@st.composite
def arrays_and_layouts(
    draw: st.DrawFn,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: DtypeLike = None,
    world: int = 4,
    *,
    elements: st.SearchStrategy[Any] | None = None,
) -> tuple[ShardedArray, Layout]:
    """An array (as ``arrays``) and a second layout of its shape: the input and target of a reshard."""
    s = _shape(draw, shape)
    x = draw(arrays(st.just(s), dtype, world, elements=elements))
    return x, draw(layouts(s, world))
