"""Without check mode, ranks that move data with different arguments raise on every rank
(each movement carries a header of its dtype, operation and layouts), and every kind of
movement still gives the right values with the header in its messages."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist._guard import inline_bytes

pytestmark = pytest.mark.multiprocess

RANKS = [0, 1, 2, 3]
X = torch.arange(96.0).reshape(8, 12)
BIG = torch.arange(float(1 << 16)).reshape(256, 256)  # 256 KiB: past the inline bytes, a round of headers first


def _message(fn):
    """``fn()`` with check mode off: the CollectiveMismatchError message it raised, or its result."""
    assert not fshard.config().check_collectives
    try:
        fn()
    except fshard.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def _int32_beside_float32(x):
    dtype = torch.int32 if dist.get_rank() == 3 else torch.float32
    a = fshard.shard(x.to(dtype), fshard.Chunk(0, RANKS))
    return _message(lambda: fshard.gather(a))


def _reversed_chunk_on_one_rank(x):
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    order = [3, 2, 1, 0] if dist.get_rank() == 2 else RANKS
    return _message(lambda: fshard.reshard(a, fshard.Chunk(1, order)))


def _gather_to_different_dst(x):
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    return _message(lambda: fshard.gather(a, dst=dist.get_rank() % 2))


def _gradient_on_some_ranks(x):
    """Blocks that require grad on ranks 0, 1 and 3 only: the reshard's backward would wait for rank 2."""
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    if dist.get_rank() != 2:
        for t in a.addressable_data:
            t.requires_grad_()
    return _message(lambda: fshard.reshard(a, fshard.Chunk(1, RANKS)))


def _result_without_gradient_on_one_rank(x):
    """A body that returns a constant on rank 2 only: the sum's backward, and the weight's, would wait for it."""
    w = fshard.map_local(lambda t: t.detach().requires_grad_(), fshard.shard(torch.ones(()), fshard.Replicated(RANKS)))
    rows = fshard.Chunk(0, RANKS)
    loss_of = fshard.shard_map(
        lambda xb, wb: (xb.sum() * wb)[None] if dist.get_rank() != 2 else torch.zeros(1),
        in_specs=(rows, fshard.Replicated(RANKS)),
        out_specs=fshard.Partial(fshard.Replicated(RANKS)),
    )
    return _message(lambda: fshard.gather(loss_of(fshard.shard(x, rows), w)).sum().backward())


def _no_grad_on_one_rank(x):
    """Rank 3 moves under torch.no_grad(): its blocks require grad, but it records no gradient through the move."""
    a = fshard.map_local(lambda t: t.detach().requires_grad_(), fshard.shard(x, fshard.Chunk(0, RANKS)))
    with torch.no_grad() if dist.get_rank() == 3 else contextlib.nullcontext():
        return _message(lambda: fshard.reshard(a, fshard.Chunk(1, RANKS)))


def _detached_on_one_holder(x):
    """Rows that ranks 0 and 1 hold, whose body detaches its result on rank 1 only: moved onto every rank, the
    gather's backward would run on ranks 0, 2 and 3 (their links follow rank 0's result) and not on rank 1."""
    a = fshard.map_local(lambda t: t.detach().requires_grad_(), fshard.shard(x, fshard.Chunk(0, [0, 1])))
    y = fshard.map_local(lambda t: t * 2 if dist.get_rank() != 1 else (t * 2).detach(), a)
    return _message(lambda: fshard.gather(fshard.reshard(y, fshard.Chunk(0, RANKS))))


def _one_more_leaf_on_one_rank(x):
    """Rank 0 moves a tree with an int64 leaf more (a second movement): its float32 movement carries the tree's
    digest, so every rank raises there, before rank 0's int64 movement would pair with the next call's."""
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    b = fshard.shard(x.long(), fshard.Chunk(0, RANKS))
    tree = {"a": a, "b": b} if dist.get_rank() == 0 else {"a": a}
    first = _message(lambda: fshard.reshard(tree, fshard.Replicated(RANKS)))
    return first if first != "no error" else _message(lambda: fshard.reshard(b, fshard.Replicated(RANKS)))


