"""Multi-process benchmarks: fshard on N Gloo processes against ShardedTensor, DTensor and the floor.

``python benchmarks/dist.py`` (or ``python -m fshard bench``, which runs these cases
too) spawns N processes (default 4) on 127.0.0.1 with ``fshard._launch.launch`` and,
for every case, times each implementation of the same data movement:

- **floor**: the raw ``torch.distributed`` call that moves exactly the minimal bytes of
  the case, on buffers allocated (and packed) before timing: ``dist.gather`` of the
  pieces, ``all_gather_into_tensor``, ``all_to_all_single`` with the split sizes of
  ``fshard.plan(src, dst).traffic()``, ``dist.scatter``. Where both exist, **floor
  p2p** moves the same pieces by ``batch_isend_irecv`` straight into the output: on
  Gloo that is often faster than the collective, and the faster of the two is the
  floor every ratio divides by. Pieces of unequal size go by ``batch_isend_irecv``
  only (``dist.gather`` would pad them). Where nothing crosses ranks, the floor is a
  ``copy_`` of the local slice into a buffer allocated before timing.
- **fshard**: ``gather``, ``reshard`` or ``shard(src=0)`` on the ``torch_dist`` backend.
- **ShardedTensor** (``torch.distributed._shard``): ``gather(dst, out)``,
  ``reshard(ChunkShardingSpec)`` (chunk -> chunk only) and ``_shard_tensor(src_rank=0)``.
- **DTensor**: ``full_tensor()``, ``redistribute`` and ``distribute_tensor(src_data_rank=0)``
  on a CPU ``DeviceMesh``.

Timing: every implementation runs once untimed (its result checked against the plain
tensor), then the rounds are interleaved (floor, fshard, ShardedTensor, DTensor, floor,
...). Before each timed call every rank of the case's group waits at a barrier; a
round's time is the slowest rank's, and the table shows the median over rounds.

Bytes sent: fshard's ``backend.counters.elements_sent`` over one call, summed over
ranks, against ``plan.min_elements_sent`` of the same movement (both x 4 bytes).

Peak extra memory: the growth of each process's resident set over one call, the
largest over ranks. Before the call the process frees what it can (``gc.collect``,
fshard's cache of output memory, glibc's ``malloc_trim``) and resets its high-water
mark (``/proc/self/clear_refs``); after it, ``VmHWM - VmRSS(before)`` from
``/proc/self/status``. It counts the result and every temporary buffer that was
written. Buffers that the floor and ``ShardedTensor.gather(out=...)`` are handed
before timing are allocated inside the measured call here, so they count too.

All processes share this machine's cores: 4 ranks on 2 cores take turns, which is the
setting the numbers describe.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` and ``fshard`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["SCENARIOS", "DistCase", "DistSettings", "cases", "main", "run"]

GROUP = "torch_dist"
ITEMSIZE = 4  # float32
GATHER_TARGET = 1.15
RESHARD_TARGET = 1.25
IMPLS = ("floor", "floor p2p", "fshard", "ShardedTensor", "DTensor")
FLOORS = ("floor", "floor p2p")
PEERS = ("ShardedTensor", "DTensor")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A data movement measured in every implementation that supports it."""

    key: str
    title: str
    kind: str  # "gather", "reshard" or "shard": which ratio target applies
    world_min: int = 2

    @property
    def target(self) -> float:
        """The largest fshard / floor ratio that meets the goal (scatter counts as a gather)."""
        return RESHARD_TARGET if self.kind == "reshard" else GATHER_TARGET


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("gather-one", "gather to rank 0, even chunks", "gather"),
    Scenario("gather-uneven", "gather to 0, Chunk(0,[0,0,1,1,2])", "gather", world_min=3),
    Scenario("gather-all", "gather to all ranks", "gather"),
    Scenario("dim0-dim1", "reshard dim 0 -> dim 1", "reshard"),
    Scenario("grid-rows", "reshard 2-D grid -> rows", "reshard"),
    Scenario("repl-chunk", "reshard replicated -> chunk", "reshard"),
    Scenario("chunk-repl", "reshard chunk -> replicated", "reshard"),
    Scenario("explicit-chunk", "reshard explicit -> chunk", "reshard"),
    Scenario("shard-src0", "shard(src=0), dim-0 chunks", "shard"),
)
_BY_KEY = {s.key: s for s in SCENARIOS}


