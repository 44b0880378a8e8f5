"""Computing on sharded values (DESIGN 3b) on the local backend: Partial, shard_map, map_local over
aligned layouts, operators, sum, gradients of replicas, and the replica-aware tree helpers."""

from __future__ import annotations

import collections
import math
import re

import numpy as np
import pytest
import torch

import fshard
from fshard import Chunk, Mesh, Named, Partial, Replicated, Single, SpecError

R = [0, 1, 2, 3]
X = torch.arange(48, dtype=torch.float64).reshape(8, 6) / 7
Y = torch.linspace(-2, 2, 48, dtype=torch.float64).reshape(8, 6)
GRID = Named(Mesh((2, 2)), ("x", "y"))
ROWS_PAIRS = Named(Mesh((2, 2)), ("x", None))


def _summands(op: str = "sum", inner=None, shape=(8, 6)) -> tuple[fshard.ShardedArray, list[torch.Tensor]]:
    layout = Partial(inner or Replicated(R), op).layout(shape)
    parts = [torch.randn(shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64) for k in R]
    shards = [
        fshard.Shard(m, parts[m.placement.rank][tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))])
        for m in layout.shards
    ]
    return fshard.from_local_shards_and_layout(shards, layout), parts


# -- Partial ----------------------------------------------------------------------------------


def test_partial_layout_is_a_value():
    lay = Partial(Replicated(R)).layout((2, 3))
    assert lay.partial == "sum"
    assert lay != Replicated(R).layout((2, 3))
    assert fshard.Layout.from_dict(lay.to_dict()) == lay
    assert "partial='sum'" in repr(lay)
    assert "pending sum" in lay.visualize()
    with pytest.raises(SpecError, match="pending reductions do not nest"):
        Partial(Partial(Replicated(R)))
    with pytest.raises(SpecError, match=re.escape("Partial op='mean' is not a reduction")):
        Partial(Replicated(R), "mean")
    with pytest.raises(fshard.LayoutError, match="is not a reduction"):
        fshard.Layout((2,), [((0,), (2,), 0)], partial="avg")


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("target", [Chunk(0, R), Chunk(1, R), Replicated(R), Single(3), GRID, ROWS_PAIRS])
def test_reshard_reduces_with_the_fewest_elements(op, target):
    p, parts = _summands(op)
    want = {"sum": sum(parts), "max": torch.stack(parts).amax(0), "min": torch.stack(parts).amin(0)}[op]
    backend = p.backend
    backend.counters.reset()
    y = fshard.reshard(p, target)
    plan = fshard.plan(p.layout, y.layout)
    assert backend.counters.elements_sent == plan.elements_sent == plan.min_elements_sent
    assert y.layout.partial is None
    assert torch.allclose(fshard.gather(y), want, rtol=0, atol=1e-12)


def test_all_reduce_and_reduce_scatter_bounds():
    n, numel = len(R), 48
    p, _ = _summands()
    assert fshard.plan(p.layout, Chunk(0, R).layout((8, 6))).elements_sent == (n - 1) * numel
    both = fshard.plan(p.layout, Replicated(R).layout((8, 6)))
    assert both.elements_sent == 2 * (n - 1) * numel
    assert len(both.phases) == 2
    assert both.phases[0].op == "sum"
    assert both.phases[1].op is None
    assert both.traffic().sum() == both.elements_sent


def test_partial_to_partial_and_value_to_partial():
    p, _parts = _summands(inner=ROWS_PAIRS)
    q = fshard.reshard(p, Partial(Chunk(0, R)))
    plan = fshard.plan(p.layout, q.layout)
    assert plan.elements_sent == plan.min_elements_sent
    assert torch.allclose(fshard.gather(q), fshard.gather(p))
    v = fshard.shard(X, Partial(Replicated(R)))  # the value is X: one copy holds it, the others 0
    assert torch.equal(fshard.gather(v), X)
    assert fshard.plan(Replicated(R).layout(X.shape), v.layout).elements_sent == 0
    assert sorted(float(s.data.abs().sum()) > 0 for s in v.addressable_shards) == [False, False, False, True]


