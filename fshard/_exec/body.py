"""The body of a ``shard_map`` while it runs, and the rendezvous of its reductions (``psum``).

``shard_map`` runs its function once per placement. A reduction inside it (``psum``) needs
every placement's value before any placement goes on:

- across processes each process runs its own placement's body, and the reduction is one
  all-reduce on the process group of the placements it sums over;
- in one process the bodies of a call that reduces run in threads, a thread per placement,
  taking turns: one runs at a time, in placement order, up to its next reduction or its
  end. Each reduction is a rendezvous at which the last thread to arrive sums every group
  in placement order (so values are the same run to run) as one autograd node over all
  placements' tensors, and the others wait for it. Turns keep the order of every call a
  body makes (saved-tensor hooks see the tensors in one order, the same at a checkpoint's
  recomputation), and let each body draw random numbers from its rank's own state, as
  each rank's process would (``on_turn``).

A body that raises, or returns while the others wait at a reduction, aborts the
rendezvous: no thread waits for ever, and the call raises the first placement's error.
The thread running a body gets the torch state the caller's thread keeps for itself:
its grad, inference and forward-grad modes, its torch-function and torch-dispatch modes
(the read-only check of input blocks among them), autocast, and the innermost
saved-tensor hooks (torch 2.8 on, where they can be read). Under such hooks no body runs
ahead on the calling thread to find out whether the call reduces (``under_hooks``; the
hooks would see tensors that are thrown away): the bodies start in threads at once. Where
hooks were set inside a body that ran ahead, the threads run without them. ``torch.func``
transforms (also per thread) are not carried over: ``psum`` refuses to run under them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

import torch
from torch.overrides import _get_current_function_mode_stack  # pyright: ignore[reportPrivateUsage]
from torch.utils._python_dispatch import (  # pyright: ignore[reportPrivateUsage]
    _get_current_dispatch_mode_stack,  # pyright: ignore[reportPrivateUsage]
    _pop_mode,  # pyright: ignore[reportPrivateUsage]
    _push_mode,  # pyright: ignore[reportPrivateUsage]
)

from fshard._errors import CollectiveMismatchError, SpecError
from fshard._exec import gathered as _gathered
from fshard._layout.placement import Placement

__all__ = [
    "Body",
    "NeedsThreads",
    "Rendezvous",
    "apart_message",
    "check_counts",
    "current",
    "entered",
    "in_transform",
    "made_in",
    "refuse_backward_in_body",
    "run_threaded",
    "under_hooks",
]

_functorch: Any = getattr(torch._C, "_functorch")  # pyright: ignore[reportPrivateUsage]  # noqa: B009


@dataclasses.dataclass(frozen=True)
class Body:
    """One placement's body of a ``shard_map`` call.

    ``placements`` are the call's placements in order, ``index`` this body's among them,
    ``mesh`` the mesh that names the axes a reduction sums over, ``rendezvous`` where the
    bodies of one process meet (``None`` where they run one after another).
    """

    placements: tuple[Placement, ...]
    index: int
    mesh: Any
    backend: Any
    rendezvous: Rendezvous | None = None
    # The mesh axes of each of its reductions (a set shared by the call's bodies): a result there may depend on
    # the blocks of every placement summed with it, which the check of the results' copies then compares.
    summed: set[tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: set[tuple[str, ...]](), compare=False, hash=False
    )
    # The counts of psums whose sums are on a device (NCCL): read when the body returns, not at each psum,
    # where reading them would make the CPU wait for the device (``AllReduce``).
    counts: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=lambda: [], compare=False, hash=False)


_STATE = threading.local()
_RUNNING: set[int] = set()  # the ids of the bodies whose function runs now, on any thread


def current() -> Body | None:
    """The body running on this thread, or ``None`` outside every ``shard_map`` body."""
    return getattr(_STATE, "body", None)


def made_in() -> weakref.ref[Body] | None:
    """The running body, held weakly: a reduction's node keeps it so (its rendezvous holds the node's outputs)."""
    body = current()
    return None if body is None else weakref.ref(body)


def refuse_backward_in_body(maker: weakref.ref[Body] | None) -> None:
    """Raises ``SpecError`` where a reduction's backward runs inside a body: ``torch.autograd.grad`` called in fn.

    The reduction's transpose sums the gradients of every placement's result, seeded by one
    backward of the whole program; a backward inside fn seeds its own placement's alone,
    which no backend can sum as that backward means (one process would give each placement
    its own gradient, processes the sum of every placement's), so both refuse it.
    ``maker``: the body the reduction ran in, from ``made_in`` (the backward may run on a device's thread).
    """
    body = None if maker is None else maker()
    if current() is None and (body is None or id(body) not in _RUNNING):
        return
    msg = (
        "The backward of a psum() ran inside a shard_map body (torch.autograd.grad or .backward() called in fn): "
        "psum's transpose sums the gradients of every placement's result, which one backward of the whole "
        "program seeds, not one placement's. Take the gradient outside the shard_map call (loss.backward(), or "
        "torch.autograd.grad of a value it returned), or inside fn differentiate before the psum()."
    )
    raise SpecError(msg)


def check_counts(counts: torch.Tensor, n: int) -> None:
    """Raises ``CollectiveMismatchError`` where a psum's 4 summed counts (``AllReduce``) say its summands differ."""
    got = cast("list[float]", counts.real.tolist())  # pyright: ignore[reportUnknownMemberType]
    apart = apart_message((got[0], got[1]), (got[2], got[3]), n)
    if apart is not None:
        raise CollectiveMismatchError(apart)


def apart_message(records: tuple[float, float], tangents: tuple[float, float], n: int) -> str | None:
    """The error of a ``psum`` whose summands record a gradient, or carry a tangent, on some placements only.

    ``records``: over the placements summed together, how many record a gradient and how many
    do not; ``tangents`` the same for forward-mode tangents. ``None`` where each is all or none.
    """
    for (yes, no), what, backward in (
        (records, "records a gradient", "backward"),
        (tangents, "has a forward-mode tangent", "tangent"),
    ):
        if yes and no:
            return (
                f"psum() of a tensor that {what} on {round(yes)} of the {n} placements summed together and not on "
                f"the others: its {backward} is a sum that every one of them must join. Compute it from tensors "
                "that do so on every placement (where a branch leaves a parameter w out, add w.sum() * 0), or "
                "detach it on every placement."
            )
    return None


@contextlib.contextmanager
def entered(body: Body) -> Generator[None, None, None]:
    """The context of ``body``'s function on this thread."""
    outer = current()
    _STATE.body = body
    _RUNNING.add(id(body))
    try:
        yield
        for counts, n in body.counts:  # the psums' on a device: every member of each group reads the same
            check_counts(counts, n)
    except NeedsThreads:
        _STATE.probed = body.placements  # this call's bodies start again in threads
        raise
    finally:
        _RUNNING.discard(id(body))
        _STATE.body = outer


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp) is active on this thread."""
    return _functorch.peek_interpreter_stack() is not None


class NeedsThreads(BaseException):  # a signal, not an error: no user handler may swallow it
    """A body reduced where the bodies of one process run one after another: run them in threads."""


class _Aborted(BaseException):
    """Another body failed: this one stops at its next rendezvous."""


class Rendezvous:
    """Where the ``n`` bodies of one process meet at each reduction, in the order they reduce."""

    def __init__(self, placements: Sequence[Placement]) -> None:
        self.placements = tuple(placements)
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[Any, torch.Tensor, tuple[bool, bool]]] = {}
        self._done: set[int] = set()
        self._round = 0
        self._last: Sequence[torch.Tensor] = ()
        self._failed = False
        self._turn: int | None = None  # the body that runs now, where they take turns
        self._on_turn: Callable[[int], None] | None = None

    def take_turns(self, on_turn: Callable[[int], None] | None = None) -> None:
        """From now on one body runs at a time, in placement order, each up to its next reduction or its end.

        ``on_turn(index)`` runs on body ``index``'s thread each time its turn comes.
        """
        self._turn = 0
        self._on_turn = on_turn

    def begin(self, index: int) -> None:
        """Body ``index`` starts: where the bodies take turns, once its turn comes."""
        if self._turn is not None:
            with self._cond:
                self._await_turn(index)

    def reduce(
        self,
        index: int,
        axes: tuple[str, ...],
        t: torch.Tensor,
        groups: tuple[tuple[int, ...], ...],
        combine: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
        flags: tuple[bool, bool] = (False, False),
    ) -> torch.Tensor:
        """Body ``index``'s share of the reduction over ``axes`` that every body calls now.

        The last body to arrive runs ``combine`` on every body's tensor, in placement order.
        ``flags``: whether ``t`` records a gradient, and whether it has a forward-mode tangent
        (the members of a group must agree on each, as processes check: ``apart_message``).

        Raises:
            CollectiveMismatchError: the bodies reduce over different axes, the members of a
                group give different shapes or dtypes, or a body returned without reducing.
        """
        with self._cond:
            if self._failed:
                raise _Aborted
            if self._done:
                self._mismatch(self._unfinished_message(min(self._done), index))
            self._pending[index] = (axes, t, flags)
            mine = self._round
            if len(self._pending) == len(self.placements):
                self._complete(groups, combine)
            else:
                self._pass_turn(index)
            while self._round == mine and not self._failed:
                self._cond.wait()
            if self._round == mine:
                raise _Aborted
            if self._turn is not None:
                self._await_turn(index)
            return self._last[index]

    def _await_turn(self, index: int) -> None:
        while self._turn != index and not self._failed:
            self._cond.wait()
        if self._failed:
            raise _Aborted
        if self._on_turn is not None:
            self._on_turn(index)

    def _pass_turn(self, index: int) -> None:
        if self._turn is not None:
            self._turn = index + 1
            self._cond.notify_all()

    def _complete(
        self, groups: tuple[tuple[int, ...], ...], combine: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]
    ) -> None:
        got = [self._pending[i] for i in range(len(self.placements))]
        odd = next((i for i, (axes, _, _) in enumerate(got) if axes != got[0][0]), None)
        if odd is not None:
            self._mismatch(self._differ(0, odd, f"over axes {got[0][0]}", f"over axes {got[odd][0]}"))
        for members in groups:
            lead = got[members[0]][1]
            odd = next((j for j in members if (got[j][1].shape, got[j][1].dtype) != (lead.shape, lead.dtype)), None)
            if odd is not None:
                t = got[odd][1]
                self._mismatch(
                    self._differ(members[0], odd, f"{tuple(lead.shape)} {lead.dtype}", f"{tuple(t.shape)} {t.dtype}")
                )
            counts = [sum(got[j][2][k] for j in members) for k in (0, 1)]
            apart = apart_message(
                (counts[0], len(members) - counts[0]), (counts[1], len(members) - counts[1]), len(members)
            )
            if apart is not None:
                self._mismatch(apart)
        try:
            self._last = combine([t for _, t, _ in got])
        except BaseException:
            self._failed = True
            self._cond.notify_all()
            raise
        self._pending = {}
        self._round += 1
        if self._turn is not None:
            self._turn = 0
        self._cond.notify_all()

    def _differ(self, i: int, j: int, a: str, b: str) -> str:
        return (
            f"psum() call {self._round + 1} of a shard_map body differs between placements "
            f"{self.placements[i]} ({a}) and {self.placements[j]} ({b}): every placement's body must reduce over "
            "the same axes, in the same order, and the placements summed together must give tensors of one shape "
            "and dtype."
        )

    def finish(self, index: int) -> None:
        """Body ``index`` returned: a reduction that waits for it now never completes."""
        with self._cond:
            self._done.add(index)
            if self._pending and not self._failed:
                waiting = min(self._pending)
                self._failed = True
                self._cond.notify_all()
                raise CollectiveMismatchError(self._unfinished_message(index, waiting))
            self._pass_turn(index)

    def fail(self) -> None:
        """Aborts every reduction, now and later (a body raised)."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _mismatch(self, msg: str) -> None:
        self._failed = True
        self._cond.notify_all()
        raise CollectiveMismatchError(msg)

    def _unfinished_message(self, done: int, waiting: int) -> str:
        return (
            f"shard_map body on placement {self.placements[done]} returned after {self._round} psum() call(s), "
            f"while the body on placement {self.placements[waiting]} called psum() once more: every placement's "
            "body must call psum() the same number of times (in SPMD code, a reduction is not skipped on some "
            "placements)."
        )


def run_threaded(
    calls: Sequence[Callable[[], Any]], rendezvous: Rendezvous, on_turn: Callable[[int], None] | None = None
) -> list[Any]:
    """Runs ``calls``, each in its own thread under this thread's torch state, taking turns; their results in order.

    ``on_turn(i)`` runs each time call ``i`` gets its turn, before it goes on.

    Raises:
        BaseException: the first call's error, in call order (the others are aborted).
    """
    # This call's first body ran ahead on this thread (the placements tuple is the one the call gives both).
    probed, _STATE.probed = getattr(_STATE, "probed", None) is rendezvous.placements, None
    state = _ThreadState.read(hooks=not probed)
    rendezvous.take_turns(on_turn)
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            rendezvous.begin(i)
            with state.applied():
                results[i] = calls[i]()
            rendezvous.finish(i)
        except BaseException as e:  # handed to the caller's thread
            errors[i] = e
            rendezvous.fail()

    threads = [threading.Thread(target=run, args=(i,), name=f"fshard-body-{i}", daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, _Aborted)), None)
    if first is not None:
        raise first
    return results


