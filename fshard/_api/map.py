"""Per-placement computation: ``map_local`` over aligned layouts and ``shard_map``.

A *slot* is one block of a placement: ``(placement, k)`` for the k-th shard (in layout
order) that a placement holds. Arrays align when every placement holds the same
number of shards of each; ``fn`` runs once per slot on the slot's blocks, and each
result leaf is laid out by its ``out_spec``: the output layout's k-th shard on a
placement is the result of that placement's k-th call.

Gradients follow one rule on every backend: a replicated value's gradient is the sum
of its uses. Where aligned arrays differ in how they replicate, a replicated argument's
copies feed computations that differ per copy, so the gradients of its copies are
summed (and every copy gets the total), and a replicated result's copies share its
gradient (each counts 1/copies), which together give the exact gradient by linearity.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import types
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, cast

import numpy as np
import optree
import torch

from fshard._api import map_trees as _trees
from fshard._api import psum as _psum
from fshard._api.move import check_plain, check_tensor, resolved, split_replicas
from fshard._api.shard import shard
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import opaque, with_body
from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec import body as _body
from fshard._exec import buckets as _buckets
from fshard._exec import fused as _fused
from fshard._exec import gathered as _varying
from fshard._exec import regather as _regather
from fshard._exec.agree import (
    agree,
    agree_alike,
    describe_results,
    holds_nothing_somewhere,
    link_without_blocks,
    merge_results,
    post_failure,
    post_outcome,
    tree_kinds,
    untouched,
)
from fshard._exec.collective import collective
from fshard._exec.replicas import check_leaves, checking
from fshard._layout.layout import Layout, ShardMeta, replica_ids, with_partial, with_terms
from fshard._layout.placement import Placement
from fshard._layout.precision import check_floating, per_argument
from fshard._layout.specs import Explicit, Partial, Replicated, as_layout

__all__ = ["check_out_specs", "map_local", "map_same", "named_shard_map", "regrouped", "shard_map"]

Slot = tuple[Placement, int]
_PROBE = 1 << 20  # an extent at which every part of a spec is non-empty


def _arg(name: int | str) -> str:
    """An argument as messages name it: by position, or by the label a caller gave it."""
    return name if isinstance(name, str) else f"argument {name}"


@with_body  # fn is compiled where the caller is
@collective("map_local")
def map_local(
    fn: Callable[..., Any], *arrays: ShardedArray, out_spec: Any = None, linear: bool = False
) -> ShardedArray | Any:
    """Applies ``fn`` to corresponding local shards of arrays.

    Arrays that share a layout pair shard by shard; a shape-preserving ``fn`` keeps the
    layout, and if ``fn`` resizes only dims that no shard splits the new global shape
    is inferred. Arrays of different layouts (or shapes) pair placement by placement
    (each placement must hold the same number of shards of each, paired in layout
    order), and then ``out_spec`` is required: a spec or ``Layout``, or a pytree of
    them matching ``fn``'s result (a tuple of tensors, say), which is then a pytree of
    arrays.

    Args:
        fn: a function of one tensor per array, returning a tensor or a pytree of them.
        arrays: the ``ShardedArray`` arguments.
        out_spec: the result's spec(s); the global shape is inferred from the blocks.
        linear: ``fn`` is linear in its pending-sum (``Partial``) arguments, so it may run
            on their summands; the result is then a pending sum too.

    Raises:
        SpecError: an argument is a pending reduction and ``linear`` is not set, arrays
            do not align, or the results do not fit ``out_spec``.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.ones(4, 2), fshard.Chunk(0, [0, 1]))
    >>> y = fshard.map_local(lambda t: torch.cat([t, 2 * t], dim=1), x)
    >>> tuple(y.shape), fshard.gather(y)[0].tolist()
    ((4, 4), [1.0, 1.0, 2.0, 2.0])
    """
    if not callable(fn):
        raise TypeError(f"map_local() fn must be callable, got {type(fn).__name__}.")
    if not isinstance(linear, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"map_local() linear must be a bool, got {linear!r} ({type(linear).__name__}).")
    if not arrays:
        raise TypeError("map_local() needs at least one ShardedArray.")
    for k, a in enumerate(arrays):
        if not isinstance(a, ShardedArray):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
            raise TypeError(f"map_local() argument {k} takes a ShardedArray, got {type(a).__name__}.")
        a._first()  # pyright: ignore[reportPrivateUsage]  # raises for a tree map's container of other leaves
    _check_backends(arrays, "map_local()")
    pending = _check_partial(arrays, linear)
    _check_terms(arrays)
    base = with_partial(arrays[0].layout, None)
    if out_spec is None and all(with_partial(a.layout, None) == base for a in arrays):
        if pending is not None and any(a.layout.partial is None and a.requires_grad for a in arrays):
            # fn runs on each summand: a replicated argument's copies each meet another summand
            # (p * v), so its gradient is the sum of theirs, as shard_map's arguments' are (_run).
            # Replicas of one summand (Layout.terms) would count it once per replica: each copy
            # becomes a summand of its own first, as the operators' linear maps do.
            arrays = tuple(_fused.regroup_tree([split_replicas(a) for a in arrays], "sum"))
        return map_same(fn, arrays, pending)
    if out_spec is None:
        k = next(k for k, a in enumerate(arrays) if with_partial(a.layout, None) != base)
        msg = (
            f"map_local() arguments 0 and {k} have different layouts; pass out_spec= for the result "
            f"(the arrays then pair placement by placement), or reshard argument {k} first: "
            "fshard.reshard(x, other.layout)."
        )
        raise SpecError(msg)
    return _run(fn, arrays, (), out_spec, pending, one_block=False, what="map_local()")


@with_body  # fn is compiled where the caller is
def shard_map(
    fn: Callable[..., Any],
    in_specs: Any,
    out_specs: Any,
    *,
    check_vma: bool = True,
    precision: Any = None,
    regather: bool = False,
) -> Callable[..., Any]:
    """Turns a function of blocks into a function of sharded arrays.

    The returned function reshards each array argument to its entry of ``in_specs``
    (nothing moves when it is there already) and shards each tensor argument (a tensor
    present on every rank) by it; an entry of ``None`` passes a non-tensor argument
    (a number, say) to ``fn`` unchanged. ``fn`` then runs once per placement on that
    placement's blocks, and its results are wrapped as ``out_specs`` (a spec, a
    ``Layout`` or a pytree of them; ``Partial`` for results that are partial sums,
    such as a row-parallel matmul's). Differentiable, also under ``torch.func``.
    ``fn`` may reduce over mesh axes inside with ``fshard.psum``/``fshard.pmean``; on
    the local backend the bodies of a call that does run concurrently, a thread each.

    A result is known to be equal on two placements only where every argument gives them
    the same block (copies of one box): an ``out_specs`` that makes such a result's
    copies replicas where an argument differs between them is refused, since the array
    would hold replicas that disagree (JAX's replication check).

    Args:
        fn: a function of one block per argument, returning a tensor or a pytree of them.
        in_specs: one spec per positional argument (a single spec when there is one). An
            argument may be a pytree of arrays and tensors (a dict of parameters, say): its
            entry is one spec for every leaf, or a tree of specs that is a prefix of it, and
            ``fn`` gets the same structure with blocks in place of the arrays.
        out_specs: the results' specs; each global shape is inferred from the blocks.
        check_vma: refuse ``out_specs`` that claim replicas the arguments do not imply.
            ``False`` trusts ``fn`` to return equal results on the claimed copies (for a
            result that ignores the arguments that differ there); check mode
            (``fshard.config(check_collectives=True)``) still compares their contents.
        precision: an ``fshard.Precision`` for every argument, or a tuple of them (``None``
            for an argument left alone) matching ``in_specs``: each argument moves to its
            spec in its precision's ``param`` dtype (the blocks ``fn`` gets have it), and
            its gradient is moved and summed in the ``reduce`` dtype, then returned in the
            argument's own dtype (docs/training.md, "Mixed precision").
        regather: the arguments that move (a fully-sharded block's parameters, gathered) are
            not kept for the backward: their moved copies are freed when ``fn`` returns, and
            the backward moves them again (in their precision's ``param`` dtype, if given),
            all in one movement, when it first needs them (FSDP2's ``reshard_after_forward``).
            Values and gradients are bit-identical.

    Raises:
        SpecError: an argument's spec gives a placement zero or several blocks, a tree of
            specs does not fit its argument, the results do not fit ``out_specs``, or
            ``out_specs`` claims a replication
            that the arguments contradict; with ``regather``, some rank runs no ``fn``
            (it could not take part in the movement again), or an argument's shards
            were written in place before the backward.

    >>> import torch, fshard
    >>> ranks = [0, 1]
    >>> x, w = torch.randn(4, 6), torch.randn(6, 3)
    >>> matmul = fshard.shard_map(
    ...     lambda xb, wb: xb @ wb,
    ...     in_specs=(fshard.Chunk(1, ranks), fshard.Chunk(0, ranks)),
    ...     out_specs=fshard.Partial(fshard.Replicated(ranks)),
    ... )
    >>> y = matmul(x, w)
    >>> y.layout.partial, torch.allclose(fshard.gather(y), x @ w, atol=1e-6)
    ('sum', True)
    """
    return named_shard_map(fn, in_specs, out_specs, check_vma=check_vma, precision=precision, regather=regather)


def named_shard_map(
    fn: Callable[..., Any],
    in_specs: Any,
    out_specs: Any,
    *,
    check_vma: bool = True,
    precision: Any = None,
    regather: bool = False,
    what: str = "shard_map()",
    labels: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """``shard_map``, whose errors name it ``what`` and its arguments by ``labels`` (one per in_spec).

    For a caller that builds the ``shard_map`` from arguments of its own (``apply_module``): its
    errors then name what that caller's user passed.
    """
    if not callable(fn):
        raise TypeError(f"{what} fn must be callable, got {type(fn).__name__}.")
    if not isinstance(check_vma, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"{what} check_vma must be a bool, got {check_vma!r} ({type(check_vma).__name__}).")
    if not isinstance(regather, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"{what} regather must be a bool, got {regather!r} ({type(regather).__name__}).")

    specs = tuple(cast("Sequence[Any]", in_specs)) if isinstance(in_specs, (tuple, list)) else (in_specs,)
    reducing = Reducing(specs, fn)
    precisions = per_argument(precision, len(specs), what)

    # The targets of a call whose arguments with a spec are all arrays are cached on those specs.
    given = [k for k, s in enumerate(specs) if s is not None]  # the positions with a spec
    plain = [k for k, s in enumerate(specs) if s is None]  # passed to fn as they are
    specs_key = _SpecsKey.of([specs[k] for k in given]) if given else None

    by_structure: dict[Any, Callable[..., Any]] = {}  # per structure of tree arguments: the shard_map of the leaves

    def of_leaves(args: tuple[Any, ...], key: Any, flat: tuple[Any, ...], trees: _trees.Trees) -> Any:
        """The call where some argument is a pytree of arrays: the ``shard_map`` of its leaves (``map_trees``)."""
        inner = by_structure.get(key)
        if inner is None:
            how = _trees.describe(args, trees, specs, precisions, labels, what)
            if len(by_structure) >= 64:  # a program that passes ever new structures: made again as needed
                by_structure.clear()
            inner = by_structure[key] = named_shard_map(
                how.function(fn), how.specs, out_specs, check_vma=check_vma, precision=how.precisions,
                regather=regather, what=what, labels=how.labels,
            )  # fmt: skip
        return inner(*flat)

    @collective(f"shard_map[{getattr(fn, '__qualname__', type(fn).__name__)}]")
    def call(*args: Any) -> Any:
        if len(specs) != len(args):
            msg = f"shard_map() got {len(args)} arguments but in_specs has {len(specs)} entries: give one per argument."
            raise SpecError(msg)
        backend = next((a.backend for a in args if isinstance(a, ShardedArray)), None)
        arrays: list[tuple[int, ShardedArray]] = []
        targets: list[Layout | None] = []  # where each array argument moves (None: a tensor, sharded there)
        extras: list[tuple[int, Any]] = []
        if (
            specs_key is not None
            and all(type(args[k]) is ShardedArray and args[k].backend is backend for k in given)
            and not any(isinstance(args[k], (torch.Tensor, ShardedArray)) for k in plain)
        ):
            # Every argument with a spec an array of one backend: their targets resolved and checked once per
            # tuple of layouts (a tree's leaves, with the call's treedefs as its last argument, come here).
            arrays = [(k, args[k]) for k in given]
            extras = [(k, args[k]) for k in plain]
            targets = list(_targets(specs_key, backend, tuple(a.layout for _, a in arrays)))
        elif any(spec is not None and not _trees.is_array(a) for a, spec in zip(args, specs)):
            key, flat, trees = _trees.flatten(args, specs)  # a container argument: its leaves
            if any(k is not None for k in key):
                return of_leaves(args, key, flat, trees)
        for k, (a, spec) in enumerate(() if arrays else zip(args, specs)):
            if spec is None:
                if isinstance(a, (torch.Tensor, ShardedArray)):
                    msg = f"shard_map() argument {k} is a {type(a).__name__} but its in_spec is None: give it a spec."
                    raise SpecError(msg)
                extras.append((k, a))
            elif isinstance(a, ShardedArray):
                arrays.append((k, a))
                targets.append(_target(a, spec))
            elif isinstance(a, torch.Tensor):
                arrays.append((k, shard(a, spec, backend=backend)))
                targets.append(None)
            else:
                msg = (
                    f"shard_map() argument {k} is a {type(a).__name__}: give a ShardedArray, a tensor or a "
                    "pytree of them (a tuple, list or dict), or in_spec None."
                )
                raise SpecError(msg)
        if not arrays:
            raise SpecError("shard_map() needs at least one array or tensor argument with a spec.")
        _check_backends(tuple(a for _, a in arrays), what)
        order: list[int | str] = [k if labels is None else labels[k] for k, _ in arrays]
        values = _arguments(arrays, targets, precisions, regather, what, labels)
        pending = _check_partial(values, linear=False, what=what, names=order)

        def block_fn(*blocks: torch.Tensor) -> Any:
            full: list[Any] = [None] * len(args)
            for (k, _), b in zip(arrays, blocks):
                full[k] = b
            for k, v in extras:
                full[k] = v
            return fn(*full)

        return _run(
            block_fn,
            values,
            order,
            out_specs,
            pending,
            one_block=True,
            what=what,
            check=check_vma,
            grouped=True,
            reducing=reducing,
        )

    return call


@opaque  # layout arithmetic in numpy: run eagerly under torch.compile
def _target(a: ShardedArray, spec: Any) -> Layout:
    """The layout that argument ``a`` moves to, checked against its backend."""
    return _target_of(a.layout, spec, a.backend)


def _target_of(layout: Layout, spec: Any, backend: Any) -> Layout:
    target = as_layout(spec, layout.shape)
    if target != layout:
        backend.check_layout(target)
    return target


class _SpecsKey:
    """A ``shard_map``'s in_specs as a cache key: hashed once, when the ``shard_map`` is made."""

    __slots__ = ("_hash", "specs")

    def __init__(self, specs: tuple[Any, ...], hashed: int) -> None:
        self.specs, self._hash = specs, hashed

    @classmethod
    def of(cls, specs: Sequence[Any]) -> _SpecsKey | None:
        """The key of ``specs``; ``None`` where one of them cannot be hashed (nothing is cached then)."""
        try:
            return cls(tuple(specs), hash(tuple(specs)))
        except TypeError:
            return None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _SpecsKey) and self.specs == other.specs)


@cached(256)
@opaque  # layout arithmetic in numpy: run eagerly under torch.compile
def _targets(specs: _SpecsKey, backend: Any, layouts: tuple[Layout, ...]) -> tuple[Layout, ...]:
    """The layouts that arguments of ``layouts`` move to under ``specs``, checked against ``backend``."""
    return tuple(_target_of(x, spec, backend) for x, spec in zip(layouts, specs.specs))


@opaque  # plans and layouts in numpy: run eagerly under torch.compile
def _arguments(
    arrays: Sequence[tuple[int, ShardedArray]],
    targets: Sequence[Layout | None],
    precisions: Sequence[Any],
    regather: bool = False,
    what: str = "shard_map()",
    labels: Sequence[str] | None = None,
) -> tuple[ShardedArray, ...]:
    """The arguments (``(position, array)``) in their ``in_specs``, each ready for use copy by copy.

    A replicated argument's copies feed computations that differ per copy, so the gradients
    of its copies are summed: by the backward of its movement where it moves (a
    reduce-scatter into a split source), else by a regroup; the arguments of one precision
    move as one tree, one collective per dtype (``fused.move_arguments``). Argument ``k``
    moves in ``precisions[k]``; a non-floating one with a precision raises. ``regather``:
    the moved copies are a group that the backward moves again rather than keeps
    (``fshard._exec.regather``).
    """
    for k, a in arrays:
        check_floating(precisions[k], a.dtype, f"{what} {_arg(k if labels is None else labels[k])}")
    values = [a for _, a in arrays]
    if regather:  # before anything moves: every rank refuses alike
        moving = (x for a, x in zip(values, targets) if x is not None and x != a.layout)
        for layout in dict.fromkeys(moving):
            _check_regather(values[0].backend, layout)

    def moved(sources: Sequence[ShardedArray], layouts: Sequence[Layout], out: Sequence[ShardedArray], p: Any) -> None:
        if regather and sources:
            _regather.register(sources, layouts, out, "shard_map()", p)

    return tuple(_fused.move_arguments(values, targets, [precisions[k] for k, _ in arrays], moved))


# -- checks -------------------------------------------------------------------------------


def _check_regather(backend: Any, layout: Layout) -> None:
    """Refuses ``regather=True`` where some rank holds no block (it runs no fn, and no movement again)."""
    empty = _blockless(backend, layout)
    if empty:
        msg = (
            f"shard_map() regather=True: ranks {empty} hold no block of the arguments, so they run no fn and "
            "cannot take part in the movement that gathers the arguments again in the backward. Lay the "
            "arguments out over every rank of the group, or pass regather=False."
        )
        raise SpecError(msg)


def _check_backends(arrays: Sequence[ShardedArray], what: str) -> None:
    """Refuses arrays of different backends, and a call from a rank outside its backend's process group.

    Such a rank holds no block and takes no part in the group's exchanges, so it could not
    learn what ``fn`` returned there (nor that it raised): it raises, as a movement does.
    """
    first = arrays[0].backend
    if not getattr(first, "member", True):
        msg = (
            f"{what}: rank {first.rank} is not in this array's process group; call collective fshard "
            "functions on it only from ranks of its group (if dist.get_rank() in ranks: ...)."
        )
        raise SpecError(msg)
    for k, a in enumerate(arrays):
        if a.backend is not first and a.backend != first:
            msg = f"{what} arguments 0 and {k} live on different backends ({first!r} and {a.backend!r})."
            raise SpecError(msg)


def _check_partial(
    arrays: Sequence[ShardedArray], linear: bool, what: str = "map_local()", names: Sequence[int | str] = ()
) -> str | None:
    """The pending op the result carries (``"sum"`` for a linear map of partial sums), or ``None``."""
    for k, a in enumerate(arrays):
        op = a.layout.partial
        if op is None:
            continue
        name = _arg(names[k] if names else k)
        if not linear:
            # Only map_local takes linear=; shard_map's fn reduces inside with fshard.psum instead.
            linear_too = ""
            if what == "map_local()":
                linear_too = ", or pass linear=True if fn is linear in its partial arguments"
            msg = (
                f"{what} {name} is a pending {op} (Partial): fn would run on its summands, not on its value. "
                f"Reshard it to a non-partial spec first (fshard.reshard(x, spec) reduces it){linear_too}."
            )
            raise SpecError(msg)
        if op != "sum":
            msg = (
                f"{what} {name} is a pending {op}: linear=True applies to pending sums only; "
                "reshard it to a non-partial spec first."
            )
            raise SpecError(msg)
    return "sum" if any(a.layout.partial for a in arrays) else None


def _check_terms(arrays: Sequence[ShardedArray]) -> None:
    """Raises unless the pending arguments hold their summands alike (``Layout.terms``)."""
    pending = [(k, a.layout.terms) for k, a in enumerate(arrays) if a.layout.partial is not None]
    for k, terms in pending[1:]:
        first = pending[0][1]
        if (terms is None) != (first is None) or (
            terms is not None and first is not None and terms.tobytes() != first.tobytes()
        ):
            msg = (
                f"map_local() arguments {pending[0][0]} and {k} are pending sums whose copies are summands in "
                "different ways (Layout.terms): reshard one to the other's layout first, "
                "fshard.reshard(x, other.layout)."
            )
            raise SpecError(msg)


# -- slots ----------------------------------------------------------------------------------


@cached(256)
def _slots(layout: Layout) -> dict[Placement, tuple[int, ...]]:
    """Shard indices per placement, placements in order of first appearance."""
    out: dict[Placement, list[int]] = {}
    for i, s in enumerate(layout.shards):
        out.setdefault(s.placement, []).append(i)
    return {p: tuple(v) for p, v in out.items()}


def _check_aligned(arrays: Sequence[ShardedArray], names: Sequence[int | str], one_block: bool, what: str) -> None:
    _aligned(tuple(a.layout for a in arrays), tuple(names), one_block, what)


@cached(256)
def _aligned(layouts: tuple[Layout, ...], names: tuple[int | str, ...], one_block: bool, what: str) -> bool:
    """``True``, or ``SpecError``: checked once per tuple of layouts."""
    first = _slots(layouts[0])
    for k, layout in zip(names, layouts):
        mine = _slots(layout)
        if one_block:
            bad = next((p for p, v in mine.items() if len(v) != 1), None)
            if bad is not None:
                msg = (
                    f"{what} {_arg(k)}: its spec gives placement {bad} {len(mine[bad])} blocks; fn runs once per "
                    "placement, so every argument's spec must give each placement exactly one block."
                )
                raise SpecError(msg)
            lacking = next(((p, k) for p in first if p not in mine), None) or next(
                ((p, names[0]) for p in mine if p not in first), None
            )
            if lacking is not None:
                p, without = lacking
                other = names[0] if without == k else k
                msg = (
                    f"{what} {_arg(without)} has no block on placement {p}, where {_arg(other)} has one: fn runs "
                    "once per placement, so every argument's spec must give the same placements exactly one block "
                    "each (give every argument's spec the placements of the first one's)."
                )
                raise SpecError(msg)
        elif {p: len(v) for p, v in mine.items()} != {p: len(v) for p, v in first.items()}:
            msg = (
                f"{what} {_arg(k)} does not align with {_arg(names[0])}: shards per placement "
                f"{_counts(mine)} against {_counts(first)}. Aligned arrays hold the same number of shards "
                "of each on every placement; reshard one of them first."
            )
            raise SpecError(msg)
    return True


def _counts(slots: dict[Placement, tuple[int, ...]]) -> str:
    return "{" + ", ".join(f"{p}: {len(v)}" for p, v in slots.items()) + "}"


# -- running ----------------------------------------------------------------------------------


def _run(
    fn: Callable[..., Any],
    arrays: Sequence[ShardedArray],
    names: Sequence[int | str],
    out_specs: Any,
    pending: str | None,
    *,
    one_block: bool,
    what: str,
    check: bool = True,
    grouped: bool = False,
    reducing: Reducing | None = None,
) -> Any:
    names = list(names) or list(range(len(arrays)))  # positions, or the caller's labels
    _check_aligned(arrays, names, one_block, what)
    backend = arrays[0].backend
    first = arrays[0].layout
    # A replicated argument's copies may feed computations that differ per copy: sum their gradients
    # (``grouped``: the caller has).
    inputs = list(arrays) if grouped else _fused.regroup_tree(arrays, "sum")
    held = backend.addressable(first)
    slot_of = _slot_index(first)

    usage = _varying.Usage()
    own = [t for a in inputs for t in a.addressable_data]

    def compute() -> tuple[list[dict[Slot, torch.Tensor]], Any]:
        calls: list[tuple[Slot, list[torch.Tensor]]] = []
        if one_block and len(held) == 1:  # one placement here: each argument, aligned, has its one block here
            calls.append((slot_of[held[0]], [a._data[0] for a in inputs]))  # pyright: ignore[reportPrivateUsage]
        else:
            by_index = [dict(zip(backend.addressable(a.layout), a.addressable_data)) for a in inputs]
            for i in held:
                p, k = slot_of[i]
                calls.append(((p, k), [data[_slots(a.layout)[p][k]] for a, data in zip(inputs, by_index)]))
        try:
            with untouched(own, what):
                results = _bodies(fn, calls, lambda: _per_shard(backend, usage, first, own), reducing, first, backend)
        finally:  # a tap's bucket belongs to this call: a block that outlives it (returned as it is) keeps none
            _varying.forget_taps(own)
        return _flatten_results(results, what)

    # Every process must learn the blocks' shapes (to infer a global shape) or dtypes (where
    # it holds none): they share what fn returned, or the error it raised.
    inferred = not all(_known_here(s) for s in _leaf_specs(out_specs, None, what))
    # Buckets of the arguments' gradients (across processes only): the ranks compare them below.
    series = _buckets.series_of(own) if backend.spans_processes else []
    leaves: list[dict[Slot, torch.Tensor]]
    if backend.spans_processes and (inferred or holds_nothing_somewhere(backend, first)):

        def describe(r: tuple[list[dict[Slot, torch.Tensor]], Any]) -> Any:
            return describe_results(r[1], r[0]), (usage.ages(), usage.closed), tuple(s.series for s in series)

        (leaves, spec_tree), seen, described = agree_alike(backend, compute, describe, _alike_form)
        if seen is None:  # every rank's results alike, placement for placement: nothing exchanged
            (_, found), (ages, closed), mine = described
            metas = cast("list[tuple[torch.dtype, _Alike]]", _alike_metas(found))
            _refuse_closed(backend, first, closed, what)
            used = set(ages)
            _buckets.compare_series(series, [mine], backend.ranks, what)
        else:
            merged, metas = merge_results([d for d, _, _ in seen], what)
            spec_tree = merged if merged is not None else spec_tree
            used = _used(backend, first, [u for _, u, _ in seen], what)
            _buckets.compare_series(series, [b for _, _, b in seen], backend.ranks, what)
    else:
        # No process waits for the others here: each posts what fn returned (or that it raised), and the
        # group's next collective compares them, so a process whose fn returned otherwise raises with the others.
        try:
            leaves, spec_tree = compute()
            metas = (describe_results(spec_tree, leaves) or (None, []))[1]
            _refuse_closed(backend, first, usage.closed, what)
            out = _results(
                out_specs, spec_tree, leaves, metas, set(), inputs, arrays, names, held, pending, check, what
            )
        except BaseException as exc:  # an interrupt too: the others' next collective learns of it
            if backend.spans_processes:
                post_failure(backend, what, exc)
            raise
        # Left for the backward's first collective, where every rank meets anyway (not a wait for the slowest
        # forward here); the buckets' series rides in it, so their first launch has no round of headers.
        if backend.spans_processes:
            post_outcome(backend, what, (spec_tree, metas), _buckets.agreed(series))
        return out
    return _results(out_specs, spec_tree, leaves, metas, used, inputs, arrays, names, held, pending, check, what)


def _results(
    out_specs: Any,
    spec_tree: Any,
    leaves: list[dict[Slot, torch.Tensor]],
    metas: Sequence[tuple[torch.dtype, dict[Any, tuple[int, ...]] | _Alike]],
    used: set[int],
    inputs: Sequence[ShardedArray],
    arrays: Sequence[ShardedArray],
    names: Sequence[int | str],
    held: Sequence[int],
    pending: str | None,
    check: bool,
    what: str,
) -> Any:
    """The result tree of ``_run``: each leaf's blocks in the layout its spec and their shapes give."""
    first = arrays[0].layout
    backend = arrays[0].backend
    specs = _leaf_specs(out_specs, spec_tree, what)
    if spec_tree is None:  # no slot anywhere: the structure comes from the specs
        spec_tree = _spec_structure(out_specs)
    if not leaves:
        leaves = [{} for _ in specs]
    outs: list[ShardedArray] = []
    for n, (spec, blocks) in enumerate(zip(specs, leaves)):
        dtype, shapes = metas[n] if n < len(metas) else (arrays[0].dtype, {})
        if len(blocks) > 1 and len(kinds := {t.dtype for t in blocks.values()}) > 1:  # as merge_results says it
            raise SpecError(f"{what} result {n} has dtypes {sorted(map(str, kinds))} on different ranks; return one.")
        link = None if held else link_without_blocks(inputs, dtype, used)
        layout = _out_layout(spec, shapes, first, pending, what, n)
        if check:
            _check_replicas(tuple(a.layout for a in arrays), names, layout, spec, what, n)
        outs.append(_wrap(layout, backend, blocks, link, dtype))
    if not check and checking():  # replicas that fn was trusted to make equal: compare their contents
        check_leaves([(f"result {n} of {what}", a) for n, a in enumerate(outs)], what)
    return optree.tree_unflatten(spec_tree, outs)


class Reducing:
    """What the bodies of one ``shard_map`` need to reduce inside (``psum``): its in_specs.

    ``threaded`` is set once a body of it has reduced on the local backend, where its bodies
    then run concurrently from the start; so is it for a new ``shard_map`` of a function whose
    code has reduced before (a body that a caller wraps anew at every step).
    """

    __slots__ = ("code", "specs", "threaded")

    def __init__(self, specs: Sequence[Any], fn: Callable[..., Any]) -> None:
        self.specs = tuple(specs)
        self.code = getattr(inspect.unwrap(fn), "__code__", None)
        self.threaded = self.code is not None and self.code in _REDUCED

    def reduced(self) -> None:
        """Its bodies reduce: from now on they start concurrently, and so do those of its code."""
        self.threaded = True
        if self.code is not None:
            _REDUCED.add(self.code)


_REDUCED: set[types.CodeType] = set()  # the code of bodies that reduced (one entry per function written)


def _bodies(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Slot, list[torch.Tensor]]],
    context: Callable[[], Any],
    reducing: Reducing | None,
    layout: Layout,
    backend: Any,
) -> list[tuple[Slot, Any]]:
    """``fn`` on each slot's blocks: one after another, or concurrently where a body reduces in one process."""
    if reducing is None:
        with context():
            return [(slot, fn(*blocks)) for slot, blocks in calls]
    position = _positions(layout)
    placements = tuple(position)
    mesh = _psum.body_mesh(reducing.specs, placements)
    # One after another first; a body that reduces needs them all at once (in one process), which a torch.func
    # transform cannot run: there only a body that does reduce in this call is refused. Under saved-tensor hooks
    # (a checkpoint) no body runs ahead to find out: the hooks would see tensors that its recomputation does not
    # make, so the bodies take turns in threads from the start, in the order one after another would run them.
    ahead = not reducing.threaded and not _body.under_hooks()
    if backend.spans_processes or ahead or _body.in_transform():
        try:
            out: list[tuple[Slot, Any]] = []
            with context():
                for slot, blocks in calls:
                    with _body.entered(_body.Body(placements, position[slot[0]], mesh, backend)):
                        out.append((slot, fn(*blocks)))
        except _body.NeedsThreads:
            reducing.reduced()
        else:
            return out
    if _body.in_transform():
        msg = "psum() cannot run under a torch.func transform (grad, vmap, jvp); use loss.backward() instead."
        raise SpecError(msg)
    meeting = _body.Rendezvous(placements)

    def run(slot: Slot, blocks: list[torch.Tensor]) -> Callable[[], tuple[Slot, Any]]:
        def body() -> tuple[Slot, Any]:
            with context(), _body.entered(_body.Body(placements, position[slot[0]], mesh, backend, meeting)):
                return slot, fn(*blocks)

        return body

    return _body.run_threaded([run(slot, blocks) for slot, blocks in calls], meeting)


