"""torch.func over sharded arrays, and gradcheck of every op on random layouts.

- ``torch.func.grad`` / ``vjp`` / ``jvp`` / ``vmap`` / ``jacrev`` / ``jacfwd`` /
  ``hessian`` over functions whose inputs and outputs are pytrees holding
  ``ShardedArray``s; results come back as arrays in the inputs' layouts.
- ``torch.func.functional_call`` with a dict of gathered parameters, differentiated
  with respect to the sharded dict or the gathered one.
- ``torch.autograd.gradcheck`` (float64, reverse and forward mode) and
  ``gradgradcheck`` for each op on layouts drawn from ``fshard.testing.strategies``;
  batched derivatives through ``torch.func.vmap``.

All on the local backend, except the last section: the transforms on 4 Gloo
processes, every rank applying the same one (docs/autograd.md lists the limits).
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import fshard
from fshard import Layout, ShardMeta
from fshard.testing import strategies as fst

FEW = settings(max_examples=20, deadline=None)
SHAPES = fst.shapes(min_dims=1, max_dims=3, max_side=5)
RANKS = st.integers(0, 3)


def box(meta: ShardMeta) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))


def double(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def same_values(array: fshard.ShardedArray, full: torch.Tensor) -> None:
    """Every addressable shard of ``array`` (replicas included) holds its box of ``full``."""
    for s in array.addressable_shards:
        torch.testing.assert_close(s.data, full[box(s.meta)])


# -- torch.func over pytrees holding ShardedArrays ----------------------------------------------

ROWS = fshard.Chunk(0, [0, 1, 2])
GRID = fshard.Named(fshard.Mesh((2, 2)), ("x", None))  # rows split, replicated along the mesh's y axis
COLS = fshard.Chunk(1, [3, 1])


def tree_fn(tree: dict) -> torch.Tensor:
    """A scalar of a nested tree: a resharded array, a plain tensor, and a list of arrays."""
    w = fshard.gather(fshard.map_local(torch.tanh, fshard.reshard(tree["w"], COLS)))
    (u, v) = tree["pair"]
    uv = fshard.gather(fshard.map_local(torch.mul, u, fshard.reshard(v, u.layout)))
    return (w * tree["scale"]).sum() + uv.pow(2).sum()


def tree_reference(full: dict) -> torch.Tensor:
    u, v = full["pair"]
    return (torch.tanh(full["w"]) * full["scale"]).sum() + (u * v).pow(2).sum()


def make_tree() -> tuple[dict, dict]:
    full = {"w": double((5, 4), 0), "scale": double((4,), 1), "pair": [double((3, 6), 2), double((3, 6), 3)]}
    tree = {
        "w": fshard.shard(full["w"], GRID),
        "scale": full["scale"],
        "pair": [fshard.shard(full["pair"][0], ROWS), fshard.shard(full["pair"][1], COLS)],
    }
    return tree, full


def test_grad_of_a_pytree_returns_arrays_in_the_input_layouts() -> None:
    tree, full = make_tree()
    got = grad(tree_fn)(tree)
    want = grad(tree_reference)(full)
    assert optree.tree_structure(got, namespace="fshard") == optree.tree_structure(tree, namespace="fshard")
    assert got["w"].layout == tree["w"].layout
    assert [a.layout for a in got["pair"]] == [a.layout for a in tree["pair"]]
    same_values(got["w"], want["w"])  # every replica of a box carries the whole gradient of the box
    same_values(got["pair"][0], want["pair"][0])
    same_values(got["pair"][1], want["pair"][1])
    torch.testing.assert_close(got["scale"], want["scale"])


def test_grad_with_argnums_and_aux() -> None:
    tree, full = make_tree()
    (g_tree, g_x), aux = grad(lambda t, x: (tree_fn(t) * x, x + 1), argnums=(0, 1), has_aux=True)(
        tree, torch.tensor(2.0, dtype=torch.float64)
    )
    torch.testing.assert_close(g_x, tree_reference(full))
    same_values(g_tree["w"], 2 * grad(tree_reference)(full)["w"])
    assert aux.item() == 3.0


def test_vjp_with_sharded_inputs_and_outputs() -> None:
    x = double((6, 5), 4)
    a = fshard.shard(x, GRID)

    def f(arr: fshard.ShardedArray) -> dict:
        moved = fshard.map_local(torch.sin, fshard.reshard(arr, COLS))
        return {"moved": moved, "total": fshard.gather(moved).sum()}

    out, pull = vjp(f, a)
    assert out["moved"].layout == COLS.layout((6, 5))
    cot_full = double((6, 5), 5)
    cot = {"moved": fshard.shard(cot_full, COLS), "total": torch.tensor(3.0, dtype=torch.float64)}
    (got,) = pull(cot)
    assert got.layout == a.layout
    same_values(got, torch.cos(x) * (cot_full + 3.0))


def test_jvp_with_sharded_primals_and_tangents() -> None:
    x, t = double((5, 4), 6), double((5, 4), 7)
    f = lambda arr: fshard.map_local(torch.exp, fshard.reshard(arr, COLS))  # noqa: E731
    out, tangent = jvp(f, (fshard.shard(x, GRID),), (fshard.shard(t, GRID),))
    assert tangent.layout == COLS.layout((5, 4))
    same_values(out, torch.exp(x))
    same_values(tangent, torch.exp(x) * t)


def test_vmap_over_tensors_sharded_inside_with_an_unbatched_array() -> None:
    """The batch is a plain tensor, sharded per sample inside; a sharded argument passes unbatched."""
    xs, w = double((3, 5, 4), 8), double((5, 4), 9)
    weights = fshard.shard(w, GRID)

    def per_sample(t: torch.Tensor, arr: fshard.ShardedArray) -> torch.Tensor:
        prod = fshard.map_local(torch.mul, fshard.shard(t, arr.layout), arr)
        return fshard.gather(fshard.reshard(prod, COLS), dst=1).sum(0)

    torch.testing.assert_close(vmap(per_sample, in_dims=(0, None))(xs, weights), (xs * w).sum(1))
    inside = vmap(lambda t: fshard.gather(fshard.reshard(fshard.shard(t, GRID), COLS)))(xs)
    assert torch.equal(inside, xs)


def test_jacobians_and_hessian() -> None:
    x = double((4, 3), 9)

    def f(t: torch.Tensor) -> torch.Tensor:
        y = fshard.reshard(fshard.shard(t, ROWS, src=2), GRID)
        return fshard.gather(fshard.map_local(torch.sin, y), dst=3)

    want = torch.func.jacrev(torch.sin)(x)
    torch.testing.assert_close(jacrev(f)(x), want)
    torch.testing.assert_close(jacfwd(f)(x), want)
    torch.testing.assert_close(hessian(lambda t: f(t).pow(3).sum())(x), hessian(lambda t: t.sin().pow(3).sum())(x))


def test_grad_through_creation_functions() -> None:
    w = fshard.randn(GRID, 5, 4, seed=1, dtype=torch.float64)
    full = fshard.gather(w)
    g = grad(lambda a: fshard.gather(fshard.map_local(torch.square, fshard.reshard(a, COLS))).sum())(w)
    same_values(g, 2 * full)


# -- functional_call ------------------------------------------------------------------------------


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def test_functional_call_with_sharded_parameters_gathered_inside() -> None:
    model, x = mlp(), double((2, 6), 10)
    sharded = fshard.shard_params(model, lambda name, t: GRID if t.ndim == 2 else fshard.Replicated([1, 3]))

    def loss(params: dict, inputs: torch.Tensor) -> torch.Tensor:
        full = {k: fshard.gather(v) for k, v in params.items()}
        return functional_call(model, full, (inputs,)).pow(2).sum()

    got = grad(loss)(sharded, x)
    want = grad(lambda p, i: functional_call(model, p, (i,)).pow(2).sum())(dict(model.named_parameters()), x)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].layout == sharded[k].layout
        same_values(got[k], want[k])


def test_functional_call_differentiated_at_the_gathered_parameters() -> None:
    """The gathered dict is the input; it is sharded inside and gathered back for the module."""
    model, x = mlp(), double((2, 6), 11)
    gathered = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params: dict, inputs: torch.Tensor) -> torch.Tensor:
        moved = {
            k: fshard.gather(fshard.reshard(fshard.shard(v, ROWS), COLS)) for k, v in params.items() if v.ndim == 2
        }
        return functional_call(model, {**params, **moved}, (inputs,)).pow(2).sum()

    got = grad(loss)(gathered, x)
    want = grad(lambda p, i: functional_call(model, p, (i,)).pow(2).sum())(gathered, x)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


# -- gradcheck of every op on random layouts ------------------------------------------------------


def check(f, *inputs: torch.Tensor, gradgrad: bool = False) -> None:
    """Reverse and forward mode against finite differences (float64); optionally second order."""
    inputs = tuple(t.detach().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True, check_forward_ad=True)
    if gradgrad:
        assert torch.autograd.gradgradcheck(f, inputs, fast_mode=True)


@FEW
@given(fst.layouts(SHAPES), st.sampled_from([None, 0, 3]), st.integers(0, 2**16))
def test_gradcheck_shard(layout: Layout, src: int | None, seed: int) -> None:
    check(lambda t: fshard.gather(fshard.shard(t, layout, src=src)), double(layout.shape, seed), gradgrad=True)


@FEW
@given(fst.layouts(SHAPES), st.sampled_from([None, 0, 2]), st.integers(0, 2**16))
def test_gradcheck_gather(layout: Layout, dst: int | None, seed: int) -> None:
    check(
        lambda t: fshard.gather(fshard.map_local(torch.sin, fshard.shard(t, layout)), dst=dst),
        double(layout.shape, seed),
    )


@FEW
@given(fst.layout_pairs(SHAPES), st.integers(0, 2**16))
def test_gradcheck_reshard(pair: tuple[Layout, Layout], seed: int) -> None:
    a, b = pair
    check(
        lambda t: fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.shard(t, a), b))),
        double(a.shape, seed),
        gradgrad=True,
    )


def trailing(layout: Layout) -> Layout:
    """``layout`` with a new last dim of size 1 that every shard spans."""
    shards = tuple(ShardMeta((*m.offsets, 0), (*m.sizes, 1), m.placement) for m in layout.shards)
    return Layout((*layout.shape, 1), shards)


@FEW
@given(fst.layout_pairs(SHAPES), st.integers(0, 2**16))
def test_gradcheck_map_local(pair: tuple[Layout, Layout], seed: int) -> None:
    """Two arrays in one layout; the result grows a dim that no shard splits (shape inferred)."""
    a, b = trailing(pair[0]), trailing(pair[1])

    def f(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        u, v = fshard.shard(s, a), fshard.reshard(fshard.shard(t, b), a)
        return fshard.gather(fshard.map_local(lambda p, q: torch.cat([p * q, p.exp()], -1), u, v))

    check(f, double(a.shape, seed), double(a.shape, seed + 1))


@FEW
@given(SHAPES, st.lists(RANKS, min_size=1, max_size=5), st.integers(0, 2**16))
def test_gradcheck_map_local_with_out_spec(shape: tuple[int, ...], ranks: list[int], seed: int) -> None:
    rows = fshard.Chunk(0, ranks).layout(shape)
    width = 2 * math.prod(shape[1:])
    out = fshard.Chunk(0, ranks).layout((shape[0], width))

    def f(t: torch.Tensor) -> torch.Tensor:
        flat = lambda s: s.reshape(s.shape[0], width // 2)  # noqa: E731
        return fshard.gather(
            fshard.map_local(lambda s: torch.cat([flat(s), flat(s).cos()], 1), fshard.shard(t, rows), out_spec=out)
        )

    check(f, double(shape, seed))


@FEW
@given(
    SHAPES.flatmap(lambda s: st.tuples(fst.guillotine_layouts(s, max_replicas=1), fst.layouts(s))),
    st.integers(0, 2**16),
)
def test_gradcheck_from_local_shards(pair: tuple[Layout, Layout], seed: int) -> None:
    """Without replicas each shard is an independent input: gradcheck perturbs each one."""
    a, b = pair
    parts = [double(m.sizes, seed + k) for k, m in enumerate(a.shards)]

    def via_layout(*ts: torch.Tensor) -> torch.Tensor:
        arr = fshard.from_local_shards_and_layout([fshard.Shard(m, t) for m, t in zip(a.shards, ts)], a)
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(arr, b)))

    def via_exchange(*ts: torch.Tensor) -> torch.Tensor:
        arr = fshard.from_local_shards([fshard.Shard(m, t) for m, t in zip(a.shards, ts)], a.shape)
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(arr, b)))

    def via_tensor(t: torch.Tensor) -> torch.Tensor:  # on the local backend: the whole array, on rank 0
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.from_local_tensor(t, dim=0), b)))

    check(via_layout, *parts)
    check(via_exchange, *parts)
    check(via_tensor, double(a.shape, seed))


@FEW
@given(fst.layout_pairs(SHAPES), st.sampled_from(["zeros", "ones", "randn", "full"]), st.integers(0, 2**16))
def test_gradients_of_creation_leaves(pair: tuple[Layout, Layout], kind: str, seed: int) -> None:
    """Every shard of a created array is a leaf; each gets the gradient of its box, replicas too."""
    a, b = pair
    make = {
        "zeros": lambda: fshard.zeros(a, a.shape, dtype=torch.float64, requires_grad=True),
        "ones": lambda: fshard.ones(a, a.shape, dtype=torch.float64, requires_grad=True),
        "randn": lambda: fshard.randn(a, a.shape, seed=seed, dtype=torch.float64, requires_grad=True),
        "full": lambda: fshard.full(a, a.shape, fill_value=0.5, dtype=torch.float64, requires_grad=True),
    }[kind]
    x = make()
    assert x.requires_grad
    assert all(t.is_leaf for t in x.addressable_data)
    w = double(a.shape, seed + 1)
    (fshard.gather(fshard.map_local(torch.sin, fshard.reshard(x, b))) * w).sum().backward()
    full = fshard.gather(x).detach()
    for s in x.addressable_shards:
        want = (torch.cos(full) * w)[box(s.meta)]
        torch.testing.assert_close(s.data.grad if s.data.numel() else torch.zeros_like(want), want)


@FEW
@given(fst.layout_pairs(SHAPES), st.sampled_from([None, 1]), st.integers(0, 2**16))
def test_batched_forward_and_reverse_derivatives(pair: tuple[Layout, Layout], dst: int | None, seed: int) -> None:
    """``vmap`` over ``jvp`` and over a ``vjp``'s pullback: every sample as the unbatched call gives."""
    a, b = pair
    x, ts = double(a.shape, seed), double((3, *a.shape), seed + 1)

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.shard(t, a, src=0), b)), dst=dst)

    torch.testing.assert_close(vmap(lambda t: jvp(f, (x,), (t,))[1])(ts), torch.cos(x) * ts)
    _, pull = vjp(f, x)
    torch.testing.assert_close(vmap(lambda t: pull(t)[0])(ts), torch.cos(x) * ts)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0)])
