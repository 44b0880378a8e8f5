"""Output memory for shards: recycled CPU blocks, shared by every backend and the checkpoint loader."""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "POOL_LIMIT_BYTES",
    "POOL_MIN_BYTES",
    "contiguous_strides",
    "empty_cache",
    "new",
    "no_summand",
    "sum_zero",
    "use_count",
]

# Memory of dead CPU output shards kept for reuse, at most this many bytes (see ``_Pool``).
POOL_LIMIT_BYTES = 1 << 30
# Smaller blocks come back from malloc's free lists without page faults anyway. Up to 32 MiB
# glibc often reuses freed blocks too, but not reliably: with several buffers alive and other
# threads (Gloo's) allocating, it may trim them and fault again on every call (docs/performance.md,
# "Output memory"), so the pool starts at 1 MiB.
POOL_MIN_BYTES = 1 << 20
# Plain element types, which a byte block can hold (not quantized ones, say), each with an
# empty tensor whose ``new()`` starts an output (faster than ``torch.empty(0, dtype=...)``).
_PLAIN = {
    d: torch.empty(0, dtype=d)
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
# How many tensors (and Python storage objects) use a storage; without it (a torch that lacks
# this private call) the pool cannot tell a dead block from a live one and stays out of the way.
use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # pyright: ignore[reportPrivateUsage]  # no public form


def _listed_refs(blocks: list[torch.UntypedStorage], k: int) -> int:
    """The refcount of ``blocks[k]`` seen from here (the same count wherever this is called)."""
    return sys.getrefcount(blocks[k])


# The references to a block held in one list and nothing else, as ``_listed_refs`` counts them.
_LISTED = _listed_refs([torch.UntypedStorage(0)], 0)


def _in_use(blocks: list[torch.UntypedStorage], k: int) -> bool:
    """Whether anything besides ``blocks`` uses ``blocks[k]``.

    Tensors count in the storage's use count. ``t.untyped_storage()`` returns the very Python
    object the pool holds, so a storage object kept alone counts in its refcount only.
    """
    return use_count(blocks[k]._cdata) > 1 or _listed_refs(blocks, k) > _LISTED  # type: ignore[misc]


class _Pool:
    """Recycles the memory of dead CPU output tensors.

    A fresh large allocation costs a page fault per 4 KiB page on first write, which
    takes longer than the copy that fills it (about 3x for 256 MiB here). Outputs are
    tensors on torch-owned byte storages (blocks) that the pool keeps, so every output is an
    ordinary torch tensor: ``resize_``, ``out=`` and ``untyped_storage().resize_(0)`` work
    on it. A block is free again once the pool holds its only reference. The weak reference
    to the tensor handed out tells when to look: its callback runs while the dying tensor
    still holds the storage, so the block is looked at on the pool's next call (a later
    callback, a take, ``clear()``). A block that something else still uses then (its storage
    object kept alone, a tensor made on it with ``set_``) is looked at again on each take
    that finds nothing to reuse. A block whose storage a user resized or shared is dropped.
    Like torch's CUDA caching allocator, memory stays reserved after its arrays die, up to
    ``POOL_LIMIT_BYTES``; ``empty_cache()`` hands it back.

    >>> pool = _Pool()
    >>> a = pool.empty((1024, 1024), torch.float32)
    >>> address = a.data_ptr()
    >>> del a  # its block goes back to the pool...
    >>> b = pool.empty((512, 2048), torch.float32)
    >>> b.data_ptr() == address  # ...and the next output of 4 MiB reuses it
    True
    >>> pool.empty((1024, 1024), torch.float32).data_ptr() != address  # b is alive: not shared
    True
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # bytes -> blocks no tensor uses
        # By id: blocks of living outputs.
        self._live: dict[int, tuple[weakref.ref[torch.Tensor], torch.UntypedStorage]] = {}
        self._dying: list[torch.UntypedStorage] = []  # outputs died: look at the next call
        self._held: list[torch.UntypedStorage] = []  # outputs died but something else used the block
        self._cached = 0
        self._lock = threading.RLock()  # a weakref callback may run inside a locked section

    def empty(self, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor (recycled memory where possible)."""
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes < POOL_MIN_BYTES or dtype not in _PLAIN or use_count is None:
            return torch.empty(sizes, dtype=dtype)
        block = self._take(nbytes)
        t = _PLAIN[dtype].new().set_(block, 0, tuple(sizes), contiguous_strides(sizes))
        ref = weakref.ref(t, self._dead)
        with self._lock:
            self._live[id(ref)] = (ref, block)
        return t

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            self._settle(self._dying)
            if not self._free.get(nbytes):
                self._settle(self._held)  # a miss pays for a fresh block: look for blocks freed late too
            blocks = self._free.get(nbytes)
            if blocks:
                self._cached -= nbytes
                return blocks.pop()
        return torch.UntypedStorage(nbytes)  # torch's allocator aligns to 64 bytes

    def _settle(self, blocks: list[torch.UntypedStorage]) -> None:
        """Frees the blocks of ``blocks`` that only the pool uses; keeps the others in ``_held``."""
        if not blocks:
            return
        looked, blocks[:] = list(blocks), []
        for k in range(len(looked)):  # by index: a loop variable would count as a reference
            if _in_use(looked, k):
                self._held.append(looked[k])
            elif self._keeps(looked[k]):
                self._free.setdefault(looked[k].nbytes(), []).append(looked[k])
                self._cached += looked[k].nbytes()

    def _keeps(self, block: torch.UntypedStorage) -> bool:
        """Whether a dead block goes back to the free lists: unresized, unshared and within the limit."""
        nbytes = block.nbytes()
        return nbytes >= POOL_MIN_BYTES and not block.is_shared() and self._cached + nbytes <= POOL_LIMIT_BYTES

    def _dead(self, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            _, block = self._live.pop(id(ref))
            self._settle(self._dying)  # their tensors are gone by now
            self._dying.append(block)

    def clear(self) -> None:
        """Drops every cached block."""
        with self._lock:
            self._settle(self._dying)
            self._settle(self._held)
            self._free.clear()
            self._cached = 0


POOL = _Pool()


def empty_cache() -> None:
    """Releases the memory the local backend keeps for reuse (like ``torch.cuda.empty_cache``).

    >>> from fshard._base.alloc import empty_cache
    >>> empty_cache()
    """
    POOL.clear()


def new(sizes: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor; on the CPU from recycled memory where the pool has some."""
    if device.type == "cpu":
        return POOL.empty(sizes, dtype)
    return torch.empty(sizes, dtype=dtype, device=device)


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``sizes``, as ``torch.empty`` gives them (a zero extent counts as one)."""
    out: list[int] = []
    step = 1
    for n in reversed(sizes):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def sum_zero(dtype: torch.dtype) -> complex | float | int | bool:
    """What a summand that adds nothing holds: -0.0 for floating and complex dtypes, else 0.

    -0.0, not 0.0: ``x + -0.0`` is ``x`` for every ``x``, where ``-0.0 + 0.0`` is ``0.0``, so a
    pending sum of one -0.0 keeps its sign (the bits a round trip through ``Partial`` gives back).

    >>> sum_zero(torch.float32), sum_zero(torch.int64), sum_zero(torch.bool)
    (-0.0, 0, False)
    """
    if dtype.is_complex:
        return complex(-0.0, -0.0)
    return -0.0 if dtype.is_floating_point else False if dtype == torch.bool else 0


def no_summand(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with ``sum_zero`` of its dtype: a summand of a pending sum that adds nothing."""
    return t.fill_(sum_zero(t.dtype))
