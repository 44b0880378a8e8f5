"""Moving arrays: ``reshard``, ``gather``, comparisons, and arrays from shards the caller holds."""

# The public functions check their arguments at run time, whatever the annotations promise.
# pyright: reportUnnecessaryIsInstance=false

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import optree
import torch

from fshard._array.array import Shard, ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import opaque
from fshard._errors import LayoutError, SpecError
from fshard._exec import autograd as _autograd
from fshard._exec import fused as _fused
from fshard._exec.agree import (
    agree,
    holds_nothing_somewhere,
    on_every_rank,
)
from fshard._exec.collective import collective
from fshard._exec.replicas import check_leaves, checking
from fshard._layout.layout import Layout, ShardMeta, with_partial, with_terms
from fshard._layout.placement import Placement
from fshard._layout.precision import Precision, check_floating, check_precision
from fshard._layout.specs import Replicated, as_layout
from fshard._layout.torch_meta import is_dtensor, is_torch_spec
from fshard._plan import fuse as _fuse
from fshard.backends import Backend, default_backend

__all__ = [
    "allclose",
    "check_plain",
    "check_tensor",
    "equal",
    "from_local_shards_and_layout",
    "gather",
    "is_spec",
    "reshard",
    "resolved",
    "resolve_backend",
    "split_replicas",
    "whole_on",
]


def resolve_backend(backend: Backend | None) -> Backend:
    """``backend`` itself, or the default one (torch_dist when initialised, else local)."""
    if backend is None:
        return default_backend()
    if not isinstance(backend, Backend):
        msg = f"backend= takes an fshard backend (LocalBackend, TorchDistBackend), not {type(backend).__name__}."
        raise TypeError(msg)
    return backend


def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor``, or ``TypeError``/``SpecError`` naming ``what`` when it is no plain torch tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}.")
    check_plain(tensor, what)
    return tensor


def check_plain(tensor: torch.Tensor, what: str) -> None:
    """Raises ``SpecError`` for a tensor whose elements are not plain values in strided memory, or a DTensor."""
    refuse_lazy(tensor, what)
    if is_dtensor(tensor):
        msg = (
            f"{what} is a torch DTensor, whose data lives on its mesh's ranks: convert it on every rank with "
            "fshard.from_dtensor(dt) (then fshard.reshard for another layout), or pass dt.full_tensor()."
        )
        raise SpecError(msg)
    if tensor.layout != torch.strided:
        raise SpecError(f"{what} has layout {tensor.layout}; only torch.strided tensors can be sharded.")
    if tensor.is_nested:
        msg = f"{what} is a nested tensor; only dense tensors can be sharded: pad it first (x.to_padded_tensor(0))."
        raise SpecError(msg)
    if tensor.is_quantized:
        msg = f"{what} has quantized dtype {tensor.dtype}, which fshard cannot shard: dequantize it (x.dequantize())."
        raise SpecError(msg)