CASES = {
    # (function, the groups of ranks named, what the message says differs)
    "int32-beside-float32": (_int32_beside_float32, [[0, 1, 2], [3]], "they differ in dtype)"),
    "chunk-reversed-on-one-rank": (_reversed_chunk_on_one_rank, [[0, 1, 3], [2]], "they differ in destination layout)"),
    "gather-dst-0-against-dst-1": (
        _gather_to_different_dst,
        [[0, 2], [1, 3]],
        "operation (or the tree of arrays it moves a part of), destination layout)",
    ),
    "gradient-on-some-ranks": (
        _gradient_on_some_ranks,
        [[0, 1, 3], [2]],
        "they differ in whether it records a gradient)",
    ),
    "one-more-leaf-on-one-rank": (
        _one_more_leaf_on_one_rank,
        [[0], [1, 2, 3]],
        "they differ in operation (or the tree of arrays it moves a part of))",
    ),
    "no-grad-on-one-rank": (_no_grad_on_one_rank, [[0, 1, 2], [3]], "they differ in whether it records a gradient)"),
    "detached-on-one-holder": (
        _detached_on_one_holder,
        [[0, 2, 3], [1]],
        "they differ in whether it records a gradient)",
    ),
}


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_disagree_raise_on_every_rank_without_check_mode(dist_pool, case, size):
    fn, groups, differ = CASES[case]
    messages = dist_pool.run(fn, X if size == "small" else BIG, timeout=60)
    assert len(set(messages)) == len(RANKS), "each rank names itself"
    for m in messages:
        assert "called it with different arguments on process group [0, 1, 2, 3], so no data was read" in m, m
        for ranks in groups:
            assert f"ranks {ranks} sent " in m, m
        assert differ in m, m
    if case == "int32-beside-float32":
        assert re.search(r"ranks \[0, 1, 2\] sent float32, .*; ranks \[3\] sent int32, ", messages[0]), messages[0]
    if "gradient" in differ:  # the fix named
        assert all(
            "sent float32 (recording a gradient), " in m
            and "Set requires_grad_() on the blocks of every rank" in m
            and "detached (t.detach()) on every rank or on none" in m
            for m in messages
        )
    # The group is still usable: nothing was left in flight.
    assert dist_pool.run(_gather_back, timeout=60) == [X.sum().item()] * 4


SHARD_MAP_RECORDING_APART = (
    "shard_map(): ranks [0, 1, 3] return result 0 recording a gradient and ranks [2] return it without one, so their "
    "backwards would differ: its backward may be a collective that every rank must join"
)


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_body_whose_result_records_no_gradient_on_one_rank_raises_at_its_call(dist_pool, size):
    """The check of outcomes that the call posts says which results record a gradient, ended at the next
    collective, before any data of its results moves: every rank raises the same error, naming the ranks."""
    messages = dist_pool.run(_result_without_gradient_on_one_rank, X if size == "small" else BIG, timeout=60)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(SHARD_MAP_RECORDING_APART), messages[0]
    assert "Set requires_grad_() on the blocks of every rank" in messages[0]
    assert dist_pool.run(_gather_back, timeout=60) == [X.sum().item()] * 4


def _gather_back():
    return fshard.gather(fshard.shard(X, fshard.Chunk(1, RANKS))).sum().item()


def _every_movement(x):
    """Each transport with headers in its messages: values, and which round the data took."""
    rank, out = dist.get_rank(), {}
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    out["reshard"] = fshard.gather(fshard.reshard(a, fshard.Chunk(1, [3, 1, 0, 2]))).equal(x)
    out["gather-dst"] = (fshard.gather(a, dst=2) is None) if rank != 2 else fshard.gather(a, dst=2).equal(x)
    src = fshard.shard(x if rank == 1 else torch.empty(0), fshard.Chunk(1, RANKS), src=1)
    out["shard-src"] = fshard.gather(src).equal(x)
    out["replicated"] = fshard.reshard(a, fshard.Replicated(RANKS)).addressable_shards[0].data.equal(x)
    layout = fshard.Partial(fshard.Replicated(RANKS), "sum").layout(x.shape)
    mine = [fshard.Shard(m, x * (rank + 1)) for m in layout.shards_on(rank)]
    summed = fshard.from_local_shards_and_layout(mine, layout)
    out["reduce-chunk"] = fshard.gather(fshard.reshard(summed, fshard.Chunk(0, RANKS))).equal(x * 10)
    half = fshard.shard(x.to(torch.bfloat16), fshard.Chunk(0, RANKS))  # a dtype that numpy lacks
    out["bfloat16"] = fshard.gather(fshard.reshard(half, fshard.Chunk(1, RANKS))).equal(x.to(torch.bfloat16))
    out["reduce-replicated"] = fshard.gather(fshard.reshard(summed, fshard.Replicated(RANKS))).equal(x * 10)
    return out


