"""The local backend: the elements a multi-process run would send, for every movement; how it
builds new shards (views, ``torch.cat``, copies); and rank arguments checked as ``torch_dist``
checks them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fshard
from fshard.backends import local
from fshard.backends.local import LOCAL, LocalBackend, recipe

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


# -- new shards: views of the sources, joined by torch.cat or copied box by box --------------

GRID = fshard.Named(fshard.Mesh((2, 2)), ("x", "y"))
FINER = fshard.Explicit([((r, c), (2, 1), r // 2 + c) for r in range(0, 8, 2) for c in range(2)])
PAIRS = {
    "rows-columns": (ROWS, fshard.Chunk(1, [0, 1])),
    "grid-rows": (GRID, ROWS),
    "rows-finer": (ROWS, FINER),  # every destination box lies inside one source shard
    "grid-finer": (GRID, FINER),
    "replicated-rows": (fshard.Replicated([0, 1, 2]), ROWS),
    "rows-replicated": (ROWS, fshard.Replicated([0, 1, 2])),
    "same-boxes-other-ranks": (ROWS, fshard.Chunk(0, [3, 2, 1, 0])),
    "uneven-with-empty": (fshard.Chunk(0, [0, 1, 2, 0, 1, 2, 3, 3, 3]), fshard.Chunk(1, [2, 0, 1])),
}


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.fixture(params=["fewest-calls", "box-by-box"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Small arrays as they run (through the whole array where that takes fewer calls), or
    as large ones do (each destination built from its boxes)."""
    if request.param == "box-by-box":
        monkeypatch.setattr(local, "_SMALL_NUMEL", -1)
    fshard.clear_caches()
    yield request.param
    fshard.clear_caches()


@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_reshard_builds_new_contiguous_shards(pair: tuple[Any, Any], route: str) -> None:
    a = fshard.shard(X, pair[0])
    b = fshard.reshard(a, pair[1])
    assert torch.equal(fshard.gather(b), X)
    for s in b.addressable_shards:
        assert s.data.is_contiguous()
        assert torch.equal(s.data, X[tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))])
    assert not _storages(a.addressable_data) & _storages(b.addressable_data)  # nothing aliases the input


@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_reshard_runs_from_the_ranks_schedules(pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's part comes from ``plan.for_rank``: the global transfers are never built,
    and the elements counted as sent are the sum of the schedules' (the plan's minimum)."""
    from fshard._plan import direct as _plan

    def refuse(*args: Any) -> None:
        raise AssertionError("the global plan was built")

    monkeypatch.setattr(local, "_SMALL_NUMEL", -1)  # each destination built from its boxes
    fshard.clear_caches()
    monkeypatch.setattr(_plan, "_build", refuse)
    a = fshard.shard(X, pair[0])
    n = sent(lambda: fshard.reshard(a, pair[1]))
    out = fshard.reshard(a, pair[1])
    for s in out.addressable_shards:
        assert torch.equal(s.data, X[tuple(slice(o, o + k) for o, k in zip(s.meta.offsets, s.meta.sizes))])
    p = fshard.plan(a.layout, pair[1].layout(X.shape))
    assert n == p.min_elements_sent == sum(p.for_rank(r).elements_sent for r in {*a.layout.ranks, *p.dst.ranks})
    fshard.clear_caches()


PENDING = {
    "sum-to-rows": (fshard.Partial(fshard.Replicated([0, 1, 2])), ROWS),
    "sum-to-replicas": (fshard.Partial(fshard.Chunk(1, [0, 1])), fshard.Replicated([1, 2, 3])),
    "sum-regrouped": (fshard.Partial(fshard.Replicated([0, 1])), fshard.Partial(fshard.Replicated([1, 2]))),
    "value-to-max": (ROWS, fshard.Partial(fshard.Chunk(1, [2, 3]), "max")),
}


@pytest.mark.parametrize("pair", PENDING.values(), ids=PENDING.keys())
def test_pending_reductions_run_from_the_ranks_schedules(
    pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reduction too: no global rows, the values kept, and the elements counted as sent
    are the schedules' (the lower bound)."""
    from fshard._plan import pending as _reduce

    a = fshard.shard(X, pair[0])

    def refuse(*args: Any) -> None:
        raise AssertionError("the global plan was built")

    fshard.clear_caches()
    monkeypatch.setattr(_reduce, "global_rows", refuse)
    n = sent(lambda: fshard.reshard(a, pair[1]))
    got = fshard.reshard(a, pair[1])
    p = fshard.plan(a.layout, got.layout)
    assert n == p.min_elements_sent
    monkeypatch.undo()
    assert torch.equal(fshard.gather(got), X)
    fshard.clear_caches()


