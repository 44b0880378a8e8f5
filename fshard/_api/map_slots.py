"""Slots: the blocks a placement holds, in order, and the checks that the arguments of a per-block function align.

A *slot* is one block of a placement: ``(placement, k)`` for the k-th shard (in layout
order) that a placement holds. Arrays align when every placement holds the same number
of shards of each; a per-block function runs once per slot on the slot's blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._errors import SpecError
from fshard._layout.layout import Layout
from fshard._layout.placement import Placement

__all__ = [
    "Slot",
    "arg_name",
    "check_aligned",
    "check_backends",
    "check_partial",
    "check_terms",
    "positions",
    "slot_index",
    "slots_of",
]


Slot = tuple[Placement, int]


def arg_name(name: int | str) -> str:
    """An argument as messages name it: by position, or by the label a caller gave it."""
    return name if isinstance(name, str) else f"argument {name}"


@cached(256)
def slots_of(layout: Layout) -> dict[Placement, tuple[int, ...]]:
    """Shard indices per placement, placements in order of first appearance."""
    out: dict[Placement, list[int]] = {}
    for i, s in enumerate(layout.shards):
        out.setdefault(s.placement, []).append(i)
    return {p: tuple(v) for p, v in out.items()}


def check_aligned(arrays: Sequence[ShardedArray], names: Sequence[int | str], one_block: bool, what: str) -> None:
    _aligned(tuple(a.layout for a in arrays), tuple(names), one_block, what)


@cached(256)
def _aligned(layouts: tuple[Layout, ...], names: tuple[int | str, ...], one_block: bool, what: str) -> bool:
    """``True``, or ``SpecError``: checked once per tuple of layouts."""
    first = slots_of(layouts[0])
    for k, layout in zip(names, layouts):
        mine = slots_of(layout)
        if one_block:
            bad = next((p for p, v in mine.items() if len(v) != 1), None)
            if bad is not None:
                msg = (
                    f"{what} {arg_name(k)}: its spec gives placement {bad} {len(mine[bad])} blocks; fn runs once per "
                    "placement, so every argument's spec must give each placement exactly one block."
                )
                raise SpecError(msg)
            lacking = next(((p, k) for p in first if p not in mine), None) or next(
                ((p, names[0]) for p in mine if p not in first), None
            )
            if lacking is not None:
                p, without = lacking
                other = names[0] if without == k else k
                msg = (
                    f"{what} {arg_name(without)} has no block on placement {p}, where {arg_name(other)} has one: "
                    "fn runs once per placement, so every argument's spec must give the same placements exactly one "
                    "block each (give every argument's spec the placements of the first one's)."
                )
                raise SpecError(msg)
        elif {p: len(v) for p, v in mine.items()} != {p: len(v) for p, v in first.items()}:
            msg = (
                f"{what} {arg_name(k)} does not align with {arg_name(names[0])}: shards per placement "
                f"{_counts(mine)} against {_counts(first)}. Aligned arrays hold the same number of shards "
                "of each on every placement; reshard one of them first."
            )
            raise SpecError(msg)
    return True


def _counts(slots: dict[Placement, tuple[int, ...]]) -> str:
    return "{" + ", ".join(f"{p}: {len(v)}" for p, v in slots.items()) + "}"


@cached(256)
def slot_index(layout: Layout) -> dict[int, Slot]:
    return {i: (p, k) for p, idx in slots_of(layout).items() for k, i in enumerate(idx)}


@cached(256)
def positions(layout: Layout) -> Mapping[Placement, int]:
    """Each placement's position among the layout's placements (in order of first appearance), read-only."""
    return MappingProxyType({p: i for i, p in enumerate(slots_of(layout))})


def check_backends(arrays: Sequence[ShardedArray], what: str) -> None:
    """Refuses arrays of different backends, and a call from a rank outside its backend's process group.

    Such a rank holds no block and takes no part in the group's exchanges, so it could not
    learn what ``fn`` returned there (nor that it raised): it raises, as a movement does.
    """
    first = arrays[0].backend
    if not getattr(first, "member", True):
        msg = (
            f"{what}: rank {first.rank} is not in this array's process group; call collective fshard "
            "functions on it only from ranks of its group (if dist.get_rank() in ranks: ...)."
        )
        raise SpecError(msg)
    for k, a in enumerate(arrays):
        if a.backend is not first and a.backend != first:
            msg = f"{what} arguments 0 and {k} live on different backends ({first!r} and {a.backend!r})."
            raise SpecError(msg)


def check_partial(
    arrays: Sequence[ShardedArray], linear: bool, what: str = "map_local()", names: Sequence[int | str] = ()
) -> str | None:
    """The pending op the result carries (``"sum"`` for a linear map of partial sums), or ``None``."""
    for k, a in enumerate(arrays):
        op = a.layout.partial
        if op is None:
            continue
        name = arg_name(names[k] if names else k)
        if not linear:
            # Only map_local takes linear=; shard_map's fn reduces inside with fshard.psum instead.
            linear_too = ""
            if what == "map_local()":
                linear_too = ", or pass linear=True if fn is linear in its partial arguments"
            msg = (
                f"{what} {name} is a pending {op} (Partial): fn would run on its summands, not on its value. "
                f"Reshard it to a non-partial spec first (fshard.reshard(x, spec) reduces it){linear_too}."
            )
            raise SpecError(msg)
        if op != "sum":
            msg = (
                f"{what} {name} is a pending {op}: linear=True applies to pending sums only; "
                "reshard it to a non-partial spec first."
            )
            raise SpecError(msg)
    return "sum" if any(a.layout.partial for a in arrays) else None


def check_terms(arrays: Sequence[ShardedArray]) -> None:
    """Raises unless the pending arguments hold their summands alike (``Layout.terms``)."""
    pending = [(k, a.layout.terms) for k, a in enumerate(arrays) if a.layout.partial is not None]
    for k, terms in pending[1:]:
        first = pending[0][1]
        if (terms is None) != (first is None) or (
            terms is not None and first is not None and terms.tobytes() != first.tobytes()
        ):
            msg = (
                f"map_local() arguments {pending[0][0]} and {k} are pending sums whose copies are summands in "
                "different ways (Layout.terms): reshard one to the other's layout first, "
                "fshard.reshard(x, other.layout)."
            )
            raise SpecError(msg)
