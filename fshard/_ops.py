"""The functional API: pure functions from values to new values."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import optree
import torch

from fshard import _autograd, _operators, _varying  # noqa: F401  (_operators adds ShardedArray's operators)
from fshard._array import Shard, ShardedArray
from fshard._collective import collective
from fshard._compile import opaque
from fshard._errors import LayoutError, SpecError
from fshard._layout import Layout, ShardMeta, with_partial
from fshard._outcome import (
    agree,
    describe_results,
    holds_nothing_somewhere,
    link_without_blocks,
    merge_results,
    untouched,
)
from fshard._placement import Placement
from fshard._shard_map import map_local  # the public map_local, re-exported here
from fshard._specs import Replicated, as_layout
from fshard._torch_meta import is_sharded_tensor
from fshard.backends import Backend, default_backend

__all__ = [
    "allclose",
    "equal",
    "from_local_shards_and_layout",
    "gather",
    "map_local",
    "map_same",
    "reshard",
    "shard",
]


def resolve_backend(backend: Backend | None) -> Backend:
    """``backend`` itself, or the default one (torch_dist when initialised, else local)."""
    if backend is None:
        return default_backend()
    if not isinstance(backend, Backend):
        msg = f"backend= takes an fshard backend (LocalBackend, TorchDistBackend), not {type(backend).__name__}."
        raise TypeError(msg)
    return backend


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}.")
    _check_plain(tensor, what)
    return tensor


def _check_plain(tensor: torch.Tensor, what: str) -> None:
    """Raises ``SpecError`` for a tensor whose elements are not plain values in strided memory."""
    if tensor.layout != torch.strided:
        raise SpecError(f"{what} has layout {tensor.layout}; only torch.strided tensors can be sharded.")
    if tensor.is_nested:
        msg = f"{what} is a nested tensor; only dense tensors can be sharded: pad it first (x.to_padded_tensor(0))."
        raise SpecError(msg)
    if tensor.is_quantized:
        msg = f"{what} has quantized dtype {tensor.dtype}, which fshard cannot shard: dequantize it (x.dequantize())."
        raise SpecError(msg)


def _resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a pending conjugation or negation applied (``z.conj()``, ``z.conj().imag``):
    such views cannot be viewed as bytes, which sending them takes. No copy for other tensors."""
    if tensor.is_conj() or tensor.is_neg():  # asking costs a fifth of resolving
        return tensor.resolve_conj().resolve_neg()
    return tensor


def _meta_problem(tensor: torch.Tensor, layout: Layout, what: str) -> str | None:
    """Why ``tensor`` cannot be sliced into ``layout``: on the meta device it has no values to put
    anywhere but on meta placements."""
    if tensor.device.type != "meta":
        return None
    devices = sorted({d for d in layout._devices if torch.device(d).type != "meta"})
    if not devices:
        return None
    return (
        f"{what} is on the meta device, which holds no values, but the spec places shards on {devices}: "
        "place them on the meta device too ('rank:0/meta'), or pass a tensor that holds values."
    )


def _source(tensor: torch.Tensor | None, src: int, spec: Any, backend: Backend) -> tuple[tuple[int, ...], torch.Tensor]:
    """Agrees on ``src`` across ranks; returns the global shape and the tensor (a stand-in off src).

    Rank ``src`` checks its tensor before the exchange and sends what is wrong with it,
    so a bad source tensor raises on every rank instead of leaving the others waiting.
    """
    mine = backend.holds(src)
    problem = _source_problem(tensor, src, spec) if mine else None
    info = (
        (src, tuple(tensor.shape), tensor.dtype, tensor.requires_grad, problem)
        if mine and problem is None and tensor is not None
        else (src, None, None, False, problem)
    )
    seen = backend.exchange(info)
    if len({s[0] for s in seen}) != 1:
        msg = f"src={src} on rank {backend.rank} does not match with src_rank on other ranks: {[s[0] for s in seen]}."
        raise SpecError(msg)
    bad = next((s[4] for s in seen if s[4] is not None), None)
    if bad is not None:
        kind, msg = bad
        raise (TypeError if kind == "TypeError" else SpecError)(msg)
    # Entries follow group order, not global ranks: the owner is the one that sent a shape.
    owner = next(s for s in seen if s[1] is not None)
    if mine:
        return owner[1], _resolved(tensor)  # type: ignore[arg-type]
    # The stand-in requires grad like the source, so every rank's shards join autograd alike.
    return owner[1], torch.empty(0, dtype=owner[2], requires_grad=owner[3])


