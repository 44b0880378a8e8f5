"""A process group as fshard reads it.

Its facts are read once per group, and layouts are checked against it once per (layout, group).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout

from .._execution import shard_device
from ._choice import has_alltoall

__all__ = ["Facts", "check_layout", "facts", "forget_facts"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What every call asks of a process group, read once.

    This process's global rank, the group's global ranks in group order, whether messages go
    through CUDA memory (NCCL) and whether the group's backend runs ``all_to_all_single``.
    """

    rank: int
    ranks: tuple[int, ...]
    on_cuda: bool
    alltoall: bool


# Keyed on (group, default group): a new init_process_group makes a new default group, so a
# stale entry is never read; the key holds both groups, so their ids are not reused meanwhile.
_FACTS: dict[tuple[Any, Any], Facts] = {}


def facts(group: Any) -> Facts:
    key = (group, dist.group.WORLD)
    found = _FACTS.get(key)
    if found is None:
        if len(_FACTS) > 64:
            _FACTS.clear()
        ranks: tuple[int, ...] = ()
        name = ""
        if group is not dist.GroupMember.NON_GROUP_MEMBER:  # (a process outside the group has neither)
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            name = str(dist.get_backend(group))
        on_cuda = name == "nccl" or ("cuda:" in name and "cpu:" not in name)
        found = _FACTS[key] = Facts(dist.get_rank(), ranks, on_cuda, has_alltoall(name))
    return found


@cached(256)
def check_layout(layout: Layout, group: Facts, member: bool) -> None:
    """Raises ``SpecError`` if a shard of ``layout`` sits on a rank outside ``group`` or on a device this process lacks.

    Cached, so a layout that passed costs one lookup.
    """
    ranks = frozenset(group.ranks)
    for r in layout.ranks:
        if (member and r not in ranks) or (not member and r == group.rank):
            msg = (
                f"Global rank {r} does not exist in input process group (global ranks {list(group.ranks)}): "
                "placements name global ranks; place shards on the group's ranks "
                f"or use a group that holds rank {r}."
            )
            raise SpecError(msg)
    for i in layout.indices_on(group.rank):
        shard_device(layout, i)


def forget_facts() -> None:
    """Drops every group's facts (and with them this table's references to the groups)."""
    _FACTS.clear()
