"""Tensors handed to collectives that a process group's own threads run, watched until those threads let go.

Gloo runs a collective on a worker thread of the process group, which holds the collective's
tensors until it drops the finished work, a moment after ``wait()`` returns (a later barrier
holds the work that was in progress when it started, too). A tensor that Python has let go of
by then (a byte view made for the call, a buffer dropped after the wait) has its Python object
kept alive by the tensor, and freed on that thread, which takes the GIL to do it. During normal
running that is harmless. At interpreter exit the GIL is no longer handed to other threads:
the thread is stopped inside a destructor and the process aborts ("terminate called without
an active exception"). So every tensor handed to such a collective is watched (a weak
reference: nothing is kept alive; a fresh view of each is handed over, so that nothing else
holds it), and at exit the process waits, a bounded time, until no watched tensor is held by
anything but its Python object (``Tensor._use_count()``).
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any

import torch

__all__ = ["handed", "held", "timed_out"]

_WATCHED: dict[int, weakref.ref[torch.Tensor]] = {}  # by id (tensors compare by value, not identity)
_EXIT_WAIT_S = 5.0


def handed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fresh views of ``tensors`` (``detach()``), watched, to hand to a collective instead of them.

    Only the collective holds a fresh view besides Python, so a tensor that something else keeps
    (a gradient, a result) never makes the exit wait.
    """
    views = tuple(t.detach() for t in tensors)
    for t in views:
        key = id(t)
        _WATCHED[key] = weakref.ref(t, lambda ref, key=key: _forget(key, ref))
    return views


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    """Drops a dead tensor's entry (unless the id was taken again since)."""
    if _WATCHED.get(key) is ref:
        del _WATCHED[key]


def _use_count(t: torch.Tensor) -> int:
    """The references to ``t`` itself (its Python object is one); not in torch's stubs."""
    count: Any = getattr(t, "_use_count")  # noqa: B009
    return int(count())


def held() -> int:
    """How many watched tensors something besides their Python object holds now (a collective's work)."""
    alive = [t for ref in list(_WATCHED.values()) if (t := ref()) is not None]
    return sum(1 for t in alive if _use_count(t) > 1)


@atexit.register
def _let_go_at_exit() -> None:
    """Waits (at most ``_EXIT_WAIT_S``) for the process groups' threads to let go of the watched tensors."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    while held() and time.monotonic() < deadline:
        time.sleep(0.001)


def timed_out(exc: RuntimeError) -> bool:
    """Whether ``exc`` is a wait's timeout: a collective's ("timed out"), or Gloo's point-to-point one.

    Gloo ends a ``send``/``recv`` pair whose wait times out with "Application timeout caused
    pair closure", which names no timeout as a collective's does.
    """
    text = str(exc).lower()
    return "timed out" in text or "timeout caused pair closure" in text
