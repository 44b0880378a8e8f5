"""Sharding specs: shape-agnostic descriptions that resolve to a ``Layout``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union, cast

import numpy as np
import torch

from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout, ShardMeta, ShardMetaLike, as_metas, with_partial, with_terms
from fshard._layout.placement import Placement, PlacementLike, as_placement
from fshard._layout.torch_meta import box_from_torch, is_shard_metadata, is_torch_spec
from fshard._layout.validate import REDUCE_OPS, check_shape

__all__ = [
    "Chunk",
    "Explicit",
    "MAX_MESH_SIZE",
    "Mesh",
    "Named",
    "Partial",
    "Replicated",
    "Single",
    "Spec",
    "SpecLike",
    "as_layout",
    "is_spec",
    "whole",
]

# Arguments are checked at run time whatever their annotations say: callers may be untyped.
# pyright: reportUnnecessaryIsInstance=false

Placements = Union[Iterable[PlacementLike], PlacementLike]


def _set(obj: object, **fields: Any) -> None:
    """Sets the fields of a frozen value once, in its ``__init__`` (its hash is made at the first ``hash``)."""
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    object.__setattr__(obj, "_hash", 0)


def _values(spec: Any) -> tuple[Any, ...]:
    """The fields that make a spec's value (what ``==`` compares)."""
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec) if f.compare)


def _hash_of(spec: Any) -> int:
    """``spec``'s ``__hash__``: its fields' hash, made at the first call and kept.

    A spec of thousands of placements is a key of caches at every call. 0: not made yet (a
    hash of 0 is made again); a spec unpickled from an older fshard has no ``_hash`` yet.
    """
    made = getattr(spec, "_hash", 0)
    if made == 0:
        made = hash(_values(spec))  # TypeError where a field cannot be hashed (a spec of the user's)
        object.__setattr__(spec, "_hash", made)
    return made


def _reduce(spec: Any) -> tuple[Any, ...]:
    """Pickles a spec by its fields, not its kept hash (``hash()`` of a str differs from process to process)."""
    return _rebuilt, (type(spec), _values(spec))


def _rebuilt(cls: type[Any], values: tuple[Any, ...]) -> Any:
    spec: Any = object.__new__(cls)
    names = [f.name for f in dataclasses.fields(spec) if f.compare]
    _set(spec, **dict(zip(names, values)))
    return spec


def _hash_field() -> Any:
    return dataclasses.field(init=False, repr=False, compare=False)


def _items(values: Any, what: str, expected: str = "a list or tuple") -> tuple[Any, ...]:
    """``values`` as a tuple, or ``SpecError`` naming ``what`` when it is not a collection of items."""
    if not isinstance(values, (str, bytes, bytearray, Mapping)):
        try:
            items = iter(cast("Iterable[Any]", values))  # TypeError if it is not
        except TypeError:
            pass
        else:
            return tuple(items)
    # The isinstance check above leaves a Mapping's item types unknown to pyright.
    raise SpecError(f"{what} must be {expected}, got {values!r} ({type(values).__name__}).")  # pyright: ignore[reportUnknownArgumentType]


def _placements(values: Placements, what: str) -> tuple[Placement, ...]:
    if isinstance(values, (str, int, Placement)):
        values = [values]
    out = tuple(as_placement(v) for v in _items(values, f"{what} placements", "a placement or a list of them"))
    if not out:
        raise SpecError(f"{what} needs at least one placement, got none.")
    return out


