"""Multi-process cases: fshard on N Gloo processes against ShardedTensor, DTensor and the floor.

``python -m fshard bench`` spawns ``--world`` processes (default 4) on 127.0.0.1 with
``fshard.testing.launch.launch``, once for all these cases, and for every case times each
implementation of the same data movement:

- **floor**: the raw ``torch.distributed`` call that moves exactly the minimal bytes of
  the case, on buffers allocated (and packed) before timing: ``dist.gather`` of the
  pieces, ``all_gather_into_tensor``, ``all_to_all_single`` with the split sizes of
  ``fshard.plan(src, dst).traffic()``, ``dist.scatter``. Where both exist, **floor
  p2p** moves the same pieces by ``batch_isend_irecv`` straight into the output: on
  Gloo that is often faster than the collective, and the faster of the two is the
  floor every ratio divides by. Pieces of unequal size go by ``batch_isend_irecv``
  only (``dist.gather`` would pad them). Where nothing crosses ranks, the floor is a
  ``copy_`` of the local slice into a buffer allocated before timing. Pending
  reductions (``Partial``, ``benchmarks/dist_partial.py``) divide by the collective that
  reduces the same bytes, ``all_reduce`` or ``reduce_scatter_tensor``.
- **pack+a2a** (reshards that move data): a hand-written reference of what any packed
  all-to-all must do, timed as one call: one strided ``copy_`` packs the outgoing boxes
  (this rank's own included, for dim 0 -> dim 1 ``sendbuf.view(n, rows, w).copy_(
  shard.view(rows, n, w).transpose(0, 1))``), one ``all_to_all_single`` receives straight
  into the output where the received boxes lie back to back there, else into a buffer
  unpacked with as few strided copies as the layout allows (one for the grid's equal
  blocks, one per piece for explicit boxes of unequal widths); buffers allocated before timing
  (``dist_build._pack_a2a``). fshard's time over it is given next to the floor ratio
  (target 1.10x).
- **fshard**: ``gather``, ``reshard`` or ``shard(src=0)`` on the ``torch_dist`` backend.
- **copies** (reshards only, a diagnostic): the memory copies of fshard's plan that no
  message makes, timed alone: local boxes, and boxes that are not contiguous in their
  shard (Gloo moves contiguous buffers, so they are packed or unpacked).
- **all_to_all** (collective reductions, a diagnostic): the bound's bytes sent by
  ``all_to_all_single`` per phase of fshard's plan, without the sums; **fshard packed**
  (the reduce-scatter, a diagnostic): fshard's packed path on the same bytes.
- **ShardedTensor** (``torch.distributed._shard``): ``gather(dst, out)``,
  ``reshard(ChunkShardingSpec)`` (chunk -> chunk only) and ``_shard_tensor(src_rank=0)``.
- **DTensor**: ``full_tensor()``, ``redistribute`` and ``distribute_tensor(src_data_rank=0)``
  on a CPU ``DeviceMesh``.

Timing: every implementation runs once untimed (its result checked against the plain
tensor), then the rounds are interleaved (floor, fshard, ShardedTensor, DTensor, floor,
...). Before each timed call every rank of the case's group waits at a barrier; a
round's time is the slowest rank's, and the table shows the median over rounds.

Bytes sent: fshard's ``backend.counters.elements_sent`` over one call, summed over
ranks, against ``plan.min_elements_sent`` of the same movement (both x 4 bytes); for
``Partial(Replicated)`` against the stated bounds, (n - 1)·N to ``Chunk(0)`` and
2(n - 1)·N to ``Replicated``. A peer's row notes fshard's time over the peer's.

Peak extra memory: the growth of each process's resident set over one call, the
largest over ranks (``benchmarks/dist_rank.py``). It counts the result and every
temporary buffer that was written, the buffers handed to the floor included.

Fixed cost per call (a group of its own): a 64x64 float32 ``reshard`` Chunk(0) -> Chunk(1)
against ``all_to_all_single`` of the same bytes packed before timing, and ``gather`` to
all against ``all_gather_into_tensor``; each round times ``FIXED_CALLS`` operations in a
row and reports the time per operation, and fshard's row notes its difference in µs, and
how much of it is CPU time of the calling thread (``time.thread_time``, the median over
ranks of each rank's median): fshard's own work, where the rest is waiting. The fixed
cost of a tree: ``reshard`` of a tree of 70 8x4 float32 arrays, Chunk(0) -> Replicated,
against ``all_to_all_single`` of the tree's bytes and, interleaved in the same rounds, the
``reshard`` of one of its arrays ("one leaf"); fshard's row gives the ratio of the two
medians (target ``TREE_TARGET``).

All processes share this machine's cores: 4 ranks on 2 cores take turns, which is the
setting the numbers describe.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from fshard.testing.launch import launch

from .common import Progress, Row, Settings
from .dist_rank import job
from .floors import ITEMSIZE

__all__ = ["SCENARIOS", "DistCase", "Scenario", "cases", "combine", "jobs", "result_rows", "run"]

GROUP = "torch_dist"
GATHER_TARGET = 1.15
RESHARD_TARGET = 1.25
IMPLS = (
    "floor",
    "floor p2p",
    "pack+a2a",
    "fshard",
    "one leaf",
    "fshard packed",
    "copies",
    "all_to_all",
    "ShardedTensor",
    "DTensor",
)
FLOORS = ("floor", "floor p2p")
DIAGNOSTICS = ("one leaf", "fshard packed", "copies", "all_to_all")
PEERS = ("ShardedTensor", "DTensor")
REFERENCE = "pack+a2a"
REFERENCE_TARGET = 1.10
TREE_TARGET = 2.0  # a tree of small arrays moved as one costs at most this many times one of them
FIXED_MIB = 1 / 64  # a 64 x 64 float32 matrix: 16 KiB
FIXED_CALLS = 100  # operations per timed call of a fixed-cost scenario
QUICK_FIXED_CALLS = 10
SIZES = (16.0, 256.0)
QUICK_SIZES = (1.0,)
QUICK_REPS = 5
TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A data movement measured in every implementation that supports it."""

    key: str
    title: str
    kind: str  # "gather", "reshard", "shard", "reduce" or "fixed": which ratio target applies
    world_min: int = 2

    @property
    def target(self) -> float | None:
        """The largest fshard / floor ratio that meets the goal; ``None`` for a fixed-cost scenario.

        A scatter or a collective reduction counts as a gather; a fixed-cost scenario only reports.
        """
        if self.kind == "fixed":
            return None
        return RESHARD_TARGET if self.kind == "reshard" else GATHER_TARGET


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("gather-one", "gather to rank 0, even chunks", "gather"),
    Scenario("gather-uneven", "gather to 0, Chunk(0,[0,0,1,1,2])", "gather", world_min=3),
    Scenario("gather-all", "gather to all ranks", "gather"),
    Scenario("dim0-dim1", "reshard dim 0 -> dim 1", "reshard"),
    Scenario("grid-rows", "reshard 2-D grid -> rows", "reshard"),
    Scenario("repl-chunk", "reshard replicated -> chunk", "reshard"),
    Scenario("chunk-repl", "reshard chunk -> replicated", "reshard"),
    Scenario("explicit-chunk", "reshard explicit -> chunk", "reshard"),
    Scenario("shard-src0", "shard(src=0), dim-0 chunks", "shard"),
    Scenario("partial-repl", "Partial(Replicated) -> Replicated", "reduce"),
    Scenario("partial-chunk", "Partial(Replicated) -> Chunk(0)", "reduce"),
    Scenario("partial-rows-cols", "Partial(rows, sum over y) -> Chunk(1)", "reshard"),
    Scenario("fixed-reshard", "per call: reshard 64x64 dim 0 -> dim 1", "fixed"),
    Scenario("fixed-gather", "per call: gather 64x64 to all ranks", "fixed"),
    Scenario("fixed-tree", "per call: reshard a tree of 70 8x4 arrays, Chunk(0) -> Replicated", "fixed"),
)
BY_KEY = {s.key: s for s in SCENARIOS}


