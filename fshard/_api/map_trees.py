"""``shard_map``'s arguments that are pytrees: a dict of parameters, a tuple of a batch and its targets.

JAX's ``shard_map`` takes pytrees of arrays, each with a spec that is a prefix of it: one
spec for a whole dict, or a dict of specs. Here such an argument is flattened into its
leaves, each with its spec, and the ``shard_map`` of the leaves runs (made once per
structure of the arguments); its function rebuilds each argument from the blocks before
calling the user's. So a tree of arrays moves as one, exactly as the same arrays passed
one by one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fshard._array.array import ShardedArray
from fshard._errors import SpecError
from fshard._layout.layout import Layout

__all__ = ["Flat", "describe", "flatten", "is_tree"]


def _array(x: Any) -> bool:
    return isinstance(x, (ShardedArray, torch.Tensor))


def _spec(x: Any) -> bool:
    """A spec (or ``None``) at a leaf of an ``in_specs`` tree, as ``shard_map`` reads one."""
    return x is None or isinstance(x, Layout) or hasattr(x, "layout")


def is_tree(x: Any) -> bool:
    """Whether ``x`` is a container (a tuple, list, dict or other pytree node) rather than one value."""
    if _array(x):
        return False
    return not optree.treespec_is_leaf(optree.tree_structure(x, is_leaf=_array, none_is_leaf=True))


@dataclasses.dataclass(frozen=True)
class Flat:
    """How a structure of arguments passes as leaves: the ``shard_map`` of the leaves takes ``specs``.

    Made once per structure (``flatten``'s key: the trees' shapes, and which leaves are
    arrays), on which ``specs``, ``precisions``, ``labels`` and ``function`` depend alone.
    """

    specs: tuple[Any, ...]
    precisions: tuple[Any, ...]
    labels: tuple[str, ...]
    shapes: tuple[tuple[Any, int], ...]  # per argument: its treedef (None: passed whole) and its leaf count

    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a function of the leaves' blocks: each tree argument rebuilt first."""
        shapes = self.shapes

        @functools.wraps(fn)  # the body's code stays fn's (shard_map remembers the bodies that reduce)
        def of_leaves(*flat: Any) -> Any:
            full: list[Any] = []
            at = 0
            for treedef, n in shapes:
                full.append(flat[at] if treedef is None else optree.tree_unflatten(treedef, flat[at : at + n]))
                at += n
            return fn(*full)

        return of_leaves


def _path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path)


Trees = list[tuple[Any, list[Any]] | None]  # per argument: its leaves' paths and the leaves, or None (passed whole)


def flatten(args: Sequence[Any], specs: Sequence[Any]) -> tuple[Any, tuple[Any, ...], Trees]:
    """``args`` with each tree argument (``is_tree``, its spec not ``None``) flattened into its leaves.

    Returns the structure's key (hashable: each tree's treedef and which of its leaves are
    arrays or tensors), the flat arguments, and each tree's paths and leaves (for ``describe``).
    """
    key: list[Any] = []
    flat: list[Any] = []
    trees: Trees = []
    for a, spec in zip(args, specs):
        if spec is not None and not _array(a):
            paths, leaves, treedef = optree.tree_flatten_with_path(a, is_leaf=_array, none_is_leaf=True)
            if not optree.treespec_is_leaf(treedef):
                key.append((treedef, tuple(map(_array, leaves))))
                flat.extend(leaves)
                trees.append((paths, leaves))
                continue
        key.append(None)
        flat.append(a)
        trees.append(None)
    return tuple(key), tuple(flat), trees


def describe(
    args: Sequence[Any],
    trees: Trees,
    specs: Sequence[Any],
    precisions: Sequence[Any],
    labels: Sequence[str] | None,
    what: str,
) -> Flat:
    """How the arguments that ``flatten`` gave ``trees`` pass as leaves: each leaf's spec, precision and name.

    A tree argument's spec is one spec for every leaf, or a tree of specs that is a prefix of
    the argument's (a dict of specs with the argument's keys, say); ``None`` there passes that
    part unchanged. Array and tensor leaves take their spec and the argument's precision;
    other leaves (numbers, ``None``) are passed to the function unchanged.

    Raises:
        SpecError: a tree of specs does not fit its argument, or an array or tensor leaf has
            the spec ``None``.
    """
    flat_specs: list[Any] = []
    flat_precisions: list[Any] = []
    flat_labels: list[str] = []
    shapes: list[tuple[Any, int]] = []
    for k, (a, tree, spec) in enumerate(zip(args, trees, specs)):
        name = f"argument {k}" if labels is None else labels[k]
        if tree is None:
            shapes.append((None, 1))
            flat_specs.append(spec)
            flat_precisions.append(precisions[k])
            flat_labels.append(name)
            continue
        paths, leaves = tree
        leaf_specs = [spec] * len(leaves) if not _spec_tree(spec) else _broadcast(spec, a, name, what)
        for path, leaf, s in zip(paths, leaves, leaf_specs):
            is_array = _array(leaf)
            if is_array and s is None:
                msg = (
                    f"{what} {name}{_path(path)} is a {type(leaf).__name__} but its in_spec is None: give it a "
                    "spec (None passes only values that are not tensors)."
                )
                raise SpecError(msg)
            flat_specs.append(s if is_array else None)
            flat_precisions.append(precisions[k] if is_array else None)
            flat_labels.append(f"{name}{_path(path)}")
        shapes.append((optree.tree_structure(a, is_leaf=_array, none_is_leaf=True), len(leaves)))
    return Flat(tuple(flat_specs), tuple(flat_precisions), tuple(flat_labels), tuple(shapes))


def _spec_tree(spec: Any) -> bool:
    """Whether ``spec`` is a tree of specs (a container of them) rather than one spec."""
    return not _spec(spec)


def _broadcast(spec: Any, a: Any, name: str, what: str) -> list[Any]:
    """The spec of each leaf of ``a``, from ``spec``, a tree of specs that is a prefix of ``a``."""

    def leaf(x: Any) -> bool:
        return _spec(x) or _array(x)

    try:
        return optree.broadcast_prefix(spec, a, is_leaf=leaf, none_is_leaf=True)
    except ValueError:  # optree's message shows the argument's values: the structures say what differs
        specs = optree.tree_structure(spec, is_leaf=leaf, none_is_leaf=True)
        given = optree.tree_structure(a, is_leaf=leaf, none_is_leaf=True)
        msg = (
            f"{what} in_specs entry for {name} does not fit it: the specs are shaped {specs}, the "
            f"argument {given}. Give one spec for the whole argument, or a tree of specs shaped as it (a dict of "
            "specs with its keys, say), or as a prefix of it."
        )
        raise SpecError(msg) from None
