"""The tensors of a checkpoint in any of the three formats, read box by box: what ``fshard convert`` streams.

A source lists its tensors (name, shape, dtype) and reads any box of one into a given
tensor, straight from the files (``_raw.read_box``): an fshard checkpoint's saved boxes,
a DCP folder's chunks, a Hugging Face file's tensors. Nothing is held between reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._checkpoint._dcp_chunks import Locator
from fshard._checkpoint._dcp_meta import BytesEntry, TensorEntry, read_metadata
from fshard._checkpoint._detect import HF_INDEX, checkpoint_kind
from fshard._checkpoint._format import Saved, inside, read_index
from fshard._checkpoint._raw import Files, Stored, read_box, safetensors_header, safetensors_tensor
from fshard._checkpoint._schema import saved_leaves
from fshard._checkpoint._tree import unflatten
from fshard._errors import CheckpointError

__all__ = ["Item", "Source", "hf_files", "open_source"]


@dataclasses.dataclass(frozen=True)
class Item:
    """A tensor of a source: its name (dots between levels), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _overlap(
    lo: tuple[int, ...], size: tuple[int, ...], box_lo: tuple[int, ...], box_size: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    a = tuple(max(x, y) for x, y in zip(lo, box_lo))
    b = tuple(min(x + n, y + m) for x, n, y, m in zip(lo, size, box_lo, box_size))
    if any(p >= q for p, q in zip(a, b)):
        return None
    return a, tuple(q - p for p, q in zip(a, b))


def _copy_boxes(
    files: Files,
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    locate: Callable[[int], Stored],
    lo: tuple[int, ...],
    size: tuple[int, ...],
    out: torch.Tensor,
) -> None:
    """Fills ``out`` (the box ``lo``, ``size``) from the stored boxes it overlaps; box j is at ``locate(j)``."""
    for j, (box_lo, box_size) in enumerate(boxes):
        hit = _overlap(lo, size, box_lo, box_size)
        if hit is not None:
            at, n = hit
            dest = out[tuple(slice(a - o, a - o + k) for a, o, k in zip(at, lo, n))]
            read_box(files, locate(j), tuple(a - o for a, o in zip(at, box_lo)), n, dest)


class Source:
    """A checkpoint's tensors (``items``), readable box by box; ``others`` names what is not a tensor."""

    def __init__(self, root: Path, kind: str, stack: contextlib.ExitStack) -> None:
        self.root, self.kind, self.files = root, kind, Files(stack)
        self.items: list[Item] = []
        self.others: list[str] = []

    def read(self, k: int, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
        """Copies the box ``(lo, size)`` of tensor ``k`` into ``out``."""
        raise NotImplementedError

    def file_of(self, k: int) -> str:
        """The name of a file that holds (part of) tensor ``k``."""
        return ""

    def tree(self) -> tuple[Any, list[int]]:
        """The tree to write (tensors as ``meta`` placeholders), and the item of each of its tensor leaves.

        A flat dict of names here; an fshard source keeps its own tree and scalars.
        """
        tree = {i.name: torch.empty(i.shape, dtype=i.dtype, device="meta") for i in self.items}
        return tree, list(range(len(self.items)))


class _Dcp(Source):
    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        super().__init__(root, "dcp", stack)
        md = read_metadata(root)
        self.entries = md.tensors
        self.items = [Item(e.name, e.shape, e.dtype) for e in self.entries]
        self.others = [e.name for e in md.entries if isinstance(e, BytesEntry)]
        self.locator = Locator(root, self.files)
        self.located: dict[tuple[int, int], Stored] = {}

    def _stored(self, k: int, c: int) -> Stored:
        if (k, c) not in self.located:
            self.located[(k, c)] = self.locator.locate(self.entries[k], self.entries[k].chunks[c])
        return self.located[(k, c)]

    def read(self, k: int, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
        entry: TensorEntry = self.entries[k]
        kept = [c for c, ch in enumerate(entry.chunks) if ch.numel]
        boxes = [(entry.chunks[c].offsets, entry.chunks[c].sizes) for c in kept]
        _copy_boxes(self.files, boxes, lambda j: self._stored(k, kept[j]), lo, size, out)


def _dotted(node: dict[str, Any], prefix: str, out: dict[int, str]) -> None:
    """Each leaf's name: its keys and list positions joined by dots (``model.layers.0.w``)."""
    if "leaf" in node:
        out[node["leaf"]] = prefix or "value"
        return
    items: list[Any] = node["dict"] if "dict" in node else node["list" if "list" in node else "tuple"]
    for key, child in items if "dict" in node else enumerate(items):
        _dotted(child, f"{prefix}.{key}" if prefix else str(key), out)


class _Fshard(Source):
    def __init__(self, root: Path, stack: contextlib.ExitStack, verify: bool) -> None:
        super().__init__(root, "fshard", stack)
        self.index, _ = read_index(root)
        self.saved = saved_leaves(root, self.index)
        self.data = root / self.index["data"]
        inside(root, self.data)
        names: dict[int, str] = {}
        _dotted(self.index["tree"], "", names)
        self.leaf = [i for i, s in enumerate(self.saved) if s.kind != "scalar"]
        self.items = [Item(names[i], self.saved[i].shape, _dtype(self.saved[i])) for i in self.leaf]
        self.others = [names[i] for i, s in enumerate(self.saved) if s.kind == "scalar"]
        self.headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self.verify, self.verified = verify, set[int]()

    def _stored(self, box: dict[str, Any]) -> Stored:
        path = self.data / box["file"]
        inside(self.root, path)
        want = self.index["files"][box["file"]]["bytes"]
        if self.files.size(path) != want:
            raise CheckpointError(
                f"Checkpoint file {path} has {self.files.size(path)} bytes, index.json records {want}."
            )
        if path not in self.headers:
            self.headers[path] = safetensors_header(self.files, path)
        stored = safetensors_tensor(self.files, path, box["tensor"], self.headers[path])
        if stored.shape != tuple(box["sizes"]):
            raise CheckpointError(f"Checkpoint file {path}: tensor {box['tensor']!r} does not match index.json.")
        return stored

    def _check_hashes(self, saved: Saved) -> None:
        for box in saved.boxes:
            stored = self._stored(box)
            digest, at, end = hashlib.sha256(), stored.start, stored.start + stored.nbytes
            while at < end:
                n = min(16 << 20, end - at)
                digest.update(self.files.read(stored.path, at, n))
                at += n
            if digest.hexdigest() != box["sha256"]:
                msg = (
                    f"Checkpoint file {stored.path}: tensor {box['tensor']!r} does not match its sha256 in index.json."
                )
                raise CheckpointError(msg)

    def read(self, k: int, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
        saved = self.saved[self.leaf[k]]
        if self.verify and k not in self.verified:
            self._check_hashes(saved)
            self.verified.add(k)
        boxes = [(tuple[int, ...](b["offsets"]), tuple[int, ...](b["sizes"])) for b in saved.boxes]
        _copy_boxes(self.files, boxes, lambda j: self._stored(saved.boxes[j]), lo, size, out)

    def tree(self) -> tuple[Any, list[int]]:
        """The saved tree, each tensor a ``meta`` placeholder and each scalar as saved."""
        values = [
            s.value if s.kind == "scalar" else torch.empty(s.shape, dtype=_dtype(s), device="meta") for s in self.saved
        ]
        item = {leaf: k for k, leaf in enumerate(self.leaf)}
        return unflatten(self.index["tree"], values), [item.get(i, -1) for i in range(len(self.saved))]


def _dtype(saved: Saved) -> torch.dtype:
    assert saved.dtype is not None
    return saved.dtype


class _Hf(Source):
    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        super().__init__(root, "hf", stack)
        self.stored: list[Stored] = []
        for path in hf_files(root):
            header = safetensors_header(self.files, path)
            for name in header[1]:
                if name != "__metadata__":
                    self.stored.append(safetensors_tensor(self.files, path, name, header))
                    self.items.append(Item(name, self.stored[-1].shape, self.stored[-1].dtype))
        names = [i.name for i in self.items]
        if len(set(names)) != len(names):
            raise CheckpointError(
                f"{root} holds tensor names more than once: {sorted({n for n in names if names.count(n) > 1})[:3]}."
            )

    def read(self, k: int, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
        read_box(self.files, self.stored[k], lo, size, out)

    def file_of(self, k: int) -> str:
        return self.stored[k].path.name


def hf_files(root: Path) -> list[Path]:
    """The safetensors files of the Hugging Face checkpoint at ``root``: a file, or a folder (with an index or not)."""
    if root.is_file():
        return [root]
    index = root / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a Hugging Face index (no weight_map): {exc}.") from None
    else:
        names = sorted(p.name for p in root.iterdir() if p.suffix == ".safetensors")
    paths = [root / n for n in names]
    for p in paths:
        inside(root, p)
    return paths


def open_source(root: Path, stack: contextlib.ExitStack, *, verify: bool = True) -> Source:
    """The checkpoint at ``root`` as a ``Source`` (its files closed by ``stack``)."""
    kind = checkpoint_kind(root)
    if kind == "dcp":
        return _Dcp(root, stack)
    if kind in ("hf-file", "hf-folder"):
        return _Hf(root, stack)
    return _Fshard(root, stack, verify)
