"""The gradients of replicated arguments, summed in buckets while the backward runs.

A ``shard_map`` argument whose copies feed computations that differ per copy (data
parallel's parameters) gets the sum of its copies' gradients. Summed after the whole
backward, that is one collective that nothing overlaps; DDP sums in **buckets** instead,
each launched as soon as its gradients are in. Here:

- the arguments of one dtype are cut into buckets of about ``config().bucket_cap_mb``
  (the last arguments first, as the backward produces their gradients first; the first
  bucket smaller, so that communication starts early). Each bucket lays its boxes end to
  end, and boxes held by the same ranks make one range (``fshard._plan.buckets``): where every
  rank holds every argument, a bucket is one ``all_reduce`` of one buffer, summed in place
  (the buffer is written by the gradients' first arrivals, with no zeroing pass), and the
  ranks check that they run the same buckets once per call: in the call's exchange of
  outcomes where it has one (``compare_series``), else in the check of outcomes that the
  call posts and the first launch ends (``agreed``), with no round of headers of their own;
- the first use in the function of any block of a run of a bucket's blocks (at most 1 MiB,
  ``tap_groups``) goes through that run's **tap** (``gathered.register_tap``): one autograd
  node for the run's blocks, not a Python call per parameter each way. Its backward runs
  once the gradients of all of them are in; it copies them into the bucket and passes
  nothing on. A backward that reaches the buckets after one that raised midway (retried from
  that root or from another) starts them afresh: the first node of a round queues a callback
  in its backward, which autograd holds until that backward ends (``_State.begin``), and a tap
  that runs again in one round says so too. When a bucket is full, and the
  buckets before it have left, it is launched (``launch``), and runs while the backward
  goes on. Where the call's backward runs other collectives of the group (a closed-over
  tensor's sum, a second series of buckets, a regathered movement), all of its buckets
  leave from the last node instead (``launch_at_end``), so that ranks whose functions used
  different blocks still pair their collectives alike;
- the backward of the arguments' own node (``_SumBuckets``) runs last. It adds the
  gradients that reached the blocks some other way (code that runs outside the function's
  torch-function mode, such as an activation checkpoint's recomputation) to the buckets not
  launched yet, launches the rest in order, waits, and gives each block its sum (views of
  the buckets, no copy). The last bucket always leaves from there, carrying more
  elements: the number of gradients that arrived after their bucket had left, a value
  that the backward carries (``carrying``: the loss, for ``fshard.backward``; else zero),
  and one per leaf, the number of ranks whose blocks of it had a gradient.
  Where that count is not zero on some rank, every rank sums those gradients too, in one
  more movement. So every rank runs the same collectives in the same order, and the result
  is the sum of every use, whichever way it came. A leaf that no rank used gets no
  gradient (``None``), as torch leaves an unused tensor and DDP an unused parameter, and as
  the local backend does: an optimizer then skips it (no momentum, no weight decay).

The buckets' buffers are kept between steps, for the first block (``_Kept``), as DDP keeps
its buckets: a fresh buffer each step would cost the memory's first touch (a page fault per
page) in every backward. A kept buffer is taken again only when nothing else refers to its
memory (the storage's reference count): where the previous step's gradients, views of it,
are still alive (``zero_grad(set_to_none=False)``, or a gradient kept by the program), the
bucket gets a new buffer, so no gradient a program holds is ever written.

Gradients of gradients (``create_graph=True``) pass taps by; they then all arrive at the
last node and are summed there, by a differentiable movement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fshard._base.alloc import use_count
from fshard._base.cache import cached
from fshard._base.compile import opaque
from fshard._config import current
from fshard._errors import CollectiveMismatchError
from fshard._exec import autograd as _autograd
from fshard._exec import gathered as _gathered
from fshard._exec.accumulate import Key, journaled, set_aside, syncing, take_back
from fshard._layout.layout import Layout, with_partial
from fshard._plan import plan as _plan
from fshard._plan.buckets import (
    FLAG,
    Bucket,
    Slots,
    bucket_slots,
    buckets,
    held_by_all,
    series_name,
    tap_groups,
)

__all__ = [
    "Carry",
    "agreed",
    "carrying",
    "compare_series",
    "launch_at_end",
    "series_of",
    "sum_in_buckets",
]

_KEPT = 2  # buffers kept per bucket: a step's, and one for a program that holds its last gradients


def _references(t: torch.Tensor) -> int:
    """How many references the memory of ``t`` has: the tensors that view it (``t`` and its views)."""
    return int(use_count(t.untyped_storage()._cdata))  # pyright: ignore[reportPrivateUsage]  # the storage's C handle


class _Kept:
    """The buckets' buffers of one tree of blocks, kept from step to step for its first block.

    A buffer is handed out as a view of its own, so every holder (the call's buckets, the
    collective in flight, the gradients) adds to its memory's count of references, and it is
    handed out again only once that count is back to the kept tensor's alone. Seen: any tensor
    that views the memory. Not seen: a program that holds only the storage object of a
    gradient (``untyped_storage()``), or reads a gradient on another CUDA stream than the
    backward's (as with DDP's ``gradient_as_bucket_view``, such a reader synchronizes itself).

    Only one series of buckets is kept (``key``: the series, the dtype and the device): blocks
    summed in other buckets than last time (another ``bucket_cap_mb``, another precision) drop
    the old buffers, so what a block holds stays one set of buckets.
    """

    def __init__(self, key: Any) -> None:
        self.key = key
        self.buffers: dict[Any, list[tuple[torch.Tensor, int]]] = {}

    @staticmethod
    def of(blocks: Sequence[torch.Tensor], key: Any) -> _Kept | None:
        """The kept buffers of ``blocks`` for ``key`` (made on first use).

        ``None`` where no block can hold them, or this torch cannot count a memory's references
        (every bucket then gets a new buffer).
        """
        if not blocks or use_count is None:
            return None
        kept: _Kept | None = _KEPT_BY.get(blocks[0])
        if kept is None or kept.key != key:
            kept = _KEPT_BY[blocks[0]] = _Kept(key)
        return kept

    def take(self, where: Any, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of a buffer of ``n`` elements at ``where``: a kept one nothing else refers to, else a new one."""
        kept = self.buffers.setdefault(where, [])
        for buffer, alone in kept:
            if _references(buffer) <= alone:
                return buffer.view(-1)  # a view: counted while the caller holds it
        buffer = torch.empty(n, dtype=dtype, device=device)
        if len(kept) < _KEPT:
            kept.append((buffer, _references(buffer)))
        return buffer.view(-1)


