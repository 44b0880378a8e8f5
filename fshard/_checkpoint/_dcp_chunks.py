"""Where a DCP chunk's elements are: inside the ``torch.save`` archive DCP wrote for it, or a safetensors file.

DCP's ``FileSystemWriter`` stores each chunk as one ``torch.save`` archive (an uncompressed
zip) at ``offset`` of its ``.distcp`` file, or, with ``SerializationFormat.SAFETENSORS``,
all of a rank's chunks as one safetensors file named by entry. ``locate`` finds the
chunk's raw elements without reading them: the archive's pickle is read by
``torch.load(..., map_location="meta", weights_only=True)`` (shape, strides, dtype,
negative and conjugate bits; torch's restricted unpickler, no data), its data record
by ``zipfile``. A chunk saved as a negated or conjugated view is stored unresolved,
with its bit: its values are resolved as they are read, as ``torch.load`` would.
"""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path
from typing import IO, Any, cast

import torch

from fshard._checkpoint._dcp_meta import Chunk, TensorEntry
from fshard._checkpoint._format import inside
from fshard._checkpoint._raw import Files, Stored, row_major_order, safetensors_header, safetensors_tensor, stored_at
from fshard._errors import CheckpointError

__all__ = ["Locator"]

_ZIP = b"PK\x03\x04"


class _Window(io.RawIOBase):
    """The bytes ``[start, start + length)`` of a file, as a seekable read-only file."""

    def __init__(self, files: Files, path: Path, start: int, length: int) -> None:
        super().__init__()
        self.files, self.path, self.start, self.length, self.pos = files, path, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        self.files.read_into(self.path, view[:n], self.start + self.pos)
        self.pos += n
        return n


class Locator:
    """Finds chunks' elements in the files of one DCP folder; remembers what it parsed."""

    def __init__(self, root: Path, files: Files) -> None:
        self.root, self.files = root, files
        self.headers: dict[tuple[Path, int], tuple[int, dict[str, Any]]] = {}

    def path(self, name: str) -> Path:
        path = self.root / name
        inside(self.root, path)
        return path

    def locate(self, entry: TensorEntry, chunk: Chunk) -> Stored:
        """The chunk's elements (a non-empty chunk), checked against its entry's dtype and the chunk's sizes."""
        path = self.path(chunk.file)
        end = chunk.offset + chunk.length
        if self.files.size(path) < end:
            msg = (
                f"DCP file {path} has {self.files.size(path)} bytes, but chunk {chunk.offsets} of {entry.name!r} "
                f"ends at byte {end}: the file is truncated."
            )
            raise CheckpointError(msg)
        if chunk.length >= 4 and self.files.read(path, chunk.offset, 4) == _ZIP:
            return self._archive(path, entry, chunk)
        return self._safetensors(path, entry, chunk)

    def _archive(self, path: Path, entry: TensorEntry, chunk: Chunk) -> Stored:
        where = f"DCP file {path}, chunk {chunk.offsets} of {entry.name!r} (bytes {chunk.offset}+{chunk.length})"
        window = _Window(self.files, path, chunk.offset, chunk.length)
        try:
            meta = torch.load(cast("IO[bytes]", window), map_location="meta", weights_only=True)
            window.seek(0)
            record, start = _data_record(zipfile.ZipFile(window), window, where)
        except CheckpointError:
            raise
        except Exception as exc:  # a damaged archive: zipfile's, pickle's and torch's many error types
            raise CheckpointError(
                f"{where} is not a readable torch.save archive: {type(exc).__name__}: {exc}."
            ) from None
        if type(meta) is not torch.Tensor or meta.layout != torch.strided:
            raise CheckpointError(f"{where} holds a {type(meta).__name__}, not a dense tensor.")
        if meta.dtype != entry.dtype or tuple(meta.shape) != chunk.sizes:
            got = f"{meta.dtype} of shape {tuple(meta.shape)}"
            msg = f"{where} holds {got}, the metadata records {entry.dtype} of shape {chunk.sizes}."
            raise CheckpointError(msg)
        order = row_major_order(tuple(meta.shape), tuple(meta.stride()))
        item = entry.dtype.itemsize
        if order is None or (meta.storage_offset() + chunk.numel) * item > record:
            raise CheckpointError(f"{where} stores its elements with strides {meta.stride()} that fshard cannot read.")
        if meta.is_neg() and not _negatable(entry.dtype):
            raise CheckpointError(f"{where} is a negated view of {entry.dtype}, which torch cannot negate.")
        at = chunk.offset + start + int(meta.storage_offset()) * item
        return stored_at(path, at, entry.dtype, chunk.sizes, order, neg=meta.is_neg(), conj=meta.is_conj())

    def _safetensors(self, path: Path, entry: TensorEntry, chunk: Chunk) -> Stored:
        key = (path, chunk.offset)  # where the rank's safetensors file starts, after its non-tensor entries
        if key not in self.headers:
            try:
                self.headers[key] = safetensors_header(self.files, path, chunk.offset)
            except CheckpointError as exc:  # no zip signature either: neither format's start
                why = str(exc).rpartition(": ")[2].rstrip(".")  # the reader's reason, without the path again
                msg = (
                    f"DCP file {path}, chunk {chunk.offsets} of {entry.name!r} (bytes {chunk.offset}+{chunk.length}), "
                    f"starts as neither a torch.save archive (a zip) nor a safetensors file ({why}): the file is "
                    "damaged. Save the checkpoint again, or restore the file."
                )
                raise CheckpointError(msg) from None
        header = self.headers[key]
        stored = safetensors_tensor(self.files, path, entry.name, header)
        if stored.dtype != entry.dtype or stored.shape != chunk.sizes:
            msg = (
                f"DCP file {path}: tensor {entry.name!r} is {stored.dtype} of shape {stored.shape}, the metadata "
                f"records {entry.dtype} {chunk.sizes} for chunk {chunk.offsets}."
            )
            raise CheckpointError(msg)
        return stored


def _negatable(dtype: torch.dtype) -> bool:
    """Whether torch has a negation for ``dtype`` (not for bool, float8 or the wide unsigned integers)."""
    try:
        torch.zeros(1, dtype=dtype).neg_()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _data_record(archive: zipfile.ZipFile, window: _Window, where: str) -> tuple[int, int]:
    """(size, start in the window) of the archive's one storage record, checked uncompressed and little-endian."""
    infos = archive.infolist()
    data = [i for i in infos if "/data/" in i.filename and not i.filename.endswith("/")]
    order = [i for i in infos if i.filename.endswith("/byteorder")]
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{where} does not hold one uncompressed storage record: {[i.filename for i in data]}.")
    if order and archive.read(order[0]).decode("ascii", "replace") != sys.byteorder:
        raise CheckpointError(f"{where} was written on a {archive.read(order[0])!r}-endian machine; this one is not.")
    info = data[0]
    window.seek(info.header_offset)
    head = window.read(30)
    if len(head) != 30 or head[:4] != _ZIP:
        raise CheckpointError(f"{where}: the zip entry {info.filename} has no local header.")
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    if start + info.file_size > window.length:
        raise CheckpointError(f"{where}: the storage record runs past the chunk's bytes.")
    return info.file_size, start
