"""Reading boxes of tensors stored as raw bytes in files, with bounded memory.

A ``Stored`` tensor is a dense array at a known file offset: row-major, or row-major
after a permutation of its dims (``torch.save`` keeps a transposed tensor's strides),
its values possibly to be negated or conjugated as read (``torch.save`` keeps a
view's negative and conjugate bits and leaves its elements as they are).
``read_box`` copies one box of it into a destination tensor, reading only the byte
span of the box: straight into the destination when the box is one run of bytes and
the destination is contiguous CPU memory, else through buffers of at most ``BLOCK``
bytes. Files are read with ``os.pread``, never mapped, so the pages read are not
counted in this process's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, cast

import torch

from fshard._base.alloc import contiguous_strides
from fshard._checkpoint._format import DTYPE_OF_CODE, unread_dtype
from fshard._errors import CheckpointError

__all__ = [
    "BLOCK",
    "Files",
    "Stored",
    "byte_view",
    "flat_bytes",
    "read_box",
    "row_major_order",
    "safetensors_header",
    "safetensors_tensor",
    "stored_at",
]

# The largest buffer one read goes through when it cannot land in its destination directly.
BLOCK = 32 << 20


@dataclasses.dataclass(frozen=True)
class Stored:
    """A tensor of ``shape`` whose element 0 starts at byte ``start`` of ``path``.

    On disk it is the row-major array of shape ``disk_shape``: ``order`` lists the
    tensor's dims from the slowest-varying to the fastest. The tensor's values are
    those on disk negated where ``neg``, and conjugated where ``conj``.
    """

    path: Path
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    order: tuple[int, ...]
    neg: bool = False
    conj: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def disk_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.order)


def row_major_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dims of a dense tensor from slowest to fastest, or ``None`` when its strides leave gaps or overlap."""
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    step = 1
    for d in reversed(order):
        if shape[d] != 1:
            if stride[d] != step:
                return None
            step *= shape[d]
    return order


class Files:
    """Files opened for reading on first use, closed with the ``ExitStack`` given."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.fds: dict[Path, int] = {}
        stack.callback(self.close)

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"Checkpoint file {path} cannot be opened: {exc.strerror or exc}.") from None
        return self.fds[path]

    def size(self, path: Path) -> int:
        return os.fstat(self.fd(path)).st_size

    def read(self, path: Path, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (a ``CheckpointError`` if the file ends first)."""
        buf = bytearray(n)
        self.read_into(path, memoryview(buf), offset)
        return bytes(buf)

    def read_into(self, path: Path, out: memoryview, offset: int) -> None:
        fd, done = self.fd(path), 0
        while done < len(out):
            got = os.preadv(fd, [out[done:]], offset + done)
            if got <= 0:
                msg = (
                    f"Checkpoint file {path} ends at byte {offset + done}, but {len(out) - done} more bytes were "
                    "expected there: the file is truncated."
                )
                raise CheckpointError(msg)
            done += got

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order as one uint8 tensor (a view where ``t`` is contiguous)."""
    t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)  # a size-1 dim may have any stride: flattened by hand


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview (no copy)."""
    return memoryview(cast("Any", flat_bytes(t).numpy())).cast("B")


def read_box(files: Files, stored: Stored, lo: tuple[int, ...], size: tuple[int, ...], out: torch.Tensor) -> None:
    """Copies the box ``(lo, size)`` of ``stored`` (tensor coordinates) into ``out`` (a tensor of shape ``size``)."""
    if math.prod(size) == 0:
        return
    order = stored.order
    dest = out.permute(order) if order != tuple(range(len(order))) else out
    _read(files, stored, tuple(lo[d] for d in order), tuple(size[d] for d in order), dest)


def _span(shape: tuple[int, ...], lo: tuple[int, ...], size: tuple[int, ...]) -> tuple[int, int]:
    """(first element, elements to the last one inclusive) of a box of a row-major array."""
    strides = contiguous_strides(shape)
    first = sum(a * s for a, s in zip(lo, strides))
    last = sum((a + n - 1) * s for a, n, s in zip(lo, size, strides))
    return first, last - first + 1


