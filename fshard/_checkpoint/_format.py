"""The on-disk format: names, dtype codes, hashing, fsync, and reading and checking ``index.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fshard._checkpoint._tree import _leaf_indices
from fshard._errors import CheckpointError, FShardError
from fshard._layout import Layout

__all__ = ["FORMAT", "VERSION", "INDEX", "PROGRESS_MIN_BYTES"]


FORMAT = "fshard-checkpoint"


VERSION = 1


INDEX = "index.json"


# Saves and loads that move at least this many bytes show a progress bar on a terminal.
PROGRESS_MIN_BYTES = 256 << 20


_DATA_RE = re.compile(r"^data\.[0-9a-f]{32}$")


_FILE_RE = re.compile(r"^rank-\d{5,}\.safetensors$")


_TMP_RE = re.compile(r"^index\.json\.[0-9a-f]{32}\.tmp$")


# torch dtype -> safetensors dtype code, for every dtype both sides know.
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


_DTYPES = {str(d).removeprefix("torch."): d for d in _CODES}


_SCALARS = (bool, int, float, str, type(None))


def _file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _box_text(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return ",".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes))


def _bytes_of(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy()


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


@contextlib.contextmanager
def _hashing() -> Iterator[ThreadPoolExecutor]:
    """Threads for SHA-256 (hashlib releases the GIL), so hashing overlaps writes, reads and copies."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="fshard-sha256") as pool:
        yield pool


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some platforms cannot fsync a directory; the rename is still atomic there
        if not directory:
            raise
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class _Saved:
    """One leaf of the index, checked."""

    path: str
    kind: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    layout: Layout | None = None
    boxes: tuple[dict[str, Any], ...] = ()
    value: Any = None

    @property
    def where(self) -> str:
        return self.path or "the root"


def _read_index(root: Path) -> dict[str, Any]:
    where = root / INDEX
    if not where.is_file():
        hint = " (an interrupted save leaves no index)" if root.is_dir() else ""
        raise CheckpointError(f"{where} does not exist{hint}: {root} is not an fshard checkpoint.")
    try:
        index = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc}); the checkpoint index is damaged.") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an fshard checkpoint index (no 'format': {FORMAT!r}).")
    if index.get("version") != VERSION:
        msg = f"{where} has format version {index.get('version')!r}; this fshard reads {VERSION}: upgrade fshard."
        raise CheckpointError(msg)
    if not _DATA_RE.match(str(index.get("data"))):
        raise CheckpointError(f"{where} names data directory {index.get('data')!r}, not 'data.<32 hex digits>'.")
    return index


def _saved_leaves(root: Path, index: dict[str, Any]) -> list[_Saved]:
    try:
        out = [_parse_leaf(r, index["files"]) for r in index["leaves"]]
        if sorted(_leaf_indices(index["tree"])) != list(range(len(out))):
            raise CheckpointError("its tree does not name each leaf exactly once")
    except (KeyError, TypeError, ValueError, AttributeError, FShardError) as exc:
        raise CheckpointError(f"{root / INDEX} is malformed: {exc!r}. The checkpoint index is damaged.") from exc
    return out


def _parse_leaf(record: dict[str, Any], files: dict[str, Any]) -> _Saved:
    kind, path = record["kind"], str(record["path"])
    if kind == "scalar":
        types = {"bool": bool, "int": int, "float": float, "str": str, "NoneType": type(None)}
        value = float(record["value"]) if record["type"] == "float" else record["value"]
        if not isinstance(value, types[record["type"]]):
            raise CheckpointError(f"scalar {path} holds {value!r}, not a {record['type']}")
        return _Saved(path, kind, value=value)
    if kind not in ("array", "tensor") or record["dtype"] not in _DTYPES:
        raise CheckpointError(f"leaf {path} has kind {kind!r} and dtype {record.get('dtype')!r}")
    shape = tuple(int(s) for s in record["shape"])
    layout = Layout.from_dict(record["layout"]) if kind == "array" else None
    for b in record["boxes"]:
        if b["file"] not in files or not _FILE_RE.match(b["file"]) or len(b["sha256"]) != 64:
            raise CheckpointError(f"leaf {path} has a box in unknown file {b['file']!r}")
    return _Saved(path, kind, _DTYPES[record["dtype"]], shape, layout, tuple(record["boxes"]))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover
