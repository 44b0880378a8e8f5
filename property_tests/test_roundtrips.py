"""Round trips of the value types: pickle, dict/JSON, torch metadata, and pytree flattening.

Layouts come from ``fshard.testing.strategies`` (chunks, named meshes, guillotine
partitions with empty shards and replicas), with placements moved onto random
devices. torch's ``ShardedTensorMetadata`` is a plain container: it holds every
layout, replicas, devices and empty shards past the end included, so the metadata
round trip is exact for all of them. What torch refuses is a ``ShardedTensor``
built on such metadata: its validators reject overlapping boxes, so replicas
cannot be held (``fshard.to_sharded_tensor`` raises ``SpecError`` for them, which
tests/test_interop.py checks on Gloo processes); here the validators are checked
to accept every replica-free layout without empty shards and to refuse every
layout with replicas. (They also refuse some empty shards: one past the end, as
``ChunkShardingSpec`` itself places them, or one inside another box.) Metadata
that names RPC workers, or that does not tile its size, raises ``LayoutError`` on
the way back.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec._internals import check_tensor, validate_non_overlapping_shards_metadata

import fshard
from fshard.testing import strategies as fst

DEVICES = ("cpu", "cuda:0", "cuda:1", "meta")

# -- strategies ----------------------------------------------------------------------------


@st.composite
def on_devices(draw: st.DrawFn, layout: fshard.Layout) -> fshard.Layout:
    """``layout`` with each shard moved to a random device (drawn layouts never hold a box twice
    on one rank, so any devices keep them valid)."""
    shards = tuple(
        dataclasses.replace(s, placement=fshard.Placement(s.placement.rank, draw(st.sampled_from(DEVICES))))
        for s in layout.shards
    )
    return fshard.Layout(layout.shape, shards)


any_layout = st.one_of(
    fst.layouts(fst.shapes()),
    fst.shapes(min_dims=1).flatmap(fst.guillotine_layouts),
).flatmap(lambda lay: st.one_of(st.just(lay), on_devices(lay)))


@st.composite
def any_spec(draw: st.DrawFn) -> Any:
    """Every kind of spec, for a random shape."""
    return draw(fst.specs(draw(fst.shapes()), world=6))


@st.composite
def array_pairs(draw: st.DrawFn) -> tuple[fshard.ShardedArray, fshard.ShardedArray]:
    """Two arrays of one dtype, for nested containers."""
    a = draw(fst.arrays())
    return a, draw(fst.arrays(dtype=a.dtype))


# -- helpers -------------------------------------------------------------------------------


def has_replicas(layout: fshard.Layout) -> bool:
    boxes = [(s.offsets, s.sizes) for s in layout.shards if s.numel]
    return len(set(boxes)) != len(boxes)


def same_array(a: fshard.ShardedArray, b: fshard.ShardedArray) -> None:
    """Equal layout, dtype and backend, and bit-identical shards."""
    assert isinstance(b, fshard.ShardedArray)
    assert b.layout == a.layout
    assert b.dtype == a.dtype
    assert b.backend == a.backend
    assert len(a.addressable_shards) == len(b.addressable_shards)
    for x, y in zip(a.addressable_shards, b.addressable_shards):
        assert x.meta == y.meta
        assert x.data.dtype == y.data.dtype
        assert torch.equal(x.data, y.data)


def wrong_shape(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose shape differs from ``t``'s, and is no vmap batch of it (that adds exactly one leading dim)."""
    return torch.zeros((t.shape[0] + 1, *t.shape[1:]) if t.dim() else (1, 1), dtype=t.dtype)


# -- layouts -------------------------------------------------------------------------------


@given(any_layout)
def test_layout_pickle_round_trip(layout: fshard.Layout) -> None:
    back = pickle.loads(pickle.dumps(layout))
    assert back == layout
    assert hash(back) == hash(layout)
    assert back.shards == layout.shards
    assert repr(back) == repr(layout)


@given(any_layout)
def test_layout_dict_json_round_trip(layout: fshard.Layout) -> None:
    data = layout.to_dict()
    wire = json.loads(json.dumps(data))
    assert wire == data  # only lists, ints and strings: JSON changes nothing
    back = fshard.Layout.from_dict(wire)
    assert back == layout
    assert hash(back) == hash(layout)
    assert back.to_dict() == data


