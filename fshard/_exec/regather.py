"""Moved arguments that the backward gathers again instead of keeping (``shard_map(..., regather=True)``).

A fully-sharded program gathers a block's parameters for its forward. Kept for the backward,
those full copies (and every layer's saved view of them) stay alive until the backward is
done with them, so the peak holds the whole model's full weights. Here, the results of one
movement are a **group**: each tensor whose storage is one of them is registered by the
storage's address. While a per-block function runs, ``saving`` installs saved-tensor hooks:
autograd saving (a view of) a group's tensor keeps a small token instead (the group, which
of its tensors, the view's sizes, strides and offset). Once the function returns, nothing
holds the full copies and they are freed.

In the backward, the first token unpacked moves the group's sources again, every leaf in one
movement (the forward's plan, without gradients), and each token gets its view of the new
copy; the copy is dropped when the last of the group's tokens has been unpacked, so the
backward also holds about one group at a time. The copy is the same plan applied to the same
sources, so values and gradients are bit-identical to keeping the copy. The sources must not
change in between: the group checks their version counters.

Under a ``torch.func`` transform (whose levels cannot see saved-tensor hooks) the copies are
kept, as without the setting.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec import fused as _fused
from fshard._layout.layout import Layout

__all__ = ["Group", "live_groups", "register", "regathers", "saving", "usable"]


class Group:
    """The results of one movement whose copy the backward moves again: the sources, the targets, the copy."""

    __slots__ = (
        "__weakref__",
        "copy",
        "layouts",
        "left",
        "lock",
        "packed",
        "precision",
        "sources",
        "versions",
        "what",
    )

    def __init__(
        self, sources: Sequence[ShardedArray], layouts: Sequence[Layout], what: str, precision: Any = None
    ) -> None:
        self.sources, self.layouts, self.what, self.precision = tuple(sources), tuple(layouts), what, precision
        self.versions = tuple(t._version for a in self.sources for t in a.addressable_data)
        self.packed = 0  # tokens made
        self.left = 0  # tokens not yet unpacked since the copy was made
        self.copy: list[torch.Tensor] | None = None
        self.lock = threading.Lock()  # bodies may run a thread each (psum on the local backend)

    def token(self, position: int, t: torch.Tensor, offset: int) -> _Token:
        """A token that stands for ``t``, a view of the group's tensor ``position`` (at storage offset ``offset``)."""
        with self.lock:
            self.packed += 1
        return _Token(self, position, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()) - offset)

    def take(self, token: _Token) -> torch.Tensor:
        """The view that ``token`` stands for, in the copy (moved again by the first token of a backward)."""
        with self.lock:
            copy = self.copy
            if copy is None:
                copy = self.copy = self._move()
                self.left = self.packed
            self.left -= 1
            if self.left <= 0:  # the last token of this backward: nothing else needs the copy
                self.copy = None
        t = copy[token.position]
        return t.as_strided(token.size, token.stride, t.storage_offset() + token.offset)

    def _move(self) -> list[torch.Tensor]:
        """The sources moved to the targets again: one movement for the tree, no gradient recorded."""
        now = tuple(t._version for a in self.sources for t in a.addressable_data)
        changed = next((k for k, (a, b) in enumerate(zip(self.versions, now)) if a != b), None)
        if changed is not None:
            msg = (
                f"{self.what} with regather=True: an argument's shard tensor (shard {changed} held here) was "
                "written in place between the forward and the backward, so gathering it again would not give "
                "the values the forward used. Update the parameters after the backward (opt.step() after "
                "loss.backward()), or pass regather=False to keep the gathered copy."
            )
            raise SpecError(msg)
        with torch.no_grad():
            moved = _fused.move_tree(self.sources, self.layouts, precision=self.precision)
        _REGATHERS[0] += 1
        return [t for a in moved for t in a.addressable_data]


