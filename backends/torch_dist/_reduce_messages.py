"""Large reduce phases by point-to-point messages (see ``_reduce_phase`` for the schedule).

A rank sends each peer its combined contributions to that peer's regions: a region of at
least ``ALONE_MIN_BYTES`` that is one contiguous contribution goes straight from the summand,
nothing packed for it; the others are packed, one message per peer. Over Gloo, where some
message is large, a rank receives one peer's messages at a time, in rank order (every send
is posted first, so each peer's arrive), so it holds buffers for one peer's share at a time,
not for all of them, and combines as the local backend does (its own contributions first,
then the peers ascending): the values are bit-identical. NCCL posts every message at once,
in one batch with the sends. The whole phase waits under one ``config(timeout=...)``.
Sender and receiver list a pair's messages alike, so they agree on each message's tag and size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from fshard._base.cache import cached

from ._reduce_phase import ReduceSchedule, as_bytes, combine_received, combined, reduce_schedule, run_local
from ._transport import ALONE_MIN_BYTES  # the size from which a message goes alone, as ``p2p``'s boxes

__all__ = ["ReduceMessages", "reduce_messages", "run_by_messages"]

_Message = tuple[int, int, Any, tuple[int, ...]]  # (peer, tag, what it sums or where it goes, shape)
_Packed = tuple[int, int, tuple[Any, ...], int]  # (peer, tag, messages as ReduceSchedule lists them, elements)


@dataclasses.dataclass(frozen=True)
class ReduceMessages:
    """How ``run_by_messages`` exchanges a schedule's messages, with their tags (alike on both sides of a pair).

    A pair's messages of at least ``ALONE_MIN_BYTES`` go alone, tagged with their position
    in the pair's list; the others packed in order, in one message tagged with the list's
    length. ``recv_order``: the peers that send, ascending, as the received messages are
    combined.
    """

    send_alone: tuple[_Message, ...]
    send_packed: tuple[_Packed, ...]
    recv_alone: dict[int, tuple[_Message, ...]]
    recv_packed: dict[int, _Packed]
    send_packed_numel: int
    recv_order: tuple[int, ...]


@cached(256)
def reduce_messages(p: Any, me: int, order: tuple[int, ...], itemsize: int) -> ReduceMessages:
    """``reduce_schedule(p, me, order)``'s messages for elements of ``itemsize`` bytes."""
    sched = reduce_schedule(p, me, order)
    send_alone, send_packed, send_numel = _by_size(sched.send, itemsize)
    recv_alone, recv_packed, _ = _by_size(sched.recv, itemsize)
    alone: dict[int, list[_Message]] = {}
    for m in recv_alone:
        alone.setdefault(m[0], []).append(m)
    return ReduceMessages(
        send_alone,
        send_packed,
        {peer: tuple(ms) for peer, ms in alone.items()},
        {m[0]: m for m in recv_packed},
        send_numel,
        tuple(peer for peer, _ in sched.recv_at),
    )


def _by_size(peers: Any, itemsize: int) -> tuple[tuple[_Message, ...], tuple[_Packed, ...], int]:
    alone: list[_Message] = []
    packed: list[_Packed] = []
    total = 0
    for peer, msgs in peers:
        small: list[tuple[Any, tuple[int, ...]]] = []
        for tag, (what, shape) in enumerate(msgs):
            if math.prod(shape) * itemsize >= ALONE_MIN_BYTES:
                alone.append((peer, tag, what, shape))
            else:
                small.append((what, shape))
        if small:
            numel = sum(math.prod(shape) for _, shape in small)
            packed.append((peer, len(msgs), tuple(small), numel))
            total += numel
    return tuple(alone), tuple(packed), total


