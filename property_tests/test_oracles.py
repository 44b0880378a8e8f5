"""Specs against torch's own arithmetic: ``Chunk`` vs ``ChunkShardingSpec``, ``Named`` vs DTensor.

``Chunk(dim, placements).layout(shape)`` must equal what torch's
``ChunkShardingSpec(dim, placements).build_metadata(...)`` builds, shard by shard.

``Named(mesh, partition)`` is checked against DTensor's
``compute_local_shape_and_global_offset``, called with a real ``DeviceMesh``.
No process group is needed: ``DeviceMesh(..., _init_backend=False, _rank=r)``
builds the mesh as rank ``r`` sees it, so one process asks DTensor for every
rank's box in turn. DTensor splits a dim sharded by several mesh axes in mesh
order (``Shard``), or in another order through ``_StridedShard``, which is
nested ``torch.chunk`` only when every split is even; fshard splits in the
order the partition names the axes, with ``torch.chunk`` at every step (JAX's
order, DTensor's per-split rule). Hence three checks: mesh-ordered partitions
against ``Shard`` placements at any size, any order against ``_StridedShard``
placements at even sizes, and any order at any size against the rule itself,
nested ``torch.chunk`` of the global indices.

An empty box holds nothing, so where it sits is a convention; both put it at
``shape[dim]``, and offsets are compared for every box.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import fshard
from fshard.testing import strategies as fst

DEVICES = ("cpu", "cuda:0", "cuda:1")

# -- strategies ----------------------------------------------------------------------------


@st.composite
def chunk_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], int, list[str]]:
    """A shape (zero sides allowed), a valid dim (negative too) and 1-9 placement strings."""
    shape = draw(fst.shapes(min_dims=1, max_dims=3, max_side=7))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    places = draw(st.lists(fst.placements(world=6, devices=DEVICES), min_size=1, max_size=9))
    return shape, dim, [str(p) for p in places]


@st.composite
def meshes(draw: st.DrawFn) -> fshard.Mesh:
    """Meshes of 1-3 axes (sides 1-4, at most 16 positions) over distinct, not necessarily contiguous, ranks."""
    sides = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= 16))
    ranks = draw(st.permutations(range(20)))[: math.prod(sides)]
    names = draw(st.sampled_from([None, ("dp", "tp", "cp")[: len(sides)]]))
    return fshard.Mesh(tuple(sides), ranks, names)


@st.composite
def partitions(draw: st.DrawFn, mesh: fshard.Mesh, ndim: int) -> tuple[Any, ...]:
    """Up to ``ndim`` entries: ``None``, one axis, or a tuple of axes in any order; each axis used once."""
    free = list(mesh.axis_names or ())
    out: list[Any] = []
    for _ in range(draw(st.integers(0, ndim))):
        kind = draw(st.sampled_from(["none", "one", "many"])) if free else "none"
        if kind == "none":
            out.append(None)
            continue
        axes = draw(
            st.lists(st.sampled_from(free), min_size=1, max_size=1 if kind == "one" else len(free), unique=True)
        )
        free = [a for a in free if a not in axes]
        out.append(axes[0] if kind == "one" else tuple(axes))
    return tuple(out)


@st.composite
def named_cases(draw: st.DrawFn, *, even: bool = False) -> tuple[fshard.Mesh, tuple[Any, ...], tuple[int, ...]]:
    """A mesh, a partition and a shape; with ``even``, every sharded side divides by its axes' product."""
    mesh = draw(meshes())
    ndim = draw(st.integers(0, 3))
    partition = draw(partitions(mesh, ndim))
    shape = []
    for d in range(ndim):
        parts = math.prod(mesh.shape[mesh.axis(a)] for a in axes_of(partition, d))
        shape.append(parts * draw(st.integers(0, 3)) if even else draw(st.integers(0, 13)))
    return mesh, partition, tuple(shape)


# -- helpers -------------------------------------------------------------------------------


def axes_of(partition: tuple[Any, ...], d: int) -> tuple[str, ...]:
    """The mesh axes that split dim ``d``, outermost first."""
    entry = partition[d] if d < len(partition) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def in_mesh_order(mesh: fshard.Mesh, partition: tuple[Any, ...]) -> tuple[Any, ...]:
    """``partition`` with each tuple of axes sorted in mesh order (what plain ``Shard`` placements express)."""
    return tuple(e if e is None or isinstance(e, str) else tuple(sorted(e, key=mesh.axis)) for e in partition)


