"""Per-rank schedules of plans with pending reductions, computed from the layouts alone.

``plan(src, dst).for_rank(r)`` between layouts with a pending reduction gives rank r's
rows of the global plan, in its order, without building it; torch_dist runs reduce
phases from that share. Checked here: the schedules against the global plan's rows on
fixed cases, the rules on small ones, a pending sum on 4,096 ranks, and reshards on
4 Gloo processes that never build the global rows and agree with the local backend
bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import fshard
from fshard import Chunk, Mesh, Named, Partial, Replicated, Single
from fshard._checkpoint._format import Saved
from fshard._checkpoint._load import _sources
from fshard._layout.layout import replica_ids
from fshard._plan import direct as _plan
from fshard._plan import pending as _reduce
from fshard._plan.schedule import Moves, RankSchedule
from fshard.backends.local import LocalBackend

R4 = [0, 1, 2, 3]
SHAPE = (7, 5)  # uneven: chunks of 2, 2, 2, 1 rows and of 2, 2, 1, 0 columns

# (source, destination) specs on 4 ranks, each a path of the reduce planner.
CASES = {
    "partial -> replicated, one rank without a summand": (Partial(Replicated([0, 1, 2])), Replicated(R4)),
    "partial -> chunk rows": (Partial(Replicated(R4)), Chunk(0, R4)),
    "partial -> chunk columns, empty chunk": (Partial(Replicated(R4)), Chunk(1, [3, 2, 1, 0])),
    "partial on two ranks -> chunks on the other two": (Partial(Replicated([1, 3])), Chunk(1, [2, 0])),
    "partial -> partial, regroup": (Partial(Named(Mesh((2, 2)), ("x", None))), Partial(Chunk(1, R4))),
    "partial -> partial on one rank": (Partial(Replicated(R4)), Partial(Replicated([2]))),
    "value -> partial": (Chunk(0, R4), Partial(Replicated([1, 2]))),
    "replicated value -> partial": (Replicated(R4), Partial(Named(Mesh((2, 2)), (None, "y")))),
    "partial -> rows with replicas (two phases)": (
        Partial(Named(Mesh((2, 2)), ("x", None))),
        Named(Mesh((2, 2)), (None, "y")),
    ),
    "partial sum -> partial max (two phases)": (Partial(Replicated(R4)), Partial(Chunk(0, [0, 1]), "max")),
    "partial max -> replicated on two ranks": (Partial(Replicated(R4), "max"), Replicated([0, 3])),
    "partial min -> single": (Partial(Chunk(1, [0, 1, 1, 2]), "min"), Single(3)),
    # Summands along y, replicas along x (DTensor's [Replicate(), Partial()]).
    "partial over y -> chunk rows": (Partial(Named(Mesh((2, 2)), (None,)), over="y"), Chunk(0, R4)),
    "partial over y -> replicated (two phases)": (Partial(Named(Mesh((2, 2)), (None,)), over="y"), Replicated(R4)),
    "partial over y -> rows over y, replicas": (
        Partial(Named(Mesh((2, 2)), (None, None)), over="y"),
        Named(Mesh((2, 2)), ("y", None)),
    ),
    "partial over y -> every copy a summand": (
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
        Partial(Named(Mesh((2, 2)), (None,))),
    ),
    "partial over y -> partial over x (two phases)": (
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
        Partial(Named(Mesh((2, 2)), (None,)), over="x"),
    ),
    "partial max over x -> single": (Partial(Named(Mesh((2, 2)), (None, "y")), "max", over="x"), Single(1)),
    "value -> partial over y": (Chunk(1, R4), Partial(Named(Mesh((2, 2)), (None,)), over="y")),
    "partial over y to itself": (
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
        Partial(Named(Mesh((2, 2)), (None,)), over="y"),
    ),
}


@contextlib.contextmanager
def global_rows_forbidden() -> Iterator[None]:
    """Within: reading any plan's rows, or building them, raises."""

    def forbidden(self: object) -> None:
        raise AssertionError("the global plan's rows were read")

    def build(*args: object) -> None:
        raise AssertionError("the global plan was built")

    saved = (_plan.Plan.__dict__["_rows"], _reduce.PendingPlan.__dict__["_rows"], _plan._build, _reduce.global_rows)
    _plan.Plan._rows = _reduce.PendingPlan._rows = property(forbidden)  # type: ignore[assignment]
    _plan._build = _reduce.global_rows = build  # type: ignore[assignment]
    try:
        yield
    finally:
        _plan.Plan._rows, _reduce.PendingPlan._rows, _plan._build, _reduce.global_rows = saved  # type: ignore[misc]


def _same_moves(a: Moves, b: Moves) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("src_shard", "dst_shard", "lo", "size", "peer"))


