"""Checkpoint throughput: ``fshard.save``/``load`` against ``torch.save``/``torch.load`` and DCP.

One tree of ``--gib`` GiB (eight float32 matrices), measured three ways in one run:

- one process: fshard on the local backend (4 ranks in the process, 4 files) and
  ``torch.save``/``torch.load(weights_only=True)`` of the same full tensors;
- 4 Gloo processes: fshard on torch_dist and DCP (``torch.distributed.checkpoint``,
  DTensors sharded on dim 0), each saving from 4 ranks and loading on 4 ranks;
- 2 Gloo processes: loading the 4-rank checkpoints into a 2-rank layout.

Every save is durable: fshard and DCP fsync their files (DCP's ``sync_files``
default), and the ``torch.save`` row fsyncs too. Loads read through the page
cache, warm from the save (the machine's memory holds the files), so they
measure deserialisation and copies, not the disk. fshard's loads, like its
reshards, recycle the memory of arrays that have died (``fshard/_base/alloc.py``);
the "fresh memory" row empties that cache first, so its outputs pay the page
faults that a first load in a process (and every ``torch.load``) pays. Throughput is GiB of tensor
data per second of wall time (median of ``--reps``); multi-process times run
from a barrier before the call to a barrier after it, on rank 0.

Run: ``python -m fshard.benchmarks.checkpoint [--gib 1] [--reps 3] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import fshard
from fshard.backends.local import empty_cache
from fshard.testing.launch import launch

__all__ = ["main", "measure_local", "measure_dist"]

MATRICES = 8
COLS = 4096


def _rows(gib: float) -> int:
    """Rows per matrix so that ``MATRICES`` float32 matrices of ``COLS`` columns hold ``gib`` GiB."""
    return max(4, int(gib * (1 << 30) / (MATRICES * COLS * 4)) // 4 * 4)


def _fresh(root: Path, name: str) -> Path:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    return path


Job = tuple[Callable[[], Any], Callable[[], Any] | None]  # (timed call, untimed setup before it)


def _rounds(jobs: dict[str, Job], reps: int, barrier: Callable[[], Any] = lambda: None) -> dict[str, list[float]]:
    """Seconds per call of each job, round-robin (A B C A B C ...) after one untimed warm-up call each.

    Interleaving makes noise from other processes on the machine hit every job alike;
    ``barrier`` (a collective one under torch.distributed) brackets each timed call.
    """
    out: dict[str, list[float]] = {name: [] for name in jobs}
    for rep in range(reps + 1):
        for name, (fn, setup) in jobs.items():
            if setup is not None:
                setup()
            barrier()
            start = time.perf_counter()
            result = fn()
            barrier()
            if rep:
                out[name].append(time.perf_counter() - start)
            del result
    return out


def _torch_save_durable(tree: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(tree, f)
        f.flush()
        os.fsync(f.fileno())


def measure_local(gib: float, reps: int, root: Path) -> dict[str, list[float]]:
    """Seconds per call in one process: fshard (local backend, 4 ranks) and torch.save/torch.load."""
    rows = _rows(gib)
    full = {f"w{k}": torch.randn(rows, COLS) for k in range(MATRICES)}
    four = fshard.Chunk(0, [0, 1, 2, 3])
    tree = {k: fshard.shard(v, four) for k, v in full.items()}
    two = {k: fshard.Chunk(1, [0, 1]) for k in full}
    ck, pt = root / "fshard-local", root / "torch.pt"
    return _rounds(
        {
            "fshard.save (local, 4 ranks)": (lambda: fshard.save(ck, tree), lambda: _fresh(root, ck.name)),
            "torch.save + fsync": (lambda: _torch_save_durable(full, pt), None),
            "fshard.load 4 -> 4 ranks (local, verify)": (lambda: fshard.load(ck, like=tree), None),
            "fshard.load 4 -> 4 ranks (local, verify, fresh memory)": (lambda: fshard.load(ck, like=tree), empty_cache),
            "fshard.load 4 -> 4 ranks (local, verify=False)": (lambda: fshard.load(ck, like=tree, verify=False), None),
            "fshard.load 4 -> 2 ranks (local, verify)": (lambda: fshard.load(ck, specs=two), None),
            "torch.load (weights_only)": (lambda: torch.load(pt, weights_only=True), None),
        },
        reps,
    )


# -- multi-process ---------------------------------------------------------------------------


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _dist_save(gib: float, reps: int, root: str) -> dict[str, list[float]]:
    """On 4 ranks: fshard.save and DCP save of the same sharded tree; then loads on the same 4 ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rows = dist.get_world_size(), _rows(gib)
    ranks = list(range(world))
    spec = fshard.Chunk(0, ranks)
    tree = {f"w{k}": fshard.map_local(torch.randn_like, fshard.empty(spec, rows, COLS)) for k in range(MATRICES)}
    mesh = init_device_mesh("cpu", (world,))
    state = {k: DTensor.from_local(v.local_tensor().clone(), mesh, [Shard(0)]) for k, v in tree.items()}
    base = Path(root)
    ck, dc = base / "fshard-dist", base / "dcp"
    warnings.filterwarnings("ignore", category=FutureWarning)  # DCP's own use of deprecated collectives
    on_rank0 = lambda path: lambda: _fresh(base, path.name) if dist.get_rank() == 0 else None  # noqa: E731
    jobs: dict[str, Job] = {
        "fshard.save (4 processes)": (lambda: fshard.save(ck, tree), on_rank0(ck)),
        "DCP save (4 processes)": (lambda: dcp.save(state, checkpoint_id=dc), on_rank0(dc)),
        "fshard.load 4 -> 4 processes (verify)": (lambda: fshard.load(ck, like=tree), None),
        "fshard.load 4 -> 4 processes (verify=False)": (lambda: fshard.load(ck, like=tree, verify=False), None),
        "DCP load 4 -> 4 processes": (lambda: dcp.load(state, checkpoint_id=dc), None),
    }
    return _rounds(jobs, reps, _barrier)


