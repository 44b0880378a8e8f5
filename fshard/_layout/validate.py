"""Checks that a layout's columns tile its shape: exact, in numpy, O(n 2^d log n) for n shards in d dims.

``Layout`` and ``Layout.from_arrays`` call these; every failure raises ``LayoutError``
naming the offending shards and the fix.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from fshard._base import boxes as _boxes
from fshard._base.cache import cached
from fshard._errors import LayoutError
from fshard._layout.placement import Placement

__all__ = [
    "ShardLike",
    "Columns",
    "MAX_EXTENT",
    "MEMO_SHARDS",
    "REDUCE_OPS",
    "check_partial",
    "check_shape",
    "columns_of",
    "device_column",
    "int_columns",
    "validate",
    "validate_memo",
]


class ShardLike(Protocol):
    """What validation and pictures read of a shard (a ``ShardMeta``): its box, owner, size and name in messages."""

    @property
    def offsets(self) -> tuple[int, ...]: ...
    @property
    def sizes(self) -> tuple[int, ...]: ...
    @property
    def placement(self) -> Placement: ...
    @property
    def numel(self) -> int: ...
    def box(self) -> str: ...


class Columns(NamedTuple):
    """A layout's shards as read-only numpy columns, in layout order (``Layout.columns``).

    ``lo`` and ``sz`` are the offsets and sizes, (shards x ndim) int64; ``rank`` the
    ranks, (shards,) int64; ``devices`` one device string per shard. Planning, indexes
    and backends read layouts through these, without making ``ShardMeta`` values.
    """

    lo: np.ndarray
    sz: np.ndarray
    rank: np.ndarray
    devices: tuple[str, ...]


# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false

# The pending reductions a layout may carry: its copies of a box are summands (or operands).
REDUCE_OPS = ("sum", "max", "min")


# Every extent, offset and size is at most this (int64): layouts are validated in exact
# integer arithmetic up to it, and ``numel`` is an exact Python int beyond it.
MAX_EXTENT = 2**63 - 1


def check_shape(shape: Iterable[Any], what: str = "shape") -> tuple[int, ...]:
    """Returns ``shape`` as a tuple of ints in ``[0, MAX_EXTENT]``, or raises ``TypeError``/``LayoutError``."""
    try:
        out = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {shape!r} ({type(shape).__name__}).") from None
    # Fast path: plain ints (bool is a subclass, so ``type(...) is int`` excludes it).
    if all(type(s) is int for s in out) and (not out or (min(out) >= 0 and max(out) <= MAX_EXTENT)):
        return out
    for s in out:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            msg = f"{what} must hold ints, got {s!r} ({type(s).__name__}) in {out!r}."
            raise TypeError(msg)
        if s < 0:
            raise LayoutError(f"{what} must be non-negative, got {out!r}.")
        if s > MAX_EXTENT:
            msg = f"{what} {out!r} holds {s}, past the largest supported extent 2**63 - 1 (int64)."
            raise LayoutError(msg)
    return tuple(int(s) for s in out)


_OFFSETS, _SIZES, _PLACEMENT = (operator.attrgetter(a) for a in ("offsets", "sizes", "placement"))
_RANK, _DEVICE = operator.attrgetter("rank"), operator.attrgetter("device")


def columns_of(
    shape: tuple[int, ...], shards: tuple[ShardLike, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """Offsets, sizes and ranks as int64 arrays, and the devices; checks every shard has ``len(shape)`` dims.

    Built with ``map``/``fromiter`` over the shards: a Python loop per shard would
    dominate validating 100,000 shards.
    """
    n, d = len(shards), len(shape)
    offsets = list(map(_OFFSETS, shards))
    if set(map(len, offsets)) - {d}:
        _check_ndims(shape, shards, np.fromiter(map(len, offsets), np.int64, count=n))
    lo = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, count=n * d).reshape(n, d)
    sizes = itertools.chain.from_iterable(map(_SIZES, shards))
    sz = np.fromiter(sizes, np.int64, count=n * d).reshape(n, d)
    placements = list(map(_PLACEMENT, shards))
    rank = np.fromiter(map(_RANK, placements), np.int64, count=n)
    return lo, sz, rank, tuple(map(_DEVICE, placements))


def check_partial(partial: str | None) -> None:
    if partial is not None and partial not in REDUCE_OPS:
        msg = f"Layout partial={partial!r} is not a reduction; use None or one of {list(REDUCE_OPS)}."
        raise LayoutError(msg)


def int_columns(shape: tuple[int, ...], offsets: Any, sizes: Any, ranks: Any) -> tuple[np.ndarray, ...]:
    """``offsets``, ``sizes`` (n x ndim) and ``ranks`` (n) as fresh int64 arrays, or raises ``LayoutError``."""
    d = len(shape)
    rank = _int_array(ranks, "ranks")
    if rank.ndim != 1:
        raise LayoutError(f"Layout.from_arrays ranks must be 1-D (one rank per shard), got shape {rank.shape}.")
    n = len(rank)
    out = [rank]
    for name, value in (("offsets", offsets), ("sizes", sizes)):
        arr = _int_array(value, name)
        if arr.size == 0 and n == 0:
            arr = arr.reshape(0, d)
        elif arr.ndim == 1 and d == 1:
            arr = arr.reshape(-1, 1)
        if arr.shape != (n, d):
            msg = (
                f"Layout.from_arrays {name} must have shape (shards, ndim) = ({n}, {d}) for {n} ranks "
                f"and shape {shape}, got {arr.shape}."
            )
            raise LayoutError(msg)
        out.append(arr)
    for name, arr in (("offsets", out[1]), ("sizes", out[2]), ("ranks", rank)):
        if arr.size and int(arr.min()) < 0:
            i = int(np.flatnonzero(_boxes.rows_any(arr.reshape(n, -1) < 0))[0])
            raise LayoutError(f"Layout.from_arrays {name} of shard {i} must be non-negative, got {arr[i].tolist()}.")
    return out[1], out[2], rank


def _int_array(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"Layout.from_arrays {name} must be an array of ints, got {value!r}: {exc}") from None
    if arr.dtype == object:
        raise LayoutError(f"Layout.from_arrays {name} must be an array of ints, got {value!r}.")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise LayoutError(f"Layout.from_arrays {name} must hold ints, got dtype {arr.dtype}.")
    if arr.dtype.kind == "u" and int(arr.max()) > MAX_EXTENT:
        raise LayoutError(f"Layout.from_arrays {name} holds {int(arr.max())}, past 2**63 - 1 (int64).")
    return np.array(arr, dtype=np.int64, order="C")


def device_column(devices: str | Sequence[str], n: int) -> tuple[str, ...]:
    """One normalised device string per shard (as ``Placement`` spells it)."""
    if not isinstance(devices, (str, Sequence)):
        raise TypeError(f"Layout.from_arrays devices must be a str or a sequence of str, got {devices!r}.")
    names = [devices] if isinstance(devices, str) else list(devices)
    if not isinstance(devices, str) and len(names) != n:
        raise LayoutError(
            f"Layout.from_arrays devices must be one str or {n} of them (one per shard), got {len(names)}."
        )
    bad = next((d for d in names if not isinstance(d, str)), None)
    if bad is not None:  # before the set below, which would raise Python's TypeError for a list
        kind = type(bad).__name__
        raise TypeError(f"Layout.from_arrays devices must be a str or a sequence of str, got an item {bad!r} ({kind}).")
    spelled = {name: Placement(0, name).device for name in set(names)}
    if isinstance(devices, str):
        return (spelled[devices],) * n
    return tuple(map(spelled.__getitem__, names))


def _check_ndims(shape: tuple[int, ...], shards: tuple[ShardLike, ...], ndims: np.ndarray) -> None:
    d = len(shape)
    bad = np.flatnonzero(ndims != d)
    if bad.size:
        i = int(bad[0])
        msg = (
            f"Shard {i} {shards[i].box()} has {ndims[i]} dims but shape {shape} has {d}: "
            "give every shard one offset and one size per dimension."
        )
        raise LayoutError(msg)


# Layouts up to this many shards are validated once per distinct value: a spec resolves
# to the same small layout on every call, and numpy's per-call overhead dominates there.
MEMO_SHARDS = 64


@cached(1024)
def validate_memo(shape: tuple[int, ...], shards: tuple[ShardLike, ...]) -> None:
    validate(shape, shards, *columns_of(shape, shards))


def validate(
    shape: tuple[int, ...],
    shards: Sequence[ShardLike],
    lo: np.ndarray,
    sz: np.ndarray,
    rank: np.ndarray,
    devices: tuple[str, ...],
) -> None:
    bounds = np.array(shape, np.int64)
    nonempty = _boxes.rows_all(sz > 0)
    _check_bounds(shape, shards, lo, sz, bounds, nonempty)
    # Inside the shape, so no sum overflows; an empty box keeps hi = lo (it covers nothing either way).
    hi = lo + np.where(nonempty[:, None], sz, 0)
    boxes = _distinct_boxes(shards, lo, sz, np.stack([rank, _codes(devices)], axis=1), nonempty)
    ulo, uhi = lo[boxes], hi[boxes]
    want = _shape_corners(shape)
    got = _boxes.corner_sums(ulo, uhi, bounds)
    if got != want:
        _explain(shape, shards, lo, hi, np.flatnonzero(nonempty), ulo, uhi, got, want)


def _shape_corners(shape: tuple[int, ...]) -> dict[tuple[int, ...], int]:
    """``corner_sums`` of the one box that is the whole shape (none if it is empty)."""
    if 0 in shape:
        return {}
    corners = itertools.product((0, 1), repeat=len(shape))
    return {tuple(n if e else 0 for n, e in zip(shape, c)): 1 - 2 * (sum(c) % 2) for c in corners}


def _check_bounds(
    shape: tuple[int, ...],
    shards: Sequence[ShardLike],
    lo: np.ndarray,
    sz: np.ndarray,
    bounds: np.ndarray,
    nonempty: np.ndarray,
) -> None:
    """Raises naming the first non-empty shard that extends past ``shape``.

    ``lo > bounds - sz`` is ``lo + sz > bounds`` without the int64 overflow of the sum.
    """
    past = _boxes.rows_any(lo > bounds - sz) & nonempty
    if not past.any():
        return
    i = int(np.flatnonzero(past)[0])
    dim = int(np.flatnonzero(lo[i] > bounds - sz[i])[0])
    msg = (
        f"Shard {i} {shards[i].box()} extends past shape {shape} in dim {dim} "
        f"({lo[i, dim]} + {sz[i, dim]} > {shape[dim]}): shrink the shard or grow the shape."
    )
    raise LayoutError(msg)


def _distinct_boxes(
    shards: Sequence[ShardLike], lo: np.ndarray, sz: np.ndarray, owner: np.ndarray, nonempty: np.ndarray
) -> np.ndarray:
    """Index of the first shard of each distinct non-empty box; raises if two non-empty shards are equal.

    Equal empty shards hold nothing and are allowed (``Chunk`` of a size-0 dim over a
    repeated placement makes them, as torch's ``ChunkShardingSpec`` does).

    One sort by (box, owner) finds both: equal neighbours are duplicate shards, and
    runs of one box are its replicas.
    """
    owner = np.c_[owner, np.where(nonempty, -1, np.arange(len(shards)))]
    box, who = _boxes.row_keys(np.concatenate([lo, sz], axis=1)), _boxes.row_keys(owner)
    width = int(who.max()) + 1 if who is not None and len(who) else 1
    if box is None or who is None or (int(box.max(initial=0)) + 1) * width > 2**63 - 1:
        _check_no_duplicates(shards, np.c_[lo, sz, owner])
        first, _ = _boxes.unique_rows(np.c_[lo, sz])
        return first[nonempty[first]]
    key = box * width + who
    order = np.argsort(key)
    srt = key[order]
    if (srt[1:] == srt[:-1]).any():
        _check_no_duplicates(shards, np.c_[lo, sz, owner])
    runs = np.flatnonzero(np.concatenate([[True], box[order[1:]] != box[order[:-1]]]))
    first = np.minimum.reduceat(order, runs) if len(order) else order
    return first[nonempty[first]]


def _codes(devices: tuple[str, ...]) -> np.ndarray:
    """A small int per distinct device string."""
    index = {name: k for k, name in enumerate(set(devices))}
    if len(index) == 1:
        return np.zeros(len(devices), np.int64)
    return np.fromiter(map(index.__getitem__, devices), np.int64, count=len(devices))


def _check_no_duplicates(shards: Sequence[ShardLike], rows: np.ndarray) -> None:
    """Raises if two shards are equal (same box and placement); ``rows`` encodes each shard."""
    first, inverse = _boxes.unique_rows(rows)
    if len(first) == len(shards):
        return
    i = int(np.flatnonzero(first[inverse] != np.arange(len(shards)))[0])
    msg = (
        f"Shards {int(first[inverse[i]])} and {i} are the same box {shards[i].box()}: a replica must sit on "
        "another placement; drop the duplicate."
    )
    raise LayoutError(msg)


def _explain(
    shape: tuple[int, ...],
    shards: Sequence[ShardLike],
    lo: np.ndarray,
    hi: np.ndarray,
    nonempty: np.ndarray,
    ulo: np.ndarray,
    uhi: np.ndarray,
    got: dict[tuple[int, ...], int],
    want: dict[tuple[int, ...], int],
) -> None:
    """Finds an element covered twice or not at all and raises naming the shards."""
    bounds = np.array(shape, np.int64)
    bad = [p for p in set(got) | set(want) if got.get(p, 0) != want.get(p, 0)]
    for p in sorted(bad):
        for e in np.ndindex(*(2,) * len(shape)):
            q = np.array(p, np.int64) - np.array(e, np.int64)
            if (q < 0).any() or (q >= bounds).any():
                continue
            covering = _boxes.count_containing(ulo, uhi, q)
            if len(covering) == 1:
                continue
            point = tuple(int(v) for v in q)
            if not len(covering):
                covered = sum(math.prod(r) for r in (uhi - ulo).tolist())
                msg = (
                    f"Shards do not cover element {point} of shape {shape} (the distinct boxes "
                    f"hold {covered} of {math.prod(shape)} elements): add a shard that covers it."
                )
                raise LayoutError(msg)
            owners = nonempty[_boxes.count_containing(lo[nonempty], hi[nonempty], q)]
            a = int(owners[0])
            b = next(
                j
                for j in cast("list[int]", owners.tolist())
                if shards[j].offsets != shards[a].offsets or shards[j].sizes != shards[a].sizes
            )
            msg = (
                f"Shards {a} {shards[a].box()} and {b} {shards[b].box()} overlap at element "
                f"{point} without being identical: boxes must be disjoint, or identical to be replicas."
            )
            raise LayoutError(msg)
    raise LayoutError(f"Shards do not tile shape {shape} exactly.")  # pragma: no cover
