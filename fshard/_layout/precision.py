"""``Precision``: the dtypes in which a movement sends its data and reduces its gradients.

A movement with a precision casts on the sending side, so the wire carries the narrow
dtype and the receiver computes in it; its backward casts the incoming gradients to the
reduce dtype, moves (and sums) them in it, and hands the source its gradient in the
source's own dtype. FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` and
DDP's ``bf16_compress_hook`` are the same idea for modules and buckets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch

from fshard._errors import SpecError

__all__ = ["FLOATING", "Precision", "check_floating", "check_precision", "per_argument"]

# The dtypes a movement may cast to: those torch can sum on every device (float8 cannot).
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True, slots=True)
class Precision:
    """The dtypes a movement sends in (``param``) and its gradients are reduced in (``reduce``).

    ``None`` leaves a dtype as it is: the array's own for ``param``, the dtype the
    gradients arrive in (``param``'s) for ``reduce``. The gradient returned to the source
    always has the source's dtype.

    Args:
        param: the forward's dtype: each sender casts its boxes before sending, and the
            result (the blocks a ``shard_map`` body computes on) has it.
        reduce: the backward's dtype: the gradients are cast to it, then moved and summed
            in it (the wire carries it), then cast to the source's dtype.

    Raises:
        SpecError: a dtype that is not one of float16, bfloat16, float32, float64.

    >>> import torch, fshard
    >>> p = fshard.Precision(param=torch.bfloat16, reduce=torch.float32)
    >>> p
    Precision(param=torch.bfloat16, reduce=torch.float32)
    >>> p.forward_dtype(torch.float32), p.reduce_dtype(torch.float32)
    (torch.bfloat16, torch.float32)
    """

    param: torch.dtype | None = None
    reduce: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param", "reduce"):
            value: Any = getattr(self, name)
            if value is not None and value not in FLOATING:
                names = ", ".join(map(str, FLOATING))
                msg = (
                    f"Precision({name}={value!r}): {name} takes a floating dtype ({names}) or None, "
                    f"got {value!r}{'' if isinstance(value, torch.dtype) else f' ({type(value).__name__})'}."
                )
                raise SpecError(msg)

    def forward_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype that a movement of an array of ``dtype`` sends and returns."""
        return self.param if self.param is not None else dtype

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype in which the gradients of an array of ``dtype`` are moved and summed."""
        return self.reduce if self.reduce is not None else self.forward_dtype(dtype)

    def casts(self, dtype: torch.dtype) -> bool:
        """Whether a movement of an array of ``dtype`` casts anything, forward or backward."""
        return self.forward_dtype(dtype) != dtype or self.reduce_dtype(dtype) != dtype


def check_precision(precision: Any, what: str) -> Precision | None:
    """``precision`` itself, or ``TypeError`` naming ``what`` when it is neither ``None`` nor a ``Precision``."""
    if precision is None or isinstance(precision, Precision):
        return precision
    msg = (
        f"{what} precision= takes an fshard.Precision or None, got {precision!r} ({type(precision).__name__}); "
        "e.g. fshard.Precision(param=torch.bfloat16, reduce=torch.float32)."
    )
    raise TypeError(msg)


def check_floating(precision: Precision | None, dtype: torch.dtype, what: str) -> None:
    """Raises ``SpecError`` naming ``what`` where ``precision`` would cast an array whose ``dtype`` is not floating."""
    if precision is not None and not dtype.is_floating_point:
        msg = (
            f"{what} has dtype {dtype}, but precision={precision!r} casts floating arrays only: move it without "
            "a precision (of a tree, the leaves that are not floating, such as integer buffers, in a call of their "
            "own; shard_map takes one per argument: precision=(fshard.Precision(...), None))."
        )
        raise SpecError(msg)


def per_argument(precision: Any, n: int, what: str) -> tuple[Precision | None, ...]:
    """One precision per argument of ``n``: ``precision`` for each, or its entries (a tuple or list of ``n``).

    Raises:
        TypeError: an entry is neither ``None`` nor a ``Precision``.
        SpecError: a sequence whose length is not ``n``.
    """
    if not isinstance(precision, (tuple, list)):
        return (check_precision(precision, what),) * n
    given = cast("Sequence[Any]", precision)
    if len(given) != n:
        msg = (
            f"{what} precision= has {len(given)} entries but in_specs has {n}: give one Precision (or None) "
            "per argument, or one Precision for all."
        )
        raise SpecError(msg)
    # An entry that is None or a Precision checks as itself: no message made for it.
    return tuple(
        p if p is None or type(p) is Precision else check_precision(p, f"{what} argument {k}'s")
        for k, p in enumerate(given)
    )
