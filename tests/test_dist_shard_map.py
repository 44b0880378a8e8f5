"""shard_map and map_local give the same values and gradients on the local backend and on Gloo.

Programs with closed-over tensors (plain ones, module parameters reached through a closure),
replication claims checked against what the results vary over, each run once on the local
backend (in this process) and once on 4 Gloo processes, compared exactly (float64).
"""

from __future__ import annotations

import re

import optree
import pytest
import torch
import torch.distributed as dist

import fshard

_ROWS01 = fshard.Chunk(0, [0, 1])  # rows that ranks 2 and 3 hold none of

pytestmark = pytest.mark.multiprocess


def _closed_over_scalar() -> list[float]:
    x = (torch.arange(8.0, dtype=torch.float64) / 10).requires_grad_()
    y = (3.0 * x).sum()  # closed over by the body
    mesh = fshard.Mesh((4,))
    xs = fshard.shard(x.detach(), fshard.Named(mesh, ("x",)))
    z = fshard.shard_map(
        lambda b: 2 * b * y, in_specs=fshard.Named(mesh, ("x",)), out_specs=fshard.Named(mesh, ("x",))
    )(xs)
    fshard.gather(z).sum().backward()
    return x.grad.tolist()


def _closed_over_module() -> list[list[float]]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2, dtype=torch.float64)
    ranks = [0, 1, 2, 3]
    data = torch.arange(24.0, dtype=torch.float64).reshape(8, 3) / 7
    xs = fshard.shard(data, fshard.Chunk(0, ranks))
    out = fshard.shard_map(
        lambda b: torch.tanh(lin(b)), in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks)
    )(xs)
    (fshard.gather(out) ** 2).sum().backward()
    return [lin.weight.grad.tolist(), lin.bias.grad.tolist()]


def _closed_over_in_map_local() -> list[float]:
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    a = fshard.shard(torch.arange(8.0, dtype=torch.float64).reshape(4, 2), fshard.Chunk(0, [0, 1, 2, 3]))
    fshard.gather(fshard.map_local(lambda t: t * w, a)).pow(2).sum().backward()
    return w.grad.tolist()


def _closed_over_with_replicas() -> list[float]:
    # Rows over x, replicated over y: each result copy counts once.
    mesh = fshard.Mesh((2, 2))
    spec = fshard.Named(mesh, ("x", None))
    w = torch.tensor([0.5, 3.0], dtype=torch.float64, requires_grad=True)
    a = fshard.shard(torch.arange(8.0, dtype=torch.float64).reshape(4, 2), spec)
    fshard.gather(fshard.shard_map(lambda b: torch.sin(b * w), in_specs=spec, out_specs=spec)(a)).sum().backward()
    return w.grad.tolist()


def _closed_over_under_vmap_of_grad() -> list[list[float]]:
    """Per-example gradients (``vmap(grad(f))``) of a tensor that a per-shard function closes over."""
    a = fshard.shard(torch.arange(12.0, dtype=torch.float64).reshape(4, 3), fshard.Chunk(0, [0, 1, 2, 3]))

    def f(w: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(lambda t: t * w, a)).pow(2).sum()

    return torch.func.vmap(torch.func.grad(f))(torch.arange(6.0, dtype=torch.float64).reshape(2, 3)).tolist()


def _closed_over_under_hessian() -> list[list[float]]:
    """``hessian`` (forward over reverse) of a function whose per-shard body closes over its argument."""
    a = fshard.shard(torch.arange(12.0, dtype=torch.float64).reshape(4, 3), fshard.Chunk(0, [0, 1, 2, 3]))

    def f(w: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.shard_map(lambda t: torch.sin(t * w), fshard.Chunk(0, [0, 1, 2, 3]),
                                              fshard.Chunk(0, [0, 1, 2, 3]))(a)).sum()  # fmt: skip

    return torch.func.hessian(f)(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)).tolist()


PROGRAMS = {
    "closed-over-under-vmap-of-grad": _closed_over_under_vmap_of_grad,
    "closed-over-under-hessian": _closed_over_under_hessian,
    "closed-over-scalar": _closed_over_scalar,
    "closed-over-module": _closed_over_module,
    "closed-over-map-local": _closed_over_in_map_local,
    "closed-over-with-replicas": _closed_over_with_replicas,
}


def _flat(x) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def _close(a, b) -> bool:
    a, b = torch.tensor(_flat(a), dtype=torch.float64), torch.tensor(_flat(b), dtype=torch.float64)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradients_of_closed_over_tensors_are_the_same_on_both_backends(dist_pool, name):
    local = PROGRAMS[name]()
    for rank, got in enumerate(dist_pool.run(PROGRAMS[name], timeout=60)):
        assert _close(got, local), f"rank {rank}: {got} != {local}"


def test_closed_over_gradient_is_the_sum_of_its_uses():
    # loss = sum(2 * b * y) with y = 3 * sum(x): d loss / d x_i = 3 * 2 * sum(x) = 16.8.
    assert _close(_closed_over_scalar(), [6 * 2.8] * 8)


def test_closed_over_gradients_under_transforms_are_those_of_the_dense_program():
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    w = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    assert _close(_closed_over_under_vmap_of_grad(), (2 * (x * x).sum(0) * w).tolist())  # d/dw sum((x w)^2)
    v = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    assert _close(_closed_over_under_hessian(), torch.diag(-(x * x * torch.sin(x * v)).sum(0)).tolist())


