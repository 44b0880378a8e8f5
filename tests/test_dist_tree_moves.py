"""Trees of arrays move as one on 4 Gloo processes: one collective per phase and dtype.

The values equal those of moving the leaves one by one; the elements sent equal the sum of
the leaves' minimums; a data-parallel and a fully-sharded step reduce their gradients in one
collective per phase (a reduce-scatter into the shards, not an all-reduce and a slice).
"""

from __future__ import annotations

import pytest
import torch

import fshard
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]


def _counted(fn):
    c = TorchDistBackend().counters
    runs, sent = c.collectives, c.elements_sent
    out = fn()
    return out, c.collectives - runs, c.elements_sent - sent


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "w": fshard.shard(torch.randn(6, 5, generator=g), fshard.Chunk(0, R)),
        "b": fshard.shard(torch.randn(5, generator=g), fshard.Chunk(0, R)),
        "e": fshard.shard(torch.empty(0, 3), fshard.Chunk(0, R)),
        "r": fshard.shard(torch.randn(3, generator=g), fshard.Replicated([1, 2])),  # on other ranks
        "h": fshard.shard(torch.randn(3, 4, generator=g, dtype=torch.float64), fshard.Chunk(0, [1, 2])),
        "c": fshard.shard(torch.randn(4, 6, generator=g), fshard.Chunk(1, R)),  # boxes that are no ranges
    }


def _tree_reshard() -> tuple[list, int, int, int, list]:
    tree = _tree()
    moved, runs, sent = _counted(lambda: fshard.reshard(tree, fshard.Replicated(R)))
    one_by_one, runs_alone, sent_alone = _counted(
        lambda: {k: fshard.reshard(a, fshard.Replicated(R)) for k, a in tree.items()}
    )
    same = [torch.equal(fshard.gather(moved[k]), fshard.gather(one_by_one[k])) for k in tree]
    return same, runs, sent, sent_alone, [runs_alone]


def test_a_tree_moves_in_one_collective_per_dtype_at_the_minimum(dist_pool):
    for same, runs, sent, sent_alone, (runs_alone,) in dist_pool.run(_tree_reshard, timeout=60):
        assert all(same)
        assert sent == sent_alone  # each rank sends what the leaves' plans send, no more
        assert runs == 3  # float32 ranges (w, b, e, r), float64 (h), and c alone
        assert runs_alone == 5  # the empty leaf moves nothing


def _many_alike() -> tuple[bool, int, int, int, bool]:
    g = torch.Generator().manual_seed(1)
    fulls = [torch.randn(8, 4, generator=g) for _ in range(70)]
    rows = {f"p{k}": fshard.shard(t, fshard.Chunk(0, R)) for k, t in enumerate(fulls)}
    cols = [fshard.shard(t, fshard.Chunk(1, R)) for t in fulls[:5]]  # boxes that are no ranges
    moved, runs, sent = _counted(lambda: fshard.reshard({"rows": rows, "cols": cols}, fshard.Replicated(R)))
    same = all(torch.equal(moved["rows"][f"p{k}"].local_tensor(), t) for k, t in enumerate(fulls))
    same = same and all(torch.equal(a.local_tensor(), t) for a, t in zip(moved["cols"], fulls))
    contiguous = all(a.local_tensor().is_contiguous() for a in [*moved["rows"].values(), *moved["cols"]])
    return same, runs, sent, 75 * 32 * 3 // 4, contiguous


def test_many_small_arrays_of_one_layout_move_as_one_stack(dist_pool):
    for same, runs, sent, bound, contiguous in dist_pool.run(_many_alike, timeout=60):
        assert same
        assert contiguous  # each leaf's shard is a contiguous tensor of its own shape
        assert runs == 2  # the 70 row chunks in the flat array, the 5 column chunks as one stack
        assert sent == bound  # each rank sends its quarter of every array to 3 peers


def _one_backend_object() -> tuple[bool, bool, list[list[float]]]:
    a = fshard.shard(torch.arange(4.0), fshard.Chunk(0, R))
    b = fshard.zeros(fshard.Replicated(R), 3)
    c = fshard.shard(torch.arange(4.0) + 10, fshard.Chunk(0, R), backend=TorchDistBackend())  # equal, its own object
    moved = fshard.reshard({"a": a, "b": b, "c": c}, fshard.Replicated(R))
    one = a.backend is b.backend is fshard.backends.default_backend()
    equal = c.backend is not a.backend and c.backend == a.backend
    return one, equal, [moved[k].local_tensor().tolist() for k in "abc"]


