"""Trees of arrays moved as one: every leaf's plan in one movement of a flat array.

(On a backend that spans processes: in one process a movement is copies alone, and the
leaves move one by one, to the same values. Not so pending sums: a reduction adds each
element's summands on the rank that owns it in the plan, in an order that starts with the
owner's own, and the flat array's elements have other owners than each leaf's alone. So a
tree of pending sums packs alike on every backend, and its sums have the same bits.)

A movement of a tree of arrays (``reshard`` of a tree, ``shard_map``'s arguments, the
reduction of their gradients) would cost one collective per leaf. Here the leaves of one
dtype are laid end to end in one 1-D **flat array**: leaf ``l`` takes the range
``[base_l, base_l + numel_l)``, and each of its shards is the range its box covers in the
leaf's row-major order. That needs boxes that are ranges (``fshard._plan.fuse``: a box whose
dims after its first partial one are whole and before it are single rows, as dim-0 chunks,
replicas and whole arrays are). The flat array's layouts are ordinary layouts, so the tree
moves by one plan (cached on the tree's layouts), with one collective per phase; its
elements sent are the sum of the leaves' minimums, and each shard tensor travels as its
flattened view, so nothing is copied to pack the tree.

Gradients need no rule of their own: the flat movement is a movement (``autograd.move``),
and flattening and unflattening are views.

For the reduction of copies (``regroup``), only the boxes' sizes matter, not where they
lie: there every distinct box of every leaf gets a range of its own
(``fshard._plan.buckets.box_layout``), so any layout fuses.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from fshard._array.array import ShardedArray
from fshard._base.calls import set_moving_tree
from fshard._exec import accumulate as _accumulate
from fshard._exec import autograd as _autograd
from fshard._exec import buckets as _buckets
from fshard._exec import flight as _flight
from fshard._layout.layout import Layout
from fshard._plan import buckets as _bucket_plan
from fshard._plan.fuse import Fused, has_copies, recipe_of

_LAYOUT, _DTYPE, _BACKEND, _DATA = map(operator.attrgetter, ("_layout", "_dtype", "_backend", "_data"))  # map() in C
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

__all__ = ["launch_tree", "move_arguments", "move_tree", "regroup_tree"]


def flatten(data: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Each leaf's shard tensors, leaf by leaf, as 1-D views (a copy only for a non-contiguous shard)."""
    return tuple(t.reshape(-1) for leaf in data for t in leaf)


def unflatten(
    flat: Sequence[torch.Tensor], layouts: Sequence[Layout], held: Sequence[Sequence[int]]
) -> list[tuple[torch.Tensor, ...]]:
    """The flat shards back as each leaf's shard tensors (views), ``held[l]`` the leaf's shard indices here."""
    out: list[tuple[torch.Tensor, ...]] = []
    at = 0
    for x, idx in zip(layouts, held):
        sz: Any = x.columns.sz
        out.append(tuple(flat[at + k].view(tuple(sz[i].tolist())) for k, i in enumerate(idx)))
        at += len(idx)
    return out


