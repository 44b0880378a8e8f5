"""Trees of arrays move as one: reshard, gather and shard_map's arguments, on the local backend.

Each tree movement gives exactly the values of moving its leaves one by one, and sends
exactly the sum of their minimum elements.
"""

from __future__ import annotations

import pytest
import torch

import fshard
from fshard._plan.buckets import box_layout
from fshard._plan.fuse import flat_layouts, flat_range
from fshard.backends.local import LOCAL

R = [0, 1, 2, 3]


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "w": fshard.shard(torch.randn(6, 5, generator=g), fshard.Chunk(0, R)),
        "b": fshard.shard(torch.randn(5, generator=g), fshard.Chunk(0, R)),
        "h": fshard.shard(torch.randn(3, 4, generator=g, dtype=torch.float64), fshard.Chunk(0, [1, 2])),
        "i": fshard.shard(torch.arange(7), fshard.Replicated([0, 3])),
        "e": fshard.shard(torch.empty(0, 3), fshard.Chunk(0, R)),  # an empty leaf
        "c": fshard.shard(torch.randn(4, 6, generator=g), fshard.Chunk(1, R)),  # boxes that are no ranges
        "s": fshard.shard(torch.tensor(2.5), fshard.Replicated(R)),  # a 0-d leaf
    }


@pytest.mark.parametrize(
    "spec", [fshard.Replicated(R), fshard.Chunk(0, [3, 2, 1, 0]), fshard.Single(2), fshard.Chunk(0, [0, 1])]
)
def test_a_tree_moves_to_the_values_of_its_leaves_moved_one_by_one(spec):
    tree = _tree()
    tree.pop("s") if isinstance(spec, fshard.Chunk) else None
    before = LOCAL.counters.elements_sent
    moved = fshard.reshard(tree, spec)
    sent = LOCAL.counters.elements_sent - before
    expected = 0
    for name, a in tree.items():
        one = fshard.reshard(a, spec)
        assert moved[name].layout == one.layout
        assert all(torch.equal(x, y) for x, y in zip(moved[name].addressable_data, one.addressable_data))
        assert moved[name].dtype == a.dtype
        expected += fshard.plan(a.layout, one.layout).min_elements_sent
    assert sent == expected


@pytest.mark.parametrize("spec", [fshard.Replicated(R), fshard.Chunk(1, R), fshard.Chunk(0, [3, 2, 1, 0])])
def test_many_arrays_of_one_layout_move_as_one_stack_to_the_values_of_each(spec):
    g = torch.Generator().manual_seed(2)
    fulls = [torch.randn(8, 4, generator=g) for _ in range(12)]
    tree = [fshard.shard(t, fshard.Chunk(0, R)) for t in fulls]
    moved, sent = _sent(lambda: fshard.reshard(tree, spec))
    expected = 0
    for a, b in zip(moved, tree, strict=True):
        one, n = _sent(lambda b=b: fshard.reshard(b, spec))
        assert a.layout == one.layout
        assert all(torch.equal(x, y) and x.is_contiguous() for x, y in zip(a.addressable_data, one.addressable_data))
        expected += n
    assert sent == expected


def _sent(fn):
    before = LOCAL.counters.elements_sent
    out = fn()
    return out, LOCAL.counters.elements_sent - before


def test_a_tree_of_specs_matches_the_tree_of_arrays():
    tree = _tree()
    specs = {name: fshard.Replicated(R) for name in tree} | {"w": fshard.Chunk(1, R), "h": fshard.Single(0)}
    moved = fshard.reshard(tree, specs)
    assert moved["w"].layout == fshard.Chunk(1, R).layout((6, 5))
    assert torch.equal(fshard.gather(moved["h"]), fshard.gather(tree["h"]))


def test_a_spec_that_does_not_fit_its_array_names_the_array_in_the_tree():
    tree = _tree()
    with pytest.raises(fshard.SpecError, match="Invalid sharding dim: 2 for a 2-D array") as info:
        fshard.reshard(tree, {name: fshard.Replicated(R) for name in tree} | {"w": fshard.Chunk(2, R)})
    assert info.value.__notes__ == ["(the array at ('w',) of reshard()'s tree, shape (6, 5))"]
    with pytest.raises(fshard.SpecError, match="Invalid sharding dim: 1 for a 1-D array") as info:
        fshard.reshard(tree, fshard.Chunk(1, R))  # one spec for all: the first array it does not fit, in key order
    assert info.value.__notes__ == ["(the array at ('b',) of reshard()'s tree, shape (5,))"]
    with pytest.raises(fshard.SpecError, match="got None") as info:
        fshard.reshard(tree, {name: fshard.Replicated(R) for name in tree} | {"h": None})
    assert info.value.__notes__ == ["(the array at ('h',) of reshard()'s tree, shape (3, 4))"]


def test_pending_sums_in_a_tree_are_reduced_as_one():
    parts = [fshard.shard(torch.ones(4, 2) * k, fshard.Chunk(1, [0, 1])).sum(1) for k in range(3)]
    assert all(p.layout.partial == "sum" for p in parts)
    reduced = fshard.reshard(parts, fshard.Chunk(0, [0, 1]))
    assert [fshard.gather(p).tolist() for p in reduced] == [[0.0] * 4, [2.0] * 4, [4.0] * 4]


