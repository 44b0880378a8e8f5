"""The embedded backend: every rank's shards live in this process, on their placed devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fshard._base.alloc import POOL_LIMIT_BYTES, empty_cache
from fshard._base.boxes import rows_all, rows_prod, unique_rows
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout
from fshard._layout.validate import MAX_EXTENT
from fshard._log import log_move
from fshard._plan.direct import Plan

from ._execution import (
    Counters,
    Index,
    Piece,
    Recipe,
    Sizes,
    accumulate,
    device_of,
    identity,
    new_shard,
    outputs,
    recipe,
    scattering,
    shard_device,
    span_slice,
)

__all__ = ["LOCAL", "POOL_LIMIT_BYTES", "LocalBackend", "empty_cache", "recipe"]

# Arrays of at most this many elements may be resharded through one whole copy, when
# that takes fewer torch calls: the extra copy costs less than the calls it saves.
_SMALL_NUMEL = 1 << 15


@cached(64)
def _copying(plan: Any) -> tuple[Recipe, ...]:
    """The recipes that run a copy phase, in turn.

    One that builds every destination shard from its boxes in the source shards, as the ranks'
    schedules list them, or, for a small array where that takes fewer torch calls, two: the
    whole array from the source shards, then the destination shards cut out of it.
    """
    ins: list[Sizes] = list(map(tuple, plan.src.columns.sz.tolist()))
    direct = (recipe(ins, outputs(plan.dst), _arrivals(plan)[0]),)
    devices = {*plan.src.columns.devices, *plan.dst.columns.devices}
    if plan.dst.numel > _SMALL_NUMEL or len(devices) != 1 or plan.src.partial or plan.dst.partial:
        return direct  # (copies of a pending sum are summands: no one box stands for them all)
    whole = (_assembly(plan.src, device_of(devices.pop())), scattering(plan.dst))
    return min(direct, whole, key=lambda route: sum(r.calls for r in route))


@cached(64)
def _arrivals(plan: Any) -> tuple[list[Piece], int]:
    """Every box that a copy phase writes, rank by rank, and the elements that cross ranks.

    The boxes are each rank's local copies and receives, as its schedule (``plan.for_rank``)
    lists them; the elements that cross ranks are summed over the receivers.
    """
    pieces: list[Piece] = []
    crossing = 0
    for r in plan.dst.ranks:
        s = plan.for_rank(r)
        crossing += s.elements_received
        for m in (s.local, s.recv):
            pieces += [(i, (read, size), j, write) for i, read, j, write, size in _located(plan, m)]
    return pieces, crossing


def _located(plan: Any, m: Any) -> list[tuple[int, Sizes, int, Sizes, Sizes]]:
    """Each move of ``m`` as (source shard, offsets in it, destination shard, offsets in it, sizes)."""
    read = map(tuple, (m.lo - plan.src.columns.lo[m.src_shard]).tolist())
    write = map(tuple, (m.lo - plan.dst.columns.lo[m.dst_shard]).tolist())
    sizes: map[Sizes] = map(tuple, m.size.tolist())
    return list(zip(m.src_shard.tolist(), read, m.dst_shard.tolist(), write, sizes))


Source = tuple[int, Index]
"""A region of one shard: (shard index, slices into its tensor)."""
Target = tuple[int, Index, int]
"""A region of a destination shard: (shard index, slices into its tensor, number of the region)."""


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A reduce phase as the ranks run it, one rank at a time (from ``plan.for_rank``).

    Each destination shard in ``fill`` starts as the op's identity (some of its elements
    receive no contribution). Then, per rank: its own contributions (``local``: source,
    destination), one at a time; then one message per (sending rank, region), peers
    ascending and regions by offsets: the sender's contributions to the region combined
    first, then the result combined into each destination shard of the rank that wants it.
    That is the order in which ``torch_dist`` combines, so both give the same bits. A
    region's first write is a copy, later ones combine with ``op``.
    """

    op: str
    fill: frozenset[int]
    local: tuple[tuple[Source, Target], ...]
    messages: tuple[tuple[tuple[Source, ...], tuple[Target, ...]], ...]
    crossing: int

    def run(self, p: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The destination shards of phase ``p`` from its source shards ``tensors``."""
        out = [new_shard(p.dst, j, like) for j in range(len(p.dst.columns.rank))]
        for j in self.fill:
            out[j].fill_(identity(self.op, like.dtype))
        done: set[int] = set()
        for (i, read), into in self.local:
            self._combine(out, into, tensors[i][read], done)
        for sources, targets in self.messages:
            (i, read), rest = sources[0], sources[1:]
            value = tensors[i][read].clone() if rest else tensors[i][read]
            for k, more in rest:
                accumulate(self.op, value, tensors[k][more])
            for into in targets:
                self._combine(out, into, value, done)
        return tuple(out)

    def _combine(self, out: list[torch.Tensor], into: Target, value: torch.Tensor, done: set[int]) -> None:
        j, write, region = into
        if j in self.fill or region in done:
            accumulate(self.op, out[j][write], value)
        else:
            out[j][write].copy_(value)
            done.add(region)


@cached(64)
def reduction(p: Any) -> Reduction:
    """The ``Reduction`` that runs reduce phase ``p``, built from every rank's schedule."""
    local: list[tuple[Source, Target]] = []
    messages: list[tuple[tuple[Source, ...], tuple[Target, ...]]] = []
    numbers: dict[tuple[int, Sizes, Sizes], int] = {}

    def target(j: int, lo: Sizes, size: Sizes) -> Target:
        return j, _at(lo, size), numbers.setdefault((j, lo, size), len(numbers))

    covered = np.zeros(len(p.dst.columns.rank), np.int64)
    crossing = 0
    for r in p.dst.ranks:
        s = p.for_rank(r)
        crossing += s.elements_received
        # Each (destination shard, region) counted once, whether it comes from this rank or a peer (a region
        # reached both ways, counted twice, left a shard that is not covered unfilled: stale memory read as a value).
        reached = [m for m in (s.local, s.recv) if len(m)]
        if reached:
            shards = np.concatenate([m.dst_shard for m in reached])
            starts = np.concatenate([m.lo for m in reached])
            sizes = np.concatenate([m.numel for m in reached])
            first, _ = unique_rows(np.c_[shards, starts])
            np.add.at(covered, shards[first], sizes[first])
        local += [((i, _at(a, z)), target(j, b, z)) for i, a, j, b, z in _located(p, s.local)]
        regions: dict[tuple[int, Sizes, Sizes], tuple[dict[int, Index], dict[int, Target]]] = {}
        for (i, a, j, b, z), peer, lo in zip(_located(p, s.recv), s.recv.peer.tolist(), s.recv.lo.tolist()):
            sources, targets = regions.setdefault((peer, tuple(lo), z), ({}, {}))
            sources.setdefault(i, _at(a, z))
            if j not in targets:
                targets[j] = target(j, b, z)
        for key in sorted(regions):
            sources, targets = regions[key]
            messages.append((tuple(sources.items()), tuple(targets.values())))
    fill = frozenset(np.flatnonzero(covered < rows_prod(p.dst.columns.sz)).tolist())
    return Reduction(str(p.op), fill, tuple(local), tuple(messages), crossing)


def _at(lo: Sizes, size: Sizes) -> Index:
    return tuple(map(span_slice, lo, size))


@dataclasses.dataclass(frozen=True)
class LocalBackend:
    """All ranks in one process: transfers are slice copies; nothing is sent anywhere.

    ``counters.elements_sent`` counts the elements that a multi-process run would
    send (those crossing ranks), so tests can compare it with the plan's minimum.

    ``world_size=n`` makes it check ranks as a group of ``n`` processes would:
    placements, ``src`` and ``dst`` outside ranks ``0 .. n-1`` raise the error that
    ``torch_dist`` raises. The default, 0, holds every rank: any non-negative int.

    >>> import torch, fshard
    >>> four = LocalBackend(world_size=4)
    >>> x = fshard.shard(torch.arange(4.0), fshard.Chunk(0, [0, 1]), backend=four)
    >>> fshard.gather(x, dst=3).tolist()
    [0.0, 1.0, 2.0, 3.0]
    >>> fshard.gather(x, dst=7)
    Traceback (most recent call last):
    ...
    fshard.SpecError: dst=7: Global rank 7 does not exist in input process group (global ranks [0, 1, 2, 3]).
    """

    name: str = "local"
    world_size: int = 0
    counters: Counters = dataclasses.field(default_factory=Counters, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # A dataclass field: callers may be untyped, so its type is checked at run time.
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise SpecError(f"LocalBackend(world_size={self.world_size!r}): give a non-negative int (0: every rank).")

    @property
    def rank(self) -> int | None:
        """``None``: this process holds every rank."""
        return None

    @property
    def spans_processes(self) -> bool:
        """``False``: every rank's data lives in this process."""
        return False

    def holds(self, rank: int) -> bool:
        """``True``: this process holds every rank's data."""
        return True

    def addressable(self, layout: Any) -> tuple[int, ...]:
        """Every shard."""
        return _every(len(layout.columns.rank))

    def check_layout(self, layout: Any) -> None:
        """Checks that every placed rank is in the group and every placed device exists here."""
        if self.world_size:
            for r in layout.ranks:
                if r >= self.world_size:
                    msg = (
                        f"Global rank {r} does not exist in input process group (global ranks "
                        f"{list(range(self.world_size))}): placements name global ranks; place shards on "
                        f"ranks 0 to {self.world_size - 1} or use a larger world_size."
                    )
                    raise SpecError(msg)
        _check_devices(layout)

    def check_rank(self, rank: Any, what: str) -> int:
        """``rank`` as an int; raises ``SpecError`` unless it names a rank of the group (as ``torch_dist`` does).

        >>> LOCAL.check_rank(2.0, "dst")
        2
        >>> LOCAL.check_rank(-1, "dst")
        Traceback (most recent call last):
        ...
        fshard.SpecError: dst=-1: Global rank -1 does not exist in input process group (the local backend ...
        """
        if _is_rank(rank) and (not self.world_size or rank < self.world_size):
            return int(rank)
        ranks = (
            f"global ranks {list(range(self.world_size))}"
            if self.world_size
            else "the local backend holds every rank: any non-negative int"
        )
        raise SpecError(f"{what}={rank!r}: Global rank {rank!r} does not exist in input process group ({ranks}).")

    def execute(self, plan: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Runs ``plan`` phase by phase, each from every rank's schedule (``plan.for_rank``).

        A phase builds each destination shard from its boxes in the source shards (one
        ``torch.cat`` where they tile it along one dim), or combines the contributions of a
        reduce phase.
        """
        log_move("local", plan, like.element_size())
        for p in plan.phases:
            if p.op is None:
                for r in _copying(p):
                    tensors = r.run(tensors, like.dtype)
                self._count(_arrivals(p)[1], like)
            else:
                run = reduction(p)
                tensors = run.run(p, tensors, like)
                self._count(run.crossing, like)
        return tuple(tensors)

    def scatter(
        self, full: torch.Tensor | None, layout: Any, src: int | None, plan: Plan | None
    ) -> tuple[torch.Tensor, ...]:
        """Copies each shard's box out of ``full``; from rank ``src`` (``plan``), counts what other ranks receive."""
        assert full is not None
        if src is not None:
            src = self.check_rank(src, "src")
        out = scattering(layout).run((full,), full.dtype)
        if plan is not None:
            self._count(plan.min_elements_sent, full)  # the planner sends exactly its lower bound
        return out

    def receivers(self, layout: Layout, dst: int | None) -> tuple[int, ...]:
        """The ranks a gather delivers to: ``dst``, or every rank of ``layout``."""
        return layout.ranks if dst is None else (self.check_rank(dst, "dst"),)

    def assemble(
        self, layout: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None, plan: Plan
    ) -> torch.Tensor:
        """Writes one copy of every box into a new global tensor (on rank ``dst``'s device).

        Counts what the receiving ranks of ``plan`` lack: rank ``dst``, or every rank of the layout.
        """
        idx = layout.indices_on(dst) if dst is not None else ()
        device = shard_device(layout, idx[0]) if idx else like.device
        (out,) = _assembly(layout, device).run(tensors, like.dtype)
        self._count(plan.min_elements_sent, like)
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """A single process: its own object."""
        return [obj]

    def _count(self, elements: int, like: torch.Tensor) -> None:
        """``elements`` of ``like``'s dtype crossed between ranks."""
        self.counters.elements_sent += elements
        self.counters.bytes_sent += elements * like.element_size()


def _is_rank(rank: Any) -> bool:
    """Whether ``rank`` equals a non-negative int that a layout can hold (int64, as ``torch_dist`` checks); no bool."""
    if isinstance(rank, (bool, np.bool_)):
        return False
    try:
        return bool(rank == int(rank)) and 0 <= int(rank) < MAX_EXTENT
    except (TypeError, ValueError, OverflowError):
        return False


@cached(64)
def _every(n: int) -> tuple[int, ...]:
    return tuple(range(n))


@cached(256)
def _check_devices(layout: Any) -> None:
    for p in set(layout.columns.devices):
        device_of(p)


@cached(64)
def _assembly(layout: Any, device: torch.device) -> Recipe:
    """The global tensor of ``layout`` on ``device``, from one copy of every non-empty box."""
    lo, sz = layout.columns.lo, layout.columns.sz
    nonempty = rows_all(sz > 0)
    first, _ = unique_rows(np.c_[lo, sz][nonempty])
    rows = np.flatnonzero(nonempty)[first].tolist()
    ins: list[Sizes] = list(map(tuple, sz.tolist()))
    offsets = lo.tolist()
    pieces: list[Piece] = [(i, ((0,) * layout.ndim, ins[i]), 0, tuple(offsets[i])) for i in rows]
    return recipe(ins, [(tuple(layout.shape), device)], pieces)


LOCAL = LocalBackend()