def test_gradient_of_a_reduction_is_the_gradient_of_the_value_on_each_summand():
    p, _parts = _summands()

    def loss(params):
        return (fshard.gather(fshard.reshard(params["p"], Chunk(1, R))) * Y).sum()

    grads = torch.func.grad(loss)({"p": p})
    assert all(torch.equal(s.data, Y) for s in grads["p"].addressable_shards)
    with pytest.raises(SpecError, match="gradient of a pending max is not supported"):
        torch.func.grad(lambda t: fshard.gather(t).sum())(_summands("max")[0])


# -- map_local and shard_map ----------------------------------------------------------------


def test_map_local_refuses_pending_sums_unless_linear():
    p, parts = _summands()
    with pytest.raises(SpecError, match=re.escape("map_local() argument 0 is a pending sum (Partial)")):
        fshard.map_local(torch.sin, p)
    doubled = fshard.map_local(lambda t: 2 * t, p, linear=True)
    assert doubled.layout.partial == "sum"
    assert torch.allclose(fshard.gather(doubled), 2 * sum(parts))
    with pytest.raises(SpecError, match="linear=True applies to pending sums only"):
        fshard.map_local(torch.neg, _summands("max")[0], linear=True)


def test_map_local_over_aligned_layouts_with_pytree_results():
    rows = fshard.shard(X, Chunk(0, R))
    sums = fshard.shard(X.sum(1), Chunk(0, R))  # another shape, the same placements
    out = fshard.map_local(lambda t, s: (t / s[:, None], s * 2), rows, sums, out_spec=(Chunk(0, R), Chunk(0, R)))
    assert torch.allclose(fshard.gather(out[0]), X / X.sum(1, keepdim=True))
    assert torch.equal(fshard.gather(out[1]), 2 * X.sum(1))
    with pytest.raises(SpecError, match="does not align with argument 0"):
        fshard.map_local(torch.add, rows, fshard.shard(X, Chunk(0, [0, 0, 1, 1])), out_spec=Chunk(0, R))


def test_out_specs_lay_out_the_results_at_their_own_places():
    """Specs match results by place (dict keys included): a sequence for a dict, or other keys, is refused."""
    rows = fshard.shard(X, Chunk(0, R))
    summed = Partial(Replicated(R))

    def both(t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"rows": 2 * t, "total": t.sum()[None]}

    # By sorted key, a tuple's first spec would lay out "rows" as a pending sum: refused, naming both places.
    with pytest.raises(SpecError, match=r"its spec at \[0\] would lay out the result at \['rows'\]"):
        fshard.shard_map(both, in_specs=Chunk(0, R), out_specs=(summed, Chunk(0, R)))(rows)
    with pytest.raises(SpecError, match=r"its spec at \['row'\] would lay out the result at \['rows'\]"):
        fshard.shard_map(both, in_specs=Chunk(0, R), out_specs={"total": summed, "row": Chunk(0, R)})(rows)
    out = fshard.shard_map(both, in_specs=Chunk(0, R), out_specs={"total": summed, "rows": Chunk(0, R)})(rows)
    assert torch.equal(fshard.gather(out["rows"]), 2 * X)
    assert torch.allclose(fshard.gather(out["total"]), X.sum()[None])
    # A list of specs for a tuple of results: the same places; so is one spec in a tuple for one result.
    pair = fshard.shard_map(lambda t: (t, -t), in_specs=Chunk(0, R), out_specs=[Chunk(0, R), Chunk(0, R)])(rows)
    assert isinstance(pair, tuple)
    assert torch.equal(fshard.gather(pair[1]), -X)
    negated = fshard.shard_map(torch.neg, in_specs=Chunk(0, R), out_specs=(Chunk(0, R),))(rows)
    assert torch.equal(fshard.gather(negated), -X)
    # Results with None between them pair with their specs by position, as they always have.
    holes = fshard.shard_map(lambda t: (t, None, t.sum()[None]), in_specs=Chunk(0, R), out_specs=(Chunk(0, R), summed))
    first, nothing, total = holes(rows)
    assert nothing is None
    assert (first.layout.partial, total.layout.partial) == (None, "sum")
    # A None at a None result's place stands for it, in a dict as in a sequence.
    aux = fshard.shard_map(
        lambda t: {"y": t, "aux": None}, in_specs=Chunk(0, R), out_specs={"y": Chunk(0, R), "aux": None}
    )(rows)
    assert aux["aux"] is None
    assert torch.equal(fshard.gather(aux["y"]), X)
    same = fshard.shard_map(lambda t: (t, None, -t), in_specs=Chunk(0, R), out_specs=(Chunk(0, R), None, summed))
    assert same(rows)[2].layout.partial == "sum"
    # Dicts match by key, whichever order their leaves come in (an OrderedDict's as inserted, a dict's sorted).
    by_key = {"total": summed, "rows": Chunk(0, R)}
    ordered = fshard.shard_map(lambda t: collections.OrderedDict(both(t)), in_specs=Chunk(0, R), out_specs=by_key)(rows)
    assert list(ordered) == ["rows", "total"]
    assert (ordered["rows"].layout.partial, ordered["total"].layout.partial) == (None, "sum")
    specs = collections.OrderedDict([("total", summed), ("rows", Chunk(0, R))])
    plain = fshard.shard_map(both, in_specs=Chunk(0, R), out_specs=specs)(rows)
    assert (plain["rows"].layout.partial, plain["total"].layout.partial) == (None, "sum")
    # A structure that cannot be hashed (its default factory) is matched too, at every call.
    factory = _Unhashable()
    for _ in range(2):
        made = fshard.shard_map(
            lambda t: collections.defaultdict(factory, both(t)), in_specs=Chunk(0, R), out_specs=specs
        )(rows)
        assert made["total"].layout.partial == "sum"


