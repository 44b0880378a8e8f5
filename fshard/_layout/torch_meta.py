"""Conversion between fshard's values and torch's sharding metadata and specs (imported lazily).

torch's ``ShardMetadata``, ``ShardedTensorMetadata``, ``ChunkShardingSpec`` and
``EnumerableShardingSpec`` become ``ShardMeta``, ``Layout``, ``Chunk`` and
``Explicit``. torch.distributed is looked up in ``sys.modules`` to recognise its
objects: one can only exist once its module is loaded, so fshard never imports it here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from fshard._errors import LayoutError, SpecError
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement

__all__ = [
    "from_torch_metadata",
    "from_torch_spec",
    "is_shard_metadata",
    "is_sharded_tensor",
    "is_torch_spec",
    "layout_of_torch_spec",
    "shard_meta_from_torch",
    "to_torch_metadata",
]


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


def is_torch_spec(value: Any) -> bool:
    """True for a torch ``ShardingSpec`` (``ChunkShardingSpec``, ``EnumerableShardingSpec``, ...)."""
    cls = _torch_class("torch.distributed._shard.sharding_spec.api", "ShardingSpec")
    return cls is not None and isinstance(value, cls)


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
    """The ``Layout`` that torch's ``ShardedTensorMetadata`` describes.

    A list of ``ShardMetadata`` is read as an ``EnumerableShardingSpec``'s shards:
    the shape is the extent of their boxes (the end of the farthest box in each dim).
    """
    if isinstance(metadata, Sequence) and not isinstance(metadata, str) and all(map(is_shard_metadata, metadata)):
        metas = tuple(map(shard_meta_from_torch, metadata))
        if not metas:
            raise LayoutError("Layout.from_torch_metadata() got an empty list of ShardMetadata: give at least one.")
        ends = [[o + n for o, n in zip(m.offsets, m.sizes)] for m in metas]
        return Layout(tuple(map(max, zip(*ends))), metas)
    value: Any = metadata  # anything that is not a list of ShardMetadata
    try:
        shards = value.shards_metadata
        size = value.size
    except AttributeError as exc:
        msg = f"Expected a torch ShardedTensorMetadata, got {type(metadata).__name__}."
        raise LayoutError(msg) from exc
    return Layout(tuple(size), tuple(map(shard_meta_from_torch, shards)))


def shard_meta_from_torch(shard: Any) -> ShardMeta:
    """torch's ``ShardMetadata`` as a ``ShardMeta`` (its placement must name a rank).

    >>> from torch.distributed._shard.metadata import ShardMetadata
    >>> shard_meta_from_torch(ShardMetadata([0, 4], [2, 4], "rank:1/cpu"))
    ShardMeta(offsets=(0, 4), sizes=(2, 4), placement=Placement(rank=1, device='cpu'))

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
    return ShardMeta(tuple(shard.shard_offsets), tuple(shard.shard_sizes), Placement(rank, str(remote.device())))


def from_torch_spec(spec: Any) -> Any:
    """The fshard spec for a torch ``ShardingSpec``: ``Chunk`` or ``Explicit``.

    Another ``ShardingSpec`` subclass (a user's own) is returned as is: ``as_layout``
    resolves it with its ``build_metadata``.
    """
    from fshard._layout.specs import Chunk, Explicit

    kind = type(spec).__name__
    if kind == "ChunkShardingSpec":
        return Chunk(spec.dim, spec.placements)
    if kind == "EnumerableShardingSpec":
        return Explicit(spec.shards)
    return spec


def layout_of_torch_spec(spec: Any, shape: tuple[int, ...]) -> Layout:
    """The layout that any torch ``ShardingSpec`` gives ``shape``, through its ``build_metadata``."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    try:
        metadata = spec.build_metadata(torch.Size(shape), TensorProperties())
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        msg = f"torch's {type(spec).__name__} cannot lay out shape {shape}: {exc}"
        raise SpecError(msg) from exc
    return from_torch_metadata(metadata)
