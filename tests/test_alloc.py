"""The output pool (``fshard._base.alloc``): recycled CPU blocks of every plain dtype, returned
exactly when the last tensor or view of them dies, within the pool's byte limit."""

from __future__ import annotations

import gc

import pytest
import torch

from fshard._base import alloc as _alloc
from fshard._base.alloc import POOL_MIN_BYTES, _Pool

SHAPE = (512, 1024)  # 2 MiB at 4 bytes an element: above POOL_MIN_BYTES for every dtype of 2 bytes or more


@pytest.mark.parametrize("dtype", sorted(_alloc._PLAIN, key=str))
def test_every_plain_dtype_gets_an_aligned_contiguous_block(dtype: torch.dtype) -> None:
    pool = _Pool()
    shape = (1024, 1024) if dtype.itemsize == 1 else SHAPE
    t = pool.empty(shape, dtype)
    assert (t.dtype, tuple(t.shape), t.is_contiguous()) == (dtype, shape, True)
    assert t.data_ptr() % 64 == 0
    t.fill_(1)
    assert bool((t == 1).all())
    address = t.data_ptr()
    del t
    again = pool.empty(shape, dtype)
    assert again.data_ptr() == address  # the dead block came back


def test_a_view_keeps_the_block_out_of_the_pool() -> None:
    pool = _Pool()
    t = pool.empty(SHAPE, torch.float32)
    address = t.data_ptr()
    view = t[1:, ::2]
    del t
    gc.collect()
    other = pool.empty(SHAPE, torch.float32)
    assert other.data_ptr() != address  # the view still uses it
    del view
    assert pool.empty(SHAPE, torch.float32).data_ptr() == address


def test_small_and_unusual_dtypes_bypass_the_pool() -> None:
    pool = _Pool()
    small = pool.empty((16,), torch.float32)
    assert small.numel() * 4 < POOL_MIN_BYTES
    del small
    unusual = pool.empty(SHAPE, torch.uint16) if hasattr(torch, "uint16") else None
    if unusual is not None:
        assert unusual.dtype == torch.uint16
        del unusual
    assert pool._free == {}
    assert pool._live == {}


def test_the_limit_caps_what_the_pool_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _Pool()
    monkeypatch.setattr(_alloc, "POOL_LIMIT_BYTES", 3 << 20)
    a, b = pool.empty(SHAPE, torch.float32), pool.empty(SHAPE, torch.float32)
    del a, b  # 2 MiB each: only the first fits under 3 MiB
    assert pool._cached == 2 << 20
    assert sum(len(v) for v in pool._free.values()) == 1
    assert pool._live == {}


def test_clear_drops_free_blocks_and_live_ones_come_back_later() -> None:
    pool = _Pool()
    live = pool.empty(SHAPE, torch.float32)
    dead = pool.empty(SHAPE, torch.float32)
    del dead
    pool.clear()
    assert pool._free == {}
    assert pool._cached == 0
    address = live.data_ptr()
    del live
    assert pool.empty(SHAPE, torch.float32).data_ptr() == address
