"""Reductions whose layouts are a collective's (see ``_reduce_phase`` for the general reduce phase).

``all_reduce`` for a full-shape pending reduction on every rank of the group to a full
copy on each, ``reduce_scatter_tensor`` for the same to equal dim-0 chunks in group order
(NCCL implements both in-network). Under Gloo, whose ``all_reduce`` adds in an order of
its own, that all-reduce runs the plan instead (``_all_reduce_in_order``): each element is
combined on its owner as the plan's reduce phase combines it (the owner's own summand
first, then the other ranks' ascending), by one all-to-all (by messages where large), then
the owners send their parts to every rank by messages; the same elements as a ring
all-reduce, and the local backend's bits. One that fits behind the headers is combined on
every rank in the owners' order (``combine_inline``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from fshard._base.alloc import new
from fshard._base.cache import cached
from fshard._layout.layout import Layout

from .._execution import accumulate
from ._reduce_phase import Slices, as_bytes, reduce_schedule, run_reduce
from ._watch import handed

__all__ = ["collective_kind", "combine_inline", "run_collective", "start_all_reduce"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _box(at: list[int], size: list[int]) -> Slices:
    return tuple(slice(a, a + n) for a, n in zip(at, size))


@cached(256)
def collective_kind(p: Any, order: tuple[int, ...], nccl: bool = True) -> str | None:
    """``"all_reduce"``, ``"reduce_scatter"`` or ``None``: whether a collective runs plan ``p``.

    Both need a full-shape summand on every rank of the group (one each) and no other
    shards, every copy a summand of its own (no ``terms``: replicas of a summand would be
    summed once per copy by a collective over the whole group); ``all_reduce`` a full copy
    on every rank, ``reduce_scatter`` equal dim-0
    chunks in group order (one each), and NCCL: Gloo's reduce-scatter is slower than
    the packed all-to-all that carries the same bytes (66 ms against 36 ms at 16 MiB
    on 4 processes, ``python -m fshard bench --only partial-chunk``).
    """
    src, dst = p.src, p.dst
    if src.partial is None or src.terms is not None or dst.partial is not None or not _one_each(src, order):
        return None
    if not all(s.sizes == src.shape for s in src.shards):
        return None
    if _one_each(dst, order) and all(s.sizes == dst.shape for s in dst.shards):
        return "all_reduce"
    n = len(order)
    if not nccl or not _one_each(dst, order) or not dst.ndim or dst.shape[0] % n:
        return None
    rows = dst.shape[0] // n
    by_rank = {s.placement.rank: s for s in dst.shards}
    for k, r in enumerate(order):
        s = by_rank[r]
        if s.offsets[0] != k * rows or s.sizes != (rows, *dst.shape[1:]) or any(s.offsets[1:]):
            return None
    return "reduce_scatter"


def _one_each(layout: Layout, order: tuple[int, ...]) -> bool:
    ranks = layout.columns.rank.tolist()
    return len(ranks) == len(order) and set(ranks) == set(order)


def start_all_reduce(p: Any, mine: torch.Tensor, out: torch.Tensor, group: Any, guard: Any) -> dist.Work:
    """``all_reduce`` of this rank's summand ``mine`` into ``out``, in flight after the round of headers (``guard``).

    ``out`` may be ``mine`` itself: the sum is then written over it. ``guard`` ``None``: the
    ranks agreed on the sum before (``launch``'s ``checked``), no round here.
    """
    if guard is not None:
        guard.agree(group)
    if out is not mine:
        out.copy_(mine)
    (summed,) = handed(out)  # written in place: out holds the sum
    return cast("dist.Work", dist.all_reduce(summed, op=_OPS[p.src.partial], group=group, async_op=True))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch


@cached(256)
def _owner_order(p: Any, ranks: tuple[int, ...]) -> tuple[tuple[Slices, tuple[int, ...]], ...]:
    """Per owner's part of an all-reduce plan ``p``: its slices and the positions in ``ranks`` in combination order.

    The owners are the destination of the plan's reduce phase (``fshard._plan.pending``), where
    each element's summands are combined as the local backend combines them: the owner's own
    first, then one message per other rank, ascending. Every rank holds one full summand
    (``collective_kind``), so that is the owner's, then the other ranks' by global rank.
    """
    owners = p.steps[0].dst if p.steps else p.dst
    cols = owners.columns
    position = {r: n for n, r in enumerate(ranks)}
    parts: list[tuple[Slices, tuple[int, ...]]] = []
    for lo, size, owner in zip(cols.lo.tolist(), cols.sz.tolist(), cols.rank.tolist()):
        rest = sorted(r for r in ranks if r != owner)
        parts.append((_box(lo, size), tuple(position[r] for r in (owner, *rest))))
    return tuple(parts)


def combine_inline(p: Any, mine: torch.Tensor, guard: Any, group: Any) -> torch.Tensor:
    """An all-reduce of this rank's summand ``mine`` (on the CPU) as one inline round of ``guard``.

    Every rank sends its summand behind its header to every other rank, and combines each
    owner's part of the plan in that owner's order (``_owner_order``), so every rank computes
    the bits that the plan's reduce-scatter and all-gather give, on either backend. For data
    that fits behind the headers (``guard.inline``): one round where ``all_reduce`` takes two
    (headers, then data), each summand sent to every rank instead of its parts to their owners.
    """
    ranks, me = guard.ranks, guard.ranks.index(guard.rank)
    flat = mine.detach().reshape(-1)
    k = flat.numel()
    split = [0 if i == me else k for i in range(len(ranks))]
    got = torch.empty((len(ranks) - 1) * k, dtype=flat.dtype)
    guard.start(got, flat.repeat(len(ranks) - 1), split, split, group).wait()
    pieces = list(got.view(len(ranks) - 1, k).unbind())
    pieces.insert(me, flat)
    shape = tuple(p.src.shape)
    whole = [piece.view(shape) for piece in pieces]
    out = torch.empty(shape, dtype=flat.dtype)
    for box, order in _owner_order(p, ranks):
        into = out[box]
        into.copy_(whole[order[0]][box])
        for n in order[1:]:
            accumulate(p.src.partial, into, whole[n][box])
    return out.view(-1)


# A large all-reduce's reduce phase goes by messages, as ``_choice.by_messages`` sends other reduce
# phases: from this many bytes sent per rank on average. Below, one all-to-all has less latency.
_MESSAGES_MIN_BYTES = 1 << 20


def _all_reduce_in_order(p: Any, mine: torch.Tensor, out: torch.Tensor, group: Any, guard: Any) -> None:
    """The all-reduce plan ``p`` of this rank's summand ``mine`` into ``out`` (both on the CPU), in the plan's order.

    Its reduce phase combines each owner's parts of ``out`` as the plan does (``_owner_order``):
    by one all-to-all after the round of headers (``run_reduce``), or, where large, by messages
    (``_reduce_by_messages``); then each owner sends its parts to every other rank
    (``_share_parts``). The same elements as the plan (a reduce-scatter and an all-gather) and
    as a ring ``all_reduce``.
    """
    ranks, me, reduce = guard.ranks, guard.rank, p.steps[0]
    parts = _owner_order(p, ranks)
    owned = {j: out[box] for j, (box, order) in enumerate(parts) if ranks[order[0]] == me}
    if reduce.min_elements_sent * out.element_size() >= len(ranks) * _MESSAGES_MIN_BYTES:
        _reduce_by_messages(p.src.partial, parts, mine, owned, group, guard)
    else:
        (i,) = reduce.src.indices_on(me)
        run_reduce(reduce_schedule(reduce, me, ranks), {i: mine}, owned, out.dtype, out.device, group, new, guard)
    _share_parts(parts, owned, out, group, guard)


def _reduce_by_messages(
    op: str, parts: Any, mine: torch.Tensor, owned: dict[int, torch.Tensor], group: Any, guard: Any
) -> None:
    """Every owner's parts of ``mine`` sent to it; this rank's own parts (``owned``) combined in the plan's order.

    Its own summand first, then one peer's message at a time, peers ascending: buffers for one
    peer's parts, not for all of them. A part that is a contiguous range of ``mine`` is sent from it.
    """
    ranks, me = guard.ranks, guard.rank
    guard.agree(group)
    deadline = guard.deadline()
    sends = [
        dist.P2POp(dist.isend, as_bytes(mine[box].contiguous()), ranks[order[0]], group, j)
        for j, (box, order) in enumerate(parts)
        if ranks[order[0]] != me
    ]
    sent = _batch(sends)
    for j, into in owned.items():
        into.copy_(mine[parts[j][0]])
    for peer in sorted(r for r in ranks if r != me):
        got = {j: new(tuple(into.shape), into.dtype, into.device) for j, into in owned.items()}
        guard.wait_all(_batch([dist.P2POp(dist.irecv, as_bytes(b), peer, group, j) for j, b in got.items()]), deadline)
        for j, b in got.items():
            accumulate(op, owned[j], b)
    guard.wait_all(sent, deadline)


def _share_parts(parts: Any, owned: dict[int, torch.Tensor], out: torch.Tensor, group: Any, guard: Any) -> None:
    """Each owner's parts of ``out`` to every other rank, from ``out`` and into it where contiguous (dim-0 rows)."""
    ranks, me = guard.ranks, guard.rank
    ops: list[dist.P2POp] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j, (box, order) in enumerate(parts):
        tag = len(parts) + j  # after the tags of the reduce phase's messages
        if j in owned:
            value = as_bytes(owned[j].contiguous())
            ops += [dist.P2POp(dist.isend, value, r, group, tag) for r in ranks if r != me]
            continue
        into = out[box]
        buf = into if into.is_contiguous() else new(tuple(into.shape), out.dtype, out.device)
        if buf is not into:
            staged.append((into, buf))
        ops.append(dist.P2POp(dist.irecv, as_bytes(buf), ranks[order[0]], group, tag))
    guard.wait_all(_batch(ops))
    for into, buf in staged:
        into.copy_(buf)


def _batch(ops: list[dist.P2POp]) -> list[Any]:
    return list(dist.batch_isend_irecv(ops)) if ops else []


def run_collective(kind: str, p: Any, mine: torch.Tensor, out: torch.Tensor, group: Any, guard: Any) -> None:
    """Runs ``all_reduce`` or ``reduce_scatter_tensor`` of this rank's summand ``mine`` into ``out``.

    It runs after the movement's round of headers (``guard``, a ``_guard.Guard``).
    """
    op = _OPS[p.src.partial]
    if kind == "all_reduce" and mine.device.type == "cpu" and p.steps:  # Gloo: in the plan's order
        _all_reduce_in_order(p, mine, out, group, guard)
        return
    if kind == "all_reduce":
        work = start_all_reduce(p, mine, out, group, guard)
    else:
        guard.agree(group)
        # reduce_scatter_single replaces the deprecated reduce_scatter_tensor where torch has it
        scatter = cast(
            "Callable[..., dist.Work]",
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,  # pyright: ignore[reportUnknownMemberType, reportDeprecated]  # untyped in torch; for older torch
        )
        into, summand = handed(out, mine.contiguous())
        work = scatter(into, summand, op=op, group=group, async_op=True)
    guard.wait(work)
