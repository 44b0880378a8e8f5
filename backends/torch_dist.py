"""The torch.distributed backend: plans executed over Gloo (CPU tensors) or NCCL (CUDA tensors).

Every rank of the group calls each operation with the same arguments (SPMD). A rank
computes the same cached ``Plan`` as every other rank and reads its own part of it:

- rows whose source and destination are this rank are local slice copies;
- rows that cross ranks are deduplicated (a box goes once to a rank, even when that
  rank holds it twice) and exchanged: ``execute`` packs all boxes for one peer into
  one contiguous buffer and runs a single ``all_to_all_single`` with split sizes (no
  padding); ``scatter`` and ``assemble`` post one ``isend``/``irecv`` per box, straight
  from and into the tensors where a box is a contiguous range of them. ``execute``
  does the same when every received box is a contiguous range of its shard and the
  boxes are few and large (chunk -> replicated, dim 0 -> dim 1 of big arrays):
  nothing is staged on arrival.

The local copies run while the messages are in flight. Boxes that already lie back to
back in one tensor are sent (or received) in place rather than packed; buffers that
must be staged come from the local backend's cache of mapped CPU memory, so they do
not pay a page fault per 4 KiB on every call. A rank's share of a plan (its peers,
split sizes, the slices of every box, which boxes need no packing) is computed once
per cached plan, so a repeated call does no index arithmetic.

Placements name global ranks; a sub-group maps them to group ranks. The wire device
follows the group: CUDA for an NCCL group, CPU otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fshard._boxes import rows_prod, unique_rows
from fshard._collective import call_name
from fshard._config import current
from fshard._errors import SpecError
from fshard._layout import Layout, ShardMeta
from fshard._log import log_move
from fshard._placement import Placement
from fshard._plan import Plan, plan

from .dist_check import agreed, check, describe_layout
from .dist_reduce import all_to_all, collective_kind, reduce_schedule, run_collective, run_reduce
from .local import _POOL, Counters, copy_plan, identity, needs_fill, new_shard, reduce_plan, shard_device, slice_shards

__all__ = ["TorchDistBackend"]

_COUNTERS: dict[int, Counters] = {}
_WARM: set[int] = set()
# ``execute`` sends box by box (nothing staged on arrival) when every received box lands
# in place, there are at most this many boxes per pair of ranks on average, and they
# average at least ``_DIRECT_MIN_BYTES``: below that, one all_to_all_single has less
# latency than the separate messages save in copying (Gloo on loopback).
_DIRECT_PIECES_PER_PAIR = 4
_DIRECT_MIN_BYTES = 1 << 20
# ``exchange`` sends pickles up to this many bytes in one round (larger: a second round).
_EXCHANGE_INLINE = 1016


@dataclasses.dataclass(frozen=True, eq=False)
class TorchDistBackend:
    """Runs plans across the processes of a ``torch.distributed`` process group.

    Args:
        group: a process group from ``dist.new_group`` (``None``: the default group).

    Two backends are equal when they name the same group. ``counters`` (shared by all
    backends of a group) count the elements this process sent and the collectives it ran.

    >>> import torch, fshard
    >>> from fshard.backends.torch_dist import TorchDistBackend
    >>> backend = TorchDistBackend()  # torch.distributed is initialised (e.g. by torchrun)
    >>> x = fshard.shard(torch.arange(6.0), fshard.Chunk(0, backend.ranks), backend=backend)
    >>> fshard.gather(fshard.reshard(x, fshard.Chunk(0, backend.ranks[::-1]))).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> backend == fshard.backends.default_backend()
    True

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    group: Any = None
    name: str = dataclasses.field(default="torch_dist", init=False)

    def __post_init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            msg = (
                "TorchDistBackend needs torch.distributed to be initialised: call "
                "dist.init_process_group(...) first (torchrun does it for you), or use the local backend."
            )
            raise RuntimeError(msg)
        if self.group is not None and self.group is dist.GroupMember.WORLD:
            object.__setattr__(self, "group", None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchDistBackend) and self.group is other.group

    def __hash__(self) -> int:
        return hash(("torch_dist", id(self.group)))

    def __repr__(self) -> str:
        return f"TorchDistBackend(ranks={list(self.ranks)})" if self.member else "TorchDistBackend(non-member)"

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's global ranks, in group-rank order (empty when this process is not in it)."""
        if self.group is dist.GroupMember.NON_GROUP_MEMBER:
            return ()
        return tuple(dist.get_process_group_ranks(self.group or dist.group.WORLD))

    @property
    def member(self) -> bool:
        """Whether this process belongs to the group."""
        return self.group is not dist.GroupMember.NON_GROUP_MEMBER

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return len(self.ranks)

    @property
    def counters(self) -> Counters:
        """Elements this process sent to other ranks, and collectives it ran, on this group."""
        return _COUNTERS.setdefault(id(self.group), Counters())

    def addressable(self, layout: Any) -> tuple[int, ...]:
        """Indices of the shards placed on this process's rank."""
        return layout.indices_on(self.rank)

    def check_layout(self, layout: Any) -> None:
        """Raises ``SpecError`` if a shard sits on a rank outside the group or on a missing device."""
        ranks = self.ranks if self.member else ()
        for r in layout.ranks:
            if (self.member and r not in ranks) or (not self.member and r == self.rank):
                msg = (
                    f"Global rank {r} does not exist in input process group (global ranks {list(ranks)}): "
                    "placements name global ranks; place shards on the group's ranks "
                    f"or use a group that holds rank {r}."
                )
                raise SpecError(msg)
        for i in self.addressable(layout):
            shard_device(layout, i)

    def execute(self, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs ``plan``, phase by phase: one ``all_to_all_single`` of packed per-peer buffers, or,
        when every received box lands in place and the boxes are few and large, one message per
        box; a reduce phase combines contributions (``all_reduce``/``reduce_scatter_tensor``
        where the layouts are theirs)."""
        log_move("torch_dist", plan, like.element_size(), self.rank)
        nccl = self._wire.type == "cuda"
        kind = collective_kind(plan, self.ranks, nccl) if plan.src.partial is not None and self.member else None
        if kind is not None and _on_wire(plan, self._wire):
            return self._collective(kind, plan, tensors, like)
        for p in plan.phases:
            index = self.addressable(p.dst)
            out = {j: new_shard(p.dst, j, like) for j in index}
            if p.op is None:
                self._move("reshard", p, tensors, out, like.dtype, direct=_direct(p, like.element_size()))
            else:
                self._reduce("reshard", p, tensors, out, like.dtype)
            tensors = tuple(out[j] for j in index)
        return tuple(tensors)

    def scatter(self, full: torch.Tensor | None, layout: Any, src: int | None) -> tuple[torch.Tensor, ...]:
        """This rank's boxes of ``full``: sliced locally (``src=None``) or sent from rank ``src``.

        Only the boxes that other ranks need leave rank ``src``, each straight from
        ``full`` where it is a contiguous range of it; off ``src``, ``full`` is a
        stand-in that gives the dtype.
        """
        if full is None:
            raise SpecError(
                f"scatter(src={src}) needs a tensor on every rank (off src, an empty stand-in of the dtype)."
            )
        if src is None:
            return self._slice(full, layout)
        self._require_member(f"shard(src={src})")
        self._check_rank(src, "src")
        like, dtype = full, full.dtype
        source = _whole(layout.shape, (src,))
        index = self.addressable(layout)
        out = {j: new_shard(layout, j, like) for j in index}
        self._move(
            f"shard(src={src})", plan(source, layout), (like,) if self.rank == src else (), out, dtype, direct=True
        )
        return tuple(out[j] for j in index)

    def assemble(
        self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None
    ) -> torch.Tensor | None:
        """The global tensor on every rank of the group (``dst=None``) or on rank ``dst`` only.

        Boxes that are contiguous ranges of the result (dim-0 chunks) are received
        straight into it; other boxes are staged once in one receive buffer.
        """
        self._require_member(f"gather(dst={dst})")
        if dst is not None:
            self._check_rank(dst, "dst")
        receivers = self.ranks if dst is None else (dst,)
        target = _whole(layout.shape, receivers)
        p = plan(layout, target)
        out = {}
        if self.rank in receivers:
            out[target.indices_on(self.rank)[0]] = _empty(layout.shape, like.dtype, self._out_device(layout, like))
        self._move(f"gather(dst={dst})", p, tensors, out, like.dtype, direct=_all_contiguous(p))
        return next(iter(out.values()), None)

    def exchange(self, obj: Any) -> list[Any]:
        """Every group rank's ``obj``, in group-rank order (``ranks[i]`` sent entry ``i``)."""
        self._require_member("exchange")
        with _outside_transforms():
            self._check("exchange", ())
            out = _gather_objects(obj, self.group, self.world_size, self._wire)
        self.counters.collectives += 1
        return out

    # -- internals ---------------------------------------------------------------------

    def _collective(
        self, kind: str, p: Plan, tensors: Sequence[torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        self._check(f"reshard:{kind}", (p.src, p.dst), like.dtype)
        (j,) = self.addressable(p.dst)
        out = _empty(p.dst.shards[j].sizes, like.dtype, self._wire)
        run_collective(kind, p, tensors[0].to(self._wire), out, self.group)
        self.counters.elements_sent += int(p.traffic()[self.rank].sum())
        self.counters.collectives += 1
        return (out.to(shard_device(p.dst, j)),)

    def _reduce(
        self, op: str, p: Plan, tensors: Sequence[torch.Tensor], out: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> None:
        self._require_member(op)
        self._check(op, (p.src, p.dst), dtype)
        src = dict(zip(self.addressable(p.src), tensors))
        sched = reduce_schedule(p, self.rank, self.ranks)
        if p.elements_sent == 0:  # every rank reads this from the same plan: no collective anywhere
            for j in needs_fill(p):
                if j in out:
                    out[j].fill_(identity(str(p.op), dtype))
            reduce_plan(p, src, out, sched.local.tolist())
            return
        self._warm()
        run_reduce(p, sched, src, out, dtype, self._wire, self.group, _empty)
        self.counters.elements_sent += sched.sent
        self.counters.collectives += 1

    def _warm(self) -> None:
        wire = self._wire
        if wire.type == "cuda" and id(self.group) not in _WARM:
            dist.all_reduce(torch.zeros(1, device=wire), group=self.group)  # NCCL: create the communicator before P2P
            _WARM.add(id(self.group))

    @property
    def _wire(self) -> torch.device:
        name = str(dist.get_backend(self.group))
        if name == "nccl" or ("cuda:" in name and "cpu:" not in name):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _slice(self, full: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
        self._check("shard(src=None)", (layout,))
        return slice_shards(full, layout, self.addressable(layout))

    def _out_device(self, layout: Layout, like: torch.Tensor) -> torch.device:
        mine = self.addressable(layout)
        return shard_device(layout, mine[0]) if mine else (like.device if like.device == self._wire else self._wire)

    def _check_rank(self, rank: int, what: str) -> None:
        if rank not in self.ranks:
            msg = (
                f"{what}={rank}: Global rank {rank} does not exist in input process group "
                f"(global ranks {list(self.ranks)})."
            )
            raise SpecError(msg)

    def _require_member(self, op: str) -> None:
        if not self.member:
            msg = (
                f"{op}: rank {self.rank} is not in this array's process group; call collective fshard "
                "functions on it only from ranks of its group."
            )
            raise SpecError(msg)

    def _check(self, op: str, layouts: tuple[Layout, ...], dtype: torch.dtype | None = None) -> None:
        """In check mode, one check round: every rank is about to run this collective, or all raise."""
        if self.member and current().check_collectives:
            moves = " -> ".join(describe_layout(x) for x in layouts)
            what = f"{op}({moves})" + (f" on {dtype}" if dtype is not None else "")
            call = call_name()  # the public call it serves, which describes the arguments already
            if call is not None:
                what = f"{call}, at {op} #{hashlib.blake2b(what.encode(), digest_size=4).hexdigest()}"
            check(self.group, self.ranks, self.rank, what)

    def settle(self, what: str, error: Exception | None = None) -> None:
        """In check mode, the check that ends a public call: how it ended here is ``what``
        (and ``error``, which the caller raises once every rank has learned of it)."""
        if not (self.member and current().check_collectives) or (error is not None and agreed(error)):
            return
        try:
            check(self.group, self.ranks, self.rank, what, error)
        except Exception:
            if error is None:
                raise

    def _move(
        self,
        op: str,
        p: Plan,
        tensors: Sequence[torch.Tensor],
        out: dict[int, torch.Tensor],
        dtype: torch.dtype,
        *,
        direct: bool,
    ) -> None:
        self._require_member(op)
        self._check(op, (p.src, p.dst), dtype)
        src = dict(zip(self.addressable(p.src), tensors))
        sched = _schedule(p, self.rank, self.ranks)
        if p.elements_sent == 0:  # every rank reads this from the same plan: no collective anywhere
            copy_plan(p, src, out, sched.local)
            return
        wire = self._wire
        self._warm()
        transport = _p2p if direct or not _has_alltoall(str(dist.get_backend(self.group))) else _alltoall
        transport(p, sched, src, out, dtype, wire, self.group, lambda: copy_plan(p, src, out, sched.local))
        self.counters.elements_sent += sched.sent
        self.counters.collectives += 1


def _on_wire(p: Plan, wire: torch.device) -> bool:
    """Whether every shard of both layouts is placed on the wire's device type (as every rank sees)."""
    return all(torch.device(d).type == wire.type for d in (*p.src._devices, *p.dst._devices))


@functools.lru_cache(maxsize=256)
def _whole(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Layout:
    """The whole array once on each of ``ranks`` (the layout ``shard(src=)`` and ``gather`` move from or to)."""
    zero = (0,) * len(shape)
    return Layout(tuple(shape), tuple(ShardMeta(zero, tuple(shape), Placement(r)) for r in ranks))


# -- schedules: this rank's part of a plan (pure, cached) ---------------------------------


_Index = tuple[int, tuple[slice, ...]]  # a box as (shard, slices into that shard's tensor)
_Span = tuple[int, int, int]  # boxes back to back in one shard: (shard, first element, end)


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """One rank's share of a plan, with every index it needs computed once.

    ``send``/``recv``: per peer in group order, the plan rows of the distinct boxes
    exchanged with it, in plan order (so sender and receiver agree); ``fanout`` maps a
    received row to every row writing the same box into a shard on this rank.
    ``at_src``/``at_dst`` give each sent row's box in its source shard and each received
    (or fanned-out) row's box in its destination shard. ``send_split``/``recv_split``
    count elements per rank of the group; ``send_span``/``recv_span`` say where the sent
    boxes (and the first destination of each received box) lie back to back in one
    shard, so that they need no packing when that shard is a contiguous tensor.
    """

    local: np.ndarray
    send: tuple[tuple[int, np.ndarray], ...]
    recv: tuple[tuple[int, np.ndarray], ...]
    fanout: dict[int, np.ndarray]
    sent: int
    at_src: dict[int, _Index]
    at_dst: dict[int, _Index]
    send_split: tuple[int, ...]
    recv_split: tuple[int, ...]
    send_span: _Span | None
    recv_span: _Span | None


@functools.lru_cache(maxsize=512)
def _schedule(p: Plan, me: int, order: tuple[int, ...]) -> _Schedule:
    sr, dr = p.src_rank, p.dst_rank
    local = np.flatnonzero((sr == me) & (dr == me))
    cross = np.flatnonzero(sr != dr)
    first, inverse = unique_rows(np.c_[p.src_shard[cross], dr[cross], p.lo[cross], p.size[cross]])
    pieces = np.sort(cross[first])  # unique_rows keeps the earliest row of each group
    position = np.zeros(int(max(sr.max(initial=0), dr.max(initial=0), max(order))) + 1, np.int64)
    position[list(order)] = np.arange(len(order))
    send = _by_peer(pieces[sr[pieces] == me], dr, position)
    recv = _by_peer(pieces[dr[pieces] == me], sr, position)
    mine = cross[dr[cross] == me]
    fanout = {int(rows[0]): rows for rows in _split_by(mine, inverse[dr[cross] == me])}
    numel = p.numel
    send_rows = np.concatenate([rows for _, rows in send]) if send else np.zeros(0, np.int64)
    first_dst = np.array([fanout[k][0] for _, rows in recv for k in rows.tolist()], np.int64)
    return _Schedule(
        local=local,
        send=send,
        recv=recv,
        fanout=fanout,
        sent=int(sum(numel[rows].sum() for _, rows in send)),
        at_src=_indices(p, send_rows, "src"),
        at_dst=_indices(p, mine, "dst"),
        send_split=_split(send, numel, position, len(order)),
        recv_split=_split(recv, numel, position, len(order)),
        send_span=_span(p, send_rows, "src"),
        recv_span=_span(p, first_dst, "dst"),
    )


def _side(p: Plan, side: str) -> tuple[Layout, np.ndarray]:
    return (p.src, p.src_shard) if side == "src" else (p.dst, p.dst_shard)


def _indices(p: Plan, rows: np.ndarray, side: str) -> dict[int, _Index]:
    """Each row's box as (shard, slices into that shard's tensor)."""
    layout, shard = _side(p, side)
    start = p.lo[rows] - layout._lo[shard[rows]]
    stop = start + p.size[rows]
    return {
        k: (j, tuple(slice(a, b) for a, b in zip(lo, hi)))
        for k, j, lo, hi in zip(rows.tolist(), shard[rows].tolist(), start.tolist(), stop.tolist())
    }


def _split(by_peer: tuple[tuple[int, np.ndarray], ...], numel: np.ndarray, position: np.ndarray,
           n: int) -> tuple[int, ...]:  # fmt: skip
    """Elements exchanged with each rank, in group order."""
    out = [0] * n
    for peer, rows in by_peer:
        out[int(position[peer])] = int(numel[rows].sum())
    return tuple(out)


def _span(p: Plan, rows: np.ndarray, side: str) -> _Span | None:
    """(shard, first element, end) when the boxes of ``rows``, in order, are non-empty ranges
    that follow each other in one shard stored contiguously (C order), else ``None``."""
    layout, shard = _side(p, side)
    if not rows.size or np.unique(shard[rows]).size != 1:
        return None
    j = int(shard[rows[0]])
    sizes, size, lo = layout._sz[j], p.size[rows], p.lo[rows] - layout._lo[j]
    if not (size > 0).all():
        return None
    if not sizes.size:  # a 0-d array: one box, its single element
        return (j, 0, 1) if rows.size == 1 else None
    # A range in C order: every extent before some dim is 1, every extent after it is whole.
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = np.arange(size.shape[1])[None, :] > lead[:, None]
    if not (((size == sizes[None, :]) | ~after).all(axis=1) | ~big.any(axis=1)).all():
        return None
    strides = np.ones(len(sizes), np.int64)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    starts, counts = lo @ strides, rows_prod(size)
    if (starts[1:] != starts[:-1] + counts[:-1]).any():
        return None
    return j, int(starts[0]), int(starts[-1] + counts[-1])


def _split_by(rows: np.ndarray, key: np.ndarray) -> list[np.ndarray]:
    """``rows`` grouped by ``key`` (groups in key order, rows kept in order within a group)."""
    o = np.argsort(key, kind="stable")
    k = key[o]
    return np.split(rows[o], np.flatnonzero(k[1:] != k[:-1]) + 1) if rows.size else []


def _by_peer(rows: np.ndarray, peer: np.ndarray, position: np.ndarray) -> tuple[tuple[int, np.ndarray], ...]:
    """``rows`` grouped by their peer rank, peers in group-rank order."""
    return tuple((int(peer[g[0]]), g) for g in _split_by(rows, position[peer[rows]]))


@functools.lru_cache(maxsize=512)
def _all_contiguous(p: Plan) -> bool:
    """Whether every box that crosses ranks is a contiguous range of its destination shard."""
    rows = np.flatnonzero(p.src_rank != p.dst_rank)
    if not rows.size or not p.dst.ndim:
        return True
    shape = p.dst._sz[p.dst_shard[rows]]
    size = p.size[rows]
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = np.arange(p.dst.ndim)[None, :] > lead[:, None]
    return bool((((size == shape) | ~after).all(axis=1) | ~big.any(axis=1)).all())


@functools.lru_cache(maxsize=512)
def _direct(p: Plan, itemsize: int) -> bool:
    """Whether ``execute`` sends box by box: every received box lands in place, and the
    boxes are few and large. Every rank computes the same answer from the same plan."""
    pieces = p._crossing.size
    if not pieces or p.elements_sent * itemsize < _DIRECT_MIN_BYTES * pieces:
        return False
    ranks = int(np.unique(np.r_[p.src._rank, p.dst._rank]).size)
    return pieces <= _DIRECT_PIECES_PER_PAIR * ranks * ranks and _all_contiguous(p)


def _has_alltoall(backend_name: str) -> bool:
    return any(b in backend_name for b in ("gloo", "nccl", "mpi", "ucc"))


# -- transports -------------------------------------------------------------------------


def _view(tensors: dict[int, torch.Tensor], at: _Index) -> torch.Tensor:
    """The box ``at`` = (shard, slices) as a view of that shard's tensor."""
    return tensors[at[0]][at[1]]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` can be viewed as bytes in place: contiguous, and unit-strided even with one
    element (torch calls a one-element view with any stride contiguous)."""
    return t.is_contiguous() and (t.numel() != 1 or t.reshape(-1).stride(0) == 1)


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor; on the CPU from memory that is already mapped."""
    if device.type == "cpu":
        return _POOL.empty(tuple(shape), dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _p2p(
    p: Plan,
    sched: _Schedule,
    src: dict,
    out: dict,
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    local: Any,
) -> None:
    """One message per box; sent from and received into the tensors where the box is contiguous.

    ``local()`` (this rank's own copies) runs while the messages are in flight.
    """
    ops, staged = [], []
    for peer, rows in sched.recv:
        for tag, k in enumerate(rows.tolist()):
            box = _view(out, sched.at_dst[k])
            if not (_contiguous(box) and box.device == wire):
                staged.append((k, box, buf := _empty(box.shape, dtype, wire)))
                box = buf
            else:
                staged.append((k, None, box))
            ops.append(dist.P2POp(dist.irecv, _bytes(box), peer, group, tag))
    for peer, rows in sched.send:
        for tag, k in enumerate(rows.tolist()):
            box = _view(src, sched.at_src[k])
            if not (_contiguous(box) and box.device == wire):
                box = _empty(box.shape, dtype, wire).copy_(box)
            ops.append(dist.P2POp(dist.isend, _bytes(box), peer, group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    local()
    for work in works:
        work.wait()
    for k, target, got in staged:
        _fan_out(sched, k, got, out, skip_first=target is None)


def _fan_out(sched: _Schedule, k: int, got: torch.Tensor, out: dict, *, skip_first: bool) -> None:
    """Copies a received box into every destination row that wants it (one per replica shard)."""
    for n, row in enumerate(sched.fanout[k].tolist()):
        if not (skip_first and n == 0):
            _view(out, sched.at_dst[row]).copy_(got)


def _in_place(span: _Span | None, tensors: dict, wire: torch.device) -> torch.Tensor | None:
    """One flat view over boxes that lie back to back in one shard (``span``), when that
    shard's tensor is contiguous and on the wire device (so they need no packing)."""
    if span is None:
        return None
    base = tensors[span[0]]
    if base.device != wire or not _contiguous(base):
        return None
    return base.reshape(-1)[span[1] : span[2]]


def _alltoall(
    p: Plan,
    sched: _Schedule,
    src: dict,
    out: dict,
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    local: Any,
) -> None:
    """Packs every box per peer into one buffer and runs a single ``all_to_all_single``.

    Boxes already back to back in one tensor are sent or received in place; ``local()``
    (this rank's own copies) runs while the collective is in flight.
    """
    sendbuf = _in_place(sched.send_span, src, wire)
    if sendbuf is None:
        sendbuf = _empty((sum(sched.send_split),), dtype, wire)
        at = 0
        for _, rows in sched.send:
            for k in rows.tolist():
                box = _view(src, sched.at_src[k])
                sendbuf[at : at + box.numel()].view(box.shape).copy_(box)
                at += box.numel()
    recvbuf = _in_place(sched.recv_span, out, wire)
    staged = recvbuf is None
    if staged:
        recvbuf = _empty((sum(sched.recv_split),), dtype, wire)
    work = all_to_all(recvbuf, sendbuf, sched.recv_split, sched.send_split, group)
    local()
    work.wait()
    at = 0
    for _, rows in sched.recv:
        for k in rows.tolist():
            shape = tuple(s.stop - s.start for s in sched.at_dst[k][1])
            n = math.prod(shape)
            _fan_out(sched, k, recvbuf[at : at + n].view(shape), out, skip_first=not staged)
            at += n


def _outside_transforms() -> Any:
    """A context in which torch.func transforms do not wrap new tensors.

    ``exchange`` moves metadata, never differentiated values; inside ``torch.func.grad``
    its wire tensors would otherwise be wrapped, and a collective cannot read a wrapper.
    """
    return torch._C._DisableFuncTorch()


def _gather_objects(obj: Any, group: Any, n: int, wire: torch.device) -> list[Any]:
    """``all_gather_object`` in one round where every pickle is small (metadata).

    Each rank sends a fixed-size record: its pickle's length and, when it fits, the
    pickle itself. Only if some rank's pickle is larger (every rank sees the lengths)
    does a second round carry the pickles, padded to the longest.
    """
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    record = np.zeros(8 + _EXCHANGE_INLINE, np.uint8)
    record[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    if len(data) <= _EXCHANGE_INLINE:
        record[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
    got = _all_gather_bytes(record, group, n, wire)
    sizes = got[:, :8].copy().view(np.int64).ravel().tolist()
    if max(sizes) <= _EXCHANGE_INLINE:
        return [pickle.loads(got[i, 8 : 8 + k].tobytes()) for i, k in enumerate(sizes)]
    padded = np.zeros(max(sizes), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = _all_gather_bytes(padded, group, n, wire)
    return [pickle.loads(rows[i, :k].tobytes()) for i, k in enumerate(sizes)]


def _all_gather_bytes(row: np.ndarray, group: Any, n: int, wire: torch.device) -> np.ndarray:
    """Every rank's ``row`` (equal lengths), as an ``n x len`` array in group order.

    Through ``all_to_all_single`` where the backend has it: every message goes out at
    once, one step, where a ring all-gather takes n - 1 steps in turn (small messages
    are all latency: about 2 ms against 4 ms for 4 Gloo processes on 2 cores, and
    ``all_gather_object``, which gathers the sizes first, takes 8 ms).
    """
    mine = torch.from_numpy(row).to(wire)
    out = torch.empty(n * row.size, dtype=torch.uint8, device=wire)
    if _has_alltoall(str(dist.get_backend(group))):
        dist.all_to_all_single(out, mine.repeat(n), group=group)
    else:
        dist.all_gather_into_tensor(out, mine, group=group)
    return out.cpu().numpy().reshape(n, row.size)