def _source_problem(tensor: Any, src: int, spec: Any) -> tuple[str, str] | None:
    """What is wrong with rank ``src``'s source tensor, as (exception type, message), or ``None``."""
    if tensor is None:
        return "SpecError", f"shard(..., src={src}) needs a tensor on rank {src}, got None."
    if is_sharded_tensor(tensor):
        msg = (
            f"shard(..., src={src}) got a torch ShardedTensor on rank {src}: its data already lives on its "
            "process group's ranks. Convert it instead, on every rank: "
            "fshard.reshard(fshard.from_sharded_tensor(st), spec)."
        )
        return "SpecError", msg
    try:
        _check_tensor(tensor, f"shard() input on rank {src}")
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    if tensor.device.type != "meta":
        return None
    try:
        layout = as_layout(spec, tuple(tensor.shape))
    except (TypeError, ValueError):
        return None  # every rank raises it after the exchange, where the shape is known
    problem = _meta_problem(tensor, layout, f"shard() input on rank {src}")
    return None if problem is None else ("SpecError", problem)


@collective("shard", local=("tensor",))
@opaque
def shard(
    tensor: torch.Tensor | None, spec: Any, *, src: int | None = None, backend: Backend | None = None
) -> ShardedArray:
    """Splits a global tensor into a ``ShardedArray`` laid out by ``spec`` (a spec or a ``Layout``).

    Args:
        tensor: the global tensor. With ``src=None`` every rank passes it and slices
            its own boxes (nothing is sent); with ``src=k`` only rank k's is read and
            other ranks may pass ``None``.
        spec: ``Chunk``, ``Named``, ``Replicated``, ``Single``, ``Explicit`` or a ``Layout``.
        src: the rank whose tensor is the source, or ``None``.
        backend: defaults to torch_dist when torch.distributed is initialised, else local.

    Returns:
        A new ``ShardedArray``; non-contiguous inputs are read correctly.

    With a ``Partial`` spec the array's value is still ``tensor``: one copy of each
    element holds it and the others hold the identity (0 for a sum).

    Raises:
        SpecError: the spec does not fit ``tensor.shape``, or ranks disagree on ``src``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(10.0), fshard.Chunk(0, [0, 1, 2, 3]))
    >>> [tuple(s.data.tolist()) for s in x.addressable_shards]
    [(0.0, 1.0, 2.0), (3.0, 4.0, 5.0), (6.0, 7.0, 8.0), (9.0,)]
    """
    if is_sharded_tensor(tensor) and src is None:  # already sharded: converted, then resharded
        from fshard._interop import shard_sharded_tensor

        return shard_sharded_tensor(tensor, spec, src=src, backend=backend)
    backend = resolve_backend(backend)
    if src is not None:
        src = backend.check_rank(src, "src")
    if src is None:
        full = _resolved(_check_tensor(tensor, "shard() input"))
        shape: tuple[int, ...] = tuple(full.shape)
    else:
        shape, full = _source(tensor, src, spec, backend)
    target = as_layout(spec, shape)
    backend.check_layout(target)
    problem = _meta_problem(full, target, "shard() input") if src is None else None
    if problem is not None:
        raise SpecError(problem)
    # A pending reduction: slice into copies that all hold the value, then keep one of each.
    layout = target if target.partial is None else with_partial(target, None) if src is None else _on(target, src)
    data, link = _autograd.scatter(full, layout, backend, src)
    out = ShardedArray(layout, data, backend, full.dtype, link)
    return out if layout is target else reshard(out, target)


