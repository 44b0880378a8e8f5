"""Writing an fshard checkpoint tensor by tensor, block by block, from a function that reads the values.

``save_streamed`` writes what ``fshard.save`` writes for a tree of plain tensors and scalars
(one ``rank-00000.safetensors`` file, ``index.json`` committed atomically), but the tree's
tensors are placeholders (``meta`` tensors): their values come from ``read`` one block at a
time, each block written and hashed before the next is read. The safetensors header comes
first (every name, dtype and shape is known up front), so nothing is held but one block.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fshard._checkpoint._collective import progress_bar
from fshard._checkpoint._format import CODES, FORMAT, file_name, fsync
from fshard._checkpoint._lock import save_lock
from fshard._checkpoint._raw import byte_view, flat_bytes
from fshard._checkpoint._save import index_record
from fshard._checkpoint._tree import flatten
from fshard._checkpoint._write import Box, assign, check_root, commit
from fshard._errors import CheckpointError
from fshard.backends.local import LOCAL

__all__ = ["SafetensorsWriter", "blocks", "save_streamed"]

# Reads the box (lo, size) of leaf ``leaf`` into ``out``.
Read = Callable[[int, tuple[int, ...], tuple[int, ...], torch.Tensor], None]


class SafetensorsWriter:
    """One safetensors file written in order: the header at once, then each tensor's bytes as they come."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], meta: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": meta}
        self.sizes: list[int] = []
        at = 0
        for name, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            self.sizes.append(n)
            at += n
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.file = path, open(path, "wb")  # noqa: SIM115  (closed by close())
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.tensor, self.left = 0, self.sizes[0] if self.sizes else 0

    def write(self, block: torch.Tensor) -> None:
        """The next bytes of the current tensor (a block of it, row-major)."""
        data = flat_bytes(block.detach().to("cpu"))
        if data.numel() > self.left:
            raise CheckpointError(f"{self.path}: a block of {data.numel()} bytes overruns tensor {self.tensor}.")
        self.file.write(byte_view(data))
        self.left -= data.numel()
        while self.left == 0 and self.tensor + 1 < len(self.sizes):
            self.tensor += 1
            self.left = self.sizes[self.tensor]

    def close(self) -> int:
        """Flushes and fsyncs the file; returns its size."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.path.stat().st_size


def blocks(
    shape: tuple[int, ...], itemsize: int, budget: int | None
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of a tensor in row-major order, each one run of bytes of at most ``budget`` (``None``: the whole).

    >>> list(blocks((3, 4), 4, 32))
    [((0, 0), (2, 4)), ((2, 0), (1, 4))]
    """
    if budget is None or math.prod(shape) * itemsize <= budget or not shape:
        yield (0,) * len(shape), shape
        return
    # dim k: the first whose trailing slab fits, so that blocks are runs of indices of dim k
    k = next((d for d in range(len(shape)) if math.prod(shape[d + 1 :]) * itemsize <= budget), None)
    if k is None:  # convert() refuses such a budget before it writes; a caller of its own learns why here
        msg = f"A block budget of {budget} bytes is less than one element ({itemsize} bytes): give {itemsize} or more."
        raise CheckpointError(msg)
    slab = math.prod(shape[k + 1 :]) * itemsize
    rows = max(1, budget // slab)
    for outer in _indices(shape[:k]):
        for a in range(0, shape[k], rows):
            n = min(rows, shape[k] - a)
            yield (*outer, a, *(0,) * (len(shape) - k - 1)), (*(1,) * k, n, *shape[k + 1 :])


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def save_streamed(
    root: Path, tree: Any, read: Read, *, budget: int | None = None, progress: bool | None = None
) -> None:
    """Writes ``tree`` (dicts, lists, tuples of meta tensors and scalars) as an fshard checkpoint at ``root``.

    Leaf ``i``'s values come from ``read(i, lo, size, out)``, in blocks of at most ``budget`` bytes.

    Raises:
        CheckpointError: ``root`` is a file or a foreign directory, another save holds it, or writing failed.
    """
    leaves: list[tuple[str, Any]] = []
    structure = flatten(tree, "", leaves)
    boxes = assign(leaves, [0])
    token = uuid.uuid4().hex
    data = root / f"data.{token}"
    check_root(root, data.name)
    made = list(itertools.takewhile(lambda p: not p.exists(), (root, *root.parents)))  # this save makes these
    try:
        with save_lock(root):
            try:
                files = _write_data(data, leaves, boxes, read, budget, progress)
                commit(root, index_record(structure, leaves, boxes, files, data.name), token)
            except BaseException:
                shutil.rmtree(data, ignore_errors=True)
                raise
    except BaseException:
        for folder in made:  # those this save made, left empty: a failed save leaves nothing behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _write_data(
    data: Path, leaves: list[tuple[str, Any]], boxes: list[Box], read: Read, budget: int | None, progress: Any
) -> dict[str, dict[str, Any]]:
    data.mkdir(parents=True)
    target = data / file_name(0)
    entries = [(b.name, leaves[b.leaf][1].dtype, b.sizes) for b in boxes]
    total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
    writer = SafetensorsWriter(target, entries, {"format": FORMAT, "rank": "0"})
    hashes: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(writer.file.close)
        bar = stack.enter_context(progress_bar("fshard convert", total, progress, LOCAL))
        for box in boxes:
            dtype = leaves[box.leaf][1].dtype
            digest = hashlib.sha256()
            for lo, size in blocks(box.sizes, dtype.itemsize, budget):
                block = torch.empty(size, dtype=dtype)
                read(box.leaf, lo, size, block)
                writer.write(block)
                digest.update(byte_view(flat_bytes(block)))
                bar.update(block.nbytes)
                del block
            hashes[box.name] = digest.hexdigest()
        size = writer.close()
    fsync(data, directory=True)
    return {target.name: {"rank": 0, "bytes": size, "sha256": hashes}}