def _groups(arrays: Sequence[ShardedArray], keep: Sequence[bool], to: Sequence[Layout] = ()) -> list[list[int]]:
    """The positions of the kept arrays, in order, grouped by dtype, backend and pending reductions.

    Those of the arrays and of their destinations ``to`` (if given).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, (a, ok) in enumerate(zip(arrays, keep)):
        if ok:
            groups.setdefault((a.dtype, a.backend, a.layout.partial, to[k].partial if to else None), []).append(k)
    return list(groups.values())


def _like(arrays: Sequence[ShardedArray]) -> torch.Tensor:
    """The tensor that stands for the group in its movement.

    The first array's, joined to the links of the arrays that hold no shard here (so the
    backward reaches their history on this rank too).
    """
    first = arrays[0]._first()  # pyright: ignore[reportPrivateUsage]  # package-internal
    if all(map(_DATA, arrays)):  # in C: every array holds shards here, so there is no link to join
        return first
    links = [a._first() for a in arrays[1:] if not a._data]  # pyright: ignore[reportPrivateUsage]  # 0-element links
    if not links or not (first.requires_grad or any(t.requires_grad for t in links)):
        return first  # no history to join (and no add for float8, uint16 or uint32)
    like = arrays[0]._link_view()  # pyright: ignore[reportPrivateUsage]
    for link in links:
        like = like + link
    return like


def move_tree(
    arrays: Sequence[ShardedArray], layouts: Sequence[Layout], *, summing: bool = False, precision: Any = None
) -> list[ShardedArray]:
    """Every array moved to its layout, the arrays of one dtype in one movement where their boxes allow.

    ``summing``: the backward sums the gradients of the destination's copies (``move_summing``).
    An array already in its layout is returned as it is (cast alone, with a ``precision``
    that casts it). Which leaves move together, and how they are laid out in the flat
    array, is computed once per tree of layouts (``fuse.recipe_of``).

    Where ``summing`` and the same movement was launched ahead (``launch_tree``, registered
    with ``flight.add``), its data is taken instead: the movement lands (``flight``).

    Raises:
        SpecError: a movement launched ahead holds some of ``arrays`` but is not this one.
    """
    out = list(arrays)
    if not arrays:
        return out
    if summing:
        ahead = _flight.claim(arrays, layouts, precision)
        if ahead is not None:
            return _land(ahead, arrays, layouts, precision)
    move: Any = _autograd.move_summing if summing else _autograd.move
    if precision is not None:
        move = functools.partial(_autograd.move_cast, precision=precision, summing=summing)
    backend = arrays[0]._backend  # pyright: ignore[reportPrivateUsage]  # the slots, not the properties: a tree is many
    if list(map(_BACKEND, arrays)).count(backend) != len(arrays):  # in C: the common case, one backend for all
        return _per_backend(arrays, layouts, summing, precision)  # arrays of several backends: each backend's apart
    # Whether a backward may sum copies (a prefetch launches ahead under no_grad, so not grad mode): it decides
    # how one process packs; across processes every tree packs flat anyway, and nothing is asked per leaf.
    sums = summing and not backend.spans_processes and any(a.requires_grad for a in arrays)
    recipe = recipe_of(tuple(map(_LAYOUT, arrays)), tuple(layouts), tuple(map(_DTYPE, arrays)), backend, sums)
    prior = set_moving_tree(recipe.tree) if recipe.tree else 0  # in each movement's header: ranks that differ raise
    try:
        for k in recipe.alone:
            a = arrays[k]
            data, link = move(a.layout, layouts[k], backend, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]
            out[k] = ShardedArray._of(layouts[k], data, backend, _dtype(a, precision), link)  # pyright: ignore[reportPrivateUsage]
        for group in recipe.fused:
            _move_flat(group, arrays, layouts, move, out, precision)
    finally:
        if recipe.tree:
            set_moving_tree(prior)
    movements = len(recipe.alone) + len(recipe.fused)
    if precision is not None:  # the arrays in place still change dtype: a cast each, nothing sent
        for k, a in enumerate(arrays):
            if a.layout == layouts[k] and precision.casts(a.dtype):
                data, link = move(a.layout, a.layout, backend, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]
                out[k] = ShardedArray._of(a.layout, data, backend, _dtype(a, precision), link)  # pyright: ignore[reportPrivateUsage]
                movements += 1
    return _together(arrays, out, movements)


def _together(arrays: Sequence[ShardedArray], out: list[ShardedArray], movements: int) -> list[ShardedArray]:
    """``out`` behind one node (``autograd.together``) where the tree took several movements that record gradients.

    So the backward of each runs wherever any of them has a gradient (on every rank alike,
    whichever leaves a rank used), and a leaf no use reached gets zeros on every backend,
    as those of one flat movement do. One movement (a tree of one flat array) needs none.
    """
    if movements < 2 or not torch.is_grad_enabled():
        return out
    made = [k for k, (a, b) in enumerate(zip(arrays, out)) if b is not a and b.requires_grad]
    if len(made) < 2:
        return out
    if torch._C._are_functorch_transforms_active():  # pyright: ignore[reportPrivateUsage]  # no public check
        return out
    tensors = [t for k in made for t in (out[k].addressable_data or (out[k]._first(),))]  # pyright: ignore[reportPrivateUsage]
    views = iter(_autograd.together(tensors))
    for k in made:
        b = out[k]
        shards = tuple(next(views) for _ in b.addressable_data)
        link = shards[0] if shards else next(views)  # where it holds no shard: its link
        out[k] = ShardedArray._of(b.layout, shards, b.backend, b.dtype, link)  # pyright: ignore[reportPrivateUsage]
    return out


def launch_tree(arrays: Sequence[ShardedArray], layouts: Sequence[Layout], precision: Any = None) -> _flight.Launches:
    """Starts ``move_tree(arrays, layouts, summing=True, precision=precision)``; its plans stay in flight."""
    with _flight.launching() as launches:
        move_tree(arrays, layouts, summing=True, precision=precision)
    return launches


def _land(
    ahead: _flight.Pending, arrays: Sequence[ShardedArray], layouts: Sequence[Layout], precision: Any
) -> list[ShardedArray]:
    """``move_tree`` of ``arrays`` (summing), landing ``ahead``: its sources in its order, results in ``arrays``'."""
    with _flight.landing(ahead.launches):
        moved = move_tree(ahead.sources, ahead.layouts, summing=True, precision=precision)
    at = {id(a): k for k, a in enumerate(ahead.sources)}
    return [moved[at[id(a)]] for a in arrays]