def _same(a: RankSchedule, b: RankSchedule) -> bool:
    if a.rank != b.rank or a.op != b.op or len(a.steps) != len(b.steps):
        return False
    if a.steps:
        return all(_same(x, y) for x, y in zip(a.steps, b.steps))
    return _same_moves(a.send, b.send) and _same_moves(a.recv, b.recv) and _same_moves(a.local, b.local)


def _rows(m: Moves) -> list[tuple]:
    return [
        (s, d, tuple(lo), p)
        for s, d, lo, p in zip(m.src_shard.tolist(), m.dst_shard.tolist(), m.lo.tolist(), m.peer.tolist())
    ]


# -- schedules against the global plan -------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_schedules_are_the_global_rows_without_building_them(name: str) -> None:
    src, dst = (spec.layout(SHAPE) for spec in CASES[name])
    fshard.clear_caches()
    with global_rows_forbidden():
        p = fshard.plan(src, dst)
        mine = {r: p.for_rank(r) for r in range(6)}  # ranks 4 and 5 hold nothing
    assert p.src.partial is not None or p.dst.partial is not None
    for r, s in mine.items():
        assert _same(s, _plan.from_plan(p, r)), (name, r)
        assert p.for_rank(r) is s
    assert sum(s.elements_sent for s in mine.values()) == p.elements_sent
    for phase in p.phases:
        assert phase.min_elements_sent == phase.elements_sent  # what torch_dist decides from


def test_regroup_receivers_take_turns() -> None:
    """Summands on ranks 2 to 5 (positions 2 to 5 among the holders) go to the destination
    holders at positions (p + u + v) mod 2: 2 and 4 to rank 0, 3 and 5 to rank 1."""
    src, dst = Partial(Replicated(range(6))).layout((4,)), Partial(Replicated([0, 1])).layout((4,))
    s0, s1 = (fshard.plan(src, dst).for_rank(r) for r in (0, 1))
    assert s0.recv.peer.tolist() == [2, 4]
    assert s1.recv.peer.tolist() == [3, 5]
    assert _rows(s0.local) == [(0, 0, (0,), 0)]
    assert fshard.plan(src, dst).for_rank(4).send.peer.tolist() == [0]


def test_make_keeps_a_value_where_a_rank_holds_both_boxes() -> None:
    """Rows [0, 2) of a value on rank 0 go to rank 1 (no rank holds them in both layouts); rows
    [2, 4) stay on rank 1, the lowest rank holding them in both; rank 2 holds the identity."""
    src, dst = Chunk(0, [0, 1]).layout((4,)), Partial(Replicated([1, 2])).layout((4,))
    p = fshard.plan(src, dst)
    assert _rows(p.for_rank(0).send) == [(0, 0, (0,), 1)]
    assert _rows(p.for_rank(1).recv) == [(0, 0, (0,), 0)]
    assert _rows(p.for_rank(1).local) == [(1, 0, (2,), 1)]
    s2 = p.for_rank(2)
    assert len(s2.send) == len(s2.recv) == len(s2.local) == 0
    assert p.elements_sent == p.min_elements_sent == 2


def test_a_pending_sum_on_4096_ranks_to_chunks() -> None:
    """Every rank holds a summand of everything; rank 7 sends a part to each other rank and
    receives its part from each, without the 4096^2 rows of the global plan."""
    n = 4096
    src = Partial(Replicated(range(n))).layout((2 * n, 3))
    dst = Chunk(0, range(n)).layout((2 * n, 3))
    fshard.clear_caches()
    with global_rows_forbidden():
        s = fshard.plan(src, dst).for_rank(7)
    assert s.op == "sum"
    assert not s.steps
    assert s.send.peer.tolist() == [r for r in range(n) if r != 7]
    assert s.recv.peer.tolist() == [r for r in range(n) if r != 7]
    assert (s.recv.lo[:, 0] == 14).all()
    assert _rows(s.local) == [(7, 7, (14, 0), 7)]
    assert s.elements_sent == s.elements_received == (n - 1) * 6
    assert len(s.peers) == n - 1


def test_a_load_on_4096_ranks_finds_one_ranks_reads_without_the_global_plan() -> None:
    """A checkpoint saved in rows on 4096 ranks, loaded in columns: rank 7 reads its column from every
    saved box, found in the saved boxes' index for its own shard alone (the global plan has 4096^2 rows)."""
    n = 4096
    shape = (2 * n, n)
    saved = Saved(path="w", kind="array", shape=shape, source=Chunk(0, range(n)).layout(shape))
    target = Chunk(1, range(n)).layout(shape)
    fshard.clear_caches()
    with global_rows_forbidden():
        pieces = _sources(saved, target, [7])
    assert sorted(pieces) == list(range(n))
    assert all(pieces[k] == [((2 * k, 7), (2, 1), 7)] for k in range(n))
    assert _sources(saved, target, []) == {}
    assert target._metas is None  # nor one ShardMeta per shard


