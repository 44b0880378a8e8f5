"""The backward pass of ``reshard`` and ``gather`` against their forward pass: time and elements sent.

For each movement the forward runs on an array whose shards are autograd leaves, and
the backward is ``torch.autograd.grad`` of the result (its shards, or the gathered
tensor) with respect to those leaves, with a cotangent of ones made before timing;
the graph is rebuilt, untimed, before each backward call.

- **local backend**: every rank in this process. Elements sent are the plans'
  accounting (``plan.elements_sent``): what a multi-process run sends.
- **torch_dist**: ``world`` Gloo processes on this machine (``fshard.testing.launch``).
  Before each timed call every rank waits at a barrier; a round's time is the
  slowest rank's. Elements sent are the backend's counters, summed over ranks.

The backward of a ``reshard`` runs the reverse plan, so it sends what the reverse
reshard sends: the same as the forward for a permutation of boxes, nothing when the
forward replicated. The backward of ``gather`` slices each rank's own gradient
(nothing sent); that of ``gather(dst=0)`` sends rank 0's gradient back out.

    python -m fshard.benchmarks.autograd            # both backends
    python -m fshard.benchmarks.autograd --quick    # smaller arrays, fewer repetitions
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fshard
from fshard.backends.torch_dist import TorchDistBackend
from fshard.testing.launch import launch

from .common import Row, Settings, Timed, interleaved, median

__all__ = ["MOVES", "AutogradCase", "GlooCase", "cases", "main"]

LOCAL_GROUP = "autograd, local backend"
GLOO_GROUP = "autograd, torch_dist (Gloo)"
ITEMSIZE = 4  # float32


@dataclasses.dataclass(frozen=True)
class Move:
    """A differentiable movement between two layouts of a square float32 array."""

    title: str
    src: Callable[[list[int]], Any]
    dst: Callable[[list[int]], Any] | None  # None: gather
    gather_to: int | None = None
    # Under torch_dist only rank k gets a result from gather(dst=k): the other ranks have
    # nothing to call backward on, so that backward runs on the local backend only.
    across_processes: bool = True

    def layouts(self, side: int, ranks: list[int]) -> tuple[fshard.Layout, fshard.Layout | None]:
        dst = None if self.dst is None else self.dst(ranks).layout((side, side))
        return self.src(ranks).layout((side, side)), dst


MOVES: dict[str, Move] = {
    "reshard rows -> columns": Move(
        "reshard rows -> columns", lambda r: fshard.Chunk(0, r), lambda r: fshard.Chunk(1, r)
    ),
    "reshard grid -> rows": Move(
        "reshard grid -> rows",
        lambda r: fshard.Named(fshard.Mesh((2, len(r) // 2)), ("x", "y")),
        lambda r: fshard.Chunk(0, r),
    ),
    "reshard rows -> replicated": Move(
        "reshard rows -> replicated", lambda r: fshard.Chunk(0, r), lambda r: fshard.Replicated(r)
    ),
    "gather to every rank": Move("gather to every rank", lambda r: fshard.Chunk(0, r), None),
    "gather to rank 0": Move("gather to rank 0", lambda r: fshard.Chunk(0, r), None, 0, across_processes=False),
}


def _side(mib: float) -> int:
    return int((mib * 2**20 / ITEMSIZE) ** 0.5)


def build(move: Move, side: int, ranks: list[int], backend: Any = None) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``forward()`` and ``backward()`` of ``move``; ``backward`` needs a ``forward`` result from ``setup``."""
    src, dst = move.layouts(side, ranks)
    x = torch.rand(side, side, generator=torch.Generator().manual_seed(0))
    leaves = fshard.map_local(lambda t: t.requires_grad_(), fshard.shard(x, src, backend=backend))
    inputs = leaves.addressable_data

    def forward() -> list[torch.Tensor]:
        if dst is not None:
            return list(fshard.reshard(leaves, dst).addressable_data)
        return [fshard.gather(leaves, dst=move.gather_to)]

    graph: list[list[torch.Tensor]] = []
    cotangents = [torch.ones_like(t) for t in forward()]

    def setup() -> None:
        graph[:] = [forward()]

    def backward() -> Any:
        return torch.autograd.grad(graph.pop(), inputs, cotangents, allow_unused=True)

    return forward, Timed(backward, setup)


def elements(move: Move, side: int, ranks: list[int]) -> tuple[int, int]:
    """Elements the forward and the backward send across ranks, from the plans."""
    src, dst = move.layouts(side, ranks)
    if dst is None:
        receivers = ranks if move.gather_to is None else [move.gather_to]
        dst = fshard.Replicated(receivers).layout(src.shape)
        # The backward of a gather slices each receiver's gradient (to every rank: locally).
        back = 0 if move.gather_to is None else fshard.plan(dst, src).elements_sent
        return fshard.plan(src, dst).elements_sent, back
    return fshard.plan(src, dst).elements_sent, fshard.plan(dst, src).elements_sent


def _rows(group: str, name: str, fwd: list[float], bwd: list[float], sent: tuple[int, int]) -> list[Row]:
    f, b = median(fwd), median(bwd)
    moved = lambda n: f"{n} elements sent ({n * ITEMSIZE / 2**20:.2f} MiB)"  # noqa: E731
    ratio = f"; bytes {sent[1] / sent[0]:.2f}x forward" if sent[0] else ""
    return [
        Row(group, name, "forward", f, len(fwd), note=moved(sent[0]), samples=tuple(fwd)),
        Row(group, name, "backward", b, len(bwd), b / f, "x forward", note=moved(sent[1]) + ratio, samples=tuple(bwd)),
    ]