# torch's C++ of torch._utils._unflatten_dense_tensors and of torch._foreach_copy_, without stubs or public forms.
_nn: Any = getattr(torch._C, "_nn")  # pyright: ignore[reportPrivateUsage]  # noqa: B009
_unflatten: Callable[[torch.Tensor, Sequence[torch.Tensor]], list[torch.Tensor]] = _nn.unflatten_dense_tensors
_copy_all: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] = getattr(torch, "_foreach_copy_")  # noqa: B009


@cached(256)
def _templates(shapes: tuple[torch.Size, ...]) -> tuple[torch.Tensor, ...]:
    """Tensors of ``shapes`` on the meta device (no memory): the shapes ``_unflatten`` views a range in."""
    return tuple(torch.empty(shape, device="meta") for shape in shapes)


# The kept buffers, by first block: weakly, so they go with the block, and not in the block's own
# attributes, which ``torch.save`` and ``copy.deepcopy`` of the tensor would carry along.
_KEPT_BY: Any = WeakIdKeyDictionary()  # torch types it loosely: _Kept by tensor


class _State:
    """One call's buckets: their buffers as the gradients come in, and those in flight."""

    def __init__(
        self,
        plan: tuple[Bucket, ...],
        slots: Slots,
        backend: Any,
        tensors: Sequence[torch.Tensor],
        like: torch.Tensor,
        precision: Any = None,
    ):
        self.plan, self.backend, self.shapes = plan, backend, tuple(t.shape for t in tensors)
        self.sync, self.key = syncing(), Key(tensors)  # outside a syncing step, nothing leaves: all is set aside
        self.series = series_name(plan)
        self.checked = False  # the ranks compared their series in the call's exchange: no round of headers
        self.agreed = False  # else the call's check of outcomes carried it: no round at the next first launch
        self.early = True  # buckets leave as they fill (else all from the last node: ``launch_at_end``)
        self.source, self.device = like.dtype, like.device
        # Gradients are summed (and sent) in the reduce dtype; the blocks are the forward dtype's.
        self.dtype = like.dtype if precision is None else precision.reduce_dtype(like.dtype)
        self.forward = like.dtype if precision is None else precision.forward_dtype(like.dtype)
        self.where, self.leaves, self.flag = slots.where, slots.leaves, slots.flag
        self.widths, self.boxes = slots.widths, slots.boxes
        self.held = len(self.where) - (-1 in self.where)  # the boxes that have a slot (empty ones: none; -1: the flag)
        self.kept = _Kept.of(tensors, (self.series, self.dtype, self.device))
        self.round = -1
        self.reset()

    def reset(self) -> None:
        self.round += 1  # backward passes finished (each of its taps runs once in each)
        self.running: weakref.ref[_Pass] | None = None  # the backward that fills the buckets (``begin``)
        self.buffers: list[list[torch.Tensor] | None] = [None] * len(self.plan)
        self.views: dict[int, torch.Tensor] = {}  # each box's view of its bucket, in its block's shape; -1: the flag
        self.cuts: list[dict[int, torch.Tensor] | None] = [None] * len(self.plan)  # those views, bucket by bucket
        self.missing = list(self.boxes)  # per bucket, the boxes no gradient reached yet
        self.given: set[int] = set()
        self.empty: set[int] = set()  # the empty boxes that a gradient reached (no range holds them): used all the same
        self.flights: list[Callable[[], tuple[torch.Tensor, ...]]] = []
        self.earlier: list[torch.Tensor | None] | None = None  # what earlier micro-batches set aside
        self.fetched = self.journaled = False

    def restart(self) -> None:
        """``reset`` after a backward that raised midway: what earlier micro-batches set aside is set aside again.

        That backward took it back (``_all_earlier``) to add it in; the next one finds it again.
        Its journal put it back when it raised (``accumulate.journaled``), unless no backward
        ran the taking (a transform's call), which this puts back.
        """
        if self.fetched and self.earlier is not None and not self.journaled:
            set_aside(self.key, self.earlier)
        self.reset()

    def begin(self) -> None:
        """Marks that a backward reaches the buckets; starts afresh where the one that filled them has ended.

        The first node of a round queues a callback in the running backward: autograd holds it
        until that backward ends. Where it is gone while the round is not finished, the backward
        that filled the buckets raised midway, and the one now running (retried from that root
        or from another) must not add what it left. A backward nested in it (a reentrant
        checkpoint's) finds it still held.
        """
        running = self.running
        if running is not None:
            if running() is not None:
                return
            self.restart()
        mark = _Pass()
        try:
            _ENGINE.queue_callback(mark.end)
        except RuntimeError:  # no backward runs this node's thread (a transform's call): nothing to mark
            return
        self.running = weakref.ref(mark)

    def _earlier(self, position: int) -> torch.Tensor | None:
        earlier = self._all_earlier()
        return None if earlier is None else earlier[position]

    def _all_earlier(self) -> list[torch.Tensor | None] | None:
        """What earlier micro-batches set aside, one per position (``None``: nothing), taken back once."""
        if not self.fetched:
            self.earlier, self.fetched = take_back(self.key), True
            self.journaled = self.earlier is not None and journaled()  # undone by the backward's journal if it raises
        return self.earlier

    def _buffer(self, b: int) -> list[torch.Tensor]:
        buf = self.buffers[b]
        if buf is None:
            sizes = [sum(widths) for widths in self.widths[b]]
            # Not zeroed: each box is written by its first gradient (copy_), or zeroed before its bucket leaves.
            buf = self.buffers[b] = [self._new(b, j, n) for j, n in enumerate(sizes)]
            cut = self.cuts[b] = self._cut(b, buf)
            self.views.update(cut)
        return buf

    def _cut(self, b: int, ranges: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each box of bucket ``b`` in ``ranges`` (its ranges' tensors), as a view in its block's shape (-1: the flag).

        One call per range makes the views of all its boxes (``unflatten_dense_tensors``, in C++),
        not a Python call per box.
        """
        bucket = self.plan[b]
        out: dict[int, torch.Tensor] = {}
        for part, widths, total in zip(bucket.parts, self.widths[b], ranges):
            shapes = tuple(
                torch.Size((width,)) if q == bucket.flag else self.shapes[bucket.positions[q]]
                for q, width in zip(part, widths)
            )
            for q, piece in zip(part, _unflatten(total, _templates(shapes))):
                out[-1 if q == bucket.flag else bucket.positions[q]] = piece
        return out

    def _new(self, b: int, j: int, n: int) -> torch.Tensor:
        if self.kept is None:
            return torch.empty(n, dtype=self.dtype, device=self.device)
        return self.kept.take((b, j, n), n, self.dtype, self.device)

    def _slot(self, position: int) -> torch.Tensor:
        """The view of ``position``'s box in its bucket (``views``), in its block's shape; -1: the flag's elements."""
        view = self.views.get(position)
        if view is None:
            self._buffer(self.where[position][0])
            view = self.views[position]
        return view

    def take(self, position: int, grad: torch.Tensor) -> bool:
        """Adds ``grad`` to its bucket unless that bucket has left; launches the buckets now full.

        Returns whether it was taken.
        """
        return self.take_all((position,), (grad,))[0] is None

    def take_all(self, positions: Sequence[int], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``take`` of each gradient (``None``: none came); returns the gradients not taken (``None`` elsewhere).

        The first gradients of boxes whose bucket has not left are copied into it in one call
        (a tap's run of blocks: ``torch._foreach_copy_``), then the buckets now full are launched.
        """
        if not self.sync:
            return list(grads)
        left: list[torch.Tensor | None] = [None] * len(grads)
        slots: list[torch.Tensor] = []
        firsts: list[torch.Tensor] = []
        for k, (position, grad) in enumerate(zip(positions, grads)):
            where = self.where.get(position)
            if grad is None:
                continue
            if where is None:  # an empty box: no range holds it
                self.empty.add(position)
                continue
            b = where[0]
            if b < len(self.flights):
                left[k] = grad
                continue
            slot = self._slot(position)  # the block's shape, as the gradient's
            if position in self.given:
                slot.add_(grad)
                continue
            earlier = self._earlier(position)
            if earlier is None:
                slots.append(slot)
                firsts.append(grad)
            else:
                slot.copy_(grad)
                slot.add_(earlier)
            self.given.add(position)
            self.missing[b] -= 1
        if slots:
            _copy_all(slots, firsts)
        while self.early and len(self.flights) < len(self.plan) - 1 and self.missing[len(self.flights)] == 0:
            self._launch(len(self.flights))
        return left

    def dense(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """``grads`` with zeros for the missing ones, in the dtype they are summed in."""
        return [self._zeros(*shape) if g is None else g.to(self.dtype) for g, shape in zip(grads, self.shapes)]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _like(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if tensors else self._zeros(0)

    def _launch(self, b: int) -> None:
        runs = self.plan[b].runs
        start = getattr(self.backend, "launch", None)
        tensors = tuple(self._buffer(b))
        if start is None:
            done, _ = _autograd.move(with_partial(runs, "sum"), runs, self.backend, tensors, self._like(tensors))
            self.flights.append(lambda: done)
        else:  # the ranks check the whole series of buckets once, at the first
            plan = _plan(with_partial(runs, "sum"), runs)
            checked = b > 0 or self.checked or self.agreed
            if b == 0:
                self.agreed = False  # the call's check covers one backward; a later one (retain_graph) has its round
            flight = start(plan, tensors, self._like(tensors), series=self.series, checked=checked, given_up=True)
            self.flights.append(flight)

    def finish(self, late: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Every position's sum over the ranks, given the gradients that reached the last node (``late``)."""
        late = [None if g is None else g.to(self.dtype) for g in late]
        outside = [k for k, g in enumerate(late) if g is not None and not self.take(k, g)]
        for k, earlier in enumerate(self._all_earlier() or ()):  # used by earlier micro-batches only
            if k not in self.given and earlier is not None:
                self.take(k, torch.zeros_like(earlier))
        if len(self.given) < self.held:  # boxes no gradient reached: zero in their bucket
            for position, (b, _, _) in self.where.items():
                if position >= 0 and position not in self.given and b >= len(self.flights):
                    self._slot(position).zero_()
        flag = self._slot(-1)
        flag[:1].fill_(len(outside))
        carry = _carry_for(self)
        if carry is None:
            flag[1:2].zero_()
        else:
            flag[1:2].copy_(carry.value.reshape(1))
        used = self.given.union(outside, self.empty)
        uses = [0.0] * (self.flag - FLAG)
        for position in used:
            uses[self.leaves[position]] = 1.0
        flag[FLAG:].copy_(torch.tensor(uses, dtype=self.dtype))
        while len(self.flights) < len(self.plan):
            self._launch(len(self.flights))
        summed = [flight() for flight in self.flights]
        out: list[Any] = [
            None if position in self.where else self._zeros(*shape) for position, shape in enumerate(self.shapes)
        ]
        for b, ranges in enumerate(summed):  # each box a view of its sum, no copy
            # Summed in place (the buffers themselves): the views the gradients were copied into.
            buffers = self.buffers[b]  # made when the bucket left
            in_place = buffers is not None and all(x is y for x, y in zip(ranges, buffers))
            cut = self.cuts[b] if in_place else None
            for position, view in (self._cut(b, ranges) if cut is None else cut).items():
                if position >= 0:
                    out[position] = view
        b, j, at = self.where[-1]
        if carry is not None:  # a copy: the bucket's buffer is kept for the next step
            carry.total = summed[b][j][at + 1 : at + 2].to(carry.value.dtype, copy=True)
        if bool(summed[b][j][at] != 0):  # some rank had gradients after their bucket left: sum them all
            extra = [g if k in outside and g is not None else torch.zeros_like(out[k]) for k, g in enumerate(late)]
            out = [a + e for a, e in zip(out, self.sum_all(extra))]
        if len(used) < len(self.shapes):  # a leaf no rank's blocks had a gradient for gets none (DDP's rule too)
            unused = (summed[b][j][at + FLAG : at + self.flag] == 0).nonzero().flatten()
            gone = set(map(int, unused))
            out = [None if self.leaves[k] in gone else g for k, g in enumerate(out)]
        self.reset()
        return out

    def sum_all(self, grads: Sequence[torch.Tensor], used: Sequence[bool] | None = None) -> list[torch.Tensor | None]:
        """``grads`` (one per position) summed over the ranks that hold copies, bucket by bucket, at once.

        ``used``: per position, whether a gradient reached it here; a leaf that no rank's positions
        were reached in then gets ``None`` (as ``finish`` gives it), its elements counted in the flag.
        """
        out: list[torch.Tensor | None] = list(grads)
        flag = self._zeros(self.flag)
        if used is not None:
            for position, reached in enumerate(used):
                if reached:
                    flag[FLAG + self.leaves[position]] = 1.0
        uses: torch.Tensor | None = None
        for b, bucket in enumerate(self.plan):
            at = bucket.positions
            packed = tuple(
                torch.cat([flag if q == bucket.flag else grads[at[q]].reshape(-1) for q in part])
                for part in bucket.parts
            )
            runs = bucket.runs
            done, _ = _autograd.move(with_partial(runs, "sum"), runs, self.backend, packed, self._like(packed))
            for position, view in self._cut(b, done).items():
                if position >= 0:
                    out[position] = view
                else:
                    uses = view[FLAG:]
        if used is not None and uses is not None:
            gone = set(map(int, (uses == 0).nonzero().flatten()))
            out = [None if self.leaves[k] in gone else g for k, g in enumerate(out)]
        return out


@dataclasses.dataclass(eq=False)
class Carry:
    """A value of one element to sum over the ranks of ``backend`` with a backward's gradients (``carrying``).

    ``total`` is the sum, once the last bucket of gradients summed over those ranks has carried it.
    """

    backend: Any
    value: torch.Tensor
    total: torch.Tensor | None = None


_CARRIES: list[Carry] = []  # the values of the backward passes running now (``carrying``)


@contextlib.contextmanager
def carrying(carry: Carry) -> Generator[Carry, None, None]:
    """The context of a backward pass whose first last bucket over ``carry.backend``'s ranks carries ``carry``.

    That bucket's summed elements (after the gradients: the count of late gradients, this
    value, the leaves' uses) are an ``all_reduce`` anyway, so the value is summed with no collective of its
    own and no rank waits for the others to sum it. Buckets of another backend, other ranks or
    another device, of gradients summed in a dtype that would round the value, of micro-batches
    under ``no_sync``, or of gradients of gradients do not carry it (``total`` stays ``None``).
    """
    _CARRIES.append(carry)
    try:
        yield carry
    finally:
        _CARRIES.remove(carry)


def _carry_for(state: _State) -> Carry | None:
    """The value that ``state``'s last bucket carries, if any (the same on every rank: it depends on no data).

    Only buckets on the value's device carry it: the backward runs one device's nodes on one
    thread, in the same order on every rank, so every rank picks the same bucket; another
    device's nodes run on a thread of their own, which could reach its last bucket first on
    one rank and last on another.
    """
    for carry in _CARRIES:
        if (
            carry.total is None
            and carry.backend == state.backend
            and state.device == carry.value.device
            and state.dtype.is_floating_point
            and torch.promote_types(carry.value.dtype, state.dtype) == state.dtype
            and set(state.plan[-1].runs.ranks) == set(state.backend.ranks)
        ):
            return carry
    return None


class _Pass:
    """Held by a callback queued in a running backward (``_State.begin``): alive while that backward is."""

    __slots__ = ("__weakref__",)

    def end(self) -> None:
        """The callback: the backward finished (its buckets were reset by their last node)."""


_ENGINE: Any = torch.autograd.Variable._execution_engine  # pyright: ignore[reportPrivateUsage, reportAttributeAccessIssue]


class _Tap(torch.autograd.Function):
    """Identity forward of a run of one bucket's blocks; backward hands their gradients to the bucket (``_State.take``).

    It passes on nothing it handed over. Its forward takes ``ctx`` (no ``setup_context``):
    ``apply`` then binds no signature.
    """

    @staticmethod
    def forward(ctx: Any, state: _State, positions: tuple[int, ...], *tensors: torch.Tensor) -> Any:
        ctx.state, ctx.positions, ctx.round = state, positions, -1
        ctx.set_materialize_grads(False)  # a block not used: None, not a tensor of zeros
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # gradients of gradients: summed by the last node
            return (None, None, *grads)
        state: _State = ctx.state
        if ctx.round == state.round:  # this tap ran in a backward that did not finish (it raised): start afresh
            state.restart()
        if state.sync:
            state.begin()
        ctx.round = state.round
        # A bucket gone (not taken): the gradient goes on, to be summed by the last node.
        return (None, None, *state.take_all(ctx.positions, grads))


class _SumBuckets(torch.autograd.Function):
    """Identity forward; backward gives each block the sum of its copies' gradients (``_State.finish``)."""

    @staticmethod
    def forward(state: _State, like: torch.Tensor, *tensors: torch.Tensor) -> Any:
        if state.forward != state.source:  # a precision: the blocks in its forward dtype (cast before use)
            return (*(t.to(state.forward) for t in tensors), like.new_empty((0,), dtype=state.forward))
        return (*(t.view_as(t) for t in tensors), _autograd.link_of(like))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        state, like = inputs[:2]
        ctx.state = state
        ctx.set_materialize_grads(False)  # a block whose uses were all tapped gets None here, not zeros
        ctx.like_shape = like.shape

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        state: _State = ctx.state
        like = _autograd.carrier(grads, state.dtype, state.device)
        if not state.sync:  # a micro-batch under no_sync: this rank's gradients wait for the syncing one
            # A block without one keeps none: a leaf no micro-batch used on any rank gets none at the end.
            set_aside(state.key, [None if g is None else g.to(state.dtype) for g in grads[:-1]])
            return (None, None, *[None] * len(state.shapes))
        if torch.is_grad_enabled():  # gradients of gradients: one differentiable movement of them all
            dense = state.dense(grads[:-1])
            earlier = take_back(state.key)
            used = [g is not None for g in grads[:-1]]
            if earlier is not None:
                dense = [g if e is None else g + e for g, e in zip(dense, earlier)]
                used = [u or e is not None for u, e in zip(used, earlier)]
            back = state.sum_all(dense, used)
        else:
            state.begin()  # a backward that reached no tap: what one that raised left goes too
            back = state.finish(grads[:-1])
        if state.dtype != state.source:  # summed in the reduce dtype; the blocks get their own dtype
            back = [None if g is None else g.to(state.source) for g in back]
        return (None, _autograd.link_grad(ctx, 1, like), *back)


def sum_in_buckets(
    layouts: tuple[Layout, ...],
    backend: Any,
    tensors: Sequence[torch.Tensor],
    like: torch.Tensor,
    precision: Any = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | None:
    """``tensors`` (this rank's shards of ``layouts``, leaf by leaf), whose copies' gradients sum in buckets.

    Their uses in per-shard functions go through taps (``gathered.register_tap``). ``None``
    where some rank of the backend holds no shard of some leaf, or the buckets' boxes make no
    ranges; the caller then sums another way. With a ``precision``, the blocks returned are
    cast to its forward dtype, and the buckets hold (send and sum) its reduce dtype.
    """
    if not held_by_all(layouts, tuple(backend.ranks)):  # a rank without some leaf: summed another way
        return None
    cap = int(current().bucket_cap_mb * (1 << 20))
    itemsize = (like.dtype if precision is None else precision.reduce_dtype(like.dtype)).itemsize
    plan = buckets(layouts, itemsize, max(cap, 1), backend.rank)
    if plan is None:
        return None
    slots = bucket_slots(layouts, itemsize, max(cap, 1), backend.rank)
    state = _State(plan, slots, backend, tensors, like, precision)
    *out, link = _autograd.apply(_SumBuckets, state, like, *tensors)
    for positions in tap_groups(tuple(layouts), itemsize, max(cap, 1), backend.rank):
        blocks = tuple(weakref.ref(out[p]) for p in positions)  # weakly: a block's tap keeps no other block
        tap = functools.partial(_tap, state, tuple(positions), blocks)
        for p in positions:
            _gathered.register_tap(out[p], tap)
    return tuple(out), link


def series_of(tensors: Sequence[torch.Tensor]) -> list[_State]:
    """The bucket states whose taps ``tensors`` carry (one per tree of blocks summed in buckets), in order."""
    found: dict[int, _State] = {}
    for t in tensors:
        tap = getattr(t, "_fshard_tap", None)
        if isinstance(tap, functools.partial) and tap.func is _tap:
            state = cast(_State, tap.args[0])
            found.setdefault(id(state), state)
    return list(found.values())


def launch_at_end(states: Sequence[_State]) -> None:
    """Makes ``states`` launch their buckets from their last node only, none while the backward runs.

    A bucket leaves as it fills at a point of the backward that depends on which blocks this
    rank's function used. Where the call's backward runs no other collective on the group, every
    rank still launches its buckets in the same order; where it runs others (a closed-over
    tensor's sum, another series of buckets, a regathered movement), a rank that used a block
    the others did not would launch a bucket before such a collective where they launch it
    after, and the ranks' collectives would pair wrongly (a hang, or sums of the wrong buffers).
    From the last node, every rank launches them at the same point.
    """
    for state in states:
        state.early = False


def compare_series(states: Sequence[_State], seen: Sequence[tuple[str, ...]], ranks: Sequence[int], what: str) -> None:
    """Marks ``states`` checked, given every rank's series (``seen``, in rank order) from an exchange.

    Raises:
        CollectiveMismatchError: on every rank alike, where the ranks' buckets differ.
    """
    mine = seen[0]
    other = next((k for k, s in enumerate(seen) if s != mine), None)
    if other is not None:
        msg = (
            f"{what}: ranks {ranks[0]} and {ranks[other]} would sum the gradients of its arguments in different "
            f"buckets ({', '.join(mine) or 'none'} against {', '.join(seen[other]) or 'none'}): give every rank "
            "the same fshard.config(bucket_cap_mb=...) and the same arguments."
        )
        raise CollectiveMismatchError(msg)
    for state in states:
        state.checked = True


def agreed(states: Sequence[_State]) -> str:
    """The text of ``states``' series that the call's check of outcomes carries, marking them so.

    Every rank calls it at the same point of the call and posts the text's digest in that
    check (``agree.post_outcome``); the group's next collective compares the digests, and a
    bucket's launch is one, so the backward's first launch starts without a round of headers.
    A state whose series the ranks compared already, or whose backward sends nothing (no
    gradient recorded, ``no_sync``), is not in the text.
    """
    named: list[str] = []
    for state in states:
        if not state.checked and state.sync and torch.is_grad_enabled():  # a backward may come, and send
            state.agreed = True
            named.append(f"{state.series} of {state.dtype}")
    return "; ".join(named)


def _tap(
    state: _State, positions: tuple[int, ...], blocks: tuple[weakref.ref[torch.Tensor], ...], t: torch.Tensor
) -> dict[int, torch.Tensor]:
    """The views of a run's blocks (those still alive), by ``id`` of the block: one ``_Tap`` node for them all."""
    alive = [(p, x) for p, ref in zip(positions, blocks) if (x := ref()) is not None]
    views = _autograd.apply(_Tap, state, tuple(p for p, _ in alive), *(x for _, x in alive))
    return {id(x): v for (_, x), v in zip(alive, views)}
