"""The context a per-block function runs in: tensors it closes over, and ranks that hold no block.

A tensor the function uses from outside its arguments gets the sum of every rank's uses
as its gradient, as an argument does. A rank that holds no block runs no function, so
it cannot take part in that sum: such calls are refused alike on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch

from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec import gathered as _varying
from fshard._exec import regather as _regather
from fshard._exec.agree import closed_apart
from fshard._layout.layout import Layout

__all__ = ["blockless", "per_shard", "refuse_closed", "refuse_closed_apart", "used_gathered"]


def per_shard(
    backend: Any, usage: _varying.Usage, layout: Layout, own: Sequence[torch.Tensor], seen: set[int] | None = None
) -> Any:
    """The context of ``fn``'s calls on the blocks ``own`` of arrays laid out like ``layout``.

    A tensor ``fn`` closes over gets the sum of every rank's uses as its gradient: across
    processes by a view whose backward sums over the ranks; in one process autograd sums
    them, and such tensors are only counted, so that both backends refuse alike: into
    ``seen`` (the ids of those one rank's calls used: ``refuse_closed_apart``), and where
    some rank of a known world holds no block (``refuse_closed``).
    """

    def closed(t: torch.Tensor) -> torch.Tensor:
        return _autograd.summed_uses(t, layout, backend)

    if backend.spans_processes:
        return _regather.saving(_varying.per_shard(backend, usage, closed, own))
    if seen is not None and not torch.compiler.is_compiling():  # (a compiled call's graph holds no mode)
        return _regather.saving(_varying.per_shard(backend, usage, functools.partial(_counted, seen), own))
    closed_here = _unchanged if blockless(backend, layout) else None
    return _regather.saving(_varying.per_shard(backend, usage, closed_here, own))


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    return t


def _counted(seen: set[int], t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, its id noted in ``seen`` (the closed-over tensors of one rank's calls)."""
    seen.add(id(t))
    return t


def refuse_closed_apart(backend: Any, layout: Layout, counts: dict[int, int], what: str) -> None:
    """In one process: refuses closed-over tensors used where some rank holds no block, or by some ranks only.

    ``counts``: per rank whose ``fn`` ran, how many tensors from outside its arguments that require
    grad its calls used. Across processes the ranks compare these numbers at the call's check; in
    one process a rank's calls may take a tensor that an earlier rank's made and kept (a cache),
    counted once for the one and as its sources for the other, so only ranks that used none
    against ranks that used some are told apart.

    Raises:
        SpecError: as ``refuse_closed`` does, or naming the ranks of each number (``closed_apart``).
    """
    refuse_closed(backend, layout, max(counts.values(), default=0), what)
    by_number: dict[int, list[int]] = {}
    for r in sorted(counts):
        by_number.setdefault(counts[r], []).append(r)
    if 0 in by_number and len(by_number) > 1:
        error = closed_apart(what, "; ".join(f"{n} on ranks {rs}" for n, rs in sorted(by_number.items())))
        msg = (
            f"{error} In one process, a tensor that one rank's call made from such tensors and kept for the other "
            "ranks' calls (a cache) counts on that rank alone: make it before the call and close over it instead."
        )
        raise SpecError(msg)


def blockless(backend: Any, layout: Layout) -> list[int]:
    """The ranks of ``backend``'s group that hold no block of ``layout`` (a ``LocalBackend(world_size=n)``: n ranks)."""
    ranks = backend.ranks if backend.spans_processes else range(getattr(backend, "world_size", 0))
    held = set(layout.ranks)
    return [r for r in ranks if r not in held]


def refuse_closed(backend: Any, layout: Layout, closed: int, what: str) -> None:
    """Refuses ``closed`` tensors that ``fn`` used from outside its arguments where some rank holds no block.

    That rank runs no ``fn``, so the sum of their gradients over the ranks cannot include it.

    Raises:
        SpecError: on every rank (``closed`` is every rank's largest count).
    """
    empty = blockless(backend, layout) if closed else []
    if empty:
        msg = (
            f"{what} fn uses {closed} tensor(s) from outside its arguments that require grad (closed over), "
            f"and ranks {empty} hold no block, so they run no fn and cannot take part in summing those gradients "
            "over the ranks. Pass such tensors as arguments (a replicated spec, e.g. fshard.Replicated(ranks)), "
            "or lay the arguments out over every rank."
        )
        raise SpecError(msg)


def used_gathered(backend: Any, layout: Layout, seen: Sequence[tuple[frozenset[int], int]], what: str) -> set[int]:
    """The gathered tensors (ages) that ``fn`` used on some rank, from every rank's usage.

    Raises:
        SpecError: on every rank, for closed-over tensors where some rank holds no block (``refuse_closed``), or
            that ranks used in different numbers.
    """
    refuse_closed(backend, layout, max((n for _, n in seen), default=0), what)
    counts = sorted({n for _, n in seen})
    if len(counts) > 1:  # each is a sum over the ranks in the backward: a rank that used fewer would not join
        raise closed_apart(what, str(counts))
    return cast("set[int]", set().union(*(keys for keys, _ in seen)))
