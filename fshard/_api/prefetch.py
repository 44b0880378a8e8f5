"""Forward prefetch: a block's argument movement started while the block before it computes."""

from __future__ import annotations

from typing import Any

import optree

from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._exec import flight as _flight
from fshard._exec import fused as _fused
from fshard._exec.collective import collective
from fshard._layout.precision import Precision, check_floating, check_precision
from fshard._layout.specs import as_layout

__all__ = ["Prefetch", "prefetch"]


class Prefetch:
    """A movement of arrays started by ``fshard.prefetch`` and not used yet.

    The next ``shard_map`` (or ``apply_module``) call that moves exactly these arrays to
    these layouts (in this precision) takes its data; ``pending`` says whether that has
    happened yet. ``cancel()`` waits for a prefetch the program will not use and drops it.

    >>> import torch, fshard
    >>> ranks = [0, 1]
    >>> params, _ = fshard.shard_module(torch.nn.Linear(4, 4), fshard.fully_sharded(ranks))
    >>> ahead = fshard.prefetch(params, fshard.Replicated(ranks))
    >>> ahead
    Prefetch(2 arrays, in flight)
    >>> ahead.cancel()  # no call will use it
    >>> ahead.pending
    False
    """

    __slots__ = ("_pending",)

    def __init__(self, pending: _flight.Pending) -> None:
        if not isinstance(pending, _flight.Pending):  # pyright: ignore[reportUnnecessaryIsInstance]  # a caller's value
            msg = (
                f"Prefetch(pending) takes a movement in flight, got {type(pending).__name__}: "
                "make one with fshard.prefetch(arrays, spec)."
            )
            raise TypeError(msg)
        self._pending = pending

    @property
    def pending(self) -> bool:
        """Whether no call has used this prefetch's data yet (nor ``cancel``)."""
        return self._pending in _flight.pending()

    def cancel(self) -> None:
        """Waits for the prefetched data and drops it (a prefetch the program will not use)."""
        if _flight.drop(self._pending):
            self._pending.launches.finish()

    def __repr__(self) -> str:
        state = "in flight" if self.pending else "used"
        return f"Prefetch({len(self._pending.sources)} arrays, {state})"


@collective("prefetch")
def prefetch(arrays: Any, spec: Any, *, precision: Precision | None = None) -> Prefetch:
    """Starts moving the arrays of ``arrays`` to ``spec`` for the next call that moves them there.

    A fully-sharded program by blocks gathers each block's parameters in its call
    (``shard_map``/``apply_module``), and every rank waits for that gather. Called before the
    block ahead runs, ``prefetch`` starts the next block's gather and leaves it in flight (on
    torch_dist; the local backend moves at once): the next call that moves exactly these arrays
    to these layouts takes the data instead of moving them, so the gather overlaps the block
    ahead's compute (FSDP2's ``set_modules_to_forward_prefetch``). The call runs the movement's
    own autograd function, so values and gradients are bit-identical and the gradients reach
    the sources by its backward (a reduce-scatter); with ``regather=True`` the backward gathers
    them again as without a prefetch. Every rank must prefetch alike (SPMD). A prefetch of
    arrays that an earlier prefetch moves, unused (its step raised before the call), replaces
    it: the earlier data is waited for and dropped.

    Args:
        arrays: a pytree of ``ShardedArray`` (a block's parameters from ``fshard.shard_module``,
            with its buffers if the block has any): the arrays the call moves, as one tree.
        spec: the spec every array moves to, the call's ``in_specs`` for them
            (``fshard.Replicated(ranks)`` for ``apply_module`` over ``ranks``).
        precision: the call's ``precision`` for these arrays, if it has one.

    Returns:
        A ``Prefetch``: keep it, or ``cancel()`` it where no call will use it.

    Raises:
        SpecError: ``arrays`` holds something other than arrays, or none; the spec does not
            fit; or, at the call
            that uses it, that call moves other arrays besides, to other layouts, or in another
            precision, or an array was written in place in between.

    >>> import torch, fshard
    >>> ranks = [0, 1]
    >>> block = torch.nn.Linear(4, 4)
    >>> params, _ = fshard.shard_module(block, fshard.fully_sharded(ranks))
    >>> x = fshard.shard(torch.randn(6, 4), fshard.Chunk(0, ranks))
    >>> ahead = fshard.prefetch(params, fshard.Replicated(ranks))
    >>> y, _ = fshard.apply_module(block, params, {}, x, regather=True)  # takes the prefetched data
    >>> ahead.pending, torch.allclose(fshard.gather(y), block(fshard.gather(x)))
    (False, True)
    """
    precision = check_precision(precision, "prefetch()")
    leaves: list[Any] = optree.tree_leaves(arrays, is_leaf=_is_array, none_is_leaf=True)  # pyright: ignore[reportUnknownMemberType]
    bad = next((k for k, x in enumerate(leaves) if not isinstance(x, ShardedArray)), None)
    if bad is not None or not leaves:
        got = "no arrays" if bad is None else f"a {type(leaves[bad]).__name__} ({leaves[bad]!r:.80})"
        msg = f"prefetch() takes a pytree of ShardedArray (a block's parameters), got {got}: pass the arrays."
        raise SpecError(msg)
    sources: list[ShardedArray] = leaves
    if precision is not None:
        for a in sources:
            check_floating(precision, a.dtype, "prefetch() array")
    _replace_stale(sources)
    layouts = [as_layout(spec, a.shape) for a in sources]
    moving = [(a, x) for a, x in zip(sources, layouts) if x != a.layout]
    for a, x in moving:
        a.backend.check_layout(x)
    pending = _flight.Pending([a for a, _ in moving], [x for _, x in moving], precision, "prefetch()")
    if moving:
        pending.launches = _fused.launch_tree(pending.sources, pending.layouts, precision)
        _flight.add(pending)
    return Prefetch(pending)


def _is_array(x: Any) -> bool:
    return isinstance(x, ShardedArray)


def _replace_stale(sources: list[ShardedArray]) -> None:
    """Cancels the unused prefetches that move any of ``sources``: this prefetch replaces them.

    Such a prefetch was left behind by a step that stopped between it and the call that would
    have used it (an exception, say). Every rank runs the same program, so every rank cancels
    alike; the earlier data is waited for and dropped, and the arrays it moved besides these
    move in their own call.
    """
    ids = {id(a) for a in sources}
    for p in _flight.pending():
        if not p.ids.isdisjoint(ids) and _flight.drop(p):
            p.launches.finish()
