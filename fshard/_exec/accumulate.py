"""Gradients of several micro-batches summed across ranks once (``no_sync``).

The gradient of a replicated argument of ``shard_map`` is the sum of its copies' gradients
over the ranks: a collective in the backward of every step. With gradient accumulation,
each micro-batch's backward would pay it. Under ``no_sync()``, a movement's backward that
would sum copies across ranks (``buckets``, ``autograd._MoveSumming``) sets this rank's
gradients aside instead, keyed by the tensors it moved, and gives their arguments none.
The first such backward outside the context (the last micro-batch) adds what was set aside
to its own gradients and sums the total once: the bytes of one step, whatever the number
of micro-batches, as DDP's ``no_sync`` and FSDP2's ``set_requires_gradient_sync(False)``.

Whether a movement syncs is decided when it runs forward, as DDP decides. Gradients set
aside for tensors that are gone by then (a step that moved other arrays) cannot be summed
any more: the syncing backward raises rather than drop them. Gradients set aside for a
movement that the syncing micro-batch does not make again (a block it skips) stay aside,
and the optimizer's step refuses them. An optimizer's step over
tensors whose gradients are still set aside (the last micro-batch run inside the context
too) raises and drops them, since the step would leave them out and a later backward
would add them to another step's. A backward that raised leaves what is set aside as it
found it (``journaled``): retried, each micro-batch counts once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Generator, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fshard._errors import SpecError

__all__ = [
    "Key",
    "discard",
    "journaled",
    "kept_for",
    "key_of",
    "no_sync",
    "set_aside",
    "sources",
    "step_unchecked",
    "syncing",
    "take_back",
]


class _Mode(threading.local):
    depth = 0
    sources: tuple[torch.Tensor, ...] | None = None
    unchecked_steps = 0  # inside ``step_unchecked``: fshard's own optimizer steps, which change nothing


_MODE = _Mode()


@contextlib.contextmanager
def no_sync() -> Generator[None, None, None]:
    """Within it, gradients of ``shard_map``'s replicated arguments stay on each rank until a backward outside it.

    The backward of the last micro-batch, run outside, sums every micro-batch's gradients
    across ranks in one reduction (the collectives of one step). Each rank must run the
    same micro-batches inside as the others (the context changes no collective's order).
    ``zero_grad()`` does not clear the gradients kept aside (``fshard.discard_kept_aside`` drops
    them, for a step given up), and an optimizer's step over parameters that have some raises
    ``SpecError`` (the last micro-batch belongs outside).

    >>> import torch, fshard
    >>> from fshard.backends.local import LocalBackend
    >>> R = [0, 1]
    >>> w = fshard.shard(torch.ones(3), fshard.Replicated(R), backend=LocalBackend(world_size=2))
    >>> leaf = w.addressable_data[0].requires_grad_()
    >>> x = fshard.shard(torch.arange(4.0), fshard.Chunk(0, R), backend=w.backend)
    >>> step = fshard.shard_map(lambda xb, wb: (xb.sum() * wb).sum()[None], in_specs=(fshard.Chunk(0, R),
    ...     fshard.Replicated(R)), out_specs=fshard.Partial(fshard.Replicated(R)))
    >>> with fshard.no_sync():
    ...     fshard.gather(step(x, w)).sum().backward()
    >>> fshard.gather(step(x, w)).sum().backward()   # the last micro-batch: sums both
    >>> leaf.grad
    tensor([12., 12., 12.])
    """
    _MODE.depth += 1
    try:
        yield
    finally:
        _MODE.depth -= 1


def syncing() -> bool:
    """Whether a movement made now sums its copies' gradients across ranks in its backward."""
    return _MODE.depth == 0


class Key:
    """The tensors a movement moved, as ids and weak references: what its set-aside gradients belong to."""

    __slots__ = ("ids", "refs")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        bases = [t._base if t._base is not None else t for t in tensors]  # a flat view of a parameter: the parameter
        self.ids = tuple(id(t) for t in bases)
        self.refs = tuple(weakref.ref(t) for t in bases)
        if _RAISED and (raised := _RAISED.get(self.ids)) is not None and raised.same(self) and _graph_task() < 0:
            _refuse_after_raise()  # a forward made after that backward, not a recomputation inside its retry

    def alive(self) -> bool:
        """Whether every tensor is still there (an id of a dead one may name another)."""
        return all(r() is not None for r in self.refs)

    def same(self, other: Key) -> bool:
        """Whether ``other`` names the same tensors, all still there (not others at a dead one's id)."""
        return len(self.refs) == len(other.refs) and all(
            (t := a()) is not None and t is b() for a, b in zip(self.refs, other.refs)
        )


@contextlib.contextmanager
def sources(tensors: Sequence[torch.Tensor]) -> Generator[None, None, None]:
    """Within it, a movement's set-aside gradients belong to ``tensors`` (the arrays' shards it packed).

    A movement of several leaves packs them (a stack is a new tensor each step): the key is
    the leaves' shard tensors, which are the same at every micro-batch.
    """
    outer, _MODE.sources = _MODE.sources, tuple(tensors)
    try:
        yield
    finally:
        _MODE.sources = outer


def key_of(inputs: Sequence[torch.Tensor], like: torch.Tensor) -> Key:
    """The key of a movement of ``inputs``: the ``sources`` around it where given.

    Where this rank holds none of the array's shards, the array's link (``like``) names it:
    it is the same tensor at every micro-batch, and another array's is another tensor.
    """
    if _MODE.sources is not None:
        return Key(_MODE.sources)
    return Key(inputs if inputs else (like,))


_ASIDE: dict[tuple[int, ...], tuple[Key, list[torch.Tensor | None]]] = {}
# Keys of gradients kept aside for arrays that are gone, whose ids another array's key took: reported
# as lost, as those still in ``_ASIDE`` are, whatever the allocator reused (which differs from rank to rank).
_DISPLACED: list[Key] = []


class _Journal:
    """What was kept aside for each key a backward changed, as it was before: put back if that backward raises.

    Held by a callback queued in that backward, which autograd runs where the backward ends
    and drops either way: a journal dropped before its callback ran belongs to a backward
    that raised. What it took back (a syncing backward's, summed with its own gradients)
    and what it set aside (a micro-batch's under ``no_sync``) are then undone, key by key,
    so a retried backward counts each micro-batch once, whether the raise came before the
    sum or after it (a hook on a parameter's block).

    A backward run inside a node of another (a reentrant checkpoint's recomputation, a custom
    function's or a hook's ``torch.autograd.backward``) has a journal of its own, so that a
    raise inside it, caught there, puts back what it changed alone. Where it ended, its
    changes become the outer backward's: autograd drops the callback as the inner backward
    returns, in the outer backward's context, and the journal joins that one's (``_adopt``).
    They then stand or fall with it, whether the node raises afterwards or not.
    """

    __slots__ = ("__weakref__", "before", "ended", "last", "nested", "task")

    def __init__(self, task: int, before: dict[tuple[int, ...], Any] | None = None) -> None:
        self.before: dict[tuple[int, ...], tuple[Key, list[torch.Tensor | None]] | None] = before or {}
        self.ended = False
        self.last = False  # whether its callback was queued again, behind the callbacks queued since (``end``)
        self.nested = False  # whether its backward ran inside a node of another (known where it ends)
        self.task = task  # the backward's graph task

    def note(self, ids: tuple[int, ...]) -> None:
        """Keeps what is aside for ``ids`` (``None``: nothing) before this backward first changes it."""
        if ids not in self.before:
            self.before[ids] = _ASIDE.get(ids)

    def end(self) -> None:
        """The callback: the backward finished; what it changed stands, or joins the backward it ran inside.

        It runs twice: a callback queued after it (a hook's, or regathering's check) may yet make
        the backward raise, so the first run queues it again, behind them.
        """
        if not self.last:
            self.last = True
            _ENGINE.queue_callback(self.end)
            return
        self.ended = True
        self.nested = _current_node() is not None  # between nodes: a backward that no node runs
        self._close()

    def _close(self) -> None:
        """Takes it out of the table of open journals."""
        ref = _JOURNALS.get(self.task)
        if ref is not None and ref() in (self, None):
            del _JOURNALS[self.task]

    def __del__(self) -> None:
        self._close()
        if self.ended:
            if self.nested and (task := _graph_task()) >= 0:  # dropped as the inner backward returns
                _adopt(self.before, task)
            return
        for ids, held in self.before.items():  # its backward raised
            # Not gradients of arrays that are gone: the backward that raised reported them lost.
            if held is None or not held[0].alive():
                _ASIDE.pop(ids, None)
            else:
                _ASIDE[ids] = held
                _RAISED[ids] = held[0]


# The journal of each backward running now that changed what is kept aside (by graph task, whatever the thread),
# held by a callback of that backward: here weakly, until it ends.
_JOURNALS: dict[int, weakref.ref[_Journal]] = {}


def _open(task: int) -> _Journal | None:
    """The journal of the backward ``task``, where it has one open."""
    ref = _JOURNALS.get(task)
    return None if ref is None else ref()


def _adopt(before: dict[tuple[int, ...], Any], task: int) -> None:
    """Makes a finished inner backward's changes (``before``) part of the backward ``task``: put back if it raises.

    Into that backward's journal where it has one (opened before, so older: its notes win);
    otherwise into a journal opened for them. A node that ran two backwards of its own adopts both.
    """
    journal = _open(task)
    if journal is None:
        _opened(task, before)
        return
    for ids, held in before.items():
        journal.before.setdefault(ids, held)


def _opened(task: int, before: dict[tuple[int, ...], Any] | None = None) -> _Journal:
    """A journal for the backward ``task``, which holds it by a callback, and open in the table."""
    journal = _Journal(task, before)
    _ENGINE.queue_callback(journal.end)
    _JOURNALS[task] = weakref.ref(journal)
    return journal


# What a backward that raised put back, by key: for that backward's retry alone (``_refuse_after_raise``).
_RAISED: dict[tuple[int, ...], Key] = {}


def _refuse_after_raise() -> None:
    """Refuses a movement made after a backward that raised put back what it had taken or set aside.

    Its retry (a backward of the same graph) finds what it had; a forward made since is either
    that micro-batch run again, whose step wants the earlier micro-batches, or a step begun
    afresh, which does not. Which one, only the program knows, so the gradients put back are
    dropped and the call raises, alike on every rank that saw that backward raise.

    Raises:
        SpecError: always.
    """
    for ids in _RAISED:
        _ASIDE.pop(ids, None)
    _RAISED.clear()
    msg = (
        "fshard.no_sync(): a backward that raised had set aside or summed gradients of micro-batches under "
        "no_sync(), and this call over the same arrays was made after it, so fshard cannot tell whether those "
        "micro-batches belong to its step. They were dropped. To keep them, retry the backward that raised on "
        "its own graph (the first `loss.backward(retain_graph=True)`, then `loss.backward()` again) before any "
        "other call over these arrays; otherwise run the step again from its first micro-batch (to give a step "
        "up without this error, call fshard.discard_kept_aside(params) on every rank first)."
    )
    raise SpecError(msg)


# -1 outside a backward
_graph_task: Any = getattr(torch._C, "_current_graph_task_id")  # pyright: ignore[reportPrivateUsage]  # noqa: B009
_ENGINE: Any = getattr(torch.autograd.Variable, "_execution_engine")  # noqa: B009  # untyped in torch's stubs
# The node whose backward runs on this thread (``None`` between nodes: where a backward that no node runs ends)
_current_node: Any = getattr(torch._C, "_current_autograd_node")  # pyright: ignore[reportPrivateUsage]  # noqa: B009


def journaled(ids: tuple[int, ...] | None = None) -> bool:
    """Whether what is kept aside changes now within a backward that puts it back if it raises.

    Opens that backward's journal on its first change, and notes ``ids``, the key about to
    change. Outside a backward (a transform's call of a node's backward) the change stands
    at once.
    """
    task = _graph_task()
    if task < 0:  # no backward runs on this thread
        return False
    journal = _open(task) or _opened(task)
    if ids is not None:
        journal.note(ids)
    return True


def set_aside(key: Key, grads: Sequence[torch.Tensor | None]) -> None:
    """Adds ``grads`` to what is set aside for the movement of ``key``'s tensors (``None``: no gradient yet)."""
    journaled(key.ids)
    raised = _RAISED.pop(key.ids, None)  # the retry of the backward that raised: what it had is its own
    held = _ASIDE.get(key.ids)
    if held is not None and held[0].same(key):
        grads = [a if g is None else g if a is None else a + g for a, g in zip(held[1], grads)]
    elif held is not None and held[0] is not raised:  # another array's, gone, whose ids these tensors took
        _DISPLACED.append(held[0])  # (not that of a step given up after a raise: dropped)
    _ASIDE[key.ids] = (key, list(grads))
    if not _STEP_HOOK:  # from the first micro-batch kept aside on: optimizers' steps are checked
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_held))