class _Token:
    """What autograd keeps for a saved view of a group's tensor."""

    __slots__ = ("group", "offset", "position", "size", "stride")

    def __init__(
        self, group: Group, position: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int
    ) -> None:
        self.group, self.position, self.size, self.stride, self.offset = group, position, size, stride, offset


class _Entry:
    """A registered storage: its group, which tensor of the group, that tensor's storage offset and dtype."""

    __slots__ = ("dtype", "group", "offset", "position", "serial")

    def __init__(self, group: Group, position: int, t: torch.Tensor, serial: int) -> None:
        self.group, self.position, self.offset, self.dtype, self.serial = (
            group,
            position,
            int(t.storage_offset()),
            t.dtype,
            serial,
        )


_AUTOGRAD: Any = getattr(torch._C, "_autograd")  # noqa: B009  # pyright: ignore[reportPrivateUsage]  # not in torch's stubs
_ENTRIES: dict[int, _Entry] = {}  # storage address -> entry, while the registered tensor lives
_SERIAL = itertools.count()
_REGATHERS = [0]  # movements run again in this process
_GROUPS: weakref.WeakSet[Group] = weakref.WeakSet()


def usable() -> bool:
    """Whether saved-tensor hooks can stand in for saved tensors now (gradients recorded, no ``torch.func`` level)."""
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():  # pyright: ignore[reportPrivateUsage]  # no public check
        return False
    enabled: Callable[[], bool] = getattr(_AUTOGRAD, "_saved_tensors_hooks_is_enabled")  # noqa: B009  # untyped in torch's stubs
    return enabled()


def _address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for a tensor without one: sparse, fake, functional)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def register(
    sources: Sequence[ShardedArray],
    layouts: Sequence[Layout],
    moved: Sequence[ShardedArray],
    what: str,
    precision: Any = None,
) -> None:
    """Makes ``moved`` (``sources`` moved to ``layouts`` as one tree) a group that the backward moves again.

    ``precision``: the movement's (the backward moves in it again, to the same values).
    """
    if not usable():
        return
    group = Group(sources, layouts, what, precision)
    held = {_address(t) for a in sources for t in a.addressable_data}
    for position, t in enumerate(t for a in moved for t in a.addressable_data):
        address = _address(t)
        if address == 0 or address in held or t.numel() == 0:
            continue  # nothing to free, or the source's own storage
        if (seen := _ENTRIES.get(address)) is not None and seen.group is group:
            continue  # a view of a storage already registered (the leaves of one flat buffer)
        serial = next(_SERIAL)
        _ENTRIES[address] = _Entry(group, position, t, serial)
        weakref.finalize(t, _drop, address, serial)
    _GROUPS.add(group)


def _drop(address: int, serial: int) -> None:
    entry = _ENTRIES.get(address)
    if entry is not None and entry.serial == serial:
        del _ENTRIES[address]


def _pack(t: torch.Tensor) -> Any:
    entry = _ENTRIES.get(_address(t))
    if entry is None or entry.dtype != t.dtype:
        return t
    return entry.group.token(entry.position, t, entry.offset)


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Token):
        return saved.group.take(saved)
    return saved


@contextlib.contextmanager
def _hooked(inner: contextlib.AbstractContextManager[Any]) -> Generator[None, None, None]:
    with inner, torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def saving(inner: contextlib.AbstractContextManager[Any]) -> contextlib.AbstractContextManager[Any]:
    """``inner``, with saved views of registered groups' tensors kept as tokens while it is entered.

    ``inner`` itself where no group is alive (nothing to stand in for) or hooks cannot be used.
    """
    if not _ENTRIES or not usable():
        return inner
    return _hooked(inner)


def regathers() -> int:
    """How many movements the backward has run again in this process (for tests and benchmarks)."""
    return _REGATHERS[0]


def live_groups() -> int:
    """How many groups hold a copy moved again right now (for tests: at most one or two in a backward)."""
    return sum(1 for g in list(_GROUPS) if g.copy is not None)