def dtensor_placements(mesh: fshard.Mesh, partition: tuple[Any, ...]) -> list[Any]:
    """DTensor placements per mesh axis: ``Shard(d)``, ``Replicate()``, or ``_StridedShard`` where an axis
    splits dim ``d`` inside axes that come later in the mesh (the FSDP2 + TP encoding)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = [Replicate()] * len(mesh.shape)
    for d in range(len(partition)):
        axes = axes_of(partition, d)
        for j, a in enumerate(axes):
            i = mesh.axis(a)
            factor = math.prod(mesh.shape[mesh.axis(b)] for b in axes[:j] if mesh.axis(b) > i)
            out[i] = Shard(d) if factor == 1 else _StridedShard(d, split_factor=factor)
    return out


def device_mesh(mesh: fshard.Mesh, rank: int) -> DeviceMesh:
    """``mesh`` as a torch ``DeviceMesh`` seen from ``rank``, built without a process group."""
    grid = torch.tensor([p.rank for p in mesh.ranks]).reshape(mesh.shape)
    return DeviceMesh("cpu", grid, mesh_dim_names=mesh.axis_names, _init_backend=False, _rank=rank)


def assert_matches_dtensor(layout: fshard.Layout, mesh: fshard.Mesh, placements: list[Any]) -> None:
    for s in layout.shards:
        sizes, offsets = compute_local_shape_and_global_offset(
            layout.shape, device_mesh(mesh, s.placement.rank), placements
        )
        assert (tuple(sizes), tuple(offsets)) == (s.sizes, s.offsets), s


def chunk_index(n: int, splits: list[tuple[int, int]]) -> torch.Tensor:
    """The global indices of ``[0, n)`` left after ``torch.chunk`` into ``parts``, keeping piece ``index``,
    for each (parts, index) in turn; a piece that ``torch.chunk`` does not return is empty."""
    idx = torch.arange(n)
    for parts, index in splits:
        pieces = torch.chunk(idx, parts) if idx.numel() else ()
        idx = pieces[index] if index < len(pieces) else idx[:0]
    return idx


# -- Chunk vs ChunkShardingSpec --------------------------------------------------------------


@given(chunk_cases())
def test_chunk_equals_chunk_sharding_spec(case: tuple[tuple[int, ...], int, list[str]]) -> None:
    shape, dim, places = case
    want = ChunkShardingSpec(dim, list(places)).build_metadata(torch.Size(shape), TensorProperties())
    got = fshard.Chunk(dim, places).layout(shape)
    assert got.shape == tuple(want.size)
    assert len(got.shards) == len(want.shards_metadata)
    for mine, theirs in zip(got.shards, want.shards_metadata):
        assert list(mine.offsets) == list(theirs.shard_offsets)
        assert list(mine.sizes) == list(theirs.shard_sizes)
        assert str(mine.placement) == str(theirs.placement)
    assert fshard.Layout.from_torch_metadata(want) == got


@given(fst.shapes(min_dims=0, max_dims=3), st.integers(-6, 6))
def test_chunk_rejects_the_dims_chunk_sharding_spec_rejects(shape: tuple[int, ...], dim: int) -> None:
    valid = -len(shape) <= dim < len(shape)
    torch_error: Exception | None = None
    try:
        ChunkShardingSpec(dim, ["rank:0/cpu"]).build_metadata(torch.Size(shape), TensorProperties())
    except ValueError as exc:
        torch_error = exc
    assert (torch_error is None) == valid
    if valid:
        assert fshard.Chunk(dim, [0]).layout(shape).shape == shape
    else:
        assert "Invalid sharding dim" in str(torch_error)
        with pytest.raises(ValueError, match="Invalid sharding dim"):
            fshard.Chunk(dim, [0]).layout(shape)


def test_named_dims_are_refused_like_chunk_sharding_spec() -> None:
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        ChunkShardingSpec("rows", ["rank:0/cpu"])
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        fshard.Chunk("rows", [0])  # type: ignore[arg-type]


# -- Named vs DTensor ------------------------------------------------------------------------


@given(named_cases())
def test_named_in_mesh_order_equals_dtensor_shard(case: tuple[fshard.Mesh, tuple[Any, ...], tuple[int, ...]]) -> None:
    mesh, partition, shape = case
    partition = in_mesh_order(mesh, partition)
    layout = fshard.Named(mesh, partition).layout(shape)
    placements = dtensor_placements(mesh, partition)
    assert all(type(p) in (Shard, Replicate) for p in placements)
    assert_matches_dtensor(layout, mesh, placements)


@given(named_cases(even=True))
def test_named_in_any_order_equals_dtensor_strided_shard_when_even(
    case: tuple[fshard.Mesh, tuple[Any, ...], tuple[int, ...]],
) -> None:
    mesh, partition, shape = case
    assert_matches_dtensor(fshard.Named(mesh, partition).layout(shape), mesh, dtensor_placements(mesh, partition))


@given(named_cases())
def test_named_equals_nested_torch_chunk(case: tuple[fshard.Mesh, tuple[Any, ...], tuple[int, ...]]) -> None:
    mesh, partition, shape = case
    layout = fshard.Named(mesh, partition).layout(shape)
    assert [s.placement for s in layout.shards] == list(mesh.ranks)
    for s, coord in zip(layout.shards, itertools.product(*map(range, mesh.shape))):
        for d, n in enumerate(shape):
            idx = chunk_index(n, [(mesh.shape[mesh.axis(a)], coord[mesh.axis(a)]) for a in axes_of(partition, d)])
            assert s.sizes[d] == idx.numel()
            if idx.numel():
                assert idx.tolist() == list(range(s.offsets[d], s.offsets[d] + s.sizes[d]))