def test_arrays_of_the_default_group_share_one_backend_object_and_equal_ones_move_with_them(dist_pool):
    for one, equal, values in dist_pool.run(_one_backend_object, timeout=60):
        assert one  # a tree's leaves then pass the one-backend check by identity, without an equality test each
        assert equal
        assert values == [[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [10.0, 11.0, 12.0, 13.0]]


def _step(style: str) -> tuple[list[float], int, int, int, int]:
    torch.manual_seed(0)
    spec = fshard.Chunk(0, R) if style == "fsdp" else fshard.Replicated(R)
    params = [fshard.randn(spec, 8, 8, seed=k, dtype=torch.float64) for k in range(6)]
    for a in params:
        for t in a.addressable_data:
            t.requires_grad_()
    x = fshard.randn(fshard.Chunk(0, R), 8, 8, seed=99, dtype=torch.float64)

    def body(xb, *ws):
        h = xb
        for w in ws:
            h = torch.tanh(h @ w)
        return h.sum()[None]

    step = fshard.shard_map(body, in_specs=(fshard.Chunk(0, R), *[fshard.Replicated(R)] * 6),
                            out_specs=fshard.Partial(fshard.Replicated(R)))  # fmt: skip
    loss, fwd_runs, fwd_sent = _counted(lambda: step(x, *params))
    _, bwd_runs, bwd_sent = _counted(lambda: fshard.gather(loss).sum().backward())
    grads = [float(t.grad.sum()) for a in params for t in a.addressable_data]
    return grads, fwd_runs, fwd_sent, bwd_runs, bwd_sent


def test_a_fully_sharded_step_gathers_and_reduce_scatters_once(dist_pool):
    n = 6 * 64  # elements of the parameters
    for _, fwd_runs, fwd_sent, bwd_runs, bwd_sent in dist_pool.run(_step, "fsdp", timeout=60):
        # One all-gather of every parameter (x is in place); full copies of the loss: no exchange at the call, only
        # the posted check of what fn returned (two elements, no movement's).
        assert fwd_runs == 2
        assert fwd_sent == 3 * n // 4  # each rank sends its quarter to 3 peers
        # The parameters' gradients: one reduce-scatter (3/4 of them leave each rank), not an all-reduce
        # (3/2 of them); the loss's gradient: 1 element per rank, 3 from the rank that reduced it.
        assert bwd_sent - 3 * n // 4 in (1, 3)
        assert bwd_runs <= 3


def test_a_data_parallel_step_reduces_every_gradient_in_one_collective_per_phase(dist_pool):
    results = dist_pool.run(_step, "dp", timeout=60)
    for grads, fwd_runs, _, bwd_runs, _ in results:
        # Nothing moves, and full copies of the loss need no exchange of result shapes: only the posted check of
        # what fn returned (ended by the backward's first collective).
        assert fwd_runs == 1
        assert bwd_runs <= 4  # the loss's gather, and one all-reduce (two phases) for all 6 gradients
        assert grads == results[0][0]  # every replica holds the total


def test_the_fully_sharded_gradients_are_the_data_parallel_ones(dist_pool):
    dp = dist_pool.run(_step, "dp", timeout=60)[0][0]
    fsdp = [g for r in dist_pool.run(_step, "fsdp", timeout=60) for g in r[0]]
    # Rank r holds rows 2r, 2r+1 of each parameter: the sums of its shards add up to the whole gradients'.
    whole = [sum(fsdp[k + 6 * r] for r in range(4)) for k in range(6)]
    assert torch.allclose(torch.tensor(whole), torch.tensor(dp), rtol=1e-12)


def _mixed_requires_grad() -> tuple[list[bool], list[bool]]:
    """A tree whose leaves of one layout and dtype (stacked into one movement) differ in requires_grad."""
    ranks = [0, 1, 2, 3]
    torch.manual_seed(0)
    a = fshard.shard(torch.randn(8, 2, requires_grad=True), fshard.Chunk(0, ranks))
    b = fshard.shard(torch.randn(8, 2), fshard.Chunk(0, ranks))
    c = fshard.shard(torch.randn(8), fshard.Chunk(0, ranks))
    tree = [a, b, c]
    moved = fshard.reshard(tree, fshard.Replicated(ranks))
    return [x.requires_grad for x in tree], [x.requires_grad for x in moved]


def test_a_leaf_that_needs_no_gradient_moved_with_ones_that_do_gives_one_that_needs_none(dist_pool):
    """As each leaf moved alone, and as on the local backend."""
    local = _mixed_requires_grad()
    assert local == ([True, False, False], [True, False, False])
    assert all(got == local for got in dist_pool.run(_mixed_requires_grad, timeout=120))


def _tree_of_one_holder(dtype_name: str) -> list[list[int]]:
    """A tree of arrays that rank 0 alone holds, in a dtype without an ``add`` (float8, uint16, uint32), replicated."""
    dtype = getattr(torch, dtype_name)
    x = torch.arange(12).reshape(3, 4).to(dtype)
    a = fshard.shard(x, fshard.Single(0), src=0)
    out = fshard.reshard({"x": a, "y": a}, fshard.Replicated([0, 1, 2, 3]))
    return [out[k].addressable_data[0].view(torch.uint8).reshape(-1).tolist() for k in ("x", "y")]


@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "uint16", "uint32"])
def test_a_tree_held_by_one_rank_moves_in_dtypes_without_add(dist_pool, dtype_name):
    want = torch.arange(12).reshape(3, 4).to(getattr(torch, dtype_name)).view(torch.uint8).reshape(-1).tolist()
    assert dist_pool.run(_tree_of_one_holder, dtype_name, timeout=60) == [[want, want]] * 4


