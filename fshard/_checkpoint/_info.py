"""``fshard.checkpoint_info``: what a checkpoint holds, from its metadata alone (no tensor data is read)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from fshard._checkpoint._dcp_meta import BytesEntry, TensorEntry, read_metadata
from fshard._checkpoint._detect import checkpoint_kind
from fshard._checkpoint._format import Saved, checkpoint_path, human, read_index
from fshard._checkpoint._schema import saved_leaves
from fshard._checkpoint._sources import hf_files, open_source
from fshard._layout.layout import Layout, ShardMeta
from fshard._layout.placement import Placement

__all__ = ["checkpoint_info"]


def checkpoint_info(path: str | os.PathLike[str]) -> str:
    r"""A description of what a checkpoint holds: tree, shapes, dtypes, files and layout pictures.

    Reads only metadata: ``index.json`` of an fshard checkpoint, ``.metadata`` of a torch
    DCP folder (its chunks pictured on the ranks that wrote them), or the headers of a
    Hugging Face safetensors file or folder.

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
    kind = checkpoint_kind(root)
    if kind == "dcp":
        return _dcp_info(root)
    if kind in ("hf-file", "hf-folder"):
        return _hf_info(root)
    index, _ = read_index(root)
    saved = saved_leaves(root, index)
    total = sum(f["bytes"] for f in index["files"].values())
    files = len(index["files"])
    lines = [
        f"fshard checkpoint {root} (format {index['version']}): {_n(len(saved), 'leaf', 'leaves')}, {human(total)} "
        f"in {_n(files, 'file')}"
    ]
    for s in saved:
        lines.extend(_describe_leaf(s))
    lines.append("files: " + ", ".join(f"{k} ({human(v['bytes'])})" for k, v in index["files"].items()))
    return "\n".join(lines)


def _n(count: int, one: str, many: str = "") -> str:
    """``count`` and the noun: ``one`` for one, else ``many`` (``one`` + "s" by default)."""
    return f"{count} {one if count == 1 else many or one + 's'}"


def _describe_leaf(s: Saved) -> list[str]:
    if s.kind == "scalar":
        return [f"{s.where}: {type(s.value).__name__} = {s.value!r}"]
    dtype = str(s.dtype).removeprefix("torch.")
    head = f"{s.where}: {s.kind} {dtype} {s.shape}, {len(s.boxes)} box{'es' if len(s.boxes) != 1 else ''} written"
    if s.layout is None:
        return [head]
    return [head, *("  " + line for line in s.layout.visualize(width=24).splitlines())]


# DCP's data files: __<rank>_<k>.distcp, written by rank <rank>.
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


def _writer(file: str) -> int:
    m = _DISTCP.match(file)
    return int(m[1]) if m else 0


def _dcp_info(root: Path) -> str:
    md = read_metadata(root)
    files = sorted(
        {c.file for e in md.tensors for c in e.chunks} | {e.file for e in md.entries if isinstance(e, BytesEntry)}
    )
    sizes = {f: (root / f).stat().st_size if (root / f).is_file() else None for f in files}
    others = len(md.entries) - len(md.tensors)
    lines = [
        f"torch DCP checkpoint {root} (version {md.version}): {_n(len(md.tensors), 'tensor')} "
        f"({human(sum(e.nbytes for e in md.tensors))}) and {_n(others, 'other entry', 'other entries')} in "
        f"{_n(len(files), 'file')}"
    ]
    for e in md.entries:
        lines.extend(_dcp_entry(e))
    shown = {f: "missing" if n is None else human(n) for f, n in sizes.items()}
    lines.append("files: " + ", ".join(f"{f} ({shown[f]})" for f in files))
    missing = [f for f in files if sizes[f] is None]
    if missing:
        lines.append(f"missing: {', '.join(missing)} (the metadata names them; fshard.load of their tensors fails)")
    return "\n".join(lines)


def _dcp_entry(e: TensorEntry | BytesEntry) -> list[str]:
    if isinstance(e, BytesEntry):
        return [f"{e.name}: not a tensor ({e.length} bytes in {e.file}; fshard.load returns them raw)"]
    kept = [c for c in e.chunks if c.numel]
    files = sorted({c.file for c in kept})
    head = f"{e.name}: {str(e.dtype).removeprefix('torch.')} {e.shape}, {_n(len(kept), 'chunk')}"
    head += f" in {', '.join(files[:4])}{' ...' if len(files) > 4 else ''}" if files else " (no elements to store)"
    if not kept or len(e.shape) == 0:
        return [head]
    layout = Layout(e.shape, [ShardMeta(c.offsets, c.sizes, Placement(_writer(c.file))) for c in kept])
    return [head, *("  " + line for line in layout.visualize(width=24).splitlines())]


def _hf_info(root: Path) -> str:
    with contextlib.ExitStack() as stack:
        source = open_source(root, stack)
        where = [source.file_of(k) for k in range(len(source.items))]
    files = sorted(p.name for p in hf_files(root))  # a file of no tensors too (save_safetensors of {})
    total = sum(i.nbytes for i in source.items)
    tensors = _n(len(source.items), "tensor")
    lines = [f"Hugging Face safetensors {root}: {tensors} ({human(total)}) in {_n(len(files), 'file')}"]
    for item, file in sorted(zip(source.items, where), key=lambda pair: pair[0].name):
        lines.append(f"{item.name}: {str(item.dtype).removeprefix('torch.')} {item.shape} in {file}")
    return "\n".join(lines)
