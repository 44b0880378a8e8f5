"""Every function of DESIGN section 3 under torch_dist on 4 Gloo processes.

Each test checks values against the plain tensor and the elements sent against the
plan's minimum (summed over ranks, each rank counting what it sent).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.local import LOCAL
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

RANKS = [0, 1, 2, 3]
SHAPE = (10, 12)
X = torch.arange(120.0).reshape(SHAPE)


def _counted(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the (elements sent, collectives run) by this rank meanwhile."""
    c = TorchDistBackend().counters
    sent, runs = c.elements_sent, c.collectives
    out = fn(*args, **kwargs)
    return out, c.elements_sent - sent, c.collectives - runs


def _mesh_rows():
    return fshard.Named(fshard.Mesh((2, 2)), ("x", None))


LAYOUTS = {
    "chunk-rows": fshard.Chunk(0, RANKS).layout(SHAPE),
    "chunk-cols": fshard.Chunk(1, RANKS).layout(SHAPE),
    "mesh-grid": fshard.Named(fshard.Mesh((2, 2)), ("x", "y")).layout(SHAPE),
    "rows+replicas": _mesh_rows().layout(SHAPE),
    "two-ranks": fshard.Chunk(0, [2, 3]).layout(SHAPE),
    "replicated": fshard.Replicated(RANKS).layout(SHAPE),
    "eight-on-four": fshard.Chunk(1, [k % 4 for k in range(8)]).layout(SHAPE),
    "uneven": fshard.Explicit(
        [((0, 0), (7, 5), 3), ((0, 5), (7, 7), 1), ((7, 0), (3, 12), 0), ((7, 0), (3, 12), 2)]
    ).layout(SHAPE),
    # Empty boxes may sit anywhere, also running past the shape in a dim where they are not empty.
    "empty-boxes-past-the-end": fshard.Explicit(
        [((0, 0), (10, 12), 1), ((0, 0), (0, 20), 0), ((12, 5), (3, 0), 2)]
    ).layout(SHAPE),
}


def _shard_everywhere(layout):
    x, sent, runs = _counted(fshard.shard, X, layout)
    rank = dist.get_rank()
    for s in x.addressable_shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        assert tuple(s.data.shape) == s.meta.sizes
        assert s.data.numel() == 0 or torch.equal(s.data, X[box])  # an empty box may run past X
        assert s.meta.placement.rank == rank
    return sent, runs


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shard_from_every_rank_sends_nothing(dist_pool, name):
    assert dist_pool.run(_shard_everywhere, LAYOUTS[name]) == [(0, 0)] * 4


def _shard_from(layout, src):
    rank = dist.get_rank()
    x, sent, _ = _counted(fshard.shard, X if rank == src else None, layout, src=src)
    for s in x.addressable_shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        assert torch.equal(s.data, X[box])
    return sent


@pytest.mark.parametrize("name", ["chunk-rows", "chunk-cols", "rows+replicas", "eight-on-four", "uneven"])
def test_shard_from_one_rank_sends_only_needed_boxes(dist_pool, name):
    layout = LAYOUTS[name]
    sent = dist_pool.run(_shard_from, layout, 2)
    single = fshard.Single(2).layout(SHAPE)
    assert sum(sent) == sent[2] == fshard.plan(single, layout).min_elements_sent
    # Each rank other than 2 receives each distinct box it holds, once.
    assert sent[2] == sum(
        int(torch.Size(n).numel())
        for r, _, n in {(s.placement.rank, s.offsets, s.sizes) for s in layout.shards}
        if r != 2
    )


def _gather(layout, dst):
    x = fshard.shard(X, layout)
    full, sent, _ = _counted(fshard.gather, x, dst=dst)
    if dst is None or dist.get_rank() == dst:
        assert torch.equal(full, X)
    else:
        assert full is None
    return sent


@pytest.mark.parametrize("dst", [None, 1])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gather(dist_pool, name, dst):
    layout = LAYOUTS[name]
    sent = dist_pool.run(_gather, layout, dst)
    receivers = RANKS if dst is None else [dst]
    target = fshard.Replicated(receivers).layout(SHAPE)
    assert sum(sent) == fshard.plan(layout, target).min_elements_sent


