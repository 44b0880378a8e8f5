"""What a DCP load builds for each entry: from ``like``, from ``specs`` (a mapping, a function or one spec), or plain.

Names are DCP's flattened keys (``model.layer.weight``). A tensor not asked for is skipped;
a non-tensor entry comes back as its raw bytes where it is asked for (or when neither
``like`` nor ``specs`` is given), never unpickled.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from fshard._array.array import ShardedArray
from fshard._checkpoint._dcp_meta import BytesEntry, DcpMetadata, TensorEntry
from fshard._errors import CheckpointError, SpecError
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement
from fshard._layout.specs import as_layout, is_spec
from fshard._layout.torch_meta import is_torch_spec
from fshard.backends import Backend

__all__ = ["Target", "coordinator", "targets"]


_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Target:
    """One tensor to build: an array in ``layout`` on ``backend``, or (``plain``) a tensor on ``device``.

    A plain tensor's ``layout`` places the whole tensor on every rank that returns it.
    """

    entry: TensorEntry
    layout: Layout
    backend: Backend
    plain: bool = False
    device: torch.device = _CPU
    requires_grad: bool = False


def coordinator(like: Any, backend: Backend | None, default: Callable[[], Backend]) -> Backend:
    """The backend that loads together: the arrays' in ``like`` (all the same), else ``backend`` or the default."""
    found = {v.backend for v in _values(like) if isinstance(v, ShardedArray)}
    if len(found) > 1:
        raise SpecError(f"load() like= holds arrays on different backends {sorted(b.name for b in found)}.")
    return found.pop() if found else backend or default()


def _values(like: Any) -> list[Any]:
    return list(cast("Mapping[str, Any]", like).values()) if isinstance(like, Mapping) else []


def targets(
    md: DcpMetadata, like: Any, specs: Any, coord: Backend, plain_ranks: tuple[int, ...]
) -> tuple[list[Target], list[BytesEntry]]:
    """The tensors to build and the non-tensor entries to return as bytes, in the metadata's order.

    ``plain_ranks``: the ranks that each return a whole plain tensor (every rank of ``coord``).
    """
    if like is not None and specs is not None:
        raise TypeError("load() takes like= or specs=, not both.")
    if like is not None:
        given = _mapping(like, "like", md)
        return _pick(md, given, lambda e, v: _from_like(e, v, coord, plain_ranks))
    if specs is None:
        return [_plain(e, coord, plain_ranks) for e in md.tensors], [e for e in md.entries if isinstance(e, BytesEntry)]
    if is_spec(specs) or is_torch_spec(specs):
        return [_from_spec(e, specs, coord) for e in md.tensors], []
    if isinstance(specs, Mapping):
        given = _mapping(specs, "specs", md)
        return _pick(md, given, lambda e, v: None if v is None else _from_spec(e, v, coord))
    if callable(specs):
        fn = cast("Callable[[str, tuple[int, ...], torch.dtype], Any]", specs)
        chosen = [(e, fn(e.name, e.shape, e.dtype)) for e in md.tensors]
        return [_from_spec(e, s, coord) for e, s in chosen if s is not None], []
    msg = (
        "load() specs= for a DCP folder takes a mapping of names to specs, a function (name, shape, dtype) -> "
        f"spec or None, or one spec for every tensor; got {type(specs).__name__}."
    )
    raise TypeError(msg)


def _mapping(value: Any, what: str, md: DcpMetadata) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        msg = f"load() {what}= for a DCP folder takes a mapping of its names (such as 'model.layer.weight'), got {type(value).__name__}."  # noqa: E501
        raise TypeError(msg)
    given = cast("Mapping[str, Any]", value)
    names = [e.name for e in md.entries]
    unknown = [k for k in given if k not in set(names)]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), names, n=3)
        hint = f" (close: {close})" if close else f" (it holds {names[:5]}{'...' if len(names) > 5 else ''})"
        raise CheckpointError(f"load() {what}= names {unknown[:3]}, which DCP folder {md.root} does not hold{hint}.")
    return given


def _pick(
    md: DcpMetadata, given: Mapping[str, Any], build: Callable[[TensorEntry, Any], Target | None]
) -> tuple[list[Target], list[BytesEntry]]:
    out: list[Target] = []
    raw: list[BytesEntry] = []
    for e in md.entries:
        if e.name not in given:
            continue
        if isinstance(e, BytesEntry):
            if given[e.name] is not None:
                msg = f"{e.name!r} of DCP folder {md.root} is not a tensor: it loads as raw bytes; give None for it."
                raise CheckpointError(msg)
            raw.append(e)
        elif (t := build(e, given[e.name])) is not None:
            out.append(t)
    return out, raw


def _from_spec(e: TensorEntry, spec: Any, coord: Backend) -> Target:
    try:
        layout = as_layout(spec, e.shape)
    except SpecError as exc:
        raise SpecError(f"Tensor {e.name!r} ({e.dtype}, shape {e.shape}): {exc}") from None
    if layout.partial is not None:
        msg = (
            f"{e.name!r}: the target layout has a pending {layout.partial} (partial={layout.partial!r}), but a "
            "checkpoint holds values, not summands: load into the spec without Partial(...)."
        )
        raise SpecError(msg)
    coord.check_layout(layout)
    return Target(e, layout, coord)


def _from_like(e: TensorEntry, like: Any, coord: Backend, plain_ranks: tuple[int, ...]) -> Target:
    if not isinstance(like, (ShardedArray, torch.Tensor)):
        raise CheckpointError(f"{e.name!r} is a tensor; like= gives a {type(like).__name__}: give an array or tensor.")
    if tuple(like.shape) != e.shape or like.dtype != e.dtype:
        msg = (
            f"{e.name!r} has shape {e.shape} and dtype {e.dtype}, like= has shape {tuple(like.shape)} and "
            f"dtype {like.dtype}: give the saved shape and dtype, and convert after loading."
        )
        raise CheckpointError(msg)
    if isinstance(like, ShardedArray):
        target = _from_spec(e, like.layout, like.backend)
        return dataclasses.replace(target, requires_grad=like.requires_grad)
    return Target(e, _whole(e, plain_ranks), coord, True, like.device, like.requires_grad)


def _plain(e: TensorEntry, coord: Backend, plain_ranks: tuple[int, ...]) -> Target:
    return Target(e, _whole(e, plain_ranks), coord, plain=True)


def _whole(e: TensorEntry, ranks: tuple[int, ...]) -> Layout:
    """The whole tensor on each of ``ranks`` (on the CPU: a plain tensor moves to its device at the end)."""
    zeros = (0,) * len(e.shape)
    return Layout(e.shape, [ShardMeta(zeros, e.shape, Placement(r)) for r in ranks])
