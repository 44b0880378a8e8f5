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
movement (the forward's plan, without gradients, by a launched movement's route, which
receives a large movement straight into the copy), and each token gets its view of the new
copy. Each tensor of the copy is let go when its last token has been unpacked (the node that
unpacked it holds it until it has run), so the backward holds less than one group at a time.
A tensor let go by a backward that reached part of the graph only is moved again, with the
whole copy, by the next backward that needs it. The copy is the same plan applied to the same
sources, so values and gradients are bit-identical to keeping the copy. The sources must not
change in between: the group checks their version counters.

**Backward prefetch** (FSDP2's): once half of a group's copy (in bytes, by storage) is let go
in a backward, the movement of the group registered before it (the block before, whose
backward comes next) is launched (``flight``) and left in flight while the rest of this
block's backward computes: at the next token (the node that let go of that half has then run,
unless that node unpacks the next token too), or at once where it was the last token. FSDP2
launches it when the copy is made, so two whole blocks are alive at once; here it flies in
the half let go. The launch starts a collective, so every rank must launch at the same point:
where the copies may differ in bytes between ranks (``alike``: uneven shards), every rank
launches at its first token instead, as FSDP2 does. It lands right before this group's own
movement runs its backward (a pre-hook on that autograd node): this block's backward is done,
and what comes next is the sum of its gradients to their shards, which then runs beside one
copy of the block before (its outputs) rather than beside that movement's message buffers.
So at most two groups hold data at once: what is left of the copy in use and the one in
flight or landed. A copy landed that no token of the backward takes (the block before belongs
to a graph this backward does not reach) is dropped at the backward's end, as a movement
still in flight is waited for and dropped.

Under a ``torch.func`` transform (whose levels cannot see saved-tensor hooks) the copies are
kept, as without the setting.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np
import torch

from fshard._array.array import ShardedArray
from fshard._base.cache import cached
from fshard._base.compile import opaque
from fshard._errors import SpecError
from fshard._exec import autograd as _autograd
from fshard._exec import flight as _flight
from fshard._exec import fused as _fused
from fshard._layout.layout import Layout

__all__ = [
    "Group",
    "alike",
    "held_bytes",
    "in_flight",
    "live_groups",
    "prefetched",
    "register",
    "regathers",
    "saving",
    "usable",
]