def test_gather_of_a_tree_gives_every_leaf():
    tree = _tree()
    got = fshard.gather(tree)
    for name, a in tree.items():
        assert torch.equal(got[name], fshard.gather(a))
    on_one = fshard.gather(tree, dst=1)
    assert torch.equal(on_one["w"], got["w"])


def test_gradients_flow_through_a_tree_movement():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, dtype=torch.float64, requires_grad=True)
    tree = {"x": fshard.shard(x, fshard.Chunk(0, R)), "y": fshard.shard(y, fshard.Chunk(0, R))}
    moved = fshard.reshard(tree, fshard.Replicated(R))
    loss = (fshard.gather(moved["x"]) ** 2).sum() + fshard.gather(moved["y"]).sin().sum()
    loss.backward()
    assert torch.allclose(x.grad, 2 * x.detach())
    assert torch.allclose(y.grad, y.detach().cos())


def test_trees_refuse_leaves_that_are_not_arrays():
    with pytest.raises(TypeError, match=r"the leaf at \('t',\) is a Tensor"):
        fshard.reshard({"t": torch.ones(2)}, fshard.Replicated(R))
    with pytest.raises(fshard.SpecError, match="pytree of specs matching"):
        fshard.reshard({"a": _tree()["w"]}, {"b": fshard.Replicated(R)})


def test_none_in_a_tree_is_kept_as_shard_keeps_it():
    # None is an empty subtree (optree, torch's pytree, JAX): shard, reshard and gather keep it in place.
    sharded = fshard.shard({"w": torch.arange(8.0), "bias": None, "pair": (torch.ones(4), None)}, fshard.Chunk(0, R))
    assert (sharded["bias"], sharded["pair"][1]) == (None, None)
    moved = fshard.reshard(sharded, fshard.Replicated(R))
    assert (moved["bias"], moved["pair"][1]) == (None, None)
    assert moved["w"].layout == fshard.Replicated(R).layout((8,))
    by_specs = fshard.reshard(sharded, {"w": fshard.Single(1), "bias": None, "pair": (fshard.Single(2), None)})
    assert by_specs["pair"][0].layout == fshard.Single(2).layout((4,))
    assert by_specs["bias"] is None
    got = fshard.gather(moved)
    assert torch.equal(got["w"], torch.arange(8.0))
    assert (got["bias"], got["pair"][1]) == (None, None)
    assert fshard.gather({"only": None}) == {"only": None}
    for fn in (fshard.gather, lambda t: fshard.reshard(t, fshard.Replicated(R))):  # None alone is no tree of arrays
        with pytest.raises(TypeError, match="takes a ShardedArray, got NoneType"):
            fn(None)


def test_flat_ranges_are_the_boxes_in_row_major_order():
    assert flat_range(fshard.Chunk(0, [0, 1, 2]).layout((5, 3))).tolist() == [[0, 6], [6, 6], [12, 3]]
    assert flat_range(fshard.Chunk(1, [0, 1]).layout((1, 6))).tolist() == [[0, 3], [3, 3]]  # one row: ranges
    assert flat_range(fshard.Chunk(1, [0, 1]).layout((2, 6))) is None
    x = fshard.Explicit([((0, 0), (1, 3), 0), ((1, 0), (1, 1), 1), ((1, 1), (1, 2), 0)]).layout((2, 3))
    assert flat_range(x).tolist() == [[0, 3], [3, 1], [4, 2]]


def test_the_flat_array_of_a_tree_is_block_diagonal():
    a, b = fshard.Chunk(0, [0, 1]).layout((4, 3)), fshard.Chunk(0, [0, 1]).layout((5,))
    a2, b2 = fshard.Replicated([0, 1]).layout((4, 3)), fshard.Replicated([0, 1]).layout((5,))
    flat = flat_layouts((a, b), (a2, b2))
    assert [(m.offsets, m.sizes, m.placement.rank) for m in flat.src.shards] == [
        ((0,), (6,), 0), ((6,), (6,), 1), ((12,), (3,), 0), ((15,), (2,), 1)]  # fmt: skip
    p = fshard.plan(flat.src, flat.dst)
    assert p.elements_sent == p.min_elements_sent
    assert p.elements_sent == fshard.plan(a, a2).min_elements_sent + fshard.plan(b, b2).min_elements_sent


def test_every_distinct_box_has_its_own_range_for_reductions():
    mesh = fshard.Named(fshard.Mesh((2, 2)), ("x", None)).layout((4, 3))
    lay = box_layout((mesh, fshard.Chunk(1, [0, 1]).layout((2, 4))))
    assert [(m.offsets[0], m.sizes[0], m.placement.rank) for m in lay.shards] == [
        (0, 6, 0), (0, 6, 1), (6, 6, 2), (6, 6, 3), (12, 4, 0), (16, 4, 1)]  # fmt: skip


def test_the_gradient_of_a_gathered_tree_reaches_every_shard():
    x = torch.randn(8, 3, dtype=torch.float64)
    tree = {"x": fshard.shard(x, fshard.Chunk(0, R))}
    for t in tree["x"].addressable_data:
        t.requires_grad_()
    (fshard.gather(tree)["x"] ** 2).sum().backward()
    assert torch.equal(torch.cat([t.grad for t in tree["x"].addressable_data]), 2 * x)