def is_spec(value: Any) -> bool:
    """True for a ``Layout`` or a spec: a value with a ``layout(shape)`` method."""
    return isinstance(value, Layout) or callable(getattr(value, "layout", None))


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        valid = f"valid: {-ndim} to {ndim - 1}" if ndim else "it has no dim to split; use Replicated or Single"
        msg = f"Invalid sharding dim: {dim} for a {ndim}-D array ({valid})."
        raise SpecError(msg)
    return dim % ndim


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Chunk:
    """Split ``dim`` into ``len(placements)`` chunks, exactly like torch's ``ChunkShardingSpec``.

    >>> [s.sizes for s in Chunk(0, [0, 1, 2, 3]).layout((10, 20)).shards]
    [(3, 20), (3, 20), (3, 20), (1, 20)]
    """

    dim: int
    placements: tuple[Placement, ...]
    _hash: int = _hash_field()

    def __init__(self, dim: int, placements: Placements) -> None:
        if isinstance(dim, str):
            msg = f"ChunkShardingSpec does not support named dimension {dim!r}: give an int dim."
            raise NotImplementedError(msg)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
            raise SpecError(f"Chunk dim must be an int, got {dim!r}.")
        _set(self, dim=int(dim), placements=_placements(placements, "Chunk"))

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec."""
        shape = check_shape(shape)
        dim = _normalize_dim(self.dim, len(shape))
        n, k = shape[dim], len(self.placements)
        lo, sz = _whole(shape, k)
        step = -(-n // k) if k else 0
        lo[:, dim] = np.arange(k, dtype=np.int64) * step
        sz[:, dim] = np.maximum(0, np.minimum(n, lo[:, dim] + step) - lo[:, dim])
        return _columns(shape, lo, sz, self.placements)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Replicated:
    """Every placement holds the whole array.

    >>> Replicated([0, 1]).layout((3,)).is_fully_replicated
    True
    """

    placements: tuple[Placement, ...]
    _hash: int = _hash_field()

    def __init__(self, placements: Placements) -> None:
        _set(self, placements=_placements(placements, "Replicated"))

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec."""
        shape = check_shape(shape)
        return _columns(shape, *_whole(shape, len(self.placements)), self.placements)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Single:
    """One placement holds the whole array.

    >>> Single("rank:2/cpu").layout((2, 2)).ranks
    (2,)
    """

    placement: Placement
    _hash: int = _hash_field()

    def __init__(self, placement: PlacementLike) -> None:
        _set(self, placement=as_placement(placement))

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec."""
        return Replicated((self.placement,)).layout(shape)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Explicit:
    """The given boxes (torch's ``EnumerableShardingSpec``), validated against the shape.

    Each box is a ``ShardMeta``, an ``(offsets, sizes, placement)`` tuple or torch's ``ShardMetadata``.

    >>> spec = Explicit([((0,), (3,), 0), ((3,), (1,), 1)])
    >>> spec.layout((4,)).shards[1].sizes
    (1,)
    """

    shards: tuple[ShardMeta, ...]
    _hash: int = _hash_field()

    def __init__(self, shards: Iterable[Any]) -> None:
        if is_torch_spec(shards):
            msg = f"Explicit() takes a list of boxes, got torch's {type(shards).__name__}: pass its .shards."
            raise SpecError(msg)
        _set(self, shards=as_metas(_box(s, k) for k, s in enumerate(_items(shards, "Explicit() shards"))))

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec."""
        return Layout(check_shape(shape), self.shards)


def _box(shard: Any, k: int) -> ShardMetaLike:
    """One box given to ``Explicit``: torch's ``ShardMetadata`` converted, anything else checked."""
    if isinstance(shard, ShardMeta):
        return shard
    if is_shard_metadata(shard):
        return ShardMeta(*box_from_torch(shard))
    box = cast("Sequence[Any]", shard)  # kept only as a tuple or list of three
    if isinstance(box, (tuple, list)) and len(box) == 3:
        return tuple(box)  # type: ignore[return-value]
    msg = (
        f"Explicit() box {k} is {shard!r} ({type(shard).__name__}): give a ShardMeta, an "
        "(offsets, sizes, placement) tuple, or torch's ShardMetadata."
    )
    raise SpecError(msg)


_DEFAULT_AXES = ("x", "y", "z")
# The most positions a Mesh without explicit ranks may have (one Placement each).
MAX_MESH_SIZE = 2**20


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """An n-D grid of placements with named axes, like ``jax.sharding.Mesh``.

    Args:
        shape: the grid's extent along each axis.
        ranks: the placements in row-major grid order, flat or nested like the grid
            (default: ranks ``0 .. prod(shape) - 1`` on cpu, for at most ``MAX_MESH_SIZE`` of them).
        axis_names: one distinct name per axis (default ``("x", "y", "z", "axis3", ...)``).

    >>> Mesh((2, 2)).axis_names
    ('x', 'y')
    >>> Mesh((2,), ranks=["rank:0/cuda:0", "rank:1/cuda:1"]).ranks[1]
    Placement(rank=1, device='cuda:1')
    """

    shape: tuple[int, ...]
    ranks: tuple[Placement, ...]
    axis_names: tuple[str, ...]
    _hash: int = _hash_field()

    def __init__(self, shape: Iterable[int], ranks: Any = None, axis_names: Iterable[str] | None = None) -> None:
        shape = check_shape(shape, "Mesh shape")
        size = math.prod(shape)
        if ranks is None and size > MAX_MESH_SIZE:
            msg = f"Mesh of shape {shape} has {size} positions; give ranks= or at most {MAX_MESH_SIZE} positions."
            raise SpecError(msg)
        flat = range(size) if ranks is None else _flat_ranks(ranks)
        if len(flat) != size:
            msg = f"Mesh of shape {shape} needs {size} placements, got {len(flat)}. Give ranks= one per position."
            raise SpecError(msg)
        placements = tuple(as_placement(r) for r in flat)
        if len(set(placements)) != size:
            raise SpecError(f"Mesh placements must be distinct, got {[str(p) for p in placements]}.")
        if axis_names is None:
            axis_names = _DEFAULT_AXES[: len(shape)] + tuple(f"axis{i}" for i in range(3, len(shape)))
        names = _items(axis_names, "Mesh axis_names")
        if not all(isinstance(n, str) for n in names):
            raise SpecError(f"Mesh axis names must be str, such as 'x', got {names}.")
        if len(names) != len(shape) or len(set(names)) != len(names):
            msg = f"Mesh of shape {shape} needs {len(shape)} distinct axis names, got {names}."
            raise SpecError(msg)
        _set(self, shape=shape, ranks=placements, axis_names=names)

    def axis(self, name: str) -> int:
        """Index of the mesh axis called ``name``."""
        if name not in self.axis_names:
            raise SpecError(f"Mesh has no axis {name!r}; its axes are {self.axis_names}.")
        return self.axis_names.index(name)


def _flat_ranks(ranks: Any) -> list[Any]:
    """Mesh ``ranks``, flat or nested like the grid (lists, arrays, tensors), as one flat list."""
    if isinstance(ranks, (str, bytes)):  # one placement's string, or a string read as many letters
        msg = (
            f"Mesh ranks= takes a list of placements (ints, Placements or strings like 'rank:0/cpu'), "
            f"got the string {ranks!r}: give a list, e.g. ranks=[0, 1] or ranks=['rank:0/cpu', 'rank:1/cpu']."
        )
        raise SpecError(msg)
    try:
        return np.asarray(ranks, dtype=object).ravel().tolist()
    except (TypeError, ValueError, RuntimeError) as exc:
        msg = f"Mesh ranks= must hold placements, flat or nested like the grid, got {type(ranks).__name__}: {exc}"
        raise SpecError(msg) from exc


PartitionEntry = Union[str, tuple[str, ...], None]


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Named:
    """JAX ``NamedSharding``: per array dim, the mesh axes (or ``None``) that split it.

    A tuple of axes splits a dim over their product, the first axis outermost;
    each split follows ``torch.chunk`` (DTensor's rule), so sizes need not divide.
    Mesh axes that no dim uses hold replicas.

    >>> spec = Named(Mesh((2, 2)), ("x", "y"))
    >>> [(s.offsets, s.sizes) for s in spec.layout((4, 4)).shards][:2]
    [((0, 0), (2, 2)), ((0, 2), (2, 2))]
    """

    mesh: Mesh
    partition: tuple[PartitionEntry, ...]
    _hash: int = _hash_field()

    def __init__(self, mesh: Mesh, partition: Iterable[Any]) -> None:
        if not isinstance(mesh, Mesh):
            raise SpecError(f"Named needs a Mesh, got {type(mesh).__name__}.")
        parts = tuple(_entry(p) for p in _items(partition, "Named partition"))
        used = [a for p in parts if p is not None for a in ((p,) if isinstance(p, str) else p)]
        for a in used:
            mesh.axis(a)
        if len(set(used)) != len(used):
            raise SpecError(f"Partition {parts} uses a mesh axis twice; each axis may split one dim.")
        _set(self, mesh=mesh, partition=parts)

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec."""
        shape = check_shape(shape)
        if len(self.partition) > len(shape):
            msg = f"Partition {self.partition} has {len(self.partition)} entries for a {len(shape)}-D array."
            raise SpecError(msg)
        parts = self.partition + (None,) * (len(shape) - len(self.partition))
        axes = [() if p is None else ((p,) if isinstance(p, str) else p) for p in parts]
        mesh = self.mesh
        coords = np.unravel_index(np.arange(len(mesh.ranks), dtype=np.int64), mesh.shape)
        lo, sz = _whole(shape, len(mesh.ranks))
        for d, ax in enumerate(axes):
            if ax:  # else whole
                splits = [(mesh.shape[mesh.axis(a)], coords[mesh.axis(a)]) for a in ax]
                lo[:, d], sz[:, d] = _split_all(shape[d], splits)
        return _columns(shape, lo, sz, mesh.ranks)


def _entry(p: Any) -> PartitionEntry:
    """One partition entry as ``None``, an axis name or a tuple of names."""
    if p is None or isinstance(p, str):
        return p
    names = cast("Sequence[Any]", p)  # kept only as a tuple or list of names
    if isinstance(names, (tuple, list)) and all(isinstance(a, str) for a in names):
        return tuple(names)
    raise SpecError(f"Partition entry {p!r} must be a mesh axis name, a tuple of axis names, or None.")


def _whole(shape: tuple[int, ...], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The columns of ``k`` boxes that each span ``shape`` whole: offsets 0, sizes ``shape`` (to narrow in place)."""
    return np.zeros((k, len(shape)), np.int64), np.tile(np.array(shape, np.int64), (k, 1))


def _columns(shape: tuple[int, ...], lo: np.ndarray, sz: np.ndarray, placements: Sequence[Placement]) -> Layout:
    """The layout of a box per placement (``lo``, ``sz``: one row each), its ``ShardMeta`` made on first read."""
    ranks = np.fromiter((p.rank for p in placements), np.int64, len(placements))
    devices = [p.device for p in placements]
    return Layout.from_arrays(shape, lo, sz, ranks, devices[0] if len(set(devices)) == 1 else devices)


def _split_all(n: int, splits: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Each placement's offset and size after splitting ``[0, n)`` by each (parts, index) in turn (DTensor's rule).

    ``splits`` (not empty) gives each axis's parts and every placement's index along it. An
    empty part sits at offset ``n``, the end of the dim, where DTensor puts it.
    """
    count = len(splits[0][1])
    offset, size = np.zeros(count, np.int64), np.full(count, n, np.int64)
    gone = np.zeros(count, bool)
    for parts, index in splits:
        step = -(-size // parts)
        start = step * index
        gone |= start >= size
        offset, size = offset + start, np.minimum(size, start + step) - start
    return np.where(gone, n, offset), np.where(gone, 0, size)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Partial:
    """A pending reduction: the copies that ``spec`` would replicate are summands.

    The array's value is the elementwise ``op`` (``"sum"``, ``"max"`` or ``"min"``) of
    its copies of each box. ``Partial(Replicated(R))`` holds a full-shape partial
    result on every rank of ``R`` (a row-parallel matmul's output);
    ``Partial(Named(mesh, ("x", None)))`` splits rows over ``x`` and sums over the
    mesh axes that no dim uses (every copy is a summand). ``gather`` and ``reshard`` to
    a non-partial spec carry out the reduction with the fewest elements sent.

    ``over`` (a mesh axis name of a ``Named`` spec, or a tuple of them) makes only the
    copies along those axes summands: the copies along the other axes that no dim uses
    are replicas of each summand. On a ``(dp, tp)`` mesh,
    ``Partial(Named(mesh, (None,)), over="tp")`` is DTensor's ``[Replicate(), Partial()]``
    and JAX's "unreduced over tp, replicated over dp": the value is the sum over ``tp``
    only. The resolved layout records it in ``Layout.terms``.

    Args:
        spec: the copies' boxes: a spec or a non-partial ``Layout``.
        op: the pending reduction.
        over: mesh axes of ``spec`` (a ``Named``) along which copies are summands.

    Raises:
        SpecError: a partial or unknown spec, an unknown op, or an ``over`` that is not
            unused axes of a ``Named`` spec's mesh (each at most once).

    >>> import torch, fshard
    >>> lay = Partial(Replicated([0, 1])).layout((3,))
    >>> parts = [fshard.Shard(m, torch.full((3,), m.placement.rank + 1.0)) for m in lay.shards]
    >>> p = fshard.from_local_shards_and_layout(parts, lay)  # rank 0 holds 1s, rank 1 holds 2s
    >>> p.layout.partial, fshard.gather(p).tolist()
    ('sum', [3.0, 3.0, 3.0])
    """

    spec: Any
    op: str
    over: tuple[str, ...] | None
    _hash: int = _hash_field()

    def __init__(self, spec: Any, op: str = "sum", *, over: str | Iterable[str] | None = None) -> None:
        if isinstance(spec, Partial) or (isinstance(spec, Layout) and spec.partial is not None):
            raise SpecError(f"Partial() takes a non-partial spec, got {spec!r}: pending reductions do not nest.")
        if not is_spec(spec):
            msg = f"Partial() takes a spec (Chunk, Named, Replicated, Single, Explicit) or a Layout, got {spec!r}."
            raise SpecError(msg)
        if op not in REDUCE_OPS:
            raise SpecError(f"Partial op={op!r} is not a reduction; use one of {list(REDUCE_OPS)}.")
        _set(self, spec=spec, op=op, over=None if over is None else _over(spec, over))

    def layout(self, shape: Sequence[int]) -> Layout:
        """The layout of an array of ``shape`` under this spec (its ``partial`` is ``op``)."""
        layout = with_partial(as_layout(self.spec, shape), self.op)
        if self.over is None:
            return layout
        mesh = cast("Named", self.spec).mesh
        axes = [mesh.axis(a) for a in self.over]
        coords = np.unravel_index(np.arange(len(mesh.ranks)), mesh.shape)
        terms = np.ravel_multi_index(tuple(coords[k] for k in axes), tuple(mesh.shape[k] for k in axes))
        return with_terms(layout, terms)


def _over(spec: Any, over: Any) -> tuple[str, ...]:
    """``over`` as a tuple of distinct mesh axes that ``spec`` (a ``Named``) leaves unused."""
    if not isinstance(spec, Named):
        msg = (
            f"Partial(..., over={over!r}) names mesh axes, so it needs a Named spec, got {spec!r}. Without a "
            "mesh every copy is a summand: drop over=, or give fshard.Named(mesh, partition)."
        )
        raise SpecError(msg)
    axes = (over,) if isinstance(over, str) else _items(over, "Partial over=", "a mesh axis name or a tuple of them")
    if not axes or not all(isinstance(a, str) for a in axes):
        msg = f"Partial over= takes mesh axis names of {spec.mesh.axis_names}, such as over='y', got {over!r}."
        raise SpecError(msg)
    if len(set(axes)) != len(axes):
        raise SpecError(f"Partial over={over!r} names a mesh axis twice; name each axis once.")
    used = {a for p in spec.partition if p is not None for a in ((p,) if isinstance(p, str) else p)}
    for a in axes:
        if a not in spec.mesh.axis_names:
            msg = f"Partial over={over!r}: the mesh has no axis {a!r}; its axes are {spec.mesh.axis_names}."
            raise SpecError(msg)
        if a in used:
            msg = (
                f"Partial over={over!r}: mesh axis {a!r} splits a dim of {spec.partition}, so its copies are "
                f"different boxes, not summands; give over= axes that no dim uses, or drop {a!r} from the partition."
            )
            raise SpecError(msg)
    return axes


for _spec in (Chunk, Replicated, Single, Explicit, Mesh, Named, Partial):  # values whose hash is kept
    _spec.__hash__ = _hash_of  # type: ignore[method-assign,assignment]
    _spec.__reduce__ = _reduce  # type: ignore[method-assign,assignment]

Spec = Union[Chunk, Named, Replicated, Single, Explicit, Partial]
SpecLike = Union[Spec, Layout]


def as_layout(spec: Any, shape: Sequence[int]) -> Layout:
    """Resolves a spec (or a ``Layout``, which must match ``shape``) for an array of ``shape``.

    torch's ``ChunkShardingSpec`` and ``EnumerableShardingSpec`` are read as ``Chunk`` and
    ``Explicit``, so every function that takes a spec takes them too.

    >>> from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    >>> as_layout(ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]), (3, 2)) == Chunk(
    ...     0, [0, 1]
    ... ).layout((3, 2))
    True
    """
    shape = check_shape(shape)
    if isinstance(spec, Layout):
        if spec.shape != shape:
            raise SpecError(f"Layout has shape {spec.shape} but the array has shape {shape}.")
        return spec
    if is_torch_spec(spec):
        spec = from_torch_spec(spec)
        if not hasattr(spec, "layout"):  # another ShardingSpec subclass: torch lays it out
            return layout_of_torch_spec(spec, shape)
    if not is_spec(spec):
        msg = f"Expected a spec (Chunk, Named, Replicated, Single, Explicit, Partial) or a Layout, got {spec!r}."
        raise SpecError(msg)
    try:
        return _resolved(spec, shape)
    except TypeError as exc:  # an unhashable spec of the user's: resolve it each time
        if "unhashable" not in str(exc):
            raise
        return spec.layout(shape)


@cached(1024)
def _resolved(spec: Any, shape: tuple[int, ...]) -> Layout:
    """``spec.layout(shape)``, remembered: specs are values, and a loop reshards to the same spec."""
    return spec.layout(shape)


def from_torch_spec(spec: Any) -> Any:
    """The fshard spec for a torch ``ShardingSpec``: ``Chunk`` or ``Explicit``.

    Another ``ShardingSpec`` subclass (a user's own) is returned as is: ``as_layout``
    resolves it with its ``build_metadata``.
    """
    kind = type(spec).__name__
    if kind == "ChunkShardingSpec":
        return Chunk(spec.dim, spec.placements)
    if kind == "EnumerableShardingSpec":
        return Explicit(spec.shards)
    return spec


def layout_of_torch_spec(spec: Any, shape: tuple[int, ...]) -> Layout:
    """The layout that any torch ``ShardingSpec`` gives ``shape``, through its ``build_metadata``."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # deferred: torch.distributed

    try:
        metadata = spec.build_metadata(torch.Size(shape), TensorProperties())
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        msg = f"torch's {type(spec).__name__} cannot lay out shape {shape}: {exc}"
        raise SpecError(msg) from exc
    return Layout.from_torch_metadata(metadata)


@cached(256)
def whole(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Layout:
    """The whole array once on each of ``ranks``: what ``shard(src=)`` moves from and ``gather`` to."""
    return Replicated(list(ranks)).layout(shape)
