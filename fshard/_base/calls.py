"""The fshard call in progress on this thread: its name (check mode), and whether it records a gradient.

``fshard._exec.collective`` pushes the description of the outermost public call
(``reshard(a: ..., spec: Chunk(...))``) while it runs; a backend's checks read it to
name the call they serve. One stack per thread: calls on two threads (on two process
groups) never see each other's. A movement of arrays whose inputs require grad (grad
mode on) marks that it records a gradient while it runs; a backend's movement headers
carry the mark.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator

__all__ = ["RECORD_ALIKE", "call_name", "calling", "records_gradient", "set_records_gradient"]

# What to do where ranks differ in recording a gradient through a movement (every backend says it alike).
RECORD_ALIKE = (
    "its backward may be a collective that every rank must join (or the backward of the calls that made the "
    "array). Set requires_grad_() on the blocks of every rank, or on none; return results computed from the "
    "arguments on every rank (t.sum() * 0, not torch.zeros(1)), detached (t.detach()) on every rank or on none; "
    "and use torch.no_grad() on every rank or on none."
)

_LOCAL = threading.local()


def _stack() -> list[str]:
    stack: list[str] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def call_name() -> str | None:
    """The description of the outermost fshard call running in check mode on this thread, if any."""
    stack = _stack()
    return stack[0] if stack else None


@contextlib.contextmanager
def calling(what: str) -> Generator[None, None, None]:
    """Marks ``what`` as the call in progress on this thread while the block runs."""
    stack = _stack()
    stack.append(what)
    try:
        yield
    finally:
        stack.pop()


def records_gradient() -> bool:
    """Whether the movement of arrays running on this thread records a gradient (``set_records_gradient``).

    Ranks whose backwards differ there may wait for one another in a collective of it, so
    the ranks' movement headers carry it, and ranks that differ raise at the movement.
    """
    return getattr(_LOCAL, "grad", False)


def set_records_gradient(on: bool) -> bool:
    """Sets ``records_gradient()`` on this thread; returns what it was, to set back."""
    prior = getattr(_LOCAL, "grad", False)
    _LOCAL.grad = on
    return prior
