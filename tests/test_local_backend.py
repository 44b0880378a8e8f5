"""The local backend's counters: the elements a multi-process run would send, for every movement."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import fshard
from fshard.backends.local import LOCAL

X = torch.arange(16.0).reshape(8, 2)
ROWS = fshard.Chunk(0, [0, 1, 2, 3])


def sent(fn: Callable[[], object]) -> int:
    """Elements the local backend counts as sent while ``fn`` runs."""
    before = LOCAL.counters.elements_sent
    fn()
    return LOCAL.counters.elements_sent - before


@pytest.mark.parametrize(
    ("spec", "dst", "expected"),
    [
        (ROWS, None, 3 * 16),  # every rank receives the 12 elements it lacks
        (ROWS, 1, 12),
        (fshard.Replicated([0, 1]), None, 0),
        (fshard.Replicated([0, 1]), 1, 0),
        (fshard.Replicated([0, 1]), 2, 16),  # a rank outside the layout receives everything
        (fshard.Explicit([((0, 0), (4, 2), 0), ((4, 0), (4, 2), 0), ((0, 0), (4, 2), 1), ((4, 0), (4, 2), 2)]), 1, 8),
        (fshard.Explicit([((0, 0), (4, 2), 0), ((4, 0), (4, 2), 0), ((0, 0), (4, 2), 1)]), None, 8),
    ],
    ids=["rows-to-all", "rows-to-1", "replicas-to-all", "replicas-to-1", "replicas-to-2", "replica-on-dst", "two-on-0"],
)
def test_gather_counts_what_the_receivers_lack(spec, dst, expected) -> None:
    a = fshard.shard(X, spec)
    assert sent(lambda: fshard.gather(a, dst=dst)) == expected


@pytest.mark.parametrize(
    ("spec", "src", "expected"),
    [(ROWS, 0, 12), (ROWS, 3, 12), (fshard.Replicated([0, 1, 2]), 0, 32), (fshard.Single(2), 2, 0), (ROWS, None, 0)],
)
def test_shard_from_one_rank_counts_what_the_others_receive(spec, src, expected) -> None:
    assert sent(lambda: fshard.shard(X, spec, src=src)) == expected


def test_reshard_counts_the_plans_elements() -> None:
    a = fshard.shard(X, ROWS)
    target = fshard.Chunk(1, [0, 1])
    assert sent(lambda: fshard.reshard(a, target)) == fshard.plan(a.layout, target.layout(X.shape)).elements_sent == 12
