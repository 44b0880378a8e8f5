"""``fshard.prefetch`` and the backward prefetch of ``regather=True`` on 4 Gloo processes.

Each block of a fully-sharded model moves its ``Chunk(0)`` parameters to ``Replicated``; with
``fshard.prefetch`` that movement is launched before the block ahead runs and left in flight
(inline with its headers for small blocks, after a round of headers for large ones, one
message per box for a block of one large array). Results must be bit-identical to moving in
the call, match the local backend within float32's tolerance, and send exactly the same
elements in the same number of collectives. Ranks whose prefetches differ raise
``CollectiveMismatchError`` on every rank.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard._base.alloc import use_count
from fshard._exec import flight as _flight
from fshard._exec import regather as _regather
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend, _choice, _guard, _transport, _watch

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
ROWS, EVERYWHERE = fshard.Chunk(0, R), fshard.Replicated(R)
BLOCKS = 3
SIZES = {"small": 8, "large": 128}  # 8: inline with the headers; 128 (64 KiB a weight): a round of headers first


def _weights(d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, generator=g)) for _ in range(BLOCKS)]


def _rows(rank: int, d: int) -> torch.Tensor:
    return torch.randn(2, d, generator=torch.Generator().manual_seed(10 + rank))


def _block(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(torch.nn.functional.linear(torch.nn.functional.layer_norm(h, h.shape[-1:]), w, b))


def _step(backend, x, d: int, ahead: bool, regather: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """The loss, the gradients here, and the collectives, elements, regathers and backward prefetches."""
    params = [(fshard.shard(w, ROWS, backend=backend), fshard.shard(b, ROWS, backend=backend)) for w, b in _weights(d)]
    leaves = [t.requires_grad_() for p in params for a in p for t in a.addressable_data]
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=regather)
    c = backend.counters
    start = (c.collectives, c.elements_sent, _regather.regathers(), _regather.prefetched())
    h = x
    if ahead:
        fshard.prefetch(params[0], EVERYWHERE)
    for k, (w, b) in enumerate(params):
        if ahead and k + 1 < BLOCKS:
            fshard.prefetch(params[k + 1], EVERYWHERE)
        h = step(h, w, b)
    assert not _flight.pending()
    loss = fshard.gather(h).square().sum()
    loss.backward()
    moved = [c.collectives - start[0], c.elements_sent - start[1]]
    again = [_regather.regathers() - start[2], _regather.prefetched() - start[3]]
    return loss.detach(), [t.grad for t in leaves], [*moved, *again]


def _on_rank(d: int, ahead: bool, regather: bool):
    backend = TorchDistBackend()
    x = fshard.from_local_tensor(_rows(backend.rank, d).requires_grad_(), dim=0)
    return _step(backend, x, d, ahead, regather)


def _local(d: int):
    backend = LocalBackend(world_size=4)
    x = fshard.shard(torch.cat([_rows(r, d) for r in R]).requires_grad_(), ROWS, backend=backend)
    loss, grads, _ = _step(backend, x, d, True, True)
    return loss, grads


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("regather", [False, True], ids=["kept", "regather"])
def test_prefetch_on_gloo_is_bit_identical_and_sends_the_same(dist_pool, size, regather):
    d = SIZES[size]
    plain = dist_pool.run(_on_rank, d, False, regather, timeout=120)
    ahead = dist_pool.run(_on_rank, d, True, regather, timeout=120)
    want_loss, want_grads = _local(d)
    for rank, ((loss0, grads0, moved0), (loss1, grads1, moved1)) in enumerate(zip(plain, ahead)):
        assert torch.equal(loss0, loss1)
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
        assert moved1[:3] == moved0[:3]  # the same collectives, elements sent and movements again
        # Backward prefetch: every block moved again but the last (first in the backward) was launched ahead.
        assert moved1[3] == moved0[3] == ((BLOCKS - 1) if regather else 0)
        torch.testing.assert_close(loss1, want_loss)
        for got, want in zip(grads1, want_grads[rank :: len(R)]):  # the local backend holds every rank's shard
            torch.testing.assert_close(got, want)


def _one_large_array() -> list[torch.Tensor]:
    """A block of one 1024 x 1024 weight (1 MiB per box: one message per box), prefetched and used."""
    torch.manual_seed(0)
    w0 = torch.randn(1024, 1024)
    out = []
    for ahead in (False, True):
        w = fshard.shard(w0, ROWS)
        w.addressable_data[0].requires_grad_()
        step = fshard.shard_map(lambda h, wb: h @ wb, in_specs=(ROWS, EVERYWHERE), out_specs=ROWS, regather=True)
        x = fshard.from_local_tensor(torch.ones(2, 1024) * (dist.get_rank() + 1), dim=0)
        if ahead:
            fshard.prefetch([w], EVERYWHERE)
        y = step(x, w)
        fshard.gather(y).sum().backward()
        out += [fshard.gather(y).detach(), w.addressable_data[0].grad]
    return out


def test_a_prefetch_sent_box_by_box_is_bit_identical(dist_pool):
    for y0, g0, y1, g1 in dist_pool.run(_one_large_array, timeout=120):
        assert torch.equal(y0, y1)
        assert torch.equal(g0, g1)


def _what_a_prefetch_holds(d: int) -> list[str]:
    """When a prefetched block's outputs are made, which message buffers it holds in flight and as it unpacks."""
    events: list[str] = []
    buffers: list[tuple[torch.UntypedStorage, int]] = []  # each buffer's memory and elements
    empty, unpack, outputs = _transport.empty, _transport._unpack, _choice.Step.outputs

    def recorded_empty(shape, dtype, device):
        t = empty(shape, dtype, device)
        buffers.append((t.untyped_storage(), t.numel()))
        return t

    def alive() -> list[int]:  # the buffers some tensor (a view, a message in flight) still uses
        return [n for storage, n in buffers if use_count(storage._cdata) > 1]

    def recorded_unpack(runs, buf, tensors):
        # Gloo's worker thread drops a finished collective (and its tensors) a moment after
        # wait() returns: count only what is still held once it has let go.
        deadline = time.monotonic() + 5
        while _watch.held() and time.monotonic() < deadline:
            time.sleep(0.001)
        into = next(k for k, (storage, _) in enumerate(buffers) if storage.data_ptr() == buf.data_ptr())
        events.append(f"unpack with buffers of {alive()} elements alive, receiving into {into}")
        return unpack(runs, buf, tensors)

    def recorded_outputs(self, dtype):
        events.append("outputs")
        return outputs(self, dtype)

    w, b = _weights(d)[0]
    params = (fshard.shard(w, ROWS), fshard.shard(b, ROWS))
    x = fshard.from_local_tensor(_rows(dist.get_rank(), d), dim=0)
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=True)
    _transport.empty, _transport._unpack, _choice.Step.outputs = recorded_empty, recorded_unpack, recorded_outputs
    try:
        fshard.prefetch(params, EVERYWHERE)
        events.append(f"launched with buffers of {alive()} elements alive")
        step(x, *params)
    finally:
        _transport.empty, _transport._unpack, _choice.Step.outputs = empty, unpack, outputs
    return events