def refuse_lazy(tensor: torch.Tensor, what: str) -> None:
    """Raises ``SpecError`` for a lazy module's parameter or buffer, which has no shape until its first forward."""
    if type(tensor) is not torch.Tensor and torch.nn.parameter.is_lazy(tensor):
        msg = (
            f"{what} is an uninitialized parameter or buffer of a lazy module (torch.nn.LazyLinear and kin), "
            "which has no shape yet: run the module once on an example batch first, so that its shapes are known."
        )
        raise SpecError(msg)


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a pending conjugation or negation applied (``z.conj()``, ``z.conj().imag``).

    Such views cannot be viewed as bytes, which sending them takes. No copy for other tensors.
    """
    if tensor.is_conj() or tensor.is_neg():  # asking costs a fifth of resolving
        return tensor.resolve_conj().resolve_neg()
    return tensor


@cached(1024)
def whole_on(layout: Layout, rank: int) -> Layout:
    """The whole array once, on ``rank`` (on the device of its first shard in ``layout``)."""
    held = layout.indices_on(rank)
    device = layout._shard(held[0] if held else 0).placement.device  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
    return Replicated([Placement(rank, device)]).layout(layout.shape)


@cached(1024)
def _reduced(layout: Layout, dst: int | None) -> Layout:
    """Where ``gather`` reduces a pending reduction: a copy on every rank of ``layout`` (or on ``dst``).

    Cached: made per call, it cost a look at every rank's shards and a new layout of one shard per rank.
    """
    if dst is not None:
        return whole_on(layout, dst)
    firsts = [layout._shard(layout.indices_on(r)[0]).placement for r in layout.ranks]  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
    return Replicated(firsts).layout(layout.shape)


@overload
def gather(array: ShardedArray, *, dst: None = None) -> torch.Tensor: ...
@overload
def gather(array: ShardedArray, *, dst: int) -> torch.Tensor | None: ...
@overload
def gather(array: Any, *, dst: int | None = None) -> Any: ...
@collective("gather")
@opaque
def gather(array: Any, *, dst: int | None = None) -> Any:
    """The global tensor: on every rank (``dst=None``) or on rank ``dst`` (others get ``None``).

    Each distinct box is read from one replica; uneven and empty shards need no padding.
    A pending reduction (``Partial``) is carried out first, with the fewest elements
    sent: a reduce-scatter then an all-gather (``dst=None``), or a reduce to ``dst``.
    A pytree of arrays gives the pytree of their tensors; where no gradient is recorded
    (evaluation, checkpoints), the arrays of one dtype are gathered in one movement (one
    collective per phase, not one per array).
    In check mode the copies of each replicated box are compared first
    (``fshard.check_replicas``): copies that drifted apart raise ``ReplicaMismatchError``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(6).reshape(2, 3), fshard.Chunk(1, [0, 1, 2, 3]))
    >>> fshard.gather(x).tolist()
    [[0, 1, 2], [3, 4, 5]]
    >>> fshard.gather({"x": x, "y": fshard.shard(torch.ones(2), fshard.Replicated([0, 1]))})["y"].tolist()
    [1.0, 1.0]
    """
    if not isinstance(array, ShardedArray):
        return _gather_tree(array, dst)
    if checking():  # copies that drifted apart: gather would return one of them
        check_leaves([("the array passed to gather()", array)], "gather()")
    if dst is not None:
        dst = array.backend.check_rank(dst, "dst")
    if array.layout.partial is not None:
        array = reshard(array, _reduced(array.layout, dst))
    return _autograd.assemble(array.layout, array.backend, array.addressable_data, array._first(), dst)  # pyright: ignore[reportPrivateUsage]  # package-internal


@overload
def reshard(array: ShardedArray, spec: Any, *, precision: Precision | None = None) -> ShardedArray: ...
@overload
def reshard(array: Any, spec: Any, *, precision: Precision | None = None) -> Any: ...
@collective("reshard")
@opaque
def reshard(array: Any, spec: Any, *, precision: Precision | None = None) -> Any:
    """The same global values in a new layout; only elements whose owner changes are sent.

    From a pending reduction (``Partial``) to a non-partial spec, the copies are
    reduced: a reduce-scatter (each element's summands reach its owner once,
    combined on each sending rank), followed by an all-gather for replicated
    targets. To a ``Partial`` spec, one copy of each element keeps the value.

    A pytree of arrays takes one spec for every leaf or a matching pytree of specs; the
    arrays of one dtype move in one movement (one collective per phase, not one per
    array) wherever their boxes are ranges of their row-major order (dim-0 chunks,
    replicas, whole arrays), and one by one otherwise.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(8.0).reshape(2, 4), fshard.Chunk(0, [0, 1]))
    >>> y = fshard.reshard(x, fshard.Chunk(1, [0, 1]))
    >>> [s.data.tolist() for s in y.addressable_shards]
    [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]
    >>> b = fshard.shard(torch.ones(3), fshard.Chunk(0, [0, 1]))
    >>> tree = fshard.reshard({"x": x, "b": b}, fshard.Replicated([0, 1]))
    >>> tree["b"].layout == fshard.Replicated([0, 1]).layout((3,))
    True

    With ``precision=fshard.Precision(param=..., reduce=...)``, each sender casts its boxes
    to ``param`` before sending (the result has that dtype), and the backward sends the
    gradients in ``reduce``, returning them in the array's own dtype (docs/training.md,
    "Mixed precision"):

    >>> half = fshard.reshard(x, fshard.Replicated([0, 1]), precision=fshard.Precision(param=torch.bfloat16))
    >>> half.dtype, half.layout == fshard.Replicated([0, 1]).layout((2, 4))
    (torch.bfloat16, True)

    Raises:
        SpecError: the spec does not fit, or ``precision`` is given for an array whose dtype
            is not floating.
    """
    precision = check_precision(precision, "reshard()")
    if not isinstance(array, ShardedArray):
        return _reshard_tree(array, spec, precision)
    layout = as_layout(spec, array.shape)
    if precision is not None:
        check_floating(precision, array.dtype, "reshard()'s array")
        if not precision.casts(array.dtype):
            precision = None
    if layout == array.layout and precision is None:
        return array
    if layout != array.layout:
        array.backend.check_layout(layout)
    if precision is not None:
        first = array._first()  # pyright: ignore[reportPrivateUsage]  # package-internal
        data, link = _autograd.move_cast(array.layout, layout, array.backend, array.addressable_data, first, precision)
        return ShardedArray._of(layout, data, array.backend, precision.forward_dtype(array.dtype), link)  # pyright: ignore[reportPrivateUsage]  # fits by construction
    data, link = _autograd.move(array.layout, layout, array.backend, array.addressable_data, array._first())  # pyright: ignore[reportPrivateUsage]  # package-internal
    return ShardedArray._of(layout, data, array.backend, array.dtype, link)  # pyright: ignore[reportPrivateUsage]  # fits by construction


def split_replicas(array: ShardedArray) -> ShardedArray:
    """A partial ``array`` with every copy a summand of its own (``Layout.terms`` dropped).

    Where copies are replicas of one summand, one of them keeps it and the others hold the
    op's identity: nothing is sent. A function that runs copy by copy (a linear map of a
    pending sum) then counts each summand once.

    >>> import torch, fshard
    >>> mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    >>> p = fshard.reshard(fshard.shard(torch.ones(2), fshard.Replicated(range(4))),
    ...                    fshard.Partial(fshard.Named(mesh, (None,)), over="tp"))
    >>> q = split_replicas(p)
    >>> q.layout.terms is None, [s.data.tolist() for s in q.addressable_shards], fshard.gather(q).tolist()
    (True, [[1.0, 1.0], [-0.0, -0.0], [-0.0, -0.0], [-0.0, -0.0]], [1.0, 1.0])
    """
    layout = array.layout
    if layout.terms is None:
        return array
    return reshard(array, with_terms(layout, None))


def _aligned(a: ShardedArray, b: ShardedArray, what: str) -> tuple[ShardedArray, ShardedArray] | None:
    """``a`` and ``b`` in one layout, their values (a pending sum reduced, not its summands); ``None``: other shapes."""
    _check_array(a, what)
    _check_array(b, what)
    if a.shape != b.shape:
        return None
    if a.layout.partial is not None:
        a = reshard(a, with_partial(a.layout, None))
    return a, reshard(b, a.layout)


@collective("equal")
def equal(a: ShardedArray, b: ShardedArray) -> bool:
    """True when both arrays have the same shape and values (collective).

    If the layouts differ, ``b`` is resharded to ``a``'s layout first; a pending sum is
    compared by its value (reduced first), not by its summands.

    >>> import torch, fshard
    >>> t = torch.arange(6.0)
    >>> fshard.equal(fshard.shard(t, fshard.Chunk(0, [0, 1])), fshard.shard(t, fshard.Replicated([0, 1])))
    True
    """
    pair = _aligned(a, b, "equal()")
    ok = pair is not None and all(torch.equal(x, y) for x, y in zip(pair[0].addressable_data, pair[1].addressable_data))
    return on_every_rank(a.backend, ok)


@collective("allclose")
def allclose(a: ShardedArray, b: ShardedArray, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """``torch.allclose`` over whole arrays (collective); ``b`` is resharded to ``a``'s layout.

    A pending sum is compared by its value (reduced first). Arrays of two dtypes raise
    ``TypeError`` on every rank, as ``torch.allclose`` refuses them.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))
    >>> fshard.allclose(x, fshard.map_local(lambda t: t + 1e-9, x))
    True
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"allclose() {name} must be a real number, got {value!r} ({type(value).__name__}).")
    if not isinstance(equal_nan, bool):
        raise TypeError(f"allclose() equal_nan must be a bool, got {equal_nan!r} ({type(equal_nan).__name__}).")
    _check_array(a, "allclose()")
    _check_array(b, "allclose()")
    if a.dtype != b.dtype:  # as torch.allclose refuses; decided from the arrays' dtypes, on every rank alike
        msg = (
            f"allclose() compares arrays of one dtype, got {a.dtype} and {b.dtype}: convert one first, "
            f"e.g. fshard.map_local(lambda t: t.to({b.dtype}), a)."
        )
        raise TypeError(msg)
    pair = _aligned(a, b, "allclose()")
    ok = pair is not None and all(
        torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
        for x, y in zip(pair[0].addressable_data, pair[1].addressable_data)
    )
    return on_every_rank(a.backend, ok)


