"""``torch.utils.checkpoint`` (``use_reentrant=False``) around fshard calls on 3 of 4 Gloo processes.

The checkpoint recomputes its region in the backward when the first tensor saved there is
read. Rank 3 holds no block of the region's arrays: its movements' nodes save one tensor
each under the checkpoint and read it first in their backward, so rank 3 recomputes the
region (and its collectives) where the others do, instead of every rank waiting. Gradients
equal the dense float64 ones on both backends.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fshard

pytestmark = pytest.mark.multiprocess

R3 = [0, 1, 2]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, dtype=torch.float64, generator=g), torch.randn(6, 3, dtype=torch.float64, generator=g)


def _region(kind: str):
    """A region of fshard calls over ranks 0-2, and its dense form."""
    if kind == "gather":
        rows = fshard.shard_map(
            lambda a, b: a @ b, (fshard.Chunk(1, R3), fshard.Chunk(0, R3)), fshard.Partial(fshard.Replicated(R3))
        )
        return (lambda a, b: fshard.gather(rows(a, b))), (lambda a, b: a @ b)
    if kind == "psum":
        summed = fshard.shard_map(
            lambda a, b: torch.tanh(fshard.psum(a @ b, "x")),
            (fshard.Chunk(1, R3), fshard.Chunk(0, R3)),
            fshard.Replicated(R3),
            check_vma=False,
        )
        return (lambda a, b: fshard.gather(summed(a, b))), (lambda a, b: torch.tanh(a @ b))
    partial = fshard.shard_map(
        lambda a, b: a @ b, (fshard.Chunk(1, R3), fshard.Chunk(0, R3)), fshard.Partial(fshard.Replicated(R3))
    )

    def moved(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = fshard.reshard(partial(a, b), fshard.Chunk(0, [1, 2]))
        return fshard.gather(fshard.map_local(torch.sin, y) * y)

    return moved, (lambda a, b: torch.sin(a @ b) * (a @ b))


def _checkpointed(kind: str) -> list[bool]:
    """Whether the gradients through the checkpointed region equal the dense ones (float64 rounding)."""
    region, dense = _region(kind)
    x, w = (t.clone().requires_grad_() for t in _inputs())
    checkpoint(region, x, w, use_reentrant=False).pow(2).sum().backward()
    xd, wd = (t.clone().requires_grad_() for t in _inputs())
    dense(xd, wd).pow(2).sum().backward()
    return [
        torch.allclose(x.grad, xd.grad, rtol=1e-12, atol=1e-12),
        torch.allclose(w.grad, wd.grad, rtol=1e-12, atol=1e-12),
    ]


@pytest.mark.parametrize("kind", ["gather", "psum", "reshard"])
def test_a_checkpointed_region_that_some_ranks_hold_no_block_of_recomputes_on_every_rank(dist_pool, kind):
    assert _checkpointed(kind) == [True, True]  # the local backend
    assert dist_pool.run(_checkpointed, kind, timeout=90) == [[True, True]] * 4
