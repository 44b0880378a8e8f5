"""What the ranks compare before a save writes anything: path, tree, arrays, plain tensors and scalars.

A save is collective: every rank must pass the same directory and the same tree.
Arrays are global values (their layouts say which rank writes what); a plain
tensor or a scalar is one value that every rank holds, written once. So each
rank checks its leaves and summarises them (plain tensors by SHA-256), the first
exchange of the save compares one digest per rank, and on a difference a second
exchange finds the first leaf that differs. Every rank raises the same error,
and nothing has been written yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._array.array import ShardedArray
from fshard._base.records import record
from fshard._checkpoint._format import CODES, DTYPES, NESTED, SCALARS, hashing, sha256
from fshard._errors import CheckpointError, SpecError
from fshard.backends import Backend


@record
@dataclasses.dataclass(frozen=True)
class _Facts:
    """What one rank was asked to save, in brief: exchanged before anything is written."""

    rank: int | None
    token: str  # the first rank's names the new data directory
    path: str
    tree: str
    leaves: str
    options: str = ""  # the call's other arguments that shape what is written (save_safetensors' max_shard_size)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _check_leaf(path: str, leaf: Any) -> None:
    where = path or "the root"
    if isinstance(leaf, ShardedArray):
        dtype = leaf.dtype
        if leaf.layout.partial is not None:
            msg = (
                f"ShardedArray at {where} has a pending {leaf.layout.partial} (its layout is partial="
                f"{leaf.layout.partial!r}): its copies are operands of a reduction, not the value, so no copy "
                "can be saved as it. Reshard it to a non-partial spec first: fshard.reshard(x, spec)."
            )
            raise SpecError(msg)
    elif type(leaf) in (torch.Tensor, torch.nn.Parameter):
        dtype = leaf.dtype
        if leaf.layout != torch.strided:
            raise TypeError(f"Tensor at {where} has layout {leaf.layout}; checkpoints take strided tensors.")
        if leaf.is_nested:
            raise TypeError(f"Tensor at {where} is a nested tensor; {NESTED}")
    elif isinstance(leaf, torch.Tensor):
        msg = (
            f"{type(leaf).__name__} at {where} is a tensor subclass; convert it to a ShardedArray first "
            "(fshard.from_dtensor, fshard.from_sharded_tensor) or pass a plain tensor."
        )
        raise TypeError(msg)
    elif isinstance(leaf, SCALARS):
        return
    else:
        msg = (
            f"{type(leaf).__name__} at {where} cannot be saved: leaves are ShardedArrays, tensors, "
            "bool, int, float, str or None."
        )
        raise TypeError(msg)
    if dtype not in CODES:
        raise TypeError(f"Leaf at {where} has dtype {dtype}; checkpoints store {sorted(DTYPES)}.")
    if _on_meta(leaf):
        raise TypeError(f"{type(leaf).__name__} at {where} is on the meta device, which holds no values to save.")


def _on_meta(leaf: ShardedArray | torch.Tensor) -> bool:
    tensors = leaf.addressable_data if isinstance(leaf, ShardedArray) else (leaf,)
    return any(t.device.type == "meta" for t in tensors)


def prepare(
    root: Path,
    structure: dict[str, Any],
    leaves: Sequence[tuple[str, Any]],
    backend: Backend,
    failure: Exception | None,
    options: str = "",
) -> tuple[_Facts, list[str], dict[int, str]]:
    """Checks the leaves and summarises them: (facts, one summary per leaf, SHA-256 of each plain tensor by leaf).

    ``options``: the call's other arguments that shape the files, as text (``check_same`` compares it).
    """
    if failure is not None:
        raise failure
    for p, leaf in leaves:
        _check_leaf(p, leaf)
    known = _plain_hashes(leaves)
    summaries = [_summary(leaf, known.get(i)) for i, (_, leaf) in enumerate(leaves)]
    tree = _sha(json.dumps(structure, ensure_ascii=False))
    facts = _Facts(backend.rank, os.urandom(16).hex(), os.path.abspath(root), tree, _sha("\n".join(summaries)), options)
    return facts, summaries, known


def _plain_hashes(leaves: Sequence[tuple[str, Any]]) -> dict[int, str]:
    """SHA-256 of each non-empty plain tensor's bytes (the same digest its writer records), in threads."""
    plain = [(i, leaf) for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.numel()]
    if not plain:
        return {}
    with hashing() as pool:
        futures = {i: pool.submit(sha256, t.detach().to("cpu")) for i, t in plain}
        return {i: f.result() for i, f in futures.items()}