class _Unhashable:
    """A default factory that cannot be hashed, nor a tree that holds it."""

    __hash__ = None  # type: ignore[assignment]

    def __call__(self) -> None:
        return None


def test_shard_map_row_and_column_parallel_matmul_with_gradients():
    w = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    row = fshard.shard_map(lambda a, b: a @ b, (Chunk(1, R), Chunk(0, R)), Partial(Replicated(R)))
    col = fshard.shard_map(lambda a, b: a @ b, (Replicated(R), Chunk(1, R)), Chunk(1, R))

    def loss(params, fn):
        return (fshard.gather(fn(params["x"], params["w"])) ** 2).sum()

    xt, wt = X.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (xt @ wt).pow(2).sum().backward()
    for fn in (row, col):
        assert torch.allclose(fshard.gather(fn(X, w)), X @ w)
        params = {"x": fshard.shard(X, Replicated(R)), "w": fshard.shard(w, Replicated(R))}
        grads = torch.func.grad(loss)(params, fn)
        # Every replica of each gradient holds the total: the sum of the uses on all ranks.
        assert all(torch.allclose(s.data, xt.grad) for s in grads["x"].addressable_shards)
        assert all(torch.allclose(s.data, wt.grad) for s in grads["w"].addressable_shards)


def test_shard_map_errors_name_the_argument():
    with pytest.raises(
        SpecError, match=re.escape("shard_map() argument 1: its spec gives placement rank:0/cpu 2 blocks")
    ):
        fshard.shard_map(torch.add, (Chunk(0, R), Chunk(0, [0, 0, 1, 2])), Chunk(0, R))(X, X)
    with pytest.raises(SpecError, match=re.escape("shard_map() got 1 arguments but in_specs has 2 entries")):
        fshard.shard_map(torch.neg, (Chunk(0, R), Chunk(0, R)), Chunk(0, R))(X)
    with pytest.raises(TypeError, match=re.escape("takes its arguments by position, one per in_spec; got keyword")):
        fshard.shard_map(lambda a, k=1: a * k, Chunk(0, R), Chunk(0, R))(X, k=torch.tensor(2.0))
    with pytest.raises(SpecError, match="no block on"):
        fshard.shard_map(torch.neg, Chunk(0, R), Chunk(0, [0, 1]))(X)


# -- operators and sum ----------------------------------------------------------------------


OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**2,
    "neg": lambda a, b: -a,
    "radd": lambda a, b: 1.5 + a,
    "rsub": lambda a, b: 1 - a,
    "rdiv": lambda a, b: 2 / b,
    "lt": lambda a, b: a < b,
    "eq": lambda a, b: a == b,
    "ge": lambda a, b: a >= 0.5,
}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("spec", [Chunk(0, R), GRID, Replicated([0, 1])])
def test_operators_match_torch(name, spec):
    a, b = fshard.shard(X, spec), fshard.shard(Y, spec)
    assert torch.equal(fshard.gather(OPS[name](a, b)), OPS[name](X, Y))


NUMBER_OPS = {
    "div": (lambda a: a / 4, lambda t: t / 4),
    "rdiv": (lambda a: 2 / a, lambda t: 2 / t),
    "mul": (lambda a: a * 3, lambda t: t * 3),
    "rsub": (lambda a: 1 - a, lambda t: 1 - t),
    "neg": (lambda a: -a, lambda t: -t),
    "lt": (lambda a: a < 0.5, lambda t: t < 0.5),
    "int-div": (lambda a: a / 2, lambda t: t / 2),  # an int64 array: true division makes floats
}


@pytest.mark.parametrize("name", list(NUMBER_OPS))
@pytest.mark.parametrize("spec", [Chunk(0, R), GRID, Replicated([0, 1]), Chunk(0, [0, 0, 1, 1])])
def test_an_operator_with_a_number_gives_map_locals_array_without_it(name, spec, monkeypatch):
    """Values bit for bit, layout, dtype and gradients of each block, with one per-shard call counted."""
    from fshard._api import operators
    from fshard._exec import gathered

    op, fn = NUMBER_OPS[name]
    x = X.clone() if name != "int-div" else torch.arange(48).reshape(8, 6)
    grads = name not in ("lt", "int-div")
    if grads:
        x.requires_grad_()
    a = fshard.shard(x, spec)
    want = fshard.map_local(fn, a)
    calls = gathered.calls()
    monkeypatch.setattr(operators, "map_local", None)  # the operator must not need it
    got = op(a)
    assert gathered.calls() == calls + 1  # counted as map_local counts its call: every rank alike
    assert got.layout == want.layout
    assert got.dtype == want.dtype
    assert all(torch.equal(g, w) for g, w in zip(got.addressable_data, want.addressable_data))
    if grads:
        (g,) = torch.autograd.grad(fshard.gather(got).sum(), x)
        (w,) = torch.autograd.grad(fshard.gather(want).sum(), x)
        assert torch.equal(g, w)


def test_an_operator_on_a_pending_sum_keeps_its_summands_and_terms(monkeypatch):
    from fshard._api import operators
    from fshard._api.move import split_replicas

    p, parts = _summands()
    dp_tp = Mesh((2, 2), axis_names=("dp", "tp"))
    twice = fshard.reshard(p, Partial(Named(dp_tp, (None,)), over="tp"))  # each summand held twice (terms)
    assert twice.layout.terms is not None
    split = [split_replicas(q) for q in (p, twice)]  # the operators' linear maps split replicas of summands first
    want = [fshard.map_local(fn, q, linear=True) for q in split for fn in (lambda t: t / 4, lambda t: -t)]
    monkeypatch.setattr(operators, "map_local", None)
    got = [f(q) for q in (p, twice) for f in (lambda q: q / 4, lambda q: -q)]
    for g, w in zip(got, want):
        assert g.layout == w.layout
        assert torch.equal(fshard.gather(g), fshard.gather(w))
    assert torch.allclose(fshard.gather(got[0]), sum(parts) / 4)
    assert torch.allclose(fshard.gather(got[2]), sum(parts) / 4)  # each summand counted once


def test_an_operator_runs_through_map_local_in_check_mode(monkeypatch):
    """Check mode compares each call across ranks: the operator is then map_local's call."""
    from fshard._api import operators

    seen = []
    real = operators.map_local
    monkeypatch.setattr(operators, "map_local", lambda *a, **k: seen.append(1) or real(*a, **k))
    a = fshard.shard(X, Chunk(0, R))
    old = fshard.config(check_collectives=True)
    try:
        got = fshard.gather(a / 2)
    finally:
        fshard.config(check_collectives=old.check_collectives)
    assert seen == [1]
    assert torch.equal(got, X / 2)
    _ = a / 2
    assert seen == [1]


