"""What a Hugging Face load returns: per array, its view of the checkpoint, target layout, backend and dtype.

``specs`` (a mapping, a function ``(name, shape, dtype) -> spec | None`` or one spec) or
``like`` (a mapping of names to arrays or tensors) name the arrays after ``rename`` and
``fuse``; a name the checkpoint lacks raises ``CheckpointError``. Without either, every
tensor comes back whole on every rank, as a plain tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._format import check_not_partial
from fshard._checkpoint._fuse import View
from fshard._errors import CheckpointError, SpecError
from fshard._layout.layout import Layout
from fshard._layout.specs import Replicated, as_layout
from fshard.backends import Backend

__all__ = ["Want", "wants_like", "wants_plain", "wants_specs"]


_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Want:
    """One array to return: its view of the checkpoint, target layout and dtype; ``device`` for a plain tensor."""

    name: str
    view: View
    layout: Layout
    dtype: torch.dtype
    device: torch.device | None = None
    requires_grad: bool = False


def _missing(names: list[str], views: dict[str, View], given: str) -> CheckpointError:
    shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
    return CheckpointError(
        f"load() {given} names {shown}, which the checkpoint does not hold (after rename= and fuse=; it holds "
        f"{len(views)} tensors, e.g. {list(views)[:3]})."
    )


def wants_specs(views: dict[str, View], specs: Any, dtype: torch.dtype | None, backend: Backend) -> list[Want]:
    if isinstance(specs, Mapping):
        table: Mapping[Any, Any] = specs  # pyright: ignore[reportUnknownVariableType]
        missing = [str(k) for k in table if k not in views]
        if missing:
            raise _missing(missing, views, "specs=")
        pick: Callable[[str, tuple[int, ...], torch.dtype], Any] = lambda name, shape, dt: table.get(name)  # noqa: E731
    elif callable(specs):
        pick = specs
    else:
        pick = lambda name, shape, dt: specs  # noqa: E731
    out: list[Want] = []
    for name, view in views.items():
        spec = pick(name, view.shape, view.dtype)
        if spec is None:
            continue
        try:
            layout = as_layout(spec, view.shape)
        except SpecError as exc:
            raise SpecError(f"Tensor {name!r} ({view.dtype}, shape {view.shape}): {exc}") from None
        check_not_partial(f"Tensor {name!r}", layout)
        backend.check_layout(layout)
        out.append(Want(name, view, layout, dtype or view.dtype))
    return out


def wants_like(views: dict[str, View], like: Any, dtype: torch.dtype | None, coord: Backend) -> list[Want]:
    if not isinstance(like, Mapping):
        raise TypeError(
            f"load() like= of a Hugging Face checkpoint takes a mapping of names, got {type(like).__name__}."
        )
    given: Mapping[Any, Any] = like  # pyright: ignore[reportUnknownVariableType]
    missing = [str(k) for k in given if k not in views]
    if missing:
        raise _missing(missing, views, "like=")
    ranks = _plain_ranks(coord)
    out: list[Want] = []
    for name, view in views.items():
        if name not in given:
            continue
        x = given[name]
        if not isinstance(x, (ShardedArray, torch.Tensor)):
            raise TypeError(f"load() like= gives a {type(x).__name__} for {name!r}: give a ShardedArray or a tensor.")
        if tuple(x.shape) != view.shape:
            raise CheckpointError(
                f"Tensor {name!r} of the checkpoint has shape {view.shape}, like= has {tuple(x.shape)}."
            )
        if dtype is None and not torch.can_cast(view.dtype, x.dtype):
            raise CheckpointError(
                f"Tensor {name!r} of the checkpoint is {view.dtype}, like= has {x.dtype}: like= casts to its dtype "
                "only where torch.can_cast allows it (not a float to an int, nor a complex to a real). Give like= "
                f"the saved dtype and convert after loading, or ask for the cast with dtype={x.dtype}."
            )
        if isinstance(x, ShardedArray):
            if x.backend != coord:
                raise SpecError(f"load() like= holds {name!r} on backend {x.backend!r}, others on {coord!r}: use one.")
            check_not_partial(f"Tensor {name!r}", x.layout)
            out.append(Want(name, view, x.layout, dtype or x.dtype, requires_grad=x.requires_grad))
        else:
            layout = Replicated(list(ranks)).layout(view.shape)
            out.append(Want(name, view, layout, dtype or x.dtype, x.device, x.requires_grad))
    return out


def wants_plain(views: dict[str, View], dtype: torch.dtype | None, coord: Backend) -> list[Want]:
    """Every tensor as a plain tensor, whole on every rank (each read once per job, sent to the others)."""
    ranks = _plain_ranks(coord)
    return [Want(n, v, Replicated(list(ranks)).layout(v.shape), dtype or v.dtype, _CPU) for n, v in views.items()]


def _plain_ranks(coord: Backend) -> tuple[int, ...]:
    """The ranks that each get a whole plain tensor: every rank of the group (rank 0 in one process)."""
    ranks: tuple[int, ...] = getattr(coord, "ranks", (0,))
    return ranks