@collective("from_local_shards_and_layout", local=("shards",))
def from_local_shards_and_layout(
    shards: Sequence[Shard], layout: Layout, *, backend: Backend | None = None
) -> ShardedArray:
    """Wraps this process's shards, checked against ``layout``.

    No communication, unless some process of the group holds no shard of ``layout``:
    then the processes share their shards' dtype and ``requires_grad`` (one small
    collective), so that one's array has them too.

    >>> import torch, fshard
    >>> lay = fshard.Chunk(0, [0, 1]).layout((4,))
    >>> parts = [fshard.Shard(m, torch.full(m.sizes, float(m.placement.rank))) for m in lay.shards]
    >>> fshard.gather(fshard.from_local_shards_and_layout(parts, lay)).tolist()
    [0.0, 0.0, 1.0, 1.0]

    Raises:
        LayoutError: a shard is missing, extra or given twice, its tensor does not fit its
            box or is not on its placement's device, or the shards differ in dtype or
            ``requires_grad``.
        SpecError: a shard's tensor is not strided (sparse, say).
    """
    backend = resolve_backend(backend)
    if not isinstance(layout, Layout):
        raise SpecError(f"from_local_shards_and_layout() needs a Layout, got {type(layout).__name__}.")
    backend.check_layout(layout)
    if not holds_nothing_somewhere(backend, layout):
        return ShardedArray(layout, _own_shards(shards, layout, backend), backend)
    # A process without shards learns the dtype from the others; a bad shard anywhere raises everywhere.
    data, seen = agree(backend, lambda: _own_shards(shards, layout, backend), _kind)
    kinds = {k for k in seen if k is not None}
    if len(kinds) > 1:
        msg = (
            "from_local_shards_and_layout(): the ranks' shards differ in (dtype, requires_grad): "
            f"{sorted(kinds, key=str)}; make them agree."
        )
        raise LayoutError(msg)
    if data or not kinds:
        return ShardedArray(layout, data, backend)
    dtype, requires_grad = kinds.pop()
    return ShardedArray(layout, (), backend, dtype, requires_grad=requires_grad)


