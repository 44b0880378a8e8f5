"""Readable text for values: what ``repr(Layout)`` and ``repr(ShardedArray)`` print.

Both print text that rebuilds the value where it is small: a layout as
``Layout(shape=..., shards=[(offsets, sizes, placement), ...])`` (``Layout``
takes shards as such tuples), an array with its values too when every shard is in
this process, so that a failing example printed by hypothesis can be pasted back.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MAX_SHARDS", "MAX_VALUES", "array_repr", "layout_repr"]

MAX_SHARDS = 64  # a layout with more shards prints a summary
MAX_VALUES = 64  # an array that stores more elements prints no values


def layout_repr(layout: Any) -> str:
    """``Layout(shape=(4,), shards=[((0,), (2,), 0), ((2,), (2,), 1)])``; a summary past ``MAX_SHARDS``."""
    pending = f", partial={layout.partial!r}" if layout.partial else ""
    if len(layout.shards) > MAX_SHARDS:
        ranks = _span(layout.ranks)
        return f"Layout(shape={layout.shape}, {len(layout.shards)} shards on ranks {ranks}{pending})"
    shards = ", ".join(f"({m.offsets}, {m.sizes}, {_placement(m.placement)})" for m in layout.shards)
    return f"Layout(shape={layout.shape}, shards=[{shards}]{pending})"


def array_repr(x: Any) -> str:
    """``ShardedArray(shape, dtype, backend, layout=Layout(...), values=[...])``.

    The values are shown where the backend holds every shard in this process (the
    local backend) and the shards store at most ``MAX_VALUES`` elements: the global
    values, or for a partial layout (whose copies are summands) ``shard_values``, one
    list per shard in layout order. No value is shown from a process that holds only
    some shards: that would need the other processes.
    """
    layout = x.layout
    head = f"ShardedArray(shape={tuple(x.shape)}, dtype={x.dtype}, backend={x.backend.name}"
    values = _values(x)
    return f"{head}, layout={layout_repr(layout)}{values})"


def _values(x: Any) -> str:
    layout, shards = x.layout, x.addressable_shards
    if len(shards) != len(layout.shards) or sum(s.data.numel() for s in shards) > MAX_VALUES:
        return ""
    if any(s.data.device.type == "meta" for s in shards):  # no values to show
        return ""
    if layout.partial is not None:
        return f", shard_values={[s.data.detach().cpu().tolist() for s in shards]}"
    full = torch.zeros(layout.shape, dtype=x.dtype)
    for s in shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        if all(s.meta.sizes):
            full[box] = s.data.detach().cpu()
    return f", values={full.tolist()}"


def _placement(p: Any) -> str:
    return str(p.rank) if p.device == "cpu" else repr(str(p))


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
