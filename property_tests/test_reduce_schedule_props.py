"""Per-rank schedules of plans with pending reductions against the global plan, on random layouts.

For random layout pairs with a pending reduction on either side (sum, max or min; with
replicas, boxes held twice by one rank on two devices, ranks without shards, and summands
that have replicas: ``Layout.terms``, from ``Partial(Named(...), over=...)`` or a label
per rank), every
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
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard._plan import pending as _reduce
from fshard._plan.schedule import Moves
from fshard.testing.strategies import layout_pairs, partial_specs, shapes, specs

WORLD = 5
DEVICES = ("cpu", "cuda:0")
OPS = (None, "sum", "max", "min")


@st.composite
def variants(draw: st.DrawFn, layout: fshard.Layout, partial: str | None) -> fshard.Layout:
    """``layout`` with shards moved to other devices and some boxes held twice by one rank (on
    two devices), each maybe, and the pending reduction ``partial``, maybe with terms: a label
    per rank, so that a rank's copies of a box are replicas of one summand."""
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
    terms = None
    if partial is not None and draw(st.booleans()):
        label = draw(st.lists(st.integers(0, 2), min_size=WORLD + 1, max_size=WORLD + 1))
        terms = [label[s.placement.rank] for s in shards]
    return fshard.Layout(layout.shape, tuple(shards), partial, terms)


@st.composite
def over_specs(draw: st.DrawFn, shape: tuple[int, ...]) -> fshard.Partial:
    """A pending reduction over some axes of a 2x2 mesh (maybe with an axis of 1), replicated over the others."""
    sides = draw(st.sampled_from([(2, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]))
    mesh = fshard.Mesh(sides, draw(st.permutations(range(WORLD)))[:4])
    axes = list(mesh.axis_names)
    partition = [draw(st.sampled_from([None, *axes])) for _ in shape]
    used = [a for a in partition if a is not None]
    if len(set(used)) != len(used) or len(set(used)) == len(axes):  # an axis twice, or none left to sum over
        partition = [None] * len(shape)
    unused = [a for a in axes if a not in partition]
    over = draw(st.lists(st.sampled_from(unused), min_size=1, max_size=max(1, len(unused) - 1), unique=True))
    op = draw(st.sampled_from(["sum", "sum", "max", "min"]))
    return fshard.Partial(fshard.Named(mesh, tuple(partition)), op, over=tuple(over))


@st.composite
def partial_pairs(draw: st.DrawFn) -> tuple[fshard.Layout, fshard.Layout]:
    """Two layouts of one shape, at least one with a pending reduction."""
    kind = draw(st.sampled_from(["over", "specs", "layouts"]))
    if kind == "over":  # summands with replicas on one side, anything on the other
        shape = draw(shapes(max_dims=3, max_side=7))
        a = draw(over_specs(shape)).layout(shape)
        b = draw(st.one_of(over_specs(shape), partial_specs(shape, world=WORLD), specs(shape, world=WORLD)))
        return (a, b.layout(shape)) if draw(st.booleans()) else (b.layout(shape), a)
    if kind == "specs":  # specs, partial ones of Named specs maybe over some mesh axes
        shape = draw(shapes(max_dims=3, max_side=7))
        a = draw(partial_specs(shape, world=WORLD)).layout(shape)
        b = draw(st.one_of(partial_specs(shape, world=WORLD), specs(shape, world=WORLD))).layout(shape)
        return (a, b) if draw(st.booleans()) else (b, a)
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


@given(st.data())
def test_values_survive_reshards_between_pending_reductions(data: st.DataObject) -> None:
    """A value made partial, resharded to any spec (partial or not) and gathered, is the value, bit for bit."""
    shape = data.draw(shapes(max_dims=2, max_side=6))
    a = data.draw(partial_specs(shape, world=WORLD))
    b = data.draw(st.one_of(partial_specs(shape, world=WORLD), specs(shape, world=WORLD)))
    x = torch.arange(float(np.prod(shape))).reshape(shape) - 3.0
    y = fshard.reshard(fshard.shard(x, a), b)
    assert torch.equal(fshard.gather(y), x)
    p = fshard.plan(a.layout(shape), y.layout)
    assert p.elements_sent == p.min_elements_sent
