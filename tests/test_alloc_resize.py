"""Outputs from the pool (1 MiB and more) are ordinary torch tensors: their storage
resizes like that of any other tensor, and a block resized or still in use is never
handed out again while it is."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import fshard
from fshard._base.alloc import POOL_MIN_BYTES, _Pool

ROWS, COLS = 512, 1024  # float32: 2 MiB in all, 1 MiB per half
X = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS)


def _outputs() -> dict[str, torch.Tensor]:
    """A reshard's and a gather's output of 1 MiB or more (from the pool)."""
    halves = fshard.shard(X, fshard.Chunk(0, [0, 1]))
    whole = fshard.reshard(halves, fshard.Replicated([0])).addressable_shards[0].data
    gathered = fshard.gather(fshard.reshard(halves, fshard.Chunk(1, [0, 1])))
    assert whole.nbytes >= POOL_MIN_BYTES
    assert gathered.nbytes >= POOL_MIN_BYTES
    return {"reshard": whole, "gather": gathered}


@pytest.mark.parametrize("op", ["reshard", "gather"])
def test_storage_resize_to_zero(op: str) -> None:
    t = _outputs()[op]
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("op", ["reshard", "gather"])
def test_resize_to_a_bigger_shape_keeps_the_values(op: str) -> None:
    t = _outputs()[op]
    t.resize_(2 * ROWS, COLS)
    assert tuple(t.shape) == (2 * ROWS, COLS)
    assert torch.equal(t[:ROWS], X)


@pytest.mark.parametrize("op", ["reshard", "gather"])
def test_out_grows_the_output(op: str) -> None:
    t = _outputs()[op]
    t.resize_(0)  # torch's way to reuse an out= tensor of another shape
    torch.add(torch.ones(2 * ROWS, COLS), 1, out=t)
    assert tuple(t.shape) == (2 * ROWS, COLS)
    assert bool((t == 2).all())


def test_a_resized_block_is_not_handed_out_again() -> None:
    pool = _Pool()
    t = pool.empty((ROWS, COLS), torch.float32)
    t.untyped_storage().resize_(0)
    del t
    again = pool.empty((ROWS, COLS), torch.float32)
    assert again.untyped_storage().nbytes() == ROWS * COLS * 4
    again.fill_(3.0)  # the memory is there to write
    assert bool((again == 3.0).all())
    assert pool._free == {}


def test_a_storage_held_alone_keeps_its_block() -> None:
    pool = _Pool()
    t = pool.empty((ROWS, COLS), torch.float32)
    t.fill_(5.0)
    storage = t.untyped_storage()
    address = t.data_ptr()
    del t
    gc.collect()
    other = pool.empty((ROWS, COLS), torch.float32)
    assert other.data_ptr() != address  # the storage still uses the block
    other.fill_(7.0)
    kept = torch.empty(0).set_(storage, 0, (ROWS, COLS))
    assert bool((kept == 5.0).all())
    del kept, storage
    assert pool.empty((ROWS, COLS), torch.float32).data_ptr() == address  # found once nothing uses it


def test_threads_never_share_a_live_block() -> None:
    pool = _Pool()
    bad: list[tuple[int, int]] = []

    def work(k: int) -> None:
        kept = []
        for step in range(200):
            t = pool.empty((ROWS // 2, COLS), torch.float32).fill_(float(k))
            kept = [*kept[-2:], t]  # a few alive at a time, the rest die and come back
            if not all(bool((x == k).all()) for x in kept):
                bad.append((k, step))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert bad == []
    assert not any(th.is_alive() for th in threads)


def _dist_outputs_resize() -> list[tuple[int, int]]:
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    big = torch.arange(float(1024 * COLS)).reshape(1024, COLS)  # 4 MiB; 1 MiB per rank's row chunk
    rows = fshard.shard(big, fshard.Chunk(0, ranks))
    outs = [
        fshard.reshard(rows, fshard.Chunk(1, ranks)).addressable_shards[0].data,
        fshard.reshard(rows, fshard.Replicated(ranks)).addressable_shards[0].data,
        fshard.gather(fshard.reshard(rows, fshard.Chunk(1, ranks))),
    ]
    sizes = []
    for t in outs:
        assert t.nbytes >= POOL_MIN_BYTES
        n = t.numel()
        t.resize_(2 * n)  # grows: new memory, the values kept
        t.untyped_storage().resize_(0)
        sizes.append((n, t.untyped_storage().nbytes()))
    return sizes


@pytest.mark.multiprocess
def test_torch_dist_outputs_resize(dist_pool) -> None:
    n = 1024 * COLS
    want = [(n // 4, 0), (n, 0), (n, 0)]
    assert dist_pool.run(_dist_outputs_resize, timeout=60) == [want] * 4