@dataclasses.dataclass(frozen=True)
class AutogradCase:
    """One movement at one size on the local backend (4 ranks in this process)."""

    move: str
    mib: float
    group: str = LOCAL_GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"{self.move}, {self.mib:g} MiB float32"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        ranks, side = [0, 1, 2, 3], _side(self.mib)
        forward, backward = build(MOVES[self.move], side, ranks)
        samples = interleaved({"forward": forward, "backward": backward}, settings)
        sent = elements(MOVES[self.move], side, ranks)
        return _rows(self.group, self.name, samples["forward"], samples["backward"], sent)


# -- torch_dist over Gloo ------------------------------------------------------------------------


def _timed_rounds(fn: Timed, reps: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(reps + 1):  # the first round warms up
        if fn.setup is not None:
            fn.setup()
        dist.barrier()
        start = time.perf_counter()
        fn.fn()
        out.append(time.perf_counter() - start)
    return out[1:]


def _gloo_job(jobs: list[tuple[str, float]], reps: int) -> list[dict[str, Any]]:
    """On every rank: per job, this rank's forward and backward times and elements sent."""
    import torch.distributed as dist

    ranks, counters, out = list(range(dist.get_world_size())), TorchDistBackend().counters, []
    for key, mib in jobs:
        forward, backward = build(MOVES[key], _side(mib), ranks)
        start = counters.elements_sent
        backward.setup()  # one forward
        middle = counters.elements_sent
        backward.fn()  # and its backward
        sent = (middle - start, counters.elements_sent - middle)
        times = {"forward": _timed_rounds(Timed(forward), reps), "backward": _timed_rounds(backward, reps)}
        out.append({"times": times, "sent": sent})
    return out


class _GlooBatch:
    """Runs every Gloo case of one ``cases()`` call in one launch, when the first is asked for."""

    def __init__(self, world: int, jobs: list[tuple[str, float]], reps: int) -> None:
        self.world, self.jobs, self.reps = world, jobs, reps
        self.results: list[list[dict[str, Any]]] | None = None

    def result(self, job: tuple[str, float]) -> list[dict[str, Any]]:
        if self.results is None:
            per_rank = launch(_gloo_job, self.world, self.jobs, self.reps, timeout=600)
            self.results = [[r[k] for r in per_rank] for k in range(len(self.jobs))]
        return self.results[self.jobs.index(job)]


@dataclasses.dataclass(frozen=True)
class GlooCase:
    """One movement at one size on ``world`` Gloo processes (run with the other cases of its batch)."""

    move: str
    mib: float
    batch: _GlooBatch = dataclasses.field(compare=False, repr=False)
    group: str = GLOO_GROUP

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return f"{self.move}, {self.mib:g} MiB float32, {self.batch.world} processes"

    def run(self, settings: Settings) -> list[Row]:
        """Measures every implementation of the case; one row each."""
        parts = self.batch.result((self.move, self.mib))
        slowest = {k: [max(v) for v in zip(*(p["times"][k] for p in parts))] for k in ("forward", "backward")}
        sent = (sum(p["sent"][0] for p in parts), sum(p["sent"][1] for p in parts))
        return _rows(self.group, self.name, slowest["forward"], slowest["backward"], sent)


def cases(settings: Settings) -> list[Any]:
    """Every movement on the local backend (16 and 64 MiB; 4 MiB with ``quick``) and on 4 Gloo processes (4 MiB)."""
    local_sizes = [4.0] if settings.quick else [16.0, 64.0]
    gloo_mib = 1.0 if settings.quick else 4.0
    out: list[Any] = [AutogradCase(m, mib) for mib in local_sizes for m in MOVES]
    world = int(getattr(settings, "world", 4) or 4)
    if world >= 2 and world % 2 == 0:
        jobs = [(m, gloo_mib) for m, move in MOVES.items() if move.across_processes]
        batch = _GlooBatch(world, jobs, max(3, settings.reps))
        out += [GlooCase(m, gloo_mib, batch) for m, _ in jobs]
    return out


def table(rows: Sequence[Row]) -> str:
    """The rows as plain text: one line per forward/backward, grouped by case."""
    lines = [f"{'case':<58} {'pass':<9} {'median':>10} {'ratio':>12}  elements sent"]
    for r in rows:
        seconds = "-" if r.seconds is None else f"{r.seconds * 1e3:.2f} ms"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        lines.append(f"{r.case:<58} {r.impl:<9} {seconds:>10} {ratio:>12}  {r.note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every case and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller arrays")
    parser.add_argument("--reps", type=int, default=15, help="repetitions per measurement (median reported)")
    parser.add_argument("--local-only", action="store_true", help="skip the Gloo processes")
    args = parser.parse_args(argv)
    settings = Settings(quick=args.quick, reps=args.reps)
    rows: list[Row] = []
    for case in cases(settings):
        if args.local_only and case.group == GLOO_GROUP:
            continue
        rows += case.run(settings)
    print(f"fshard autograd overhead, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
