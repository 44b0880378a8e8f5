"""Planner scaling: layout validation and planning at 1k to 100k shards, against torch's own checks.

Validation inputs (prebuilt ``ShardMeta`` tuples, so only validation is timed):

- ``chunk``: n shards of 4 elements along one dim;
- ``grid``: a k x k grid of 1x1 shards (300 x 300 = 90,000 is the headline case);
- ``adversarial columns``: n shards ``[0:2n, j:j+1]`` plus one ``[2n:2n+1, 0:n]``: every
  column overlaps every other in dim 0, which makes sweep-line checks quadratic.

torch's peer is ``validate_non_overlapping_shards_metadata`` on the same boxes (it
checks overlaps only; fshard also checks bounds, duplicates and full coverage).

Planning pairs (validate both layouts, then plan; each plan has O(n) transfers):
chunk -> the same chunks on rotated ranks, grid -> rows, grid -> the same grid on
other ranks, and grid -> a finer grid with other boundaries. torch has no planner
for arbitrary layouts (ShardedTensor.reshard handles chunk -> chunk only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Row, Settings, Timed, interleaved, median
from fshard import Layout, Placement, ShardMeta, plan

__all__ = ["PlanCase", "ValidationCase", "cases"]

GROUP = "planner"
Boxes = tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]]


# -- inputs --------------------------------------------------------------------------------


def chunk_boxes(n: int) -> Boxes:
    """n shards of 4 elements along one dim, shard i on rank i."""
    return (4 * n,), tuple(((4 * i,), (4,), i) for i in range(n))


def grid_boxes(k: int) -> Boxes:
    """A k x k grid of 1 x 1 shards, one rank each."""
    return (k, k), tuple(((i, j), (1, 1), i * k + j) for i in range(k) for j in range(k))


def adversarial_boxes(n: int) -> Boxes:
    """n tall columns and one wide row under them: every column meets every other in dim 0."""
    columns = tuple(((0, j), (2 * n, 1), j) for j in range(n))
    return (2 * n + 1, n), (*columns, ((2 * n, 0), (1, n), n))


@functools.cache
def _placement(rank: int) -> Placement:
    return Placement(rank)


def metas(boxes: Boxes) -> tuple[ShardMeta, ...]:
    """The boxes as fshard ``ShardMeta`` values."""
    return tuple(ShardMeta(o, s, _placement(r)) for o, s, r in boxes[1])


def torch_metas(boxes: Boxes) -> list[Any]:
    """The boxes as torch ``ShardMetadata`` values."""
    from torch.distributed._shard.metadata import ShardMetadata

    return [ShardMetadata(list(o), list(s), f"rank:{r}/cpu") for o, s, r in boxes[1]]


FAMILIES: dict[str, tuple[Callable[[int], Boxes], Callable[[int], int], float]] = {
    # name: (boxes of size parameter p, shards for p, exponent of torch's growth in shards)
    "chunk": (chunk_boxes, lambda n: n, 1.0),
    "grid": (grid_boxes, lambda k: k * k, 1.5),
    "adversarial columns": (adversarial_boxes, lambda n: n + 1, 2.0),
}


# -- validation ------------------------------------------------------------------------------


@dataclasses.dataclass
class _TorchClock:
    """Extrapolates torch's time to the next size of a family, to skip hopeless runs."""

    last: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def estimate(self, family: str, shards: int) -> float | None:
        if family not in self.last:
            return None
        n, seconds = self.last[family]
        return seconds * (shards / n) ** FAMILIES[family][2]


@dataclasses.dataclass(frozen=True)
class ValidationCase:
    """``Layout(shape, shards)`` vs torch's overlap check, on one family at one size."""

    family: str
    size: int
    clock: _TorchClock
    target_s: float | None = None
    group: str = GROUP

    @property
    def name(self) -> str:
        shards = FAMILIES[self.family][1](self.size)
        label = f"{self.size}x{self.size}" if self.family == "grid" else f"n={self.size:,}"
        return f"validate {self.family} {label} ({shards:,} shards)"

    def run(self, settings: Settings) -> list[Row]:
        boxes = FAMILIES[self.family][0](self.size)
        start = time.perf_counter()
        shards = metas(boxes)
        built = time.perf_counter() - start
        fns: dict[str, Any] = {"fshard Layout()": lambda: Layout(boxes[0], shards)}
        estimate = self.clock.estimate(self.family, len(shards))
        run_torch = settings.peers and (estimate is None or estimate <= settings.skip_over_s)
        if run_torch:
            from torch.distributed._shard.sharding_spec._internals import validate_non_overlapping_shards_metadata

            tmetas = torch_metas(boxes)
            fns["torch validate_non_overlapping"] = lambda: validate_non_overlapping_shards_metadata(tmetas)
        samples = interleaved(fns, settings)
        ours = median(samples["fshard Layout()"])
        rows = [self._row("fshard Layout()", samples["fshard Layout()"], ours)]
        rows.append(
            Row(GROUP, self.name, "(building the ShardMetas)", built, 1, note="not part of the validation time")
        )
        if run_torch:
            theirs = median(samples["torch validate_non_overlapping"])
            self.clock.last[self.family] = (len(shards), theirs)
            rows.append(self._row("torch validate_non_overlapping", samples["torch validate_non_overlapping"], ours))
        elif settings.peers:
            note = f"skipped: estimated {estimate:,.0f} s per call (> {settings.skip_over_s:.0f} s)"
            rows.append(Row(GROUP, self.name, "torch validate_non_overlapping", None, note=note))
        return rows

    def _row(self, impl: str, samples: list[float], ours: float) -> Row:
        seconds = median(samples)
        mine = impl.startswith("fshard")
        target = f"< {self.target_s:g} s" if mine and self.target_s else ""
        ok = seconds < self.target_s if mine and self.target_s else None
        ratio = None if mine else seconds / ours
        return Row(GROUP, self.name, impl, seconds, len(samples), ratio, "" if mine else "x fshard", target, ok,
                   samples=tuple(samples))  # fmt: skip


