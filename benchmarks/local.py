"""Local backend.

``fshard.reshard`` against a plain ``Tensor.copy_`` of the same boxes, and the fixed cost of small calls against the
same result written by hand.

The floor copies every box of the plan (sent or kept on its rank) from the source
shards into destination tensors allocated once, before timing. ``reshard`` must also
allocate its outputs (arrays are immutable); it reuses the memory of outputs that
have died (``fshard/_base/alloc.py``, ``_Pool``). The "fresh memory" row empties that
pool before every call, so its outputs pay the kernel's page faults on first write:
the cost any newly allocated tensor pays, ``torch.empty`` or ``clone`` alike.

The small-array cases time ``reshard`` (dim-0 chunks to dim-1 chunks), ``gather`` and
``map_local`` of a 64x64 float32 on 4 ranks against the fewest torch calls that give
the same tensors: ``torch.cat`` of the column slices of each source shard per
destination shard, ``torch.cat`` of the shards, and the function on each shard. At
this size the data is 16 KiB and what is left is fshard's fixed cost per call.

The output-memory cases time a new CPU tensor filled by ``copy_``: from ``torch.empty``
against a block of fshard's pool, per size: what the pool costs where malloc reuses
freed memory itself (one thread, one buffer at a time, below glibc's 32 MiB mmap
threshold) and what it saves where malloc maps fresh pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import fshard
from fshard._base.alloc import POOL_MIN_BYTES, _Pool
from fshard.backends._execution import box_slices
from fshard.backends.local import empty_cache

from .common import Row, Settings, Timed, interleaved, median

__all__ = ["AllocCase", "ReshardCase", "SmallCase", "cases"]

GROUP = "local backend"
SMALL_GROUP = "local backend, small arrays"
ALLOC_GROUP = "output memory"
SMALL_SIDE = 64
RANKS = [0, 1, 2, 3]
SPECS: dict[str, tuple[Any, Any]] = {
    "chunk dim 0 -> dim 1": (fshard.Chunk(0, RANKS), fshard.Chunk(1, RANKS)),
    "2x2 grid -> rows": (fshard.Named(fshard.Mesh((2, 2)), ("x", "y")), fshard.Chunk(0, RANKS)),
}


def floor_copies(array: fshard.ShardedArray, dst: fshard.Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) of every plan box, destinations preallocated."""
    p = fshard.plan(array.layout, dst)
    src = array.addressable_data
    out = [torch.empty(s.sizes, dtype=array.dtype) for s in dst.shards]
    pairs = []
    for k in range(len(p)):
        i, j = int(p.src_shard[k]), int(p.dst_shard[k])
        lo, size = p.lo[k].tolist(), p.size[k].tolist()
        read = box_slices(lo, size, p.src.columns.lo[i].tolist())
        write = box_slices(lo, size, p.dst.columns.lo[j].tolist())
        pairs.append((out[j][write], src[i][read]))
    return pairs


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in pairs:
        d.copy_(s)


