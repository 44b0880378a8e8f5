"""``fshard.prefetch``: a block's argument movement started ahead, taken by the call that moves them.

A fully-sharded model of ``BLOCKS`` blocks, each a ``shard_map`` (or ``apply_module``) whose
parameters move from ``Chunk(0)`` to ``Replicated``. Prefetching each block's parameters
before the block ahead runs must give bit-identical losses, gradients and parameters (float64,
several SGD steps), with and without ``regather``; misuse raises ``SpecError`` naming the
arrays and the fix.
"""

from __future__ import annotations

import gc
import re
import weakref

import optree
import pytest
import torch

import fshard
from fshard._exec import flight as _flight
from fshard._exec import regather as _regather

R = [0, 1, 2, 3]
ROWS, EVERYWHERE = fshard.Chunk(0, R), fshard.Replicated(R)
BLOCKS, D = 3, 8


def _params() -> list[tuple[fshard.ShardedArray, fshard.ShardedArray]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(BLOCKS):
        w = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5
        b = torch.randn(D, generator=g, dtype=torch.float64)
        out.append((fshard.shard(w, ROWS), fshard.shard(b, ROWS)))
    for p in optree.tree_leaves(out):
        p.requires_grad_()
    return out


def _x() -> fshard.ShardedArray:
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    return fshard.shard(x, ROWS)


def _block(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(torch.nn.functional.linear(torch.nn.functional.layer_norm(h, (D,)), w, b))


def _loss(params, x, regather: bool, ahead: bool) -> torch.Tensor:
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=regather)
    if ahead:
        fshard.prefetch(params[0], EVERYWHERE)
    h = x
    for k, (w, b) in enumerate(params):
        if ahead and k + 1 < len(params):
            fshard.prefetch(params[k + 1], EVERYWHERE)  # in flight while block k computes
        h = step(h, w, b)
    assert not _flight.pending()  # every prefetch was taken by its block's call
    return fshard.gather(h).square().sum()


def _train(regather: bool, ahead: bool, steps: int = 2) -> list[torch.Tensor]:
    """Losses and the parameters' gradients of ``steps`` SGD steps, then the parameters."""
    params, x = _params(), _x()
    leaves = optree.tree_leaves(params)
    opt = torch.optim.SGD(leaves, lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(params, x, regather, ahead)
        loss.backward()
        out += [loss.detach(), *(t.grad.clone() for t in leaves)]
        opt.step()
    return out + [t.detach().clone() for t in leaves]


@pytest.mark.parametrize("regather", [False, True], ids=["kept", "regather"])
def test_prefetch_is_bit_identical_to_moving_in_the_call(regather):
    want = _train(regather=False, ahead=False)
    got = _train(regather=regather, ahead=True)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_apply_module_takes_the_prefetched_parameters_bit_identically():
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, D)).double() for _ in range(BLOCKS)]
    x = _x()

    def run(ahead: bool) -> list[torch.Tensor]:
        params = [fshard.shard_module(m, fshard.fully_sharded(R))[0] for m in blocks]
        leaves = [t.requires_grad_() for p in params for a in p.values() for t in a.addressable_data]
        h = x
        for k, (m, p) in enumerate(zip(blocks, params)):
            if ahead and k + 1 < len(params):
                fshard.prefetch(params[k + 1], EVERYWHERE)
            if ahead and k == 0:
                fshard.prefetch(p, EVERYWHERE)
            h, _ = fshard.apply_module(m, p, {}, h, regather=True)
        assert not _flight.pending()
        fshard.gather(h).square().sum().backward()
        return [fshard.gather(h).detach(), *(t.grad for t in leaves)]

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_at_most_one_prefetch_is_in_flight_beside_the_block_in_use():
    params, x = _params(), _x()
    seen: list[int] = []

    def body(h, w, b):
        seen.append(len(_flight.pending()))
        return _block(h, w, b)

    step = fshard.shard_map(body, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=True)
    h = x
    for k, (w, b) in enumerate(params):
        if k + 1 < len(params):
            fshard.prefetch(params[k + 1], EVERYWHERE)
        h = step(h, w, b)
    # Each body (one per placement) saw the next block's movement in flight, the last block none.
    assert seen == [1] * len(R) * (BLOCKS - 1) + [0] * len(R)


def test_the_backward_launches_each_block_ahead_and_holds_at_most_two_groups():
    params, x = _params(), _x()
    loss = _loss(params, x, regather=True, ahead=True)
    before, ahead = _regather.regathers(), _regather.prefetched()
    loss.backward()
    assert _regather.regathers() - before == BLOCKS
    assert _regather.prefetched() - ahead == BLOCKS - 1
    assert _regather.live_groups() == 0


