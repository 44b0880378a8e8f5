"""Global layout metadata: which box of the global shape lives on which rank."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from fshard._base.cache import cached
from fshard._errors import LayoutError
from fshard._layout.placement import Placement, PlacementLike, as_placement
from fshard._layout.show import MAX_SHARDS, layout_repr, span, summands_line, visualize
from fshard._layout.terms import canonical_terms
from fshard._layout.torch_meta import read_torch_metadata, to_torch_metadata
from fshard._layout.validate import (
    MAX_EXTENT,
    MEMO_SHARDS,
    Columns,
    check_partial,
    check_shape,
    columns_of,
    device_column,
    int_columns,
    validate,
    validate_memo,
)

__all__ = [
    "Columns",
    "Layout",
    "ShardMeta",
    "ShardMetaLike",
    "as_metas",
    "layout_digest",
    "replica_ids",
    "with_partial",
    "with_terms",
]


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

    def box(self) -> str:
        """``[offsets ..., sizes ...] on rank:r/device``, for messages."""
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
    ``terms`` (one int per shard, with ``partial`` only) says which copies are summands:
    copies of a box with the same term are replicas of one summand, copies with different
    terms are different summands (``None``: every copy is a summand of its own). It is
    kept canonical (``fshard._layout.terms``): each box's summands numbered 0, 1, ... in
    order of first appearance, and ``None`` where no two copies are replicas.
    ``fshard.Partial(Named(mesh, ...), over=axes)`` resolves to one.

    >>> lay = Layout((4, 6), [ShardMeta((0, 0), (2, 6), 0), ShardMeta((2, 0), (2, 6), 1)])
    >>> lay.ranks, lay.numel
    ((0, 1), 24)
    >>> Layout.from_dict(lay.to_dict()) == lay
    True

    A pending sum of two summands, each held by two ranks (ranks 0 and 2 hold one, 1 and 3
    the other):

    >>> p = Layout((3,), [((0,), (3,), r) for r in range(4)], "sum", terms=[0, 1, 0, 1])
    >>> p.terms.tolist(), replica_ids(p).tolist()
    ([0, 1, 0, 1], [0, 1, 0, 1])

    Raises:
        LayoutError: naming the offending shards and the fix.
    """

    shape: tuple[int, ...]
    partial: str | None
    terms: np.ndarray | None = dataclasses.field(init=False, repr=False)
    _lo: np.ndarray = dataclasses.field(init=False, repr=False)
    _sz: np.ndarray = dataclasses.field(init=False, repr=False)
    _rank: np.ndarray = dataclasses.field(init=False, repr=False)
    _devices: tuple[str, ...] = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False)
    _metas: tuple[ShardMeta, ...] | None = dataclasses.field(init=False, repr=False)
    columns: Columns = dataclasses.field(init=False, repr=False)

    def __init__(
        self, shape: Iterable[int], shards: Iterable[ShardMetaLike], partial: str | None = None, terms: Any = None
    ) -> None:
        shape = check_shape(shape)
        shards = as_metas(shards)
        check_partial(partial)
        lo, sz, rank, devices = columns_of(shape, shards)
        if len(shards) <= MEMO_SHARDS:
            validate_memo(shape, shards)
        else:
            validate(shape, shards, lo, sz, rank, devices)
        self._set(shape, partial, lo, sz, rank, devices, shards, canonical_terms(terms, lo, sz, rank, partial))

    def _set(
        self,
        shape: tuple[int, ...],
        partial: str | None,
        lo: np.ndarray,
        sz: np.ndarray,
        rank: np.ndarray,
        devices: tuple[str, ...],
        metas: tuple[ShardMeta, ...] | None,
        terms: np.ndarray | None,
    ) -> None:
        for arr in (lo, sz, rank):
            arr.setflags(write=False)
        for name, value in (("shape", shape), ("partial", partial), ("terms", terms), ("_lo", lo), ("_sz", sz),
                            ("_rank", rank), ("_devices", devices), ("_metas", metas)):  # fmt: skip
            object.__setattr__(self, name, value)
        object.__setattr__(self, "columns", Columns(lo, sz, rank, devices))
        summands = None if terms is None else terms.tobytes()
        key = (shape, lo.tobytes(), sz.tobytes(), rank.tobytes(), devices, partial, summands)
        object.__setattr__(self, "_hash", hash(key))

    @classmethod
    def from_arrays(
        cls,
        shape: Iterable[int],
        offsets: Any,
        sizes: Any,
        ranks: Any,
        devices: str | Sequence[str] = "cpu",
        partial: str | None = None,
        terms: Any = None,
    ) -> Layout:
        """A layout from columns: ``offsets`` and ``sizes`` of shape (n, ndim), ``ranks`` of shape (n,).

        Validated like the constructor, with numpy only: no ``ShardMeta`` is made until
        ``shards`` is read, so a layout of 100,000 shards builds in milliseconds.
        ``devices`` is one device for every shard or one per shard. The result equals
        (and hashes, pickles and serialises like) ``Layout(shape, shards, partial, terms)``.

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
        check_partial(partial)
        lo, sz, rank = int_columns(shape, offsets, sizes, ranks)
        devs = device_column(devices, len(rank))
        validate(shape, _LazyShards(lo, sz, rank, devs), lo, sz, rank, devs)
        out = object.__new__(cls)
        out._set(shape, partial, lo, sz, rank, devs, None, canonical_terms(terms, lo, sz, rank, partial))
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
            and _same_terms(self.terms, other.terms)
        )

    def __hash__(self) -> int:
        return self._hash

    def __fshard_nbytes__(self) -> int:
        """What a cache entry holding this layout costs: its columns, and (once made) a ShardMeta per shard."""
        terms = 0 if self.terms is None else int(self.terms.nbytes)
        return 160 * len(self._lo) + sum(int(a.nbytes) for a in (self._lo, self._sz, self._rank)) + terms

    def __reduce__(self) -> tuple[Any, ...]:
        devices = self._devices[0] if len(set(self._devices)) == 1 else self._devices
        return (_from_columns, (self.shape, self._lo, self._sz, self._rank, devices, self.partial, self.terms))

    def __repr__(self) -> str:
        """``Layout(shape=..., shards=[(offsets, sizes, placement), ...])`` that rebuilds it; large ones summarised."""
        if len(self._rank) > MAX_SHARDS:  # without making the shards
            pending = f", partial={self.partial!r}" if self.partial else ""
            if self.terms is not None:
                pending += f", up to {int(self.terms.max()) + 1} summands per box"
            return f"Layout(shape={self.shape}, {len(self._rank)} shards on ranks {span(self.ranks)}{pending})"
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
        if isinstance(rank, (int, np.integer)) and 0 <= rank < MAX_EXTENT:  # (ranks are int64)  # pyright: ignore[reportUnnecessaryIsInstance]
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
        if self.terms is not None:
            out["terms"] = self.terms.tolist()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of ``to_dict``."""
        try:
            shards = [ShardMeta(s["offsets"], s["sizes"], s["placement"]) for s in data["shards"]]
            return cls(tuple(data["shape"]), tuple(shards), data.get("partial"), data.get("terms"))
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            msg = f"Not a layout dict (want keys 'shape' and 'shards'): {exc!r}"
            raise LayoutError(msg) from exc

    def to_torch_metadata(self, dtype: Any = None, requires_grad: bool = False) -> Any:
        """This layout as torch's ``ShardedTensorMetadata`` (``dtype`` defaults to float32).

        A box held on several ranks (replicas) is listed once per rank: ``from_torch_metadata``
        reads it back, where torch's own checks refuse overlapping shards
        (``to_sharded_tensor`` refuses replicas).

        Raises:
            LayoutError: a pending reduction (``partial``), which torch's metadata cannot hold: its
                summands would read back as replicas of one value.
        """
        if self.partial is not None:
            msg = (
                f"to_torch_metadata(): ShardedTensorMetadata cannot hold a pending reduction ({self.partial!r}), "
                "whose summands it would read as one value: reduce first (fshard.reshard to a spec without Partial)."
            )
            raise LayoutError(msg)
        return to_torch_metadata(self.shape, self.shards, dtype, requires_grad)

    @classmethod
    def from_torch_metadata(cls, metadata: Any) -> Layout:
        """Reads torch's ``ShardedTensorMetadata`` (or a list of ``ShardMetadata`` with a size)."""
        shape, boxes = read_torch_metadata(metadata)
        return cls(shape, boxes)

    def visualize(self, width: int = 60, *, color: bool | str = False) -> str:
        """A picture of the layout, to scale: which ranks hold which box.

        Widths and heights are proportional to the boxes' extents (like
        ``jax.debug.visualize_array_sharding``), within rounding: every box gets at least
        one line and room for its label, and the picture grows taller than its usual
        ``width / 4`` lines (up to ``width``) where its thinnest band needs that to keep
        its proportions (``fshard._layout.show``); an N-D layout is drawn over the dims
        its boxes split (a summary where they split more than two), an empty one as a
        line. A partial layout adds a line saying which reduction is pending and, where
        some copies are replicas of one summand (``terms``), which copies are summands.

        Args:
            width: the picture's width at most, in characters (at least 4).
            color: ``False`` (plain text, the default); ``True``: each box in its lowest
                rank's colour, as ANSI codes; ``"auto"``: colour only when standard output
                is a terminal. Colour needs ``rich`` (the ``bench`` extra); without it
                the text is plain.

        Rows of 3, 3, 3 and 1 make bands of 3, 3, 3 and 1 lines:

        >>> from fshard import Chunk
        >>> print(Chunk(0, [0, 1, 2, 3]).layout((10, 20)).visualize(width=40))
        +---------------------------------------+
        |                                       |
        |                  r0                   |
        |                                       |
        +---------------------------------------+
        |                                       |
        |                  r1                   |
        |                                       |
        +---------------------------------------+
        |                                       |
        |                  r2                   |
        |                                       |
        +---------------------------------------+
        |                  r3                   |
        +---------------------------------------+
        """
        text = visualize(self, width, color)  # type: ignore[arg-type]
        if self.partial is not None:
            text += "\n" + summands_line(self)  # type: ignore[arg-type]
        return text