@cached(256)
def _positions(layout: Layout) -> Mapping[Placement, int]:
    """Each placement's position among the layout's placements (in order of first appearance), read-only."""
    return MappingProxyType({p: i for i, p in enumerate(_slots(layout))})


def _per_shard(backend: Any, usage: _varying.Usage, layout: Layout, own: Sequence[torch.Tensor]) -> Any:
    """The context of ``fn``'s calls on the blocks ``own`` of arrays laid out like ``layout``.

    A tensor ``fn`` closes over gets the sum of every rank's uses as its gradient: across
    processes by a view whose backward sums over the ranks; in one process autograd sums
    them, and such tensors are only counted where some rank of a known world holds no
    block (``_refuse_closed``), so that both backends refuse alike.
    """

    def closed(t: torch.Tensor) -> torch.Tensor:
        return _autograd.summed_uses(t, layout, backend)

    if backend.spans_processes:
        return _regather.saving(_varying.per_shard(backend, usage, closed, own))
    closed_here = _unchanged if _blockless(backend, layout) else None
    return _regather.saving(_varying.per_shard(backend, usage, closed_here, own))


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


def _blockless(backend: Any, layout: Layout) -> list[int]:
    """The ranks of ``backend``'s group that hold no block of ``layout`` (a ``LocalBackend(world_size=n)``: n ranks)."""
    ranks = backend.ranks if backend.spans_processes else range(getattr(backend, "world_size", 0))
    held = set(layout.ranks)
    return [r for r in ranks if r not in held]


