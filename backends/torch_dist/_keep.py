"""The tensors of collectives that a process group's own threads run, kept until those threads let go.

Gloo runs a collective on a worker thread of the process group, which holds the collective's
tensors until it drops the finished work, a moment after ``wait()`` returns (a later barrier
holds the work that was in progress when it started, too). A tensor that Python has let go of
by then (a byte view made for the call, a buffer dropped after the wait) is freed on that
thread, which must take the GIL to free its Python object. At interpreter exit the GIL is no
longer handed to other threads: the thread is stopped inside a destructor and the process
aborts ("terminate called without an active exception"). So every tensor handed to such a
collective is kept here until only Python holds it (``Tensor._use_count()``: the references
to the tensor itself, one for its Python object), and the process waits at exit, a bounded
time, for the group's threads to let go of the rest.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import torch

__all__ = ["keep", "kept"]

_KEPT: list[tuple[torch.Tensor, ...]] = []
_LOCK = threading.Lock()
_EXIT_WAIT_S = 5.0


def _held(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether something besides its Python object still holds one of ``tensors``."""
    return any(_use_count(t) > 1 for t in tensors)


def _use_count(t: torch.Tensor) -> int:
    """The references to ``t`` itself (its Python object is one); not in torch's stubs."""
    count: Any = getattr(t, "_use_count")  # noqa: B009
    return int(count())


def _sweep() -> int:
    """Drops the tensors that only Python holds now; returns how many calls' tensors stay kept."""
    with _LOCK:
        _KEPT[:] = [k for k in _KEPT if _held(k)]
        return len(_KEPT)


def keep(*tensors: torch.Tensor) -> None:
    """Keeps ``tensors``, just handed to a collective, until the process group's threads let go of them."""
    _sweep()
    with _LOCK:
        _KEPT.append(tensors)


def kept() -> int:
    """How many collectives' tensors are kept now (for tests)."""
    return _sweep()


@atexit.register
def _let_go_at_exit() -> None:
    """Waits (at most ``_EXIT_WAIT_S``) for the process groups' threads to let go of the kept tensors."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    while _sweep() and time.monotonic() < deadline:
        time.sleep(0.001)
