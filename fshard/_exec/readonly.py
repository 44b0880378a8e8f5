"""Input blocks that a per-block function may read but not write.

``map_local`` and ``shard_map`` hand a user function the blocks of immutable arrays.
While it runs, a torch-dispatch mode reads the schema of every aten op it calls: an op
that writes into an argument (``Tensor(a!)`` in its schema, ``out=`` included) whose
memory is that of an input block is refused with ``SpecError`` before it runs, so the
array keeps its values. Writes into tensors the function made itself go through.

The mode sees the ops that reach the dispatcher one by one. While TorchDynamo traces
``map_local`` itself (``torch.compiler.is_compiling()``) it is not entered: a dispatch
mode cannot be traced. While TorchDynamo compiles a body called under it, it stands aside
(``ignore_compile_internals``), and it is on again while the compiled code runs, which
checks the ops that code dispatches but not the writes inside an Inductor kernel. The
caller's version-counter check after the function catches those, after the fact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fshard._base.compile import opaque
from fshard._errors import SpecError

__all__ = ["read_only"]

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

    def __init__(self, storages: frozenset[int], what: str) -> None:
        super().__init__()  # pyright: ignore[reportUnknownMemberType]  # torch leaves its argument untyped
        self.storages = storages
        self.what = what

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
                self._refuse(func, name)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _aliases_input(self, value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return _storage(value) in self.storages
        if isinstance(value, (list, tuple)):  # Tensor(a!)[]: the _foreach_ ops
            return any(self._aliases_input(v) for v in value)  # pyright: ignore[reportUnknownVariableType]
        return False

    def _refuse(self, func: Any, name: str) -> None:
        schema = func._schema
        op = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        msg = (
            f"{self.what} fn called {op}, which writes into its argument {name!r} in place, and that "
            "argument is (a view of) an input block. ShardedArray values are immutable, and other arrays "
            "and tensors may share that memory: the write was refused before it ran, so the input is "
            "unchanged. Return a new tensor instead (t * 10, not t.mul_(10); no out= into an input), "
            "or write into a tensor fn makes itself (y = t.clone(); y.mul_(10))."
        )
        raise SpecError(msg)


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


@opaque  # where TorchDynamo runs map_local's frame eagerly, it would still trace this call
def _mode(tensors: Sequence[torch.Tensor], what: str) -> _ReadOnly:
    return _ReadOnly(frozenset(s for s in map(_storage, tensors) if s is not None), what)
