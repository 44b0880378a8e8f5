"""Readable text for values: what ``repr(ShardedArray)`` prints."""

from __future__ import annotations

from typing import Any

__all__ = ["array_repr"]


def array_repr(x: Any) -> str:
    """``ShardedArray(shape=..., dtype=..., N shards on ranks [...], backend=...)``."""
    layout = x.layout
    pending = f", partial={layout.partial!r}" if layout.partial else ""
    return (
        f"ShardedArray(shape={tuple(x.shape)}, dtype={x.dtype}, "
        f"{len(layout.shards)} shards on ranks {list(layout.ranks)}{pending}, backend={x.backend.name})"
    )
