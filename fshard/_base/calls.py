"""The public fshard call in progress on this thread, as check mode describes it.

``fshard._exec.collective`` pushes the description of the outermost public call
(``reshard(a: ..., spec: Chunk(...))``) while it runs; a backend's checks read it to
name the call they serve. One stack per thread: calls on two threads (on two process
groups) never see each other's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator

__all__ = ["call_name", "calling"]

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
