"""The fshard call in progress on this thread: its name (check mode), and whether it records a gradient.

``fshard._exec.collective`` pushes the description of the outermost public call
(``reshard(a: ..., spec: Chunk(...))``) while it runs; a backend's checks read it to
name the call they serve. One stack per thread: calls on two threads (on two process
groups) never see each other's. A movement of arrays whose inputs require grad (grad
mode on) marks that it records a gradient while it runs, and a tree's leaves moved as one
which of them do (``recording_leaves``); a backend's movement headers carry both marks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any

import torch

from fshard._errors import SpecError

__all__ = [
    "RECORD_ALIKE",
    "block_function",
    "call_name",
    "calling",
    "recording_leaves",
    "records_gradient",
    "refuse_in_block_function",
    "set_records_gradient",
]

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


# torch's stack of dispatch modes (the C functions behind torch.utils._python_dispatch's helpers).
_depth: Callable[[], int] = torch._C._len_torch_dispatch_stack  # pyright: ignore[reportPrivateUsage]
_mode_at: Callable[[int], Any] = torch._C._get_dispatch_stack_at  # pyright: ignore[reportPrivateUsage]


def block_function() -> str | None:
    """The name of the per-block function (``map_local()``, ``shard_map()``) whose ``fn`` runs on this thread, if any.

    While ``fn`` runs, its in-place check is on torch's dispatch stack and carries that name in
    ``block_function`` (``fshard._exec.readonly``). The stack's depth is read first: most calls
    run with no mode on it.
    """
    for i in range(_depth()):
        what: str | None = getattr(_mode_at(i), "block_function", None)
        if what is not None:
            return what
    return None


def refuse_in_block_function(doing: str) -> None:
    """Raises ``SpecError`` where a per-block function's ``fn`` runs on this thread: ``doing`` is of arrays.

    ``fn`` runs once per placement, on tensors that are that placement's: in one process once
    for each placement, across processes once on each rank. A function of arrays called there
    (a movement, a computation, a read of an array's blocks) would run a different number of
    times on each backend, or read every rank's blocks in one process and this rank's across
    processes, and the gradients of what it returns would be counted differently on each.
    ``doing``: what was done, as ``"gather() was called"``.
    """
    if torch.compiler.is_compiling() or not _depth():  # (TorchDynamo enters no check while it traces)
        return
    what = block_function()
    if what is not None:
        msg = (
            f"{doing} inside {what}'s fn, which runs once per placement on that placement's blocks: in one process "
            "once for each placement, across processes once on each rank. A function of arrays there would run a "
            "different number of times on each backend, on tensors that are one placement's, not global values "
            "(each rank would take its own block for the same array), and the gradient of what it returns would "
            f"be counted differently on each. Call it before {what} and pass its arrays in with their specs (fn "
            "gets each placement's blocks), or close over what it returns (a gathered tensor used inside fn gets "
            "the sum of every placement's gradient); reduce across placements inside fn with fshard.psum."
        )
        raise SpecError(msg)


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


def recording_leaves() -> int:
    """Of a tree's leaves moved as one, a digest of which record a gradient on this rank; 0 for one array.

    One leaf recording on some ranks only would otherwise hide behind another that records on
    every rank: the movement records on every rank all the same.
    """
    return getattr(_LOCAL, "leaves", 0)


def moving_tree() -> int:
    """A digest of the tree whose several movements run on this thread (``set_moving_tree``); 0 elsewhere.

    A tree moved in several movements (one per dtype, or leaves that move alone) carries it in
    every movement's header, so a rank that moves another tree (another leaf, or one more)
    raises at the first of them, not later, where a movement of its own would pair with
    another rank's next call.
    """
    return getattr(_LOCAL, "tree", 0)


def set_moving_tree(tree: int) -> int:
    """Sets ``moving_tree()`` on this thread; returns what it was, to set back."""
    prior = getattr(_LOCAL, "tree", 0)
    _LOCAL.tree = tree
    return prior


def set_records_gradient(on: bool, leaves: int = 0) -> tuple[bool, int]:
    """Sets ``records_gradient()`` and ``recording_leaves()`` on this thread; returns what they were, to set back."""
    prior = getattr(_LOCAL, "grad", False), getattr(_LOCAL, "leaves", 0)
    _LOCAL.grad, _LOCAL.leaves = on, leaves
    return prior
