"""Inside the ranks: interleaved timing, bytes sent and peak memory of each scenario.

Every rank makes the same collective calls in the same order; ``job`` is what
``fshard.testing.launch.launch`` runs on each of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
import warnings
from pathlib import Path
from typing import Any

from fshard.backends.local import empty_cache

from .dist_build import build
from .floors import Env, Impl

__all__ = ["job", "run_scenario"]


def _timed_call(impl: Impl, state: Any, group: Any) -> tuple[float, float]:
    """The wall time of one call and the CPU time of this (the calling) thread in it."""
    import torch.distributed as dist

    dist.barrier(group=group)
    gc.disable()  # a collection pause would land on whichever call happens to trigger it
    try:
        start, cpu = time.perf_counter(), time.thread_time()
        result = impl.fn(state)
        cpu, elapsed = time.thread_time() - cpu, time.perf_counter() - start
    finally:
        gc.enable()
    del result  # freed outside the timed region
    return elapsed, cpu


def _status_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        text = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":")))
    return None


def _reset_peak() -> bool:
    """Sets this process's resident-set high-water mark to its current size (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


_LIBC: Any = None


def _trim() -> None:
    """Frees what this process holds but does not use, so the next call's growth is its own."""
    global _LIBC

    gc.collect()
    empty_cache()
    gc.collect()
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _measure_memory(impl: Impl, group: Any) -> float | None:
    """Peak resident-set growth (MiB) of this process over one call, its buffers included."""
    import torch.distributed as dist

    state = impl.setup() if impl.setup else None
    _trim()
    dist.barrier(group=group)
    ok = _reset_peak()
    before = _status_kib("VmRSS")
    if impl.buffers is not None:
        state = impl.buffers()
    result = impl.fn(state)
    peak = _status_kib("VmHWM")
    del result, state
    if not ok or before is None or peak is None:
        return None
    return max(0, peak - before) / 1024


def run_scenario(key: str, mib: float, env: Env, reps: int, calls: int = 1) -> dict[str, Any] | None:
    """Times one scenario on this rank; returns this rank's raw results (``None`` off its group).

    A sample is the time per operation: a call's time over the operations it makes (``Impl.calls``); ``cpu`` has the
    calling thread's CPU time per operation the same way.
    """
    import torch.distributed as dist

    gc.collect()
    began = time.perf_counter()
    built = build(key, mib, env, calls)
    if env.rank not in built.members:
        return None
    group, impls = built.group, built.impls
    states = {name: impl.buffers() if impl.buffers else None for name, impl in impls.items()}
    checks: dict[str, bool | None] = {}
    for name, impl in impls.items():  # warm-up, checked
        state = impl.setup() if impl.setup else states[name]
        dist.barrier(group=group)
        result = impl.fn(state)
        checks[name] = impl.check(result) if impl.check else None
        del result
    samples: dict[str, list[float]] = {name: [] for name in impls}
    cpu: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, impl in impls.items():
            state = impl.setup() if impl.setup else states[name]
            elapsed, used = _timed_call(impl, state, group)
            samples[name].append(elapsed / impl.calls)
            cpu[name].append(used / impl.calls)
    sent = built.fshard_once()
    del states
    memory = {name: _measure_memory(impl, group) for name, impl in impls.items()}
    _trim()
    return {
        "key": key,
        "mib": mib,
        "members": built.members,
        "samples": samples,
        "cpu": cpu,
        "checks": checks,
        "sent": sent,
        "memory": memory,
        "min_elements": built.min_elements,
        "floor_elements": built.floor_elements,
        "unsupported": built.unsupported,
        "notes": built.notes,
        "floor_op": built.floor_op,
        "p2p_op": built.p2p_op,
        "wall_s": time.perf_counter() - began,
    }


def job(jobs: list[tuple[str, float]], reps: int, peers: bool, report: Any = None,
        calls: int = 1) -> list[dict[str, Any] | None]:  # fmt: skip
    """One rank's whole run: every (scenario, size) of ``jobs``, in order.

    ``calls`` is the number of operations per timed call of the fixed-cost scenarios.

    Rank 0 puts ``("start", k)`` and ``("done", k)`` for job ``k`` on ``report`` (a
    multiprocessing queue, or ``None``), so that the parent can show progress.
    """
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor is deprecated
    warnings.filterwarnings("ignore", category=UserWarning)
    # DTensor says once per process that CPU groups have no all_to_all; the table says it instead.
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    env = Env(dist.get_world_size(), peers)
    tell = report.put if report is not None and env.rank == 0 else lambda _: None
    out = []
    for k, (key, mib) in enumerate(jobs):
        tell(("start", k))
        out.append(run_scenario(key, mib, env, reps, calls))
        dist.barrier()
        tell(("done", k))
    return out
