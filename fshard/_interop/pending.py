"""DTensor's ``Partial`` placements as fshard's ``Partial``, both ways.

A DTensor whose placement on mesh dim ``i`` is ``Partial(op)`` holds, along that dim, summands
of a pending ``op``; along its ``Replicate()`` dims, replicas. That is
``fshard.Partial(Named(mesh, partition), op, over=(the partial dims' axis names))``:
``[Shard(0), Partial()]`` splits rows over mesh dim 0 and sums over dim 1, and
``[Replicate(), Partial()]`` sums over dim 1 and replicates over dim 0. fshard reduces
``"sum"``, ``"max"`` and ``"min"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fshard._errors import SpecError
from fshard._layout.layout import Layout
from fshard._layout.specs import Mesh, Named, Partial
from fshard._layout.terms import canonical_terms

__all__ = ["PARTIAL", "dtensor_placement", "pending_of", "summand_key", "with_pending"]

# The choice that marks a mesh dim as holding summands (the others: None for Replicate, a dim for Shard).
PARTIAL = "partial"
_OPS = ("sum", "max", "min")


def pending_of(placements: Sequence[Any], mesh: Mesh) -> tuple[str, tuple[str, ...]] | None:
    """The pending op and the mesh axes of ``placements``' ``Partial`` dims, or ``None`` where there is none.

    Raises:
        SpecError: a ``Partial`` that fshard does not reduce (another op, a subclass such as
            an embedding's masked partial) or partial dims with different ops; the message gives
            the ``redistribute`` call that reduces them first.
    """
    ops: dict[str, str] = {}
    for i, p in enumerate(placements):
        if not p.is_partial():
            continue
        op = getattr(p, "reduce_op", None)
        if type(p).__name__ != "Partial" or op not in _OPS:
            raise SpecError(_refusal(placements, i, f"is a pending {op!r} reduction that fshard does not hold"))
        ops[mesh.axis_names[i]] = op
    if not ops:
        return None
    if len(set(ops.values())) > 1:
        i = next(i for i, p in enumerate(placements) if p.is_partial() and p.reduce_op != next(iter(ops.values())))
        raise SpecError(_refusal(placements, i, f"reduces by another op than the other partial dims ({ops})"))
    return next(iter(ops.values())), tuple(ops)


def _refusal(placements: Sequence[Any], i: int, why: str) -> str:
    fixed = ["Replicate()" if q.is_partial() else repr(q) for q in placements]
    return (
        f"DTensor placement {placements[i]!r} on mesh dim {i} {why}: reduce it first with "
        f"dt.redistribute(dt.device_mesh, [{', '.join(fixed)}])."
    )


def with_pending(spec: Named, pending: tuple[str, tuple[str, ...]] | None) -> Named | Partial:
    """``spec``, or ``Partial(spec, op, over=axes)`` for a pending (op, axes)."""
    if pending is None:
        return spec
    op, axes = pending
    return Partial(spec, op, over=axes)


def dtensor_placement(op: str) -> Any:
    """DTensor's ``Partial(op)``."""
    from torch.distributed.tensor import Partial as DPartial  # deferred: torch.distributed

    return DPartial(op)


def summand_key(layout: Layout) -> tuple[str | None, tuple[int, ...] | None]:
    """The pending op and the summands' terms, numbered in (rank, offsets, sizes) order.

    Two layouts of the same boxes (as ``_boxes`` compares them) and the same key hold the
    same summands and replicas, whatever their shards' order.
    """
    if layout.terms is None:
        return layout.partial, None
    lo, sz, rank = layout.columns.lo, layout.columns.sz, layout.columns.rank
    order = np.lexsort((*(sz[:, k] for k in range(layout.ndim - 1, -1, -1)),
                        *(lo[:, k] for k in range(layout.ndim - 1, -1, -1)), rank))  # fmt: skip
    terms = canonical_terms(layout.terms[order], lo[order], sz[order], rank[order], layout.partial)
    return layout.partial, None if terms is None else tuple(terms.tolist())
