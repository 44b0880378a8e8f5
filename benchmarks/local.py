"""Local backend: ``fshard.reshard`` against a plain ``Tensor.copy_`` of the same boxes.

The floor copies every box of the plan (sent or kept on its rank) from the source
shards into destination tensors allocated once, before timing. ``reshard`` must also
allocate its outputs (arrays are immutable); it reuses the memory of outputs that
have died (``backends/local.py``, ``_Pool``). The "fresh memory" row empties that
pool before every call, so its outputs pay the kernel's page faults on first write:
the cost any newly allocated tensor pays, ``torch.empty`` or ``clone`` alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import fshard
from benchmarks.common import Row, Settings, Timed, interleaved, median
from fshard.backends.local import box_slices, empty_cache

__all__ = ["ReshardCase", "cases"]

GROUP = "local backend"
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
        read = box_slices(lo, size, p.src._lo[i].tolist())
        write = box_slices(lo, size, p.dst._lo[j].tolist())
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
        return f"reshard {self.pair}, {self.mib:g} MiB float32"

    def run(self, settings: Settings) -> list[Row]:
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


def cases(settings: Settings) -> list[Any]:
    """``settings.sizes`` MiB (default 16 and 256; 4 and 64 with ``quick``) for each layout pair."""
    sizes = settings.sizes or ((4, 64) if settings.quick else (16, 256))
    return [ReshardCase(pair, mib) for mib in sizes for pair in SPECS]
