"""Random pairs of layouts through the 4-process pool: bit-identical values, minimal traffic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

RANKS = (0, 1, 2, 3)


def _guillotine(draw, lo, hi, depth):
    """Boxes that tile ``[lo, hi)``: cut a random dim at a random point, recursively."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if depth == 0 or not dims or not draw(st.booleans()):
        return [(tuple(lo), tuple(b - a for a, b in zip(lo, hi)))]
    d = draw(st.sampled_from(dims))
    cut = draw(st.integers(lo[d] + 1, hi[d] - 1))
    left_hi, right_lo = list(hi), list(lo)
    left_hi[d], right_lo[d] = cut, cut
    return _guillotine(draw, lo, left_hi, depth - 1) + _guillotine(draw, right_lo, hi, depth - 1)


@st.composite
def layouts(draw, shape):
    kind = draw(st.sampled_from(["chunk", "named", "replicated", "explicit"] if shape else ["replicated", "explicit"]))
    if kind == "chunk":
        placements = draw(st.lists(st.sampled_from(RANKS), min_size=1, max_size=6))
        return fshard.Chunk(draw(st.integers(-len(shape), len(shape) - 1)), placements).layout(shape)
    if kind == "named":
        mesh = fshard.Mesh((2, 2), ranks=draw(st.permutations(RANKS)))
        axes = st.sampled_from([None, "x", "y", ("x", "y"), ("y", "x")])
        partition = draw(st.lists(axes, min_size=len(shape), max_size=len(shape)).filter(_no_axis_twice))
        return fshard.Named(mesh, tuple(partition)).layout(shape)
    if kind == "replicated":
        return fshard.Replicated(draw(st.lists(st.sampled_from(RANKS), min_size=1, max_size=4, unique=True))).layout(
            shape
        )
    boxes = _guillotine(draw, [0] * len(shape), list(shape), 3)
    metas = []
    for offsets, sizes in boxes:
        for r in draw(st.lists(st.sampled_from(RANKS), min_size=1, max_size=2, unique=True)):
            metas.append(fshard.ShardMeta(offsets, sizes, r))
    return fshard.Layout(shape, tuple(metas))


def _no_axis_twice(partition):
    used = [a for p in partition if p is not None for a in ((p,) if isinstance(p, str) else p)]
    return len(used) == len(set(used))


@st.composite
def pairs(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=2)))
    src = draw(st.sampled_from((None, *RANKS)))
    dst = draw(st.sampled_from((None, *RANKS)))
    return draw(layouts(shape)), draw(layouts(shape)), src, dst


def _round_trip(a, b, src, dst):
    """shard (from ``src``), reshard, gather (to ``dst``); returns what this rank sent in each step."""
    rank = dist.get_rank()
    x = torch.arange(a.numel, dtype=torch.float64).reshape(a.shape) * 1.5 - 3
    counters = TorchDistBackend().counters
    sent = []
    start = counters.elements_sent
    y = fshard.shard(x if src in (None, rank) else None, a, src=src)
    sent.append(counters.elements_sent - start)
    start = counters.elements_sent
    z = fshard.reshard(y, b)
    sent.append(counters.elements_sent - start)
    for s in z.addressable_shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        assert torch.equal(s.data, x[box])
    start = counters.elements_sent
    full = fshard.gather(z, dst=dst)
    sent.append(counters.elements_sent - start)
    assert (full is None) == (dst not in (None, rank))
    assert full is None or torch.equal(full, x)
    return sent


def _single(rank, shape):
    return fshard.Single(rank).layout(shape)


@settings(max_examples=20, deadline=None)
@given(pairs())
def test_random_layout_pairs_are_exact_and_send_the_minimum(dist_pool, pair):
    a, b, src, dst = pair
    per_rank = dist_pool.run(_round_trip, a, b, src, dst)
    sent = [sum(r[k] for r in per_rank) for k in range(3)]
    receivers = fshard.Replicated(list(RANKS) if dst is None else [dst]).layout(a.shape)
    assert sent[0] == (0 if src is None else fshard.plan(_single(src, a.shape), a).min_elements_sent)
    assert sent[1] == fshard.plan(a, b).min_elements_sent
    assert sent[2] == fshard.plan(b, receivers).min_elements_sent