# d: what the prefetch holds in flight and as it lands (elements of the message buffers it made).
HOLDS = {
    # Inline with the headers, by one all-to-all: the outputs are made when the call lands it, and
    # the send buffer (0) is gone before the receive buffer (1) is unpacked into them.
    8: [
        "launched with buffers of [54, 54] elements alive",
        "outputs",
        "unpack with buffers of [54] elements alive, receiving into 1",
    ],
    # After a round of headers, by one all-to-all (a rank sends under 1 MiB): the same.
    128: [
        "launched with buffers of [12384, 12384] elements alive",
        "outputs",
        "unpack with buffers of [12384] elements alive, receiving into 1",
    ],
    # A rank sends 3 MiB: by messages, received in place into outputs made at once. The 1 MiB
    # weight rows travel alone, from the shard straight into the outputs; only the bias rows
    # are packed, one message per peer each way (3 peers x 256 elements).
    1024: ["outputs", "launched with buffers of [768, 768] elements alive"],
}


@pytest.mark.parametrize("d", sorted(HOLDS))
def test_a_prefetch_in_flight_holds_its_messages_only(dist_pool, d):
    assert dist_pool.run(_what_a_prefetch_holds, d, timeout=120) == [HOLDS[d]] * len(R)


def _one_token_blocks(d: int) -> list[tuple[str, int]]:
    """Blocks ``h @ w`` (one saved view of the gathered weight per rank): what is in flight in each one's backward."""
    torch.manual_seed(0)
    ws = [fshard.shard(torch.randn(d, d), ROWS) for _ in range(BLOCKS)]
    for w in ws:
        w.addressable_data[0].requires_grad_()
    seen: list[tuple[str, int]] = []

    def body(h, w):
        h = h.view_as(h)
        h.register_hook(lambda g: seen.append(("backward", _regather.in_flight())) or g)
        return h @ w

    execute = TorchDistBackend.execute

    def recorded(self, plan, tensors, like):
        if plan.src.partial is not None and plan.src.shape == (d, d):  # a block's gradients to their shards
            seen.append(("sum", _regather.in_flight()))
        return execute(self, plan, tensors, like)

    step = fshard.shard_map(body, in_specs=(ROWS, EVERYWHERE), out_specs=ROWS, regather=True)
    h = fshard.from_local_tensor(torch.ones(2, d, requires_grad=True), dim=0)
    for w in ws:
        h = step(h, w)
    loss = fshard.gather(h).sum()
    TorchDistBackend.execute = recorded
    try:
        loss.backward()
    finally:
        TorchDistBackend.execute = execute
    return seen


