"""Box geometry against brute force: intersection joins, exact layout validation, minimal plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard
import fshard._layout.layout
from fshard._base import boxes as _boxes
from fshard._layout.layout import Layout, ShardMeta
from fshard.testing.strategies import guillotine_layouts as layouts

# -- strategies ------------------------------------------------------------------------


@st.composite
def box_sets(draw: st.DrawFn, d: int, n_max: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Random boxes, including empty and boundary-touching ones, at small or huge coordinates."""
    scale = draw(st.sampled_from([3, 8, 50, 2**40]))
    n = draw(st.integers(0, n_max))
    points = st.lists(st.integers(0, scale), min_size=d, max_size=d)
    lo = np.array(draw(st.lists(points, min_size=n, max_size=n)), np.int64)
    ext = st.one_of(st.integers(0, 2), st.integers(0, scale))
    size = np.array(draw(st.lists(st.lists(ext, min_size=d, max_size=d), min_size=n, max_size=n)), np.int64)
    return lo.reshape(n, d), (lo + size).reshape(n, d)


shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)

# -- brute force -----------------------------------------------------------------------


def brute_pairs(lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray) -> set[tuple[int, int]]:
    """Every pair of boxes that share an element, by checking all pairs."""
    return {
        (i, j)
        for i in range(len(lo_a))
        for j in range(len(lo_b))
        if (np.maximum(lo_a[i], lo_b[j]) < np.minimum(hi_a[i], hi_b[j])).all()
    }


def brute_valid(shape: tuple[int, ...], shards: list[ShardMeta]) -> bool:
    """The layout invariants, checked element by element (equal empty shards hold nothing and are allowed)."""
    nonempty = [s for s in shards if s.numel]
    if len(set(nonempty)) != len(nonempty):
        return False
    boxes = {(s.offsets, s.sizes) for s in shards if all(z > 0 for z in s.sizes)}
    cover = np.zeros(shape, np.int64)
    for offsets, sizes in boxes:
        if any(o + z > n for o, z, n in zip(offsets, sizes, shape)):
            return False
        cover[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))] += 1
    return bool((cover == 1).all())


def holders(layout: Layout, shape: tuple[int, ...]) -> dict[tuple[int, ...], set[int]]:
    """For each element, the ranks that hold it."""
    out: dict[tuple[int, ...], set[int]] = {p: set() for p in itertools.product(*map(range, shape))}
    for s in layout.shards:
        for p in itertools.product(*(range(o, o + z) for o, z in zip(s.offsets, s.sizes))):
            out[p].add(s.placement.rank)
    return out


# -- intersect_pairs ---------------------------------------------------------------------