def _closed_over_where_a_rank_holds_no_block() -> str:
    w = torch.tensor([2.0], requires_grad=True)
    a = fshard.shard(torch.arange(6.0), fshard.Chunk(0, [0, 1, 2]))
    try:
        fshard.map_local(lambda t: t * w, a)
    except fshard.SpecError as e:
        return str(e)
    return "no error"


def test_closed_over_tensor_with_a_rank_without_blocks_is_refused_on_every_rank(dist_pool):
    for msg in dist_pool.run(_closed_over_where_a_rank_holds_no_block, timeout=60):
        assert "closed over" in msg
        assert "ranks [3] hold no block" in msg
        assert "Replicated" in msg


def _closed_over_without_grad_where_a_rank_holds_no_block() -> list[float]:
    w = torch.tensor([2.0])
    a = fshard.shard(torch.arange(6.0), fshard.Chunk(0, [0, 1, 2]))
    return fshard.gather(fshard.map_local(lambda t: t * w, a)).tolist()


def test_closed_over_tensor_without_grad_needs_no_block_anywhere(dist_pool):
    for got in dist_pool.run(_closed_over_without_grad_where_a_rank_holds_no_block, timeout=60):
        assert got == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def _claimed_replicas() -> list[float]:
    # Rows over x, replicated over y: the copies along y are replicas the arguments imply.
    mesh = fshard.Mesh((2, 2))
    spec = fshard.Named(mesh, ("x", None))
    y = fshard.shard_map(lambda t: t.cumsum(1), in_specs=spec, out_specs=spec)(torch.arange(12.0).reshape(4, 3))
    moved = fshard.reshard(y, fshard.Single(3))
    return [*fshard.gather(y).flatten().tolist(), float(fshard.equal(y, moved))]


def _refused_claim() -> str:
    mesh = fshard.Mesh((2, 2))
    try:
        fshard.shard_map(
            lambda t: 2 * t, in_specs=fshard.Named(mesh, ("x", "y")), out_specs=fshard.Named(mesh, (None, "y"))
        )(torch.ones(4, 4))
    except fshard.SpecError as e:
        return str(e)
    return "no error"


def test_accepted_claims_give_the_same_values_on_both_backends(dist_pool):
    local = _claimed_replicas()
    assert local[-1] == 1.0
    assert dist_pool.run(_claimed_replicas, timeout=60) == [local] * 4


def test_a_refused_claim_raises_on_every_rank(dist_pool):
    for msg in dist_pool.run(_refused_claim, timeout=60):
        assert "replicas along mesh axis 'x'" in msg


def _trusted_claim_in_check_mode(honest: bool) -> str:
    mesh = fshard.Mesh((2, 2))
    body = (lambda t: t.sum(0, keepdim=True) * 0) if honest else (lambda t: t.sum(0, keepdim=True))
    old = fshard.config(check_collectives=True)
    try:
        y = fshard.shard_map(
            body, in_specs=fshard.Named(mesh, ("x", "y")), out_specs=fshard.Named(mesh, (None, "y")), check_vma=False
        )(torch.arange(16.0).reshape(4, 4))
        return f"ok {tuple(y.shape)}"
    except fshard.ReplicaMismatchError as e:
        return str(e)
    finally:
        fshard.config(**{"check_collectives": old.check_collectives})


def test_check_mode_compares_the_copies_that_check_vma_false_trusts(dist_pool):
    assert dist_pool.run(_trusted_claim_in_check_mode, True, timeout=60) == ["ok (1, 4)"] * 4
    for msg in dist_pool.run(_trusted_claim_in_check_mode, False, timeout=60):
        assert "result 0 of shard_map()" in msg


def test_a_local_world_of_four_refuses_the_closure_as_four_processes_do():
    from fshard.backends.local import LocalBackend

    four = LocalBackend(world_size=4)
    w = torch.tensor([2.0], requires_grad=True)
    a = fshard.shard(torch.arange(6.0), fshard.Chunk(0, [0, 1, 2]), backend=four)
    with pytest.raises(fshard.SpecError, match=r"ranks \[3\] hold no block"):
        fshard.map_local(lambda t: t * w, a)
    v = torch.ones(3, requires_grad=True)
    g = fshard.gather(fshard.shard(v, fshard.Replicated([0, 1, 2]), backend=four))
    assert g.requires_grad
    fshard.map_local(lambda t: t * g.sum(), a)  # a gathered tensor is no closure: accepted alike
    every = fshard.shard(torch.arange(8.0), fshard.Chunk(0, [0, 1, 2, 3]), backend=four)
    fshard.gather(fshard.map_local(lambda t: t * w, every)).sum().backward()
    assert w.grad.tolist() == [28.0]


def _array_made_inside_a_body(kind: str) -> str:
    """An fn that makes an array of its block: each placement's, not one global value; refused on both backends."""
    ranks = [0, 1, 2, 3]
    rows = fshard.Chunk(0, ranks)
    twice = fshard.shard_map(lambda t: t * 2, in_specs=rows, out_specs=rows)
    fns = {
        "shard_map of the block": lambda b: fshard.gather(twice(b)),
        "shard of the block": lambda b: fshard.gather(fshard.shard(b, fshard.Replicated(ranks))),
        "shard from a rank": lambda b: fshard.gather(fshard.shard(b, fshard.Replicated(ranks), src=0)),
    }
    x = fshard.shard(torch.arange(8.0), rows)
    try:
        if kind == "map_local":
            fshard.map_local(fns["shard of the block"], x)
        else:
            fshard.shard_map(fns[kind], in_specs=rows, out_specs=rows)(x)
    except fshard.SpecError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind", ["shard_map of the block", "shard of the block", "shard from a rank", "map_local"])