@dataclasses.dataclass(frozen=True)
class DistSettings:
    """What to run: ``world`` processes, square float32 tensors of ``sizes`` MiB, ``reps`` rounds."""

    world: int = 4
    sizes: tuple[float, ...] = (16, 256)
    reps: int = 15
    peers: bool = True
    only: tuple[str, ...] = ()
    timeout: float = 1200.0
    progress: bool = True

    def jobs(self) -> list[tuple[str, float]]:
        """(scenario key, MiB) pairs, smallest size first, filtered by ``only``."""
        return [
            (s.key, mib)
            for mib in self.sizes
            for s in SCENARIOS
            if s.world_min <= self.world and (not self.only or any(o in s.key or o in s.title for o in self.only))
        ]


# -- inside the ranks: inputs, floors, peers ------------------------------------------------


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
    from fshard._demo import _uneven

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
    compares the first result with the plain tensor.
    """

    fn: Callable[[Any], Any]
    setup: Callable[[], Any] | None = None
    buffers: Callable[[], Any] | None = None
    check: Callable[[Any], bool] | None = None


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
    fshard_once: Callable[[], int] = lambda: 0  # one fshard call; returns the elements this rank sent


class _Env:
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


def _alltoall_floor(p: Any, rank: int, ranks: Sequence[int], full: Any) -> Impl:
    """``all_to_all_single`` with the plan's split sizes, on buffers filled before timing."""
    import torch
    import torch.distributed as dist

    traffic = p.traffic()
    n = traffic.shape[0]
    send = [int(traffic[rank, r]) if max(rank, r) < n else 0 for r in ranks]
    recv = [int(traffic[r, rank]) if max(rank, r) < n else 0 for r in ranks]

    def buffers() -> tuple[Any, Any]:
        return full.reshape(-1)[: sum(send)].clone(), torch.empty(sum(recv), dtype=full.dtype)

    def fn(state: tuple[Any, Any]) -> Any:
        dist.all_to_all_single(state[1], state[0], recv, send)
        return state[1]

    return Impl(fn, buffers=buffers)


def _p2p_gather_floor(array: Any, receivers: Sequence[int], rank: int, full: Any, group: Any) -> Impl:
    """Every piece sent once to each receiver straight into its output (``batch_isend_irecv``);
    a receiver copies its own pieces in while the messages fly."""
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


def build(key: str, mib: float, env: _Env) -> Built:
    """Prepares scenario ``key`` at ``mib`` MiB on this rank (collective: every rank calls it)."""
    side = _side(mib)
    full = _full(side)
    if key.startswith("gather"):
        return _build_gather(key, full, env)
    if key == "shard-src0":
        return _build_shard(full, env)
    return _build_reshard(key, full, env)


def _full(side: int) -> Any:
    import torch

    return torch.arange(side * side, dtype=torch.float32).view(side, side)


def _build_gather(key: str, full: Any, env: _Env) -> Built:
    import torch
    import torch.distributed as dist

    import fshard
    from fshard.backends.torch_dist import TorchDistBackend

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


def _build_shard(full: Any, env: _Env) -> Built:
    import torch
    import torch.distributed as dist

    import fshard
    from fshard.backends.torch_dist import TorchDistBackend

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


def _build_reshard(key: str, full: Any, env: _Env) -> Built:
    import torch
    import torch.distributed as dist

    import fshard

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
        out.floor_op = "copy_ of the local slice (nothing crosses ranks)"
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
        out.floor_op = "all_to_all_single (the plan's split sizes)"
    out.impls["fshard"] = Impl(lambda _: fshard.reshard(x, dst_spec), check=_shards_of(full))
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


# -- inside the ranks: timing and memory (every rank makes the same collective calls) ----------


def _timed_call(impl: Impl, state: Any, group: Any) -> float:
    import torch.distributed as dist

    dist.barrier(group=group)
    gc.disable()  # a collection pause would land on whichever call happens to trigger it
    try:
        start = time.perf_counter()
        result = impl.fn(state)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    del result  # freed outside the timed region
    return elapsed


