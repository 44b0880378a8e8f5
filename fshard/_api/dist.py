"""Arrays built from every rank's own pieces: one metadata exchange, the same checks on every rank.

Each rank describes its pieces; the descriptions are exchanged once and every rank runs
the same checks on the same data, so a bad input raises the same typed error on every
rank (naming the ranks and shards) instead of leaving some ranks waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import optree
import torch

from fshard._array.array import Shard, ShardedArray
from fshard._base.cache import cached
from fshard._base.records import record
from fshard._config import current
from fshard._errors import LayoutError, SpecError
from fshard._exec.agree import tree_kinds
from fshard._exec.collective import collective
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement
from fshard._layout.specs import as_layout, is_spec
from fshard._layout.torch_meta import is_torch_spec
from fshard._layout.validate import check_shape
from fshard.backends import Backend, for_group

__all__ = ["check_pieces", "from_local_shards", "from_local_tensor"]

_PROPERTIES = ("dtype", "requires_grad", "pinned", "layout", "device_type")


@record
class Piece(NamedTuple):
    """What one rank tells the others about one of its shards."""

    meta: ShardMeta
    dtype: torch.dtype
    device: str
    requires_grad: bool
    pinned: bool
    layout: str

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


@record
class Report(NamedTuple):
    """One rank's part of the exchange: its rank, the shape it passed, its pieces, its problems."""

    rank: int | None
    shape: tuple[int, ...] | None
    pieces: tuple[Piece, ...]
    problems: tuple[str, ...]


def _backend(group: Any, what: str) -> Backend:
    return for_group(group, what)


def _describe(shards: Any, shape: Any, rank: int | None) -> Report:
    """This rank's report; bad local input becomes a problem to raise on every rank."""
    problems: list[str] = []
    pieces: list[Piece] = []
    try:
        gshape: tuple[int, ...] | None = check_shape(
            tuple(cast("Sequence[Any]", shape)) if isinstance(shape, (list, tuple, torch.Size)) else (shape,)
        )
    except (TypeError, ValueError) as exc:
        gshape, problems = None, [f"bad global shape {shape!r}: {exc}"]
    for k, s in enumerate(shards):
        if not isinstance(s, Shard):
            problems.append(f"item {k} is a {type(s).__name__}, not an fshard.Shard")
            continue
        t, p = s.data, s.meta.placement
        pieces.append(Piece(s.meta, t.dtype, str(t.device), t.requires_grad, _pinned(t), str(t.layout)))
        if rank is not None and p.rank != rank:
            problems.append(
                f"shard {s.meta.box()} names rank {p.rank}, but rank {rank} passed it: "
                "a rank passes only its own shards"
            )
        if t.layout != torch.strided:
            problems.append(f"shard {s.meta.box()} has layout {t.layout}; only torch.strided tensors can be sharded")
        if torch.device(p.device) != t.device:
            problems.append(
                f"shard {s.meta.box()} has its tensor on {t.device}, not on its placement's device {p.device}"
            )
    return Report(rank, gshape, tuple(pieces), tuple(problems))


def _sequence(shards: Any) -> list[Any]:
    if isinstance(shards, (Shard, torch.Tensor, str, bytes)) or not isinstance(shards, Iterable):
        raise TypeError(f"from_local_shards() takes a sequence of fshard.Shard, got {type(shards).__name__}.")
    return list(cast("Iterable[Any]", shards))


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and bool(t.is_pinned())


def _at(rank: int | None, problem: str) -> str:
    return problem if rank is None else f"rank {rank}: {problem}"


