"""Per-rank schedules (``plan(src, dst).for_rank(r)``), lazy plans and ``Layout.from_arrays``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import fshard
from fshard import Chunk, Layout, Mesh, Named, Partial, Replicated, ShardMeta, Single
from fshard._plan import direct as _plan
from fshard._plan import schedule as _schedule


def _rows(m: _schedule.Moves) -> list[tuple[int, int, list[int], list[int], int]]:
    return list(zip(m.src_shard.tolist(), m.dst_shard.tolist(), m.lo.tolist(), m.size.tolist(), m.peer.tolist()))


@pytest.fixture
def no_global_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails any test that builds the global transfers of a plan between non-partial layouts."""

    def refuse(src: Layout, dst: Layout) -> None:
        raise AssertionError("the global plan was built")

    monkeypatch.setattr(_plan, "_build", refuse)
    fshard._plan._plan.cache_clear()
    _schedule.schedule.cache_clear()


# -- small known cases ---------------------------------------------------------------------


def test_dim0_to_dim1_on_two_ranks() -> None:
    src, dst = Chunk(0, [0, 1]).layout((4, 4)), Chunk(1, [0, 1]).layout((4, 4))
    s0 = fshard.plan(src, dst).for_rank(0)
    assert s0.rank == 0
    assert s0.src == src  # (an equal layout cached earlier may be the one held)
    assert s0.dst == dst
    assert _rows(s0.send) == [(0, 1, [0, 2], [2, 2], 1)]
    assert _rows(s0.recv) == [(1, 0, [2, 0], [2, 2], 1)]
    assert _rows(s0.local) == [(0, 0, [0, 0], [2, 2], 0)]
    assert (s0.elements_sent, s0.elements_received, s0.peers) == (4, 4, (1,))
    s1 = fshard.plan(src, dst).for_rank(1)
    assert _rows(s1.send) == [(1, 0, [2, 0], [2, 2], 0)]
    assert _rows(s1.local) == [(1, 1, [2, 2], [2, 2], 1)]


def test_rank_without_shards_has_an_empty_schedule() -> None:
    p = fshard.plan(Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,)))
    s = p.for_rank(7)
    assert len(s.send) == len(s.recv) == len(s.local) == 0
    assert (s.elements_sent, s.elements_received, s.peers) == (0, 0, ())
    assert s.send.lo.shape == (0, 1)
    # A rank that holds only empty shards (Chunk past the end) has nothing to do either.
    q = fshard.plan(Chunk(0, [0, 1, 2]).layout((2,)), Chunk(0, [2, 1, 0]).layout((2,)))
    assert q.src.shards[2].sizes == (0,)
    assert len(q.for_rank(2).send) == 0
    assert len(q.for_rank(2).recv) == 1


def test_replicas_take_turns_sending() -> None:
    """The receivers of a replicated box rotate over its holders: both replicas send."""
    p = fshard.plan(Replicated([0, 1]).layout((8,)), Chunk(0, [0, 1, 2, 3]).layout((8,)))
    sent = {r: p.for_rank(r).elements_sent for r in range(4)}
    assert sent == {0: 2, 1: 2, 2: 0, 3: 0}
    assert p.traffic().sum(axis=1).tolist() == [2, 2, 0, 0]
    assert p.elements_sent == p.min_elements_sent == 4


def test_a_box_held_twice_arrives_once_per_shard() -> None:
    """Rank 1 holds the destination box on two devices: two rows, one source, counted once."""
    dst = Layout((4,), [ShardMeta((0,), (4,), "rank:1/cpu"), ShardMeta((0,), (4,), "rank:1/cuda:0")])
    s = fshard.plan(Single(0).layout((4,)), dst).for_rank(1)
    assert [(src, d, peer) for src, d, _, _, peer in _rows(s.recv)] == [(0, 0, 0), (0, 1, 0)]
    assert s.elements_received == 4
    assert fshard.plan(Single(0).layout((4,)), dst).for_rank(0).elements_sent == 4


def test_a_local_copy_comes_from_the_same_device() -> None:
    both = [ShardMeta((0,), (4,), "rank:0/cpu"), ShardMeta((0,), (4,), "rank:0/cuda:0")]
    src = Layout((4,), both)
    dst = Layout((4,), [ShardMeta((0,), (4,), "rank:0/cuda:0")])
    assert _rows(fshard.plan(src, dst).for_rank(0).local) == [(1, 0, [0], [4], 0)]


