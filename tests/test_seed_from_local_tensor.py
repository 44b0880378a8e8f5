"""The seed's TestShardedTensorFromLocalTensor in fshard terms: ``from_local_tensor(tensor, spec, size)``.

torch's test builds a ShardedTensor from each rank's local tensor for four
``ChunkShardingSpec``s with shuffled placements and four sizes, and checks the
local shard, its metadata and the global metadata against the spec's
``build_metadata``. Here the same 16 cases run on the local backend (one call
passes every rank's tensor) and on the 4-process Gloo pool (each rank its own).
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

import fshard

SIZES = [[20, 10], [21, 11], [23, 16], [44, 16, 8]]


def chunk_specs(sharding_dims: list[int], seed: int = 0) -> list[ChunkShardingSpec]:
    """torch's ``_chunk_sharding_specs_list_for_test`` with cpu placements: one list shuffled in turn."""
    placements = [f"rank:{r}/cpu" for r in range(4)]
    specs = []
    for i, dim in enumerate(sharding_dims):
        random.Random(seed + i).shuffle(placements)
        specs.append(ChunkShardingSpec(dim=dim, placements=list(placements)))
    return specs


SPECS = chunk_specs([0, 1, 1, 0], seed=31)
CASES = [(k, size) for k in range(len(SPECS)) for size in SIZES]


def torch_layout(spec: ChunkShardingSpec, size: list[int]) -> fshard.Layout:
    return fshard.Layout.from_torch_metadata(spec.build_metadata(torch.Size(size), TensorProperties()))


def test_the_specs_are_shuffled() -> None:
    orders = [tuple(str(p) for p in s.placements) for s in SPECS]
    assert len(set(orders)) > 1
    assert any(o != tuple(f"rank:{r}/cpu" for r in range(4)) for o in orders)


@pytest.mark.parametrize(("k", "size"), CASES, ids=[f"spec{k}-{'x'.join(map(str, s))}" for k, s in CASES])
def test_init_from_local_tensor(k: int, size: list[int]) -> None:
    spec = SPECS[k]
    want = torch_layout(spec, size)
    full = torch.rand(size, generator=torch.Generator().manual_seed(k))
    mine = [full[tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))].contiguous() for m in want.shards]
    x = fshard.from_local_tensor(mine, spec, size)
    assert tuple(x.shape) == tuple(size)
    assert x.layout == want  # the global metadata is the spec's, placements in the spec's order
    for shard, tensor, meta in zip(x.addressable_shards, mine, want.shards):
        assert shard.data is tensor  # the local shards are the tensors given, not copies
        assert shard.meta == meta
    assert torch.equal(fshard.gather(x), full)


def test_init_from_local_tensor_errors() -> None:
    spec = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [5, 5], "rank:0/cpu"), ShardMetadata([5, 0], [5, 5], "rank:1/cpu")]
    )
    with pytest.raises(fshard.SpecError, match="do not cover the entire tensor"):
        fshard.from_local_tensor([torch.rand(5, 5), torch.rand(5, 5)], spec, [24, 12])
    chunk = chunk_specs([0], seed=31)[0]
    parts = [torch.rand(12, 6).t() for _ in range(4)]  # (6, 12) views, not contiguous
    with pytest.raises(fshard.LayoutError, match=re.escape("local_tensor is not a contiguous Tensor")):
        fshard.from_local_tensor(parts, chunk, [24, 12])
    with pytest.raises(fshard.LayoutError, match=re.escape("passed 1 local tensor(s) but holds 4 shard(s)")):
        fshard.from_local_tensor(torch.rand(6, 12), chunk, [24, 12])
    with pytest.raises(fshard.LayoutError, match=re.escape("local tensor of shape (5, 12) is not the size of shard")):
        fshard.from_local_tensor([torch.rand(5, 12)] * 4, chunk, [24, 12])
    with pytest.raises(TypeError, match=re.escape("needs the global shape with a spec")):
        fshard.from_local_tensor(torch.rand(6, 12), chunk)


# -- each rank its own tensor, on 4 Gloo processes -----------------------------------------------


def _init_from_local_tensor() -> list[tuple[int, bool, bool, bool]]:
    rank = dist.get_rank()
    out = []
    for k, size in CASES:
        spec = SPECS[k]
        want = torch_layout(spec, size)
        (meta,) = want.shards_on(rank)
        full = torch.rand(size, generator=torch.Generator().manual_seed(k))
        local = full[tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))].contiguous()
        x = fshard.from_local_tensor(local, spec, size)
        same_local = x.local_tensor() is local and x.addressable_shards[0].meta == meta
        out.append((k, x.layout == want, same_local, torch.equal(fshard.gather(x), full)))
    return out


@pytest.mark.multiprocess
def test_init_from_local_tensor_on_four_ranks(dist_pool) -> None:
    for result in dist_pool.run(_init_from_local_tensor):
        assert [r[1:] for r in result] == [(True, True, True)] * len(CASES)


def _errors_on_four_ranks() -> tuple[str, str]:
    rank = dist.get_rank()
    spec = chunk_specs([0], seed=31)[0]
    local = torch.rand(12, 6).t() if rank == 2 else torch.rand(6, 12)  # only rank 2's is a transposed view
    try:
        fshard.from_local_tensor(local, spec, [24, 12])
        layout_message = ""
    except fshard.LayoutError as exc:
        layout_message = str(exc)
    local = torch.rand(6, 12, dtype=torch.float64 if rank == 1 else torch.float32)
    try:
        fshard.from_local_tensor(local, spec, [24, 12])
        spec_message = ""
    except fshard.SpecError as exc:
        spec_message = str(exc)
    return layout_message, spec_message


@pytest.mark.multiprocess
def test_every_rank_raises_the_same_error(dist_pool) -> None:
    results = dist_pool.run(_errors_on_four_ranks)
    assert len(set(results)) == 1  # the same messages on every rank, not only on the rank at fault
    layout_message, spec_message = results[0]
    assert "rank 2: local_tensor is not a contiguous Tensor" in layout_message
    assert "local tensors differ in (dtype, requires_grad)" in spec_message
    assert "torch.float64" in spec_message