def jobs(world: int, sizes: Sequence[float]) -> list[tuple[str, float]]:
    """(scenario key, MiB) pairs that ``world`` ranks can run, smallest size first.

    The fixed-cost scenarios once each, at their own size (``FIXED_MIB``), first.
    """
    sized = [s for s in SCENARIOS if s.world_min <= world and s.kind != "fixed"]
    fixed = [(s.key, FIXED_MIB) for s in SCENARIOS if s.world_min <= world and s.kind == "fixed"]
    return fixed + [(s.key, float(mib)) for mib in sizes for s in sized]


def label(key: str, mib: float) -> str:
    """The case name of scenario ``key`` at ``mib`` MiB (a fixed-cost scenario: its title)."""
    if BY_KEY[key].kind == "fixed":
        return BY_KEY[key].title
    return f"{BY_KEY[key].title}, {mib:g} MiB"


# -- the parent: launch, progress, combine the ranks' results ---------------------------------


def run(todo: Sequence[tuple[str, float]], world: int, reps: int, peers: bool,
        progress: Progress | None = None, calls: int = FIXED_CALLS) -> list[dict[str, Any]]:  # fmt: skip
    """Launches ``world`` Gloo processes, runs ``todo`` in them; one combined result per job.

    Rank 0 reports each job's start and end, which ``progress`` receives as they happen.
    A fixed-cost scenario times ``calls`` operations per round.
    """
    if not todo:
        return []
    queue = mp.get_context("spawn").SimpleQueue() if progress is not None else None
    watcher = threading.Thread(target=_watch, args=(queue, progress, list(todo)), daemon=True)
    if queue is not None:
        watcher.start()
    try:
        for attempt in range(2):
            try:
                per_rank = launch(job, world, list(todo), reps, peers, queue, calls, timeout=TIMEOUT_S)
                break
            except RuntimeError as exc:  # a rendezvous that lost its port to another process: once more
                if attempt or "connectFullMesh" not in str(exc):
                    raise
    finally:
        if queue is not None:
            queue.put(None)
            watcher.join()
    return [combine([r[k] for r in per_rank]) for k in range(len(todo))]


