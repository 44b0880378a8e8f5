"""Hypothesis strategies for placements, specs, layouts and sharded arrays.

Use them to property-test your own sharded code the way fshard tests itself:

>>> from hypothesis import given
>>> import fshard
>>> from fshard.testing import strategies as fst
>>> @given(fst.layout_pairs(fst.shapes()))
... def test_reshard_round_trip(pair):
...     a, b = pair
...     x = torch.arange(float(a.numel)).reshape(a.shape)
...     assert torch.equal(fshard.gather(fshard.reshard(fshard.shard(x, a), b)), x)
>>> test_reshard_round_trip()

Every strategy takes ``world`` (ranks are drawn from ``range(world)``) and produces
valid values only; shrinking goes towards fewer dims, fewer shards and rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from fshard._array import ShardedArray
from fshard._layout import Layout, ShardMeta
from fshard._placement import Placement
from fshard._specs import Chunk, Explicit, Mesh, Named, Replicated, Single

__all__ = [
    "arrays",
    "chunk_specs",
    "guillotine_layouts",
    "layout_pairs",
    "layouts",
    "named_specs",
    "placements",
    "shapes",
    "specs",
]


def placements(world: int = 4, devices: Sequence[str] = ("cpu",)) -> st.SearchStrategy[Placement]:
    """Placements on ranks ``0 .. world-1`` and the given devices."""
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
    dim = draw(st.integers(-ndim, ndim - 1))
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world + 2))
    return Chunk(dim, ranks)


@st.composite
def named_specs(draw: st.DrawFn, ndim: int, world: int = 4) -> Named:
    """``Named`` specs on a random mesh of up to ``world`` distinct ranks (1-3 axes)."""
    sides = draw(st.lists(st.integers(1, world), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= world))
    ranks = draw(st.permutations(range(world)))[: math.prod(sides)]
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

    Empty shards (a zero side) may sit at any non-negative offset, as the layout rules allow.
    """
    shards: list[ShardMeta] = []
    for lo, hi in _split(draw, [0] * len(shape), list(shape), depth):
        size = tuple(b - a for a, b in zip(lo, hi))
        shards += [ShardMeta(tuple(lo), size, r) for r in draw(_rank_lists(world, 1, min(max_replicas, world)))]
    for _ in range(draw(st.integers(0, 2)) if empty and shape else 0):
        offsets = tuple(draw(st.integers(0, 2 * s + 1)) for s in shape)
        sizes = (0, *(draw(st.sampled_from([0, 1])) for _ in shape[1:]))
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


def layouts(shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]], world: int = 4) -> st.SearchStrategy[Layout]:
    """Layouts of ``shape`` (a shape or a strategy of shapes) drawn from every kind of spec."""
    shape_st = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))
    return shape_st.flatmap(lambda s: specs(s, world).map(lambda spec: spec.layout(s)))


def layout_pairs(
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]], world: int = 4
) -> st.SearchStrategy[tuple[Layout, Layout]]:
    """Two layouts of one shape: the source and target of a reshard."""
    shape_st = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))
    return shape_st.flatmap(lambda s: st.tuples(layouts(s, world), layouts(s, world)))


_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.bool)


@st.composite
def arrays(
    draw: st.DrawFn,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: torch.dtype | None = None,
    world: int = 4,
) -> ShardedArray:
    """``ShardedArray`` values on the local backend with random layouts, dtypes and contents.

    Contents are drawn as small integers so every dtype holds them exactly.
    """
    from fshard._ops import shard

    s = draw(shapes() if shape is None else shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape)))
    layout = draw(layouts(s, world))
    dt = dtype if dtype is not None else draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, s, generator=g)
    return shard(values.to(dt), layout)