def test_named_grid_to_rows() -> None:
    shape = (8, 8)
    src, dst = Named(Mesh((2, 2)), ("x", "y")).layout(shape), Chunk(0, range(4)).layout(shape)
    s = fshard.plan(src, dst).for_rank(1)  # holds rows 0:4 x cols 4:8, then rows 2:4
    assert _rows(s.send) == [(1, 0, [0, 4], [2, 4], 0)]
    assert _rows(s.recv) == [(0, 1, [2, 0], [2, 4], 0)]
    assert _rows(s.local) == [(1, 1, [2, 4], [2, 4], 1)]
    assert s.elements_sent == s.elements_received == 8


def test_repr() -> None:
    s = fshard.plan(Chunk(0, [0, 1]).layout((4, 4)), Chunk(1, [0, 1]).layout((4, 4))).for_rank(1)
    assert repr(s) == (
        "RankSchedule(rank 1, shape (4, 4): sends 1 transfer (4 elements) to ranks 0, "
        "receives 1 (4 elements) from ranks 0, 1 local copy)"
    )
    assert repr(s.send) == "Moves(1 transfers, 4 elements, peers 0)"


def test_bad_ranks_are_refused() -> None:
    p = fshard.plan(Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,)))
    for bad in (-1, 1.0, True, "0", 2**63):
        with pytest.raises(fshard.SpecError, match="non-negative int rank"):
            p.for_rank(bad)  # type: ignore[arg-type]
    assert p.for_rank(np.int64(1)) is p.for_rank(1)  # type: ignore[arg-type]


# -- caching and laziness --------------------------------------------------------------------


def test_schedules_are_cached_on_the_layouts_and_rank() -> None:
    src, dst = Chunk(0, [0, 1, 2]).layout((6, 3)), Chunk(1, [2, 1, 0]).layout((6, 3))
    s = fshard.plan(src, dst).for_rank(2)
    assert fshard.plan(src, dst).for_rank(2) is s
    copies = Layout(src.shape, src.shards), Layout(dst.shape, dst.shards)  # equal, other objects
    assert fshard.plan(*copies).for_rank(2) is s
    assert fshard.plan(src, dst).for_rank(1) is not s
    with pytest.raises(AttributeError):
        s.rank = 0  # type: ignore[misc]
    assert not s.send.lo.flags.writeable


@pytest.mark.usefixtures("no_global_plan")
def test_for_rank_and_the_minimum_need_no_global_plan() -> None:
    n = 2048
    shape = (n, n)
    src = Layout.from_arrays(shape, np.c_[np.arange(n), np.zeros(n, int)], np.c_[np.ones(n, int), np.full(n, n)],
                             np.arange(n))  # fmt: skip
    dst = Chunk(1, range(n)).layout(shape)
    p = fshard.plan(src, dst)
    s = p.for_rank(5)
    assert len(s.send) == len(s.recv) == n - 1
    assert len(s.local) == 1
    assert s.peers == tuple(r for r in range(n) if r != 5)
    assert p.min_elements_sent == n * n - n
    assert src._metas is None  # no ShardMeta was made


def test_plan_rows_are_built_on_first_use() -> None:
    src, dst = Chunk(0, [0, 1]).layout((4,)), Chunk(0, [1, 0]).layout((4,))
    p = fshard._plan._plan.__wrapped__(src, dst)
    assert "_rows" not in vars(p)
    assert p.min_elements_sent == 4
    assert "_rows" not in vars(p)
    assert len(p) == 2
    assert "_rows" in vars(p)
    with pytest.raises(AttributeError):
        p.src = dst  # type: ignore[misc]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (Chunk(0, [0, 1]), Chunk(1, [1, 0])),
        (Replicated([0, 1, 2]), Named(Mesh((2, 2)), ("x", None))),
        (Named(Mesh((2, 2)), (None, "y")), Replicated([0, 1, 2, 3, 4])),
        (Single(3), Chunk(1, [0, 0, 1])),
    ],
)
def test_closed_form_minimum_equals_the_rows(src: object, dst: object) -> None:
    a, b = src.layout((6, 5)), dst.layout((6, 5))  # type: ignore[attr-defined]
    p = fshard._plan._plan.__wrapped__(a, b)
    assert _plan.min_elements(a, b) == p.elements_sent == int(p.traffic().sum())


# -- plans with pending reductions ---------------------------------------------------------------


def test_reduce_scatter_schedule() -> None:
    src, dst = Partial(Replicated([0, 1])).layout((4,)), Chunk(0, [0, 1]).layout((4,))
    s = fshard.plan(src, dst).for_rank(0)
    assert s.op == "sum"
    assert s.phases == (s,)
    assert _rows(s.send) == [(0, 1, [2], [2], 1)]
    assert _rows(s.recv) == [(1, 0, [0], [2], 1)]
    assert _rows(s.local) == [(0, 0, [0], [2], 0)]
    assert fshard.plan(src, dst).for_rank(0) is s


