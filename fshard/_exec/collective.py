"""Public functions as calls that the ranks agree on, in check mode.

``collective(name)`` marks a public function. Outside check mode it adds one
attribute read. In check mode on a multi-process backend, the outermost such call
names every check its collectives make (``reshard(a: ..., spec: Chunk(...))``,
not just ``exchange``), and when it ends, the ranks run one more check on how it
ended: returned, or raised (and with what). So

- a rank that raises before it reaches a collective (a bad argument on that rank
  only) makes every other rank raise its error, at their next check, instead of
  waiting in a collective forever;
- a rank that skips a collective, or does nothing where the others move data (a
  reshard to the layout it already has), meets the others' checks with a different
  call: every rank raises ``CollectiveMismatchError``.

Arguments that legitimately differ per rank (each rank's own shards or tensor) are
named in ``local`` and described as such.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

import optree
import torch

from fshard import _config
from fshard._array.array import ShardedArray
from fshard._base.calls import call_name, calling, refuse_in_block_function
from fshard._base.compile import opaque
from fshard._layout.layout import Layout
from fshard._layout.show import describe_layout
from fshard.backends import default_backend, for_group

__all__ = ["collective", "describe"]

F = TypeVar("F", bound=Callable[..., Any])


def collective(name: str, local: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Marks ``fn`` as the public function ``name`` whose calls the ranks agree on in check mode.

    The call is also ``opaque``: under ``torch.compile`` it is a graph break and runs eagerly
    (``fshard._base.compile``), so every public function is a boundary of the compiled graph.
    """

    def mark(fn: F) -> F:
        # Read in check mode only: made at the first such call, not here (shard_map makes a
        # collective function at every call of it, and apply_module calls shard_map each time).
        signature = functools.cache(functools.partial(inspect.signature, fn))

        public = name.partition("[")[0]  # shard_map[fn]: shard_map

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            refuse_in_block_function(f"{public}() was called")
            if not _config._current.check_collectives or call_name() is not None:  # pyright: ignore[reportPrivateUsage]  # one attribute read, not a call
                return fn(*args, **kwargs)
            backend = _backend_of(args, kwargs)
            settle = getattr(backend, "settle", None)  # a backend of one process has nothing to agree on
            if settle is None or not backend.spans_processes or not getattr(backend, "member", True):
                return fn(*args, **kwargs)
            what = _describe_call(name, signature(), args, kwargs, local)
            try:
                with calling(what):
                    out = fn(*args, **kwargs)
            except BaseException as exc:
                # An interrupt that the other ranks learned of (``fshard._exec.agree``) is settled like an
                # error, since they settle too; any other interrupt (Ctrl-C) stops this rank at once.
                if isinstance(exc, Exception) or getattr(exc, "_fshard_posted", False):
                    settle(f"{what} raised", exc)
                raise
            settle(f"{what} returned")
            return out

        return opaque(call)  # type: ignore[return-value]

    return mark


def _backend_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The backend a call runs on: its first array's, or its ``backend``/``group`` argument, or the default."""
    call: Any = (args, kwargs)  # a pytree (optree's PyTree type does not spell out tuples of them)
    for leaf in optree.tree_leaves(call, is_leaf=lambda x: isinstance(x, ShardedArray)):
        if isinstance(leaf, ShardedArray):
            return leaf.backend
    if kwargs.get("backend") is not None:
        return kwargs["backend"]
    if kwargs.get("group") is not None:
        return for_group(kwargs["group"])
    try:
        return default_backend()
    except RuntimeError:
        return None


def _describe_call(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any], local: tuple[str, ...]
) -> str:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return f"{name}(<arguments that do not fit its signature>)"
    parts: list[str] = []
    for key, value in bound.arguments.items():
        if key in ("backend", "group"):
            continue
        kind = signature.parameters[key].kind
        shown = "<this rank's own>" if key in local else describe(value)
        if kind is inspect.Parameter.VAR_POSITIONAL:
            parts.append(", ".join(describe(v) for v in value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            parts.extend(f"{k}={describe(v)}" for k, v in value.items())
        else:
            parts.append(f"{key}={shown}")
    return f"{name}({', '.join(p for p in parts if p)})"


def describe(x: Any, depth: int = 0) -> str:
    """A description of an argument that is the same on every rank exactly when it should be."""
    if isinstance(x, ShardedArray):
        return f"array[{x.dtype}, {describe_layout(x.layout)}]"
    if isinstance(x, Layout):
        return describe_layout(x)
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}:{x.dtype}"
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return repr(x)
    if depth > 3:
        return type(x).__name__
    if isinstance(x, (list, tuple)):
        seq = cast("list[Any] | tuple[Any, ...]", x)
        items = [describe(v, depth + 1) for v in seq[:8]]
        more = f", ... {len(seq) - 8} more" if len(seq) > 8 else ""
        return f"{type(seq).__name__}[{', '.join(items)}{more}]"
    if isinstance(x, dict):
        mapping = cast("dict[Any, Any]", x)
        items = [f"{k!r}: {describe(v, depth + 1)}" for k, v in list(mapping.items())[:8]]
        return "{" + ", ".join(items) + (", ..." if len(mapping) > 8 else "") + "}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return repr(x)
    if callable(x):
        return getattr(x, "__qualname__", type(x).__name__)
    text = repr(x)
    return type(x).__name__ if " at 0x" in text else text
