"""Differentiable data movement: one of three autograd functions per movement.

The backward of each function runs the opposite movement on the gradients:

- ``Move`` (plan ``A -> B``): backward runs plan ``B -> A``;
- ``Scatter`` (a global tensor sliced into shards): backward assembles the gradient;
- ``Assemble`` (shards into a global tensor): backward slices the gradient.

A replicated value is one value: its copies carry equal gradients, and a backward
reads one copy rather than summing them (JAX and DTensor do the same). The copies of
a pending sum (``Layout.partial``) are summands: the gradient of each is the gradient
of their sum, so the backward of a move between layouts with pending sums is the
opposite move with every copy read as a replica (a reduction's backward broadcasts). The forward
and the backward of each function are themselves movements, so gradients of any
order work, and each function also has a forward-mode rule (``jvp``) and a batching
rule (``vmap``: the batch becomes a leading dim that no shard splits), which is what
``torch.func`` transforms need. docs/autograd.md states the semantics op by op.
Where nothing can observe a derivative (no input requires grad or grad mode is
off, no forward-mode level, no ``torch.func`` transform), a movement runs its
forward alone: the same tensors, without the autograd Function's per-call cost.

Each movement also takes and returns a 0-element "link" tensor. On a process that
holds no shard of an array (torch_dist), the link is the array's one pytree leaf and
carries its autograd history and batching, so that the process runs the same backward
and batched collectives as the processes that hold shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np
import torch

from fshard._base.cache import cached
from fshard._base.calls import RECORD_ALIKE, set_records_gradient
from fshard._base.compile import opaque
from fshard._base.function import apply, requires_grad_tells, transformed
from fshard._errors import CollectiveMismatchError, SpecError
from fshard._exec import flight as _flight
from fshard._exec import gathered as _varying
from fshard._exec.accumulate import Key, key_of, set_aside, syncing, take_back
from fshard._exec.body import under_hooks
from fshard._exec.replicas import check_global, checking
from fshard._layout.batch import with_batch
from fshard._layout.layout import Layout, ShardMeta, replica_ids, with_partial
from fshard._layout.show import describe_layout
from fshard._layout.specs import whole
from fshard._plan import plan
from fshard._plan.direct import Plan
from fshard.backends import Backend
from fshard.backends._execution import accumulate

__all__ = [
    "apply",
    "assemble",
    "carrier",
    "link_grad",
    "link_of",
    "move",
    "move_cast",
    "move_summing",
    "movement_nodes",
    "regroup",
    "scatter",
    "sum_tree",
    "summed_uses",
    "together",
]


def _stand_in(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor that only carries a dtype and a device to the backend."""
    return torch.empty(0, dtype=dtype, device=device)


def _batched_like(like: torch.Tensor) -> torch.Tensor:
    """What a batching rule passes on as ``like``: a 0-element link as it is, else an empty stand-in.

    A rank that holds no block reaches the movement's backward only through its link, so the
    link keeps its history there (the gradients of gradients of ``hessian``).
    """
    return like.reshape(0) if like.numel() == 0 else _stand_in(like.dtype, like.device)