_autograd: Any = getattr(torch._C, "_autograd")  # pyright: ignore[reportPrivateUsage]  # noqa: B009


def under_hooks() -> bool:
    """Whether saved-tensor hooks are on here that a body's thread takes over (torch 2.8 on): a checkpoint's, say."""
    top = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


_AUTOCAST_DEVICES: tuple[str, ...] = tuple(getattr(torch._C, "_autocast_supported_devices", lambda: ("cpu", "cuda"))())  # pyright: ignore[reportPrivateUsage]


@dataclasses.dataclass(frozen=True)
class _ThreadState:
    """The torch state a thread keeps for itself that changes what a body computes, read on one thread.

    Global state (default dtype, deterministic algorithms, anomaly mode, ``torch.backends``
    flags, matmul precision, the number of intra-op threads, the random generators) is
    every thread's already.
    """

    grad: bool
    inference: bool
    forward_grad: bool
    functions: tuple[Any, ...]
    dispatch: tuple[Any, ...]
    autocast: tuple[tuple[str, torch.dtype], ...]  # the device types autocast is on for, with its dtype
    autocast_cache: bool
    hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None  # the innermost pair
    hooks_disabled: str | None  # why saved-tensor hooks are refused, where they are

    @staticmethod
    def read(*, hooks: bool = True) -> _ThreadState:
        """This thread's state; without its saved-tensor hooks where not ``hooks``."""
        autocast: tuple[tuple[str, torch.dtype], ...] = ()
        if torch._C._is_any_autocast_enabled():  # pyright: ignore[reportPrivateUsage]
            autocast = tuple(
                (d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)
            )
        top = getattr(_autograd, "_top_saved_tensors_default_hooks", None) if hooks else None  # torch 2.8 on
        enabled = _autograd._saved_tensors_hooks_is_enabled()
        return _ThreadState(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            forward_grad=torch._C._is_fwd_grad_enabled(),  # pyright: ignore[reportPrivateUsage]
            functions=tuple(m for m in _get_current_function_mode_stack() if not _gathered.is_per_shard_mode(m)),
            dispatch=tuple(_get_current_dispatch_mode_stack()),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            hooks=None if top is None else top(False),
            hooks_disabled=None if enabled else _autograd._saved_tensors_hooks_get_disabled_error_message(),
        )

    @contextlib.contextmanager
    def applied(self) -> Generator[None, None, None]:
        """This state, on this thread (a fresh one: what it had before is put back on leaving)."""
        with contextlib.ExitStack() as stack:
            for m in self.functions:
                torch._C._push_on_torch_function_stack(m)  # pyright: ignore[reportPrivateUsage]
                stack.callback(torch._C._pop_torch_function_stack)  # pyright: ignore[reportPrivateUsage]
            for m in self.dispatch:
                _push_mode(m)
                stack.callback(_pop_mode)
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.forward_grad != torch._C._is_fwd_grad_enabled():  # pyright: ignore[reportPrivateUsage]
                stack.enter_context(_forward_grad(self.forward_grad))
            if self.autocast:
                stack.enter_context(_autocast(self.autocast, self.autocast_cache))
            if self.hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
            if self.hooks_disabled is not None:
                stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(self.hooks_disabled))
            yield


