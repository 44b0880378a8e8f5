"""The error types of fshard: one root, each also a builtin so plain handlers work.

Each class names itself by its public path (``fshard.SpecError``) in tracebacks and
pickles: ``__module__`` is ``"fshard"``, which re-exports them.
"""

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

    __module__ = "fshard"


class LayoutError(FShardError, ValueError):
    """A set of shard boxes is not a valid layout of the global shape."""

    __module__ = "fshard"


class SpecError(FShardError, ValueError):
    """A sharding spec, a placement or another argument's value is malformed or does not fit the array."""

    __module__ = "fshard"


class CollectiveMismatchError(FShardError, RuntimeError):
    """Ranks called the same collective with different arguments (check mode)."""

    __module__ = "fshard"


class CheckpointError(FShardError, RuntimeError):
    """A checkpoint is missing, truncated, tampered with or does not match the request."""

    __module__ = "fshard"
