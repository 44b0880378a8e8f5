"""The ``fshard`` logger: each plan and each data movement at DEBUG.

fshard logs nothing at INFO or above by default and adds only a ``NullHandler``;
turn the messages on as for any library::

    logging.basicConfig()
    logging.getLogger("fshard").setLevel(logging.DEBUG)

>>> import logging, fshard
>>> from fshard._log import plan_message
>>> plan_message(fshard.plan(fshard.Chunk(0, [0, 1]).layout((4, 2)), fshard.Chunk(1, [0, 1]).layout((4, 2))))
'plan (4, 2): 2 -> 2 shards, 4 transfers, 4 elements sent between ranks (minimum 4)'
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["log_move", "log_plan", "logger", "move_message", "plan_message"]

logger = logging.getLogger("fshard")
logger.addHandler(logging.NullHandler())


def plan_message(plan: Any) -> str:
    """One line about ``plan``: its shape, shards, transfers and elements sent (and the minimum)."""
    return (
        f"plan {plan.src.shape}: {len(plan.src.shards)} -> {len(plan.dst.shards)} shards, "
        f"{len(plan)} transfers, {plan.elements_sent} elements sent between ranks "
        f"(minimum {plan.min_elements_sent})"
    )


def move_message(backend: str, plan: Any, itemsize: int, rank: int | None = None) -> str:
    """One line about a plan that a backend runs: the plan and its bytes sent between ranks."""
    where = "" if rank is None else f" (rank {rank})"
    return f"{backend}{where} runs {plan_message(plan)}: {plan.bytes_sent(itemsize)} bytes of {itemsize}-byte elements"


def log_plan(plan: Any) -> None:
    """Logs ``plan`` at DEBUG; costs one level check when DEBUG is off."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(plan_message(plan))


def log_move(backend: str, plan: Any, itemsize: int, rank: int | None = None) -> None:
    """Logs a plan that a backend runs, with its bytes, at DEBUG; one level check when DEBUG is off."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(move_message(backend, plan, itemsize, rank))
