"""Creation functions at the edges: pending reductions, dtypes that hold no random values, and
shards too large for one tensor, with the same answer (value or error) on every rank."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._api.creation import _filled

RANKS = [0, 1, 2]
SUM = fshard.Partial(fshard.Replicated(RANKS))
MESH = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
OVER_TP = fshard.Partial(fshard.Named(MESH, (None,)), over="tp")  # terms [0, 1, 0, 1]
OVER_DP = fshard.Partial(fshard.Named(MESH, (None,)), over="dp")  # terms [0, 0, 1, 1]


def _pending_sum() -> fshard.ShardedArray:
    """``x.sum(0)`` of a Chunk(0) array: a pending sum of 3 summands, value [6., 9.]."""
    x = fshard.shard(torch.arange(6.0).reshape(3, 2), fshard.Chunk(0, RANKS))
    s = x.sum(0)
    assert s.layout.partial == "sum"
    assert fshard.gather(s).tolist() == [6.0, 9.0]
    return s


def _data(a: fshard.ShardedArray) -> list[list[float]]:
    return [sh.data.tolist() for sh in a.addressable_shards]


# -- a pending sum: the created array's value is the requested one -------------------------------


def test_like_of_a_pending_sum_has_the_requested_value():
    s = _pending_sum()
    for made, want in (
        (fshard.ones_like(s), torch.ones(2)),
        (fshard.full_like(s, 5.0), torch.full((2,), 5.0)),
        (fshard.zeros_like(s), torch.zeros(2)),
        (fshard.full_like(s, 7, dtype=torch.int64), torch.full((2,), 7)),
    ):
        assert made.layout == s.layout
        got = fshard.gather(made)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    # The first summand holds the values, the others zeros.
    assert _data(fshard.ones_like(s)) == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def test_random_like_of_a_pending_sum_is_layout_invariant():
    s = _pending_sum()
    for like, make in ((fshard.rand_like, fshard.rand), (fshard.randn_like, fshard.randn)):
        got = like(s, seed=11)
        assert got.layout == s.layout
        want = fshard.gather(make(fshard.Single(0), 2, seed=11))
        assert torch.equal(fshard.gather(got), want)
        assert _data(got)[1:] == [[0.0, 0.0], [0.0, 0.0]]


def test_like_of_a_shard_map_partial_output():
    ranks = [0, 1]
    x, w = torch.arange(8.0).reshape(2, 4), torch.ones(4, 3)
    y = fshard.shard_map(
        lambda xb, wb: xb @ wb,
        in_specs=(fshard.Chunk(1, ranks), fshard.Chunk(0, ranks)),
        out_specs=fshard.Partial(fshard.Replicated(ranks)),
    )(x, w)
    assert y.layout.partial == "sum"
    assert torch.equal(fshard.gather(fshard.ones_like(y)), torch.ones(2, 3))
    assert torch.equal(fshard.gather(fshard.full_like(y, -2.5)), torch.full((2, 3), -2.5))


@pytest.mark.parametrize("device", [None, "cpu"])
def test_creation_with_a_partial_spec_has_the_requested_value(device):
    lay = SUM.layout((2, 3))
    for made, want in (
        (fshard.ones(SUM, 2, 3, device=device), torch.ones(2, 3)),
        (
            fshard.full(SUM, 2, 3, fill_value=4, dtype=torch.int8, device=device),
            torch.full((2, 3), 4, dtype=torch.int8),
        ),
        (fshard.zeros(SUM, 2, 3, device=device), torch.zeros(2, 3)),
    ):
        assert made.layout == lay
        got = fshard.gather(made)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_device_keeps_the_pending_reduction_and_terms():
    for spec in (SUM, OVER_TP, fshard.Partial(fshard.Replicated(RANKS), "max")):
        lay = spec.layout((3,))
        got = fshard.zeros(spec, 3, device="cpu").layout
        assert got == lay
        assert got.partial == lay.partial
        assert (got.terms is None and lay.terms is None) or got.terms.tolist() == lay.terms.tolist()


def test_summands_with_replicas():
    # Over tp: ranks 0 and 2 hold replicas of one summand, ranks 1 and 3 of the other.
    assert OVER_TP.layout((3,)).terms.tolist() == [0, 1, 0, 1]
    assert _filled(OVER_TP.layout((3,))).tolist() == [True, False, True, False]
    assert OVER_DP.layout((3,)).terms.tolist() == [0, 0, 1, 1]
    assert _filled(OVER_DP.layout((3,))).tolist() == [True, True, False, False]
    for spec in (OVER_TP, OVER_DP):
        a = fshard.full(spec, 3, fill_value=2.0)
        assert torch.equal(fshard.gather(a), torch.full((3,), 2.0))
        ones = [[1.0] * 3 if f else [0.0] * 3 for f in _filled(spec.layout((3,))).tolist()]
        assert _data(fshard.ones(spec, 3)) == ones
        assert torch.equal(fshard.gather(fshard.ones_like(a)), torch.ones(3))


def test_pending_max_and_min_fill_every_copy():
    for op in ("max", "min"):
        spec = fshard.Partial(fshard.Replicated(RANKS), op)
        a = fshard.full(spec, 2, fill_value=-3.0)
        assert a.layout.partial == op
        assert _filled(a.layout) is None
        assert _data(a) == [[-3.0, -3.0]] * 3
        assert torch.equal(fshard.gather(a), torch.full((2,), -3.0))
        assert torch.equal(fshard.gather(fshard.ones_like(a)), torch.ones(2))
        want = fshard.gather(fshard.rand(fshard.Single(0), 2, seed=5))
        assert torch.equal(fshard.gather(fshard.rand(spec, 2, seed=5)), want)


@pytest.mark.parametrize(
    ("op", "dtype"),
    [("sum", torch.float8_e4m3fn), ("sum", torch.uint32), ("sum", torch.uint64), ("max", torch.uint16)],
)
def test_a_pending_reduction_torch_has_no_kernel_for_is_refused_when_made(op, dtype):
    """It was made, and the first movement raised torch's NotImplementedError ("add_stub" not implemented)."""
    name = {"sum": "add", "max": "maximum"}[op]
    msg = f"A pending {op} of {dtype} values cannot be reduced: torch has no {name} for {dtype}."
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        fshard.ones(fshard.Partial(fshard.Replicated(RANKS), op), 3, dtype=dtype)
    fshard.ones(fshard.Chunk(0, RANKS), 3, dtype=dtype)  # nothing to reduce: made as before


