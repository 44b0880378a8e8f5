"""``fshard.checkpoint_info``: what a checkpoint holds, from its index alone."""

from __future__ import annotations

import os

from fshard._checkpoint._format import Saved, checkpoint_path, human, read_index
from fshard._checkpoint._schema import saved_leaves

__all__ = ["checkpoint_info"]


def checkpoint_info(path: str | os.PathLike[str]) -> str:
    r"""A description of what a checkpoint holds: tree, shapes, dtypes, files and layout pictures.

    Reads only ``index.json``.

    Raises:
        TypeError: ``path`` is not a str or an ``os.PathLike``.
        CheckpointError: ``path`` holds no index, or one that is damaged, edited or
            malformed (naming the field), as ``load`` would.

    >>> import tempfile, torch, fshard
    >>> x = fshard.shard(torch.zeros(4, 6), fshard.Chunk(0, [0, 1]))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fshard.save(d, {"w": x, "lr": 0.1})
    ...     info = fshard.checkpoint_info(d)
    >>> print("\n".join(line for line in info.splitlines()[1:] if not line.startswith("  ")))  # without the pictures
    ['w']: array float32 (4, 6), 2 boxes written
    ['lr']: float = 0.1
    files: rank-00000.safetensors (...), rank-00001.safetensors (...)
    """
    root = checkpoint_path(path, "checkpoint_info()")
    index, _ = read_index(root)
    saved = saved_leaves(root, index)
    total = sum(f["bytes"] for f in index["files"].values())
    files = len(index["files"])
    lines = [
        f"fshard checkpoint {root} (format {index['version']}): {len(saved)} leaves, {human(total)} in {files} files"
    ]
    for s in saved:
        lines.extend(_describe_leaf(s))
    lines.append("files: " + ", ".join(f"{k} ({human(v['bytes'])})" for k, v in index["files"].items()))
    return "\n".join(lines)


def _describe_leaf(s: Saved) -> list[str]:
    if s.kind == "scalar":
        return [f"{s.where}: {type(s.value).__name__} = {s.value!r}"]
    dtype = str(s.dtype).removeprefix("torch.")
    head = f"{s.where}: {s.kind} {dtype} {s.shape}, {len(s.boxes)} box{'es' if len(s.boxes) != 1 else ''} written"
    if s.layout is None:
        return [head]
    return [head, *("  " + line for line in s.layout.visualize(width=24).splitlines())]
