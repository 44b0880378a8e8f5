"""Global layout metadata: which box of the global shape lives on which rank."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fshard import _boxes
from fshard._errors import LayoutError
from fshard._placement import Placement, PlacementLike, as_placement

__all__ = ["Layout", "ShardMeta", "check_shape"]


def check_shape(shape: Iterable[Any], what: str = "shape") -> tuple[int, ...]:
    """Returns ``shape`` as a tuple of non-negative ints, or raises ``TypeError``/``LayoutError``."""
    out = tuple(shape)
    for s in out:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            msg = f"{what} must hold ints, got {s!r} ({type(s).__name__}) in {out!r}."
            raise TypeError(msg)
        if s < 0:
            raise LayoutError(f"{what} must be non-negative, got {out!r}.")
    return tuple(int(s) for s in out)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardMeta:
    """One box of the global array, ``[offsets, offsets + sizes)``, and its owner.

    >>> ShardMeta((0, 5), (5, 5), "rank:1/cuda:1")
    ShardMeta(offsets=(0, 5), sizes=(5, 5), placement=Placement(rank=1, device='cuda:1'))
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    placement: Placement

    def __post_init__(self) -> None:
        offsets = check_shape(self.offsets, "ShardMeta offsets")
        sizes = check_shape(self.sizes, "ShardMeta sizes")
        if len(offsets) != len(sizes):
            msg = f"ShardMeta offsets {offsets} and sizes {sizes} have different lengths."
            raise LayoutError(msg)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "placement", as_placement(self.placement))

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return int(np.prod(self.sizes, dtype=np.int64)) if self.sizes else 1

    def _box(self) -> str:
        return f"[offsets {self.offsets}, sizes {self.sizes}] on {self.placement}"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """The global shape and the shards that cover it, validated at construction.

    Non-empty boxes must lie inside ``shape``, be pairwise disjoint or identical
    (identical boxes on different placements are replicas) and cover every element.
    Validation is exact and takes O(n 2^d log n) for n shards in d dims.

    >>> lay = Layout((4, 6), [ShardMeta((0, 0), (2, 6), 0), ShardMeta((2, 0), (2, 6), 1)])
    >>> lay.ranks, lay.numel
    ((0, 1), 24)
    >>> Layout.from_dict(lay.to_dict()) == lay
    True

    Raises:
        LayoutError: naming the offending shards and the fix.
    """

    shape: tuple[int, ...]
    shards: tuple[ShardMeta, ...]
    _lo: np.ndarray = dataclasses.field(init=False, repr=False)
    _sz: np.ndarray = dataclasses.field(init=False, repr=False)
    _rank: np.ndarray = dataclasses.field(init=False, repr=False)
    _hash: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        shape = check_shape(self.shape)
        shards = tuple(s if isinstance(s, ShardMeta) else ShardMeta(*s) for s in self.shards)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "shards", shards)
        _check_ndims(shape, shards)
        d = len(shape)
        flat = np.array([s.offsets + s.sizes for s in shards], np.int64).reshape(len(shards), 2 * d)
        lo, sz = flat[:, :d], flat[:, d:]
        for arr in (lo, sz):
            arr.setflags(write=False)
        rank = np.array([s.placement.rank for s in shards], np.int64)
        rank.setflags(write=False)
        object.__setattr__(self, "_lo", lo)
        object.__setattr__(self, "_sz", sz)
        object.__setattr__(self, "_rank", rank)
        _validate(shape, shards, lo, sz)
        devices = tuple(s.placement.device for s in shards)
        object.__setattr__(self, "_hash", hash((shape, flat.tobytes(), rank.tobytes(), devices)))

    # Value semantics: compare by content, hash once, rebuild (and revalidate) on unpickle.
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return self._hash == other._hash and self.shape == other.shape and self.shards == other.shards

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (Layout, (self.shape, self.shards))

    def __repr__(self) -> str:
        if len(self.shards) > 8:
            return f"Layout(shape={self.shape}, {len(self.shards)} shards on ranks {_span(self.ranks)})"
        return f"Layout(shape={self.shape}, shards={self.shards!r})"

    @property
    def ndim(self) -> int:
        """Number of dimensions of the global array."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements of the global array."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that hold at least one shard, sorted."""
        return _ranks(self)

    def shards_on(self, rank: int) -> tuple[ShardMeta, ...]:
        """The shards placed on ``rank``, in layout order."""
        return tuple(self.shards[i] for i in self.indices_on(rank))

    def indices_on(self, rank: int) -> tuple[int, ...]:
        """Indices (into ``shards``) of the shards placed on ``rank``."""
        return _indices_by_rank(self).get(rank, ())

    @property
    def is_fully_replicated(self) -> bool:
        """True when every shard holds the whole array."""
        return bool((self._lo == 0).all() and (self._sz == np.array(self.shape, np.int64)).all())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; ``Layout.from_dict`` rebuilds an equal layout."""
        return {
            "shape": list(self.shape),
            "shards": [
                {"offsets": list(s.offsets), "sizes": list(s.sizes), "placement": str(s.placement)}
                for s in self.shards
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of ``to_dict``."""
        try:
            shards = [ShardMeta(s["offsets"], s["sizes"], s["placement"]) for s in data["shards"]]
            return cls(tuple(data["shape"]), tuple(shards))
        except (KeyError, TypeError) as exc:
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

    def visualize(self, width: int = 60) -> str:
        """A text picture of a 1-D or 2-D layout: which ranks hold which box.

        >>> from fshard import Chunk
        >>> print(Chunk(0, [0, 1]).layout((4, 6)).visualize(width=12))
        +-----------+
        |    r0     |
        +-----------+
        |    r1     |
        +-----------+
        """
        from fshard._visualize import visualize

        return visualize(self, width)