def _two_weight_blocks(d: int) -> list[tuple[str, int, int]]:
    """Blocks ``tanh(h @ w1) @ w2``: in each one's backward, the copy's bytes still held and what is in flight."""
    torch.manual_seed(0)
    ws = [(fshard.shard(torch.randn(d, d), ROWS), fshard.shard(torch.randn(d, d), ROWS)) for _ in range(BLOCKS)]
    for w in ws:
        for a in w:
            a.addressable_data[0].requires_grad_()
    seen: list[tuple[str, int, int]] = []

    def record(where):
        return lambda g: seen.append((where, _regather.held_bytes(), _regather.in_flight())) or g

    def body(h, w1, w2):
        h = h.view_as(h)
        h.register_hook(record("input"))
        m = torch.tanh(h @ w1)
        m.register_hook(record("middle"))
        return m @ w2

    step = fshard.shard_map(body, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS, regather=True)
    h = fshard.from_local_tensor(torch.ones(2, d, requires_grad=True), dim=0)
    for w1, w2 in ws:
        h = step(h, w1, w2)
    fshard.gather(h).sum().backward()
    return seen


def test_a_block_lets_go_of_its_weights_after_their_last_use_and_launches_the_block_before_at_half(dist_pool):
    # The two equal weights move as one stacked tensor, so they share a storage. w2's backward
    # comes first: its storage stays for w1, and nothing flies yet. At w1's use (the last), the
    # storage is let go and the block before is launched.
    d = 16
    both = 2 * d * d * 4
    want = [("middle", both, 0), ("input", 0, 1)] * (BLOCKS - 1) + [("middle", both, 0), ("input", 0, 0)]
    assert dist_pool.run(_two_weight_blocks, d, timeout=120) == [want] * len(R)


