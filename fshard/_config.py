"""Process-wide settings."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from fshard._errors import SpecError

__all__ = ["Config", "config", "current", "parse_bool_env"]

# Spellings the environment variables accept, case-insensitively (an empty value is unset).
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool_env(name: str, value: str | None, default: bool = False) -> bool:
    """Reads a boolean environment variable strictly.

    Args:
        name: the variable's name, for the message.
        value: its value (``None`` or blank: unset, giving ``default``).
        default: the value when unset.

    Raises:
        ValueError: ``value`` is none of 1/0/true/false/yes/no/on/off (any case).

    >>> parse_bool_env("FSHARD_CHECK", "Off"), parse_bool_env("FSHARD_CHECK", None)
    (False, False)
    """
    if value is None or not value.strip():
        return default
    word = value.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    msg = f"{name}={value!r} is not a boolean: use one of {'/'.join(_TRUE + _FALSE)} (any case), or unset it."
    raise ValueError(msg)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """fshard's settings.

    Attributes:
        check_collectives: before each collective, ranks compare a hash of
            (operation, plan) and raise ``CollectiveMismatchError`` on a mismatch
            instead of hanging (one extra small all-gather per collective).
            Defaults to the ``FSHARD_CHECK`` environment variable (1/0, true/false,
            yes/no or on/off in any case; unset or empty is off; anything else
            makes ``import fshard`` raise ``ValueError``).
        check_timeout: seconds that check mode lets ranks take to arrive at a
            collective before it reports the ranks still missing; from 0.001 (torch
            waits in whole milliseconds) to 1e12 (default 60).
        timeout: seconds that a rank waits for the others in each movement's
            collectives (``torch_dist``) before it raises ``CollectiveMismatchError``
            naming the operation and, where it knows them, the ranks that did not
            arrive; from 0.001 to 1e12, or ``None`` (the default): the
            process group's own timeout (30 minutes unless set). The collective
            stays in flight after such an error, so the group cannot be used again.
        bucket_cap_mb: the size, in MiB, of the buckets in which ``shard_map`` sums the
            gradients of replicated arguments across processes while the backward runs
            (DDP's ``bucket_cap_mb``; the first bucket is at most 1 MiB); a positive, finite
            number (default 25). A larger bucket sends fewer messages and overlaps less.

    Raises:
        TypeError: a setting of the wrong type (``check_collectives`` takes only a
            real ``bool``: the string ``"false"`` is refused, not read as true).
        SpecError: ``check_timeout`` or ``timeout`` outside 0.001 to 1e12 seconds, or a
            ``bucket_cap_mb`` that is not positive and finite (a ``ValueError``).
    """

    check_collectives: bool = False
    check_timeout: float = 60.0
    timeout: float | None = None
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        if type(self.check_collectives) is not bool:
            value = self.check_collectives
            msg = (
                f"fshard setting check_collectives={value!r} is a {type(value).__name__}: give True or False "
                "(strings are not read as booleans)."
            )
            raise TypeError(msg)
        _check_seconds("check_timeout", self.check_timeout)
        object.__setattr__(self, "check_timeout", float(self.check_timeout))
        if self.timeout is not None:
            _check_seconds("timeout", self.timeout)
            object.__setattr__(self, "timeout", float(self.timeout))
        _check_positive("bucket_cap_mb", self.bucket_cap_mb, "MiB, such as 25.0")
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))


# Waits are given to torch in whole milliseconds, as a timedelta: less than one reads as no timeout at all, and
# more than about 8.6e13 s is no timedelta. A bound well inside both.
_SECONDS = (0.001, 1e12)


def _check_seconds(name: str, value: Any) -> None:
    _check_positive(name, value, "seconds, such as 60.0")
    low, high = _SECONDS
    if not low <= value <= high:
        msg = (
            f"fshard setting {name}={value!r}: give from {low} s (torch waits in whole milliseconds; less reads "
            f"as no timeout) to {high:.0e} s."
        )
        raise SpecError(msg)


def _check_positive(name: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"fshard setting {name}={value!r} is a {type(value).__name__}: give a number of {unit}."
        raise TypeError(msg)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past any float
        finite = False
    if not (finite and value > 0):
        raise SpecError(f"fshard setting {name}={value!r:.40}: give a positive, finite number of {unit}.")


_current = Config(check_collectives=parse_bool_env("FSHARD_CHECK", os.environ.get("FSHARD_CHECK")))


def current() -> Config:
    """The settings in force."""
    return _current


def config(**changes: Any) -> Config:
    """Changes settings for this process and returns the previous ones.

    Raises:
        TypeError: an unknown setting, or a value of the wrong type.
        SpecError: a value out of range (a ``check_timeout`` or ``timeout`` outside 0.001 to 1e12 seconds, a
            ``bucket_cap_mb`` that is not positive and finite); a ``ValueError``.

    >>> import fshard
    >>> old = fshard.config(check_collectives=True, check_timeout=5.0)
    >>> now = fshard.config(**dataclasses.asdict(old))
    >>> now.check_collectives, now.check_timeout
    (True, 5.0)
    """
    global _current
    unknown = set(changes) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        msg = f"Unknown fshard settings {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(Config)]}."
        raise TypeError(msg)
    old, _current = _current, dataclasses.replace(_current, **changes)
    return old