def test_a_prefetch_cancelled_is_not_taken():
    params, x = _params(), _x()
    w, b = params[0]
    ahead = fshard.prefetch(params[0], EVERYWHERE)
    assert ahead.pending
    assert repr(ahead) == "Prefetch(2 arrays, in flight)"
    ahead.cancel()
    assert not ahead.pending
    assert not _flight.pending()
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)
    assert torch.equal(fshard.gather(step(x, w, b)), fshard.gather(_moved_in_the_call(x, w, b)))


def _moved_in_the_call(x, w, b):
    return fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)(x, w, b)


def test_a_prefetch_of_arrays_in_flight_replaces_the_unused_one():
    params = _params()
    x = _x()
    ahead = fshard.prefetch(params[0], EVERYWHERE)
    again = fshard.prefetch(params[0], EVERYWHERE)
    assert (ahead.pending, again.pending) == (False, True)
    assert _flight.pending() == (again._pending,)
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)
    assert torch.equal(fshard.gather(step(x, *params[0])), fshard.gather(_moved_in_the_call(x, *params[0])))
    assert not again.pending


def test_a_step_that_raised_after_its_prefetch_leaves_the_next_step_working():
    params = _params()
    x = _x()
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)

    def train_step(fail: bool) -> torch.Tensor:
        fshard.prefetch(params[0], EVERYWHERE)  # the handle is not kept, as in the docs' loop
        if fail:
            raise ValueError("a bad batch")
        return fshard.gather(step(x, *params[0]))

    with pytest.raises(ValueError, match="a bad batch"):
        train_step(True)
    assert torch.equal(train_step(False), fshard.gather(_moved_in_the_call(x, *params[0])))
    assert not _flight.pending()


@pytest.mark.parametrize(
    ("use", "message"),
    [
        ("other-arrays", "it moves 2 arrays, 1 of them not prefetched, while 1 of the 2 prefetched arrays"),
        ("other-layout", "to shape (8, 8): [0:8, 0:8]@3 [0:8, 0:8]@2 [0:8, 0:8]@1 [0:8, 0:8]@0"),
        ("written-in-place", "a prefetched array's shard tensor was written in place since the prefetch started"),
        ("other-precision", "in precision Precision(param=torch.float32"),
    ],
)
def test_a_call_that_does_not_fit_the_prefetch_raises(use, message):
    params, x = _params(), _x()
    w, b = params[0]
    fshard.prefetch(params[0], EVERYWHERE)
    specs: tuple = (ROWS, EVERYWHERE, EVERYWHERE)
    precision = None
    if use == "other-arrays":
        b = params[1][1]
    elif use == "other-layout":
        specs = (ROWS, fshard.Replicated(R[::-1]), fshard.Replicated(R[::-1]))
    elif use == "written-in-place":
        with torch.no_grad():
            w.addressable_data[0].add_(1)
    else:
        precision = fshard.Precision(param=torch.float32)
    step = fshard.shard_map(_block, in_specs=specs, out_specs=ROWS, precision=precision)
    with pytest.raises(fshard.SpecError, match=re.escape(message)) as info:
        step(x, w, b)
    assert "Prefetch exactly the arrays the next call moves" in str(info.value)
    assert not _flight.pending()  # the prefetched data was dropped


def test_prefetch_refuses_what_is_not_arrays():
    with pytest.raises(fshard.SpecError, match=re.escape("got a Tensor (tensor([1., 1.])): pass the arrays")):
        fshard.prefetch({"w": torch.ones(2)}, EVERYWHERE)
    with pytest.raises(fshard.SpecError, match=re.escape("got a NoneType (None): pass the arrays")):
        fshard.prefetch(None, EVERYWHERE)
    with pytest.raises(fshard.SpecError, match=re.escape("got no arrays")):
        fshard.prefetch({}, EVERYWHERE)


def test_prefetch_of_arrays_in_place_already_moves_nothing():
    a = fshard.shard(torch.ones(4), EVERYWHERE)
    ahead = fshard.prefetch([a], EVERYWHERE)
    assert not ahead.pending
    assert not _flight.pending()


def test_the_prefetched_blocks_are_dead_once_the_forward_returns():
    refs: list[weakref.ref[torch.Tensor]] = []

    def body(h, w, b):
        refs.extend((weakref.ref(w), weakref.ref(b)))
        return _block(h, w, b)

    params, x = _params(), _x()
    step = fshard.shard_map(body, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=True)
    h = x
    for k, (w, b) in enumerate(params):
        fshard.prefetch(params[k], EVERYWHERE)
        h = step(h, w, b)
    loss = fshard.gather(h).square().sum()
    gc.collect()
    assert len(refs) == 2 * BLOCKS * len(R)
    assert sum(r() is not None for r in refs) == 0
    loss.backward()