@pytest.mark.parametrize("x", [X, BIG], ids=["inline", "header-round"])
def test_every_movement_gives_the_right_values_with_headers(dist_pool, x):
    assert X.numel() * 4 <= inline_bytes(4) < BIG.numel() * 4
    got = dist_pool.run(_every_movement, x, timeout=60)
    assert all(all(r.values()) for r in got), got


def _subset_programs():
    """Programs on arrays that ranks 2 and 3 hold no block of, whose results need no gradient on ranks 0 and 1."""
    x = X.clone().requires_grad_()
    pred = fshard.shard(x, fshard.Chunk(0, [0, 1]))
    target = fshard.map_local(lambda t: t.detach() * 0.5, pred)  # a stop-gradient target
    (fshard.gather(pred) - fshard.gather(target)).pow(2).sum().backward()
    hits = fshard.map_local(lambda t: (t > 3).float(), pred)  # a metric, under grad mode, never differentiated
    p = X[:4, :5].clone().requires_grad_()

    def move(v):
        return fshard.gather(fshard.reshard(fshard.shard(p * v, fshard.Chunk(0, [0, 1])), fshard.Chunk(1, RANKS)))

    batched = torch.func.vmap(lambda v: move(v).sum())(torch.arange(15.0).reshape(3, 5))
    return x.grad.sum().item(), fshard.gather(hits).mean().item(), batched.tolist()


def test_ranks_that_hold_no_block_say_nothing_of_gradients(dist_pool):
    """Their link need not follow what the other ranks' function returned: the same values as the local backend."""
    assert dist_pool.run(_subset_programs, timeout=60) == [_subset_programs()] * 4


def _mark(a, ranks):
    """``requires_grad_()`` on the blocks of ``ranks`` that this process holds (every rank's on the local backend)."""
    if a.backend.spans_processes:
        blocks = a.addressable_data if a.backend.rank in ranks else ()
    else:
        blocks = [a.addressable_data[j] for r in ranks for j in a.layout.indices_on(r)]
    for t in blocks:
        t.requires_grad_()


def _same_program(case):
    """One program for either backend (no rank asked): the CollectiveMismatchError's message, or "no error"."""
    rows = fshard.Chunk(0, RANKS)
    a = fshard.shard(X, rows)
    if case == "constant-on-one-shard":  # rank 2's block starts at X[4, 0] = 48: its body returns a constant
        a = fshard.map_local(lambda t: t.detach().requires_grad_(), a)
        loss_of = fshard.shard_map(
            lambda t: t.sum()[None] if t[0, 0] != 48 else torch.zeros(1),
            in_specs=rows,
            out_specs=fshard.Partial(fshard.Replicated(RANKS)),
        )
        return _message(lambda: fshard.gather(loss_of(a)))
    if case == "packed-leaf-on-some-ranks":  # u records on ranks 0, 1, 3, behind v, which records on every rank
        v = fshard.map_local(lambda t: t.detach().requires_grad_(), a)
        u = fshard.map_local(lambda t: t * 2, a)  # (a function's results that differ so are refused at its call)
        _mark(u, [0, 1, 3])
        return _message(lambda: fshard.reshard({"u": u, "v": v}, fshard.Chunk(1, RANKS)))
    _mark(a, RANKS if case == "every-rank" else [0, 1, 3])
    if case == "gather":
        return _message(lambda: fshard.gather(a))
    return _message(lambda: fshard.reshard(a, fshard.Chunk(1, RANKS)))