def _span(ranks: Sequence[int]) -> str:
    if ranks and list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


@functools.lru_cache(maxsize=256)
def _ranks(layout: Layout) -> tuple[int, ...]:
    return tuple(int(r) for r in np.unique(layout._rank))


@functools.lru_cache(maxsize=256)
def _indices_by_rank(layout: Layout) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for i, r in enumerate(layout._rank.tolist()):
        out.setdefault(r, []).append(i)
    return {r: tuple(v) for r, v in out.items()}


def _check_ndims(shape: tuple[int, ...], shards: tuple[ShardMeta, ...]) -> None:
    d = len(shape)
    for i, s in enumerate(shards):
        if len(s.offsets) != d:
            msg = (
                f"Shard {i} {s._box()} has {len(s.offsets)} dims but shape {shape} has {d}: "
                "give every shard one offset and one size per dimension."
            )
            raise LayoutError(msg)


def _validate(shape: tuple[int, ...], shards: tuple[ShardMeta, ...], lo: np.ndarray, sz: np.ndarray) -> None:
    bounds = np.array(shape, np.int64)
    nonempty = np.flatnonzero((sz > 0).all(axis=1)) if len(shape) else np.arange(len(shards))
    hi = lo + sz
    out = nonempty[(hi[nonempty] > bounds).any(axis=1)]
    if out.size:
        i = int(out[0])
        dim = int(np.flatnonzero(hi[i] > bounds)[0])
        msg = (
            f"Shard {i} {shards[i]._box()} extends past shape {shape} in dim {dim} "
            f"({lo[i, dim]} + {sz[i, dim]} > {shape[dim]}): shrink the shard or grow the shape."
        )
        raise LayoutError(msg)
    _check_no_duplicates(shards)
    rows = np.concatenate([lo[nonempty], sz[nonempty]], axis=1)
    first, _ = _boxes.unique_rows(rows)
    ulo, uhi = lo[nonempty[first]], hi[nonempty[first]]
    want = _boxes.corner_sums(np.zeros((1, len(shape)), np.int64), bounds[None], bounds)
    if any(s == 0 for s in shape):
        want = {}
    got = _boxes.corner_sums(ulo, uhi, bounds)
    if got != want:
        _explain(shape, shards, lo, hi, nonempty, ulo, uhi, got, want)


def _check_no_duplicates(shards: tuple[ShardMeta, ...]) -> None:
    if len(set(shards)) == len(shards):
        return
    seen: dict[ShardMeta, int] = {}
    for i, s in enumerate(shards):
        if s in seen:
            msg = (
                f"Shards {seen[s]} and {i} are the same box {s._box()}: a replica must sit on "
                "another placement; drop the duplicate."
            )
            raise LayoutError(msg)
        seen[s] = i


def _explain(shape, shards, lo, hi, nonempty, ulo, uhi, got, want) -> None:  # noqa: ANN001
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
                covered = int(np.prod(uhi - ulo, axis=1).sum()) if len(ulo) else 0
                msg = (
                    f"Shards do not cover element {point} of shape {shape} (the distinct boxes "
                    f"hold {covered} of {int(np.prod(shape))} elements): add a shard that covers it."
                )
                raise LayoutError(msg)
            owners = nonempty[_boxes.count_containing(lo[nonempty], hi[nonempty], q)]
            a = int(owners[0])
            b = next(int(j) for j in owners if shards[j].offsets != shards[a].offsets or shards[j].sizes != shards[a].sizes)
            msg = (
                f"Shards {a} {shards[a]._box()} and {b} {shards[b]._box()} overlap at element "
                f"{point} without being identical: boxes must be disjoint, or identical to be replicas."
            )
            raise LayoutError(msg)
    raise LayoutError(f"Shards do not tile shape {shape} exactly.")  # pragma: no cover
