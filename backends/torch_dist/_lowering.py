"""This rank's part of a plan (pure, cached).

``schedule`` turns the core's ``RankSchedule`` (``plan.for_rank(rank)``: this rank's
sends, receives and local copies, computed from the two layouts alone) into what the
transports index with: peers in group order, split sizes, the slices of every box,
where boxes lie back to back, and how the rest is packed: ``runs`` groups boxes that
one strided ``copy_`` moves (equal boxes at a fixed step along one dim, or one box for
several peers), and ``Exchange`` describes the rank's ``all_to_all_single``, with its
own copies in its own segment where that lets every received box land in place. All
of it is derived from the rank's own share, O(its boxes). Nothing here reads the
global plan's rows.

The transport choices, which every rank makes alike, are in ``_choice``.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np

from fshard._base.boxes import rows_prod, unique_rows
from fshard._base.cache import cached
from fshard._layout.layout import Layout
from fshard._plan import plan
from fshard._plan.direct import Plan
from fshard._plan.schedule import Moves

Index = tuple[int, tuple[slice, ...]]  # a box as (shard, slices into that shard's tensor)
Span = tuple[int, int, int]  # boxes back to back in one shard: (shard, first element, end)
Peer = tuple[int, tuple[Index, ...]]  # a peer rank and the boxes exchanged with it, in order


@dataclasses.dataclass(frozen=True)
class Run:
    """Boxes of one shard, equal in shape, one after another in a buffer, copied by one ``copy_``.

    ``region``: slices of shard ``shard`` that cover every box. ``dim`` is ``None`` for a
    single box (``region`` is the box), ``-1`` for the same box ``copies`` times (a
    replicated box sent to several peers), else the dim along which box ``k`` starts
    ``k * step`` after the first (``Tensor.unfold(dim, shape[dim], step)`` of the region).
    ``numel``: elements of all the boxes; ``contiguous``: the strides of the boxes back to
    back in a buffer, as a tensor of shape ``(copies, *shape)``.
    """

    shard: int
    region: tuple[slice, ...]
    dim: int | None
    step: int
    copies: int
    shape: tuple[int, ...]
    numel: int = dataclasses.field(init=False, repr=False, compare=False)
    contiguous: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        strides = [1]
        for n in reversed(self.shape):
            strides.append(strides[-1] * n)
        object.__setattr__(self, "numel", self.copies * strides[-1])
        object.__setattr__(self, "contiguous", tuple(reversed(strides)))


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What one ``all_to_all_single`` of a schedule moves, and how it is packed and unpacked.

    ``send_split``/``recv_split``: elements per rank of the group. ``local``: whether this
    rank's own copies (``Schedule.local``) travel in its own segment of the collective
    (the backend copies a rank's segment to itself), which it does where that lets every
    received box land in place (dim 0 -> dim 1: the own block sits between the peers').
    ``send_span``/``recv_span``: where the buffer is a range of one contiguous shard (no
    packing). Otherwise ``send_runs``/``recv_runs`` pack or unpack it, one ``copy_`` per run.
    ``fanout``: (offset in the receive buffer, shape, other destination boxes) of each
    received box that shards of this rank hold more than once.
    """

    send_split: tuple[int, ...]
    recv_split: tuple[int, ...]
    local: bool
    send_span: Span | None
    recv_span: Span | None
    send_runs: tuple[Run, ...]
    recv_runs: tuple[Run, ...]
    fanout: tuple[tuple[int, tuple[int, ...], tuple[Index, ...]], ...]

    @property
    def staged(self) -> int:
        """Elements packed before the collective or unpacked after it (where the shards are contiguous)."""
        send = 0 if self.send_span is not None else sum(self.send_split)
        return send + (0 if self.recv_span is not None else sum(self.recv_split))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's share of a plan, with every index it needs computed once.

    ``send``: per peer in group order, each distinct box sent to it, in its source shard
    (a box goes once to a rank that holds it twice). ``recv``: per peer in group order,
    each distinct box received from it, in its first destination shard, and ``fanout``:
    for each received box (numbered in that order), every other destination shard on
    this rank that wants it. Sender and receiver list a pair's boxes alike (the plan's
    order). ``local``: (source box, destination box) of each copy between shards of
    this rank. ``plain``: the boxes exchanged with peers as one ``all_to_all_single``
    moves them, the own copies made apart (``Exchange``; its splits, spans and runs are
    this schedule's too); ``exchange``: how ``all_to_all_single`` runs this share, which
    may carry the own copies in the rank's own segment instead.
    """

    local: tuple[tuple[Index, Index], ...]
    send: tuple[Peer, ...]
    recv: tuple[Peer, ...]
    fanout: tuple[tuple[Index, ...], ...]
    sent: int
    plain: Exchange
    exchange: Exchange

    @property
    def send_split(self) -> tuple[int, ...]:
        """Elements sent to each rank of the group, in group order."""
        return self.plain.send_split

    @property
    def recv_split(self) -> tuple[int, ...]:
        """Elements received from each rank of the group, in group order."""
        return self.plain.recv_split

    @property
    def send_span(self) -> Span | None:
        """Where the sent boxes lie back to back in one shard (no packing), if they do."""
        return self.plain.send_span

    @property
    def recv_span(self) -> Span | None:
        """Where the received boxes (their first destinations) lie back to back in one shard, if they do."""
        return self.plain.recv_span

    @property
    def send_runs(self) -> tuple[Run, ...]:
        """The sent boxes as runs that one strided copy each packs (``runs``)."""
        return self.plain.send_runs


def schedule(p: Plan, me: int, order: tuple[int, ...]) -> Schedule:
    """Rank ``me``'s share of ``p``, peers in the group order ``order``; cached on (layouts, rank, order).

    ``p`` is a plan without pending reductions: ``p.op`` unset and no ``steps``.
    """
    if p.op is not None or p.steps or p.src.partial is not None or p.dst.partial is not None:
        raise ValueError("schedule() runs plans without a reduction; see _reduce.reduce_schedule.")
    return _schedule(p.src, p.dst, int(me), tuple(order))


@cached(512)
def _schedule(src: Layout, dst: Layout, me: int, order: tuple[int, ...]) -> Schedule:
    rs = plan(src, dst).for_rank(me)
    position = np.full(int(max(order, default=0)) + 1, -1, np.int64)
    position[list(order)] = np.arange(len(order))
    send, _ = _distinct(rs.send, position)
    recv, fan = _distinct(rs.recv, position)
    send_at = _at(src, rs.send.src_shard[send], rs.send.lo[send], rs.send.size[send])
    every_at = _at(dst, rs.recv.dst_shard, rs.recv.lo, rs.recv.size)
    recv_at = [every_at[k] for k in cast("list[int]", recv.tolist())]
    local = rs.local
    sends = _Boxes.of(src, rs.send.src_shard[send], rs.send.lo[send], rs.send.size[send], position[rs.send.peer[send]])
    recvs = _Boxes.of(dst, rs.recv.dst_shard[recv], rs.recv.lo[recv], rs.recv.size[recv], position[rs.recv.peer[recv]])
    fanout = tuple(tuple(every_at[k] for k in rows[1:]) for rows in fan)
    send_split = _split(rs.send, send, position, len(order))
    recv_split = _split(rs.recv, recv, position, len(order))
    exchange = plain = _exchange(src, dst, sends, recvs, send_split, recv_split, fanout)
    if len(local) and me in order:
        at = np.full(len(local), position[me])
        own = (
            _Boxes.of(src, local.src_shard, local.lo, local.size, at),
            _Boxes.of(dst, local.dst_shard, local.lo, local.size, at),
        )
        through = _exchange(src, dst, sends, recvs, send_split, recv_split, fanout, own)
        if through.staged < plain.staged:
            exchange = through
    return Schedule(
        local=tuple(
            zip(
                _at(src, local.src_shard, local.lo, local.size),
                _at(dst, local.dst_shard, local.lo, local.size),
            )
        ),
        send=_by_peer(rs.send.peer[send], send_at),
        recv=_by_peer(rs.recv.peer[recv], recv_at),
        fanout=fanout,
        sent=int(rs.send.numel[send].sum()),
        plain=plain,
        exchange=exchange,
    )


@dataclasses.dataclass(frozen=True)
class _Boxes:
    """Boxes in buffer order.

    Shard, low corner within the shard, extents, and the group position of the peer each goes
    to or comes from (ascending).
    """

    shard: np.ndarray
    lo: np.ndarray  # relative to the shard's own offsets
    size: np.ndarray
    position: np.ndarray

    @classmethod
    def of(cls, layout: Layout, shard: np.ndarray, lo: np.ndarray, size: np.ndarray, position: np.ndarray) -> _Boxes:
        shard = np.asarray(shard, np.int64)
        shape = (len(shard), layout.ndim)
        lo = np.asarray(lo, np.int64).reshape(shape) - layout.columns.lo[shard]
        return cls(shard, lo, np.asarray(size, np.int64).reshape(shape), np.asarray(position, np.int64))

    @property
    def numel(self) -> np.ndarray:
        """Elements of each box."""
        return rows_prod(self.size) if len(self.shard) else np.zeros(0, np.int64)

    def merge(self, other: _Boxes) -> tuple[_Boxes, int]:
        """These boxes with ``other`` (all of one peer) placed in peer order; where ``other`` starts."""
        k = int(np.searchsorted(self.position, other.position[0], "left"))  # pyright: ignore[reportUnknownArgumentType]  # numpy's stub
        merged = _Boxes(
            *(np.concatenate([a[:k], b, a[k:]]) for a, b in zip(
                (self.shard, self.lo, self.size, self.position),
                (other.shard, other.lo, other.size, other.position)))
        )  # fmt: skip
        return merged, k

    def span(self, layout: Layout) -> Span | None:
        return _span(layout, self.shard, self.lo + layout.columns.lo[self.shard], self.size)


def _exchange(
    src: Layout,
    dst: Layout,
    sends: _Boxes,
    recvs: _Boxes,
    send_split: tuple[int, ...],
    recv_split: tuple[int, ...],
    fanout: tuple[tuple[Index, ...], ...],
    own: tuple[_Boxes, _Boxes] | None = None,
) -> Exchange:
    """The all_to_all of ``sends`` and ``recvs`` (buffer order).

    This rank's own copies ``own`` (source boxes, destination boxes) are its own segment when given.
    """
    sizes = recvs.numel
    offsets = np.cumsum(sizes) - sizes
    shapes = [tuple(r) for r in recvs.size.tolist()]
    if own is not None:
        mine_src, mine_dst = own
        n, at = int(mine_src.numel.sum()), int(mine_src.position[0])
        sends, _ = sends.merge(mine_src)
        recvs, k = recvs.merge(mine_dst)
        offsets = offsets + np.where(np.arange(offsets.size) >= k, n, 0)
        send_split = (*send_split[:at], send_split[at] + n, *send_split[at + 1 :])
        recv_split = (*recv_split[:at], recv_split[at] + n, *recv_split[at + 1 :])
    return Exchange(
        send_split=send_split,
        recv_split=recv_split,
        local=own is not None,
        send_span=sends.span(src),
        recv_span=recvs.span(dst),
        send_runs=runs(sends.shard, sends.lo, sends.size),
        recv_runs=runs(recvs.shard, recvs.lo, recvs.size),
        fanout=tuple((int(offsets[k]), shapes[k], t) for k, t in enumerate(fanout) if t),
    )


def runs(shard: np.ndarray, lo: np.ndarray, size: np.ndarray) -> tuple[Run, ...]:
    """The boxes (in order: shard, low corner within it, extents) cut into the fewest runs found left to right.

    A run is consecutive non-empty boxes of one shard and one shape whose low corners advance by
    the same step, either 0 (one box again) or a positive step in one dim. Equal column blocks
    of a row chunk (dim 0 -> dim 1) are one run, a whole shard sent to every peer (chunk ->
    replicated) is one run.
    """
    if not len(shard):
        return ()
    numel = rows_prod(size)
    step = np.diff(lo, axis=0)
    moved = (step != 0).sum(axis=1)
    chained = (
        (shard[1:] == shard[:-1])
        & (size[1:] == size[:-1]).all(axis=1)
        & (numel[1:] > 0)
        & (numel[:-1] > 0)
        & ((moved == 0) | ((moved == 1) & (step >= 0).all(axis=1)))
    )
    out: list[Run] = []
    k, n = 0, len(shard)
    chained_l, step_l = chained.tolist(), step.tolist()
    while k < n:
        end = k + 1
        if end < n and chained_l[k]:
            while end < n - 1 and chained_l[end] and step_l[end] == step_l[k]:
                end += 1
            end += 1
        out.append(_run(int(shard[k]), lo[k], size[k], step_l[k] if end - k > 1 else None, end - k))
        k = end
    return tuple(out)


def _run(shard: int, lo: np.ndarray, size: np.ndarray, step: list[int] | None, count: int) -> Run:
    lo_l, size_l = lo.tolist(), size.tolist()
    region = [slice(a, a + b) for a, b in zip(lo_l, size_l)]
    if step is None:
        return Run(shard, tuple(region), None, 0, 1, tuple(size_l))
    moving = [d for d, s in enumerate(step) if s]
    if not moving:
        return Run(shard, tuple(region), -1, 0, count, tuple(size_l))
    (d,) = moving
    region[d] = slice(lo_l[d], lo_l[d] + (count - 1) * step[d] + size_l[d])
    return Run(shard, tuple(region), d, step[d], count, tuple(size_l))


def _distinct(m: Moves, position: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """The first row of each distinct (source shard, peer, box) of ``m``, and every row of each.

    Peers in group order (rows kept in order within a peer); each distinct box's rows come first
    row first.
    """
    if not len(m):
        return np.zeros(0, np.int64), []
    first, inverse = unique_rows(np.c_[m.src_shard, m.peer, m.lo, m.size])
    rows = first[np.lexsort((first, position[m.peer[first]]))]
    group = np.empty(len(first), np.int64)
    group[inverse[rows]] = np.arange(len(rows))
    members: list[list[int]] = [[] for _ in rows]
    for k, g in enumerate(cast("list[int]", group[inverse].tolist())):
        members[g].append(k)
    return rows, members


def _at(layout: Layout, shard: np.ndarray, lo: np.ndarray, size: np.ndarray) -> list[Index]:
    """Each box as (shard, slices into that shard's tensor), built dim by dim (few Python objects)."""
    start = lo - layout.columns.lo[shard]
    stop = start + size
    if not layout.ndim:
        return [(j, ()) for j in shard.tolist()]
    per_dim = [map(slice, a.tolist(), b.tolist()) for a, b in zip(start.T, stop.T)]
    return list(zip(shard.tolist(), zip(*per_dim)))


def _by_peer(peer: np.ndarray, at: list[Index]) -> tuple[Peer, ...]:
    """Boxes grouped by their peer (consecutive runs: the rows are sorted by peer already)."""
    if not peer.size:
        return ()
    starts = np.r_[0, np.flatnonzero(peer[1:] != peer[:-1]) + 1]
    ends = np.r_[starts[1:], peer.size]
    return tuple((r, tuple(at[a:b])) for r, a, b in zip(peer[starts].tolist(), starts.tolist(), ends.tolist()))


def _split(m: Moves, rows: np.ndarray, position: np.ndarray, n: int) -> tuple[int, ...]:
    """Elements exchanged with each rank, in group order."""
    out = np.zeros(n, np.int64)
    np.add.at(out, position[m.peer[rows]], m.numel[rows])
    return tuple(out.tolist())


def _span(layout: Layout, shard: np.ndarray, lo: np.ndarray, size: np.ndarray) -> Span | None:
    """(shard, first element, end) when the boxes are ranges back to back in one contiguous shard.

    That is, when the boxes, in order, are non-empty ranges that follow each other in one shard
    stored contiguously (C order), else ``None``.
    """
    if not shard.size or np.unique(shard).size != 1:
        return None
    j = int(shard[0])
    sizes, lo = layout.columns.sz[j], lo - layout.columns.lo[j]
    if not (size > 0).all():
        return None
    if not sizes.size:  # a 0-d array: one box, its single element
        return (j, 0, 1) if shard.size == 1 else None
    if not _ranges(size, sizes[None, :]).all():
        return None
    strides = np.ones(len(sizes), np.int64)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    starts, counts = lo @ strides, rows_prod(size)
    if (starts[1:] != starts[:-1] + counts[:-1]).any():
        return None
    return j, int(starts[0]), int(starts[-1] + counts[-1])


def _ranges(size: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Whether each box of extents ``size`` is one range of a C-order tensor of ``shape``.

    It is when every extent before some dim is 1 and every extent after it is whole.
    """
    big = size > 1
    lead = np.argmax(big, axis=1)
    after = cast(np.ndarray, np.arange(size.shape[1])[None, :] > lead[:, None])  # numpy's stub: Unknown
    return ((size == shape) | ~after).all(axis=1) | ~big.any(axis=1)
