"""Process groups of a few ranks, for the reductions of ``shard_map`` bodies over mesh axes.

A body's ``psum`` over a mesh axis sums over the processes that differ only along that
axis: the axis **partitions** the ranks into groups. Where the partition covers the whole
job, the first time it is used every process makes every group of it, in the same order
(``new_group`` is collective over the whole job, and every process reaches the same
``psum`` at once), and keeps them.

Where it does not (a ``shard_map`` over some of the job's ranks), the other processes run
no body and cannot take part in a ``new_group``, and groups made by their members only
(``use_local_synchronization=True``) hang on Gloo once a process makes a second one
(torch 2.13: ranks 0 and 1, then 0 and 2). Those sums go by messages on the default group
instead, tagged apart from the movements' messages: each member sums one slice of the
tensor, its members' parts in rank order, and sends that slice of the sum to the others
(a reduce-scatter and an all-gather, ``2 (k - 1)`` messages per member of ``k``, each
element sent twice), so every member gets the same bits.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import torch
import torch.distributed as dist

from fshard._errors import CollectiveMismatchError

from ._exchange import bounded_wait
from ._watch import handed

__all__ = ["all_reduce_among", "forget_subgroups"]

# Keyed on (ranks, default group): a new init_process_group makes a new default group, so a
# stale group is never used.
_GROUPS: dict[tuple[tuple[int, ...], Any], Any] = {}
_MADE: set[tuple[tuple[tuple[int, ...], ...], Any]] = set()  # partitions whose every group was made


def subgroup(ranks: tuple[int, ...], partition: tuple[tuple[int, ...], ...], wire: torch.device) -> Any:
    """The process group of global ``ranks`` (sorted), one group of ``partition``, made once.

    ``None`` where the partition does not cover the whole job: that sum goes by messages.

    Every process decides alike from the partition, which they share: whether it was made.
    Where the partition covers the job, its groups are made after every process has shown it
    uses that partition (one exchange, at its first use): ``new_group`` pairs the processes'
    calls by their order alone, so bodies that sum over different axes on different placements
    would otherwise make groups of the wrong processes, and sum with them.

    Raises:
        CollectiveMismatchError: on every process, where they use different partitions there.
    """
    world = dist.get_world_size()
    # A sum over the whole job too has a group of its own: were it the default group's, a body that calls
    # psum more often on some placements would pair its sum with another collective of the others.
    groups = tuple(sorted(tuple(sorted(g)) for g in partition))
    if sum(len(g) for g in groups) == world:  # the whole job: every process makes every group
        if (groups, dist.group.WORLD) not in _MADE:
            _agree_on(groups, world, wire)
            for g in groups:
                made = dist.new_group(list(g))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
                _GROUPS.setdefault((g, dist.group.WORLD), made)
            _MADE.add((groups, dist.group.WORLD))
        return _GROUPS[(ranks, dist.group.WORLD)]
    return None  # not the whole job: the sum goes by messages (``_sum_by_messages``)


def _agree_on(groups: tuple[tuple[int, ...], ...], world: int, wire: torch.device) -> None:
    """Raises on every process unless every process is about to make the groups of ``groups``."""
    digest = int.from_bytes(hashlib.blake2b(repr(groups).encode(), digest_size=8).digest(), "big", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=wire)
    seen = [torch.empty_like(mine) for _ in range(world)]
    work = cast("dist.Work", dist.all_gather(seen, mine, async_op=True))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    bounded_wait(work, "psum's agreement on its groups", None)
    digests = cast("list[int]", torch.cat(seen).tolist())  # pyright: ignore[reportUnknownMemberType]  # torch's stub
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digest]
        msg = (
            f"psum: ranks {odd} sum over other axes than this rank (rank {dist.get_rank()}, which sums within "
            f"{[list(g) for g in groups]}) at the same psum() call: every placement's body must reduce over the "
            "same axes, in the same order."
        )
        raise CollectiveMismatchError(msg)


def all_reduce_among(
    t: torch.Tensor,
    ranks: tuple[int, ...],
    wire: torch.device,
    partition: tuple[tuple[int, ...], ...],
    extra: tuple[float, ...] = (),
) -> torch.Tensor:
    """The sum of ``t`` over the processes of ``ranks`` (this one among them): a new tensor on ``t``'s device.

    ``extra`` numbers are summed after ``t``'s elements, in the same all-reduce, and the result is
    then flat. The wait is bounded by ``config(timeout=...)`` where it is set: a body that calls
    ``psum`` fewer times on some placements leaves the others waiting, and they raise
    ``CollectiveMismatchError``.
    """
    if extra:
        n = t.numel()
        buf = torch.empty(n + len(extra), dtype=t.dtype, device=wire)
        buf[:n].copy_(t.detach().reshape(-1))
        buf[n:].copy_(torch.tensor(extra, dtype=t.dtype))
    else:
        buf = t.detach().to(wire, copy=True).contiguous()
    members = tuple(sorted(ranks))
    group = subgroup(members, partition, wire)
    if group is None:
        return _sum_by_messages(buf, members).to(t.device)
    (summed,) = handed(buf)  # written in place: buf holds the sum
    work = cast("dist.Work", dist.all_reduce(summed, group=group, async_op=True))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    _wait(work, members)
    return buf.to(t.device)


_TAG = 1 << 30  # the messages of sums by messages: apart from the movements' tags (a pair's box numbers)


def _sum_by_messages(buf: torch.Tensor, members: tuple[int, ...]) -> torch.Tensor:
    """The sum of ``buf`` over the processes ``members`` (global ranks, sorted; this one among them).

    Member ``i`` sums slice ``i`` of the flat tensor (its members' parts in rank order) and
    sends that slice of the sum to every other member: the same bits on every member.
    """
    me = members.index(dist.get_rank())
    flat = buf.reshape(-1)
    slices = torch.tensor_split(flat, len(members))
    mine = slices[me]
    parts = [torch.empty_like(mine) for _ in members]
    parts[me] = mine
    ops = [dist.P2POp(dist.irecv, parts[k], peer, tag=_TAG) for k, peer in enumerate(members) if k != me]
    ops += [dist.P2POp(dist.isend, slices[k], peer, tag=_TAG) for k, peer in enumerate(members) if k != me]
    _exchange(ops, members)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    out = torch.empty_like(flat)
    pieces = torch.tensor_split(out, len(members))
    pieces[me].copy_(total)
    ops = [dist.P2POp(dist.irecv, pieces[k], peer, tag=_TAG + 1) for k, peer in enumerate(members) if k != me]
    ops += [dist.P2POp(dist.isend, total, peer, tag=_TAG + 1) for k, peer in enumerate(members) if k != me]
    _exchange(ops, members)
    return out.view(buf.shape)


def _exchange(ops: list[dist.P2POp], members: tuple[int, ...]) -> None:
    for work in dist.batch_isend_irecv(ops) if ops else []:  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        _wait(work, members)


def _wait(work: Any, members: tuple[int, ...]) -> None:
    """``work.wait()``, at most ``config(timeout=...)`` seconds where that is set (``bounded_wait``)."""

    def late(timeout: float) -> str:
        return (
            f"psum: ranks {list(members)} did not all arrive within {timeout:g} s (config(timeout=...)): they are "
            "stopped, slower than this rank, or their shard_map bodies called psum fewer times or over other axes "
            "(every placement's body must call psum alike, in the same order). The sum stays in flight, so this "
            "process group cannot be used again: end the job or destroy the group."
        )

    bounded_wait(work, "psum", None, late)


def forget_subgroups() -> None:
    """Drops the groups made here (torch keeps its own references to them while they live)."""
    _GROUPS.clear()
    _MADE.clear()