def test_degenerate_shapes(shape: tuple[int, ...]) -> None:
    x = double(shape)
    lay = fshard.Replicated([0, 2]).layout(shape)
    check(lambda t: fshard.gather(fshard.reshard(fshard.shard(t, lay), fshard.Single(1))), x, gradgrad=True)


# -- torch.func under torch_dist: the pool of 4 Gloo processes ------------------------------------

POOL_PAIRS = {
    "rows -> columns": (fshard.Chunk(0, [0, 1, 2, 3]), fshard.Chunk(1, [3, 2, 1, 0])),
    "grid with replicas -> uneven rows": (GRID, fshard.Chunk(0, [2, 0, 1, 3, 3])),
    "replicated -> grid": (fshard.Replicated([0, 1, 2, 3]), fshard.Named(fshard.Mesh((2, 2)), ("y", "x"))),
    # Ranks that hold no shard of an array still take part in its backward.
    "one rank -> two ranks": (fshard.Single(0), fshard.Chunk(0, [1, 2])),
    "two ranks -> one rank": (fshard.Chunk(1, [3, 1]), fshard.Single(2)),
}


def _transforms_over_processes(a_spec, b_spec) -> bool:
    """grad, vjp, jvp, vmap, jacrev and jacfwd with every rank applying the same transform."""
    x, ts = double((5, 4), 20), double((3, 5, 4), 21)
    a, b = a_spec.layout((5, 4)), b_spec.layout((5, 4))

    def f(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(torch.sin, fshard.reshard(fshard.shard(t, a), b)))

    torch.testing.assert_close(grad(lambda t: f(t).sum())(x), torch.cos(x))
    out, pull = vjp(f, x)
    torch.testing.assert_close(out, torch.sin(x))
    torch.testing.assert_close(pull(ts[0])[0], torch.cos(x) * ts[0])
    torch.testing.assert_close(jvp(f, (x,), (ts[1],))[1], torch.cos(x) * ts[1])
    torch.testing.assert_close(vmap(f)(ts), torch.sin(ts))
    torch.testing.assert_close(vmap(lambda t: pull(t)[0])(ts), torch.cos(x) * ts)
    torch.testing.assert_close(jacrev(f)(x), torch.func.jacrev(torch.sin)(x))
    torch.testing.assert_close(jacfwd(f)(x), torch.func.jacrev(torch.sin)(x))
    # Forward over reverse: a rank that holds no shard reaches the gradients of gradients through its link.
    cubes = hessian(lambda t: torch.sin(t).pow(3).sum())(x)
    torch.testing.assert_close(hessian(lambda t: f(t).pow(3).sum())(x), cubes)
    tree = {"w": fshard.shard(x, a), "s": torch.tensor(2.0, dtype=torch.float64)}
    g = grad(lambda p: (fshard.gather(fshard.map_local(torch.sin, fshard.reshard(p["w"], b))) * p["s"]).sum())(tree)
    assert g["w"].layout == a
    same_values(g["w"], 2 * torch.cos(x))
    torch.testing.assert_close(g["s"], torch.sin(x).sum())
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(POOL_PAIRS))
def test_torch_func_transforms_over_gloo(dist_pool, name: str) -> None:
    assert dist_pool.run(_transforms_over_processes, *POOL_PAIRS[name]) == [True] * 4


