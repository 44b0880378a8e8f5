"""Per-rank schedules against the global plan, on random layout pairs.

The union over ranks of ``plan(a, b).for_rank(r)`` is the plan: every row once, on
the rank of its destination (``recv`` or ``local``) and, when it crosses ranks, on the
rank of its source (``send``), in the plan's order; each rank's rows touch only its
own shards.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard._plan.schedule import Moves
from fshard.testing.strategies import layout_pairs, shapes

WORLD = 5
DEVICES = ("cpu", "cuda:0")


@st.composite
def variants(draw: st.DrawFn, layout: fshard.Layout) -> fshard.Layout:
    """``layout`` with shards moved to other devices, some boxes held twice by one rank (on
    two devices), and a pending reduction, each maybe."""
    shards = list(layout.shards)
    if draw(st.booleans()):
        devices = [draw(st.sampled_from(DEVICES)) for _ in shards]
        shards = [
            fshard.ShardMeta(s.offsets, s.sizes, fshard.Placement(s.placement.rank, d)) for s, d in zip(shards, devices)
        ]
    if draw(st.booleans()):
        for s in list(shards):
            twin = fshard.ShardMeta(s.offsets, s.sizes, f"rank:{s.placement.rank}/cuda:1")
            if s.numel and twin not in shards and draw(st.booleans()):
                shards.append(twin)
    partial = draw(st.sampled_from([None, None, None, "sum", "max"]))
    return fshard.Layout(layout.shape, tuple(shards), partial)


pairs = layout_pairs(shapes(max_dims=3, max_side=7), world=WORLD).flatmap(
    lambda p: st.tuples(variants(p[0]), variants(p[1]))
)


def rows(src_shard, dst_shard, lo, size) -> list[tuple]:
    return [
        (s, d, tuple(a), tuple(z))
        for s, d, a, z in zip(src_shard.tolist(), dst_shard.tolist(), lo.tolist(), size.tolist())
    ]


def moves(m: Moves) -> list[tuple]:
    return rows(m.src_shard, m.dst_shard, m.lo, m.size)


def plan_rows(p: fshard.Plan, keep: np.ndarray) -> list[tuple]:
    return rows(p.src_shard[keep], p.dst_shard[keep], p.lo[keep], p.size[keep])


@settings(max_examples=max(300, settings().max_examples))
@given(pairs)
def test_union_of_rank_schedules_is_the_plan(pair: tuple[fshard.Layout, fshard.Layout]) -> None:
    a, b = pair
    p = fshard.plan(a, b)
    for phase in p.phases:
        sr, dr = phase.src_rank, phase.dst_rank
        received: Counter[tuple] = Counter()
        sent: Counter[tuple] = Counter()
        ranks = set(phase.src.ranks) | set(phase.dst.ranks) | {max(WORLD, *phase.src.ranks, *phase.dst.ranks)}
        for r in sorted(ranks):
            s = p.for_rank(r)
            s = s.phases[p.phases.index(phase)]
            assert s.rank == r
            # The plan's own rows of this rank, in the plan's order.
            assert moves(s.local) == plan_rows(phase, np.flatnonzero((sr == r) & (dr == r)))
            assert moves(s.recv) == plan_rows(phase, np.flatnonzero((dr == r) & (sr != r)))
            assert moves(s.send) == plan_rows(phase, np.flatnonzero((sr == r) & (dr != r)))
            # Only this rank's shards, and the peers on the other side.
            assert (phase.src.columns.rank[s.send.src_shard] == r).all()
            assert (s.send.peer != r).all()
            assert (phase.dst.columns.rank[s.send.dst_shard] == s.send.peer).all()
            assert (phase.dst.columns.rank[s.recv.dst_shard] == r).all()
            assert (s.recv.peer != r).all()
            assert (phase.src.columns.rank[s.recv.src_shard] == s.recv.peer).all()
            assert (phase.src.columns.rank[s.local.src_shard] == r).all()
            assert (phase.dst.columns.rank[s.local.dst_shard] == r).all()
            received.update(moves(s.recv) + moves(s.local))
            sent.update(moves(s.send))
        everything = Counter(plan_rows(phase, np.arange(len(phase.src_shard))))
        assert received == everything
        assert sent == Counter(plan_rows(phase, np.flatnonzero(sr != dr)))
    assert sum(p.for_rank(r).elements_sent for r in set(a.ranks) | set(b.ranks)) == p.elements_sent


@given(pairs, st.integers(0, WORLD))
def test_schedules_are_cached_and_pure(pair: tuple[fshard.Layout, fshard.Layout], rank: int) -> None:
    a, b = pair
    s = fshard.plan(a, b).for_rank(rank)
    assert fshard.plan(a, b).for_rank(rank) is s
    copies = (fshard.Layout(a.shape, a.shards, a.partial), fshard.Layout(b.shape, b.shards, b.partial))
    assert fshard.plan(*copies).for_rank(rank) is s