def test_an_array_made_of_a_block_inside_fn_is_refused_on_both_backends(dist_pool, kind):
    local = _array_made_inside_a_body(kind)
    what = "map_local()" if kind == "map_local" else "shard_map()"
    called = "shard_map" if kind == "shard_map of the block" else "shard"
    assert local.startswith(f"{called}() was called inside {what}'s fn, which runs once per placement")
    assert dist_pool.run(_array_made_inside_a_body, kind, timeout=60) == [local] * 4


def _array_function_of_a_closed_over_array_inside_fn(kind: str) -> tuple[str, list[list[float]]]:
    """A body that moves a closed-over array that records a gradient: refused; moved before the call, it sums.

    Returns the refusal's first words, and each shard's gradient (this process's) when the
    array is gathered before the call and the tensor closed over.
    """
    ranks = [0, 1, 2, 3]
    rows = fshard.Chunk(0, ranks)
    x = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)
    w = fshard.map_local(
        lambda t: t.detach().requires_grad_(), fshard.shard(torch.arange(4.0, dtype=torch.float64), rows)
    )
    fns = {
        "gather": lambda a: a * fshard.gather(w),
        "reshard": lambda a: a * fshard.reshard(w, fshard.Replicated(ranks)).addressable_data[0],
        "map_local": lambda a: a * fshard.gather(fshard.map_local(torch.neg, w)),
        "an operator": lambda a: a * fshard.gather(w * 2),
        "global_norm": lambda a: a * fshard.global_norm(w),
        "addressable_data": lambda a: a * w.addressable_data[0],  # every rank's in one process, its own across
    }
    try:
        fshard.shard_map(fns[kind], in_specs=rows, out_specs=rows)(x)
        refused = "no error"
    except fshard.SpecError as e:
        refused = str(e).split(",")[0]
    whole = fshard.gather(w)
    fshard.gather(fshard.shard_map(lambda a: a * whole, in_specs=rows, out_specs=rows)(x)).sum().backward()
    return refused, [t.grad.tolist() for t in w.addressable_data]


@pytest.mark.parametrize("kind", ["gather", "reshard", "map_local", "an operator", "global_norm", "addressable_data"])
def test_a_function_of_a_closed_over_array_inside_fn_is_refused_on_both_backends(dist_pool, kind):
    """Across processes it ran once per rank, in one process once per placement: the gradients differed."""
    said = {"an operator": "* of an array was applied", "addressable_data": "the addressable_data of an array was read"}
    doing = said.get(kind, f"{kind}() was called")
    local = _array_function_of_a_closed_over_array_inside_fn(kind)
    assert local == (f"{doing} inside shard_map()'s fn", [[24.0], [28.0], [32.0], [36.0]])
    got = dist_pool.run(_array_function_of_a_closed_over_array_inside_fn, kind, timeout=60)
    assert got == [(local[0], [g]) for g in local[1]]


def _closure_without_gradient(use: str, backend=None) -> list:
    """A closed-over tensor that requires grad, used only in ways that give it no gradient; ranks 2, 3 hold no block."""
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    uses = {
        "detach": lambda t: t * w.detach(),
        "shape": lambda t: t * w.shape[0],
        "tolist": lambda t: t * w.tolist()[0],
        "data": lambda t: t * w.data,
        "both": lambda t: t * w.detach() + t * w,  # a use with a gradient too: refused
    }
    kw = {} if backend is None else {"backend": backend}
    rows = fshard.shard(torch.arange(8.0).reshape(4, 2), fshard.Chunk(0, [0, 1]), **kw)
    try:
        return fshard.gather(fshard.map_local(uses[use], rows)).tolist()
    except fshard.SpecError as e:
        return [str(e).split(",")[0]]


@pytest.mark.parametrize("use", ["detach", "shape", "tolist", "data", "both"])
def test_a_closure_used_without_gradient_is_not_refused_on_either_backend(dist_pool, use):
    from fshard.backends.local import LocalBackend

    local = _closure_without_gradient(use, LocalBackend(world_size=4))
    x = torch.arange(8.0).reshape(4, 2)
    w = torch.tensor([1.5, -2.0])
    want = {"detach": x * w, "shape": x * 2, "tolist": x * 1.5, "data": x * w}
    if use == "both":
        assert local == ["map_local() fn uses 1 tensor(s) from outside its arguments that require grad (closed over)"]
    else:
        assert local == want[use].tolist()
    assert dist_pool.run(_closure_without_gradient, use, timeout=60) == [local] * 4


