"""The caches of pure functions of layouts (plans, schedules, indexes), in one registry.

``cached(maxsize)`` is ``functools.lru_cache(maxsize)`` (a hit costs what a hit of
``lru_cache`` costs) that also counts the bytes of what it keeps: on each miss, the
numpy arrays (and layouts) reachable from the new result are measured. All caches
share one budget, ``CACHE_LIMIT_BYTES``: when a miss takes the total past it, the
largest caches are emptied until the total is under half of it. Entries that
``lru_cache`` drops by count are subtracted at the cache's average entry size, so
the total is an estimate, not an exact figure. ``fshard.clear_caches()`` empties
every cache (and hands the local backend's pooled memory back).
"""

from __future__ import annotations

import dataclasses
import functools
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
    entries: int = 0


_REGISTRY: list[_Cache] = []


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
    return sum(c.bytes for c in _REGISTRY)


def clear_caches() -> None:
    """Empties every cache of plans, schedules and layout indexes, and the local backend's memory pool.

    The pool holds reusable CPU memory. Results stay correct; the next calls plan afresh.

    >>> import fshard
    >>> fshard.clear_caches()
    """
    for c in _REGISTRY:
        _clear(c)
    _alloc.empty_cache()


def _charge(entry: _Cache, nbytes: int) -> None:
    size = entry.fn.cache_info().currsize if entry.fn is not None else entry.entries
    if entry.entries and size <= entry.entries:  # lru_cache dropped an entry to make room
        entry.bytes -= entry.bytes // entry.entries
    entry.entries = size + 1
    entry.bytes += nbytes
    if cache_bytes() > CACHE_LIMIT_BYTES:
        for c in sorted(_REGISTRY, key=lambda c: c.bytes, reverse=True):
            _clear(c)
            if cache_bytes() <= CACHE_LIMIT_BYTES // 2:
                break


def _clear(c: _Cache) -> None:
    c.fn.cache_clear()
    c.bytes = c.entries = 0


def _nbytes(x: object, depth: int = 0) -> int:
    """Bytes of the numpy arrays reachable from ``x`` (a few levels deep), plus a small charge per object.

    A layout counts its columns and its shard objects.
    """
    if isinstance(x, np.ndarray):
        return int(x.nbytes) + 112
    if depth > 4 or x is None or isinstance(x, (int, float, str, bool)):
        return 64
    hook = getattr(type(x), "__fshard_nbytes__", None)
    if hook is not None:  # a value that knows its size (a layout: its columns)
        return int(hook(x))
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