def _kind(data: Sequence[torch.Tensor]) -> tuple[torch.dtype, bool] | None:
    return (data[0].dtype, data[0].requires_grad) if data else None


def _own_shards(shards: Any, layout: Layout, backend: Backend) -> list[torch.Tensor]:
    """The tensors of this process's shards of ``layout``, in layout order, checked."""
    shards = list(cast("Sequence[Any]", shards)) if isinstance(shards, (list, tuple)) else _listed(shards)
    given: dict[ShardMeta, list[torch.Tensor]] = {}
    for s in shards:
        if not isinstance(s, Shard):
            raise TypeError(f"Expected fshard.Shard values, got {type(s).__name__}.")
        given.setdefault(s.meta, []).append(check_tensor(s.data, f"The tensor of shard {s.meta}"))
    index = backend.addressable(layout)
    want = [layout._shard(i) for i in index]  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
    counts = collections.Counter(want)
    twice = [m for m, ts in given.items() if len(ts) > counts[m] > 0]
    if twice:
        raise LayoutError(f"from_local_shards_and_layout() got shard {twice[0]} twice; pass each shard once.")
    missing = [m for m in counts if m not in given]
    extra = [m for m in given if m not in counts]
    if missing or extra:
        msg = f"Local shards do not match the layout on this process: missing {missing}, unexpected {extra}."
        raise LayoutError(msg)
    data = [given[m][0] if len(given[m]) == 1 else given[m][k] for m, k in _occurrences(want)]
    for m, t in zip(want, data):
        device = torch.device(m.placement.device)
        if t.device.type != device.type or device.index not in (None, t.device.index):
            msg = (
                f"The tensor of shard {m} is on {t.device}, not on its placement's device "
                f"{device}; move it there first."
            )
            raise LayoutError(msg)
    if len({(t.dtype, t.requires_grad) for t in data}) > 1:
        first = (data[0].dtype, data[0].requires_grad)
        m, t = next((m, t) for m, t in zip(want, data) if (t.dtype, t.requires_grad) != first)
        msg = (
            f"Local shards differ: the shard at offsets {want[0].offsets} on rank {want[0].placement.rank} is "
            f"{first[0]} with requires_grad={first[1]}, the one at offsets {m.offsets} on rank {m.placement.rank} "
            f"{t.dtype} with requires_grad={t.requires_grad}; give every shard one dtype, and requires_grad on every "
            "shard or on none."
        )
        raise LayoutError(msg)
    return data


