"""The same code paths on CUDA tensors: the local backend, NCCL on one GPU, NCCL on several."""

from __future__ import annotations

from typing import Any

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
    mine = x.chunk(world)[rank]  # this rank's rows, its check posted on the GPU and ended by the gather
    e = fshard.from_local_tensor(mine.contiguous(), dim=0, even=True)
    assert torch.equal(fshard.gather(e).cpu(), X[: mine.shape[0] * world])
    old = fshard.config(check_collectives=True)
    try:
        assert torch.equal(
            fshard.gather(fshard.rand(fshard.Chunk(0, on_gpu), 10, 12, seed=1)).cpu(),
            fshard.gather(fshard.rand(fshard.Chunk(0, [0]), 10, 12, seed=1)).cpu(),
        )
        checked = fshard.from_local_tensor(mine.contiguous(), dim=0, even=True)  # each rank names its own GPU
        assert torch.equal(fshard.gather(checked).cpu(), X[: mine.shape[0] * world])
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


def _ws() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 8, generator=g, dtype=torch.float64) * 0.5 for _ in range(3)]


def _rows(step: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)


def _body(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    for w in ws:
        x = torch.tanh(x @ w)
    return x.square().sum()[None]


def _steps_over_gloo(style: str, device: str, steps: int = 2) -> list[list[Any]]:
    """``steps`` training steps on 4 Gloo processes whose blocks live on ``device``: each step's gradients (numpy).

    Data parallel (``Replicated`` parameters: gradients summed in buckets) or fully sharded
    (``Chunk(0)``: gathered, and reduce-scattered in the backward; ``"regather"``: gathered
    again in the backward, the first step's gather prefetched). Over Gloo, CUDA blocks travel
    through the CPU.
    """
    ranks = list(range(dist.get_world_size()))
    where = [f"rank:{r}/{device}" for r in ranks]
    spec = fshard.Replicated(where) if style.startswith("dp") else fshard.Chunk(0, where)
    params = [fshard.shard(w.to(device), spec) for w in _ws()]
    if style == "dp-devices":  # the first layer on the CPU: its gradients sum in buckets on another device
        params[0] = fshard.shard(_ws()[0], fshard.Replicated([f"rank:{r}/cpu" for r in ranks]))
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    step = _across_devices(where) if style == "dp-devices" else fshard.shard_map(
        _body, in_specs=(fshard.Chunk(0, where), *[fshard.Replicated(where)] * 3),
        out_specs=fshard.Partial(fshard.Replicated(where)), regather=style == "regather",
    )  # fmt: skip
    out = []
    for k in range(steps):
        if style == "regather" and k == 0:
            fshard.prefetch(params, fshard.Replicated(where))
        if style.startswith("dp-"):  # each rank's own rows, and the loss carried by a last bucket
            x = fshard.from_local_tensor(_rows(k).chunk(4)[dist.get_rank()].to(device), dim=0, even=True)
            loss = step(x, *params)
            value = fshard.backward(loss)
            with torch.no_grad():
                torch.testing.assert_close(value, fshard.gather(loss), rtol=1e-12, atol=0)
        else:
            x = fshard.shard(_rows(k).to(device), fshard.Chunk(0, where))
            fshard.gather(step(x, *params)).backward()
        assert all(t.grad.device == t.device for t in leaves)
        out.append([t.grad.cpu().numpy() for t in leaves])  # numpy: no tensor outlives the process
        for t in leaves:
            t.grad = None
    return out


def _across_devices(where: list[str]) -> Any:
    """``_body`` as two ``shard_map``s: the first layer on each rank's CPU, the others on ``where``'s devices.

    The rows move to the CPU and back between them; the loss is on ``where``'s devices.
    """
    cpu = [f"rank:{r}/cpu" for r in range(len(where))]
    first = fshard.shard_map(
        lambda x, w: torch.tanh(x @ w), in_specs=(fshard.Chunk(0, cpu), fshard.Replicated(cpu)),
        out_specs=fshard.Chunk(0, cpu),
    )  # fmt: skip
    rest = fshard.shard_map(
        _body, in_specs=(fshard.Chunk(0, where), *[fshard.Replicated(where)] * 2),
        out_specs=fshard.Partial(fshard.Replicated(where)),
    )  # fmt: skip

    def step(x: Any, *params: Any) -> Any:
        return rest(fshard.reshard(first(x, params[0]), fshard.Chunk(0, where)), *params[1:])

    return step


def _expected(style: str, steps: int = 2) -> list[list[torch.Tensor]]:
    """Each step's gradients of the whole batch in one process, as each rank holds them (its rows, fully sharded)."""
    out = []
    for k in range(steps):
        ws = [w.clone().requires_grad_() for w in _ws()]
        _body(_rows(k), *ws).backward()
        grads = [w.grad for w in ws]
        out.append([[g] * 4 if style.startswith("dp") else list(g.chunk(4)) for g in grads])
    return out


@needs_cuda
@pytest.mark.parametrize("style", ["dp", "dp-waitless", "dp-devices", "fsdp", "regather"])
def test_a_training_step_over_gloo_with_cuda_blocks_gives_the_dense_gradients(style):
    """Two steps (the second one reuses the buckets' buffers), each rank's gradients against one process's."""
    got = launch(_steps_over_gloo, 4, style, "cuda:0", timeout=300)
    for k, want in enumerate(_expected(style)):
        for rank, per_rank in enumerate(got):
            for g, w in zip(per_rank[k], want):
                torch.testing.assert_close(torch.from_numpy(g), w[rank], rtol=0, atol=1e-10)
