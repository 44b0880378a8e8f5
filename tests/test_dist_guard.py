"""Without check mode, ranks that move data with different arguments raise on every rank
(each movement carries a header of its dtype, operation and layouts), and every kind of
movement still gives the right values with the header in its messages."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist._guard import inline_bytes

pytestmark = pytest.mark.multiprocess

RANKS = [0, 1, 2, 3]
X = torch.arange(96.0).reshape(8, 12)
BIG = torch.arange(float(1 << 16)).reshape(256, 256)  # 256 KiB: past the inline bytes, a round of headers first


def _message(fn):
    """``fn()`` with check mode off: the CollectiveMismatchError message it raised, or its result."""
    assert not fshard.config().check_collectives
    try:
        fn()
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def _int32_beside_float32(x):
    dtype = torch.int32 if dist.get_rank() == 3 else torch.float32
    a = fshard.shard(x.to(dtype), fshard.Chunk(0, RANKS))
    return _message(lambda: fshard.gather(a))


def _reversed_chunk_on_one_rank(x):
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    order = [3, 2, 1, 0] if dist.get_rank() == 2 else RANKS
    return _message(lambda: fshard.reshard(a, fshard.Chunk(1, order)))


def _gather_to_different_dst(x):
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    return _message(lambda: fshard.gather(a, dst=dist.get_rank() % 2))


CASES = {
    # (function, the groups of ranks named, what the message says differs)
    "int32-beside-float32": (_int32_beside_float32, [[0, 1, 2], [3]], "they differ in dtype)"),
    "chunk-reversed-on-one-rank": (_reversed_chunk_on_one_rank, [[0, 1, 3], [2]], "they differ in destination layout)"),
    "gather-dst-0-against-dst-1": (_gather_to_different_dst, [[0, 2], [1, 3]], "operation, destination layout)"),
}


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_disagree_raise_on_every_rank_without_check_mode(dist_pool, case, size):
    fn, groups, differ = CASES[case]
    messages = dist_pool.run(fn, X if size == "small" else BIG, timeout=60)
    assert len(set(messages)) == len(RANKS), "each rank names itself"
    for m in messages:
        assert "called it with different arguments on process group [0, 1, 2, 3], so no data was read" in m, m
        for ranks in groups:
            assert f"ranks {ranks} sent " in m, m
        assert differ in m, m
    if case == "int32-beside-float32":
        assert re.search(r"ranks \[0, 1, 2\] sent float32, .*; ranks \[3\] sent int32, ", messages[0]), messages[0]
    # The group is still usable: nothing was left in flight.
    assert dist_pool.run(_gather_back, timeout=60) == [X.sum().item()] * 4


def _gather_back():
    return fshard.gather(fshard.shard(X, fshard.Chunk(1, RANKS))).sum().item()


def _every_movement(x):
    """Each transport with headers in its messages: values, and which round the data took."""
    rank, out = dist.get_rank(), {}
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    out["reshard"] = fshard.gather(fshard.reshard(a, fshard.Chunk(1, [3, 1, 0, 2]))).equal(x)
    out["gather-dst"] = (fshard.gather(a, dst=2) is None) if rank != 2 else fshard.gather(a, dst=2).equal(x)
    src = fshard.shard(x if rank == 1 else torch.empty(0), fshard.Chunk(1, RANKS), src=1)
    out["shard-src"] = fshard.gather(src).equal(x)
    out["replicated"] = fshard.reshard(a, fshard.Replicated(RANKS)).addressable_shards[0].data.equal(x)
    layout = fshard.Partial(fshard.Replicated(RANKS), "sum").layout(x.shape)
    mine = [fshard.Shard(m, x * (rank + 1)) for m in layout.shards_on(rank)]
    summed = fshard.from_local_shards_and_layout(mine, layout)
    out["reduce-chunk"] = fshard.gather(fshard.reshard(summed, fshard.Chunk(0, RANKS))).equal(x * 10)
    half = fshard.shard(x.to(torch.bfloat16), fshard.Chunk(0, RANKS))  # a dtype that numpy lacks
    out["bfloat16"] = fshard.gather(fshard.reshard(half, fshard.Chunk(1, RANKS))).equal(x.to(torch.bfloat16))
    out["reduce-replicated"] = fshard.gather(fshard.reshard(summed, fshard.Replicated(RANKS))).equal(x * 10)
    return out


@pytest.mark.parametrize("x", [X, BIG], ids=["inline", "header-round"])
def test_every_movement_gives_the_right_values_with_headers(dist_pool, x):
    assert X.numel() * 4 <= inline_bytes(4) < BIG.numel() * 4
    got = dist_pool.run(_every_movement, x, timeout=60)
    assert all(all(r.values()) for r in got), got
