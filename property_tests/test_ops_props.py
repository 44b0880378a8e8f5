"""The functional API on random layouts and dtypes: reshard, map_local, equal, allclose, plans.

Moved values are compared as raw bits, so NaN payloads, infinities and -0.0 must
all survive every movement; computed values (``map_local``) are compared bit for
bit except for NaN payloads, which torch's own kernels do not keep stable.
``reshard`` is a pure function: its input's shards keep their values and its
output owns new memory, except that an unchanged layout returns the input array
itself (as documented in docs/api.md).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard
from fshard.backends.local import LOCAL
from fshard.testing import strategies as fst

DTYPES = (torch.int64, torch.bool, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64)
FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SPECIAL = (float("nan"), float("inf"), float("-inf"), -0.0)

# -- strategies ----------------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values of ``dtype`` over its whole range; floats get NaN, infinities and -0.0 too."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g)
    x = (torch.randn(shape, generator=g, dtype=torch.float64 if dtype != torch.complex64 else dtype) * 100).to(dtype)
    if dtype in FLOATS and x.numel():
        flat = x.reshape(-1)
        for value in draw(st.lists(st.sampled_from(SPECIAL), max_size=3)):
            flat[draw(st.integers(0, flat.numel() - 1))] = value
    return x


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, fshard.Layout, fshard.Layout]:
    """A tensor of a random dtype and two random layouts of its shape (over up to 3 and up to 6 ranks)."""
    shape = draw(fst.shapes(max_dims=3, max_side=6))
    x = draw(tensors(shape, draw(st.sampled_from(DTYPES))))
    return x, draw(fst.layouts(shape, world=3)), draw(fst.layouts(shape, world=6))


# -- helpers -------------------------------------------------------------------------------

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` (complex as pairs of floats, bool as bytes)."""
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INTS[t.element_size()]) if t.dim() else t.reshape(1).view(_INTS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical except that any NaN equals any NaN: torch's kernels give NaN results
    payloads that depend on the tensor's size (bfloat16 arithmetic, for one)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and same_bits(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel():
        return False
    (lo_a, hi_a), (lo_b, hi_b) = storage_span(a), storage_span(b)
    return lo_a < hi_b and lo_b < hi_a


def elementwise(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A shape-preserving fn that changes every value of ``dtype``."""
    if dtype == torch.bool:
        return torch.logical_not
    if dtype == torch.int64:
        return lambda t: t * 3 - 7
    return lambda t: -t * 2


def cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A shape-preserving fn that changes the dtype."""
    return lambda t: t.to(torch.complex128 if dtype.is_complex else torch.float64)


def perturb(x: torch.Tensor, k: int, amount: float) -> torch.Tensor:
    """``x`` with element ``k`` (of its flat view) moved by ``amount`` (flipped, for bool)."""
    y = x.clone()
    flat = y.reshape(-1)
    flat[k] = ~flat[k] if y.dtype == torch.bool else flat[k] + torch.tensor(amount).to(y.dtype)
    return y


# -- reshard -------------------------------------------------------------------------------


@given(cases())
def test_reshard_round_trip_is_bit_identical(case: tuple[torch.Tensor, fshard.Layout, fshard.Layout]) -> None:
    x, a, b = case
    xa = fshard.shard(x, a)
    assert same_bits(fshard.gather(xa), x)
    y = fshard.reshard(xa, b)
    assert y.layout == b
    assert y.dtype == x.dtype
    assert same_bits(fshard.gather(y), x)


@given(cases())
def test_reshard_neither_mutates_nor_aliases_its_input(case: tuple[torch.Tensor, fshard.Layout, fshard.Layout]) -> None:
    x, a, b = case
    xa = fshard.shard(x, a)
    before = [t.clone() for t in xa.addressable_data]
    y = fshard.reshard(xa, b)
    assert xa.layout == a
    assert all(same_bits(t, u) for t, u in zip(xa.addressable_data, before))
    if b == a:
        assert y is xa
        return
    assert not any(shares_memory(t, u) for t in y.addressable_data for u in xa.addressable_data)
    for t in y.addressable_data:
        t.zero_()
    assert all(same_bits(t, u) for t, u in zip(xa.addressable_data, before))


@given(cases())
def test_reshard_there_and_back_gives_the_same_shards(case: tuple[torch.Tensor, fshard.Layout, fshard.Layout]) -> None:
    x, a, b = case
    xa = fshard.shard(x, a)
    back = fshard.reshard(fshard.reshard(xa, b), a)
    assert back.layout == a
    for s, t in zip(xa.addressable_shards, back.addressable_shards):
        assert s.meta == t.meta
        assert same_bits(s.data, t.data)


@given(cases())
def test_resharding_a_layout_equal_to_the_current_one_returns_the_array(
    case: tuple[torch.Tensor, fshard.Layout, fshard.Layout],
) -> None:
    x, a, _ = case
    xa = fshard.shard(x, a)
    assert fshard.reshard(xa, pickle.loads(pickle.dumps(a))) is xa


# -- map_local -----------------------------------------------------------------------------


@given(cases(), st.sampled_from(["elementwise", "cast"]))
def test_map_local_equals_fn_on_the_gathered_tensor(
    case: tuple[torch.Tensor, fshard.Layout, fshard.Layout], kind: str
) -> None:
    x, a, _ = case
    fn = elementwise(x.dtype) if kind == "elementwise" else cast(x.dtype)
    xa = fshard.shard(x, a)
    y = fshard.map_local(fn, xa)
    assert y.layout == a
    assert same_values(fshard.gather(y), fn(x))
    assert same_bits(fshard.gather(xa), x)


@given(cases(), st.data())
def test_map_local_over_two_arrays_equals_fn_on_both_gathered(
    case: tuple[torch.Tensor, fshard.Layout, fshard.Layout], data: st.DataObject
) -> None:
    x, a, b = case
    y = data.draw(tensors(tuple(x.shape), x.dtype))
    fn = torch.logical_xor if x.dtype == torch.bool else torch.sub
    # map_local needs one layout: the second array is resharded into the first's.
    out = fshard.map_local(fn, fshard.shard(x, a), fshard.reshard(fshard.shard(y, b), a))
    assert out.layout == a
    assert same_values(fshard.gather(out), fn(x, y))


# -- equal and allclose --------------------------------------------------------------------


@st.composite
def comparisons(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, fshard.Layout, fshard.Layout]:
    """``x``, a ``y`` equal to it or one element off (by a tiny or a large step), and two layouts."""
    x, a, b = draw(cases())
    if not x.numel() or draw(st.booleans()):
        return x, x.clone(), a, b
    k = draw(st.integers(0, x.numel() - 1))
    return x, perturb(x, k, draw(st.sampled_from([1e-9, 1e-3, 1.0, 1e6]))), a, b


@given(comparisons())
def test_equal_agrees_with_torch_on_gathered_values(case: tuple) -> None:
    x, y, a, b = case
    assert fshard.equal(fshard.shard(x, a), fshard.shard(y, b)) == torch.equal(x, y)


@given(comparisons(), st.sampled_from([(1e-5, 1e-8), (1e-2, 1e-3), (0.0, 0.0)]), st.booleans())
def test_allclose_agrees_with_torch_on_gathered_values(case: tuple, tol: tuple[float, float], equal_nan: bool) -> None:
    x, y, a, b = case
    rtol, atol = tol
    got = fshard.allclose(fshard.shard(x, a), fshard.shard(y, b), rtol=rtol, atol=atol, equal_nan=equal_nan)
    assert got == torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)


@given(fst.arrays(), st.data())
def test_equal_agrees_with_torch_on_strategy_arrays(x: fshard.ShardedArray, data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([tuple(x.shape), data.draw(fst.shapes())]))
    y = data.draw(fst.arrays(shape=shape, dtype=x.dtype))
    assert fshard.equal(x, y) == torch.equal(fshard.gather(x), fshard.gather(y))


# -- plans ---------------------------------------------------------------------------------


@given(fst.layout_pairs(fst.shapes(max_dims=3, max_side=12), world=6))
def test_plans_send_the_minimum(pair: tuple[fshard.Layout, fshard.Layout]) -> None:
    a, b = pair
    p = fshard.plan(a, b)
    assert p.elements_sent == p.min_elements_sent
    assert int(p.traffic().sum()) == p.elements_sent
    assert int(np.trace(p.traffic())) == 0
    assert p.bytes_sent(6) == 6 * p.elements_sent
    assert fshard.plan(a, a).elements_sent == 0


@given(fst.layout_pairs(fst.shapes(max_dims=3, max_side=12), world=6))
def test_plans_are_cached_by_value(pair: tuple[fshard.Layout, fshard.Layout]) -> None:
    a, b = pair
    p = fshard.plan(a, b)
    a2, b2 = pickle.loads(pickle.dumps(a)), pickle.loads(pickle.dumps(b))
    assert a2 is not a
    assert fshard.plan(a2, b2) is p
    assert fshard.plan(a, b) is p


@given(cases())
def test_local_backend_counts_what_the_plan_sends(case: tuple[torch.Tensor, fshard.Layout, fshard.Layout]) -> None:
    x, a, b = case
    xa = fshard.shard(x, a)
    start = LOCAL.counters.elements_sent
    fshard.reshard(xa, b)
    assert LOCAL.counters.elements_sent - start == (fshard.plan(a, b).elements_sent if a != b else 0)


# -- the public strategies -----------------------------------------------------------------


@given(fst.arrays())
def test_strategy_arrays_are_valid(x: fshard.ShardedArray) -> None:
    assert isinstance(x, fshard.ShardedArray)
    assert x.backend == LOCAL
    assert tuple(x.shape) == x.layout.shape
    assert x.dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.bool)
    assert len(x.addressable_shards) == len(x.layout.shards)
    full = fshard.gather(x)
    for s in x.addressable_shards:
        assert tuple(s.data.shape) == s.meta.sizes
        assert s.data.dtype == x.dtype
        if s.meta.numel:
            assert torch.equal(s.data, full[tuple(slice(o, o + z) for o, z in zip(s.meta.offsets, s.meta.sizes))])
    if x.dtype.is_floating_point:
        assert bool(torch.isfinite(full).all())
    assert x.layout.ranks == () or max(x.layout.ranks) < 4