def _summary(leaf: Any, sha: str | None) -> str:
    """A short description of a leaf that two ranks share only if they hold the same value."""
    if isinstance(leaf, ShardedArray):
        layout = _sha(json.dumps(leaf.layout.to_dict(), sort_keys=True))[:16]
        return f"array {str(leaf.dtype).removeprefix('torch.')} {tuple(leaf.shape)} layout {layout}"
    if isinstance(leaf, torch.Tensor):
        return f"tensor {str(leaf.dtype).removeprefix('torch.')} {tuple(leaf.shape)} sha256 {(sha or 'empty')[:32]}"
    text = repr(leaf)
    if len(text) > 60:
        text = f"{text[:40]}... (sha256 {_sha(text)[:16]})"
    return f"{type(leaf).__name__} {text}"


def check_same(
    backend: Backend,
    seen: Sequence[_Facts],
    summaries: list[str],
    leaves: Sequence[tuple[str, Any]],
    what: str = "fshard.save",
) -> None:
    """Raises the same ``CheckpointError`` on every rank if the ranks were given different saves.

    ``what`` names the call in the message.
    """
    first = seen[0]
    if any(f.path != first.path for f in seen):
        by = ", ".join(f"rank {f.rank}: {f.path}" for f in seen[:4]) + (", ..." if len(seen) > 4 else "")
        msg = (
            f"{what} was given different paths on different ranks ({by}): every rank must pass the same "
            "directory. Compute a timestamp or step in the path once and share it (for example with "
            "torch.distributed.broadcast_object_list from rank 0). Nothing was written."
        )
        raise CheckpointError(msg)
    if any(f.options != first.options for f in seen):
        odd = next(f for f in seen if f.options != first.options)
        msg = (
            f"{what} was given {odd.options} on rank {odd.rank} but {first.options} on rank {first.rank}: every "
            "rank must pass the same, since the ranks write the same files. Nothing was written."
        )
        raise CheckpointError(msg)
    if all(f.tree == first.tree and f.leaves == first.leaves for f in seen):
        return
    # Every rank saw the difference above, so every rank takes part in this second exchange.
    every = backend.exchange([(p, s) for (p, _), s in zip(leaves, summaries)])
    raise CheckpointError(_difference(seen, every, what))


def _difference(seen: Sequence[_Facts], every: list[list[tuple[str, str]]], what: str) -> str:
    """Names the first leaf where some rank's tree differs from the first rank's."""
    ours, head = every[0], f"rank {seen[0].rank}"
    for facts, theirs in zip(seen[1:], every[1:]):
        other = f"rank {facts.rank}"
        for k in range(max(len(ours), len(theirs))):
            a = ours[k] if k < len(ours) else None
            b = theirs[k] if k < len(theirs) else None
            if a == b:
                continue
            if a is None or b is None or a[0] != b[0]:
                return (
                    f"{what} was given trees of different structure: leaf {k} is "
                    f"{_place(a)} on {head} and {_place(b)} on {other}. Every rank must pass the same tree. "
                    "Nothing was written."
                )
            return _leaf_difference(a[0] or "the root", a[1], b[1], head, other)
        if facts.tree != seen[0].tree:
            msg = f"{what} was given trees of different structure on {head} and {other} (the same leaves, "
            return msg + "in different containers or under different keys). Nothing was written."
    return f"{what} was given different trees on different ranks. Nothing was written."  # pragma: no cover


def _place(entry: tuple[str, str] | None) -> str:
    return "missing" if entry is None else f"{entry[0] or 'the root'} ({entry[1].split(' ')[0]})"


def _leaf_difference(where: str, a: str, b: str, head: str, other: str) -> str:
    kind = a.split(" ")[0]
    said = f"{head} has {a}, {other} has {b}"
    if kind == "tensor" and b.split(" ")[0] == "tensor":
        return (
            f"Plain tensor at {where} differs between ranks ({said}). A plain tensor in a saved tree is one value "
            "that every rank holds, written by one rank, so the other ranks' values would be lost. Wrap per-rank "
            "state as arrays: fshard.from_local_tensor(t.unsqueeze(0)) holds one row per rank (dim=0 joins blocks "
            "of different lengths). Nothing was written."
        )
    if kind == "array":
        return (
            f"ShardedArray at {where} differs between ranks ({said}): every rank must pass the same arrays, "
            "with one layout and dtype. Nothing was written."
        )
    return (
        f"Leaf at {where} differs between ranks ({said}). A scalar (or plain tensor) is one value that every rank "
        "holds, saved once: give every rank the same value, or wrap per-rank values as arrays "
        "(fshard.from_local_tensor). Nothing was written."
    )
