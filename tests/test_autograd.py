"""Gradients through shard, gather, reshard, map_local and the creation functions, on both backends.

Each op is checked two ways on random layouts from ``fshard.testing.strategies``
(chunks, named meshes with replicas, random box partitions with empty shards):
against finite differences with ``torch.autograd.gradcheck`` in double precision,
and against the same function on the unsharded tensor. Checked functions go from
global tensors to global tensors (shard -> ops -> gather): a replicated value is one
value, so its copies are never exposed to the check one by one (see docs/autograd.md).

The last section runs a set of these checks on the pool of 4 Gloo processes, and
counts what the backward passes send.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import fshard
from fshard._layout.layout import Layout, ShardMeta
from fshard.backends.local import LOCAL
from fshard.backends.torch_dist import TorchDistBackend
from fshard.testing import strategies as fst

# -- strategies ----------------------------------------------------------------------------

WORLD = 4
SHAPES = fst.shapes(min_dims=1, max_dims=3, max_side=5)
ranks = RANKS = st.integers(0, WORLD - 1)


@st.composite
def cases(draw: st.DrawFn, n_layouts: int = 1) -> tuple[torch.Tensor, tuple[Layout, ...]]:
    """A random double tensor and ``n_layouts`` random layouts of its shape (every kind of spec,
    replicas and empty shards included; ``fshard.testing.strategies``)."""
    shape = draw(SHAPES)
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, tuple(draw(fst.layouts(shape, WORLD)) for _ in range(n_layouts))


# -- helpers ---------------------------------------------------------------------------------


def grads_agree(f, reference, *inputs: torch.Tensor) -> None:
    """``f`` passes gradcheck and its gradient equals that of the unsharded ``reference``."""
    inputs = tuple(t.detach().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)
    out, want = f(*inputs), reference(*inputs)
    torch.testing.assert_close(out, want)
    cot = torch.randn_like(want)
    got = torch.autograd.grad(out, inputs, cot)
    expected = torch.autograd.grad(want, inputs, cot)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def leaf(x: fshard.ShardedArray) -> fshard.ShardedArray:
    """``x`` with every shard a fresh leaf that requires grad."""
    return fshard.map_local(lambda t: t.detach().requires_grad_(), x)


def shard_grads(x: fshard.ShardedArray) -> fshard.ShardedArray:
    """The ``.grad`` of every shard of ``x``, as an array in ``x``'s layout."""
    return fshard.map_local(lambda t: t.grad, x)


def box(meta: ShardMeta) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))


# -- one op at a time --------------------------------------------------------------------------


@given(cases())
def test_shard_then_gather(case) -> None:
    x, (a,) = case
    grads_agree(lambda t: fshard.gather(fshard.map_local(torch.sin, fshard.shard(t, a))), torch.sin, x)


@given(cases(2))
def test_reshard(case) -> None:
    x, (a, b) = case

    def f(t: torch.Tensor) -> torch.Tensor:
        y = fshard.reshard(fshard.map_local(torch.sin, fshard.shard(t, a)), b)
        return fshard.gather(fshard.map_local(lambda s: s * s, y))

    grads_agree(f, lambda t: torch.sin(t) ** 2, x)


@given(cases(3))
def test_reshard_chain(case) -> None:
    x, (a, b, c) = case

    def f(t: torch.Tensor) -> torch.Tensor:
        y = fshard.reshard(fshard.reshard(fshard.shard(t, a), b), c)
        return fshard.gather(fshard.map_local(torch.exp, y))

    grads_agree(f, torch.exp, x)


@given(cases(), st.data())
def test_shard_from_and_gather_to_one_rank(case, data) -> None:
    x, (a,) = case
    src, dst = data.draw(ranks), data.draw(ranks)
    grads_agree(
        lambda t: fshard.gather(fshard.map_local(torch.tanh, fshard.shard(t, a, src=src)), dst=dst), torch.tanh, x
    )


