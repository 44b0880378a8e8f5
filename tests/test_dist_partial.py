"""Pending reductions (``Partial``) under torch_dist on 4 Gloo processes.

Each rank holds its own summands; every test checks the reduced values against the
plain sum (max, min) and the elements this rank sent against the plan's accounting,
whose total meets the lower bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._base.alloc import use_count
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
SHAPE = (8, 6)


def _summand(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64)


def _reduced(op: str) -> torch.Tensor:
    stack = torch.stack([_summand(r) for r in R])
    return {"sum": stack.sum(0), "max": stack.amax(0), "min": stack.amin(0)}[op]


def _partial(op: str, inner=None) -> fshard.ShardedArray:
    """Every rank's summand of the whole array (or of its boxes under ``inner``)."""
    layout = fshard.Partial(inner or fshard.Replicated(R), op).layout(SHAPE)
    mine = _summand(dist.get_rank())
    shards = [
        fshard.Shard(m, mine[tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))])
        for m in layout.shards_on(dist.get_rank())
    ]
    return fshard.from_local_shards_and_layout(shards, layout)


def _sent(fn, *args):
    c = TorchDistBackend().counters
    before = c.elements_sent
    out = fn(*args)
    return out, c.elements_sent - before


TARGETS = {
    "chunk-rows": fshard.Chunk(0, R),
    "chunk-cols": fshard.Chunk(1, R),
    "replicated": fshard.Replicated(R),
    "single": fshard.Single(2),
    "grid": fshard.Named(fshard.Mesh((2, 2)), ("x", "y")),
    "rows+replicas": fshard.Named(fshard.Mesh((2, 2)), ("x", None)),
    "partial-rows": fshard.Partial(fshard.Chunk(0, R)),
    "partial-pairs": fshard.Partial(fshard.Named(fshard.Mesh((2, 2)), ("x", None))),
}


def _reshard_from_partial(op: str, name: str, inner_name: str | None):
    inner = None if inner_name is None else TARGETS[inner_name]
    p = _partial(op, inner)
    spec = TARGETS[name]
    if isinstance(spec, fshard.Partial):
        spec = fshard.Partial(spec.spec, op)
    y, sent = _sent(fshard.reshard, p, spec)
    full = fshard.gather(y)
    reference = _partial_reference(op, inner)
    plan = fshard.plan(p.layout, y.layout)
    return torch.allclose(full, reference, rtol=1e-12, atol=1e-12), sent, plan.elements_sent, plan.min_elements_sent


def _partial_reference(op: str, inner) -> torch.Tensor:
    """The value of ``_partial(op, inner)``, reduced in plain torch."""
    layout = fshard.Partial(inner or fshard.Replicated(R), op).layout(SHAPE)
    ident = {"sum": 0.0, "max": -torch.inf, "min": torch.inf}[op]
    parts = []
    for r in R:
        t = torch.full(SHAPE, ident, dtype=torch.float64)
        for m in layout.shards_on(r):
            box = tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))
            t[box] = _summand(r)[box]
        parts.append(t)
    stack = torch.stack(parts)
    return {"sum": stack.sum(0), "max": stack.amax(0), "min": stack.amin(0)}[op]


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_reshard_from_replicated_summands(dist_pool, op, name):
    results = dist_pool.run(_reshard_from_partial, op, name, None)
    assert all(ok for ok, *_ in results), results
    sent, planned, minimum = sum(r[1] for r in results), results[0][2], results[0][3]
    assert sent == planned == minimum


@pytest.mark.parametrize("inner", ["rows+replicas", "chunk-rows"])
@pytest.mark.parametrize("name", ["chunk-cols", "replicated", "partial-rows"])
def test_reshard_from_other_partial_layouts(dist_pool, inner, name):
    results = dist_pool.run(_reshard_from_partial, "sum", name, inner)
    assert all(ok for ok, *_ in results), results
    assert sum(r[1] for r in results) == results[0][2] == results[0][3]


def test_all_reduce_bound_is_exact(dist_pool):
    """Partial(Replicated) of N elements on n ranks: (n-1)N to Chunk, 2(n-1)N to Replicated."""
    results = dist_pool.run(_reshard_from_partial, "sum", "replicated", None)
    n, numel = len(R), SHAPE[0] * SHAPE[1]
    assert sum(r[1] for r in results) == 2 * (n - 1) * numel
    results = dist_pool.run(_reshard_from_partial, "sum", "chunk-rows", None)
    assert sum(r[1] for r in results) == (n - 1) * numel