@cached(1024)
def with_partial(layout: Layout, partial: str | None) -> Layout:
    """``layout`` with its copies read as summands of ``partial`` (``None``: as replicas).

    Dropping the reduction drops the ``terms``; changing its op keeps them.
    """
    if layout.partial == partial:
        return layout
    check_partial(partial)
    return _derived(layout, partial, None if partial is None else layout.terms)


def with_terms(layout: Layout, terms: Any) -> Layout:
    """The partial ``layout`` with ``terms`` (one int per shard; ``None``: every copy a summand).

    >>> lay = with_partial(Layout((2,), [((0,), (2,), r) for r in range(4)]), "sum")
    >>> with_terms(lay, [0, 0, 1, 1]).terms.tolist(), with_terms(lay, None) == lay
    ([0, 0, 1, 1], True)

    Raises:
        LayoutError: ``layout`` is not partial, or ``terms`` is not a valid column for it.
    """
    return _derived(layout, layout.partial, terms)


def _derived(layout: Layout, partial: str | None, terms: Any) -> Layout:
    """``layout``'s validated boxes with another pending op and terms (the boxes are not checked again)."""
    lo, sz, rank, devices = layout.columns
    out = object.__new__(Layout)
    # Layout._set is this module's own: the columns are read-only and shared.
    out._set(layout.shape, partial, lo, sz, rank, devices, layout._metas,  # pyright: ignore[reportPrivateUsage]
             canonical_terms(terms, lo, sz, rank, partial))  # fmt: skip
    return out


