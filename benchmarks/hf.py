"""Hugging Face checkpoints on N Gloo processes: ``fshard.load`` and ``fshard.save_safetensors`` against safetensors.

The model is ``MATRICES`` float32 matrices of ``COLS`` columns, ``--sizes`` MiB in all (default
1024; 16 with ``--quick``), written once as a Hugging Face folder of ``world`` files
(``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``), and, for the
references, each rank's rows of every matrix as a file of its own. All processes share this
machine and read through its page cache (warm: the files were just written), so load times
measure reading and copying, not the disk. Three cases, each timed in interleaved rounds (a
round's time is the slowest rank's, from a barrier; median of ``--reps``):

- **folder -> Chunk(0)**: ``fshard.load(folder, specs=Chunk(0))`` against each rank's
  ``safetensors.torch.load_file`` of a file holding exactly its rows (the same bytes),
  copied into memory the rank owns, as fshard's shards are (target 1.2x). safetensors
  0.8's ``load_file`` maps the file and returns tensors over the mapping, read from the
  page cache on first use and changed if the file is; its lazy call, and the call with one
  byte of every page touched (the bytes faulted in, not copied), are rows of their own.
  Also: the bytes all ranks read from disk over the distinct boxes' bytes
  (target 1.01; ``fshard._checkpoint._safetensors.counters``), and each rank's peak
  resident-set growth over one load against its shards' bytes + 64 MiB.
- **folder -> Replicated**: every rank holds the whole model. Bytes read from disk by all
  ranks together over one copy (target 1.01: each box read by one rank, sent to the others),
  timed (no target) against each rank's ``load_file`` of every file, copied: here the page
  cache is faster than the messages, on a cluster the storage is the slower.
- **save_safetensors**: the Chunk(0) arrays saved from every rank as ``world`` files (one per
  rank) against each rank's ``safetensors.torch.save_file`` of its rows plus an fsync, as
  ``save_safetensors`` fsyncs (target 1.3x); peak growth against one file + 64 MiB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import fshard
from fshard._checkpoint._safetensors import counters
from fshard.backends.local import empty_cache
from fshard.testing.launch import launch

from .common import Row, Settings

__all__ = ["HFCase", "cases", "job"]

GROUP = "checkpoint: Hugging Face safetensors"
MATRICES = 8
COLS = 2048
LOAD_TARGET, SAVE_TARGET, BYTES_TARGET = 1.2, 1.3, 1.01
SLACK_MIB = 64


def _rows(mib: float, world: int) -> int:
    """Rows per matrix: ``MATRICES`` float32 matrices of ``COLS`` columns in ``mib`` MiB, a multiple of ``world``."""
    return max(world, int(mib * (1 << 20) / (MATRICES * COLS * 4)) // world * world)


def write_folder(root: Path, mib: float, world: int) -> dict[str, tuple[int, int]]:
    """The model as a Hugging Face folder of ``world`` files and per-rank row files; returns the shapes by name."""
    rows = _rows(mib, world)
    names = [f"layers.{k}.weight" for k in range(MATRICES)]
    folder = root / "hf"
    folder.mkdir(parents=True)
    per_file = math.ceil(MATRICES / world)
    files = [names[i : i + per_file] for i in range(0, MATRICES, per_file)]
    weight_map: dict[str, str] = {}
    g = torch.Generator().manual_seed(0)
    for k, group in enumerate(files):
        tensors = {n: torch.randn(rows, COLS, generator=g) for n in group}
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
    index = {"metadata": {"total_size": MATRICES * rows * COLS * 4}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    full = {n: t for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(f).items()}
    for r in range(world):
        part = rows // world
        save_file(
            {n: t[r * part : (r + 1) * part].contiguous() for n, t in full.items()}, root / f"rows-{r}.safetensors"
        )
    return dict.fromkeys(names, (rows, COLS))


# -- on every rank -------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        text = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":")))
    return None


def _peak_mib(fn: Any) -> float | None:
    """Peak resident-set growth (MiB) of this process over one call of ``fn`` (its result kept until the end)."""
    import torch.distributed as dist

    gc.collect()
    empty_cache()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    dist.barrier()
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return None if before is None or peak is None else max(0, peak - before) / 1024


def _touched(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` after reading one byte of each 4 KiB page: lazily mapped data is then in memory."""
    for t in tensors.values():
        t.reshape(-1).view(torch.uint8)[::4096].sum()
    return tensors


