"""Process-wide settings."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["Config", "config", "current"]


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """fshard's settings.

    Attributes:
        check_collectives: before each collective, ranks compare a hash of
            (operation, plan) and raise ``CollectiveMismatchError`` on a mismatch
            instead of hanging (one extra small all-gather per collective).
            Defaults to the ``FSHARD_CHECK`` environment variable.
    """

    check_collectives: bool = False


_current = Config(check_collectives=os.environ.get("FSHARD_CHECK", "0") not in ("", "0", "false", "False"))


def current() -> Config:
    """The settings in force."""
    return _current


def config(**changes: bool) -> Config:
    """Changes settings for this process and returns the previous ones.

    >>> import fshard
    >>> old = fshard.config(check_collectives=True)
    >>> fshard.config(**dataclasses.asdict(old)).check_collectives
    True
    """
    global _current
    unknown = set(changes) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        msg = f"Unknown fshard settings {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(Config)]}."
        raise TypeError(msg)
    old, _current = _current, dataclasses.replace(_current, **changes)
    return old
