"""The pieces every distributed scenario shares.

What a rank times (``Impl``, ``Built``, ``Env``), how results are checked, and the raw-collective floors
(``all_to_all_single``, point-to-point) that fshard is measured against.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from fshard._demo import _uneven

__all__ = ["ITEMSIZE", "Built", "Env", "Impl"]

ITEMSIZE = 4  # float32
PACKED = ("dim0-dim1", "grid-rows", "chunk-repl", "explicit-chunk")  # reshards with a "pack+a2a" reference


def _side(mib: float) -> int:
    """The side of a square float32 matrix of ``mib`` MiB."""
    return max(1, math.isqrt(int(mib * 2**20) // ITEMSIZE))


def _grid(world: int) -> tuple[int, int]:
    """The most square 2-D mesh of ``world`` ranks."""
    a = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    return a, world // a


def _box(t: Any, meta: Any) -> Any:
    """The view of global tensor ``t`` that a shard's box covers."""
    return t[tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))]


def _explicit(shape: tuple[int, int], ranks: list[int]) -> list[Any]:
    """Arbitrary boxes: two row bands split into columns of growing width (1 : 2 : 3 ...)."""
    return _uneven(shape, ranks)


def _even(layout: Any) -> bool:
    """One shard per rank, all the same size (what ``dist.gather``/``scatter`` can move)."""
    return len({s.sizes for s in layout.shards}) == 1 and len(layout.ranks) == len(layout.shards)


