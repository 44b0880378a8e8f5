"""What both backends run: recipes of box copies, devices of shards, counters, reduction identities.

A ``Recipe`` is a cached list of copies between boxes of input and output tensors;
the local backend runs whole plans as recipes, torch_dist runs the copies a rank
does by itself (its own boxes) and slices shards out of a global tensor with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from fshard._base.alloc import POOL_MIN_BYTES, no_summand, sum_zero
from fshard._base.alloc import new as new_tensor
from fshard._base.cache import cached
from fshard._errors import SpecError

__all__ = [
    "Box",
    "Counters",
    "Fill",
    "Index",
    "Piece",
    "Recipe",
    "Sizes",
    "accumulate",
    "box_slices",
    "device_of",
    "identity",
    "new_shard",
    "outputs",
    "recipe",
    "scattering",
    "shard_device",
    "slice_shards",
    "span_slice",
]


@dataclasses.dataclass
class Counters:
    """What a backend has moved: elements that crossed ranks, their bytes, and collectives run.

    ``bytes_sent`` counts each element at the size of the dtype it crossed in (a movement
    with a ``Precision`` sends the narrow dtype's bytes).
    """

    elements_sent: int = 0
    collectives: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        """Sets every counter back to zero."""
        self.elements_sent = 0
        self.collectives = 0
        self.bytes_sent = 0


def box_slices(lo: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    """Index of the global box ``[lo, lo + size)`` inside a shard whose box starts at ``origin``."""
    return tuple(slice(a - o, a - o + s) for a, s, o in zip(lo, size, origin))


@cached(64)
def device_of(name: str) -> torch.device:
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
    return device_of(layout.columns.devices[i])


def new_shard(layout: Any, i: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor for shard ``i``, with ``like``'s dtype."""
    return new_tensor(tuple(layout.columns.sz[i].tolist()), like.dtype, shard_device(layout, i))


Index = tuple[slice, ...]
Sizes = tuple[int, ...]
Box = tuple[Sizes, Sizes]


@dataclasses.dataclass(frozen=True)
class Fill:
    """How one new tensor is built from views.

    ``views`` (positions in a list of views) go to ``writes``; when they tile the result
    along dim ``dim``, in order, one ``torch.cat`` (or, for one view, one ``clone``) builds it.
    ``covered``: the writes reach every element. A summand of a pending sum may hold a box that
    no piece reaches (its value is in another summand there): those elements add nothing (-0.0, ``no_summand``).
    """

    sizes: tuple[int, ...]
    device: torch.device
    views: tuple[int, ...]
    writes: tuple[Index, ...]
    dim: int | None
    numel: int
    covered: bool = True

    def build(self, views: Sequence[torch.Tensor], dtype: torch.dtype, direct: bool) -> torch.Tensor:
        """A new contiguous tensor of ``dtype`` on ``device`` (``direct``: the views are of both)."""
        mine = [views[k] for k in self.views]
        if direct and self.dim is not None:
            if self.device.type == "cpu" and self.numel * dtype.itemsize >= POOL_MIN_BYTES:
                return torch.cat(mine, self.dim, out=new_tensor(self.sizes, dtype, self.device))  # recycled memory
            out = mine[0].clone(memory_format=torch.contiguous_format) if len(mine) == 1 else torch.cat(mine, self.dim)
            return out if out.is_contiguous() else out.contiguous()
        out = new_tensor(self.sizes, dtype, self.device)
        if not self.covered:  # new_tensor's memory may be recycled: what no write reaches adds nothing
            no_summand(out)
        for v, w in zip(mine, self.writes):
            out[w].copy_(v)
        return out


@dataclasses.dataclass(frozen=True)
class Recipe:
    """New tensors built from boxes of input tensors, worked out once.

    Running it then only takes views and copies them.

    The views are taken first: each input in ``cuts`` is split along a dim into the
    given sizes (one ``split_with_sizes`` for all its boxes), then each of ``reads``
    is indexed (``None``: the whole input). ``device`` is the one device of every
    output, if they share one: inputs there (and of the output dtype) are copied with
    ``torch.cat``/``clone``, others box by box with ``copy_``.

    >>> halves = [(0, ((0, 0), (2, 2)), 0, (0, 0)), (0, ((2, 0), (2, 2)), 1, (0, 0))]
    >>> r = recipe([(4, 2)], [((2, 2), "cpu"), ((2, 2), "cpu")], halves)
    >>> r.cuts, r.reads, [f.dim for f in r.fills]
    (((0, 0, (2, 2)),), (), [0, 0])
    >>> [t.tolist() for t in r.run([torch.arange(8).reshape(4, 2)], torch.int64)]
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    """

    cuts: tuple[tuple[int, int, tuple[int, ...]], ...]
    reads: tuple[tuple[int, Index | None], ...]
    fills: tuple[Fill, ...]
    device: torch.device | None

    @property
    def calls(self) -> int:
        """The torch calls that one run makes (where the views are on the outputs' device).

        A ``torch.cat`` counts as many as the views it joins: one call, but each view is an
        entry of its list and an input it reads (a cat per shard of n views each, as a copy to
        n replicas from n pieces builds, is n * n of them).
        """
        views = len(self.cuts) + sum(r is not None for _, r in self.reads)
        return views + sum(len(f.views) if f.dim is not None else 1 + 2 * len(f.views) for f in self.fills)

    def run(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The outputs, from ``tensors`` (the inputs, in order), of ``dtype``."""
        views: list[torch.Tensor] = []
        for i, dim, sizes in self.cuts:
            views += tensors[i].split_with_sizes(sizes, dim)
        for i, r in self.reads:
            views.append(tensors[i] if r is None else tensors[i][r])
        device = self.device
        direct = device is not None and all(t.device == device and t.dtype == dtype for t in tensors)
        return tuple(f.build(views, dtype, direct) for f in self.fills)


Piece = tuple[int, Box, int, tuple[int, ...]]
"""One box copied: (input, its box in the input, output, offsets of the box in the output)."""


def recipe(ins: Sequence[Sizes], outs: Sequence[tuple[Sizes, str | torch.device]], pieces: Iterable[Piece]) -> Recipe:
    """The ``Recipe`` that builds outputs of ``outs`` (sizes, device) from inputs of sizes ``ins``.

    It copies ``pieces``.
    """
    pieces = list(pieces)
    boxes: dict[int, list[Box]] = {}
    for i, box, _, _ in pieces:
        boxes.setdefault(i, []).append(box)
    cuts: list[tuple[int, int, Sizes]] = []
    reads: list[tuple[int, Index | None]] = []
    order: list[tuple[bool, list[tuple[int, Box]]]] = []
    for i, found in sorted(boxes.items()):
        distinct = sorted(set(found))
        dim = _tiling_dim(ins[i], distinct) if len(distinct) > 1 else None
        if dim is None:
            reads += [(i, _index(lo, size, ins[i])) for lo, size in distinct]
        else:
            cuts.append((i, dim, tuple(size[dim] for _, size in distinct)))
        order.append((dim is None, [(i, box) for box in distinct]))
    # Views come cut inputs first, then read ones: number them in that order.
    keys = [key for _, group in sorted(order, key=lambda g: g[0]) for key in group]
    position = {key: k for k, key in enumerate(keys)}
    into: list[list[tuple[Sizes, Sizes, int]]] = [[] for _ in outs]
    for i, box, j, at in pieces:
        into[j].append((tuple(at), box[1], position[(i, box)]))
    fills = tuple(_fill(tuple(sizes), device_of(str(device)), sorted(got)) for (sizes, device), got in zip(outs, into))
    devices = {f.device for f in fills}
    return Recipe(tuple(cuts), tuple(reads), fills, devices.pop() if len(devices) == 1 else None)


def _fill(sizes: Sizes, device: torch.device, got: Sequence[tuple[Sizes, Sizes, int]]) -> Fill:
    """The ``Fill`` of an output from views ``got``: (offsets in it, sizes, view position), sorted."""
    writes = tuple(tuple(map(span_slice, at, size)) for at, size, _ in got)
    dim = _tiling_dim(sizes, [(at, size) for at, size, _ in got])
    numel = math.prod(sizes)
    covered = dim is not None or _covers(sizes, [(at, size) for at, size, _ in got])
    return Fill(sizes, device, tuple(k for _, _, k in got), writes, dim, numel, covered)


def _covers(sizes: Sizes, boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` together reach every element of a tensor of ``sizes`` (counted on a grid of their edges)."""
    total = math.prod(sizes)
    if sum(math.prod(z) for _, z in boxes) < total:
        return False  # too few elements, even were no two boxes to overlap
    edges = [
        sorted({0, n, *(lo[d] for lo, _ in boxes), *(lo[d] + z[d] for lo, z in boxes)}) for d, n in enumerate(sizes)
    ]
    reached = np.zeros([len(e) - 1 for e in edges], dtype=bool)
    for lo, z in boxes:
        reached[tuple(slice(e.index(lo[d]), e.index(lo[d] + z[d])) for d, e in enumerate(edges))] = True
    return bool(reached.all())


def _tiling_dim(sizes: tuple[int, ...], boxes: Sequence[Box]) -> int | None:
    """The dim along which ``boxes``, in order, tile a tensor of ``sizes`` exactly (each spanning every other dim)."""
    if not boxes or not sizes:
        return None
    for d in range(len(sizes)):
        whole = all(lo[e] == 0 and z[e] == sizes[e] for lo, z in boxes for e in range(len(sizes)) if e != d)
        ends = [0, *(lo[d] + z[d] for lo, z in boxes)]
        if whole and all(lo[d] == end for (lo, _), end in zip(boxes, ends)) and ends[-1] == sizes[d]:
            return d
    return None


def _index(lo: Sequence[int], size: Sequence[int], sizes: Sequence[int]) -> Index | None:
    """Index of box ``[lo, lo + size)`` in a tensor of ``sizes`` (``None``: the whole tensor)."""
    if not any(lo) and tuple(size) == tuple(sizes):
        return None
    return tuple(map(span_slice, lo, size))


def slice_shards(full: torch.Tensor, layout: Any, index: Iterable[int]) -> tuple[torch.Tensor, ...]:
    """New tensors holding the boxes of shards ``index`` of ``layout``, copied out of ``full``."""
    out: list[torch.Tensor] = []
    for i in index:
        (t,) = _slicing(layout, i).run((full,), full.dtype)
        out.append(t)
    return tuple(out)


@cached(1024)
def _slicing(layout: Any, i: int) -> Recipe:
    """Shard ``i`` of ``layout`` read out of the global tensor."""
    return recipe(
        [layout.shape], [(tuple(layout.columns.sz[i].tolist()), layout.columns.devices[i])], _scattered(layout, [i])
    )


@cached(64)
def scattering(layout: Any) -> Recipe:
    """Every shard of ``layout`` read out of the global tensor."""
    return recipe([layout.shape], outputs(layout), _scattered(layout, range(len(layout.columns.rank))))


def _scattered(layout: Any, index: Iterable[int]) -> list[Piece]:
    # An empty shard may sit past the end, where a slice would clip: it reads nothing.
    lo, sz = layout.columns.lo.tolist(), layout.columns.sz.tolist()
    zero = (0,) * layout.ndim
    return [(0, (tuple(lo[i]), tuple(sz[i])), j, zero) for j, i in enumerate(index) if all(sz[i])]


def outputs(layout: Any) -> list[tuple[Sizes, str]]:
    """(sizes, device) of every shard of ``layout``, from its columns."""
    sizes: list[Sizes] = list(map(tuple, layout.columns.sz.tolist()))
    return list(zip(sizes, layout.columns.devices))


def span_slice(start: int, size: int) -> slice:
    return slice(start, start + size)


def identity(op: str, dtype: torch.dtype) -> complex | float | int | bool:
    """The value that ``op`` leaves unchanged: what a destination region no contribution reaches holds.

    Of a sum, ``sum_zero``: -0.0 of floating and complex values, which keeps a -0.0 summed
    into it.
    """
    if op == "sum":
        return sum_zero(dtype)
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    if dtype.is_complex:
        msg = f"A pending {op} cannot reduce complex values ({dtype}): only 'sum' can; reshard to a real dtype first."
        raise SpecError(msg)
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def accumulate(op: str, into: torch.Tensor, value: torch.Tensor) -> None:
    """``into = op(into, value)``, in place; ``value`` is brought to ``into``'s device first.

    The two differ where a message on the CPU (Gloo's wire) is combined into a CUDA block,
    or blocks of one reduction live on several devices.
    """
    if value.device != into.device:
        value = value.to(into.device)
    if op == "sum":
        into.add_(value)
    elif op == "max":
        torch.maximum(into, value, out=into)
    else:
        torch.minimum(into, value, out=into)