@given(cases(2))
def test_map_local_of_two_arrays(case) -> None:
    x, (a, b) = case
    y = x.flip(0).contiguous()

    def f(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        u = fshard.shard(s, a)
        v = fshard.reshard(fshard.shard(t, b), a)
        return fshard.gather(fshard.map_local(lambda p, q: p * torch.cos(q), u, v))

    grads_agree(f, lambda s, t: s * torch.cos(t), x, y)


@given(cases())
def test_map_local_resizing_an_unsplit_dim(case) -> None:
    x, (a,) = case
    x = x.unsqueeze(-1)  # a new last dim that no shard splits
    lay = Layout((*a.shape, 1), tuple(ShardMeta((*m.offsets, 0), (*m.sizes, 1), m.placement) for m in a.shards))

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(lambda s: torch.cat([s, s**2], dim=-1), fshard.shard(t, lay)))

    grads_agree(f, lambda t: torch.cat([t, t**2], dim=-1), x)


@given(cases(2))
def test_map_local_with_out_spec(case) -> None:
    x, (a, _) = case
    rows = fshard.Chunk(0, [1, 2, 0]).layout(x.shape)
    out = fshard.Chunk(0, [1, 2, 0]).layout((x.shape[0], 2 * math.prod(x.shape[1:])))

    def f(t: torch.Tensor) -> torch.Tensor:
        y = fshard.reshard(fshard.shard(t, a), rows)
        return fshard.gather(fshard.map_local(both, y, out_spec=out))

    def both(t: torch.Tensor) -> torch.Tensor:  # (n, ...) -> (n, 2 * prod(...))
        flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
        return torch.cat([flat, flat.sin()], 1)

    grads_agree(f, both, x)


@given(cases(2))
def test_gradients_of_gradients(case) -> None:
    x, (a, b) = case

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.shard(t, a), b)), dst=0)

    assert torch.autograd.gradgradcheck(f, (x.requires_grad_(),), fast_mode=True)


def test_exhaustive_gradcheck_on_uneven_replicated_layouts() -> None:
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    a = fshard.Named(fshard.Mesh((2, 2)), ("x", None)).layout((5, 3))
    b = fshard.Explicit([((0, 0), (4, 2), 3), ((0, 2), (4, 1), 1), ((4, 0), (1, 3), 0), ((4, 0), (1, 3), 2)]).layout(
        (5, 3)
    )

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(torch.sinh, fshard.reshard(fshard.shard(t, a), b)))

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


# -- shard tensors as inputs: creation functions and leaves -------------------------------------


@given(cases(2))
def test_gather_as_a_function_of_the_shards(case) -> None:
    """Without replicas the shards are independent inputs; gradcheck sees each one."""
    x, (_, b) = case
    a = fshard.Chunk(0, [2, 0, 3]).layout(x.shape)
    parts = [x[box(m)].clone() for m in a.shards]

    def f(*ts: torch.Tensor) -> torch.Tensor:
        arr = fshard.from_local_shards_and_layout([fshard.Shard(m, t) for m, t in zip(a.shards, ts)], a)
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(arr, b)))

    assert torch.autograd.gradcheck(f, tuple(p.requires_grad_() for p in parts), fast_mode=True)


CREATORS = {
    "zeros": lambda spec, shape, **kw: fshard.zeros(spec, shape, **kw),
    "ones": lambda spec, shape, **kw: fshard.ones(spec, shape, **kw),
    "full": lambda spec, shape, **kw: fshard.full(spec, shape, fill_value=0.5, **kw),
    "rand": lambda spec, shape, **kw: fshard.rand(spec, shape, seed=3, **kw),
    "randn": lambda spec, shape, **kw: fshard.randn(spec, shape, seed=3, **kw),
    "zeros_like": lambda spec, shape, **kw: fshard.zeros_like(fshard.empty(spec, shape), **kw),
    "ones_like": lambda spec, shape, **kw: fshard.ones_like(fshard.empty(spec, shape), **kw),
    "full_like": lambda spec, shape, **kw: fshard.full_like(fshard.empty(spec, shape), 0.5, **kw),
    "rand_like": lambda spec, shape, **kw: fshard.rand_like(fshard.empty(spec, shape), seed=3, **kw),
    "randn_like": lambda spec, shape, **kw: fshard.randn_like(fshard.empty(spec, shape), seed=3, **kw),
}