def _gather_rows(spec, shape, dtype, wires):
    """gather of ``spec`` to every rank, by all_gather on the wire types ``wires`` (None: the default); how many
    ``all_gather_into_tensor`` calls it made."""
    from fshard.backends import torch_dist

    full = (torch.arange(math.prod(shape)).reshape(shape) * 7 % 5 - 2).to(dtype)
    x = fshard.shard(full, spec)
    real, default, calls = torch_dist.all_gather, torch_dist.ALL_GATHER_WIRES, []
    torch_dist.all_gather = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1]
    torch_dist.ALL_GATHER_WIRES = default if wires is None else wires
    try:
        got, sent, runs = _counted(fshard.gather, x)
    finally:
        torch_dist.all_gather, torch_dist.ALL_GATHER_WIRES = real, default
    assert got.dtype == dtype
    assert torch.equal(got, full)
    return len(calls), sent, runs


@pytest.mark.parametrize(
    ("spec", "shape", "gathers"),
    [
        (fshard.Chunk(0, RANKS), (8, 3), True),
        (fshard.Chunk(0, RANKS), (12,), True),
        (fshard.Chunk(0, RANKS[::-1]), (8, 3), False),  # not in group order: one message per box
        (fshard.Chunk(0, RANKS), (10, 3), False),  # 3, 3, 3, 1 rows
    ],
    ids=["rows", "1-d", "reversed", "uneven"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64, torch.bfloat16])
def test_gather_of_equal_rows_in_group_order_is_one_all_gather(dist_pool, spec, shape, gathers, dtype):
    """The NCCL path, run over Gloo: the same code with the wire type allowed."""
    out = dist_pool.run(_gather_rows, spec, shape, dtype, frozenset({"cpu", "cuda"}))
    assert [calls for calls, _, _ in out] == [int(gathers)] * 4
    assert [runs for _, _, runs in out] == [1] * 4
    assert sum(sent for _, sent, _ in out) == 3 * math.prod(shape)  # each element to the 3 other ranks


def test_gather_over_gloo_sends_one_message_per_box(dist_pool):
    """Gloo's all_gather is slower than the messages: equal rows in group order do not use it."""
    out = dist_pool.run(_gather_rows, fshard.Chunk(0, RANKS), (8, 3), torch.float32, None)
    assert [calls for calls, _, _ in out] == [0] * 4


def _reshard(src, dst, dtype):
    x = (X * 7 % 5).to(dtype)
    a = fshard.shard(x, src)
    b, sent, runs = _counted(fshard.reshard, a, dst)
    assert b.layout == dst
    for s in b.addressable_shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        assert s.data.dtype == dtype
        assert torch.equal(s.data, x[box])
    assert torch.equal(fshard.gather(b), x)
    return sent, runs


PAIRS = [
    ("chunk-rows", "chunk-cols"),
    ("chunk-cols", "mesh-grid"),
    ("mesh-grid", "uneven"),
    ("uneven", "rows+replicas"),
    ("chunk-rows", "two-ranks"),
    ("two-ranks", "replicated"),
    ("eight-on-four", "chunk-rows"),
    ("replicated", "eight-on-four"),
    ("rows+replicas", "mesh-grid"),
]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_sends_the_minimum(dist_pool, src, dst):
    a, b = LAYOUTS[src], LAYOUTS[dst]
    out = dist_pool.run(_reshard, a, b, torch.float32)
    p = fshard.plan(a, b)
    assert sum(s for s, _ in out) == p.min_elements_sent
    assert [r for _, r in out] == [1 if p.elements_sent else 0] * 4  # one all_to_all_single, or none


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float16, torch.complex64])
def test_reshard_dtypes(dist_pool, dtype):
    dist_pool.run(_reshard, LAYOUTS["chunk-cols"], LAYOUTS["uneven"], dtype)


def test_reshard_to_a_rank_that_holds_a_box_twice_receives_it_once(dist_pool):
    # Rank 1 holds the bottom half twice (two placements on one rank): it is sent once.
    twice = fshard.Layout(
        SHAPE,
        [
            fshard.ShardMeta((0, 0), (5, 12), 0),
            fshard.ShardMeta((5, 0), (5, 12), fshard.Placement(1, "cpu")),
            fshard.ShardMeta((5, 0), (5, 12), fshard.Placement(1, "cpu:0")),
        ],
    )
    src = LAYOUTS["chunk-cols"]
    out = dist_pool.run(_reshard, src, twice, torch.float32)
    assert sum(s for s, _ in out) == fshard.plan(src, twice).min_elements_sent
    assert fshard.plan(src, twice).min_elements_sent < 2 * 60


