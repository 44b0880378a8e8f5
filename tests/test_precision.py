"""Mixed precision of movements (``fshard.Precision``), on the local backend.

A movement with ``Precision(param=p, reduce=r)`` casts each sender's boxes to ``p`` before
sending (the counters count ``p``'s bytes), and its backward moves and sums the gradients
in ``r``, returning them in the source's dtype. Each program here is compared bit for bit
with the torch computation it describes; the error bound of docs/training.md ("Mixed
precision") is checked on random data.
"""

from __future__ import annotations

import contextlib
import pickle
import re

import optree
import pytest
import torch

import fshard
from fshard.backends.local import LocalBackend

R = [0, 1, 2, 3]
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
MIXED = fshard.Precision(param=BF16, reduce=F32)


def _w(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- the value ------------------------------------------------------------------------------


def test_a_precision_is_a_frozen_comparable_picklable_value():
    p = fshard.Precision(param=BF16, reduce=F32)
    assert repr(p) == "Precision(param=torch.bfloat16, reduce=torch.float32)"
    assert p == pickle.loads(pickle.dumps(p))
    assert hash(p) == hash(fshard.Precision(BF16, F32))
    assert fshard.Precision() == fshard.Precision(None, None)
    with pytest.raises(AttributeError):
        p.param = F32  # type: ignore[misc]
    assert (p.forward_dtype(F32), p.reduce_dtype(F32)) == (BF16, F32)
    assert fshard.Precision(param=BF16).reduce_dtype(F32) == BF16  # the gradients' own dtype
    assert fshard.Precision(reduce=F32).forward_dtype(BF16) == BF16
    assert not fshard.Precision(param=F32).casts(F32)
    assert fshard.Precision(reduce=F64).casts(F32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"param": torch.int8}, "Precision(param=torch.int8): param takes a floating dtype"),
        ({"reduce": torch.float8_e4m3fn}, "Precision(reduce=torch.float8_e4m3fn): reduce takes a floating dtype"),
        ({"param": "bfloat16"}, "Precision(param='bfloat16'): param takes a floating dtype"),
        ({"reduce": torch.complex64}, "Precision(reduce=torch.complex64)"),
    ],
    ids=["int", "float8", "string", "complex"],
)
def test_a_precision_refuses_dtypes_it_cannot_cast_to(kwargs, message):
    with pytest.raises(fshard.SpecError, match=re.escape(message)):
        fshard.Precision(**kwargs)


# -- reshard --------------------------------------------------------------------------------


def test_the_wire_carries_the_param_dtypes_bytes():
    """Chunk over 4 ranks to replicas of 8x4: each rank receives the 24 elements it lacks, 2 bytes each."""
    backend = LocalBackend()
    x = fshard.shard(_w(8, 4), fshard.Chunk(0, R), backend=backend)
    for precision, itemsize in ((None, 4), (MIXED, 2), (fshard.Precision(param=F64), 8)):
        backend.counters.reset()
        y = fshard.reshard(x, fshard.Replicated(R), precision=precision)
        assert (backend.counters.elements_sent, backend.counters.bytes_sent) == (96, 96 * itemsize)
        assert y.dtype == (F32 if precision is None else precision.param)


def test_the_forward_is_the_senders_cast_then_the_move():
    x = _w(6, 5)
    a = fshard.shard(x, fshard.Chunk(0, R))
    y = fshard.reshard(a, fshard.Chunk(1, [3, 2, 1, 0]), precision=MIXED)
    assert y.dtype == BF16
    assert torch.equal(fshard.gather(y), x.to(BF16))
    assert all(s.data.dtype == BF16 for s in y.addressable_shards)


def test_the_gradient_is_moved_in_the_reduce_dtype_and_returned_in_the_sources():
    """The gradient reaching the bf16 result is cast once to fp32: the source's gradient is exactly that."""
    w = _w(8, 4).requires_grad_()
    c = _w(8, 4, seed=1)
    y = fshard.reshard(fshard.shard(w, fshard.Chunk(0, R)), fshard.Replicated(R), precision=MIXED)
    (fshard.gather(y).float() * c).sum().backward()
    assert w.grad is not None
    assert w.grad.dtype == F32
    assert torch.equal(w.grad, c.to(BF16).to(F32))


