"""Per-rank schedules of plans with pending reductions against the global plan, on random layouts.

For random layout pairs with a pending reduction on either side (sum, max or min; with
replicas, boxes held twice by one rank on two devices, and ranks without shards), every
rank's schedule is computed with the global rows forbidden. Then, per phase, the union
over ranks of the rows received and copied locally is the global plan's rows as a
multiset, and so is the union of the rows sent for its rows that cross ranks; each
rank's rows are in the plan's order; ``elements_sent`` summed over ranks is the plan's;
and every phase meets its lower bound, which is what torch_dist reads to decide whether
a phase needs a collective.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard._plan import pending as _reduce
from fshard._plan.schedule import Moves
from fshard.testing.strategies import layout_pairs, shapes

WORLD = 5
DEVICES = ("cpu", "cuda:0")
OPS = (None, "sum", "max", "min")


@st.composite
def variants(draw: st.DrawFn, layout: fshard.Layout, partial: str | None) -> fshard.Layout:
    """``layout`` with shards moved to other devices and some boxes held twice by one rank (on
    two devices), each maybe, and the pending reduction ``partial``."""
    shards = list(layout.shards)
    if draw(st.booleans()):
        shards = [
            fshard.ShardMeta(s.offsets, s.sizes, fshard.Placement(s.placement.rank, draw(st.sampled_from(DEVICES))))
            for s in shards
        ]
    if draw(st.booleans()):
        for s in list(shards):
            twin = fshard.ShardMeta(s.offsets, s.sizes, f"rank:{s.placement.rank}/cuda:1")
            if s.numel and twin not in shards and draw(st.booleans()):
                shards.append(twin)
    return fshard.Layout(layout.shape, tuple(shards), partial)


@st.composite
def partial_pairs(draw: st.DrawFn) -> tuple[fshard.Layout, fshard.Layout]:
    """Two layouts of one shape, at least one with a pending reduction."""
    a, b = draw(layout_pairs(shapes(max_dims=3, max_side=7), world=WORLD))
    ops = draw(st.tuples(st.sampled_from(OPS), st.sampled_from(OPS)).filter(lambda o: o != (None, None)))
    return draw(variants(a, ops[0])), draw(variants(b, ops[1]))


def _rows(m: Moves) -> list[tuple]:
    return [
        (s, d, tuple(lo), tuple(z))
        for s, d, lo, z in zip(m.src_shard.tolist(), m.dst_shard.tolist(), m.lo.tolist(), m.size.tolist())
    ]


def _plan_rows(p: fshard.Plan, keep: np.ndarray) -> list[tuple]:
    return [
        (s, d, tuple(lo), tuple(z))
        for s, d, lo, z in zip(
            p.src_shard[keep].tolist(), p.dst_shard[keep].tolist(), p.lo[keep].tolist(), p.size[keep].tolist()
        )
    ]


def _schedules_without_global_rows(a: fshard.Layout, b: fshard.Layout, ranks: list[int]) -> dict:
    def forbidden(*args: object) -> None:
        raise AssertionError("the global plan's rows were built")

    fshard.clear_caches()
    saved = _reduce.global_rows
    _reduce.global_rows = forbidden  # type: ignore[assignment]
    try:
        p = fshard.plan(a, b)
        return {r: p.for_rank(r) for r in ranks}
    finally:
        _reduce.global_rows = saved


@settings(max_examples=max(300, settings().max_examples))
@given(partial_pairs())
def test_union_of_rank_schedules_is_the_global_plan(pair: tuple[fshard.Layout, fshard.Layout]) -> None:
    a, b = pair
    ranks = sorted(set(a.ranks) | set(b.ranks) | {WORLD})  # WORLD holds nothing
    mine = _schedules_without_global_rows(a, b, ranks)
    p = fshard.plan(a, b)
    for k, phase in enumerate(p.phases):
        sr, dr = phase.src_rank, phase.dst_rank
        received: Counter[tuple] = Counter()
        sent: Counter[tuple] = Counter()
        for r in ranks:
            s = mine[r].phases[k]
            assert s.op == phase.op
            assert s.rank == r
            # This rank's rows of the plan, in the plan's order (the order of combination).
            assert _rows(s.local) == _plan_rows(phase, np.flatnonzero((sr == r) & (dr == r)))
            assert _rows(s.recv) == _plan_rows(phase, np.flatnonzero((dr == r) & (sr != r)))
            assert _rows(s.send) == _plan_rows(phase, np.flatnonzero((sr == r) & (dr != r)))
            assert (s.recv.peer == phase.src.columns.rank[s.recv.src_shard]).all()
            assert (s.send.peer == phase.dst.columns.rank[s.send.dst_shard]).all()
            received.update(_rows(s.recv) + _rows(s.local))
            sent.update(_rows(s.send))
        assert received == Counter(_plan_rows(phase, np.arange(len(phase.src_shard))))
        assert sent == Counter(_plan_rows(phase, np.flatnonzero(sr != dr)))
        if phase.op is not None:
            assert phase.min_elements_sent == phase.elements_sent
    assert sum(s.elements_sent for s in mine.values()) == p.elements_sent == p.min_elements_sent
    assert sum(s.elements_received for s in mine.values()) == p.elements_sent