def _status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        text = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":")))
    return None


def _reset_peak() -> bool:
    """Sets this process's resident-set high-water mark to its current size (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


_LIBC: Any = None


def _trim() -> None:
    """Frees what this process holds but does not use, so the next call's growth is its own."""
    global _LIBC
    from fshard.backends.local import empty_cache

    gc.collect()
    empty_cache()
    gc.collect()
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _measure_memory(impl: Impl, group: Any) -> float | None:
    """Peak resident-set growth (MiB) of this process over one call, its buffers included."""
    import torch.distributed as dist

    state = impl.setup() if impl.setup else None
    _trim()
    dist.barrier(group=group)
    ok = _reset_peak()
    before = _status_kib("VmRSS")
    if impl.buffers is not None:
        state = impl.buffers()
    result = impl.fn(state)
    peak = _status_kib("VmHWM")
    del result, state
    if not ok or before is None or peak is None:
        return None
    return max(0, peak - before) / 1024


def run_scenario(key: str, mib: float, env: _Env, reps: int) -> dict[str, Any] | None:
    """Times one scenario on this rank; returns this rank's raw results (``None`` off its group)."""
    import torch.distributed as dist

    gc.collect()
    began = time.perf_counter()
    built = build(key, mib, env)
    if env.rank not in built.members:
        return None
    group, impls = built.group, built.impls
    states = {name: impl.buffers() if impl.buffers else None for name, impl in impls.items()}
    checks: dict[str, bool] = {}
    for name, impl in impls.items():  # warm-up, checked
        state = impl.setup() if impl.setup else states[name]
        dist.barrier(group=group)
        result = impl.fn(state)
        checks[name] = impl.check(result) if impl.check else True
        del result
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, impl in impls.items():
            state = impl.setup() if impl.setup else states[name]
            samples[name].append(_timed_call(impl, state, group))
    sent = built.fshard_once()
    del states
    memory = {name: _measure_memory(impl, group) for name, impl in impls.items()}
    _trim()
    return {
        "key": key,
        "mib": mib,
        "members": built.members,
        "samples": samples,
        "checks": checks,
        "sent": sent,
        "memory": memory,
        "min_elements": built.min_elements,
        "floor_elements": built.floor_elements,
        "unsupported": built.unsupported,
        "notes": built.notes,
        "floor_op": built.floor_op,
        "wall_s": time.perf_counter() - began,
    }