def _copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` copied out of the file mapping into memory this process owns."""
    return {n: t.clone() for n, t in tensors.items()}


def _save_durable(tensors: dict[str, torch.Tensor], path: Path) -> None:

    save_file(tensors, path, metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.unlink()


def job(root: str, shapes: dict[str, tuple[int, int]], reps: int) -> dict[str, Any]:
    """One rank's times, bytes read, peak memory and checks of every implementation."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = list(range(world))
    base, folder = Path(root), Path(root) / "hf"
    files = sorted(folder.glob("*.safetensors"))
    mine = base / f"rows-{rank}.safetensors"
    chunk = dict.fromkeys(shapes, fshard.Chunk(0, ranks))
    repl = dict.fromkeys(shapes, fshard.Replicated(ranks))
    total = sum(math.prod(s) * 4 for s in shapes.values())
    arrays = fshard.load(folder, specs=chunk)
    local = {n: a.local_tensor() for n, a in arrays.items()}
    out, own = base / "out", base / f"own-{rank}.safetensors"
    quarter = math.ceil(total / world)

    def fresh_out() -> None:
        if rank == 0:
            _remove(out)
        dist.barrier()

    impls: dict[str, tuple[Any, Any]] = {
        "load_file (own rows, lazy)": (lambda: load_file(mine), None),
        "load_file (own rows, pages touched)": (lambda: _touched(load_file(mine)), None),
        "load_file (own rows)": (lambda: _copied(load_file(mine)), None),
        "fshard.load -> Chunk(0)": (lambda: fshard.load(folder, specs=chunk), None),
        "load_file (every file)": (lambda: [_copied(load_file(f)) for f in files], None),
        "fshard.load -> Replicated": (lambda: fshard.load(folder, specs=repl), None),
        "save_file + fsync (own rows)": (lambda: _save_durable(local, own), lambda: _remove(own)),
        "fshard.save_safetensors": (lambda: fshard.save_safetensors(out, arrays, max_shard_size=quarter), fresh_out),
    }
    samples: dict[str, list[float]] = {k: [] for k in impls}
    for rep in range(reps + 1):
        for name, (fn, setup) in impls.items():
            if setup is not None:
                setup()
            dist.barrier()
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            del result
            if rep:
                samples[name].append(elapsed)
    read: dict[str, int] = {}
    for name, specs in (("fshard.load -> Chunk(0)", chunk), ("fshard.load -> Replicated", repl)):
        counters.reset()
        fshard.load(folder, specs=specs)
        read[name] = counters.bytes_read
    peak = {
        "fshard.load -> Chunk(0)": _peak_mib(lambda: fshard.load(folder, specs=chunk)),
        "load_file (own rows)": _peak_mib(lambda: _copied(load_file(mine))),
    }
    fresh_out()
    peak["fshard.save_safetensors"] = _peak_mib(lambda: fshard.save_safetensors(out, arrays, max_shard_size=quarter))
    checks = _checks(folder, out, mine, chunk, repl, rank)
    shard_mib = sum(t.nbytes for t in local.values()) / 2**20
    files_out = len(list(out.glob("model-*.safetensors")))
    return {"samples": samples, "read": read, "peak": peak, "checks": checks, "shard_mib": shard_mib,
            "file_mib": quarter / 2**20, "total": total, "files_out": files_out}  # fmt: skip


def _checks(folder: Path, out: Path, mine: Path, chunk: Any, repl: Any, rank: int) -> dict[str, bool]:
    """Whether each fshard result is what safetensors reads."""
    own = load_file(mine)
    loaded = fshard.load(folder, specs=chunk)
    everything = fshard.load(folder, specs=repl)
    whole = {n: a.local_tensor() for n, a in everything.items()}
    saved = {n: t for f in sorted(out.glob("*.safetensors")) for n, t in load_file(f).items()}
    rows = {n: slice(rank * len(t), (rank + 1) * len(t)) for n, t in own.items()}
    return {
        "fshard.load -> Chunk(0)": all(torch.equal(loaded[n].local_tensor(), t) for n, t in own.items()),
        "fshard.load -> Replicated": set(whole) == set(own)
        and all(torch.equal(whole[n][rows[n]], t) for n, t in own.items()),
        "fshard.save_safetensors": set(saved) == set(whole) and all(torch.equal(saved[n], whole[n]) for n in whole),
    }


# -- the cases -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Batch:
    """One launch of ``world`` processes measures every case of one size."""

    world: int
    mib: float
    reps: int
    results: list[dict[str, Any]] | None = None

    def result(self) -> list[dict[str, Any]]:
        if self.results is None:
            with tempfile.TemporaryDirectory(prefix="fshard-bench-hf-") as d:
                shapes = write_folder(Path(d), self.mib, self.world)
                self.results = launch(job, self.world, d, shapes, self.reps, timeout=600 + 2 * self.mib)
        return self.results


def _median_slowest(parts: list[dict[str, Any]], name: str) -> tuple[float, list[float]]:
    rounds = [max(v) for v in zip(*(p["samples"][name] for p in parts))]
    return statistics.median(rounds), rounds


@dataclasses.dataclass(frozen=True)
class HFCase:
    """One of the three cases at one size (``kind``: ``"chunk"``, ``"replicated"`` or ``"save"``)."""

    kind: str
    batch: _Batch = dataclasses.field(compare=False, repr=False)

    @property
    def group(self) -> str:
        """The table this case goes in."""
        return f"{GROUP}, {self.batch.world} Gloo processes"

    @property
    def name(self) -> str:
        """The case's name in the tables."""
        what = {"chunk": "folder -> Chunk(0)", "replicated": "folder -> Replicated", "save": "save_safetensors"}
        return f"{what[self.kind]}, {self.batch.mib:g} MiB"

    def run(self, settings: Settings) -> list[Row]:
        """Measures the case's two implementations; one row each."""
        parts = self.batch.result()
        ref, impl = {
            "chunk": ("load_file (own rows)", "fshard.load -> Chunk(0)"),
            "replicated": ("load_file (every file)", "fshard.load -> Replicated"),
            "save": ("save_file + fsync (own rows)", "fshard.save_safetensors"),
        }[self.kind]
        ref_s, ref_rounds = _median_slowest(parts, ref)
        s, rounds = _median_slowest(parts, impl)
        target = {"chunk": LOAD_TARGET, "save": SAVE_TARGET}.get(self.kind)  # Replicated: a bytes target only
        notes, ok = self._notes(parts, impl)
        verified = all(p["checks"][impl] for p in parts)
        rows = [Row(self.group, self.name, ref, ref_s, len(ref_rounds), samples=tuple(ref_rounds))]
        if self.kind == "chunk":
            for name, note in (
                ("load_file (own rows, lazy)", "tensors over a mapping of the file, read on first use"),
                ("load_file (own rows, pages touched)", "one byte of each page read: faulted in, not copied"),
            ):
                other_s, other = _median_slowest(parts, name)
                rows.insert(len(rows) - 1, Row(self.group, self.name, name, other_s, len(other), note=note))
        peak = max((p["peak"].get(impl) or 0.0) for p in parts) if impl in parts[0]["peak"] else None
        goal = f"<= {target:.1f}x" if target is not None else f"bytes <= {BYTES_TARGET}x"
        ok = ok and (target is None or s / ref_s <= target)
        row = Row(self.group, self.name, impl, s, len(rounds), ratio=s / ref_s, ratio_to=ref, target=goal, ok=ok,
                  note="; ".join(notes), samples=tuple(rounds), peak_mib=peak, verified=verified)  # fmt: skip
        return [*rows, row]

    def _notes(self, parts: list[dict[str, Any]], impl: str) -> tuple[list[str], bool]:
        total, ok, notes = parts[0]["total"], True, []
        if impl in parts[0]["read"]:
            read = sum(p["read"][impl] for p in parts)
            copies = read / total
            ok &= copies <= BYTES_TARGET
            what = "distinct boxes" if self.kind == "chunk" else "one copy"
            notes.append(f"disk bytes read {read / 2**20:.1f} MiB = {copies:.3f}x {what} (target <= {BYTES_TARGET}x)")
        if impl in parts[0]["peak"]:
            limit = parts[0]["file_mib" if self.kind == "save" else "shard_mib"] + SLACK_MIB
            peaks = [p["peak"][impl] for p in parts]
            if all(v is not None for v in peaks):
                ok &= max(peaks) <= limit
                base = "one file" if self.kind == "save" else "its shards"
                each = ", ".join(f"{v:.0f}" for v in peaks)
                notes.append(f"peak RSS growth per rank {each} MiB (target <= {base} + {SLACK_MIB} = {limit:.0f} MiB)")
        if self.kind == "save":
            notes.append(f"{parts[0]['files_out']} files, one per rank")
        return notes, ok


def cases(settings: Settings) -> list[Any]:
    """The three cases at each size (``--sizes`` MiB; default 1024, 16 with ``--quick``)."""
    world = int(getattr(settings, "world", 4) or 4)
    sizes = settings.sizes or ((16.0,) if settings.quick else (1024.0,))
    reps = min(settings.reps, 5) if settings.quick else max(3, min(settings.reps, 7))
    out: list[Any] = []
    for mib in sizes:
        batch = _Batch(world, mib, reps)
        out += [HFCase(kind, batch) for kind in ("chunk", "replicated", "save")]
    return out