def _dtype(a: ShardedArray, precision: Any) -> torch.dtype:
    """The dtype of ``a`` after a movement with ``precision`` (``None``: its own)."""
    return a.dtype if precision is None else precision.forward_dtype(a.dtype)


def _per_backend(
    arrays: Sequence[ShardedArray], layouts: Sequence[Layout], summing: bool, precision: Any
) -> list[ShardedArray]:
    out = list(arrays)
    by: dict[Any, list[int]] = {}
    for k, a in enumerate(arrays):
        by.setdefault(a.backend, []).append(k)
    for ks in by.values():
        moved = move_tree([arrays[k] for k in ks], [layouts[k] for k in ks], summing=summing, precision=precision)
        for k, a in zip(ks, moved):
            out[k] = a
    return out


def _move_flat(
    group: Fused,
    arrays: Sequence[ShardedArray],
    layouts: Sequence[Layout],
    move: Any,
    out: list[ShardedArray],
    precision: Any = None,
) -> None:
    """Runs one movement of several leaves: packs its parts, moves them, and hands each leaf its shards."""
    members = list(map(arrays.__getitem__, group.leaves))
    backend = members[0]._backend  # pyright: ignore[reportPrivateUsage]
    data: list[torch.Tensor] = []
    for part in group.parts:
        shards = list(map(_DATA, map(arrays.__getitem__, part.leaves)))
        if part.dim is None:
            data.extend(t.reshape(-1) for t in shards[0])
        else:  # one stacked tensor per shard held here: torch.stack packs the leaves in one copy
            stacked = (torch.stack(ts, part.dim) for ts in zip(*shards))
            data.extend(t.reshape(-1) for t in stacked) if group.flat else data.extend(stacked)
    # What no_sync keys on: the shards, or the link of an array that holds none here, of the leaves that take
    # a gradient. Those are the same at every micro-batch, where the others may be new arrays (a module's
    # buffers, updated by each forward). Where every leaf holds shards here and all or none take a gradient
    # (a tree of parameters, or of values), that is every shard: found in C, without a call per leaf.
    held = list(map(_DATA, members))
    mixed, keys = True, ()
    if all(held):
        keys = tuple(itertools.chain.from_iterable(held))
        needs = list(map(_REQUIRES_GRAD, keys))
        mixed = any(needs) and not all(needs)
    if mixed:
        keyed = [a for a in members if a.requires_grad] or members
        keys = tuple(itertools.chain.from_iterable(a._data or (a._first(),) for a in keyed))  # pyright: ignore[reportPrivateUsage]
    with _accumulate.sources(keys), _autograd.packed(members):
        moved, link = move(group.src, group.dst, backend, tuple(data), _like(members))
    at = 0
    for part in group.parts:
        got = moved[at : at + len(part.sizes)]
        at += len(part.sizes)
        if part.dim is None:
            (k,) = part.leaves
            shards = tuple(t.view(s) for t, s in zip(got, part.sizes))
            out[k] = ShardedArray._of(layouts[k], shards, backend, _dtype(arrays[k], precision), link)  # pyright: ignore[reportPrivateUsage]
            continue
        # Each stacked shard back as the leaves' shards: views (a copy first where the stack is not dim 0).
        if part.dim == 0:
            per_shard = [t.view(s).unbind(0) for t, s in zip(got, part.sizes)]
        else:
            per_shard = [t.view(s).movedim(part.dim, 0).contiguous().unbind(0) for t, s in zip(got, part.sizes)]
        to = map(layouts.__getitem__, part.leaves)
        if per_shard:  # fit by construction; the dtype theirs, as _of takes it
            made = ShardedArray._many(to, zip(*per_shard), backend, got[0].dtype)  # pyright: ignore[reportPrivateUsage]
        else:
            dtype = _dtype(arrays[part.leaves[0]], precision)
            made = [ShardedArray._of(x, (), backend, dtype, link) for x in to]  # pyright: ignore[reportPrivateUsage]
        for k, a in zip(part.leaves, made):
            out[k] = a
    if mixed and link.requires_grad:  # a leaf that needs no gradient, moved beside ones that do: its result needs none
        for k, a in zip(group.leaves, members):
            if not a.requires_grad:
                b = out[k]
                shards = tuple(t.detach() for t in b._data)  # pyright: ignore[reportPrivateUsage]
                out[k] = ShardedArray._of(b.layout, shards, backend, b.dtype, link.detach())  # pyright: ignore[reportPrivateUsage]


