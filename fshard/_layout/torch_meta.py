"""Reading and writing torch's sharding metadata (``ShardMetadata``, ``ShardedTensorMetadata``).

torch's metadata is read into plain boxes ``(offsets, sizes, Placement)``, which
``Layout`` and ``ShardMeta`` take as they are; specs (``ChunkShardingSpec``,
``EnumerableShardingSpec``) are converted in ``fshard._layout.specs``.
torch.distributed is looked up in ``sys.modules`` to recognise its objects: one can
only exist once its module is loaded, so fshard never imports it here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

from fshard._errors import LayoutError
from fshard._layout.placement import Placement
from fshard._layout.validate import ShardLike

__all__ = [
    "Box",
    "box_from_torch",
    "is_dtensor",
    "is_shard_metadata",
    "is_sharded_tensor",
    "is_torch_spec",
    "read_torch_metadata",
    "to_torch_metadata",
]

# A box as ``Layout`` and ``ShardMeta`` take it: offsets, sizes and placement.
Box = tuple[tuple[int, ...], tuple[int, ...], Placement]


def _torch_class(module: str, name: str) -> type | None:
    return getattr(sys.modules.get(module), name, None)


def is_shard_metadata(value: Any) -> bool:
    """True for torch's ``ShardMetadata`` (without importing torch.distributed)."""
    cls = _torch_class("torch.distributed._shard.metadata", "ShardMetadata")
    return cls is not None and isinstance(value, cls)


def is_sharded_tensor(value: Any) -> bool:
    """True for torch's ``ShardedTensor`` (without importing torch.distributed)."""
    cls = _torch_class("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
    return cls is not None and isinstance(value, cls)


def is_dtensor(value: Any) -> bool:
    """True for torch's ``DTensor`` (without importing torch.distributed)."""
    cls = _torch_class("torch.distributed.tensor._api", "DTensor")
    return cls is not None and isinstance(value, cls)


def is_torch_spec(value: Any) -> bool:
    """True for a torch ``ShardingSpec`` (``ChunkShardingSpec``, ``EnumerableShardingSpec``, ...)."""
    cls = _torch_class("torch.distributed._shard.sharding_spec.api", "ShardingSpec")
    return cls is not None and isinstance(value, cls)


def to_torch_metadata(
    shape: tuple[int, ...], shards: Sequence[ShardLike], dtype: Any = None, requires_grad: bool = False
) -> Any:
    """A layout's ``shape`` and ``shards`` as torch's ``ShardedTensorMetadata`` with the given tensor properties."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    metadata = [ShardMetadata(list(s.offsets), list(s.sizes), str(s.placement)) for s in shards]
    props = TensorProperties(dtype=dtype or torch.float32, requires_grad=requires_grad)
    return ShardedTensorMetadata(metadata, torch.Size(shape), props)


def read_torch_metadata(metadata: Any) -> tuple[tuple[int, ...], tuple[Box, ...]]:
    """The shape and boxes that torch's ``ShardedTensorMetadata`` describes.

    A list of ``ShardMetadata`` is read as an ``EnumerableShardingSpec``'s shards:
    the shape is the extent of their boxes (the end of the farthest box in each dim),
    empty boxes aside.
    """
    listed = cast("Sequence[Any]", metadata)  # used only once it is known to be a sequence
    if isinstance(metadata, Sequence) and not isinstance(metadata, str) and all(map(is_shard_metadata, listed)):
        boxes = tuple(map(box_from_torch, listed))
        if not boxes:
            raise LayoutError("Layout.from_torch_metadata() got an empty list of ShardMetadata: give at least one.")
        # An empty box may lie past the end (ChunkShardingSpec puts 5 rows over 4 ranks' last at row 6).
        full = [b for b in boxes if 0 not in b[1]]
        if not full:
            msg = (
                "Layout.from_torch_metadata() got a list of ShardMetadata whose boxes are all empty, which does not "
                "tell the shape: give a ShardedTensorMetadata (its size is the shape)."
            )
            raise LayoutError(msg)
        ends = [[o + n for o, n in zip(offsets, sizes)] for offsets, sizes, _ in full]
        return tuple(map(max, zip(*ends))), boxes
    value = cast(Any, metadata)  # anything that is not a list of ShardMetadata
    try:
        shards = value.shards_metadata
        size = value.size
    except AttributeError as exc:
        msg = f"Expected a torch ShardedTensorMetadata, got {type(value).__name__}."
        raise LayoutError(msg) from exc
    return tuple(size), tuple(map(box_from_torch, shards))


def box_from_torch(shard: Any) -> Box:
    """Torch's ``ShardMetadata`` as a box (its placement must name a rank).

    >>> from torch.distributed._shard.metadata import ShardMetadata
    >>> box_from_torch(ShardMetadata([0, 4], [2, 4], "rank:1/cpu"))
    ((0, 4), (2, 4), Placement(rank=1, device='cpu'))

    Raises:
        LayoutError: the placement is missing or names an RPC worker instead of a rank.
    """
    remote = shard.placement
    box = f"ShardMetadata(shard_offsets={list(shard.shard_offsets)}, shard_sizes={list(shard.shard_sizes)})"
    if remote is None:
        msg = f"{box} has no placement: fshard needs one, such as placement='rank:0/cpu'."
        raise LayoutError(msg)
    rank = remote.rank()
    if rank is None:
        msg = (
            f"Placement {remote} names no rank (an RPC worker name or a bare device); "
            "fshard needs 'rank:<int>/<device>'."
        )
        raise LayoutError(msg)
    return tuple(shard.shard_offsets), tuple(shard.shard_sizes), Placement(rank, str(remote.device()))
