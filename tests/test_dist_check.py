"""Check mode: ranks that call collectives differently raise CollectiveMismatchError, not hang."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

RANKS = [0, 1, 2, 3]
X = torch.arange(96.0).reshape(8, 12)


def _checked(fn, *args, **kwargs):
    """Runs ``fn(*args, **kwargs)`` in check mode; returns the CollectiveMismatchError message (or None)."""
    old = fshard.config(check_collectives=True)
    try:
        fn(*args, **kwargs)
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        fshard.config(check_collectives=old.check_collectives)
    return None


def _different_reshards():
    a = fshard.shard(X, fshard.Chunk(0, RANKS))
    spec = fshard.Chunk(1, RANKS) if dist.get_rank() < 2 else fshard.Chunk(0, [3, 2, 1, 0])
    return _checked(fshard.reshard, a, spec)


def _gather_versus_reshard():
    a = fshard.shard(X, fshard.Chunk(0, RANKS))
    if dist.get_rank() == 3:
        return _checked(fshard.gather, a)
    return _checked(fshard.reshard, a, fshard.Chunk(1, RANKS))


def _different_shard_specs():
    """torch's "does not match with sharding_spec": shard(src=None) itself sends nothing."""
    rank = dist.get_rank()
    spec = fshard.Chunk(0, [rank, *[r for r in RANKS if r != rank]])
    return _checked(fshard.shard, X, spec)


def _different_dtypes():
    a = fshard.shard(X.to(torch.float64 if dist.get_rank() == 0 else torch.float32), fshard.Chunk(0, RANKS))
    return _checked(fshard.gather, a, dst=1)


def _different_dst():
    a = fshard.shard(X, fshard.Chunk(0, RANKS))
    return _checked(fshard.gather, a, dst=dist.get_rank() % 2)


CASES = {
    "reshard-to-different-specs": (_different_reshards, [[0, 1], [2, 3]]),
    "gather-versus-reshard": (_gather_versus_reshard, [[0, 1, 2], [3]]),
    "shard-with-different-specs": (_different_shard_specs, [[0], [1], [2], [3]]),
    "different-dtypes": (_different_dtypes, [[0], [1, 2, 3]]),
    "gather-to-different-dst": (_different_dst, [[0, 2], [1, 3]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_on_every_rank_naming_the_ranks(dist_pool, case):
    fn, groups = CASES[case]
    messages = dist_pool.run(fn)
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, "every rank raises the same error"
    assert "Ranks called different collectives on process group [0, 1, 2, 3]" in messages[0]
    for ranks in groups:
        assert f"ranks {ranks} called" in messages[0]


def _matching_calls_pass_and_cost_one_gather():
    a = fshard.shard(X, fshard.Chunk(0, RANKS))
    c = TorchDistBackend().counters
    before = (c.elements_sent, c.collectives)
    assert _checked(lambda: fshard.equal(fshard.reshard(a, fshard.Chunk(1, RANKS)), a)) is None
    assert _checked(lambda: torch.equal(fshard.gather(a), X) or 1 / 0) is None
    return c.elements_sent - before[0], c.collectives - before[1]


def test_matching_calls_pass_in_check_mode(dist_pool):
    out = dist_pool.run(_matching_calls_pass_and_cost_one_gather)
    # Check-mode gathers are not counted: reshard, equal's reshard back and its exchange, gather.
    assert [r for _, r in out] == [4] * 4


def _sub_group_mismatch():
    pg = dist.new_group([1, 2, 3])
    if dist.get_rank() == 0:
        return None
    backend = TorchDistBackend(pg)
    a = fshard.shard(X, fshard.Chunk(0, [1, 2, 3]), backend=backend)
    return _checked(fshard.gather, a, dst=1 if dist.get_rank() == 1 else 2)


def test_mismatch_on_a_sub_group(dist_pool):
    messages = dist_pool.run(_sub_group_mismatch)
    assert messages[0] is None
    assert len(set(messages[1:])) == 1
    assert re.search(r"process group \[1, 2, 3\]: ranks \[1\] called gather\(array=.*, dst=1\)", messages[1])
    assert re.search(r"ranks \[2, 3\] called gather\(array=.*, dst=2\)", messages[1])