class Group:
    """The results of one movement whose copy the backward moves again: the sources, the targets, the copy."""

    __slots__ = (
        "__weakref__",
        "ahead",
        "alike",
        "copy",
        "due",
        "early",
        "half",
        "held",
        "layouts",
        "left",
        "left_at",
        "lock",
        "packed",
        "packed_at",
        "precision",
        "previous",
        "rounds",
        "sizes",
        "sources",
        "storage_of",
        "versions",
        "views",
        "what",
    )

    def __init__(
        self, sources: Sequence[ShardedArray], layouts: Sequence[Layout], what: str, precision: Any = None
    ) -> None:
        self.sources, self.layouts, self.what, self.precision = tuple(sources), tuple(layouts), what, precision
        self.versions = _flight.versions(self.sources)
        self.packed = 0  # tokens made
        self.packed_at: dict[int, int] = {}  # tokens made, per tensor of the group
        self.left = 0  # tokens not yet unpacked since the copy was made
        self.left_at: dict[int, int] = {}  # the same, per tensor
        self.copy: list[torch.Tensor | None] | None = None  # a tensor is let go after its last token
        self.held = self.half = 0  # bytes of the copy not let go yet, and half of them when it was made
        self.storage_of: dict[int, int] = {}  # position -> its storage's address
        self.views: dict[int, int] = {}  # storage address -> the copy's tensors on it not let go yet
        self.sizes: dict[int, int] = {}  # storage address -> bytes
        self.due = False  # the block before's movement is launched at this group's next token
        # Every rank's copy alike in bytes, so ranks let go of half at the same token and launch alike.
        self.alike = alike(self.layouts)
        self.early = False  # the copy was landed by the group after this one, and no token took it yet
        self.lock = threading.Lock()  # bodies may run a thread each (psum on the local backend)
        self.ahead: _flight.Launches | None = None  # the movement again, launched and not landed yet
        self.rounds = 0  # copies made (one per backward through the group, or landed ahead for one)
        self.previous: weakref.ref[Group] | None = None  # the group registered before this one

    def token(self, position: int, t: torch.Tensor, offset: int) -> _Token:
        """A token that stands for ``t``, a view of the group's tensor ``position`` (at storage offset ``offset``)."""
        with self.lock:
            self.packed += 1
            self.packed_at[position] = self.packed_at.get(position, 0) + 1
        return _Token(self, position, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()) - offset)

    def take(self, token: _Token) -> torch.Tensor:
        """The view that ``token`` stands for, in the copy.

        The first token of a backward moves the sources again, or finds the copy landed by the
        group after this one (``land_previous``).
        """
        with self.lock:
            launch, self.due = (
                self.due,
                False,
            )  # set at an earlier token (its node has run, unless it unpacks this one too)
            copy, first = self.copy, False
            # None made yet, or this tensor was let go by a backward that reached part of the graph only.
            if copy is None or copy[token.position] is None:
                copy, landed = self._move()
                self._made(copy)
                _count(landed)
                first = True
            elif self.early:  # landed ahead by the group after this one: this is its first token
                self.early, first = False, True
                _count(True)
            # Where ranks may let go of half at different tokens, every rank launches at its first.
            launch = launch or (first and not self.alike)
            t = copy[token.position]
            assert t is not None
            self.left -= 1
            self.left_at[token.position] -= 1
            if self.left_at[token.position] <= 0:  # its last token: the node that unpacks it holds it until it has run
                copy[token.position] = None
                if self._let_go(token.position) and self.alike:  # half of the copy let go (see the module)
                    self.due = self.left > 0
                    launch = launch or self.left <= 0
            if self.left <= 0:  # the last token of this backward: nothing else needs the copy
                self.copy = None
        if launch:
            self._prefetch_previous()
        return t.as_strided(token.size, token.stride, t.storage_offset() + token.offset)

    def _made(self, copy: list[torch.Tensor | None]) -> None:
        """Keeps ``copy`` as this backward's copy, for every token made in the forward (under the lock).

        Counts the bytes it holds by storage (tensors of one movement may be views of one).
        """
        self.copy, self.left, self.left_at = copy, self.packed, dict(self.packed_at)
        self.due, self.storage_of, self.views = False, {}, {}
        sizes: dict[int, int] = {}
        for k, t in enumerate(copy):
            if k not in self.left_at or t is None:
                copy[k] = None  # no token takes it
                continue
            storage = t.untyped_storage()
            self.storage_of[k] = key = storage.data_ptr()
            self.views[key] = self.views.get(key, 0) + 1
            sizes[key] = storage.nbytes()
        self.sizes = sizes
        self.held = sum(sizes.values())
        self.half = self.held // 2
        self.rounds += 1

    def _let_go(self, position: int) -> bool:
        """Counts tensor ``position`` of the copy let go; whether that let go of the copy's half (under the lock)."""
        key = self.storage_of[position]
        self.views[key] -= 1
        if self.views[key]:
            return False  # another tensor of the copy still uses its storage
        before, self.held = self.held, self.held - self.sizes[key]
        return before > self.half >= self.held

    def land_previous(self) -> None:
        """Lands the movement launched for the group before this one, if it is in flight (see the module)."""
        previous = self.previous() if self.previous is not None else None
        if previous is None:
            return
        with previous.lock:
            # A source written in place since the launch: its own first token raises, as without this.
            if previous.ahead is None or previous.copy is not None or previous._changed() is not None:  # pyright: ignore[reportPrivateUsage]  # same class
                return
            previous._made(previous._move()[0])  # pyright: ignore[reportPrivateUsage]  # same class
            previous.early = True

    def _prefetch_previous(self) -> None:
        """Launches the movement of the group before this one, whose backward comes next, if it has none yet.

        Only where that group has tokens, has not been moved again in this backward, and its
        sources are unchanged (else its own backward raises, at its first token).
        """
        previous = self.previous() if self.previous is not None else None
        if previous is None or torch._C._current_graph_task_id() == -1:  # pyright: ignore[reportPrivateUsage]  # in no backward: nothing comes next
            return
        with previous.lock:
            if previous.copy is not None or previous.ahead is not None or previous.packed == 0:
                return
            if previous.rounds >= self.rounds or previous._changed() is not None:  # pyright: ignore[reportPrivateUsage]  # same class
                return
            with _flight.launching() as launches:
                _fused.move_tree(previous.sources, previous.layouts, precision=previous.precision)
            previous.ahead = launches
        # A group of another graph (still alive) is not reached by this backward: nothing stays in flight past it.
        _ENGINE.queue_callback(functools.partial(_settle, weakref.ref(previous)))

    def _changed(self) -> int | None:
        """The first shard tensor of the sources written in place since the forward (``None``: none)."""
        now = _flight.versions(self.sources)
        return next((k for k, (a, b) in enumerate(zip(self.versions, now)) if a != b), None)

    def _move(self) -> tuple[list[torch.Tensor | None], bool]:
        """The sources moved to the targets again (one movement, no gradient recorded), and whether it landed.

        Where it was launched ahead (``_prefetch_previous``), it lands instead.
        """
        ahead, self.ahead = self.ahead, None
        changed = self._changed()
        if changed is not None:
            if ahead is not None:
                ahead.finish()  # nothing left in flight
            msg = (
                f"{self.what} with regather=True: an argument's shard tensor (shard {changed} held here) was "
                "written in place between the forward and the backward, so gathering it again would not give "
                "the values the forward used. Update the parameters after the backward (opt.step() after "
                "loss.backward()), or pass regather=False to keep the gathered copy."
            )
            raise SpecError(msg)
        launched = ahead is not None
        if ahead is None:
            # Moved now by a launched movement's route, which receives large movements straight
            # into the copy (``TorchDistBackend.launch``): no message buffers besides.
            with _flight.launching() as ahead:
                try:
                    _fused.move_tree(self.sources, self.layouts, precision=self.precision)
                except BaseException:
                    ahead.finish()  # nothing left in flight
                    raise
        try:
            with torch.no_grad(), _flight.landing(ahead):
                moved = _fused.move_tree(self.sources, self.layouts, precision=self.precision)
        except BaseException:
            ahead.finish()
            raise
        return [t for a in moved for t in a.addressable_data], launched