# -- planning --------------------------------------------------------------------------------


def _grid(k: int, block: tuple[int, int], extent: int, rank: Callable[[int, int], int]) -> tuple[ShardMeta, ...]:
    """A grid of ``block``-sized boxes over ``extent`` x ``extent`` (edge boxes clipped)."""
    rows, cols = math.ceil(extent / block[0]), math.ceil(extent / block[1])
    out = []
    for i in range(rows):
        for j in range(cols):
            lo = (i * block[0], j * block[1])
            size = (min(block[0], extent - lo[0]), min(block[1], extent - lo[1]))
            out.append(ShardMeta(lo, size, _placement(rank(i, j) % (k * k))))
    return tuple(out)


def plan_pair(kind: str, n: int) -> tuple[tuple[int, ...], tuple[ShardMeta, ...], tuple[ShardMeta, ...]]:
    """Shape and the two shard tuples of a planning case with about ``n`` shards."""
    if kind == "chunk -> rotated ranks":
        shape, boxes = chunk_boxes(n)
        src = metas((shape, boxes))
        return shape, src, tuple(ShardMeta(s.offsets, s.sizes, _placement((i + 1) % n)) for i, s in enumerate(src))
    k = math.isqrt(n)
    extent = 10 * k
    grid = _grid(k, (10, 10), extent, lambda i, j: i * k + j)
    if kind == "grid -> rows":
        step = 10
        return (extent, extent), grid, tuple(ShardMeta((i * step, 0), (step, extent), _placement(i)) for i in range(k))
    if kind == "grid -> grid, other ranks":
        return (extent, extent), grid, _grid(k, (10, 10), extent, lambda i, j: i * k + j + 1)
    if kind == "grid -> finer grid":
        return (extent, extent), grid, _grid(k, (12, 8), extent, lambda i, j: i * 7 + j * 3)
    raise ValueError(kind)


PLAN_KINDS = ("chunk -> rotated ranks", "grid -> rows", "grid -> grid, other ranks", "grid -> finer grid")


@dataclasses.dataclass(frozen=True)
class PlanCase:
    """Validating two layouts and planning between them, uncached; then the cached re-plan."""

    kind: str
    n: int
    group: str = GROUP

    @property
    def name(self) -> str:
        return f"plan {self.kind} (~{self.n:,} shards)"

    def run(self, settings: Settings) -> list[Row]:
        shape, a, b = plan_pair(self.kind, self.n)
        src, dst = Layout(shape, a), Layout(shape, b)
        build = plan.__wrapped__  # the uncached planner behind the lru_cache
        p = plan(src, dst)
        src2, dst2 = Layout(shape, a), Layout(shape, b)  # equal values, other objects
        per_call, per_call_eq = 1000, 100
        fns = {
            "validate 2 layouts + plan": lambda: build(Layout(shape, a), Layout(shape, b)),
            "plan (uncached)": lambda: build(src, dst),
            "cached re-plan": Timed(lambda: [plan(src, dst) for _ in range(per_call)]),
            "cached re-plan, equal copies": Timed(lambda: [plan(src2, dst2) for _ in range(per_call_eq)]),
        }
        samples = interleaved(fns, settings)
        samples["cached re-plan"] = [s / per_call for s in samples["cached re-plan"]]
        eq = "cached re-plan, equal copies"
        samples[eq] = [s / per_call_eq for s in samples[eq]]
        note = f"{len(src.shards):,} -> {len(dst.shards):,} shards, {len(p):,} transfers"
        targets = {"validate 2 layouts + plan": 1.0, "cached re-plan": 50e-6}
        rows = []
        for impl, s in samples.items():
            seconds, target = median(s), targets.get(impl)
            label = "" if target is None else (f"< {target:g} s" if target >= 1 else f"< {target * 1e6:g} us")
            ok = None if target is None else seconds < target
            rows.append(Row(GROUP, self.name, impl, seconds, len(s), target=label, ok=ok, note=note,
                            samples=tuple(s)))  # fmt: skip
        return rows


# -- the list -------------------------------------------------------------------------------


def cases(settings: Settings) -> list[Any]:
    """The planner cases for ``settings`` (smaller sizes with ``quick``)."""
    clock = _TorchClock()
    sizes = {
        "chunk": [1_000, 10_000] if settings.quick else [1_000, 10_000, 100_000],
        "grid": [32, 100] if settings.quick else [32, 100, 300],
        "adversarial columns": [1_000, 2_000, 4_000] if settings.quick else [1_000, 2_000, 4_000, 8_000, 100_000],
    }
    targets = {("grid", 300): 0.1, ("adversarial columns", 4_000): 0.02}
    out: list[Any] = [
        ValidationCase(family, size, clock, targets.get((family, size)))
        for family, family_sizes in sizes.items()
        for size in family_sizes
    ]
    plan_sizes = [1_000, 10_000] if settings.quick else [1_000, 10_000, 100_000]
    out += [PlanCase(kind, n) for n in plan_sizes for kind in PLAN_KINDS]
    return out
