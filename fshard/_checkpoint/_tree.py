"""Pytree structure as JSON: flattening a tree of dicts, lists and tuples, and matching a given tree to it."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any, TypeGuard

from fshard._checkpoint._format import MAX_DEPTH
from fshard._errors import CheckpointError


# ``isinstance`` would narrow a user's tree to containers of unknown items; these say "of any objects".
def _is_dict(value: Any) -> TypeGuard[dict[Any, Any]]:
    return isinstance(value, dict)


def _is_container(value: Any) -> TypeGuard[dict[Any, Any] | list[Any] | tuple[Any, ...]]:
    return isinstance(value, (dict, list, tuple))


def flatten(tree: Any, path: str, leaves: list[tuple[str, Any]], depth: int = 0) -> dict[str, Any]:
    """The JSON structure of ``tree`` (dicts, lists, tuples); appends ``(path, leaf)`` pairs."""
    if depth > MAX_DEPTH:
        msg = (
            f"The tree nests deeper than {MAX_DEPTH} levels at {path[:200]}...: checkpoints hold trees of at most "
            f"{MAX_DEPTH} levels (does a container hold itself?)."
        )
        raise TypeError(msg)
    if type(tree) in (dict, collections.OrderedDict):
        for k in tree:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                msg = f"Dict key {k!r} at {path or 'the root'} is a {type(k).__name__}; use str or int keys."
                raise TypeError(msg)
        return {"dict": [[k, flatten(v, f"{path}[{k!r}]", leaves, depth + 1)] for k, v in tree.items()]}
    if type(tree) in (list, tuple):
        kind = type(tree).__name__
        return {kind: [flatten(v, f"{path}[{i}]", leaves, depth + 1) for i, v in enumerate(tree)]}
    if _is_container(tree):
        msg = (
            f"{type(tree).__name__} at {path or 'the root'} is not a plain dict, list or tuple; "
            "convert it first (a namedtuple with ._asdict(), a custom mapping with dict(...))."
        )
        raise TypeError(msg)
    leaves.append((path, tree))
    return {"leaf": len(leaves) - 1}


def unflatten(node: dict[str, Any], values: Sequence[Any]) -> Any:
    if "leaf" in node:
        return values[node["leaf"]]
    if "dict" in node:
        return {k: unflatten(v, values) for k, v in node["dict"]}
    kind = "list" if "list" in node else "tuple"
    return (list if kind == "list" else tuple)(unflatten(v, values) for v in node[kind])


def _leaf_indices(node: dict[str, Any]) -> Iterator[int]:
    if "leaf" in node:
        yield node["leaf"]
        return
    children = [c for _, c in node["dict"]] if "dict" in node else node["list" if "list" in node else "tuple"]
    for child in children:
        yield from _leaf_indices(child)


def _describe_node(node: dict[str, Any]) -> str:
    if "leaf" in node:
        return "a leaf"
    if "dict" in node:
        return f"a dict with keys {[k for k, _ in node['dict']]}"
    kind = "list" if "list" in node else "tuple"
    return f"a {kind} of {len(node[kind])}"


def match(node: dict[str, Any], tree: Any, path: str, out: dict[int, Any], *, prefix: bool) -> None:
    """Pairs each saved leaf with the entry of ``tree`` at the same place (``prefix``: a leaf covers a subtree)."""
    if "leaf" in node or (prefix and not _is_container(tree)):
        out.update(dict.fromkeys(_leaf_indices(node), tree))
        return
    where, given = path or "the root", "specs=" if prefix else "like="
    if "dict" in node and _is_dict(tree):
        keys = [k for k, _ in node["dict"]]
        if set(keys) != set(tree):
            msg = (
                f"Tree structure differs at {where}: the checkpoint has keys {keys}, {given} has "
                f"{list(tree)} (missing {[k for k in keys if k not in tree]}, extra "
                f"{[k for k in tree if k not in keys]}): pass a tree shaped like the saved one."
            )
            raise CheckpointError(msg)
        for k, child in node["dict"]:
            match(child, tree[k], f"{path}[{k!r}]", out, prefix=prefix)
        return
    kind = "list" if "list" in node else "tuple" if "tuple" in node else None
    if kind is None or type(tree).__name__ != kind or len(tree) != len(node[kind]):
        got = f"a {type(tree).__name__}" + (f" of {len(tree)}" if _is_container(tree) else "")
        msg = (
            f"Tree structure differs at {where}: the checkpoint has {_describe_node(node)}, {given} has {got}; "
            "pass a tree shaped like the saved one (fshard.checkpoint_info(path) shows it)."
        )
        raise CheckpointError(msg)
    for i, child in enumerate(node[kind]):
        match(child, tree[i], f"{path}[{i}]", out, prefix=prefix)
