"""fshard under torch.compile and torch.func.vmap (fshard._base.compile), on the local backend.

``shard``, ``reshard`` and ``gather`` run eagerly under ``torch.compile`` (a graph
break each, ``fshard._base.compile.opaque``), and a ShardedArray rebuilt from shard tensors
that gained a batch dim under ``vmap`` gets the batched layout
(``fshard._layout.batch.batched_layout``).
"""

from __future__ import annotations

import re

import optree
import pytest
import torch
from torch.func import grad, vmap

import fshard
import fshard._array.array
from fshard._base.compile import opaque
from fshard._layout.batch import batched_layout

ROWS = fshard.Chunk(0, [0, 1])
COLS = fshard.Chunk(1, [0, 1, 2])


@pytest.fixture
def opaque_movement():
    """A fresh dynamo cache around a compile test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def batched_results():
    """Results of vmap rebuild batched arrays (nothing to set up: kept for the tests' signatures)."""
    return


# -- torch.compile --------------------------------------------------------------------------------


def step(x: torch.Tensor) -> torch.Tensor:
    a = fshard.shard(x, ROWS)
    b = fshard.map_local(lambda t: torch.sin(t) * 2 + 1, a)
    c = fshard.reshard(b, COLS)
    d = fshard.map_local(lambda t: t.sum(0, keepdim=True), fshard.reshard(c, fshard.Replicated([0, 1])))
    return fshard.gather(c).sum() + fshard.gather(d).sum()


# Dynamo reads .grad of the shard tensors while it builds its guards, and notes that it traces through
# cached pure functions of layouts (map_local's layout inference): torch's warnings, not failures.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function:UserWarning")
def test_compiled_step_gives_the_eager_result_and_gradient(opaque_movement) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = step(x)
    want.backward()
    want_grad, x.grad = x.grad.clone(), None
    got = torch.compile(step)(x)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, want_grad)


def test_map_local_body_compiles_with_fullgraph() -> None:
    body = torch.compile(lambda t, u: torch.tanh(t) * u + 1, fullgraph=True)
    x = fshard.shard(torch.randn(6, 4), ROWS)
    y = fshard.shard(torch.randn(6, 4), ROWS)
    got = fshard.gather(fshard.map_local(body, x, y))
    torch.testing.assert_close(got, torch.tanh(fshard.gather(x)) * fshard.gather(y) + 1)


def test_opaque_keeps_name_and_docstring() -> None:
    wrapped = opaque(fshard.reshard)
    assert wrapped.__name__ == "reshard"
    assert wrapped.__doc__ == fshard.reshard.__doc__
    assert wrapped.__module__ == fshard.reshard.__module__  # doctest still finds its examples


# -- torch.func.vmap: per-example gradients -----------------------------------------------------

W = torch.randn(40, 5, generator=torch.Generator().manual_seed(1))
XS = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))


def loss(w: fshard.ShardedArray, x: torch.Tensor) -> torch.Tensor:
    y = fshard.map_local(lambda t: torch.tanh(t * x), w)
    return (fshard.gather(fshard.reshard(y, fshard.Replicated([0, 1]))) ** 2).sum()


def reference() -> torch.Tensor:
    return vmap(grad(lambda w, x: (torch.tanh(w * x) ** 2).sum()), in_dims=(None, 0))(W, XS)


def test_per_example_gradients_come_back_as_one_batched_array(batched_results) -> None:
    w = fshard.shard(W, ROWS)
    g = vmap(grad(loss), in_dims=(None, 0))(w, XS)
    assert g.layout == fshard.Layout((8, 40, 5), [((0, 0, 0), (8, 20, 5), 0), ((0, 20, 0), (8, 20, 5), 1)])
    torch.testing.assert_close(fshard.gather(g), reference())


def test_per_example_gradients_over_the_leaves() -> None:
    """The way that needs no batched array: vmap over the shard tensors, rebuilding the tree inside."""
    w = fshard.shard(W, ROWS)
    leaves, treespec = optree.tree_flatten(w)
    per_example = vmap(grad(lambda ls, x: loss(optree.tree_unflatten(treespec, ls), x)), in_dims=(None, 0))(leaves, XS)
    torch.testing.assert_close(torch.cat(per_example, dim=1), reference())


def test_other_out_dims_raise_naming_vmap_and_the_way_around(batched_results) -> None:
    w = fshard.shard(W, ROWS)
    msg = "Shard 0 tensor has shape (20, 8, 5) but the layout gives it sizes (20, 5)"
    with pytest.raises(fshard.LayoutError, match=re.escape(msg)) as info:
        vmap(grad(loss), in_dims=(None, 0), out_dims=1)(w, XS)
    assert isinstance(info.value, fshard.FShardError)
    assert "torch.func.vmap" in str(info.value)
    assert "optree.tree_leaves(result)" in str(info.value)


def test_batched_layout_of_a_process_without_shards() -> None:
    lay = fshard.Chunk(0, [2, 3]).layout((4, 3))
    assert batched_layout(lay, [torch.empty(5, 0)], ()) == fshard.Chunk(1, [2, 3]).layout((5, 4, 3))
    assert batched_layout(lay, [torch.empty(0)], ()) is None
    assert batched_layout(lay, [torch.zeros(2, 3), torch.zeros(2, 3)], (0, 1)) is None
