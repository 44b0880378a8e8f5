"""Global layout metadata: which box of the global shape lives on which rank."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from fshard import _boxes
from fshard._cache import cached
from fshard._errors import LayoutError
from fshard._placement import Placement, PlacementLike, as_placement

__all__ = [
    "MAX_EXTENT",
    "REDUCE_OPS",
    "Layout",
    "ShardMeta",
    "ShardMetaLike",
    "as_metas",
    "check_shape",
    "with_partial",
]

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


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class ShardMeta:
    """One box of the global array, ``[offsets, offsets + sizes)``, and its owner.

    >>> ShardMeta((0, 5), (5, 5), "rank:1/cuda:1")
    ShardMeta(offsets=(0, 5), sizes=(5, 5), placement=Placement(rank=1, device='cuda:1'))
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    placement: Placement

    def __init__(self, offsets: Iterable[int], sizes: Iterable[int], placement: PlacementLike) -> None:
        offsets = check_shape(offsets, "ShardMeta offsets")
        sizes = check_shape(sizes, "ShardMeta sizes")
        if len(offsets) != len(sizes):
            msg = f"ShardMeta offsets {offsets} and sizes {sizes} have different lengths."
            raise LayoutError(msg)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "placement", as_placement(placement))

    @property
    def numel(self) -> int:
        """Number of elements in the box (an exact int, however large)."""
        return math.prod(self.sizes)

    def _box(self) -> str:
        return f"[offsets {self.offsets}, sizes {self.sizes}] on {self.placement}"


