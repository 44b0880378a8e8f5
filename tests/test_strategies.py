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