def _closure_on_some_ranks(out_spec: str) -> tuple[str, str]:
    """A closed-over tensor that rank 1's body alone uses: (the error's type, its start) on this rank.

    With a ``Partial`` result the ranks learn it at the backward's first collective (the call's posted
    check); with a ``Chunk`` result whose shape is inferred, at the call's exchange of outcomes.
    """
    from fshard.backends.torch_dist import TorchDistBackend

    backend = TorchDistBackend()
    rep = fshard.Replicated([0, 1, 2, 3])
    rows = fshard.Chunk(0, [0, 1, 2, 3])
    w = fshard.shard(torch.eye(3, dtype=torch.float64), rep)
    for t in w.addressable_data:
        t.requires_grad_()
    c = torch.eye(3, dtype=torch.float64).requires_grad_()

    def body(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        y = xb @ wb
        if backend.rank == 1:  # data-dependent: the other ranks never use c
            y = y @ c
        return (y**2).sum()[None] if out_spec == "partial" else y[:, :1]

    x = fshard.from_local_tensor(torch.ones(2, 3, dtype=torch.float64), dim=0)
    out = fshard.Partial(rep) if out_spec == "partial" else fshard.Chunk(0, [0, 1, 2, 3])
    try:
        fshard.gather(fshard.shard_map(body, in_specs=(rows, rep), out_specs=out)(x, w)).sum().backward()
    except fshard.SpecError as e:
        return type(e).__name__, str(e).split(" from outside", 1)[0]
    return "no error", ""


@pytest.mark.parametrize("out_spec", ["partial", "chunk"])
def test_a_closure_some_ranks_use_is_refused_on_every_rank(dist_pool, out_spec):
    """Its gradient is a sum over the ranks that every rank must join: refused alike, not left waiting."""
    got = dist_pool.run(_closure_on_some_ranks, out_spec, timeout=60)
    assert {kind for kind, _ in got} == {"SpecError"}
    assert all("tensor" in start and "shard_map() fn used" in start for _, start in got)


def _closure_on_some_ranks_anywhere(out_spec: str) -> tuple[str, str]:
    """A closed-over tensor that the body of rank 1's rows alone uses (a branch on the data): on either backend."""
    rep, rows = fshard.Replicated([0, 1, 2, 3]), fshard.Chunk(0, [0, 1, 2, 3])
    c = torch.eye(3, dtype=torch.float64).requires_grad_()

    def body(xb: torch.Tensor) -> torch.Tensor:
        y = xb * 2
        if xb[0, 0] == 3:  # rank 1's block starts at x[1, 0] = 3
            y = y @ c
        return (y**2).sum()[None] if out_spec == "partial" else y[:, :1]

    x = fshard.shard(torch.arange(12.0, dtype=torch.float64).reshape(4, 3), rows)
    out = fshard.Partial(rep) if out_spec == "partial" else fshard.Chunk(0, [0, 1, 2, 3])
    try:
        fshard.gather(fshard.shard_map(body, in_specs=rows, out_specs=out)(x)).sum().backward()
    except fshard.SpecError as e:
        return type(e).__name__, str(e).split(" from outside", 1)[0]
    return "no error", ""


@pytest.mark.parametrize("out_spec", ["partial", "chunk"])
def test_the_local_backend_refuses_a_closure_some_ranks_use(dist_pool, out_spec):
    """One process runs every rank's body and could sum the uses itself, but refuses them as processes do."""
    want = ("SpecError", "shard_map() fn used different numbers of tensors")
    assert dist_pool.run(_closure_on_some_ranks_anywhere, out_spec, timeout=60) == [want] * 4
    assert _closure_on_some_ranks_anywhere(out_spec) == want
    rows, c = fshard.Chunk(0, [0, 1, 2, 3]), torch.ones(1, 1, requires_grad=True)
    with pytest.raises(fshard.SpecError, match=re.escape("ranks (0 on ranks [0, 2, 3]; 1 on ranks [1]): ")):
        fshard.shard_map(lambda t: t @ c if t[0, 0] == 1 else t, in_specs=rows, out_specs=rows)(
            fshard.shard(torch.arange(4.0)[:, None], rows)
        )


def _closure_every_rank_uses(case: str) -> float:
    """Closed-over tensors that every rank's body uses, on either backend: a loss and a gradient, summed.

    ``cached``: a weight-normed Linear under ``parametrize.cached()``: in one process the first rank's
    body computes its weight from two tensors, the others take it from the cache. ``psum``: a body that
    reduces (its calls run in threads in one process), closing over a tensor made by an op.
    """
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    rows, every = fshard.Chunk(0, [0, 1, 2, 3]), fshard.Replicated([0, 1, 2, 3])
    x = fshard.shard(torch.arange(12.0, dtype=torch.float64).reshape(4, 3) / 7, rows)
    if case == "cached":
        torch.manual_seed(0)
        lin = weight_norm(torch.nn.Linear(3, 2, bias=False).double())
        f = fshard.shard_map(lambda b: torch.tanh(lin(b)).sum()[None], in_specs=rows, out_specs=fshard.Partial(every))
        with parametrize.cached():
            loss = fshard.gather(f(x)).sum()
        loss.backward()
        return loss.item() + lin.parametrizations.weight.original0.grad.sum().item()
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    c = w * 2.0
    f = fshard.shard_map(
        lambda b: (b * c * fshard.psum((b * c).sum(), "x")).sum()[None], in_specs=rows, out_specs=fshard.Partial(every)
    )
    loss = fshard.gather(f(x)).sum()
    loss.backward()
    return loss.item() + w.grad.sum().item()


@pytest.mark.parametrize("case", ["cached", "psum"])
def test_a_closure_every_rank_uses_is_accepted_on_both_backends(dist_pool, case):
    local = _closure_every_rank_uses(case)
    got = dist_pool.run(_closure_every_rank_uses, case, timeout=60)
    assert got == [pytest.approx(local, rel=1e-12, abs=0)] * 4


def _stop_gradient_of_rows_two_ranks_hold() -> list:
    """Results that need no gradient (a stop-gradient target, a metric) of rows that ranks 2 and 3 hold none of.

    Those ranks' links follow what the other ranks' fn returned: the target, moved onto every rank and
    used in the loss, and the metric, moved onto every rank, need no gradient on any rank.
    """
    x = torch.arange(8.0).reshape(4, 2).requires_grad_()
    rows = fshard.Chunk(0, [0, 1])
    pred = fshard.shard(x, rows)
    target = fshard.map_local(lambda t: t.detach() * 0.5, pred)
    hits = fshard.map_local(lambda t: (t > 3).float(), pred)
    half = fshard.shard_map(lambda t: t.detach() * 0.5, in_specs=(rows,), out_specs=rows)(pred)
    every = fshard.Chunk(0, [0, 1, 2, 3])
    loss = (fshard.gather(pred) - fshard.gather(fshard.reshard(target, every))).pow(2).sum()
    loss = loss + (fshard.gather(pred) - fshard.gather(fshard.reshard(half, every))).pow(2).sum()
    loss.backward()
    metric = fshard.gather(fshard.reshard(hits, every)).mean()
    return [target.requires_grad, hits.requires_grad, half.requires_grad, loss.item(), x.grad.tolist(), metric.item()]


def test_a_result_that_needs_no_gradient_needs_none_on_ranks_without_blocks(dist_pool):
    local = _stop_gradient_of_rows_two_ranks_hold()
    assert local[:4] == [False, False, False, 2 * 0.25 * sum(v * v for v in range(8))]
    assert dist_pool.run(_stop_gradient_of_rows_two_ranks_hold, timeout=60) == [local] * 4


def _stop_gradient_under_func_grad() -> list:
    """``torch.func.grad`` of a loss with a stop-gradient target of rows that ranks 2 and 3 hold none of."""
    a = fshard.shard(torch.arange(8.0).reshape(4, 2), fshard.Chunk(0, [0, 1]))

    def loss(a: fshard.ShardedArray) -> torch.Tensor:
        target = fshard.map_local(lambda t: t.detach(), a)
        return (fshard.gather(a) - 0.5 * fshard.gather(target)).pow(2).sum()

    return [t.tolist() for t in optree.tree_leaves(torch.func.grad(loss)(a))]


def test_a_stop_gradient_under_func_grad_has_the_local_gradient(dist_pool):
    a = torch.arange(8.0).reshape(4, 2)
    local = _stop_gradient_under_func_grad()  # d/da sum((a - stop(a) / 2)^2) = 2 * (a / 2) = a
    assert local == [a[:2].tolist(), a[2:].tolist()]
    got = dist_pool.run(_stop_gradient_under_func_grad, timeout=60)
    assert got[0] == local[:1]  # each holder's block
    assert got[1] == local[1:]
    assert got[2] == got[3] == [[]]  # the link of a rank that holds none: an empty gradient


def _new_leaf_of_rows_two_ranks_hold() -> list:
    """A fresh leaf made by ``map_local`` of rows that ranks 2 and 3 hold none of, differentiated on every rank."""
    a = fshard.map_local(lambda t: t.detach().requires_grad_(), fshard.shard(torch.arange(8.0).reshape(4, 2), _ROWS01))
    fshard.global_norm({"a": a}).backward()  # its backward sums over every rank: each must run it
    return [a.requires_grad, [t.grad.tolist() for t in optree.tree_leaves(a)]]


def test_a_new_leaf_made_by_fn_is_a_new_leaf_on_ranks_without_blocks(dist_pool):
    x = torch.arange(8.0).reshape(4, 2)
    local = _new_leaf_of_rows_two_ranks_hold()
    assert local == [True, [(x[:2] / x.norm()).tolist(), (x[2:] / x.norm()).tolist()]]
    got = dist_pool.run(_new_leaf_of_rows_two_ranks_hold, timeout=60)
    assert got[:2] == [[True, local[1][:1]], [True, local[1][1:]]]
    assert got[2] == got[3] == [True, [[]]]  # the link: a leaf that requires grad, with an empty gradient


def _vmap_of_a_tree_some_ranks_hold_part_of() -> float:
    """``vmap`` of a loss that moves, as one tree, rows ranks 2 and 3 hold none of and rows every rank holds."""
    p = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).requires_grad_()
    xs = torch.arange(24.0, dtype=torch.float64).reshape(3, 4, 2) / 10
    every = fshard.Replicated([0, 1, 2, 3])

    def f(x: torch.Tensor) -> torch.Tensor:
        a = fshard.shard(p * x, _ROWS01)
        b = fshard.shard(x + 1, fshard.Chunk(0, [0, 1, 2, 3]))
        a2, b2 = fshard.reshard([a, b], [every, every])
        return (fshard.gather(a2) * fshard.gather(b2)).sum()

    return torch.func.vmap(f)(xs).sum().item()