def _map_local():
    x = fshard.shard(X, fshard.Chunk(0, RANKS))
    y = fshard.map_local(lambda t: t * 2 + 1, x)
    assert y.layout == x.layout
    assert torch.equal(fshard.gather(y), X * 2 + 1)
    z = fshard.map_local(lambda t: torch.cat([t, -t], dim=1), x)  # grows an unsplit dim
    assert tuple(z.shape) == (10, 24)
    assert torch.equal(fshard.gather(z), torch.cat([X, -X], dim=1))
    w = fshard.map_local(torch.add, x, fshard.shard(X, fshard.Chunk(0, RANKS)))
    assert torch.equal(fshard.gather(w), 2 * X)


def test_map_local(dist_pool):
    dist_pool.run(_map_local)


def _creation():
    rank = dist.get_rank()
    spec = fshard.Chunk(0, RANKS)
    assert torch.equal(fshard.gather(fshard.zeros(spec, 10, 20)), torch.zeros(10, 20))
    assert torch.equal(fshard.gather(fshard.ones(spec, [10, 20])), torch.ones(10, 20))
    full = fshard.full(spec, (10, 20), fill_value=3, dtype=torch.int32)
    assert torch.equal(fshard.gather(full), torch.full((10, 20), 3, dtype=torch.int32))
    e = fshard.empty(spec, 10, 20)
    assert tuple(e.local_tensor().shape) == ((1, 20) if rank == 3 else (3, 20))
    like = fshard.full_like(e, 8.5)
    assert like.layout == e.layout
    assert torch.equal(fshard.gather(like), torch.full((10, 20), 8.5))
    assert torch.equal(fshard.gather(fshard.zeros_like(e)), torch.zeros(10, 20))
    assert fshard.ones_like(e, dtype=torch.int8).dtype == torch.int8
    with pytest.raises(TypeError):
        fshard.empty(spec, "foo")


def test_creation(dist_pool):
    dist_pool.run(_creation)


def _random_is_layout_invariant(seed):
    out = []
    for make in (fshard.rand, fshard.randn):
        reference = fshard.gather(make(fshard.Chunk(1, [0, 1, 2]), 24, 12, seed=seed, backend=LOCAL))
        for spec in (fshard.Chunk(0, RANKS), fshard.Named(fshard.Mesh((2, 2)), ("x", "y")), fshard.Replicated([3])):
            assert torch.equal(fshard.gather(make(spec, 24, 12, seed=seed)), reference)
        x = make(fshard.Chunk(0, RANKS), 24, 12, seed=seed)
        assert torch.equal(
            fshard.gather(fshard.rand_like(x, seed=seed)), fshard.gather(fshard.rand(spec, 24, 12, seed=seed))
        )
        out.append(float(reference.sum()))
    return out


def test_rand_across_processes_equals_local(dist_pool):
    got = dist_pool.run(_random_is_layout_invariant, 11)
    local = [
        float(fshard.gather(m(fshard.Chunk(0, [0, 1]), 24, 12, seed=11)).sum()) for m in (fshard.rand, fshard.randn)
    ]
    assert got == [local] * 4


def _equal_allclose():
    rank = dist.get_rank()
    a = fshard.shard(X, fshard.Chunk(0, RANKS))
    b = fshard.shard(X, fshard.Named(fshard.Mesh((2, 2)), ("x", "y")))
    assert fshard.equal(a, b)
    off = fshard.map_local(lambda t: t + (1.0 if rank == 2 else 0.0), a)  # differs on rank 2 only
    assert not fshard.equal(a, off)
    assert not fshard.equal(off, a)
    near = fshard.map_local(lambda t: t * (1 + 1e-6) + 1e-9, b)
    assert fshard.allclose(a, near)
    assert not fshard.allclose(a, off)
    assert not fshard.equal(a, fshard.shard(X[:5], fshard.Chunk(0, RANKS)))


def test_equal_and_allclose_are_collective(dist_pool):
    dist_pool.run(_equal_allclose)


def _autograd_through_every_movement():
    rank = dist.get_rank()
    x = X.clone().requires_grad_(True)
    a = fshard.shard(x, fshard.Chunk(0, RANKS))
    b = fshard.reshard(a, fshard.Chunk(1, [3, 2, 1, 0]))
    (fshard.gather(b) * X).sum().backward()
    assert torch.equal(x.grad, X)
    # shard from rank 1, gather everywhere: the gradient flows back to rank 1 only.
    y = X.clone().requires_grad_(True) if rank == 1 else None
    c = fshard.shard(y, fshard.Chunk(1, RANKS), src=1)
    fshard.gather(fshard.map_local(lambda t: t * 3, c)).sum().backward()
    if rank == 1:
        assert torch.equal(y.grad, torch.full(SHAPE, 3.0))


