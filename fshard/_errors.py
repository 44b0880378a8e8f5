"""The error types of fshard: one root, each also a builtin so plain handlers work."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "FShardError",
    "LayoutError",
    "SpecError",
]


class FShardError(Exception):
    """Root of every error fshard raises on purpose."""


class LayoutError(FShardError, ValueError):
    """A set of shard boxes is not a valid layout of the global shape."""


class SpecError(FShardError, ValueError):
    """A sharding spec or placement is malformed or does not fit the array."""


class CollectiveMismatchError(FShardError, RuntimeError):
    """Ranks called the same collective with different arguments (check mode)."""


class CheckpointError(FShardError, RuntimeError):
    """A checkpoint is missing, truncated, tampered with or does not match the request."""