ShardMetaLike = Union[ShardMeta, tuple[Iterable[int], Iterable[int], PlacementLike]]


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Layout:
    """The global shape and the shards that cover it, validated at construction.

    Non-empty boxes must lie inside ``shape``, be pairwise disjoint or identical
    (identical boxes on different placements are replicas) and cover every element.
    Validation is exact and takes O(n 2^d log n) for n shards in d dims.

    With ``partial="sum"`` (or ``"max"``, ``"min"``) the copies of a box are not
    replicas but **summands** (operands) of a pending reduction: the array's value
    is their elementwise sum (max, min). ``fshard.Partial(spec)`` resolves to one.

    >>> lay = Layout((4, 6), [ShardMeta((0, 0), (2, 6), 0), ShardMeta((2, 0), (2, 6), 1)])
    >>> lay.ranks, lay.numel
    ((0, 1), 24)
    >>> Layout.from_dict(lay.to_dict()) == lay
    True

    Raises:
        LayoutError: naming the offending shards and the fix.
    """

    shape: tuple[int, ...]
    partial: str | None
    _lo: np.ndarray = dataclasses.field(init=False, repr=False)
    _sz: np.ndarray = dataclasses.field(init=False, repr=False)
    _rank: np.ndarray = dataclasses.field(init=False, repr=False)
    _devices: tuple[str, ...] = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False)
    _metas: tuple[ShardMeta, ...] | None = dataclasses.field(init=False, repr=False)

    def __init__(self, shape: Iterable[int], shards: Iterable[ShardMetaLike], partial: str | None = None) -> None:
        shape = check_shape(shape)
        shards = as_metas(shards)
        _check_partial(partial)
        lo, sz, rank, devices = _columns(shape, shards)
        if len(shards) <= _MEMO_SHARDS:
            _validate_memo(shape, shards)
        else:
            _validate(shape, shards, lo, sz, rank, devices)
        self._set(shape, partial, lo, sz, rank, devices, shards)

    def _set(
        self,
        shape: tuple[int, ...],
        partial: str | None,
        lo: np.ndarray,
        sz: np.ndarray,
        rank: np.ndarray,
        devices: tuple[str, ...],
        metas: tuple[ShardMeta, ...] | None,
    ) -> None:
        for arr in (lo, sz, rank):
            arr.setflags(write=False)
        for name, value in (("shape", shape), ("partial", partial), ("_lo", lo), ("_sz", sz), ("_rank", rank),
                            ("_devices", devices), ("_metas", metas)):  # fmt: skip
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash((shape, lo.tobytes(), sz.tobytes(), rank.tobytes(), devices, partial)))

    @classmethod
    def from_arrays(
        cls,
        shape: Iterable[int],
        offsets: Any,
        sizes: Any,
        ranks: Any,
        devices: str | Sequence[str] = "cpu",
        partial: str | None = None,
    ) -> Layout:
        """A layout from columns: ``offsets`` and ``sizes`` of shape (n, ndim), ``ranks`` of shape (n,).

        Validated like the constructor, with numpy only: no ``ShardMeta`` is made until
        ``shards`` is read, so a layout of 100,000 shards builds in milliseconds.
        ``devices`` is one device for every shard or one per shard. The result equals
        (and hashes, pickles and serialises like) ``Layout(shape, shards, partial)``.

        >>> import numpy as np
        >>> lay = Layout.from_arrays((4, 6), [[0, 0], [2, 0]], [[2, 6], [2, 6]], [0, 1])
        >>> lay == Layout((4, 6), [ShardMeta((0, 0), (2, 6), 0), ShardMeta((2, 0), (2, 6), 1)])
        True
        >>> lay.shards[1]
        ShardMeta(offsets=(2, 0), sizes=(2, 6), placement=Placement(rank=1, device='cpu'))

        Raises:
            LayoutError: for columns of the wrong shape or values, or shards that do not tile ``shape``.
        """
        shape = check_shape(shape)
        _check_partial(partial)
        lo, sz, rank = _int_columns(shape, offsets, sizes, ranks)
        devs = _device_column(devices, len(rank))
        _validate(shape, _LazyShards(lo, sz, rank, devs), lo, sz, rank, devs)
        out = object.__new__(cls)
        out._set(shape, partial, lo, sz, rank, devs, None)
        return out

    @property
    def shards(self) -> tuple[ShardMeta, ...]:
        """The shards as ``ShardMeta`` values, in layout order (built on first use for ``from_arrays`` layouts)."""
        metas = self._metas
        if metas is None:
            metas = tuple(_LazyShards(self._lo, self._sz, self._rank, self._devices))
            object.__setattr__(self, "_metas", metas)
        return metas

    def _shard(self, i: int) -> ShardMeta:
        """``shards[i]``, without building the other shards' ``ShardMeta`` (``from_arrays`` layouts)."""
        metas = self._metas
        return metas[i] if metas is not None else _LazyShards(self._lo, self._sz, self._rank, self._devices)[i]

    # Value semantics: compare by content, hash once, rebuild (and revalidate) on unpickle.
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        # The arrays hold the same facts as ``shards``, and compare far faster.
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and len(self._rank) == len(other._rank)
            and all(a.tobytes() == b.tobytes() for a, b in ((self._lo, other._lo), (self._sz, other._sz)))
            and self._rank.tobytes() == other._rank.tobytes()
            and self._devices == other._devices
            and self.partial == other.partial
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        devices = self._devices[0] if len(set(self._devices)) == 1 else self._devices
        return (_from_columns, (self.shape, self._lo, self._sz, self._rank, devices, self.partial))

    def __repr__(self) -> str:
        """``Layout(shape=..., shards=[(offsets, sizes, placement), ...])``, which rebuilds it; large ones
        summarised (without making their ``ShardMeta`` values)."""
        from fshard._repr import MAX_SHARDS, _span, layout_repr

        if len(self._rank) > MAX_SHARDS:  # without making the shards
            pending = f", partial={self.partial!r}" if self.partial else ""
            return f"Layout(shape={self.shape}, {len(self._rank)} shards on ranks {_span(self.ranks)}{pending})"
        return layout_repr(self)

    @property
    def ndim(self) -> int:
        """Number of dimensions of the global array."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements of the global array (an exact int, however large)."""
        return math.prod(self.shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that hold at least one shard, sorted."""
        return _ranks(self)

    def shards_on(self, rank: int) -> tuple[ShardMeta, ...]:
        """The shards placed on ``rank``, in layout order."""
        return tuple(self._shard(i) for i in self.indices_on(rank))

    def indices_on(self, rank: int) -> tuple[int, ...]:
        """Indices (into ``shards``) of the shards placed on ``rank``."""
        if isinstance(rank, (int, np.integer)) and 0 <= rank < MAX_EXTENT:  # (ranks are int64)
            return _indices_on(self, int(rank))
        return ()

    @property
    def is_fully_replicated(self) -> bool:
        """True when every shard holds the whole array."""
        return bool((self._lo == 0).all() and (self._sz == np.array(self.shape, np.int64)).all())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; ``Layout.from_dict`` rebuilds an equal layout."""
        out: dict[str, Any] = {
            "shape": list(self.shape),
            "shards": [
                {"offsets": lo, "sizes": sz, "placement": f"rank:{r}/{dev}"}
                for lo, sz, r, dev in zip(self._lo.tolist(), self._sz.tolist(), self._rank.tolist(), self._devices)
            ],
        }
        if self.partial is not None:
            out["partial"] = self.partial
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of ``to_dict``."""
        try:
            shards = [ShardMeta(s["offsets"], s["sizes"], s["placement"]) for s in data["shards"]]
            return cls(tuple(data["shape"]), tuple(shards), data.get("partial"))
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            msg = f"Not a layout dict (want keys 'shape' and 'shards'): {exc!r}"
            raise LayoutError(msg) from exc

    def to_torch_metadata(self, dtype: Any = None, requires_grad: bool = False) -> Any:
        """This layout as torch's ``ShardedTensorMetadata`` (``dtype`` defaults to float32)."""
        from fshard._torch_meta import to_torch_metadata

        return to_torch_metadata(self, dtype, requires_grad)

    @classmethod
    def from_torch_metadata(cls, metadata: Any) -> Layout:
        """Reads torch's ``ShardedTensorMetadata`` (or a list of ``ShardMetadata`` with a size)."""
        from fshard._torch_meta import from_torch_metadata

        return from_torch_metadata(metadata)

    def visualize(self, width: int = 60, *, color: bool | str = False) -> str:
        """A picture of the layout, to scale: which ranks hold which box.

        Widths and heights are proportional to the boxes' extents (like
        ``jax.debug.visualize_array_sharding``); an N-D layout is drawn over the dims
        its boxes split (a summary where they split more than two), an empty one as a
        line. A partial layout adds a line saying which reduction is pending.

        Args:
            width: the picture's width at most, in characters (at least 4).
            color: ``False`` (plain text, the default); ``True``: each box in its lowest
                rank's colour, as ANSI codes; ``"auto"``: colour only when standard output
                is a terminal. Colour needs ``rich`` (the ``bench`` extra); without it
                the text is plain.

        Rows of 3, 3, 3 and 1 make bands of 2, 2, 2 and 1 lines:

        >>> from fshard import Chunk
        >>> print(Chunk(0, [0, 1, 2, 3]).layout((10, 20)).visualize(width=40))
        +---------------------------------------+
        |                  r0                   |
        |                                       |
        +---------------------------------------+
        |                  r1                   |
        |                                       |
        +---------------------------------------+
        |                  r2                   |
        |                                       |
        +---------------------------------------+
        |                  r3                   |
        +---------------------------------------+
        """
        from fshard._visualize import visualize

        text = visualize(self, width, color)  # type: ignore[arg-type]
        if self.partial is not None:
            text += f"\n(pending {self.partial}: each element is the {self.partial} of its copies)"
        return text


@cached(1024)
def with_partial(layout: Layout, partial: str | None) -> Layout:
    """``layout`` with its copies read as summands of ``partial`` (``None``: as replicas)."""
    if layout.partial == partial:
        return layout
    return Layout(layout.shape, layout.shards, partial)


@cached(256)
def _ranks(layout: Layout) -> tuple[int, ...]:
    return tuple(int(r) for r in np.unique(layout._rank))


@cached(256)
def _rank_order(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The shard indices sorted by rank (stably: ascending within a rank), and their ranks."""
    order = np.argsort(layout._rank, kind="stable")
    return order, layout._rank[order]


@cached(4096)
def _indices_on(layout: Layout, rank: int) -> tuple[int, ...]:
    order, ranks = _rank_order(layout)
    a, b = np.searchsorted(ranks, [rank, rank + 1])
    return tuple(order[a:b].tolist())


def as_metas(shards: Iterable[ShardMetaLike]) -> tuple[ShardMeta, ...]:
    """``shards`` as a tuple of ``ShardMeta``; ``(offsets, sizes, placement)`` tuples are converted."""
    try:
        shards = tuple(shards)
    except TypeError:
        raise TypeError(f"Layout shards must be a sequence of boxes, got {type(shards).__name__}.") from None
    if set(map(type, shards)) <= {ShardMeta}:  # the common case, without a Python-level loop
        return shards  # type: ignore[return-value]
    return tuple(_as_meta(s) for s in shards)


def _as_meta(s: Any) -> ShardMeta:
    if isinstance(s, ShardMeta):
        return s
    if isinstance(s, (str, bytes)) or not isinstance(s, (tuple, list)) or len(s) != 3:
        msg = f"Layout shards must be ShardMeta or (offsets, sizes, placement) triples, got {s!r}."
        raise TypeError(msg)
    return ShardMeta(*s)


_OFFSETS, _SIZES, _PLACEMENT = (operator.attrgetter(a) for a in ("offsets", "sizes", "placement"))
_RANK, _DEVICE = operator.attrgetter("rank"), operator.attrgetter("device")


def _columns(
    shape: tuple[int, ...], shards: tuple[ShardMeta, ...]
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


def _check_partial(partial: str | None) -> None:
    if partial is not None and partial not in REDUCE_OPS:
        msg = f"Layout partial={partial!r} is not a reduction; use None or one of {list(REDUCE_OPS)}."
        raise LayoutError(msg)


def _int_columns(shape: tuple[int, ...], offsets: Any, sizes: Any, ranks: Any) -> tuple[np.ndarray, ...]:
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


def _device_column(devices: str | Sequence[str], n: int) -> tuple[str, ...]:
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


class _LazyShards(Sequence[ShardMeta]):
    """The shards of validated columns, each ``ShardMeta`` made when indexed."""

    def __init__(self, lo: np.ndarray, sz: np.ndarray, rank: np.ndarray, devices: tuple[str, ...]) -> None:
        self._cols = (lo, sz, rank, devices)

    def __len__(self) -> int:
        return len(self._cols[2])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        lo, sz, rank, devices = self._cols
        return _checked(ShardMeta, offsets=tuple(lo[i].tolist()), sizes=tuple(sz[i].tolist()),
                        placement=_checked(Placement, rank=int(rank[i]), device=devices[i]))  # fmt: skip

    def __iter__(self) -> Any:
        lo, sz, rank, devices = self._cols
        for o, z, r, dev in zip(map(tuple, lo.tolist()), map(tuple, sz.tolist()), rank.tolist(), devices):
            yield _checked(ShardMeta, offsets=o, sizes=z, placement=_checked(Placement, rank=r, device=dev))


def _checked(cls: type, **values: Any) -> Any:
    """An instance of a frozen value class from values already validated (its checks skipped)."""
    out = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out


def _from_columns(
    shape: tuple[int, ...],
    lo: np.ndarray,
    sz: np.ndarray,
    rank: np.ndarray,
    devices: str | Sequence[str],
    partial: str | None,
) -> Layout:
    """Unpickles a layout (validated again)."""
    return Layout.from_arrays(shape, lo, sz, rank, devices, partial)


def _check_ndims(shape: tuple[int, ...], shards: tuple[ShardMeta, ...], ndims: np.ndarray) -> None:
    d = len(shape)
    bad = np.flatnonzero(ndims != d)
    if bad.size:
        i = int(bad[0])
        msg = (
            f"Shard {i} {shards[i]._box()} has {ndims[i]} dims but shape {shape} has {d}: "
            "give every shard one offset and one size per dimension."
        )
        raise LayoutError(msg)


# Layouts up to this many shards are validated once per distinct value: a spec resolves
# to the same small layout on every call, and numpy's per-call overhead dominates there.
_MEMO_SHARDS = 64


@cached(1024)
def _validate_memo(shape: tuple[int, ...], shards: tuple[ShardMeta, ...]) -> None:
    _validate(shape, shards, *_columns(shape, shards))


def _validate(
    shape: tuple[int, ...],
    shards: Sequence[ShardMeta],
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


def _check_bounds(shape, shards, lo, sz, bounds, nonempty) -> None:
    """Raises naming the first non-empty shard that extends past ``shape``.

    ``lo > bounds - sz`` is ``lo + sz > bounds`` without the int64 overflow of the sum.
    """
    past = _boxes.rows_any(lo > bounds - sz) & nonempty
    if not past.any():
        return
    i = int(np.flatnonzero(past)[0])
    dim = int(np.flatnonzero(lo[i] > bounds - sz[i])[0])
    msg = (
        f"Shard {i} {shards[i]._box()} extends past shape {shape} in dim {dim} "
        f"({lo[i, dim]} + {sz[i, dim]} > {shape[dim]}): shrink the shard or grow the shape."
    )
    raise LayoutError(msg)


def _distinct_boxes(
    shards: Sequence[ShardMeta], lo: np.ndarray, sz: np.ndarray, owner: np.ndarray, nonempty: np.ndarray
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


def _check_no_duplicates(shards: Sequence[ShardMeta], rows: np.ndarray) -> None:
    """Raises if two shards are equal (same box and placement); ``rows`` encodes each shard."""
    first, inverse = _boxes.unique_rows(rows)
    if len(first) == len(shards):
        return
    i = int(np.flatnonzero(first[inverse] != np.arange(len(shards)))[0])
    msg = (
        f"Shards {int(first[inverse[i]])} and {i} are the same box {shards[i]._box()}: a replica must sit on "
        "another placement; drop the duplicate."
    )
    raise LayoutError(msg)


def _explain(shape, shards, lo, hi, nonempty, ulo, uhi, got, want) -> None:
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
                int(j) for j in owners if shards[j].offsets != shards[a].offsets or shards[j].sizes != shards[a].sizes
            )
            msg = (
                f"Shards {a} {shards[a]._box()} and {b} {shards[b]._box()} overlap at element "
                f"{point} without being identical: boxes must be disjoint, or identical to be replicas."
            )
            raise LayoutError(msg)
    raise LayoutError(f"Shards do not tile shape {shape} exactly.")  # pragma: no cover