def _on(layout: Layout, rank: int) -> Layout:
    """The whole array once, on ``rank`` (on the device of its first shard in ``layout``)."""
    held = layout.indices_on(rank)
    device = layout._shard(held[0] if held else 0).placement.device
    return Replicated([Placement(rank, device)]).layout(layout.shape)


def _reduced(layout: Layout, dst: int | None) -> Layout:
    """Where ``gather`` reduces a pending reduction: a copy on every rank of ``layout`` (or on ``dst``)."""
    if dst is not None:
        return _on(layout, dst)
    firsts = [layout._shard(layout.indices_on(r)[0]).placement for r in layout.ranks]
    return Replicated(firsts).layout(layout.shape)


@overload
def gather(array: ShardedArray, *, dst: None = None) -> torch.Tensor: ...
@overload
def gather(array: ShardedArray, *, dst: int) -> torch.Tensor | None: ...
@collective("gather")
@opaque
def gather(array: ShardedArray, *, dst: int | None = None) -> torch.Tensor | None:
    """The global tensor: on every rank (``dst=None``) or on rank ``dst`` (others get ``None``).

    Each distinct box is read from one replica; uneven and empty shards need no padding.
    A pending reduction (``Partial``) is carried out first, with the fewest elements
    sent: a reduce-scatter then an all-gather (``dst=None``), or a reduce to ``dst``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(6).reshape(2, 3), fshard.Chunk(1, [0, 1, 2, 3]))
    >>> fshard.gather(x).tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    _check_array(array, "gather()")
    if dst is not None:
        dst = array.backend.check_rank(dst, "dst")
    if array.layout.partial is not None:
        array = reshard(array, _reduced(array.layout, dst))
    return _autograd.assemble(array.layout, array.backend, array._data, array._first(), dst)


@collective("reshard")
@opaque
def reshard(array: ShardedArray, spec: Any) -> ShardedArray:
    """The same global values in a new layout; only elements whose owner changes are sent.

    From a pending reduction (``Partial``) to a non-partial spec, the copies are
    reduced: a reduce-scatter (each element's summands reach its owner once,
    combined on each sending rank), followed by an all-gather for replicated
    targets. To a ``Partial`` spec, one copy of each element keeps the value.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(8.0).reshape(2, 4), fshard.Chunk(0, [0, 1]))
    >>> y = fshard.reshard(x, fshard.Chunk(1, [0, 1]))
    >>> [s.data.tolist() for s in y.addressable_shards]
    [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]
    """
    _check_array(array, "reshard()")
    layout = as_layout(spec, array.shape)
    if layout == array.layout:
        return array
    array.backend.check_layout(layout)
    data, link = _autograd.move(array.layout, layout, array.backend, array._data, array._first())
    return ShardedArray._of(layout, data, array.backend, array.dtype, link)


def map_same(fn: Callable[..., Any], arrays: Sequence[ShardedArray], pending: str | None) -> Any:
    """``map_local`` of arrays that share a layout (``pending``: the result is a pending sum).

    Each result leaf's layout is inferred from its shards: the arguments' layout, with
    dims that no shard splits resized to the new extent. Where some process holds no
    shard, the processes share what ``fn`` returned (structure, dtypes, shapes), so
    that one learns them too, and an error ``fn`` raised anywhere is raised everywhere.
    """
    first = arrays[0]
    backend, base = first.backend, with_partial(first.layout, None)
    index = backend.addressable(first.layout)

    usage = _varying.Usage()

    def compute() -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
        with _varying.per_shard(backend, usage), untouched([t for a in arrays for t in a._data], "map_local()"):
            outs = tuple(fn(*ts) for ts in zip(*(a._data for a in arrays)))
        return _result_leaves(outs)

    if holds_nothing_somewhere(backend, first.layout):
        describe = lambda r: (describe_results(r[0], [dict(zip(index, leaf)) for leaf in r[1]]), usage.ages())  # noqa: E731
        (tree, leaves), seen = agree(backend, compute, describe)
        tree, metas = merge_results([d for d, _ in seen], "map_local()")
        used = set().union(*(keys for _, keys in seen))
    else:
        tree, leaves = compute()
        metas = (describe_results(tree, [dict(zip(index, leaf)) for leaf in leaves]) or (None, []))[1]
        used = set()
    if tree is None:  # no shard anywhere: the result's link joins every argument's
        link = link_without_blocks(arrays, first.dtype, used)
        return ShardedArray(with_partial(first.layout, pending), (), backend, first.dtype, link)
    results = []
    for n, (dtype, sizes) in enumerate(metas):
        layout = with_partial(_infer_layout(base, sizes), pending)
        if leaves:
            results.append(ShardedArray(layout, leaves[n], backend, dtype))
        else:
            results.append(ShardedArray(layout, (), backend, dtype, link_without_blocks(arrays, dtype, used)))
    return optree.tree_unflatten(tree, results)


_LEAF = optree.tree_structure(cast(Any, 0))  # the structure of a single leaf


def _result_leaves(outs: Sequence[Any]) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """The results' tree structure (``None`` when there is none here) and each leaf's shards."""
    if not outs:
        return None, []
    if all(type(o) is torch.Tensor and _is_plain(o) for o in outs):  # the common case: one plain tensor each
        leaves = [tuple(outs)]
        tree = _LEAF
    else:
        flat = [optree.tree_flatten(o) for o in outs]
        tree = flat[0][1]
        if any(spec != tree for _, spec in flat):
            raise SpecError(f"map_local() fn returned different structures on different shards: {tree} and others.")
        leaves = [
            tuple(_resolved(_check_tensor(f[0][n], "map_local() fn result")) for f in flat)
            for n in range(tree.num_leaves)
        ]
    for leaf in leaves:
        if len(leaf) > 1 and len({t.dtype for t in leaf}) > 1:
            raise SpecError(
                f"map_local() fn returned dtypes {sorted({str(t.dtype) for t in leaf})} on different shards."
            )
    return tree, leaves


def _is_plain(t: torch.Tensor) -> bool:
    """Strided, not nested, quantized, conjugated or negated: kept as it is, unchecked."""
    return t.layout == torch.strided and not (t.is_nested or t.is_quantized or t.is_conj() or t.is_neg())


@opaque  # layout arithmetic in numpy: run eagerly under torch.compile
def _infer_layout(layout: Layout, sizes: dict[int, tuple[int, ...]]) -> Layout:
    """The layout of ``map_local``'s result, from the shapes of the result shards known here."""
    if all(s == tuple(layout._sz[i].tolist()) for i, s in sizes.items()):
        return layout
    if any(len(s) != layout.ndim for s in sizes.values()):
        msg = "map_local() fn changed the number of dims; pass out_spec=Layout(...) for the result."
        raise SpecError(msg)
    shape = tuple(_new_extent(layout, sizes, d) for d in range(layout.ndim))
    return Layout(shape, tuple(_resize(s, layout.shape, shape) for s in layout.shards))