def test_a_reduce_dtype_alone_leaves_the_forward_and_widens_the_backward():
    backend = LocalBackend()
    w = _w(8, 4).to(BF16).requires_grad_()
    y = fshard.reshard(
        fshard.shard(w, fshard.Chunk(0, R), backend=backend), fshard.Chunk(1, R), precision=fshard.Precision(reduce=F32)
    )
    assert y.dtype == BF16
    backend.counters.reset()
    (fshard.gather(y) * 3).sum().backward()
    assert w.grad is not None
    assert w.grad.dtype == BF16
    assert torch.equal(w.grad, torch.full((8, 4), 3.0, dtype=BF16))


def test_a_precision_that_casts_nothing_changes_nothing():
    a = fshard.shard(_w(4, 4), fshard.Chunk(0, R))
    assert fshard.reshard(a, a.layout, precision=fshard.Precision(param=F32)) is a
    b = fshard.reshard(a, a.layout, precision=MIXED)  # a cast in place: nothing sent
    assert b.layout == a.layout
    assert torch.equal(fshard.gather(b), fshard.gather(a).to(BF16))


def test_a_tree_moves_as_one_in_the_param_dtype():
    """Two fp32 leaves and an fp64 one, chunks to replicas: the sum of the leaves' minimums, in bf16 bytes."""
    backend = LocalBackend()
    tree = {
        "w": fshard.shard(_w(8, 4), fshard.Chunk(0, R), backend=backend),
        "b": fshard.shard(_w(4, seed=2), fshard.Chunk(0, R), backend=backend),
        "d": fshard.shard(_w(4, 2, seed=3).to(F64), fshard.Chunk(0, R), backend=backend),
        "r": fshard.shard(_w(3, seed=4), fshard.Replicated(R), backend=backend),  # in place: cast alone
    }
    backend.counters.reset()
    moved = fshard.reshard(tree, fshard.Replicated(R), precision=MIXED)
    assert backend.counters.elements_sent == 3 * (32 + 4 + 8)
    assert backend.counters.bytes_sent == 2 * backend.counters.elements_sent
    for name, a in moved.items():
        assert a.dtype == BF16
        assert torch.equal(fshard.gather(a), fshard.gather(tree[name]).to(BF16))


# -- shard_map: the gradient of every use, summed in the reduce dtype --------------------------------


def _body(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    return torch.tanh(xb.to(wb.dtype) @ wb).float().pow(2).sum()[None]


def _reference(x: torch.Tensor, w: torch.Tensor, order) -> torch.Tensor:
    """Each placement's gradient of ``_body`` in bf16, cast to fp32 and summed in fp32 in ``order``."""
    grads = []
    for r in R:
        wb = w.to(BF16).requires_grad_()
        (g,) = torch.autograd.grad(_body(x[2 * r : 2 * r + 2], wb).sum(), wb)
        grads.append(g.to(F32))
    total = grads[order[0]].clone()
    for r in order[1:]:
        total += grads[r]
    return total


@pytest.mark.parametrize("param_spec", [fshard.Chunk(0, R), fshard.Replicated(R)], ids=["fsdp", "dp"])
def test_shard_map_gradients_are_the_fp32_sums_of_bf16_gradients(param_spec):
    """Fully sharded (a reduce-scatter in the backward) and data parallel (copies summed), bit for bit.

    The local backend sums each element's summands on its owner: its own first, then the
    other ranks' ascending (``backends.local.Reduction``); with replicas, rank 0 owns them.
    """
    backend = LocalBackend()
    x, w = _w(8, 6, seed=5), _w(6, 4, seed=6).requires_grad_()
    step = fshard.shard_map(
        _body,
        in_specs=(fshard.Chunk(0, R), fshard.Replicated(R)),
        out_specs=fshard.Chunk(0, R),
        precision=(None, MIXED),
    )
    params = fshard.shard(w, param_spec, backend=backend)
    loss = fshard.gather(step(fshard.shard(x, fshard.Chunk(0, R), backend=backend), params)).sum()
    grads = torch.autograd.grad(loss, params.addressable_data)
    assert {g.dtype for g in grads} == {F32}
    if param_spec == fshard.Replicated(R):
        want = _reference(x, w.detach(), [0, 1, 2, 3])
        assert all(torch.equal(g, want) for g in grads)
    else:
        for r, g in enumerate(grads):  # rank r's rows of each sum: its own summand first
            want = _reference(x, w.detach(), [r, *(q for q in R if q != r)])
            assert torch.equal(g, want[2 * r : 2 * r + 2])  # 6 rows over 4 ranks: 2, 2, 2, 0
        assert grads[3].shape == (0, 4)


def test_shard_map_sends_bf16_forward_and_fp32_backward():
    """A 16x4 parameter in dim-0 chunks: 48 elements to each rank forward (bf16), 48 back from each (fp32)."""
    backend = LocalBackend()
    w = fshard.shard(_w(16, 4), fshard.Chunk(0, R), backend=backend)
    for t in w.addressable_data:  # the shards are the leaves (a gradient of the tensor would gather it)
        t.requires_grad_()
    step = fshard.shard_map(
        lambda wb: wb.float().sum()[None], fshard.Replicated(R), fshard.Chunk(0, R), precision=MIXED
    )
    backend.counters.reset()
    out = step(w)
    assert (backend.counters.elements_sent, backend.counters.bytes_sent) == (4 * 48, 4 * 48 * 2)
    total = torch.stack(list(out.addressable_data)).sum()  # every placement's result, no movement
    backend.counters.reset()
    total.backward()
    assert (backend.counters.elements_sent, backend.counters.bytes_sent) == (4 * 48, 4 * 48 * 4)


def test_no_precision_is_the_movement_without_casts_bit_for_bit():
    x, w = _w(8, 6, seed=5), _w(6, 4, seed=6)
    args = (fshard.Chunk(0, R), fshard.Replicated(R))

    def run(precision):
        wt = w.clone().requires_grad_()
        body = lambda xb, wb: torch.tanh(xb @ wb).pow(2).sum()[None]  # noqa: E731
        f = fshard.shard_map(body, args, fshard.Chunk(0, R), **precision)
        out = fshard.gather(f(fshard.shard(x, args[0]), fshard.shard(wt, fshard.Chunk(0, R))))
        out.sum().backward()
        return out, wt.grad

    plain, none = run({}), run({"precision": None})
    same = run({"precision": fshard.Precision(param=F32, reduce=F32)})
    for a, b in ((plain, none), (plain, same)):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1], b[1])