@pytest.mark.parametrize("make", [fshard.zeros, fshard.ones, fshard.rand, fshard.empty])
def test_a_quantized_dtype_is_refused_naming_the_way(make):
    """torch fills none of them: zeros raised torch's NotImplementedError, a pending sum an INTERNAL ASSERT."""
    with pytest.raises(TypeError, match=re.escape("dtype=torch.qint8 is quantized, which fshard's creation")):
        make(fshard.Chunk(0, RANKS), 3, dtype=torch.qint8)


@pytest.mark.parametrize("make", [fshard.rand, fshard.randn])
def test_random_values_are_the_same_for_every_spec_partial_ones_included(make):
    shape = (5, 3)
    want = fshard.gather(make(fshard.Single(0), *shape, seed=3))
    specs = [
        fshard.Chunk(0, RANKS),
        fshard.Chunk(1, [0, 1]),
        fshard.Replicated([0, 1]),
        SUM,
        fshard.Partial(fshard.Chunk(0, [0, 1])),
        fshard.Partial(fshard.Replicated(RANKS), "max"),
        fshard.Partial(fshard.Replicated(RANKS), "min"),
        fshard.Partial(fshard.Named(MESH, ("dp",)), over="tp"),
    ]
    for spec in specs:
        for device in (None, "cpu"):
            got = fshard.gather(make(spec, *shape, seed=3, device=device))
            assert torch.equal(got, want), spec


def test_a_scalar_pending_sum():
    assert torch.equal(fshard.gather(fshard.ones(SUM)), torch.ones(()))
    assert torch.equal(fshard.gather(fshard.rand(SUM, seed=2)), fshard.gather(fshard.rand(fshard.Single(0), seed=2)))


def test_a_pending_sum_of_leaves_gives_each_summand_its_gradient():
    a = fshard.ones(SUM, 2, requires_grad=True)
    assert torch.equal(fshard.gather(a), torch.ones(2))
    (fshard.gather(a) * torch.tensor([2.0, 3.0])).sum().backward()
    assert [sh.data.grad.tolist() for sh in a.addressable_shards] == [[2.0, 3.0]] * 3


# -- rand / randn: real floating dtypes only ---------------------------------------------------------