def _gather_partial(dst):
    p = _partial("sum")
    out = fshard.gather(p, dst=dst)
    if out is None:
        return None
    return torch.allclose(out, _reduced("sum"), rtol=1e-12, atol=1e-12)


def test_gather_reduces(dist_pool):
    assert dist_pool.run(_gather_partial, None) == [True] * 4
    assert dist_pool.run(_gather_partial, 1) == [None, True, None, None]


def _shard_into_partial(src):
    x = torch.arange(48.0).reshape(SHAPE)
    a = fshard.shard(x if src in (None, dist.get_rank()) else None, fshard.Partial(fshard.Replicated(R)), src=src)
    held = [s.data for s in a.addressable_shards]
    return torch.equal(fshard.gather(a), x), float(held[0].abs().sum()) if held else None


def test_shard_into_partial_keeps_one_summand(dist_pool):
    for src in (None, 2):
        results = dist_pool.run(_shard_into_partial, src)
        assert all(ok for ok, _ in results)
        # One rank holds the value, the others zeros.
        assert sorted(total > 0 for _, total in results) == [False, False, False, True]


def _negative_zeros_through_pending_sums() -> list[bool]:
    """-0.0 elements moved into pending sums (and made by ``full``) and back: their sign bits survive.

    The summands that do not hold an element hold -0.0, which adds nothing to every value,
    where 0.0 would turn a -0.0 into 0.0.
    """
    x = torch.tensor([-0.0, 1.0, -0.0, -0.0, 2.0, -0.0, 0.0, -0.0])
    a = fshard.shard(x, fshard.Chunk(0, R))
    same = []
    for target in (fshard.Partial(fshard.Replicated(R)), fshard.Partial(fshard.Chunk(0, R + R))):
        p = fshard.reshard(a, target)
        for back in (fshard.Chunk(0, R), fshard.Replicated(R), fshard.Chunk(0, [3, 2, 1, 0])):
            same.append(torch.equal(torch.signbit(fshard.gather(fshard.reshard(p, back))), torch.signbit(x)))
    made = fshard.full(fshard.Partial(fshard.Replicated(R)), (3,), fill_value=-0.0)
    same.append(bool(torch.signbit(fshard.gather(made)).all()))
    return same


def test_negative_zeros_keep_their_sign_through_pending_sums(dist_pool):
    assert _negative_zeros_through_pending_sums() == [True] * 7  # the local backend
    assert dist_pool.run(_negative_zeros_through_pending_sums, timeout=60) == [[True] * 7] * 4


def _backward_of_reduction():
    mine = _summand(dist.get_rank()).requires_grad_(True)
    layout = fshard.Partial(fshard.Replicated(R)).layout(SHAPE)
    p = fshard.from_local_shards_and_layout([fshard.Shard(layout.shards_on(dist.get_rank())[0], mine)], layout)
    y = fshard.reshard(p, fshard.Chunk(0, R))
    w = torch.arange(48.0, dtype=torch.float64).reshape(SHAPE)
    (fshard.gather(y) * w).sum().backward()
    return torch.equal(mine.grad, w)


def test_gradient_of_a_reduction_reaches_every_summand(dist_pool):
    assert dist_pool.run(_backward_of_reduction) == [True] * 4


# -- one semantics: the gradient of a replicated value is the sum of its uses ---------------


def _replicated_bias_grad(outside: float, world: int | None = None):
    """``bf = gather(b)`` used inside map_local over row chunks (and ``outside`` times outside it)."""
    ranks = R if world is None else list(range(world))
    backend = fshard.backends.local.LOCAL if world is not None else None
    x = torch.arange(24.0, dtype=torch.float64).reshape(8, 3)

    def loss(params):
        bf = fshard.gather(params["b"])
        rows = fshard.shard(x, fshard.Chunk(0, ranks), backend=params["b"].backend)
        y = fshard.map_local(lambda t: t + bf, rows)
        return fshard.gather(y).sum() + outside * bf.sum()

    b = fshard.shard(torch.zeros(3, dtype=torch.float64), fshard.Replicated(ranks), backend=backend)
    grads = torch.func.grad(loss)({"b": b})
    return [s.data.tolist() for s in grads["b"].addressable_shards]