def test_an_operator_in_a_compiled_step_compiles_its_blocks_as_map_local_does():
    """A compiled caller compiles map_local's per-block function: an operator's too, so not on the blocks directly."""
    a = fshard.shard(X.clone().requires_grad_(), Chunk(0, R))

    def step(a):
        return a / 3, fshard.map_local(lambda t: t / 3, a)

    got, want = torch.compile(step, backend="aot_eager")(a)
    nodes = {type(t.grad_fn).__name__ for t in (*got.addressable_data, *want.addressable_data)}
    assert nodes == {"CompiledFunctionBackward"}
    assert torch.equal(fshard.gather(got), fshard.gather(want))


def test_an_operator_that_raises_counts_its_call_as_map_local_does():
    """A gather's backward asks whether any per-shard call ran since, on every rank alike: a raising one counts."""
    from fshard._exec import gathered

    flags = fshard.shard(torch.tensor([True, False, True, True]), Chunk(0, [0, 1]))
    for raising in (lambda: -flags, lambda: fshard.map_local(lambda t: -t, flags)):
        calls = gathered.calls()
        with pytest.raises(RuntimeError, match="Negation, the `-` operator, on a bool tensor is not supported"):
            raising()
        assert gathered.calls() == calls + 1


def test_operators_refuse_what_is_not_linear_in_a_pending_sum():
    p = fshard.shard(X, Chunk(1, R)).sum(1)
    x = fshard.shard(X.sum(1), fshard.Layout(p.layout.shape, p.layout.shards))  # p's boxes, not pending
    assert torch.allclose(fshard.gather(p * 2 - p / 4 + (-p)), 0.75 * X.sum(1))
    assert torch.allclose(fshard.gather(p * x), X.sum(1) ** 2)
    for bad in (lambda: p + 1, lambda: p * p, lambda: p**2, lambda: p < 0, lambda: 1 / p, lambda: x / p):
        with pytest.raises(SpecError, match="Reshard it to a non-partial spec first"):
            bad()
    with pytest.raises(SpecError, match="different layouts"):
        _ = fshard.shard(X, Chunk(0, R)) + fshard.shard(X, Chunk(1, R))
    with pytest.raises(TypeError, match="truth value of a ShardedArray is ambiguous"):
        bool(fshard.shard(X, Chunk(0, R)))


def test_a_pending_sum_is_not_scaled_by_inf_nor_divided_by_zero():
    """Summands of both signs scaled by inf sum to inf - inf (NaN) where the value times inf is inf: refused."""
    p = fshard.shard(torch.tensor([[3.0], [-2.0]]), Chunk(0, [0, 1])).sum(0)  # the value [1.0]
    for bad in (lambda: p * math.inf, lambda: -math.inf * p, lambda: p / 0.0, lambda: p * complex(1, math.inf)):
        with pytest.raises(SpecError, match="whose results can sum to NaN where the reduced value's is not"):
            bad()
    assert torch.equal(fshard.gather(p * np.float32(2.0)), torch.tensor([2.0]))  # a numpy scalar is a number
    assert fshard.gather(p * math.nan).isnan().all()  # NaN either way


def test_an_array_and_a_tensor_do_not_combine_and_say_how():
    """Before, == and != fell back to Python's identity comparison (a bool), the others to a bare TypeError."""
    a = fshard.shard(X, Chunk(0, R))
    for bad in (
        lambda: a == torch.tensor(2.0),
        lambda: a != torch.tensor(2.0),
        lambda: a + torch.ones(X.shape),
        lambda: torch.ones(X.shape) * a,
        lambda: a < np.zeros(X.shape),
    ):
        with pytest.raises(TypeError, match=r"of a ShardedArray and a (torch.Tensor|numpy array): .*fshard.shard"):
            bad()
    assert (a == None) is False  # noqa: E711  # other values still compare by identity
    assert torch.equal(fshard.gather(a * np.int64(3)), X * 3)


