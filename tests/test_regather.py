"""``shard_map(..., regather=True)``: gathered arguments freed after the forward, gathered again in the backward.

A fully-sharded model of ``BLOCKS`` blocks, each a ``shard_map`` (or ``apply_module``) whose
parameters move from ``Chunk(0)`` to ``Replicated``. With ``regather=True`` the result must
be bit-identical (float64: losses, gradients, parameters after SGD steps) to keeping the
gathered copies; the copies must be dead once a block's forward returns; the backward must
move each block again exactly once and hold at most one block's copy at a time.
"""

from __future__ import annotations

import gc
import re
import weakref

import optree
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fshard
from fshard._exec import regather as _regather
from fshard.backends.local import LocalBackend

R = [0, 1, 2, 3]
ROWS, EVERYWHERE = fshard.Chunk(0, R), fshard.Replicated(R)
BLOCKS, D = 3, 8


def _params(backend=None) -> list[tuple[fshard.ShardedArray, fshard.ShardedArray]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(BLOCKS):
        w = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5
        b = torch.randn(D, generator=g, dtype=torch.float64)
        out.append((fshard.shard(w, ROWS, backend=backend), fshard.shard(b, ROWS, backend=backend)))
    for p in optree.tree_leaves(out):
        p.requires_grad_()
    return out


def _x(backend=None) -> fshard.ShardedArray:
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    return fshard.shard(x, ROWS, backend=backend)


def _block(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(torch.nn.functional.linear(torch.nn.functional.layer_norm(h, (D,)), w, b))


def _checkpointed(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return checkpoint(_block, h, w, b, use_reentrant=False)


def _loss(params, x, regather: bool, body=_block) -> torch.Tensor:
    step = fshard.shard_map(body, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=regather)
    h = x
    for w, b in params:
        h = step(h, w, b)
    return fshard.gather(h).square().sum()


def _train(regather: bool, body=_block, steps: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses and the parameters' gradients of ``steps`` SGD steps, then the parameters."""
    params, x = _params(), _x()
    leaves = optree.tree_leaves(params)
    opt = torch.optim.SGD(leaves, lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(params, x, regather, body)
        loss.backward()
        losses.append(loss.detach())
        grads += [t.grad.clone() for t in leaves]
        opt.step()
    return losses + grads, [t.detach().clone() for t in leaves]


@pytest.mark.parametrize("body", [_block, _checkpointed], ids=["plain", "checkpoint"])
def test_regather_is_bit_identical_to_keeping_the_gathered_copies(body):
    kept, kept_params = _train(False, body)
    again, again_params = _train(True, body)
    assert all(torch.equal(a, b) for a, b in zip(kept, again))
    assert all(torch.equal(a, b) for a, b in zip(kept_params, again_params))
    assert not _regather._ENTRIES  # nothing registered outlives its step


def test_the_gathered_blocks_are_dead_once_the_forward_returns():
    refs: dict[bool, list[weakref.ref[torch.Tensor]]] = {False: [], True: []}

    def body(h, w, b):
        # The tensors that hold the gathered memory (a block may be a view of one: its base holds it).
        refs[regather] += [weakref.ref(t if t._base is None else t._base) for t in (w, b)]
        return _block(h, w, b)

    params, x = _params(), _x()
    losses = []
    for regather in (False, True):
        loss = _loss(params, x, regather, body)
        gc.collect()
        alive = sum(r() is not None for r in refs[regather])
        assert len(refs[regather]) == 2 * BLOCKS * len(R)
        # Kept: every weight (the linear's backward needs it; the bias is used by no saved formula).
        assert alive == (BLOCKS * len(R) if not regather else 0)
        losses.append(loss)
    sum(losses).backward()


def test_the_backward_moves_each_block_again_once_and_holds_at_most_two():
    params, x = _params(), _x()
    seen: list[int] = []

    def body(h, w, b):
        h = h + 0 * w.sum()  # every block's input depends on its weights: a hook sees each block's backward
        h.register_hook(lambda g: seen.append(_regather.live_groups()) or g)
        return _block(h, w, b)

    loss = _loss(params, x, True, body)
    before, ahead = _regather.regathers(), _regather.prefetched()
    loss.backward()
    assert _regather.regathers() - before == BLOCKS
    # Each block but the last (whose backward comes first) was launched ahead, by the block after it.
    assert _regather.prefetched() - ahead == BLOCKS - 1
    assert seen
    assert max(seen) == 2  # the copy in use and the one in flight, never more
    assert _regather.live_groups() == 0
    loss = _loss(params, x, False, body)
    loss.backward()
    assert _regather.regathers() - before == BLOCKS  # without the setting, nothing moves again


def test_the_block_before_has_landed_when_a_blocks_gradients_go_to_their_shards(monkeypatch):
    """The block before's movement, launched as a block's backward starts, lands when that backward is done with it.

    So the sum of the block's gradients to their shards runs beside one landed copy, not
    beside a movement in flight (whose message buffers it would add to the peak).
    """
    params, x = _params(), _x()
    backend = params[0][0].backend
    loss = _loss(params, x, True)
    seen: list[tuple[int, int]] = []
    execute = type(backend).execute

    def recorded(self, plan, tensors, like):
        # A block's gradients summed: its weight's and bias's, packed in one flat array (as across processes).
        if plan.src.partial is not None and plan.src.shape == (D * D + D,):
            seen.append((_regather.in_flight(), _regather.live_groups()))
        return execute(self, plan, tensors, like)

    monkeypatch.setattr(type(backend), "execute", recorded)
    loss.backward()
    # Each block's (the last block's first), with the block before landed: nothing in flight,
    # and the landed copy the one group holding data (the block's own copy is dropped by then);
    # the first block's, with no block before it.
    assert seen == [(0, 1), (0, 1), (0, 0)]
    assert _regather.in_flight() == _regather.live_groups() == 0


def test_a_retained_graph_moves_again_in_each_backward():
    params, x = _params(), _x()
    leaves = optree.tree_leaves(params)
    kept = _loss(params, x, False)
    kept.backward(retain_graph=True)
    kept.backward()
    want = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss = _loss(params, x, True)
    before = _regather.regathers()
    loss.backward(retain_graph=True)
    loss.backward()
    assert _regather.regathers() - before == 2 * BLOCKS
    assert all(torch.equal(t.grad, g) for t, g in zip(leaves, want))


def test_under_torch_func_the_copies_are_kept_and_the_gradients_agree():
    params, x = _params(), _x()
    leaves, tree = optree.tree_flatten(params)

    def loss_of(regather):
        return lambda ls: _loss(optree.tree_unflatten(tree, ls), x, regather)

    before = _regather.regathers()
    got = torch.func.grad(loss_of(True))(leaves)
    assert _regather.regathers() == before
    want = torch.func.grad(loss_of(False))(leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        pairs = (torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, D)) for _ in range(BLOCKS))
        self.blocks = torch.nn.ModuleList(pairs)
        self.double()


def test_apply_module_regathers_each_block_bit_identically():
    net = _Net()
    per_block = [fshard.shard_module(block, fshard.fully_sharded(R))[0] for block in net.blocks]
    x = _x()

    def run(regather):
        for t in optree.tree_leaves(per_block):
            t.requires_grad_().grad = None
        h = x
        for block, p in zip(net.blocks, per_block):
            h, _ = fshard.apply_module(block, p, {}, h, regather=regather)
        loss = fshard.gather(h).square().sum()
        loss.backward()
        return [loss.detach()] + [t.grad.clone() for t in optree.tree_leaves(per_block)]

    kept = run(False)
    before = _regather.regathers()
    again = run(True)
    assert _regather.regathers() - before == BLOCKS
    assert all(torch.equal(a, b) for a, b in zip(kept, again))


def test_regather_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape("shard_map() regather must be a bool, got 1 (int)")):
        fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=1)


def test_sources_written_before_the_backward_are_refused():
    params, x = _params(), _x()
    loss = _loss(params, x, True)
    with torch.no_grad():
        params[-1][0].addressable_data[0].mul_(2)  # an optimizer step before the backward
    with pytest.raises(fshard.SpecError, match=r"regather=True: an argument's shard tensor .* written in place"):
        loss.backward()


def test_regather_where_some_rank_runs_no_body_is_refused():
    backend = LocalBackend(world_size=4)
    two = fshard.Chunk(0, [0, 1])
    w = fshard.shard(torch.ones(D, D), two, backend=backend)
    x = fshard.shard(torch.ones(4, D), two, backend=backend)
    step = fshard.shard_map(lambda h, w: h @ w, in_specs=(two, fshard.Replicated([0, 1])), out_specs=two, regather=True)
    with pytest.raises(fshard.SpecError, match=re.escape("regather=True: ranks [2, 3] hold no block")):
        step(x, w)


class _Probe(torch.autograd.Function):
    """Identity; its backward (the first of its block's backward) calls ``seen()``."""

    @staticmethod
    def forward(ctx, t, seen):
        ctx.seen = seen
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.seen()
        return g, None


def test_each_blocks_gradients_are_reduced_before_the_previous_blocks_backward():
    """Per-block moves: block k's gradients reach its shards (the reduce-scatter) before block k-1's backward starts."""
    params, x = _params(), _x()
    done: list[list[bool]] = []

    def body(h, w, b):
        out = _block(h, w, b)
        return _Probe.apply(out, lambda: done.append([p[0].addressable_data[0].grad is not None for p in params]))

    _loss(params, x, True, body).backward()
    # The probes run once per placement, the last block's first; each block's shards hold their
    # gradient once the next block's backward (on every placement) is done.
    firsts = done[:: len(R)]
    assert firsts == [[False, False, False], [False, False, True], [False, True, True]]
    assert all(t.grad is not None for t in optree.tree_leaves(params))


def _mixed_loss(regather: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """A float32 model whose blocks compute in bfloat16 (``Precision(param=bfloat16, reduce=float32)``)."""
    params = [
        (fshard.shard(w.detach().float(), ROWS), fshard.shard(b.detach().float(), ROWS))
        for w, b in ((fshard.gather(w), fshard.gather(b)) for w, b in _params())
    ]
    leaves = optree.tree_leaves(params)
    for t in leaves:
        t.requires_grad_()
    precision = fshard.Precision(param=torch.bfloat16, reduce=torch.float32)
    step = fshard.shard_map(
        lambda h, w, b: _block(h.to(torch.bfloat16), w, b).float(),
        in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS,
        precision=(None, precision, precision), regather=regather,
    )  # fmt: skip
    before = _regather.regathers()
    h = fshard.shard(fshard.gather(_x()).detach().float().requires_grad_(), ROWS)  # every block saves its weights
    for w, b in params:
        h = step(h, w, b)
    loss = fshard.gather(h).square().sum()
    loss.backward()
    grads = [t.grad for t in leaves]
    return loss.detach(), grads, _regather.regathers() - before


def test_regather_in_a_precision_moves_again_in_it_bit_identically():
    """The backward gathers the bfloat16 copies again: the same values as the forward's, one movement per block."""
    want_loss, want_grads, _ = _mixed_loss(regather=False)
    loss, grads, regathers = _mixed_loss(regather=True)
    assert regathers == BLOCKS
    assert torch.equal(loss, want_loss)
    assert all(g.dtype == torch.float32 for g in grads)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_a_backward_leaves_nothing_in_flight_for_a_graph_it_does_not_reach():
    """The first block of a second forward was registered after the last of a first one, whose backward never runs."""
    params, x = _params(), _x()
    unused = _loss(params, x, True)  # its groups stay alive, never moved again
    loss = _loss(params, x, True)
    before = _regather.prefetched()
    loss.backward()
    # The backward launched its own blocks ahead and, past its first block, the unused graph's last one,
    # which it waited for and dropped when it ended.
    assert _regather.prefetched() - before == BLOCKS - 1
    assert _regather.live_groups() == 0
    del unused


def test_a_backward_through_part_of_the_graph_then_the_whole_moves_the_copy_again():
    # The first backward reaches the last block's intermediates only: it lets go of some of that
    # block's gathered tensors and not others. The second, through the retained graph, needs them all.
    stash: list[torch.Tensor] = []

    def body(h, w, b):
        inner = torch.tanh(torch.nn.functional.linear(h, w))
        stash.append(inner)
        return h + inner * b

    results = []
    for regather in (False, True):
        stash.clear()
        params, x = _params(), _x()
        loss = _loss(params, x, regather, body)
        part = torch.autograd.grad(loss, stash[-len(R) :], retain_graph=True)
        loss.backward()
        results.append((part, [t.grad for t in optree.tree_leaves(params)]))
    (part0, grads0), (part1, grads1) = results
    assert all(torch.equal(a, b) for a, b in zip(part0, part1))
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_the_block_before_is_launched_once_half_the_copys_memory_is_let_go(monkeypatch):
    # Two equal weights per block move as one stacked tensor: each rank's pair shares a storage,
    # which is freed only when both are let go. Counted by tensor, half would be "let go" while
    # every storage is alive.
    shares: list[float] = []
    launch = _regather.Group._prefetch_previous

    def recorded(self):
        alive = sum(self.sizes[key] for key, n in self.views.items() if n)
        shares.append(alive / sum(self.sizes.values()))
        return launch(self)

    monkeypatch.setattr(_regather.Group, "_prefetch_previous", recorded)
    g = torch.Generator().manual_seed(0)
    params = [
        [fshard.shard(torch.randn(D, D, generator=g, dtype=torch.float64), ROWS) for _ in range(2)]
        for _ in range(BLOCKS)
    ]
    for t in optree.tree_leaves(params):
        t.requires_grad_()
    step = fshard.shard_map(
        lambda h, w1, w2: h + torch.tanh(h @ w1.T) @ w2.T,
        in_specs=(ROWS, EVERYWHERE, EVERYWHERE),
        out_specs=ROWS,
        regather=True,
    )
    h = _x()
    for w1, w2 in params:
        h = step(h, w1, w2)
    fshard.gather(h).square().sum().backward()
    assert len(shares) >= BLOCKS - 1  # every block but the first launches the one before
    assert all(share <= 0.5 for share in shares)