def _read(files: Files, stored: Stored, lo: tuple[int, ...], size: tuple[int, ...], dest: torch.Tensor) -> None:
    """``read_box`` in disk coordinates: ``lo``, ``size`` and ``dest`` permuted to ``stored.order``."""
    item, shape = stored.dtype.itemsize, stored.disk_shape
    first, span = _span(shape, lo, size)
    at = stored.start + first * item
    if span == math.prod(size) and dest.is_contiguous() and dest.device.type == "cpu":
        files.read_into(stored.path, byte_view(dest), at)
        _resolve(stored, dest)
        return
    if span * item <= BLOCK or all(n == 1 for n in size):
        buf = torch.empty(span * item, dtype=torch.uint8)
        files.read_into(stored.path, byte_view(buf), at)
        strides = contiguous_strides(shape)
        dest.copy_(_resolve(stored, buf.view(stored.dtype).as_strided(size, strides)))
        return
    d = next(k for k, n in enumerate(size) if n > 1)  # split the slowest dim that has more than one index
    one = _span(shape, lo, (*size[:d], 1, *size[d + 1 :]))[1]
    step = contiguous_strides(shape)[d]
    # The most indices of dim d whose span fits BLOCK (fewer than all, or the span would have fit).
    rows = min(size[d] - 1, max(1, (BLOCK // item - one) // step + 1))
    for a in range(0, size[d], rows):
        n = min(rows, size[d] - a)
        sub_lo = (*lo[:d], lo[d] + a, *lo[d + 1 :])
        _read(files, stored, sub_lo, (*size[:d], n, *size[d + 1 :]), dest.narrow(d, a, n))


def _resolve(stored: Stored, values: torch.Tensor) -> torch.Tensor:
    """``values`` (CPU elements just read from ``stored``), negated and conjugated in place as ``stored`` says."""
    if stored.neg:
        values.neg_()
    if stored.conj:
        values.conj_physical_()
    return values


def stored_at(
    path: Path,
    start: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    order: Any = None,
    *,
    neg: bool = False,
    conj: bool = False,
) -> Stored:
    """A ``Stored`` row-major tensor (or in ``order``), its values negated where ``neg``, conjugated where ``conj``."""
    dims = tuple(range(len(shape))) if order is None else tuple(order)
    return Stored(path, start, dtype, shape, dims, neg, conj)


# A safetensors header larger than this is refused (the format's own reader caps it at 100 MB).
_MAX_HEADER = 100_000_000


def safetensors_header(files: Files, path: Path, at: int = 0) -> tuple[int, dict[str, Any]]:
    """(byte of ``path`` where the data starts, the parsed JSON header) of the safetensors file at byte ``at``.

    Nothing else is read. ``at`` is 0 but where the safetensors file is a part of
    ``path`` (DCP writes a rank's non-tensor entries before it).
    """
    size = files.size(path) - at
    where = str(path) if at == 0 else f"{path} at byte {at}"
    if size < 8:
        raise CheckpointError(f"{where} has {size} bytes: too short for a safetensors file.")
    n = int.from_bytes(files.read(path, at, 8), "little")
    if n > min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"{where} is not a safetensors file: its header length {n} exceeds the file.")
    try:
        header = json.loads(files.read(path, at + 8, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not a safetensors file: its header is no JSON ({exc}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where} is not a safetensors file: its header is no JSON object.")
    return at + 8 + n, cast("dict[str, Any]", header)


def safetensors_tensor(files: Files, path: Path, name: str, header: tuple[int, dict[str, Any]]) -> Stored:
    """Tensor ``name`` of a safetensors file whose ``safetensors_header`` is ``header``, checked against the file."""
    start, table = header
    rec = table.get(name)
    if not isinstance(rec, dict) or name == "__metadata__":
        raise CheckpointError(f"{path} holds no tensor {name!r}.")
    rec = cast("dict[str, Any]", rec)
    dtype, shape, span = DTYPE_OF_CODE.get(rec.get("dtype")), rec.get("shape"), rec.get("data_offsets")  # pyright: ignore[reportArgumentType]
    ok_shape = isinstance(shape, list) and all(type(v) is int and v >= 0 for v in cast("list[Any]", shape))
    ok_span = (
        isinstance(span, list)
        and len(cast("list[Any]", span)) == 2
        and all(type(v) is int for v in cast("list[Any]", span))
    )
    code = rec.get("dtype")
    if dtype is None and isinstance(code, str):  # a dtype that safetensors writes but fshard does not read
        raise CheckpointError(f"{path}: tensor {name!r} {unread_dtype(code)}.")
    if dtype is None or not ok_shape or not ok_span:
        raise CheckpointError(f"{path}: the header entry of tensor {name!r} is malformed: {rec!r:.200}.")
    shape_t, (a, b) = tuple(cast("list[int]", shape)), cast("list[int]", span)
    if b - a != math.prod(shape_t) * dtype.itemsize or not 0 <= a <= b or start + b > files.size(path):
        msg = (
            f"{path}: tensor {name!r} ({dtype}, {shape_t}) has data offsets [{a}, {b}] that do not fit it or the file."
        )
        raise CheckpointError(msg)
    return stored_at(path, start + a, dtype, shape_t)
