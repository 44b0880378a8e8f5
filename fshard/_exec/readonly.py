"""Input blocks that a per-block function may read but not write.

``map_local`` and ``shard_map`` hand a user function the blocks of immutable arrays.
While it runs, a torch-dispatch mode reads the schema of every aten op it calls: an op
that writes into an argument (``Tensor(a!)`` in its schema, ``out=`` included) whose
memory is that of an input block is refused with ``SpecError`` before it runs, so the
array keeps its values. Writes into tensors the function made itself go through.

The mode sees the ops that reach the dispatcher one by one, at a Python call per op (about
15 us: some 3 ms of a small transformer's forward). So a torch-function mode stands in
front of it: ``gathered``'s per-shard mode where that runs (across processes while
gradients are recorded), else ``front``'s. That mode runs the calls that cannot write into
any argument (``pure``) with the dispatch mode set aside (``unchecked``): a fixed list of
torch's functions and tensor methods whose aten ops write into no argument (``_PURE``), a
few functionals that write only when asked to, by name or by position (``F.relu(t, inplace=True)``,
``F.embedding(..., max_norm=1)``: ``_PURE_UNLESS``), and attribute reads. Every other call
(one given ``out=``, an in-place method, a tensor subclass's), and all code the
torch-function mode does not see (a storage's methods, ``Tensor.set_``, TorchScript, a
custom autograd Function's own ``apply``), runs under the dispatch mode, so a write into an
input block is refused as it is without the torch-function mode. Python code that a call
let through runs itself (an index object's ``__index__``, a saved-tensor hook) runs with the
check aside too: a write there is caught by the version-counter check after the function,
after the fact.

While TorchDynamo traces
``map_local`` itself (``torch.compiler.is_compiling()``) it is not entered: a dispatch
mode cannot be traced. While TorchDynamo compiles a body called under it, it stands aside
(``ignore_compile_internals``), and it is on again while the compiled code runs, which
checks the ops that code dispatches but not the writes inside an Inductor kernel. The
caller's version-counter check after the function catches those, after the fact.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fshard._base.compile import opaque
from fshard._errors import SpecError

__all__ = ["IMPURE", "call_if_pure", "front", "pure", "read_only", "unchecked", "versions", "wrote_into"]

T = TypeVar("T")

# torch's functorch bindings, which have no stub and no public form.
_functorch: Any = getattr(torch._C, "_functorch")  # pyright: ignore[reportPrivateUsage]  # noqa: B009

# Per op, the (position, name) of each argument its schema marks as written: a pure fact of
# the op's schema, kept for the ops a program calls (a few hundred at most).
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The arguments that ``func`` writes into, by position and name (none for a higher-order op)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def _storage(t: torch.Tensor) -> int | None:
    """An id of the memory that ``t`` views, shared by all its views; ``None`` where it has none."""
    while _functorch.is_functorch_wrapped_tensor(t):  # vmap/grad: the tensor they wrap
        t = _functorch.get_unwrapped(t)
    try:
        storage: Any = t.untyped_storage()  # pyright: ignore[reportUnknownMemberType]  # torch's stub: partly unknown
        return int(storage._cdata)
    except (NotImplementedError, RuntimeError):  # a sparse or subclass tensor without one storage
        return None


class _ReadOnly(TorchDispatchMode):
    """Refuses any aten op that would write into memory of the given storages."""

    supports_higher_order_operators = True  # passed through: their inner ops run without this mode

    def __init__(self, storages: frozenset[int], what: str, blocks: frozenset[int] = frozenset()) -> None:
        super().__init__()  # pyright: ignore[reportUnknownMemberType]  # torch leaves its argument untyped
        self.storages = storages
        self.what = what
        self.blocks = blocks  # the input tensors themselves, by id (alive while the function runs)

    @property
    def block_function(self) -> str:
        """The per-block function whose ``fn`` runs under this check (``fshard._base.calls.block_function``)."""
        return self.what

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while TorchDynamo compiles a body, on while the compiled code runs."""
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` around ``__torch_dispatch__``: it is ``opaque`` instead.

        Both keep TorchDynamo out of the frame; torch's wrapper costs about as much per op as
        the check itself (the mode sees every aten op of a body), ``opaque`` a dictionary lookup
        where TorchDynamo is not loaded and two calls of torch's frame hook where it is.
        """
        return False

    @opaque
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        written = _WRITTEN.get(func)
        if written is None:
            written = _WRITTEN[func] = _written(func)
        for position, name in written:  # most ops write nothing: no loop, no lookups
            value = args[position] if position < len(args) else kwargs.get(name) if kwargs else None
            if self._aliases_input(value):
                self._refuse(func, name, value)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _aliases_input(self, value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return _storage(value) in self.storages
        if isinstance(value, (list, tuple)):  # Tensor(a!)[]: the _foreach_ ops
            return any(self._aliases_input(v) for v in value)  # pyright: ignore[reportUnknownVariableType]
        return False

    def _refuse(self, func: Any, name: str, value: Any) -> None:
        schema = func._schema
        op = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        msg = (
            f"{self.what} fn called {op}, which writes into its argument {name!r} in place, and that "
            "argument is (a view of) an input block. ShardedArray values are immutable, and other arrays "
            "and tensors may share that memory: the write was refused before it ran, so the input is "
            "unchanged. Return a new tensor instead (t * 10, not t.mul_(10); no out= into an input), "
            "or write into a tensor fn makes itself (y = t.clone(); y.mul_(10))."
        )
        error = SpecError(msg)
        error._fshard_written = value  # type: ignore[attr-defined]  # what a caller may name better (wrote_into)
        raise error


def wrote_into(error: BaseException, t: torch.Tensor) -> bool:
    """Whether ``error`` is the in-place check's refusal of a write into the memory of ``t``."""
    value: Any = getattr(error, "_fshard_written", None)
    values = cast("Sequence[Any]", value if isinstance(value, (list, tuple)) else (value,))
    target = _storage(t)
    return any(isinstance(v, torch.Tensor) and _storage(v) == target for v in values)


# Calls that write into none of their arguments: each of their aten ops has no argument that its
# schema marks as written but ``out`` (and a call given ``out=`` is never let through). Methods
# by name on ``torch.Tensor``; tests/test_inplace.py checks every one against torch's schemas.
_PURE_METHODS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__neg__", "__pow__", "__getitem__", "add", "sub", "mul", "div", "matmul",
    "pow", "neg", "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "abs", "sum", "mean", "amax", "softmax",
    "log_softmax", "masked_fill", "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t",
    "flatten", "unflatten", "unbind", "split", "chunk", "squeeze", "unsqueeze", "expand", "expand_as",
    "contiguous", "narrow", "select", "dim", "size", "numel", "float", "to", "type_as", "clone", "detach",
)  # fmt: skip
_PURE_FUNCTIONS = (
    torch.arange, torch.cat, torch.stack, torch.matmul, torch.bmm, torch.tanh, torch.exp, torch.softmax,
    torch.layer_norm, torch.embedding, torch.where, torch.zeros, torch.ones, torch.empty, torch.zeros_like,
    torch.ones_like, torch.empty_like, torch.full, F.linear, F.gelu, F.scaled_dot_product_attention,
    F.layer_norm, F.cross_entropy, F.softmax, F.log_softmax, F.mse_loss,
)  # fmt: skip
_PURE: frozenset[Any] = frozenset([*(getattr(torch.Tensor, name) for name in _PURE_METHODS), *_PURE_FUNCTIONS])
# Functionals that write into an argument only when asked: the position and name of that argument.
_PURE_UNLESS: dict[Any, tuple[int, str]] = {
    F.embedding: (3, "max_norm"),  # renormalizes the weight in place
    F.dropout: (3, "inplace"),
    F.relu: (1, "inplace"),
    F.silu: (1, "inplace"),
}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN = frozenset(_PLAIN_TYPES)


def pure(func: Any, kinds: Any, args: Any, kwargs: Any) -> bool:
    """Whether the call ``func(*args, **kwargs)`` (its arguments of types ``kinds``) writes into no argument."""
    try:
        plain = _PLAIN.issuperset(kinds)
    except TypeError:  # a type that cannot be hashed (its metaclass's doing): compared one by one
        plain = all(k in _PLAIN_TYPES for k in kinds)
    if not plain or "out" in kwargs:  # a subclass's own handler: not ours to judge
        return False
    if func in _PURE:
        return True
    unless = _PURE_UNLESS.get(func)
    if unless is not None:
        position, name = unless
        asked = args[position] if len(args) > position else kwargs.get(name)
        return asked is None or asked is False  # max_norm=0.0 renormalizes too
    return isinstance(func, types.MethodWrapperType) and func.__name__ == "__get__"  # an attribute read


@opaque  # TorchDynamo traces a call made through here wrongly after a graph break (torch 2.13): run it eagerly
def unchecked(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with the in-place check's dispatch mode off the stack, where it is the innermost mode.

    For calls that write into no argument (``pure``) and fshard's own views of the blocks.
    Where another mode was entered above the check, or TorchDynamo traces, ``fn`` runs as it is.
    """
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    return _unchecked(fn, args, kwargs)


IMPURE: Any = object()  # what call_if_pure returns for a call it did not make


@opaque  # as unchecked
def call_if_pure(func: Any, kinds: Any, args: Any, kwargs: Any, given: Any = None) -> Any:
    """``unchecked(func, *args, **kwargs)`` where the call is ``pure``, else ``IMPURE``: not called.

    One call for the two, made for every torch call of a per-shard function: not while TorchDynamo traces.
    ``given``: the arguments as the function passed them, where a mode put views in their place
    (a change of an input block's autograd facts is refused by the block, not by its view).
    """
    if not pure(func, kinds, args, kwargs):
        target = (args if given is None else given)[:1]
        if target and _changes_autograd(func):
            _refuse_autograd(func, target[0])
        return IMPURE
    return _unchecked(func, args, kwargs)


def _changes_autograd(func: Any) -> bool:
    """Whether ``func`` sets a tensor's own autograd facts (no aten op, which the dispatch mode would see)."""
    if func is torch.Tensor.requires_grad_:
        return True
    return (
        isinstance(func, types.MethodWrapperType)
        and func.__name__ == "__set__"
        and getattr(func.__self__, "__name__", None) in ("requires_grad", "data", "grad")
    )


def _refuse_autograd(func: Any, target: Any) -> None:
    """Raises ``SpecError`` where ``target`` is an input block of the per-block function running now."""
    if not isinstance(target, torch.Tensor):
        return
    for i in range(_depth()):
        mode = _mode_at(i)
        if type(mode) is _ReadOnly and id(target) in mode.blocks:
            setter = "" if func is torch.Tensor.requires_grad_ else func.__self__.__name__
            name = f"the setter of .{setter}" if setter else "requires_grad_()"
            msg = (
                f"{mode.what} fn called {name} on an input block: ShardedArray values are immutable, and the block "
                "is the array's own tensor, which would keep the change. Use a tensor fn makes itself instead "
                "(t.detach().requires_grad_(), or pass arrays whose blocks require grad)."
            )
            raise SpecError(msg)


@contextlib.contextmanager
def front() -> Generator[None, None, None]:
    """A torch-function mode in front of the in-place check, where the check is the innermost mode.

    It runs the calls that cannot write (``pure``) with the check set aside, and lets every
    other call, and all code it does not see, meet the check as before.
    """
    depth = _depth()
    if torch.compiler.is_compiling() or not depth or type(_mode_at(depth - 1)) is not _ReadOnly:
        yield
        return
    with _Front():
        yield


class _Front(TorchFunctionMode):
    """Runs a call that cannot write (``pure``) with the in-place check set aside (``call_if_pure``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # TorchDynamo traces a direct call (through a helper, after a graph break, torch 2.13 traces it wrongly).
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        out = call_if_pure(func, types, args, kwargs)
        return func(*args, **kwargs) if out is IMPURE else out


def _unchecked(fn: Callable[..., T], args: Any, kwargs: Any) -> T:
    depth = _depth()
    if not depth or type(_mode_at(depth - 1)) is not _ReadOnly:
        return fn(*args, **kwargs)
    mode = None
    try:
        mode = _pop(None)
        return fn(*args, **kwargs)
    finally:
        if mode is not None:
            _push(mode)


# torch's stack of dispatch modes (the C functions behind torch.utils._python_dispatch's helpers).
_C: Any = torch._C  # pyright: ignore[reportPrivateUsage]
_depth, _mode_at = _C._len_torch_dispatch_stack, _C._get_dispatch_stack_at
_pop, _push = _C._pop_torch_dispatch_stack, _C._push_on_torch_dispatch_stack


def read_only(tensors: Sequence[torch.Tensor], what: str) -> contextlib.AbstractContextManager[Any]:
    """A context in which every aten op that would write into ``tensors`` raises ``SpecError`` instead.

    A write into a view of one of them, or into any tensor that shares its memory, is
    refused too; writes into other tensors go through. Inert while TorchDynamo traces.

    >>> import torch
    >>> t = torch.ones(2)
    >>> with read_only([t], "example"):
    ...     y = t * 2
    ...     _ = y.add_(1)  # a tensor made here: fine
    ...     t.add_(1)
    Traceback (most recent call last):
    ...
    fshard.SpecError: example fn called aten::add_.Tensor, which writes into its argument 'self' in place, ...
    >>> t
    tensor([1., 1.])
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _mode(tensors, what)


def versions(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (an in-place write bumps one); -1 for an inference tensor, which has none.

    Outside inference mode torch refuses any in-place write into an inference tensor; inside
    it, the read-only mode refuses it before it runs.
    """
    tensors = list(tensors)
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # "Inference tensors do not track version counter"
        return [-1 if t.is_inference() else t._version for t in tensors]


@opaque  # where TorchDynamo runs map_local's frame eagerly, it would still trace this call
def _mode(tensors: Sequence[torch.Tensor], what: str) -> _ReadOnly:
    storages = frozenset(s for s in map(_storage, tensors) if s is not None)
    return _ReadOnly(storages, what, frozenset(map(id, tensors)))
