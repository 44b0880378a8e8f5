"""Transports: a rank's schedule run over point-to-point messages or one all_to_all_single."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fshard._base.alloc import new

from ._guard import Guard
from ._lowering import Index, Peer, Run, Schedule, Span
from ._reduce_phase import as_bytes


def _view(tensors: dict[int, torch.Tensor], at: Index) -> torch.Tensor:
    """The box ``at`` = (shard, slices) as a view of that shard's tensor."""
    return tensors[at[0]][at[1]]


def _contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` can be viewed as bytes in place.

    It can when contiguous, and unit-strided even with one element (torch calls a one-element
    view with any stride contiguous).
    """
    return t.is_contiguous() and (t.numel() != 1 or t.reshape(-1).stride(0) == 1)


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor; on the CPU from memory that is already mapped."""
    return new(tuple(shape), dtype, device)


# Boxes of fewer bytes than this travel packed, one message per peer: a message costs more
# than copying such a box (Gloo on loopback). Larger boxes go alone, sent from and received
# into the shards where they are contiguous, so no buffer is alive for them in flight.
ALONE_MIN_BYTES = 1 << 18

_Box = tuple[int, Index, tuple[int, ...], int]  # (box number, box, shape, elements)
_Alone = tuple[int, int, int, Index]  # (peer, tag, box number, box)
_Packed = tuple[int, int, tuple[_Box, ...]]  # (peer, tag, boxes)


@dataclasses.dataclass(frozen=True)
class Messages:
    """The messages ``p2p`` exchanges for a schedule, with their tags (alike on both sides of a pair).

    A pair's boxes of at least ``ALONE_MIN_BYTES`` go one message each, tagged with the box's
    position in the pair's list; the others go packed in order, in one message tagged with the
    list's length. ``recv_alone``/``recv_packed`` carry each received box's number (for
    ``Schedule.fanout``) and every box its shape and elements.
    """

    send_alone: tuple[tuple[int, int, Index], ...]  # (peer, tag, box)
    send_packed: tuple[_Packed, ...]
    recv_alone: tuple[_Alone, ...]
    recv_packed: tuple[_Packed, ...]
    send_packed_numel: int
    recv_packed_numel: int


def messages(sched: Schedule, itemsize: int) -> Messages:
    """How ``p2p`` carries ``sched`` for elements of ``itemsize`` bytes (O(the rank's boxes))."""
    send_alone, send_packed, send_numel = _split(sched.send, itemsize)
    recv_alone, recv_packed, recv_numel = _split(sched.recv, itemsize)
    sends = tuple((peer, tag, at) for peer, tag, _, at in send_alone)
    return Messages(sends, send_packed, recv_alone, recv_packed, send_numel, recv_numel)


def _split(peers: tuple[Peer, ...], itemsize: int) -> tuple[tuple[_Alone, ...], tuple[_Packed, ...], int]:
    """The boxes exchanged with ``peers`` that go alone, those packed per peer, and the packed elements."""
    alone: list[_Alone] = []
    packed: list[_Packed] = []
    k = total = 0
    for peer, boxes in peers:
        small: list[_Box] = []
        for tag, at in enumerate(boxes):
            shape = tuple(s.stop - s.start for s in at[1])
            numel = math.prod(shape)
            if numel * itemsize >= ALONE_MIN_BYTES:
                alone.append((peer, tag, k, at))
            else:
                small.append((k, at, shape, numel))
                total += numel
            k += 1
        if small:
            packed.append((peer, len(boxes), tuple(small)))
    return tuple(alone), tuple(packed), total


def p2p(
    sched: Schedule,
    src: dict[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    guard: Guard,
    opened: Any = None,
    *,
    plan: Messages,
    own: bool = False,
    later: bool = False,
) -> Callable[[], None]:
    """Starts the messages of ``plan``: large boxes alone, sent from and received into the tensors; small ones packed.

    A large box that is not contiguous (columns of a row chunk) is staged in a buffer of its
    own; the small boxes of each pair travel packed in one message. This rank's own copies
    (``sched.local``) run while the messages are in flight. The messages follow the
    movement's round of headers (``guard``; ``opened``: that round, already in flight);
    where the data fits in that round, it goes there instead (``alltoall``), so small moves
    take one round.

    Returns the function that waits for the messages and puts what they carried in place
    (``out`` holds the result once it has returned); ``own`` and ``later`` as ``alltoall``'s.
    Messages are received into the outputs, so they are made before (``later`` is false)
    unless the data travels with the headers.
    """
    if guard.inline:
        return alltoall(sched, src, out, dtype, wire, group, guard, own=own, later=later)
    if later:
        raise RuntimeError("fshard internal error: p2p() receives into the outputs; they cannot come later.")
    ops: list[dist.P2POp] = []
    landed: list[tuple[torch.Tensor, tuple[_Box, ...]]] = []  # buffers copied into place at the wait
    fanned: list[tuple[int, torch.Tensor]] = []  # boxes received in place that other shards also want
    for peer, tag, k, at in plan.recv_alone:
        box = _view(out, at)
        if _contiguous(box) and box.device == wire:
            if sched.fanout[k]:
                fanned.append((k, box))
        else:
            shape = tuple(box.shape)
            landed.append((buf := empty(shape, dtype, wire), ((k, at, shape, box.numel()),)))
            box = buf
        ops.append(dist.P2POp(dist.irecv, as_bytes(box), peer, group, tag))
    if plan.recv_packed:
        buf, offset = empty((plan.recv_packed_numel,), dtype, wire), 0
        for peer, tag, boxes in plan.recv_packed:
            seg = buf[offset : offset + sum(b[3] for b in boxes)]
            landed.append((seg, boxes))
            ops.append(dist.P2POp(dist.irecv, as_bytes(seg), peer, group, tag))
            offset += seg.numel()
    for peer, tag, at in plan.send_alone:
        box = _view(src, at)
        if not (_contiguous(box) and box.device == wire):
            box = empty(tuple(box.shape), dtype, wire).copy_(box)
        ops.append(dist.P2POp(dist.isend, as_bytes(box), peer, group, tag))
    if plan.send_packed:
        buf, offset = empty((plan.send_packed_numel,), dtype, wire), 0
        for peer, tag, boxes in plan.send_packed:
            start = offset
            for _, at, shape, numel in boxes:
                buf[offset : offset + numel].view(shape).copy_(_view(src, at))
                offset += numel
            ops.append(dist.P2POp(dist.isend, as_bytes(buf[start:offset]), peer, group, tag))
    guard.agree(group, opened)  # every rank moves the same data, before any message is posted
    works = dist.batch_isend_irecv(ops) if ops else []
    copy_local(sched, src, out)

    def finish() -> None:
        guard.wait_all(works)
        works.clear()
        ops.clear()  # the buffers the messages used, alive until here
        for k, box in fanned:
            _fan_out(sched.fanout[k], box, out)
        for buf, boxes in landed:
            offset = 0
            for k, at, shape, numel in boxes:
                got = buf[offset : offset + numel].view(shape)
                _view(out, at).copy_(got)
                _fan_out(sched.fanout[k], got, out)
                offset += numel
        landed.clear()

    return finish


def copy_local(sched: Schedule, src: dict[int, torch.Tensor], out: dict[int, torch.Tensor]) -> None:
    """This rank's copies between its own shards (``sched.local``: the schedule's local moves)."""
    for read, write in sched.local:
        _view(out, write).copy_(_view(src, read))


def _fan_out(targets: tuple[Index, ...], got: torch.Tensor, out: dict[int, torch.Tensor]) -> None:
    """Copies a received box into the other destination shards that want it (replicas on this rank)."""
    for at in targets:
        _view(out, at).copy_(got)


def _region(tensors: dict[int, torch.Tensor], run: Run) -> torch.Tensor:
    """The run's boxes as one view of shape (copies, *box shape) of its shard's tensor.

    One ``as_strided`` of a plain tensor (the strides are the tensor's own, so strided inputs
    work), else the same view by slicing and ``unfold``.
    """
    t = tensors[run.shard]
    if type(t) is torch.Tensor and not (t.is_conj() or t.is_neg()):
        st = t.stride()
        offset = t.storage_offset()
        for s, k in zip(run.region, st):
            offset += s.start * k
        lead = run.step * st[run.dim] if run.dim is not None and run.dim >= 0 else 0
        return t.as_strided((run.copies, *run.shape), (lead, *st), offset)
    view = t[run.region]
    if run.dim is None:
        return view.unsqueeze(0)
    if run.dim < 0:
        return view.unsqueeze(0).expand(run.copies, *run.shape)
    return view.unfold(run.dim, run.shape[run.dim], run.step).movedim(run.dim, 0).movedim(-1, run.dim + 1)


def _pack(runs: tuple[Run, ...], tensors: dict[int, torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    """Copies the runs' boxes, in order, into the flat ``buf`` (one ``copy_`` per run); returns ``buf``."""
    at = buf.storage_offset()
    for run in runs:
        buf.as_strided((run.copies, *run.shape), run.contiguous, at).copy_(_region(tensors, run))
        at += run.numel
    return buf


def _unpack(runs: tuple[Run, ...], buf: torch.Tensor, tensors: dict[int, torch.Tensor]) -> None:
    """Copies the flat ``buf``, in order, into the runs' boxes (one ``copy_`` per run)."""
    at = buf.storage_offset()
    for run in runs:
        _region(tensors, run).copy_(buf.as_strided((run.copies, *run.shape), run.contiguous, at))
        at += run.numel


def _in_place(span: Span | None, tensors: dict[int, torch.Tensor], wire: torch.device) -> torch.Tensor | None:
    """One flat view over boxes that lie back to back in one shard (``span``).

    Only when that shard's tensor is contiguous and on the wire device (so they need no packing).
    """
    if span is None:
        return None
    base = tensors[span[0]]
    if base.device != wire or not _contiguous(base):
        return None
    return base.reshape(-1)[span[1] : span[2]]


def alltoall(
    sched: Schedule,
    src: dict[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    guard: Guard,
    opened: Any = None,
    *,
    own: bool = False,
    later: bool = False,
) -> Callable[[], None]:
    """Packs every box per peer into one buffer and starts a single ``all_to_all_single``.

    ``sched.exchange`` says how: boxes already back to back in one tensor are sent or
    received in place, the others packed or unpacked with one strided copy per run of
    boxes. This rank's own copies (``sched.local``) run while the collective is in
    flight, or travel in its own segment of it where that lets every received box land in
    place. ``guard`` carries the movement's headers: with the data where it fits (then the
    own copies never travel, as the round bounds what a segment holds), else in a round of
    their own first (``opened``, in flight while this packs).

    Returns the function that waits for it and unpacks (``out`` holds the result once it has
    returned). The send buffer is let go once the collective is through, before unpacking.
    ``own``: the round gets a receive buffer of its own, so that it may stay in flight while
    other movements run (a launched movement). ``later``: ``out`` is empty, and the caller
    puts the destination shards in it before the wait, so that they are not alive while the
    movement is in flight (for a movement received into a buffer anyway); this rank's own
    copies wait too.
    """
    ex = sched.plain if guard.inline else sched.exchange
    sendbuf = _in_place(ex.send_span, src, wire)
    if sendbuf is None:
        sendbuf = _pack(ex.send_runs, src, empty((sum(ex.send_split),), dtype, wire))
    recvbuf = None if later else _in_place(ex.recv_span, out, wire)
    staged = recvbuf is None
    if recvbuf is None:
        recvbuf = empty((sum(ex.recv_split),), dtype, wire)
    work = guard.start(recvbuf, sendbuf, ex.recv_split, ex.send_split, group, opened, own=own)
    own_copies = not ex.local and bool(sched.local)
    if own_copies and not later:
        copy_local(sched, src, out)
    held: list[Any] = [work, recvbuf, sendbuf]  # alive until the collective is through
    sources = [src] if own_copies and later else []  # read at the wait: nothing else is kept for it

    def finish() -> None:
        held[0].wait()
        got = held[1]
        del held[:]
        if sources:
            copy_local(sched, sources.pop(), out)
        if staged:
            _unpack(ex.recv_runs, got, out)
        for at, shape, targets in ex.fanout:
            _fan_out(targets, got[at : at + math.prod(shape)].view(shape), out)

    return finish