def _job(jobs: list[tuple[str, float]], reps: int, peers: bool, progress: bool) -> list[dict[str, Any] | None]:
    """One rank's whole run: every (scenario, size) of ``jobs``, in order."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor is deprecated
    warnings.filterwarnings("ignore", category=UserWarning)
    # DTensor says once per process that CPU groups have no all_to_all; the table says it instead.
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    env = _Env(dist.get_world_size(), peers)
    bar = None
    if progress and env.rank == 0:
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), unit="case", file=sys.stderr, dynamic_ncols=True, leave=False)
    out = []
    for key, mib in jobs:
        if bar is not None:
            bar.set_description(f"{_BY_KEY[key].title}, {mib:g} MiB")
        out.append(run_scenario(key, mib, env, reps))
        dist.barrier()
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return out


# -- the parent: launch, combine the ranks' results, report ------------------------------------


def run(settings: DistSettings, jobs: Sequence[tuple[str, float]] | None = None) -> list[dict[str, Any]]:
    """Launches ``settings.world`` Gloo processes and runs ``jobs`` (default: every job of
    ``settings``) in them; returns one combined result per job."""
    from fshard._launch import launch

    jobs = settings.jobs() if jobs is None else list(jobs)
    if not jobs:
        return []
    args = (jobs, settings.reps, settings.peers, settings.progress)
    for attempt in range(2):
        try:
            per_rank = launch(_job, settings.world, *args, timeout=settings.timeout)
            break
        except RuntimeError as exc:  # a rendezvous that lost its port to another process: once more
            if attempt or "connectFullMesh" not in str(exc):
                raise
    return [combine([r[k] for r in per_rank]) for k in range(len(jobs))]


def combine(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One scenario's result from every rank's: per round the slowest rank, then the median."""
    got = [p for p in parts if p is not None]
    first = got[0]
    scenario = _BY_KEY[first["key"]]
    out: dict[str, Any] = {
        "case": scenario.title,
        "key": scenario.key,
        "kind": scenario.kind,
        "mib": first["mib"],
        "ranks": len(first["members"]),
        "floor_op": first["floor_op"],
        "min_bytes": first["min_elements"] * ITEMSIZE,
        "floor_bytes": first["floor_elements"] * ITEMSIZE,
        "fshard_bytes": sum(p["sent"] for p in got) * ITEMSIZE,
        "target": scenario.target,
        "wall_s": max(p["wall_s"] for p in got),
        "unsupported": first["unsupported"],
        "notes": first["notes"],
        "impls": {},
    }
    for name in IMPLS:
        if name not in first["samples"]:
            continue
        rounds = [max(vals) for vals in zip(*(p["samples"][name] for p in got))]
        memory = [p["memory"][name] for p in got if p["memory"][name] is not None]
        out["impls"][name] = {
            "median_s": statistics.median(rounds),
            "samples_s": rounds,
            "peak_extra_mib": max(memory) if memory else None,
            "correct": all(p["checks"][name] for p in got),
        }
    floor = min(out["impls"][name]["median_s"] for name in FLOORS if name in out["impls"])
    fshard = out["impls"]["fshard"]["median_s"]
    out["floor_s"] = floor
    for name, r in out["impls"].items():
        r["ratio"] = r["median_s"] / floor if floor > 0 else None
        if name in PEERS:
            r["fshard_faster"] = fshard < r["median_s"]
    ratio = out["impls"]["fshard"]["ratio"]
    out["bytes_ok"] = out["fshard_bytes"] == out["min_bytes"]
    out["ratio_ok"] = ratio is not None and ratio <= scenario.target
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


HEADER = ["case", "MiB", "impl", "median ms", "x floor", "target", "MiB sent", "peak +MiB", "note"]
_RIGHT = {"MiB", "median ms", "x floor", "peak +MiB"}


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table as strings: one row per implementation, or per peer that cannot do the case."""
    rows = []
    for res in results:
        head = [res["case"], f"{res['mib']:g}"]
        both_floors = all(n in res["impls"] for n in FLOORS)
        for name in IMPLS:
            r = res["impls"].get(name)
            if r is None:
                if name in res["unsupported"]:
                    rows.append([*head, name, "N/A", "", "", "", "", res["unsupported"][name]])
                    head = ["", ""]
                continue
            target, sent, note = "", "", res["notes"].get(name, "")
            if name in FLOORS:
                sent = _mib(res["floor_bytes"])
                note = res["floor_op"] if name == "floor" else "batch_isend_irecv straight into the output"
                if both_floors and r["median_s"] == res["floor_s"]:
                    note += " (the floor)"
            elif name == "fshard":
                target = f"<={res['target']:.2f} " + ("ok" if res["ratio_ok"] else "MISS")
                sent = f"{_mib(res['fshard_bytes'])} (min {_mib(res['min_bytes'])}) " + (
                    "ok" if res["bytes_ok"] else "MISS"
                )
            else:
                target = "slower " + ("ok" if r["fshard_faster"] else "MISS")
            if not r["correct"]:
                note += "; WRONG RESULT"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            mem = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
            rows.append([*head, name, _ms(r["median_s"]), ratio, target, sent, mem, note])
            head = ["", ""]
    return rows


def plain_table(rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width text columns, a blank line between cases."""
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *rows)]

    def line(r: Sequence[str]) -> str:
        cells = (str(x).rjust(w) if h in _RIGHT else str(x).ljust(w) for x, w, h in zip(r, widths, HEADER))
        return "  ".join(cells).rstrip()

    out = [line(HEADER), line(["-" * w for w in widths])]
    for r in rows:
        if r[0] and len(out) > 2:
            out.append("")
        out.append(line(r))
    return "\n".join(out)