@dataclasses.dataclass(frozen=True)
class ReshardCase:
    """One layout pair at one size (float32, square)."""

    pair: str
    mib: float
    group: str = GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"reshard {self.pair}, {self.mib:g} MiB float32"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        side = max(1, int((self.mib * 2**20 // 4) ** 0.5))
        src_spec, dst_spec = SPECS[self.pair]
        x = fshard.shard(torch.rand(side, side), src_spec)
        dst = dst_spec.layout((side, side))
        pairs = floor_copies(x, dst)
        moved = sum(d.numel() for d, _ in pairs) * 4
        fns = {
            "copy_ floor": Timed(lambda: _copy_all(pairs)),
            "fshard reshard": Timed(lambda: fshard.reshard(x, dst_spec)),
            "fshard reshard, fresh memory": Timed(lambda: fshard.reshard(x, dst_spec), setup=empty_cache),
        }
        samples = interleaved(fns, settings)
        floor = median(samples["copy_ floor"])
        note = f"{moved / 2**20:.0f} MiB copied in {len(pairs)} boxes"
        series = {"series": f"reshard {self.pair}", "size_mib": float(self.mib)}
        rows = [Row(GROUP, self.name, "copy_ floor", floor, len(samples["copy_ floor"]), note=note,
                    samples=tuple(samples["copy_ floor"]), **series)]  # fmt: skip
        for impl in ("fshard reshard", "fshard reshard, fresh memory"):
            seconds = median(samples[impl])
            headline = impl == "fshard reshard" and self.mib >= 256
            rows.append(Row(GROUP, self.name, impl, seconds, len(samples[impl]), seconds / floor, "x copy_",
                            "<= 1.3x copy_" if headline else "", seconds / floor <= 1.3 if headline else None,
                            samples=tuple(samples[impl]), **series))  # fmt: skip
        empty_cache()
        return rows


def _by_hand(op: str, x: fshard.ShardedArray) -> Callable[[], Any]:
    """The fewest torch calls that give what fshard's ``op`` gives for the case's array."""
    shards = x.addressable_data
    width = SMALL_SIDE // len(RANKS)
    if op == "reshard":
        return lambda: [torch.cat([s[:, j * width : (j + 1) * width] for s in shards]) for j in range(len(RANKS))]
    if op == "gather":
        return lambda: torch.cat(shards)
    return lambda: [torch.neg(s) for s in shards]


def _fshard(op: str, x: fshard.ShardedArray) -> Callable[[], Any]:
    if op == "reshard":
        columns = fshard.Chunk(1, RANKS)
        return lambda: fshard.reshard(x, columns)
    if op == "gather":
        return lambda: fshard.gather(x)
    return lambda: fshard.map_local(torch.neg, x)


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, fshard.ShardedArray):
        return list(result.addressable_data)
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()

    return run


@dataclasses.dataclass(frozen=True)
class SmallCase:
    """``op`` (reshard, gather or map_local) of a 64x64 float32 on 4 ranks against the same result by hand.

    Each sample times a batch of calls and reports the time per call.
    """

    op: str
    group: str = SMALL_GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        what = {"reshard": "reshard dim 0 -> dim 1", "gather": "gather to all", "map_local": "map_local(torch.neg)"}
        return f"{what[self.op]}, {SMALL_SIDE}x{SMALL_SIDE} float32, 4 ranks"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        x = fshard.shard(torch.rand(SMALL_SIDE, SMALL_SIDE), fshard.Chunk(0, RANKS))
        hand, ours = _by_hand(self.op, x), _fshard(self.op, x)
        same = all(torch.equal(a, b) for a, b in zip(_tensors(hand()), _tensors(ours()), strict=True))
        calls = 20 if settings.quick else 200
        samples = interleaved({"by hand": _repeated(hand, calls), "fshard": _repeated(ours, calls)}, settings)
        hand_s, ours_s = ([t / calls for t in samples[k]] for k in ("by hand", "fshard"))
        base, seconds = median(hand_s), median(ours_s)
        headline = self.op == "reshard"
        note = f"{(seconds - base) * 1e6:.1f} µs per call above by hand"
        ours_row = Row(
            self.group,
            self.name,
            "fshard",
            seconds,
            len(ours_s),
            ratio=seconds / base,
            ratio_to="x by hand",
            target="<= 1.5x by hand" if headline else "",
            ok=seconds / base <= 1.5 if headline else None,
            note=note,
            samples=tuple(ours_s),
            verified=same,
        )
        hand_row = Row(self.group, self.name, "by hand", base, len(hand_s), samples=tuple(hand_s))
        return [hand_row, ours_row]


@dataclasses.dataclass(frozen=True)
class AllocCase:
    """A new ``mib`` MiB float32 CPU tensor filled by ``copy_``.

    ``torch.empty`` against a pooled block (a pool of its own, warmed by the untimed call).
    """

    mib: float
    group: str = ALLOC_GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"new tensor + copy_, {self.mib:g} MiB"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        src = torch.rand(int(self.mib * 2**18))
        pool = _Pool()
        fns = {
            "torch.empty": lambda: torch.empty(src.shape).copy_(src),
            "pooled block": lambda: pool.empty(src.shape, src.dtype).copy_(src),
        }
        samples = interleaved(fns, settings)
        base = median(samples["torch.empty"])
        used = "pooled block" if self.mib * 2**20 >= POOL_MIN_BYTES else "torch.empty"
        rows = []
        for impl, got in samples.items():
            seconds = median(got)
            note = "what fshard uses at this size" if impl == used else ""
            rows.append(Row(self.group, self.name, impl, seconds, len(got), seconds / base, "x torch.empty",
                            note=note, samples=tuple(got)))  # fmt: skip
        return rows


def cases(settings: Settings) -> list[Any]:
    """The local backend's cases: each layout pair, the small-array cases and the output-memory cases.

    Layout pairs run at ``settings.sizes`` MiB (default 16 and 256; 4 and 64 with ``quick``), the
    output-memory cases at 1, 4, 16 and 32 MiB (1 and 32 with ``quick``).
    """
    sizes = settings.sizes or ((4, 64) if settings.quick else (16, 256))
    small = [SmallCase(op) for op in ("reshard", "gather", "map_local")]
    memory = [AllocCase(mib) for mib in ((1, 32) if settings.quick else (1, 4, 16, 32))]
    return [ReshardCase(pair, mib) for mib in sizes for pair in SPECS] + small + memory
