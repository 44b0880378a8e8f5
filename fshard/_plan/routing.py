"""The source of each piece of a plan: a rule that needs only the piece's two boxes and its receiver.

Every rank applies it to its own boxes alone, so one rank's schedule agrees with the
global plan, and the holders of a box take turns sending it.
"""

from __future__ import annotations

import numpy as np

from fshard._base import boxes as _boxes
from fshard._layout.index import Holders, Index, expand, index
from fshard._layout.layout import Layout

__all__ = ["copy_on", "shared_holders", "source_shards", "walk_holders"]


# -- the source of each piece ------------------------------------------------------------------


def source_shards(src: Layout, dst: Layout, u: np.ndarray, v: np.ndarray, dst_shard: np.ndarray) -> np.ndarray:
    """The source shard of each row: the piece of source box ``u`` in destination box ``v``.

    The piece is written into ``dst_shard`` (on rank r).

    - r holds a copy of ``u``: that copy (on the destination shard's device if there is
      one), a local copy;
    - else the k-th holder of ``u`` (ranks ascending, m of them) sends its lowest-index
      copy, with ``k = (p + u + v) mod m`` where ``p`` is r's position among the ranks of
      ``v`` that hold no copy of ``u``: the receivers of a piece take turns over its
      holders, so the senders are balanced, and one rank of ``v`` receives a piece once.
    """
    si, di = index(src), index(dst)
    rank = dst.columns.rank[dst_shard]
    held = si.find(u, rank)
    out = np.empty(len(u), np.int64)
    here = np.flatnonzero(held >= 0)
    out[here] = copy_on(src, si, u[here], rank[here], dst, dst_shard[here])
    away = np.flatnonzero(held < 0)
    out[away] = si.first[_sender(si, di, u[away], v[away], rank[away])]
    return out


def copy_on(
    layout: Layout, ix: Index, box: np.ndarray, rank: np.ndarray, other: Layout, shard: np.ndarray
) -> np.ndarray:
    """The copy of ``box[k]`` on ``rank[k]`` (which holds one) on the device of ``other``'s shard ``shard[k]``.

    Where none is on that device, the lowest-index copy on ``rank[k]``.

    ``ix.copies`` runs by (box, rank, shard), so the first copy of a run is the lowest.
    """
    start, stop = ix.copies_of(box, rank)
    out = ix.copies[start] if len(start) else np.zeros(0, np.int64)
    for k in np.flatnonzero(stop - start > 1).tolist():  # a rank holding a box on several devices
        device = other.columns.devices[int(shard[k])]
        same = [int(c) for c in ix.copies[start[k] : stop[k]] if layout.columns.devices[int(c)] == device]
        out[k] = same[0] if same else out[k]
    return out


def _sender(si: Index, di: Index, u: np.ndarray, v: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Position in ``si.held`` of the holder of ``u`` that sends to ``rank`` (which holds no copy)."""
    m = si.count[u]
    k = np.zeros(len(u), np.int64)
    multi = np.flatnonzero(m > 1)
    if multi.size:
        uu, vv, rr = u[multi], v[multi], rank[multi]
        p = di.find(vv, rr) - di.start[vv] - _shared_below(si, di, uu, vv, rr)
        k[multi] = (p + uu + vv) % m[multi]
    return si.start[u] + k


def _shared_below(si: Index, di: Index, u: np.ndarray, v: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per row, the ranks below ``rank`` that hold both ``u`` (source) and ``v`` (destination).

    Each distinct (u, v) walks the shorter of its two rank lists once (``shared_holders``).
    """
    first, inverse = _boxes.unique_rows(np.c_[u, v])
    pair, holder = shared_holders(si, di, u[first], v[first])
    width = len(si.ranks) + 1
    keys = pair * width + np.searchsorted(si.ranks, holder)  # sorted: ranks ascend within a pair
    query = inverse * width + np.searchsorted(si.ranks, rank)
    return np.searchsorted(keys, query) - np.searchsorted(keys, inverse * width)


def shared_holders(si: Holders, di: Holders, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (pair, rank) where ``rank`` holds both ``u[pair]`` (in ``si``) and ``v[pair]`` (in ``di``).

    Pairs ascend, and ranks ascend within a pair; each pair walks the shorter of its two rank
    lists.
    """
    pair, at = expand(np.minimum(si.count[u], di.count[v]))
    return walk_holders(si, di, u, v, pair, at)


def walk_holders(
    si: Holders, di: Holders, u: np.ndarray, v: np.ndarray, pair: np.ndarray, at: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The entries ``at`` of the shorter holder list of each ``pair`` that the other list holds too.

    They come as (pair, rank).
    """
    from_u = (si.count[u] <= di.count[v])[pair]
    rank = np.empty(len(pair), np.int64)
    hit = np.empty(len(pair), bool)
    a, b = np.flatnonzero(from_u), np.flatnonzero(~from_u)
    rank[a] = si.holder[si.start[u[pair[a]]] + at[a]]
    hit[a] = di.find(v[pair[a]], rank[a]) >= 0
    rank[b] = di.holder[di.start[v[pair[b]]] + at[b]]
    hit[b] = si.find(u[pair[b]], rank[b]) >= 0
    return pair[hit], rank[hit]
