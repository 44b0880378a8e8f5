"""The ``fshard`` logger: each plan and each data movement at DEBUG.

fshard logs nothing at INFO or above by default and adds only a ``NullHandler``;
turn the messages on as for any library::

    logging.basicConfig()
    logging.getLogger("fshard").setLevel(logging.DEBUG)

>>> import logging, fshard
>>> from fshard._log import plan_message
>>> p = fshard.plan(fshard.Chunk(0, [0, 1]).layout((4, 2)), fshard.Chunk(1, [0, 1]).layout((4, 2)))
>>> plan_message(p)
'plan (4, 2): 2 -> 2 shards, 4 elements sent between ranks (the minimum)'
>>> move_message("torch_dist", p, 4, rank=1).split("; ")[1]
'this rank sends 2 elements (8 bytes of 4-byte elements) and receives 2'

Neither reads the plan's global transfers (O(world^2) rows for an all-to-all): the
minimum has a closed form, and a rank's share is its schedule (``plan.for_rank``).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["log_move", "log_plan", "logger", "move_message", "plan_message"]

logger = logging.getLogger("fshard")
logger.addHandler(logging.NullHandler())


def plan_message(plan: Any) -> str:
    """One line about ``plan``: its shape, shards and the elements sent between ranks.

    Every plan sends the minimum.
    """
    return (
        f"plan {plan.src.shape}: {len(plan.src.columns.rank)} -> {len(plan.dst.columns.rank)} shards, "
        f"{plan.min_elements_sent} elements sent between ranks (the minimum)"
    )


def move_message(backend: str, plan: Any, itemsize: int, rank: int | None = None) -> str:
    """One line about a plan that a backend runs: the plan and the bytes sent between ranks.

    The bytes are all of them, or, for one ``rank``, what its schedule sends and receives.
    """
    if rank is None:
        sent = plan.min_elements_sent * itemsize
        return f"{backend} runs {plan_message(plan)}: {sent} bytes of {itemsize}-byte elements"
    s = plan.for_rank(rank)
    return (
        f"{backend} (rank {rank}) runs {plan_message(plan)}; this rank sends {s.elements_sent} elements "
        f"({s.elements_sent * itemsize} bytes of {itemsize}-byte elements) and receives {s.elements_received}"
    )


def log_plan(plan: Any) -> None:
    """Logs ``plan`` at DEBUG; costs one level check when DEBUG is off."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(plan_message(plan))


def log_move(backend: str, plan: Any, itemsize: int, rank: int | None = None) -> None:
    """Logs a plan that a backend runs, with its bytes, at DEBUG; one level check when DEBUG is off."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(move_message(backend, plan, itemsize, rank))
