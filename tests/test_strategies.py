"""The public strategies' dtypes, values and array-with-layout pairs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import fshard
from fshard.testing import strategies as fst


@given(fst.dtypes())
def test_dtypes_default(dtype: torch.dtype) -> None:
    assert dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.bool)


def test_dtypes_follow_include() -> None:
    assert find(fst.dtypes([torch.int8, torch.complex64]), lambda d: d.is_complex) == torch.complex64


@pytest.mark.parametrize("include", [[], [torch.float8_e4m3fn]], ids=["empty", "unfillable"])
def test_dtypes_reject_what_arrays_cannot_fill(include: list[torch.dtype]) -> None:
    with pytest.raises(ValueError, match=re.escape("dtypes() takes a non-empty list of")):
        fst.dtypes(include)


def test_arrays_draw_fractional_and_large_floats() -> None:
    def fractional(x: fshard.ShardedArray) -> bool:
        full = fshard.gather(x)
        return bool((full != full.round()).any())

    def large(x: fshard.ShardedArray) -> bool:
        return bool((fshard.gather(x).abs() > 1e6).any())

    assert fractional(find(fst.arrays(dtype=torch.float64), fractional))
    assert large(find(fst.arrays(dtype=torch.float32), large))


@settings(max_examples=30)
@given(fst.arrays(dtype=fst.dtypes([torch.float16, torch.bfloat16, torch.complex128])))
def test_float_arrays_are_finite(x: fshard.ShardedArray) -> None:
    assert x.dtype in (torch.float16, torch.bfloat16, torch.complex128)
    assert bool(fshard.gather(x).isfinite().all())


@settings(max_examples=30)
@given(fst.arrays(dtype=torch.int32, elements=st.integers(-8, 7)))
def test_elements_choose_the_values(x: fshard.ShardedArray) -> None:
    full = fshard.gather(x)
    assert bool(((full >= -8) & (full <= 7)).all())


def test_values_cover_the_dtype() -> None:
    assert find(fst.values(torch.float32), lambda v: v == 0 and str(v) == "-0.0") == 0.0
    assert find(fst.values(torch.int64), lambda v: v > 2**40) > 2**40
    assert find(fst.values(torch.bool), lambda v: v) is True


@settings(max_examples=40)
@given(fst.arrays_and_layouts(fst.shapes(max_dims=3), world=3))
def test_arrays_and_layouts_share_a_shape(pair: tuple[fshard.ShardedArray, fshard.Layout]) -> None:
    x, layout = pair
    assert layout.shape == tuple(x.shape)
    assert max(layout.ranks, default=0) < 3
    assert fshard.equal(fshard.reshard(x, layout), x)


def test_arrays_reject_a_dtype_they_cannot_fill() -> None:
    with pytest.raises(ValueError, match=re.escape("arrays() cannot fill dtype torch.float8_e4m3fn")):
        find(fst.arrays(dtype=torch.float8_e4m3fn), lambda x: True)


@given(st.data())
def test_partial_specs_resolve_to_pending_reductions(data: st.DataObject) -> None:
    shape = data.draw(fst.shapes(max_dims=2))
    spec = data.draw(fst.partial_specs(shape))
    layout = spec.layout(shape)
    assert layout.partial == spec.op
    assert spec.over is None or isinstance(spec.spec, fshard.Named)


def test_partial_specs_draw_summands_with_replicas() -> None:
    spec = find(fst.partial_specs((4, 2)), lambda p: p.layout((4, 2)).terms is not None)
    assert spec.over is not None
    assert spec.layout((4, 2)).terms is not None


@given(fst.values(torch.bfloat16))
def test_bfloat16_values_are_what_bfloat16_holds(v: float) -> None:
    """They were float32 draws (1/3 as 0.3333333432674408, float32 subnormals), which bfloat16 rounds."""
    assert float(torch.tensor(v, dtype=torch.bfloat16)) == v


def test_guillotine_empty_shards_may_be_empty_along_any_dim() -> None:
    """Every empty shard had size 0 in dim 0."""
    layout = find(fst.guillotine_layouts((3, 3)), lambda lay: any(m.sizes == (1, 0) for m in lay.shards))
    assert any(m.sizes == (1, 0) for m in layout.shards)


def _one(strategy: st.SearchStrategy) -> object:
    return find(strategy, lambda _: True)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fst.placements(0), "placements() needs world >= 1 (ranks 0 .. world-1), got 0."),
        (lambda: fst.layouts((2,), world=0), "layouts() needs world >= 1"),
        (lambda: _one(fst.guillotine_layouts((4,), max_replicas=0)), "needs max_replicas >= 1, got 0."),
        (lambda: _one(fst.guillotine_layouts((4,), depth=-1)), "needs depth >= 0 (cuts of cuts), got -1."),
        (lambda: fst.values(torch.uint16), "values() cannot draw dtype torch.uint16; use one of"),
        (lambda: _one(fst.arrays((2,), dtype=st.just(torch.uint16))), "arrays() cannot fill dtype torch.uint16"),
        (
            lambda: _one(fst.arrays((4,), dtype=torch.uint8, elements=st.integers(-8, -1))),
            "arrays() elements= drew a value that torch.uint8 cannot hold",
        ),
    ],
    ids=[
        "world-0",
        "layouts-world-0",
        "max-replicas-0",
        "depth-negative",
        "values-uint16",
        "arrays-uint16",
        "uint8-neg",
    ],
)
def test_bad_parameters_raise_value_error_naming_them(make, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_one_dtype_is_a_list_of_one() -> None:
    assert find(fst.dtypes(torch.float32), lambda d: True) == torch.float32


@settings(max_examples=5)
@given(fst.named_specs(2, world=1000))
def test_named_specs_on_a_large_world_draw_only_their_meshs_ranks(spec: fshard.Named) -> None:
    """A permutation of the whole world was drawn to take a few ranks: hypothesis's health check refused it."""
    assert len(set(spec.mesh.ranks)) == len(spec.mesh.ranks) <= 1000