def regroup_tree(arrays: Sequence[ShardedArray], mode: str, precision: Any = None) -> list[ShardedArray]:
    """``autograd.regroup`` of every array that has copies and needs a gradient, one per dtype.

    The backward of ``"sum"`` reduces the copies of every array of a dtype in one movement.
    With a ``precision`` (``"sum"`` only), every array is cast to its forward dtype, and
    the copies' gradients are summed in its reduce dtype.
    """
    out = list(arrays)
    needs = [a.requires_grad and a.layout.partial is None and has_copies(a.layout) for a in arrays]
    for group in _groups(arrays, needs):
        leaves = [arrays[k] for k in group]
        backend = leaves[0].backend
        layouts = tuple(a.layout for a in leaves)
        data = tuple(t for a in leaves for t in a.addressable_data)
        # Sums in one node for the tree: in one process, as the buckets do across processes.
        summing = mode == "sum" and not torch._C._are_functorch_transforms_active()  # pyright: ignore[reportPrivateUsage]  # no public check
        whole = None
        if summing and not backend.spans_processes:
            counts = tuple(len(a.addressable_data) for a in leaves)
            whole = _autograd.sum_tree(layouts, backend, counts, data, _like(leaves), precision)
        elif summing:
            whole = _buckets.sum_in_buckets(layouts, backend, data, _like(leaves), precision)
        if whole is None and not backend.spans_processes:  # under a transform: one node per array
            for k, a in zip(group, leaves):
                shards, link = _regroup(a.layout, backend, mode, a.addressable_data, a._first(), precision)  # pyright: ignore[reportPrivateUsage]
                out[k] = ShardedArray(a.layout, shards, backend, _dtype(a, precision), link)
            continue
        if whole is not None:  # the blocks as they come (across processes, the function's uses are tapped)
            flat, link = whole
            counts = [len(a._data) for a in leaves]  # pyright: ignore[reportPrivateUsage]  # the slots: a hot path
            if flat and all(counts):  # every array holds shards here: made in one loop
                ends = list(itertools.accumulate(counts, initial=0))
                parts = (tuple(flat[i:j]) for i, j in itertools.pairwise(ends))
                made = ShardedArray._many((a.layout for a in leaves), parts, backend, flat[0].dtype)  # pyright: ignore[reportPrivateUsage]
                for k, a in zip(group, made):
                    out[k] = a
                continue
        else:
            # What no_sync keys on: the blocks held here; where there are none, the first array's link (the same
            # at every micro-batch, where the tensor that stands for the group may be made afresh: ``_like``).
            with _accumulate.sources(data or (leaves[0]._first(),)):  # pyright: ignore[reportPrivateUsage]
                flat, link = _regroup(
                    _bucket_plan.box_layout(layouts),
                    backend,
                    mode,
                    tuple(t.reshape(-1) for t in data),
                    _like(leaves),
                    precision,
                )
        at = 0
        for k, a in zip(group, leaves):
            n = len(a.addressable_data)
            shards = (
                flat[at : at + n]
                if whole is not None
                else tuple(f.view(t.shape) for f, t in zip(flat[at:], a.addressable_data))
            )
            at += n
            out[k] = ShardedArray._of(a.layout, tuple(shards), backend, _dtype(a, precision), link)  # pyright: ignore[reportPrivateUsage]  # a's shapes
    if precision is not None:  # the others only change dtype: a cast each, nothing sent
        for k, a in enumerate(arrays):
            if not needs[k] and precision.casts(a.dtype):
                first = a._first()  # pyright: ignore[reportPrivateUsage]  # package-internal
                data, link = _autograd.move_cast(a.layout, a.layout, a.backend, a.addressable_data, first, precision)
                out[k] = ShardedArray._of(a.layout, data, a.backend, _dtype(a, precision), link)  # pyright: ignore[reportPrivateUsage]
    return out


