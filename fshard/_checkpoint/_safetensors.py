"""Safetensors files, strictly: every header checked in full before a byte of data is read.

A file is 8 bytes (little-endian ``N``), ``N`` bytes of JSON header, then the data
section. The header maps tensor names to ``{"dtype", "shape", "data_offsets"}``
(offsets into the data section) plus an optional ``"__metadata__"`` of strings.
``read_header`` refuses, with a ``CheckpointError`` naming the file and the tensor,
anything that the safetensors library itself refuses, and more: a header over
``MAX_HEADER`` bytes or past the end of the file, duplicate keys, unknown fields or
dtypes, an offset range outside the data section or overlapping another, a byte
count that is not ``prod(shape) * itemsize``, bytes that no tensor owns. Nothing is
allocated from a size the header gives until the header has passed these checks, so
every allocation is bounded by the file's real size.

Data is then read by byte ranges (``read_runs``): a box of a row-major tensor is a set
of contiguous runs, and only those runs are read, straight into the caller's buffer.
``counters`` counts the bytes read, for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, TypeGuard

import torch

from fshard._checkpoint._format import DTYPE_OF_CODE, unread_dtype
from fshard._errors import CheckpointError

__all__ = ["MAX_HEADER", "Entry", "Header", "ReadCounters", "counters", "read_header"]


# The safetensors library refuses larger headers (its MAX_HEADER_SIZE).
MAX_HEADER = 100_000_000


_FIELDS = {"dtype", "shape", "data_offsets"}


@dataclasses.dataclass
class ReadCounters:
    """What this process read from safetensors files: data bytes, read calls and header bytes."""

    bytes_read: int = 0
    reads: int = 0
    header_bytes: int = 0

    def reset(self) -> None:
        """Sets every counter back to zero."""
        self.bytes_read = self.reads = self.header_bytes = 0


counters = ReadCounters()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, dtype, shape and absolute byte range ``[begin, end)`` in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked header: the file, its size and identity when read, its tensors and metadata."""

    path: Path
    size: int
    identity: tuple[int, int, int]  # (st_dev, st_ino, st_mtime_ns): the file the header came from
    entries: tuple[Entry, ...]  # in header order
    metadata: tuple[tuple[str, str], ...]
    sample: bytes = b""  # a few runs of its data's bytes (``_sample``): files that differ there hold other data


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"Safetensors file {path}: {problem}.")


def read_header(path: Path) -> Header:
    """The checked header of the safetensors file ``path``.

    Raises:
        CheckpointError: the file is missing, unreadable, not a regular file, or its header
            is malformed, lies about the data, or is over ``MAX_HEADER`` bytes.
    """
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise _fail(path, "is not a regular file")
            size = info.st_size
            if size < 8:
                raise _fail(path, f"has {size} bytes, fewer than the 8 of a header length: it is truncated or empty")
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER:
                raise _fail(path, f"declares a header of {n} bytes, over the limit of {MAX_HEADER}: it is corrupt")
            if 8 + n > size:
                raise _fail(path, f"declares a header of {n} bytes but holds {size} bytes: it is truncated")
            raw = f.read(n)
            sample = _sample(f, 8 + n, size)
    except FileNotFoundError:
        raise _fail(path, "does not exist") from None
    except OSError as exc:
        raise _fail(path, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) != n:
        raise _fail(path, f"shrank while its header was read ({len(raw)} of {n} bytes)")
    counters.header_bytes += 8 + n + len(sample)
    entries, metadata = _parse(path, raw, 8 + n, size)
    return Header(path, size, (info.st_dev, info.st_ino, info.st_mtime_ns), entries, metadata, sample)


_SAMPLE = 64  # bytes of each run that ``_sample`` reads


def _sample(f: Any, begin: int, end: int) -> bytes:
    """The bytes of three runs of the data ``[begin, end)``: at its start, middle and end.

    Ranks compare them to tell two checkpoints whose headers are alike (the same model saved
    at two steps) apart, at three small reads per file.
    """
    out = b""
    for at in sorted({begin, max(begin, (begin + end) // 2 - _SAMPLE // 2), max(begin, end - _SAMPLE)}):
        f.seek(at)
        out += f.read(min(_SAMPLE, end - at))
    return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _is_dict(value: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(value, dict)


def _decode(path: Path, raw: bytes) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise _fail(path, "has a header that does not start with '{': it is not a safetensors file")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(path, f"has a header that is not valid JSON ({exc})") from None
    if not _is_dict(header):
        raise _fail(path, "has a header that is not a JSON object")
    return header


def _parse(path: Path, raw: bytes, start: int, size: int) -> tuple[tuple[Entry, ...], tuple[tuple[str, str], ...]]:
    header = _decode(path, raw)
    metadata = header.pop("__metadata__", {})
    if not _is_dict(metadata) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, f"has __metadata__ {str(metadata)[:80]}, not an object of strings")
    entries = tuple(_entry(path, name, info, start) for name, info in header.items())
    _check_tiling(path, entries, start, size)
    return entries, tuple(metadata.items())


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _counts(value: Any, n: int | None = None) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of non-negative ints (of length ``n``, if given)."""
    items: list[Any] = value if isinstance(value, list) else []  # pyright: ignore[reportUnknownVariableType]
    return isinstance(value, list) and (n is None or len(items) == n) and all(map(_is_count, items))


def _entry(path: Path, name: str, info: Any, start: int) -> Entry:
    where = f"tensor {name!r}"
    if not _is_dict(info) or set(info) != _FIELDS:
        got = sorted(info) if _is_dict(info) else type(info).__name__
        raise _fail(path, f"{where} is described by {got}, not exactly {sorted(_FIELDS)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in DTYPE_OF_CODE:
        raise _fail(path, f"{where} {unread_dtype(code)}")
    if not _counts(shape):
        raise _fail(path, f"{where} has shape {shape!r}, not a list of non-negative ints")
    if not _counts(offsets, 2):
        raise _fail(path, f"{where} has data_offsets {offsets!r}, not two non-negative ints")
    begin, end = offsets
    dtype, dims = DTYPE_OF_CODE[code], tuple(shape)
    if begin > end:
        raise _fail(path, f"{where} has data_offsets [{begin}, {end}], which end before they begin")
    want = math.prod(dims) * dtype.itemsize
    if end - begin != want:
        raise _fail(
            path, f"{where} is {code} of shape {list(dims)}: {want} bytes, but its data_offsets hold {end - begin}"
        )
    return Entry(name, dtype, dims, start + begin, start + end)


def _check_tiling(path: Path, entries: tuple[Entry, ...], start: int, size: int) -> None:
    """The tensors' ranges must tile the data section exactly: in order, no overlap, no gap, nothing after."""
    at, last = start, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < at:
            raise _fail(
                path, f"tensor {e.name!r} (bytes {e.begin - start} to {e.end - start}) overlaps tensor {last!r}"
            )
        if e.begin > at:
            raise _fail(
                path, f"bytes {at - start} to {e.begin - start} of the data belong to no tensor (before {e.name!r})"
            )
        at, last = e.end, e.name
    if at > size:
        raise _fail(path, f"tensor {last!r} ends at byte {at} but the file has {size} bytes: it is truncated")
    if at < size:
        raise _fail(path, f"holds {size - at} bytes after the last tensor's data: it is corrupt or was appended to")
