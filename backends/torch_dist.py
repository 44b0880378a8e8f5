"""The torch.distributed backend: plans executed over Gloo (CPU tensors) or NCCL (CUDA tensors).

Every rank of the group calls each operation with the same arguments (SPMD). A rank
computes the same cached ``Plan`` as every other rank and reads its own part of it:

- rows whose source and destination are this rank are local slice copies;
- rows that cross ranks are deduplicated (a box goes once to a rank, even when that
  rank holds it twice) and exchanged: ``execute`` packs all boxes for one peer into
  one contiguous buffer and runs a single ``all_to_all_single`` with split sizes (no
  padding); ``scatter`` and ``assemble`` post one ``isend``/``irecv`` per box, straight
  from and into the tensors where a box is a contiguous range of them.

Placements name global ranks; a sub-group maps them to group ranks. The wire device
follows the group: CUDA for an NCCL group, CPU otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fshard._boxes import unique_rows
from fshard._config import current
from fshard._errors import CollectiveMismatchError, SpecError
from fshard._layout import Layout, ShardMeta
from fshard._placement import Placement
from fshard._plan import Plan, plan
from fshard.backends.local import Counters, box_slices, copy_plan, new_shard, shard_device

__all__ = ["TorchDistBackend"]

_COUNTERS: dict[int, Counters] = {}
_WARM: set[int] = set()


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
                    f"placements name global ranks; place shards on the group's ranks or use a group that holds rank {r}."
                )
                raise SpecError(msg)
        for i in self.addressable(layout):
            shard_device(layout, i)

    def execute(self, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs ``plan`` with one ``all_to_all_single`` of packed per-peer buffers."""
        index = self.addressable(plan.dst)
        out = {j: new_shard(plan.dst, j, like) for j in index}
        self._move("execute", plan, tensors, out, like.dtype, direct=False)
        return tuple(out[j] for j in index)

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
        self._require_member(f"scatter(src={src})")
        self._check_rank(src, "src")
        like, dtype = full, full.dtype
        source = Layout(layout.shape, (ShardMeta((0,) * layout.ndim, layout.shape, Placement(src)),))
        index = self.addressable(layout)
        out = {j: new_shard(layout, j, like) for j in index}
        self._move(
            f"scatter(src={src})", plan(source, layout), (like,) if self.rank == src else (), out, dtype, direct=True
        )
        return tuple(out[j] for j in index)

    def assemble(
        self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None
    ) -> torch.Tensor | None:
        """The global tensor on every rank of the group (``dst=None``) or on rank ``dst`` only.

        Boxes that are contiguous ranges of the result (dim-0 chunks) are received
        straight into it; other boxes are staged once in one receive buffer.
        """
        self._require_member(f"assemble(dst={dst})")
        if dst is not None:
            self._check_rank(dst, "dst")
        receivers = self.ranks if dst is None else (dst,)
        zero = (0,) * layout.ndim
        target = Layout(layout.shape, tuple(ShardMeta(zero, layout.shape, Placement(r)) for r in receivers))
        p = plan(layout, target)
        out = {}
        if self.rank in receivers:
            out[target.indices_on(self.rank)[0]] = torch.empty(
                layout.shape, dtype=like.dtype, device=self._out_device(layout, like)
            )
        self._move(f"assemble(dst={dst})", p, tensors, out, like.dtype, direct=_all_contiguous(p))
        return next(iter(out.values()), None)

    def exchange(self, obj: Any) -> list[Any]:
        """Every group rank's ``obj``, in group-rank order (``ranks[i]`` sent entry ``i``)."""
        self._require_member("exchange")
        self._check("exchange", ())
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        self.counters.collectives += 1
        return out

    # -- internals ---------------------------------------------------------------------

    @property
    def _wire(self) -> torch.device:
        name = str(dist.get_backend(self.group))
        if name == "nccl" or ("cuda:" in name and "cpu:" not in name):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _slice(self, full: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
        self._check("scatter(src=None)", (layout,))
        out = []
        for i in self.addressable(layout):
            s = layout.shards[i]
            out.append(new_shard(layout, i, full).copy_(full[box_slices(s.offsets, s.sizes, (0,) * layout.ndim)]))
        return tuple(out)

    def _out_device(self, layout: Layout, like: torch.Tensor) -> torch.device:
        mine = self.addressable(layout)
        return shard_device(layout, mine[0]) if mine else (like.device if like.device == self._wire else self._wire)

    def _check_rank(self, rank: int, what: str) -> None:
        if rank not in self.ranks:
            msg = f"{what}={rank}: Global rank {rank} does not exist in input process group (global ranks {list(self.ranks)})."
            raise SpecError(msg)

    def _require_member(self, op: str) -> None:
        if not self.member:
            msg = (
                f"{op}: rank {self.rank} is not in this array's process group; call collective fshard "
                "functions on it only from ranks of its group."
            )
            raise SpecError(msg)

    def _check(self, op: str, layouts: tuple[Layout, ...], dtype: torch.dtype | None = None) -> None:
        if self.member and current().check_collectives:
            _check_same(self.group, self.ranks, op, layouts, dtype)

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
        copy_plan(p, src, out, sched.local)
        if p.elements_sent == 0:
            return
        wire = self._wire
        if wire.type == "cuda" and id(self.group) not in _WARM:
            dist.all_reduce(torch.zeros(1, device=wire), group=self.group)  # NCCL: create the communicator before P2P
            _WARM.add(id(self.group))
        if direct or not _has_alltoall(str(dist.get_backend(self.group))):
            _p2p(p, sched, src, out, dtype, wire, self.group)
        else:
            _alltoall(p, sched, src, out, dtype, wire, self.group)
        self.counters.elements_sent += sched.sent
        self.counters.collectives += 1


# -- schedules: this rank's part of a plan (pure, cached) ---------------------------------


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """One rank's share of a plan.

    ``send``/``recv``: per peer in group order, the plan rows of the distinct boxes
    exchanged with it, in plan order (so sender and receiver agree); ``fanout`` maps a
    received row to every row writing the same box into a shard on this rank.
    """

    local: np.ndarray
    send: tuple[tuple[int, np.ndarray], ...]
    recv: tuple[tuple[int, np.ndarray], ...]
    fanout: dict[int, np.ndarray]
    sent: int


@functools.lru_cache(maxsize=512)
def _schedule(p: Plan, me: int, order: tuple[int, ...]) -> _Schedule:
    sr, dr = p.src_rank, p.dst_rank
    local = np.flatnonzero((sr == me) & (dr == me))
    cross = np.flatnonzero(sr != dr)
    first, inverse = unique_rows(np.c_[p.src_shard[cross], dr[cross], p.lo[cross], p.size[cross]])
    pieces = np.sort(cross[first])  # unique_rows keeps the earliest row of each group
    numel = p.numel
    send = tuple((r, pieces[(sr[pieces] == me) & (dr[pieces] == r)]) for r in order if r != me)
    recv = tuple((r, pieces[(dr[pieces] == me) & (sr[pieces] == r)]) for r in order if r != me)
    fanout = {int(cross[first[g]]): cross[inverse == g] for g in np.unique(inverse[dr[cross] == me])}
    sent = int(sum(numel[rows].sum() for _, rows in send))
    return _Schedule(local, tuple(s for s in send if s[1].size), tuple(r for r in recv if r[1].size), fanout, sent)


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


def _has_alltoall(backend_name: str) -> bool:
    return any(b in backend_name for b in ("gloo", "nccl", "mpi", "ucc"))


# -- transports -------------------------------------------------------------------------


def _region(p: Plan, k: int, side: str, tensors: dict[int, torch.Tensor]) -> torch.Tensor:
    """The view of row ``k``'s box inside its source (``side="src"``) or destination shard."""
    layout, shard = (p.src, p.src_shard) if side == "src" else (p.dst, p.dst_shard)
    j = int(shard[k])
    return tensors[j][box_slices(p.lo[k].tolist(), p.size[k].tolist(), layout._lo[j].tolist())]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _p2p(p: Plan, sched: _Schedule, src: dict, out: dict, dtype: torch.dtype, wire: torch.device, group: Any) -> None:
    """One message per box; sent from and received into the tensors where the box is contiguous."""
    ops, staged = [], []
    for peer, rows in sched.send:
        for tag, k in enumerate(rows.tolist()):
            box = _region(p, k, "src", src)
            if not (box.is_contiguous() and box.device == wire):
                box = box.to(wire, memory_format=torch.contiguous_format, copy=True)
            ops.append(dist.P2POp(dist.isend, _bytes(box), peer, group, tag))
    for peer, rows in sched.recv:
        for tag, k in enumerate(rows.tolist()):
            box = _region(p, k, "dst", out)
            if not (box.is_contiguous() and box.device == wire):
                staged.append((k, box, buf := torch.empty(box.shape, dtype=dtype, device=wire)))
                box = buf
            else:
                staged.append((k, None, box))
            ops.append(dist.P2POp(dist.irecv, _bytes(box), peer, group, tag))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    for k, target, got in staged:
        _fan_out(p, sched, k, got, out, skip_first=target is None)


def _fan_out(p: Plan, sched: _Schedule, k: int, got: torch.Tensor, out: dict, *, skip_first: bool) -> None:
    """Copies a received box into every destination row that wants it (one per replica shard)."""
    for n, row in enumerate(sched.fanout[k].tolist()):
        if not (skip_first and n == 0):
            _region(p, row, "dst", out).copy_(got)


def _alltoall(
    p: Plan, sched: _Schedule, src: dict, out: dict, dtype: torch.dtype, wire: torch.device, group: Any
) -> None:
    """Packs every box per peer into one buffer and runs a single ``all_to_all_single``."""
    order = dist.get_process_group_ranks(group or dist.group.WORLD)
    numel = p.numel
    send_n = dict.fromkeys(order, 0) | {r: int(numel[rows].sum()) for r, rows in sched.send}
    recv_n = dict.fromkeys(order, 0) | {r: int(numel[rows].sum()) for r, rows in sched.recv}
    sendbuf = torch.empty(sum(send_n.values()), dtype=dtype, device=wire)
    at = 0
    for _, rows in sched.send:
        for k in rows.tolist():
            box = _region(p, k, "src", src)
            sendbuf[at : at + box.numel()].view(box.shape).copy_(box)
            at += box.numel()
    recvbuf = torch.empty(sum(recv_n.values()), dtype=dtype, device=wire)
    item = recvbuf.element_size()
    dist.all_to_all_single(
        _bytes(recvbuf),
        _bytes(sendbuf),
        [recv_n[r] * item for r in order],
        [send_n[r] * item for r in order],
        group=group,
    )
    at = 0
    for _, rows in sched.recv:
        for k in rows.tolist():
            n = int(numel[k])
            _fan_out(p, sched, k, recvbuf[at : at + n].view(tuple(p.size[k].tolist())), out, skip_first=False)
            at += n


# -- check mode -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _layout_digest(layout: Layout) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(layout.shape).encode())
    for a in (layout._lo, layout._sz, layout._rank):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    h.update("|".join(s.placement.device for s in layout.shards).encode())
    return h.digest()


def _describe(op: str, layouts: tuple[Layout, ...], dtype: torch.dtype | None) -> str:
    parts = " -> ".join(repr(x) for x in layouts)
    return f"{op} [{parts}]" + (f" dtype {dtype}" if dtype is not None else "")


def _check_same(
    group: Any, ranks: tuple[int, ...], op: str, layouts: tuple[Layout, ...], dtype: torch.dtype | None
) -> None:
    """All-gathers an 8-byte digest of the call; on a mismatch every rank raises the same error."""
    h = hashlib.blake2b(op.encode() + str(dtype).encode(), digest_size=8)
    for x in layouts:
        h.update(_layout_digest(x))
    wire = (
        torch.device("cuda", torch.cuda.current_device())
        if str(dist.get_backend(group)) == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor([int.from_bytes(h.digest(), "little", signed=True)], dtype=torch.int64, device=wire)
    seen = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(seen, mine, group=group)
    if len({int(t) for t in seen}) == 1:
        return
    calls: list[Any] = [None] * len(ranks)
    dist.all_gather_object(calls, _describe(op, layouts, dtype), group=group)
    by_call: dict[str, list[int]] = {}
    for r, c in zip(ranks, calls):
        by_call.setdefault(c, []).append(r)
    lines = "; ".join(f"ranks {rs} called {c}" for c, rs in by_call.items())
    msg = (
        f"Ranks called different collectives on process group {list(ranks)}: {lines}. Every rank must call "
        "each fshard function with the same arguments, in the same order (SPMD)."
    )
    raise CollectiveMismatchError(msg)