def check_pieces(reports: Sequence[Report]) -> Layout:
    """The layout of every rank's pieces, or the error that every rank raises.

    Raises:
        LayoutError: local problems, different global shapes, tensor properties that
            differ between shards, or boxes that overlap, leave gaps or leave the shape.
    """
    problems = [_at(r.rank, p) for r in reports for p in r.problems]
    if problems:
        raise LayoutError("from_local_shards(): " + "; ".join(problems) + ".")
    shapes = {r.shape for r in reports}
    if len(shapes) > 1:
        given = ", ".join(f"rank {r.rank} {r.shape}" for r in reports)
        msg = (
            f"from_local_shards(): global size does not match across ranks: {given}; "
            "every rank must pass the same shape."
        )
        raise LayoutError(msg)
    pieces = [(r.rank, p) for r in reports for p in r.pieces]
    _check_properties(pieces)
    shape = reports[0].shape
    assert shape is not None  # a bad shape is a problem, raised above
    try:
        return Layout(shape, tuple(p.meta for _, p in pieces))
    except LayoutError as exc:
        msg = f"from_local_shards(): the shards of all ranks do not tile shape {shape}: {exc}"
        raise LayoutError(msg) from exc


def _check_properties(pieces: Sequence[tuple[int | None, Piece]]) -> None:
    """Raises naming the first two shards that differ in a tensor property."""
    for name in _PROPERTIES:
        values = {getattr(p, name) for _, p in pieces}
        if len(values) < 2:
            continue
        a = pieces[0][1]
        b = next(p for _, p in pieces if getattr(p, name) != getattr(a, name))
        msg = (
            f"from_local_shards(): local shards' tensor {name} property need to be the same on all ranks! "
            f"Found {name}={getattr(a, name)} on rank {a.meta.placement.rank} (shard {a.meta.box()}) and "
            f"{name}={getattr(b, name)} on rank {b.meta.placement.rank} (shard {b.meta.box()}): make them agree."
        )
        raise LayoutError(msg)


@collective("from_local_shards", local=("shards",))
def from_local_shards(shards: Sequence[Shard], shape: Any, *, group: Any = None) -> ShardedArray:
    """Builds an array from each rank's own shards, exchanging their metadata once.

    Under torch.distributed every rank of ``group`` passes its own shards (possibly
    none) and the same global ``shape``. On the local backend one call passes the
    shards of every rank. The checks run on every rank over the same gathered data,
    so every rank raises the same error.

    Args:
        shards: this rank's ``Shard`` values (their placements name this rank).
        shape: the global shape (ints, a list, a tuple or a ``torch.Size``).
        group: a ``torch.distributed`` process group; ``None`` for the default backend.

    Returns:
        A ``ShardedArray`` whose layout lists the shards rank by rank, in the order given.

    Raises:
        LayoutError: overlapping boxes, gaps, boxes outside ``shape``, ranks that pass
            different shapes, shards on another rank or device, sparse shards, or dtype, device type,
            requires_grad, pin-memory or tensor-layout mismatches between shards.
        TypeError: ``shards`` is not a sequence of ``Shard``, or ``group`` not a process group.

    >>> import torch, fshard
    >>> parts = [fshard.Shard(fshard.ShardMeta((2 * r, 0), (2, 3), r), torch.full((2, 3), r)) for r in range(2)]
    >>> fshard.gather(fshard.from_local_shards(parts, (4, 3)))[:, 0].tolist()
    [0, 0, 1, 1]
    """
    backend, shards = _backend(group, "from_local_shards()"), _by_rank(_sequence(shards))
    reports = backend.exchange(_describe(shards, shape, backend.rank))
    bad = [_at(r.rank, p) for r in reports for p in r.problems if "not an fshard.Shard" in p]
    if bad:
        raise TypeError(f"from_local_shards() takes fshard.Shard values: {'; '.join(bad)}.")
    layout = check_pieces(reports)
    backend.check_layout(layout)
    index = backend.addressable(layout)
    mine = [s.data for s in shards]
    if len(mine) != len(index):  # pragma: no cover - the layout is built from these shards
        raise LayoutError(f"Expected {len(index)} local shards, got {len(mine)}.")
    dtype = next((p.dtype for r in reports for p in r.pieces), torch.get_default_dtype())
    grad = any(p.requires_grad for r in reports for p in r.pieces)
    return ShardedArray(layout, mine, backend, dtype, requires_grad=grad)


def _by_rank(shards: Sequence[Any]) -> list[Any]:
    """``shards`` listed rank by rank, in the order given within a rank (a stable sort).

    Across processes each rank passes its own shards, so this changes nothing there; in one
    process the shards of every rank come in one list, in any order, and the layout is the
    same as across processes.
    """
    if not all(isinstance(s, Shard) for s in shards):  # refused below, naming each by its position as given
        return list(shards)
    return sorted(shards, key=lambda s: s.meta.placement.rank)