def _refuse_closed(backend: Any, layout: Layout, closed: int, what: str) -> None:
    """Refuses ``closed`` tensors that ``fn`` used from outside its arguments where some rank holds no block.

    That rank runs no ``fn``, so the sum of their gradients over the ranks cannot include it.

    Raises:
        SpecError: on every rank (``closed`` is every rank's largest count).
    """
    empty = _blockless(backend, layout) if closed else []
    if empty:
        msg = (
            f"{what} fn uses {closed} tensor(s) from outside its arguments that require grad (closed over), "
            f"and ranks {empty} hold no block, so they run no fn and cannot take part in summing those gradients "
            "over the ranks. Pass such tensors as arguments (a replicated spec, e.g. fshard.Replicated(ranks)), "
            "or lay the arguments out over every rank."
        )
        raise SpecError(msg)


def _used(backend: Any, layout: Layout, seen: Sequence[tuple[frozenset[int], int]], what: str) -> set[int]:
    """The gathered tensors (ages) that ``fn`` used on some rank, from every rank's usage.

    Raises:
        SpecError: on every rank, for closed-over tensors where some rank holds no block (``_refuse_closed``).
    """
    _refuse_closed(backend, layout, max((n for _, n in seen), default=0), what)
    return cast("set[int]", set().union(*(keys for keys, _ in seen)))