def _new_extent(layout: Layout, sizes: dict[int, tuple[int, ...]], d: int) -> int:
    """The result's extent along ``d``: the sum of the new sizes of the distinct intervals
    that tile the dim (one interval when no shard splits it)."""
    new: dict[tuple[int, int], set[int]] = {}
    for i, s in sizes.items():
        m = layout._shard(i)
        new.setdefault((m.offsets[d], m.sizes[d]), set()).add(s[d])
    if all(k[1] == n for k, v in new.items() for n in v):
        return layout.shape[d]
    split = any(m.sizes[d] != layout.shape[d] for m in layout.shards)
    olds = sorted(k for k in new if k[1] > 0)
    if split:
        msg = (
            f"map_local() fn changed dim {d}, which the layout splits, from sizes {[k[1] for k in olds]} "
            f"to {[sorted(new[k]) for k in olds]}; pass out_spec= for the result."
        )
        raise SpecError(msg)
    covered = sum(k[1] for k in olds)
    tiles = all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(olds)) and olds and olds[0][0] == 0
    if any(len(new[k]) > 1 for k in olds) or not tiles or covered != layout.shape[d]:
        msg = (
            f"map_local() cannot infer the new extent of dim {d} from the shards held here "
            f"(new sizes per interval: { {k: sorted(v) for k, v in new.items()} }); pass out_spec=Layout(...)."
        )
        raise SpecError(msg)
    return sum(next(iter(new[k])) for k in olds)