@pytest.mark.parametrize("spec", [Chunk(0, R), Chunk(1, R), Replicated(R), GRID, ROWS_PAIRS, Chunk(0, [0, 0, 1, 1])])
@pytest.mark.parametrize("dim", [None, 0, 1, (0, 1), -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_counts_every_element_once(spec, dim, keepdim):
    a = fshard.shard(X, spec)
    got = a.sum(keepdim=keepdim) if dim is None else a.sum(dim, keepdim=keepdim)
    want = X.sum(dim=(0, 1) if dim is None else dim, keepdim=keepdim)
    assert torch.allclose(fshard.gather(got), want)
    dims = (0, 1) if dim is None else dim if isinstance(dim, tuple) else (dim % 2,)
    split = any(s.sizes[d] != X.shape[d] for s in a.layout.shards if 0 not in s.sizes for d in dims)
    assert (got.layout.partial == "sum") == split


def test_gradient_through_sum_of_replicas_reaches_every_copy():
    def loss(params):
        return fshard.gather((params["w"] * params["w"]).sum(0)).sum()

    for spec in (Replicated(R), ROWS_PAIRS):
        grads = torch.func.grad(loss)({"w": fshard.shard(X, spec)})
        for s in grads["w"].addressable_shards:
            box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
            assert torch.allclose(s.data, 2 * X[box])


# -- tree helpers -----------------------------------------------------------------------------


def test_global_norm_counts_replicas_once_and_reduces_pending_sums():
    tree = {
        "w": fshard.shard(X, Replicated(R)),
        "b": fshard.shard(Y, GRID),
        "p": fshard.shard(X, Chunk(1, R)).sum(1),
        "t": torch.ones(3, dtype=torch.float64),
    }
    want = (X.pow(2).sum() + Y.pow(2).sum() + X.sum(1).pow(2).sum() + 3).sqrt()
    assert torch.allclose(fshard.global_norm(tree), want)
    clipped, norm = fshard.clip_grad_norm(tree, max_norm=1.0)
    assert torch.allclose(norm, want)
    assert torch.allclose(fshard.global_norm(clipped), torch.tensor(1.0, dtype=torch.float64))
    same, _ = fshard.clip_grad_norm(tree, max_norm=1e9)
    assert torch.equal(fshard.gather(same["w"]), X)


def test_global_norm_gives_every_copy_the_gradient():
    """Each box is read once, from its first copy; the gradient of that use reaches every copy."""
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    a = fshard.reshard(fshard.shard(x, Single(2)), Replicated(R))  # the reshard's backward reads one copy
    fshard.global_norm(a).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.6, 0.8]], dtype=torch.float64), rtol=1e-15, atol=0)
    w = fshard.shard(torch.tensor([3.0, 4.0], dtype=torch.float64), Replicated([0, 1]))
    blocks = [t.requires_grad_() for t in w.addressable_data]
    b = fshard.shard(X, Chunk(0, R))
    for t in b.addressable_data:  # each rank's share of the norm records a gradient, as processes require
        t.requires_grad_()
    (0.5 * fshard.global_norm({"w": w, "b": b}) ** 2).backward()
    for t in blocks:  # d(|w|^2 / 2)/dw = w, on both copies
        assert torch.equal(t.grad, torch.tensor([3.0, 4.0], dtype=torch.float64))


def test_torch_optim_over_the_leaves_of_a_tree_of_arrays():
    """The shard tensors are the optimizer's parameters; replicas get equal gradients and stay equal."""
    params = {"w": fshard.shard(X.clone(), Replicated([0, 1])), "b": fshard.shard(Y.clone(), Chunk(0, R))}
    leaves = [t.requires_grad_(True) for t in _leaves(params)]
    opt = torch.optim.SGD(leaves, lr=0.1)
    loss = (fshard.gather(params["w"]) * fshard.gather(params["b"])).sum()
    loss.backward()
    opt.step()
    w0, w1 = (s.data for s in params["w"].addressable_shards)
    assert torch.allclose(w0, X - 0.1 * Y)
    assert torch.equal(w0, w1)


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def test_sum_with_an_empty_shard_is_a_pending_sum_not_a_replica_of_zeros():
    x = fshard.shard(torch.arange(1.0, 5.0, dtype=torch.float64).reshape(1, 4), Chunk(0, [0, 1]))
    total = x.sum()
    assert total.layout.partial == "sum"
    assert [float(s.data) for s in total.addressable_shards] == [10.0]  # the empty shard adds nothing
    assert float(fshard.gather(total)) == 10.0


