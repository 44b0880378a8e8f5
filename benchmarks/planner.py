"""Planner scaling: layout validation and planning at 1k to 100k shards, against torch's own checks.

Validation inputs (prebuilt ``ShardMeta`` tuples for ``Layout()``, numpy columns for
``Layout.from_arrays``, so only validation is timed):

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

One rank's schedule (``plan(src, dst).for_rank(1)``) on 64 to 16,384 ranks of an
8192 x 8192 array, for ``Chunk(0) -> Chunk(1)`` (every rank sends to every other), a
``Named`` k x n/k grid -> row blocks, and a pending sum held by every rank ->
``Chunk(0)`` (a reduce-scatter: every rank sends a part of its summand to every other
and receives its part from each): built from the layouts alone with every cache
cleared first, then the cached re-plan; the global plan (n^2 transfers for the
all-to-all and the reduce-scatter) is timed next to it up to 256 ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import fshard
from fshard import Chunk, Layout, Mesh, Named, Partial, Placement, Replicated, ShardMeta, plan
from fshard._layout import index as _index
from fshard._plan import pending as _reduce
from fshard._plan import schedule as _schedule

from .common import Row, Settings, Timed, interleaved, median

__all__ = ["PlanCase", "ValidationCase", "cases"]

GROUP = "planner"
Boxes = tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]]


# -- inputs --------------------------------------------------------------------------------


def chunk_boxes(n: int) -> Boxes:
    """``n`` shards of 4 elements along one dim, shard i on rank i."""
    return (4 * n,), tuple(((4 * i,), (4,), i) for i in range(n))


def grid_boxes(k: int) -> Boxes:
    """A k x k grid of 1 x 1 shards, one rank each."""
    return (k, k), tuple(((i, j), (1, 1), i * k + j) for i in range(k) for j in range(k))


def adversarial_boxes(n: int) -> Boxes:
    """``n`` tall columns and one wide row under them: every column meets every other in dim 0."""
    columns = tuple(((0, j), (2 * n, 1), j) for j in range(n))
    return (2 * n + 1, n), (*columns, ((2 * n, 0), (1, n), n))


@functools.cache
def _placement(rank: int) -> Placement:
    return Placement(rank)


def metas(boxes: Boxes) -> tuple[ShardMeta, ...]:
    """The boxes as fshard ``ShardMeta`` values."""
    return tuple(ShardMeta(o, s, _placement(r)) for o, s, r in boxes[1])


def columns(boxes: Boxes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The boxes as ``Layout.from_arrays`` columns: offsets, sizes, ranks."""
    d = len(boxes[0])
    lo = np.array([o for o, _, _ in boxes[1]], np.int64).reshape(-1, d)
    sz = np.array([z for _, z, _ in boxes[1]], np.int64).reshape(-1, d)
    return lo, sz, np.array([r for _, _, r in boxes[1]], np.int64)


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
        """The case's name in the tables."""
        shards = FAMILIES[self.family][1](self.size)
        label = f"{self.size}x{self.size}" if self.family == "grid" else f"n={self.size:,}"
        return f"validate {self.family} {label} ({shards:,} shards)"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        boxes = FAMILIES[self.family][0](self.size)
        start = time.perf_counter()
        shards = metas(boxes)
        built = time.perf_counter() - start
        lo, sz, ranks = columns(boxes)
        fns: dict[str, Any] = {
            "fshard Layout()": lambda: Layout(boxes[0], shards),
            "fshard Layout.from_arrays": lambda: Layout.from_arrays(boxes[0], lo, sz, ranks),
        }
        estimate = self.clock.estimate(self.family, len(shards))
        run_torch = settings.peers and (estimate is None or estimate <= settings.skip_over_s)
        if run_torch:
            from torch.distributed._shard.sharding_spec._internals import validate_non_overlapping_shards_metadata

            tmetas = torch_metas(boxes)
            fns["torch validate_non_overlapping"] = lambda: validate_non_overlapping_shards_metadata(tmetas)
        samples = interleaved(fns, settings)
        ours = median(samples["fshard Layout()"])
        rows = [self._row(impl, samples[impl], ours) for impl in ("fshard Layout()", "fshard Layout.from_arrays")]
        note = "not part of Layout()'s time; from_arrays needs none"
        rows.append(Row(GROUP, self.name, "(building the ShardMetas)", built, 1, note=note))
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
        """The case's name in the tables."""
        return f"plan {self.kind} (~{self.n:,} shards)"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        shape, a, b = plan_pair(self.kind, self.n)
        src, dst = Layout(shape, a), Layout(shape, b)
        p = plan(src, dst)
        src2, dst2 = Layout(shape, a), Layout(shape, b)  # equal values, other objects
        per_call, per_call_eq = 1000, 100
        fns = {
            "validate 2 layouts + plan": Timed(lambda: _rows(Layout(shape, a), Layout(shape, b)), clear_caches),
            "plan (uncached)": Timed(lambda: _rows(src, dst), clear_caches),
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


def clear_caches() -> None:
    """Forgets every plan, schedule and layout index, so that the next one is built from scratch."""
    fshard._plan._plan.cache_clear()
    _schedule.schedule.cache_clear()
    _index.index.cache_clear()
    _reduce.rank_schedule.cache_clear()


def _rows(src: Layout, dst: Layout) -> int:
    """Builds every transfer of the (uncached) plan; ``fshard.plan`` alone computes none."""
    return len(fshard._plan._plan.__wrapped__(src, dst))


# -- one rank's schedule at 64 to 16,384 ranks ----------------------------------------------

RANK_GROUP = "planner: one rank's schedule, 8192 x 8192"
RANK_SHAPE = (8192, 8192)
RANK_KINDS = ("Chunk(0) -> Chunk(1)", "Named grid -> rows", "Partial sum -> Chunk(0)")


def rank_pair(kind: str, n: int) -> tuple[Layout, Layout]:
    """The two layouts of a per-rank case on ``n`` ranks.

    All-to-all, a k x n/k grid to row blocks, or a pending sum on every rank to row blocks.
    """
    if kind == "Chunk(0) -> Chunk(1)":
        return Chunk(0, range(n)).layout(RANK_SHAPE), Chunk(1, range(n)).layout(RANK_SHAPE)
    if kind == "Named grid -> rows":
        k = math.isqrt(n)
        return Named(Mesh((k, n // k)), ("x", "y")).layout(RANK_SHAPE), Chunk(0, range(n)).layout(RANK_SHAPE)
    if kind == "Partial sum -> Chunk(0)":
        return Partial(Replicated(range(n))).layout(RANK_SHAPE), Chunk(0, range(n)).layout(RANK_SHAPE)
    raise ValueError(kind)


@dataclasses.dataclass(frozen=True)
class RankCase:
    """``plan(src, dst).for_rank(rank)`` on ``n`` ranks.

    From the layouts alone (every cache cleared first), and again (cached); the global plan next to it where it is
    small.
    """

    kind: str
    n: int
    rank: int = 1
    global_up_to: int = 256
    group: str = RANK_GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"{self.kind}, {self.n:,} ranks"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        src, dst = rank_pair(self.kind, self.n)
        per_call = 1000
        fns: dict[str, Any] = {
            "this rank's schedule (first)": Timed(lambda: plan(src, dst).for_rank(self.rank), clear_caches),
            "cached re-plan": Timed(lambda: [plan(src, dst).for_rank(self.rank) for _ in range(per_call)]),
        }
        if self.n <= self.global_up_to:
            fns["global plan (every rank)"] = Timed(lambda: _rows(src, dst), clear_caches)
        samples = interleaved(fns, settings)
        samples["cached re-plan"] = [s / per_call for s in samples["cached re-plan"]]
        s = plan(src, dst).for_rank(self.rank)
        note = f"rank {self.rank}: sends {len(s.send):,}, receives {len(s.recv):,} transfers ({len(s.peers):,} peers)"
        targets = {"this rank's schedule (first)": 20e-3, "cached re-plan": 50e-6}
        rows = []
        for impl, t in samples.items():
            seconds, target = median(t), targets.get(impl)
            label = "" if target is None else (f"< {target * 1e3:g} ms" if target >= 1e-3 else f"< {target * 1e6:g} us")
            ok = None if target is None else seconds < target
            rows.append(Row(self.group, self.name, impl, seconds, len(t), target=label, ok=ok, note=note,
                            samples=tuple(t), series=f"planning {self.kind}", x=float(self.n),
                            x_label="ranks"))  # fmt: skip
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
    rank_sizes = [64, 1024, 16_384] if settings.quick else [64, 256, 1024, 4096, 16_384]
    out += [RankCase(kind, n, global_up_to=64 if settings.quick else 256) for kind in RANK_KINDS for n in rank_sizes]
    return out