@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_shard_and_gather_copy_out_of_their_input(pair: tuple[Any, Any]) -> None:
    a = fshard.shard(X, pair[0])
    full = fshard.gather(a)
    assert torch.equal(full, X)
    assert full.is_contiguous()
    assert not _storages([X, full]) & _storages(a.addressable_data)
    assert full.untyped_storage().data_ptr() != X.untyped_storage().data_ptr()


def test_non_contiguous_source_shards(route: str) -> None:
    layout = ROWS.layout((8, 6))
    x = torch.arange(48.0).reshape(8, 6)
    shards = [fshard.Shard(m, x[m.offsets[0] : m.offsets[0] + 2].t().contiguous().t()) for m in layout.shards]
    a = fshard.from_local_shards_and_layout(shards, layout)
    assert not a.addressable_data[0].is_contiguous()
    for spec in (fshard.Chunk(1, [0, 1, 2]), GRID, fshard.Replicated([1])):
        b = fshard.reshard(a, spec)
        assert torch.equal(fshard.gather(b), x)
        assert all(t.is_contiguous() for t in b.addressable_data)


def test_large_shards_reuse_pooled_memory() -> None:
    x = torch.rand(1024, 1024)  # 1 MiB per destination shard: the pool's outputs
    b = fshard.reshard(fshard.shard(x, ROWS), fshard.Chunk(1, [0, 1, 2, 3]))
    assert torch.equal(fshard.gather(b), x)
    assert all(t.is_contiguous() for t in b.addressable_data)


def test_a_scalar_array(route: str) -> None:
    a = fshard.shard(torch.tensor(3.5), fshard.Replicated([0, 1]))
    b = fshard.reshard(a, fshard.Single(1))
    assert fshard.gather(b).shape == ()
    assert fshard.gather(b).item() == 3.5


def test_a_recipe_cuts_each_source_once_and_joins_each_output_once() -> None:
    p = fshard.plan(ROWS.layout((8, 4)), fshard.Chunk(1, [0, 1]).layout((8, 4)))
    pieces = [(t.src_shard, ((t.box[0][0] - 2 * t.src_shard, t.box[0][1]), t.box[1]), t.dst_shard,
               (t.box[0][0], 0)) for t in p]  # fmt: skip
    r = recipe([(2, 4)] * 4, [((8, 2), "cpu")] * 2, pieces)
    assert r.cuts == tuple((i, 1, (2, 2)) for i in range(4))
    assert r.reads == ()
    assert [f.dim for f in r.fills] == [0, 0]
    x = torch.arange(32.0).reshape(8, 4)
    out = r.run(x.split(2), torch.float32)
    assert [o.tolist() for o in out] == [x[:, :2].tolist(), x[:, 2:].tolist()]
    as_double = r.run(x.split(2), torch.float64)  # another dtype: copied box by box, converted
    assert all(o.dtype == torch.float64 and torch.equal(o, e.double()) for o, e in zip(as_double, out))


def test_small_reshards_take_the_route_with_fewer_calls() -> None:
    def calls(a: Any, b: Any, shape: tuple[int, ...]) -> list[int]:
        return [r.calls for r in local._copying(fshard.plan(a.layout(shape), b.layout(shape)))]

    # A cat counts as the views it joins.
    columns = fshard.Chunk(1, [0, 1, 2, 3])
    assert calls(ROWS, columns, (64, 64)) == [4, 5]  # cat the rows, then split and clone the columns
    assert calls(ROWS, columns, (256, 256)) == [20]  # too large: split each source, cat each destination
    assert calls(GRID, ROWS, (64, 64)) == [12]  # through the whole array would take 14
    assert calls(fshard.Partial(ROWS), fshard.Partial(columns), (64, 64)) == [20]  # summands: no whole


def test_a_copy_to_every_rank_goes_through_the_whole_array_once() -> None:
    """Chunk(0) to Replicated on 256 ranks: one cat of 256 pieces and 256 clones, not a cat of 256 per rank.

    Counted as one call each, the 256 cats of 256 views each (65,536 views: O(world ** 2) per call) looked
    cheaper than the 257 calls through the whole array.
    """
    ranks = list(range(256))
    route = local._copying(
        fshard.plan(fshard.Chunk(0, ranks).layout((4096,)), fshard.Replicated(ranks).layout((4096,)))
    )
    assert [r.calls for r in route] == [256, 256]


def test_a_recipe_copies_boxes_that_tile_no_single_dim() -> None:
    # Four 2x2 blocks into one 4x4 output: no single torch.cat gives it.
    pieces = [(2 * i + j, ((0, 0), (2, 2)), 0, (2 * i, 2 * j)) for i in range(2) for j in range(2)]
    r = recipe([(2, 2)] * 4, [((4, 4), "cpu")], pieces)
    assert r.cuts == ()
    assert [f.dim for f in r.fills] == [None]
    x = torch.arange(16.0).reshape(4, 4)
    blocks = [x[:2, :2], x[:2, 2:], x[2:, :2], x[2:, 2:]]
    assert torch.equal(r.run(blocks, torch.float32)[0], x)


