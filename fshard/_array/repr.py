"""What ``repr(ShardedArray)`` prints: its layout and, where small and all in this process, its values.

The layout is printed by ``fshard._layout.show.layout_repr``; the values are there so that a
failing example printed by hypothesis can be pasted back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fshard._layout.show import layout_repr

if TYPE_CHECKING:
    from fshard._array.array import ShardedArray

__all__ = ["MAX_VALUES", "array_repr"]

MAX_VALUES = 64  # an array that stores more elements prints no values


def array_repr(x: ShardedArray) -> str:
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


def _values(x: ShardedArray) -> str:
    layout, shards = x.layout, x.addressable_shards
    if len(shards) != len(layout.shards) or sum(s.data.numel() for s in shards) > MAX_VALUES:
        return ""
    if any(s.data.device.type == "meta" for s in shards):  # no values to show
        return ""
    if layout.partial is not None:
        # torch's stub types tolist() as a bare list, here and below.
        return f", shard_values={[s.data.detach().cpu().tolist() for s in shards]}"  # pyright: ignore[reportUnknownMemberType]
    full = torch.zeros(layout.shape, dtype=x.dtype)
    for s in shards:
        box = tuple(slice(o, o + n) for o, n in zip(s.meta.offsets, s.meta.sizes))
        if all(s.meta.sizes):
            full[box] = s.data.detach().cpu()
    return f", values={full.tolist()}"  # pyright: ignore[reportUnknownMemberType]