@given(any_layout, st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]), st.booleans())
def test_layout_torch_metadata_round_trip(layout: fshard.Layout, dtype: torch.dtype, requires_grad: bool) -> None:
    meta = layout.to_torch_metadata(dtype, requires_grad)
    assert isinstance(meta, ShardedTensorMetadata)
    assert meta.size == torch.Size(layout.shape)
    assert meta.tensor_properties.dtype == dtype
    assert meta.tensor_properties.requires_grad == requires_grad
    assert len(meta.shards_metadata) == len(layout.shards)
    for mine, theirs in zip(layout.shards, meta.shards_metadata):
        assert tuple(theirs.shard_offsets) == mine.offsets
        assert tuple(theirs.shard_sizes) == mine.sizes
        assert theirs.placement.rank() == mine.placement.rank
        assert str(theirs.placement) == str(mine.placement)
    assert fshard.Layout.from_torch_metadata(meta) == layout
    assert fshard.Layout.from_torch_metadata(pickle.loads(pickle.dumps(meta))) == layout


def test_torch_metadata_dtype_defaults_to_float32() -> None:
    meta = fshard.Chunk(0, [0, 1]).layout((4,)).to_torch_metadata()
    assert meta.tensor_properties.dtype == torch.float32
    assert meta.tensor_properties.requires_grad is False


@given(any_layout)
def test_sharded_tensor_validators_refuse_replicas_and_accept_tilings(layout: fshard.Layout) -> None:
    meta = layout.to_torch_metadata()
    if has_replicas(layout):
        with pytest.raises(ValueError, match="overlap"):
            validate_non_overlapping_shards_metadata(meta.shards_metadata)
    elif all(s.numel for s in layout.shards):
        validate_non_overlapping_shards_metadata(meta.shards_metadata)
        check_tensor(meta.shards_metadata, list(meta.size))


@given(any_layout, st.data())
def test_metadata_with_a_shard_dropped_reads_back_only_if_still_tiling(
    layout: fshard.Layout, data: st.DataObject
) -> None:
    meta = layout.to_torch_metadata()
    i = data.draw(st.integers(0, len(layout.shards) - 1))
    dropped = layout.shards[i]
    rest = meta.shards_metadata[:i] + meta.shards_metadata[i + 1 :]
    others = {(s.offsets, s.sizes) for k, s in enumerate(layout.shards) if k != i}
    still_tiles = dropped.numel == 0 or (dropped.offsets, dropped.sizes) in others
    partial = ShardedTensorMetadata(rest, meta.size, meta.tensor_properties)
    if still_tiles:
        assert fshard.Layout.from_torch_metadata(partial).shards == layout.shards[:i] + layout.shards[i + 1 :]
    else:
        with pytest.raises(fshard.LayoutError, match="do not cover element"):
            fshard.Layout.from_torch_metadata(partial)


@pytest.mark.parametrize(
    "placement", ["worker0/cuda:1", "trainer3", "cuda:0"], ids=["worker", "bare-worker", "no-rank"]
)
def test_metadata_without_ranks_raises_layout_error(placement: str) -> None:
    meta = ShardedTensorMetadata([ShardMetadata([0], [4], placement)], torch.Size([4]), TensorProperties())
    with pytest.raises(fshard.LayoutError, match=re.escape("fshard needs 'rank:<int>/<device>'")):
        fshard.Layout.from_torch_metadata(meta)


def test_non_metadata_raises_layout_error() -> None:
    with pytest.raises(fshard.LayoutError, match="Expected a torch ShardedTensorMetadata, got str"):
        fshard.Layout.from_torch_metadata("rows")
    # A list of ShardMetadata is metadata too: its shape is where the boxes end.
    assert fshard.Layout.from_torch_metadata([ShardMetadata([0], [4], "rank:0/cpu")]) == fshard.Single(0).layout((4,))


# -- specs ---------------------------------------------------------------------------------


