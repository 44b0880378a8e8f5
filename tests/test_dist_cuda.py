"""The same code paths on CUDA tensors: the local backend, NCCL on one GPU, NCCL on several."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.testing.launch import launch

pytestmark = pytest.mark.cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(
    GPUS < 2,
    reason=f"needs 2 GPUs (torch.cuda.device_count() is {GPUS})"
    if GPUS
    else "needs CUDA (torch.cuda.is_available() is False)",
)

X = torch.arange(120.0).reshape(10, 12)


@needs_cuda
def test_local_backend_on_cuda_tensors():
    spec = fshard.Chunk(0, ["rank:0/cuda:0", "rank:1/cuda:0", "rank:2/cpu"])
    a = fshard.shard(X.cuda(), spec)
    assert [s.data.device.type for s in a.addressable_shards] == ["cuda", "cuda", "cpu"]
    b = fshard.reshard(a, fshard.Chunk(1, ["rank:0/cpu", "rank:1/cuda:0"]))
    assert torch.equal(fshard.gather(b).cpu(), X)


def _nccl_job(world):
    rank = dist.get_rank()
    ranks = list(range(world))
    on_gpu = [f"rank:{r}/cuda:{r % torch.cuda.device_count()}" for r in ranks]
    x = X.cuda()
    a = fshard.shard(x, fshard.Chunk(0, on_gpu))
    assert all(s.data.is_cuda for s in a.addressable_shards)
    counters = a.backend.counters
    before = counters.elements_sent
    b = fshard.reshard(a, fshard.Chunk(1, on_gpu[::-1]))
    sent = counters.elements_sent - before
    full = fshard.gather(b, dst=0)
    assert (full is None) == (rank != 0)
    assert full is None or torch.equal(full.cpu(), X)
    assert torch.equal(fshard.gather(b).cpu(), X)
    c = fshard.shard(x if rank == 0 else None, fshard.Chunk(0, on_gpu), src=0)
    assert fshard.equal(a, c)
    old = fshard.config(check_collectives=True)
    try:
        assert torch.equal(
            fshard.gather(fshard.rand(fshard.Chunk(0, on_gpu), 10, 12, seed=1)).cpu(),
            fshard.gather(fshard.rand(fshard.Chunk(0, [0]), 10, 12, seed=1)).cpu(),
        )
    finally:
        fshard.config(check_collectives=old.check_collectives)
    return sent


@needs_cuda
def test_nccl_world_size_one():
    assert launch(_nccl_job, 1, 1, backend="nccl") == [0]


@needs_gpus
def test_nccl_on_every_gpu():
    sent = launch(_nccl_job, GPUS, GPUS, backend="nccl")
    on_gpu = list(range(GPUS))
    layout = fshard.Chunk(0, on_gpu).layout(X.shape)
    target = fshard.Chunk(1, on_gpu[::-1]).layout(X.shape)
    assert sum(sent) == fshard.plan(layout, target).min_elements_sent
