"""Names and shapes as a loader sees them: ``rename``, ``Split`` and ``Concat`` over checkpoint tensors.

Every array a load returns is a ``View``: pieces of checkpoint tensors laid one after
another along one dim. A plain tensor is one piece, a ``Split`` part is one piece (a
slab of its source), a ``Concat`` holds one piece per source. Reading a box of a view
reads, from each piece it meets, only the part it needs.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fshard._errors import CheckpointError, SpecError

__all__ = ["Concat", "Piece", "Split", "View", "apply_fuse", "rename_all"]


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty str, got {value!r}.")
    return value


def _check_dim(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} dim must be an int, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True, init=False)
class Split:
    """One checkpoint tensor loaded as several arrays: consecutive slices along ``dim``.

    ``parts`` maps each new name to its size along ``dim``, in order; the sizes must add
    up to the tensor's size there. The source name is gone from the result.

    >>> import fshard
    >>> fshard.Split("attn.qkv.weight", 0, {"attn.q.weight": 64, "attn.k.weight": 32, "attn.v.weight": 32})
    Split('attn.qkv.weight', dim=0, parts={'attn.q.weight': 64, 'attn.k.weight': 32, 'attn.v.weight': 32})
    """

    source: str
    dim: int
    parts: tuple[tuple[str, int], ...]

    def __init__(self, source: str, dim: int, parts: Mapping[str, int]) -> None:
        _check_name(source, "Split source")
        _check_dim(dim, "Split")
        if not isinstance(parts, Mapping) or not parts:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Split parts must be a non-empty mapping of name to size, got {parts!r}.")
        items = tuple((_check_name(k, "Split part name"), v) for k, v in parts.items())
        for name, size in items:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
                raise SpecError(f"Split part {name!r} has size {size!r}: give a non-negative int.")
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "parts", items)

    def __repr__(self) -> str:
        return f"Split({self.source!r}, dim={self.dim}, parts={dict(self.parts)!r})"


@dataclasses.dataclass(frozen=True, init=False)
class Concat:
    """Several checkpoint tensors loaded as one array ``name``, concatenated along ``dim``.

    The sources must share dtype and every size but the one along ``dim``; their names
    are gone from the result.

    >>> import fshard
    >>> fshard.Concat(["attn.q.weight", "attn.k.weight", "attn.v.weight"], 0, "attn.qkv.weight")
    Concat(['attn.q.weight', 'attn.k.weight', 'attn.v.weight'], dim=0, name='attn.qkv.weight')
    """

    sources: tuple[str, ...]
    dim: int
    name: str

    def __init__(self, sources: Sequence[str], dim: int, name: str) -> None:
        if isinstance(sources, str) or not isinstance(sources, Iterable) or not sources:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"Concat sources must be a non-empty sequence of names, got {sources!r}.")
        object.__setattr__(self, "sources", tuple(_check_name(s, "Concat source") for s in sources))
        object.__setattr__(self, "dim", _check_dim(dim, "Concat"))
        object.__setattr__(self, "name", _check_name(name, "Concat name"))

    def __repr__(self) -> str:
        return f"Concat({list(self.sources)!r}, dim={self.dim}, name={self.name!r})"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of the checkpoint tensor ``source`` (its name in the file): ``offsets`` and ``sizes``."""

    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class View:
    """An array to load: ``shape`` and file ``dtype``; ``pieces`` laid one after another along ``dim``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    pieces: tuple[Piece, ...]

    @staticmethod
    def whole(source: str, shape: tuple[int, ...], dtype: torch.dtype) -> View:
        """A whole checkpoint tensor."""
        return View(shape, dtype, 0, (Piece(source, (0,) * len(shape), shape),))

    def starts(self) -> list[int]:
        """Where each piece starts along ``dim``."""
        out: list[int] = []
        at = 0
        for p in self.pieces:
            out.append(at)
            at += p.sizes[self.dim] if p.sizes else 1
        return out

    def slab(self, dim: int, start: int, size: int) -> View:
        """The elements ``start .. start + size`` along ``dim``."""
        shape = (*self.shape[:dim], size, *self.shape[dim + 1 :])
        if dim != self.dim or len(self.pieces) == 1:
            pieces = tuple(_cut(p, dim, p.offsets[dim] + start, size) for p in self.pieces)
            return View(shape, self.dtype, self.dim if len(self.pieces) > 1 else dim, pieces)
        kept: list[Piece] = []
        for p, at in zip(self.pieces, self.starts()):
            lo, hi = max(start, at), min(start + size, at + p.sizes[dim])
            if lo < hi:
                kept.append(_cut(p, dim, p.offsets[dim] + lo - at, hi - lo))
        return View(shape, self.dtype, dim, tuple(kept))


def _cut(p: Piece, dim: int, lo: int, size: int) -> Piece:
    return Piece(p.source, (*p.offsets[:dim], lo, *p.offsets[dim + 1 :]), (*p.sizes[:dim], size, *p.sizes[dim + 1 :]))


def rename_all(views: dict[str, View], rename: Any) -> dict[str, View]:
    """``views`` under new names: ``rename`` is a mapping (names it lacks stay) or a function of the name.

    Raises:
        CheckpointError: a mapping names a tensor the checkpoint lacks (a misspelt name would
            otherwise leave the tensor it meant under its old name), or two names become one.
    """
    if rename is None:
        return views
    if isinstance(rename, Mapping):
        table: Mapping[Any, Any] = rename  # pyright: ignore[reportUnknownVariableType]
        absent = [k for k in table if k not in views]
        if absent:
            near = difflib.get_close_matches(str(absent[0]), list(views), n=3)
            hint = f" (close: {near})" if near else ""
            msg = (
                f"load() rename= maps {absent[:5]!r}, which the checkpoint lacks{hint}: fix the names, or pass a "
                "function of the name to rename names that may be absent."
            )
            raise CheckpointError(msg)
        fn: Callable[[str], Any] = lambda name: table.get(name, name)  # noqa: E731
    elif callable(rename):
        fn = rename
    else:
        raise TypeError(f"load() rename= takes a mapping or a function of the name, got {type(rename).__name__}.")
    out: dict[str, View] = {}
    first: dict[str, str] = {}
    for name, view in views.items():
        new = fn(name)
        if not isinstance(new, str):
            raise TypeError(f"load() rename= gave {new!r} for {name!r}: give a str.")
        if new in out:
            raise CheckpointError(
                f"load() rename= maps both {first[new]!r} and {name!r} to {new!r}: names must stay distinct."
            )
        out[new], first[new] = view, name
    return out


def apply_fuse(views: dict[str, View], fuse: Any) -> dict[str, View]:
    """``views`` after each ``Split`` and ``Concat`` of ``fuse``, in order (each sees the names before it)."""
    if fuse is None:
        return views
    if isinstance(fuse, (Split, Concat)) or not isinstance(fuse, Iterable):
        raise TypeError(f"load() fuse= takes a list of fshard.Split and fshard.Concat, got {type(fuse).__name__}.")
    for decl in fuse:  # pyright: ignore[reportUnknownVariableType]
        if isinstance(decl, Split):
            views = _split(views, decl)
        elif isinstance(decl, Concat):
            views = _concat(views, decl)
        else:
            raise TypeError(f"load() fuse= takes fshard.Split and fshard.Concat values, got {decl!r}.")
    return views


def _missing(decl: Split | Concat, name: str, views: dict[str, View]) -> CheckpointError:
    near = [n for n in views if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
    hint = f" (names ending alike: {near})" if near else ""
    return CheckpointError(f"{decl!r}: the checkpoint has no tensor {name!r} (after rename= and earlier fuse=){hint}.")


def _dim(decl: Split | Concat, view: View) -> int:
    nd = len(view.shape)
    if not -nd <= decl.dim < nd:
        raise CheckpointError(f"{decl!r}: dim {decl.dim} is out of range for a tensor of shape {view.shape}.")
    return decl.dim % nd


def _replace(views: dict[str, View], old: Sequence[str], new: dict[str, View], decl: Split | Concat) -> dict[str, View]:
    """``views`` with the names ``old`` removed and ``new`` put where the first of them was."""
    taken = [k for k in new if k in views and k not in old]
    if taken:
        raise CheckpointError(f"{decl!r}: the name {taken[0]!r} is taken: give the new arrays unused names.")
    out: dict[str, View] = {}
    for name, view in views.items():
        if name not in old:
            out[name] = view
        elif not any(k in out for k in new):
            out.update(new)
    return out


def _split(views: dict[str, View], decl: Split) -> dict[str, View]:
    if decl.source not in views:
        raise _missing(decl, decl.source, views)
    view = views[decl.source]
    dim = _dim(decl, view)
    total = sum(size for _, size in decl.parts)
    if total != view.shape[dim]:
        msg = f"{decl!r}: the parts add up to {total} along dim {dim}, but {decl.source!r} has shape {view.shape}."
        raise CheckpointError(msg)
    new: dict[str, View] = {}
    at = 0
    for name, size in decl.parts:
        if name in new:
            raise CheckpointError(f"{decl!r}: the part name {name!r} appears twice.")
        new[name] = view.slab(dim, at, size)
        at += size
    return _replace(views, [decl.source], new, decl)


def _concat(views: dict[str, View], decl: Concat) -> dict[str, View]:
    for s in decl.sources:
        if s not in views:
            raise _missing(decl, s, views)
    if len(set(decl.sources)) != len(decl.sources):
        raise CheckpointError(f"{decl!r}: a source appears twice.")
    parts = [views[s] for s in decl.sources]
    dim = _dim(decl, parts[0])
    for s, v in zip(decl.sources, parts):
        same = v.dtype == parts[0].dtype and len(v.shape) == len(parts[0].shape)
        if not same or any(a != b for k, (a, b) in enumerate(zip(v.shape, parts[0].shape)) if k != dim):
            msg = (
                f"{decl!r}: {s!r} is {v.dtype} of shape {v.shape} and {decl.sources[0]!r} is {parts[0].dtype} of "
                f"shape {parts[0].shape}: sources must share dtype and every size but the one along dim {dim}."
            )
            raise CheckpointError(msg)
        if len(v.pieces) > 1 and v.dim != dim:
            msg = f"{decl!r}: {s!r} is itself a Concat along dim {v.dim}; nest concatenations along one dim only."
            raise CheckpointError(msg)
    shape = (*parts[0].shape[:dim], sum(v.shape[dim] for v in parts), *parts[0].shape[dim + 1 :])
    pieces = tuple(p for v in parts for p in v.pieces)
    return _replace(views, list(decl.sources), {decl.name: View(shape, parts[0].dtype, dim, pieces)}, decl)