@pytest.fixture(params=["classes", "rounded"])
def class_budget(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs a test as is, and again with extents forced into rounded classes (the large-n path)."""
    if request.param == "rounded":
        monkeypatch.setattr(_boxes, "_CLASS_BUDGET", 0)
        monkeypatch.setattr(_boxes, "_CLASS_SLACK", 0)


@pytest.mark.usefixtures("class_budget")
@given(st.integers(0, 3).flatmap(lambda d: st.tuples(box_sets(d), box_sets(d))))
def test_intersect_pairs_matches_brute_force(sets: tuple) -> None:
    (lo_a, hi_a), (lo_b, hi_b) = sets
    ia, ib = _boxes.intersect_pairs(lo_a, hi_a, lo_b, hi_b)
    got = list(zip(ia.tolist(), ib.tolist()))
    assert len(got) == len(set(got)), "a pair was reported twice"
    assert set(got) == brute_pairs(lo_a, hi_a, lo_b, hi_b)
    assert got == sorted(got, key=lambda p: (p[1], p[0]))


@pytest.mark.usefixtures("class_budget")
@given(shapes.flatmap(lambda s: st.tuples(layouts(s), layouts(s))))
def test_intersect_pairs_of_tilings(pair: tuple[Layout, Layout]) -> None:
    a, b = pair
    lo_a, hi_a, lo_b, hi_b = a.columns.lo, a.columns.lo + a.columns.sz, b.columns.lo, b.columns.lo + b.columns.sz
    ia, ib = _boxes.intersect_pairs(lo_a, hi_a, lo_b, hi_b)
    assert set(zip(ia.tolist(), ib.tolist())) == brute_pairs(lo_a, hi_a, lo_b, hi_b)


def test_touching_boxes_do_not_intersect() -> None:
    lo = np.array([[0, 0], [0, 2], [2, 0]])
    hi = np.array([[2, 2], [2, 4], [4, 2]])
    ia, ib = _boxes.intersect_pairs(lo[:1], hi[:1], lo[1:], hi[1:])
    assert ia.size == 0
    assert ib.size == 0


# -- rows and keys -----------------------------------------------------------------------


@given(st.lists(st.lists(st.integers(-3, 2**62), min_size=2, max_size=2), max_size=12))
def test_unique_rows_matches_numpy(values: list[list[int]]) -> None:
    rows = np.array(values, np.int64).reshape(-1, 2)
    first, inverse = _boxes.unique_rows(rows)
    if not len(rows):
        assert first.size == 0
        return
    _, np_first, np_inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    assert first.tolist() == np_first.tolist()
    assert inverse.tolist() == np_inverse.ravel().tolist()


# -- validation ----------------------------------------------------------------------------


@st.composite
def candidate_layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[ShardMeta]]:
    """Shards that may or may not tile the shape: near-tilings, overlaps, gaps, duplicates."""
    shape = draw(shapes)
    shards = list(draw(layouts(shape)).shards)
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["drop", "add", "duplicate", "grow"]))
        if action == "drop" and shards:
            shards.pop(draw(st.integers(0, len(shards) - 1)))
        elif action == "duplicate" and shards:
            shards.append(shards[draw(st.integers(0, len(shards) - 1))])
        elif action == "add":
            offsets = tuple(draw(st.integers(0, s)) for s in shape)
            sizes = tuple(draw(st.integers(0, s)) for s in shape)
            shards.append(ShardMeta(offsets, sizes, draw(st.integers(0, 5))))
        elif action == "grow" and shards and shape:
            s = shards.pop(draw(st.integers(0, len(shards) - 1)))
            k = draw(st.integers(0, len(shape) - 1))
            sizes = tuple(z + (i == k) for i, z in enumerate(s.sizes))
            shards.append(ShardMeta(s.offsets, sizes, s.placement))
    return shape, shards


@pytest.fixture(params=["memo", "direct"])
def validation_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validates small layouts through the memo, and again directly (the path of large ones)."""
    if request.param == "direct":
        monkeypatch.setattr(fshard._layout.layout, "MEMO_SHARDS", 0)


@pytest.mark.usefixtures("validation_path")
@given(candidate_layouts())
def test_validation_matches_brute_force(case: tuple[tuple[int, ...], list[ShardMeta]]) -> None:
    shape, shards = case
    try:
        Layout(shape, tuple(shards))
        valid = True
    except fshard.LayoutError:
        valid = False
    assert valid == brute_valid(shape, shards)


def test_corner_sums_of_a_tiling_are_the_shape_corners() -> None:
    lo = np.array([[0, 0], [0, 2], [3, 0]])
    hi = np.array([[3, 2], [3, 5], [4, 5]])
    assert _boxes.corner_sums(lo, hi, np.array([4, 5])) == {(0, 0): 1, (4, 0): -1, (0, 5): -1, (4, 5): 1}


# -- plans ---------------------------------------------------------------------------------


@given(shapes.filter(lambda s: len(s) > 0 and np.prod(s) <= 64).flatmap(lambda s: st.tuples(layouts(s), layouts(s))))
def test_plan_is_minimal_and_complete(pair: tuple[Layout, Layout]) -> None:
    a, b = pair
    p = fshard.plan(a, b)
    held_a, held_b = holders(a, a.shape), holders(b, b.shape)
    minimum = sum(len(held_b[e] - held_a[e]) for e in held_a)
    assert p.min_elements_sent == minimum
    assert p.elements_sent == minimum
    assert int(p.traffic().sum()) == minimum
    # Every element of every destination shard is written exactly once, from a source that holds it.
    written = {j: np.zeros(b.shards[j].sizes, np.int64) for j in range(len(b.shards))}
    for t in p.transfers:
        (lo, size), src, dst = t.box, a.shards[t.src_shard], b.shards[t.dst_shard]
        assert src.placement.rank == t.src_rank
        assert dst.placement.rank == t.dst_rank
        for meta in (src, dst):
            assert all(o <= x and x + z <= o + m for x, z, o, m in zip(lo, size, meta.offsets, meta.sizes))
        written[t.dst_shard][tuple(slice(x - o, x - o + z) for x, z, o in zip(lo, size, dst.offsets))] += 1
    assert all((w == 1).all() for w in written.values())


@given(shapes.filter(lambda s: np.prod(s) <= 64).flatmap(lambda s: st.tuples(layouts(s), layouts(s))))
def test_local_reshard_moves_the_right_values(pair: tuple[Layout, Layout]) -> None:
    a, b = pair
    x = torch.arange(float(np.prod(a.shape, dtype=np.int64))).reshape(a.shape)
    y = fshard.reshard(fshard.shard(x, a), b)
    for s in y.addressable_shards:
        if 0 in s.meta.sizes:  # an empty shard may sit past the end, where slicing x would clip
            assert tuple(s.data.shape) == s.meta.sizes
            continue
        assert torch.equal(s.data, x[tuple(slice(o, o + z) for o, z in zip(s.meta.offsets, s.meta.sizes))])
