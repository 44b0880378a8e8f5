"""Gradients of replicated arguments summed in buckets while the backward runs (4 Gloo processes).

A data-parallel step: every parameter ``Replicated`` on the 4 ranks, each rank on its own
rows, the loss a ``Partial`` sum. Each rank's gradient must be the sum of every rank's
uses, as on the local backend (float64, to 1e-12), however the gradients reach the
arguments: through the function's own uses (the buckets leave during the backward);
through an activation checkpoint's recomputation; through a custom autograd function,
whose inputs no torch-function mode sees (they arrive after their buckets left: every rank
sums them once more); as gradients of gradients; or from ranks that use different parameters (with a
closed-over tensor, or weights of two dtypes, whose collectives the buckets must not pass).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import types
import warnings
from typing import Any

import pytest
import torch
from _counting import calls
from torch.utils.checkpoint import checkpoint

import fshard
from fshard._exec import accumulate as _accumulate
from fshard._exec import buckets as _buckets
from fshard._exec import gathered as _gathered
from fshard._plan import buckets as _bucket_plan
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
D = 6


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5 for _ in range(5)]


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)


class _MatMul(torch.autograd.Function):
    """``x @ w`` as a custom autograd function: torch-function modes do not see its inputs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


def _body(style: str, closed: torch.Tensor | None = None):
    def body(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        if style == "no_grad first":  # a first use that records no gradient: the later uses still do
            with torch.no_grad():
                x = x + 0 * ws[0].abs().sum()
        for k, w in enumerate(ws):
            if style == "checkpoint" and k % 2:
                x = checkpoint(lambda x, w=w: torch.tanh(x @ w), x, use_reentrant=False)
            elif style == "reentrant" and k % 2:  # a second use, recomputed outside the function: arrives late
                x = torch.tanh(x @ w)
                x = checkpoint(lambda x, w=w: torch.tanh(x @ w), x, use_reentrant=True)
            elif style == "function" and k % 2:  # a second use that reaches the argument untapped
                x = torch.tanh(_MatMul.apply(torch.tanh(x @ w), w))
            elif style.startswith("skip") and k == 2 and x.sum() > 0:  # data-dependent: some ranks skip this weight
                continue
            elif style == "skip closed" and k == 1:  # a closed-over tensor: its sum is a collective of the backward
                assert closed is not None
                x = torch.tanh(x @ w) @ closed
            elif style == "skip mixed":  # weights of two dtypes: two series of buckets
                x = torch.tanh(x @ w.to(x.dtype))
            elif style == "reentrant first" and k == 0:  # the first use runs without gradients, recomputed later
                with warnings.catch_warnings():  # torch warns that no input requires grad: w is closed over
                    warnings.simplefilter("ignore", UserWarning)
                    x = checkpoint(lambda x, w=w: torch.tanh(x @ w), x, use_reentrant=True)
            else:
                x = torch.tanh(x @ w)
        return (x**2).sum()[None]

    return body


def _grads(style: str, backend, x: fshard.ShardedArray) -> list[torch.Tensor]:
    """Each parameter's gradient on this process, after one backward (and its gradient of gradients)."""
    weights = [w.float() if style == "skip mixed" and k % 2 else w for k, w in enumerate(_weights())]
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in weights]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep = fshard.Replicated(R)
    closed = torch.eye(D, dtype=torch.float64).mul(0.9).requires_grad_()
    body = torch.compile(_body("plain"), backend="eager") if style == "compiled" else _body(style, closed)
    step = fshard.shard_map(body, in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=fshard.Partial(rep))
    loss = fshard.gather(step(x, *params))
    if style == "double":  # the gradient of the squared gradient norm: gradients of gradients
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        sum(g.pow(2).sum() for g in grads[: len(grads) // len(params)]).backward()
        return [t.grad for t in leaves[:: len(leaves) // len(params)]]
    loss.backward()
    return [t.grad for t in leaves[:: len(leaves) // len(params)]] + ([closed.grad] if style == "skip closed" else [])


def _local(style: str) -> list[torch.Tensor]:
    backend = LocalBackend(world_size=4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=backend)
    return _grads(style, backend, x)


def _on_rank(style: str, cap_mb: float) -> tuple[list[torch.Tensor], int]:
    old = fshard.config(bucket_cap_mb=cap_mb)
    try:
        backend = TorchDistBackend()
        x = fshard.from_local_tensor(_rows(backend.rank), dim=0)
        before = backend.counters.collectives
        grads = _grads(style, backend, x)
        return grads, backend.counters.collectives - before
    finally:
        fshard.config(**{"bucket_cap_mb": old.bucket_cap_mb})


@pytest.mark.parametrize(
    "style",
    [
        "plain", "checkpoint", "reentrant", "function", "skip", "skip closed", "skip mixed", "double", "no_grad first",
        "reentrant first", "compiled",
    ],
)  # fmt: skip
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])  # one bucket, or one per parameter
def test_gradients_summed_in_buckets_equal_the_local_backends(dist_pool, style, cap_mb):
    expected = _local(style)
    # torch gives w0 no gradient (no input of the checkpoint requires one), nor does any rank's bucket: None.
    assert (expected[0] is None) == (style == "reentrant first")
    for grads, _ in dist_pool.run(_on_rank, style, cap_mb, timeout=120):
        for got, want in zip(grads, expected):
            if want is None:
                assert got is None
            else:  # float32 weights ("skip mixed"): their sums' order may round otherwise
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if want.dtype == torch.float64 else 1e-5)


def _unused(backend: Any, rows: torch.Tensor, micro: int, precision: Any = None) -> list[torch.Tensor | None]:
    """One shard's gradient of each of 4 weights after ``micro`` micro-batches (all but the last under no_sync).

    Weight 0 is used everywhere; weight 1 nowhere; weight 2 by the ranks whose rows sum above 0; weight 3 by
    the first micro-batch only (kept aside, then summed by a backward that does not reach it).
    """
    ws = [
        fshard.shard(torch.full((D,), k + 1.0, dtype=torch.float64), fshard.Replicated(R), backend=backend)
        for k in range(4)
    ]
    leaves = [[t.requires_grad_() for t in w.addressable_data] for w in ws]
    x = (
        fshard.from_local_tensor(rows, dim=0)
        if isinstance(backend, TorchDistBackend)
        else fshard.shard(rows, fshard.Chunk(0, R), backend=backend)
    )
    rep = fshard.Replicated(R)
    for k in range(micro):

        def body(xb, a, b, c, d, first=k == 0):
            xb = xb.to(a.dtype)  # the weights' forward dtype, with a precision
            y = xb @ a
            if xb.sum() > 0:
                y = y * (xb @ c)
            if first:
                y = y + xb @ d
            return y.sum()[None]

        precisions = (None, *[precision] * 4)
        step = fshard.shard_map(
            body, in_specs=(fshard.Chunk(0, R), *[rep] * 4), out_specs=fshard.Partial(rep), precision=precisions
        )
        with fshard.no_sync() if k < micro - 1 else contextlib.nullcontext():
            fshard.gather(step(x, *ws)).float().backward()
    return [shards[0].grad for shards in leaves]


def _unused_on_rank(micro: int, precision: Any) -> list[torch.Tensor | None]:
    backend = TorchDistBackend()
    return _unused(backend, _rows(backend.rank), micro, precision)


_BF16 = fshard.Precision(param=torch.bfloat16, reduce=torch.float32)


@pytest.mark.parametrize("precision", [None, _BF16])
@pytest.mark.parametrize("micro", [1, 2])
def test_a_weight_no_rank_used_gets_no_gradient_as_on_the_local_backend(dist_pool, micro, precision):
    """As torch (and DDP) leave a parameter no rank used: ``None``, so an optimizer skips it (momentum, decay)."""
    expected = _unused(LocalBackend(world_size=4), torch.cat([_rows(r) for r in R]), micro, precision)
    assert expected[1] is None
    assert all(expected[k] is not None for k in (0, 2, 3))
    positive = [float(_rows(r).sum()) > 0 for r in R]
    assert any(positive)  # weight 2: some ranks use it, some do not
    assert not all(positive)
    tolerance = {"rtol": 0, "atol": 1e-12} if precision is None else {"rtol": 1e-5, "atol": 1e-5}  # fp32 sums
    for grads in dist_pool.run(_unused_on_rank, micro, precision, timeout=120):
        assert grads[1] is None
        for got, want in zip(grads, expected):
            if want is not None:
                torch.testing.assert_close(got, want, **tolerance)


def _sharded_uses(backend: Any, rows: torch.Tensor) -> list[torch.Tensor | None]:
    """This rank's shards' gradients of 4 fully-sharded weights, gathered by one ``shard_map``.

    Two split by rows (their boxes are ranges: one flat movement across processes), two by
    columns (each moved alone). Of each kind, one is used by the ranks whose rows sum above
    0 only, and the other by no rank.
    """
    by_rows, by_cols = fshard.Chunk(0, R), fshard.Chunk(1, R)
    g = torch.Generator().manual_seed(3)
    ws = [
        fshard.shard(torch.randn(D + 2, D, generator=g, dtype=torch.float64), spec, backend=backend)
        for spec in (by_rows, by_rows, by_cols, by_cols)
    ]
    leaves = [t.requires_grad_() for w in ws for t in w.addressable_data]
    x = (
        fshard.from_local_tensor(rows, dim=0)
        if isinstance(backend, TorchDistBackend)
        else fshard.shard(rows, by_rows, backend=backend)
    )

    def body(xb, a, b, c, d):
        y = (xb @ a[:D].T).sum()  # every rank reads a
        if xb.sum() > 0:
            y = y + (xb @ c[:D]).square().sum()
        return y[None]

    rep = fshard.Replicated(R)
    step = fshard.shard_map(body, in_specs=(by_rows, *[rep] * 4), out_specs=fshard.Partial(rep))
    fshard.gather(step(x, *ws)).backward()
    return [t.grad for t in leaves]


def _sharded_uses_on_rank() -> list[torch.Tensor | None]:
    backend = TorchDistBackend()
    return _sharded_uses(backend, _rows(backend.rank))


def test_fully_sharded_weights_some_or_no_rank_used_get_the_local_backends_gradients(dist_pool):
    """Every movement of the tree runs its backward on every rank: zeros for a weight no use reached.

    A weight moved alone and used on some ranks only ran its movement's backward (a
    collective) on those ranks alone, which raised; and the local backend, which moves each
    leaf alone, gave ``None`` where one flat movement across processes gives zeros.
    """
    expected = _sharded_uses(LocalBackend(world_size=4), torch.cat([_rows(r) for r in R]))
    positive = [float(_rows(r).sum()) > 0 for r in R]
    assert any(positive)
    assert not all(positive)
    unused = [k for k, g in enumerate(expected) if g is not None and not g.any()]
    assert set(range(4, 8)) | set(range(12, 16)) <= set(unused)  # the shards of b and d: zeros
    assert all(g is not None for g in expected)
    for rank, grads in enumerate(dist_pool.run(_sharded_uses_on_rank, timeout=120)):
        for got, want in zip(grads, expected[rank::4]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_buckets_leave_one_collective_each(dist_pool):
    """5 parameters of 288 bytes: one bucket each at a cap below that, one for all at 25 MiB."""
    few = dist_pool.run(_on_rank, "plain", 25.0, timeout=120)
    many = dist_pool.run(_on_rank, "plain", 1e-4, timeout=120)
    assert {runs for _, runs in many} == {runs + 4 for _, runs in few}


def test_a_bucket_plan_is_one_range_per_bucket_where_every_rank_holds_every_leaf():
    layouts = tuple(fshard.Replicated(R).layout((D, D)) for _ in range(5))
    plan = _bucket_plan.buckets(layouts, 8, 2 * D * D * 8, rank=1)
    assert plan is not None
    assert [len(b.positions) for b in plan] == [2, 2, 1]  # the last leaves first; two per bucket
    assert [b.positions for b in plan] == [(4, 3), (2, 1), (0,)]
    for b in plan:
        assert len(b.runs.indices_on(1)) == 1
        assert len(b.parts) == 1
    assert plan[-1].flag == 1
    assert plan[-1].runs.shape == (D * D + 2 + 5,)  # the count of late gradients, a carried value, each leaf's uses


def test_only_a_last_bucket_on_the_losss_device_carries_it():
    """Which buckets may carry ``fshard.backward``'s loss: facts of the bucket, the same on every rank.

    A bucket on another device than the loss's does not: the backward runs each device's nodes
    on a thread of its own, so two devices' last buckets could be reached in either order.
    """
    backend = types.SimpleNamespace(ranks=tuple(R))  # what the rule reads of a backend: its ranks
    layouts = tuple(fshard.Replicated(R).layout((D, D)) for _ in range(2))
    plan = _bucket_plan.buckets(layouts, 4, 1 << 20, rank=0)
    assert plan is not None

    def state(device: str, dtype: torch.dtype = torch.float32) -> Any:
        return types.SimpleNamespace(backend=backend, device=torch.device(device), dtype=dtype, plan=plan)

    carry = _buckets.Carry(backend, torch.ones((), device="meta"))
    with _buckets.carrying(carry):
        assert _buckets._carry_for(state("meta")) is carry
        assert _buckets._carry_for(state("cpu")) is None  # another device
        assert _buckets._carry_for(state("meta", torch.bfloat16)) is None  # would round the loss
        other = types.SimpleNamespace(ranks=(0, 1))
        assert _buckets._carry_for(types.SimpleNamespace(**{**vars(state("meta")), "backend": other})) is None
        carry.total = torch.ones(())
        assert _buckets._carry_for(state("meta")) is None  # carried once
    assert _buckets._carry_for(state("meta")) is None  # outside the backward


def test_the_bucket_size_is_a_checked_setting():
    with pytest.raises(fshard.SpecError, match="bucket_cap_mb"):
        fshard.config(bucket_cap_mb=0)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        fshard.config(bucket_cap_mb="25")


def _weights_and_step(style: str, world: int | None) -> tuple[Any, list[Any], list[torch.Tensor], Any]:
    """The backend (torch_dist, or ``world`` ranks in this process), the weights (``"dp"``: replicated, ``"fsdp"``:
    by rows), their blocks, and the data-parallel step over them."""
    backend = TorchDistBackend() if world is None else LocalBackend(world_size=world)
    spec = fshard.Chunk(0, R) if style == "fsdp" else fshard.Replicated(R)
    params = [fshard.shard(w, spec, backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    step = fshard.shard_map(_body("plain"), in_specs=(rows, *[rep] * 5), out_specs=fshard.Partial(rep))
    return backend, params, leaves, step


def _accumulated(style: str, micro: int, world: int | None = None) -> tuple[list[torch.Tensor], int]:
    """Gradients of ``micro`` micro-batches (each rank's rows, split), all but the last under ``no_sync``.

    Also the elements this rank sent in the backwards (on torch_dist; ``world``: a local backend of that size).
    """
    backend, params, leaves, step = _weights_and_step(style, world)
    rows = fshard.Chunk(0, R)
    if world is None:
        batches = [fshard.from_local_tensor(_rows(backend.rank)[k::micro], dim=0) for k in range(micro)]
    else:
        every = [_rows(r) for r in R]
        batches = [fshard.shard(torch.cat([x[k::micro] for x in every]), rows, backend=backend) for k in range(micro)]
    sent = 0
    for k, xb in enumerate(batches):
        with fshard.no_sync() if k < micro - 1 else contextlib.nullcontext():
            loss = fshard.gather(step(xb, *params))
        before = backend.counters.elements_sent
        loss.backward()
        sent += backend.counters.elements_sent - before
    return [t.grad for t in leaves], sent


@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_micro_batches_under_no_sync_send_the_gradients_of_one_step(dist_pool, style):
    """4 micro-batches: the gradients of the whole batch, as on the local backend, for the bytes of one backward."""
    one = dist_pool.run(_accumulated, style, 1, timeout=120)
    four = dist_pool.run(_accumulated, style, 4, timeout=120)
    local, _ = _accumulated(style, 4, world=4)
    for g, want in zip(local, _accumulated(style, 1, world=4)[0]):  # the whole batch's gradient
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    for rank, ((got, sent), (_, sent_once)) in enumerate(zip(four, one)):
        assert sent == sent_once > 0
        mine = local[rank::4] if style == "fsdp" else local[::4]
        for g, want in zip(got, mine):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _lost() -> str:
    backend = TorchDistBackend()
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    step = fshard.shard_map(_body("plain"), in_specs=(rows, *[rep] * 5), out_specs=fshard.Partial(rep))
    xb = fshard.from_local_tensor(_rows(backend.rank), dim=0)

    def params() -> list[fshard.ShardedArray]:
        out = [fshard.shard(w, rep) for w in _weights()]
        for p in out:
            p.addressable_data[0].requires_grad_()
        return out

    with fshard.no_sync():
        fshard.gather(step(xb, *params())).backward()  # these arrays are gone after this line
    try:
        fshard.gather(step(xb, *params())).backward()
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


def test_gradients_set_aside_for_arrays_that_are_gone_raise_on_every_rank(dist_pool):
    for message in dist_pool.run(_lost, timeout=120):
        assert "no longer exist" in message


def _step_refusal(opt: torch.optim.Optimizer) -> str:
    """The message of the SpecError that ``opt.step()`` raises, or ``"no error"``."""
    try:
        opt.step()
    except fshard.SpecError as exc:
        return str(exc)
    return "no error"


def _stepped_with_gradients_aside(world: int | None = None) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """The last micro-batch run inside no_sync too, then an optimizer step; then a correct step.

    Returns the step's error, and the next step's gradients with those of the same step alone.
    """
    backend = TorchDistBackend() if world is None else LocalBackend(world_size=world)
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    step = fshard.shard_map(_body("plain"), in_specs=(rows, *[rep] * 5), out_specs=fshard.Partial(rep))
    xb = fshard.shard(torch.cat([_rows(r) for r in R]), rows, backend=backend)
    params = [fshard.shard(w, rep, backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    opt = torch.optim.SGD(leaves, lr=0.0)  # a step that changes nothing: the gradients alone are compared
    with fshard.no_sync():
        fshard.gather(step(xb, *params)).backward()  # the last micro-batch inside too: nothing summed
    message = _step_refusal(opt)
    opt.zero_grad()
    fshard.gather(step(xb, *params)).backward()
    after = [t.grad.clone() for t in leaves]
    opt.zero_grad()
    fshard.gather(step(xb, *params)).backward()
    return message, after, [t.grad for t in leaves]


@pytest.mark.parametrize("world", [None, 4])
def test_an_optimizer_step_with_gradients_kept_aside_raises_and_drops_them(dist_pool, world):
    """The step refuses on every rank; the next step's gradients are its own, not twice them."""
    results = (
        [_stepped_with_gradients_aside(world)] if world else dist_pool.run(_stepped_with_gradients_aside, timeout=120)
    )
    for message, after, alone in results:
        assert "fshard.no_sync() still keeps aside" in message
        assert "outside `with fshard.no_sync():`" in message
        assert all(torch.equal(a, b) for a, b in zip(after, alone))


def _block_skipped_at_the_end(style: str, world: int | None = None) -> tuple[str, list[Any], list[Any]]:
    """Two blocks, one call each; the last micro-batch skips the second block, which the first used under no_sync.

    Returns the error of the optimizer's step after it (the second block's gradients are still kept aside), and
    the gradients of a whole step after that with those of the same step alone (nothing kept aside is added).
    """
    backend = TorchDistBackend() if world is None else LocalBackend(world_size=world)
    rows = fshard.Chunk(0, R)
    spec = fshard.Replicated(R) if style == "dp" else rows
    blocks = [fshard.shard(w[:, :D], spec, backend=backend) for w in _weights()[:2]]
    leaves = [t.requires_grad_() for b in blocks for t in b.addressable_data]
    opt = torch.optim.SGD(leaves, lr=0.0)  # a step that changes nothing: the gradients alone are compared
    layer = fshard.shard_map(lambda x, w: torch.tanh(x @ w), in_specs=(rows, fshard.Replicated(R)), out_specs=rows)

    def loss(x: fshard.ShardedArray, used: list[fshard.ShardedArray]) -> torch.Tensor:
        for w in used:
            x = layer(x, w)
        return fshard.gather(x).square().sum()

    x = fshard.shard(torch.cat([_rows(r) for r in R]), rows, backend=backend)
    with fshard.no_sync():
        loss(x, blocks).backward()
    loss(x, blocks[:1]).backward()  # sums the first block's; the second block's stay aside
    message = _step_refusal(opt)
    opt.zero_grad()
    loss(x, blocks).backward()
    after = [t.grad.clone() for t in leaves]
    opt.zero_grad()
    loss(x, blocks).backward()
    return message, after, [t.grad for t in leaves]


@pytest.mark.parametrize("world", [None, 4])
@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_a_block_the_last_micro_batch_skips_is_refused_by_the_step_on_every_rank(dist_pool, style, world):
    """Its gradients kept aside would be lost, or added to a later step's: every rank's step raises, and drops them."""
    results = (
        [_block_skipped_at_the_end(style, world)]
        if world
        else dist_pool.run(_block_skipped_at_the_end, style, timeout=120)
    )
    for message, after, alone in results:
        assert "fshard.no_sync() still keeps aside" in message
        assert "a block that earlier micro-batches used and it skips keeps its gradients aside" in message
        assert all(torch.equal(a, b) for a, b in zip(after, alone))


def test_an_optimizer_over_views_of_a_flat_buffer_is_checked_by_their_base():
    """Shards that are views of one buffer (a flat parameter): the step over them raises too."""
    backend = LocalBackend(world_size=2)
    flat = torch.randn(8)
    w = fshard.ShardedArray(fshard.Chunk(0, [0, 1]).layout((8,)), [flat[:4], flat[4:]], backend)
    views = [t.requires_grad_() for t in w.addressable_data]
    every = fshard.Replicated([0, 1])
    f = fshard.shard_map(lambda wb: (wb * wb).sum()[None], in_specs=(every,), out_specs=fshard.Partial(every))
    with fshard.no_sync():
        fshard.backward(f(w))
    with pytest.raises(fshard.SpecError, match="still keeps aside"):
        torch.optim.SGD(views, lr=0.1).step()


def test_optimizer_state_between_micro_batches_keeps_their_gradients():
    """optimizer_state's own step (zero lr, to make the state) is not refused, and drops nothing."""
    backend = LocalBackend(world_size=2)
    every = fshard.Replicated([0, 1])
    params = {"w": fshard.shard(torch.randn(4, 2), fshard.Chunk(0, [0, 1]), backend=backend)}
    leaves = [t.requires_grad_() for t in params["w"].addressable_data]
    f = fshard.shard_map(lambda a: (a * a).sum()[None], in_specs=(every,), out_specs=fshard.Partial(every))
    opt = torch.optim.AdamW(leaves, lr=0.1)
    with fshard.no_sync():
        fshard.backward(f(params["w"]))
    fshard.optimizer_state(opt, params)
    fshard.backward(f(params["w"]))  # the last micro-batch: both
    want = 8 * fshard.gather(params["w"]).detach()  # two micro-batches, each 2w from each of two copies
    torch.testing.assert_close(torch.cat([t.grad for t in leaves]), want, rtol=0, atol=0)


def _kept_aside_without_shards() -> tuple[str, dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Two stages, the second held by rank 0 alone, inputs over every rank; the last micro-batch kept aside too."""
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    params, _ = fshard.shard_module(model, {"0.*": fshard.Replicated(ranks), "1.*": fshard.Replicated([0])})
    x = torch.randn(16, 8)
    xs = fshard.shard(x, fshard.Chunk(0, ranks))

    def micro_batch() -> fshard.ShardedArray:
        out, _ = fshard.apply_module(
            model, params, {}, xs, method=lambda m, xb: m(xb).square().sum()[None],
            out_specs=fshard.Partial(fshard.Replicated(ranks)),
        )  # fmt: skip
        return out

    opt = torch.optim.SGD([t for a in params.values() for t in a.addressable_data], lr=0.0)  # no links
    with fshard.no_sync():
        fshard.backward(micro_batch())
    message = _step_refusal(opt)
    opt.zero_grad()
    fshard.backward(micro_batch())
    model(x).square().sum().backward()
    return (
        message,
        {k: [t.grad for t in a.addressable_data] for k, a in params.items()},
        {k: p.grad for k, p in model.named_parameters()},
    )


def test_gradients_kept_aside_for_arrays_a_rank_holds_no_shard_of_are_dropped_alike(dist_pool):
    """Such a rank keys them on the arrays' links, which its optimizer may not hold: every rank drops all."""
    for message, got, want in dist_pool.run(_kept_aside_without_shards, timeout=120):
        assert "Every gradient kept aside was dropped" in message
        for name, grads in got.items():
            for g in grads:
                torch.testing.assert_close(g, want[name], rtol=0, atol=1e-5)


def test_an_optimizer_over_other_tensors_steps_while_gradients_are_kept_aside():
    backend = LocalBackend(world_size=4)
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    step = fshard.shard_map(_body("plain"), in_specs=(rows, *[rep] * 5), out_specs=fshard.Partial(rep))
    xb = fshard.shard(torch.cat([_rows(r) for r in R]), rows, backend=backend)
    params = [fshard.shard(w, rep, backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    other = torch.ones(3, requires_grad=True)
    with fshard.no_sync():
        fshard.gather(step(xb, *params)).backward()
    other.sum().backward()
    torch.optim.SGD([other], lr=1.0).step()  # not a parameter whose gradients are kept aside
    assert torch.equal(other, torch.zeros(3))
    fshard.gather(step(xb, *params)).backward()  # the last micro-batch sums both
    assert all(t.grad is not None for t in leaves)


def _identity_then_map(world: int | None = None) -> tuple[torch.Tensor, int]:
    """A body that returns its block as it is; the result used by a later per-shard function.

    Also how many tensors still have a tap once the call has returned (none may: a tap's bucket
    belongs to its call's backward).
    """
    backend = TorchDistBackend() if world is None else LocalBackend(world_size=world)
    rep = fshard.Replicated(R)
    w = fshard.shard(_weights()[0], rep, backend=backend)
    leaf = w.addressable_data[0].requires_grad_()
    seen = []
    same = fshard.shard_map(lambda wb: seen.append(wb) or wb, in_specs=(rep,), out_specs=rep)(w)
    tapped = sum(_gathered._TAPPED.get(id(t)) is t for t in seen)
    out = fshard.map_local(lambda t: t * 3, same)
    fshard.gather(out).sum().backward()
    return leaf.grad, tapped


def test_a_block_keeps_no_tap_after_its_call(dist_pool):
    want, _ = _identity_then_map(world=4)
    for got, tapped in dist_pool.run(_identity_then_map, timeout=60):
        assert tapped == 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _data_parallel(out_spec: Any) -> tuple[TorchDistBackend, fshard.ShardedArray, list[fshard.ShardedArray], Any]:
    """This rank's rows, the replicated weights (leaves that need a gradient), and a data-parallel step over them."""
    backend = TorchDistBackend()
    x = fshard.from_local_tensor(_rows(backend.rank), dim=0)
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in _weights()]
    for p in params:
        p.addressable_data[0].requires_grad_()
    rep = fshard.Replicated(R)
    step = fshard.shard_map(_body("plain"), in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=out_spec)
    return backend, x, params, step


def _backward_rounds(cap_mb: float, out: str = "copies") -> tuple[dict[str, int], dict[str, int], int]:
    """The process group calls of one data-parallel forward (the shard_map call) and backward, and its buckets.

    ``out``: the results' out_specs, ``"copies"`` (``Partial(Replicated)``: each rank's own
    block lays it out, no exchange of outcomes) or ``"split"`` (``Chunk(0)``: its extent comes
    from every rank's block, so the call compares outcomes: one all_reduce of their digests,
    which agree here, so nothing more is exchanged).
    """
    old = fshard.config(bucket_cap_mb=cap_mb)
    try:
        spec = fshard.Partial(fshard.Replicated(R)) if out == "copies" else fshard.Chunk(0, R)
        backend, x, params, step = _data_parallel(spec)
        with calls() as forward:
            y = step(x, *params)
        loss = fshard.gather(y).sum()
        layouts = tuple(p.layout for p in params)
        plan = _bucket_plan.buckets(layouts, 8, max(int(cap_mb * (1 << 20)), 1), backend.rank)
        with calls() as backward:
            loss.backward()
        return dict(forward), backward, len(plan)
    finally:
        fshard.config(**{"bucket_cap_mb": old.bucket_cap_mb})


@pytest.mark.parametrize("out", ["copies", "split"])
@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
def test_a_backward_runs_its_buckets_and_nothing_else(dist_pool, cap_mb, out):
    """One all_reduce per bucket, summed in place, and no other round in the backward.

    The ranks compare their series of buckets in the forward: in the call's comparison of
    outcomes where it has one (an all_reduce), else in the check of outcomes that the call
    posts (an all_gather, not counted here) and the first launch ends: no round of headers.
    A loss gathered after the last shard_map has no per-shard part on any rank, so its
    backward exchanges nothing.
    """
    for forward, backward, n in dist_pool.run(_backward_rounds, cap_mb, out, timeout=120):
        assert forward == {"all_to_all_single": 0, "all_reduce": 0 if out == "copies" else 1}
        assert backward == {"all_reduce": n, "all_to_all_single": 0}
        assert n == (1 if cap_mb == 25.0 else 5)


def _taps_and_launches(cap_mb: float) -> tuple[int, int, int, list[torch.Tensor]]:
    """One step's tap nodes, the buckets that left before the arguments' own node ran, the buckets, the gradients."""
    taps, early = [], []
    forward, finish = _buckets._Tap.forward, _buckets._State.finish

    def counted_forward(ctx, state, positions, *tensors):
        taps.append(len(positions))
        return forward(ctx, state, positions, *tensors)

    def recorded_finish(self, late):
        early.append(len(self.flights))
        return finish(self, late)

    old = fshard.config(bucket_cap_mb=cap_mb)
    _buckets._Tap.forward, _buckets._State.finish = staticmethod(counted_forward), recorded_finish
    try:
        backend = TorchDistBackend()
        x = fshard.from_local_tensor(_rows(backend.rank), dim=0)
        grads = _grads("plain", backend, x)
        plan = _bucket_plan.buckets(
            tuple([fshard.Replicated(R).layout((D, D))] * 5), 8, max(int(cap_mb * (1 << 20)), 1), 0
        )
        return len(taps), early[0], len(plan), grads
    finally:
        _buckets._Tap.forward, _buckets._State.finish = forward, finish
        fshard.config(**{"bucket_cap_mb": old.bucket_cap_mb})


@pytest.mark.parametrize("cap_mb", [25.0, 1e-4])
def test_one_tap_per_bucket_and_every_bucket_but_the_last_leaves_during_the_backward(dist_pool, cap_mb):
    """A bucket's blocks share one autograd node, which hands their gradients over once all are in.

    With a bucket per parameter, every bucket but the last (which carries the count of late
    gradients) has left when the backward reaches the arguments' own node.
    """
    want = _local("plain")
    for taps, early, n, grads in dist_pool.run(_taps_and_launches, cap_mb, timeout=120):
        assert taps == n == (1 if cap_mb == 25.0 else 5)
        assert early == n - 1
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _different_buckets(out: str) -> str:
    old = fshard.config(bucket_cap_mb=25.0 if TorchDistBackend().rank == 0 else 1e-4)
    try:
        _backward_rounds(fshard.config().bucket_cap_mb, out)
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        fshard.config(**{"bucket_cap_mb": old.bucket_cap_mb})
    return "no error"


@pytest.mark.parametrize("out", ["copies", "split"])
def test_ranks_whose_buckets_differ_raise_on_every_rank(dist_pool, out):
    """In the call's exchange, or in the check of outcomes that the call posts (the first launch ends it)."""
    for message in dist_pool.run(_different_buckets, out, timeout=120):
        assert "in different buckets" in message, message
        assert "bucket_cap_mb" in message


def _no_sync_on_rank_0() -> str:
    """A data-parallel forward under ``no_sync`` on rank 0 only, whose backward would send nothing there."""
    backend, x, params, step = _data_parallel(fshard.Partial(fshard.Replicated(R)))
    with fshard.no_sync() if backend.rank == 0 else contextlib.nullcontext():
        loss = step(x, *params)
    try:
        total = fshard.gather(loss)  # the next collective: a bucket's launch would be one too
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    return f"no error: {total}"


def test_a_step_under_no_sync_on_some_ranks_only_raises_on_every_rank(dist_pool):
    """The other ranks' buckets would wait for rank 0's, which never leave: every rank raises at its next collective."""
    for message in dist_pool.run(_no_sync_on_rank_0, timeout=120):
        assert "ranks [0] and ranks [1, 2, 3] would sum the gradients of its arguments in different buckets" in message
        assert "fshard.no_sync() on every rank or on none" in message


def _small_sums() -> list[tuple[torch.Tensor, dict[str, int]]]:
    backend = TorchDistBackend()
    out = []
    for op in ("sum", "max", "min"):
        mine = torch.arange(3.0) * (backend.rank + 1) - backend.rank**2
        layout = fshard.Partial(fshard.Replicated(R), op=op).layout((3,))
        (i,) = layout.indices_on(backend.rank)
        x = fshard.from_local_shards_and_layout([fshard.Shard(layout.shards[i], mine)], layout, backend=backend)
        with calls() as counts:
            got = fshard.gather(x)
        out.append((got, dict(counts)))
    return out


def test_a_small_all_reduce_is_one_round_with_its_headers(dist_pool):
    """A loss-sized all-reduce on Gloo: one all_to_all carries the headers and every rank's summand."""
    summands = [torch.arange(3.0) * (r + 1) - r**2 for r in R]
    want = [sum(summands), torch.stack(summands).amax(0), torch.stack(summands).amin(0)]
    for results in dist_pool.run(_small_sums, timeout=60):
        for (got, counts), expected in zip(results, want):
            assert counts == {"all_to_all_single": 1, "all_reduce": 0}
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _steps(keep: bool) -> tuple[bool, bool, list[torch.Tensor], list[torch.Tensor]]:
    """Two backwards of the same step; ``keep``: the first step's gradients are held by the program.

    Returns whether the second step's gradients live in the first step's buffer, whether the
    held gradients kept their values, and both steps' gradients.
    """
    backend = TorchDistBackend()
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep = fshard.Replicated(R)
    step = fshard.shard_map(_body("plain"), in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=fshard.Partial(rep))
    grads = []
    for k in range(2):
        x = fshard.from_local_tensor(_rows(backend.rank) * (k + 1), dim=0)
        fshard.gather(step(x, *params)).backward()
        grads.append([t.grad for t in leaves])
        memory = {t.grad.untyped_storage().data_ptr() for t in leaves}
        if k == 0:
            first, held = memory, [g.clone() for g in grads[0]]
            if not keep:
                grads = []
        for t in leaves:
            t.grad = None
    kept = {b.untyped_storage().data_ptr() for bs in _buckets._KEPT_BY[leaves[0]].buffers.values() for b, _ in bs}
    same = memory == first and memory <= kept  # the second step's gradients in the first step's kept buffer
    kept_values = all(torch.equal(g, h) for g, h in zip(grads[0], held)) if keep else True
    return same, kept_values, held, [g.clone() for g in grads[-1]]


@pytest.mark.parametrize("keep", [False, True])
def test_bucket_buffers_are_reused_only_when_no_gradient_is_held(dist_pool, keep):
    """A step whose last gradients are gone sums into the same buffer; gradients a program holds keep their values."""
    results = dist_pool.run(_steps, keep, timeout=120)
    for same, kept_values, first, second in results:
        assert same is not keep
        assert kept_values
        assert not any(torch.equal(a, b) for a, b in zip(first, second))  # two different steps


def _kept_after_a_new_cap() -> tuple[int, int, bool]:
    """The buffers the first block keeps after a step at 25 MiB, then after one at a cap of one bucket per parameter."""
    backend = TorchDistBackend()
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep = fshard.Replicated(R)
    step = fshard.shard_map(_body("plain"), in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=fshard.Partial(rep))
    counts, keys = [], []
    for cap in (25.0, 1e-4):
        old = fshard.config(bucket_cap_mb=cap)
        try:
            fshard.gather(step(fshard.from_local_tensor(_rows(backend.rank), dim=0), *params)).backward()
        finally:
            fshard.config(bucket_cap_mb=old.bucket_cap_mb)
        kept = _buckets._KEPT_BY[leaves[0]]
        counts.append(sum(len(held) for held in kept.buffers.values()))
        keys.append(kept.key)
    assert not vars(leaves[0])  # held beside the block, not in it: torch.save(block) carries none of it
    return counts[0], counts[1], keys[0] != keys[1]


def test_blocks_keep_the_buffers_of_their_last_buckets_only(dist_pool):
    """One bucket at 25 MiB, then one per parameter: the 25 MiB bucket's buffer is dropped, not kept beside them."""
    for one, many, changed in dist_pool.run(_kept_after_a_new_cap, timeout=120):
        assert (one, many, changed) == (1, 5, True)


def _twice_on_one_graph() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Two backwards of one graph (``retain_graph``), the second of twice the loss, the first's gradients held.

    Returns the first backward's gradients as they were, as they are after the second, and the second's.
    """
    backend = TorchDistBackend()
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    rep = fshard.Replicated(R)
    step = fshard.shard_map(_body("plain"), in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=fshard.Partial(rep))
    loss = fshard.gather(step(fshard.from_local_tensor(_rows(backend.rank), dim=0), *params))
    loss.backward(retain_graph=True)
    held = [t.grad for t in leaves]  # views of the first backward's buckets, still referred to
    before = [g.clone() for g in held]
    for t in leaves:
        t.grad = None
    torch.autograd.backward(loss, torch.full_like(loss, 2.0))  # twice the gradients, into other buffers
    return before, held, [t.grad for t in leaves]


def test_a_second_backward_of_one_graph_leaves_the_gradients_held_from_the_first(dist_pool):
    expected = _local("plain")
    for before, held, second in dist_pool.run(_twice_on_one_graph, timeout=120):
        for a, h, b, want in zip(before, held, second, expected):
            torch.testing.assert_close(a, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(h, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(b, 2 * want, rtol=0, atol=1e-12)


class _Raised(Exception):
    pass


def _raising_once(
    backend: Any, hook_at: int, middle: bool = False
) -> tuple[list[Any], list[torch.Tensor], list[bool], Any]:
    """Replicated weights, their blocks, a switch, and a step whose backward a hook after weight ``hook_at``
    makes raise once while the switch is on (after the later weights' buckets have filled, and left).

    ``middle``: the step returns a second result too, the sum of the activations the hook is on.
    """
    params = [fshard.shard(w, fshard.Replicated(R), backend=backend) for w in _weights()]
    leaves = [t.requires_grad_() for p in params for t in p.addressable_data]
    armed = [False]

    def raise_once(g: torch.Tensor) -> None:
        if armed[0]:
            armed[0] = False
            raise _Raised

    def body(xb: torch.Tensor, *ws: torch.Tensor) -> Any:
        mid = xb
        for k, w in enumerate(ws):
            xb = torch.tanh(xb @ w)
            if k == hook_at:
                mid = xb
                xb = xb * 1.0  # the hook on a tensor of the first result's path alone
                xb.register_hook(raise_once)
        return ((xb**2).sum()[None], mid.sum()[None]) if middle else (xb**2).sum()[None]

    rep = fshard.Replicated(R)
    out = (fshard.Partial(rep), fshard.Partial(rep)) if middle else fshard.Partial(rep)
    step = fshard.shard_map(body, in_specs=(fshard.Chunk(0, R), *[rep] * 5), out_specs=out)
    return params, leaves, armed, step


def _retried(backend: Any, x: fshard.ShardedArray, another_root: bool = False) -> list[torch.Tensor | None]:
    """Each weight's gradient from a backward retried on its graph after one that a hook made raise midway.

    ``another_root``: the retry is a backward of the step's second result, which reaches none of the
    taps that the raised one ran (the later weights' buckets, filled and launched), only the first two
    weights'.
    """
    params, leaves, armed, step = _raising_once(backend, 1, middle=another_root)
    out = fshard.gather(step(x, *params))
    first, retry = out if another_root else (out, out)
    armed[0] = True
    with pytest.raises(_Raised):
        first.backward(retain_graph=True)
    for t in leaves:
        t.grad = None
    retry.backward()
    return [t.grad for t in leaves[:: len(leaves) // len(params)]]


def _one_bucket_per_weight(program: Any, *args: Any) -> Any:
    """``program(backend, x, *args)`` on this process's rows, with one bucket per weight."""
    old = fshard.config(bucket_cap_mb=1e-4)
    try:
        backend = TorchDistBackend()
        return program(backend, fshard.from_local_tensor(_rows(backend.rank), dim=0), *args)
    finally:
        fshard.config(bucket_cap_mb=old.bucket_cap_mb)


def test_a_backward_retried_after_one_that_raised_midway_starts_afresh(dist_pool):
    """The buckets the raised backward filled or launched are not added to the retry's gradients."""
    expected = _local("plain")
    for grads in dist_pool.run(_one_bucket_per_weight, _retried, timeout=120):
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_backward_from_another_root_after_one_that_raised_midway_starts_afresh(dist_pool):
    """The buckets the raised backward filled are not added: the weights the second result needs none of get none."""
    backend = LocalBackend(world_size=4)
    expected = _retried(
        backend, fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=backend), True
    )
    assert [g is None for g in expected] == [False, False, True, True, True]
    for grads in dist_pool.run(_one_bucket_per_weight, _retried, True, timeout=120):
        assert [g is None for g in grads] == [False, False, True, True, True]
        for got, want in zip(grads[:2], expected[:2], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _micro_batch_then_retried(backend: Any, x: fshard.ShardedArray) -> list[torch.Tensor]:
    """Each weight's gradient over a no_sync micro-batch and a syncing one whose backward raised midway, retried.

    The raised backward's taps of the later weights took back what the micro-batch set aside.
    """
    params, leaves, armed, step = _raising_once(backend, 2)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    loss = fshard.gather(step(x, *params))
    armed[0] = True
    with pytest.raises(_Raised):
        loss.backward(retain_graph=True)
    loss.backward()
    return [t.grad for t in leaves[:: len(leaves) // len(params)]]


def test_a_micro_batch_set_aside_survives_a_syncing_backward_that_raised_midway(dist_pool):
    """The raised backward took back what no_sync set aside; the retry finds it again: both micro-batches count."""
    backend = LocalBackend(world_size=4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=backend)
    expected = _micro_batch_then_retried(backend, x)
    for got, want in zip(expected, _local("plain"), strict=True):  # two micro-batches of the same rows
        torch.testing.assert_close(got, 2 * want, rtol=0, atol=1e-12)
    for grads in dist_pool.run(_one_bucket_per_weight, _micro_batch_then_retried, timeout=120):
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _hooked_step(
    style: str, world: int | None, on: torch.Tensor | None = None
) -> tuple[list[Any], list[torch.Tensor], Any, Any, list[bool]]:
    """Weights (``"dp"``: replicated, ``"fsdp"``: by rows), their blocks, this process's rows, the step, and a switch:
    while it is on, a hook on the first weight's block (or on ``on``) raises once, after the block's backward summed
    or set aside.
    """
    backend, params, leaves, step = _weights_and_step(style, world)
    rows = fshard.Chunk(0, R)
    x = (
        fshard.from_local_tensor(_rows(backend.rank), dim=0)
        if world is None
        else fshard.shard(torch.cat([_rows(r) for r in R]), rows, backend=backend)
    )
    armed = [False]

    def raise_once(g: torch.Tensor | None) -> None:
        if armed[0]:
            armed[0] = False
            raise _Raised

    (leaves[0] if on is None else on).register_hook(raise_once)
    return params, leaves, x, step, armed


def _raised_after_the_sum(style: str, which: str, world: int | None = None) -> list[torch.Tensor]:
    """Every block's gradient over two micro-batches of the same rows, one of which raised once and was retried.

    A hook on the first parameter's block raises after that micro-batch's backward set its gradients
    aside (``which="no_sync"``) or summed them with the earlier micro-batch's (``"syncing"``).
    """
    params, leaves, x, step, armed = _hooked_step(style, world)
    for k in range(2):
        with fshard.no_sync() if k == 0 else contextlib.nullcontext():
            loss = fshard.gather(step(x, *params))
            armed[0] = which == ("no_sync" if k == 0 else "syncing")
            if armed[0]:
                with pytest.raises(_Raised):
                    loss.backward(retain_graph=True)
                for t in leaves:  # what the blocks' own accumulation took before the raise
                    t.grad = None
            loss.backward()
    return [t.grad for t in leaves]


def _two_micro_batches_on_both(dist_pool: Any, style: str, fn: Any, *args: Any) -> None:
    """``fn(*args, world=4)`` gave every block two micro-batches' gradient, and each Gloo rank its blocks the same."""
    got = fn(*args, world=4)
    one, _ = _accumulated(style, 1, world=4)
    for g, want in zip(got, one, strict=True):  # two micro-batches of the same rows
        torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)
    for rank, grads in enumerate(dist_pool.run(fn, *args, timeout=120)):
        mine = got[rank::4] if style == "fsdp" else got[::4]
        for g, want in zip(grads, mine, strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("style", ["dp", "fsdp"])
@pytest.mark.parametrize("which", ["no_sync", "syncing"])
def test_a_backward_that_raised_after_its_sum_and_was_retried_counts_its_micro_batch_once(dist_pool, style, which):
    """A backward that raised puts back what it set aside or took back: each micro-batch counts once."""
    _two_micro_batches_on_both(dist_pool, style, _raised_after_the_sum, style, which)


def _raised_after_a_reentrant_checkpoint(
    style: str, which: str, depth: int, world: int | None = None
) -> list[torch.Tensor]:
    """As ``_raised_after_the_sum``, with each micro-batch's call inside ``depth`` nested reentrant checkpoints.

    The innermost checkpoint's backward recomputes the call and runs its own backward, which sums
    or sets aside, and ends; the step's backward raises after them (a hook on the outermost
    checkpoint's input).
    """
    start = torch.zeros((), dtype=torch.float64, requires_grad=True)
    params, leaves, x, step, armed = _hooked_step(style, world, on=start)

    def call(s: torch.Tensor, level: int = 1) -> torch.Tensor:
        if level < depth:
            return checkpoint(call, s, level + 1, use_reentrant=True)
        return fshard.gather(step(x, *params)) + s

    for k in range(2):
        with fshard.no_sync() if k == 0 else contextlib.nullcontext():
            loss = checkpoint(call, start, use_reentrant=True)
            armed[0] = which == ("no_sync" if k == 0 else "syncing")
            if armed[0]:
                with pytest.raises(_Raised):
                    loss.backward(retain_graph=True)
                for t in leaves:  # what the checkpoint's backward gave the blocks before the raise
                    t.grad = None
            loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("style", ["dp", "fsdp"])
@pytest.mark.parametrize("which", ["no_sync", "syncing"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_backward_that_raised_after_a_reentrant_checkpoints_own_backward_counts_its_micro_batch_once(
    dist_pool, style, which, depth
):
    """What a checkpoint's inner backward changed is put back with the backward whose node ran it."""
    _two_micro_batches_on_both(dist_pool, style, _raised_after_a_reentrant_checkpoint, style, which, depth)


def test_a_backward_run_from_a_nodes_hook_keeps_what_it_set_aside_once_the_step_succeeded():
    """A micro-batch's backward run from a module's backward hook (a hook of a node of another backward), under
    ``no_sync``: that outer backward succeeds, so what it set aside stands, also once the outer graph is freed."""
    _, params, leaves, step = _weights_and_step("dp", 4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=params[0].backend)

    def micro_batch(*_: Any) -> None:
        with torch.enable_grad():
            loss = fshard.gather(step(x, *params))
        loss.backward()

    module = torch.nn.Linear(1, 1)
    module.register_full_backward_hook(micro_batch)
    with fshard.no_sync():
        outer = module(torch.zeros(1, requires_grad=True)).sum()
        outer.backward()
    del outer  # the outer graph, and the node whose hook ran the micro-batch
    micro_batch()  # the syncing micro-batch
    one, _ = _accumulated("dp", 1, world=4)
    for g, want in zip([t.grad for t in leaves], one, strict=True):  # two micro-batches of the same rows
        torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)


def _through_a_node(start: torch.Tensor, backward: Any) -> torch.Tensor:
    """``start`` through a custom function whose backward first runs ``backward()``: backwards of its own."""

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, s: torch.Tensor) -> torch.Tensor:
            return s.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            backward()
            return g

    return Node.apply(start)


def _raised_after_a_node_that_ran_two_backwards(style: str, where: str, world: int | None = None) -> list[torch.Tensor]:
    """As ``_raised_after_a_reentrant_checkpoint``, with one node (a custom function's, as a reversible block's)
    running two micro-batches' backwards of its own: one under ``no_sync``, then the syncing one, which sums both.
    The step's backward raises once after the node (``where="after"``: a hook on its input) or in it (``"inside"``:
    a hook on the first block, in the syncing backward, after its sum), and is retried.
    """
    start = torch.zeros((), dtype=torch.float64, requires_grad=True)
    params, leaves, x, step, armed = _hooked_step(style, world, on=start if where == "after" else None)
    tries = [0]

    def two_micro_batches() -> None:
        tries[0] += 1
        for k in range(2):
            with fshard.no_sync() if k == 0 else contextlib.nullcontext(), torch.enable_grad():
                loss = fshard.gather(step(x, *params))
            armed[0] = armed[0] or (where == "inside" and k == 1 and tries[0] == 1)
            loss.backward()

    loss = _through_a_node(start, two_micro_batches)
    armed[0] = where == "after"
    with pytest.raises(_Raised):
        loss.backward(retain_graph=True)
    for t in leaves:  # what the node's second backward gave the blocks before the raise
        t.grad = None
    loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("style", ["dp", "fsdp"])
@pytest.mark.parametrize("where", ["after", "inside"])
def test_a_backward_that_raised_after_a_node_that_ran_two_backwards_counts_each_micro_batch_once(
    dist_pool, style, where
):
    """Both backwards that the node ran are put back with the backward that ran the node, also where the node
    raises after the first (its second backward raised)."""
    _two_micro_batches_on_both(dist_pool, style, _raised_after_a_node_that_ran_two_backwards, style, where)


def _inner_raise_caught(which: str, outer: bool, world: int | None = None) -> tuple[int, list[torch.Tensor]]:
    """A node runs a micro-batch's backward (``which``: under ``no_sync`` or syncing) that raises once, catches it
    and retries it on its own graph. Where ``outer``, the step's backward set a micro-batch aside before the node.
    Then the syncing micro-batch, where the node's was under ``no_sync``.

    Returns how many raises the node caught, and every block's gradient.
    """
    z = torch.zeros((), dtype=torch.float64, requires_grad=True)
    params, leaves, x, step, armed = _hooked_step("dp", world, on=z)
    start = torch.zeros((), dtype=torch.float64, requires_grad=True)
    caught = [0]

    def micro_batch() -> None:
        with torch.enable_grad(), fshard.no_sync() if which == "no_sync" else contextlib.nullcontext():
            before = z * 1.0  # made before the step: z's hook runs after the step's nodes
            loss = fshard.gather(step(x, *params)) + before
        armed[0] = True
        try:
            loss.backward(retain_graph=True)
        except _Raised:
            caught[0] += 1
            for t in leaves:  # what the blocks' own accumulation took before the raise
                t.grad = None
            loss.backward()

    with fshard.no_sync():
        total = _through_a_node(start, micro_batch)
        if outer:
            total = total + fshard.gather(step(x, *params))  # made after the node: its backward runs first
    total.backward()
    if which == "no_sync":
        fshard.gather(step(x, *params)).backward()
    return caught[0], [t.grad for t in leaves]


@pytest.mark.parametrize("which", ["no_sync", "syncing"])
@pytest.mark.parametrize("outer", [False, True])
def test_a_backward_that_a_node_ran_and_retried_after_a_raise_counts_its_micro_batch_once(dist_pool, which, outer):
    """The node's own backward has a journal of its own, also where the step's backward has one open: its raise
    puts back what it changed, and what the step's backward changed before stands."""
    caught, got = _inner_raise_caught(which, outer, world=4)
    assert caught == 1
    one, _ = _accumulated("dp", 1, world=4)
    micro_batches = 1 + outer + (which == "no_sync")
    for g, want in zip(got, one, strict=True):  # micro-batches of the same rows
        torch.testing.assert_close(g, micro_batches * want, rtol=0, atol=1e-12)
    for n, grads in dist_pool.run(_inner_raise_caught, which, outer, timeout=120):
        assert n == 1
        for g, want in zip(grads, got[::4], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _hooks_node_run_again(world: int | None = None) -> tuple[list[torch.Tensor], int]:
    """A micro-batch's backward run under ``no_sync`` from a module's backward hook; the outer graph, kept, runs its
    backward again, which raises after the module; then the syncing micro-batch.

    Returns every block's gradient, and how many journals of backwards are still alive.
    """
    z = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    params, leaves, x, step, armed = _hooked_step("dp", world, on=z)
    ran = [False]

    def micro_batch(*_: Any) -> None:
        if ran[0]:
            return
        ran[0] = True
        with torch.enable_grad():
            loss = fshard.gather(step(x, *params))
        loss.backward()

    module = torch.nn.Linear(1, 1, dtype=torch.float64)
    module.register_full_backward_hook(micro_batch)
    with fshard.no_sync():
        outer = module(z).sum()
        outer.backward(retain_graph=True)  # the module's node ran the micro-batch from its hooks: it succeeded
        armed[0] = True
        with pytest.raises(_Raised):
            outer.backward()  # the same node again, then a raise: not that micro-batch's backward
    del outer
    ran[0] = False
    micro_batch()  # the syncing micro-batch
    gc.collect()
    return [t.grad for t in leaves], sum(type(o) is _accumulate._Journal for o in gc.get_objects())


def test_a_backward_run_from_a_nodes_hooks_stands_when_that_node_runs_again_in_a_backward_that_raises(dist_pool):
    """That backward belongs to the outer one that succeeded: a later backward of the graph that raises leaves it,
    and no journal is left alive."""
    got, journals = _hooks_node_run_again(world=4)
    assert journals == 0
    one, _ = _accumulated("dp", 1, world=4)
    for g, want in zip(got, one, strict=True):  # two micro-batches of the same rows
        torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)
    for grads, alive in dist_pool.run(_hooks_node_run_again, timeout=120):
        assert alive == 0
        for g, want in zip(grads, got[::4], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _hooks_backward_in_one_that_raised(kind: str, world: int | None = None) -> tuple[int, list[torch.Tensor]]:
    """Under ``no_sync``, a hook of the outer graph (``kind``) runs a micro-batch's backward; the outer backward
    raises after it, and is retried on its graph, which runs the hook again; then the syncing micro-batch.

    Returns how many times the hook ran, and every block's gradient.
    """
    z = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    params, leaves, x, step, armed = _hooked_step("dp", world, on=z)
    ran = [0]

    def micro_batch(*_: Any) -> None:
        ran[0] += 1
        with torch.enable_grad():
            loss = fshard.gather(step(x, *params))
        loss.backward()

    module = torch.nn.Linear(1, 1, dtype=torch.float64)
    if kind == "module":
        module.register_full_backward_hook(micro_batch)
    elif kind == "accumulated":
        module.weight.register_post_accumulate_grad_hook(micro_batch)
    with fshard.no_sync():
        h = module(z) * 2.0
        if kind == "tensor":
            h.register_hook(micro_batch)
        outer = h.sum()
        armed[0] = True
        with pytest.raises(_Raised):
            outer.backward(retain_graph=True)  # raises at z's hook, after the hook's micro-batch
        outer.backward()  # the retry: the hook's micro-batch again
    fshard.gather(step(x, *params)).backward()  # the syncing micro-batch
    return ran[0], [t.grad for t in leaves]


@pytest.mark.parametrize("kind", ["module", "tensor", "accumulated"])
def test_a_backward_a_hook_ran_falls_with_the_backward_that_raised(dist_pool, kind):
    """A backward run inside another (from any of its hooks) stands or falls with it: retried, it counts once."""
    ran, got = _hooks_backward_in_one_that_raised(kind, world=4)
    assert ran == 2
    one, _ = _accumulated("dp", 1, world=4)
    for g, want in zip(got, one, strict=True):  # the hook's micro-batch once, and the syncing one
        torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)
    for n, grads in dist_pool.run(_hooks_backward_in_one_that_raised, kind, timeout=120):
        assert n == 2
        for g, want in zip(grads, got[::4], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _raised_in_a_later_callback(nested: bool, world: int | None = None) -> list[torch.Tensor]:
    """A micro-batch under ``no_sync`` whose backward raises in a callback queued after fshard's (by a hook on the
    first block), and is retried on its graph: at the top (``nested=False``), or inside a node that catches and
    retries it. Then the syncing micro-batch. Every block's gradient."""
    params, leaves, x, step, _ = _hooked_step("dp", world)
    fired = [False]

    def raise_later() -> None:
        raise _Raised

    def queue(g: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(raise_later)  # pyright: ignore[reportAttributeAccessIssue]

    leaves[0].register_hook(queue)

    def micro_batch() -> None:
        with torch.enable_grad(), fshard.no_sync():
            loss = fshard.gather(step(x, *params))
        with pytest.raises(_Raised):
            loss.backward(retain_graph=True)
        for t in leaves:
            t.grad = None
        loss.backward()

    if nested:
        _through_a_node(torch.zeros((), dtype=torch.float64, requires_grad=True), micro_batch).backward()
    else:
        micro_batch()
    fshard.gather(step(x, *params)).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("nested", [False, True])
def test_a_backward_that_raised_in_a_later_callback_counts_its_micro_batch_once(dist_pool, nested):
    """A raise in a callback queued after fshard's is a raise of the backward: what it set aside is put back."""
    _two_micro_batches_on_both(dist_pool, "dp", _raised_in_a_later_callback, nested)


def _moved_on_after_a_raise(style: str, which: str, world: int | None = None) -> tuple[str, list[torch.Tensor]]:
    """A micro-batch under no_sync, then one (``which``) whose backward raised after its sum; then a new forward.

    Returns the new forward's error, and every block's gradient from one whole step run after it.
    """
    params, leaves, x, step, armed = _hooked_step(style, world)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    with fshard.no_sync() if which == "no_sync" else contextlib.nullcontext():
        loss = fshard.gather(step(x, *params))
        armed[0] = True
        with pytest.raises(_Raised):
            loss.backward()
    for t in leaves:
        t.grad = None
    with pytest.raises(fshard.SpecError, match="backward that raised") as refused:
        step(x, *params)
    fshard.gather(step(x, *params)).backward()  # what was put back is gone: this step alone
    return str(refused.value), [t.grad for t in leaves]


@pytest.mark.parametrize("style", ["dp", "fsdp"])
@pytest.mark.parametrize("which", ["no_sync", "syncing"])
def test_a_call_made_after_a_backward_that_raised_is_refused_on_every_rank(dist_pool, style, which):
    """The gradients put back go silently into no step run since: the call raises, and the next step is its own."""
    message, got = _moved_on_after_a_raise(style, which, world=4)
    assert "retain_graph=True" in message
    assert "first micro-batch" in message
    one, _ = _accumulated(style, 1, world=4)
    for g, want in zip(got, one, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    for rank, (text, grads) in enumerate(dist_pool.run(_moved_on_after_a_raise, style, which, timeout=120)):
        assert text == message
        mine = got[rank::4] if style == "fsdp" else got[::4]
        for g, want in zip(grads, mine, strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _given_up(style: str, after: str, world: int | None = None) -> tuple[str, list[torch.Tensor]]:
    """A step given up after a micro-batch kept aside (``after="no_sync"``) or after its last micro-batch's backward
    raised (``"raise"``), dropped with ``discard_kept_aside``; then one whole step, and an optimizer's step.

    Returns what the optimizer's step raised (``""``: nothing) and every block's gradient from that whole step.
    """
    params, leaves, x, step, armed = _hooked_step(style, world)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    if after == "raise":
        loss = fshard.gather(step(x, *params))
        armed[0] = True
        with pytest.raises(_Raised):
            loss.backward()
    fshard.discard_kept_aside(params)
    opt = torch.optim.SGD(leaves, lr=0.0)
    opt.zero_grad()
    fshard.gather(step(x, *params)).backward()  # neither refused nor adding the step given up
    try:
        opt.step()
    except fshard.SpecError as exc:
        return str(exc), [t.grad for t in leaves]
    return "", [t.grad for t in leaves]


@pytest.mark.parametrize("style", ["dp", "fsdp"])
@pytest.mark.parametrize("after", ["no_sync", "raise"])
def test_a_step_given_up_and_discarded_leaves_the_next_step_its_own_gradients(dist_pool, style, after):
    """``discard_kept_aside`` drops a given-up step's micro-batches (and what a raise put back) on every rank."""
    refused, got = _given_up(style, after, world=4)
    assert refused == ""
    one, _ = _accumulated(style, 1, world=4)
    for g, want in zip(got, one, strict=True):  # that step's one micro-batch alone
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    for rank, (text, grads) in enumerate(dist_pool.run(_given_up, style, after, timeout=120)):
        assert text == ""
        mine = got[rank::4] if style == "fsdp" else got[::4]
        for g, want in zip(grads, mine, strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _discarded_apart(how: str) -> tuple[str, list[torch.Tensor]]:
    """A micro-batch kept aside; then rank 0 passes ``discard_kept_aside`` another tree than the other ranks:
    ``"more"`` (one array twice: other layouts), ``"part"`` (one array of the five the call moved as one).

    Returns the error and every block's gradient from a syncing micro-batch after it: nothing was dropped.
    """
    params, leaves, x, step, _ = _hooked_step("dp", None)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    mine = params if x.backend.rank else [*params, params[0]] if how == "more" else params[:1]
    try:
        fshard.discard_kept_aside(mine)
    except (fshard.CollectiveMismatchError, fshard.SpecError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "no error"
    fshard.gather(step(x, *params)).backward()
    return message, [t.grad for t in leaves]


@pytest.mark.parametrize("how", ["more", "part"])
def test_ranks_that_discard_different_arrays_raise_on_every_rank_and_drop_nothing(dist_pool, how):
    one, _ = _accumulated("dp", 1, world=4)
    for rank, (message, grads) in enumerate(dist_pool.run(_discarded_apart, how, timeout=120)):
        if how == "part" and rank == 0:
            assert message.startswith("SpecError: fshard.discard_kept_aside(): gradients kept aside for some")
            assert "moved in one call with shard tensors of other arrays" in message
        else:
            assert message.startswith("CollectiveMismatchError: fshard.discard_kept_aside(): the ranks passed")
        assert "pass the same tree" in message or "pass every array that call moved" in message
        for g, want in zip(grads, one[::4], strict=True):  # the micro-batch kept aside, and the syncing one
            torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)


def _discarded_on_a_subgroup() -> list[float] | None:
    """Arrays of a group of ranks [1, 2, 3]: rank 0, not in it, passes the same tree and compares nothing."""
    import torch.distributed as dist

    group = dist.new_group([1, 2, 3])  # every rank creates the group
    backend = TorchDistBackend(group)
    rep, rows = fshard.Replicated([1, 2, 3]), fshard.Chunk(0, [1, 2, 3])
    w = fshard.shard(torch.ones(3), rep, backend=backend)
    if not backend.member:
        fshard.discard_kept_aside(w)
        return None
    leaf = w.addressable_data[0].requires_grad_()
    x = fshard.shard(torch.arange(6.0), rows, backend=backend)
    step = fshard.shard_map(
        lambda xb, wb: (xb.sum() * wb).sum()[None], in_specs=(rows, rep), out_specs=fshard.Partial(rep)
    )
    with fshard.no_sync():
        fshard.gather(step(x, w)).sum().backward()
    fshard.discard_kept_aside(w)
    fshard.gather(step(x, w)).sum().backward()
    return leaf.grad.tolist()


def test_discard_kept_aside_of_a_groups_arrays_on_a_rank_outside_it(dist_pool):
    assert dist_pool.run(_discarded_on_a_subgroup, timeout=120) == [None] + [[15.0] * 3] * 3  # one micro-batch


@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_discard_kept_aside_refuses_part_of_a_call_and_drops_nothing(style):
    """Arrays moved in one call share what is kept aside: dropping part of them would drop the others'."""
    _, params, leaves, step = _weights_and_step(style, 4)
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=params[0].backend)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    with pytest.raises(fshard.SpecError, match="moved in one call with shard tensors of other arrays"):
        fshard.discard_kept_aside(params[:1])
    fshard.gather(step(x, *params)).backward()
    one, _ = _accumulated(style, 1, world=4)
    for g, want in zip([t.grad for t in leaves], one, strict=True):  # both micro-batches
        torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)


def _backend_and_rows(world: int | None) -> tuple[Any, fshard.ShardedArray]:
    """The backend (torch_dist, or ``world`` ranks in this process) and every rank's rows on it."""
    if world is None:
        backend = TorchDistBackend()
        return backend, fshard.from_local_tensor(_rows(backend.rank), dim=0)
    backend = LocalBackend(world_size=world)
    return backend, fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=backend)


def _kept_by_two_calls(world: int | None = None, attempt: bool = True) -> tuple[str, list[torch.Tensor]]:
    """Weights ``w0``, ``w1``, ``w2``; each micro-batch moves ``(w0, w1)`` in one call and ``(w0, w2)`` in another.

    After a micro-batch kept aside, ``discard_kept_aside((w0, w1))`` (where ``attempt``): ``w0``'s gradients
    were moved with ``w2``'s too. Returns its error and every block's gradient after a syncing micro-batch.
    """
    backend, x = _backend_and_rows(world)
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    ws = [fshard.shard(w, rep, backend=backend) for w in _weights()[:3]]
    leaves = [t.requires_grad_() for w in ws for t in w.addressable_data]
    two = fshard.shard_map(
        lambda xb, a, b: (torch.tanh(xb @ a) @ b).square().sum()[None],
        in_specs=(rows, rep, rep),
        out_specs=fshard.Partial(rep),
    )
    with fshard.no_sync():
        (fshard.gather(two(x, ws[0], ws[1])) + fshard.gather(two(x, ws[0], ws[2]))).backward()
    message = ""
    if attempt:
        try:
            fshard.discard_kept_aside(ws[:2])
        except fshard.SpecError as exc:
            message = str(exc)
    (fshard.gather(two(x, ws[0], ws[1])) + fshard.gather(two(x, ws[0], ws[2]))).backward()
    return message, [t.grad for t in leaves]


def test_discard_kept_aside_refuses_an_array_that_another_call_moved_with_arrays_not_passed(dist_pool):
    """What is kept aside for ``w0`` came from both calls, on one backend as across processes: refused alike."""
    message, got = _kept_by_two_calls(world=4)
    assert message.startswith("fshard.discard_kept_aside(): gradients kept aside for some")
    assert "moved in one call with shard tensors of other arrays" in message
    _, whole = _kept_by_two_calls(world=4, attempt=False)
    for g, want in zip(got, whole, strict=True):  # nothing was dropped
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    for text, grads in dist_pool.run(_kept_by_two_calls, timeout=120):
        assert text == message
        for g, want in zip(grads, got[::4], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _kept_where_some_ranks_hold_none(world: int | None = None) -> list[torch.Tensor]:
    """Two arrays on ranks [0, 1] of four moved in one call (``global_norm``), a micro-batch under ``no_sync``, then the
    syncing one. Ranks 2 and 3 hold no block: what they keep aside is keyed by the arrays' links, not by the tensor
    made afresh at each call that stands for the group there. Every block's gradient."""
    backend, _ = _backend_and_rows(world)
    a, b = (
        fshard.map_local(
            lambda t: t.detach().requires_grad_(), fshard.shard(w, fshard.Replicated([0, 1]), backend=backend)
        )
        for w in _weights()[:2]
    )
    with fshard.no_sync():
        fshard.global_norm([a, b]).backward()
    fshard.global_norm([a, b]).backward()
    return [t.grad for w in (a, b) for t in w.addressable_data]


def test_micro_batches_kept_aside_on_ranks_that_hold_no_block_of_the_call(dist_pool):
    got = _kept_where_some_ranks_hold_none(world=4)
    w = _weights()[:2]
    norm = torch.cat([v.reshape(-1) for v in w]).norm()
    for g, v in zip(got, [w[0], w[0], w[1], w[1]], strict=True):  # two micro-batches of the norm's gradient
        torch.testing.assert_close(g, 2 * v / norm, rtol=1e-12, atol=1e-12)
    for rank, grads in enumerate(dist_pool.run(_kept_where_some_ranks_hold_none, timeout=120)):
        mine = got[rank::2] if rank < 2 else []  # local: a's blocks, then b's
        for g, want in zip(grads, mine, strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _moved_in_a_tree_then_alone(world: int | None = None) -> tuple[str, list[torch.Tensor]]:
    """Under ``no_sync``, ``(w0, w1)`` moved in one call, then ``w0`` alone; the syncing micro-batch moves ``(w0, w1)``
    only, and an optimizer steps. Returns what the step raised, and every block's gradient."""
    backend, x = _backend_and_rows(world)
    rep, rows = fshard.Replicated(R), fshard.Chunk(0, R)
    ws = [fshard.shard(w, rep, backend=backend) for w in _weights()[:2]]
    leaves = [t.requires_grad_() for w in ws for t in w.addressable_data]
    two = fshard.shard_map(
        lambda xb, a, b: (torch.tanh(xb @ a) @ b).square().sum()[None], in_specs=(rows, rep, rep),
        out_specs=fshard.Partial(rep),
    )  # fmt: skip
    alone = fshard.shard_map(
        lambda xb, a: torch.tanh(xb @ a).square().sum()[None], in_specs=(rows, rep), out_specs=fshard.Partial(rep)
    )
    with fshard.no_sync():
        fshard.gather(two(x, *ws)).backward()
        fshard.gather(alone(x, ws[0])).backward()
    fshard.gather(two(x, *ws)).backward()
    try:
        torch.optim.SGD(leaves, lr=0.0).step()
    except fshard.SpecError as exc:
        return str(exc), [t.grad for t in leaves]
    return "no error", [t.grad for t in leaves]


def test_what_a_call_kept_aside_is_its_own_on_one_backend_as_across_processes(dist_pool):
    """The tree's call takes back its own micro-batch; ``w0``'s call alone kept its own, which no syncing backward
    summed: the step refuses it, on the local backend as across processes (each rank's entries are keyed alike)."""
    message, got = _moved_in_a_tree_then_alone(world=4)
    assert message.startswith("SGD.step() over parameters whose gradients fshard.no_sync() still keeps aside")
    for text, grads in dist_pool.run(_moved_in_a_tree_then_alone, timeout=120):
        assert text == message
        for g, want in zip(grads, got[::4], strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def _kept_on_apart_ranks(world: int | None = None, drop: bool = True) -> list[torch.Tensor]:
    """``a`` replicated on ranks [0, 1] and ``b`` on [2, 3], moved in one call (``global_norm``); after a micro-batch
    kept aside, ``discard_kept_aside(a)`` (where ``drop``), then a syncing micro-batch. Every block's gradient."""
    backend, _ = _backend_and_rows(world)
    a, b = (
        fshard.map_local(lambda t: t.detach().requires_grad_(), fshard.shard(w, spec, backend=backend))
        for w, spec in zip(_weights(), [fshard.Replicated([0, 1]), fshard.Replicated([2, 3])])
    )
    leaves = [t for w in (a, b) for t in w.addressable_data]
    with fshard.no_sync():
        fshard.global_norm([a, b]).backward()
    if drop:
        fshard.discard_kept_aside(a)
    fshard.global_norm([a, b]).backward()
    return [t.grad for t in leaves]


def test_discard_kept_aside_of_arrays_moved_with_others_on_other_ranks(dist_pool):
    """A rank drops what it keeps for the call's arrays it holds: the others are on other ranks, as across processes."""
    got, kept = _kept_on_apart_ranks(world=4), _kept_on_apart_ranks(world=4, drop=False)
    for g, both in zip(got[:2], kept[:2], strict=True):  # a: the syncing micro-batch alone
        torch.testing.assert_close(g, both / 2, rtol=0, atol=1e-12)
    for g, both in zip(got[2:], kept[2:], strict=True):  # b: both micro-batches
        torch.testing.assert_close(g, both, rtol=0, atol=0)
    for rank, grads in enumerate(dist_pool.run(_kept_on_apart_ranks, timeout=120)):
        torch.testing.assert_close(grads, [got[rank]], rtol=0, atol=1e-12)


def test_discard_kept_aside_refuses_what_is_not_an_array_and_a_call_from_a_backward():
    _, params, leaves, step = _weights_and_step("dp", 4)
    with pytest.raises(TypeError, match="got a leaf of type Tensor"):
        fshard.discard_kept_aside([params[0], leaves[0]])
    x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=params[0].backend)
    leaves[0].register_hook(lambda g: fshard.discard_kept_aside(params))
    with pytest.raises(fshard.SpecError, match="ran inside a backward"):
        fshard.gather(step(x, *params)).backward()


def _unused_and_empty(backend: Any, rows: torch.Tensor, create_graph: bool) -> list[torch.Tensor | None]:
    """The gradients of a used weight, an unused one and a used zero-size one (``torch.autograd.grad``)."""
    values = [torch.full((D, D), 0.5, dtype=torch.float64), torch.ones(D, dtype=torch.float64), torch.zeros(0)]
    ws = [fshard.shard(v.to(torch.float64), fshard.Replicated(R), backend=backend) for v in values]
    blocks = [[t.requires_grad_() for t in w.addressable_data] for w in ws]
    first = [b[0] for b in blocks]  # one shard of each
    x = (
        fshard.from_local_tensor(rows, dim=0)
        if backend.spans_processes
        else fshard.shard(rows, fshard.Chunk(0, R), backend=backend)
    )
    rep = fshard.Replicated(R)
    step = fshard.shard_map(
        lambda xb, w, unused, e: ((xb @ w) ** 2 + e.sum()).sum()[None],
        in_specs=(fshard.Chunk(0, R), rep, rep, rep),
        out_specs=fshard.Partial(rep),
    )
    loss = fshard.gather(step(x, *ws))
    grads = torch.autograd.grad(loss, first, create_graph=create_graph, allow_unused=True)
    return [None if g is None else g.detach() for g in grads]


def _unused_and_empty_on_rank(create_graph: bool) -> list[torch.Tensor | None]:
    backend = TorchDistBackend()
    return _unused_and_empty(backend, _rows(backend.rank), create_graph)


@pytest.mark.parametrize("create_graph", [False, True])
def test_an_unused_weight_gets_none_and_a_used_empty_one_zeros_as_on_the_local_backend(dist_pool, create_graph):
    """As torch: ``None`` for a weight no rank used, an empty gradient for a zero-size one that was used."""
    rows = torch.cat([_rows(r) for r in R])
    expected = _unused_and_empty(LocalBackend(world_size=4), rows, create_graph)
    assert expected[1] is None
    assert expected[2] is not None
    assert expected[2].shape == (0,)
    for grads in dist_pool.run(_unused_and_empty_on_rank, create_graph, timeout=120):
        torch.testing.assert_close(grads[0], expected[0], rtol=0, atol=1e-12)
        assert grads[1] is None
        assert grads[2] is not None
        assert grads[2].shape == (0,)


def test_a_backward_that_raised_on_one_thread_leaves_another_threads_micro_batches():
    """Two models on two threads: one's backward raises (and is retried) while the other sets a micro-batch aside.

    Each journal puts back only the keys its own backward changed: both models count both micro-batches.
    """
    one, _ = _accumulated("dp", 1, world=4)
    opened, set_aside = threading.Event(), threading.Event()
    got: dict[str, list[torch.Tensor]] = {}

    def raising() -> None:
        _, params, leaves, step = _weights_and_step("dp", 4)
        x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=params[0].backend)
        armed = [False]

        def wait_then_raise(g: torch.Tensor | None) -> None:
            if armed[0]:
                armed[0] = False
                opened.set()
                set_aside.wait(30)
                raise _Raised

        leaves[0].register_hook(wait_then_raise)
        with fshard.no_sync():
            fshard.gather(step(x, *params)).backward()
        loss = fshard.gather(step(x, *params))
        armed[0] = True
        with pytest.raises(_Raised):
            loss.backward(retain_graph=True)  # its journal is open when the other thread sets aside
        for t in leaves:
            t.grad = None
        loss.backward()
        got["raised"] = [t.grad for t in leaves]

    def other() -> None:
        _, params, leaves, step = _weights_and_step("dp", 4)
        x = fshard.shard(torch.cat([_rows(r) for r in R]), fshard.Chunk(0, R), backend=params[0].backend)
        opened.wait(30)
        with fshard.no_sync():
            fshard.gather(step(x, *params)).backward()
        set_aside.set()
        time.sleep(0.5)  # the raised backward's journal is dropped meanwhile
        fshard.gather(step(x, *params)).backward()
        got["other"] = [t.grad for t in leaves]

    threads = [threading.Thread(target=raising), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for name in ("raised", "other"):
        for g, want in zip(got[name], one, strict=True):
            torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12)


def test_a_step_given_up_after_a_raise_runs_again_on_new_arrays():
    """Arrays made afresh (a reload) after a syncing backward raised: what was put back for the old ones is dropped."""
    params, leaves, x, step, armed = _hooked_step("dp", 4)
    with fshard.no_sync():
        fshard.gather(step(x, *params)).backward()
    loss = fshard.gather(step(x, *params))
    armed[0] = True
    with pytest.raises(_Raised):
        loss.backward()
    del params, leaves, loss
    one, _ = _accumulated("dp", 1, world=4)  # new arrays: neither refused nor reported lost
    again, _ = _accumulated("dp", 1, world=4)
    for g, want in zip(again, one, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
