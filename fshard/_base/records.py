"""The record types that ranks exchange as data, by name.

A module whose values cross ranks in metadata exchanges (a ``NamedTuple`` or a frozen
dataclass of plain fields) registers its type here when it is defined; the
``torch_dist`` codec encodes a registered record as its name and fields and rebuilds
it on the other side from this table, so decoding untrusted input never looks a type
up anywhere else. Every rank that exchanges a record has run the module that defines
it, since that module makes the exchange.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["count", "record", "records"]

T = TypeVar("T", bound=type)

_BY_NAME: dict[str, type] = {}


def record(cls: T) -> T:
    """Registers ``cls`` under its name (a class decorator); two types of one name are refused."""
    known = _BY_NAME.setdefault(cls.__name__.lstrip("_"), cls)
    if known is not cls:
        raise TypeError(f"Two exchanged record types are named {cls.__name__}: {known!r} and {cls!r}.")
    return cls


def records() -> dict[str, type]:
    """Every registered record type, by name (a copy)."""
    return dict(_BY_NAME)


def count() -> int:
    """How many types are registered (registrations only add: a cache of ``records()`` keys on it)."""
    return len(_BY_NAME)
