"""Conversion between ``Layout`` and torch's ``ShardedTensorMetadata`` (imported lazily)."""

from __future__ import annotations

from typing import Any

import torch

from fshard._errors import LayoutError
from fshard._layout import Layout, ShardMeta
from fshard._placement import Placement

__all__ = ["from_torch_metadata", "to_torch_metadata"]


def to_torch_metadata(layout: Layout, dtype: Any = None, requires_grad: bool = False) -> Any:
    """``layout`` as torch's ``ShardedTensorMetadata`` with the given tensor properties."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    shards = [ShardMetadata(list(s.offsets), list(s.sizes), str(s.placement)) for s in layout.shards]
    props = TensorProperties(dtype=dtype or torch.float32, requires_grad=requires_grad)
    return ShardedTensorMetadata(shards, torch.Size(layout.shape), props)


def from_torch_metadata(metadata: Any) -> Layout:
    """The ``Layout`` that torch's ``ShardedTensorMetadata`` describes."""
    try:
        shards = metadata.shards_metadata
        size = metadata.size
    except AttributeError as exc:
        msg = f"Expected a torch ShardedTensorMetadata, got {type(metadata).__name__}."
        raise LayoutError(msg) from exc
    return Layout(tuple(size), tuple(_meta(s) for s in shards))


def _meta(shard: Any) -> ShardMeta:
    remote = shard.placement
    rank = remote.rank()
    if rank is None:
        msg = (
            f"Placement {remote} names no rank (an RPC worker name or a bare device); "
            "fshard needs 'rank:<int>/<device>'."
        )
        raise LayoutError(msg)
    return ShardMeta(tuple(shard.shard_offsets), tuple(shard.shard_sizes), Placement(rank, str(remote.device())))