def _ready(result: Any) -> Any:
    """Waits for DTensor's asynchronous collectives, so that the timed call includes them."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    out = result._local_tensor if isinstance(result, DTensor) else result
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


@dataclasses.dataclass
class Impl:
    """One implementation: ``fn(state)`` is timed.

    ``setup()`` makes a fresh ``state`` before every call, untimed (ShardedTensor's
    ``reshard`` changes its input). ``buffers()`` allocates what the call writes into
    once, before timing (the floor's buffers, ``gather(out=...)``). ``check(result)``
    compares the first result with the plain tensor. ``calls``: how many operations
    one call of ``fn`` makes in a row (the time per operation is the call's over it).
    """

    fn: Callable[[Any], Any]
    setup: Callable[[], Any] | None = None
    buffers: Callable[[], Any] | None = None
    check: Callable[[Any], bool] | None = None
    calls: int = 1


@dataclasses.dataclass
class Built:
    """A scenario ready to run on this rank."""

    members: tuple[int, ...]
    group: Any
    impls: dict[str, Impl] = dataclasses.field(default_factory=dict)
    unsupported: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    min_elements: int = 0
    floor_elements: int = 0
    floor_op: str = ""
    p2p_op: str = "isend/irecv straight into the output"
    fshard_once: Callable[[], int] = lambda: 0  # one fshard call; returns the elements this rank sent


class Env:
    """What every scenario of one run shares on one rank (created collectively, once)."""

    def __init__(self, world: int, peers: bool) -> None:
        import torch
        import torch.distributed as dist

        self.world, self.peers, self.rank = world, peers, dist.get_rank()
        self.ranks = list(range(world))
        self.group3 = dist.new_group([0, 1, 2]) if world >= 3 else None
        self.mesh1 = self.mesh2 = None
        if peers:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh1 = DeviceMesh("cpu", list(range(world)))
            self.mesh2 = DeviceMesh("cpu", torch.arange(world).view(*_grid(world)))


def _equal_to(expected: Any) -> Callable[[Any], bool]:
    import torch

    return lambda got: bool(torch.equal(_ready(got), expected))


def _shards_of(full: Any) -> Callable[[Any], bool]:
    """Checks a ShardedArray's local shards against the global tensor."""
    import torch

    return lambda arr: all(torch.equal(s.data, _box(full, s.meta)) for s in arr.addressable_shards)


def _counted(fn: Callable[[], Any], backend: Any) -> Callable[[], int]:
    def once() -> int:
        before = backend.counters.elements_sent
        fn()
        return backend.counters.elements_sent - before

    return once


def _splits(p: Any, rank: int, ranks: Sequence[int]) -> tuple[list[int], list[int]]:
    """Elements this rank sends to and receives from each rank of ``ranks`` under plan ``p``."""
    traffic = p.traffic()
    n = traffic.shape[0]
    send = [int(traffic[rank, r]) if max(rank, r) < n else 0 for r in ranks]
    recv = [int(traffic[r, rank]) if max(rank, r) < n else 0 for r in ranks]
    return send, recv


def _alltoall_floor(p: Any, rank: int, ranks: Sequence[int], full: Any) -> Impl:
    """``all_to_all_single`` with the plan's split sizes, on buffers filled before timing."""
    import torch
    import torch.distributed as dist

    send, recv = _splits(p, rank, ranks)

    def buffers() -> tuple[Any, Any]:
        return full.reshape(-1)[: sum(send)].clone(), torch.empty(sum(recv), dtype=full.dtype)

    def fn(state: tuple[Any, Any]) -> Any:
        dist.all_to_all_single(state[1], state[0], recv, send)
        return state[1]

    return Impl(fn, buffers=buffers)


def _p2p_exchange_floor(p: Any, rank: int, ranks: Sequence[int], full: Any) -> Impl:
    """The same split sizes as ``_alltoall_floor``, one ``isend``/``irecv`` per peer."""
    import torch
    import torch.distributed as dist

    send, recv = _splits(p, rank, ranks)
    send_at, recv_at = [0, *itertools.accumulate(send)], [0, *itertools.accumulate(recv)]

    def buffers() -> tuple[Any, Any]:
        return full.reshape(-1)[: sum(send)].clone(), torch.empty(sum(recv), dtype=full.dtype)

    def fn(state: tuple[Any, Any]) -> Any:
        sendbuf, recvbuf = state
        ops = [dist.P2POp(dist.irecv, recvbuf[recv_at[k] : recv_at[k + 1]], r)
               for k, r in enumerate(ranks) if recv[k]]  # fmt: skip
        ops += [dist.P2POp(dist.isend, sendbuf[send_at[k] : send_at[k + 1]], r)
                for k, r in enumerate(ranks) if send[k]]  # fmt: skip
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return recvbuf

    return Impl(fn, buffers=buffers)


def _p2p_gather_floor(array: Any, receivers: Sequence[int], rank: int, full: Any, group: Any) -> Impl:
    """Every piece sent once to each receiver straight into its output (``batch_isend_irecv``).

    A receiver copies its own pieces in while the messages fly.
    """
    import torch
    import torch.distributed as dist

    shards = array.layout.shards
    mine = {s.meta: s.data for s in array.addressable_shards}

    def buffers() -> Any:
        return torch.empty(full.shape, dtype=full.dtype) if rank in receivers else None

    def fn(out: Any) -> Any:
        ops = []
        for m in shards:
            for dst in receivers:
                if m.placement.rank == rank != dst:
                    ops.append(dist.P2POp(dist.isend, mine[m], dst, group))
                elif dst == rank != m.placement.rank:
                    ops.append(dist.P2POp(dist.irecv, _box(out, m), m.placement.rank, group))
        works = dist.batch_isend_irecv(ops) if ops else []
        if rank in receivers:
            for m, t in mine.items():
                _box(out, m).copy_(t)
        for w in works:
            w.wait()
        return out

    return Impl(fn, buffers=buffers, check=_equal_to(full) if rank in receivers else None)


def _p2p_scatter_floor(layout: Any, rank: int, full: Any) -> Impl:
    """Rank 0 sends each other rank its pieces straight from ``full`` and copies its own."""
    import torch
    import torch.distributed as dist

    mine = [s for s in layout.shards if s.placement.rank == rank]

    def buffers() -> Any:
        return [torch.empty(s.sizes, dtype=full.dtype) for s in mine]

    def fn(out: Any) -> Any:
        ops = []
        if rank == 0:
            ops = [dist.P2POp(dist.isend, _box(full, s).contiguous(), s.placement.rank)
                   for s in layout.shards if s.placement.rank != 0]  # fmt: skip
        else:
            ops = [dist.P2POp(dist.irecv, t, 0) for t in out]
        works = dist.batch_isend_irecv(ops) if ops else []
        if rank == 0:
            for s, t in zip(mine, out):
                t.copy_(_box(full, s))
        for w in works:
            w.wait()
        return out

    check = lambda out: all(_equal_to(_box(full, s))(t) for s, t in zip(mine, out))  # noqa: E731
    return Impl(fn, buffers=buffers, check=check)


def _pack_a2a(key: str, local: Any, rank: int, world: int, full: Any, expected: Any) -> Impl | str:
    """The reference a packed ``all_to_all_single`` must reach, written by hand for the case.

    One strided ``copy_`` packs every outgoing box (this rank's own included, which the collective copies to itself),
    one ``all_to_all_single`` receives straight into the output where the received boxes lie back to back there, else
    into a buffer that one strided ``copy_`` unpacks. Buffers are allocated before timing. Returns why not (a string)
    where the case's shape does not divide evenly.
    """
    import torch
    import torch.distributed as dist

    rows, cols = local.shape
    n = world
    if key == "dim0-dim1":  # rows x (n * w) -> (n * rows) x w: column blocks, one per peer
        if cols % n:
            return "columns do not split evenly"
        w = cols // n

        def buffers() -> tuple[Any, Any]:
            return torch.empty(n * rows * w, dtype=local.dtype), torch.empty(n * rows, w, dtype=local.dtype)

        def fn(state: tuple[Any, Any]) -> Any:
            send, out = state
            send.view(n, rows, w).copy_(local.view(rows, n, w).transpose(0, 1))
            dist.all_to_all_single(out.view(-1), send)
            return out

        return Impl(fn, buffers=buffers, check=_equal_to(expected))
    if key == "chunk-repl":  # every peer gets the whole chunk: one broadcast copy packs n of them

        def buffers() -> tuple[Any, Any]:
            return torch.empty(n * rows * cols, dtype=local.dtype), torch.empty(n * rows, cols, dtype=local.dtype)

        def fn(state: tuple[Any, Any]) -> Any:
            send, out = state
            send.view(n, rows, cols).copy_(local.expand(n, rows, cols))
            dist.all_to_all_single(out.view(-1), send)
            return out

        return Impl(fn, buffers=buffers, check=_equal_to(expected))
    if key == "grid-rows":  # an a x b grid block -> b row blocks, one to each rank of the block's mesh row
        b = _grid(world)[1]
        i = rank // b
        if rows % b:
            return "rows do not split evenly"
        r = rows // b
        split_send = [r * cols if q // b == i else 0 for q in range(n)]
        split_recv = [r * cols if q // b == rank // b else 0 for q in range(n)]

        def buffers() -> tuple[Any, Any]:
            return torch.empty(b * r * cols, dtype=local.dtype), torch.empty(r, b * cols, dtype=local.dtype)

        def fn(state: tuple[Any, Any]) -> Any:
            recv, out = state
            dist.all_to_all_single(recv, local.reshape(-1), split_recv, split_send)
            out.view(r, b, cols).copy_(recv.view(b, r, cols).transpose(0, 1))
            return out

        return Impl(fn, buffers=buffers, check=_equal_to(expected))
    return "no hand-written reference for this case"


def _pack_a2a_boxes(src: Any, dst: Any, local: Any, rank: int, world: int, expected: Any) -> Impl | str:
    """``_pack_a2a`` for one box per rank on each side whose pieces are whole rows of the source box.

    For ``Explicit`` bands -> row chunks: the source shard is the send buffer as it is (its
    pieces are row ranges in rank order), and one ``copy_`` per received piece unpacks the
    receive buffer (the pieces are column blocks of unequal widths).
    """
    import torch
    import torch.distributed as dist

    (mine,) = [m for m in src.shards if m.placement.rank == rank]
    (want,) = [m for m in dst.shards if m.placement.rank == rank]
    by_rank = {m.placement.rank: m for m in src.shards}
    target = {m.placement.rank: m for m in dst.shards}
    if len(by_rank) != world or len(target) != world:
        return "needs one box per rank on each side"

    def rows_of(a: Any, b: Any) -> tuple[int, int]:
        lo = max(a.offsets[0], b.offsets[0])
        return lo, max(lo, min(a.offsets[0] + a.sizes[0], b.offsets[0] + b.sizes[0]))

    def cols_overlap(a: Any, b: Any) -> int:
        return max(0, min(a.offsets[1] + a.sizes[1], b.offsets[1] + b.sizes[1]) - max(a.offsets[1], b.offsets[1]))

    if any(cols_overlap(mine, target[q]) != mine.sizes[1] for q in range(world)):
        return "pieces are not whole rows of the source box"
    send = [(lambda lo, hi: (hi - lo) * mine.sizes[1])(*rows_of(mine, target[q])) for q in range(world)]
    pieces = []  # (rows in the output, columns in the output) per source rank, in rank order
    for q in range(world):
        lo, hi = rows_of(by_rank[q], want)
        c0 = by_rank[q].offsets[1] - want.offsets[1]
        pieces.append((slice(lo - want.offsets[0], hi - want.offsets[0]), slice(c0, c0 + by_rank[q].sizes[1])))
    recv = [(p[0].stop - p[0].start) * (p[1].stop - p[1].start) for p in pieces]
    flat = local.reshape(-1)

    def buffers() -> tuple[Any, Any]:
        return torch.empty(sum(recv), dtype=local.dtype), torch.empty(want.sizes, dtype=local.dtype)

    def fn(state: tuple[Any, Any]) -> Any:
        buf, out = state
        dist.all_to_all_single(buf, flat, recv, send)
        at = 0
        for (rows, cols), k in zip(pieces, recv):
            if k:
                out[rows, cols].copy_(buf[at : at + k].view(rows.stop - rows.start, cols.stop - cols.start))
            at += k
        return out

    return Impl(fn, buffers=buffers, check=_equal_to(expected))


def _copies(p: Any, array: Any, rank: int) -> Impl:
    """The memory copies of this rank's part of plan ``p`` that no message does.

    Its local boxes, and the boxes it sends or receives that are not contiguous in their shard (Gloo moves contiguous
    buffers only, so those are packed or unpacked). No communication: next to the floor, it shows what a reshard costs
    beyond the wire.
    """
    import torch

    src = dict(zip(array.layout.indices_on(rank), (s.data for s in array.addressable_shards)))
    dst = {j: torch.empty(p.dst.shards[j].sizes, dtype=array.dtype) for j in p.dst.indices_on(rank)}
    pairs = []
    for k in range(len(p)):
        sr, dr, i, j = int(p.src_rank[k]), int(p.dst_rank[k]), int(p.src_shard[k]), int(p.dst_shard[k])
        lo, size = p.lo[k].tolist(), p.size[k].tolist()
        read = src[i][_slices(lo, size, p.src.shards[i].offsets)] if sr == rank else None
        write = dst[j][_slices(lo, size, p.dst.shards[j].offsets)] if dr == rank else None
        if read is not None and write is not None:
            pairs.append((write, read))
        elif read is not None and not read.is_contiguous():
            pairs.append((torch.empty(size, dtype=array.dtype), read))
        elif write is not None and not write.is_contiguous():
            pairs.append((write, torch.empty(size, dtype=array.dtype)))

    def fn(_: Any) -> int:
        for a, b in pairs:
            a.copy_(b)
        return len(pairs)

    return Impl(fn)


def _slices(lo: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a - o, a - o + n) for a, n, o in zip(lo, size, origin))


def _st_spec(dim: int, ranks: Sequence[int]) -> Any:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def _sharded_tensor(array: Any, group: Any = None) -> Any:
    """A ShardedTensor over the same local tensors as a chunked fshard array (collective)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    local = [
        Shard(s.data, ShardMetadata(list(s.meta.offsets), list(s.meta.sizes), f"rank:{s.meta.placement.rank}/cpu"))
        for s in array.addressable_shards
    ]
    return ShardedTensor._init_from_local_shards(local, *array.shape, process_group=group)


def _fresh_copies(st: Any) -> Callable[[], Any]:
    """New ShardedTensors like ``st`` on the same local tensors, without communication."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    shards, meta, spec, group = list(st.local_shards()), st.metadata(), st._sharding_spec, st._process_group

    def fresh() -> Any:
        out = ShardedTensor._init_from_local_shards_and_global_metadata(
            list(shards), copy.deepcopy(meta), process_group=group
        )
        out._sharding_spec = copy.deepcopy(spec)
        return out

    return fresh


# -- inside the ranks: the scenarios --------------------------------------------------------