def _preamble(info: dict[str, Any], settings: DistSettings) -> list[str]:
    load = f"load average before the run: {info['load_before']}"
    if "load_after" in info:
        load += f", after: {info['load_after']}"
    return [
        f"fshard torch_dist benchmarks: {settings.world} Gloo processes on 127.0.0.1 (loopback TCP), "
        f"float32 square matrices, median of {settings.reps} interleaved rounds (slowest rank per round)",
        f"machine: {info['cpu']}, {info['cores']} cores shared by all {settings.world} processes "
        f"({info['threads_per_rank']} torch thread each), torch {info['torch']}, Python {info['python']}; {load}",
        "x floor: median / median of the faster floor (the raw collective, or isend/irecv where both ran). "
        "MiB sent: fshard's counters summed over ranks (minimum from the plan).",
        "peak +MiB: largest per-rank resident-set growth over one call, result and buffers included. "
        "The Chunk(0,[0,0,1,1,2]) case runs on ranks 0-2.",
    ]


def render(results: Sequence[dict[str, Any]], info: dict[str, Any], settings: DistSettings, *,
           plain: bool = False, file: Any = None) -> None:  # fmt: skip
    """Prints the table: with rich when it is installed and ``plain`` is false, else as text."""
    file = file or sys.stdout
    lines, rows = _preamble(info, settings), table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        plain = True
    if plain:
        print("\n".join([*lines, plain_table(rows)]), file=file)
        return
    console = Console(file=file, width=max(150, Console(file=file).width))
    for text in lines:
        console.print(text, highlight=False, markup=False)
    table = Table(pad_edge=False)
    for col in HEADER:
        table.add_column(col, justify="right" if col in _RIGHT else "left", overflow="fold")
    for row in rows:
        if row[0] and table.row_count:
            table.add_section()
        table.add_row(*row)
    console.print(table)


def machine(world: int) -> dict[str, Any]:
    """Where the numbers come from."""
    import torch

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // world),
        "transport": "Gloo over TCP loopback",
        "load_before": _load(),
    }


def _load() -> str:
    """The 1, 5 and 15 minute load averages: how much else the machine was running."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def save(results: Sequence[dict[str, Any]], info: dict[str, Any], settings: DistSettings, folder: Path,
         seconds: float) -> Path:  # fmt: skip
    """Writes the results as JSON under ``folder``; returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = folder / f"dist-{stamp}.json"
    data = {"machine": info, "settings": dataclasses.asdict(settings), "wall_s": seconds, "results": list(results)}
    path.write_text(json.dumps(data, indent=1))
    return path


# -- the ``python -m fshard bench`` hook ------------------------------------------------------


class _Batch:
    """Runs the cases of one ``cases()`` call in one launch, when the first one is asked for.

    It holds its cases weakly: those a caller dropped before running any (``python -m
    fshard bench --only ...`` filters the list) are gone by then and do not run.
    """

    def __init__(self, settings: DistSettings) -> None:
        self.settings = settings
        self.cases: weakref.WeakSet[DistCase] = weakref.WeakSet()
        self.results: dict[tuple[str, float], dict[str, Any]] | None = None

    def result(self, key: str, mib: float) -> dict[str, Any]:
        if self.results is None:
            alive = {(c.key, c.mib) for c in self.cases} | {(key, mib)}
            jobs = [j for j in self.settings.jobs() if j in alive]
            self.results = {(r["key"], r["mib"]): r for r in run(self.settings, jobs)}
        return self.results[(key, mib)]


