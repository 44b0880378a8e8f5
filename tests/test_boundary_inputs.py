"""Inputs that torch accepts but fshard cannot shard as they are, refused or handled at
the boundary: quantized and nested tensors, meta tensors bound for real devices, empty
shapes whose other extents overflow, and conjugate or negative views (whose values
are taken, not their lazy bits)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import fshard
from fshard import Chunk, LayoutError, Replicated, SpecError

HALVES = Chunk(0, [0, 1])
ON_META = Chunk(0, ["rank:0/meta", "rank:1/meta"])
Z = torch.arange(12.0).reshape(3, 4) + 1j * torch.arange(12.0, 24.0).reshape(3, 4)  # complex64


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(torch.ones(4, 4), 0.1, 0, torch.quint8)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested tensors are a prototype
        return torch.nested.nested_tensor([torch.ones(4), torch.ones(4)])


QUANTIZED = "shard() input has quantized dtype torch.quint8, which fshard cannot shard: dequantize it (x.dequantize())."
NESTED = "shard() input is a nested tensor; only dense tensors can be sharded: pad it first (x.to_padded_tensor(0))."


@pytest.mark.parametrize("src", [None, 0])
@pytest.mark.parametrize(("make", "message"), [(_quantized, QUANTIZED), (_nested, NESTED)], ids=["quantized", "nested"])
def test_unsupported_tensor_kinds_are_refused_by_shard(make, message: str, src: int | None) -> None:
    want = message if src is None else message.replace("shard() input", "shard() input on rank 0")
    with pytest.raises(SpecError, match=re.escape(want)):
        fshard.shard(make(), HALVES, src=src)


def test_a_quantized_result_of_map_local_is_refused() -> None:
    x = fshard.shard(torch.ones(4, 4), HALVES)
    q = _quantized()
    want = "map_local() fn result has quantized dtype torch.quint8"
    with pytest.raises(SpecError, match=re.escape(want)):
        fshard.map_local(lambda t: q[: t.shape[0]], x)
    with pytest.raises(SpecError, match=re.escape(want)):
        fshard.map_local(lambda t: {"q": q[: t.shape[0]]}, x)


def test_a_quantized_shard_is_refused_by_from_local_shards_and_layout() -> None:
    layout = HALVES.layout((4, 4))
    q = _quantized()
    parts = [fshard.Shard(m, q[m.offsets[0] : m.offsets[0] + m.sizes[0]]) for m in layout.shards]
    with pytest.raises(SpecError, match=re.escape("has quantized dtype torch.quint8")):
        fshard.from_local_shards_and_layout(parts, layout)


META_TO_CPU = (
    "is on the meta device, which holds no values, but the spec places shards on ['cpu']: "
    "place them on the meta device too ('rank:0/meta'), or pass a tensor that holds values."
)


@pytest.mark.parametrize("src", [None, 0])
@pytest.mark.parametrize("spec", [HALVES, Chunk(0, ["rank:0/meta", "rank:1/cpu"])], ids=["cpu", "meta-and-cpu"])
def test_a_meta_tensor_bound_for_the_cpu_is_refused(spec, src: int | None) -> None:
    what = "shard() input" if src is None else "shard() input on rank 0"
    with pytest.raises(SpecError, match=re.escape(f"{what} {META_TO_CPU}")):
        fshard.shard(torch.ones(4, 4, device="meta"), spec, src=src)


@pytest.mark.parametrize("src", [None, 0])
def test_a_meta_tensor_onto_meta_placements_still_works(src: int | None) -> None:
    x = fshard.shard(torch.ones(4, 4, device="meta"), ON_META, src=src)
    assert [(s.data.device.type, tuple(s.data.shape)) for s in x.addressable_shards] == [("meta", (2, 4))] * 2


@pytest.mark.parametrize("make", [fshard.zeros, fshard.ones, fshard.empty, fshard.rand, fshard.randn])
def test_an_empty_shape_whose_other_extents_overflow_is_refused(make) -> None:
    want = (
        "shape (1099511627776, 1099511627776, 0) gives shard 0 sizes (549755813888, 1099511627776, 0): "
        "more than 2**63 - 1 bytes of torch.float32, the most one tensor holds (it is empty, but torch "
        "counts the extents other than 0 all the same). Use a smaller shape or more shards."
    )
    with pytest.raises(LayoutError, match=re.escape(want)):
        make(HALVES, 2**40, 2**40, 0)


def test_an_overflowing_shape_without_a_zero_is_refused() -> None:
    want = "shape (4294967296, 4294967296) gives shard 0 sizes (2147483648, 4294967296): more than 2**63 - 1 bytes"
    with pytest.raises(LayoutError, match=re.escape(want)):
        fshard.zeros(HALVES, 2**32, 2**32)


def test_a_large_empty_shape_that_fits_works() -> None:
    x = fshard.zeros(HALVES, 2**20, 2**20, 0)
    assert [tuple(s.data.shape) for s in x.addressable_shards] == [(2**19, 2**20, 0)] * 2
    assert tuple(fshard.gather(x).shape) == (2**20, 2**20, 0)
    assert tuple(fshard.gather(fshard.reshard(x, Chunk(1, [0, 1]))).shape) == (2**20, 2**20, 0)


VIEWS = {
    "conj": lambda: Z.conj(),
    "conj-imag": lambda: Z.conj().imag,  # a negative view
    "neg-view": lambda: torch._neg_view(Z.real),
    "conj-transposed": lambda: Z.conj().t(),
}


@pytest.mark.parametrize("src", [None, 0])
@pytest.mark.parametrize("view", VIEWS)
def test_conjugate_and_negative_views_shard_to_their_values(view: str, src: int | None) -> None:
    x = VIEWS[view]()
    assert x.is_conj() or x.is_neg()
    want = x.resolve_conj().resolve_neg()
    a = fshard.shard(x, Chunk(0, [0, 1]), src=src)
    assert not any(s.data.is_conj() or s.data.is_neg() for s in a.addressable_shards)
    assert torch.equal(fshard.gather(a), want)
    assert torch.equal(fshard.gather(fshard.reshard(a, Replicated([0, 1]))), want)


def test_map_local_results_that_are_conjugate_views_hold_their_values() -> None:
    a = fshard.shard(Z, Chunk(0, [0, 1]))
    y = fshard.map_local(torch.conj, a)
    assert not any(s.data.is_conj() for s in y.addressable_shards)
    assert torch.equal(fshard.gather(y), Z.conj().resolve_conj())
    pair = fshard.map_local(lambda t: (t.conj(), t.conj().imag), a)
    assert not any(s.data.is_conj() or s.data.is_neg() for p in pair for s in p.addressable_shards)
    assert torch.equal(fshard.gather(pair[1]), -Z.imag)


def test_results_through_out_spec_and_shard_map_are_checked_and_resolved() -> None:
    x = fshard.shard(torch.ones(4, 4), HALVES)
    q = _quantized()
    with pytest.raises(SpecError, match=re.escape("map_local() fn result has quantized dtype torch.quint8")):
        fshard.map_local(lambda t: q[: t.shape[0]], x, out_spec=HALVES)
    with pytest.raises(SpecError, match=re.escape("shard_map() fn result has layout torch.sparse_coo")):
        fshard.shard_map(lambda t: t.to_sparse(), HALVES, HALVES)(x)
    with pytest.raises(SpecError, match=re.escape("shard_map() fn result is a nested tensor")):
        fshard.shard_map(lambda t: torch.nested.nested_tensor(list(t)), HALVES, HALVES)(x)
    z = fshard.shard(Z, HALVES)
    for y in (fshard.map_local(torch.conj, z, out_spec=HALVES), fshard.shard_map(torch.conj, HALVES, HALVES)(z)):
        assert not any(s.data.is_conj() for s in y.addressable_shards)
        assert torch.equal(fshard.gather(y), Z.conj().resolve_conj())
