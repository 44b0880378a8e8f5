"""Layout-invariant random numbers: ``rand``, ``randn``, ``rand_like`` and ``randn_like``.

Each element is a hash of (seed, global index), so the gathered values must be
bit-identical for every layout of a shape (any spec, rank count, replicas, empty
shards) and every dtype's values are compared as raw bits. The distribution
checks use fixed seeds and large samples: the values are a pure function of the
seed, so their bounds either always hold or never do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard
from fshard.testing import strategies as fst

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAKERS: dict[str, Callable[..., fshard.ShardedArray]] = {"rand": fshard.rand, "randn": fshard.randn}
LIKE: dict[str, Callable[..., fshard.ShardedArray]] = {"rand": fshard.rand_like, "randn": fshard.randn_like}

seeds = st.integers(-(2**63), 2**63 - 1)
shapes = fst.shapes(max_dims=3, max_side=7)


@st.composite
def layouts_of_two_worlds(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[fshard.Layout, fshard.Layout]:
    """Two layouts of ``shape``: one over at most 2 ranks, one over at most 8."""
    return draw(fst.layouts(shape, world=2)), draw(fst.layouts(shape, world=8))


cases = shapes.flatmap(lambda s: st.tuples(st.just(s), layouts_of_two_worlds(s)))

# -- helpers -------------------------------------------------------------------------------

_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor (so -0.0 and 0.0 differ, as do NaN payloads)."""
    return t.contiguous().view(_INTS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def replicas_agree(x: fshard.ShardedArray) -> bool:
    """Every shard holding a box has the same bits as the first shard that holds it."""
    first: dict[tuple, torch.Tensor] = {}
    for s in x.addressable_shards:
        ref = first.setdefault((s.meta.offsets, s.meta.sizes), s.data)
        if not same_bits(ref, s.data):
            return False
    return True


def sample(kind: str, n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return fshard.gather(MAKERS[kind](fshard.Chunk(0, [0, 1, 2]), n, seed=seed, dtype=dtype)).double()


# -- layout invariance ---------------------------------------------------------------------


@given(cases, seeds, st.sampled_from(FLOATS), st.sampled_from(sorted(MAKERS)))
def test_values_do_not_depend_on_the_layout(case: tuple, seed: int, dtype: torch.dtype, kind: str) -> None:
    shape, (a, b) = case
    x, y = MAKERS[kind](a, shape, seed=seed, dtype=dtype), MAKERS[kind](b, shape, seed=seed, dtype=dtype)
    assert x.layout == a
    assert y.layout == b
    assert x.dtype == y.dtype == dtype
    gx, gy = fshard.gather(x), fshard.gather(y)
    assert tuple(gx.shape) == shape
    assert same_bits(gx, gy)
    assert replicas_agree(x)
    assert replicas_agree(y)
    assert bool(torch.isfinite(gx).all())


@given(cases, seeds, st.sampled_from(FLOATS), st.sampled_from(sorted(MAKERS)))
def test_like_functions_match_the_makers(case: tuple, seed: int, dtype: torch.dtype, kind: str) -> None:
    shape, (a, b) = case
    template = fshard.zeros(a, shape, dtype=dtype)
    x = LIKE[kind](template, seed=seed)
    assert x.layout == a
    assert x.dtype == dtype
    assert same_bits(fshard.gather(x), fshard.gather(MAKERS[kind](b, shape, seed=seed, dtype=dtype)))
    other = torch.float64 if dtype != torch.float64 else torch.float32
    assert LIKE[kind](template, seed=seed, dtype=other).dtype == other


@given(cases, seeds, st.sampled_from(FLOATS))
def test_rand_lies_in_the_unit_interval(case: tuple, seed: int, dtype: torch.dtype) -> None:
    shape, (a, _) = case
    u = fshard.gather(fshard.rand(a, shape, seed=seed, dtype=dtype))
    assert bool((u >= 0).all())
    assert bool((u < 1).all())


@given(fst.shapes(min_dims=1, min_side=1, max_side=7).filter(lambda s: math.prod(s) >= 16), seeds, seeds)
@settings(max_examples=20)
def test_different_seeds_give_different_values(shape: tuple[int, ...], s: int, t: int) -> None:
    spec = fshard.Chunk(0, [0, 1])
    for kind in MAKERS:
        for dtype in FLOATS:
            x = fshard.gather(MAKERS[kind](spec, shape, seed=s, dtype=dtype))
            y = fshard.gather(MAKERS[kind](spec, shape, seed=t, dtype=dtype))
            assert same_bits(x, y) == (s == t)


@given(st.integers(-(2**62), 2**62), st.integers(1, 3))
@settings(max_examples=10)
def test_rand_is_not_the_angle_of_randn_at_a_nearby_seed(seed: int, step: int) -> None:
    """Box-Muller's angle stream of one seed must not be the uniform stream of another."""
    z = sample("randn", 4096, seed)
    u = sample("rand", 4096, seed + step)
    agree = ((z > 0) == (torch.cos(2 * math.pi * u) > 0)).double().mean().item()
    assert 0.4 < agree < 0.6


def test_seed_is_taken_as_a_64_bit_pattern() -> None:
    spec = fshard.Chunk(0, [0, 1])
    assert torch.equal(
        fshard.gather(fshard.rand(spec, 64, seed=-1)), fshard.gather(fshard.rand(spec, 64, seed=2**64 - 1))
    )
    assert not torch.equal(
        fshard.gather(fshard.rand(spec, 64, seed=0)), fshard.gather(fshard.rand(spec, 64, seed=2**62))
    )


# -- distribution --------------------------------------------------------------------------

N = 1 << 18


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rand_looks_uniform(dtype: torch.dtype) -> None:
    u = sample("rand", N, 2024, dtype)
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.std().item() - math.sqrt(1 / 12)) < 0.005
    counts = torch.histc(u, bins=16, min=0.0, max=1.0) / N
    assert bool(((counts - 1 / 16).abs() < 0.005).all())
    bits_held = 1 - round(math.log2(torch.finfo(dtype).eps))  # significand bits, 24 for float32
    k = u * 2.0**bits_held
    assert torch.equal(k, k.round())  # multiples of 2**-bits_held...
    assert bool((k % 2 == 1).any())  # ...down to the last bit
    if bits_held <= 11:
        assert torch.unique(u).numel() == 2**bits_held  # every value is drawn


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_randn_looks_standard_normal(dtype: torch.dtype) -> None:
    z = sample("randn", N, 2024, dtype)
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1) < 0.01
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.01
    assert abs((z.abs() < 2).double().mean().item() - 0.9545) < 0.01
    assert abs((z**3).mean().item()) < 0.05  # skew
    assert abs((z**4).mean().item() - 3) < 0.1  # kurtosis


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_neighbouring_elements_are_uncorrelated(kind: str) -> None:
    x = sample(kind, N, 7)
    lag = torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1].item()
    rows = torch.corrcoef(torch.stack([x[: N // 2], x[N // 2 :]]))[0, 1].item()
    assert abs(lag) < 0.01
    assert abs(rows) < 0.01


# -- seed=None -----------------------------------------------------------------------------


@given(cases, st.integers(0, 2**32 - 1), st.sampled_from(sorted(MAKERS)))
@settings(max_examples=20)
def test_manual_seed_makes_seed_none_repeatable(case: tuple, torch_seed: int, kind: str) -> None:
    shape, (a, b) = case
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed)
        first = fshard.gather(MAKERS[kind](a, shape))
        second = fshard.gather(LIKE[kind](fshard.zeros(b, shape)))
        torch.manual_seed(torch_seed)
        first_again = fshard.gather(LIKE[kind](fshard.zeros(b, shape)))
        second_again = fshard.gather(MAKERS[kind](a, shape))
    assert same_bits(first, first_again)
    assert same_bits(second, second_again)
    if math.prod(shape) >= 8:
        assert not same_bits(first, second)  # the generator moved on: a new seed