@pytest.mark.parametrize("name", sorted(CREATORS))
def test_creation_leaves_receive_the_reference_gradient(name) -> None:
    """Every shard is a leaf; every copy of a replicated box gets the whole gradient of its box."""
    spec = fshard.Named(fshard.Mesh((2, 2)), (None, "y"))  # columns split, rows replicated
    x = CREATORS[name](spec, (3, 5), dtype=torch.float64, requires_grad=True)
    assert x.requires_grad
    assert all(t.is_leaf for t in x.addressable_data)
    w = torch.arange(15.0, dtype=torch.float64).reshape(3, 5)
    full = fshard.gather(fshard.reshard(x, fshard.Chunk(0, [3, 1])))
    (full * w).sum().backward()
    for s in x.addressable_shards:
        torch.testing.assert_close(s.data.grad, w[box(s.meta)])
    assert not CREATORS[name](spec, (3, 5), dtype=torch.float64).requires_grad


# -- replica semantics, requires_grad, detach ------------------------------------------------


def test_replicas_are_one_value() -> None:
    """Each copy of a replicated leaf gets the full gradient (not a share, not zero), and a
    function that reads every copy on its own counts as reading one."""
    x = torch.arange(4.0, requires_grad=True)
    rep = fshard.shard(x, fshard.Replicated([0, 1, 2]))
    fshard.gather(rep).sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    x.grad = None
    copies = sum(t.sum() for t in rep.addressable_data)  # exposes the three copies
    copies.backward()
    assert torch.equal(x.grad, torch.ones(4))  # one copy read, not the sum of three

    p = leaf(fshard.zeros(fshard.Replicated([0, 1]), 4))
    (fshard.gather(p) * torch.arange(4.0)).sum().backward()
    assert [s.data.grad.tolist() for s in p.addressable_shards] == [[0.0, 1.0, 2.0, 3.0]] * 2


def test_requires_grad_carries_over() -> None:
    x = torch.randn(6, 4)
    a, b = fshard.Chunk(0, [0, 1]), fshard.Named(fshard.Mesh((2, 2)), (None, "x"))
    assert not fshard.shard(x, a).requires_grad
    y = fshard.shard(x.requires_grad_(), a)
    assert y.requires_grad
    assert fshard.reshard(y, b).requires_grad
    assert fshard.map_local(torch.sin, y).requires_grad
    assert fshard.gather(y).requires_grad
    assert fshard.gather(y, dst=1).requires_grad
    with torch.no_grad():
        assert not fshard.reshard(y, b).requires_grad
        assert not fshard.gather(y).requires_grad


def _moved(x: torch.Tensor) -> tuple[fshard.ShardedArray, fshard.ShardedArray, torch.Tensor]:
    a = fshard.shard(x, fshard.Chunk(0, [0, 1]))
    b = fshard.reshard(a, fshard.Named(fshard.Mesh((2, 2)), (None, "x")))
    return a, b, fshard.gather(b)


def test_movements_that_no_derivative_sees_record_nothing() -> None:
    """Without a gradient to record, a movement runs its forward alone: no autograd node."""
    for x, context in ((torch.randn(6, 4), torch.enable_grad), (torch.randn(6, 4, requires_grad=True), torch.no_grad)):
        with context():
            a, b, full = _moved(x)
        assert all(t.grad_fn is None and not t.requires_grad for t in (*a.addressable_data, *b.addressable_data, full))
        assert torch.equal(full, x)