def test_vmap_of_a_tree_some_ranks_hold_part_of_gives_the_local_value(dist_pool):
    """Under vmap a movement's header says nothing of gradients: a batched ``p * x`` reads requires_grad False."""
    local = _vmap_of_a_tree_some_ranks_hold_part_of()
    assert dist_pool.run(_vmap_of_a_tree_some_ranks_hold_part_of, timeout=60) == [local] * 4


def _map_local_closure(case: str) -> list:
    """``map_local`` of rows every rank holds (that need no gradient), closing over ``c`` in the second of three calls.

    ``some``: the bodies of ranks 2 and 3 alone use ``c`` (a branch on the data); ``every``: every body uses it.
    Returns ``[the error's type and start, or None; c.grad]``.
    """
    c = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    rows = fshard.Chunk(0, [0, 1, 2, 3])
    x = fshard.shard(torch.arange(4.0, dtype=torch.float64), rows)

    def body(k: int):
        def f(t: torch.Tensor) -> torch.Tensor:
            if case == "some" and k == 1:
                return t * c if t[0] >= 2 else t * 1.0
            return t * c

        return f

    error = None
    try:
        outs = [fshard.map_local(body(k), x) for k in range(3)]
        sum(fshard.gather(y).sum() for y in outs).backward()
    except fshard.CollectiveMismatchError as e:
        error = f"{type(e).__name__}: {str(e).split(':')[0]}"
    fshard.gather(fshard.shard(torch.ones(4), rows))  # the group is usable after
    return [error, None if c.grad is None else c.grad.tolist()]