def test_autograd_through_every_movement(dist_pool):
    dist_pool.run(_autograd_through_every_movement)


def _reshard_without_alltoall(src, dst):
    """The batched isend/irecv transport, used where a group's backend lacks all_to_all_single."""
    from fshard.backends.torch_dist import _group

    has = _group.has_alltoall
    _group.has_alltoall = lambda name: False
    _group._FACTS.clear()  # the group's facts are read once: read them again, without all_to_all
    try:
        assert not _group.facts(None).alltoall
        return _reshard(src, dst, torch.float32)
    finally:
        _group.has_alltoall = has
        _group._FACTS.clear()


@pytest.mark.parametrize(("src", "dst"), PAIRS[:4], ids=[f"{a}->{b}" for a, b in PAIRS[:4]])
def test_reshard_over_point_to_point_sends_the_minimum(dist_pool, src, dst):
    a, b = LAYOUTS[src], LAYOUTS[dst]
    out = dist_pool.run(_reshard_without_alltoall, a, b)
    assert sum(s for s, _ in out) == fshard.plan(a, b).min_elements_sent


def _norm_tree(backend=None):
    """20 arrays of 5 layouts (row and column chunks, replicas, a pair of ranks, pending sums) and a tensor."""
    kw = {} if backend is None else {"backend": backend}
    specs = [
        fshard.Chunk(0, RANKS),
        fshard.Chunk(1, RANKS),
        fshard.Replicated(RANKS),
        fshard.Chunk(0, [1, 2]),
        fshard.Partial(fshard.Replicated(RANKS)),
    ]
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(20)]
    return {
        "arrays": [fshard.shard(v, specs[k % 5], **kw) for k, v in enumerate(values)],
        "t": torch.full((3,), 2.0, dtype=torch.float64),
    }, values


def _tree_norm_counted():
    tree, _ = _norm_tree()
    norm, _, runs = _counted(fshard.global_norm, tree)
    (clipped, clip_norm), _, clip_runs = _counted(fshard.clip_grad_norm, tree, max_norm=1.0, eps=0.0)
    return norm, runs, clip_norm, clip_runs, fshard.global_norm(clipped)


def _norm_gradients(backend=None):
    """Per block of 4 arrays (chunks, replicas, a pair of ranks): its gradient of half the squared norm; its data."""
    tree, _ = _norm_tree(backend)
    arrays = tree["arrays"][:4]
    blocks = [t.requires_grad_() for a in arrays for t in a.addressable_data]
    (0.5 * fshard.global_norm(arrays) ** 2).backward()
    return [(t.grad, t.detach()) for t in blocks]


def test_global_norm_gives_every_copy_the_gradient(dist_pool):
    """d(|w|^2 / 2)/dw = w on every copy of every box, on each process as on the local backend."""
    for got in [_norm_gradients(LOCAL), *dist_pool.run(_norm_gradients, timeout=120)]:
        assert got
        for grad, data in got:
            assert grad is not None
            assert torch.equal(grad, data)


def test_global_norm_of_a_tree_is_two_collectives_whatever_its_leaves(dist_pool):
    """One movement reduces the tree's pending sums, one sums every rank's squares (each box once)."""
    tree, values = _norm_tree(LOCAL)
    # A pending sum's value is its summands' sum: shard() of a Partial spec puts the value in one summand.
    want = (sum(v.square().sum() for v in values) + 12).sqrt()
    torch.testing.assert_close(fshard.global_norm(tree), want, rtol=1e-14, atol=0)
    for norm, runs, clip_norm, clip_runs, after in dist_pool.run(_tree_norm_counted, timeout=120):
        torch.testing.assert_close(norm, want, rtol=1e-14, atol=0)
        torch.testing.assert_close(clip_norm, want, rtol=1e-14, atol=0)
        assert runs == 2
        # The scaling sends nothing; map_local learns the blocks of an array that some rank holds none of
        # (the 4 on ranks 1 and 2) from the ranks that hold them.
        assert clip_runs == 2 + 4
        torch.testing.assert_close(after, torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)
