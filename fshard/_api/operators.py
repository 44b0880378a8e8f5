"""Operators on ``ShardedArray``: elementwise arithmetic and comparisons, and ``sum``.

Arithmetic between two arrays of one layout, or with a Python number, is
``map_local``; with a number (and unary minus) it runs on the blocks directly
where ``map_local``'s context would do nothing (``_on_blocks``). A pending sum
(``Partial``) takes part only where the operation is linear in it, so no function
ever runs on summands as if they were the value: ``p + q`` and ``p - q`` (both
pending sums of one layout), ``p * c``, ``p / c``, ``-p`` and ``p * x`` / ``p / x``
with ``x`` an array of the same boxes that is not partial. Everything else on a
pending reduction raises ``SpecError`` with the fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from fshard import _config
from fshard._api.map import map_local
from fshard._api.map_run import regrouped
from fshard._api.map_same import is_plain as _is_plain
from fshard._api.move import split_replicas
from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.calls import refuse_in_block_function
from fshard._base.compile import compiled_caller, opaque
from fshard._errors import SpecError
from fshard._exec import gathered as _varying
from fshard._exec.agree import holds_nothing_somewhere
from fshard._layout.layout import Layout, ShardMeta, with_partial

__all__ = ["array_sum", "install"]

_NUMBERS = (bool, int, float, complex)

# How each operator treats a pending sum: "add" (both operands pending, or neither),
# "scale" (one pending operand, the other a number or a non-partial array), "divide"
# (the pending operand on the left), or None (never).
_BINARY: dict[str, tuple[Callable[[Any, Any], Any], str, str | None]] = {
    "add": (operator.add, "+", "add"),
    "sub": (operator.sub, "-", "add"),
    "mul": (operator.mul, "*", "scale"),
    "truediv": (operator.truediv, "/", "divide"),  # pyright: ignore[reportUnknownMemberType]  # typeshed leaves it untyped
    "pow": (operator.pow, "**", None),  # pyright: ignore[reportUnknownMemberType]  # typeshed leaves it untyped
    "eq": (torch.eq, "==", None),
    "ne": (torch.ne, "!=", None),
    "lt": (torch.lt, "<", None),
    "le": (torch.le, "<=", None),
    "gt": (torch.gt, ">", None),
    "ge": (torch.ge, ">=", None),
}


def _refuse(symbol: str, x: ShardedArray) -> SpecError:
    return SpecError(
        f"Cannot apply {symbol} to a pending {x.layout.partial} (Partial) here: it would act on the summands, "
        "not on their reduction. Reshard it to a non-partial spec first (fshard.reshard(x, spec) reduces it)."
    )


def _linear(rule: str | None, symbol: str, left: Any, right: Any) -> bool:
    """Whether the operation runs linearly on pending sums; raises where it would be wrong."""
    arrays = [x for x in (left, right) if isinstance(x, ShardedArray)]
    pending = [x for x in arrays if x.layout.partial is not None]
    if not pending:
        return False
    if any(x.layout.partial != "sum" for x in pending) or rule is None:
        raise _refuse(symbol, pending[0])
    if rule == "add" and len(pending) != 2:
        raise _refuse(symbol, pending[0])
    if rule in ("scale", "divide") and len(pending) != 1:
        raise _refuse(symbol, pending[0])
    if rule == "divide" and left is not pending[0]:  # (left, right) are already in written order
        raise _refuse(symbol, pending[0])
    return True


def _check_factor(symbol: str, number: Any, rule: str | None) -> None:
    """Refuses a number that a pending sum's summands cannot each be scaled by.

    Scaling each summand gives the scaled sum only while every product is finite: by inf, or
    divided by 0, summands of both signs give inf - inf (NaN) where the reduced value times
    the number is inf. (A finite factor that makes a summand overflow does too; that
    depends on the values, and is documented.)
    """
    value = complex(number)
    bad = math.isinf(value.real) or math.isinf(value.imag) or (rule == "divide" and value == 0)
    if bad:
        msg = (
            f"{symbol} {number!r} of a pending sum (Partial) would act on each summand, whose results can sum to NaN "
            "where the reduced value's is not (inf - inf). Reshard it to a non-partial spec first "
            "(fshard.reshard(x, spec) reduces it)."
        )
        raise SpecError(msg)


def _binary(name: str, reflected: bool = False) -> Callable[[ShardedArray, Any], Any]:
    fn, symbol, rule = _BINARY[name]

    def method(self: ShardedArray, other: Any) -> Any:
        refuse_in_block_function(f"{symbol} of an array was applied")
        left, right = (other, self) if reflected else (self, other)
        if isinstance(other, ShardedArray):
            if with_partial(self.layout, None) != with_partial(other.layout, None):
                msg = (
                    f"Operands of {symbol} have different layouts (shapes {tuple(left.shape)} and "
                    f"{tuple(right.shape)}): reshard one to the other's first, fshard.reshard(b, a.layout)."
                )
                raise SpecError(msg)
            linear = _linear(rule, symbol, left, right)
            if linear:  # copy by copy: each summand counted once
                left, right = split_replicas(left), split_replicas(right)
            return map_local(fn, left, right, linear=linear)
        if isinstance(other, np.generic) and other.ndim == 0:  # a numpy scalar: its Python number
            other = cast("complex", other.item())
        if isinstance(other, _NUMBERS):
            linear = _linear(rule, symbol, left, right)
            if linear:
                _check_factor(symbol, other, rule)

            def with_number(t: torch.Tensor) -> Any:
                return fn(other, t) if reflected else fn(t, other)

            operand = split_replicas(self) if linear else self
            done = _on_blocks(with_number, operand)
            return done if done is not None else map_local(with_number, operand, linear=linear)
        if isinstance(other, (torch.Tensor, np.ndarray)):
            # Not NotImplemented: Python would then compare == and != by identity, a bool and no error.
            kind = "torch.Tensor" if isinstance(other, torch.Tensor) else "numpy array"
            msg = (
                f"{symbol} of a ShardedArray and a {kind}: an array combines with another array of "
                "its layout or a Python number. Shard the tensor first (fshard.shard(t, a.layout)), apply it to the "
                "blocks (fshard.map_local(lambda b: b + t, a)), or gather() the array."
            )
            raise TypeError(msg)
        return NotImplemented

    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    method.__doc__ = f"``{symbol}`` shard by shard (see ``fshard._api.operators``)."
    return method


def _on_blocks(fn: Callable[[torch.Tensor], Any], a: ShardedArray) -> ShardedArray | None:
    """``map_local(fn, a)`` run on the blocks directly, where its context does nothing; else ``None``.

    ``fn`` is an operator of a block and a number: it closes over no tensor, writes into no
    block and keeps each block's shape and layout. So where every process holds blocks of
    ``a`` (no process needs to learn what the others' returned) and no block is gathered
    across processes or tapped (whose uses per shard go through views of their own), its
    results are ``map_local``'s, layout and gradients alike, without the per-shard mode, the
    in-place check and the result's inference. The call is counted as ``map_local`` counts
    it, raising or not. ``None`` (``map_local`` runs it) where the caller is compiled
    (``map_local`` compiles ``fn`` there), under a ``torch.func`` transform, in check mode
    (which compares the call across ranks), and where a result is not a plain tensor of its
    block's shape.
    """
    blocks = a._data  # pyright: ignore[reportPrivateUsage]  # the slots: a hot path
    backend = a._backend  # pyright: ignore[reportPrivateUsage]
    if (
        not blocks
        or compiled_caller()
        or _transforms_active()
        or _config.current().check_collectives
        or holds_nothing_somewhere(backend, a.layout)
        or not all(type(t) in _BLOCK_TYPES for t in blocks)  # no subclass, nor a tree map's other leaves
        or not _varying.plain(blocks)
    ):
        return None
    try:
        outs = [fn(t) for t in blocks]  # the same calls map_local would make, in its order
    except BaseException:
        _varying.count_call()  # as map_local's context counts a call whose fn raised
        raise
    dtype = outs[0].dtype
    if not all(
        type(o) is torch.Tensor and o.shape == t.shape and o.dtype == dtype and _is_plain(o)
        for o, t in zip(outs, blocks)
    ):
        return None  # map_local's rules and errors (it counts the call); fn writes nothing: running it again is alike
    _varying.count_call()
    return ShardedArray._many([a.layout], [tuple(outs)], backend, dtype)[0]  # pyright: ignore[reportPrivateUsage]


_transforms_active: Any = torch._C._are_functorch_transforms_active  # pyright: ignore[reportPrivateUsage]
_BLOCK_TYPES = (torch.Tensor, torch.nn.Parameter)


def _neg(self: ShardedArray) -> ShardedArray:
    """Unary minus, shard by shard (linear, so a pending sum stays one)."""
    refuse_in_block_function("unary - of an array was applied")
    if self.layout.partial not in (None, "sum"):
        raise _refuse("unary -", self)
    operand = self if self.layout.partial is None else split_replicas(self)
    done = _on_blocks(operator.neg, operand)
    return done if done is not None else map_local(operator.neg, operand, linear=operand.layout.partial is not None)


def _bool(self: ShardedArray) -> bool:
    msg = (
        "The truth value of a ShardedArray is ambiguous: compare with fshard.equal(a, b), "
        "or gather() and use torch's reductions."
    )
    raise TypeError(msg)


def install() -> None:
    """Adds the operators to ``ShardedArray``, each a graph break under ``torch.compile`` (``opaque``)."""
    for name in _BINARY:
        setattr(ShardedArray, f"__{name}__", opaque(_binary(name)))
        if name in ("add", "sub", "mul", "truediv", "pow"):
            setattr(ShardedArray, f"__r{name}__", opaque(_binary(name, reflected=True)))
    ShardedArray.__neg__ = opaque(_neg)  # type: ignore[method-assign]
    ShardedArray.__bool__ = _bool  # type: ignore[method-assign,assignment]
    ShardedArray.__hash__ = object.__hash__  # type: ignore[method-assign,assignment]  # identity, as torch.Tensor
    ShardedArray.sum = opaque(array_sum)  # type: ignore[attr-defined]


# -- sum ------------------------------------------------------------------------------------


def array_sum(self: ShardedArray, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> ShardedArray:
    """The sum over ``dim`` (every dim where it is ``None`` or ``()``, as ``torch.sum``), as a ``ShardedArray``.

    Each shard sums its own box. Over dims that no shard splits the result keeps the
    layout (replicas stay replicas); over a split dim the shards' sums are partial, so
    the result is a pending sum (``Partial``) with one summand per placement and box,
    each element counted once: ``gather`` or ``reshard`` completes it. The result has
    ``torch.sum``'s dtype on every rank (an int or bool array sums to int64), and an
    empty array sums to zeros.

    >>> import torch, fshard
    >>> x = fshard.shard(torch.arange(12.0).reshape(4, 3), fshard.Chunk(0, [0, 1]))
    >>> s = x.sum(0)
    >>> s.layout.partial, fshard.gather(s).tolist()
    ('sum', [18.0, 22.0, 26.0])
    >>> fshard.gather(x.sum(1)).tolist()
    [3.0, 12.0, 21.0, 30.0]
    >>> b = fshard.shard(torch.tensor([True, False, True]), fshard.Chunk(0, [0, 1]))
    >>> s = b.sum(dim=())
    >>> s.dtype, fshard.gather(s).item()
    (torch.int64, 2)
    """
    layout = self.layout
    refuse_in_block_function("sum() of an array was called")
    if layout.partial not in (None, "sum"):
        raise _refuse("sum()", self)
    dims = _dims(dim, layout.ndim)
    out = _kept_layout(layout, dims, keepdim)
    if out is None:
        return _partial_sum(self, dims, keepdim)

    def block_sum(t: torch.Tensor) -> torch.Tensor:
        return t.sum(dim=dims, keepdim=keepdim)

    return map_local(block_sum, self, out_spec=out)


def _dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """``dim`` as sorted dims in ``range(ndim)``: ``None`` and ``()`` name every dim, as in ``torch.sum``."""
    if dim is None:
        dims: tuple[Any, ...] = ()
    elif isinstance(dim, (tuple, list)):
        dims = tuple(cast("tuple[Any, ...] | list[Any]", dim))
    else:
        dims = (dim,)
    if not dims:
        return tuple(range(ndim))
    out: list[int] = []
    n = max(ndim, 1)  # torch wraps a 0-d tensor's dims as one dim's: 0 and -1 name it
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            why = f", whose {d!r} is not an int" if d is not dim else ""
            msg = f"sum() got dim={dim!r}{why}; give an int, a tuple of ints, or None (every dim), as torch.sum takes."
            raise TypeError(msg)
        d = int(cast("int", d))
        if not -n <= d < n:
            msg = f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {d})"
            raise IndexError(msg)
        out.append(d % n)
    if len(set(out)) != len(out):
        raise SpecError(f"sum() got dim {dim!r}, which names a dim twice.")
    return tuple(sorted(out)) if ndim else ()  # of a 0-d array: the array itself, as torch.sum gives it


def _project(values: tuple[int, ...], dims: tuple[int, ...], keepdim: bool, full: bool) -> tuple[int, ...]:
    """``values`` (a shape, offsets or sizes) with ``dims`` dropped, or set to 1 (0 for offsets)."""
    if keepdim:
        return tuple((1 if full else 0) if d in dims else v for d, v in enumerate(values))
    return tuple(v for d, v in enumerate(values) if d not in dims)


def _project_meta(s: ShardMeta, dims: tuple[int, ...], keepdim: bool) -> ShardMeta:
    return ShardMeta(_project(s.offsets, dims, keepdim, False), _project(s.sizes, dims, keepdim, True), s.placement)


@cached(256)
def _kept_layout(layout: Layout, dims: tuple[int, ...], keepdim: bool) -> Layout | None:
    """The layout of the sum over ``dims`` where no shard splits them (each box's sum is whole), else ``None``.

    A shard is split along the summed dims if it does not span them whole and its sum is not
    empty: an empty shard whose projection holds elements would be a replica of zeros.
    """
    if layout.partial is not None:
        return None
    kept = [s for s in layout.shards if 0 not in _project(s.sizes, dims, keepdim, True)]
    if any(s.sizes[d] != layout.shape[d] for s in kept for d in dims):
        return None
    return Layout(
        _project(layout.shape, dims, keepdim, full=True), [_project_meta(s, dims, keepdim) for s in layout.shards]
    )


@cached(256)
def _summands(layout: Layout, dims: tuple[int, ...], keepdim: bool) -> tuple[Layout, dict[int, int]]:
    """The pending sum of the shards' sums over ``dims``, and which of its shards each shard of ``layout`` adds to.

    One summand per (placement, box), each element once: of a box's replicas only the first
    contributes, and an empty shard none, unless the array is empty: then every shard whose
    sum has elements contributes its zeros, so that the summands cover the result; and where
    the result is empty too, every shard contributes its empty sum (the result stays on the
    array's placements).
    """
    shape = _project(layout.shape, dims, keepdim, True)
    empty, nothing = 0 in layout.shape, 0 in shape
    keys: dict[tuple[Any, ...], ShardMeta] = {}
    contributors: list[tuple[int, tuple[Any, ...]]] = []
    seen: set[tuple[Any, ...]] = set()
    for i, s in enumerate(layout.shards):
        box = (s.offsets, s.sizes)
        meta = _project_meta(s, dims, keepdim)
        if (not nothing and 0 in (meta.sizes if empty else s.sizes)) or (layout.partial is None and box in seen):
            continue
        seen.add(box)
        key = (meta.offsets, meta.sizes, s.placement)
        keys.setdefault(key, meta)
        contributors.append((i, key))
    try:
        out = Layout(shape, tuple(keys.values()), "sum")
    except ValueError as exc:  # a LayoutError: the projected boxes overlap without being equal
        msg = (
            f"sum(dim={dims}) of {layout!r}: its shards split the other dims differently along the summed dims, "
            "so their sums do not form a layout; reshard to a spec that splits only the summed dims first."
        )
        raise SpecError(msg) from exc
    index = {(m.offsets, m.sizes, m.placement): j for j, m in enumerate(out.shards)}
    return out, {i: index[key] for i, key in contributors}


@cached(64)
def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """``torch.sum``'s result dtype for arrays of ``dtype``: an int or bool array sums to int64."""
    return torch.empty(0, dtype=dtype, device="meta").sum().dtype


def _partial_sum(x: ShardedArray, dims: tuple[int, ...], keepdim: bool) -> ShardedArray:
    """The per-shard sums as a pending sum (``_summands``), in ``torch.sum``'s result dtype on every rank."""
    dtype = _sum_dtype(x.dtype)
    x = split_replicas(x)  # replicas of a summand: one keeps it, the others hold 0
    layout, backend = x.layout, x.backend
    # Of a value's replicas only the first contributes; their gradients are then summed to all.
    x = regrouped(x, "sum")
    out, into = _summands(layout, dims, keepdim)
    totals: dict[int, torch.Tensor] = {}
    for i, t in zip(backend.addressable(layout), x.addressable_data):
        j = into.get(i)
        if j is not None:
            part = t.sum(dim=dims, keepdim=keepdim)
            totals[j] = part if j not in totals else totals[j] + part
    tensors = tuple(totals[j] for j in backend.addressable(out))
    link = None if tensors else x._link_view().to(dtype)  # pyright: ignore[reportPrivateUsage]  # package-internal
    return ShardedArray(out, tensors, backend, dtype, link)