@given(st.data(), fst.shapes(), st.sampled_from(DTYPES), st.integers(1, 8))
def test_strategy_arrays_follow_their_arguments(
    data: st.DataObject, shape: tuple[int, ...], dtype: torch.dtype, world: int
) -> None:
    x = data.draw(fst.arrays(shape=shape, dtype=dtype, world=world))
    assert tuple(x.shape) == shape
    assert x.dtype == dtype
    assert max(x.layout.ranks, default=0) < world


@given(st.data(), fst.shapes(min_dims=1, min_side=1), st.integers(1, 6), st.integers(1, 3))
def test_guillotine_layouts_follow_their_arguments(
    data: st.DataObject, shape: tuple[int, ...], world: int, reps: int
) -> None:
    layout = data.draw(fst.guillotine_layouts(shape, world, max_replicas=reps, empty=False))
    assert all(s.numel for s in layout.shards)
    assert max(layout.ranks) < world
    copies: dict[tuple, int] = {}
    for s in layout.shards:
        copies[(s.offsets, s.sizes)] = copies.get((s.offsets, s.sizes), 0) + 1
    assert max(copies.values()) <= min(reps, world)
    assert sum(math.prod(box[1]) for box in copies) == math.prod(shape)


@given(st.data(), fst.shapes(), st.integers(1, 6))
def test_strategy_specs_resolve_for_their_shape(data: st.DataObject, shape: tuple[int, ...], world: int) -> None:
    spec = data.draw(fst.specs(shape, world))
    layout = spec.layout(shape)
    assert layout.shape == shape
    assert max(layout.ranks) < world
    if isinstance(spec, fshard.Named):
        used = [a for p in spec.partition if p is not None for a in ((p,) if isinstance(p, str) else p)]
        assert len(used) == len(set(used))
        assert spec.mesh.ranks is not None
        assert len({p.rank for p in spec.mesh.ranks}) == math.prod(spec.mesh.shape) <= world
