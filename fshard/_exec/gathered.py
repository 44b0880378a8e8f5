"""Gradients of gathered tensors used per shard, on a multi-process backend.

``bf = fshard.gather(b)`` gives every rank the same tensor. Where every rank uses it
alike (a loss computed in full on each rank), its gradient is the same everywhere and
counts once. Where it is used inside ``map_local``/``shard_map``, each rank uses it on
its own shards only, so its gradient there is a part: the gradient of ``b`` is the
sum of the parts over all ranks. The local backend gets that sum by itself (one
process holds every shard and one ``bf``); here, fshard sums it:

- while a per-shard function runs, a torch-function mode replaces each gathered
  tensor it touches with a view whose backward sets its gradient aside (the per-shard
  part) instead of passing it on;
- the backward of the gather that made the tensor adds the parts summed over all
  ranks (one small exchange says whether any rank has a part; then one all-reduce).
  Where no per-shard function ran since the gather (a loss gathered last), there is
  no part on any rank, and no exchange.

This is JAX's rule for ``shard_map`` (an invariant value used where values vary per
device is broadcast, and the transpose of that broadcast is a sum), applied to the
tensors that fshard produced.

Every other tensor that a per-shard function uses from outside its arguments (a
closed-over tensor, a module's parameter reached through a closure) and that needs a
gradient is such a value too: the mode replaces it by a view (``closed``) whose backward
sums its gradient over the ranks, so that each rank gets the sum of every rank's uses, as
the local backend does. A tensor is "from outside" when it is not one of the function's
blocks and existed before the function ran (a leaf, or made by an autograd node older than
the call's ``mark``).

The sum is a collective in the gather's backward, so every rank's backward must reach
that gather. A rank that holds no shard runs no per-shard function; its result then
joins (``join``) the gathered tensors that the other ranks' functions used, which it
learns from them (``Usage``: each gathered tensor is named by its age, the number of
gathers registered after it, which is the same on every rank that gathered alike since).
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Callable, Collection, Container, Generator, Mapping, Sequence
from typing import Any, cast

import optree
import torch
from torch.overrides import TorchFunctionMode

from fshard._base.compile import never_compiled, opaque
from fshard._base.function import apply
from fshard._errors import SpecError
from fshard._exec import readonly as _readonly

__all__ = [
    "Parts",
    "Usage",
    "calls",
    "count_call",
    "forget_taps",
    "is_per_shard_mode",
    "join",
    "mark",
    "mark_gathered",
    "per_shard",
    "plain",
    "register",
    "register_tap",
]


class Parts:
    """The per-shard gradient parts of one gathered tensor, summed on this rank.

    ``since`` is the number of per-shard calls made before the gather (``calls``): where
    it is still that number, no per-shard function ran since, on any rank (every rank
    makes every call), so no rank has a part.
    """

    __slots__ = ("__weakref__", "grad", "since")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.since = _CALLS[0]

    def add(self, g: torch.Tensor) -> None:
        self.grad = g if self.grad is None else self.grad + g


_CALLS = [0]  # per-shard contexts entered so far in this process (``per_shard``), one per call on every rank


def calls() -> int:
    """How many per-shard contexts this process has entered (every rank enters one per call)."""
    return _CALLS[0]


_LIVE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_PARTS: dict[int, Parts] = {}
_KEYS: dict[int, int] = {}
_BY_KEY: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_COUNT = [0]  # gathers registered so far in this process


def register(t: torch.Tensor, parts: Parts) -> None:
    """Marks ``t`` (a gather's result on every rank) as a tensor whose per-shard uses are parts.

    The n-th registered tensor has key n here; ranks compare ages (``Usage.ages``), not
    keys, since one rank may have registered more in an earlier, failed program.
    """
    key, n = id(t), _COUNT[0]
    _COUNT[0] += 1
    _LIVE[key] = t
    _PARTS[key] = parts
    _KEYS[key] = n
    _BY_KEY[n] = t
    weakref.finalize(t, _forget, key)


def plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether none of ``tensors`` is gathered across processes or tapped.

    A per-shard function of them alone (closing over no tensor) then sees them as they are,
    and needs no context (``per_shard``). A call run so must still be counted (``count_call``).
    """
    return not any(id(t) in _LIVE_KEYS or id(t) in _TAPPED_KEYS for t in tensors)


def count_call() -> None:
    """Counts a per-shard call run without a context (``calls``), as ``per_shard`` counts one.

    Every rank counts every call alike, whichever way each ran it.
    """
    _CALLS[0] += 1


def _forget(key: int) -> None:
    _PARTS.pop(key, None)
    _KEYS.pop(key, None)


# Gathers' results in one process: they need no parts there (one process runs every use), but a
# per-shard function's use of one is a gathered use, not a closure, on every backend alike.
_GATHERED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_gathered(t: torch.Tensor) -> None:
    """Marks ``t``, a gather's result in one process, as gathered (not closed over) in per-shard functions."""
    _GATHERED[id(t)] = t


# Blocks whose first use in a per-shard function goes through a function of theirs (``register_tap``);
# the function is the block's own attribute, so it goes with the block.
_TAPPED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def register_tap(t: torch.Tensor, tap: Callable[[torch.Tensor], Mapping[int, torch.Tensor]]) -> None:
    """Makes per-shard functions use a view made by ``tap`` wherever they use ``t``, made at the first use.

    ``tap(t)`` returns the views of ``t`` and of the blocks tapped with it (those that share
    ``tap``), by ``id`` of the block: one autograd node for them all, which the function's
    later uses of those blocks reuse. Made there, the node is numbered among the function's
    own nodes, so the backward runs it as soon as the gradients of those blocks' uses are in,
    not after every node made later (the engine runs the ready node with the highest number
    first).
    """
    _TAPPED[id(t)] = t
    setattr(t, "_fshard_tap", tap)  # noqa: B010  # the block carries its tap: it goes when the block goes


def forget_taps(tensors: Collection[torch.Tensor]) -> None:
    """Later uses of ``tensors`` in per-shard functions go through no tap (their call is over)."""
    for t in tensors:
        if _TAPPED.get(id(t)) is t:
            del _TAPPED[id(t)]
            delattr(t, "_fshard_tap")


class Usage:
    """The keys of the gathered tensors that per-shard functions used."""

    __slots__ = ("closed", "keys")

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.closed = 0  # closed-over tensors given a summed gradient

    def ages(self) -> frozenset[int]:
        """The used tensors as ages: how many gathers were registered since each.

        Ranks agree on these as long as they gathered alike since then, even where an earlier
        program (a failed one, say) left their counts apart.
        """
        return frozenset(_COUNT[0] - n for n in self.keys)


def join(link: torch.Tensor, ages: set[int] | frozenset[int]) -> torch.Tensor:
    """``link`` (0 elements) joined to the gathered tensors of ``ages`` (``Usage.ages``) still alive here.

    A backward from it thus reaches their gathers' backward (and its collective) as on the
    other ranks.
    """
    for age in sorted(ages):
        t = _BY_KEY.get(_COUNT[0] - age)
        if t is not None:
            link = link + t.reshape(-1)[:0].to(link.dtype)
    return link


class _SetAside(torch.autograd.Function):
    """Identity forward; backward adds the gradient to ``parts`` and passes nothing on."""

    @staticmethod
    def forward(parts: Parts, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.parts = inputs[0]

    @staticmethod
    @opaque  # autograd calls it back, TorchDynamo's hook still on
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        ctx.parts.add(grad_outputs[0])
        return None, None


# The tables' own dicts (a WeakValueDictionary keeps its entries in ``data``): a key in them, tested in C.
_TAPPED_KEYS: Container[int] = cast(Any, _TAPPED).data
_LIVE_KEYS: Container[int] = cast(Any, _LIVE).data
_GATHERED_KEYS: Container[int] = cast(Any, _GATHERED).data


class _PerShard(TorchFunctionMode):
    """Replaces gathered and closed-over tensors by views in every torch call (one view per tensor)."""

    def __init__(
        self,
        usage: Usage | None,
        closed: Callable[[torch.Tensor], torch.Tensor] | None,
        own: Collection[int],
        since: int,
        across: bool = True,
    ) -> None:
        super().__init__()
        self.across = across  # a multi-process backend's calls: in one process only closed-over tensors are counted
        self.views: dict[int, torch.Tensor] = {}
        self.usage = usage
        self.closed, self.own, self.since = closed, own, since
        # The torch.func level the function was called at: a tensor of a deeper level was made by a
        # transform inside it (the leaf that torch.func.grad differentiates), not closed over.
        level = _functorch.maybe_current_level()
        self.level: int = -1 if level is None else int(level)

    @never_compiled
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # No gradient recorded (no_grad, inference, a reentrant checkpoint's forward): nothing to tap or set
        # aside, and a view made here would serve later uses.
        if torch.compiler.is_compiling():
            # (In one process a compiled body's uses are not counted.) Only a tensor that needs a gradient is
            # swapped: the call is traced where none does.
            if self.across and torch.is_grad_enabled() and (_needs_grad(args) or _needs_grad(kwargs)):
                # Swapped eagerly, a graph break: traced, the tables' lookups by id() would guard on each
                # tensor's identity, and the next step's tensors would trace the body again.
                args, kwargs = _swapped_eagerly(self, args, kwargs)
            # TorchDynamo traces a direct call (a call of func through a helper here, after a graph break,
            # is traced wrongly by torch 2.13).
            return func(*args, **(kwargs or {}))
        given = args
        if _grad_enabled():
            if not _gradient_free(func):
                args = self._swapped(args)
                if kwargs:
                    kwargs = {k: self._swap_any(v) for k, v in kwargs.items()}
        elif self.closed is not None:  # not recorded here, though the function records: what will record it later?
            self._refuse_unsummed(args, kwargs)
        kwargs = kwargs or {}
        # The in-place check set aside where the call writes nothing.
        out = _readonly.call_if_pure(func, types, args, kwargs, given)
        return func(*args, **kwargs) if out is _readonly.IMPURE else out

    @never_compiled
    def _swapped(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with their tensors swapped (``_swap_any``), the tuple itself where none is.

        Run for every torch call of the function, so in one loop: a tensor that is in no table
        and needs no closed view (most of a body's tensors) costs a few lookups, no call.
        """
        views, closed, own, since = self.views, self.closed, self.own, self.since
        new: list[Any] | None = None
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                key = id(a)
                view = views.get(key)
                if view is None:  # _swap's three cases, tested here without a call (it tests them again, exactly)
                    if not (
                        key in _TAPPED_KEYS
                        or key in _LIVE_KEYS
                        or (
                            closed is not None
                            and a.requires_grad
                            and key not in own
                            and ((node := a.grad_fn) is None or node._sequence_nr() < since)  # pyright: ignore[reportPrivateUsage]  # older than the call
                        )
                    ):
                        continue
                    view = self._swap(a)
            elif isinstance(a, (list, tuple, dict)) and not _ints(a):
                view = self._swap_any(a)
            else:
                continue
            if view is not a:
                if new is None:
                    new = list(args)
                new[i] = view
        return args if new is None else tuple(new)

    @never_compiled
    def _refuse_unsummed(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        """Raises where a tensor whose gradient must sum over the ranks is used where no view of it can be.

        A torch call that records nothing inside a function that records: under ``no_grad`` (nothing
        to sum), or in the forward of a custom ``torch.autograd.Function`` or of a reentrant
        ``torch.utils.checkpoint``, whose backward gives the tensor its gradient with no sum over
        the ranks (the Function's node holds the tensor itself; the checkpoint's recomputation runs
        in the backward, outside the function). So it is refused there, on every backend alike.
        """
        for a in (*args, *(kwargs or {}).values()):
            for t in cast("Sequence[Any]", a) if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and self._unsummed(t):
                    where = _recorded_later(t)
                    if where is not None:
                        raise SpecError(_unsummed_message(t, where))

    @never_compiled
    def _unsummed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a gathered or closed-over tensor whose gradient sums over the ranks (as ``_swap`` finds).

        A tensor gathered in one process (not live) counts as closed over here: its uses sum there.
        """
        key = id(x)
        if key in _LIVE_KEYS and _LIVE.get(key) is x:
            return True
        return key not in _TAPPED_KEYS and self._from_outside(x, key)

    @never_compiled
    def _from_outside(self, x: torch.Tensor, key: int) -> bool:
        """Whether ``x`` (of id ``key``) needs a gradient and comes from outside the function.

        No argument block, made before the call (an older autograd node, or none), at the
        function's ``torch.func`` level or an outer one.
        """
        return (
            x.requires_grad
            and key not in self.own
            and ((node := x.grad_fn) is None or node._sequence_nr() < self.since)  # pyright: ignore[reportPrivateUsage]  # older than the call
            and _functorch.maybe_get_level(x) <= self.level
        )

    @never_compiled
    def _swap_any(self, x: Any) -> Any:
        """``x`` with its tensors swapped: directly for a tensor (most arguments), through its pytree else."""
        if isinstance(x, torch.Tensor):
            seen = self.views.get(id(x))
            return seen if seen is not None else self._swap(x)
        if isinstance(x, (list, tuple, dict)):
            return optree.tree_map(self._swap_leaf, cast(Any, x), none_is_leaf=True)
        return x

    @never_compiled
    def _swap_leaf(self, x: Any) -> Any:
        """A pytree leaf swapped where it is a tensor (a leaf may be a tuple subclass, as ``torch.Size``)."""
        if isinstance(x, torch.Tensor):
            seen = self.views.get(id(x))
            return seen if seen is not None else self._swap(x)
        return x

    @never_compiled
    def _swap(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s view where it is tapped, gathered or closed over (made at its first use), else ``x``."""
        key = id(x)
        # Most tensors of a body are in none of the tables: a lookup in each table's own dict (in C)
        # says so before a WeakValueDictionary.get (in Python) would.
        # This mode is off while it handles a call: apply() is not intercepted.
        if key in _TAPPED_KEYS and _TAPPED.get(key) is x:
            tap = cast("Callable[[torch.Tensor], Mapping[int, torch.Tensor]]", getattr(x, "_fshard_tap"))  # noqa: B009  # set by register_tap
            tapped = _readonly.unchecked(tap, x)  # views that fshard makes: no op of theirs writes
            self.views.update(tapped)  # the blocks tapped with x: their first uses find their views here
            return tapped[key]
        elif key in _LIVE_KEYS and _LIVE.get(key) is x:
            view = cast("torch.Tensor", apply(_SetAside, _PARTS[key], x))
            if self.usage is not None:
                self.usage.keys.add(_KEYS[key])
        elif (
            self.closed is not None
            and self._from_outside(x, key)
            and not (key in _GATHERED_KEYS and _GATHERED.get(key) is x)
        ):
            view = self.closed(x)
            if self.usage is not None:
                self.usage.closed += 1
        else:
            return x
        self.views[key] = view
        return view


def _recorded_later(x: torch.Tensor) -> str | None:
    """The custom Function whose forward takes ``x`` as an input and records, or the reentrant checkpoint, running now.

    ``None`` where neither is (a ``no_grad`` block, a Function applied under ``no_grad`` or
    inside another's forward, whose node records nothing). Read from the call stack: a
    Function's forward runs from ``Function.apply``, whose ``args`` hold its inputs, and its
    ``ctx`` (where its forward takes one) has edges only where it records. Functions of torch's
    own compiled graphs (TorchDynamo's, AOTAutograd's) are not the caller's: skipped.
    """
    checkpoint = sys.modules.get("torch.utils.checkpoint")  # not imported: no checkpoint runs
    reentrant = getattr(checkpoint, "CheckpointFunction", None)
    reentrant_code = reentrant.forward.__code__ if reentrant is not None else None
    frame, inner = sys._getframe(1), None  # pyright: ignore[reportPrivateUsage]  # the one way to read the call stack
    while frame is not None:
        if frame.f_code is reentrant_code and _records(frame.f_locals.get("ctx")):
            return "checkpoint"
        if frame.f_code is _APPLY:
            cls, found = frame.f_locals.get("cls"), frame.f_locals
            inputs = (*found.get("args", ()), *found.get("kwargs", {}).values())
            ctx = inner.f_locals.get("ctx") if inner is not None else None  # the forward's frame is the one inside
            if (
                any(a is x for a in inputs)
                and not getattr(cls, "__module__", "").startswith("torch._")  # a compiled graph's, not the caller's
                and _records(ctx)
            ):
                return getattr(cls, "__qualname__", "a custom Function")
        frame, inner = frame.f_back, frame
    return None


def _records(ctx: Any) -> bool:
    """Whether a Function's ``ctx`` records (it has an edge: an input that requires grad, with grad enabled).

    ``True`` where there is no ctx: a forward of ``setup_context``'s kind takes none, and
    whether its node records is not known inside it.
    """
    edges = getattr(ctx, "next_functions", None)
    return edges is None or any(node is not None for node, _ in edges)


_APPLY = vars(torch.autograd.Function)["apply"].__func__.__code__  # a custom Function's apply (a classmethod)


def _unsummed_message(x: torch.Tensor, where: str) -> str:
    what = f"a tensor of shape {tuple(x.shape)} from outside the function's arguments that requires grad"
    if where == "checkpoint":
        return (
            f"A per-shard function (shard_map's or map_local's fn) used {what} inside torch.utils.checkpoint with "
            "use_reentrant=True (torch's default where use_reentrant is not given): its backward recomputes "
            "outside the function, where the tensor's gradient cannot sum over the ranks. Pass use_reentrant=False "
            "to checkpoint(), or checkpoint the whole shard_map call."
        )
    return (
        f"A per-shard function (shard_map's or map_local's fn) passed {what} to custom autograd Function {where}: "
        "its backward gives the tensor a gradient that cannot sum over the ranks (the Function's node holds the "
        "tensor itself). Pass the tensor to shard_map as an argument (a Replicated in_spec), or pass the Function "
        "a view of it made in the function (w.view_as(w)), whose gradient sums; where the Function runs under "
        "torch.no_grad(), pass it w.detach()."
    )


def _needs_grad(x: Any) -> bool:
    """Whether a tensor in ``x`` (a tensor, or a list, tuple or dict of them, nested) requires a gradient."""
    if isinstance(x, torch.Tensor):
        return x.requires_grad
    if isinstance(x, dict):
        x = list(cast("dict[Any, Any]", x).values())
    if isinstance(x, (list, tuple)):
        for v in cast("Sequence[Any]", x):
            if _needs_grad(v):
                return True
    return False


@opaque
def _swapped_eagerly(
    mode: _PerShard, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """A compiled function's torch call's ``args`` and ``kwargs`` swapped by ``mode``, run eagerly."""
    return mode._swapped(args), None if not kwargs else {k: mode._swap_any(v) for k, v in kwargs.items()}  # pyright: ignore[reportPrivateUsage]


_grad_enabled = torch.is_grad_enabled

# Calls whose result carries no gradient to their tensor arguments: a closed-over tensor used only
# through them (w.detach(), w.shape[0], w.tolist()) needs no summed gradient, so it is not taken for one.
_GRADIENT_FREE: frozenset[Any] = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "detach", "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
        "is_floating_point", "is_complex", "data_ptr", "item", "tolist", "__len__", "__bool__", "__index__",
        "__int__", "__float__", "get_device",
    )
)  # fmt: skip
_GRADIENT_FREE_ATTRIBUTES = frozenset((
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda", "names",
    "grad", "data", "itemsize", "nbytes", "is_sparse", "is_quantized", "is_meta", "_version",
))  # fmt: skip


def _gradient_free(func: Any) -> bool:
    """Whether a torch call of ``func`` gives its tensor arguments no gradient (``_GRADIENT_FREE``, attribute reads)."""
    if func in _GRADIENT_FREE:
        return True
    return (
        type(func) is types.MethodWrapperType
        and func.__name__ == "__get__"
        and getattr(func.__self__, "__name__", None) in _GRADIENT_FREE_ATTRIBUTES
    )


_functorch: Any = getattr(torch._C, "_functorch")  # pyright: ignore[reportPrivateUsage]  # noqa: B009  # torch's functorch bindings, untyped


def _ints(x: Any) -> bool:
    """Whether ``x`` is a list or tuple of ints only (a shape, dims): no tensor to swap in it."""
    return type(x) in (list, tuple) and all(type(v) is int for v in x)


def is_per_shard_mode(mode: Any) -> bool:
    """Whether ``mode`` is the mode of ``per_shard`` (a thread that runs a body enters its own)."""
    return isinstance(mode, _PerShard)


def mark() -> int:
    """The number of the next autograd node made on this thread (nodes are numbered in order)."""
    probe = torch.empty(0, requires_grad=True).view(0).grad_fn
    assert probe is not None  # a view of a tensor that requires grad has a node
    return probe._sequence_nr() + 1  # pyright: ignore[reportPrivateUsage]


@contextlib.contextmanager
def per_shard(
    backend: Any,
    usage: Usage | None = None,
    closed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    own: Collection[torch.Tensor] = (),
) -> Generator[None, None, None]:
    """The context of a per-shard function whose arguments are ``own``.

    On a multi-process backend, uses of gathered tensors become parts of their gradients
    (their keys are added to ``usage``); and, when gradients are recorded and ``closed`` is
    given, every tensor from outside the arguments that needs a gradient is passed through
    ``closed`` (counted in ``usage``).
    """
    _CALLS[0] += 1
    closed = closed if closed is not None and torch.is_grad_enabled() else None
    if not ((backend.spans_processes and (_LIVE or _TAPPED)) or closed is not None):
        with _readonly.front():  # in front of the in-place check: the calls that cannot write pass it
            yield
        return
    since = _readonly.unchecked(mark) if closed is not None else 0  # its probe writes into nothing
    with _PerShard(usage, closed, {id(t) for t in own}, since, backend.spans_processes):
        try:
            yield
        except Exception as exc:
            if backend.spans_processes and _traced_here(exc):
                raise SpecError(_FULLGRAPH) from exc
            raise


_FULLGRAPH = (
    "torch.compile(fn, fullgraph=True) of a per-shard function (shard_map's or map_local's fn) cannot run across "
    "processes while a gradient is recorded: fshard's per-shard mode runs in each of the function's torch calls "
    "(it makes the gradients of replicated arguments, gathered tensors and closed-over tensors sum over the "
    "ranks), and TorchDynamo cannot trace it into one graph. Compile the function without fullgraph=True "
    "(TorchDynamo runs the mode between graphs), compile the whole step instead, or call it under "
    "torch.no_grad()."
)


def _traced_here(exc: Exception) -> bool:
    """Whether ``exc`` is TorchDynamo refusing to trace this module's mode (a compiled function with fullgraph)."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    if dynamo is None or not isinstance(exc, dynamo.Unsupported):
        return False
    return any(frame.filename == __file__ for frame in getattr(exc, "real_stack", None) or ())
