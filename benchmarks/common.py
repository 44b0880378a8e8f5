"""What every benchmark case shares: settings, result rows, and interleaved timing."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["Case", "Progress", "Row", "Settings", "Timed", "interleaved", "median"]


class Progress(Protocol):
    """Where a case that runs several steps at once (a multi-process batch) reports them."""

    def start(self, label: str) -> None:
        """A step named ``label`` begins."""
        ...

    def done(self) -> None:
        """The current step has finished."""
        ...


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a run is configured (from the command line).

    Attributes:
        quick: smaller sizes, for a fast check that everything runs.
        reps: repetitions per measurement (the median is reported).
        peers: also time torch's own implementations where they exist.
        slow_budget_s: a function slower than 1 s per call gets fewer repetitions
            (at least 3), about this many seconds in all.
        skip_over_s: a peer estimated to take longer than this per call is not run.
        world: processes of the multi-process cases.
        sizes: tensor sizes in MiB of the data-movement cases (``None``: each module's default).
        progress: where batched cases report their steps (not saved with the results).
    """

    quick: bool = False
    reps: int = 15
    peers: bool = True
    slow_budget_s: float = 20.0
    skip_over_s: float = 30.0
    world: int = 4
    sizes: tuple[float, ...] | None = None
    progress: Progress | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the settings (``progress`` left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "progress"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured (or skipped) implementation of one case.

    ``ratio`` compares with the case's reference implementation (``ratio_to`` names
    it); ``target`` states the goal and ``ok`` whether it was met (``None``: no goal).
    Data-movement cases also give ``series`` (the case without its size, one plot
    panel), ``size_mib``, the bytes sent against the minimum, the peak extra memory and
    whether the result was checked correct (``None`` where a field does not apply).
    Cases that grow along something else than bytes give ``series``, ``x`` and
    ``x_label`` (``"ranks"``, say) to be plotted against it instead.
    """

    group: str
    case: str
    impl: str
    seconds: float | None
    reps: int = 0
    ratio: float | None = None
    ratio_to: str = ""
    target: str = ""
    ok: bool | None = None
    note: str = ""
    samples: tuple[float, ...] = ()
    series: str = ""
    size_mib: float | None = None
    sent_bytes: int | None = None
    min_bytes: int | None = None
    peak_mib: float | None = None
    verified: bool | None = None
    x: float | None = None
    x_label: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field."""
        return dataclasses.asdict(self)


class Case(Protocol):
    """A benchmark: ``run`` measures every implementation of one scenario."""

    group: str
    name: str

    def run(self, settings: Settings) -> list[Row]:
        """Measures and returns one row per implementation."""
        ...


@dataclasses.dataclass(frozen=True)
class Timed:
    """A function to time, and an untimed ``setup`` run before each call."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None


def interleaved(fns: Mapping[str, Timed | Callable[[], Any]], settings: Settings) -> dict[str, list[float]]:
    """Wall-clock seconds of each function, measured round-robin (A B A B ...).

    Interleaving makes machine noise (other processes on a shared 2-core box) hit
    every implementation alike. Each function is called once untimed first, to warm
    caches; one that took over a second is counted instead (nothing slow is cached)
    and joins only the first ``max(3, slow_budget_s / seconds)`` rounds.
    """
    timed = {k: f if isinstance(f, Timed) else Timed(f) for k, f in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in timed}
    rounds: dict[str, int] = {}
    gc.collect()
    gc.freeze()  # the inputs (100k-shard layouts) need no scanning by later collections
    try:
        for name, t in timed.items():
            first = _call(t)
            if first > 1.0:
                samples[name].append(first)
            slow = max(3, min(settings.reps, int(settings.slow_budget_s / first)))
            rounds[name] = settings.reps if first <= 1.0 else slow
        for _ in range(settings.reps):
            for name, t in timed.items():
                if len(samples[name]) < rounds[name]:
                    samples[name].append(_call(t))
    finally:
        gc.unfreeze()
    return samples


def _call(t: Timed) -> float:
    if t.setup is not None:
        t.setup()
    gc.disable()  # a collection pause would land on whichever call happens to trigger it
    try:
        start = time.perf_counter()
        result = t.fn()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    del result  # freed outside the timed region
    return elapsed


def median(samples: list[float]) -> float:
    """The median of ``samples``."""
    return statistics.median(samples)