def _occurrences(metas: Sequence[ShardMeta]) -> list[tuple[ShardMeta, int]]:
    """Each meta with how many equal ones come before it (a layout may list an empty box twice)."""
    seen: collections.Counter[ShardMeta] = collections.Counter()
    out: list[tuple[ShardMeta, int]] = []
    for m in metas:
        out.append((m, seen[m]))
        seen[m] += 1
    return out


def _listed(shards: Any) -> list[Any]:
    try:
        return list(shards)
    except TypeError:
        msg = f"from_local_shards_and_layout() takes a sequence of fshard.Shard, got {type(shards).__name__}."
        raise TypeError(msg) from None


def _check_array(x: Any, what: str) -> None:
    if not isinstance(x, ShardedArray):
        raise TypeError(f"{what} takes a ShardedArray, got {type(x).__name__}.")


_ARRAY_TYPE = {ShardedArray}
_LAYOUT, _BACKEND = operator.attrgetter("_layout"), operator.attrgetter("_backend")  # of many arrays: map() in C


_is_array: Callable[[Any], bool] = ShardedArray.__instancecheck__  # isinstance(x, ShardedArray), called from C


def is_spec(x: Any) -> bool:
    """Whether ``x`` is one spec (or a ``Layout``) rather than a pytree of them."""
    return x is None or isinstance(x, Layout) or hasattr(x, "layout") or is_torch_spec(x)


def _leaves(tree: Any, what: str) -> tuple[list[ShardedArray], Any]:
    """The arrays of a pytree and its structure; ``TypeError`` naming a leaf that is no array.

    ``None`` in a tree is an empty subtree, kept where it is (as ``shard`` keeps it, and as
    optree, torch's pytree and JAX read it); ``None`` itself is no tree of arrays.
    """
    if tree is None:
        raise TypeError(f"{what} takes a ShardedArray, got NoneType. A pytree of ShardedArrays is taken too.")
    leaves, treedef = optree.tree_flatten(tree, is_leaf=_is_array, none_is_leaf=False)
    if set(map(type, leaves)) != _ARRAY_TYPE:  # one pass in C for the common case
        _check_leaves(tree, leaves, what)
    if leaves:
        _same_backend(leaves, what)
    return cast("list[ShardedArray]", leaves), treedef


def _check_leaves(tree: Any, leaves: list[Any], what: str) -> None:
    for path, leaf in zip(optree.tree_paths(tree, is_leaf=_is_array, none_is_leaf=False), leaves):
        if not isinstance(leaf, ShardedArray):
            if not path:
                msg = f"{what} takes a ShardedArray, got {type(leaf).__name__}. A pytree of ShardedArrays is taken too."
            else:
                msg = f"{what} takes a ShardedArray or a pytree of them; the leaf at {path} is a {type(leaf).__name__}."
            raise TypeError(msg)


def _same_backend(leaves: Sequence[ShardedArray], what: str) -> None:
    backends = list(map(_BACKEND, leaves))
    first = backends[0]
    if backends.count(first) == len(backends):  # in C: the common case, one backend object, tests identity alone
        return
    other = next((a.backend for a in leaves if a.backend != first), None)
    if other is not None:
        raise SpecError(f"{what} takes a tree of arrays of one backend; it holds {first!r} and {other!r}.")


def _reshard_tree(tree: Any, specs: Any, precision: Precision | None) -> Any:
    leaves, treedef = _leaves(tree, "reshard()")
    if not leaves:
        empty: Any = optree.tree_unflatten(treedef, cast("list[Any]", []))
        return empty
    if precision is not None:
        for path, leaf in zip(optree.tree_paths(tree, is_leaf=_is_array, none_is_leaf=False), leaves):
            check_floating(precision, leaf.dtype, f"reshard()'s leaf at {path}")
    src = tuple(map(_LAYOUT, leaves))
    backend = leaves[0].backend
    flat_specs: tuple[Any, ...] | None = None
    if not is_spec(specs):
        try:
            flat_specs = tuple(treedef.flatten_up_to(specs))
        except (ValueError, TypeError) as exc:
            msg = f"reshard() takes one spec or a pytree of specs matching the arrays ({treedef}): {exc}"
            raise SpecError(msg) from None
    try:
        layouts = _tree_targets(src, None if flat_specs is not None else specs, flat_specs, backend)
    except (TypeError, ValueError) as error:  # named by the leaf whose spec does not fit (SpecError, LayoutError)
        each = flat_specs if flat_specs is not None else (specs,) * len(src)
        for path, x, s in zip(optree.tree_paths(tree, is_leaf=_is_array, none_is_leaf=False), src, each):
            try:
                _targets((x,), s, None, backend)
            except (TypeError, ValueError):
                error.add_note(f"(the array at {path} of reshard()'s tree, shape {x.shape})")
                break
        raise
    moved: list[Any] = _fused.move_tree(leaves, layouts, precision=precision)
    return optree.tree_unflatten(treedef, moved)


