"""``apply``: a custom autograd Function's ``apply`` without torch's per-call signature binding.

``torch.autograd.Function.apply`` binds its arguments to ``forward``'s signature with
``inspect.signature`` on every call, to fill in defaults, when the Function defines
``setup_context`` (as fshard's do, for ``torch.func``). That costs about 12 µs a call;
the node itself about 3 µs. Where ``forward`` has no defaults and takes its arguments by
position, the binding changes nothing, and ``apply`` here goes straight to the C
implementation the same way ``Function.apply`` ends, unwrapping dead ``torch.func``
wrappers first as it does. Under a ``torch.func`` transform and while TorchDynamo traces,
it calls ``Function.apply`` itself.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch._C._functorch as _functorch
import torch.autograd.forward_ad as _forward_ad

__all__ = ["apply", "requires_grad_tells", "transformed"]

try:  # what Function.apply does to its arguments before the C call, outside torch.func transforms
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap  # pyright: ignore[reportPrivateImportUsage]
except ImportError:  # pragma: no cover - a torch without it: Function.apply every time
    _unwrap = None

_transforms_active: Any = torch._C._are_functorch_transforms_active  # pyright: ignore[reportPrivateUsage]
_BY_POSITION: dict[type, bool] = {}  # Function class -> whether its forward binds positional arguments as given


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``: a tensor or a tuple of tensors.

    >>> import torch
    >>> class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x):
    ...         return 2 * x
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         pass
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return 2 * g
    >>> x = torch.ones(2, requires_grad=True)
    >>> apply(Double, x).sum().backward()
    >>> x.grad
    tensor([2., 2.])
    """
    own: Any = getattr(fn, "apply")  # noqa: B009  # torch leaves apply untyped
    if torch.compiler.is_compiling() or _unwrap is None or _transforms_active():  # TorchDynamo traces apply itself
        return own(*args)
    plain = _BY_POSITION.get(fn)
    if plain is None:
        plain = _BY_POSITION[fn] = _binds_as_given(fn)
    if not plain:
        return own(*args)
    base: Any = getattr(super(torch.autograd.Function, fn), "apply")  # noqa: B009  # the C call Function.apply ends in
    out: Any = base(*_unwrap(args))
    return out


def transformed() -> bool:
    """Whether a ``torch.func`` transform or a forward-mode level is active on this thread.

    There ``requires_grad`` alone does not say what autograd records: a tangent, or a
    transform's own level, may carry a derivative.

    >>> import torch
    >>> transformed(), torch.func.grad(lambda x: torch.tensor(float(transformed())) + x)(torch.ones(()))
    (False, tensor(1.))
    """
    return _transforms_active() or getattr(_forward_ad, "_current_level", 0) >= 0


def requires_grad_tells() -> bool:
    """Whether ``requires_grad`` says what autograd records: no transform nor forward-mode level, or one ``grad``.

    Under one ``torch.func.grad`` (or ``vjp``, ``jacrev``) level, ``requires_grad`` says it for
    that level; under ``vmap``, forward mode or nested transforms a tensor does not say it (a
    batched ``p * x`` reads False where ``p`` requires grad).

    >>> import torch
    >>> requires_grad_tells(), torch.func.grad(lambda x: torch.tensor(float(requires_grad_tells())) * x)(torch.ones(()))
    (True, tensor(1.))
    >>> torch.func.vmap(lambda x: torch.tensor(float(requires_grad_tells())) + x)(torch.zeros(2))
    tensor([0., 0.])
    """
    if getattr(_forward_ad, "_current_level", 0) >= 0:  # a forward-mode level: tangents, not requires_grad
        return False
    if not _transforms_active():
        return True
    stack = _functorch.get_interpreter_stack() or ()
    return len(stack) == 1 and stack[0].key() == _functorch.TransformType.Grad


def _binds_as_given(fn: type[torch.autograd.Function]) -> bool:
    """Whether binding positional arguments to ``fn.forward`` gives them back unchanged (no defaults to fill)."""
    mro = fn.__mro__
    if any("apply" in k.__dict__ for k in mro[: mro.index(torch.autograd.Function)]):  # an apply of its own
        return False
    p = inspect.Parameter
    kinds = (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    params = inspect.signature(fn.forward).parameters.values()
    return all(q.default is p.empty and q.kind in kinds for q in params)
