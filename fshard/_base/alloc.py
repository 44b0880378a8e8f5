"""Output memory for shards: recycled CPU blocks, shared by every backend and the checkpoint loader."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["POOL_LIMIT_BYTES", "POOL_MIN_BYTES", "empty_cache", "new"]

# Memory of dead CPU output shards kept for reuse, at most this many bytes (see ``_Pool``).
POOL_LIMIT_BYTES = 1 << 30
# Smaller blocks come back from malloc's free lists without page faults anyway. Up to 32 MiB
# glibc often reuses freed blocks too, but not reliably: with several buffers alive and other
# threads (Gloo's) allocating, it may trim them and fault again on every call (docs/performance.md,
# "Output memory"), so the pool starts at 1 MiB.
POOL_MIN_BYTES = 1 << 20
_ALIGN = 64
# Plain element types, which a byte buffer can be viewed as (not quantized ones, say), and the
# numpy type of the same size that carries each (numpy's views cost less than torch's).
_CARRIER = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


class _Pool:
    """Recycles the memory of dead CPU output tensors.

    A fresh large allocation costs a page fault per 4 KiB page on first write, which
    takes longer than the copy that fills it (about 3x for 256 MiB here). Outputs are
    carved from numpy blocks through ``torch.from_numpy``, which keeps the block alive
    exactly as long as any tensor or view of it; a weak reference's callback then returns
    the block here, and the next output of the same byte size reuses it, already mapped. Like
    torch's CUDA caching allocator, memory stays reserved after its arrays die, up to
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
        self._free: dict[int, list[tuple[np.ndarray, int]]] = {}  # bytes -> (block, aligned start)
        self._live: dict[int, tuple[weakref.ref, np.ndarray, int, int]] = {}  # by id: the arrays torch holds
        self._cached = 0
        self._lock = threading.RLock()  # a weakref callback may run inside a locked section

    def empty(self, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor (recycled memory where possible)."""
        nbytes = math.prod(sizes) * dtype.itemsize
        carrier = _CARRIER.get(dtype)
        if nbytes < POOL_MIN_BYTES or carrier is None:
            return torch.empty(sizes, dtype=dtype)
        block, start = self._take(nbytes)
        held = block[start : start + nbytes].view(carrier).reshape(sizes)  # its death returns ``block``
        ref = weakref.ref(held, self._dead)
        with self._lock:
            self._live[id(ref)] = (ref, block, start, nbytes)
        t = torch.from_numpy(held)
        return t if t.dtype == dtype else t.view(dtype)

    def _take(self, nbytes: int) -> tuple[np.ndarray, int]:
        with self._lock:
            blocks = self._free.get(nbytes)
            if blocks:
                self._cached -= nbytes
                return blocks.pop()
        block = np.empty(nbytes + _ALIGN, np.uint8)
        return block, -block.ctypes.data % _ALIGN  # torch's own allocator aligns to 64 bytes; numpy's to 16

    def _dead(self, ref: weakref.ref) -> None:
        with self._lock:
            _, block, start, nbytes = self._live.pop(id(ref))
            if self._cached + nbytes <= POOL_LIMIT_BYTES:
                self._free.setdefault(nbytes, []).append((block, start))
                self._cached += nbytes

    def clear(self) -> None:
        """Drops every cached block."""
        with self._lock:
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
