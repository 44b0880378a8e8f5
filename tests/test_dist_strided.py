"""``fshard.from_dtensor`` of ``_StridedShard`` DTensors on 4 Gloo processes: FSDP2 over tensor parallelism.

The arrays must gather to ``dt.full_tensor()`` bit for bit, and share the DTensor's local tensor.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fshard

pytestmark = pytest.mark.multiprocess


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _fsdp_over_tp() -> list[tuple[str, str, bool, bool]]:
    """(name, placements, gathered == full_tensor, shards are views of the local tensor) per parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.filterwarnings("ignore")  # DTensor's note on sequential all-gathers of strided placements
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 9))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    out = []
    for name, p in model.named_parameters():
        dt = p.data
        x = fshard.from_dtensor(dt)
        local = dt.to_local()
        views = all(
            s.data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() for s in x.addressable_shards
        )
        out.append((name, str(tuple(dt.placements)), _same(fshard.gather(x), dt.full_tensor()), views))
    return out


def test_fsdp2_over_tensor_parallel_parameters(dist_pool) -> None:
    results = dist_pool.run(_fsdp_over_tp, timeout=180)
    assert results[0][0][1] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # the colwise weight: 7 rows, uneven
    for rank in results:
        assert [(name, ok, views) for name, _, ok, views in rank] == [
            ("0.weight", True, True),
            ("0.bias", True, True),
            ("2.weight", True, True),
            ("2.bias", True, True),
        ]


def _placement(kind: str, dim: int, factor: int) -> object:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {"shard": Shard(dim), "strided": _StridedShard(dim, split_factor=factor), "replicate": Replicate()}[kind]


def _distributed(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], kinds: list[tuple[str, int, int]]
) -> tuple[bool, list[int]]:
    """A DTensor whose local tensor is cut by DTensor's own placements, left to right, at this rank's coordinate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    warnings.filterwarnings("ignore")
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(torch.float64)
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [_placement(*k) for k in kinds]
    local = full
    for m, p in enumerate(placements):
        if not p.is_replicate():  # type: ignore[attr-defined]
            parts, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=True)  # type: ignore[attr-defined]
            local = parts[mesh.get_coordinate()[m]]
    dt = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    x = fshard.from_dtensor(dt)
    return _same(fshard.gather(x), dt.full_tensor()) and _same(dt.full_tensor(), full), [len(x.addressable_shards)]


@pytest.mark.parametrize(
    ("shape", "mesh", "kinds", "boxes"),
    [
        ((9, 3), (4,), [("strided", 0, 2)], [2, 2, 2, 1]),  # DTensor's own example: rank 0 holds rows 0, 1, 5
        ((9, 4), (2, 2), [("shard", 1, 1), ("strided", 0, 2)], [2, 2, 2, 2]),
        ((5, 6), (2, 2), [("strided", 1, 2), ("shard", 1, 1)], [1, 1, 1, 1]),
        ((7, 5), (2, 2), [("strided", 0, 2), ("shard", 1, 1)], [2, 2, 2, 2]),
        ((8, 3), (2, 2), [("replicate", 0, 1), ("strided", 0, 2)], [2, 2, 2, 2]),
    ],
    ids=["1d-example", "2d-cols-then-strided-rows", "cols", "rows-and-cols", "replicated"],
)
def test_distribute_tensor_with_strided_placements(dist_pool, shape, mesh, kinds, boxes) -> None:
    results = dist_pool.run(_distributed, shape, mesh, kinds, timeout=120)
    assert [ok for ok, _ in results] == [True] * 4
    assert [n for _, (n,) in results] == boxes