def run_by_messages(
    sched: ReduceSchedule,
    plan: ReduceMessages,
    src: dict[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    dtype: torch.dtype,
    wire: torch.device,
    group: Any,
    empty: Any,
    guard: Any,
) -> None:
    """Runs a reduce phase by messages (``plan``); see the module."""
    opened = guard.open(group)  # a round of headers alone, in flight while this packs
    ops: list[dist.P2POp] = []
    for peer, tag, parts, shape in plan.send_alone:
        if len(parts) == 1 and (view := src[parts[0][0]][parts[0][1]]).is_contiguous() and view.device == wire:
            sent = view
        else:
            sent = combined(sched, parts, src, empty(shape, dtype, wire))
        ops.append(dist.P2POp(dist.isend, as_bytes(sent), peer, group, tag))
    if plan.send_packed:
        buf, at = empty((plan.send_packed_numel,), dtype, wire), 0
        for peer, tag, msgs, _ in plan.send_packed:
            start = at
            for parts, shape in msgs:
                at += combined(sched, parts, src, buf[at : at + math.prod(shape)].view(shape)).numel()
            ops.append(dist.P2POp(dist.isend, as_bytes(buf[start:at]), peer, group, tag))
    guard.agree(group, opened)  # every rank moves the same data, before any message is posted
    # Over Gloo, where some message is large, one peer's messages are received at a time (every
    # send is posted, so each peer's arrive): buffers for one peer's share, not for all of them.
    # NCCL posts every message in one batch with the sends (a send there waits on the stream for
    # its receive, which must not queue behind the receiver's own sends).
    order = list(plan.recv_order)
    window = 1 if wire.type == "cpu" and plan.recv_alone else len(order)
    sent, posted = _post(ops, [_receives(plan, peer, dtype, wire, group, empty) for peer in order[:window]])
    ops.clear()
    done = run_local(sched, src, out, dtype)
    deadline = guard.deadline()  # one bound for the whole phase
    for k in range(len(order)):  # peers ascending, as the local backend combines
        guard.wait_all(posted[k][0], deadline)
        combine_received(sched, posted[k][1], out, done)
        posted[k] = ([], [])  # this peer's buffers (and the works that hold them), before the next peer's are made
        if k + window < len(order):
            posted += _post([], [_receives(plan, order[k + window], dtype, wire, group, empty)])[1]
    guard.wait_all(sent, deadline)


def _post(
    sends: list[dist.P2POp], receives: list[tuple[list[dist.P2POp], list[tuple[torch.Tensor, Any]]]]
) -> tuple[list[Any], list[tuple[list[Any], list[tuple[torch.Tensor, Any]]]]]:
    """Posts ``sends`` and some peers' ``receives`` in one batch.

    Returns the sends' works and, per peer, its receives' works and buffers: after this, nothing
    else holds a peer's buffers.
    """
    ops = sends + [op for peer_ops, _ in receives for op in peer_ops]
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    at = len(sends)
    posted: list[tuple[list[Any], list[tuple[torch.Tensor, Any]]]] = []
    for peer_ops, got in receives:
        posted.append((works[at : at + len(peer_ops)], got))
        at += len(peer_ops)
    return works[: len(sends)], posted


def _receives(
    plan: ReduceMessages, peer: int, dtype: torch.dtype, wire: torch.device, group: Any, empty: Any
) -> tuple[list[dist.P2POp], list[tuple[torch.Tensor, Any]]]:
    """The receives of ``peer``'s messages, to post, and (buffer, what goes where) of each."""
    ops: list[dist.P2POp] = []
    got: list[tuple[torch.Tensor, Any]] = []
    for _, tag, targets, shape in plan.recv_alone.get(peer, ()):
        got.append((buf := empty(shape, dtype, wire), ((targets, shape),)))
        ops.append(dist.P2POp(dist.irecv, as_bytes(buf), peer, group, tag))
    if (packed := plan.recv_packed.get(peer)) is not None:
        _, tag, msgs, numel = packed
        got.append((buf := empty((numel,), dtype, wire), msgs))
        ops.append(dist.P2POp(dist.irecv, as_bytes(buf), peer, group, tag))
    return ops, got
