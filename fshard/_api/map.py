"""Per-placement computation: ``map_local`` over aligned layouts and ``shard_map``.

Both run a function once per slot (``map_slots``): ``map_local`` on the shards of arrays
that share a layout (``map_same``) or align, ``shard_map`` on one block per placement of
its arguments, moved to their ``in_specs`` first (one exchange per phase for the whole
tree, ``fused.move_arguments``). ``map_run`` runs the function and wraps its results in
the layouts that ``map_out`` gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch

from fshard._api import map_trees as _trees
from fshard._api.map_context import blockless
from fshard._api.map_run import Reducing, run_per_slot
from fshard._api.map_same import map_same
from fshard._api.map_slots import arg_name, check_backends, check_partial, check_terms
from fshard._api.move import split_replicas
from fshard._api.shard import shard
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import opaque, with_body
from fshard._errors import SpecError
from fshard._exec import fused as _fused
from fshard._exec import regather as _regather
from fshard._exec.collective import collective
from fshard._layout.layout import Layout, with_partial
from fshard._layout.precision import check_floating, per_argument
from fshard._layout.specs import as_layout

__all__ = ["map_local", "named_shard_map", "shard_map"]


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
    check_backends(arrays, "map_local()")
    pending = check_partial(arrays, linear)
    check_terms(arrays)
    base = with_partial(arrays[0].layout, None)
    if out_spec is None and all(with_partial(a.layout, None) == base for a in arrays):
        if pending is not None and any(a.layout.partial is None and a.requires_grad for a in arrays):
            # fn runs on each summand: a replicated argument's copies each meet another summand
            # (p * v), so its gradient is the sum of theirs, as shard_map's arguments' are (run_per_slot).
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
    return run_per_slot(fn, arrays, (), out_spec, pending, one_block=False, what="map_local()")


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
    the local backend the bodies of a call that does run in threads, a thread each, taking turns.

    A result is known to be equal on two placements only where every argument gives them
    the same block (copies of one box), and, where ``fn`` sums with ``psum``, gives the
    placements summed with each of them the same blocks too, in the order it adds them: an
    ``out_specs`` that makes such a result's copies replicas where an argument differs
    between them is refused, since the array would hold replicas that disagree (JAX's
    replication check).

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
    reducing_key: Hashable = None,
    form: tuple[str, str] = ("", ""),
) -> Callable[..., Any]:
    """``shard_map``, whose errors name it ``what`` and its arguments by ``labels`` (one per in_spec).

    For a caller that builds the ``shard_map`` from arguments of its own (``apply_module``): its
    errors then name what that caller's user passed. ``reducing_key``: what tells its function
    apart from others of the same code, as to whether its bodies reduce (``Reducing``).
    ``form``: what the ranks must agree on besides the results (``run_per_slot``).
    """
    if not callable(fn):
        raise TypeError(f"{what} fn must be callable, got {type(fn).__name__}.")
    if not isinstance(check_vma, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"{what} check_vma must be a bool, got {check_vma!r} ({type(check_vma).__name__}).")
    if not isinstance(regather, bool):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
        raise TypeError(f"{what} regather must be a bool, got {regather!r} ({type(regather).__name__}).")

    specs = tuple(cast("Sequence[Any]", in_specs)) if isinstance(in_specs, (tuple, list)) else (in_specs,)
    reducing = Reducing(specs, fn, reducing_key)
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
                regather=regather, what=what, labels=how.labels, reducing_key=reducing.key, form=form,
            )  # fmt: skip
        return inner(*flat)

    @collective(f"shard_map[{getattr(fn, '__qualname__', type(fn).__name__)}]")
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            msg = (
                f"{what} function takes its arguments by position, one per in_spec; got keyword arguments "
                f"{sorted(kwargs)}. Pass each by position with an in_spec of its own, or bind it before "
                "shard_map (functools.partial(fn, name=value))."
            )
            raise TypeError(msg)
        if len(specs) != len(args):
            msg = f"shard_map() got {len(args)} arguments but in_specs has {len(specs)} entries: give one per argument."
            raise SpecError(msg)
        backend = next((a.backend for a in args if isinstance(a, ShardedArray)), None)
        arrays: list[tuple[int, ShardedArray]] = []
        targets: list[Layout | None] = []  # where each array argument moves (None: a tensor, sharded there)
        extras: list[tuple[int, Any]] = []
        tensors: list[str] = []  # each tensor argument's shape and dtype: every rank must pass the same tensor
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
                tensors.append(f"{_label(k)} {tuple(a.shape)} {a.dtype}")
            else:
                msg = (
                    f"shard_map() argument {k} is a {type(a).__name__}: give a ShardedArray, a tensor or a "
                    "pytree of them (a tuple, list or dict), or in_spec None."
                )
                raise SpecError(msg)
        if not arrays:
            raise SpecError("shard_map() needs at least one array or tensor argument with a spec.")
        check_backends(tuple(a for _, a in arrays), what)
        order: list[int | str] = [k if labels is None else labels[k] for k, _ in arrays]
        values = _arguments(arrays, targets, precisions, regather, what, labels)
        pending = check_partial(values, linear=False, what=what, names=order)

        def block_fn(*blocks: torch.Tensor) -> Any:
            full: list[Any] = [None] * len(args)
            for (k, _), b in zip(arrays, blocks):
                full[k] = b
            for k, v in extras:
                full[k] = v
            return fn(*full)

        return run_per_slot(
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
            regathered=regather and any(t is not None and t != a.layout for (_, a), t in zip(arrays, targets)),
            form=_with_tensors(form, tensors) if tensors and arrays[0][1].backend.spans_processes else form,
        )

    def _label(k: int) -> str:
        return f"argument {k}" if labels is None else str(labels[k])

    return call


def _with_tensors(form: tuple[str, str], tensors: Sequence[str]) -> tuple[str, str]:
    """``form`` with the shapes and dtypes of the call's tensor arguments, which every rank must pass alike.

    Each rank shards its own tensor: one of another shape would lay the others' blocks out
    wrongly, and the call's results would be blamed.
    """
    what = "the shapes and dtypes of its tensor arguments (pass the same tensor on every rank)"
    if form[0]:  # one digest for both: the ranks learn that one of them differs, each rank's text says which
        return f"either {form[0]}, or {what}", f"{form[1]}; tensor arguments: {', '.join(tensors)}"
    return what, ", ".join(tensors)


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
        check_floating(precisions[k], a.dtype, f"{what} {arg_name(k if labels is None else labels[k])}")
    values = [a for _, a in arrays]
    if regather:  # before anything moves: every rank refuses alike
        moving = (x for a, x in zip(values, targets) if x is not None and x != a.layout)
        for layout in dict.fromkeys(moving):
            _check_regather(values[0].backend, layout)

    def moved(sources: Sequence[ShardedArray], layouts: Sequence[Layout], out: Sequence[ShardedArray], p: Any) -> None:
        if regather and sources:
            _regather.register(sources, layouts, out, "shard_map()", p)

    return tuple(_fused.move_arguments(values, targets, [precisions[k] for k, _ in arrays], moved))


def _check_regather(backend: Any, layout: Layout) -> None:
    """Refuses ``regather=True`` where some rank holds no block (it runs no fn, and no movement again)."""
    empty = blockless(backend, layout)
    if empty:
        msg = (
            f"shard_map() regather=True: ranks {empty} hold no block of the arguments, so they run no fn and "
            "cannot take part in the movement that gathers the arguments again in the backward. Lay the "
            "arguments out over every rank of the group, or pass regather=False."
        )
        raise SpecError(msg)