def _linearize_across_processes(owners: list[int]) -> str:
    """``torch.func.linearize`` of a movement across processes: the error it raised."""
    x = double((4, 2), 40)

    def f(t: torch.Tensor) -> torch.Tensor:
        a = fshard.map_local(torch.sin, fshard.shard(t, fshard.Chunk(0, owners)))
        return fshard.gather(fshard.reshard(a, fshard.Chunk(0, [0, 1, 2, 3])))

    try:
        torch.func.linearize(f, x)
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node:UserWarning")  # torch's own linearize
@pytest.mark.parametrize("owners", [[0, 1], [0, 1, 2, 3]])
def test_linearize_across_processes_is_refused_on_every_rank(dist_pool, owners: list[int]) -> None:
    """Its trace would replay without the collectives (tangents of zeros); in one process it is exact."""
    x, v = double((4, 2), 40), double((4, 2), 41)
    layout = fshard.Chunk(0, owners)
    _, tangent_of = torch.func.linearize(
        lambda t: fshard.gather(fshard.map_local(torch.sin, fshard.shard(t, layout))), x
    )
    torch.testing.assert_close(tangent_of(v), torch.cos(x) * v)  # the local backend
    got = dist_pool.run(_linearize_across_processes, owners, timeout=60)
    assert len(set(got)) == 1
    assert "fshard's movements across processes cannot be traced to be replayed" in got[0], got


def _exchange_inside_transforms() -> bool:
    """Functions that exchange metadata between ranks work inside grad, vjp and jvp."""
    x, t = double((4, 3), 30), double((4, 3), 31)
    rows = fshard.Chunk(0, [0, 1, 2, 3])

    def f(v: torch.Tensor) -> torch.Tensor:
        a = fshard.shard(v, rows)
        assert fshard.equal(a, a)
        assert fshard.allclose(a, fshard.reshard(a, fshard.Chunk(1, [3, 2, 1])))
        b = fshard.from_local_shards(list(a.addressable_shards), v.shape)
        return fshard.gather(fshard.map_local(torch.sin, b))

    torch.testing.assert_close(grad(lambda v: f(v).sum())(x), torch.cos(x))
    torch.testing.assert_close(vjp(f, x)[1](t)[0], torch.cos(x) * t)
    torch.testing.assert_close(jvp(f, (x,), (t,))[1], torch.cos(x) * t)
    return True


@pytest.mark.multiprocess
def test_metadata_exchanges_inside_transforms_over_gloo(dist_pool) -> None:
    assert dist_pool.run(_exchange_inside_transforms) == [True] * 4
