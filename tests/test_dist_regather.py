"""``shard_map(..., regather=True)`` on 4 Gloo processes: the same results, one more all-gather per block.

Each block of a fully-sharded model moves its ``Chunk(0)`` parameters to ``Replicated`` (one
all-gather); in the backward, with ``regather=True``, the block's parameters are gathered
again (one more all-gather, the forward's elements) and its gradients reduce-scattered (one
reduce-scatter) as soon as its backward is done. The results must be bit-identical to
keeping the gathered copies, and match the local backend within float32's tolerance.
"""

from __future__ import annotations

import pytest
import torch

import fshard
from fshard._exec import regather as _regather
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
ROWS, EVERYWHERE = fshard.Chunk(0, R), fshard.Replicated(R)
BLOCKS, D = 3, 8
PER_BLOCK = D * D + D  # elements of one block's parameters
SHARD = PER_BLOCK // len(R)


def _weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) * 0.5, torch.randn(D, generator=g)) for _ in range(BLOCKS)]


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(10 + rank))


def _block(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(torch.nn.functional.linear(torch.nn.functional.layer_norm(h, (D,)), w, b))


def _step(backend, x: fshard.ShardedArray, regather: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """The loss, each parameter's gradients here, and the collectives and elements of the forward and backward."""
    params = [(fshard.shard(w, ROWS, backend=backend), fshard.shard(b, ROWS, backend=backend)) for w, b in _weights()]
    leaves = [t.requires_grad_() for p in params for a in p for t in a.addressable_data]
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=regather)
    c = backend.counters
    start = (c.collectives, c.elements_sent)
    h = x
    for w, b in params:
        h = step(h, w, b)
    loss = fshard.gather(h).square().sum()
    middle = (c.collectives, c.elements_sent)
    again = _regather.regathers()
    loss.backward()
    moved = [middle[0] - start[0], middle[1] - start[1], c.collectives - middle[0], c.elements_sent - middle[1]]
    return loss.detach(), [t.grad for t in leaves], [*moved, _regather.regathers() - again]


def _on_rank(regather: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    backend = TorchDistBackend()
    x = fshard.from_local_tensor(_rows(backend.rank).requires_grad_(), dim=0)
    return _step(backend, x, regather)


def _local() -> tuple[torch.Tensor, list[torch.Tensor]]:
    backend = LocalBackend(world_size=4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]).requires_grad_(), ROWS, backend=backend)
    loss, grads, _ = _step(backend, x, True)
    return loss, grads


def test_regather_on_gloo_is_bit_identical_and_matches_the_local_backend(dist_pool):
    kept = dist_pool.run(_on_rank, False, timeout=120)
    again = dist_pool.run(_on_rank, True, timeout=120)
    want_loss, want_grads = _local()
    for rank, ((loss0, grads0, _), (loss1, grads1, _)) in enumerate(zip(kept, again)):
        assert torch.equal(loss0, loss1)
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
        torch.testing.assert_close(loss1, want_loss)
        for got, want in zip(grads1, want_grads[rank :: len(R)]):  # the local backend holds every rank's shard
            torch.testing.assert_close(got, want)


def test_regather_sends_one_more_all_gather_per_block(dist_pool):
    """Per block and rank: forward an all-gather (3 x its shard), backward one more and a reduce-scatter."""
    kept = dist_pool.run(_on_rank, False, timeout=120)
    again = dist_pool.run(_on_rank, True, timeout=120)
    for (_, _, k), (_, _, a) in zip(kept, again):
        fwd_runs, fwd_sent, back_runs, back_sent, regathers = a
        assert (fwd_runs, fwd_sent) == (k[0], k[1])
        assert fwd_sent == BLOCKS * 3 * SHARD + 3 * 2 * D  # the blocks' all-gathers and the loss's gather of h
        assert regathers == BLOCKS
        assert k[4] == 0
        assert back_runs == k[2] + BLOCKS
        assert back_sent == k[3] + BLOCKS * 3 * SHARD
        assert k[3] == BLOCKS * 3 * SHARD  # without: one reduce-scatter per block, nothing else