# -- the error bound -----------------------------------------------------------------------------


def _sum_of_rounded(c: torch.Tensor, precision: fshard.Precision) -> torch.Tensor:
    """The gradient of a replicated fp64 ``w`` in ``sum_r (w * c[r]).sum()``, each use computed in bf16."""
    n = c.shape[0]
    ranks = list(range(n))
    w = torch.zeros(c.shape[1:], dtype=F64, requires_grad=True)
    cs = fshard.shard(c, fshard.Chunk(0, ranks))
    step = fshard.shard_map(
        lambda cb, wb: (wb * cb[0].to(wb.dtype)).sum().float()[None],
        (fshard.Chunk(0, ranks), fshard.Replicated(ranks)),
        fshard.Chunk(0, ranks),
        precision=(None, precision),
    )
    fshard.gather(step(cs, fshard.shard(w, fshard.Replicated(ranks)))).sum().backward()
    assert w.grad is not None
    assert w.grad.dtype == F64
    return w.grad


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_documented_bound_holds_for_bf16_gradients_summed_in_fp32(n):
    """|sum - exact| <= 2^-8 * sum|c_i| + gamma(n-1, 2^-24) * sum|round(c_i)|, on every element.

    Summed in bf16 instead (``reduce`` left to the gradients' dtype), the same data breaks that
    bound: the test tells the two apart.
    """
    c = torch.randn(n, 4096, generator=torch.Generator().manual_seed(n), dtype=F64) * torch.logspace(
        -3, 3, 4096, dtype=F64
    )
    exact = c.sum(0)
    magnitude = c.abs().sum(0)
    rounded = c.to(BF16).to(F64).abs().sum(0)
    u = 2.0**-24
    bound = 2.0**-8 * magnitude + (n - 1) * u / (1 - (n - 1) * u) * rounded
    wide = _sum_of_rounded(c, fshard.Precision(param=BF16, reduce=F32))
    assert bool(((wide - exact).abs() <= bound).all())
    narrow = _sum_of_rounded(c, fshard.Precision(param=BF16))
    assert bool(((narrow - exact).abs() > bound).any())


# -- errors ----------------------------------------------------------------------------------------


