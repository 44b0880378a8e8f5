"""``fshard.backward``: the backward from a pending loss, the loss carried by the last bucket (4 Gloo processes).

A data-parallel loss, a ``Partial`` sum of one summand per rank, needs no collective of its
own: each rank backpropagates its summand, and the last bucket of the parameters' gradients
sums the loss with them. Where no bucket can carry it, the loss is gathered after the
backward. Either way the values and gradients are those of ``gather(loss).backward()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

R = [0, 1, 2, 3]
D = 6


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5).to(dtype) for _ in range(3)]


def _rows(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64).to(dtype)


def _body(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    for w in ws:
        x = torch.tanh(x @ w)
    return (x.double() ** 2).sum()[None]  # a float64 loss, whatever the parameters' dtype


def _step(how: str, spec: str, dtype: torch.dtype, backend) -> tuple[torch.Tensor, list[torch.Tensor], int, int]:
    """One step's loss, gradients, collectives and elements sent: ``fshard.backward`` or ``gather`` then backward."""
    layout = fshard.Replicated(R) if spec == "replicated" else fshard.Chunk(0, R)
    params = [fshard.shard(w, layout, backend=backend) for w in _weights(dtype)]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    if backend.spans_processes:
        x = fshard.from_local_tensor(_rows(backend.rank, dtype), dim=0)
    else:
        x = fshard.shard(torch.cat([_rows(r, dtype) for r in R]), fshard.Chunk(0, R), backend=backend)
    rep = fshard.Replicated(R)
    loss_of = fshard.shard_map(_body, in_specs=(fshard.Chunk(0, R), *[rep] * 3), out_specs=fshard.Partial(rep))
    counters = backend.counters
    before = (counters.collectives, counters.elements_sent)
    total = loss_of(x, *params) / 12
    if how == "backward":
        value = fshard.backward(total)
    else:
        value = fshard.gather(total)
        value.backward()
        value = value.detach()
    return value, [t.grad for t in leaves], counters.collectives - before[0], counters.elements_sent - before[1]


def _both(spec: str, dtype: torch.dtype) -> tuple[tuple, tuple, int]:
    """Each way's step, and the elements that a gather of a loss like that sends alone."""
    backend = TorchDistBackend()
    ones = fshard.from_local_tensor(torch.ones(1, dtype=torch.float64), dim=0)
    loss = fshard.shard_map(
        lambda b: b.sum()[None], in_specs=(fshard.Chunk(0, R),), out_specs=fshard.Partial(fshard.Replicated(R))
    )(ones)  # a summand on each rank, as the steps' losses
    before = backend.counters.elements_sent
    fshard.gather(loss)
    alone = backend.counters.elements_sent - before
    return _step("backward", spec, dtype, backend), _step("gather", spec, dtype, backend), alone


@pytest.mark.multiprocess
def test_the_last_bucket_carries_a_data_parallel_loss(dist_pool):
    local = _step("gather", "replicated", torch.float64, LocalBackend(world_size=4))
    for (value, grads, runs, sent), (value_g, grads_g, runs_g, sent_g), alone in dist_pool.run(
        _both, "replicated", torch.float64, timeout=120
    ):
        torch.testing.assert_close(value, value_g, rtol=0, atol=1e-12)
        torch.testing.assert_close(value, local[0], rtol=0, atol=1e-12)
        assert (value.dtype, value.shape) == (torch.float64, (1,))
        for got, want, on_one in zip(grads, grads_g, local[1][::4]):
            assert torch.equal(got, want)  # the same backward: each summand's gradient is 1/12 either way
            torch.testing.assert_close(got, on_one, rtol=0, atol=1e-12)
        assert runs_g - runs == 1  # the loss's gather: gone
        assert sent_g - sent == alone > 0  # and its elements


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("spec", "dtype"),
    [("chunk", torch.float64), ("replicated", torch.float32)],
    ids=["reduce-scattered gradients", "buckets of float32 and a float64 loss"],
)
def test_a_loss_no_bucket_carries_is_gathered_after_the_backward(dist_pool, spec, dtype):
    for (value, grads, runs, _), (value_g, grads_g, runs_g, _), _ in dist_pool.run(_both, spec, dtype, timeout=120):
        assert torch.equal(value, value_g)  # the same gather, after the backward
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_g))
        assert runs == runs_g


