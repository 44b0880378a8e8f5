"""``ShardedArray.sum`` where torch's answer is easy to miss: dtypes, empty arrays, ``dim=()``.

Every case is checked against ``torch.sum`` of the full tensor (values, shape and dtype),
on the local backend and on 4 Gloo processes, where the sum's dtype must also be torch's
on every rank, whether the rank holds a summand, only an empty shard, or nothing.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import fshard
from fshard import Chunk, Mesh, Named, Replicated

R = [0, 1, 2, 3]
MESH = Mesh((2, 2), axis_names=("dp", "tp"))
X = torch.arange(60).reshape(5, 4, 3) - 20

# name: (tensor, spec, args and kwargs of sum)
Case = tuple[torch.Tensor, Any, tuple[Any, ...], dict[str, Any]]

INT_AND_BOOL: dict[str, Case] = {
    # (pred == label).sum() with the batch split over dp, replicated over tp: ranks 1 and 3 hold replicas
    "bool-batch-over-dp": (torch.tensor([1, 0, 1, 1]) == torch.tensor([1, 1, 1, 0]), Named(MESH, ("dp",)), (), {}),
    # rank 1 holds only an empty shard, ranks 2 and 3 nothing
    "int32-empty-shard": (torch.arange(3, dtype=torch.int32).reshape(1, 3), Chunk(0, [0, 1]), (0,), {}),
    "int8-rows": (X.to(torch.int8), Chunk(0, R), (), {}),
    "uint8-rows-keepdim": (X.abs().to(torch.uint8), Chunk(0, R), ((0, 2),), {"keepdim": True}),
    "int16-two-rows-on-eight-shards": (X[:2].to(torch.int16), Chunk(0, R * 2), (0,), {}),
    "bool-rows-over-dp": (X > 0, Named(MESH, ("dp", None, None)), ((0, 1),), {}),
    "bool-unsplit-dim-on-two-ranks": (X[:2, :, 0] > 0, Chunk(0, [0, 1]), (1,), {}),
    "float16-rows": (X.to(torch.float16), Chunk(0, R), (), {}),
}

EMPTY: dict[str, Case] = {
    "0x3-split-cols": (torch.ones(0, 3), Chunk(1, [0, 1]), (), {}),
    "4x0x3-split-rows": (torch.ones(4, 0, 3), Chunk(0, [0, 1]), ((0, 1),), {}),
    "4x0x3-split-rows-keepdim": (torch.ones(4, 0, 3), Chunk(0, R), ((0, 1),), {"keepdim": True}),
    "3x0-split-rows": (torch.ones(3, 0), Chunk(0, [0, 1]), (), {}),
    "3x0-split-rows-four-ranks": (torch.ones(3, 0), Chunk(0, R), ((0, 1),), {}),
    "0x4-grid": (torch.ones(0, 4), Named(MESH, ("dp", "tp")), (0,), {}),
    "0x4-grid-all": (torch.ones(0, 4), Named(MESH, ("dp", "tp")), (), {}),
    "int32-0x3-split-cols": (torch.zeros(0, 3, dtype=torch.int32), Chunk(1, R), (), {}),
    "bool-0x3-split-cols": (torch.zeros(0, 3, dtype=torch.bool), Chunk(1, R), ((0, 1),), {}),
}

EMPTY_DIMS: dict[str, Case] = {
    "rows": (X.double(), Chunk(0, R), (), {"dim": ()}),
    "rows-keepdim": (X.double(), Chunk(0, R), (), {"dim": (), "keepdim": True}),
    "rows-list": (X.double(), Chunk(0, R), ([],), {}),
    "positional": (X.double(), Chunk(1, R), ((),), {}),
    "replicated-int32": (X.to(torch.int32), Replicated(R), (), {"dim": ()}),
    "bool-grid": (X > 0, Named(MESH, ("dp", "tp", None)), (), {"dim": ()}),
    "scalar": (torch.tensor(3.5), Replicated(R), (), {"dim": ()}),
}

TABLES = {"int_and_bool": INT_AND_BOOL, "empty": EMPTY, "empty_dims": EMPTY_DIMS}


def _summed(table: str, name: str) -> tuple[torch.dtype, torch.Tensor]:
    """The sum's dtype on this rank, and its gathered value."""
    t, spec, args, kwargs = TABLES[table][name]
    s = fshard.shard(t, spec).sum(*args, **kwargs)
    return s.dtype, fshard.gather(s)


