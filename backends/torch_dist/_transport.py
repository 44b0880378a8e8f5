"""Transports: a rank's schedule run over point-to-point messages or one all_to_all_single."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fshard._alloc import new

from ._reduce import all_to_all
from ._schedule import Index, Schedule, Span


def _view(tensors: dict[int, torch.Tensor], at: Index) -> torch.Tensor:
    """The box ``at`` = (shard, slices) as a view of that shard's tensor."""
    return tensors[at[0]][at[1]]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` can be viewed as bytes in place: contiguous, and unit-strided even with one
    element (torch calls a one-element view with any stride contiguous)."""
    return t.is_contiguous() and (t.numel() != 1 or t.reshape(-1).stride(0) == 1)


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor; on the CPU from memory that is already mapped."""
    return new(tuple(shape), dtype, device)


def p2p(sched: Schedule, src: dict, out: dict, dtype: torch.dtype, wire: torch.device, group: Any) -> None:
    """One message per box; sent from and received into the tensors where the box is contiguous.

    This rank's own copies (``sched.local``) run while the messages are in flight.
    """
    ops, staged = [], []
    n = 0
    for peer, boxes in sched.recv:
        for tag, at in enumerate(boxes):
            box = _view(out, at)
            if not (_contiguous(box) and box.device == wire):
                staged.append((n, box, buf := empty(box.shape, dtype, wire)))
                box = buf
            else:
                staged.append((n, None, box))
            ops.append(dist.P2POp(dist.irecv, _bytes(box), peer, group, tag))
            n += 1
    for peer, boxes in sched.send:
        for tag, at in enumerate(boxes):
            box = _view(src, at)
            if not (_contiguous(box) and box.device == wire):
                box = empty(box.shape, dtype, wire).copy_(box)
            ops.append(dist.P2POp(dist.isend, _bytes(box), peer, group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    copy_local(sched, src, out)
    for work in works:
        work.wait()
    for k, target, got in staged:
        if target is not None:
            target.copy_(got)
        _fan_out(sched, k, got, out)


def copy_local(sched: Schedule, src: dict, out: dict) -> None:
    """This rank's copies between its own shards (``sched.local``: the schedule's local moves)."""
    for read, write in sched.local:
        _view(out, write).copy_(_view(src, read))


def _fan_out(sched: Schedule, k: int, got: torch.Tensor, out: dict) -> None:
    """Copies received box ``k`` into the other destination shards that want it (replicas on this rank)."""
    for at in sched.fanout[k]:
        _view(out, at).copy_(got)


def _in_place(span: Span | None, tensors: dict, wire: torch.device) -> torch.Tensor | None:
    """One flat view over boxes that lie back to back in one shard (``span``), when that
    shard's tensor is contiguous and on the wire device (so they need no packing)."""
    if span is None:
        return None
    base = tensors[span[0]]
    if base.device != wire or not _contiguous(base):
        return None
    return base.reshape(-1)[span[1] : span[2]]


def alltoall(sched: Schedule, src: dict, out: dict, dtype: torch.dtype, wire: torch.device, group: Any) -> None:
    """Packs every box per peer into one buffer and runs a single ``all_to_all_single``.

    Boxes already back to back in one tensor are sent or received in place; this rank's
    own copies (``sched.local``) run while the collective is in flight.
    """
    sendbuf = _in_place(sched.send_span, src, wire)
    if sendbuf is None:
        sendbuf = empty((sum(sched.send_split),), dtype, wire)
        at = 0
        for _, boxes in sched.send:
            for where in boxes:
                box = _view(src, where)
                sendbuf[at : at + box.numel()].view(box.shape).copy_(box)
                at += box.numel()
    recvbuf = _in_place(sched.recv_span, out, wire)
    staged = recvbuf is None
    if staged:
        recvbuf = empty((sum(sched.recv_split),), dtype, wire)
    work = all_to_all(recvbuf, sendbuf, sched.recv_split, sched.send_split, group)
    copy_local(sched, src, out)
    work.wait()
    at, k = 0, 0
    for _, boxes in sched.recv:
        for where in boxes:
            shape = tuple(s.stop - s.start for s in where[1])
            n = math.prod(shape)
            got = recvbuf[at : at + n].view(shape)
            if staged:
                _view(out, where).copy_(got)
            _fan_out(sched, k, got, out)
            at, k = at + n, k + 1