def _spec_structure(out_specs: Any) -> Any:
    if _trees.is_spec(out_specs):
        return optree.tree_structure(cast(Any, 0))  # a single leaf
    return optree.tree_structure(out_specs, is_leaf=_trees.is_spec, none_is_leaf=True)


def regrouped(a: ShardedArray, mode: str) -> ShardedArray:
    """``a`` itself, or with gradients of its copies summed or shared (when it has copies and needs grad)."""
    # A pending sum's replicas of a summand (Layout.terms) share a result's gradient; its summands never sum theirs.
    copies = max(_autograd._copy_counts(a.layout), default=1)  # pyright: ignore[reportPrivateUsage]
    if (mode == "sum" and a.layout.partial is not None) or not a.requires_grad or copies < 2:
        return a
    data, link = _autograd.regroup(a.layout, a.backend, mode, a.addressable_data, a._first())  # pyright: ignore[reportPrivateUsage]  # package-internal
    return ShardedArray(a.layout, data, a.backend, a.dtype, link)


@cached(256)
def _slot_index(layout: Layout) -> dict[int, Slot]:
    return {i: (p, k) for p, idx in _slots(layout).items() for k, i in enumerate(idx)}


def _flatten_results(results: list[tuple[Slot, Any]], what: str) -> tuple[list[dict[Slot, torch.Tensor]], Any]:
    """Per result leaf, its block at each slot held here; and the results' tree structure."""
    tree = None
    leaves: list[dict[Slot, torch.Tensor]] = []
    for slot, out in results:
        flat, spec = optree.tree_flatten(out)
        if tree is None:
            tree = spec
            leaves = [{} for _ in flat]
        elif spec != tree:
            raise SpecError(f"{what} fn returned {spec} on placement {slot[0]} but {tree} elsewhere.")
        for n, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise SpecError(f"{what} fn must return tensors (or a pytree of them), got a {type(t).__name__}.")
            check_plain(t, f"{what} fn result")
            leaves[n][slot] = resolved(t)
    if tree is None:  # no slot here: the structure comes from the specs
        return [], None
    return leaves, tree


