"""Process groups of a few ranks, for the reductions of ``shard_map`` bodies over mesh axes.

A body's ``psum`` over a mesh axis sums over the processes that differ only along that
axis: the axis **partitions** the ranks into groups. The first time a partition is used,
every process makes every group of it, in the same order (``new_group`` is collective
over the whole job, and every process reaches the same ``psum`` at once), and keeps them.
Groups made by the members only (``use_local_synchronization=True``) were measured to
hang on Gloo after other groups of the same ranks had been made, so they are used only
where the processes of the psum are not the whole job.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._watch import handed

__all__ = ["all_reduce_among"]

# Keyed on (ranks, default group): a new init_process_group makes a new default group, so a
# stale group is never used.
_GROUPS: dict[tuple[tuple[int, ...], Any], Any] = {}
_MADE: set[tuple[tuple[tuple[int, ...], ...], Any]] = set()  # partitions whose every group was made


def subgroup(ranks: tuple[int, ...], partition: tuple[tuple[int, ...], ...]) -> Any:
    """The process group of global ``ranks`` (sorted), one group of ``partition``, made once.

    Every process decides alike from the partition, which they share: whether it was made.
    """
    world = dist.get_world_size()
    if len(ranks) == world:
        return dist.group.WORLD
    groups = tuple(sorted(tuple(sorted(g)) for g in partition))
    if sum(len(g) for g in groups) == world:  # the whole job: every process makes every group
        if (groups, dist.group.WORLD) not in _MADE:
            for g in groups:
                made = dist.new_group(list(g))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
                _GROUPS.setdefault((g, dist.group.WORLD), made)
            _MADE.add((groups, dist.group.WORLD))
        return _GROUPS[(ranks, dist.group.WORLD)]
    key = (ranks, dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=True)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    return _GROUPS[key]


def all_reduce_among(
    t: torch.Tensor, ranks: tuple[int, ...], wire: torch.device, partition: tuple[tuple[int, ...], ...]
) -> torch.Tensor:
    """The sum of ``t`` over the processes of ``ranks`` (this one among them): a new tensor on ``t``'s device."""
    buf = t.detach().to(wire, copy=True).contiguous()
    (summed,) = handed(buf)  # written in place: buf holds the sum
    dist.all_reduce(summed, group=subgroup(tuple(sorted(ranks)), partition))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    return buf.to(t.device)
