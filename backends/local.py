"""The embedded backend: every rank's shards live in this process, on their placed devices."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from fshard._boxes import rows_all, rows_prod, unique_rows
from fshard._errors import SpecError
from fshard._log import log_move

__all__ = [
    "LOCAL",
    "POOL_LIMIT_BYTES",
    "Counters",
    "LocalBackend",
    "accumulate",
    "box_slices",
    "combine_into",
    "empty_cache",
    "identity",
    "needs_fill",
    "reduce_plan",
]

# Memory of dead CPU output shards kept for reuse, at most this many bytes (see ``_Pool``).
POOL_LIMIT_BYTES = 1 << 30
# Smaller blocks come back from malloc's free lists without page faults anyway.
_POOL_MIN_BYTES = 1 << 20
_ALIGN = 64
# Plain element types, which a byte buffer can be viewed as (not quantized ones, say).
_POOL_DTYPES = frozenset(
    {
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
    }
)


@dataclasses.dataclass
class Counters:
    """What a backend has moved: elements that crossed ranks, and collectives run."""

    elements_sent: int = 0
    collectives: int = 0

    def reset(self) -> None:
        """Sets every counter back to zero."""
        self.elements_sent = 0
        self.collectives = 0


def box_slices(lo: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    """Index of the global box ``[lo, lo + size)`` inside a shard whose box starts at ``origin``."""
    return tuple(slice(a - o, a - o + s) for a, s, o in zip(lo, size, origin))


@functools.lru_cache(maxsize=64)
def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        msg = (
            f"Placement device {name!r} is not available in this process "
            f"(torch.cuda.device_count() = {torch.cuda.device_count() if torch.cuda.is_available() else 0}): "
            "place shards on 'cpu' or on a device that exists."
        )
        raise SpecError(msg)
    return device


def shard_device(layout: Any, i: int) -> torch.device:
    """The torch device of shard ``i`` of ``layout``."""
    return _device(layout.shards[i].placement.device)


class _Pool:
    """Recycles the memory of dead CPU output tensors.

    A fresh large allocation costs a page fault per 4 KiB page on first write, which
    takes longer than the copy that fills it (about 3x for 256 MiB here). Outputs are
    carved from numpy blocks through ``torch.from_numpy``, which keeps the block alive
    exactly as long as any tensor or view of it; a finalizer then returns the block
    here, and the next output of the same byte size reuses it, already mapped. Like
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
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached = 0
        self._lock = threading.RLock()  # a finalizer may run inside a locked section

    def empty(self, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor (recycled memory where possible)."""
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes < _POOL_MIN_BYTES or dtype not in _POOL_DTYPES:
            return torch.empty(sizes, dtype=dtype)
        block = self._take(nbytes)
        start = -block.ctypes.data % _ALIGN  # torch's own allocator aligns to 64 bytes; numpy's to 16
        view = block[start : start + nbytes]  # the object torch holds; its death returns ``block``
        weakref.finalize(view, self._give, block, nbytes)
        return torch.from_numpy(view).view(dtype).view(tuple(sizes))

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            blocks = self._free.get(nbytes)
            if blocks:
                self._cached -= nbytes
                return blocks.pop()
        return np.empty(nbytes + _ALIGN, np.uint8)

    def _give(self, block: np.ndarray, nbytes: int) -> None:
        with self._lock:
            if self._cached + nbytes <= POOL_LIMIT_BYTES:
                self._free.setdefault(nbytes, []).append(block)
                self._cached += nbytes

    def clear(self) -> None:
        """Drops every cached block."""
        with self._lock:
            self._free.clear()
            self._cached = 0


_POOL = _Pool()


def empty_cache() -> None:
    """Releases the memory the local backend keeps for reuse (like ``torch.cuda.empty_cache``).

    >>> from fshard.backends.local import empty_cache
    >>> empty_cache()
    """
    _POOL.clear()


def new_shard(layout: Any, i: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor for shard ``i``, with ``like``'s dtype."""
    device = shard_device(layout, i)
    if device.type == "cpu":
        return _POOL.empty(layout.shards[i].sizes, like.dtype)
    return torch.empty(layout.shards[i].sizes, dtype=like.dtype, device=device)


def slice_shards(full: torch.Tensor, layout: Any, index: Iterable[int]) -> tuple[torch.Tensor, ...]:
    """New tensors holding the boxes of shards ``index`` of ``layout``, copied out of ``full``."""
    out = []
    for i in index:
        s = layout.shards[i]
        t = new_shard(layout, i, full)
        if t.numel():  # an empty shard may sit past the end, where the slice would clip
            t.copy_(full[box_slices(s.offsets, s.sizes, (0,) * len(s.offsets))])
        out.append(t)
    return tuple(out)


def copy_plan(plan: Any, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor], rows: Iterable[int]) -> None:
    """Runs the transfers ``rows`` of ``plan`` between shard tensors held in this process."""
    moves = _moves(plan)
    for k in rows:
        i, j, read, write = moves[k]
        dst[j][write].copy_(src[i][read])