def test_all_reduce_schedule_has_two_phases() -> None:
    src, dst = Partial(Replicated([0, 1])).layout((4,)), Replicated([0, 1]).layout((4,))
    p = fshard.plan(src, dst)
    s = p.for_rank(1)
    assert [x.op for x in s.phases] == ["sum", None]
    assert len(s.send) == 0
    assert s.elements_sent == p.elements_sent // 2 == 4
    assert "2 phases" in repr(s)


# -- Layout.from_arrays --------------------------------------------------------------------------


def test_from_arrays_equals_the_constructor() -> None:
    shards = [ShardMeta((0, 0), (2, 3), 0), ShardMeta((2, 0), (2, 3), "rank:1/cuda:1"), ShardMeta((4, 0), (0, 3), 2)]
    built = Layout((4, 3), shards, "sum")
    cols = Layout.from_arrays((4, 3), [[0, 0], [2, 0], [4, 0]], [[2, 3], [2, 3], [0, 3]], [0, 1, 2],
                              devices=["cpu", "cuda:1", "cpu"], partial="sum")  # fmt: skip
    assert cols == built
    assert hash(cols) == hash(built)
    assert cols._metas is None
    assert cols.to_dict() == built.to_dict()
    assert repr(cols) == repr(built)
    assert pickle.loads(pickle.dumps(cols)) == built
    assert pickle.loads(pickle.dumps(built)) == cols
    assert cols.shards == built.shards
    assert cols._metas is not None


def test_from_arrays_is_lazy_and_fast_to_compare() -> None:
    n = 1000
    lay = Layout.from_arrays((4 * n,), np.arange(n) * 4, np.full(n, 4), np.arange(n))
    assert lay.ranks == tuple(range(n))
    assert lay._metas is None
    assert "1000 shards on ranks 0-999" in repr(lay)
    assert lay._metas is None
    assert lay == Chunk(0, range(n)).layout((4 * n,))
    assert lay.shards_on(3) == (ShardMeta((12,), (4,), 3),)


def test_a_specs_layout_makes_no_object_per_shard_until_its_shards_are_read() -> None:
    """Chunk, Replicated and Named lay out 65536 placements as columns; to_dtensor's search reads them so."""
    from fshard._interop.torch_objects import _placements_for

    n = 1 << 16
    mesh = Mesh((256, 256), range(n), ("x", "y"))
    for spec in (Chunk(1, range(n)), Replicated(range(n)), Named(mesh, ("y", "x")), Partial(Named(mesh, ("x",)))):
        lay = spec.layout((4 * n, 8))
        assert lay._metas is None
    lay = Named(mesh, ("y", "x")).layout((512, 512))
    assert [repr(p) for p in _placements_for(lay, mesh)] == ["Shard(dim=1)", "Shard(dim=0)"]
    assert lay._metas is None
    assert lay.shards[-1] == ShardMeta((510, 510), (2, 2), n - 1)  # made on first read, as the constructor's


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offsets": [[0]], "sizes": [[2], [2]], "ranks": [0, 1]}, r"offsets must have shape \(shards, ndim\)"),
        ({"offsets": [[0], [1]], "sizes": [[2], [2]], "ranks": [0, 1]}, "overlap at element"),
        ({"offsets": [[0], [2]], "sizes": [[2], [1]], "ranks": [0, 1]}, "do not cover element"),
        ({"offsets": [[0], [2]], "sizes": [[2], [2]], "ranks": [0, -1]}, "ranks of shard 1 must be non-negative"),
        ({"offsets": [[0.0], [2]], "sizes": [[2], [2]], "ranks": [0, 1]}, "offsets must hold ints"),
        ({"offsets": [[0], [2]], "sizes": [[2], [2]], "ranks": [[0, 1]]}, "ranks must be 1-D"),
        ({"offsets": [[0], [2]], "sizes": [[2], [3]], "ranks": [0, 1]}, "extends past shape"),
        ({"offsets": [[0], [2]], "sizes": [[2], [2]], "ranks": [0, 1], "devices": ["cpu"]}, "one per shard"),
        ({"offsets": [[0], [2]], "sizes": [[2], [2]], "ranks": [0, 1], "partial": "mean"}, "not a reduction"),
    ],
)
def test_from_arrays_validates(kwargs: dict, message: str) -> None:
    with pytest.raises(fshard.LayoutError, match=message):
        Layout.from_arrays((4,), **kwargs)


def test_from_arrays_edge_shapes() -> None:
    assert Layout.from_arrays((), np.zeros((1, 0), int), np.zeros((1, 0), int), [3]) == Single(3).layout(())
    assert Layout.from_arrays((0,), [], [], []) == Layout((0,), [])
