"""Layer 2: pure planning. Plans and schedules are functions of global layouts (and a rank), cached.

``plan`` is the one place that sees both kinds of plan: direct ones
(``fshard._plan.direct``) and pending reductions (``fshard._plan.pending``, whose copy
phase is a direct plan).
"""

from __future__ import annotations

from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout
from fshard._plan.direct import Plan
from fshard._plan.pending import build as build_pending

__all__ = ["plan"]


def plan(src: Layout, dst: Layout) -> Plan:
    """The plan that moves data from layout ``src`` to layout ``dst`` (pure, cached).

    Local copies are used wherever the receiving rank already holds an element;
    otherwise the element is sent once per receiving rank, the ranks holding a box
    taking turns (``fshard._plan.schedule.source_shards``: a rule that one rank applies to
    its own boxes alone, so ``for_rank`` agrees with the plan). The transfers are
    computed on first use. Pending reductions (``Layout.partial``) are planned by
    ``fshard._plan.pending``: reduce-scatter, then copies to the replicas, each rank's share
    again from the layouts alone.

    Raises:
        SpecError: if the layouts have different shapes.
    """
    # A public function: callers may be untyped, so the types are checked at run time.
    if not isinstance(src, Layout) or not isinstance(dst, Layout):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise SpecError(f"plan() takes two Layouts, got {type(src).__name__} and {type(dst).__name__}.")
    return _plan(src, dst)


@cached(1024)
def _plan(src: Layout, dst: Layout) -> Plan:
    if src.shape != dst.shape:
        raise SpecError(f"Cannot plan between shapes {src.shape} and {dst.shape}: shapes must match.")
    if src.partial is not None or dst.partial is not None:
        return build_pending(src, dst)
    return Plan(src, dst)