def _tree_targets(src: tuple[Layout, ...], spec: Any, specs: tuple[Any, ...] | None, backend: Backend) -> list[Layout]:
    """The target layout of each leaf (of layouts ``src``): ``spec`` for all, or ``specs[k]`` for leaf ``k``; checked.

    Cached on the tree's layouts and specs, so that a tree moved again resolves and checks
    nothing per leaf; specs that cannot be hashed are resolved every time.
    """
    try:
        return list(_cached_targets(src, spec, specs, backend))
    except TypeError as exc:
        if "unhashable" not in str(exc):
            raise
        return list(_targets(src, spec, specs, backend))


def _targets(src: tuple[Layout, ...], spec: Any, specs: tuple[Any, ...] | None, backend: Backend) -> tuple[Layout, ...]:
    flat_specs = specs if specs is not None else (spec,) * len(src)
    layouts = tuple(as_layout(s, x.shape) for x, s in zip(src, flat_specs))
    for a, x in zip(src, layouts):
        if x != a:
            backend.check_layout(x)
    return layouts


_cached_targets = cached(256)(_targets)


def _gather_tree(tree: Any, dst: int | None) -> Any:
    leaves, treedef = _leaves(tree, "gather()")
    if not leaves:  # nothing to gather; dst is still checked, against the default backend
        if dst is not None:
            default_backend().check_rank(dst, "dst")
        empty: Any = optree.tree_unflatten(treedef, cast("list[Any]", []))
        return empty
    if checking():  # copies that drifted apart: gather would return one of them
        paths = optree.tree_paths(tree, is_leaf=_is_array, none_is_leaf=False)
        check_leaves([(f"the leaf at {p} passed to gather()", a) for p, a in zip(paths, leaves)], "gather()")
    backend = leaves[0].backend
    if dst is not None:
        dst = backend.check_rank(dst, "dst")
    receivers: set[int] = set(backend.receivers(leaves[0].layout, dst))
    if dst is None and not backend.spans_processes:  # the ranks of the job that this process stands for
        size: int = getattr(backend, "world_size", 0)
        receivers = set(range(size)) if size else {r for a in leaves for r in a.layout.ranks}
    # Across processes and without gradients, where every receiver holds a shard, the whole array on
    # each (reduced first) is a layout of the array: those leaves move as one tree. The others go
    # through gather one by one (as every leaf does in one process, but pending sums, which pack alike
    # on every backend to add alike: fused.move_tree): a gathered tensor that needs a gradient is one
    # whose per-shard uses gather's backward sums, on every backend alike.
    grads = torch.is_grad_enabled() and any(a.requires_grad for a in leaves)
    src = tuple(a.layout for a in leaves)
    packs = _fuse.packs_flat(backend, *(x.partial for x in src))
    fused, targets = _gather_targets(src, dst, tuple(receivers)) if packs and not grads else ((), ())
    out: list[Any] = [None] * len(leaves)
    moved = _fused.move_tree([leaves[k] for k in fused], targets)
    for k, a in zip(fused, moved):
        out[k] = a.addressable_data[0] if a.addressable_data else None
    for k in sorted(set(range(len(leaves))) - set(fused)):
        out[k] = gather(leaves[k], dst=dst)
    return optree.tree_unflatten(treedef, out)


@cached(256)
def _gather_targets(
    src: tuple[Layout, ...], dst: int | None, receivers: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[Layout, ...]]:
    """The leaves of layouts ``src`` that a gather moves as one tree, and the layouts they move to.

    Those where every receiver holds a shard; each moves to the whole array on every receiver.
    """
    fused = tuple(k for k, x in enumerate(src) if set(receivers) <= set(x.ranks))
    return fused, tuple(_reduced(src[k], dst) for k in fused)