@collective("from_local_tensor", local=("tensor",))
def from_local_tensor(tensor: Any, dim: Any = 0, shape: Any = None, *, group: Any = None, even: bool = False) -> Any:
    """Builds an array from each rank's local tensor: a block along ``dim``, or its shard of a spec.

    With an int ``dim``, ``tensor`` may also be a tuple, list or dict of tensors (a rank's
    batch and its targets, say): the result is the same structure of arrays, built with one
    exchange for all of them.

    With an int ``dim``, rank ``i``'s tensor is block ``i`` along ``dim``: blocks
    are stacked in group-rank order; their sizes along ``dim`` may differ (and be
    zero); other dims, dtype and requires_grad must agree across ranks (sizes are
    exchanged once). On the local backend the one tensor is the whole array, on rank 0.

    ``even=True`` (with an int ``dim``) says that every rank passes blocks alike: the same
    shapes, dtypes, ``requires_grad`` and device type (a data-parallel batch of a fixed
    size). Then no rank waits for the others here: each builds the layout from its own
    blocks, and the check that the ranks' blocks agree rides on the group's next
    collective, where every rank raises ``SpecError`` if they did not (a rank whose own
    blocks fail a check raises at once, and again at that collective with the others, unless
    every rank failed or check mode made every rank raise at the call). Under NCCL the check
    ends at the call: its messages go through the GPU.
    Each rank's layout names its own device for every rank's block.

    With a spec and the global ``shape`` (torch's
    ``ShardedTensor._init_from_local_tensor(tensor, spec, shape)``; torch's
    ``ChunkShardingSpec`` and ``EnumerableShardingSpec`` work too), each rank's
    tensor is its shard of ``spec.layout(shape)``, whatever the order of the
    placements. A rank that holds several shards (every shard, on the local
    backend) passes a list of tensors in layout order; one that holds none
    passes ``None`` or an empty list. Tensor properties are exchanged once, so
    every rank raises the same error.

    >>> import torch, fshard
    >>> x = fshard.from_local_tensor(torch.ones(3, 2), dim=1)
    >>> x.shape, x.layout.ranks
    (torch.Size([3, 2]), (0,))
    >>> spec = fshard.Chunk(0, [1, 0])  # on the local backend: every rank's tensor, in layout order
    >>> y = fshard.from_local_tensor([torch.zeros(2, 2), torch.ones(1, 2)], spec, (3, 2))
    >>> fshard.gather(y)[:, 0].tolist(), [s.placement.rank for s in y.layout.shards]
    ([0.0, 0.0, 1.0], [1, 0])
    >>> xs, ys = fshard.from_local_tensor((torch.zeros(4, 3), torch.ones(4)), dim=0)
    >>> xs.shape, ys.shape
    (torch.Size([4, 3]), torch.Size([4]))
    >>> xs, ys = fshard.from_local_tensor((torch.zeros(4, 3), torch.ones(4)), dim=0, even=True)  # blocks alike
    >>> xs.shape, ys.shape
    (torch.Size([4, 3]), torch.Size([4]))

    Raises:
        SpecError: ``dim`` is out of range, blocks disagree off ``dim`` or in dtype, a
            spec's shards do not cover the entire tensor, or a local tensor is not
            contiguous ("not a contiguous Tensor").
        LayoutError: a local tensor does not have its shard's sizes, or a rank passes
            more or fewer tensors than it holds shards.
        TypeError: ``tensor`` is not a ``torch.Tensor`` (or, with an int ``dim``, a tree of them),
            ``dim`` neither an int nor a spec, or ``group`` not a process group.
    """
    if not isinstance(dim, int) or isinstance(dim, bool):
        if not (is_spec(dim) or is_torch_spec(dim)):
            msg = f"from_local_tensor() dim must be an int, or a spec with the global shape, got {dim!r}."
            raise TypeError(msg)
        return _from_local_tensor_and_spec(tensor, dim, shape, _backend(group, "from_local_tensor()"))
    if shape is not None:
        raise TypeError(f"from_local_tensor(tensor, dim={dim}) takes no shape; shape goes with a spec.")
    if not isinstance(even, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value, untyped
        raise TypeError(f"from_local_tensor() even must be a bool, got {even!r} ({type(even).__name__}).")
    backend = _backend(group, "from_local_tensor()")
    if even and backend.spans_processes:
        return _even(tensor, dim, cast("Any", backend))
    if isinstance(tensor, torch.Tensor):
        return _along(tensor, dim, backend.exchange(_info(tensor, backend)), backend)
    leaves, treedef = _tree_of_tensors(tensor)
    seen = backend.exchange([_info(t, backend) for t in leaves])  # one exchange for the whole tree
    if len({len(s) for s in seen}) > 1:
        counts = ", ".join(f"rank {s[0][0]}: {len(s)}" for s in seen if s)
        raise SpecError(f"from_local_tensor(): ranks passed trees of different sizes ({counts}); pass one structure.")
    return optree.tree_unflatten(treedef, [_along(t, dim, [s[k] for s in seen], backend) for k, t in enumerate(leaves)])


def _tree_of_tensors(tensor: Any) -> tuple[list[torch.Tensor], Any]:
    """The leaves and structure of ``from_local_tensor``'s ``tensor`` (a tensor, or a tree of them)."""
    if isinstance(tensor, torch.Tensor):
        return [tensor], None
    leaves, treedef = optree.tree_flatten(tensor)
    if isinstance(tensor, ShardedArray) or not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        msg = (
            f"from_local_tensor() takes a torch.Tensor, or a tuple, list or dict of them (each rank's "
            f"blocks of several arrays), got {type(tensor).__name__}."
        )
        raise TypeError(msg)
    return leaves, treedef


def _even(tensor: Any, dim: int, backend: Any) -> Any:
    """``from_local_tensor(tensor, dim, even=True)`` across processes: every rank's blocks taken to be alike.

    This rank's blocks are checked here and its digest of them posted (``check_later``), to go
    with the next check posted or the group's next collective, in one gather; that collective
    compares every rank's, so every rank raises there where they differ. A rank whose own
    check fails posts that it failed at once, before it raises.
    """
    what = f"from_local_tensor(dim={dim}, even=True)"
    infos: tuple[Any, ...] | None = None  # this rank's blocks, once read
    # In check mode every rank learns at the call of any rank's error there, and raises it.
    raised_alike = current().check_collectives

    def verdict(pairs: Sequence[tuple[int, bool, int]]) -> SpecError | None:
        return _even_verdict(pairs, what, _described(infos), raised_alike)

    if not backend.member:
        raise SpecError(f"{what}: rank {backend.rank} is not in the process group; call it from ranks of the group.")
    ranks: tuple[int, ...] = tuple(backend.ranks)
    try:
        leaves, treedef = _tree_of_tensors(tensor)
        infos = tuple((tuple(t.shape), t.dtype, t.requires_grad, t.device.type) for t in leaves)
        arrays = [ShardedArray(_even_layout(ranks, dim, tuple(t.shape), str(t.device)), (t,), backend) for t in leaves]
    except BaseException:
        with contextlib.suppress(SpecError):  # where the check runs now (NCCL), this rank's own error goes first
            backend.check_later(what, True, 0, verdict)
        raise
    dims = tuple(dim % max(t.ndim, 1) for t in leaves)
    try:
        digest = _even_digest(dims, treedef, infos)
    except TypeError:  # a structure that cannot be hashed (a node's metadata): made afresh
        digest = _digest(dims, treedef, infos)
    backend.check_later(what, False, digest, verdict, defer=True)  # goes with the next check, in one gather
    return arrays[0] if treedef is None else optree.tree_unflatten(treedef, arrays)


def _described(infos: tuple[Any, ...] | None) -> str:
    """A rank's blocks as its error names them."""
    if infos is None:
        return "an invalid argument"
    return ", ".join(f"{s} {d} requires_grad={g} on {v}" for s, d, g, v in infos)


def _digest(dims: tuple[int, ...], treedef: Any, infos: tuple[Any, ...]) -> int:
    """The digest a rank posts of its blocks: ranks whose dims, structure or blocks differ post different ones.

    The structure goes in by its paths and node kinds (a repr may hold addresses), each dim counted from 0.
    """
    structure = None if treedef is None else (optree.treespec_paths(treedef), tree_kinds(treedef))
    digest = hashlib.blake2b(repr((dims, structure, infos)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_even_digest = cached(256)(_digest)  # made once per kind of batch


def _even_verdict(
    pairs: Sequence[tuple[int, bool, int]], what: str, mine: str, raised_alike: bool = False
) -> SpecError | None:
    """The error every rank raises where ranks' ``(failed, digest)`` of their blocks differ (``None``: they agree).

    ``raised_alike``: every rank raised at the call where one failed there (check mode), so a
    failure is not raised again. Ranks whose blocks differ are named against the blocks most
    ranks passed (the lowest rank's among equally many).
    """
    failed = [r for r, f, _ in pairs if f]
    if len(failed) == len(pairs) or (failed and raised_alike):  # every rank raised at the call
        return None
    if failed:
        return SpecError(
            f"{what} raised on rank(s) {failed}, whose error says why; the other ranks raise this where the check "
            "ends (the group's next collective; under NCCL, that call)."
        )
    usual = Counter(d for _, _, d in pairs).most_common(1)[0][0]  # the first of the most common, in rank order
    odd = [r for r, _, d in pairs if d != usual]
    if not odd:
        return None
    like = [r for r, _, d in pairs if d == usual]
    alike = str(like) if len(like) <= 8 else f"[{like[0]}, {like[1]}, ..., {like[-1]}] ({len(like)} ranks)"
    return SpecError(
        f"{what}: ranks {odd} passed blocks unlike those of ranks {alike} (shapes, dtypes, requires_grad, device "
        f"types or structure differ); this rank passed {mine}. With even=True every rank's blocks must be alike; "
        "to stack blocks of different sizes, drop even=True (the sizes are then exchanged at the call)."
    )


@cached(256)
def _even_layout(ranks: tuple[int, ...], dim: int, shape: tuple[int, ...], device: str) -> Layout:
    """The layout whose block ``i`` along ``dim`` has ``shape`` on ``ranks[i]`` (every block on ``device``)."""
    return _stacked(_dim(dim, len(shape)), tuple((r, shape, device) for r in ranks))


def _dim(dim: int, ndim: int) -> int:
    """``dim`` counted from 0 for ``ndim``-D blocks; ``SpecError`` where it is out of range."""
    if not -ndim <= dim < ndim:
        msg = f"Invalid sharding dim: {dim} for {ndim}-D local tensors (valid: {-ndim} to {ndim - 1})."
        raise SpecError(msg)
    return dim % ndim


@cached(256)
def _stacked(dim: int, blocks: tuple[tuple[int, tuple[int, ...], str], ...]) -> Layout:
    """The layout of ``blocks`` (rank, shape, device), stacked along ``dim`` in that order.

    Cached: a step's batches have the same blocks at every step, and the layout has a shard per rank.
    """
    offsets = 0
    metas: list[ShardMeta] = []
    for rank, shape, device in blocks:
        metas.append(
            ShardMeta(tuple(offsets if k == dim else 0 for k in range(len(shape))), shape, Placement(rank, device))
        )
        offsets += shape[dim]
    return Layout(tuple(offsets if k == dim else s for k, s in enumerate(blocks[0][1])), tuple(metas))


def _info(tensor: torch.Tensor, backend: Backend) -> tuple[Any, ...]:
    """What ranks exchange about a local block: rank, shape, dtype, requires_grad, device."""
    return (backend.rank or 0, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, str(tensor.device))


def _along(tensor: torch.Tensor, dim: int, seen: Sequence[Any], backend: Backend) -> ShardedArray:
    """The array whose blocks along ``dim`` are the ranks' tensors, given every rank's ``_info`` (``seen``)."""
    ndims = {len(s[1]) for s in seen}
    if len(ndims) > 1:
        given = ", ".join(f"rank {s[0]} {s[1]}" for s in seen)
        raise SpecError(f"from_local_tensor(): ranks passed tensors with different numbers of dims: {given}.")
    dim = _dim(dim, tensor.ndim)
    _check_blocks(seen, dim)
    layout = _stacked(dim, tuple((rank, shape, device) for rank, shape, *_, device in seen))
    return ShardedArray(layout, (tensor,), backend)


def _from_local_tensor_and_spec(tensor: Any, spec: Any, shape: Any, backend: Backend) -> ShardedArray:
    """``from_local_tensor(tensor, spec, shape)``: this rank's tensors are its shards of the spec's layout."""
    if shape is None:
        raise TypeError("from_local_tensor(tensor, spec, shape) needs the global shape with a spec.")
    gshape = check_shape(
        tuple(cast("Sequence[Any]", shape)) if isinstance(shape, (list, tuple, torch.Size)) else (shape,)
    )
    try:
        layout = as_layout(spec, gshape)
    except LayoutError as exc:
        msg = f"from_local_tensor(): the spec's shards do not cover the entire tensor of shape {gshape}: {exc}"
        raise SpecError(msg) from exc
    backend.check_layout(layout)
    tensors = _local_tensors(tensor)
    index = backend.addressable(layout)
    problems = _local_problems(tensors, layout, index)
    props = {(t.dtype, t.requires_grad) for t in tensors}
    seen = backend.exchange((backend.rank, tuple(problems), props))
    problems = [_at(r, p) for r, ps, _ in seen for p in ps]
    if problems:
        raise LayoutError("from_local_tensor(): " + "; ".join(problems) + ".")
    every = {p for *_, ps in seen for p in ps}
    if len(every) > 1:
        given = ", ".join(f"rank {r}: {sorted(map(str, ps))}" for r, _, ps in seen if ps)
        msg = f"from_local_tensor(): local tensors differ in (dtype, requires_grad): {given}; make them agree."
        raise SpecError(msg)
    dtype = next(iter(every))[0] if every else torch.get_default_dtype()
    grad = bool(every) and next(iter(every))[1]
    return ShardedArray(layout, tensors, backend, dtype, requires_grad=grad)


def _local_tensors(tensor: Any) -> tuple[torch.Tensor, ...]:
    if tensor is None:
        return ()
    items = (tensor,) if isinstance(tensor, torch.Tensor) else tuple(tensor)
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's items
            raise TypeError(f"from_local_tensor() takes torch.Tensors, got {type(t).__name__} (item {k}).")
    return items


def _local_problems(tensors: Sequence[torch.Tensor], layout: Layout, index: Sequence[int]) -> list[str]:
    """What is wrong with this rank's tensors as its shards ``index`` of ``layout``."""
    if len(tensors) != len(index):
        return [
            f"passed {len(tensors)} local tensor(s) but holds {len(index)} shard(s) of {layout!r}: "
            "pass one tensor per shard, in layout order"
        ]
    problems: list[str] = []
    for i, t in zip(index, tensors):
        meta = layout._shard(i)  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
        if tuple(t.shape) != meta.sizes:
            problems.append(f"local tensor of shape {tuple(t.shape)} is not the size of shard {i} {meta.box()}")
        elif not t.is_contiguous():
            problems.append(f"local_tensor is not a contiguous Tensor (shard {i}): pass tensor.contiguous()")
    return problems


def _check_blocks(seen: Sequence[tuple[Any, ...]], dim: int) -> None:
    """Raises ``SpecError`` unless every block agrees with rank 0's off ``dim``, in dtype and grad."""
    r0, s0, d0, g0, _ = seen[0]
    for rank, shape, dtype, grad, _ in seen[1:]:
        if any(shape[k] != s0[k] for k in range(len(s0)) if k != dim) or dtype != d0 or grad != g0:
            msg = (
                f"from_local_tensor(dim={dim}): rank {rank} passed {tuple(shape)} {dtype} requires_grad={grad} but "
                f"rank {r0} passed {tuple(s0)} {d0} requires_grad={g0}; blocks may differ only in dim {dim}."
            )
            raise SpecError(msg)