@pytest.mark.parametrize("case", ["some", "every"])
def test_a_map_local_closure_that_some_ranks_use_is_refused_at_the_next_movement(dist_pool, case):
    """Where ``c`` is a result's only source of gradient, ranks whose fn did not use it record none through the
    result's gather: its header says so, and every rank raises there instead of waiting in the backward's sum."""
    got = dist_pool.run(_map_local_closure, case, timeout=60)
    if case == "every":
        assert got == [[None, [3 * 6.0]]] * 4  # the sum over the 4 ranks' rows, in each of 3 calls
        assert _map_local_closure(case) == [None, [3 * 6.0]]
    else:
        assert got == [["CollectiveMismatchError: gather(dst=None)", None]] * 4
        # One process runs every rank's body, and refuses the same movement: ranks [2, 3] record a gradient there.
        assert _map_local_closure(case) == ["CollectiveMismatchError: gather(dst=None) of shape (4,)", None]


def test_the_local_backend_refuses_a_map_local_closure_some_ranks_use_while_the_arguments_record():
    """Across processes nothing tells the ranks apart before the backward, where the ranks that used ``c`` wait in its
    sum for the others, which raise at a later movement. One process counts each rank's uses and refuses at the call.
    """
    c = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    x = fshard.shard(torch.arange(4.0, dtype=torch.float64), fshard.Chunk(0, [0, 1, 2, 3]))
    x = fshard.map_local(lambda t: t.detach().requires_grad_(), x)
    with pytest.raises(fshard.SpecError, match=re.escape("different ranks (0 on ranks [0, 1]; 1 on ranks [2, 3])")):
        fshard.map_local(lambda t: t * c if t[0] >= 2 else t * 1.0, x)
    with torch.no_grad():  # no gradient, no sum
        fshard.map_local(lambda t: t * c if t[0] >= 2 else t * 1.0, x)
    fshard.gather(fshard.map_local(lambda t: t * c, x)).sum().backward()  # every rank's use: summed
    assert c.grad.tolist() == [6.0]
    assert fshard.gather(fshard.map_local(torch.mul, x, x)).tolist() == [0.0, 1.0, 4.0, 9.0]  # closes over nothing


def test_a_cache_that_one_ranks_call_fills_from_a_closed_over_tensor_is_refused_in_one_process_naming_the_fix():
    """One process runs every rank's call: the rank that fills the cache uses ``c``, the others only the number kept.
    Across processes each process fills its own cache, and every rank uses ``c``; here the message says how to
    write it."""
    c = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    x = fshard.shard(torch.arange(4.0, dtype=torch.float64), fshard.Chunk(0, [0, 1, 2, 3]))
    x = fshard.map_local(lambda t: t.detach().requires_grad_(), x)
    cache: dict[str, float] = {}

    def scaled(t: torch.Tensor) -> torch.Tensor:
        if "scale" not in cache:
            cache["scale"] = int(torch.count_nonzero(c)) + 2  # computed from c, kept as a number
        return t * cache["scale"]

    with pytest.raises(fshard.SpecError, match=re.escape("(0 on ranks [1, 2, 3]; 1 on ranks [0])")) as info:
        fshard.map_local(scaled, x)
    assert "a cache" in str(info.value)
    assert "make it before the call and close over it" in str(info.value)
    scale = int(torch.count_nonzero(c)) + 2  # as the message says
    fshard.gather(fshard.map_local(lambda t: t * scale, x)).sum().backward()
    assert [t.grad.tolist() for t in x.addressable_data] == [[3.0]] * 4


def _compiled_body(fullgraph: bool, grad: bool) -> tuple[str, float]:
    """A per-shard function compiled by TorchDynamo, on arrays that need a gradient (``grad``) or not.

    Returns the error, and the sum of the array's gradient (or of the result, without one).
    """
    torch._dynamo.reset()
    body = torch.compile(lambda t: torch.tanh(t) * 2, fullgraph=fullgraph, backend="eager")
    a = fshard.shard(torch.arange(24.0, dtype=torch.float64).reshape(8, 3) / 10, fshard.Chunk(0, [0, 1, 2, 3]))
    if grad:
        a = fshard.map_local(lambda t: t.detach().requires_grad_(), a)
    try:
        out = fshard.gather(fshard.map_local(body, a)).sum()
        if not grad:
            return "no error", float(out)
        out.backward()
    except fshard.SpecError as exc:
        return str(exc), 0.0
    blocks = a.addressable_data
    return "no error", float(sum(t.grad.sum() for t in blocks))


