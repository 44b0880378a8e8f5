"""Gradients through shard, gather, reshard, map_local and the creation functions (local backend).

Each op is checked two ways on random layouts (chunks, named meshes with replicas,
random box partitions with empty shards): against finite differences with
``torch.autograd.gradcheck`` in double precision, and against the same function on
the unsharded tensor. Checked functions go from global tensors to global tensors
(shard -> ops -> gather): a replicated value is one value, so its copies are never
exposed to the check one by one (see docs/autograd.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fshard
from fshard._layout import Layout, ShardMeta
from fshard.backends.local import LOCAL

# -- strategies ----------------------------------------------------------------------------

WORLD = 4
shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
ranks = st.integers(0, WORLD - 1)


def _guillotine(draw: st.DrawFn, lo: list[int], hi: list[int], depth: int) -> list[tuple[list[int], list[int]]]:
    """Boxes tiling ``[lo, hi)``: cut along a random dim, recurse on both halves."""
    cuttable = [k for k in range(len(lo)) if hi[k] - lo[k] > 1]
    if not cuttable or depth == 0 or not draw(st.booleans()):
        return [(lo, hi)]
    k = draw(st.sampled_from(cuttable))
    at = draw(st.integers(lo[k] + 1, hi[k] - 1))
    left_hi, right_lo = list(hi), list(lo)
    left_hi[k], right_lo[k] = at, at
    return _guillotine(draw, lo, left_hi, depth - 1) + _guillotine(draw, right_lo, hi, depth - 1)


@st.composite
def box_layouts(draw: st.DrawFn, shape: tuple[int, ...]) -> Layout:
    """A random partition of ``shape``, each box on 1-3 ranks, plus an empty shard or two."""
    shards = []
    for lo, hi in _guillotine(draw, [0] * len(shape), list(shape), depth=3):
        sizes = tuple(b - a for a, b in zip(lo, hi))
        shards += [ShardMeta(tuple(lo), sizes, r) for r in draw(st.lists(ranks, min_size=1, max_size=3, unique=True))]
    for _ in range(draw(st.integers(0, 2))):
        empty = ShardMeta(tuple(draw(st.integers(0, n)) for n in shape), (0, *shape[1:]), draw(ranks))
        if empty not in shards:
            shards.append(empty)
    order = draw(st.permutations(range(len(shards))))
    return Layout(shape, tuple(shards[i] for i in order))


@st.composite
def named_layouts(draw: st.DrawFn, shape: tuple[int, ...]) -> Layout:
    """A 2 x 2 mesh; each axis splits one dim or none (unused axes hold replicas)."""
    parts: list[object] = [None] * len(shape)
    for axis in ("x", "y"):
        d = draw(st.integers(-1, len(shape) - 1))
        if d >= 0:
            parts[d] = axis if parts[d] is None else (parts[d], axis)
    return fshard.Named(fshard.Mesh((2, 2)), tuple(parts)).layout(shape)


def layouts(shape: tuple[int, ...]) -> st.SearchStrategy[Layout]:
    """Layouts of ``shape`` over ranks 0-3: every spec kind, replicas and empty shards included."""
    dims = st.integers(-len(shape), len(shape) - 1)
    chunk = st.builds(fshard.Chunk, dims, st.lists(ranks, min_size=1, max_size=6))
    whole = st.one_of(
        st.builds(fshard.Replicated, st.lists(ranks, min_size=1, max_size=4, unique=True)),
        st.builds(fshard.Single, ranks),
    )
    specs = st.one_of(chunk, whole).map(lambda s: s.layout(shape))
    return st.one_of(specs, named_layouts(shape), box_layouts(shape))


@st.composite
def cases(draw: st.DrawFn, n_layouts: int = 1) -> tuple[torch.Tensor, tuple[Layout, ...]]:
    """A random double tensor and ``n_layouts`` random layouts of its shape."""
    shape = draw(shapes)
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, tuple(draw(layouts(shape)) for _ in range(n_layouts))


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
    grads_agree(lambda t: fshard.gather(fshard.map_local(torch.tanh, fshard.shard(t, a, src=src)), dst=dst), torch.tanh, x)


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
    out = fshard.Chunk(0, [1, 2, 0]).layout((x.shape[0], 2 * x[0].numel()))

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
    b = fshard.Explicit([((0, 0), (4, 2), 3), ((0, 2), (4, 1), 1), ((4, 0), (1, 3), 0), ((4, 0), (1, 3), 2)]).layout((5, 3))

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
    assert x.requires_grad and all(t.is_leaf for t in x.addressable_data)
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
    assert fshard.gather(y).requires_grad and fshard.gather(y, dst=1).requires_grad
    with torch.no_grad():
        assert not fshard.reshard(y, b).requires_grad
        assert not fshard.gather(y).requires_grad


def test_detach_is_map_local() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    y = fshard.shard(x, fshard.Chunk(1, [0, 1, 2]))
    z = fshard.map_local(torch.Tensor.detach, y)
    assert not z.requires_grad and z.layout == y.layout
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(y.addressable_data, z.addressable_data))
    fresh = leaf(y)
    assert all(t.is_leaf and t.requires_grad for t in fresh.addressable_data)
    fshard.gather(fresh).sum().backward()
    assert x.grad is None
    assert torch.equal(fshard.gather(shard_grads(fresh)), torch.ones(6, 4))


def test_integer_arrays_move_without_autograd() -> None:
    x = fshard.shard(torch.arange(12).reshape(3, 4), fshard.Chunk(0, [0, 1]))
    y = fshard.reshard(x, fshard.Chunk(1, [1, 0]))
    assert not y.requires_grad and torch.equal(fshard.gather(y), torch.arange(12).reshape(3, 4))


def test_backward_of_a_reshard_runs_the_reverse_plan() -> None:
    """Elements sent by the backward equal the reverse plan's (minimal) count."""
    shape = (8, 6)
    a = fshard.Named(fshard.Mesh((2, 2)), ("x", None)).layout(shape)
    b = fshard.Chunk(1, [3, 2, 1, 0]).layout(shape)
    x = torch.randn(shape, requires_grad=True)
    y = fshard.reshard(fshard.shard(x, a), b)
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