def _known_here(spec: Any) -> bool:
    """Whether this rank's own blocks lay out a result of ``spec``: a ``Layout``, or a spec of full copies.

    Full copies: every placement holds the whole array (``Replicated``, ``Partial(Replicated)``).
    Where every rank holds blocks, such results need no exchange of outcomes: each rank's
    global shape is its block's, and ranks whose results differ in shape or dtype raise at
    the next movement of the array (its header names both layouts and the dtype).
    """
    if isinstance(spec, Partial):
        spec = spec.spec
    return isinstance(spec, (Layout, Replicated))


def _leaf_specs(out_specs: Any, tree: Any, what: str) -> list[Any]:
    """One spec per result leaf: ``out_specs`` broadcast (a single spec) or matched to the results' tree."""
    if _trees.is_spec(out_specs):
        return [out_specs] * (tree.num_leaves if tree is not None else 1)
    flat, given = _flat_specs(out_specs, tree)
    if tree is not None and tree.num_leaves != len(flat):
        msg = f"{what} out_specs has {len(flat)} specs but fn returned {tree.num_leaves} tensors ({tree})."
        raise SpecError(msg)
    if tree is not None:
        order = _spec_order(given, tree, what)
        if order is not None:
            flat = [flat[k] for k in order]
    return flat