def move_arguments(
    arrays: Sequence[ShardedArray],
    targets: Sequence[Layout | None],
    precisions: Sequence[Any],
    moved: Callable[[Sequence[ShardedArray], Sequence[Layout], Sequence[ShardedArray], Any], None] | None = None,
) -> list[ShardedArray]:
    """``shard_map``'s arguments moved to ``targets`` (``None``: in place), each in its precision (``None``: none).

    The gradients of a replicated argument's copies are summed (by the backward of its
    movement, else by a regroup), in the reduce dtype of its precision; the arguments of one
    precision (and dtype) move as one tree, and ``moved`` (if given) is told of each such
    movement: its sources, targets, results and precision.
    """
    out = list(arrays)
    for precision in dict.fromkeys(precisions):  # each distinct precision once, in order
        mine = [k for k, p in enumerate(precisions) if p == precision]
        moving = [k for k in mine if targets[k] is not None and targets[k] != arrays[k].layout]
        to = [cast(Layout, targets[k]) for k in moving]
        sources = [arrays[k] for k in moving]
        results = move_tree(sources, to, summing=True, precision=precision)
        if moved is not None:
            moved(sources, to, results, precision)
        for k, a in zip(moving, results):
            out[k] = a
        went = set(moving)
        staying = [k for k in mine if k not in went]
        for k, a in zip(staying, regroup_tree([arrays[k] for k in staying], "sum", precision)):
            out[k] = a
    return out


def _regroup(
    layout: Layout, backend: Any, mode: str, tensors: Sequence[torch.Tensor], like: torch.Tensor, precision: Any
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``autograd.regroup``, or with a ``precision`` (mode ``"sum"``) the cast whose backward sums the copies."""
    if precision is None:
        return _autograd.regroup(layout, backend, mode, tensors, like)
    return _autograd.move_cast(layout, layout, backend, tensors, like, precision, summing=True)
