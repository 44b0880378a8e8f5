"""Mixed precision across 4 Gloo processes: the bytes on the wire, and the local backend's gradients.

A training step's ``shard_map`` with ``Precision(param=bf16, reduce=fp32)``:

- fully sharded (parameters in dim-0 chunks): a bf16 all-gather forward, an fp32
  reduce-scatter backward. Under Gloo the reduce-scatter is a packed all-to-all and a local
  sum in the local backend's order, so the gradients equal the local backend's bit for bit;
- data parallel (parameters replicated): the copies' gradients summed in fp32 buckets by a
  native ``all_reduce``, whose order is Gloo's: equal to the local backend's within twice the
  fp32 summation bound of docs/training.md ("Mixed precision").
"""

from __future__ import annotations

import pytest
import torch

import fshard
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
MIXED = fshard.Precision(param=torch.bfloat16, reduce=torch.float32)
SHAPES = [(8, 6), (6, 6), (6, 4)]  # 108 elements; dim-0 chunks of 2 rows (rank 3 holds none of the last two)


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(10 + rank))


def _body(xb: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    h = xb.to(ws[0].dtype)
    for w in ws:
        h = torch.tanh(h @ w)
    return h.float().pow(2).sum()[None]


def _step(style: str, backend, x) -> tuple[list[torch.Tensor], tuple[int, int], tuple[int, int]]:
    """This process's parameter gradients, and (elements, bytes) sent forward and backward."""
    spec = fshard.Chunk(0, R) if style == "fsdp" else fshard.Replicated(R)
    params = [fshard.shard(w, spec, backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep = fshard.Replicated(R)
    step = fshard.shard_map(
        _body, in_specs=(fshard.Chunk(0, R), *[rep] * 3), out_specs=fshard.Partial(rep), precision=(None, *[MIXED] * 3)
    )
    c = backend.counters
    before = (c.elements_sent, c.bytes_sent)
    partial = step(x, *params)
    middle = (c.elements_sent, c.bytes_sent)
    torch.autograd.backward([t.sum() for t in partial.addressable_data])  # every rank's summand, nothing gathered
    after = (c.elements_sent, c.bytes_sent)
    forward = (middle[0] - before[0], middle[1] - before[1])
    backward = (after[0] - middle[0], after[1] - middle[1])
    return [t.grad for t in leaves], forward, backward


def _on_rank(style: str):
    backend = TorchDistBackend()
    return _step(style, backend, fshard.from_local_tensor(_rows(backend.rank), dim=0))


def _local(style: str):
    backend = LocalBackend(world_size=4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=backend)
    return _step(style, backend, x)


def test_fully_sharded_mixed_precision_sends_bf16_then_fp32_and_equals_the_local_backend(dist_pool):
    """Forward, each of the 108 elements reaches the 3 ranks that lack it, 2 bytes each.

    Backward, as many summands go back, 4 bytes each.
    """
    local_grads, local_fwd, local_bwd = _local("fsdp")
    results = dist_pool.run(_on_rank, "fsdp", timeout=120)
    assert sum(f[0] for _, f, _ in results) == local_fwd[0] == 3 * sum(a * b for a, b in SHAPES)
    assert sum(f[1] for _, f, _ in results) == local_fwd[1] == 2 * local_fwd[0]  # bf16 on the wire
    assert sum(b[1] for _, _, b in results) == local_bwd[1] == 4 * local_bwd[0]  # fp32 on the wire
    assert sum(b[0] for _, _, b in results) == local_bwd[0] == local_fwd[0]
    for rank, (grads, _, _) in enumerate(results):
        mine = local_grads[rank::4]
        assert [g.dtype for g in grads] == [torch.float32] * 3
        for got, want in zip(grads, mine):
            assert torch.equal(got, want)


def test_data_parallel_mixed_precision_sums_fp32_buckets_within_the_documented_bound(dist_pool):
    local_grads, _, _ = _local("dp")
    results = dist_pool.run(_on_rank, "dp", timeout=120)
    u, n = 2.0**-24, 4
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    magnitude = [_summand_magnitude(k) for k in range(3)]
    for grads, forward, backward in results:
        assert forward == (0, 0)  # replicated parameters stay: a cast on each rank, nothing sent
        assert backward[1] == 4 * backward[0] > 0  # the buckets send fp32
        for k, got in enumerate(grads):
            want = local_grads[4 * k]
            assert got.dtype == torch.float32
            assert bool(((got - want).abs() <= 2 * gamma * magnitude[k]).all())


def _summand_magnitude(k: int) -> torch.Tensor:
    """``sum_r |g_r|`` for weight ``k``: each rank's bf16 gradient of its own rows, as fp32."""
    total = torch.zeros(SHAPES[k])
    for r in R:
        ws = [w.to(torch.bfloat16).requires_grad_() for w in _weights()]
        (g,) = torch.autograd.grad(_body(_rows(r), *ws).sum(), ws[k])
        total += g.float().abs()
    return total
