"""The ``torch.compile`` boundary: fshard's own code runs eagerly, the functions it is handed compile.

Layouts, plans and collectives are cached numpy code and process-group calls, a few
Python calls per step, that TorchDynamo cannot trace and need not. Every public
function (``fshard._exec.collective.collective`` applies ``opaque``) and every
``backward`` that autograd calls back into is ``opaque``:

- while TorchDynamo traces a step, a call to it is a graph break (the
  ``_torchdynamo_disable`` mark, read without running any code of ours);
- while the compiled step runs, the call runs with TorchDynamo off, in its frame and
  every frame below it, as under ``torch.compiler.disable``;
- except the per-block functions it was handed (``map_local``'s and ``shard_map``'s
  ``fn``, marked ``body``): TorchDynamo is on again while they run, with the hook of
  the compiled caller (its backend, options and cache), so the computation on the
  blocks is compiled where the step around it is.

Nothing here imports TorchDynamo (about 75 MiB and a second): the frame-evaluation hook
is read and set through torch's C module, as ``torch.compiler.disable`` does, and only
once TorchDynamo is loaded (before that nothing can be compiling).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["body", "compiled_caller", "never_compiled", "opaque", "unwrapped", "with_body"]

F = TypeVar("F", bound=Callable[..., Any])

# torch's frame-evaluation hook (TorchDynamo's entry), a C module without a public form.
_frames: Any = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)  # pyright: ignore[reportPrivateUsage]


# The frame hook that is on (None: none), where torch has the getter; else a value that is never None.
_hook: Any = getattr(_frames, "get_eval_frame_callback", None) or (lambda: True)

_NOT_A_LEAF = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"


class _Caller(threading.local):
    """The hook that was on where the outermost opaque call of this thread began (``None``: not compiling)."""

    hook: Any = None


_caller = _Caller()


def opaque(fn: F) -> F:
    """``fn`` run eagerly under ``torch.compile`` (a graph break), with its name and docstring.

    >>> import torch
    >>> tolist = opaque(torch.Tensor.tolist)
    >>> step = torch.compile(lambda t: tolist(t * 2))
    >>> step(torch.ones(2))
    [2.0, 2.0]
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        # Nothing can be compiling: TorchDynamo not loaded, or no frame hook on (eager code, as most is).
        if "torch._dynamo" not in sys.modules or _frames is None or _hook() is None:
            return fn(*args, **kwargs)
        prior = _frames.set_eval_frame(None)
        outer = _caller.hook
        if prior is not None:
            _caller.hook = prior
        try:
            return fn(*args, **kwargs)
        finally:
            _caller.hook = outer
            _frames.set_eval_frame(prior)

    run._torchdynamo_disable = True  # type: ignore[attr-defined]  # TorchDynamo: do not inline, call it
    return run  # type: ignore[return-value]


def compiled_caller() -> bool:
    """Whether the opaque call running on this thread has a compiled caller: a ``body`` it runs is compiled.

    >>> compiled_caller()
    False
    """
    return _caller.hook is not None


def body(fn: F) -> F:
    """``fn``, a per-block function that an opaque call runs, compiled wherever that call's caller is.

    Outside an opaque call of a compiled caller it is ``fn`` itself, run as it is.
    Non-callables pass through unchanged (the caller refuses them).

    >>> import torch
    >>> twice = body(lambda t: t * 2)
    >>> opaque(lambda t: twice(t) + 1)(torch.ones(2))
    tensor([3., 3.])
    """
    if not callable(fn):
        return fn

    @functools.wraps(fn)
    def enter(*args: Any, **kwargs: Any) -> Any:
        hook = _caller.hook
        if hook is None:
            return fn(*args, **kwargs)
        _frames.set_eval_frame(hook)
        try:
            with warnings.catch_warnings():
                # TorchDynamo reads .grad of every tensor it guards on, and the blocks are not leaves.
                warnings.filterwarnings("ignore", _NOT_A_LEAF, UserWarning)
                return fn(*args, **kwargs)
        finally:
            _frames.set_eval_frame(None)

    return enter  # type: ignore[return-value]


_ENTER = body(len).__code__  # pyright: ignore[reportFunctionMemberAccess]  # the code of every function body() makes


def unwrapped(fn: Any) -> Any:
    """The function that ``body`` wrapped into ``fn``; ``fn`` itself where ``body`` did not make it."""
    return fn.__wrapped__ if getattr(fn, "__code__", None) is _ENTER else fn


def with_body(fn: F) -> F:
    """``opaque(fn)``, whose first argument (or ``fn=``) is a per-block function: passed on as ``body(it)``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            return fn(body(args[0]), *args[1:], **kwargs)
        if "fn" in kwargs:
            kwargs["fn"] = body(kwargs["fn"])
        return fn(*args, **kwargs)

    return opaque(call)  # type: ignore[return-value]


def never_compiled(fn: F) -> F:
    """``fn`` itself, whose own frame TorchDynamo never compiles where it runs as a frame (the calls it makes may be).

    Where a traced frame calls ``fn``, TorchDynamo still traces it inline. A frame of it runs
    only after a graph break in it, and compiling that frame again would yield no graph: only
    guards on its arguments (a tensor's identity, say), which fail at the next step's tensors
    and trace it once more, up to TorchDynamo's recompile limit. On a torch without per-code
    strategies TorchDynamo compiles it as before.

    >>> never_compiled(len) is len
    True
    """
    strategy = getattr(_frames, "_FrameExecStrategy", None)
    code = getattr(fn, "__code__", None)
    if strategy is not None and code is not None:
        _frames.set_code_exec_strategy(code, strategy(_frames._FrameAction.SKIP, _frames._FrameAction.DEFAULT))
    return fn


for _wrapper in (opaque(len), body(len)):  # they switch TorchDynamo off and on themselves
    never_compiled(_wrapper)
