"""Inside the ranks: the inputs, floors, peers and fshard calls of each distributed scenario.

``build(key, mib, env)`` is collective (every rank calls it) and returns what this rank
times: one ``Impl`` per implementation, with how to check its result. See
``benchmarks/dist.py`` for what each implementation is and how it is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fshard
from fshard.backends.torch_dist import TorchDistBackend

from .dist_partial import build_partial
from .floors import (
    PACKED,
    Built,
    Env,
    Impl,
    _alltoall_floor,
    _box,
    _copies,
    _counted,
    _equal_to,
    _even,
    _explicit,
    _fresh_copies,
    _grid,
    _p2p_exchange_floor,
    _p2p_gather_floor,
    _p2p_scatter_floor,
    _pack_a2a,
    _pack_a2a_boxes,
    _ready,
    _sharded_tensor,
    _shards_of,
    _side,
    _st_spec,
)

__all__ = ["build"]


def build(key: str, mib: float, env: Env, calls: int = 1) -> Built:
    """Prepares scenario ``key`` at ``mib`` MiB on this rank (collective: every rank calls it).

    A fixed-cost scenario makes ``calls`` operations per timed call.
    """
    side = _side(mib)
    if key == "fixed-tree":
        return _build_tree(env, calls)
    if key.startswith("fixed"):
        return _build_fixed(key, _full(side), env, calls)
    if key.startswith("partial"):
        return build_partial(key, side, env)
    full = _full(side)
    if key.startswith("gather"):
        return _build_gather(key, full, env)
    if key == "shard-src0":
        return _build_shard(full, env)
    return _build_reshard(key, full, env)


def _full(side: int) -> Any:
    import torch

    return torch.arange(side * side, dtype=torch.float32).view(side, side)


def _repeat(fn: Callable[[Any], Any], calls: int) -> Callable[[Any], Any]:
    """``fn`` called ``calls`` times in a row; the last result."""

    def many(state: Any) -> Any:
        for _ in range(calls - 1):
            fn(state)
        return fn(state)

    return many


TREE_LEAVES = 70  # a tree of this many small arrays (a model's parameters, say) ...
TREE_LEAF = (8, 4)  # ... of this shape, float32


def _build_tree(env: Env, calls: int) -> Built:
    """A tree of ``TREE_LEAVES`` small arrays resharded Chunk(0) -> Replicated, against one of its arrays alone.

    The floor is ``all_to_all_single`` of the tree's bytes, packed before timing; "one leaf" is fshard's
    ``reshard`` of one of the arrays, whose time the tree's is compared with (the fixed cost of a tree).
    """
    import torch

    ranks = env.ranks
    src, dst = fshard.Chunk(0, ranks), fshard.Replicated(ranks)
    fulls = [torch.arange(k, k + TREE_LEAF[0] * TREE_LEAF[1], dtype=torch.float32).view(TREE_LEAF)
             for k in range(TREE_LEAVES)]  # fmt: skip
    tree = {f"w{k}": fshard.shard(t, src) for k, t in enumerate(fulls)}
    one = tree["w0"]
    leaf = fshard.plan(one.layout, dst.layout(TREE_LEAF))
    side = torch.cat(fulls, 1)  # the tree's elements as one array, for the floor's splits
    whole = fshard.plan(src.layout(tuple(side.shape)), dst.layout(tuple(side.shape)))
    out = Built(tuple(ranks), None, min_elements=TREE_LEAVES * leaf.min_elements_sent,
                floor_elements=int(whole.traffic().sum()))  # fmt: skip
    out.floor_op = f"all_to_all_single of the tree's bytes ({TREE_LEAVES} arrays), packed before timing"
    floor = _alltoall_floor(whole, env.rank, ranks, side)

    def check(moved: Any) -> bool:
        return all(torch.equal(moved[f"w{k}"].addressable_data[0], t) for k, t in enumerate(fulls))

    def tree_once(_: Any) -> Any:
        return fshard.reshard(tree, dst)

    def one_once(_: Any) -> Any:
        return fshard.reshard(one, dst)

    out.impls["floor"] = Impl(_repeat(floor.fn, calls), buffers=floor.buffers, calls=calls)
    out.impls["fshard"] = Impl(_repeat(tree_once, calls), check=check, calls=calls)
    first = fulls[0]
    out.impls["one leaf"] = Impl(_repeat(one_once, calls), check=lambda a: torch.equal(a.addressable_data[0], first),
                                 calls=calls)  # fmt: skip
    out.notes["one leaf"] = f"fshard's reshard of one {TREE_LEAF[0]}x{TREE_LEAF[1]} array of the tree"
    out.fshard_once = _counted(lambda: tree_once(None), one.backend)
    return out


def _build_fixed(key: str, full: Any, env: Env, calls: int) -> Built:
    """A small array moved ``calls`` times by fshard and by the raw collective on buffers packed before timing.

    ``reshard`` Chunk(0) -> Chunk(1) against ``all_to_all_single`` with the plan's splits, ``gather`` to all against
    ``all_gather_into_tensor``.
    """
    import torch
    import torch.distributed as dist

    rank, ranks, shape = env.rank, env.ranks, tuple(full.shape)
    x = fshard.shard(full, fshard.Chunk(0, ranks))
    local = x.addressable_shards[0].data
    if key == "fixed-reshard":
        dst_spec = fshard.Chunk(1, ranks)
        dst = dst_spec.layout(shape)
        p = fshard.plan(x.layout, dst)
        out = Built(tuple(ranks), None, min_elements=p.min_elements_sent, floor_elements=int(p.traffic().sum()))
        floor = _alltoall_floor(p, rank, ranks, full)
        out.floor_op = "all_to_all_single of the same bytes, packed before timing"
        check = _shards_of(full)

        def once(_: Any) -> Any:
            return fshard.reshard(x, dst_spec)

    else:
        p = fshard.plan(x.layout, fshard.Replicated(ranks).layout(shape))
        out = Built(tuple(ranks), None, min_elements=p.min_elements_sent, floor_elements=int(p.traffic().sum()))
        gather_all = lambda o: (dist.all_gather_into_tensor(o, local), o)[1]  # noqa: E731
        floor = Impl(gather_all, buffers=lambda: torch.empty_like(full))
        out.floor_op = "all_gather_into_tensor into a buffer allocated before timing"
        check = _equal_to(full)

        def once(_: Any) -> Any:
            return fshard.gather(x)

    out.impls["floor"] = Impl(_repeat(floor.fn, calls), buffers=floor.buffers, check=floor.check, calls=calls)
    out.impls["fshard"] = Impl(_repeat(once, calls), check=check, calls=calls)
    out.fshard_once = _counted(lambda: once(None), x.backend)
    return out


def _build_gather(key: str, full: Any, env: Env) -> Built:
    import torch
    import torch.distributed as dist

    rank, shape = env.rank, tuple(full.shape)
    if key == "gather-uneven":
        members, group, spec = (0, 1, 2), env.group3, fshard.Chunk(0, [0, 0, 1, 1, 2])
    else:
        members, group, spec = tuple(env.ranks), None, fshard.Chunk(0, env.ranks)
    out = Built(members, group)
    if rank not in members:
        return out
    backend = TorchDistBackend(group)
    x = fshard.shard(full, spec, backend=backend)
    dst = None if key == "gather-all" else 0
    receivers = members if dst is None else (dst,)
    target = fshard.Replicated(list(members)) if dst is None else fshard.Single(dst)
    p = fshard.plan(x.layout, target.layout(shape))
    out.min_elements, out.floor_elements = p.min_elements_sent, int(p.traffic().sum())
    local = x.addressable_shards[0].data
    check = _equal_to(full) if rank in receivers else None

    def whole() -> Any:
        return torch.empty(shape, dtype=full.dtype) if rank in receivers else None

    p2p = _p2p_gather_floor(x, receivers, rank, full, group)
    if not _even(x.layout):
        out.impls["floor"], out.floor_op = p2p, "batch_isend_irecv (uneven pieces)"
    elif dst is None:
        gather_all = lambda o: (dist.all_gather_into_tensor(o, local, group=group), o)[1]  # noqa: E731
        out.impls["floor"] = Impl(gather_all, buffers=whole, check=check)
        out.impls["floor p2p"], out.floor_op = p2p, "all_gather_into_tensor"
    else:
        gather_one = lambda o: (dist.gather(local, list(o.chunk(len(members))) if o is not None else None,  # noqa: E731
                                            dst=dst, group=group), o)[1]  # fmt: skip
        out.impls["floor"] = Impl(gather_one, buffers=whole, check=check)
        out.impls["floor p2p"], out.floor_op = p2p, "gather"
    out.impls["fshard"] = Impl(lambda _: fshard.gather(x, dst=dst), check=check)
    out.fshard_once = _counted(lambda: fshard.gather(x, dst=dst), backend)
    if not env.peers:
        return out
    if dst is None:
        out.unsupported["ShardedTensor"] = "gathers to one rank only"
        from torch.distributed.tensor import DTensor, Shard

        d = DTensor.from_local(local, env.mesh1, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        out.impls["DTensor"] = Impl(lambda _: _ready(d.full_tensor()), check=check)
        return out
    st = _sharded_tensor(x, group)
    out.impls["ShardedTensor"] = Impl(lambda o: (st.gather(dst, o), o)[1], buffers=whole, check=check)
    out.unsupported["DTensor"] = (
        "a rank holding two chunks is no DTensor placement"
        if key == "gather-uneven"
        else "no gather to one rank (full_tensor gathers to all)"
    )
    return out


def _build_shard(full: Any, env: Env) -> Built:
    import torch
    import torch.distributed as dist

    rank, ranks, shape = env.rank, env.ranks, tuple(full.shape)
    layout = fshard.Chunk(0, ranks).layout(shape)
    p = fshard.plan(fshard.Single(0).layout(shape), layout)
    out = Built(tuple(ranks), None, min_elements=p.min_elements_sent, floor_elements=int(p.traffic().sum()))
    (mine,) = layout.indices_on(rank)
    expected = _box(full, layout.shards[mine])
    p2p = _p2p_scatter_floor(layout, rank, full)
    if _even(layout):
        parts = list(full.chunk(len(ranks))) if rank == 0 else None

        def piece() -> Any:
            return torch.empty(layout.shards[mine].sizes, dtype=full.dtype)

        scatter = lambda o: (dist.scatter(o, parts, src=0), o)[1]  # noqa: E731
        out.impls["floor"] = Impl(scatter, buffers=piece, check=_equal_to(expected))
        out.impls["floor p2p"], out.floor_op = p2p, "scatter"
    else:
        out.impls["floor"], out.floor_op = p2p, "batch_isend_irecv (uneven pieces)"
    source = full if rank == 0 else None  # the other ranks need not hold the tensor

    def once() -> Any:
        return fshard.shard(source, fshard.Chunk(0, ranks), src=0)

    out.impls["fshard"] = Impl(lambda _: once(), check=_shards_of(full))
    out.fshard_once = _counted(once, TorchDistBackend())
    if env.peers:
        from torch.distributed._shard.api import _shard_tensor
        from torch.distributed.tensor import Shard, distribute_tensor

        spec, first_shard = _st_spec(0, ranks), lambda st: st.local_shards()[0].tensor
        out.impls["ShardedTensor"] = Impl(lambda _: _shard_tensor(full, spec, src_rank=0),
                                          check=lambda st: _equal_to(expected)(first_shard(st)))  # fmt: skip
        out.impls["DTensor"] = Impl(lambda _: _ready(distribute_tensor(full, env.mesh1, [Shard(0)], src_data_rank=0)),
                                    check=_equal_to(expected))  # fmt: skip
        out.notes["ShardedTensor"] = out.notes["DTensor"] = "needs the whole tensor on every rank"
    return out


def _build_reshard(key: str, full: Any, env: Env) -> Built:
    import torch
    import torch.distributed as dist

    rank, ranks, shape = env.rank, env.ranks, tuple(full.shape)
    mesh = fshard.Mesh(_grid(env.world))
    src_spec, dst_spec = {
        "dim0-dim1": (fshard.Chunk(0, ranks), fshard.Chunk(1, ranks)),
        "grid-rows": (fshard.Named(mesh, ("x", "y")), fshard.Named(mesh, (("x", "y"), None))),
        "repl-chunk": (fshard.Replicated(ranks), fshard.Chunk(0, ranks)),
        "chunk-repl": (fshard.Chunk(0, ranks), fshard.Replicated(ranks)),
        "explicit-chunk": (fshard.Explicit(_explicit(shape, ranks)), fshard.Chunk(0, ranks)),
    }[key]
    x = fshard.shard(full, src_spec)
    dst = dst_spec.layout(shape)
    p = fshard.plan(x.layout, dst)
    out = Built(tuple(ranks), None, min_elements=p.min_elements_sent, floor_elements=int(p.traffic().sum()))
    local = x.addressable_shards[0].data
    expected = _box(full, dst.shards[dst.indices_on(rank)[0]])
    if key == "repl-chunk":
        out.impls["floor"] = Impl(lambda o: o.copy_(expected), buffers=lambda: torch.empty_like(expected))
        out.floor_op = "copy_ of the local slice (no messages)"
    elif key == "chunk-repl" and not _even(x.layout):
        out.impls["floor"] = _p2p_gather_floor(x, tuple(ranks), rank, full, None)
        out.floor_op = "batch_isend_irecv (uneven pieces)"
    elif key == "chunk-repl":
        gather_all = lambda o: (dist.all_gather_into_tensor(o, local), o)[1]  # noqa: E731
        out.impls["floor"] = Impl(gather_all, buffers=lambda: torch.empty_like(full), check=_equal_to(full))
        out.impls["floor p2p"] = _p2p_gather_floor(x, tuple(ranks), rank, full, None)
        out.floor_op = "all_gather_into_tensor"
    else:
        out.impls["floor"] = _alltoall_floor(p, rank, ranks, full)
        out.impls["floor p2p"] = _p2p_exchange_floor(p, rank, ranks, full)
        out.floor_op, out.p2p_op = "all_to_all_single, the plan's splits", "isend/irecv, one per peer"
    if key == "explicit-chunk":
        ref = _pack_a2a_boxes(x.layout, dst, local, rank, env.world, expected)
    else:
        ref = _pack_a2a(key, local, rank, env.world, full, expected) if key in PACKED else "nothing crosses ranks"
    if isinstance(ref, Impl):
        out.impls["pack+a2a"] = ref
    else:
        out.unsupported["pack+a2a"] = ref
    out.impls["fshard"] = Impl(lambda _: fshard.reshard(x, dst_spec), check=_shards_of(full))
    out.impls["copies"] = _copies(p, x, rank)
    out.fshard_once = _counted(lambda: fshard.reshard(x, dst_spec), x.backend)
    if not env.peers:
        return out
    if key == "dim0-dim1" and not (_even(x.layout) and _even(dst)):
        out.unsupported["ShardedTensor"] = "reshard needs equal chunks on Gloo (it scatters them)"
    elif key == "dim0-dim1":
        new_spec = _st_spec(1, ranks)
        out.impls["ShardedTensor"] = Impl(lambda st: st.reshard(new_spec), setup=_fresh_copies(_sharded_tensor(x)),
                                          check=lambda st: _equal_to(expected)(st.local_tensor()))  # fmt: skip
    else:
        out.unsupported["ShardedTensor"] = "reshard handles ChunkShardingSpec -> ChunkShardingSpec only"
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dtensors = {
        "dim0-dim1": (env.mesh1, [Shard(0)], [Shard(1)]),
        "grid-rows": (env.mesh2, [Shard(0), Shard(1)], [Shard(0), Shard(0)]),
        "repl-chunk": (env.mesh1, [Replicate()], [Shard(0)]),
        "chunk-repl": (env.mesh1, [Shard(0)], [Replicate()]),
    }
    if key not in dtensors:
        out.unsupported["DTensor"] = "arbitrary boxes are no DTensor placement"
        return out
    device_mesh, before, after = dtensors[key]
    d = DTensor.from_local(local, device_mesh, before, run_check=False, shape=full.shape, stride=full.stride())
    out.impls["DTensor"] = Impl(lambda _: _ready(d.redistribute(device_mesh, after)), check=_equal_to(expected))
    if key in ("dim0-dim1", "grid-rows"):
        out.notes["DTensor"] = "on CPU meshes DTensor all-gathers, then keeps its chunk"
    return out