def test_a_large_plans_repr_builds_no_transfers() -> None:
    """A gather to 4096 ranks has 4096^2 transfers: its repr says what is cheap (its printing took 10-30 s)."""
    n = 4096
    gather = fshard.plan(Chunk(0, range(n)).layout((n, 2)), Replicated(range(n)).layout((n, 2)))
    summed = fshard.plan(Partial(Replicated(range(n))).layout((n, 2)), Replicated(range(n)).layout((n, 2)))
    with global_rows_forbidden():
        assert repr(gather) == (
            f"Plan(4096 -> 4096 shards, minimum {2 * n * (n - 1)} elements sent, shape (4096, 2); len(plan) and "
            "plan.elements_sent build its transfers, plan.for_rank(rank) one rank's)"
        )
        assert repr(summed).startswith("Plan(2 phases, 4096 -> 4096 shards, minimum ")
    small = fshard.plan(Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,)))
    assert repr(small) == "Plan(2 transfers, 4 elements sent (minimum 4), shape (4,))"


# -- on 4 processes ---------------------------------------------------------------------------


def _summands(layout: fshard.Layout, exact: bool) -> list[torch.Tensor]:
    """One tensor per shard: independent summands of a partial layout, or the boxes of one
    value; integers when ``exact`` (any order of a sum gives the same bits)."""
    g = torch.Generator().manual_seed(7)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        if exact:
            return torch.randint(-50, 50, shape, generator=g).to(torch.float64)
        return torch.randn(shape, generator=g, dtype=torch.float64)

    if layout.partial is None:
        full = draw(layout.shape)
        return [full[tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))].clone() for m in layout.shards]
    drawn: dict[int, torch.Tensor] = {}  # replicas of a summand (Layout.terms) hold one draw
    ids = replica_ids(layout).tolist()
    return [drawn.setdefault(k, draw(m.sizes)).clone() for k, m in zip(ids, layout.shards)]


def _array(layout: fshard.Layout, exact: bool, rank: int | None, backend: object = None) -> fshard.ShardedArray:
    data = _summands(layout, exact)
    index = range(len(layout.shards)) if rank is None else layout.indices_on(rank)
    shards = [fshard.Shard(layout.shards[i], data[i]) for i in index]
    return fshard.from_local_shards_and_layout(shards, layout, backend=backend)  # type: ignore[arg-type]


def _reshard_on_this_rank(src_spec: object, dst_spec: object, exact: bool) -> tuple[list, int, list]:
    """Reshards with every cache cleared and the global rows forbidden; returns this rank's
    (shard index, tensor) pairs, the elements it sent, and its reduce phases' peers."""
    import torch.distributed as dist

    from fshard.backends.torch_dist import TorchDistBackend

    rank, counters = dist.get_rank(), TorchDistBackend().counters
    x = _array(src_spec.layout(SHAPE), exact, rank)  # type: ignore[attr-defined]
    fshard.clear_caches()
    before = counters.elements_sent
    with global_rows_forbidden():
        y = fshard.reshard(x, dst_spec)
        peers = [list(s.peers) for s in fshard.plan(x.layout, y.layout).for_rank(rank).phases]
    sent = counters.elements_sent - before
    return list(zip(y.layout.indices_on(rank), y.addressable_data)), sent, peers


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64)


def _check_against_local(dist_pool: object, src_spec: object, dst_spec: object, exact: bool = False) -> None:
    results = dist_pool.run(_reshard_on_this_rank, src_spec, dst_spec, exact)  # type: ignore[attr-defined]
    local = fshard.reshard(_array(src_spec.layout(SHAPE), exact, None, LocalBackend(world_size=4)), dst_spec)  # type: ignore[attr-defined]
    expected = dict(enumerate(local.addressable_data))
    got = [i for shards, _, _ in results for i, _ in shards]
    assert sorted(got) == sorted(i for i, m in enumerate(local.layout.shards) if m.placement.rank in R4)
    for shards, _, _ in results:
        for i, t in shards:
            assert t.dtype == expected[i].dtype
            assert torch.equal(_bits(t), _bits(expected[i])), i
    p = fshard.plan(src_spec.layout(SHAPE), local.layout)  # type: ignore[attr-defined]
    assert sum(sent for _, sent, _ in results) == p.elements_sent == p.min_elements_sent


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_partial_reshards_match_the_local_backend_without_the_global_plan(dist_pool: object, name: str) -> None:
    _check_against_local(dist_pool, *CASES[name])


@pytest.mark.multiprocess
def test_all_reduce_counts_from_the_rank_schedule(dist_pool: object) -> None:
    """A full-shape pending sum on every rank to a full copy on each runs ``all_reduce``; each rank
    counts what its schedule sends (exact data: the collective's order of summation is its own)."""
    _check_against_local(dist_pool, Partial(Replicated(R4)), Replicated(R4), exact=True)
