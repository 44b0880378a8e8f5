"""Movements started now and waited for later: a pass that launches them, a pass that lands them.

A movement of a tree of arrays (``fused.move_tree``) is a few plans run one after another,
with packing before and unpacking after. To leave its collectives in flight while other work
runs, the tree is moved twice, with the same recipe:

- **launching** (under ``torch.no_grad``): each plan the movement would run is started
  (``backend.launch``, where the backend has one; else it runs at once) and its wait kept,
  in order. The pass's results are placeholders on the meta device, which nobody reads.
- **landing**: the movement runs again where its result is wanted, under the grad mode of
  that moment, and each plan, instead of running, waits for the one launched in its place.
  Its packing and unpacking, and its autograd functions, are those of a movement run then,
  so values and gradients are bit-identical, and the backward is the movement's own.

Both passes make the same plans in the same order (the recipe is a function of the layouts);
landing checks each plan against the one launched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from fshard._errors import SpecError
from fshard._exec import readonly as _readonly
from fshard._layout.show import describe_layout

__all__ = ["Launches", "Pending", "add", "claim", "drop", "execute", "landing", "launching", "pending", "versions"]


class Launches:
    """The plans one launching pass started, in order: each one's plan, dtype and wait."""

    __slots__ = ("landed", "started")

    def __init__(self) -> None:
        self.started: list[tuple[Any, torch.dtype, Callable[[], tuple[torch.Tensor, ...]]]] = []
        self.landed = 0

    def land(self, plan: Any, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The next launched plan's result (it must be ``plan`` of ``dtype``), once it has arrived."""
        if self.landed >= len(self.started):
            raise RuntimeError("fshard internal error: a landing pass runs more plans than were launched.")
        launched, of, wait = self.started[self.landed]
        # The same layouts (a plan is cached, but may have been made again in between).
        if of != dtype or (launched is not plan and (launched.src != plan.src or launched.dst != plan.dst)):
            raise RuntimeError("fshard internal error: a landing pass runs other plans than were launched.")
        self.landed += 1
        return wait()

    def finish(self) -> None:
        """Waits for every launched plan not landed yet (a movement given up: nothing is left in flight).

        Its results are dropped, so no gradient is recorded: they may view sources written in
        place since the launch (the reason a claim gives it up), which autograd refuses to
        record a use of.
        """
        with torch.no_grad():
            while self.landed < len(self.started):
                self.started[self.landed][2]()
                self.landed += 1


_MODE = threading.local()  # ``mode``: None, or ("launch" | "land", Launches)


def _set(mode: tuple[str, Launches] | None) -> tuple[str, Launches] | None:
    previous: tuple[str, Launches] | None = getattr(_MODE, "mode", None)
    _MODE.mode = mode
    return previous


@contextlib.contextmanager
def launching() -> Generator[Launches, None, None]:
    """A launching pass: the plans run in it are started, and gathered in the ``Launches`` yielded."""
    launches = Launches()
    previous = _set(("launch", launches))
    try:
        with torch.no_grad():
            yield launches
    finally:
        _set(previous)


@contextlib.contextmanager
def landing(launches: Launches) -> Generator[None, None, None]:
    """A landing pass: the plans run in it take, in order, the results of those in ``launches``."""
    previous = _set(("land", launches))
    try:
        yield
    finally:
        _set(previous)
    if launches.landed != len(launches.started):
        raise RuntimeError("fshard internal error: a landing pass ran fewer plans than were launched.")


def execute(backend: Any, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``backend.execute(plan, tensors, like)``, or its launch or landing inside such a pass."""
    mode: tuple[str, Launches] | None = getattr(_MODE, "mode", None)
    if mode is None:
        return backend.execute(plan, tensors, like)
    kind, launches = mode
    if kind == "land":
        return launches.land(plan, like.dtype)
    start = getattr(backend, "launch", None)
    if start is None:  # a backend that runs everything at once (one process: copies)
        result = backend.execute(plan, tensors, like)
        launches.started.append((plan, like.dtype, lambda: result))
    else:
        launches.started.append((plan, like.dtype, start(plan, tensors, like)))
    sizes: Any = plan.dst.columns.sz
    return tuple(
        torch.empty(tuple(sizes[j].tolist()), dtype=like.dtype, device="meta") for j in backend.addressable(plan.dst)
    )


class Pending:
    """A tree's movement launched ahead of its use (``fshard.prefetch``): its sources, targets and launches.

    ``versions``: the sources' shard tensors' version counters when it was launched.
    """

    __slots__ = ("ids", "launches", "layouts", "precision", "sources", "versions", "what")

    def __init__(self, sources: Sequence[Any], layouts: Sequence[Any], precision: Any, what: str) -> None:
        self.sources, self.layouts, self.precision, self.what = tuple(sources), tuple(layouts), precision, what
        self.ids = frozenset(id(a) for a in self.sources)
        self.versions = versions(self.sources)
        self.launches = Launches()


_PENDING: list[Pending] = []  # launched and not yet used, oldest first
_LOCK = threading.Lock()


def versions(arrays: Sequence[Any]) -> tuple[int, ...]:
    """The version counters of the arrays' shard tensors (an in-place write bumps one)."""
    return tuple(_readonly.versions(t for a in arrays for t in a.addressable_data))


def pending() -> tuple[Pending, ...]:
    """The movements launched ahead and not used yet, oldest first."""
    with _LOCK:
        return tuple(_PENDING)


def add(p: Pending) -> None:
    """Registers ``p``: the next movement of exactly its sources to its targets takes its data."""
    with _LOCK:
        _PENDING.append(p)


def drop(p: Pending) -> bool:
    """Removes ``p`` from the pending movements; whether it was there."""
    with _LOCK:
        if p in _PENDING:
            _PENDING.remove(p)
            return True
        return False


def claim(arrays: Sequence[Any], layouts: Sequence[Any], precision: Any) -> Pending | None:
    """The pending movement of exactly ``arrays`` to ``layouts`` in ``precision``, taken off the list.

    ``None`` where no pending movement holds any of ``arrays``. The caller lands it.

    Raises:
        SpecError: a pending movement holds some of ``arrays`` but is not this movement (other
            arrays besides, other layouts or another precision), or its sources were written
            in place since it was launched.
    """
    if not _PENDING:
        return None
    ids = {id(a) for a in arrays}
    with _LOCK:
        found = next((p for p in _PENDING if not p.ids.isdisjoint(ids)), None)
        if found is None:
            return None
        _PENDING.remove(found)
    _check_claim(found, arrays, layouts, precision)
    return found


def _check_claim(p: Pending, arrays: Sequence[Any], layouts: Sequence[Any], precision: Any) -> None:
    """Raises ``SpecError`` unless the movement of ``arrays`` to ``layouts`` is ``p``'s, on unchanged sources."""
    by_id = {id(a): (k, x) for k, (a, x) in enumerate(zip(arrays, layouts))}
    missing = [k for k, a in enumerate(p.sources) if id(a) not in by_id]
    extra = [k for k, a in enumerate(arrays) if id(a) not in p.ids]
    moved = [k for k, (a, x) in enumerate(zip(p.sources, p.layouts)) if id(a) in by_id and by_id[id(a)][1] != x]
    problem = ""
    if missing or extra:
        problem = (
            f"it moves {len(arrays)} arrays, {len(extra)} of them not prefetched, while {len(missing)} of the "
            f"{len(p.sources)} prefetched arrays are not among them (prefetched arrays {missing[:4]} missing)"
        )
    elif moved:
        k = moved[0]
        problem = (
            f"it moves prefetched array {k} (shape {tuple(p.sources[k].shape)}) to "
            f"{describe_layout(by_id[id(p.sources[k])][1])}, not to {describe_layout(p.layouts[k])} as prefetched"
        )
    elif precision != p.precision:
        problem = f"it moves them in precision {precision!r}, not in {p.precision!r} as prefetched"
    elif versions(p.sources) != p.versions:
        problem = "a prefetched array's shard tensor was written in place since the prefetch started"
    if problem:
        p.launches.finish()
        msg = (
            f"{p.what}: the data prefetched for {len(p.sources)} arrays does not fit the call that uses them: "
            f"{problem}. Prefetch exactly the arrays the next call moves (a block's parameters and buffers "
            "together), to its in_specs and precision, and update them only after that call; the prefetched "
            "data is dropped."
        )
        raise SpecError(msg)