def _flat_specs(out_specs: Any, tree: Any) -> tuple[list[Any], Any]:
    """``out_specs``' specs and their structure.

    A ``None`` is a spec (a hole in a sequence of specs), except where the results hold
    ``None`` at its place: then it stands for that ``None`` (``{"y": spec, "aux": None}``).
    """
    flat, given = optree.tree_flatten(out_specs, is_leaf=_trees.is_spec, none_is_leaf=True)
    if tree is not None and tree.num_leaves != len(flat) and any(x is None for x in flat):
        fewer, structure = optree.tree_flatten(out_specs, is_leaf=lambda x: x is not None and _trees.is_spec(x))
        if len(fewer) == tree.num_leaves:
            return fewer, structure
    return flat, given


def check_out_specs(out_specs: Any, results: Any, what: str, maker: str) -> None:
    """Refuses ``out_specs`` that would lay out ``results`` by other results' specs (``_spec_order``)."""
    if not _trees.is_spec(out_specs):
        tree = optree.tree_structure(results)
        given = _flat_specs(out_specs, tree)[1]
        if given.num_leaves == tree.num_leaves:  # else a count that fshard.shard_map refuses as such
            _spec_order(given, tree, what, maker)


def _spec_order(given: Any, tree: Any, what: str, maker: str = "fn") -> tuple[int, ...] | None:
    """Which spec lays out each result (``_match_paths``), made once per pair of structures where they hash."""
    try:
        return _matched(given, tree, what, maker)
    except TypeError:  # a structure that cannot be hashed (a node's metadata): matched afresh
        return _match_paths(given, tree, what, maker)


def _match_paths(given: Any, tree: Any, what: str, maker: str) -> tuple[int, ...] | None:
    """Per result leaf, the position of the spec at its place; ``None`` where they are in the same order.

    Specs match results by place: a dict's spec by its key, whatever order each dict's leaves
    come in (a ``dict``'s sorted, an ``OrderedDict``'s as inserted). A spec inside a container
    of one spec at a result's place lays out that result (``(spec,)`` for one tensor). Sequences
    pair by position (a list of specs for a tuple of results; results with ``None`` between
    them). Specs at other places (other keys, a sequence of specs for a dict of results) would
    lay out a result by another's spec: ``SpecError``.
    """
    specs, results = given.paths(), tree.paths()
    if specs == results or len(results) == 1:
        return None
    try:
        where = {p: k for k, p in enumerate(specs)}
    except TypeError:  # a place that cannot be hashed: compared in order only
        where = {}
    if len(where) < len(specs):  # no places to look up (or two specs at one): none matched by place
        where = {}
    order = [where.get(p, -1) for p in results]
    taken = set(order)
    for n, r in enumerate(results):  # a container of one spec at the result's place
        if order[n] < 0:
            inside = [k for k, p in enumerate(specs) if k not in taken and p[: len(r)] == r]
            if len(inside) == 1:
                order[n] = inside[0]
                taken.add(inside[0])
    if -1 not in order:
        return None if order == list(range(len(order))) else tuple(order)
    if all(_by_position(p, r) for p, r in zip(specs, results)):  # sequences only: paired in order
        return None
    named = set(map(repr, results))  # by repr: a place need not hash
    lost = [r for r, k in zip(results, order) if k < 0] or results
    stray = [p for p in specs if repr(p) not in named] or specs
    msg = (
        f"{what} out_specs does not match {maker}'s results: its spec at {_path(stray[0])} would lay out the "
        f"result at {_path(lost[0])} ({tree}). Give out_specs the structure of {maker}'s results, with the "
        "same dict keys, or one spec for all of them."
    )
    raise SpecError(msg)


