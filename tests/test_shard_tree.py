"""``shard`` of a pytree of tensors, on the local backend.

Each leaf of the result is exactly what ``shard`` of that leaf alone gives, for ``src=None``
and ``src=k``; with ``src=k`` the elements sent are the sum of the leaves' minimums.
"""

from __future__ import annotations

import re

import pytest
import torch

import fshard
from fshard.backends.local import LOCAL

R = [0, 1, 2, 3]


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(5, generator=g),
        "h": torch.randn(3, 4, generator=g, dtype=torch.float64),  # another dtype
        "e": torch.empty(0, 3),  # an empty leaf
        "s": torch.tensor(2.5),  # a 0-d leaf
        "none": None,  # kept as None
        "more": [torch.arange(7), torch.randn(4, 6, generator=g)],
    }


def _specs():
    return {
        "w": fshard.Chunk(0, R),
        "b": fshard.Chunk(0, R),
        "h": fshard.Chunk(0, [1, 2]),  # other ranks
        "e": fshard.Chunk(0, R),
        "s": fshard.Replicated(R),
        "none": None,
        "more": [fshard.Replicated([0, 3]), fshard.Chunk(1, R)],  # boxes that are no ranges
    }


def _sent(fn):
    before = LOCAL.counters.elements_sent
    out = fn()
    return out, LOCAL.counters.elements_sent - before


def _same(a: fshard.ShardedArray, b: fshard.ShardedArray) -> bool:
    return (
        a.layout == b.layout
        and a.dtype == b.dtype
        and all(torch.equal(x, y) for x, y in zip(a.addressable_data, b.addressable_data, strict=True))
    )


@pytest.mark.parametrize("src", [None, 0, 2])
def test_each_leaf_is_the_shard_of_that_leaf_alone(src):
    tree, specs = _tree(), _specs()
    out, sent = _sent(lambda: fshard.shard(tree, specs, src=src))
    expected = 0
    for key in ("w", "b", "h", "e", "s"):
        one, n = _sent(lambda key=key: fshard.shard(tree[key], specs[key], src=src))
        assert _same(out[key], one)
        expected += n
    for a, t, spec in zip(out["more"], tree["more"], specs["more"], strict=True):
        one, n = _sent(lambda t=t, spec=spec: fshard.shard(t, spec, src=src))
        assert _same(a, one)
        expected += n
    assert out["none"] is None
    assert sent == expected
    assert (sent == 0) == (src is None)


@pytest.mark.parametrize("src", [None, 1])
def test_one_spec_for_every_leaf(src):
    tree = {"a": torch.arange(8.0), "b": [torch.ones(2, 3), torch.zeros(())]}
    out = fshard.shard(tree, fshard.Replicated([1, 3]), src=src)
    assert out["a"].layout == fshard.Replicated([1, 3]).layout((8,))
    assert torch.equal(fshard.gather(out["b"][0]), torch.ones(2, 3))
    assert [s.data.item() for s in out["b"][1].addressable_shards] == [0.0, 0.0]


@pytest.mark.parametrize("src", [None, 0])
def test_the_result_does_not_share_memory_with_the_input(src):
    t = torch.arange(4.0)
    out = fshard.shard({"t": t}, fshard.Single(0), src=src)
    t.add_(1)
    assert out["t"].addressable_data[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_pending_sums_keep_the_value():
    out = fshard.shard([torch.ones(4), torch.arange(4.0)], fshard.Partial(fshard.Replicated([0, 1])), src=0)
    assert all(a.layout.partial == "sum" for a in out)
    assert fshard.gather(out[1]).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("src", [None, 0])
def test_gradients_reach_every_leaf(src):
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, dtype=torch.float64, requires_grad=True)
    out = fshard.shard({"x": x, "y": y}, {"x": fshard.Chunk(0, R), "y": fshard.Replicated([0, 2])}, src=src)
    loss = (fshard.gather(out["x"]) ** 2).sum() + fshard.gather(out["y"]).sin().sum()
    loss.backward()
    assert torch.allclose(x.grad, 2 * x.detach())
    assert torch.allclose(y.grad, y.detach().cos())


def test_an_empty_tree_gives_an_empty_tree():
    assert fshard.shard({}, fshard.Replicated(R)) == {}
    assert fshard.shard({"a": []}, fshard.Replicated(R), src=0) == {"a": []}


BAD = [
    (
        {"a": torch.ones(2), "n": 3},
        fshard.Replicated(R),
        TypeError,
        "the leaf at ('n',) is of type int. Leave it out of the tree, or make it a tensor (torch.as_tensor).",
    ),
    (
        {"a": torch.ones(2)},
        {"b": fshard.Replicated(R)},
        fshard.SpecError,
        "shard() takes one spec or a pytree of specs matching the tensors (PyTreeSpec({'a': *}))",
    ),
    ({"a": torch.ones(2, 3)}, fshard.Chunk(5, R), fshard.SpecError, "Invalid sharding dim: 5"),
    (
        [torch.ones(2).to_sparse()],
        fshard.Replicated(R),
        fshard.SpecError,
        "has layout torch.sparse_coo; only torch.strided tensors can be sharded.",
    ),
]


@pytest.mark.parametrize("src", [None, 0])
@pytest.mark.parametrize(("tree", "spec", "error", "message"), BAD, ids=["not-a-tensor", "specs", "dim", "sparse"])
def test_bad_trees_raise_naming_the_leaf(tree, spec, error, message, src):
    with pytest.raises(error, match=re.escape(message)) as info:
        fshard.shard(tree, spec, src=src)
    if "leaf" not in message and "tensors (" not in message:  # the leaf's path, in the message or a note
        assert "(0,)" in str(info.value) or "('a',)" in " ".join(getattr(info.value, "__notes__", []))


def test_a_bad_spec_names_the_leaf_in_a_note():
    with pytest.raises(fshard.SpecError) as info:
        fshard.shard({"a": torch.ones(2, 3)}, {"a": fshard.Chunk(5, R)})
    assert info.value.__notes__ == ["(the tensor at ('a',) of shard()'s tree, shape (2, 3))"]
