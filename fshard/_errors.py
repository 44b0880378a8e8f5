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
    "ReplicaMismatchError",
    "SpecError",
    "as_error",
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


class ReplicaMismatchError(FShardError, RuntimeError):
    """Copies of a replicated box hold different data (``check_replicas``; ``save`` and ``gather`` in check mode)."""

    __module__ = "fshard"


class CheckpointError(FShardError, RuntimeError):
    """A checkpoint is missing, truncated, tampered with or does not match the request."""

    __module__ = "fshard"


def as_error(exc: BaseException, rank: int, where: str) -> Exception:
    """Rank ``rank``'s error, raised in ``where``, to raise here: an interrupt there is an error here.

    A ``KeyboardInterrupt`` or ``SystemExit`` stops the rank it happened on; the others
    must not stop as if interrupted themselves, but learn which rank stopped and why.
    """
    if isinstance(exc, Exception):
        return exc
    what = f"{type(exc).__name__}{f' ({exc})' if str(exc) else ''}"
    msg = (
        f"Rank {rank}'s {where} raised {what}, which stops that rank; the group cannot go on without it. "
        "Stop the job (or catch the interrupt on every rank)."
    )
    return CollectiveMismatchError(msg)