@pytest.mark.parametrize("outside", [0.0, 3.0])
def test_gradient_of_a_gathered_replica_sums_its_uses_over_ranks(dist_pool, outside):
    want = [8.0 + outside] * 3  # 8 rows use each element once; the outside use counts once
    results = dist_pool.run(_replicated_bias_grad, outside)
    assert results == [[want]] * 4
    assert _replicated_bias_grad(outside, world=4) == [want] * 4  # the local backend agrees


def _replicated_bias_backward():
    """The same with ``.backward()`` on a leaf tensor each rank holds."""
    x = torch.arange(24.0, dtype=torch.float64).reshape(8, 3)
    leaf = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    b = fshard.shard(leaf, fshard.Replicated(R))
    bf = fshard.gather(b)
    y = fshard.map_local(lambda t: t + bf, fshard.shard(x, fshard.Chunk(0, R)))
    fshard.gather(y).sum().backward()
    return leaf.grad.tolist()


def test_backward_of_a_gathered_replica_sums_its_uses_over_ranks(dist_pool):
    assert dist_pool.run(_replicated_bias_backward) == [[8.0] * 3] * 4


def _operator_on_a_gathered_block(through_map_local: bool):
    """``a * 2`` where ``a``'s block is a gathered tensor: its use per shard is a part of the gather's gradient."""
    leaf = torch.arange(3.0, dtype=torch.float64).requires_grad_()
    bf = fshard.gather(fshard.shard(leaf, fshard.Replicated(R)))
    layout = fshard.Replicated(R).layout((3,))
    a = fshard.from_local_shards_and_layout([fshard.Shard(layout.shards_on(dist.get_rank())[0], bf)], layout)
    y = fshard.map_local(lambda t: t * 2, a) if through_map_local else a * 2
    (fshard.gather(y) * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)).sum().backward()
    return leaf.grad.tolist()


def test_an_operator_on_a_gathered_block_sums_its_uses_as_map_local_does(dist_pool):
    """The operators run on plain blocks directly; a gathered block goes through map_local's per-shard context."""
    want = dist_pool.run(_operator_on_a_gathered_block, True)
    assert want == [[8.0, 80.0, 800.0]] * 4  # every rank's use of the copy, summed
    assert dist_pool.run(_operator_on_a_gathered_block, False) == want


def _operator_where_some_rank_holds_nothing():
    """``a / 2`` of rows held by ranks 0 and 1 only: every rank learns the result's dtype (map_local's exchange)."""
    a = fshard.shard(torch.arange(12.0).reshape(4, 3), fshard.Chunk(0, [0, 1]))
    half = a / 2
    return half.dtype, fshard.gather(half).tolist()


def test_an_operator_where_some_rank_holds_nothing_runs_on_every_rank(dist_pool):
    want = (torch.float32, (torch.arange(12.0).reshape(4, 3) / 2).tolist())
    assert dist_pool.run(_operator_where_some_rank_holds_nothing, timeout=60) == [want] * 4


# -- summands with replicas: [Replicate(), Partial()] on a (dp, tp) mesh ---------------------

DPTP = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
OVER_TP = fshard.Partial(fshard.Named(DPTP, (None,)), over="tp")  # summands along tp, replicas along dp
OVER_TP_TARGETS = {
    "chunk-rows": fshard.Chunk(0, R),
    "replicated": fshard.Replicated(R),  # one full summand per rank: all_reduce over all 4 would add each twice
    "single": fshard.Single(2),
    "rows-over-tp": fshard.Named(DPTP, ("tp",)),
    "every-copy-a-summand": fshard.Partial(fshard.Named(DPTP, (None,))),
}


def _over_tp(leaf: bool = False) -> tuple[fshard.ShardedArray, torch.Tensor]:
    """Rank (dp, tp) holds a replica of summand ``tp``."""
    rank = dist.get_rank()
    mine = _summand(rank % 2).requires_grad_(leaf)
    layout = OVER_TP.layout(SHAPE)
    return fshard.from_local_shards_and_layout([fshard.Shard(layout.shards_on(rank)[0], mine)], layout), mine


def _reshard_over_tp(name: str):
    p, _ = _over_tp()
    y, sent = _sent(fshard.reshard, p, OVER_TP_TARGETS[name])
    plan = fshard.plan(p.layout, y.layout)
    return torch.equal(fshard.gather(y), _summand(0) + _summand(1)), sent, plan.elements_sent, plan.min_elements_sent