def _refusal(what: str, got: str, complex_: bool = False) -> str:
    msg = f"{what} makes real floating point values, {got}: give dtype=torch.float32 (or float16, bfloat16, float64)."
    if complex_:
        msg += (
            " For complex values make the real and imaginary parts as two real arrays (two seeds) "
            "and combine them: fshard.map_local(torch.complex, re, im)."
        )
    return msg


REFUSED = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", REFUSED)
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_refuses_dtypes_that_are_not_real_floating(name, dtype):
    make = getattr(fshard, name)
    msg = _refusal(f"{name}()", f"got dtype={dtype}", dtype.is_complex)
    for spec in (fshard.Chunk(0, [0, 1]), fshard.Chunk(0, [0]), SUM):
        with pytest.raises(TypeError) as info:
            make(spec, 4, seed=0, dtype=dtype)
        assert str(info.value) == msg


@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_like_refuses_an_array_dtype_that_is_not_real_floating(name):
    like = getattr(fshard, f"{name}_like")
    x = fshard.zeros(fshard.Chunk(0, [0, 1]), 4, dtype=torch.int64)
    with pytest.raises(TypeError) as info:
        like(x, seed=0)
    assert str(info.value) == _refusal(f"{name}_like()", "the array's dtype is torch.int64")
    with pytest.raises(TypeError) as info:
        like(x, seed=0, dtype=torch.complex64)
    assert str(info.value) == _refusal(f"{name}_like()", "got dtype=torch.complex64", complex_=True)
    got = like(x, seed=0, dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(fshard.gather(got), fshard.gather(getattr(fshard, name)(fshard.Single(0), 4, seed=0)))


def test_a_refused_dtype_draws_no_seed():
    torch.manual_seed(0)
    with pytest.raises(TypeError):
        fshard.rand(fshard.Chunk(0, [0, 1]), 4, dtype=torch.int64)
    after = torch.randint(0, 2**62, (1,))
    torch.manual_seed(0)
    assert torch.equal(after, torch.randint(0, 2**62, (1,)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_random_real_floating_dtypes(dtype):
    for make in (fshard.rand, fshard.randn):
        a = make(fshard.Chunk(0, [0, 1]), 6, seed=9, dtype=dtype)
        b = make(fshard.Replicated([0]), 6, seed=9, dtype=dtype)
        assert a.dtype == dtype
        assert torch.equal(fshard.gather(a), fshard.gather(b))


def test_complex_values_from_two_real_arrays():
    spec = fshard.Chunk(0, [0, 1])
    re, im = fshard.randn(spec, 4, seed=1), fshard.randn(spec, 4, seed=2)
    c = fshard.map_local(torch.complex, re, im)
    assert c.dtype == torch.complex64
    assert torch.equal(fshard.gather(c), torch.complex(fshard.gather(re), fshard.gather(im)))


# -- shard sizes: every shard of the layout is checked ------------------------------------------------


def test_sizes_at_the_limit_are_counted_exactly():
    # 3 * 3074457345618258602 = 2**63 - 2 bytes of int8; one more row is past 2**63 - 1, where
    # float64 gives both the same value.
    spec = fshard.Chunk(2, [0, 1])
    assert fshard.zeros(spec, 3, 3074457345618258602, 0, dtype=torch.int8).shape == (3, 3074457345618258602, 0)
    with pytest.raises(fshard.LayoutError) as info:
        fshard.zeros(spec, 3, 3074457345618258603, 0, dtype=torch.int8)
    assert str(info.value) == (
        "shape (3, 3074457345618258603, 0) gives shard 0 sizes (3, 3074457345618258603, 0): more than 2**63 - 1 "
        "bytes of torch.int8, the most one tensor holds (it is empty, but torch counts the extents other than 0 "
        "all the same). Use a smaller shape or more shards."
    )


def _huge_layout() -> fshard.Layout:
    """Rows [2, 2**61) of (2**61 + 1, 8) float32 on rank 2, one row on each other rank."""
    n = 2**61 + 1
    return fshard.Layout.from_arrays(
        (n, 8), [[0, 0], [1, 0], [2, 0], [n - 1, 0]], [[1, 8], [1, 8], [n - 3, 8], [1, 8]], [0, 1, 2, 3]
    )


HUGE_MSG = (
    "shape (2305843009213693953, 8) gives shard 2 sizes (2305843009213693950, 8): more than 2**63 - 1 bytes of "
    "torch.float32, the most one tensor holds. Use a smaller shape or more shards."
)
CHUNK_MSG = (
    "shape (1099511627776, 1099511627776) gives shard 0 sizes (1099511627776, 1099511627776): more than 2**63 - 1 "
    "bytes of torch.float32, the most one tensor holds. Use a smaller shape or more shards."
)


def test_the_first_shard_too_large_is_named():
    with pytest.raises(fshard.LayoutError) as info:
        fshard.zeros(_huge_layout(), 2**61 + 1, 8)
    assert str(info.value) == HUGE_MSG
    assert np.array_equal(_huge_layout().columns.rank, [0, 1, 2, 3])


def _sizes_on_every_rank():
    out = []
    for make in (
        lambda: fshard.zeros(fshard.Chunk(0, [0]), 2**40, 2**40),
        lambda: fshard.ones(_huge_layout(), 2**61 + 1, 8),
        lambda: fshard.rand(fshard.Chunk(0, [0]), 2**40, 2**40, seed=0),
    ):
        try:
            make()
            out.append(None)
        except fshard.LayoutError as exc:
            out.append(str(exc))
    # The group is still in step: a collective after the refusals.
    x = fshard.ones(fshard.Chunk(0, [0, 1, 2, 3]), 8)
    out.append(fshard.gather(x).tolist())
    return out


@pytest.mark.multiprocess
def test_a_shard_too_large_raises_on_every_rank(dist_pool):
    got = dist_pool.run(_sizes_on_every_rank, timeout=60)
    assert got == [[CHUNK_MSG, HUGE_MSG, CHUNK_MSG, [1.0] * 8]] * 4


def _dtypes_on_every_rank():
    out = []
    for make, dtype in ((fshard.rand, torch.int64), (fshard.randn, torch.bool), (fshard.randn, torch.complex64)):
        try:
            make(fshard.Chunk(0, [0]), 4, seed=0, dtype=dtype)  # only rank 0 holds a shard
            out.append(None)
        except TypeError as exc:
            out.append(str(exc))
    return out


@pytest.mark.multiprocess
def test_a_refused_dtype_raises_on_every_rank(dist_pool):
    got = dist_pool.run(_dtypes_on_every_rank, timeout=60)
    want = [
        _refusal("rand()", "got dtype=torch.int64"),
        _refusal("randn()", "got dtype=torch.bool"),
        _refusal("randn()", "got dtype=torch.complex64", complex_=True),
    ]
    assert got == [want] * 4


def _pending_on_every_rank():
    rank = dist.get_rank()
    x = fshard.shard(torch.arange(8.0).reshape(4, 2), fshard.Chunk(0, [0, 1, 2, 3]))
    s = x.sum(0)
    assert s.layout.partial == "sum"
    spec = fshard.Partial(fshard.Named(fshard.Mesh((2, 2), axis_names=("dp", "tp")), (None,)), over="tp")
    return (
        rank,
        fshard.gather(fshard.ones_like(s)).tolist(),
        fshard.gather(fshard.full_like(s, 3.0)).tolist(),
        fshard.gather(fshard.rand_like(s, seed=4)).tolist(),
        fshard.gather(fshard.randn(spec, 3, seed=4, device="cpu")).tolist(),
        fshard.ones(spec, 3).local_tensor().tolist(),
    )


@pytest.mark.multiprocess
def test_pending_sums_on_processes(dist_pool):
    got = dist_pool.run(_pending_on_every_rank, timeout=60)
    rand = fshard.gather(fshard.rand(fshard.Single(0), 2, seed=4)).tolist()
    randn = fshard.gather(fshard.randn(fshard.Single(0), 3, seed=4)).tolist()
    local = [[1.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]
    assert got == [(r, [1.0, 1.0], [3.0, 3.0], rand, randn, local[r]) for r in range(4)]


@pytest.mark.parametrize("seed", [2**64, 2**70 + 5, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused_rather_than_wrapped(seed: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"seed {seed} does not fit 64 bits")):
        fshard.rand(fshard.Chunk(0, [0, 1]), 4, seed=seed)


def test_the_ends_of_the_seed_range_draw_as_their_bit_patterns() -> None:
    """-1 and 2**64 - 1 are one 64-bit pattern, as for torch.manual_seed; both ends are accepted."""
    spec = fshard.Chunk(0, [0, 1])
    top = fshard.gather(fshard.rand(spec, 4, seed=2**64 - 1))
    assert torch.equal(fshard.gather(fshard.rand(spec, 4, seed=-1)), top)
    fshard.rand(spec, 4, seed=-(2**63))