def test_a_fullgraph_body_that_records_a_gradient_is_refused_across_processes_with_the_fix(dist_pool):
    """TorchDynamo cannot trace the per-shard mode into one graph: a SpecError naming the fix, not its own error.

    Without fullgraph (the fix) the gradient is the local backend's, and a fullgraph body with no gradient runs.
    """
    x = torch.arange(24.0, dtype=torch.float64).reshape(8, 3) / 10
    want = float((2 * (1 - torch.tanh(x) ** 2)).sum())
    for message, _ in dist_pool.run(_compiled_body, True, True, timeout=180):
        assert message.startswith("torch.compile(fn, fullgraph=True) of a per-shard function"), message
        assert "without fullgraph=True" in message, message
    eager = dist_pool.run(_compiled_body, False, True, timeout=180)
    assert [message for message, _ in eager] == ["no error"] * 4
    assert sum(total for _, total in eager) == pytest.approx(want, rel=1e-12)  # each rank's rows, summed
    for message, total in dist_pool.run(_compiled_body, True, False, timeout=180):
        assert message == "no error"
        assert total == pytest.approx(float((torch.tanh(x) * 2).sum()), rel=1e-12)


def _random_draws_in_bodies() -> tuple[list[list[float]], ...]:
    """Dropout in a shard_map body, in map_local's (two blocks on rank 0), in apply_module, in a body that
    draws on both sides of a psum and in apply_module under tensor parallelism; then a draw after.

    Across processes each rank draws from its own generator, where the call found it; in one
    process each rank's bodies do too (in turn, or in threads that take turns where they reduce),
    so the masks are alike on both backends.
    """
    ranks = [0, 1, 2, 3]
    x = torch.arange(1.0, 41.0).reshape(8, 5)
    torch.manual_seed(5)
    rows = fshard.Chunk(0, ranks)
    dropped = fshard.shard_map(lambda b: torch.nn.functional.dropout(b, 0.5), in_specs=rows, out_specs=rows)(x)
    blocks = fshard.shard(x, fshard.Chunk(0, [0, 0, 1, 2]))  # rank 0 holds two blocks: drawn one after the other
    mapped = fshard.map_local(lambda b: torch.nn.functional.dropout(b, 0.5), blocks)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Dropout(0.5))
    params, buffers = fshard.shard_module(model, fshard.replicated(ranks))
    torch.manual_seed(7)
    out, _ = fshard.apply_module(model, params, buffers, fshard.shard(x, rows))

    def reducing(b: torch.Tensor) -> torch.Tensor:
        total = fshard.psum(torch.nn.functional.dropout(b, 0.5).sum(0), "x")
        return torch.nn.functional.dropout(b, 0.5) * total

    named = fshard.Named(fshard.Mesh((4,), axis_names=("x",)), ("x", None))
    torch.manual_seed(9)
    summed = fshard.shard_map(reducing, in_specs=named, out_specs=named)(x)
    torch.manual_seed(1)
    wide = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 5))
    rules = fshard.tensor_parallel(fshard.Mesh((2, 2), axis_names=("dp", "tp")), {"0": "colwise", "2": "rowwise"})
    tp_params, tp_buffers = fshard.shard_module(wide, rules)
    torch.manual_seed(3)
    tp_out, _ = fshard.apply_module(wide, tp_params, tp_buffers, fshard.shard(x, rules.rows), rules=rules)
    return (
        fshard.gather(dropped).tolist(),
        fshard.gather(mapped).tolist(),
        fshard.gather(out).detach().tolist(),
        fshard.gather(summed).tolist(),
        fshard.gather(tp_out).detach().tolist(),
        torch.rand(3).tolist(),
    )


def test_random_draws_in_bodies_are_alike_in_one_process_and_across_processes(dist_pool):
    local = _random_draws_in_bodies()
    assert dist_pool.run(_random_draws_in_bodies, timeout=60) == [local] * 4
    dropped = torch.tensor(local[0])
    kept = dropped != 0
    assert torch.equal(kept[0:2], kept[2:4])  # every rank's mask the same: drawn from where the call found it
    assert 0 < int(kept.sum()) < kept.numel()
    summed = torch.tensor(local[3])
    assert torch.equal(summed[0:2] != 0, summed[2:4] != 0)  # after the psum too, from where each rank left off
    assert 0 < int((summed != 0).sum()) < summed.numel()


def test_random_draws_in_reducing_bodies_do_not_depend_on_what_ran_before_in_the_process():
    """A body that reduces runs in threads in one process; its draws are each rank's own, whatever ran before."""
    first = _random_draws_in_bodies()
    again = _random_draws_in_bodies()  # now every function above is known to reduce or not: threads from the start
    assert again == first