def _by_position(spec: tuple[Any, ...], result: tuple[Any, ...]) -> bool:
    """Whether two places differ only in sequence positions (a key never pairs by position)."""
    return len(spec) == len(result) and all(a == b or (type(a) is int and type(b) is int) for a, b in zip(spec, result))


_matched = cached(256)(_match_paths)


def _path(path: tuple[Any, ...]) -> str:
    return _trees.path_text(path) or "the top"


@dataclasses.dataclass(frozen=True)
class _Alike:
    """A result's block shapes where every placement holds blocks of the same shapes: the k-th ``shapes[k]``."""

    shapes: tuple[tuple[int, ...], ...]

    def spread(self, layout: Layout) -> dict[Slot, tuple[int, ...]]:
        """The shape of the block at each slot of ``layout`` (the arguments' placements)."""
        return {slot: self.shapes[slot[1]] for slot in _slot_index(layout).values()}


def _alike_metas(
    found: Sequence[tuple[torch.dtype, dict[Slot, tuple[int, ...]]]],
) -> list[tuple[torch.dtype, _Alike]] | None:
    """Per result leaf, its dtype and its block shapes by position on this rank's one placement.

    ``None`` where this rank's blocks lie on several placements, or skip a position.
    """
    out: list[tuple[torch.dtype, _Alike]] = []
    for dtype, shapes in found:
        slots = list(shapes)
        if len({p for p, _ in slots}) != 1 or sorted(k for _, k in slots) != list(range(len(slots))):
            return None
        out.append((dtype, _Alike(tuple(shapes[slot] for slot in sorted(slots, key=lambda slot: slot[1])))))
    return out


def _alike_form(description: Any) -> Any:
    """What a rank's description (``_run``'s ``describe``) says, naming no rank; ``None`` where it cannot.

    Ranks whose forms are equal returned one structure and dtypes, blocks of the same shapes
    at each position of their one placement, and used the same gathered and closed-over
    tensors and buckets: each can then rebuild the others' descriptions from its own.
    """
    results, (ages, closed), series = description
    if results is None:
        return None
    tree, found = results
    metas = _alike_metas(found)
    if metas is None:
        return None
    leaves = [(str(dtype), alike.shapes) for dtype, alike in metas]
    return repr(tree), tree_kinds(tree), leaves, sorted(ages), closed, series


def _out_layout(
    spec: Any, shapes: dict[Slot, tuple[int, ...]] | _Alike, first: Layout, pending: str | None, what: str, n: int
) -> Layout:
    """The layout of result ``n``, checked against the block shapes and the slots of ``first`` (where ``fn`` ran).

    The block shapes are those known here: every rank's where they were exchanged (or
    alike). Made once per spec and shapes (``_laid_out``): on thousands of ranks a layout
    and its checks take milliseconds.
    """
    key = shapes if isinstance(shapes, _Alike) else tuple(shapes.items())
    try:
        hash(spec)
    except TypeError:  # a spec that cannot be hashed: laid out afresh
        return _lay_out(spec, key, first, pending, what, n)
    return _laid_out(spec, key, first, pending, what, n)


def _lay_out(
    spec: Any,
    key: tuple[tuple[Slot, tuple[int, ...]], ...] | _Alike,
    first: Layout,
    pending: str | None,
    what: str,
    n: int,
) -> Layout:
    shapes = key.spread(first) if isinstance(key, _Alike) else dict(key)
    slots = set(_slot_index(first).values())
    if spec is None:
        raise SpecError(f"{what} needs an out_spec for result {n}.")
    layout = spec if isinstance(spec, Layout) else as_layout(spec, _infer_shape(spec, shapes, what, n))
    placed = set(_slot_index(layout).values())
    if placed != slots:
        extra, lost = sorted(placed - slots, key=str), sorted(slots - placed, key=str)
        where = [f"blocks on {_names(extra)}, where fn did not run"] if extra else []
        where += [f"no block on {_names(lost)}, where fn ran"] if lost else []
        msg = (
            f"{what} result {n}: out_spec {spec!r} gives {' and '.join(where)}; give it the arguments' "
            "placements, with as many blocks on each."
        )
        raise SpecError(msg)
    if pending is not None and layout.partial != pending:
        msg = (
            f"{what} ran linearly on pending sums, so result {n} is a pending sum: give out_spec as "
            f"fshard.Partial(...), got {spec!r}."
        )
        raise SpecError(msg)
    for i, (p, k) in _slot_index(layout).items():
        got = shapes.get((p, k))
        if got is not None and got != layout._shard(i).sizes:  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
            msg = (
                f"{what} result {n} on placement {p} has shape {got} but out_spec gives that block "
                f"sizes {layout._shard(i).sizes} (global shape {layout.shape})."  # pyright: ignore[reportPrivateUsage]
            )
            raise SpecError(msg)
    return layout


_laid_out = cached(256)(_lay_out)


def _check_replicas(
    layouts: tuple[Layout, ...], names: Sequence[int | str], out: Layout, spec: Any, what: str, n: int
) -> None:
    """Refuses ``out`` where it makes copies of results whose arguments differ.

    Raises:
        SpecError: naming the argument, the placements (and the mesh axes of a ``Named``
            out spec) along which the claimed copies get different blocks, and the fixes.
    """
    found = _replica_conflict(layouts, out)
    if found is None:
        return
    k, p, q = found
    axes = _mesh_axes(spec, p, q)
    along = f" along mesh axis {axes[0]!r}" if len(axes) == 1 else f" along mesh axes {axes}" if axes else ""
    partial = f"fshard.Partial(spec, over={tuple(axes)!r})" if axes else "fshard.Partial(spec)"
    opt_out = (
        "pass check_vma=False if fn returns equal results there"
        if what.startswith("shard_map")
        else "run the module through fshard.shard_map(..., check_vma=False) if it returns equal results there"
        if what.startswith("apply_module")
        else "use fshard.shard_map(..., check_vma=False) if fn returns equal results there"
    )
    msg = (
        f"{what} out_spec {spec!r} makes the copies of result {n} on placements {p} and {q} replicas{along}, "
        f"but {_arg(names[k])} gives those placements different blocks, so the results there may differ "
        "and the array would hold replicas that disagree. Give an out_spec that splits the result"
        f"{along} (or {partial} if its copies are partial sums), reshard the result afterwards, "
        f"or {opt_out}."
    )
    raise SpecError(msg)