# -- rank arguments: checked as torch_dist checks them -----------------------------------------


@pytest.mark.parametrize(
    "dst", [-1, 1.5, "1", float("nan"), True], ids=["negative", "fraction", "string", "nan", "bool"]
)
def test_gather_to_no_rank_raises(dst: Any) -> None:
    a = fshard.shard(X, ROWS)
    want = f"dst={dst!r}: Global rank {dst!r} does not exist in input process group (the local backend"
    with pytest.raises(fshard.SpecError, match=re.escape(want)):
        fshard.gather(a, dst=dst)


@pytest.mark.parametrize("src", [-1, 0.5, "0", True], ids=["negative", "fraction", "string", "bool"])
def test_shard_from_no_rank_raises(src: Any) -> None:
    with pytest.raises(fshard.SpecError, match=re.escape(f"src={src!r}: Global rank {src!r} does not exist")):
        fshard.shard(X, ROWS, src=src)


def test_rank_arguments_that_equal_a_rank_pass() -> None:
    a = fshard.shard(X, ROWS)
    for dst in (2.0, torch.tensor(3)):  # equal to ranks 2, 3, as torch_dist's `rank in ranks` (a bool is no rank)
        assert torch.equal(fshard.gather(a, dst=dst), X)


def test_a_world_size_bounds_ranks_as_a_process_group_does() -> None:
    four = LocalBackend(world_size=4)
    a = fshard.shard(X, fshard.Chunk(0, [0, 1]), backend=four)
    assert torch.equal(fshard.gather(a, dst=3), X)  # a rank of the group that holds no shard
    in_group = "does not exist in input process group (global ranks [0, 1, 2, 3])"
    with pytest.raises(fshard.SpecError, match=re.escape(f"dst=7: Global rank 7 {in_group}.")):
        fshard.gather(a, dst=7)
    with pytest.raises(fshard.SpecError, match=re.escape(f"src=4: Global rank 4 {in_group}.")):
        fshard.shard(X, ROWS, src=4, backend=four)
    with pytest.raises(fshard.SpecError, match=re.escape(f"Global rank 5 {in_group}: placements name global ranks")):
        fshard.shard(X, fshard.Chunk(0, [0, 5]), backend=four)
    with pytest.raises(fshard.SpecError, match="Global rank 4 does not exist in input process group"):
        fshard.reshard(a, fshard.Single(4))


@pytest.mark.parametrize("world", [-1, 2.0, True, "4"])
def test_world_size_is_a_non_negative_int(world: Any) -> None:
    with pytest.raises(fshard.SpecError, match=re.escape(f"LocalBackend(world_size={world!r})")):
        LocalBackend(world_size=world)


def test_a_summand_that_a_region_reaches_twice_is_still_filled_where_none_reaches() -> None:
    """Rank 0's summand gets box (2, 1) from itself and from a peer: counted once, its 9 of 10 elements are no cover.

    Counted twice, the shard was not filled, and its element (2, 0) read recycled memory (a stale value).
    """
    p0, p1, p2 = (fshard.Placement(r, "cpu") for r in range(3))
    boxes = [((0, 0), (1, 1), p0), ((0, 1), (1, 1), p0), ((1, 0), (1, 2), p0), ((2, 0), (1, 1), p1),
             ((2, 1), (1, 1), p1), ((2, 1), (1, 1), p0), ((3, 0), (2, 2), p0), ((2, 1), (1, 1), p2)]  # fmt: skip
    a = fshard.Partial(fshard.Explicit([fshard.ShardMeta(*box) for box in boxes]))
    b = fshard.Partial(fshard.Named(fshard.Mesh((2,), ranks=[p0, p1], axis_names=("x",)), (None, None)), over=("x",))
    x = torch.arange(10.0).reshape(5, 2) - 3.0
    plan = fshard.plan(a.layout((5, 2)), b.layout((5, 2)))
    assert local.reduction(plan.phases[-1]).fill == frozenset({0, 1})
    xs = fshard.shard(x, a)
    for _ in range(20):  # each round recycles the last one's blocks
        assert torch.equal(fshard.gather(fshard.reshard(xs, b)), x)


def test_a_copy_into_a_tensor_that_its_pieces_do_not_cover_starts_from_zeros() -> None:
    r = recipe([(1, 2)], [((2, 2), "cpu")], [(0, ((0, 0), (1, 2)), 0, (1, 0))])
    assert [f.covered for f in r.fills] == [False]
    out = r.run([torch.ones(1, 2)], torch.float32)[0]
    assert out.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    whole = recipe(
        [(1, 2), (1, 2)], [((2, 2), "cpu")], [(0, ((0, 0), (1, 2)), 0, (0, 0)), (1, ((0, 0), (1, 2)), 0, (1, 0))]
    )
    assert [f.covered for f in whole.fills] == [True]