@functools.lru_cache(maxsize=32)
def _moves(plan: Any) -> tuple[tuple[int, int, tuple[slice, ...], tuple[slice, ...]], ...]:
    """Per plan row: (source shard, destination shard, index into the source, into the destination).

    Computed once per plan with numpy, so executing a cached plan does no index arithmetic.
    """
    read = (plan.lo - plan.src._lo[plan.src_shard]).tolist()
    write = (plan.lo - plan.dst._lo[plan.dst_shard]).tolist()
    size = plan.size.tolist()
    return tuple(
        (i, j, tuple(map(_slice, r, z)), tuple(map(_slice, w, z)))
        for i, j, r, w, z in zip(plan.src_shard.tolist(), plan.dst_shard.tolist(), read, write, size)
    )


def _slice(start: int, size: int) -> slice:
    return slice(start, start + size)


def identity(op: str, dtype: torch.dtype) -> float | int | bool:
    """The value that ``op`` leaves unchanged: what a destination region no contribution reaches holds."""
    if op == "sum":
        return False if dtype == torch.bool else 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    if dtype.is_complex:
        msg = f"A pending {op} cannot reduce complex values ({dtype}): only 'sum' can; reshard to a real dtype first."
        raise SpecError(msg)
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def accumulate(op: str, into: torch.Tensor, value: torch.Tensor) -> None:
    """``into = op(into, value)``, in place."""
    if op == "sum":
        into.add_(value)
    elif op == "max":
        torch.maximum(into, value, out=into)
    else:
        torch.minimum(into, value, out=into)


@functools.lru_cache(maxsize=32)
def needs_fill(plan: Any) -> frozenset[int]:
    """Destination shards of a reduce phase with elements that no contribution reaches."""
    first, _ = unique_rows(np.c_[plan.dst_shard, plan.lo])
    covered = np.zeros(len(plan.dst.shards), np.int64)
    np.add.at(covered, plan.dst_shard[first], plan.numel[first])
    return frozenset(np.flatnonzero(covered < rows_prod(plan.dst._sz)).tolist())


def reduce_plan(
    plan: Any,
    src: dict[int, torch.Tensor],
    dst: dict[int, torch.Tensor],
    rows: Iterable[int],
    done: set[Any] | None = None,
) -> None:
    """Runs the contributions ``rows`` of a reduce phase, in plan order: the first contribution to a
    region of a destination shard is copied, later ones are combined with ``plan.op``.

    ``done`` names the regions written so far (to share with contributions received later).
    """
    moves, done = _moves(plan), set() if done is None else done
    for k in rows:
        i, j, read, write = moves[k]
        combine_into(plan, j, write, src[i][read], dst, done)


