"""A partial layout's summands: per distinct box, which ranks hold replicas of which summand.

A pending reduction reads one copy of each summand. Where copies are replicas of one
summand (``Layout.terms``) any of them will do, so the planner groups a box's summands by
the ranks that hold them: two summands of a box that share a rank are held by exactly the
same ranks (``fshard._layout.terms`` checks it), so each rank holding a box belongs to one
*group* of summands, and reading the group from any one of its ranks reads each of its
summands once. Without ``terms`` every copy is a summand of its own, and a group is the
copies of a box on one rank.

Groups are numbered by (box, lowest rank); ``Summands`` keys them like ``Index`` keys
boxes, so the walks over holders (``fshard._plan.routing``) take either.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._layout.index import Holders, expand, index
from fshard._layout.layout import Layout

__all__ = ["Summands", "summands"]


@dataclasses.dataclass(frozen=True, eq=False)
class Summands(Holders):
    """The groups of summands of a partial layout (see the module), keyed like ``Index`` boxes.

    Per group: its ranks (``held``, ``holder``, ``start``, ``count``, as ``Holders``) and its
    ``box``. Per distinct box of the layout's ``Index``: its groups, ``first[b]`` to
    ``first[b] + groups[b]``. Per (box, rank) entry of the ``Index`` (``index(layout).held``):
    its group (``group_of``), the rank's position among the group's ranks (``position``),
    the shards the rank reads to contribute the group (``reads``: one copy of each summand,
    its lowest-index one) and the shards that take a value put into the group (``takes``:
    the copies of its lowest summand), each a run ``(start, count)`` into a shard column.
    """

    ranks: np.ndarray
    held: np.ndarray
    holder: np.ndarray
    start: np.ndarray
    count: np.ndarray
    box: np.ndarray
    first: np.ndarray
    groups: np.ndarray
    group_of: np.ndarray
    position: np.ndarray
    reads: tuple[np.ndarray, np.ndarray, np.ndarray]
    takes: tuple[np.ndarray, np.ndarray, np.ndarray]

    def read(self, entry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, shard) for every shard that (box, rank) entry ``entry[row]`` reads."""
        return _run(self.reads, entry)

    def take(self, entry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, shard) for every shard of (box, rank) entry ``entry[row]`` that takes its group's value."""
        return _run(self.takes, entry)


def _run(runs: tuple[np.ndarray, np.ndarray, np.ndarray], entry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    start, count, shards = runs
    row, k = expand(count[entry])
    return row, shards[start[entry][row] + k]


@cached(256)
def summands(layout: Layout) -> Summands:
    """The cached ``Summands`` of a partial ``layout`` (O(n log n) once per layout)."""
    ix = index(layout)
    width = max(len(ix.ranks), 1)
    box, code = ix.held // width, ix.held % width
    n = len(ix.held)
    whole = _runs(ix.copy_key, ix.copies, ix.held)
    if layout.terms is None:  # every copy a summand: a group is a box's copies on one rank
        every = np.arange(n)
        lowest = (whole[0], np.ones(n, np.int64), ix.copies)
        return Summands(ix.ranks, every * width + code, ix.holder, every, np.ones(n, np.int64), box, ix.start,
                        ix.count, every, np.zeros(n, np.int64), whole, lowest)  # fmt: skip
    shard, key = ix.copies, ix.copy_key  # non-empty shards by (box, rank, shard)
    term = layout.terms[shard]
    _, summand = _boxes.unique_rows(np.c_[key // width, term])
    low = np.full(int(summand.max(initial=-1)) + 1, width, np.int64)
    np.minimum.at(low, summand, key % width)
    _, group = _boxes.unique_rows(np.c_[key // width, low[summand]])  # by (box, lowest rank)
    entry = np.searchsorted(ix.held, key)
    group_of = np.empty(n, np.int64)
    group_of[entry] = group
    n_groups = int(group.max(initial=-1)) + 1
    order = np.lexsort((code, group_of))
    count = np.bincount(group_of, minlength=n_groups)
    start = np.cumsum(count) - count
    position = np.empty(n, np.int64)
    position[order] = np.arange(n) - start[group_of[order]]
    group_box = np.zeros(n_groups, np.int64)
    group_box[group_of] = box
    groups = np.bincount(group_box, minlength=len(ix.lo))
    one, _ = _boxes.unique_rows(np.c_[key, term])  # the lowest-index copy of each summand on each rank
    least = np.full(n_groups, np.iinfo(np.int64).max)
    np.minimum.at(least, group, term)
    valued = np.flatnonzero(term == least[group])
    return Summands(ix.ranks, group_of[order] * width + code[order], ix.holder[order], start, count, group_box,
                    np.cumsum(groups) - groups, groups, group_of, position,
                    _runs(key[one], shard[one], ix.held), _runs(key[valued], shard[valued], ix.held))  # fmt: skip


def _runs(keys: np.ndarray, shards: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per held key, the run of ``shards`` (sorted by ``keys``) with that key: (start, count, shards)."""
    start = np.searchsorted(keys, held, side="left")
    return start, np.searchsorted(keys, held, side="right") - start, shards