def _check(table: str, name: str, results: list[tuple[torch.dtype, torch.Tensor]]) -> None:
    t, _, args, kwargs = TABLES[table][name]
    expected = t.sum(*args, **kwargs)
    for dtype, got in results:
        assert dtype == expected.dtype
        assert got.dtype == expected.dtype
        assert got.shape == expected.shape
        assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(INT_AND_BOOL))
def test_int_and_bool_sums_are_int64_like_torch_locally(name: str) -> None:
    _check("int_and_bool", name, [_summed("int_and_bool", name)])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(INT_AND_BOOL))
def test_int_and_bool_sums_are_int64_on_every_rank(dist_pool, name: str) -> None:
    _check("int_and_bool", name, dist_pool.run(_summed, "int_and_bool", name, timeout=60))


@pytest.mark.parametrize("name", list(EMPTY))
def test_empty_array_sums_to_zeros_locally(name: str) -> None:
    _check("empty", name, [_summed("empty", name)])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EMPTY))
def test_empty_array_sums_to_zeros_on_every_rank(dist_pool, name: str) -> None:
    _check("empty", name, dist_pool.run(_summed, "empty", name, timeout=60))


def _empty_batch() -> tuple[torch.dtype, torch.Tensor]:
    """Every rank's batch empty: its loss sums to 0."""
    s = fshard.from_local_tensor(torch.zeros(0), dim=0).sum()
    return s.dtype, fshard.gather(s)


@pytest.mark.multiprocess
def test_sum_of_empty_batches_on_every_rank_is_zero(dist_pool) -> None:
    assert dist_pool.run(_empty_batch, timeout=60) == [(torch.float32, torch.tensor(0.0))] * 4


def test_empty_array_sum_has_a_gradient_of_its_shape() -> None:
    t = torch.ones(4, 0, 3, requires_grad=True)
    x = fshard.shard(t, Chunk(0, [0, 1]))
    assert fshard.gather(x.sum((0, 1))).tolist() == [0.0, 0.0, 0.0]
    fshard.gather(x.sum()).backward()
    assert t.grad is not None
    assert t.grad.shape == (4, 0, 3)


@pytest.mark.parametrize("name", list(EMPTY_DIMS))
def test_sum_over_no_dims_sums_every_dim_like_torch_locally(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.sum(dim=()) warns of nothing, and neither does fshard
        result = _summed("empty_dims", name)
    _check("empty_dims", name, [result])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EMPTY_DIMS))
def test_sum_over_no_dims_sums_every_dim_on_every_rank(dist_pool, name: str) -> None:
    _check("empty_dims", name, dist_pool.run(_summed, "empty_dims", name, timeout=60))


def test_sum_still_refuses_a_dim_named_twice() -> None:
    x = fshard.shard(X.double(), Chunk(0, R))
    with pytest.raises(fshard.SpecError, match="names a dim twice"):
        x.sum((0, -3))


@pytest.mark.parametrize(
    ("dim", "named"), [(1.0, "dim=1.0;"), ("x", "dim='x';"), (True, "dim=True;"), ((0, 1.0), "whose 1.0 is not an int")]
)
def test_sum_refuses_a_dim_that_is_not_an_int_naming_it(dim: Any, named: str) -> None:
    x = fshard.shard(X.double(), Chunk(0, R))
    with pytest.raises(TypeError, match=re.escape(named)):
        x.sum(dim)
    with pytest.raises(TypeError):  # torch refuses each too
        X.double().sum(dim)


def test_sum_takes_numpy_ints_and_lists_of_dims_as_torch() -> None:
    x = fshard.shard(X.double(), Chunk(0, R))
    dims: tuple[Any, ...] = (np.int64(2), [2], (np.int64(-1),))
    for dim in dims:
        assert torch.equal(fshard.gather(x.sum(dim)), X.double().sum(2))


@pytest.mark.parametrize("dim", [0, -1, (0,), (-1,)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_a_0d_array_sums_over_dim_0_or_minus_1_as_torch(dim: Any, keepdim: bool) -> None:
    t = torch.tensor(3.5, dtype=torch.float64)
    got = fshard.gather(fshard.shard(t, fshard.Replicated([0, 1])).sum(dim, keepdim=keepdim))
    want = t.sum(dim, keepdim=keepdim)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert torch.equal(got, want)
    with pytest.raises(IndexError, match=r"expected to be in range of \[-1, 0\], but got 1"):
        fshard.shard(t, fshard.Replicated([0, 1])).sum(1)