@cached(256)
def _replica_conflict(layouts: tuple[Layout, ...], out: Layout) -> tuple[int, Placement, Placement] | None:
    """Two placements ``p``, ``q`` that ``out`` gives copies of one value but ``argument`` does not.

    ``(argument, p, q)``, or ``None`` if there are none. Placement by placement, the
    arguments' blocks (their replica ids) say what a result may depend on: slots with
    equal blocks of every argument give equal results.
    """
    ids = replica_ids(out)
    keep = np.flatnonzero(np.all(out.columns.sz > 0, axis=1))  # an empty block holds nothing to disagree
    if len(np.unique(ids[keep])) == len(keep):
        return None  # no two non-empty blocks are copies: nothing is claimed
    out_slots = _slot_index(out)
    # Per kept output shard, the replica id of each argument's block at its slot.
    blocks = np.array(
        [[replica_ids(lay)[_slots(lay)[out_slots[i][0]][out_slots[i][1]]] for lay in layouts] for i in keep.tolist()],
        dtype=np.int64,
    ).reshape(len(keep), len(layouts))
    _, first, group = np.unique(ids[keep], return_index=True, return_inverse=True)
    lead = first[group.reshape(-1)]
    bad = np.flatnonzero(np.any(blocks != blocks[lead], axis=1))
    if not len(bad):
        return None
    row = int(bad[0])
    k = int(np.flatnonzero(blocks[row] != blocks[lead[row]])[0])
    return k, out_slots[int(keep[lead[row]])][0], out_slots[int(keep[row])][0]


def _mesh_axes(spec: Any, p: Placement, q: Placement) -> list[str]:
    """The axes of a ``Named`` spec's mesh along which placements ``p`` and ``q`` lie apart (else none)."""
    inner = spec.spec if isinstance(spec, Partial) else spec
    mesh = getattr(inner, "mesh", None)
    if mesh is None or p not in mesh.ranks or q not in mesh.ranks:
        return []
    at = np.unravel_index([mesh.ranks.index(p), mesh.ranks.index(q)], mesh.shape)
    return [name for name, c in zip(mesh.axis_names, at) if c[0] != c[1]]


def _names(slots: list[Slot]) -> str:
    return "[" + ", ".join(f"{p}#{k}" if k else str(p) for p, k in slots) + "]" if slots else "no placement"


def _infer_shape(spec: Any, shapes: dict[Slot, tuple[int, ...]], what: str, n: int) -> tuple[int, ...]:
    """The global shape at which ``spec`` gives every slot the shape of its block."""
    inner = spec.spec if isinstance(spec, Partial) else spec
    if isinstance(inner, Layout):
        return inner.shape
    ndims = {len(s) for s in shapes.values()}
    if len(ndims) > 1:
        raise SpecError(f"{what} result {n} has blocks with different numbers of dims: {sorted(ndims)}.")
    ndim = ndims.pop() if ndims else 0
    if isinstance(inner, Explicit):
        return tuple(max((m.offsets[d] + m.sizes[d] for m in inner.shards), default=0) for d in range(ndim))
    probe = as_layout(inner, (_PROBE,) * ndim)
    slots = _slot_index(probe)
    shape: list[int] = []
    for d in range(ndim):
        seen: dict[int, int] = {}
        for i, m in enumerate(probe.shards):
            if m.sizes[d] and m.offsets[d] not in seen and slots[i] in shapes:
                seen[m.offsets[d]] = shapes[slots[i]][d]
        shape.append(sum(seen.values()))
    return tuple(shape)


def _wrap(
    layout: Layout, backend: Any, blocks: dict[Slot, torch.Tensor], link: torch.Tensor | None, dtype: torch.dtype
) -> ShardedArray:
    slots = _slot_index(layout)
    data = tuple(blocks[slots[i]] for i in backend.addressable(layout))
    if not data:
        return ShardedArray(layout, (), backend, dtype, link)
    out = ShardedArray(layout, data, backend)
    # A replicated result's copies were computed once each: together they count once.
    return regrouped(out, "share")


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
    terms = next((a.layout.terms for a in arrays if a.layout.partial is not None), None)

    usage = _varying.Usage()
    own = [t for a in arrays for t in a.addressable_data]

    def compute() -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
        with untouched(own, "map_local()"), _per_shard(backend, usage, first.layout, own):
            outs = tuple(fn(*ts) for ts in zip(*(a.addressable_data for a in arrays)))
        return _result_leaves(outs)

    def results(tree: Any, leaves: list[tuple[torch.Tensor, ...]], metas: Sequence[Any], used: set[int]) -> Any:
        if tree is None:  # no shard anywhere: the result's link joins every argument's
            link = link_without_blocks(arrays, first.dtype, used)
            return ShardedArray(_pending(base, pending, terms), (), backend, first.dtype, link)
        out: list[ShardedArray] = []
        for n, (dtype, sizes) in enumerate(metas):
            layout = _pending(_infer_layout(base, sizes), pending, terms)
            if leaves:
                out.append(ShardedArray(layout, leaves[n], backend, dtype))
            else:
                out.append(ShardedArray(layout, (), backend, dtype, link_without_blocks(arrays, dtype, used)))
        return optree.tree_unflatten(tree, out)

    if holds_nothing_somewhere(backend, first.layout):

        def describe(r: tuple[Any, list[tuple[torch.Tensor, ...]]]) -> Any:
            return describe_results(r[0], [dict(zip(index, leaf)) for leaf in r[1]]), (usage.ages(), usage.closed)

        (tree, leaves), seen = agree(backend, compute, describe)
        tree, metas = merge_results([d for d, _ in seen], "map_local()")
        return results(tree, leaves, metas, _used(backend, first.layout, [u for _, u in seen], "map_local()"))
    # Every process holds blocks: none waits for the others, and none learns what the others' fn returned.
    # A structure or dtype that differs per process is caught by the next movement's headers where the
    # results' layouts or dtypes differ (design notes).
    tree, leaves = compute()
    metas = (describe_results(tree, [dict(zip(index, leaf)) for leaf in leaves]) or (None, []))[1]
    _refuse_closed(backend, first.layout, usage.closed, "map_local()")
    return results(tree, leaves, metas, set())


def _pending(layout: Layout, pending: str | None, terms: Any) -> Layout:
    """``layout`` with the pending op of a linear map of pending sums, and their summands' terms."""
    return layout if pending is None else with_terms(with_partial(layout, pending), terms)


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
            tuple(resolved(check_tensor(f[0][n], "map_local() fn result")) for f in flat)
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
    if all(s == tuple(layout.columns.sz[i].tolist()) for i, s in sizes.items()):
        return layout
    if any(len(s) != layout.ndim for s in sizes.values()):
        msg = "map_local() fn changed the number of dims; pass out_spec=Layout(...) for the result."
        raise SpecError(msg)
    shape = tuple(_new_extent(layout, sizes, d) for d in range(layout.ndim))
    return Layout(shape, tuple(_resize(s, layout.shape, shape) for s in layout.shards))


def _new_extent(layout: Layout, sizes: dict[int, tuple[int, ...]], d: int) -> int:
    """The result's extent along ``d``: the sum of the new sizes of the distinct intervals that tile the dim.

    There is one interval when no shard splits the dim.
    """
    new: dict[tuple[int, int], set[int]] = {}
    for i, s in sizes.items():
        m = layout._shard(i)  # pyright: ignore[reportPrivateUsage]  # builds one ShardMeta only
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