def _same_terms(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.tobytes() == b.tobytes()


@cached(1024)
def layout_digest(layout: Layout) -> bytes:
    """16 bytes that name ``layout``'s shape, pending op (with its terms) and boxes with their ranks.

    What ranks that hold one layout agree on: devices are left out, which ranks may name
    differently for one layout (each its own GPU).
    """
    h = hashlib.blake2b(repr((layout.shape, layout.partial)).encode(), digest_size=16)
    if layout.terms is not None:
        h.update(layout.terms.tobytes())
    for a in (layout.columns.lo, layout.columns.sz, layout.columns.rank):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return h.digest()


def replica_ids(layout: Layout) -> np.ndarray:
    """Per shard, an id that two shards share exactly when they must hold equal data.

    Copies of one box are replicas and share an id; the copies of a pending reduction
    (``partial``) are its summands, each with an id of its own, except that copies of
    one summand (same box and same term, ``Layout.terms``) are replicas and share one.
    Read-only, (shards,) int64.

    >>> lay = Layout((4,), [((0,), (2,), 0), ((0,), (2,), 1), ((2,), (2,), 2)])
    >>> replica_ids(lay).tolist(), replica_ids(with_partial(lay, "sum")).tolist()
    ([0, 0, 1], [0, 1, 2])
    >>> replica_ids(with_terms(with_partial(lay, "sum"), [0, 0, 0])).tolist()
    [0, 0, 1]
    """
    n = len(layout.columns.rank)
    if (layout.partial is not None and layout.terms is None) or n == 0:
        ids = np.arange(n, dtype=np.int64)
    else:
        columns = [layout.columns.lo, layout.columns.sz]
        if layout.terms is not None:
            columns.append(layout.terms[:, None])
        _, ids = np.unique(np.concatenate(columns, axis=1), axis=0, return_inverse=True)
        ids = ids.reshape(-1).astype(np.int64)
    ids.flags.writeable = False
    return ids


@cached(256)
def _ranks(layout: Layout) -> tuple[int, ...]:
    return tuple(int(r) for r in np.unique(layout.columns.rank))


@cached(256)
def _rank_order(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The shard indices sorted by rank (stably: ascending within a rank), and their ranks."""
    order = np.argsort(layout.columns.rank, kind="stable")
    return order, layout.columns.rank[order]


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


def _as_meta(s: ShardMeta | Sequence[Any]) -> ShardMeta:
    if isinstance(s, ShardMeta):
        return s
    if isinstance(s, (str, bytes)) or not isinstance(s, (tuple, list)) or len(s) != 3:
        msg = f"Layout shards must be ShardMeta or (offsets, sizes, placement) triples, got {s!r}."
        raise TypeError(msg)
    return ShardMeta(*s)


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
        for o, z, r, d in zip(lo.tolist(), sz.tolist(), rank.tolist(), devices):
            yield _checked(ShardMeta, offsets=tuple(o), sizes=tuple(z), placement=_checked(Placement, rank=r, device=d))


def _checked(cls: type[Any], **values: Any) -> Any:
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
    terms: np.ndarray | None = None,
) -> Layout:
    """Unpickles a layout (validated again)."""
    return Layout.from_arrays(shape, lo, sz, rank, devices, partial, terms)