def test_the_block_before_stays_in_flight_through_a_blocks_backward_and_lands_before_its_sum(dist_pool):
    # Each block's backward runs with the block before in flight (the last, first in the
    # backward, launched its gather at its one token), and that block has landed by the
    # time this block's gradients are summed to their shards; the first block has no block before.
    want = [("backward", 1), ("sum", 0)] * (BLOCKS - 1) + [("backward", 0), ("sum", 0)]
    assert dist_pool.run(_one_token_blocks, 64, timeout=120) == [want] * len(R)


def _prefetch_elsewhere_on_rank_3(d: int) -> str:
    """Rank 3 prefetches to the ranks reversed, the others to the call's layout: every rank must raise."""
    w, b = _weights(d)[0]
    params = (fshard.shard(w, ROWS), fshard.shard(b, ROWS))
    x = fshard.from_local_tensor(_rows(dist.get_rank(), d), dim=0)
    spec = fshard.Replicated(R[::-1]) if dist.get_rank() == 3 else EVERYWHERE
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)
    return _mismatch(lambda: (fshard.prefetch(params, spec), step(x, *params)))


def _mismatch(fn) -> str:
    """``fn()``'s CollectiveMismatchError message, or "no error"; the prefetches it left in flight dropped."""
    try:
        fn()
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        for p in _flight.pending():
            _flight.drop(p)
    return "no error"


@pytest.mark.parametrize("size", sorted(SIZES))
def test_ranks_whose_prefetches_differ_raise_on_every_rank(dist_pool, size):
    messages = dist_pool.run(_prefetch_elsewhere_on_rank_3, SIZES[size], timeout=60)
    for m in messages:
        assert "called it with different arguments on process group [0, 1, 2, 3], so no data was read" in m, m
        assert "ranks [0, 1, 2] sent " in m, m
        assert "ranks [3] sent " in m, m
        assert "they differ in destination layout)" in m, m


def _prefetch_of_other_arrays_on_rank_0(skip: bool, d: int) -> str:
    """Rank 0 alone prefetches (``skip``: every rank but rank 0 does), the arrays the step moves or others.

    A launched movement's header names it apart from a movement made at once: without that,
    the others' step met rank 0's prefetched round of other arrays of the same layouts and
    took their data (silently wrong), and rank 0 went on to a movement no rank joined.
    """
    (w, b), (w2, b2) = _weights(d)[:2]
    params = (fshard.shard(w, ROWS), fshard.shard(b, ROWS))
    later = (fshard.shard(w2, ROWS), fshard.shard(b2, ROWS))
    x = fshard.from_local_tensor(_rows(dist.get_rank(), d), dim=0)
    step = fshard.shard_map(_block, in_specs=(ROWS, EVERYWHERE, EVERYWHERE), out_specs=ROWS)

    def program() -> None:
        if (dist.get_rank() == 0) != skip:
            fshard.prefetch(params if skip else later, EVERYWHERE)
        if skip or dist.get_rank() != 0:
            step(x, *params)
        else:  # the rank that erred: its next movement checks its launched round once the others met it
            deadline = time.monotonic() + 30
            while not all(r.work.is_completed() for r in _guard._LAUNCHED) and time.monotonic() < deadline:
                time.sleep(0.01)
            fshard.gather(x)

    return _mismatch(program)


@pytest.mark.parametrize("skip", [False, True], ids=["prefetch-on-one-rank", "prefetch-skipped-on-one-rank"])
def test_a_prefetch_that_other_ranks_do_not_make_raises_a_mismatch_on_every_rank(dist_pool, skip):
    messages = dist_pool.run(_prefetch_of_other_arrays_on_rank_0, skip, SIZES["small"], timeout=90)
    for m in messages:
        assert "called it with different arguments on process group [0, 1, 2, 3], so no data was read" in m, m
        assert "ranks [0] sent " in m, m
        assert "ranks [1, 2, 3] sent " in m, m
        assert "they differ in operation" in m, m
    assert dist_pool.run(_gather_back, timeout=60) == [X_SUM] * 4  # the group still works