def test_movements_that_need_a_gradient_record_their_function() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    a, b, full = _moved(x)
    assert {type(t.grad_fn).__name__ for t in a.addressable_data} == {"_ScatterBackward"}
    assert {type(t.grad_fn).__name__ for t in b.addressable_data} == {"_MoveBackward"}
    assert type(full.grad_fn).__name__ == "_AssembleBackward"
    (full * full).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_forward_mode_ad_through_movements() -> None:
    import torch.autograd.forward_ad as fwad

    x, t = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with fwad.dual_level():
        a = fshard.shard(fwad.make_dual(x, t), fshard.Chunk(0, [0, 1]))
        y = fshard.gather(fshard.map_local(torch.sin, fshard.reshard(a, fshard.Chunk(1, [1, 0, 2]))))
        primal, tangent = fwad.unpack_dual(y)
    torch.testing.assert_close(primal, torch.sin(x))
    torch.testing.assert_close(tangent, torch.cos(x) * t)
    with fwad.dual_level(), pytest.raises(fshard.SpecError, match="forward derivative of a pending max"):
        fshard.shard(fwad.make_dual(x, t), fshard.Partial(fshard.Replicated([0, 1]), "max"))


@pytest.mark.parametrize("precision", [None, fshard.Precision(param=torch.bfloat16, reduce=torch.float32)])
def test_forward_mode_ad_through_a_replicated_argument_of_shard_map(precision) -> None:
    """A weight's tangent passes the node that sums its copies' gradients, cast as its values are."""
    import torch.autograd.forward_ad as fwad

    g = torch.Generator().manual_seed(0)
    x, w, t = (torch.randn(*shape, generator=g) for shape in ((6, 4), (4, 3), (4, 3)))
    w.requires_grad_()  # as a module's parameter: forward mode on a leaf that backward would reach too
    step = fshard.shard_map(
        lambda xb, wb: (xb.to(wb.dtype) @ wb).float(),
        in_specs=(fshard.Chunk(0, [0, 1]), fshard.Replicated([0, 1])),
        out_specs=fshard.Chunk(0, [0, 1]),
        precision=(None, precision),
    )
    cast = torch.float32 if precision is None else torch.bfloat16
    with fwad.dual_level():
        y = fshard.gather(step(x, fwad.make_dual(w, t)))
        tangent = fwad.unpack_dual(y).tangent
    torch.testing.assert_close(tangent, (x.to(cast) @ t.to(cast)).float())


def test_tensors_left_over_from_a_transform_move_as_plain_tensors() -> None:
    """A tensor kept from inside ``torch.func.grad`` (a dead wrapper) moves like its value."""
    kept: list[torch.Tensor] = []

    def f(t: torch.Tensor) -> torch.Tensor:
        kept.extend((t, t.detach()))
        return t.sum()

    x = torch.arange(8.0).reshape(4, 2)
    torch.func.grad(f)(x)
    for t in kept:
        _, b, full = _moved(t)
        assert torch.equal(full, x)
        assert not any(torch._C._functorch.is_functorch_wrapped_tensor(s) for s in (*b.addressable_data, full))


def test_detach_is_map_local() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    y = fshard.shard(x, fshard.Chunk(1, [0, 1, 2]))
    z = fshard.map_local(torch.Tensor.detach, y)
    assert not z.requires_grad
    assert z.layout == y.layout
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(y.addressable_data, z.addressable_data))
    fresh = leaf(y)
    assert all(t.is_leaf and t.requires_grad for t in fresh.addressable_data)
    fshard.gather(fresh).sum().backward()
    assert x.grad is None
    assert torch.equal(fshard.gather(shard_grads(fresh)), torch.ones(6, 4))


def test_integer_arrays_move_without_autograd() -> None:
    x = fshard.shard(torch.arange(12).reshape(3, 4), fshard.Chunk(0, [0, 1]))
    y = fshard.reshard(x, fshard.Chunk(1, [1, 0]))
    assert not y.requires_grad
    assert torch.equal(fshard.gather(y), torch.arange(12).reshape(3, 4))