@pytest.mark.parametrize("name", list(OVER_TP_TARGETS))
def test_a_sum_over_tp_replicated_over_dp_reduces_over_tp_only(dist_pool, name):
    results = dist_pool.run(_reshard_over_tp, name)
    assert all(ok for ok, *_ in results), results
    assert sum(r[1] for r in results) == results[0][2] == results[0][3]


def test_a_sum_over_tp_sends_the_lower_bound(dist_pool):
    numel = SHAPE[0] * SHAPE[1]
    results = dist_pool.run(_reshard_over_tp, "chunk-rows")
    assert sum(r[1] for r in results) == numel  # each element: the other summand, from the owner's dp row
    results = dist_pool.run(_reshard_over_tp, "replicated")
    assert sum(r[1] for r in results) == 4 * numel  # 2 summands + 4 receivers - 1 - 1


def _backward_over_tp() -> bool:
    p, mine = _over_tp(leaf=True)
    y = fshard.reshard(p, fshard.Chunk(0, R))
    w = torch.arange(48.0, dtype=torch.float64).reshape(SHAPE)
    (fshard.gather(y) * w).sum().backward()
    return torch.equal(mine.grad, w)


def test_the_gradient_of_a_sum_over_tp_reaches_every_copy(dist_pool):
    assert dist_pool.run(_backward_over_tp) == [True] * 4