def _tree_with_none() -> tuple[bool, bool, bool]:
    tree = {
        "w": fshard.shard(torch.arange(8.0), fshard.Chunk(0, R)),
        "skip": None,
        "b": fshard.shard(torch.ones(4), fshard.Chunk(0, R)),
    }
    moved = fshard.reshard(tree, fshard.Replicated(R))
    got = fshard.gather(tree)
    on_two = fshard.gather(tree, dst=2)
    return (
        moved["skip"] is None and torch.equal(moved["w"].addressable_data[0], torch.arange(8.0)),
        got["skip"] is None and torch.equal(got["w"], torch.arange(8.0)) and torch.equal(got["b"], torch.ones(4)),
        on_two["skip"] is None,
    )


def test_none_in_a_tree_is_kept_across_processes(dist_pool):
    assert dist_pool.run(_tree_with_none, timeout=60) == [(True, True, True)] * 4


def _pending_tree(backend=None) -> dict[str, fshard.ShardedArray]:
    """Pending sums whose summands differ in scale (so that the order of their addition shows in the bits)."""
    pending = fshard.Partial(fshard.Replicated(R))
    out = {}
    for name, n, dtype in (("0", 40, torch.float32), ("a", 1000, torch.float32), ("b", 301, torch.float32),
                           ("c", 17, torch.float32), ("d", 17, torch.float32), ("e", 9, torch.float64)):  # fmt: skip
        layout = (fshard.Partial(fshard.Replicated(R[:2])) if name == "0" else pending).layout((n,))  # first: 2 ranks
        g = torch.Generator().manual_seed(n + ord(name))
        summands = [(torch.randn(n, generator=g) * 10.0**r).to(dtype) for r in R]
        held = range(len(layout.shards)) if backend is not None else layout.indices_on(TorchDistBackend().rank)
        shards = [fshard.Shard(layout.shards[i], summands[i]) for i in held]
        out[name] = fshard.from_local_shards_and_layout(
            shards, layout, **({} if backend is None else {"backend": backend})
        )
    return out


def _pending_tree_moves() -> list[list[torch.Tensor]]:
    """Each leaf of a tree of pending sums reshard to copies, to chunks, and gathered: this rank's tensors."""
    out = []
    for spec in (fshard.Replicated(R), fshard.Chunk(0, R)):
        moved = fshard.reshard(_pending_tree(), spec)
        out.append([moved[k].addressable_data[0] for k in sorted(moved)])
    gathered = fshard.gather(_pending_tree())
    out.append([gathered[k] for k in sorted(gathered)])
    return out


def test_a_tree_of_pending_sums_adds_as_the_local_backend_does(dist_pool):
    """The tree packs alike in one process, so every element has the same owner and its sum the same bits."""
    from fshard.backends.local import LocalBackend

    backend = LocalBackend(world_size=4)
    for rank, got in enumerate(dist_pool.run(_pending_tree_moves, timeout=60)):
        for k, spec in enumerate((fshard.Replicated(R), fshard.Chunk(0, R))):
            moved = fshard.reshard(_pending_tree(backend), spec)
            for name, tensor in zip(sorted(moved), got[k]):
                assert torch.equal(tensor, moved[name].addressable_data[rank]), (spec, name)
        gathered = fshard.gather(_pending_tree(backend))
        for name, tensor in zip(sorted(gathered), got[2]):
            assert torch.equal(tensor, gathered[name]), name