def test_backward_of_a_reshard_runs_the_reverse_plan() -> None:
    """Elements sent by the backward equal the reverse plan's (minimal) count."""
    shape = (8, 6)
    a = fshard.Named(fshard.Mesh((2, 2)), ("x", None)).layout(shape)
    b = fshard.Chunk(1, [3, 2, 1, 0]).layout(shape)
    y = fshard.reshard(leaf(fshard.shard(torch.randn(shape), a)), b)
    counters = LOCAL.counters
    before = counters.elements_sent
    parts = sum((t * (k + 1)).sum() for k, t in enumerate(y.addressable_data))
    parts.backward()
    assert counters.elements_sent - before == fshard.plan(b, a).elements_sent == fshard.plan(b, a).min_elements_sent


def test_unused_outputs_get_zero_gradients() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    y = fshard.reshard(fshard.shard(x, fshard.Chunk(0, [0, 1])), fshard.Chunk(1, [0, 1]))
    y.addressable_data[0].sum().backward()  # only the first column block is used
    assert torch.equal(x.grad, torch.cat([torch.ones(4, 2), torch.zeros(4, 2)], 1))


def test_backward_of_gather_to_one_rank_scatters_the_gradient() -> None:
    x = torch.arange(12.0).reshape(4, 3).requires_grad_()
    y = fshard.shard(x, fshard.Named(fshard.Mesh((2, 2)), (None, "y")))
    full = fshard.gather(y, dst=3)
    (full * full).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


# -- over the Gloo pool: 4 processes, one rank each ---------------------------------------------


def inside(layout: Layout) -> bool:
    """Whether every box, empty ones included, lies inside the shape."""
    return all(o + n <= d for m in layout.shards for o, n, d in zip(m.offsets, m.sizes, layout.shape))


# Shrinking restarts the pool after every failing attempt: report the first failure as drawn.
POOL = settings(deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
POOL_PAIRS = SHAPES.flatmap(lambda s: st.tuples(fst.layouts(s, WORLD), fst.layouts(s, WORLD))).filter(
    lambda pair: inside(pair[0]) and inside(pair[1])
)


def _gradcheck_over_processes(a: Layout, b: Layout, seed: int) -> bool:
    torch.manual_seed(seed)  # every rank draws the same probes
    x = torch.randn(a.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.shard(t, a), b)))

    x.requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), fast_mode=True, check_forward_ad=True)
    out = f(x)
    torch.testing.assert_close(out, torch.sin(x))
    (g,) = torch.autograd.grad(out, x, torch.cos(x).detach())
    torch.testing.assert_close(g, torch.cos(x).detach() ** 2)
    return True


@pytest.mark.multiprocess
@settings(POOL, max_examples=10)
@given(POOL_PAIRS, st.integers(0, 2**16))
def test_gradcheck_over_gloo(dist_pool, pair: tuple[Layout, Layout], seed: int) -> None:
    assert dist_pool.run(_gradcheck_over_processes, *pair, seed) == [True] * WORLD