@contextlib.contextmanager
def _forward_grad(enabled: bool) -> Generator[None, None, None]:
    torch._C._set_fwd_grad_enabled(enabled)  # pyright: ignore[reportPrivateUsage]
    try:
        yield
    finally:
        torch._C._set_fwd_grad_enabled(not enabled)  # pyright: ignore[reportPrivateUsage]


@contextlib.contextmanager
def _autocast(devices: Sequence[tuple[str, torch.dtype]], cache: bool) -> Generator[None, None, None]:
    """Autocast on for ``devices`` (device type, dtype), as ``torch.autocast`` sets it."""
    before = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d, _ in devices]
    cache_before = torch.is_autocast_cache_enabled()
    for d, dtype in devices:
        torch.set_autocast_enabled(d, True)
        torch.set_autocast_dtype(d, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache)
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        for d, enabled, dtype in before:
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(cache_before)


class GroupSum(torch.autograd.Function):
    """``out[i]`` = the sum of ``tensors[j]`` over ``j`` in ``i``'s group, in group order; its own transpose."""

    @staticmethod
    def forward(groups: tuple[tuple[int, ...], ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return group_sums(groups, tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.groups, ctx.body = inputs[0], made_in()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        refuse_backward_in_body(ctx.body)
        return (None, *GroupSum.apply(ctx.groups, *grads))  # pyright: ignore[reportUnknownMemberType]

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Linear: the tangents' sums (forward-mode AD, ``torch.autograd.forward_ad``); the groups' is ``None``."""
        return group_sums(ctx.groups, tangents[1:])


def group_sums(groups: tuple[tuple[int, ...], ...], tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Per tensor, the sum over its group (``groups``: the members of each group, in order), on its device."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for members in groups:
        total = tensors[members[0]]
        for j in members[1:]:
            total = total + tensors[j].to(total.device)
        for j in members:
            out[j] = total.to(tensors[j].device, copy=True)
    return tuple(cast("list[torch.Tensor]", out))


class AllReduce(torch.autograd.Function):
    """The sum over the processes of ``ranks``, one group of ``partition`` (``backend.all_reduce_among``).

    Its own transpose. ``flags`` (``psum``'s forward; ``None`` in its backward): whether this
    process's summand records a gradient and has a forward-mode tangent. Where the dtype can
    carry either, their counts ride in the sum, and every process raises where they differ.
    """

    @staticmethod
    def forward(
        backend: Any,
        partition: tuple[tuple[int, ...], ...],
        ranks: tuple[int, ...],
        flags: tuple[bool, bool] | None,
        t: torch.Tensor,
    ) -> torch.Tensor:
        if flags is None or not (t.is_floating_point() or t.is_complex()):
            return backend.all_reduce_among(t, ranks, partition)
        records, tangent = (float(f) for f in flags)
        flat = backend.all_reduce_among(t, ranks, partition, (records, 1 - records, tangent, 1 - tangent))
        body = current()
        if flat.device.type == "cpu" or body is None:
            check_counts(flat[-4:], len(ranks))
        else:  # read when the body returns: at once, the CPU would wait for the device here
            body.counts.append((flat[-4:], len(ranks)))
        return flat[:-4].view(t.shape).detach()  # its own tensor to autograd (not a view of the flat sum)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.backend, ctx.partition, ctx.ranks, ctx.body = inputs[0], inputs[1], inputs[2], made_in()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        refuse_backward_in_body(ctx.body)
        summed = cast("torch.Tensor", AllReduce.apply(ctx.backend, ctx.partition, ctx.ranks, None, grads[0]))  # pyright: ignore[reportUnknownMemberType]
        return None, None, None, None, summed

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Linear: the tangent's sum over the same processes (forward-mode AD), one more all-reduce."""
        return ctx.backend.all_reduce_among(tangents[4], ctx.ranks, ctx.partition)
