"""Caches of plans, schedules and layout indexes: bounded by bytes, and emptied on request."""

from __future__ import annotations

import torch

import fshard
import fshard.backends._execution  # registers its device cache
from fshard._base import cache as _cache


def _layouts(n: int, k: int) -> tuple[fshard.Layout, fshard.Layout]:
    ranks = list(range(k, k + n))
    shape = (n * 4, 8)
    return fshard.Chunk(0, ranks).layout(shape), fshard.Chunk(1, ranks[::-1]).layout(shape)


def test_distinct_large_layouts_stay_within_the_byte_budget(monkeypatch):
    fshard.clear_caches()
    monkeypatch.setattr(_cache, "CACHE_LIMIT_BYTES", 4 << 20)
    for k in range(12):
        src, dst = _layouts(2000, k)
        p = fshard.plan(src, dst)
        assert p.elements_sent == p.min_elements_sent
        assert _cache.cache_bytes() <= 4 << 20
    assert _cache.cache_bytes() > 0


def test_clear_caches_empties_every_cache_and_results_stay_the_same():
    x = fshard.shard(torch.arange(64.0).reshape(8, 8), fshard.Chunk(0, [0, 1, 2, 3]))
    before = fshard.gather(fshard.reshard(x, fshard.Chunk(1, [0, 1, 2, 3])))
    assert _cache.cache_bytes() > 0
    fshard.clear_caches()
    assert _cache.cache_bytes() == 0
    assert all(c.fn.cache_info().currsize == 0 for c in _cache._REGISTRY)
    after = fshard.gather(fshard.reshard(x, fshard.Chunk(1, [0, 1, 2, 3])))
    assert torch.equal(before, after)


def test_every_cache_of_a_layout_function_is_registered():
    names = {c.name for c in _cache._REGISTRY}
    expected = {
        "fshard._plan._plan",
        "fshard._plan.schedule.schedule",
        "fshard._layout.index.index",
        "fshard._layout.validate.validate_memo",
        "fshard._layout.specs._resolved",
        "fshard._exec.autograd._copy_counts",
        "fshard.backends._execution.device_of",
        "fshard._layout.batch.with_batch",
    }
    assert expected <= names
