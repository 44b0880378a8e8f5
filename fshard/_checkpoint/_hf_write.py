"""Writing Hugging Face safetensors files: which tensors go in which file, and each file's bytes.

Files are cut as ``huggingface_hub`` cuts them (tensors in order; a new file when the next
tensor would pass ``max_shard_size``; a tensor larger than that alone in its file), and
each file's tensors are laid out as the safetensors library lays them out (by dtype,
widest first, then by name), so a file fshard writes is byte for byte the one
``safetensors.torch.save_file`` writes for the same tensors.

Where each process writes its boxes is ``_hf_direct``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from fshard._checkpoint._detect import HF_SINGLE
from fshard._checkpoint._format import CODES
from fshard._errors import SpecError

__all__ = ["METADATA_KEY", "file_names", "header_bytes", "parse_size", "shard_files", "write_order"]

# The key of a safetensors header that holds the file's metadata, not a tensor.
METADATA_KEY = "__metadata__"


# The safetensors library orders a file's tensors by dtype, in this order, then by name.
_DTYPE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
                "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")  # fmt: skip


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any) -> int:
    """``max_shard_size`` in bytes: a positive int, or a str such as ``"5GB"`` (10**9) or ``"512MiB"`` (2**20).

    >>> parse_size("5GB"), parse_size("100KB"), parse_size("1.5MiB"), parse_size(1000)
    (5000000000, 100000, 1572864, 1000)
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = _UNITS.get((m[2] or "B").upper()) if m else None
    if m is None or unit is None or int(float(m[1]) * unit) <= 0:
        msg = f"max_shard_size={value!r}: give a positive int of bytes or a str such as '5GB', '100MB' or '512MiB'."
        raise SpecError(msg)
    return int(float(m[1]) * unit)


def shard_files(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """The tensors (indices into ``sizes``, in bytes) of each file, as ``huggingface_hub`` splits a state dict."""
    files: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if n > limit:
            files.append([i])
            continue
        if used + n > limit and current:
            files.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current or not files:
        files.append(current)
    return files


def file_names(n: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000n.safetensors``."""
    return [HF_SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def write_order(names: Sequence[str], dtypes: Sequence[torch.dtype]) -> list[int]:
    """The order of a file's tensors in its data section: by dtype as safetensors orders them, then by name."""
    return sorted(range(len(names)), key=lambda i: (_DTYPE_ORDER.index(CODES[dtypes[i]]), names[i]))


def header_bytes(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length prefix and JSON header of a file holding ``entries`` (name, dtype, shape) in data order."""
    header: dict[str, Any] = {METADATA_KEY: {"format": "pt"}}
    at = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return len(text).to_bytes(8, "little") + text