@dataclasses.dataclass(frozen=True)
class DistCase:
    """One scenario at one size, as a ``benchmarks.common.Case`` (``group``, ``name``, ``run``)."""

    key: str
    mib: float
    batch: _Batch = dataclasses.field(compare=False, repr=False)
    group: str = dataclasses.field(default=GROUP, compare=False)

    @property
    def name(self) -> str:
        return f"{_BY_KEY[self.key].title}, {self.mib:g} MiB"

    def run(self, settings: Any = None) -> list[Any]:
        """The case's rows as ``benchmarks.common.Row`` values (bytes and memory in the note)."""
        from benchmarks.common import Row

        res = self.batch.result(self.key, self.mib)
        rows = []
        for name in IMPLS:
            r = res["impls"].get(name)
            if r is None:
                if name in res["unsupported"]:
                    rows.append(Row(self.group, self.name, name, None, note="N/A: " + res["unsupported"][name]))
                continue
            mem = "" if r["peak_extra_mib"] is None else f"peak +{r['peak_extra_mib']:.0f} MiB"
            target, ok = "", None
            if name in FLOORS:
                op = res["floor_op"] if name == "floor" else "batch_isend_irecv"
                note = f"{op}; {_mib(res['floor_bytes'])} MiB; {mem}"
            elif name == "fshard":
                target, ok = f"<= {res['target']:.2f}x floor, bytes = min", res["ratio_ok"] and res["bytes_ok"]
                note = f"sent {_mib(res['fshard_bytes'])} MiB (min {_mib(res['min_bytes'])}); {mem}"
            else:
                target, ok = "fshard faster", r["fshard_faster"]
                note = "; ".join(x for x in (mem, res["notes"].get(name, "")) if x)
            if not r["correct"]:
                note += "; WRONG RESULT"
            ratio_to = "x floor (the floor)" if name in FLOORS and r["ratio"] == 1 else "x floor"
            rows.append(Row(self.group, self.name, name, r["median_s"], len(r["samples_s"]), r["ratio"], ratio_to,
                            target, ok, note, tuple(r["samples_s"])))  # fmt: skip
        return rows


def cases(settings: Any = None) -> list[DistCase]:
    """The cases for ``python -m fshard bench`` (``benchmarks.run.CASE_MODULES``).

    ``settings`` is a ``benchmarks.common.Settings`` (``quick``: 1 MiB and 5 rounds,
    else 16 and 256 MiB and at least 15 rounds; ``peers``), a ``DistSettings``, or
    ``None`` for the defaults. The cases share one launch of 4 Gloo processes.
    """
    if isinstance(settings, DistSettings):
        dist_settings = settings
    elif settings is None:
        dist_settings = DistSettings()
    else:
        quick = bool(getattr(settings, "quick", False))
        reps = int(getattr(settings, "reps", 15))
        dist_settings = DistSettings(
            sizes=(1,) if quick else (16, 256),
            reps=min(5, reps) if quick else max(15, reps),
            peers=bool(getattr(settings, "peers", True)),
        )
    batch = _Batch(dist_settings)
    group = f"{GROUP}: {dist_settings.world} Gloo processes sharing {os.cpu_count()} cores"
    out = [DistCase(key, mib, batch, group) for key, mib in dist_settings.jobs()]
    batch.cases.update(out)
    return out


# -- command line ---------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line of ``python benchmarks/dist.py``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/dist.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="number of Gloo processes (default 4)")
    parser.add_argument("--sizes", type=float, nargs="+", default=None, help="tensor sizes in MiB (default 16 256)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per case (default 15; 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="1 MiB and 5 rounds: a fast check that everything runs")
    parser.add_argument("--no-peers", action="store_true", help="time fshard and the floor only")
    parser.add_argument("--only", action="append", default=[], help="run scenarios whose key or title contains this")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the JSON results")
    parser.add_argument("--plain", action="store_true", help="a plain-text table even when rich is installed")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world must be at least 2, got {args.world}")
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.sizes and min(args.sizes) <= 0:
        parser.error(f"--sizes must be positive, got {args.sizes}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks and prints the table; returns 0, 1 if a result was wrong, 2 if nothing ran."""
    args = parse(argv)
    sizes = tuple(args.sizes) if args.sizes else ((1,) if args.quick else (16, 256))
    sizes = tuple(int(s) if float(s).is_integer() else s for s in sizes)
    reps = args.reps or (5 if args.quick else 15)
    settings = DistSettings(world=args.world, sizes=sizes, reps=reps, peers=not args.no_peers, only=tuple(args.only))
    if not settings.jobs():
        print(f"No scenario matches {args.only} on {args.world} ranks.", file=sys.stderr)
        return 2
    info = machine(settings.world)
    start = time.perf_counter()
    results = run(settings)
    seconds = time.perf_counter() - start
    info["load_after"] = _load()
    render(results, info, settings, plain=args.plain)
    path = save(results, info, settings, args.out, seconds)
    print(f"wall time {seconds:.0f} s; results: {path}")
    return 1 if any(not i["correct"] for r in results for i in r["impls"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
