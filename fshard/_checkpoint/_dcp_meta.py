"""A torch DCP folder's ``.metadata``, unpickled by the allow-list and checked into plain records.

DCP (``torch.distributed.checkpoint`` with its ``FileSystemWriter``) writes ``.metadata``
(a pickle of ``Metadata``: per entry its dtype, global shape and saved chunks, and per chunk
the file, offset and length of its bytes) beside ``__<rank>_<k>.distcp`` data files.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from fshard._checkpoint._dcp_pickle import Record, unpickle
from fshard._checkpoint._format import inside
from fshard._errors import CheckpointError, LayoutError
from fshard._layout.layout import Layout

__all__ = ["METADATA", "BytesEntry", "Chunk", "DcpMetadata", "TensorEntry", "read_metadata"]

METADATA = ".metadata"

# What a data file's name may be: one name inside the folder, never a path.
_FILE = re.compile(r"^[^/\\\x00]+$")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One saved box of a tensor and where its bytes are: ``length`` bytes at ``offset`` of ``file``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its name (DCP's flattened key), shape, dtype and saved chunks."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class BytesEntry:
    """A non-tensor entry (DCP pickles such objects with ``torch.save``): where its bytes are."""

    name: str
    file: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class DcpMetadata:
    """The checked content of ``.metadata``: entries in the order DCP listed them."""

    root: Path
    entries: tuple[TensorEntry | BytesEntry, ...]
    version: str | None

    @property
    def tensors(self) -> tuple[TensorEntry, ...]:
        return tuple(e for e in self.entries if isinstance(e, TensorEntry))


class _Bad(Exception):
    pass


def read_metadata(root: Path) -> DcpMetadata:
    """``root/.metadata``, unpickled through the allow-list and checked field by field.

    Raises:
        CheckpointError: no ``.metadata``, a name outside the allow-list, a malformed field (named),
            a chunk without storage, chunks that do not tile their tensor, or stored transforms.
    """
    where = root / METADATA
    try:
        inside(root, where)
        data = where.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist: {root} is not a torch DCP checkpoint.") from None
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be read: {exc.strerror or exc}.") from None
    md = unpickle(data, where)
    try:
        return _metadata(root, md)
    except _Bad as exc:
        raise CheckpointError(f"{where} is malformed: {exc}. The checkpoint metadata is damaged.") from None


def _metadata(root: Path, md: Any) -> DcpMetadata:
    _kind(md, "Metadata", "the pickled object")
    state = md.get("state_dict_metadata")
    storage = md.get("storage_data")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise _Bad("state_dict_metadata and storage_data must be dicts")
    places = _storage(cast("dict[Any, Any]", storage))
    entries = tuple(_entry(name, value, places) for name, value in cast("dict[Any, Any]", state).items())
    version = md.get("version")
    return DcpMetadata(root, entries, version if isinstance(version, str) else None)


def _kind(value: Any, kind: str, field: str) -> Record:
    if not isinstance(value, Record) or value.kind != kind:
        raise _Bad(f"{field} is {type(value).__name__}, expected DCP's {kind}")
    return value


def _ints(value: Any, field: str) -> tuple[int, ...]:
    items = cast("tuple[Any, ...]", value) if isinstance(value, tuple) else None
    if items is None or not all(type(v) is int and v >= 0 for v in items):
        raise _Bad(f"{field} is {value!r}, expected a torch.Size of non-negative ints")
    return items


def _storage(storage: dict[Any, Any]) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """``storage_data`` as (name, chunk offsets or None) -> (file, offset, length)."""
    out: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in storage.items():
        _kind(key, "MetadataIndex", "a storage_data key")
        name, offset = key.get("fqn"), key.get("offset")
        if not isinstance(name, str):
            raise _Bad(f"a storage_data key has fqn {name!r}, expected a string")
        where = f"storage_data[{name!r}]"
        at = None if offset is None else _ints(offset, f"{where}.offset")
        out[(name, at)] = _place(_kind(info, "_StorageInfo", where), where)
    return out


def _place(info: Record, where: str) -> tuple[str, int, int]:
    path, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    if not isinstance(path, str) or not _FILE.match(path) or path in (".", ".."):
        raise _Bad(f"{where}.relative_path is {path!r}, expected a file name inside the folder")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _Bad(f"{where} has offset {offset!r} and length {length!r}, expected non-negative ints")
    transforms = info.get("transform_descriptors")
    if transforms:
        msg = (
            f"{where} was stored through transforms {list(transforms)!r} (DCP's experimental stream "  # pyright: ignore[reportUnknownArgumentType]
            "extensions, e.g. compression), which fshard does not read: load it with torch.distributed."
            "checkpoint and save it again without extensions"
        )
        raise CheckpointError(msg)
    return path, offset, length


def _entry(name: Any, value: Any, places: dict[Any, tuple[str, int, int]]) -> TensorEntry | BytesEntry:
    if not isinstance(name, str):
        raise _Bad(f"state_dict_metadata has key {name!r}, expected a string")
    if isinstance(value, Record) and value.kind == "BytesStorageMetadata":
        if (name, None) not in places:
            raise _Bad(f"entry {name!r} (not a tensor) has no storage_data")
        return BytesEntry(name, *places[(name, None)])
    tensor = _kind(value, "TensorStorageMetadata", f"entry {name!r}")
    shape = _ints(tensor.get("size"), f"entry {name!r}.size")
    dtype = _dtype(tensor.get("properties"), name)
    chunks = tensor.get("chunks")
    if not isinstance(chunks, list):
        raise _Bad(f"entry {name!r}.chunks is {type(chunks).__name__}, expected a list")
    saved = tuple(_chunk(name, k, c, shape, places) for k, c in enumerate(cast("list[Any]", chunks)))
    entry = TensorEntry(name, shape, dtype, saved)
    _check_tiles(entry)
    return entry


def _check_tiles(entry: TensorEntry) -> None:
    """Refuses chunks that overlap, leave a gap or leave the shape: a load would return memory never written."""
    boxes = [c for c in entry.chunks if c.numel]
    try:
        Layout.from_arrays(
            entry.shape,
            [c.offsets for c in boxes] or np.zeros((0, len(entry.shape)), np.int64),
            [c.sizes for c in boxes] or np.zeros((0, len(entry.shape)), np.int64),
            np.zeros(len(boxes), np.int64),
        )
    except LayoutError as exc:
        raise _Bad(f"the chunks of entry {entry.name!r} do not tile its shape {entry.shape}: {exc}") from None


def _dtype(properties: Any, name: str) -> torch.dtype:
    props = _kind(properties, "TensorProperties", f"entry {name!r}.properties")
    state = props.state
    dtype = state[0] if isinstance(state, tuple) and state else props.get("dtype")  # pyright: ignore[reportUnknownVariableType]
    if not isinstance(dtype, torch.dtype):
        raise _Bad(f"entry {name!r} has dtype {dtype!r}, expected a torch dtype")
    return dtype


def _chunk(name: str, k: int, chunk: Any, shape: tuple[int, ...], places: dict[Any, Any]) -> Chunk:
    where = f"entry {name!r} chunk {k}"
    _kind(chunk, "ChunkStorageMetadata", where)
    offsets, sizes = _ints(chunk.get("offsets"), f"{where}.offsets"), _ints(chunk.get("sizes"), f"{where}.sizes")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise _Bad(f"{where} has offsets {offsets} and sizes {sizes} for a tensor of shape {shape}")
    if (name, offsets) not in places:
        raise _Bad(f"{where} (offsets {offsets}) has no storage_data")
    return Chunk(offsets, sizes, *places[(name, offsets)])
