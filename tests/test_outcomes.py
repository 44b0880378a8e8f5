"""Results of per-shard functions on processes that hold no shard, and errors that one
process hits: on 4 Gloo processes every rank learns the result's dtype and shape, or
every rank raises; on the local backend the same programs give the same answers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard import LayoutError, SpecError

ON_TWO = fshard.Chunk(0, [1, 2])  # ranks 0 and 3 hold nothing


def _x() -> fshard.ShardedArray:
    return fshard.shard(torch.arange(8.0).reshape(4, 2), ON_TWO)


def _dtype_and_shape() -> list[object]:
    x = _x()
    y = fshard.map_local(lambda t: t > 2, x)
    z = fshard.map_local(lambda t: torch.cat([t, t], 1).to(torch.float16), x)
    w = fshard.shard_map(lambda t: t.sum(1, keepdim=True).int(), ON_TWO, ON_TWO)(x)
    return [(a.dtype, a.shape, fshard.gather(a).tolist()) for a in (y, z, w)]


def _fn_fails_on_rank(bad: int):
    def fn(t: torch.Tensor) -> torch.Tensor:
        if (dist.is_initialized() and dist.get_rank() == bad) or (not dist.is_initialized() and t[0, 0] == 4):
            raise ValueError("fn refused this block")
        return t + 1

    try:
        fshard.map_local(fn, _x())
    except ValueError as exc:
        return type(exc).__name__, str(exc), exc.__notes__ if hasattr(exc, "__notes__") else []
    return None


def _shards_of(layout: fshard.Layout, rank: int | None, dtype: torch.dtype) -> list[fshard.Shard]:
    metas = layout.shards if rank is None else layout.shards_on(rank)
    return [fshard.Shard(m, torch.ones(m.sizes, dtype=dtype)) for m in metas]


def _wrap_no_shard_here() -> tuple[torch.dtype, bool]:
    layout = ON_TWO.layout((4, 2))
    shards = _shards_of(layout, dist.get_rank(), torch.float64)
    for s in shards:
        s.data.requires_grad_(True)
    a = fshard.from_local_shards_and_layout(shards, layout)
    return a.dtype, a.requires_grad


def _bad_shard_on_one_rank() -> str:
    layout = ON_TWO.layout((4, 2))
    shards = _shards_of(layout, dist.get_rank(), torch.float32)
    if dist.get_rank() == 2:
        shards = shards + shards  # the same shard twice
    try:
        fshard.from_local_shards_and_layout(shards, layout)
    except LayoutError as exc:
        return type(exc).__name__
    return "no error"


def test_local_results_of_dtype_and_shape_changes():
    assert _dtype_and_shape() == [
        (torch.bool, (4, 2), [[False, False], [False, True], [True, True], [True, True]]),
        (torch.float16, (4, 4), [[0, 1, 0, 1], [2, 3, 2, 3], [4, 5, 4, 5], [6, 7, 6, 7]]),
        (torch.int32, (4, 1), [[1], [5], [9], [13]]),
    ]


@pytest.mark.multiprocess
def test_ranks_without_shards_learn_dtype_and_shape(dist_pool):
    want = _dtype_and_shape()
    assert dist_pool.run(_dtype_and_shape, timeout=30) == [want] * 4


@pytest.mark.multiprocess
def test_fn_error_on_one_rank_raises_on_every_rank(dist_pool):
    """Rank 2 holds the block fn refuses; the ranks without a block raise its error too."""
    got = dist_pool.run(_fn_fails_on_rank, 2, timeout=30)
    local = _fn_fails_on_rank(2)
    assert local is not None
    assert local[:2] == ("ValueError", "fn refused this block")
    assert [g[:2] for g in got] == [local[:2]] * 4
    assert got[2][2] == []
    assert got[0][2] == ["(raised on rank 2; this rank's function returned)"]


@pytest.mark.multiprocess
def test_from_local_shards_and_layout_on_a_rank_without_shards(dist_pool):
    assert dist_pool.run(_wrap_no_shard_here, timeout=30) == [(torch.float64, True)] * 4


@pytest.mark.multiprocess
def test_bad_shard_on_one_rank_raises_on_every_rank(dist_pool):
    assert dist_pool.run(_bad_shard_on_one_rank, timeout=30) == ["LayoutError"] * 4


def test_from_local_shards_and_layout_rejects_duplicates_sparse_and_wrong_device():
    layout = fshard.Chunk(0, [0, 1]).layout((4,))
    shards = _shards_of(layout, None, torch.float32)
    with pytest.raises(LayoutError, match="twice"):
        fshard.from_local_shards_and_layout([*shards, shards[0]], layout)
    sparse = [fshard.Shard(shards[0].meta, torch.ones(2).to_sparse()), shards[1]]
    with pytest.raises(SpecError, match=r"only torch\.strided"):
        fshard.from_local_shards_and_layout(sparse, layout)
    meta = [fshard.Shard(shards[0].meta, torch.ones(2, device="meta")), shards[1]]
    with pytest.raises(LayoutError, match="is on meta, not on its placement's device cpu"):
        fshard.from_local_shards_and_layout(meta, layout)
    with pytest.raises(TypeError, match=r"sequence of fshard\.Shard"):
        fshard.from_local_shards_and_layout(3, layout)


def test_in_place_writes_into_input_blocks_raise():
    a = fshard.shard(torch.ones(4, 2), fshard.Chunk(0, [0, 1]))
    with pytest.raises(SpecError, match=r"map_local\(\) fn called aten::mul_\.Tensor, which writes into"):
        fshard.map_local(lambda t: t.mul_(10), a)
    spec = fshard.Chunk(0, [0, 1])
    with pytest.raises(SpecError, match=r"shard_map\(\) fn called aten::mul\.out, which writes into"):
        fshard.shard_map(lambda t: torch.mul(t, 2, out=t), spec, spec)(a)
    b = fshard.shard(torch.ones(4, 2), spec)
    with pytest.raises(SpecError, match="in place"):  # a view of the block shares its memory
        fshard.map_local(lambda t: t[0].zero_(), b)
    c = fshard.shard(torch.ones(4, 2), spec)
    assert fshard.gather(fshard.map_local(lambda t: t * 10, c)).sum().item() == 80.0
    assert fshard.gather(c).sum().item() == 8.0


def _gathered_use_after_diverged_history() -> float:
    """A rank without a block joins the gather that fn used elsewhere, even where earlier
    programs left the ranks' counts of gathers apart (as a failure on one rank can)."""
    from fshard._exec import gathered as _varying

    _varying._COUNT[0] += 7 * dist.get_rank()
    leaf = torch.ones(3, dtype=torch.float64, requires_grad=True)
    b = fshard.shard(leaf, fshard.Replicated([0, 1, 2, 3]))
    x = fshard.shard(torch.arange(6.0, dtype=torch.float64).reshape(2, 3), ON_TWO)
    bf = fshard.gather(b)
    y = fshard.map_local(lambda t: t * bf.sum(), x)
    fshard.gather(y).sum().backward()
    return float(leaf.grad.sum())