def test_bad_precisions_raise_errors_that_name_them_and_the_fix():
    ints = fshard.shard(torch.arange(8), fshard.Chunk(0, R))
    floats = fshard.shard(_w(8), fshard.Chunk(0, R))
    msg = f"reshard()'s array has dtype torch.int64, but precision={MIXED!r} casts floating arrays only"
    with pytest.raises(fshard.SpecError, match=re.escape(msg)):
        fshard.reshard(ints, fshard.Replicated(R), precision=MIXED)
    with pytest.raises(fshard.SpecError, match=re.escape("reshard()'s leaf at ('i',) has dtype torch.int64")):
        fshard.reshard({"f": floats, "i": ints}, fshard.Replicated(R), precision=MIXED)
    with pytest.raises(
        TypeError, match=re.escape("reshard() precision= takes an fshard.Precision or None, got 'bf16' (str)")
    ):
        fshard.reshard(floats, fshard.Replicated(R), precision="bf16")
    f = lambda a, b: a  # noqa: E731
    specs = (fshard.Chunk(0, R), fshard.Chunk(0, R))
    with pytest.raises(fshard.SpecError, match=re.escape("shard_map() argument 1 has dtype torch.int64")) as info:
        fshard.shard_map(f, specs, fshard.Chunk(0, R), precision=MIXED)(floats, ints)
    assert "precision=(fshard.Precision(...), None)" in str(info.value)
    with pytest.raises(fshard.SpecError, match=re.escape("shard_map() precision= has 1 entries but in_specs has 2")):
        fshard.shard_map(f, specs, fshard.Chunk(0, R), precision=(MIXED,))
    with pytest.raises(TypeError, match=re.escape("shard_map() argument 1's precision= takes an fshard.Precision")):
        fshard.shard_map(f, specs, fshard.Chunk(0, R), precision=(MIXED, torch.bfloat16))
    out = fshard.shard_map(f, specs, fshard.Chunk(0, R), precision=(MIXED, None))(floats, ints)
    assert out.dtype == BF16


# -- transforms and micro-batches -------------------------------------------------------------------


def test_per_example_gradients_under_vmap_are_the_bf16_gradients_in_fp32():
    w = fshard.shard(_w(4, 3), fshard.Chunk(0, [0, 1]))
    xs = _w(5, 3, seed=7)
    leaves, treespec = optree.tree_flatten(w)

    def loss(leaves, x):
        y = fshard.reshard(optree.tree_unflatten(treespec, leaves), fshard.Replicated([0, 1]), precision=MIXED)
        return (fshard.gather(y).float() * x).sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(leaves, xs)
    want = xs.to(BF16).to(F32)[:, None, :].expand(5, 2, 3)  # each example's x, rounded once
    assert [g.dtype for g in grads] == [F32, F32]
    assert all(torch.equal(g, want) for g in grads)
    _, tangent = torch.func.jvp(lambda *ls: loss(list(ls), xs[0]), tuple(leaves), tuple(map(torch.ones_like, leaves)))
    assert torch.equal(tangent, (torch.ones(4, 3) * xs[0]).sum())  # a tangent of ones: exact in bf16


def test_micro_batches_under_no_sync_send_nothing_until_the_step():
    """Gradients set aside between micro-batches (in the reduce dtype, fp32) and summed once at the end."""
    backend = LocalBackend()
    x = _w(8, 6, seed=5)
    w = fshard.shard(_w(6, 4, seed=6), fshard.Chunk(0, R), backend=backend)
    for t in w.addressable_data:
        t.requires_grad_()
    step = fshard.shard_map(
        _body, (fshard.Chunk(0, R), fshard.Replicated(R)), fshard.Partial(fshard.Replicated(R)), precision=(None, MIXED)
    )
    sent = []
    for k, rows in enumerate((x[0::2], x[1::2])):
        with fshard.no_sync() if k == 0 else contextlib.nullcontext():
            out = step(fshard.shard(rows, fshard.Chunk(0, R), backend=backend), w)
            backend.counters.reset()
            torch.autograd.backward([t.sum() for t in out.addressable_data])
            sent.append(backend.counters.bytes_sent)
    assert sent == [0, 4 * 18 * 4]  # the step's one fp32 reduce-scatter of the 6x4 parameter's summands
    accumulated = torch.cat([t.grad for t in w.addressable_data])
    wb = _w(6, 4, seed=6).to(BF16).requires_grad_()
    grads = [torch.autograd.grad(_body(x[r::2][q : q + 1], wb).sum(), wb)[0] for r in (0, 1) for q in R]
    exact = sum(g.double() for g in grads)
    bound = 2.0**-24 * 8 * sum(g.double().abs() for g in grads)
    assert accumulated.dtype == F32
    assert bool(((accumulated.double() - exact).abs() <= bound).all())