_STEP_HOOK: list[Any] = []  # the handle of the hook on every optimizer's step, once made


def kept_for(tensors: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """The keys of what is kept aside for movements of ``tensors`` (arrays' shard tensors and links), for ``discard``.

    Raises:
        SpecError: called while a backward runs (a hook), which may be summing them; or a movement
            whose entry is among them moved other tensors too (part of a tree moved as one).
    """
    if _graph_task() >= 0:
        msg = (
            "fshard.discard_kept_aside() ran inside a backward (a hook), which may be summing or setting aside "
            "the very gradients it drops: call it between steps, after the backward has returned or raised."
        )
        raise SpecError(msg)
    mine = {id(t if t._base is None else t._base) for t in tensors}
    found: list[tuple[int, ...]] = []
    for ids, (key, _) in tuple(_ASIDE.items()):  # (what a raise put back is aside too, its key in ``_RAISED``)
        alive = {id(t) for r in key.refs if (t := r()) is not None}
        if mine.isdisjoint(alive):
            continue
        if not mine.issuperset(alive):
            msg = (
                "fshard.discard_kept_aside(): gradients kept aside for some of these arrays were moved in one "
                "call with shard tensors of other arrays (a tree moved as one), and would be dropped with them: "
                "pass every array that call moved (the whole tree the optimizer holds). Nothing was dropped."
            )
            raise SpecError(msg)
        found.append(ids)
    return found


def discard(found: Sequence[tuple[int, ...]]) -> None:
    """Drops what is kept aside, and what a backward that raised put back, under the keys ``found`` (``kept_for``)."""
    for ids in found:
        _ASIDE.pop(ids, None)
        _RAISED.pop(ids, None)


@contextlib.contextmanager
def step_unchecked() -> Generator[None, None, None]:
    """Within it, optimizer steps are not refused for gradients kept aside (a step of zero lr that makes state)."""
    _MODE.unchecked_steps += 1
    try:
        yield
    finally:
        _MODE.unchecked_steps -= 1


def _refuse_held(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Refuses an optimizer step over tensors whose micro-batches' gradients are still kept aside.

    No backward outside ``no_sync`` has summed them, so those tensors hold no gradient from
    them: the step would leave them out, and the next syncing backward would add them to
    another step's. Both are silent, so the step raises, and every gradient kept aside is
    dropped: also those a rank keeps for arrays it holds no shard of, whose links its
    optimizer may not hold (every rank steps alike, so every rank drops alike).

    Raises:
        SpecError: some of ``optimizer``'s tensors have gradients kept aside.
    """
    if not _ASIDE or _MODE.unchecked_steps:
        return
    mine = {id(p if p._base is None else p._base) for group in optimizer.param_groups for p in group["params"]}
    if all(mine.isdisjoint(ids) for ids, (key, _) in tuple(_ASIDE.items()) if key.alive()):
        return
    _ASIDE.clear()  # all of it: what a rank keeps for arrays it holds no shard of is in no optimizer of its own
    _DISPLACED.clear()
    _RAISED.clear()
    msg = (
        f"{type(optimizer).__name__}.step() over parameters whose gradients fshard.no_sync() still keeps aside: "
        "no backward outside no_sync() has summed them across ranks, so the step would leave them out, and a "
        "later backward would add them to another step's. Every gradient kept aside was dropped. Run the last "
        "micro-batch of each step outside `with fshard.no_sync():` (its backward sums every micro-batch's "
        "gradients once), then step; that micro-batch must make every call the others made (a block that "
        "earlier micro-batches used and it skips keeps its gradients aside: run a micro-batch that skips a "
        "block inside no_sync(), and one that calls it last)."
    )
    raise SpecError(msg)


def take_back(key: Key) -> list[torch.Tensor | None] | None:
    """What is set aside for the movement of ``key``'s tensors (forgotten here), or ``None``.

    An entry is taken back only by the very tensors it was kept for (their weak references
    compared, not their ids, which a dead tensor's successor may reuse on one rank and not on
    another).

    Raises:
        SpecError: gradients were set aside for tensors that no longer exist: they would be lost.
    """
    if not (_ASIDE or _DISPLACED):  # the common case: no micro-batch kept aside
        return None
    journaled(key.ids)
    _RAISED.pop(key.ids, None)  # the retry of the backward that raised: what it had is its own
    # A copy of the table, taken at once: a backward on another thread may put entries back meanwhile.
    gone = [ids for ids, (k, _) in tuple(_ASIDE.items()) if not k.alive()]
    lost = [ids for ids in gone if _RAISED.pop(ids, None) is None]  # not a step given up after a raise
    for ids in gone:
        _ASIDE.pop(ids, None)
    if lost or _DISPLACED:
        _DISPLACED.clear()
        msg = (
            "Gradients accumulated under fshard.no_sync() belong to arrays that no longer exist, so they "
            "cannot be summed: pass the same arrays (the ones the optimizer holds) to every micro-batch."
        )
        raise SpecError(msg)
    held = _ASIDE.get(key.ids)
    if held is None or not held[0].same(key):
        return None
    _ASIDE.pop(key.ids, None)
    return held[1]
