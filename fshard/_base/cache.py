"""The caches of pure functions of layouts (plans, schedules, indexes), in one registry.

``cached(maxsize)`` is ``functools.lru_cache(maxsize)`` (a hit costs what a hit of
``lru_cache`` costs) that also counts the bytes of what it keeps: on each miss, the
numpy arrays (and layouts) reachable from the new result are measured. A layout is
counted once, from the first entry that holds it until it dies: the caches of one
movement (its plan, schedules, digests) key on the same layout objects, and at thousands
of ranks a layout's columns are most of an entry, so charging it per entry would count
one layout many times and empty the caches long before their memory is at the budget;
and a layout lives as long as any cache (or array) holds it, whichever entry charged it.
All caches share one budget, ``CACHE_LIMIT_BYTES``: when a miss takes the total past it,
every cache is emptied (and the layouts counted are forgotten with them). Entries that
``lru_cache`` drops by count are subtracted at the cache's average entry size, so
the total is an estimate, not an exact figure. ``fshard.clear_caches()`` empties
every cache (and hands the local backend's pooled memory back).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from fshard._base import alloc as _alloc

__all__ = ["CACHE_LIMIT_BYTES", "cache_bytes", "cached", "clear_caches"]

CACHE_LIMIT_BYTES = 1 << 30

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(eq=False)
class _Cache:
    name: str
    fn: Any = None
    bytes: int = 0


_REGISTRY: list[_Cache] = []
# The objects with a size of their own (layouts) counted since the caches were last emptied, by id: each
# with the finalizer that takes its bytes off ``_LIVE_BYTES`` when it dies.
_COUNTED: dict[int, weakref.finalize[Any, Any]] = {}
_LIVE_BYTES = [0]


def cached(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered and counted against the shared byte budget."""

    def wrap(fn: F) -> F:
        entry = _Cache(f"{fn.__module__}.{fn.__qualname__}")

        def miss(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            _charge(entry, _nbytes(out) + _nbytes(args))  # the key keeps its layouts alive too
            return out

        memo = functools.lru_cache(maxsize=maxsize)(functools.wraps(fn)(miss))
        entry.fn = memo
        _REGISTRY.append(entry)
        return memo  # type: ignore[return-value]

    return wrap


def cache_bytes() -> int:
    """The estimated bytes held by every registered cache."""
    return sum(c.bytes for c in _REGISTRY) + _LIVE_BYTES[0]


def clear_caches() -> None:
    """Empties every cache of plans, schedules and layout indexes, and the local backend's memory pool.

    The pool holds reusable CPU memory. Results stay correct; the next calls plan afresh.

    >>> import fshard
    >>> fshard.clear_caches()
    """
    _clear_all()
    _alloc.empty_cache()


def _charge(entry: _Cache, nbytes: int) -> None:
    info = entry.fn.cache_info()
    if info.maxsize is not None and info.currsize >= info.maxsize:  # lru_cache drops its oldest to keep this one
        entry.bytes -= entry.bytes // info.currsize
    entry.bytes += nbytes
    if cache_bytes() > CACHE_LIMIT_BYTES:  # every cache: a layout counted for one may be held by others
        _clear_all()


def _clear_all() -> None:
    for c in _REGISTRY:
        c.fn.cache_clear()
        c.bytes = 0
    for done in _COUNTED.values():  # a layout that the next entries hold is counted again
        done.detach()
    _COUNTED.clear()
    _LIVE_BYTES[0] = 0


def _count(x: object, nbytes: int) -> None:
    """Counts ``x``'s ``nbytes`` until it dies (or the caches are emptied)."""
    key = id(x)
    _LIVE_BYTES[0] += nbytes
    _COUNTED[key] = weakref.finalize(x, _gone, key, nbytes)


def _gone(key: int, nbytes: int) -> None:
    _COUNTED.pop(key, None)
    _LIVE_BYTES[0] -= nbytes


def _nbytes(x: object, depth: int = 0) -> int:
    """Bytes of the numpy arrays reachable from ``x`` (a few levels deep), plus a small charge per object.

    A layout counts its columns and its shard objects.
    """
    if isinstance(x, np.ndarray):
        return int(x.nbytes) + 112
    if depth > 4 or x is None or isinstance(x, (int, float, str, bool)):
        return 64
    hook = getattr(type(x), "__fshard_nbytes__", None)
    if hook is not None:  # a value that knows its size (a layout: its columns), counted once while it lives
        if id(x) not in _COUNTED:  # a dead one's id is taken off as it dies, so an id here is x's
            _count(x, int(hook(x)))
        return 64
    if isinstance(x, (tuple, list)):
        seq = cast("Sequence[object]", x)
        sample = seq[:64]  # a long sequence is charged as many times its first 64 items
        return 56 + sum(_nbytes(v, depth + 1) for v in sample) * len(seq) // max(len(sample), 1)
    if isinstance(x, dict):
        items = list(cast("dict[object, object]", x).items())[:64]
        return 64 + sum(_nbytes(k, depth + 1) + _nbytes(v, depth + 1) for k, v in items)
    fields = getattr(x, "__dict__", None)
    if fields is None and dataclasses.is_dataclass(x):
        fields = {f.name: getattr(x, f.name, None) for f in dataclasses.fields(x)}
    if fields:
        return 64 + sum(_nbytes(v, depth + 1) for v in fields.values())
    return 64
