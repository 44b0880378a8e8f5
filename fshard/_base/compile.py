"""The ``torch.compile`` boundary: code that TorchDynamo should run eagerly.

Data movement (``shard``, ``reshard``, ``gather``) resolves layouts and plans with
cached numpy code that TorchDynamo should not trace: ``opaque`` runs such a
function eagerly, so a compiled step graph-breaks around each movement while the
compute between them (``map_local`` bodies) is compiled.
"""

from __future__ import annotations

import functools
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
    # torch's stub leaves disable's arguments untyped.
    eager: Callable[..., Any] = torch.compiler.disable(fn)  # pyright: ignore[reportUnknownMemberType]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return eager(*args, **kwargs)

    return run  # type: ignore[return-value]
