"""Inside the ranks: the pending-reduction (``fshard.Partial``) scenarios.

Every rank holds a summand; the result is their sum, reduced by ``fshard.reshard``:

- ``partial-repl``: ``Partial(Replicated(ranks))`` -> ``Replicated(ranks)``, an all-reduce.
  Stated bound: 2(n - 1)·N elements in all. Floor: ``dist.all_reduce`` in place on a
  buffer filled before timing.
- ``partial-chunk``: ``Partial(Replicated(ranks))`` -> ``Chunk(0, ranks)``, a
  reduce-scatter. Stated bound: (n - 1)·N. Floor: ``dist.reduce_scatter_tensor``.
- ``partial-rows-cols``: ``Partial(Named(mesh, ("x", None)))`` (row blocks over ``x``,
  a pending sum over ``y``) -> ``Chunk(1, ranks)``. No collective has these layouts, so
  fshard sends packed contributions by ``all_to_all_single`` and sums what arrives.
  Bound: per element |S| + |D| - 1 - [S and D meet]. Floors: ``all_to_all_single`` and
  ``isend``/``irecv`` with the plan's split sizes.

For the two collective cases, **all_to_all** (a diagnostic, not a floor) sends the
bound's bytes as the packed path would, one ``all_to_all_single`` per phase of the plan,
with no arithmetic. For the reduce-scatter, **fshard packed** (a diagnostic) reshards
to ``Chunk(0)`` over the ranks rotated by one: the same bytes, in a layout that no
collective has, so fshard's packed path runs. DTensor runs ``from_local(t, mesh, [Partial()]).redistribute`` to
``Replicate()``, ``Shard(0)``, or, on the 2-D mesh, ``[Shard(0), Partial()]`` to
``[Shard(1), Shard(1)]``. Summands are small integers, so every sum is exact in float32
whatever the order of the additions, and results are compared with ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import fshard
from fshard.backends.torch_dist._reduce_collective import collective_kind

from .floors import (
    Built,
    Env,
    Impl,
    _alltoall_floor,
    _box,
    _counted,
    _equal_to,
    _grid,
    _p2p_exchange_floor,
    _ready,
    _shards_of,
    _splits,
)

__all__ = ["KEYS", "build_partial"]

KEYS = ("partial-repl", "partial-chunk", "partial-rows-cols")


def _base(side: int) -> Any:
    """Small integers (0 .. 250): sums of a few of them are exact in float32."""
    import torch

    return torch.arange(side * side, dtype=torch.int32).remainder_(251).view(side, side).float()


def _specs(key: str, env: Env) -> tuple[Any, Any]:
    ranks = env.ranks
    if key == "partial-rows-cols":
        mesh = fshard.Mesh(_grid(env.world))
        return fshard.Partial(fshard.Named(mesh, ("x", None))), fshard.Chunk(1, ranks)
    dst = fshard.Replicated(ranks) if key == "partial-repl" else fshard.Chunk(0, ranks)
    return fshard.Partial(fshard.Replicated(ranks)), dst


def build_partial(key: str, side: int, env: Env) -> Built:
    """Prepares scenario ``key`` on a ``side`` x ``side`` float32 matrix (collective: every rank calls it)."""
    import torch

    rank, ranks, shape = env.rank, env.ranks, (side, side)
    src_spec, dst_spec = _specs(key, env)
    src = src_spec.layout(shape)
    base = _base(side)
    summand = base + rank
    x = fshard.from_local_shards_and_layout([fshard.Shard(m, _box(summand, m)) for m in src.shards_on(rank)], src)
    expected = torch.zeros(shape)  # the value: each box's summands added up
    for m in src.shards:
        _box(expected, m).add_(_box(base, m) + m.placement.rank)
    dst = dst_spec.layout(shape)
    p = fshard.plan(src, dst)
    out = Built(tuple(ranks), None, min_elements=p.min_elements_sent, floor_elements=int(p.traffic().sum()))
    kind = collective_kind(p, tuple(ranks), nccl=False)  # the cases run on Gloo
    out.notes["fshard"] = _bound_note(key, len(ranks), side * side, p.min_elements_sent, kind)
    if key != "partial-rows-cols":
        out.min_elements = _stated_bound(key, len(ranks), side * side)
    mine = _box(expected, dst.shards[dst.indices_on(rank)[0]])
    _floors(key, out, p, env, summand, mine)
    out.impls["fshard"] = Impl(lambda _: fshard.reshard(x, dst_spec), check=_shards_of(expected))
    out.fshard_once = _counted(lambda: fshard.reshard(x, dst_spec), x.backend)
    if key != "partial-rows-cols":
        out.impls["all_to_all"] = _phases_alltoall(p, rank, ranks, summand)
        out.notes["all_to_all"] = "the bound's bytes by all_to_all_single per phase, no sums (a diagnostic)"
    if key == "partial-chunk":
        rotated = fshard.Chunk(0, ranks[1:] + ranks[:1])
        out.impls["fshard packed"] = Impl(lambda _: fshard.reshard(x, rotated), check=_shards_of(expected))
        out.notes["fshard packed"] = "reshard to Chunk(0) over rotated ranks: the packed path, same bytes"
    if env.peers:
        out.unsupported["ShardedTensor"] = "no pending reductions"
        out.impls["DTensor"] = _dtensor(key, env, summand, x, mine)
    return out


def _stated_bound(key: str, n: int, numel: int) -> int:
    """(n - 1)·N for the reduce-scatter, 2(n - 1)·N for the all-reduce."""
    return (2 if key == "partial-repl" else 1) * (n - 1) * numel


def _bound_note(key: str, n: int, numel: int, planned: int, kind: str | None) -> str:
    # On Gloo an all-reduce sums on the owners in the local backend's order, then sends their parts to every rank.
    path = "reduce on the owners + parts to all" if kind == "all_reduce" else "packed all_to_all + sums"
    if key == "partial-rows-cols":
        return f"{path}; bound: sum over elements of |S|+|D|-1-[S∩D≠∅]"
    formula = "2(n-1)N" if key == "partial-repl" else "(n-1)N"
    note = f"{path}; bound {formula} = {_stated_bound(key, n, numel):,} elements"
    if planned != _stated_bound(key, n, numel):
        note += f" but the plan's minimum is {planned:,}"
    return note


def _floors(key: str, out: Built, p: Any, env: Env, summand: Any, mine: Any) -> None:
    import torch
    import torch.distributed as dist

    if key == "partial-repl":
        reduce_all = lambda buf: (dist.all_reduce(buf), buf)[1]  # noqa: E731
        out.impls["floor"] = Impl(reduce_all, buffers=summand.clone, check=_equal_to(mine))
        out.floor_op = "all_reduce, in place (bytes of a bandwidth-optimal all-reduce)"
    elif key == "partial-chunk":
        scatter = lambda o: (dist.reduce_scatter_tensor(o, summand), o)[1]  # noqa: E731
        out.impls["floor"] = Impl(scatter, buffers=lambda: torch.empty_like(mine), check=_equal_to(mine))
        out.floor_op = "reduce_scatter_tensor (bytes of a bandwidth-optimal reduce-scatter)"
    else:
        out.impls["floor"] = _alltoall_floor(p, env.rank, env.ranks, summand)
        out.impls["floor p2p"] = _p2p_exchange_floor(p, env.rank, env.ranks, summand)
        out.floor_op, out.p2p_op = "all_to_all_single, the plan's splits", "isend/irecv, one per peer"


def _phases_alltoall(p: Any, rank: int, ranks: list[int], summand: Any) -> Impl:
    """One ``all_to_all_single`` per phase of ``p`` with that phase's split sizes, buffers filled before timing."""
    import torch
    import torch.distributed as dist

    splits = [_splits(phase, rank, ranks) for phase in p.phases]
    flat = summand.reshape(-1)

    def buffers() -> list[tuple[Any, Any]]:  # the sends read the summand in place: it is not written
        return [(flat[: sum(send)], torch.empty(sum(recv))) for send, recv in splits]

    def fn(bufs: list[tuple[Any, Any]]) -> Any:
        for (send, recv), (sendbuf, recvbuf) in zip(splits, bufs):
            dist.all_to_all_single(recvbuf, sendbuf, recv, send)
        return bufs

    return Impl(fn, buffers=buffers)


def _dtensor(key: str, env: Env, summand: Any, x: Any, mine: Any) -> Impl:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    local = x.addressable_shards[0].data
    mesh, before, after = {
        "partial-repl": (env.mesh1, [Partial()], [Replicate()]),
        "partial-chunk": (env.mesh1, [Partial()], [Shard(0)]),
        "partial-rows-cols": (env.mesh2, [Shard(0), Partial()], [Shard(1), Shard(1)]),
    }[key]
    d = DTensor.from_local(local, mesh, before, run_check=False, shape=summand.shape, stride=summand.stride())
    return Impl(lambda _: _ready(d.redistribute(mesh, after)), check=_equal_to(mine))