def _resize(meta: ShardMeta, old: Sequence[int], new: Sequence[int]) -> ShardMeta:
    """``meta`` with every dim it spans whole stretched (or shrunk) to the new extent."""
    sizes = tuple(n if o == 0 and s == m else s for n, m, o, s in zip(new, old, meta.offsets, meta.sizes))
    return ShardMeta(meta.offsets, sizes, meta.placement)


def _aligned(a: ShardedArray, b: ShardedArray, what: str) -> tuple[ShardedArray, ShardedArray] | None:
    _check_array(a, what)
    _check_array(b, what)
    if a.shape != b.shape:
        return None
    return a, reshard(b, a.layout)


@collective("equal")
def equal(a: ShardedArray, b: ShardedArray) -> bool:
    """True when both arrays have the same shape and values (collective).

    If the layouts differ, ``b`` is resharded to ``a``'s layout first.

    >>> import torch, fshard
    >>> t = torch.arange(6.0)
    >>> fshard.equal(fshard.shard(t, fshard.Chunk(0, [0, 1])), fshard.shard(t, fshard.Replicated([0, 1])))
    True
    """
    pair = _aligned(a, b, "equal()")
    ok = pair is not None and all(torch.equal(x, y) for x, y in zip(pair[0]._data, pair[1]._data))
    return all(a.backend.exchange(ok))


@collective("allclose")
def allclose(a: ShardedArray, b: ShardedArray, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """``torch.allclose`` over whole arrays (collective); ``b`` is resharded to ``a``'s layout.

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
    pair = _aligned(a, b, "allclose()")
    ok = pair is not None and all(
        torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan) for x, y in zip(pair[0]._data, pair[1]._data)
    )
    return all(a.backend.exchange(ok))


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
    shards = list(shards) if isinstance(shards, (list, tuple)) else _listed(shards)
    given: dict[ShardMeta, list[torch.Tensor]] = {}
    for s in shards:
        if not isinstance(s, Shard):
            raise TypeError(f"Expected fshard.Shard values, got {type(s).__name__}.")
        given.setdefault(s.meta, []).append(_check_tensor(s.data, f"The tensor of shard {s.meta}"))
    index = backend.addressable(layout)
    want = [layout._shard(i) for i in index]
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
    for i, t in zip(index, data):
        device = torch.device(layout._shard(i).placement.device)
        if t.device.type != device.type or device.index not in (None, t.device.index):
            msg = (
                f"The tensor of shard {layout._shard(i)} is on {t.device}, not on its placement's device "
                f"{device}; move it there first."
            )
            raise LayoutError(msg)
    if len({(t.dtype, t.requires_grad) for t in data}) > 1:
        raise LayoutError("Local shards differ in dtype or requires_grad; make them agree.")
    return data


def _occurrences(metas: Sequence[ShardMeta]) -> list[tuple[ShardMeta, int]]:
    """Each meta with how many equal ones come before it (a layout may list an empty box twice)."""
    seen: collections.Counter[ShardMeta] = collections.Counter()
    out = []
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