X_SUM = float(sum(range(4)))


def _gather_back() -> float:
    return float(fshard.gather(fshard.from_local_tensor(torch.tensor([float(dist.get_rank())]), dim=0)).sum())


def _rank_1_skips_its_prefetches() -> str:
    """In check mode: rank 1 runs the program without prefetching, the others prefetch."""
    old = fshard.config(check_collectives=True)
    try:
        _on_rank(8, dist.get_rank() != 1, True)
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    finally:
        fshard.config(check_collectives=old.check_collectives)
        for p in _flight.pending():
            _flight.drop(p)
    return "no error"


def test_in_check_mode_a_rank_that_skips_a_prefetch_raises_on_every_rank(dist_pool):
    for m in dist_pool.run(_rank_1_skips_its_prefetches, timeout=60):
        assert m.startswith(
            "Ranks called different collectives on process group [0, 1, 2, 3]: ranks [0, 2, 3] called prefetch("
        ), m


def _prefetch_a_pending_sum() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pending sum prefetched to full copies and taken by a call: its summand, before and after, and the sum."""
    rank = dist.get_rank()
    layout = fshard.Partial(EVERYWHERE).layout((4,))
    (i,) = layout.indices_on(rank)
    mine = torch.arange(4.0) * (rank + 1)
    before = mine.clone()
    p = fshard.from_local_shards_and_layout([fshard.Shard(layout.shards[i], mine)], layout)
    fshard.prefetch([p], EVERYWHERE)
    total = fshard.shard_map(lambda t: t * 1, in_specs=EVERYWHERE, out_specs=EVERYWHERE)(p)
    return before, mine, total.addressable_data[0]


def test_a_prefetched_pending_sum_leaves_its_summands_as_they_are(dist_pool):
    """The all_reduce of a launched sum writes into a buffer of its own, never into the array's shards."""
    for before, after, total in dist_pool.run(_prefetch_a_pending_sum, timeout=60):
        assert torch.equal(before, after)
        assert torch.equal(total, torch.arange(4.0) * 10)


def _prefetch_then(what: str) -> list[str]:
    """A prefetch whose step goes wrong: its arrays written in place before the call, or the step raising before it."""
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    params, _ = fshard.shard_module(block, fshard.fully_sharded(R))
    opt = torch.optim.SGD([t.requires_grad_() for a in params.values() for t in a.addressable_data], lr=0.1)
    x = fshard.shard(torch.randn(4, 8), ROWS)
    fshard.gather(fshard.apply_module(block, params, {}, x)[0]).sum().backward()
    seen = []
    ahead = fshard.prefetch(params, EVERYWHERE)
    if what == "written":
        opt.step()  # writes the prefetched arrays' shards in place
        try:
            fshard.apply_module(block, params, {}, x)
        except fshard.SpecError as e:
            seen.append("written in place since the prefetch started" in str(e))
    else:
        seen.append(ahead.pending)  # the step stopped here: its call never ran
        fshard.prefetch(params, EVERYWHERE)  # the next step's
        seen.append(ahead.pending)
    y, _ = fshard.apply_module(block, params, {}, x)  # and the next call works
    want = torch.nn.functional.linear(fshard.gather(x), *(fshard.gather(params[n]) for n in ("weight", "bias")))
    seen.append(torch.allclose(fshard.gather(y), want))
    seen.append(not _flight.pending())
    return seen


@pytest.mark.parametrize(("what", "seen"), [("written", [True, True, True]), ("raised", [True, False, True, True])])
def test_a_prefetch_whose_step_went_wrong_raises_or_is_replaced_alike_on_every_rank(dist_pool, what, seen):
    assert dist_pool.run(_prefetch_then, what, timeout=60) == [seen] * 4