def _dist_load(gib: float, reps: int, root: str) -> dict[str, list[float]]:
    """On 2 ranks: fshard.load and DCP load of the 4-rank checkpoints into a 2-rank layout."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    world, rows = dist.get_world_size(), _rows(gib)
    specs = {f"w{k}": fshard.Chunk(0, list(range(world))) for k in range(MATRICES)}
    mesh = init_device_mesh("cpu", (world,))
    state = {k: dtensor_empty(rows, COLS, device_mesh=mesh, placements=[Shard(0)]) for k in specs}
    base = Path(root)
    ck, dc = base / "fshard-dist", base / "dcp"
    warnings.filterwarnings("ignore", category=FutureWarning)  # DCP's own use of deprecated collectives
    jobs: dict[str, Job] = {
        f"fshard.load 4 -> {world} processes (verify)": (lambda: fshard.load(ck, specs=specs), None),
        f"fshard.load 4 -> {world} processes (verify=False)": (
            lambda: fshard.load(ck, specs=specs, verify=False),
            None,
        ),
        f"DCP load 4 -> {world} processes": (lambda: dcp.load(state, checkpoint_id=dc), None),
    }
    return _rounds(jobs, reps, _barrier)


def measure_dist(gib: float, reps: int, root: Path, world: int = 4, load_world: int = 2) -> dict[str, list[float]]:
    """Seconds per call on ``world`` Gloo processes (save, load) and ``load_world`` processes (load)."""
    timeout = 600 + 120 * gib * reps
    out = launch(_dist_save, world, gib, reps, str(root), timeout=timeout)[0]
    out |= launch(_dist_load, load_world, gib, reps, str(root), timeout=timeout)[0]
    return out


def _table(results: dict[str, list[float]], gib: float) -> str:
    width = max(map(len, results))
    lines = [f"{'':{width}}  {'median s':>9}  {'GiB/s':>6}  {'best s':>7}"]
    for name, samples in results.items():
        m = statistics.median(samples)
        lines.append(f"{name:{width}}  {m:9.3f}  {gib / m:6.2f}  {min(samples):7.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measures and prints the table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the tree in GiB")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median reported)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the checkpoints go")
    parser.add_argument("--no-dist", action="store_true", help="skip the multi-process measurements")
    args = parser.parse_args(argv)
    gib = MATRICES * _rows(args.gib) * COLS * 4 / (1 << 30)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fshard-bench-") as d:
        root = Path(d)
        results = measure_local(args.gib, args.reps, root)
        for p in root.iterdir():  # room on disk and in the page cache for the next part
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if not args.no_dist:
            results |= measure_dist(args.gib, args.reps, root)
    where = f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"checkpoint throughput: {gib:.2f} GiB tree ({MATRICES} float32 matrices), {where}")
    print(_table(results, gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
