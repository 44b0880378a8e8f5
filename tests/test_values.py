"""Value types: ``Placement``, ``ShardMeta``, ``Layout`` and ``ShardedArray`` (DESIGN.md section 2).

Every value is frozen, hashable or immutable, picklable, comparable by value and has a
readable ``repr``; ``Layout`` validates its boxes at construction and names the
offending shards when it refuses them.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fshard
from fshard import (
    Chunk,
    Explicit,
    Layout,
    LayoutError,
    Mesh,
    Named,
    Placement,
    Replicated,
    ShardMeta,
    Single,
    SpecError,
)

RANKS = ("rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:2", "rank:3/cuda:3")


def _boxes(layout: Layout) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """(offsets, sizes, placement string) of every shard, in layout order."""
    return [(s.offsets, s.sizes, str(s.placement)) for s in layout.shards]


def _x(*shape: int) -> torch.Tensor:
    """A float tensor whose values are their own flat indices."""
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


# -- Placement ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rank", "device"),
    [
        ("rank:0/cuda:0", 0, "cuda:0"),
        ("rank:1/cuda:1", 1, "cuda:1"),
        ("rank:3/cuda:3", 3, "cuda:3"),
        ("rank:1/cpu", 1, "cpu"),
        ("rank:12/cpu", 12, "cpu"),
        ("rank:2/cuda", 2, "cuda"),
    ],
)
def test_placement_parse_and_str_round_trip(text, rank, device):
    p = Placement.parse(text)
    assert (p.rank, p.device) == (rank, device)
    assert p == Placement(rank, device)
    assert str(p) == text
    assert Placement.parse(str(p)) == p


def test_placement_without_device_is_on_cpu():
    assert Placement.parse("rank:2") == Placement(2, "cpu")
    assert str(Placement.parse("rank:2")) == "rank:2/cpu"
    assert Placement(5) == Placement(5, "cpu")
    assert str(Placement(5)) == "rank:5/cpu"


def test_placement_device_is_normalised_by_torch():
    assert Placement(0, "cuda:0").device == "cuda:0"
    assert Placement.parse("rank:0/cpu").device == "cpu"


@pytest.mark.parametrize("text", ["worker0/cuda:1", "workerfoo/cuda:1", "trainer3/cpu"])
def test_placement_rejects_rpc_worker_names(text):
    msg = (
        f"Invalid placement {text!r}: expected 'rank:<int>/<device>'. RPC worker names are not supported: "
        "fshard has no RPC; remote shards are reached with gather() or reshard()."
    )
    with pytest.raises(SpecError, match=re.escape(msg)):
        Placement.parse(text)


def test_specs_read_placements_from_placements_strings_and_ints():
    spec = Chunk(0, [Placement(0, "cuda:0"), "rank:1/cuda:1", 2])
    assert spec.placements == (Placement(0, "cuda:0"), Placement(1, "cuda:1"), Placement(2, "cpu"))


def test_placement_is_a_frozen_hashable_ordered_value():
    p = Placement(1, "cuda:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.rank = 2  # type: ignore[misc]
    assert hash(p) == hash(Placement.parse("rank:1/cuda:1"))
    assert len({p, Placement(1, "cuda:1"), Placement(1, "cpu")}) == 2
    assert sorted([Placement(2), Placement(0, "cuda:0"), Placement(0)]) == [
        Placement(0, "cpu"),
        Placement(0, "cuda:0"),
        Placement(2, "cpu"),
    ]
    assert repr(p) == "Placement(rank=1, device='cuda:1')"
    assert pickle.loads(pickle.dumps(p)) == p


# -- ShardMeta ---------------------------------------------------------------------------


def test_shard_meta_converts_fields_to_tuples_and_placements():
    m = ShardMeta([0, 5], [5, 5], "rank:1/cuda:1")
    assert m.offsets == (0, 5)
    assert m.sizes == (5, 5)
    assert m.placement == Placement(1, "cuda:1")
    assert m.numel == 25
    assert ShardMeta((), (), 0).numel == 1
    assert ShardMeta((3,), (0,), 0).numel == 0


def test_shard_meta_is_a_frozen_hashable_value():
    m = ShardMeta((0, 5), (5, 5), "rank:1/cuda:1")
    assert m == ShardMeta([0, 5], (5, 5), Placement(1, "cuda:1"))
    assert hash(m) == hash(ShardMeta([0, 5], (5, 5), Placement(1, "cuda:1")))
    assert m != ShardMeta((0, 5), (5, 5), "rank:1/cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.sizes = (1, 1)  # type: ignore[misc]
    assert repr(m) == "ShardMeta(offsets=(0, 5), sizes=(5, 5), placement=Placement(rank=1, device='cuda:1'))"
    assert pickle.loads(pickle.dumps(m)) == m


# -- Layout: queries ----------------------------------------------------------------------


def test_layout_queries_on_chunked_rows():
    lay = Chunk(0, RANKS).layout((10, 20))
    assert lay.shape == (10, 20)
    assert lay.ndim == 2
    assert lay.numel == 200
    assert lay.ranks == (0, 1, 2, 3)
    assert lay.shards_on(3) == (ShardMeta((9, 0), (1, 20), "rank:3/cuda:3"),)
    assert lay.shards_on(7) == ()
    assert not lay.is_fully_replicated


def test_layout_ranks_are_sorted_and_distinct():
    lay = Chunk(0, [3, 1, 3, 0]).layout((8,))
    assert lay.ranks == (0, 1, 3)
    assert [s.offsets for s in lay.shards_on(3)] == [(0,), (4,)]
    assert lay.indices_on(3) == (0, 2)


def test_layout_of_a_scalar_has_one_element():
    lay = Single(0).layout(())
    assert (lay.ndim, lay.numel, lay.ranks) == (0, 1, (0,))
    assert lay.is_fully_replicated


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Replicated([0, 1, 2]).layout((3, 4)), True),
        (Single(2).layout((3, 4)), True),
        (Named(Mesh((2, 2)), (None, None)).layout((3, 4)), True),
        (Chunk(0, [0, 1]).layout((3, 4)), False),
        (Named(Mesh((2, 2)), ("x", None)).layout((4, 4)), False),
        (Layout((4,), [ShardMeta((0,), (4,), 0), ShardMeta((9,), (0,), 1)]), False),
    ],
    ids=["replicated", "single", "mesh-unused", "chunk", "mesh-rows", "with-empty-shard"],
)
def test_layout_is_fully_replicated(layout, expected):
    assert layout.is_fully_replicated is expected


# -- Layout: value semantics -----------------------------------------------------------------


def test_layouts_compare_and_hash_by_value():
    a = Chunk(0, RANKS).layout((10, 20))
    b = Explicit([((3 * r, 0), (1 if r == 3 else 3, 20), RANKS[r]) for r in range(4)]).layout([10, 20])
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != Chunk(0, [0, 1, 2, 3]).layout((10, 20))  # same boxes, other devices
    assert a != Chunk(0, RANKS).layout((11, 20))
    assert a != Chunk(0, RANKS[::-1]).layout((10, 20))
    assert a != "not a layout"


def test_layout_is_immutable():
    lay = Chunk(0, [0, 1]).layout((4,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.shape = (5,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del lay.shards
    assert isinstance(lay.shards, tuple)
    assert Layout((4,), [ShardMeta((0,), (4,), 0)]).shards == (ShardMeta((0,), (4,), 0),)


def test_layout_accepts_shards_as_plain_tuples():
    lay = Layout([4], [((0,), (2,), 0), ([2], [2], "rank:1/cpu")])
    assert lay == Chunk(0, [0, 1]).layout((4,))


def test_layout_repr():
    lay = Chunk(0, [0, "rank:1/cuda:1"]).layout((4,))
    assert repr(lay) == "Layout(shape=(4,), shards=[((0,), (2,), 0), ((2,), (2,), 'rank:1/cuda:1')])"
    assert repr(Chunk(0, range(65)).layout((65,))) == "Layout(shape=(65,), 65 shards on ranks 0-64)"
    assert repr(Chunk(0, [0, 2] * 33).layout((66,))) == "Layout(shape=(66,), 66 shards on ranks 0,2)"


@pytest.mark.parametrize(
    "layout",
    [
        Chunk(0, RANKS).layout((10, 20)),
        Chunk(0, [0, 1, 2, 3]).layout((2, 20)),
        Named(Mesh((2, 2)), ("x", None)).layout((5, 3)),
        Explicit([((0, 0), (2, 4), 0), ((0, 4), (4, 2), 1), ((2, 0), (4, 4), 2), ((4, 4), (2, 2), 3)]).layout((6, 6)),
        Single(0).layout(()),
    ],
    ids=["chunk", "empty-shards", "replicas", "uneven-boxes", "scalar"],
)
def test_layout_round_trips(layout):
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout
    assert hash(again) == hash(layout)
    text = json.dumps(layout.to_dict())
    assert Layout.from_dict(json.loads(text)) == layout
    assert Layout.from_torch_metadata(layout.to_torch_metadata()) == layout


def test_layout_to_dict_is_plain_json_data():
    lay = Chunk(1, ["rank:0/cuda:0", "rank:1/cpu"]).layout((2, 3))
    assert lay.to_dict() == {
        "shape": [2, 3],
        "shards": [
            {"offsets": [0, 0], "sizes": [2, 2], "placement": "rank:0/cuda:0"},
            {"offsets": [0, 2], "sizes": [2, 1], "placement": "rank:1/cpu"},
        ],
    }


def test_layout_to_torch_metadata_matches_the_seed_metadata():
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    lay = Explicit(
        [((0, 0), (5, 5), RANKS[0]), ((0, 5), (5, 5), RANKS[1]), ((5, 0), (5, 5), RANKS[2]), ((5, 5), (5, 5), RANKS[3])]
    ).layout((10, 10))
    meta = lay.to_torch_metadata(dtype=torch.double, requires_grad=True)
    assert meta.size == torch.Size([10, 10])
    assert meta.shards_metadata == [
        ShardMetadata([0, 0], [5, 5], "rank:0/cuda:0"),
        ShardMetadata([0, 5], [5, 5], "rank:1/cuda:1"),
        ShardMetadata([5, 0], [5, 5], "rank:2/cuda:2"),
        ShardMetadata([5, 5], [5, 5], "rank:3/cuda:3"),
    ]
    assert meta.tensor_properties == TensorProperties(dtype=torch.double, requires_grad=True)
    assert lay.to_torch_metadata().tensor_properties.dtype == torch.float32


def test_layout_from_torch_chunk_sharding_spec_metadata():
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    # torch converts the placement list in place: give it a fresh one.
    meta = ChunkShardingSpec(0, list(RANKS)).build_metadata(torch.Size([9, 12]), TensorProperties())
    assert Layout.from_torch_metadata(meta) == Chunk(0, RANKS).layout((9, 12))


# -- Layout: validation -----------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 3, 4, 5, 100])
def test_empty_box_may_sit_at_any_non_negative_offset(offset):
    lay = Layout((4,), [ShardMeta((0,), (4,), 0), ShardMeta((offset,), (0,), 1)])
    assert lay.ranks == (0, 1)
    assert lay.shards_on(1)[0].offsets == (offset,)


def test_empty_box_may_sit_past_the_end_in_two_dims():
    lay = Layout((2, 3), [ShardMeta((0, 0), (2, 3), 0), ShardMeta((7, 9), (0, 3), 1), ShardMeta((0, 50), (2, 0), 2)])
    assert lay.numel == 6


def test_equal_empty_boxes_are_allowed():
    lay = Chunk(0, [0, 0]).layout((0, 3))
    assert _boxes(lay) == [((0, 0), (0, 3), "rank:0/cpu"), ((0, 0), (0, 3), "rank:0/cpu")]


def test_identical_boxes_on_other_placements_are_replicas():
    lay = Layout((4,), [ShardMeta((0,), (4,), 0), ShardMeta((0,), (4,), 1), ShardMeta((0,), (4,), "rank:0/cuda:0")])
    assert lay.ranks == (0, 1)
    assert lay.is_fully_replicated


def test_empty_shape_needs_no_shards():
    lay = Layout((0, 4), ())
    assert (lay.numel, lay.ranks, lay.shards) == (0, (), ())


def test_layout_overlap_names_both_shards():
    msg = (
        "Shards 0 [offsets (0,), sizes (3,)] on rank:0/cpu and 1 [offsets (2,), sizes (2,)] on rank:1/cpu "
        "overlap at element (2,) without being identical: boxes must be disjoint, or identical to be replicas."
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((4,), [ShardMeta((0,), (3,), 0), ShardMeta((2,), (2,), 1)])


def test_layout_overlap_in_two_dims():
    shards = [
        ShardMeta((0, 0), (6, 6), 0),
        ShardMeta((0, 5), (5, 5), 1),
        ShardMeta((5, 0), (5, 5), 2),
        ShardMeta((5, 5), (5, 5), 3),
    ]
    msg = (
        "Shards 0 [offsets (0, 0), sizes (6, 6)] on rank:0/cpu and 1 [offsets (0, 5), sizes (5, 5)] on rank:1/cpu "
        "overlap at element (0, 5) without being identical"
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((10, 10), shards)


def test_layout_gap_names_the_uncovered_element():
    msg = (
        "Shards do not cover element (2,) of shape (4,) (the distinct boxes hold 3 of 4 elements): "
        "add a shard that covers it."
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((4,), [ShardMeta((0,), (2,), 0), ShardMeta((3,), (1,), 1)])


def test_layout_without_shards_does_not_cover_a_scalar():
    msg = "Shards do not cover element () of shape () (the distinct boxes hold 0 of 1 elements)"
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((), ())


def test_layout_out_of_bounds_names_the_shard_and_dim():
    msg = (
        "Shard 1 [offsets (0, 2), sizes (4, 5)] on rank:1/cpu extends past shape (4, 6) in dim 1 (2 + 5 > 6): "
        "shrink the shard or grow the shape."
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((4, 6), [ShardMeta((0, 0), (4, 2), 0), ShardMeta((0, 2), (4, 5), 1)])


def test_layout_wrong_ndim_names_the_shard():
    msg = (
        "Shard 1 [offsets (2,), sizes (2,)] on rank:1/cpu has 1 dims but shape (4, 1) has 2: "
        "give every shard one offset and one size per dimension."
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((4, 1), [ShardMeta((0, 0), (2, 1), 0), ShardMeta((2,), (2,), 1)])


def test_layout_duplicate_shard_names_both_indices():
    msg = (
        "Shards 0 and 2 are the same box [offsets (0,), sizes (2,)] on rank:0/cpu: a replica must sit on "
        "another placement; drop the duplicate."
    )
    with pytest.raises(LayoutError, match=re.escape(msg)):
        Layout((4,), [ShardMeta((0,), (2,), 0), ShardMeta((2,), (2,), 1), ShardMeta((0,), (2,), 0)])


# -- Layout: pictures ---------------------------------------------------------------------


def test_visualize_rows_of_a_2d_layout():
    assert Chunk(0, [0, 1]).layout((4, 6)).visualize(width=12) == "\n".join(
        [
            "+-----------+",
            "|    r0     |",
            "+-----------+",
            "|    r1     |",
            "+-----------+",
        ]
    )


def test_visualize_a_2d_grid():
    assert Named(Mesh((2, 2)), ("x", "y")).layout((4, 6)).visualize(width=24) == "\n".join(
        [
            "+----------+----------+",
            "|    r0    |    r1    |",
            "|          |          |",
            "+----------+----------+",
            "|    r2    |    r3    |",
            "|          |          |",
            "+----------+----------+",
        ]
    )


def test_visualize_uneven_boxes_with_devices():
    lay = Explicit(
        [((0, 0), (2, 4), RANKS[0]), ((0, 4), (4, 2), RANKS[1]), ((2, 0), (4, 4), RANKS[2]), ((4, 4), (2, 2), RANKS[3])]
    ).layout((6, 6))
    assert lay.visualize(width=24) == "\n".join(
        [
            "+------------+----------+",
            "| r0:cuda:0  |          |",
            "+------------+r1:cuda:1 |",
            "|            |          |",
            "| r2:cuda:2  +----------+",
            "|            |r3:cuda:3 |",
            "+------------+----------+",
        ]
    )


def test_visualize_replicas_share_a_box():
    assert Named(Mesh((2, 2)), ("x", None)).layout((4, 4)).visualize(width=16) == "\n".join(
        [
            "+---------+",
            "|  r0 r1  |",
            "+---------+",
            "|  r2 r3  |",
            "+---------+",
        ]
    )


def test_visualize_1d_lists_empty_shards():
    assert Chunk(0, [0, 1, 2, 3]).layout((9,)).visualize(width=20) == "\n".join(
        [
            "+-----+-----+-----+",
            "| r0  | r1  | r2  |",
            "+-----+-----+-----+",
            "(empty shards: r3)",
        ]
    )


def test_visualize_summarises_what_it_cannot_draw():
    assert Chunk(0, range(30)).layout((30,)).visualize().splitlines() == [
        "<1-D layout of shape (30,), 30 shards: too fine to draw>",
        "  dim 0: blocks of 1, 1, 1, 1, 1, 1, 1, 1, ... (30 blocks)",
        "  each of ranks 0-29 holds 1 shard, 1 element",
    ]


# -- ShardedArray -----------------------------------------------------------------------------


@pytest.fixture
def rows() -> fshard.ShardedArray:
    """A 10 x 20 array chunked over rows on 4 ranks (shard sizes 3, 3, 3, 1)."""
    return fshard.shard(_x(10, 20), Chunk(0, [0, 1, 2, 3]))


def test_sharded_array_is_immutable(rows):
    with pytest.raises(AttributeError, match=re.escape("ShardedArray is immutable: cannot set '_layout'")):
        rows._layout = Chunk(0, [0]).layout((10, 20))  # type: ignore[misc]
    with pytest.raises(AttributeError, match=re.escape("ShardedArray is immutable: cannot set 'shape'")):
        rows.shape = torch.Size([1])  # type: ignore[misc]
    with pytest.raises(AttributeError, match=re.escape("ShardedArray is immutable: cannot set 'note'")):
        rows.note = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=re.escape("ShardedArray is immutable: cannot delete '_data'")):
        del rows._data
    assert rows.layout == Chunk(0, [0, 1, 2, 3]).layout((10, 20))


def test_sharded_array_sizes(rows):
    assert rows.size() == torch.Size([10, 20])
    assert rows.shape == torch.Size([10, 20])
    assert (rows.size(0), rows.size(1), rows.size(-1), rows.size(-2)) == (10, 20, 20, 10)
    assert rows.dim() == 2
    assert rows.ndim == 2
    assert rows.numel() == 200


@pytest.mark.parametrize("dim", [2, 3, -3, -5])
def test_sharded_array_size_out_of_range(rows, dim):
    msg = f"Dimension out of range (expected to be in range of [-2, 1], but got {dim})"
    with pytest.raises(IndexError, match=re.escape(msg)):
        rows.size(dim)


def test_sharded_array_properties(rows):
    assert rows.dtype == torch.float32
    assert rows.device == torch.device("cpu")
    assert rows.requires_grad is False
    assert rows.backend.name == "local"
    assert repr(rows) == (
        "ShardedArray(shape=(10, 20), dtype=torch.float32, backend=local, layout=Layout(shape=(10, 20), "
        "shards=[((0, 0), (3, 20), 0), ((3, 0), (3, 20), 1), ((6, 0), (3, 20), 2), ((9, 0), (1, 20), 3)]))"
    )
    ints = fshard.zeros(Chunk(0, [0, 1]), 4, dtype=torch.int16, requires_grad=False)
    assert ints.dtype == torch.int16
    grads = fshard.zeros(Chunk(0, [0, 1]), 4, requires_grad=True)
    assert grads.requires_grad is True


def test_addressable_shards_are_every_shard_in_layout_order(rows):
    x = _x(10, 20)
    shards = rows.addressable_shards
    assert isinstance(shards, tuple)
    assert [s.meta for s in shards] == list(rows.layout.shards)
    for s, start in zip(shards, [0, 3, 6, 9]):
        assert isinstance(s, fshard.Shard)
        assert torch.equal(s.data, x[start : start + s.meta.sizes[0]])
    assert rows.addressable_data == tuple(s.data for s in shards)


def test_shard_is_frozen(rows):
    s = rows.addressable_shards[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.data = torch.zeros(3, 20)  # type: ignore[misc]


def test_local_tensor_of_a_single_shard():
    x = _x(24, 12)
    a = fshard.shard(x, Chunk(0, ["rank:0/cpu"]))
    assert a.local_tensor() is a.addressable_shards[0].data
    assert torch.equal(a.local_tensor(), x)


def test_local_tensor_of_several_shards_raises(rows):
    msg = "Only single local shard is supported. This process holds 4; use addressable_shards."
    with pytest.raises(NotImplementedError, match=re.escape(msg)):
        rows.local_tensor()


def test_sharded_array_pickles(rows):
    again = pickle.loads(pickle.dumps(rows))
    assert again.layout == rows.layout
    assert torch.equal(fshard.gather(again), _x(10, 20))


def test_optree_flatten_unflatten_round_trip(rows):
    leaves, treespec = optree.tree_flatten(rows)
    assert len(leaves) == 4
    assert all(a is b for a, b in zip(leaves, rows.addressable_data))
    doubled = optree.tree_unflatten(treespec, [2 * t for t in leaves])
    assert isinstance(doubled, fshard.ShardedArray)
    assert doubled.layout == rows.layout
    assert torch.equal(fshard.gather(doubled), 2 * _x(10, 20))


def test_torch_pytree_flatten_unflatten_round_trip(rows):
    leaves, treespec = torch_pytree.tree_flatten(rows)
    assert len(leaves) == 4
    plus = torch_pytree.tree_unflatten([t + 1 for t in leaves], treespec)
    assert isinstance(plus, fshard.ShardedArray)
    assert plus.layout == rows.layout
    assert torch.equal(fshard.gather(plus), _x(10, 20) + 1)


@pytest.mark.parametrize("tree_map", [optree.tree_map, torch_pytree.tree_map], ids=["optree", "torch-pytree"])
def test_tree_map_over_a_dict_of_arrays(rows, tree_map):
    cols = fshard.shard(_x(4, 6), Named(Mesh((2, 2)), ("x", "y")))
    tree = {"rows": rows, "nested": [cols, torch.ones(2)]}
    out = tree_map(lambda t: -t, tree)
    assert out["rows"].layout == rows.layout
    assert out["nested"][0].layout == cols.layout
    assert torch.equal(fshard.gather(out["rows"]), -_x(10, 20))
    assert torch.equal(fshard.gather(out["nested"][0]), -_x(4, 6))
    assert torch.equal(out["nested"][1], -torch.ones(2))
    assert torch.equal(fshard.gather(rows), _x(10, 20))  # the input is unchanged


def test_unflatten_with_wrong_shapes_raises(rows):
    msg = (
        "Shard 0 tensor has shape (1, 20) but the layout gives it sizes (3, 20): "
        "a pytree transform must keep every shard's shape, or (torch.func.vmap) add one leading batch dim "
        "to all of them."
    )
    leaves, treespec = optree.tree_flatten(rows)
    with pytest.raises(LayoutError, match=re.escape(msg)):
        optree.tree_unflatten(treespec, [t[:1] for t in leaves])
    leaves, treespec = torch_pytree.tree_flatten(rows)
    with pytest.raises(LayoutError, match=re.escape(msg)):
        torch_pytree.tree_unflatten([t[:1] for t in leaves], treespec)


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("add", lambda a: torch.add(a, torch.ones(10, 20))),
        ("sum", torch.sum),
        ("cat", lambda a: torch.cat([a, a])),
    ],
    ids=["add", "sum", "cat"],
)
def test_torch_functions_point_at_map_local(rows, name, call):
    msg = (
        f"torch.{name} is not supported for ShardedArray: "
        "apply it to the shards with fshard.map_local, or gather() first."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        call(rows)


def test_an_array_without_shards_here_keeps_a_0_element_link() -> None:
    class NoShardsHere:
        """A backend stand-in for a process that holds no shard of any layout."""

        name = "none-here"

        def addressable(self, layout: Layout) -> tuple[int, ...]:
            return ()

    backend = NoShardsHere()
    layout = Chunk(0, [0, 1]).layout((4,))
    x = fshard.ShardedArray(layout, (), backend, torch.float64)
    assert x.dtype == torch.float64
    assert not x.requires_grad
    (leaf,) = optree.tree_leaves(x)
    assert leaf.shape == (0,)
    linked = fshard.ShardedArray(layout, (), backend, torch.float64, torch.zeros(0, requires_grad=True))
    assert linked.requires_grad
    rebuilt = optree.tree_map(lambda t: t * 2, linked)
    assert rebuilt.requires_grad
    assert rebuilt.addressable_data == ()
    with pytest.raises(LayoutError, match=re.escape("has a 0-element link, got one of shape (3,)")):
        optree.tree_map(lambda t: torch.ones(3), x)


@pytest.mark.parametrize("tree_map", [optree.tree_map, torch_pytree.tree_map], ids=["optree", "torch-pytree"])
def test_a_map_that_casts_casts_an_array_without_shards_here(tree_map) -> None:
    class NoShardsHere:
        """A backend stand-in for a process that holds no shard of any layout."""

        name = "none-here"

        def addressable(self, layout: Layout) -> tuple[int, ...]:
            return ()

    x = fshard.ShardedArray(Chunk(0, [0, 1]).layout((4,)), (), NoShardsHere(), torch.float32)
    cast = tree_map(lambda t: t.to(torch.float16), x)
    assert cast.dtype == torch.float16  # as on the ranks that hold shards: one dtype on every rank
    assert optree.tree_leaves(cast)[0].dtype == torch.float16


def test_a_tree_map_to_other_leaves_is_a_container_that_fshard_functions_refuse(rows) -> None:
    a, spec = rows, Chunk(0, [0, 1, 2, 3])
    sizes = optree.tree_map(lambda t: t.shape, a)  # a container of torch.Size leaves (torch.func's in_dims)
    assert optree.tree_leaves(sizes, none_is_leaf=True) == [t.shape for t in a.addressable_data]
    assert "leaves=[torch.Size([" in repr(sizes)
    assert "leaves=[1, 1, 1, 1]" in repr(optree.tree_map(lambda t: 1, a))
    calls = {
        "gather": lambda: fshard.gather(sizes),
        "gather of a tree": lambda: fshard.gather([sizes]),
        "reshard": lambda: fshard.reshard(sizes, Replicated([0, 1])),
        "map_local": lambda: fshard.map_local(lambda t: t, sizes),
        "shard_map": lambda: fshard.shard_map(lambda t: t, in_specs=(spec,), out_specs=spec)(sizes),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="holds Size where its shard tensors should be: a pytree map") as info:
            call()
        assert "fshard.map_local" in str(info.value), name


def test_torch_pytree_key_paths_name_each_shard_as_optree_does(rows) -> None:
    paths = [torch_pytree.keystr(p) for p, _ in torch_pytree.tree_flatten_with_path({"w": rows})[0]]
    assert paths == ["['w'][0]", "['w'][1]", "['w'][2]", "['w'][3]"]
    assert optree.tree_paths({"w": rows}) == [("w", k) for k in range(4)]
    doubled = torch_pytree.tree_map_with_path(lambda path, t: t * 2, {"w": rows})
    assert torch.equal(fshard.gather(doubled["w"]), fshard.gather(rows) * 2)