class _Token:
    """What autograd keeps for a saved view of a group's tensor."""

    __slots__ = ("group", "offset", "position", "size", "stride")

    def __init__(
        self, group: Group, position: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int
    ) -> None:
        self.group, self.position, self.size, self.stride, self.offset = group, position, size, stride, offset


class _Entry:
    """A registered storage: its group, dtype, and the group's tensors in it (storage offsets, sorted, and positions).

    A saved view is told by the tensor it starts in, so that it is found again in the copy
    moved again whichever way that copy packs the group's tensors into storages.
    """

    __slots__ = ("dtype", "group", "offsets", "positions", "serial")

    def __init__(self, group: Group, position: int, t: torch.Tensor, serial: int) -> None:
        self.group, self.dtype, self.serial = group, t.dtype, serial
        self.offsets, self.positions = [int(t.storage_offset())], [position]

    def add(self, position: int, t: torch.Tensor) -> None:
        """Adds the group's tensor ``position``, ``t``, a view of this storage."""
        k = bisect.bisect_right(self.offsets, int(t.storage_offset()))
        self.offsets.insert(k, int(t.storage_offset()))
        self.positions.insert(k, position)

    def find(self, t: torch.Tensor) -> tuple[int, int]:
        """The position of the group's tensor that view ``t`` starts in, and that tensor's storage offset."""
        k = max(bisect.bisect_right(self.offsets, int(t.storage_offset())) - 1, 0)
        return self.positions[k], self.offsets[k]


_ENGINE: Any = getattr(torch.autograd.Variable, "_execution_engine")  # noqa: B009  # untyped in torch's stubs
_AUTOGRAD: Any = getattr(torch._C, "_autograd")  # noqa: B009  # pyright: ignore[reportPrivateUsage]  # not in torch's stubs
_ENTRIES: dict[int, _Entry] = {}  # storage address -> entry, while the registered tensor lives
_SERIAL = itertools.count()
_REGATHERS = [0]  # copies moved again that a backward took, in this process
_PREFETCHED = [0]  # of those, the ones launched ahead (backward prefetch)
_GROUPS: weakref.WeakSet[Group] = weakref.WeakSet()
_LAST: list[weakref.ref[Group]] = []  # the group registered last


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
    made: list[torch.Tensor] = []
    for position, t in enumerate(t for a in moved for t in a.addressable_data):
        address = _address(t)
        if address == 0 or address in held or t.numel() == 0:
            continue  # nothing to free, or the source's own storage
        made.append(t)
        if (seen := _ENTRIES.get(address)) is not None and seen.group is group:
            seen.add(position, t)  # a view of a storage already registered (the leaves of one flat buffer)
            continue
        serial = next(_SERIAL)
        _ENTRIES[address] = _Entry(group, position, t, serial)
        weakref.finalize(t, _drop, address, serial)
    _GROUPS.add(group)
    group.previous = _LAST[0] if _LAST else None
    _LAST[:] = [weakref.ref(group)]
    # Right before this group's movement runs its backward, the block before lands. The hook
    # holds the group: by then autograd has let go of the tokens, which held it until then.
    for node in _autograd.movement_nodes(made):
        node.register_prehook(functools.partial(_before_sum, group))


