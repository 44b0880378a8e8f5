"""Pending reductions under torch_dist give the local backend's bits (4 Gloo processes).

A float sum depends on the order of its summands: with 2^24 and ones in float32 (2^8 in
bfloat16), adding a one to the large value first loses it. Every transport of a reduction
(the all-reduce carried behind the headers, the all-reduce of larger data, the packed
all-to-all, the reduce phase by messages) must combine an element's summands as the local
backend does: its owner's own first, then the other ranks' in ascending rank order. Each
rank runs the same movement on the local backend too and compares its own shards bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist

import fshard
from fshard.backends.local import LocalBackend
from fshard.backends.torch_dist import TorchDistBackend

pytestmark = pytest.mark.multiprocess

R = [0, 1, 2, 3]
MESH = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
# The ulp of 1 is 2^-23 in float32 and 2^-7 in bfloat16, so BIG + 1 rounds back to BIG.
BIG = {torch.float32: 2.0**24, torch.bfloat16: 2.0**8, torch.float64: 2.0**53}
# On 4 Gloo processes, a sum from every rank travels behind the headers ("one", "small"), by one
# all-to-all per reduce phase ("medium") or by messages ("large", "tall" in float32). An all-reduce's
# owners split the longest dim: columns (strided parts) except for "tall" (rows, contiguous parts).
SHAPES = {"one": (1, 1), "small": (12, 5), "medium": (64, 96), "large": (512, 1024), "tall": (2048, 256)}

SOURCES = {
    "all": lambda op: fshard.Partial(fshard.Replicated(R), op),
    "subset": lambda op: fshard.Partial(fshard.Replicated([0, 2, 3]), op),
    "trio": lambda op: fshard.Partial(fshard.Replicated([1, 2, 3]), op),
    "rows": lambda op: fshard.Partial(fshard.Named(MESH, ("dp", None)), op),
    "over-tp": lambda op: fshard.Partial(fshard.Named(MESH, (None, None)), op, over="tp"),
    "rows-over-dp": lambda op: fshard.Partial(fshard.Named(MESH, (None, "tp")), op, over="dp"),
}
TARGETS = {
    "replicated": fshard.Replicated(R),
    "chunk0": fshard.Chunk(0, R),
    "chunk1": fshard.Chunk(1, R),
    "subset": fshard.Replicated([1, 2]),
    "trio": fshard.Replicated([1, 2, 3]),
    "single": fshard.Single(3),
}


def _summand(key: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Summand ``key`` of the whole array: BIG, 1, 1 and -BIG, in an order that varies by element."""
    big = BIG[dtype]
    values = torch.tensor([big, 1.0, 1.0, -big], dtype=torch.float64)
    e = torch.arange(shape[0] * shape[1]).reshape(shape)
    step = 1 + 2 * ((e // 7) % 2)  # 1 or 3: each a permutation of four keys
    return values[(key * step + e) % 4].to(dtype)


def _array(source: str, op: str, shape: tuple[int, ...], dtype: torch.dtype, backend) -> fshard.ShardedArray:
    """The pending reduction ``source``: this rank's shards, or all of them on the local backend (replicas alike)."""
    layout = SOURCES[source](op).layout(shape)
    keys = layout.terms.tolist() if layout.terms is not None else list(range(len(layout.shards)))
    mine = range(len(layout.shards)) if isinstance(backend, LocalBackend) else layout.indices_on(dist.get_rank())
    shards = []
    for i in mine:
        m = layout.shards[i]
        box = tuple(slice(o, o + n) for o, n in zip(m.offsets, m.sizes))
        shards.append(fshard.Shard(m, _summand(int(keys[i]), shape, dtype)[box].clone()))
    return fshard.from_local_shards_and_layout(shards, layout, backend=backend)


def _move(a: fshard.ShardedArray, target: str) -> tuple[list[torch.Tensor | None], fshard.Layout | None]:
    """``target``'s result and its layout: the gathered tensor, or the destination shards here (all, locally)."""
    if target == "gather":
        return [fshard.gather(a)], None
    if target.startswith("gather-"):
        return [fshard.gather(a, dst=int(target.removeprefix("gather-")))], None
    out = fshard.reshard(a, TARGETS[target])
    return list(out.addressable_data), out.layout


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (or are both ``None``)."""
    if a is None or b is None:
        return a is b
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _compare(cases: list[tuple[str, str, str, str, str]], group: list[int] | None = None) -> list[str]:
    """Runs each (source, target, dtype, shape, op) here and on the local backend; names those whose bits differ.

    On the process group of ``group``'s ranks where given (the others run nothing).
    """
    me = dist.get_rank()
    backend = TorchDistBackend() if group is None else TorchDistBackend(group=dist.new_group(group))
    if group is not None and me not in group:
        return []
    local = LocalBackend(world_size=4)
    wrong = []
    for source, target, dtype_name, size, op in cases:
        dtype, shape = getattr(torch, dtype_name), SHAPES[size]
        got, _ = _move(_array(source, op, shape, dtype, backend), target)
        ref, layout = _move(_array(source, op, shape, dtype, backend=local), target)
        if target.startswith("gather-") and me != int(target.removeprefix("gather-")):
            ref = [None]
        elif layout is not None:  # this rank's destination shards of all of them
            ref = [ref[i] for i in layout.indices_on(me)]
        same = len(got) == len(ref) and all(_same(a, b) for a, b in zip(got, ref))
        if not same:
            wrong.append(f"{source}->{target} {dtype_name} {size} {op}: {_short(got)} != {_short(ref)}")
    return wrong


def _short(ts: Sequence[torch.Tensor | None]) -> str:
    return str([None if t is None else t.reshape(-1)[:8].tolist() for t in ts])


def _run(dist_pool, cases, group=None, timeout=120):
    results = dist_pool.run(_compare, cases, group, timeout=timeout)
    wrong = sorted({w for rank in results for w in rank})
    assert not wrong, "\n".join(wrong)


GATHERS = ["gather", "gather-0", "gather-2", "replicated"]
ALL_TARGETS = [*GATHERS, "chunk0", "chunk1", "subset", "single"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_sums_from_every_rank_match_local(dist_pool, dtype):
    _run(dist_pool, [("all", t, dtype, size, "sum") for t in ALL_TARGETS for size in ("one", "small")])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_medium_sums_from_every_rank_match_local(dist_pool, dtype):
    _run(dist_pool, [("all", t, dtype, "medium", "sum") for t in ALL_TARGETS])


def test_large_sums_from_every_rank_match_local(dist_pool):
    cases = [("all", t, "float32", "large", "sum") for t in ["gather", "gather-1", "replicated", "chunk1"]]
    _run(dist_pool, [*cases, ("all", "gather", "float32", "tall", "sum"), ("all", "gather", "bfloat16", "tall", "sum")])


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_sums_on_a_sub_group_match_local(dist_pool, size):
    targets = ["gather", "gather-2", "trio"] if size != "large" else ["gather"]
    _run(dist_pool, [("trio", t, d, size, "sum") for t in targets for d in ("float32", "bfloat16")], group=[1, 2, 3])


@pytest.mark.parametrize("source", ["subset", "rows", "over-tp", "rows-over-dp"])
@pytest.mark.parametrize("size", ["small", "medium"])
def test_sums_over_subsets_and_replicas_match_local(dist_pool, source, size):
    _run(dist_pool, [(source, t, d, size, "sum") for t in ALL_TARGETS for d in ("float32", "bfloat16")])


def test_large_sums_over_subsets_and_replicas_match_local(dist_pool):
    _run(dist_pool, [(s, "gather", "float32", "large", "sum") for s in ("subset", "over-tp")])


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_match_local(dist_pool, op):
    cases = [(s, t, "float32", size, op) for s in ("all", "over-tp") for t in GATHERS for size in ("small", "medium")]
    _run(dist_pool, [*cases, ("all", "gather", "bfloat16", "large", op), ("all", "gather", "float32", "tall", op)])


def test_float64_matches_local(dist_pool):
    _run(dist_pool, [("all", t, "float64", size, "sum") for t in GATHERS for size in ("small", "medium")])


def _order_and_cost(size: str) -> tuple[list[float], int]:
    """The float32 example of the design notes: rank r holds {2^24, 1, 1, -2^24}[r] at every element."""
    n = SHAPES[size][0] * SHAPES[size][1]
    layout = fshard.Partial(fshard.Replicated(R)).layout((n,))
    value = torch.full((n,), [2.0**24, 1.0, 1.0, -(2.0**24)][dist.get_rank()])
    p = fshard.from_local_shards_and_layout([fshard.Shard(layout.shards_on(dist.get_rank())[0], value)], layout)
    counters = TorchDistBackend().counters
    before = counters.elements_sent
    out = fshard.gather(p)
    return out[:: max(n // 4, 1)].tolist(), counters.elements_sent - before


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_each_owner_adds_its_own_summand_first(dist_pool, size):
    n = SHAPES[size][0] * SHAPES[size][1]
    results = dist_pool.run(_order_and_cost, size, timeout=120)
    # Rank 3 owns the last quarter and adds -2^24 first: 2^24 - 2^24 + 1 + 1. The others lose the ones.
    assert [r[0] for r in results] == [[0.0, 0.0, 0.0, 2.0]] * 4
    assert sum(r[1] for r in results) == 2 * (len(R) - 1) * n  # the plan's bound: a reduce-scatter and an all-gather


def _prefetched(size: str) -> list[bool]:
    """A pending sum prefetched to Replicated, then taken by shard_map: the bits of the call without the prefetch."""
    backend = TorchDistBackend()
    a = _array("all", "sum", SHAPES[size], torch.float32, backend)
    everywhere = fshard.Replicated(R)
    same = fshard.shard_map(lambda t: t * 1, in_specs=everywhere, out_specs=everywhere)
    plain = same(a).addressable_data[0]
    ahead = fshard.prefetch([a], everywhere)
    taken = same(a).addressable_data[0]
    local = _array("all", "sum", SHAPES[size], torch.float32, LocalBackend(world_size=4))
    return [not ahead.pending, torch.equal(plain, taken), torch.equal(taken, fshard.gather(local))]


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_a_prefetched_pending_sum_gives_the_bits_of_the_call_without_it(dist_pool, size):
    assert dist_pool.run(_prefetched, size, timeout=120) == [[True, True, True]] * 4


def _spread(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A rank's gradient of a block: values over seven orders of magnitude, whose sum depends on the order."""
    g = torch.Generator().manual_seed(100 + rank + 7 * shape[0])
    return torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)


def _tree_over_two_axes() -> list[bool]:
    """Two leaves split over ``fs`` and copied over ``dp``, gathered by one call: each shard's gradient, bit for bit.

    The backward sums the 4 ranks' gradients of each block; across processes the tree moves as one flat array.
    """

    def grads(backend: object) -> list[list[torch.Tensor]]:
        mesh = fshard.Mesh((2, 2), R, axis_names=("dp", "fs"))
        ws = [fshard.shard(torch.zeros(s), fshard.Named(mesh, ("fs", None)), backend=backend) for s in ((6, 4), (3, 4))]
        for w in ws:
            for t in w.addressable_data:
                t.requires_grad_()
        rows = fshard.Chunk(0, R)
        x = fshard.shard(torch.arange(4.0), rows, backend=backend)

        def body(xb: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
            rank = int(xb.item())
            return sum((b * _spread(rank, tuple(b.shape))).sum() for b in blocks)[None]

        everywhere = fshard.Replicated(R)
        f = fshard.shard_map(body, in_specs=(rows, everywhere, everywhere), out_specs=fshard.Partial(everywhere))
        torch.autograd.backward([t.sum() for t in f(x, *ws).addressable_data])
        return [[t.grad for t in w.addressable_data] for w in ws]

    rank = dist.get_rank()
    mesh = fshard.Mesh((2, 2), R, axis_names=("dp", "fs"))
    mine = [fshard.Named(mesh, ("fs", None)).layout(s).indices_on(rank) for s in ((6, 4), (3, 4))]
    here, local = grads(TorchDistBackend()), grads(LocalBackend(world_size=4))
    return [torch.equal(g, local[k][i]) for k in range(2) for g, i in zip(here[k], mine[k])]


def test_a_tree_over_two_mesh_axes_sums_its_gradients_in_the_local_backends_bits(dist_pool):
    assert dist_pool.run(_tree_over_two_axes, timeout=120) == [[True, True]] * 4