def test_a_sum_of_a_pending_sum_whose_result_is_empty_stays_on_its_placements():
    """Before, the sum of an empty pending sum over a dim that leaves no element had no shard at all:
    its gather raised about an internal spec (``Replicated`` of no placement)."""
    layout = Partial(Replicated([0, 1])).layout((0, 3))
    p = fshard.from_local_shards_and_layout([fshard.Shard(m, torch.zeros(m.sizes)) for m in layout.shards], layout)
    for got in (p.sum(1), p.sum(1, keepdim=True), p.sum(1) * 2):
        assert got.layout.partial == "sum"
        assert got.layout.ranks == (0, 1)
        assert fshard.gather(got).shape == torch.zeros(0, 3).sum(1, keepdim=got.ndim == 2).shape
    assert fshard.reshard(p.sum(1), Replicated([0, 1])).shape == (0,)
    assert fshard.gather(p.sum(0)).shape == (3,)  # a result with elements: the summands' zeros


def test_shard_map_resolves_its_arguments_targets_once_per_tuple_of_layouts():
    from fshard._api import map as _map

    f = fshard.shard_map(lambda x, w: x @ w, in_specs=(Chunk(0, R), Replicated(R)), out_specs=Chunk(0, R))
    g = torch.Generator().manual_seed(0)
    xs, ws = torch.randn(8, 3, generator=g), torch.randn(3, 2, generator=g)
    x, w = fshard.shard(xs, Chunk(1, R[:3])), fshard.shard(ws, Replicated(R))  # x moves, w stays
    _map._targets.cache_clear()  # pyright: ignore[reportFunctionMemberAccess]  # an lru_cache
    first, again = f(x, w), f(x, w)
    info = _map._targets.cache_info()  # pyright: ignore[reportFunctionMemberAccess]
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(fshard.gather(first), fshard.gather(again))
    assert torch.allclose(fshard.gather(first), xs @ ws)
    taller = fshard.shard(torch.randn(12, 3, generator=g), Chunk(0, R))  # other layouts: resolved for them
    assert f(taller, w).shape == (12, 2)
    assert _map._targets.cache_info().misses == 2  # pyright: ignore[reportFunctionMemberAccess]
    assert torch.allclose(fshard.gather(f(xs, w)), xs @ ws)  # a tensor argument: resolved per argument
    assert _map._targets.cache_info().misses == 2  # pyright: ignore[reportFunctionMemberAccess]


def test_shard_map_of_arrays_on_two_backends_names_the_two_backends():
    from fshard.backends.local import LocalBackend

    f = fshard.shard_map(lambda x, y: x + y, in_specs=(Chunk(0, [0, 1]), Chunk(0, [2, 3])), out_specs=Chunk(0, [0, 1]))
    two, four = LocalBackend(world_size=2), LocalBackend(world_size=4)
    a = fshard.shard(torch.ones(4), Chunk(0, [0, 1]), backend=two)
    b = fshard.shard(torch.ones(4), Chunk(0, [3, 2]), backend=four)  # to move to ranks the first backend lacks
    with pytest.raises(SpecError, match="live on different backends"):
        f(a, b)


def test_clip_grad_norm_refuses_a_pending_max_by_its_path():
    x = fshard.reshard(fshard.shard(X, Replicated(R)), Partial(Replicated(R), op="max"))
    with pytest.raises(SpecError, match=re.escape("clip_grad_norm() leaf ['g'][0] is a pending max")):
        fshard.clip_grad_norm({"g": [x]}, max_norm=1.0)