@pytest.mark.multiprocess
def test_ranks_without_blocks_reach_the_gathers_used_elsewhere(dist_pool):
    got = dist_pool.run(_gathered_use_after_diverged_history, timeout=30)
    assert len(set(got)) == 1, got
    assert got[0] == 3 * 15.0  # d/db of sum(x) * sum(b): sum(x) = 15 for each of b's 3 elements


def _copies_that_differ(what: str) -> str:
    """A result of full copies (no exchange of outcomes) whose shape or dtype differs on rank 1."""
    rank = dist.get_rank()
    ranks = list(range(dist.get_world_size()))

    def fn(t: torch.Tensor) -> torch.Tensor:
        out = t.sum(0, keepdim=True)
        if rank == 1:
            out = torch.cat([out, out]) if what == "shape" else out.double()
        return out

    rows = fshard.Chunk(0, ranks)
    y = fshard.shard_map(fn, in_specs=rows, out_specs=fshard.Partial(fshard.Replicated(ranks)))(
        fshard.shard(torch.arange(8.0).reshape(4, 2), rows)
    )
    try:
        fshard.gather(y)
    except (fshard.CollectiveMismatchError, fshard.SpecError) as exc:
        return type(exc).__name__
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("what", "error"), [("shape", "CollectiveMismatchError"), ("dtype", "SpecError")])
def test_full_copies_that_differ_across_ranks_raise_on_every_rank_at_their_next_movement(dist_pool, what, error):
    """Each rank's own block lays out a result of full copies (no exchange in the call); ranks
    whose results differ build different arrays, and the next movement catches it: the check of
    what fn returned that the call posted (structure and dtypes), else the movement's headers."""
    assert dist_pool.run(_copies_that_differ, what, timeout=60) == [error] * 4