def _watch(queue: Any, progress: Progress, todo: list[tuple[str, float]]) -> None:
    """Forwards rank 0's ``("start" | "done", job)`` messages to ``progress`` until ``None``."""
    while (message := queue.get()) is not None:
        kind, k = message
        if kind == "start":
            progress.start(label(*todo[k]))
        else:
            progress.done()


def combine(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One scenario's result from every rank's: per round the slowest rank, then the median."""
    got = [p for p in parts if p is not None]
    first = got[0]
    scenario = BY_KEY[first["key"]]
    out: dict[str, Any] = {
        "key": scenario.key,
        "mib": first["mib"],
        "ranks": len(first["members"]),
        "floor_op": first["floor_op"],
        "p2p_op": first["p2p_op"],
        "min_bytes": first["min_elements"] * ITEMSIZE,
        "floor_bytes": first["floor_elements"] * ITEMSIZE,
        "fshard_bytes": sum(p["sent"] for p in got) * ITEMSIZE,
        "target": scenario.target,
        "unsupported": first["unsupported"],
        "notes": first["notes"],
        "impls": {},
    }
    for name in IMPLS:
        if name not in first["samples"]:
            continue
        rounds = [max(vals) for vals in zip(*(p["samples"][name] for p in got))]
        memory = [p["memory"][name] for p in got if p["memory"][name] is not None]
        checks = [p["checks"][name] for p in got if p["checks"][name] is not None]
        out["impls"][name] = {
            "median_s": statistics.median(rounds),
            "samples_s": rounds,
            "cpu_s": statistics.median(statistics.median(p["cpu"][name]) for p in got) if "cpu" in first else None,
            "peak_extra_mib": max(memory) if memory else None,
            "verified": all(checks) if checks else None,
        }
    floor = min(out["impls"][name]["median_s"] for name in FLOORS if name in out["impls"])
    out["floor_s"] = floor
    for r in out["impls"].values():
        r["ratio"] = r["median_s"] / floor if floor > 0 else None
    ratio = out["impls"]["fshard"]["ratio"]
    ref = out["impls"].get(REFERENCE)
    out["ref_ratio"] = out["impls"]["fshard"]["median_s"] / ref["median_s"] if ref and ref["median_s"] > 0 else None
    out["overhead_s"] = out["impls"]["fshard"]["median_s"] - floor
    leaf = out["impls"].get("one leaf")
    out["leaf_ratio"] = out["impls"]["fshard"]["median_s"] / leaf["median_s"] if leaf and leaf["median_s"] > 0 else None
    out["bytes_ok"] = out["fshard_bytes"] == out["min_bytes"]
    out["ratio_ok"] = None if scenario.target is None else ratio is not None and ratio <= scenario.target
    return out


def result_rows(res: dict[str, Any], group: str) -> list[Row]:
    """The table rows of one combined result: one per implementation, or per peer that cannot do it."""
    series, mib = BY_KEY[res["key"]].title, res["mib"]
    case, fshard_s = label(res["key"], mib), res["impls"]["fshard"]["median_s"]
    fixed = res["target"] is None
    common = {"series": series, "size_mib": None if fixed else mib, "min_bytes": res["min_bytes"]}
    rows = []
    for name in IMPLS:
        r = res["impls"].get(name)
        if r is None:
            if name in res["unsupported"]:
                rows.append(Row(group, case, name, None, note="N/A: " + res["unsupported"][name], **common))
            continue
        target, ok, sent, note = "", None, None, res["notes"].get(name, "")
        if name in FLOORS:
            sent = res["floor_bytes"]
            note = res["floor_op"] if name == "floor" else res["p2p_op"]
            if r["median_s"] == res["floor_s"] and len([n for n in FLOORS if n in res["impls"]]) > 1:
                note += " (the floor)"
        elif name == "fshard" and res["target"] is None:  # a fixed cost: reported, no goal
            sent = res["fshard_bytes"]
            note = f"fshard - floor = {res['overhead_s'] * 1e6:.0f} µs per call"
            if r.get("cpu_s") is not None:
                note += f"; calling thread's CPU +{(r['cpu_s'] - res['impls']['floor']['cpu_s']) * 1e6:.0f} µs"
            if res.get("leaf_ratio") is not None:  # a tree: its time against one of its arrays'
                note += f"; tree / one leaf = {res['leaf_ratio']:.2f}x"
                target, ok = f"<= {TREE_TARGET:.2f}x one leaf", res["leaf_ratio"] <= TREE_TARGET
        elif name == "fshard":
            target, sent = f"<= {res['target']:.2f}x floor", res["fshard_bytes"]
            ok = res["ratio_ok"] and res["bytes_ok"] and r["verified"] is not False
        elif name == REFERENCE:
            target = f"fshard <= {REFERENCE_TARGET:.2f}x"
            ok = res["ref_ratio"] is not None and res["ref_ratio"] <= REFERENCE_TARGET
            note = f"fshard / {name} = {res['ref_ratio']:.2f}x; one strided pack, all_to_all_single into the output"
        elif name in DIAGNOSTICS:
            note = note or "fshard's copies alone, no messages"
        else:
            target, ok = "fshard faster", fshard_s < r["median_s"]
            note = "; ".join(n for n in (note, f"fshard / {name} = {fshard_s / r['median_s']:.2f}x") if n)
        rows.append(Row(group, case, name, r["median_s"], len(r["samples_s"]), r["ratio"], "x floor", target, ok,
                        note, tuple(r["samples_s"]), sent_bytes=sent, peak_mib=r["peak_extra_mib"],
                        verified=r["verified"], **common))  # fmt: skip
    return rows


# -- the ``python -m fshard bench`` hook ------------------------------------------------------


class _Batch:
    """Runs the cases of one ``cases()`` call in one launch, when the first one is asked for.

    It holds its cases weakly: those a caller dropped before running any (``python -m
    fshard bench --only ...`` filters the list) are gone by then and do not run.
    """

    def __init__(self, world: int, todo: list[tuple[str, float]], reps: int, peers: bool,
                 calls: int = FIXED_CALLS) -> None:  # fmt: skip
        self.world, self.todo, self.reps, self.peers, self.calls = world, todo, reps, peers, calls
        self.cases: weakref.WeakSet[DistCase] = weakref.WeakSet()
        self.results: dict[tuple[str, float], dict[str, Any]] | None = None

    def result(self, key: str, mib: float, progress: Progress | None) -> dict[str, Any]:
        if self.results is None:
            alive = {(c.key, c.mib) for c in self.cases} | {(key, mib)}
            todo = [j for j in self.todo if j in alive]
            done = run(todo, self.world, self.reps, self.peers, progress, self.calls)
            self.results = {(r["key"], r["mib"]): r for r in done}
        return self.results[(key, mib)]


@dataclasses.dataclass(frozen=True)
class DistCase:
    """One scenario at one size, as a ``benchmarks.common.Case`` (``group``, ``name``, ``run``)."""

    key: str
    mib: float
    batch: _Batch = dataclasses.field(compare=False, repr=False)
    group: str = dataclasses.field(default=GROUP, compare=False)

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        return label(self.key, self.mib)

    def run(self, settings: Settings) -> list[Row]:
        """The case's rows; the first case run of a batch runs them all (``settings.progress`` sees each)."""
        return result_rows(self.batch.result(self.key, self.mib, settings.progress), self.group)


def cases(settings: Settings) -> list[DistCase]:
    """The distributed cases, and the fixed-cost cases in a group of their own.

    Each runs at ``settings.sizes`` MiB (default 16 and 256; 1 with ``quick``) on ``settings.world``
    processes, ``settings.reps`` rounds (at most 5 with ``quick``).
    """
    sizes = settings.sizes or (QUICK_SIZES if settings.quick else SIZES)
    reps = min(QUICK_REPS, settings.reps) if settings.quick else settings.reps
    todo = jobs(settings.world, sizes)
    calls = QUICK_FIXED_CALLS if settings.quick else FIXED_CALLS
    batch = _Batch(settings.world, todo, reps, settings.peers, calls)
    cores = os.cpu_count() or 1
    where = f"{settings.world} Gloo processes on 127.0.0.1 sharing {cores} cores"
    group = f"{GROUP}: {where}"
    fixed = f"{GROUP}, fixed cost per call: {where}"
    out = [DistCase(key, mib, batch, fixed if BY_KEY[key].kind == "fixed" else group) for key, mib in todo]
    batch.cases.update(out)
    return out
