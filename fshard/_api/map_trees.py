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

__all__ = ["Flat", "Trees", "describe", "flatten", "is_array", "is_spec", "path_text"]


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array or a tensor: a leaf of a tree argument that takes a spec."""
    return isinstance(x, (ShardedArray, torch.Tensor))


def is_spec(x: Any) -> bool:
    """Whether ``x`` is one spec (or ``None``), a leaf of a tree of specs, as ``shard_map`` reads one."""
    return x is None or isinstance(x, Layout) or hasattr(x, "layout")


@dataclasses.dataclass(frozen=True)
class Flat:
    """How a structure of arguments passes as leaves: the ``shard_map`` of the leaves takes ``specs``.

    Made once per structure (``flatten``'s key: the trees' shapes, which leaves are arrays,
    and which of those are floating), on which ``specs``, ``precisions``, ``labels`` and
    ``function`` depend alone.
    """

    specs: tuple[Any, ...]
    precisions: tuple[Any, ...]
    labels: tuple[str, ...]
    counts: tuple[int | None, ...]  # per argument: its leaf count (None: passed whole)

    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a function of the leaves' blocks and, last, the call's treedefs: each tree rebuilt first.

        The treedefs are the call's own, not the first call's: two dicts with the same keys in
        another order share a ``Flat`` (their treedefs compare equal) but not their order.
        """
        counts = self.counts

        @functools.wraps(fn)  # the body's code stays fn's (shard_map remembers the bodies that reduce)
        def of_leaves(*blocks: Any) -> Any:
            treedefs = blocks[-1]
            full: list[Any] = []
            at = 0
            for treedef, n in zip(treedefs, counts):
                full.append(blocks[at] if n is None else optree.tree_unflatten(treedef, blocks[at : at + n]))
                at += 1 if n is None else n
            return fn(*full)

        return of_leaves


def path_text(path: tuple[Any, ...]) -> str:
    """A pytree path as an index expression: ``['w'][0]``; empty for the root."""
    return "".join(f"[{k!r}]" for k in path)


# Per argument: its leaves' paths, the leaves and their kinds (``_kind``), or None (passed whole).
Trees = list[tuple[Any, list[Any], tuple[int, ...]] | None]


def _kind(x: Any) -> int:
    """A leaf's kind as the structure's key holds it: 0 a value, 1 an array or tensor, 2 a floating one."""
    if not is_array(x):
        return 0
    return 2 if x.dtype.is_floating_point else 1


def flatten(args: Sequence[Any], specs: Sequence[Any]) -> tuple[Any, tuple[Any, ...], Trees]:
    """``args`` with each tree argument (a container of values, its spec not ``None``) flattened into its leaves.

    Returns the structure's key (hashable: each tree's treedef and its leaves' kinds; all
    ``None`` where no argument is a tree), the flat arguments, the call's treedefs last
    (``Flat.function`` rebuilds the trees with them), and each tree's paths, leaves and
    kinds (for ``describe``).
    """
    key: list[Any] = []
    flat: list[Any] = []
    treedefs: list[Any] = []
    trees: Trees = []
    for a, spec in zip(args, specs):
        if spec is not None and not is_array(a):
            paths, leaves, treedef = optree.tree_flatten_with_path(a, is_leaf=is_array, none_is_leaf=True)
            if not optree.treespec_is_leaf(treedef):
                kinds = tuple(map(_kind, leaves))
                key.append((treedef, kinds))
                flat.extend(leaves)
                treedefs.append(treedef)
                trees.append((paths, leaves, kinds))
                continue
        key.append(None)
        flat.append(a)
        treedefs.append(None)
        trees.append(None)
    flat.append(tuple(treedefs))
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
    the argument's (a dict of specs with the argument's keys, say), matched by key, not by
    order; ``None`` there passes values that are not tensors. Array and tensor leaves take
    their spec, and the floating ones the argument's precision; other leaves (numbers,
    ``None``) are passed to the function unchanged. The last flat argument (the call's
    treedefs) takes the spec ``None``.

    Raises:
        SpecError: a tree of specs does not fit its argument, or an array or tensor leaf has
            the spec ``None``.
    """
    flat_specs: list[Any] = []
    flat_precisions: list[Any] = []
    flat_labels: list[str] = []
    counts: list[int | None] = []
    for k, (a, tree, spec) in enumerate(zip(args, trees, specs)):
        name = f"argument {k}" if labels is None else labels[k]
        if tree is None:
            counts.append(None)
            flat_specs.append(spec)
            flat_precisions.append(precisions[k])
            flat_labels.append(name)
            continue
        paths, leaves, kinds = tree
        leaf_specs = [spec] * len(leaves) if is_spec(spec) else _by_path(spec, a, paths, name, what)
        for path, leaf, kind, s in zip(paths, leaves, kinds, leaf_specs):
            if kind and s is None:
                msg = (
                    f"{what} {name}{path_text(path)} is a {type(leaf).__name__} but its in_spec is None: give it a "
                    "spec (None passes only values that are not tensors)."
                )
                raise SpecError(msg)
            flat_specs.append(s if kind else None)
            flat_precisions.append(precisions[k] if kind == 2 else None)
            flat_labels.append(f"{name}{path_text(path)}")
        counts.append(len(leaves))
    flat_specs.append(None)  # the call's treedefs
    flat_precisions.append(None)
    flat_labels.append("the structure of the arguments")
    return Flat(tuple(flat_specs), tuple(flat_precisions), tuple(flat_labels), tuple(counts))


def _by_path(spec: Any, a: Any, paths: Sequence[tuple[Any, ...]], name: str, what: str) -> list[Any]:
    """The spec of each leaf of ``a`` (at ``paths``), from ``spec``, a tree of specs that is a prefix of ``a``.

    Matched by path, so that a dict of specs fits an ``OrderedDict`` argument whatever the
    order of either's keys (optree pairs two dicts' values in their own orders).
    """

    def leaf(x: Any) -> bool:
        return is_spec(x) or is_array(x)

    try:
        optree.broadcast_prefix(spec, a, is_leaf=leaf, none_is_leaf=True)  # the structures: the same keys, arities
    except ValueError:  # optree's message shows the argument's values: the structures say what differs
        specs = optree.tree_structure(spec, is_leaf=leaf, none_is_leaf=True)
        given = optree.tree_structure(a, is_leaf=leaf, none_is_leaf=True)
        msg = (
            f"{what} in_specs entry for {name} does not fit it: the specs are shaped {specs}, the "
            f"argument {given}. Give one spec for the whole argument, or a tree of specs shaped as it (a dict of "
            "specs with its keys, say), or as a prefix of it."
        )
        raise SpecError(msg) from None
    spec_paths, spec_leaves, _ = optree.tree_flatten_with_path(spec, is_leaf=leaf, none_is_leaf=True)
    at = dict(zip(spec_paths, spec_leaves))
    # Each leaf's spec is the one at the longest prefix of its path (there is exactly one: the structures fit).
    return [next(at[p[:n]] for n in range(len(p), -1, -1) if p[:n] in at) for p in paths]