@pytest.mark.parametrize(
    "case", ["by-hand", "gather", "constant-on-one-shard", "packed-leaf-on-some-ranks", "every-rank"]
)
def test_the_local_backend_refuses_what_processes_refuse(dist_pool, case):
    """Ranks that disagree on recording a gradient through a movement: one program, the same ranks named.

    Also through one leaf of a tree moved as one, where another leaf records on every rank.
    """
    local, across = _same_program(case), dist_pool.run(_same_program, case, timeout=60)
    if case == "every-rank":
        assert local == "no error"
        assert across == ["no error"] * 4
        return
    if case == "constant-on-one-shard":  # refused at the call, before its result moves: one message on both
        assert local.startswith(SHARD_MAP_RECORDING_APART), local
        assert across == [local] * 4
        return
    assert local.startswith("gather(dst=None) of " if case == "gather" else "reshard of "), local
    assert "ranks [0, 1, 3] record a gradient through it and ranks [2] do not" in local, local
    assert "Set requires_grad_() on the blocks of every rank, or on none" in local, local
    packed = case == "packed-leaf-on-some-ranks"
    assert ("one of a tree of 2 moved as one): ranks" in local) is packed, local
    for m in across:
        assert "Set requires_grad_() on the blocks of every rank, or on none" in m, m
        assert "ranks [0, 1, 3] sent float32 (recording a gradient), " in m, m
        if packed:  # the movement records on every rank: its leaves differ
            assert "they differ in which leaves of the tree moved as one record a gradient)" in m, m
            assert "ranks [2] sent float32 (recording a gradient), " in m, m
        else:
            assert "they differ in whether it records a gradient)" in m, m
            assert "ranks [2] sent float32, " in m, m


def test_the_local_backend_names_no_ranks_outside_its_group():
    """As across processes: a group whose ranks do not all hold blocks of the source says nothing of gradients."""
    four, eight = LocalBackend(world_size=4), LocalBackend(world_size=8)
    for backend, refused in ((four, True), (eight, False)):
        a = fshard.shard(X, fshard.Chunk(0, RANKS), backend=backend)
        _mark(a, [0, 1, 3])
        says = _message(lambda a=a: fshard.reshard(a, fshard.Chunk(1, RANKS)))
        assert ("ranks [0, 1, 3] record a gradient through it and ranks [2] do not" in says) is refused, says


def _accepted_alike(case):
    """Programs every rank records a gradient in, as processes see it: a float (the same on either backend)."""
    every = fshard.Replicated(RANKS)
    if case == "packed-leaf-some-ranks-hold":  # moved as one: ranks 2, 3 record through a's link
        p = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).requires_grad_()
        x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) / 10
        a = fshard.shard(p * x, fshard.Chunk(0, [0, 1]))
        b = fshard.shard(x + 1, fshard.Chunk(0, RANKS))  # needs no gradient
        f = fshard.shard_map(lambda u, v: (u * v).sum()[None], in_specs=(every, every), out_specs=fshard.Partial(every))
        fshard.gather(f(a, b)).sum().backward()
        return p.grad.sum().item()
    # global_norm: a replicated weight's history joins every rank's summand of the squares
    w = fshard.shard(torch.tensor([3.0, 4.0], dtype=torch.float64), every)
    blocks = [t.requires_grad_() for t in w.addressable_data]
    (0.5 * fshard.global_norm({"w": w, "b": fshard.shard(torch.arange(8.0), fshard.Chunk(0, RANKS))}) ** 2).backward()
    return sum(t.grad.sum().item() for t in blocks) / len(blocks)


@pytest.mark.parametrize("case", ["packed-leaf-some-ranks-hold", "global-norm"])
def test_what_processes_accept_the_local_backend_accepts(dist_pool, case):
    local = _accepted_alike(case)
    assert local == pytest.approx(7.0 if case == "global-norm" else 16.8, rel=1e-12, abs=0)  # d(|w|^2/2)/dw = w
    assert dist_pool.run(_accepted_alike, case, timeout=60) == [local] * 4