def _shard_from_one_rank(a: Layout, b: Layout, src: int, seed: int) -> float | None:
    """The largest gradient error on rank ``src``; every rank runs ``backward()`` (see docs/autograd.md)."""
    x = torch.randn(a.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mine = x.clone().requires_grad_() if dist.get_rank() == src else None
    y = fshard.reshard(fshard.shard(mine, a, src=src), b)
    (fshard.gather(fshard.map_local(torch.sin, y)) * x).sum().backward()
    if mine is None:
        return None
    return float((mine.grad - torch.cos(x) * x).abs().max()) if x.numel() else 0.0


@pytest.mark.multiprocess
@settings(POOL, max_examples=8)
@given(POOL_PAIRS, RANKS, st.integers(0, 2**16))
def test_shard_from_one_rank_over_gloo(dist_pool, pair: tuple[Layout, Layout], src: int, seed: int) -> None:
    a, b = pair
    out = dist_pool.run(_shard_from_one_rank, a, b, src, seed)
    assert out[src] < 1e-12
    assert [v for r, v in enumerate(out) if r != src] == [None] * (WORLD - 1)


def _sent(fn):
    """``fn()`` and the elements this rank sent meanwhile."""
    counters = TorchDistBackend().counters
    before = counters.elements_sent
    out = fn()
    return out, counters.elements_sent - before


def _reshard_traffic(a: Layout, b: Layout) -> tuple[int, int]:
    x = torch.arange(float(math.prod(a.shape))).reshape(a.shape)
    arr = leaf(fshard.shard(x, a))
    y, forward = _sent(lambda: fshard.reshard(arr, b))
    cot = [torch.ones_like(t) for t in y.addressable_data]
    grads, backward = _sent(lambda: torch.autograd.grad(y.addressable_data, arr.addressable_data, cot))
    assert all(torch.equal(g, torch.ones_like(g)) for g in grads)  # one copy read, never a sum of copies
    return forward, backward


def _backward_without_shards(a: fshard.Layout, b: fshard.Layout) -> bool:
    """Ranks that hold no shard of ``a`` or of ``b`` run the backward collectives with the others."""
    x = torch.arange(float(math.prod(a.shape)), dtype=torch.float64).reshape(a.shape).requires_grad_()
    y = fshard.reshard(fshard.shard(x, a), b)
    assert y.requires_grad  # on every rank, with or without shards
    loss = (fshard.gather(fshard.map_local(torch.sin, y)) * x.detach()).sum()
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g, torch.cos(x.detach()) * x.detach())
    return True


NO_SHARDS = {
    "one rank -> two ranks": (fshard.Single(0), fshard.Chunk(0, [1, 2])),
    "two ranks -> one rank": (fshard.Chunk(1, [3, 1]), fshard.Single(2)),
    "one rank -> another": (fshard.Single(3), fshard.Single(0)),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(NO_SHARDS))
def test_ranks_without_shards_join_the_backward_over_gloo(dist_pool, name: str) -> None:
    a, b = (s.layout((6, 4)) for s in NO_SHARDS[name])
    assert dist_pool.run(_backward_without_shards, a, b) == [True] * WORLD


