"""A process group as fshard reads it.

Its facts are read once per group, and layouts are checked against it once per (layout, group).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout

from .._execution import shard_device
from ._choice import has_alltoall

__all__ = ["Facts", "check_layout", "facts", "weakly"]


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


# Keyed on the ids of (group, default group): a new init_process_group makes a new default group, so
# a stale entry is never read. The groups are held weakly (a destroyed group must not live on in this
# table: see ``_let_go_of_groups``), and an entry serves only the very groups it was made for.
_FACTS: dict[tuple[int, int], tuple[Callable[[], Any], Callable[[], Any], Facts]] = {}


def facts(group: Any) -> Facts:
    world = dist.group.WORLD
    key = (id(group), id(world))
    entry = _FACTS.get(key)
    if entry is not None and entry[0]() is group and entry[1]() is world:
        return entry[2]
    if len(_FACTS) > 64:
        _FACTS.clear()
    ranks: tuple[int, ...] = ()
    name = ""
    if group is not dist.GroupMember.NON_GROUP_MEMBER:  # (a process outside the group has neither)
        ranks = tuple(dist.get_process_group_ranks(group or world))
        name = str(dist.get_backend(group))
    on_cuda = name == "nccl" or ("cuda:" in name and "cpu:" not in name)
    found = Facts(dist.get_rank(), ranks, on_cuda, has_alltoall(name))
    _FACTS[key] = (weakly(group), weakly(world), found)
    return found


def weakly(x: Any) -> Callable[[], Any]:
    """A weak reference to a process group; for ``None`` or torch's non-member sentinel (an int), ``x`` itself."""
    try:
        return weakref.ref(x)
    except TypeError:  # not a group: nothing to keep alive
        return functools.partial(_same, x)


def _same(x: Any) -> Any:
    return x


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