def _empty_summands(how: str) -> tuple[list[float], list[float]]:
    """A loss whose one summand is rank 0's, the other ranks' boxes empty (``Partial(Chunk(0))``)."""
    w = fshard.shard(torch.arange(4.0, dtype=torch.float64), fshard.Replicated(R))
    (leaf,) = [t.requires_grad_() for t in w.addressable_data]
    first = dist.get_rank() == 0
    f = fshard.shard_map(
        lambda b: (b * b).sum()[None][: 1 if first else 0],
        in_specs=(fshard.Replicated(R),),
        out_specs=fshard.Partial(fshard.Chunk(0, R)),
    )
    if how == "backward":
        value = fshard.backward(f(w))
    else:
        value = fshard.gather(f(w))
        value.backward()
    return value.tolist(), leaf.grad.tolist()


@pytest.mark.multiprocess
def test_a_loss_whose_summands_are_not_one_whole_per_rank_is_gathered(dist_pool):
    got = dist_pool.run(_empty_summands, "backward", timeout=60)
    assert got == dist_pool.run(_empty_summands, "gather", timeout=60)
    assert got[0] == ([14.0], [0.0, 2.0, 4.0, 6.0])


def test_on_one_process_it_is_gather_and_backward():
    backend = LocalBackend(world_size=4)
    value, grads, _, _ = _step("backward", "replicated", torch.float64, backend)
    value_g, grads_g, _, _ = _step("gather", "replicated", torch.float64, backend)
    assert torch.equal(value, value_g)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_g))


def test_backward_refuses_what_is_not_a_loss_array():
    with pytest.raises(TypeError, match="takes a ShardedArray"):
        fshard.backward(torch.ones(1, requires_grad=True))
    two = fshard.shard(torch.ones(2, requires_grad=True), fshard.Chunk(0, [0, 1]))
    with pytest.raises(fshard.SpecError, match=r"one element \(a loss\), got shape \(2,\)"):
        fshard.backward(two)
    without_grad = fshard.shard(torch.ones(1), fshard.Replicated([0, 1]))
    with pytest.raises(fshard.SpecError, match="requires grad"):
        fshard.backward(without_grad)
    complex_loss = fshard.shard(torch.ones(1, dtype=torch.complex64, requires_grad=True), fshard.Replicated([0, 1]))
    with pytest.raises(fshard.SpecError, match=r"takes a real loss, got torch\.complex64"):
        fshard.backward(complex_loss)


def _under_no_grad(summands: str, backend: Any = None) -> tuple[list[float], list[float]]:
    """``fshard.backward`` called under ``torch.no_grad()``: the loss carried by the buckets ("whole" summands
    across processes), or gathered first (a summand in rank 0's box only, or one process)."""
    backend = TorchDistBackend() if backend is None else backend
    w = fshard.shard(torch.arange(4.0, dtype=torch.float64), fshard.Replicated(R), backend=backend)
    leaves = [t.requires_grad_() for t in w.addressable_data]
    keep = 1 if summands == "whole" or not backend.spans_processes or backend.rank == 0 else 0
    out = fshard.Partial(fshard.Replicated(R) if summands == "whole" else fshard.Chunk(0, R))
    loss = fshard.shard_map(lambda b: (b * b).sum()[None][:keep], in_specs=(fshard.Replicated(R),), out_specs=out)(w)
    with torch.no_grad():
        value = fshard.backward(loss)
    return value.tolist(), leaves[0].grad.tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize("summands", ["whole", "empty"])
def test_backward_runs_under_no_grad_as_torchs_does(dist_pool, summands):
    want = ([56.0], [0.0, 8.0, 16.0, 24.0]) if summands == "whole" else ([14.0], [0.0, 2.0, 4.0, 6.0])
    assert dist_pool.run(_under_no_grad, summands, timeout=60) == [want] * 4
    if summands == "whole":  # in one process: gathered first, alike
        assert _under_no_grad(summands, LocalBackend(world_size=4)) == want