TRAFFIC = {
    "rows -> columns": (fshard.Chunk(0, [0, 1, 2, 3]), fshard.Chunk(1, [3, 2, 1, 0])),
    "grid -> rows": (fshard.Named(fshard.Mesh((2, 2)), ("x", "y")), fshard.Chunk(0, [0, 1, 2, 3])),
    "rows -> replicated": (fshard.Chunk(0, [0, 1, 2, 3]), fshard.Replicated([0, 1, 2, 3])),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_backward_of_a_reshard_sends_the_reverse_plan_over_gloo(dist_pool, name: str) -> None:
    a, b = (s.layout((8, 6)) for s in TRAFFIC[name])
    sent = dist_pool.run(_reshard_traffic, a, b)
    assert sum(f for f, _ in sent) == fshard.plan(a, b).elements_sent
    assert sum(k for _, k in sent) == fshard.plan(b, a).elements_sent == fshard.plan(b, a).min_elements_sent


def _gather_backward_per_rank(spec) -> tuple[list, int, int]:
    rank = dist.get_rank()
    arr = leaf(fshard.zeros(spec, 4, 2, dtype=torch.float64))
    full, forward = _sent(lambda: fshard.gather(arr))
    loss = (full * (rank + 1)).sum()  # a different cotangent on every rank
    grads, backward = _sent(lambda: torch.autograd.grad(loss, arr.addressable_data))
    return [g.tolist() for g in grads], forward, backward


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", [fshard.Chunk(0, [0, 1, 2, 3]), fshard.Named(fshard.Mesh((2, 2)), ("x", None))])
def test_backward_of_gather_slices_each_ranks_own_gradient(dist_pool, spec) -> None:
    """The gathered tensor is one value: each rank's shards get slices of that rank's own
    gradient of it (nothing is sent, nothing is summed over ranks)."""
    out = dist_pool.run(_gather_backward_per_rank, spec)
    layout = spec.layout((4, 2))
    for rank, (grads, _, backward) in enumerate(out):
        mine = [m for m in layout.shards if m.placement.rank == rank]
        assert grads == [torch.full(m.sizes, rank + 1.0).tolist() for m in mine]
        assert backward == 0
    assert (
        sum(f for _, f, _ in out) == fshard.plan(layout, fshard.Replicated([0, 1, 2, 3]).layout((4, 2))).elements_sent
    )


# -- gradients of gradients through copies ---------------------------------------------------------


def _copies_specs() -> dict[str, object]:
    mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    return {
        "replicated": fshard.Replicated([0, 1, 2]),
        "rows over dp, copies over tp": fshard.Named(mesh, ("dp", None)),
        "chunk": fshard.Chunk(0, [0, 1, 2, 3]),
    }


def _sin_through(spec: object, how: str):
    """``t -> sin(t)`` through a ``shard_map`` (or ``map_local`` with an out_spec) of ``spec``, gathered."""

    def f(t: torch.Tensor) -> torch.Tensor:
        if how == "shard_map":
            return fshard.gather(fshard.shard_map(torch.sin, spec, spec)(t))
        return fshard.gather(fshard.map_local(torch.sin, fshard.shard(t, spec), out_spec=spec))

    return f


@pytest.mark.parametrize("how", ["shard_map", "map_local"])
@pytest.mark.parametrize("name", list(_copies_specs()))
def test_gradients_of_gradients_through_copies_are_the_functions(name: str, how: str) -> None:
    """Second derivatives by double backward and by forward-over-reverse (``torch.func.hessian``).

    A result's copies each take a share of its gradient, and each share feeds its copy's own
    backward: the second-order parts that reach the shares sum over the copies. Read from one
    copy alone, the term through the result came out divided by the number of copies.
    """
    f = _sin_through(_copies_specs()[name], how)
    x = torch.tensor([[0.3, -1.2], [0.7, 2.0], [-0.4, 1.1], [1.5, 0.2]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(f, (x,))
    (g,) = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
    torch.testing.assert_close(g, torch.sin(2 * x))
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, 2 * torch.cos(2 * x.detach()))
    h = torch.func.hessian(lambda t: f(t).square().sum())(x.detach())
    torch.testing.assert_close(h.reshape(8, 8), torch.diag((2 * torch.cos(2 * x.detach())).reshape(-1)))


def _second_order_over_processes(name: str) -> torch.Tensor:
    f = _sin_through(_copies_specs()[name], "shard_map")
    x = torch.tensor([[0.3, -1.2], [0.7, 2.0], [-0.4, 1.1], [1.5, 0.2]], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return gg


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["rows over dp, copies over tp", "chunk"])
def test_gradients_of_gradients_through_copies_over_gloo(dist_pool, name: str) -> None:
    x = torch.tensor([[0.3, -1.2], [0.7, 2.0], [-0.4, 1.1], [1.5, 0.2]], dtype=torch.float64)
    for gg in dist_pool.run(_second_order_over_processes, name, timeout=120):
        torch.testing.assert_close(gg, 2 * torch.cos(2 * x))


def test_a_tree_of_one_movement_has_no_node_in_front_and_of_several_has_one() -> None:
    """The node that makes every movement of a tree run its backward is there only where a tree takes several."""
    rows, every = fshard.Chunk(0, [0, 1]), fshard.Replicated([0, 1])
    alike = [fshard.shard(torch.ones(4, 2), rows), fshard.shard(torch.ones(4, 2), rows)]  # stacked: one movement
    unlike = [fshard.shard(torch.ones(4, 2), rows), fshard.shard(torch.ones(6), rows)]
    for tree in (alike, unlike):
        for a in tree:
            for t in a.addressable_data:  # on every rank, as processes require
                t.requires_grad_()

    def nodes(tree: list[fshard.ShardedArray]) -> set[str]:
        return {type(a.addressable_data[0].grad_fn).__name__ for a in fshard.reshard(tree, every)}

    assert not any("Together" in n for n in nodes(alike))
    assert nodes(unlike) == {"_TogetherBackward"}