@given(any_spec())
def test_spec_pickle_round_trip(spec: Any) -> None:
    back = pickle.loads(pickle.dumps(spec))
    assert type(back) is type(spec)
    assert back == spec
    assert hash(back) == hash(spec)
    assert repr(back) == repr(spec)


@given(fst.shapes().flatmap(lambda s: st.tuples(st.just(s), fst.specs(s, world=6))))
def test_pickled_spec_resolves_to_the_same_layout(case: tuple[tuple[int, ...], Any]) -> None:
    shape, spec = case
    assert pickle.loads(pickle.dumps(spec)).layout(shape) == spec.layout(shape)


@given(fst.named_specs(ndim=2, world=6), fst.placements(world=6, devices=DEVICES))
def test_mesh_placement_and_single_pickle_round_trip(named: fshard.Named, placement: fshard.Placement) -> None:
    for value in (named.mesh, placement, fshard.Single(placement), fshard.Replicated([placement, 7])):
        back = pickle.loads(pickle.dumps(value))
        assert back == value
        assert hash(back) == hash(value)
    assert fshard.Placement.parse(str(placement)) == placement


# -- arrays --------------------------------------------------------------------------------


@given(fst.arrays())
def test_array_pickle_round_trip(x: fshard.ShardedArray) -> None:
    back = pickle.loads(pickle.dumps(x))
    same_array(x, back)
    assert torch.equal(fshard.gather(back), fshard.gather(x))


@given(fst.arrays())
def test_array_optree_round_trip(x: fshard.ShardedArray) -> None:
    leaves, spec = optree.tree_flatten(x)
    assert len(leaves) == len(x.addressable_shards)
    assert all(a is b for a, b in zip(leaves, x.addressable_data))
    same_array(x, optree.tree_unflatten(spec, leaves))


@given(fst.arrays())
def test_array_torch_pytree_round_trip(x: fshard.ShardedArray) -> None:
    leaves, spec = torch_pytree.tree_flatten(x)
    assert all(a is b for a, b in zip(leaves, x.addressable_data))
    same_array(x, torch_pytree.tree_unflatten(leaves, spec))


@given(array_pairs())
def test_nested_containers_round_trip_in_both_pytree_libraries(
    pair: tuple[fshard.ShardedArray, fshard.ShardedArray],
) -> None:
    a, b = pair
    tree = {"a": a, "rest": [b, (torch.arange(3),)]}
    n = len(a.addressable_shards) + len(b.addressable_shards) + 1
    o_leaves, o_spec = optree.tree_flatten(tree)
    t_leaves, t_spec = torch_pytree.tree_flatten(tree)
    assert len(o_leaves) == len(t_leaves) == n
    for back in (optree.tree_unflatten(o_spec, o_leaves), torch_pytree.tree_unflatten(t_leaves, t_spec)):
        same_array(a, back["a"])
        same_array(b, back["rest"][0])
        assert torch.equal(back["rest"][1][0], torch.arange(3))


@given(fst.arrays(dtype=torch.int64))
def test_tree_map_returns_arrays_in_the_same_layout(x: fshard.ShardedArray) -> None:
    want = fshard.gather(x) * 2 + 1
    for tree_map in (optree.tree_map, torch_pytree.tree_map):
        y = tree_map(lambda t: t * 2 + 1, x)
        assert isinstance(y, fshard.ShardedArray)
        assert y.layout == x.layout
        assert torch.equal(fshard.gather(y), want)


@given(fst.arrays(), st.data())
def test_unflatten_with_a_wrongly_shaped_leaf_raises(x: fshard.ShardedArray, data: st.DataObject) -> None:
    leaves, o_spec = optree.tree_flatten(x)
    _, t_spec = torch_pytree.tree_flatten(x)
    i = data.draw(st.integers(0, len(leaves) - 1))
    bad = [*leaves[:i], wrong_shape(leaves[i]), *leaves[i + 1 :]]
    with pytest.raises(fshard.LayoutError, match="a pytree transform must keep every shard's shape"):
        optree.tree_unflatten(o_spec, bad)
    with pytest.raises(fshard.LayoutError, match="a pytree transform must keep every shard's shape"):
        torch_pytree.tree_unflatten(bad, t_spec)
