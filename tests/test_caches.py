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


def test_a_layout_that_many_entries_hold_is_charged_once():
    # One source planned to six destinations: seven layouts held, each counted once (per entry, the
    # source would count six times), plus the plans' own small arrays.
    fshard.clear_caches()
    ranks = list(range(2000))
    shape = (8000, 8)
    src = fshard.Chunk(0, ranks).layout(shape)
    per = src.__fshard_nbytes__()
    for k in range(1, 7):
        fshard.plan(src, fshard.Chunk(0, ranks[k:] + ranks[:k]).layout(shape))
    assert 7 * per <= _cache.cache_bytes() < 7.1 * per
    fshard.clear_caches()
    assert not _cache._COUNTED  # emptied caches forget what they counted: the next entries count it again
    fshard.plan(src, fshard.Chunk(0, ranks[1:] + ranks[:1]).layout(shape))
    assert _cache.cache_bytes() >= 2 * per


def test_only_the_entries_the_lru_drops_are_subtracted():
    import numpy as np

    def block(n: int) -> np.ndarray:
        return np.zeros(n)

    memo = _cache.cached(2)(block)
    entry = _cache._REGISTRY[-1]
    try:
        memo(1000)
        one = entry.bytes
        memo(1000 + 1)  # the lru keeps both: both counted
        assert entry.bytes == 2 * one + 8
        memo(1000 + 2)  # the lru drops the first to keep this one: one entry's average out, the new one in
        assert memo.cache_info().currsize == 2
        assert entry.bytes == (2 * one + 8) - (2 * one + 8) // 2 + one + 16
        memo(1000 + 2)  # a hit: nothing charged
        assert entry.bytes == (2 * one + 8) - (2 * one + 8) // 2 + one + 16
    finally:
        _cache._REGISTRY.remove(entry)


def test_layouts_made_per_call_are_made_once():
    # A sum's layout and a creation's on a device are O(world) to build: made once per layout,
    # not at every call (at 4,096 ranks each took 15-19 ms).
    x = fshard.shard(torch.arange(12.0).reshape(4, 3), fshard.Chunk(0, [0, 1]))
    assert x.sum(1).layout is x.sum(1).layout  # no summed dim split: the boxes projected
    assert x.sum(0).layout is x.sum(0).layout  # a pending sum
    spec = fshard.Chunk(0, [0, 1])
    assert fshard.zeros(spec, (4, 3), device="cpu").layout is fshard.zeros(spec, (4, 3), device="cpu").layout


def test_a_layout_stays_counted_while_another_cache_holds_it():
    # The entry that first counted a layout leaves its lru; a plan still holds the layout, so it stays counted
    # (it is counted while it lives), and it leaves the count when it dies.
    import gc

    fshard.clear_caches()
    ranks = list(range(2000))
    src = fshard.Chunk(0, ranks).layout((8000, 8))
    per = src.__fshard_nbytes__()
    memo = _cache.cached(1)(lambda layout: layout.numel)
    entry = _cache._REGISTRY[-1]
    try:
        memo(src)  # counts src
        dst = fshard.Chunk(0, ranks[1:] + ranks[:1]).layout((8000, 8))
        fshard.plan(src, dst)  # holds src too
        memo(dst)  # the lru of one drops src's entry
        assert _cache.cache_bytes() >= 2 * per
        fshard.clear_caches()
        memo(src)
        counted = _cache.cache_bytes()
        assert counted >= per
        memo.cache_clear()
        del src
        gc.collect()
        assert _cache.cache_bytes() <= counted - per
    finally:
        _cache._REGISTRY.remove(entry)
        fshard.clear_caches()
