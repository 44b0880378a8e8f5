"""The multi-process scenarios of torch's test_sharded_tensor.py, in fshard terms, over Gloo.

Each ``_name`` function runs on the 4 ranks of the pool; the test sends it there.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

RANKS = [0, 1, 2, 3]


def _sent(backend, fn):
    """Runs ``fn()``; returns (its result, elements this rank sent meanwhile)."""
    before = backend.counters.elements_sent
    out = fn()
    return out, backend.counters.elements_sent - before


def _complete_world_size():
    rank = dist.get_rank()
    for dim in (0, -2):
        st = fshard.ones(fshard.Chunk(dim, [f"rank:{r}/cpu" for r in RANKS]), 10, 20)
        (shard,) = st.addressable_shards
        assert shard.data.device == torch.device("cpu")
        assert tuple(shard.data.shape) == ((1, 20) if rank == 3 else (3, 20))
        metas = st.layout.shards
        assert len(metas) == 4
        for r, m in enumerate(metas):
            assert m.offsets == (r * 3, 0)
            assert m.sizes == ((1, 20) if r == 3 else (3, 20))
            assert str(m.placement) == f"rank:{r}/cpu"
        # torch's remote shards: every rank reads the others' data through gather.
        assert torch.equal(fshard.gather(st), torch.ones(10, 20))


def test_complete_world_size(dist_pool):
    dist_pool.run(_complete_world_size)


def _partial_world_size():
    rank = dist.get_rank()
    st = fshard.empty(fshard.Chunk(0, ["rank:2/cpu", "rank:3/cpu"]), 10, 20)
    shards = st.addressable_shards
    if rank >= 2:
        assert len(shards) == 1
        assert tuple(shards[0].data.shape) == (5, 20)
    else:
        assert shards == ()
    for k, m in enumerate(st.layout.shards):
        assert (m.offsets, m.sizes, str(m.placement)) == ((k * 5, 0), (5, 20), f"rank:{k + 2}/cpu")
    x = torch.arange(200.0).reshape(10, 20)
    y = fshard.shard(x, fshard.Chunk(0, [2, 3]))
    assert torch.equal(fshard.gather(y), x)  # ranks 0 and 1 hold nothing and still get it


def test_partial_world_size(dist_pool):
    dist_pool.run(_partial_world_size)


def _new_group():
    rank = dist.get_rank()
    pg = dist.new_group(ranks=[1, 2, 3])
    backend = TorchDistBackend(pg)
    spec = fshard.Chunk(0, ["rank:2/cpu", "rank:3/cpu"])
    st = fshard.empty(spec, 10, 20, backend=backend)  # every rank, member or not, may create
    assert len(st.addressable_shards) == (1 if rank >= 2 else 0)
    assert [str(m.placement) for m in st.layout.shards] == ["rank:2/cpu", "rank:3/cpu"]
    if rank == 0:
        assert not backend.member
        with pytest.raises(
            fshard.SpecError,
            match=re.escape("rank 0 is not in the process group (the group of the call's arrays"),
        ):
            fshard.gather(st)
        # Per-shard functions too: this rank could not learn what fn returned on the group's ranks.
        for call in (
            lambda: fshard.map_local(lambda t: t.to(torch.int32), st),
            lambda: st + 1,
            lambda: fshard.shard_map(lambda t: t * 2, in_specs=spec, out_specs=spec)(st),
        ):
            with pytest.raises(fshard.SpecError, match="rank 0 is not in this array's process group"):
                call()
        return None
    assert backend.ranks == (1, 2, 3)
    x = torch.arange(200.0).reshape(10, 20)
    a = fshard.shard(x if rank == 1 else None, spec, src=1, backend=backend)
    b = fshard.reshard(a, fshard.Chunk(1, [3, 1, 2]))
    full = fshard.gather(b, dst=2)
    assert (full is not None) == (rank == 2)
    assert full is None or torch.equal(full, x)
    assert torch.equal(fshard.gather(b), x)
    return rank


def test_new_group(dist_pool):
    assert dist_pool.run(_new_group) == [None, 1, 2, 3]


def _gather_on_subgroup_of_two():
    """torch's ShardedTensor.gather on a group [2, 3] raises IndexError; fshard's works."""
    rank = dist.get_rank()
    pg = dist.new_group(ranks=[2, 3])
    if rank < 2:
        return None
    backend = TorchDistBackend(pg)
    x = torch.arange(40.0).reshape(8, 5)
    a = fshard.shard(x, fshard.Chunk(0, [3, 2]), backend=backend)
    full = fshard.gather(a, dst=2)
    assert (full is None) == (rank == 3)
    assert full is None or torch.equal(full, x)
    return fshard.gather(a).sum().item()


def test_gather_on_sub_group(dist_pool):
    assert dist_pool.run(_gather_on_subgroup_of_two) == [None, None, 780.0, 780.0]


def _multiple_local_shards():
    rank = dist.get_rank()
    spec = fshard.Chunk(0, [f"rank:{k % 4}/cpu" for k in range(8)])
    x = torch.arange(320.0).reshape(16, 20)
    st = fshard.shard(x, spec)
    assert len(st.addressable_shards) == 2
    for s in st.addressable_shards:
        assert tuple(s.data.shape) == (2, 20)
        assert s.meta.placement.rank == rank
    for k, m in enumerate(st.layout.shards):
        assert (m.offsets, m.sizes, str(m.placement)) == ((2 * k, 0), (2, 20), f"rank:{k % 4}/cpu")
    with pytest.raises(NotImplementedError, match=re.escape("Only single local shard is supported.")):
        st.local_tensor()
    back, sent = _sent(st.backend, lambda: fshard.reshard(st, fshard.Chunk(0, RANKS)))
    assert torch.equal(back.local_tensor(), x[4 * rank : 4 * rank + 4])
    assert torch.equal(fshard.gather(st), x)
    return sent


def test_multiple_local_shards(dist_pool):
    sent = dist_pool.run(_multiple_local_shards)
    spec = fshard.Chunk(0, [k % 4 for k in range(8)])
    assert sum(sent) == fshard.plan(spec.layout((16, 20)), fshard.Chunk(0, RANKS).layout((16, 20))).min_elements_sent


def _gather_to(placements, h, w, dst):
    rank = dist.get_rank()
    st = fshard.ones(fshard.Chunk(0, placements), h, w)
    full, sent = _sent(st.backend, lambda: fshard.gather(st, dst=dst))
    if rank == dst:
        assert torch.equal(full, torch.ones(h, w))
    else:
        assert full is None
    return sent


@pytest.mark.parametrize(
    "placements",
    [pytest.param(RANKS, id="even"), pytest.param([0, 0, 1, 1, 2], id="uneven-5-on-3")],
)
def test_gather(dist_pool, placements):
    sent = dist_pool.run(_gather_to, placements, 10, 20, 1)
    layout = fshard.Chunk(0, placements).layout((10, 20))
    assert sum(sent) == 200 - sum(s.numel for s in layout.shards_on(1))
    assert sent[1] == 0


def _insufficient_sharding_dims():
    rank = dist.get_rank()
    st = fshard.empty(fshard.Chunk(0, RANKS), 2, 20)
    (shard,) = st.addressable_shards
    if rank <= 1:
        assert tuple(shard.data.shape) == (1, 20)
    else:
        assert shard.data.numel() == 0
    for r, m in enumerate(st.layout.shards):
        assert m.offsets == (r, 0)
        assert m.sizes == ((1, 20) if r <= 1 else (0, 20))
    x = torch.arange(40.0).reshape(2, 20)
    y = fshard.reshard(fshard.shard(x, fshard.Chunk(0, RANKS)), fshard.Chunk(1, RANKS))
    assert torch.equal(fshard.gather(y), x)


def test_insufficient_sharding_dims(dist_pool):
    dist_pool.run(_insufficient_sharding_dims)


def _sharding_columns():
    rank = dist.get_rank()
    for dim in (1, -1):
        st = fshard.empty(fshard.Chunk(dim, RANKS), 10, 32)
        assert tuple(st.local_tensor().shape) == (10, 8)
        for r, m in enumerate(st.layout.shards):
            assert (m.offsets, m.sizes, str(m.placement)) == ((0, r * 8), (10, 8), f"rank:{r}/cpu")
    x = torch.arange(320).reshape(10, 32)
    assert torch.equal(fshard.shard(x, fshard.Chunk(-1, RANKS)).local_tensor(), x[:, 8 * rank : 8 * rank + 8])


def test_sharding_columns(dist_pool):
    dist_pool.run(_sharding_columns)


def _invalid_sharding():
    with pytest.raises(NotImplementedError, match="does not support named dimension"):
        fshard.empty(fshard.Chunk("H", ["rank:1/cpu"]), 10, 20)
    for dim in (2, 3, 4, -3, -4, -5):
        with pytest.raises(ValueError, match="Invalid sharding dim"):
            fshard.empty(fshard.Chunk(dim, ["rank:1/cpu"]), 10, 20)
    with pytest.raises(ValueError, match="Global rank 5 does not exist in input process group"):
        fshard.empty(fshard.Chunk(0, ["rank:5/cpu"]), 10, 20)
    with pytest.raises(fshard.SpecError, match="RPC worker names are not supported"):
        fshard.Chunk(0, ["worker0/cpu"])
    st = fshard.empty(fshard.Chunk(0, [0]), 10, 20)
    with pytest.raises(TypeError, match="not supported for ShardedArray"):
        torch.add(st, torch.empty(10, 20))
    for flag in (True, np.bool_(True)):  # equal to rank 1, but no rank
        with pytest.raises(fshard.SpecError, match=r"dst=(np\.)?True.*: Global rank .* does not exist"):
            fshard.gather(st, dst=flag)
        with pytest.raises(fshard.SpecError, match=r"src=(np\.)?True.*: Global rank .* does not exist"):
            fshard.shard(torch.zeros(10, 20), fshard.Chunk(0, [0]), src=flag)


def test_invalid_sharding(dist_pool):
    dist_pool.run(_invalid_sharding)


def _sub_group_placements():
    """A sub-group [1, 2, 3] with a shard placed on rank 0: every rank raises the same error."""
    pg = dist.new_group(ranks=[1, 2, 3])
    backend = TorchDistBackend(pg)
    msg = "Global rank 0 does not exist in input process group"
    with pytest.raises(fshard.SpecError, match=msg):
        fshard.empty(fshard.Chunk(0, [0, 1, 2, 3]), 10, 20, backend=backend)
    with pytest.raises(fshard.SpecError, match=msg):
        fshard.from_local_shards_and_layout([], fshard.Chunk(0, [2, 0]).layout((4,)), backend=backend)
    if dist.get_rank() > 0:
        x = fshard.zeros(fshard.Chunk(0, [1, 2, 3]), 6, backend=backend)
        with pytest.raises(fshard.SpecError, match=msg):
            fshard.reshard(x, fshard.Chunk(0, [0, 1]))
        with pytest.raises(fshard.SpecError, match="Global rank 0 does not exist"):
            fshard.gather(x, dst=0)


def test_sub_group_placement_validation(dist_pool):
    dist_pool.run(_sub_group_placements)


def _local_tensor():
    st = fshard.rand(fshard.Chunk(0, RANKS), 24, 12, seed=0)
    assert tuple(st.local_tensor().shape) == (6, 12)
    assert st.local_tensor() is st.local_tensor()
    st = fshard.rand(fshard.Chunk(0, [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]), 24, 12, seed=0)
    with pytest.raises(NotImplementedError, match=re.escape("Only single local shard is supported.")):
        st.local_tensor()


def test_local_tensor_and_errors(dist_pool):
    dist_pool.run(_local_tensor)


def _shard_tensor_errors():
    rank = dist.get_rank()
    spec = fshard.Chunk(0, RANKS)
    tensor = torch.rand(12, 12, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="does not match with src_rank"):
        fshard.shard(tensor, spec, src=rank)
    # A transposed (non-contiguous) tensor is read correctly, from every rank or from one.
    t = tensor.t()
    assert torch.equal(fshard.shard(t, spec).local_tensor(), t[3 * rank : 3 * rank + 3])
    assert torch.equal(fshard.shard(t if rank == 1 else None, spec, src=1).local_tensor(), t[3 * rank : 3 * rank + 3])
    st = fshard.shard(torch.rand(9, 12, generator=torch.Generator().manual_seed(1)), spec)
    assert tuple(st.local_tensor().shape) == ((0, 12) if rank == 3 else (3, 12))


def test_shard_tensor_errors(dist_pool):
    dist_pool.run(_shard_tensor_errors)
