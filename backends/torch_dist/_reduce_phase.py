"""Reduce phases over torch.distributed (see ``fshard._plan.pending`` for the plans).

A rank combines its own contributions to each (peer, region) before sending, so a
region crosses between two ranks at most once; all messages go out in one
``all_to_all_single`` with split sizes (a large phase by messages instead:
``_reduce_messages``), and the receiver combines them with its own contributions (its
own first, then by peer rank ascending, as the local backend does). A rank's share
comes from ``plan.for_rank(rank)``, computed from the layouts alone: no rank reads the
global plan's rows (O(world^2) for a reduce-scatter).

Where the layouts are those of a collective, ``_reduce_collective`` runs them instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from fshard._base.boxes import rows_prod, unique_rows
from fshard._base.cache import cached
from fshard._layout.layout import Layout
from fshard._plan.schedule import Moves, RankSchedule

from .._execution import accumulate, identity
from ._watch import handed

__all__ = [
    "ReduceSchedule",
    "Slices",
    "all_to_all",
    "as_bytes",
    "reduce_schedule",
    "run_local",
    "combine_received",
    "combined",
    "run_reduce",
]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

Slices = tuple[slice, ...]
_Send = tuple[tuple[tuple[int, Slices], ...], tuple[int, ...]]  # (source shard, read) to combine; region's shape
_Recv = tuple[tuple[tuple[int, Slices, int], ...], tuple[int, ...]]  # (destination shard, write, region id); shape


@dataclasses.dataclass(frozen=True)
class ReduceSchedule:
    """One rank's share of a reduce phase, with every index it needs computed once.

    ``fill``: this rank's destination shards with elements that no contribution reaches
    (they start as the identity). ``local``: (source shard, read, destination shard,
    write, region id) of each contribution between this rank's shards, in the plan's
    order. ``send``/``recv``: per peer in group order (the order of the all-to-all's
    segments), the messages exchanged with it, ordered by region on both sides: a sender
    lists the source boxes it combines (each source shard once), a receiver the
    destination shards it writes (each once). ``recv_at``: each peer that sends, ascending,
    and where its segment starts in the receive buffer: messages are combined in that
    order, as the local backend combines them, whatever the group's order.
    A region id names one (destination shard, region) of this rank: the first
    contribution to it is copied, later ones combined.
    """

    op: str
    fill: frozenset[int]
    local: tuple[tuple[int, Slices, int, Slices, int], ...]
    send: tuple[tuple[int, tuple[_Send, ...]], ...]
    recv: tuple[tuple[int, tuple[_Recv, ...]], ...]
    recv_at: tuple[tuple[int, int], ...]
    send_split: tuple[int, ...]
    recv_split: tuple[int, ...]
    sent: int


@cached(256)
def reduce_schedule(p: Any, me: int, order: tuple[int, ...]) -> ReduceSchedule:
    """Rank ``me``'s share of the reduce phase ``p``, peers in the group order ``order``.

    From ``p.for_rank(me)`` (the layouts alone: never the global plan's rows).
    """
    rs = p.for_rank(me)
    if rs.steps or rs.op is None:
        raise ValueError("reduce_schedule() runs one reduce phase (a plan with op set and no steps).")
    position = {r: n for n, r in enumerate(order)}
    mine = _regions(rs.local, rs.recv)
    local = [
        (i, _box(read, z), j, _box(write, z), mine[(j, tuple(lo))])
        for i, j, lo, z, read, write in _columns(rs.local, p.src, p.dst)
    ]
    send: dict[int, dict[tuple[int, ...], tuple[dict[int, Slices], tuple[int, ...]]]] = {}
    for (i, _, lo, z, read, _), peer in zip(_columns(rs.send, p.src, p.dst), rs.send.peer.tolist()):
        parts, _ = send.setdefault(peer, {}).setdefault(tuple(lo), ({}, tuple(z)))
        parts.setdefault(i, _box(read, z))  # a source shard contributes once to a region
    recv: dict[int, dict[tuple[int, ...], tuple[dict[int, tuple[Slices, int]], tuple[int, ...]]]] = {}
    for (_, j, lo, z, _, write), peer in zip(_columns(rs.recv, p.src, p.dst), rs.recv.peer.tolist()):
        targets, _ = recv.setdefault(peer, {}).setdefault(tuple(lo), ({}, tuple(z)))
        targets.setdefault(j, (_box(write, z), mine[(j, tuple(lo))]))  # a shard is written once per message
    sends = tuple(
        (peer, tuple((tuple(parts.items()), shape) for _, (parts, shape) in sorted(send[peer].items())))
        for peer in sorted(send, key=position.__getitem__)
    )
    recvs = tuple(
        (
            peer,
            tuple(
                (tuple((j, *t) for j, t in targets.items()), shape)
                for _, (targets, shape) in sorted(recv[peer].items())
            ),
        )
        for peer in sorted(recv, key=position.__getitem__)
    )
    send_split, recv_split = _split(sends, position), _split(recvs, position)
    starts = np.cumsum(recv_split) - recv_split
    recv_at = tuple(sorted((peer, int(starts[position[peer]])) for peer, _ in recvs))
    fill = _needs_fill(rs, p.dst)
    return ReduceSchedule(rs.op, fill, tuple(local), sends, recvs, recv_at, send_split, recv_split, sum(send_split))


def _columns(m: Moves, src: Layout, dst: Layout) -> Any:
    """The rows of ``m`` as Python values.

    Each is (source shard, destination shard, lo, size, lo in the source shard, lo in the
    destination shard).
    """
    read = (m.lo - src.columns.lo[m.src_shard]).tolist()
    write = (m.lo - dst.columns.lo[m.dst_shard]).tolist()
    return zip(m.src_shard.tolist(), m.dst_shard.tolist(), m.lo.tolist(), m.size.tolist(), read, write)


def _box(at: list[int], size: list[int]) -> Slices:
    return tuple(slice(a, a + n) for a, n in zip(at, size))


def _regions(*moves: Moves) -> dict[tuple[int, tuple[int, ...]], int]:
    """A number for each distinct (destination shard, region lo) of ``moves``."""
    out: dict[tuple[int, tuple[int, ...]], int] = {}
    for m in moves:
        for j, lo in zip(m.dst_shard.tolist(), m.lo.tolist()):
            out.setdefault((j, tuple(lo)), len(out))
    return out


def _needs_fill(rs: RankSchedule, dst: Layout) -> frozenset[int]:
    """This rank's destination shards with elements that none of its contributions reaches."""
    j = np.concatenate([rs.local.dst_shard, rs.recv.dst_shard])
    lo = np.concatenate([rs.local.lo, rs.recv.lo]).reshape(len(j), dst.ndim)
    numel = np.concatenate([rs.local.numel, rs.recv.numel])
    first, _ = unique_rows(np.c_[j, lo])
    covered = np.zeros(len(dst.shards), np.int64)
    np.add.at(covered, j[first], numel[first])
    own = np.array(dst.indices_on(rs.rank), np.int64)
    short = covered[own] < rows_prod(dst.columns.sz[own]) if len(own) else np.zeros(0, bool)
    return frozenset(own[short].tolist())


def _split(by_peer: Any, position: dict[int, int]) -> tuple[int, ...]:
    counts = [0] * len(position)
    for peer, msgs in by_peer:
        counts[position[peer]] = sum(math.prod(shape) for _, shape in msgs)
    return tuple(counts)


def run_local(
    sched: ReduceSchedule, src: dict[int, torch.Tensor], out: dict[int, torch.Tensor], dtype: torch.dtype
) -> set[int]:
    """Fills the shards that need it with the identity and combines this rank's own contributions.

    Returns the regions written.
    """
    for j in sched.fill:
        out[j].fill_(identity(sched.op, dtype))
    done: set[int] = set()
    for i, read, j, write, region in sched.local:
        _combine(sched, out[j][write], src[i][read], region, j, done)
    return done


def _combine(
    sched: ReduceSchedule, into: torch.Tensor, value: torch.Tensor, region: int, j: int, done: set[int]
) -> None:
    """``into = value`` for the first contribution to a region (of a shard not filled), else ``op``."""
    if region in done or j in sched.fill:
        accumulate(sched.op, into, value)
    else:
        into.copy_(value)
        done.add(region)


def combined(sched: ReduceSchedule, parts: Any, src: dict[int, torch.Tensor], into: torch.Tensor) -> torch.Tensor:
    """``into`` = this rank's contributions ``parts`` to one region, combined."""
    for n, (i, read) in enumerate(parts):
        if n == 0:
            into.copy_(src[i][read])
        else:
            accumulate(sched.op, into, src[i][read])
    return into


def combine_received(
    sched: ReduceSchedule, got: list[tuple[torch.Tensor, Any]], out: dict[int, torch.Tensor], done: set[int]
) -> None:
    """Combines received messages into this rank's destination shards.

    ``got``: (a buffer, the messages it holds in order) each.
    """
    for buf, msgs in got:
        at = 0
        for targets, shape in msgs:
            value = buf[at : at + math.prod(shape)].view(shape)
            for j, write, region in targets:
                _combine(sched, out[j][write], value, region, j, done)
            at += value.numel()


def run_reduce(
    sched: ReduceSchedule,
    src: dict[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    empty: Any,
    guard: Any,
) -> None:
    """Runs a reduce phase by one ``all_to_all_single`` of packed buffers.

    Combines this rank's contributions per peer and region into the send buffer, exchanges
    them while combining this rank's own, then combines what arrived. ``guard``
    (``_guard.Guard``) starts the exchange behind the movement's headers (or carries the data
    inline). Large phases go by messages instead (``_reduce_messages``).
    """
    opened = guard.open(group)  # a round of headers alone, in flight while this packs
    sendbuf = empty((sum(sched.send_split),), dtype, wire)
    at = 0
    for _, msgs in sched.send:
        for parts, shape in msgs:
            at += combined(sched, parts, src, sendbuf[at : at + math.prod(shape)].view(shape)).numel()
    recvbuf = empty((sum(sched.recv_split),), dtype, wire)
    work = guard.start(recvbuf, sendbuf, sched.recv_split, sched.send_split, group, opened)
    done = run_local(sched, src, out, dtype)
    work.wait()
    messages = dict(sched.recv)
    for peer, at in sched.recv_at:  # peers ascending, as the local backend combines
        combine_received(sched, [(recvbuf[at:], messages[peer])], out, done)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``t`` as a flat view of its bytes (so any dtype goes through a collective)."""
    if t.dim() == 1 and not t.requires_grad:  # the buffers of a movement: one view
        return t.view(torch.uint8)
    return t.detach().reshape(-1).view(torch.uint8)


def all_to_all(recvbuf: torch.Tensor, sendbuf: torch.Tensor, recv_split: Any, send_split: Any, group: Any) -> Any:
    """Starts one ``all_to_all_single`` of flat buffers, split in elements per rank of the group.

    Sent as bytes (so any dtype goes through); returns its ``Work``.
    """
    item = recvbuf.element_size()
    got, sent = handed(as_bytes(recvbuf), as_bytes(sendbuf))
    work = cast(
        "dist.Work | None",
        dist.all_to_all_single(  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
            got,
            sent,
            [n * item for n in recv_split],
            [n * item for n in send_split],
            group=group,
            async_op=True,
        ),
    )
    assert work is not None  # async_op=True always returns a Work
    return work
