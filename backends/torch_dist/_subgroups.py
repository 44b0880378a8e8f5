"""Process groups of a few ranks, for the reductions of ``shard_map`` bodies over mesh axes.

A body's ``psum`` over a mesh axis sums over the processes that differ only along that
axis. Each such set of ranks gets one process group, made the first time it is used and
kept: ``new_group(ranks, use_local_synchronization=True)`` is collective over the members
only, so each process makes just the groups it belongs to, whatever order others use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_among"]

# Keyed on (ranks, default group): a new init_process_group makes a new default group, so a
# stale group is never used.
_GROUPS: dict[tuple[tuple[int, ...], Any], Any] = {}


def subgroup(ranks: tuple[int, ...]) -> Any:
    """The process group of global ``ranks`` (sorted), made once."""
    key = (ranks, dist.group.WORLD)
    found = _GROUPS.get(key)
    if found is None:
        if dist.get_world_size() == len(ranks):
            found = dist.group.WORLD
        else:
            found = dist.new_group(list(ranks), use_local_synchronization=True)  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
        _GROUPS[key] = found
    return found


def all_reduce_among(t: torch.Tensor, ranks: tuple[int, ...], wire: torch.device) -> torch.Tensor:
    """The sum of ``t`` over the processes of ``ranks`` (this one among them): a new tensor on ``t``'s device."""
    buf = t.detach().to(wire, copy=True).contiguous()
    dist.all_reduce(buf, group=subgroup(tuple(sorted(ranks))))  # pyright: ignore[reportUnknownMemberType]  # untyped in torch
    return buf.to(t.device)