def _dense(layout: Layout, backend: Any, grads: Sequence[Any], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``grads`` with every missing (``None``) entry replaced by zeros of its shard's size."""
    idx = backend.addressable(layout)
    return tuple(
        # Layout._shard is fshard-internal: it makes one ShardMeta without making the others.
        torch.zeros(layout._shard(i).sizes, dtype=like.dtype, device=like.device) if g is None else g  # pyright: ignore[reportPrivateUsage]
        for i, g in zip(idx, grads)
    )


def _linear(src: Layout, dst: Layout, what: str) -> tuple[Layout, Layout]:
    """The layouts of the opposite (or same) move of gradients: copies read as replicas.

    Raises:
        SpecError: for a pending max or min, whose derivative this move cannot give.
    """
    for x in (src, dst):
        if x.partial in ("max", "min"):
            msg = (
                f"The {what} of a pending {x.partial} is not supported: a max/min reduction is not linear. "
                "Reduce it with fshard.gather or reshard outside the differentiated function, or use a sum."
            )
            raise SpecError(msg)
    return with_partial(src, None), with_partial(dst, None)


def _lead(t: torch.Tensor, dim: int | None, n: int) -> torch.Tensor:
    """``t`` with its batch dim first (an unbatched ``t`` is broadcast along a new one)."""
    return t.expand(n, *t.shape) if dim is None else t.movedim(dim, 0)


def link_of(like: torch.Tensor) -> torch.Tensor:
    """A new 0-element output: autograd makes it require grad when any input does."""
    return like.new_empty((0,))


def carrier(grads: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-element slice of the incoming gradients (or tangents), for a backward's own movement.

    It passes on what the gradients carry besides values: their batching under
    ``torch.func.vmap`` (so a process without shards runs the batched collective too)
    and their history (for gradients of gradients).
    """
    g = next((g for g in grads if g is not None), None)
    return _stand_in(dtype, device) if g is None else g.unsqueeze(0)[:0].reshape(0)  # a view: nothing is copied


def link_grad(ctx: Any, k: int, carrier: torch.Tensor) -> torch.Tensor | None:
    """The gradient of input ``k`` (``like``) when it is a 0-element link with history.

    A process without shards reaches the backward collectives through it; a real
    shard passed as ``like`` gets its gradient through its own slot instead.
    """
    if not ctx.needs_input_grad[k] or ctx.like_shape.numel():
        return None
    return carrier.reshape(ctx.like_shape)


def _observed(args: Sequence[Any]) -> bool:
    """Whether a derivative or a ``torch.func`` transform can see a movement of ``args``.

    A gradient (grad mode on and an input that requires grad), a forward-mode level
    or an active transform needs the autograd Function; otherwise its forward alone
    gives the same tensors without the Function's per-call cost.
    """
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return True
    return transformed()


def _run(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, or ``fn.forward(*args)`` where nothing can observe the difference.

    A movement of arrays that records a gradient says so while it runs (``records_gradient``):
    the ranks' movement headers carry the mark (``torch_dist``'s guard), so ranks whose
    backwards would differ (an input that requires grad on some ranks only) raise at the
    movement, every one, instead of waiting in a collective of the backward. A scatter is not marked: its
    source tensor is one rank's. Nor is a movement made while a backward runs (one that
    creates a graph, as ``torch.func.grad`` does): there a rank that holds no block moves
    a stand-in gradient that records none.
    """
    if not _observed(args):
        return fn.forward(*args)
    if fn not in _MARKED or _in_backward() is not None or not _records(args):
        return apply(fn, *args)
    _alike_in_one_process(fn, args)
    packed = getattr(_PACKED, "leaves", None)  # across processes, the headers compare which leaves record
    digest = _leaves_recording(packed) if packed is not None and packed[0].backend.spans_processes else 0
    prior = set_records_gradient(True, digest)
    try:
        return apply(fn, *args)
    finally:
        set_records_gradient(*prior)


def _alike_in_one_process(fn: type[torch.autograd.Function], args: Sequence[Any]) -> None:
    """Where one process runs every rank, raises where ranks disagree on recording a gradient (``_run``).

    As the movement headers do across processes: a movement that sends data, where every
    rank of the group holds blocks of the source and the blocks of some ranks require grad
    while none of the others' do (set by hand, or a function that returned a constant on
    some ranks); for a tree's leaves moved as one, where they do so through one leaf. The
    group: ranks ``0 .. world_size - 1`` of a ``LocalBackend(world_size=n)``, else the ranks
    the movement reaches. The cost: a look at each block where some do not require grad,
    nothing where all do.

    Raises:
        CollectiveMismatchError: ranks of the group disagree, naming both sets of ranks.
    """
    if fn is _Regroup:  # no data moves in its forward: across processes it sends no header either
        return
    gathers = fn is _Assemble
    backend = args[1] if gathers else args[2]
    tensors = args[5:] if gathers else args[6:] if fn is _CastMove else args[4:]
    if backend.spans_processes:
        return
    leaves: Sequence[Any] | None = getattr(_PACKED, "leaves", None)
    mixed: list[Any] = []
    if leaves is not None:  # a tree's leaves packed in one movement: the leaves whose ranks may differ
        mixed = [a for a in leaves if a.requires_grad and not all(map(_REQUIRES_GRAD, a.addressable_data))]
        if not mixed:
            return
    elif all(t.requires_grad for t in tensors):
        return
    op, p = (
        (f"gather(dst={args[2]})", _assemble_plan(args[0], backend, args[2]))
        if gathers
        else ("reshard", plan(args[0], args[1]))
    )
    if not p.min_elements_sent:
        return
    world = getattr(backend, "world_size", 0)
    grad: dict[int, bool] = {}
    for r, t in zip(p.src.columns.rank.tolist(), tensors):
        grad[r] = grad.get(r, False) or t.requires_grad
    group = range(world) if world else sorted({*grad, *p.dst.ranks})
    if any(r not in grad for r in group):  # a rank without blocks: across processes it says nothing either
        return
    through = ""
    if leaves is not None:  # each leaf as each rank sees it
        for a in mixed:
            grad = _ranks_recording(a, group)
            if not all(grad.values()):
                through = f" (its leaf of {describe_layout(a.layout)}, one of a tree of {len(leaves)} moved as one)"
                break
        else:
            return
    yes = [r for r in group if grad[r]]
    no = [r for r in group if not grad[r]]
    if yes and no:
        msg = (
            f"{op} of {describe_layout(p.src)}{through}: ranks {yes} record a gradient through it and ranks {no} "
            "do not (none of their blocks requires grad); across processes every rank raises at this movement, "
            f"and so does this backend: {RECORD_ALIKE}"
        )
        raise CollectiveMismatchError(msg)


def _ranks_recording(a: Any, group: Sequence[int]) -> dict[int, bool]:
    """Whether each rank of ``group`` records a gradient through leaf ``a`` of a tree moved as one, in one process.

    A rank that holds blocks of ``a``: whether one requires grad. One that holds none records
    one through the leaf's link where the leaf requires grad (``packed``).
    """
    ranks = a.layout.columns.rank.tolist()
    grad: dict[int, bool] = dict.fromkeys(group, bool(a.requires_grad))
    grad.update(dict.fromkeys(ranks, False))
    for r, t in zip(ranks, a.addressable_data):
        grad[r] = grad[r] or t.requires_grad
    return grad


def _leaves_recording(leaves: Sequence[Any]) -> int:
    """``recording_leaves``'s digest on this process: which of ``leaves`` record a gradient (as ``packed``)."""
    bits = bytes(
        any(map(_REQUIRES_GRAD, a.addressable_data)) if a.addressable_data else a.requires_grad for a in leaves
    )
    return int.from_bytes(hashlib.blake2b(bits, digest_size=8).digest(), "little") or 1


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


_PACKED = threading.local()  # the leaves of a tree that the movement running on this thread packs (``packed``)


@contextlib.contextmanager
def packed(leaves: Sequence[Any]) -> Generator[None, None, None]:
    """The movement made in the block packs ``leaves`` (arrays) into one: whether each rank records a gradient.

    Across processes a rank that holds no block of a leaf that requires grad records one
    through the movement all the same (the leaf's link joins the movement's ``like``); in one
    process, the same rank is said to record it (``_alike_in_one_process``).
    """
    prior = getattr(_PACKED, "leaves", None)
    _PACKED.leaves = leaves
    try:
        yield
    finally:
        _PACKED.leaves = prior


# The autograd node whose backward runs on this thread, or None (torch's stub says it is never None).
_in_backward: Callable[[], Any] = torch._C._current_autograd_node  # pyright: ignore[reportPrivateUsage]


class _Batching(threading.local):
    """Whether a batching rule (a movement's ``vmap``) runs on this thread: its movements say nothing of gradients."""

    on = False


_BATCHING = _Batching()


@contextlib.contextmanager
def _batching() -> Generator[None, None, None]:
    """Runs a batching rule, whose movements say nothing of gradients (``_records``).

    The rule runs for a call under ``torch.func.vmap`` with the transform's level left (no
    transform reads as active there), so it is marked as such a call: under a transform no
    movement says whether it records a gradient.
    """
    prior, _BATCHING.on = _BATCHING.on, True
    try:
        yield
    finally:
        _BATCHING.on = prior


def _records(args: Sequence[Any]) -> bool:
    """Whether a gradient is recorded through a call with ``args``: grad mode on, and one requires grad.

    Said under one ``torch.func.grad`` level, for that level; not under ``vmap``, nested
    transforms or a forward-mode level, where ``requires_grad`` does not tell it alike on
    every rank (a batched ``p * x`` reads False where ``p`` requires grad).
    """
    if _BATCHING.on or not requires_grad_tells():
        return False
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _holds_result(backend: Any, dst: int | None) -> bool:
    """Whether this process receives the result of a gather to ``dst``."""
    return dst is None or backend.holds(dst)


def anchor(ctx: Any, saved: torch.Tensor, backend: Any) -> None:
    """Under saved-tensor hooks across processes, saves ``saved`` for a movement's backward to read first.

    A non-reentrant ``torch.utils.checkpoint`` recomputes its region in the backward when
    the first tensor it saved there is read. A rank that holds no block of the region's
    arrays saves nothing of its own, so it would not recompute the region's movements that
    the others recompute (their collectives), and every rank would wait. Each movement's
    node saves this one tensor, read at the start of its backward, so every rank recomputes
    the region at the backward of its last movement at the latest, before that backward's
    own collective, where the ranks that hold blocks did too (``reach_anchor``). ``saved``:
    the node's 0-element link output where it has one (nothing for a hook to copy), else an
    input. In one process a recomputation runs every rank's part at once: nothing is saved.
    """
    if backend.spans_processes and under_hooks():
        ctx.save_for_backward(saved)
        ctx.anchored = True


def reach_anchor(ctx: Any) -> None:
    """Reads what ``anchor`` saved, if it did: a checkpointed region is recomputed now, on every rank."""
    if getattr(ctx, "anchored", False):
        ctx.saved_tensors  # noqa: B018  # the read is the point: it makes the checkpoint recompute


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(src: Layout, dst: Layout, backend: Any, like: torch.Tensor, *tensors: torch.Tensor) -> Any:
        return (*_flight.execute(backend, plan(src, dst), tensors, like), link_of(like))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        src, dst, backend, like = inputs[:4]
        ctx.args = (src, dst, backend, like.dtype, like.device)
        ctx.like_shape = like.shape
        anchor(ctx, output[-1], backend)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        return _move_back(ctx, grads, summing=False)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        src, dst, backend, dtype, device = ctx.args
        like = carrier(tangents[3:], dtype, device)
        _linear(src, dst, "forward derivative")
        out, link = move(src, dst, backend, _dense(src, backend, tangents[4:], like), like)
        return (*out, link)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        return _move_batched(info, in_dims, args, move)


class _MoveSumming(_Move):
    """``_Move`` whose backward sums the gradients of the destination's copies.

    The move of an argument that per-shard functions then use copy by copy (each copy in a
    computation of its own): the gradients of its copies are summed into the source, a
    reduce-scatter where the source is split, rather than read from one copy.
    """

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _Move.setup_context(ctx, inputs, output)
        ctx.sync, ctx.key = syncing(), key_of(inputs[4:], inputs[3])

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        return _move_back(ctx, grads, summing=True)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        return _move_batched(info, in_dims, args, move_summing)


def _move_back(ctx: Any, grads: Sequence[Any], summing: bool) -> Any:
    """The backward of a move: the opposite move of the gradients, copies read as replicas (or summed)."""
    reach_anchor(ctx)
    src, dst, backend, dtype, device = ctx.args
    back, like = _gradients_back(ctx, grads, src, dst, backend, summing, dtype, device)
    if back is None:
        return (None,) * (4 + len(grads) - 1)
    return (None, None, None, link_grad(ctx, 3, like), *back)


def _gradients_back(
    ctx: Any,
    grads: Sequence[Any],
    src: Layout,
    dst: Layout,
    backend: Any,
    summing: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Sequence[torch.Tensor] | None, torch.Tensor]:
    """The gradients of a move's sources in ``dtype``, and the link's carrier.

    The opposite move of the gradients, copies read as replicas (or summed). ``None`` for
    the gradients where ``summing`` outside a syncing step: they were set aside for the
    syncing micro-batch (``accumulate.no_sync``).
    """
    like = carrier(grads, dtype, device).to(dtype)
    to, frm = _linear(src, dst, "gradient")
    frm = with_partial(frm, "sum") if summing else frm
    dense = tuple(g.to(dtype) for g in _dense(dst, backend, grads[:-1], like))
    if summing:
        aside = _after_aside(ctx, dense)
        if aside is None:
            return None, like
        dense = aside
    back = move(frm, to, backend, dense, like)[0] if frm != to else dense
    if src.partial == "sum" and torch.is_grad_enabled():
        # Gradients of gradients: each summand's copy of the gradient feeds that summand's own
        # backward (a computation per copy), so the gradients that reach the copies are summed
        # over them, as those of a replicated argument are; read from one copy, the others' were lost.
        back, _ = regroup(to, backend, "sum", back, like)
    return back, like


class _CastMove(torch.autograd.Function):
    """``_Move`` (or ``_MoveSumming``) with a ``Precision``: sends, and returns, its forward dtype.

    Forward: each sender casts its shards to the precision's forward dtype, then the plan
    runs in it (equal layouts: the cast alone). Backward: the gradients are cast to the
    reduce dtype, moved (and summed, ``summing``) in it, and cast to the source's dtype,
    so the source gets a gradient of its own dtype, rounded once.
    """

    @staticmethod
    def forward(
        src: Layout,
        dst: Layout,
        backend: Any,
        precision: Any,
        summing: bool,
        like: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> Any:
        to = precision.forward_dtype(like.dtype)
        sent = tuple(t.to(to) if t.dtype != to else t.view_as(t) for t in tensors)
        if src != dst:
            sent = tuple(_flight.execute(backend, plan(src, dst), sent, _stand_in(to, like.device)))
        return (*sent, like.new_empty((0,), dtype=to))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        src, dst, backend, precision, summing, like = inputs[:6]
        ctx.args = (src, dst, backend, precision, summing, like.dtype, like.device)
        ctx.like_shape = like.shape
        ctx.sync, ctx.key = (syncing(), key_of(inputs[6:], like)) if summing else (True, None)
        anchor(ctx, output[-1], backend)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        reach_anchor(ctx)
        src, dst, backend, precision, summing, dtype, device = ctx.args
        wide = precision.reduce_dtype(dtype)
        back, like = _gradients_back(ctx, grads, src, dst, backend, summing, wide, device)
        if back is None:
            return (None,) * (6 + len(grads) - 1)
        return (None,) * 5 + (link_grad(ctx, 5, like), *(b.to(dtype) for b in back))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        src, dst, backend, precision, _summing, dtype, device = ctx.args
        to = precision.forward_dtype(dtype)
        like = carrier(tangents[5:], to, device).to(to)
        _linear(src, dst, "forward derivative")
        dense = tuple(t.to(to) for t in _dense(src, backend, tangents[6:], like))
        out, link = move(src, dst, backend, dense, like) if src != dst else (dense, like.new_empty((0,)))
        return (*out, link)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        src, dst, backend, precision, summing, like, *tensors = args
        n = info.batch_size
        lead = tuple(_lead(t, d, n) for t, d in zip(tensors, in_dims[6:]))
        with _batching():
            out, link = move_cast(
                with_batch(src, n),
                with_batch(dst, n),
                backend,
                lead,
                _batched_like(like),
                precision,
                summing,
            )
        return (*out, _lead(link, None, n)), (0,) * (len(out) + 1)


def _after_aside(ctx: Any, dense: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    """``dense`` plus what earlier micro-batches set aside; ``None`` (set aside too) outside a syncing step."""
    if not ctx.sync:
        set_aside(ctx.key, dense)
        return None
    earlier = take_back(ctx.key)
    return dense if earlier is None else tuple(g if e is None else g + e for g, e in zip(dense, earlier))


def _move_batched(info: Any, in_dims: tuple[Any, ...], args: tuple[Any, ...], how: Any) -> Any:
    """The batching rule of a move (``how``: ``move`` or ``move_summing``): the batch a leading dim no shard splits."""
    src, dst, backend, like, *tensors = args
    n = info.batch_size
    lead = tuple(_lead(t, d, n) for t, d in zip(tensors, in_dims[4:]))
    with _batching():
        out, link = how(with_batch(src, n), with_batch(dst, n), backend, lead, _batched_like(like))
    return (*out, _lead(link, None, n)), (0,) * (len(out) + 1)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(layout: Layout, backend: Any, src: int | None, full: torch.Tensor) -> Any:
        return (*backend.scatter(full, layout, src, _scatter_plan(layout, src)), link_of(full))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layout, backend, src, full = inputs
        ctx.args = (layout, backend, src, full.dtype, full.device)
        anchor(ctx, output[-1], backend)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        reach_anchor(ctx)
        layout, backend, src, dtype, device = ctx.args
        like = carrier(grads, dtype, device)
        return None, None, None, assemble(layout, backend, _dense(layout, backend, grads[:-1], like), like, src)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        layout, backend, src, dtype, device = ctx.args
        full = tangents[3] if tangents[3] is not None else _stand_in(dtype, device)
        out, link = scatter(full, layout, backend, src)
        return (*out, link)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        layout, backend, src, full = args
        n = info.batch_size
        out, link = scatter(_lead(full, in_dims[3], n), with_batch(layout, n), backend, src)
        return (*out, _lead(link, None, n)), (0,) * (len(out) + 1)


class _Assemble(torch.autograd.Function):
    @staticmethod
    def forward(
        layout: Layout, backend: Any, dst: int | None, parts: Any, like: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        out = backend.assemble(layout, tensors, like, dst, _assemble_plan(layout, backend, dst))
        # Off rank dst the result is an empty stand-in: the backward still needs a node here.
        return out if out is not None else like.new_empty((0,))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layout, backend, dst, parts, like = inputs[:5]
        ctx.args = (layout, backend, dst, like.dtype, like.device)
        ctx.parts = parts
        ctx.like_shape = like.shape
        anchor(ctx, like, backend)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        reach_anchor(ctx)
        layout, backend, dst = ctx.args[:3]
        grad = grads[0]
        if dst is None and checking():  # every rank holds the result whole: its gradient must agree
            check_global(
                backend, [("The gradient of a gathered tensor (fshard.gather's backward)", grad)], gradient=True
            )
        if ctx.parts is not None:  # uses inside per-shard functions: their parts summed over ranks
            grad = _with_parts(ctx.parts, grad, backend)
        # Off rank dst the gradient is that of the 0-element stand-in: it only gives the dtype.
        shards, _ = scatter(grad, layout, backend, dst)
        return (None, None, None, None, link_grad(ctx, 4, carrier(grads, *ctx.args[3:])), *shards)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        layout, backend, dst, dtype, device = ctx.args
        like = carrier(tangents[4:], dtype, device)
        return apply(_Assemble, layout, backend, dst, None, like, *_dense(layout, backend, tangents[5:], like))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        layout, backend, dst, _parts, like, *tensors = args
        n = info.batch_size
        lead = tuple(_lead(t, d, n) for t, d in zip(tensors, in_dims[5:]))
        out = apply(_Assemble, with_batch(layout, n), backend, dst, None, _batched_like(like), *lead)
        return (out, 0) if _holds_result(backend, dst) else (out.new_empty((n, 0)), 0)


def move(
    src: Layout, dst: Layout, backend: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The addressable shards of ``dst`` filled from those of ``src`` (differentiable), and the link.

    The link is a 0-element tensor that carries the autograd history on a process
    that holds no shard of ``dst`` (see ``ShardedArray``); ``like`` is the source's.

    Raises:
        SpecError: a pending max or min of complex values (they have no order), on every rank,
            to reduce or to make.
    """
    check_orderable(src.partial, like.dtype)
    check_orderable(dst.partial, like.dtype)
    *out, link = _run(_Move, src, dst, backend, like, *tensors)
    return tuple(out), link


def check_orderable(op: str | None, dtype: torch.dtype) -> None:
    """Refuses a pending reduction that torch cannot compute for ``dtype``, on every rank alike.

    Complex values have no order (``max``, ``min``); some dtypes have no kernel for the
    reduction at all (float8 and uint16/32/64 no add, quantized ones neither): the reduction
    would raise torch's own error at the first movement, on the ranks that reduce.

    Raises:
        SpecError: ``op`` is ``"max"`` or ``"min"`` and ``dtype`` is complex, or torch has no
            kernel for ``op`` of ``dtype``.
    """
    if op is None:
        return
    if op in ("max", "min") and dtype.is_complex:
        msg = (
            f"A pending {op} of {dtype} values cannot be reduced: complex numbers have no order. "
            "Reduce their absolute values or real parts instead (fshard.map_local(torch.abs, x) before the "
            "Partial), or use a pending sum."
        )
        raise SpecError(msg)
    if _no_kernel(op, dtype):
        name = {"sum": "add", "max": "maximum", "min": "minimum"}.get(op, op)
        msg = (
            f"A pending {op} of {dtype} values cannot be reduced: torch has no {name} for "
            f"{dtype}. Make the pending value in a dtype that has one (torch.float32, torch.bfloat16, "
            "torch.int64, ...) and convert the reduced result."
        )
        raise SpecError(msg)


@cached(64)
def _no_kernel(op: str, dtype: torch.dtype) -> bool:
    """Whether the backends' ``accumulate`` cannot combine ``op``'s values of ``dtype`` (tried once, on the CPU)."""
    try:
        one = torch.zeros(1, dtype=dtype)
        accumulate(op, one.clone(), one)
    except (NotImplementedError, RuntimeError):
        return True
    return False


def move_summing(
    src: Layout, dst: Layout, backend: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``move``, whose backward sums the gradients of ``dst``'s copies (``_MoveSumming``)."""
    *out, link = _run(_MoveSumming, src, dst, backend, like, *tensors)
    return tuple(out), link


def movement_nodes(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """The autograd nodes of the movements that made ``tensors``, through views of their results.

    A node runs once every gradient of its movement's results is in: a pre-hook on it runs
    right before the movement's backward (for a gathered block, the sum of its gradients to
    their shards).
    """
    found: list[Any] = []
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(t.grad_fn, 0) for t in tensors if t.grad_fn is not None]
    while todo:
        node, depth = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "_forward_cls", None) in _MOVEMENTS:
            found.append(node)
        elif depth < _VIEW_DEPTH:  # a view of a result (a leaf's shard of a fused movement)
            todo.extend((n, depth + 1) for n, _ in node.next_functions)
    return found


def move_cast(
    src: Layout,
    dst: Layout,
    backend: Any,
    tensors: Sequence[torch.Tensor],
    like: torch.Tensor,
    precision: Any,
    summing: bool = False,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``move`` (``move_summing`` where ``summing``) with a ``Precision``: the shards of ``dst`` in its forward dtype.

    Equal layouts are allowed: the cast alone, whose backward (where ``summing``) sums the
    gradients of the copies, as ``regroup``'s does.
    """
    *out, link = _run(_CastMove, src, dst, backend, precision, summing, like, *tensors)
    return tuple(out), link


def scatter(
    full: torch.Tensor, layout: Layout, backend: Any, src: int | None
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The addressable shards of ``layout`` sliced from ``full`` (differentiable), and the link."""
    *out, link = _run(_Scatter, layout, backend, src, full)
    return tuple(out), link


def assemble(
    layout: Layout, backend: Any, tensors: Sequence[torch.Tensor], like: torch.Tensor, dst: int | None
) -> torch.Tensor | None:
    """The global tensor from the addressable shards of ``layout`` (differentiable).

    ``None`` on a process other than rank ``dst`` (torch_dist). On a multi-process
    backend, the result of a gather to every rank is marked so that its uses inside
    per-shard functions add up over the ranks in its gradient (``fshard._exec.gathered``).
    """
    parts = None
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (like, *tensors))
    if dst is None and backend.spans_processes and needs_grad:
        parts = _varying.Parts()
    out = _run(_Assemble, layout, backend, dst, parts, like, *tensors)
    if parts is not None:
        _varying.register(out, parts)
    elif dst is None and needs_grad:  # in one process: not closed over, as across processes
        _varying.mark_gathered(out)
    return out if _holds_result(backend, dst) else None


class _Regroup(torch.autograd.Function):
    """Identity forward; backward reads the copies of ``layout``'s boxes in another way.

    ``mode="sum"``: the gradients of a box's copies are summed and the total given to
    every copy (a replicated argument used by computations that differ per copy: its
    gradient is the sum of its uses). ``mode="share"``: each copy's gradient is divided
    by the number of copies (a replicated result computed once per copy: together they
    count once).
    """

    @staticmethod
    def forward(layout: Layout, backend: Any, mode: str, like: torch.Tensor, *tensors: torch.Tensor) -> Any:
        return (*(t.view_as(t) for t in tensors), link_of(like))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layout, backend, mode, like = inputs[:4]
        ctx.args = (layout, backend, mode, like.dtype, like.device)
        ctx.like_shape = like.shape
        ctx.sync, ctx.key = syncing(), key_of(inputs[4:], like) if mode == "sum" else None

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        layout, backend, mode, dtype, device = ctx.args
        like = carrier(grads, dtype, device)
        dense = _dense(layout, backend, grads[:-1], like)
        if mode == "sum":
            summed = _after_aside(ctx, dense)
            if summed is None:
                return (None,) * (4 + len(grads) - 1)
            back, _ = move(with_partial(layout, "sum"), layout, backend, summed, like)
        else:
            back = tuple(g / n for g, n in zip(dense, _copies(layout, backend)))
            if torch.is_grad_enabled():
                # Gradients of gradients: each copy's share feeds that copy's own backward (a computation
                # per copy), so the gradients that reach the shares are summed over the copies, as those of a
                # replicated argument are; read from one copy alone, the others' parts were lost.
                back, _ = regroup(layout, backend, "sum", back, like)
        return (None, None, None, link_grad(ctx, 3, like), *back)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Forward mode: the identity's (the tangents as they are)."""
        layout, backend, _mode, dtype, device = ctx.args
        like = carrier(tangents[4:], dtype, device)
        dense = _dense(layout, backend, tangents[4:], like)
        return (*(t.view_as(t) for t in dense), like.new_empty((0,)))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        layout, backend, mode, like, *tensors = args
        n = info.batch_size
        lead = tuple(_lead(t, d, n) for t, d in zip(tensors, in_dims[4:]))
        *out, link = apply(_Regroup, with_batch(layout, n), backend, mode, _batched_like(like), *lead)
        return (*out, _lead(link, None, n)), (0,) * (len(out) + 1)


class _SumTree(torch.autograd.Function):
    """``_Regroup`` (``"sum"``) of the arrays of a tree in one node, on a backend of one process.

    One node for the tree, as the buckets across processes are: a syncing backward that
    reaches any of the arrays adds, for every one of them, what earlier micro-batches kept
    aside (``no_sync``), also where this backward does not reach it; and an array that no
    copy had a gradient for, here or in a micro-batch kept aside, gets none (``None``), as
    torch leaves an unused tensor. What is kept aside is keyed by each rank's blocks of the
    tree, as each process keys its buckets. With a ``precision``, as ``_CastMove``: the
    blocks in its forward dtype, their gradients summed in its reduce dtype and returned in
    their own.
    """

    @staticmethod
    def forward(
        layouts: tuple[Layout, ...],
        backend: Any,
        counts: tuple[int, ...],
        precision: Any,
        like: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> Any:
        to = like.dtype if precision is None else precision.forward_dtype(like.dtype)
        return (*(t.to(to) if t.dtype != to else t.view_as(t) for t in tensors), like.new_empty((0,), dtype=to))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        layouts, backend, counts, precision, like = inputs[:5]
        tensors = inputs[5:]
        wide = like.dtype if precision is None else precision.reduce_dtype(like.dtype)
        ctx.args = (layouts, backend, counts, like.dtype, wide, like.device)
        ctx.to = like.dtype if precision is None else precision.forward_dtype(like.dtype)
        ctx.like_shape = like.shape
        ctx.set_materialize_grads(False)  # an array not used: None, not zeros
        ctx.sync = syncing()
        ctx.keys = _by_rank(layouts, backend, tensors)

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        layouts, backend, counts, dtype, wide, device = ctx.args
        keys: list[tuple[Key, tuple[int, ...]]] = ctx.keys
        like = carrier(grads, wide, device).to(wide)
        # Every block's gradient, zeros for the blocks of an array that has a gradient elsewhere.
        full: list[torch.Tensor | None] = []
        at = 0
        for layout, n in zip(layouts, counts):
            mine = [None if g is None else g.to(wide) for g in grads[at : at + n]]
            at += n
            full += _dense(layout, backend, mine, like) if any(g is not None for g in mine) else [None] * n
        if not ctx.sync:  # kept aside, each rank's where this micro-batch gave it a gradient
            for key, positions in keys:
                part = [full[p] for p in positions]
                if any(g is not None for g in part):
                    set_aside(key, part)
            return (None, None, None, None, link_grad(ctx, 4, like), *[None] * len(full))
        for key, positions in keys:
            earlier: list[torch.Tensor | None] = take_back(key) or []
            for p, e in zip(positions, earlier):
                if e is not None:
                    mine_p = full[p]
                    full[p] = e if mine_p is None else mine_p + e
        out: list[torch.Tensor | None] = []
        at = 0
        for layout, n in zip(layouts, counts):
            part = full[at : at + n]
            at += n
            if all(g is None for g in part):  # no gradient here or in a micro-batch kept aside
                out += part
                continue
            back, _ = move(with_partial(layout, "sum"), layout, backend, _dense(layout, backend, part, like), like)
            out += [b.to(dtype) for b in back]
        return (None, None, None, None, link_grad(ctx, 4, like), *out)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Forward mode: the tangents as the forward moves the values (cast to the forward dtype)."""
        layouts, backend, counts, _dtype, _wide, device = ctx.args
        like = carrier(tangents[5:], ctx.to, device).to(ctx.to)
        out: list[torch.Tensor] = []
        at = 5
        for layout, n in zip(layouts, counts):
            dense = _dense(layout, backend, tangents[at : at + n], like)
            out += [t.to(ctx.to) if t.dtype != ctx.to else t.view_as(t) for t in dense]  # a view, as the forward's
            at += n
        return (*out, like.new_empty((0,)))


def _by_rank(
    layouts: tuple[Layout, ...], backend: Any, tensors: Sequence[torch.Tensor]
) -> list[tuple[Key, tuple[int, ...]]]:
    """Per rank, the key of its ``tensors`` (the shards of ``layouts`` held here, in order), and where they are.

    What that rank's process keys its buckets by, across processes.
    """
    held: dict[int, list[int]] = {}
    at = 0
    for layout in layouts:
        ranks = layout.columns.rank.tolist()
        for i in backend.addressable(layout):
            held.setdefault(ranks[i], []).append(at)
            at += 1
    return [(Key([tensors[p] for p in positions]), tuple(positions)) for positions in held.values()]


def sum_tree(
    layouts: tuple[Layout, ...],
    backend: Any,
    counts: tuple[int, ...],
    tensors: Sequence[torch.Tensor],
    like: torch.Tensor,
    precision: Any = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``tensors`` (``counts[k]`` shards of ``layouts[k]`` each), their copies' gradients summed in one node.

    For a backend of one process (``_SumTree``); in ``precision``'s forward dtype where given. And the link.
    """
    *out, link = _run(_SumTree, layouts, backend, counts, precision, like, *tensors)
    return tuple(out), link


class _Together(torch.autograd.Function):
    """Identity of the results of a tree's movements: one node in front of them all.

    A tree moves in several movements where its leaves' layouts do not share one (a leaf
    whose boxes are no ranges moves alone). A movement's backward runs only where some
    result of it has a gradient, so a leaf used on some ranks only (a per-shard function
    that reads it on some shards) would have its movement's backward, a collective, run
    on those ranks alone. Behind this node, every movement of the tree runs its backward
    wherever any leaf of the tree has a gradient, and a leaf without one gets zeros, as
    the leaves that one flat movement moves together do.
    """

    @staticmethod
    def forward(*tensors: torch.Tensor) -> Any:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass  # gradients materialize: an unused result gets zeros, so its movement's backward runs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return grads

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        return tuple(t.view_as(t) for t in tangents)


def together(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tensors`` (the results of several movements of one tree) behind one node (``_Together``)."""
    return tuple(apply(_Together, *tensors)) if len(tensors) > 1 else tuple(tensors)


@cached(256)
def _copy_counts(layout: Layout) -> tuple[int, ...]:
    """Per shard, how many shards hold replicas of its data (1 for an empty one).

    The copies of its box, or in a partial layout the copies of its summand: 1 each
    without ``terms``, the copies with its box and term with them (``replica_ids``).
    """
    ids = replica_ids(layout)
    counts = np.bincount(ids)[ids] if len(ids) else ids
    return tuple(np.where((layout.columns.sz > 0).all(axis=1), counts, 1).tolist())


def _copies(layout: Layout, backend: Backend) -> tuple[int, ...]:
    counts = _copy_counts(layout)
    return tuple(counts[i] for i in backend.addressable(layout))


def regroup(
    layout: Layout, backend: Any, mode: str, tensors: Sequence[torch.Tensor], like: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``tensors`` unchanged, with a backward that combines the gradients of each box's copies; and the link.

    The backward sums (``"sum"``) or shares (``"share"``) those gradients.
    """
    *out, link = _run(_Regroup, layout, backend, mode, like, *tensors)
    return tuple(out), link


def _with_parts(parts: _varying.Parts, grad: torch.Tensor, backend: Any) -> torch.Tensor:
    """``grad`` plus every rank's per-shard ``parts`` (a collective: every rank of the gather calls it).

    Where no per-shard function ran since the gather (on every rank alike), there are none: no exchange.
    """
    if parts.since == _varying.calls():
        return grad
    seen = backend.exchange((parts.grad is not None, str(grad.device)))  # each rank's device: a GPU each, say
    mine, parts.grad = parts.grad, None
    if not any(has for has, _ in seen):
        return grad
    summands, whole = _parts_layouts(tuple(grad.shape), tuple(backend.ranks), tuple(dev for _, dev in seen))
    mine = mine if mine is not None else torch.zeros_like(grad)
    (summed,), _ = move(summands, whole, backend, (mine,), mine)
    return grad + summed


@cached(64)
def _parts_layouts(shape: tuple[int, ...], ranks: tuple[int, ...], devices: tuple[str, ...]) -> tuple[Layout, Layout]:
    """A pending sum of one summand of ``shape`` per rank (on its device), and the full copies it sums into."""
    zero = (0,) * len(shape)
    shards = [ShardMeta(zero, shape, f"rank:{r}/{dev}") for r, dev in zip(ranks, devices)]
    return Layout(shape, shards, "sum"), Layout(shape, shards)


class _SumUses(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks of ``layout``.

    A tensor from outside a per-shard function (closed over) is one value that each
    rank uses on its own blocks: its gradient is the sum of every rank's uses.
    """

    @staticmethod
    def forward(layout: Layout, backend: Any, t: torch.Tensor) -> Any:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.args = inputs[:2]

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grads: Any) -> Any:
        layout, backend = ctx.args
        g = grads[0]
        summands, total, device = _over_ranks(layout, tuple(g.shape), backend.rank)
        here = g.to(device)
        (out,), _ = move(summands, total, backend, (here,), here)
        return None, None, out.to(g.device)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        return tangents[2].view_as(tangents[2])  # the forward is the identity: so is its derivative

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        # Elementwise in the backward (a sum over ranks of whatever shape): the batch is one more dim of it.
        return apply(_SumUses, *args), in_dims[2]


@cached(256)
def _over_ranks(layout: Layout, shape: tuple[int, ...], rank: int) -> tuple[Layout, Layout, torch.device]:
    """A whole ``shape`` on each rank of ``layout`` (on its first shard's device), as summands and as replicas.

    Also this rank's device there.
    """
    found, firsts = np.unique(layout.columns.rank, return_index=True)
    ranks: list[int] = found.tolist()
    devices: list[str] = [layout.columns.devices[i] for i in firsts.tolist()]
    summands, whole = _parts_layouts(shape, tuple(ranks), tuple(devices))
    return summands, whole, torch.device(devices[ranks.index(rank)])


def summed_uses(t: torch.Tensor, layout: Layout, backend: Any) -> torch.Tensor:
    """``t`` (a view), whose gradient is summed over the ranks of ``layout`` (a collective in the backward)."""
    return apply(_SumUses, layout, backend, t)


def _scatter_plan(layout: Layout, src: int | None) -> Plan | None:
    """The plan of ``shard(src=)``: the whole array on ``src`` to ``layout`` (none without ``src``)."""
    return None if src is None else plan(whole(layout.shape, (src,)), layout)


def _assemble_plan(layout: Layout, backend: Any, dst: int | None) -> Plan:
    """The plan of ``gather``: ``layout`` to the whole array on each receiving rank."""
    return plan(layout, whole(layout.shape, backend.receivers(layout, dst)))


# The movements' autograd functions, and how many view nodes may stand between one and a result.
_MOVEMENTS = (_Move, _MoveSumming, _CastMove)
# Movements of arrays whose backward is a collective of the ranks that moved them (``_run`` marks them).
_MARKED = frozenset((*_MOVEMENTS, _Assemble, _Regroup))
_VIEW_DEPTH = 4