def combine_into(
    plan: Any, j: int, write: tuple[slice, ...], value: torch.Tensor, dst: dict[int, torch.Tensor], done: set[Any]
) -> None:
    """Writes ``value`` into region ``write`` of destination shard ``j``: a copy the first time, else ``plan.op``."""
    key = (j, tuple((w.start, w.stop) for w in write))
    if key in done or j in needs_fill(plan):
        accumulate(plan.op, dst[j][write], value)
    else:
        dst[j][write].copy_(value)
        done.add(key)


@functools.lru_cache(maxsize=256)
def held(layout: Any, rank: int | None = None) -> int:
    """Elements held, summed over ranks (or on ``rank`` only): a box held twice by a rank counts once."""
    keep = rows_all(layout._sz > 0) & (True if rank is None else layout._rank == rank)
    first, _ = unique_rows(np.c_[layout._lo, layout._sz, layout._rank][keep])
    return int(np.prod(layout._sz[keep][first], axis=1).sum())


@dataclasses.dataclass(frozen=True)
class LocalBackend:
    """All ranks in one process: transfers are slice copies; nothing is sent anywhere.

    ``counters.elements_sent`` counts the elements that a multi-process run would
    send (those crossing ranks), so tests can compare it with the plan's minimum.
    """

    name: str = "local"
    counters: Counters = dataclasses.field(default_factory=Counters, compare=False, hash=False, repr=False)

    @property
    def rank(self) -> int | None:
        """``None``: this process holds every rank."""
        return None

    @property
    def world_size(self) -> int:
        """0: any rank may be placed."""
        return 0

    def addressable(self, layout: Any) -> tuple[int, ...]:
        """Every shard."""
        return tuple(range(len(layout.shards)))

    def check_layout(self, layout: Any) -> None:
        """Checks that every placed device exists here."""
        for p in {s.placement.device for s in layout.shards}:
            _device(p)

    def execute(self, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies each transfer's box out of its source shard into a new destination shard
        (combining the contributions of a reduce phase), phase by phase."""
        log_move("local", plan, like.element_size())
        for p in plan.phases:
            out = {j: new_shard(p.dst, j, like) for j in range(len(p.dst.shards))}
            if p.op is None:
                copy_plan(p, dict(enumerate(tensors)), out, range(len(p)))
            else:
                for j in needs_fill(p):
                    out[j].fill_(identity(p.op, like.dtype))
                reduce_plan(p, dict(enumerate(tensors)), out, range(len(p)))
            self.counters.elements_sent += p.elements_sent
            tensors = tuple(out[j] for j in range(len(out)))
        return tuple(tensors)

    def scatter(self, full: torch.Tensor | None, layout: Any, src: int | None) -> tuple[torch.Tensor, ...]:
        """Copies each shard's box out of ``full`` (from rank ``src``: counts what other ranks receive)."""
        assert full is not None
        out = slice_shards(full, layout, range(len(layout.shards)))
        if src is not None:
            self.counters.elements_sent += held(layout) - held(layout, src)
        return tuple(out)

    def assemble(
        self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None
    ) -> torch.Tensor:
        """Writes one copy of every box into a new global tensor (on rank ``dst``'s device)."""
        idx = layout.indices_on(dst) if dst is not None else ()
        device = shard_device(layout, idx[0]) if idx else like.device
        if device.type == "cpu":
            out = _POOL.empty(layout.shape, like.dtype)
        else:
            out = torch.empty(layout.shape, dtype=like.dtype, device=device)
        lo, sz = layout._lo, layout._sz
        nonempty = rows_all(sz > 0)
        first, _ = unique_rows(np.c_[lo, sz][nonempty])
        for i in np.flatnonzero(nonempty)[first].tolist():
            out[box_slices(lo[i].tolist(), sz[i].tolist(), [0] * layout.ndim)].copy_(tensors[i])
        # What each receiving rank lacks: rank dst, or every rank of the layout.
        if dst is None:
            self.counters.elements_sent += len(layout.ranks) * layout.numel - held(layout)
        else:
            self.counters.elements_sent += layout.numel - held(layout, dst)
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """A single process: its own object."""
        return [obj]


LOCAL = LocalBackend()