def _call_then_next(call: Any) -> str:
    """What ``call(xs)`` did on this rank (``xs``: rows of ones, rank 3's -1), then what the next collective did.

    Each rank catches what the call raised and goes on to its next collective (a gather).
    """
    ranks = list(range(dist.get_world_size()))
    x = torch.ones(4, 2)
    x[3] = -1
    xs = fshard.shard(x, fshard.Chunk(0, ranks))
    seen = []
    try:
        out = call(xs)
        seen.append("returned")
    except fshard.SpecError:
        out = None
        seen.append("raised")
    try:
        fshard.gather(xs)
        seen.append("next collective ran")
    except fshard.SpecError as exc:
        message = str(exc)
        seen.append(
            "raised there: rank 3 raised" if "fn raised on rank(s) [3]" in message
            else "raised there: rank 3's outcome" if "another structure or other dtypes on ranks [3]" in message
            else f"raised there: {message}"
        )  # fmt: skip
    del out
    return " / ".join(seen)


def _known_layout_outcomes(what: str) -> str:
    """A shard_map whose out_specs need no exchange, whose fn returns otherwise (or raises) on rank 3 only."""
    ranks = list(range(dist.get_world_size()))
    rows = fshard.Chunk(0, ranks)

    def fn(b: torch.Tensor) -> Any:
        s = b.sum()[None]
        if b[0, 0] < 0:  # rank 3's rows
            if what == "structure":
                return (s, s)
            b.add_(1)  # refused: a write into an input block
        return s

    return _call_then_next(fshard.shard_map(fn, in_specs=rows, out_specs=fshard.Partial(fshard.Replicated(ranks))))


@pytest.mark.multiprocess
@pytest.mark.parametrize("what", ["structure", "in-place"])
def test_an_outcome_on_one_rank_only_raises_on_every_rank_at_the_next_collective(dist_pool, what):
    """No rank waits at the call; each posts what fn returned, and the next collective compares: every rank raises.

    Before, the other ranks went on, and their next collectives paired with rank 3's other ones (a gather
    read the wrong array's data).
    """
    got = dist_pool.run(_known_layout_outcomes, what, timeout=60)
    if what == "structure":
        assert got == ["returned / raised there: rank 3's outcome"] * 4
    else:
        assert got == ["returned / raised there: rank 3 raised"] * 3 + ["raised / raised there: rank 3 raised"]


def _many_calls_without_a_collective() -> tuple[int, float]:
    """100 shard_maps whose results need no exchange, then one gather: the most checks in flight, and the sum."""
    from fshard.backends.torch_dist import _later

    ranks = list(range(dist.get_world_size()))
    rows = fshard.Chunk(0, ranks)
    f = fshard.shard_map(lambda b: b.sum()[None], in_specs=rows, out_specs=fshard.Partial(fshard.Replicated(ranks)))
    xs = fshard.shard(torch.ones(8), rows)
    most, out = 0, []
    for _ in range(100):
        out.append(f(xs))
        most = max(most, _later.pending(xs.backend.group))
    return most, float(fshard.gather(out[-1]))


@pytest.mark.multiprocess
def test_checks_in_flight_are_bounded_by_a_run_of_calls_without_a_collective(dist_pool):
    for most, total in dist_pool.run(_many_calls_without_a_collective, timeout=60):
        assert 1 <= most <= 64
        assert total == 8.0
