"""Where a Hugging Face checkpoint's tensors are: one file, a folder with an index, or a folder of files.

Every header is read and checked (``_safetensors.read_header``) before any data. In an
indexed folder (``model.safetensors.index.json``), the ``weight_map`` names the file of
each tensor; it is untrusted input like the headers, so its file names must be plain
names of ``.safetensors`` files in the folder (no separators, no ``..``), and each
tensor must be in the file it names. A tensor of a listed file that the index leaves out
is read from that file (as ``transformers`` reads it), and refused if two files hold it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, TypeGuard

from fshard._checkpoint._detect import HF_INDEX, HF_SINGLE
from fshard._checkpoint._safetensors import MAX_HEADER, Entry, Header, read_header
from fshard._errors import CheckpointError

__all__ = ["Source", "catalog"]


_FILE_RE = re.compile(r"^[^/\\\x00]+\.safetensors$")


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint tensor: the header of its file and its entry there."""

    header: Header
    entry: Entry


def _is_dict(value: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(value, dict)


def catalog(root: Path, kind: str) -> dict[str, Source]:
    """Every tensor of the checkpoint at ``root`` by name (``kind``: ``"hf-file"`` or ``"hf-folder"``).

    Raises:
        CheckpointError: a file or the index is missing, malformed or lies (naming it), a tensor is in
            two files, or the index names a tensor that its file does not hold.
    """
    if kind == "hf-file":
        return _from_headers([read_header(root)])
    single = root / HF_SINGLE
    if single.is_file():  # first, as transformers' from_pretrained reads a folder (an index beside it: an older save's)
        return _from_headers([read_header(single)])
    index = root / HF_INDEX
    if index.exists():
        return _from_index(root, index)
    files = sorted(p for p in root.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        raise CheckpointError(f"{root} holds no .safetensors file and no {HF_INDEX}: it is no Hugging Face checkpoint.")
    return _from_headers([read_header(p) for p in files])


def _from_headers(headers: list[Header]) -> dict[str, Source]:
    out: dict[str, Source] = {}
    for h in headers:
        for e in h.entries:
            if e.name in out:
                msg = (
                    f"Tensor {e.name!r} is in both {out[e.name].header.path} and {h.path}: a folder without "
                    f"{HF_INDEX} must hold each tensor once. Remove the stray file, or add an index."
                )
                raise CheckpointError(msg)
            out[e.name] = Source(h, e)
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        raw = index.read_bytes() if index.stat().st_size <= MAX_HEADER else None
        if raw is None:
            raise CheckpointError(f"{index} is over {MAX_HEADER} bytes: it is no index that fshard reads.")
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{index} cannot be read: {exc.strerror or exc}.") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not valid JSON ({exc}).") from None
    weights = data.get("weight_map") if _is_dict(data) else None
    if not _is_dict(weights) or not all(isinstance(v, str) for v in weights.values()):
        raise CheckpointError(f"{index} has no 'weight_map' object of tensor name to file name.")
    for name, file in weights.items():
        if not _FILE_RE.match(file):
            msg = (
                f"{index} puts tensor {name!r} in {file!r}, which is not the plain name of a .safetensors file "
                "in the folder: an index names files beside it only."
            )
            raise CheckpointError(msg)
    return weights


def _from_index(root: Path, index: Path) -> dict[str, Source]:
    weights = _read_index(index)
    headers = {f: read_header(root / f) for f in sorted(set(weights.values()))}
    by_file = {f: {e.name: e for e in h.entries} for f, h in headers.items()}
    out: dict[str, Source] = {}
    for name, file in weights.items():
        entry = by_file[file].get(name)
        if entry is None:
            raise CheckpointError(f"{index} puts tensor {name!r} in {root / file}, which does not hold it.")
        out[name] = Source(headers[file], entry)
    # A tensor that a listed file holds but the index leaves out is read too, as transformers'
    # from_pretrained reads every tensor of the files an index lists.
    for file, header in headers.items():
        for e in header.entries:
            if e.name in weights:
                continue
            if e.name in out:
                msg = (
                    f"Tensor {e.name!r} is in both {out[e.name].header.path} and {root / file}, and {index} names "
                    "neither: add it to the index's weight_map, or remove it from one file."
                )
                raise CheckpointError(msg)
            out[e.name] = Source(header, e)
    return out