def _before_sum(group: Group, grad_outputs: Any) -> None:
    """The pre-hook on a group's movement: lands the group before it (``Group.land_previous``)."""
    group.land_previous()


def _count(landed: bool) -> None:
    """Counts a copy that a backward took: moved again, and whether it was launched ahead."""
    _REGATHERS[0] += 1
    if landed:
        _PREFETCHED[0] += 1


def _settle(ref: weakref.ref[Group]) -> None:
    """At the end of a backward: drops what was moved ahead for ``ref``'s group and not taken.

    Waits for its movement where it is still in flight, and drops its copy where it landed
    and no token took it.
    """
    group = ref()
    if group is None:
        return
    with group.lock:
        ahead, group.ahead = group.ahead, None
        if group.early:  # landed, and no token of this backward took it
            group.copy, group.early = None, False
    if ahead is not None:
        ahead.finish()


def _drop(address: int, serial: int) -> None:
    entry = _ENTRIES.get(address)
    if entry is not None and entry.serial == serial:
        del _ENTRIES[address]


@opaque  # autograd calls it back, TorchDynamo's hook still on
def _pack(t: torch.Tensor) -> Any:
    entry = _ENTRIES.get(_address(t))
    if entry is None or entry.dtype != t.dtype:
        return t
    position, offset = entry.find(t)
    return entry.group.token(position, t, offset)


@opaque  # autograd calls it back, TorchDynamo's hook still on
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
    """How many copies moved again a backward has taken in this process (for tests and benchmarks)."""
    return _REGATHERS[0]


def prefetched() -> int:
    """How many of the movements run again were launched ahead (backward prefetch), in this process."""
    return _PREFETCHED[0]


def live_groups() -> int:
    """How many groups hold a copy moved again, or one in flight, right now (for tests: at most two)."""
    return sum(1 for g in list(_GROUPS) if g.copy is not None or g.ahead is not None)


def in_flight() -> int:
    """How many groups have a movement launched ahead and not landed, right now (for tests)."""
    return sum(1 for g in list(_GROUPS) if g.ahead is not None)


def held_bytes() -> int:
    """Bytes of the copies moved again that groups still hold, right now, by storage (for tests)."""
    groups = [g for g in list(_GROUPS) if g.copy is not None]
    return sum(g.sizes[key] for g in groups for key, n in g.views.items() if n)


@cached(256)
def alike(layouts: tuple[Layout, ...]) -> bool:
    """Whether every rank of ``layouts`` holds shards of the same sizes in each of them.

    Then a copy moved to them has the same bytes on every rank, and every rank lets go of its
    half at the same token. O(shards log shards).

    >>> import fshard
    >>> alike((fshard.Replicated([0, 1]).layout((4, 3)), fshard.Chunk(0, [0, 1]).layout((4,))))
    True
    >>> alike((fshard.Chunk(0, [0, 1, 2]).layout((4, 3)),))  # rows 2, 1 and 1
    False
    """
    everyone = np.unique(np.concatenate([x.columns.rank for x in layouts])) if layouts else np.zeros(0)
    for x in layouts:
        c = x.columns
        numel = np.prod(c.sz, axis=1) if c.sz.shape[1] else np.ones(len(c.rank), np.int64)
        ranks, counts = np.unique(c.rank, return_counts=True)
        if len(ranks) != len(everyone) or len(set(counts.tolist())) > 1:
            return False
        per_rank = numel[np.lexsort((numel, c.rank))].reshape(len(ranks), -1)
        if (per_rank != per_rank[0]).any():
            return False
    return True
