"""The embedded backend: every rank's shards live in this process, on their placed devices."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._boxes import unique_rows
from fshard._errors import SpecError

__all__ = ["LOCAL", "Counters", "LocalBackend", "box_slices"]


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


def new_shard(layout: Any, i: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor for shard ``i``, with ``like``'s dtype."""
    return torch.empty(layout.shards[i].sizes, dtype=like.dtype, device=shard_device(layout, i))


def copy_plan(plan: Any, src: dict[int, torch.Tensor], dst: dict[int, torch.Tensor], rows: Any) -> None:
    """Runs the transfers ``rows`` of ``plan`` between shard tensors held in this process."""
    s_lo, d_lo = plan.src._lo, plan.dst._lo
    for k in rows:
        i, j = int(plan.src_shard[k]), int(plan.dst_shard[k])
        lo, size = plan.lo[k].tolist(), plan.size[k].tolist()
        dst[j][box_slices(lo, size, d_lo[j].tolist())].copy_(src[i][box_slices(lo, size, s_lo[i].tolist())])


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
        """Copies each transfer's box out of its source shard into a new destination shard."""
        out = {j: new_shard(plan.dst, j, like) for j in range(len(plan.dst.shards))}
        copy_plan(plan, dict(enumerate(tensors)), out, range(len(plan)))
        self.counters.elements_sent += plan.elements_sent
        return tuple(out[j] for j in range(len(out)))

    def scatter(self, full: torch.Tensor | None, layout: Any, src: int | None) -> tuple[torch.Tensor, ...]:
        """Copies each shard's box out of ``full``."""
        assert full is not None
        out = []
        for i, s in enumerate(layout.shards):
            t = new_shard(layout, i, full)
            t.copy_(full[box_slices(s.offsets, s.sizes, (0,) * len(s.offsets))])
            out.append(t)
        return tuple(out)

    def assemble(self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None) -> torch.Tensor:
        """Writes one copy of every box into a new global tensor (on rank ``dst``'s device)."""
        idx = layout.indices_on(dst) if dst is not None else ()
        device = shard_device(layout, idx[0]) if idx else like.device
        out = torch.empty(layout.shape, dtype=like.dtype, device=device)
        lo, sz = layout._lo, layout._sz
        nonempty = (sz > 0).all(axis=1) if layout.ndim else np.ones(len(tensors), bool)
        first, _ = unique_rows(np.c_[lo, sz][nonempty])
        for i in np.flatnonzero(nonempty)[first].tolist():
            out[box_slices(lo[i].tolist(), sz[i].tolist(), [0] * layout.ndim)].copy_(tensors[i])
        if dst is not None:
            self.counters.elements_sent += sum(
                layout.shards[i].numel for i in np.flatnonzero(nonempty)[first].tolist()
                if layout.shards[i].placement.rank != dst
            )
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """A single process: its own object."""
        return [obj]


LOCAL = LocalBackend()