def _recording_on_some_ranks(case: str) -> tuple[str, str]:
    """A body that keeps its block's history on rank 0's rows only (a branch on the data), on either backend.

    ``grad``: under ``torch.func.grad``, then gathered; ``backward``: a pending sum's ``fshard.backward``.
    Returns the error's type and its first words.
    """
    rows = fshard.Chunk(0, [0, 1, 2, 3])
    x = torch.arange(24.0, dtype=torch.float64).reshape(4, 6) / 10

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if t.sum() > 3 else t * 1  # rank 0's block sums to 1.5

    try:
        if case == "grad":
            torch.func.grad(lambda v: fshard.gather(fshard.shard_map(keep, rows, rows)(v)).pow(2).sum())(x)
        else:
            total = fshard.shard_map(
                lambda t: keep(t).sum()[None], rows, fshard.Partial(fshard.Replicated([0, 1, 2, 3]))
            )
            fshard.backward(total(x.requires_grad_()))
    except fshard.CollectiveMismatchError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("case", ["grad", "backward"])
def test_results_that_record_a_gradient_on_some_ranks_only_raise_on_every_rank(dist_pool, case):
    """Before, under torch.func.grad the other ranks returned a zero gradient while rank 0 waited in its
    backward; and ranks whose pending loss recorded no gradient raised at backward() alone while rank 0 waited."""
    local = _recording_on_some_ranks(case)
    assert local[1].startswith(
        "shard_map(): ranks [0] return result 0 recording a gradient and ranks [1, 2, 3] return it without one"
    ), local
    assert dist_pool.run(_recording_on_some_ranks, case, timeout=60) == [local] * 4


def _a_view_on_one_rank_under_no_grad() -> list[bool]:
    """Under no_grad, rank 3's empty block's contiguous() is the block itself (it requires grad), the others' copies."""
    x = fshard.shard(torch.arange(24.0).reshape(4, 6).requires_grad_(), fshard.Chunk(1, [0, 1, 2, 3]))
    with torch.no_grad():
        y = fshard.shard_map(
            lambda b: b.T.contiguous().T, fshard.Chunk(1, [0, 1, 2, 3]), fshard.Chunk(1, [0, 1, 2, 3])
        )(x)
        assert torch.equal(fshard.gather(y), torch.arange(24.0).reshape(4, 6))
    return [b.requires_grad for b in y.addressable_data]


def test_results_are_not_compared_for_gradients_under_no_grad(dist_pool):
    """As the movements' headers: under no_grad no rank records a gradient through the call, whatever its blocks say."""
    assert _a_view_on_one_rank_under_no_grad() == [False, False, False, True]
    assert dist_pool.run(_a_view_on_one_rank_under_no_grad, timeout=60) == [[False], [False], [False], [True]]


def _tensor_of_another_shape_on_rank_zero(kind: str) -> tuple[str, str]:
    """Rank 0 passes a (4, 8) tensor, the others (4, 6): each shards its own."""
    ranks = [0, 1, 2, 3]
    t = torch.ones(4, 8) if dist.get_rank() == 0 else torch.ones(4, 6)
    try:
        if kind == "inferred":  # the results' shapes exchanged: the call blamed its result, and a global shape (4, 8)
            y = fshard.shard_map(lambda b: b * 2, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))(t)
        else:  # the outcome posted: the sum 26 of 8 + 6 * 3 ones came back with no error
            y = fshard.shard_map(
                lambda b: b.sum()[None],
                in_specs=fshard.Chunk(0, ranks),
                out_specs=fshard.Partial(fshard.Replicated(ranks)),
            )(t)
        return "ok", str(fshard.gather(y).tolist())
    except fshard.CollectiveMismatchError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("kind", ["inferred", "posted"])
def test_a_tensor_argument_of_another_shape_on_one_rank_raises_on_every_rank(dist_pool, kind):
    for rank, (error, msg) in enumerate(dist_pool.run(_tensor_of_another_shape_on_rank_zero, kind, timeout=60)):
        assert error == "CollectiveMismatchError", (rank, msg)
        assert "differ in the shapes and dtypes of its tensor arguments (pass the same tensor on every rank)" in msg
        assert f"(this rank's: argument 0 (4, {8 if rank == 0 else 6}) torch.float32)" in msg


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask


def _apply_module_with_a_mask_of_another_shape_on_rank_zero() -> str:
    ranks = [0, 1, 2, 3]
    torch.manual_seed(0)
    model = _Masked()
    params, buffers = fshard.shard_module(model, fshard.fully_sharded(ranks))
    mask = torch.ones(1) if dist.get_rank() == 0 else torch.ones(3)
    try:
        x = fshard.shard(torch.randn(8, 6), fshard.Chunk(0, ranks))
        out, _ = fshard.apply_module(model, params, buffers, x, mask)
        return str(tuple(fshard.gather(out).shape))
    except fshard.CollectiveMismatchError as e:
        return str(e)


def test_apply_module_names_both_things_its_ranks_must_agree_on_and_each_ranks_values(dist_pool):
    """apply_module's own form (the buffers its forward updates) and the tensor arguments go in one digest."""
    for rank, msg in enumerate(dist_pool.run(_apply_module_with_a_mask_of_another_shape_on_rank_zero, timeout=60)):
        assert "differ in either the buffers the module's forward updates" in msg, (rank, msg)
        assert "or the shapes and dtypes of its tensor arguments (pass the same tensor on every rank)" in msg
        side = 1 if rank == 0 else 3
        assert f"(this rank's: []; tensor arguments: forward argument 1 ({side},) torch.float32)" in msg