def _dense_gradient_through_over_tp(target: str) -> bool:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9), dtype=torch.float64, requires_grad=True)
    w = torch.randint(-5, 6, SHAPE, generator=torch.Generator().manual_seed(10)).double()
    p = fshard.reshard(fshard.shard(x, fshard.Chunk(0, R)), OVER_TP)
    (fshard.gather(fshard.reshard(p, OVER_TP_TARGETS[target])) ** 2 * w).sum().backward()
    return torch.allclose(x.grad, 2 * x.detach() * w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", ["chunk-rows", "replicated"])
def test_a_value_through_a_sum_over_tp_has_the_dense_gradient(dist_pool, target):
    assert dist_pool.run(_dense_gradient_through_over_tp, target) == [True] * 4


def _row_parallel_linear() -> tuple[bool, list[int]]:
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    in_specs = (fshard.Named(DPTP, (None, "tp")), fshard.Named(DPTP, ("tp", None)))
    y = fshard.shard_map(lambda xb, wb: xb @ wb, in_specs=in_specs, out_specs=OVER_TP)(x, w)
    full = fshard.gather(fshard.reshard(y, fshard.Replicated(R)))
    return torch.allclose(full, x @ w, rtol=1e-12, atol=1e-12), y.layout.terms.tolist()


def test_a_row_parallel_linear_output_replicated_over_dp_reduces_to_the_dense_result(dist_pool):
    assert dist_pool.run(_row_parallel_linear) == [(True, [0, 1, 0, 1])] * 4


# -- large summands: messages sent from the summands, received one peer at a time -------------

BIG = (1024, 512)  # a dim-0 chunk's piece for one peer is 256 x 512 float32: 512 KiB, sent alone


def _big_summand(rank: int) -> torch.Tensor:
    return torch.randn(BIG, generator=torch.Generator().manual_seed(200 + rank))


def _big_partial(backend=None) -> fshard.ShardedArray:
    layout = fshard.Partial(fshard.Replicated(R)).layout(BIG)
    ranks = R if backend is not None else [dist.get_rank()]
    shards = [fshard.Shard(m, _big_summand(m.placement.rank)) for r in ranks for m in layout.shards_on(r)]
    return fshard.from_local_shards_and_layout(shards, layout, backend=backend)


def _reduce_big(name: str) -> tuple[bool, list[list[int]]]:
    """The reduced array (bit-identical to the local backend's?) and the buffers alive at each one made."""
    from fshard.backends import torch_dist

    made: list[tuple[torch.UntypedStorage, int]] = []
    alive: list[list[int]] = []
    empty = torch_dist.empty

    def recorded(shape, dtype, device):
        t = empty(shape, dtype, device)
        made.append((t.untyped_storage(), t.numel()))
        alive.append([n for s, n in made if use_count(s._cdata) > 1])
        return t

    p = _big_partial()
    torch_dist.empty = recorded
    try:
        y = fshard.reshard(p, TARGETS[name])
    finally:
        torch_dist.empty = empty
    y = fshard.gather(y)
    want = fshard.gather(fshard.reshard(_big_partial(LocalBackend(world_size=len(R))), TARGETS[name]))
    return torch.equal(y, want), alive


def test_a_large_reduce_sends_from_the_summands_and_receives_one_peer_at_a_time(dist_pool):
    # Each peer's 512 KiB goes straight from the summand (no send buffer); each rank receives its
    # peers' pieces one peer at a time, in rank order, into one buffer at a time.
    piece = BIG[0] // len(R) * BIG[1]
    for equal, alive in dist_pool.run(_reduce_big, "chunk-rows", timeout=120):
        assert equal
        assert alive == [[piece]] * (len(R) - 1)


@pytest.mark.parametrize("name", ["chunk-cols", "grid", "rows+replicas"])
def test_large_reduces_are_bit_identical_to_the_local_backend(dist_pool, name):
    # Column pieces are not contiguous in the summand: each is staged in a buffer of its own.
    assert all(equal for equal, _ in dist_pool.run(_reduce_big, name, timeout=120))


def _pending_sum_of(dtype_name: str, n: int) -> list[int]:
    """Rank r's summand holds r + 1 everywhere; the gathered sum (of n elements) as a list."""
    dtype = getattr(torch, dtype_name)
    layout = fshard.Partial(fshard.Replicated([0, 1, 2, 3])).layout((n,))
    rank = dist.get_rank()
    parts = [
        fshard.Shard(m, torch.full(m.sizes, rank + 1, dtype=dtype)) for m in layout.shards if m.placement.rank == rank
    ]
    return fshard.gather(fshard.from_local_shards_and_layout(parts, layout)).to(torch.int64).tolist()


@pytest.mark.parametrize("n", [0, 3, 100_000])
def test_pending_sums_of_a_dtype_that_gloo_does_not_reduce(dist_pool, n):
    """int16: Gloo's all_reduce refuses it, so the sum goes by messages, combined by torch here."""
    assert dist_pool.run(_pending_sum_of, "int16", n, timeout=60) == [[10] * n] * 4


def _complex_max(backend) -> str:
    """A pending max of complex values, built and then reduced: the error each rank raises."""
    layout = fshard.Partial(fshard.Replicated([0, 1, 2, 3]), "max").layout((2,))
    index = range(4) if backend is not None else [dist.get_rank()]
    parts = [fshard.Shard(layout.shards[i], torch.full((2,), 1 + 1j, dtype=torch.complex64)) for i in index]
    x = fshard.from_local_shards_and_layout(parts, layout, backend=backend)
    try:
        fshard.gather(x, dst=0)
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


def test_a_pending_max_of_complex_values_is_refused_on_every_rank(dist_pool):
    want = (
        "A pending max of torch.complex64 values cannot be reduced: complex numbers have no order. Reduce their "
        "absolute values or real parts instead (fshard.map_local(torch.abs, x) before the Partial), or use a "
        "pending sum."
    )
    assert _complex_max(LocalBackend()) == want
    assert dist_pool.run(_complex_max, None, timeout=60) == [want] * 4


def _complex_max_made(backend, how: str) -> str:
    """A pending max of complex values made by a movement, shard or creation: refused where it is made."""
    kw = {"backend": backend} if backend is not None else {}
    to = fshard.Partial(fshard.Replicated([0, 1]), "max")
    z = torch.tensor([1 + 2j, 3 - 4j])
    makers = {
        "reshard": lambda: fshard.reshard(fshard.shard(z, fshard.Single(0), **kw), to),
        "shard": lambda: fshard.shard(z, to, **kw),
        "zeros": lambda: fshard.zeros(to, 2, dtype=torch.complex64, **kw),
        "zeros_like": lambda: fshard.zeros_like(fshard.zeros(to, 2, **kw), dtype=torch.complex64),
    }
    try:
        makers[how]()
    except fshard.SpecError as exc:
        return str(exc).split(":")[0]
    return "no error"


@pytest.mark.parametrize("how", ["reshard", "shard", "zeros", "zeros_like"])
def test_a_pending_max_of_complex_values_is_refused_where_it_is_made_on_every_rank(dist_pool, how):
    want = "A pending max of torch.complex64 values cannot be reduced"
    assert _complex_max_made(LocalBackend(world_size=4), how) == want
    assert dist_pool.run(_complex_max_made, None, how, timeout=60) == [want] * 4
