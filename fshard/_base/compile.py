"""The ``torch.compile`` boundary: code that TorchDynamo should run eagerly.

Data movement (``shard``, ``reshard``, ``gather``) resolves layouts and plans with
cached numpy code that TorchDynamo should not trace: ``opaque`` runs such a
function eagerly, so a compiled step graph-breaks around each movement while the
compute between them (``map_local`` bodies) is compiled.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["opaque"]

F = TypeVar("F", bound=Callable[..., Any])


def opaque(fn: F) -> F:
    """``fn`` run eagerly under ``torch.compile`` (a graph break), with its name and docstring.

    >>> import torch
    >>> step = torch.compile(lambda t: opaque(torch.Tensor.tolist)(t * 2))
    >>> step(torch.ones(2))
    [2.0, 2.0]
    """
    # torch.compiler.disable imports TorchDynamo (about 75 MiB and a second): do it on the first call
    # that could be traced, i.e. once TorchDynamo has been imported by someone (torch.compile).
    eager: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not eager:
            if "torch._dynamo" not in sys.modules:  # nothing can be compiling: no need to disable
                return fn(*args, **kwargs)
            # torch's stub leaves disable's arguments untyped.
            eager.append(torch.compiler.disable(fn))  # pyright: ignore[reportUnknownMemberType]
        return eager[0](*args, **kwargs)

    run._torchdynamo_disable = True  # type: ignore[attr-defined]  # TorchDynamo: do not inline, call it
    return run  # type: ignore[return-value]
